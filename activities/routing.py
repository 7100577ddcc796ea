"""The ``Routing`` entity's activities: sample a model's sites, write its routing
document, and tell an entity about a site event. Thin and idempotent under retries.

The document is stored through the cluster port's versioned routing table
(``set_routing_weights``): in Kubernetes that is the routing ConfigMap and the
model's HTTPRoute; the dev stack's front door (``cli/front_door.py``) applies the
same table to HAProxy through its runtime API.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field
from temporalio import activity
from temporalio.common import WorkflowIDConflictPolicy

from activities.env import FleetEnv
from activities.errors import typed_errors
from fleet.messages.routing import RoutingInput, RoutingSample, RoutingSampleInput, SiteEvent
from fleet.routing import RoutingDocument, SiteLoad, routing_workflow_id

#: Round trip assumed to a site in the callers' geography, and to one elsewhere, until
#: measured latencies feed the sample: enough for ``nearest`` to keep traffic at home.
NEAR_MS, FAR_MS = 10.0, 100.0


class SiteEventInput(BaseModel):
    event: SiteEvent
    #: The models to tell; empty: every model served at the site.
    models: list[str] = Field(default_factory=list, max_length=10_000)


class RoutingActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env

    def all(self) -> list:
        return [self.routing_sample, self.write_routing, self.routing_event]

    @activity.defn
    @typed_errors
    def routing_sample(self, input: RoutingSampleInput) -> RoutingSample:
        """Each site serving the model: Ready replicas, queue depth, latency, price, and what
        an evacuation decided for the site (the fleet-wide site document)."""
        cluster = self.env.cluster
        decided = cluster.get_site_routes()
        routes = decided.sites if decided else {}
        sites = []
        for status in cluster.list_serving():
            if status.model != input.model:
                continue
            try:
                site = self.env.site(status.site)
                price = site.price_per_gpu_hour * max(1, status.gpus_per_replica)
                near = input.geography is None or site.geography == input.geography
            except Exception:  # noqa: BLE001 - a site gone from the config still serves until drained
                price, near = 0.0, False
            route = routes.get(status.site)
            sites.append(SiteLoad(
                site=status.site, ready_replicas=status.available_replicas, queue_depth=0,
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
        for model in models:
            await client.start_workflow(
                "Routing", RoutingInput(model=model).model_dump(mode="json", exclude_none=True),
                id=routing_workflow_id(model), task_queue=activity.info().task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                start_signal="site_event", start_signal_args=[input.event.model_dump(mode="json")],
                static_summary=f"routing of {model}: the one writer of its routes",
            )
        return models
