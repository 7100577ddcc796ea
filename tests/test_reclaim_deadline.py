"""SpotReclaim acts against the newest notice's termination time, and a cancel of it puts back what
it changed.

The provider may post a newer notice for a machine already being reclaimed (the Node entity signals
it as ``notice``). Before, the run kept the time it read at its start: an earlier one left it
draining and waiting past a machine already gone, a later one cut the drain short of the time the
provider still gave. Each wait also names in the current details what it waits for and until when.
A person who believes a notice false cancels the reclaim (``temporal workflow cancel``): before, the
node stayed cordoned for good and unmarked, read as a person's cordon, ``FleetState`` ``reclaiming``.

Against the real dev server, the control-plane worker and the simulated providers. The run is
started and told as the Node entity does (``tests/test_site_reclaim.py`` covers the way there)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from datetime import datetime, timezone

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import CancelledError

from fleet.cluster import ANNOTATION_CORDONED_BY, CORDONED_BY_RECLAIM
from fleet.messages.capacity import SpotReclaimResult
from tests.capacity_fleet import FAST_JOIN, CapStack
from tests.conftest import wait_for
from tests.replay import replay_and_record
from tests.test_site_reclaim import cap, live  # noqa: F401 - cap: the fixture


async def details(handle: WorkflowHandle) -> str:
    """The workflow's current details (the UI's "User Metadata" tab)."""
    metadata = await handle.query("__temporal_workflow_metadata")
    return metadata.current_details if hasattr(metadata, "current_details") else metadata["currentDetails"]


async def until_details(handle: WorkflowHandle, predicate, timeout: float = 30) -> str:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            shown = await details(handle)
        except Exception:  # noqa: BLE001 - the first workflow task may not have run yet
            shown = ""
        if predicate(shown):
            return shown
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"details never matched; last: {shown!r}")
        await asyncio.sleep(0.1)


def utc(epoch: float) -> str:
    return f"{datetime.fromtimestamp(epoch, timezone.utc):%H:%M:%S} UTC"


async def a_spot_node_whose_pods_cannot_leave(cap: CapStack, name: str) -> tuple[str, str]:
    """A spot node running two replicas a PodDisruptionBudget keeps both of: its drain is blocked
    until its deadline. Returns (node, machine id)."""
    spot = cap.site("spot")
    await cap.client.execute_workflow("NodeJoin", {"site": spot, "timeouts": FAST_JOIN}, id=f"join/{spot}/{name}",
                                      task_queue=cap.settings.task_queue)
    (machine,) = live(cap, "spot")
    for pod in ("web-1", "web-2"):
        cap.cluster.add_pod(machine["name"], pod, labels={"app": "web"})
    cap.cluster.set_pdb("default", "web", {"app": "web"}, min_available=2)
    return machine["name"], machine["id"]


async def start_reclaim(cap: CapStack, node: str, machine_id: str, terminate_at: float) -> WorkflowHandle:
    return await cap.client.start_workflow(
        "SpotReclaim", {"node_name": node, "site": cap.site("spot"), "machine_id": machine_id,
                        "terminate_at": terminate_at},
        id=f"reclaim/{node}", task_queue=cap.settings.task_queue,
    )


async def until_draining(handle: WorkflowHandle) -> None:
    """Until the run has read its deadline and started the drain (its ``step`` query)."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        try:
            if await handle.query("step") == "draining":
                return
        except Exception:  # noqa: BLE001 - the first workflow task may not have run yet
            pass
        assert asyncio.get_running_loop().time() < deadline, "the reclaim never started draining"
        await asyncio.sleep(0.1)


async def activities_completed(handle: WorkflowHandle, activity_type: str) -> int:
    events = (await handle.fetch_history()).events
    scheduled = {e.event_id for e in events if e.HasField("activity_task_scheduled_event_attributes")
                 and e.activity_task_scheduled_event_attributes.activity_type.name == activity_type}
    return sum(e.activity_task_completed_event_attributes.scheduled_event_id in scheduled
               for e in events if e.HasField("activity_task_completed_event_attributes"))


async def test_the_drain_says_what_it_waits_for_and_until_when(cap: CapStack) -> None:
    """Before: "<node> within 600s", and after a newer notice still that: neither what the run
    waits for nor until when, and not the time it acts by."""
    node, machine_id = await a_spot_node_whose_pods_cannot_leave(cap, "details")
    first = time.time() + 600
    handle = await start_reclaim(cap, node, machine_id, first)
    await until_draining(handle)
    waiting = "**draining**: waiting for the drain of {node} (PDBs honoured) until {until}, " \
              "when the provider takes the machine; acquiring a replacement"
    assert await details(handle) == waiting.format(node=node, until=utc(first))
    newer = time.time() + 300
    await handle.signal("notice", {"terminate_at": newer})
    await until_details(handle, lambda text: text == waiting.format(node=node, until=utc(newer)))
    await handle.terminate("test over")


