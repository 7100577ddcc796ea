"""What only the Kubernetes adapter has, where the real tier cannot show it yet; the rest (join-token
Secrets, node patches and their write counts, resourceVersion preconditions, drains through the
Eviction API, serving objects, a real 403) runs against the real API server:
``tests/realk8s/test_adapter_objects.py``.

Left on the fake API server, each saying why at the test: a pod that takes time to terminate
(no kubelet ends a graceful termination on the real tier's kubelet-less Nodes), a Deployment's
rollout status (no kubelet runs its pods there), the routing objects (the Gateway API's and
Envoy Gateway's CRDs are not installed there), a hung server (a fault a real one is not made
to show).
"""

from __future__ import annotations

import json
import time

import pytest

from fleet.errors import Transient
from fleet.cluster import LABEL_SITE, ServingSpec
from providers.cluster.kubernetes import ROUTING_CONFIGMAP, KubernetesCluster, _machine_from_provider_id
from tests.ports import free_port

GW = "gateway.networking.k8s.io"


def _writes(fake, fragment: str) -> list[str]:
    return [method for method, path in fake.writes if fragment in path]


# -- nodes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("provider_id, machine", [
    ("aws:///us-east-1a/i-0abc123", "i-0abc123"),
    ("hcloud://4711", "4711"),
    ("gce://proj/europe-west4-a/gpu-node-1", "gpu-node-1"),
    ("", ""),
])
def test_machine_id_from_provider_id(provider_id, machine):
    assert _machine_from_provider_id(provider_id) == machine


# -- drain ------------------------------------------------------------------------------------
def test_drain_waits_for_evicted_pods_to_terminate(kube, fake):
    # Fake: a graceful termination that ends after 0.5 s needs a kubelet to end it; the real tier's
    # Nodes here have none (its kubelet-backed drains: tests/realk8s/test_fleet.py).
    fake.add_node("gpu-1")
    fake.add_pod("gpu-1", "slow-1", terminating_seconds=0.5)
    result = kube.drain_node("gpu-1", deadline_s=5)
    assert result.completed and result.elapsed_s >= 0.4
    fake.add_pod("gpu-1", "slower-1", terminating_seconds=30)
    result = kube.drain_node("gpu-1", deadline_s=0.5)
    assert not result.completed
    assert [(p.key, p.reason) for p in result.blocked] == [("default/slower-1", "evicted but still terminating")]


# -- serving ----------------------------------------------------------------------------------
def test_serving_ready_waits_for_the_controller(kube, fake):
    # Fake: the Deployment's status is the fake's controller's; on the real tier a rollout is only
    # ready once kubelets run its pods, which no kubelet-less Node here does.
    fake.add_node("gpu-1", {LABEL_SITE: "site-a"})
    fake.rollout_delay_s = 0.4
    spec = ServingSpec(model="m", site="site-a", image="img:1", replicas=1)
    status = kube.apply_serving(spec)
    assert not status.ready and status.observed_generation < status.generation
    time.sleep(0.45)
    assert kube.serving_status("m", "site-a").ready
    status = kube.apply_serving(spec.model_copy(update={"image": "img:2"}))
    assert not status.ready and status.generation == 2
    time.sleep(0.45)
    status = kube.serving_status("m", "site-a")
    assert status.ready and status.observed_generation == 2


# -- routing ----------------------------------------------------------------------------------
# Fake: HTTPRoute (Gateway API) and BackendTrafficPolicy (Envoy Gateway) are CRDs the real tier
# does not install; the routing table's ConfigMap alone would not show the adapter's writes.
def test_routing_update_is_one_write_per_object_and_repeats_write_nothing(kube, fake):
    kube.set_routing_weights("llama-3-8b", {"site-a": 80, "site-b": 20})
    assert _writes(fake, "/configmaps") == ["POST"] and _writes(fake, "/httproutes") == ["POST"]
    route = fake.get(GW, "httproutes", "gpufleet", "llama-3-8b")
    refs = route["spec"]["rules"][0]["backendRefs"]
    assert [(r["name"], r["weight"], r["port"]) for r in refs] == [
        ("llama-3-8b-site-a", 80, 8000), ("llama-3-8b-site-b", 20, 8000)]
    assert route["spec"]["parentRefs"][0]["name"] == "gpufleet"
    configmap = fake.get("", "configmaps", "gpufleet", ROUTING_CONFIGMAP)
    versions = (configmap["metadata"]["resourceVersion"], route["metadata"]["resourceVersion"])

    kube.set_routing_weights("llama-3-8b", {"site-a": 80, "site-b": 20})
    assert len(_writes(fake, "/configmaps")) == 1 and len(_writes(fake, "/httproutes")) == 1
    configmap = fake.get("", "configmaps", "gpufleet", ROUTING_CONFIGMAP)
    route = fake.get(GW, "httproutes", "gpufleet", "llama-3-8b")
    assert (configmap["metadata"]["resourceVersion"], route["metadata"]["resourceVersion"]) == versions

    kube.set_routing_weights("llama-3-8b", {"site-a": 50, "site-b": 50})
    assert _writes(fake, "/configmaps") == ["POST", "PUT"] and _writes(fake, "/httproutes") == ["POST", "PUT"]
    configmap = fake.get("", "configmaps", "gpufleet", ROUTING_CONFIGMAP)
    entry = json.loads(configmap["data"]["llama-3-8b"])
    assert entry["version"] == 2
    assert entry["sites"]["site-a"] == {"weight": 50, "healthy": True, "draining": False, "incident": ""}
    route = fake.get(GW, "httproutes", "gpufleet", "llama-3-8b")
    assert [r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]] == [50, 50]
    assert route["metadata"]["generation"] == 2


