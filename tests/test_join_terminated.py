"""A NodeJoin terminated after its node registered leaves nothing past the leak sweep.

A terminate runs no clean-up: a join terminated (``temporal workflow terminate``, the UI's
button, a reset gone wrong) during its smoke test or admission leaves its machine, its Node
(registered, labelled with its site, tainted ``gpufleet.io/unproven``) and the node's identity
record. Nothing admits that node (no join runs), and no Node entity watches it. Before, the
FleetSweep counted it as a node that accounts for its machine: the machine was billed for good,
the Site counted the node toward its min (``joining``) and the demand loop counted it as capacity
on its way. Now a node left unproven by a join that no longer runs accounts for nothing: once its
machine is older than the grace, the sweep deletes the machine and then removes the Node and its
identity record. An unproven node whose join still runs is kept.

Against the real dev server, the control-plane worker and the simulated providers."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from temporalio import activity

from activities.node_agent import NodeAgentActivities
from fleet.cluster import UNPROVEN_TAINT
from fleet.messages.join import JoinProgress, NodeJoinResult
from fleet.messages.nodes import SmokeTestInput
from fleet.messages.sweep import FleetSweepResult
from tests.conftest import Stack, wait_for
from tests.repair_helpers import eventually
from tests.replay import replay_and_record

HOURS_2 = 7200


async def test_a_join_terminated_during_its_smoke_test_leaves_no_machine_node_or_record_past_the_sweep(
        fleet_world: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    testing, release = threading.Semaphore(0), threading.Event()
    honest = NodeAgentActivities.smoke_test

    @activity.defn(name="smoke_test")
    def smoke_test(self, input: SmokeTestInput) -> Any:  # no hint on self: the SDK skips it
        testing.release()
        release.wait(60)  # a long compute check: the terminate lands during it
        return honest(self, input)

    monkeypatch.setattr(NodeAgentActivities, "smoke_test", smoke_test)
    from tests.plugins.stack import running_stack

    async with running_stack(fleet_world) as stack:
        try:
            ended = await stack.start_join({"site": "site-a"}, request=f"ended-{uuid.uuid4().hex[:6]}")
            await wait_for(lambda: testing.acquire(blocking=False), timeout=30)
            running = await stack.start_join({"site": "site-a"}, request=f"running-{uuid.uuid4().hex[:6]}")
            await wait_for(lambda: testing.acquire(blocking=False), timeout=30)

            async def in_smoke_test(handle) -> bool:
                return JoinProgress.model_validate(await handle.query("progress")).step == "smoke test"

            for handle in (ended, running):
                await eventually(lambda h=handle: in_smoke_test(h), timeout=10)
            names = {h.id: JoinProgress.model_validate(await h.query("progress")) for h in (ended, running)}
            gone, kept = names[ended.id], names[running.id]
            await ended.terminate("a person ends a join that looks stuck")

            # What the terminate left: the machine, its Node unproven, its identity record.
            assert UNPROVEN_TAINT in stack.cluster.get_node(gone.node_name).taints
            assert stack.cluster.node_identity(gone.node_name).machine_id == gone.machine_id
            for p in (gone, kept):
                stack.world.age_machine(p.machine_id, HOURS_2)

            sweep = await stack.client.start_workflow(
                "FleetSweep", {"grace_seconds": 1800}, id=f"fleet-sweep/{uuid.uuid4().hex[:8]}",
                task_queue=stack.settings.task_queue, result_type=FleetSweepResult,
            )
            result = await sweep.result()
        finally:
            release.set()

        a = {r.site: r for r in result.sites}["site-a"]
        live = {m["id"] for m in stack.world.machines("site-a")}
        assert gone.machine_id not in live, f"the terminated join's machine is still billed: {a}"
        assert a.deleted == [gone.machine_id] and a.abandoned == [gone.node_name], a
        assert stack.cluster.get_node(gone.node_name) is None, "its Node removed"
        assert stack.cluster.node_identity(gone.node_name) is None, "its identity record removed"
        details = (await sweep.query("__temporal_workflow_metadata")).current_details
        assert f"removed nodes left unproven by a join no longer running: {gone.node_name}" in details, details
        # The join still running keeps its machine and node, and admits it.
        assert kept.machine_id in live and a.known == 1, a
        done = NodeJoinResult.model_validate(await running.result())
        assert done.nodes[0].node_name == kept.node_name
        assert UNPROVEN_TAINT not in stack.cluster.get_node(kept.node_name).taints
        await replay_and_record(sweep, "fleet_sweep_abandoned_node")
