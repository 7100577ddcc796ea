"""``gpufleet sim pods`` creates demand the simulated scheduler places; ``gpufleet demand``
says, without a running loop, which pods wait."""

from __future__ import annotations

import json
from types import SimpleNamespace

from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode
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


def test_sim_pods_add_prints_the_command_that_deletes_them_and_it_does(tmp_path):
    """Like every sim knob (issue 36): the tour's demand is taken back by the line it printed."""
    import shlex

    config = str(write_fleet(tmp_path))
    common = ["--state-dir", str(tmp_path), "--config", config]
    runner = CliRunner()
    added = runner.invoke(app, ["sim", "pods", "add", "llm", "--count", "3", "--namespace", "team-a", *common])
    assert added.exit_code == 0, added.output
    (undo,) = [line.removeprefix("undo: ") for line in added.output.splitlines() if line.startswith("undo: ")]
    command = undo.split("   ")[0]
    assert command == "gpufleet sim pods delete llm-0 llm-1 llm-2 --namespace team-a", undo
    assert "gpufleet sim reset" in undo
    one = runner.invoke(app, ["sim", "pods", "add", "solo", *common])
    assert "undo: gpufleet sim pods delete solo   " in one.output, one.output

    undone = runner.invoke(app, [*shlex.split(command)[1:], *common])
    assert undone.exit_code == 0 and "deleted 3 of 3" in undone.output, undone.output
    listed = runner.invoke(app, ["sim", "pods", "list", "-o", "json", *common])
    assert [p["pod"] for p in json.loads(listed.output)] == ["default/solo"]


def test_demand_start_prints_the_loops_temporal_ui_link(tmp_path, monkeypatch):
    """`gpufleet demand --start` names the workflow it started and its Temporal UI link, as every
    command that starts one does; a loop already running is said to be."""
    from cli import demand as demand_cli
    from fleet.messages.demand import DemandStatus
    from fleet.naming import DEMAND_WORKFLOW_ID

    started: list[str] = []
    running = {"yes": False}

    class Handle:
        async def describe(self):
            if not running["yes"]:
                raise RPCError("not found", RPCStatusCode.NOT_FOUND, b"")
            return SimpleNamespace(status=WorkflowExecutionStatus.RUNNING)

        async def query(self, *args, **kwargs):
            return DemandStatus()

    class Client:
        async def start_workflow(self, workflow, arg, *, id, **kwargs):
            started.append(id)
            running["yes"] = True

        def get_workflow_handle(self, workflow_id):
            assert workflow_id == DEMAND_WORKFLOW_ID
            return Handle()

    async def connect(settings):
        return Client()

    monkeypatch.setattr(demand_cli, "connect", connect)
    monkeypatch.delenv("GPUFLEET_UI_URL", raising=False)
    config = str(write_fleet(tmp_path))
    common = ["--state-dir", str(tmp_path), "--config", config, "--address", "127.0.0.1:7300"]
    runner = CliRunner()
    first = runner.invoke(app, ["demand", "--start", *common])
    assert first.exit_code == 0, first.output
    assert started == [DEMAND_WORKFLOW_ID]
    assert f"started {DEMAND_WORKFLOW_ID}" in first.output
    assert f"  UI: http://127.0.0.1:8300/namespaces/default/workflows/{DEMAND_WORKFLOW_ID}" in first.output.splitlines()
    # Started again: already running (the start is idempotent), and the same link.
    again = runner.invoke(app, ["demand", "--start", *common], env={"GPUFLEET_UI_URL": "https://temporal.example.com/"})
    assert f"already running {DEMAND_WORKFLOW_ID}" in again.output, again.output
    assert f"  UI: https://temporal.example.com/namespaces/default/workflows/{DEMAND_WORKFLOW_ID}" in again.output
    # Where there is no UI (GPUFLEET_UI_URL=none: `gpufleet dev --temporal cluster`), no link.
    bare = runner.invoke(app, ["demand", "--start", *common], env={"GPUFLEET_UI_URL": "none"})
    assert bare.exit_code == 0 and "  UI: " not in bare.output, bare.output
    # Without --start nothing is started and no link is printed.
    shown = runner.invoke(app, ["demand", *common])
    assert shown.exit_code == 0 and "  UI: " not in shown.output and started == [DEMAND_WORKFLOW_ID], shown.output


def test_demand_says_a_loop_that_ended_is_not_running_and_how_it_ended(tmp_path, monkeypatch):
    """A cancelled (or failed) loop answers its status query still: `gpufleet demand` printed its
    last purchases as a running loop's. It says the loop is not running, how and when it ended."""
    from datetime import datetime, timezone

    from cli import demand as demand_cli
    from fleet.messages.demand import DemandStatus

    class Handle:
        async def describe(self):
            return SimpleNamespace(status=WorkflowExecutionStatus.CANCELED,
                                   close_time=datetime(2026, 12, 6, 9, 30, 5, tzinfo=timezone.utc))

        async def query(self, *args, **kwargs):
            return DemandStatus(log=["cancelled: stopped purchases capacity/demand-1-1"])

    class Client:
        def get_workflow_handle(self, workflow_id):
            return Handle()

    async def connect(settings):
        return Client()

    monkeypatch.setattr(demand_cli, "connect", connect)
    config = str(write_fleet(tmp_path))
    shown = CliRunner().invoke(app, ["demand", "--state-dir", str(tmp_path), "--config", config])
    assert shown.exit_code == 0, shown.output
    said = " ".join(shown.output.split())
    assert "the demand loop is not running: its last run ended canceled at 2026-12-06 09:30:05 UTC" in said, said
    assert "cancelled: stopped purchases capacity/demand-1-1" in said