def test_routing_applies_the_envoy_gateway_policy_with_the_route(kube, fake):
    """Stickiness and retry-before-response live in Envoy Gateway's BackendTrafficPolicy,
    attached to the model's HTTPRoute, written with it; repeats write nothing; drift is undone."""
    envoy = "gateway.envoyproxy.io"
    kube.set_routing_weights("llama-3-8b", {"site-a": 80, "site-b": 20})
    policy = fake.get(envoy, "backendtrafficpolicies", "gpufleet", "llama-3-8b")
    assert policy["spec"]["targetRefs"] == [{"group": GW, "kind": "HTTPRoute", "name": "llama-3-8b"}]
    assert policy["spec"]["loadBalancer"]["consistentHash"] == {"type": "Header", "header": {"name": "x-session-id"}}
    assert policy["spec"]["retry"]["retryOn"]["triggers"] == ["connect-failure", "refused-stream"]
    kube.set_routing_weights("llama-3-8b", {"site-a": 50, "site-b": 50})
    assert _writes(fake, "/backendtrafficpolicies") == ["POST"], "the policy does not change with the weights"

    edited = fake.get(envoy, "backendtrafficpolicies", "gpufleet", "llama-3-8b")
    edited["spec"]["retry"]["retryOn"]["triggers"] = ["5xx"]  # would replay a streamed answer
    fake.store[(envoy, "backendtrafficpolicies", "gpufleet", "llama-3-8b")]["spec"] = edited["spec"]
    kube.set_routing_weights("llama-3-8b", {"site-a": 40, "site-b": 60})
    assert _writes(fake, "/backendtrafficpolicies") == ["POST", "PUT"]
    policy = fake.get(envoy, "backendtrafficpolicies", "gpufleet", "llama-3-8b")
    assert policy["spec"]["retry"]["retryOn"]["triggers"] == ["connect-failure", "refused-stream"]


def test_routing_table_write_retries_on_conflict(kube, fake):
    kube.set_routing_weights("a", {"site-a": 1})
    original = fake._update
    raced = []

    def other_model_written_first(group, resource, namespace, name, body):
        if resource == "configmaps" and not raced:
            raced.append(1)
            stored = fake.store[("", "configmaps", namespace, name)]
            stored["data"]["b"] = json.dumps({"model": "b", "version": 7, "sites": {}})
            stored["metadata"]["resourceVersion"] = fake._next_rv()
        return original(group, resource, namespace, name, body)

    fake._update = other_model_written_first
    assert kube.set_routing_weights("a", {"site-a": 2}).version == 2
    data = fake.get("", "configmaps", "gpufleet", ROUTING_CONFIGMAP)["data"]
    assert json.loads(data["b"])["version"] == 7 and json.loads(data["a"])["version"] == 2
    assert _writes(fake, "/configmaps") == ["POST", "PUT", "PUT"]


# -- errors -----------------------------------------------------------------------------------
def test_unreachable_api_is_transient():
    """A loopback port nothing listens on: the connection is refused (no server needed)."""
    from kubernetes import client as k8s

    configuration = k8s.Configuration()
    configuration.host = f"http://127.0.0.1:{free_port()}"
    configuration.retries = 0
    cluster = KubernetesCluster(api_client=k8s.ApiClient(configuration))
    with pytest.raises(Transient):
        cluster.get_node("gpu-1")


def test_a_hung_api_server_times_out_as_transient(fake):
    # Fake: a server that accepts and then answers nothing for a second is a fault a real API
    # server is not made to show.
    cluster = KubernetesCluster(api_client=fake.api_client(), request_timeout_s=0.2)
    fake.response_delay_s = 1.0
    started = time.monotonic()
    with pytest.raises(Transient):
        cluster.get_node("gpu-1")
    assert time.monotonic() - started < 5

