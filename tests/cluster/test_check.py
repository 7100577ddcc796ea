"""``providers.cluster.check`` and ``gpufleet cluster check`` against the fake server."""

from __future__ import annotations

from typer.testing import CliRunner

from cli.cluster import cluster_app
from providers.cluster.check import check_access
from providers.cluster.kubernetes import ACCESS
from tests.cluster.test_cluster_check import install_admission_policy

runner = CliRunner()


def test_every_permission_is_asked_and_granted(fake):
    rows = check_access(fake.api_client(), "gpufleet")
    assert len(rows) == len(ACCESS)
    assert all(row.allowed for row in rows)
    asked = [r for r in fake.requests if r[2] == "selfsubjectaccessreviews"]
    # The approve grant is limited to the two kubelet signers: asked for each by name.
    assert len(asked) == len(ACCESS) + 1
    assert {r.namespace for r in rows} == {"", "kube-system", "kube-public", "gpufleet-bootstrap", "gpufleet"}


def test_a_missing_verb_is_reported(fake):
    fake.deny("create", "pods", subresource="eviction")
    rows = check_access(fake.api_client(), "gpufleet")
    missing = [(r.verb, r.what, r.namespace) for r in rows if not r.allowed]
    assert missing == [("create", "pods/eviction", "")]


def test_cli_check_passes(fake, tmp_path):
    install_admission_policy(fake)
    # A cluster with its Konnectivity tunnels up (tests/cluster/test_network.py covers them).
    fake.add_pod("cp-1", "konnectivity-server-cp-1", "kube-system", owner_kind="", mirror=True)
    fake.set_pod_ready("kube-system", "konnectivity-server-cp-1")
    result = runner.invoke(cluster_app, ["check", "--kubeconfig", fake.kubeconfig(tmp_path / "kubeconfig")])
    assert result.exit_code == 0, result.output
    assert f"all {len(ACCESS)} permissions granted" in result.output


def test_cli_check_names_the_missing_verb_and_exits_1(fake, tmp_path):
    fake.deny("update", "httproutes", group="gateway.networking.k8s.io", namespace="gpufleet")
    result = runner.invoke(
        cluster_app, ["check", "--kubeconfig", fake.kubeconfig(tmp_path / "kubeconfig"), "--no-tunnels"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 1, result.output
    missing_lines = [line for line in result.output.splitlines() if "MISSING" in line]
    assert len(missing_lines) == 1
    assert "update" in missing_lines[0] and "httproutes.gateway.networking.k8s.io" in missing_lines[0]
    assert "1 permission(s) missing" in result.output


def test_cli_check_other_namespace(fake, tmp_path):
    install_admission_policy(fake)
    fake.deny("get", "configmaps", namespace="serving")
    kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
    assert runner.invoke(cluster_app, ["check", "--kubeconfig", kubeconfig, "--no-tunnels"]).exit_code == 0
    assert runner.invoke(cluster_app, ["check", "--kubeconfig", kubeconfig, "--no-tunnels",
                                       "-n", "serving"]).exit_code == 1


def test_cli_check_unreachable_exits_2(fake, tmp_path):
    kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
    fake.stop()
    result = runner.invoke(cluster_app, ["check", "--kubeconfig", kubeconfig])
    assert result.exit_code == 2, result.output
    assert "cannot check the cluster" in result.output