async def test_an_earlier_notice_moves_the_deadline_the_reclaim_acts_by(cap: CapStack) -> None:
    """The first notice gives ten minutes; a newer one says the machine goes in five seconds. The
    drain is cut short then and the machine is retired then, not ten minutes later (before: the
    run drained on against the first time, its details naming it, the newer notice unused)."""
    node, machine_id = await a_spot_node_whose_pods_cannot_leave(cap, "earlier")
    first = time.time() + 600
    handle = await start_reclaim(cap, node, machine_id, first)
    await until_draining(handle)
    newer = time.time() + 5
    await handle.signal("notice", {"terminate_at": newer})

    # Bounded far below the first notice's ten minutes, which the run before waited out.
    result = SpotReclaimResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    deleted_at = cap.world.machine(machine_id)["deleted_at"]
    assert deleted_at is not None and newer <= deleted_at < first, (newer, deleted_at, first)
    assert not result.drained
    assert result.blocked == [f"drain cut short at {utc(newer).removesuffix(' UTC')} UTC: a newer notice has "
                              "the provider take the machine then"], result.blocked
    assert sorted(p.name for p in cap.cluster.pods(node)) == ["web-1", "web-2"], "the PDB is honoured to the end"
    await replay_and_record(handle, "spot_reclaim_earlier_notice")


async def test_a_later_notice_gives_the_drain_the_time_it_adds(cap: CapStack) -> None:
    """The first notice gives a few seconds, a newer one half a minute. The drain that ends at the
    first time with both pods still held drains again until the newer one, and the pods leave once
    the PDB lets them (before: the node was retired at the first time, its pods still on it)."""
    node, machine_id = await a_spot_node_whose_pods_cannot_leave(cap, "later")
    first = time.time() + 6
    handle = await start_reclaim(cap, node, machine_id, first)
    await until_draining(handle)  # against the first time
    later = time.time() + 30
    await handle.signal("notice", {"terminate_at": later})
    # The first drain ended at the first time, its pods held: now the PDB lets them go.
    deadline = asyncio.get_running_loop().time() + 30
    while await activities_completed(handle, "drain_within") < 1:
        assert asyncio.get_running_loop().time() < deadline, "the first drain never ended"
        await asyncio.sleep(0.2)
    assert cap.world.machine(machine_id)["deleted_at"] is None, "retired at the first notice's time"
    cap.cluster.delete_pdb("default", "web")

    result = SpotReclaimResult.model_validate(await asyncio.wait_for(handle.result(), 90))
    assert result.drained and result.blocked == [], result
    assert cap.cluster.pods(node) == []
    assert cap.world.machine(machine_id)["deleted_at"] is not None
    await replay_and_record(handle, "spot_reclaim_later_notice")


async def test_a_notice_far_off_is_believed_for_an_hour_at_most(cap: CapStack) -> None:
    """The notice is the node's word: one saying the year 2100 held the node's own drain, and the
    wait for its replacement, open for good. No provider gives more than minutes; the run acts by
    an hour after it began at the latest."""
    node, machine_id = await a_spot_node_whose_pods_cannot_leave(cap, "far")
    handle = await start_reclaim(cap, node, machine_id, time.time() + 600)
    await until_draining(handle)
    await handle.signal("notice", {"terminate_at": datetime(2100, 1, 1, tzinfo=timezone.utc).timestamp()})
    began = (await handle.describe()).start_time.timestamp()
    shown = await until_details(handle, lambda text: f"until {utc(began + 3600)}" in text)
    assert "2100" not in shown
    await handle.terminate("test over")


# -- a cancel ---------------------------------------------------------------------------------
def cordon_mark(cap: CapStack, node: str) -> str | None:
    return cap.cluster.annotate_node(node, {}).get(ANNOTATION_CORDONED_BY)  # a read: nothing merged


async def cancelled(handle: WorkflowHandle) -> None:
    """Cancel the run (``temporal workflow cancel``) and wait until it has ended Canceled."""
    await handle.cancel()
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(handle.result(), 60)
    assert isinstance(caught.value.cause, CancelledError), caught.value.cause


