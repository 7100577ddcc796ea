"""The Site entity wakes on events, not on a short timer (issue 37), on the real dev server and
the simulated fleet: an idle site's history does not grow; its nodes going NotReady all at once
open an incident inside the window with its probe timer off (``check_seconds`` an hour); each
Node entity knows its node fell silent, from the cluster, within 60 s, and watches afresh when it
answers again. The recorded histories replay (tests/test_replay.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from fleet import naming
from fleet.contracts import workflows as flows
from fleet.messages.capacity import SiteStatus
from fleet.messages.evacuation import AdmitRepairInput, RepairDecision
from fleet.messages.watches import ClusterNodeState
from fleet.messages.repair import NodeStatus
from tests.conftest import wait_for
from tests.evacuation_helpers import IncStack, activity_inputs, incident_fleet, open_incident_stack, poll
from tests.replay import replay_and_record
from tests.repair_helpers import eventually
from tests.test_repair_cancel import rstack  # noqa: F401 - the fixture

MODEL = "llm"
#: Billed history events a Site entity records when it does something (an activity, a timer, a
#: signal it sends or gets, a search-attribute upsert).
BILLED = {EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED, EventType.EVENT_TYPE_TIMER_STARTED,
          EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED, EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES,
          EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED}


@pytest.fixture
async def quiet(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[IncStack]:
    """The incident stack with the old probe timer an hour long: whatever the site sees, its
    watch saw (the window stays 30 s, the trip 3 nodes)."""
    uid = uuid.uuid4().hex[:6]
    fleet = incident_fleet(uid, incident={"check_seconds": 3600})
    async for stack in open_incident_stack(temporal_env.client, tmp_path, fleet, uid):
        yield stack


@pytest.fixture
async def busy(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[IncStack]:
    """The incident stack as the incident tests run it: the old probe timer half a second."""
    async for stack in open_incident_stack(temporal_env.client, tmp_path):
        yield stack


async def billed(handle) -> int:
    history = await handle.fetch_history()
    return sum(e.event_type in BILLED for e in history.events)


async def node_names(inc: IncStack, name: str) -> list[str]:
    return sorted(n.name for n in inc.cluster.list_nodes() if n.site == inc.site(name))


async def node(inc: IncStack, name: str) -> NodeStatus | None:
    try:
        return await inc.client.get_workflow_handle(f"node/{name}").query("status", result_type=NodeStatus)
    except Exception:  # noqa: BLE001 - not started yet
        return None


async def test_an_idle_site_costs_nothing_and_its_nodes_entities_learn_notready_from_the_cluster(busy) -> None:
    """``check_seconds`` half a second: the probe a site ran on that timer is now inside its watch."""
    inc = busy
    a = inc.site("a")
    await inc.join("a", 2)
    handle = await inc.start_site("a", reconcile_seconds=3600)

    async def settled() -> SiteStatus | None:
        status = await handle.query("status", result_type=SiteStatus)
        return status if "within min/max" in status.last else None

    await poll(settled, timeout=30)
    await asyncio.sleep(1.0)
    before = await billed(handle)
    await asyncio.sleep(8)
    assert await billed(handle) == before, "an idle site did something on a timer"

    # Both nodes fall silent (their agents and kubelets stop): 2 of 2, under the trip's 3 nodes.
    names = await node_names(inc, "a")
    inc.world.set_site(a, unreachable=1)

    async def told() -> list[NodeStatus] | None:
        found = [await node(inc, n) for n in names]
        return found if all(s is not None and s.not_ready_since is not None for s in found) else None

    # Told by the site's watch, from the cluster (the reconcile that would tell is an hour away;
    # the poll's bound only guards against a hang).
    statuses = await poll(told, timeout=120)
    assert all(any("NotReady in the cluster" in line for line in s.log) for s in statuses)
    status = await handle.query("status", result_type=SiteStatus)
    assert sorted(status.incident.failing) == names and status.incident.open is None, "counted, not tripped"

    inc.world.set_site(a, unreachable=0)

    async def back() -> list[NodeStatus] | None:
        found = [await node(inc, n) for n in names]
        return found if all(s is not None and s.not_ready_since is None for s in found) else None

    statuses = await poll(back, timeout=30)
    assert all(any("Ready again in the cluster" in line for line in s.log) for s in statuses)
    # The fresh watch works: a GPU fault on a node that came back is seen and repaired.
    [machine] = [m["id"] for m in inc.world.machines(a) if m["name"] == names[0]]
    inc.world.inject_fault(machine, 0, "xid", 48, clears_on="reset")

    async def repaired() -> bool:
        return bool((s := await node(inc, names[0])) and any("ended repaired" in line for line in s.log))

    await poll(repaired, timeout=45)
    await replay_and_record(handle, "site_events_nodes_notready_and_back")
    await replay_and_record(inc.client.get_workflow_handle(f"node/{names[0]}"), "node_entity_cluster_not_ready")


async def test_a_notready_in_a_runs_first_task_counts_and_its_ready_replaces_the_watch(busy) -> None:
    """The Site entity's ``cluster_state`` may land in a Node run's first workflow task (sent while
    the run before continued as new; here, with the start). The SDK runs that task's handlers
    before ``run`` decided that the cluster tells it anything: the NotReady was dropped, so the
    node was not known silent, and when it was Ready again the watch in flight (held by an agent
    that may be gone, for up to its 10-minute heartbeat timeout) was not replaced."""
    inc = busy
    name = f"{inc.site('a')}-first-task"  # no agent polls its queue: its first watch waits
    handle = await inc.client.start_workflow(
        flows.Node.TYPE, {"node_name": name}, id=naming.node_workflow_id(name), task_queue=inc.settings.task_queue,
        start_signal=flows.Node.cluster_state,
        start_signal_args=[ClusterNodeState(ready=False, observed_at=1000.0).model_dump(mode="json")])

    async def status() -> NodeStatus:
        return await handle.query(flows.Node.status, result_type=NodeStatus)

    async def watches(count: int) -> bool:
        return len(await activity_inputs(handle, "watch_node")) == count

    await poll(lambda: watches(1), timeout=30)
    first = await status()
    assert first.not_ready_since == 1000.0 and any("NotReady in the cluster" in line for line in first.log)

    await handle.signal(flows.Node.cluster_state, ClusterNodeState(ready=True, observed_at=1060.0).model_dump(mode="json"))
    await poll(lambda: watches(2), timeout=30)  # the watch in flight replaced
    after = await status()
    assert after.not_ready_since is None
    assert any("Ready again in the cluster after 60s NotReady" in line for line in after.log)
    await replay_and_record(handle, "node_cluster_state_in_the_first_task")
    await handle.terminate("test over")


async def test_a_sites_nodes_going_notready_at_once_trip_its_incident_within_the_window(quiet) -> None:
    """The provider is down: every node of the site NotReady at once. With no probe on a timer,
    the site's watch sees them, and the incident opens inside the 30 s window."""
    inc = quiet
    a = inc.site("a")
    await inc.join("a", 3)
    await inc.join("d", 1)
    inc.serve(MODEL, "a", replicas=1)
    inc.serve(MODEL, "d", replicas=0)
    handle = await inc.start_site("a", reconcile_seconds=3600)
    await poll(lambda: _watched(handle, 3), timeout=30)
    inc.world.set_site(a, unreachable=1)
    # The probe and the reconcile are an hour away: only the watch can open it (the poll's bound
    # only guards against a hang). Three nodes failing inside the window is what trips it.
    await poll(lambda: inc.progress("a"), timeout=90)
    status = await handle.query("status", result_type=SiteStatus)
    assert status.incident.open is not None and "3 of 3 nodes" in status.incident.open.reason
    await inc.evacuation("a").execute_update("abort", "test: stop here")
    await replay_and_record(handle, "site_events_notready_trips")


