"""Issue 35, finding 2 and 4: what one node's certificate can do to what every node shares.

The node is the attacker: it speaks raw gRPC to the session's node gateway with its own
certificate (any bytes, any number of calls, on as many connections as it likes). What it
sends is judged by what reaches the real Temporal dev server behind the gateway (polls held
there, Worker Deployments and workers it lists) and by what the node hears back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta

import grpc
import pytest
from temporalio import workflow
from temporalio.api.deployment.v1 import WorkerDeploymentOptions
from temporalio.api.enums.v1 import WorkerVersioningMode
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.worker.v1 import WorkerHeartbeat
from temporalio.api.deployment.v1 import WorkerDeploymentVersion
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.workflowservice.v1 import (
    DescribeNamespaceRequest,
    ListWorkerDeploymentsRequest,
    ListWorkersRequest,
    PollActivityTaskQueueRequest,
    PollActivityTaskQueueResponse,
    RecordActivityTaskHeartbeatRequest,
    RecordWorkerHeartbeatRequest,
    RespondActivityTaskCompletedRequest,
    ShutdownWorkerRequest,
)

from temporalio.worker import Worker

from tests.conftest import NODE_GATEWAYS, start_test_gateway, wait_for
from tests.gateway_keys import token_keys_as_deployed
from tests.security.gateway_helpers import (
    call,
    code_of,
    credentials,
    end_entity,
    gather_codes,
    live_entity,
    node_channel,
    poll_request,
    unique,
)
from workers.gateway.authorization import GatewayStats, NodeAuthorization
from workers.gateway.liveness import Verdict
from workers.gateway.node_log import NODE_LOG_SECONDS, NodeLog
from workers.gateway.proxy import (
    CALLS_PER_NODE,
    HEARTBEAT_BURST,
    HEARTBEATS_PER_SECOND,
    HELD_BYTES_PER_NODE,
    HELD_CALL_BYTES,
    HELD_CALLS_PER_NODE,
    POLLS_PER_NODE,
    REQUEST_BYTES,
    RESULT_BYTES,
)
from workers.gateway.task_tokens import TaskTokens

OK, DENIED, EXHAUSTED = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture
async def gateway(temporal_env):
    return NODE_GATEWAYS[temporal_env.client.service_client.config.target_host]


@pytest.fixture
async def attacker(temporal_env, gateway):
    """A live node (its entity runs), as an attacker holds it: certificate, key, a connection."""
    name = unique("atk")
    await live_entity(temporal_env.client, name)
    node = credentials(gateway.pki, name)
    channel = node_channel(gateway.access, node)
    yield node, channel
    await channel.close()
    await end_entity(temporal_env.client, name)


async def test_a_node_gets_two_polls_upstream_however_many_it_holds_open(temporal_env, gateway, attacker) -> None:
    """The frontend's poll budget is shared (1,200 per namespace and frontend): one node's
    extra polls are held at the gateway, never forwarded, and answered as a long poll that
    found no task; another node's poll still goes through."""
    node, channel = attacker
    stats = gateway.running.gateway.stats
    before = stats.held_polls
    poll = call(channel, "PollActivityTaskQueue")
    held = [asyncio.ensure_future(poll(poll_request(node.name), timeout=5)) for _ in range(12)]
    await asyncio.sleep(1.5)
    assert stats.held_polls - before == POLLS_PER_NODE, "only two of its polls reach the server"

    other = unique("atk-other")
    await live_entity(temporal_env.client, other)
    neighbour = credentials(gateway.pki, other)
    async with node_channel(gateway.access, neighbour) as theirs:
        their_poll = asyncio.ensure_future(call(theirs, "PollActivityTaskQueue")(poll_request(other), timeout=4))
        await wait_for(lambda: stats.held_polls - before == POLLS_PER_NODE + 1, timeout=3)
        assert await code_of(their_poll) == OK
    await end_entity(temporal_env.client, other)
    # The held ones end as a long poll with no task does: an empty answer, no error.
    assert await gather_codes(held) == [OK] * len(held)


