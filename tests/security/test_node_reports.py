"""Issue 35: a node is hostile. What its agent returns on its own queue (``watch_node``) is
untrusted input to the Node entity: a malformed answer is a bad report from that node
(logged, counted, shown), never a failed workflow task, and the watch goes on; a few in a row
quarantine the node (cordoned, handed to the repair ladder).

The node joins the simulated fleet as usual; its agent is the real one except ``watch_node``,
which answers with what the test forges while something is queued (else honestly).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.request
from datetime import timedelta
from typing import Any, AsyncIterator, Callable

import pytest
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from temporalio import activity
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import RespondActivityTaskCompletedRequest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import RawValue
from temporalio.worker import Worker

import fleet.naming
import workers.node_agent
from activities.node_agent import NodeAgentActivities
from fleet.messages.join import JoinedNode
from fleet.messages.repair import MAX_NODE_GPUS, NodeStatus, NodeWatchInput
from fleet.naming import node_queue
from sim.cluster import SimCluster
from tests.bad_input_helpers import task_failures
from tests.can_server import run_chain
from tests.plugins.stack import session_temporal_env
from tests.conftest import Stack
from tests.details_helpers import decided
from tests.repair_helpers import (
    REPAIR, eventually, exists, join_node, node_status, repair_fleet, repair_handle, running_stack, spot,
)
from tests.replay import replay_and_record
from tests.test_bad_input_property import draw
from workers.metrics import MetricsServer
from workflows.node import MAX_BAD_REPORTS_IN_A_ROW

#: A forged answer: one payload (returned as the activity's result), or several (``Payloads``,
#: which no activity can return: the agent's own client completes the task with them).
Forgery = Callable[[NodeWatchInput], "Payload | Payloads"]


def as_json(value: Any) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(value, allow_nan=True).encode())


class HostileWatch:
    """The node's ``watch_node``, turned: a forgery answers the newest watch in flight (built from
    the entity's own input), else the real agent answers.

    The newest, not the oldest: a watch the entity replaced (cancelled after a reboot) may still
    run in the agent until its cancellation arrives with a heartbeat, and an answer it gives is
    discarded by the server."""

    def __init__(self) -> None:
        #: Every watch the entity scheduled, in order: a new one after an answer = the watch lives.
        self.inputs: list[NodeWatchInput] = []
        self._newest: asyncio.Future[Forgery] | None = None
        self._queued: Forgery | None = None  # for the next watch, when none waits

    def build_agent(self, client, node_name, gpus, executor, watch=None) -> Worker:
        agent = NodeAgentActivities(node_name, gpus, watch)

        @activity.defn(name="watch_node")
        async def watch_node(input: NodeWatchInput) -> Any:
            self.inputs.append(input)
            mine: asyncio.Future[Forgery] = asyncio.get_running_loop().create_future()
            self._newest = mine
            if self._queued is not None:
                mine.set_result(self._queued)
                self._queued = None
            honest = asyncio.ensure_future(agent.watch_node(input))
            try:
                await asyncio.wait({honest, mine}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                if mine.done():  # taken, never answered (its agent stopped): for the next watch
                    self._queued = mine.result()
                raise
            finally:
                honest.cancel()
                if self._newest is mine:
                    self._newest = None
            if mine.done():
                forged = mine.result()(input)
                if isinstance(forged, Payloads):  # as a hostile node sends it: a raw completion
                    await client.workflow_service.respond_activity_task_completed(RespondActivityTaskCompletedRequest(
                        namespace=client.namespace, task_token=activity.info().task_token, result=forged))
                    activity.raise_complete_async()
                return RawValue(forged)
            return honest.result()

        others = [a for a in agent.all() if getattr(a, "__name__", "") != "watch_node"]
        return Worker(client, task_queue=node_queue(node_name), activities=[*others, watch_node],
                      activity_executor=executor, max_concurrent_activities=5)

    async def answer(self, forgery: Forgery) -> None:
        """Forge the answer to the newest watch in flight (or the next one); return once the entity
        took it and scheduled the watch after the one that answered. Not merely the next watch: the
        honest agent may have answered the one in flight first (the forged digest differs from what
        the node really has), and the watch that then takes the queued forgery is not yet answered
        as it starts."""
        answered_at: list[int] = []

        def forge(input: NodeWatchInput) -> Payload | Payloads:
            answered_at.append(len(self.inputs))  # the watches so far, the one answering among them
            return forgery(input)

        if self._newest is not None and not self._newest.done():
            self._newest.set_result(forge)
        else:
            self._queued = forge
        await eventually(_async(lambda: bool(answered_at) and len(self.inputs) > answered_at[0]),
                         timeout=15, interval=0.02)


def _async(check: Callable[[], bool]):
    async def predicate() -> bool:
        return check()
    return predicate


def quiet(input: NodeWatchInput) -> Payload:
    """A well-formed answer: the state the entity already has (nothing to act on)."""
    return as_json({"node_name": input.node_name, "seq": input.seq, "digest": input.digest, "boot_id": "b"})


def well_formed(input: NodeWatchInput) -> dict[str, Any]:
    return {"node_name": input.node_name, "seq": input.seq + 1, "digest": "d" * 64, "boot_id": "b" * 36,
            "gpus": [{"index": 0, "uuid": "GPU-0", "name": "H100", "memory_gb": 80, "temperature_c": 40,
                      "ecc_uncorrected": 0, "xid_events": [{"xid": 13, "at": "2026-01-01T00:00:00Z",
                                                            "message": "m"}]}],
            "reclaim_at": None, "observed_at": None}


def replacing(path: tuple, value: Any) -> Forgery:
    """A well-formed answer with one field (``path`` into it) replaced by ``value``."""
    def forge(input: NodeWatchInput) -> Payload:
        answer = well_formed(input)
        *parents, last = path
        holder = answer
        for key in parents:
            holder = holder[key]
        holder[last] = value
        return as_json(answer)
    return forge


def raw_bytes(data: bytes, encoding: bytes = b"json/plain") -> Forgery:
    return lambda _input: Payload(metadata={"encoding": encoding}, data=data)


#: The attacks as found (issue 35), and a few more a decoder must survive.
KNOWN_ATTACKS: list[tuple[str, Forgery]] = [
    ("1000-character digest", replacing(("digest",), "x" * 1000)),
    ("reclaim_at NaN", replacing(("reclaim_at",), math.nan)),
    ("seq of the wrong type", replacing(("seq",), {"not": "a number"})),
    ("gpus of the wrong type", replacing(("gpus",), "all fine")),
    ("an XID at year 1", replacing(("gpus", 0, "xid_events", 0, "at"), "0001-01-01T00:00:00")),
    ("not JSON", raw_bytes(b"{not json")),
    ("an encoding nobody speaks", raw_bytes(b"\x00\x01", b"binary/hostile")),
    ("null", lambda _input: as_json(None)),
]

#: Fields of a watch result, each of which a hostile value below makes invalid.
FIELDS = [("node_name",), ("seq",), ("digest",), ("boot_id",), ("gpus",), ("reclaim_at",), ("observed_at",),
          ("gpus", 0, "index"), ("gpus", 0, "uuid"), ("gpus", 0, "name"), ("gpus", 0, "memory_gb"),
          ("gpus", 0, "temperature_c"), ("gpus", 0, "ecc_uncorrected"), ("gpus", 0, "xid_events"),
          ("gpus", 0, "xid_events", 0, "xid"), ("gpus", 0, "xid_events", 0, "at"),
          ("gpus", 0, "xid_events", 0, "message")]


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


HOSTILE_VALUES = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.integers(min_value=10_000, max_value=70_000).map(lambda n: "x" * n),  # huge strings
    st.sampled_from([{"wrong": "type"}, [{"wrong": "type"}], [[1, 2]]]),  # wrong types for every field
    st.integers(min_value=40, max_value=200).map(nested),  # deep nesting
)
ATTACKS = st.tuples(st.sampled_from(FIELDS), HOSTILE_VALUES)
#: Drawn attacks per run (derandomized): each costs two watch round trips, well under a second.
EXAMPLES = 20


#: Where a "small-history" server (``hostile``) suggests continue-as-new: at 600 KB of history, not
#: Temporal's 4 MB, so the largest answers a watch may give (``RESULT_LIMITS``) fill a run in about
#: ten, not sixty (four minutes a test).
SMALL_HISTORY_SUGGESTION = 600_000


@pytest.fixture(scope="module")
async def small_history_env() -> AsyncIterator:
    async with session_temporal_env("--dynamic-config-value",
                                    f"limit.historySize.suggestContinueAsNew={SMALL_HISTORY_SUGGESTION}") as env:
        yield env


@pytest.fixture
async def hostile(temporal_env, tmp_path, monkeypatch, request) -> AsyncIterator[tuple[Stack, JoinedNode, HostileWatch]]:
    """The node at site-a, an on-demand site; at a spot one where a test asks
    (``@pytest.mark.parametrize("hostile", ["spot"], indirect=True)``)."""
    async for found in hostile_on(temporal_env.client, tmp_path, monkeypatch,
                                  spot_site=getattr(request, "param", None) == "spot"):
        yield found


@pytest.fixture
async def hostile_small_history(small_history_env, tmp_path, monkeypatch) -> AsyncIterator:
    """``hostile`` on the module's server that suggests continue-as-new early."""
    async for found in hostile_on(small_history_env.client, tmp_path, monkeypatch):
        yield found


