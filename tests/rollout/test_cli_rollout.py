"""``gpufleet rollout start/status/pause/abort`` against a running stack."""

from __future__ import annotations

import asyncio
import json

from typer.testing import CliRunner

from cli.main import app
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
