"""The Provider contract, run against every adapter pointed at its wire-level fake."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from fleet.errors import BadCredentials, NotFound
from fleet.models import Machine, Offer
from providers.base import Provider
from tests.providers.harness import ERROR_KINDS, Harness, stored_failure

PROVIDERS = ["aws", "lambda", "nebius", "hetzner", "own_dc"]


@pytest.fixture(params=PROVIDERS)
def harness(request: pytest.FixtureRequest) -> Harness:
    # Every provider has its harness (tests/providers/conftest.py): one missing is an error, not a skip.
    return request.getfixturevalue(f"{request.param}_harness")


def key() -> str:
    return f"test-{uuid.uuid4()}"


def leaks(secret: str, text: str) -> bool:
    """Whether ``text`` contains the secret or a long part of it (``user:password``). The own-dc
    harness's BMC user is ``gpufleet``, a name every join's providerID carries: not a part to find."""
    parts = [secret, *(p for p in secret.split(":") if len(p) >= 8 and p != "gpufleet")]
    return any(p in text for p in parts)


def test_harness_shape(harness: Harness) -> None:
    assert isinstance(harness, Harness)
    assert isinstance(harness.provider, Provider)
    assert harness.provider.name in ("aws", "lambda", "nebius", "hetzner", "own-dc")


def test_create_twice_with_same_key_makes_one_machine(harness: Harness) -> None:
    k = key()
    first = harness.provider.create_machine(harness.spec, k)
    second = harness.provider.create_machine(harness.spec, k)
    assert first.id == second.id
    assert harness.machine_count() == 1
    assert first.name == harness.spec.name
    assert first.site == harness.spec.site
    assert first.provider == harness.provider.name


def test_created_machine_is_listed_and_gettable(harness: Harness) -> None:
    machine = harness.provider.create_machine(harness.spec, key())
    got = harness.provider.get_machine(machine.id)
    assert (got.id, got.name, got.site, got.provider) == (machine.id, machine.name, machine.site, machine.provider)
    assert machine.id in {m.id for m in harness.provider.list_machines()}


def test_delete_of_gone_machine_succeeds(harness: Harness) -> None:
    machine = harness.provider.create_machine(harness.spec, key())
    harness.provider.delete_machine(machine.id)
    harness.provider.delete_machine(machine.id)
    assert harness.machine_count() == 0
    harness.provider.delete_machine(getattr(harness, "unknown_id", "does-not-exist-0000"))


def test_get_of_unknown_id_is_not_found(harness: Harness) -> None:
    with pytest.raises(NotFound):
        harness.provider.get_machine(getattr(harness, "unknown_id", "does-not-exist-0000"))


@pytest.mark.parametrize("kind", list(ERROR_KINDS))
def test_real_error_body_maps_to_taxonomy(harness: Harness, kind: str) -> None:
    if kind not in getattr(harness, "error_kinds", ERROR_KINDS):
        pytest.skip(f"{harness.provider.name} has no {kind} error")
    harness.fail_next_create(kind)
    with pytest.raises(ERROR_KINDS[kind]) as caught:
        harness.provider.create_machine(harness.spec, key())
    assert type(caught.value) is ERROR_KINDS[kind]
    assert caught.value.provider == harness.provider.name
    assert caught.value.code
    assert harness.machine_count() == 0
    secret = getattr(harness, "secret", None)
    if secret:
        assert not leaks(secret, str(caught.value))


def test_list_offers_returns_offers(harness: Harness) -> None:
    offers = harness.provider.list_offers()
    assert offers
    for offer in offers:
        assert isinstance(offer, Offer)
        assert offer.provider == harness.provider.name
        assert offer.site == harness.spec.site
        assert offer.gpus >= 1


def test_reboot_live_machine(harness: Harness) -> None:
    machine = harness.provider.create_machine(harness.spec, key())
    harness.provider.reboot_machine(machine.id)
    assert harness.provider.get_machine(machine.id).id == machine.id


def test_full_cycle_never_shows_the_credential(harness: Harness) -> None:
    secret = getattr(harness, "secret", None)
    if not secret:
        pytest.skip("harness does not expose its secret")
    provider = harness.provider
    models: list[Machine | Offer] = []
    machine = provider.create_machine(harness.spec, key())
    models.append(machine)
    models.append(provider.get_machine(machine.id))
    models.extend(provider.list_machines())
    models.extend(provider.list_offers())
    provider.reboot_machine(machine.id)
    models.append(provider.get_machine(machine.id))
    provider.delete_machine(machine.id)
    assert harness.machine_count() == 0
    assert len(models) >= 4
    for model in models:
        assert not leaks(secret, model.model_dump_json())


def provider_activities(harness: Harness, tmp_path):
    """The control plane's provider activities on the harness's adapter (pointed at its fake), and
    a runner for one call: the provider activities are async (they run the SDK in a thread)."""
    from temporalio.testing import ActivityEnvironment

    from activities.control_plane import ControlPlaneActivities
    from activities.env import FleetEnv
    from fleet.config import FleetConfig
    from fleet.settings import Settings

    config = FleetConfig(mode="real", sites=[harness.provider.site], accounts=[harness.provider.account])
    # The account guard of mode real lives in the cluster: the simulated one keeps the port's contract.
    from sim.cluster import SimCluster
    from sim.world import SimWorld

    cluster = SimCluster(SimWorld(tmp_path / "cluster.db"))
    env = FleetEnv(settings=Settings(state_dir=tmp_path), config=config, cluster=cluster)
    env._providers[harness.spec.site] = harness.provider  # the adapter pointed at its fake
    if harness.provider.site.provider == "own-dc":
        harness.provider.options["seed_dir"] = str(tmp_path / "seeds")  # where a joining rack machine's user data goes
    environment = ActivityEnvironment()

    def run(fn, arg):
        result = environment.run(fn, arg)
        return asyncio.run(result) if asyncio.iscoroutine(result) else result

    return ControlPlaneActivities(env), run


def test_activity_payloads_never_carry_the_credential(harness: Harness, tmp_path) -> None:
    """What Temporal would store: every activity input, result and failure of a join's
    create/delete cycle, encoded by the worker's data converter."""
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.exceptions import ApplicationError

    from fleet.messages.nodes import DeleteMachineInput, ProvisionJoinInput

    secret = getattr(harness, "secret", None)
    if not secret:
        pytest.skip("harness does not expose its secret")
    activities, run = provider_activities(harness, tmp_path)
    payloads: list = []

    create = ProvisionJoinInput(site=harness.spec.site, spec=harness.spec, idempotency_key=key())
    provisioned = run(activities.provision_joining_machine, create)
    delete = DeleteMachineInput(site=harness.spec.site, machine_id=provisioned.machine.id)
    run(activities.delete_machine, delete)
    payloads += [create, provisioned, delete]

    if "BadCredentials" in getattr(harness, "error_kinds", ERROR_KINDS):
        harness.fail_next_create("BadCredentials")
        with pytest.raises(ApplicationError) as failure:
            run(activities.provision_joining_machine, create.model_copy(update={"idempotency_key": key()}))
        assert failure.value.type == "BadCredentials" and failure.value.non_retryable
        payloads += [str(failure.value), *failure.value.details]

    encoded = asyncio.run(pydantic_data_converter.encode(payloads))
    for payload in encoded:
        assert not leaks(secret, payload.data.decode(errors="replace"))


