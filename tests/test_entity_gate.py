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
from fleet.contracts import workflows as flows
from fleet.messages.repair import NodeStatus, SkipToInput
from fleet.naming import reclaim_workflow_id
from fleet.repair_policy import Rung
from tests.can_server import Hold, server_suggesting_continue_as_new
from tests.repair_helpers import (
    REPAIR, eventually, join_node, ladder, node_status, repair_fleet, repair_handle, running_stack, spot,
)
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


async def test_a_node_whose_repair_waits_for_a_person_continues_as_new_and_follows_it(can_env, tmp_path: Path) -> None:
    """GPU 0's ladder is exhausted and waits for a person, for weeks maybe, while GPU 1 keeps
    reporting (application XIDs, each a change its watch answers). The entity continues as new when
    the server suggests it, the repair running (``node-continues-while-repairing``): the next run
    follows it, grants it the node's action slot when a person re-enters its ladder, and sees it end.
    Before, the run continued only with no repair running: its history grew with every watch, and
    past ``watch_pace_history_mib`` (here 0.06 MiB) every next watch of GPU 1 waited a pause
    doubling up to a year."""
    timeouts = {**REPAIR["timeouts"], "watch_pace_max_seconds": 0.5, "watch_pace_history_mib": PACE_HISTORY_MIB}
    async for stack in running_stack(can_env.client, tmp_path, repair_fleet(max_rung="reset", timeouts=timeouts)):
        node = await join_node(stack)
        handle = stack.client.get_workflow_handle(f"node/{node.node_name}")
        repair = repair_handle(stack, node.node_name, 0)
        stack.world.inject_fault(node.machine_id, 0, "compute", clears_on="never")  # its proof fails
        stack.world.inject_fault(node.machine_id, 0, "ecc", 3, clears_on="never")  # the finding
        await eventually(lambda: _exhausted(stack, node.node_name), timeout=60)  # waits for a person, no deadline
        waiting = (await handle.describe()).run_id  # the run the exhausted ladder waits in

        for xids in range(1, 41):  # GPU 1's watch answers each; the history grows
            stack.world.inject_fault(node.machine_id, 1, "xid", 13, clears_on="never")
            try:
                await eventually(lambda: _counted(stack, node.node_name, xids), timeout=20)
            except AssertionError:
                status = await handle.query(flows.Node.status, result_type=NodeStatus)
                raise AssertionError(f"GPU 1's application XID #{xids} not taken in 20 s: its watch is paced "
                                     f"({[line for line in status.log if 'history at' in line]})") from None
            if (await handle.describe()).run_id != waiting:
                break
        continued = (await handle.describe()).run_id
        assert continued != waiting, f"no continue-as-new in {xids} watch answers while the repair waits"
        assert (await repair.describe()).status == WorkflowExecutionStatus.RUNNING
        status = await eventually(lambda: node_status(stack, node.node_name), timeout=10)  # its first task run
        assert status.active_repairs == {"0": repair.id}, "the continued run follows the repair"
        assert not [line for line in status.log if "history at" in line], "GPU 1's watch was paced"
        await replay_and_record(stack.client.get_workflow_handle(handle.id, run_id=waiting),
                                "node_entity_continues_while_a_repair_waits")

        # A person mends the GPU and re-enters the ladder: its reset asks the continued run for the
        # node's action slot, and the run that started the repair is long gone.
        resets = len(_resets(status, repair.id))
        stack.world.clear_faults(node.machine_id, "never", gpu=0)
        await repair.execute_update("skip_to", SkipToInput(rung=Rung.RESET))
        assert (await asyncio.wait_for(repair.result(), 60))["outcome"] == "repaired"

        async def ended() -> NodeStatus | None:
            status = await node_status(stack, node.node_name)
            return status if status and not status.active_repairs and status.state == "ready" else None

        status = await eventually(ended, timeout=30)
        granted = _resets(status, repair.id)
        assert len(granted) == resets + 1 and granted[-1].finished_at is not None, status.node_actions
        last = stack.client.get_workflow_handle(handle.id, run_id=(await handle.describe()).run_id)
        await replay_and_record(last, "node_entity_follows_a_carried_repair_to_its_end")


#: The history a run may have while a repair runs before its next watches are paced: here below what a
#: run with an exhausted ladder reaches in the test's answers, far above what one that continues does.
PACE_HISTORY_MIB = 0.06


async def _counted(stack, node: str, xids: int) -> bool:
    """The entity took ``xids`` application XIDs of GPU 1 (its newest run; None while it starts)."""
    status = await node_status(stack, node)
    return status is not None and status.app_xids.get("13", 0) >= xids


def _resets(status: NodeStatus, repair_id: str) -> list:
    return [a for a in status.node_actions if a.repair_id == repair_id and a.rung == Rung.RESET]


async def _exhausted(stack, node: str) -> bool:
    state = await ladder(stack, node, 0)
    return bool(state and state.outcome == "exhausted")
