"""Each node activity's result is bounded by its own figure, not only by the gateway's gRPC bound.

Every answer a node gives lands in the history of the workflow that scheduled the activity, in
Temporal's store every workflow shares (kept 14 days after the run closes). The gateway bounded
one request at 512 KiB (``proxy.RESULT_BYTES``), so a node padded each answer to that: under the
watch's pace 30 early answers a change each are free, again after every answer at half the
watch's wait (15 minutes), about 62 MiB an hour into its Node entity (continuing as new every
~4 MB, each run kept), ~20 GiB per node over retention; and one evacuation's proof round took
each node's smoke result whole (100 hostile nodes of a site: 50 MB in one round).

The gateway now seals each task's activity type into the token it hands the node
(``task_tokens``) and bounds the result's data by that type (``authorization.RESULT_LIMITS``,
derived here from what an honest agent sends at its models' maximums); a larger result is
replaced as a malformed one is: a bad report, a failed smoke test.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from typing import Any, AsyncIterator

import pytest
from temporalio import activity
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.client import Client
from temporalio.common import RawValue
from temporalio.contrib.pydantic import pydantic_data_converter

import workers.node_agent
from activities.node_agent import MAX_XIDS
from fleet.contracts import workflows as flows
from fleet.messages.evacuation import EvacuationResult
from fleet.messages.join import JoinedNode
from fleet.messages.nodes import SmokeResult
from fleet.messages.repair import MAX_NODE_GPUS, NodeReport, NodeStatus, NodeWatchInput, NodeWatchResult, SmokeReport
from fleet.models import GpuHealth, XidEvent
from tests.security.armed_watch import ArmedWatch
from tests.bad_input_helpers import task_failures
from tests.conftest import Stack
from tests.evacuation_helpers import open_incident_stack
from tests.gateway_keys import token_keys_as_deployed
from tests.repair_helpers import REPAIR, eventually, join_node, repair_fleet, running_stack
from tests.security.test_evacuation_proof import GarbledProof
from workers.gateway import authorization
from workers.gateway.task_tokens import MAC_BYTES, VERSION, TaskTokens

#: What a padded answer carries beyond an honest one: a field the models ignore (each string under
#: the entity's ``first_problem`` bound), 200 KB in all, over every node activity's bound.
PAD = {"pad": ["x" * 50_000] * 4}


def _gpu(index: int, xids: int) -> GpuHealth:
    """A GPU as ``NvmlBackend`` reports it, every number at its widest."""
    return GpuHealth(index=index, uuid="GPU-12345678-1234-1234-1234-123456789012", name="NVIDIA H100 80GB HBM3",
                     memory_gb=79.6, temperature_c=95, slowdown_temperature_c=90, ecc_uncorrected=2**31,
                     remapped_rows_pending=True, remapped_rows_failure=True, retired_pages_pending=True,
                     nvlink_down=18, recovery_action=4, lost=False,
                     xid_events=[XidEvent(xid=2**31, at=datetime(2099, 12, 31, 23, 59, 59, 999_999, timezone.utc),
                                          message="nvmlEventTypeXidCriticalError") for _ in range(xids)])


def _state(gpus: list[GpuHealth]) -> NodeWatchResult:
    return NodeWatchResult(node_name="site-a-" + "x" * 56, seq=2**53, digest="f" * 64, boot_id="b" * 36,
                           gpus=gpus, reclaim_at=4_102_444_800.0, observed_at=4_102_444_800.0)


def _size(value: Any) -> int:
    return len(pydantic_data_converter.payload_converter.to_payloads([value])[0].data)


def test_an_honest_agents_largest_answers_fit_their_bounds() -> None:
    """The bounds leave every honest answer room: a watch (and a probe) of 16 GPUs each holding
    its full XID list (``MAX_XIDS``) or of 64 GPUs (``MAX_NODE_GPUS``) with 16 events each; the
    largest smoke result the workflow accepts (at most 256 failures, so at most 256 XID events in
    its state, 64 GPUs); a reset's or reinstall's output at the 1,000 characters accepted, every
    one escaped."""
    limits = authorization.RESULT_LIMITS
    watch = limits["watch_node"]
    assert _size(_state([_gpu(i, MAX_XIDS) for i in range(16)])) <= watch
    assert _size(_state([_gpu(i, 16) for i in range(MAX_NODE_GPUS)])) <= watch
    assert limits["probe_gpus"] == watch
    # Each GPU's problems are failures too (8 here), and each XID event one more.
    per_gpu = len(_gpu(0, 0).problems())
    accepted = SmokeReport.model_fields["failures"].metadata[0].max_length
    gpus = [_gpu(i, 0) for i in range(MAX_NODE_GPUS)]
    left = accepted - per_gpu * 16
    gpus[:16] = [_gpu(i, left // 16) for i in range(16)]  # the rest of the 256 as XID events
    failures = [f"GPU {g.index}: {problem}" for g in gpus[:16] for problem in g.problems()]
    assert len(failures) == accepted
    smoke = SmokeResult(passed=False, gpus_seen=MAX_NODE_GPUS, boot_id="b" * 36, failures=failures,
                        state=_state(gpus))
    SmokeReport.model_validate(smoke.model_dump(mode="json"))
    NodeReport.model_validate(smoke.state.model_dump(mode="json"))
    assert _size(smoke) <= limits["smoke_test"]
    for kind in ("reset_gpu", "reinstall_driver"):
        assert _size("\x01" * 1000) <= limits[kind]


def test_a_result_over_its_kinds_bound_is_replaced_and_one_within_is_kept() -> None:
    for kind, limit in authorization.RESULT_LIMITS.items():
        within = Payloads(payloads=[Payload(metadata={"encoding": b"json/plain"}, data=b"x" * limit)])
        assert authorization.clean_result(within, kind) == (within, "")
        over = Payloads(payloads=[Payload(metadata={"encoding": b"json/plain"}, data=b"x" * (limit + 1))])
        replaced, why = authorization.clean_result(over, kind)
        assert replaced.payloads[0].metadata["encoding"] == authorization.REFUSED_RESULT_ENCODING
        assert f"over the {limit} a {kind} result may take" in why


def test_a_token_sealed_before_types_were_opens_with_no_type() -> None:
    """An envelope a replica from before sealed (no type: a task in flight across an upgrade)
    still opens, its result bounded by the gRPC bound only; one sealed now names its type."""
    import hashlib
    import hmac

    keys = token_keys_as_deployed()
    tokens = TaskTokens(keys)
    old = VERSION + hmac.new(keys.current, b"gpufleet node gateway task token\x00n1\x00tok",
                             hashlib.sha256).digest() + b"tok"
    assert len(old) == 1 + MAC_BYTES + 3
    assert tokens.open_task("n1", old) == (b"tok", "")
    assert tokens.open_task("n1", tokens.seal("n1", b"tok", "smoke_test")) == (b"tok", "smoke_test")
    assert tokens.open_task("n2", tokens.seal("n1", b"tok", "smoke_test")) is None


async def _history_bytes(client: Client, workflow_id: str) -> int:
    """Every run's history of ``workflow_id`` together, in bytes (closed runs stay for retention)."""
    total = 0
    async for run in client.list_workflows(f'WorkflowId = "{workflow_id}"'):
        described = await client.get_workflow_handle(workflow_id, run_id=run.run_id).describe()
        total += described.raw_description.workflow_execution_info.history_size_bytes
    return total


