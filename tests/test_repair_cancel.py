"""A cancelled GpuRepair stops: it climbs no further rung, buys no replacement, and leaves the
GPU fenced for a person, who is told so by the repair and by the node's entity.

Product rule: every cancel stops spending. A cancel lands while a rung waits (here: the reboot's
wait for a new boot id); the activity it waited on ends cancelled, which the ladder used to take
for a failed rung: it reinstalled next, then bought a replacement.
"""

from __future__ import annotations

import asyncio

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import CancelledError

from activities.repair import fence_key
from fleet.messages.join import JoinedNode
from fleet.messages.repair import GpuRepairResult, NodeStatus
from fleet.repair_policy import Rung
from sim.provider import SimProvider
from tests.conftest import Stack
from tests.details_helpers import current_details as _details
from tests.details_helpers import held
from tests.one_task_helpers import JOB_MODES, in_one_task, jobs_applied, one_task_had_both
from tests.repair_helpers import eventually, exists, join_node, ladder, node_status, repair_handle, running_stack
from tests.replay import replay_and_record

#: The reboot's machine takes this long to come back: the cancel lands while the repair waits for it.
SLOW_BOOT_SECONDS = 60
#: What a repair schedules once its reboot is over: the next rungs (reinstall, replace) and the
#: proof. None of them may follow a cancel.
AFTER_THE_REBOOT = {"reinstall_machine", "reinstall_driver", "replacement_sites", "reset_gpu", "smoke_test",
                    "uncontain_gpu"}


@pytest.fixture
async def rstack(temporal_env, tmp_path):
    async for stack in running_stack(temporal_env.client, tmp_path):
        yield stack


