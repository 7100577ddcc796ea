"""The fleet at size (issue 22): one run grows the simulated fleet through ``--steps`` sizes
and measures each, printing every figure as a ratio to the smallest.

Processes, as under ``gpufleet dev``: the dev server (WorkflowEnvironment's child), the
control-plane worker (``python -m workers.control_plane``), the node gateway
(``python -m workers.node_gateway``) and the simulated node host (``python -m
workers.node_agent --sim``), whose agents reach Temporal only through the gateway, each with
its own key and certificate, each polling only its own ``node/<name>`` queue; and the
product's Schedules, as ``gpufleet dev`` applies them (the site reconcile's first pass starts
every Site entity before the first join). Each process is its own, so CPU seconds and
resident memory are read from /proc for each alone. The node host runs at ``--nodes-nice``
(10, as ``gpufleet dev`` runs it). This process only starts joins, injects
faults, posts reclaim notices, asks for capacity and watches the sim's cluster.

At each size:

1. join: NodeJoins (spread round-robin over the sites, at most ``--join-concurrency``
   in flight) bring the fleet from the previous size to this one; nodes admitted per
   minute over that window. A join that fails is counted (no fault is injected while
   joining, so any failure is a finding).
2. steady, for ``--minutes`` (``--largest-minutes`` at the largest size: by default long
   enough for 105 faults, since a p99 of fewer than 100 values is the slowest one; the
   targets are read there), five things at once:
   - one seeded fault every ``--fault-interval`` s into a random healthy node's simulated
     GPU (XID 48; cleared by reset / reboot / never, i.e. replace). The clock starts
     before the fault is written into the sim world and stops when this process sees the
     node cordoned (one look at every pending fault's node each 10 ms): detection is
     included. In the sim, the node host sees the world change (its poll, 50 ms here) and
     wakes that machine's watch, as a real node's XID waiter wakes its own; the Node
     entity's ``watch_node`` returns the new state. Beside it, the time the cordon was
     written by (the fence's local activity done, by the worker's clock);
   - one spot reclaim notice every ``--reclaim-interval`` s on another healthy node
     (``--reclaim-notice`` s of warning), timed from the notice to the end of its
     ``reclaim/<node>`` (drained, replacement joined);
   - one capacity request (``AcquireCapacity``, ``--capacity-count`` H100 nodes) started
     with the window, timed to its result;
   - health traffic: ``--health-per-minute`` application XIDs (XID 13: counted, never
     repaired) into random GPUs of nodes nothing else touches, each one a change the
     node's watch returns to its Node entity; delivery is checked on a sample of nodes
     (the entity's count of XID 13 against what was injected there);
   - one provider incident, a third of the way in, at a site of its own (``incident-<k>``,
     3 nodes serving a model, its incident rule on; its twin ``refuge-<k>`` serves the same
     model on one node): two nodes' GPUs fail, and once the Site entity holds both, a third
     fails; the clock runs from that third fault (detection included) to the site's
     routing weight 0.
3. costs over the steady window: CPU seconds of worker, gateway and dev server, resident
   memory of every process; the largest history (describe) of any running Node, Site,
   ProviderAccount or SiteEvacuation; workflow-task schedule-to-start on the control-plane
   queue, from the histories of the GpuRepairs the step started.

The incident rule is off at the ten main sites (seeded faults close together would read as
an incident there) and on at each drill's own site. Health is pulled, never pushed: the
"reports" are watch results, one per change of a node's state.

    python -m bench.scale [--nodes 1250] [--sites 10] [--gpus-per-node 8] [--minutes 1]
                          [--largest-minutes 3.5] [--nodes-nice 10] [--steps 125,250,625,1250] [--fault-interval 2] [--reclaim-interval 15]
                          [--health-per-minute 1000] [--seed 22]
    python -m bench.scale --smoke   # 2 then 4 nodes, seconds (the suite runs this)
                          [--address HOST:PORT [--namespace NS] [--task-queue Q] [--server-pids PID,...]]

``--address``: an existing Temporal cluster instead of a dev server of its own (its namespace
needs gpufleet's search attributes; missing ones are added). Its processes' CPU and memory are
read only where they run on this machine and are named with ``--server-pids`` (each pid and its
children, e.g. PostgreSQL's backends; ``python -m tests.realtemporal.cluster`` prints them).
It runs gpufleet's Schedules under their fixed ids, so it refuses a namespace that already has
any (a fleet runs there: give it a namespace of its own, ``--namespace``); when it ends it deletes
them and terminates every workflow still running on its task queue.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml
from temporalio.service import RPCError

from activities.env import FleetEnv
from bench.common import (bench_env, command_line, fleet, bench_args, run, pct, proc_cpu, rss_mb, server_pid, until,
                          usage_error)
from fleet.settings import Settings
from cli.dev import wait_for_port
from workers.gc_tuning import SLOW_COLLECTION_SECONDS, settle_garbage_collection
from workers.node_agent import SIM_HOST_NICE
from workers.gateway.pki import dev_gateway_files
from fleet import search_attributes as sa
from fleet.naming import join_workflow_id
from fleet.schedules import SCHEDULES, apply_schedules
from fleet.contracts import workflows as flows
from fleet.naming import node_workflow_id, reclaim_workflow_id, site_workflow_id

ENTITY_TYPES = (flows.Node.TYPE, flows.Site.TYPE, flows.ProviderAccount.TYPE, flows.SiteEvacuation.TYPE)
#: What a seeded fault needs to clear: most resets, some reboots, a few replacements.
FAULT_MIX = (("reset", 0.7), ("reboot", 0.2), ("never", 0.1))




@asynccontextmanager
async def existing_cluster_env(fleet_config: dict, address: str, namespace: str, task_queue: str):
    """``bench_env``'s pair for a cluster that is already running: a client (no server to stop)."""
    from temporalio.client import Client
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.testing import WorkflowEnvironment

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sites.yaml"
        path.write_text(yaml.safe_dump(fleet_config))
        client = await Client.connect(address, namespace=namespace, data_converter=pydantic_data_converter)
        taken = await existing_schedules(client)
        if taken:
            raise SystemExit(f"--namespace {namespace}: it has gpufleet's Schedules already ({', '.join(taken)}), so a "
                             "fleet runs there and the benchmark would take them over: give it a namespace of its own "
                             "(or, if an earlier benchmark was killed there, delete them: `temporal schedule delete`)")
        await sa.ensure_registered(client)
        try:
            yield WorkflowEnvironment.from_client(client), Settings(
                address=address, namespace=namespace, state_dir=Path(tmp), config=str(path), task_queue=task_queue)
        finally:
            await leave_nothing_running(client, task_queue)


async def existing_schedules(client) -> list[str]:
    """Which of gpufleet's Schedule ids the namespace has."""
    from temporalio.service import RPCStatusCode

    found = []
    for schedule_id in SCHEDULES:
        try:
            await client.get_schedule_handle(schedule_id).describe()
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            continue
        found.append(schedule_id)
    return found


