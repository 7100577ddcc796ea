"""A node's agent turned hostile at a moment the test picks: ``ArmedWatch.build_agent`` stands in
for ``workers.node_agent.build_agent`` (monkeypatched), runs the real agent's activities, and once
``armed`` answers each watch with ``armed_answer`` instead (a subclass says what), at once."""

from __future__ import annotations

from typing import Any, Callable

from temporalio import activity
from temporalio.worker import Worker

from activities.node_agent import NodeAgentActivities
from fleet.messages.repair import NodeWatchInput, NodeWatchResult
from fleet.naming import node_queue


class ArmedWatch:
    def __init__(self) -> None:
        self.inputs: list[NodeWatchInput] = []
        self.armed = False
        #: The real agent's last answer before it was armed.
        self.last: NodeWatchResult | None = None

    def armed_answer(self, input: NodeWatchInput) -> Any:
        raise NotImplementedError

    def more_activities(self) -> list[Callable]:
        """Activities of the real agent's this one replaces too, besides ``watch_node``."""
        return []

    def build_agent(self, client, node_name, gpus, executor, watch=None) -> Worker:
        agent = NodeAgentActivities(node_name, gpus, watch)

        @activity.defn(name="watch_node")
        async def watch_node(input: NodeWatchInput) -> Any:
            self.inputs.append(input)
            if not self.armed:
                self.last = await agent.watch_node(input)
                return self.last
            return self.armed_answer(input)

        own = [watch_node, *self.more_activities()]
        replaced = {getattr(a, "__name__", "") for a in own}
        others = [a for a in agent.all() if getattr(a, "__name__", "") not in replaced]
        return Worker(client, task_queue=node_queue(node_name), activities=[*others, *own],
                      activity_executor=executor, max_concurrent_activities=5)
