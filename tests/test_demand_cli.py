"""``gpufleet sim pods`` creates demand the simulated scheduler places; ``gpufleet demand``
says, without a running loop, which pods wait."""

from __future__ import annotations

from typer.testing import CliRunner

from cli.main import app
from tests.conftest import write_fleet


def test_sim_pods_add_list_delete_and_demand(tmp_path):
    config = str(write_fleet(tmp_path))
    common = ["--state-dir", str(tmp_path), "--config", config]
    runner = CliRunner()
    added = runner.invoke(app, ["sim", "pods", "add", "llm", "--count", "2", "--gpus", "2", "--geo", "eu",
                                "--model", "m", *common])
    assert added.exit_code == 0, added.output
    listed = runner.invoke(app, ["sim", "pods", "list", "--output", "json", *common])
    assert listed.exit_code == 0 and "default/llm-0" in listed.output and "Pending" in listed.output
    shown = runner.invoke(app, ["demand", "--address", "127.0.0.1:1", *common])
    # No Temporal there: the command says where it looked, and fails.
    assert shown.exit_code == 1 and "cannot reach Temporal" in shown.output
    deleted = runner.invoke(app, ["sim", "pods", "delete", "llm-0", "llm-1", *common])
    assert deleted.exit_code == 0 and "deleted 2 of 2" in deleted.output
