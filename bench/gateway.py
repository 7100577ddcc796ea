"""The node gateway's cost, in one run on one dev server.

1. **A round trip through the gateway against one through a proxy that only forwards.** One
   activity round trip on a node queue (scheduled → dispatched to the node's agent → completed,
   from the server's own event times) on three sides: direct to the dev server, through
   ``bench.passthrough`` (mutual TLS as the gateway terminates it, every call forwarded as bytes,
   nothing checked: the floor any Python gRPC proxy pays) and through the gateway (the agent on
   mutual TLS with its own certificate), in turn in batches of 10 (the order rotates each batch,
   so drift in the dev server's load hits every side alike). Target: gateway p50 / pass-through
   p50 ≤ 1.15 in the worst run (``ROUND_TRIP_RATIO``: the issue's bound, once asked of gateway /
   direct and retired because the floor alone misses it). Printed beside it: gateway / direct,
   and the milliseconds each proxy adds per hop. A round trip crosses a proxy twice: the task
   goes out as the answer to the agent's held poll (server → proxy → agent) and the result
   comes back (agent → proxy → server); the poll request itself is already waiting upstream
   when the activity is scheduled. So the cost per hop is half the difference of the two
   sides' distributions in the same run (``(gateway p50 - direct p50) / 2``, the same for p99:
   the sides are separate samples, not pairs).
2. **One node's flood against another node's round trips** (issue 35). A victim node's agent
   (the SDK's Worker, one poller) runs the round trips of part 1 through the gateway while an
   attacker node, in a process of its own (``bench.flood_attacker``), holds ``--flood-polls``
   long polls and ``--flood-big`` polls of 3 MB; the attack is switched on and off between short
   batches (quiet-attacked, then attacked-quiet, ...), so the quiet batches are the baseline
   measured in the same run. Target: the victim's p99 attacked / quiet ≤ 1.2 (the issue's
   20%), and every round trip of every batch done (a starved node's batch never ends: it is
   given ``--flood-batch-seconds`` and counted). Printed beside it: the attacker's calls the
   gateway held over its limits (its per-node bound, ``HELD_CALLS_PER_NODE``, when the attack
   is on) and its resident memory.
3. **CPU per 1,000 nodes in the steady mix.** ``--idle`` idle nodes (default 1,250) each
   hold what an idle node agent holds through the gateway: one long poll on its queue, renewed
   whenever the server answers it empty, and its health watch (``watch_node``, a long-running
   activity): a heartbeat every ``--heartbeat-seconds`` (300: half the watch's heartbeat timeout,
   ``workflows/node.py``'s ``WATCH_LONG_HEARTBEAT``) and a result every ``--watch-seconds``
   (1,800: ``WATCH_LONG_WAIT``), after which the next watch arrives on the held poll. Each node
   starts its watch at a random age (nodes join at different times). The gateway process's CPU
   seconds (``/proc/<pid>/stat``) over ``--window`` seconds (default 120: every held poll is
   answered and renewed about once a minute, so a window spans at least one renewal of each)
   are divided by the window and scaled to 1,000 nodes. The node side here is a small raw-gRPC
   emulation of the agent's calls (``STEADY_HOLDER``: running 1,250 SDK workers would take the
   machine from the gateway being measured), with the SDK's keepalive pings (every 30 s), and the watches are a bench workflow's
   activities, not Node entities (those would add their own start-up work to the window);
   the gateway does its full work on every call (certificate, liveness, limits, rebuilt
   request). The calls counted in the window are printed. Target: ≤ 0.15 core per 1,000 nodes.
4. Fault reported → contained (cordoned), as in bench/repair_latency, with every node agent
   (the sim host, in its own process) behind the gateway and the idle nodes of part 3 still
   holding their polls and watches through it: target p99 < 500 ms. The fault is injected into
   the simulated GPU; the node's ``watch_node`` pulls it. The gateway's resident memory is
   printed.

The gateway runs in its own process (``python -m workers.node_gateway``), as deployed;
``--profile FILE`` runs it under cProfile.

    python -m bench.gateway [--samples 400] [--runs 1] [--part all|round-trip|flood|steady|contain]
                            [--flood-rounds 16] [--flood-batch 20] [--flood-polls 1300] [--flood-big 40]
                            [--idle 1250] [--window 120] [--faults 30] [--profile gateway.prof]
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Optional

import typer

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum, UnsandboxedWorkflowRunner, Worker

from bench.common import bench_env, command_line, fleet, bench_args, run, pct, peak_rss_mb, proc_cpu, rss_mb
from bench.repair_latency import repair_result
from cli.dev import wait_for_port
from workers.gateway.proxy import HELD_CALLS_PER_NODE
from workers.node_agent import connect_via_gateway
from workers.gateway.node_identity import GatewayAccess
from workers.gateway.pki import Pki, dev_gateway_files
from fleet.contracts import activities as act
from fleet.contracts import workflows as flows
from fleet.naming import node_queue, node_workflow_id

ROOT = Path(__file__).resolve().parent.parent


@activity.defn(name="noop")
async def noop(seq: int) -> int:
    return seq


@workflow.defn(name="GatewayRoundTrips", sandboxed=False)
class RoundTrips:
    @workflow.run
    async def run(self, args: list) -> int:
        queue, count = args
        for i in range(count):
            await workflow.execute_activity(noop, i, task_queue=queue, start_to_close_timeout=timedelta(seconds=30))
        return count


@workflow.defn(name="GatewaySteadyWatch", sandboxed=False)
class SteadyWatch:
    """An idle node's health watch, one after another on its queue, as its Node entity runs it."""

    @workflow.run
    async def run(self, args: list) -> None:
        queue, watch_seconds, heartbeat_seconds = args
        while True:
            await workflow.execute_activity(
                act.watch_node, queue, task_queue=queue, start_to_close_timeout=timedelta(seconds=3 * watch_seconds),
                heartbeat_timeout=timedelta(seconds=2 * heartbeat_seconds))


