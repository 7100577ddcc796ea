"""``gpufleet cluster check``'s blast-radius rows, from the shipped files: the check's own reads are
granted by name only, the Secret admission policy names gpufleet's group and service account, the
node-marks policy judges every kubelet's writes on its Node, and the mirror-pod policy keeps a
node's own pods out of every pod selector gpufleet ships or renders.
What the check reports from the objects themselves (kubeadm's two auto-approve bindings with the
command that removes them, a missing or auditing policy, a binding it may not read) is read from
a real control plane: tests/realk8s/test_adapter.py and tests/realk8s/test_blast_radius.py."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path
from typing import Any, Iterator

import yaml

from fleet.cluster import ServingSpec
from providers.cluster.check import (
    ADMISSION_POLICIES,
    ADMISSION_POLICY,
    CHECK_ACCESS,
    CHECK_NAMES,
    MIRROR_PODS_POLICY,
    NODE_MARKS_POLICY,
)
from providers.cluster.kubernetes import render_deployment, render_model_service, render_pdb, render_service

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
ADMISSION = "admissionregistration.k8s.io"


def install_admission_policy(fake) -> None:
    """What `kubectl apply -k deploy/kubernetes` installs: the shipped policy and binding (into the
    fake API server, for tests/cluster/test_network.py's Konnectivity tests)."""
    for doc in yaml.safe_load_all((DEPLOY / "admission-policy.yaml").read_text()):
        resource = {"ValidatingAdmissionPolicy": "validatingadmissionpolicies",
                    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings"}[doc["kind"]]
        fake.put(ADMISSION, resource, doc)


def shipped(name: str) -> tuple[dict, dict]:
    """The shipped policy ``name`` and its binding."""
    docs = list(yaml.safe_load_all((DEPLOY / "admission-policy.yaml").read_text()))
    [policy] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == name]
    [binding] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding" and d["metadata"]["name"] == name]
    return policy, binding


def test_the_checks_reads_are_granted_by_name_only() -> None:
    """The control plane may read kubeadm's two bindings and its own policy, not every binding."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text()) if d]
    [role] = [d for d in docs if d["kind"] == "ClusterRole"
              and d["metadata"].get("labels", {}).get("gpufleet.io/rbac-for") == "cluster-check"]
    granted = {(verb, group, resource, name) for rule in role["rules"] for verb in rule["verbs"]
               for group in rule["apiGroups"] for resource in rule["resources"] for name in rule["resourceNames"]}
    used = {(r.verb, r.group, r.resource, name) for r in CHECK_ACCESS for name in CHECK_NAMES[r.resource]}
    assert granted == used
    [binding] = [d for d in docs if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == role["metadata"]["name"]]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpufleet-control-plane", "namespace": "gpufleet"}]


def test_the_admission_policy_names_gpufleets_group_and_service_account() -> None:
    """The policy's CEL spells gpufleet's token group raw and in base64 (how the API server hands
    Secret data to it) and matches the service account rbac.yaml binds: all three must follow
    the code, or every join is refused (or the fence matches nobody)."""
    import base64

    from providers.cluster.bootstrap import BOOTSTRAP_GROUP

    policy, binding = shipped(ADMISSION_POLICY)
    [groups] = [v["expression"] for v in policy["spec"]["validations"] if "auth-extra-groups" in v["expression"]]
    assert f"'{BOOTSTRAP_GROUP}'" in groups and f"'{base64.b64encode(BOOTSTRAP_GROUP.encode()).decode()}'" in groups
    [who] = policy["spec"]["matchConditions"]
    assert who["expression"] == "request.userInfo.username == 'system:serviceaccount:gpufleet:gpufleet-control-plane'"
    assert binding["spec"] == {"policyName": ADMISSION_POLICY, "validationActions": ["Deny"]}
    assert policy["metadata"]["name"] == ADMISSION_POLICY


def test_the_check_reads_every_shipped_policy_and_the_node_marks_policy_judges_every_node() -> None:
    """The check looks for each policy the base ships; the node-marks policy judges every kubelet
    (group system:nodes) on its Node and its status, and denies (Fail: no node write unjudged)."""
    docs = list(yaml.safe_load_all((DEPLOY / "admission-policy.yaml").read_text()))
    assert {d["metadata"]["name"] for d in docs} == set(ADMISSION_POLICIES)
    policy, binding = shipped(NODE_MARKS_POLICY)
    assert binding["spec"] == {"policyName": NODE_MARKS_POLICY, "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    [who] = policy["spec"]["matchConditions"]
    assert who["expression"] == "'system:nodes' in request.userInfo.groups"
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["nodes", "nodes/status"] and rule["operations"] == ["CREATE", "UPDATE"]


# -- a node's own pods ---------------------------------------------------------------------------
#: The mirror-pod policy's rules, which ``node_pod_refusal`` reads in Python (kept equal here: a
#: change to the CEL must change that reading too). The real API server runs the CEL itself in
#: tests/realk8s/test_mirror_pods.py.
MIRROR_POD_RULES = {
    "namespace": "!(request.namespace in variables.ownNamespaces)",
    "label key": "!variables.labels.exists(k, variables.ownKeyPrefixes.exists(p, k.startsWith(p)))",
    "label value": ("!variables.labels.exists(k, k in variables.selectedValues && "
                    "variables.labels[k] in variables.selectedValues[k])"),
}


def mirror_pod_lists() -> dict[str, Any]:
    """The policy's lists (CEL's list and map literals of strings read as Python's)."""
    policy, _ = shipped(MIRROR_PODS_POLICY)
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    return {name: ast.literal_eval(variables[name]) for name in ("ownNamespaces", "ownKeyPrefixes", "selectedValues")}


def node_pod_refusal(namespace: str, labels: dict[str, str]) -> str:
    """Which rule of the shipped mirror-pod policy refuses a pod a node creates in ``namespace``
    with ``labels`` (a key of ``MIRROR_POD_RULES``), or "" when it lets it through."""
    lists = mirror_pod_lists()
    if namespace in lists["ownNamespaces"]:
        return "namespace"
    if any(key.startswith(prefix) for key in labels for prefix in lists["ownKeyPrefixes"]):
        return "label key"
    if any(labels[key] in lists["selectedValues"].get(key, ()) for key in labels):
        return "label value"
    return ""


def test_the_mirror_pod_policy_judges_every_pod_a_node_creates() -> None:
    """Every kubelet's credential (either mark of a node), on every pod it creates, denied (Fail:
    none unjudged); its rules are the ones ``node_pod_refusal`` reads."""
    policy, binding = shipped(MIRROR_PODS_POLICY)
    assert binding["spec"] == {"policyName": MIRROR_PODS_POLICY, "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    [who] = policy["spec"]["matchConditions"]
    assert who["expression"] == ("'system:nodes' in request.userInfo.groups || "
                                 "request.userInfo.username.startsWith('system:node:')")
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["resources"], rule["operations"]) == ([""], ["pods"], ["CREATE"])
    [labels] = [v["expression"] for v in policy["spec"]["variables"] if v["name"] == "labels"]
    assert labels == "object.metadata.?labels.orValue({})"
    assert [v["expression"] for v in policy["spec"]["validations"]] == list(MIRROR_POD_RULES.values())
    assert {v["reason"] for v in policy["spec"]["validations"]} == {"Forbidden"}


def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict) and "kind" in d]


