"""What only the Kubernetes adapter has, that the fake API server used to stand in for because the
real tier lacked a piece (issue 33): its routing objects (Gateway API's ``HTTPRoute`` and Envoy
Gateway's ``BackendTrafficPolicy``, served here from their published CRDs), a drain that waits
for a graceful termination, and a Deployment's rollout status from the real controllers.
The adapter runs as the control plane's service account under the shipped RBAC, in a namespace
of the test's own (``tests/realk8s/contract.py``'s ``RealHarness``, whose stand-in kubelet starts
the pods bound to its Nodes and ends those deleted, after the seconds a pod asks for).

Moved from tests/cluster/test_kubernetes_adapter.py, where only a hung server stays on the fake.
"""

from __future__ import annotations

import copy
import json
import time

import pytest
from pydantic import ValidationError

from fleet.cluster import ServingSpec
from fleet.config import ServingPolicy
from fleet.errors import ClusterInvalid
from fleet.rollout import RolloutInput
from providers.cluster import envoy_gateway
from providers.cluster.envoy_gateway import render_routing
from providers.cluster.kubernetes import ROUTING_CONFIGMAP, routing, serving
from providers.cluster.kubernetes.api import _is_subset
from tests.realk8s.cluster import ClusterFailed
from tests.realk8s.contract import RealHarness
from tests.realk8s.test_adapter import record_requests
from tests.realk8s.test_monitoring import apply_strictly
from tests.test_envoy_gateway import routing_document

GW = "gateway.networking.k8s.io"
ENVOY = "gateway.envoyproxy.io"


def _writes(seen, fragment: str) -> list[str]:
    return [method for method, path, _ in seen if fragment in path and method in ("POST", "PUT", "PATCH", "DELETE")]


def _get(harness: RealHarness, path: str) -> dict:
    status, answer = harness.real.request("GET", path, admin=True)
    assert status == 200, answer
    return answer


def _route(harness: RealHarness, name: str) -> dict:
    return _get(harness, f"/apis/{GW}/v1/namespaces/{harness.namespace}/httproutes/{name}")


def _policy(harness: RealHarness, name: str) -> dict:
    return _get(harness, f"/apis/{ENVOY}/v1alpha1/namespaces/{harness.namespace}/backendtrafficpolicies/{name}")


def _table(harness: RealHarness) -> dict:
    return _get(harness, f"/api/v1/namespaces/{harness.namespace}/configmaps/{ROUTING_CONFIGMAP}")


# -- drain ------------------------------------------------------------------------------------
def test_drain_waits_for_evicted_pods_to_terminate(harness: RealHarness):
    harness.add_node("gpu-1")
    harness.add_pod("gpu-1", "slow-1", terminating_seconds=0.5)
    result = harness.cluster.drain_node("gpu-1", deadline_s=10)
    # Done once the evicted pod is gone (it lists while it terminates), not at its eviction.
    assert result.completed and harness.pods("gpu-1") == [], result
    harness.add_pod("gpu-1", "slower-1", terminating_seconds=30)
    result = harness.cluster.drain_node("gpu-1", deadline_s=0.5)
    assert not result.completed
    assert [(p.key, p.reason) for p in result.blocked] == [("default/slower-1", "evicted but still terminating")]


# -- serving ----------------------------------------------------------------------------------
def test_serving_ready_waits_for_the_controller(harness: RealHarness):
    harness.add_node("gpu-1", site="site-a")
    spec = ServingSpec(model="m", site="site-a", image="img:1", replicas=1)
    with harness.pods_held():  # no replica can have started when apply_serving answers
        status = harness.cluster.apply_serving(spec)
    assert not status.ready and status.available_replicas == 0, "no replica has started yet"

    def ready(generation: int):
        deadline = time.monotonic() + 30
        while not ((now := harness.cluster.serving_status("m", "site-a")).ready and now.observed_generation == generation):
            assert time.monotonic() < deadline, now
            time.sleep(0.1)
        return now

    assert ready(1).available_replicas == 1
    with harness.pods_held():
        status = harness.cluster.apply_serving(spec.model_copy(update={"image": "img:2"}))
    assert not status.ready and status.generation == 2
    status = ready(2)
    assert status.image == "img:2" and status.updated_replicas == status.available_replicas == 1


