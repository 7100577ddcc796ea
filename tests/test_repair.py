"""The per-GPU repair ladder end to end: real dev server, simulated fleet and GPUs."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest
from typer.testing import CliRunner
from temporalio.client import (
    WithStartWorkflowOperation,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment
from temporalio.api.enums.v1 import EventType

from activities.env import FleetEnv
from activities.evacuation import EvacuationActivities
from fleet.contracts import workflows as flows
from fleet.messages.evacuation import HoldRepairsInput
from fleet.messages.nodes import HealthReport
from activities.repair import FENCE_PREFIX, RepairActivities, fence_key
from cli.main import app
from fleet.models import GpuHealth, XidEvent
from fleet.naming import node_queue
from fleet.repair_policy import Rung
from fleet.settings import Settings
from tests.conftest import Stack, terminate_running, write_before_next_cordon
from tests.details_helpers import decided, held, scheduled, until
from tests.replay import replay_and_record
from tests.test_repair_cancel import SLOW_BOOT_SECONDS, _details
from tests.test_watches import add_node
from tests.repair_helpers import (
    cluster_refuses_to_read,
    eventually,
    exists,
    join_node,
    ladder,
    REPAIR,
    make_stack,
    node_status,
    repair_fleet,
    repair_handle,
    repair_result,
    repair_settings,
    running_stack,
    start_host,
)
from sim.cluster import SimCluster
from sim.gpu import SimGpuBackend
from sim.provider import SimProvider
from workers.control_plane import build_worker
from workers.health_report import send_report
from fleet.messages.repair import ATTEMPTS_KEPT, GpuRepairInput, LadderState, SkipToInput
from fleet.messages.join import JoinTimeouts

#: The event of a child workflow's start.
START_CHILD = EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED


@pytest.fixture
async def rstack(temporal_env, tmp_path):
    async for stack in running_stack(temporal_env.client, tmp_path):
        yield stack


def cordoned(stack: Stack, node: str) -> bool:
    n = stack.cluster.get_node(node)
    return bool(n and n.unschedulable)


async def history_order(stack: Stack, workflow_id: str) -> list[str]:
    """Activity types in the order they were scheduled."""
    history = await stack.client.get_workflow_handle(workflow_id).fetch_history()
    return [e.activity_task_scheduled_event_attributes.activity_type.name
            for e in history.events if e.HasField("activity_task_scheduled_event_attributes")]


def test_uncontain_leaves_a_node_another_gpus_repair_fenced_between_its_look_and_its_uncordon(
        tmp_path, monkeypatch) -> None:
    """GPU 0's repair is done: it drops its fence and, no other GPU fenced, uncordons the node; GPU 1's
    repair fences it right in between (and cordons). The uncordon, made on the marks read, is
    refused; read again, GPU 1 is fenced: the node stays cordoned, that repair's. Before, the
    uncordon lifted GPU 1's cordon: the node took pods on a GPU under repair."""
    from fleet.messages.nodes import FenceInput, UncontainInput

    env = FleetEnv.from_settings(Settings(state_dir=tmp_path))
    add_node(env, "gpu-node")
    acts = RepairActivities(env)
    ActivityEnvironment().run(acts.fence_gpu, FenceInput(node_name="gpu-node", gpu=0, rung="reset"))

    def gpu_1_fenced() -> None:  # as fence_gpu does
        env.cluster.annotate_node("gpu-node", {fence_key(1): "reset"})
        env.cluster.cordon("gpu-node", True)

    raced = write_before_next_cordon(monkeypatch, env.cluster, "gpu-node", gpu_1_fenced)
    result = ActivityEnvironment().run(acts.uncontain_gpu, UncontainInput(node_name="gpu-node", gpu=0))
    assert raced, "GPU 1 was fenced between the uncontain's look and its uncordon"
    assert (result.uncordoned, result.still_fenced) == (False, [1]), result
    assert env.cluster.get_node("gpu-node").unschedulable, "GPU 1's repair keeps the node cordoned"


async def test_xid48_reset_fixes_and_node_serves_only_after_proof(rstack: Stack) -> None:
    node = await join_node(rstack)
    seen_cordoned = []

    async def watch() -> None:
        while True:
            seen_cordoned.append(cordoned(rstack, node.node_name))
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    rstack.world.inject_fault(node.machine_id, 0, "xid", 48, clears_on="reset")
    result = await repair_result(rstack, node.node_name, 0)
    watcher.cancel()
    assert result.outcome == "repaired"
    assert [(a.rung, a.outcome) for a in result.attempts] == [(Rung.RESET, "passed")]
    assert True in seen_cordoned, "the node was contained"
    assert not cordoned(rstack, node.node_name), "and serves again"
    order = await history_order(rstack, f"repair/{node.node_name}/gpu0")
    assert order.index("contain_gpu") < order.index("reset_gpu") < order.index("smoke_test") < order.index("uncontain_gpu")
    assert rstack.world.machine(node.machine_id)["reboots"] == 0
    assert rstack.world.gpu_health(node.machine_id)[0].xid_events == []
    annotations = rstack.cluster.annotate_node(node.node_name, {})
    assert fence_key(0) not in annotations


