"""What only the Kubernetes adapter has, against the real API server: the objects it writes and
how it writes them (bootstrap-token Secrets, patch types, ``resourceVersion`` preconditions,
write counts), drains through the real Eviction API, and how a real refusal maps to gpufleet's
errors (a 422, a 403) at the activity boundary and through Temporal; kubelet CSRs made as the
node (impersonated) judged by gpufleet's approver, and the keys it binds (issue 35's finding 3);
the network model's objects (a Service that prefers the caller's zone, a site as a zone label).
The adapter runs as the control-plane service account (the shipped RBAC), or as one bound to its
roles less one rule.

Moved from ``tests/cluster/``'s ``test_kubernetes_adapter.py``, ``test_cluster_errors.py``,
``test_csr_key_binding.py``, ``test_csr_renewals.py`` and ``test_network.py`` (issue 33). Nodes here are Node objects
the admin writes with a fresh Ready condition (no kubelet behind them; each test is over long
before the node lifecycle controller's grace ends); pods are bound to them by ``nodeName`` and
deleted at once (``terminationGracePeriodSeconds: 0``: no kubelet confirms a graceful end here).
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from urllib.parse import quote

import pytest
from temporalio import workflow
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.testing import ActivityEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.capacity import CapacityActivities
from activities.env import FleetEnv
from fleet.cluster import (
    ANNOTATION_PREVIOUS_TEMPLATE,
    ANNOTATION_TEMPLATE,
    FLEET_TAINT_KEY,
    GPU_RESOURCE,
    LABEL_GPU_PRODUCT,
    LABEL_MODEL,
    LABEL_REGION,
    LABEL_SITE,
    LABEL_ZONE,
    UNPROVEN_TAINT,
    ServingSpec,
)
from fleet.config import load_config
from fleet.errors import BadCredentials, ClusterForbidden, ClusterInvalid
from fleet.messages.capacity import SiteNode, SiteNodesInput
from fleet.naming import MAX_SITE_NAME, label_value_problem, node_name_for, site_name_problem
from fleet.rollout import ENV_NAME, WeightFile
from fleet.settings import Settings
from fleet.cluster import NODE_KEYS_KEPT, NODE_KEYS_KIND, NodeIdentity, bound_keys
from providers.cluster.base import CONTROL_PLANE_LABEL, SERVING_SIGNER, serving_labels, serving_name
from providers.cluster.check import KUBEADM_BINDINGS
from providers.cluster.kubernetes import NODE_IDENTITY_KIND, KubernetesCluster, bootstrap_secret_name, render_pod_template
from providers.cluster.kubernetes.api import _canonical
from providers.cluster.kubernetes.csrs import RENEWALS_PER_WINDOW, SERVING_PER_WINDOW
from tests.cluster.sim_kubelet import csr_pem, unreadable_csr_pem
from tests.cluster.test_manifests import largest_manifest, rollout_spec
from tests.cluster.test_csr_renewals import renewal
from tests.conftest import write_fleet
from tests.realk8s.test_blast_radius import kubeadm_bindings_restored  # noqa: F401 - a fixture
from tests.realk8s.cluster import RealCluster
from tests.realk8s.test_join import wait_for
from tests.realk8s.test_adapter import _post, control_plane_less, kube, record_requests, unique  # noqa: F401

BOOTSTRAP_NS = "gpufleet-bootstrap"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _data(secret: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def _get(real: RealCluster, path: str) -> dict | None:
    status, answer = real.request("GET", path, admin=True)
    assert status in (200, 404), answer
    return answer if status == 200 else None


def _secret(real: RealCluster, namespace: str, name: str) -> dict | None:
    return _get(real, f"/api/v1/namespaces/{namespace}/secrets/{name}")


def _node(real: RealCluster, name: str) -> dict:
    return _get(real, f"/api/v1/nodes/{name}")


def _writes(seen, fragment: str, taken: bool = False) -> list[str]:
    """The writes sent to paths containing ``fragment``, a refused one (409) included; ``taken``:
    only those the API server took (a 409 lost to another writer, such as the deployment
    controller stamping its revision, is one the adapter reads again and retries)."""
    return [request[0] for request in seen if request[0] in ("POST", "PUT", "PATCH", "DELETE")
            and fragment in request[1] and not (taken and request.status == 409)]


@pytest.fixture
def nodes(real_cluster: RealCluster):
    """Adds Node objects as a kubelet registers them (a Ready condition, GPUs allocatable); all
    deleted afterwards."""
    made: list[str] = []

    def add(name: str, labels: dict | None = None, *, provider_id: str = "", annotations: dict | None = None,
            taints: list[dict] | None = None) -> str:
        spec = {**({"providerID": provider_id} if provider_id else {}), **({"taints": taints} if taints else {})}
        resources = {GPU_RESOURCE: "8", "cpu": "8", "memory": "64Gi", "pods": "110"}
        _post(real_cluster, "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node", "spec": spec,
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                         "annotations": annotations or {}}})
        made.append(name)
        status, answer = real_cluster.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": {
            "capacity": resources, "allocatable": resources, "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": _now(),
                 "lastTransitionTime": _now()}]}}, admin=True, content_type="application/merge-patch+json")
        assert status == 200, answer
        # The node lifecycle controller taints a new Node not-ready until it sees it Ready; the
        # tests start from a node the controller is done with, as a registered kubelet's is.
        deadline = time.monotonic() + 30
        while any(t["key"].startswith("node.kubernetes.io/")
                  for t in _node(real_cluster, name)["spec"].get("taints") or []):
            assert time.monotonic() < deadline, f"the controller kept {name} tainted: {_node(real_cluster, name)}"
            time.sleep(0.2)
        return name

    yield add
    for name in made:
        real_cluster.request("DELETE", f"/api/v1/nodes/{name}", admin=True)


@pytest.fixture
def namespace(real_cluster: RealCluster, unique):
    name = f"drain-{unique}"
    _post(real_cluster, "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    real_cluster.request("DELETE", f"/api/v1/namespaces/{name}", admin=True)


def _running_pod(real: RealCluster, namespace: str, node: str, name: str, labels: dict | None = None,
                 owner: dict | None = None) -> None:
    """A pod bound to ``node`` and Running, as its kubelet would report it (a Pending pod's
    eviction ignores every PodDisruptionBudget on a real server)."""
    meta = {"name": name, "namespace": namespace, "labels": labels or {}}
    if owner:
        meta["ownerReferences"] = [owner]
    _post(real, f"/api/v1/namespaces/{namespace}/pods", {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {
        "nodeName": node, "terminationGracePeriodSeconds": 0, "tolerations": [{"operator": "Exists"}],
        "containers": [{"name": "main", "image": "registry.invalid/app:1"}]}})
    status, answer = real.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": {
        "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
        admin=True, content_type="application/merge-patch+json")
    assert status == 200, answer


# -- join tokens -------------------------------------------------------------------------
def test_join_token_is_a_bootstrap_token_secret(real_cluster, kube, unique):
    before = datetime.now(timezone.utc)
    machine = f"i-0ABC_{unique}"
    ref = kube.create_join_token(f"gpu-{unique}", machine, 3600)
    try:
        secret = _secret(real_cluster, "kube-system", f"bootstrap-token-{ref.token_id}")
        assert secret["type"] == "bootstrap.kubernetes.io/token"
        data = _data(secret)
        assert data["token-id"] == ref.token_id
        assert re.fullmatch(r"[a-z0-9]{16}", data["token-secret"])
        assert data["usage-bootstrap-authentication"] == "true"
        assert data["usage-bootstrap-signing"] == "true"
        assert data["auth-extra-groups"].startswith("system:bootstrappers:")
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", data["expiration"])
        expiration = datetime.fromisoformat(data["expiration"].replace("Z", "+00:00"))
        assert expiration == ref.expires_at
        assert expiration <= before + timedelta(hours=1, seconds=1)
        # The bootstrap channel holds the full token; the workflow's ref does not.
        channel = _secret(real_cluster, BOOTSTRAP_NS, bootstrap_secret_name(machine))
        assert bootstrap_secret_name("i-0ABC_1") == "gpufleet-bootstrap-i-0abc-1"
        assert _data(channel)["token"] == f"{ref.token_id}.{data['token-secret']}"
        assert _data(channel)["node-name"] == f"gpu-{unique}"
        assert channel["metadata"]["labels"]["gpufleet.io/token-id"] == ref.token_id
        assert data["token-secret"] not in ref.model_dump_json()
    finally:
        kube.revoke_join_token(ref.token_id)


def test_revoke_deletes_both_secrets(real_cluster, kube, unique):
    machine = f"m-{unique}"
    ref = kube.create_join_token(f"gpu-{unique}", machine, 600)
    kube.revoke_join_token(ref.token_id)
    assert _secret(real_cluster, "kube-system", f"bootstrap-token-{ref.token_id}") is None
    assert _secret(real_cluster, BOOTSTRAP_NS, bootstrap_secret_name(machine)) is None
    kube.revoke_join_token(ref.token_id)  # 404s are success
    with pytest.raises(ValueError):
        kube.revoke_join_token("../../x")


def test_a_new_token_for_the_same_machine_supersedes_the_old(real_cluster, kube, unique):
    machine = f"m-{unique}"
    old = kube.create_join_token(f"gpu-{unique}", machine, 600)
    new = kube.create_join_token(f"gpu-{unique}", machine, 600)
    assert old.token_id != new.token_id
    assert _secret(real_cluster, "kube-system", f"bootstrap-token-{old.token_id}") is None
    assert _secret(real_cluster, "kube-system", f"bootstrap-token-{new.token_id}") is not None
    assert kube.take_bootstrap_token(machine).startswith(f"{new.token_id}.")
    assert _secret(real_cluster, BOOTSTRAP_NS, bootstrap_secret_name(machine)) is None
    kube.revoke_join_token(new.token_id)


def test_bootstrap_fetch_is_once_even_when_raced(real_cluster, kube, unique, monkeypatch):
    machine = f"m-{unique}"
    ref = kube.create_join_token(f"gpu-{unique}", machine, 600)
    name = bootstrap_secret_name(machine)
    # Someone replaces the channel between our read and delete: the real API server refuses the
    # delete's resourceVersion precondition, and we hand out nothing rather than a stale token.
    real_delete = kube.core.delete_namespaced_secret

    def replaced_meanwhile(secret_name, namespace, **kwargs):
        if secret_name == name:
            status, answer = real_cluster.request(
                "PATCH", f"/api/v1/namespaces/{namespace}/secrets/{name}",
                {"metadata": {"annotations": {"example.com/replaced": "yes"}}}, admin=True,
                content_type="application/merge-patch+json")
            assert status == 200, answer
        return real_delete(secret_name, namespace, **kwargs)

    monkeypatch.setattr(kube.core, "delete_namespaced_secret", replaced_meanwhile)
    assert kube.take_bootstrap_token(machine) is None
    monkeypatch.undo()
    assert _secret(real_cluster, BOOTSTRAP_NS, name) is not None, "the replaced channel is left alone"
    kube.revoke_join_token(ref.token_id)


# -- nodes ------------------------------------------------------------------------------------
def test_label_patch_is_a_merge_and_a_repeat_writes_nothing(real_cluster, kube, nodes, unique):
    name = nodes(f"gpu-{unique}", {"team": "infra"})
    seen = record_requests(kube)
    kube.label_node(name, {"gpufleet.io/state": "proving"})
    version = _node(real_cluster, name)["metadata"]["resourceVersion"]
    kube.label_node(name, {"gpufleet.io/state": "proving"})
    node = _node(real_cluster, name)
    assert node["metadata"]["resourceVersion"] == version
    assert node["metadata"]["labels"]["team"] == "infra"
    assert _writes(seen, "/nodes/") and all(m == "PATCH" for m in _writes(seen, "/nodes/"))


def test_taints_keep_foreign_taints_and_their_fields(real_cluster, kube, nodes, unique):
    foreign = {"key": "example.com/foreign", "effect": "NoExecute", "timeAdded": "2024-01-01T00:00:00Z"}
    name = nodes(f"gpu-{unique}", taints=[foreign])
    node = kube.set_taints(name, add=[UNPROVEN_TAINT])
    assert node.taints == ["example.com/foreign:NoExecute", UNPROVEN_TAINT]
    stored = _node(real_cluster, name)["spec"]["taints"]
    assert stored[0] == foreign
    assert stored[1] == {"key": "gpufleet.io/unproven", "effect": "NoSchedule"}
    seen = record_requests(kube)
    kube.set_taints(name, add=[UNPROVEN_TAINT])
    assert _writes(seen, "/nodes/") == []  # nothing to change, nothing written
    kube.set_taints(name, remove=[UNPROVEN_TAINT, "example.com/foreign:NoExecute"])
    assert "taints" not in _node(real_cluster, name)["spec"]


def test_taints_retry_on_a_conflicting_writer(real_cluster, kube, nodes, unique, monkeypatch):
    name = nodes(f"gpu-{unique}")
    real_patch = kube.core.patch_node
    raced = []

    def other_writer_first(node_name, body, **kwargs):
        if not raced:
            raced.append(1)
            status, answer = real_cluster.request(
                "PATCH", f"/api/v1/nodes/{node_name}", {"spec": {"taints": [{"key": "other", "effect": "NoSchedule"}]}},
                admin=True, content_type="application/merge-patch+json")
            assert status == 200, answer
        return real_patch(node_name, body, **kwargs)

    monkeypatch.setattr(kube.core, "patch_node", other_writer_first)
    seen = record_requests(kube)
    node = kube.set_taints(name, add=[UNPROVEN_TAINT])
    assert sorted(node.taints) == sorted(["other:NoSchedule", UNPROVEN_TAINT])
    assert _writes(seen, f"/nodes/{name}") == ["PATCH", "PATCH"], "refused once (409), then written"


def test_cordon_patches_spec_unschedulable(real_cluster, kube, nodes, unique):
    name = nodes(f"gpu-{unique}")
    kube.cordon(name)
    assert _node(real_cluster, name)["spec"]["unschedulable"] is True
    kube.cordon(name, False)
    assert not _node(real_cluster, name)["spec"].get("unschedulable")


def test_a_cordon_and_who_made_it_are_one_patch(real_cluster, kube, nodes, unique):
    """The demand loop's drain marks its cordon in the same write (never a cordoned node unmarked
    between two); an uncordon drops the mark with it, so a later ``kubectl cordon`` is a person's."""
    from fleet.cluster import ANNOTATION_CORDONED_BY, CORDONED_BY_DEMAND

    name = nodes(f"gpu-{unique}")
    seen = record_requests(kube)
    kube.cordon(name, by=CORDONED_BY_DEMAND)
    assert _writes(seen, f"/nodes/{name}") == ["PATCH"]
    stored = _node(real_cluster, name)
    assert stored["spec"]["unschedulable"] is True
    assert stored["metadata"]["annotations"][ANNOTATION_CORDONED_BY] == CORDONED_BY_DEMAND
    kube.cordon(name, False)
    stored = _node(real_cluster, name)
    assert not stored["spec"].get("unschedulable")
    assert ANNOTATION_CORDONED_BY not in (stored["metadata"].get("annotations") or {})


