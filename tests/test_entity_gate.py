"""The entities' continue-as-new gate (``workflows.entity``) on a real dev server, for the Node
entity: its health-watch loop is an own task, so a run continues as new only once that loop
rests at its watch, never in the middle of a step (patch ``node-continue-when-watch-rests``).

The server here suggests continuing as new after ``CAN_EVENTS`` events, so a few signals are
enough to bring the entity to its gate. (The ProviderAccount's gate: tests/test_account_gate.py.)
A run that continued with nothing changed upserts no search attribute: they carry over.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowHistory
from temporalio.testing import WorkflowEnvironment

from fleet import search_attributes as sa
from fleet.naming import reclaim_workflow_id
from tests.can_server import Hold, server_suggesting_continue_as_new
from tests.repair_helpers import eventually, join_node, repair_fleet, running_stack, spot
from tests.test_node_join import own_upserts
from tests.replay import replay_and_record

CAN_EVENTS = 80


@pytest.fixture(scope="module")
async def can_env() -> AsyncIterator[WorkflowEnvironment]:
    async with server_suggesting_continue_as_new(CAN_EVENTS) as env:
        yield env


async def runs(client: Client, workflow_id: str) -> list:
    return sorted([w async for w in client.list_workflows(f'WorkflowId = "{workflow_id}"')], key=lambda w: w.start_time)


async def history_length(handle: WorkflowHandle) -> int:
    return (await handle.describe()).raw_description.workflow_execution_info.history_length


async def test_a_node_continues_as_new_only_once_its_watch_loop_rests(can_env, tmp_path: Path, monkeypatch) -> None:
    """A spot notice reaches the Node entity's health-watch loop, which reads the node's facts
    (held here) before it starts the node's SpotReclaim; the server asks the entity to continue as
    new meanwhile. Before the gate the run continued at once, in the middle of that step: the
    SpotReclaim was not started and the loop's writes to the state (the notice, the watch's
    sequence) were lost, so the next run took the notice again. Now the run waits for the loop to
    rest at its next watch: the run that took the notice starts the SpotReclaim, then continues,
    carrying the notice."""
    import workers.control_plane

    facts = Hold("node_facts")  # a local activity: the worker's interceptors hold it too
    interceptors = workers.control_plane.worker_interceptors
    monkeypatch.setattr(workers.control_plane, "worker_interceptors", lambda: [*interceptors(), facts])
    async for stack in running_stack(can_env.client, tmp_path, spot(repair_fleet())):
        node = None
        try:
            node = await join_node(stack)
            handle = stack.client.get_workflow_handle(f"node/{node.node_name}")
            # The run that takes the notice (``handle`` follows the newest run).
            first = stack.client.get_workflow_handle(handle.id, run_id=(await handle.describe()).run_id)
            assert await history_length(first) < CAN_EVENTS - 10, "room for the scenario"
            facts.armed = True
            terminate_at = stack.world.post_reclaim_notice(node.machine_id, 600)
            await asyncio.wait_for(facts.holding.wait(), 30)
            # Reports that change nothing, until the server asks the entity to continue as new.
            report = {"node_name": node.node_name, "boot_id": "", "gpus": []}
            for _ in range(100):
                if await history_length(first) >= CAN_EVENTS + 2:
                    break
                await first.signal("health_report", report)
                await asyncio.sleep(0.3)
            await asyncio.sleep(12)  # past the held local activity's workflow-task heartbeat
            if (await first.describe()).status == WorkflowExecutionStatus.RUNNING:
                await first.signal("health_report", report)
                await asyncio.sleep(2)
            facts.release.set()

            await eventually(lambda: _more_runs(stack.client, handle.id, 1), timeout=60)
            events = (await first.fetch_history()).events
            started = [e.start_child_workflow_execution_initiated_event_attributes.workflow_id for e in events
                       if e.HasField("start_child_workflow_execution_initiated_event_attributes")]
            assert started == [reclaim_workflow_id(node.node_name)], "the run that took the notice acted on it"
            assert events[-1].HasField("workflow_execution_continued_as_new_event_attributes")
            carried = json.loads(events[-1].workflow_execution_continued_as_new_event_attributes.input.payloads[0].data)
            assert carried["carry"]["reclaim_at"] == pytest.approx(terminate_at), "the notice was carried"
            await replay_and_record(first, "node_entity_continued_as_new_after_reclaim")
        finally:
            facts.release.set()
            if node is not None:  # the reclaim drains for the notice's 10 minutes: not this test's to wait for
                try:
                    await stack.client.get_workflow_handle(reclaim_workflow_id(node.node_name)).terminate("test over")
                except Exception:  # noqa: BLE001 - never started (the test failed before it)
                    pass


async def _more_runs(client: Client, workflow_id: str, than: int) -> bool:
    return len(await runs(client, workflow_id)) > than


async def test_a_continued_node_run_that_changes_nothing_upserts_no_search_attribute(can_env, tmp_path: Path) -> None:
    """Search attributes carry over continue-as-new: a Node run that continued with nothing changed
    keeps the join's ``NodeName`` and ``Site`` and its ``FleetState`` and upserts none of them
    (``node-patches-at-start-7``). Before, every run upserted ``NodeName`` and ``FleetState`` at its
    start and its facts read upserted ``Site``: two commands a run that changed nothing. The facts
    read stays, once: it is how the run sees the config's repair settings as they are now."""
    async for stack in running_stack(can_env.client, tmp_path, repair_fleet()):
        node = await join_node(stack)
        handle = stack.client.get_workflow_handle(f"node/{node.node_name}")
        # Reports that change nothing, until the server asks the entity to continue as new.
        report = {"node_name": node.node_name, "boot_id": "", "gpus": []}
        for _ in range(100):
            if await _more_runs(stack.client, handle.id, 1):
                break
            await handle.signal("health_report", report)
            await asyncio.sleep(0.3)
        continued = (await runs(stack.client, handle.id))[1]
        second = stack.client.get_workflow_handle(handle.id, run_id=continued.run_id)
        history = await eventually(lambda: _watching(second), timeout=30)  # settled: at its first watch

        scheduled = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                     if e.HasField("activity_task_scheduled_event_attributes")]
        assert scheduled == ["node_facts", "watch_node"], scheduled
        assert own_upserts(history) == [], "no search attribute upserted"
        kept = (await second.describe()).typed_search_attributes
        assert (kept.get(sa.NODE_NAME), kept.get(sa.SITE), kept.get(sa.FLEET_STATE)) == (
            node.node_name, "site-a", "ready")
        await replay_and_record(second, "node_entity_continued_changing_nothing")


async def _watching(handle: WorkflowHandle) -> WorkflowHistory | None:
    """The run's history once it scheduled its first watch."""
    history = await handle.fetch_history()
    watching = any(e.HasField("activity_task_scheduled_event_attributes")
                   and e.activity_task_scheduled_event_attributes.activity_type.name == "watch_node"
                   for e in history.events)
    return history if watching else None