async def leave_nothing_running(client, task_queue: str, timeout: float = 60) -> None:
    """On an existing cluster the benchmark's fleet would keep running (its entities wait for
    ever, its Schedules keep starting workflows, each an action): delete the Schedules it made
    and terminate what still runs on its task queue, until visibility lists nothing."""
    from temporalio.service import RPCStatusCode

    for schedule_id in await existing_schedules(client):
        await client.get_schedule_handle(schedule_id).delete()
    query = f"TaskQueue = '{task_queue}' AND ExecutionStatus = 'Running'"
    deadline = time.monotonic() + timeout
    while True:
        running = [wf async for wf in client.list_workflows(query)]
        if not running:
            return
        if time.monotonic() > deadline:
            print(f"left running after {timeout:.0f} s: {len(running)} workflows on {task_queue}", file=sys.stderr)
            return
        for wf in running:
            try:
                await client.get_workflow_handle(wf.id, run_id=wf.run_id).terminate("bench.scale is over")
            except RPCError as error:
                if error.status != RPCStatusCode.NOT_FOUND:  # ended meanwhile
                    raise
        await asyncio.sleep(1)  # visibility catches up


def _family(pids: tuple[int, ...]) -> list[int]:
    """The pids and their children (PostgreSQL serves each connection from a child process)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) in pids:
                children.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return [*pids, *children]


def cpu_of(pid: int | tuple[int, ...]) -> float:
    """CPU seconds of one process, or of a cluster's processes with their children, living and
    reaped (``--server-pids``; none named: not measured)."""
    if isinstance(pid, int):
        return proc_cpu(pid)
    if not pid:
        return float("nan")
    total = 0.0
    for one in _family(pid):
        try:
            fields = open(f"/proc/{one}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited since: its time is in its parent's reaped children
        reaped = (int(fields[13]) + int(fields[14])) if one in pid else 0
        total += (int(fields[11]) + int(fields[12]) + reaped) / os.sysconf("SC_CLK_TCK")
    return total


def rss_of(pid: int | tuple[int, ...]) -> float:
    """Resident MB of one process; of a cluster's processes and their children, their proportional
    share (PSS): PostgreSQL's backends each map its shared buffers, which RSS would count again
    for every one."""
    if isinstance(pid, int):
        return rss_mb(pid)
    sizes = []
    for one in _family(pid) if pid else []:
        try:
            rollup = Path(f"/proc/{one}/smaps_rollup").read_text()
        except OSError:
            continue
        sizes += [int(line.split()[1]) / 1024 for line in rollup.splitlines() if line.startswith("Pss:")]
    return sum(sizes) if sizes else float("nan")


@dataclass
class Step:
    nodes: int
    join_wall: float = 0.0
    joined: int = 0
    join_failures: list[str] = field(default_factory=list)
    contain: list[float] = field(default_factory=list)
    #: (node, fault injected, fault in the sim world, cordon seen), wall clock: the server runs on this
    #: machine, so its event times and ours read the same clock.
    cordons: list[tuple[str, float, float, float]] = field(default_factory=list)
    report_contain: list[float] = field(default_factory=list)  # watch result on the server -> cordon seen
    #: (fault injected, watch result on the server) -> the fence's local activity done, by the
    #: worker's clock: the cordon is written by then, without the driver's look to see it.
    fault_written: list[float] = field(default_factory=list)
    report_written: list[float] = field(default_factory=list)
    hops: dict[str, list[float]] = field(default_factory=dict)  # PATH_HOPS → s from the hop before
    #: Faults seen cordoned only after ``LATE_AFTER`` seconds (counted in ``contain`` too), and
    #: faults never seen cordoned within ``GIVE_UP_AFTER``.
    late: int = 0
    not_contained: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    steady_wall: float = 0.0
    steady_started: float = 0.0  # wall clock
    #: (watch result -> cordon seen s, injected s into the window, the hop that took longest):
    #: where in the window the tail falls, and on which hop.
    slowest: list[tuple[float, float, str]] = field(default_factory=list)
    #: process → its collections of ``SLOW_COLLECTION_SECONDS`` or more: (s into the window, ms, generation)
    gc_pauses: dict[str, list[tuple[float, float, int]]] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)  # process → CPU s over the steady window
    join_cpu: dict[str, float] = field(default_factory=dict)  # process → CPU s over the join window
    rss: dict[str, float] = field(default_factory=dict)  # process → MB at the window's end
    largest_history: tuple[int, str] = (0, "")
    schedule_to_start: list[float] = field(default_factory=list)
    #: The same waits by the queue the task was scheduled on ("sticky": the worker that has the
    #: workflow cached; "normal": the task queue), from the repairs' and the faults' Node entities'
    #: histories; and the tasks that timed out unstarted on a sticky queue (the SDK's
    #: ``sticky_queue_schedule_to_start_timeout``), each then scheduled again on the normal queue.
    waits_by_queue: dict[str, list[float]] = field(default_factory=dict)
    sticky_timeouts: int = 0
    tasks_seen: int = 0
    gpus: int = 0  # GPUs on the cluster's nodes at the steady window's end
    reclaims: list[float] = field(default_factory=list)  # notice -> reclaim done, replacement joined
    reclaim_failures: list[str] = field(default_factory=list)
    capacity: tuple[float, str] = (float("nan"), "")  # seconds to the result, and what it said
    health_sent: dict[str, int] = field(default_factory=dict)  # node → application XIDs injected
    health_checked: tuple[int, int] = (0, 0)  # (seen by the Node entities, injected) on the sampled nodes
    incident: float = float("nan")  # third fault injected -> the site's routing weight 0 (s)
    incident_said: str = ""

    @property
    def joins_per_minute(self) -> float:
        return self.joined / self.join_wall * 60 if self.join_wall else float("nan")


def spawn(module: list[str], settings, log: Path, extra_env: dict[str, str]) -> subprocess.Popen:
    env = {**os.environ, **settings.env(), **extra_env}
    return subprocess.Popen([sys.executable, "-m", *module], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


async def grow(client, settings, sites: list[dict], start: int, target: int, concurrency: int, step: Step) -> list[dict]:
    """Join nodes ``start``..``target``; the admitted nodes' descriptions."""
    gate = asyncio.Semaphore(concurrency)
    admitted: list[dict] = []

    async def join_one(i: int) -> None:
        site = sites[i % len(sites)]
        join_id = join_workflow_id(site["name"], uuid.uuid4().hex[:8])
        async with gate:
            try:
                result = await client.execute_workflow(
                    flows.NodeJoin.TYPE, {"site": site["name"]}, id=join_id, task_queue=settings.task_queue,
                    search_attributes=sa.join_start_attributes(site["name"], site["provider"], site["account"], join_id),
                )
                admitted.extend(result["nodes"])
            except Exception as error:  # noqa: BLE001 - counted and printed: any failure is a finding
                step.join_failures.append(f"{join_id}: {type(error).__name__}: {getattr(error, 'cause', None) or error}")

    begin = time.perf_counter()
    await asyncio.gather(*(join_one(i) for i in range(start, target)))
    step.join_wall = time.perf_counter() - begin
    step.joined = len(admitted)
    return admitted


def drill_sites(k: int) -> tuple[str, str]:
    return f"incident-{k}", f"refuge-{k}"


DRILL_PREFIXES = ("incident-", "refuge-")


