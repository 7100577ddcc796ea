"""The demand loop (workflow ``Demand``) on the real dev server and the simulated fleet:
Pending pods buy the cheapest qualifying machines once, the scheduler binds them, idle
nodes go back (PDBs and the per-site fraction honoured); active-passive fails over and returns to
zero; a reclaim's replacement is not bought twice and the spot share holds; a pod that goes
cancels its purchase before provisioning."""

from __future__ import annotations

import asyncio
import threading
import re
import uuid
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from fleet.cluster import ANNOTATION_CORDONED_BY, CORDONED_BY_DEMAND, LABEL_GPU_PRODUCT, LABEL_MODEL, LABEL_SITE
from fleet.demand import (
    DEMAND_TAINT_KEY,
    LABEL_CAPACITY_TYPE,
    LABEL_FLEET,
    LABEL_GEOGRAPHY,
    GpuPod,
    Toleration,
)
from fleet.contracts import workflows as flows
from fleet.messages.capacity import CapacityProgress, CapacityResult
from fleet.messages.demand import DemandStatus
from fleet.naming import capacity_workflow_id, node_name_for
from tests.capacity_fleet import (
    FAST_JOIN,
    CapStack,
    capacity_fleet,
    open_stack,
    replay_and_record,
)
from tests.conftest import terminate_running, wait_for, write_after_next_read, write_before_next_cordon
from tests.details_helpers import current_details, until
from tests.details_helpers import scheduled as watch_scheduled
from tests.bad_input_helpers import wait_for_async
from tests.evacuation_helpers import failed_pass, poll, refuse

FAST = {"tick_seconds": 0.5, "batch_idle_seconds": 0.3, "batch_max_seconds": 2, "idle_ttl_seconds": 1,
        "max_site_fraction": 1, "purchase_deadline_seconds": 20, "drain_seconds": 2,
        "capacity_request": {"join_timeouts": FAST_JOIN, "backoff_seconds": 1}}


def demand_pod(name: str, gpus: int = 1, model: str = "", **selector: str) -> GpuPod:
    return GpuPod(namespace="ml", name=name, gpus=gpus, labels={LABEL_MODEL: model} if model else {},
                  node_selector={LABEL_FLEET: "true", **selector},
                  tolerations=[Toleration(key=DEMAND_TAINT_KEY, operator="Exists", effect="NoSchedule")])


async def open_demand(temporal_env: WorkflowEnvironment, tmp_path: Path, models: dict | None = None,
                      **overrides) -> AsyncIterator[CapStack]:
    uid = uuid.uuid4().hex[:6]
    fleet = capacity_fleet(uid, **overrides)
    if models:
        fleet["models"] = {name: {**policy, "sites": [f"{s}-{uid}" for s in policy["sites"]],
                                  "standby_sites": [f"{s}-{uid}" for s in policy.get("standby_sites", [])]}
                           for name, policy in models.items()}
    address = temporal_env.client.service_client.config.target_host
    async for stack in open_stack(temporal_env.client, address, tmp_path, fleet=fleet, uid=uid):
        yield stack


@asynccontextmanager
async def demand_stack(temporal_env: WorkflowEnvironment, tmp_path: Path, models: dict | None = None,
                       **overrides) -> AsyncIterator[CapStack]:
    """The one stack, closed even when the test fails while using it (an abandoned
    generator would leave its worker running and the session hanging)."""
    async with aclosing(open_demand(temporal_env, tmp_path, models, **overrides)) as stacks:
        async for stack in stacks:
            try:
                yield stack
            except BaseException:
                # The stack's own clean-up (after its yield) is skipped on the way out.
                await terminate_running(stack.client, stack.settings.task_queue)
                raise


async def start_demand(cap: CapStack, **overrides):
    return await cap.client.start_workflow(
        "Demand", {**FAST, **overrides}, id=f"demand-{cap.uid}", task_queue=cap.settings.task_queue)


async def status(handle) -> DemandStatus:
    return await handle.query("status", result_type=DemandStatus)


def bound(cap: CapStack) -> dict[str, str]:
    return {p.key: p.node for p in cap.cluster.list_gpu_pods() if p.node}


def purchases(cap: CapStack) -> int:
    return sum(1 for m in cap.world.query("SELECT * FROM machines") if True)


