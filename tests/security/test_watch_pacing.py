"""A node that answers every ``watch_node`` at once, with a well-formed "nothing changed" report
padded with fields the report model ignores (up to the gateway's result limit).

An honest agent's watch is level-triggered: it answers when the node's state changed, or after
the watch's wait (minutes). The Node entity scheduled the next watch the moment an answer came,
and the gateway bounds a node's calls in flight, not their rate: such a node drove a workflow
task, an activity and about half a megabyte of history per round trip on the shared control-plane
worker and Temporal store, as fast as it liked (100 round trips, 42 MB, in 10 s). Since
``node-patches-at-start-2`` the entity paces the next watch (workflows/node.py ``_pace_watch``).

A node that also changes its digest on every answer (its GPUs unchanged) has each answer count as
a change: the first ``WATCH_EARLY_FREE`` (30) are free. The pace was counted per run, and the
padding alone passes the server's continue-as-new suggestion every ~9 answers (4 MiB of history),
so every run started counting afresh and such a node was never paced. Since
``node-patches-at-start-8`` the counts and the pause go over continue-as-new with the entity's state.

A node that fails every watch at once (non-retryable) instead of answering was not paced at all
until ``node-paces-failed-watches``: each failure a facts read and the next watch at once.

Each answer lands in the Node entity's history, in the store every workflow shares (14 days
retention), and the gateway bounds one to 128 KiB, not how many: the 30 free early answers of a
node changing its digest each time were 30 answers of 128 KiB, again after every answer at half the
watch's wait (about 16 MiB an hour). Since ``node-paces-answer-bytes`` an early answer counts as one
per ``WATCH_FREE_BYTES`` (16 KiB) begun: a 128 KiB one as 8, an honest one (3 KB for 8 GPUs) as one.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import pytest
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

import workers.node_agent
from fleet.contracts import workflows as flows
from fleet.messages.repair import NodeStatus, NodeWatchInput
from tests.bad_input_helpers import task_failures
from tests.security.armed_watch import ArmedWatch
from tests.can_server import run_chain, server_suggesting_continue_as_new
from tests.repair_helpers import eventually, join_node, running_stack
from tests.replay import replay_and_record
from workflows.node import WATCH_EARLY_FREE, WATCH_FREE_BYTES

#: Extra fields the report model ignores: each string under first_problem's 64 KiB bound.
#: Two strings of 60 KB: under the 128 KiB a watch answer may take (``RESULT_LIMITS``).
PAD = {"pad": ["x" * 60_000] * 2}
#: Padding that keeps an answer under ``WATCH_FREE_BYTES``: it counts as one early answer.
SMALL_PAD = {"pad": ["x" * 12_000]}
SECONDS = 10.0


class EagerWatch(ArmedWatch):
    def __init__(self, new_digests: bool = False, pad: dict = PAD) -> None:
        super().__init__()
        self.bytes = 0
        #: Each answer a new digest (and sequence number), the node's GPUs unchanged.
        self.new_digests = new_digests
        self.pad = pad

    @property
    def boot_id(self) -> str:
        return self.last.boot_id if self.last is not None else "b"

    def armed_answer(self, input: NodeWatchInput) -> Any:
        """The node's answer once armed: at once, the node's GPUs unchanged."""
        seq, digest = input.seq, input.digest
        if self.new_digests:
            seq, digest = seq + 1, f"padded-{len(self.inputs)}"
        data = json.dumps({"node_name": input.node_name, "seq": seq, "digest": digest,
                           "boot_id": self.boot_id, **self.pad}).encode()
        self.bytes += len(data)
        return RawValue(Payload(metadata={"encoding": b"json/plain"}, data=data))


async def watched_by(watch: EagerWatch, client, tmp_path, monkeypatch) -> AsyncIterator:
    """A stack with a node joined whose agent's watches ``watch`` answers, once it watches."""
    monkeypatch.setattr(workers.node_agent, "build_agent", watch.build_agent)
    async for stack in running_stack(client, tmp_path):
        node = await join_node(stack)

        async def watching() -> bool:
            return bool(watch.inputs)

        await eventually(watching, timeout=30)
        yield stack, node, watch


@pytest.fixture
async def eager(temporal_env, tmp_path, monkeypatch) -> AsyncIterator:
    async for stack, node, watch in watched_by(EagerWatch(), temporal_env.client, tmp_path, monkeypatch):
        yield stack, node, watch


