"""``gpufleet cluster check`` with nothing answering: one line, exit 2.

What the check asks and how it reports a missing verb is answered by the real authorizer:
``tests/realk8s/test_adapter.py`` (and the kubeadm bindings, ``tests/realk8s/test_blast_radius.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli.cluster import cluster_app
from tests.ports import free_port

runner = CliRunner()


def test_cli_check_unreachable_exits_2(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "nowhere",
        # A loopback port nothing listens on: the connection is refused at once.
        "clusters": [{"name": "nowhere", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}],
        "users": [{"name": "someone", "user": {"token": "x"}}],
        "contexts": [{"name": "nowhere", "context": {"cluster": "nowhere", "user": "someone"}}]}))
    result = runner.invoke(cluster_app, ["check", "--kubeconfig", str(kubeconfig)])
    assert result.exit_code == 2, result.output
    assert "cannot check the cluster" in result.output


@pytest.mark.parametrize("token", ["gpufleet-t0ken-3f9c1e7a\n", "gpufleet-t0ken-3f9c1e7a\nrest"],
                         ids=["trailing-newline", "line-break"])
def test_cli_check_never_prints_the_token(tmp_path, token):
    """http.client refuses a token with a line break in the Authorization header, with an error
    quoting it whole; a trailing newline (`kubectl create token ... > file`) is trimmed and sent."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "nowhere",
        "clusters": [{"name": "nowhere", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}],
        "users": [{"name": "someone", "user": {"token": token}}],
        "contexts": [{"name": "nowhere", "context": {"cluster": "nowhere", "user": "someone"}}]}))
    result = runner.invoke(cluster_app, ["check", "--kubeconfig", str(kubeconfig)])
    assert result.exit_code == 2, result.output
    assert "gpufleet-t0ken" not in result.output, result.output
    if "\n" in token.strip():  # a line break inside: the credentials' source is named
        assert "ClusterForbidden" in result.output and str(kubeconfig) in result.output.replace("\n", "")


def test_cli_check_refuses_a_config_naming_a_secret_the_control_plane_cannot_be_granted(tmp_path):
    """Read before the cluster is asked anything: a credential outside `gpufleet` is named by its
    field, exit 2, and no kubeconfig is needed to learn it."""
    config = tmp_path / "sites.yaml"
    config.write_text(yaml.safe_dump({"mode": "real", "accounts": [
        {"name": "lambda-prod", "provider": "lambda", "credentials": {"secret": "default/lambda-prod#api-key"}}]}))
    result = runner.invoke(cluster_app, ["check", "--kubeconfig", str(tmp_path / "absent"), "--config", str(config)],
                           env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    assert "cannot check the credentials the fleet config names" in result.output
    assert "accounts.lambda-prod.credentials" in result.output and "cannot check the cluster" not in result.output


def test_config_check_against_the_cluster_names_a_dropped_sites_nodes(tmp_path, fake):
    """`gpufleet config check sites.yaml --fleet --kubeconfig ...` (mode real) reads the nodes and
    node identity records through the adapter: a site the file drops while the cluster has a node
    there is refused, naming it; the nodes of the sites it keeps are not."""
    from cli.main import app
    from fleet.cluster import LABEL_SITE, NODE_IDENTITY_KIND, NodeIdentity
    from providers.cluster.kubernetes import KubernetesCluster

    example = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "sites.example.yaml").read_text())
    example["sites"] = [s for s in example["sites"] if s["name"] != "lambda-us-east"]
    config = tmp_path / "sites.yaml"
    config.write_text(yaml.safe_dump(example))
    fake.add_node("lambda-us-east-n1", labels={LABEL_SITE: "lambda-us-east"}, machine_id="i-1")
    fake.add_node("hetzner-fsn1-n1", labels={LABEL_SITE: "hetzner-fsn1"}, machine_id="h-1")
    identity = NodeIdentity(node_name="lambda-us-east-n1", machine_id="i-1", provider="lambda",
                            account="lambda-prod", site="lambda-us-east")
    KubernetesCluster(api_client=fake.api_client(), namespace="gpufleet").update_state(
        NODE_IDENTITY_KIND, "lambda-us-east-n1", lambda _old: identity.state())

    result = runner.invoke(app, ["config", "check", str(config), "--fleet",
                                 "--kubeconfig", fake.kubeconfig(tmp_path / "kubeconfig")], env={"COLUMNS": "400"})
    flat = " ".join(result.output.split())
    assert result.exit_code == 1, result.output
    assert "lambda-us-east: not in" in flat and "1 node(s) there (lambda-us-east-n1)" in flat, flat
    assert "hetzner-fsn1" not in flat
