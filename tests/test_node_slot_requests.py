"""A repair that ends while it waits for its node's action slot gives up its place in the queue.

Product rule: one disruptive action per node at a time, and an action that started after a
fault was detected covers that fault's repair (two GPUs failing together cost one reboot).
Both rest on the Node entity's record of the actions that ran. A repair cancelled (or failed,
or terminated) while its request for the slot was queued used to keep that request: once the
slot was free the entity granted it to the closed repair and recorded a reboot that never
happened, which then "covered" the repairs queued behind it. They skipped their own action and
the GPU they were for was never reset or rebooted.

The slot is held by a reboot whose machine is slow to boot (tests/test_repair_cancel.py builds
it); the faults queued behind it are reported by the control plane's own ``send_report``, as
the node's agent is down for the reboot.

A repair queued for the slot says who holds it and until when that holder is expected to give it
back ("every wait says why and until when"): an operator can tell a reboot that takes its time
from a stuck one.

Only an action on the whole node (a reboot, reinstall or replace) covers another GPU's repair: a
reset is ``nvidia-smi -r -i <gpu>``, one GPU's. Two GPUs whose faults were seen together each get
their own reset, the second after the first gives the slot back.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from fleet.contracts import workflows as flows
from fleet.messages.join import JoinedNode
from fleet.messages.nodes import HealthReport
from fleet.messages.repair import GpuRepairResult, NodeStatus
from fleet.models import GpuHealth, XidEvent
from fleet.repair_policy import Rung
from sim.gpu import SimGpuBackend
from tests.conftest import Stack
from tests.details_helpers import held
from tests.repair_helpers import (
    eventually, exists, join_node, ladder, node_status, repair_fleet, repair_handle, repair_result, running_stack,
)
from tests.replay import HISTORIES, replay_and_record
from tests.test_repair_cancel import _details, _waiting_for_boot, repair_waiting_for_boot
from tests.test_cli import gpufleet
from workers.health_report import send_report

#: The recorded Node run of this scenario on today's code, and the same run on the code before
#: ``node-patches-at-start-3`` (it granted the slot to the cancelled repair; it must still replay).
RECORDED = "node_entity_queued_request_of_an_ended_repair"
RECORDED_BEFORE = f"{RECORDED}_before"
#: The Node run and a queued repair's run of the scenario where the queue is told who holds the slot.
RECORDED_TOLD = "node_entity_tells_the_queue_who_holds_the_slot"
RECORDED_TOLD_REPAIR = "gpu_repair_told_who_holds_the_slot"
#: The same Node run on the code before ``node-tells-the-queue-once``, and a Node run of five repairs
#: queued at once, each told its wait once (and the next in line again).
RECORDED_TOLD_BEFORE = f"{RECORDED_TOLD}_before"
RECORDED_QUEUE = "node_entity_tells_a_queue_of_five_once"
#: The Node run where two GPUs' resets each get the slot (``node-patches-at-start-7``), and the same
#: scenario on the code before, where the first reset "covered" the second (it must still replay).
RECORDED_RESETS = "node_entity_grants_each_gpu_its_own_reset"
RECORDED_RESETS_BEFORE = f"{RECORDED_RESETS}_before"
#: A repair held while queued for the slot (``repair-holds-at-the-grant``) and the Node run that took
#: its slot back unused (``node-slot-given-back-unused``).
RECORDED_HELD = "gpu_repair_held_in_the_queue_gives_the_slot_back"
RECORDED_HELD_NODE = "node_entity_slot_given_back_unused"


@pytest.fixture
async def rstack(temporal_env, tmp_path):
    """The repair tests' stack, with three GPUs a machine at site-a: one fault holds the slot, two queue."""
    fleet = repair_fleet()
    fleet["sites"][0]["gpus_per_machine"] = 3
    async for stack in running_stack(temporal_env.client, tmp_path, fleet):
        yield stack


async def _report_xid(stack: Stack, node: JoinedNode, gpu: int, xid: int) -> None:
    """A fatal XID on ``gpu``, reported by the control plane (the node's agent is down)."""
    event = XidEvent(xid=xid, at=datetime.now(timezone.utc))
    await send_report(stack.client, stack.settings.task_queue, HealthReport(
        node_name=node.node_name, boot_id="", gpus=[GpuHealth(index=gpu, uuid=f"GPU-{gpu}", xid_events=[event])]))


