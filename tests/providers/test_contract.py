"""The Provider contract, run against every adapter pointed at its wire-level fake."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from fleet.errors import NotFound
from fleet.models import Machine, Offer
from providers.base import Provider
from tests.providers.harness import ERROR_KINDS, Harness

PROVIDERS = ["aws", "lambda", "nebius", "hetzner", "own_dc"]


@pytest.fixture(params=PROVIDERS)
def harness(request: pytest.FixtureRequest) -> Harness:
    try:
        return request.getfixturevalue(f"{request.param}_harness")
    except pytest.FixtureLookupError:
        pytest.skip(f"no {request.param}_harness fixture yet (tests/providers/harness_{request.param}.py)")


def key() -> str:
    return f"test-{uuid.uuid4()}"


def leaks(secret: str, text: str) -> bool:
    """Whether ``text`` contains the secret or a long part of it (``user:password``)."""
    parts = [secret, *(p for p in secret.split(":") if len(p) >= 8)]
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


def test_activity_payloads_never_carry_the_credential(harness: Harness, tmp_path) -> None:
    """What Temporal would store: every activity input, result and failure of a
    create/get/delete cycle, encoded by the worker's data converter."""
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from activities.control_plane import ControlPlaneActivities
    from activities.env import FleetEnv
    from fleet.messages.nodes import DeleteMachineInput, ProvisionMachineInput
    from fleet.config import FleetConfig
    from fleet.settings import Settings

    secret = getattr(harness, "secret", None)
    if not secret:
        pytest.skip("harness does not expose its secret")
    site = harness.spec.site
    config = FleetConfig(mode="real", sites=[harness.provider.site], accounts=[harness.provider.account])
    # The account guard of mode real lives in the cluster: the simulated one keeps the port's contract.
    from sim.cluster import SimCluster
    from sim.world import SimWorld

    cluster = SimCluster(SimWorld(tmp_path / "cluster.db"))
    env = FleetEnv(settings=Settings(state_dir=tmp_path), config=config, cluster=cluster)
    env._providers[site] = harness.provider  # the adapter pointed at its fake
    activities = ControlPlaneActivities(env)
    environment = ActivityEnvironment()

    def run(fn, arg):
        """One activity call; the provider activities are async (they run the SDK in a thread)."""
        result = environment.run(fn, arg)
        return asyncio.run(result) if asyncio.iscoroutine(result) else result

    payloads: list = []

    create = ProvisionMachineInput(site=site, spec=harness.spec, idempotency_key=key())
    machine = run(activities.provision_machine, create)
    delete = DeleteMachineInput(site=site, machine_id=machine.id)
    run(activities.delete_machine, delete)
    payloads += [create, machine, delete]

    if "BadCredentials" in getattr(harness, "error_kinds", ERROR_KINDS):
        harness.fail_next_create("BadCredentials")
        with pytest.raises(ApplicationError) as failure:
            run(activities.provision_machine, create.model_copy(update={"idempotency_key": key()}))
        assert failure.value.type == "BadCredentials" and failure.value.non_retryable
        payloads += [str(failure.value), *failure.value.details]

    encoded = asyncio.run(pydantic_data_converter.encode(payloads))
    for payload in encoded:
        assert not leaks(secret, payload.data.decode(errors="replace"))
