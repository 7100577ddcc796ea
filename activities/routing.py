"""The ``Routing`` entity's activities: sample a model's sites, watch them until the routes
would change, write its routing document, and tell an entity about a site event. Thin and
idempotent under retries.

The document is stored through the cluster port's versioned routing table
(``set_routing_weights``): in Kubernetes that is the routing ConfigMap and the
model's HTTPRoute; the dev stack's front door (``cli/front_door.py``) applies the
same table to HAProxy through its runtime API.
"""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from activities.env import FleetEnv
from activities.errors import typed_errors
from activities.watches import RareHeartbeat, stop_if_asked
from fleet.messages.routing import (
    RoutingInput,
    RoutingModelInput,
    RoutingProgress,
    RoutingSample,
    RoutingSampleInput,
    RoutingWatchInput,
    RoutingWatchResult,
    SiteEventInput,
    apply_override,
)
from fleet.routing import ENDPOINTS_KIND, RoutingDocument, SiteLoad, endpoints_key, next_document, site_queue_depth
from fleet.models import listing
from fleet.naming import routing_workflow_id
from providers.model_server_metrics import server_queues
from fleet.contracts import workflows as flows

#: Round trip assumed to a site in the callers' geography, and to one elsewhere, until
#: measured latencies feed the sample: enough for ``nearest`` to keep traffic at home.
NEAR_MS, FAR_MS = 10.0, 100.0


#: How often ``routing_event`` asks an entity whether the event is in its routes yet.
APPLIED_POLL_S = 0.2


class RoutingActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env

    def all(self) -> list:
        return [self.routing_model_problems, self.routing_sample, self.watch_routing, self.write_routing,
                self.routing_event]

    @activity.defn
    @typed_errors
    def routing_model_problems(self, input: RoutingModelInput) -> list[tuple[str, str]]:
        """``[("model", problem)]`` when no site serves the model (a Deployment of it, at any replica
        count: the system starts a model's entity only once one exists) and the fleet config does
        not name it (``models:``): an entity started by hand for a typo. None otherwise."""
        if input.model in self.env.config.models:
            return []
        served = {status.model for status in self.env.cluster.list_serving()}
        if input.model in served:
            return []
        return [("model", f"no site serves {input.model!r} and the fleet config does not name it (models:); "
                          f"served: {listing(served)}")]

    @activity.defn
    @typed_errors
    def routing_sample(self, input: RoutingSampleInput) -> RoutingSample:
        """Each site serving the model: Ready replicas, queue depth (``vllm:num_requests_waiting``
        of the site's published model servers, which no one of them decides: ``site_queue_depth``),
        latency, price, and what an evacuation decided for the site (the fleet-wide site document)."""
        return self._sample(input.model, input.geography)

    @activity.defn
    @typed_errors
    async def watch_routing(self, input: RoutingWatchInput) -> RoutingWatchResult:
        """Sample every ``look_seconds`` here, in the worker (no Temporal action), until the
        document the entity would decide from a sample differs from ``previous``; after
        ``max_wait_seconds`` the last sample, unchanged. Async: a model's watch holds no thread
        while it waits, only for a sample."""
        beat = RareHeartbeat()
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            stop_if_asked()
            sample = await asyncio.to_thread(self._sample, input.model, input.geography)
            sites = [apply_override(s, input.overrides.get(s.site)) for s in sample.sites]
            # The entity's own decision, hysteresis included: a wobble it would keep out of the
            # routes wakes nothing. ``previous`` itself back means no change.
            changed = next_document(input.model, sites, input.policy, input.previous, "") is not input.previous
            now = loop.time()
            if changed and now - start >= input.hold_seconds:
                return RoutingWatchResult(sample=sample, changed=True)
            left = start + input.max_wait_seconds - now
            if left <= 0:
                return RoutingWatchResult(sample=sample, changed=False)
            # Heartbeats go from this loop: each is an action, one per half the heartbeat timeout.
            await asyncio.sleep(min(input.look_seconds, left, beat.every or left))
            beat()

    def _sample(self, model: str, geography: str | None) -> RoutingSample:
        cluster = self.env.cluster
        decided = cluster.get_site_routes()
        routes = decided.sites if decided else {}
        sites = []
        for status in cluster.list_serving():
            if status.model != model:
                continue
            try:
                site = self.env.site(status.site)
                price = site.price_per_gpu_hour * max(1, status.gpus_per_replica)
                near = geography is None or site.geography == geography
            except Exception:  # noqa: BLE001 - a site gone from the config still serves until drained
                price, near = 0.0, False
            route = routes.get(status.site)
            servers = cluster.read_state(ENDPOINTS_KIND, endpoints_key(model, status.site))
            sites.append(SiteLoad(
                site=status.site, ready_replicas=status.available_replicas,
                queue_depth=site_queue_depth(server_queues(sorted(servers.values()))),
                latency_ms=NEAR_MS if near else FAR_MS, price_per_gpu_hour=price,
                healthy=route.healthy if route else True, draining=route.draining if route else False,
                cap_percent=min(100, route.weight) if route else 100,
                incident=(route.incident if route else "")[:500],
            ))
        return RoutingSample(sites=sites)

    @activity.defn
    @typed_errors
    def write_routing(self, document: RoutingDocument) -> int:
        """Store the document as the model's routing table; the table's version."""
        table = self.env.cluster.set_routing_weights(
            document.model, document.weights,
            healthy={k: v.healthy for k, v in document.sites.items()},
            draining={k: v.draining for k, v in document.sites.items()},
            incident={k: v.incident for k, v in document.sites.items()},
        )
        return table.version

    @activity.defn
    async def routing_event(self, input: SiteEventInput) -> list[str]:
        """Signal ``routing/<model>`` (started if needed) with the event; the models told."""
        models = input.models or sorted({s.model for s in await asyncio.to_thread(
            self.env.cluster.list_serving, input.event.site)})
        client = activity.client()
        handles = []
        for model in models:
            await client.start_workflow(
                flows.Routing.TYPE, RoutingInput(model=model).model_dump(mode="json", exclude_none=True),
                id=routing_workflow_id(model), task_queue=activity.info().task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                start_signal=flows.Routing.site_event, start_signal_args=[input.event.model_dump(mode="json")],
                static_summary=f"routing of {model}: the one writer of its routes",
            )
            # By id alone: the entity may continue as new while we wait on it.
            handles.append(client.get_workflow_handle(routing_workflow_id(model)))
        if input.wait_seconds:
            await asyncio.gather(*(self._applied(h, input.wait_seconds) for h in handles))
        return models

    @staticmethod
    async def _applied(handle, wait_seconds: float) -> None:
        """Until the entity's written routes reflect every event it had taken when asked first
        (a query sees every signal accepted before it, so ours is among them)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        wanted: int | None = None
        while True:
            try:
                progress = await handle.query(flows.Routing.progress, result_type=RoutingProgress)
            except RPCError:  # a just-started entity answers queries after its first task
                progress = None
            if progress is not None:
                wanted = progress.events if wanted is None else wanted
                if progress.applied >= wanted:
                    return
            if loop.time() > deadline:
                # Retryable: the entity's own sample or write is failing (the cluster), and
                # whatever waits on these routes must not go ahead without them.
                raise ApplicationError(
                    f"{handle.id} has not written routes with the event after {wait_seconds:.0f}s "
                    f"({progress.applied if progress else 0} of {wanted} events applied)", type="RoutingNotApplied")
            activity.heartbeat()
            await asyncio.sleep(APPLIED_POLL_S)