async def test_reset_failing_its_proof_climbs_to_reboot(rstack: Stack) -> None:
    node = await join_node(rstack)
    rstack.world.inject_fault(node.machine_id, 1, "xid", 48, clears_on="reboot")
    result = await repair_result(rstack, node.node_name, 1)
    assert [(a.rung, a.outcome) for a in result.attempts] == [(Rung.RESET, "failed"), (Rung.REBOOT, "passed")]
    assert "XID 48" in result.attempts[0].detail
    assert rstack.world.machine(node.machine_id)["reboots"] == 1
    assert not cordoned(rstack, node.node_name)
    assert rstack.cluster.get_node(node.node_name).ready


async def test_xid79_starts_at_reboot(rstack: Stack) -> None:
    node = await join_node(rstack)
    boot_before = rstack.cluster.get_node(node.node_name).boot_id
    rstack.world.inject_fault(node.machine_id, 0, "xid", 79, clears_on="reboot")
    result = await repair_result(rstack, node.node_name, 0)
    assert [(a.rung, a.outcome) for a in result.attempts] == [(Rung.REBOOT, "passed")]
    assert "reset_gpu" not in await history_order(rstack, f"repair/{node.node_name}/gpu0")
    assert rstack.cluster.get_node(node.node_name).boot_id != boot_before, "boot id changed"
    assert rstack.world.machine(node.machine_id)["reboots"] == 1


async def test_a_reinstall_after_a_reboot_whose_boot_never_came_reinstalls_and_repairs(rstack: Stack) -> None:
    """The reboot's new boot never came (its wait ran out, the node still on its old boot id) and
    the GPU's fault clears only on a reinstall. The reinstall found the reboot's mark from that
    boot and took it for its own request: it never called the provider, and the ladder deleted
    the machine and bought another where a reinstall fixes it. The reinstall is requested, and
    the repair ends repaired on the same machine."""
    node = await join_node(rstack)
    rstack.world.set_site("site-a", boot_seconds=SLOW_BOOT_SECONDS)  # past the reboot's 15 s: it times out
    rstack.world.inject_fault(node.machine_id, 0, "xid", 79, clears_on="reinstall")
    await eventually(lambda: _rebooting(rstack, node.machine_id), timeout=40)
    rstack.world.set_site("site-a", boot_seconds=1)  # the reinstall's boot comes within its wait
    result = await repair_result(rstack, node.node_name, 0, timeout=120)
    assert [(a.rung, a.outcome) for a in result.attempts] == [(Rung.REBOOT, "failed"), (Rung.REINSTALL, "passed")], \
        result.attempts
    assert "did not come back with a new boot id" in result.attempts[0].detail
    assert result.outcome == "repaired"
    machine = rstack.world.machine(node.machine_id)
    assert machine["reinstalls"] == 1 and machine["deleted_at"] is None


#: Each step's limit long enough that a test, not the limit, ends the step it holds open.
PATIENT = {**REPAIR["timeouts"], "contain_seconds": 120, "reset_seconds": 150, "reboot_seconds": 180,
           "smoke_test_seconds": 210}


@pytest.fixture
async def patient(temporal_env, tmp_path):
    async for stack in running_stack(temporal_env.client, tmp_path, repair_fleet(timeouts=PATIENT)):
        yield stack


async def _saying(handle, words: str) -> str | None:
    details = await _details(handle)
    return details if words in details else None


