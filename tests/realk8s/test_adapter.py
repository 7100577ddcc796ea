"""The Kubernetes adapter's own calls against the real API server, as the control-plane service
account (the shipped RBAC; every request the real authorizer refuses fails the test, which is
what ``tests/cluster/conftest.py``'s access-table check stood in for on the fake):

* control-plane state under real ``resourceVersion`` conflicts: a replace carrying a stale
  version is refused with 409 by the API server, the loser reads again and keeps both changes,
  two creators race on ``create`` (409 AlreadyExists), writers that keep losing end retryable;
* a node's cordon decided on its marks (the Site's release of its cordon, the demand loop's drain,
  its retire, the drop of its mark from a fenced node): written under the resourceVersion read, it
  is refused with 409 once a repair fenced the node or a person marked it theirs in between, and
  the activity, reading again, leaves the node to them;
* join-token records: a retried join renders the same token from its record without reading
  kube-system (whose Secrets the shipped RBAC does not let it read), revocation deletes the
  real bootstrap-token Secret;
* ``cluster check``'s SelfSubjectAccessReviews answered by the real authorizer, for the shipped
  RBAC and for an account bound to the same roles less one rule;
* pending GPU pods as kube-scheduler leaves them (``PodScheduled=False``, ``Unschedulable``),
  listed with real field selectors and watched with a real watch.

Moved here from ``tests/cluster/`` (issue 33); the fake API server stays only for faults a real
server cannot be made to show (``tests/cluster/fake_apiserver.py``'s docstring lists them).
Names are unique per test: the control plane is shared by the tier's tests.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Callable
from urllib.parse import parse_qs, urlparse

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from temporalio.testing import ActivityEnvironment
from typer.testing import CliRunner

from cli.cluster import cluster_app
from activities.capacity import CapacityActivities

from fleet.cluster import (
    ANNOTATION_CORDONED_BY, CORDONED_BY_DEMAND, CORDONED_BY_SURPLUS, FENCE_PREFIX, GPU_RESOURCE, LABEL_MODEL,
    DrainResult,
)
from fleet.config import load_config
from fleet.demand import opted_in
from fleet.errors import ClusterConflict
from fleet.messages.capacity import DrainNodeInput, ReleaseCordonsInput, RetireMachineInput
from providers.cluster.base import state_object_name
from providers.cluster.check import (
    ADMISSION_POLICIES,
    KUBEADM_AUTOAPPROVE_BOOTSTRAP,
    KUBEADM_AUTOAPPROVE_ROTATION,
    KUBEADM_BINDINGS,
    check_access,
    check_hardening,
)
from providers.cluster.kubernetes import ACCESS, JOIN_TOKEN_KIND, TOKEN_NAMESPACE, KubernetesCluster
from providers.credentials import control_plane_secret_fields
from providers.own_dc import ClusterAllocations
from tests.cluster.test_demand_pods import OPT_IN
from tests.realk8s.cluster import RealCluster
from tests.realk8s.conftest import SHIPPED_SITES
from tests.realk8s.test_blast_radius import kubeadm_bindings_restored  # noqa: F401 - a fixture
from tests.realk8s.test_join import control_plane_cluster
from tests.conftest import write_after_next_read, write_before_next_cordon

RBAC = "/apis/rbac.authorization.k8s.io/v1"
REPO = Path(__file__).resolve().parents[2]


def _add(entry: str, value: str):
    return lambda data: {**data, entry: value}


class Request(tuple):
    """One request the adapter sent, ``(method, path, query)``, and ``status``: what the API
    server answered (a 409 is a write another writer beat, which the adapter reads again and
    retries)."""

    status: int | None = None


def record_requests(cluster: KubernetesCluster) -> list[Request]:
    """Every HTTP request the adapter's client sends, in order: (method, path, query), each with
    the status it was answered with once it is."""
    seen: list[Request] = []
    rest = cluster.api_client.rest_client
    real = rest.request

    def recorded(method, url, query_params=None, *args, **kwargs):
        parsed = urlparse(url)
        query = parsed.query or "&".join(f"{k}={v}" for k, v in (query_params or []))
        request = Request((method, parsed.path, query))
        seen.append(request)
        try:
            response = real(method, url, query_params, *args, **kwargs)
        except ApiException as error:
            request.status = error.status
            raise
        request.status = response.status
        return response

    rest.request = recorded
    return seen


@pytest.fixture
def kube(real_cluster: RealCluster):
    cluster = control_plane_cluster(real_cluster)
    yield cluster
    cluster.api_client.close()


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:6]


def _configmap(real: RealCluster, kind: str, key: str) -> dict:
    status, answer = real.request("GET", f"/api/v1/namespaces/gpufleet/configmaps/{state_object_name(kind, key)}",
                                  admin=True)
    assert status == 200, answer
    return answer


# -- compare-and-swap under the real API server's resourceVersion ----------------------------
def test_two_writers_one_wins_the_other_rereads_and_keeps_both(real_cluster, kube, unique):
    other = control_plane_cluster(real_cluster)
    key = f"acct-{unique}"
    kube.update_state("account", key, _add("record", "v0"))
    seen: list[dict] = []

    def slow_writer(data):
        seen.append(dict(data))
        if len(seen) == 1:
            # The other writer reads and writes after this one's read, before its write.
            other.update_state("account", key, _add("pending", "from-other"))
        return {**data, "record": "v1"}

    mine, theirs = record_requests(kube), record_requests(other)
    result = kube.update_state("account", key, slow_writer)
    assert seen == [{"record": "v0"}, {"record": "v0", "pending": "from-other"}]
    assert result == {"record": "v1", "pending": "from-other"}
    assert _configmap(real_cluster, "account", key)["data"] == result
    # The loser's first replace carried the stale resourceVersion and was refused with 409, then it
    # replaced again: three replaces in all (the other writer's, the refused one, the retried one).
    replaces = [r for r in mine + theirs if r[0] == "PUT" and "/configmaps/" in r[1]]
    assert len(replaces) == 3, replaces
    other.api_client.close()


def test_two_creators_one_wins_the_other_rereads(real_cluster, kube, unique):
    other = control_plane_cluster(real_cluster)
    key = f"rack-{unique}"
    seen: list[dict] = []

    def slow_creator(data):
        seen.append(dict(data))
        if len(seen) == 1:
            other.update_state("own-dc", key, _add("allocations", json.dumps({"m1": {"key": "k-other"}})))
        allocations = json.loads(data.get("allocations") or "{}")
        free = next(m for m in ("m1", "m2") if m not in allocations)
        allocations[free] = {"key": "k-mine"}
        return {"allocations": json.dumps(allocations, sort_keys=True)}

    result = kube.update_state("own-dc", key, slow_creator)
    assert len(seen) == 2 and seen[0] == {}  # the first create met 409 AlreadyExists
    assert json.loads(result["allocations"]) == {"m1": {"key": "k-other"}, "m2": {"key": "k-mine"}}
    other.api_client.close()


def test_a_stale_resource_version_is_refused_by_the_api_server(real_cluster, kube, unique):
    key = f"acct-{unique}"
    kube.update_state("account", key, _add("record", "v0"))
    stale = _configmap(real_cluster, "account", key)
    kube.update_state("account", key, _add("record", "v1"))
    stale["data"] = {"record": "lost update"}
    with pytest.raises(Exception) as refused:
        kube.core.replace_namespaced_config_map(stale["metadata"]["name"], "gpufleet", stale)
    assert getattr(refused.value, "status", None) == 409
    assert kube.read_state("account", key) == {"record": "v1"}


def test_writers_that_keep_losing_get_a_retryable_conflict(real_cluster, kube, unique):
    other = control_plane_cluster(real_cluster)
    key = f"acct-{unique}"
    kube.update_state("account", key, _add("n", "0"))
    calls = 0

    def always_overtaken(data):
        nonlocal calls
        calls += 1
        other.update_state("account", key, _add("n", str(calls)))
        return {**data, "mine": "x"}

    with pytest.raises(ClusterConflict) as error:
        kube.update_state("account", key, always_overtaken)
    assert error.value.retryable  # a later activity attempt may win
    assert "mine" not in kube.read_state("account", key)
    other.api_client.close()


def test_two_allocators_never_take_the_same_rack_machine(real_cluster, kube, unique):
    pool = f"dc-{unique}"
    mine = ClusterAllocations(kube, pool)
    theirs = ClusterAllocations(control_plane_cluster(real_cluster), pool)

    def reserve(store, key, interleave=None):
        def change(state):
            if interleave:
                interleave()
            allocations = state["allocations"]
            free = next(m for m in ("rack1-node1", "rack1-node2", "rack1-node3") if m not in allocations)
            allocations[free] = {"key": key}
            return free

        return store.update(change)

    once = []
    got_mine = reserve(mine, "k-mine", lambda: once or once.append(reserve(theirs, "k-theirs")))
    assert once == ["rack1-node1"] and got_mine == "rack1-node2"
    assert set(ClusterAllocations(kube, pool).read()["allocations"]) == {"rack1-node1", "rack1-node2"}


# -- a node's cordon decided on its marks, under the real API server's resourceVersion ---------
@pytest.fixture
def node_of_ours(real_cluster, unique):
    name = f"marks-{unique}"
    _post(real_cluster, "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    yield name
    real_cluster.request("DELETE", f"/api/v1/nodes/{name}", admin=True)


def _another_writer(real: RealCluster, name: str, annotations: dict[str, str]) -> Callable[[], None]:
    """A cordon and annotations written on the node by someone else (a repair, a person: the admin)."""

    def write() -> None:
        status, answer = real.request("PATCH", f"/api/v1/nodes/{name}", {
            "metadata": {"annotations": annotations}, "spec": {"unschedulable": True}},
            admin=True, content_type="application/merge-patch+json")
        assert status == 200, answer

    return write


def _node_marks(real: RealCluster, name: str) -> tuple[bool, dict[str, str]]:
    """The node's cordon and annotations, as the admin reads them."""
    _, node = real.request("GET", f"/api/v1/nodes/{name}", admin=True)
    return bool(node["spec"].get("unschedulable")), node["metadata"].get("annotations") or {}