# -- a credential as people store it: a trailing newline, a stray control character --------------
def set_credential(harness: Harness, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    env = harness.provider.account.credentials.env
    assert env, "the harnesses read their credential from a variable"
    monkeypatch.setenv(env, value)


def test_a_credential_read_with_a_trailing_newline_works(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kubectl create secret --from-file` and `echo` leave a newline after the key."""
    secret = getattr(harness, "secret", None)
    if not secret:
        pytest.skip("harness does not expose its secret")
    set_credential(harness, monkeypatch, f"  {secret}\n")
    machine = harness.provider.create_machine(harness.spec, key())
    assert machine.id in {m.id for m in harness.provider.list_machines()}
    harness.provider.delete_machine(machine.id)
    assert harness.machine_count() == 0


def test_a_blank_credential_is_bad_credentials_naming_its_reference(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_credential(harness, monkeypatch, " \n")
    with pytest.raises(BadCredentials) as caught:
        harness.provider.create_machine(harness.spec, key())
    assert harness.provider.account.credentials.env in str(caught.value)


def provision_with_a_broken_credential(harness: Harness, monkeypatch: pytest.MonkeyPatch, tmp_path) -> Exception:
    """How provisioning fails with the harness's key broken over two lines (as pasted), checked
    to leave the worker with no part of the key: the HTTP client refuses such a header with an
    error that quotes it whole (the part after the newline included)."""
    from fleet.messages.nodes import ProvisionJoinInput

    secret = getattr(harness, "secret", None)
    if not secret or not getattr(harness, "secret_in_header", True):
        pytest.skip("the credential does not travel as a header value")
    quoted = secret[6:]
    set_credential(harness, monkeypatch, secret[:6] + "\n" + quoted)
    activities, run = provider_activities(harness, tmp_path)
    create = ProvisionJoinInput(site=harness.spec.site, spec=harness.spec, idempotency_key=key())
    with pytest.raises(Exception) as failure:
        run(activities.provision_joining_machine, create)
    stored = stored_failure(failure.value)
    assert not leaks(secret, stored) and not leaks(quoted, stored), stored
    return failure.value


def test_a_credential_no_header_can_carry_is_bad_credentials_and_never_shown(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """Sent as it is, the header would be refused with an error quoting it, retried as Transient
    though no retry can mend the key."""
    from temporalio.exceptions import ApplicationError

    failure = provision_with_a_broken_credential(harness, monkeypatch, tmp_path)
    assert isinstance(failure, ApplicationError), failure
    assert (failure.type, failure.non_retryable) == ("BadCredentials", True), failure
    assert harness.provider.account.credentials.env in str(failure)
    assert harness.machine_count() == 0


def test_a_transport_failure_quoting_the_credential_stays_out_of_history(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """Whatever header value reaches the transport unchecked (here the key itself, the adapter's
    check taken away), the HTTP client's error that quotes it is neither our error's message nor
    its cause."""
    for module in ("providers.credentials", type(harness.provider).__module__):
        monkeypatch.setattr(f"{module}.header_safe", lambda value, *args, **kwargs: value, raising=False)
    provision_with_a_broken_credential(harness, monkeypatch, tmp_path)