async def test_each_wait_of_a_reset_says_until_when(patient: Stack, monkeypatch) -> None:
    """The repair's page names the bound of each step it waits in, by the workflow's clock in UTC:
    containing (one try's limit, ``contain_seconds``), the reset (``reset_seconds``: when a repair
    queued for the node's action slot is told it is expected back) and the proof
    (``smoke_test_seconds``). Before, none said until when."""
    stack, timeouts = patient, PATIENT
    node = await join_node(stack)
    draining, drained = held(monkeypatch, SimCluster, "drain_node")
    resetting, reset = held(monkeypatch, SimGpuBackend, "reset_gpu")
    proving, proved = held(monkeypatch, SimGpuBackend, "compute_check")  # after the join's own proof
    stack.world.inject_fault(node.machine_id, 0, "xid", 48, clears_on="reset")
    handle = repair_handle(stack, node.node_name, 0)
    await eventually(lambda: exists(handle), timeout=30)

    await eventually(lambda: asyncio.to_thread(draining.wait, 0.1), timeout=30)
    began, _ = await scheduled(handle, "contain_gpu")
    shown = await eventually(lambda: _saying(handle, "containing"), timeout=30)
    assert f"cordon, {until(began, timeouts['contain_seconds'])} (per try)" in shown, shown
    drained.set()

    await eventually(lambda: asyncio.to_thread(resetting.wait, 0.1), timeout=30)
    began, _ = await scheduled(handle, "reset_gpu")
    shown = await eventually(lambda: _saying(handle, "recovering"), timeout=30)
    assert f"reset {until(began, timeouts['reset_seconds'])}" in shown, shown
    reset.set()

    await eventually(lambda: asyncio.to_thread(proving.wait, 0.1), timeout=30)
    began, _ = await scheduled(handle, "smoke_test")
    shown = await eventually(lambda: _saying(handle, "proving"), timeout=30)
    assert f"smoke test on {node_queue(node.node_name)} {until(began, timeouts['smoke_test_seconds'])}" in shown, shown
    proved.set()
    assert (await repair_result(stack, node.node_name, 0)).outcome == "repaired"


async def test_each_wait_of_a_reboot_says_until_when(patient: Stack, monkeypatch) -> None:
    """A reboot holds the node's action slot for the provider's call and the wait for a new boot id:
    its page says until when (what a repair queued behind it is told), then the wait's own deadline.
    Before: "reboot", then "reboot: waiting for a new boot id", with no time."""
    stack, timeouts = patient, PATIENT
    node = await join_node(stack)
    stack.world.set_site("site-a", boot_seconds=600)  # the machine comes back when the test says
    rebooting, rebooted = held(monkeypatch, SimProvider, "reboot_machine")
    stack.world.inject_fault(node.machine_id, 0, "xid", 79, clears_on="reboot")
    handle = repair_handle(stack, node.node_name, 0)
    await eventually(lambda: exists(handle), timeout=30)

    await eventually(lambda: asyncio.to_thread(rebooting.wait, 0.1), timeout=30)
    began, _ = await scheduled(handle, "node_facts")  # the grant's task: facts, then the provider's call
    shown = await eventually(lambda: _saying(handle, "recovering"), timeout=30)
    slot = timeouts["provider_call_seconds"] + timeouts["reboot_seconds"]
    assert f"reboot {until(began, slot)} (the provider's call, then a new boot id)" in shown, shown
    rebooted.set()

    began, waiting = await eventually(lambda: scheduled(handle, "wait_for_boot"), timeout=30)
    deadline = datetime.fromisoformat(waiting["deadline"])
    # The task's clock, read here from its history to the microsecond the SDK may round.
    assert abs(deadline - began - timedelta(seconds=timeouts["reboot_seconds"])) < timedelta(milliseconds=1)
    shown = await eventually(lambda: _saying(handle, "waiting for a new boot id"), timeout=30)
    assert f"reboot: waiting for a new boot id {until(deadline)}" in shown, shown
    with stack.world.tx() as db:  # back now, with its new boot id
        db.execute("UPDATE machines SET boot_at=? WHERE id=?", (time.time(), node.machine_id))
    assert (await repair_result(stack, node.node_name, 0, timeout=90)).outcome == "repaired"


async def test_two_faults_on_one_node_cost_one_reboot(rstack: Stack) -> None:
    node = await join_node(rstack)
    rstack.world.inject_fault(node.machine_id, 0, "xid", 79, clears_on="reboot")
    rstack.world.inject_fault(node.machine_id, 1, "lost", clears_on="reboot")
    first, second = await asyncio.gather(
        repair_result(rstack, node.node_name, 0), repair_result(rstack, node.node_name, 1)
    )
    assert {first.outcome, second.outcome} == {"repaired"}
    outcomes = sorted(a.outcome for r in (first, second) for a in r.attempts)
    assert outcomes == ["covered", "passed"], "one repair rebooted, the other was covered by it"
    assert rstack.world.machine(node.machine_id)["reboots"] == 1
    assert not cordoned(rstack, node.node_name)