def _a_person_marks_it_theirs(when: Callable, monkeypatch, real: RealCluster, kube: KubernetesCluster,
                              name: str) -> tuple[list, list[Request]]:
    """A person marks the node theirs at ``when`` (``write_before_next_cordon``,
    ``write_after_next_read``): whether they did, and the adapter's requests from now on."""
    raced = when(monkeypatch, kube, name, _another_writer(real, name, {ANNOTATION_CORDONED_BY: "alice"}))
    return raced, record_requests(kube)


def _drain_for_the_loop(kube: KubernetesCluster, name: str) -> DrainResult:
    drain = CapacityActivities(SimpleNamespace(cluster=kube)).drain_within  # it uses the cluster only
    return ActivityEnvironment().run(drain, DrainNodeInput(node_name=name, deadline_seconds=5,
                                                           cordoned_by=CORDONED_BY_DEMAND))


def _refused(seen: list[Request], name: str) -> list[Request]:
    return [r for r in seen if r[0] == "PATCH" and r[1] == f"/api/v1/nodes/{name}" and r.status == 409]


def test_an_uncordon_decided_on_a_read_is_refused_once_a_repair_fenced_the_node(
        real_cluster, kube, node_of_ours, monkeypatch):
    """The Site's release reads its own cordon on a node and uncordons it; right in between a repair
    fences a GPU of the node and cordons it. The API server refuses the uncordon, whose patch
    carries the resourceVersion read (409); the release reads again, finds the fence and leaves the
    node cordoned, the repair's. Before, the uncordon was a plain merge patch: it lifted the
    repair's cordon, and the node took pods on a GPU under repair."""
    name, fence = node_of_ours, f"{FENCE_PREFIX}0"
    kube.cordon(name, by=CORDONED_BY_SURPLUS)
    raced = write_before_next_cordon(monkeypatch, kube, name, _another_writer(real_cluster, name, {fence: "reset"}))
    seen = record_requests(kube)
    release = CapacityActivities(SimpleNamespace(cluster=kube)).release_cordons  # it uses the cluster only
    assert ActivityEnvironment().run(release, ReleaseCordonsInput(nodes=[name], cordoned_by=CORDONED_BY_SURPLUS)) == []
    assert raced and _refused(seen, name), seen
    cordoned, annotations = _node_marks(real_cluster, name)
    assert cordoned and annotations[fence] == "reset", annotations