async def test_a_cancel_during_the_drain_uncordons_the_node_and_stops_the_replacement(cap: CapStack) -> None:
    """The notice was false: a person cancels the reclaim while it drains and its replacement boots.
    The node is uncordoned and its machine kept, the replacement's machine deleted before the run
    ends, ``FleetState`` ``cancelled`` and the details saying so (before: the node stayed cordoned
    for good, with no mark, read as a person's cordon, and the run said ``reclaiming``)."""
    node, machine_id = await a_spot_node_whose_pods_cannot_leave(cap, "cancel")
    for other in ("cheap", "mid", "dear"):  # the replacement's machine boots for a minute
        cap.world.set_site(cap.site(other), boot_seconds=60)
    handle = await start_reclaim(cap, node, machine_id, time.time() + 600)
    await until_draining(handle)
    await wait_for(lambda: cordon_mark(cap, node) == CORDONED_BY_RECLAIM, timeout=20)
    bought = await wait_for(lambda: [m for m in cap.world.machines() if m["id"] != machine_id], timeout=30)

    await cancelled(handle)
    after = cap.cluster.get_node(node)
    assert after is not None and not after.unschedulable, "the node serves again"
    assert cordon_mark(cap, node) is None
    assert cap.world.machine(machine_id)["deleted_at"] is None, "the machine is kept"
    assert sorted(p.name for p in cap.cluster.pods(node)) == ["web-1", "web-2"]
    replacement = await cap.client.get_workflow_handle(f"capacity/reclaim-{node}").describe()
    assert replacement.status != WorkflowExecutionStatus.RUNNING, "the replacement still buys"
    assert [cap.world.machine(m["id"])["deleted_at"] is not None for m in bought] == [True] * len(bought), \
        "the replacement's machine was deleted before the reclaim ended"
    assert await cap.listed(f'WorkflowId = "{handle.id}" AND FleetState = "cancelled"')
    shown = await details(handle)
    assert shown.startswith("**cancelled**: cancelled while draining: ") and f"{node} uncordoned" in shown, shown
    assert "the replacement request stopped" in shown, shown
    await asyncio.sleep(3)  # time for anything still running to buy more (nothing must)
    assert [m["id"] for m in cap.world.machines()] == [machine_id]
    await replay_and_record(handle, "spot_reclaim_cancelled_while_draining")


async def test_a_cancelled_reclaims_uncordon_says_it_has_no_deadline(cap: CapStack, monkeypatch) -> None:
    """A cancelled reclaim's uncordon is retried until the cluster answers (nothing else ever uncordons
    the node): its details say so, and why. Before: "uncordoning" and the node, nothing saying the run
    waits on the cluster with no bound (an API server away for an hour: an hour of that)."""
    import activities.capacity

    node, machine_id = await a_spot_node_whose_pods_cannot_leave(cap, "uncordon")
    uncordoning, go_on = threading.Event(), threading.Event()
    uncordon = activities.capacity.uncordon_unless

    def held(cluster, nodes, *args, **kwargs):
        if node in nodes:
            uncordoning.set()
            go_on.wait(30)
        return uncordon(cluster, nodes, *args, **kwargs)

    monkeypatch.setattr(activities.capacity, "uncordon_unless", held)
    handle = await start_reclaim(cap, node, machine_id, time.time() + 600)
    await until_draining(handle)
    await wait_for(lambda: cordon_mark(cap, node) == CORDONED_BY_RECLAIM, timeout=20)
    await handle.cancel()
    try:
        assert await asyncio.to_thread(uncordoning.wait, 30), "the uncordon began"
        shown = await details(handle)
    finally:
        go_on.set()
    assert shown.split("\n")[0] == (
        f"**uncordoning**: {node}: cancelled before the notice's time, the machine stays: its uncordon retried "
        "until the cluster answers (no deadline: a put-back that gave up would leave the change in place)"), shown
    with pytest.raises(WorkflowFailureError):
        await asyncio.wait_for(handle.result(), 60)
    assert not cap.cluster.get_node(node).unschedulable, "uncordoned"


