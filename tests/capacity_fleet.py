"""A simulated fleet for the capacity tests: four sites at four accounts, unique names per test
(entity workflow ids such as ``site/<name>`` and ``account/<provider>/<name>`` live on the
session's one dev server, so every test gets its own)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import yaml
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.worker import Worker

from activities.env import FleetEnv
from fleet.settings import Settings
from sim.cluster import SimCluster
from sim.world import SimWorld
from tests.conftest import CONTROL_PLANE_QUEUES, run_node_host, stop_stack
from workers.control_plane import build_worker
from tests.replay import replay_and_record  # noqa: F401 - used by the scenario tests

#: Short everything: the sim boots in 0.1 s.
FAST_JOIN = {"registration_seconds": 10, "smoke_test_seconds": 10, "heartbeat_seconds": 5}


def capacity_fleet(uid: str, **site_overrides: dict[str, Any]) -> dict[str, Any]:
    def site(name, provider, account, geo, price, capacity_type="on-demand", risk=0.0):
        s = {"name": f"{name}-{uid}", "provider": provider, "account": f"{account}-{uid}", "region": "r1",
             "geography": geo, "gpu": "H100", "gpu_memory_gb": 80, "gpus_per_machine": 2,
             "instance_type": f"{name}.2xh100", "price_per_gpu_hour": price, "capacity_type": capacity_type,
             "max_nodes": 8, "sim": {"capacity": 4, "quota": 8, "boot_seconds": 0.1, "interruption_risk": risk}}
        s.update(site_overrides.get(name, {}))
        return s

    return {
        "mode": "sim",
        "accounts": [
            {"name": f"a-{uid}", "provider": "lambda", "credentials": {"env": "K"}},
            {"name": f"b-{uid}", "provider": "nebius", "credentials": {"env": "K"}},
            {"name": f"c-{uid}", "provider": "aws", "credentials": {"env": "K"}},
            {"name": f"d-{uid}", "provider": "hetzner", "credentials": {"env": "K"}},
        ],
        "sites": [
            site("cheap", "lambda", "a", "us-east", 2.0),
            site("mid", "nebius", "b", "eu", 2.5),
            site("dear", "aws", "c", "us-east", 3.5),
            # Spot: $1.50, risk 0.8 → ranks as $2.70 (between mid and dear).
            site("spot", "hetzner", "d", "eu", 1.5, "spot", 0.8),
        ],
    }


@dataclass
class CapStack:
    client: Client
    settings: Settings
    world: SimWorld
    cluster: SimCluster
    env: FleetEnv
    uid: str
    #: The control-plane worker and its task (``restart_worker`` replaces them).
    worker: Worker | None = None
    running: asyncio.Task | None = None

    async def restart_worker(self, fleet: dict[str, Any]) -> None:
        """The control plane restarted with another fleet config, as ``kubectl rollout restart``
        after the ConfigMap changed (docs/operations.md, "Changing the fleet config"): the worker
        stops (its watches fail over, as a pod's do), the file is rewritten, and a new worker reads it."""
        await self.worker.shutdown()
        await self.running
        Path(self.settings.config).write_text(yaml.safe_dump(fleet))
        self.env = FleetEnv.from_settings(self.settings)
        self.worker = build_worker(self.client, self.settings, self.env)
        self.running = asyncio.create_task(self.worker.run())

    def fleet(self) -> dict[str, Any]:
        """The fleet config the worker reads now."""
        return yaml.safe_load(Path(self.settings.config).read_text())

    def site(self, name: str) -> str:
        return f"{name}-{self.uid}"

    def account(self, letter: str) -> str:
        return f"{letter}-{self.uid}"

    def offer(self, name: str) -> str:
        return f"{name}-{self.uid}/{name}.2xh100"

    async def request(self, raw: dict[str, Any], name: str = "req") -> WorkflowHandle:
        raw = {"join_timeouts": FAST_JOIN, **raw}
        return await self.client.start_workflow(
            "AcquireCapacity", raw, id=f"capacity/{name}-{self.uid}-{uuid.uuid4().hex[:4]}",
            task_queue=self.settings.task_queue,
        )

    async def refresh_catalog(self) -> int:
        return await self.client.execute_workflow(
            "CatalogRefresh", None, id=f"catalog-refresh-{uuid.uuid4().hex[:8]}", task_queue=self.settings.task_queue
        )

    def account_handle(self, provider: str, letter: str) -> WorkflowHandle:
        return self.client.get_workflow_handle(f"account/{provider}/{self.account(letter)}")

    async def listed(self, query: str, timeout: float = 15) -> list:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            found = [w async for w in self.client.list_workflows(query)]
            if found or asyncio.get_running_loop().time() > deadline:
                return found
            await asyncio.sleep(0.1)


async def open_stack(client: Client, address: str, tmp_path: Path, fleet: dict | None = None,
                     uid: str | None = None) -> AsyncIterator[CapStack]:
    uid = uid or uuid.uuid4().hex[:6]
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(fleet or capacity_fleet(uid)))
    settings = Settings(address=address, task_queue=CONTROL_PLANE_QUEUES.get(address, f"cap-{uid}"), state_dir=tmp_path,
                        config=str(path))
    env = FleetEnv.from_settings(settings)
    stack = CapStack(client, settings, env.world, env.cluster, env, uid)
    stop = asyncio.Event()
    host = await run_node_host(client, settings, stop)
    stack.worker = build_worker(client, settings)
    stack.running = asyncio.create_task(stack.worker.run())
    try:
        yield stack
    finally:
        await stop_stack(client, settings.task_queue, stack.worker, stack.running, stop, host)


# -- an entity's failed pass (workflows/passes.py) ----------------------------------------------
async def details(handle: WorkflowHandle) -> str:
    """The workflow's current details (the UI's "User Metadata" tab)."""
    metadata = await handle.query("__temporal_workflow_metadata")
    return metadata.current_details if hasattr(metadata, "current_details") else metadata["currentDetails"]


async def failed_pass_shown(handle: WorkflowHandle, timeout: float = 15) -> str:
    """The entity's details once they say a pass failed ("could not ..."), the entity still
    running: a failed call ended it, before."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        status = (await handle.describe()).status
        assert status == WorkflowExecutionStatus.RUNNING, f"{handle.id} ended: {status.name}"
        text = await details(handle)
        if "could not" in text:
            return text
        assert asyncio.get_running_loop().time() < deadline, f"no failed pass shown: {text}"
        await asyncio.sleep(0.1)


async def failed_pass_cleared(handle: WorkflowHandle, timeout: float = 10) -> None:
    """A pass that worked: the details no longer say one failed, the entity still running."""
    deadline = asyncio.get_running_loop().time() + timeout
    while "could not" in (text := await details(handle)):
        assert asyncio.get_running_loop().time() < deadline, f"still shown: {text}"
        await asyncio.sleep(0.1)
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