async def _scheduled(handle: WorkflowHandle) -> list[str]:
    history = await handle.fetch_history()
    return [e.activity_task_scheduled_event_attributes.activity_type.name
            for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


async def _after_the_cancel(handle: WorkflowHandle) -> tuple[list[str], int]:
    """Activity types scheduled after the cancel request, and children started in the whole run."""
    history = await handle.fetch_history()
    after, children, cancelled = [], 0, False
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED:
            cancelled = True
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED and cancelled:
            after.append(event.activity_task_scheduled_event_attributes.activity_type.name)
        elif event.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
            children += 1
    return after, children


async def _ended_or_climbed(handle: WorkflowHandle) -> bool:
    """The run closed (a cancel stops it), or it went on past the reboot (the defect): either
    way there is something to assert on, instead of waiting out a ladder that climbs."""
    if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
        return True
    after, children = await _after_the_cancel(handle)
    return bool(set(after) & AFTER_THE_REBOOT) or children > 0


async def _told_a_person(stack: Stack, node: str) -> NodeStatus | None:
    status = await node_status(stack, node)
    return status if status and not status.active_repairs and status.state == "needs-person" else None


async def repair_waiting_for_boot(stack: Stack) -> tuple[JoinedNode, WorkflowHandle]:
    """A node whose GPU 0 (XID 79) is being repaired at the reboot rung, its repair waiting for
    the machine's slow boot: where a cancel lands."""
    node = await join_node(stack)
    stack.world.set_site("site-a", boot_seconds=SLOW_BOOT_SECONDS)
    stack.world.inject_fault(node.machine_id, 0, "xid", 79, clears_on="reboot")
    handle = repair_handle(stack, node.node_name, 0)
    await eventually(lambda: exists(handle), timeout=30)
    await eventually(lambda: _waiting_for_boot(handle), timeout=30)
    return node, handle


async def test_cancel_during_the_reboot_wait_stops_the_ladder_and_leaves_the_gpu_fenced(rstack: Stack) -> None:
    node, handle = await repair_waiting_for_boot(rstack)
    machines_before = len(rstack.world.machines())

    await handle.cancel()
    await eventually(lambda: _ended_or_climbed(handle), timeout=60)

    after, children = await _after_the_cancel(handle)
    assert not set(after) & AFTER_THE_REBOOT, f"the ladder went on after the cancel: {after}"
    assert children == 0, "no replacement NodeJoin was started"
    assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED
    with pytest.raises(WorkflowFailureError) as ended:
        await handle.result()
    assert isinstance(ended.value.cause, CancelledError)
    assert len(rstack.world.machines()) == machines_before, "nothing bought"
    assert rstack.world.machine(node.machine_id)["reinstalls"] == 0

    # The GPU was never proven: it stays fenced and its node cordoned.
    assert fence_key(0) in rstack.cluster.annotate_node(node.node_name, {})
    assert rstack.cluster.get_node(node.node_name).unschedulable
    # The repair says so where the operator looks.
    state = await ladder(rstack, node.node_name, 0)
    assert state is not None and state.done and state.outcome == "cancelled"
    assert [(a.rung, a.outcome) for a in state.attempts] == [(Rung.REBOOT, "cancelled")]
    details = await _details(handle)
    assert "cancelled" in details and "stays fenced" in details and "a person decides" in details, details
    # The Node entity freed the node's action slot and says a person must look at the GPU.
    status = await eventually(lambda: _told_a_person(rstack, node.node_name), timeout=30)
    assert all(a.finished_at is not None for a in status.node_actions), "the action slot was given back"
    assert "0" in status.needs_person and "cancelled" in status.needs_person["0"]
    assert "needs a person" in await _details(rstack.client.get_workflow_handle(f"node/{node.node_name}"))
    # The metrics count the node (GpufleetNodeNeedsPerson pages on it), by its site.
    from activities.env import FleetEnv
    from workers.metrics import fleet_snapshot

    snap = await fleet_snapshot(FleetEnv.from_settings(rstack.settings), rstack.client, rstack.settings.task_queue)
    assert snap.nodes_needing_a_person == {"site-a": 1}, snap.nodes_needing_a_person
    # And `gpufleet repair node` says it, rather than that the GPU waits for its site.
    from tests.test_cli import gpufleet

    shown = await gpufleet(rstack, "repair", "node", node.node_name)
    assert shown.returncode == 0, shown.stderr
    assert "GPU 0: needs a person" in shown.stdout and "waits for site" not in shown.stdout, shown.stdout

    await replay_and_record(handle, "gpu_repair_cancelled")
    await replay_and_record(rstack.client.get_workflow_handle(f"node/{node.node_name}"),
                            "node_entity_repair_cancelled")


async def test_cancel_while_a_replacement_joins_buys_nothing_more(rstack: Stack) -> None:
    """The replace rung's NodeJoin is cancelled with the repair (it deletes the machine it
    bought), and the cancelled join is not taken for a failed site: no join starts elsewhere."""
    node = await join_node(rstack)
    for site in ("site-a", "site-b"):  # the replacement's machine is slow to boot, wherever it is
        rstack.world.set_site(site, boot_seconds=SLOW_BOOT_SECONDS)
    rstack.world.inject_fault(node.machine_id, 0, "remap_failure", clears_on="never")  # starts at replace
    handle = repair_handle(rstack, node.node_name, 0)
    await eventually(lambda: exists(handle), timeout=30)
    await eventually(lambda: _bought_a_replacement(rstack, node.machine_id), timeout=30)

    await handle.cancel()
    await eventually(lambda: _ended_or_joined_again(handle), timeout=60)

    _, children = await _after_the_cancel(handle)
    assert children == 1, "the cancelled join was not followed by another"
    assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED
    bought = [m for m in rstack.world.machines(include_deleted=True) if m["id"] != node.machine_id]
    assert len(bought) == 1
    await eventually(lambda: _deleted(rstack, bought[0]["id"]), timeout=30)  # the join cleans up as it ends
    # The old node was not retired: a person decides about it, its GPU fenced.
    assert rstack.world.machine(node.machine_id)["deleted_at"] is None
    assert fence_key(0) in rstack.cluster.annotate_node(node.node_name, {})
    state = await ladder(rstack, node.node_name, 0)
    assert state.outcome == "cancelled" and [(a.rung, a.outcome) for a in state.attempts] == [(Rung.REPLACE, "cancelled")]
    await replay_and_record(handle, "gpu_repair_cancelled_replacing")


async def _bought_a_replacement(stack: Stack, original: str) -> bool:
    return any(m["id"] != original for m in stack.world.machines())


async def _deleted(stack: Stack, machine_id: str) -> bool:
    return stack.world.machine(machine_id)["deleted_at"] is not None


async def _ended_or_joined_again(handle: WorkflowHandle) -> bool:
    if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
        return True
    return (await _after_the_cancel(handle))[1] > 1


async def _waiting_for_boot(handle: WorkflowHandle) -> bool:
    return "wait_for_boot" in await _scheduled(handle)



async def test_cancel_after_the_replacement_joined_retires_the_replaced_node(rstack: Stack, monkeypatch) -> None:
    """A cancel that lands once the replacement joined stops nothing but the old node's retirement:
    the old machine billed on beside its replacement, the repair said the node stayed cordoned for
    a person and never named the replacement (or, with the delete in flight, which a cancel only
    asks to stop, the machine went while it said so). Now the retirement runs to its end, and the
    repair ends replaced, the cancel noted."""
    node = await join_node(rstack)
    deleting, deleted = held(monkeypatch, SimProvider, "delete_machine")
    rstack.world.inject_fault(node.machine_id, 0, "remap_failure", clears_on="never")  # starts at replace
    handle = repair_handle(rstack, node.node_name, 0)
    await eventually(lambda: exists(handle), timeout=30)
    await eventually(lambda: asyncio.to_thread(deleting.wait, 0.1), timeout=90)  # joined; retiring the old one

    await handle.cancel()
    await eventually(lambda: _cancel_requested(handle), timeout=30)
    deleted.set()

    result = GpuRepairResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert result.outcome == "replaced" and result.replacement_node, result
    assert [(a.rung, a.outcome) for a in result.attempts] == [(Rung.REPLACE, "replaced")]
    assert "cancelled" in result.attempts[0].detail and "retired all the same" in result.attempts[0].detail, \
        result.attempts[0].detail
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED
    # One machine bills: the replacement. The old one is deleted and its node out of the cluster.
    assert rstack.world.machine(node.machine_id)["deleted_at"] is not None
    assert rstack.cluster.get_node(node.node_name) is None
    assert rstack.cluster.get_node(result.replacement_node) is not None
    details = await _details(handle)
    assert f"replaced by {result.replacement_node}" in details and "stays fenced" not in details, details
    # The old node's entity ends with its node gone, holding no GPU for a person.
    entity = rstack.client.get_workflow_handle(f"node/{node.node_name}")
    await asyncio.wait_for(entity.result(), 30)
    assert (await node_status(rstack, node.node_name)).needs_person == {}
    await replay_and_record(handle, "gpu_repair_cancelled_after_the_replacement_joined")


async def _cancel_requested(handle: WorkflowHandle) -> bool:
    history = await handle.fetch_history()
    return any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED for e in history.events)



