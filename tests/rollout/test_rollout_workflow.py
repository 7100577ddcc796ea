"""ModelRollout end to end: real Temporal dev server, simulated cluster, moto S3 stores."""

from __future__ import annotations

import asyncio
import re
import json
import threading
from datetime import datetime, timedelta, timezone
from typing import Callable, NamedTuple

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    WithStartWorkflowOperation, WorkflowExecutionStatus, WorkflowFailureError, WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.service import RPCError

from activities import weights
from activities.weights import Replicator
from fleet.cluster import ServingSpec, SiteRoute
from fleet.errors import ClusterInvalid, InvalidRequest
from activities.serving import ROLLOUT_CLAIM_KIND, ServingActivities
from fleet.messages.rollout import RollbackSiteInput
from fleet.rollout import RolloutProgress, RolloutResult
from providers.cluster.kubernetes import render_pod_template
from tests.conftest import visibility_lagging, wait_for
from tests.details_helpers import current_details, decided, held, scheduled
from tests.details_helpers import until as until_utc
from tests.evacuation_helpers import activity_inputs, cancel_seen, poll
from tests.replay import replay_and_record
from sim.cluster import SimCluster
from tests.rollout.conftest import MODEL, RolloutStack


async def progress(handle) -> RolloutProgress | None:
    try:
        return await handle.query("progress", result_type=RolloutProgress)
    except Exception:  # noqa: BLE001 - the first workflow task may not have run yet
        return None


async def until(handle, predicate, timeout: float = 30) -> RolloutProgress:
    """Poll the progress query until ``predicate(progress)``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        p = await progress(handle)
        if p is not None and predicate(p):
            return p
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met; last progress: {p}")
        await asyncio.sleep(0.1)


def states(p: RolloutProgress) -> dict[str, str]:
    return {s.site: s.state.value for s in p.sites}


async def failure_of(handle) -> ApplicationError:
    with pytest.raises(WorkflowFailureError) as caught:
        await handle.result()
    assert isinstance(caught.value.cause, ApplicationError)
    return caught.value.cause


async def test_rollout_happy_path(rollout_stack: RolloutStack) -> None:
    stack = rollout_stack
    stack.serve_v1(["site-a"])  # site-b gets the model for the first time
    handle = await stack.start(stack.request({"site-a": 2, "site-b": 1}), "happy")
    result = RolloutResult.model_validate(await handle.result())
    assert result.outcome == "completed"
    assert {s.site: s.state.value for s in result.sites} == {"site-a": "done", "site-b": "done"}
    assert stack.image("site-a") == "img:v2" and stack.image("site-b") == "img:v2"
    status = stack.cluster.serving_status(MODEL, "site-a")
    assert status.desired_replicas == 2 and status.can_rollback
    for site in ("site-a", "site-b"):
        store = stack.stores[site]
        listed = stack.s3.client(store).list_objects_v2(Bucket=store.bucket, Prefix="models/llm/v2/")
        assert {o["Key"].rsplit("/", 1)[1] for o in listed["Contents"]} == {f["path"] for f in stack.files}
    untouched = stack.stores["site-c"]
    assert stack.s3.client(untouched).list_objects_v2(Bucket=untouched.bucket).get("KeyCount", 0) == 0

    query = f'WorkflowId = "{handle.id}" AND Model = "{MODEL}" AND ModelVersion = "v2" AND FleetState = "completed"'

    async def listed() -> list:
        return [w async for w in stack.client.list_workflows(query)]

    for _ in range(50):
        if await listed():
            break
        await asyncio.sleep(0.1)
    assert len(await listed()) == 1
    description = await handle.describe()
    details = description.raw_description.workflow_extended_info  # noqa: F841 - exists on this server
    # The operator's table: sites x state.
    p = await progress(handle)
    assert states(p) == {"site-a": "done", "site-b": "done"}

    # Each site's pods pull the verified weights from that site's own store: the spec carries
    # the store (its credentials only as a reference), the version's prefix and the manifest.
    specs = {i["spec"]["site"]: ServingSpec.model_validate(i["spec"]) for i in await inputs(handle, "update_serving")}
    for site, spec in specs.items():
        store = stack.stores[site]
        assert spec.weights is not None and spec.weights.store.bucket == store.bucket
        assert spec.weights.prefix == "models/llm/v2/" and spec.weights.version == "v2"
        assert {f.path: f.sha256 for f in spec.weights.files} == {f["path"]: f["sha256"] for f in stack.files}
        assert spec.weights.store.credentials == store.credentials
        pod = render_pod_template(spec)["spec"]
        assert [c["name"] for c in pod["initContainers"]] == ["weights"]
        assert all(v.get("hostPath", {}).get("path") != spec.weights_path for v in pod["volumes"])
    # Each switch told the model's Routing entity: the site new to the model has its route.
    events = [i["event"] for i in await inputs(handle, "routing_event")]
    assert sorted((e["kind"], e["site"]) for e in events) == [("rollout", "site-a"), ("rollout", "site-b")]
    await wait_for(lambda: (t := stack.cluster.get_routing(MODEL)) and t.sites.get("site-b")
                   and t.sites["site-b"].weight > 0)


async def inputs(handle, activity_type: str) -> list[dict]:
    history = await handle.fetch_history()
    return [json.loads(e.activity_task_scheduled_event_attributes.input.payloads[0].data) for e in history.events
            if e.HasField("activity_task_scheduled_event_attributes")
            and e.activity_task_scheduled_event_attributes.activity_type.name == activity_type]


async def test_bad_input_rejected_before_copying(rollout_stack: RolloutStack) -> None:
    stack = rollout_stack
    bad = stack.request({"site-a": 1, "nowhere": 1})
    error = await failure_of(await stack.start(bad, "unknown-site"))
    assert error.type == "InvalidInput" and "unknown site 'nowhere'" in str(error)
    missing = stack.request({"site-a": 1})
    del missing["weights"]["files"][0]["sha256"]
    assert (await failure_of(await stack.start(missing, "no-sha"))).type == "InvalidInput"
    zero = stack.request({"site-a": 0, "site-b": 0})
    assert "zero replicas" in str(await failure_of(await stack.start(zero, "zero")))
    store = stack.stores["site-a"]
    assert stack.s3.client(store).list_objects_v2(Bucket=store.bucket).get("KeyCount", 0) == 0


async def test_a_replica_no_machine_of_a_site_can_hold_is_refused_before_copying(rollout_stack: RolloutStack) -> None:
    """16 GPUs per replica on sites of 8-GPU machines: the pods could never be scheduled. The
    rollout copied every weight, waited out ``ready_timeout_seconds`` and rolled back; now it is
    refused at start, naming the field and the sites, with nothing copied or applied."""
    stack = rollout_stack
    request = stack.request({"site-a": 1, "site-b": 1})
    request["gpus_per_replica"] = 16
    handle = await stack.start(request, "too-big")
    error = await failure_of(handle)
    assert error.type == "InvalidInput" and error.non_retryable, error
    assert "gpus_per_replica: 16 GPUs per replica" in str(error), error
    assert "site-a (8 GPUs per machine), site-b (8 GPUs per machine)" in str(error), error
    history = await handle.fetch_history()
    scheduled = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                 if e.HasField("activity_task_scheduled_event_attributes")]
    assert scheduled == ["resolve_rollout_sites"], "only the look-up ran: no copy, no Deployment"
    for site in ("site-a", "site-b"):
        store = stack.stores[site]
        assert stack.s3.client(store).list_objects_v2(Bucket=store.bucket).get("KeyCount", 0) == 0
        assert stack.image(site) is None


async def test_a_model_whose_kubernetes_name_another_served_model_has_is_refused(rollout_stack: RolloutStack) -> None:
    """``LLM`` and ``llm`` are one Kubernetes name: the adapter's Deployment, Service, HTTPRoute
    and routing entry of one are the other's, so the rollout would replace the served model's
    template and fight over its route. The simulated cluster keys by the exact name; the refusal
    comes at start, naming ``model``, with nothing copied or applied."""
    stack = rollout_stack
    stack.serve_v1(["site-a"])
    before = stack.cluster.serving_status(MODEL, "site-a")
    request = stack.request({"site-a": 1, "site-b": 1})
    request["model"] = MODEL.upper()
    handle = await stack.start(request, "clash")
    error = await failure_of(handle)
    assert error.type == "InvalidInput" and error.non_retryable, error
    assert "model: 'llm' and 'LLM' are one Kubernetes name (llm): 'llm' is served at site-a" in str(error), error
    history = await handle.fetch_history()
    scheduled = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                 if e.HasField("activity_task_scheduled_event_attributes")]
    assert scheduled == ["resolve_rollout_sites"], "only the look-up ran: no copy, no Deployment"
    assert stack.cluster.serving_status(MODEL, "site-a") == before
    assert [(s.model, s.site) for s in stack.cluster.list_serving()] == [(MODEL, "site-a")]
    await replay_and_record(handle, "rollout_refused_kubernetes_name_clash")


def only_the_look_up_ran(history) -> None:
    scheduled = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                 if e.HasField("activity_task_scheduled_event_attributes")]
    assert scheduled == ["resolve_rollout_sites"], "only the look-up ran: no copy, no Deployment"


@pytest.mark.parametrize("rollout_stack", [{"LLM": {"sites": ["site-c"]}}], indirect=True)
async def test_a_model_whose_kubernetes_name_a_configured_model_has_is_refused(rollout_stack: RolloutStack) -> None:
    """``LLM`` is in the fleet config's ``models:`` but served nowhere yet: a rollout of ``llm``
    would take the Deployments, Services and route that ``LLM``'s first rollout writes."""
    stack = rollout_stack
    handle = await stack.start(stack.request({"site-a": 1, "site-b": 1}), "configured-clash")
    error = await failure_of(handle)
    assert error.type == "InvalidInput" and error.non_retryable, error
    assert ("model: 'LLM' and 'llm' are one Kubernetes name (llm): 'LLM' is named in the fleet config "
            "(models.LLM); roll out under its name or rename the model") in str(error), error
    only_the_look_up_ran(await handle.fetch_history())
    assert stack.cluster.list_serving() == []


