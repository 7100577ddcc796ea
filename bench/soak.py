"""A seeded chaos soak: a mixed workload on the simulated fleet while the
control-plane worker is SIGKILLed and the dev server restarted, then five
invariants, each of which must be zero.

The stack is the one ``gpufleet dev`` runs, started with cli/dev.py's own helpers,
as child processes this soak owns: the object stores' S3 emulator (moto's
server) with the demo model seeded into ``demo-weights``, a Temporal dev server
with SQLite persistence (``--db-filename``, so a restart keeps every workflow),
``python -m workers.control_plane``, the node gateway, and the simulated nodes'
host ``python -m workers.node_agent --sim``, whose agents reach Temporal only
through that gateway (one certificate each). For the first 60% of the run it
injects, at moments drawn from ``--seed``: NodeJoins, AcquireCapacity requests,
GPU faults (a reset-class XID 48 or a reboot-class XID 79, one per machine), one
provider incident (a site's machines stop dialing home until it is drained), one
ModelRollout of the demo model (deploy/rollout.demo.yaml, retargeted at two soak
sites, started as ``gpufleet rollout start`` does), worker SIGKILLs and
dev-server restarts. Then it stops injecting, lets the fleet quiesce for the rest
of the run, and checks:

- ``task-failure loops``: open workflows whose last workflow-task outcome is
  ``WorkflowTaskFailed`` (the workflow stays Running and nobody is told);
- ``joins without exactly one machine``: completed NodeJoins whose node name
  was given to a machine other than exactly once at the simulated provider;
- ``orphaned machines``: live machines with no node and no open join, after one
  ``FleetSweep`` when the registry has it;
- ``duplicate disruptive actions``: per injected fault, the same effective
  reboot/reinstall/delete/GPU reset on its machine more than once (counted at
  the simulated provider, ``SimWorld.actions``);
- ``workflows not waiting``: open workflows that are neither waiting on a
  timer, signal, child or activity: a workflow task outstanding after the
  quiesce, or an activity failing attempt after attempt (one whose current attempt
  heartbeats on time is waiting: a long watch loses an attempt to each restart).

The rollout's outcome is shown with the stats, not counted: a gate that fails
because faults took the canary site's GPUs is the rollout doing its job.

    python -m bench.soak [--minutes 10] [--seed 1] [--state-dir DIR]

Exits 1 if any invariant is not zero. ``tests/test_soak.py`` runs it for 1.5 minutes.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Awaitable, Callable, Optional

import typer
import yaml
from temporalio.api.enums.v1 import EventType, PendingActivityState
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.common import WorkflowIDConflictPolicy

from bench.common import command_line, bench_args, usage_error
from cli.dev import (
    DEMO_STORE,
    DEV_S3_KEY,
    dev_server_tuning_flags,
    loopback_stores,
    node_gateway_command,
    node_gateway_env,
    object_store_command,
    seed_loopback_stores,
    temporal_binary,
    wait_for_port,
)
from client.fleet import FleetClient
from fleet import search_attributes
from fleet.config import load_config
from fleet.naming import node_name_for
from fleet.settings import NodeAgentEnv, Settings
from fleet.temporal import connect
from fleet.contracts import workflows as flows
from fleet.naming import site_workflow_id

INVARIANTS = (
    "task-failure loops",
    "joins without exactly one machine",
    "orphaned machines after one sweep",
    "duplicate disruptive actions",
    "workflows not waiting",
)

#: Activity timeouts short enough for a run of minutes: a worker killed mid-activity
#: is noticed within a heartbeat, and nothing waits the production defaults (10-15 min).
JOIN_TIMEOUTS = {"provision_seconds": 20, "registration_seconds": 30, "smoke_test_seconds": 15,
                 "heartbeat_seconds": 3}

#: The site whose provider goes away once; faults and capacity requests stay off it.
INCIDENT_SITE = "soak-d"
#: The soak's own run of the fleet's orphan sweep (the Schedule's runs are ``fleet-sweep``).
SOAK_SWEEP_ID = "fleet-sweep/soak"
FAULT_SITES = ("soak-a", "soak-b", "soak-c")
#: The demo model's rollout targets (canary first); faults land here too.
ROLLOUT_SITES = ("soak-a", "soak-b")
#: ``gpufleet rollout start deploy/rollout.demo.yaml``, as the README walks it on the dev stack.
DEMO_ROLLOUT = Path(__file__).resolve().parents[1] / "deploy" / "rollout.demo.yaml"
#: The finite workflow types the quiesce waits for (entities run for ever, by design).
FINITE = ("NodeJoin", "AcquireCapacity", "GpuRepair", "SiteEvacuation", "SpotReclaim", "ModelRollout",
          "SiteSweep", "CatalogRefresh", "FleetSweep")


def soak_fleet(capacity: int, s3_port: int) -> dict:
    """Four simulated sites over two accounts; only the incident site may trip an incident
    (faults elsewhere are repaired one by one, however many land in a window). Object stores
    as in the built-in fleet: ``demo-weights`` and one bucket per site, on the S3 emulator."""
    store = {"endpoint_url": f"http://127.0.0.1:{s3_port}", "addressing_style": "path",
             "credentials": {"env": DEV_S3_KEY[0]}}
    accounts = [{"name": "soak-lambda", "provider": "lambda", "credentials": {"env": "SOAK_LAMBDA_KEY"}},
                {"name": "soak-nebius", "provider": "nebius", "credentials": {"env": "SOAK_NEBIUS_KEY"}}]
    sites = []
    for i, name in enumerate(("soak-a", "soak-b", "soak-c", INCIDENT_SITE)):
        lam = i % 2 == 0
        site = {"name": name, "provider": "lambda" if lam else "nebius", "account": "soak-lambda" if lam else "soak-nebius",
                "region": "r", "geography": "us-east", "gpu": "H100", "gpu_memory_gb": 80, "gpus_per_machine": 2,
                "instance_type": "gpu_2x_h100", "price_per_gpu_hour": 2.0 + i / 10, "max_nodes": capacity,
                "sim": {"capacity": capacity, "quota": capacity, "api_latency_ms": 5, "boot_seconds": 0.3},
                "object_store": {**store, "bucket": f"site-{name}"}}
        if name == INCIDENT_SITE:
            site["incident"] = {"enabled": True, "min_nodes": 3, "fraction": 0.5, "window_seconds": 60,
                                "settle_seconds": 1, "check_seconds": 2, "probe_seconds": 2, "bake_seconds": 1,
                                "ready_seconds": 20, "drain_seconds": 2, "capacity_deadline_seconds": 30,
                                "smoke_test_seconds": 15, "api_failure_seconds": 60}
        sites.append(site)
    return {
        "mode": "sim", "accounts": accounts, "sites": sites,
        "object_stores": {DEMO_STORE: {**store, "bucket": DEMO_STORE}},
        "incident": {"enabled": False},
        "repair": {
            "timeouts": {"contain_seconds": 20, "drain_seconds": 2, "reset_seconds": 15, "reboot_seconds": 20,
                         "reinstall_seconds": 20, "replace_seconds": 60, "smoke_test_seconds": 15,
                         "heartbeat_seconds": 3, "provider_call_seconds": 15},
            "recheck_seconds": 3,
        },
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """The S3 emulator, the dev server, the control-plane worker, the node gateway and the
    node host, as under ``gpufleet dev``."""

    def __init__(self, settings: Settings, port: int, http_port: int, gateway_port: int, log) -> None:
        self.settings = settings
        self.port = port
        self.http_port = http_port
        self.gateway_port = gateway_port
        self.log = log
        self.config = load_config(settings.config)
        self.s3 = loopback_stores(self.config)
        self.env = {k: v for k, v in os.environ.items()
                    if not (k == "TEMPORAL_API_KEY" or k.startswith(("TEMPORAL_TLS", "TEMPORAL_PROFILE",
                                                                     "TEMPORAL_CONFIG_FILE")))}
        self.env.update(settings.env())
        self.env[NodeAgentEnv.variable("health_seconds")] = "1"
        self.env.setdefault(*DEV_S3_KEY)
        # This process seeds the stores and starts the rollout (its client reads the config).
        os.environ.setdefault(DEV_S3_KEY[0], self.env[DEV_S3_KEY[0]])
        self.logs = settings.state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        #: Exits nobody asked for (a worker that dies when the server goes away, say).
        self.unexpected_exits: Counter[str] = Counter()

    def _spawn(self, name: str, command: list[str]) -> None:
        out = open(self.logs / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        out.close()

    def start_server(self) -> None:
        db = self.settings.state_dir / "temporal.db"
        command = [temporal_binary(), "server", "start-dev", "--db-filename", str(db), "--ip", "127.0.0.1",
                   "--port", str(self.port), "--http-port", str(self.http_port), "--headless",
                   "--namespace", self.settings.namespace, "--log-level", "error", *dev_server_tuning_flags()]
        if not db.exists():
            command += search_attributes.dev_server_flags()
        self._spawn("server", command)

    def start_object_stores(self) -> None:
        for port in self.s3:
            self._spawn(f"s3-{port}", object_store_command(port))

    def seed_object_stores(self) -> None:
        seed_loopback_stores(self.config, self.s3)

    def _restart_object_stores(self) -> None:
        # The emulator keeps its buckets in memory: a new one is seeded again.
        for port in self.s3:
            self.stop(f"s3-{port}")
        self.start_object_stores()
        self.seed_object_stores()

    def start_worker(self) -> None:
        self._spawn("control-plane", [sys.executable, "-m", "workers.control_plane"])

    def start_gateway(self) -> None:
        self._spawn("node-gateway", node_gateway_command(self.gateway_port))
        wait_for_port(self.gateway_port)

    def start_nodes(self) -> None:
        self.env.update(node_gateway_env(self.settings.state_dir, self.gateway_port))
        self._spawn("node-agents", [sys.executable, "-m", "workers.node_agent", "--sim", "--poll-seconds", "0.1"])

    def stop(self, name: str, sig: int = signal.SIGTERM, wait: float = 20) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def revive(self) -> None:
        """Restart a child that exited by itself (and count it)."""
        for name, start in (("server", self.start_server), ("control-plane", self.start_worker),
                            ("node-gateway", self.start_gateway), ("node-agents", self.start_nodes),
                            *((f"s3-{port}", self._restart_object_stores) for port in self.s3)):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                self.unexpected_exits[name] += 1
                self.log(f"  ! {name} exited by itself ({proc.returncode}); restarting")
                del self.procs[name]
                start()

    def stop_all(self) -> None:
        for name in ("node-agents", "node-gateway", "control-plane", "server", *(f"s3-{p}" for p in self.s3)):
            self.stop(name)


async def retrying(what: str, call: Callable[[], Awaitable[Any]], timeout: float = 60) -> Any:
    """A client call that rides out a dev-server restart."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except Exception as error:  # noqa: BLE001 - the server is restarting; anything else shows at the deadline
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: {error}") from error
            await asyncio.sleep(0.5)


