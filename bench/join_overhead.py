"""50 concurrent NodeJoins vs a baseline of the same number of no-op activities.

Both run on the same dev server in the same process, alternating, so machine
noise hits both. NodeJoin runs 8 activities per node (resolve, provision,
token, wait for registration, label/taint, smoke test on the node's queue,
admit, revoke), started the way `gpufleet join` starts them (carrying their
site's search attributes); the baseline workflow runs 8 no-op activities. Each round runs
the baseline, then the joins: the ratio is taken per round (neighbours share
the machine's mood) and the median of those is reported. Wall time on this
shared VM moves ±20% between neighbouring rounds, so the CPU seconds of all
three processes (dev server, this worker, the simulated nodes) are reported too:
time stolen by other tenants does not count in them.

    python -m bench.join_overhead [--nodes 50] [--rounds 7]
    python -m bench.join_overhead --smoke   # 3 joins, 1 round (the suite runs this)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated

import typer
from temporalio.worker import Worker

from activities.env import FleetEnv
from fleet import search_attributes as sa
from fleet.naming import join_workflow_id
from bench.baseline import NoopSteps, NoopStepsWithMetadata, noop
from bench.common import (Smoke, bench_env, command_line, fleet, median, bench_args, run, start_node_host, timed,
                          proc_cpu, server_pid)
from workers.control_plane import POLLERS, build_worker
from workers.workflow_runner import workflow_runner
from fleet.contracts import workflows as flows

ACTIVITIES_PER_JOIN = 8




@dataclass
class Window:
    wall: float
    cpu: dict[str, float]  # process → CPU seconds

    @property
    def total_cpu(self) -> float:
        return sum(self.cpu.values())


async def measure(run, pids: dict[str, int]) -> Window:
    def cpu() -> dict[str, float]:
        return {"worker": time.process_time(), **{name: proc_cpu(pid) for name, pid in pids.items()}}

    before = cpu()
    wall = await timed(run)
    after = cpu()
    return Window(wall, {name: after[name] - before[name] for name in after})


async def retire_all(env: FleetEnv, client) -> None:
    """Delete every machine and node and end their Node entities, so neither agents nor
    entities (whose watches would time out and retry in a later round) pile up across rounds."""
    def delete() -> None:
        for node in env.cluster.list_nodes():
            env.cluster.remove_node(node.name)
        for machine in env.world.machines():
            env.provider(machine["site"]).delete_machine(machine["id"])

    await asyncio.to_thread(delete)
    entities = [client.get_workflow_handle(wf.id, run_id=wf.run_id)
                async for wf in client.list_workflows(f"WorkflowType = '{flows.Node.TYPE}' AND ExecutionStatus = 'Running'")]
    await asyncio.gather(*[handle.terminate("bench round over") for handle in entities])


async def main(args) -> None:
    if args.smoke:
        args.nodes, args.rounds = 3, 1
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
                                 activity_executor=ThreadPoolExecutor(128), max_concurrent_activities=128,
                                 **POLLERS)

        async def baseline(workflow=NoopSteps) -> None:
            await asyncio.gather(*[
                client.execute_workflow(workflow.run, ACTIVITIES_PER_JOIN, id=f"noop-{uuid.uuid4().hex}",
                                        task_queue=baseline_queue)
                for _ in range(n)
            ])

        async def baseline_with_metadata() -> None:
            await baseline(NoopStepsWithMetadata)

        async def join_one(site: dict) -> None:
            join_id = join_workflow_id(site["name"], uuid.uuid4().hex[:8])
            await client.execute_workflow(
                flows.NodeJoin.TYPE, {"site": site["name"]}, id=join_id, task_queue=settings.task_queue,
                search_attributes=sa.join_start_attributes(site["name"], site["provider"], site["account"], join_id),
            )

        async def joins() -> None:
            await asyncio.gather(*[join_one(sites[i % len(sites)]) for i in range(n)])

        fleet_env = FleetEnv.from_settings(settings)
        pids = {"server": server_pid(), "nodes": host.pid}
        base, meta, join = [], [], []
        try:
            async with build_worker(client, settings), baseline_worker:
                # Warm-up, both paths: connections, sandbox imports, the first agents' start.
                await baseline()
                await joins()
                await retire_all(fleet_env, client)
                for _ in range(args.rounds):
                    base.append(await measure(baseline, pids))
                    meta.append(await measure(baseline_with_metadata, pids))
                    join.append(await measure(joins, pids))
                    await retire_all(fleet_env, client)  # each round starts from an empty fleet
        finally:
            host.terminate()
            host.wait()

    def walls(windows: list[Window]) -> str:
        return f"{median([w.wall for w in windows]):.2f} s   rounds: {', '.join(f'{w.wall:.2f}' for w in windows)}"

    def cpus(windows: list[Window]) -> str:
        return ", ".join(f"{name} {median([w.cpu[name] for w in windows]):.2f}" for name in windows[0].cpu)

    def paired(ours: list[Window], theirs: list[Window], of) -> str:
        ratios = [of(a) / of(b) for a, b in zip(ours, theirs)]
        return f"{median(ratios):.2f}   rounds: {', '.join(f'{r:.2f}' for r in ratios)}"

    print(f"{n} concurrent workflows x {ACTIVITIES_PER_JOIN} activities, {args.rounds} rounds (median)")
    print(f"  baseline (no-op activities): {walls(base)}")
    print(f"  baseline + UI metadata:      {walls(meta)}   (summaries, current details, search attributes)")
    print(f"  NodeJoin (sim, 0 latency):   {walls(join)}")
    print(f"  CPU s per round, baseline:   {cpus(base)}")
    print(f"  CPU s per round, NodeJoin:   {cpus(join)}")
    print(f"  ratio NodeJoin / baseline, wall:      {paired(join, base, lambda w: w.wall)}   (target <= 1.3)")
    print(f"  ratio NodeJoin / baseline, CPU:       {paired(join, base, lambda w: w.total_cpu)}")
    print(f"  ratio NodeJoin / baseline + UI metadata, wall: {paired(join, meta, lambda w: w.wall)}")


def cli(nodes: Annotated[int, typer.Option()] = 50, rounds: Annotated[int, typer.Option()] = 7,
        smoke: Smoke = False) -> None:
    args = bench_args(locals())
    run(lambda: main(args))


if __name__ == "__main__":
    command_line(cli, __doc__)
