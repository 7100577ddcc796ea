"""Determinism of ModelRollout: recorded histories replay against today's code.

Record with ``GPUFLEET_RECORD=1 pytest tests/test_replay_rollout.py``; commit the
files under tests/histories/ with the workflow change they belong to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.rollout.conftest import MODEL, RolloutStack, moto_s3, rollout_stack  # noqa: F401 - fixtures
from tests.rollout.test_rollout_workflow import states, until
from workflows import ALL_WORKFLOWS

HISTORIES = Path(__file__).parent / "histories"
RECORD = os.environ.get("GPUFLEET_RECORD") == "1"
NAMES = ("rollout_happy", "rollout_canary_failed", "rollout_aborted")


def replayer() -> Replayer:
    return Replayer(workflows=ALL_WORKFLOWS, data_converter=pydantic_data_converter)


async def test_fresh_rollout_histories_replay(rollout_stack: RolloutStack) -> None:  # noqa: F811
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b", "site-c"])
    happy = await stack.start(stack.request({"site-a": 1, "site-b": 2}), "replay-happy")
    await happy.result()

    stack.probe.set_error_rate(MODEL, "site-a", 1.0, image="img:v3")
    failed = await stack.start(stack.request({"site-a": 1, "site-b": 1}, version="v3"), "replay-canary")
    with pytest.raises(WorkflowFailureError):
        await failed.result()

    stack.cluster.set_routing_weights(MODEL, {"site-a": 1, "site-b": 1, "site-c": 0}, draining={"site-c": True})
    aborted = await stack.start(stack.request({"site-a": 1, "site-b": 1, "site-c": 1}, version="v4"), "replay-abort")
    await until(aborted, lambda p: states(p).get("site-c") == "deferred" and states(p)["site-b"] == "done")
    await aborted.execute_update("pause")
    await aborted.execute_update("resume")
    await aborted.execute_update("abort", "replay")
    await aborted.result()

    for name, handle in zip(NAMES, (happy, failed, aborted)):
        history = await handle.fetch_history()
        await replayer().replay_workflow(history)
        if RECORD:
            HISTORIES.mkdir(exist_ok=True)
            (HISTORIES / f"{name}.json").write_text(json.dumps(history.to_json_dict(), indent=1))


@pytest.mark.parametrize("name", NAMES)
async def test_recorded_rollout_history_replays(name: str) -> None:
    path = HISTORIES / f"{name}.json"
    assert path.exists(), f"record it: GPUFLEET_RECORD=1 pytest {Path(__file__).name}"
    data = json.loads(path.read_text())
    workflow_id = data["events"][0]["workflowExecutionStartedEventAttributes"].get("workflowId", name)
    await replayer().replay_workflow(WorkflowHistory.from_json(workflow_id, data))