async def _waiting_for_the_slot(stack: Stack, node: JoinedNode, gpu: int) -> bool:
    """The repair waits for its grant, its request delivered to the Node entity (not only sent)."""
    state = await ladder(stack, node.node_name, gpu)
    if state is None or state.step != "waiting for the node":
        return False
    history = await repair_handle(stack, node.node_name, gpu).fetch_history()
    return any(e.event_type == EventType.EVENT_TYPE_EXTERNAL_WORKFLOW_EXECUTION_SIGNALED for e in history.events)


async def _closed(handle: WorkflowHandle) -> bool:
    return (await handle.describe()).status != WorkflowExecutionStatus.RUNNING


async def _queued_behind(stack: Stack, node: JoinedNode, gpu: int, xid: int) -> WorkflowHandle:
    """GPU ``gpu`` fails while the slot is held: its repair starts and asks for the slot."""
    await _report_xid(stack, node, gpu, xid)
    handle = repair_handle(stack, node.node_name, gpu)
    await eventually(lambda: exists(handle), timeout=30)
    await eventually(lambda: _waiting_for_the_slot(stack, node, gpu), timeout=30)
    return handle


async def _signals_after_its_end(node_entity: WorkflowHandle, repair_id: str) -> list[str]:
    """The signals the Node entity sent to ``repair_id`` after it saw that repair end."""
    history = await node_entity.fetch_history()
    ended, sent = False, []
    for event in history.events:
        if event.event_type in (EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_CANCELED,
                                EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_FAILED,
                                EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_TERMINATED):
            attributes = getattr(event, event.WhichOneof("attributes"))
            ended = ended or attributes.workflow_execution.workflow_id == repair_id
        elif event.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED and ended:
            attributes = event.signal_external_workflow_execution_initiated_event_attributes
            if attributes.workflow_execution.workflow_id == repair_id:
                sent.append(attributes.signal_name)
    return sent


async def _settled(stack: Stack, node: JoinedNode) -> NodeStatus | None:
    status = await node_status(stack, node.node_name)
    return status if status and not status.active_repairs and status.state == "needs-person" else None


async def test_a_repair_cancelled_in_the_queue_is_not_granted_and_covers_no_later_fault(rstack: Stack) -> None:
    # GPU 0 falls off the bus: its repair holds the node's slot while the machine reboots (slowly).
    node, first = await repair_waiting_for_boot(rstack)
    # GPU 1 too: its repair queues for the slot behind the reboot, and is cancelled there.
    second = await _queued_behind(rstack, node, 1, xid=79)
    await second.cancel()
    await eventually(lambda: _closed(second), timeout=30)
    # GPU 2 then has a double-bit ECC error: its repair (a reset) queues behind the cancelled one.
    third = await _queued_behind(rstack, node, 2, xid=48)

    # The reboot ends; the slot is free.
    rstack.world.set_site("site-a", boot_seconds=1.0)
    with rstack.world.tx() as db:
        db.execute("UPDATE machines SET boot_at=? WHERE id=?", (time.time(), node.machine_id))
    assert GpuRepairResult.model_validate(await first.result()).outcome == "repaired"
    third_result = GpuRepairResult.model_validate(await third.result())
    status = await eventually(lambda: _settled(rstack, node), timeout=30)

    node_entity = rstack.client.get_workflow_handle(f"node/{node.node_name}")
    assert await _signals_after_its_end(node_entity, second.id) == [], "nothing is sent to a closed repair"
    assert [a.repair_id for a in status.node_actions] == [first.id, third.id], (
        "the actions that ran, and no action for the cancelled repair")
    # The reset ran for GPU 2: the reboot before its fault covers nothing of it, and nothing else ran.
    assert [(a.rung, a.outcome) for a in third_result.attempts] == [(Rung.RESET, "passed")], third_result
    assert third_result.outcome == "repaired"
    assert rstack.world.machine(node.machine_id)["reboots"] == 1
    # The cancelled repair's GPU is held for a person, as any cancelled repair's.
    assert set(status.needs_person) == {"1"} and "cancelled" in status.needs_person["1"], status.needs_person
    assert any(f"{second.id} ended while waiting for the node's action slot" in line for line in status.log), \
        status.log

    await replay_and_record(node_entity, RECORDED)