def test_a_drain_for_the_loop_is_refused_once_a_person_marked_the_node_theirs(
        real_cluster, kube, node_of_ours, monkeypatch):
    """The demand loop chose an idle node; right before its drain's cordon a person cordons it and
    marks it theirs. The API server refuses that cordon (409: the node changed since the drain read
    it); read again, the node is the person's, and the drain leaves it, saying who holds it. Before,
    the cordon was a plain merge patch that overwrote the person's mark with the loop's, and the
    retirement after the drain deleted their node."""
    name = node_of_ours
    raced, seen = _a_person_marks_it_theirs(write_before_next_cordon, monkeypatch, real_cluster, kube, name)
    drained = _drain_for_the_loop(kube, name)
    cordoned, annotations = _node_marks(real_cluster, name)
    assert cordoned and annotations[ANNOTATION_CORDONED_BY] == "alice", annotations
    assert raced and _refused(seen, name), seen
    assert drained.held == f"cordoned by 'alice' ({ANNOTATION_CORDONED_BY})" and not drained.completed, drained


def test_a_retirement_decided_on_a_read_is_refused_once_a_person_marked_the_node_theirs(
        real_cluster, kube, node_of_ours, monkeypatch):
    """The loop's drain left the node cordoned with its mark; its retire reads the node, finds it
    the loop's and decides to delete it. Right after that read a person marks it theirs. The
    decision, written under the resourceVersion read before anything is deleted, is refused (409);
    read again, the node is the person's: the retire says so and the node stays. Before, the node
    (and its machine) were deleted on the read alone."""
    name = node_of_ours
    kube.cordon(name, by=CORDONED_BY_DEMAND)
    raced, seen = _a_person_marks_it_theirs(write_after_next_read, monkeypatch, real_cluster, kube, name)
    retire = CapacityActivities(SimpleNamespace(cluster=kube)).retire_machine  # no machine: the cluster only
    held = asyncio.run(ActivityEnvironment().run(retire, RetireMachineInput(
        site="east", node_name=name, machine_id="", cordoned_by=CORDONED_BY_DEMAND)))
    status, _ = real_cluster.request("GET", f"/api/v1/nodes/{name}", admin=True)
    assert status == 200, "the node stays"
    cordoned, annotations = _node_marks(real_cluster, name)
    assert cordoned and annotations[ANNOTATION_CORDONED_BY] == "alice", annotations
    assert raced and _refused(seen, name), seen
    assert held == f"cordoned by 'alice' ({ANNOTATION_CORDONED_BY})", held


def test_dropping_the_loops_mark_from_a_fenced_node_keeps_a_persons_mark_written_since(
        real_cluster, kube, node_of_ours, monkeypatch):
    """A repair fenced a GPU of a node the loop cordoned: the node is the repair's, and the loop's
    next look (its drain) drops the loop's mark. A person marks the node theirs right after that
    look read it. The drop, a patch under the resourceVersion read, is refused (409); read again,
    the mark is the person's and stays. Before, the drop was a plain merge patch that deleted the
    person's mark."""
    name, fence = node_of_ours, f"{FENCE_PREFIX}0"
    kube.cordon(name, by=CORDONED_BY_DEMAND)
    kube.annotate_node(name, {fence: "reset"})
    raced, seen = _a_person_marks_it_theirs(write_after_next_read, monkeypatch, real_cluster, kube, name)
    drained = _drain_for_the_loop(kube, name)
    cordoned, annotations = _node_marks(real_cluster, name)
    assert cordoned and annotations[ANNOTATION_CORDONED_BY] == "alice" and fence in annotations, annotations
    assert raced and _refused(seen, name), seen
    assert drained.held == "cordoned by its repair (GPU 0 fenced)", drained


# -- join-token records -----------------------------------------------------------------------
def _kube_system_secret_reads(seen) -> list:
    return [r for r in seen if r[0] == "GET" and f"/namespaces/{TOKEN_NAMESPACE}/secrets" in r[1]]