async def round_trips(client: Client, control_queue: str, queue: str, count: int,
                      within: float | None = None) -> list[float]:
    """Activity round trips (ActivityTaskScheduled → ActivityTaskCompleted), seconds. ``within``:
    the rest are given up after that many seconds (the workflow terminated) and only those done
    are returned, so a starved node shows as a count short of ``count``."""
    handle = await client.start_workflow(RoundTrips.run, [queue, count], id=f"rt-{uuid.uuid4().hex[:8]}",
                                         task_queue=control_queue)
    try:
        await asyncio.wait_for(handle.result(), within)
    except asyncio.TimeoutError:
        await handle.terminate(f"{count} round trips not done in {within:g} s")
    scheduled, out = {}, []
    async for event in handle.fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            scheduled[event.event_id] = event.event_time.ToNanoseconds()
        elif event.HasField("activity_task_completed_event_attributes"):
            started_from = event.activity_task_completed_event_attributes.scheduled_event_id
            out.append((event.event_time.ToNanoseconds() - scheduled[started_from]) / 1e9)
    return out



@dataclass
class RoundTripRun:
    """One run's round trips, seconds, on each side: direct to the server, through a proxy that
    only forwards (``bench.passthrough``), through the gateway."""

    direct: list[float]
    passthrough: list[float]
    gateway: list[float]

    def percentile(self, side: str, p: float) -> float:
        values = getattr(self, side)
        return statistics.median(values) if p == 50 else pct(values, p)