def _faults_seen_together(stack: Stack, node: JoinedNode, xid: int, gpus: tuple[int, ...]) -> None:
    """A fatal XID on each of ``gpus``, written in one transaction: the agent's next probe sees them
    all, and one report brings every fault to the Node entity before any repair asks for the slot."""
    with stack.world.tx() as db:
        for gpu in gpus:
            db.execute("INSERT INTO gpu_faults(machine_id, idx, kind, value, clears_on, at) VALUES (?,?,?,?,?,?)",
                       (node.machine_id, gpu, "xid", xid, "reset", time.time()))


async def _the_queued_one(stack: Stack, node: JoinedNode, gpus: tuple[int, ...]) -> int | None:
    for gpu in gpus:
        if await _waiting_for_the_slot(stack, node, gpu):
            return gpu
    return None


async def test_a_reset_queued_behind_another_gpus_reset_runs_its_own(rstack: Stack, monkeypatch) -> None:
    # Two GPUs of one node need a reset, their faults seen in one report: one repair holds the node's
    # slot for its reset (held here), the other queues behind it.
    node = await join_node(rstack)
    resetting, reset = held(monkeypatch, SimGpuBackend, "reset_gpu")
    _faults_seen_together(rstack, node, xid=48, gpus=(0, 1))
    await eventually(lambda: asyncio.to_thread(resetting.wait, 0.1), timeout=30)
    queued = await eventually(lambda: _the_queued_one(rstack, node, (0, 1)), timeout=30)
    reset.set()

    results = {gpu: await repair_result(rstack, node.node_name, gpu, timeout=90) for gpu in (0, 1)}
    # The first reset covers nothing of the other GPU: it gets the slot and resets its own GPU. (Before,
    # "covered", it went to the proof never reset, failed it and rebooted the node.)
    for gpu, result in results.items():
        assert [(a.rung, a.outcome) for a in result.attempts] == [(Rung.RESET, "passed")], (gpu, result)
        assert result.outcome == "repaired"
    resets = sorted(a["gpu"] for a in rstack.world.actions(node.machine_id) if a["op"] == "gpu_reset")
    assert resets == [0, 1], "each GPU reset once"
    assert rstack.world.machine(node.machine_id)["reboots"] == 0
    status = await eventually(lambda: node_status(rstack, node.node_name), timeout=30)
    granted = [(a.repair_id, a.rung) for a in status.node_actions]
    assert granted[-1] == (repair_handle(rstack, node.node_name, queued).id, Rung.RESET), granted
    assert sorted(granted) == [(repair_handle(rstack, node.node_name, gpu).id, Rung.RESET) for gpu in (0, 1)]

    await replay_and_record(rstack.client.get_workflow_handle(f"node/{node.node_name}"), RECORDED_RESETS)


async def test_a_reboot_covers_another_gpus_reset_queued_behind_it(rstack: Stack) -> None:
    # GPU 0's reboot holds the slot (the machine slow to boot); GPU 1's reboot queues, then GPU 2's reset.
    node, first = await repair_waiting_for_boot(rstack)
    second = await _queued_behind(rstack, node, 1, xid=79)
    third = await _queued_behind(rstack, node, 2, xid=48)

    rstack.world.set_site("site-a", boot_seconds=1.0)
    _booted(rstack, node)
    assert GpuRepairResult.model_validate(await first.result()).outcome == "repaired"
    assert GpuRepairResult.model_validate(await second.result()).outcome == "repaired"
    # GPU 1's reboot began after GPU 2's fault was detected: it rebooted the whole node, GPU 2 included.
    third_result = GpuRepairResult.model_validate(await third.result())
    assert [(a.rung, a.outcome) for a in third_result.attempts] == [(Rung.RESET, "covered")], third_result
    assert third_result.outcome == "repaired"
    assert not [a for a in rstack.world.actions(node.machine_id) if a["op"] == "gpu_reset"], "no reset ran"
    assert rstack.world.machine(node.machine_id)["reboots"] == 2


