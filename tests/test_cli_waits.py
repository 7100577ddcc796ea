"""cli/waits.py: what a watched workflow's activities wait for, said with why and until when."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from temporalio.api.activity.v1 import ActivityOptions
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.api.failure.v1 import Failure
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflow.v1 import PendingActivityInfo

from cli.waits import activity_wait, activity_waits

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
    clock = (NOW + timedelta(seconds=50)).astimezone().strftime("%H:%M:%S")
    assert said == (f"provision_joining_machine: no heartbeat for 550 s, its worker may be gone; retried by {clock} "
                    "(heartbeat timeout 600 s)")


def test_a_failed_attempt_says_why_and_when_it_is_tried_again() -> None:
    waiting = activity(SCHEDULED, attempt=2, last_failure=Failure(message="activity Heartbeat timeout"),
                       scheduled_time=stamp(60), next_attempt_schedule_time=stamp(-5))
    clock = (NOW + timedelta(seconds=5)).astimezone().strftime("%H:%M:%S")
    assert activity_wait(waiting, NOW) == ("provision_joining_machine failed (attempt 1): activity Heartbeat timeout; "
                                           f"next try at {clock}")


def test_a_retry_no_worker_takes_says_so() -> None:
    waiting = activity(SCHEDULED, attempt=2, last_failure=Failure(message="activity Heartbeat timeout"),
                       scheduled_time=stamp(120), next_attempt_schedule_time=stamp(40))
    assert activity_wait(waiting, NOW) == ("provision_joining_machine failed (attempt 1): activity Heartbeat timeout; "
                                           "no worker has taken it for 40 s (is one polling gpufleet?)")
    first = activity(SCHEDULED, scheduled_time=stamp(16))
    assert activity_wait(first, NOW) == \
        "provision_joining_machine: no worker has taken it for 16 s (is one polling gpufleet?)"