async def test_an_incident_is_evacuated_at_once_while_the_site_drains_its_surplus(temporal_env, tmp_path) -> None:
    """a (max 1) has four nodes, three above its max, and a PodDisruptionBudget holds every drain
    for its 60 s. Its details say which node it drains and until when. Then the provider goes
    down: every node NotReady. The incident opens and its evacuation starts within seconds, long
    before the first drain's 60 s end, and the retirement stops: the node it drained stays
    cordoned with the Site's mark, no other is drained, none retired. Once the site is back and the
    incident over, the site retires its surplus, that node first. Before, the loop drained the
    three one after another inside its own pass: no watch result taken (the Node entities not told
    NotReady), no incident, no evacuation, for 3 x 60 s (k x 300 s by default)."""
    from fleet.cluster import ANNOTATION_CORDONED_BY, CORDONED_BY_SURPLUS
    from tests.details_helpers import current_details, scheduled, until

    uid = uuid.uuid4().hex[:6]
    fleet = incident_fleet(uid, incident={"check_seconds": 3600}, a={"max_nodes": 1})
    async for inc in open_incident_stack(temporal_env.client, tmp_path, fleet, uid):
        a = inc.site("a")
        for _ in range(4):  # one at a time: a join of more than the site's max is refused
            await inc.join("a")
        await inc.join("d", 1)
        inc.serve(MODEL, "a", replicas=1)
        inc.serve(MODEL, "d", replicas=0)
        names = await node_names(inc, "a")
        for name in names:
            inc.cluster.add_pod(name, f"keeper-{name}", labels={"app": "keeper"})
        inc.cluster.set_pdb("default", "keeper", {"app": "keeper"}, min_available=len(names))
        handle = await inc.start_site("a", reconcile_seconds=3600, drain_seconds=60)

        def marked() -> list[str]:
            return [n for n in names if inc.cluster.get_node(n) is not None
                    and inc.cluster.annotate_node(n, {}).get(ANNOTATION_CORDONED_BY) == CORDONED_BY_SURPLUS]

        [draining] = await wait_for(marked, timeout=30)  # its first drain began
        shown = await current_details(handle)
        began, _ = await scheduled(handle, "drain_within")

        inc.world.set_site(a, unreachable=1)
        await poll(lambda: inc.progress("a"), timeout=90)  # a guard against a hang only
        assert f"retiring 3: draining {draining} {until(began, 60)}" in shown, shown

        # The retirement stopped: the node it drained left cordoned, marked the Site's; nothing
        # else drained, nothing retired.
        status = await handle.query("status", result_type=SiteStatus)
        assert status.incident.open is not None and status.retiring == []
        await asyncio.sleep(3)
        assert [d["node_name"] for d in await activity_inputs(handle, "drain_within")] == [draining]
        # The evacuation began while that drain was still held by the budget, and the drain was
        # cancelled: not run out (60 s), nor the next two drained first.
        assert await _drain_cut_short_by_the_evacuation(handle), "the evacuation waited for the drain"
        assert await activity_inputs(handle, "retire_machine") == []
        assert len(inc.world.machines(a)) == 4 and marked() == [draining]
        # The loop took the watch's results meanwhile: the silent nodes' entities know.
        silent = [n for n in names if n != draining]
        told = [await node(inc, n) for n in silent]
        assert all(s is not None and s.not_ready_since is not None for s in told), told

        # The site is back, the incident over: the surplus goes, the node it left cordoned first.
        inc.world.set_site(a, unreachable=0)
        inc.cluster.delete_pdb("default", "keeper")
        await inc.evacuation("a").execute_update("abort", "test: the site is back")
        await wait_for(lambda: len(inc.world.machines(a)) == 1, timeout=90)
        assert inc.cluster.get_node(draining) is None
        await replay_and_record(handle, "site_incident_stops_its_surplus_retirement")


async def _drain_cut_short_by_the_evacuation(handle) -> bool:
    """In the Site entity's history: its evacuation child started before its one drain ended,
    and that drain was cancelled."""
    events = (await handle.fetch_history()).events
    [drain] = [e.event_id for e in events if e.HasField("activity_task_scheduled_event_attributes")
               and e.activity_task_scheduled_event_attributes.activity_type.name == "drain_within"]
    evacuation = next(e.event_id for e in events
                      if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
                      and e.start_child_workflow_execution_initiated_event_attributes.workflow_type.name
                      == flows.SiteEvacuation.TYPE)
    ended = [e.event_id for e in events for field in ("activity_task_completed_event_attributes",
                                                      "activity_task_failed_event_attributes",
                                                      "activity_task_timed_out_event_attributes",
                                                      "activity_task_canceled_event_attributes")
             if e.HasField(field) and getattr(e, field).scheduled_event_id == drain]
    cancelled = [e for e in events if e.HasField("activity_task_cancel_requested_event_attributes")
                 and e.activity_task_cancel_requested_event_attributes.scheduled_event_id == drain]
    return all(end > evacuation for end in ended) and len(cancelled) == 1


async def _watched(handle, count: int) -> bool:
    status = await handle.query("status", result_type=SiteStatus)
    return status.incident is not None and status.incident.site_nodes >= count