async def test_remap_failure_replaces_the_machine(rstack: Stack) -> None:
    node = await join_node(rstack)
    rstack.world.inject_fault(node.machine_id, 0, "remap_failure", clears_on="never")
    result = await repair_result(rstack, node.node_name, 0, timeout=90)
    assert result.outcome == "replaced"
    assert [a.rung for a in result.attempts] == [Rung.REPLACE]
    new = rstack.cluster.get_node(result.replacement_node)
    assert new is not None and new.ready and new.site == "site-a"
    assert rstack.cluster.get_node(node.node_name) is None, "old node removed"
    assert rstack.world.machine(node.machine_id)["deleted_at"] is not None, "old machine deleted"
    entity = rstack.client.get_workflow_handle(f"node/{node.node_name}")
    await asyncio.wait_for(entity.result(), 30)  # the old node's entity ends: gone


async def test_a_replacement_join_says_until_when_by_its_own_timeouts(rstack: Stack, monkeypatch) -> None:
    """The replace rung waits for its NodeJoin (tens of minutes: a machine bought, booted, proved),
    bounded by the join's own timeouts: its page says until when. Before: "replace: joining a node
    at site-a", with no time (it overwrote the bound said just before)."""
    node = await join_node(rstack)
    buying, bought = held(monkeypatch, SimProvider, "create_machine")  # the replacement's create
    rstack.world.inject_fault(node.machine_id, 0, "remap_failure", clears_on="never")  # starts at replace
    handle = repair_handle(rstack, node.node_name, 0)
    try:
        await eventually(lambda: asyncio.to_thread(buying.wait, 0.1), timeout=30)
        began, _ = await decided(handle, lambda e: e.event_type == START_CHILD)
        shown = await _details(handle)
    finally:
        bought.set()
    timeouts = JoinTimeouts()  # the join is started with its defaults
    seconds = timeouts.provision_seconds + timeouts.registration_seconds + timeouts.smoke_test_seconds
    assert shown.split("\n")[0] == (
        f"**recovering at rung replace**: replace: joining a node at site-a {until(began, seconds)} (its timeouts: "
        f"provision {timeouts.provision_seconds:g} s a try, registration {timeouts.registration_seconds:g} s, "
        f"smoke test {timeouts.smoke_test_seconds:g} s), then {node.node_name} retired"), shown
    result = await repair_result(rstack, node.node_name, 0, timeout=90)
    assert result.outcome == "replaced", result


async def test_an_exhausted_ladder_says_it_waits_for_a_person_with_no_deadline(temporal_env, tmp_path) -> None:
    """No rung left: the GPU stays contained until a person decides. Its page says there is no
    deadline and what the person may do, with the commands. Before: "node stays contained", nothing
    saying who ends the wait, nor that nothing will."""
    async for stack in running_stack(temporal_env.client, tmp_path, repair_fleet(max_rung="reset")):
        node = await join_node(stack)
        stack.world.inject_fault(node.machine_id, 0, "compute", clears_on="never")  # its proof fails
        stack.world.inject_fault(node.machine_id, 0, "ecc", 3, clears_on="never")  # the finding
        await eventually(lambda: _exhausted(stack, node.node_name), timeout=60)
        handle = repair_handle(stack, node.node_name, 0)
        shown = await _details(handle)
        name = node.node_name
        assert shown.split("\n")[0] == (
            f"**exhausted at rung reset**: no rung above reset allowed (max reset); node stays contained. No "
            f"deadline: a person decides: `gpufleet repair skip-to {name} 0 <rung>` re-enters the ladder, or cancel "
            f"this repair (`temporal workflow cancel --workflow-id repair/{name}/gpu0`) and the GPU stays fenced, "
            f"held for a person: `gpufleet repair return {name} 0 --reason ...` puts it back in service"), shown
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 30)
        # What it says is so: cancelled, the GPU is held for a person, whom the command answers.
        returned = await asyncio.to_thread(CliRunner().invoke, app, [
            "repair", "return", name, "0", "--reason", "checked by hand", "--address", stack.settings.address])
        assert returned.exit_code == 0 and "returned" in returned.output, returned.output


async def test_application_xid_never_starts_a_repair(rstack: Stack) -> None:
    node = await join_node(rstack)
    rstack.world.inject_fault(node.machine_id, 0, "xid", 13, clears_on="reset")
    status = await eventually(lambda: _app_xids_counted(rstack, node.node_name))
    assert status.active_repairs == {}
    assert not await exists(repair_handle(rstack, node.node_name, 0))
    assert not cordoned(rstack, node.node_name)


async def _app_xids_counted(stack: Stack, node: str):
    status = await node_status(stack, node)
    return status if status and status.app_xids.get("13") == 1 else None


