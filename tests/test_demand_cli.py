"""``gpufleet sim pods`` creates demand the simulated scheduler places; ``gpufleet demand``
says, without a running loop, which pods wait."""

from __future__ import annotations

import asyncio
import json

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from typer.testing import CliRunner

from cli.demand import start_demand_loop
from cli.main import app
from fleet.naming import DEMAND_WORKFLOW_ID
from fleet.settings import TASK_QUEUE_ENV
from tests.conftest import Stack, write_fleet


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


async def demand_cli(stack: Stack, *args: str, ui_url: str | None = None):
    """``gpufleet demand`` against the test's dev server, on the test's task queue."""
    env = {TASK_QUEUE_ENV: stack.settings.task_queue, "GPUFLEET_UI_URL": ui_url}
    common = ["--address", stack.settings.address, "--state-dir", str(stack.settings.state_dir),
              "--config", stack.settings.config]
    return await asyncio.to_thread(CliRunner().invoke, app, ["demand", *args, *common], env=env)


async def test_demand_start_prints_the_loops_temporal_ui_link(stack: Stack):
    """`gpufleet demand --start` names the workflow it started and its Temporal UI link, as every
    command that starts one does; a loop already running is said to be."""
    handle = stack.client.get_workflow_handle(DEMAND_WORKFLOW_ID)
    first = await demand_cli(stack, "--start")
    assert first.exit_code == 0, first.output
    assert f"started {DEMAND_WORKFLOW_ID}" in first.output
    host, _, port = stack.settings.address.rpartition(":")  # the dev server's UI: its port + 1000
    link = f"  UI: http://{host}:{int(port) + 1000}/namespaces/default/workflows/{DEMAND_WORKFLOW_ID}"
    assert link in first.output.splitlines(), first.output
    started = await handle.describe()
    assert (started.status, started.task_queue) == (WorkflowExecutionStatus.RUNNING, stack.settings.task_queue)
    # Started again: already running (the start is idempotent), and the same link.
    again = await demand_cli(stack, "--start", ui_url="https://temporal.example.com/")
    assert again.exit_code == 0 and f"already running {DEMAND_WORKFLOW_ID}" in again.output, again.output
    assert f"  UI: https://temporal.example.com/namespaces/default/workflows/{DEMAND_WORKFLOW_ID}" in again.output
    # `gpufleet dev` starts the loop without looking first: a restart finds it running, and keeps it.
    await start_demand_loop(stack.client, stack.settings.task_queue)
    # Where there is no UI (GPUFLEET_UI_URL=none: `gpufleet dev --temporal cluster`), no link.
    bare = await demand_cli(stack, "--start", ui_url="none")
    assert bare.exit_code == 0 and "  UI: " not in bare.output, bare.output
    # Without --start nothing is started and no link is printed.
    shown = await demand_cli(stack)
    assert shown.exit_code == 0 and "  UI: " not in shown.output, shown.output
    assert (await handle.describe()).run_id == started.run_id, "one run all along"


async def test_demand_says_a_loop_that_ended_is_not_running_and_how_it_ended(stack: Stack):
    """A cancelled (or failed) loop answers its status query still: `gpufleet demand` printed its
    last purchases as a running loop's. It says the loop is not running, how and when it ended."""
    started = await demand_cli(stack, "--start", ui_url="none")
    assert started.exit_code == 0, started.output
    handle = stack.client.get_workflow_handle(DEMAND_WORKFLOW_ID)
    await handle.cancel()
    with pytest.raises(WorkflowFailureError):
        await asyncio.wait_for(handle.result(), 30)
    ended = await handle.describe()
    assert ended.status == WorkflowExecutionStatus.CANCELED

    shown = await demand_cli(stack)
    assert shown.exit_code == 0, shown.output
    said = " ".join(shown.output.split())
    assert (f"the demand loop is not running: its last run ended canceled at {ended.close_time:%Y-%m-%d %H:%M:%S} UTC"
            in said), said
    assert "cancelled: no purchase was buying; no node left cordoned" in said, said


async def test_demand_with_no_worker_says_so_and_fails_instead_of_an_empty_status(fleet_world: Stack):
    """The loop runs but no control-plane worker polls its queue (crashed, the stack down): the
    status query waited the server's 30 s, then `gpufleet demand` showed an empty status, as if the
    loop were idle. It fails within the query's bound, naming the query and where the worker should be."""
    import time

    await start_demand_loop(fleet_world.client, fleet_world.settings.task_queue)
    handle = fleet_world.client.get_workflow_handle(DEMAND_WORKFLOW_ID)
    try:
        described = await handle.describe()
        assert (described.status, described.task_queue) == (WorkflowExecutionStatus.RUNNING,
                                                            fleet_world.settings.task_queue)
        began = time.monotonic()
        shown = await demand_cli(fleet_world, ui_url="none")
        took = time.monotonic() - began
        said = " ".join(shown.output.split())
        assert shown.exit_code == 1, said
        assert took < 15, f"took {took:.0f} s"
        assert (f"error: no worker answered `status` of `{DEMAND_WORKFLOW_ID}` within 10 s: is the control plane "
                f"running (its worker polls `{fleet_world.settings.task_queue}`)?") in said, said
        assert "purchases" not in said, "no empty status as if the loop were idle"
    finally:
        await handle.terminate()