@pytest.fixture
async def slow_reboots(temporal_env, tmp_path):
    """``rstack``, with reboots allowed two minutes: the test, not the timeout, ends each one."""
    fleet = repair_fleet()
    fleet["sites"][0]["gpus_per_machine"] = 3
    fleet["repair"]["timeouts"]["reboot_seconds"] = 120
    async for stack in running_stack(temporal_env.client, tmp_path, fleet):
        yield stack


def _booted(stack: Stack, node: JoinedNode) -> None:
    """The reboot in flight ends now: the machine comes back with its new boot id."""
    with stack.world.tx() as db:
        db.execute("UPDATE machines SET boot_at=? WHERE id=?", (time.time(), node.machine_id))


async def _held_by(stack: Stack, node: JoinedNode, repair_id: str) -> str:
    """What a queued repair must say of the slot ``repair_id`` holds for a reboot: since when (the
    Node entity's record) and until when it is expected back, then plus the reboot's timeouts
    (the provider's call and the wait for the new boot id)."""
    status = await eventually(lambda: node_status(stack, node.node_name), timeout=30)
    (action,) = [a for a in status.node_actions if a.repair_id == repair_id and a.finished_at is None]
    assert action.rung == Rung.REBOOT
    until = action.started_at + timedelta(seconds=4 + 120)  # provider_call_seconds + reboot_seconds
    return (f"the slot is held by {repair_id} for its reboot since {action.started_at:%H:%M:%S} UTC, "
            f"expected back by {until:%H:%M:%S} UTC")


def _back_by(held: str) -> datetime:
    """The time a holder is expected back by, as ``_held_by`` says it (today's date: the test's)."""
    at = datetime.strptime(held.rsplit("expected back by ", 1)[1], "%H:%M:%S UTC").time()
    return datetime.combine(datetime.now(timezone.utc).date(), at, tzinfo=timezone.utc)


def _queued_when_told(behind: str, ahead: int, held: str, turn_by: datetime) -> str:
    """What a repair with others ahead of it in the queue says, told once as it queued: the request
    right ahead of it, how many were ahead and who held the slot then, and the bound of its own turn."""
    then = held.removeprefix("the slot is ")
    return (f"queued behind {behind} ({ahead} ahead when it queued, the slot then {then}), "
            f"its turn expected by {turn_by:%H:%M:%S} UTC at the latest")


async def _details_naming(handle: WorkflowHandle, words: str) -> str | None:
    details = await _details(handle)
    return details if words in details else None


async def test_a_queued_repair_names_the_slots_holder_and_when_it_is_expected_back(slow_reboots: Stack) -> None:
    stack = slow_reboots
    # GPU 0's repair holds the node's slot for a reboot; GPU 1's (a reboot) and GPU 2's (a reset) queue.
    node, first = await repair_waiting_for_boot(stack)
    second = await _queued_behind(stack, node, 1, xid=79)
    third = await _queued_behind(stack, node, 2, xid=48)
    held = await _held_by(stack, node, first.id)

    # Each waiting repair's details name the holder and until when; one further back, the request
    # right ahead of it and when its own turn comes at the latest (the holder's bound plus a reboot's).
    shown = await eventually(lambda: _details_naming(second, held), timeout=30)
    assert "queued ahead" not in shown and "reboot needs the node's action slot" in shown, shown
    queued = _queued_when_told(second.id, 1, held, _back_by(held) + timedelta(seconds=4 + 120))
    await eventually(lambda: _details_naming(third, queued), timeout=30)
    # ... and so do its ladder and `gpufleet repair show`.
    assert (await ladder(stack, node.node_name, 1)).waiting_for == held
    cli = await gpufleet(stack, "repair", "show", node.node_name, "2")
    assert cli.returncode == 0, cli.stderr
    assert f"waiting: {queued}" in " ".join(cli.stdout.split()), cli.stdout

    # The reboot ends: GPU 1's repair takes the slot for its own reboot, and GPU 2's, next in line,
    # is told the new holder.
    _booted(stack, node)
    assert GpuRepairResult.model_validate(await first.result()).outcome == "repaired"
    await eventually(lambda: _details_naming(second, "recovering"), timeout=30)
    held = await _held_by(stack, node, second.id)
    shown = await eventually(lambda: _details_naming(third, held), timeout=30)
    assert "queued ahead" not in shown and first.id not in shown, shown

    # The second reboot ends; it covers GPU 2's fault (detected before it began), whose repair
    # stops waiting and says nothing of the slot any more.
    _booted(stack, node)
    assert GpuRepairResult.model_validate(await second.result()).outcome == "repaired"
    third_result = GpuRepairResult.model_validate(await third.result())
    assert [(a.rung, a.outcome) for a in third_result.attempts] == [(Rung.RESET, "covered")], third_result
    assert (await ladder(stack, node.node_name, 2)).waiting_for == ""
    assert "held by" not in await _details(third)

    await replay_and_record(stack.client.get_workflow_handle(f"node/{node.node_name}"), RECORDED_TOLD)
    await replay_and_record(third, RECORDED_TOLD_REPAIR)


