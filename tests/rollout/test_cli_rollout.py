"""``gpufleet rollout start/status/pause/abort`` against a running stack."""

from __future__ import annotations

import asyncio
import io
import json
import re
import uuid

import pytest
import yaml
from rich.console import Console
from rich.text import Text
from temporalio.service import RPCError
from typer.testing import CliRunner

from cli.main import app
from fleet.cluster import SiteRoute
from fleet.rollout import RolloutProgress
from tests.evacuation_helpers import poll
from tests.rollout.conftest import RolloutStack


async def test_cli_start_status_and_updates(rollout_stack: RolloutStack, tmp_path) -> None:
    stack = rollout_stack
    runner = CliRunner()
    env = {**stack.settings.env()}
    spec = stack.request({"site-a": 1, "site-b": 1}, version="v9", gate={"bake_seconds": 0})

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**spec, "sites": [{"site": "site-a", "replicas": 0}]}))
    result = await asyncio.to_thread(runner.invoke, app, ["rollout", "start", str(bad)], env=env)
    assert result.exit_code == 2 and "zero replicas everywhere" in result.output

    good = tmp_path / "rollout.yaml"
    good.write_text(json.dumps(spec))
    result = await asyncio.to_thread(runner.invoke, app, ["rollout", "start", str(good)], env=env)
    assert result.exit_code == 0, result.output
    assert "rollout/llm/v9" in result.output
    await stack.client.get_workflow_handle("rollout/llm/v9").result()

    result = await asyncio.to_thread(runner.invoke, app, ["rollout", "status", "llm/v9"], env=env)
    assert result.exit_code == 0, result.output
    assert "completed" in result.output and "100%" in result.output and "site-b" in result.output

    result = await asyncio.to_thread(runner.invoke, app, ["rollout", "pause", "rollout/llm/v9"], env=env)
    assert result.exit_code == 1 and "rejected" in result.output


async def test_cli_start_refuses_a_rollout_the_fleet_config_rules_out_before_starting_it(rollout_stack: RolloutStack,
                                                                                           tmp_path) -> None:
    """A target site the fleet config does not name, or a replica wanting more GPUs than a site's
    machine has: `gpufleet rollout start` said `started rollout/llm/<v>` and exited 0, and the
    rollout then failed at its first step (an operator without --wait saw success). Refused now
    (exit 2, naming each field, as an unknown object store was), and nothing is started."""
    stack = rollout_stack
    env = {**stack.settings.env()}
    cases = {
        "unknown-site": ({**stack.request({"site-a": 1, "nowhere": 1}, version="u1")},
                         "sites[1].site: unknown site 'nowhere'"),
        "too-big": ({**stack.request({"site-a": 1}, version="u2"), "gpus_per_replica": 16},
                    "gpus_per_replica: 16 GPUs per replica, more than one machine has at site-a (8 GPUs per machine)"),
    }
    for name, (spec, problem) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(spec))
        result = await asyncio.to_thread(CliRunner().invoke, app, ["rollout", "start", str(path)], env=env)
        said = " ".join(result.output.split())
        assert result.exit_code == 2 and "invalid rollout" in said and problem in said, said
        assert "started" not in said, said
        with pytest.raises(RPCError):
            await stack.client.get_workflow_handle(f"rollout/llm/{spec['version']}").describe()


