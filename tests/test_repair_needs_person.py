"""A GPU its Node entity holds for a person (its repair was cancelled, failed or terminated:
fenced, node cordoned, ``needs_person``) is a person's to decide: ``gpufleet repair return``
puts it back in service, ``gpufleet repair retry`` repairs it again through its Site entity.

Product rule: nothing un-fences a GPU no proof passed but a person. Before these commands the
only way out was a new finding from the node's health watch, which a clean GPU never reports:
the node stayed cordoned for good.

The needs-person state is built as tests/test_repair_cancel.py builds it: a repair cancelled
while its reboot waits for the machine to boot again.
"""

from __future__ import annotations

import time

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WithStartWorkflowOperation, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy

from activities.repair import fence_key
from fleet.messages.join import JoinedNode
from fleet.contracts import workflows as flows
from fleet.messages.repair import GpuDecision, GpuRepairResult, NodeCarry, NodeEntityInput, NodeStatus
from fleet.repair_policy import Rung
from tests.conftest import without_input_guard, Stack
from tests.repair_helpers import cluster_refuses_to_read, eventually, running_stack, exists, node_status, repair_handle
from tests.replay import replay_and_record
from tests.test_cli import gpufleet
from tests.test_repair_cancel import _told_a_person, repair_waiting_for_boot, rstack  # noqa: F401

#: How fast the machine boots once the cancel has landed (the site's boot time in the test fleet).
QUICK_BOOT_SECONDS = 1.0


async def _held_for_a_person(stack: Stack) -> JoinedNode:
    """A node whose GPU 0 its entity holds for a person: the repair was cancelled during its
    reboot's wait for boot, the GPU left fenced and the node cordoned. The machine is then let
    boot at once (the slow boot was there only for the cancel to land in the wait), and its node
    is back on the new boot, so the node is healthy and nothing but a person moves it on."""
    node, handle = await repair_waiting_for_boot(stack)
    await handle.cancel()
    status = await eventually(lambda: _told_a_person(stack, node.node_name), timeout=60)
    assert set(status.needs_person) == {"0"}, status.needs_person

    stack.world.set_site("site-a", boot_seconds=QUICK_BOOT_SECONDS)
    with stack.world.tx() as db:  # the reboot the cancel left in flight ends now
        db.execute("UPDATE machines SET boot_at=? WHERE id=?", (time.time(), node.machine_id))
    await eventually(lambda: _on_its_new_boot(stack, node), timeout=30)
    assert fence_key(0) in stack.cluster.annotate_node(node.node_name, {})
    assert stack.cluster.get_node(node.node_name).unschedulable
    return node


async def _on_its_new_boot(stack: Stack, node: JoinedNode) -> bool:
    record = stack.cluster.get_node(node.node_name)
    return record is not None and record.ready and record.boot_id == stack.world.machine(node.machine_id)["boot_id"]


def _node_entity(stack: Stack, node: JoinedNode) -> WorkflowHandle:
    return stack.client.get_workflow_handle(f"node/{node.node_name}")


async def _ready(stack: Stack, node: JoinedNode) -> NodeStatus | None:
    status = await node_status(stack, node.node_name)
    return status if status and status.state == "ready" and not status.active_repairs else None


async def test_return_puts_the_gpu_back_in_service_and_uncordons_the_node(rstack: Stack) -> None:
    node = await _held_for_a_person(rstack)

    done = await gpufleet(rstack, "repair", "return", node.node_name, "0", "--reason", "vendor reseated the card")

    assert done.returncode == 0, done.stderr
    assert "returned" in done.stdout and "un-fenced, node uncordoned" in done.stdout, done.stdout
    assert fence_key(0) not in rstack.cluster.annotate_node(node.node_name, {})
    assert not rstack.cluster.get_node(node.node_name).unschedulable, "the node serves again"
    status = await node_status(rstack, node.node_name)
    assert status.state == "ready" and status.needs_person == {} and status.fenced == [], status
    assert any("returned to service by a person (vendor reseated the card)" in line for line in status.log), status.log
    shown = await gpufleet(rstack, "repair", "node", node.node_name)
    assert shown.returncode == 0, shown.stderr
    assert ": ready," in shown.stdout.splitlines()[0] and "needs a person" not in shown.stdout, shown.stdout
    # A person's word did it, not a repair: the cancelled one is still the GPU's last.
    assert (await repair_handle(rstack, node.node_name, 0).describe()).status == WorkflowExecutionStatus.CANCELED

    await replay_and_record(_node_entity(rstack, node), "node_entity_gpu_returned")