def test_a_fence_cordons_the_node_and_lifting_the_last_uncordons(real_cluster, kube, nodes, unique, tmp_path):
    """Contain first, against the API server: the Node entity's ``fence_gpu`` writes the fence
    and the cordon; ``uncontain_gpu`` lifts them, uncordoning only when no GPU is fenced."""
    from fleet.messages.nodes import FenceInput, UncontainInput
    from activities.repair import RepairActivities, fence_key
    from fleet.cluster import FENCE_ON_HOLD

    name = nodes(f"gpu-{unique}")
    repair = RepairActivities(FleetEnv(Settings(state_dir=tmp_path), load_config(write_fleet(tmp_path)), kube))
    ActivityEnvironment().run(repair.fence_gpu, FenceInput(node_name=name, gpu=0, rung="reset"))
    ActivityEnvironment().run(repair.fence_gpu, FenceInput(node_name=name, gpu=1, rung="reboot"))
    stored = _node(real_cluster, name)
    assert stored["spec"].get("unschedulable") is True
    assert {k: v for k, v in stored["metadata"]["annotations"].items() if k.startswith("gpufleet.io/fenced")} == {
        fence_key(0): "reset" + FENCE_ON_HOLD, fence_key(1): "reboot" + FENCE_ON_HOLD}  # the entity's, until a repair's
    first = ActivityEnvironment().run(repair.uncontain_gpu, UncontainInput(node_name=name, gpu=0))
    assert (first.uncordoned, first.still_fenced) == (False, [1])
    assert _node(real_cluster, name)["spec"].get("unschedulable") is True
    last = ActivityEnvironment().run(repair.uncontain_gpu, UncontainInput(node_name=name, gpu=1))
    assert last.uncordoned and not _node(real_cluster, name)["spec"].get("unschedulable")