async def test_a_node_answering_every_watch_at_once_is_paced(eager) -> None:
    stack, node, watch = eager
    before = len(watch.inputs)
    watch.armed = True
    # Answer the watch in flight: the honest one blocks until something changes.
    stack.world.inject_fault(node.machine_id, 0, "xid", 13, clears_on="never")  # an application XID: no repair
    await asyncio.sleep(SECONDS)
    watch.armed = False
    rounds = len(watch.inputs) - before
    handle = stack.client.get_workflow_handle(f"node/{node.node_name}")
    # 3 free answers that change nothing, then pauses of 5 s, 10 s, ... (the first answer, the
    # fault's, changed something).
    assert rounds <= 6, f"{rounds} watch rounds in {SECONDS:g} s ({watch.bytes / 1e6:.1f} MB of history)"
    assert not await task_failures(handle)
    status = await handle.query(flows.Node.status, result_type=NodeStatus)
    assert any("the next watches are paced" in line for line in status.log), status.log
    await replay_and_record(handle, "node_watch_paced")


@pytest.fixture(scope="module")
async def can_env() -> AsyncIterator:
    """A dev server that suggests continue-as-new every 40 events, as the padding's 4 MiB would."""
    async with server_suggesting_continue_as_new(40) as env:
        yield env


@pytest.fixture
async def eager_new_digests(can_env, tmp_path, monkeypatch) -> AsyncIterator:
    # Answers under WATCH_FREE_BYTES: each counts as one early answer (the server here suggests
    # continue-as-new by events, not by bytes).
    async for stack, node, watch in watched_by(EagerWatch(new_digests=True, pad=SMALL_PAD), can_env.client,
                                               tmp_path, monkeypatch):
        yield stack, node, watch


async def armed_until_paced(stack, node, handle, watch: EagerWatch, flooding_past: int, timeout: float) -> None:
    """Arm ``watch`` and end the watch in flight (a fault), then wait until the Node entity logs
    that it paces the watch, or the node has had more than ``flooding_past`` watches in all (not
    paced in time: the test's own figures then say by how much)."""

    async def paced_or_flooding() -> bool:
        if len(watch.inputs) > flooding_past:
            return True
        status = await handle.query(flows.Node.status, result_type=NodeStatus)  # the newest run
        return any("the next watches are paced" in line for line in status.log)

    watch.armed = True
    stack.world.inject_fault(node.machine_id, 0, "xid", 13, clears_on="never")  # ends the watch in flight
    await eventually(paced_or_flooding, timeout=timeout, interval=0.2)


async def test_a_node_changing_its_digest_on_every_answer_stays_paced_across_continue_as_new(
        eager_new_digests) -> None:
    stack, node, watch = eager_new_digests
    handle = stack.client.get_workflow_handle(f"node/{node.node_name}")
    first_run = (await handle.describe()).run_id
    before = len(watch.inputs)

    await armed_until_paced(stack, node, handle, watch, flooding_past=before + WATCH_EARLY_FREE + 10, timeout=90)
    await asyncio.sleep(8)  # paced: a pause of 5 s, then of 10 s, whichever run it falls in
    watch.armed = False
    rounds = len(watch.inputs) - before
    chain = await run_chain(stack.client, handle.id, first_run)
    # The free early answers are counted across runs (the old code counted from 0 in every
    # run, which the padding ends every few answers: never paced).
    assert rounds <= WATCH_EARLY_FREE + 4, (
        f"{rounds} watch rounds over {len(chain)} runs ({watch.bytes / 1e6:.1f} MB of history)")
    assert len(chain) >= 3, "the answers' history did not make the entity continue as new"
    assert not [run for run in chain if any(e.HasField("workflow_task_failed_event_attributes")
                                            for e in run.events)]
    await replay_and_record(handle, "node_watch_paced_across_continue_as_new")


@pytest.fixture
async def eager_padded(temporal_env, tmp_path, monkeypatch) -> AsyncIterator:
    async for stack, node, watch in watched_by(EagerWatch(new_digests=True), temporal_env.client, tmp_path,
                                               monkeypatch):
        yield stack, node, watch


def history_bytes(chain: list) -> int:
    return sum(event.ByteSize() for history in chain for event in history.events)


