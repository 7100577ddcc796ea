"""A real control-plane worker SIGKILLed in the middle of ``replicate_weights``.

ModelRollout runs on ``python -m workers.control_plane`` in a subprocess against the
session's dev server. Once the server holds a heartbeat saying the first two files
are finished and the third is part-way through its multipart upload, the worker is
killed (SIGKILL: no cleanup, no final heartbeat). The activity's heartbeat times out,
a new worker takes the retried attempt, and it continues from that heartbeat: the
finished files are not copied again (one object version each, the same one as
before the kill), the open upload is continued rather than abandoned, and every
copied byte matches the manifest.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path

import yaml
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import ResetStickyTaskQueueRequest
from temporalio.client import WorkflowHandle

from activities.env import FleetEnv
from fleet.rollout import RolloutResult
from tests.conftest import make_settings
from tests.rollout.conftest import MotoS3, RolloutStack, add_node, put_files, rollout_fleet
from workers.control_plane import build_worker

KiB = 1024
PREFIX = "models/llm/v2/"
FILES = {"config.json": 2_000, "model-00001.safetensors": 96 * KiB, "model-00002.safetensors": 2048 * KiB}
FIRST, SECOND, LAST = FILES


async def replicate_heartbeat(handle: WorkflowHandle) -> dict | None:
    """The server's copy of the pending replicate activity's last heartbeat."""
    try:
        description = await handle.describe()
    except Exception:  # noqa: BLE001 - not started yet
        return None
    for pending in description.raw_description.pending_activities:
        if pending.activity_id.startswith("replicate/") and pending.heartbeat_details.payloads:
            (details,) = await handle._client.data_converter.decode(pending.heartbeat_details.payloads)
            return details
    return None


async def replicate_attempts(handle: WorkflowHandle) -> tuple[list[int], list[dict]]:
    """(attempt numbers in the replicate activity's started events, its decoded results)."""
    history = await handle.fetch_history()
    scheduled = {e.event_id for e in history.events
                 if e.activity_task_scheduled_event_attributes.activity_type.name == "replicate_weights"}
    attempts, results = [], []
    for event in history.events:
        started = event.activity_task_started_event_attributes
        if started.scheduled_event_id in scheduled:
            attempts.append(started.attempt)
        completed = event.activity_task_completed_event_attributes
        if completed.scheduled_event_id in scheduled:
            results += await handle._client.data_converter.decode(completed.result.payloads)
    return attempts, results


async def test_worker_killed_mid_copy_resumes_without_recopying(temporal_env, tmp_path: Path,
                                                                moto_s3: MotoS3) -> None:
    source = moto_s3.bucket(moto_s3.store(0))
    dest = moto_s3.bucket(moto_s3.store(1), versioned=True)
    settings = make_settings(temporal_env, tmp_path)
    (tmp_path / "sites.yaml").write_text(yaml.safe_dump(rollout_fleet({"site-b": dest}, source)))
    env = FleetEnv.from_settings(settings)
    add_node(env, "site-b")
    files = put_files(moto_s3, source, FILES, seed=7)
    stack = RolloutStack(temporal_env.client, settings, env.world, env.cluster, env=env, s3=moto_s3,
                         source=source, stores={"site-b": dest}, files=files)
    raw = stack.request({"site-b": 1})
    # 64 KiB parts (conftest), throttled so the last file takes ~4 s: long enough to be
    # killed in the middle of it. A 2 s heartbeat timeout makes the retry come quickly.
    raw["replication"].update(bandwidth_limit_bytes_per_s=512 * KiB, heartbeat_seconds=2)
    s3 = moto_s3.client(dest)

    worker = subprocess.Popen([sys.executable, "-m", "workers.control_plane"], env=stack.settings_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        handle = await stack.start(raw, "crash")
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            beat = await replicate_heartbeat(handle)
            current = (beat or {}).get("current") or {}
            if (beat and set(beat["done"]) == {FIRST, SECOND} and current.get("path") == LAST
                    and len(current.get("parts", [])) >= 2):
                break
            assert worker.poll() is None, "the worker died on its own"
            assert asyncio.get_running_loop().time() < deadline, f"no mid-copy heartbeat; last: {beat}"
            await asyncio.sleep(0.05)
        worker.kill()
        worker.wait()

        # What the dead worker left: two finished files, the third one still an open upload.
        before = {v["Key"]: v for v in s3.list_object_versions(Bucket=dest.bucket, Prefix=PREFIX).get("Versions", [])}
        assert set(before) == {PREFIX + FIRST, PREFIX + SECOND}
        uploads = s3.list_multipart_uploads(Bucket=dest.bucket).get("Uploads", [])
        assert [u["UploadId"] for u in uploads] == [current["upload_id"]]

        # The workflow's next task would wait on the dead worker's sticky queue until its
        # schedule-to-start timeout (10 s); send it to the shared queue instead, as a
        # worker that drops a workflow from its cache does. The activity is unaffected.
        await stack.client.workflow_service.reset_sticky_task_queue(ResetStickyTaskQueueRequest(
            namespace=stack.client.namespace, execution=WorkflowExecution(workflow_id=handle.id)))
        async with build_worker(stack.client, stack.settings):
            result = RolloutResult.model_validate(await asyncio.wait_for(handle.result(), 30))
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert result.outcome == "completed", result.reason

    attempts, results = await replicate_attempts(handle)
    # History records an activity's started event once, for the attempt that finished it.
    assert attempts == [2], "the killed attempt was retried once, by the new worker"
    (replicated,) = results
    assert replicated["resumed"]
    assert replicated["files"] == {FIRST: "resumed", SECOND: "resumed", LAST: "copied"}

    after = s3.list_object_versions(Bucket=dest.bucket, Prefix=PREFIX).get("Versions", [])
    assert sorted(v["Key"] for v in after) == sorted(PREFIX + f for f in FILES), "one version per file"
    for version in after:
        if version["Key"] in before:  # the finished files were not written again
            assert version["VersionId"] == before[version["Key"]]["VersionId"]
            assert version["LastModified"] == before[version["Key"]]["LastModified"]
    assert s3.list_multipart_uploads(Bucket=dest.bucket).get("Uploads", []) == [], \
        "the dead worker's open upload was continued and completed, not abandoned"
    for f in files:
        body = s3.get_object(Bucket=dest.bucket, Key=PREFIX + f["path"])["Body"].read()
        assert hashlib.sha256(body).hexdigest() == f["sha256"]
