"""Upgrading a running fleet (docs/operations.md, "Upgrading the control plane"), as the runbook
says to, on a dev server: the worker of today's code runs a joined node's entities and a join
that waits for its machine; it stops; a worker of the next release (tests/upgrade_build.py:
NodeJoin with one more patch) starts.

- the join that was open across the deploy finishes on the new worker down the old path of the
  new patch, a join started after it takes the new path, and the entities from before answer
  and stay open on the new worker: no workflow task of any of them failed;
- ``gpufleet patches --deployed-since <when the old worker stopped>`` keeps NodeJoin's patches
  while that join is open and the entities' patches while their runs from before are open, and
  says ``can remove`` for NodeJoin's deprecated patch (``can deprecate`` for its other) once the
  join ended.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from cli.patches import _stamp
from fleet.naming import node_workflow_id, site_workflow_id
from tests.conftest import Stack, run_node_host, stop_stack
from tests.evacuation_helpers import FAST_JOIN
from tests.test_patches import gpufleet_patches
from tests.upgrade_build import NodeJoinNextRelease
from workers.control_plane import build_worker
from workflows import ALL_WORKFLOWS
from workflows.node_join import NodeJoin

NEXT_RELEASE = [w for w in ALL_WORKFLOWS if w is not NodeJoin] + [NodeJoinNextRelease]


async def _poll(check, timeout: float = 60, interval: float = 0.2):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(interval)


async def _failed_tasks(handle: WorkflowHandle) -> int:
    history = await handle.fetch_history()
    return sum(e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED for e in history.events)


async def test_a_new_release_takes_over_open_entities_and_a_join_mid_way(fleet_world: Stack) -> None:
    stack = fleet_world
    client, settings = stack.client, stack.settings
    address = client.service_client.config.target_host
    stop = asyncio.Event()
    host = await run_node_host(client, settings, stop)
    worker = build_worker(client, settings)  # today's release
    running = asyncio.create_task(worker.run())
    try:
        # Before the deploy: the Site entity, a node joined (its Node entity) and a join waiting
        # for its machine to boot.
        site = await client.start_workflow("Site", {"site": "site-a"}, id=site_workflow_id("site-a"),
                                           task_queue=settings.task_queue)
        first = await stack.start_join({"site": "site-a", "timeouts": FAST_JOIN}, request="before")
        joined = (await first.result())["nodes"][0]["node_name"]
        stack.world.set_site("site-a", boot_seconds=6)
        across = await stack.start_join({"site": "site-a", "timeouts": FAST_JOIN}, request="across")

        async def waiting() -> bool:
            return (await across.query("progress"))["step"] == "waiting for registration"
        await _poll(waiting)

        # The deploy: the old release's worker stops; when it has stopped is the deploy's time.
        await worker.shutdown()
        await running
        deployed = datetime.now(timezone.utc)
        await asyncio.sleep(0.3)  # the next start is after it
        worker = build_worker(client, settings, workflows=NEXT_RELEASE)
        running = asyncio.create_task(worker.run())

        # The verdicts while the join from before is open: every patch of a type with an open run
        # from before is kept, and no other.
        rows = await asyncio.to_thread(gpufleet_patches, address, settings.task_queue, deployed)
        said = {(r["workflow"], r["patch"]): r["verdict"] for r in rows}
        since = _stamp(deployed)
        assert said[("NodeJoin", "join-admits-to-its-end")] == \
            f"keep deprecated: 1 open run of NodeJoin started before {since}"
        assert said[("NodeJoin", "join-by-hand-refuses-max-nodes-0")] == \
            f"keep: 1 open run of NodeJoin started before {since}"
        assert {v for (t, _), v in said.items() if t == "Node"} == {f"keep: 1 open run of Node started before {since}"}
        assert {v for (t, _), v in said.items() if t == "Site"} == {f"keep: 1 open run of Site started before {since}"}
        for short in ("ModelRollout", "FleetSweep", "AcquireCapacity", "SiteEvacuation"):
            assert {v for (t, _), v in said.items() if t == short} <= {"can deprecate", "can remove"}, short

        # The join from before finishes on the new release, down the old path of its new patch.
        stack.world.set_site("site-a", boot_seconds=0.1)
        result = await asyncio.wait_for(across.result(), 90)
        names = {joined, result["nodes"][0]["node_name"]}
        assert await across.query("next_path") is False
        # A join started after the deploy takes the new path.
        after = await stack.start_join({"site": "site-a", "timeouts": FAST_JOIN}, request="after")
        names.add((await asyncio.wait_for(after.result(), 90))["nodes"][0]["node_name"])
        assert await after.query("next_path") is True

        # The entities from before answer on the new release and are still open; the Site entity
        # counted the nodes joined on both sides of the deploy.
        node = client.get_workflow_handle(node_workflow_id(joined))
        assert (await node.query("status"))["node_name"] == joined

        async def counted() -> bool:
            return names <= set((await site.query("status"))["nodes"])
        await _poll(counted, timeout=30)
        for entity in (node, site):
            assert (await entity.describe()).status == WorkflowExecutionStatus.RUNNING
        for handle in (first, across, after, node, site):
            assert await _failed_tasks(handle) == 0, handle.id

        # The join from before has ended: NodeJoin's deprecated patch can go, its other be deprecated;
        # the entities' stay.
        rows = await asyncio.to_thread(gpufleet_patches, address, settings.task_queue, deployed)
        said = {(r["workflow"], r["patch"]): r["verdict"] for r in rows}
        assert said[("NodeJoin", "join-admits-to-its-end")] == "can remove"
        assert said[("NodeJoin", "join-by-hand-refuses-max-nodes-0")] == "can deprecate"
        assert {v for (t, _), v in said.items() if t == "Node"} == {f"keep: 1 open run of Node started before {since}"}
    finally:
        await stop_stack(client, settings.task_queue, worker, running, stop, host)
