"""Shared set-up for the provider-incident tests: a four-site fleet with unique
names per test (entity ids ``site/<name>`` live on the session's one dev server),
short incident timers, the control-plane worker and the simulated node host."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import yaml
from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.client import Client, WorkflowHandle

from activities.env import FleetEnv
from fleet.settings import Settings
from fleet.cluster import ServingSpec
from sim.cluster import SimCluster
from sim.world import SimWorld
from workers.control_plane import build_worker
from tests.conftest import sim_host
from tests.replay import replay_and_record  # noqa: F401 - used by the scenario tests
from fleet.messages.evacuation import EvacuationProgress

FAST_JOIN = {"registration_seconds": 15, "smoke_test_seconds": 10, "heartbeat_seconds": 5}
#: Everything short: the sim boots in 0.1 s.
INCIDENT = {
    "min_nodes": 3, "fraction": 0.3, "window_seconds": 30, "settle_seconds": 1.5, "check_seconds": 0.5,
    "probe_seconds": 0.5, "bake_seconds": 0.3, "drain_seconds": 2, "ready_seconds": 8,
    "capacity_deadline_seconds": 60, "smoke_test_seconds": 10,
}
REPAIR = {
    "timeouts": {"contain_seconds": 10, "drain_seconds": 1, "reset_seconds": 5, "reboot_seconds": 15,
                 "reinstall_seconds": 15, "replace_seconds": 60, "smoke_test_seconds": 6, "heartbeat_seconds": 3,
                 "provider_call_seconds": 4},
    "recheck_seconds": 0.5,
}


def incident_fleet(uid: str, incident: dict | None = None, **site_overrides: dict[str, Any]) -> dict[str, Any]:
    def site(name, provider, account, geo, price):
        s = {"name": f"{name}-{uid}", "provider": provider, "account": f"{account}-{uid}", "region": "r1",
             "geography": geo, "gpu": "H100", "gpu_memory_gb": 80, "gpus_per_machine": 2,
             "instance_type": f"{name}.2xh100", "price_per_gpu_hour": price, "max_nodes": 10,
             "sim": {"capacity": 10, "quota": 12, "boot_seconds": 0.1}}
        s.update(site_overrides.get(name, {}))
        return s

    return {
        "mode": "sim",
        "incident": {**INCIDENT, **(incident or {})},
        "repair": REPAIR,
        "accounts": [
            {"name": f"a-{uid}", "provider": "lambda", "credentials": {"env": "K"}},
            {"name": f"b-{uid}", "provider": "nebius", "credentials": {"env": "K"}},
            {"name": f"c-{uid}", "provider": "aws", "credentials": {"env": "K"}},
            {"name": f"d-{uid}", "provider": "hetzner", "credentials": {"env": "K"}},
        ],
        "sites": [
            site("a", "lambda", "a", "us-east", 2.0),
            {**site("b", "nebius", "b", "eu", 2.5), "compliance": True, **site_overrides.get("b", {})},
            site("c", "aws", "c", "us-east", 3.0),
            site("d", "hetzner", "d", "eu", 2.2),
        ],
    }


@dataclass
class IncStack:
    client: Client
    settings: Settings
    world: SimWorld
    cluster: SimCluster
    uid: str

    def site(self, name: str) -> str:
        return f"{name}-{self.uid}"

    async def join(self, name: str, count: int = 1) -> list[str]:
        site = self.site(name)
        await self.client.execute_workflow(
            "NodeJoin", {"site": site, "count": count, "timeouts": FAST_JOIN},
            id=f"join/{site}/{uuid.uuid4().hex[:6]}", task_queue=self.settings.task_queue,
        )
        return [m["id"] for m in self.world.machines(site)]

    def serve(self, model: str, name: str, replicas: int, gpus: int = 2) -> None:
        self.cluster.apply_serving(ServingSpec(model=model, site=self.site(name), image="vllm:1", replicas=replicas,
                                               gpus_per_replica=gpus))

    async def start_site(self, name: str, **extra) -> WorkflowHandle:
        return await self.client.start_workflow(
            "Site", {"site": self.site(name), "fill_request": {"join_timeouts": FAST_JOIN},
                     "evacuation": {"capacity_request": {"join_timeouts": FAST_JOIN, "backoff_seconds": 1}},
                     **extra},
            id=f"site/{self.site(name)}", task_queue=self.settings.task_queue,
        )

    async def workflows(self, kind: str, name: str, running: bool = False) -> list:
        query = f'WorkflowType = "{kind}" AND Site = "{self.site(name)}"'
        if running:
            query += ' AND ExecutionStatus = "Running"'
        return [w async for w in self.client.list_workflows(query)]

    def evacuation(self, name: str, n: int = 1) -> WorkflowHandle:
        return self.client.get_workflow_handle(f"evacuate/{self.site(name)}/{n}")

    async def evacuate_with_a_liar(self, name: str, lies: Callable[[str], None]) -> tuple[WorkflowHandle, str]:
        """Four nodes join ``name``; three fail (an incident: the site goes to weight 0) and,
        once the evacuation is under way, recover; ``lies(node)`` is told the fourth's name
        before its proof. Returns the evacuation and that node.

        The site's provider API is away from the moment the faults come until they are cleared:
        the evacuation's recovery (its API back, its nodes Ready) waits for it, so its proof comes
        after the faults are gone and the liar is named. Without it, a proof reached before this
        test looked (a loaded machine) met the faults still there."""
        machines = await self.join(name, 4)
        await self.start_site(name)
        for machine in machines[:3]:
            self.world.inject_fault(machine, 0, "ecc", 1, clears_on="never")
        self.world.set_site(self.site(name), unreachable=1)
        evacuation = self.evacuation(name)
        await poll(lambda: self.progress(name), timeout=60)
        for machine in machines[:3]:
            self.world.clear_faults(machine, "never")
        liar = self.world.machine(machines[3])["name"]
        lies(liar)
        self.world.set_site(self.site(name), unreachable=0)
        return evacuation, liar

    async def progress(self, name: str, n: int = 1) -> EvacuationProgress | None:
        try:
            return await self.evacuation(name, n).query("progress", result_type=EvacuationProgress)
        except Exception:  # noqa: BLE001 - not started yet
            return None


async def open_incident_stack(client: Client, tmp_path: Path, fleet: dict | None = None,
                              uid: str | None = None, terminate: bool = True) -> AsyncIterator[IncStack]:
    uid = uid or uuid.uuid4().hex[:6]
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(fleet or incident_fleet(uid)))
    settings = Settings(address=client.service_client.config.target_host, task_queue=f"inc-{uid}",
                        state_dir=tmp_path, config=str(path))
    env = FleetEnv.from_settings(settings)
    stack = IncStack(client, settings, env.world, env.cluster, uid)
    # Routing entities (``routing/<model>``) are shared by every test on the session's server:
    # one left running on an earlier test's queue would never apply this test's route changes.
    async for wf in client.list_workflows('WorkflowType = "Routing" AND ExecutionStatus = "Running"'):
        try:
            await client.get_workflow_handle(wf.id, run_id=wf.run_id).terminate("an earlier test's entity")
        except Exception:  # noqa: BLE001 - ended meanwhile
            pass
    stop = asyncio.Event()
    host = sim_host(client, settings, poll_seconds=0.05)  # through the session's node gateway
    host.health_seconds = 0.2
    host_task = asyncio.create_task(host.run(stop))
    try:
        async with build_worker(client, settings):
            yield stack
            if not terminate:  # a "killed" worker: leave the workflows for the next one
                return
            async for wf in client.list_workflows(f'TaskQueue = "{settings.task_queue}" AND ExecutionStatus = "Running"'):
                try:
                    await client.get_workflow_handle(wf.id, run_id=wf.run_id).terminate("test over")
                except Exception:  # noqa: BLE001
                    pass
    finally:
        stop.set()
        await host_task


#: The SDK's deadlock detector: a workflow task whose activation ran over 2 s of wall time. On a
#: loaded 2-core test machine a garbage collection of the worker's heap, mid-activation of a run
#: with 2,000 drains, takes that long; the server retries the task and the run goes on. A run that
#: really never yields fails every retry, and the caller's wait for its progress fails.
DEADLOCK_DETECTED = "[TMPRL1101] Potential deadlock detected"


def failed_tasks(history) -> list:
    """The run's failed workflow tasks, but for those the server closed to flush the events that
    came while a task ran (``FORCE_CLOSE_COMMAND``: more than ``history.maximumBufferedEventsBatch``,
    100, on a loaded test machine, as a run with hundreds of activities or signals in flight gets)
    and those the SDK's deadlock detector failed (``DEADLOCK_DETECTED``): the next task takes them,
    and the run goes on."""
    flushed = WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND
    return [e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
            and e.workflow_task_failed_event_attributes.cause != flushed
            and not e.workflow_task_failed_event_attributes.failure.message.startswith(DEADLOCK_DETECTED)]


async def poll(predicate, timeout: float = 30, interval: float = 0.1):
    """Until the async ``predicate()`` is truthy; returns its value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