def test_a_node_written_machine_id_annotation_is_ignored(kube, nodes, unique):
    """The kubelet may write its Node's annotations: no machine id comes from there."""
    name = nodes(f"gpu-{unique}", annotations={"gpufleet.io/machine-id": "m-annotated"},
                 provider_id="aws:///us-east-1a/i-0abc")
    assert kube.get_node(name).machine_id == "i-0abc"


def test_the_identity_record_names_the_machine(kube, nodes, unique):
    from fleet.cluster import NODE_IDENTITY_KIND, NodeIdentity, gpufleet_provider_id

    name = f"gpu-{unique}"
    provider_id = gpufleet_provider_id("aws", "acct-1", name)
    nodes(name, {LABEL_SITE: f"elsewhere-{unique}"}, annotations={"gpufleet.io/machine-id": "someone-elses"},
          provider_id=provider_id)
    assert kube.get_node(name).machine_id == "", "a gpufleet providerID names no provider id"
    identity = NodeIdentity(node_name=name, machine_id="i-0real", provider="aws", account="acct-1",
                            site="aws-use1", provider_id=provider_id)
    kube.update_state(NODE_IDENTITY_KIND, name, lambda _old: identity.state())
    try:
        for node in (kube.get_node(name), *kube.list_nodes({LABEL_SITE: f"elsewhere-{unique}"})):
            assert (node.machine_id, node.site, node.provider, node.account) == ("i-0real", "aws-use1", "aws", "acct-1")
    finally:
        kube.delete_state(NODE_IDENTITY_KIND, name)


# -- drain ------------------------------------------------------------------------------------
def test_drain_uses_the_eviction_api_and_lists_by_field_selector(real_cluster, kube, nodes, namespace, unique):
    name = nodes(f"gpu-{unique}")
    # A real DaemonSet (placing nothing: no node has its label) that the pod names as its owner,
    # so the garbage collector keeps the pod; not its controller, so the DaemonSet leaves it be.
    daemonset = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "ds", "namespace": namespace},
                 "spec": {"selector": {"matchLabels": {"app": "ds"}}, "template": {
                     "metadata": {"labels": {"app": "ds"}}, "spec": {
                         "nodeSelector": {"example.com/nowhere": "true"},
                         "containers": [{"name": "main", "image": "registry.invalid/ds:1"}]}}}}
    status, made = real_cluster.request("POST", f"/apis/apps/v1/namespaces/{namespace}/daemonsets", daemonset,
                                        admin=True)
    assert status == 201, made
    owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": made["metadata"]["uid"],
             "controller": False}
    _running_pod(real_cluster, namespace, name, "web-1")
    _running_pod(real_cluster, namespace, name, "ds-1", owner=owner)
    seen = record_requests(kube)
    assert kube.drain_node(name, deadline_s=10).completed
    on_pods = {(method, path.rsplit("/", 1)[-1]) for method, path, _ in seen if "/pods" in path}
    assert on_pods == {("GET", "pods"), ("POST", "eviction")}, seen
    assert all("fieldSelector=spec.nodeName" in query for method, path, query in seen
               if method == "GET" and path.endswith("/pods")), seen
    assert _get(real_cluster, f"/api/v1/namespaces/{namespace}/pods/ds-1") is not None
    assert _get(real_cluster, f"/api/v1/namespaces/{namespace}/pods/web-1") is None


def test_drain_with_two_pdbs_reports_the_server_message(real_cluster, kube, nodes, namespace, unique):
    name = nodes(f"gpu-{unique}")
    _running_pod(real_cluster, namespace, name, "web-1", labels={"app": "web", "tier": "a"})
    for pdb, selector in (("pdb-1", {"app": "web"}), ("pdb-2", {"tier": "a"})):
        _post(real_cluster, f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets", {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": pdb},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}}})
    result = kube.drain_node(name, deadline_s=1)
    assert not result.completed
    assert "more than one PodDisruptionBudget" in result.blocked[0].reason, result.blocked


# -- serving ----------------------------------------------------------------------------------
@pytest.fixture
def serving_cleanup(real_cluster: RealCluster):
    names: list[str] = []
    yield names
    for name in names:
        real_cluster.request("DELETE", f"/apis/apps/v1/namespaces/gpufleet/deployments/{name}", admin=True)
        real_cluster.request("DELETE", f"/api/v1/namespaces/gpufleet/services/{name}", admin=True)


def _within(written, stored) -> bool:
    """Every field of ``written`` is in ``stored`` with the same value (lists item by item)."""
    if isinstance(written, dict):
        return isinstance(stored, dict) and all(k in stored and _within(v, stored[k]) for k, v in written.items())
    if isinstance(written, list):
        return isinstance(stored, list) and len(written) == len(stored) and all(
            _within(w, s) for w, s in zip(written, stored))
    return written == stored


def _deployment(real: RealCluster, name: str) -> dict:
    return _get(real, f"/apis/apps/v1/namespaces/gpufleet/deployments/{name}")


