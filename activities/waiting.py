"""Waiting inside an activity: poll with backoff, heartbeat only once the wait is long.

Each heartbeat is a write to the workflow's state on the server. An activity
that finishes within its first second has nothing to prove, so heartbeats
start after a grace period (a quarter of the heartbeat timeout, at most 1 s):
a worker that dies is still noticed within the heartbeat timeout.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Callable, TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError, CancelledError

T = TypeVar("T")

GRACE_SECONDS = 1.0
FIRST_POLL_SECONDS = 0.05


class Liveness:
    """Heartbeats for one activity execution; create it when the activity starts.

    ``first_at_share`` of the heartbeat timeout, instead of the short grace period, delays
    the first heartbeat for an activity that usually ends well within its timeout (the
    health watch): one that ends before it costs the server no heartbeat at all, and the
    first still lands inside the timeout."""

    def __init__(self, first_at_share: float | None = None) -> None:
        self._start = time.monotonic()
        timeout = activity.info().heartbeat_timeout
        if timeout and first_at_share is not None:
            self._grace = timeout.total_seconds() * first_at_share
        else:
            self._grace = min(GRACE_SECONDS, timeout.total_seconds() / 4) if timeout else GRACE_SECONDS

    def beat(self, *details: object) -> None:
        if time.monotonic() - self._start >= self._grace:
            activity.heartbeat(*details)


def heartbeat_or_stop() -> None:
    """A heartbeat for a wait in a worker thread, which then stops if its activity was cancelled
    (the cancel comes in a heartbeat's answer: an evacuation's abort cuts its drain short). The SDK
    raises the cancel in the thread too, wherever it is, where a cluster call's own ``except`` may
    take it; here it is raised where the wait stands."""
    activity.heartbeat()
    stop_if_cancelled()


def stop_if_cancelled() -> None:
    if activity.is_cancelled():
        raise CancelledError("cancelled while it waited")


def poll_until(
    check: Callable[[], T | None],
    deadline: datetime,
    poll_seconds: float,
    timed_out: Callable[[], ApplicationError],
) -> T:
    """``check()`` until it returns something, polling fast at first (a warm machine
    answers within a second) and backing off to ``poll_seconds``; past ``deadline``
    raise ``timed_out()``."""
    liveness = Liveness()
    interval = FIRST_POLL_SECONDS
    while True:
        found = check()
        if found is not None:
            return found
        if datetime.now(timezone.utc) >= deadline:
            raise timed_out()
        liveness.beat()
        stop_if_cancelled()  # told at a heartbeat's answer: the wait is no longer wanted
        time.sleep(interval)
        interval = min(interval * 2, poll_seconds)