async def test_reports_for_unknown_node_or_gpu_are_ignored(rstack: Stack) -> None:
    node = await join_node(rstack)
    now = datetime.now(timezone.utc)
    bad = GpuHealth(index=7, uuid="GPU-ghost", xid_events=[XidEvent(xid=79, at=now)])
    await send_report(rstack.client, rstack.settings.task_queue,
                      HealthReport(node_name=node.node_name, boot_id="b", gpus=[bad]))
    ghost = HealthReport(node_name="ghost-node", boot_id="b", gpus=[bad.model_copy(update={"index": 0})])
    await send_report(rstack.client, rstack.settings.task_queue, ghost)
    status = await asyncio.wait_for(rstack.client.get_workflow_handle("node/ghost-node").result(), 30)
    assert "does not know" in " ".join(status["log"])
    known = await eventually(lambda: _logged(rstack, node.node_name, "unknown GPU 7"))
    assert known.active_repairs == {}
    assert not await exists(repair_handle(rstack, node.node_name, 7))
    assert not await exists(repair_handle(rstack, "ghost-node", 0))


async def _logged(stack: Stack, node: str, text: str):
    status = await node_status(stack, node)
    return status if status and any(text in line for line in status.log) else None


async def test_a_node_entity_outlives_a_cluster_that_will_not_answer_and_repairs_once_it_does(
        rstack: Stack, monkeypatch) -> None:
    """The Node entity reads the node from the cluster before it acts on a finding. A read that
    failed (its retries spent, or refused) left ``run`` and failed the entity for good: the sick
    GPU never fenced, the node's health watch (spot notices too) gone, and nothing restarts it.
    Now the finding is kept on hold, the entity says what it waits for and until when, and acts
    as it would have once the cluster answers."""
    node = await join_node(rstack)
    entity = rstack.client.get_workflow_handle(f"node/{node.node_name}")
    refusing = cluster_refuses_to_read(monkeypatch, node.node_name)
    rstack.world.inject_fault(node.machine_id, 0, "xid", 48, clears_on="reset")

    async def refused_or_ended():
        if (await entity.describe()).status != WorkflowExecutionStatus.RUNNING:
            return True  # the old code: failed by the read's ActivityError
        return await _logged(rstack, node.node_name, "could not read node")

    await eventually(refused_or_ended, timeout=30)
    await asyncio.sleep(1)  # a few rechecks, each refused again
    assert (await entity.describe()).status == WorkflowExecutionStatus.RUNNING
    status = await node_status(rstack, node.node_name)
    assert status.deferred == [0] and status.active_repairs == {}, status
    waits = re.compile(rf"could not read node {node.node_name} from the cluster \(ClusterForbidden: get node "
                       rf"{node.node_name}: .*\); trying again at \d\d:\d\d:\d\d UTC")
    assert any(waits.search(line) for line in status.log), status.log
    assert "GPU 0: XID 48" in next(line for line in status.log if waits.search(line))
    details = await _details(entity)  # what the UI shows
    assert waits.search(details), details
    assert not await exists(repair_handle(rstack, node.node_name, 0)), "nothing acted on unread facts"
    [row] = rstack.world.query("SELECT unschedulable FROM nodes WHERE name=?", node.node_name)  # not by get_node
    assert not row["unschedulable"]

    refusing[0] = False  # the cluster answers again: fenced, admitted by its site, repaired
    result = await repair_result(rstack, node.node_name, 0)
    assert result.outcome == "repaired" and [(a.rung, a.outcome) for a in result.attempts] == [
        (Rung.RESET, "passed")], result
    assert "fence_gpu" in await history_order(rstack, entity.id), "contained by the entity, as it would have been"
    assert (await entity.describe()).status == WorkflowExecutionStatus.RUNNING
    status = await eventually(lambda: _ready(rstack, node.node_name), timeout=30)
    assert status.deferred == [], status
    assert not cordoned(rstack, node.node_name)
    await replay_and_record(entity, "node_entity_repairs_once_the_cluster_answers")


async def _ready(stack: Stack, node: str):
    status = await node_status(stack, node)
    return status if status and status.state == "ready" and not status.active_repairs else None