async def test_the_schedules_sweep_starts_the_sites_not_running_and_signals_none(quiet) -> None:
    """The Schedule's pass (``SiteSweep`` naming no site) is a safety sweep: it starts the entity
    of every configured site that is not running, and leaves a running one alone (no signal, no
    action: it has its own watch and safety timer). Before, it signalled every site each pass."""
    inc = quiet
    handle = await inc.start_site("a", reconcile_seconds=3600)

    async def settled() -> bool:
        return "within min/max" in (await handle.query("status", result_type=SiteStatus)).last

    await poll(settled, timeout=30)
    await asyncio.sleep(1.5)  # visibility lists the running entity
    def signalled(history) -> int:
        return sum(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED for e in history.events)

    before = signalled(await handle.fetch_history())
    sweep = await inc.client.start_workflow("SiteSweep", {}, id=f"sweep-{uuid.uuid4().hex[:6]}",
                                            task_queue=inc.settings.task_queue, result_type=list[str])
    started = await sweep.result()
    assert sorted(started) == sorted(inc.site(n) for n in ("b", "c", "d")), started
    assert signalled(await handle.fetch_history()) == before, "a running site was signalled"
    for name in ("b", "c", "d"):
        described = await inc.client.get_workflow_handle(f"site/{inc.site(name)}").describe()
        assert described.status.name == "RUNNING", name
    await asyncio.sleep(1.5)  # visibility lists the entities just started
    again = await inc.client.execute_workflow("SiteSweep", {}, id=f"sweep-{uuid.uuid4().hex[:6]}",
                                              task_queue=inc.settings.task_queue, result_type=list[str])
    assert again == [], "every site runs: the sweep starts nothing"
    await replay_and_record(sweep, "site_sweep_starts_only")


#: The recorded SiteSweep pass that starts a terminated Node entity again, and the same scenario's
#: pass on the code before ``sweep-starts-node-entities`` (it started none; it must still replay).
RECORDED_NODE_SWEEP = "site_sweep_restarts_node_entities"
RECORDED_NODE_SWEEP_BEFORE = f"{RECORDED_NODE_SWEEP}_before"


async def _sweep(inc: IncStack) -> tuple:
    """One pass of the Schedule's SiteSweep (naming no site): its handle and what its node part
    answered (``ensure_node_entities``'s result; None where the pass ran none)."""
    sweep = await inc.client.start_workflow("SiteSweep", {}, id=f"sweep-{uuid.uuid4().hex[:6]}",
                                            task_queue=inc.settings.task_queue, result_type=list[str])
    await sweep.result()
    events = (await sweep.fetch_history()).events
    scheduled = {e.event_id for e in events if e.HasField("activity_task_scheduled_event_attributes")
                 and e.activity_task_scheduled_event_attributes.activity_type.name == "ensure_node_entities"}
    done = [e.activity_task_completed_event_attributes for e in events
            if e.HasField("activity_task_completed_event_attributes")
            and e.activity_task_completed_event_attributes.scheduled_event_id in scheduled]
    if not done:
        return sweep, None
    from fleet.messages.nodes import NodeEntitiesStarted

    return sweep, NodeEntitiesStarted.model_validate(json.loads(done[0].result.payloads[0].data))


async def test_the_schedules_sweep_starts_a_terminated_node_entity_again_and_no_retiring_nodes(quiet) -> None:
    """A Node entity is started by its node's join alone. Terminated (the Temporal UI, `temporal
    workflow terminate`), its node went on serving with nothing watching it: its faults started no
    repair, and `gpufleet repair node` said "ready". The Schedule's pass starts it again, from the
    join's record, and the new run repairs the node's next fault. It leaves alone a node cordoned
    for its retirement (the demand loop's drain) and one gpufleet has no identity record of (not
    joined by it, or retired), and a second pass right after, visibility not yet listing the new
    run, starts no second entity."""
    from client import FleetClient
    from fleet.cluster import CORDONED_BY_DEMAND, NODE_IDENTITY_KIND

    inc = quiet
    a = inc.site("a")
    await inc.join("a", 3)
    watched, retiring, unknown = names = await node_names(inc, "a")

    async def entities_listed() -> bool:
        query = (f'WorkflowType = "{flows.Node.TYPE}" AND ExecutionStatus = "Running" '
                 f'AND TaskQueue = "{inc.settings.task_queue}"')
        return len([w async for w in inc.client.list_workflows(query)]) == 3

    await poll(entities_listed, timeout=30)  # each join's admission started its node's entity

    async def entities_know_their_site() -> bool:
        # Each entity has run its first steps (an entity terminated before it learned its node's facts
        # leaves a status with no site, which `gpufleet repair node` shows as "site unknown").
        sites = [getattr(await node(inc, n), "site", "") for n in names]
        return sites == [a] * len(names)

    await poll(entities_know_their_site, timeout=30)
    entity = {n: inc.client.get_workflow_handle(naming.node_workflow_id(n)) for n in names}
    terminated = {n: (await entity[n].describe()).run_id for n in names}
    inc.cluster.cordon(retiring, True, by=CORDONED_BY_DEMAND)
    inc.cluster.delete_state(NODE_IDENTITY_KIND, unknown)
    for n in names:
        await entity[n].terminate("an operator's slip in the Temporal UI")

    # Before the pass: `gpufleet repair node` says the node is unwatched and how its entity ended,
    # not "ready"; `gpufleet sites` counts it (not the retiring node, nor the one of no record).
    shown = await _gpufleet(inc, "repair", "node", watched)
    assert shown.returncode == 0, shown.stderr
    assert f"{watched} ({a}): unwatched: its entity node/{watched} is not running (terminated at" in shown.stdout, \
        shown.stdout
    sites = await _gpufleet(inc, "sites", "-o", "json")
    assert {row["site"]: row["unwatched"] for row in json.loads(sites.stdout)}[a] == "1", sites.stdout

    sweep, first = await _sweep(inc)
    await replay_and_record(sweep, RECORDED_NODE_SWEEP)  # before the asserts: ``_before`` is this on the old code
    assert first is not None, "the pass did not look for node entities"
    assert (first.started, [s.node_name for s in first.named]) == (1, [watched]), first
    assert first.named[0].was == "terminated" and first.named[0].site == a
    restarted = await entity[watched].describe()
    assert restarted.status.name == "RUNNING" and restarted.run_id != terminated[watched]
    for n in (retiring, unknown):
        assert (await entity[n].describe()).status.name == "TERMINATED", n

    # At once, before visibility lists the new run: the pass sees it running and starts nothing.
    _, second = await _sweep(inc)
    assert second is not None and second.started == 0, second
    assert (await entity[watched].describe()).run_id == restarted.run_id, "a second entity"

    # The new run says why it runs, and repairs the node's next fault.
    status = await node(inc, watched)
    assert any("started again by the site sweep: its run before was terminated at" in line for line in status.log)
    [machine] = [m["id"] for m in inc.world.machines(a) if m["name"] == watched]
    inc.world.inject_fault(machine, 0, "xid", 48, clears_on="reset")

    async def repaired() -> bool:
        return bool((s := await node(inc, watched)) and any("ended repaired" in line for line in s.log))

    await poll(repaired, timeout=45)  # a guard against a hang only

    # The client says which runs: the node left unwatched (its retirement's) is, not "ready".
    fleet = FleetClient(inc.settings, inc.client)
    left = await fleet.node_status(retiring)
    assert (left.state, left.entity) == ("unwatched", "terminated") and left.entity_closed_at is not None, left
    assert (await fleet.node_status(watched)).entity == "running"
    sites = await _gpufleet(inc, "sites", "-o", "json")
    assert {row["site"]: row["unwatched"] for row in json.loads(sites.stdout)}[a] == "0", sites.stdout


