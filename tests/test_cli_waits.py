"""cli/waits.py: what a watched workflow's activities wait for, said with why and until when (in UTC,
as the workflows' own details say their times)."""

from __future__ import annotations

import asyncio

import time
from datetime import datetime, timedelta, timezone

import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from temporalio.api.activity.v1 import ActivityOptions
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.api.failure.v1 import Failure
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflow.v1 import PendingActivityInfo

from cli.capacity import capacity_line
from cli.waits import UnansweredQueries, activity_wait, activity_waits
from fleet.messages.capacity import CapacityProgress

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 4, 12, 0, 0, tzinfo=timezone.utc)


def stamp(ago: float) -> Timestamp:
    at = Timestamp()
    at.FromDatetime(NOW - timedelta(seconds=ago))
    return at


def activity(state, heartbeat: float = 30, **fields) -> PendingActivityInfo:
    info = PendingActivityInfo(state=state, activity_options=ActivityOptions(
        heartbeat_timeout=Duration(seconds=int(heartbeat)), task_queue=TaskQueue(name="gpufleet")), **fields)
    info.activity_type.name = "provision_joining_machine"
    return info


STARTED, SCHEDULED = (PendingActivityState.PENDING_ACTIVITY_STATE_STARTED,
                      PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED)


def test_a_running_activity_that_beats_waits_for_nothing() -> None:
    assert activity_wait(activity(STARTED, last_started_time=stamp(100), last_heartbeat_time=stamp(10)), NOW) is None
    assert activity_waits([activity(SCHEDULED, scheduled_time=stamp(2))], NOW) == []


def test_a_silent_worker_is_named_with_when_the_server_retries() -> None:
    said = activity_wait(activity(STARTED, heartbeat=600, last_started_time=stamp(900),
                                  last_heartbeat_time=stamp(550)), NOW)
    assert said == ("provision_joining_machine: no heartbeat for 550 s, its worker may be gone; retried by "
                    "12:00:50 UTC (heartbeat timeout 600 s)")


def test_a_failed_attempt_says_why_and_when_it_is_tried_again() -> None:
    waiting = activity(SCHEDULED, attempt=2, last_failure=Failure(message="activity Heartbeat timeout"),
                       scheduled_time=stamp(60), next_attempt_schedule_time=stamp(-5))
    assert activity_wait(waiting, NOW) == ("provision_joining_machine failed (attempt 1): activity Heartbeat timeout; "
                                           "next try at 12:00:05 UTC")


def test_a_retry_no_worker_takes_says_so() -> None:
    waiting = activity(SCHEDULED, attempt=2, last_failure=Failure(message="activity Heartbeat timeout"),
                       scheduled_time=stamp(120), next_attempt_schedule_time=stamp(40))
    assert activity_wait(waiting, NOW) == ("provision_joining_machine failed (attempt 1): activity Heartbeat timeout; "
                                           "no worker has taken it for 40 s (is one polling gpufleet?)")
    first = activity(SCHEDULED, scheduled_time=stamp(16))
    assert activity_wait(first, NOW) == \
        "provision_joining_machine: no worker has taken it for 16 s (is one polling gpufleet?)"


@pytest.fixture
def new_york(monkeypatch):
    """This machine's clock in another zone than the workflows' (UTC)."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_the_times_the_cli_adds_to_a_step_are_in_utc_as_the_steps_own(new_york) -> None:
    """A workflow's details give their times in UTC ("until 12:05:00 UTC"); the lines the CLI adds
    to a step printed this machine's local time with no zone, so one screen read 12:05 and 07:00
    for the same moment."""
    assert datetime(2026, 12, 4, 12).astimezone().utcoffset() == timedelta(hours=-5), "the zone took"
    waiting = activity(SCHEDULED, attempt=2, last_failure=Failure(message="activity Heartbeat timeout"),
                       scheduled_time=stamp(60), next_attempt_schedule_time=stamp(-5))
    assert activity_wait(waiting, NOW).endswith("next try at 12:00:05 UTC")
    silent = activity(STARTED, heartbeat=600, last_started_time=stamp(900), last_heartbeat_time=stamp(550))
    assert "retried by 12:00:50 UTC (heartbeat timeout 600 s)" in activity_wait(silent, NOW)
    waiting_for_offers = CapacityProgress(step="waiting for capacity", requested=2, wait_until=NOW + timedelta(minutes=5),
                                          deadline=NOW + timedelta(hours=1))
    assert capacity_line("capacity/x", waiting_for_offers) == ("capacity/x: waiting for capacity, 0 of 2 joined; looks "
                                                               "again at 12:05:00 UTC or when offers change; gives up "
                                                               "at 13:00:00 UTC")


async def test_a_watch_says_once_that_no_worker_answers_and_once_that_one_answers_again() -> None:
    """A live watch's queries while the control plane's worker is away (a rolling deploy): the
    reason at once, said once however many workflows the watch asks about, and taken back once a
    query is answered; any other error stays the watch's own to handle."""
    from client.errors import NoWorker, NotFound

    answers: list = [NoWorker("join/site-a/x-0", "progress", "gpufleet", 10),
                     NoWorker("join/site-a/x-1", "progress", "gpufleet", 10), "provisioning",
                     NotFound("join/site-a/x-2")]

    async def query():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    unanswered = UnansweredQueries(until=NOW)
    assert unanswered.news() is None and unanswered.why == ""
    assert await unanswered.ask(query) is None
    said = ("no worker answered `progress` of `join/site-a/x-0` within 10 s: is the control plane running (its "
            "worker polls `gpufleet`)? (gpufleet dev / kubectl -n gpufleet get pods); still watching until "
            "12:00:00 UTC; Ctrl-C to stop")
    assert unanswered.news() == said
    assert await unanswered.ask(query) is None
    assert "`join/site-a/x-1`" in unanswered.why and unanswered.news() is None  # said once
    assert await unanswered.ask(query) == "provisioning"
    assert (unanswered.why, unanswered.news(), unanswered.news()) == ("", "a worker answers the queries again", None)
    with pytest.raises(NotFound):
        await unanswered.ask(query)


async def test_queries_asked_together_keep_the_reason_while_any_of_them_went_unanswered() -> None:
    """A watch of several joins asks them at once: the one answered last must not hide that no
    worker answered another (the join watch took whichever came back last)."""
    from client.errors import NoWorker

    async def unanswered_query():
        raise NoWorker("join/site-a/x-0", "progress", "gpufleet", 10)

    async def answered_late():
        await asyncio.sleep(0.01)
        return "provisioning"

    async def raced():
        raise RuntimeError("not found yet")

    unanswered = UnansweredQueries()
    answers = await unanswered.ask_together([unanswered_query, answered_late, raced])
    assert answers[:2] == [None, "provisioning"] and isinstance(answers[2], RuntimeError)
    assert "`join/site-a/x-0`" in unanswered.why
    assert await unanswered.ask_together([answered_late]) == ["provisioning"] and unanswered.why == ""
