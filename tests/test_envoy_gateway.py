"""The production rendering of a routing document: weights, stickiness and retries. That the
objects pass the published CRDs (Gateway API's HTTPRoute, Envoy Gateway's BackendTrafficPolicy)
is checked on a real API server serving them, with strict field validation
(tests/realk8s/test_adapter_routing.py), not against a copy of their schemas here."""

from __future__ import annotations

from fleet.routing import RoutingDocument, SiteRouteState
from providers.cluster.base import serving_name
from providers.cluster.envoy_gateway import render_routing


def routing_document() -> RoutingDocument:
    """A model on three sites, one draining (weight 0, its Service still a backend)."""
    return RoutingDocument(model="meta-llama/Llama-3.1-8B", version=3, sites={
        "aws-use1": SiteRouteState(weight=700), "hetzner-fsn1": SiteRouteState(weight=300),
        "lambda-east": SiteRouteState(weight=0, draining=True, incident="evacuating")})


def test_weights_stickiness_and_retry_before_response():
    route, policy = render_routing(routing_document(), "gpufleet", "gpufleet", "gpufleet")
    refs = {r["name"]: r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]}
    model = "meta-llama/Llama-3.1-8B"
    assert refs == {serving_name(model, "aws-use1"): 700, serving_name(model, "hetzner-fsn1"): 300,
                    serving_name(model, "lambda-east"): 0}
    assert policy["spec"]["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute",
                                             "name": route["metadata"]["name"]}]
    assert policy["spec"]["loadBalancer"]["consistentHash"] == {"type": "Header", "header": {"name": "x-session-id"}}
    # Nothing that can fire after the answer began (5xx, reset) is a retry trigger.
    assert set(policy["spec"]["retry"]["retryOn"]["triggers"]) <= {"connect-failure", "refused-stream"}