def _token_secret(real: RealCluster, token_id: str) -> dict | None:
    status, answer = real.request("GET", f"/api/v1/namespaces/{TOKEN_NAMESPACE}/secrets/bootstrap-token-{token_id}",
                                  admin=True)
    assert status in (200, 404), answer
    return answer if status == 200 else None


def test_a_retried_join_gets_the_same_token_without_reading_kube_system(real_cluster, kube, unique) -> None:
    seen = record_requests(kube)
    first = kube.issue_bootstrap_token(f"gpu-{unique}", f"join/site-a/{unique}", 3600)
    again = kube.issue_bootstrap_token(f"gpu-{unique}", f"join/site-a/{unique}", 3600)
    assert (again.token_id, again.secret, again.expires_at) == (first.token_id, first.secret, first.expires_at)
    stored = _token_secret(real_cluster, first.token_id)
    assert base64.b64decode(stored["data"]["token-secret"]).decode() == first.secret, "what the API server checks"
    other = kube.issue_bootstrap_token(f"gpu2-{unique}", f"join/site-a/{unique}-2", 3600)
    assert other.token_id != first.token_id and other.secret != first.secret
    record = kube.read_state(JOIN_TOKEN_KIND, first.token_id)
    assert record["node-name"] == f"gpu-{unique}" and first.secret not in str(record), "the record holds no secret"
    assert _kube_system_secret_reads(seen) == []
    for token in (first, other):
        kube.revoke_node_tokens(f"gpu-{unique}" if token is first else f"gpu2-{unique}")


def test_the_approver_and_revocation_go_by_the_records(real_cluster, kube, unique) -> None:
    seen = record_requests(kube)
    node = f"gpu-{unique}"
    token = kube.issue_bootstrap_token(node, f"join/site-a/{unique}", 3600)
    assert kube._token_node(token.token_id, {}) == node
    assert kube._token_node("zzzzzz", {}) is None, "a token gpufleet did not issue (kubeadm's) is not ours"
    assert kube.revoke_node_tokens(node) == [token.token_id]
    assert _token_secret(real_cluster, token.token_id) is None
    assert kube.read_state(JOIN_TOKEN_KIND, token.token_id) == {}
    assert kube._token_node(token.token_id, {}) is None, "a revoked token is no longer approved"
    assert _kube_system_secret_reads(seen) == []


# -- cluster check: the real authorizer answers ----------------------------------------------
def test_every_permission_is_asked_and_granted(real_cluster, kube):
    seen = record_requests(kube)
    rows = check_access(kube.api_client, "gpufleet")
    assert len(rows) == len(ACCESS)
    assert all(row.allowed for row in rows), [r for r in rows if not r.allowed]
    asked = [r for r in seen if r[1].endswith("/selfsubjectaccessreviews")]
    # The approve grant is limited to the two kubelet signers: asked for each by name.
    assert len(asked) == len(ACCESS) + 1
    assert {r.namespace for r in rows} == {"", "kube-system", "kube-public", "gpufleet-bootstrap", "gpufleet"}


def _shipped_bindings() -> set[tuple[str, str]]:
    """(namespace or "", name) of every binding the shipped manifests make (conftest applies them)."""
    shipped = set()
    for path in [*sorted((REPO / "deploy" / "kubernetes").glob("*.yaml")), REPO / "deploy" / "bootstrap" / "rbac.yaml"]:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in ("RoleBinding", "ClusterRoleBinding"):
                shipped.add((doc["metadata"].get("namespace", ""), doc["metadata"]["name"]))
    return shipped


def _bindings_of(real: RealCluster, account: str) -> list[tuple[str, dict]]:
    """(namespace or "", binding) for every shipped binding naming the gpufleet service account.
    Only the shipped ones: a contract test binds the account in its own namespace too
    (``bind_serving_role``), and that namespace may be terminating by the time a copy of its
    Role is made there (403: "being terminated"; seen with the routing and object tests in parallel)."""
    found, shipped = [], _shipped_bindings()
    for path, namespaced in ((f"{RBAC}/clusterrolebindings", False), (f"{RBAC}/rolebindings", True)):
        status, listed = real.request("GET", path, admin=True)
        assert status == 200, listed
        for binding in listed["items"]:
            if (binding["metadata"].get("namespace", "") if namespaced else "", binding["metadata"]["name"]) not in shipped:
                continue
            if any(s.get("kind") == "ServiceAccount" and s.get("name") == account and s.get("namespace") == "gpufleet"
                   for s in binding.get("subjects") or []):
                found.append((binding["metadata"].get("namespace", "") if namespaced else "", binding))
    return found


def _post(real: RealCluster, path: str, body: dict) -> None:
    status, answer = real.request("POST", path, body, admin=True)
    assert status == 201, (path, answer.get("message", answer) if isinstance(answer, dict) else answer)


def _less(rules: list[dict], verb: str, resource: str) -> list[dict]:
    """The rules less ``verb`` on ``resource`` (a rule naming it is split: the rest keep all)."""
    kept = []
    for rule in rules:
        if resource not in rule.get("resources", []):
            kept.append(rule)
            continue
        others = [r for r in rule["resources"] if r != resource]
        if others:
            kept.append({**rule, "resources": others})
        verbs = [v for v in rule["verbs"] if v != verb]
        if verbs:
            kept.append({**rule, "resources": [resource], "verbs": verbs})
    return kept