async def _next_action(stack: Stack, node: JoinedNode, after: str) -> NodeStatus | None:
    """The Node entity's status once it recorded an action after ``after``'s (granted, or given back)."""
    status = await node_status(stack, node.node_name)
    ids = [a.repair_id for a in status.node_actions] if status else []
    return status if after in ids and ids[-1] != after else None


async def test_a_repair_held_in_the_queue_gives_the_slot_back_and_acts_only_once_released(
        slow_reboots: Stack) -> None:
    """A hold (an operator's ``gpufleet repair hold``, or the site's for an incident) that reaches a
    repair queued for the node's action slot holds it there: the grant goes back unused, and the
    repair queued behind it takes the slot for its own action. Before, the held repair ran its rung
    on the grant (at the replace rung: bought a machine during the incident) while its details said
    "held (contained, doing nothing until released)"; and a slot given back finished an action the
    Node entity recorded as run, which "covered" the faults queued behind it."""
    stack = slow_reboots
    # GPU 0's reboot holds the slot; GPU 1's reboot queues behind it and is held there, then GPU 2's.
    node, first = await repair_waiting_for_boot(stack)
    second = await _queued_behind(stack, node, 1, xid=79)
    await second.execute_update(flows.GpuRepair.hold, {"reason": "vendor ticket 4711"})
    third = await _queued_behind(stack, node, 2, xid=79)

    # The reboot ends: the slot comes to the held repair, which gives it back; GPU 2's takes it.
    _booted(stack, node)
    assert GpuRepairResult.model_validate(await first.result()).outcome == "repaired"
    status = await eventually(lambda: _next_action(stack, node, first.id), timeout=30)
    assert [a.repair_id for a in status.node_actions] == [first.id, third.id], \
        "the held repair acted, or its slot given back stays on record as an action that ran"
    await eventually(lambda: _waiting_for_boot(third), timeout=30)  # its own reboot, GPU 1's fault beside it
    held_state = await ladder(stack, node.node_name, 1)
    assert held_state.held and held_state.step == "held", held_state
    assert [(a.rung, a.outcome) for a in held_state.attempts] == [(Rung.REBOOT, "running")]
    shown = await _details(second)
    assert "**held**" in shown and "went back unused" in shown, shown
    assert stack.world.machine(node.machine_id)["reboots"] == 2, "GPU 0's and GPU 2's reboots; none held"

    _booted(stack, node)
    third_result = GpuRepairResult.model_validate(await third.result())
    assert [(a.rung, a.outcome) for a in third_result.attempts] == [(Rung.REBOOT, "passed")], third_result
    # Released, GPU 1's repair asks for the slot again: GPU 2's reboot, begun after its fault, covers it.
    await second.execute_update(flows.GpuRepair.release, {"reason": "ticket closed"})
    second_result = GpuRepairResult.model_validate(await second.result())
    assert [(a.rung, a.outcome) for a in second_result.attempts] == [(Rung.REBOOT, "covered")], second_result
    assert second_result.outcome == "repaired"
    assert stack.world.machine(node.machine_id)["reboots"] == 2

    await replay_and_record(second, RECORDED_HELD)
    await replay_and_record(stack.client.get_workflow_handle(f"node/{node.node_name}"), RECORDED_HELD_NODE)