async def _gpufleet(inc: IncStack, *args: str):
    import os
    import subprocess
    import sys

    env = {**os.environ, **inc.settings.env(), "COLUMNS": "200"}
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cli", *args], env=env,
                                   capture_output=True, text=True, timeout=120)


#: A Node entity the sweep started again, on a node whose GPU 0 an ended repair left fenced (the new
#: path of ``node-started-again-takes-what-was-left``; ``_before``: the code before, which held
#: nothing, replays), and one on a node whose repair still ran.
RECORDED_STARTED_AGAIN_HELD = "node_entity_started_again_holds_the_fenced_gpu"
RECORDED_STARTED_AGAIN_FOLLOWS = "node_entity_started_again_follows_the_running_repair"


async def _started_again(stack, node_name: str) -> WorkflowHandle:
    """Terminate the node's entity, then one pass of the Schedule's SiteSweep: the new run's handle."""
    entity = stack.client.get_workflow_handle(naming.node_workflow_id(node_name))
    before = (await entity.describe()).run_id
    await entity.terminate("an operator's slip in the Temporal UI")
    _, done = await _sweep(stack)
    assert done is not None and [s.node_name for s in done.named] == [node_name], done
    assert (await entity.describe()).run_id != before
    return entity


async def _taken(stack, node_name: str) -> NodeStatus | None:
    """The new run's status once it took what the run before left (or, on the code before, said it
    did not), else None."""
    status = await node(stack, node_name)
    took = ("not carried", "held for a person", "following it")
    return status if status and any(word in line for line in status.log for word in took) else None


async def test_a_node_entity_started_again_holds_the_gpu_a_repair_left_fenced_for_a_person(rstack) -> None:
    """A GPU whose repair ended unproven stays fenced, its node cordoned, held for a person by the
    node's entity. That entity terminated and started again by the sweep, the new run knew nothing
    of it: `gpufleet repair return` was refused ("not held for a person"), nothing showed the GPU
    as needing anyone, and it stayed fenced, the node cordoned, for good. The new run reads the
    node's fences first: the GPU is held for a person again, and `return` puts it back in service."""
    from activities.repair import fence_key
    from tests.test_cli import gpufleet
    from tests.test_repair_needs_person import _held_for_a_person

    node_name = (await _held_for_a_person(rstack)).node_name
    entity = await _started_again(rstack, node_name)
    status = await eventually(lambda: _taken(rstack, node_name), timeout=30)
    await replay_and_record(entity, RECORDED_STARTED_AGAIN_HELD)  # before the asserts: ``_before`` is this on the old code

    assert status.state == "needs-person" and set(status.needs_person) == {"0"}, status
    assert "fenced in the cluster (its mark says reboot) when its entity was started again" in \
        status.needs_person["0"], status
    assert any("GPU 0: fenced in the cluster and no repair runs: held for a person" in line for line in status.log)
    shown = await gpufleet(rstack, "repair", "node", node_name)
    assert "needs a person" in shown.stdout, shown.stdout

    done = await gpufleet(rstack, "repair", "return", node_name, "0", "--reason", "checked after the restart")
    assert done.returncode == 0, done.stderr
    assert "un-fenced, node uncordoned" in done.stdout, done.stdout
    assert fence_key(0) not in rstack.cluster.annotate_node(node_name, {})
    assert not rstack.cluster.get_node(node_name).unschedulable, "the node serves again"
    status = await node(rstack, node_name)
    assert status.state == "ready" and status.needs_person == {} and status.fenced == [], status
    await replay_and_record(entity, RECORDED_STARTED_AGAIN_HELD)


async def _held_before_its_proof(stack) -> tuple[str, WorkflowHandle]:
    """A node whose GPU 0's repair, held by a person, stopped after its reboot and before its proof
    (its action slot given back): the node's name and the repair's handle."""
    import time

    from fleet.messages.repair import LadderState
    from tests.test_repair_cancel import repair_waiting_for_boot

    joined, repair = await repair_waiting_for_boot(stack)
    node_name = joined.node_name
    await repair.execute_update(flows.GpuRepair.hold, {"reason": "look at the card before its proof"})
    stack.world.set_site("site-a", boot_seconds=1.0)
    with stack.world.tx() as db:  # the reboot ends now; the repair stops, held, before its proof
        db.execute("UPDATE machines SET boot_at=? WHERE id=?", (time.time(), joined.machine_id))

    async def held_after_its_reboot() -> bool:
        ladder = await repair.query(flows.GpuRepair.ladder, result_type=LadderState)
        status = await node(stack, node_name)
        return bool(ladder.held and ladder.attempts and status and status.node_actions
                    and status.node_actions[-1].finished_at is not None
                    and stack.cluster.get_node(node_name).ready)

    await eventually(held_after_its_reboot, timeout=30)
    return node_name, repair


async def test_a_node_entity_started_again_follows_the_repair_still_running_to_its_end(rstack) -> None:
    """A repair outlives its Node entity (abandoned, not cancelled, when the entity ends). Its entity
    terminated while the repair was held by a person after its reboot, and started again by the
    sweep, the new run did not know it: it showed the node "ready" and would not have held the GPU
    for a person had the repair ended unproven. The new run follows it to its end."""
    from activities.repair import fence_key

    node_name, repair = await _held_before_its_proof(rstack)
    entity = await _started_again(rstack, node_name)
    status = await eventually(lambda: _taken(rstack, node_name), timeout=30)
    await replay_and_record(entity, RECORDED_STARTED_AGAIN_FOLLOWS)

    assert status.state == "repairing" and status.active_repairs == {"0": repair.id}, status
    assert any(f"GPU 0: {repair.id} still runs (at reboot): following it" in line for line in status.log), status.log

    await repair.execute_update(flows.GpuRepair.release, {"reason": "the card looks fine"})
    assert (await repair.result())["outcome"] == "repaired"

    async def ended() -> NodeStatus | None:
        got = await node(rstack, node_name)
        return got if got and got.state == "ready" and not got.active_repairs else None

    status = await eventually(ended, timeout=30)
    assert any(f"GPU 0: {repair.id} ended repaired" in line for line in status.log), status.log
    assert status.needs_person == {}, status
    assert fence_key(0) not in rstack.cluster.annotate_node(node_name, {})
    assert not rstack.cluster.get_node(node_name).unschedulable
    await replay_and_record(entity, RECORDED_STARTED_AGAIN_FOLLOWS)