@contextmanager
def control_plane_less(real: RealCluster, unique: str, verb: str, resource: str):
    """A token of a new service account bound to copies of every role the control plane's is
    bound to, less ``verb`` on ``resource``: what a cluster whose RBAC lags the code grants."""
    account = f"check-{unique}"
    _post(real, "/api/v1/namespaces/gpufleet/serviceaccounts",
          {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, "namespace": "gpufleet"}})
    made: list[str] = []
    try:
        for namespace, binding in _bindings_of(real, "gpufleet-control-plane"):
            ref = binding["roleRef"]
            role_path = (f"{RBAC}/clusterroles/{ref['name']}" if ref["kind"] == "ClusterRole"
                         else f"{RBAC}/namespaces/{namespace}/roles/{ref['name']}")
            status, role = real.request("GET", role_path, admin=True)
            assert status == 200, role
            name = f"{account}-{len(made)}"
            kind = "ClusterRole" if not namespace else "Role"
            meta = {"name": name, **({"namespace": namespace} if namespace else {})}
            roles = f"{RBAC}/clusterroles" if not namespace else f"{RBAC}/namespaces/{namespace}/roles"
            bindings = f"{RBAC}/clusterrolebindings" if not namespace else f"{RBAC}/namespaces/{namespace}/rolebindings"
            _post(real, roles, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": meta,
                                "rules": _less(role.get("rules") or [], verb, resource)})
            made.append(f"{roles}/{name}")
            _post(real, bindings, {
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": f"{kind}Binding", "metadata": meta,
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": "gpufleet"}]})
            made.append(f"{bindings}/{name}")
        assert made, "the control plane's service account is bound to nothing"
        yield real.service_account_token("gpufleet", account)
    finally:
        for path in made:
            real.request("DELETE", path, admin=True)
        real.request("DELETE", f"/api/v1/namespaces/gpufleet/serviceaccounts/{account}", admin=True)


def test_a_missing_verb_is_reported(real_cluster, unique):
    """The real authorizer says no to exactly the rule taken away, and the check reports exactly that row."""
    with control_plane_less(real_cluster, unique, "create", "pods/eviction") as token:
        client = real_cluster.api_client(token)
        try:
            rows = check_access(client, "gpufleet")
        finally:
            client.close()
    missing = [(r.verb, r.what, r.namespace) for r in rows if not r.allowed]
    assert missing == [("create", "pods/eviction", "")]


def _kubeconfig(real: RealCluster, tmp_path, token: str) -> str:
    ca = tmp_path / "ca.crt"
    ca.write_bytes(real.ca_pem)
    path = tmp_path / "kubeconfig.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gpufleet",
        "clusters": [{"name": "real", "cluster": {"server": real.server, "certificate-authority": str(ca)}}],
        "users": [{"name": "gpufleet", "user": {"token": token}}],
        "contexts": [{"name": "gpufleet", "context": {"cluster": "real", "user": "gpufleet"}}]}))
    return str(path)


def test_cli_check_names_the_missing_verb_and_exits_1(real_cluster, unique, tmp_path):
    with control_plane_less(real_cluster, unique, "update", "httproutes") as token:
        result = CliRunner().invoke(
            cluster_app, ["check", "--kubeconfig", _kubeconfig(real_cluster, tmp_path, token), "--no-tunnels"],
            env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    missing_lines = [line for line in result.output.splitlines() if "MISSING" in line]
    assert len(missing_lines) == 1, missing_lines
    assert "update" in missing_lines[0] and "httproutes.gateway.networking.k8s.io" in missing_lines[0]
    assert "1 permission(s) missing" in result.output


def test_cli_check_other_namespace(real_cluster, tmp_path, kubeadm_bindings_restored):
    """The shipped RBAC grants the control plane its namespaced verbs in ``gpufleet`` only."""
    for name in KUBEADM_BINDINGS:  # as the check advises (tests/realk8s/test_blast_radius.py)
        real_cluster.kubectl("delete", "clusterrolebinding", name)
    kubeconfig = _kubeconfig(real_cluster, tmp_path,
                             real_cluster.service_account_token("gpufleet", "gpufleet-control-plane"))
    result = CliRunner().invoke(cluster_app, ["check", "--kubeconfig", kubeconfig, "--no-tunnels"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cluster_app, ["check", "--kubeconfig", kubeconfig, "--no-tunnels", "-n", "serving"])
    assert result.exit_code == 1, result.output
    assert "configmaps" in " ".join(line for line in result.output.splitlines() if "MISSING" in line)


# -- cluster check: may the control plane get the Secrets its fleet config names? -------------
@pytest.fixture
def credentials_role_restored(real_cluster: RealCluster):
    """The test takes away the credentials Role conftest rendered from the shipped example; the
    package's other tests rely on it."""
    yield
    real_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                         input=_render_credentials_role(SHIPPED_SITES))


def _render_credentials_role(config: Path) -> str:
    rendered = CliRunner().invoke(cluster_app, ["credentials-role", "--config", str(config)])
    assert rendered.exit_code == 0, rendered.output
    return rendered.stdout


def _check_credentials(kubeconfig: str, config: Path) -> tuple[int, str]:
    result = CliRunner().invoke(cluster_app, ["check", "--kubeconfig", kubeconfig, "--no-tunnels",
                                              "--config", str(config)], env={"COLUMNS": "400"})
    return result.exit_code, result.output


def _unreadable(output: str) -> dict[str, str]:
    """Secret → the config fields naming it, for each the check says the control plane may not get."""
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in output.splitlines()]
    return {row[1].removeprefix("gpufleet/"): row[2] for row in rows
            if len(row) >= 3 and row[0] == "MISSING" and row[1].startswith("gpufleet/")}


