"""``gpufleet cluster check``'s blast-radius rows, from the shipped files: the check's own reads are
granted by name only, the Secret admission policy names gpufleet's group and service account, and
the node-marks policy judges every kubelet's writes on its Node.
What the check reports from the objects themselves (kubeadm's two auto-approve bindings with the
command that removes them, a missing or auditing policy, a binding it may not read) is read from
a real control plane: tests/realk8s/test_adapter.py and tests/realk8s/test_blast_radius.py."""

from __future__ import annotations

from pathlib import Path

import yaml

from providers.cluster.check import ADMISSION_POLICIES, ADMISSION_POLICY, CHECK_ACCESS, CHECK_NAMES, NODE_MARKS_POLICY

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
