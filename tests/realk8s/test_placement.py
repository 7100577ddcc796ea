"""Where the real kube-scheduler puts gpufleet's pods (issue 35): the control plane and the node
gateway on control-plane hosts only, never on a GPU node; the node agent and serving on GPU nodes.

The cluster is the one the README describes: kubeadm's control-plane hosts (labelled and tainted
``node-role.kubernetes.io/control-plane``) and GPU nodes gpufleet joined, which register with the
taints of their JoinConfiguration and keep the fleet taint after admission. The manifests are
``deploy/kubernetes`` as the conftest applied them, unchanged.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime, timedelta, timezone

from activities.capacity import CapacityActivities
from fleet.messages.nodes import AwaitRegistrationInput
from fleet.cluster import (
    FLEET_TAINT,
    LABEL_GPU_PRODUCT,
    LABEL_MODEL,
    LABEL_PROVIDER,
    LABEL_REGION,
    LABEL_SITE,
    UNPROVEN_TAINT,
    ServingSpec,
)
from fleet.messages.capacity import SiteNodesInput
from providers.cluster.bootstrap import read_join_configuration
from tests.providers.test_join_real import run, user_data_of
from tests.realk8s.cluster import KUBEADM_TOKEN
from tests.realk8s.test_join import RealJoining, one, wait_for  # noqa: F401 - the fixture

CONTROL_PLANE_ROLE = "node-role.kubernetes.io/control-plane"
CONTROL_PLANE_APPS = {"gpufleet-control-plane": 1, "gpufleet-node-gateway": 2}


def control_plane_host_user_data(gpu_user_data: str, name: str) -> str:
    """A machine joined as kubeadm joins a control-plane host: kubeadm's own token (its CSR is
    auto-approved), registered with kubeadm's control-plane taint and none of gpufleet's."""
    config = read_join_configuration(gpu_user_data)
    text = gpu_user_data.replace(config["discovery"]["tlsBootstrapToken"], KUBEADM_TOKEN)
    text = text.replace(config["nodeRegistration"]["name"], name)
    text, replaced = re.subn(r"(        taints:\n)(?:          - key: .*\n            effect: .*\n)+",
                             rf"\g<1>          - key: {CONTROL_PLANE_ROLE}\n            effect: NoSchedule\n", text)
    assert replaced == 1
    return text


def pods(one: RealJoining, namespace: str, app: str) -> list[dict]:
    status, listed = one.real.request(
        "GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector=app.kubernetes.io%2Fname%3D{app}", admin=True)
    assert status == 200, listed
    return [p for p in listed["items"] if not p["metadata"].get("deletionTimestamp")]


def unschedulable(pod: dict) -> str:
    """The scheduler's refusal (PodScheduled False, Unschedulable), or ''."""
    for condition in pod["status"].get("conditions") or []:
        if condition["type"] == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return condition.get("message") or "unschedulable"
    return ""


def fresh_pods(one: RealJoining, app: str) -> list[str]:
    """Delete the Deployment's pods so its ReplicaSet makes new ones, which the scheduler
    judges against the nodes as they are now; their names."""
    old = {p["metadata"]["name"] for p in pods(one, "gpufleet", app)}
    for name in old:
        one.real.request("DELETE", f"/api/v1/namespaces/gpufleet/pods/{name}?gracePeriodSeconds=0", admin=True)
    wanted = CONTROL_PLANE_APPS[app]
    new = wait_for(lambda: (found := [p for p in pods(one, "gpufleet", app) if p["metadata"]["name"] not in old])
                   and len(found) == wanted and found, 30, f"{app}: new pods")
    return [p["metadata"]["name"] for p in new]


def all_refused(one: RealJoining, app: str, names: list[str]) -> list[dict]:
    def refused():
        found = [p for p in pods(one, "gpufleet", app) if p["metadata"]["name"] in names]
        return found if len(found) == len(names) and all(unschedulable(p) for p in found) else None

    return wait_for(refused, 60, f"{app}: the scheduler's verdict on its new pods")


