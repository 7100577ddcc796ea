"""``bench.scale --address``: the scale benchmark at its smoke size against the real cluster, in a
namespace of its own, with the cluster's processes measured (``--server-pids``), leaving nothing
running; and refusing a namespace where a fleet runs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from temporalio.service import RPCError, RPCStatusCode

from fleet.schedules import SCHEDULES, apply_schedules
from tests.realtemporal.cluster import RealTemporal
from tests.realtemporal.conftest import BENCH_NAMESPACE

#: The suite's size (``--smoke``: 2 then 4 nodes): two steps, two cells in each row.
SMOKE = ["--smoke"]
STEPS = 2


async def test_the_scale_benchmark_runs_against_an_existing_cluster(real_temporal: RealTemporal) -> None:
    pids = ",".join(str(pid) for pid in real_temporal.pids().values())
    command = [sys.executable, "-m", "bench.scale", *SMOKE, "--address", real_temporal.address,
               "--namespace", BENCH_NAMESPACE, "--server-pids", pids]
    try:
        done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=240,
                                       env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rows = {line[:50].strip(): line[50:].split() for line in done.stdout.splitlines() if len(line) > 50}
        assert rows["join failures"] == ["0"] * STEPS
        # Every fault injected was contained (late ones, which load can cause, are printed, not judged).
        contained, _late, never = rows["faults contained / late (> 30 s) / never"][0].split("/")
        assert int(contained) > 0 and int(never) == 0
        assert f"Temporal: the cluster at {real_temporal.address}, namespace {BENCH_NAMESPACE}" in done.stdout
        # The cluster's own processes were measured (PostgreSQL's backends with them): numbers,
        # where no pids would read n/a.
        assert all(float(cpu) > 0 for cpu in rows["Temporal cluster CPU s per steady minute"][:STEPS])
        assert all(float(mb) > 0 for mb in rows["Temporal cluster RSS (MB)"][:STEPS])
        # On a cluster that outlives it, the benchmark's fleet stops with it: no Schedule left
        # starting workflows, nothing left running.
        client = await real_temporal.connect(namespace=BENCH_NAMESPACE)
        assert [schedule_id for schedule_id in SCHEDULES if await exists(client, schedule_id)] == []
        assert [wf.id async for wf in client.list_workflows('ExecutionStatus = "Running"')] == []
    finally:
        await stop_everything(real_temporal)


async def test_the_scale_benchmark_refuses_a_namespace_a_fleet_runs_in(real_temporal: RealTemporal) -> None:
    """It runs gpufleet's Schedules under their fixed ids: in a fleet's namespace it would point
    the fleet's own Schedules at its task queue."""
    client = await real_temporal.connect(namespace=BENCH_NAMESPACE)
    await apply_schedules(client, "the-fleets-own-queue", site_every=300, catalog_every=600)
    try:
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "bench.scale", *SMOKE, "--address", real_temporal.address,
                             "--namespace", BENCH_NAMESPACE], capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert done.returncode != 0
        assert f"--namespace {BENCH_NAMESPACE}: it has gpufleet's Schedules already" in done.stderr, done.stderr[-2000:]
        for schedule_id in SCHEDULES:  # untouched: still the fleet's
            described = await client.get_schedule_handle(schedule_id).describe()
            assert described.schedule.action.task_queue == "the-fleets-own-queue"
    finally:
        await stop_everything(real_temporal)


async def exists(client, schedule_id: str) -> bool:
    try:
        await client.get_schedule_handle(schedule_id).describe()  # unlike a list, not eventually consistent
    except RPCError as error:
        if error.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    return True


async def stop_everything(real_temporal: RealTemporal) -> None:
    """Whatever a test left in the benchmark's namespace (a run that failed midway, the fleet's
    Schedules of the refusal test)."""
    client = await real_temporal.connect(namespace=BENCH_NAMESPACE)
    for schedule_id in SCHEDULES:
        if await exists(client, schedule_id):
            await client.get_schedule_handle(schedule_id).delete()
    async for wf in client.list_workflows('ExecutionStatus = "Running"'):
        try:
            await client.get_workflow_handle(wf.id, run_id=wf.run_id).terminate("benchmark over")
        except Exception:  # noqa: BLE001 - ended meanwhile
            pass
