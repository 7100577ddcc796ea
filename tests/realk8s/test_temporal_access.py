"""Who may reach the Temporal frontend (issue 35, "The frontend"), on the real control plane.

``deploy/temporal/network-policy.yaml`` is applied unchanged by the tier's conftest (the real API
server validates it). Its selectors are evaluated by the real API server itself, as label
selectors over the pods the shipped Deployments and DaemonSet created: of gpufleet's pods, the
control-plane worker and the node gateway only, never the node agent. Enforcement is the CNI's
(this tier runs none), so mutual TLS is proven on its own in tests/test_temporal_manifests.py.
"""

from __future__ import annotations

from urllib.parse import quote

from tests.realk8s.cluster import RealCluster
from tests.realk8s.conftest import TEMPORAL_NAMESPACE
from tests.realk8s.test_join import wait_for


def selector(spec: dict) -> str:
    """A NetworkPolicy label selector as the API's ``labelSelector`` query."""
    terms = [f"{k}={v}" for k, v in (spec.get("matchLabels") or {}).items()]
    for expression in spec.get("matchExpressions") or []:
        assert expression["operator"] in ("In", "NotIn"), expression
        terms.append(f"{expression['key']} {expression['operator'].lower()} ({','.join(expression['values'])})")
    return ",".join(terms)


def test_only_the_control_plane_and_the_gateway_of_gpufleet_may_reach_the_frontend(real_cluster: RealCluster):
    status, policy = real_cluster.request(
        "GET", f"/apis/networking.k8s.io/v1/namespaces/{TEMPORAL_NAMESPACE}/networkpolicies/temporal-frontend-clients",
        admin=True)
    assert status == 200, policy
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "temporal",
                                                   "app.kubernetes.io/component": "frontend"}
    same_namespace, gpufleet = spec["ingress"]
    assert same_namespace["from"] == [{"podSelector": {}}], "Temporal's own pods: their namespace only"
    (peer,) = gpufleet["from"]
    assert gpufleet["ports"] == [{"protocol": "TCP", "port": 7233}]

    status, namespaces = real_cluster.request(
        "GET", f"/api/v1/namespaces?labelSelector={quote(selector(peer['namespaceSelector']))}", admin=True)
    assert status == 200 and [n["metadata"]["name"] for n in namespaces["items"]] == ["gpufleet"]

    def pods(query: str = "") -> dict[str, str]:
        """gpufleet's pods (the shipped workloads') by name → app."""
        status, listed = real_cluster.request(
            "GET", f"/api/v1/namespaces/gpufleet/pods{'?labelSelector=' + quote(query) if query else ''}", admin=True)
        assert status == 200, listed
        return {p["metadata"]["name"]: p["metadata"]["labels"].get("app.kubernetes.io/name", "")
                for p in listed["items"]}

    # The Deployments' pods exist (Pending or not: labels are what the policy matches).
    wait_for(lambda: {"gpufleet-control-plane", "gpufleet-node-gateway"} <= set(pods().values()), 60,
             "the control plane's and the gateway's pods")
    allowed = pods(selector(peer["podSelector"]))
    assert set(allowed.values()) == {"gpufleet-control-plane", "gpufleet-node-gateway"}
    # The node agent's pods (one per GPU node; this cluster may have none yet) carry its
    # DaemonSet's template labels, which the API server's selector does not match.
    status, agent = real_cluster.request("GET", "/apis/apps/v1/namespaces/gpufleet/daemonsets/gpufleet-node-agent",
                                         admin=True)
    assert status == 200, agent
    labels = agent["spec"]["template"]["metadata"]["labels"]
    status, matched = real_cluster.request(
        "GET", "/apis/apps/v1/namespaces/gpufleet/daemonsets?labelSelector=" + quote(selector(peer["podSelector"])),
        admin=True)
    assert status == 200 and labels == agent["metadata"]["labels"] and not matched["items"], (labels, matched)
