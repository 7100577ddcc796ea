"""A node gone from the cluster (retired by its site, or its Node object deleted by hand: ``kubectl
delete node``) has its Node entity ended within seconds: the Site entity's watch sees the node go and
tells it (``cluster_state`` with ``deleted``, ``site-tells-deleted-nodes``), and the entity, once the
cluster's own record confirms it (``node-ends-when-told-deleted``), cancels its watch and ends "replaced
or removed". Before, nobody told it: it ran on, listed as a live node, its watch pending on a queue no
agent polls, until the watch's retries ran out (up to an hour) and a facts read found the node gone.
A word that comes after the node joined again under its name ends nothing. On the real dev server and
the simulated fleet; the recorded histories replay (tests/test_replay.py)."""

from __future__ import annotations

import uuid

from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from fleet import naming
from fleet.contracts import workflows as flows
from fleet.messages.capacity import SiteStatus
from fleet.messages.repair import NodeStatus
from fleet.messages.watches import ClusterNodeState
from tests.conftest import wait_for
from tests.evacuation_helpers import IncStack, activity_inputs, incident_fleet, open_incident_stack, poll
from tests.replay import replay_and_record

#: How long a test waits for an entity to end: a guard against a hang only (before, up to an hour).
ENDS_WITHIN = 60


def entity(inc: IncStack, name: str) -> WorkflowHandle:
    return inc.client.get_workflow_handle(naming.node_workflow_id(name))


async def running(handle: WorkflowHandle) -> bool:
    return (await handle.describe()).status == WorkflowExecutionStatus.RUNNING


async def ended(handle: WorkflowHandle) -> NodeStatus:
    """The entity's last status, once it ended (completed: ``run`` returns it)."""

    async def closed() -> bool:
        return (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED

    await poll(closed, timeout=ENDS_WITHIN)
    return NodeStatus.model_validate(await handle.result())


async def watched(handle: WorkflowHandle, names: list[str]) -> bool:
    return sorted((await handle.query("status", result_type=SiteStatus)).nodes) >= names


async def test_a_node_retired_by_its_site_has_its_entity_ended_within_seconds(temporal_env, tmp_path) -> None:
    """a (max 1) has two nodes: its Site entity drains and retires one. That node's entity ends
    "replaced or removed" once the site's watch sees the node go; the other's runs on."""
    uid = uuid.uuid4().hex[:6]
    fleet = incident_fleet(uid, incident={"check_seconds": 3600}, a={"max_nodes": 1})
    async for inc in open_incident_stack(temporal_env.client, tmp_path, fleet, uid):
        a = inc.site("a")
        for _ in range(2):  # one at a time: a join of more than the site's max is refused
            await inc.join("a")
        names = sorted(n.name for n in inc.cluster.list_nodes() if n.site == a)
        for name in names:  # each entity watches its node before the site retires one
            await poll(lambda: _watching(entity(inc, name)), timeout=30)
        site = await inc.start_site("a", reconcile_seconds=3600, drain_seconds=1)
        await wait_for(lambda: len([n for n in names if inc.cluster.get_node(n) is not None]) == 1, timeout=90)
        [retired] = [n for n in names if inc.cluster.get_node(n) is None]
        [kept] = [n for n in names if n != retired]

        last = await ended(entity(inc, retired))
        assert last.state == "gone", last
        assert any("deleted from the cluster" in line and "removed, its watch cancelled" in line for line in last.log)
        assert await running(entity(inc, kept)), "the node still there is watched on"
        history = await site.fetch_history()
        told = [e for e in history.events if e.HasField("signal_external_workflow_execution_initiated_event_attributes")
                and e.signal_external_workflow_execution_initiated_event_attributes.workflow_execution.workflow_id
                == naming.node_workflow_id(retired)]
        assert told, "the site told the retired node's entity"
        await replay_and_record(site, "site_tells_a_retired_node_it_is_deleted")
        await replay_and_record(entity(inc, retired), "node_entity_ends_when_its_site_saw_it_retired")


async def test_a_node_deleted_by_hand_ends_its_entity_and_a_stale_word_ends_no_node_there_again(
        temporal_env, tmp_path) -> None:
    """Two nodes; a person deletes one's Node object (``kubectl delete node``): its entity ends
    within seconds, "replaced or removed". The site's word reaching a node that is in the cluster
    again (joined again under its name after its site saw it go) ends nothing: the entity reads the
    cluster, says so, and watches on."""
    uid = uuid.uuid4().hex[:6]
    async for inc in open_incident_stack(temporal_env.client, tmp_path, incident_fleet(uid, incident={
            "check_seconds": 3600}), uid):
        a = inc.site("a")
        await inc.join("a", 2)
        names = sorted(n.name for n in inc.cluster.list_nodes() if n.site == a)
        site = await inc.start_site("a", reconcile_seconds=3600)
        await poll(lambda: watched(site, names), timeout=30)
        for name in names:
            await poll(lambda: _watching(entity(inc, name)), timeout=30)
        deleted, there = names

        inc.cluster.remove_node(deleted)
        last = await ended(entity(inc, deleted))
        assert last.state == "gone", last
        assert any("deleted from the cluster" in line and "removed, its watch cancelled" in line for line in last.log)

        # The word again, for a node the cluster has (as if it joined again under its name since).
        node = entity(inc, there)
        await node.signal(flows.Node.cluster_state,
                          ClusterNodeState(ready=False, observed_at=1000.0, deleted=True).model_dump(mode="json"))

        async def heard() -> NodeStatus | None:
            status = await node.query(flows.Node.status, result_type=NodeStatus)
            return status if any("the cluster has it again" in line for line in status.log) else None

        status = await poll(heard, timeout=30)
        assert await running(node) and status.state == "ready", status
        assert status.not_ready_since is None, "nor taken as NotReady"
        # Watched on: no watch of it was cancelled.
        history = await node.fetch_history()
        assert not any(e.HasField("activity_task_cancel_requested_event_attributes") for e in history.events)
        await replay_and_record(node, "node_entity_told_deleted_while_in_the_cluster")
        await replay_and_record(entity(inc, deleted), "node_entity_ends_when_its_site_saw_it_deleted")


async def _watching(handle: WorkflowHandle) -> bool:
    try:
        return len(await activity_inputs(handle, "watch_node")) >= 1
    except Exception:  # noqa: BLE001 - not started yet
        return False
