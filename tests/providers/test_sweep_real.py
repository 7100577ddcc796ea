"""FleetSweep's site sweep in ``mode: real``: each adapter against its wire-level fake.

A fleet-marked machine that nothing accounts for is left alone while it is younger than
the grace and deleted once older; a machine of a known node is never deleted (issue 13,
item 5). The activity runs as the control-plane worker runs it, with the real adapter."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.testing import ActivityEnvironment

from activities.account_store import AccountStore
from activities.env import FleetEnv
from activities.sweep import SweepActivities
from fleet.config import FleetConfig
from fleet.errors import Transient
from fleet.messages.sweep import SweepKnown, SweepSiteInput
from fleet.naming import node_name_for
from fleet.settings import Settings
from tests.providers.harness import Harness

PROVIDERS = ["aws", "lambda", "nebius", "hetzner", "own_dc"]


@pytest.fixture(params=PROVIDERS)
def harness(request: pytest.FixtureRequest) -> Harness:
    return request.getfixturevalue(f"{request.param}_harness")


def run(activity_fn, arg):
    """The activity as the worker runs it; the test itself stays sync (the Nebius SDK's
    sync calls refuse a running event loop)."""
    return asyncio.run(ActivityEnvironment().run(activity_fn, arg))


def sweep_env(harness: Harness, tmp_path) -> FleetEnv:
    provider = harness.provider
    config = FleetConfig(mode="real", accounts=[provider.account], sites=[provider.site])
    env = FleetEnv(Settings(state_dir=tmp_path), config, cluster=None)  # type: ignore[arg-type]
    env._providers[provider.site.name] = provider
    env._accounts = AccountStore(tmp_path / "guard.db")  # the guard's store is not under test here
    return env


def test_sweep_deletes_an_old_orphan_and_keeps_the_rest(harness: Harness, tmp_path) -> None:
    provider = harness.provider
    site = provider.site.name
    env = sweep_env(harness, tmp_path)
    acts = SweepActivities(env)

    def create(key: str):
        spec = harness.spec.model_copy(update={"name": node_name_for(site, key)})
        return provider.create_machine(spec, key)

    orphan = create(f"join/{site}/lost-{uuid.uuid4().hex[:6]}")
    known = create(f"join/{site}/kept-{uuid.uuid4().hex[:6]}")
    assert orphan.id != known.id
    nodes = SweepKnown(node_names=[known.name])

    young = run(acts.sweep_site, SweepSiteInput(site=site, known=nodes, grace_seconds=3600))
    assert young.deleted == [] and orphan.id in young.young and young.known == 1
    assert young.unmarked == 0

    old = run(
        acts.sweep_site, SweepSiteInput(site=site, known=nodes, grace_seconds=0, first_seen=young.first_seen))
    assert old.deleted == [orphan.id]
    live = {m.id for m in provider.list_machines() if m.state != "terminated"}
    assert orphan.id not in live and known.id in live


def test_lambda_instances_without_the_fleet_name_are_never_swept(lambda_harness, tmp_path) -> None:
    provider = lambda_harness.provider
    site = provider.site.name
    foreign = provider.create_machine(lambda_harness.spec.model_copy(update={"name": "someone-elses-box"}), "x")
    acts = SweepActivities(sweep_env(lambda_harness, tmp_path))
    report = run(
        acts.sweep_site, SweepSiteInput(site=site, known=SweepKnown(), grace_seconds=0))
    assert report.unmarked == 1 and report.deleted == []
    assert foreign.id in {m.id for m in provider.list_machines()}


def test_a_failed_delete_is_reported_in_our_words_only(lambda_harness, tmp_path, monkeypatch) -> None:
    """A delete that fails is reported and the sweep goes on. The report is an activity result, in
    workflow history: a typed error's message (written not to quote a request) is cut short, and any
    other failure is named by its type alone. Before, its own text went in whole, a transport
    failure's included, which quotes the header it refused (a key with it)."""
    provider = lambda_harness.provider
    site = provider.site.name
    acts = SweepActivities(sweep_env(lambda_harness, tmp_path))
    orphans = [provider.create_machine(lambda_harness.spec.model_copy(update={"name": node_name_for(site, key)}), key)
               for key in (f"join/{site}/lost-{uuid.uuid4().hex[:6]}" for _ in range(2))]
    failures = {orphans[0].id: Transient("the provider answered 503: " + "busy " * 2000, provider="lambda"),
                orphans[1].id: ValueError("Invalid header value b'Bearer secret_live_key\\n'")}

    def failing_delete(machine_id: str) -> None:
        raise failures[machine_id]

    monkeypatch.setattr(provider, "delete_machine", failing_delete)
    report = run(acts.sweep_site, SweepSiteInput(site=site, known=SweepKnown(), grace_seconds=0))
    assert report.deleted == [] and len(report.failed) == 2, report
    transient, other = sorted(report.failed, key=lambda line: not line.startswith(orphans[0].id))
    assert transient.startswith(f"{orphans[0].id}: Transient: the provider answered 503: busy") and len(transient) < 400
    assert other == f"{orphans[1].id}: ValueError"
