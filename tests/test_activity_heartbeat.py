"""Every long activity heartbeats, so a lost worker's attempt is retried on its heartbeat timeout
(issue 36).

The fleet sweep's ``sweep_site`` lists (and deletes at) a provider: minutes at a slow one. It
had no heartbeat timeout, so after ``kill -9`` of the control-plane worker mid-call the retry
waited out its 5-minute start-to-close timeout. Now FleetSweep asks for a 30 s heartbeat timeout
and the activity heartbeats while the provider call runs (every 10 s): the attempt lost with the
worker times out within 30 s and the worker that comes back runs the retry. (The rollout's
``probe_serving``, the CSR approver's pass and the evacuation's smoke test are scheduled the
same way; provisioning has its own test, tests/test_provision_heartbeat.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import WorkflowHandle

from fleet.messages.sweep import FleetSweepResult
from tests.conftest import Stack, terminate_running
from tests.test_provision_heartbeat import pid_of, retries, stop, timed_out_on_its_heartbeat, worker

pytestmark = pytest.mark.integration  # control-plane workers as processes of their own

#: The simulated provider's API latency at site-a: half before the listing, half after.
SLOW_MS = 40_000


@pytest.fixture
async def world(fleet_world: Stack) -> AsyncIterator[Stack]:
    """Settings and the simulated world only: the test runs its own control-plane workers."""
    try:
        yield fleet_world
    finally:
        await terminate_running(fleet_world.client, fleet_world.settings.task_queue)


async def sweeping(handle: WorkflowHandle, timeout: float = 60):
    """The sweep's ``sweep_site`` attempt still running (site-a's: the other site answers at once)."""
    deadline = time.monotonic() + timeout
    while True:
        for pending in (await handle.describe()).raw_description.pending_activities:
            if (pending.activity_type.name == "sweep_site"
                    and pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED):
                return pending
        assert time.monotonic() < deadline, "sweep_site never started"
        await asyncio.sleep(0.2)


async def test_kill_9_of_the_worker_mid_sweep_is_retried_on_its_heartbeat_timeout(world: Stack, tmp_path: Path) -> None:
    stack = world
    stack.world.set_site("site-a", api_latency_ms=SLOW_MS)
    first = worker(stack, tmp_path / "worker-1.log")
    second = None
    try:
        handle = await stack.client.start_workflow(
            "FleetSweep", {"dry_run": True}, id=f"fleet-sweep-kill9-{uuid.uuid4().hex[:6]}",
            task_queue=stack.settings.task_queue)
        pending = await sweeping(handle)
        assert pid_of(pending) == first.pid
        await asyncio.sleep(12)  # mid-call, its first heartbeat sent
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        stack.world.set_site("site-a", api_latency_ms=0)
        second = worker(stack, tmp_path / "worker-2.log")
        # A guard against a hang only (the start-to-close timeout the retry once waited out is
        # 5 minutes): which timeout ended the lost attempt, the history says.
        result = FleetSweepResult.model_validate(await asyncio.wait_for(handle.result(), 150))
        by_site = {r.site: r for r in result.sites}
        assert by_site["site-a"].skipped == "" and by_site["site-a"].account == "acct-a", by_site["site-a"]
        [retry] = await retries(handle, "sweep_site")
        assert retry.attempt == 2 and timed_out_on_its_heartbeat(retry), \
            f"site-a's sweep ran again on the worker that came back after its heartbeat timeout: {retry}"
    finally:
        for proc in (first, second):
            if proc is not None:
                stop(proc)