async def test_a_cancelled_reclaim_says_it_waits_for_its_stopped_replacement(cap: CapStack, monkeypatch) -> None:
    """Cancelled while its replacement's machine is being created, the reclaim uncordons the node, then
    waits for the replacement request to end: its join awaits the create, then deletes the machine.
    Its details say so, and until when (the create's one try). Before: still "uncordoning", the
    uncordon long done, nothing naming the wait."""
    from sim.provider import SimProvider
    from tests.details_helpers import held

    node, machine_id = await a_spot_node_whose_pods_cannot_leave(cap, "stopping")
    creating, created = held(monkeypatch, SimProvider, "create_machine")  # the replacement's
    handle = await start_reclaim(cap, node, machine_id, time.time() + 600)
    await until_draining(handle)
    try:
        assert await asyncio.to_thread(creating.wait, 30), "the replacement's create began"
        await handle.cancel()
        shown = await until_details(handle, lambda text: not text.startswith(("**draining**", "**uncordoning**")))
        events = (await handle.fetch_history()).events
    finally:
        created.set()
    child = f"capacity/reclaim-{node}"
    head = re.fullmatch(
        rf"\*\*stopping the replacement\*\*: {node}: cancelled; waiting for {child} to end: told to stop, its "
        r"joins in flight delete their machines \(a create under way is awaited first: its try ends until "
        r"(\d\d:\d\d:\d\d) UTC at the latest\)", shown)
    assert head is not None, shown
    # The join's default provision_seconds (600) from the task that took the uncordon's answer.
    uncordon = next(e.event_id for e in events if e.HasField("activity_task_scheduled_event_attributes")
                    and e.activity_task_scheduled_event_attributes.activity_type.name == "release_cordons")
    answered = next(e.event_id for e in events if e.HasField("activity_task_completed_event_attributes")
                    and e.activity_task_completed_event_attributes.scheduled_event_id == uncordon)
    task = next(e for e in events if e.event_id > answered and e.HasField("workflow_task_started_event_attributes"))
    assert head.group(1) == utc(task.event_time.ToDatetime(tzinfo=timezone.utc).timestamp() + 600)[:8], head.group(1)
    with pytest.raises(WorkflowFailureError):
        await asyncio.wait_for(handle.result(), 60)
    assert not cap.cluster.get_node(node).unschedulable, "uncordoned"
    assert "the replacement request stopped" in await details(handle)


async def test_a_cancel_leaves_a_cordon_that_was_not_the_reclaims(cap: CapStack) -> None:
    """A person had cordoned the node before the notice (``kubectl cordon``, no mark): the reclaim
    drains it all the same (the machine goes at the notice), marks nothing, and its cancel leaves
    that cordon to the person. A replacement that joined before the cancel stays."""
    node, machine_id = await a_spot_node_whose_pods_cannot_leave(cap, "theirs")
    cap.cluster.cordon(node)
    handle = await start_reclaim(cap, node, machine_id, time.time() + 600)
    await until_draining(handle)
    replacement = cap.client.get_workflow_handle(f"capacity/reclaim-{node}")
    await asyncio.wait_for(replacement.result(), 30)

    await cancelled(handle)
    assert cap.cluster.get_node(node).unschedulable and cordon_mark(cap, node) is None
    shown = await details(handle)
    assert f"{node} left cordoned: its cordon is not the reclaim's" in shown, shown
    assert "the replacement had joined already and stays" in shown, shown


async def test_a_cancel_once_the_machine_is_retired_stops_the_replacement(cap: CapStack) -> None:
    """The notice's time came and the node was retired; the replacement still boots when a person
    cancels the reclaim. The replacement's machine is deleted and the run ends Canceled, saying the
    node was retired (before: the cancel was taken for the replacement's failure and the run
    completed, ``replacement failed``)."""
    spot = cap.site("spot")
    await cap.client.execute_workflow("NodeJoin", {"site": spot, "timeouts": FAST_JOIN}, id=f"join/{spot}/gone",
                                      task_queue=cap.settings.task_queue)
    ((node, machine_id),) = [(m["name"], m["id"]) for m in live(cap, "spot")]
    for other in ("cheap", "mid", "dear"):  # the replacement's machine boots for a minute
        cap.world.set_site(cap.site(other), boot_seconds=60)
    handle = await start_reclaim(cap, node, machine_id, time.time() + 3)
    await until_details(handle, lambda text: text.startswith("**waiting for the replacement**"))
    assert cap.world.machine(machine_id)["deleted_at"] is not None
    bought = [m for m in cap.world.machines() if m["site"] != spot]

    await cancelled(handle)
    assert bought and all(cap.world.machine(m["id"])["deleted_at"] is not None for m in bought), bought
    assert await cap.listed(f'WorkflowId = "{handle.id}" AND FleetState = "cancelled"')
    shown = await details(handle)
    assert f"cancelled while waiting for the replacement: {node} retired" in shown, shown
    assert "the replacement request stopped" in shown, shown
    await replay_and_record(handle, "spot_reclaim_cancelled_waiting_for_the_replacement")
