"""The production rendering of a routing document, checked against trimmed copies of
the CRD schemas it must satisfy: Gateway API v1 ``HTTPRoute`` (standard channel: no
``sessionPersistence``) and Envoy Gateway v1.x ``BackendTrafficPolicy``. Only the fields
we use are kept; ``additionalProperties: false`` stands for the API server's pruning,
so a field the CRD does not know fails here instead of vanishing silently there."""

from __future__ import annotations

import jsonschema

from fleet.routing import RoutingDocument, SiteRouteState
from providers.cluster.base import serving_name
from providers.cluster.envoy_gateway import render_routing

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
HTTPROUTE_SPEC = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "parentRefs": {"type": "array", "maxItems": 32, "items": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME,
                           "namespace": _NAME, "sectionName": _NAME}}},
        "rules": {"type": "array", "maxItems": 16, "items": {
            "type": "object", "additionalProperties": False,  # standard channel: no sessionPersistence
            "properties": {
                "matches": {"type": "array", "maxItems": 64, "items": {
                    "type": "object", "additionalProperties": False, "properties": {"path": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                            "value": {"type": "string", "maxLength": 1024, "pattern": "^/"}}}}}},
                "backendRefs": {"type": "array", "maxItems": 16, "items": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME,
                                   "namespace": _NAME, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                   "weight": {"type": "integer", "minimum": 0, "maximum": 1000000}}}}}}},
    },
}
RETRY_TRIGGERS = ["5xx", "gateway-error", "reset", "connect-failure", "retriable-4xx", "refused-stream",
                  "retriable-status-codes", "cancelled", "deadline-exceeded", "internal", "resource-exhausted",
                  "unavailable"]
BACKEND_TRAFFIC_POLICY_SPEC = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "targetRefs": {"type": "array", "items": {
            "type": "object", "required": ["group", "kind", "name"], "additionalProperties": False,
            "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME,
                           "sectionName": _NAME}}},
        "loadBalancer": {
            "type": "object", "required": ["type"], "additionalProperties": False,
            "properties": {
                "type": {"enum": ["ConsistentHash", "LeastRequest", "Random", "RoundRobin"]},
                "consistentHash": {"type": "object", "required": ["type"], "additionalProperties": False,
                                   "properties": {"type": {"enum": ["SourceIP", "Header", "Cookie"]},
                                                  "header": {"type": "object", "required": ["name"],
                                                             "additionalProperties": False,
                                                             "properties": {"name": {"type": "string"}}}}}}},
        "retry": {"type": "object", "additionalProperties": False, "properties": {
            "numRetries": {"type": "integer", "minimum": 0},
            "retryOn": {"type": "object", "additionalProperties": False, "properties": {
                "triggers": {"type": "array", "items": {"enum": RETRY_TRIGGERS}},
                "httpStatusCodes": {"type": "array", "items": {"type": "integer"}}}}}},
    },
}


def _doc() -> RoutingDocument:
    return RoutingDocument(model="meta-llama/Llama-3.1-8B", version=3, sites={
        "aws-use1": SiteRouteState(weight=700), "hetzner-fsn1": SiteRouteState(weight=300),
        "lambda-east": SiteRouteState(weight=0, draining=True, incident="evacuating")})


def test_the_rendered_objects_satisfy_the_crd_schemas():
    route, policy = render_routing(_doc(), "gpufleet", "gpufleet", "gpufleet")
    assert (route["apiVersion"], route["kind"]) == ("gateway.networking.k8s.io/v1", "HTTPRoute")
    assert (policy["apiVersion"], policy["kind"]) == ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy")
    jsonschema.validate(route["spec"], HTTPROUTE_SPEC)
    jsonschema.validate(policy["spec"], BACKEND_TRAFFIC_POLICY_SPEC)


def test_weights_stickiness_and_retry_before_response():
    route, policy = render_routing(_doc(), "gpufleet", "gpufleet", "gpufleet")
    refs = {r["name"]: r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]}
    model = "meta-llama/Llama-3.1-8B"
    assert refs == {serving_name(model, "aws-use1"): 700, serving_name(model, "hetzner-fsn1"): 300,
                    serving_name(model, "lambda-east"): 0}
    assert policy["spec"]["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute",
                                             "name": route["metadata"]["name"]}]
    assert policy["spec"]["loadBalancer"]["consistentHash"] == {"type": "Header", "header": {"name": "x-session-id"}}
    # Nothing that can fire after the answer began (5xx, reset) is a retry trigger.
    assert set(policy["spec"]["retry"]["retryOn"]["triggers"]) <= {"connect-failure", "refused-stream"}