async def incident_drill(fleet_env: FleetEnv, client, step: Step, k: int) -> None:
    """Two of ``incident-<k>``'s nodes fail; once its Site entity holds both, the third fails:
    timed from that fault to the site's routing weight 0."""
    cluster, world = fleet_env.cluster, fleet_env.world
    site, _ = drill_sites(k)
    machines = sorted(world.machines(site), key=lambda m: m["id"])[:3]
    if len(machines) < 3:
        step.incident_said = f"{site} has {len(machines)} machines, not 3"
        return
    handle = client.get_workflow_handle(site_workflow_id(site))

    async def holding_two() -> bool:
        try:
            status = await handle.query(flows.Site.status)
        except RPCError:
            return False
        return len(((status or {}).get("incident") or {}).get("failing") or []) >= 2

    async def weight_zero() -> bool:
        doc = await asyncio.to_thread(cluster.get_site_routes)
        return bool(doc and site in doc.sites and doc.sites[site].weight == 0)

    for m in machines[:2]:
        await asyncio.to_thread(world.inject_fault, m["id"], 0, "xid", 79, clears_on="reboot")
    try:
        await until(holding_two, 60, interval=0.01)
    except TimeoutError:
        step.incident_said = f"site/{site} never held two failures"
        return
    start = time.perf_counter()
    await asyncio.to_thread(world.inject_fault, machines[2]["id"], 0, "xid", 79, clears_on="reboot")
    try:
        step.incident = await until(weight_zero, 60, interval=0.01) - start
        step.incident_said = "tripped"
    except TimeoutError:
        step.incident_said = f"{site}'s weight not 0 within 60 s"


async def check_health_traffic(client, step: Step, rng: random.Random, sample: int = 40) -> None:
    """On a sample of the nodes that got application XIDs: how many their Node entities counted."""
    names = rng.sample(sorted(step.health_sent), min(sample, len(step.health_sent)))
    seen = sent = 0
    for name in names:
        try:
            status = await client.get_workflow_handle(node_workflow_id(name)).query(flows.Node.status)
        except Exception:  # noqa: BLE001 - replaced meanwhile (a spot reclaim): not in the sample
            continue
        seen += min(int((status.get("app_xids") or {}).get("13", 0)), step.health_sent[name])
        sent += step.health_sent[name]
    step.health_checked = (seen, sent)


#: A fault seen cordoned after this many seconds is late (a finding, printed); one not seen
#: cordoned after ``GIVE_UP_AFTER`` never was. Containment takes well under a second (see the
#: p99 rows), so only a fault the fleet lost reaches the second: the suite's smoke run asserts
#: none did, and leaves lateness, which a loaded machine can cause, to the printed count.
LATE_AFTER = 30
GIVE_UP_AFTER = 120


async def steady(fleet_env: FleetEnv, client, settings, step: Step, args, rng: random.Random,
                 used: set[tuple[str, int]], drill: int, minutes: float) -> list[str]:
    """The steady mix for ``minutes``: seeded faults (each timed from injection to
    cordon), spot reclaims (notice to reclaim done), one capacity request, health traffic and
    one provider incident (drill ``drill``). Returns the repair ids."""
    cluster, world = fleet_env.cluster, fleet_env.world
    busy: set[str] = set()
    repairs: list[str] = []
    watchers: list[asyncio.Task] = []

    #: node → (fault's perf_counter start, its wall-clock injection, the injection back from the sim
    #: world's write): faults not yet seen cordoned.
    pending: dict[str, tuple[float, float, float]] = {}

    def cordoned_now() -> list[str]:
        return [name for name in list(pending) if (cluster.get_node(name) or _gone).unschedulable]

    async def watch_cordons() -> None:
        """One look at every pending fault's node each 10 ms, in a thread of its own: a poll per
        fault, or one in the shared pool, would queue behind the driver's other threads (a
        listing of every node) and add its wait to the figure."""
        loop = asyncio.get_running_loop()
        while pending or time.perf_counter() < end:
            for name in await loop.run_in_executor(looker, cordoned_now) if pending else []:
                start, injected_at, written_at = pending.pop(name)
                step.contain.append(time.perf_counter() - start)
                step.late += step.contain[-1] > LATE_AFTER
                step.cordons.append((name, injected_at, written_at, time.time()))
            for name, (start, _, _) in list(pending.items()):
                if time.perf_counter() > start + GIVE_UP_AFTER:
                    pending.pop(name)
                    step.not_contained += 1
            await asyncio.sleep(0.01)

    async def reclaimed(name: str, start: float) -> None:
        handle = client.get_workflow_handle(reclaim_workflow_id(name))
        deadline = start + args.reclaim_notice + 120
        while True:
            try:
                result = await asyncio.wait_for(handle.result(), max(1.0, deadline - time.perf_counter()))
                break
            except RPCError:  # not started yet: the Node entity has not seen the notice
                if time.perf_counter() > deadline:
                    step.reclaim_failures.append(f"{name}: no reclaim workflow")
                    return
                await asyncio.sleep(0.1)
            except Exception as error:  # noqa: BLE001 - counted: any failure is a finding
                step.reclaim_failures.append(f"{name}: {type(error).__name__}: {getattr(error, 'cause', None) or error}")
                return
        replacement = result.get("replacement") or {}
        if not result.get("drained") or not replacement.get("complete"):
            step.reclaim_failures.append(f"{name}: drained {result.get('drained')}, replacement "
                                         f"{replacement.get('nodes') and len(replacement['nodes'])} of "
                                         f"{replacement.get('requested')}")
            return
        step.reclaims.append(time.perf_counter() - start)

    async def capacity_request() -> None:
        from client import FleetClient

        start = time.perf_counter()
        try:
            handle = await FleetClient(settings, client).acquire_capacity(
                {"constraints": {"gpu": "H100"}, "count": args.capacity_count, "deadline_seconds": 600},
                request_id=f"scale-{step.nodes}-{uuid.uuid4().hex[:6]}")
            result = await handle.result()
            said = f"{len(result.nodes)} of {result.requested} joined"
        except Exception as error:  # noqa: BLE001 - printed: any failure is a finding
            said = f"failed: {type(error).__name__}: {getattr(error, 'cause', None) or error}"
        step.capacity = (time.perf_counter() - start, said)

    # [when, the nodes]: one listing of the fleet serves every chooser for 5 s. A listing is
    # 1,250 rows parsed in this process, and the look for cordons waits while it holds the GIL.
    listed: list = [0.0, []]

    async def healthy_nodes() -> list:
        if time.perf_counter() - listed[0] > 5:
            listed[:] = [time.perf_counter(), await asyncio.to_thread(cluster.list_nodes)]
        return [n for n in listed[1]
                if n.ready and not n.unschedulable and n.machine_id and n.name not in busy
                and not n.site.startswith(DRILL_PREFIXES)]

    async def health_traffic() -> None:
        """Application XIDs at ``--health-per-minute``, on nodes no fault or reclaim touches."""
        if not args.health_per_minute:
            return
        interval = 60 / args.health_per_minute
        candidates: list = []
        refreshed = due = time.perf_counter()
        while due < end:
            if not candidates or time.perf_counter() - refreshed > 2:
                candidates = await healthy_nodes()
                refreshed = time.perf_counter()
                if not candidates:
                    return
            node = rng.choice(candidates)
            if node.name in busy:
                candidates.remove(node)
                continue
            gpu = rng.randrange(node.gpus_allocatable) if node.gpus_allocatable else 0
            await asyncio.to_thread(world.inject_fault, node.machine_id, gpu, "xid", 13, clears_on="reset")
            step.health_sent[node.name] = step.health_sent.get(node.name, 0) + 1
            due += interval
            await asyncio.sleep(max(0.0, due - time.perf_counter()))

    async def incident_later() -> None:
        await asyncio.sleep(minutes * 60 / 3)
        await incident_drill(fleet_env, client, step, drill)

    await healthy_nodes()  # listed before the clock starts, not beside the first fault
    looker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cordon-look")
    # Its thread's own connection to the sim world, opened now: opening one waited up to 1.4 s
    # (behind a checkpoint of the joins' writes) and that wait landed on the first fault.
    await asyncio.get_running_loop().run_in_executor(looker, cluster.get_node, "")
    end = time.perf_counter() + minutes * 60
    requested = asyncio.create_task(capacity_request())
    watchers.append(asyncio.create_task(watch_cordons()))
    watchers.append(asyncio.create_task(health_traffic()))
    watchers.append(asyncio.create_task(incident_later()))
    next_reclaim = time.perf_counter() + args.reclaim_interval / 2
    while time.perf_counter() < end:
        tick = time.perf_counter()
        nodes = await healthy_nodes()
        rng.shuffle(nodes)
        for node in nodes:
            gpu = rng.randrange(node.gpus_allocatable) if node.gpus_allocatable else 0
            if (node.name, gpu) in used:
                continue
            used.add((node.name, gpu))
            busy.add(node.name)
            clears = rng.choices([c for c, _ in FAULT_MIX], [w for _, w in FAULT_MIX])[0]
            start, injected_at = time.perf_counter(), time.time()
            await asyncio.to_thread(world.inject_fault, node.machine_id, gpu, "xid", 48, clears_on=clears)
            pending[node.name] = (start, injected_at, time.time())
            repairs.append(f"repair/{node.name}/gpu{gpu}")
            break
        if args.reclaim_interval and time.perf_counter() >= next_reclaim:
            next_reclaim += args.reclaim_interval
            spare = [n for n in nodes if n.name not in busy]
            if spare:
                node = rng.choice(spare)
                busy.add(node.name)
                start = time.perf_counter()
                await asyncio.to_thread(world.post_reclaim_notice, node.machine_id, args.reclaim_notice)
                watchers.append(asyncio.create_task(reclaimed(node.name, start)))
        await asyncio.sleep(max(0.0, args.fault_interval - (time.perf_counter() - tick)))
    await asyncio.gather(*watchers, requested)
    looker.shutdown()
    return repairs