def refuse(monkeypatch, method: str, error: Exception) -> dict[str, bool]:
    """The simulated cluster's ``method`` raises ``error`` (what the Kubernetes adapter raises: a
    403, a 503) while the switch it returns is on (``switch["on"] = False``: it answers again)."""
    switch = {"on": True}
    real = getattr(SimCluster, method)

    def refusing(self, *args, **kwargs):
        if switch["on"]:
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SimCluster, method, refusing)
    return switch


async def failed_pass(handle: WorkflowHandle) -> str:
    """An entity's current details once they say a pass of its loop failed ("could not ...",
    ``workflows.passes.FailedPasses``), or how its run ended if it did; else "" (for ``poll``)."""
    from temporalio.client import WorkflowExecutionStatus

    described = await handle.describe()
    if described.status != WorkflowExecutionStatus.RUNNING:
        return f"the run ended {described.status.name}"
    metadata = await handle.query("__temporal_workflow_metadata")
    text = metadata.current_details if hasattr(metadata, "current_details") else metadata["currentDetails"]
    return text if "could not" in text else ""


async def activity_inputs(handle: WorkflowHandle, activity_type: str) -> list[dict]:
    """The inputs of every ``activity_type`` the workflow scheduled, in order."""
    history = await handle.fetch_history()
    out = []
    for e in history.events:
        if e.HasField("activity_task_scheduled_event_attributes"):
            attrs = e.activity_task_scheduled_event_attributes
            if attrs.activity_type.name == activity_type:
                out.append(json.loads(attrs.input.payloads[0].data))
    return out


async def cancel_seen(handle: WorkflowHandle) -> bool:
    """The run has taken its cancel request: a workflow task completed after it."""
    kinds = [e.event_type async for e in handle.fetch_history_events()]
    requested = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED
    return requested in kinds and EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED in kinds[kinds.index(requested):]
