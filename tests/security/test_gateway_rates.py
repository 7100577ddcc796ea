"""One node spends the frontend's request rate, which every node and the control plane share.

Before, the gateway bounded a node's calls at once, not their rate (heartbeats only): 16
``DescribeNamespace`` at once got 4,768 calls forwarded in 3 s, and a poll opened and cancelled
in a loop sent about 350 polls a second upstream. Now each node has a token bucket for the calls
it sends upstream (``proxy.CALLS_PER_SECOND``; a task delivered to it pays for its poll and its
result), a call over it is answered RESOURCE_EXHAUSTED by the gateway, and ``GetSystemInfo`` and
``DescribeNamespace`` are answered from one copy (``proxy.StartupAnswers``).

What reaches the frontend is counted there: the gateway under test forwards to a pass-through
gRPC proxy in front of the session's dev server (``CountingFrontend``). Its budget is set far
below the default, so the bound stays far apart from what the old gateway forwarded however
slowly this machine runs the loops.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc
import pytest
from temporalio import workflow
from temporalio.api.workflowservice.v1 import (
    DescribeNamespaceRequest,
    GetSystemInfoRequest,
    PollActivityTaskQueueRequest,
)
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from fleet.naming import node_queue
from fleet.settings import Settings
from tests.security.gateway_helpers import (
    call,
    code_of,
    credentials,
    end_entity,
    live_entity,
    node_channel,
    poll_request,
    unique,
)
from workers.gateway.liveness import temporal_liveness
from workers.gateway.node_identity import GatewayAccess
from workers.gateway.pki import Pki
from workers.gateway.proxy import STARTUP_ANSWER_SECONDS, StartupAnswers, start_gateway
from workers.node_agent import build_agent, connect_via_gateway

#: The gateway's budget here: far below the default, so that what the old gateway forwarded
#: (every call) and the bound (``BURST + RATE`` × the blast's seconds) stay far apart.
RATE, BURST = 2.0, 10
#: Calls the node sends: start-up calls from 14 loops at once (with its two polls, the 16 calls
#: at once the gateway takes from a node), and polls opened and cancelled in two loops.
STARTUP_CALLS, STARTUP_LOOPS = 600, 14
POLL_CYCLES, POLL_LOOPS = 200, 2
#: The honest node's watches during the blast, each a poll and a result: three times its burst
#: of calls, which the tasks delivered to it pay for.
WATCHES = 15


class CountingFrontend(grpc.GenericRpcHandler):
    """A pass-through gRPC proxy in front of the dev server, counting what reaches it: calls by
    method, polls by task queue."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.calls: Counter[str] = Counter()
        self.polls: Counter[str] = Counter()

    def service(self, details: grpc.HandlerCallDetails):
        method = details.method
        stub = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            self.calls[method.rsplit("/", 1)[-1]] += 1
            if method.endswith("/PollActivityTaskQueue"):
                self.polls[PollActivityTaskQueueRequest.FromString(request).task_queue.name] += 1
            metadata = tuple((k, v) for k, v in context.invocation_metadata() or ()
                             if not k.startswith((":", "grpc-")) and k != "user-agent")
            try:
                return await stub(request, metadata=metadata, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as error:
                context.set_trailing_metadata(tuple(error.trailing_metadata() or ()))
                await context.abort(error.code(), error.details() or "")

        return grpc.unary_unary_rpc_method_handler(forward)


@pytest.fixture
async def counted(temporal_env):
    """A gateway of its own (``RATE``, ``BURST``), forwarding through a ``CountingFrontend``."""
    client = temporal_env.client
    frontend = CountingFrontend(client.service_client.config.target_host)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((frontend,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pki = Pki.create("gpufleet rate-test CA")
    cert, key = pki.server_cert()
    running = await start_gateway(Settings(address=f"127.0.0.1:{port}", namespace=client.namespace), cert, key,
                                  pki.ca_pem, live=temporal_liveness(client), calls_per_second=RATE, call_burst=BURST)
    try:
        yield frontend, pki, GatewayAccess(running.address, pki.ca_pem)
    finally:
        await running.stop(grace=None)
        await server.stop(None)
        await frontend.channel.close()


class QuietGpus:
    """A node with no GPU trouble (the honest agent's backend)."""

    def boot_id(self) -> str:
        return "boot-1"

    def probe(self) -> list:
        return []


@workflow.defn(name="SecurityWatches", sandboxed=False)
class Watches:
    """The node's health watch (``watch_node`` on its queue), ``count`` times in a row."""

    @workflow.run
    async def run(self, args: list) -> list[int]:
        node, count = args
        seen = []
        for seq in range(count):
            answer = await workflow.execute_activity(
                "watch_node", {"node_name": node, "seq": seq, "digest": "", "max_wait_seconds": 30},
                task_queue=node_queue(node), start_to_close_timeout=timedelta(seconds=60))
            seen.append(answer["seq"])
        return seen


async def test_one_nodes_call_flood_reaches_the_frontend_as_a_bounded_count(temporal_env, counted, caplog) -> None:
    """One node sends 600 start-up calls, 14 at once, and opens and cancels 200 polls, while
    another node's honest agent runs its watches through the same gateway. The frontend gets at
    most the node's burst and rate of its polls (the rest answered RESOURCE_EXHAUSTED, which the
    SDK backs off on) and one fetch of each start-up answer per ``STARTUP_ANSWER_SECONDS``
    (before: every call); the honest node's watches all complete during the blast, none of its
    calls over its budget (its tasks pay for their polls and results)."""
    frontend, pki, access = counted
    control = temporal_env.client
    attacker, honest = unique("flood"), unique("honest")
    for name in (attacker, honest):
        await live_entity(control, name)
    channel = node_channel(access, credentials(pki, attacker))
    victim = credentials(pki, honest)
    loop = asyncio.get_running_loop()
    try:
        # As the node agent runs it: no SDK worker heartbeats (workers/node_agent.py).
        victim_client = await connect_via_gateway(access, "default", victim.cert, victim.key, runtime=Runtime(
            telemetry=TelemetryConfig(), worker_heartbeat_interval=None))
        queue = unique("security-watches")
        with ThreadPoolExecutor(5) as executor:
            async with Worker(control, task_queue=queue, workflows=[Watches],
                              workflow_runner=UnsandboxedWorkflowRunner()), \
                    build_agent(victim_client, honest, QuietGpus(), executor):
                startups_before = frontend.calls["DescribeNamespace"] + frontend.calls["GetSystemInfo"]
                started = loop.time()
                watched = asyncio.ensure_future(control.execute_workflow(
                    "SecurityWatches", [honest, WATCHES], id=unique("security-watches"), task_queue=queue,
                    execution_timeout=timedelta(seconds=120)))

                startup_codes: Counter = Counter()
                startup_left = [STARTUP_CALLS]

                async def ask_at_start_up() -> None:
                    describe = DescribeNamespaceRequest(namespace="default").SerializeToString()
                    info = GetSystemInfoRequest().SerializeToString()
                    while startup_left[0] > 0:
                        startup_left[0] -= 1
                        method, request = (("DescribeNamespace", describe) if startup_left[0] % 2
                                           else ("GetSystemInfo", info))
                        startup_codes[await code_of(call(channel, method)(request, timeout=10))] += 1

                poll_codes: Counter = Counter()
                cycles = [0]

                async def open_and_cancel_polls() -> None:
                    # Until the honest node's watches are done too: they run during the blast.
                    while cycles[0] < POLL_CYCLES or not watched.done():
                        cycles[0] += 1
                        pending = asyncio.ensure_future(call(channel, "PollActivityTaskQueue")(
                            poll_request(attacker), timeout=60))
                        done, _ = await asyncio.wait({pending}, timeout=0.05)
                        if not done:
                            pending.cancel()
                            poll_codes["cancelled"] += 1
                        else:
                            poll_codes[await code_of(pending)] += 1
                            await asyncio.sleep(0.05)  # the same pace either way: the count is the point

                await asyncio.gather(*(ask_at_start_up() for _ in range(STARTUP_LOOPS)),
                                     *(open_and_cancel_polls() for _ in range(POLL_LOOPS)))
                elapsed = loop.time() - started
                # Each watch answers at once (its digest differs from the state the agent sees).
                assert await watched == list(range(1, WATCHES + 1)), "the honest node's watches completed"
                upstream_polls = frontend.polls[node_queue(attacker)]
                upstream_startups = frontend.calls["DescribeNamespace"] + frontend.calls["GetSystemInfo"] \
                    - startups_before
    finally:
        await channel.close()
        for name in (attacker, honest):
            await end_entity(control, name)

    assert cycles[0] >= POLL_CYCLES and sum(startup_codes.values()) == STARTUP_CALLS
    assert upstream_polls <= BURST + RATE * elapsed, (
        f"{upstream_polls} of the node's {cycles[0]} polls reached the frontend in {elapsed:.1f} s "
        f"(its budget: {BURST} + {RATE:g}/s); answers: {dict(poll_codes)}")
    assert poll_codes[grpc.StatusCode.RESOURCE_EXHAUSTED] > 0, poll_codes
    fetches = 2 * (1 + math.ceil(elapsed / STARTUP_ANSWER_SECONDS))
    assert upstream_startups <= fetches, (
        f"{upstream_startups} of {STARTUP_CALLS} start-up calls reached the frontend in {elapsed:.1f} s")
    assert set(startup_codes) == {grpc.StatusCode.OK}, startup_codes
    over = [r.getMessage() for r in caplog.records if "over its limits" in r.getMessage()]
    assert not [line for line in over if honest in line], over
    assert [line for line in over if attacker in line], "the test proves nothing: the flood was never over its budget"


async def test_start_up_answers_are_fetched_once_for_callers_at_once_and_a_failure_is_not_kept() -> None:
    now = [0.0]
    answers = StartupAnswers(10.0, clock=lambda: now[0])
    fetched: list[str] = []

    async def fetch() -> bytes:
        fetched.append("x")
        await asyncio.sleep(0.01)
        if len(fetched) == 1:
            raise RuntimeError("the frontend is away")
        return b"answer"

    first = await asyncio.gather(*(answers.get("DescribeNamespace", fetch) for _ in range(5)), return_exceptions=True)
    assert len(fetched) == 1 and all(isinstance(e, RuntimeError) for e in first), "one fetch, its error to each"
    assert await asyncio.gather(*(answers.get("DescribeNamespace", fetch) for _ in range(5))) == [b"answer"] * 5
    assert len(fetched) == 2, "the failure was not kept; the answer is"
    now[0] = 9.9
    await answers.get("DescribeNamespace", fetch)
    assert len(fetched) == 2
    now[0] = 10.0
    await answers.get("DescribeNamespace", fetch)
    assert len(fetched) == 3, "fetched again once stale"