async def compare_round_trips(client: Client, settings, access: GatewayAccess, passthrough: GatewayAccess, pki: Pki,
                              control_queue: str, samples: int) -> RoundTripRun:
    """``samples`` round trips each way, the three sides in turn in batches of 10 (the order
    rotating each batch) after a warm-up each."""
    suffix = uuid.uuid4().hex[:6]
    direct_name, pass_name, gw_name = f"rt-direct-{suffix}", f"rt-pass-{suffix}", f"rt-gw-{suffix}"
    await client.start_workflow(flows.Node.TYPE, {"node_name": gw_name}, id=node_workflow_id(gw_name), task_queue="nobody")
    cert, key = enrol_sim_node(settings, gw_name, pki)  # what the gateway's liveness check asks for
    node_client = await connect_via_gateway(access, settings.namespace, cert, key)
    pass_client = await connect_via_gateway(passthrough, settings.namespace, *pki.node_credentials(pass_name))
    # The direct agent gets a connection of its own too: sharing the control plane's (busy with
    # the workflow worker's polls and the bench's own calls) would handicap the direct side.
    direct_client = await Client.connect(settings.address, namespace=settings.namespace,
                                         data_converter=client.data_converter)
    one = dict(activities=[noop], activity_task_poller_behavior=PollerBehaviorSimpleMaximum(1))
    run = RoundTripRun([], [], [])
    try:
        async with Worker(client, task_queue=control_queue, workflows=[RoundTrips],
                          workflow_runner=UnsandboxedWorkflowRunner()), \
                Worker(direct_client, task_queue=node_queue(direct_name), **one), \
                Worker(pass_client, task_queue=node_queue(pass_name), **one), \
                Worker(node_client, task_queue=node_queue(gw_name), **one):
            sides = [(run.direct, direct_name), (run.passthrough, pass_name), (run.gateway, gw_name)]
            for _, name in sides:  # warm-up
                await round_trips(client, control_queue, node_queue(name), 10)
            batch = 10
            for i in range(max(1, samples // batch)):
                for out, name in sides[i % 3:] + sides[:i % 3]:
                    out += await round_trips(client, control_queue, node_queue(name), batch)
    finally:
        await client.get_workflow_handle(node_workflow_id(gw_name)).terminate("bench over")
    return run


def start_passthrough(settings, files: dict, port: int) -> subprocess.Popen:
    """``bench.passthrough`` on ``port`` with the gateway's certificate and client CA."""
    proxy = subprocess.Popen([sys.executable, "-m", "bench.passthrough", f"127.0.0.1:{port}", settings.address,
                              str(files["cert"]), str(files["key"]), str(files["ca"])],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proxy.stdout.readline().strip() == "ready", "bench.passthrough did not start"
    return proxy


def enrol_sim_node(settings, name: str, pki: Pki, env=None) -> tuple[bytes, bytes]:
    """A node the gateway takes as joined, in the sim cluster, and its (certificate, key): its
    Node registered with a node-bound token (a kubelet's TLS bootstrap), its identity record
    written (the join's ``await_registration``), and the certificate's key bound to it (the
    cluster's CSR approver): the gateway's liveness asks all three, and the Node entity."""
    from activities.env import FleetEnv
    from fleet.cluster import NODE_IDENTITY_KIND, NodeIdentity
    from workers.node_agent import cert_key_fingerprint

    env = env or FleetEnv.from_settings(settings)
    machine = f"m-{name}"
    env.cluster.create_join_token(name, machine, 600)
    token = env.world.query("SELECT token FROM bootstrap WHERE machine_id=?", machine)[0]["token"]
    env.cluster.register_with_token(machine, token, "boot-1", 8)
    identity = NodeIdentity(node_name=name, machine_id=machine, provider="sim", account="bench", site="bench")
    env.cluster.update_state(NODE_IDENTITY_KIND, name, lambda _old: identity.state())
    cert, key = pki.node_credentials(name)
    assert env.cluster.bind_client_key(name, machine, cert_key_fingerprint(cert)), name
    return cert, key


# -- one node's flood, another node's round trips --------------------------------------------
def gateway_limits(metrics: str) -> dict[str, float]:
    """From the gateway's ``/metrics`` at ``metrics`` (host:port): the polls it forwards and holds
    now, the calls it holds for nodes over their limits now, and the calls over limits (held or
    refused) since it started."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    page = httpx.get(f"http://{metrics}/metrics", timeout=5).text
    samples = {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples}
    return {"polls": samples.get("gpufleet_gateway_held_polls", 0.0),
            "over_limits": samples.get("gpufleet_gateway_held_over_limits", 0.0),
            "limited": samples.get("gpufleet_gateway_limited_total", 0.0)}


def start_attacker(access: GatewayAccess, folder, name: str, polls: int, big: int) -> subprocess.Popen:
    """``bench.flood_attacker`` as node ``name`` (its ``name.pem`` and ``name.key`` and the
    gateway's ``ca.pem`` in ``folder``), waiting for ``on``."""
    return subprocess.Popen(
        [sys.executable, "-m", "bench.flood_attacker", access.address, str(folder / "ca.pem"),
         str(folder / f"{name}.pem"), str(folder / f"{name}.key"), name, "--polls", str(polls), "--big", str(big)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


async def switch_attack(attack: subprocess.Popen, metrics: str, on: bool) -> float:
    """Switch the attack on (each of its calls over its limits held at the gateway, or refused
    beyond what the gateway holds of a node) or off (every call gone); how many calls of it the
    gateway holds once that has settled."""
    attack.stdin.write("on\n" if on else "off\n")
    attack.stdin.flush()
    answer = await asyncio.to_thread(attack.stdout.readline)
    assert answer.startswith("holding" if on else "quiet"), answer
    deadline = asyncio.get_running_loop().time() + 20
    before = None
    while True:
        now = await asyncio.to_thread(gateway_limits, metrics)
        # Off: the victim's own poll, and at most a couple of the attacker's that the gateway has
        # not yet seen cancelled (each ends within its deadline anyway). On: as many held as the
        # gateway holds of one node, and the burst of calls the attacker sent all judged (no more
        # counted over limits since the last look).
        settled = before is not None and now["limited"] == before["limited"]
        if (settled and now["over_limits"] >= HELD_CALLS_PER_NODE) if on \
                else (now["polls"] + now["over_limits"] <= 3):
            return now["over_limits"]
        assert asyncio.get_running_loop().time() < deadline, f"attack {'on' if on else 'off'}: {now}"
        before = now
        await asyncio.sleep(0.25 if on else 0.1)


@dataclass
class Flood:
    """The victim's round trips, each batch's, with the attack off and on."""

    batch: int
    quiet: list[list[float]] = field(default_factory=list)
    attacked: list[list[float]] = field(default_factory=list)
    #: The most of the attacker's calls the gateway held over limits, at any switch on.
    most_held: float = 0.0

    def times(self, side: str) -> list[float]:
        """Every round trip done on one side, ``quiet`` or ``attacked``, seconds."""
        return [t for batch in getattr(self, side) for t in batch]

    def done(self, side: str) -> tuple[int, int]:
        """(round trips done, asked) on one side, ``quiet`` or ``attacked``."""
        batches = getattr(self, side)
        return sum(map(len, batches)), self.batch * len(batches)


async def alternate(client: Client, agent: Client, queue: str, attack: subprocess.Popen, metrics: str,
                    rounds: int, batch: int, batch_seconds: float) -> Flood:
    """``rounds`` pairs of batches of the victim's round trips on ``queue`` (its agent connected
    through the gateway as ``agent``), the attack off then on, then on then off, ...: load from
    anything else on the machine falls on both sides alike. A batch not done in
    ``batch_seconds`` is counted short. The attack is off when it returns."""
    flood = Flood(batch)
    control_queue = f"flood-{uuid.uuid4().hex[:6]}"
    async with Worker(client, task_queue=control_queue, workflows=[RoundTrips],
                      workflow_runner=UnsandboxedWorkflowRunner()), \
            Worker(agent, task_queue=queue, activities=[noop],
                   activity_task_poller_behavior=PollerBehaviorSimpleMaximum(1)):
        await round_trips(client, control_queue, queue, 10)  # warm-up
        for i in range(rounds):
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                flood.most_held = max(flood.most_held, await switch_attack(attack, metrics, on))
                done = await round_trips(client, control_queue, queue, batch, within=batch_seconds)
                (flood.attacked if on else flood.quiet).append(done)
        await switch_attack(attack, metrics, False)
    return flood


async def flood_through(client: Client, settings, access: GatewayAccess, pki: Pki, metrics: str, args) -> Flood:
    """Part 2 on the bench's own gateway: a victim and an attacker enrolled as joined nodes."""
    folder = settings.state_dir / "flood"
    folder.mkdir()
    (folder / "ca.pem").write_bytes(pki.ca_pem)
    victim, attacker = f"victim-{uuid.uuid4().hex[:6]}", f"attacker-{uuid.uuid4().hex[:6]}"
    credentials = {}
    for name in (victim, attacker):
        await client.start_workflow(flows.Node.TYPE, {"node_name": name}, id=node_workflow_id(name),
                                    task_queue="nobody")
        credentials[name] = enrol_sim_node(settings, name, pki)
    cert, key = credentials[attacker]
    (folder / f"{attacker}.pem").write_bytes(cert)
    (folder / f"{attacker}.key").write_bytes(key)
    agent = await connect_via_gateway(access, settings.namespace, *credentials[victim])
    attack = start_attacker(access, folder, attacker, args.flood_polls, args.flood_big)
    try:
        return await alternate(client, agent, node_queue(victim), attack, metrics, args.flood_rounds,
                               args.flood_batch, args.flood_batch_seconds)
    finally:
        attack.kill()
        attack.wait(10)
        for name in (victim, attacker):
            await client.get_workflow_handle(node_workflow_id(name)).terminate("bench over")


@dataclass
class Figures:
    runs: list[RoundTripRun] = field(default_factory=list)
    #: CPU seconds the gateway used in the window, and the calls the idle nodes made in it
    steady_cpu: float | None = None
    steady_calls: dict = field(default_factory=dict)
    contain: list[float] = field(default_factory=list)
    held_rss: float = float("nan")
    flood: Flood | None = None
    flood_rss: float = float("nan")


#: Targets (issue 35). A round trip through the gateway against one through a proxy that only
#: forwards (``bench.passthrough``), p50, in the worst run: the issue's bound of 1.15, once asked
#: of gateway / direct and retired because a pass-through Python gRPC proxy already misses it
#: (docs/benchmarks.md), now asked of what the gateway adds over that floor: its checks, limits
#: and rebuilt requests.
ROUND_TRIP_RATIO = 1.15
#: Another node's round-trip p99 with one node flooding, against the same run's quiet batches:
#: at most 20% more (the issue's bound).
FLOOD_P99_RATIO = 1.2
CORES_PER_1000_NODES = 0.15


def per_hop_ms(d: float, g: float) -> float:
    """Milliseconds the gateway adds per hop: a round trip crosses it twice."""
    return (g - d) / 2 * 1000


def round_trip_verdict(runs: list[RoundTripRun]) -> tuple[float, bool]:
    """The worst run's gateway p50 / pass-through p50, and whether it meets ``ROUND_TRIP_RATIO``."""
    worst = max(run.percentile("gateway", 50) / run.percentile("passthrough", 50) for run in runs)
    return worst, worst <= ROUND_TRIP_RATIO


def flood_verdict(flood: Flood) -> tuple[float, bool]:
    """The victim's p99 attacked / quiet, and whether the target is met: that ratio within
    ``FLOOD_P99_RATIO`` and every round trip of every batch done on both sides (a round trip
    never done has no time; a batch cut short is a starved node whatever its p99 says)."""
    quiet, attacked = flood.times("quiet"), flood.times("attacked")
    if not quiet or not attacked:
        return float("nan"), False
    ratio = pct(attacked, 99) / pct(quiet, 99)
    everything = all(done == asked for done, asked in (flood.done("quiet"), flood.done("attacked")))
    return ratio, everything and ratio <= FLOOD_P99_RATIO


def report(args, figures: Figures) -> None:
    ms = lambda v: f"{v * 1000:7.2f} ms"  # noqa: E731
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    if figures.runs:
        print(f"activity round trip on a node queue, {args.samples} each way per run, the three sides in turn in "
              f"batches of 10 (server event times)")
        print(f"  {'run':>4s}{'direct p50':>14s}{'p99':>11s}{'pass-through p50':>19s}{'p99':>11s}"
              f"{'gateway p50':>14s}{'p99':>11s}")
        for i, run in enumerate(figures.runs, 1):
            print(f"  {i:4d}   {ms(run.percentile('direct', 50))} {ms(run.percentile('direct', 99))}        "
                  f"{ms(run.percentile('passthrough', 50))} {ms(run.percentile('passthrough', 99))}   "
                  f"{ms(run.percentile('gateway', 50))} {ms(run.percentile('gateway', 99))}")
        ratio, ok = round_trip_verdict(figures.runs)
        print(f"  round trip through the gateway / through the pass-through proxy, p50, worst run: {ratio:.2f} "
              f"(target <= {ROUND_TRIP_RATIO:g}: {met(ok)})")
        direct_ratio = max(run.percentile("gateway", 50) / run.percentile("direct", 50) for run in figures.runs)
        print(f"  round trip through the gateway / direct, p50, worst run: {direct_ratio:.2f}")
        for side, name in (("gateway", "gateway"), ("passthrough", "pass-through proxy")):
            worst50 = max(per_hop_ms(run.percentile("direct", 50), run.percentile(side, 50)) for run in figures.runs)
            worst99 = max(per_hop_ms(run.percentile("direct", 99), run.percentile(side, 99)) for run in figures.runs)
            print(f"  {name} adds per hop (half the round trip's difference from direct), worst run: "
                  f"p50 {worst50:.2f} ms, p99 {worst99:.2f} ms")
    if figures.flood is not None:
        flood = figures.flood
        quiet, attacked = flood.times("quiet"), flood.times("attacked")
        ratio, ok = flood_verdict(flood)
        (quiet_done, quiet_asked), (attacked_done, attacked_asked) = flood.done("quiet"), flood.done("attacked")
        print(f"flood: one node holding {args.flood_polls} polls and {args.flood_big} of 3 MB through the gateway, "
              f"another node's round trips in {args.flood_rounds} pairs of batches of {args.flood_batch}, "
              f"the attack off and on")
        print(f"  round trips done: quiet {quiet_done} of {quiet_asked}, attacked {attacked_done} of {attacked_asked}")
        if quiet and attacked:
            print(f"  victim round trip p50 {ms(statistics.median(quiet))} quiet, {ms(statistics.median(attacked))} "
                  f"attacked; p99 {ms(pct(quiet, 99))} quiet, {ms(pct(attacked, 99))} attacked")
        print(f"  ratio attacked / quiet p99: {ratio:.2f} (target <= {FLOOD_P99_RATIO:g}, every round trip done: "
              f"{met(ok)})")
        print(f"  gateway held {flood.most_held:.0f} of the attacker's calls over its limits (its bound per node: "
              f"{HELD_CALLS_PER_NODE}); resident memory {figures.flood_rss:.0f} MB")
    if figures.steady_cpu is not None:
        cores = figures.steady_cpu / args.window
        per_1000 = cores * 1000 / args.idle
        calls = figures.steady_calls
        print(f"steady mix: {args.idle} idle nodes through the gateway (a held poll and a health watch each: "
              f"a heartbeat every {args.heartbeat_seconds:g} s, a result every {args.watch_seconds:g} s), "
              f"{args.window:g} s window")
        print(f"  calls in the window: {calls.get('polls', 0)} polls answered, {calls.get('tasks', 0)} tasks, "
              f"{calls.get('heartbeats', 0)} heartbeats, {calls.get('results', 0)} results, "
              f"{calls.get('errors', 0)} errors")
        print(f"  gateway CPU: {figures.steady_cpu:.2f} s in {args.window:g} s = {cores:.3f} core at {args.idle} "
              f"nodes; per 1,000 nodes: {per_1000:.3f} core (target <= {CORES_PER_1000_NODES:g}: "
              f"{met(per_1000 <= CORES_PER_1000_NODES)})")
    if figures.contain:
        contain = figures.contain
        print(f"fault reported -> contained, {args.faults} faults on {args.nodes} nodes behind the gateway, "
              f"{args.idle} idle nodes held")
        print(f"  p50 {ms(statistics.median(contain))}  p99 {ms(pct(contain, 99))}  "
              f"(target p99 < 500 ms: {met(pct(contain, 99) < 0.5)})")
        print(f"  gateway resident memory with {args.idle} idle nodes held: {figures.held_rss:.0f} MB")


STEADY_HOLDER = r'''
"""Idle node agents, as the gateway sees them: one long poll held on node/<name> at all times
(renewed when the server answers it empty), and the health watch each holds: a heartbeat every
HEARTBEAT_EVERY seconds and a result every WATCH_SECONDS, at a random phase per node (nodes join
at different times). Counts its calls; prints them when asked on stdin."""
import asyncio, json, random, sys, grpc
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import (PollActivityTaskQueueRequest, PollActivityTaskQueueResponse,
    RecordActivityTaskHeartbeatRequest, RespondActivityTaskCompletedRequest)
address, ca, folder, count = sys.argv[1], open(sys.argv[2], "rb").read(), sys.argv[3], int(sys.argv[4])
HEARTBEAT_EVERY, WATCH_SECONDS = float(sys.argv[5]), float(sys.argv[6])
SERVICE = "/temporal.api.workflowservice.v1.WorkflowService/"
calls = {"polls": 0, "tasks": 0, "heartbeats": 0, "results": 0, "errors": 0}
def json_payloads(value):
    return Payloads(payloads=[Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(value).encode())])
async def watch(name, call, token, first):
    # The watch started ``age`` seconds ago (its node joined then): its beats fall on multiples of
    # HEARTBEAT_EVERY from its start, its result at WATCH_SECONDS.
    age = random.uniform(0, WATCH_SECONDS) if first else 0.0
    beat = call("RecordActivityTaskHeartbeat")
    done = call("RespondActivityTaskCompleted")
    at = age
    while True:
        next_beat = (int(at // HEARTBEAT_EVERY) + 1) * HEARTBEAT_EVERY
        if next_beat >= WATCH_SECONDS:
            break
        await asyncio.sleep(next_beat - at)
        at = next_beat
        try:
            await beat(RecordActivityTaskHeartbeatRequest(task_token=token, namespace="default", identity=name,
                                                          details=json_payloads(1)).SerializeToString(), timeout=30)
            calls["heartbeats"] += 1
        except grpc.aio.AioRpcError:
            calls["errors"] += 1
    await asyncio.sleep(WATCH_SECONDS - at)
    gpus = [{"index": i, "uuid": f"GPU-{name}-{i}", "healthy": True, "xids": [], "ecc_uncorrected": 0,
             "temperature_c": 41, "lost": False} for i in range(8)]
    result = {"node_name": name, "seq": 1, "digest": "0" * 64, "boot_id": "b" * 32, "gpus": gpus,
              "reclaim_at": None, "observed_at": 0.0}
    try:
        await done(RespondActivityTaskCompletedRequest(task_token=token, namespace="default", identity=name,
                                                       result=json_payloads(result)).SerializeToString(), timeout=30)
        calls["results"] += 1
    except grpc.aio.AioRpcError:
        calls["errors"] += 1
async def node(i, watches):
    name = f"idle-{i}"
    creds = grpc.ssl_channel_credentials(ca, open(f"{folder}/{name}.key", "rb").read(),
                                         open(f"{folder}/{name}.pem", "rb").read())
    # HTTP/2 keepalive pings as the SDK's agent sends them (temporalio KeepAliveConfig.default:
    # every 30 s, 15 s to answer): the gateway answers each one, and that is part of its CPU.
    channel = grpc.aio.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", "localhost"),
                                                               ("grpc.use_local_subchannel_pool", 1),
                                                               ("grpc.keepalive_time_ms", 30_000),
                                                               ("grpc.keepalive_timeout_ms", 15_000)])
    call = lambda method: channel.unary_unary(SERVICE + method, request_serializer=None,  # noqa: E731
                                              response_deserializer=None)
    poll = call("PollActivityTaskQueue")
    request = PollActivityTaskQueueRequest(namespace="default", task_queue=TaskQueue(name=f"node/{name}"),
                                           identity=name).SerializeToString()
    first = True
    while True:
        try:
            response = await poll(request, timeout=70)
            calls["polls"] += 1
        except grpc.aio.AioRpcError as error:
            calls["errors"] += 1
            if error.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                print(name, error.code(), error.details(), file=sys.stderr, flush=True)
                await asyncio.sleep(5)
            continue
        token = PollActivityTaskQueueResponse.FromString(response).task_token
        if token:
            calls["tasks"] += 1
            watches.add(task := asyncio.create_task(watch(name, call, token, first)))
            task.add_done_callback(watches.discard)
            first = False
async def main():
    tasks, watches = [], set()
    for i in range(count):
        tasks.append(asyncio.create_task(node(i, watches)))
        if i % 50 == 49:
            await asyncio.sleep(0.05)
    while calls["tasks"] < count:  # every node holds its watch
        await asyncio.sleep(0.1)
    print("holding", flush=True)
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.readline():
        print(json.dumps(calls), flush=True)
asyncio.run(main())
'''


async def holder_calls(holder: subprocess.Popen) -> dict:
    """The idle nodes' call counts so far (the holder answers a line on stdin with its counts)."""
    holder.stdin.write("count\n")
    holder.stdin.flush()
    return json.loads(await asyncio.to_thread(holder.stdout.readline))


async def main(args) -> None:
    figures = Figures()
    config = fleet(sites=5, capacity=max(args.nodes, 5))
    config["repair"] = {"timeouts": {"drain_seconds": 1, "smoke_test_seconds": 10, "heartbeat_seconds": 5}}
    config["incident"] = {"settle_seconds": 0, "enabled": False}
    children: list[subprocess.Popen] = []
    async with bench_env(config) as (env, settings), AsyncExitStack() as stack:
        client = env.client
        files = dev_gateway_files(settings.state_dir)
        pki = Pki.load_or_create(files["ca"].parent)
        gateway_port = 17300 + os.getpid() % 1000
        child_env = {**os.environ, **settings.env()}
        profiler = ["-m", "cProfile", "-o", args.profile] if args.profile else []
        metrics = f"127.0.0.1:{gateway_port + 1000}"  # the flood part reads what it holds over limits
        gateway = subprocess.Popen([sys.executable, *profiler, "-m", "workers.node_gateway", "--dev", "--listen",
                                    f"127.0.0.1:{gateway_port}", "--metrics-port", str(gateway_port + 1000)],
                                   env=child_env)
        children.append(gateway)
        wait_for_port(gateway_port)
        access = GatewayAccess(f"127.0.0.1:{gateway_port}", pki.ca_pem)
        control_queue = f"{settings.task_queue}-rt"
        try:
            # -- 1. round trips, interleaved ---------------------------------------------------
            if args.part in ("all", "round-trip"):
                passthrough_port = gateway_port + 2000
                children.append(start_passthrough(settings, files, passthrough_port))
                passthrough = GatewayAccess(f"127.0.0.1:{passthrough_port}", pki.ca_pem)
                for _ in range(args.runs):
                    figures.runs.append(await compare_round_trips(client, settings, access, passthrough, pki,
                                                                  control_queue, args.samples))
            if args.part == "round-trip":
                return report(args, figures)

            # -- 2. one node's flood, another node's round trips ---------------------------------
            if args.part in ("all", "flood"):
                figures.flood = await flood_through(client, settings, access, pki, metrics, args)
                figures.flood_rss = peak_rss_mb(gateway.pid)
            if args.part == "flood":
                return report(args, figures)

            # -- 3. the steady mix: idle nodes, each a held poll and a health watch ----------------
            idle_dir = settings.state_dir / "idle"
            idle_dir.mkdir()
            from activities.env import FleetEnv

            sim = FleetEnv.from_settings(settings)
            await stack.enter_async_context(Worker(client, task_queue=control_queue, workflows=[SteadyWatch],
                                                   workflow_runner=UnsandboxedWorkflowRunner()))
            starts = []
            for i in range(args.idle):
                name = f"idle-{i}"
                cert, key = enrol_sim_node(settings, name, pki, sim)
                (idle_dir / f"{name}.pem").write_bytes(cert)
                (idle_dir / f"{name}.key").write_bytes(key)
                # The gateway's liveness asks for a running Node entity (here one no worker runs).
                starts.append(client.start_workflow(flows.Node.TYPE, {"node_name": name}, id=node_workflow_id(name),
                                                    task_queue="nobody"))
                starts.append(client.start_workflow(
                    SteadyWatch.run, [node_queue(name), args.watch_seconds, args.heartbeat_seconds],
                    id=f"watch/{name}", task_queue=control_queue))
                if len(starts) >= 100:
                    await asyncio.gather(*starts)
                    starts = []
            await asyncio.gather(*starts)
            holder = subprocess.Popen([sys.executable, "-c", STEADY_HOLDER, access.address, str(files["ca"]),
                                       str(idle_dir), str(args.idle), str(args.heartbeat_seconds),
                                       str(args.watch_seconds)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            children.append(holder)
            ready = await asyncio.wait_for(asyncio.to_thread(holder.stdout.readline), 300)
            assert ready.strip() == "holding", f"the idle nodes did not get their watches: {ready!r}"
            await asyncio.sleep(5)  # every idle node's poll renewed and reached the server
            if args.part in ("all", "steady"):
                before_calls, before_cpu = await holder_calls(holder), proc_cpu(gateway.pid)
                await asyncio.sleep(args.window)
                figures.steady_cpu = proc_cpu(gateway.pid) - before_cpu
                after_calls = await holder_calls(holder)
                figures.steady_calls = {k: after_calls[k] - before_calls[k] for k in after_calls}
            if args.part == "steady":
                figures.held_rss = rss_mb(gateway.pid)
                return report(args, figures)

            # -- 4. fault → contained with the idle nodes held -----------------------------------
            from workers.control_plane import build_worker

            host_env = {**child_env, "GPUFLEET_GATEWAY": access.address, "GPUFLEET_GATEWAY_CA": str(files["ca"]),
                        "GPUFLEET_SIM_SIGNER_DIR": str(files["ca"].parent), "GPUFLEET_HEALTH_SECONDS": "5"}
            host = subprocess.Popen([sys.executable, "-m", "workers.node_agent", "--sim", "--poll-seconds", "0.02"],
                                    env=host_env)
            children.append(host)
            cluster, world = sim.cluster, sim.world
            async with build_worker(client, settings):
                joins = [client.execute_workflow(flows.NodeJoin.TYPE, {"site": f"site-{i % 5}"},
                                                 id=f"join/site-{i % 5}/{uuid.uuid4().hex[:8]}",
                                                 task_queue=settings.task_queue) for i in range(args.nodes)]
                nodes = [r["nodes"][0] for r in await asyncio.gather(*joins)]
                await asyncio.sleep(2.0)  # every Node entity's first watch answered
                figures.held_rss = rss_mb(gateway.pid)
                for i in range(args.faults):
                    node = nodes[i % len(nodes)]
                    gpu = (i // len(nodes)) % node["gpus"]
                    name, machine_id = node["node_name"], node["machine_id"]
                    start = time.perf_counter()
                    await asyncio.to_thread(world.inject_fault, machine_id, gpu, "xid", 48, clears_on="reset")
                    while not await asyncio.to_thread(lambda: cluster.get_node(name).unschedulable):
                        await asyncio.sleep(0.005)
                    figures.contain.append(time.perf_counter() - start)
                    result = await repair_result(client, f"repair/{name}/gpu{gpu}")
                    assert result["outcome"] == "repaired", result
                    while await asyncio.to_thread(lambda: cluster.get_node(name).unschedulable):
                        await asyncio.sleep(0.01)
        finally:
            for child in reversed(children):
                child.terminate()
                try:
                    child.wait(15)
                except subprocess.TimeoutExpired:
                    child.kill()
    report(args, figures)


class Part(str, enum.Enum):
    """``--part``: which of the four measurements (all: every one)."""

    all = "all"
    round_trip = "round-trip"
    flood = "flood"
    steady = "steady"
    contain = "contain"


def cli(
    samples: Annotated[int, typer.Option(help="round trips each way, per run")] = 400,
    runs: Annotated[int, typer.Option(help="repeat the round-trip comparison")] = 1,
    part: Annotated[Part, typer.Option()] = Part.all,
    flood_rounds: Annotated[int, typer.Option(help="pairs of the victim's batches, the attack off and on")] = 16,
    flood_batch: Annotated[int, typer.Option(help="the victim's round trips per batch")] = 20,
    flood_batch_seconds: Annotated[float, typer.Option(
        help="a batch not done by then is counted short (a batch takes about a second)")] = 60.0,
    flood_polls: Annotated[int, typer.Option(help="long polls the attacker holds")] = 1300,
    flood_big: Annotated[int, typer.Option(help="3 MB polls the attacker keeps in flight")] = 40,
    idle: Annotated[int, typer.Option(help="idle nodes holding a poll and a watch")] = 1250,
    window: Annotated[float, typer.Option(help="seconds the steady mix's CPU is measured")] = 120.0,
    heartbeat_seconds: Annotated[float, typer.Option(help="an idle watch's heartbeat interval")] = 300.0,
    watch_seconds: Annotated[float, typer.Option(help="an idle watch's length")] = 1800.0,
    faults: Annotated[int, typer.Option()] = 30,
    nodes: Annotated[int, typer.Option()] = 10,
    profile: Annotated[Optional[str], typer.Option(
        help="run the gateway under cProfile, writing its stats here")] = None,
) -> None:
    args = bench_args({**locals(), "part": part.value})
    run(lambda: main(args))


if __name__ == "__main__":
    command_line(cli, __doc__)