async def prepare_drills(client, settings, fleet_env: FleetEnv, drills: int) -> None:
    """Join each drill's sites and put a model on them, routed (its weight above 0)."""
    from fleet.cluster import ServingSpec

    queue = settings.task_queue
    joins = []
    for k in range(drills):
        incident, refuge = drill_sites(k)
        joins.append(client.execute_workflow(flows.NodeJoin.TYPE, {"site": incident, "count": 3},
                                             id=f"join/{incident}/{uuid.uuid4().hex[:6]}", task_queue=queue))
        joins.append(client.execute_workflow(flows.NodeJoin.TYPE, {"site": refuge},
                                             id=f"join/{refuge}/{uuid.uuid4().hex[:6]}", task_queue=queue))
    await asyncio.gather(*joins)
    for k in range(drills):
        incident, refuge = drill_sites(k)
        for site, replicas in ((incident, 3), (refuge, 1)):
            await asyncio.to_thread(fleet_env.cluster.apply_serving, ServingSpec(
                model=f"llm-drill-{k}", site=site, image="vllm", replicas=replicas, gpus_per_replica=8))
        await client.execute_workflow(flows.SiteSweep.TYPE, {"sites": [incident]}, id=f"sweep-{incident}", task_queue=queue)


#: Faults the largest size's window holds by default: with fewer, a p99 is just the slowest one.
P99_SAMPLES = 100


#: Target: the fault → contained and report → contained p99 at the largest size within 5 times
#: those at the first (a tenth of it by default), the same run. A fault's path touches one node's
#: entity, so what grows with the fleet is the load on the machine every process shares: the
#: report → contained target this replaces (500 ms at 1,250 nodes) was 5 to 10 times the first
#: size's p99 in the runs docs/benchmarks.md records (48-100 ms at 125 nodes).
P99_GROWTH = 5.0


def growth_verdict(first: list[float], largest: list[float]) -> tuple[float, bool]:
    """The largest size's p99 over the first size's, and whether it is within ``P99_GROWTH``."""
    if not first or not largest:
        return float("nan"), False
    ratio = pct(largest, 99) / pct(first, 99)
    return ratio, ratio <= P99_GROWTH


def samples(values: list[float]) -> str:
    return f"p99 of {len(values)}" + (" = the slowest" if len(values) < P99_SAMPLES else "")


#: The hops of a fault's path, in order: each is timed from the one before (server event times,
#: and the worker's for its local activities: this machine's clock), the first from the fault's
#: injection to the driver's write of it into the sim world returning. The cordon is written in
#: the Node entity's workflow task that took the watch result (the node's facts, then the fence,
#: local activities; under ``node-patches-at-start-4`` regular ones, each a task of its own); the
#: Site's admission, the GpuRepair and its drain come after it.
PATH_HOPS = ("fault in the sim world", "watch result", "node task started", "facts answered", "fenced",
             "cordon seen")
#: Those activities, by the worker's completion time in a local one's marker or the server's
#: time of a regular one's ActivityTaskCompleted.
LOCAL_HOPS = {"node_facts": "facts answered", "fence_gpu": "fenced"}