async def test_failing_proof_keeps_the_node_out_and_operator_controls(temporal_env, tmp_path) -> None:
    async for stack in running_stack(temporal_env.client, tmp_path, repair_fleet(max_rung="reboot")):
        node = await join_node(stack)
        stack.world.inject_fault(node.machine_id, 0, "compute", clears_on="never")
        stack.world.inject_fault(node.machine_id, 0, "ecc", 3, clears_on="never")
        state = await eventually(lambda: _exhausted(stack, node.node_name), timeout=60)
        assert [(a.rung, a.outcome) for a in state.attempts] == [(Rung.RESET, "failed"), (Rung.REBOOT, "failed")]
        assert cordoned(stack, node.node_name), "a node that fails its proof stays out"
        handle = repair_handle(stack, node.node_name, 0)
        address = ["--address", stack.settings.address]
        shown = await asyncio.to_thread(CliRunner().invoke, app, ["repair", "show", node.node_name, "0", *address])
        assert shown.exit_code == 0, shown.output
        assert "exhausted" in shown.output and "reboot" in shown.output
        listed = await asyncio.to_thread(CliRunner().invoke, app, ["repair", "list", *address])
        assert listed.exit_code == 0, listed.output
        refused = await asyncio.to_thread(CliRunner().invoke, app, ["repair", "skip-to", node.node_name, "0", "warp", *address])
        assert refused.exit_code == 2
        # Operator: hold, then skip back to reset after the GPU was fixed by hand.
        with pytest.raises(WorkflowUpdateFailedError) as refused_hold:
            await handle.execute_update("hold", {"colour": "red"})  # hold takes a reason, nothing else
        assert "colour" in str(refused_hold.value.cause)
        held = await handle.execute_update("hold", {"reason": "GPU reseated by hand"}, result_type=None)
        assert held["held"] and held["hold_reason"] == "GPU reseated by hand"
        shown = await asyncio.to_thread(CliRunner().invoke, app, ["repair", "show", node.node_name, "0", *address])
        assert "held: GPU reseated by hand" in " ".join(shown.output.split())  # whose hold, and why
        with pytest.raises(WorkflowUpdateFailedError) as refused_rung:
            await handle.execute_update("skip_to", {"rung": "teleport"})  # no such rung: refused naming it
        cause = refused_rung.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == "InvalidInput" and cause.non_retryable, cause
        assert cause.message.startswith("invalid SkipToInput: rung: "), cause.message
        stack.world.clear_faults(node.machine_id, "never")
        await handle.execute_update("skip_to", SkipToInput(rung=Rung.RESET))
        await asyncio.sleep(0.5)
        assert cordoned(stack, node.node_name), "held: still contained, nothing done"
        with pytest.raises(WorkflowUpdateFailedError) as refused_release:
            await handle.execute_update("release")  # null (a payload lost on the way) never releases
        assert refused_release.value.cause.type == "InvalidInput", refused_release.value.cause
        await asyncio.sleep(0.5)
        assert cordoned(stack, node.node_name), "still held"
        await handle.execute_update("release", {"reason": "reseated and checked"})
        result = await asyncio.wait_for(handle.result(), 30)
        assert result["outcome"] == "repaired", [(a["rung"], a["outcome"], a.get("detail")) for a in result["attempts"]]
        assert not cordoned(stack, node.node_name)


async def test_a_ladder_re_run_many_times_keeps_its_newest_attempts(temporal_env, tmp_path) -> None:
    """A person may re-run an exhausted ladder (``skip_to``) any number of times, and each attempt's
    detail holds what the node said: the ladder (its query, the result its Node entity gets, at most
    2 MiB) keeps the newest ``ATTEMPTS_KEPT`` attempts and counts the rest. Each attempt is still
    its own (its reset keyed apart, so each ran). Before, every attempt was kept."""
    async for stack in running_stack(temporal_env.client, tmp_path, repair_fleet(max_rung="reset")):
        node = await join_node(stack)
        stack.world.inject_fault(node.machine_id, 0, "compute", clears_on="never")
        stack.world.inject_fault(node.machine_id, 0, "ecc", 3, clears_on="never")
        handle = repair_handle(stack, node.node_name, 0)

        async def exhausted_after(resets: int) -> LadderState | None:
            ran = sum(a["op"] == "gpu_reset" for a in stack.world.actions(node.machine_id))
            return await _exhausted(stack, node.node_name) if ran == resets else None

        runs = ATTEMPTS_KEPT + 2
        await eventually(lambda: exhausted_after(1), timeout=60)
        for run in range(2, runs + 1):
            await handle.execute_update("skip_to", SkipToInput(rung=Rung.RESET))
            state = await eventually(lambda: exhausted_after(run), timeout=30)
        assert len(state.attempts) == ATTEMPTS_KEPT and state.earlier_attempts == runs - ATTEMPTS_KEPT, state
        assert all((a.rung, a.outcome) == (Rung.RESET, "failed") for a in state.attempts)
        shown = await asyncio.to_thread(CliRunner().invoke, app, ["repair", "show", node.node_name, "0",
                                                                  "--address", stack.settings.address])
        assert "and 2 earlier attempts" in " ".join(shown.output.split()), shown.output
        await handle.terminate("seen enough")