def test_cli_check_names_each_secret_the_control_plane_may_not_get_until_the_role_is_rendered(
        real_cluster, tmp_path, unique, kubeadm_bindings_restored, credentials_role_restored):
    """An operator who applied the base and not the rendered credentials Role: the check, with
    their credentials, fails naming each Secret the config names and the field naming it, and
    prints the command that fixes it; once that is applied, the credentials check passes. A
    Secret's value is never shown (the check reads none)."""
    for name in KUBEADM_BINDINGS:  # as the check advises, so only the credentials decide
        real_cluster.kubectl("delete", "clusterrolebinding", name)
    value = f"never-shown-{unique}"
    real_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "lambda-prod", "namespace": "gpufleet"},
         "type": "Opaque", "stringData": {"api-key": value}}))
    real_cluster.kubectl("-n", "gpufleet", "delete", "role,rolebinding", "gpufleet-credentials")
    named = control_plane_secret_fields(load_config(SHIPPED_SITES))
    assert len(named) > 1, "the example names several Secrets"
    admin = str(real_cluster.admin_kubeconfig)

    code, output = _check_credentials(admin, SHIPPED_SITES)
    assert code == 1, output
    assert "permissions granted" in output and "admission policies enforced" in output, "only the credentials fail"
    assert _unreadable(output) == {secret: ", ".join(fields) for secret, fields in named.items()}
    fix = next(line for line in output.splitlines()
               if line.startswith(f"{len(named)} Secret(s) the control plane may not get")).split(": ")[-1]
    assert fix == f"gpufleet cluster credentials-role --config {SHIPPED_SITES} | kubectl apply -f -"
    assert value not in output

    # The advice, applied as printed.
    real_cluster.kubectl("apply", "-f", "-", input=_render_credentials_role(SHIPPED_SITES))
    code, output = _check_credentials(admin, SHIPPED_SITES)
    assert code == 0, output
    assert f"the control plane may get all {len(named)} Secret(s)" in output
    assert "MISSING" not in output and value not in output


def test_cli_check_names_the_account_added_since_the_role_was_rendered(
        real_cluster, tmp_path, unique, kubeadm_bindings_restored):
    """The Role rendered from the example, then an account added to sites.yaml and the Role not
    rendered again: the check names that account's field and Secret, and only those. Asked with
    the operator's credentials (a SubjectAccessReview) and with the service account's own token
    (which may not create one: it asks of itself), the same answer; with credentials that can do
    neither, a warning, not a failure."""
    for name in KUBEADM_BINDINGS:
        real_cluster.kubectl("delete", "clusterrolebinding", name)
    sites = yaml.safe_load(SHIPPED_SITES.read_text())
    added = next(a for a in sites["accounts"] if a["name"] == "lambda-prod")
    sites["accounts"].append({**added, "name": f"lambda-{unique}",
                              "credentials": {"secret": f"gpufleet/new-{unique}#api-key"}})
    config = tmp_path / "sites.yaml"
    config.write_text(yaml.safe_dump(sites))
    own = _kubeconfig(real_cluster, tmp_path, real_cluster.service_account_token("gpufleet", "gpufleet-control-plane"))

    for kubeconfig in (str(real_cluster.admin_kubeconfig), own):
        code, output = _check_credentials(kubeconfig, config)
        assert code == 1, output
        assert _unreadable(output) == {f"new-{unique}": f"accounts.lambda-{unique}.credentials"}
        assert f"credentials-role --config {config} | kubectl apply -f -" in output

    with control_plane_less(real_cluster, unique, "get", "no-such-resource") as token:
        code, output = _check_credentials(_kubeconfig(real_cluster, tmp_path, token), config)
    assert code == 0, output
    assert "WARNING: not checked whether system:serviceaccount:gpufleet:gpufleet-control-plane may get" in output
    assert "may not create subjectaccessreviews" in output and not _unreadable(output)


# -- pending GPU pods, as kube-scheduler leaves them -----------------------------------------
def _namespace(real: RealCluster, name: str) -> None:
    _post(real, "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


def _gpu_node(real: RealCluster, name: str, gpus: int) -> None:
    """A Node object with GPUs allocatable and a NoSchedule taint nothing here tolerates (the
    scheduler must leave the test's pods Pending; the node is only a nomination's target)."""
    _post(real, "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                                  "spec": {"taints": [{"key": "example.com/test-only", "effect": "NoSchedule"}]}})
    status, answer = real.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": {
        "capacity": {GPU_RESOURCE: str(gpus), "cpu": "8", "memory": "64Gi", "pods": "110"},
        "allocatable": {GPU_RESOURCE: str(gpus), "cpu": "8", "memory": "64Gi", "pods": "110"}}},
        admin=True, content_type="application/merge-patch+json")
    assert status == 200, answer


def _pod(real: RealCluster, namespace: str, name: str, gpus: int = 0, *, node: str = "",
         node_selector: dict | None = None, tolerations: list | None = None, labels: dict | None = None,
         annotations: dict | None = None, limits_only: bool = False) -> None:
    resources = {}
    if gpus:
        resources = {"limits": {GPU_RESOURCE: str(gpus)}} if limits_only else \
            {"requests": {GPU_RESOURCE: str(gpus)}, "limits": {GPU_RESOURCE: str(gpus)}}
    spec = {"containers": [{"name": "server", "image": "registry.invalid/vllm:1", "resources": resources}],
            "nodeSelector": node_selector or {}, "tolerations": tolerations or [],
            "terminationGracePeriodSeconds": 0}
    if node:
        spec["nodeName"] = node
    _post(real, f"/api/v1/namespaces/{namespace}/pods", {
        "apiVersion": "v1", "kind": "Pod", "spec": spec,
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}, "annotations": annotations or {}}})


