"""Determinism: recorded histories must replay against today's workflow code.

Recorded with ``GPUFLEET_RECORD=1 pytest tests/test_replay.py``; commit the
files under tests/histories/ together with the workflow change they belong to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.conftest import Stack, wait_for
from workflows import ALL_WORKFLOWS

HISTORIES = Path(__file__).parent / "histories"
RECORD = os.environ.get("GPUFLEET_RECORD") == "1"


def replayer() -> Replayer:
    return Replayer(workflows=ALL_WORKFLOWS, data_converter=pydantic_data_converter)


async def _scenarios(stack: Stack) -> dict[str, object]:
    """Run each NodeJoin path once and return the handles whose histories matter."""
    happy = await stack.start_join({"site": "site-a"}, request="replay-happy")
    await happy.result()
    many = await stack.start_join({"site": "site-b", "count": 2}, request="replay-many")
    await many.result()
    stack.world.set_site("site-a", boot_seconds=1.0)
    smoke = await stack.start_join({"site": "site-a", "timeouts": {"smoke_test_seconds": 5}}, request="replay-smoke")
    machine = await wait_for(lambda: [m for m in stack.world.machines("site-a") if m["name"] != ""][1:], timeout=20)
    stack.world.inject_fault(machine[0]["id"], 0, "xid", 79, clears_on="reboot")
    with pytest.raises(WorkflowFailureError):
        await smoke.result()
    return {"node_join_happy": happy, "node_join_count2": many, "node_join_smoke_failed": smoke}


async def test_fresh_histories_replay(stack: Stack) -> None:
    for name, handle in (await _scenarios(stack)).items():
        history = await handle.fetch_history()
        await replayer().replay_workflow(history)
        if RECORD:
            HISTORIES.mkdir(exist_ok=True)
            (HISTORIES / f"{name}.json").write_text(json.dumps(history.to_json_dict(), indent=1))


@pytest.mark.parametrize("path", sorted(HISTORIES.glob("*.json")), ids=lambda p: p.stem)
async def test_recorded_history_replays(path: Path) -> None:
    from temporalio.client import WorkflowHistory

    data = json.loads(path.read_text())
    workflow_id = data["events"][0]["workflowExecutionStartedEventAttributes"].get("workflowId", path.stem)
    await replayer().replay_workflow(WorkflowHistory.from_json(workflow_id, data))


def test_histories_are_recorded() -> None:
    assert {p.stem for p in HISTORIES.glob("*.json")} >= {
        "node_join_happy", "node_join_count2", "node_join_smoke_failed",
    }
