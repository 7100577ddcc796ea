"""The fleet's cluster calls against the real control plane: drains against a real
PodDisruptionBudget and the Eviction API, control-plane state under real resourceVersion
conflicts, the demand loop reading the Pending pods kube-scheduler left, and consolidation
reading real pods while a drain moves them.

The adapter runs as the ``gpufleet-control-plane`` service account (the shipped RBAC), on a
node that joined from its user data (``test_join.RealJoining``), with real pods bound by
kube-scheduler and run by that node's kubelet.
"""

from __future__ import annotations

import threading
import uuid

from activities.demand import DemandActivities
from fleet.cluster import GPU_RESOURCE, LABEL_SITE, UNPROVEN_TAINT
from tests.realk8s.test_join import RealJoining, control_plane_cluster, one, wait_for  # noqa: F401

UNPROVEN = {"key": "gpufleet.io/unproven", "operator": "Exists"}
#: The fleet taint every gpufleet node keeps: GPU workloads tolerate it.
FLEET = {"key": "gpufleet.io/demand", "operator": "Exists"}


def gpu_deployment(name: str, node: str, replicas: int, gpus: int) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "default"},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {
                         "nodeSelector": {"kubernetes.io/hostname": node}, "tolerations": [UNPROVEN, FLEET],
                         "terminationGracePeriodSeconds": 0,
                         "containers": [{"name": "serve", "image": "registry.invalid/serve:1",
                                         "resources": {"limits": {GPU_RESOURCE: str(gpus)}}}]}}}}


def running_pods(one: RealJoining, app: str, node: str) -> list[dict]:
    _, pods = one.real.request("GET", f"/api/v1/namespaces/default/pods?labelSelector=app%3D{app}", admin=True)
    return [p for p in pods["items"] if p["spec"].get("nodeName") == node and p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")]


def test_a_drain_is_held_by_a_real_pod_disruption_budget_and_completes_once_it_allows(one: RealJoining) -> None:
    provisioned = one.provision()
    one.machine(provisioned.machine.id).boot()
    node = one.await_registration(provisioned)
    app = f"serve-{uuid.uuid4().hex[:6]}"
    status, answer = one.real.request("POST", "/apis/apps/v1/namespaces/default/deployments",
                                      gpu_deployment(app, node.name, replicas=2, gpus=2), admin=True)
    assert status == 201, answer
    wait_for(lambda: len(running_pods(one, app, node.name)) == 2, 90, "two replicas Running on the node")
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": app, "namespace": "default"},
           "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": app}}}}
    status, answer = one.real.request("POST", "/apis/policy/v1/namespaces/default/poddisruptionbudgets", pdb,
                                      admin=True)
    assert status == 201, answer
    # The disruption controller computes the budget's status before the Eviction API honours it.
    wait_for(lambda: one.real.request("GET", f"/apis/policy/v1/namespaces/default/poddisruptionbudgets/{app}",
                                      admin=True)[1].get("status", {}).get("observedGeneration"), 30,
             "the PDB observed")

    held = one.cluster.drain_node(node.name, deadline_s=3)
    assert not held.completed and not held.evicted
    assert sorted(p.name for p in held.blocked) == sorted(p["metadata"]["name"] for p in running_pods(
        one, app, node.name)), "both replicas named as blocked"
    assert all("disruption budget" in p.reason.lower() or "429" in p.reason for p in held.blocked), held.blocked
    assert one.cluster.get_node(node.name).unschedulable, "cordoned first"

    one.real.request("DELETE", f"/apis/policy/v1/namespaces/default/poddisruptionbudgets/{app}", admin=True)
    drained = one.cluster.drain_node(node.name, deadline_s=60)
    assert drained.completed and len(drained.evicted) == 2, drained
    assert running_pods(one, app, node.name) == []
    one.real.request("DELETE", f"/apis/apps/v1/namespaces/default/deployments/{app}", admin=True)


