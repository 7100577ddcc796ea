"""A capacity request converges (issue 36): what no configured site can ever serve is refused
at start naming the field; a cancel (the update, Temporal's own cancel, the HTTP relay, Ctrl-C
on `gpufleet capacity`) stops spending, each join in flight deleting its machine; and a wait
says why and until when, in the workflow's details and on the command's line.

Against the real dev server, the control-plane worker and the simulated providers."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle, WorkflowUpdateStage
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from client import FleetClient, InvalidArgument
from fleet.config import Site, load_config
from fleet.feasibility import count_problems, request_problems
from fleet.messages.capacity import Catalog, CapacityProgress, CapacityResult, GetCatalogInput
from fleet.messages.join import JoinedNode, JoinProgress, NodeJoinResult
from fleet.placement import Constraints
from tests.bad_input_helpers import invalid_input, task_failures
from tests.capacity_fleet import CapStack, capacity_fleet, details, open_stack
from tests.conftest import wait_for
from tests.one_task_helpers import JOB_MODES, in_one_task, jobs_applied, one_task_had_both
from tests.repair_helpers import eventually
from tests.replay import replay_and_record

#: Joins that stay in flight: the machine boots for a minute, registration may take two.
SLOW_JOIN = {"registration_seconds": 120, "smoke_test_seconds": 10, "heartbeat_seconds": 5}


@pytest.fixture
async def cap(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[CapStack]:
    address = temporal_env.client.service_client.config.target_host
    async for stack in open_stack(temporal_env.client, address, tmp_path):
        yield stack


def bought(cap: CapStack) -> list:
    """Every machine the simulated providers ever sold this test, deleted or not."""
    return cap.world.machines(include_deleted=True)


def live(cap: CapStack) -> list:
    return cap.world.machines()


# -- refused at start --------------------------------------------------------------------------
def test_impossible_requests_name_their_field() -> None:
    """The pure rule, on the capacity fleet's config (four H100 sites, two of them in eu)."""
    sites = load_config_from(capacity_fleet("u")).sites

    def problems(**constraints) -> list[tuple[str, str]]:
        return request_problems(Constraints(**constraints), sites)

    assert problems()[0][0] == "constraints" and "empty request" in problems()[0][1]
    assert problems(sites=["mars-1"]) == [
        ("constraints.sites", "unknown site 'mars-1' (configured: cheap-u, dear-u, mid-u, spot-u)")]
    assert problems(gpu="Z999") == [("constraints.gpu", "no configured site sells GPU 'Z999' (sold: H100)")]
    assert problems(gpu_class=[])[0][0] == "constraints.gpu_class", "[] never means every GPU"
    assert problems(gpu="H100", geographies=[])[0][0] == "constraints.geographies"
    assert problems(gpu="H100", geographies=["mars"])[0][0] == "constraints.geographies"
    field, why = problems(gpu="H100", geographies=["eu"], max_price_per_gpu_hour=1.0)[0]
    assert field == "constraints.geographies, constraints.max_price_per_gpu_hour", field
    assert "no configured site can ever satisfy" in why and "$1.50/GPU-h > max $1.00" in why
    # What a person or time can change is not refused: the request waits for it.
    assert problems(gpu="H100") == [] and problems(sites=["cheap-u"], spend_cap_per_hour=4.0) == []


def test_a_count_is_checked_against_the_max_nodes_of_the_sites_the_request_may_buy_at() -> None:
    """The eligible sites are those its constraints allow (eu: mid and spot, 8 nodes each); their
    configured max_nodes, not the room they have now."""
    sites = load_config_from(capacity_fleet("u")).sites
    eu = Constraints(gpu="H100", geographies=["eu"])
    assert count_problems(16, eu, sites) == []
    assert count_problems(17, eu, sites) == [
        ("count", "17 nodes is more than the eligible sites can ever hold together: 16 (max_nodes: mid-u 8, spot-u 8)")]
    assert count_problems(32, Constraints(gpu="H100"), sites) == []


def load_config_from(fleet: dict):
    import tempfile

    import yaml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(fleet, f)
    try:
        return load_config(f.name)
    finally:
        os.unlink(f.name)


@pytest.mark.parametrize("request_body, field", [
    ({}, "constraints"),
    ({"constraints": {"sites": ["mars-1"]}}, "constraints.sites"),
    ({"constraints": {"gpu": "Z999"}}, "constraints.gpu"),
    ({"constraints": {"gpu": "H100", "geographies": ["eu"], "capacity_types": ["owned"]}},
     "constraints.capacity_types"),
])
async def test_acquire_capacity_refuses_what_no_site_can_serve(cap: CapStack, request_body: dict,
                                                               field: str) -> None:
    handle = await cap.request(request_body)
    cause = await invalid_input(handle, field)
    assert cause.message.startswith(f"invalid AcquireCapacity: {field}"), cause.message
    assert bought(cap) == [], "nothing bought"
    if request_body == {}:
        history = await handle.fetch_history()
        assert not [e for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED], \
            "{} is refused before even the catalog is read"
    await replay_and_record(handle, "capacity_refused_at_start")


