"""ModelRollout (id ``rollout/<model>/<version>``): a model version onto its sites.

The runbook (product rules 10 and 11):

1. validate: the manifest (every file has a sha256), the sites (known, with an
   object store, machines with ``gpus_per_replica`` GPUs), replicas (not zero
   everywhere) - before anything is copied;
2. replicate the weights to every target site's object store, sites in
   parallel, each verified by checksum (``replicate_weights``); a site whose
   copy fails twice is failed (a failed canary stops the rollout);
3. canary site(s), one at a time: update the Deployment (surge: the old
   replicas serve until the new ones are ready; at a site with no GPUs to spare
   for a surge replica, one replica at a time), wait until ready, probe,
   bake, probe again. A failed gate rolls that site back and stops;
4. the other sites in batches of ``batch_size``, one batch in flight at a
   time, each site gated the same way; a site under evacuation is deferred and
   stays queued until it is restored (one activity waits for it, and the rollout
   continues as new in that wait when Temporal suggests it).

Operators: ``pause`` (holds before the next batch; replication goes on),
``resume``, ``abort`` (stops and rolls back every site already updated), all
updates with validators; the ``progress`` query; current details show the
site x state table; search attributes ``Model``, ``ModelVersion``, ``FleetState``.
Temporal's cancel rolls back as ``abort`` does, then the run ends Canceled
(phase ``cancelled``); one that lands while an abort rolls back stops no rollback,
and the run then ends Canceled too, not aborted. One that lands while a site's
Deployment is updated waits for the update's answer, then rolls that site back too. An abort or a
cancel while weights are copied stops each copy and waits (twice its heartbeat at most) for it to
abort its open multipart upload; then the uploads left open under the rollout's key prefix at the
sites whose copy did not finish are aborted.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any, Optional

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import activities as act
    from fleet.messages.rollout import (
        AbortedUploads, AbortUploadsInput, EvacuationInput, EvacuationWaitInput, ProbeServingInput, ReplicateInput,
        ReplicateResult, ResolveRolloutSitesInput, RollbackSiteInput, RolloutCarry, RolloutRunInput, RolloutSites,
        ServingRef, UpdateServingInput,
    )
    from fleet import search_attributes as sa
    from fleet.errors import NON_RETRYABLE_TYPES
    from fleet.rollout import (
        TOUCHED,
        ProbeResult,
        RolloutInput,
        RolloutProgress,
        RolloutResult,
        SiteProgress,
        SiteState,
        check_sites,
        check_source,
        evaluate_gate,
        next_batch,
        render_details,
    )
    from fleet.cluster import ServingSpec, ServingStatus
    from fleet.messages.routing import SiteEvent, SiteEventInput
    from fleet.weights_pull import WeightsPull
    from workflows.inputs import check_text, parse_input
    from workflows.refusals import wrong_state
    from workflows.steps import (
        CLUSTER_RETRY, LONG_WATCH_HEARTBEAT, PUT_BACK_RETRY, PUT_BACK_UNTIL, QUICK, STORE_RETRY, WAIT_HEARTBEAT,
        cancelled_by_request, cancelled_words, failure_text,
        show_details, to_its_end, until_in, until_run_began, wait_for_serving,
    )

#: Copying weights: many files over a slow link, so more attempts than a plain provider call;
#: a checksum mismatch is the source's fault and never passes on a retry.
REPLICATE_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), backoff_coefficient=2, maximum_interval=timedelta(seconds=60),
    maximum_attempts=20, non_retryable_error_types=[*NON_RETRYABLE_TYPES, "ChecksumMismatch"],
)


class _Aborted(Exception):
    pass


class _SiteFailed(Exception):
    def __init__(self, site: str, reason: str) -> None:
        super().__init__(f"{site}: {reason}")
        self.site, self.reason = site, reason

#: Deprecated, to be removed in a later release (docs/design/patches.md, "The rule"): a pause (or an
#: abort) that comes while the rollout waits out an evacuation, or while it asks which sites are
#: evacuating, holds before the batch it was waiting for, and once resumed the batch's sites are
#: looked at again. Every rollout open now started after it; the call stays, deprecated, right before
#: each batch, until no run holding its marker is open.
PAUSE_BEFORE_BATCH_PATCH = "rollout-pauses-before-each-batch"
#: Deprecated, to be removed in a later release (docs/design/patches.md, "The rule"): a weights copy
#: the rollout stops (its abort, Temporal's cancel) is cancelled with ``WAIT_CANCELLATION_COMPLETED``:
#: the copy hears ``cancel_requested`` at its next heartbeat, aborts its open multipart upload and
#: reports cancelled, and the rollout waits for that (twice the copy's heartbeat at most: one that
#: does not answer is timed out), its details saying so. Once every copy has ended, the uploads still
#: open under the rollout's key prefix at each site whose copy did not finish are aborted
#: (``abort_weights_uploads``). Every rollout open now started after it; the call stays, deprecated,
#: as the copies start, until no run holding its marker is open.
OPEN_UPLOADS_PATCH = "rollout-aborts-open-uploads"
#: How long the uploads a site's copy left open are looked for and aborted, retries included.
UPLOADS_CLEAN_UP = timedelta(minutes=2)
#: The longest one wait for evacuated sites lasts: then the rollout looks again itself (a lost
#: answer, a route no look compares, cost at most this).
EVACUATION_WAIT = timedelta(hours=1)


@workflow.defn(name="ModelRollout")
class ModelRollout:
    #: ``run``'s input: the input guard refuses its ``Carried`` fields in a run that did not continue as new.
    INPUT = RolloutRunInput

    def __init__(self) -> None:
        self._p: RolloutProgress | None = None
        self._req: RolloutRunInput | None = None
        self._stores: dict = {}
        self._updated_generation: dict[str, int] = {}
        #: The sites whose update was asked and gave no answer: each may have changed.
        self._unanswered: set[str] = set()
        #: Each site's Deployment before and after our update: what a rollback puts back (its
        #: template and replicas) and how it knows whether that already happened.
        self._before: dict[str, ServingStatus] = {}
        self._after: dict[str, ServingStatus] = {}
        self._paused = False
        self._abort = False
        self._abort_reason = ""
        self._finished = False
        #: Whether the rollout is stopping the weights copies now.
        self._stopping_copies = False
        #: The reason as the runbook last said it; the progress shows it with what a person
        #: must do after it (``_say``).
        self._reason = ""

    # -- operator surface -----------------------------------------------------------------
    @workflow.query
    def progress(self) -> RolloutProgress | None:
        return self._p

    def _accepting(self) -> None:
        """The rollout's state, not the input, refuses an operator's update (``WrongState``).
        One still starting accepts it: an update sent the moment the rollout appears reaches the
        run's first task, whose updates the SDK hands to their handlers before ``run`` has built
        the progress; each handler waits for it (``until_run_began``), then acts."""
        if self._p is None:
            return
        if self._finished:
            raise wrong_state(f"the rollout has finished ({self._p.phase})", self._p.phase)
        if self._abort:
            raise wrong_state("the rollout is being aborted", "aborting")

    @workflow.update
    async def pause(self, reason: Any = "") -> RolloutProgress:
        await until_run_began(lambda: self._p is not None)
        self._paused = True
        self._p.paused = True
        self._say(f"paused by operator{': ' + reason if reason else ''}")
        self._show()
        return self._p

    @pause.validator
    def _validate_pause(self, reason: Any = "") -> None:
        check_text("reason", reason)
        self._accepting()
        if self._paused:
            raise wrong_state("already paused", "paused")

    @workflow.update
    async def resume(self, reason: Any = "") -> RolloutProgress:
        await until_run_began(lambda: self._p is not None)
        self._paused = False
        self._p.paused = False
        self._say(f"resumed by operator{': ' + reason if reason else ''}")
        self._show()
        return self._p

    @resume.validator
    def _validate_resume(self, reason: Any = "") -> None:
        check_text("reason", reason)
        self._accepting()
        if not self._paused:
            raise wrong_state("not paused", self._p.phase if self._p else "starting")

    @workflow.update
    async def abort(self, reason: Any = "") -> RolloutProgress:
        """Stop and roll back every site already updated; returns at once (watch ``progress``)."""
        await until_run_began(lambda: self._p is not None)
        self._abort = True
        self._abort_reason = reason or "aborted by operator"
        self._p.aborting = True
        self._show()
        return self._p

    @abort.validator
    def _validate_abort(self, reason: Any = "") -> None:
        check_text("reason", reason)
        self._accepting()

    # -- helpers --------------------------------------------------------------------------
    def _show(self) -> None:
        if self._p is not None:
            # The domain's rendering (fleet.rollout): its first line is the headline show_details writes.
            head, *rest = render_details(self._p).split("\n")
            detail = head.removeprefix(f"**{self._p.phase}**").strip()
            if self._p.phase == "paused":
                # Held between batches for a person: nothing ends the wait but them.
                rollout_id = workflow.info().workflow_id
                detail += (f"; no deadline: until `gpufleet rollout resume {rollout_id}` (or "
                           f"`gpufleet rollout abort {rollout_id}`, which rolls back the sites updated)")
            show_details(self._p.phase, *rest, detail=detail)

    def _say(self, reason: str) -> None:
        """The progress reason: once a person is needed, what they must do stays after it."""
        self._reason = reason
        self._p.reason = self._p.with_needs_person(reason)

    def _phase(self, phase: str, reason: str | None = None) -> None:
        """The runbook's phase. Once a person is needed (``needs_person``), ``FleetState`` stays
        ``needs-person`` and the reason and details keep saying why, whatever the phase: an
        operator listing or watching the rollout must not lose it to the next step."""
        self._p.phase = phase
        if reason is not None:
            self._say(reason)
        # The same one upsert per phase as ever; only its value differs once a person is needed
        # (a search attribute's value is not compared on replay: no patch).
        state = "needs-person" if self._p.needs_person else phase
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(state)])
        self._show()

    def _set(self, site: str, state: SiteState, detail: str | None = None) -> SiteProgress:
        progress = self._p.site(site)
        progress.state = state
        if detail is not None:
            progress.detail = detail
        self._show()
        return progress

    def _check_abort(self) -> None:
        if self._abort:
            raise _Aborted()

    async def _checkpoint(self) -> None:
        """Between batches: honour abort, hold while paused."""
        self._check_abort()
        if self._paused:
            phase = self._p.phase
            self._phase("paused")
            await workflow.wait_condition(lambda: not self._paused or self._abort)
            self._check_abort()
            self._phase(phase)

    async def _held_before_batch(self) -> bool:
        """``_checkpoint`` again right before a batch: the look at which sites are evacuating, and a
        wait for one to come back (hours, for a canary), lie between the first and the batch. Whether
        it held (paused): the batch's sites are then looked at again, as one may have been evacuated
        while it was paused."""
        workflow.deprecate_patch(PAUSE_BEFORE_BATCH_PATCH)
        held = self._paused
        await self._checkpoint()
        return held

    async def _wait_ready_unless_aborted(self, site: str, ready_by) -> None:
        """The site's Deployment ready by ``ready_by``; an abort meanwhile cancels the wait (the
        caller's ``_check_abort`` then ends the rollout, which rolls the site back), and so does a
        cancel of the rollout (which rolls it back too)."""
        ready = asyncio.ensure_future(wait_for_serving(self._req.model, site, ready_by,
                                                       summary=f"wait until {site} is ready"))
        if not await self._unless_aborted(ready):
            await self._cut_short(ready)
            return
        await ready

    async def _unless_aborted(self, step: asyncio.Future) -> bool:
        """Until ``step`` ends or an abort comes: whether it ended. A cancel of the rollout
        meanwhile cuts the step short and is raised."""
        aborted = asyncio.ensure_future(workflow.wait_condition(lambda: self._abort))
        try:
            await workflow.wait([step, aborted], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            aborted.cancel()
            await self._cut_short(step)
            raise
        aborted.cancel()
        return step.done()

    @staticmethod
    async def _cut_short(ready: asyncio.Future) -> None:
        ready.cancel()
        try:
            await ready
        except (asyncio.CancelledError, ActivityError):
            pass  # cancelled on purpose: the site is rolled back next

    async def _sleep_unless_aborted(self, seconds: float, summary: str) -> None:
        try:
            await workflow.wait_condition(lambda: self._abort, timeout=timedelta(seconds=seconds), timeout_summary=summary)
        except asyncio.TimeoutError:
            pass
        self._check_abort()

    # -- the runbook ----------------------------------------------------------------------
    @workflow.run
    async def run(self, raw: Any) -> RolloutResult:
        request = parse_input(RolloutRunInput, raw)
        self._req = request
        if request.carry is not None:
            self._resume(request.carry)
        else:
            canaries = request.canaries
            files, total = len(request.weights.files), request.weights.total_bytes
            self._p = RolloutProgress(
                rollout_id=request.rollout_id, model=request.model, version=request.version,
                sites=[SiteProgress(site=t.site, replicas=t.replicas, canary=t.site in canaries, bytes_total=total,
                                    files_total=files) for t in request.sites],
            )
        workflow.upsert_search_attributes([
            sa.MODEL.value_set(request.model), sa.MODEL_VERSION.value_set(request.version),
        ])
        try:
            return await self._run_book(request)
        except (ActivityError, asyncio.CancelledError) as error:
            # Temporal's cancel (the UI's button, ``temporal workflow cancel``) at any step: each site
            # it changed is rolled back as an abort does. Before, the cancel ended the run where it
            # was: the canary went on serving the new version, the progress still "baking".
            if not cancelled_by_request(error) or self._finished:
                raise  # not the run's cancel, or one an abort's rollbacks took (``_finish_abort``)
            await self._finish_cancel()
            raise  # the run ends Canceled: a cancel was requested and this is a cancel error

    async def _run_book(self, request: RolloutRunInput) -> RolloutResult:
        if request.carry is None:  # a continued run was validated and replicated by its first
            await self._validate(request)
        try:
            if request.carry is None:
                await self._replicate()
            await self._roll_out()
        except _Aborted:
            return await self._finish_abort()
        except _SiteFailed as failure:
            self._finished = True
            self._phase("failed", f"{failure.site} failed: {failure.reason}")
            # The message ends with "rollback failed at <sites>: needs a person (...)" when one did.
            raise ApplicationError(self._p.reason, {"site": failure.site, "reason": failure.reason,
                                                    "needs_person": self._p.needs_person},
                                   type="RolloutFailed", non_retryable=True) from None
        self._finished = True
        failed = [s.site for s in self._p.sites if s.state != SiteState.DONE]
        outcome = "completed-with-failures" if failed else "completed"
        self._phase(outcome, f"not updated: {', '.join(failed)}" if failed else "every site serves " + request.version)
        return RolloutResult(rollout_id=request.rollout_id, outcome=outcome, sites=self._p.sites, reason=self._p.reason,
                             needs_person=self._p.needs_person)

    async def _validate(self, request: RolloutInput) -> None:
        self._phase("validating")
        sites: RolloutSites = await workflow.execute_activity(
            act.resolve_rollout_sites, ResolveRolloutSitesInput(sites=[t.site for t in request.sites],
                                                                model=request.model, weights=request.weights),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary="look up target sites and their object stores",
        )
        problems = check_sites(request, sites.stores, sites.known, sites.gpus_per_machine)
        problems = sites.problems + check_source(request, sites.object_stores) + problems
        if problems:
            self._finished = True
            self._phase("failed", "; ".join(problems))
            raise ApplicationError("invalid ModelRollout: " + "; ".join(problems), {"problems": problems},
                                   type="InvalidInput", non_retryable=True)
        self._stores = sites.stores

    # -- 1. weights -----------------------------------------------------------------------
    async def _replicate(self) -> None:
        self._phase("replicating")
        # Asked before the copies start (how they are cancelled is decided as each is scheduled).
        workflow.deprecate_patch(OPEN_UPLOADS_PATCH)
        tasks = {t.site: asyncio.ensure_future(self._replicate_site(t.site)) for t in self._req.sites}
        try:
            await workflow.wait_condition(lambda: self._abort or all(t.done() for t in tasks.values()))
        except asyncio.CancelledError:
            await self._stop_copies(tasks, cancelled_words())  # a cancel stops the copies as an abort does
            raise
        if self._abort:
            await self._stop_copies(tasks, self._abort_reason)
            raise _Aborted()
        await to_its_end(asyncio.ensure_future(
            self._abort_open_uploads([s for s in tasks if self._p.site(s).state == SiteState.FAILED])))
        if workflow.cancellation_reason() is not None:
            raise asyncio.CancelledError()  # the run's cancel, taken as the uploads were aborted: rolls back
        failed = [s for s in self._req.canaries if self._p.site(s).state == SiteState.FAILED]
        if failed:
            raise _SiteFailed(failed[0], "weights replication: " + self._p.site(failed[0]).detail)

    async def _stop_copies(self, tasks: dict[str, asyncio.Future], why: str) -> None:
        """Stop the copies still running (an abort, the run's cancel). Each copy aborts its open
        upload as it stops, the rollout waits for that (a cancel of the run landing meanwhile is
        taken: ``_finish_abort`` ends the run as it asked), then aborts what they left open."""
        copying = [site for site, task in tasks.items() if not task.done()]
        if copying:
            by = until_in(2 * self._req.replication.heartbeat_seconds)
            for site in copying:
                self._p.site(site).detail = (f"stopping the copy: at its next heartbeat it aborts its open upload, "
                                             f"which nothing would resume; waiting for that {by} at the latest")
            self._say(f"{why}: waiting for the weights copies to {', '.join(copying)} to stop and abort their "
                      f"open uploads (else stored and billed for good), {by} at the latest")
            self._show()
        self._stopping_copies = True
        for task in tasks.values():
            task.cancel()
        await to_its_end(asyncio.gather(*tasks.values(), return_exceptions=True))
        await to_its_end(asyncio.ensure_future(
            self._abort_open_uploads([s for s in tasks if self._p.site(s).state != SiteState.REPLICATED])))

    async def _abort_open_uploads(self, sites: list[str]) -> None:
        """Abort the multipart uploads open under the rollout's key prefix at ``sites``, whose copies
        ended without finishing (stopped, failed): what a stop that landed between two tries, a try
        that never answered or one that failed for good left, which no copy resumes. Run once no
        copy of the rollout runs; the model's claim keeps every other rollout off the prefix. Best
        effort: a store that refuses it (its credentials lack s3:ListBucketMultipartUploads) is
        named in the site's row, and the rollout goes on."""
        async def one(site: str) -> None:
            store, progress = self._stores[site], self._p.site(site)
            prefix, base = self._req.dest_prefix(store), progress.detail
            where = f"s3://{store.bucket}/{prefix}"
            progress.detail = (f"{base}; aborting the uploads left open under {where} "
                               f"{until_in(UPLOADS_CLEAN_UP.total_seconds())} at the latest")
            self._show()
            try:
                done: AbortedUploads = await workflow.execute_activity(
                    act.abort_weights_uploads, AbortUploadsInput(site=site, prefix=prefix),
                    start_to_close_timeout=QUICK, schedule_to_close_timeout=UPLOADS_CLEAN_UP, retry_policy=STORE_RETRY,
                    summary=f"abort the uploads left open under {where}",
                )
            except ActivityError as error:
                progress.detail = f"{base}; uploads left open under {where} not aborted: {failure_text(error)}"
            else:
                progress.detail = base + (f"; {len(done.keys)} upload(s) left open aborted" if done.keys else "")
            self._show()

        await asyncio.gather(*(one(site) for site in sites))

    def _replicate_input(self, site: str, store) -> ReplicateInput:
        request, source = self._req, self._req.weights.source
        common = dict(site=site, files=request.weights.files, dest_prefix=request.dest_prefix(store),
                      options=request.replication)
        return ReplicateInput(source_store=source.store, source_prefix=source.prefix, **common)

    async def _replicate_site(self, site: str) -> None:
        request, options = self._req, self._req.replication
        store = self._stores[site]
        # The activity's limit is one try's: a try that fails (a lost worker) resumes the copy.
        self._set(site, SiteState.REPLICATING, f"copying {len(request.weights.files)} weight files to "
                                               f"s3://{store.bucket} {until_in(options.timeout_seconds)} (per try)")
        try:
            result: ReplicateResult = await workflow.execute_activity(
                act.replicate_weights,
                self._replicate_input(site, store),
                activity_id=f"replicate/{site}",
                start_to_close_timeout=timedelta(seconds=options.timeout_seconds),
                heartbeat_timeout=timedelta(seconds=options.heartbeat_seconds), retry_policy=REPLICATE_RETRY,
                summary=f"copy {len(request.weights.files)} weight files to {site} (s3://{store.bucket})",
                # A stopped copy aborts its open upload, and the rollout waits for it (_stop_copies).
                cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            )
        except ActivityError as error:
            if self._stopping_copies:
                # Stopped by the rollout and waited for: cancelled (its upload aborted), or one that did
                # not answer (timed out) or failed as it stopped.
                self._p.site(site).detail = ("copy stopped" if is_cancelled_exception(error)
                                             else f"copy stopped: {failure_text(error)}")
                self._show()
                return
            if cancelled_by_request(error):
                self._p.site(site).detail = "copy stopped"  # no longer copying until then
                raise  # the rollout's cancel, not the copy's failure
            self._set(site, SiteState.FAILED, failure_text(error))
            return
        progress = self._set(
            site, SiteState.REPLICATED,
            f"weights: {sum(v in ('copied', 'recopied') for v in result.files.values())} copied, "
            f"{sum(v == 'skipped' for v in result.files.values())} already there",
        )
        progress.bytes_done, progress.files_done = result.bytes_total, len(result.files)
        self._show()

    # -- 2. + 3. serving ------------------------------------------------------------------
    async def _roll_out(self) -> None:
        request = self._req
        # The sites still to update: in a fresh run every canary (a failed copy to one stopped the
        # rollout) and each other site whose weights are there; in a continued run those of them
        # its first did not update yet.
        queued = {SiteState.REPLICATED, SiteState.DEFERRED}
        canaries = [c for c in request.canaries if self._p.site(c).state in queued]
        queue = [t.site for t in request.sites
                 if t.site not in request.canaries and self._p.site(t.site).state in queued]
        size = request.strategy.batch_size
        if request.carry is None:
            self._p.batches = len(canaries) + -(-len(queue) // size)
        for canary in canaries:
            await self._checkpoint()
            self._phase("canary")
            await self._wait_until_not_evacuating(canary)
            while await self._held_before_batch():
                await self._wait_until_not_evacuating(canary)  # it may be evacuated again meanwhile
            await self._run_batch([canary])
        while queue:
            await self._checkpoint()
            self._phase("rolling-out")
            evacuating = await self._evacuations(queue)
            batch, deferred = next_batch(queue, evacuating, size)
            until = None
            if not batch:
                until = self._evacuation_wait_ends()
            for site in queue:
                if site in deferred:
                    self._set(site, SiteState.DEFERRED, f"under evacuation ({evacuating[site]}); queued until restored "
                                                        f"({self._next_look(until)})")
                elif self._p.site(site).state == SiteState.DEFERRED:
                    self._set(site, SiteState.REPLICATED, "restored; queued")
            if not batch:
                await self._wait_for_evacuations(evacuating, until)
                continue
            if await self._held_before_batch():
                continue  # a fresh look at which sites are evacuating: the pause may have lasted days
            await self._run_batch(batch)
            queue = [s for s in queue if s not in batch]

    async def _evacuations(self, sites: list[str]) -> dict[str, str]:
        return await workflow.execute_activity(
            act.site_evacuations, EvacuationInput(model=self._req.model, sites=sites),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary="which sites are under evacuation",
        )

    def _next_look(self, until: datetime | None = None) -> str:
        """When a deferred site is looked at again: an evacuation ends by restore, abort, cancel or
        failure, and each restores the site's routes, which the next look sees. Waiting in one
        activity (``until``), the routes are read every poll in the worker, and the rollout
        looks again itself at ``until`` at the latest."""
        poll = self._req.strategy.evacuation_poll_seconds
        if until is not None:
            return f"watched every {poll:g} s, next look at {until:%H:%M:%S} UTC at the latest"
        return f"next look at {workflow.now() + timedelta(seconds=poll):%H:%M:%S} UTC"

    def _evacuation_wait_ends(self) -> datetime:
        poll = timedelta(seconds=self._req.strategy.evacuation_poll_seconds)
        return workflow.now() + max(EVACUATION_WAIT, poll)

    async def _wait_until_not_evacuating(self, site: str) -> None:
        while True:
            evacuating = await self._evacuations([site])
            if site not in evacuating:
                return
            until = self._evacuation_wait_ends()
            self._set(site, SiteState.DEFERRED, f"under evacuation ({evacuating[site]}); waiting until restored "
                                                f"({self._next_look(until)})")
            await self._wait_for_evacuations(evacuating, until)

    async def _wait_for_evacuations(self, seen: dict[str, str], until: datetime) -> None:
        """Until the sites' evacuations differ from ``seen`` (one came back) or ``until``: one
        activity, whatever the outage's length, which an abort or a cancel cuts short. Nothing
        else is in flight here, so this is where the rollout continues as new when told to."""
        await self._continue_as_new_if_suggested()
        sites = ", ".join(seen)
        wait = asyncio.ensure_future(workflow.execute_activity(
            act.wait_site_evacuations,
            EvacuationWaitInput(model=self._req.model, seen=seen, until=until,
                                poll_seconds=self._req.strategy.evacuation_poll_seconds),
            start_to_close_timeout=until - workflow.now() + QUICK, heartbeat_timeout=LONG_WATCH_HEARTBEAT,
            retry_policy=CLUSTER_RETRY, summary=f"until {sites} come back from evacuation",
        ))
        if not await self._unless_aborted(wait):
            await self._cut_short(wait)
        self._check_abort()
        await wait  # failed past its retries (the cluster refusing): the rollout fails, as a look did

    async def _continue_as_new_if_suggested(self) -> None:
        """Called only in the wait for evacuated sites, between batches: no site is being updated
        and no activity is open, so the carry is the whole state, and the next run goes on with
        the sites still queued."""
        if not workflow.info().is_continue_as_new_suggested():
            return
        await workflow.wait_condition(workflow.all_handlers_finished)
        self._check_abort()
        carry = RolloutCarry(progress=self._p, stores=self._stores, before=self._before, after=self._after,
                             updated_generation=self._updated_generation, paused=self._paused, reason=self._reason)
        workflow.continue_as_new(self._req.model_copy(update={"carry": carry}).model_dump(mode="json"))

    def _resume(self, carry: RolloutCarry) -> None:
        self._p, self._stores, self._paused, self._reason = carry.progress, carry.stores, carry.paused, carry.reason
        self._before, self._after = carry.before, carry.after
        self._updated_generation = carry.updated_generation

    async def _run_batch(self, batch: list[str]) -> None:
        self._p.batch += 1
        self._show()
        results = await asyncio.gather(*[self._update_site(site) for site in batch], return_exceptions=True)
        if self._abort or any(isinstance(r, _Aborted) for r in results):
            raise _Aborted()
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _update_site(self, site: str) -> None:
        """Update, wait ready, probe, bake, probe; a failure rolls this site back."""
        request, gate = self._req, self._req.strategy.gate
        store = self._stores[site]
        progress = self._set(site, SiteState.UPDATING, f"to {request.image}")
        before: Optional[ServingStatus] = await workflow.execute_activity(
            act.serving_snapshot, ServingRef(model=request.model, site=site),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary=f"current serving at {site}",
        )
        progress.previous_generation = before.generation if before else None
        progress.previous_image = before.image if before else ""
        if before is not None:
            self._before[site] = before
        self._check_abort()
        env = {
            **request.env,
            "MODEL_NAME": request.model,
            "MODEL_VERSION": request.version,
            "WEIGHTS_URI": f"s3://{store.bucket}/{request.dest_prefix(store)}",
        }
        if store.endpoint_url:
            env["AWS_ENDPOINT_URL_S3"] = store.endpoint_url
        # Pods pull the verified weights from the site's store into the node's cache (an init
        # step), and the site's new version reaches the routes through its Routing entity.
        spec = ServingSpec(
            model=request.model, site=site, image=request.image, replicas=request.replicas(site),
            gpus_per_replica=request.gpus_per_replica, args=request.args, weights_path=request.weights_path,
            env=env, port=request.port,
            # The store as the config names it: its credentials are a reference, never a secret.
            weights=WeightsPull(model=request.model, version=request.version, store=store,
                                prefix=request.dest_prefix(store), files=request.weights.files),
        )
        try:
            await self._update(spec, before)
            ready_by = workflow.now() + timedelta(seconds=gate.ready_timeout_seconds)
            how = ""
            if self._one_at_a_time(site):
                how = f"no room for a surge replica at {site}: replacing one at a time" + (
                    " (its one replica is down until the new one is ready; the other sites serve)"
                    if spec.replicas == 1 else "") + "; "
            self._set(site, SiteState.UPDATING, f"{how}waiting for {spec.replicas} replicas of {request.version} "
                                                f"to be ready, until {ready_by:%H:%M:%S} UTC")
            await self._wait_ready_unless_aborted(site, ready_by)
            self._check_abort()
            await self._gate(site, "gate")
            if gate.bake_seconds > 0:
                baked_at = workflow.now() + timedelta(seconds=gate.bake_seconds)
                self._set(site, SiteState.BAKING, f"{gate.bake_seconds:.0f}s, until {baked_at:%H:%M:%S} UTC, "
                                                  "then the gate again")
                await self._sleep_unless_aborted(gate.bake_seconds, f"bake {site}")
                await self._gate(site, "after bake")
        except ActivityError as error:
            if cancelled_by_request(error):
                raise  # the rollout's cancel, not the site's failure: it rolls back every site it changed
            raise _SiteFailed(site, await self._roll_back_after(site, failure_text(error))) from None
        except _SiteFailed as failure:
            raise _SiteFailed(site, await self._roll_back_after(site, failure.reason)) from None
        done = f"serving {request.version}"
        if self._one_at_a_time(site):
            done += " (replaced one at a time: no room for a surge replica" + (
                "; its one replica was down until the new one was ready)" if spec.replicas == 1 else ")")
        self._set(site, SiteState.DONE, done)
        await self._tell_routing(site)

    def _one_at_a_time(self, site: str) -> bool:
        """Whether ``update_serving`` found no GPUs at ``site`` for a surge replica and replaced
        its replicas one at a time (not where it surged, made the Deployment or changed nothing)."""
        before, after = self._before.get(site), self._after.get(site)
        return (before is not None and after is not None and after.max_surge == 0
                and after.template != before.template)

    async def _update(self, spec: ServingSpec, before: Optional[ServingStatus]) -> None:
        """Apply ``spec`` at its site. Until the answer comes the site may have changed
        (``_unanswered``): one call to the cluster, which hears no cancel, or whose first half
        (the Deployment, not yet its Service) may have been written before it failed."""
        site = spec.site
        self._unanswered.add(site)
        update = workflow.start_activity(
            act.update_serving, UpdateServingInput(spec=spec),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary=f"{spec.model} {self._req.version} at {site}: {spec.replicas} replicas",
        )
        try:
            status: ServingStatus = await asyncio.shield(update)
        except asyncio.CancelledError:
            # The call hears no cancel and applies anyway: no cancel is sent, its answer (its retries
            # too) is awaited, then the rollout's cancel rolls the site back with the others.
            try:
                status = await update
            except ActivityError:
                raise asyncio.CancelledError() from None  # still unanswered: rolled back where it landed
            self._answered(site, before, status)
            raise
        self._answered(site, before, status)

    def _answered(self, site: str, before: Optional[ServingStatus], status: ServingStatus) -> None:
        self._unanswered.discard(site)
        if before is None or status.generation != before.generation:
            self._updated_generation[site] = status.generation  # changed: rollback has something to undo
            self._after[site] = status

    def _may_have_changed(self, site: str) -> bool:
        """``site`` changed by the rollout, or possibly changed: its update gave no answer."""
        return site in self._updated_generation or site in self._unanswered

    async def _tell_routing(self, site: str) -> None:
        """A new version (or a site new to the model) is serving: its Routing entity samples
        the site's Ready replicas now (a new site gets its route)."""
        event = SiteEvent(kind="rollout", site=site, detail=f"{self._req.model} {self._req.version}"[:500])
        try:
            await workflow.execute_activity(
                act.routing_event, SiteEventInput(event=event, models=[self._req.model]),
                start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                summary=f"routing of {self._req.model}: {site} serves {self._req.version}",
            )
        except ActivityError as error:
            if cancelled_by_request(error):
                raise
            # The site serves either way, and the entity's next sample finds it.
            self._p.site(site).detail += f"; routing not told: {failure_text(error)}"
            self._show()

    async def _gate(self, site: str, when: str) -> None:
        gate = self._req.strategy.gate
        self._set(site, SiteState.GATING, f"{gate.probe_requests} probe requests ({when})")
        probe: ProbeResult | None = None
        if gate.probe_requests:
            probe = await workflow.execute_activity(
                act.probe_serving,
                ProbeServingInput(model=self._req.model, site=site, requests=gate.probe_requests,
                                  timeout_seconds=gate.probe_timeout_seconds),
                start_to_close_timeout=timedelta(seconds=gate.probe_timeout_seconds * gate.probe_requests + 60),
                # The probes can take minutes: a worker lost meanwhile is retried within a minute.
                heartbeat_timeout=WAIT_HEARTBEAT,
                retry_policy=CLUSTER_RETRY, summary=f"{gate.probe_requests} probe requests to {site}",
            )
        verdict = evaluate_gate(gate, True, probe)
        self._check_abort()
        if not verdict.passed:
            raise _SiteFailed(site, f"health gate ({when}): {verdict.reason}")
        self._set(site, SiteState.GATING, f"gate passed ({when}): {verdict.reason}")

    async def _roll_back_after(self, site: str, why: str) -> str:
        """Roll ``site`` back after it failed: ``why``, and "rolled back" only when it was (when
        not, ``needs_person`` names the site, and the rollout's reason ends with it)."""
        return f"{why}; rolled back" if await self._rollback(site, why) else why

    async def _rollback(self, site: str, reason: str) -> bool:
        """Put ``site`` back as it was before the update: whether that was done. A rollback that
        fails (refused for good: anything else is retried until done) marks the site FAILED and
        the rollout as needing a person, naming the site and why."""
        if not self._may_have_changed(site):
            self._set(site, SiteState.ROLLED_BACK, f"{reason} (the Deployment was not changed)")
            return True
        progress = self._p.site(site)
        # Retried until done: the row says so (before, only the reason: an API server away for an hour
        # left the site "rolling-back" with nothing saying the rollout waits on it, nor until when).
        back_to = progress.previous_image or "nothing (its Deployment removed)"
        self._set(site, SiteState.ROLLING_BACK, f"{reason}; rolling back to {back_to}: {PUT_BACK_UNTIL}")
        rollback = workflow.start_activity(
            act.rollback_site,
            self._undo(site, had_previous=progress.previous_generation is not None),
            # Until done, as every put-back: after ten attempts (a few minutes of API-server
            # trouble) the site was left FAILED serving the version it was rolled back from,
            # and nothing tried again. A rollback refused for good still fails at once.
            start_to_close_timeout=QUICK, retry_policy=PUT_BACK_RETRY,
            summary=f"roll {site} back to " + (progress.previous_image or "nothing (remove)"),
        )
        try:
            # A cancel of the rollout while a site is put back (an abort's, a failed site's) must not
            # stop it: the site would be left FAILED, serving the new version.
            await to_its_end(rollback)
        except ActivityError as error:
            why = failure_text(error)
            self._p.rollback_failed_at(site, why)
            self._say(self._reason)  # the reason shown now says a person is needed, and where
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("needs-person")])
            self._set(site, SiteState.FAILED, f"{reason}; rollback failed: {why}")
            return False
        self._set(site, SiteState.ROLLED_BACK, reason)
        return True

    def _undo(self, site: str, had_previous: bool) -> RollbackSiteInput:
        """What the rollback of ``site`` puts back, and what it finds if that already happened."""
        before, after = self._before.get(site), self._after.get(site)
        undo = RollbackSiteInput(
            model=self._req.model, site=site, had_previous=had_previous,
            updated_generation=self._updated_generation.get(site, 0),
            previous_template=before.template if before else "", updated_template=after.template if after else "",
            previous_replicas=before.desired_replicas if before else None,
            updated_replicas=after.desired_replicas if after else None,
        )
        if site in self._unanswered:  # what the update asked for: the rollback looks whether it landed
            undo.unanswered_image, undo.updated_replicas = self._req.image, self._req.replicas(site)
        return undo

    async def _finish_abort(self) -> RolloutResult:
        self._phase("aborting", self._abort_reason)
        rolled_back = await self._roll_back_touched(self._abort_reason)
        done = f"rolled back: {', '.join(rolled_back) or 'none'}"
        if workflow.cancellation_reason() is not None:
            # Temporal's cancel came while the abort rolled back (the rollbacks ran to their end): the
            # run ends Canceled as the cancel asked. Ended "aborted", the operator's cancel was lost.
            self._phase("cancelled", f"{cancelled_words()} as it rolled back ({self._abort_reason}); {done}")
            raise asyncio.CancelledError()
        self._phase("aborted", f"{self._abort_reason}; {done}")
        return RolloutResult(rollout_id=self._p.rollout_id, outcome="aborted", sites=self._p.sites,
                             reason=self._p.reason, needs_person=self._p.needs_person)

    async def _finish_cancel(self) -> None:
        """Cancelled: the abort's rollbacks, and the progress says it was cancelled."""
        why = cancelled_words()
        self._phase("cancelling", why)
        rolled_back = await self._roll_back_touched(why)
        self._phase("cancelled", f"{why}; rolled back: {', '.join(rolled_back) or 'none'}")

    async def _roll_back_touched(self, reason: str) -> list[str]:
        """Roll back every site the rollout changed, the last first; the others are skipped. The
        sites that are back: one whose rollback failed is named by ``needs_person``."""
        touched = [s.site for s in self._p.sites if (s.state in TOUCHED or s.state == SiteState.ROLLING_BACK)
                   and self._may_have_changed(s.site)]
        for site in reversed(touched):
            await self._rollback(site, reason)
        for s in self._p.sites:
            if s.state not in (SiteState.ROLLED_BACK, SiteState.FAILED):
                s.state = SiteState.SKIPPED
        self._finished = True
        self._p.aborting = False
        return [site for site in touched if self._p.site(site).state == SiteState.ROLLED_BACK]