async def test_a_padded_proof_does_not_reach_the_evacuations_history(temporal_env, tmp_path, monkeypatch) -> None:
    """Three of a site's four nodes fail and recover; the fourth answers its proof with a smoke
    result that passes, padded to 200 KB. The gateway replaces it (over the 64 KiB a smoke result
    may take): the evacuation's history stays far below the padding (before: it held all of it,
    and the node passed), the site comes back with the three, the fourth unproven and cordoned."""
    honest = json.loads(SmokeResult(passed=True, gpus_seen=1).model_dump_json())
    padded = GarbledProof(Payload(metadata={"encoding": b"json/plain"}, data=json.dumps({**honest, **PAD}).encode()))
    monkeypatch.setattr(workers.node_agent, "build_agent", padded.build_agent)
    async for inc in open_incident_stack(temporal_env.client, tmp_path):
        evacuation, liar = await inc.evacuate_with_a_liar("a", padded.nodes.add)
        result = EvacuationResult.model_validate(await asyncio.wait_for(evacuation.result(), 90))
        size = (await evacuation.describe()).raw_description.workflow_execution_info.history_size_bytes
        print(f"the evacuation's history: {size:,} bytes")
        assert size < 100_000, f"the evacuation's history holds {size:,} bytes"
        assert result.outcome == "restored"
        proven = next(s for s in result.timeline if s.name == "nodes proven")
        assert proven.detail.startswith("3 nodes passed smoke tests"), proven.detail
        assert liar in proven.detail and "bad report: undecodable" in proven.detail, proven.detail
        assert inc.cluster.get_node(liar).unschedulable
        assert await task_failures(evacuation) == 0