async def test_a_model_whose_serving_name_at_a_site_another_model_has_is_refused(rollout_stack: RolloutStack) -> None:
    """The adapter names a model's Deployment, Service and PodDisruptionBudget at a site
    ``<model>-<site>``: ``llm`` at ``site-a`` is ``llm-site`` at ``a``. The rollout would take
    that model's Deployment there; it is refused at start, naming the target and both models."""
    stack = rollout_stack
    stack.cluster.apply_serving(ServingSpec(model="llm-site", site="a", image="other:v1", replicas=1))
    handle = await stack.start(stack.request({"site-b": 1, "site-a": 1}), "serving-name-clash")
    error = await failure_of(handle)
    assert error.type == "InvalidInput" and error.non_retryable, error
    assert ("sites[1].site: 'llm-site' at a and 'llm' at site-a are one Kubernetes name (llm-site-a): 'llm-site' "
            "is served at a; rename the model or roll out to another site") in str(error), error
    assert "sites[0]" not in str(error)
    only_the_look_up_ran(await handle.fetch_history())
    assert [(s.model, s.site, s.image) for s in stack.cluster.list_serving()] == [("llm-site", "a", "other:v1")]


async def test_a_target_where_a_configured_model_has_the_serving_name_is_refused(temporal_env, tmp_path) -> None:
    """``a-b`` is to serve at ``c`` (the fleet config's ``models:``) and serves nowhere yet: a
    rollout of ``a`` to ``b-c`` would write the Deployment ``a-b``'s first rollout writes there."""
    from temporalio.testing import ActivityEnvironment

    from activities.env import FleetEnv
    from fleet.messages.rollout import ResolveRolloutSitesInput
    from tests.conftest import TEST_FLEET, make_settings, write_fleet

    site = TEST_FLEET["sites"][0]
    settings = make_settings(temporal_env, tmp_path)
    write_fleet(tmp_path, {**TEST_FLEET, "sites": [*TEST_FLEET["sites"], {**site, "name": "c"}, {**site, "name": "b-c"}],
                           "models": {"a-b": {"sites": ["c"]}}})
    look_up = ServingActivities(FleetEnv.from_settings(settings)).resolve_rollout_sites
    found = await ActivityEnvironment(client=temporal_env.client).run(
        look_up, ResolveRolloutSitesInput(sites=[site["name"], "b-c"], model="a"))
    assert found.problems == ["sites[1].site: 'a-b' at c and 'a' at b-c are one Kubernetes name (a-b-c): 'a-b' is "
                              "to serve at c (models.a-b in the fleet config); rename the model or roll out to "
                              "another site"]
    apart = await ActivityEnvironment(client=temporal_env.client).run(
        look_up, ResolveRolloutSitesInput(sites=[site["name"], "c"], model="a"))
    assert apart.problems == []


async def test_a_rollout_that_would_name_another_models_service_is_refused(temporal_env, tmp_path) -> None:
    """A model's model-wide Service is named after it (``a-b``), another's at a site after both
    (``a`` at ``b``: ``a-b`` too): either rollout would take the other model's Service. Refused
    at start both ways, the configured model counting as the served one does."""
    from temporalio.testing import ActivityEnvironment

    from activities.env import FleetEnv
    from fleet.messages.rollout import ResolveRolloutSitesInput
    from tests.conftest import TEST_FLEET, make_settings, write_fleet

    site = TEST_FLEET["sites"][0]
    settings = make_settings(temporal_env, tmp_path)
    write_fleet(tmp_path, {**TEST_FLEET, "sites": [*TEST_FLEET["sites"], {**site, "name": "b"}],
                           "models": {"a-b": {"sites": [site["name"]]}}})
    look_up = ServingActivities(FleetEnv.from_settings(settings)).resolve_rollout_sites
    run = ActivityEnvironment(client=temporal_env.client).run
    found = await run(look_up, ResolveRolloutSitesInput(sites=[site["name"], "b"], model="a"))
    assert found.problems == ["sites[1].site: 'a' at b and model 'a-b' name one Service (a-b): 'a-b' is a model; "
                              "rename the model or roll out to another site"]
    write_fleet(tmp_path, {**TEST_FLEET, "sites": [*TEST_FLEET["sites"], {**site, "name": "b"}],
                           "models": {"a": {"sites": ["b"]}}})
    look_up = ServingActivities(FleetEnv.from_settings(settings)).resolve_rollout_sites
    found = await run(look_up, ResolveRolloutSitesInput(sites=[site["name"]], model="a-b"))
    assert found.problems == ["model: 'a' at b and model 'a-b' name one Service (a-b): 'a' is to serve at b "
                              "(models.a in the fleet config); rename the model"]
    assert (await run(look_up, ResolveRolloutSitesInput(sites=[site["name"]], model="a-c"))).problems == []