async def test_a_node_over_its_connection_limit_is_held_not_served(gateway, attacker) -> None:
    """Calls on a node's fifth connection while four carry its calls: held until their
    deadline, then RESOURCE_EXHAUSTED; its first four connections are served at once."""
    node, _channel = attacker
    channels = [node_channel(gateway.access, node) for _ in range(6)]
    try:
        # Four connections each hold a poll (two upstream, two waiting for a poll slot).
        polls = [asyncio.ensure_future(call(c, "PollActivityTaskQueue")(poll_request(node.name), timeout=6))
                 for c in channels[:4]]
        await asyncio.sleep(1.0)
        describe = DescribeNamespaceRequest(namespace="default").SerializeToString()
        # Its own connections are served (a held call ends RESOURCE_EXHAUSTED), none held.
        assert await code_of(call(channels[0], "DescribeNamespace")(describe, timeout=3)) == OK
        assert load_held(gateway, node.name) == 0
        # The fifth is held while its deadline runs (not answered, nor refused, at once), then refused.
        fifth = asyncio.ensure_future(call(channels[4], "DescribeNamespace")(describe, timeout=3))
        await wait_for(lambda: load_held(gateway, node.name) == 1, timeout=30)
        assert not fifth.done(), "answered at once, not held"
        assert await code_of(fifth) == EXHAUSTED
        await gather_codes(polls)
    finally:
        for channel in channels:
            await channel.close()


