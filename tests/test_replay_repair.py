"""Determinism of the Node entity and GpuRepair: recorded histories replay against today's code.

Recorded with ``GPUFLEET_RECORD=1 pytest tests/test_replay_repair.py``; commit the
files under tests/histories/ together with the workflow change they belong to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.repair_helpers import join_node, repair_handle, repair_result, running_stack
from workflows import ALL_WORKFLOWS

HISTORIES = Path(__file__).parent / "histories"
RECORD = os.environ.get("GPUFLEET_RECORD") == "1"
NAMES = {"gpu_repair_reset", "gpu_repair_reboot_after_reset", "gpu_repair_covered", "node_entity_two_repairs"}


def replayer() -> Replayer:
    return Replayer(workflows=ALL_WORKFLOWS, data_converter=pydantic_data_converter)


async def test_fresh_repair_histories_replay(temporal_env, tmp_path) -> None:
    async for stack in running_stack(temporal_env.client, tmp_path):
        a = await join_node(stack)
        stack.world.inject_fault(a.machine_id, 0, "xid", 48, clears_on="reset")
        await repair_result(stack, a.node_name, 0)
        stack.world.inject_fault(a.machine_id, 1, "xid", 48, clears_on="reboot")
        await repair_result(stack, a.node_name, 1)
        b = await join_node(stack, "site-b")
        stack.world.inject_fault(b.machine_id, 0, "xid", 79, clears_on="reboot")
        stack.world.inject_fault(b.machine_id, 1, "xid", 74, clears_on="reboot")
        await repair_result(stack, b.node_name, 0)
        covered = await repair_result(stack, b.node_name, 1)
        handles = {
            "gpu_repair_reset": repair_handle(stack, a.node_name, 0),
            "gpu_repair_reboot_after_reset": repair_handle(stack, a.node_name, 1),
            "gpu_repair_covered": repair_handle(stack, b.node_name, 1 if covered.attempts[0].outcome == "covered" else 0),
            "node_entity_two_repairs": stack.client.get_workflow_handle(f"node/{a.node_name}"),
        }
        for name, handle in handles.items():
            history = await handle.fetch_history()
            await replayer().replay_workflow(history)
            if RECORD:
                HISTORIES.mkdir(exist_ok=True)
                (HISTORIES / f"{name}.json").write_text(json.dumps(history.to_json_dict(), indent=1))


@pytest.mark.parametrize("name", sorted(NAMES))
async def test_recorded_repair_history_replays(name: str) -> None:
    path = HISTORIES / f"{name}.json"
    if not path.exists():
        pytest.fail(f"{path} missing: record with GPUFLEET_RECORD=1")
    data = json.loads(path.read_text())
    workflow_id = data["events"][0]["workflowExecutionStartedEventAttributes"].get("workflowId", name)
    await replayer().replay_workflow(WorkflowHistory.from_json(workflow_id, data))