def test_the_demand_loop_reads_the_pending_gpu_pods_the_scheduler_could_not_place(one: RealJoining) -> None:
    provisioned = one.provision()
    one.machine(provisioned.machine.id).boot()
    node = one.await_registration(provisioned)
    fits, too_big = f"fits-{uuid.uuid4().hex[:6]}", f"too-big-{uuid.uuid4().hex[:6]}"
    for name, gpus in ((fits, 2), (too_big, 16)):
        # Pinned to this test's node: the package's cluster may still hold other tests' GPU nodes.
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
               "spec": {"tolerations": [UNPROVEN, FLEET], "terminationGracePeriodSeconds": 0,
                        "nodeSelector": {"kubernetes.io/hostname": node.name},
                        "containers": [{"name": "c", "image": "registry.invalid/serve:1",
                                        "resources": {"limits": {GPU_RESOURCE: str(gpus)}}}]}}
        status, answer = one.real.request("POST", "/api/v1/namespaces/default/pods", pod, admin=True)
        assert status == 201, answer

    def pending():
        found = {p.name: p for p in one.cluster.list_gpu_pods(pending_only=True)}
        return found if too_big in found and found[too_big].unschedulable else None

    found = wait_for(pending, 60, "the 16-GPU pod marked Unschedulable by kube-scheduler")
    assert found[too_big].gpus == 16 and found[too_big].node == ""
    wait_for(lambda: fits not in {p.name for p in one.cluster.list_gpu_pods(pending_only=True)}, 60,
             "the 2-GPU pod bound")
    every = {p.name: p for p in one.cluster.list_gpu_pods()}
    assert every[fits].node == node.name and every[fits].gpus == 2
    for name in (fits, too_big):
        one.real.request("DELETE", f"/api/v1/namespaces/default/pods/{name}?gracePeriodSeconds=0", admin=True)


def test_state_written_by_many_writers_under_real_resource_version_conflicts_loses_nothing(real_cluster) -> None:
    """Two control-plane replicas' worth of writers on one state object: every change is a
    create or a replace under the resourceVersion read, retried on 409, so none is lost."""
    writers = [control_plane_cluster(real_cluster) for _ in range(2)]
    key = f"counter-{uuid.uuid4().hex[:6]}"
    errors: list[BaseException] = []

    def bump(cluster) -> None:
        try:
            for _ in range(10):
                cluster.update_state("test-counter", key, lambda old: {"n": str(int(old.get("n", "0")) + 1)})
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=bump, args=(writers[i % 2],)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert writers[0].read_state("test-counter", key) == {"n": "60"}
    assert writers[0].delete_state("test-counter", key)
    for cluster in writers:
        cluster.api_client.close()


def test_consolidation_sees_real_pods_and_a_drain_moves_them_to_the_other_node(one: RealJoining) -> None:
    """Two joined nodes, one replica of a GPU Deployment that may run on either. The demand
    loop's ``idle_nodes`` (what consolidation chooses from) names the empty node and never the
    one holding the pod; draining the busy node evicts the pod, its ReplicaSet's replacement is
    bound by kube-scheduler to the other node and run by its kubelet, and the two swap roles."""
    nodes = []
    for _ in range(2):
        one.new_join()
        provisioned = one.provision()
        one.machine(provisioned.machine.id).boot()
        # Labelled by the join's own activity, then proven as admit_node does after a passed smoke
        # test (consolidation never picks an unproven node, nor one of no site).
        name = one.await_registration(provisioned, labels={LABEL_SITE: one.site.name}).name
        one.cluster.set_taints(name, remove=[UNPROVEN_TAINT])
        nodes.append(name)
    app = f"serve-{uuid.uuid4().hex[:6]}"
    deployment = gpu_deployment(app, nodes[0], replicas=1, gpus=2)
    pod_spec = deployment["spec"]["template"]["spec"]
    del pod_spec["nodeSelector"]  # either of this test's nodes (the package's cluster has others)
    pod_spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}]}}}
    status, answer = one.real.request("POST", "/apis/apps/v1/namespaces/default/deployments", deployment, admin=True)
    assert status == 201, answer

    def placed() -> str | None:
        running = [n for n in nodes if running_pods(one, app, n)]
        return running[0] if len(running) == 1 else None

    busy = wait_for(placed, 90, "the replica Running on one of the two nodes")
    (empty,) = set(nodes) - {busy}
    demand = DemandActivities(one.env)

    def idle() -> set[str]:
        return {n.name for n in demand._idle().idle} & set(nodes)

    assert idle() == {empty}, "consolidation may choose only the node without a GPU pod"

    drained = one.cluster.drain_node(busy, deadline_s=60)
    assert drained.completed and len(drained.evicted) == 1, drained
    wait_for(lambda: running_pods(one, app, empty), 90, "the replacement Running on the other node")
    assert running_pods(one, app, busy) == []
    # The busy node is cordoned now (a drain's first step): it is not offered for new pods,
    # and it holds none, so consolidation may retire it; the other one now serves.
    assert wait_for(lambda: idle() == {busy} or None, 30, "the roles swapped in idle_nodes")
    one.real.request("DELETE", f"/apis/apps/v1/namespaces/default/deployments/{app}", admin=True)