async def hostile_on(client: Client, tmp_path, monkeypatch, spot_site: bool = False) -> AsyncIterator:
    watch = HostileWatch()
    monkeypatch.setattr(workers.node_agent, "build_agent", watch.build_agent)
    # Its answers come at once and most change nothing, some as large as a report may be: the entity
    # paces such a node's watches by their count and by their bytes (tests/security/test_watch_pacing.py,
    # test_watch_bytes.py), here by a hundredth of a second and not by bytes: these tests are about what
    # the answers make the entity do and carry.
    fleet = repair_fleet(timeouts={**REPAIR["timeouts"], "watch_pace_seconds": 0.01, "watch_pace_max_seconds": 0.01,
                                   "watch_bytes_burst_kib": 1_048_576})
    if spot_site:
        fleet = spot(fleet)
    async for stack in running_stack(client, tmp_path, fleet):
        node = await join_node(stack)
        # The entity is up and its watch (after the join's state) waits at the node.
        await eventually(_async(lambda: bool(watch.inputs)), timeout=30)
        yield stack, node, watch


def entity(stack: Stack, node: JoinedNode) -> WorkflowHandle:
    return stack.client.get_workflow_handle(f"node/{node.node_name}")


async def status(stack: Stack, node: JoinedNode) -> NodeStatus:
    found = await node_status(stack, node.node_name)
    assert found is not None
    return found


