"""``gpufleet cluster check`` with nothing answering: one line, exit 2.

What the check asks and how it reports a missing verb is answered by the real authorizer:
``tests/realk8s/test_adapter.py`` (and the kubeadm bindings, ``tests/realk8s/test_blast_radius.py``)."""

from __future__ import annotations

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