@dataclass
class Fault:
    machine_id: str
    node_name: str
    gpu: int
    xid: int
    at: float


@dataclass
class SoakResult:
    invariants: dict[str, int]
    stats: dict[str, Any] = field(default_factory=dict)
    details: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(v == 0 for v in self.invariants.values())

    def report(self) -> str:
        lines = ["workload and chaos:"]
        lines += [f"  {k:44s} {v}" for k, v in self.stats.items()]
        lines.append("invariants (each must be 0):")
        lines += [f"  {k:44s} {v}" for k, v in self.invariants.items()]
        for name, items in self.details.items():
            if items:
                lines.append(f"{name}:")
                lines += [f"  - {item}" for item in items[:20]]
                if len(items) > 20:
                    lines.append(f"  ... and {len(items) - 20} more")
        return "\n".join(lines)


class Soak:
    def __init__(self, minutes: float, seed: int, state_dir: Path, log=print) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.total = minutes * 60
        self.chaos = self.total * 0.6
        self.log = log
        self.state_dir = state_dir
        self.capacity = 64
        config = state_dir / "sites.yaml"
        config.write_text(yaml.safe_dump(soak_fleet(self.capacity, _free_port())))
        self.settings = Settings(address="", state_dir=state_dir, config=str(config), task_queue="gpufleet")
        port = _free_port()
        self.settings = self.settings.model_copy(update={"address": f"127.0.0.1:{port}"})
        self.procs = Processes(self.settings, port, _free_port(), _free_port(), log)
        self.client: Client | None = None
        self.faults: list[Fault] = []
        self.stats: Counter[str] = Counter()
        self.seq = 0
        self.t0 = 0.0
        self.rollout_id = ""

    # -- world ---------------------------------------------------------------------------------
    @property
    def world(self):
        from sim.world import SimWorld

        return SimWorld(self.settings.sim_db)

    def _ready_nodes(self, sites: tuple[str, ...]) -> list[Any]:
        rows = self.world.query(
            "SELECT n.name, n.machine_id, m.site, m.gpus FROM nodes n JOIN machines m ON m.id = n.machine_id"
            " WHERE m.deleted_at IS NULL AND n.ready = 1 AND n.unschedulable = 0 AND n.taints NOT LIKE '%unproven%'")
        return [r for r in rows if r["site"] in sites]

    # -- client ----------------------------------------------------------------------------------
    async def _connect(self) -> None:
        async def attempt() -> Client:
            client = await connect(self.settings)
            await search_attributes.ensure_registered(client)
            return client

        self.client = await retrying("connect", attempt, timeout=90)

    async def _start(self, workflow: str, arg: dict, workflow_id: str) -> None:
        await retrying(f"start {workflow_id}", lambda: self.client.start_workflow(
            workflow, arg, id=workflow_id, task_queue=self.settings.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING))

    # -- workload ----------------------------------------------------------------------------------
    async def join(self, site: str) -> None:
        self.seq += 1
        await self._start(flows.NodeJoin.TYPE, {"site": site, "timeouts": JOIN_TIMEOUTS}, f"join/{site}/soak-{self.seq}")
        self.stats["joins started"] += 1

    async def capacity_request(self) -> None:
        self.seq += 1
        request = {"constraints": {"sites": list(FAULT_SITES)}, "count": self.rng.randint(1, 2),
                   "deadline_seconds": 60, "backoff_seconds": 2, "max_backoff_seconds": 5, "concurrency": 2,
                   "join_timeouts": JOIN_TIMEOUTS}
        await self._start(flows.AcquireCapacity.TYPE, request, f"capacity/soak-{self.seq}")
        self.stats["capacity requests"] += 1

    async def gpu_fault(self) -> None:
        faulted = {f.machine_id for f in self.faults}
        nodes = [n for n in await asyncio.to_thread(self._ready_nodes, FAULT_SITES) if n["machine_id"] not in faulted]
        if not nodes:
            self.stats["faults skipped (no ready node)"] += 1
            return
        node = self.rng.choice(nodes)
        gpu = self.rng.randrange(node["gpus"])
        xid, clears_on = self.rng.choice([(48, "reset"), (79, "reboot")])
        await asyncio.to_thread(self.world.inject_fault, node["machine_id"], gpu, "xid", xid, clears_on)
        self.faults.append(Fault(node["machine_id"], node["name"], gpu, xid, time.time()))
        self.stats["GPU faults injected"] += 1

    async def incident(self, until: float) -> None:
        """The incident site's machines stop dialing home until its evacuation drained it
        (or ``until``), then it heals."""
        world = self.world
        await asyncio.to_thread(world.set_site, INCIDENT_SITE, unreachable=1)
        self.stats["provider incidents"] += 1
        self.log(f"  {self._t()} incident at {INCIDENT_SITE}")
        try:
            while time.monotonic() < until:
                try:
                    status = await self.client.get_workflow_handle(site_workflow_id(INCIDENT_SITE)).query(flows.Site.status)
                    incident = (status or {}).get("incident") or {}
                    evacuation = (incident.get("open") or {}).get("id") or ""
                    if evacuation:
                        progress = await self.client.get_workflow_handle(evacuation).query(flows.SiteEvacuation.progress)
                        if any(step.get("name") == "drained" for step in (progress or {}).get("timeline", [])):
                            self.stats["incident drained before heal"] += 1
                            break
                except Exception:  # noqa: BLE001 - server restarting, or no evacuation yet
                    pass
                await asyncio.sleep(1)
        finally:
            await asyncio.to_thread(world.set_site, INCIDENT_SITE, unreachable=0)
            self.log(f"  {self._t()} {INCIDENT_SITE} healed")

    async def rollout(self) -> None:
        """The demo model, as ``gpufleet rollout start deploy/rollout.demo.yaml`` starts it (the
        operator's client), onto the soak's sites, with a gate sized for a run of minutes."""
        manifest = yaml.safe_load(DEMO_ROLLOUT.read_text())
        manifest["sites"] = [{"site": site, "replicas": 1} for site in ROLLOUT_SITES]
        manifest["strategy"]["gate"].update(ready_timeout_seconds=30, probe_timeout_seconds=10)
        manifest["replication"] = {"heartbeat_seconds": 3}
        fleet = FleetClient(self.settings, temporal=self.client)
        handle = await retrying("start rollout", lambda: fleet.start_rollout(manifest))
        self.rollout_id = handle.id
        self.stats["rollouts started"] += 1
        self.log(f"  {self._t()} rollout {handle.id} to {', '.join(ROLLOUT_SITES)}")

    async def kill_worker(self) -> None:
        self.procs.stop("control-plane", signal.SIGKILL)
        self.stats["worker SIGKILLs"] += 1
        self.log(f"  {self._t()} SIGKILL control-plane worker")
        await asyncio.sleep(self.rng.uniform(0.2, 2.0))
        self.procs.start_worker()

    async def restart_server(self) -> None:
        self.log(f"  {self._t()} restart dev server")
        await asyncio.to_thread(self.procs.stop, "server")
        self.procs.start_server()
        self.stats["dev-server restarts"] += 1

    def _t(self) -> str:
        return f"[{time.monotonic() - self.t0:6.1f}s]"

    def plan(self) -> list[tuple[float, str]]:
        """Seeded moments for every injected event inside the chaos window."""
        T = self.chaos
        events = [(self.rng.uniform(0.05, 0.8) * T, "join") for _ in range(max(4, int(T / 8)))]
        events += [(self.rng.uniform(0.05, 0.7) * T, "capacity") for _ in range(max(2, int(T / 25)))]
        events += [(self.rng.uniform(0.2, 0.9) * T, "fault") for _ in range(max(3, int(T / 10)))]
        events += [(self.rng.uniform(0.05, 0.95) * T, "kill-worker") for _ in range(max(2, int(T / 20)))]
        events += [(self.rng.uniform(0.15, 0.85) * T, "restart-server") for _ in range(max(1, int(T / 45)))]
        events.append((self.rng.uniform(0.15, 0.3) * T, "incident"))
        events.append((self.rng.uniform(0.2, 0.5) * T, "rollout"))
        return sorted(events)

    async def run(self) -> SoakResult:
        self.t0 = time.monotonic()
        procs = self.procs
        try:
            procs.start_object_stores()
            await asyncio.to_thread(procs.seed_object_stores)
            procs.start_server()
            await self._connect()
            procs.start_worker()
            procs.start_gateway()
            procs.start_nodes()
            from fleet.schedules import apply_schedules

            await retrying("schedules", lambda: apply_schedules(self.client, self.settings.task_queue,
                                                                site_every=15, catalog_every=30))
            # The Site entities watch their sites from the start (the sweep would start them too).
            for site in (*FAULT_SITES, INCIDENT_SITE):
                await self._start(flows.Site.TYPE, {"site": site}, f"site/{site}")
            # A fleet to break: enough nodes at the incident site to trip its rule.
            for _ in range(3):
                await self.join(INCIDENT_SITE)
            for site in FAULT_SITES:
                await self.join(site)
            self.log(f"  {self._t()} stack up; chaos for {self.chaos:.0f}s (seed {self.seed})")
            await self._chaos()
            self.log(f"  {self._t()} injecting stopped; quiescing")
            await self._quiesce(deadline=self.t0 + self.total)
            self.log(f"  {self._t()} checking")
            result = await self._check()
            result.stats = {**dict(self.stats), **{f"unexpected exits: {k}": v
                                                    for k, v in procs.unexpected_exits.items()}, **result.stats}
            return result
        finally:
            procs.stop_all()

    async def _chaos(self) -> None:
        start = time.monotonic()
        background: list[asyncio.Task] = []
        for at, kind in self.plan():
            while time.monotonic() - start < at:
                self.procs.revive()
                await asyncio.sleep(min(0.25, max(0.0, at - (time.monotonic() - start))))
            try:
                if kind == "join":
                    await self.join(self.rng.choice(FAULT_SITES))
                elif kind == "capacity":
                    await self.capacity_request()
                elif kind == "fault":
                    await self.gpu_fault()
                elif kind == "kill-worker":
                    background.append(asyncio.create_task(self.kill_worker()))
                elif kind == "restart-server":
                    await self.restart_server()
                elif kind == "incident":
                    background.append(asyncio.create_task(self.incident(until=start + self.chaos)))
                elif kind == "rollout":
                    await self.rollout()
            except RuntimeError as error:
                self.stats["injections that failed"] += 1
                self.log(f"  ! {kind}: {error}")
        while time.monotonic() - start < self.chaos:
            self.procs.revive()
            await asyncio.sleep(0.25)
        await asyncio.gather(*background)
        self.procs.revive()

    async def _open(self) -> list[Any]:
        async def listing() -> list[Any]:
            return [w async for w in self.client.list_workflows("ExecutionStatus='Running'")]

        return await retrying("list open workflows", listing)

    def _unrepaired(self) -> list[Fault]:
        """Injected faults still on a live machine."""
        world = self.world
        live = {m["id"] for m in world.machines()}
        left = {(r["machine_id"], r["idx"]) for r in world.query("SELECT machine_id, idx FROM gpu_faults")}
        return [f for f in self.faults if f.machine_id in live and (f.machine_id, f.gpu) in left]

    async def _quiesce(self, deadline: float) -> None:
        """Until no finite workflow is open (entities stay open by design) and every fault is
        repaired, or the run's end."""
        while time.monotonic() < deadline:
            self.procs.revive()
            open_finite = [w for w in await self._open() if w.workflow_type in FINITE]
            if not open_finite and not await asyncio.to_thread(self._unrepaired):
                self.stats["quiesced after (s)"] = round(time.monotonic() - self.t0 - self.chaos)
                return
            await asyncio.sleep(1)
        self.stats["finite workflows still open at the end"] = len(
            [w for w in await self._open() if w.workflow_type in FINITE])

    # -- the invariants ------------------------------------------------------------------------------
    async def _check(self) -> SoakResult:
        details: dict[str, list[str]] = {name: [] for name in INVARIANTS}
        stats: dict[str, Any] = {}
        client = self.client

        sweep = await self._sweep_once()
        stats["FleetSweep"] = sweep

        every = await retrying("list workflows", lambda: _collect(client.list_workflows("")))
        by_status = Counter(f"{w.workflow_type} {w.status.name.lower()}" for w in every)
        stats["workflows"] = ", ".join(f"{k}: {v}" for k, v in sorted(by_status.items()))
        stats["rollout"] = await self._rollout_outcome(every)

        now = time.time()
        task_failures_seen = 0
        # Who ran each activity on a node's own queue: through the gateway it is ``node:<name>``.
        node_activities: Counter[str] = Counter()
        recovered = 0
        for w in [w for w in every if w.status == WorkflowExecutionStatus.RUNNING]:
            handle = client.get_workflow_handle(w.id, run_id=w.run_id)
            history = await retrying(f"history {w.id}", handle.fetch_history)
            events = list(history.events)
            outcome, outstanding_since = None, None
            node_queue: set[int] = set()
            for event in events:
                t = event.event_type
                if t == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                    if event.activity_task_scheduled_event_attributes.task_queue.name.startswith("node/"):
                        node_queue.add(event.event_id)
                elif t == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                    started = event.activity_task_started_event_attributes
                    if started.scheduled_event_id in node_queue:
                        node_activities["via gateway" if started.identity.startswith("node:") else "direct"] += 1
                if t == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                    task_failures_seen += 1
                if t in (EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED, EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED,
                         EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT):
                    outcome = t
                if t == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED and outstanding_since is None:
                    outstanding_since = event.event_time.ToDatetime().timestamp()
                elif t == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                    outstanding_since = None
            if outcome == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                failed = next(e for e in reversed(events) if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)
                cause = failed.workflow_task_failed_event_attributes.failure.message
                details["task-failure loops"].append(f"{w.id} ({w.workflow_type}): {cause[:200]}")
                continue
            if outstanding_since is not None and now - outstanding_since > 15:
                details["workflows not waiting"].append(
                    f"{w.id} ({w.workflow_type}): a workflow task outstanding for {now - outstanding_since:.0f}s")
                continue
            described = await retrying(f"describe {w.id}", handle.describe)
            for pending in described.raw_description.pending_activities:
                if pending.attempt >= 4 and pending.HasField("last_failure"):
                    if _heartbeating(pending, time.time()):
                        recovered += 1
                        continue
                    details["workflows not waiting"].append(
                        f"{w.id} ({w.workflow_type}): activity {pending.activity_type.name} failing, attempt "
                        f"{pending.attempt}: {pending.last_failure.message[:160]}")
        stats["WorkflowTaskFailed events in open workflows"] = task_failures_seen
        stats["activities heartbeating after >=3 failures"] = recovered
        stats["node-queue activities via the gateway"] = node_activities["via gateway"]
        stats["node-queue activities not via the gateway"] = node_activities["direct"]

        world = self.world
        machines = world.query("SELECT * FROM machines")
        by_name = Counter(m["name"] for m in machines)
        joined = 0
        for w in every:
            if w.workflow_type != "NodeJoin" or w.status != WorkflowExecutionStatus.COMPLETED:
                continue
            result = await retrying(f"result {w.id}", client.get_workflow_handle(w.id, run_id=w.run_id).result)
            for node in (result or {}).get("nodes", []):
                # A join names its node from its id and its first run id (joins never continue as new).
                if node["node_name"] not in (node_name_for(node["site"], w.id, w.run_id),
                                             node_name_for(node["site"], w.id)):
                    continue  # a fan-out parent: its children are counted themselves
                joined += 1
                if by_name[node["node_name"]] != 1:
                    details["joins without exactly one machine"].append(
                        f"{w.id}: {by_name[node['node_name']]} machines named {node['node_name']}")
        stats["successful joins"] = joined

        open_joins = {w.id for w in every if w.workflow_type == "NodeJoin" and w.status == WorkflowExecutionStatus.RUNNING}
        nodes = {r["machine_id"] for r in world.query("SELECT machine_id FROM nodes")}
        for m in machines:
            if m["deleted_at"] is None and m["id"] not in nodes and m["idempotency_key"] not in open_joins:
                details["orphaned machines after one sweep"].append(
                    f"{m['id']} ({m['name']} at {m['site']}, join {m['idempotency_key']}): live, no node, no open join")
        stats["live machines"] = sum(1 for m in machines if m["deleted_at"] is None)

        faulted = set()
        for fault in self.faults:
            faulted.add(fault.machine_id)
            seen = Counter((a["op"], a["gpu"]) for a in world.actions(fault.machine_id) if a["at"] >= fault.at)
            for (op, gpu), n in seen.items():
                if n > 1:
                    what = f"{op} gpu{gpu}" if gpu is not None else op
                    details["duplicate disruptive actions"].append(
                        f"{fault.node_name} XID {fault.xid} on gpu{fault.gpu}: {what} x{n}")
        actions = world.actions()
        stats["disruptive actions (all)"] = ", ".join(f"{k}: {v}" for k, v in sorted(Counter(a["op"] for a in actions).items()))
        # Not one of the five: a fault injected late may still be on its way up the ladder.
        unrepaired = self._unrepaired()
        stats["GPU faults not repaired by the end"] = len(unrepaired)
        details["not repaired by the end (not an invariant)"] = [
            f"{f.node_name} gpu{f.gpu} XID {f.xid}, injected {time.time() - f.at:.0f}s before the check"
            for f in unrepaired]

        invariants = {name: len(details[name]) for name in INVARIANTS}
        return SoakResult(invariants=invariants, stats=stats, details=details)

    async def _rollout_outcome(self, every: list[Any]) -> str:
        run = next((w for w in every if w.id == self.rollout_id), None)
        if run is None:
            return "not started"
        if run.status == WorkflowExecutionStatus.FAILED:
            # A canary gate that failed under the faults: the rollout ended, rolled back.
            handle = self.client.get_workflow_handle(run.id, run_id=run.run_id)
            try:
                await handle.result()
            except WorkflowFailureError as error:
                return f"{run.id}: failed: {error.cause}"
        if run.status != WorkflowExecutionStatus.COMPLETED:
            return f"{run.status.name.lower()} (not ended)"
        result = await retrying("rollout result", self.client.get_workflow_handle(run.id, run_id=run.run_id).result)
        return f"{run.id}: {result['outcome']}"

    async def _sweep_once(self) -> str:
        """Run the fleet's own orphan sweep once, where the registry has one."""
        from workflows.registry import ALL_WORKFLOWS

        names = {getattr(w, "__temporal_workflow_definition").name for w in ALL_WORKFLOWS}
        if flows.FleetSweep.TYPE not in names:
            return "not in the registry yet: orphans compared here (machines vs nodes and open joins)"
        # Grace 0: after the quiesce, anything unaccounted for is an orphan.
        await self._start(flows.FleetSweep.TYPE, {"grace_seconds": 0}, SOAK_SWEEP_ID)
        try:
            result = await asyncio.wait_for(self.client.get_workflow_handle(SOAK_SWEEP_ID).result(), 60)
        except Exception as error:  # noqa: BLE001 - shown; a sweep stuck in a task-failure loop counts below
            return f"did not finish: {type(error).__name__}: {error}"
        return json.dumps(result, default=str)[:300]