async def details(handle: WorkflowHandle) -> str:
    metadata = await handle.query("__temporal_workflow_metadata")
    return metadata.current_details if hasattr(metadata, "current_details") else metadata["currentDetails"]


async def test_malformed_watch_results_fail_no_task_and_the_watch_lives_on(hostile) -> None:
    """Property: for the attacks as found and drawn ones (NaN, infinities, huge strings, wrong
    types, deep nesting, in any field of the result), each is a counted bad report, no workflow
    task fails, the entity schedules the next watch, and afterwards a real GPU fault is still
    seen and repaired."""
    stack, node, watch = hostile
    handle = entity(stack, node)
    attacks = KNOWN_ATTACKS + [(f"{path} = {str(value)[:40]}", replacing(path, value))
                               for path, value in draw(ATTACKS, EXAMPLES)]
    for number, (what, forgery) in enumerate(attacks, start=1):
        await watch.answer(forgery)
        now = await status(stack, node)
        assert now.bad_reports == number, f"{what}: not counted as a bad report ({now.log[-1:]})"
        if number == 1:
            assert f"bad report from {node.node_name}" in await details(handle)
        await watch.answer(quiet)  # a good one between: no quarantine, the count in a row restarts
        assert (await status(stack, node)).bad_reports_in_a_row == 0, what

    assert await task_failures(handle) == 0
    final = await status(stack, node)
    assert final.bad_reports == len(attacks) and final.loop_restarts == 0
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
    assert not await exists(repair_handle(stack, node.node_name, 0)), "no quarantine: never 3 in a row"

    # The watch is alive: a real fault on the node reaches the entity and starts its repair.
    stack.world.inject_fault(node.machine_id, 1, "xid", 48, clears_on="reset")
    await eventually(lambda: exists(repair_handle(stack, node.node_name, 1)), timeout=30)
    assert await task_failures(handle) == 0