def serve_elsewhere(stack: RolloutStack, count: int) -> list[str]:
    """``MODEL`` served at ``count`` more sites (Deployments only: the route counts them)."""
    sites = [f"old-{i:02d}" for i in range(count)]
    for site in sites:
        stack.cluster.apply_serving(ServingSpec(model=MODEL, site=site, image="img:v1", replicas=1))
    return sites


async def test_a_rollout_that_would_route_the_model_to_more_than_16_sites_is_refused(rollout_stack: RolloutStack) -> None:
    """Served at 15 sites, rolled out to two more: a rollout retires no site, so the model's
    HTTPRoute would need 17 backendRefs, which the API server refuses (Gateway API allows 16)
    when the route is written, after the copies and the Deployments. Refused at start, naming
    ``sites``, the targets and the sites it is served at."""
    stack = rollout_stack
    served = serve_elsewhere(stack, 15)
    handle = await stack.start(stack.request({"site-a": 1, "site-b": 1}), "17-sites")
    error = await failure_of(handle)
    assert error.type == "InvalidInput" and error.non_retryable, error
    assert ("sites: 'llm' would be routed to 17 sites, at most 16 (its HTTPRoute's backendRefs, Gateway API's "
            f"limit): the target sites (site-a, site-b); the sites it is served at already ({', '.join(served)})"
            in str(error)), error
    only_the_look_up_ran(await handle.fetch_history())
    for site in ("site-a", "site-b"):
        store = stack.stores[site]
        assert stack.s3.client(store).list_objects_v2(Bucket=store.bucket).get("KeyCount", 0) == 0
        assert stack.image(site) is None


async def test_two_rollouts_of_one_model_started_together_run_one_at_a_time(rollout_stack: RolloutStack,
                                                                            monkeypatch) -> None:
    """Two rollouts of one model (v2 and v3: one workflow id per version) started back to back,
    from code as from the ``temporal`` CLI, within the visibility store's lag: both ran, each
    rolling the model's Deployment to its own version. One acts: the other is refused at start,
    naming the one running, having copied and changed nothing; and the model is free the moment
    the first ends."""
    visibility_lagging(monkeypatch)
    stack = rollout_stack
    stack.serve_v1(["site-a"])
    versions = ("v2", "v3")
    twins = await asyncio.gather(*(stack.start(stack.request({"site-a": 1}, version=v, gate={"bake_seconds": 1}),
                                               "twin") for v in versions))
    ended = await asyncio.gather(*(twin.result() for twin in twins), return_exceptions=True)
    refused = [i for i, end in enumerate(ended) if isinstance(end, WorkflowFailureError)]
    assert len(refused) == 1, ended
    loser, winner = refused[0], 1 - refused[0]
    error = ended[loser].cause
    assert isinstance(error, ApplicationError) and error.type == "InvalidInput" and error.non_retryable, error
    assert (f"model: {twins[winner].id} is still running, and a model is rolled out by one rollout at a time: "
            f"wait for it to end, or stop it (gpufleet rollout abort {twins[winner].id})") in str(error), error
    only_the_look_up_ran(await twins[loser].fetch_history())
    store = stack.stores["site-a"]
    copied = stack.s3.client(store).list_objects_v2(Bucket=store.bucket, Prefix=f"models/llm/{versions[loser]}/")
    assert copied.get("KeyCount", 0) == 0
    assert RolloutResult.model_validate(ended[winner]).outcome == "completed"
    assert stack.image("site-a") == f"img:{versions[winner]}"
    after = await stack.start(stack.request({"site-a": 1}, version="v4"), "after")
    assert RolloutResult.model_validate(await after.result()).outcome == "completed"
    assert stack.image("site-a") == "img:v4"


async def test_a_paused_rollout_holds_its_model_until_it_is_aborted(rollout_stack: RolloutStack) -> None:
    """A paused rollout still runs: another version of its model is refused at start, naming it
    and how to stop it; so is one started where the paused one took no claim (started before
    rollouts claimed their model: Temporal's list shows it). Aborted, the model is free at once."""
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b"])
    first = await stack.start(stack.request({"site-a": 1, "site-b": 1}), "first")
    await first.execute_update("pause", "holding the first one")
    await until(first, lambda p: p.phase == "paused")
    refused = f"model: {first.id} is still running, and a model is rolled out by one rollout at a time"
    second = await stack.start(stack.request({"site-c": 1}, version="v3"), "second")
    error = await failure_of(second)
    assert error.type == "InvalidInput" and error.non_retryable and refused in str(error), error
    only_the_look_up_ran(await second.fetch_history())
    assert stack.cluster.delete_state(ROLLOUT_CLAIM_KIND, MODEL)
    third = await stack.start(stack.request({"site-c": 1}, version="v4"), "third")
    error = await failure_of(third)
    assert error.type == "InvalidInput" and refused in str(error), error
    only_the_look_up_ran(await third.fetch_history())
    assert stack.image("site-c") is None
    assert (await progress(first)).phase == "paused"

    await first.execute_update("abort", "make way for v5")
    assert RolloutResult.model_validate(await first.result()).outcome == "aborted"
    fifth = await stack.start(stack.request({"site-c": 1}, version="v5"), "fifth")
    assert RolloutResult.model_validate(await fifth.result()).outcome == "completed"
    assert stack.image("site-c") == "img:v5"


async def test_canary_fails_gate_rolled_back_others_untouched(rollout_stack: RolloutStack) -> None:
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b", "site-c"])
    stack.probe.set_error_rate(MODEL, "site-b", 0.6, image="img:v2")  # the new build answers 500s
    raw = stack.request({"site-a": 2, "site-b": 2, "site-c": 1}, canary_sites=["site-b"])
    error = await failure_of(await stack.start(raw, "canary-fails"))
    assert error.type == "RolloutFailed"
    assert "site-b" in str(error) and "3 of 5 probes failed" in str(error) and "rolled back" in str(error)
    assert stack.image("site-b") == "img:v1", "the canary is back on the previous version"
    for site in ("site-a", "site-c"):
        status = stack.cluster.serving_status(MODEL, site)
        assert status.image == "img:v1" and status.generation == 1, f"{site} was touched"


async def test_abort_midway_rolls_back_updated_sites(rollout_stack: RolloutStack) -> None:
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b", "site-c"])
    # site-c is under evacuation: the rollout updates a and b, then waits for c.
    stack.cluster.set_site_routes({"site-a": SiteRoute(weight=100), "site-b": SiteRoute(weight=100),
                                   "site-c": SiteRoute(weight=0, draining=True)})
    handle = await stack.start(stack.request({"site-a": 1, "site-b": 1, "site-c": 1}), "abort")
    p = await until(handle, lambda p: states(p) == {"site-a": "done", "site-b": "done", "site-c": "deferred"})
    assert "under evacuation" in p.site("site-c").detail
    assert stack.image("site-a") == stack.image("site-b") == "img:v2"
    await handle.execute_update("abort", "bad numbers on the dashboard")
    result = RolloutResult.model_validate(await handle.result())
    assert result.outcome == "aborted"
    assert {s.site: s.state.value for s in result.sites} == {
        "site-a": "rolled-back", "site-b": "rolled-back", "site-c": "skipped"}
    assert [stack.image(s) for s in ("site-a", "site-b", "site-c")] == ["img:v1"] * 3
    assert stack.cluster.serving_status(MODEL, "site-c").generation == 1
    # Each rollback is retried until done (0: no limit). Before, ten attempts: a few minutes of
    # API-server trouble left the site FAILED serving v2, and nothing tried again.
    rollbacks = [e.activity_task_scheduled_event_attributes.retry_policy.maximum_attempts
                 async for e in handle.fetch_history_events()
                 if e.HasField("activity_task_scheduled_event_attributes")
                 and e.activity_task_scheduled_event_attributes.activity_type.name == "rollback_site"]
    assert rollbacks == [0, 0], rollbacks
    with pytest.raises((WorkflowUpdateFailedError, RPCError)):  # finished: rejected
        await handle.execute_update("abort", "again")


