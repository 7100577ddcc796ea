"""A model's routing document as Envoy Gateway objects, for production.

- ``HTTPRoute`` (Gateway API, standard channel): ``/<model>`` to each site's Service,
  ``backendRefs`` weighted by the document (``render_httproute``, which the Kubernetes adapter
  writes too);
- ``BackendTrafficPolicy`` (``gateway.envoyproxy.io/v1alpha1``) attached to that route:
  session persistence as a consistent hash on the ``x-session-id`` header (HTTPRoute's
  own ``sessionPersistence`` is experimental-channel only and silently pruned by the
  standard CRDs), and retries only on failures before any response byte
  (``connect-failure``, ``refused-stream``: Envoy never retries once it has begun to
  send the answer downstream, so a streamed answer is never replayed).

A draining or unhealthy site keeps its backendRef at weight 0, so its Service stays
resolvable while sessions leave it. tests/realk8s/test_adapter_routing.py applies the objects
to a real API server serving both projects' published CRDs, with strict field validation.

The adapter writes them with strict field validation too: a cluster whose CRDs predate a field
gpufleet writes refuses the object (``ClusterInvalid`` naming the field and ``ROUTING_CRDS``'s
release) instead of storing it without, stickiness or retries silently gone.
"""

from __future__ import annotations

from typing import Any

from fleet.cluster import LABEL_MODEL, SERVING_PORT, SiteRoute
from fleet.routing import RoutingDocument
from providers.cluster.base import (
    ANNOTATION_MODEL,
    GATEWAY_GROUP,
    GATEWAY_VERSION,
    dns_label,
    label_value,
    serving_name,
)
from providers.haproxy import SESSION_HEADER

ENVOY_GROUP = "gateway.envoyproxy.io"
ENVOY_VERSION = "v1alpha1"
#: Per kind, the oldest releases whose published CRDs declare every field ``render_routing``
#: writes (Gateway API v1.1.0's standard HTTPRoute, Envoy Gateway v1.2.4's BackendTrafficPolicy:
#: the oldest the Go module proxy serves, read field by field; the real tier serves v1.4.1 and
#: v1.9.1). What a refused write tells the operator to install; docs/production/index.md names them.
ROUTING_CRDS = {
    "HTTPRoute": "Gateway API v1.1 or later (its standard-channel CRDs)",
    "BackendTrafficPolicy": "Envoy Gateway v1.2 or later (its CRDs)",
}
#: Retried only while no byte of the answer has left Envoy.
RETRY_BEFORE_RESPONSE = ["connect-failure", "refused-stream"]


def render_httproute_spec(model: str, sites: dict[str, SiteRoute], gateway: str, gateway_namespace: str) -> dict:
    return {
        "parentRefs": [
            {"group": GATEWAY_GROUP, "kind": "Gateway", "name": gateway, "namespace": gateway_namespace}
        ],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": f"/{dns_label(model)}"}}],
                "backendRefs": [
                    {
                        "group": "",
                        "kind": "Service",
                        "name": serving_name(model, site),
                        "port": SERVING_PORT,
                        "weight": route.weight,
                    }
                    for site, route in sorted(sites.items())
                ],
            }
        ],
    }


def render_httproute(
    model: str, sites: dict[str, SiteRoute], namespace: str, gateway: str, gateway_namespace: str
) -> dict[str, Any]:
    name = dns_label(model)
    return {
        "apiVersion": f"{GATEWAY_GROUP}/{GATEWAY_VERSION}",
        "kind": "HTTPRoute",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {LABEL_MODEL: label_value(name), "app.kubernetes.io/managed-by": "gpufleet"},
            "annotations": {ANNOTATION_MODEL: model},
        },
        "spec": render_httproute_spec(model, sites, gateway, gateway_namespace),
    }


def render_backend_traffic_policy(model: str, namespace: str, retries: int = 2) -> dict[str, Any]:
    name = dns_label(model)
    return {
        "apiVersion": f"{ENVOY_GROUP}/{ENVOY_VERSION}",
        "kind": "BackendTrafficPolicy",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "gpufleet"},
                     "annotations": {ANNOTATION_MODEL: model}},
        "spec": {
            "targetRefs": [{"group": GATEWAY_GROUP, "kind": "HTTPRoute", "name": name}],
            "loadBalancer": {"type": "ConsistentHash",
                             "consistentHash": {"type": "Header", "header": {"name": SESSION_HEADER}}},
            "retry": {"numRetries": retries, "retryOn": {"triggers": list(RETRY_BEFORE_RESPONSE)}},
        },
    }


def render_routing(document: RoutingDocument, namespace: str, gateway: str,
                   gateway_namespace: str) -> list[dict[str, Any]]:
    """The objects to apply for one model: its HTTPRoute and its BackendTrafficPolicy."""
    sites = {s: SiteRoute(weight=r.weight if r.healthy and not r.draining else 0, healthy=r.healthy,
                          draining=r.draining, incident=r.incident)
             for s, r in document.sites.items()}
    return [render_httproute(document.model, sites, namespace, gateway, gateway_namespace),
            render_backend_traffic_policy(document.model, namespace)]
