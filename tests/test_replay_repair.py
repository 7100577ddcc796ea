"""Determinism of the Node entity and GpuRepair: fresh histories replay against today's code.

Record with ``GPUFLEET_RECORD=1 pytest tests/test_replay_repair.py`` and commit the files
under tests/histories/ with the workflow change; tests/test_replay.py replays them all.
"""

from __future__ import annotations

import pytest

from tests.replay import HISTORIES, replay_and_record, replay_file
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


#: Cancelled repairs (tests/test_repair_cancel.py): a cancel during a reboot's wait for boot, and
#: during a replacement's join, each stopping the ladder; the Node entity that saw the first end
#: (its GPU left for a person). ``node_entity_repair_cancelled_before``: the Node entity called itself
#: ``ready`` when the repair ended, where it now says ``needs-person``: the same command (a search
#: attribute upsert, whose values a replay does not compare), so it replays.
CANCELLED_REPAIRS = ("gpu_repair_cancelled", "gpu_repair_cancelled_replacing",
                     "node_entity_repair_cancelled", "node_entity_repair_cancelled_before")


@pytest.mark.parametrize("name", CANCELLED_REPAIRS)
async def test_cancelled_repair_histories_replay(name: str) -> None:
    await replay_file(HISTORIES / f"{name}.json")
