"""Policy that left the activities for fleet/ (issue 12, item 3): where a replacement may
go, what "recovered" means, the stepwise restore; and the account guard in one method
of the activity environment. Pure functions first, then the activities that call them
against the simulated fleet (no Temporal server)."""

from __future__ import annotations

import pytest
from temporalio.testing import ActivityEnvironment

from activities.capacity import CapacityActivities
from activities.env import FleetEnv
from activities.evacuation import EvacuationActivities
from fleet.messages.nodes import ReplacementSitesInput
from activities.repair import RepairActivities
from fleet.config import Site
from fleet.incident import SiteFacts, allowed_targets, recovery, restore_percents, restore_weights, weight_at
from fleet.messages.evacuation import SiteWeightInput
from fleet.models import AccountState, CapacityType
from fleet.placement import offers_from_config, rank, replacement_constraints
from fleet.replacement import may_move, replacement_sites
from fleet.settings import Settings


def site(name, price, geo="us-east", gpu="H100", compliance=False, gpus=8) -> Site:
    return Site(name=name, provider="lambda", account=f"acct-{name}", region="r", geography=geo, gpu=gpu,
                gpus_per_machine=gpus, gpu_memory_gb=80, instance_type=f"{name}-type", price_per_gpu_hour=price,
                capacity_type=CapacityType.ON_DEMAND, max_nodes=8, compliance=compliance)


EU = site("eu-1", 3.0, geo="eu", compliance=True)
SITES = [
    EU, site("eu-2", 2.8, geo="eu"), site("eu-3", 2.0, geo="eu", gpu="L40S"), site("us-1", 1.5),
    site("us-2", 2.5), site("eu-4", 3.5, geo="eu", compliance=True),
]


# -- where a replacement may go ---------------------------------------------------------------
def test_a_compliance_site_replaces_inside_its_geography_only():
    assert replacement_sites(EU, SITES) == ["eu-1", "eu-2", "eu-4"]  # same GPU, cheapest first, never us-*


def test_a_free_site_replaces_anywhere_with_the_same_gpu_cheapest_first():
    us = SITES[4]
    assert replacement_sites(us, SITES) == ["us-2", "us-1", "eu-2", "eu-1", "eu-4"]


def test_moving_into_a_compliance_geography_is_allowed_leaving_it_is_not():
    assert may_move(SITES[3], EU) and not may_move(EU, SITES[3])
    assert may_move(EU, SITES[5]) and may_move(EU, SITES[1])


def test_the_evacuation_planner_uses_the_same_rule():
    facts = [SiteFacts(name=s.name, geography=s.geography, compliance=s.compliance) for s in SITES]
    assert [s.name for s in allowed_targets(facts[0], facts)] == ["eu-2", "eu-3", "eu-4"]
    assert [s.name for s in allowed_targets(facts[3], facts)] == ["eu-1", "eu-2", "eu-3", "us-2", "eu-4"]


def test_a_spot_reclaim_replacement_of_a_compliance_site_ranks_only_its_geography():
    constraints = replacement_constraints(EU)
    placement = rank(offers_from_config(SITES), SITES, constraints)
    assert [c.offer.site for c in placement.candidates] == ["eu-2", "eu-1", "eu-4"]
    assert "geography us-east not in eu" in {r.reason for r in placement.rejected if r.site == "us-1"}
    free = replacement_constraints(SITES[3])
    assert free.geographies is None and (free.gpu, free.gpus_per_machine) == ("H100", 8)


def test_the_repair_activity_asks_the_rule(tmp_path):
    env = FleetEnv(Settings(state_dir=tmp_path), _config_with(SITES), cluster=None)
    run = ActivityEnvironment().run
    assert run(RepairActivities(env).replacement_sites, ReplacementSitesInput(site="eu-1")) == ["eu-1", "eu-2", "eu-4"]
    assert run(RepairActivities(env).replacement_sites, ReplacementSitesInput(site="gone")) == []


def _config_with(sites: list[Site]):
    from fleet.config import FleetConfig

    accounts = [{"name": s.account, "provider": s.provider, "credentials": {"env": "X"}} for s in sites]
    return FleetConfig.model_validate({"mode": "sim", "accounts": accounts,
                                       "sites": [s.model_dump(mode="json") for s in sites]})


