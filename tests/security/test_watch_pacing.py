"""A node that answers every ``watch_node`` at once, with a well-formed "nothing changed" report
padded with fields the report model ignores (up to the gateway's result limit).

An honest agent's watch is level-triggered: it answers when the node's state changed, or after
the watch's wait (minutes). The Node entity scheduled the next watch the moment an answer came,
and the gateway bounds a node's calls in flight, not their rate: such a node drove a workflow
task, an activity and about half a megabyte of history per round trip on the shared control-plane
worker and Temporal store, as fast as it liked (100 round trips, 42 MB, in 10 s). Since
``node-patches-at-start-2`` the entity paces the next watch (workflows/node.py ``_pace_watch``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import pytest
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue
from temporalio.worker import Worker

import workers.node_agent
from activities.node_agent import NodeAgentActivities
from fleet.contracts import workflows as flows
from fleet.messages.repair import NodeStatus, NodeWatchInput
from fleet.naming import node_queue
from tests.bad_input_helpers import task_failures
from tests.repair_helpers import eventually, join_node, running_stack
from tests.replay import replay_and_record

#: Extra fields the report model ignores: each string under first_problem's 64 KiB bound.
PAD = {"pad": ["x" * 60_000] * 7}
SECONDS = 10.0


class EagerWatch:
    def __init__(self) -> None:
        self.inputs: list[NodeWatchInput] = []
        self.armed = False
        self.bytes = 0

    def build_agent(self, client, node_name, gpus, executor, watch=None) -> Worker:
        agent = NodeAgentActivities(node_name, gpus, watch)

        @activity.defn(name="watch_node")
        async def watch_node(input: NodeWatchInput) -> Any:
            self.inputs.append(input)
            if not self.armed:
                return await agent.watch_node(input)
            data = json.dumps({"node_name": input.node_name, "seq": input.seq, "digest": input.digest,
                               "boot_id": "b", **PAD}).encode()
            self.bytes += len(data)
            return RawValue(Payload(metadata={"encoding": b"json/plain"}, data=data))

        others = [a for a in agent.all() if getattr(a, "__name__", "") != "watch_node"]
        return Worker(client, task_queue=node_queue(node_name), activities=[*others, watch_node],
                      activity_executor=executor, max_concurrent_activities=5)


@pytest.fixture
async def eager(temporal_env, tmp_path, monkeypatch) -> AsyncIterator:
    watch = EagerWatch()
    monkeypatch.setattr(workers.node_agent, "build_agent", watch.build_agent)
    async for stack in running_stack(temporal_env.client, tmp_path):
        node = await join_node(stack)

        async def watching() -> bool:
            return bool(watch.inputs)

        await eventually(watching, timeout=30)
        yield stack, node, watch


async def test_a_node_answering_every_watch_at_once_is_paced(eager) -> None:
    stack, node, watch = eager
    before = len(watch.inputs)
    watch.armed = True
    # Answer the watch in flight: the honest one blocks until something changes.
    stack.world.inject_fault(node.machine_id, 0, "xid", 13, clears_on="never")  # an application XID: no repair
    await asyncio.sleep(SECONDS)
    watch.armed = False
    rounds = len(watch.inputs) - before
    handle = stack.client.get_workflow_handle(f"node/{node.node_name}")
    # 3 free answers that change nothing, then pauses of 5 s, 10 s, ... (the first answer, the
    # fault's, changed something).
    assert rounds <= 6, f"{rounds} watch rounds in {SECONDS:g} s ({watch.bytes / 1e6:.1f} MB of history)"
    assert not await task_failures(handle)
    status = await handle.query(flows.Node.status, result_type=NodeStatus)
    assert any("the next watches are paced" in line for line in status.log), status.log
    await replay_and_record(handle, "node_watch_paced")