async def test_a_site_releases_the_repairs_it_held_and_no_others(temporal_env, tmp_path) -> None:
    """A provider incident holds the site's running repairs and, once it closes, releases them
    (``hold_site_repairs``, as the Site entity calls it). The release used to be sent without a
    payload, which GpuRepair refuses (a lost payload must never let a held ladder go): every
    repair the incident held stayed held for good. And a repair an operator held for a reason
    of theirs is theirs: the incident neither takes it over nor lets it go."""
    async for stack in running_stack(temporal_env.client, tmp_path, repair_fleet(max_rung="reboot")):
        nodes = [await join_node(stack), await join_node(stack)]
        for node in nodes:  # nothing fixes either GPU: each ladder ends exhausted, open, waiting
            stack.world.inject_fault(node.machine_id, 0, "compute", clears_on="never")
            stack.world.inject_fault(node.machine_id, 0, "ecc", 3, clears_on="never")
        for node in nodes:
            await eventually(lambda node=node: _exhausted(stack, node.node_name), timeout=60)
        await repair_handle(stack, nodes[1].node_name, 0).execute_update(
            flows.GpuRepair.hold, {"reason": "vendor ticket 4711"})
        incident = "site site-a: provider incident evacuate/site-a/1"
        activities, env = EvacuationActivities(None), ActivityEnvironment(client=stack.client)

        async def hold(on: bool) -> list[str]:
            return await env.run(activities.hold_site_repairs,
                                 HoldRepairsInput(site="site-a", hold=on, reason=incident))

        async def holds() -> list[tuple[bool, str]]:
            return [((s := await ladder(stack, n.node_name, 0)).held, s.hold_reason) for n in nodes]

        held = await eventually(lambda: hold(True), timeout=20)  # once visibility lists them
        assert held == [f"repair/{nodes[0].node_name}/gpu0"]
        assert await hold(True) == held, "run again (a retried attempt): the same, nothing held twice"
        assert await holds() == [(True, incident), (True, "vendor ticket 4711")]

        assert await hold(False) == held
        assert await holds() == [(False, incident), (True, "vendor ticket 4711")], \
            "the incident's hold went, the operator's stayed"


async def held_from_its_start(stack: Stack, node, reason: str):
    """GPU 0's repair on ``node``, started with a hold in its first task (update-with-start puts it
    there every time): the hold's answer and the repair's handle."""
    start = WithStartWorkflowOperation(
        flows.GpuRepair.TYPE, GpuRepairInput(node_name=node.node_name, gpu=0, site="site-a", machine_id=node.machine_id, gpus=2),
        id=f"repair/{node.node_name}/gpu0", task_queue=stack.settings.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.FAIL)
    held = await stack.client.execute_update_with_start_workflow(
        flows.GpuRepair.hold, {"reason": reason}, start_workflow_operation=start, result_type=LadderState)
    return held, await start.workflow_handle()


async def test_a_repair_held_the_moment_it_starts_is_held(rstack: Stack) -> None:
    """An operator (or a site's incident) holds a repair the moment it appears. The update then
    reaches the run's first task, whose updates the SDK hands to their handlers before ``run``
    has built the ladder, and the hold was refused: "the repair is not running" (a full CI run
    hit it). Now such a hold starts the ladder held: nothing contained until it is released."""
    node = await join_node(rstack)
    repair_id = f"repair/{node.node_name}/gpu0"
    held, handle = await held_from_its_start(rstack, node, "looking at it first")
    assert (held.held, held.hold_reason) == (True, "looking at it first")
    await asyncio.sleep(0.5)
    state = await ladder(rstack, node.node_name, 0)
    assert state.held and state.attempts == [], state
    assert "contain_gpu" not in await history_order(rstack, repair_id), "held: not even contained"
    assert not cordoned(rstack, node.node_name)
    await handle.execute_update(flows.GpuRepair.release, {"reason": "go ahead"})
    result = await asyncio.wait_for(handle.result(), 30)
    assert result["outcome"] == "repaired", [(a["rung"], a["outcome"], a.get("detail")) for a in result["attempts"]]
    assert not cordoned(rstack, node.node_name)
    await replay_and_record(handle, "gpu_repair_held_at_start")