# -- routing ----------------------------------------------------------------------------------
def test_routing_update_is_one_write_per_object_and_repeats_write_nothing(harness: RealHarness):
    seen = record_requests(harness.cluster)
    harness.cluster.set_routing_weights("llama-3-8b", {"site-a": 80, "site-b": 20})
    assert _writes(seen, "/configmaps") == ["POST"] and _writes(seen, "/httproutes") == ["POST"]
    route = _route(harness, "llama-3-8b")
    refs = route["spec"]["rules"][0]["backendRefs"]
    assert [(r["name"], r["weight"], r["port"]) for r in refs] == [
        ("llama-3-8b-site-a", 80, 8000), ("llama-3-8b-site-b", 20, 8000)]
    assert route["spec"]["parentRefs"][0]["name"] == "gpufleet"
    versions = (_table(harness)["metadata"]["resourceVersion"], route["metadata"]["resourceVersion"])

    harness.cluster.set_routing_weights("llama-3-8b", {"site-a": 80, "site-b": 20})
    assert len(_writes(seen, "/configmaps")) == 1 and len(_writes(seen, "/httproutes")) == 1
    assert (_table(harness)["metadata"]["resourceVersion"],
            _route(harness, "llama-3-8b")["metadata"]["resourceVersion"]) == versions

    harness.cluster.set_routing_weights("llama-3-8b", {"site-a": 50, "site-b": 50})
    assert _writes(seen, "/configmaps") == ["POST", "PUT"] and _writes(seen, "/httproutes") == ["POST", "PUT"]
    entry = json.loads(_table(harness)["data"]["llama-3-8b"])
    assert entry["version"] == 2
    assert entry["sites"]["site-a"] == {"weight": 50, "healthy": True, "draining": False, "incident": ""}
    route = _route(harness, "llama-3-8b")
    assert [r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]] == [50, 50]
    assert route["metadata"]["generation"] == 2


def test_a_route_reaches_16_sites_and_gpufleet_refuses_a_17th_before_the_api_server_does(harness: RealHarness):
    """Gateway API's published HTTPRoute CRD allows 16 backendRefs in a rule: the real API server
    takes a model's route to 16 sites and refuses one to 17 (and the routes stay as they were, the
    weights frozen). A serving policy or a rollout that would give a model a 17th site is refused
    first: at config load, at the rollout's start."""
    sites = [f"site-{i:02d}" for i in range(17)]
    harness.cluster.set_routing_weights("llama-3-8b", {site: 1 for site in sites[:16]})
    assert len(_route(harness, "llama-3-8b")["spec"]["rules"][0]["backendRefs"]) == 16
    with pytest.raises(ClusterInvalid, match="backendRefs") as caught:
        harness.cluster.set_routing_weights("llama-3-8b", {site: 1 for site in sites})
    assert caught.value.code == "422" and not caught.value.retryable
    assert len(_route(harness, "llama-3-8b")["spec"]["rules"][0]["backendRefs"]) == 16

    with pytest.raises(ValidationError, match="17 sites; a model is routed to at most 16"):
        ServingPolicy(mode="burst", sites=sites[:9], standby_sites=sites[9:])
    with pytest.raises(ValidationError, match="17 target sites; a model is routed to at most 16"):
        RolloutInput.model_validate({
            "model": "llama-3-8b", "version": "v2", "image": "img:2",
            "weights": {"source": {"store": "src"}, "files": [{"path": "w", "size": 1, "sha256": "a" * 64}]},
            "sites": [{"site": site, "replicas": 1} for site in sites]})


def test_routing_applies_the_envoy_gateway_policy_with_the_route(harness: RealHarness):
    """Stickiness and retry-before-response live in Envoy Gateway's BackendTrafficPolicy,
    attached to the model's HTTPRoute, written with it; repeats write nothing; drift is undone."""
    seen = record_requests(harness.cluster)
    harness.cluster.set_routing_weights("llama-3-8b", {"site-a": 80, "site-b": 20})
    policy = _policy(harness, "llama-3-8b")
    assert policy["spec"]["targetRefs"] == [{"group": GW, "kind": "HTTPRoute", "name": "llama-3-8b"}]
    hashed = policy["spec"]["loadBalancer"]["consistentHash"]  # with the CRD's default tableSize
    assert (hashed["type"], hashed["header"]) == ("Header", {"name": "x-session-id"})
    assert policy["spec"]["retry"]["retryOn"]["triggers"] == ["connect-failure", "refused-stream"]
    harness.cluster.set_routing_weights("llama-3-8b", {"site-a": 50, "site-b": 50})
    assert _writes(seen, "/backendtrafficpolicies") == ["POST"], "the policy does not change with the weights"

    # Someone edits the policy to retry on 5xx (which would replay a streamed answer).
    status, answer = harness.real.request(
        "PATCH", f"/apis/{ENVOY}/v1alpha1/namespaces/{harness.namespace}/backendtrafficpolicies/llama-3-8b",
        {"spec": {"retry": {"retryOn": {"triggers": ["5xx"]}}}}, admin=True,
        content_type="application/merge-patch+json")
    assert status == 200, answer
    harness.cluster.set_routing_weights("llama-3-8b", {"site-a": 40, "site-b": 60})
    assert _writes(seen, "/backendtrafficpolicies") == ["POST", "PUT"]
    assert _policy(harness, "llama-3-8b")["spec"]["retry"]["retryOn"]["triggers"] == ["connect-failure",
                                                                                       "refused-stream"]