#: Kinds whose selectors pick Services, not pods: the Services they pick are judged themselves.
SELECTS_SERVICES = {"ServiceMonitor"}


def _found(tree: Any, keys: set[str], path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Each (path, value) under a key of ``keys``, anywhere in ``tree``."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key in keys:
                yield (*path, key), value
            yield from _found(value, keys, (*path, key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _found(value, keys, (*path, i))


def _namespace_of(selector: dict[str, Any]) -> str:
    """The namespace a NetworkPolicy peer's namespaceSelector names (by its name label only)."""
    assert set(selector) == {"matchLabels"} and set(selector["matchLabels"]) == {"kubernetes.io/metadata.name"}, (
        f"a namespaceSelector this test cannot resolve: {selector}")
    return selector["matchLabels"]["kubernetes.io/metadata.name"]


def pod_selectors(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(namespace, label selector) of every way ``doc`` picks pods: a Service's selector, a
    workload's or a PodDisruptionBudget's, a pod template's spread and affinity terms, and a
    NetworkPolicy's pods and peers (a peer's namespace resolved from its namespaceSelector)."""
    if doc["kind"] in SELECTS_SERVICES:
        return []
    namespace = doc.get("metadata", {}).get("namespace", "")
    found = list(_found(doc, {"selector", "podSelector", "labelSelector", "namespaceSelector"}))
    if doc["kind"] != "NetworkPolicy":
        assert not [p for p, _ in found if p[-1] == "namespaceSelector"], f"{doc['kind']}: teach this test"
        return [(namespace, {"matchLabels": value} if doc["kind"] == "Service" else value)
                for _, value in found if value is not None]
    selectors = []
    for path, value in found:
        if path == ("spec", "podSelector"):
            selectors.append((namespace, value))
        elif path[-1] == "namespaceSelector":
            peer = doc
            for step in path[:-1]:
                peer = peer[step]
            selectors.append((_namespace_of(value), peer.get("podSelector") or {}))
        elif path[-1] == "podSelector":
            peer = doc
            for step in path[:-1]:
                peer = peer[step]
            if "namespaceSelector" not in peer:
                selectors.append((namespace, value))
        else:
            raise AssertionError(f"NetworkPolicy {path}: teach this test")
    return selectors


def fewest_labels(selector: dict[str, Any]) -> Iterator[dict[str, str]]:
    """Every smallest label set a pod matching ``selector`` could carry (one per choice of each
    ``In`` term's values): the policy's rules only refuse more as labels are added, so refusing
    these refuses every pod the selector matches."""
    required = dict(selector.get("matchLabels") or {})
    choices = []
    for term in selector.get("matchExpressions") or []:
        if term["operator"] == "In":
            choices.append([(term["key"], value) for value in term["values"]])
        elif term["operator"] == "Exists":
            choices.append([(term["key"], "any")])
        else:
            assert term["operator"] in ("NotIn", "DoesNotExist"), term  # add no label
    for picked in itertools.product(*choices):
        yield {**required, **dict(picked)}


#: Not in gpufleet's namespaces: serving may be rendered into any (the adapter's ``namespace``).
ELSEWHERE = "team-serving"


def shipped_and_rendered() -> list[tuple[str, dict[str, Any]]]:
    """(where, object) of every manifest deploy/ ships (the Helm chart renders the same objects as
    the kustomize base: tests/test_helm.py) and every object the adapter renders for serving."""
    objects = [(str(path.relative_to(DEPLOY.parent)), doc) for path in sorted(DEPLOY.parent.rglob("*.yaml"))
               if "helm" not in path.parts for doc in _yaml_docs(path)]
    spec = ServingSpec(model="llama-3-8b", site="site-a", image="registry.invalid/serve:1")
    objects += [("render_deployment", render_deployment(spec, ELSEWHERE)),
                ("render_service", render_service(spec.model, spec.site, ELSEWHERE)),
                ("render_model_service", render_model_service(spec.model, ELSEWHERE)),
                ("render_pdb", render_pdb(spec.model, spec.site, ELSEWHERE))]
    return objects


def test_no_pod_selector_gpufleet_ships_or_renders_can_pick_a_pod_a_node_made() -> None:
    """A node's own pod joins whatever selects its labels. Every pod selector of the shipped
    manifests (the gateway's and the control plane's Services, the node agent's, the frontend's
    NetworkPolicy, CoreDNS's spread) and of the adapter's serving objects, rendered into a namespace
    not gpufleet's, picks only pods the mirror-pod policy refuses a node. By the labels it requires
    alone, wherever it is applied (Temporal installed in another namespace, serving rendered into
    one), but a selector of every pod of a namespace: that namespace's. A new selector the
    policy's lists miss fails here."""
    judged, uncovered = [], []
    for where, doc in shipped_and_rendered():
        for namespace, selector in pod_selectors(doc):
            for labels in fewest_labels(selector):
                judged.append((where, namespace, labels))
                refused = node_pod_refusal(ELSEWHERE, labels) if labels else node_pod_refusal(namespace, labels)
                if not refused:
                    uncovered.append(f"{where}: {doc['kind']} {doc['metadata'].get('name')} in {namespace!r} "
                                     f"picks {labels}")
    assert uncovered == []
    # The selectors the finding named are among those judged (the enumeration found them).
    picked = {(namespace, tuple(sorted(labels.items()))) for _, namespace, labels in judged}
    assert ("gpufleet", (("app.kubernetes.io/name", "gpufleet-node-gateway"),)) in picked
    assert ("gpufleet", (("app.kubernetes.io/name", "gpufleet-control-plane"),)) in picked
    assert ("temporal", ()) in picked, "the frontend's NetworkPolicy: every pod of Temporal's namespace"
    assert (ELSEWHERE, (("gpufleet.io/model", "llama-3-8b"),
                        ("node-restriction.kubernetes.io/gpufleet-site", "site-a"))) in picked
    assert ("kube-system", (("k8s-app", "kube-dns"),)) in picked


def test_the_mirror_pod_policys_namespaces_are_gpufleets_and_temporals() -> None:
    """The namespaces the base creates, and the one Temporal's NetworkPolicies are applied into."""
    namespaces = {d["metadata"]["name"] for d in _yaml_docs(DEPLOY / "namespaces.yaml")}
    temporal = {d["metadata"]["namespace"] for d in _yaml_docs(DEPLOY.parent / "temporal" / "network-policy.yaml")}
    assert set(mirror_pod_lists()["ownNamespaces"]) == namespaces | temporal


def test_other_static_pods_stay_allowed() -> None:
    """The control-plane hosts' own static pods (kubeadm's, gpufleet's Konnectivity server) and an
    operator's agent in its own namespace: no selector of gpufleet's picks them."""
    [server] = _yaml_docs(DEPLOY.parent / "network" / "konnectivity" / "control-plane" / "konnectivity-server.yaml")
    assert node_pod_refusal(server["metadata"]["namespace"], server["metadata"]["labels"]) == ""
    assert node_pod_refusal("kube-system", {"component": "kube-apiserver", "tier": "control-plane"}) == ""
    assert node_pod_refusal("monitoring", {"app.kubernetes.io/name": "node-exporter"}) == ""