def with_metadata(forgery: Forgery, **metadata: bytes) -> Forgery:
    def forge(input: NodeWatchInput) -> Payload:
        payload = forgery(input)
        for key, value in metadata.items():
            payload.metadata[key] = value
        return payload
    return forge


#: Results whose form the SDK acts on before workflow code runs (``decode_activation``, core's
#: activity resolution): each failed the Node entity's workflow task on every retry before the
#: gateway rebuilt results. (what, forgery, taken: whether the entity takes it as a report.) A
#: protobuf result was a bad report before too (the SDK decodes it only when workflow code asks):
#: ``test_a_nodes_result_is_one_json_payload_and_nothing_else`` checks the gateway replaces it.
POISONED_RESULTS: list[tuple[str, Forgery, bool]] = [
    # TMPRL1105: "externally stored payload(s) but external storage is not configured".
    ("an external-storage reference", raw_bytes(b'{"driver_name": "s3"}', b"json/external-storage-reference"),
     False),
    ("a protobuf external-storage reference",
     with_metadata(raw_bytes(b"{}", b"json/protobuf"), messageType=b"temporal.api.sdk.v1.ExternalStorageReference"),
     False),
    # The marker key on a well-formed report: dropped by the gateway, the report taken.
    ("the external-storage marker key on a report", with_metadata(quiet, __temporal_external_storage_reference=b"true"),
     True),
    # Core: "Not exactly one payload in activity result".
    ("two payloads", lambda input: Payloads(payloads=[quiet(input), quiet(input)]), False),
    ("no payload", lambda _input: Payloads(), False),
]


@pytest.mark.parametrize("what, forgery, taken", POISONED_RESULTS, ids=[p[0] for p in POISONED_RESULTS])
async def test_a_result_in_a_form_the_sdk_acts_on_fails_no_task(hostile, what: str, forgery: Forgery,
                                                                  taken: bool) -> None:
    """The gateway rebuilds a node's result: one payload, ``encoding: json/plain`` and its data,
    nothing else. Any other form (an external-storage reference, several payloads or none)
    reaches the entity as an undecodable payload: a bad report, no failed workflow task,
    and the entity watches on; a report with extra metadata keys is taken without them."""
    stack, node, watch = hostile
    handle = entity(stack, node)
    await watch.answer(forgery)
    now = await status(stack, node)
    assert now.bad_reports == (0 if taken else 1), f"{what}: {now.log[-1:]}"
    if not taken:
        assert "undecodable" in await details(handle), what
    await watch.answer(quiet)  # the watch lives on, and its next answer is taken
    assert (await status(stack, node)).bad_reports_in_a_row == 0
    assert await task_failures(handle) == 0
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING


