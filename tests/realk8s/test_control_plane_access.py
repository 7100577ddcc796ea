"""Who may reach the control plane's pods, on the real control plane: Prometheus, on the metrics port.

``deploy/kubernetes/control-plane.yaml`` is applied unchanged by the tier's conftest (the real API
server validates its NetworkPolicy). Its selectors are evaluated by the real API server itself, as
label selectors: over the pods the shipped Deployments made (the control plane's, not the
gateway's), over the namespaces (only `monitoring`), and over pods there labelled as the
Prometheus Operator labels a Prometheus's and as other monitoring pods are labelled (a node
exporter runs on every GPU node). Enforcement is the CNI's, and this tier runs none: what a caller
that still reaches the port can take is bounded by the server itself
(tests/security/test_metrics_endpoint.py).
"""

from __future__ import annotations

import uuid
from urllib.parse import quote

from tests.cluster.test_manifests import PROMETHEUS_POD
from tests.realk8s.cluster import RealCluster
from tests.realk8s.contract import ensure_namespace
from tests.realk8s.test_join import wait_for
from tests.realk8s.test_temporal_access import selector

MONITORING = "monitoring"


def listed(cluster: RealCluster, path: str, selected: dict) -> list[dict]:
    """The objects at ``path`` the label selector ``selected`` matches, as the API server says."""
    status, answer = cluster.request("GET", f"{path}?labelSelector={quote(selector(selected))}", admin=True)
    assert status == 200, answer
    return answer["items"]


def test_only_prometheus_may_reach_the_control_planes_metrics_port(real_cluster: RealCluster) -> None:
    status, policy = real_cluster.request(
        "GET", "/apis/networking.k8s.io/v1/namespaces/gpufleet/networkpolicies/gpufleet-control-plane", admin=True)
    assert status == 200, policy
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"], "ingress it does not admit is refused"

    # It applies to the control plane's pods, and to no other pod of gpufleet's.
    def apps(pods: list[dict]) -> set[str]:
        return {p["metadata"]["labels"].get("app.kubernetes.io/name", "") for p in pods}

    wait_for(lambda: {"gpufleet-control-plane", "gpufleet-node-gateway"}
             <= apps(listed(real_cluster, "/api/v1/namespaces/gpufleet/pods", {})), 60,
             "the control plane's and the gateway's pods")
    assert apps(listed(real_cluster, "/api/v1/namespaces/gpufleet/pods", spec["podSelector"])) == {
        "gpufleet-control-plane"}

    # One rule: the metrics port the stored Deployment's worker serves (and its Service targets).
    (rule,) = spec["ingress"]
    status, deployment = real_cluster.request(
        "GET", "/apis/apps/v1/namespaces/gpufleet/deployments/gpufleet-control-plane", admin=True)
    assert status == 200, deployment
    (worker,) = deployment["spec"]["template"]["spec"]["containers"]
    assert [p["name"] for p in worker["ports"]] == ["metrics"], "every port it serves is judged here"
    assert rule["ports"] == [{"protocol": "TCP", "port": worker["ports"][0]["containerPort"]}]
    status, service = real_cluster.request(
        "GET", "/api/v1/namespaces/gpufleet/services/gpufleet-control-plane-metrics", admin=True)
    assert status == 200 and service["spec"]["ports"][0]["targetPort"] == "metrics", service

    # From Prometheus's pods in monitoring only: one peer, both selectors (a pod must match both).
    (peer,) = rule["from"]
    assert set(peer) == {"namespaceSelector", "podSelector"}
    ensure_namespace(real_cluster, MONITORING)  # and its default service account
    assert [n["metadata"]["name"] for n in listed(real_cluster, "/api/v1/namespaces", peer["namespaceSelector"])] \
        == [MONITORING]
    tag = uuid.uuid4().hex[:6]
    made = {f"prometheus-{tag}": PROMETHEUS_POD,
            f"node-exporter-{tag}": {"app.kubernetes.io/name": "prometheus-node-exporter"},
            f"alertmanager-{tag}": {"app.kubernetes.io/name": "alertmanager", "alertmanager": "main"}}
    try:
        for name, labels in made.items():
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
                   "spec": {"automountServiceAccountToken": False,
                            "containers": [{"name": "c", "image": "registry.invalid/monitoring:1"}]}}
            status, answer = real_cluster.request("POST", f"/api/v1/namespaces/{MONITORING}/pods", pod, admin=True)
            assert status == 201, answer
        picked = {p["metadata"]["name"] for p in listed(real_cluster, f"/api/v1/namespaces/{MONITORING}/pods",
                                                         peer["podSelector"])}
        assert picked & set(made) == {f"prometheus-{tag}"}
    finally:
        for name in made:
            real_cluster.request("DELETE", f"/api/v1/namespaces/{MONITORING}/pods/{name}?gracePeriodSeconds=0",
                                 admin=True)