@pytest.fixture
async def five_gpus(temporal_env, tmp_path):
    """``slow_reboots`` on five-GPU machines: one repair holds the slot, four queue behind it."""
    fleet = repair_fleet()
    fleet["sites"][0]["gpus_per_machine"] = 5
    fleet["repair"]["timeouts"]["reboot_seconds"] = 120
    fleet["repair"]["thresholds"] = {"node_remediation_limit": 10}  # five repairs of one node: none a replace
    async for stack in running_stack(temporal_env.client, tmp_path, fleet):
        yield stack


async def _waits_sent(node_entity: WorkflowHandle) -> list[str]:
    """The repairs the Node entity sent a ``node_action_wait``, one entry a signal, from its history."""
    history = await node_entity.fetch_history()
    return [attributes.workflow_execution.workflow_id for event in history.events
            if event.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
            and (attributes := event.signal_external_workflow_execution_initiated_event_attributes).signal_name
            == flows.GpuRepair.node_action_wait]


async def test_repairs_queued_for_the_slot_are_told_their_wait_in_signals_linear_in_the_queue(five_gpus: Stack) -> None:
    """Q repairs of one node queued for its action slot cost at most two ``node_action_wait`` each:
    told once as it queues, and once more as the next in line (2Q-3 in all). Before, every waiter
    was told again each time the slot changed hands: Q(Q-1)/2, 10 here, 28 for an 8-GPU node."""
    stack = five_gpus
    # GPU 0's reboot holds the node's slot; four GPUs' resets (none covers another) queue behind it.
    node, first = await repair_waiting_for_boot(stack)
    queued = [await _queued_behind(stack, node, gpu, xid=48) for gpu in (1, 2, 3, 4)]
    held = await _held_by(stack, node, first.id)

    # The last in line still says why it waits and until when: the request right ahead of it, and its
    # own turn at the latest, once the reboot and the three resets ahead (5 s each) gave the slot back.
    turn_by = _back_by(held) + timedelta(seconds=3 * 5)
    await eventually(lambda: _details_naming(queued[-1], _queued_when_told(queued[-2].id, 3, held, turn_by)),
                     timeout=30)
    await eventually(lambda: _details_naming(queued[0], held), timeout=30)
    # The queue as it is now is the Node entity's to say.
    status = await eventually(lambda: node_status(stack, node.node_name), timeout=30)
    assert status.slot_queue == [handle.id for handle in queued], status.slot_queue
    cli = await gpufleet(stack, "repair", "node", node.node_name)
    assert cli.returncode == 0, cli.stderr
    assert f"queued for the node's action slot, next first: {queued[0].id}" in cli.stdout, cli.stdout

    _booted(stack, node)
    for handle in (first, *queued):
        result = GpuRepairResult.model_validate(await handle.result())
        assert result.outcome == "repaired", (handle.id, result)

    # Told once as it queued, and once more on becoming next in line behind a holder it was not
    # told of; the first in line, behind the reboot from the start, once.
    node_entity = stack.client.get_workflow_handle(f"node/{node.node_name}")
    waits, q = await _waits_sent(node_entity), 5
    assert [waits.count(handle.id) for handle in queued] == [1, 2, 2, 2], waits
    assert len(waits) == 2 * q - 3, waits  # the code before: q * (q - 1) / 2 = 10

    await replay_and_record(node_entity, RECORDED_QUEUE)


def test_a_node_run_from_before_the_patch_told_the_whole_queue_at_each_hand_over() -> None:
    """What the two recorded runs of three repairs queued are (tests/test_replay.py replays both): the
    run from before ``node-tells-the-queue-once`` replays down its old path, and one after it records
    the patch; the same three signals either way (2Q-3 = Q(Q-1)/2 at Q = 3), the one further back told
    when its turn comes."""
    from workflows.node import NODE_TELLS_THE_QUEUE_ONCE

    wait = flows.GpuRepair.node_action_wait
    (before, waits_before), (after, waits_after) = _sent(RECORDED_TOLD_BEFORE, wait), _sent(RECORDED_TOLD, wait)
    assert NODE_TELLS_THE_QUEUE_ONCE not in before and len(waits_before) == 3
    assert not any(wait.get("turn_by") for wait in waits_before), waits_before
    assert NODE_TELLS_THE_QUEUE_ONCE in after and len(waits_after) == 3
    assert [bool(wait["turn_by"]) for wait in waits_after] == [False, True, False], waits_after
    # Five repairs queued (the recorded run of the test above): 2Q-3 = 7, where the path before sent 10.
    queue, waits = _sent(RECORDED_QUEUE, wait)
    assert NODE_TELLS_THE_QUEUE_ONCE in queue and len(waits) == 7, waits