async def test_bad_reports_in_a_row_quarantine_the_node(hostile, monkeypatch) -> None:
    """A node that keeps answering garbage is cordoned and handed to the repair ladder (from a
    reboot), and its entity keeps watching it."""
    stack, node, watch = hostile
    handle = entity(stack, node)
    cordoned: list[tuple[str, bool]] = []
    real_cordon = SimCluster.cordon

    def recording_cordon(cluster, name: str, unschedulable: bool = True, **marks):
        cordoned.append((name, unschedulable))
        return real_cordon(cluster, name, unschedulable, **marks)

    monkeypatch.setattr(SimCluster, "cordon", recording_cordon)
    for _ in range(MAX_BAD_REPORTS_IN_A_ROW - 1):
        await watch.answer(replacing(("reclaim_at",), math.nan))
    assert (await status(stack, node)).bad_reports_in_a_row == MAX_BAD_REPORTS_IN_A_ROW - 1
    await watch.answer(replacing(("digest",), "x" * 1000))

    repair = repair_handle(stack, node.node_name, 0)
    await eventually(lambda: exists(repair), timeout=30)
    assert cordoned[0] == (node.node_name, True), "cordoned (with the repair's first GPU fenced) at once"
    started = (await repair.fetch_history()).events[0].workflow_execution_started_event_attributes
    repair_input = json.loads(started.input.payloads[0].data)
    assert repair_input["rung"] == "reboot"
    assert repair_input["reasons"] == [f"{MAX_BAD_REPORTS_IN_A_ROW} bad reports in a row from the node agent"]
    now = await status(stack, node)
    assert now.bad_reports == MAX_BAD_REPORTS_IN_A_ROW and now.bad_reports_in_a_row == 0
    # The ladder reboots the machine (its agent stops and a new one starts): once it is back,
    # the node is still watched: the next answer is taken and judged.
    outcome = await asyncio.wait_for(repair.result(), 90)
    assert outcome["outcome"] == "repaired", outcome
    # The watch in flight during the reboot was the old boot's agent's: replaced once the node
    # booted again (its agent may have died without a word, and a quick reboot is never NotReady).
    events = (await handle.fetch_history()).events
    done_at = next(e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
                   and e.workflow_execution_signaled_event_attributes.signal_name == "node_action_done")
    assert any(e.event_id > done_at and e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED
               for e in events), "the watch held by the rebooted agent was replaced"
    await watch.answer(replacing(("seq",), "many"))
    assert (await status(stack, node)).bad_reports == MAX_BAD_REPORTS_IN_A_ROW + 1
    assert await task_failures(handle) == 0
    # Named for the newest Node patch (``node-patches-at-start``); the older file stays (runs in flight).
    await replay_and_record(handle, "node_bad_reports_quarantine_patches_at_start")


@pytest.fixture
async def metered(temporal_env, tmp_path, monkeypatch) -> AsyncIterator[tuple[Stack, JoinedNode, HostileWatch, int]]:
    """``hostile``, with the control-plane worker's client on a metrics runtime, as the worker
    runs it (``workers.control_plane``): its ``/metrics`` port last."""
    watch = HostileWatch()
    monkeypatch.setattr(workers.node_agent, "build_agent", watch.build_agent)
    server = MetricsServer(0, "control-plane", host="127.0.0.1", registry=CollectorRegistry(),
                           worker_heartbeats=False)
    try:
        config = temporal_env.client.service_client.config
        client = await Client.connect(config.target_host, namespace=temporal_env.client.namespace,
                                      data_converter=temporal_env.client.data_converter, runtime=server.runtime)
        async for stack in running_stack(client, tmp_path):
            node = await join_node(stack)
            await eventually(_async(lambda: bool(watch.inputs)), timeout=30)
            yield stack, node, watch, server.port
    finally:
        server.close()


def bad_reports_metric(port: int) -> dict[tuple[str, str], float]:
    """``gpufleet_node_bad_reports_total`` on the worker's page, by (site, source)."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "gpufleet_node_bad_reports_total":
                key = (sample.labels["site"], sample.labels["source"])
                found[key] = found.get(key, 0) + sample.value
    return found


async def test_bad_reports_are_counted_in_a_metric_by_site(metered) -> None:
    """A bad report is counted on the control-plane worker's metrics page (Temporal's workflow
    metric meter, through the SDK's exporter the page appends), by site and by what the node
    answered; not by node: the node is named in its entity's details."""
    stack, node, watch, port = metered
    assert bad_reports_metric(port).get((node.site, "watch"), 0) == 0
    await watch.answer(replacing(("reclaim_at",), math.nan))
    await watch.answer(quiet)
    await watch.answer(replacing(("digest",), "x" * 1000))
    assert (await status(stack, node)).bad_reports == 2

    async def counted() -> bool:
        return bad_reports_metric(port).get((node.site, "watch")) == 2

    await eventually(counted, timeout=10)
    assert all("node" not in labels for labels in _labels(port)), "no series per node"


def _labels(port: int) -> list[dict[str, str]]:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [s.labels for f in text_string_to_metric_families(page) for s in f.samples
            if s.name == "gpufleet_node_bad_reports_total"]


