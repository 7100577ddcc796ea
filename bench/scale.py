"""The fleet at size (issue 22, first step): one run grows the simulated fleet through
``--steps`` sizes and measures each, printing every figure as a ratio to the smallest.

Processes, as under ``gpufleet dev``: the dev server (WorkflowEnvironment's child), the
control-plane worker (``python -m workers.control_plane``) and the simulated node host
(``python -m workers.node_agent --sim``, agents connected directly, no gateway), each its
own process so that CPU seconds and resident memory are read from /proc for each alone.
This process only starts joins, injects faults and watches the sim's cluster.

At each size:

1. join: NodeJoins (spread round-robin over the sites, at most ``--join-concurrency``
   in flight) bring the fleet from the previous size to this one; nodes admitted per
   minute over that window. A join that fails is counted (no fault is injected while
   joining, so any failure is a finding).
2. steady: for ``--minutes``, one seeded fault every ``--fault-interval`` s into a random
   healthy node's simulated GPU (XID 48; mix cleared by reset / reboot / never, i.e.
   replace). The clock starts before the fault is written into the sim world and stops
   when the node is cordoned: detection is included. In the sim, the node host sees the
   world change (its poll, 50 ms here) and wakes every agent's watch, as a real node's XID
   waiter wakes its own; the Node entity's ``watch_node`` returns the new state.
3. costs over the steady window: CPU seconds of worker and dev server, resident memory of
   all three processes; the largest history (describe) of any running Node, Site,
   ProviderAccount or SiteEvacuation; workflow-task schedule-to-start on the control-plane
   queue, from the histories of the GpuRepairs the step started.

The incident detector is off (seeded faults close together would read as an incident),
so threshold → routing weight 0, spot reclaims and the capacity request are printed as
"not measured". Health traffic is the agents' pull watch at ``GPUFLEET_HEALTH_SECONDS``
(``--health-seconds``), not a push mix of 1,000 reports per minute.

    python -m bench.scale [--nodes 1250] [--sites 10] [--gpus-per-node 8] [--minutes 1]
                          [--steps 125,250,625,1250] [--fault-interval 2] [--seed 22]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from activities.env import FleetEnv
from bench.common import bench_env, fleet, run
from bench.join_overhead import proc_cpu, server_pid
from fleet import search_attributes as sa
from fleet.naming import join_workflow_id

ENTITY_TYPES = ("Node", "Site", "ProviderAccount", "SiteEvacuation")
#: What a seeded fault needs to clear: most resets, some reboots, a few replacements.
FAULT_MIX = (("reset", 0.7), ("reboot", 0.2), ("never", 0.1))


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Step:
    nodes: int
    join_wall: float = 0.0
    joined: int = 0
    join_failures: list[str] = field(default_factory=list)
    contain: list[float] = field(default_factory=list)
    not_contained: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    steady_wall: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # process → CPU s over the steady window
    join_cpu: dict[str, float] = field(default_factory=dict)  # process → CPU s over the join window
    rss: dict[str, float] = field(default_factory=dict)  # process → MB at the window's end
    largest_history: tuple[int, str] = (0, "")
    schedule_to_start: list[float] = field(default_factory=list)
    gpus: int = 0  # GPUs on the cluster's nodes at the steady window's end

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
                    "NodeJoin", {"site": site["name"]}, id=join_id, task_queue=settings.task_queue,
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


async def steady(fleet_env: FleetEnv, step: Step, minutes: float, interval: float, rng: random.Random,
                 used: set[tuple[str, int]]) -> list[str]:
    """Seeded faults for ``minutes``; each timed from injection to cordon. Returns the repair ids."""
    cluster, world = fleet_env.cluster, fleet_env.world
    busy: set[str] = set()
    repairs: list[str] = []
    watchers: list[asyncio.Task] = []

    async def contained(name: str, start: float) -> None:
        deadline = start + 30
        while not await asyncio.to_thread(lambda: (cluster.get_node(name) or _gone).unschedulable):
            if time.perf_counter() > deadline:
                step.not_contained += 1
                return
            await asyncio.sleep(0.01)
        step.contain.append(time.perf_counter() - start)

    end = time.perf_counter() + minutes * 60
    while time.perf_counter() < end:
        tick = time.perf_counter()
        nodes = [n for n in await asyncio.to_thread(cluster.list_nodes)
                 if n.ready and not n.unschedulable and n.machine_id and n.name not in busy]
        rng.shuffle(nodes)
        for node in nodes:
            gpu = rng.randrange(node.gpus_allocatable) if node.gpus_allocatable else 0
            if (node.name, gpu) in used:
                continue
            used.add((node.name, gpu))
            busy.add(node.name)
            clears = rng.choices([c for c, _ in FAULT_MIX], [w for _, w in FAULT_MIX])[0]
            start = time.perf_counter()
            await asyncio.to_thread(world.inject_fault, node.machine_id, gpu, "xid", 48, clears_on=clears)
            watchers.append(asyncio.create_task(contained(node.name, start)))
            repairs.append(f"repair/{node.name}/gpu{gpu}")
            break
        await asyncio.sleep(max(0.0, interval - (time.perf_counter() - tick)))
    await asyncio.gather(*watchers)
    return repairs


class _Gone:
    unschedulable = True  # a node deleted mid-repair (replaced) was contained before it went


_gone = _Gone()


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
        scheduled: dict[int, int] = {}
        try:
            async for event in handle.fetch_history_events():
                if event.HasField("workflow_task_scheduled_event_attributes"):
                    scheduled[event.event_id] = event.event_time.ToNanoseconds()
                elif event.HasField("workflow_task_started_event_attributes"):
                    from_id = event.workflow_task_started_event_attributes.scheduled_event_id
                    if from_id in scheduled:
                        step.schedule_to_start.append((event.event_time.ToNanoseconds() - scheduled[from_id]) / 1e9)
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
          f" nodes; steady window {args.minutes} min, a fault every {args.fault_interval} s; seed {args.seed}")
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
    print(f"  {'faults contained / not within 30 s':48s}"
          + "".join(f"{f'{len(s.contain)}/{s.not_contained}':>12s}" for s in steps))
    row("workflow task schedule-to-start p99 (ms)", [pct(s.schedule_to_start, 99) * 1000 if s.schedule_to_start
                                                     else nan for s in steps], "{:.1f}")
    row("worker CPU s per steady minute", [s.cpu["worker"] / s.steady_wall * 60 for s in steps], "{:.1f}")
    row("  per node (ms / min)", per_node([s.cpu["worker"] / s.steady_wall * 60_000 for s in steps]), "{:.1f}")
    row("dev server CPU s per steady minute", [s.cpu["server"] / s.steady_wall * 60 for s in steps], "{:.1f}")
    row("node host CPU s per steady minute", [s.cpu["nodes"] / s.steady_wall * 60 for s in steps], "{:.1f}")
    row("worker RSS (MB)", [s.rss["worker"] for s in steps], "{:.0f}")
    row("  per node (MB)", per_node([s.rss["worker"] for s in steps]), "{:.2f}")
    row("dev server RSS (MB)", [s.rss["server"] for s in steps], "{:.0f}")
    row("node host RSS (MB)", [s.rss["nodes"] for s in steps], "{:.0f}")
    row("  per node (MB)", per_node([s.rss["nodes"] for s in steps]), "{:.2f}")
    row("largest entity history (events)", [s.largest_history[0] for s in steps], "{:.0f}")
    print(f"  {'  held by':48s}" + "".join(f"  {s.largest_history[1]}" for s in steps))
    print("  repair outcomes: " + "; ".join(
        f"{s.nodes}: " + ", ".join(f"{k} {v}" for k, v in sorted(s.outcomes.items())) for s in steps))
    for s in steps:
        for failure in s.join_failures[:3]:
            print(f"  join failure at {s.nodes}: {failure[:200]}")
    for label in ("threshold -> routing weight 0 (incident)", "spot reclaims at the spot site",
                  "capacity request under the steady mix", "push health mix at 1,000 reports/min"):
        print(f"  {label:48s}not measured")
    worst_p99 = max((pct(s.contain, 99) for s in steps if s.contain), default=nan)
    print(f"  target fault -> contained p99 < 2 s: {'met' if worst_p99 < 2 else 'NOT met'} (worst {worst_p99:.2f} s)")
    worst = max(s.largest_history[0] for s in steps)
    print(f"  target no entity history > 10,000 events: {'met' if worst <= 10_000 else 'NOT met'} (largest {worst})")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1250, help="the largest size (the last step)")
    parser.add_argument("--sites", type=int, default=10)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=1.0, help="steady window at each size")
    parser.add_argument("--steps", default="", help="sizes measured, comma-separated (default: 10%%, 20%%, 50%%, "
                        "100%% of --nodes)")
    parser.add_argument("--fault-interval", type=float, default=2.0, help="seconds between injected faults")
    parser.add_argument("--health-seconds", type=float, default=5.0, help="the agents' probe interval")
    parser.add_argument("--join-concurrency", type=int, default=200)
    parser.add_argument("--seed", type=int, default=22)
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.steps.split(",") if s.strip()}) if args.steps else \
        sorted({max(1, round(args.nodes * f)) for f in (0.1, 0.2, 0.5, 1.0)})
    if not sizes or sizes[0] < 1:
        parser.error("--steps: positive sizes, e.g. 125,250")
    for name in ("sites", "gpus_per_node", "join_concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: at least 1")
    if args.minutes <= 0 or args.fault_interval <= 0:
        parser.error("--minutes and --fault-interval: greater than 0")
    # Room for replacements of faults that never clear, on top of the largest size.
    per_site = math.ceil(sizes[-1] / args.sites * 1.3) + 5
    config = fleet(sites=args.sites, capacity=per_site)
    for site in config["sites"]:
        site["gpus_per_machine"] = args.gpus_per_node
    config["repair"] = {"timeouts": {"drain_seconds": 1, "smoke_test_seconds": 10, "heartbeat_seconds": 5}}
    config["incident"] = {"settle_seconds": 0, "enabled": False}
    rng = random.Random(args.seed)
    steps: list[Step] = []
    async with bench_env(config) as (env, settings):
        client = env.client
        logs = settings.state_dir
        worker = spawn(["workers.control_plane"], settings, logs / "worker.log", {})
        host = spawn(["workers.node_agent", "--sim", "--poll-seconds", "0.05"], settings, logs / "nodes.log",
                     {"GPUFLEET_HEALTH_SECONDS": str(args.health_seconds)})
        pids = {"worker": worker.pid, "server": server_pid(), "nodes": host.pid}
        fleet_env = FleetEnv.from_settings(settings)
        used: set[tuple[str, int]] = set()
        try:
            await asyncio.sleep(3)  # the worker's first polls (sandbox warm-up happens on the first joins)
            for proc, name in ((worker, "worker"), (host, "node host")):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited: {(logs / f'{name.split()[0]}.log').read_text()[-2000:]}")
            have = 0
            for size in sizes:
                step = Step(size)
                before = {name: proc_cpu(pid) for name, pid in pids.items()}
                await grow(client, settings, config["sites"], have, size, args.join_concurrency, step)
                have = size
                step.join_cpu = {name: proc_cpu(pid) - before[name] for name, pid in pids.items()}
                await asyncio.sleep(2)  # every new Node entity's first watch answered
                before = {name: proc_cpu(pid) for name, pid in pids.items()}
                begin = time.perf_counter()
                repairs = await steady(fleet_env, step, args.minutes, args.fault_interval, rng, used)
                step.steady_wall = time.perf_counter() - begin
                step.cpu = {name: proc_cpu(pid) - before[name] for name, pid in pids.items()}
                step.rss = {name: rss_mb(pid) for name, pid in pids.items()}
                step.gpus = sum(n.gpus_allocatable for n in await asyncio.to_thread(fleet_env.cluster.list_nodes))
                await settle_repairs(client, repairs, step, timeout=30)
                step.largest_history = await largest_history(client)
                steps.append(step)
                print(f"  [{size} nodes: joined {step.joined} in {step.join_wall:.1f} s, {len(step.contain)} faults "
                      f"contained]", flush=True)
        finally:
            for proc in (host, worker):
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            if steps:  # a run cut short still prints the sizes it finished
                print_table(args, steps)


if __name__ == "__main__":
    run(main)