def _pod_status(real: RealCluster, namespace: str, name: str, status: dict) -> None:
    code, answer = real.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": status},
                                admin=True, content_type="application/merge-patch+json")
    assert code == 200, answer


def _unschedulable(real: RealCluster, namespace: str, name: str) -> bool:
    _, pod = real.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}", admin=True)
    return any(c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable"
               for c in pod.get("status", {}).get("conditions") or [])


def _wait(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds:.0f} s: {what}")
        time.sleep(0.2)


def _cleanup(real: RealCluster, namespaces: list[str], nodes: list[str]) -> None:
    for namespace in namespaces:
        real.request("DELETE", f"/api/v1/namespaces/{namespace}", admin=True)
    for node in nodes:
        real.request("DELETE", f"/api/v1/nodes/{node}", admin=True)


def test_the_adapter_lists_pending_gpu_pods_with_field_selectors(real_cluster, kube, unique):
    ml, other, node = f"ml-{unique}", f"other-{unique}", f"n1-{unique}"
    for namespace in (ml, other):
        _namespace(real_cluster, namespace)
    _gpu_node(real_cluster, node, 8)
    try:
        _pod(real_cluster, ml, "want", 2, labels={LABEL_MODEL: "llm"},
             annotations={"gpufleet.io/max-price-per-gpu-hour": "3", "other": "x"}, **OPT_IN)
        _pod(real_cluster, ml, "limits", 4, limits_only=True, **OPT_IN)
        _pod(real_cluster, ml, "nominated", 1, **OPT_IN)
        # Not opted in to the fleet; a selector no node carries keeps it Pending here.
        _pod(real_cluster, other, "plain", 1, node_selector={"example.com/nowhere": "true"})
        _pod(real_cluster, ml, "cpu-only", node=node, tolerations=[{"operator": "Exists"}])  # bound, no GPUs
        _pod(real_cluster, ml, "finished", 1, node=node, tolerations=[{"operator": "Exists"}])
        _pod_status(real_cluster, ml, "finished", {"phase": "Succeeded"})
        _pod(real_cluster, ml, "serving", 1, node=node, tolerations=[{"operator": "Exists"}])  # placed, running
        _pod_status(real_cluster, ml, "serving", {"phase": "Running"})
        for namespace, name in ((ml, "want"), (ml, "limits"), (ml, "nominated"), (other, "plain")):
            _wait(lambda: _unschedulable(real_cluster, namespace, name), 30, f"{name} marked Unschedulable")
        # A preemption in progress, as the scheduler records it.
        _pod_status(real_cluster, ml, "nominated", {"nominatedNodeName": node})

        seen = record_requests(kube)
        ours = (ml, other)
        pending = {p.key: p for p in kube.list_gpu_pods(pending_only=True) if p.namespace in ours}
        assert set(pending) == {f"{ml}/want", f"{ml}/limits", f"{ml}/nominated", f"{other}/plain"}
        want = pending[f"{ml}/want"]
        assert (want.gpus, want.model, want.unschedulable, want.node) == (2, "llm", True, "")
        assert want.annotations == {"gpufleet.io/max-price-per-gpu-hour": "3"}
        assert opted_in(want) and not opted_in(pending[f"{other}/plain"])
        assert pending[f"{ml}/limits"].gpus == 4
        assert pending[f"{ml}/nominated"].nominated_node == node
        # Every GPU pod that has not finished: the running one too; the finished one and the
        # CPU-only one are not listed.
        every = {p.key: p for p in kube.list_gpu_pods() if p.namespace in ours}
        assert set(every) == set(pending) | {f"{ml}/serving"}
        assert every[f"{ml}/serving"].node == node
        pods = [r for r in seen if r[1].endswith("/pods")]
        assert pods and all(r[0] == "GET" and "fieldSelector" in r[2] for r in pods), pods
    finally:
        _cleanup(real_cluster, [ml, other], [node])


def test_the_adapter_watches_pending_gpu_pods_with_a_real_watch(real_cluster, kube, unique):
    ml, node = f"ml-{unique}", f"n1-{unique}"
    _namespace(real_cluster, ml)
    _gpu_node(real_cluster, node, 8)
    try:
        _pod(real_cluster, ml, "cpu-only", node=node, tolerations=[{"operator": "Exists"}])
        changer = threading.Thread(target=lambda: (time.sleep(1), _pod(real_cluster, ml, "want", 2, **OPT_IN)),
                                   daemon=True)
        seen = record_requests(kube)
        changer.start()
        pods = kube.watch_gpu_pods(lambda pods: any(p.key == f"{ml}/want" for p in pods), timeout_s=30,
                                   recheck_s=10)
        changer.join()
        assert [p.key for p in pods if p.namespace == ml] == [f"{ml}/want"], "GPU pods only"
        on_pods = [r for r in seen if r[1].endswith("/pods")]
        assert any("watch=" in r[2] for r in on_pods), "a watch, not a list every look"
        assert sum("watch=" not in r[2] for r in on_pods) == 1, f"one list, then the watch: {on_pods}"
    finally:
        _cleanup(real_cluster, [ml], [node])


