"""A lost worker is noticed on its heartbeat timeout, and its retry never buys a second machine
(issue 36).

The provisioning activity heartbeats while the provider creates the machine, and NodeJoin asks
for it (the join's heartbeat timeout, 30 s by default). So:

- ``kill -9`` of the control-plane worker mid-provision: the attempt times out on its missing
  heartbeat (the history says which timeout), the worker that comes back retries it under the
  same idempotency key and finds the machine the lost attempt created. Before, the retry waited
  out the 600 s start-to-close timeout (13.5 min to join, measured).
- A first attempt that is slow but alive (its worker stopped, then continued) and its retry run
  the provider's create at the same time: one machine, bought once.

Each worker is a process of its own, as under `gpufleet dev`; the simulated providers (one
SQLite world) are what both attempts call, the slowness is their API latency.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.api.enums.v1 import EventType, PendingActivityState, TimeoutType
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from cli.waits import activity_waits
from fleet.messages.join import NodeJoinResult
from tests.conftest import Stack, run_node_host, wait_for

pytestmark = pytest.mark.integration  # control-plane workers as processes of their own

#: The simulated provider's API latency while the machine is created: half before the create
#: is recorded, half after (``SimProvider._call``), each call.
SLOW_MS = 20_000


#: The control-plane worker with room for one activity at a time: while its one attempt runs it
#: holds no poll open at the server, so a retry can only go to another worker (a stopped worker's
#: open polls would otherwise take the retries too, and time out again).
ONE_SLOT_WORKER = """
import asyncio
from concurrent.futures import ThreadPoolExecutor
from temporalio.worker import Worker
from activities import control_plane_activities
from activities.env import FleetEnv
from fleet.settings import Settings
from fleet.temporal import connect
from workers.control_plane import worker_interceptors
from workers.workflow_runner import workflow_runner
from workflows import ALL_WORKFLOWS

async def main():
    settings = Settings.from_env()
    client = await connect(settings)
    async with Worker(client, task_queue=settings.task_queue, workflows=ALL_WORKFLOWS,
                      activities=control_plane_activities(FleetEnv.from_settings(settings)),
                      activity_executor=ThreadPoolExecutor(max_workers=4), max_concurrent_activities=1,
                      interceptors=worker_interceptors(), workflow_runner=workflow_runner(client.data_converter)):
        await asyncio.Event().wait()

asyncio.run(main())
"""


def worker(stack: Stack, log: Path, one_slot: bool = False) -> subprocess.Popen:
    env = {**os.environ, **stack.settings.env()}
    command = ["-c", ONE_SLOT_WORKER] if one_slot else ["-m", "workers.control_plane"]
    return subprocess.Popen([sys.executable, *command], env=env, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
async def nodes(fleet_world: Stack) -> AsyncIterator[Stack]:
    """The simulated nodes' host only: each test runs its own control-plane workers."""
    halt = asyncio.Event()
    host = await run_node_host(fleet_world.client, fleet_world.settings, halt)
    try:
        yield fleet_world
    finally:
        from tests.conftest import terminate_running

        await terminate_running(fleet_world.client, fleet_world.settings.task_queue)
        halt.set()
        await host


