"""The node gateway's cost, in one run on one dev server.

1. One activity round trip on a node queue (scheduled → dispatched to the node's agent
   → completed, from the server's own event times), through the gateway (the agent on
   mutual TLS with its own certificate) and direct to the dev server, interleaved:
   target ratio p50 gateway / direct ≤ 1.15.
2. Fault reported → contained (cordoned), as in bench/repair_latency, with every node
   agent (the sim host, in its own process) behind the gateway and 1,250 idle nodes
   holding a long poll open through it: target p99 < 500 ms. The fault is injected into
   the simulated GPU; the node's ``watch_node`` pulls it. The gateway's resident memory
   with the polls held is printed.

The gateway runs in its own process (``python -m workers.node_gateway``), as deployed.

Fairness of part 1: both agents are the same ``Worker`` (one activity poller, one
connection of its own each, neither shared with the workflow worker), both are warmed
up, and the two sides alternate in short batches so drift in the dev server's load
hits both alike. ``--runs`` repeats part 1 and prints every run's ratio.

    python -m bench.gateway [--samples 400] [--runs 1] [--part all|round-trip|contain]
                            [--faults 30] [--idle 1250] [--profile gateway.prof]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum, UnsandboxedWorkflowRunner, Worker

from bench.common import bench_env, fleet, run, pct, rss_mb
from bench.repair_latency import repair_result
from cli.dev import wait_for_port
from workers.node_agent import connect_via_gateway
from workers.node_gateway import GatewayAccess, Pki, dev_gateway_files



@activity.defn(name="noop")
async def noop(seq: int) -> int:
    return seq


@workflow.defn(name="GatewayRoundTrips", sandboxed=False)
class RoundTrips:
    @workflow.run
    async def run(self, args: list) -> int:
        queue, count = args
        for i in range(count):
            await workflow.execute_activity("noop", i, task_queue=queue, start_to_close_timeout=timedelta(seconds=30))
        return count


async def round_trips(client: Client, control_queue: str, queue: str, count: int) -> list[float]:
    """Activity round trips (ActivityTaskScheduled → ActivityTaskCompleted), seconds."""
    handle = await client.start_workflow("GatewayRoundTrips", [queue, count], id=f"rt-{uuid.uuid4().hex[:8]}",
                                         task_queue=control_queue)
    await handle.result()
    scheduled, out = {}, []
    async for event in handle.fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            scheduled[event.event_id] = event.event_time.ToNanoseconds()
        elif event.HasField("activity_task_completed_event_attributes"):
            started_from = event.activity_task_completed_event_attributes.scheduled_event_id
            out.append((event.event_time.ToNanoseconds() - scheduled[started_from]) / 1e9)
    return out



async def compare_round_trips(client: Client, settings, access: GatewayAccess, pki: Pki, control_queue: str,
                              samples: int) -> tuple[list[float], list[float]]:
    """``samples`` round trips each way, alternating in batches of 10 after a warm-up each."""
    direct_name, gw_name = f"rt-direct-{uuid.uuid4().hex[:6]}", f"rt-gw-{uuid.uuid4().hex[:6]}"
    await client.start_workflow("Node", {"node_name": gw_name}, id=f"node/{gw_name}", task_queue="nobody")
    cert, key = enrol_sim_node(settings, gw_name, pki)  # what the gateway's liveness check asks for
    node_client = await connect_via_gateway(access, settings.namespace, cert, key)
    # The direct agent gets a connection of its own too: sharing the control plane's (busy with
    # the workflow worker's polls and the bench's own calls) would handicap the direct side.
    direct_client = await Client.connect(settings.address, namespace=settings.namespace,
                                         data_converter=client.data_converter)
    one = dict(activities=[noop], activity_task_poller_behavior=PollerBehaviorSimpleMaximum(1))
    direct, through = [], []
    try:
        async with Worker(client, task_queue=control_queue, workflows=[RoundTrips],
                          workflow_runner=UnsandboxedWorkflowRunner()), \
                Worker(direct_client, task_queue=f"node/{direct_name}", **one), \
                Worker(node_client, task_queue=f"node/{gw_name}", **one):
            await round_trips(client, control_queue, f"node/{direct_name}", 10)  # warm-up
            await round_trips(client, control_queue, f"node/{gw_name}", 10)
            batch = 10
            for i in range(max(1, samples // batch)):
                sides = [(direct, direct_name), (through, gw_name)]
                for out, name in (sides if i % 2 == 0 else sides[::-1]):
                    out += await round_trips(client, control_queue, f"node/{name}", batch)
    finally:
        await client.get_workflow_handle(f"node/{gw_name}").terminate("bench over")
    return direct, through


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


def report(args, ratios: list[tuple[float, float, float, float]], contain: list[float], held_rss: float) -> None:
    ms = lambda v: f"{v * 1000:7.2f} ms"  # noqa: E731
    if ratios:
        print(f"activity round trip on a node queue, {args.samples} each way per run, alternating batches "
              f"(server event times)")
        print(f"  {'run':>4s}{'direct p50':>14s}{'p99':>11s}{'gateway p50':>14s}{'p99':>11s}{'ratio p50':>11s}")
        for i, (d50, d99, g50, g99) in enumerate(ratios, 1):
            print(f"  {i:4d}   {ms(d50)} {ms(d99)}   {ms(g50)} {ms(g99)}{g50 / d50:10.2f}")
        worst = max(g50 / d50 for d50, _, g50, _ in ratios)
        print(f"  ratio gateway / direct (p50), worst run: {worst:.2f}  "
              f"(target <= 1.15: {'met' if worst <= 1.15 else 'NOT met'})")
    if contain:
        print(f"fault reported -> contained, {args.faults} faults on {args.nodes} nodes behind the gateway, "
              f"{args.idle} idle polls held")
        print(f"  p50 {ms(statistics.median(contain))}  p99 {ms(pct(contain, 99))}  "
              f"(target p99 < 500 ms: {'met' if pct(contain, 99) < 0.5 else 'NOT met'})")
        print(f"  gateway resident memory with {args.idle} polls held: {held_rss:.0f} MB")


IDLE_HOLDER = r'''
import asyncio, sys, grpc
from temporalio.api.workflowservice.v1 import PollActivityTaskQueueRequest
from temporalio.api.taskqueue.v1 import TaskQueue
address, ca, folder, count = sys.argv[1], open(sys.argv[2], "rb").read(), sys.argv[3], int(sys.argv[4])
async def hold(i):
    name = f"idle-{i}"
    creds = grpc.ssl_channel_credentials(ca, open(f"{folder}/{name}.key", "rb").read(),
                                         open(f"{folder}/{name}.pem", "rb").read())
    channel = grpc.aio.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", "localhost"),
                                                               ("grpc.use_local_subchannel_pool", 1)])
    poll = channel.unary_unary("/temporal.api.workflowservice.v1.WorkflowService/PollActivityTaskQueue",
                               request_serializer=None, response_deserializer=None)
    request = PollActivityTaskQueueRequest(namespace="default", task_queue=TaskQueue(name=f"node/{name}"),
                                           identity=name).SerializeToString()
    while True:
        try:
            await poll(request, timeout=70)
        except grpc.aio.AioRpcError as error:
            if error.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                print(name, error.code(), error.details(), flush=True)
                await asyncio.sleep(5)
async def main():
    tasks = []
    for i in range(count):
        tasks.append(asyncio.create_task(hold(i)))
        if i % 50 == 49:
            await asyncio.sleep(0.05)
    print("holding", flush=True)
    await asyncio.gather(*tasks)
asyncio.run(main())
'''


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=400, help="round trips each way, per run")
    parser.add_argument("--runs", type=int, default=1, help="repeat the round-trip comparison")
    parser.add_argument("--part", choices=["all", "round-trip", "contain"], default="all")
    parser.add_argument("--faults", type=int, default=30)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--idle", type=int, default=1250, help="idle nodes holding a poll open")
    parser.add_argument("--profile", help="run the gateway under cProfile, writing its stats here")
    args = parser.parse_args()
    ratios: list[tuple[float, float, float, float]] = []
    contain: list[float] = []
    held_rss = float("nan")
    config = fleet(sites=5, capacity=max(args.nodes, 5))
    config["repair"] = {"timeouts": {"drain_seconds": 1, "smoke_test_seconds": 10, "heartbeat_seconds": 5}}
    config["incident"] = {"settle_seconds": 0, "enabled": False}
    children: list[subprocess.Popen] = []
    async with bench_env(config) as (env, settings):
        client = env.client
        files = dev_gateway_files(settings.state_dir)
        pki = Pki.load_or_create(files["ca"].parent)
        gateway_port = 17300 + os.getpid() % 1000
        child_env = {**os.environ, **settings.env()}
        profiler = ["-m", "cProfile", "-o", args.profile] if args.profile else []
        gateway = subprocess.Popen([sys.executable, *profiler, "-m", "workers.node_gateway", "--dev", "--listen",
                                    f"127.0.0.1:{gateway_port}"], env=child_env)
        children.append(gateway)
        wait_for_port(gateway_port)
        access = GatewayAccess(f"127.0.0.1:{gateway_port}", pki.ca_pem)
        control_queue = f"{settings.task_queue}-rt"
        try:
            # -- 1. round trips, interleaved ---------------------------------------------------
            if args.part in ("all", "round-trip"):
                for _ in range(args.runs):
                    direct, through = await compare_round_trips(client, settings, access, pki, control_queue,
                                                                args.samples)
                    ratios.append((statistics.median(direct), pct(direct, 99),
                                   statistics.median(through), pct(through, 99)))
            if args.part == "round-trip":
                return report(args, ratios, contain, held_rss)

            # -- 2. fault → contained with idle polls held ---------------------------------------
            idle_dir = settings.state_dir / "idle"
            idle_dir.mkdir()
            starts = []
            from activities.env import FleetEnv

            sim = FleetEnv.from_settings(settings)
            for i in range(args.idle):
                name = f"idle-{i}"
                cert, key = enrol_sim_node(settings, name, pki, sim)
                (idle_dir / f"{name}.pem").write_bytes(cert)
                (idle_dir / f"{name}.key").write_bytes(key)
                starts.append(client.start_workflow("Node", {"node_name": name}, id=f"node/{name}", task_queue="nobody"))
                if len(starts) == 50:
                    await asyncio.gather(*starts)
                    starts = []
            await asyncio.gather(*starts)
            holder = subprocess.Popen([sys.executable, "-c", IDLE_HOLDER, access.address, str(files["ca"]),
                                       str(idle_dir), str(args.idle)], stdout=subprocess.PIPE, text=True)
            children.append(holder)
            assert holder.stdout.readline().strip() == "holding"
            await asyncio.sleep(5)  # every idle poll reached the server

            from activities.env import FleetEnv
            from workers.control_plane import build_worker

            host_env = {**child_env, "GPUFLEET_GATEWAY": access.address, "GPUFLEET_GATEWAY_CA": str(files["ca"]),
                        "GPUFLEET_SIM_SIGNER_DIR": str(files["ca"].parent), "GPUFLEET_HEALTH_SECONDS": "5"}
            host = subprocess.Popen([sys.executable, "-m", "workers.node_agent", "--sim", "--poll-seconds", "0.02"],
                                    env=host_env)
            children.append(host)
            fleet_env = FleetEnv.from_settings(settings)
            cluster, world = fleet_env.cluster, fleet_env.world
            async with build_worker(client, settings):
                joins = [client.execute_workflow("NodeJoin", {"site": f"site-{i % 5}"},
                                                 id=f"join/site-{i % 5}/{uuid.uuid4().hex[:8]}",
                                                 task_queue=settings.task_queue) for i in range(args.nodes)]
                nodes = [r["nodes"][0] for r in await asyncio.gather(*joins)]
                await asyncio.sleep(2.0)  # every Node entity's first watch answered
                held_rss = rss_mb(gateway.pid)
                for i in range(args.faults):
                    node = nodes[i % len(nodes)]
                    gpu = (i // len(nodes)) % node["gpus"]
                    name, machine_id = node["node_name"], node["machine_id"]
                    start = time.perf_counter()
                    await asyncio.to_thread(world.inject_fault, machine_id, gpu, "xid", 48, clears_on="reset")
                    while not await asyncio.to_thread(lambda: cluster.get_node(name).unschedulable):
                        await asyncio.sleep(0.005)
                    contain.append(time.perf_counter() - start)
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
    report(args, ratios, contain, held_rss)

if __name__ == "__main__":
    run(main)
