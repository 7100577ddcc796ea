"""own-dc adapter specifics, against sushy-tools' Redfish emulator: allocation,
PXE + reset on create, reset type choice, power off on delete, BMC errors."""

from __future__ import annotations

import json

import pytest

from fleet.config import Account
from fleet.errors import BadCredentials, InvalidRequest, NoCapacity, NotFound, Transient
from providers.own_dc import REBOOT_TYPES, OwnDcProvider, choose_reset_type
from tests.providers.fault_proxy import Reply
from tests.ports import free_port
from tests.providers.harness_own_dc import CREDENTIALS_ENV, SYSTEMS, OwnDcHarness


def sent(harness: OwnDcHarness, method: str, suffix: str = "") -> list[dict]:
    return [
        json.loads(r.body) if r.body else {}
        for r in harness.proxy.requests
        if r.method == method and r.path.endswith(suffix)
    ]


def rewrite_system(change):
    """A proxy rule passing the next GET of a system through ``change(system_json)``."""

    def rule(request):
        if request.method != "GET" or "/redfish/v1/Systems/" not in request.path or "/Actions/" in request.path:
            return None

        def transform(reply: Reply) -> Reply:
            system = json.loads(reply.body)
            change(system)
            return Reply(reply.status, json.dumps(system).encode(), reply.headers)

        return transform

    return rule


def powered_on_allowing(*values: str):
    """Next system GET: powered on, and only ``values`` allowed for reset."""

    def change(system: dict) -> None:
        system["PowerState"] = "On"
        system["Actions"]["#ComputerSystem.Reset"]["ResetType@Redfish.AllowableValues"] = list(values)

    return rewrite_system(change)


@pytest.mark.parametrize(
    ("allowed", "expected"),
    [
        (["On", "ForceOff", "GracefulRestart", "ForceRestart", "PowerCycle"], "ForceRestart"),
        (["On", "PowerCycle", "GracefulRestart"], "PowerCycle"),
        (["On", "GracefulRestart"], "GracefulRestart"),
        (["On", "ForceOff"], None),
        (None, "ForceRestart"),
    ],
)
def test_choose_reset_type(allowed: list[str] | None, expected: str | None) -> None:
    assert choose_reset_type(allowed, REBOOT_TYPES) == expected


def test_create_allocates_sets_pxe_once_and_powers_on(own_dc_harness: OwnDcHarness) -> None:
    # Emulated power changes land 1-11 s later, so an earlier test may have left it on.
    own_dc_harness.proxy.once(rewrite_system(lambda s: s.update(PowerState="Off")))
    machine = own_dc_harness.provider.create_machine(own_dc_harness.spec, "k1")
    assert machine.id == SYSTEMS[0]["name"] and machine.state == "pending"
    patch = sent(own_dc_harness, "PATCH")
    assert patch == [{"Boot": {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}}]
    assert sent(own_dc_harness, "POST", "/ComputerSystem.Reset") == [{"ResetType": "On"}]
    allocation = own_dc_harness.allocations()[machine.id]
    assert (allocation["key"], allocation["name"], allocation["status"]) == (
        "k1",
        own_dc_harness.spec.name,
        "allocated",
    )


def test_create_restarts_a_machine_that_is_already_on(own_dc_harness: OwnDcHarness) -> None:
    own_dc_harness.proxy.once(rewrite_system(lambda s: s.update(PowerState="On")))
    own_dc_harness.provider.create_machine(own_dc_harness.spec, "k1")
    assert sent(own_dc_harness, "POST", "/ComputerSystem.Reset") == [{"ResetType": "ForceRestart"}]


def test_pool_exhaustion_and_return(own_dc_harness: OwnDcHarness) -> None:
    provider, spec = own_dc_harness.provider, own_dc_harness.spec
    ids = [provider.create_machine(spec.model_copy(update={"name": f"n{i}"}), f"k{i}").id for i in range(3)]
    assert sorted(ids) == sorted(s["name"] for s in SYSTEMS)
    assert not provider.list_offers()[0].available
    with pytest.raises(NoCapacity) as caught:
        provider.create_machine(spec, "k-extra")
    assert caught.value.code == "pool-exhausted"
    provider.delete_machine(ids[1])
    assert provider.list_offers()[0].available
    assert provider.create_machine(spec, "k-extra").id == ids[1]


