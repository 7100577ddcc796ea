"""SiteEvacuation and AcquireCapacity continue as new in their long waits and lose nothing.

A dev server of their own suggests continue-as-new at 50 events (the real one at
4,096), so both workflows continue as new within seconds of starting to wait.
Each run that continued as new is checked to have had no activity and no child
workflow open at that moment; the chain must then finish exactly as one run would.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHistory
from temporalio.testing import WorkflowEnvironment

from fleet.messages.capacity import CapacityProgress, CapacityResult
from fleet.messages.evacuation import EvacuationProgress, EvacuationResult
from tests.can_server import run_chain, server_suggesting_continue_as_new
from tests.capacity_fleet import CapStack, open_stack
from tests.evacuation_helpers import IncStack, incident_fleet, open_incident_stack, poll
from tests.replay import replay_and_record

MODEL = "llm"


@pytest.fixture(scope="module")
async def can_env() -> AsyncIterator[WorkflowEnvironment]:
    async with server_suggesting_continue_as_new(50) as env:
        yield env


# -- helpers --------------------------------------------------------------------------------
def open_when_closed(history: WorkflowHistory) -> list[str]:
    """Activities and child workflows a run left open when it closed (by name)."""
    scheduled, children = {}, {}
    for e in history.events:
        if e.HasField("activity_task_scheduled_event_attributes"):
            scheduled[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
        for field in ("activity_task_completed_event_attributes", "activity_task_failed_event_attributes",
                      "activity_task_timed_out_event_attributes", "activity_task_canceled_event_attributes"):
            if e.HasField(field):
                scheduled.pop(getattr(e, field).scheduled_event_id, None)
        if e.HasField("start_child_workflow_execution_initiated_event_attributes"):
            children[e.event_id] = e.start_child_workflow_execution_initiated_event_attributes.workflow_type.name
        for field in ("start_child_workflow_execution_failed_event_attributes",
                      "child_workflow_execution_completed_event_attributes",
                      "child_workflow_execution_failed_event_attributes",
                      "child_workflow_execution_canceled_event_attributes",
                      "child_workflow_execution_timed_out_event_attributes",
                      "child_workflow_execution_terminated_event_attributes"):
            if e.HasField(field):
                children.pop(getattr(e, field).initiated_event_id, None)
    return sorted(scheduled.values()) + sorted(children.values())


async def continued_as_new(client: Client, workflow_id: str, first_run_id: str, times: int) -> bool:
    return len(await run_chain(client, workflow_id, first_run_id)) > times


# -- SiteEvacuation -------------------------------------------------------------------------
@pytest.fixture
async def inc(can_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[IncStack]:
    # Its waits' watch returns every second (30 minutes by default): the history grows, and each
    # return is where the run may continue as new.
    uid = uuid.uuid4().hex[:6]
    async for stack in open_incident_stack(can_env.client, tmp_path,
                                           incident_fleet(uid, incident={"recovery_watch_seconds": 1}), uid):
        yield stack


async def test_evacuation_continues_as_new_while_waiting_for_recovery_and_restores(inc: IncStack) -> None:
    a, d = inc.site("a"), inc.site("d")
    await inc.join("a", 3)
    await inc.join("d", 1)
    inc.serve(MODEL, "a", replicas=1)
    inc.serve(MODEL, "d", replicas=0)
    inc.world.set_site(a, unreachable=1)  # the provider is down: every agent at a stops dialing home
    handle = await inc.client.start_workflow(
        "SiteEvacuation", {"site": a, "reason": "test: provider down"}, id=f"evacuate/{a}/1",
        task_queue=inc.settings.task_queue,
    )
    first_run = handle.first_execution_run_id
    waiting: EvacuationProgress = await poll(lambda: _state(inc, "waiting-for-recovery"), timeout=60)
    # Two continue-as-new while probing: a continued run continues again.
    await poll(lambda: continued_as_new(inc.client, handle.id, first_run, times=2), timeout=60)

    carried: EvacuationProgress = await inc.progress("a")
    assert carried.state == "waiting-for-recovery"
    assert carried.timeline == waiting.timeline, "every mark (and its time) carried over"
    assert (carried.moves, carried.drained, carried.weights) == (waiting.moves, waiting.drained, waiting.weights)
    assert carried.moves == {MODEL: {d: 1}} and len(carried.drained) == 3
    chain = await run_chain(inc.client, handle.id, first_run)
    for history in chain[:-1]:
        assert open_when_closed(history) == [], "continued as new with an activity or child open"

    inc.world.set_site(a, unreachable=0)
    result = EvacuationResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert result.outcome == "restored"
    names = [s.name for s in result.timeline]
    assert names == [
        "detected", "weight 0", "replicas ready elsewhere", "drained", "recovered", "nodes proven",
        "replicas back", "weight 10%", "weight 50%", "weight 100%", "surplus drained", "restored",
    ]
    assert result.timeline[:len(waiting.timeline)] == waiting.timeline
    # What only the carried state knows: the weights before, the drained nodes, the replicas elsewhere.
    routes = inc.cluster.get_site_routes().sites[a]
    assert (routes.weight, routes.healthy, routes.draining, routes.incident) == (100, True, False, "")
    final = inc.cluster.get_routing(MODEL).sites[a]  # written by the model's Routing entity
    assert final.weight > 0 and (final.healthy, final.draining, final.incident) == (True, False, "")
    assert not any(n.unschedulable for n in inc.cluster.list_nodes({"node-restriction.kubernetes.io/gpufleet-site": a})), "drained nodes back"
    assert inc.cluster.serving_status(MODEL, a).desired_replicas == 1
    assert inc.cluster.serving_status(MODEL, d).desired_replicas == 0, "replicas moved to d scaled back"
    assert len(await run_chain(inc.client, handle.id, first_run)) >= 3
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED

    await replay_and_record(inc.client.get_workflow_handle(handle.id, run_id=first_run),
                            "site_evacuation_continued_as_new_routed")
    await replay_and_record(handle, "site_evacuation_restored_after_continue_as_new_routed")


async def test_evacuation_continues_as_new_while_no_compliant_site_then_moves_on(inc: IncStack) -> None:
    """b is a compliance site in the eu: eu-only has nowhere to go until a person adds a Deployment at d."""
    b, d = inc.site("b"), inc.site("d")
    await inc.join("b", 2)
    await inc.join("d", 2)
    inc.serve(MODEL, "b", replicas=1)
    inc.serve(MODEL, "d", replicas=0)
    inc.serve("eu-only", "b", replicas=1)
    inc.serve("eu-only", "c", replicas=0)  # outside the geography: never a target
    inc.world.set_site(b, unreachable=1)
    handle = await inc.client.start_workflow(
        "SiteEvacuation", {"site": b, "reason": "test: provider down"}, id=f"evacuate/{b}/1",
        task_queue=inc.settings.task_queue,
    )
    first_run = handle.first_execution_run_id
    stuck: EvacuationProgress = await poll(lambda: _state(inc, "needs-person", "b"), timeout=60)
    await poll(lambda: continued_as_new(inc.client, handle.id, first_run, times=1), timeout=60)
    carried = await inc.progress("b")
    assert carried.state == "needs-person" and "eu-only" in carried.needs_person
    assert carried.timeline == stuck.timeline

    inc.serve("eu-only", "d", replicas=0)  # a person adds a compliant Deployment, and says so
    await handle.signal("retry")
    moved: EvacuationProgress = await poll(lambda: _state(inc, "waiting-for-recovery", "b"), timeout=60)
    assert moved.moves == {MODEL: {d: 1}, "eu-only": {d: 1}}
    assert [s.name for s in moved.timeline] == ["detected", "weight 0", "replicas ready elsewhere", "drained"]
    assert inc.cluster.serving_status("eu-only", d).desired_replicas == 1

    await handle.execute_update("abort", "test: stop here")
    # The abort waits (up to ready_seconds, 8 s here) for b's replicas, which cannot come up while
    # b is unreachable, before routing returns and the replicas elsewhere go.
    result = EvacuationResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert result.outcome == "aborted"
    assert inc.cluster.get_site_routes().sites[b].weight == 100, "an abort restores the routing (issue 36)"
    for history in (await run_chain(inc.client, handle.id, first_run))[:-1]:
        assert open_when_closed(history) == [], "continued as new with an activity or child open"
    await replay_and_record(inc.client.get_workflow_handle(handle.id, run_id=first_run),
                            "site_evacuation_continued_as_new_placing_routed")
    # Named for the patch ``evacuation-abort-restores`` (now removed: docs/design/patches.md, "Retired").
    await replay_and_record(handle, "site_evacuation_aborted_restores_after_continue_as_new")


async def _state(inc: IncStack, state: str, name: str = "a"):
    progress = await inc.progress(name)
    return progress if progress is not None and progress.state == state else None


# -- AcquireCapacity ------------------------------------------------------------------------
@pytest.fixture
async def cap(can_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[CapStack]:
    address = can_env.client.service_client.config.target_host
    async for stack in open_stack(can_env.client, address, tmp_path):
        yield stack


async def test_capacity_continues_as_new_while_backing_off_and_keeps_its_attempts(cap: CapStack) -> None:
    # The catalog (read once, kept 10 min) sells cheap and mid; the providers have nothing left.
    cap.world.set_site(cap.site("dear"), capacity=0)
    cap.world.set_site(cap.site("spot"), capacity=0)
    await cap.refresh_catalog()
    cap.world.set_site(cap.site("cheap"), capacity=0)
    cap.world.set_site(cap.site("mid"), capacity=0)
    handle = await cap.request({
        "constraints": {"gpu": "H100"}, "count": 1, "catalog_max_age_seconds": 600, "deadline_seconds": 120,
        "backoff_seconds": 0.3, "max_backoff_seconds": 0.3, "unavailable_ttl_seconds": 600,
    })
    first_run = handle.first_execution_run_id
    await poll(lambda: continued_as_new(cap.client, handle.id, first_run, times=2), timeout=60)

    waiting = await handle.query("progress", result_type=CapacityProgress)
    tried = [(cap.offer("cheap"), "NoCapacity"), (cap.offer("mid"), "NoCapacity")]
    assert [(a.offer, a.outcome) for a in waiting.attempts] == tried
    assert waiting.requested == 1 and waiting.joined == 0
    chain = await run_chain(cap.client, handle.id, first_run)
    for history in chain[:-1]:
        assert open_when_closed(history) == [], "continued as new with a join or an activity open"

    # Capacity is back, cheapest first: cheap is still out of the ranking (its NoCapacity
    # exclusion was carried), so the request takes dear.
    cap.world.set_site(cap.site("cheap"), capacity=2)
    cap.world.set_site(cap.site("dear"), capacity=2)
    await cap.refresh_catalog()
    result = CapacityResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert result.complete
    assert [n.site for n in result.nodes] == [cap.site("dear")]
    assert [(a.offer, a.outcome) for a in result.attempts] == [*tried, (cap.offer("dear"), "joined")]
    assert cap.world.calls(cap.account("a"), "create") == 1, "cheap was not tried again"
    # The join numbering carried on: three joins, three ids.
    request_id = handle.id.removeprefix("capacity/")

    async def joins() -> list[str]:
        found = [w.id async for w in cap.client.list_workflows('WorkflowType = "NodeJoin"') if request_id in w.id]
        return found if len(found) >= 3 else []

    assert sorted(j.rsplit("-", 1)[1] for j in await poll(joins, timeout=15)) == ["1", "2", "3"]

    await replay_and_record(cap.client.get_workflow_handle(handle.id, run_id=first_run), "capacity_continued_as_new")
    await replay_and_record(handle, "capacity_completed_after_continue_as_new")



# -- no entity spins (issue 37) ---------------------------------------------------------------
#: Each entity's status query; every one is asked throughout and must answer, over and over.
STATUS_QUERIES = {"Site": "status", "Node": "status", "Demand": "status", "ProviderAccount": "status",
                  "Routing": "progress"}


@pytest.fixture(scope="module")
async def spin_env() -> AsyncIterator[WorkflowEnvironment]:
    """A dev server that suggests continue-as-new after 40 events: every entity is asked to
    continue within seconds, while children and background tasks are still open."""
    async with server_suggesting_continue_as_new(40) as env:
        yield env


async def failed_workflow_tasks(client: Client, task_queue: str) -> dict[str, list[str]]:
    """Workflow id → why each of its workflow tasks failed, in every run of every workflow on the queue."""
    failed: dict[str, list[str]] = {}
    async for wf in client.list_workflows(f'TaskQueue = "{task_queue}"'):
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        for e in history.events:
            if e.HasField("workflow_task_failed_event_attributes"):
                why = e.workflow_task_failed_event_attributes.failure.message[:300]
                failed.setdefault(f"{wf.id} ({wf.workflow_type})", []).append(why)
    return failed


@pytest.mark.integration
async def test_no_entity_spins_while_its_children_and_tasks_are_open(spin_env: WorkflowEnvironment,
                                                                     tmp_path: Path) -> None:
    """Every entity runs on a server that asks it to continue as new after 40 events, while each
    kind of child and background task it can have is open: a fill (site c: below its min, no
    capacity), an evacuation (site a: its provider down, waiting for recovery), a repair held by
    that incident (a node of a), a spot reclaim whose drain a PDB holds (a node of d), the watches
    (every Site, Node and the Demand loop), the Demand loop's own loop, a Routing and an account
    entity. Throughout: no workflow task fails, and every entity answers its status query, over
    and over (a spinning entity fails its tasks and answers nothing)."""
    from fleet.naming import account_workflow_id, reclaim_workflow_id
    from tests.evacuation_helpers import FAST_JOIN, incident_fleet, open_incident_stack

    uid = uuid.uuid4().hex[:6]
    # d is spot: only a spot node's reclaim notice is obeyed.
    fleet = incident_fleet(uid, c={"min_nodes": 1, "sim": {"capacity": 0, "quota": 12, "boot_seconds": 0.1}},
                           d={"capacity_type": "spot"})
    async for inc in open_incident_stack(spin_env.client, tmp_path, fleet, uid):
        client, queue = inc.client, inc.settings.task_queue
        a, c, d = inc.site("a"), inc.site("c"), inc.site("d")
        await inc.join("a", 3)
        await inc.join("d", 2)
        inc.serve(MODEL, "a", replicas=1)
        inc.serve(MODEL, "d", replicas=0)
        fill = {"fill_request": {"join_timeouts": FAST_JOIN, "deadline_seconds": 600, "backoff_seconds": 1}}
        for name in ("a", "c", "d"):
            await inc.start_site(name, **(fill if name == "c" else {}))
        await client.start_workflow("Demand", {"tick_seconds": 3600, "idle_ttl_seconds": 3600}, id=f"demand-{uid}",
                                    task_queue=queue)
        await client.start_workflow("ProviderAccount", {"account": f"a-{uid}", "provider": "lambda"},
                                    id=account_workflow_id("lambda", f"a-{uid}"), task_queue=queue)
        # The CSR approver: a pass, then its watch on CSRs (the joins above made some), open throughout.
        approver = await client.start_workflow("CsrApprover", {}, id=f"csr-approver-{uid}", task_queue=queue)
        # Every entity's status query, from here to the end (not only once things settled): a
        # spinning entity answers nothing, and one that stalls while its children open is as bad.
        answered: Counter = Counter()
        querying = asyncio.create_task(_query_throughout(client, queue, answered))
        # A repair at a, then a's provider goes down: the incident holds the repair and evacuates.
        machines_a = [m for m in inc.world.machines(a)]
        inc.world.inject_fault(machines_a[0]["id"], 0, "xid", 79, clears_on="reboot")
        await poll(lambda: inc.workflows("GpuRepair", "a"), timeout=30)
        inc.world.set_site(a, unreachable=1)
        await poll(lambda: _evacuation_waiting(inc), timeout=60)
        # A spot reclaim at d whose drain a PodDisruptionBudget holds for the notice's 10 minutes.
        victim = inc.world.machines(d)[0]
        inc.cluster.add_pod(victim["name"], "held", namespace="ml", labels={"app": "held"})
        inc.cluster.set_pdb("ml", "held", {"app": "held"}, min_available=1)
        inc.world.post_reclaim_notice(victim["id"], seconds=600)
        await poll(lambda: _running(client, reclaim_workflow_id(victim["name"])), timeout=30)
        await poll(lambda: _running(client, f"capacity/site-{c}-1"), timeout=30)  # c's fill waits for capacity

        # Past 40 events each, so the server asks them all to continue as new: signals the entities
        # take as no-ops (a reconcile; a Ready node told it is Ready) and pods nothing can take.
        held_node = machines_a[0]["name"]
        for _ in range(8):
            for name in ("a", "c", "d"):
                await client.get_workflow_handle(f"site/{inc.site(name)}").signal("reconcile")
            for node in (held_node, victim["name"]):
                await client.get_workflow_handle(f"node/{node}").signal("cluster_state", {"ready": True})
            await asyncio.sleep(0.3)
        for i in range(4):
            inc.cluster.create_pod(_unplaceable(f"nowhere-{i}"))
            await asyncio.sleep(1.5)

        # While all that was set up (a busy machine: joins, an incident, a reclaim), every entity
        # answered; from here, settled, every one running throughout answers again and again.
        assert not querying.done(), querying.exception()
        during_setup = Counter(answered)
        answered.clear()
        running_before = await _entities(client, queue)
        await asyncio.sleep(20)  # the entities continue (or wait to) while the querier asks
        running_after = await _entities(client, queue)
        querying.cancel()
        kinds = await asyncio.gather(asyncio.wait_for(querying, 30), return_exceptions=True)
        assert not [k for k in kinds if not isinstance(k, asyncio.CancelledError)], kinds
        asked = {kind for _wid, kind in [*answered, *during_setup]}
        assert {"Site", "Node", "Demand", "ProviderAccount", "Routing"} <= asked, asked
        silent = {key: answered[key] for key in running_before & running_after if answered[key] < 2}
        assert not silent, f"entities that answered their status query less than twice in 20 s: {silent}"
        # The approver is open still (watching) or ended as a run does, never failed.
        assert (await approver.describe()).status in (WorkflowExecutionStatus.RUNNING,
                                                      WorkflowExecutionStatus.COMPLETED)
        # The children and tasks were open all along, and every entity was asked to continue.
        for workflow_id in (f"evacuate/{a}/1", reclaim_workflow_id(victim["name"]), f"capacity/site-{c}-1"):
            assert await _running(client, workflow_id), f"{workflow_id} ended: the test held nothing open"
        assert await inc.workflows("GpuRepair", "a")
        # The entities holding a child open were asked to continue (past 40 events) and could not:
        # they wait, in the same run, without spinning; the others continued.
        for workflow_id in (f"site/{a}", f"site/{c}", f"node/{held_node}"):
            described = await client.get_workflow_handle(workflow_id).describe()
            assert described.raw_description.workflow_execution_info.history_length >= 40, workflow_id
            assert described.status == WorkflowExecutionStatus.RUNNING
        for workflow_id in (f"site/{d}", f"demand-{uid}"):
            handle = client.get_workflow_handle(workflow_id)
            first = (await handle.describe()).raw_description.workflow_execution_info.first_run_id
            assert first != (await handle.describe()).run_id, f"{workflow_id} never continued as new"
        failed = await failed_workflow_tasks(client, queue)
        # The server refuses a task that closes the run (continue-as-new) while a signal came in
        # during it, so the next task sees the signal (``UnhandledCommand``, retried at once): the
        # signals pushing the entities past 40 events race their continue-as-new. No other
        # failure, and no more than a couple of those per entity (a spinning entity fails for ever).
        assert {wf: whys for wf, whys in failed.items() if set(whys) != {"UnhandledCommand"}} == {}, failed
        assert all(len(whys) <= 3 for whys in failed.values()), failed
        await inc.evacuation("a").execute_update("abort", "test: stop here")


#: A status query unanswered this long fails the test: a guard against an entity that answers
#: nothing (spinning, or stuck), far above an answer's milliseconds on a busy machine.
QUERY_GUARD_SECONDS = 30


async def _entities(client: Client, queue: str) -> set[tuple[str, str]]:
    """(workflow id, type) of every entity with a status query running on ``queue`` now."""
    return {(wf.id, wf.workflow_type)
            async for wf in client.list_workflows(f'TaskQueue = "{queue}" AND ExecutionStatus = "Running"')
            if wf.workflow_type in STATUS_QUERIES}


async def _query_throughout(client: Client, queue: str, answered: Counter) -> None:
    """Until cancelled: every running entity on ``queue`` asked its status query, over and over;
    each answer counted in ``answered`` (by (workflow id, type)). A query not answered within
    ``QUERY_GUARD_SECONDS`` fails the test (through the task's result)."""
    while True:
        async for wf in client.list_workflows(f'TaskQueue = "{queue}" AND ExecutionStatus = "Running"'):
            if wf.workflow_type not in STATUS_QUERIES:
                continue
            try:
                # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that comes as the query
                # answers, so this loop never ended and the test hung until pytest's timeout (a CI
                # run). asyncio.timeout runs the query in this task: a cancel always lands.
                async with asyncio.timeout(QUERY_GUARD_SECONDS):
                    await client.get_workflow_handle(wf.id).query(STATUS_QUERIES[wf.workflow_type])
            except TimeoutError:
                raise AssertionError(f"{wf.id} answered no status query within {QUERY_GUARD_SECONDS} s") from None
            except Exception:  # noqa: BLE001 - it continued as new or ended between the list and the query
                continue
            answered[(wf.id, wf.workflow_type)] += 1
        await asyncio.sleep(0.2)


def _unplaceable(name: str):
    """An opted-in Pending pod no offer can take (a GPU nobody sells): the Demand loop plans it."""
    from fleet.demand import DEMAND_TAINT_KEY, LABEL_FLEET, GpuPod, Toleration

    return GpuPod(namespace="ml", name=name, gpus=1, node_selector={LABEL_FLEET: "true", "gpufleet.io/gpu": "B200"},
                  tolerations=[Toleration(key=DEMAND_TAINT_KEY, operator="Exists")])


async def _running(client: Client, workflow_id: str) -> bool:
    try:
        return (await client.get_workflow_handle(workflow_id).describe()).status == WorkflowExecutionStatus.RUNNING
    except Exception:  # noqa: BLE001 - not started yet
        return False


async def _evacuation_waiting(inc) -> bool:
    progress = await inc.progress("a")
    return progress is not None and progress.state == "waiting-for-recovery"