@pytest.fixture
async def cap(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[CapStack]:
    async for stack in open_demand(temporal_env, tmp_path):
        yield stack


async def test_pending_pods_buy_the_cheapest_qualifying_machines_once_and_idle_nodes_go_back(cap: CapStack):
    handle = await start_demand(cap)
    eu = [demand_pod(f"eu-{i}", **{LABEL_GEOGRAPHY: "eu", LABEL_CAPACITY_TYPE: "on-demand"}) for i in range(3)]
    us = demand_pod("us-0", 2, **{LABEL_GEOGRAPHY: "us-east", LABEL_GPU_PRODUCT: "H100"})
    for pod in [*eu, us]:
        cap.cluster.create_pod(pod)
    placed = await wait_for(lambda: len(bound(cap)) == 4 and bound(cap), timeout=60)
    nodes = {n.name: n for n in cap.cluster.list_nodes()}
    # eu on-demand: "mid" (the eu spot site is excluded); us-east: "cheap".
    assert {nodes[placed[p.key]].labels[LABEL_SITE] for p in eu} == {cap.site("mid")}
    assert nodes[placed["ml/us-0"]].labels[LABEL_SITE] == cap.site("cheap")
    assert len(nodes) == 3  # 3 eu GPUs on two 2-GPU machines, one for us-0: nothing else
    # Seen again and again (several ticks): nothing more is bought.
    await asyncio.sleep(2)
    assert len(cap.cluster.list_nodes()) == 3
    state = await status(handle)
    assert len([p for p in state.purchases]) == 3
    assert all("→" in line for line in state.log if "capacity/demand-" in line and "joined" not in line)
    # The pods go: the idle nodes are drained and retired (sites' min is 0).
    for key in placed:
        cap.cluster.delete_pod(*key.split("/"))
    await wait_for(lambda: not cap.cluster.list_nodes(), timeout=60)
    # The node goes in the retire step's activity; the loop logs it once that step has returned.
    await until_status(handle, lambda s: any(line.split(" ", 1)[1].startswith("retired") for line in s.log))
    await replay_and_record(handle, "demand_buy_then_retire")


async def test_active_passive_fails_over_and_returns_to_zero(temporal_env, tmp_path):
    models = {"llm": {"mode": "active-passive", "sites": ["dear"], "standby_sites": ["cheap"]}}
    async with demand_stack(temporal_env, tmp_path, models=models) as cap:
        handle = await start_demand(cap)
        cap.cluster.create_pod(demand_pod("r0", model="llm"))
        await wait_for(lambda: bound(cap), timeout=60)
        assert {n.labels[LABEL_SITE] for n in cap.cluster.list_nodes()} == {cap.site("dear")}
        # The primary has no capacity: the passive site serves.
        cap.world.set_site(cap.site("dear"), capacity=0)
        await cap.refresh_catalog()
        cap.cluster.create_pod(demand_pod("r1", gpus=2, model="llm"))
        await wait_for(lambda: "ml/r1" in bound(cap), timeout=60)
        node = bound(cap)["ml/r1"]
        assert cap.cluster.get_node(node).labels[LABEL_SITE] == cap.site("cheap")
        # The primary serves again; the passive replica goes: the passive site returns to zero.
        cap.cluster.delete_pod("ml", "r1")
        await wait_for(lambda: not cap.cluster.list_nodes({LABEL_SITE: cap.site("cheap")}), timeout=60)
        assert cap.cluster.list_nodes({LABEL_SITE: cap.site("dear")})
        await handle.terminate("test over")


async def until_status(handle, predicate, timeout: float = 30) -> DemandStatus:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        state = await status(handle)
        if predicate(state):
            return state
        assert asyncio.get_running_loop().time() < deadline, state.log[-10:]
        await asyncio.sleep(0.1)


async def test_a_loop_started_again_never_books_new_pods_on_an_earlier_loops_purchase(cap: CapStack):
    """The loop ended (a person terminated it, or an older build's loop failed) while a purchase of
    its was still buying, and ``gpufleet demand --start`` started a new one, with nothing carried.
    The new loop's purchase for a new Pending pod is a purchase of its own. Before, every fresh loop
    numbered ``capacity/demand-1`` on: its start found the earlier loop's purchase still running
    under that id and took it for its own, and nothing was bought for the new pod."""
    # Each purchase holds before its first join (its offer out of its own ranking for 60 s).
    hold = {**FAST["capacity_request"], "exclude": [{"offer": cap.offer(name), "seconds": 60}
                                                    for name in ("cheap", "mid")]}
    first = await start_demand(cap, capacity_request=hold)
    cap.cluster.create_pod(demand_pod("early", 2, **{LABEL_SITE: cap.site("mid")}))
    (earlier,) = (await until_status(first, lambda s: s.purchases)).purchases
    await first.terminate("the loop ended")
    cap.cluster.delete_pod("ml", "early")  # its purchase buys on: no loop to cancel it

    again = await start_demand(cap, capacity_request=hold)
    cap.cluster.create_pod(demand_pod("late", 2, **{LABEL_SITE: cap.site("cheap")}))
    state = await until_status(again, lambda s: s.purchases)
    (late,) = state.purchases
    assert late.pods == ["ml/late"] and late.site == cap.site("cheap")
    assert late.workflow_id != earlier.workflow_id, "booked on the earlier loop's purchase"
    for purchase in (earlier, late):
        described = await cap.client.get_workflow_handle(purchase.workflow_id).describe()
        assert described.status == WorkflowExecutionStatus.RUNNING, purchase.workflow_id
    await again.terminate("test over")


def scheduled_activities(history) -> list[str]:
    from temporalio.api.enums.v1 import EventType

    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


async def test_a_pending_pods_purchase_starts_from_the_step_that_plans_it(cap: CapStack):
    """From the watch that saw a new Pending pod to its purchase's start the loop runs one activity,
    ``plan_and_buy`` (the catalog read, the plan and the start), and follows the purchase from its
    answer. Before, three ran one after the other (``get_catalog``, ``plan_demand``,
    ``start_purchase``), each a round trip through the loop that the pod waited on: pod → bound took
    1.36 to 1.52 times a direct join of the same machine (``python -m bench.demand``, target 1.3)."""
    handle = await start_demand(cap, tick_seconds=3600)
    cap.cluster.create_pod(demand_pod("eu-0", **{LABEL_GEOGRAPHY: "eu", LABEL_CAPACITY_TYPE: "on-demand"}))
    await wait_for(lambda: bound(cap).get("ml/eu-0"), timeout=60)
    state = await until_status(handle, lambda s: [p.status for p in s.purchases] == ["joined"])
    (purchase,) = state.purchases
    assert (purchase.pods, purchase.offer) == (["ml/eu-0"], cap.offer("mid"))
    assert logged(state, f"ml/eu-0 → {cap.offer('mid')} → `{purchase.workflow_id}`"), state.log[-5:]
    steps = scheduled_activities(await handle.fetch_history())
    saw = steps.index("watch_demand_events")  # the first watch: it returned with the pod
    assert steps[saw + 1] == "plan_and_buy", steps
    assert not {"get_catalog", "plan_demand", "start_purchase"} & set(steps), steps
    await replay_and_record(handle, "demand_plans_and_buys_in_one_step")
    await handle.terminate("test over")


async def test_an_idle_loops_safety_look_costs_three_activities(cap: CapStack):
    """Idle costs nothing: with no Pending pod, each safety look (every ``tick_seconds``) schedules its
    watch, one activity to plan (``plan_and_buy``, which buys nothing) and the idle nodes' list: three
    billed actions. Before, the plan was two (``get_catalog``, ``plan_demand``): four a look."""
    handle = await start_demand(cap)  # a look every 0.5 s
    look = ["watch_demand_events", "plan_and_buy", "idle_nodes"]

    async def three_looks() -> list[str]:  # however slow the machine: the looks, not a time, are waited for
        steps = scheduled_activities(await handle.fetch_history())
        return steps if len(steps) >= 1 + 3 * len(look) else []
    steps = await poll(three_looks, timeout=60, interval=0.5)
    await handle.terminate("test over")
    assert steps[0] == "demand_settings", steps
    assert steps[1:] == (look * len(steps))[:len(steps) - 1], steps


async def test_a_step_that_failed_after_starting_a_purchase_does_not_buy_again(cap: CapStack, monkeypatch):
    """The loop hears of a purchase only from the answer of the step that planned and started it.
    That step failed right after the start (Temporal did not answer it): its next try finds the
    purchase under the number it would use, takes it as the loop's (its pods counted as joining)
    and buys nothing more; the loop follows it for the pod it was bought for."""
    from temporalio.service import RPCError, RPCStatusCode

    real, starts = Client.start_workflow, []

    async def lost_answer(self, *args, id: str, **kwargs):
        handle = await real(self, *args, id=id, **kwargs)
        if id.startswith("capacity/demand-"):
            starts.append(id)
            if len(starts) == 1:
                raise RPCError("the answer to the start was lost", RPCStatusCode.UNAVAILABLE, b"")
        return handle

    monkeypatch.setattr(Client, "start_workflow", lost_answer)
    # The purchase holds before its first join: its offer is out of its own ranking for 60 s.
    hold = {**FAST["capacity_request"], "exclude": [{"offer": cap.offer("cheap"), "seconds": 60}]}
    handle = await start_demand(cap, capacity_request=hold)
    cap.cluster.create_pod(demand_pod("once", **{LABEL_SITE: cap.site("cheap")}))
    state = await until_status(handle, lambda s: s.purchases)
    (purchase,) = state.purchases
    assert (purchase.pods, purchase.offer, purchase.status) == (["ml/once"], cap.offer("cheap"), "buying")
    assert starts == [purchase.workflow_id], "the try after the failed one started a purchase"
    await asyncio.sleep(1.5)  # passes since: the pod is covered by its purchase
    assert len((await status(handle)).purchases) == 1 and starts == [purchase.workflow_id]
    described = await cap.client.get_workflow_handle(purchase.workflow_id).describe()
    assert described.status == WorkflowExecutionStatus.RUNNING
    await handle.terminate("test over")
    await cap.client.get_workflow_handle(purchase.workflow_id).terminate("test over")


async def test_a_step_whose_first_start_failed_never_buys_twice_for_a_pod(cap: CapStack, monkeypatch):
    """The step plans two machines, one pod each; the first purchase's start fails (Temporal did not
    answer) and that pod goes before the next try. The next try plans the other pod alone: it is
    bought for once. Before, the starts ran side by side: the second purchase started while the
    first failed, the next try's look for what it started stopped at the first number (free), and
    the pod was bought for again under it, the earlier purchase buying on untracked."""
    from activities.demand import PURCHASE_MEMO
    from temporalio.service import RPCError, RPCStatusCode

    real, tried, started = Client.start_workflow, [], []

    async def first_start_fails(self, *args, id: str, **kwargs):
        if id.startswith("capacity/demand-"):
            tried.append(id)
            if len(tried) == 1:
                for pod in kwargs["memo"][PURCHASE_MEMO].pods:  # its pod goes before the next try
                    cap.cluster.delete_pod(*pod.split("/"))
                await asyncio.sleep(1)  # a start made beside this one has answered by now
                raise RPCError("Temporal did not answer the start", RPCStatusCode.UNAVAILABLE, b"")
        handle = await real(self, *args, id=id, **kwargs)
        if id.startswith("capacity/demand-"):
            started.append(id)
        return handle

    monkeypatch.setattr(Client, "start_workflow", first_start_fails)
    # Each purchase holds before its first join: its offer is out of its own ranking for 60 s.
    hold = {**FAST["capacity_request"], "exclude": [{"offer": cap.offer(name), "seconds": 60}
                                                    for name in ("cheap", "mid")]}
    handle = await start_demand(cap, capacity_request=hold, tick_seconds=3600)
    for name, site in (("one", "cheap"), ("two", "mid")):  # two GPUs each: a machine each
        cap.cluster.create_pod(demand_pod(name, 2, **{LABEL_SITE: cap.site(site)}))
    state = await until_status(handle, lambda s: s.purchases)
    await asyncio.sleep(1.5)  # passes since: the pod left is covered by its purchase
    state = await status(handle)
    bought: dict[str, list[str]] = {}
    for workflow_id in started:
        described = await cap.client.get_workflow_handle(workflow_id).describe()
        if described.status == WorkflowExecutionStatus.RUNNING:
            for pod in (await described.memo_value(PURCHASE_MEMO)).get("pods", []):
                bought.setdefault(pod, []).append(workflow_id)
    await handle.terminate("test over")
    for workflow_id in started:
        await cap.client.get_workflow_handle(workflow_id).terminate("test over")
    assert len(bought) == 1 and all(len(ids) == 1 for ids in bought.values()), f"bought twice: {bought}"
    assert [(p.workflow_id, p.pods) for p in state.purchases] == [(ids[0], [pod]) for pod, ids in bought.items()]


async def test_a_pod_that_goes_cancels_what_was_bought_for_it_before_provisioning(cap: CapStack):
    # Each purchase holds before its first join: its offer is out of its own ranking for 60 s.
    hold = {**FAST["capacity_request"], "exclude": [{"offer": cap.offer("cheap"), "seconds": 60}]}
    handle = await start_demand(cap, capacity_request=hold)
    cap.cluster.create_pod(demand_pod("brief", **{LABEL_SITE: cap.site("cheap")}))
    state = await until_status(handle, lambda s: any(p.status == "buying" for p in s.purchases))
    (purchase,) = state.purchases
    cap.cluster.delete_pod("ml", "brief")
    state = await until_status(handle, lambda s: s.purchases[0].status != "buying")
    assert state.purchases[0].status == "cancelled", state.log[-5:]
    assert any("cancelled before provisioning" in line for line in state.log)
    described = await cap.client.get_workflow_handle(purchase.workflow_id).describe()
    assert described.status == WorkflowExecutionStatus.CANCELED
    assert not cap.world.query("SELECT * FROM machines"), "nothing was bought"
    await handle.terminate("test over")


#: A loop's run that kept a purchase after its pods went (it could not be asked which joins it runs),
#: planned a new pod onto it and cancelled it once it could be asked (``demand-follows-kept-purchases``);
#: and the same scenario on the code before, which bought beside it and never asked again.
KEPT = "demand_follows_a_kept_purchase"
KEPT_BEFORE = f"{KEPT}_before"


async def test_a_kept_purchase_is_followed_new_pods_wait_on_it_and_it_is_cancelled_once_it_can_be_asked(
        cap: CapStack, monkeypatch):
    """A purchase's pod goes while Temporal does not answer its ``progress`` query (a transient
    error): ``cancel_purchase`` keeps it, since it cannot tell whether a join is buying a machine.
    The loop follows it on: a new pod that fits waits on it instead of buying a machine beside it,
    and the next pass that can ask cancels it (nothing of it was past provisioning); the new pod is
    then bought for. Before, a kept purchase was never looked at again: the new pod bought a second
    machine beside it, and it ran on alone to its deadline, buying for pods that were gone."""
    from temporalio.client import WorkflowHandle
    from temporalio.service import RPCError, RPCStatusCode

    real, unanswered = WorkflowHandle.query, {"on": False, "asked": 0}

    async def purchases_unanswered(self, *args, **kwargs):
        if unanswered["on"] and self.id.startswith("capacity/demand-"):
            unanswered["asked"] += 1
            raise RPCError("context deadline exceeded", RPCStatusCode.DEADLINE_EXCEEDED, b"")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(WorkflowHandle, "query", purchases_unanswered)
    # Each purchase holds before its first join: its offer is out of its own ranking for 60 s.
    hold = {**FAST["capacity_request"], "exclude": [{"offer": cap.offer("cheap"), "seconds": 60}]}
    handle = await start_demand(cap, capacity_request=hold, purchase_deadline_seconds=60)
    cap.cluster.create_pod(demand_pod("gone", **{LABEL_SITE: cap.site("cheap")}))
    (kept,) = (await until_status(handle, lambda s: any(p.status == "buying" for p in s.purchases))).purchases
    unanswered["on"] = True
    cap.cluster.delete_pod("ml", "gone")
    state = await until_status(handle, lambda s: s.purchases[0].status != "buying")
    assert state.purchases[0].status == "kept", state.log[-5:]
    assert logged(state, f"{kept.workflow_id}: pods gone; could not ask {kept.workflow_id} which joins it runs")

    cap.cluster.create_pod(demand_pod("late", **{LABEL_SITE: cap.site("cheap")}))  # fits the kept one's machine
    state = await until_status(handle, lambda s: "ml/late" in s.covered or len(s.purchases) > 1)
    assert [p.workflow_id for p in state.purchases] == [kept.workflow_id], "bought beside the kept purchase"
    asked = unanswered["asked"]
    await wait_for(lambda: unanswered["asked"] > asked, timeout=10)  # a later pass asks again
    unanswered["on"] = False
    state = await until_status(handle, lambda s: len(s.purchases) > 1)
    await replay_and_record(handle, KEPT)
    await handle.terminate("test over")
    statuses = {p.workflow_id: p.status for p in state.purchases}
    (late,) = [p for p in state.purchases if p.workflow_id != kept.workflow_id]
    assert statuses == {kept.workflow_id: "cancelled", late.workflow_id: "buying"}, state.log[-5:]
    assert late.pods == ["ml/late"]
    assert sum(line.count(f"{kept.workflow_id}: pods gone;") for line in state.log) == 2, "kept is said once"
    described = await cap.client.get_workflow_handle(kept.workflow_id).describe()
    assert described.status == WorkflowExecutionStatus.CANCELED
    assert not cap.world.query("SELECT * FROM machines"), "nothing was bought"
    await cap.client.get_workflow_handle(late.workflow_id).terminate("test over")


#: A purchase bought for two pods, one of which went while it bought: the loop buys on for the other
#: and its watch sleeps; the other gone too, the purchase is cancelled (no patch: the watch's input
#: differs, not the loop's commands). ``_before``: the code before, whose watches returned at once.
PARTLY_GONE = "demand_purchase_partly_gone"
#: How long the loop is watched once a purchase's pod went (nothing else happens meanwhile).
PARTLY_GONE_SECONDS = 5.0


async def test_a_purchase_one_of_whose_pods_went_buys_on_for_the_other_and_the_loop_sleeps(cap: CapStack):
    """Two pods bought one machine (one purchase, holding before its first join); one pod is deleted.
    The loop says so once and buys on for the other, and its next watch sleeps until something else
    changes: a watch and a ``purchase_status`` for the deletion, then nothing. The other pod gone too,
    the purchase is cancelled before provisioning, as before. Before, the watch compared the pods the
    purchases were bought for with those present, and the deleted one was missing from every look:
    each watch returned "pods gone" at once and the loop, with nothing to do, watched again, for as
    long as the purchase bought (188 watches and 187 ``purchase_status`` in 5 s in the sim, each
    watch listing the cluster's nodes and pods)."""
    hold = {**FAST["capacity_request"], "exclude": [{"offer": cap.offer("cheap"), "seconds": 60}]}
    handle = await start_demand(cap, capacity_request=hold, tick_seconds=3600, purchase_deadline_seconds=120)
    for name in ("pair-a", "pair-b"):
        cap.cluster.create_pod(demand_pod(name, **{LABEL_SITE: cap.site("cheap")}))
    state = await until_status(handle, lambda s: any(p.status == "buying" for p in s.purchases))
    (purchase,) = state.purchases
    assert sorted(purchase.pods) == ["ml/pair-a", "ml/pair-b"], "one machine for both"
    before = len(scheduled_activities(await handle.fetch_history()))
    cap.cluster.delete_pod("ml", "pair-a")
    await asyncio.sleep(PARTLY_GONE_SECONDS)  # nothing else changes meanwhile: the loop has nothing to do
    steps = scheduled_activities(await handle.fetch_history())[before:]
    assert steps.count("watch_demand_events") <= 3 and steps.count("purchase_status") <= 2, (
        f"{steps.count('watch_demand_events')} watches in {PARTLY_GONE_SECONDS:g} s after one pod went")
    state = await status(handle)
    (purchase,) = state.purchases
    assert (purchase.status, purchase.gone) == ("buying", ["ml/pair-a"]), state.log[-5:]
    assert sum(line.count(f"{purchase.workflow_id}: ml/pair-a gone; buying on for the 1 pod still waiting on it")
               for line in state.log) == 1, state.log[-5:]

    cap.cluster.delete_pod("ml", "pair-b")
    state = await until_status(handle, lambda s: s.purchases[0].status != "buying")
    assert state.purchases[0].status == "cancelled", state.log[-5:]
    assert not cap.world.query("SELECT * FROM machines"), "nothing was bought"
    await replay_and_record(handle, PARTLY_GONE)
    await handle.terminate("test over")


def start_slowly(monkeypatch, seconds: float) -> asyncio.Event:
    """Each purchase's start (the loop's call to Temporal) takes ``seconds``; the event is set as the
    first one begins."""
    real, starting = Client.start_workflow, asyncio.Event()

    async def slow(self, *args, id: str, **kwargs):
        if id.startswith("capacity/demand-"):
            starting.set()
            await asyncio.sleep(seconds)
        return await real(self, *args, id=id, **kwargs)

    monkeypatch.setattr(Client, "start_workflow", slow)
    return starting


async def purchase_end(cap: CapStack, workflow_id: str, timeout: float) -> CapacityResult:
    """The purchase's result once it has ended, within ``timeout`` (it may not have started yet)."""
    from temporalio.service import RPCError, RPCStatusCode

    handle = cap.client.get_workflow_handle(workflow_id, result_type=CapacityResult)
    async with asyncio.timeout(timeout):
        while True:
            try:
                return await handle.result()
            except RPCError as error:
                if error.status != RPCStatusCode.NOT_FOUND:
                    raise
            await asyncio.sleep(0.1)


async def cancelled(handle, reason: str = "") -> DemandStatus:
    """Cancel the loop (``temporal workflow cancel``); its status once it has ended cancelled."""
    await handle.cancel(reason=reason)
    with pytest.raises(WorkflowFailureError) as ended:
        await handle.result()
    assert "cancel" in str(ended.value.cause).lower(), ended.value
    return await status(handle)


@pytest.mark.parametrize("when", ["while it buys", "as it starts", "for a long reason"])
async def test_a_cancelled_loop_stops_its_purchase_still_buying(cap: CapStack, monkeypatch, when: str):
    """The loop is cancelled while a purchase of its waits for capacity (or while its start is in
    flight): the purchase is told to stop, ends with nothing bought, and the loop says so. Before,
    the loop ended at the cancel and the purchase bought on until its deadline, for pods that may be
    gone (a start in flight as the cancel landed started it after the loop had ended). A cancel whose
    reason is longer than a stop takes (a person's free text) stops it too: passed on, the purchase
    dropped the stop and bought on, while the loop said it had stopped it."""
    # The purchase holds before its first join: its offer is out of its own ranking for 60 s.
    hold = {**FAST["capacity_request"], "exclude": [{"offer": cap.offer("cheap"), "seconds": 60}]}
    if when == "as it starts":
        starting = start_slowly(monkeypatch, 2)
    handle = await start_demand(cap, capacity_request=hold)
    cap.cluster.create_pod(demand_pod("waiting", **{LABEL_SITE: cap.site("cheap")}))
    if when == "as it starts":  # the step that planned it is starting it: the loop has not heard of it yet
        await wait_for(starting.is_set, timeout=30)
    else:
        await until_status(handle, lambda s: logged(s, "ml/waiting → "))
    state = await cancelled(handle, reason="x" * 5000 if when == "for a long reason" else "")
    (purchase,) = state.purchases

    result = await purchase_end(cap, purchase.workflow_id, timeout=10)  # its deadline (20 s) would end it later
    assert result.cancelled.startswith("the demand loop was cancelled"), result
    assert not result.nodes and not cap.world.query("SELECT * FROM machines"), "nothing was bought"
    assert [p.status for p in state.purchases] == ["stopped"]
    assert logged(state, f"cancelled: stopped purchases {purchase.workflow_id}; no node left cordoned"), state.log[-3:]
    if when != "for a long reason":
        await replay_and_record(handle, "demand_cancelled_stops_its_purchase" if when == "while it buys"
                                else "demand_cancelled_as_its_step_starts_a_purchase")


@pytest.mark.parametrize("when", ["as it fails", "after it failed"])
async def test_a_cancelled_loop_stops_the_purchase_its_failed_step_started(cap: CapStack, monkeypatch, when: str):
    """The step that plans a pod started its purchase, then failed for good; the loop is cancelled
    while that step runs, or in the pause after it failed (before a next step takes the purchase).
    The loop never had the step's answer: it takes the purchase from Temporal (started under its
    next number, carrying what the loop follows it as), and the wind-down stops it. Before, the
    loop ended with "no purchase was buying" and the purchase bought on until its deadline, for a
    loop that was gone."""
    from temporalio.exceptions import ApplicationError

    real, started, cancel_asked = Client.start_workflow, asyncio.Event(), asyncio.Event()

    async def fails_after_the_start(self, *args, id: str, **kwargs):
        handle = await real(self, *args, id=id, **kwargs)
        if id.startswith("capacity/demand-") and not started.is_set():
            started.set()
            if when == "as it fails":
                await asyncio.wait_for(cancel_asked.wait(), timeout=30)
                await asyncio.sleep(0.5)  # the loop has taken its cancel
            raise ApplicationError("the step failed after the start", non_retryable=True)
        return handle

    monkeypatch.setattr(Client, "start_workflow", fails_after_the_start)
    # The wind-down's look for what the failed step started is held while the test reads the details.
    from temporalio import activity
    from activities.demand import DemandActivities

    looking, go_on, look = asyncio.Event(), asyncio.Event(), DemandActivities._started_earlier

    async def held_look(self, *args, **kwargs):
        if activity.info().activity_type == "started_purchases":
            looking.set()
            await asyncio.wait_for(go_on.wait(), 30)
        return await look(self, *args, **kwargs)

    monkeypatch.setattr(DemandActivities, "_started_earlier", held_look)
    # The purchase holds before its first join: its offer is out of its own ranking for 60 s.
    hold = {**FAST["capacity_request"], "exclude": [{"offer": cap.offer("cheap"), "seconds": 60}]}
    handle = await start_demand(cap, capacity_request=hold)
    cap.cluster.create_pod(demand_pod("waiting", **{LABEL_SITE: cap.site("cheap")}))
    await wait_for(started.is_set, timeout=30)
    if when == "after it failed":  # the pass failed; the next one (in a second) would take the purchase
        await poll(lambda: failed_pass(handle), timeout=10, interval=0.05)
    await handle.cancel()
    cancel_asked.set()
    try:
        await asyncio.wait_for(looking.wait(), 30)
        # Retried until done, as a put-back (the wind-down must know what to stop): said so, with no
        # deadline. Before: "cancelled: winding down", nothing else.
        head = (await current_details(handle)).split("\n")[0]
    finally:
        go_on.set()
    assert head == ("**cancelled: winding down**: looking for the purchases a failed step started: retried until "
                    "the cluster answers (no deadline: a put-back that gave up would leave the change in place)"), head
    with pytest.raises(WorkflowFailureError) as ended:
        await handle.result()
    assert "cancel" in str(ended.value.cause).lower(), ended.value
    state = await status(handle)
    assert [p.status for p in state.purchases] == ["stopped"], state.log[-3:]
    (purchase,) = state.purchases
    assert purchase.pods == ["ml/waiting"]
    result = await purchase_end(cap, purchase.workflow_id, timeout=10)  # its deadline (20 s) would end it later
    assert result.cancelled.startswith("the demand loop was cancelled"), result
    assert not result.nodes and not cap.world.query("SELECT * FROM machines"), "nothing was bought"
    assert logged(state, f"cancelled: stopped purchases {purchase.workflow_id}; no node left cordoned"), state.log[-3:]
    if when == "as it fails":
        await replay_and_record(handle, "demand_cancelled_as_its_step_fails_after_a_start")


async def test_consolidation_honours_pdbs_and_the_site_fraction(temporal_env, tmp_path):
    async with demand_stack(temporal_env, tmp_path) as cap:
        cheap, mid = cap.site("cheap"), cap.site("mid")
        await cap.client.execute_workflow("NodeJoin", {"site": cheap, "count": 3, "timeouts": FAST_JOIN},
                                          id=f"join/{cheap}/idle", task_queue=cap.settings.task_queue)
        await cap.client.execute_workflow("NodeJoin", {"site": mid, "timeouts": FAST_JOIN},
                                          id=f"join/{mid}/guarded", task_queue=cap.settings.task_queue)
        (guarded,) = cap.cluster.list_nodes({LABEL_SITE: mid})
        # No GPU pod (so idle), but a pod whose budget refuses its eviction.
        cap.cluster.add_pod(guarded.name, "keeper", labels={"app": "keeper"})
        cap.cluster.set_pdb("default", "keeper", {"app": "keeper"}, min_available=1)
        # A third of a site at once: one of cheap's three nodes at a time.
        handle = await start_demand(cap, max_site_fraction=0.34)
        most, deadline = 0, asyncio.get_running_loop().time() + 60
        while cap.cluster.list_nodes({LABEL_SITE: cheap}):
            retiring = [n for n, why in (await status(handle)).retiring.items() if why.startswith(f"{cheap}:")]
            most = max(most, len(retiring))
            assert asyncio.get_running_loop().time() < deadline, (await status(handle)).log[-10:]
            await asyncio.sleep(0.05)
        assert most == 1, "never more than a third of the site at once"
        state = await until_status(handle, lambda s: any(line.split(" ", 1)[1].startswith(f"kept {guarded.name}")
                                                         for line in s.log))
        # The PDB held: the node is still there (cordoned, tried again later), its pod too.
        assert cap.cluster.get_node(guarded.name) is not None
        assert [p.name for p in cap.cluster.pods(guarded.name)] == ["keeper"]
        assert any("keeper" in line for line in state.log if guarded.name in line)
        # The loop's own cordon is the loop's to try again: once the budget allows, the node goes.
        cap.cluster.delete_pdb("default", "keeper")
        await wait_for(lambda: cap.cluster.get_node(guarded.name) is None, timeout=60)
        await handle.terminate("test over")


async def test_consolidation_leaves_a_node_a_repair_contained(temporal_env, tmp_path):
    """A repair contains a GPU (the node fenced, cordoned, drained): the node is idle, and stays
    idle past the TTL, but it is the repair's; the loop retires the other idle node only. Before,
    it retired the contained node too, and the repair, its node gone, would climb to replace it."""
    from activities.repair import fence_key

    async with demand_stack(temporal_env, tmp_path) as cap:
        cheap = cap.site("cheap")
        await cap.client.execute_workflow("NodeJoin", {"site": cheap, "count": 2, "timeouts": FAST_JOIN},
                                          id=f"join/{cheap}/idle", task_queue=cap.settings.task_queue)
        contained, free = cap.cluster.list_nodes({LABEL_SITE: cheap})
        cap.cluster.annotate_node(contained.name, {fence_key(0): "reset"})  # as contain_gpu does
        cap.cluster.cordon(contained.name)
        handle = await start_demand(cap)
        await wait_for(lambda: cap.cluster.get_node(free.name) is None, timeout=60)
        state = await until_status(handle, lambda s: contained.name in s.kept_idle)
        assert "cordoned" in state.kept_idle[contained.name], state.kept_idle
        await asyncio.sleep(3)  # several passes, each past the 1 s TTL
        assert cap.cluster.get_node(contained.name) is not None, (await status(handle)).log[-5:]
        assert not any(contained.name in line for line in (await status(handle)).log)
        await replay_and_record(handle, "demand_leaves_a_contained_node")
        await handle.terminate("test over")


async def guarded_node(cap: CapStack) -> str:
    """One idle node at ``mid`` whose drain a PodDisruptionBudget blocks (a pod, not a GPU pod)."""
    mid = cap.site("mid")
    await cap.client.execute_workflow("NodeJoin", {"site": mid, "timeouts": FAST_JOIN},
                                      id=f"join/{mid}/guarded", task_queue=cap.settings.task_queue)
    (guarded,) = cap.cluster.list_nodes({LABEL_SITE: mid})
    cap.cluster.add_pod(guarded.name, "keeper", labels={"app": "keeper"})
    cap.cluster.set_pdb("default", "keeper", {"app": "keeper"}, min_available=1)
    return guarded.name


async def draining(cap: CapStack):
    """The loop draining ``guarded_node`` (its drain waits on the PDB, 30 s at most): the node, its
    machine and the loop's handle, once the drain has cordoned it with the loop's mark."""
    node = await guarded_node(cap)
    (machine,) = cap.world.machines(cap.site("mid"))
    handle = await start_demand(cap, drain_seconds=30)
    await wait_for(lambda: cap.cluster.annotate_node(node, {}).get(ANNOTATION_CORDONED_BY) == CORDONED_BY_DEMAND,
                   timeout=30)
    return node, machine, handle


def logged(state: DemandStatus, start: str) -> bool:
    return any(line.split(" ", 1)[1].startswith(start) for line in state.log)


async def test_consolidation_lets_go_a_node_a_repair_took_after_its_drain_blocked(temporal_env, tmp_path):
    """The loop's drain of an idle node blocked (it stays cordoned, the loop's to try again), then a
    repair fenced a GPU of it: the node is the repair's now. The loop lets it go (says why) and does
    not retire it once the drain could pass. Before, it drained and deleted the node under repair,
    and the repair, its node gone, would climb to replace it."""
    from activities.repair import fence_key

    async with demand_stack(temporal_env, tmp_path) as cap:
        node = await guarded_node(cap)
        handle = await start_demand(cap)
        await until_status(handle, lambda s: logged(s, f"kept {node}: drain blocked"))
        assert cap.cluster.annotate_node(node, {})[ANNOTATION_CORDONED_BY] == CORDONED_BY_DEMAND
        cap.cluster.annotate_node(node, {fence_key(1): "reset"})  # as fence_gpu does (already cordoned)
        await until_status(handle, lambda s: logged(s, f"let go {node}"))
        # Kept, with why (once no drain of it is in flight).
        state = await until_status(handle, lambda s: node in s.kept_idle)
        assert "repair" in state.kept_idle[node] and "GPU 1 fenced" in state.kept_idle[node], state.kept_idle
        assert ANNOTATION_CORDONED_BY not in cap.cluster.annotate_node(node, {}), "the cordon is the repair's now"
        await asyncio.sleep(FAST["drain_seconds"] + 1)  # a drain in flight when the fence landed ends blocked
        cap.cluster.delete_pdb("default", "keeper")
        await asyncio.sleep(4)  # several passes past the TTL, a drain would now pass
        assert cap.cluster.get_node(node) is not None, (await status(handle)).log[-5:]
        assert cap.cluster.get_node(node).unschedulable, "the cordon is left to the repair"
        assert [p.name for p in cap.cluster.pods(node)] == ["keeper"]
        await replay_and_record(handle, "demand_lets_go_a_node_a_repair_took")
        await handle.terminate("test over")


async def test_a_retirement_keeps_a_node_a_repair_took_during_its_drain(temporal_env, tmp_path):
    """The loop chose an idle node and drains it; while the drain runs a repair fences a GPU of it,
    then the drain passes. The node is the repair's now: the retirement keeps it (node, machine and
    cordon), says who holds it, and the loop lets it go. Before, the node and its machine were
    deleted under the repair, which would then climb its ladder to replace a node that vanished."""
    from activities.repair import fence_key

    async with demand_stack(temporal_env, tmp_path) as cap:
        node, machine, handle = await draining(cap)
        cap.cluster.annotate_node(node, {fence_key(1): "reset"})  # as fence_gpu does (already cordoned)
        cap.cluster.delete_pdb("default", "keeper")  # the drain passes
        state = await until_status(handle, lambda s: logged(s, f"kept {node}: cordoned by its repair (GPU 1 fenced)"))
        assert not logged(state, f"retired {node}"), state.log[-5:]
        await asyncio.sleep(3)  # several passes past the TTL: the node is held, not the loop's
        assert cap.cluster.get_node(node) is not None, (await status(handle)).log[-5:]
        assert [m["id"] for m in cap.world.machines(cap.site("mid"))] == [machine["id"]], "its machine stays"
        assert cap.cluster.get_node(node).unschedulable, "the cordon is left to the repair"
        assert ANNOTATION_CORDONED_BY not in cap.cluster.annotate_node(node, {}), "the cordon is the repair's now"
        state = await until_status(handle, lambda s: node in s.kept_idle)
        assert "GPU 1 fenced" in state.kept_idle[node], state.kept_idle
        await replay_and_record(handle, "demand_keeps_a_node_a_repair_took_during_its_drain")
        await handle.terminate("test over")


async def test_a_cancelled_loop_uncordons_the_node_it_was_draining(temporal_env, tmp_path):
    """The loop is cancelled while it drains an idle node (a PodDisruptionBudget holds the drain):
    the drain is cancelled and the node uncordoned, its mark gone, nothing deleted; the loop says so.
    Before, the loop ended at the cancel and the node stayed cordoned by the loop, unusable and
    paid for, with no loop left to retire it."""
    async with demand_stack(temporal_env, tmp_path) as cap:
        node, machine, handle = await draining(cap)
        state = await cancelled(handle)
        assert not cap.cluster.get_node(node).unschedulable, state.log[-3:]
        assert ANNOTATION_CORDONED_BY not in cap.cluster.annotate_node(node, {}), "the loop's mark is gone"
        assert [m["id"] for m in cap.world.machines(cap.site("mid"))] == [machine["id"]], "its machine stays"
        assert [p.name for p in cap.cluster.pods(node)] == ["keeper"]
        assert logged(state, f"cancelled: no purchase was buying; uncordoned {node}"), state.log[-3:]
        await replay_and_record(handle, "demand_cancelled_uncordons_its_drain")


async def test_the_waits_for_its_drains_and_its_wind_down_say_until_when(temporal_env, tmp_path, monkeypatch):
    """Asked to continue as new (``renew``) while it drains an idle node, the loop waits for the
    drain first (up to ``drain_seconds``): its page says so and until when. Cancelled then, it winds
    down, and its uncordon is retried until the cluster answers: its page says so, and that it has
    no deadline. Before: the last pass's "watching Pending pods until ..." (a time already past),
    then "cancelled: winding down", nothing saying what it waited on nor until when."""
    import activities.capacity

    uncordoning, go_on = threading.Event(), threading.Event()
    uncordon = activities.capacity.uncordon_unless

    def held_uncordon(cluster, nodes, *args, **kwargs):
        uncordoning.set()
        go_on.wait(30)
        return uncordon(cluster, nodes, *args, **kwargs)

    monkeypatch.setattr(activities.capacity, "uncordon_unless", held_uncordon)
    async with demand_stack(temporal_env, tmp_path) as cap:
        node, _machine, handle = await draining(cap)
        began, drain = await watch_scheduled(handle, "drain_within", last=True)
        await handle.signal("renew")

        async def head_line() -> str:
            return (await current_details(handle)).split("\n")[0]
        head = await wait_for_async(head_line, lambda h: h.startswith("**continuing as new**"), timeout=30)
        assert head == (f"**continuing as new**: no new pass until its retirements in flight end: `{node}` drained "
                        f"(PodDisruptionBudgets honoured) {until(began, drain['deadline_seconds'])} at most, then "
                        "its machine deleted"), head

        await handle.cancel()
        try:
            assert await asyncio.to_thread(uncordoning.wait, 30), "the uncordon began"
            head = (await current_details(handle)).split("\n")[0]
        finally:
            go_on.set()
        assert head == (f"**cancelled: winding down**: uncordoning {node}: retried until the cluster answers (no "
                        "deadline: a put-back that gave up would leave the change in place)"), head
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        assert not cap.cluster.get_node(node).unschedulable, "uncordoned"


async def test_a_retirement_keeps_a_node_a_person_took_right_before_its_drain(temporal_env, tmp_path, monkeypatch):
    """The loop chose an idle node (a pod on it, no GPU pod); a person cordons it and marks it theirs
    right before the drain's cordon. That cordon, made on the marks the drain read, is refused; read
    again, the node is the person's: nothing cordoned over or evicted, the retirement keeps it and
    the loop lets it go. Before, the drain's cordon overwrote the person's mark with the loop's, so
    their pod was evicted and their node and machine deleted."""
    async with demand_stack(temporal_env, tmp_path) as cap:
        node = await guarded_node(cap)
        cap.cluster.delete_pdb("default", "keeper")  # nothing but the person's mark keeps the node
        (machine,) = cap.world.machines(cap.site("mid"))
        raced = write_before_next_cordon(monkeypatch, cap.cluster, node, lambda: cap.cluster.cordon(node, by="alice"))
        handle = await start_demand(cap)
        state = await until_status(handle, lambda s: logged(s, f"kept {node}: cordoned by 'alice'"))
        assert raced and not logged(state, f"retired {node}"), state.log[-5:]
        await asyncio.sleep(3)  # several passes past the TTL: the node is the person's, not the loop's
        assert [m["id"] for m in cap.world.machines(cap.site("mid"))] == [machine["id"]], "its machine stays"
        assert cap.cluster.get_node(node).unschedulable
        assert cap.cluster.annotate_node(node, {})[ANNOTATION_CORDONED_BY] == "alice", "the mark is the person's"
        assert [p.name for p in cap.cluster.pods(node)] == ["keeper"], "nothing evicted"
        state = await until_status(handle, lambda s: node in s.kept_idle)
        assert "'alice'" in state.kept_idle[node], state.kept_idle
        await replay_and_record(handle, "demand_keeps_a_node_a_person_took_before_its_drain")
        await handle.terminate("test over")


async def test_a_retirement_keeps_a_node_a_person_marked_theirs_and_a_repairs_own_retire_goes_on(
        temporal_env, tmp_path):
    """The retire activity itself: given the loop's mark, a node a person marked theirs since is
    kept (who holds it said, nothing deleted); without a mark (a repair retiring its own node, a
    reclaim) it retires whoever holds it, as always."""
    from temporalio.testing import ActivityEnvironment

    from activities.capacity import CapacityActivities
    from fleet.messages.capacity import RetireMachineInput

    async with demand_stack(temporal_env, tmp_path) as cap:
        node = await guarded_node(cap)
        (machine,) = cap.world.machines(cap.site("mid"))
        cap.cluster.cordon(node, by="alice")
        retire = CapacityActivities(cap.env).retire_machine
        mine = RetireMachineInput(site=cap.site("mid"), node_name=node, machine_id=machine["id"],
                                  cordoned_by=CORDONED_BY_DEMAND)
        assert await ActivityEnvironment().run(retire, mine) == f"cordoned by 'alice' ({ANNOTATION_CORDONED_BY})"
        assert cap.cluster.get_node(node) is not None and cap.world.machines(cap.site("mid")), "nothing deleted"
        assert await ActivityEnvironment().run(retire, mine.model_copy(update={"cordoned_by": None})) is None
        assert cap.cluster.get_node(node) is None and not cap.world.machines(cap.site("mid"))


async def test_a_retirement_keeps_a_node_a_person_uncordoned_after_its_drain(temporal_env, tmp_path):
    """The drain cordoned the node with the loop's mark and ended; before the retire a person
    uncordons it (which drops the mark): they put it back to work. The retire keeps it, saying so,
    and deletes nothing. Before, the node and its machine were deleted: nothing held it any more."""
    from temporalio.testing import ActivityEnvironment

    from activities.capacity import CapacityActivities
    from fleet.messages.capacity import RetireMachineInput

    async with demand_stack(temporal_env, tmp_path) as cap:
        node = await guarded_node(cap)
        (machine,) = cap.world.machines(cap.site("mid"))
        cap.cluster.cordon(node, by=CORDONED_BY_DEMAND)  # as the loop's drain leaves it
        cap.cluster.cordon(node, False)  # `kubectl uncordon`
        retire = CapacityActivities(cap.env).retire_machine
        mine = RetireMachineInput(site=cap.site("mid"), node_name=node, machine_id=machine["id"],
                                  cordoned_by=CORDONED_BY_DEMAND)
        assert "uncordoned" in await ActivityEnvironment().run(retire, mine)
        assert cap.cluster.get_node(node) is not None and cap.world.machines(cap.site("mid")), "nothing deleted"
        cap.cluster.cordon(node, by=CORDONED_BY_DEMAND)  # drained again: the loop's, it goes
        assert await ActivityEnvironment().run(retire, mine) is None
        assert cap.cluster.get_node(node) is None and not cap.world.machines(cap.site("mid"))


def _repair_fences(cluster, node: str) -> None:  # as fence_gpu does
    cluster.annotate_node(node, {"gpufleet.io/fenced-gpu-0": "reset"})
    cluster.cordon(node, True)


#: What lands on a node the loop drained, right after the retire read it, and what the retire says.
TAKEN_AFTER_THE_LOOK = {
    "a repair fences a GPU": (_repair_fences, "cordoned by its repair (GPU 0 fenced)"),
    "a person uncordons it": (lambda cluster, node: cluster.cordon(node, False), "uncordoned since its drain"),
    "a person marks it theirs": (lambda cluster, node: cluster.cordon(node, by="alice"),
                                 f"cordoned by 'alice' ({ANNOTATION_CORDONED_BY})"),
}


@pytest.mark.parametrize("taken", TAKEN_AFTER_THE_LOOK)
async def test_a_retirement_keeps_a_node_taken_between_its_look_and_its_delete(
        temporal_env, tmp_path, monkeypatch, taken):
    """The retire reads the node as the loop's drain left it (its cordon and mark, no one else's)
    and decides to delete it; right then a repair fences a GPU of it, or a person uncordons it or
    marks it theirs. The decision, written on the node as read before anything is deleted, is
    refused; read again, the node is theirs: the retire says so and deletes nothing. Before, the
    machine and the node were deleted on the look alone."""
    from temporalio.testing import ActivityEnvironment

    from activities.capacity import CapacityActivities
    from fleet.messages.capacity import RetireMachineInput

    write, said = TAKEN_AFTER_THE_LOOK[taken]
    async with demand_stack(temporal_env, tmp_path) as cap:
        node = await guarded_node(cap)
        (machine,) = cap.world.machines(cap.site("mid"))
        cap.cluster.cordon(node, by=CORDONED_BY_DEMAND)  # as the loop's drain leaves it
        raced = write_after_next_read(monkeypatch, cap.cluster, node, lambda: write(cap.cluster, node))
        retire = CapacityActivities(cap.env).retire_machine
        mine = RetireMachineInput(site=cap.site("mid"), node_name=node, machine_id=machine["id"],
                                  cordoned_by=CORDONED_BY_DEMAND)
        held = await ActivityEnvironment().run(retire, mine)
        assert raced and held and held.startswith(said), held
        assert cap.cluster.get_node(node) is not None, "the node stays"
        assert [m["id"] for m in cap.world.machines(cap.site("mid"))] == [machine["id"]], "its machine stays"


def node_removal_unavailable(node: str) -> Exception:
    """What the Kubernetes adapter raises when the API answers a Node's removal with a 503."""
    from fleet.errors import Transient

    return Transient(f"DELETE /api/v1/nodes/{node}: 503 Service Unavailable", provider="kubernetes", code="503")


@pytest.mark.parametrize("taken", TAKEN_AFTER_THE_LOOK)
async def test_a_retry_removes_the_node_whose_machine_its_first_attempt_deleted_whoever_took_it_since(
        temporal_env, tmp_path, monkeypatch, taken):
    """The retire's first attempt deletes the machine, then the cluster refuses to remove the Node
    (a 503); before the retry a repair fences a GPU of the node, or a person uncordons it or marks
    it theirs. Its machine is gone: the retry removes the Node, a ghost whoever holds it. Before,
    the retry found the node held and kept it: a Node with no machine, which pods could be
    scheduled to and the site counted as working."""
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from activities.capacity import CapacityActivities
    from fleet.messages.capacity import RetireMachineInput

    write, _ = TAKEN_AFTER_THE_LOOK[taken]
    async with demand_stack(temporal_env, tmp_path) as cap:
        node = await guarded_node(cap)
        (machine,) = cap.world.machines(cap.site("mid"))
        cap.cluster.cordon(node, by=CORDONED_BY_DEMAND)  # as the loop's drain leaves it
        refused = refuse(monkeypatch, "remove_node", node_removal_unavailable(node))
        retire = CapacityActivities(cap.env).retire_machine
        mine = RetireMachineInput(site=cap.site("mid"), node_name=node, machine_id=machine["id"],
                                  cordoned_by=CORDONED_BY_DEMAND)
        with pytest.raises(ApplicationError, match="503"):
            await ActivityEnvironment().run(retire, mine)
        assert not cap.world.machines(cap.site("mid")) and cap.cluster.get_node(node) is not None, "the machine went"
        refused["on"] = False
        write(cap.cluster, node)
        assert await ActivityEnvironment().run(retire, mine) is None, "retired"
        assert cap.cluster.get_node(node) is None, "no Node without its machine"


async def test_the_loop_retires_a_node_put_back_to_work_between_its_machines_delete_and_its_removal(
        temporal_env, tmp_path, monkeypatch):
    """The loop drains and retires an idle node: the retire deletes its machine, then the cluster
    refuses to remove the Node (a 503), and a person uncordons it before the activity's retry. The
    retry removes the Node (its machine is gone) and the loop says it retired it. Before, the retry
    kept the node as put back to work: a Node with no machine, schedulable."""
    from sim.cluster import SimCluster

    async with demand_stack(temporal_env, tmp_path) as cap:
        node, machine, handle = await draining(cap)
        real, refused = SimCluster.remove_node, []

        def remove_node(self, name: str) -> None:
            if name == node and not refused:
                refused.append(name)
                self.cordon(name, False)  # `kubectl uncordon`, before the retry
                raise node_removal_unavailable(name)
            real(self, name)

        monkeypatch.setattr(SimCluster, "remove_node", remove_node)
        cap.cluster.delete_pdb("default", "keeper")  # the drain passes
        state = await until_status(handle, lambda s: logged(s, f"retired {node}") or logged(s, f"kept {node}"))
        assert refused and logged(state, f"retired {node}"), state.log[-5:]
        assert cap.cluster.get_node(node) is None and not cap.world.machines(cap.site("mid"))
        await handle.terminate("test over")


async def test_a_retry_removes_the_node_whose_machines_delete_its_first_attempt_queued_for_a_revoked_account(
        temporal_env, tmp_path, monkeypatch):
    """The site's account is revoked: the retire's first attempt queues its machine's delete (no
    call to the account), then the cluster refuses to remove the Node; a person uncordons it before
    the retry. The machine's delete is decided: the retry removes the Node, still asks the account
    nothing, and the delete stays queued for when the credentials are rotated."""
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from activities.capacity import CapacityActivities
    from fleet.messages.capacity import RetireMachineInput

    async with demand_stack(temporal_env, tmp_path) as cap:
        node = await guarded_node(cap)
        (machine,) = cap.world.machines(cap.site("mid"))
        site = cap.env.site(cap.site("mid"))
        cap.env.accounts.mark_revoked(site.account, site.provider, "revoked in a test")
        cap.cluster.cordon(node, by=CORDONED_BY_DEMAND)  # as the loop's drain leaves it
        refused = refuse(monkeypatch, "remove_node", node_removal_unavailable(node))
        retire = CapacityActivities(cap.env).retire_machine
        mine = RetireMachineInput(site=site.name, node_name=node, machine_id=machine["id"],
                                  cordoned_by=CORDONED_BY_DEMAND)
        with pytest.raises(ApplicationError, match="503"):
            await ActivityEnvironment().run(retire, mine)
        refused["on"] = False
        cap.cluster.cordon(node, False)  # `kubectl uncordon`
        assert await ActivityEnvironment().run(retire, mine) is None, "retired"
        assert cap.cluster.get_node(node) is None, "no Node without its machine"
        assert [p.machine_id for p in cap.env.accounts.pending_deletes(site.account)] == [machine["id"]]
        assert [m["id"] for m in cap.world.machines(site.name)] == [machine["id"]], "no call to the revoked account"


async def test_a_retirement_removes_a_node_a_person_uncordoned_once_its_machine_is_gone(temporal_env, tmp_path):
    """The loop's drain cordoned the node; a person uncordons it, and its machine is gone already
    (the provider finished a reclaim). Uncordoned or not, the Node has no machine: the retire
    removes it. Before, it was kept as put back to work, a Node with no machine."""
    from temporalio.testing import ActivityEnvironment

    from activities.capacity import CapacityActivities
    from fleet.messages.capacity import RetireMachineInput

    async with demand_stack(temporal_env, tmp_path) as cap:
        node = await guarded_node(cap)
        (machine,) = cap.world.machines(cap.site("mid"))
        cap.cluster.cordon(node, by=CORDONED_BY_DEMAND)  # as the loop's drain leaves it
        cap.cluster.cordon(node, False)  # `kubectl uncordon`
        cap.env.provider(cap.site("mid")).delete_machine(machine["id"])  # reclaimed
        retire = CapacityActivities(cap.env).retire_machine
        mine = RetireMachineInput(site=cap.site("mid"), node_name=node, machine_id=machine["id"],
                                  cordoned_by=CORDONED_BY_DEMAND)
        assert await ActivityEnvironment().run(retire, mine) is None
        assert cap.cluster.get_node(node) is None


async def test_a_retirement_keeps_a_node_a_person_marked_theirs_while_the_provider_does_not_answer(
        temporal_env, tmp_path, monkeypatch, caplog):
    """A node the loop drained is a person's now, and the provider's API is down (a 503) as the
    retire asks whether its machine is gone: not known gone, the node is kept as held, at once,
    nothing deleted, and the fault logged; the next retirement pass asks again. Before, the retire
    failed with the provider's error and was retried for minutes (its policy's attempts), a node
    found held no longer answered by the cluster alone."""
    from temporalio.testing import ActivityEnvironment

    from activities.capacity import CapacityActivities
    from fleet.errors import Transient
    from fleet.messages.capacity import RetireMachineInput
    from sim.provider import SimProvider

    async with demand_stack(temporal_env, tmp_path) as cap:
        node = await guarded_node(cap)
        (machine,) = cap.world.machines(cap.site("mid"))
        cap.cluster.cordon(node, by="alice")

        def unavailable(self, machine_id: str):
            raise Transient(f"GET /instances/{machine_id}: 503 Service Unavailable", provider="sim", code="503")

        monkeypatch.setattr(SimProvider, "get_machine", unavailable)
        retire = CapacityActivities(cap.env).retire_machine
        mine = RetireMachineInput(site=cap.site("mid"), node_name=node, machine_id=machine["id"],
                                  cordoned_by=CORDONED_BY_DEMAND)
        assert await ActivityEnvironment().run(retire, mine) == f"cordoned by 'alice' ({ANNOTATION_CORDONED_BY})"
        assert cap.cluster.get_node(node) is not None, "the node stays"
        assert [m["id"] for m in cap.world.machines(cap.site("mid"))] == [machine["id"]], "its machine stays"
        assert "503 Service Unavailable" in caplog.text, "the provider's fault is logged"


async def test_a_drain_for_the_loop_keeps_a_persons_mark_written_as_it_drops_its_own_from_a_fenced_node(
        temporal_env, tmp_path, monkeypatch):
    """The loop cordoned a node, then a repair fenced a GPU of it: the repair's now, so the loop's
    next look drops the loop's mark. Right after that look read the node, a person marks it theirs.
    The drop, made on the node as read, is refused; read again, the mark is the person's, and it
    stays. Before, the drop was a plain merge that deleted whatever mark the node had by then:
    the person's, whose node then read as no one's once the repair was done."""
    from temporalio.testing import ActivityEnvironment

    from activities.capacity import CapacityActivities
    from activities.repair import fence_key
    from fleet.messages.capacity import DrainNodeInput

    async with demand_stack(temporal_env, tmp_path) as cap:
        node = await guarded_node(cap)
        cap.cluster.cordon(node, by=CORDONED_BY_DEMAND)
        cap.cluster.annotate_node(node, {fence_key(0): "reset"})
        raced = write_after_next_read(monkeypatch, cap.cluster, node, lambda: cap.cluster.cordon(node, by="alice"))
        drain = CapacityActivities(cap.env).drain_within
        drained = ActivityEnvironment().run(drain, DrainNodeInput(node_name=node, deadline_seconds=1,
                                                                  cordoned_by=CORDONED_BY_DEMAND))
        assert raced and drained.held == "cordoned by its repair (GPU 0 fenced)", drained
        assert cap.cluster.annotate_node(node, {})[ANNOTATION_CORDONED_BY] == "alice", "the person's mark stays"


async def test_a_new_run_retires_a_node_an_earlier_run_left_cordoned(temporal_env, tmp_path):
    """A run's drain blocked and it ended (its carried state gone: terminated, or from before the
    loop carried such nodes): the node stays cordoned, idle. The next run knows it as its own from
    the cluster's mark and retires it once the drain passes. Before, nothing ever did: a node paid
    for and unusable."""
    async with demand_stack(temporal_env, tmp_path) as cap:
        node = await guarded_node(cap)
        first = await start_demand(cap)
        await until_status(first, lambda s: logged(s, f"kept {node}: drain blocked"))
        await first.terminate("its state is lost")
        assert cap.cluster.get_node(node).unschedulable
        cap.cluster.delete_pdb("default", "keeper")
        handle = await start_demand(cap)
        await wait_for(lambda: cap.cluster.get_node(node) is None, timeout=60)
        state = await status(handle)
        assert logged(state, f"{node}: cordoned by an earlier drain of the loop's"), state.log[-5:]
        assert logged(state, f"retired {node}"), state.log[-5:]
        await replay_and_record(handle, "demand_retires_a_node_it_left_cordoned")
        await handle.terminate("test over")


async def test_after_a_spot_reclaim_its_replacement_is_not_bought_twice_and_the_spot_share_holds(temporal_env, tmp_path):
    models = {"llm": {"mode": "active-active", "sites": ["spot", "cheap"], "spot_share": 0.5,
                      "on_demand_floor_gpus": 2}}
    # Spot at no risk is the cheapest offer: only the share keeps the model off it.
    calm = {"sim": {"capacity": 4, "quota": 8, "boot_seconds": 0.1, "interruption_risk": 0.0}}
    async with demand_stack(temporal_env, tmp_path, models=models, spot=calm) as cap:
        handle = await start_demand(cap, idle_ttl_seconds=60)
        names = [f"r{i}" for i in range(4)]
        for name in names:
            cap.cluster.create_pod(demand_pod(name, model="llm"))
        await wait_for(lambda: len(bound(cap)) == 4, timeout=60)

        def gpus_by_type() -> dict[str, int]:
            held: dict[str, int] = {}
            for node in bound(cap).values():
                kind = cap.cluster.get_node(node).labels[LABEL_CAPACITY_TYPE]
                held[kind] = held.get(kind, 0) + 1
            return held

        assert gpus_by_type() == {"spot": 2, "on-demand": 2}
        bought = len((await status(handle)).purchases)

        # The provider takes the spot machine; its replacement (elsewhere) boots slowly.
        cap.world.set_site(cap.site("cheap"), boot_seconds=4)
        (machine,) = cap.world.machines(cap.site("spot"))
        evicted = [k.split("/")[1] for k, node in bound(cap).items() if node == machine["name"]]
        cap.world.post_reclaim_notice(machine["id"], seconds=20)
        await wait_for(lambda: not any(node == machine["name"] for node in bound(cap).values()), timeout=20)
        for name in evicted:  # their ReplicaSet puts them back, Pending
            cap.cluster.create_pod(demand_pod(name, model="llm"))
        state = await until_status(handle, lambda s: all(f"ml/{n}" in s.covered for n in evicted))
        assert all(state.covered[f"ml/{n}"].startswith(f"joining capacity/reclaim-{machine['name']}")
                   for n in evicted), state.covered
        await wait_for(lambda: len(bound(cap)) == 4, timeout=60)
        state = await status(handle)
        assert len(state.purchases) == bought, "the reclaim's replacement was the only machine bought"
        held = gpus_by_type()
        assert held.get("spot", 0) <= 0.5 * 4 and held.get("on-demand", 0) >= 2, held
        reclaim = cap.client.get_workflow_handle(f"reclaim/{machine['name']}")
        await reclaim.result()
        await handle.terminate("test over")


async def test_pods_wait_for_a_reclaim_replacement_that_is_still_reading_the_catalog(temporal_env, tmp_path):
    """A SpotReclaim's replacement starts as the drain does; the pods the drain evicts may come back
    Pending before it has read the catalog. Until it has chosen, the reclaimed machine stands in for
    it: the pods wait for it, and nothing is bought beside it. Before, the loop counted it only once
    it had candidates, and bought a second machine for the same pods whenever its plan came first
    (the reclaim test failed so 1 run in 5 on a busy machine)."""
    models = {"llm": {"mode": "active-active", "sites": ["spot", "cheap"], "spot_share": 0.5}}
    calm = {"sim": {"capacity": 4, "quota": 8, "boot_seconds": 0.1, "interruption_risk": 0.0}}
    async with demand_stack(temporal_env, tmp_path, models=models, spot=calm) as cap:
        handle = await start_demand(cap)
        await cap.refresh_catalog()  # the loop plans on the stored catalog
        # The replacement reads every provider afresh, and one of them answers slowly.
        cap.world.set_site(cap.site("dear"), api_latency_ms=16000)
        try:
            reclaimed = node_name_for(cap.site("spot"), "a-join")
            replacement = await cap.client.start_workflow(
                flows.AcquireCapacity.TYPE, {"count": 1, "constraints": {"gpu": "H100"}, "catalog_max_age_seconds": 0,
                                             "reason": f"replace {reclaimed}",
                                             "exclude": [{"offer": f"{cap.site('spot')}/spot.2xh100", "seconds": 600}]},
                id=capacity_workflow_id(f"reclaim-{reclaimed}"), task_queue=cap.settings.task_queue)
            await wait_for_async(lambda: replacement_progress(replacement), lambda p: p.step == "reading the catalog", 20)
            for name in ("r0", "r1"):
                cap.cluster.create_pod(demand_pod(name, model="llm"))
            state = await until_status(handle, lambda s: all(f"ml/r{i}" in s.covered for i in range(2)))
            assert all(state.covered[f"ml/r{i}"] == f"joining {replacement.id}" for i in range(2)), state.covered
            assert not state.purchases, [p.workflow_id for p in state.purchases]
            assert (await replacement_progress(replacement)).step == "reading the catalog", \
                "the test's window closed before the loop planned"
        finally:  # a slow provider would hold the stack's clean-up too
            cap.world.set_site(cap.site("dear"), api_latency_ms=0)
        # Once it has read the catalog it buys, and the pods run on its machine: still nothing bought.
        await wait_for(lambda: len(bound(cap)) == 2, timeout=60)
        assert not (await status(handle)).purchases
        await replacement.result()
        await handle.terminate("test over")


async def replacement_progress(handle) -> CapacityProgress:
    return await handle.query(flows.AcquireCapacity.progress, result_type=CapacityProgress)


async def test_on_events_pods_buy_and_idle_nodes_go_back_with_no_tick(cap: CapStack):
    """Issue 37: the loop wakes on events (new pods, purchases ending, nodes going idle, an idle
    node's TTL), not on a tick: with an hour between its safety looks it still buys for the pods
    and gives the idle nodes back, and while nothing happens it schedules nothing."""
    from temporalio.api.enums.v1 import EventType

    handle = await start_demand(cap, tick_seconds=3600)
    pods = [demand_pod(f"eu-{i}", **{LABEL_GEOGRAPHY: "eu", LABEL_CAPACITY_TYPE: "on-demand"}) for i in range(2)]
    for pod in pods:
        cap.cluster.create_pod(pod)
    placed = await wait_for(lambda: len(bound(cap)) == 2 and bound(cap), timeout=60)
    assert len(cap.cluster.list_nodes()) == 1

    async def scheduled() -> int:
        history = await handle.fetch_history()
        return sum(e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED for e in history.events)

    await asyncio.sleep(2)  # the purchase's end is taken; then nothing happens
    before = await scheduled()
    await asyncio.sleep(5)
    assert await scheduled() == before, "the loop worked on a tick while nothing happened"
    # Its page says until when it watches with nothing new (before: "watching Pending pods", no time).
    began, watching = await watch_scheduled(handle, "watch_demand_events", last=True)
    shown = await current_details(handle)
    assert shown.startswith(f"**watching Pending pods {until(began, watching['wait_seconds'])} with nothing new**"), shown
    for key in placed:
        cap.cluster.delete_pod(*key.split("/"))
    await wait_for(lambda: not cap.cluster.list_nodes(), timeout=60)
    # The node goes in the retire step's activity; the loop logs it once that step has returned.
    await until_status(handle, lambda s: any(line.split(" ", 1)[1].startswith("retired") for line in s.log))
    await replay_and_record(handle, "demand_events_buy_then_retire")


async def test_an_idle_node_whose_own_static_pod_asks_for_a_gpu_is_retired_after_its_ttl(cap: CapStack):
    """A node is hostile: its kubelet may publish a static pod's mirror, bound to itself, asking
    for a GPU. That pod is the node's word, not a workload: the node, idle once the pods the fleet
    placed on it went, is retired after its TTL. Before, the mirror pod made it busy for ever: never
    consolidated, and billed on."""
    await start_demand(cap)
    cap.cluster.create_pod(demand_pod("eu-0", **{LABEL_GEOGRAPHY: "eu", LABEL_CAPACITY_TYPE: "on-demand"}))
    placed = await wait_for(lambda: bound(cap).get("ml/eu-0"), timeout=60)
    # The static pod comes before the workload goes: the node is never without a GPU pod.
    cap.cluster.create_pod(GpuPod(namespace="kube-system", name=f"keep-me-{placed}", node=placed, phase="Running",
                                  gpus=1, mirror=True, owner_kinds=["Node"]))
    cap.cluster.delete_pod("ml", "eu-0")
    await wait_for(lambda: placed not in {n.name for n in cap.cluster.list_nodes()}, timeout=45)


async def test_renew_cuts_the_event_watch_and_the_loop_moves_on_with_its_purchases(cap: CapStack):
    """``gpufleet patches renew`` after a deploy (``FleetClient.renew_entities``): the loop waits in its
    event watch up to ``tick_seconds`` (an hour here) with nothing new; asked to renew, the watch is
    cut and the run continues as new at once, its purchases and series carried."""
    from datetime import datetime, timezone

    from client import FleetClient, Renewed

    handle = await start_demand(cap, tick_seconds=3600)
    cap.cluster.create_pod(demand_pod("eu-0", **{LABEL_GEOGRAPHY: "eu", LABEL_CAPACITY_TYPE: "on-demand"}))
    await wait_for(lambda: len(bound(cap)) == 1, timeout=60)
    bought = await until_status(handle, lambda s: bool(s.purchases))

    async def watching() -> bool:
        pending = (await handle.describe()).raw_description.pending_activities
        return [a.activity_type.name for a in pending] == ["watch_demand_events"]
    await poll(watching, timeout=30)
    run = (await handle.describe()).run_id
    deployed = datetime.now(timezone.utc)
    await asyncio.sleep(0.3)  # the next run starts after the deploy
    renewed = await FleetClient(cap.settings, cap.client).renew_entities(deployed, ["Demand"])
    assert renewed == [Renewed("Demand", asked=1)]

    async def moved_on() -> bool:
        return (await cap.client.get_workflow_handle(handle.id).describe()).run_id != run
    await poll(moved_on, timeout=20)  # not the hour its watch had left
    old = cap.client.get_workflow_handle(handle.id, run_id=run)
    assert (await old.describe()).status == WorkflowExecutionStatus.CONTINUED_AS_NEW
    now = await status(cap.client.get_workflow_handle(handle.id))
    assert [(p.workflow_id, p.pods) for p in now.purchases] == [(p.workflow_id, p.pods) for p in bought.purchases]
    assert all(p.workflow_id.startswith("capacity/demand-") for p in now.purchases)
    await replay_and_record(old, "demand_renewed_in_its_watch")


async def test_the_loop_outlives_a_cluster_that_refuses_and_buys_again_once_it_answers(cap: CapStack, monkeypatch):
    """The Kubernetes API refuses the loop's pod watch (``ClusterForbidden``, a 403: what the real
    adapter raises when the control plane's token is refused, e.g. during a control-plane upgrade;
    non-retryable, so each pass fails at once). The loop stays up, says what failed and when it
    looks again, and once the cluster answers buys for a new Pending pod, numbering on from the
    purchases it carried. Before, the first refusal failed the workflow: Pending pods bought nothing
    and idle nodes billed on until a person started the loop again, with its purchases forgotten."""
    from fleet.errors import ClusterForbidden

    handle = await start_demand(cap)
    cap.cluster.create_pod(demand_pod("before", 2, **{LABEL_SITE: cap.site("cheap")}))
    await wait_for(lambda: "ml/before" in bound(cap), timeout=60)
    (bought,) = (await status(handle)).purchases

    refused = refuse(monkeypatch, "watch_gpu_pods", ClusterForbidden("GET /api/v1/pods?watch=1: 403 Forbidden",
                                                                     code="403"))
    shown = await poll(lambda: failed_pass(handle), timeout=30)
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING, shown
    assert re.search(r"could not watch the Pending pods \(ClusterForbidden: GET /api/v1/pods\?watch=1: "
                     r"403 Forbidden\); next try at \d\d:\d\d:\d\d UTC", shown), shown
    assert logged(await status(handle), "could not watch the Pending pods")

    refused["on"] = False
    cap.cluster.create_pod(demand_pod("after", 2, **{LABEL_SITE: cap.site("cheap")}))
    await wait_for(lambda: "ml/after" in bound(cap), timeout=60)
    state = await status(handle)
    # Numbered on from the carried one. The pod binds as its node registers, so the new purchase
    # may still be buying, and the list shows purchases buying first: compare in number order.
    assert sorted(p.workflow_id for p in state.purchases) == [bought.workflow_id, bought.workflow_id[:-1] + "2"]
    assert logged(state, "a pass went through again"), state.log[-5:]
    await replay_and_record(handle, "demand_outlives_a_refused_watch")
    await handle.terminate("test over")


@pytest.mark.timeout(60)  # minutes of retries and pauses; without the skipping this would not end
async def test_the_loop_outlives_a_cluster_api_away_for_longer_than_its_retries(time_skipping_env, tmp_path,
                                                                               monkeypatch):
    """The Kubernetes API answers 503 (``Transient``, as the real adapter raises it) for seven
    minutes, a control-plane upgrade: longer than the watch's retries (10 attempts, about 2.5
    minutes). The loop stays up, says what failed and when it looks again, and tries again after a
    pause that grows. Before, the watch's last attempt failed the workflow. (The time-skipping
    server: minutes of retries and pauses in no time. That the loop buys again once the API answers
    is the dev-server test's above.)"""
    from fleet.errors import Transient
    from tests.conftest import TEST_FLEET
    from tests.test_time_skipping import control_plane, timeline

    refuse(monkeypatch, "watch_gpu_pods",
           Transient("GET /api/v1/pods?watch=1: 503 Service Unavailable", provider="kubernetes", code="503"))
    async with control_plane(time_skipping_env, tmp_path, TEST_FLEET) as (settings, _):
        handle = await time_skipping_env.client.start_workflow(
            "Demand", FAST, id=f"demand-{uuid.uuid4().hex[:6]}", task_queue=settings.task_queue)
        await time_skipping_env.sleep(7 * 60)
        shown = await failed_pass(handle)
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING, shown
        assert re.search(r"could not watch the Pending pods \(Transient: GET /api/v1/pods\?watch=1: 503 Service "
                         r"Unavailable\); next try at \d\d:\d\d:\d\d UTC", shown), shown
        # Two passes failed, each after all its attempts; the pause after each grows.
        timers, _, _ = await timeline(handle)
        assert timers == [1, 2], timers
        state = await status(handle)
        assert sum("could not watch the Pending pods" in line for line in state.log) == 1, "one line a streak"
        await handle.terminate("test over")