# -- what "recovered" means ---------------------------------------------------------------------
def test_recovered_needs_the_api_and_every_node_ready():
    assert recovery(None, {"a": True, "b": True}).recovered
    down = recovery(None, {"a": True, "b": False, "c": False})
    assert not down.recovered and down.detail.startswith("2 of 3 nodes not ready") and "b, c" in down.detail
    api = recovery("Transient: 503", {"a": True})
    assert not api.recovered and api.detail == "provider API: Transient: 503"
    assert not recovery(None, {}).recovered, "a site with no nodes has nothing to prove healthy"


# -- stepwise restore ---------------------------------------------------------------------------
@pytest.mark.parametrize("original, percent, weight", [
    (100, 0, 0), (100, 10, 10), (5, 10, 1), (5, 50, 3), (7, 100, 7), (0, 50, 0), (100, 150, 100), (3, 1, 1),
])
def test_weight_at(original, percent, weight):
    assert weight_at(original, percent) == weight


def test_restore_percents_end_at_full_traffic():
    assert restore_percents([10, 50]) == [10, 50, 100]
    assert restore_percents([0, 150, 50]) == [1, 50, 100]


@pytest.mark.parametrize("original, steps, weights", [
    (7, [10, 50, 100], [1, 4, 7]),       # 0.7 and 3.5 round up
    (100, [10, 50], [10, 50, 100]),      # full traffic is always the last step
    (250, [50, 10], [25, 125, 250]),     # steps in any order climb upwards
    (3, [10, 20, 100], [1, 3]),          # 0.3 and 0.6 both give 1: one step, not two
    (1, [10, 50, 100], [1]),
    (0, [10, 50, 100], [0]),             # a site that had no traffic gets none back
])
def test_restore_weights_are_the_weights_at_each_step(original, steps, weights):
    assert restore_weights(original, steps) == weights


def test_the_weight_activity_writes_weight_at(tmp_path):
    """set_site_weight writes what fleet.incident.weight_at says (the old copy is gone)."""
    env = FleetEnv.from_settings(Settings(state_dir=tmp_path))
    acts = EvacuationActivities(env)
    site_name = env.config.sites[0].name
    for percent, expected in ((0, 0), (10, 1), (50, 4), (100, 7)):
        result = ActivityEnvironment().run(acts.set_site_weight, SiteWeightInput(
            site=site_name, percent=percent, original_models={"m": 7}, original_site=7,
            all_sites=[s.name for s in env.config.sites], healthy=True, draining=False, incident=""))
        assert result.weights["m"] == expected
        assert env.cluster.get_site_routes().sites[site_name].weight == expected


def test_the_recovery_verdict_reports_the_rule(tmp_path):
    env = FleetEnv.from_settings(Settings(state_dir=tmp_path))
    site_name = env.config.sites[0].name
    probe = EvacuationActivities(env).recovery_verdict(site_name)
    assert (probe.recovered, probe.detail) == (False, "no nodes at the site")


def test_a_recovery_verdict_while_the_cluster_api_is_away_says_not_yet(tmp_path, monkeypatch):
    """Before: the probe raised, failed after its ten attempts (a few minutes of API-server
    trouble), failed the evacuation, and the evacuation's undo routed traffic back to a site
    that was still down. A look at recovery is a question: no answer is "not recovered yet"."""
    from fleet.errors import Transient

    env = FleetEnv.from_settings(Settings(state_dir=tmp_path))
    site_name = env.config.sites[0].name

    def away(*_args, **_kwargs):
        raise Transient("GET /api/v1/nodes: 503 Service Unavailable", provider="kubernetes", code="503")

    monkeypatch.setattr(env.cluster, "list_nodes", away)
    probe = EvacuationActivities(env).recovery_verdict(site_name)
    assert probe.recovered is False
    assert probe.detail == "the cluster API did not answer: GET /api/v1/nodes: 503 Service Unavailable"


def test_the_site_entity_knows_its_own_incident_holds_and_no_one_elses():
    """``release_orphaned_holds`` lets go only of holds this reads as the site's own incident's."""
    from fleet.incident import incident_hold_reason, incident_of_hold

    mine = incident_hold_reason("site-a", "evacuate/site-a/7")
    assert incident_of_hold("site-a", mine) == "evacuate/site-a/7"
    assert incident_of_hold("site-b", mine) is None, "another site's incident"
    assert incident_of_hold("site-a", "operator: reseating the GPU") is None, "an operator's hold"
    assert incident_of_hold("site-a", incident_hold_reason("site-a", "")) is None, "no incident named"


