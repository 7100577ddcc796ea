"""50 concurrent NodeJoins vs a baseline of the same number of no-op activities.

Both run on the same dev server in the same process, alternating, so machine
noise hits both. NodeJoin runs 8 activities per node (resolve, provision,
token, wait for registration, label/taint, smoke test on the node's queue,
admit, revoke), started the way `gpufleet join` starts them (carrying their
site's search attributes); the baseline workflow runs 8 no-op activities. Each round runs
the baseline, then the joins: the ratio is taken per round (neighbours share
the machine's mood) and the median of those is reported.

    python -m bench.join_overhead [--nodes 50] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from temporalio.worker import Worker

from activities.env import FleetEnv
from fleet import search_attributes as sa
from fleet.naming import join_workflow_id
from bench.baseline import NoopSteps, NoopStepsWithMetadata, noop
from bench.common import bench_env, fleet, median, run, start_node_host, timed
from workers.control_plane import build_worker
from workers.workflow_runner import workflow_runner

ACTIVITIES_PER_JOIN = 8


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of another process (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def retire_all(env: FleetEnv) -> None:
    """Delete every machine and node, so agents do not pile up across rounds."""
    for node in env.cluster.list_nodes():
        env.cluster.remove_node(node.name)
    for machine in env.world.machines():
        env.provider(machine["site"]).delete_machine(machine["id"])


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    n = args.nodes
    config = fleet(sites=5, capacity=n * (args.rounds + 1))
    sites = config["sites"]
    async with bench_env(config) as (env, settings):
        client = env.client
        # The simulated nodes live in their own process, as under `gpufleet dev`.
        # Health reports off: each would start the node's Node entity, which is the
        # agent's work, not the join's (bench/repair_latency.py covers it).
        host = start_node_host(settings, health_seconds=0)
        baseline_queue = f"{settings.task_queue}-baseline"
        baseline_worker = Worker(client, task_queue=baseline_queue, workflows=[NoopSteps, NoopStepsWithMetadata], activities=[noop],
                                 workflow_runner=workflow_runner(client.data_converter),
                                 activity_executor=ThreadPoolExecutor(128), max_concurrent_activities=128)

        async def baseline(workflow=NoopSteps) -> None:
            await asyncio.gather(*[
                client.execute_workflow(workflow.run, ACTIVITIES_PER_JOIN, id=f"noop-{uuid.uuid4().hex}",
                                        task_queue=baseline_queue)
                for _ in range(n)
            ])

        async def baseline_with_metadata() -> None:
            await baseline(NoopStepsWithMetadata)

        async def join(site: dict) -> None:
            join_id = join_workflow_id(site["name"], uuid.uuid4().hex[:8])
            await client.execute_workflow(
                "NodeJoin", {"site": site["name"]}, id=join_id, task_queue=settings.task_queue,
                search_attributes=sa.join_start_attributes(site["name"], site["provider"], site["account"], join_id),
            )

        async def joins() -> None:
            await asyncio.gather(*[join(sites[i % len(sites)]) for i in range(n)])

        fleet_env = FleetEnv.from_settings(settings)
        base_times, meta_times, join_times, base_cpu, join_cpu, host_cpu = [], [], [], [], [], []
        async with build_worker(client, settings), baseline_worker:
            # Warm-up, both paths: connections, sandbox imports, the first agents' start.
            await baseline()
            await joins()
            await asyncio.to_thread(retire_all, fleet_env)
            for _ in range(args.rounds):
                cpu = time.process_time()
                base_times.append(await timed(baseline))
                base_cpu.append(time.process_time() - cpu)
                meta_times.append(await timed(baseline_with_metadata))
                cpu = time.process_time()
                hcpu = proc_cpu(host.pid)
                join_times.append(await timed(joins))
                join_cpu.append(time.process_time() - cpu)
                host_cpu.append(proc_cpu(host.pid) - hcpu)
                await asyncio.to_thread(retire_all, fleet_env)  # each round starts from an empty fleet
        host.terminate()
        host.wait()
    b, j = median(base_times), median(join_times)
    print(f"{n} concurrent workflows x {ACTIVITIES_PER_JOIN} activities, {args.rounds} rounds (median)")
    print(f"  baseline (no-op activities): {b:.2f} s   rounds: {', '.join(f'{t:.2f}' for t in base_times)}")
    m = median(meta_times)
    print(f"  baseline + UI metadata:      {m:.2f} s   rounds: {', '.join(f'{t:.2f}' for t in meta_times)}"
          "   (summaries, current details, search attributes)")
    print(f"  NodeJoin (sim, 0 latency):   {j:.2f} s   rounds: {', '.join(f'{t:.2f}' for t in join_times)}")
    print(f"  worker CPU s per round:      baseline {median(base_cpu):.2f}, NodeJoin {median(join_cpu):.2f}"
          f"  (+ {median(host_cpu):.2f} s in the simulated nodes' process)")
    ratios = [jt / bt for jt, bt in zip(join_times, base_times)]
    meta_ratios = [jt / mt for jt, mt in zip(join_times, meta_times)]
    print(f"  ratio NodeJoin / baseline:   {median(ratios):.2f}   (target <= 1.3)"
          f"   rounds: {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"  ratio NodeJoin / baseline + UI metadata: {median(meta_ratios):.2f}"
          f"   rounds: {', '.join(f'{r:.2f}' for r in meta_ratios)}")


if __name__ == "__main__":
    run(main)