async def report_to_contained(client, step: Step) -> None:
    """For each contained fault: from the watch result that carried it (its ActivityTaskCompleted
    in the Node entity's history, the first after the fault) to the cordon seen; and where the
    time went (``PATH_HOPS``), from the Node entity's history."""
    def seconds(event) -> float:
        return event.event_time.ToNanoseconds() / 1e9

    async def one(name: str, injected_at: float, written_at: float, cordoned_at: float) -> None:
        activities: dict[int, str] = {}
        marks: dict[str, float] = {"injected": injected_at, "fault in the sim world": written_at}
        waits = TaskWaits(since=injected_at)
        try:
            async for event in client.get_workflow_handle(node_workflow_id(name)).fetch_history_events():
                waits.see(event)
                if event.HasField("activity_task_scheduled_event_attributes"):
                    activities[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
                elif event.HasField("activity_task_completed_event_attributes") and "watch result" not in marks:
                    kind = activities.get(event.activity_task_completed_event_attributes.scheduled_event_id)
                    if kind == "watch_node" and seconds(event) >= injected_at:
                        marks["watch result"] = seconds(event)
                        step.report_contain.append(cordoned_at - seconds(event))
                elif event.HasField("activity_task_completed_event_attributes") and "node task started" in marks:
                    hop = LOCAL_HOPS.get(activities.get(event.activity_task_completed_event_attributes.scheduled_event_id))
                    if hop and hop not in marks:
                        marks[hop] = seconds(event)
                    if "fenced" in marks:
                        break
                elif (event.HasField("workflow_task_started_event_attributes") and "watch result" in marks
                      and "node task started" not in marks):
                    marks["node task started"] = seconds(event)
                elif (event.HasField("marker_recorded_event_attributes") and "node task started" in marks
                      and event.marker_recorded_event_attributes.marker_name == "core_local_activity"):
                    local = json.loads(event.marker_recorded_event_attributes.details["data"].payloads[0].data)
                    hop = LOCAL_HOPS.get(local.get("activity_type"))
                    if hop and hop not in marks:
                        done = local["complete_time"]
                        marks[hop] = done["seconds"] + done["nanos"] / 1e9
                    if "fenced" in marks:
                        break
        except Exception:  # noqa: BLE001 - a node replaced meanwhile: its history may be gone; the sample shrinks
            return
        waits.add_to(step)
        marks["cordon seen"] = cordoned_at
        if "fenced" in marks and "watch result" in marks:
            step.fault_written.append(marks["fenced"] - injected_at)
            step.report_written.append(marks["fenced"] - marks["watch result"])
        last, longest = injected_at, (0.0, "")
        for hop in PATH_HOPS:
            if hop in marks:
                took = max(0.0, marks[hop] - last)
                step.hops.setdefault(hop, []).append(took)
                longest = max(longest, (took, hop)) if hop != "watch result" else longest
                last = marks[hop]
        if "watch result" in marks:
            step.slowest.append((cordoned_at - marks["watch result"], injected_at - step.steady_started, longest[1]))

    await asyncio.gather(*(one(*c) for c in step.cordons))


GC_LINE = re.compile(r"^(\S+ \S+) \S+ WARNING gc: generation (\d) collection stopped this process for (\d+) ms")


def slow_collections(logs: Path, since: float, until: float) -> dict[str, list[tuple[float, float, int]]]:
    """The collections each Python process logged as slow (``workers.gc_tuning``) in the window:
    process → [(s into the window, ms, generation)]."""
    found: dict[str, list[tuple[float, float, int]]] = {}
    for name in ("worker", "gateway", "nodes"):
        path = logs / f"{name}.log"
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if (m := GC_LINE.match(line)) is None:
                continue
            stamp, millis = m.group(1).split(",")
            at = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
            if since <= at <= until:
                found.setdefault(name, []).append((at - since, float(m.group(3)), int(m.group(2))))
    return found


class _Gone:
    unschedulable = True  # a node deleted mid-repair (replaced) was contained before it went


_gone = _Gone()


class TaskWaits:
    """A history's workflow tasks: each one's schedule-to-start by the kind of queue it was
    scheduled on, and those that timed out unstarted (only a sticky queue's tasks can: a normal
    queue's have no schedule-to-start timeout). ``since``: tasks scheduled from then on only."""

    def __init__(self, since: float = 0.0) -> None:
        from temporalio.api.enums.v1 import TaskQueueKind, TimeoutType

        self._sticky, self._schedule_to_start = TaskQueueKind.TASK_QUEUE_KIND_STICKY, \
            TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_START
        self.since = since
        self.scheduled: dict[int, tuple[float, str]] = {}
        self.started: list[tuple[str, float]] = []
        self.sticky_timeouts = 0

    def see(self, event) -> None:
        at = event.event_time.ToNanoseconds() / 1e9
        if event.HasField("workflow_task_scheduled_event_attributes") and at >= self.since:
            kind = event.workflow_task_scheduled_event_attributes.task_queue.kind
            self.scheduled[event.event_id] = (at, "sticky" if kind == self._sticky else "normal")
        elif event.HasField("workflow_task_started_event_attributes"):
            scheduled = self.scheduled.get(event.workflow_task_started_event_attributes.scheduled_event_id)
            if scheduled:
                self.started.append((scheduled[1], at - scheduled[0]))
        elif (event.HasField("workflow_task_timed_out_event_attributes")
              and event.workflow_task_timed_out_event_attributes.timeout_type == self._schedule_to_start
              and event.workflow_task_timed_out_event_attributes.scheduled_event_id in self.scheduled):
            self.sticky_timeouts += 1

    def add_to(self, step: "Step") -> None:
        for kind, wait in self.started:
            step.waits_by_queue.setdefault(kind, []).append(wait)
        step.sticky_timeouts += self.sticky_timeouts
        step.tasks_seen += len(self.started) + self.sticky_timeouts


async def settle_repairs(client, repairs: list[str], step: Step, timeout: float) -> None:
    """Wait (bounded) for the step's repairs; tally outcomes and their workflow-task schedule-to-start."""
    async def one(repair_id: str) -> None:
        handle = client.get_workflow_handle(repair_id)
        try:
            result = await asyncio.wait_for(handle.result(), timeout)
            outcome = result.get("outcome", "?") if isinstance(result, dict) else str(result)
        except TimeoutError:
            outcome = "still running"
        except Exception as error:  # noqa: BLE001 - tallied: the table shows it
            outcome = f"failed ({type(error).__name__})"
        step.outcomes[outcome] = step.outcomes.get(outcome, 0) + 1
        waits = TaskWaits()
        try:
            async for event in handle.fetch_history_events():
                waits.see(event)
            step.schedule_to_start += [wait for _, wait in waits.started]
            waits.add_to(step)
        except Exception as error:  # noqa: BLE001 - a history that cannot be read only shrinks the sample
            step.outcomes[f"history unread ({type(error).__name__})"] = 1 + step.outcomes.get(
                f"history unread ({type(error).__name__})", 0)

    await asyncio.gather(*(one(r) for r in repairs))


async def largest_history(client) -> tuple[int, str]:
    query = " OR ".join(f'WorkflowType="{t}"' for t in ENTITY_TYPES)
    ids = [w.id async for w in client.list_workflows(f'({query}) AND ExecutionStatus="Running"')]
    gate = asyncio.Semaphore(16)
    best = (0, "")

    async def describe(workflow_id: str) -> None:
        nonlocal best
        async with gate:
            try:
                desc = await client.get_workflow_handle(workflow_id).describe()
            except Exception:  # noqa: BLE001 - closed between list and describe
                return
        length = desc.raw_description.workflow_execution_info.history_length
        best = max(best, (length, workflow_id))

    await asyncio.gather(*(describe(i) for i in ids))
    return best


def print_table(args, steps: list[Step]) -> None:
    # Short labels keep the table's columns; the header line names the cluster's address.
    server = "Temporal cluster" if args.address else "dev server"
    where = f"the cluster at {args.address}, namespace {args.namespace}" if args.address else "a dev server of its own"

    def row(label: str, values: list[float], fmt: str, unit: str = "") -> None:
        cells = "".join(f"{fmt.format(v) if not math.isnan(v) else 'n/a':>12s}" for v in values)
        first = values[0]
        ratios = "  ".join(f"{v / first:.2f}" if first and not math.isnan(v) and not math.isnan(first) else "n/a"
                           for v in values)
        print(f"  {label:48s}{cells}   x{ratios}{unit}")

    def per_node(values: list[float]) -> list[float]:
        return [v / s.nodes for v, s in zip(values, steps)]

    nan = float("nan")
    print(f"scale: {args.sites} sites, {args.gpus_per_node} GPUs/node, steps {', '.join(str(s.nodes) for s in steps)}"
          f" nodes; steady window {args.minutes:g} min ({args.largest_minutes:g} at {steps[-1].nodes}), a fault every {args.fault_interval} s, a reclaim every "
          f"{args.reclaim_interval} s, {args.health_per_minute:.0f} application XIDs a minute, one incident; "
          f"heartbeat timeout {args.heartbeat_seconds} s; simulated nodes at nice {args.nodes_nice}; seed {args.seed}; "
          f"Temporal: {where}")
    print(f"  {'nodes':48s}" + "".join(f"{s.nodes:>12d}" for s in steps) + "   ratios to the first size")
    print(f"  {'GPUs on the nodes':48s}" + "".join(f"{s.gpus:>12d}" for s in steps))
    row("join: nodes admitted / min (this step's joins)", [s.joins_per_minute for s in steps], "{:.0f}")
    for name in ("worker", "server"):
        row(f"join: {name} CPU ms per node joined", [s.join_cpu[name] / s.joined * 1000 if s.joined else nan
                                                    for s in steps], "{:.0f}")
    print(f"  {'join failures':48s}" + "".join(f"{len(s.join_failures):>12d}" for s in steps))
    row("fault injected -> contained p50 (ms)", [statistics.median(s.contain) * 1000 if s.contain else nan
                                                  for s in steps], "{:.0f}")
    row("fault injected -> contained p99 (ms)", [pct(s.contain, 99) * 1000 if s.contain else nan for s in steps],
        "{:.0f}")
    row("  watch result (report) -> contained p50 (ms)", [statistics.median(s.report_contain) * 1000
                                                          if s.report_contain else nan for s in steps], "{:.0f}")
    row("  watch result (report) -> contained p99 (ms)", [pct(s.report_contain, 99) * 1000 if s.report_contain
                                                          else nan for s in steps], "{:.0f}")
    for label, values in (("fault injected -> cordon written", "fault_written"),
                          ("  watch result -> cordon written", "report_written")):
        row(f"{label}, p50 / p99 (ms)",
            [statistics.median(getattr(s, values)) * 1000 if getattr(s, values) else nan for s in steps], "{:.0f}")
        print(f"  {'    (the fence done, by the worker clock)':48s}"
              + "".join(f"{pct(getattr(s, values), 99) * 1000 if getattr(s, values) else nan:>12.0f}" for s in steps))
    for hop in PATH_HOPS:
        row(f"    {hop}: from the hop before, p50 / p99 (ms)",
            [statistics.median(s.hops[hop]) * 1000 if s.hops.get(hop) else nan for s in steps], "{:.0f}")
        print(f"  {'':48s}" + "".join(f"{pct(s.hops[hop], 99) * 1000 if s.hops.get(hop) else nan:>12.0f}"
                                         for s in steps))
    for s in steps:
        worst = sorted(s.slowest, reverse=True)[:3]
        print(f"  {f'slowest reports -> contained at {s.nodes}':48s}"
              + ", ".join(f"{took * 1000:.0f} ms at +{at:.0f} s ({hop})" for took, at, hop in worst))
    for name in ("worker", "gateway", "nodes", "driver"):
        row(f"GC pauses >= {SLOW_COLLECTION_SECONDS * 1000:.0f} ms, {name}: count",
            [len(s.gc_pauses.get(name, [])) for s in steps], "{:.0f}")
        longest = sorted(steps[-1].gc_pauses.get(name, []), key=lambda pause: -pause[1])[:3]
        if longest:
            print(f"  {'    the longest, at':48s}"
                  + ", ".join(f"{ms:.0f} ms (gen {gen}) +{at:.0f} s" for at, ms, gen in longest))
    print(f"  {f'faults contained / late (> {LATE_AFTER} s) / never':48s}"
          + "".join(f"{f'{len(s.contain)}/{s.late}/{s.not_contained}':>12s}" for s in steps))
    row("spot reclaim notice -> replaced p50 (s)", [statistics.median(s.reclaims) if s.reclaims else nan
                                                    for s in steps], "{:.1f}")
    print(f"  {'spot reclaims replaced / failed':48s}"
          + "".join(f"{f'{len(s.reclaims)}/{len(s.reclaim_failures)}':>12s}" for s in steps))
    row("capacity request -> result (s)", [s.capacity[0] for s in steps], "{:.1f}")
    print(f"  {'  it said':48s}" + "".join(f"  {s.capacity[1]}" for s in steps))
    row("workflow task schedule-to-start p99 (ms)", [pct(s.schedule_to_start, 99) * 1000 if s.schedule_to_start
                                                     else nan for s in steps], "{:.1f}")
    for kind in ("sticky", "normal"):
        row(f"  {kind} queue: p50 / p99 (ms; repairs' and faults' nodes' tasks)",
            [statistics.median(s.waits_by_queue[kind]) * 1000 if s.waits_by_queue.get(kind) else nan
             for s in steps], "{:.1f}")
        print(f"  {'':48s}" + "".join(f"{pct(s.waits_by_queue[kind], 99) * 1000 if s.waits_by_queue.get(kind) else nan:>12.1f}"
                                         for s in steps))
    print(f"  {'  timed out on the sticky queue / tasks':48s}"
          + "".join(f"{f'{s.sticky_timeouts}/{s.tasks_seen}':>12s}" for s in steps))
    row("worker CPU s per steady minute", [s.cpu["worker"] / s.steady_wall * 60 for s in steps], "{:.1f}")
    row("  per node (ms / min)", per_node([s.cpu["worker"] / s.steady_wall * 60_000 for s in steps]), "{:.1f}")
    row(f"{server} CPU s per steady minute", [s.cpu["server"] / s.steady_wall * 60 for s in steps], "{:.1f}")
    row("node host CPU s per steady minute", [s.cpu["nodes"] / s.steady_wall * 60 for s in steps], "{:.1f}")
    row("node gateway CPU s per steady minute", [s.cpu["gateway"] / s.steady_wall * 60 for s in steps], "{:.1f}")
    row("this benchmark's driver CPU s per steady minute", [s.cpu["driver"] / s.steady_wall * 60 for s in steps],
        "{:.1f}")
    row("worker RSS (MB)", [s.rss["worker"] for s in steps], "{:.0f}")
    row("  per node (MB)", per_node([s.rss["worker"] for s in steps]), "{:.2f}")
    row(f"{server} RSS (MB)", [s.rss["server"] for s in steps], "{:.0f}")
    row("node gateway RSS (MB)", [s.rss["gateway"] for s in steps], "{:.0f}")
    row("node host RSS (MB)", [s.rss["nodes"] for s in steps], "{:.0f}")
    row("  per node (MB)", per_node([s.rss["nodes"] for s in steps]), "{:.2f}")
    row("largest entity history (events)", [s.largest_history[0] for s in steps], "{:.0f}")
    print(f"  {'  held by':48s}" + "".join(f"  {s.largest_history[1]}" for s in steps))
    print("  repair outcomes: " + "; ".join(
        f"{s.nodes}: " + ", ".join(f"{k} {v}" for k, v in sorted(s.outcomes.items())) for s in steps))
    for s in steps:
        for failure in s.join_failures[:3]:
            print(f"  join failure at {s.nodes}: {failure[:200]}")
        for failure in s.reclaim_failures[:3]:
            print(f"  reclaim failure at {s.nodes}: {failure[:200]}")
    row("incident: third fault -> routing weight 0 (ms)", [s.incident * 1000 for s in steps], "{:.0f}")
    print(f"  {'  it said':48s}" + "".join(f"  {s.incident_said}" for s in steps))
    row("health traffic: application XIDs per minute", [sum(s.health_sent.values()) / s.steady_wall * 60
                                                        for s in steps], "{:.0f}")
    print(f"  {'  counted by the Node entities (sampled nodes)':48s}"
          + "".join(f"{f'{s.health_checked[0]}/{s.health_checked[1]}':>12s}" for s in steps))
    largest, first = steps[-1], steps[0]
    # The targets are taken at the largest size, where the window holds enough faults for a p99,
    # against the first size of the same run.
    for label, attr in (("fault -> contained", "contain"), ("report -> contained", "report_contain")):
        before, after = getattr(first, attr), getattr(largest, attr)
        if len(steps) < 2 or not before or not after:
            judged = "not judged (one size, or none contained at one of them: no baseline)"
        else:
            ratio, ok = growth_verdict(before, after)
            judged = (f"{'met' if ok else 'NOT met'} ({ratio:.2f}x: {pct(after, 99) * 1000:.0f} ms, {samples(after)}, "
                      f"against {pct(before, 99) * 1000:.0f} ms, {samples(before)})")
        print(f"  target {label} p99 at {largest.nodes} within {P99_GROWTH:g}x of at {first.nodes}: {judged}")
    if len(steps) > 1 and first.incident:
        print(f"  incident: third fault -> routing weight 0 at {largest.nodes} / at {first.nodes}: "
              f"{largest.incident / first.incident:.2f}x (one drill each; bench.incident judges it)")
    worst = max(s.largest_history[0] for s in steps)
    print(f"  target no entity history > 10,000 events: {'met' if worst <= 10_000 else 'NOT met'} (largest {worst})")
    last = steps[-1]
    print(f"  target worker RSS < 1 GiB at {last.nodes} nodes: {'met' if last.rss['worker'] < 1024 else 'NOT met'} "
          f"({last.rss['worker']:.0f} MB)")
    if len(steps) > 1:
        cost = max(last.cpu["worker"] / last.nodes / (steps[0].cpu["worker"] / steps[0].nodes),
                   last.rss["worker"] / last.nodes / (steps[0].rss["worker"] / steps[0].nodes))
        print(f"  target worker cost per node within 1.5x of the first size: {'met' if cost <= 1.5 else 'NOT met'} "
              f"(worst of CPU and RSS: {cost:.2f}x)")


async def main(args) -> None:
    if args.smoke:
        args.nodes, args.sites, args.steps, args.join_concurrency = 4, 2, "2,4", 4
        args.minutes = args.largest_minutes = 0.1
        args.fault_interval, args.reclaim_interval, args.health_per_minute = 1.5, 4.0, 30.0
    sizes = sorted({int(s) for s in args.steps.split(",") if s.strip()}) if args.steps else \
        sorted({max(1, round(args.nodes * f)) for f in (0.1, 0.2, 0.5, 1.0)})
    if not sizes or sizes[0] < 1:
        usage_error("--steps: positive sizes, e.g. 125,250")
    for name in ("sites", "gpus_per_node", "join_concurrency"):
        if getattr(args, name) < 1:
            usage_error(f"--{name.replace('_', '-')}: at least 1")
    if args.reclaim_interval < 0 or args.reclaim_notice <= 0 or args.capacity_count < 1:
        usage_error("--reclaim-interval >= 0, --reclaim-notice > 0, --capacity-count >= 1")
    if args.heartbeat_seconds <= 0:
        usage_error("--heartbeat-seconds: greater than 0")
    if args.minutes <= 0 or args.fault_interval <= 0:
        usage_error("--minutes and --fault-interval: greater than 0")
    if args.largest_minutes is None:
        # A few more than P99_SAMPLES: the first fault waits a moment and the last may not be contained in the window.
        args.largest_minutes = max(args.minutes, math.ceil((P99_SAMPLES + 5) * args.fault_interval / 6) / 10)
    elif args.largest_minutes <= 0:
        usage_error("--largest-minutes: greater than 0")
    if args.health_per_minute < 0:
        usage_error("--health-per-minute: 0 or more")
    if not args.address and (args.server_pids or args.task_queue or args.namespace != "default"):
        usage_error("--namespace, --task-queue and --server-pids go with --address")
    try:
        server_pids = tuple(int(p) for p in args.server_pids.split(",") if p.strip())
    except ValueError:
        usage_error("--server-pids: process ids, comma-separated")
    # Room for replacements (faults that never clear, reclaims) and capacity requests, on top
    # of the largest size.
    per_site = math.ceil(sizes[-1] / args.sites * 1.3) + 5 + math.ceil(len(sizes) * args.capacity_count / args.sites)
    config = fleet(sites=args.sites, capacity=per_site)
    for site in config["sites"]:
        site["gpus_per_machine"] = args.gpus_per_node
        site["capacity_type"] = "spot"  # the reclaims: only a spot node's notice is acted on
    # The heartbeat timeout is the product's default unless asked: every Node entity's watch
    # heartbeats at most every 0.8 x timeout, and each heartbeat is a write on the server.
    config["repair"] = {"timeouts": {"drain_seconds": 1, "smoke_test_seconds": 10,
                                     "heartbeat_seconds": args.heartbeat_seconds}}
    config["incident"] = {"settle_seconds": 0, "enabled": False}
    # One incident drill per size, each at a site pair of its own (as in bench/incident): dearer
    # and full, so no capacity request lands there.
    for k in range(len(sizes)):
        for name, nodes in zip(drill_sites(k), (3, 1)):
            config["accounts"].append({"name": f"acct-{name}", "provider": "lambda", "credentials": {"env": "X"}})
            config["sites"].append({
                **config["sites"][0], "name": name, "account": f"acct-{name}", "price_per_gpu_hour": 9.0,
                "max_nodes": nodes, "sim": {**config["sites"][0]["sim"], "capacity": nodes, "quota": nodes},
                **({"incident": {"enabled": True, "min_nodes": 3, "fraction": 0.3, "settle_seconds": 10,
                                 "check_seconds": 3600, "probe_seconds": 3600}} if name.startswith("incident") else {}),
            })
    main_sites = [s for s in config["sites"] if not s["name"].startswith(DRILL_PREFIXES)]
    rng = random.Random(args.seed)
    steps: list[Step] = []
    environment = existing_cluster_env(config, args.address, args.namespace, args.task_queue or
                                       f"bench-{uuid.uuid4().hex[:6]}") if args.address else bench_env(config)
    async with environment as (env, settings):
        client = env.client
        logs = settings.state_dir
        worker = spawn(["workers.control_plane"], settings, logs / "worker.log",
                       {} if args.worker_metrics_port is None else {"GPUFLEET_METRICS_PORT": str(args.worker_metrics_port)})
        # Every agent through the node gateway, with a key and certificate of its own, as deployed.
        files = dev_gateway_files(settings.state_dir)
        gateway_port = 17300 + os.getpid() % 1000
        gateway = spawn(["workers.node_gateway", "--dev", "--listen", f"127.0.0.1:{gateway_port}"], settings,
                        logs / "gateway.log", {})
        wait_for_port(gateway_port)
        host = spawn(["workers.node_agent", "--sim", "--poll-seconds", "0.05", "--nice", str(args.nodes_nice)],
                     settings, logs / "nodes.log",
                     {"GPUFLEET_HEALTH_SECONDS": str(args.health_seconds),
                      "GPUFLEET_GATEWAY": f"127.0.0.1:{gateway_port}", "GPUFLEET_GATEWAY_CA": str(files["ca"]),
                      "GPUFLEET_SIM_SIGNER_DIR": str(files["ca"].parent)})
        # The driver's own full collections would stop the clock that sees each cordon.
        driver_gc = settle_garbage_collection()
        # This process too: it injects, polls the cluster for cordons and queries, on the same two cores.
        pids = {"worker": worker.pid, "server": server_pids if args.address else server_pid(), "gateway": gateway.pid,
                "nodes": host.pid, "driver": os.getpid()}
        fleet_env = FleetEnv.from_settings(settings)
        used: set[tuple[str, int]] = set()
        try:
            await asyncio.sleep(3)  # the worker's first polls (sandbox warm-up happens on the first joins)
            for proc, name in ((worker, "worker"), (gateway, "gateway"), (host, "nodes")):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited: {(logs / f'{name}.log').read_text()[-2000:]}")
            # The product's Schedules, as `gpufleet dev` applies them: the site reconcile's first
            # pass starts every Site entity, so a fault meets its site's entity running, as in a
            # fleet that has been up for a while.
            await apply_schedules(client, settings.task_queue, site_every=300, catalog_every=600)
            await prepare_drills(client, settings, fleet_env, len(sizes))
            have = 0
            for drill, size in enumerate(sizes):
                step = Step(size)
                before = {name: cpu_of(pid) for name, pid in pids.items()}
                await grow(client, settings, main_sites, have, size, args.join_concurrency, step)
                have = size
                step.join_cpu = {name: cpu_of(pid) - before[name] for name, pid in pids.items()}
                await asyncio.sleep(2)  # every new Node entity's first watch answered
                before = {name: cpu_of(pid) for name, pid in pids.items()}
                begin, step.steady_started = time.perf_counter(), time.time()
                driver_gc.slow.clear()
                minutes = args.largest_minutes if size == sizes[-1] else args.minutes
                repairs = await steady(fleet_env, client, settings, step, args, rng, used, drill, minutes)
                step.steady_wall = time.perf_counter() - begin
                step.gc_pauses = {**slow_collections(logs, step.steady_started, time.time()),
                                  "driver": [(at - step.steady_started, took * 1000, gen)
                                             for at, took, gen in driver_gc.slow]}
                step.cpu = {name: cpu_of(pid) - before[name] for name, pid in pids.items()}
                step.rss = {name: rss_of(pid) for name, pid in pids.items()}
                step.gpus = sum(n.gpus_allocatable for n in await asyncio.to_thread(fleet_env.cluster.list_nodes))
                await settle_repairs(client, repairs, step, timeout=30)
                await check_health_traffic(client, step, rng)
                await report_to_contained(client, step)
                step.largest_history = await largest_history(client)
                steps.append(step)
                print(f"  [{size} nodes: joined {step.joined} in {step.join_wall:.1f} s, {len(step.contain)} faults "
                      f"contained]", flush=True)
        finally:
            for proc in (host, gateway, worker):
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            if steps:  # a run cut short still prints the sizes it finished
                print_table(args, steps)


def cli(
    nodes: Annotated[int, typer.Option(help="the largest size (the last step)")] = 1250,
    sites: Annotated[int, typer.Option()] = 10,
    gpus_per_node: Annotated[int, typer.Option()] = 8,
    minutes: Annotated[float, typer.Option(help="steady window at each size")] = 1.0,
    nodes_nice: Annotated[int, typer.Option(
        help="CPU niceness of the simulated nodes' host (0: the same as the control plane)")] = SIM_HOST_NICE,
    largest_minutes: Annotated[Optional[float], typer.Option(
        help=f"steady window at the largest size (default: long enough for {P99_SAMPLES} faults, so that its p99 "
             "is not simply the slowest one)")] = None,
    steps: Annotated[str, typer.Option(
        help="sizes measured, comma-separated (default: 10%, 20%, 50%, 100% of --nodes)")] = "",
    fault_interval: Annotated[float, typer.Option(help="seconds between injected faults")] = 2.0,
    health_seconds: Annotated[float, typer.Option(
        help="the agents' periodic probe (0: only when the sim wakes a node's watch, as a real node's XID waiter "
             "does: every fault here is an XID, and 1,250 simulated nodes' periodic probes would spend on this "
             "machine what real nodes spend on their own)")] = 0.0,
    join_concurrency: Annotated[int, typer.Option()] = 200,
    heartbeat_seconds: Annotated[float, typer.Option(
        help="repair heartbeat timeout (the watch's too); 30 is the product default")] = 30.0,
    reclaim_interval: Annotated[float, typer.Option(
        help="seconds between spot reclaim notices in the steady window (0: none)")] = 15.0,
    reclaim_notice: Annotated[float, typer.Option(help="warning a reclaim notice gives")] = 20.0,
    capacity_count: Annotated[int, typer.Option(help="nodes the steady window's capacity request asks")] = 2,
    health_per_minute: Annotated[float, typer.Option(
        help="application XIDs injected per minute in the steady window (0: none)")] = 1000.0,
    seed: Annotated[int, typer.Option()] = 22,
    address: Annotated[str, typer.Option(help="an existing Temporal cluster (default: a dev server of its own)")] = "",
    namespace: Annotated[str, typer.Option(help="with --address: the namespace")] = "default",
    task_queue: Annotated[str, typer.Option(
        help="with --address: the control plane's queue (default: bench-<random>)")] = "",
    server_pids: Annotated[str, typer.Option(
        help="with --address: the cluster's processes on this machine, comma-separated, for its CPU and memory")] = "",
    worker_metrics_port: Annotated[Optional[int], typer.Option(
        help="serve the control-plane worker's /metrics (the SDK's temporal_* series: pollers, sticky cache, "
             "schedule-to-start) on this port, to watch a run (default: none)")] = None,
    smoke: Annotated[bool, typer.Option(
        "--smoke", help="the suite's size (tests/test_bench_smoke.py): 2 then 4 nodes at 2 sites, 6 s steady "
                        "windows; a crash fails it")] = False,
) -> None:
    args = bench_args(locals())
    run(lambda: main(args))


if __name__ == "__main__":
    command_line(cli, __doc__)