def test_a_gpu_pod_watch_asks_again_at_its_wake_time_and_resumes_from_its_version(real_cluster, kube, unique):
    """``wake_at`` (what the Demand watch's batch window is): a read that would wait past it is cut
    there and ``until`` asked with no event, the watch going on from the last version it saw: pods
    made across those cuts each arrive, with one list and no watch resumed from an older version."""
    ml, node = f"ml-{unique}", f"n1-{unique}"
    _namespace(real_cluster, ml)
    _gpu_node(real_cluster, node, 8)
    names = [f"p{i}" for i in range(4)]
    try:
        def make() -> None:
            for name in names:
                time.sleep(0.7)
                _pod(real_cluster, ml, name, 1, **OPT_IN)

        asked: list[float] = []

        def all_there(pods) -> bool:
            asked.append(time.monotonic())
            return {p.key for p in pods if p.namespace == ml} == {f"{ml}/{name}" for name in names}

        changer = threading.Thread(target=make, daemon=True)
        seen = record_requests(kube)
        changer.start()
        started = time.monotonic()
        pods = kube.watch_gpu_pods(all_there, timeout_s=30, recheck_s=10, wake_at=lambda: time.monotonic() + 0.25)
        changer.join()
        assert sorted(p.key for p in pods if p.namespace == ml) == [f"{ml}/{name}" for name in names]
        on_pods = [r for r in seen if r[1].endswith("/pods")]
        assert sum("watch=" not in r[2] for r in on_pods) == 1, f"one list, then the watch: {on_pods}"
        versions = [int(parse_qs(r[2])["resourceVersion"][0]) for r in on_pods if "watch=" in r[2]]
        assert len(versions) > len(names), f"reads cut at the wake time: {on_pods}"
        assert versions == sorted(versions), f"each chunk from the last version seen: {versions}"
        quiet = [b - a for a, b in zip(asked, asked[1:])]
        assert max(quiet) < 1.5, f"asked at the wake time, not at the chunk's end ({time.monotonic() - started:.1f}s)"
    finally:
        _cleanup(real_cluster, [ml], [node])


# -- cluster check's blast-radius rows, read from the real objects ----------------------------
ADMISSION = "/apis/admissionregistration.k8s.io/v1"


@pytest.fixture
def admission_policy_restored(real_cluster: RealCluster):
    """The test takes the shipped admission policy away; the package's other tests rely on it."""
    yield
    real_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                         str(REPO / "deploy" / "kubernetes" / "admission-policy.yaml"))


def _rows(kube: KubernetesCluster) -> dict:
    return {row.what: row for row in check_hardening(kube.api_client)}


def test_kubeadms_auto_approve_bindings_are_reported_with_the_command_that_removes_them(
        real_cluster, kube, kubeadm_bindings_restored) -> None:
    rows = _rows(kube)
    bootstrap = rows[f"clusterrolebinding {KUBEADM_AUTOAPPROVE_BOOTSTRAP}"]
    rotation = rows[f"clusterrolebinding {KUBEADM_AUTOAPPROVE_ROTATION}"]
    assert not bootstrap.ok and "ANY node name" in bootstrap.state and "kubeadm upgrade apply" in bootstrap.state
    assert bootstrap.fix == f"kubectl delete clusterrolebinding {KUBEADM_AUTOAPPROVE_BOOTSTRAP}"
    assert not rotation.ok and "never ends" in rotation.state
    for policy in ADMISSION_POLICIES:
        assert rows[f"validatingadmissionpolicy {policy}"].ok
        assert rows[f"validatingadmissionpolicybinding {policy}"].ok

    real_cluster.kubectl("delete", "clusterrolebinding", KUBEADM_AUTOAPPROVE_BOOTSTRAP)
    rows = _rows(kube)
    assert rows[f"clusterrolebinding {KUBEADM_AUTOAPPROVE_BOOTSTRAP}"].ok
    assert not rows[f"clusterrolebinding {KUBEADM_AUTOAPPROVE_ROTATION}"].ok, "each binding on its own"


@pytest.mark.parametrize("policy", list(ADMISSION_POLICIES))
def test_a_missing_or_auditing_policy_is_not_a_fence(real_cluster, kube, admission_policy_restored, policy) -> None:
    status, answer = real_cluster.request(
        "PATCH", f"{ADMISSION}/validatingadmissionpolicybindings/{policy}",
        {"spec": {"validationActions": ["Audit"]}}, admin=True, content_type="application/merge-patch+json")
    assert status == 200, answer
    auditing = _rows(kube)[f"validatingadmissionpolicybinding {policy}"]
    assert not auditing.ok and "denies nothing" in auditing.state

    for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
        status, answer = real_cluster.request("DELETE", f"{ADMISSION}/{kind}/{policy}", admin=True)
        assert status == 200, answer
    rows = _rows(kube)
    gone = rows[f"validatingadmissionpolicy {policy}"]
    assert not gone.ok and gone.state == f"missing: {ADMISSION_POLICIES[policy]}"
    missing = rows[f"validatingadmissionpolicybinding {policy}"]
    assert not missing.ok and "admission-policy.yaml" in missing.fix
    for other in set(ADMISSION_POLICIES) - {policy}:
        assert rows[f"validatingadmissionpolicy {other}"].ok, "each policy on its own"


def test_a_binding_the_check_may_not_read_is_not_vouched_for(real_cluster, unique) -> None:
    """RBAC that lags the code: the real authorizer's 403 on the binding's read is no all-clear."""
    with control_plane_less(real_cluster, unique, "get", "clusterrolebindings") as token:
        client = real_cluster.api_client(token)
        try:
            rows = {row.what: row for row in check_hardening(client)}
        finally:
            client.close()
    row = rows[f"clusterrolebinding {KUBEADM_AUTOAPPROVE_BOOTSTRAP}"]
    assert not row.ok and "403" in row.state