@pytest.fixture
async def small_sites(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[CapStack]:
    """The capacity fleet with cheap and mid held to one node each (max_nodes), each provider
    still able to sell four."""
    address = temporal_env.client.service_client.config.target_host
    uid = uuid.uuid4().hex[:6]
    fleet = capacity_fleet(uid, cheap={"max_nodes": 1}, mid={"max_nodes": 1})
    async for stack in open_stack(temporal_env.client, address, tmp_path, fleet, uid):
        yield stack


async def test_a_count_the_eligible_sites_can_never_hold_is_refused_at_start(small_sites: CapStack) -> None:
    """Three nodes from two sites of at most one node each. Before, the request bought all three
    at the cheaper site, two above its max_nodes (for its Site entity to drain and retire)."""
    cap = small_sites
    handle = await cap.request({"constraints": {"sites": [cap.site("cheap"), cap.site("mid")]}, "count": 3,
                                "deadline_seconds": 30, "backoff_seconds": 1})
    cause = await invalid_input(handle, "count")
    assert cause.message == (f"invalid AcquireCapacity: count: 3 nodes is more than the eligible sites can ever "
                             f"hold together: 2 (max_nodes: {cap.site('cheap')} 1, {cap.site('mid')} 1)"), cause.message
    assert bought(cap) == [], "nothing bought"
    await replay_and_record(handle, "capacity_refused_count")


def test_the_client_refuses_before_anything_starts(tmp_path: Path) -> None:
    """No server needed: the client checks against its own fleet config."""
    from typer.testing import CliRunner
    import yaml

    from cli.main import app
    from fleet.settings import Settings

    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(capacity_fleet("u")))
    fleet = FleetClient(Settings(address="127.0.0.1:1", config=str(path)))
    for body, field in (({}, "constraints"), ({"constraints": {"sites": ["mars-1"]}}, "constraints.sites"),
                        ({"constraints": {"gpu": "Z999"}}, "constraints.gpu")):
        with pytest.raises(InvalidArgument) as caught:
            asyncio.run(fleet.acquire_capacity(body, request_id="x"))
        assert caught.value.field == field, caught.value
    # Two eu sites of max_nodes 8: 17 nodes never fit; `gpufleet capacity` says so before connecting.
    with pytest.raises(InvalidArgument) as caught:
        asyncio.run(fleet.acquire_capacity({"constraints": {"gpu": "H100", "geographies": ["eu"]}, "count": 17},
                                           request_id="x"))
    assert caught.value.problems == [("count", "17 nodes is more than the eligible sites can ever hold together: "
                                               "16 (max_nodes: mid-u 8, spot-u 8)")]
    refused = CliRunner().invoke(app, ["capacity", "--gpu", "H100", "--geo", "eu", "--count", "17",
                                       "--address", "127.0.0.1:1", "--config", str(path)], env={"COLUMNS": "250"})
    assert refused.exit_code == 2, refused.output
    assert "--count: 17 nodes is more than the eligible sites can ever hold together: 16" in refused.output, refused.output


# -- a cancel stops spending -------------------------------------------------------------------
async def in_flight(cap: CapStack, count: int, **extra) -> tuple:
    """A request whose ``count`` joins each bought a machine that is still booting."""
    cap.world.set_site(cap.site("cheap"), boot_seconds=60)
    handle = await cap.request({"constraints": {"sites": [cap.site("cheap")]}, "count": count,
                                "join_timeouts": SLOW_JOIN, **extra})
    await wait_for(lambda: len(live(cap)) == count, timeout=20)
    return handle


async def settled(cap: CapStack, seconds: float = 4.0) -> None:
    """Time for anything still running to buy more (it must not)."""
    cap.world.set_site(cap.site("cheap"), boot_seconds=0.1)
    await cap.refresh_catalog()
    await asyncio.sleep(seconds)


async def test_cancel_update_stops_every_join_and_deletes_its_machine(cap: CapStack) -> None:
    handle = await in_flight(cap, 2)
    fleet = FleetClient(cap.settings, cap.client)
    progress = await fleet.cancel_capacity(handle.id, "not needed after all")
    assert progress.cancelled == "not needed after all" and progress.finished
    assert len(progress.released) == 2 and all("machine deleted" in r for r in progress.released), progress
    assert live(cap) == [], "each join deleted its machine before the cancel answered"
    result = CapacityResult.model_validate(await handle.result())
    assert result.cancelled == "not needed after all" and result.nodes == [] and not result.complete
    await settled(cap)
    assert len(bought(cap)) == 2 and live(cap) == [], "nothing bought after the cancel"
    assert await task_failures(handle) == 0
    await replay_and_record(handle, "capacity_cancelled")


async def test_temporal_cancel_winds_the_joins_down_too(cap: CapStack) -> None:
    """``temporal workflow cancel``, the UI's button, a batch cancel over HTTP: the same end."""
    handle = await in_flight(cap, 1)
    await handle.cancel()
    with pytest.raises(WorkflowFailureError) as caught:
        await handle.result()
    assert isinstance(caught.value.cause, CancelledError)
    assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED
    assert live(cap) == []
    progress = await handle.query("progress", result_type=CapacityProgress)
    assert len(progress.released) == 1 and progress.finished
    await settled(cap)
    assert len(bought(cap)) == 1 and live(cap) == []
    await replay_and_record(handle, "capacity_temporal_cancel")


async def test_the_http_relay_cancels_the_same_way(cap: CapStack) -> None:
    handle = await in_flight(cap, 1)
    relay = await cap.client.start_workflow(
        "EntityUpdate", {"entity": handle.id, "update": "cancel", "args": {"reason": "over HTTP"}},
        id=f"update-cancel-{cap.uid}", task_queue=cap.settings.task_queue)
    answer = await relay.result()
    assert answer["workflow_type"] == "AcquireCapacity" and answer["result"]["cancelled"] == "over HTTP"
    assert len(answer["result"]["released"]) == 1
    assert live(cap) == []
    await settled(cap)
    assert len(bought(cap)) == 1