class FailsOnce:
    """``fleet.naming.reclaim_workflow_id`` (which the Node entity's watch loop calls on a spot
    notice) raising once when armed: an unexpected error inside the loop."""

    def __init__(self) -> None:
        self.armed = False
        self.real = fleet.naming.reclaim_workflow_id

    def __call__(self, node_name: str) -> str:
        if self.armed:
            self.armed = False
            raise RuntimeError("an unexpected error in the watch loop")
        return self.real(node_name)


@pytest.fixture
def reclaim_id_fails_once(monkeypatch) -> FailsOnce:
    # Before the node joins: its entity's sandbox binds the name when it imports workflows.node.
    fails = FailsOnce()
    monkeypatch.setattr(fleet.naming, "reclaim_workflow_id", fails)
    return fails


@pytest.mark.parametrize("hostile", ["spot"], indirect=True)  # only a spot node's notice is acted on
async def test_an_error_in_the_watch_loop_is_shown_and_the_loop_restarts(reclaim_id_fails_once, hostile) -> None:
    """An exception inside the entity's background watch loop used to end it silently (the node
    still counted as live, nothing watched it). Now it is logged and shown, the loop restarts,
    and the spot notice that hit the error is acted on by the restarted loop."""
    stack, node, _watch = hostile
    handle = entity(stack, node)
    reclaim_id_fails_once.armed = True
    stack.world.post_reclaim_notice(node.machine_id, 600)

    reclaim = stack.client.get_workflow_handle(fleet.naming.reclaim_workflow_id.real(node.node_name))
    await eventually(lambda: exists(reclaim), timeout=30)
    assert not reclaim_id_fails_once.armed, "the error was raised"
    now = await status(stack, node)
    assert now.loop_restarts == 1
    # ... and says when it restarts (before: "restarting in 1s", in a log whose lines carry no time).
    paused, _ = await decided(handle, lambda event: event.event_type == EventType.EVENT_TYPE_TIMER_STARTED
                              and event.timer_started_event_attributes.start_to_fire_timeout.ToSeconds() == 1)
    assert (f"health watch failed (RuntimeError: an unexpected error in the watch loop); restarting at "
            f"{paused + timedelta(seconds=1):%H:%M:%S} UTC") in now.log, now.log
    assert await task_failures(handle) == 0


def notice(terminate_at: float) -> Forgery:
    """A well-formed answer that changes nothing but carries a spot reclaim notice."""
    return lambda input: as_json({"node_name": input.node_name, "seq": input.seq, "digest": input.digest,
                                  "boot_id": "b", "reclaim_at": terminate_at})


async def test_a_reclaim_notice_from_a_node_at_an_on_demand_site_is_a_bad_report(hostile) -> None:
    """A spot notice is the provider's word, but it reaches the entity in the node's own answer.
    Obeyed from a node at an on-demand site (site-a), it started the node's SpotReclaim: drained
    by the node's deadline, the machine retired past PodDisruptionBudgets and a replacement
    bought. Now it is ignored: a bad report per notice (not per answer: an agent repeats its
    notice in each), no ``reclaim/<node>``, the machine kept and schedulable. (A spot site's
    notice is obeyed: tests/test_site_reclaim.py.)"""
    stack, node, watch = hostile
    handle = entity(stack, node)
    await watch.answer(notice(time.time() + 600))  # forged by the node
    now = await status(stack, node)
    assert now.bad_reports == 1, now.log
    assert f"at {node.site}, an on-demand site: only spot machines are reclaimed; ignored" in now.last_bad_report

    # The agent's own notice (the sim's provider posting one), in every answer from now on.
    stack.world.post_reclaim_notice(node.machine_id, 600)
    await eventually(lambda: _bad_reports(stack, node, 2), timeout=15)
    stack.world.inject_fault(node.machine_id, 1, "xid", 13, clears_on="reset")  # an answer for it
    await eventually(lambda: _app_xids(stack, node), timeout=15)
    now = await status(stack, node)
    assert now.bad_reports == 2 and now.bad_reports_in_a_row == 0, now.log

    assert not await exists(stack.client.get_workflow_handle(fleet.naming.reclaim_workflow_id(node.node_name)))
    assert stack.world.machine(node.machine_id)["deleted_at"] is None
    assert not stack.cluster.get_node(node.node_name).unschedulable
    assert await task_failures(handle) == 0
    await replay_and_record(handle, "node_reclaim_notice_at_an_on_demand_site")


