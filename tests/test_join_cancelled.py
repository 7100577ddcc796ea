"""A cancelled NodeJoin ends cancelled, not failed: it deletes the machine it bought (and the
node's join tokens) as before, then closes Canceled with ``FleetState = "cancelled"`` and its
details saying what it cleaned up. Before, it reported the cancel as its own failure
(``CancelledError while waiting for registration``): the UI, ``gpufleet`` and every caller saw a
failed join where an operator (or a parent request) had cancelled one.

Against the real dev server, the control-plane worker and the simulated providers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import CancelledError
from temporalio.worker import HandleQueryInput, Interceptor, WorkflowInboundInterceptor

from activities.control_plane import ControlPlaneActivities
from activities.node_agent import NodeAgentActivities
from client import FleetClient
from fleet import search_attributes as sa
from fleet.messages.join import JoinProgress
from fleet.messages.nodes import ResolveSiteInput, SmokeTestInput
from workers import control_plane
from tests.conftest import Stack, wait_for
from tests.repair_helpers import eventually
from tests.replay import replay_and_record

#: The join's machine boots this long: the cancel lands while the join waits for it to register.
SLOW_BOOT_SECONDS = 60


async def _progress(handle: WorkflowHandle) -> JoinProgress:
    return JoinProgress.model_validate(await handle.query("progress"))


async def _details(handle: WorkflowHandle) -> str:
    metadata = await handle.query("__temporal_workflow_metadata")  # the UI reads its details here
    return metadata.current_details if hasattr(metadata, "current_details") else metadata["currentDetails"]


async def join_waiting_for_registration(stack: Stack) -> tuple[WorkflowHandle, dict]:
    """A join whose machine is bought and boots slowly: it waits for the node to register,
    which is where a cancel lands."""
    stack.world.set_site("site-a", boot_seconds=SLOW_BOOT_SECONDS)
    handle = await stack.start_join({"site": "site-a"}, request=f"cancel-{uuid.uuid4().hex[:6]}")

    async def waiting() -> bool:
        return (await _progress(handle)).step == "waiting for registration"

    await eventually(waiting, timeout=30)
    (machine,) = await wait_for(lambda: stack.world.machines("site-a"), timeout=20)
    return handle, machine


async def test_a_join_cancelled_while_waiting_for_registration_deletes_its_machine_and_ends_cancelled(
        stack: Stack) -> None:
    handle, machine = await join_waiting_for_registration(stack)

    await handle.cancel()
    with pytest.raises(WorkflowFailureError) as ended:
        await handle.result()

    assert isinstance(ended.value.cause, CancelledError), f"ended by {ended.value.cause!r}, not by the cancel"
    description = await handle.describe()
    assert description.status == WorkflowExecutionStatus.CANCELED
    assert description.typed_search_attributes.get(sa.FLEET_STATE) == "cancelled"
    # The clean-up is what it was: the machine deleted, no node object, no join token left.
    assert stack.world.machines("site-a") == []
    assert stack.world.machine(machine["id"])["deleted_at"] is not None
    assert [n for n in stack.cluster.list_nodes() if n.name == machine["name"]] == [], "never admitted"
    assert stack.world.query("SELECT * FROM join_tokens WHERE node_name=?", machine["name"]) == []
    # And it says so where the operator looks: the progress query and the UI's details.
    progress = await _progress(handle)
    assert progress.step == "cancelled" and progress.machine_id == machine["id"], progress
    assert "waiting for registration" in progress.done, "where the cancel landed"
    details = await _details(handle)
    assert "cancelled while waiting for registration" in details, details
    assert f"machine {machine['id']} deleted" in details, details
    await replay_and_record(handle, "node_join_cancelled")


async def test_cancel_join_says_the_machine_was_deleted(stack: Stack) -> None:
    """What ``gpufleet join`` prints when it is interrupted (``FleetClient.cancel_join``)."""
    handle, machine = await join_waiting_for_registration(stack)

    cancelled = await FleetClient(stack.settings, temporal=stack.client).cancel_join(handle.id, "test")

    assert cancelled.status == "canceled" and not cancelled.needs_person, cancelled
    assert cancelled.step == "waiting for registration", cancelled
    assert cancelled.summary() == (f"cancelled {handle.id}: machine {machine['id']} "
                                   f"deleted, node {machine['name']} never admitted")
    assert stack.world.machines("site-a") == []


async def test_a_cancelled_fan_out_ends_cancelled_once_each_join_deleted_its_machine(stack: Stack) -> None:
    """``count`` > 1: the fan-out's children are cancelled with it, each deletes its machine, and
    the fan-out says so (it closed Canceled before too, but stayed ``FleetState = joining``)."""
    stack.world.set_site("site-a", boot_seconds=SLOW_BOOT_SECONDS)
    handle = await stack.start_join({"site": "site-a", "count": 2}, request=f"fan-{uuid.uuid4().hex[:6]}")
    await wait_for(lambda: len(stack.world.machines("site-a")) == 2, timeout=30)

    await handle.cancel()
    with pytest.raises(WorkflowFailureError) as ended:
        await handle.result()

    assert isinstance(ended.value.cause, CancelledError), ended.value.cause
    description = await handle.describe()
    assert description.status == WorkflowExecutionStatus.CANCELED
    assert description.typed_search_attributes.get(sa.FLEET_STATE) == "cancelled"
    assert stack.world.machines("site-a") == []
    for i in range(2):
        child = await stack.client.get_workflow_handle(f"{handle.id}/{i}").describe()
        assert child.status == WorkflowExecutionStatus.CANCELED
        assert child.typed_search_attributes.get(sa.FLEET_STATE) == "cancelled"
    progress = await _progress(handle)
    assert progress.step == "cancelled" and progress.cancelled_while == "joining", progress
    assert "each deleted the machine it bought" in await _details(handle)


async def test_cancel_join_of_a_fan_out_says_what_each_of_its_joins_bought(stack: Stack) -> None:
    """What ``gpufleet join --count 2`` prints when it is interrupted: the fan-out bought nothing
    itself, its joins each bought a machine (and delete it, or keep the node one admitted). Before,
    it said "nothing was bought" of two machines bought."""
    stack.world.set_site("site-a", boot_seconds=SLOW_BOOT_SECONDS)
    handle = await stack.start_join({"site": "site-a", "count": 2}, request=f"fan-{uuid.uuid4().hex[:6]}")
    machines = await wait_for(lambda: (m := stack.world.machines("site-a")) and len(m) == 2 and m, timeout=30)

    said = (await FleetClient(stack.settings, temporal=stack.client).cancel_join(handle.id, "test")).summary()

    lines = said.splitlines()
    assert lines[0] == f"cancelled {handle.id} while joining; its 2 joins:", said
    by_id = {m["id"]: m for m in machines}
    deleted = sorted(lines[1:])
    assert len(deleted) == 2 and all(line.startswith(f"  cancelled {handle.id}/") for line in deleted), said
    for machine_id, machine in by_id.items():
        assert any(f"machine {machine_id} deleted, node {machine['name']} never admitted" in line
                   for line in deleted), said
    assert "nothing was bought" not in said


async def test_a_join_cancelled_during_its_smoke_test_ends_cancelled_not_with_a_failed_smoke_test(
        fleet_world: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The smoke test's activity cancelled with the join is not the node failing its test: before,
    the join failed as ``SmokeTestFailed`` (which its capacity request counts against the offer)."""
    testing, release = threading.Event(), threading.Event()
    honest = NodeAgentActivities.smoke_test

    @activity.defn(name="smoke_test")
    def smoke_test(self, input: SmokeTestInput) -> Any:  # no hint on self: the SDK skips it
        testing.set()
        release.wait(60)  # a long compute check: the cancel lands during it
        return honest(self, input)

    monkeypatch.setattr(NodeAgentActivities, "smoke_test", smoke_test)
    from tests.plugins.stack import running_stack

    async with running_stack(fleet_world) as stack:
        try:
            handle = await stack.start_join({"site": "site-a"}, request=f"smoke-{uuid.uuid4().hex[:6]}")
            await wait_for(testing.is_set, timeout=30)
            (machine,) = stack.world.machines("site-a")
            await handle.cancel()
            with pytest.raises(WorkflowFailureError) as ended:
                await handle.result()
        finally:
            release.set()

        assert isinstance(ended.value.cause, CancelledError), f"ended by {ended.value.cause!r}, not by the cancel"
        description = await handle.describe()
        assert description.status == WorkflowExecutionStatus.CANCELED
        assert description.typed_search_attributes.get(sa.FLEET_STATE) == "cancelled"
        assert stack.world.machines("site-a") == [] and stack.world.machine(machine["id"])["deleted_at"] is not None
        assert [n for n in stack.cluster.list_nodes() if n.name == machine["name"]] == [], "node object removed"
        progress = await _progress(handle)
        assert progress.step == "cancelled" and progress.cancelled_while == "smoke test", progress