async def test_cli_start_refuses_a_spec_yaml_would_read_wrong_naming_where_and_starts_nothing(
        rollout_stack: RolloutStack, tmp_path) -> None:
    """A spec YAML would read otherwise than written. Before, a second `sites:` block (a site pasted
    at the end with its header) or `files:` list was taken alone, the first one dropped without a
    word: `gpufleet rollout start` started the rollout to the second block's sites only, or with only
    the second list's weight files; a spec nested some thousand deep ended in a RecursionError
    traceback. Now each is refused (exit 2), naming where, and nothing is started."""
    stack = rollout_stack
    env = {**stack.settings.env()}
    spec = stack.request({"site-a": 1}, version="y1")
    files = yaml.safe_dump({"files": spec["weights"].pop("files")}, sort_keys=False)
    base = yaml.safe_dump(spec, sort_keys=False)
    written = base.replace("weights:\n", "weights:\n" + "".join(f"  {line}\n" for line in files.splitlines()), 1)
    assert yaml.safe_load(written)["weights"]["files"] == [dict(f) for f in stack.files]
    cases = {
        "sites-twice": (written + "sites:\n- {site: site-b, replicas: 1}\n", "sites: given twice (lines "),
        "files-twice": (written.replace("  source:", "  files:\n  - {path: a.bin, size: 1, sha256: " + "0" * 64
                                        + "}\n  source:", 1), "weights.files: given twice (lines "),
        "deep": (written + "env: " + "[" * 3000 + "]" * 3000 + "\n", "not valid YAML: nested too deeply"),
    }
    for name, (text, problem) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        result = await asyncio.to_thread(CliRunner().invoke, app, ["rollout", "start", str(path)], env=env)
        said = " ".join(result.output.split())
        assert result.exit_code == 2 and problem in said, (name, said, result.exception)
        assert "keep one" in said or "nested" in said, said
        with pytest.raises(RPCError):
            await stack.client.get_workflow_handle("rollout/llm/y1").describe()
    # Given once, the same spec starts.
    path = tmp_path / "once.yaml"
    path.write_text(written)
    result = await asyncio.to_thread(CliRunner().invoke, app, ["rollout", "start", str(path)], env=env)
    assert result.exit_code == 0 and "rollout/llm/y1" in result.output, result.output


async def test_cli_start_refuses_a_second_rollout_of_a_model_naming_the_running_one(rollout_stack: RolloutStack,
                                                                                   tmp_path) -> None:
    """`gpufleet rollout start` of another version while one of the model runs (paused here) is
    refused before anything starts, naming the running one and how to stop it; the running one's
    own spec still attaches to it."""
    stack = rollout_stack
    runner = CliRunner()
    env = {**stack.settings.env()}
    stack.serve_v1(["site-a", "site-b"])

    async def start(version: str):
        spec = tmp_path / f"{version}.json"
        spec.write_text(json.dumps(stack.request({"site-a": 1, "site-b": 1}, version=version)))
        return await asyncio.to_thread(runner.invoke, app, ["rollout", "start", str(spec)], env=env)

    assert (await start("v2")).exit_code == 0
    first = stack.client.get_workflow_handle("rollout/llm/v2")
    await first.execute_update("pause", "holding the first one")
    await poll(lambda: _paused(first), timeout=30)

    result = await start("v3")
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert ("model: rollout/llm/v2 is still running, and a model is rolled out by one rollout at a time: wait for it "
            "to end, or stop it (gpufleet rollout abort rollout/llm/v2)") in said, said
    with pytest.raises(RPCError):
        await stack.client.get_workflow_handle("rollout/llm/v3").describe()

    run_id = (await first.describe()).run_id
    result = await start("v2")
    assert result.exit_code == 0 and "rollout/llm/v2" in result.output, result.output
    assert (await first.describe()).run_id == run_id and await _paused(first)


async def _paused(handle) -> bool:
    progress = await handle.query("progress", result_type=RolloutProgress)
    return progress is not None and progress.phase == "paused"


def _rollout_with_site_b_evacuating(stack: RolloutStack, tmp_path, incident: str):
    """v1 serving at both sites, site-b under evacuation (``incident``): a rollout spec whose
    rollout updates site-a and defers site-b. Its version and the spec's path."""
    stack.serve_v1(["site-a", "site-b"])
    stack.cluster.set_site_routes({"site-a": SiteRoute(weight=100),
                                   "site-b": SiteRoute(weight=0, healthy=False, draining=True, incident=incident)})
    version = f"w{uuid.uuid4().hex[:6]}"
    spec = tmp_path / "rollout.yaml"
    spec.write_text(json.dumps(stack.request({"site-a": 1, "site-b": 1}, version=version, gate={"bake_seconds": 0},
                                             evacuation_poll_seconds=1)))
    return version, spec


