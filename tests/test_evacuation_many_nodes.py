"""An evacuation of a site of more nodes than Temporal lets one workflow run have activities in
flight (its ``limit.numPendingActivities.error``: 2,000 by default, and fixed at 2,000 on Temporal
Cloud): the site drains, ``DRAIN_AT_ONCE`` nodes at a time. Before, it started one drain per node in
one workflow task, which the server failed (``PENDING_ACTIVITIES_LIMIT_EXCEEDED``) on every retry:
the evacuation never got past its drain. A site may hold up to ``MAX_SITE_NODES`` (5,000). On the
real dev server, whose limit is the production default; the nodes past the site's real one are the
test's (the simulated world joins a handful: the drain of a node the cluster does not have ends at
once), so these tests stop at the end of the drain, the step that failed, not at the restore."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import AsyncIterator

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from activities.evacuation import EvacuationActivities
from fleet.messages.evacuation import EvacuationFacts, EvacuationProgress, ProbeNode
from fleet.models import MAX_SITE_NODES
from tests.evacuation_helpers import IncStack, failed_tasks, incident_fleet, open_incident_stack, poll
from tests.replay import replay_and_record
from workflows.steps import TEMPORAL_PENDING_PER_RUN
from workflows.evacuation import DRAIN_AT_ONCE


def site_of(monkeypatch, count: int) -> None:
    """The evacuation's facts name ``count`` nodes more at the site than the cluster has."""
    real = EvacuationActivities._facts

    def facts(self, name: str, whole: bool = True) -> EvacuationFacts:
        found = real(self, name, whole)
        if whole:
            found.nodes += [ProbeNode(name=f"far-{i:04d}", ready=False) for i in range(count)]
        return found

    monkeypatch.setattr(EvacuationActivities, "_facts", facts)


def fleet_stack(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[IncStack]:
    uid = uuid.uuid4().hex[:6]
    return open_incident_stack(temporal_env.client, tmp_path, incident_fleet(uid), uid)


async def evacuate(inc: IncStack) -> WorkflowHandle:
    """One node joins a (nothing served there: nothing to move), and a person evacuates it."""
    await inc.join("a", 1)
    a = inc.site("a")
    return await inc.client.start_workflow("SiteEvacuation", {"site": a, "reason": "test: a large site"},
                                           id=f"evacuate/{a}/manual-large", task_queue=inc.settings.task_queue)


async def drained(handle: WorkflowHandle, seen: list[str]) -> EvacuationProgress | None:
    """The progress once the timeline says "drained"; fails at once on a failed workflow task (not
    one the server closed to flush events: ``failed_tasks``)."""
    failed = failed_tasks(await handle.fetch_history())
    assert not failed, failed[0].workflow_task_failed_event_attributes.failure.message
    try:
        progress = await handle.query("progress", result_type=EvacuationProgress)
    except RPCError as error:
        # A query waits for the run's workflow task, which takes a while with 2,000 drains' answers
        # on a loaded machine: its RPC timed out ('Timeout expired'). Asked again at the next poll.
        if error.status in (RPCStatusCode.CANCELLED, RPCStatusCode.DEADLINE_EXCEEDED):
            return None
        raise
    if progress.step == "draining":
        seen.append(progress.step_detail)
    return progress if any(step.name == "drained" for step in progress.timeline) else None


async def most_drains_at_once(handle: WorkflowHandle) -> int:
    """The most drains the run had scheduled and not yet closed at any point of its history."""
    closed = (EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED, EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
              EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT, EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED)
    drains: set[int] = set()
    open_now = most = 0
    for event in (await handle.fetch_history()).events:
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            if event.activity_task_scheduled_event_attributes.activity_type.name == "drain_within":
                drains.add(event.event_id)
                open_now += 1
                most = max(most, open_now)
        elif event.event_type in closed:
            attributes = getattr(event, event.WhichOneof("attributes"))
            if attributes.scheduled_event_id in drains:
                open_now -= 1
    return most


def test_a_site_may_hold_more_nodes_than_temporal_lets_one_run_have_activities_in_flight() -> None:
    """The premise, from the code's own constants: a site's nodes outnumber the pending-activity
    limit, and the drains in flight at once stay well under it."""
    assert MAX_SITE_NODES > TEMPORAL_PENDING_PER_RUN
    assert DRAIN_AT_ONCE * 2 <= TEMPORAL_PENDING_PER_RUN


async def test_a_site_of_more_nodes_than_temporals_pending_activity_limit_drains(
        temporal_env, tmp_path, monkeypatch) -> None:
    count = TEMPORAL_PENDING_PER_RUN + 100
    site_of(monkeypatch, count)
    async for inc in fleet_stack(temporal_env, tmp_path):
        handle = await evacuate(inc)
        seen: list[str] = []
        # The poll's bound only guards against a hang: before, the task failed at once, every retry.
        progress = await poll(lambda: drained(handle, seen), timeout=300, interval=1.0)
        total = count + 1
        step = next(step for step in progress.timeline if step.name == "drained")
        assert step.detail == f"{total} nodes", step.detail
        assert len(set(progress.drained)) == total, "every node drained once"
        assert await most_drains_at_once(handle) == DRAIN_AT_ONCE
        assert all(d.startswith(f"draining {DRAIN_AT_ONCE} at a time: ") and f" of {total:,} done" in d
                            for d in seen), seen


async def test_a_site_of_a_few_hundred_nodes_past_one_turn_drains_in_turns(
        temporal_env, tmp_path, monkeypatch) -> None:
    """More than one turn (recorded: tests/test_replay.py replays it)."""
    site_of(monkeypatch, DRAIN_AT_ONCE + 100)
    async for inc in fleet_stack(temporal_env, tmp_path):
        handle = await evacuate(inc)
        progress = await poll(lambda: drained(handle, []), timeout=180, interval=0.5)
        assert len(progress.drained) == DRAIN_AT_ONCE + 101
        await replay_and_record(handle, "evacuation_drains_in_turns")
