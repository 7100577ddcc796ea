"""Who may reach Temporal's pods (issue 35, "The frontend"), on the real control plane.

``deploy/temporal/network-policy.yaml`` is applied unchanged by the tier's conftest (the real API
server validates it). Its selectors are evaluated by the real API server itself, as label
selectors over the pods the shipped Deployments and DaemonSet created: of gpufleet's pods, the
control-plane worker and the node gateway only, never the node agent; and over pods labelled as
Temporal's chart labels its own: the server's services take calls from one another only.
Enforcement is the CNI's (this tier runs none), so mutual TLS is proven on its own in
tests/test_temporal_manifests.py and tests/realtemporal/test_tls.py.
"""

from __future__ import annotations

from urllib.parse import quote

from tests.realk8s.cluster import RealCluster
from tests.realk8s.conftest import TEMPORAL_NAMESPACE
from tests.realk8s.test_join import wait_for
from tests.test_temporal_manifests import SERVER_PORTS, TEMPORAL_TOOLS, chart_pod_labels


def selector(spec: dict) -> str:
    """A NetworkPolicy label selector as the API's ``labelSelector`` query."""
    terms = [f"{k}={v}" for k, v in (spec.get("matchLabels") or {}).items()]
    for expression in spec.get("matchExpressions") or []:
        assert expression["operator"] in ("In", "NotIn"), expression
        terms.append(f"{expression['key']} {expression['operator'].lower()} ({','.join(expression['values'])})")
    return ",".join(terms)


def ingress_policy(cluster: RealCluster, name: str) -> dict:
    """The spec of the shipped NetworkPolicy ``name`` in Temporal's namespace, as the API server
    stored it; an ingress policy."""
    status, policy = cluster.request(
        "GET", f"/apis/networking.k8s.io/v1/namespaces/{TEMPORAL_NAMESPACE}/networkpolicies/{name}", admin=True)
    assert status == 200, policy
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    return policy["spec"]


def test_only_the_control_plane_and_the_gateway_of_gpufleet_may_reach_the_frontend(real_cluster: RealCluster):
    spec = ingress_policy(real_cluster, "temporal-frontend-clients")
    assert spec["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "temporal",
                                                   "app.kubernetes.io/component": "frontend"}
    same_namespace, gpufleet = spec["ingress"]
    assert same_namespace["from"] == [{"podSelector": {}}], "Temporal's own pods: their namespace only"
    assert same_namespace.get("ports") == [{"protocol": "TCP", "port": 7233}], "its tools: the gRPC port only"
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


def test_temporals_services_take_calls_from_one_another_only(real_cluster: RealCluster):
    """A pod of each kind Temporal's chart runs (its labels, Pending: labels are what a policy
    matches); the API server says which of them each policy applies to and which each rule admits."""
    for component in [*SERVER_PORTS, *TEMPORAL_TOOLS]:
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"chart-{component}", "labels": chart_pod_labels(component)},
               "spec": {"automountServiceAccountToken": False,
                        "containers": [{"name": "temporal", "image": "temporalio/server:1.32.1"}]}}
        # The namespace's default service account, which admission wants, comes a moment after it.
        wait_for(lambda: real_cluster.request("POST", f"/api/v1/namespaces/{TEMPORAL_NAMESPACE}/pods", pod,
                                              admin=True)[0] in (201, 409), 60, f"the pod chart-{component}")

    def pods(selected: dict) -> set[str]:
        """The chart's pods of Temporal's namespace that ``selected`` (a label selector) matches."""
        status, listed = real_cluster.request(
            "GET", f"/api/v1/namespaces/{TEMPORAL_NAMESPACE}/pods?labelSelector={quote(selector(selected))}",
            admin=True)
        assert status == 200, listed
        return {p["metadata"]["name"].removeprefix("chart-") for p in listed["items"]
                if p["metadata"]["name"].startswith("chart-")}

    spec = ingress_policy(real_cluster, "temporal-server-peers")
    assert pods(spec["podSelector"]) == set(SERVER_PORTS)
    (rule,) = spec["ingress"]
    assert "ports" not in rule, "every port of theirs, membership included, for one another"
    (peer,) = rule["from"]
    # A pod selector alone: this namespace's pods, never another namespace's or an address range
    # (a GPU node's pods and hosts).
    assert set(peer) == {"podSelector"}
    assert pods(peer["podSelector"]) == set(SERVER_PORTS)