async def test_retry_at_a_rung_starts_a_new_repair_that_runs_to_repaired(rstack: Stack) -> None:
    node = await _held_for_a_person(rstack)
    cancelled_run = (await repair_handle(rstack, node.node_name, 0).describe()).run_id

    done = await gpufleet(rstack, "repair", "retry", node.node_name, "0", "--rung", "reboot",
                          "--reason", "the card was reseated; prove it")

    assert done.returncode == 0, done.stderr
    assert f"repair/{node.node_name}/gpu0 started at reboot" in done.stdout, done.stdout
    handle = repair_handle(rstack, node.node_name, 0)
    assert (await handle.describe()).run_id != cancelled_run, "a new run of the repair"
    result = GpuRepairResult.model_validate(await handle.result())
    assert result.outcome == "repaired" and [(a.rung, a.outcome) for a in result.attempts] == [
        (Rung.REBOOT, "passed")], result
    assert await _site_admissions(rstack) == 2, "admitted by the Site entity, as a finding's repair is"
    assert rstack.world.machine(node.machine_id)["reboots"] == 2, "the cancelled reboot and the retry's"
    # The repair took over the containment and gave the GPU back when its proof passed.
    assert fence_key(0) not in rstack.cluster.annotate_node(node.node_name, {})
    assert not rstack.cluster.get_node(node.node_name).unschedulable
    status = await eventually(lambda: _ready(rstack, node), timeout=30)
    assert status.needs_person == {}
    assert any("a person asked (the card was reseated; prove it)" in line and "at reboot" in line
               for line in status.log), status.log

    await replay_and_record(_node_entity(rstack, node), "node_entity_gpu_retried")


async def _site_admissions(stack: Stack) -> int:
    """How many repairs the node asked its Site entity to admit (``admit_repair``): the
    cancelled one's, then the retry's."""
    history = await stack.client.get_workflow_handle("site/site-a").fetch_history()
    return sum(1 for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
               and e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name
               == "admit_repair")


@pytest.mark.parametrize("command", [("return",), ("retry", "--rung", "reboot")], ids=["return", "retry"])
async def test_a_gpu_not_held_for_a_person_is_refused_naming_it(rstack: Stack, command: tuple[str, ...]) -> None:
    node = await _held_for_a_person(rstack)  # GPU 0 is held; GPU 1 is healthy and serving

    refused = await gpufleet(rstack, "repair", *command[:1], node.node_name, "1", *command[1:], "--reason", "typo")

    assert refused.returncode == 1, (refused.stdout, refused.stderr)
    assert "gpu: GPU 1" in refused.stderr and "not held for a person (held for a person: 0)" in refused.stderr, \
        refused.stderr
    # Nothing changed: GPU 0 still held and fenced, the node cordoned, no repair of GPU 1.
    status = await node_status(rstack, node.node_name)
    assert set(status.needs_person) == {"0"} and status.state == "needs-person", status
    assert not await exists(repair_handle(rstack, node.node_name, 1))
    assert fence_key(0) in rstack.cluster.annotate_node(node.node_name, {})
    assert rstack.cluster.get_node(node.node_name).unschedulable

    # A node with no running entity: refused, naming it.
    unknown = await gpufleet(rstack, "repair", *command[:1], "no-such-node", "0", *command[1:], "--reason", "typo")
    assert unknown.returncode == 1 and "no running Node entity node/no-such-node" in unknown.stderr, unknown.stderr


async def test_a_retry_the_cluster_cannot_read_the_node_for_is_refused_saying_so(rstack: Stack, monkeypatch) -> None:
    """``gpufleet repair retry`` reads the node first, as a finding's repair does. While the cluster
    does not answer (here it refuses: an RBAC mistake) the person hears that, in words naming the
    node and the cluster's answer, and the GPU stays held for them (before: the update failed with
    the read's bare "Activity task failed"). The entity runs on; the retry works once it answers."""
    node = await _held_for_a_person(rstack)
    refusing = cluster_refuses_to_read(monkeypatch, node.node_name)

    refused = await gpufleet(rstack, "repair", "retry", node.node_name, "0", "--reason", "reseated")

    assert refused.returncode == 1, (refused.stdout, refused.stderr)
    said = " ".join(refused.stderr.split())
    assert f"could not read node {node.node_name} from the cluster (ClusterForbidden: get node" in said, said
    assert "GPU 0 stays held for a person: try again" in said, said
    assert (await _node_entity(rstack, node).describe()).status == WorkflowExecutionStatus.RUNNING
    status = await node_status(rstack, node.node_name)
    assert set(status.needs_person) == {"0"} and status.deferred == [] and status.active_repairs == {}, status
    assert (await repair_handle(rstack, node.node_name, 0).describe()).status == WorkflowExecutionStatus.CANCELED

    refusing[0] = False
    done = await gpufleet(rstack, "repair", "retry", node.node_name, "0", "--reason", "reseated")
    assert done.returncode == 0 and f"repair/{node.node_name}/gpu0 started" in done.stdout, (done.stdout, done.stderr)

    await replay_and_record(_node_entity(rstack, node), "node_entity_retried_after_the_cluster_refused")


