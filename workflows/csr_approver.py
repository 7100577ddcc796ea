"""CsrApprover (started by the Schedule ``gpufleet-csr-approver``): gpufleet's kubelet CSR
approver, woken by new CSRs.

Joins and repairs run the approver while they wait for a kubelet, but a kubelet also asks
on its own: it renews its client certificate (as ``system:node:<name>``) before it expires
and asks for a serving certificate. Nothing else approves those for gpufleet's nodes (its
token group is bound to no auto-approval), so without a timer a fleet that is not joining
or repairing would lose its kubelets when their certificates lapse.

A run makes one pass, then waits on ``watch_csrs``, a watch on CSRs that returns when one it has
not seen appears under a signer gpufleet judges (no sooner than its pace after it began, so CSRs
that keep coming get a pass per pace, not one each), and makes a pass for it; each watch returns
unchanged after ``CSR_WATCH_SECONDS`` (a pass then too: the safety sweep). The run ends when its
history asks to be continued (or after ``CSR_RUN_SECONDS``), and the Schedule (overlap SKIP, every
``fleet.schedules.CSR_APPROVER_EVERY``) starts the next: a run that is lost is replaced within
that, and a Schedule keeps it visible and pausable in the UI. A cancelled run ends with what it
decided. An idle fleet's approver costs two activities and one heartbeat per ten minutes, where
a pass every half minute cost 240 an hour.

The pace is ``CSR_PACE_SECONDS`` (10 s) unless a flood slows it. A node is hostile: its kubelet
(or a bootstrap token) may post CSRs at will, and junk posted steadily woke a pass every 10 s,
which filled the run's history in about an hour; the run ended, and no approver ran until the
Schedule's next start, up to ten minutes, while every genuine kubelet's CSR waited. Now each pass
a new CSR woke that approved nothing doubles the next watch's pace, up to
``CSR_FLOOD_PACE_SECONDS`` (5 minutes); a pass that approves something (a node gets at most three
renewals an hour), or a watch that returns on its safety-sweep timeout, puts it back to the base.
A pass decides every open CSR, so a genuine CSR posted during a flood waits at most one watch at
the flood's pace, the pass in flight and its own: 5 minutes and seconds, half the safety sweep,
and a kubelet asks for its renewal long before its certificate lapses (a joining node's CSRs are
decided by its join's own passes). A run's day then holds 288 watches, fewer than the 340 that
filled its history.

Nor does a flood fill its history by size (Temporal suggests a new run at 4 MB). A watch named the
CSRs open at its end (up to 500, 253 characters each), which the next watch's input carried again,
and a pass listed up to 100 verdicts: up to 300 KB a round, so a run under a flood of long names
ended after a dozen rounds or so, about an hour at the flood's pace. Now a watch hands the next
one a mark of what it saw (``CsrMark``: digests of the newest 32 open CSRs and when the oldest of
them was created, some 500 bytes), and a pass lists ten verdicts, approvals first, each cut to a
few hundred bytes, and counts them all: a round writes a few KB however many CSRs nodes post, or
how long their names. In tests/cluster/test_csr_flood.py (300 CSRs of 253-character names every 2
s) a round wrote up to 249 KB before, at most 4.8 KB now (the test's bound is 8 KB): at the flood
pace a day's 288 rounds write about 1.4 MB (2.3 MB at the bound), and the run lasts its day.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import activities as act
    from fleet.messages.csr import VERDICTS_NAMED, CsrApproverInput, CsrApproverResult
    from fleet.messages.watches import (CSR_FLOOD_PACE_SECONDS, CSR_PACE_SECONDS, CsrMark, CsrWatchInput,
                                        CsrWatchResult)
    from workflows.inputs import parse_input
    from workflows.steps import CLUSTER_RETRY, WAIT_HEARTBEAT, show_details

#: A watch returns unchanged after this long (a pass then: the safety sweep) ...
CSR_WATCH_SECONDS = 600.0
#: ... and heartbeats once per half of this.
CSR_WATCH_HEARTBEAT = timedelta(minutes=10)
#: A run ends after this long at most; the Schedule's next pass starts the next one.
CSR_RUN_SECONDS = 86400.0
#: Deprecated, to be removed in a later release (docs/design/patches.md, "The rule"): a run cancelled
#: during its first pass ends with what it decided, as one cancelled later does. Every run open now
#: started after it (a run ends within a day); the call stays, deprecated, where that cancel is
#: taken, until no run holding its marker is open.
FIRST_PASS_CANCEL_PATCH = "approver-cancelled-in-its-first-pass-ends"


@workflow.defn(name="CsrApprover")
class CsrApprover:
    def __init__(self) -> None:
        self._approved = 0
        self._denied = 0

    @workflow.run
    async def run(self, raw: Any = None) -> CsrApproverResult:
        parse_input(CsrApproverInput, raw or {})
        mark: CsrMark | None = CsrMark()
        known: list[str] = []
        known_cut = False
        pace = CSR_PACE_SECONDS
        decided: list = []
        first_pass = True
        try:
            result = await self._pass("approve or deny pending kubelet CSRs of gpufleet's nodes")
            first_pass = False
            started = workflow.now()
            decided = list(result.decided)
            while not workflow.info().is_continue_as_new_suggested() and \
                    workflow.now() - started < timedelta(seconds=CSR_RUN_SECONDS):
                # The pace is an activity input, which replay does not compare: a run recorded before
                # it (every watch at the activity's 10 s) issues the same commands in the same order,
                # watch, pass, watch..., so it needs no patch.
                seen: CsrWatchResult = await workflow.execute_activity(
                    act.watch_csrs,
                    CsrWatchInput(mark=mark, known=known, known_cut=known_cut, max_wait_seconds=CSR_WATCH_SECONDS,
                                  pace_seconds=pace),
                    start_to_close_timeout=timedelta(seconds=CSR_WATCH_SECONDS) + CSR_WATCH_HEARTBEAT,
                    heartbeat_timeout=CSR_WATCH_HEARTBEAT, retry_policy=CLUSTER_RETRY,
                    summary="wait for a new kubelet CSR (watch)",
                )
                # A result from before the mark (a watch in flight at the deploy) names the CSRs it
                # saw, which the next watch is told as before; one since marks them, in a few hundred bytes.
                mark, known, known_cut = seen.mark, seen.pending, seen.mark is None and seen.cut
                result = await self._pass("a new kubelet CSR: approve or deny" if seen.changed
                                          else "safety sweep: approve or deny pending kubelet CSRs")
                decided = [*decided, *result.decided][-VERDICTS_NAMED:]
                # New CSRs and nothing approved: junk (a flood), which gets a pass per doubled pace.
                junk = seen.changed and not result.approved
                pace = min(pace * 2, CSR_FLOOD_PACE_SECONDS) if junk else CSR_PACE_SECONDS
        except (asyncio.CancelledError, ActivityError) as error:
            if not is_cancelled_exception(error):
                raise
            if first_pass:
                workflow.deprecate_patch(FIRST_PASS_CANCEL_PATCH)
            # Cancelled (an operator, or a test that has seen enough): the watch is stopped with the
            # run, and the run ends with what it decided. A pass in flight is cancelled too; every
            # decision it made is on its CSR, and the next run's first pass sees the rest.
            show_details("cancelled", detail=f"{self._approved} approved, {self._denied} denied")
        # Ends rather than continuing as new: the Schedule follows the run it started, so its next
        # pass starts the next run (a continued run would not be its to skip).
        return CsrApproverResult(decided=decided, approved=self._approved, denied=self._denied)

    async def _pass(self, summary: str) -> CsrApproverResult:
        result: CsrApproverResult = await workflow.execute_activity(
            act.approve_node_csrs, start_to_close_timeout=timedelta(minutes=2),
            # A pass asks the provider for each node's machine: it heartbeats while it works, so a
            # lost worker's pass is retried within a minute, not at the start-to-close timeout.
            heartbeat_timeout=WAIT_HEARTBEAT, retry_policy=CLUSTER_RETRY, summary=summary,
        )
        self._approved += result.approved
        self._denied += result.denied
        show_details("watching for new CSRs",
                     *(f"- `{v.name}` ({v.requester}): {'approved' if v.approve else 'denied'}, {v.reason}"
                       for v in result.decided[:20]),
                     detail=f"{self._approved} approved, {self._denied} denied")
        return result
