"""The Hetzner adapter against a local Hetzner API speaking the real JSON."""

from __future__ import annotations

import socket

import pytest

from fleet.errors import (
    BadCredentials,
    InvalidRequest,
    NoCapacity,
    NotFound,
    OverQuota,
    ProviderError,
    Transient,
)
from fleet.models import Machine, Offer
from providers.base import Provider
from providers.hetzner import ERRORS, HTTP_STATUS_ERRORS, SITE_LABEL, HetznerProvider, classify
from tests.providers.fake_hetzner import ERROR_BODIES, FakeHetzner
from tests.providers.harness_hetzner import (
    TOKEN_ENV,
    HetznerHarness,
    default_server_types,
    make_account,
    make_site,
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_is_a_provider(hetzner_harness: HetznerHarness) -> None:
    assert isinstance(hetzner_harness.provider, Provider)
    assert hetzner_harness.provider.name == "hetzner"


def test_constructor_does_no_io_and_missing_token_fails_before_any_call(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeHetzner("unused", default_server_types()).start()
    try:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        provider = HetznerProvider(make_site(), make_account(fake.url))
        assert fake.requests == []
        with pytest.raises(BadCredentials, match=f"env:{TOKEN_ENV}") as info:
            provider.list_machines()
        assert info.value.provider == "hetzner"
        assert fake.requests == []
    finally:
        fake.stop()


def test_full_cycle_never_leaks_the_token(hetzner_harness: HetznerHarness) -> None:
    h = hetzner_harness
    provider, fake = h.provider, h.fake
    returned: list[Machine | Offer] = []

    machine = provider.create_machine(h.spec, "key-1")
    returned.append(machine)
    assert machine.name == h.spec.name and machine.site == "hetzner-fsn1" and machine.provider == "hetzner"
    assert machine.id == str(fake.live_servers()[0]["id"])
    assert machine.instance_type == h.spec.instance_type
    assert fake.live_servers()[0]["labels"][SITE_LABEL] == "hetzner-fsn1"
    assert fake.live_servers()[0]["labels"]["gpufleet.io/pool"] == "default"

    got = provider.get_machine(machine.id)
    returned.append(got)
    assert got.id == machine.id and got.state == "running" and got.created_at is not None

    listed = provider.list_machines()
    returned.extend(listed)
    assert [m.id for m in listed] == [machine.id]

    provider.reboot_machine(machine.id)
    assert fake.resets == {int(machine.id): 1}
    assert fake.count("POST", f"/v1/servers/{machine.id}/actions/reboot") == 0  # soft reboot never used

    provider.reinstall_machine(machine.id)
    assert fake.rebuilds == {int(machine.id): [161547269]}  # the server's own image, by id
    assert provider.get_machine(machine.id).id == machine.id

    returned.extend(provider.list_offers())

    provider.delete_machine(machine.id)
    assert h.machine_count() == 0
    with pytest.raises(NotFound):
        provider.get_machine(machine.id)
    provider.delete_machine(machine.id)  # gone already: still fine

    for model in returned:
        dumped = model.model_dump_json()
        assert h.token not in dumped
        assert "Secr3tRootPw" not in dumped  # Hetzner's root password from create never travels


def test_token_is_sent_as_bearer_and_read_at_call_time(
    hetzner_harness: HetznerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = hetzner_harness
    h.provider.list_machines()
    monkeypatch.setenv(TOKEN_ENV, "rotated-but-wrong")
    with pytest.raises(BadCredentials) as info:
        h.provider.list_machines()
    assert info.value.code == "unauthorized"


def test_create_twice_with_same_key_makes_one_server(hetzner_harness: HetznerHarness) -> None:
    h = hetzner_harness
    first = h.provider.create_machine(h.spec, "key-1")
    second = h.provider.create_machine(h.spec, "key-1")
    assert first.id == second.id
    assert h.machine_count() == 1
    assert h.fake.count("POST", "/v1/servers") == 1


def test_uniqueness_error_from_a_lost_race_returns_the_existing_server(hetzner_harness: HetznerHarness) -> None:
    h = hetzner_harness
    first = h.provider.create_machine(h.spec, "key-1")
    # The name lookup misses (the other create had not landed yet); POST then says uniqueness_error.
    empty = {"servers": [], "meta": {"pagination": {"page": 1, "per_page": 50, "previous_page": None,
                                                    "next_page": None, "last_page": 1, "total_entries": 0}}}
    h.fake.answer_next("GET /servers", 200, empty)
    again = h.provider.create_machine(h.spec, "key-1")
    assert again.id == first.id
    assert h.machine_count() == 1
    assert h.fake.count("POST", "/v1/servers") == 2


def test_same_name_owned_by_another_site_is_refused(hetzner_harness: HetznerHarness) -> None:
    h = hetzner_harness
    other = HetznerProvider(make_site(name="hetzner-other"), make_account(h.fake.url))
    other.create_machine(h.spec.model_copy(update={"site": "hetzner-other"}), "k-other")
    with pytest.raises(InvalidRequest, match="already exists"):
        h.provider.create_machine(h.spec, "key-1")
    assert h.provider.list_machines() == []
    assert len(other.list_machines()) == 1


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("NoCapacity", NoCapacity),
        ("OverQuota", OverQuota),
        ("BadCredentials", BadCredentials),
        ("Transient", Transient),
        ("InvalidRequest", InvalidRequest),
        ("NoSpace", NoCapacity),
        ("Maintenance", Transient),
        ("Locked", Transient),
        ("Protected", InvalidRequest),
        ("Unknown", Transient),
    ],
)
def test_real_error_bodies_map_to_the_taxonomy(
    hetzner_harness: HetznerHarness, kind: str, expected: type[ProviderError]
) -> None:
    h = hetzner_harness
    h.fail_next_create(kind)
    with pytest.raises(expected) as info:
        h.provider.create_machine(h.spec, "key-1")
    code = ERROR_BODIES[kind][1]
    assert type(info.value) is expected
    assert info.value.provider == "hetzner"
    assert info.value.code == code
    assert code in str(info.value)
    # The SDK's own retry loop is off: one POST, none sent again after a backoff.
    assert h.fake.count("POST", "/v1/servers") == 1
    assert h.machine_count() == 0
    # The error was for that one call only.
    assert h.provider.create_machine(h.spec, "key-1").name == h.spec.name


def test_placement_failure_from_the_fake_itself_is_no_capacity(hetzner_harness: HetznerHarness) -> None:
    h = hetzner_harness
    spec = h.spec.model_copy(update={"region": "nbg1"})  # listed there, but not available
    with pytest.raises(NoCapacity):
        h.provider.create_machine(spec, "key-1")


def test_unknown_server_type_is_invalid_request(hetzner_harness: HetznerHarness) -> None:
    h = hetzner_harness
    with pytest.raises(InvalidRequest) as info:
        h.provider.create_machine(h.spec.model_copy(update={"instance_type": "nope"}), "key-1")
    assert info.value.code == "invalid_input"


def test_a_failed_action_is_classified_by_its_error_code(hetzner_harness: HetznerHarness) -> None:
    h = hetzner_harness
    machine = h.provider.create_machine(h.spec, "key-1")
    h.fake.fail_next_action("locked", "server is locked by another action")
    with pytest.raises(Transient) as info:
        h.provider.reboot_machine(machine.id)
    assert info.value.code == "locked"
    h.fake.fail_next_action("image_unavailable", "image is not available")
    with pytest.raises(Transient) as unknown:
        h.provider.reinstall_machine(machine.id)
    assert unknown.value.code == "image_unavailable"  # unknown code: Transient, raw code kept


def test_action_wait_is_bounded(hetzner_harness: HetznerHarness) -> None:
    h = hetzner_harness
    provider = HetznerProvider(make_site(), make_account(h.fake.url, action_wait_s=0.2, poll_interval_s=0.05))
    machine = provider.create_machine(h.spec, "key-1")
    h.fake.hold_actions = True
    with pytest.raises(Transient) as info:
        provider.reboot_machine(machine.id)
    assert info.value.code == "action_timeout"
    # Bounded by action_wait_s: at most action_wait_s / poll_interval_s looks at the action, then given up.
    looks = [path for method, path in h.fake.requests if method == "GET" and path.startswith("/v1/actions/")]
    assert 1 <= len(looks) <= 4, looks


def test_error_tables_are_data_and_cover_the_brief() -> None:
    assert all(issubclass(cls, ProviderError) for cls in ERRORS.values())
    assert all(issubclass(cls, ProviderError) for cls in HTTP_STATUS_ERRORS.values())
    expected = {
        NoCapacity: {"resource_unavailable", "placement_error", "no_space_left_in_location"},
        OverQuota: {"resource_limit_exceeded"},
        BadCredentials: {"unauthorized", "forbidden", "token_readonly"},
        Transient: {"rate_limit_exceeded", "conflict", "locked", "server_error", "service_error",
                    "maintenance", "timeout", "bad_gateway"},
        InvalidRequest: {"invalid_input", "uniqueness_error", "protected", "invalid_server_type"},
        NotFound: {"not_found"},
    }
    for cls, codes in expected.items():
        for code in codes:
            assert ERRORS[code] is cls, code


def test_bodies_without_json_classify_by_http_status() -> None:
    assert isinstance(classify(401, "Unauthorized"), BadCredentials)
    assert isinstance(classify(502, "Bad Gateway"), Transient)
    # A bare 404 (wrong endpoint, proxy) must not read as "server gone".
    not_json_404 = classify(404, "Not Found")
    assert type(not_json_404) is Transient and not_json_404.code == "404"


def test_unreachable_api_is_transient(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "t")
    provider = HetznerProvider(make_site(), make_account(f"http://127.0.0.1:{_free_port()}/v1"))
    with pytest.raises(Transient) as info:
        provider.get_machine("42")
    assert info.value.code == "connection_error"


def test_unknown_ids(hetzner_harness: HetznerHarness) -> None:
    provider = hetzner_harness.provider
    for machine_id in ("999999", "not-a-number"):
        with pytest.raises(NotFound):
            provider.get_machine(machine_id)
        with pytest.raises(NotFound):
            provider.reboot_machine(machine_id)
        with pytest.raises(NotFound):
            provider.reinstall_machine(machine_id)
        provider.delete_machine(machine_id)


def test_offers(hetzner_harness: HetznerHarness) -> None:
    h = hetzner_harness
    [offer] = h.provider.list_offers()
    assert isinstance(offer, Offer)
    assert (offer.site, offer.provider, offer.instance_type) == ("hetzner-fsn1", "hetzner", "gx-l40s-1")
    assert (offer.gpu, offer.gpus, offer.gpu_memory_gb, offer.region) == ("L40S", 1, 48, "fsn1")
    assert offer.price_per_gpu_hour == 1.25 and offer.available
    account = make_account(h.fake.url)
    [nbg] = HetznerProvider(make_site(region="nbg1"), account).list_offers()
    assert not nbg.available  # listed at the location but not available now
    [hel] = HetznerProvider(make_site(region="hel1"), account).list_offers()
    assert not hel.available  # not sold there at all
    assert HetznerProvider(make_site(instance_type="gone-type"), account).list_offers() == []


def test_list_machines_only_sees_this_sites_label(hetzner_harness: HetznerHarness) -> None:
    h = hetzner_harness
    mine = h.provider.create_machine(h.spec, "k1")
    other = HetznerProvider(make_site(name="hetzner-other"), make_account(h.fake.url))
    other.create_machine(h.spec.model_copy(update={"name": "other-node", "site": "hetzner-other"}), "k2")
    assert [m.id for m in h.provider.list_machines()] == [mine.id]


def test_reinstall_rebuilds_with_fresh_user_data_and_the_server_runs_after(hetzner_harness: HetznerHarness) -> None:
    """The reinstall rung's re-bootstrap: power off (the control plane waits for the Node to go
    NotReady in between), then ``rebuild`` from the server's image with the new document, which
    the metadata service then serves; the server is running again either way Hetzner leaves it."""
    h = hetzner_harness
    machine = h.provider.create_machine(h.spec, "key-1", user_data="#cloud-config\n# first join\n")
    sid = int(machine.id)
    for leaves_off in (False, True):
        h.fake.rebuild_leaves_off = leaves_off
        h.provider.stop_machine(machine.id)
        assert h.provider.get_machine(machine.id).state == "stopped"
        fresh = f"#cloud-config\n# rejoin {leaves_off}\n"
        h.provider.reinstall_machine(machine.id, user_data=fresh)
        assert h.fake.user_data[sid] == fresh, "what the rebuilt server's cloud-init reads"
        assert h.provider.get_machine(machine.id).state == "running"
    assert h.fake.rebuilds == {sid: [161547269, 161547269]}  # the server's own image
    assert h.fake.count("POST", f"/v1/servers/{sid}/actions/poweron") == 1, "only when the rebuild left it off"
    h.provider.stop_machine(machine.id)
    h.provider.stop_machine(machine.id)  # off already: no second power cut
    assert h.fake.count("POST", f"/v1/servers/{sid}/actions/poweroff") == 3


def test_user_data_over_32_kib_is_refused_before_any_call_and_by_the_api(hetzner_harness: HetznerHarness) -> None:
    from providers.hetzner import MAX_USER_DATA_BYTES

    h = hetzner_harness
    machine = h.provider.create_machine(h.spec, "key-1")
    calls = len(h.fake.requests)
    too_long = "#cloud-config\n" + "#" * MAX_USER_DATA_BYTES
    for attempt in (lambda: h.provider.reinstall_machine(machine.id, user_data=too_long),
                    lambda: h.provider.create_machine(h.spec.model_copy(update={"name": "other"}), "k2",
                                                      user_data=too_long)):
        with pytest.raises(InvalidRequest) as refused:
            attempt()
        assert refused.value.code == "user_data-too-large"
    assert len(h.fake.requests) == calls
    status, answer = h.fake._on_server("POST", ["actions", "rebuild"], h.fake.servers[int(machine.id)],
                                       {"image": "ubuntu-24.04", "user_data": too_long})
    assert (status, answer["error"]["code"]) == (400, "invalid_input")
