"""``gpufleet cluster check``'s blast-radius rows, against the fake API server: kubeadm's two
auto-approve bindings are reported with the command that removes them, the Secret admission
policy must be installed and bound with Deny, and the check's own reads are granted by name only.
(The same on a real control plane: tests/realk8s/test_blast_radius.py.)"""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from cli.cluster import cluster_app
from providers.cluster.check import (
    ADMISSION_POLICY,
    CHECK_ACCESS,
    CHECK_NAMES,
    KUBEADM_AUTOAPPROVE_BOOTSTRAP,
    KUBEADM_AUTOAPPROVE_ROTATION,
    check_hardening,
)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
ADMISSION = "admissionregistration.k8s.io"
RBAC = "rbac.authorization.k8s.io"
runner = CliRunner()


def install_admission_policy(fake) -> None:
    """What `kubectl apply -k deploy/kubernetes` installs: the shipped policy and binding."""
    for doc in yaml.safe_load_all((DEPLOY / "admission-policy.yaml").read_text()):
        resource = {"ValidatingAdmissionPolicy": "validatingadmissionpolicies",
                    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings"}[doc["kind"]]
        fake.put(ADMISSION, resource, doc)


def kubeadm_binding(fake, name: str, group: str, role: str) -> None:
    """As `kubeadm init` (and every `kubeadm upgrade apply`) creates it."""
    fake.put(RBAC, "clusterrolebindings", {
        "apiVersion": f"{RBAC}/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
        "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": role},
        "subjects": [{"apiGroup": RBAC, "kind": "Group", "name": group}]})


def kubeadm_bindings(fake) -> None:
    kubeadm_binding(fake, KUBEADM_AUTOAPPROVE_BOOTSTRAP, "system:bootstrappers:kubeadm:default-node-token",
                    "system:certificates.k8s.io:certificatesigningrequests:nodeclient")
    kubeadm_binding(fake, KUBEADM_AUTOAPPROVE_ROTATION, "system:nodes",
                    "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient")


def rows_by_what(fake) -> dict:
    return {row.what: row for row in check_hardening(fake.api_client())}


def test_kubeadms_auto_approve_bindings_are_reported_with_the_command_that_removes_them(fake) -> None:
    install_admission_policy(fake)
    kubeadm_bindings(fake)
    rows = rows_by_what(fake)
    bootstrap = rows[f"clusterrolebinding {KUBEADM_AUTOAPPROVE_BOOTSTRAP}"]
    rotation = rows[f"clusterrolebinding {KUBEADM_AUTOAPPROVE_ROTATION}"]
    assert not bootstrap.ok and "ANY node name" in bootstrap.state and "kubeadm upgrade apply" in bootstrap.state
    assert bootstrap.fix == f"kubectl delete clusterrolebinding {KUBEADM_AUTOAPPROVE_BOOTSTRAP}"
    assert not rotation.ok and "never ends" in rotation.state
    assert rows[f"validatingadmissionpolicy {ADMISSION_POLICY}"].ok
    assert rows[f"validatingadmissionpolicybinding {ADMISSION_POLICY}"].ok

    fake.store.pop((RBAC, "clusterrolebindings", "", KUBEADM_AUTOAPPROVE_BOOTSTRAP))
    rows = rows_by_what(fake)
    assert rows[f"clusterrolebinding {KUBEADM_AUTOAPPROVE_BOOTSTRAP}"].ok
    assert not rows[f"clusterrolebinding {KUBEADM_AUTOAPPROVE_ROTATION}"].ok, "each binding on its own"


def test_a_missing_or_auditing_policy_is_not_a_fence(fake) -> None:
    rows = rows_by_what(fake)
    assert not rows[f"validatingadmissionpolicy {ADMISSION_POLICY}"].ok
    missing = rows[f"validatingadmissionpolicybinding {ADMISSION_POLICY}"]
    assert not missing.ok and "admission-policy.yaml" in missing.fix
    install_admission_policy(fake)
    binding = fake.store[(ADMISSION, "validatingadmissionpolicybindings", "", ADMISSION_POLICY)]
    binding["spec"]["validationActions"] = ["Audit"]
    auditing = rows_by_what(fake)[f"validatingadmissionpolicybinding {ADMISSION_POLICY}"]
    assert not auditing.ok and "denies nothing" in auditing.state


def test_a_binding_the_check_may_not_read_is_not_vouched_for(fake) -> None:
    install_admission_policy(fake)
    fake.forbid("get", "clusterrolebindings", group=RBAC)
    row = rows_by_what(fake)[f"clusterrolebinding {KUBEADM_AUTOAPPROVE_BOOTSTRAP}"]
    assert not row.ok and "403" in row.state


def test_the_cli_exits_1_while_a_kubeadm_binding_is_there_and_0_once_removed(fake, tmp_path) -> None:
    install_admission_policy(fake)
    kubeadm_bindings(fake)
    kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
    result = runner.invoke(cluster_app, ["check", "--kubeconfig", kubeconfig, "--no-tunnels"],
                           env={"COLUMNS": "400"})
    assert result.exit_code == 1, result.output
    assert "permissions granted" in result.output, "the permissions themselves are fine"
    assert (f"kubectl delete clusterrolebinding {KUBEADM_AUTOAPPROVE_BOOTSTRAP} {KUBEADM_AUTOAPPROVE_ROTATION}"
            in result.output.replace("\n", ""))
    for name in (KUBEADM_AUTOAPPROVE_BOOTSTRAP, KUBEADM_AUTOAPPROVE_ROTATION):
        fake.store.pop((RBAC, "clusterrolebindings", "", name))
    result = runner.invoke(cluster_app, ["check", "--kubeconfig", kubeconfig, "--no-tunnels"],
                           env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "admission policy enforced" in result.output


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
