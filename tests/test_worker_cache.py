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
    assert "GPUFLEET_MAX_CACHED_WORKFLOWS: a whole number of workflows, 0 or more, not 'lots'" in done.stderr


async def test_a_worker_shut_down_in_the_suite_leaves_no_run_to_wake_in_another_workflow(
        time_skipping_env: WorkflowEnvironment, tmp_path) -> None:
    """The SDK does not evict a worker's cached runs as it shuts down (its process ends). The suite's
    process outlives hundreds of workers: a dropped run was garbage-collected later, and its
    ``finally`` (here the capacity request's wait for its handlers) ran on whatever thread the
    collection fell, taking that thread's running workflow for its own (CI: a Site run recorded a
    NodeJoin's ``revoke_node_tokens`` and failed replay). Each worker now evicts what it holds as it
    stops (tests/plugins/evict_on_shutdown.py): the run's clean-up runs in its own loop, and nothing of
    it is left for a collection to wake."""
    import gc
    import uuid

    from fleet.messages.capacity import CapacityProgress
    from tests.test_time_skipping import control_plane, wait_for_async

    env = time_skipping_env
    woken: list = []
    async with control_plane(env, tmp_path) as (settings, _):
        handle = await env.client.start_workflow(
            "AcquireCapacity", {"constraints": {"gpu": "H100"}, "count": 1, "backoff_seconds": 1800},
            id=f"capacity/left-{uuid.uuid4().hex[:6]}", task_queue=settings.task_queue)

        async def waiting() -> CapacityProgress | None:
            progress = await handle.query("progress", result_type=CapacityProgress)
            return progress if progress.wait_until is not None else None

        await wait_for_async(waiting)  # suspended in its wait for capacity, its finally still ahead
    hook = sys.unraisablehook
    sys.unraisablehook = woken.append
    try:
        gc.collect()  # what the suite's next collection, on any thread, would find
    finally:
        sys.unraisablehook = hook
    assert [repr(u.exc_value) for u in woken if "temporalio" in repr(u.object) or "workflow" in repr(u.object)] == []
