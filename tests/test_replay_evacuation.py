"""Determinism of SiteEvacuation and the Site entity's incident path: recorded
histories replay against today's code.

Recorded with ``GPUFLEET_RECORD=1 pytest tests/test_evacuation.py``; commit the
files under tests/histories/ together with the workflow change they belong to.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows import ALL_WORKFLOWS

HISTORIES = Path(__file__).parent / "histories"
NAMES = {"site_evacuation_restored", "site_incident_tripped", "site_evacuation_resumed"}


@pytest.mark.parametrize("name", sorted(NAMES))
async def test_recorded_evacuation_history_replays(name: str) -> None:
    path = HISTORIES / f"{name}.json"
    if not path.exists():
        pytest.fail(f"{path} missing: record with GPUFLEET_RECORD=1")
    data = json.loads(path.read_text())
    workflow_id = data["events"][0]["workflowExecutionStartedEventAttributes"].get("workflowId", name)
    replayer = Replayer(workflows=ALL_WORKFLOWS, data_converter=pydantic_data_converter)
    await replayer.replay_workflow(WorkflowHistory.from_json(workflow_id, data))