async def test_the_rung_a_fence_names_is_shown_and_a_retry_of_a_gpu_held_after_a_start_again_starts_at_a_reset(
        rstack) -> None:
    """The rung in a GPU's fence is on the node's own object. A Node entity started again took it as
    where a person's `repair retry` without `--rung` starts: a node that wrote "replace" in its fence
    had its machine deleted and a new one bought on a person's retry. The rung is shown only; the
    retry starts at a reset, as one of any GPU held for a person whose fault nobody knows."""
    from activities.repair import fence_key
    from tests.repair_helpers import repair_handle
    from tests.test_cli import gpufleet
    from tests.test_repair_needs_person import _held_for_a_person

    node_name = (await _held_for_a_person(rstack)).node_name
    rstack.cluster.annotate_node(node_name, {fence_key(0): "replace"})  # the node's word on its own object
    machines = len(rstack.world.machines())
    await _started_again(rstack, node_name)
    held = (await eventually(lambda: _taken(rstack, node_name), timeout=30)).needs_person

    done = await gpufleet(rstack, "repair", "retry", node_name, "0", "--reason", "checked after the restart")
    assert done.returncode == 0, done.stderr
    assert f"repair/{node_name}/gpu0 started at reset" in done.stdout, done.stdout
    assert (await repair_handle(rstack, node_name, 0).result())["outcome"] == "repaired"
    assert len(rstack.world.machines()) == machines, "nothing bought"
    assert "fenced in the cluster (its mark says replace) when its entity was started again" in held["0"], held
    assert "a retry starts at a reset unless it names a rung" in held["0"], held


async def test_a_repair_the_new_run_took_as_holding_the_slot_is_granted_its_next_rung(rstack, monkeypatch) -> None:
    """The new run read a repair as acting in the instant its action ended, its give-back sent to no
    run (the entity was terminated): the run held the slot for it, and nothing freed it. Its proof
    failed, it asked for the slot for a reinstall and waited behind itself for good, the node fenced
    and cordoned. A request from the slot's holder is its give-back: the reinstall is granted."""
    from activities.repair import RepairActivities

    node_name, repair = await _held_before_its_proof(rstack)
    [machine_id] = [m["id"] for m in rstack.world.machines() if m["name"] == node_name]
    running_repair = RepairActivities._running_repair

    async def read_acting(self, node: str, gpu: int):
        left = await running_repair(self, node, gpu)
        if left is not None and left.repair_id == repair.id:
            left.slot = "acting"
        return left

    monkeypatch.setattr(RepairActivities, "_running_repair", read_acting)
    await _started_again(rstack, node_name)
    status = await eventually(lambda: _taken(rstack, node_name), timeout=30)
    assert any("holding the node's action slot): following it" in line for line in status.log), status.log

    rstack.world.inject_fault(machine_id, 0, "xid", 79, clears_on="reinstall")  # its proof fails
    await repair.execute_update(flows.GpuRepair.release, {"reason": "the card looks fine"})
    result = await asyncio.wait_for(repair.result(), timeout=120)
    assert result["outcome"] == "repaired" and result["attempts"][-1]["rung"] == "reinstall", result
    await eventually(lambda: _idle(rstack, node_name), timeout=30)
    assert not rstack.cluster.get_node(node_name).unschedulable


async def _read_what_was_left(entity: WorkflowHandle) -> bool:
    """Whether the new run's ``node_left`` completed."""
    events = (await entity.fetch_history()).events
    scheduled = {e.event_id for e in events if e.HasField("activity_task_scheduled_event_attributes")
                 and e.activity_task_scheduled_event_attributes.activity_type.name == "node_left"}
    return any(e.activity_task_completed_event_attributes.scheduled_event_id in scheduled for e in events
               if e.HasField("activity_task_completed_event_attributes"))


async def test_a_node_entity_started_again_holds_no_gpu_whose_repair_ended_while_it_read_the_node(
        rstack, monkeypatch) -> None:
    """The new run read the node's fences, then its repairs: a repair that un-fenced its GPU and
    ended between the two reads left the GPU read fenced and no repair running, and the new run held
    a repaired GPU for a person, the node cordoned. Now the repairs are read first."""
    from activities.repair import RepairActivities, fence_key

    node_name, repair = await _held_before_its_proof(rstack)
    running_repair = RepairActivities._running_repair

    async def ends_first(self, node: str, gpu: int):
        if gpu == 0 and node == node_name:  # the repair proves, un-fences and ends as the run reads
            await repair.execute_update(flows.GpuRepair.release, {"reason": "the card looks fine"})
            assert (await repair.result())["outcome"] == "repaired"
        return await running_repair(self, node, gpu)

    monkeypatch.setattr(RepairActivities, "_running_repair", ends_first)
    entity = await _started_again(rstack, node_name)
    await eventually(lambda: _read_what_was_left(entity), timeout=60)

    async def settled() -> NodeStatus | None:
        got = await node(rstack, node_name)
        return got if got and not got.active_repairs and got.state in ("ready", "needs-person") else None

    status = await eventually(settled, timeout=30)
    assert status.state == "ready" and status.needs_person == {}, status
    assert fence_key(0) not in rstack.cluster.annotate_node(node_name, {})
    assert not rstack.cluster.get_node(node_name).unschedulable


async def test_a_node_entity_started_again_asks_a_repairs_ladder_again_when_the_server_does_not_answer(
        rstack, monkeypatch) -> None:
    """A ladder query that timed out once left the repair followed with nothing known of it: its
    rung taken as a reset and its place at the node's action slot lost (one waiting for it was never
    queued, and waited for a grant for good). The query is asked again."""
    from temporalio.client import WorkflowHandle as Handle
    from temporalio.service import RPCError, RPCStatusCode

    node_name, repair = await _held_before_its_proof(rstack)
    query, failed = Handle.query, []

    async def times_out_once(self, *args, **kwargs):
        if self.id == repair.id and not failed:
            failed.append(self.id)
            raise RPCError("query timed out", RPCStatusCode.DEADLINE_EXCEEDED, b"")
        return await query(self, *args, **kwargs)

    monkeypatch.setattr(Handle, "query", times_out_once)
    await _started_again(rstack, node_name)
    status = await eventually(lambda: _taken(rstack, node_name), timeout=60)
    assert failed, "the ladder query never failed"
    assert any(f"GPU 0: {repair.id} still runs (at reboot): following it" in line for line in status.log), status.log
    await repair.execute_update(flows.GpuRepair.release, {"reason": "the card looks fine"})
    assert (await repair.result())["outcome"] == "repaired"