@pytest.mark.parametrize("given, field, words", [
    # gpus left at its default (1) on a node of 2: every proof failed ("2 of 1 GPUs visible"), the
    # ladder climbed to replace, bought a machine and retired the healthy node.
    ({"gpu": 0}, "gpus", "gpus: 1, but node {node} has 2 GPUs"),
    ({"gpu": 2, "gpus": 2}, "gpu", "gpu: must be less than gpus (2)"),
    # Another site than the node's: its reboot, its replacement and the machine's retirement went to
    # that site and its provider account.
    ({"gpu": 0, "gpus": 2, "site": "site-b"}, "site", "site: site-b, but node {node} is at site-a"),
])
async def test_a_repair_started_by_hand_with_gpus_or_a_site_the_node_lacks_is_refused_at_start(
        rstack: Stack, given: dict, field: str, words: str) -> None:
    node = await join_node(rstack)
    machines = len(rstack.world.machines(include_deleted=True))
    handle = await rstack.client.start_workflow(
        flows.GpuRepair.TYPE, {"node_name": node.node_name, "site": "site-a", **given},
        id=f"repair/{node.node_name}/gpu{given['gpu']}", task_queue=rstack.settings.task_queue)
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(handle.result(), 60)
    refusal = caught.value.cause
    assert isinstance(refusal, ApplicationError) and refusal.type == "InvalidInput" and refusal.non_retryable
    assert words.format(node=node.node_name) in refusal.message and refusal.details[0]["fields"] == [field], refusal
    assert set(await history_order(rstack, handle.id)) <= {"node_facts"}, "nothing contained, reset or bought"
    assert not cordoned(rstack, node.node_name)
    assert not any(k.startswith(FENCE_PREFIX) for k in rstack.cluster.annotate_node(node.node_name, {})), "no GPU fenced"
    assert len(rstack.world.machines(include_deleted=True)) == machines, "no machine bought"
    assert rstack.world.machine(node.machine_id)["reboots"] == 0
    if field in ("gpus", "site"):
        await replay_and_record(handle, f"gpu_repair_refused_{field}")


async def _exhausted(stack: Stack, node: str, gpu: int = 0):
    state = await ladder(stack, node, gpu)
    return state if state and state.outcome == "exhausted" else None


async def test_worker_killed_mid_ladder_resumes_without_a_second_reboot(temporal_env, tmp_path) -> None:
    stack = make_stack(temporal_env.client, repair_settings(temporal_env.client, tmp_path))
    stop, host = await start_host(stack)
    worker = subprocess.Popen([sys.executable, "-m", "workers.control_plane"], env=stack.settings_env())
    try:
        node = await join_node(stack)
        stack.world.set_site("site-a", boot_seconds=3.0)  # the reboot takes a while
        stack.world.inject_fault(node.machine_id, 0, "xid", 79, clears_on="reboot")
        await eventually(lambda: _rebooting(stack, node.machine_id), timeout=40)
        worker.kill()
        worker.wait()
        async with build_worker(stack.client, stack.settings):
            before = await ladder(stack, node.node_name, 0)  # answered by the new worker, after replay
            result = await repair_result(stack, node.node_name, 0)
            desc = await stack.client.get_workflow_handle(f"node/{node.node_name}").describe()
            node_running = desc.status == WorkflowExecutionStatus.RUNNING
            await terminate_running(stack.client, stack.settings.task_queue)  # this test's entities end with it
    finally:
        if worker.poll() is None:
            worker.kill()
        stop.set()
        await host
    assert before is None or before.rung == Rung.REBOOT
    assert [(a.rung, a.outcome) for a in result.attempts] == [(Rung.REBOOT, "passed")]
    assert stack.world.machine(node.machine_id)["reboots"] == 1, "no duplicate reboot"
    assert not cordoned(stack, node.node_name)
    assert node_running, "the Node entity kept running"


async def _rebooting(stack: Stack, machine_id: str) -> bool:
    return stack.world.machine(machine_id)["reboots"] >= 1


async def test_a_worker_stopped_under_an_open_repair_lets_python_close_it_quietly(temporal_env, tmp_path) -> None:
    """A control-plane worker that stops (every deploy) with a repair cached leaves that run's
    coroutine for Python to close, which throws ``GeneratorExit`` into the wait it is in. The
    ladder's cancel handling caught every BaseException and asked the workflow whether it was
    cancelled, outside any workflow's event loop: an 'Exception ignored' traceback on the way out
    (a full run showed it), and code run for a run that no longer exists."""
    import gc
    import traceback

    ignored: list[str] = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda raised: ignored.append("".join(traceback.format_exception(
        raised.exc_type, raised.exc_value, raised.exc_traceback)))
    try:
        async for stack in running_stack(temporal_env.client, tmp_path):
            await held_from_its_start(stack, await join_node(stack), "open while the worker stops")
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0.1)
    finally:
        sys.unraisablehook = previous
    assert not [text for text in ignored if "workflows/repair.py" in text], ignored