async def test_a_cancel_after_the_end_is_refused_not_applied(cap: CapStack) -> None:
    handle = await cap.request({"constraints": {"sites": [cap.site("cheap")]}})
    result = CapacityResult.model_validate(await handle.result())
    assert result.complete
    from client import Rejected, NotFound

    with pytest.raises((Rejected, NotFound)):
        await FleetClient(cap.settings, cap.client).cancel_capacity(handle.id)
    assert len(live(cap)) == 1, "the joined node stays"


async def test_a_join_cancelled_while_its_node_is_admitted_keeps_the_node_it_admitted(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The request is cancelled while its join admits the node (the unproven taint lifted, the
    Node entity and the Site still to be told). The admit hears no cancel and goes on: once it
    went through, the node is schedulable and its Site counts it ready, so pods may be on it. The
    join waits for the admit's answer and ends ready, the node kept and the cancel noted; the
    request counts it joined, and its cost. Before, the join deleted the machine and removed the node
    (after the admit, with no drain; earlier still, while the admit went on); then the request's
    result left the kept machine's cost out."""
    from fleet.cluster import UNPROVEN_TAINT
    from sim.cluster import SimCluster

    admitting, go_on = threading.Event(), threading.Event()
    set_taints = SimCluster.set_taints

    def admit_held(self, name: str, add: list[str] = (), remove: list[str] = ()):
        node = set_taints(self, name, add, remove)
        if UNPROVEN_TAINT in remove:  # the admit's first step: the rest of it waits for the test
            admitting.set()
            go_on.wait(60)
        return node

    monkeypatch.setattr(SimCluster, "set_taints", admit_held)
    handle = await cap.request({"constraints": {"sites": [cap.site("cheap")]}})
    await wait_for(admitting.is_set, timeout=60)
    (join_id,) = (await handle.query("progress", result_type=CapacityProgress)).joins
    join = cap.client.get_workflow_handle(join_id)
    (machine,) = live(cap)
    cancel = asyncio.ensure_future(FleetClient(cap.settings, cap.client).cancel_capacity(handle.id, "not needed"))
    try:
        await asyncio.sleep(3)
        status = (await join.describe()).status
        assert status == WorkflowExecutionStatus.RUNNING, f"the join waits for its admit's answer, not {status.name}"
        assert live(cap) == [machine], "nothing deleted while the admit goes on"
    finally:
        go_on.set()
    progress = await asyncio.wait_for(cancel, 60)
    assert progress.released == [], progress
    assert progress.joined == 1 and progress.attempts[-1].outcome == "joined", progress
    assert live(cap) == [machine], "the admitted node's machine stays"
    node = cap.cluster.get_node(machine["name"])
    assert node is not None and UNPROVEN_TAINT not in node.taints, "and its node, admitted"
    assert (await join.describe()).status == WorkflowExecutionStatus.COMPLETED
    text = await details(join)
    assert text.startswith("**ready**"), text
    assert (f"cancelled while admitting: node {machine['name']} was admitted as the cancel came "
            f"and stays (machine {machine['id']})") in text, text
    assert (await join.query("progress", result_type=JoinProgress)).admitted
    said = (await FleetClient(cap.settings, cap.client).cancel_join(join_id)).summary()  # `gpufleet join` says
    assert said == (f"{join_id}: the cancel came while node {machine['name']} was admitted; the admit went "
                    f"through, so that node stays (machine {machine['id']})"), said
    result = CapacityResult.model_validate(await handle.result())
    assert [n.node_name for n in result.nodes] == [machine["name"]] and result.cancelled == "not needed", result
    assert result.cost_per_hour == 4.0, "the kept machine bills: its 2 GPUs at $2.00/GPU-h"
    history = await join.fetch_history()
    assert not [e for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED], \
        "no cancel sent to the admit"
    await replay_and_record(join, "node_join_cancelled_while_admitting")


async def test_a_fatal_failure_names_the_node_a_join_admitted_as_the_joins_were_stopped(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """One join fails fatally (InvalidRequest) while another admits its node: the request stops
    that join, which keeps its node (the admit went through), and fails naming that node and its
    machine, which stay and bill. Before, the failure named only the InvalidRequest: the kept node
    was named nowhere."""
    from fleet.cluster import UNPROVEN_TAINT
    from fleet.errors import InvalidRequest
    from sim.cluster import SimCluster
    from sim.provider import SimProvider

    admitting, go_on = threading.Event(), threading.Event()
    set_taints, create_machine = SimCluster.set_taints, SimProvider.create_machine
    keys: list[str] = []

    def admit_held(self, name: str, add: list[str] = (), remove: list[str] = ()):
        if UNPROVEN_TAINT in remove and not admitting.is_set():  # the first join's admit waits
            admitting.set()
            go_on.wait(60)
        return set_taints(self, name, add, remove)

    def second_refused(self, spec, idempotency_key: str, user_data: str = ""):
        keys.append(idempotency_key)
        if idempotency_key != keys[0]:  # the second join's machine: refused once the first admits
            admitting.wait(60)
            raise InvalidRequest("test: the spec is wrong", provider=self.name)
        return create_machine(self, spec, idempotency_key, user_data)

    monkeypatch.setattr(SimCluster, "set_taints", admit_held)
    monkeypatch.setattr(SimProvider, "create_machine", second_refused)
    handle = await cap.request({"constraints": {"sites": [cap.site("cheap")]}, "count": 2})
    try:
        await wait_for(admitting.is_set, timeout=60)

        async def join_cancelled() -> bool:  # the request stopped the admitting join
            history = await handle.fetch_history()
            return any(e.event_type == EventType.EVENT_TYPE_REQUEST_CANCEL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
                       for e in history.events)

        await eventually(join_cancelled, timeout=60)
    finally:
        go_on.set()
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(handle.result(), 60)
    (machine,) = live(cap)
    failure = caught.value.cause
    assert isinstance(failure, ApplicationError) and failure.type == "InvalidRequest", failure
    assert f"{machine['name']} (machine {machine['id']}) joined as the joins in flight were stopped and stay" \
        in failure.message, failure.message
    assert (await handle.query("progress", result_type=CapacityProgress)).joined == 1


@pytest.fixture(params=JOB_MODES)
async def cap_jobs(request, temporal_env: WorkflowEnvironment, tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[CapStack]:
    """``cap`` whose worker runs an activation's jobs in sets or as one batch (``jobs_applied``)."""
    jobs_applied(request.param, monkeypatch)
    address = temporal_env.client.service_client.config.target_host
    async for stack in open_stack(temporal_env.client, address, tmp_path):
        yield stack


@pytest.mark.parametrize("first", ["resolve_child_workflow_execution", "cancel_workflow"])
async def test_a_temporal_cancel_in_the_task_a_join_ended_in_keeps_its_node(
        cap_jobs: CapStack, monkeypatch: pytest.MonkeyPatch, request, first: str) -> None:
    """The request's join ends with its node joined and Temporal's cancel of the request comes in
    the same workflow task (either first): the request counts the node joined, not stopped. Before,
    with the cancel first, the request cancelled a join that had ended and took it for one that
    deleted its machine: "machine deleted" said of a node that joined and bills, named nowhere."""
    from fleet.cluster import UNPROVEN_TAINT
    from sim.cluster import SimCluster

    cap = cap_jobs
    admitting, go_on = threading.Event(), threading.Event()
    set_taints = SimCluster.set_taints

    def admit_held(self, name: str, add: list[str] = (), remove: list[str] = ()):
        if UNPROVEN_TAINT in remove and first == "cancel_workflow":  # the join ends once the cancel came
            admitting.set()
            go_on.wait(60)
        return set_taints(self, name, add, remove)

    monkeypatch.setattr(SimCluster, "set_taints", admit_held)
    handle = await cap.request({"constraints": {"sites": [cap.site("cheap")]}}, name="one-task")
    then = "cancel_workflow" if first == "resolve_child_workflow_execution" else "resolve_child_workflow_execution"
    held_one = in_one_task(monkeypatch, handle.id, first, then)
    try:
        if first == "cancel_workflow":  # the cancel lands while the join admits; the join ends after it
            await wait_for(admitting.is_set, timeout=60)
            await handle.cancel()
            await eventually(lambda: asyncio.to_thread(held_one.wait, 0.1), timeout=60)
        else:  # the join ended; the cancel lands before the request took it
            await eventually(lambda: asyncio.to_thread(held_one.wait, 0.1), timeout=60)
            await handle.cancel()
    finally:
        go_on.set()
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(handle.result(), 60)
    assert isinstance(caught.value.cause, CancelledError)
    assert await one_task_had_both(handle)
    (machine,) = live(cap)
    progress = await handle.query("progress", result_type=CapacityProgress)
    assert progress.released == [], "the join was not stopped: it had ended"
    assert progress.joined == 1 and progress.attempts[-1].outcome == "joined", progress
    assert progress.attempts[-1].message == machine["name"], progress
    assert cap.cluster.get_node(machine["name"]) is not None
    if request.node.callspec.params["cap_jobs"] == "jobs-as-one-batch" and first == "cancel_workflow":
        await replay_and_record(handle, "capacity_cancelled_in_the_task_a_join_ended")


# -- a request that gave up on failed joins ---------------------------------------------------
#: One site, so every join of a request is at the same offer. A 2-GPU machine at $2.00/GPU-h.
GAVE_UP_SITE = Site(name="s1", provider="lambda", account="a1", region="r", gpu="H100", gpus_per_machine=2,
                    instance_type="t", price_per_gpu_hour=2.0, max_nodes=8)


@workflow.defn(name="NodeJoin", sandboxed=False)
class JoinStandIn:
    """A request's joins: the first fails its smoke test at once (one failure too many with
    ``max_other_failures: 0``); the others boot until told ``booted``, then deliver a node."""

    #: The first join's failure: its type and message.
    FIRST_FAILS = ("SmokeTestFailed", "smoke test failed")

    def __init__(self) -> None:
        self._booted = False

    @workflow.signal
    def booted(self) -> None:
        self._booted = True

    @workflow.run
    async def run(self, raw: dict) -> NodeJoinResult:
        join_id = workflow.info().workflow_id
        if join_id.endswith("-1"):
            kind, message = self.FIRST_FAILS
            raise ApplicationError(message, type=kind, non_retryable=True)
        await workflow.wait_condition(lambda: self._booted)
        return NodeJoinResult(nodes=[JoinedNode(node_name=f"node-{join_id[-1]}", machine_id=f"m-{join_id[-1]}",
                                                site="s1", provider="lambda", gpus=2)])


@activity.defn(name="get_catalog")
async def one_site_catalog(input: GetCatalogInput) -> Catalog:
    return Catalog(offers=[GAVE_UP_SITE.offer("lambda")], sites=[GAVE_UP_SITE])


@pytest.fixture
async def gave_up(temporal_env: WorkflowEnvironment) -> AsyncIterator[tuple[WorkflowHandle, WorkflowHandle]]:
    """A request for two nodes that gave up after its first join failed, and its second join, still
    in flight (booting until told)."""
    from workflows.capacity import AcquireCapacity

    client, uid = temporal_env.client, uuid.uuid4().hex[:6]
    queue = f"capacity-gave-up-{uid}"
    async with Worker(client, task_queue=queue, workflows=[AcquireCapacity, JoinStandIn],
                      activities=[one_site_catalog], workflow_runner=UnsandboxedWorkflowRunner()):
        handle = await client.start_workflow(
            "AcquireCapacity", {"constraints": {"sites": ["s1"]}, "count": 2, "concurrency": 2,
                                "max_other_failures": 0},
            id=f"capacity/gave-up-{uid}", task_queue=queue)

        async def failed_once() -> bool:
            progress = await handle.query("progress", result_type=CapacityProgress)
            return any(a.outcome == "SmokeTestFailed" for a in progress.attempts)

        await eventually(failed_once, timeout=20, interval=0.05)
        yield handle, client.get_workflow_handle(f"join/s1/gave-up-{uid}-2")


async def test_a_request_that_gave_up_on_failed_joins_still_takes_a_cancel(gave_up) -> None:
    """The cancel stops the join still in flight (it deletes its machine) and answers; before, it
    waited for that join to deliver its node, and the node was kept."""
    handle, join = gave_up
    cancel = await handle.start_update("cancel", "not needed", wait_for_stage=WorkflowUpdateStage.ACCEPTED,
                                       result_type=CapacityProgress)
    answered, _ = await asyncio.wait({asyncio.ensure_future(cancel.result())}, timeout=20)
    if not answered:
        await join.signal("booted")  # the run ends (the join delivers its node) before the test does
    assert answered, "the cancel is answered while the join is in flight"
    stopped = answered.pop().result()
    assert stopped.released == [f"{join.id} (s1/t): machine deleted"], stopped
    assert (await join.describe()).status == WorkflowExecutionStatus.CANCELED
    result = CapacityResult.model_validate(await handle.result())
    assert result.cancelled == "not needed" and result.nodes == [] and result.cost_per_hour == 0, result
    await replay_and_record(handle, "capacity_cancelled_after_giving_up")


async def test_a_node_that_joins_after_the_request_gave_up_is_counted_in_its_cost(gave_up) -> None:
    """Before, the request said "joining" until the end and left that node out of its cost."""
    handle, join = gave_up
    progress = await handle.query("progress", result_type=CapacityProgress)
    assert progress.step == "finishing the joins in flight" and progress.joins == [join.id], progress
    await join.signal("booted")
    result = CapacityResult.model_validate(await handle.result())
    assert [n.node_name for n in result.nodes] == ["node-2"] and not result.complete
    assert result.cost_per_hour == 4.0, "its 2 GPUs at $2.00/GPU-h"
    assert result.why[0] == "1 of 2 not joined: too many failed joins"
    progress = await handle.query("progress", result_type=CapacityProgress)
    assert progress.joined == 1 and progress.in_flight == [] and progress.joins == [], progress
    await replay_and_record(handle, "capacity_gave_up_join_in_flight")


@workflow.defn(name="NodeJoin", sandboxed=False)
class FailingJoin:
    """Every join fails its smoke test at once, at length."""

    @workflow.run
    async def run(self, raw: dict) -> NodeJoinResult:
        raise ApplicationError("smoke test failed: " + "x" * 3000, type="SmokeTestFailed", non_retryable=True)


async def test_a_request_keeps_its_newest_attempts_however_many_joins_failed(temporal_env) -> None:
    """A request keeps the joins it tried in its progress, its result and the carry it continues as
    new with, each bounded at 2 MiB; it may try for days. Before, it kept every one, whole."""
    from fleet.messages.capacity import ATTEMPT_MESSAGE_CHARS, ATTEMPTS_KEPT
    from workflows.capacity import AcquireCapacity

    client, uid = temporal_env.client, uuid.uuid4().hex[:6]
    queue = f"capacity-attempts-{uid}"
    async with Worker(client, task_queue=queue, workflows=[AcquireCapacity, FailingJoin],
                      activities=[one_site_catalog], workflow_runner=UnsandboxedWorkflowRunner()):
        handle = await client.start_workflow(
            "AcquireCapacity", {"constraints": {"sites": ["s1"]}, "max_other_failures": ATTEMPTS_KEPT + 10,
                                "unavailable_ttl_seconds": 0},
            id=f"capacity/attempts-{uid}", task_queue=queue)
        result = CapacityResult.model_validate(await asyncio.wait_for(handle.result(), 120))
        progress = await handle.query("progress", result_type=CapacityProgress)
    assert result.why[0] == "1 of 1 not joined: too many failed joins", result.why
    assert len(result.attempts) == ATTEMPTS_KEPT and progress.attempts == result.attempts
    assert all(a.outcome == "SmokeTestFailed" and len(a.message) == ATTEMPT_MESSAGE_CHARS for a in result.attempts)
    assert await task_failures(handle) == 0


# -- a store away for minutes ends no request ------------------------------------------------
@workflow.defn(name="NodeJoin", sandboxed=False)
class OverQuotaJoin(JoinStandIn):
    """The same, the first join refused over quota."""

    FIRST_FAILS = ("OverQuota", "quota reached")

    @workflow.run
    async def run(self, raw: dict) -> NodeJoinResult:
        return await super().run(raw)


@asynccontextmanager
async def stand_in_request(temporal_env: WorkflowEnvironment, name: str, request: dict, joins: type,
                           activities: list) -> AsyncIterator[WorkflowHandle]:
    """A request ``capacity/<name>-<uid>`` on a worker of its own: its joins ``joins``, its
    activities ``activities``."""
    from workflows.capacity import AcquireCapacity

    client, uid = temporal_env.client, uuid.uuid4().hex[:6]
    queue = f"capacity-{name}-{uid}"
    async with Worker(client, task_queue=queue, workflows=[AcquireCapacity, joins], activities=activities,
                      workflow_runner=UnsandboxedWorkflowRunner()):
        yield await client.start_workflow("AcquireCapacity", request, id=f"capacity/{name}-{uid}", task_queue=queue)


#: What a store's write raises once its retries are spent: the API server away (a control-plane
#: upgrade), or a 403 after an RBAC mistake, which no retry helps (so the test need not wait out
#: STORE_RETRY's three minutes).
def store_away_error() -> ApplicationError:
    return ApplicationError("the API server did not answer", type="ClusterUnavailable", non_retryable=True)


async def test_an_account_report_that_fails_ends_no_request_nor_its_joins_in_flight(temporal_env) -> None:
    """A join is refused over quota while another is in flight, and the account's store (or its
    ProviderAccount entity) cannot be told: the request goes on, says so in that join's attempt,
    and the join in flight delivers its node. Before, the report's failure failed the request, and
    its parent-close policy cancelled the join in flight: a machine about to join was deleted."""
    reports: list[str] = []

    @activity.defn(name="report_account")
    async def store_away(input) -> None:
        reports.append(input["kind"] if isinstance(input, dict) else input.kind)
        raise store_away_error()

    request = {"constraints": {"sites": ["s1"]}, "count": 2, "concurrency": 2, "deadline_seconds": 15}
    async with stand_in_request(temporal_env, "report-fails", request, OverQuotaJoin,
                                [one_site_catalog, store_away]) as handle:
        join = temporal_env.client.get_workflow_handle(f"join/s1/{handle.id.removeprefix('capacity/')}-2")

        async def report_failed_and_taken() -> bool:
            if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
                return True  # ended by it: the assertion below says so
            progress = await handle.query("progress", result_type=CapacityProgress)
            return any(a.outcome == "OverQuota" and "not told" in a.message for a in progress.attempts)

        await eventually(report_failed_and_taken, timeout=20, interval=0.05)
        assert reports == ["OverQuota"]
        status = (await handle.describe()).status
        assert status == WorkflowExecutionStatus.RUNNING, f"the request goes on, not {status.name}"
        assert (await join.describe()).status == WorkflowExecutionStatus.RUNNING, "its join in flight too"
        progress = await handle.query("progress", result_type=CapacityProgress)
        (refused,) = [a for a in progress.attempts if a.outcome == "OverQuota"]
        assert refused.message.endswith(
            "quota reached; account a1 not told (ClusterUnavailable: the API server did not answer)"), refused
        assert progress.joins == [join.id], progress
        text = await details(handle)  # the UI's current details
        assert "account a1 not told (ClusterUnavailable" in text, text

        await join.signal("booted")
        result = CapacityResult.model_validate(await handle.result())
    assert [n.node_name for n in result.nodes] == ["node-2"], result
    assert result.why[0] == "1 of 2 not joined by the deadline", result.why
    assert await task_failures(handle) == 0
    await replay_and_record(handle, "capacity_account_report_failed")


def flaky_catalog(failures: int):
    """``get_catalog`` whose first ``failures`` reads fail as the store away would, then answer."""
    calls: list[float] = []

    @activity.defn(name="get_catalog")
    async def get_catalog(input: GetCatalogInput) -> Catalog:
        calls.append(asyncio.get_running_loop().time())
        if len(calls) <= failures:
            raise store_away_error()
        return await one_site_catalog(input)

    return get_catalog, calls


async def test_a_catalog_read_that_fails_is_shown_and_tried_again(temporal_env) -> None:
    """The catalog (offers, each account's state from its store) cannot be read: the request says
    so and when it tries again, then reads it and buys. Before, the failed read failed the request."""
    get_catalog, calls = flaky_catalog(1)
    # Its first join fails its smoke test at once: the offer is out of the ranking for a while.
    request = {"constraints": {"sites": ["s1"]}, "deadline_seconds": 600}
    async with stand_in_request(temporal_env, "catalog-fails", request, JoinStandIn, [get_catalog]) as handle:

        async def shown() -> bool:
            if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
                return True  # ended by it: the assertion below says so
            return "could not read the catalog" in await details(handle)

        await eventually(shown, timeout=20, interval=0.05)
        status = (await handle.describe()).status
        assert status == WorkflowExecutionStatus.RUNNING, f"the request goes on, not {status.name}"
        text = await details(handle)
        assert text.startswith("**reading the catalog**"), text
        assert re.search(r"could not read the catalog \(ClusterUnavailable: the API server did not answer\); "
                         r"next try at \d\d:\d\d:\d\d UTC", text), text

        async def tried_a_join() -> bool:
            progress = await handle.query("progress", result_type=CapacityProgress)
            return bool(progress.attempts)

        await eventually(tried_a_join, timeout=20, interval=0.1)
        assert len(calls) == 2 and calls[1] - calls[0] >= 4, "read again after the pause (5 s)"
        assert "could not read the catalog" not in await details(handle)
        await handle.execute_update("cancel", "seen", result_type=CapacityProgress)
        result = CapacityResult.model_validate(await handle.result())
    assert result.cancelled == "seen"
    assert await task_failures(handle) == 0
    await replay_and_record(handle, "capacity_catalog_read_failed_then_read")


async def test_a_catalog_never_read_by_the_deadline_ends_the_request_saying_so(temporal_env) -> None:
    """Nothing was bought, and the request's result says why, at its deadline (not failed on the
    first read, nor reading on past it)."""
    get_catalog, calls = flaky_catalog(1000)
    request = {"constraints": {"sites": ["s1"]}, "deadline_seconds": 8}
    async with stand_in_request(temporal_env, "catalog-away", request, JoinStandIn, [get_catalog]) as handle:
        result = CapacityResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert result.nodes == [] and not result.complete
    assert result.why == ["1 of 1 not joined by the deadline", result.why[1],
                          "could not read the catalog: ClusterUnavailable: the API server did not answer"], result.why
    assert result.why[1].startswith("the deadline passed at "), result.why
    assert 2 <= len(calls) <= 3, "5 s, then the pause cut at the deadline: no read past it"
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED


@workflow.defn(name="NodeJoin", sandboxed=False)
class BadCredentialsJoin(JoinStandIn):
    """The same, the first join refused: the account's credentials are revoked."""

    FIRST_FAILS = ("BadCredentials", "the API key was revoked")

    @workflow.run
    async def run(self, raw: dict) -> NodeJoinResult:
        return await super().run(raw)


async def test_an_account_revoked_and_not_told_is_not_called_again(temporal_env) -> None:
    """A join finds the account's credentials revoked, and its store cannot be told: the store
    (each catalog read) still says the account is healthy. The request keeps it revoked over its
    reads and starts no join there again, only waits (rule 6: no more calls to a revoked
    account). Before, the read after its backoff took the store's word, and the next join called
    the revoked account again."""
    reads: list[GetCatalogInput] = []

    @activity.defn(name="get_catalog")
    async def get_catalog(input: GetCatalogInput) -> Catalog:
        reads.append(input)
        return await one_site_catalog(input)

    @activity.defn(name="report_account")
    async def store_away(input) -> None:
        raise store_away_error()

    request = {"constraints": {"sites": ["s1"]}, "deadline_seconds": 60, "backoff_seconds": 1}
    async with stand_in_request(temporal_env, "revoked-not-told", request, BadCredentialsJoin,
                                [get_catalog, store_away]) as handle:

        async def read_twice_since_or_joining() -> bool:
            progress = await handle.query("progress", result_type=CapacityProgress)
            # The first join (``-1``) may still be listed as it fails: a join after it is the one asked of.
            return len(reads) >= 3 or any(not join.endswith("-1") for join in progress.joins)

        await eventually(read_twice_since_or_joining, timeout=30, interval=0.1)
        progress = await handle.query("progress", result_type=CapacityProgress)
        assert progress.joins == [], f"no join at the revoked account again: {progress.joins}"
        assert [a.outcome for a in progress.attempts] == ["BadCredentials"], progress.attempts
        assert "account a1 not told" in progress.attempts[0].message, progress.attempts
        assert progress.step == "waiting for capacity" and any("a1" in w for w in progress.waiting_for), progress
        await handle.execute_update("cancel", "seen", result_type=CapacityProgress)
        result = CapacityResult.model_validate(await handle.result())
    assert result.nodes == [] and result.cancelled == "seen", result
    assert await task_failures(handle) == 0
    await replay_and_record(handle, "capacity_account_revoked_not_told_stays_revoked")


@pytest.mark.integration  # a dev server with a low continue-as-new threshold
async def test_a_catalog_read_failing_on_continues_as_new_and_still_checks_the_request() -> None:
    """The catalog cannot be read, and the server suggests continuing as new (a store away for days
    of a 30-day deadline: each pause adds events, past Temporal's history limit otherwise): the
    request continues as new between reads, and the run it continues as still checks the request
    at its first read (a count more than the site's max_nodes is refused, naming the field).
    Before, the retry loop never continued as new."""
    from tests.can_server import runs, server_suggesting_continue_as_new

    get_catalog, calls = flaky_catalog(1)
    request = {"constraints": {"sites": ["s1"]}, "count": 9, "deadline_seconds": 600}
    async with server_suggesting_continue_as_new(10) as env:
        async with stand_in_request(env, "catalog-can", request, JoinStandIn, [get_catalog]) as handle:
            cause = await asyncio.wait_for(invalid_input(handle, "count"), 60)
            assert "9 nodes is more than" in cause.message, cause.message
            assert len(calls) == 2, calls
            assert await runs(env.client, handle.id) == 2, "continued as new between the reads"
            await replay_and_record(handle, "capacity_catalog_read_failed_continued_as_new")
            await replay_and_record(env.client.get_workflow_handle(handle.id),
                                    "capacity_catalog_read_failed_continued_as_new_then_checked")


# -- the command line --------------------------------------------------------------------------
def gpufleet(cap: CapStack, *args: str) -> subprocess.Popen:
    env = {**os.environ, **cap.settings.env(), "COLUMNS": "250"}
    return subprocess.Popen([sys.executable, "-m", "cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


async def read_until(proc: subprocess.Popen, words: str, timeout: float = 30) -> str:
    """The command's output up to the first line containing ``words``."""
    seen: list[str] = []

    def read() -> str:
        for line in proc.stdout:
            seen.append(line)
            if words in line:
                return "".join(seen)
        raise AssertionError(f"{words!r} never printed:\n" + "".join(seen))

    reading = asyncio.ensure_future(asyncio.to_thread(read))
    done, _ = await asyncio.wait({reading}, timeout=timeout)
    if not done:
        proc.kill()  # ends the read, which then says what was printed
    return await reading


async def test_ctrl_c_on_gpufleet_capacity_cancels_and_nothing_is_bought_afterwards(cap: CapStack) -> None:
    cap.world.set_site(cap.site("cheap"), boot_seconds=60)
    proc = gpufleet(cap, "capacity", "--site", cap.site("cheap"), "--count", "2", "--request", f"int-{cap.uid}")
    try:
        await read_until(proc, "joining at", timeout=30)  # piped: one plain line per change
        await wait_for(lambda: len(live(cap)) == 2, timeout=20)
        proc.send_signal(signal.SIGINT)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert f"cancelled capacity/int-{cap.uid}: 2 joins stopped, their machines deleted" in out, out
    assert "Traceback" not in out, out
    assert live(cap) == []
    status = (await cap.client.get_workflow_handle(f"capacity/int-{cap.uid}").describe()).status
    assert status == WorkflowExecutionStatus.COMPLETED
    await settled(cap)
    assert len(bought(cap)) == 2 and live(cap) == [], "a Ctrl-C'd request buys nothing afterwards"


async def test_ctrl_c_while_the_start_call_returns_cancels_the_request_it_started(cap: CapStack) -> None:
    """The server has started the request; the Ctrl-C lands before the command heard so."""
    cap.world.set_site(cap.site("cheap"), boot_seconds=60)
    env = {**os.environ, **cap.settings.env(), "COLUMNS": "250"}
    proc = subprocess.Popen([sys.executable, "-m", "tests.interrupt_at_start", "acquire_capacity", "capacity",
                             "--site", cap.site("cheap"), "--count", "2", "--request", f"int-{cap.uid}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = await asyncio.to_thread(proc.communicate, timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    assert f"cancelled capacity/int-{cap.uid}" in out, out
    handle = cap.client.get_workflow_handle(f"capacity/int-{cap.uid}")
    assert (await handle.describe()).status != WorkflowExecutionStatus.RUNNING, "the request stopped"
    await settled(cap)
    assert live(cap) == [], "every machine it bought is deleted, and it buys nothing afterwards"


async def test_a_wait_on_a_revoked_account_says_why_and_until_when(cap: CapStack) -> None:
    """The issue's case: `gpufleet capacity --gpu H100 --geo eu` while the only eu on-demand
    account is revoked. Piped, it says what it waits for and when it gives up; Ctrl-C stops it,
    and fixing the account later buys nothing for it."""
    b = cap.account("b")
    cap.world.set_credentials_valid(b, False)
    proc = gpufleet(cap, "capacity", "--gpu", "H100", "--geo", "eu", "--on-demand", "--request", f"rev-{cap.uid}")
    try:
        out = await read_until(proc, "waiting for:", timeout=40)
        proc.send_signal(signal.SIGINT)
        rest, _ = await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    line = out.splitlines()[-1]
    assert "waiting for capacity" in line and "gives up at" in line and "looks again at" in line, line
    assert f"account {b} credentials revoked" in line, line
    assert f"gpufleet accounts credentials-rotated {b}" in line, line
    assert proc.returncode == 130 and f"cancelled capacity/rev-{cap.uid}: no join was in flight" in rest, rest
    # The workflow's own details say the same (the UI's current details).
    handle = cap.client.get_workflow_handle(f"capacity/rev-{cap.uid}")
    # The fix arrives after the cancel: nothing is bought for a request nobody waits for.
    cap.world.set_credentials_valid(b, True)
    await FleetClient(cap.settings, cap.client).credentials_rotated(b)
    await settled(cap)
    assert bought(cap) == []
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED


async def test_the_waiting_request_shows_why_in_its_details(cap: CapStack) -> None:
    cap.world.set_site(cap.site("cheap"), quota=0)
    handle = await cap.request({"constraints": {"sites": [cap.site("cheap")]}, "backoff_seconds": 60})
    await cap.listed(f'WorkflowId = "{handle.id}" AND FleetState = "waiting-for-capacity"')
    progress = await handle.query("progress", result_type=CapacityProgress)
    (why,) = progress.waiting_for
    assert "over quota" in why and f"gpufleet accounts quota-raised {cap.account('a')}" in why, why
    assert progress.deadline is not None and progress.wait_until is not None
    metadata = await handle.query("__temporal_workflow_metadata")  # the UI reads its details here
    text = metadata.current_details if hasattr(metadata, "current_details") else metadata["currentDetails"]
    assert "waiting for:" in text and "over quota" in text and "gives up at" in text, text
    # The offer is listed once, under what it waits for (it was listed again as "- not <offer>: ...").
    offer = why.split(": ", 1)[0]
    listed = [line for line in text.splitlines() if line.startswith((f"- {offer}:", f"- not {offer}:"))]
    assert listed == [f"- {why}"], text
    await FleetClient(cap.settings, cap.client).cancel_capacity(handle.id)