def _heartbeating(pending, now: float) -> bool:
    """A started attempt that heartbeats on time is waiting, whatever its earlier attempts met:
    a long watch (a Node's, 5 minutes) loses one attempt to every dev-server restart."""
    if pending.state != PendingActivityState.PENDING_ACTIVITY_STATE_STARTED:
        return False
    timeout = pending.activity_options.heartbeat_timeout.ToTimedelta().total_seconds()
    started = pending.last_started_time.ToDatetime().timestamp()
    beat = pending.last_heartbeat_time.ToDatetime().timestamp()
    return timeout > 0 and beat >= started and now - beat < max(2 * timeout, 5)


async def _collect(iterator) -> list[Any]:
    return [item async for item in iterator]


async def run_soak(minutes: float = 10, seed: int = 1, state_dir: Path | None = None, log=print) -> SoakResult:
    if state_dir is None:
        with tempfile.TemporaryDirectory(prefix="gpufleet-soak-") as tmp:
            return await Soak(minutes, seed, Path(tmp), log).run()
    state_dir.mkdir(parents=True, exist_ok=True)
    return await Soak(minutes, seed, state_dir.resolve(), log).run()


def main(
    minutes: Annotated[float, typer.Option(help="the whole run: 60% chaos, then quiesce and check")] = 10,
    seed: Annotated[int, typer.Option()] = 1,
    state_dir: Annotated[Optional[Path], typer.Option(
        help="keep the run's state and logs here (default: a temp dir)")] = None,
) -> None:
    args = bench_args(locals())
    if args.minutes <= 0:
        usage_error("--minutes must be positive")
    print(f"chaos soak: {args.minutes:g} minutes, seed {args.seed}", flush=True)
    # SIGTERM (a CI timeout) unwinds like Ctrl-C, so the stack's processes are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result = asyncio.run(run_soak(args.minutes, args.seed, args.state_dir, log=lambda m: print(m, flush=True)))
    print(result.report())
    print("all invariants hold" if result.ok else "INVARIANT VIOLATED")
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    command_line(main, __doc__)