def test_serving_objects(real_cluster, kube, unique, serving_cleanup):
    model, site = f"llama-{unique}", f"site-{unique}"
    spec = ServingSpec(model=model, site=site, image="vllm:0.6", replicas=2, gpus_per_replica=4,
                       args=["--tp", "4"], weights_path="/models/llama", env={"HF_HOME": "/cache"})
    serving_cleanup.append(f"{model}-{site}")
    kube.apply_serving(spec)
    deployment = _deployment(real_cluster, f"{model}-{site}")
    labels = {LABEL_MODEL: model, LABEL_SITE: site}
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {LABEL_SITE: site}
    (container,) = pod["containers"]
    assert container["image"] == "vllm:0.6" and container["args"] == ["--tp", "4"]
    assert container["resources"]["limits"][GPU_RESOURCE] == "4" == container["resources"]["requests"][GPU_RESOURCE]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"MODEL_NAME": model, "MODEL_WEIGHTS": "/models/llama", "HF_HOME": "/cache"}
    assert container["volumeMounts"] == [{"name": "weights", "mountPath": "/models/llama", "readOnly": True}]
    assert pod["volumes"][0]["hostPath"]["path"] == "/models/llama"
    # The annotation is the template as gpufleet wrote it; the stored one is that, plus only the
    # real API server's defaults (imagePullPolicy, terminationMessagePath, ...).
    written = json.loads(deployment["metadata"]["annotations"][ANNOTATION_TEMPLATE])
    assert _within(written, deployment["spec"]["template"]), (written, deployment["spec"]["template"])
    assert written["spec"]["containers"][0]["image"] == "vllm:0.6"
    service = _get(real_cluster, f"/api/v1/namespaces/gpufleet/services/{model}-{site}")
    assert service["spec"]["selector"] == labels
    assert service["spec"]["ports"][0]["port"] == 8000


#: Where the ServiceAccount admission plugin mounts a pod's token.
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def token_mounts(pod: dict) -> list[str]:
    """What of ``pod`` (as stored, after admission) holds its service account's token: each volume
    projecting one, each container mounting one at the token's path."""
    spec = pod["spec"]
    volumes = [v["name"] for v in spec.get("volumes") or []
               if any("serviceAccountToken" in source for source in (v.get("projected") or {}).get("sources") or [])]
    mounts = [f"{c['name']}:{m['mountPath']}" for c in [*spec.get("initContainers", []), *spec["containers"]]
              for m in c.get("volumeMounts") or [] if m["mountPath"] == TOKEN_PATH]
    return volumes + mounts


def _pods_of(real: RealCluster, model: str, site: str, image: str) -> list[dict]:
    """The pods the Deployment controller made for a model at a site, running ``image``."""
    selector = ",".join(f"{k}={v}" for k, v in serving_labels(model, site).items())
    listed = _get(real, f"/api/v1/namespaces/gpufleet/pods?labelSelector={quote(selector)}")
    return [p for p in listed["items"] if p["spec"]["containers"][0]["image"] == image]


def test_a_model_servers_pods_hold_no_service_account_token(real_cluster, kube, unique, serving_cleanup):
    """A model server calls no Kubernetes API, runs third-party model code, and runs on a GPU node,
    which may be hostile: its pods mount no service-account token. The Deployment the adapter
    writes says so, as the real API server stores it; the pods the real Deployment controller
    makes from it pass the real ServiceAccount admission plugin (which mounts the token into a
    pod that does not say so: asked here as a dry run) without one. A rollback to a template
    written before (which did not say so) brings no token back; the annotation keeps that
    template as written, the name a rollout knows it by. (Old code: the token was mounted.)"""
    model, site = f"m-{unique}", f"site-{unique}"
    name = serving_name(model, site)
    serving_cleanup.append(name)
    spec = ServingSpec(model=model, site=site, image="img:2")
    kube.apply_serving(spec)
    template = _deployment(real_cluster, name)["spec"]["template"]
    assert template["spec"]["automountServiceAccountToken"] is False
    pods = wait_for(lambda: _pods_of(real_cluster, model, site, "img:2"), 60, "the Deployment's pod")
    assert token_mounts(pods[0]) == [], "no token in a model server's pod"
    # The plugin runs on this server: the same pod, not saying so, is given the token.
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"bare-{unique}"},
            "spec": {k: v for k, v in template["spec"].items() if k != "automountServiceAccountToken"}}
    status, admitted = real_cluster.request("POST", "/api/v1/namespaces/gpufleet/pods?dryRun=All", bare, admin=True)
    assert status == 201, admitted
    assert len(token_mounts(admitted)) == 2, admitted["spec"]

    # A Deployment whose template before was written by the code before this one: the token mounted.
    before = render_pod_template(spec.model_copy(update={"image": "img:1"}))
    del before["spec"]["automountServiceAccountToken"]
    status, answer = real_cluster.request(
        "PATCH", f"/apis/apps/v1/namespaces/gpufleet/deployments/{name}",
        {"metadata": {"annotations": {ANNOTATION_PREVIOUS_TEMPLATE: _canonical(before)}}},
        admin=True, content_type="application/merge-patch+json")
    assert status == 200, answer
    kube.rollback_serving(model, site)
    deployment = _deployment(real_cluster, name)
    assert deployment["metadata"]["annotations"][ANNOTATION_TEMPLATE] == _canonical(before)
    assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "img:1"
    pods = wait_for(lambda: _pods_of(real_cluster, model, site, "img:1"), 60, "the rolled-back pod")
    assert token_mounts(pods[0]) == [], "no token after a rollback either"


def test_update_and_rollback_keep_templates_in_annotations(real_cluster, kube, unique, serving_cleanup):
    model, site = f"m-{unique}", f"site-{unique}"
    name = f"{model}-{site}"
    serving_cleanup.append(name)
    spec = ServingSpec(model=model, site=site, image="img:1")
    seen = record_requests(kube)
    kube.apply_serving(spec)
    assert _writes(seen, "/deployments") == ["POST"]
    kube.apply_serving(spec)
    # Nothing changed, nothing written: the real API server's defaults in the stored template
    # (imagePullPolicy, terminationMessagePath, ...) are no change of gpufleet's.
    assert _writes(seen, "/deployments") == ["POST"]
    kube.apply_serving(spec.model_copy(update={"image": "img:2"}))
    deployment = _deployment(real_cluster, name)
    previous = json.loads(deployment["metadata"]["annotations"][ANNOTATION_PREVIOUS_TEMPLATE])
    assert previous["spec"]["containers"][0]["image"] == "img:1"
    kube.rollback_serving(model, site)
    deployment = _deployment(real_cluster, name)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "img:1"
    assert _writes(seen, "/deployments", taken=True) == ["POST", "PUT", "PUT"]


def test_foreign_changes_to_the_deployment_survive_apply(real_cluster, kube, unique, serving_cleanup):
    model, site = f"m-{unique}", f"site-{unique}"
    name = f"{model}-{site}"
    serving_cleanup.append(name)
    spec = ServingSpec(model=model, site=site, image="img:1")
    kube.apply_serving(spec)
    status, answer = real_cluster.request(
        "PATCH", f"/apis/apps/v1/namespaces/gpufleet/deployments/{name}",
        {"metadata": {"annotations": {"argocd.argoproj.io/sync": "x"}}, "spec": {"revisionHistoryLimit": 3}},
        admin=True, content_type="application/merge-patch+json")
    assert status == 200, answer
    kube.apply_serving(spec.model_copy(update={"replicas": 2}))
    stored = _deployment(real_cluster, name)
    assert stored["spec"]["revisionHistoryLimit"] == 3 and stored["spec"]["replicas"] == 2
    assert stored["metadata"]["annotations"]["argocd.argoproj.io/sync"] == "x"


