"""``gpufleet cluster check``'s blast-radius rows, from the shipped files: the check's own reads are
granted by name only, and the Secret admission policy names gpufleet's group and service account.
What the check reports from the objects themselves (kubeadm's two auto-approve bindings with the
command that removes them, a missing or auditing policy, a binding it may not read) is read from
a real control plane: tests/realk8s/test_adapter.py and tests/realk8s/test_blast_radius.py."""

from __future__ import annotations

from pathlib import Path

import yaml

from providers.cluster.check import ADMISSION_POLICY, CHECK_ACCESS, CHECK_NAMES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
ADMISSION = "admissionregistration.k8s.io"


def install_admission_policy(fake) -> None:
    """What `kubectl apply -k deploy/kubernetes` installs: the shipped policy and binding (into the
    fake API server, for tests/cluster/test_network.py's Konnectivity tests)."""
    for doc in yaml.safe_load_all((DEPLOY / "admission-policy.yaml").read_text()):
        resource = {"ValidatingAdmissionPolicy": "validatingadmissionpolicies",
                    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings"}[doc["kind"]]
        fake.put(ADMISSION, resource, doc)


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

    policy, binding = yaml.safe_load_all((DEPLOY / "admission-policy.yaml").read_text())
    [groups] = [v["expression"] for v in policy["spec"]["validations"] if "auth-extra-groups" in v["expression"]]
    assert f"'{BOOTSTRAP_GROUP}'" in groups and f"'{base64.b64encode(BOOTSTRAP_GROUP.encode()).decode()}'" in groups
    [who] = policy["spec"]["matchConditions"]
    assert who["expression"] == "request.userInfo.username == 'system:serviceaccount:gpufleet:gpufleet-control-plane'"
    assert binding["spec"] == {"policyName": ADMISSION_POLICY, "validationActions": ["Deny"]}
    assert policy["metadata"]["name"] == ADMISSION_POLICY
