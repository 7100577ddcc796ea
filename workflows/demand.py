"""Demand (id ``demand``): capacity follows the Pending pods, and idle nodes go back.

One entity per fleet, a loop:

1. watch (activity, heartbeating): wait for opted-in Pending GPU pods the loop has no
   answer for, then let the batch close (1 s without a new pod, 10 s at most);
2. look at the purchases in flight; a purchase whose pods all went is cancelled while
   its join has not yet asked the provider for a machine; one kept (its join past that, or it
   could not be asked) is followed and asked again each pass while it runs (``FOLLOWS_KEPT_PATCH``);
3. plan (pure ``fleet.demand_planner.plan_demand``): pods that fit a node or a join in flight
   (a kept purchase's too) buy nothing; the rest are bin-packed onto the cheapest qualifying offers;
4. buy: one ``AcquireCapacity`` per planned machine, pinned to its offer, started with
   the standard id ``capacity/demand-<series>-<n>`` (not a child: a purchase outlives this run's
   continue-as-new; a failed one puts its offer out of the plan for a while and the pods
   are planned again, elsewhere). The catalog read, the plan and the starts are one activity,
   ``plan_and_buy`` (``PLAN_AND_BUY_PATCH``): the pods wait on one round trip through the loop;
5. consolidate: nodes idle past the TTL are drained (PDBs honoured) and retired,
   most expensive first, within the site minimums and fractions (``fleet.consolidation.consolidate``).

Every decision (pods → offer → purchase, with its reason; cancellations; retirements)
is in the current details and the ``status`` query (``gpufleet demand``).
Cancelled (``temporal workflow cancel``, the UI), the loop stops spending before it ends: each
purchase still buying (or kept after its pods went, or started by a ``plan_and_buy`` that failed
before the loop heard of it: taken from Temporal first) is told to ``stop`` (its joins in flight delete
their machines; nodes already joined stay), its drains in flight are cancelled and their nodes
uncordoned (a node already retired stays retired), and its details and log say what it stopped
(``CANCEL_WINDS_DOWN_PATCH``).
A pass whose cluster or provider call failed (out of its retries, or refused) is no end of the
loop: it is shown and passed again after a growing pause, the state as it was (``FailedPasses``).

An entity (``workflows.entity``, docs/design/entities.md): its one state is ``DemandCarry``
(the purchase numbering, the purchases, when each idle node went idle, offers out of the plan,
the decisions' log). Each retirement is an own task; it continues as new when the server
suggests it (or ``renew`` asks: the event watch in flight is cut), through the base's gate, once
they have ended (it has no handler that awaits).
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, FailureError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import activities as act
    from fleet.contracts import workflows as flows
    from fleet import search_attributes as sa
    from fleet.cluster import CORDONED_BY_DEMAND
    from fleet.consolidation import ConsolidationSettings, consolidate
    from fleet.messages.capacity import Catalog, GetCatalogInput, ReleaseCordonsInput
    from fleet.messages.demand import (
        CancelOutcome, CancelPurchaseInput, DemandBatch, DemandCarry, DemandInput, DemandStatus, IdleNodesResult,
        JoiningMachine, PlanAndBuyInput, PlanAndBuyResult, PlanDemandInput, PlanDemandResult, Purchase, PurchaseState,
        PurchaseStatusInput, StartedPurchasesInput, StartPurchaseInput, WatchDemandInput, pods_named, purchase_request,
        purchase_summary,
    )
    from fleet.naming import purchase_workflow_id
    from fleet.messages.watches import DemandWake, DemandWatchInput
    from workflows.entity import Entity
    from workflows.inputs import MAX_NOTE, parse_input
    from fleet.routing import shortened
    from workflows.passes import FailedPasses
    from workflows.steps import (
        CLUSTER_RETRY,
        PROVIDER_RETRY,
        PUT_BACK_RETRY,
        PUT_BACK_UNTIL,
        QUICK,
        STORE_RETRY,
        WAIT_HEARTBEAT,
        MAX_PROBLEM_SHOWN,
        Retirement,
        cancelled_by_request,
        cancelled_words,
        drain_node,
        failure_message,
        failure_text,
        retire_drained,
        show_details,
        to_its_end,
        until,
        until_in,
    )

#: The event watch's heartbeat timeout (one beat per half: the watch waits up to ``tick_seconds``).
DEMAND_WATCH_HEARTBEAT = timedelta(minutes=10)
#: Decisions kept in the status (and carried over continue-as-new).
LOG_LINES = 60
#: Workflow patch (issue 37): the loop wakes on events, not on a tick. ``watch_demand_events``
#: returns when new opted-in Pending pods' batch closes, a pod a purchase was bought for goes, a
#: purchase ends, or the nodes holding GPU pods change (one went idle); else at the earliest idle
#: node's TTL or after ``tick_seconds`` (the safety look). The catalog and the plan are read only
#: for new pods, an ended purchase or the safety look; idle nodes only when they may have changed.
EVENTS_PATCH = "demand-events"
#: Workflow patch: a loop started afresh numbers its purchases ``capacity/demand-<series>-<n>``,
#: its series the last 8 hex digits of its first run's id, carried over continue-as-new. Before
#: it every fresh start numbered ``capacity/demand-1`` on, and a purchase an earlier loop still
#: ran under that id took the new pods (``start_purchase`` joins a running purchase of its id):
#: nothing was bought for them. Asked only by a run started afresh, before its first command.
SERIES_PATCH = "demand-purchase-series"
#: Workflow patch: a cancelled loop winds down before it ends: each purchase still buying (or kept
#: after its pods went) is told to ``stop``, its drains in flight are cancelled and their nodes (and those its blocked drains left
#: cordoned) uncordoned, unless someone else holds them; a purchase whose start is in flight as the
#: cancel lands is started first, so it is stopped too. Runs before it ended at the cancel: the
#: purchases bought on until their deadline, for pods perhaps gone, and the nodes stayed cordoned.
#: Asked only where the run's cancel is seen (Demand runs no local activity).
CANCEL_WINDS_DOWN_PATCH = "demand-cancel-winds-down"
#: Workflow patch: the catalog read, the plan and each planned machine's purchase start are one
#: activity, ``plan_and_buy`` (it numbers the purchases on from the loop's, and takes those an earlier
#: try of it started as its own). Runs before it scheduled ``get_catalog``, ``plan_demand`` and one
#: ``start_purchase`` per machine, each a round trip through the loop that the Pending pods waited on.
#: Asked where the pass plans, right before its first command there (Demand runs no local activity).
PLAN_AND_BUY_PATCH = "demand-plans-and-buys-in-one-step"
#: Workflow patch: a purchase kept after its pods went (a join of it past provisioning, or it could
#: not be asked: a transient error) is followed while it runs, as one buying: each pass asks to cancel
#: it again (cancelled once it can be asked and has nothing past provisioning), the plan counts it as
#: joining, and its end wakes the watch. Runs before it never looked at a kept purchase again: it ran
#: alone to its deadline, buying again for nobody if its join failed, and new pods bought beside it.
#: Asked where the loop first follows a kept purchase (Demand runs no local activity).
FOLLOWS_KEPT_PATCH = "demand-follows-kept-purchases"
#: The loop's first pause after a failed pass (``FailedPasses``): Pending pods wait on it.
FIRST_PAUSE = timedelta(seconds=1)
#: What a pass was doing, by the activity that failed (``FailedPasses``: "could not <step> ...").
STEPS = {
    "demand_settings": "read the fleet config's demand: block",
    "watch_demand_events": "watch the Pending pods", "watch_demand": "watch the Pending pods",
    "purchase_status": "look at the purchases in flight", "cancel_purchase": "cancel a purchase whose pods went",
    "get_catalog": "read the provider catalog", "plan_demand": "plan the Pending pods",
    "plan_and_buy": "plan the Pending pods and start their purchases",
    "start_purchase": "start a purchase", "idle_nodes": "list the idle nodes",
}


@workflow.defn(name="Demand")
class Demand(Entity[DemandCarry]):
    #: ``run``'s input: the input guard refuses its ``Carried`` fields in a run that did not continue as new.
    INPUT = DemandInput

    def __init__(self) -> None:
        super().__init__(DemandCarry())
        #: What the last look found (Pending pods, the plan's verdicts, retirements in flight):
        #: not carried, the next run looks again. ``status`` adds the state's purchases and log.
        self._seen = DemandStatus()
        self._retry = FailedPasses(STEPS, show=self._show, log=self._log, first_pause=FIRST_PAUSE)
        #: The event watch in flight, which ``renew`` cuts.
        self._watching: workflow.ActivityHandle[DemandWake] | None = None

    def on_renewal_asked(self) -> None:
        # The loop asks after its pass, whose event watch waits up to ``tick_seconds`` (10 minutes by
        # default, up to a day): cut, the pass ends there. Level-triggered, nothing is lost: the next
        # run's first pass, a full one, looks again at the Pending pods, purchases and idle nodes.
        if self._watching is not None:
            self._watching.cancel()

    @workflow.query
    def status(self) -> DemandStatus:
        return self._seen.model_copy(update={"purchases": self.state.purchases, "log": self.state.log})

    def _log(self, line: str) -> None:
        stamp = workflow.now().strftime("%H:%M:%S")
        self.state.log = [*self.state.log, f"{stamp} {line}"][-LOG_LINES:]

    def _show(self, step: str, detail: str = "") -> None:
        s = self.status()
        buying = [p for p in s.purchases if p.status == "buying"]
        lines = [f"{s.pending} Pending pods waiting on purchases; last batch window {s.window_seconds:.1f}s"]
        lines += [f"- `{p.workflow_id}`: {len(p.pods)} pods → {p.offer} ({p.reason})" for p in buying[:10]]
        lines += [f"- not placed {pod}: {why}" for pod, why in list(s.unplaceable.items())[:5]]
        lines += [f"- retiring {node}: {why}" for node, why in s.retiring.items()]
        if self._retry.failing and self._retry.failing != step:  # a pass after a failed one: still say why
            lines.append(f"- the last pass: {self._retry.failing}")
        lines += [f"- {line}" for line in s.log[-8:]]
        show_details(step, *lines, detail=detail)

    @workflow.run
    async def run(self, raw: Any) -> None:
        args = parse_input(DemandInput, raw)
        self._args = args
        self.start_with(args.carry)
        if args.carry is None and workflow.patched(SERIES_PATCH):
            # A loop started afresh (``gpufleet demand --start`` after one ended) numbers its
            # purchases in a series of its own: never onto an earlier loop's purchase in flight.
            # The run id's end, its random part: a UUIDv7 begins with the time, alike for runs a minute apart.
            self.state.series = workflow.info().first_execution_run_id.replace("-", "")[-8:]
        #: Node → its retirement (an own task: continue-as-new waits for it).
        self._retirements: dict[str, asyncio.Task] = {}
        #: Node → when its retirement began (its drain's bound is ``drain_seconds`` from then).
        self._retiring_since: dict[str, datetime] = {}
        #: The nodes whose retirement is at its drain (a cancel of the loop cancels those drains).
        self._draining: set[str] = set()
        #: Nodes holding GPU pods as the last watch saw them (``EVENTS_PATCH``).
        self._busy: list[str] | None = None
        #: The fleet config's ``demand:`` block, read by the first pass that gets through it.
        self._config: dict | None = None
        #: A ``plan_and_buy`` failed (or is in flight): purchases it started may be unknown to the loop.
        self._unanswered = False
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("watching")])
        try:
            await self._loop()
        except (asyncio.CancelledError, ActivityError) as error:
            if cancelled_by_request(error) and workflow.patched(CANCEL_WINDS_DOWN_PATCH):
                # The cancel is taken here once: the wind-down runs to its end, then the run ends cancelled.
                await to_its_end(asyncio.ensure_future(self._wind_down()))
            raise

    async def _loop(self) -> None:
        # A full pass first, and after a failed one: plan and consolidate whatever woke it.
        full = True
        while True:
            try:
                await self._pass(full)
            except ActivityError as error:  # the cluster or a provider away: never the loop's end
                await self._retry.pause_after(error)
                full = True
            else:
                self._retry.passed()
                full = False
            if self.continue_as_new_suggested():
                # Blocks the loop until the retirements end (drains, in minutes), then continues.
                self._show_continuing()
                await self.continue_as_new_when_ready(
                    lambda: self._args.model_copy(update={"carry": self.state}).model_dump(mode="json"))

    def _show_continuing(self) -> None:
        """What the loop waits for before it continues as new: its retirements in flight, each
        drain until its bound at most (no new pass meanwhile). Nothing in flight: it goes on at once."""
        going = sorted(node for node, task in self._retirements.items() if not task.done())
        if not going:
            return
        said = []
        for node in going:
            if node in self._draining and node in self._retiring_since:
                at = self._retiring_since[node] + timedelta(seconds=self._args.drain_seconds)
                said.append(f"`{node}` drained (PodDisruptionBudgets honoured) {until(at)} at most, "
                            "then its machine deleted")
            else:
                said.append(f"`{node}`: its machine being deleted")
        self._show("continuing as new", f"no new pass until its retirements in flight end: {'; '.join(said)}")

    async def _read_config(self) -> None:
        config: dict = await workflow.execute_activity(
            act.demand_settings, start_to_close_timeout=QUICK, retry_policy=STORE_RETRY,
            summary="the fleet config's demand: block",
        )
        args = self._args
        self._batch_idle = (args.batch_idle_seconds if args.batch_idle_seconds is not None
                            else config["batch_idle_seconds"])
        self._batch_max = args.batch_max_seconds if args.batch_max_seconds is not None else config["batch_max_seconds"]
        self._consolidation = ConsolidationSettings(
            idle_ttl_seconds=args.idle_ttl_seconds if args.idle_ttl_seconds is not None else config["idle_ttl_seconds"],
            max_site_fraction=(args.max_site_fraction if args.max_site_fraction is not None
                               else config["max_site_fraction"]),
        )
        self._events = workflow.patched(EVENTS_PATCH)
        self._config = config

    async def _pass(self, full: bool) -> None:
        """One pass: watch, follow the purchases, plan and buy, consolidate. ``full``: plan and
        consolidate whatever woke it (the first pass, the one after a failed pass)."""
        if self._config is None:
            await self._read_config()
        args, events = self._args, self._events
        wait = self._watch_wait()
        self._show(f"watching Pending pods {until_in(wait)} with nothing new")
        known = sorted({pod for p in self._buying() for pod in p.pods}
                       | set(self._seen.covered) | set(self._seen.unplaceable))
        why = "tick"
        if events:
            wake = await self._watch_events(known, self._batch_idle, self._batch_max, wait)
            if wake is None:
                return  # cut by ``renew``: the loop continues as new
            batch, why, self._busy = wake.batch, wake.why, wake.busy
        else:
            batch = await workflow.execute_activity(
                act.watch_demand,
                WatchDemandInput(known=known, batch_idle_seconds=self._batch_idle, batch_max_seconds=self._batch_max,
                                 wait_seconds=args.tick_seconds, poll_seconds=args.poll_seconds),
                start_to_close_timeout=timedelta(seconds=args.tick_seconds + self._batch_max + 60),
                heartbeat_timeout=WAIT_HEARTBEAT, retry_policy=CLUSTER_RETRY,
                summary="wait for Pending GPU pods; batch them",
            )
        if batch.new:
            self._seen.window_seconds = batch.window_seconds
        ended = await self._follow_purchases(set(batch.present))
        # On events: the plan only when there is something new to plan (or the safety look).
        if not events or full or batch.new or ended or why == "timeout":
            await self._plan_and_buy(batch)
        if args.consolidate and (not events or full or why in ("idle", "timeout") or ended):
            await self._consolidate()

    def _watch_wait(self) -> float:
        """How long the next watch waits with nothing new: ``tick_seconds`` (the safety look); on
        events at most until the earliest idle node's TTL."""
        args, now = self._args, workflow.now().timestamp()
        wait = args.tick_seconds
        if self._events and args.consolidate:
            ttl = self._consolidation.idle_ttl_seconds
            due = [since + ttl - now for node, since in self.state.idle_since.items()
                   if since + ttl > now and node not in self._retirements]
            wait = min([wait, *due])
        return wait

    async def _watch_events(self, known: list[str], batch_idle: float, batch_max: float,
                            wait: float) -> DemandWake | None:
        """One ``watch_demand_events``: until the next thing the loop acts on, at most ``wait``
        (``_watch_wait``). Heartbeats once per ``DEMAND_WATCH_HEARTBEAT`` half: the watch is long.
        None: ``renew`` cut it (or came before it)."""
        if self.renewal_asked:
            return None
        args = self._args
        buying = self._buying()
        # The same command as ``execute_activity``, its handle kept for ``renew`` to cut.
        self._watching = workflow.start_activity(
            act.watch_demand_events,
            DemandWatchInput(known=known, batch_idle_seconds=batch_idle, batch_max_seconds=batch_max,
                             wait_seconds=max(wait, 0.0), tracked=sorted({pod for p in buying for pod in p.pods}),
                             gone=sorted({pod for p in buying for pod in p.gone}),
                             purchases=[p.workflow_id for p in self._followed()],
                             busy=self._busy if args.consolidate else None,
                             poll_seconds=args.poll_seconds),
            start_to_close_timeout=timedelta(seconds=wait + batch_max + 120),
            heartbeat_timeout=DEMAND_WATCH_HEARTBEAT, retry_policy=CLUSTER_RETRY,
            summary="wait for Pending GPU pods (batched), purchases ending, nodes going idle",
        )
        try:
            return await self._watching
        except ActivityError as error:
            if self.renewal_asked and is_cancelled_exception(error) and not cancelled_by_request(error):
                return None
            raise
        finally:
            self._watching = None

    def _buying(self) -> list[Purchase]:
        return [p for p in self.state.purchases if p.status == "buying"]

    def _followed(self) -> list[Purchase]:
        """The purchases the loop follows until they end: those buying and, since
        ``FOLLOWS_KEPT_PATCH``, those kept after their pods went (the patch asked once one is kept)."""
        kept = any(p.status == "kept" for p in self.state.purchases) and workflow.patched(FOLLOWS_KEPT_PATCH)
        return [p for p in self.state.purchases if p.status == "buying" or (kept and p.status == "kept")]

    # -- purchases ------------------------------------------------------------------------
    async def _follow_purchases(self, present: set[str]) -> bool:
        """Purchases that ended (joined or failed), were cancelled or kept: True when any did."""
        followed = self._followed()
        if not followed:
            return False
        was = [p.status for p in followed]
        states: list[PurchaseState] = await workflow.execute_activity(
            act.purchase_status, PurchaseStatusInput(workflow_ids=[p.workflow_id for p in followed]),
            start_to_close_timeout=QUICK, retry_policy=STORE_RETRY,
            summary=f"how {len(followed)} purchases are doing",
        )
        by_id = {s.workflow_id: s for s in states}
        now = workflow.now().timestamp()
        for purchase in followed:
            state = by_id.get(purchase.workflow_id)
            if state is None or state.status == "running":
                if purchase.pods and not any(pod in present for pod in purchase.pods):
                    outcome: CancelOutcome = await workflow.execute_activity(
                        act.cancel_purchase, CancelPurchaseInput(
                            workflow_id=purchase.workflow_id, site=purchase.site,
                            reason="every pod it was bought for is gone"),
                        start_to_close_timeout=QUICK, retry_policy=STORE_RETRY,
                        summary=f"pods gone: cancel {purchase.workflow_id} unless provisioning",
                    )
                    status = "cancelled" if outcome.cancelled else "kept"
                    if status != purchase.status:  # one kept again, pass after pass, is said once
                        self._log(f"{purchase.workflow_id}: pods gone; " + ("cancelled before provisioning"
                                                                            if outcome.cancelled else outcome.reason))
                    purchase.status = status
                elif self._events and purchase.status == "buying":
                    self._partly_gone(purchase, present)
                continue
            if state.status == "completed":
                purchase.status, purchase.nodes = "joined", state.nodes
                self._log(f"{purchase.workflow_id}: joined {', '.join(state.nodes)} for {len(purchase.pods)} pods")
            elif state.status == "missing":
                # Never started (its start failed while Temporal was away): its offer did not fail.
                purchase.status = "failed"
                self._log(f"{purchase.workflow_id}: not found, never started; its pods are planned again")
            else:
                purchase.status = "failed"
                self.state.excluded[purchase.offer] = now + self._args.exclude_seconds
                why = "; ".join(state.why[:2]) or state.status
                self._log(f"{purchase.workflow_id}: {purchase.offer} failed ({why}); out of the plan for "
                          f"{self._args.exclude_seconds:.0f}s, its pods are planned again")
        # Keep the finished ones a while for the status; the newest 50.
        following = self._followed()
        followed_ids = {p.workflow_id for p in following}
        done = [p for p in self.state.purchases if p.workflow_id not in followed_ids]
        self.state.purchases = following + done[-50:]
        return [p.status for p in followed] != was

    def _partly_gone(self, purchase: Purchase, present: set[str]) -> None:
        """Some of the pods ``purchase`` was bought for went, the others still wait on it: it buys on
        for them, and the next watch is told the gone ones (``Purchase.gone``), so their absence does
        not end it again. Before, every watch returned "pods gone" at once for as long as the purchase
        bought: a watch and a ``purchase_status`` each time, some 40 a second. A pod back under its
        name is waited on again."""
        gone = [pod for pod in purchase.pods if pod not in present]
        new = [pod for pod in gone if pod not in purchase.gone]
        if new:
            left = len(purchase.pods) - len(gone)
            self._log(f"{purchase.workflow_id}: {pods_named(new)} gone; buying on for the {left} "
                      f"{'pod' if left == 1 else 'pods'} still waiting on it")
        purchase.gone = gone

    def _joining_and_excluded(self) -> tuple[list[JoiningMachine], dict[str, str]]:
        """What the plan counts as joining (the purchases followed: a kept one may still bring its
        node, and new pods wait on it rather than buy beside it) and the offers out of it now."""
        now = workflow.now().timestamp()
        self.state.excluded = {k: until for k, until in self.state.excluded.items() if until > now}
        joining = [JoiningMachine(purchase=p.workflow_id, site=p.site, gpus=p.gpus, capacity_type=p.capacity_type,
                                  model_gpus=p.model_gpus) for p in self._followed()]
        return joining, {k: "a purchase there just failed" for k in self.state.excluded}

    async def _plan_and_buy(self, batch: DemandBatch) -> None:
        if workflow.patched(PLAN_AND_BUY_PATCH):
            await self._plan_and_buy_in_one_step(batch)
            return
        # A run from before ``PLAN_AND_BUY_PATCH``: the catalog, the plan and each start, one activity each.
        catalog: Catalog = await workflow.execute_activity(
            act.get_catalog, GetCatalogInput(max_age_seconds=60),
            start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY, summary="provider catalog: offers, accounts",
        )
        joining, excluded = self._joining_and_excluded()
        result: PlanDemandResult = await workflow.execute_activity(
            act.plan_demand,
            PlanDemandInput(offers=catalog.offers, accounts=catalog.accounts, joining=joining, excluded=excluded),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary=f"plan {len(batch.new)} new Pending pods (bin-pack onto the cheapest offers)",
        )
        self._planned(batch, result)
        for machine in result.plan.machines:
            self.state.seq += 1
            purchase = Purchase.of(machine, purchase_workflow_id(self.state.seq, self.state.series),
                                   started_at=workflow.now().timestamp())
            # Followed before it is started: a start that failed after its retries (Temporal away)
            # may still have started it, and a purchase running untracked would be bought twice.
            self.state.purchases.append(purchase)
            await self._start_purchase(workflow.start_activity(
                act.start_purchase, StartPurchaseInput(
                    workflow_id=purchase.workflow_id,
                    request=purchase_request(machine, self._args.purchase_deadline_seconds,
                                             self._args.capacity_request),
                    summary=purchase_summary(machine)),
                start_to_close_timeout=QUICK, retry_policy=STORE_RETRY,
                summary=f"buy {machine.offer} for {len(machine.pods)} pods",
            ))
            self._bought(purchase)
        self._labelled(result)

    async def _plan_and_buy_in_one_step(self, batch: DemandBatch) -> None:
        """``PLAN_AND_BUY_PATCH``: the catalog, the plan and the purchases' starts in one activity."""
        joining, excluded = self._joining_and_excluded()
        # Until its answer: a step that fails may have started purchases first, which the loop hears
        # of only from the next step (it takes them) or, cancelled before that, from ``_take_started``.
        self._unanswered = True
        step = workflow.start_activity(
            act.plan_and_buy,
            PlanAndBuyInput(joining=joining, excluded=excluded, seq=self.state.seq, series=self.state.series,
                            deadline_seconds=self._args.purchase_deadline_seconds,
                            capacity_request=self._args.capacity_request),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary=f"plan {len(batch.new)} new Pending pods (bin-pack onto the cheapest offers) and buy",
        )
        try:
            result = await asyncio.shield(step)
        except asyncio.CancelledError:
            # The run's cancel. The step starts its purchases whether or not a cancel reaches it, and
            # the loop hears of them only from its answer: awaited to it, so the wind-down stops them.
            try:
                self._took(batch, await step)
            except ActivityError:
                pass  # failed meanwhile: the wind-down looks for what it started (``_unanswered``)
            raise
        self._took(batch, result)

    def _took(self, batch: DemandBatch, result: PlanAndBuyResult) -> None:
        """What one ``plan_and_buy`` planned and started, followed from now on."""
        self._unanswered = False
        self._planned(batch, result)
        self.state.seq = max(self.state.seq, result.seq)
        for purchase in result.purchases:
            self.state.purchases.append(purchase)
            self._bought(purchase)
        self._labelled(result)

    def _planned(self, batch: DemandBatch, result: PlanDemandResult) -> None:
        plan = result.plan
        self._seen.covered = plan.covered
        self._seen.unplaceable = plan.unplaceable
        self._seen.pending = len(plan.covered) + len(plan.unplaceable) + sum(len(m.pods) for m in plan.machines)
        for pod, why in plan.unplaceable.items():
            if pod in batch.new:
                self._log(f"{pod}: nothing bought: {why}")

    def _bought(self, purchase: Purchase) -> None:
        self._log(f"{pods_named(purchase.pods)} → {purchase.offer} → `{purchase.workflow_id}`: {purchase.reason}")

    def _labelled(self, result: PlanDemandResult) -> None:
        if result.labelled:
            self._log(f"fleet labels set on {', '.join(result.labelled[:5])}")

    @staticmethod
    async def _start_purchase(starting: workflow.ActivityHandle[str]) -> None:
        """A purchase's start, awaited to its answer even when the run's cancel lands meanwhile:
        the activity starts the purchase whether or not its cancel reaches it (it waits on one call
        to Temporal), so a start cancelled with the run could start a purchase after the wind-down
        looked, which would buy on for nobody. The cancel is raised once the start has answered."""
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            if not workflow.patched(CANCEL_WINDS_DOWN_PATCH):
                starting.cancel()  # a run from before: the start cancelled with the run, as it was
                await starting
            try:
                await starting
            except ActivityError:
                pass  # it may have started all the same: the wind-down tells it to stop either way
            raise

    # -- the run's cancel ----------------------------------------------------------------
    async def _wind_down(self) -> None:
        """The run's cancel (``CANCEL_WINDS_DOWN_PATCH``): stop spending, then put back what the
        loop's drains changed. Each purchase still buying is told to ``stop`` (its joins in flight
        delete their machines; nodes already joined stay); each drain in flight is cancelled, a
        retire past its drain ends as it goes (a node retired stays retired), and the nodes the
        loop cordoned are uncordoned unless someone else holds them now. Said in the log and the
        details: "cancelled: stopped purchases X, Y; uncordoned A"."""
        # The cancel's reason is a person's free text: cut for the details, and not passed on to the
        # purchases (``AcquireCapacity.stop`` drops a reason past MAX_NOTE, and the purchase bought on).
        why = shortened(f"the demand loop was {cancelled_words()}", MAX_NOTE)
        self._show("cancelled: winding down", "stopping its purchases and drains, then uncordoning the nodes its "
                                              f"drains cordoned: each put-back {PUT_BACK_UNTIL}")
        if self._unanswered:
            self._show("cancelled: winding down", f"looking for the purchases a failed step started: {PUT_BACK_UNTIL}")
            await self._take_started()
        stopped, ended = await self._stop_purchases("the demand loop was cancelled")
        uncordoned, left = await self._release_drains()
        said = [f"stopped purchases {', '.join(stopped)}" if stopped else "no purchase was buying"]
        if ended:
            said.append(f"already ended: {', '.join(ended)}")
        said.append(f"uncordoned {', '.join(uncordoned)}" if uncordoned else "no node left cordoned")
        if left:
            said.append(left)
        self._log("cancelled: " + "; ".join(said))
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("cancelled")])
        show_details("cancelled", *(f"- {line}" for line in said), detail=why)

    async def _take_started(self) -> None:
        """The purchases still running that a failed ``plan_and_buy`` started under the loop's next
        numbers (each carries what the loop follows it as), followed from now on: no later step
        takes them, and unknown to the wind-down they would buy until their deadline. Retried until
        done, as a put-back."""
        try:
            started: list[Purchase] = await workflow.execute_activity(
                act.started_purchases, StartedPurchasesInput(seq=self.state.seq, series=self.state.series),
                start_to_close_timeout=QUICK, retry_policy=PUT_BACK_RETRY,
                summary="the purchases a failed step started (the loop was cancelled)",
            )
        except ActivityError as error:  # refused for good: the wind-down stops those it knows
            problem = failure_text(error)[:MAX_PROBLEM_SHOWN]
            self._log(f"could not look for the purchases a failed step started ({problem})")
            return
        for purchase in started:
            self.state.purchases.append(purchase)
            self._bought(purchase)

    async def _stop_purchases(self, why: str) -> tuple[list[str], list[str]]:
        """Signal ``stop`` to each purchase still buying, and to each kept after its pods went (its
        node was to come for consolidation to give back, and no loop is left to): the ones stopped,
        and those still buying as the loop last looked that had ended (or never started)."""
        buying = [p for p in self.state.purchases if p.status in ("buying", "kept")]

        async def stop(purchase: Purchase) -> bool:
            try:
                await workflow.get_external_workflow_handle(purchase.workflow_id).signal(flows.AcquireCapacity.stop, why)
            except FailureError as error:
                workflow.logger.info("purchase %s not stopped: %s", purchase.workflow_id, failure_message(error))
                return False
            purchase.status = "stopped"
            return True

        done = await asyncio.gather(*(stop(p) for p in buying))
        return ([p.workflow_id for p, ok in zip(buying, done) if ok],
                [p.workflow_id for p, ok in zip(buying, done) if not ok and p.status == "buying"])

    async def _release_drains(self) -> tuple[list[str], str]:
        """Cancel the drains in flight, let a retire past its drain finish, then uncordon the nodes
        the loop cordoned (those drains', and those its blocked drains left cordoned): on the marks
        as read, so a node someone took since (a repair's fence, a person's mark) is left to them.
        The ones uncordoned, and what could not be done."""
        draining = sorted(self._draining)
        for node in draining:
            self._retirements[node].cancel()
        await asyncio.gather(*self._retirements.values(), return_exceptions=True)
        self._seen.retiring = {}
        nodes = sorted({*draining, *self.state.left_cordoned})
        if not nodes:
            return [], ""
        self._show("cancelled: winding down", f"uncordoning {', '.join(nodes[:5])}"
                                              + (f" and {len(nodes) - 5} more" if len(nodes) > 5 else "")
                                              + f": {PUT_BACK_UNTIL}")
        try:
            # Until done, as every put-back: no loop is left to try again.
            released: list[str] = await workflow.execute_activity(
                act.release_cordons, ReleaseCordonsInput(nodes=nodes, cordoned_by=CORDONED_BY_DEMAND),
                start_to_close_timeout=QUICK, retry_policy=PUT_BACK_RETRY,
                summary=f"uncordon {', '.join(nodes[:5])}: cordoned by the loop's drains (the loop was cancelled)",
            )
        except ActivityError as error:
            # Refused for good. Marked the loop's: a loop started again retires them once idle (``_own_cordons``).
            return [], f"{', '.join(nodes)} not uncordoned ({failure_text(error)[:MAX_PROBLEM_SHOWN]})"
        self.state.left_cordoned = [n for n in self.state.left_cordoned if n not in released]
        return released, ""

    # -- consolidation --------------------------------------------------------------------
    async def _consolidate(self) -> None:
        for node, task in list(self._retirements.items()):
            if task.done():
                del self._retirements[node]
                self._retiring_since.pop(node, None)
                self._seen.retiring.pop(node, None)
        found: IdleNodesResult = await workflow.execute_activity(
            act.idle_nodes, start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary="GPU nodes with no GPU pod",
        )
        now = workflow.now().timestamp()
        idle_names = {n.name for n in found.idle}
        # Idle since the loop first saw it empty (a pod landing on it resets that).
        self.state.idle_since = {name: self.state.idle_since.get(name, now) for name in idle_names}
        for node in found.idle:
            node.idle_since = self.state.idle_since[node.name]
        retiring: dict[str, int] = {}
        for node in self._retirements:
            site = self._seen.retiring.get(node, "").split(":", 1)[0]
            retiring[site] = retiring.get(site, 0) + 1
        candidates = [n for n in found.idle if n.name not in self._retirements]
        self.state.left_cordoned = self._own_cordons(found)
        others = set(found.cordoned) - set(self.state.left_cordoned)
        chosen, kept = consolidate(candidates, found.site_nodes, found.site_min, retiring, now,
                                   self._consolidation, keep_warm=found.keep_warm, cordoned=others)
        for node in kept:
            if node in found.held:
                kept[node] = f"{found.held[node]}: not the loop's to retire"
        self._seen.kept_idle = kept
        for retire in chosen:
            self._seen.retiring[retire.node] = f"{retire.site}: {retire.reason}"
            self._log(f"retire {retire.node} at {retire.site}: {retire.reason}")
            self._retiring_since[retire.node] = workflow.now()
            self._retirements[retire.node] = self.spawn(self._retire(retire.site, retire.node,
                                                                     retire.machine_id, retire.reason))

    def _own_cordons(self, found: IdleNodesResult) -> list[str]:
        """The cordoned nodes that are the loop's to retire: those its own blocked drain left
        cordoned (carried) and those the cluster marks as its cordon (a run whose carried state
        lacks them: from before ``left_cordoned``, or lost), unless someone else holds one now (a
        repair fenced a GPU of it, a person marked it theirs): that one the loop lets go, its
        cordon left to them. A node uncordoned or gone since is no longer the loop's either."""
        own: list[str] = []
        for node in self.state.left_cordoned:
            if node in found.held:
                self._log(f"let go {node}, left cordoned by a retirement of the loop's: {found.held[node]} "
                          "now; the cordon is theirs")
            elif node in found.cordoned:
                own.append(node)
        for node in found.own_cordon:
            if node not in own and node not in self._retirements:
                self._log(f"{node}: cordoned by an earlier drain of the loop's (the cluster's mark): "
                          "the loop's to retire")
                own.append(node)
        return own

    async def _retire(self, site: str, node: str, machine_id: str, reason: str) -> None:
        try:
            # The drain, then the retire (``steps.drain_and_retire``): a cancel of the loop cancels
            # the drain, never a retire under way.
            self._draining.add(node)
            try:
                drained = await drain_node(node, self._args.drain_seconds, cordoned_by=CORDONED_BY_DEMAND,
                                           summary=f"drain {node} (idle: {reason}; PDBs honoured)")
            finally:
                self._draining.discard(node)
            outcome = await retire_drained(site, node, machine_id, drained, cordoned_by=CORDONED_BY_DEMAND)
        except ActivityError as error:  # the cluster away: said, not lost with the task
            if cancelled_by_request(error):
                raise
            outcome = Retirement(False, failed=f"could not drain ({failure_text(error)[:MAX_PROBLEM_SHOWN]})")
        if outcome.retired:
            self._log(f"retired {node} at {site}")
            self.state.idle_since.pop(node, None)
        elif outcome.kept:
            # Taken since the loop chose it (a repair fenced a GPU during the drain): not the
            # loop's to retire, nor its cordon to carry.
            self._log(f"kept {node}: {outcome.kept} since it was chosen; the cordon is theirs")
            self.state.left_cordoned = [n for n in self.state.left_cordoned if n != node]
        else:
            self._log(f"kept {node}: {outcome.blocked or outcome.failed}")
            # Uncordon is the drain's business to undo: a blocked drain leaves the node
            # cordoned, so it is tried again next time (still idle) rather than reused.
            self.state.left_cordoned = [*(n for n in self.state.left_cordoned if n != node), node]