#: A Node entity the sweep started again, on a node whose GPU 0 the run before fenced while its site
#: held the repair (the new path of ``node-started-again-rechecks-what-was-on-hold``; ``_before``: the
#: code before, which held it for a person, replays).
RECORDED_STARTED_AGAIN_ON_HOLD = "node_entity_started_again_rechecks_a_gpu_fenced_on_hold"


async def test_a_node_entity_started_again_asks_the_site_again_for_a_gpu_its_run_before_fenced_on_hold(
        temporal_env, tmp_path, monkeypatch) -> None:
    """A sick GPU is fenced at once, its node cordoned, and while its site holds the repair (an
    incident settling) the finding waits on hold in the Node entity. That entity terminated and
    started again by the sweep, the finding went with the run before, and the new run took the
    fence for one an ended repair left: the GPU was held for a person, the node cordoned until
    someone ran `gpufleet repair return` or `retry`. The fence says it was on hold: the new run
    asks the site again, and once the site admits it the GPU is repaired and serves again. (A
    quarantine: nothing in the node's health reports finds it again.)"""
    from temporalio import activity

    from activities.evacuation import EvacuationActivities
    from activities.repair import fence_key
    from tests.repair_helpers import exists, join_node, repair_handle, running_stack

    admit, holding = EvacuationActivities.admit_repair, [True]

    @activity.defn(name="admit_repair")  # (its annotations are read from this module's names)
    async def held_while_an_incident_settles(self, input: AdmitRepairInput) -> RepairDecision:
        if holding[0]:
            return RepairDecision(repair=False, incident=f"evacuate/{input.site}/1", why="an incident settles")
        return await admit(self, input)

    monkeypatch.setattr(EvacuationActivities, "admit_repair", held_while_an_incident_settles)  # before the worker
    async for stack in running_stack(temporal_env.client, tmp_path):
        joined = await join_node(stack)
        node_name = joined.node_name
        await stack.client.get_workflow_handle(naming.node_workflow_id(node_name)).signal(
            flows.Node.quarantine, {"reason": "failed an evacuation's proof"})

        async def on_hold() -> NodeStatus | None:
            got = await node(stack, node_name)
            return got if got and got.state == "awaiting-site" and got.deferred == [0] and got.fenced == [0] else None

        await eventually(on_hold, timeout=30)
        assert stack.cluster.get_node(node_name).unschedulable
        entity = await _started_again(stack, node_name)

        async def taken() -> NodeStatus | None:
            got = await node(stack, node_name)
            took = ("held for a person", "asking its site again")
            return got if got and any(word in line for line in got.log for word in took) else None

        status = await eventually(taken, timeout=30)
        await replay_and_record(entity, RECORDED_STARTED_AGAIN_ON_HOLD)  # before the asserts: ``_before``, the old code
        assert status.needs_person == {} and status.state == "awaiting-site", status
        assert (status.deferred, status.fenced) == ([0], [0]), status
        assert any("GPU 0: fenced on hold by the run before (its mark says reboot)" in line for line in status.log)

        holding[0] = False  # the incident settled: the site admits the next recheck's repair
        repair = repair_handle(stack, node_name, 0)
        await eventually(lambda: exists(repair), timeout=30)
        result = await asyncio.wait_for(repair.result(), timeout=60)
        assert result["outcome"] == "repaired" and [a["rung"] for a in result["attempts"]] == ["reset"], result
        status = await eventually(lambda: _idle(stack, node_name), timeout=30)
        assert status.needs_person == {} and status.fenced == [] and status.deferred == [], status
        assert fence_key(0) not in stack.cluster.annotate_node(node_name, {})
        assert not stack.cluster.get_node(node_name).unschedulable, "the node serves again"
        await replay_and_record(entity, RECORDED_STARTED_AGAIN_ON_HOLD)


async def test_a_node_entity_started_again_follows_a_repair_started_by_hand_between_its_two_reads(
        rstack, monkeypatch) -> None:
    """A person starts a GpuRepair by hand (``temporal workflow start --type GpuRepair``, its id the
    node's ``repair/<node>/gpu<i>``) just as the node's entity, started again, reads what was left: not
    yet running at the read of the repairs, it had fenced its GPU by the read of the fences. The GPU
    was held for a person while its repair ran, and `gpufleet repair node` said so. A fenced GPU the
    first read found no repair of is read again: the repair is followed to its end."""
    import threading

    from activities.repair import RepairActivities, fence_key
    from fleet.messages.repair import GpuRepairInput
    from sim.gpu import SimGpuBackend
    from tests.repair_helpers import join_node, repair_handle

    joined = await join_node(rstack)
    node_name = joined.node_name
    repair = repair_handle(rstack, node_name, 0)
    resetting_may_end = threading.Event()
    reset, running_repair = SimGpuBackend.reset_gpu, RepairActivities._running_repair
    started = []

    def slow_reset(self, index: int) -> str:
        resetting_may_end.wait(timeout=50)  # the repair runs while the new run reads and follows it
        return reset(self, index)

    async def started_by_hand_after_this_read(self, node: str, gpu: int):
        left = await running_repair(self, node, gpu)
        if gpu == 0 and not started:
            started.append(True)
            await rstack.client.start_workflow(
                flows.GpuRepair.TYPE, GpuRepairInput(node_name=node, gpu=0, site="site-a", machine_id=joined.machine_id,
                                                     gpus=2), id=repair.id, task_queue=rstack.settings.task_queue)
            for _ in range(150):  # until its containment fenced the GPU, before the read of the fences
                if fence_key(0) in rstack.cluster.annotate_node(node, {}):
                    break
                await asyncio.sleep(0.1)
        return left

    monkeypatch.setattr(SimGpuBackend, "reset_gpu", slow_reset)
    monkeypatch.setattr(RepairActivities, "_running_repair", started_by_hand_after_this_read)
    await _started_again(rstack, node_name)
    status = await eventually(lambda: _taken(rstack, node_name), timeout=30)
    assert started and fence_key(0) in rstack.cluster.annotate_node(node_name, {})
    assert status.needs_person == {} and status.active_repairs == {"0": repair.id}, status
    assert any(f"GPU 0: {repair.id} still runs (at reset): following it" in line for line in status.log), status.log

    resetting_may_end.set()
    assert (await asyncio.wait_for(repair.result(), timeout=60))["outcome"] == "repaired"
    status = await eventually(lambda: _idle(rstack, node_name), timeout=30)
    assert status.needs_person == {} and any(f"GPU 0: {repair.id} ended repaired" in line for line in status.log)
    assert not rstack.cluster.get_node(node_name).unschedulable


RECORDED_STARTED_AGAIN_DONE_WHILE_READING = "node_entity_started_again_action_done_while_it_read"