def test_the_largest_manifest_a_rollout_takes_updates_a_deployment_and_its_replica_set(
        real_cluster, kube, unique, serving_cleanup):
    """Two versions of the largest manifest ``RolloutInput`` takes, one over the other: the real
    API server keeps both templates in the Deployment's annotations and the controller copies them
    to the new ReplicaSet (256 KiB in all on each). The 1000 shards the rollout took before are
    refused there at the second version, what every site's update met mid-rollout."""
    model, site = f"m{unique}" + "x" * 121, f"s{unique}" + "x" * 47
    name = serving_name(model, site)
    serving_cleanup.append(name)
    files = largest_manifest()
    kube.apply_serving(rollout_spec(files, "1" * 128, model, site))
    kube.apply_serving(rollout_spec(files, "2" * 128, model, site))
    deployment = _deployment(real_cluster, name)
    templates = [json.loads(deployment["metadata"]["annotations"][key])
                 for key in (ANNOTATION_PREVIOUS_TEMPLATE, ANNOTATION_TEMPLATE)]
    versions = [e["value"] for t in templates for e in t["spec"]["containers"][0]["env"] if e["name"] == "MODEL_VERSION"]
    assert versions == ["1" * 128, "2" * 128]
    deadline = time.monotonic() + 30
    while not any(rs["metadata"]["annotations"].get(ANNOTATION_TEMPLATE)
                  == deployment["metadata"]["annotations"][ANNOTATION_TEMPLATE]
                  for rs in _get(real_cluster, "/apis/apps/v1/namespaces/gpufleet/replicasets")["items"]
                  if rs["metadata"]["name"].startswith(name)):
        assert time.monotonic() < deadline, _deployment(real_cluster, name).get("status")
        time.sleep(0.2)

    shards = [WeightFile(path=f"model-{i:05d}-of-01000.safetensors", size=5 * 10**9, sha256="a" * 64)
              for i in range(1000)]
    elsewhere = f"t{unique}"
    serving_cleanup.append(serving_name(model, elsewhere))
    kube.apply_serving(rollout_spec(shards, "1" * 128, model, elsewhere))
    with pytest.raises(ClusterInvalid, match="metadata.annotations: Too long") as caught:
        kube.apply_serving(rollout_spec(shards, "2" * 128, model, elsewhere))
    assert not caught.value.retryable


def test_what_a_rollout_takes_for_env_names_the_api_server_takes(kube, unique, serving_cleanup):
    """A rollout's ``env`` keys name the server container's variables: those ``RolloutInput`` takes
    the real API server takes; those every Kubernetes refuses, it refuses too, after the copies
    (``RolloutInput`` refuses them at start)."""
    model = f"m-{unique}"
    taken = {"HF_HOME": "/cache", "vllm.flag-x_1": "a=b\nc", "_X": ""}
    assert all(ENV_NAME.fullmatch(k) for k in taken)
    serving_cleanup.append(serving_name(model, f"ok-{unique}"))
    kube.apply_serving(ServingSpec(model=model, site=f"ok-{unique}", image="img:1", env=taken))
    for i, refused in enumerate(("A=B", "MODÈLE", "A\nB")):
        assert not ENV_NAME.fullmatch(refused)
        site = f"no{i}-{unique}"
        serving_cleanup.append(serving_name(model, site))
        with pytest.raises(ClusterInvalid, match=r"env\[\d+\]\.name"):
            kube.apply_serving(ServingSpec(model=model, site=site, image="img:1", env={refused: "1"}))


# -- errors -----------------------------------------------------------------------------------
def test_forbidden_is_cluster_forbidden(real_cluster, unique):
    """Not BadCredentials: a cluster RBAC gap must never revoke a provider account. A service
    account bound to nothing: the real authorizer's 403."""
    account = f"nothing-{unique}"
    _post(real_cluster, "/api/v1/namespaces/gpufleet/serviceaccounts",
          {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}})
    cluster = KubernetesCluster(api_client=real_cluster.api_client(
        real_cluster.service_account_token("gpufleet", account)), namespace="gpufleet")
    try:
        with pytest.raises(ClusterForbidden, match="forbidden") as caught:
            cluster.list_nodes()
        assert not isinstance(caught.value, BadCredentials) and not caught.value.retryable
    finally:
        cluster.api_client.close()
        real_cluster.request("DELETE", f"/api/v1/namespaces/gpufleet/serviceaccounts/{account}", admin=True)


# -- errors typed at the activity boundary and through Temporal (tests/cluster/test_cluster_errors.py) --
#: The Site entity's reconcile (``site_nodes``): it labels a node of the site that lacks the site's
#: placement labels (a node made here has none), one patch, before anything else it writes.
SITE = SiteNodesInput(site="site-a")


def _activities(cluster: KubernetesCluster, tmp_path, gpu: str = "") -> CapacityActivities:
    """``gpu``: site-a's GPU product label as the API server must take it, where the config's own
    check (``label_value_problem``, at load) would refuse it: a rule of the server's the config
    misread."""
    env = FleetEnv(Settings(state_dir=tmp_path), load_config(write_fleet(tmp_path)), cluster)
    if gpu:
        env.config.sites = [s.model_copy(update={"gpu": gpu}) if s.name == SITE.site else s for s in env.config.sites]
    return CapacityActivities(env)


def _node_patches(seen, name: str) -> int:
    return sum(1 for method, path, _ in seen if method == "PATCH" and path.endswith(f"/nodes/{name}"))


@workflow.defn(name="ClusterErrorsProbeReal", sandboxed=False)
class ClusterErrorsProbe:
    @workflow.run
    async def run(self, inp: SiteNodesInput) -> list[SiteNode]:
        return await workflow.execute_activity(
            "site_nodes", inp, result_type=list[SiteNode], start_to_close_timeout=timedelta(seconds=30),
            # Unbounded and no non-retryable types listed: the error's own non_retryable flag must end it.
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=100),
                                     maximum_interval=timedelta(milliseconds=200)),
        )


async def _execute(temporal_env, acts: CapacityActivities, inp: SiteNodesInput) -> list[SiteNode]:
    queue = f"cluster-errors-{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(4) as pool:
        async with Worker(temporal_env.client, task_queue=queue, workflows=[ClusterErrorsProbe],
                          activities=[acts.site_nodes], activity_executor=pool,
                          workflow_runner=UnsandboxedWorkflowRunner()):
            return await temporal_env.client.execute_workflow(
                ClusterErrorsProbe.run, inp, id=f"cluster-errors/{uuid.uuid4().hex[:8]}", task_queue=queue,
                execution_timeout=timedelta(seconds=60))


def test_an_invalid_label_value_is_cluster_invalid_and_asked_once(kube, nodes, unique):
    name = nodes(f"gpu-{unique}")
    seen = record_requests(kube)
    with pytest.raises(ClusterInvalid, match="metadata.labels") as caught:
        kube.label_node(name, {LABEL_GPU_PRODUCT: "H100 SXM 80GB"})
    assert caught.value.code == "422" and not caught.value.retryable
    assert _node_patches(seen, name) == 1


