"""Determinism for AcquireCapacity, ProviderAccount, Site and SpotReclaim.

Each scenario test in test_capacity.py / test_site_reclaim.py replays its fresh
history; ``GPUFLEET_RECORD=1 pytest tests/test_capacity.py tests/test_site_reclaim.py``
also writes them under tests/histories/, and this module replays the recorded ones
against today's code.
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
MINE = ("capacity_", "account_", "site_", "spot_")
EXPECTED = {
    "capacity_no_capacity_fallback", "capacity_over_quota", "capacity_bad_credentials", "capacity_wait_then_resume",
    "account_quota_raised", "account_credentials_rotated", "site_fill_below_min", "site_retire_above_max",
    "spot_reclaim",
}


def recorded() -> list[Path]:
    return sorted(p for p in HISTORIES.glob("*.json") if p.stem.startswith(MINE))


@pytest.mark.parametrize("path", recorded(), ids=lambda p: p.stem)
async def test_recorded_capacity_history_replays(path: Path) -> None:
    data = json.loads(path.read_text())
    workflow_id = data["events"][0]["workflowExecutionStartedEventAttributes"].get("workflowId", path.stem)
    replayer = Replayer(workflows=ALL_WORKFLOWS, data_converter=pydantic_data_converter)
    await replayer.replay_workflow(WorkflowHistory.from_json(workflow_id, data))


def test_capacity_histories_are_recorded() -> None:
    assert {p.stem for p in recorded()} >= EXPECTED
