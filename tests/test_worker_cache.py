"""The control-plane worker keeps a fleet's entities cached: every node is a Node entity, and
one evicted from the cache replays its whole history on its next task."""

from __future__ import annotations

import subprocess
import sys

from temporalio.testing import WorkflowEnvironment

from tests.conftest import make_settings
from workers.control_plane import build_worker


async def test_worker_caches_more_entities_than_a_full_fleet_has_nodes(temporal_env: WorkflowEnvironment,
                                                                      tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("GPUFLEET_MAX_CACHED_WORKFLOWS", raising=False)
    worker = build_worker(temporal_env.client, make_settings(temporal_env, tmp_path))
    assert worker.config()["max_cached_workflows"] >= 1250 + 100
    monkeypatch.setenv("GPUFLEET_MAX_CACHED_WORKFLOWS", "6000")
    (tmp_path / "other").mkdir()
    other = build_worker(temporal_env.client, make_settings(temporal_env, tmp_path / "other"))
    assert other.config()["max_cached_workflows"] == 6000


def test_a_bad_cache_size_is_named() -> None:
    done = subprocess.run([sys.executable, "-c", "from workers.control_plane import max_cached_workflows as m; m()"],
                          env={"GPUFLEET_MAX_CACHED_WORKFLOWS": "lots", "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "GPUFLEET_MAX_CACHED_WORKFLOWS: a whole number, not 'lots'" in done.stderr