async def test_an_abort_in_the_rollouts_first_task_is_taken(rollout_stack: RolloutStack) -> None:
    """An abort sent the moment a rollout appears (a script, a person's reflex) reaches the run's
    first task, whose updates the SDK hands to their handlers before ``run`` has built the
    progress: it was refused as "still starting" and the rollout went on to update every site.
    Update-with-start puts it there every time: now it is taken, and no site changes."""
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b"])
    raw = stack.request({"site-a": 1, "site-b": 1})
    workflow_id = f"rollout/{raw.get('model')}/{raw.get('version')}-first-task"
    start = WithStartWorkflowOperation("ModelRollout", raw, id=workflow_id, task_queue=stack.settings.task_queue,
                                       id_conflict_policy=WorkflowIDConflictPolicy.FAIL)
    taken = await stack.client.execute_update_with_start_workflow(
        "abort", "test: stopped at once", start_workflow_operation=start)
    assert taken["aborting"], taken
    handle = await start.workflow_handle()
    result = RolloutResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert result.outcome == "aborted"
    assert [stack.image(s) for s in ("site-a", "site-b")] == ["img:v1"] * 2, "no site was updated"
    await replay_and_record(handle, "rollout_aborted_in_its_first_task")


async def test_an_abort_after_a_scale_puts_the_old_version_back(rollout_stack: RolloutStack) -> None:
    """A scale while the site bakes (an evacuation elsewhere adding replicas, an autoscaler,
    ``kubectl scale``) raises the Deployment's generation. Before: the rollback took that for
    "already rolled back", did nothing, and reported the site rolled back while it served v2."""
    stack = rollout_stack
    stack.serve_v1(["site-a"])
    handle = await stack.start(stack.request({"site-a": 2}, gate={"bake_seconds": 30}), "scale-abort")
    await until(handle, lambda p: states(p)["site-a"] == "baking")
    assert stack.image("site-a") == "img:v2"
    stack.cluster.scale_serving(MODEL, "site-a", 3)
    await handle.execute_update("abort", "bad numbers")
    result = RolloutResult.model_validate(await handle.result())
    assert result.outcome == "aborted" and result.sites[0].state.value == "rolled-back"
    status = stack.cluster.serving_status(MODEL, "site-a")
    # v1 back; the 3 replicas someone asked for since the update stay theirs.
    assert (status.image, status.desired_replicas) == ("img:v1", 3)
    await replay_and_record(handle, "rollout_aborted_after_a_scale")


async def test_a_rollback_puts_back_the_replicas_and_runs_once(rollout_stack: RolloutStack) -> None:
    """Before: the site went back to v1 with the rollout's replica count (1 of its 2), and nobody
    was told. A rollback retried after it happened changes nothing (the activity, run again)."""
    stack = rollout_stack
    stack.serve_v1(["site-a"])  # 2 replicas
    handle = await stack.start(stack.request({"site-a": 1}, gate={"bake_seconds": 30}), "replicas-abort")
    await until(handle, lambda p: states(p)["site-a"] == "baking")
    assert stack.cluster.serving_status(MODEL, "site-a").desired_replicas == 1
    await handle.execute_update("abort", "bad numbers")
    RolloutResult.model_validate(await handle.result())
    status = stack.cluster.serving_status(MODEL, "site-a")
    assert (status.image, status.desired_replicas) == ("img:v1", 2)
    [rollback] = await activity_inputs(handle, "rollback_site")
    again = ServingActivities(stack.env).rollback_site(RollbackSiteInput.model_validate(rollback))
    assert (again.image, again.desired_replicas, again.template) == (status.image, 2, status.template)


async def test_the_rollback_of_an_update_that_gave_no_answer_goes_back_only_if_it_landed(
        rollout_stack: RolloutStack) -> None:
    """An update that gave no answer (it failed, a cancel came) may or may not have applied. Where it
    did not, "back to the previous template" would take the site to the version before the one it
    served (v0); where it did, v1 comes back with its replicas, once."""
    stack = rollout_stack
    stack.cluster.apply_serving(ServingSpec(model=MODEL, site="site-a", image="img:v0", replicas=2))
    stack.serve_v1(["site-a"])
    v1 = stack.cluster.serving_status(MODEL, "site-a")
    undo = RollbackSiteInput(model=MODEL, site="site-a", had_previous=True, previous_template=v1.template,
                             previous_replicas=2, updated_replicas=1, unanswered_image="img:v2")
    serving = ServingActivities(stack.env)
    not_landed = serving.rollback_site(undo)
    assert (not_landed.image, not_landed.generation) == ("img:v1", v1.generation)
    stack.cluster.apply_serving(ServingSpec(model=MODEL, site="site-a", image="img:v2", replicas=1))
    landed = serving.rollback_site(undo)
    assert (landed.image, landed.desired_replicas, landed.template) == ("img:v1", 2, v1.template)
    again = serving.rollback_site(undo)  # a retried attempt
    assert (again.image, again.generation) == ("img:v1", landed.generation)


async def test_a_site_its_replicas_fill_is_updated_one_replica_at_a_time(rollout_stack: RolloutStack) -> None:
    """Two replicas of 4 GPUs fill site-a's one 8-GPU node. The update surged (maxSurge 1,
    maxUnavailable 0): its new replica found no GPUs, no old one went, and the readiness wait
    ended in ServingNotReady and a rollback: a rollout that could never pass at a full site. Now
    the update replaces one replica at a time there, and the details say so."""
    stack = rollout_stack
    stack.cluster.apply_serving(ServingSpec(model=MODEL, site="site-a", image="img:v1", replicas=2,
                                            gpus_per_replica=4))
    handle = await stack.start({**stack.request({"site-a": 2}), "gpus_per_replica": 4}, "full-site")
    result = RolloutResult.model_validate(await handle.result())
    assert result.outcome == "completed", result.reason
    assert result.sites[0].detail == "serving v2 (replaced one at a time: no room for a surge replica)"
    status = stack.cluster.serving_status(MODEL, "site-a")
    assert (status.image, status.available_replicas, status.max_surge) == ("img:v2", 2, 0)
    await replay_and_record(handle, "rollout_full_site_one_at_a_time")


async def test_a_full_sites_one_replica_is_replaced_only_while_another_site_serves(
        rollout_stack: RolloutStack) -> None:
    """One replica of 8 GPUs fills site-a. Replaced one at a time, the model is down there until
    the new replica is ready: taken where another site serves it (said in the details), refused
    where site-a's replica is the model's only one (product rule 11), nothing changed."""
    stack = rollout_stack
    for site in ("site-a", "site-b"):
        stack.cluster.apply_serving(ServingSpec(model=MODEL, site=site, image="img:v1", replicas=1,
                                                gpus_per_replica=8))
    stack.cluster.scale_serving(MODEL, "site-b", 0)  # site-a alone serves
    raw = {**stack.request({"site-a": 1}), "gpus_per_replica": 8}
    refused = await failure_of(await stack.start(raw, "only-replica"))
    assert "no room for a surge replica at site-a" in str(refused), str(refused)
    assert "would leave llm served nowhere" in str(refused), str(refused)
    assert stack.image("site-a") == "img:v1"

    stack.cluster.scale_serving(MODEL, "site-b", 1)
    result = RolloutResult.model_validate(await (await stack.start(raw, "one-replica")).result())
    assert result.outcome == "completed", result.reason
    assert result.sites[0].detail == ("serving v2 (replaced one at a time: no room for a surge replica; its one "
                                       "replica was down until the new one was ready)")
    assert stack.image("site-a") == "img:v2" and stack.image("site-b") == "img:v1"
    # Run again, site-a alone serving: already on v2, no replica is replaced, nothing is refused.
    stack.cluster.scale_serving(MODEL, "site-b", 0)
    again = RolloutResult.model_validate(await (await stack.start(raw, "again")).result())
    assert again.outcome == "completed" and again.sites[0].detail == "serving v2", again


