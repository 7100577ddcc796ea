"""Routing (entity, id ``routing/<model>``): the one writer of a model's routes.

Recomputes the model's per-site weights (``fleet.routing``) when a site event
arrives (``site_event``: incident, drain, restore, rollout, scale) and when the
model's load moves them, and writes the result as one versioned routing document
through ``write_routing``; the front doors render that document (an Envoy
Gateway HTTPRoute with its policies in production, HAProxy through its runtime
API in the dev stack).

Load (``EVENTS_PATCH``, "routing-events"): one ``watch_routing`` at a time samples in the
worker, free of Temporal actions, and returns only when the document this entity
would decide from a sample differs from the current one (or after its long safety
wait); an idle model costs its watch, about twelve actions an hour, and no timer.
Runs from before it sampled on a 30 s timer (about 240 actions an hour).

A sample (``routing_sample``) reads each site's Ready replicas, queue depth,
latency to the callers' geography and price, plus what an evacuation decided for
the site (the fleet-wide site document: draining, incident, weight ceiling), so
an evacuation and its restore move traffic through this entity. Events only add
to that: an event's override holds until a later event (``restore``) lifts it.

A sample or write that failed (the cluster away past its retries, or refusing) is no end of the
entity: it is shown and recomputed after a growing pause, its overrides and events kept
(``FailedPasses``).

An entity (``workflows.entity``, docs/design/entities.md): its one state is ``RoutingState``
(overrides, the last document, pending reasons). Its handler never awaits (one step each, no
lock); it continues as new when the server suggests it, through the base's gate, once the
watch in flight is cancelled (the next run watches again).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import activities as act
    from fleet.errors import NON_RETRYABLE_TYPES
    from fleet.messages.routing import (
        RoutingInput,
        RoutingModelInput,
        RoutingProgress,
        RoutingSample,
        RoutingSampleInput,
        RoutingState,
        RoutingWatchInput,
        RoutingWatchResult,
        SiteEvent,
        SiteOverride,
        apply_override,
    )
    from fleet.routing import RoutingDocument, next_document
    from workflows.entity import Entity
    from workflows.inputs import parse_input, parse_signal, refusal
    from workflows.passes import FailedPasses
    from workflows.steps import (
        CLUSTER_RETRY, LONG_WATCH_HEARTBEAT, LONG_WATCH_PAUSE, LONG_WATCH_RETRY, QUICK, failure_message,
        show_details,
    )

#: Workflow patch (issue 37): load reaches the routes through ``watch_routing``, which returns
#: only on a change the entity would write; no timer, no periodic sample. Asked first in ``run``.
EVENTS_PATCH = "routing-events"
#: The load watch: ``LONG_WATCH_*`` (``workflows/steps.py``). Site events never wait on its
#: heartbeat: they cancel the watch.
#: A watch that saw a change the entity did not (worker and workflow code out of step) is
#: followed by one that waits this long before it may return on a change: no spinning.
WATCH_HOLD_SECONDS = 60.0
#: What a pass was doing, by the activity that failed (``FailedPasses``: "could not <step> ...").
STEPS = {"routing_sample": "sample the model's sites", "write_routing": "write the routes"}
#: The first pause after a failed pass (``FailedPasses``): the routes wait on it.
FIRST_PAUSE = timedelta(seconds=1)
#: Workflow patch: a run started afresh (no carried state) first asks whether its model is one
#: the fleet has (``routing_model_problems``: a site serves it, or ``models:`` names it); one that
#: is not (started by hand for a typo: the system starts a model's entity only once a Deployment
#: of it exists) is refused, ``InvalidInput`` naming ``model``, before it writes a routing table.
#: Asked only in such a run. Before it, the entity wrote an empty table for the typo and watched it
#: for good. A continued run is not asked: its model may have gone since, and it says so.
MODEL_CHECKED_PATCH = "routing-checks-its-model"
#: The check must not hold a new model's first routes for long: a cluster that does not answer it
#: leaves the entity to run as before.
MODEL_CHECK_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3,
                                non_retryable_error_types=NON_RETRYABLE_TYPES)


@workflow.defn(name="Routing")
class RoutingEntity(Entity[RoutingState]):
    #: ``run``'s input: the input guard refuses its ``Carried`` fields in a run that did not continue as new.
    INPUT = RoutingInput

    def __init__(self) -> None:
        super().__init__(RoutingState())
        self._watch: workflow.ActivityHandle[RoutingWatchResult] | None = None
        self._hold = 0.0

    @workflow.signal
    def site_event(self, raw: dict[str, Any]) -> None:
        event = parse_signal(SiteEvent, raw, "site_event")
        if event is not None:
            # After ``run`` took its state: ``routing_event`` starts the entity with the event,
            # whose handler runs before ``run`` begins (entity rule 1).
            self.after_start(lambda: self._take_event(event))

    def _take_event(self, event: SiteEvent) -> None:
        o = self.state.overrides.get(event.site, SiteOverride())
        if event.kind == "incident":
            o = o.model_copy(update={"healthy": False, "incident": event.detail or "incident"})
        elif event.kind == "drain":
            o = o.model_copy(update={"draining": True, "incident": event.detail or o.incident})
        elif event.kind == "restore":
            o = SiteOverride(cap_percent=100 if event.cap_percent is None else event.cap_percent)
        if event.cap_percent is not None and event.kind != "restore":
            o = o.model_copy(update={"cap_percent": event.cap_percent})
        if o == SiteOverride():
            self.state.overrides.pop(event.site, None)
        else:
            self.state.overrides[event.site] = o
        self.state.events += 1
        self.state.add_pending(f"{event.kind} at {event.site}" + (f": {event.detail}" if event.detail else ""))

    @workflow.query
    def document(self) -> RoutingDocument | None:
        return self.state.document

    @workflow.query
    def progress(self) -> RoutingProgress:
        doc = self.state.document
        return RoutingProgress(events=self.state.events, applied=self.state.applied, version=doc.version if doc else 0)

    @workflow.run
    async def run(self, raw: Any) -> None:
        on_events = workflow.patched(EVENTS_PATCH)  # first: before any activity
        args = parse_input(RoutingInput, raw)
        if args.state is None and workflow.patched(MODEL_CHECKED_PATCH):
            await self._check_model(args)
        self.start_with(args.state)
        self._retry = FailedPasses(STEPS, show=lambda line: self._show_routes(args, line), first_pause=FIRST_PAUSE)
        if on_events:
            await self._run_on_events(args)
            return
        reason = "start"
        while True:
            try:
                await self._recompute(args, reason)
            except ActivityError as error:
                self.state.add_pending(reason)  # the next pass recomputes for it
                await self._retry.pause_after(error)
            else:
                self._retry.passed()
            timed_out = False
            try:
                await workflow.wait_condition(
                    lambda: bool(self.state.pending) or self.continue_as_new_suggested(),
                    timeout=timedelta(seconds=args.sample_seconds), timeout_summary="next load sample",
                )
            except asyncio.TimeoutError:
                timed_out = True
            events = self.state.take_pending()
            reason = "load sample" if timed_out else events
            if self.continue_as_new_suggested():
                # An event taken meanwhile is pending in the carried state: the next run recomputes first.
                await self.continue_as_new_when_ready(
                    lambda: args.model_copy(update={"state": self.state}).model_dump(mode="json"))

    async def _check_model(self, args: RoutingInput) -> None:
        """Refuse a model no site serves and the fleet config does not name (nothing written)."""
        try:
            problems = await workflow.execute_activity(
                act.routing_model_problems, RoutingModelInput(model=args.model),
                start_to_close_timeout=QUICK, retry_policy=MODEL_CHECK_RETRY,
                summary=f"is {args.model} served or configured",
            )
        except ActivityError as error:
            # Not known either way: the entity runs as before rather than end over a cluster read.
            workflow.logger.warning("could not check model %s: %s", args.model, failure_message(error))
            return
        if problems:
            refused = refusal("Routing", problems)
            show_details("refused", detail=refused.message)
            raise refused

    async def _run_on_events(self, args: RoutingInput) -> None:
        """Recompute at start and on every site event (a fresh sample, at once); otherwise sleep on
        the watch, which returns only with a sample the routes must follow. Nothing on a timer
        but the pause after a watch refused for good."""
        # Events carried over continue-as-new are in the first recompute.
        if not self.state.pending:
            self.state.add_pending("start")
        paused = False
        while True:
            reason = ""
            try:
                if self._watch is not None and self._watch.done():
                    reason = "load sample"
                    paused = not await self._take_watch(args)
                if self.state.pending:
                    reason = self.state.take_pending()
                    # The watch in flight judges by the overrides and document before the event.
                    await self._drop_watch()
                    await self._recompute(args, reason)
                    paused = False  # the cluster answered the event's sample: watch again
            except ActivityError as error:
                # The overrides are in the state already; the next pass recomputes for the reason.
                self.state.add_pending(reason)
                await self._retry.pause_after(error)
                await self._continue_as_new_if_suggested(args)
                continue
            if reason:
                self._retry.passed()
            await self._continue_as_new_if_suggested(args)
            if self._watch is None and not paused:
                self._watch = self._start_watch(args)
            try:
                await workflow.wait_condition(
                    lambda: (bool(self.state.pending) or (self._watch is not None and self._watch.done())
                             or self.continue_as_new_suggested()),
                    timeout=LONG_WATCH_PAUSE if paused else None, timeout_summary="routing watch failed: try again",
                )
            except asyncio.TimeoutError:
                paused = False

    async def _continue_as_new_if_suggested(self, args: RoutingInput) -> None:
        if self.continue_as_new_suggested():
            await self._drop_watch()
            # An event taken meanwhile is pending in the carried state: the next run recomputes first.
            await self.continue_as_new_when_ready(
                lambda: args.model_copy(update={"state": self.state}).model_dump(mode="json"))

    def _start_watch(self, args: RoutingInput) -> workflow.ActivityHandle[RoutingWatchResult]:
        hold, self._hold = self._hold, 0.0
        return workflow.start_activity(
            act.watch_routing,
            RoutingWatchInput(model=args.model, geography=args.geography, policy=args.policy,
                              overrides=self.state.overrides, previous=self.state.document,
                              look_seconds=args.sample_seconds, max_wait_seconds=args.watch_seconds,
                              hold_seconds=hold),
            start_to_close_timeout=timedelta(seconds=args.watch_seconds + hold) + QUICK,
            heartbeat_timeout=LONG_WATCH_HEARTBEAT, retry_policy=LONG_WATCH_RETRY,
            summary=f"load of {args.model}'s sites; on a change of its routes",
        )

    async def _take_watch(self, args: RoutingInput) -> bool:
        """The watch's sample into the routes; False: the watch failed for good (shown)."""
        watch, self._watch = self._watch, None
        try:
            seen = await watch
        except ActivityError as error:
            self._show_routes(args, f"load watch failed ({failure_message(error)}); again in {LONG_WATCH_PAUSE}")
            return False
        written = await self._decide(args, seen.sample, "load sample")
        if seen.changed and not written:
            self._hold = WATCH_HOLD_SECONDS
        return True

    async def _drop_watch(self) -> None:
        """Cancel the watch in flight (its result, if any, is stale); the loop starts the next."""
        watch, self._watch = self._watch, None
        if watch is None:
            return
        if not watch.done():
            watch.cancel()
        try:
            await watch
        except ActivityError:
            pass  # cancelled, or failed: either way replaced

    async def _recompute(self, args: RoutingInput, reason: str) -> None:
        # Events taken before the sample are in this recompute; later ones wait for the next.
        taken = self.state.events
        sample: RoutingSample = await workflow.execute_activity(
            act.routing_sample, RoutingSampleInput(model=args.model, geography=args.geography),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary=f"Ready replicas, load, latency and price of {args.model}'s sites",
        )
        await self._decide(args, sample, reason, taken)

    async def _decide(self, args: RoutingInput, sample: RoutingSample, reason: str, taken: int | None = None) -> bool:
        """The document from ``sample``, written when it changed (True). ``taken``: the events a
        sample taken after them reflects (a watch's sample may predate an event: none)."""
        sites = [apply_override(s, self.state.overrides.get(s.site)) for s in sample.sites]
        previous = self.state.document
        document = next_document(args.model, sites, args.policy, previous, reason)
        if document is not previous:
            await workflow.execute_activity(
                act.write_routing, document, start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                summary=f"routing v{document.version} of {args.model}: {reason}"[:200],
            )
            self.state.document = document
        if taken is not None:
            self.state.applied = taken
        self._show_routes(args)
        return document is not previous

    def _show_routes(self, args: RoutingInput, note: str = "") -> None:
        doc = self.state.document
        lines = [f"{site}: weight {r.weight}/1000, {r.ready_replicas} ready"
                 + (" (draining)" if r.draining else "") + ("" if r.healthy else " (unhealthy)")
                 for site, r in sorted(doc.sites.items())] if doc else ["no sites serve this model yet"]
        if doc is not None and not doc.sites:
            # Its Deployments went (a model retired): the entity stays, routing nothing.
            lines = [f"no site serves this model now: nothing to route (a model gone for good: terminate "
                     f"routing/{args.model})"]
        show_details(f"routing of {args.model}, v{doc.version if doc else 0}", *lines,
                     detail=f"last change: {doc.reason if doc else '-'}; {self.state.events} site events"
                     + (f"; {note}" if note else ""))