def test_a_node_run_from_before_the_patch_granted_the_ended_repair_and_one_after_did_not() -> None:
    """What the two recorded runs are (tests/test_replay.py replays both against today's code): the
    run from before ``node-patches-at-start-3`` replays down its old path, the grant to a closed
    repair and the covered reset included, as a Node run open at the deploy must."""
    from workflows.node import NODE_PATCHES_AT_START_3

    before, after = _grants(HISTORIES / f"{RECORDED_BEFORE}.json"), _grants(HISTORIES / f"{RECORDED}.json")
    assert NODE_PATCHES_AT_START_3 not in before["markers"]
    assert before["to_the_cancelled"] == [flows.GpuRepair.node_action_grant], before
    assert NODE_PATCHES_AT_START_3 in after["markers"]
    assert after["to_the_cancelled"] == [], after


def test_a_node_run_from_before_the_patch_let_one_reset_cover_another_and_one_after_did_not() -> None:
    """What the two recorded runs of two GPUs' resets are (tests/test_replay.py replays both): the run
    from before ``node-patches-at-start-7`` replays down its old path, the second GPU's reset "covered"
    by the first, as a Node run open at the deploy must."""
    from workflows.node import NODE_PATCHES_AT_START_7

    grant = flows.GpuRepair.node_action_grant
    (before, granted_before) = _sent(RECORDED_RESETS_BEFORE, grant)
    (after, granted_after) = _sent(RECORDED_RESETS, grant)
    assert NODE_PATCHES_AT_START_7 not in before
    assert [grant["covered_by"] for grant in granted_before if not grant["go"]] == ["reset"], granted_before
    assert NODE_PATCHES_AT_START_7 in after
    assert [grant["go"] for grant in granted_after] == [True, True], granted_after


def _sent(name: str, signal: str) -> tuple[list[str], list[dict]]:
    """A recorded run's patch markers, and the payloads of the ``signal`` signals it sent."""
    events = json.loads((HISTORIES / f"{name}.json").read_text())["events"]
    sent = [json.loads(base64.b64decode(attributes["input"]["payloads"][0]["data"])) for event in events
            if (attributes := event.get("signalExternalWorkflowExecutionInitiatedEventAttributes"))
            and attributes["signalName"] == signal]
    return _markers(events), sent


def _markers(events: list[dict]) -> list[str]:
    """The patch markers of a recorded run's events."""
    markers = []
    for event in events:
        if event["eventType"] == "EVENT_TYPE_MARKER_RECORDED" \
                and "patch-data" in event["markerRecordedEventAttributes"]["details"]:
            payload = event["markerRecordedEventAttributes"]["details"]["patch-data"]["payloads"][0]["data"]
            markers.append(json.loads(base64.b64decode(payload))["id"])
    return markers


def _grants(path: Path) -> dict[str, list[str]]:
    """A recorded Node run's patch markers, and the signals it sent to GPU 1's repair (cancelled
    while queued) after that repair ended."""
    events = json.loads(path.read_text())["events"]
    to_the_cancelled, ended = [], False
    for event in events:
        kind = event["eventType"]
        if kind == "EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_CANCELED":
            attributes = event["childWorkflowExecutionCanceledEventAttributes"]
            ended = ended or attributes["workflowExecution"]["workflowId"].endswith("/gpu1")
        elif kind == "EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED" and ended:
            attributes = event["signalExternalWorkflowExecutionInitiatedEventAttributes"]
            if attributes["workflowExecution"]["workflowId"].endswith("/gpu1"):
                to_the_cancelled.append(attributes["signalName"])
    return {"markers": _markers(events), "to_the_cancelled": to_the_cancelled}