async def test_a_node_padding_every_early_answer_is_paced_by_its_bytes(eager_padded) -> None:
    """A node answers every watch at once with a new digest, each answer padded to ~120 KB (under
    the gateway's 128 KiB). Each early answer counted once: 30 free, 3.6 MB of history, again
    after every answer at half the watch's wait. Since ``node-paces-answer-bytes`` each counts as
    one per ``WATCH_FREE_BYTES`` begun (8): the watch is paced after 4 of them."""
    stack, node, watch = eager_padded
    handle = stack.client.get_workflow_handle(f"node/{node.node_name}")
    first_run = (await handle.describe()).run_id
    before, before_bytes = len(watch.inputs), history_bytes(await run_chain(stack.client, handle.id, first_run))
    counts = -(-len(json.dumps(PAD)) // WATCH_FREE_BYTES)
    assert counts == 8
    most = WATCH_EARLY_FREE // counts + 1  # the free ones, then the one past them

    await armed_until_paced(stack, node, handle, watch, flooding_past=before + most + 8, timeout=60)
    watch.armed = False
    rounds = len(watch.inputs) - before
    chain = await run_chain(stack.client, handle.id, first_run)
    written = history_bytes(chain) - before_bytes
    # Before: paced after 30 such answers (3.6 MB), the next 30 free after one at half the wait.
    assert rounds <= most, f"{rounds} padded answers ({written / 1e6:.2f} MB of history) before the watch was paced"
    assert written < most * 140_000, f"{written / 1e6:.2f} MB of history for {rounds} answers"
    assert not [run for run in chain if any(e.HasField("workflow_task_failed_event_attributes")
                                            for e in run.events)]
    await replay_and_record(handle, "node_paces_answer_bytes")


class FailingWatch(EagerWatch):
    """Fails every ``watch_node`` at once, non-retryable (the gateway forwards a failure's type and
    flag), once armed."""

    def armed_answer(self, input: NodeWatchInput) -> Any:
        raise ApplicationError("watch refused", non_retryable=True)


@pytest.fixture
async def failing(temporal_env, tmp_path, monkeypatch) -> AsyncIterator:
    async for stack, node, watch in watched_by(FailingWatch(), temporal_env.client, tmp_path, monkeypatch):
        yield stack, node, watch


async def test_a_node_failing_every_watch_at_once_is_paced(failing) -> None:
    """A watch that fails is followed by a facts read and the next watch. A node failing each one
    at once (non-retryable, so no retry of the server's comes between) got them at once: 419 round
    trips in 10 s, each a workflow task on the control plane's queue, two activities, two reads of
    the API server and a dozen events of history (5,063 in 10 s; continue-as-new cannot cut it
    while a repair of the node runs). Since ``node-paces-failed-watches`` a watch failed before its
    heartbeat timeout counts as an early answer that changed nothing: past 3 in a row, paced."""
    stack, node, watch = failing
    before = len(watch.inputs)
    watch.armed = True
    stack.world.inject_fault(node.machine_id, 0, "xid", 13, clears_on="never")  # ends the watch in flight
    await asyncio.sleep(SECONDS)
    watch.armed = False
    rounds = len(watch.inputs) - before
    handle = stack.client.get_workflow_handle(f"node/{node.node_name}")
    events = len((await handle.fetch_history()).events)
    # The honest answer to the fault, 3 free failures, then pauses of 5 s, 10 s, ...
    assert rounds <= 6, f"{rounds} watch rounds in {SECONDS:g} s ({events} events of history)"
    assert not await task_failures(handle)
    status = await handle.query(flows.Node.status, result_type=NodeStatus)
    assert any("the next watches are paced" in line for line in status.log), status.log
    await replay_and_record(handle, "node_watch_failures_paced")


async def test_a_node_padding_past_its_bytes_budget_waits_until_they_are_paid_for(eager_padded) -> None:
    """Padded early answers (~120 KB, a new digest each) past the 512 KiB burst
    (``node-charges-every-answer-bytes``): the next watch waits until their bytes are paid for at
    256 KiB an hour, longer than the pace by counts (before: 4 answers, then a pause of 10 s, and
    one at half the watch's wait set the count back to 0, uncharged)."""
    stack, node, watch = eager_padded
    handle = stack.client.get_workflow_handle(f"node/{node.node_name}")
    before = len(watch.inputs)

    async def paid_for_or_flooding() -> bool:
        if len(watch.inputs) > before + 12:
            return True
        status = await handle.query(flows.Node.status, result_type=NodeStatus)
        return any("until they are paid for" in line for line in status.log)

    watch.armed = True
    stack.world.inject_fault(node.machine_id, 0, "xid", 13, clears_on="never")  # ends the watch in flight
    await eventually(paid_for_or_flooding, timeout=40, interval=0.2)
    watch.armed = False
    rounds = len(watch.inputs) - before
    status = await handle.query(flows.Node.status, result_type=NodeStatus)
    assert any("until they are paid for" in line for line in status.log), (rounds, status.log)
    # The burst and the answer that passed it: 5 padded answers (4 free by counts, a pause of 10 s).
    assert rounds <= 6, f"{rounds} padded answers"
    assert not await task_failures(handle)
    await replay_and_record(handle, "node_charges_every_answer_bytes")
