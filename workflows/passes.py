"""A long-lived entity outlives a failed call: the pass that failed is shown and tried again later.

An entity (Site, ProviderAccount, Demand, Routing) runs for the life of what it stands for. A call in its loop that
fails past its bounded retry (the Kubernetes API server away for a control-plane upgrade, a 403
after an RBAC mistake, which no retry helps) must not end it: raised, it failed the workflow, and
with it everything the entity does (a site's min/max, retirement and incident rule), until
something started it again, with none of its carried state. Such a pass is logged, shown in the
entity's details ("could not <step> (Type: message); next try at HH:MM:SS UTC") and tried again
after a pause that doubles up to ``MAX_PAUSE``; the run and its state go on.

Only an activity's failure is taken: a bug in the workflow's own code fails its workflow task
(retried, the run intact, until a fixed worker runs it), and a cancel of the run stays the run's.
(The Node entity's background loops restart the same way: ``Node._background``. A capacity
request's catalog read pauses the same way too, each pause cut at its deadline: ``until``.)
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any, Awaitable, Callable

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from workflows.steps import LONG_WATCH_PAUSE, MAX_PROBLEM_SHOWN, cancelled_by_request, failure_text

#: The first pause after a failed pass, doubled by each that fails again. A refusal that no retry
#: helps fails at once, so the pause is all that paces it (a timer a pass); a call retried until
#: it gave up (the API server away, ``CLUSTER_RETRY``: about two and a half minutes) has waited
#: already ...
FIRST_PAUSE = timedelta(seconds=5)
#: ... up to this, as long as a site's watch refused for good waits: the loop is back within it of
#: the cluster answering again.
MAX_PAUSE = LONG_WATCH_PAUSE


class FailedPasses:
    """One entity loop's failed passes: what failed (shown until a pass works) and the next pause.
    Not carried: a run that continues as new starts again from its first pause.

    Two ways in: ``attempt`` runs a pass and takes its failure (the Site, ProviderAccount); a loop
    that catches the ``ActivityError`` itself (Demand, Routing: what the pass had done decides
    what the next one does) calls ``pause_after`` with it, and ``passed`` once a pass goes through.
    ``steps`` names what a pass was doing by the activity that failed, for ``pause_after``'s line;
    ``log`` takes the first line of each streak of failures, for the entity's own log."""

    def __init__(self, steps: dict[str, str] | None = None, *, show: Callable[[str], None] = lambda line: None,
                 log: Callable[[str], None] = lambda line: None, first_pause: timedelta = FIRST_PAUSE) -> None:
        self._steps, self._show, self._log = steps or {}, show, log
        self._first = self.pause = first_pause
        #: Passes failed in a row.
        self.failed = 0
        #: "could not <step> (...); next try at ..." while the last pass failed, else "".
        self.failing = ""

    async def attempt(self, step: str, work: Callable[[], Awaitable[Any]], show: Callable[[str], None], *,
                      wake: Callable[[], bool] = lambda: False) -> bool:
        """``work()``, one pass (``step`` names it for a person: "reconcile"); True when it worked.
        One that failed is logged and shown (``show``), the pause is waited (cut short once
        ``wake()`` holds: work that must not wait), and False returned: the loop tries again."""
        self.failing = ""  # trying again now: what the pass shows as it goes is the news
        try:
            await work()
        except ActivityError as error:
            await self.pause_after(error, step=step, show=show, wake=wake)
            return False
        self.passed()
        return True

    async def pause_after(self, error: ActivityError, *, step: str | None = None,
                          show: Callable[[str], None] | None = None, wake: Callable[[], bool] | None = None,
                          until: datetime | None = None) -> None:
        """Show the failure and wait until the next pass (cut short once ``wake()`` holds, and at
        ``until``: a request's deadline); the run's own cancel is raised, not taken for a failed call."""
        if cancelled_by_request(error):
            raise error
        self.failed += 1
        pause, self.pause = self.pause, min(self.pause * 2, MAX_PAUSE)
        if until is not None:
            pause = max(min(pause, until - workflow.now()), timedelta(seconds=1))
        step = step or self._steps.get(error.activity_type or "", f"run `{error.activity_type}`")
        self.failing = (f"could not {step} ({failure_text(error)[:MAX_PROBLEM_SHOWN]}); "
                        f"next try at {workflow.now() + pause:%H:%M:%S} UTC")
        workflow.logger.warning("%s", self.failing)
        if self.failed == 1:  # one line a streak in the entity's log: its decisions stay readable
            self._log(self.failing)
        (show or self._show)(self.failing)
        if wake is None:
            await workflow.sleep(pause, summary="a pass failed: the next one")
            return
        try:
            await workflow.wait_condition(wake, timeout=pause, timeout_summary=f"could not {step}: try again")
        except asyncio.TimeoutError:
            pass

    def passed(self) -> None:
        """A pass went through: the next failure starts a new streak at the first pause."""
        if self.failed:
            self._log(f"a pass went through again, after {self.failed} that failed")
        self.failed, self.failing, self.pause = 0, "", self._first
