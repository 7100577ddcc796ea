"""A node's own pods on the real control plane: where NodeRestriction lets a kubelet put them and
the shipped mirror-pod policy (gpufleet-node-mirror-pods) does not.

A machine joins from its user data and its real kubelet registers. With that kubelet's client
certificate (what a hostile node holds), it creates pods as a kubelet publishes a static pod's
mirror: bound to itself, owned by its Node. NodeRestriction allows any labels in any namespace, so
without the policy such a pod joins the node gateway's LoadBalancer, is scraped as the control
plane, serves another site's model, counts as one of Temporal's pods, answers the site's DNS, or
is let through to the control plane's metrics port as Prometheus.
The policy refuses each; an operator's own static pod elsewhere still goes through, and the real
kubelet still publishes the mirrors of its static pods there, reports their status, deletes
them, and writes its Node's status.
"""

from __future__ import annotations

import json
import time
import uuid

from fleet.cluster import LABEL_MODEL, UNPROVEN_TAINT
from providers.cluster.base import serving_labels
from providers.cluster.check import MIRROR_PODS_POLICY
from tests.realk8s.conftest import TEMPORAL_NAMESPACE
from tests.realk8s.contract import ensure_namespace
from tests.realk8s.test_join import RealJoining, one, wait_for  # noqa: F401 - the fixture
from tests.realk8s.test_labels import refused_by

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
#: An operator's namespace of its own, none of gpufleet's.
OPERATORS = "node-monitoring"


