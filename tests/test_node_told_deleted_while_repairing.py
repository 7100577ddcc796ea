"""A node deleted from the cluster while a repair of it runs: its site's word (``cluster_state`` with
``deleted``) is kept until the repair ends, and once none runs the entity asks the cluster and ends
"replaced or removed" (``node-takes-told-deleted-after-its-repair``). Before, the word was logged and
dropped: a repair that ended other than replaced (here: cancelled) left the entity on a node the
cluster no longer has, holding it for a person (the needs-person alert firing for a node that does
not exist) until its watch's retries ran out (up to an hour). The recorded history replays
(tests/test_replay.py)."""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from fleet.messages.repair import NodeStatus
from tests.conftest import Stack
from tests.repair_helpers import eventually, node_status, running_stack
from tests.replay import replay_and_record
from tests.test_repair_cancel import repair_waiting_for_boot

#: A guard against a hang only (before, the entity lingered up to an hour).
ENDS_WITHIN = 30


@pytest.fixture
async def rstack(temporal_env, tmp_path):
    async for stack in running_stack(temporal_env.client, tmp_path):
        yield stack


async def _ended(handle: WorkflowHandle) -> bool:
    return (await handle.describe()).status != WorkflowExecutionStatus.RUNNING


async def test_a_node_deleted_while_its_repair_runs_ends_its_entity_once_the_repair_is_cancelled(
        rstack: Stack) -> None:
    """GPU 0's repair waits for the node's reboot; the node is deleted from the cluster and its site
    says so; the repair is cancelled (its GPU would wait for a person). The entity ends "gone", not
    held for a person on a node the cluster no longer has."""
    node, repair = await repair_waiting_for_boot(rstack)
    entity = rstack.client.get_workflow_handle(f"node/{node.node_name}")

    rstack.cluster.remove_node(node.node_name)  # its Site entity's watch sees it go and tells the entity

    async def heard() -> NodeStatus | None:
        status = await node_status(rstack, node.node_name)
        return status if status and any("deleted from the cluster" in line for line in status.log) else None

    status = await eventually(heard, timeout=30)
    assert status.active_repairs, "heard while the repair ran"

    await repair.cancel()
    await eventually(lambda: _ended(entity), timeout=ENDS_WITHIN)
    assert (await entity.describe()).status == WorkflowExecutionStatus.COMPLETED
    last = NodeStatus.model_validate(await entity.result())
    assert last.state == "gone", last
    assert not last.active_repairs
    assert any("the cluster does not know it: removed" in line for line in last.log), last.log
    await replay_and_record(entity, "node_entity_told_deleted_while_repairing")