async def test_the_readiness_wait_and_the_bake_say_until_when(rollout_stack: RolloutStack) -> None:
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b"])
    # No GPUs for 20 replicas at site-a: its readiness wait lasts its whole timeout.
    waiting = await stack.start(stack.request({"site-a": 20}, gate={"ready_timeout_seconds": 5}), "ready-until")
    p = await until(waiting, lambda p: "to be ready" in p.site("site-a").detail)
    assert re.fullmatch(r"waiting for 20 replicas of v2 to be ready, until \d\d:\d\d:\d\d UTC",
                        p.site("site-a").detail), p.site("site-a").detail
    assert "not ready by" in (await failure_of(waiting)).message  # and rolled back
    baking = await stack.start(stack.request({"site-b": 2}, gate={"bake_seconds": 30}), "bake-until")
    p = await until(baking, lambda p: states(p)["site-b"] == "baking")
    assert re.fullmatch(r"30s, until \d\d:\d\d:\d\d UTC, then the gate again", p.site("site-b").detail)
    await baking.execute_update("abort", "done looking")
    await baking.result()


async def test_a_site_rolling_back_says_what_to_and_that_it_has_no_deadline(rollout_stack: RolloutStack,
                                                                            monkeypatch) -> None:
    """A rollback is retried until the cluster answers (a put-back that gave up would leave the site
    serving the version it was rolled back from): the site's row says what it is rolled back to and
    that the wait has no deadline, and why. Before, only the abort's reason: an API server away for
    an hour left the rollout "aborting", the site "rolling-back", nothing saying what it waited on."""
    stack = rollout_stack
    stack.serve_v1(["site-a"])
    rolling_back, go_on = held(monkeypatch, SimCluster, "rollback_serving")
    handle = await stack.start(stack.request({"site-a": 2}, gate={"bake_seconds": 300}), "rollback-no-deadline")
    await until(handle, lambda p: states(p)["site-a"] == "baking")
    await handle.execute_update("abort", "bad numbers")
    try:
        assert await asyncio.to_thread(rolling_back.wait, 30), "the rollback began"
        shown = await current_details(handle)
        p = await progress(handle)
    finally:
        go_on.set()
    detail = ("bad numbers; rolling back to img:v1: retried until the cluster answers (no deadline: a put-back "
              "that gave up would leave the change in place)")
    assert (states(p)["site-a"], p.site("site-a").detail) == ("rolling-back", detail), p
    assert any(line.startswith("| site-a") and "| rolling-back |" in line and line.endswith(f"| {detail} |")
               for line in shown.split("\n")), shown
    result = RolloutResult.model_validate(await asyncio.wait_for(handle.result(), 30))
    assert result.outcome == "aborted" and stack.image("site-a") == "img:v1", result


async def test_a_site_copying_its_weights_says_until_when(rollout_stack: RolloutStack) -> None:
    """A site copies its weights for up to ``replication.timeout_seconds`` a try (6 h by default): its
    row says so, until when in UTC, where it was empty; and a copy the rollout's cancel stops no
    longer does."""
    stack = rollout_stack
    raw = stack.request({"site-a": 1})
    raw["replication"].update(bandwidth_limit_bytes_per_s=16 * 1024, timeout_seconds=7200)  # a copy of ~13 s
    handle = await stack.start(raw, "copy-until")
    p = await until(handle, lambda p: states(p)["site-a"] == "replicating")
    began, _ = await scheduled(handle, "replicate_weights")
    copying = (f"copying {len(stack.files)} weight files to s3://{stack.stores['site-a'].bucket} "
               f"{until_utc(began, 7200)} (per try)")
    assert p.site("site-a").detail == copying, p.site("site-a").detail
    assert f"| replicating | 0/{len(stack.files)} files" in (shown := await current_details(handle)), shown
    assert copying in shown, shown

    await handle.cancel()
    with pytest.raises(WorkflowFailureError):
        await handle.result()
    p = await progress(handle)
    assert p.phase == "cancelled" and [(s.state.value, s.detail) for s in p.sites] == [("skipped", "copy stopped")], p


def open_uploads(stack: RolloutStack, site: str) -> list[str]:
    """The keys of the multipart uploads open in ``site``'s store: parts the store keeps, and bills."""
    store = stack.stores[site]
    return [u["Key"] for u in stack.s3.client(store).list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])]


