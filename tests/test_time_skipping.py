"""Timer logic under Temporal's time-skipping test server (the unit tier's Temporal): hours of
workflow time in about a second, with the real control-plane worker, its real activities and the
simulated providers in this process. The server jumps its clock to the next timer whenever the
test waits on a result (or calls ``env.sleep``), so what is checked here is the workflow's own
schedule: which waits it chose, and when, by its own clock, it acted.

What the test server cannot do (visibility queries, long activity waits, which hold its clock)
stays with the dev-server tests; nothing here needs them."""

from __future__ import annotations

import asyncio
import copy
import uuid
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.env import FleetEnv
from fleet.messages.capacity import CapacityProgress, CapacityResult
from fleet.settings import Settings
from tests.conftest import TEST_FLEET, write_fleet
from workers.control_plane import build_worker

HOUR = 3600


def sold_out_fleet() -> dict:
    """The test fleet with no capacity at either site: every offer is listed, none can be bought."""
    fleet = copy.deepcopy(TEST_FLEET)
    for site in fleet["sites"]:
        site["sim"]["capacity"] = 0
    return fleet


@asynccontextmanager
async def control_plane(env: WorkflowEnvironment, tmp_path: Path,
                        fleet_config: dict | None = None) -> AsyncIterator[tuple[Settings, FleetEnv]]:
    """The control-plane worker on the test server; its fleet ``sold_out_fleet()`` unless given."""
    settings = Settings(address=env.client.service_client.config.target_host,
                        task_queue=f"timers-{uuid.uuid4().hex[:8]}", state_dir=tmp_path,
                        config=str(write_fleet(tmp_path, fleet_config or sold_out_fleet())))
    fleet = FleetEnv.from_settings(settings)
    async with build_worker(env.client, settings, fleet):
        yield settings, fleet


def catalog_reads(fleet: FleetEnv) -> list[int]:
    """Per account, the times its provider was asked for its offers (a catalog refresh asks each once)."""
    return [fleet.world.calls(account["name"], "offers") for account in TEST_FLEET["accounts"]]


async def timeline(handle: WorkflowHandle) -> tuple[list[float], datetime, datetime]:
    """The workflow's timers (seconds each was set for), and its start and close by its own clock."""
    events = (await handle.fetch_history()).events
    timers = [e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta().total_seconds()
              for e in events if e.HasField("timer_started_event_attributes")]
    return timers, events[0].event_time.ToDatetime(timezone.utc), events[-1].event_time.ToDatetime(timezone.utc)


@pytest.mark.timeout(60)  # four hours of backoff; without the skipping this would not end
async def test_a_request_nothing_can_serve_backs_off_doubling_to_its_cap_and_gives_up_at_its_deadline(
        time_skipping_env: WorkflowEnvironment, tmp_path: Path) -> None:
    async with control_plane(time_skipping_env, tmp_path) as (settings, fleet):
        handle = await time_skipping_env.client.start_workflow(
            "AcquireCapacity", {"constraints": {"gpu": "H100"}, "count": 1, "deadline_seconds": 4 * HOUR,
                                "backoff_seconds": 300, "max_backoff_seconds": 1800},
            id=f"capacity/sold-out-{uuid.uuid4().hex[:6]}", task_queue=settings.task_queue)
        result = CapacityResult.model_validate(await handle.result())
    timers, started, closed = await timeline(handle)
    # 5, 10, 20 minutes, then the 30-minute cap until the deadline; the last wait is cut short
    # there (it gives up at its deadline, not a backoff later).
    assert [round(t) for t in timers[:-1]] == [300, 600, 1200, 1800, 1800, 1800, 1800, 1800, 1800]
    assert 0 < timers[-1] <= 1800
    assert sum(timers) == pytest.approx(4 * HOUR, abs=10)
    assert (closed - started).total_seconds() == pytest.approx(4 * HOUR, abs=10)
    # It looked again after every wait (the catalog afresh from the providers), and only then.
    assert catalog_reads(fleet) == [len(timers) + 1] * len(TEST_FLEET["accounts"])
    assert not result.complete and result.nodes == []
    assert result.why[0] == "1 of 1 not joined by the deadline"
    assert any("no capacity" in why for why in result.why[1:])


@pytest.mark.timeout(60)
async def test_a_waiting_request_says_until_when_and_a_cancel_ends_it_without_waiting_out_the_backoff(
        time_skipping_env: WorkflowEnvironment, tmp_path: Path) -> None:
    env = time_skipping_env
    async with control_plane(env, tmp_path) as (settings, fleet):
        handle = await env.client.start_workflow(
            "AcquireCapacity", {"constraints": {"gpu": "H100"}, "count": 1, "deadline_seconds": 24 * HOUR,
                                "backoff_seconds": 1800, "max_backoff_seconds": 1800},
            id=f"capacity/waits-{uuid.uuid4().hex[:6]}", task_queue=settings.task_queue)

        async def waiting() -> CapacityProgress | None:
            progress = await handle.query("progress", result_type=CapacityProgress)
            return progress if progress.wait_until is not None else None

        progress = await wait_for_async(waiting)
        _, started, _ = await timeline(handle)
        # The wait says why (each offer and what stands in its way) and until when; and when it gives up.
        assert progress.step == "waiting for capacity"
        assert (progress.wait_until - started).total_seconds() == pytest.approx(1800, abs=10)
        assert (progress.deadline - started).total_seconds() == pytest.approx(24 * HOUR, abs=10)
        assert progress.waiting_for and any("capacity" in line for line in progress.waiting_for)
        reads = catalog_reads(fleet)

        await env.sleep(timedelta(minutes=10))  # a third of the way into the 30-minute wait
        stopped = CapacityProgress.model_validate(await handle.execute_update("cancel", "not needed any more"))
        result = CapacityResult.model_validate(await handle.result())
    _, started, closed = await timeline(handle)
    assert stopped.finished
    assert result.cancelled and not result.complete
    # Ended when asked, ten minutes in: not at the end of the backoff, and with no look at the providers since.
    assert (closed - started).total_seconds() == pytest.approx(600, abs=30)
    assert catalog_reads(fleet) == reads


async def wait_for_async(predicate, timeout: float = 10):
    """Like ``tests.conftest.wait_for``, for an async predicate (here: a query); returns its value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (value := await predicate()) is None:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)
    return value