def _misspelled_retries(spec: dict) -> None:
    spec["retry"]["numRetry"] = spec["retry"].pop("numRetries")


def _unknown_trigger(spec: dict) -> None:
    spec["retry"]["retryOn"]["triggers"] = ["connect_failure"]


def _hash_without_its_header(spec: dict) -> None:
    del spec["loadBalancer"]["consistentHash"]["header"]


def test_the_routing_objects_pass_the_published_crds_strictly(harness: RealHarness):
    """What gpufleet writes for a model (``render_routing``: the HTTPRoute and the
    BackendTrafficPolicy the adapter writes) passes Gateway API's and Envoy Gateway's published
    CRDs under strict field validation, as ``kubectl apply --validate=strict`` asks: a field the
    CRD does not know is refused here, where a plain create or update would store the object
    without it (stickiness or retries silently gone, and the adapter rewriting it on every
    call). The server is the judge: a misspelled field, a trigger Envoy Gateway does not know,
    and a consistent hash on a header without its header (a CEL rule) are each refused."""
    route, policy = render_routing(routing_document(), harness.namespace, "gpufleet", "gpufleet")
    stored = apply_strictly(harness.real, "-f", "-", manifest=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": [route, policy]}))
    assert [(o["kind"], o["metadata"]["name"]) for o in stored] == [
        ("HTTPRoute", route["metadata"]["name"]), ("BackendTrafficPolicy", policy["metadata"]["name"])]
    for sent, kept in zip((route, policy), stored):
        assert _is_subset(sent["spec"], kept["spec"]), "the adapter's repeat check would rewrite it forever"

    for mutate, refusal in ((_misspelled_retries, 'unknown field "numRetry"|numRetry: field not declared in schema'),
                            (_unknown_trigger, 'Unsupported value: "connect_failure"'),
                            (_hash_without_its_header, "If consistent hash type is header, the header field")):
        wrong = copy.deepcopy(policy)
        mutate(wrong["spec"])
        with pytest.raises(ClusterFailed, match=refusal):
            apply_strictly(harness.real, "-f", "-", manifest=json.dumps(wrong))


def _session_persistence_on_the_route(monkeypatch) -> None:
    """Gateway API's rule-level ``sessionPersistence``: a real HTTPRoute field, of the experimental
    channel only, so the standard-channel CRD the tier serves (v1.4.1) has no such field."""
    rendered = envoy_gateway.render_httproute_spec

    def with_it(*args):
        spec = rendered(*args)
        spec["rules"][0]["sessionPersistence"] = {"type": "Header", "sessionName": "x-session-id"}
        return spec

    monkeypatch.setattr(envoy_gateway, "render_httproute_spec", with_it)  # the create's
    monkeypatch.setattr(routing, "render_httproute_spec", with_it)  # the update's


def _a_field_envoy_gateway_lacks_on_the_policy(monkeypatch) -> None:
    """A test-only field: every Envoy Gateway release the Go module proxy serves (v1.2.4 on)
    declares each field gpufleet writes, so an older CRD cannot be installed to lack one."""
    rendered = routing.render_backend_traffic_policy

    def with_it(*args):
        body = rendered(*args)
        body["spec"]["loadBalancer"]["consistentHash"]["testOnlyField"] = "x"
        return body

    monkeypatch.setattr(routing, "render_backend_traffic_policy", with_it)


@pytest.mark.parametrize("kind, inject, field, needs", [
    ("HTTPRoute", _session_persistence_on_the_route, "spec.rules[0].sessionPersistence",
     "Gateway API v1.1 or later"),
    ("BackendTrafficPolicy", _a_field_envoy_gateway_lacks_on_the_policy,
     "spec.loadBalancer.consistentHash.testOnlyField", "Envoy Gateway v1.2 or later"),
], ids=["HTTPRoute", "BackendTrafficPolicy"])
def test_a_routing_field_the_clusters_crd_lacks_is_refused_by_name_not_dropped(
        harness: RealHarness, monkeypatch, kind, inject, field, needs):
    """gpufleet writes a field the cluster's CRD does not declare (as on a cluster whose Gateway
    API or Envoy Gateway is older than gpufleet's): the update and the create are refused, naming
    the kind, the field and the release to install, and nothing stored changes. Without strict
    field validation the API server stores each object without the field (a warning header the
    only sign): stickiness or retries silently gone, and the object rewritten on every call."""
    read = {"HTTPRoute": _route, "BackendTrafficPolicy": _policy}[kind]
    collection = {"HTTPRoute": f"/apis/{GW}/v1/namespaces/{harness.namespace}/httproutes",
                  "BackendTrafficPolicy": f"/apis/{ENVOY}/v1alpha1/namespaces/{harness.namespace}/"
                                          "backendtrafficpolicies"}[kind]
    harness.cluster.set_routing_weights("llama-3-8b", {"site-a": 80, "site-b": 20})
    stored = read(harness, "llama-3-8b")
    inject(monkeypatch)
    seen = record_requests(harness.cluster)

    for model in ("llama-3-8b", "mistral-7b"):  # the update of a stored object, then a create
        with pytest.raises(ClusterInvalid) as caught:
            harness.cluster.set_routing_weights(model, {"site-a": 80, "site-b": 20})
        assert not caught.value.retryable and caught.value.code == "400"
        assert f"refused, nothing written: this cluster's {kind} schema lacks {field}, which gpufleet writes" \
            in str(caught.value)
        assert needs in str(caught.value)
    assert read(harness, "llama-3-8b") == stored, "the refused update changed nothing"
    assert harness.real.request("GET", f"{collection}/mistral-7b", admin=True)[0] == 404, "the refused create"
    writes = [(method, query) for method, _, query in seen if method in ("POST", "PUT", "PATCH")]
    assert writes and all("fieldValidation=Strict" in query for _, query in writes), writes


def test_serving_objects_are_written_with_strict_field_validation(harness: RealHarness, monkeypatch):
    """The built-in kinds too: a field the cluster's Kubernetes does not declare (a field newer
    than the cluster, or a typo) in the Service gpufleet writes is refused by name, in its create
    and in its patch, not dropped."""
    spec = ServingSpec(model="m", site="site-a", image="img:1", replicas=1)
    harness.cluster.apply_serving(spec)
    rendered = serving.render_service

    def with_a_field_kubernetes_lacks(*args):
        body = rendered(*args)
        body["spec"]["testOnlyField"] = "x"
        return body

    monkeypatch.setattr(serving, "render_service", with_a_field_kubernetes_lacks)
    for site, code, kind in (("site-a", "422", "object"), ("site-b", "400", "Service")):  # a patch, a create
        with pytest.raises(ClusterInvalid) as caught:
            harness.cluster.apply_serving(spec.model_copy(update={"site": site}))
        assert not caught.value.retryable and caught.value.code == code
        assert f"this cluster's {kind} schema lacks spec.testOnlyField, which gpufleet writes" in str(caught.value)
        assert "Kubernetes 1.31 or later" in str(caught.value)
    status, _ = harness.real.request("GET", f"/api/v1/namespaces/{harness.namespace}/services/m-site-b",
                                     admin=True)
    assert status == 404


def test_routing_table_write_retries_on_conflict(harness: RealHarness):
    """Another writer changes the routing table between the adapter's read and its write: the
    real API server refuses the stale write (409), the adapter reads again and keeps both."""
    harness.cluster.set_routing_weights("a", {"site-a": 1})
    seen = record_requests(harness.cluster)
    rest = harness.cluster.api_client.rest_client
    sent = rest.request
    raced: list[int] = []

    def other_model_written_first(method, url, *args, **kwargs):
        if method == "PUT" and url.endswith(f"/configmaps/{ROUTING_CONFIGMAP}") and not raced:
            raced.append(1)
            status, answer = harness.real.request(
                "PATCH", f"/api/v1/namespaces/{harness.namespace}/configmaps/{ROUTING_CONFIGMAP}",
                {"data": {"b": json.dumps({"model": "b", "version": 7, "sites": {}})}}, admin=True,
                content_type="application/merge-patch+json")
            assert status == 200, answer
        return sent(method, url, *args, **kwargs)

    rest.request = other_model_written_first
    assert harness.cluster.set_routing_weights("a", {"site-a": 2}).version == 2
    data = _table(harness)["data"]
    assert json.loads(data["b"])["version"] == 7 and json.loads(data["a"])["version"] == 2
    assert _writes(seen, "/configmaps") == ["PUT", "PUT"], "the first, stale, refused with 409; then again"
