"""Determinism of the Node entity and GpuRepair: fresh histories replay against today's code.

Record with ``GPUFLEET_RECORD=1 pytest tests/test_replay_repair.py`` and commit the files
under tests/histories/ with the workflow change; tests/test_replay.py replays them all.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tests.replay import HISTORIES, replay_and_record, replay_file
from workflows.repair import CANCEL_STOPS_PATCH
from tests.repair_helpers import join_node, repair_handle, repair_result, running_stack


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
            # Named for the newest Node patch (``node-patches-at-start``): the older files stay, they guard
            # runs in flight.
            "node_entity_two_repairs_patches_at_start": stack.client.get_workflow_handle(f"node/{a.node_name}"),
        }
        for name, handle in handles.items():
            await replay_and_record(handle, name)


#: Cancelled repairs (``repair-cancel-stops``, tests/test_repair_cancel.py): a cancel during a reboot's
#: wait for boot, and during a replacement's join, each stopping the ladder; the Node entity that saw
#: the first end (its GPU left for a person). The repairs were recorded while the patch was asked with
#: ``workflow.patched``: they hold its non-deprecated marker, as a run open when its deprecation
#: deploys does, and replay against ``deprecate_patch``. ``node_entity_repair_cancelled_before``: the
#: Node entity called itself ``ready`` when the repair ended, where it now says ``needs-person``: the
#: same command (a search attribute upsert, whose values a replay does not compare), so it replays.
CANCELLED_REPAIRS = ("gpu_repair_cancelled", "gpu_repair_cancelled_replacing",
                     "node_entity_repair_cancelled", "node_entity_repair_cancelled_before")


@pytest.mark.parametrize("name", CANCELLED_REPAIRS)
async def test_cancelled_repair_histories_replay(name: str) -> None:
    await replay_file(HISTORIES / f"{name}.json")


def test_the_recorded_cancelled_repair_holds_the_marker_an_open_run_holds() -> None:
    """What the replay above proves: a run that recorded the patch's non-deprecated marker, and
    stopped at its cancel (nothing scheduled after it), replays against today's deprecated call.
    Re-recorded, the file would hold the deprecated marker and prove nothing about open runs."""
    after = _after_cancel(HISTORIES / "gpu_repair_cancelled.json")
    assert after["markers"] == [{"id": CANCEL_STOPS_PATCH, "deprecated": False}] and after["scheduled"] == []
    assert after["ended"] == "EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED"


def _after_cancel(path: Path) -> dict:
    """The patch markers of a recorded run, the activities it scheduled after its cancel request, and its last event."""
    events = json.loads(path.read_text())["events"]
    markers, scheduled, cancelled = [], [], False
    for event in events:
        if event["eventType"] == "EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED":
            cancelled = True
        elif event["eventType"] == "EVENT_TYPE_MARKER_RECORDED":
            payload = event["markerRecordedEventAttributes"]["details"]["patch-data"]["payloads"][0]["data"]
            markers.append(json.loads(base64.b64decode(payload)))
        elif event["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED" and cancelled:
            scheduled.append(event["activityTaskScheduledEventAttributes"]["activityType"]["name"])
    return {"markers": markers, "scheduled": scheduled, "ended": events[-1]["eventType"]}