@pytest.fixture
async def unguarded_stack(temporal_env, tmp_path, monkeypatch):
    """``rstack`` without the input guard, which refuses a carry in a run that did not continue as
    new: a test starts a run as a continue-as-new starts it, with an update in that run's first task.
    (A real ``renew`` continues a Node whose GPU is held for a person as new too, the test below,
    but no test can time an update to land in the continued run's first task by it.)"""
    without_input_guard(monkeypatch)
    async for stack in running_stack(temporal_env.client, tmp_path):
        yield stack


async def test_a_return_in_a_continued_runs_first_task_sees_the_carried_hold(unguarded_stack: Stack) -> None:
    """A run continued as new gets what the entity knows in its input (``carry``); a person's
    ``gpufleet repair return`` that reaches its first task met the empty state ``__init__`` made
    and was refused: "GPU 0 is not held for a person (held for a person: none)". Now it waits
    for ``run`` to take its state (``Entity.until_started``). The run is started here as a
    continue-as-new starts it, its carry in its input, with the update in its first task (on a
    worker without the input guard, which refuses that start from any caller but the run before)."""
    rstack = unguarded_stack
    node = await _held_for_a_person(rstack)
    entity = _node_entity(rstack, node)
    await entity.terminate("test: stands for the run that continued as new")
    carry = NodeCarry(state="needs-person", needs_person={0: "its repair was cancelled"},
                      boot_id=rstack.world.machine(node.machine_id)["boot_id"])
    start = WithStartWorkflowOperation(
        flows.Node.TYPE, NodeEntityInput(node_name=node.node_name, carry=carry).model_dump(mode="json"),
        id=entity.id, task_queue=rstack.settings.task_queue, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING)
    decision = await rstack.client.execute_update_with_start_workflow(
        flows.Node.return_gpu, {"gpu": 0, "reason": "checked by hand"}, start_workflow_operation=start,
        result_type=GpuDecision)
    assert decision.outcome == "returned" and decision.uncordoned, decision
    assert fence_key(0) not in rstack.cluster.annotate_node(node.node_name, {})
    assert not rstack.cluster.get_node(node.node_name).unschedulable, "the node serves again"
    await replay_and_record(await start.workflow_handle(), "node_entity_gpu_returned_in_its_first_task")


async def test_a_node_whose_gpu_is_held_for_a_person_renews_carrying_the_hold(rstack: Stack) -> None:
    """``gpufleet patches renew`` (docs/operations.md, "Upgrading the control plane") sends ``renew``
    to every entity run from before a deploy: a Node entity whose GPU is held for a person moves on
    to a new run as an idle one does, the hold carried (the GPU still fenced, the node cordoned), and
    the person's ``gpufleet repair return`` is taken by the new run."""
    node = await _held_for_a_person(rstack)
    entity = _node_entity(rstack, node)
    first_run = (await entity.describe()).run_id

    # ``flows.Node.renew``: the name the SDK routes by (``flows.Entity`` only declares it).
    await entity.signal(flows.Node.renew)

    async def continued() -> str | None:
        run_id = (await entity.describe()).run_id
        return run_id if run_id != first_run else None
    await eventually(continued, timeout=30)
    old = rstack.client.get_workflow_handle(entity.id, run_id=first_run)
    assert (await old.describe()).status == WorkflowExecutionStatus.CONTINUED_AS_NEW
    status = await node_status(rstack, node.node_name)
    assert status.state == "needs-person" and set(status.needs_person) == {"0"}, status
    assert fence_key(0) in rstack.cluster.annotate_node(node.node_name, {})
    assert rstack.cluster.get_node(node.node_name).unschedulable

    done = await gpufleet(rstack, "repair", "return", node.node_name, "0", "--reason", "checked after the deploy")
    assert done.returncode == 0 and "un-fenced, node uncordoned" in done.stdout, (done.stdout, done.stderr)
    assert fence_key(0) not in rstack.cluster.annotate_node(node.node_name, {})
    assert not rstack.cluster.get_node(node.node_name).unschedulable, "the node serves again"
    await replay_and_record(old, "node_entity_renewed_held_for_a_person")