def test_two_sites_share_the_pool_without_double_allocation(own_dc_harness: OwnDcHarness) -> None:
    other_site = own_dc_harness.site.model_copy(update={"name": "dc-fra-other"})
    other = OwnDcProvider(other_site, own_dc_harness.account)
    a = own_dc_harness.provider.create_machine(own_dc_harness.spec, "k1")
    b = other.create_machine(own_dc_harness.spec.model_copy(update={"site": "dc-fra-other"}), "k2")
    assert a.id != b.id
    assert [m.id for m in own_dc_harness.provider.list_machines()] == [a.id]
    assert [m.id for m in other.list_machines()] == [b.id]


def test_reboot_uses_force_restart(own_dc_harness: OwnDcHarness) -> None:
    machine = own_dc_harness.provider.create_machine(own_dc_harness.spec, "k1")
    own_dc_harness.proxy.reset()
    own_dc_harness.proxy.once(rewrite_system(lambda s: s.update(PowerState="On")))
    own_dc_harness.provider.reboot_machine(machine.id)
    assert sent(own_dc_harness, "POST", "/ComputerSystem.Reset") == [{"ResetType": "ForceRestart"}]


def test_reboot_with_no_usable_reset_type_is_invalid_request(own_dc_harness: OwnDcHarness) -> None:
    machine = own_dc_harness.provider.create_machine(own_dc_harness.spec, "k1")
    own_dc_harness.proxy.reset()
    own_dc_harness.proxy.once(powered_on_allowing("On", "ForceOff", "Nmi"))
    with pytest.raises(InvalidRequest) as caught:
        own_dc_harness.provider.reboot_machine(machine.id)
    assert caught.value.code == "ResetTypeNotAllowed"
    assert sent(own_dc_harness, "POST") == []


def test_reset_type_the_bmc_rejects_is_invalid_request(own_dc_harness: OwnDcHarness) -> None:
    """The BMC advertises PowerCycle only; the emulator really answers 501 to it."""
    machine = own_dc_harness.provider.create_machine(own_dc_harness.spec, "k1")
    own_dc_harness.proxy.reset()
    own_dc_harness.proxy.once(powered_on_allowing("On", "PowerCycle"))
    with pytest.raises(InvalidRequest) as caught:
        own_dc_harness.provider.reboot_machine(machine.id)
    assert caught.value.code.startswith("HTTP 501")
    assert sent(own_dc_harness, "POST", "/ComputerSystem.Reset") == [{"ResetType": "PowerCycle"}]


def test_reinstall_is_pxe_once_then_reset(own_dc_harness: OwnDcHarness) -> None:
    machine = own_dc_harness.provider.create_machine(own_dc_harness.spec, "k1")
    own_dc_harness.proxy.reset()
    own_dc_harness.proxy.once(rewrite_system(lambda s: s.update(PowerState="On")))
    own_dc_harness.provider.reinstall_machine(machine.id)
    assert sent(own_dc_harness, "PATCH") == [
        {"Boot": {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}}
    ]
    assert sent(own_dc_harness, "POST", "/ComputerSystem.Reset") == [{"ResetType": "ForceRestart"}]


def test_reinstall_without_pxe_is_invalid_request(own_dc_harness: OwnDcHarness) -> None:
    machine = own_dc_harness.provider.create_machine(own_dc_harness.spec, "k1")
    own_dc_harness.proxy.once(
        rewrite_system(lambda s: s["Boot"].update({"BootSourceOverrideTarget@Redfish.AllowableValues": ["Hdd"]}))
    )
    with pytest.raises(InvalidRequest):
        own_dc_harness.provider.reinstall_machine(machine.id)