class PaddingWatch(ArmedWatch):
    """The node's agent, except that once ``armed`` each watch answers at once, a change padded
    to ``PAD``."""

    def __init__(self) -> None:
        super().__init__()
        self.answers = 0

    def armed_answer(self, input: NodeWatchInput) -> Any:
        assert self.last is not None
        self.answers += 1
        return RawValue(Payload(metadata={"encoding": b"json/plain"}, data=json.dumps({
            **self.last.model_dump(mode="json"), "seq": input.seq + 1, "digest": f"padded-{self.answers}",
            **PAD}).encode()))


@pytest.fixture
async def padding_watch(temporal_env, tmp_path, monkeypatch) -> AsyncIterator[tuple[Stack, JoinedNode, PaddingWatch]]:
    node_agent = PaddingWatch()
    monkeypatch.setattr(workers.node_agent, "build_agent", node_agent.build_agent)
    fleet = repair_fleet(timeouts={**REPAIR["timeouts"], "watch_pace_seconds": 0.1, "watch_pace_max_seconds": 0.5})
    async for stack in running_stack(temporal_env.client, tmp_path, fleet):
        node = await join_node(stack)

        async def watching() -> bool:
            return bool(node_agent.inputs)

        await eventually(watching, timeout=30)
        yield stack, node, node_agent


async def test_padded_watch_answers_do_not_reach_the_node_entitys_history(padding_watch) -> None:
    """The node answers every watch at once with a change padded to 200 KB. The gateway replaces
    each (over the 128 KiB a watch answer may take): the entity counts them as bad reports (and
    quarantines the node after three), and its history, every run of it, grows by a few KB an
    answer (before: by the 200 KB of each, 30 of them free under the pace)."""
    stack, node, node_agent = padding_watch
    entity = f"node/{node.node_name}"
    handle = stack.client.get_workflow_handle(entity)
    before = await _history_bytes(stack.client, entity)
    node_agent.armed = True
    stack.world.inject_fault(node.machine_id, 0, "xid", 13, clears_on="never")  # ends the watch in flight

    async def answered() -> bool:
        return node_agent.answers >= 9  # the ninth watch: the entity took the eighth answer

    try:
        await eventually(answered, timeout=60, interval=0.2)
    except AssertionError:
        status = await handle.query(flows.Node.status, result_type=NodeStatus)
        raise AssertionError(f"{node_agent.answers} answers, {len(node_agent.inputs)} watches: {status.log}")
    grown = await _history_bytes(stack.client, entity) - before
    print(f"{node_agent.answers} padded answers: the entity's history grew by {grown:,} bytes")
    assert grown < 8 * 200_000 / 4, (f"{node_agent.answers} padded answers; the entity's history grew by "
                                     f"{grown:,} bytes")
    status = await handle.query(flows.Node.status, result_type=NodeStatus)
    assert any("bad report" in line and "undecodable" in line for line in status.log), status.log
    assert await task_failures(handle) == 0