def static_pod(name: str, namespace: str, labels: dict[str, str]) -> dict:
    """A static pod manifest: what a file in the kubelet's static pod folder holds."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "registry.invalid/agent:1"}]}}


def as_mirror(pod: dict, node: dict) -> dict:
    """``pod`` as a kubelet publishes it: named after its node, bound to it, owned by it, annotated
    as a mirror (the only pod NodeRestriction lets a node create)."""
    name = node["metadata"]["name"]
    mirrored = {**pod, "metadata": {**pod["metadata"], "name": f"{pod['metadata']['name']}-{name}",
                                    "annotations": {"kubernetes.io/config.mirror": uuid.uuid4().hex,
                                                    "kubernetes.io/config.source": "file"},
                                    "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name,
                                                         "uid": node["metadata"]["uid"], "controller": True}]}}
    mirrored["spec"] = {**pod["spec"], "nodeName": name}
    return mirrored


def test_a_node_may_not_publish_its_own_pods_where_gpufleets_selectors_pick_them(one: RealJoining) -> None:
    provisioned = one.provision()
    machine = one.machine(provisioned.machine.id).boot()
    registered = one.await_registration(provisioned, add_taints=[UNPROVEN_TAINT])
    status, node = one.real.request("GET", f"/api/v1/nodes/{registered.name}", admin=True)
    assert status == 200, node
    ensure_namespace(one.real, OPERATORS)
    ensure_namespace(one.real, "monitoring")

    def create(namespace: str, labels: dict[str, str]) -> tuple[int, dict]:
        """The node's own pod, created with its kubelet's certificate (a dry run: nothing is stored)."""
        pod = as_mirror(static_pod(f"static-{uuid.uuid4().hex[:6]}", namespace, labels), node)
        return one.real.request("POST", f"/api/v1/namespaces/{namespace}/pods?dryRun=All", pod,
                                cert=machine.client_pem)

    def outcome(namespace: str, labels: dict[str, str]) -> str:
        status, answer = create(namespace, labels)
        return "allowed" if status == 201 else f"{status} {refused_by(answer)}"

    # The API server loads admission policies asynchronously: give it until a dry run is refused.
    gateway = {"app.kubernetes.io/name": "gpufleet-node-gateway"}
    control_plane = {"app.kubernetes.io/name": "gpufleet-control-plane"}
    deadline = time.monotonic() + 30
    while create("gpufleet", gateway)[0] == 201 and time.monotonic() < deadline:
        time.sleep(0.5)  # not enforced after that: the table below says what the node could do

    refused = f"403 {MIRROR_PODS_POLICY}"
    victim = serving_labels("victim-model", "another-site")
    found = {
        # Behind the gateway's LoadBalancer Service: a share of every node agent's connections.
        "the gateway's label in gpufleet": outcome("gpufleet", gateway),
        # Scraped as the control plane; let through to Temporal's frontend by its NetworkPolicy.
        "the control plane's label in gpufleet": outcome("gpufleet", control_plane),
        # A replica behind another site's Service of that model: its users' prompts.
        "a model's and a site's labels in gpufleet": outcome("gpufleet", victim),
        "a model's and a site's labels elsewhere": outcome(OPERATORS, victim),
        "a model's label alone elsewhere": outcome(OPERATORS, {LABEL_MODEL: "victim-model"}),
        "the control plane's label elsewhere": outcome(OPERATORS, control_plane),
        # One of Temporal's own pods to the frontend's NetworkPolicy (it admits its whole namespace).
        "any pod in temporal": outcome(TEMPORAL_NAMESPACE, {"app": "debug"}),
        # The site's DNS: the kube-dns Service prefers a caller's own site.
        "the cluster DNS's label in kube-system": outcome("kube-system", {"k8s-app": "kube-dns"}),
        # Let through to the control plane's metrics port by its NetworkPolicy.
        "Prometheus's label in monitoring": outcome("monitoring", {"app.kubernetes.io/name": "prometheus"}),
        # Not gpufleet's: an operator's agent in its own namespace, a control-plane static pod.
        "an operator's agent in its own namespace": outcome(OPERATORS, {"app.kubernetes.io/name": "node-exporter"}),
        "a control-plane static pod in kube-system": outcome("kube-system", {"component": "kube-scheduler",
                                                                            "tier": "control-plane"}),
    }
    assert found == {
        "the gateway's label in gpufleet": refused, "the control plane's label in gpufleet": refused,
        "a model's and a site's labels in gpufleet": refused, "a model's and a site's labels elsewhere": refused,
        "a model's label alone elsewhere": refused, "the control plane's label elsewhere": refused,
        "any pod in temporal": refused, "the cluster DNS's label in kube-system": refused,
        "Prometheus's label in monitoring": refused,
        "an operator's agent in its own namespace": "allowed", "a control-plane static pod in kube-system": "allowed",
    }, found

    # The real kubelet, from its static pod folder: it publishes the operator's agent and reports
    # it running; the gateway's label in gpufleet it runs, but may not publish.
    agent = static_pod("node-exporter", OPERATORS, {"app.kubernetes.io/name": "node-exporter"})
    impostor = static_pod("impostor", "gpufleet", gateway)
    for pod in (agent, impostor):
        (machine.static_pod_dir / f"{pod['metadata']['name']}.json").write_text(json.dumps(pod))
    mirror = f"/api/v1/namespaces/{OPERATORS}/pods/node-exporter-{node['metadata']['name']}"

    def running() -> dict | None:
        status, pod = one.real.request("GET", mirror, admin=True)
        return pod if status == 200 and pod["status"].get("phase") == "Running" else None

    published = wait_for(running, 60, "the operator's static pod published and reported Running by its kubelet")
    assert "kubernetes.io/config.mirror" in published["metadata"]["annotations"]
    wait_for(lambda: MIRROR_PODS_POLICY in machine.log_tail(200_000), 60,
             "the kubelet's mirror of the impostor, refused")
    status, _ = one.real.request("GET", f"/api/v1/namespaces/gpufleet/pods/impostor-{node['metadata']['name']}",
                                 admin=True)
    assert status == 404, "the impostor has no mirror pod"

    # The kubelet's own writes still pass: its pods' status, its Node's status.
    status, answer = one.real.request("PATCH", f"{mirror}/status", {"status": {"message": "kubelet"}},
                                      cert=machine.client_pem, content_type=MERGE)
    assert status == 200, answer
    status, answer = one.real.request("PATCH", f"/api/v1/nodes/{node['metadata']['name']}/status", {"status": {
        "conditions": [{"type": "ExampleCondition", "status": "False", "reason": "Kubelet"}]}},
        cert=machine.client_pem, content_type=STRATEGIC)
    assert status == 200, answer
    [ready] = [c for c in answer["status"]["conditions"] if c["type"] == "Ready"]
    assert ready["status"] == "True", ready
    # Its static pods removed, the kubelet deletes their mirror itself.
    for pod in (agent, impostor):
        (machine.static_pod_dir / f"{pod['metadata']['name']}.json").unlink()
    wait_for(lambda: one.real.request("GET", mirror, admin=True)[0] == 404, 60, "the mirror deleted by its kubelet")