def test_delete_powers_off_and_returns_to_pool(own_dc_harness: OwnDcHarness) -> None:
    machine = own_dc_harness.provider.create_machine(own_dc_harness.spec, "k1")
    own_dc_harness.proxy.reset()
    own_dc_harness.proxy.once(rewrite_system(lambda s: s.update(PowerState="On")))
    own_dc_harness.provider.delete_machine(machine.id)
    assert sent(own_dc_harness, "POST", "/ComputerSystem.Reset") == [{"ResetType": "ForceOff"}]
    assert own_dc_harness.allocations() == {}
    with pytest.raises(NotFound):
        own_dc_harness.provider.get_machine(machine.id)


def test_failed_power_off_keeps_the_allocation(own_dc_harness: OwnDcHarness) -> None:
    machine = own_dc_harness.provider.create_machine(own_dc_harness.spec, "k1")
    own_dc_harness.fail_next_create("Transient")  # the BMC is busy
    with pytest.raises(Transient):
        own_dc_harness.provider.delete_machine(machine.id)
    assert machine.id in own_dc_harness.allocations()


def test_wrong_bmc_password_is_a_real_401(own_dc_harness: OwnDcHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CREDENTIALS_ENV, "gpufleet:not-the-password")
    with pytest.raises(BadCredentials) as caught:
        own_dc_harness.provider.create_machine(own_dc_harness.spec, "k1")
    assert caught.value.code.startswith("HTTP 401")
    assert own_dc_harness.allocations() == {}


def test_missing_credentials_fail_before_any_call(
    own_dc_harness: OwnDcHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CREDENTIALS_ENV)
    with pytest.raises(BadCredentials, match=CREDENTIALS_ENV):
        own_dc_harness.provider.create_machine(own_dc_harness.spec, "k1")
    assert own_dc_harness.proxy.requests == []
    assert own_dc_harness.allocations() == {}


def test_unreachable_bmc_is_transient_and_releases(own_dc_harness: OwnDcHarness) -> None:
    options = {
        **own_dc_harness.account.options,
        "machines": [{"name": "dead", "bmc_url": f"http://127.0.0.1:{free_port()}", "system_id": "1"}],
    }
    provider = OwnDcProvider(own_dc_harness.site, own_dc_harness.account.model_copy(update={"options": options}))
    with pytest.raises(Transient):
        provider.create_machine(own_dc_harness.spec, "k1")
    assert own_dc_harness.allocations() == {}


def test_system_id_is_discovered_when_the_bmc_has_one_system(own_dc_harness: OwnDcHarness) -> None:
    options = {
        **own_dc_harness.account.options,
        "machines": [{"name": "solo", "bmc_url": own_dc_harness.proxy.url}],
    }
    provider = OwnDcProvider(own_dc_harness.site, own_dc_harness.account.model_copy(update={"options": options}))
    with pytest.raises(InvalidRequest) as caught:  # the emulator manages three systems
        provider.create_machine(own_dc_harness.spec, "k1")
    assert caught.value.code == "config/system_id"

    def one_member(request):
        if request.method == "GET" and request.path.rstrip("/") == "/redfish/v1/Systems":
            return lambda reply: Reply(
                200,
                json.dumps({"Members": [{"@odata.id": f"/redfish/v1/Systems/{SYSTEMS[2]['uuid']}"}]}).encode(),
                reply.headers,
            )
        return None

    own_dc_harness.proxy.once(one_member)
    machine = provider.create_machine(own_dc_harness.spec, "k2")
    assert machine.id == "solo"
    assert any(
        r.path.endswith(f"{SYSTEMS[2]['uuid']}/Actions/ComputerSystem.Reset") for r in own_dc_harness.proxy.requests
    )


def test_bad_inventory_is_invalid_request(own_dc_harness: OwnDcHarness) -> None:
    account = Account(name="dc", provider="own-dc", options={"machines": [{"name": "no-bmc"}]})
    with pytest.raises(InvalidRequest):
        OwnDcProvider(own_dc_harness.site, account)


def test_machine_outside_the_inventory_is_not_found(own_dc_harness: OwnDcHarness) -> None:
    with pytest.raises(NotFound):
        own_dc_harness.provider.reboot_machine("rack9-node99")
    with pytest.raises(NotFound):
        own_dc_harness.provider.reinstall_machine(SYSTEMS[0]["name"])  # in the pool, not allocated