async def _bad_reports(stack: Stack, node: JoinedNode, count: int) -> bool:
    return (await status(stack, node)).bad_reports >= count


async def _app_xids(stack: Stack, node: JoinedNode) -> bool:
    return bool((await status(stack, node)).app_xids)


# -- what a node's well-formed answers make the entity carry ----------------------------------
#: The biggest answers the gateway lets through (the 128 KiB a watch answer may take,
#: ``RESULT_LIMITS``; 512 KiB before, five GPUs): one GPU as large as ``NodeReport`` allows (64 XID
#: events of 1,000-character messages each).
BLOATED_GPUS = 1
#: Continue-as-new's input is a 2 MiB blob at most; the carried state must stay far below it.
CARRY_BOUND = 128 * 1024


def bloated(number: int) -> Forgery:
    """A well-formed answer of GPUs the node does not have (it has 2), as large as the model
    allows, fresh every answer: application XIDs on most, fatal ones on the first (on the old code
    each GPU's events were kept whole in ``latest`` and every fatal XID in the ledger)."""
    def forge(input: NodeWatchInput) -> Payload:
        first = 2 + (number * BLOATED_GPUS) % (64 - 2 - BLOATED_GPUS)
        gpus = [{"index": index, "uuid": "U" * 128, "name": "N" * 1000, "xid_events": [
            {"xid": 79 if index == first else 13, "at": 1_700_000_000 + number * 100 + k, "message": "m" * 1000}
            for k in range(64)]} for index in range(first, first + BLOATED_GPUS)]
        return as_json({"node_name": input.node_name, "seq": input.seq + 1, "digest": f"{number:064x}",
                        "boot_id": "b" * 36, "gpus": gpus})
    return forge


@pytest.mark.integration  # a dev server of the module's own
async def test_well_formed_answers_cannot_grow_what_the_entity_carries(hostile_small_history) -> None:
    """A node's answers that pass validation, as large as it allows and fresh every time (GPUs
    it does not have, 64 XIDs each with 1,000-character messages, fatal ones among them), made the
    Node entity's carried state 4 MB: its continue-as-new failed every workflow task after
    (PayloadsTooLarge) and the node's health went unwatched. Now the entity continues as new
    twice over with a small state, no workflow task fails, an answer past the model's limits is a
    bad report, and a real fault after all that is still repaired."""
    stack, node, watch = hostile_small_history
    handle = entity(stack, node)
    first_run = (await handle.describe()).run_id
    run_ids = {first_run}
    for number in range(1, 80):  # about 10 answers fill a run's history to where this server asks
        try:
            await watch.answer(bloated(number))
        except AssertionError:
            failures = sum(await _task_failures(stack, handle, first_run))
            raise AssertionError(f"the watch stopped after answer {number}: {failures} workflow tasks failed")
        run_ids.add((await handle.describe()).run_id)
        if len(run_ids) == 3:
            break
    chain = await run_chain(stack.client, handle.id, first_run)
    assert len(chain) == 3, f"continued as new twice ({number} answers)"
    carried = [len(h.events[-1].workflow_execution_continued_as_new_event_attributes.input.payloads[0].data)
               for h in chain[:-1]]
    assert max(carried) < CARRY_BOUND, f"carried {carried} bytes"

    # In the new run (its facts read at its start): a small answer of the same kind, one past the
    # model's limits (65 XID events), and the node's honest answers after.
    await watch.answer(replacing(("gpus",), [
        {"index": 5, "uuid": "GPU-5", "xid_events": [{"xid": 79, "at": "2026-01-01T00:00:00Z"}]}]))
    await watch.answer(replacing(("gpus", 0, "xid_events"), [{"xid": 13, "at": 1_700_000_000 + k} for k in range(65)]))
    assert (await status(stack, node)).bad_reports == 1
    stack.world.inject_fault(node.machine_id, 1, "xid", 48, clears_on="reset")
    await eventually(lambda: exists(repair_handle(stack, node.node_name, 1)), timeout=30)
    assert await _task_failures(stack, handle, first_run) == [0, 0, 0]
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
    assert len((await handle.fetch_history()).events[0].workflow_execution_started_event_attributes
               .input.payloads[0].data) < CARRY_BOUND
    await replay_and_record(handle, "node_carry_bounded_after_bloated_answers")


