"""Fallback cost: AcquireCapacity over 4 NoCapacity candidates vs a direct join at the 5th.

Five zero-latency simulated sites, cheapest first; the catalog still advertises the
first four, whose create calls answer NoCapacity. Each round times, alternating on
the same dev server and worker: a NodeJoin straight at site-4, and an
AcquireCapacity that tries site-0..3 (each a NodeJoin child failing NoCapacity)
and joins at site-4. Then: a revoked account is skipped with zero provider calls.

    python -m bench.fallback [--rounds 5]
    python -m bench.fallback --smoke   # 1 round (the suite runs this)
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated

import typer

from activities.env import FleetEnv
from bench.common import Smoke, bench_env, command_line, fleet, median, bench_args, run, start_node_host, timed
from workers.control_plane import build_worker
from fleet.contracts import workflows as flows

SKIPPED = 4


def retire_all(env: FleetEnv) -> None:
    for node in env.cluster.list_nodes():
        env.cluster.remove_node(node.name)
    for machine in env.world.machines():
        env.provider(machine["site"]).delete_machine(machine["id"])


async def main(args) -> None:
    if args.smoke:
        args.rounds = 1
    async with bench_env(fleet(sites=5, capacity=50)) as (env, settings):
        client = env.client
        world_env = FleetEnv.from_settings(settings)
        world = world_env.world
        host = start_node_host(settings)
        queue = settings.task_queue

        async def direct() -> None:
            await client.execute_workflow(flows.NodeJoin.TYPE, {"site": "site-4"}, id=f"join/site-4/{uuid.uuid4().hex[:8]}",
                                          task_queue=queue)

        attempts: list[list[str]] = []

        async def fallback() -> None:
            result = await client.execute_workflow(
                flows.AcquireCapacity.TYPE, {"constraints": {"gpu": "H100"}, "count": 1, "catalog_max_age_seconds": 3600},
                id=f"capacity/bench-{uuid.uuid4().hex[:8]}", task_queue=queue,
            )
            attempts.append([f"{a['offer'].split('/')[0]}:{a['outcome']}" for a in result["attempts"]])

        direct_times, fallback_times = [], []
        async with build_worker(client, settings):
            # The catalog is read while every site sells; then the first four run dry.
            await client.execute_workflow(flows.CatalogRefresh.TYPE, None, id="catalog-refresh-bench", task_queue=queue)
            for i in range(SKIPPED):
                world.set_site(f"site-{i}", capacity=0)
            await direct()  # warm-up: connections, sandbox imports
            await fallback()
            for _ in range(args.rounds):
                direct_times.append(await timed(direct))
                fallback_times.append(await timed(fallback))
                await asyncio.to_thread(retire_all, world_env)

            # A revoked account: skipped with zero provider calls.
            world_env.accounts.mark_revoked("acct-4", "lambda", "bench: revoked")
            world.set_site("site-3", capacity=5)
            before = world.calls("acct-4")
            await client.execute_workflow(
                flows.AcquireCapacity.TYPE, {"constraints": {"gpu": "H100"}, "count": 1, "catalog_max_age_seconds": 3600,
                                    "exclude": []},
                id=f"capacity/bench-revoked-{uuid.uuid4().hex[:6]}", task_queue=queue,
            )
            await client.execute_workflow(flows.CatalogRefresh.TYPE, None, id="catalog-refresh-bench-2", task_queue=queue)
            revoked_calls = world.calls("acct-4") - before
        host.terminate()
        host.wait()
    d, f = median(direct_times), median(fallback_times)
    print(f"fallback over {SKIPPED} NoCapacity candidates, {args.rounds} rounds (median), zero-latency sim")
    print(f"  attempts (last round):        {' → '.join(attempts[-1])}")
    print(f"  direct NodeJoin at site-4:    {d * 1000:.0f} ms   rounds: {', '.join(f'{t * 1000:.0f}' for t in direct_times)}")
    print(f"  AcquireCapacity (fallback):   {f * 1000:.0f} ms   rounds: {', '.join(f'{t * 1000:.0f}' for t in fallback_times)}")
    print(f"  ratio fallback / direct:      {f / d:.2f}")
    print(f"  ms added per skipped offer:   {(f - d) * 1000 / SKIPPED:.0f} ms   (target < 100 ms)")
    print(f"  provider calls to a revoked account during a request + a catalog refresh: {revoked_calls}")


def cli(rounds: Annotated[int, typer.Option()] = 5, smoke: Smoke = False) -> None:
    args = bench_args(locals())
    run(lambda: main(args))


if __name__ == "__main__":
    command_line(cli, __doc__)
