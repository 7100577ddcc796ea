"""The entities' continue-as-new gate (``workflows.entity``) on a real dev server, for the Node
entity: its health-watch loop is an own task, so a run continues as new only once that loop
rests at its watch, never in the middle of a step (patch ``node-continue-when-watch-rests``).

The server here suggests continuing as new after ``CAN_EVENTS`` events, so a few signals are
enough to bring the entity to its gate. (The ProviderAccount's gate: tests/test_account_gate.py.)
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from fleet.naming import reclaim_workflow_id
from tests.can_server import Hold, server_suggesting_continue_as_new
from tests.repair_helpers import eventually, join_node, repair_fleet, running_stack, spot
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
