"""Shared set-up for the repair-ladder tests: a fast fleet with repair settings,
the control-plane worker, and the simulated node host probing GPU health fast."""

from __future__ import annotations

import asyncio
import copy
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from activities.env import FleetEnv
from fleet.errors import ClusterForbidden
from fleet.settings import Settings
from tests.conftest import TEST_FLEET, Stack, sim_host, write_fleet
from fleet.messages.join import JoinedNode, NodeJoinResult
from fleet.messages.repair import GpuRepairResult, LadderState, NodeStatus
from sim.cluster import SimCluster

REPAIR = {
    "timeouts": {"contain_seconds": 10, "drain_seconds": 1, "reset_seconds": 5, "reboot_seconds": 15,
                 "reinstall_seconds": 15, "replace_seconds": 60, "smoke_test_seconds": 6, "heartbeat_seconds": 3,
                 "provider_call_seconds": 4},
    "recheck_seconds": 0.5,
}


def repair_fleet(**repair: Any) -> dict[str, Any]:
    fleet = copy.deepcopy(TEST_FLEET)
    fleet["repair"] = {**copy.deepcopy(REPAIR), **repair}
    # Repairs are admitted by the Site entity at once (no settle wait for a burst of failures).
    fleet["incident"] = {"settle_seconds": 0}
    return fleet


def spot(fleet: dict[str, Any]) -> dict[str, Any]:
    """``fleet`` with every site spot: a reclaim notice is obeyed only from a node at a spot site."""
    fleet = copy.deepcopy(fleet)
    for site in fleet["sites"]:
        site["capacity_type"] = "spot"
    return fleet


def repair_settings(client: Client, tmp_path: Path, fleet: dict[str, Any] | None = None) -> Settings:
    return Settings(
        address=client.service_client.config.target_host,
        task_queue=f"gpufleet-repair-{uuid.uuid4().hex[:8]}",
        state_dir=tmp_path,
        config=str(write_fleet(tmp_path, fleet or repair_fleet())),
    )


def make_stack(client: Client, settings: Settings) -> Stack:
    env = FleetEnv.from_settings(settings)
    return Stack(client, settings, env.world, env.cluster)


async def start_host(stack: Stack, health_seconds: float = 0.2) -> tuple[asyncio.Event, asyncio.Task]:
    stop = asyncio.Event()
    host = sim_host(stack.client, stack.settings, poll_seconds=0.05)
    host.health_seconds = health_seconds
    stack.host_stop = stop
    return stop, asyncio.create_task(host.run(stop))


async def join_node(stack: Stack, site: str = "site-a") -> JoinedNode:
    handle = await stack.start_join({"site": site})
    return NodeJoinResult.model_validate(await handle.result()).nodes[0]


async def eventually(predicate, timeout: float = 30, interval: float = 0.1):
    """Like conftest.wait_for, for async predicates."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


def repair_handle(stack: Stack, node: str, gpu: int) -> WorkflowHandle:
    return stack.client.get_workflow_handle(f"repair/{node}/gpu{gpu}")


async def exists(handle: WorkflowHandle) -> bool:
    try:
        await handle.describe()
        return True
    except RPCError:
        return False


async def repair_result(stack: Stack, node: str, gpu: int, timeout: float = 60) -> GpuRepairResult:
    handle = repair_handle(stack, node, gpu)
    await eventually(lambda: exists(handle), timeout=timeout)
    return GpuRepairResult.model_validate(await asyncio.wait_for(handle.result(), timeout))


async def ladder(stack: Stack, node: str, gpu: int) -> LadderState | None:
    handle = repair_handle(stack, node, gpu)
    try:
        return await handle.query("ladder", result_type=LadderState)
    except Exception:  # noqa: BLE001 - not started yet, or its first task not run
        return None


async def node_status(stack: Stack, node: str) -> NodeStatus | None:
    try:
        return await stack.client.get_workflow_handle(f"node/{node}").query("status", result_type=NodeStatus)
    except Exception:  # noqa: BLE001
        return None


async def running_stack(client: Client, tmp_path: Path, fleet: dict[str, Any] | None = None) -> AsyncIterator[Stack]:
    from workers.control_plane import build_worker

    stack = make_stack(client, repair_settings(client, tmp_path, fleet))
    stop, host = await start_host(stack)
    worker = build_worker(client, stack.settings)
    running = asyncio.create_task(worker.run())
    try:
        yield stack
    finally:
        from tests.conftest import stop_stack

        await stop_stack(client, stack.settings.task_queue, worker, running, stop, host)


def cluster_refuses_to_read(monkeypatch, node_name: str) -> list[bool]:
    """Every read of ``node_name`` from the simulated cluster (the worker's own ``SimCluster`` too)
    raises what the Kubernetes adapter raises for a 403 (an RBAC mistake) while the returned flag
    is set: non-retryable, so the entity's facts read fails at once under its real retry policy.
    A transient outage (an API server away during an upgrade) fails the same read the same way,
    only after ``CLUSTER_RETRY``'s 10 attempts (about 2.5 minutes)."""
    refusing, read = [True], SimCluster.get_node

    def get_node(cluster: SimCluster, name: str):
        if refusing[0] and name == node_name:
            raise ClusterForbidden(f'get node {name}: nodes "{name}" is forbidden: User '
                                   '"system:serviceaccount:gpufleet:control-plane" cannot get resource "nodes"',
                                   code="403")
        return read(cluster, name)

    monkeypatch.setattr(SimCluster, "get_node", get_node)
    return refusing