@pytest.fixture(params=JOB_MODES)
async def batched_stack(request, temporal_env, tmp_path, monkeypatch):
    """A stack whose worker runs an activation's jobs in sets or as one batch (``jobs_applied``)."""
    jobs_applied(request.param, monkeypatch)
    async for stack in running_stack(temporal_env.client, tmp_path):
        yield stack


@pytest.mark.parametrize("first", ["resolve_child_workflow_execution", "cancel_workflow"])
async def test_a_cancel_in_the_task_the_replacement_joined_in_retires_the_replaced_node(
        batched_stack: Stack, monkeypatch, request, first: str) -> None:
    """The replacement's join ends and the repair's cancel comes in the same workflow task (either
    first): the join's result is taken, and the repair retires the node it replaced and ends
    replaced, the cancel noted. Applying the task's jobs as one batch, it ended cancelled: the
    replacement joined and billing, never named; the old machine billing beside it, cordoned."""
    stack = batched_stack
    node = await join_node(stack)
    handle = repair_handle(stack, node.node_name, 0)
    then = "cancel_workflow" if first == "resolve_child_workflow_execution" else "resolve_child_workflow_execution"
    held_one = in_one_task(monkeypatch, handle.id, first, then)
    stack.world.inject_fault(node.machine_id, 0, "remap_failure", clears_on="never")  # starts at replace
    await eventually(lambda: exists(handle), timeout=30)
    if first == "cancel_workflow":  # the cancel lands while the join runs; the join ends before it is told
        await eventually(lambda: _bought_a_replacement(stack, node.machine_id), timeout=60)
    else:  # the join ended; the cancel lands before the repair took it
        await eventually(lambda: asyncio.to_thread(held_one.wait, 0.1), timeout=90)
    await handle.cancel()

    result = GpuRepairResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert held_one.is_set() and await one_task_had_both(handle)
    assert result.outcome == "replaced" and result.replacement_node, result
    assert [(a.rung, a.outcome) for a in result.attempts] == [(Rung.REPLACE, "replaced")]
    assert "retired all the same" in result.attempts[0].detail, result.attempts[0].detail
    # One machine bills: the replacement. The old one is deleted and its node out of the cluster.
    assert stack.world.machine(node.machine_id)["deleted_at"] is not None
    assert stack.cluster.get_node(node.node_name) is None
    assert stack.cluster.get_node(result.replacement_node) is not None
    if request.node.callspec.params["batched_stack"] == "jobs-as-one-batch" and first != "cancel_workflow":
        await replay_and_record(handle, "gpu_repair_cancelled_in_the_task_the_replacement_joined")
