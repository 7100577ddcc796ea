"""The Nebius adapter against a local Nebius gRPC API with real status details."""

from __future__ import annotations

import json
import socket

import grpc
import pytest
from nebius.api.nebius.common.v1 import ResourceMetadata
from nebius.api.nebius.compute.v1 import (
    AttachedDiskSpec,
    ExistingDisk,
    Instance,
    InstanceSpec,
    InstanceStatus,
    ResourcesSpec,
)

from fleet.errors import (
    BadCredentials,
    InvalidRequest,
    NoCapacity,
    NotFound,
    OverQuota,
    ProviderError,
    Transient,
)
from fleet.models import CapacityType, CredentialsRef, Machine, Offer
from providers.base import Provider
from providers.nebius import (
    DETAIL_ERRORS,
    SITE_LABEL,
    STATUS_ERRORS,
    NebiusProvider,
    classify,
    idempotency_uuid,
)
from tests.providers.fake_nebius import FakeNebius
from tests.providers.harness_nebius import (
    PROJECT,
    TOKEN_ENV,
    NebiusHarness,
    default_platforms,
    make_account,
    make_site,
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_is_a_provider(nebius_harness: NebiusHarness) -> None:
    assert isinstance(nebius_harness.provider, Provider)
    assert nebius_harness.provider.name == "nebius"


def test_constructor_does_no_io_and_missing_token_fails_before_any_call(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNebius("unused", PROJECT, default_platforms()).start()
    try:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        provider = NebiusProvider(make_site(), make_account(fake.address))
        with pytest.raises(BadCredentials, match=f"env:{TOKEN_ENV}") as info:
            provider.get_machine("computeinstance-e00x")
        assert info.value.provider == "nebius"
        assert not fake.calls
    finally:
        fake.stop()


@pytest.mark.parametrize("missing", ["parent_id", "subnet_id"])
def test_missing_required_options_fail_before_any_call(nebius_harness: NebiusHarness, missing: str) -> None:
    h = nebius_harness
    account = make_account(h.fake.address, **{missing: None})
    provider = NebiusProvider(make_site(), account)
    with pytest.raises(InvalidRequest, match=f"options.{missing}") as info:
        provider.create_machine(h.spec, "key-1")
    assert info.value.code == "config"
    assert not h.fake.calls


def test_full_cycle_never_leaks_the_token(nebius_harness: NebiusHarness) -> None:
    h = nebius_harness
    provider, fake = h.provider, h.fake
    returned: list[Machine | Offer] = []

    machine = provider.create_machine(h.spec, "key-1")
    returned.append(machine)
    assert (machine.name, machine.site, machine.provider) == (h.spec.name, "nebius-eu-north", "nebius")
    assert machine.id.startswith("computeinstance-") and machine.state == "running"
    assert machine.instance_type == "gpu-h100-sxm.8gpu-128vcpu-1600gb"
    assert machine.capacity_type == CapacityType.ON_DEMAND and machine.created_at is not None
    stored = fake.instances[machine.id]
    assert stored.metadata.parent_id == PROJECT
    assert stored.metadata.labels[SITE_LABEL] == "nebius-eu-north"
    assert stored.metadata.labels["gpufleet.io/pool"] == "default"
    assert stored.spec.hostname == h.spec.name
    assert stored.spec.network_interfaces[0].subnet_id == "vpcsubnet-e00gpufleettest"
    assert stored.spec.boot_disk.managed_disk.name == f"{h.spec.name}-boot"
    assert stored.spec.boot_disk.managed_disk.spec.source_image_family.image_family == "ubuntu22.04-cuda12"
    assert not stored.spec.check_presence("preemptible")

    returned.append(provider.get_machine(machine.id))
    listed = provider.list_machines()
    returned.extend(listed)
    assert [m.id for m in listed] == [machine.id]

    provider.reboot_machine(machine.id)
    assert fake.power_cycles[machine.id] == 1
    assert provider.get_machine(machine.id).state == "running"

    provider.reinstall_machine(machine.id)
    assert fake.boot_disks_replaced[machine.id] == 1
    assert fake.instances[machine.id].spec.boot_disk.managed_disk.name == f"{h.spec.name}-boot-1"
    provider.reinstall_machine(machine.id)
    assert fake.instances[machine.id].spec.boot_disk.managed_disk.name == f"{h.spec.name}-boot-2"
    after = provider.get_machine(machine.id)
    returned.append(after)
    assert after.id == machine.id and after.state == "running"
    # Same image family after reimaging.
    assert fake.instances[machine.id].spec.boot_disk.managed_disk.spec.source_image_family.image_family == (
        "ubuntu22.04-cuda12"
    )

    returned.extend(provider.list_offers())

    provider.delete_machine(machine.id)
    assert h.machine_count() == 0
    with pytest.raises(NotFound) as info:
        provider.get_machine(machine.id)
    assert info.value.code == "NOT_FOUND/resource_not_found"
    provider.delete_machine(machine.id)  # gone: still fine

    for model in returned:
        assert h.token not in model.model_dump_json()


def test_token_is_read_at_call_time(nebius_harness: NebiusHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    h = nebius_harness
    h.provider.list_machines()
    monkeypatch.setenv(TOKEN_ENV, "rotated-but-wrong")
    with pytest.raises(BadCredentials) as info:
        h.provider.list_machines()
    assert info.value.code == "UNAUTHENTICATED"


def test_create_twice_with_same_key_is_one_instance(nebius_harness: NebiusHarness) -> None:
    h = nebius_harness
    first = h.provider.create_machine(h.spec, "key-1")
    second = h.provider.create_machine(h.spec, "key-1")
    assert first.id == second.id
    assert h.machine_count() == 1
    assert h.fake.idempotency_keys == [idempotency_uuid("key-1")] * 2
    assert h.fake.calls["InstanceService.GetByName"] == 0  # the key alone deduplicated


def test_already_exists_with_a_forgotten_key_returns_the_named_instance(nebius_harness: NebiusHarness) -> None:
    h = nebius_harness
    first = h.provider.create_machine(h.spec, "key-1")
    again = h.provider.create_machine(h.spec, "key-unknown-to-the-server")
    assert again.id == first.id
    assert h.machine_count() == 1
    assert h.fake.calls["InstanceService.GetByName"] == 1


def test_same_name_owned_by_another_site_is_refused(nebius_harness: NebiusHarness) -> None:
    h = nebius_harness
    other = NebiusProvider(make_site(name="nebius-other"), make_account(h.fake.address))
    other.create_machine(h.spec.model_copy(update={"site": "nebius-other"}), "k-other")
    with pytest.raises(InvalidRequest, match="already exists"):
        h.provider.create_machine(h.spec, "key-1")
    assert h.provider.list_machines() == []


@pytest.mark.parametrize(
    ("kind", "expected", "code"),
    [
        ("NoCapacity", NoCapacity, "RESOURCE_EXHAUSTED/not_enough_resources"),  # failed operation
        ("NoCapacityRpc", NoCapacity, "RESOURCE_EXHAUSTED/not_enough_resources"),
        ("OverQuota", OverQuota, "RESOURCE_EXHAUSTED/quota_failure"),
        ("BadCredentials", BadCredentials, "UNAUTHENTICATED"),
        ("PermissionDenied", BadCredentials, "PERMISSION_DENIED/permission_denied"),
        ("Transient", Transient, "RESOURCE_EXHAUSTED/too_many_requests"),
        ("Unavailable", Transient, "UNAVAILABLE"),
        ("InvalidRequest", InvalidRequest, "INVALID_ARGUMENT/bad_request"),
        ("Unknown", Transient, "DATA_LOSS"),
    ],
)
def test_real_error_statuses_map_to_the_taxonomy(
    nebius_harness: NebiusHarness, kind: str, expected: type[ProviderError], code: str
) -> None:
    h = nebius_harness
    h.fail_next_create(kind)
    with pytest.raises(expected) as info:
        h.provider.create_machine(h.spec, "key-1")
    assert type(info.value) is expected
    assert info.value.provider == "nebius"
    assert info.value.code == code
    assert code in str(info.value)
    assert h.fake.calls["InstanceService.Create"] == 1  # the SDK's own retries are off
    assert h.machine_count() == 0
    # That error was for one call; a fresh key creates the machine.
    assert h.provider.create_machine(h.spec, "key-2").name == h.spec.name


def test_unknown_platform_is_invalid_request_from_the_server(nebius_harness: NebiusHarness) -> None:
    h = nebius_harness
    spec = h.spec.model_copy(update={"instance_type": "gpu-b300-sxm.8gpu-192vcpu-2400gb"})
    with pytest.raises(InvalidRequest) as info:
        h.provider.create_machine(spec, "key-1")
    assert info.value.code == "INVALID_ARGUMENT/bad_request"


def test_instance_type_without_a_preset_is_refused_locally(nebius_harness: NebiusHarness) -> None:
    h = nebius_harness
    with pytest.raises(InvalidRequest) as info:
        h.provider.create_machine(h.spec.model_copy(update={"instance_type": "h100x8"}), "key-1")
    assert info.value.code == "config"
    assert not h.fake.calls


def test_instance_types_option_maps_names(nebius_harness: NebiusHarness) -> None:
    h = nebius_harness
    mapping = {"h100x8": {"platform": "gpu-h100-sxm", "preset": "8gpu-128vcpu-1600gb"}}
    site = make_site(instance_type="h100x8")
    provider = NebiusProvider(site, make_account(h.fake.address, instance_types=mapping))
    machine = provider.create_machine(h.spec.model_copy(update={"instance_type": "h100x8"}), "key-1")
    assert machine.instance_type == "h100x8"
    assert h.fake.instances[machine.id].spec.resources.preset == "8gpu-128vcpu-1600gb"
    [offer] = provider.list_offers()
    assert offer.instance_type == "h100x8" and offer.gpus == 8


def test_spot_sites_create_preemptible_instances(nebius_harness: NebiusHarness) -> None:
    h = nebius_harness
    site = make_site(name="nebius-spot", capacity_type="spot")
    provider = NebiusProvider(site, make_account(h.fake.address))
    spec = h.spec.model_copy(update={"site": "nebius-spot", "capacity_type": CapacityType.SPOT})
    machine = provider.create_machine(spec, "key-1")
    assert machine.capacity_type == CapacityType.SPOT
    assert h.fake.instances[machine.id].spec.check_presence("preemptible")
    [offer] = provider.list_offers()
    assert offer.capacity_type == CapacityType.SPOT and offer.available
    l40s = NebiusProvider(make_site(capacity_type="spot", instance_type="gpu-l40s-a.1gpu-8vcpu-32gb"),
                          make_account(h.fake.address))
    [not_for_spot] = l40s.list_offers()
    assert not not_for_spot.available


def test_offers(nebius_harness: NebiusHarness) -> None:
    h = nebius_harness
    [offer] = h.provider.list_offers()
    assert isinstance(offer, Offer)
    assert (offer.site, offer.provider, offer.region) == ("nebius-eu-north", "nebius", "eu-north1")
    assert (offer.gpu, offer.gpus, offer.gpu_memory_gb) == ("H100", 8, 80)
    assert offer.price_per_gpu_hour == 2.95 and offer.available
    account = make_account(h.fake.address)
    assert NebiusProvider(make_site(instance_type="gpu-h100-sxm.3gpu-x"), account).list_offers() == []
    assert NebiusProvider(make_site(instance_type="gpu-nope.8gpu"), account).list_offers() == []


def test_operation_wait_is_bounded(nebius_harness: NebiusHarness) -> None:
    h = nebius_harness
    provider = NebiusProvider(make_site(), make_account(h.fake.address, operation_wait_s=0.3, poll_interval_s=0.05))
    h.fake.hold_operations = True
    with pytest.raises(Transient) as info:
        provider.create_machine(h.spec, "key-1")
    assert info.value.code == "timeout"
    # Bounded by operation_wait_s: at most operation_wait_s / poll_interval_s looks (and the first).
    assert 1 <= h.fake.calls["OperationService.Get"] <= 0.3 / 0.05 + 1, h.fake.calls
    # The retry, same key, waits on the same operation; once it finishes, the machine is there.
    h.fake.hold_operations = False
    machine = provider.create_machine(h.spec, "key-1")
    assert h.machine_count() == 1 and machine.state == "running"


def test_unknown_ids(nebius_harness: NebiusHarness) -> None:
    provider = nebius_harness.provider
    with pytest.raises(NotFound):
        provider.get_machine("computeinstance-e00nothere")
    with pytest.raises(NotFound):
        provider.reboot_machine("computeinstance-e00nothere")
    with pytest.raises(NotFound):
        provider.reinstall_machine("computeinstance-e00nothere")
    provider.delete_machine("computeinstance-e00nothere")


def test_reinstall_refuses_an_unmanaged_boot_disk(nebius_harness: NebiusHarness) -> None:
    h = nebius_harness
    h.fake.instances["computeinstance-e00byhand"] = Instance(
        metadata=ResourceMetadata(id="computeinstance-e00byhand", parent_id=PROJECT, name="by-hand",
                                  labels={SITE_LABEL: "nebius-eu-north"}),
        spec=InstanceSpec(
            resources=ResourcesSpec(platform="gpu-h100-sxm", preset="8gpu-128vcpu-1600gb"),
            boot_disk=AttachedDiskSpec(existing_disk=ExistingDisk(id="computedisk-e00x")),
        ),
        status=InstanceStatus(state=InstanceStatus.InstanceState.RUNNING),
    )
    with pytest.raises(InvalidRequest) as info:
        h.provider.reinstall_machine("computeinstance-e00byhand")
    assert info.value.code == "unmanaged_boot_disk"
    assert h.fake.calls["InstanceService.Stop"] == 0


def test_list_machines_pages_and_filters_by_site(nebius_harness: NebiusHarness) -> None:
    h = nebius_harness
    h.fake.max_page_size = 2
    mine = {h.provider.create_machine(h.spec.model_copy(update={"name": f"n{i}"}), f"k{i}").id for i in range(3)}
    other = NebiusProvider(make_site(name="nebius-other"), make_account(h.fake.address))
    other.create_machine(h.spec.model_copy(update={"name": "other", "site": "nebius-other"}), "k-other")
    assert {m.id for m in h.provider.list_machines()} == mine
    assert h.fake.calls["InstanceService.List"] == 2


def test_unreachable_api_is_transient(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "t")
    provider = NebiusProvider(make_site(), make_account(f"127.0.0.1:{_free_port()}", request_timeout_s=1))
    with pytest.raises(Transient) as info:
        provider.get_machine("computeinstance-e00x")
    assert info.value.code in {"UNAVAILABLE", "DEADLINE_EXCEEDED", "timeout"}


def test_malformed_service_account_json_is_bad_credentials(
    nebius_harness: NebiusHarness, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    h = nebius_harness
    path = tmp_path / "credentials.json"
    path.write_text(json.dumps({"subject-credentials": {"alg": "RS256", "private-key": "nope"}}))
    account = make_account(h.fake.address).model_copy(update={"credentials": CredentialsRef(file=str(path))})
    with pytest.raises(BadCredentials, match=f"file:{path}") as info:
        NebiusProvider(make_site(), account).list_machines()
    assert info.value.code == "credentials_file"
    assert "nope" not in str(info.value)
    assert not h.fake.calls


def _service_account_json(kid: str, account_id: str) -> tuple[str, bytes]:
    """A Nebius credentials.json body, and the public key to register with the fake."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    subject = {"alg": "RS256", "private-key": pem, "kid": kid, "iss": account_id, "sub": account_id}
    return json.dumps({"subject-credentials": subject}), public


def test_service_account_credentials_are_exchanged_for_a_token(nebius_harness: NebiusHarness, tmp_path) -> None:
    h = nebius_harness
    body, public = _service_account_json("publickey-e00abc", "serviceaccount-e00abc")
    h.fake.service_account_keys["publickey-e00abc"] = ("serviceaccount-e00abc", public)
    path = tmp_path / "credentials.json"
    path.write_text(body)
    account = make_account(h.fake.address).model_copy(update={"credentials": CredentialsRef(file=str(path))})
    provider = NebiusProvider(make_site(), account)
    machine = provider.create_machine(h.spec, "key-1")
    assert h.fake.calls["TokenExchangeService.Exchange"] >= 1
    assert provider.get_machine(machine.id).id == machine.id
    private_key = json.loads(body)["subject-credentials"]["private-key"]
    assert "PRIVATE KEY" not in machine.model_dump_json() and private_key not in machine.model_dump_json()


def test_service_account_the_token_service_refuses_is_bad_credentials(nebius_harness: NebiusHarness, tmp_path) -> None:
    h = nebius_harness
    body, _ = _service_account_json("publickey-e00unknown", "serviceaccount-e00abc")
    path = tmp_path / "credentials.json"
    path.write_text(body)
    account = make_account(h.fake.address).model_copy(update={"credentials": CredentialsRef(file=str(path))})
    with pytest.raises(BadCredentials) as info:
        NebiusProvider(make_site(), account).list_machines()
    assert info.value.code == "UNAUTHENTICATED"
    # Reported at once: the one exchange the token service refused, not retried until the deadline.
    assert h.fake.calls["TokenExchangeService.Exchange"] == 1, h.fake.calls
    assert h.fake.calls["InstanceService.List"] == 0


def test_error_tables_are_data_and_cover_the_brief() -> None:
    assert all(issubclass(cls, ProviderError) for cls in DETAIL_ERRORS.values())
    assert all(issubclass(cls, ProviderError) for cls in STATUS_ERRORS.values())
    assert DETAIL_ERRORS["not_enough_resources"] is NoCapacity
    assert DETAIL_ERRORS["quota_failure"] is OverQuota
    assert DETAIL_ERRORS["permission_denied"] is BadCredentials
    assert DETAIL_ERRORS["too_many_requests"] is Transient
    assert STATUS_ERRORS[grpc.StatusCode.UNAUTHENTICATED] is BadCredentials
    assert STATUS_ERRORS[grpc.StatusCode.UNAVAILABLE] is Transient
    assert STATUS_ERRORS[grpc.StatusCode.INVALID_ARGUMENT] is InvalidRequest
    assert STATUS_ERRORS[grpc.StatusCode.NOT_FOUND] is NotFound
    # RESOURCE_EXHAUSTED alone cannot tell quota from capacity: it is not in the code table.
    assert grpc.StatusCode.RESOURCE_EXHAUSTED not in STATUS_ERRORS


def test_classify_detail_beats_code_and_unknown_is_transient() -> None:
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert type(classify(exhausted, ["quota_failure"], "m")) is OverQuota
    assert type(classify(exhausted, ["not_enough_resources"], "m")) is NoCapacity
    bare = classify(exhausted, [], "m")
    assert type(bare) is Transient and bare.code == "RESOURCE_EXHAUSTED"
    odd = classify(grpc.StatusCode.INVALID_ARGUMENT, ["brand_new_detail"], "m")
    assert type(odd) is InvalidRequest  # unknown detail falls back to the code
    unknown = classify(grpc.StatusCode.DATA_LOSS, ["brand_new_detail"], "m")
    assert type(unknown) is Transient and unknown.code == "DATA_LOSS/brand_new_detail"
