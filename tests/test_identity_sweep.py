"""FleetSweep deletes the identity records of nodes that are gone (issue 24, item 3): what a
``kubectl delete node`` or a crash between the two deletes of ``remove_node`` left. A record
without its Node is kept for the grace period (its kubelet may register it again), then
deleted; the records of live nodes stay. On the simulated fleet, with the real worker."""

from __future__ import annotations

import uuid

from fleet.cluster import NODE_IDENTITY_KIND
from fleet.messages.sweep import FleetSweepResult
from tests.conftest import Stack
from tests.repair_helpers import join_node
from tests.replay import replay_and_record


async def sweep(stack: Stack, grace_seconds: float):
    handle = await stack.client.start_workflow(
        "FleetSweep", {"grace_seconds": grace_seconds}, id=f"fleet-sweep/{uuid.uuid4().hex[:8]}",
        task_queue=stack.settings.task_queue, result_type=FleetSweepResult,
    )
    return handle, await handle.result()


async def test_the_sweep_deletes_records_of_gone_nodes_after_the_grace(stack: Stack) -> None:
    gone, kept = await join_node(stack), await join_node(stack)
    assert set(stack.cluster.list_state(NODE_IDENTITY_KIND)) == {gone.node_name, kept.node_name}
    # Someone deletes the Node object behind gpufleet's back (kubectl delete node).
    with stack.world.tx() as db:
        db.execute("DELETE FROM nodes WHERE name=?", (gone.node_name,))

    _, young = await sweep(stack, grace_seconds=3600)
    assert young.identities.young == [gone.node_name] and young.identities.deleted == []
    assert stack.cluster.node_identity(gone.node_name) is not None, "kept within the grace"

    handle, old = await sweep(stack, grace_seconds=0)
    assert old.identities.deleted == [gone.node_name] and old.identities.listed == 2
    assert stack.cluster.node_identity(gone.node_name) is None
    assert stack.cluster.node_identity(kept.node_name).machine_id == kept.machine_id, "a live node keeps its own"
    await replay_and_record(handle, "fleet_sweep_identity_records")