async def test_big_requests_are_refused_before_they_are_held(gateway, attacker) -> None:
    """3 MB polls never reach the server (the finding: 40 of them held 535 MB in the gateway
    and 625 MB in Temporal for a whole long poll); a poll over REQUEST_BYTES is refused; a
    result may be larger (RESULT_BYTES)."""
    node, channel = attacker
    stats = gateway.running.gateway.stats
    before = stats.held_polls
    poll = call(channel, "PollActivityTaskQueue")
    huge = poll_request(node.name, identity="x" * 3_000_000)
    big = poll_request(node.name, identity="x" * (REQUEST_BYTES + 1))
    most = {"polls": before, "held": 0}

    def sample() -> None:
        most["polls"] = max(most["polls"], stats.held_polls)
        most["held"] = max(most["held"], load_held(gateway, node.name))

    watcher = asyncio.ensure_future(_every(0.005, sample))
    try:
        codes = await gather_codes([poll(huge, timeout=5) for _ in range(20)] + [poll(big, timeout=5)])
    finally:
        watcher.cancel()
    assert codes == [EXHAUSTED] * 21
    # Refused, not held for a long poll: none was forwarded (a poll upstream) nor held meanwhile.
    assert most == {"polls": before, "held": 0}, most
    # A result of a quarter megabyte is within its own limit: judged (an undelivered token) on its merits.
    payload = Payload(metadata={"encoding": b"binary/plain"}, data=b"r" * (RESULT_BYTES // 2))
    result = RespondActivityTaskCompletedRequest(namespace="default", task_token=b"not-delivered",
                                                 result=Payloads(payloads=[payload])).SerializeToString()
    assert await code_of(call(channel, "RespondActivityTaskCompleted")(result, timeout=5)) == DENIED


async def test_a_node_holds_no_more_than_its_share_of_the_gateways_memory(gateway, attacker) -> None:
    """A held call's request stays in the gateway's memory until the call ends. A node over its
    call limit that sends result after half-megabyte result gets a few of them held; the rest are
    answered at once, so what it holds is bounded, however many it sends."""
    node, channel = attacker
    stats = gateway.running.gateway.stats
    # Its CALLS_PER_NODE calls: polls (two upstream, the rest waiting for a poll slot).
    polls = [asyncio.ensure_future(call(channel, "PollActivityTaskQueue")(poll_request(node.name), timeout=8))
             for _ in range(CALLS_PER_NODE)]
    await wait_for(lambda: gateway.running.gateway.load_of(node.name).calls == CALLS_PER_NODE, timeout=5)
    payload = Payload(metadata={"encoding": b"binary/plain"}, data=b"r" * (RESULT_BYTES - 4096))
    result = RespondActivityTaskCompletedRequest(namespace="default", task_token=b"t",
                                                 result=Payloads(payloads=[payload])).SerializeToString()
    can_hold = HELD_BYTES_PER_NODE // (len(result) + HELD_CALL_BYTES)
    others = [node_channel(gateway.access, node) for _ in range(3)]  # within its connection limit
    try:
        answered: list[grpc.StatusCode] = []

        async def send(c) -> grpc.StatusCode:
            code = await code_of(call(c, "RespondActivityTaskCompleted")(result, timeout=5))
            answered.append(code)
            return code

        sends = [asyncio.ensure_future(send(others[i % 3])) for i in range(can_hold + 12)]
        await wait_for(lambda: len(answered) >= 12, timeout=30)
        assert stats.held_bytes <= HELD_BYTES_PER_NODE
        # Twelve answered while its share is still held: the rest were answered at once, not held.
        assert load_held(gateway, node.name) == can_hold, "its share is held, no more"
        assert await asyncio.gather(*sends) == [EXHAUSTED] * len(sends)
    finally:
        for c in others:
            await c.close()
    await gather_codes(polls)
    assert stats.held_bytes == 0


async def test_a_node_holds_no_more_than_its_count_of_calls_however_small(temporal_env, gateway, attacker) -> None:
    """Each held call costs the gateway about 25 KiB however small its request: a node over its
    call limit that sends empty requests, 25 on each of connection after connection, gets
    HELD_CALLS_PER_NODE of them held; the rest are refused at once, saying why, and another
    node's calls still go through. Before, all were held (9,000 took 223 MiB) at 0 held bytes."""
    node, channel = attacker
    polls = [asyncio.ensure_future(call(channel, "PollActivityTaskQueue")(poll_request(node.name), timeout=8))
             for _ in range(CALLS_PER_NODE)]
    await wait_for(lambda: gateway.running.gateway.load_of(node.name).calls == CALLS_PER_NODE, timeout=5)
    most_held = 0

    def sample() -> None:
        nonlocal most_held
        most_held = max(most_held, load_held(gateway, node.name))

    watcher = asyncio.ensure_future(_every(0.005, sample))
    others = [node_channel(gateway.access, node) for _ in range(8)]  # past its connection limit too
    try:
        refusals: list[tuple[grpc.StatusCode, str]] = []

        async def send(c) -> None:
            try:
                await call(c, "GetSystemInfo")(b"", timeout=6)
            except grpc.aio.AioRpcError as error:
                refusals.append((error.code(), error.details()))

        sends = [asyncio.ensure_future(send(c)) for c in others for _ in range(25)]
        refused_now = len(sends) - HELD_CALLS_PER_NODE
        await wait_for(lambda: len(refusals) >= refused_now, timeout=30)
        # All those refused while its count is still held: the rest were refused at once, not held.
        assert load_held(gateway, node.name) == HELD_CALLS_PER_NODE, "its count is held, no more"
        assert {code for code, _ in refusals} == {EXHAUSTED}
        assert f"{HELD_CALLS_PER_NODE} of its calls held already" in refusals[0][1], refusals[0][1]

        other = unique("atk-other")
        await live_entity(temporal_env.client, other)
        async with node_channel(gateway.access, credentials(gateway.pki, other)) as theirs:
            # Another node is served (a held call ends RESOURCE_EXHAUSTED), none of its calls held.
            assert await code_of(call(theirs, "GetSystemInfo")(b"", timeout=3)) == OK
            assert load_held(gateway, other) == 0
        await end_entity(temporal_env.client, other)
        await asyncio.gather(*sends)
        assert len(refusals) == len(sends), "the held ones end RESOURCE_EXHAUSTED at their deadline"
    finally:
        watcher.cancel()
        for c in others:
            await c.close()
    await gather_codes(polls)
    assert most_held == HELD_CALLS_PER_NODE
    assert gateway.running.gateway.stats.held_bytes == 0


async def _every(seconds: float, do) -> None:
    while True:
        do()
        await asyncio.sleep(seconds)


def load_held(gateway, node: str) -> int:
    return gateway.running.gateway.load_of(node).held


@workflow.defn(name="SecurityOneNodeActivity", sandboxed=False)
class OneNodeActivity:
    """Schedules one activity on a node's queue (the node is the attacker: it polls it itself)."""

    @workflow.run
    async def run(self, queue: str) -> None:
        await workflow.execute_activity("watch_node", task_queue=queue, start_to_close_timeout=timedelta(minutes=5),
                                        heartbeat_timeout=timedelta(minutes=5))


async def test_a_node_heartbeats_upstream_at_a_bounded_rate(temporal_env, gateway, attacker) -> None:
    """Each heartbeat a node sends for a task it holds is a write in the store every workflow
    shares. One node heartbeating as fast as it can gets HEARTBEATS_PER_SECOND through (after a
    burst of HEARTBEAT_BURST); the rest are answered RESOURCE_EXHAUSTED and go nowhere."""
    node, channel = attacker
    client = temporal_env.client
    queue = unique("wf")
    async with Worker(client, task_queue=queue, workflows=[OneNodeActivity]):
        handle = await client.start_workflow(OneNodeActivity.run, f"node/{node.name}", id=unique("hb"),
                                             task_queue=queue)
        task = PollActivityTaskQueueResponse.FromString(
            await call(channel, "PollActivityTaskQueue")(poll_request(node.name), timeout=10))
        assert task.task_token, "the node holds a task"
        beat = RecordActivityTaskHeartbeatRequest(namespace="default", task_token=task.task_token).SerializeToString()
        heartbeat = call(channel, "RecordActivityTaskHeartbeat")
        loop = asyncio.get_running_loop()
        started = loop.time()
        codes = [await code_of(heartbeat(beat, timeout=5)) for _ in range(200)]
        seconds = loop.time() - started
        through = codes.count(OK)
        assert through + codes.count(EXHAUSTED) == len(codes), codes
        assert through <= HEARTBEAT_BURST + HEARTBEATS_PER_SECOND * seconds + 1, (through, seconds)
        assert codes[:HEARTBEAT_BURST] == [OK] * HEARTBEAT_BURST, "an honest agent's few heartbeats all go through"
        await handle.terminate("test over")


async def test_deployment_options_and_unknown_fields_are_dropped(temporal_env, gateway, attacker) -> None:
    """Deployment options on a poll create a Worker Deployment in the namespace when they
    reach the server; unknown fields would be held for the whole long poll. Neither is forwarded."""
    node, channel = attacker
    deployment = unique("planted-deployment")
    options = WorkerDeploymentOptions(deployment_name=deployment, build_id="b1",
                                      worker_versioning_mode=WorkerVersioningMode.WORKER_VERSIONING_MODE_VERSIONED)
    # Field 999 is no field of a poll: 30 kB the server would keep in memory as unknown bytes.
    unknown = b"\xba\x3e" + bytes([0xb0, 0xea, 0x01]) + b"u" * 30_000
    request = poll_request(node.name, deployment_options=options) + unknown
    assert await code_of(call(channel, "PollActivityTaskQueue")(request, timeout=4)) == OK
    listed = await temporal_env.client.workflow_service.list_worker_deployments(
        ListWorkerDeploymentsRequest(namespace="default"))
    assert deployment not in {d.name for d in listed.worker_deployments}, "no Worker Deployment was planted"

    # What the gateway forwards: the poll rebuilt from the fields a poll of its own queue needs.
    forwarded, _ = gateway.running.gateway.authorization.authorize(node.name, "PollActivityTaskQueue", request)
    assert forwarded == PollActivityTaskQueueRequest(
        namespace="default", identity=f"node:{node.name}",
        task_queue=TaskQueue(name=f"node/{node.name}", kind=1)).SerializeToString()
    sealed = gateway.running.gateway.authorization.tokens.seal(node.name, b"token-a")  # as delivered to it
    result = Payloads(payloads=[Payload(metadata={"encoding": b"json/plain"}, data=b"1")])
    done = RespondActivityTaskCompletedRequest(namespace="default", task_token=sealed, identity="me", result=result,
                                               deployment_options=options).SerializeToString() + unknown
    forwarded, _ = gateway.running.gateway.authorization.authorize(node.name, "RespondActivityTaskCompleted", done)
    assert forwarded == RespondActivityTaskCompletedRequest(namespace="default", task_token=b"token-a", result=result,
                                                            identity=f"node:{node.name}").SerializeToString()


async def _workers(client, instance_key: str) -> list:
    listed = await client.workflow_service.list_workers(ListWorkersRequest(namespace="default"))
    return [w for w in listed.workers_info if w.worker_heartbeat.worker_instance_key == instance_key]


async def test_shutdown_worker_needs_a_live_node_and_plants_no_worker(temporal_env, gateway, attacker) -> None:
    """Finding 4: ``ShutdownWorker`` skipped the liveness check, and the worker heartbeat it
    may carry planted a fake worker on the control plane's queue ``gpufleet``."""
    node, channel = attacker
    planted = unique("planted")
    heartbeat = WorkerHeartbeat(worker_instance_key=planted, task_queue="gpufleet", worker_identity="control-plane",
                                sdk_name="temporal-python")
    bye = ShutdownWorkerRequest(namespace="default", identity="x", reason="bye", worker_heartbeat=heartbeat,
                                worker_instance_key=planted).SerializeToString()
    assert await code_of(call(channel, "ShutdownWorker")(bye, timeout=5)) == OK
    await asyncio.sleep(0.5)
    assert await _workers(temporal_env.client, planted) == [], "no worker planted on any queue"

    # A worker heartbeat, even about its own queue, is refused (test_worker_heartbeats.py).
    own = WorkerHeartbeat(worker_instance_key=planted, task_queue=f"node/{node.name}", worker_identity="someone",
                          deployment_version=WorkerDeploymentVersion(deployment_name="d", build_id="b"),
                          sdk_name="temporal-python")
    beat = RecordWorkerHeartbeatRequest(namespace="default", worker_heartbeat=[own]).SerializeToString()
    assert await code_of(call(channel, "RecordWorkerHeartbeat")(beat, timeout=5)) == DENIED
    await asyncio.sleep(0.5)
    assert await _workers(temporal_env.client, planted) == [], "no worker planted on its own queue either"

    # A never-joined identity (no entity, no join) is refused like any other call.
    stranger = credentials(gateway.pki, unique("never-joined"))
    async with node_channel(gateway.access, stranger) as theirs:
        refused_bye = ShutdownWorkerRequest(namespace="default", task_queue=f"node/{stranger.name}").SerializeToString()
        assert await code_of(call(theirs, "ShutdownWorker")(refused_bye, timeout=5)) == DENIED


async def test_names_a_node_sends_are_cut_short_in_errors_and_logs(gateway, attacker, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="gpufleet.node_gateway")
    node, channel = attacker
    long_queue = "q" * 20_000
    request = PollActivityTaskQueueRequest(namespace="default", task_queue=TaskQueue(name=long_queue))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(channel, "PollActivityTaskQueue")(request.SerializeToString(), timeout=5)
    assert caught.value.code() == DENIED and len(caught.value.details()) < 300, caught.value.details()[:400]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(channel, "DescribeNamespace")(DescribeNamespaceRequest(namespace="n" * 20_000).SerializeToString(),
                                                 timeout=5)
    assert caught.value.code() == DENIED and len(caught.value.details()) < 300
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        # 4,000: under gRPC's 8 KiB soft limit on metadata (the :path), past which the transport
        # itself refuses at random (RESOURCE_EXHAUSTED) before the gateway sees the call.
        await channel.unary_unary("/temporal.api.workflowservice.v1.WorkflowService/" + "M" * 4_000,
                                  request_serializer=None, response_deserializer=None)(b"", timeout=5)
    assert caught.value.code() == DENIED and len(caught.value.details()) < 300
    lines = [r.getMessage() for r in caplog.records if r.name == "gpufleet.node_gateway" and node.name in r.getMessage()]
    assert len(lines) >= 3 and all(len(line) < 400 for line in lines), [line[:120] for line in lines]


def _lines_about(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpufleet.node_gateway" and name in r.getMessage()]


async def test_a_retired_node_refused_500_times_writes_a_few_log_lines(temporal_env, caplog) -> None:
    """Security audit: every refused call was logged, one warning a call, so a retired node whose
    certificate is still valid wrote the gateway's log (and the log pipeline every component
    shares) at its full call rate: 500 calls, 500 lines. Now its first refusal is logged at once
    and the rest are counted into one line when the minute ends; every call is still refused,
    and counted in ``gpufleet_gateway_refused``."""
    caplog.set_level(logging.WARNING, logger="gpufleet.node_gateway")
    own = await start_test_gateway(temporal_env.client)
    gateway = own.running.gateway
    name = unique("retired")
    await live_entity(temporal_env.client, name)
    await end_entity(temporal_env.client, name)  # retired; its certificate is valid for hours more
    node = credentials(own.pki, name)
    try:
        async with node_channel(own.access, node) as channel:
            poll = call(channel, "PollActivityTaskQueue")

            async def polls(count: int) -> list[grpc.StatusCode]:
                return [await code_of(poll(poll_request(name), timeout=10)) for _ in range(count)]

            # Ten at once: under CALLS_PER_NODE, so none is held.
            codes = [code for some in await asyncio.gather(*(polls(50) for _ in range(10))) for code in some]
            assert codes == [DENIED] * 500, "the refusal itself is unchanged"
            first = _lines_about(caplog, name)
            assert len(first) == 1, f"{len(first)} lines for 500 refused calls: {first[:3]}"
            assert f"node {name}: PollActivityTaskQueue refused: {Verdict.RETIRED.value}" in first

            # The minute is over: the next refusal brings the count, and is logged itself.
            gateway.node_log.clock = lambda: time.monotonic() + NODE_LOG_SECONDS
            assert await code_of(poll(poll_request(name), timeout=10)) == DENIED
    finally:
        await own.running.stop(grace=None)
    lines = _lines_about(caplog, name)
    assert len(lines) == 3, lines
    assert (f"node {name}: 499 more PollActivityTaskQueue refused ({Verdict.RETIRED.value}) "
            f"in the last {NODE_LOG_SECONDS:g} s") in lines, lines
    assert gateway.stats.refused == 501, "the metric counts every refusal"


async def test_a_nodes_left_out_warnings_are_counted_when_its_window_ends_and_its_keys_are_bounded(caplog) -> None:
    """A node that stops calling still gets its count (at the window's end, no later call needed);
    what a node sent never opens a window of its own; a full table closes its oldest window early,
    its count logged, so the bookkeeping's memory is bounded."""
    caplog.set_level(logging.WARNING, logger="test.node_log")
    node_log = NodeLog(logging.getLogger("test.node_log"), seconds=0.3, windows=2)
    for _ in range(4):
        node_log.warn("n1", "Poll refused", "namespace …", "node %s: namespace %s", "n1", "'x'")
    assert [r.getMessage() for r in caplog.records] == ["node n1: namespace 'x'"]
    await wait_for(lambda: len(caplog.records) == 2, timeout=3)
    assert caplog.records[1].getMessage() == "node n1: 3 more Poll refused (namespace …) in the last 0.3 s"

    caplog.clear()
    node_log.seconds, node_log.clock = 60.0, lambda: 100.0
    for node in ("a", "a", "b", "c"):  # c's window is the third: a's, the oldest, closes early
        node_log.warn(node, "calls over its limits", "", "node %s over its limits", node)
    assert [r.getMessage() for r in caplog.records] == [
        "node a over its limits", "node b over its limits",
        "node a: 1 more calls over its limits in the last 0 s", "node c over its limits"]
    assert len(node_log._windows) == 2

    # Names a node makes up share one window; the workflow service's own calls are named.
    caplog.clear()
    authorization = NodeAuthorization("default", GatewayStats(), TaskTokens(token_keys_as_deployed()),
                                      NodeLog(logging.getLogger("test.node_log")))
    for made_up in ("Made", "Up", "Names", "StartWorkflowExecution"):
        authorization.refuse("n1", made_up, "not a node agent's call")
    assert [r.getMessage() for r in caplog.records] == [
        "node n1: Made refused: not a node agent's call",
        "node n1: StartWorkflowExecution refused: not a node agent's call"]