async def test_a_repair_whose_action_ended_while_the_new_run_read_it_is_not_held_at_the_slot_for_good(
        rstack, monkeypatch) -> None:
    """The new run read a repair as acting (its GPU reset running), and the reset ended while the run
    was still reading: the repair's `node_action_done` reached the new run, which held no slot yet and
    did nothing, and then the run made the repair the slot's holder, which nothing freed. Its proof
    failed, it asked for the slot for a reboot and waited behind itself for good, the node fenced and
    cordoned. Now a give-back that comes while the run reads counts: the reboot is granted."""
    import threading

    from activities.repair import RepairActivities
    from fleet.messages.repair import LadderState
    from sim.gpu import SimGpuBackend
    from tests.repair_helpers import exists, join_node, repair_handle

    resetting_may_end = threading.Event()
    reset, running_repair = SimGpuBackend.reset_gpu, RepairActivities._running_repair
    read_acting = []

    def slow_reset(self, index: int) -> str:
        resetting_may_end.wait(timeout=50)  # the repair holds the slot while the reset runs
        return reset(self, index)

    async def done_while_reading(self, node_name: str, gpu: int):
        left = await running_repair(self, node_name, gpu)
        if left is not None and left.slot == "acting":
            read_acting.append(True)
            resetting_may_end.set()  # its done, its failed proof and its request reach the new run now
            for _ in range(150):
                ladder = await repair.query(flows.GpuRepair.ladder, result_type=LadderState)
                if ladder.rung == "reboot" and ladder.step == "waiting for the node":
                    break
                await asyncio.sleep(0.2)
        return left

    monkeypatch.setattr(SimGpuBackend, "reset_gpu", slow_reset)
    monkeypatch.setattr(RepairActivities, "_running_repair", done_while_reading)
    joined = await join_node(rstack)
    node_name = joined.node_name
    rstack.world.inject_fault(joined.machine_id, 1, "xid", 48, clears_on="reboot")  # a reset does not clear it
    repair = repair_handle(rstack, node_name, 1)
    await eventually(lambda: exists(repair), timeout=30)

    async def resetting() -> bool:
        ladder = await repair.query(flows.GpuRepair.ladder, result_type=LadderState)
        return bool(ladder.step == "recovering" and ladder.rung == "reset" and ladder.attempts
                    and ladder.attempts[-1].outcome == "running")

    await eventually(resetting, timeout=30)
    await asyncio.sleep(1)
    entity = await _started_again(rstack, node_name)
    result = await asyncio.wait_for(repair.result(), timeout=90)
    await replay_and_record(entity, RECORDED_STARTED_AGAIN_DONE_WHILE_READING)

    assert read_acting, "the new run never read the repair acting"
    assert result["outcome"] == "repaired" and [a["rung"] for a in result["attempts"]] == ["reset", "reboot"], result
    await eventually(lambda: _idle(rstack, node_name), timeout=30)
    assert not rstack.cluster.get_node(node_name).unschedulable


async def _idle(stack, node_name: str) -> NodeStatus | None:
    got = await node(stack, node_name)
    return got if got and got.state == "ready" and not got.active_repairs else None


def test_a_sweep_pass_from_before_the_patch_looked_for_no_node_entities_and_one_after_did() -> None:
    """What the two recorded passes are (tests/test_replay.py replays both): the one from before
    ``sweep-starts-node-entities`` ran the sites' activity alone, as a pass open at the deploy did;
    the one after records the patch's marker and then the node entities' activity."""
    import base64

    from tests.replay import HISTORIES
    from workflows.site import SWEEP_NODE_ENTITIES_PATCH

    def steps(name: str) -> list[str]:
        events = json.loads((HISTORIES / f"{name}.json").read_text())["events"]
        out = []
        for e in events:
            if "activityTaskScheduledEventAttributes" in e:
                out.append(e["activityTaskScheduledEventAttributes"]["activityType"]["name"])
            elif "markerRecordedEventAttributes" in e:
                data = e["markerRecordedEventAttributes"]["details"]["patch-data"]["payloads"][0]["data"]
                out.append(json.loads(base64.b64decode(data))["id"])
        return out

    assert steps(RECORDED_NODE_SWEEP_BEFORE) == ["ensure_sites"]
    assert steps(RECORDED_NODE_SWEEP) == ["ensure_sites", SWEEP_NODE_ENTITIES_PATCH, "ensure_node_entities"]


RECORDED_REPAIR_OUTLIVES_ITS_ENTITY = "gpu_repair_outlives_its_node_entity"


async def test_a_repair_whose_node_entity_was_terminated_waits_for_the_next_run_and_ends_repaired(rstack) -> None:
    """A repair outlives its Node entity (abandoned, not cancelled, when the entity ends), but it
    asks that entity for the node's action slot and gives it back by a signal. Its entity terminated
    while the repair rebooted the node, the repair's `node_action_done` found no run and the repair
    failed: its GPU stayed fenced, the node cordoned, and the next run held it for a person. Now the
    give-back that could not be delivered is only noted, the repair proves, climbs to a reinstall and
    keeps its request for the slot pending, saying why; the sweep's next run takes the request over
    from the ladder, grants it, and the node ends repaired, un-fenced and uncordoned."""
    import time

    from activities.repair import fence_key
    from fleet.messages.repair import LadderState
    from tests.details_helpers import current_details
    from tests.repair_helpers import exists, join_node, repair_handle
    from tests.test_repair_cancel import SLOW_BOOT_SECONDS

    joined = await join_node(rstack)
    node_name = joined.node_name
    rstack.world.set_site("site-a", boot_seconds=SLOW_BOOT_SECONDS)
    rstack.world.inject_fault(joined.machine_id, 0, "xid", 79, clears_on="reinstall")  # a reboot does not clear it
    repair = repair_handle(rstack, node_name, 0)
    await eventually(lambda: exists(repair), timeout=30)

    async def rebooting() -> bool:
        status = await node(rstack, node_name)
        ladder = await repair.query(flows.GpuRepair.ladder, result_type=LadderState)
        return bool(ladder.step == "recovering" and "new boot id" in await current_details(repair)
                    and status and status.node_actions and status.node_actions[-1].finished_at is None)

    await eventually(rebooting, timeout=30)  # the repair holds the slot, waiting for the new boot id
    entity = rstack.client.get_workflow_handle(naming.node_workflow_id(node_name))
    await entity.terminate("an operator's slip in the Temporal UI")
    rstack.world.set_site("site-a", boot_seconds=1.0)
    with rstack.world.tx() as db:  # the reboot ends now; its proof fails and the ladder climbs
        db.execute("UPDATE machines SET boot_at=? WHERE id=?", (time.time(), joined.machine_id))

    async def asking_for_the_reinstall() -> LadderState | bool:
        if (await repair.describe()).status.name != "RUNNING":
            return True  # the defect: the repair ended at its signal to no run
        ladder = await repair.query(flows.GpuRepair.ladder, result_type=LadderState)
        # The step is taken as the request is signalled; why it waits is known once the signal failed
        # (a later task), so a query between the two sees the step and no reason yet.
        asking = ladder.step == "waiting for the node" and ladder.rung == "reinstall" and ladder.waiting_for
        return ladder if asking else False

    ladder = await eventually(asking_for_the_reinstall, timeout=60)
    described = await repair.describe()
    assert described.status.name == "RUNNING", f"the repair ended {described.status.name} with its entity gone"
    assert [(a.rung, a.outcome) for a in ladder.attempts] == [("reboot", "failed"), ("reinstall", "running")], ladder
    assert f"node/{node_name} is not running" in ladder.waiting_for, ladder
    details = await current_details(repair)
    assert "its request for the slot was not delivered and stays pending" in details and "the site sweep" in details, details
    assert "could not give the node's action slot back" in details, details
    assert fence_key(0) in rstack.cluster.annotate_node(node_name, {}), "contained while it waits"

    _, done = await _sweep(rstack)
    assert done is not None and [s.node_name for s in done.named] == [node_name], done
    assert (await repair.result())["outcome"] == "repaired"

    async def ended() -> NodeStatus | None:
        got = await node(rstack, node_name)
        return got if got and got.state == "ready" and not got.active_repairs else None

    status = await eventually(ended, timeout=30)
    assert any(f"GPU 0: {repair.id} still runs (at reinstall, waiting for the node's action slot)" in line
               for line in status.log), status.log
    assert [(a.repair_id, a.rung) for a in status.node_actions] == [(repair.id, "reinstall")], status
    assert status.needs_person == {} and status.fenced == [], status
    assert fence_key(0) not in rstack.cluster.annotate_node(node_name, {})
    assert not rstack.cluster.get_node(node_name).unschedulable, "the node serves again"
    await replay_and_record(repair, RECORDED_REPAIR_OUTLIVES_ITS_ENTITY)