@pytest.mark.parametrize("where", ["piped", "terminal"])
async def test_start_wait_shows_each_change_and_why_a_site_waits(rollout_stack: RolloutStack, tmp_path,
                                                                 monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """``rollout start --wait``: piped, one plain line per change (a deferred site's says why and
    until when); on a terminal a view redrawn in place, as ``join`` and ``capacity`` show theirs
    (before: plain lines on a terminal too)."""
    import cli.rollout

    stack = rollout_stack
    screen = io.StringIO()
    if where == "terminal":
        monkeypatch.setattr(cli.rollout, "console", Console(file=screen, width=80, force_terminal=True,
                                                            color_system=None))
    version, spec = _rollout_with_site_b_evacuating(stack, tmp_path, "inc-9")
    waiting = asyncio.create_task(asyncio.to_thread(CliRunner().invoke, app, ["rollout", "start", str(spec), "--wait"],
                                                    env=stack.settings.env()))
    handle = stack.client.get_workflow_handle(f"rollout/llm/{version}")

    async def deferred() -> bool:
        try:
            p = await handle.query("progress", result_type=RolloutProgress)
        except Exception:  # noqa: BLE001 - not started yet
            return False
        return p.site("site-b").state.value == "deferred" and p.site("site-a").state.value == "done"

    await poll(deferred, timeout=60)
    await asyncio.sleep(1.5)  # a look or two while deferred, as the operator sees it
    stack.end_evacuation(["site-a", "site-b"])
    result = await asyncio.wait_for(waiting, 60)
    assert result.exit_code == 0, result.output + screen.getvalue()
    lines = result.output.splitlines()
    if where == "piped":
        assert not screen.getvalue()
        assert lines[-1] == f"rollout/llm/{version}: completed", lines
        said = [line for line in lines if line.startswith("  site-b: deferred")]
        assert said and re.search(r"under evacuation \(inc-9\).*next look at \d\d:\d\d:\d\d UTC", said[0]), lines
        assert [line for line in lines if line.startswith("  site-b: done")], "\n".join(lines)
        # One line per change: a site's line is printed again only when it changed.
        site_lines = [line for line in lines if line.startswith("  site-")]
        for before, after in zip(site_lines, site_lines[1:]):
            assert before != after, lines
        assert len(site_lines) == len(set(site_lines)), lines
    else:
        shown = screen.getvalue()
        # No plain per-change lines on the terminal: the view is redrawn in place (cursor moves)
        # and ends with every site's state, then the outcome.
        assert not [line for line in lines if line.startswith("  site-")], lines
        assert "\x1b[" in shown and "under evacuation (inc-9)" in shown, shown
        plain = Text.from_ansi(shown).plain.splitlines()
        for site in ("site-a", "site-b"):  # the last view drawn: every site done
            assert " done " in next(line for line in reversed(plain) if site in line), plain[-12:]
        assert shown.rstrip().endswith(f"rollout/llm/{version}: completed"), shown[-500:]
        assert all(len(line) <= 80 for line in plain), plain


async def test_ctrl_c_on_start_wait_stops_watching_and_names_how_to_stop_the_rollout(rollout_stack: RolloutStack,
                                                                                     tmp_path) -> None:
    """Ctrl-C on ``rollout start --wait``: the watch ends with exit 130 and the rollout goes on (a
    rollback is a decision, not what an interrupted watch implies); the message names the
    commands that watch, pause and roll it back (before: a traceback, and nothing said)."""
    import os
    import signal
    import subprocess
    import sys

    from temporalio.client import WorkflowExecutionStatus

    from tests.test_cli_cancel import finished, read_until

    stack = rollout_stack
    version, spec = _rollout_with_site_b_evacuating(stack, tmp_path, "inc-7")
    proc = subprocess.Popen([sys.executable, "-m", "cli", "rollout", "start", str(spec), "--wait"],
                            env={**os.environ, **stack.settings.env(), "COLUMNS": "250"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rollout_id = f"rollout/llm/{version}"
    handle = stack.client.get_workflow_handle(rollout_id)
    try:
        await read_until(proc, "site-b: deferred")
        proc.send_signal(signal.SIGINT)
        out = await finished(proc, 30)
        assert proc.returncode == 130, out
        assert "Traceback" not in out, out
        assert f"{rollout_id} goes on" in out and f"gpufleet rollout abort {rollout_id}" in out, out
        assert f"gpufleet rollout pause {rollout_id}" in out, out
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
    finally:
        if proc.poll() is None:
            proc.kill()
        await handle.execute_update("abort", "test over")
