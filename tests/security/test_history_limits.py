"""A node drives its own Node entity's history toward Temporal's limits while continue-as-new
cannot cut it.

Every answer a node gives lands in the history of the workflow that scheduled the activity,
whatever the workflow then makes of it: the gateway bounds one answer (512 KiB), nothing bounds
how many. The Node entity continues as new when the server suggests it (4 MB), but only with no
repair of the node running (``_active``), and the node decides that: a fatal XID it reports
starts one, and the repair's steps run on the node's own queue (a reset it holds, heartbeating,
for ``reset_seconds``; a smoke test it fails, climbing to a ladder exhausted that waits for a
person for good). Meanwhile its watch answers are paced (``_pace_watch``) but each may carry half
a megabyte: 30 early answers that change its digest are free, and one answer at half the watch's
wait (15 minutes) makes the next 30 free again, so about 15 MB every 15 minutes. At 50 MB (or
51,200 events) the server terminates the entity ("Workflow history size exceeds limit"): the
node's health, its repairs' action slot and its spot notices are then watched by nothing until
the site sweep starts it again.

Since ``node-paces-a-long-history`` a run whose history passed ``repair.timeouts.watch_pace_history_mib``
(16 MiB) or 16,384 events while a repair runs waits before each next watch, twice as long each
time (up to a year), or until no repair runs. Since ``node-continues-while-repairing`` the run
continues as new while repairs run (a ladder exhausted that waits for a person no longer keeps it:
tests/test_entity_gate.py), but not while one holds the node's action slot, as the reset the node
holds here does: the pace is the backstop there, until the slot is free.

The test runs that with the limits scaled down (the server's history limit, the repair settings'
pace and the entity's own bound) so it takes seconds: the node answers through the real gateway.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

import pytest
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.client import WorkflowExecutionStatus
from temporalio.common import RawValue
from temporalio.testing import WorkflowEnvironment

import workers.node_agent
from fleet.contracts import workflows as flows
from fleet.messages.join import JoinedNode
from fleet.messages.nodes import ResetGpuInput
from fleet.messages.repair import NodeStatus, NodeWatchInput
from tests.security.armed_watch import ArmedWatch
from tests.bad_input_helpers import task_failures
from tests.conftest import Stack
from tests.plugins.stack import session_temporal_env
from tests.repair_helpers import REPAIR, eventually, join_node, repair_fleet, running_stack
from tests.replay import replay_and_record

#: The server terminates a workflow whose history passes this (Temporal's default: 50 MB).
HISTORY_LIMIT = 800_000
#: Each padded answer: extra fields the report model ignores, each string under first_problem's bound.
PAD = {"pad": ["x" * 60_000]}


def history_limit_flags(limit: int) -> list[str]:
    """The dev server's flags that terminate a run past ``limit`` bytes of history."""
    return ["--dynamic-config-value", f"limit.historySize.error={limit}",
            "--dynamic-config-value", f"limit.historySize.warn={limit // 2}"]


@pytest.fixture(scope="module")
async def limited_env() -> AsyncIterator[WorkflowEnvironment]:
    # A dev server of the module's own, a node gateway in front of it (every simulated agent
    # reaches it through the gateway).
    async with session_temporal_env(*history_limit_flags(HISTORY_LIMIT)) as env:
        yield env


class PaddingNode(ArmedWatch):
    """The node's agent, turned: once ``armed``, each watch answers at once, a new digest (a
    change, the node's GPUs as they were) padded to ``PAD``; its resets hold, heartbeating,
    until ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.answers = 0
        self.bytes = 0
        self.resetting = asyncio.Event()
        self.release = asyncio.Event()

    def armed_answer(self, input: NodeWatchInput) -> RawValue:
        return self.padded(input)

    def more_activities(self) -> list:
        @activity.defn(name="reset_gpu")
        async def reset_gpu(input: ResetGpuInput) -> str:
            self.resetting.set()
            while not self.release.is_set():
                activity.heartbeat()
                await asyncio.sleep(0.5)
            return "reset"

        return [reset_gpu]

    def padded(self, input: NodeWatchInput) -> RawValue:
        assert self.last is not None
        self.answers += 1
        data = json.dumps({"node_name": input.node_name, "seq": input.seq + 1, "digest": f"padded-{self.answers}",
                           "boot_id": self.last.boot_id, "gpus": [g.model_dump(mode="json") for g in self.last.gpus],
                           **PAD}).encode()
        self.bytes += len(data)
        return RawValue(Payload(metadata={"encoding": b"json/plain"}, data=data))


@pytest.fixture
async def padding(limited_env, tmp_path, monkeypatch) -> AsyncIterator[tuple[Stack, JoinedNode, PaddingNode]]:
    """A stack on the limited server with a node joined, its agent a ``PaddingNode`` (unarmed)."""
    node_agent = PaddingNode()
    monkeypatch.setattr(workers.node_agent, "build_agent", node_agent.build_agent)
    fleet = repair_fleet(timeouts={**REPAIR["timeouts"], "reset_seconds": 600, "watch_pace_seconds": 0.1,
                                   "watch_pace_max_seconds": 0.5, "watch_pace_history_mib": 0.25})
    async for stack in running_stack(limited_env.client, tmp_path, fleet):
        node = await join_node(stack)

        async def watching() -> bool:
            return bool(node_agent.inputs)

        await eventually(watching, timeout=30)
        try:
            yield stack, node, node_agent
        finally:
            node_agent.release.set()


@pytest.mark.integration
async def test_a_node_padding_its_answers_while_its_repair_runs_keeps_its_entity_under_the_history_limit(
        padding) -> None:
    """The node reports a fatal XID and holds the reset of its repair, then answers every watch at
    once with a change padded to 60 KB. Past ``watch_pace_history_mib`` (here 0.25 MiB) each next
    watch waits twice as long as the one before, and the entity stays under the server's limit
    (here 800 KB; before: terminated after 13 answers), its repair running, no task failed."""
    stack, node, node_agent = padding
    handle = stack.client.get_workflow_handle(f"node/{node.node_name}")
    # A fatal XID: the entity starts a repair, whose reset the node holds (continue-as-new waits).
    stack.world.inject_fault(node.machine_id, 0, "xid", 48, clears_on="reset")
    await asyncio.wait_for(node_agent.resetting.wait(), 60)
    node_agent.armed = True
    stack.world.inject_fault(node.machine_id, 1, "xid", 13, clears_on="never")  # ends the watch in flight

    async def ended_or_paced_long() -> bool:
        if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
            return True
        status = await handle.query(flows.Node.status, result_type=NodeStatus)
        # The fifth pause: 0.5 s doubled four times.
        return any("the next watch waits 8s" in line for line in status.log)

    await eventually(ended_or_paced_long, timeout=120, interval=0.5)
    description = await handle.describe()
    size = description.raw_description.workflow_execution_info.history_size_bytes
    assert description.status == WorkflowExecutionStatus.RUNNING, (
        f"the entity ended {description.status.name} after {node_agent.answers} padded answers "
        f"({node_agent.bytes / 1e6:.1f} MB; its history {size / 1e6:.2f} MB)")
    assert size < HISTORY_LIMIT
    assert not await task_failures(handle)
    repair = stack.client.get_workflow_handle(f"repair/{node.node_name}/gpu0")
    assert (await repair.describe()).status == WorkflowExecutionStatus.RUNNING
    await replay_and_record(handle, "node_paces_a_long_history")