# -- what a node's well-formed answers make the control plane do ------------------------------
def fatal_on_every_gpu(number: int) -> Forgery:
    """A well-formed answer naming the most GPUs a report may (64; the node has 2), a fresh fatal
    XID on each."""
    def forge(input: NodeWatchInput) -> Payload:
        gpus = [{"index": index, "uuid": f"GPU-{index}", "xid_events": [{"xid": 79, "at": 1_700_000_000 + number}]}
                for index in range(MAX_NODE_GPUS)]
        return as_json({"node_name": input.node_name, "seq": input.seq + 1, "digest": f"{number:064x}",
                        "boot_id": "b" * 36, "gpus": gpus})
    return forge


def facts_reads(histories) -> int:
    """The Node entity's ``node_facts`` calls: a regular activity's ``ActivityTaskScheduled``, or
    a local activity's ``MarkerRecorded`` event (``core_local_activity``) whose data names it."""
    return sum(_is_facts_read(e) for history in histories for e in history.events)


def _is_facts_read(e) -> bool:
    if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
        return e.activity_task_scheduled_event_attributes.activity_type.name == "node_facts"
    return (e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
            and e.marker_recorded_event_attributes.marker_name == "core_local_activity"
            and b'"activity_type":"node_facts"' in e.marker_recorded_event_attributes.details["data"].payloads[0].data)


def local_activities(history) -> int:
    return sum(e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
               and e.marker_recorded_event_attributes.marker_name == "core_local_activity" for e in history.events)


async def test_fatal_xids_on_gpus_the_node_lacks_cost_no_facts_reads(hostile) -> None:
    """Each finding on a GPU the node lacks cost the control-plane worker a facts read (a local
    activity) before it was ignored: a node naming 64 GPUs drove 62 such reads a report. Now the
    GPUs its facts say it lacks are ignored without one, and its real GPUs' faults are still
    contained."""
    stack, node, watch = hostile
    handle = entity(stack, node)
    first_run = (await handle.describe()).run_id
    before = facts_reads(await run_chain(stack.client, handle.id, first_run))
    reports = (await status(stack, node)).reports
    answers = 3
    for number in range(1, answers + 1):
        await watch.answer(fatal_on_every_gpu(number))
    # Then one of no GPUs: reports are handled in order, so once it is counted the others are done.
    await watch.answer(replacing(("gpus",), []))

    async def handled() -> bool:
        return (await status(stack, node)).reports >= reports + answers + 1

    await eventually(handled, timeout=120)
    # The faults on its two GPUs are contained (fenced, each handed to its repair); none other is.
    assert await exists(repair_handle(stack, node.node_name, 0)) and await exists(repair_handle(stack, node.node_name, 1))
    assert not await exists(repair_handle(stack, node.node_name, 2))
    reads = facts_reads(await run_chain(stack.client, handle.id, first_run)) - before
    assert reads <= 2, f"{reads} facts reads for {answers} reports: one for each real GPU's finding at most"
    lines = [line for line in (await status(stack, node)).log if "unknown GPU" in line]
    assert lines == ["health report for unknown GPUs 2, 3, 4, 5, 6 and 57 more (node has 2): ignored"] * answers, \
        "one line a report"
    assert not any(await _task_failures(stack, handle, first_run))
    # Its facts reads, fences and un-fences are regular activities: a local one's result can reach
    # the workflow a task late, after the watch loop's next command, which a replay runs before.
    assert local_activities(await handle.fetch_history()) == 0
    await replay_and_record(handle, "node_fatal_xids_on_gpus_it_lacks")


async def _task_failures(stack: Stack, handle: WorkflowHandle, first_run: str) -> list[int]:
    """Failed workflow tasks in each run of the entity, first to latest."""
    return [sum(e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED for e in history.events)
            for history in await run_chain(stack.client, handle.id, first_run)]