def test_the_control_plane_runs_only_on_control_plane_hosts_and_gpu_work_on_gpu_nodes(one: RealJoining) -> None:
    # Two machines boot at once: a GPU machine from gpufleet's user data, and a host that joins
    # as kubeadm joins a control-plane host.
    provisioned = one.provision()
    gpu_user_data = user_data_of(one.harness, provisioned.machine.id)
    host_name = f"control-plane-{uuid.uuid4().hex[:6]}"
    one.machine(provisioned.machine.id).boot()
    one.machine(provisioned.machine.id, control_plane_host_user_data(gpu_user_data, host_name),
                name="control-plane-host").boot()
    site = one.site
    node = run(one.acts.await_registration, AwaitRegistrationInput(
        site=site.name, node_name=one.node_name, machine_id=provisioned.machine.id,
        provider_id=provisioned.provider_id, join_id=one.join_id, poll_seconds=0.2,
        deadline=datetime.now(timezone.utc) + timedelta(seconds=90),
        labels={LABEL_SITE: site.name, LABEL_PROVIDER: site.provider, LABEL_REGION: site.region,
                LABEL_GPU_PRODUCT: site.gpu}, add_taints=[UNPROVEN_TAINT]))
    assert UNPROVEN_TAINT in node.taints and FLEET_TAINT in node.taints, "registered with both, from its JoinConfiguration"

    # Admission, as admit_node does it (the control plane's service account): only unproven goes.
    admitted = one.cluster.set_taints(node.name, remove=[UNPROVEN_TAINT])
    assert FLEET_TAINT in admitted.taints and UNPROVEN_TAINT not in admitted.taints

    # The node cannot drop the fleet taint itself (NodeRestriction) ...
    status, answer = one.real.request("PATCH", f"/api/v1/nodes/{node.name}", {"spec": {"taints": None}},
                                      cert=one.machines[0].client_pem, content_type="application/merge-patch+json")
    assert status == 403 and "taints" in answer["message"], answer
    # ... and where someone else did, the site reconcile puts it back.
    one.cluster.set_taints(node.name, remove=[FLEET_TAINT])
    run(CapacityActivities(one.env).site_nodes, SiteNodesInput(site=site.name))
    assert FLEET_TAINT in one.cluster.get_node(node.name).taints

    # No control-plane host yet (registered, not yet marked): the admitted GPU node is the only
    # node without a taint they tolerate, and the real scheduler still refuses them.
    wait_for(lambda: one.real.request("GET", f"/api/v1/nodes/{host_name}", admin=True)[0] == 200, 60,
             "the control-plane host registered")
    for app in CONTROL_PLANE_APPS:
        for pod in all_refused(one, app, fresh_pods(one, app)):
            assert not pod["spec"].get("nodeName"), pod["metadata"]["name"]

    # kubeadm marks the host (as the admin: a kubelet may not set a node-role label on itself).
    status, answer = one.real.request("PATCH", f"/api/v1/nodes/{host_name}",
                                      {"metadata": {"labels": {CONTROL_PLANE_ROLE: ""}}}, admin=True,
                                      content_type="application/merge-patch+json")
    assert status == 200, answer
    status, host = one.real.request("GET", f"/api/v1/nodes/{host_name}", admin=True)
    assert {"key": CONTROL_PLANE_ROLE, "effect": "NoSchedule"} in [
        {k: t[k] for k in ("key", "effect")} for t in host["spec"].get("taints") or []]
    try:
        for app, replicas in CONTROL_PLANE_APPS.items():
            bound = wait_for(lambda: (found := [p for p in pods(one, "gpufleet", app) if p["spec"].get("nodeName")])
                             and len(found) == replicas and found, 60, f"{app} scheduled")
            assert {p["spec"]["nodeName"] for p in bound} == {host_name}, app

        # The node agent lands on the GPU node (unproven or not), never on the control-plane host.
        agents = wait_for(lambda: [p for p in pods(one, "gpufleet", "gpufleet-node-agent")
                                   if p["spec"].get("nodeName") == node.name], 60, "the node agent on the GPU node")
        assert len(agents) == 1
        assert not [p for p in pods(one, "gpufleet", "gpufleet-node-agent") if p["spec"].get("nodeName") == host_name]

        # A serving Deployment as gpufleet renders it (the control plane's own adapter) runs there.
        model = f"placement-{uuid.uuid4().hex[:6]}"
        one.cluster.apply_serving(ServingSpec(model=model, site=site.name, image="registry.invalid/serve:1",
                                              gpus_per_replica=2, replicas=1))
        try:
            def serving_running():
                _, listed = one.real.request("GET", "/api/v1/namespaces/gpufleet/pods", admin=True)
                found = [p for p in listed["items"] if (p["metadata"].get("labels") or {}).get(LABEL_MODEL) == model]
                return found if found and all(p["status"].get("phase") == "Running" for p in found) else None

            served = wait_for(serving_running, 60, "the serving pod Running")
            assert [p["spec"]["nodeName"] for p in served] == [node.name]
        finally:
            one.cluster.delete_serving(model, site.name)

        # The control-plane host cordoned: the control plane waits for it, it does not move to the GPU node.
        status, _ = one.real.request("PATCH", f"/api/v1/nodes/{host_name}", {"spec": {"unschedulable": True}},
                                     admin=True, content_type="application/merge-patch+json")
        assert status == 200
        for app in CONTROL_PLANE_APPS:
            for pod in all_refused(one, app, fresh_pods(one, app)):
                assert not pod["spec"].get("nodeName"), pod["metadata"]["name"]
    finally:
        # The package's cluster has no control-plane host again (its pods go back to Pending).
        one.machines[1].stop()
        one.real.request("DELETE", f"/api/v1/nodes/{host_name}", admin=True)