@pytest.mark.parametrize("stop", ["abort", "cancel"])
async def test_a_copy_the_rollout_stops_aborts_its_open_upload_before_the_rollout_ends(
        rollout_stack: RolloutStack, stop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An abort (or Temporal's cancel) while a site's file is part-way through its multipart upload
    stops the copy, which aborts that upload as it stops (no try of it comes back to continue it),
    and the rollout waits for that, saying so in its details and until when (twice the copy's
    heartbeat: it hears the stop at its next one). Before, the rollout went on at once, the copy
    heard the stop only as ``not_found`` (what a try whose heartbeat timed out hears while its retry
    resumes the upload), and the upload stayed open, its parts stored and billed by the site's store
    for good (no setup in the docs adds a lifecycle rule that would expire them)."""
    stack = rollout_stack
    raw = stack.request({"site-b": 1})
    raw["replication"].update(bandwidth_limit_bytes_per_s=8 * 1024, heartbeat_seconds=10)  # a copy of ~45 s
    handle = await stack.start(raw, f"{stop}-mid-copy")
    # The copy's abort of its upload is held until the test has read what the rollout says meanwhile.
    aborting, release = held(monkeypatch, Replicator, "_abort")
    await wait_for(lambda: open_uploads(stack, "site-b"), timeout=30)
    if stop == "abort":
        await handle.execute_update("abort", "wrong weights")
    else:
        await handle.cancel()
    p = await until(handle, lambda p: p.site("site-b").detail.startswith("stopping the copy"))
    asked, _ = await decided(handle, lambda e: e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED)
    by = until_utc(asked, 20)
    assert p.site("site-b").detail == ("stopping the copy: at its next heartbeat it aborts its open upload, which "
                                        f"nothing would resume; waiting for that {by} at the latest"), p
    why = "wrong weights" if stop == "abort" else "cancelled"
    assert p.reason == (f"{why}: waiting for the weights copies to site-b to stop and abort their open uploads "
                        f"(else stored and billed for good), {by} at the latest"), p.reason
    assert p.reason in await current_details(handle)
    await wait_for(aborting.is_set, timeout=30)  # the copy heard the stop and aborts its upload ...
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING  # ... and the rollout waits
    release.set()
    if stop == "abort":
        assert RolloutResult.model_validate(await handle.result()).outcome == "aborted"
    else:
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    assert open_uploads(stack, "site-b") == []  # gone as the rollout ends: nothing stored, nothing billed
    p = await progress(handle)
    assert [(s.state.value, s.detail) for s in p.sites] == [("skipped", "copy stopped")], p
    await replay_and_record(handle, {"abort": "rollout_aborted_while_copying",
                                     "cancel": "rollout_cancelled_while_copying"}[stop])


async def test_a_copy_that_fails_for_good_leaves_no_upload_open(
        rollout_stack: RolloutStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A site's copy that fails for good part-way through a file (the store refusing a part) leaves its
    multipart upload open, and no copy resumes it (the next rollout starts an upload of its own): once
    every copy has ended, the rollout aborts the uploads open under its own key prefix at each site
    whose copy did not finish (``abort_weights_uploads``; what a stop that lands between two tries of a
    copy, or a try that never answers, leaves too), and only those: an upload under another version's
    prefix stays. Before, the upload stayed open, stored and billed for good."""
    stack = rollout_stack
    store, s3 = stack.stores["site-b"], stack.s3.client(stack.stores["site-b"])
    other = s3.create_multipart_upload(Bucket=store.bucket, Key=f"{store.prefix}models/{MODEL}/v20/config.json")
    parts = 0

    def refuse_the_second_part(site: str, path: str, attempt: int, data: bytes) -> bytes:
        nonlocal parts
        if site == "site-b" and path == "model-00001.safetensors":
            parts += 1
            if parts > 1:
                raise InvalidRequest("upload part: 400 InvalidArgument")
        return data

    monkeypatch.setattr(weights, "TRANSIT_FAULT", refuse_the_second_part)
    handle = await stack.start(stack.request({"site-b": 1}), "copy-fails")
    failed = await failure_of(handle)
    assert "weights replication" in failed.message and "InvalidRequest" in failed.message, failed.message
    assert open_uploads(stack, "site-b") == [f"{store.prefix}models/{MODEL}/v20/config.json"]
    p = await progress(handle)
    assert p.site("site-b").detail.endswith("; 1 upload(s) left open aborted"), p.site("site-b").detail
    s3.abort_multipart_upload(Bucket=store.bucket, Key=f"{store.prefix}models/{MODEL}/v20/config.json",
                              UploadId=other["UploadId"])
    await replay_and_record(handle, "rollout_copy_failed_aborts_its_upload")


async def test_an_abort_cuts_the_readiness_wait_short(rollout_stack: RolloutStack) -> None:
    """Before: an abort while a site's new replicas were not ready waited out the whole
    ``ready_timeout_seconds`` (600 s by default, up to a day) before it rolled back."""
    stack = rollout_stack
    stack.serve_v1(["site-a"])
    # No GPUs for 20 replicas: the readiness wait would last its whole ten minutes.
    handle = await stack.start(stack.request({"site-a": 20}, gate={"ready_timeout_seconds": 600}), "abort-waiting")
    await until(handle, lambda p: "to be ready" in p.site("site-a").detail)
    await handle.execute_update("abort", "wrong image")
    # Rolled back long before the wait's end (the bound only guards against a hang).
    result = RolloutResult.model_validate(await asyncio.wait_for(handle.result(), 120))
    assert result.outcome == "aborted" and result.sites[0].state.value == "rolled-back"
    status = stack.cluster.serving_status(MODEL, "site-a")
    assert (status.image, status.desired_replicas) == ("img:v1", 2)
    await replay_and_record(handle, "rollout_aborted_while_waiting_for_ready")


class CancelAt(NamedTuple):
    """Where a cancel lands: the sites' replicas, the gate, the progress that shows the rollout is
    there, the sites it changed by then, and the name of the history recorded."""

    sites: dict[str, int]
    gate: dict
    there: Callable[[RolloutProgress], bool]
    changed: list[str]
    history: str


CANCEL_AT = {
    # No GPUs for 20 replicas: the canary's readiness wait lasts its whole ten minutes.
    "readiness wait": CancelAt({"site-a": 20, "site-b": 1}, {"ready_timeout_seconds": 600},
                               lambda p: "to be ready" in p.site("site-a").detail, ["site-a"],
                               "rollout_cancelled_while_waiting_for_ready"),
    "bake": CancelAt({"site-a": 2, "site-b": 2}, {"bake_seconds": 300}, lambda p: states(p)["site-a"] == "baking",
                     ["site-a"], "rollout_cancelled_while_baking"),
    # site-c is under evacuation: a and b updated, the rollout looks again every 0.2 s.
    "evacuation wait": CancelAt({"site-a": 1, "site-b": 1, "site-c": 1}, {"bake_seconds": 0},
                                lambda p: states(p) == {"site-a": "done", "site-b": "done", "site-c": "deferred"},
                                ["site-a", "site-b"], "rollout_cancelled_while_a_site_is_evacuated"),
}


@pytest.mark.parametrize("where", list(CANCEL_AT))
async def test_a_cancel_rolls_back_every_site_it_changed(rollout_stack: RolloutStack, where: str) -> None:
    """Temporal's cancel (the UI's button, ``temporal workflow cancel``) ended the rollout where it
    was: the canary went on serving the new image and the progress said "baking" for good. Now a
    cancel rolls back every site the rollout changed, as an abort does, and the run ends Canceled."""
    stack = rollout_stack
    at = CANCEL_AT[where]
    stack.serve_v1(list(at.sites))
    if "site-c" in at.sites:
        stack.cluster.set_site_routes({"site-a": SiteRoute(weight=100), "site-b": SiteRoute(weight=100),
                                       "site-c": SiteRoute(weight=0, draining=True)})
    handle = await stack.start(stack.request(at.sites, gate=at.gate), f"cancel-{where.replace(' ', '-')}")
    await until(handle, at.there)
    assert [stack.image(s) for s in at.changed] == ["img:v2"] * len(at.changed)
    await handle.cancel()
    # Each step lasts minutes or for ever: the bound only guards against a hang.
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(handle.result(), 120)
    assert isinstance(caught.value.cause, CancelledError), repr(caught.value.cause)
    assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED
    for site in at.sites:
        status = stack.cluster.serving_status(MODEL, site)
        assert (status.image, status.desired_replicas) == ("img:v1", 2), f"{site} not back: {status}"
    p = await progress(handle)
    assert (p.phase, p.reason) == ("cancelled", f"cancelled; rolled back: {', '.join(at.changed)}"), p
    assert states(p) == {s: "rolled-back" if s in at.changed else "skipped" for s in at.sites}, states(p)
    await replay_and_record(handle, at.history)


async def test_a_cancel_during_an_aborts_rollback_does_not_stop_it(rollout_stack: RolloutStack, monkeypatch) -> None:
    """A cancel that landed while an abort rolled a site back cancelled the rollback: the site was
    marked FAILED, "rollback failed", a person needed, and the rollout went on to end aborted. Then
    the rollback ran to its end, but the run still ended aborted (completed): the operator's cancel
    was absorbed. Now the rollback runs to its end and the run ends Canceled, phase ``cancelled``."""
    stack = rollout_stack
    stack.serve_v1(["site-a"])
    rolling_back, go_on = threading.Event(), threading.Event()
    roll_back = SimCluster.rollback_serving

    def held(self, model, site):
        rolling_back.set()
        go_on.wait(30)
        return roll_back(self, model, site)

    monkeypatch.setattr(SimCluster, "rollback_serving", held)
    handle = await stack.start(stack.request({"site-a": 2}, gate={"bake_seconds": 300}), "cancel-rollback")
    await until(handle, lambda p: states(p)["site-a"] == "baking")
    await handle.execute_update("abort", "bad numbers")
    await asyncio.to_thread(rolling_back.wait, 30)
    await handle.cancel()
    await poll(lambda: cancel_seen(handle), timeout=15)  # the run took the cancel while the rollback is held
    go_on.set()
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(handle.result(), 30)
    assert isinstance(caught.value.cause, CancelledError), repr(caught.value.cause)
    assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED
    assert stack.image("site-a") == "img:v1"
    p = await progress(handle)
    assert (p.phase, p.needs_person) == ("cancelled", ""), p
    assert p.reason == "cancelled as it rolled back (bad numbers); rolled back: site-a", p.reason
    assert states(p) == {"site-a": "rolled-back"}, states(p)
    await replay_and_record(handle, "rollout_cancelled_during_an_aborts_rollback")


async def test_a_cancel_during_a_sites_update_rolls_that_site_back(rollout_stack: RolloutStack,
                                                                    monkeypatch) -> None:
    """The update of a Deployment is one call to the cluster that hears no cancel: a cancel that
    landed during it ended the rollout at once, the call applied the new template anyway, and the
    site was marked skipped ("rolled back: site-a" only), serving v2 for good. Now the cancel waits
    for the update to its end and rolls that site back too."""
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b"])
    updating, go_on, applied = threading.Event(), threading.Event(), threading.Event()
    apply = SimCluster.apply_serving

    def held(self, spec):
        if spec.site != "site-b":
            return apply(self, spec)
        updating.set()
        go_on.wait(30)
        try:
            return apply(self, spec)
        finally:
            applied.set()

    monkeypatch.setattr(SimCluster, "apply_serving", held)
    # site-a is the canary: updated, gated and done before site-b's update begins.
    handle = await stack.start(stack.request({"site-a": 2, "site-b": 2}, gate={"bake_seconds": 0}), "cancel-update")
    await asyncio.to_thread(updating.wait, 30)
    await handle.cancel()
    await poll(lambda: cancel_seen(handle), timeout=15)  # the run took the cancel while the update is held
    go_on.set()
    await asyncio.to_thread(applied.wait, 30)
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(handle.result(), 30)
    assert isinstance(caught.value.cause, CancelledError), repr(caught.value.cause)
    assert [stack.image(s) for s in ("site-a", "site-b")] == ["img:v1"] * 2
    p = await progress(handle)
    assert (p.phase, p.reason) == ("cancelled", "cancelled; rolled back: site-a, site-b"), p
    assert states(p) == {"site-a": "rolled-back", "site-b": "rolled-back"}, states(p)
    await replay_and_record(handle, "rollout_cancelled_while_updating")


async def test_an_update_that_failed_after_writing_the_deployment_is_rolled_back(rollout_stack: RolloutStack,
                                                                                   monkeypatch) -> None:
    """An update that wrote the Deployment, then failed for good (its Service refused): the site was
    reported "rolled back (the Deployment was not changed)" while it served v2. Now it is rolled back."""
    stack = rollout_stack
    stack.serve_v1(["site-a"])
    apply = SimCluster.apply_serving

    def half_applied(self, spec):
        apply(self, spec)
        raise ClusterInvalid(f"service llm-{spec.site}: spec.ports[0].port: Invalid value", code="422")

    monkeypatch.setattr(SimCluster, "apply_serving", half_applied)
    handle = await stack.start(stack.request({"site-a": 2}), "update-fails")
    error = await failure_of(handle)
    assert error.type == "RolloutFailed" and "ClusterInvalid" in str(error), str(error)
    assert stack.image("site-a") == "img:v1"
    p = await progress(handle)
    assert states(p) == {"site-a": "rolled-back"} and not p.needs_person, p
    assert p.site("site-a").detail == "ClusterInvalid: service llm-site-a: spec.ports[0].port: Invalid value", p
    assert p.reason.endswith("Invalid value; rolled back"), p.reason
    await replay_and_record(handle, "rollout_update_failed_half_applied")


async def test_pause_holds_and_resume_continues(rollout_stack: RolloutStack) -> None:
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b"])
    handle = await stack.start(stack.request({"site-a": 1, "site-b": 1}, gate={"bake_seconds": 0}), "pause")
    await until(handle, lambda p: p.phase != "starting")
    await handle.execute_update("pause", "change freeze")
    with pytest.raises(WorkflowUpdateFailedError):
        await handle.execute_update("pause")  # the validator: already paused
    p = await until(handle, lambda p: p.phase == "paused")
    assert p.paused and all(s.state.value == "replicated" for s in p.sites), states(p)
    # Held: nothing updated while paused (replication done, canary not started).
    for _ in range(5):
        assert stack.image("site-a") == "img:v1"
        await asyncio.sleep(0.1)
    await handle.execute_update("resume")
    result = RolloutResult.model_validate(await handle.result())
    assert result.outcome == "completed" and stack.image("site-b") == "img:v2"
    with pytest.raises((WorkflowUpdateFailedError, RPCError)):
        await handle.execute_update("resume")  # finished


async def test_a_paused_rollout_says_it_has_no_deadline_and_what_ends_it(rollout_stack: RolloutStack) -> None:
    """Paused, a rollout waits between batches for a person, for as long as they take: its page
    says there is no deadline and which commands end the wait. Before: "paused", the operator's
    reason, nothing saying who ends the wait nor that nothing else will."""
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b"])
    handle = await stack.start(stack.request({"site-a": 1, "site-b": 1}, gate={"bake_seconds": 0}), "paused-says")
    await until(handle, lambda p: p.phase != "starting")
    await handle.execute_update("pause", "change freeze")
    await until(handle, lambda p: p.phase == "paused")
    head = (await current_details(handle)).split("\n")[0]
    assert head.startswith("**paused**") and "(paused)" not in head, head  # the phase says it once
    assert head.endswith(f"; no deadline: until `gpufleet rollout resume {handle.id}` (or "
                         f"`gpufleet rollout abort {handle.id}`, which rolls back the sites updated)"), head
    await handle.execute_update("resume")
    assert RolloutResult.model_validate(await handle.result()).outcome == "completed"
    assert "no deadline" not in await current_details(handle)


async def test_a_pause_while_the_canary_waits_out_an_evacuation_holds_when_it_comes_back(
        rollout_stack: RolloutStack) -> None:
    """Paused while its canary site was under evacuation (a wait of hours): the progress said
    "paused", yet when the site came back its Deployment was updated at once, the pause looked at
    only before the wait. Now the rollout holds there until resumed, and resumed, it looks at the
    site again: evacuated anew while paused, it waits again."""
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b"])
    stack.cluster.set_site_routes({"site-b": SiteRoute(weight=100),
                                   "site-a": SiteRoute(weight=0, healthy=False, draining=True, incident="inc-9")})
    handle = await stack.start(stack.request({"site-a": 1, "site-b": 1}, gate={"bake_seconds": 0}), "paused-canary")
    await until(handle, lambda p: p.phase == "canary" and states(p)["site-a"] == "deferred")
    await handle.execute_update("pause", "change freeze")
    stack.end_evacuation(["site-a"])
    await until(handle, lambda p: p.phase == "paused")
    for _ in range(10):  # five looks at the routes: the site is back
        assert stack.image("site-a") == "img:v1"
        await asyncio.sleep(0.1)
    # Evacuated again while paused (the pause may last days): resumed, the canary is looked at again.
    stack.cluster.set_site_routes({"site-a": SiteRoute(weight=0, healthy=False, draining=True, incident="inc-10")})
    await handle.execute_update("resume")
    progress = await until(handle, lambda p: p.phase == "canary" and "inc-10" in p.site("site-a").detail)
    assert states(progress)["site-a"] == "deferred" and stack.image("site-a") == "img:v1"
    stack.end_evacuation(["site-a"])
    result = RolloutResult.model_validate(await handle.result())
    assert result.outcome == "completed" and stack.image("site-a") == "img:v2"
    await replay_and_record(handle, "rollout_pauses_before_a_canary_back_from_evacuation")


async def test_evacuated_site_deferred_until_restored(rollout_stack: RolloutStack) -> None:
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b", "site-c"])
    # What SiteEvacuation decides for site-b (the Routing entity, told of each switch, keeps it).
    stack.cluster.set_site_routes({"site-a": SiteRoute(weight=100), "site-c": SiteRoute(weight=100),
                                   "site-b": SiteRoute(weight=0, healthy=False, draining=True, incident="inc-7")})
    raw = stack.request({"site-a": 1, "site-b": 1, "site-c": 1}, gate={"bake_seconds": 0})
    handle = await stack.start(raw, "evacuated")
    # site-c (after site-b in the queue) goes first; site-b waits.
    progress = await until(handle, lambda p: states(p) == {"site-a": "done", "site-b": "deferred", "site-c": "done"})
    assert stack.image("site-b") == "img:v1"
    # The wait says why and until when.
    detail = progress.site("site-b").detail
    assert "inc-7" in detail and re.search(r"next look at \d\d:\d\d:\d\d UTC", detail), detail
    await wait_for(lambda: (t := stack.cluster.get_routing(MODEL)) and t.sites["site-b"].incident == "inc-7")
    stack.cluster.set_site_routes({s: SiteRoute(weight=100) for s in ("site-a", "site-b", "site-c")})
    result = RolloutResult.model_validate(await handle.result())
    assert result.outcome == "completed" and stack.image("site-b") == "img:v2"


def scheduled_activities(history) -> list[str]:
    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
            if e.HasField("activity_task_scheduled_event_attributes")]


async def test_a_rollout_deferred_behind_an_evacuation_waits_in_one_activity(rollout_stack: RolloutStack) -> None:
    """A rollout whose next site was under evacuation looked again every ``evacuation_poll_seconds``
    with an activity and a timer (60 s: 120 actions an hour, about 11 history events a look), so a
    long outage took it to Temporal's history limit, which terminated it with its sites on two
    versions. Now one activity waits, reading the routes in the worker, for an hour at most; the
    rollout goes on when the evacuation ends."""
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b"])
    stack.cluster.set_site_routes({"site-a": SiteRoute(weight=100),
                                   "site-b": SiteRoute(weight=0, healthy=False, draining=True, incident="inc-3")})
    handle = await stack.start(stack.request({"site-a": 1, "site-b": 1}, gate={"bake_seconds": 0}), "deferred-waits")
    await until(handle, lambda p: states(p) == {"site-a": "done", "site-b": "deferred"})
    await asyncio.sleep(3)  # fifteen poll periods
    history = await handle.fetch_history()
    looks = [name for name in scheduled_activities(history) if name in ("site_evacuations", "wait_site_evacuations")]
    # The canary's look, the queue's, then one wait (before: a look and a timer every 0.2 s).
    assert looks == ["site_evacuations", "site_evacuations", "wait_site_evacuations"], looks
    assert not [e for e in history.events if e.HasField("timer_started_event_attributes")]
    (wait,) = await activity_inputs(handle, "wait_site_evacuations")
    started = history.events[0].event_time.ToDatetime(tzinfo=timezone.utc)
    assert datetime.fromisoformat(wait["until"]) - started >= timedelta(minutes=30), wait
    assert wait["seen"] == {"site-b": "inc-3"} and wait["poll_seconds"] == 0.2, wait
    # Why it waits, and until when: the routes are watched every poll, the rollout's own look later.
    detail = (await progress(handle)).site("site-b").detail
    assert re.fullmatch(r"under evacuation \(inc-3\); queued until restored \(watched every 0\.2 s, "
                        r"next look at \d\d:\d\d:\d\d UTC at the latest\)", detail), detail

    stack.end_evacuation(["site-a", "site-b"])
    result = RolloutResult.model_validate(await asyncio.wait_for(handle.result(), 30))
    assert result.outcome == "completed" and stack.image("site-b") == "img:v2"
    assert {s.site: s.state.value for s in result.sites} == {"site-a": "done", "site-b": "done"}
    await replay_and_record(handle, "rollout_waits_out_an_evacuation_in_one_activity")


@pytest.mark.parametrize("end", ["finishes", "aborted"])
async def test_a_rollout_continued_as_new_while_deferred_keeps_its_progress(continuing_rollout_stack: RolloutStack,
                                                                            end: str) -> None:
    """A rollout never continued as new, so its history grew for as long as an evacuation held a
    site back. Now, told to by Temporal (here after 50 events), it continues as new in that wait,
    carrying its progress and what a rollback needs: the next run updates only the sites left and
    finishes, or an abort there rolls back the site its first run updated."""
    from tests.can_server import run_chain
    from tests.test_continue_as_new import open_when_closed

    stack = continuing_rollout_stack
    stack.serve_v1(["site-a", "site-b"])
    stack.cluster.set_site_routes({"site-a": SiteRoute(weight=100),
                                   "site-b": SiteRoute(weight=0, healthy=False, draining=True, incident="inc-4")})
    handle = await stack.start(stack.request({"site-a": 1, "site-b": 1}, gate={"bake_seconds": 0}), f"continued-{end}")

    async def continued() -> list:
        chain = await run_chain(stack.client, handle.id, handle.result_run_id)
        return chain if len(chain) > 1 else []

    await poll(continued, timeout=30)
    latest = stack.client.get_workflow_handle(handle.id)
    p = await until(latest, lambda p: "inc-4" in p.site("site-b").detail)
    assert states(p) == {"site-a": "done", "site-b": "deferred"} and (p.batch, p.batches) == (1, 2), p
    assert p.site("site-a").detail == "serving v2" and p.site("site-a").previous_image == "img:v1", p
    if end == "finishes":
        stack.end_evacuation(["site-a", "site-b"])
        result = RolloutResult.model_validate(await asyncio.wait_for(latest.result(), 30))
        assert result.outcome == "completed", result
        assert {s.site: s.state.value for s in result.sites} == {"site-a": "done", "site-b": "done"}
        assert [stack.image(s) for s in ("site-a", "site-b")] == ["img:v2"] * 2
    else:
        await latest.execute_update("abort", "bad numbers")
        result = RolloutResult.model_validate(await asyncio.wait_for(latest.result(), 30))
        assert result.outcome == "aborted", result
        assert {s.site: s.state.value for s in result.sites} == {"site-a": "rolled-back", "site-b": "skipped"}
        status = stack.cluster.serving_status(MODEL, "site-a")
        assert (status.image, status.desired_replicas) == ("img:v1", 2), status
    chain = await run_chain(stack.client, handle.id, handle.result_run_id)
    for history in chain[:-1]:
        assert open_when_closed(history) == [], "an activity was open when the run continued as new"
    # The canary was copied to and updated once, by the first run: the later runs went on from there.
    later = [name for history in chain[1:] for name in scheduled_activities(history)]
    assert "replicate_weights" not in later and "resolve_rollout_sites" not in later, later
    assert later.count("update_serving") == (1 if end == "finishes" else 0), later
    if end == "finishes":
        first = stack.client.get_workflow_handle(handle.id, run_id=handle.result_run_id)
        await replay_and_record(first, "rollout_continued_as_new_while_deferred")
        await replay_and_record(latest, "rollout_finished_after_continue_as_new")
