"""The cluster port's contract suite on the real control plane: ``RealHarness`` puts nodes, pods
and PodDisruptionBudgets into the real API server the way ``tests/cluster/conftest.py``'s
``SimHarness`` puts them into the simulated cluster, so the same tests (tests/cluster/
test_contract.py, test_state.py, test_identity_records.py, test_watch_contract.py) hold the
Kubernetes adapter to what a real API server, its controllers and kube-scheduler do.

What is real: the adapter runs as the ``gpufleet-control-plane`` service account, in a namespace
of the test's own bound to a copy of the shipped ``gpufleet-serving`` Role (read from the cluster
as ``kubectl apply -k deploy/kubernetes`` made it, not re-typed), so every call passes the real
authorizer or fails the test; Deployments, ReplicaSets, the scheduler's placement by GPUs,
taints and cordons, the disruption controller and the Eviction API are the real ones.

What stands in for a kubelet: the harness's Nodes are Node objects the admin writes (a Ready
condition, GPUs allocatable), and a thread reports each pod bound to them Running and Ready and
ends each pod deleted on them, as their kubelet would; a pod annotated
``TERMINATING_ANNOTATION`` takes that many seconds to end (a graceful termination).  Pods a
test adds name real owner objects (a ReplicaSet that places nothing, a suspended Job, a
DaemonSet that fits no node, the Node itself for a mirror pod), not controllers of them: the
garbage collector deletes a pod whose owner does not exist. A mirror pod is made as its node
(``system:node:<name>``, under NodeRestriction), the way a hostile kubelet would make one; one
labelled as gpufleet's, which the shipped mirror-pod policy refuses a node, by the admin.

The routing objects are custom resources of Gateway API's ``HTTPRoute`` and Envoy Gateway's
``BackendTrafficPolicy`` kinds, served by the real API server from the projects' published CRDs
(``install_routing_crds``; tests/realk8s/build.py copies them from their Go modules), so the
server checks each object against its real schema, limits and CEL rules: real resourceVersions,
generations and conflicts, and the shipped Role's verbs on them.
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Iterator

from fleet.cluster import GPU_RESOURCE, LABEL_PROVIDER, LABEL_SITE
from providers.cluster.base import PodInfo
from providers.cluster.kubernetes import KubernetesCluster
from tests.cluster.test_cluster_check import node_pod_refusal
from tests.realk8s import build
from tests.realk8s.cluster import RealCluster

RBAC = "/apis/rbac.authorization.k8s.io/v1"
MERGE = "application/merge-patch+json"
#: Seconds the stand-in kubelet takes to end a deleted pod (a graceful termination).
TERMINATING_ANNOTATION = "contract.gpufleet.io/terminating-seconds"
#: Namespaces the contract's pods live in besides ``default`` and ``kube-system``.
POD_NAMESPACES = ("jobs", "monitoring", "data")

OWNER_API = {"ReplicaSet": ("apps/v1", "/apis/apps/v1/namespaces/{ns}/replicasets"),
             "DaemonSet": ("apps/v1", "/apis/apps/v1/namespaces/{ns}/daemonsets"),
             "Job": ("batch/v1", "/apis/batch/v1/namespaces/{ns}/jobs")}


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ok(answer: tuple[int, Any], *expected: int) -> Any:
    status, body = answer
    assert status in (expected or (200, 201)), (status, body)
    return body


def wait_default_service_account(real: RealCluster, namespace: str, seconds: float = 30) -> None:
    """A pod is refused until its namespace's ``default`` ServiceAccount exists (the service
    account admission looks it up), which the controller-manager makes just after the namespace."""
    deadline = time.monotonic() + seconds
    while real.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default", admin=True)[0] != 200:
        assert time.monotonic() < deadline, f"no default ServiceAccount in {namespace}"
        time.sleep(0.1)


def ensure_namespace(real: RealCluster, name: str) -> None:
    status, answer = real.request("POST", "/api/v1/namespaces",
                                  {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}, admin=True)
    assert status in (201, 409), answer
    wait_default_service_account(real, name)


def install_routing_crds(real: RealCluster) -> None:
    """``HTTPRoute`` (gateway.networking.k8s.io/v1) and ``BackendTrafficPolicy``
    (gateway.envoyproxy.io/v1alpha1) from Gateway API's and Envoy Gateway's published CRDs."""
    for path in build.crd_files():
        real.kubectl("apply", "--server-side", "--field-manager=routing-crds", "-f", str(path))
    for path in ("/apis/gateway.networking.k8s.io/v1/httproutes",
                 "/apis/gateway.envoyproxy.io/v1alpha1/backendtrafficpolicies"):
        deadline = time.monotonic() + 30
        while real.request("GET", path, admin=True)[0] != 200:
            assert time.monotonic() < deadline, f"{path} not served"
            time.sleep(0.1)


def bind_serving_role(real: RealCluster, namespace: str, account: str = "gpufleet-control-plane") -> None:
    """The shipped ``gpufleet-serving`` Role, as applied in ``gpufleet``, copied into ``namespace``
    and bound to the control plane's service account there (what an operator who runs gpufleet
    in another namespace applies)."""
    role = _ok(real.request("GET", f"{RBAC}/namespaces/gpufleet/roles/gpufleet-serving", admin=True), 200)
    meta = {"name": "gpufleet-serving", "namespace": namespace}
    _ok(real.request("POST", f"{RBAC}/namespaces/{namespace}/roles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": role["rules"]},
        admin=True), 201)
    _ok(real.request("POST", f"{RBAC}/namespaces/{namespace}/rolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "gpufleet-serving"},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": "gpufleet"}]}, admin=True), 201)


class RealHarness:
    kind = "kubernetes"

    def __init__(self, real: RealCluster, token: str) -> None:
        self.real = real
        self.namespace = f"contract-{uuid.uuid4().hex[:6]}"
        ensure_namespace(real, self.namespace)
        bind_serving_role(real, self.namespace)
        self.cluster = KubernetesCluster(api_client=real.api_client(token), namespace=self.namespace)
        #: Nodes this test did not add (the tier's other tests leave theirs): a listing of every
        #: node shows them too.
        self.foreign = {n["metadata"]["name"] for n in _ok(real.request("GET", "/api/v1/nodes", admin=True))["items"]}
        self.nodes: dict[str, str] = {}  # name -> uid
        self.pod_keys: list[tuple[str, str]] = []
        self.pdbs: list[tuple[str, str]] = []
        self.owners: dict[tuple[str, str], dict[str, Any]] = {}
        self._ending: dict[str, float] = {}  # pod uid -> when its stand-in kubelet ends it
        self._stop = threading.Event()
        #: Held by each round of the stand-in kubelets; ``pods_held`` takes it to stop them between rounds.
        self._kubelet_round = threading.Lock()
        self._pods_held = False
        self._kubelet = threading.Thread(target=self._kubelets, daemon=True, name="contract-kubelets")
        self._kubelet.start()

    # -- nodes ----------------------------------------------------------------------------
    def add_node(self, name: str, site: str = "site-a", gpus: int = 8, ready: bool = True,
                 machine_id: str = "", boot_id: str = "boot-1") -> None:
        made = _ok(self.real.request("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, LABEL_SITE: site,
                                                  LABEL_PROVIDER: "sim"}},
            "spec": {"providerID": f"sim:///zone-1/{machine_id or f'm-{name}'}"}}, admin=True), 201)
        self.nodes[name] = made["metadata"]["uid"]
        resources = {GPU_RESOURCE: str(gpus), "cpu": "64", "memory": "256Gi", "pods": "110"}
        _ok(self.real.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": {
            "capacity": resources, "allocatable": resources, "conditions": [self._ready(ready)],
            "nodeInfo": {"bootID": boot_id, "machineID": machine_id or name, "systemUUID": machine_id or name,
                         "architecture": "amd64", "operatingSystem": "linux", "kubeletVersion": "v1.34.0",
                         "containerRuntimeVersion": "containerd://2.0.0", "kernelVersion": "6.8.0",
                         "osImage": "Ubuntu 24.04", "kubeProxyVersion": ""}}}, admin=True, content_type=MERGE), 200)
        if ready:
            # The API server's admission taints a new Node not-ready; the node lifecycle controller
            # lifts that once it sees the Ready condition (well under a second).
            deadline = time.monotonic() + 30
            while any(t["key"].startswith("node.kubernetes.io/") for t in self._node(name)["spec"].get("taints") or []):
                assert time.monotonic() < deadline, f"the controller kept {name} tainted: {self._node(name)}"
                time.sleep(0.05)

    @staticmethod
    def _ready(ready: bool) -> dict[str, str]:
        return {"type": "Ready", "status": "True" if ready else "False",
                "reason": "KubeletReady" if ready else "KubeletNotReady",
                "lastHeartbeatTime": now(), "lastTransitionTime": now()}

    def _node(self, name: str) -> dict[str, Any]:
        return _ok(self.real.request("GET", f"/api/v1/nodes/{name}", admin=True), 200)

    def set_ready(self, name: str, ready: bool) -> None:
        _ok(self.real.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": {"conditions": [self._ready(ready)]}},
                              admin=True, content_type=MERGE), 200)

    # -- pods -----------------------------------------------------------------------------
    def _owner(self, kind: str, namespace: str, node: str) -> dict[str, Any]:
        """A real object of ``kind`` a pod can name as its owner (not its controller)."""
        if kind == "Node":  # its controller: NodeRestriction lets a node own its mirror pods only so
            return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": self.nodes[node], "controller": True}
        key = (kind, namespace)
        if key not in self.owners:
            api_version, path = OWNER_API[kind]
            name = f"owner-{kind.lower()}-{self.namespace}"
            labels = {"contract.gpufleet.io/owner": name}  # no pod of the tests carries it
            template = {"metadata": {"labels": labels}, "spec": {
                "containers": [{"name": "c", "image": "registry.invalid/owner:1"}]}}
            spec: dict[str, Any] = {"selector": {"matchLabels": labels}, "template": template}
            if kind == "ReplicaSet":
                spec["replicas"] = 0
            elif kind == "DaemonSet":
                template["spec"]["nodeSelector"] = {"contract.gpufleet.io/nowhere": "true"}
            else:  # a suspended Job runs nothing; its selector is its own
                template["spec"]["restartPolicy"] = "Never"
                spec = {"suspend": True, "template": template}
            made = _ok(self.real.request("POST", path.format(ns=namespace), {
                "apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": namespace},
                "spec": spec}, admin=True), 201)
            self.owners[key] = {"apiVersion": api_version, "kind": kind, "name": name,
                                "uid": made["metadata"]["uid"], "controller": False, "_path": path.format(ns=namespace)}
        return {k: v for k, v in self.owners[key].items() if not k.startswith("_")}

    def add_pod(self, node: str, name: str, namespace: str = "default", labels: dict | None = None,
                owner_kind: str = "ReplicaSet", mirror: bool = False, terminating_seconds: float = 0,
                gpus: int = 0) -> None:
        meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels or {}, "annotations": {}}
        if owner_kind:
            meta["ownerReferences"] = [self._owner(owner_kind, namespace, node)]
        if mirror:
            meta["annotations"]["kubernetes.io/config.mirror"] = "mirror-hash"
        if terminating_seconds:
            meta["annotations"][TERMINATING_ANNOTATION] = str(terminating_seconds)
        spec: dict[str, Any] = {"nodeName": node, "automountServiceAccountToken": False,
                                "containers": [{"name": "c", "image": "registry.invalid/app:1"}]}
        if gpus:  # held on the node, as the scheduler counts them
            spec["containers"][0]["resources"] = {"limits": {GPU_RESOURCE: str(gpus)}}
        if not mirror:
            spec["serviceAccountName"] = "default"
        # No grace unless asked: a pod ends as soon as it is evicted (its kubelet says so at once).
        spec["terminationGracePeriodSeconds"] = 30 if terminating_seconds else 0
        # A mirror pod is made by its node's kubelet, as ``system:node:<node>`` (the admin
        # impersonates it): what NodeRestriction lets a node write, and nothing more. One that the
        # shipped mirror-pod policy refuses a node (labelled as gpufleet's) is made by the admin:
        # what a cluster without that policy lets a node make, which the adapter must still read
        # as the node's own (tests/realk8s/test_mirror_pods.py tries the node's refusal).
        as_node = ({"Impersonate-User": f"system:node:{node}", "Impersonate-Group": "system:nodes"}
                   if mirror and not node_pod_refusal(namespace, meta["labels"]) else None)
        _ok(self.real.request("POST", f"/api/v1/namespaces/{namespace}/pods",
                              {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}, admin=True,
                              headers=as_node), 201)
        self.pod_keys.append((namespace, name))
        self._report_running(namespace, name)

    def _report_running(self, namespace: str, name: str) -> None:
        """What a kubelet reports of a pod whose containers started and passed their probes (a
        Pending pod's eviction ignores every PodDisruptionBudget on a real server)."""
        status, answer = self.real.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": {
            "phase": "Running", "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now()}]}},
            admin=True, content_type=MERGE)
        assert status in (200, 404), answer  # 404: deleted meanwhile

    @contextmanager
    def pods_held(self) -> Iterator[None]:
        """The stand-in kubelets start no pod meanwhile (they end deleted ones still), as a node
        pulling a large image would not: what a test reads right after a write is then the state
        before any replica ran, however slow the loaded machine made the write."""
        with self._kubelet_round:  # the round in progress ends first
            self._pods_held = True
        try:
            yield
        finally:
            self._pods_held = False

    def _kubelets(self) -> None:
        """The harness's Nodes' kubelets: start each pod bound to one of them, end each deleted."""
        while not self._stop.wait(0.2):
            with self._kubelet_round:
                self._kubelet_round_once()

    def _kubelet_round_once(self) -> None:
        try:
            status, pods = self.real.request("GET", "/api/v1/pods", admin=True)
        except OSError:
            return
        if status != 200:
            return
        for pod in pods["items"]:
            meta, spec = pod["metadata"], pod["spec"]
            if spec.get("nodeName") not in self.nodes:
                continue
            namespace, name = meta["namespace"], meta["name"]
            if meta.get("deletionTimestamp"):
                seconds = float((meta.get("annotations") or {}).get(TERMINATING_ANNOTATION, 0))
                ends = self._ending.setdefault(meta["uid"], time.monotonic() + seconds)
                if time.monotonic() >= ends:
                    self.real.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                                      {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                                       "preconditions": {"uid": meta["uid"]}}, admin=True)
            elif (pod.get("status") or {}).get("phase", "Pending") == "Pending" and not self._pods_held:
                self._report_running(namespace, name)

    def pods(self, node: str) -> list[PodInfo]:
        """The pods on ``node``, less those of the cluster's own DaemonSets the test did not add:
        the shipped node agent runs on every gpufleet node (and a drain leaves it, as it must)."""
        listed = _ok(self.real.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{node}", admin=True), 200)
        return [PodInfo(namespace=p["metadata"]["namespace"], name=p["metadata"]["name"]) for p in listed["items"]
                if (p["metadata"]["namespace"], p["metadata"]["name"]) in self.pod_keys
                or not any(o.get("kind") == "DaemonSet" for o in p["metadata"].get("ownerReferences") or [])]

    # -- budgets --------------------------------------------------------------------------
    def set_pdb(self, namespace: str, name: str, selector: dict, min_available: int | None = None,
                max_unavailable: int | None = None) -> None:
        self.delete_pdb(namespace, name)
        spec: dict[str, Any] = {"selector": {"matchLabels": selector}}
        if min_available is not None:
            spec["minAvailable"] = min_available
        if max_unavailable is not None:
            spec["maxUnavailable"] = max_unavailable
        path = f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets"
        _ok(self.real.request("POST", path, {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                                             "metadata": {"name": name, "namespace": namespace}, "spec": spec},
                              admin=True), 201)
        self.pdbs.append((namespace, name))
        # The disruption controller's first look at the budget, which an eviction waits for.
        deadline = time.monotonic() + 30
        while True:
            pdb = _ok(self.real.request("GET", f"{path}/{name}", admin=True), 200)
            if (pdb.get("status") or {}).get("observedGeneration", 0) >= pdb["metadata"]["generation"]:
                return
            assert time.monotonic() < deadline, f"the disruption controller did not observe {name}: {pdb}"
            time.sleep(0.05)

    def delete_pdb(self, namespace: str, name: str) -> None:
        status, answer = self.real.request("DELETE", f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}",
                                           admin=True)
        assert status in (200, 404), answer

    def take_bootstrap_token(self, machine_id: str) -> str | None:
        return self.cluster.take_bootstrap_token(machine_id)

    # -- the end --------------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        self._kubelet.join(5)
        self.cluster.api_client.close()
        grace0 = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}
        for namespace, name in self.pod_keys:
            self.real.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", grace0, admin=True)
        for namespace, name in self.pdbs:
            self.delete_pdb(namespace, name)
        for owner in self.owners.values():
            self.real.request("DELETE", f"{owner['_path']}/{owner['name']}", admin=True)
        # The namespace takes its state, Deployments, Services and routing objects with it; its
        # pods (a serving Deployment's) are deleted here and now, before the nodes: one still
        # Pending would be scheduled on the next test's node of the same name, and one bound to
        # a node deleted under it would show on that next node (the pod GC takes a minute).
        self.real.request("DELETE", f"/api/v1/namespaces/{self.namespace}", admin=True)
        pods = f"/api/v1/namespaces/{self.namespace}/pods"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, listed = self.real.request("GET", pods, admin=True)
            left = [p["metadata"]["name"] for p in (listed.get("items") or [])] if status == 200 else []
            if not left:
                break
            for name in left:
                self.real.request("DELETE", f"{pods}/{name}", grace0, admin=True)
            time.sleep(0.1)
        for name in self.nodes:
            self.real.request("DELETE", f"/api/v1/nodes/{name}", admin=True)