def test_what_the_config_takes_for_node_names_and_labels_the_api_server_takes(real_cluster, kube, nodes, unique):
    """A site names its nodes (``<site>-<8 hex>``, also their hostname label), and its name,
    region and GPU are their labels: at their longest, the real API server takes them; what the
    config refuses at load, the server would have refused at the join, after the machine."""
    site = f"s{unique}" + "a" * (MAX_SITE_NAME - 7)
    region, gpu = "r" * 63, "NVIDIA-H100_80GB.HBM3"
    assert not any(problem(v) for problem, v in ((site_name_problem, site), (label_value_problem, region),
                                                 (label_value_problem, gpu)))
    name = nodes(node_name_for(site, f"join/{site}/1"), {LABEL_SITE: site, LABEL_ZONE: site, LABEL_REGION: region,
                                                         LABEL_GPU_PRODUCT: gpu})
    for refused in (site + "b", f"Site_{unique}", f"s{unique}\n"):
        assert site_name_problem(refused)
        node = node_name_for(refused, f"join/{refused}/1")
        status, answer = real_cluster.request("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}}}, admin=True)
        assert status == 422, answer
    for refused in ("H100 SXM", "r" * 64, "H100\n"):
        assert label_value_problem(refused)
        with pytest.raises(ClusterInvalid, match="metadata.labels"):
            kube.label_node(name, {LABEL_GPU_PRODUCT: refused})


def test_a_label_the_server_refuses_fails_the_activity_named_and_final(kube, nodes, unique, tmp_path):
    nodes(f"gpu-{unique}", {LABEL_SITE: SITE.site})
    with pytest.raises(ApplicationError) as caught:
        ActivityEnvironment().run(_activities(kube, tmp_path, gpu="not a label value!").site_nodes, SITE)
    assert (caught.value.type, caught.value.non_retryable) == ("ClusterInvalid", True)
    assert "not a label value!" in str(caught.value)


def test_a_forbidden_node_write_fails_the_activity_named_and_final_not_bad_credentials(
        real_cluster, nodes, unique, tmp_path):
    nodes(f"gpu-{unique}", {LABEL_SITE: SITE.site})
    with control_plane_less(real_cluster, unique, "patch", "nodes") as token:
        cluster = KubernetesCluster(api_client=real_cluster.api_client(token), namespace="gpufleet")
        try:
            with pytest.raises(ApplicationError) as caught:
                ActivityEnvironment().run(_activities(cluster, tmp_path).site_nodes, SITE)
        finally:
            cluster.api_client.close()
    assert (caught.value.type, caught.value.non_retryable) == ("ClusterForbidden", True)
    assert caught.value.type != BadCredentials.__name__
    assert isinstance(caught.value.__cause__, ClusterForbidden)


async def test_a_422_ends_the_workflow_after_one_attempt(temporal_env, kube, nodes, unique, tmp_path):
    name = nodes(f"gpu-{unique}", {LABEL_SITE: SITE.site})
    seen = record_requests(kube)
    with pytest.raises(WorkflowFailureError) as caught:
        await _execute(temporal_env, _activities(kube, tmp_path, gpu="H100 SXM"), SITE)
    cause = caught.value.cause
    assert isinstance(cause, ActivityError) and isinstance(cause.cause, ApplicationError)
    assert cause.cause.type == "ClusterInvalid"
    assert _node_patches(seen, name) == 1


async def test_a_403_ends_the_workflow_after_one_attempt(temporal_env, real_cluster, nodes, unique, tmp_path):
    name = nodes(f"gpu-{unique}", {LABEL_SITE: SITE.site})
    with control_plane_less(real_cluster, unique, "patch", "nodes") as token:
        cluster = KubernetesCluster(api_client=real_cluster.api_client(token), namespace="gpufleet")
        seen = record_requests(cluster)
        try:
            with pytest.raises(WorkflowFailureError) as caught:
                await _execute(temporal_env, _activities(cluster, tmp_path), SITE)
        finally:
            cluster.api_client.close()
    assert caught.value.cause.cause.type == "ClusterForbidden"
    assert _node_patches(seen, name) == 1


# -- CSRs a node sends, judged and bound by gpufleet's approver (tests/cluster/test_csr_*.py) -----
CSRS = "/apis/certificates.k8s.io/v1/certificatesigningrequests"


def key_of(csr: dict) -> str:
    """The node-keys record's name for the CSR's key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from fleet.cluster import client_key_fingerprint

    request = x509.load_pem_x509_csr(base64.b64decode(csr["spec"]["request"]))
    return client_key_fingerprint(request.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo))


def _csr_as_node(real: RealCluster, name: str, node: str, serving_ip: str = "", request: bytes = b"") -> dict:
    """A client-certificate renewal (or, with ``serving_ip``, a serving certificate for the node's
    name and that address; with ``request``, a renewal of that PEM request) as the node's kubelet
    sends it: made *as* ``system:node:<node>`` (the admin impersonates it), so the real API server
    writes the CSR's username and groups."""
    status, answer = _post_as_node(real, name, node, serving_ip, request)
    assert status == 201, answer
    assert answer["spec"]["username"] == f"system:node:{node}"
    return answer


def _post_as_node(real: RealCluster, name: str, node: str, serving_ip: str = "",
                  request: bytes = b"") -> tuple[int, dict]:
    """``_csr_as_node``'s request, and the API server's answer, whatever it is."""
    csr = renewal(name, node)
    if request:
        csr["spec"]["request"] = base64.b64encode(request).decode()
    if serving_ip:
        request = csr_pem(f"system:node:{node}", ["system:nodes"], ips=[serving_ip], dns=[node])
        csr["spec"].update(signerName=SERVING_SIGNER, usages=["digital signature", "server auth"],
                           request=base64.b64encode(request).decode())
    csr["spec"] = {k: v for k, v in csr["spec"].items() if k not in ("username", "groups")}
    as_node = {"Impersonate-User": f"system:node:{node}", "Impersonate-Group": "system:nodes"}
    return real.request("POST", CSRS, csr, admin=True, headers=as_node)


def _approve_as_kubeadm(real: RealCluster, csr: dict) -> None:
    """What kube-controller-manager's csrapproving does under kubeadm's auto-approve bindings."""
    message = "Auto approving self kubelet client certificate after SubjectAccessReview."
    body = {**csr, "status": {"conditions": [{"type": "Approved", "status": "True", "reason": "AutoApproved",
                                              "message": message}]}}
    status, answer = real.request("PUT", f"{CSRS}/{csr['metadata']['name']}/approval", body, admin=True)
    assert status == 200, answer


def _conditions(real: RealCluster, name: str) -> list[str]:
    return [c["type"] for c in (_get(real, f"{CSRS}/{name}").get("status") or {}).get("conditions") or []]


@pytest.fixture
def csrs(real_cluster: RealCluster, kubeadm_bindings_restored):
    """Without kubeadm's auto-approval (as ``gpufleet cluster check`` advises), so that each CSR
    is gpufleet's to judge unless the test approves it as kubeadm would; CSRs deleted afterwards."""
    for name in KUBEADM_BINDINGS:
        real_cluster.kubectl("delete", "clusterrolebinding", name)
    made: list[str] = []
    yield made
    for name in made:
        real_cluster.request("DELETE", f"{CSRS}/{name}", admin=True)


def test_the_adapter_renews_a_labelled_control_plane_node_and_denies_a_removed_one(
        real_cluster, kube, nodes, csrs, unique) -> None:
    control_plane, live = nodes(f"cp-{unique}", {CONTROL_PLANE_LABEL: ""}), nodes(f"gpu-live-{unique}")
    # A removed node whose kubelet registered its Node again: it cannot give itself the
    # control-plane label (NodeRestriction), only another one.
    removed = nodes(f"gpu-removed-{unique}", {"node-role.example.com/control-plane": ""})
    identity = NodeIdentity(node_name=live, machine_id="m-1", provider="lambda", account="a", site="s")
    kube.update_state(NODE_IDENTITY_KIND, live, lambda _current: identity.state())
    names = {f"r-cp-{unique}": control_plane, f"r-live-{unique}": live, f"r-removed-{unique}": removed}
    for name, node in names.items():
        _csr_as_node(real_cluster, name, node)
        csrs.append(name)
    try:
        verdicts = {d.name: d for d in kube.review_csrs(lambda _node: None) if d.name in names}
        assert verdicts[f"r-cp-{unique}"].approve and verdicts[f"r-live-{unique}"].approve
        assert not verdicts[f"r-removed-{unique}"].approve
        assert {n: _conditions(real_cluster, n) for n in names} == {
            f"r-cp-{unique}": ["Approved"], f"r-live-{unique}": ["Approved"], f"r-removed-{unique}": ["Denied"]}
    finally:
        kube.remove_node(live)


def test_the_approver_binds_the_keys_it_approves_and_only_those(real_cluster, kube, nodes, csrs, unique) -> None:
    live, removed = nodes(f"gpu-live-{unique}"), nodes(f"gpu-removed-{unique}")  # removed: no identity record
    identity = NodeIdentity(node_name=live, machine_id="m-1", provider="lambda", account="a", site="s")
    kube.update_state(NODE_IDENTITY_KIND, live, lambda _current: identity.state())
    made = {}
    for name, node in ((f"r-live-{unique}", live), (f"r-removed-{unique}", removed),
                       (f"a-removed-{unique}", removed), (f"a-live-{unique}", live)):
        made[name] = _csr_as_node(real_cluster, name, node)
        csrs.append(name)
    # Approved by kubeadm's auto-approval: for a name gpufleet does not renew (not to be bound), and
    # for a live node's own renewal (gpufleet approves it too, so bound).
    _approve_as_kubeadm(real_cluster, made[f"a-removed-{unique}"])
    _approve_as_kubeadm(real_cluster, made[f"a-live-{unique}"])

    verdicts = {d.name: d.approve for d in kube.review_csrs(lambda _node: None) if d.name in made}
    assert verdicts == {f"r-live-{unique}": True, f"r-removed-{unique}": False}
    expected = {key_of(made[f"r-live-{unique}"]), key_of(made[f"a-live-{unique}"])}
    assert set(bound_keys(kube.read_state(NODE_KEYS_KIND, live))) == expected
    assert kube.read_state(NODE_KEYS_KIND, removed) == {}, "no key of a node gpufleet does not renew"
    # A second pass binds nothing new and keeps what it bound.
    kube.review_csrs(lambda _node: None)
    assert set(bound_keys(kube.read_state(NODE_KEYS_KIND, live))) == expected

    kube.remove_node(live)
    assert kube.read_state(NODE_KEYS_KIND, live) == {}, "a removed node's keys open nothing"
    assert kube.node_identity(live) is None


def _live_node(kube, nodes, name: str) -> str:
    node = nodes(name)
    identity = NodeIdentity(node_name=node, machine_id="m-1", provider="lambda", account="a", site="s")
    kube.update_state(NODE_IDENTITY_KIND, node, lambda _current: identity.state())
    return node


def test_a_pass_over_renewals_approved_and_bound_before_writes_nothing(real_cluster, kube, nodes, csrs, unique) -> None:
    """More approved renewals than keys kept: the oldest keys are rotated out of the record, and
    their CSRs stay listed for an hour. A later pass (every join's wait polls one) must not bind
    them again: each would rotate out another key, a ConfigMap write per CSR on every pass."""
    live = _live_node(kube, nodes, f"gpu-live-{unique}")
    made = []
    for i in range(NODE_KEYS_KEPT + 2):  # in order, so creation time (then name) orders them
        made.append(_csr_as_node(real_cluster, f"k{i}-{unique}", live))
        csrs.append(made[-1]["metadata"]["name"])
        _approve_as_kubeadm(real_cluster, made[-1])
    try:
        kube.review_csrs(lambda _node: None)
        newest = [key_of(csr) for csr in made[-NODE_KEYS_KEPT:]]
        assert bound_keys(kube.read_state(NODE_KEYS_KIND, live)) == newest
        seen = record_requests(kube)
        for _ in range(2):
            kube.review_csrs(lambda _node: None)
        writes = [r for r in seen if r[0] in ("POST", "PUT", "PATCH", "DELETE") and "/configmaps" in r[1]]
        assert writes == [], writes
        assert bound_keys(kube.read_state(NODE_KEYS_KIND, live)) == newest, "the rotated-out keys stay out"
    finally:
        kube.remove_node(live)


def _asked_one_at_a_time(real_cluster, kube, csrs, live: str, names: list[str], addresses, **kind) -> dict[str, bool]:
    """Each CSR asked for, then a pass over it (a kubelet asks again only once its last request
    is answered or given up on): whether each was approved."""
    approved = {}
    for name in names:
        _csr_as_node(real_cluster, name, live, **kind)
        csrs.append(name)
        approved.update({d.name: d.approve for d in kube.review_csrs(addresses) if d.name == name})
    return approved


def test_a_node_asking_for_many_renewals_gets_a_few(real_cluster, kube, nodes, csrs, unique) -> None:
    live = _live_node(kube, nodes, f"gpu-live-{unique}")
    names = [f"m{i}-{unique}" for i in range(RENEWALS_PER_WINDOW + 2)]
    try:
        approved = _asked_one_at_a_time(real_cluster, kube, csrs, live, names, lambda _node: None)
        assert [n for n in names if approved[n]] == names[:RENEWALS_PER_WINDOW], approved
        assert [_conditions(real_cluster, n) for n in names[RENEWALS_PER_WINDOW:]] == [["Denied"]] * 2
        assert len(bound_keys(kube.read_state(NODE_KEYS_KIND, live))) == RENEWALS_PER_WINDOW
        # Asked for at once (a pass that came late): the newest is judged, the rest superseded.
        at_once = [f"n{i}-{unique}" for i in range(3)]
        for name in at_once:
            _csr_as_node(real_cluster, name, live)
            csrs.append(name)
        verdicts = {d.name: d for d in kube.review_csrs(lambda _node: None) if d.name in at_once}
        assert f"node {live} had {RENEWALS_PER_WINDOW} client certificates renewed" in verdicts[at_once[-1]].reason
        assert all("superseded" in verdicts[n].reason for n in at_once[:-1]), verdicts
    finally:
        kube.remove_node(live)


def test_a_node_asking_for_many_serving_certificates_gets_a_few(real_cluster, kube, nodes, csrs, unique) -> None:
    """Each serving certificate approved is an API write and a signed certificate: a node that
    asks for them by the hundred, for its own name and address, gets a few."""
    live, address = _live_node(kube, nodes, f"gpu-live-{unique}"), "198.51.100.7"
    addresses = lambda node: [address] if node == live else None  # noqa: E731
    names = [f"s{i}-{unique}" for i in range(SERVING_PER_WINDOW + 2)]
    try:
        approved = _asked_one_at_a_time(real_cluster, kube, csrs, live, names, addresses, serving_ip=address)
        assert [n for n in names if approved[n]] == names[:SERVING_PER_WINDOW], approved
        assert [_conditions(real_cluster, n) for n in names[SERVING_PER_WINDOW:]] == [["Denied"]] * 2
        # Its client renewals are counted apart: a renewal is still approved.
        renewal = _asked_one_at_a_time(real_cluster, kube, csrs, live, [f"renewal-{unique}"], addresses)
        assert renewal == {f"renewal-{unique}": True}
    finally:
        kube.remove_node(live)


def test_after_an_approver_outage_the_request_a_kubelet_waits_on_is_approved(real_cluster, kube, nodes, csrs,
                                                                            unique) -> None:
    """A kubelet whose serving CSR goes unanswered for minutes gives up on it and asks again. After
    an approver outage several of a node's requests are open; it waits only on the newest, which
    is approved. The older are denied as superseded and do not count against the node's
    allowance: approved oldest first, the newest was denied and the node went without a serving
    certificate for the hour."""
    live, address = _live_node(kube, nodes, f"gpu-live-{unique}"), "198.51.100.8"
    names = [f"o{i}-{unique}" for i in range(SERVING_PER_WINDOW + 2)]
    for name in names:
        _csr_as_node(real_cluster, name, live, serving_ip=address)
        csrs.append(name)
    try:
        verdicts = {d.name: d for d in kube.review_csrs(lambda node: [address] if node == live else None)
                    if d.name in names}
        assert [n for n in names if verdicts[n].approve] == names[-1:], verdicts
        assert all("superseded" in verdicts[n].reason for n in names[:-1]), verdicts
        assert [_conditions(real_cluster, n) for n in names] == [["Denied"]] * (len(names) - 1) + [["Approved"]]
    finally:
        kube.remove_node(live)


def test_a_request_the_api_server_accepts_and_cryptography_cannot_read_is_denied_alone(real_cluster, kube, nodes,
                                                                                      csrs, unique) -> None:
    """The real API server accepts a live node's CSR whose KeyUsage is malformed (it reads only the
    SAN extension), which failed every pass until it was collected a day later: it is now denied
    by itself, and the node's honest renewal beside it approved (tests/cluster/test_csr_flood.py).
    A KeyUsage given twice the API server refuses itself: the approver's denial of that one
    (tested against the fake API server) is defence in depth."""
    live = _live_node(kube, nodes, f"gpu-live-{unique}")
    status, answer = _post_as_node(real_cluster, f"u-duplicate-{unique}", live, request=unreadable_csr_pem(
        f"system:node:{live}", ["system:nodes"], "duplicate"))
    assert status == 403 and "duplicate requested extensions" in answer["message"], answer
    unreadable, honest = f"u-key-usage-{unique}", f"v-renewal-{unique}"  # the renewal newest: none superseded
    _csr_as_node(real_cluster, unreadable, live, request=unreadable_csr_pem(
        f"system:node:{live}", ["system:nodes"], "key-usage"))
    csrs.append(unreadable)
    _csr_as_node(real_cluster, honest, live)
    csrs.append(honest)
    try:
        verdicts = {d.name: d for d in kube.review_csrs(lambda _node: None) if d.name in (unreadable, honest)}
        assert verdicts[honest].approve
        assert not verdicts[unreadable].approve and verdicts[unreadable].reason.startswith("unparseable request")
        assert {n: _conditions(real_cluster, n) for n in (unreadable, honest)} == {
            unreadable: ["Denied"], honest: ["Approved"]}
    finally:
        kube.remove_node(live)


# -- the network model on the API server (tests/cluster/test_network.py) ------------------------
def test_serving_at_two_sites_writes_one_prefer_close_service(real_cluster, kube, unique, serving_cleanup):
    """The real API server validates ``trafficDistribution`` (the field a Service that spans
    sites needs, to prefer the caller's zone)."""
    model = f"llama-{unique}"
    serving_cleanup.extend([f"{model}-site-a", f"{model}-site-b", model])
    seen = record_requests(kube)
    for site in ("site-a", "site-b"):
        kube.apply_serving(ServingSpec(model=model, site=site, image="vllm:1"))

    def services() -> dict[str, dict]:
        _, listed = real_cluster.request("GET", "/api/v1/namespaces/gpufleet/services", admin=True)
        return {s["metadata"]["name"]: s for s in listed["items"]
                if s["metadata"]["name"] in (model, f"{model}-site-a", f"{model}-site-b")}

    found = services()
    assert set(found) == {model, f"{model}-site-a", f"{model}-site-b"}
    spanning = [s for s in found.values() if LABEL_SITE not in s["spec"]["selector"]]
    assert [s["metadata"]["name"] for s in spanning] == [model]
    assert all(s["spec"].get("trafficDistribution") == "PreferClose" for s in spanning)
    posts = _writes(seen, "/services")
    kube.apply_serving(ServingSpec(model=model, site="site-a", image="vllm:1"))
    assert [m for m in _writes(seen, "/services") if m == "POST"] == [m for m in posts if m == "POST"]
    kube.delete_serving(model, "site-a")
    assert model in services(), "site-b still serves it"
    kube.delete_serving(model, "site-b")
    assert services() == {}


def test_the_model_wide_service_never_takes_over_another_models_service(real_cluster, kube, unique, serving_cleanup):
    model = f"m-{unique}"
    serving_cleanup.extend([f"{model}-x", f"{model}-x-y"])
    kube.apply_serving(ServingSpec(model=model, site="x", image="i"))          # Service "<m>-x", one site
    kube.apply_serving(ServingSpec(model=f"{model}-x", site="y", image="i"))   # its model-wide name is "<m>-x" too
    other = _get(real_cluster, f"/api/v1/namespaces/gpufleet/services/{model}-x")
    assert other["spec"]["selector"] == {LABEL_MODEL: model, LABEL_SITE: "x"}
    kube.delete_serving(f"{model}-x", "y")
    assert _get(real_cluster, f"/api/v1/namespaces/gpufleet/services/{model}-x") is not None
    kube.delete_serving(model, "x")


def _fleet_env(kube: KubernetesCluster, tmp_path) -> FleetEnv:
    return FleetEnv(Settings(state_dir=tmp_path), load_config(write_fleet(tmp_path)), kube)


def test_the_reconcile_sweep_puts_a_changed_zone_back(real_cluster, kube, nodes, unique, tmp_path):
    from fleet.demand import public_placement_labels  # zone, region and GPU product: all put back

    env = _fleet_env(kube, tmp_path)
    fleet_taint = [{"key": FLEET_TAINT_KEY, "effect": "NoSchedule"}]  # what every joined node keeps
    placed = public_placement_labels(env.site("site-a"))
    moved = nodes(f"gpu-1-{unique}", {**placed, LABEL_SITE: "site-a", LABEL_ZONE: "site-b"}, taints=fleet_taint)
    kept = nodes(f"gpu-2-{unique}", {**placed, LABEL_SITE: "site-a"}, taints=fleet_taint)
    site_nodes = CapacityActivities(env).site_nodes
    seen = record_requests(kube)
    listed = ActivityEnvironment().run(site_nodes, SiteNodesInput(site="site-a"))
    assert {moved, kept} <= {n.node_name for n in listed}
    assert _node(real_cluster, moved)["metadata"]["labels"][LABEL_ZONE] == "site-a"
    assert _writes(seen, f"/nodes/{moved}") == ["PATCH"] and _writes(seen, f"/nodes/{kept}") == [], \
        "only the node whose zone was wrong is written"
    ActivityEnvironment().run(site_nodes, SiteNodesInput(site="site-a"))
    assert _writes(seen, f"/nodes/{moved}") == ["PATCH"], "once put back, nothing more to write"