# -- the account guard: one method, the enum ----------------------------------------------------
def test_a_revoked_account_queues_the_delete_and_makes_no_call(tmp_path):
    env = FleetEnv.from_settings(Settings(state_dir=tmp_path))
    target = env.config.sites[0]
    machine = env.provider(target.name).create_machine(
        _spec(target), idempotency_key="test-guard-1")
    env.accounts.mark_revoked(target.account, target.provider, "revoked in a test")
    calls = env.world.calls(target.account)

    assert env.delete_machine(target.name, machine.id) is False
    assert [p.machine_id for p in env.accounts.pending_deletes(target.account)] == [machine.id]
    assert env.world.calls(target.account) == calls, "no call of any kind to a revoked account"

    env.accounts.put(env.accounts.get(target.account).model_copy(update={"state": AccountState.HEALTHY}))
    assert env.delete_machine(target.name, machine.id) is True
    assert machine.id not in {m.id for m in env.provider(target.name).list_machines()}


def test_the_catalog_tells_the_guard_from_the_provider_by_type(tmp_path):
    env = FleetEnv.from_settings(Settings(state_dir=tmp_path))
    acts = CapacityActivities(env)
    revoked, refused = env.config.sites[0], env.config.sites[1]
    assert revoked.account != refused.account
    env.accounts.mark_revoked(revoked.account, revoked.provider, "revoked earlier")
    env.world.set_credentials_valid(refused.account, False)

    entries = {e.site: e for e in acts._refresh()}
    assert entries[revoked.name].error_type == "AccountRevoked"  # the guard: already reported, no call
    assert entries[refused.name].error_type == "BadCredentials"  # the provider's answer: to be reported


def _spec(target: Site):
    from fleet.models import MachineSpec

    return MachineSpec(name="guard-test-node", site=target.name, region=target.region,
                       instance_type=target.instance_type, gpu=target.gpu, gpus=target.gpus_per_machine)


def test_draining_a_node_already_gone_is_done(tmp_path):
    """A reclaim the provider finished first: nothing to drain, not a failure retried forever."""
    from fleet.messages.capacity import DrainNodeInput

    env = FleetEnv.from_settings(Settings(state_dir=tmp_path))
    result = ActivityEnvironment().run(CapacityActivities(env).drain_within,
                                       DrainNodeInput(node_name="gone-node", deadline_seconds=1))
    assert result.completed and result.node == "gone-node" and not result.evicted


def test_a_failure_names_its_type_once():
    """Progress lines and reasons read ``Type: message``. A typed ApplicationError's text already
    starts with its type, and every typed activity failure read ``ServingNotFound:
    ServingNotFound: ...`` in rollouts, repairs and evacuations."""
    from temporalio.exceptions import ActivityError, ApplicationError, RetryState

    from workflows.steps import failure_text

    def failed(cause: ApplicationError) -> ActivityError:
        error = ActivityError("activity error", scheduled_event_id=1, started_event_id=2, identity="w",
                              activity_type="rollback_serving", activity_id="1", retry_state=RetryState.NON_RETRYABLE_FAILURE)
        error.__cause__ = cause
        return error

    typed = failed(ApplicationError("no Deployment m at site-b", type="ServingNotFound"))
    assert failure_text(typed) == "ServingNotFound: no Deployment m at site-b"
    untyped = failed(ApplicationError("the API server did not answer"))
    assert failure_text(untyped) == "ApplicationError: the API server did not answer"


def test_the_recovery_watch_takes_a_cluster_api_away_for_no_change(tmp_path, monkeypatch):
    """In an evacuation's needs-person wait, ``watch_recovery`` reads at every probe which models
    nothing may take. A cluster API away meanwhile is no answer, so no change: the watch waits on to
    its bound (raised, it would fail the evacuation; read as a change, it would wake the workflow to
    read its facts again at every probe, the poll this watch replaced)."""
    from activities.watches import WatchActivities
    from fleet.errors import Transient
    from fleet.messages.watches import RecoveryWatchInput

    env = FleetEnv.from_settings(Settings(state_dir=tmp_path))
    site_name = env.config.sites[0].name

    def away(*_args, **_kwargs):
        raise Transient("GET /apis/apps/v1/deployments: 503 Service Unavailable", provider="kubernetes", code="503")

    monkeypatch.setattr(env.cluster, "list_serving", away)
    watched = ActivityEnvironment().run(WatchActivities(env).watch_recovery, RecoveryWatchInput(
        site=site_name, recovered=False, impossible=["llm"], probe_seconds=0.05, max_wait_seconds=0.3))
    assert (watched.recovered, watched.detail, watched.placing_changed) == (False, "no nodes at the site", False)
