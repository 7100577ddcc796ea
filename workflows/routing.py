"""Routing (entity, id ``routing/<model>``): the one writer of a model's routes.

Recomputes the model's per-site weights (``fleet.routing``) when a site event
arrives (``site_event``: incident, drain, restore, rollout, scale) and on a
periodic load sample, and writes the result as one versioned routing document
through ``write_routing``; the front doors render that document (an Envoy
Gateway HTTPRoute with its policies in production, HAProxy through its runtime
API in the dev stack).

A sample (``routing_sample``) reads each site's Ready replicas, queue depth,
latency to the callers' geography and price, plus what an evacuation decided for
the site (the fleet-wide site document: draining, incident, weight ceiling), so
an evacuation and its restore move traffic through this entity. Events only add
to that: an event's override holds until a later event (``restore``) lifts it.

Continues as new when the server suggests it, carrying ``RoutingState`` (overrides,
the last document, pending reasons), once every handler has finished.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from fleet.messages.routing import (
        RoutingInput,
        RoutingProgress,
        RoutingSample,
        RoutingSampleInput,
        RoutingState,
        SiteEvent,
        SiteOverride,
    )
    from fleet.routing import RoutingDocument, SiteLoad, next_document
    from workflows.inputs import parse_input, parse_signal
    from workflows.steps import CLUSTER_RETRY, QUICK, show_details


def _apply(load: SiteLoad, override: SiteOverride | None) -> SiteLoad:
    if override is None:
        return load
    return load.model_copy(update={
        "healthy": load.healthy and override.healthy,
        "draining": load.draining or override.draining,
        "cap_percent": min(load.cap_percent, override.cap_percent),
        "incident": override.incident or load.incident,
    })


@workflow.defn(name="Routing")
class RoutingEntity:
    def __init__(self) -> None:
        self.state = RoutingState()

    @workflow.signal
    def site_event(self, raw: dict[str, Any]) -> None:
        event = parse_signal(SiteEvent, raw, "site_event")
        if event is None:
            return
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
        self.state.pending.append(f"{event.kind} at {event.site}" + (f": {event.detail}" if event.detail else ""))

    @workflow.query
    def document(self) -> RoutingDocument | None:
        return self.state.document

    @workflow.query
    def progress(self) -> RoutingProgress:
        doc = self.state.document
        return RoutingProgress(events=self.state.events, applied=self.state.applied, version=doc.version if doc else 0)

    @workflow.run
    async def run(self, raw: Any) -> None:
        args = parse_input(RoutingInput, raw)
        self.state = args.state or RoutingState()
        reason = "start"
        while True:
            await self._recompute(args, reason)
            try:
                await workflow.wait_condition(
                    lambda: bool(self.state.pending) or workflow.info().is_continue_as_new_suggested(),
                    timeout=timedelta(seconds=args.sample_seconds), timeout_summary="next load sample",
                )
                reason = "; ".join(self.state.pending[-5:])
            except asyncio.TimeoutError:
                reason = "load sample"
            self.state.pending = []
            if workflow.info().is_continue_as_new_suggested():
                await workflow.wait_condition(workflow.all_handlers_finished)
                # An event taken meanwhile is pending in the carried state: the next run recomputes first.
                workflow.continue_as_new(args.model_copy(update={"state": self.state}).model_dump(mode="json"))

    async def _recompute(self, args: RoutingInput, reason: str) -> None:
        # Events taken before the sample are in this recompute; later ones wait for the next.
        taken = self.state.events
        sample: RoutingSample = await workflow.execute_activity(
            "routing_sample", RoutingSampleInput(model=args.model, geography=args.geography),
            result_type=RoutingSample, start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary=f"Ready replicas, load, latency and price of {args.model}'s sites",
        )
        sites = [_apply(s, self.state.overrides.get(s.site)) for s in sample.sites]
        previous = self.state.document
        document = next_document(args.model, sites, args.policy, previous, reason)
        if document is not previous:
            await workflow.execute_activity(
                "write_routing", document, start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                summary=f"routing v{document.version} of {args.model}: {reason}"[:200],
            )
            self.state.document = document
        self.state.applied = taken
        doc = self.state.document
        lines = [f"{site}: weight {r.weight}/1000, {r.ready_replicas} ready"
                 + (" (draining)" if r.draining else "") + ("" if r.healthy else " (unhealthy)")
                 for site, r in sorted(doc.sites.items())] if doc else ["no sites serve this model yet"]
        show_details(f"routing of {args.model}, v{doc.version if doc else 0}", *lines,
                     detail=f"last change: {doc.reason if doc else '-'}; {self.state.events} site events")
