"""ProviderAccount (entity, id ``account/<provider>/<account>``): what a person must fix.

States: ``healthy``; ``quota-blocked`` (which offers, since when: the rest of the
account still sells); ``credentials-revoked`` (nothing may call the account).
Workflows report problems with the ``report`` signal (through the
``report_account`` activity, which also blocks the account in the guard store at
once). A person clears them with updates:

- ``quota_raised`` {"offers": [...]} or {"all": true}: the offers sell again (no offer and
  no ``all`` is refused: "all" is never implied).
- ``credentials_rotated``: accepted only after one cheap authenticated call
  succeeds; then the deletes queued while revoked run. Deletes that fail past their retries
  do not undo the rotation: they are owed (``AccountStatus.deletes_owed_since``, carried over
  continue-as-new), and the loop tries them again after a pause that doubles, until they run
  (patch ``account-owes-failed-deletes``). A run started afresh (its run before terminated by hand,
  its state not carried) reads the deletes still queued in the guard store and owes them, unless the
  guard has the account revoked (the next rotation runs them: patch
  ``account-started-afresh-takes-queued-deletes``). The deletes queued (which machines, where, since
  when) are shown in the status and details, read from the guard store while revoked (patch
  ``account-shows-queued-deletes``): ``gpufleet accounts list`` counts them, ``show`` names them.

A run started afresh first takes the account as the guard store holds it (revoked, the offers
quota-blocked: patch ``account-started-afresh-takes-the-guard``): a call the guard refuses reports
nothing, so its state would otherwise say healthy while the guard blocks, and refuse the updates.
A read of the store that failed is tried again by the loop until one lands, in the next run too when
the run continues as new first (``AccountStatus.guard_unread``, carried: patch
``account-carries-the-guard-unread``). The runs read the deletes queued with ``shown_only``: how many,
and the first ``MAX_QUEUED_DELETES_SHOWN``, never every machine, so a read's result stays small.

Every change is written through to the guard store that activities check, the
search attribute ``FleetState`` is ``needs-person`` while anything is blocked
(the UI lists them), a webhook is POSTed when a person is needed, and waiting
AcquireCapacity requests are woken when something is unblocked.

An entity (``workflows.entity``, docs/design/entities.md): its one state is ``AccountStatus``
(``self.state``); it continues as new when the server suggests it, through the base's gate,
once the updates running have finished (a report that comes in meanwhile is taken first).

The run loop (reports) and the two updates each change the state and then write it
to the guard store through an activity: each takes the state lock around that
change and its write (patch ``account-state-lock``), so the writes land in the
order of the changes and the store ends equal to the entity.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager, nullcontext
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import activities as act
    from fleet.messages.capacity import (
        AccountConfigInput,
        AccountInput,
        AccountRecordInput,
        AccountStatus,
        NotifyInput,
        ProviderAccountInput,
        MAX_QUEUED_DELETES_SHOWN,
        QueuedDelete,
        QueuedDeletes,
        QueuedDeletesInput,
        QuotaRaised,
        ReportAccountInput,
    )
    from fleet import search_attributes as sa
    from fleet.models import AccountState, listing
    from workflows.entity import Entity
    from workflows.inputs import invalid_input, parse_input, parse_signal, refusal
    from workflows.passes import FIRST_PAUSE, MAX_PAUSE, FailedPasses
    from workflows.refusals import wrong_state
    from workflows.steps import (
        MAX_PROBLEM_SHOWN, QUICK, STORE_RETRY, cancelled_by_request, failure_message, failure_text, show_details,
    )

#: The credential check: one attempt per person's request (a wrong key is not transient).
CHECK_RETRY = RetryPolicy(maximum_attempts=3, non_retryable_error_types=["BadCredentials", "InvalidRequest"])
#: A webhook that keeps failing is counted and shown, not waited for: the entity must carry on.
NOTIFY_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)
#: Workflow patch: the state lock (runs started before it replay without one).
STATE_LOCK_PATCH = "account-state-lock"
#: Workflow patch: ``quota_raised`` with no offers is refused (its validator), never "every
#: blocked offer"; before it, such an update unblocked all (kept for runs that took one).
QUOTA_ALL_EXPLICIT_PATCH = "quota-raised-all-explicit"
#: Workflow patch: continue-as-new waits for running updates *or* a report, and a report that
#: came in meanwhile is taken first. Before it the wait also needed an empty report queue, which
#: only this waiting loop empties: a report during an update's wait stopped the entity for good.
CONTINUE_WHEN_READY_PATCH = "account-continue-when-ready"
#: Workflow patch: each run first asks the fleet config about its account
#: (``account_config_problems``). A run started afresh (no carried status: by hand, for a typo)
#: for an account the config lacks, or names with another provider, is refused, ``InvalidInput``
#: naming the field; a continued run whose account left the config goes on and says so. Before
#: it, such an entity ran for good, listed by ``gpufleet accounts`` as a healthy account.
CONFIG_CHECKED_PATCH = "account-checked-against-config"
#: Workflow patch, asked where an update's write of the guard store (``quota_raised``,
#: ``credentials_rotated``) failed past its retries: the entity's state is put back as it was before
#: the update (``FleetState`` too) and the update fails saying nothing changed, so the same update,
#: sent again once the store takes writes, is taken. Before it the entity kept the change the guard
#: never got: it said healthy while the guard still blocked every call (revoked) or the offers
#: (quota), and the update sent again was refused ("credentials are not revoked", "has no
#: quota-blocked offer"): the account stayed blocked for good.
UPDATE_PUTS_BACK_PATCH = "account-update-puts-back-on-a-failed-write"
#: Workflow patch, asked where ``credentials_rotated``'s run of the deletes queued while revoked
#: (``run_queued_deletes``, after the rotation was written to the guard) failed past its retries (a
#: provider outage longer than them, a refusal): the rotation stands and the update returns it, the
#: deletes owed (``AccountStatus.deletes_owed_since``, ``deletes_failing``: carried over
#: continue-as-new, shown by ``gpufleet accounts``); the loop tries them again after a pause that
#: doubles from 5 s to 5 minutes, each failed try shown with why and when the next is, but not while
#: the account is revoked again (the next rotation runs them), until they run. Before it the update
#: failed with the rotation saved: sent again it was refused ("credentials are not revoked") and
#: nothing else ran the deletes: the machines queued for deletion stayed up, billed, no one told.
DELETES_OWED_PATCH = "account-owes-failed-deletes"
#: Workflow patch, asked in a run started afresh (no carried status: its run before was terminated,
#: by hand, and the next report started it again), once the fleet config is checked: the run reads
#: the deletes the guard store still holds queued for its account (``queued_deletes``). With the guard
#: not revoking the account they are owed (since the oldest was queued), shown, and the loop runs
#: them at once and tries them again as ``account-owes-failed-deletes`` does; a read that fails past
#: its retries owes them too (the loop's try reads the store itself). Revoked, they wait for the next
#: rotation, as before. Before it a fresh run started owing nothing: a terminated run's owed deletes
#: stayed queued in the store until the account was revoked and rotated again, their machines up,
#: billed, shown nowhere (the FleetSweep took those accounted for by nothing, once past its grace).
TAKES_QUEUED_DELETES_PATCH = "account-started-afresh-takes-queued-deletes"
#: Workflow patch, asked once at the start of every run: the run shows the deletes the account guard
#: store holds queued for its account (``AccountStatus.deletes_queued``: which machines, at which site,
#: queued when; ``deletes_queued_count``), in its ``status`` and details, so a person rotating the
#: credentials sees which machines are still up, billed, owed a delete. While the account is revoked
#: (or a run started afresh holds some the guard still refuses) the loop reads them
#: (``queued_deletes``, the store only) 5 s after the revocation (at once in a run that continued as
#: new), then again after a pause that doubles up to 5 minutes, from 5 s again when they changed; a
#: try of them that failed reads them too (which are left), a try that ran them empties the list, and
#: a run started afresh keeps what it read. Before it a delete queued while revoked was shown nowhere
#: (``queued_deletes`` is the store's; the entity never learnt of it) until a rotation's try of it
#: failed: a person rotating the credentials could not see which machines were still up, billed.
SHOWS_QUEUED_PATCH = "account-shows-queued-deletes"
#: Workflow patch, asked in a run started afresh (no carried status) once the fleet config is checked,
#: before ``account-started-afresh-takes-queued-deletes``'s read of the guard store: the run takes the
#: account's record there (``queued_deletes`` returns it: revoked, the offers quota-blocked, the reason
#: and since when) as its own state, so its ``status``, ``FleetState`` (``needs-person``), details and
#: a webhook to a person say what the guard enforces, and ``credentials_rotated`` / ``quota_raised``
#: are taken. On a disagreement the store wins: it is what every activity enforces, and a fresh run
#: knows nothing of its own (its run before, the store's writer, was terminated with its state). A
#: read that fails past its retries leaves the run as it was (healthy) and the loop reads the store
#: again (as it reads the deletes queued) until a read lands, then takes what it holds on top of what
#: the run learnt meanwhile. A continued run carries its own state: it is the store's writer, and
#: takes nothing (unless carried ``guard_unread``: ``CARRIES_GUARD_UNREAD_PATCH``). Before it a fresh
#: run began healthy while the guard still refused every call to a
#: revoked account, which no call reports again: the entity said healthy, ``credentials_rotated`` was
#: refused ("credentials are not revoked") until a new bad-credentials report came, and the deletes
#: queued while revoked never ran; an offer the guard blocked was not shown, nor could it be raised.
TAKES_GUARD_PATCH = "account-started-afresh-takes-the-guard"
#: Workflow patch, asked at the continue-as-new gate of a run that has not taken the account guard
#: store's record yet (``AccountStatus.guard_unread``: started afresh, its read of the record failed
#: and no read has landed since): the next run is carried ``guard_unread`` and its loop reads the
#: store at once, and again after a pause that doubles, until a read lands, then takes the record
#: (``TAKES_GUARD_PATCH``). Before it the flag was the run's own: asked to continue as new (the
#: server's suggestion, ``gpufleet patches renew``) before a read landed, the next run, which carries
#: a status, never read the guard: it said healthy while the guard enforced the revocation,
#: ``credentials_rotated`` was refused, and the deletes owed were tried against the refusing guard
#: for good.
CARRIES_GUARD_UNREAD_PATCH = "account-carries-the-guard-unread"
#: What the owed deletes' try is called in the entity's details and log.
DELETES_STEP = "run the deletes queued while revoked"


@workflow.defn(name="ProviderAccount")
class ProviderAccount(Entity[AccountStatus | None]):
    #: ``run``'s input: the input guard refuses its ``Carried`` fields in a run that did not continue as new.
    INPUT = ProviderAccountInput

    def __init__(self) -> None:
        # The state (``run`` sets it: a report sent with the start is queued here until then, and
        # an update before it waits for it: ``Entity.until_started``).
        super().__init__(None)
        #: Reports not yet taken by the loop (in flight: the gate lets the loop take them first).
        self._reports: list[ReportAccountInput] = []
        #: A report taken whose store write failed past its retries: written (and a person told)
        #: again after a pause, until it lands (``_write_and_notify``).
        self._unwritten = False
        self._passes = FailedPasses()
        #: Why the fleet config does not have this run's account (a continued run: shown); "" = it does.
        self._not_in_config = ""
        #: ``run_queued_deletes`` is running (the update's or the loop's): the loop starts no second one.
        self._deleting = False
        #: Deletes owed (``AccountStatus.deletes_owed_since``): when the loop tries them next (None: at
        #: once), the pause after the next failure, and the tries since a person's rotation. Not
        #: carried: a run that continues as new tries them at once, then pauses from the first pause.
        self._deletes_next: datetime | None = None
        self._deletes_pause = FIRST_PAUSE
        self._deletes_tries = 0
        #: ``SHOWS_QUEUED_PATCH``, decided at the start of the run.
        self._shows_queued = False
        #: The deletes queued, while watched (``_queued_watched``): when the loop reads them next (None:
        #: at once), the pause after the next read that finds them unchanged, and why the last read
        #: failed ("": it did not). Not carried: a run that continues as new reads them at once.
        self._queued_next: datetime | None = None
        self._queued_pause = FIRST_PAUSE
        self._queued_failing = ""
        #: Tries of the queued deletes that ended: a read that a try's end overtook is not kept.
        self._deletes_runs = 0
        #: ``TAKES_GUARD_PATCH``, decided in a run started afresh (whether the guard store's record of the
        #: account is still to be read and taken is ``AccountStatus.guard_unread``: ``_guard_unread``).
        self._takes_guard = False

    # -- what workflows and people send ---------------------------------------------------
    @workflow.signal
    def report(self, raw: dict[str, Any]) -> None:
        report = parse_signal(ReportAccountInput, raw, "report")
        if report is not None:
            self._reports.append(report)

    @workflow.query
    def status(self) -> AccountStatus:
        assert self.state is not None
        return self.state

    @workflow.update
    async def quota_raised(self, raw: Any = None) -> AccountStatus:
        request = parse_input(QuotaRaised, raw or {})
        if not self.started:  # the validator could not look at the state yet
            await self.until_started()
            self._check_blocked(request)
        status = self.state
        # Locked: a report's store write, still in flight, would land after this one and re-block the offers.
        async with self._locked():
            before = status.model_copy(deep=True)
            if request.offers:
                offers = request.offers
            elif request.all or not workflow.patched(QUOTA_ALL_EXPLICIT_PATCH):
                offers = list(status.blocked_offers)  # (before the patch, no offers meant all)
            else:
                offers = []  # the validator refuses this: named offers, or all
            for offer in offers:
                status.blocked_offers.pop(offer, None)
            self._log(f"quota raised for {', '.join(offers)}")
            if status.state == AccountState.QUOTA_BLOCKED and not status.blocked_offers:
                self._set(AccountState.HEALTHY, "")
            await self._persist_or_put_back(before, "quota_raised")
        await self._wake()
        return status

    @quota_raised.validator
    def _check_quota_raised(self, raw: Any = None) -> None:
        request = parse_input(QuotaRaised, raw or {})  # a bad payload rejects the update, naming the field
        if not request.offers and not request.all:
            raise invalid_input('offers: name the offers that sell again (site/instance-type), or send {"all": true}',
                                ["offers"])
        if request.offers and request.all:
            raise invalid_input("all: either offers or all, not both", ["all"])
        if self.started:  # else the handler checks, once the run has its state
            self._check_blocked(request)

    def _check_blocked(self, request: QuotaRaised) -> None:
        status = self.state
        if not status.blocked_offers:
            # The account's state, not the input: nothing is blocked now.
            raise wrong_state(f"account {status.account} has no quota-blocked offer", status.state.value)
        unknown = [o for o in request.offers if o not in status.blocked_offers]
        if unknown:
            # The input: offers that are not blocked here (a typo, or another account's).
            raise invalid_input(f"offers: not blocked: {', '.join(unknown)}; blocked: {', '.join(status.blocked_offers)}",
                                ["offers"])

    @workflow.update
    async def credentials_rotated(self) -> AccountStatus:
        if not self.started:  # the validator could not look at the state yet
            await self.until_started()
            self._check_rotated()
        status = self.state
        # Locked, check included: a report's store write (still revoked), in flight meanwhile, would land
        # after this one and leave the guard revoked while the entity says healthy.
        async with self._locked():
            if status.state != AccountState.CREDENTIALS_REVOKED:
                return status  # another rotation finished while this one waited for the lock
            try:
                checked = await workflow.execute_activity(
                    act.check_credentials, AccountInput(account=status.account),
                    start_to_close_timeout=QUICK, retry_policy=CHECK_RETRY,
                    summary=f"one authenticated call to {status.account}",
                )
            except ActivityError as error:
                self._log(f"credentials still rejected: {failure_message(error)}")
                raise ApplicationError(
                    f"credentials for {status.account} still rejected: {failure_message(error)}",
                    type="BadCredentials", non_retryable=True,
                ) from None
            before = status.model_copy(deep=True)
            self._log(f"credentials rotated ({checked})")
            self._set(AccountState.QUOTA_BLOCKED if status.blocked_offers else AccountState.HEALTHY,
                      status.reason if status.blocked_offers else "")
            await self._persist_or_put_back(before, "credentials_rotated")
        # The queued deletes and the wake-up write no guard: no lock (reports go on meanwhile).
        try:
            await self._run_queued_deletes()
        except ActivityError as error:
            if cancelled_by_request(error) or not workflow.patched(DELETES_OWED_PATCH):
                raise  # (a run from before: the update fails, the rotation kept, the deletes not run)
            # The rotation stands (written): the deletes are owed, and the loop tries them again.
            self._owe_deletes(error, rotated=True)
            await self._read_queued()  # which are left
        await self._wake()
        return status

    @credentials_rotated.validator
    def _check_rotated(self) -> None:
        if not self.started:  # the handler checks, once the run has its state
            return
        if self.state.state != AccountState.CREDENTIALS_REVOKED:
            owed = self.state.deletes_owed_since
            raise wrong_state("credentials are not revoked: nothing to rotate" + (
                f" (the deletes owed since {owed} are tried again by the entity until they run)" if owed else ""
            ), self.state.state.value)

    # -- the entity loop ------------------------------------------------------------------
    @workflow.run
    async def run(self, raw: Any) -> None:
        args = parse_input(ProviderAccountInput, raw)
        workflow.patched(STATE_LOCK_PATCH)  # decided (and recorded) once, at the start of the run
        takes_reports_at_gate = workflow.patched(CONTINUE_WHEN_READY_PATCH)  # the same, before any activity
        checks_config = workflow.patched(CONFIG_CHECKED_PATCH)  # the same
        self._shows_queued = workflow.patched(SHOWS_QUEUED_PATCH)  # the same
        self.start_with(args.status or AccountStatus(account=args.account, provider=args.provider))
        if checks_config:
            # After the state is set: an update meanwhile is checked against it, not held until the check
            # ends (a fresh run's state refuses every update: nothing is blocked or revoked yet).
            await self._check_config(args)
        if args.status is None and workflow.patched(TAKES_QUEUED_DELETES_PATCH):
            self._takes_guard = workflow.patched(TAKES_GUARD_PATCH)  # decided before the read, in every fresh run
            await self._take_queued_deletes()
        workflow.upsert_search_attributes([
            sa.ACCOUNT.value_set(args.account), sa.PROVIDER.value_set(args.provider),
            sa.FLEET_STATE.value_set(self._fleet_state()),
        ])
        self._show()
        while True:
            await self._until_work()
            # A write that failed (the store away, or refusing: a 403) is shown and tried again after
            # a pause: raised, it failed the entity, and with it the record a person fixes things from.
            shown = lambda _failing: self._show()  # noqa: E731 - ``_show`` adds what failed
            if self._unwritten:
                await self._passes.attempt("write the account guard", self._write_and_notify, shown)
                continue
            if self._reports:
                await self._passes.attempt("write the account guard", lambda: self._apply(self._reports.pop(0)), shown)
                continue
            if self._deletes_due() and not self.continue_as_new_suggested():  # (else carried, tried at once)
                try:
                    await self._run_queued_deletes()
                except ActivityError as error:
                    if cancelled_by_request(error):
                        raise
                    self._owe_deletes(error)
                    await self._read_queued()  # which are left
                continue
            if self._queued_due() and not self.continue_as_new_suggested():  # (else read by the next run)
                await self._read_queued()
                continue
            if not self.continue_as_new_suggested():
                continue  # woken for owed deletes' new pause: wait for it
            carried = lambda: {"account": args.account, "provider": args.provider,  # noqa: E731
                               "status": self._carried_status()}
            if takes_reports_at_gate:
                # A report that arrives while an update finishes is the loop's to take: take it, ask again.
                await self.continue_as_new_when_ready(carried, unless=lambda: bool(self._reports))
            else:  # a run from before the patch (see it): an empty queue too, which a report made never
                await self.continue_as_new_when_ready(carried, until=lambda: not self._reports)

    def _carried_status(self) -> dict[str, Any]:
        """The state the next run is carried: ``guard_unread`` only behind ``CARRIES_GUARD_UNREAD_PATCH``
        (asked only where it is set: a run from before the patch carried it not)."""
        status = self.state.model_dump(mode="json")
        if status["guard_unread"] and not workflow.patched(CARRIES_GUARD_UNREAD_PATCH):
            status["guard_unread"] = False
        return status

    def _has_work(self) -> bool:
        return (bool(self._reports) or self._unwritten or self.continue_as_new_suggested()
                or self._deletes_due() or self._queued_due())

    async def _until_work(self) -> None:
        """Wait for work for the loop: a report, a write to try again, continue-as-new, or the next
        try of deletes owed (a timer only while some are owed and their pause runs). Deletes owed
        meanwhile (an update's), or waiting again (revoked no more), end the wait: the loop waits
        again, for their pause."""
        plan = self._deletes_plan()
        pause = self._deletes_pause_left()
        woken = lambda: self._has_work() or self._deletes_plan() != plan  # noqa: E731
        read = self._queued_pause_left()
        if read is not None and (pause is None or read < pause):  # (never in a run from before the patch)
            try:
                await workflow.wait_condition(woken, timeout=read, timeout_summary="read the deletes queued again")
            except asyncio.TimeoutError:
                self._queued_next = None  # the pause is over: read them
            return
        if pause is None:
            await workflow.wait_condition(woken)
            return
        try:
            await workflow.wait_condition(woken, timeout=pause,
                                          timeout_summary=f"deletes owed: try {self._deletes_tries + 1}")
        except asyncio.TimeoutError:
            self._deletes_next = None  # the pause is over: try them

    # -- deletes queued while revoked ---------------------------------------------------------
    def _deletes_waiting(self) -> bool:
        """Deletes are owed and may be tried: the account is not revoked (again: the next rotation
        runs them) and no try is running."""
        status = self.state
        return (bool(status.deletes_owed_since) and status.state != AccountState.CREDENTIALS_REVOKED
                and not self._deleting)

    def _deletes_plan(self) -> tuple:
        """What the loop's wait for owed deletes, and for the next read of those queued, depends on
        (the same for a run that owes none and watches none)."""
        return (self._deletes_next, self._deletes_tries, self._deletes_waiting(),
                self._queued_next, self._queued_watched())

    def _deletes_due(self) -> bool:
        return self._deletes_waiting() and (self._deletes_next is None or workflow.now() >= self._deletes_next)

    def _deletes_pause_left(self) -> timedelta | None:
        if not self._deletes_waiting() or self._deletes_next is None:
            return None
        left = self._deletes_next - workflow.now()
        return left if left > timedelta(0) else None

    async def _run_queued_deletes(self) -> None:
        """``run_queued_deletes``: the deletes queued while revoked, each done as it goes (a try that
        fails leaves the rest queued). Ran: deletes owed are paid, and said so."""
        status = self.state
        self._deleting = True
        try:
            deleted: list[str] = await workflow.execute_activity(
                act.run_queued_deletes, AccountInput(account=status.account),
                start_to_close_timeout=timedelta(minutes=10), heartbeat_timeout=timedelta(seconds=60),
                retry_policy=STORE_RETRY, summary=DELETES_STEP,
            )
        finally:
            self._deleting = False
            self._deletes_runs += 1
        if deleted:
            self._log(f"ran {len(deleted)} queued deletes: {', '.join(deleted)}")
        if status.deletes_queued_count:  # it ran every delete queued: none is left
            status.deletes_queued, status.deletes_queued_count = [], 0
            self._show()
        if status.deletes_owed_since:
            self._log(f"the deletes owed since {status.deletes_owed_since} ran")
            status.deletes_owed_since = status.deletes_failing = ""
            self._deletes_next, self._deletes_pause, self._deletes_tries = None, FIRST_PAUSE, 0
            self._show()

    async def _take_queued_deletes(self) -> None:
        """A run started afresh: the deletes the guard store still holds queued for the account,
        which a run before it (terminated, its state not carried) may have owed. Owed (since the
        oldest was queued) unless the guard has the account revoked: the loop runs them at once, after
        any report that came with the start, and tries them again until they run."""
        status = self.state
        try:
            queued: QueuedDeletes = await workflow.execute_activity(
                act.queued_deletes, QueuedDeletesInput(account=status.account, shown_only=True),
                start_to_close_timeout=QUICK, retry_policy=STORE_RETRY, summary="deletes queued in the account guard",
            )
        except ActivityError as error:
            if cancelled_by_request(error):
                raise
            # The guard's record not known either: the loop reads the store again until it is (``_queued_watched``),
            # and so does the next run if this one continues as new first (``CARRIES_GUARD_UNREAD_PATCH``).
            status.guard_unread = self._takes_guard
            # Not known: owed, so none is left; the loop's try reads the store itself (none queued: none run).
            status.deletes_owed_since = workflow.now().isoformat(timespec="seconds")
            status.deletes_failing = (f"could not read the deletes queued in the account guard "
                                      f"({failure_text(error)[:MAX_PROBLEM_SHOWN]}): tried as owed")
            self._log(f"started afresh: {status.deletes_failing}")
            return
        if self._takes_guard:
            await self._adopt_guard(queued)
        if self._shows_queued:
            self._take_read(queued)
        if not queued.total:
            return
        machines = f"{queued.total} deletes queued in the account guard since {queued.oldest}"
        if queued.revoked:  # the guard refuses them: the next rotation runs them, as any queued while revoked
            self._log(f"started afresh with {machines} ({_named(queued)}): they run once the "
                      "credentials are rotated")
            return
        status.deletes_owed_since = queued.oldest
        status.deletes_failing = f"{machines}, owed by a run before this one (it ended without running them)"
        self._log(f"started afresh owing {machines} ({_named(queued)}): running them")

    # -- the guard's record, taken by a run started afresh -------------------------------------
    def _take_guard(self, queued: QueuedDeletes) -> bool:
        """The account as the guard store holds it (``queued_deletes``' read), taken into the state of
        a run started afresh (``TAKES_GUARD_PATCH``): revoked, and every offer it blocks, on top of
        what the run holds (nothing, at its start: then the store's record is the state). The store
        wins: it is what every activity enforces (a call to a revoked account is refused there, and no
        report tells this entity again), and a fresh run knows nothing of its own. Whether anything
        changed (then logged; the caller shows it and tells a person)."""
        status, now = self.state, workflow.now().isoformat(timespec="seconds")
        state = queued.state or (AccountState.CREDENTIALS_REVOKED if queued.revoked else AccountState.HEALTHY)
        since = queued.since or now  # (the store keeps no time per offer: each is shown blocked since the account was)
        before = (status.state, set(status.blocked_offers))
        for offer in queued.blocked_offers:
            status.blocked_offers.setdefault(offer or "(account)", since)  # (a report's "" offer, as ``_apply`` keys it)
        reason = queued.reason or f"the account guard has the account {state.value}"
        if state == AccountState.CREDENTIALS_REVOKED and status.state != state:
            status.state, status.since, status.reason = state, since, reason
            if self._shows_queued:  # deletes queue from now: read again soon (as ``_set`` does)
                self._queued_next, self._queued_pause = workflow.now() + FIRST_PAUSE, FIRST_PAUSE * 2
        elif status.state == AccountState.HEALTHY and status.blocked_offers:
            status.state, status.since, status.reason = AccountState.QUOTA_BLOCKED, since, reason
        if (status.state, set(status.blocked_offers)) == before:
            return False
        blocked = f"; quota-blocked: {listing(list(status.blocked_offers))}" if status.blocked_offers else ""
        self._log(f"took the account guard's record: {status.state.value} since {status.since} ({reason}){blocked}")
        return True

    async def _adopt_guard(self, queued: QueuedDeletes) -> None:
        """The guard's record taken (``_take_guard``, under the state lock: an update's put-back must
        not undo it); when it changed anything, ``FleetState`` and the details say so and a person is
        told (a run started afresh is a new record of the account: what it now says needs a person)."""
        async with self._locked():
            if not self._take_guard(queued):
                return
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(self._fleet_state())])
        self._show()
        unwritten = self._unwritten  # (``_notify`` clears it: a report's write still to try again stays so)
        await self._notify()
        self._unwritten = self._unwritten or unwritten

    # -- the deletes queued, shown ------------------------------------------------------------
    @property
    def _guard_unread(self) -> bool:
        """The account guard store's record is still to be read and taken (``AccountStatus.guard_unread``:
        a run started afresh whose read failed, or the run it continued as new into)."""
        return self.state.guard_unread

    def _queued_watched(self) -> bool:
        """The loop reads the deletes queued (``SHOWS_QUEUED_PATCH``): while the account is revoked
        (they are queued then), while a run started afresh holds some that are not owed (the
        guard had the account revoked), until they are gone, or has still to take the guard's
        record (``TAKES_GUARD_PATCH``: its first read failed), until a read lands."""
        status = self.state
        return self._shows_queued and (
            status.state == AccountState.CREDENTIALS_REVOKED or self._guard_unread
            or (status.deletes_queued_count > 0 and not status.deletes_owed_since))

    def _queued_due(self) -> bool:
        return (self._queued_watched() and not self._deleting
                and (self._queued_next is None or workflow.now() >= self._queued_next))

    def _queued_pause_left(self) -> timedelta | None:
        if not self._queued_watched() or self._deleting or self._queued_next is None:
            return None
        left = self._queued_next - workflow.now()
        return left if left > timedelta(0) else None

    async def _read_queued(self) -> None:
        """Read the deletes the guard store holds queued for the account (``queued_deletes``) and
        show them; the next read (while watched) after a pause that doubles, from the first again when
        they changed. A read that fails keeps what was read before, and says so."""
        if not self._shows_queued:
            return  # a run from before the patch: nothing read, nothing shown
        runs = self._deletes_runs
        try:
            queued: QueuedDeletes = await workflow.execute_activity(
                act.queued_deletes, QueuedDeletesInput(account=self.state.account, shown_only=True),
                start_to_close_timeout=QUICK, retry_policy=STORE_RETRY, summary="deletes queued in the account guard",
            )
        except ActivityError as error:
            if cancelled_by_request(error):
                raise
            self._queued_failing = (f"could not read the deletes queued in the account guard "
                                    f"({failure_text(error)[:MAX_PROBLEM_SHOWN]}): shown as last read")
            self._queued_later(changed=False)
            self._show()
            return
        failed, self._queued_failing = self._queued_failing, ""
        if self._guard_unread:  # a fresh run whose first read failed (or the run it continued into): at last
            self.state.guard_unread = False
            await self._adopt_guard(queued)
        if runs != self._deletes_runs:  # a try of them ended meanwhile: what it left is shown already
            self._queued_later(changed=True)
            return
        changed = self._take_read(queued)
        self._queued_later(changed=changed)
        if changed or failed:
            self._show()

    def _take_read(self, queued: QueuedDeletes) -> bool:
        """The deletes queued as read (the first ``MAX_QUEUED_DELETES_SHOWN``, and how many in all)
        into the state; whether they changed (then logged)."""
        status = self.state
        shown = queued.queued or [QueuedDelete(machine_id=m) for m in queued.machines[:MAX_QUEUED_DELETES_SHOWN]]
        status.deletes_queued_read = workflow.now().isoformat(timespec="seconds")
        if (shown, queued.total) == (status.deletes_queued, status.deletes_queued_count):
            return False
        status.deletes_queued, status.deletes_queued_count = shown, queued.total
        self._log(f"deletes queued in the account guard: {queued.total}"
                  + (f" ({_named(queued)})" if queued.machines else ""))
        return True

    def _queued_later(self, *, changed: bool) -> None:
        if changed:
            self._queued_pause = FIRST_PAUSE
        pause, self._queued_pause = self._queued_pause, min(self._queued_pause * 2, MAX_PAUSE)
        self._queued_next = workflow.now() + pause

    def _owe_deletes(self, error: ActivityError, *, rotated: bool = False) -> None:
        """A try of the queued deletes failed past its retries: they are owed, and tried again after
        a pause that doubles up to ``MAX_PAUSE`` (a person's rotation starts again from the first);
        the try, why and when the next is are shown, and logged (the entity's log: a rotation's and
        the loop's first)."""
        status, now = self.state, workflow.now()
        if rotated:
            self._deletes_pause, self._deletes_tries = FIRST_PAUSE, 0
        self._deletes_tries += 1
        pause, self._deletes_pause = self._deletes_pause, min(self._deletes_pause * 2, MAX_PAUSE)
        self._deletes_next = now + pause
        status.deletes_owed_since = status.deletes_owed_since or now.isoformat(timespec="seconds")
        status.deletes_failing = (f"could not {DELETES_STEP} ({failure_text(error)[:MAX_PROBLEM_SHOWN]}); "
                                  f"try {self._deletes_tries}, next try at {self._deletes_next:%H:%M:%S} UTC")
        workflow.logger.warning("account %s: %s", status.account, status.deletes_failing)
        if rotated:
            self._log(f"credentials_rotated taken, but {status.deletes_failing}: the deletes are owed and the "
                      "entity tries them again until they run (nothing to send again)")
        elif self._deletes_tries <= 2:  # the loop's first tries (a streak: one line, the log stays readable)
            self._log(status.deletes_failing)
        self._show()

    async def _check_config(self, args: ProviderAccountInput) -> None:
        """Refuse a fresh start for an account the fleet config does not have; a continued run's
        account that left the config is shown, and the entity keeps the record it holds."""
        try:
            problems = await workflow.execute_activity(
                act.account_config_problems, AccountConfigInput(account=args.account, provider=args.provider),
                start_to_close_timeout=QUICK, retry_policy=STORE_RETRY, summary="the account in the fleet config",
            )
        except ActivityError as error:
            # Not known either way: the entity runs as before rather than end over a config read.
            workflow.logger.warning("could not check account %s against the fleet config: %s", args.account,
                                    failure_message(error))
            return
        if not problems:
            return
        if args.status is None:
            refused = refusal("ProviderAccount", problems)
            show_details("refused", detail=refused.message)
            raise refused
        self._not_in_config = "; ".join(f"{field}: {problem}" for field, problem in problems)

    async def _apply(self, report: ReportAccountInput) -> None:
        status = self.state
        # Locked: an update's store write must not land between this change and its write (nor before, older).
        async with self._locked():
            before = (status.state, set(status.blocked_offers))
            now = workflow.now().isoformat(timespec="seconds")
            if report.kind == "BadCredentials":
                self._set(AccountState.CREDENTIALS_REVOKED, report.message)
            else:
                status.blocked_offers.setdefault(report.offer or "(account)", now)
                if status.state == AccountState.HEALTHY:
                    self._set(AccountState.QUOTA_BLOCKED, report.message)
            if (status.state, set(status.blocked_offers)) == before:
                return
            self._log(f"{report.kind}: {report.message}")
            self._unwritten = True
            await self._persist()
        await self._notify()

    async def _write_and_notify(self) -> None:
        """The write of a report that failed, again, then the notification it did not reach."""
        async with self._locked():
            await self._persist()
        await self._notify()

    async def _notify(self) -> None:
        status = self.state
        self._unwritten = False
        try:
            await workflow.execute_activity(
                act.notify_person,
                NotifyInput(subject=f"{status.provider} account {status.account}: {status.state.value}",
                            workflow_id=workflow.info().workflow_id, details=status.model_dump(mode="json")),
                start_to_close_timeout=QUICK, retry_policy=NOTIFY_RETRY,
                summary="webhook: a person is needed",
            )
        except ActivityError as error:
            # The entity outlives its notifications: a person still sees the state here and in the UI.
            status.notify_failures += 1
            status.notify_error = failure_message(error)
            self._log(f"webhook failed: {status.notify_error}")
            self._show()

    # -- helpers ----------------------------------------------------------------------------
    def _locked(self) -> AbstractAsyncContextManager:
        """The state lock; none for a run started before it (its history interleaved freely)."""
        return self.state_lock if workflow.patched(STATE_LOCK_PATCH) else nullcontext()

    def _set(self, state: AccountState, reason: str) -> None:
        status = self.state
        if status.state != state:
            status.since = workflow.now().isoformat(timespec="seconds") if state != AccountState.HEALTHY else ""
            if state == AccountState.CREDENTIALS_REVOKED and self._shows_queued:  # deletes queue from now: read soon
                self._queued_next, self._queued_pause = workflow.now() + FIRST_PAUSE, FIRST_PAUSE * 2
        status.state, status.reason = state, reason

    def _log(self, line: str) -> None:
        self.state.history = [*self.state.history[-19:], f"{workflow.now().isoformat(timespec='seconds')} {line}"]

    def _fleet_state(self) -> str:
        return "healthy" if self.state.state == AccountState.HEALTHY else "needs-person"

    def _show(self) -> None:
        s = self.state
        lines = [s.reason] if s.reason else []
        if self._not_in_config:
            lines.append(f"not in the fleet config any more ({self._not_in_config}): no report reaches this "
                         "entity; terminate it once its record is no longer needed")
        if self._passes.failing:
            lines.append(self._passes.failing)
        lines += [f"- quota-blocked: {offer} (since {since})" for offer, since in s.blocked_offers.items()]
        if s.state == AccountState.CREDENTIALS_REVOKED:
            lines.append("a person must rotate the credentials, then send the `credentials_rotated` update")
        elif s.blocked_offers:
            lines.append("a person must raise the quota, then send the `quota_raised` update")
        if s.deletes_owed_since and s.state == AccountState.CREDENTIALS_REVOKED:
            lines.append(f"deletes owed since {s.deletes_owed_since} (their machines are still up): they run once "
                         f"the credentials are rotated; last try: {s.deletes_failing}")
        elif s.deletes_owed_since:
            lines.append(f"deletes owed since {s.deletes_owed_since} (their machines are still up): "
                         f"{s.deletes_failing}; nothing to send: the entity tries them again until they run")
        if s.deletes_queued_count:
            shown = ", ".join(f"{d.machine_id}" + (f" at {d.site}" if d.site else "")
                              + (f" (queued {d.queued_at})" if d.queued_at else "") for d in s.deletes_queued)
            more = s.deletes_queued_count - len(s.deletes_queued)
            lines.append(f"{s.deletes_queued_count} machine(s) owed a delete, queued in the account guard (still up, "
                         f"billed; read {s.deletes_queued_read}): {shown}" + (f" and {more} more" if more else ""))
        if self._queued_failing:
            lines.append(self._queued_failing)
        if s.notify_failures:
            lines.append(f"webhook failed {s.notify_failures} time(s), last: {s.notify_error}")
        lines += [f"- {h}" for h in s.history[-5:]]
        show_details(s.state.value, *lines, detail=f"since {s.since}" if s.since else "")

    async def _persist(self) -> None:
        s = self.state
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(self._fleet_state())])
        self._show()
        await workflow.execute_activity(
            act.write_account_state,
            AccountRecordInput(account=s.account, provider=s.provider, state=s.state,
                               blocked_offers=list(s.blocked_offers), reason=s.reason),
            start_to_close_timeout=QUICK, retry_policy=STORE_RETRY, summary=f"account guard: {s.state.value}",
        )

    async def _persist_or_put_back(self, before: AccountStatus, update: str) -> None:
        """An update's change written to the guard store; a write that failed past its retries
        (``UPDATE_PUTS_BACK_PATCH``) puts the state back as it was ``before`` the update, the
        guard's, and fails the update saying nothing changed. Called holding the state lock."""
        try:
            await self._persist()
        except ActivityError as error:
            if not workflow.patched(UPDATE_PUTS_BACK_PATCH):
                raise  # a run from before: the change stays, unwritten
            status, why = self.state, failure_text(error)
            # What the updates change; the log and a webhook's failure noted meanwhile stay.
            for field in ("state", "reason", "since", "blocked_offers"):
                setattr(status, field, getattr(before, field))
            self._log(f"{update} not taken: could not write the account guard ({why}); nothing changed")
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(self._fleet_state())])
            self._show()
            raise ApplicationError(
                f"{update}: could not write the account guard ({why}); nothing changed: "
                f"send {update} again once the guard store takes writes (account {status.account} is "
                f"{status.state.value} as before)", type="GuardNotWritten", non_retryable=True,
            ) from None

    async def _wake(self) -> None:
        await workflow.execute_activity(
            act.wake_waiting_requests, start_to_close_timeout=QUICK, retry_policy=STORE_RETRY,
            summary="offers changed: wake waiting requests",
        )


def _named(queued: QueuedDeletes) -> str:
    """The machines of a read of the deletes queued, for a log line: at most 12 (``listing``), then how
    many in all (a read with ``shown_only`` holds the first ``MAX_QUEUED_DELETES_SHOWN`` only)."""
    named = listing(queued.machines[:12])
    return named + (f", … ({queued.total} in all)" if queued.total > min(len(queued.machines), 12) else "")
