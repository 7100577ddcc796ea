"""AcquireCapacity (id ``capacity/<request>``): ranked fallback across sites and providers.

The runbook: refuse what no configured site can ever serve (fleet.feasibility: an
empty request, an unknown site, GPU or geography, an impossible combination, a
``count`` more than the eligible sites' ``max_nodes`` together;
``InvalidInput`` naming the field, nothing bought) → read the catalog → rank the offers for the request's constraints
(fleet.placement) → join the best candidate through a NodeJoin child, several
nodes at once (bounded) → on each failure apply the three-error rule:

- NoCapacity: that offer is out of the ranking for a while (TTL); next candidate. A TTL of 0
  keeps it out until the next look at the offers, which comes after a wait for capacity.
- OverQuota: the account's ProviderAccount entity blocks that offer until a
  person raises the quota; next candidate.
- BadCredentials: the account is revoked (no activity calls it any more, from
  any workflow); next candidate.
- InvalidRequest: the request is wrong; fail it with the reason.

A call to our own stores that fails past its retries (the API server or Temporal away for
minutes, a 403 after an RBAC mistake) does not end the request: an account not told of an
OverQuota or BadCredentials is said in that join's attempt, and the request goes on, keeping the
offer blocked or the account revoked over its catalog reads (whose store still says otherwise)
until one shows the store holds it; and a catalog read that failed is shown ("could not read the
catalog (…); next try at …") and tried again after a growing pause, until the deadline or a
cancel, continuing as new when the server suggests it. Raised, either failed the request, and
its joins in flight were cancelled with it: machines about to join deleted.

When nothing qualifies it waits ("waiting for capacity": each offer it may not buy
now and who can change that, e.g. a revoked account and the command a person runs),
backing off 5 → 30 min, and looks again early when offers change (a catalog
refresh, an account unblocked) — until the deadline. Once the deadline has passed no
join starts (nothing more is bought); the joins in flight then finish (each may still
deliver its node) and the request returns what joined, its details and result naming
the deadline.
The spend cap is checked against joined plus in-flight machines, so it is never
exceeded. A long wait continues as new when the server suggests it, right
after a backoff ends or a failed catalog read's pause (no join in flight then), carrying what
joined, every attempt, the excluded offers, the deadline, the join numbering and what its
accounts' stores were not told.

``cancel`` (update; also Temporal's own cancel) stops buying: every join in
flight is cancelled and deletes its machine, nodes already joined stay, and so
does the node of a join that was admitting it as the cancel came (counted joined,
its cost with it); the update answers once that is done, naming each join it stopped.

CatalogRefresh (id ``catalog-refresh``, run by a Schedule): refresh every site's
offers and, when they changed since its last run, wake the requests waiting for capacity
(each reads what it listed: one listing for them all).
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any, NoReturn

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import activities as act
    from fleet.messages.capacity import (
        ATTEMPT_MESSAGE_CHARS,
        ATTEMPTS_KEPT,
        CapacityCarry,
        CapacityProgress,
        CapacityRequest,
        CapacityResult,
        Catalog,
        CatalogRefreshInput,
        ExcludedOffer,
        GetCatalogInput,
        JoinAttempt,
        ReportAccountInput,
        WAITING_FOR_CAPACITY,
        WakeRequestsInput,
    )
    from fleet import search_attributes as sa
    from fleet.models import AccountState, append_bounded
    from fleet.naming import join_workflow_id
    from fleet.placement import AccountView, Candidate, Placement, rank
    from fleet.feasibility import EMPTY, count_problems, request_problems, waiting_for
    from workflows.inputs import check_text, invalid_input, parse_input
    from fleet.messages.join import TOKEN_CHECKS, JoinedNode, JoinTimeouts, NodeJoinResult
    from workflows.node_join import NodeJoin
    from workflows.passes import FailedPasses
    from workflows.steps import (
        MAX_PROBLEM_SHOWN,
        PROVIDER_RETRY,
        QUICK,
        STORE_RETRY,
        cancelled_by_request,
        failure_message,
        failure_text,
        failure_type,
        join_until,
        show_details,
    )

#: Failures no other site can fix: a wrong request, and a cluster permission the control
#: plane lacks (ClusterForbidden fails every join at every site alike, so trying the next
#: one only buys and deletes more machines).
FATAL = ("InvalidRequest", "InvalidInput", "ClusterForbidden")

#: Deprecated, to be removed in a later release (docs/design/patches.md, "The rule"): an offer that
#: said NoCapacity under ``unavailable_ttl_seconds: 0`` is out of the ranking until the request next
#: reads the catalog (after its wait for capacity: the backoff, or a wake), not joined again at once.
#: Every request open now started after it; the call stays, deprecated, where such an answer is
#: taken, until no run holding its marker is open.
TTL_0_WAITS_PATCH = "capacity-ttl-0-waits-before-trying-again"
#: Why an offer is out of the ranking under that patch (its details and ``waiting_for``).
NO_CAPACITY_UNTIL_NEXT_LOOK = "no capacity (tried again at the next look at the offers)"


def _names_what(req: CapacityRequest) -> bool:
    """The request says what to buy (a GPU or the sites): otherwise it is refused before the catalog is read."""
    c = req.constraints
    return bool(c.gpu) or c.gpu_class is not None or c.sites is not None


@workflow.defn(name="AcquireCapacity")
class AcquireCapacity:
    #: ``run``'s input: the input guard refuses its ``Carried`` fields in a run that did not continue as new.
    INPUT = CapacityRequest

    def __init__(self) -> None:
        self._progress = CapacityProgress(step="starting")
        self._offers_changed = 0
        #: A wake during this wait came without a fresh listing (an account unblocked): list again.
        self._wake_needs_listing = False
        self._fleet_state = ""
        #: The ``cancel`` update's reason, once asked.
        self._cancel = ""
        #: Joins in flight: task → (offer, join workflow id).
        self._in_flight: dict[asyncio.Task, tuple[Candidate, str]] = {}
        #: When each join in flight was started (its id → workflow time): what bounds it is its own
        #: timeouts from then, not the request's deadline. Never carried: a run continues as new
        #: only with no join in flight.
        self._join_began: dict[str, datetime] = {}
        self._joined: list[JoinedNode] = []
        #: The catalog last read (None until the first read went through) and its failed reads.
        self._catalog_now: Catalog | None = None
        self._catalog_reads = FailedPasses()
        #: Why the last catalog read failed ("" once one went through).
        self._catalog_failed = ""
        #: Account → what this request saw of it (revoked, offers blocked over quota) that its store
        #: could not be told (a report that failed): put over every catalog read, since the store
        #: still says otherwise, and a read that took its word called a revoked account again (rule
        #: 6: no more calls). Dropped once a read shows the store holds it: then a person's fix shows.
        self._not_told: dict[str, AccountView] = {}
        #: Offers that said NoCapacity under a TTL of 0 since the catalog was last read: out of the
        #: ranking until the next read, which follows a wait for capacity. Not carried: a run
        #: continues as new only before a read (after a wait, or a failed read's pause).
        self._no_capacity_until_read: set[str] = set()

    @workflow.signal
    def offers_changed(self, listed: Any = False) -> None:
        """A catalog refresh or an unblocked account: look again now. ``listed`` (``True`` from a
        refresh that has just listed every site's offers): read the catalog as stored, with no
        listing of its own; anything else (an account unblocked, a sender from before it): list."""
        self._offers_changed += 1
        if listed is not True:
            self._wake_needs_listing = True

    @workflow.query
    def progress(self) -> CapacityProgress:
        return self._progress

    @workflow.update
    async def cancel(self, reason: Any = "") -> CapacityProgress:
        """Stop buying: every join in flight is cancelled (each deletes its machine, unless it was
        admitting its node as the cancel came: that node stays), nodes already joined stay.
        Answers once that is done, with what it stopped."""
        if not self._cancel and not self._progress.finished:
            self._cancel = reason or "cancelled"
        await workflow.wait_condition(lambda: self._progress.finished)
        return self._progress

    @cancel.validator
    def _validate_cancel(self, reason: Any = "") -> None:
        check_text("reason", reason)

    @workflow.signal
    def stop(self, reason: Any = "") -> None:
        """``cancel`` for a workflow that started this one (a workflow cannot send updates): the
        same wind-down, and the request still returns its result (the nodes that joined)."""
        try:
            reason = check_text("reason", reason)
        except ApplicationError as error:
            workflow.logger.warning("dropped signal stop: %s", error.message)
            return
        if not self._cancel and not self._progress.finished:
            self._cancel = reason or "stopped by the workflow that started it"

    # -- operator surface -----------------------------------------------------------------
    def _state(self, state: str) -> None:
        if state != self._fleet_state:
            self._fleet_state = state
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(state)])

    def _show(self, step: str, placement: Placement | None = None, detail: str = "") -> None:
        p = self._progress
        p.step = step
        if placement is not None:
            p.candidates = [f"{c.key} ${c.effective_price:.2f}/GPU-h" for c in placement.candidates]
            p.rejected = placement.reasons()
        lines = [f"joined {p.joined} of {p.requested}"]
        if p.deadline is not None and not p.finished:
            passed = "deadline passed at" if workflow.now() >= p.deadline else "gives up at"
            lines[0] += f"; {passed} {p.deadline.isoformat(timespec='seconds')}"
        if p.in_flight:
            lines.append("joining: " + ", ".join(p.in_flight))
        if p.waiting_for:
            lines.append("waiting for:")
            lines += [f"- {w}" for w in p.waiting_for]
        if p.released:
            lines.append("stopped: " + ", ".join(p.released))
        if p.candidates:
            lines.append("candidates: " + "; ".join(p.candidates[:5]))
        # An offer the request waits for is named there, with what ends the wait: not again here.
        waited = {w.split(": ", 1)[0] for w in p.waiting_for}
        lines += [f"- not {r}" for r in p.rejected if r.split(": ", 1)[0] not in waited]
        lines += [f"- tried {a.offer}: {a.outcome}" + (f" ({a.message})" if a.message else "") for a in p.attempts[-10:]]
        show_details(step, *lines, detail=detail)

    def _attempted(self, offer: str, outcome: str, message: str) -> JoinAttempt:
        """One join's outcome kept in ``attempts``: the newest ``ATTEMPTS_KEPT``, each message cut."""
        attempt = JoinAttempt(offer=offer, outcome=outcome, message=message[:ATTEMPT_MESSAGE_CHARS])
        append_bounded(self._progress.attempts, attempt, ATTEMPTS_KEPT)
        return attempt

    def _track(self) -> None:
        self._progress.in_flight = [c.key for c, _ in self._in_flight.values()]
        self._progress.joins = [join_id for _, join_id in self._in_flight.values()]
        self._join_began = {j: at for j, at in self._join_began.items() if j in self._progress.joins}

    def _joins_until(self) -> str:
        """The bound of the joins in flight: the last one's, by its own timeouts (the request's
        deadline stops no join in flight)."""
        began = [self._join_began[j] for _, j in self._in_flight.values() if j in self._join_began]
        if not began:
            return ""
        return f", the last {join_until(max(began), self._req.join_timeouts or JoinTimeouts())}"

    # -- the runbook ----------------------------------------------------------------------
    @workflow.run
    async def run(self, raw: Any) -> CapacityResult:
        try:
            return await self._run(raw)
        except asyncio.CancelledError:
            # Cancelled from outside: nothing more is bought, and no join is left running for nobody.
            if self._in_flight:
                await self._stop_joins("the request was cancelled")
                self._state("cancelled")
                self._show("cancelled", None, f"{len(self._progress.released)} joins stopped, "
                                              f"{len(self._joined)} joined nodes stay")
            raise
        finally:
            self._progress.finished = True
            self._progress.wait_until = None
            # A ``cancel`` update still waiting for its answer gets it before the run closes.
            await workflow.wait_condition(workflow.all_handlers_finished)

    async def _run(self, raw: Any) -> CapacityResult:
        """The runbook: check the request, read the catalog, then until enough nodes joined (or
        the deadline, a fatal failure, too many failed joins, a cancel): start the best joins,
        or wait for capacity when none can start; take each join's outcome as it ends."""
        req = self._begin(raw)
        self._show("reading the catalog")
        # A continued run resumes right after a backoff or a failed read, where the catalog is
        # always read afresh.
        read = await self._read_catalog(force=req.carry is not None)
        if read and self._unchecked:  # a continued run was checked by its first, once it read the catalog
            self._unchecked = False
            catalog = self._catalog_now
            self._refuse(request_problems(req.constraints, catalog.sites, catalog.offers))
            self._refuse(count_problems(req.count, req.constraints, catalog.sites, catalog.offers))
        # No catalog (never read by the deadline or a cancel): nothing is bought, the run ends below.
        while (self._catalog_now is not None and len(self._joined) < req.count and self._fatal is None
               and self._other_failures <= req.max_other_failures and not self._cancel):
            ranked = self._start_joins()
            if self._in_flight:
                await self._take_ended_joins(ranked)
                continue
            if workflow.now() >= self._deadline:
                break
            listing = await self._wait_for_capacity(ranked)
            if self._cancel:
                break
            await self._continue_as_new_if_suggested()
            self._state("acquiring")
            await self._read_catalog(force=listing)
        self._progress.waiting_for = []
        if self._cancel:
            return await self._cancelled(req, self._costs)
        if self._fatal is not None:
            await self._fail()
        return await self._result()

    def _begin(self, raw: Any) -> CapacityRequest:
        """1. The request checked (refused at start, naming the field, if it names nothing to buy)
        and the carry of an earlier run taken up."""
        # A request's first run only: a continued one was checked by its first.
        first_run = not (isinstance(raw, dict) and raw.get("carry") is not None)
        req = parse_input(CapacityRequest, raw, context={TOKEN_CHECKS: first_run})
        self._req = req
        start = workflow.now()
        if req.carry is None and not _names_what(req):
            self._refuse([("constraints", EMPTY)])  # before any activity: ``{}`` never buys
        carry = req.carry or CapacityCarry(
            deadline=start + timedelta(seconds=req.deadline_seconds), backoff_seconds=req.backoff_seconds,
            excluded=[ExcludedOffer(offer=e.offer, until=start + timedelta(seconds=e.seconds), reason=e.reason)
                      for e in req.exclude],
        )
        self._deadline = carry.deadline
        self._request_id = workflow.info().workflow_id.removeprefix("capacity/").replace("/", "-")
        self._progress.requested = req.count
        self._progress.deadline = carry.deadline
        self._state("acquiring")
        #: offer key → (until, why) it is out of the ranking.
        self._excluded: dict[str, tuple[datetime, str]] = {e.offer: (e.until, e.reason) for e in carry.excluded}
        self._joined.extend(carry.joined)
        self._costs: dict[str, float] = dict(carry.costs)
        self._progress.attempts.extend(carry.attempts[-ATTEMPTS_KEPT:])
        self._progress.joined = len(self._joined)
        self._other_failures = carry.other_failures
        self._seq = carry.seq
        self._backoff = carry.backoff_seconds
        self._not_told = dict(carry.not_told)
        #: The request is still to be checked against the catalog (its first run has read none).
        self._unchecked = req.carry is None or carry.unchecked
        self._fatal: str | None = None
        self._fatal_kind = ""
        return req

    async def _read_catalog(self, *, force: bool) -> bool:
        """The offers and each account's state, read; whether a read went through. One that failed
        past its retries (the API server or Temporal away for minutes, a 403 after an RBAC mistake)
        is shown and tried again after a pause doubling from 5 s to 5 minutes, until the deadline or
        a cancel (then False; a later read leaves the catalog read before). Nothing is in flight here,
        so after a pause the run continues as new when Temporal suggests it: a store away for days of
        a 30-day deadline would otherwise grow one history past Temporal's limit."""
        while True:
            try:
                self._catalog_now = await self._catalog(self._req.catalog_max_age_seconds, force=force)
            except ActivityError as error:
                if cancelled_by_request(error):
                    raise
                self._catalog_failed = failure_text(error)[:MAX_PROBLEM_SHOWN]
                if workflow.now() >= self._deadline or self._cancel:
                    return False
                await self._catalog_reads.pause_after(
                    error, step="read the catalog", until=self._deadline, wake=lambda: bool(self._cancel),
                    show=lambda failing: self._show("reading the catalog", None, failing))
                await self._continue_as_new_if_suggested()
                force = True  # a read that failed may have listed nothing
                continue
            self._catalog_reads.passed()
            self._catalog_failed = ""
            self._no_capacity_until_read.clear()
            self._accounts = self._accounts_read(self._catalog_now.accounts)
            return True

    def _accounts_read(self, read: dict[str, AccountView]) -> dict[str, AccountView]:
        """Each account as its store says, with what this request saw and could not tell it put
        over it; what a read shows the store holds is dropped from ``_not_told``."""
        accounts = dict(read)
        for name, seen in list(self._not_told.items()):
            stored = accounts.get(name) or AccountView()
            revoked = (seen.state == AccountState.CREDENTIALS_REVOKED
                       and stored.state != AccountState.CREDENTIALS_REVOKED)
            blocked = [o for o in seen.blocked_offers if o not in stored.blocked_offers]
            if not revoked and not blocked:
                del self._not_told[name]  # told since (a catalog refresh, another request, a person)
                continue
            self._not_told[name] = AccountView(state=seen.state if revoked else AccountState.HEALTHY,
                                               blocked_offers=blocked)
            accounts[name] = AccountView(state=AccountState.CREDENTIALS_REVOKED if revoked else stored.state,
                                         blocked_offers=[*stored.blocked_offers, *blocked])
        return accounts

    def _placement(self) -> Placement:
        """The offers ranked now: those out of the ranking left out, the spend cap counting the
        joins in flight."""
        now, req, catalog = workflow.now(), self._req, self._catalog_now
        excluded = {k: why for k, (until, why) in self._excluded.items() if until > now}
        for key in sorted(self._no_capacity_until_read):
            excluded.setdefault(key, NO_CAPACITY_UNTIL_NEXT_LOOK)
        spent = sum(self._costs.values()) + sum(c.machine_cost_per_hour for c, _ in self._in_flight.values())
        cap = req.constraints.spend_cap_per_hour
        return rank(catalog.offers, catalog.sites, req.constraints, self._accounts, excluded,
                    budget_left=None if cap is None else cap - spent)

    def _start_joins(self) -> Placement:
        """2. The best offers' joins started, up to the concurrency and the count."""
        req, in_flight = self._req, self._in_flight
        ranked = self._placement()
        while len(in_flight) < req.concurrency and len(self._joined) + len(in_flight) < req.count and ranked.candidates:
            if workflow.now() >= self._deadline:
                break  # past the deadline nothing more is bought
            best = ranked.candidates[0]
            self._seq += 1
            join_id = join_workflow_id(best.offer.site, f"{self._request_id}-{self._seq}")
            in_flight[asyncio.create_task(self._join(best, join_id))] = (best, join_id)
            self._join_began[join_id] = workflow.now()
            self._track()
            ranked = self._placement()
        return ranked

    async def _wait_for_capacity(self, ranked: Placement) -> bool:
        """3. Nothing can start: wait (backing off) until offers change, the backoff ends or a cancel.
        Whether to list the offers again before looking: after the backoff, or a wake that did not
        list them; not after a catalog refresh's wake (it has just listed them). A wake leaves the
        backoff as it is: only a wait that ran out doubles it, a node that joined resets it."""
        req, catalog = self._req, self._catalog_now
        now = workflow.now()
        wait = min(timedelta(seconds=self._backoff), self._deadline - now)
        self._progress.wait_until = now + wait
        self._progress.waiting_for = waiting_for(ranked, catalog.offers, catalog.sites, req.constraints,
                                                 self._accounts, catalog.errors)
        self._state(WAITING_FOR_CAPACITY)
        self._show("waiting for capacity", ranked,
                   f"look again at {(now + wait).isoformat(timespec='seconds')} or when offers change")
        seen = self._offers_changed
        self._wake_needs_listing = False
        try:
            await workflow.wait_condition(lambda: self._offers_changed != seen or bool(self._cancel),
                                          timeout=wait, timeout_summary="wait for capacity (backoff)")
        except asyncio.TimeoutError:
            self._backoff = min(self._backoff * 2, req.max_backoff_seconds)
            return True
        finally:
            self._progress.wait_until = None
        return self._wake_needs_listing

    async def _continue_as_new_if_suggested(self) -> None:
        """Nothing in flight (no child join open to be cut off): the carry is the whole state. A
        cancel meanwhile is taken here instead (its update waits for the run's end)."""
        if self._cancel or not workflow.info().is_continue_as_new_suggested():
            return
        await workflow.wait_condition(lambda: workflow.all_handlers_finished() or bool(self._cancel))
        if self._cancel:
            return
        now = workflow.now()
        carry = CapacityCarry(
            deadline=self._deadline, joined=self._joined, costs=self._costs, attempts=self._progress.attempts,
            excluded=[ExcludedOffer(offer=k, until=until, reason=why)
                      for k, (until, why) in self._excluded.items() if until > now],
            other_failures=self._other_failures, seq=self._seq, backoff_seconds=self._backoff,
            not_told=self._not_told, unchecked=self._unchecked,
        )
        workflow.continue_as_new(self._req.model_copy(update={"carry": carry}).model_dump(mode="json"))

    async def _take_ended_joins(self, ranked: Placement) -> None:
        """4. Wait for a join to end (or a cancel), and take each outcome: a node joined, an offer
        out of the ranking for a while, an account told, a fatal failure, or one more failure."""
        req, in_flight, accounts = self._req, self._in_flight, self._accounts
        self._progress.waiting_for = []
        bound = self._joins_until()
        if self._other_failures > req.max_other_failures:
            self._show("finishing the joins in flight", ranked,
                       f"too many failed joins ({self._other_failures}): no join starts; it returns what "
                       f"joined once the joins in flight ({len(in_flight)}) end{bound}")
        elif workflow.now() >= self._deadline:
            self._show("finishing the joins in flight", ranked,
                       "no join starts past the deadline; it returns what joined once the joins "
                       f"in flight ({len(in_flight)}) end{bound}")
        else:
            self._show("joining", ranked, f"{len(in_flight)} in flight{bound}")
        cancelled = asyncio.ensure_future(workflow.wait_condition(lambda: bool(self._cancel)))
        done, _ = await workflow.wait([*in_flight, cancelled], return_when=asyncio.FIRST_COMPLETED)
        if not cancelled.done():
            cancelled.cancel()
        for task in done:
            if task is cancelled:
                continue
            cand, _ = in_flight.pop(task)
            self._track()
            error = task.exception()
            if error is None:
                node: JoinedNode = task.result()
                self._joined.append(node)
                self._costs[node.node_name] = cand.machine_cost_per_hour
                self._progress.joined = len(self._joined)
                self._attempted(cand.key, "joined", node.node_name)
                self._backoff = req.backoff_seconds
                continue
            kind, message = failure_type(error), failure_message(error)
            attempt = self._attempted(cand.key, kind, message)
            now = workflow.now()
            if kind == "NoCapacity" and req.unavailable_ttl_seconds == 0:
                # Excluded until "now" it was joined again at once (a join and a provider call each
                # time, until the deadline): out until the next look at the offers instead, so with no
                # other candidate the request waits for capacity, backing off, as with any TTL.
                workflow.deprecate_patch(TTL_0_WAITS_PATCH)
                self._no_capacity_until_read.add(cand.key)
            elif kind == "NoCapacity":
                until = now + timedelta(seconds=req.unavailable_ttl_seconds)
                self._excluded[cand.key] = (until, f"no capacity (until {until.isoformat(timespec='seconds')})")
            elif kind == "OverQuota":
                view = accounts.setdefault(cand.account, AccountView())
                view.blocked_offers = [*view.blocked_offers, cand.key]
                if not await self._report(cand.account, "OverQuota", cand.key, message, attempt):
                    untold = self._not_told.setdefault(cand.account, AccountView())
                    untold.blocked_offers = [*untold.blocked_offers, cand.key]
            elif kind == "BadCredentials":
                accounts[cand.account] = AccountView(state=AccountState.CREDENTIALS_REVOKED)
                if not await self._report(cand.account, "BadCredentials", cand.key, message, attempt):
                    untold = self._not_told.setdefault(cand.account, AccountView())
                    untold.state = AccountState.CREDENTIALS_REVOKED
            elif kind in FATAL:
                self._fatal = f"{kind} at {cand.key}: {message}"
                self._fatal_kind = kind
            else:  # smoke test, registration timeout, retries exhausted: count it, try elsewhere
                self._other_failures += 1
                until = now + timedelta(seconds=req.unavailable_ttl_seconds)
                self._excluded[cand.key] = (until, f"last join failed: {kind}")

    async def _fail(self) -> NoReturn:
        """A fatal failure: the joins in flight stopped (each deletes its machine), then fail,
        naming each node one of them joined meanwhile or admitted as the cancel came: it stays
        and bills."""
        kept = await self._stop_joins(self._fatal)
        message = self._fatal
        if kept:
            message += "; " + ", ".join(f"{n.node_name} (machine {n.machine_id})" for n in kept) + \
                " joined as the joins in flight were stopped and stay"
        self._state("failed")
        self._show("failed", None, message)
        raise ApplicationError(message, type=self._fatal_kind, non_retryable=True)

    async def _result(self) -> CapacityResult:
        """5. The nodes joined, their cost, and why any are missing."""
        req, joined = self._req, self._joined
        if self._in_flight:  # gave up on other failures: let the ones in flight finish
            while self._in_flight and not self._cancel:
                await self._take_ended_joins(self._placement())
            if self._cancel:
                return await self._cancelled(req, self._costs)
        result = CapacityResult(
            requested=req.count, nodes=joined, complete=len(joined) >= req.count, attempts=self._progress.attempts,
            cost_per_hour=round(sum(self._costs.values()), 6),
        )
        summary = f"{len(joined)} of {req.count} joined, ${result.cost_per_hour:.2f}/h"
        if not result.complete:
            missing = f"{req.count - len(joined)} of {req.count} not joined"
            if workflow.now() >= self._deadline:
                passed = f"the deadline passed at {self._deadline_text()}"
                result.why = [f"{missing} by the deadline", f"{passed}: no join starts after it"]
                summary += f"; stopped: {passed}"
            else:
                result.why = [f"{missing}: too many failed joins"]
                summary += "; stopped: too many failed joins"
            if self._catalog_failed:
                result.why.append(f"could not read the catalog: {self._catalog_failed}")
            if self._catalog_now is not None:
                result.why += self._placement().reasons() or ["no offer qualifies"]
        self._state("done" if result.complete else "partial")
        self._show("done" if result.complete else "partial", None, summary)
        return result

    def _deadline_text(self) -> str:
        return self._deadline.isoformat(timespec="seconds")

    def _refuse(self, problems: list[tuple[str, str]]) -> None:
        """Fail now, naming each field no configured site can ever satisfy (nothing bought)."""
        if not problems:
            return
        text = "; ".join(f"{field}: {why}" for field, why in problems)
        self._state("failed")
        self._show("refused", None, text)
        raise invalid_input(f"invalid AcquireCapacity: {text}", [field for field, _ in problems])

    async def _stop_joins(self, why: str) -> list[JoinedNode]:
        """Cancel every join in flight and wait until each has deleted its machine; a join that
        finished meanwhile (or was admitting its node as the cancel came) counts as joined, its
        machine's cost with it. Returns the nodes kept that way."""
        if not self._in_flight:
            return []
        # Conditions are checked once nothing else is ready to run: by then a join whose end came in
        # this workflow task with the cancel has taken it (cancelled before, the SDK raised the
        # cancel where the join awaited its child and its node was lost). No command.
        await workflow.wait_condition(lambda: True)
        stopping = list(self._in_flight.items())
        for task, _ in stopping:
            if not task.done():
                task.cancel()
        outcomes = await asyncio.gather(*(task for task, _ in stopping), return_exceptions=True)
        kept: list[JoinedNode] = []
        for (task, (cand, join_id)), outcome in zip(stopping, outcomes):
            self._in_flight.pop(task, None)
            if isinstance(outcome, JoinedNode):
                self._joined.append(outcome)
                self._costs[outcome.node_name] = cand.machine_cost_per_hour
                self._attempted(cand.key, "joined", outcome.node_name)
                kept.append(outcome)
            else:
                self._progress.released.append(f"{join_id} ({cand.key}): machine deleted")
                self._attempted(cand.key, "cancelled", why)
        self._progress.joined = len(self._joined)
        self._track()
        return kept

    async def _cancelled(self, req: CapacityRequest, costs: dict[str, float]) -> CapacityResult:
        p = self._progress
        p.cancelled = self._cancel
        self._show("cancelling", None, f"{len(self._in_flight)} joins in flight: each deletes its machine "
                                         "(a node admitted as the cancel came stays)")
        await self._stop_joins(self._cancel)
        self._state("cancelled")
        kept = len(self._joined)
        self._show("cancelled", None, f"{self._cancel}: {len(p.released)} joins stopped, {kept} joined nodes stay")
        return CapacityResult(
            requested=req.count, nodes=self._joined, complete=False, attempts=p.attempts, cancelled=self._cancel,
            cost_per_hour=round(sum(costs.get(n.node_name, 0.0) for n in self._joined), 6),
            why=[f"cancelled: {self._cancel}"],
        )

    async def _join(self, cand: Candidate, join_id: str) -> JoinedNode:
        raw: dict[str, Any] = {"site": cand.offer.site}
        if self._req.join_timeouts is not None:
            raw["timeouts"] = self._req.join_timeouts.model_dump(mode="json")
        result: NodeJoinResult = await workflow.execute_child_workflow(
            NodeJoin.run, raw, id=join_id, result_type=NodeJoinResult,
            search_attributes=sa.join_start_attributes(cand.offer.site, cand.offer.provider, cand.account, join_id),
            # A request that ends (terminated, cancelled, failed fatally) cancels its joins: each
            # deletes its machine rather than bill on for nobody.
            parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
            static_summary=f"join a node at {cand.offer.site} ({cand.offer.instance_type}, "
                           f"${cand.offer.price_per_gpu_hour:.2f}/GPU-h)",
        )
        return result.nodes[0]

    async def _catalog(self, max_age: float, force: bool) -> Catalog:
        return await workflow.execute_activity(
            act.get_catalog, GetCatalogInput(max_age_seconds=max_age, force=force),
            start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY,
            summary="provider catalog: offers, account states",
        )

    async def _report(self, account: str, kind: str, offer: str, message: str, attempt: JoinAttempt) -> bool:
        """Tell the account's store and entity; whether it was told. A report that failed past its
        retries (the API server or Temporal away for minutes) is said in the join's attempt, and the
        request goes on: it has blocked the offer or the account itself, and keeps it so over its
        catalog reads (``_not_told``), which show the store's older word. Raised, it failed the
        request and cancelled every join in flight."""
        try:
            await workflow.execute_activity(
                act.report_account, ReportAccountInput(account=account, kind=kind, offer=offer, message=message),
                start_to_close_timeout=QUICK, retry_policy=STORE_RETRY,
                summary=f"{kind}: tell account/{account}",
            )
        except ActivityError as error:
            if cancelled_by_request(error):
                raise
            note = f"; account {account} not told ({failure_text(error)[:MAX_PROBLEM_SHOWN]})"
            workflow.logger.warning("%s at %s%s", kind, offer, note)
            attempt.message = attempt.message[:ATTEMPT_MESSAGE_CHARS - len(note)] + note
            return False
        return True


@workflow.defn(name="CatalogRefresh")
class CatalogRefresh:
    """Refresh every site's offers, then wake the requests waiting for capacity if they changed."""

    @workflow.run
    async def run(self, raw: Any = None) -> int:
        parse_input(CatalogRefreshInput, raw or {})
        show_details("refreshing the provider catalog")
        catalog: Catalog = await workflow.execute_activity(
            act.get_catalog, GetCatalogInput(force=True), start_to_close_timeout=QUICK,
            retry_policy=PROVIDER_RETRY, summary="list every site's offers",
        )
        woken: int = await workflow.execute_activity(
            act.wake_waiting_requests, WakeRequestsInput(offers_digest=catalog.offers_digest()),
            start_to_close_timeout=QUICK, retry_policy=STORE_RETRY,
            summary="signal waiting AcquireCapacity workflows if the offers changed",
        )
        available = sum(o.available for o in catalog.offers)
        show_details("done", detail=f"{len(catalog.offers)} offers ({available} available), "
                                    f"{len(catalog.errors)} sites failed, {woken} waiting requests woken")
        return woken
