"""SiteEvacuation and AcquireCapacity continue as new in their long waits and lose nothing.

A dev server of their own suggests continue-as-new at 50 events (the real one at
4,096), so both workflows continue as new within seconds of starting to wait.
Each run that continued as new is checked to have had no activity and no child
workflow open at that moment; the chain must then finish exactly as one run would.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from cli.dev import dev_server_tuning_flags, temporal_binary
from fleet import search_attributes
from fleet.messages.capacity import CapacityProgress, CapacityResult
from fleet.messages.evacuation import EvacuationProgress, EvacuationResult
from tests.capacity_fleet import CapStack, open_stack
from tests.evacuation_helpers import IncStack, open_incident_stack, poll
from tests.replay import replay_and_record

MODEL = "llm"


@pytest.fixture(scope="module")
async def can_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        data_converter=pydantic_data_converter,
        search_attributes=search_attributes.ALL,
        dev_server_log_level="error",
        dev_server_extra_args=[*dev_server_tuning_flags(),
                               "--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=50"],
    )
    try:
        yield env
    finally:
        await env.shutdown()


# -- helpers --------------------------------------------------------------------------------
async def run_chain(client: Client, workflow_id: str, first_run_id: str) -> list[WorkflowHistory]:
    """The histories of every run, first to latest, following continue-as-new."""
    histories = []
    run_id = first_run_id
    while True:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        histories.append(history)
        last = history.events[-1]
        if not last.HasField("workflow_execution_continued_as_new_event_attributes"):
            return histories
        run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id


def open_when_closed(history: WorkflowHistory) -> list[str]:
    """Activities and child workflows a run left open when it closed (by name)."""
    scheduled, children = {}, {}
    for e in history.events:
        if e.HasField("activity_task_scheduled_event_attributes"):
            scheduled[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
        for field in ("activity_task_completed_event_attributes", "activity_task_failed_event_attributes",
                      "activity_task_timed_out_event_attributes", "activity_task_canceled_event_attributes"):
            if e.HasField(field):
                scheduled.pop(getattr(e, field).scheduled_event_id, None)
        if e.HasField("start_child_workflow_execution_initiated_event_attributes"):
            children[e.event_id] = e.start_child_workflow_execution_initiated_event_attributes.workflow_type.name
        for field in ("start_child_workflow_execution_failed_event_attributes",
                      "child_workflow_execution_completed_event_attributes",
                      "child_workflow_execution_failed_event_attributes",
                      "child_workflow_execution_canceled_event_attributes",
                      "child_workflow_execution_timed_out_event_attributes",
                      "child_workflow_execution_terminated_event_attributes"):
            if e.HasField(field):
                children.pop(getattr(e, field).initiated_event_id, None)
    return sorted(scheduled.values()) + sorted(children.values())


async def continued_as_new(client: Client, workflow_id: str, first_run_id: str, times: int) -> bool:
    return len(await run_chain(client, workflow_id, first_run_id)) > times


# -- SiteEvacuation -------------------------------------------------------------------------
@pytest.fixture
async def inc(can_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[IncStack]:
    async for stack in open_incident_stack(can_env.client, tmp_path):
        yield stack


async def test_evacuation_continues_as_new_while_waiting_for_recovery_and_restores(inc: IncStack) -> None:
    a, d = inc.site("a"), inc.site("d")
    await inc.join("a", 3)
    await inc.join("d", 1)
    inc.serve(MODEL, "a", replicas=1)
    inc.serve(MODEL, "d", replicas=0)
    inc.world.set_site(a, unreachable=1)  # the provider is down: every agent at a stops dialing home
    handle = await inc.client.start_workflow(
        "SiteEvacuation", {"site": a, "reason": "test: provider down"}, id=f"evacuate/{a}/1",
        task_queue=inc.settings.task_queue,
    )
    first_run = handle.first_execution_run_id
    waiting: EvacuationProgress = await poll(lambda: _state(inc, "waiting-for-recovery"), timeout=60)
    # Two continue-as-new while probing: a continued run continues again.
    await poll(lambda: continued_as_new(inc.client, handle.id, first_run, times=2), timeout=60)

    carried: EvacuationProgress = await inc.progress("a")
    assert carried.state == "waiting-for-recovery"
    assert carried.timeline == waiting.timeline, "every mark (and its time) carried over"
    assert (carried.moves, carried.drained, carried.weights) == (waiting.moves, waiting.drained, waiting.weights)
    assert carried.moves == {MODEL: {d: 1}} and len(carried.drained) == 3
    chain = await run_chain(inc.client, handle.id, first_run)
    for history in chain[:-1]:
        assert open_when_closed(history) == [], "continued as new with an activity or child open"

    inc.world.set_site(a, unreachable=0)
    result = EvacuationResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert result.outcome == "restored"
    names = [s.name for s in result.timeline]
    assert names == [
        "detected", "weight 0", "replicas ready elsewhere", "drained", "recovered", "nodes proven",
        "replicas back", "weight 10%", "weight 50%", "weight 100%", "surplus drained", "restored",
    ]
    assert result.timeline[:len(waiting.timeline)] == waiting.timeline
    # What only the carried state knows: the weights before, the drained nodes, the replicas elsewhere.
    routes = inc.cluster.get_site_routes().sites[a]
    assert (routes.weight, routes.healthy, routes.draining, routes.incident) == (100, True, False, "")
    final = inc.cluster.get_routing(MODEL).sites[a]  # written by the model's Routing entity
    assert final.weight > 0 and (final.healthy, final.draining, final.incident) == (True, False, "")
    assert not any(n.unschedulable for n in inc.cluster.list_nodes({"node-restriction.kubernetes.io/gpufleet-site": a})), "drained nodes back"
    assert inc.cluster.serving_status(MODEL, a).desired_replicas == 1
    assert inc.cluster.serving_status(MODEL, d).desired_replicas == 0, "replicas moved to d scaled back"
    assert len(await run_chain(inc.client, handle.id, first_run)) >= 3
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED

    await replay_and_record(inc.client.get_workflow_handle(handle.id, run_id=first_run),
                            "site_evacuation_continued_as_new_routed")
    await replay_and_record(handle, "site_evacuation_restored_after_continue_as_new_routed")


async def test_evacuation_continues_as_new_while_no_compliant_site_then_moves_on(inc: IncStack) -> None:
    """b is a compliance site in the eu: eu-only has nowhere to go until a person adds a Deployment at d."""
    b, d = inc.site("b"), inc.site("d")
    await inc.join("b", 2)
    await inc.join("d", 2)
    inc.serve(MODEL, "b", replicas=1)
    inc.serve(MODEL, "d", replicas=0)
    inc.serve("eu-only", "b", replicas=1)
    inc.serve("eu-only", "c", replicas=0)  # outside the geography: never a target
    inc.world.set_site(b, unreachable=1)
    handle = await inc.client.start_workflow(
        "SiteEvacuation", {"site": b, "reason": "test: provider down"}, id=f"evacuate/{b}/1",
        task_queue=inc.settings.task_queue,
    )
    first_run = handle.first_execution_run_id
    stuck: EvacuationProgress = await poll(lambda: _state(inc, "needs-person", "b"), timeout=60)
    await poll(lambda: continued_as_new(inc.client, handle.id, first_run, times=1), timeout=60)
    carried = await inc.progress("b")
    assert carried.state == "needs-person" and "eu-only" in carried.needs_person
    assert carried.timeline == stuck.timeline

    inc.serve("eu-only", "d", replicas=0)  # a person adds a compliant Deployment, and says so
    await handle.signal("retry")
    moved: EvacuationProgress = await poll(lambda: _state(inc, "waiting-for-recovery", "b"), timeout=60)
    assert moved.moves == {MODEL: {d: 1}, "eu-only": {d: 1}}
    assert [s.name for s in moved.timeline] == ["detected", "weight 0", "replicas ready elsewhere", "drained"]
    assert inc.cluster.serving_status("eu-only", d).desired_replicas == 1

    await handle.execute_update("abort", "test: stop here")
    result = EvacuationResult.model_validate(await asyncio.wait_for(handle.result(), 30))
    assert result.outcome == "aborted"
    assert inc.cluster.get_site_routes().sites[b].weight == 0, "abort stops where it is"
    for history in (await run_chain(inc.client, handle.id, first_run))[:-1]:
        assert open_when_closed(history) == [], "continued as new with an activity or child open"
    await replay_and_record(inc.client.get_workflow_handle(handle.id, run_id=first_run),
                            "site_evacuation_continued_as_new_placing_routed")
    await replay_and_record(handle, "site_evacuation_aborted_after_continue_as_new_routed")


async def _state(inc: IncStack, state: str, name: str = "a"):
    progress = await inc.progress(name)
    return progress if progress is not None and progress.state == state else None


# -- AcquireCapacity ------------------------------------------------------------------------
@pytest.fixture
async def cap(can_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[CapStack]:
    address = can_env.client.service_client.config.target_host
    async for stack in open_stack(can_env.client, address, tmp_path):
        yield stack


async def test_capacity_continues_as_new_while_backing_off_and_keeps_its_attempts(cap: CapStack) -> None:
    # The catalog (read once, kept 10 min) sells cheap and mid; the providers have nothing left.
    cap.world.set_site(cap.site("dear"), capacity=0)
    cap.world.set_site(cap.site("spot"), capacity=0)
    await cap.refresh_catalog()
    cap.world.set_site(cap.site("cheap"), capacity=0)
    cap.world.set_site(cap.site("mid"), capacity=0)
    handle = await cap.request({
        "constraints": {"gpu": "H100"}, "count": 1, "catalog_max_age_seconds": 600, "deadline_seconds": 120,
        "backoff_seconds": 0.3, "max_backoff_seconds": 0.3, "unavailable_ttl_seconds": 600,
    })
    first_run = handle.first_execution_run_id
    await poll(lambda: continued_as_new(cap.client, handle.id, first_run, times=2), timeout=60)

    waiting = await handle.query("progress", result_type=CapacityProgress)
    tried = [(cap.offer("cheap"), "NoCapacity"), (cap.offer("mid"), "NoCapacity")]
    assert [(a.offer, a.outcome) for a in waiting.attempts] == tried
    assert waiting.requested == 1 and waiting.joined == 0
    chain = await run_chain(cap.client, handle.id, first_run)
    for history in chain[:-1]:
        assert open_when_closed(history) == [], "continued as new with a join or an activity open"

    # Capacity is back, cheapest first: cheap is still out of the ranking (its NoCapacity
    # exclusion was carried), so the request takes dear.
    cap.world.set_site(cap.site("cheap"), capacity=2)
    cap.world.set_site(cap.site("dear"), capacity=2)
    await cap.refresh_catalog()
    result = CapacityResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert result.complete
    assert [n.site for n in result.nodes] == [cap.site("dear")]
    assert [(a.offer, a.outcome) for a in result.attempts] == [*tried, (cap.offer("dear"), "joined")]
    assert cap.world.calls(cap.account("a"), "create") == 1, "cheap was not tried again"
    # The join numbering carried on: three joins, three ids.
    request_id = handle.id.removeprefix("capacity/")

    async def joins() -> list[str]:
        found = [w.id async for w in cap.client.list_workflows('WorkflowType = "NodeJoin"') if request_id in w.id]
        return found if len(found) >= 3 else []

    assert sorted(j.rsplit("-", 1)[1] for j in await poll(joins, timeout=15)) == ["1", "2", "3"]

    await replay_and_record(cap.client.get_workflow_handle(handle.id, run_id=first_run), "capacity_continued_as_new")
    await replay_and_record(handle, "capacity_completed_after_continue_as_new")