async def polling(stack: Stack, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Until worker process ``proc`` polls the stack's task queue (its start-up done)."""
    from tests.test_temporal_manifests import pollers

    deadline = time.monotonic() + timeout
    while not any(identity.startswith(f"{proc.pid}@") for identity in
                  await pollers(stack.client, stack.settings.task_queue)):
        assert proc.poll() is None and time.monotonic() < deadline, \
            f"worker {proc.pid} never polled: {log.read_text()[-3000:]}"
        await asyncio.sleep(0.2)


def pid_of(pending) -> int:
    return int(pending.last_worker_identity.split("@")[0])  # the SDK's identity: pid@host


async def provisioning(handle: WorkflowHandle, attempt: int = 1, timeout: float = 60, not_on: int = 0):
    """The join's provisioning activity once attempt ``attempt`` (or a later one) runs on a
    worker (other than process ``not_on``)."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while True:
        for pending in (await handle.describe()).raw_description.pending_activities:
            seen.append(f"{pending.activity_type.name} attempt {pending.attempt} state {pending.state} "
                        f"on {pending.last_worker_identity} failure {pending.last_failure.message[:80]!r}")
            if (pending.activity_type.name == "provision_joining_machine" and pending.attempt >= attempt
                    and pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
                    and pid_of(pending) != not_on):
                return pending
        assert time.monotonic() < deadline, (f"attempt {attempt} of the provisioning never started: "
                                             + "; ".join(dict.fromkeys(seen)))
        await asyncio.sleep(0.2)


async def retries(handle: WorkflowHandle, activity: str) -> list:
    """From the run's history: each attempt of ``activity`` after the first that ran to its end,
    with the failure of the attempt before it (``last_failure``)."""
    history = await handle.fetch_history()
    scheduled = {e.event_id for e in history.events
                 if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                 and e.activity_task_scheduled_event_attributes.activity_type.name == activity}
    return [e.activity_task_started_event_attributes for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
            and e.activity_task_started_event_attributes.scheduled_event_id in scheduled
            and e.activity_task_started_event_attributes.attempt > 1]


def timed_out_on_its_heartbeat(retry) -> bool:
    """The attempt before ``retry`` ended on its heartbeat timeout (not its start-to-close timeout)."""
    return (retry.last_failure.HasField("timeout_failure_info")
            and retry.last_failure.timeout_failure_info.timeout_type == TimeoutType.TIMEOUT_TYPE_HEARTBEAT)


async def test_kill_9_of_the_worker_mid_provision_is_retried_on_its_heartbeat_timeout(nodes: Stack,
                                                                                       tmp_path: Path) -> None:
    stack = nodes
    stack.world.set_site("site-a", api_latency_ms=SLOW_MS)
    first = worker(stack, tmp_path / "worker-1.log")
    second = None
    try:
        # Default timeouts: the join's own 30 s heartbeat timeout is what this proves.
        handle = await stack.start_join({"site": "site-a"}, request=f"kill9-{uuid.uuid4().hex[:6]}")
        await provisioning(handle)
        await wait_for(lambda: stack.world.machines("site-a"), timeout=30)  # created, the reply still on its way
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        stack.world.set_site("site-a", api_latency_ms=0)
        # What `gpufleet join` shows meanwhile (cli/waits.py): the attempt timed out on its
        # heartbeat and, no worker taking the retry, says so, with the queue to look at.
        async def said() -> str:
            lines = activity_waits((await handle.describe()).raw_description.pending_activities)
            return "; ".join(lines)

        deadline = time.monotonic() + 90
        while "no worker has taken it" not in (shown := await said()):
            assert time.monotonic() < deadline, f"no wait said about the lost worker: {shown!r}"
            await asyncio.sleep(1)
        assert "provision_joining_machine failed (attempt 1)" in shown and "Heartbeat timeout" in shown, shown
        assert f"is one polling {stack.settings.task_queue}?" in shown, shown
        second = worker(stack, tmp_path / "worker-2.log")
        # A guard against a hang only (what the retry once waited out was the 600 s start-to-close
        # timeout): which timeout ended the lost attempt, the history says.
        result = NodeJoinResult.model_validate(await asyncio.wait_for(handle.result(), 150))
        [retry] = await retries(handle, "provision_joining_machine")
        assert retry.attempt == 2 and timed_out_on_its_heartbeat(retry), retry
        (machine,) = stack.world.machines("site-a", include_deleted=True)
        assert result.nodes[0].machine_id == machine["id"], "the retry found the lost attempt's machine"
    finally:
        for proc in (first, second):
            if proc is not None:
                stop(proc)


async def test_a_slow_alive_attempt_and_its_retry_buy_one_machine(nodes: Stack, tmp_path: Path) -> None:
    stack = nodes
    stack.world.set_site("site-a", api_latency_ms=SLOW_MS)
    slow = worker(stack, tmp_path / "worker-1.log", one_slot=True)
    workers = [slow]
    try:
        handle = await stack.start_join({"site": "site-a", "timeouts": {"heartbeat_seconds": 6}},
                                        request=f"slow-{uuid.uuid4().hex[:6]}")
        try:
            first = await provisioning(handle)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{(tmp_path / 'worker-1.log').read_text()[-3000:]}") from None
        assert pid_of(first) == slow.pid
        workers.append(worker(stack, tmp_path / "worker-2.log"))
        # Up before the first is stopped: a worker starting opens the simulated world's database,
        # which a stopped process may hold locked ("database is locked": the second never polled).
        await polling(stack, workers[-1], tmp_path / "worker-2.log")
        os.kill(slow.pid, signal.SIGSTOP)  # alive, but no heartbeat reaches the server
        await provisioning(handle, attempt=2, timeout=60, not_on=slow.pid)
        os.kill(slow.pid, signal.SIGCONT)  # the first attempt carries on: both create at once
        await wait_for(lambda: stack.world.calls("acct-a", "create") >= 2, timeout=30)
        stack.world.set_site("site-a", api_latency_ms=0)
        result = NodeJoinResult.model_validate(await asyncio.wait_for(handle.result(), 120))
        machines = stack.world.machines("site-a", include_deleted=True)
        assert len(machines) == 1, [dict(m) for m in machines]
        assert result.nodes[0].machine_id == machines[0]["id"]
        assert stack.world.calls("acct-a", "create") == 2, "both attempts called the provider"
    finally:
        for proc in workers:
            stop(proc)
