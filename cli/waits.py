"""What a running workflow waits for below its own step: its activities' state, as Temporal
describes them, in one line an operator can act on.

A workflow's progress query says which step it is at ("provisioning"), not that the step is
stuck: the activity's worker may be gone (no heartbeat since), or the activity failed and waits
for its next attempt, or no worker polls its task queue. Temporal knows each of these
(``DescribeWorkflowExecution``'s pending activities); this turns them into "why, and until
when", which the watching commands append to the step.

Above the activities, the watch's own queries may go unanswered: no worker polls the workflow's
task queue (the control plane down, or between two of its pods in a rolling deploy).
``UnansweredQueries`` says so in the watch's view at once, and takes it back once a query is
answered again; the watch keeps asking.
"""

from __future__ import annotations

import asyncio

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Iterable, TypeVar

from temporalio.api.enums.v1 import PendingActivityState
from temporalio.api.workflow.v1 import PendingActivityInfo

from cli.common import clock
from client.errors import NoWorker

T = TypeVar("T")

#: The SDK sends an activity's heartbeats at most every 80% of its heartbeat timeout: silent for
#: longer (and this slack), its worker is likely gone and the server will time the attempt out.
HEARTBEAT_SHARE = 0.8
HEARTBEAT_SLACK = timedelta(seconds=5)
#: A task ready this long and not started: no worker is taking its task queue.
UNSTARTED_AFTER = timedelta(seconds=15)
MAX_FAILURE_SHOWN = 120


def _when(stamp) -> datetime | None:
    return stamp.ToDatetime(tzinfo=timezone.utc) if stamp is not None and stamp.seconds else None


def activity_wait(pending: PendingActivityInfo, now: datetime) -> str | None:
    """Why ``pending`` holds its workflow up and until when, or None when it is simply running."""
    name = pending.activity_type.name
    options = pending.activity_options if pending.HasField("activity_options") else None
    heartbeat = options.heartbeat_timeout.ToTimedelta() if options is not None else timedelta(0)
    if pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED:
        last = _when(pending.last_heartbeat_time) or _when(pending.last_started_time)
        if last is None or not heartbeat or now - last <= heartbeat * HEARTBEAT_SHARE + HEARTBEAT_SLACK:
            return None
        attempt = f" (attempt {pending.attempt})" if pending.attempt > 1 else ""
        return (f"{name}{attempt}: no heartbeat for {(now - last).total_seconds():.0f} s, its worker may be gone; "
                f"retried by {clock(last + heartbeat)} (heartbeat timeout {heartbeat.total_seconds():g} s)")
    if pending.state != PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED:
        return None
    parts = []
    failure = pending.last_failure.message if pending.HasField("last_failure") else ""
    if failure:
        parts.append(f"{name} failed (attempt {max(pending.attempt - 1, 1)}): {failure[:MAX_FAILURE_SHOWN]}")
    ready_at = _when(pending.next_attempt_schedule_time) or _when(pending.scheduled_time)
    if ready_at is not None and ready_at > now:
        parts.append(f"next try at {clock(ready_at)}")
    elif ready_at is not None and now - ready_at >= UNSTARTED_AFTER:
        queue = options.task_queue.name if options is not None else ""
        parts.append(("" if failure else f"{name}: ") + f"no worker has taken it for "
                     f"{(now - ready_at).total_seconds():.0f} s" + (f" (is one polling {queue}?)" if queue else ""))
    return "; ".join(parts) or None


def activity_waits(pending: Iterable[PendingActivityInfo], now: datetime | None = None) -> list[str]:
    """Every pending activity's wait, as ``activity_wait`` says it."""
    now = now or datetime.now(timezone.utc)
    return [line for p in pending if (line := activity_wait(p, now))]


class UnansweredQueries:
    """What a live watch shows while no worker answers its queries. Each poll's query goes through
    ``ask``; the view shows ``why`` (a terminal's live view: ``beneath``; piped: the ``news``
    lines), so the operator sees why the view stopped moving rather than a frozen line."""

    def __init__(self, until: datetime | None = None) -> None:
        #: When the watch gives up on its own (its --timeout), said with the reason; None: never.
        self.until = until
        #: The last query no worker answered; None once one is answered.
        self.error: NoWorker | None = None
        self._said = False

    @property
    def why(self) -> str:
        """Why the view does not move, and that the watch goes on; "" while queries are answered."""
        if self.error is None:
            return ""
        until = f" until {clock(self.until)}" if self.until is not None else ""
        return f"{self.error}; still watching{until}; Ctrl-C to stop"

    async def ask(self, query: Callable[[], Awaitable[T]]) -> T | None:
        """``query()``'s answer; None when no worker answered it (``why`` then says which, and
        where the worker should poll). Any other error is the caller's: a workflow just started
        may not be found for a moment, and each watch knows what it can wait out."""
        try:
            answer = await query()
        except NoWorker as error:
            self.error = error
            return None
        self.error = None
        return answer

    async def ask_together(self, queries: list[Callable[[], Awaitable[T]]]) -> list[T | BaseException | None]:
        """Each of ``queries`` at once (with no worker each waits its whole bound), in order: an
        answer, None where no worker answered, or the error it raised. ``why`` stays set when any
        of them went unanswered: one answered query does not hide another's missing worker."""
        missed: list[NoWorker] = []

        async def one(query: Callable[[], Awaitable[T]]) -> T | None:
            try:
                return await query()
            except NoWorker as error:
                missed.append(error)
                return None

        answers = await asyncio.gather(*(one(q) for q in queries), return_exceptions=True)
        self.error = missed[0] if missed else None
        return answers

    def news(self) -> str | None:
        """For a watch that prints one line per change: ``why`` once when queries stop being
        answered, and once when they are answered again; None otherwise (a watch of several
        workflows would otherwise repeat the reason for each)."""
        if bool(self.why) == self._said:
            return None
        self._said = bool(self.why)
        return self.why or "a worker answers the queries again"

    def beneath(self, view=None):
        """A live view with ``why`` under it (``view`` None: ``why`` alone, or nothing)."""
        from rich.console import Group
        from rich.text import Text

        return Group(*([view] if view is not None else []),
                     *([Text(self.why, style="yellow")] if self.why else []))