async def test_a_join_cancelled_while_its_progress_is_answered_during_the_site_lookup_replays(
        fleet_world: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpufleet join` and the UI query a join's progress from its start, and a cancel (Ctrl-C, the
    request that started it) can come during its first task. When the site's lookup was a local
    activity that ended while the worker answered such a query, the worker handed its result over
    a task late, with the cancel: the run ended cancelled at the lookup where a replay (the result
    from its marker, a task earlier) had scheduled the machine's create, so the history did not
    replay and a query of the ended join failed (`gpufleet join` then named no step). The join
    runs no local activity: a join by hand looks its site up in a regular activity,
    ``resolve_site`` (``join-by-hand-refuses-max-nodes-0``), a parent's join in its provisioning
    activity. One cancelled in that window buys nothing and replays. (The run of the code before
    the patch, cancelled in its provisioning activity, is
    ``tests/histories/node_join_cancelled_while_queried_in_site_lookup.json``; it still replays.)"""
    answering, cancelled = threading.Event(), threading.Event()
    honest = ControlPlaneActivities.resolve_site

    @activity.defn(name="resolve_site")
    async def resolve_site(self, input: ResolveSiteInput) -> Any:  # no hint on self: the SDK skips it
        # The lookup ends while the query is answered, after the cancel came.
        await asyncio.to_thread(answering.wait, 30)
        await asyncio.to_thread(cancelled.wait, 30)
        await asyncio.sleep(0.3)  # (as a regular activity, after the task that takes the cancel)
        return honest(self, input)

    class SlowProgress(WorkflowInboundInterceptor):
        def handle_query(self, input: HandleQueryInput) -> Any:
            if input.query == "progress":
                answering.set()
                time.sleep(1.0)  # a loaded worker answers slowly
            return super().handle_query(input)

    class SlowProgressQueries(Interceptor):
        def workflow_interceptor_class(self, input: Any) -> type[WorkflowInboundInterceptor]:
            return SlowProgress

    monkeypatch.setattr(ControlPlaneActivities, "resolve_site", resolve_site)
    interceptors = control_plane.worker_interceptors
    monkeypatch.setattr(control_plane, "worker_interceptors", lambda: [*interceptors(), SlowProgressQueries()])
    from tests.plugins.stack import running_stack

    handle = await fleet_world.start_join({"site": "site-a"}, request=f"lookup-{uuid.uuid4().hex[:6]}")
    watching = asyncio.create_task(_progress(handle))  # no worker yet: it comes with the first task
    await asyncio.sleep(0.5)
    async with running_stack(fleet_world) as stack:
        try:
            await asyncio.to_thread(answering.wait, 30)
            await handle.cancel()
        finally:
            cancelled.set()
        assert (await watching).step == "resolving site"
        with pytest.raises(WorkflowFailureError) as ended:
            await asyncio.wait_for(handle.result(), 60)

        assert isinstance(ended.value.cause, CancelledError), f"ended by {ended.value.cause!r}, not by the cancel"
        assert stack.world.calls("acct-a") == 0 and stack.world.machines(include_deleted=True) == [], "nothing bought"
        markers = [e.marker_recorded_event_attributes.marker_name async for e in handle.fetch_history_events()
                   if e.HasField("marker_recorded_event_attributes")]
        assert "core_local_activity" not in markers, markers
        progress = await _progress(handle)  # a query of the ended join replays its history
        assert progress.step == "cancelled" and progress.cancelled_while == "resolving site", progress
        assert "nothing was bought" in await _details(handle)
        await replay_and_record(handle, "node_join_cancelled_while_queried_in_site_lookup_by_hand")


async def test_gpufleet_join_watching_a_join_cancelled_elsewhere_says_cancelled_not_failed(stack: Stack) -> None:
    """An operator watches `gpufleet join`; someone cancels the join in the Temporal UI. The
    command says what the cancel left (its machine deleted), not that the join failed."""
    stack.world.set_site("site-a", boot_seconds=SLOW_BOOT_SECONDS)
    request = f"watched-{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen([sys.executable, "-m", "cli", "join", "--site", "site-a", "--request", request],
                            env={**stack.settings_env(), "COLUMNS": "250"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        handle = stack.client.get_workflow_handle(f"join/site-a/{request}")

        async def waiting() -> bool:
            try:
                return (await _progress(handle)).step == "waiting for registration"
            except Exception:  # noqa: BLE001 - not started yet
                return False

        await eventually(waiting, timeout=30)
        await handle.cancel()
        out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    assert f"cancelled join/site-a/{request}: machine " in out and "deleted" in out, out
    assert "failed" not in out, out


async def test_a_failed_join_whose_clean_up_left_its_machine_says_a_person_must_look(stack: Stack) -> None:
    """The node never registers in time, and meanwhile the provider account's credentials were
    revoked: the join fails, and its clean-up cannot delete the machine. The machine may be
    billing: the join ends needs-person (its failure names what it left), not as an ordinary
    failure."""
    stack.world.set_site("site-a", boot_seconds=SLOW_BOOT_SECONDS)
    handle = await stack.start_join({"site": "site-a", "timeouts": {"registration_seconds": 3}},
                                    request=f"leaky-{uuid.uuid4().hex[:6]}")
    (machine,) = await wait_for(lambda: stack.world.machines("site-a"), timeout=20)
    stack.world.set_credentials_valid(machine["account"], False)
    with pytest.raises(WorkflowFailureError) as ended:
        await asyncio.wait_for(handle.result(), 120)
    assert f"clean-up incomplete, a person looks: machine {machine['id']}" in str(ended.value.cause), ended.value.cause
    assert stack.world.machine(machine["id"])["deleted_at"] is None, "the machine is still there"
    description = await handle.describe()
    assert description.typed_search_attributes.get(sa.FLEET_STATE) == "needs-person"


async def test_a_cancel_during_a_failed_joins_clean_up_does_not_stop_it(stack: Stack) -> None:
    """The node never registers in time, and the join cleans up; an operator (or the request
    that started it) cancels it meanwhile. The cancel used to cancel the machine's delete: the
    machine was left billing for the sweep and the join ended needs-person. Now the clean-up runs
    to its end under the cancel and the join ends as it was going to:
    failed, the machine deleted, no token left."""
    stack.world.set_site("site-a", boot_seconds=SLOW_BOOT_SECONDS)
    handle = await stack.start_join({"site": "site-a", "timeouts": {"registration_seconds": 2}},
                                    request=f"late-{uuid.uuid4().hex[:6]}")
    (machine,) = await wait_for(lambda: stack.world.machines("site-a"), timeout=20)
    stack.world.set_site("site-a", api_latency_ms=3000)  # the delete is slow: the cancel lands in it

    async def cleaning_up() -> bool:
        return (await _progress(handle)).step == "cleaning up"

    await eventually(cleaning_up, timeout=30)
    await handle.cancel()
    with pytest.raises(WorkflowFailureError) as ended:
        await asyncio.wait_for(handle.result(), 60)
    assert "clean-up incomplete" not in str(ended.value.cause), ended.value.cause
    assert "while waiting for registration" in str(ended.value.cause), ended.value.cause
    description = await handle.describe()
    assert description.typed_search_attributes.get(sa.FLEET_STATE) == "failed"
    assert stack.world.machine(machine["id"])["deleted_at"] is not None, "the machine is deleted"
    assert stack.world.query("SELECT * FROM join_tokens WHERE node_name=?", machine["name"]) == []
    await replay_and_record(handle, "node_join_failed_clean_up_cancelled")