async def test_a_repair_waiting_for_a_node_left_not_ready_gets_its_entity_from_the_sweep_and_ends_repaired(
        rstack) -> None:
    """A repair's Node entity terminated while the repair rebooted the node, and the machine's boot
    outlasted the reboot's timeout: the node stays NotReady, the repair climbs to a reinstall and
    waits for an entity run to take its request for the node's action slot over. The sweep started
    the entity of a Ready node only: nothing ever started this one, and the repair sat at "waiting
    for the node" for good, its GPU fenced. The sweep starts the entity of a NotReady node a repair
    runs on; the new run, its node's agent down, takes the request over and grants it, and once the
    machine is back the repair proves the GPU and the node serves again."""
    import time

    from activities.repair import fence_key
    from fleet.messages.repair import LadderState
    from tests.details_helpers import current_details
    from tests.repair_helpers import exists, join_node, repair_handle
    from tests.test_repair_cancel import SLOW_BOOT_SECONDS

    joined = await join_node(rstack)
    node_name = joined.node_name
    rstack.world.set_site("site-a", boot_seconds=SLOW_BOOT_SECONDS)  # past the reboot's 15 s: it times out
    rstack.world.inject_fault(joined.machine_id, 0, "xid", 79, clears_on="reboot")
    repair = repair_handle(rstack, node_name, 0)
    await eventually(lambda: exists(repair), timeout=30)

    async def rebooting() -> bool:
        ladder = await repair.query(flows.GpuRepair.ladder, result_type=LadderState)
        return ladder.step == "recovering" and "new boot id" in await current_details(repair)

    await eventually(rebooting, timeout=30)
    await rstack.client.get_workflow_handle(naming.node_workflow_id(node_name)).terminate(
        "an operator's slip in the Temporal UI")

    async def waiting_for_the_reinstall() -> LadderState | None:
        ladder = await repair.query(flows.GpuRepair.ladder, result_type=LadderState)
        # Its request to no run failed (``waiting_for`` says so): a sweep before that could start the
        # entity as the signal is still on its way, and the test would be about another order of events.
        asking = ladder.step == "waiting for the node" and ladder.rung == "reinstall" and ladder.waiting_for
        return ladder if asking else None

    ladder = await eventually(waiting_for_the_reinstall, timeout=60)
    assert [(a.rung, a.outcome) for a in ladder.attempts] == [("reboot", "failed"), ("reinstall", "running")], ladder
    assert not rstack.cluster.get_node(node_name).ready, "the reboot left the node NotReady"
    # Until the sweep's pass the fleet's metrics (GpufleetNodeUnwatched) and `gpufleet sites` count
    # it unwatched: they counted Ready nodes alone, and this repair waited on its entity unseen.
    from activities.env import FleetEnv
    from workers.metrics import fleet_snapshot

    snap = await fleet_snapshot(FleetEnv.from_settings(rstack.settings), rstack.client, rstack.settings.task_queue)
    assert (dict(snap.unwatched), snap.errors) == ({"site-a": 1}, {}), snap
    sites = await _gpufleet(rstack, "sites", "-o", "json")
    assert {row["site"]: row["unwatched"] for row in json.loads(sites.stdout)}["site-a"] == "1", sites.stdout

    _, done = await _sweep(rstack)
    assert done is not None and [s.node_name for s in done.named] == [node_name], \
        f"the sweep left the NotReady node's repair waiting for good: {done}"

    async def granted() -> bool:
        return "reinstall: waiting for a new boot id" in await current_details(repair)

    await eventually(granted, timeout=30)  # the new run took the request over and granted it
    assert not rstack.cluster.get_node(node_name).ready
    with rstack.world.tx() as db:  # the slow boot ends now
        db.execute("UPDATE machines SET boot_at=? WHERE id=?", (time.time(), joined.machine_id))
    assert (await repair.result())["outcome"] == "repaired"

    async def ended() -> NodeStatus | None:
        got = await node(rstack, node_name)
        return got if got and got.state == "ready" and not got.active_repairs else None

    status = await eventually(ended, timeout=30)
    assert any("its node is NotReady and a GpuRepair of it runs, waiting for the entity" in line
               for line in status.log), status.log
    assert any(f"GPU 0: {repair.id} still runs (at reinstall, waiting for the node's action slot)" in line
               for line in status.log), status.log
    assert [(a.repair_id, a.rung) for a in status.node_actions] == [(repair.id, "reinstall")], status
    assert status.needs_person == {} and status.fenced == [], status
    assert fence_key(0) not in rstack.cluster.annotate_node(node_name, {})
    assert rstack.cluster.get_node(node_name).ready and not rstack.cluster.get_node(node_name).unschedulable
