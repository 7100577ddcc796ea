"""One node, or many together, spend the frontend's request rate, which every node and the
control plane share.

Before, the gateway bounded a node's calls at once, not their rate (heartbeats only): 16
``DescribeNamespace`` at once got 4,768 calls forwarded in 3 s, and a poll opened and cancelled
in a loop sent about 350 polls a second upstream. Now each node has a token bucket for the calls
it sends upstream (``proxy.CALLS_PER_SECOND``; a task delivered to it pays for its poll and its
result), a call over it is answered RESOURCE_EXHAUSTED by the gateway, and ``GetSystemInfo`` and
``DescribeNamespace`` are answered from one copy (``proxy.StartupAnswers``).

Many nodes each within their own budget still spent it together: a call went upstream whenever
its node's bucket had a token. Now everything the gateway forwards takes from one budget
(``fleet_budget.FleetBudget``, ``proxy.UPSTREAM_CALLS_PER_SECOND``), shared max-min fairly: a
node is refused only while every node that used as much of it or more is refused too.

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
from contextlib import asynccontextmanager
from datetime import timedelta

import grpc
import pytest
from temporalio import workflow
from temporalio.api.workflowservice.v1 import (
    DescribeNamespaceRequest,
    GetSystemInfoRequest,
    PollActivityTaskQueueRequest,
    RespondActivityTaskCompletedRequest,
)
from temporalio.client import Client
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from fleet.naming import node_queue
from fleet.settings import Settings
from tests.gateway_keys import token_keys_as_deployed
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
from workers.gateway.fleet_budget import FleetBudget
from workers.gateway.liveness import temporal_liveness
from workers.gateway.node_identity import GatewayAccess
from workers.gateway.pki import Pki
from workers.gateway.proxy import (
    CALLS_PER_TASK,
    FAILED_STARTUP_ANSWER_SECONDS,
    MIN_UPSTREAM_POLL_SECONDS,
    STARTUP_ANSWER_SECONDS,
    StartupAnswers,
    start_gateway,
)
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
    method, polls by task queue, completions by the identity the gateway wrote in them. The
    methods in ``failing`` are answered UNAVAILABLE, not passed on (a frontend restarting, or
    refusing under load)."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.calls: Counter[str] = Counter()
        self.polls: Counter[str] = Counter()
        self.completions: Counter[str] = Counter()
        self.failing: set[str] = set()

    def service(self, details: grpc.HandlerCallDetails):
        method = details.method
        stub = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            name = method.rsplit("/", 1)[-1]
            self.calls[name] += 1
            if method.endswith("/PollActivityTaskQueue"):
                self.polls[PollActivityTaskQueueRequest.FromString(request).task_queue.name] += 1
            if name in self.failing:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "frontend away")
            if method.endswith("/RespondActivityTaskCompleted"):
                self.completions[RespondActivityTaskCompletedRequest.FromString(request).identity] += 1
            metadata = tuple((k, v) for k, v in context.invocation_metadata() or ()
                             if not k.startswith((":", "grpc-")) and k != "user-agent")
            try:
                return await stub(request, metadata=metadata, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as error:
                context.set_trailing_metadata(tuple(error.trailing_metadata() or ()))
                await context.abort(error.code(), error.details() or "")

        return grpc.unary_unary_rpc_method_handler(forward)


async def every_node_live(node: str, key: str) -> bool:
    return True


@asynccontextmanager
async def counting_gateway(client, lookups_counted: bool = False, **limits):
    """A gateway of its own (``limits``: ``start_gateway``'s), forwarding through a
    ``CountingFrontend``: the frontend, the CA, the gateway's address and the gateway.
    ``lookups_counted``: its liveness lookups go through the ``CountingFrontend`` too. No
    ``client``: no server behind the frontend (every method the test calls must be ``failing``),
    and every node live."""
    frontend = CountingFrontend(client.service_client.config.target_host if client else "127.0.0.1:9")
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((frontend,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pki = Pki.create("gpufleet rate-test CA")
    cert, key = pki.server_cert()
    if lookups_counted:
        client = await Client.connect(f"127.0.0.1:{port}", namespace=client.namespace)
    running = await start_gateway(Settings(address=f"127.0.0.1:{port}", namespace=client.namespace if client else "default"),
                                  cert, key, pki.ca_pem, token_keys_as_deployed(),
                                  live=temporal_liveness(client) if client else every_node_live, **limits)
    try:
        yield frontend, pki, GatewayAccess(running.address, pki.ca_pem), running.gateway
    finally:
        await running.stop(grace=None)
        await server.stop(None)
        await frontend.channel.close()


@pytest.fixture
async def counted(temporal_env):
    """A gateway of its own (``RATE``, ``BURST``), forwarding through a ``CountingFrontend``."""
    async with counting_gateway(temporal_env.client, calls_per_second=RATE, call_burst=BURST) as (frontend, pki,
                                                                                                   access, _):
        yield frontend, pki, access


class QuietGpus:
    """A node with no GPU trouble (the honest agent's backend)."""

    def boot_id(self) -> str:
        return "boot-1"

    def probe(self) -> list:
        return []


@workflow.defn(name="SecurityWatches", sandboxed=False)
class Watches:
    """The node's health watch (``watch_node`` on its queue), ``count`` times in a row, ``pause``
    seconds apart (none unless given)."""

    @workflow.run
    async def run(self, args: list) -> list[int]:
        node, count, *pause = args
        seen = []
        for seq in range(count):
            if seq and pause:
                await workflow.sleep(pause[0])
            answer = await workflow.execute_activity(
                "watch_node", {"node_name": node, "seq": seq, "digest": "", "max_wait_seconds": 30},
                task_queue=node_queue(node), start_to_close_timeout=timedelta(seconds=60))
            seen.append(answer["seq"])
        return seen


@asynccontextmanager
async def honest_agent(control, access: GatewayAccess, pki: Pki, honest: str):
    """``honest``'s node agent connected through the gateway, and a worker running ``Watches``
    for it: the workflows' task queue."""
    victim = credentials(pki, honest)
    # As the node agent runs it: no SDK worker heartbeats (workers/node_agent.py).
    client = await connect_via_gateway(access, "default", victim.cert, victim.key, runtime=Runtime(
        telemetry=TelemetryConfig(), worker_heartbeat_interval=None))
    queue = unique("security-watches")
    with ThreadPoolExecutor(5) as executor:
        async with Worker(control, task_queue=queue, workflows=[Watches],
                          workflow_runner=UnsandboxedWorkflowRunner()), \
                build_agent(client, honest, QuietGpus(), executor):
            yield queue


async def open_and_cancel_poll(channel: grpc.aio.Channel, node: str, codes: Counter, pace: float) -> None:
    """A poll on ``node``'s own queue, cancelled after ``pace`` seconds unless answered first (then
    a pause of ``pace``: the same pace either way, the count is the point); how it ended counted in
    ``codes``."""
    pending = asyncio.ensure_future(call(channel, "PollActivityTaskQueue")(poll_request(node), timeout=60))
    done, _ = await asyncio.wait({pending}, timeout=pace)
    if not done:
        pending.cancel()
        codes["cancelled"] += 1
    else:
        codes[await code_of(pending)] += 1
        await asyncio.sleep(pace)


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
    loop = asyncio.get_running_loop()
    try:
        async with honest_agent(control, access, pki, honest) as queue:
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
                    await open_and_cancel_poll(channel, attacker, poll_codes, 0.05)

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


async def test_start_up_answers_are_fetched_once_for_callers_at_once_and_a_failure_is_kept_a_second() -> None:
    """Callers at once share one fetch; its answer is kept 10 s, its error 1 s (before: not at
    all, so while the frontend failed every call fetched again); a fetch its caller may not start
    (``start`` raises) is neither made nor kept."""
    now = [0.0]
    answers = StartupAnswers(10.0, 1.0, clock=lambda: now[0])
    fetched: list[str] = []

    async def fetch() -> bytes:
        fetched.append("x")
        await asyncio.sleep(0.01)
        if len(fetched) == 1:
            raise RuntimeError("the frontend is away")
        return b"answer"

    def refused() -> bytes:
        raise PermissionError("over its rate")

    first = await asyncio.gather(*(answers.get("DescribeNamespace", fetch) for _ in range(5)), return_exceptions=True)
    assert len(fetched) == 1 and all(isinstance(e, RuntimeError) for e in first), "one fetch, its error to each"
    now[0] = 0.9
    with pytest.raises(RuntimeError):
        await answers.get("DescribeNamespace", fetch)
    assert len(fetched) == 1, "the failure is kept a second: no fetch meanwhile"
    now[0] = 1.0
    with pytest.raises(PermissionError):
        await answers.get("DescribeNamespace", refused)
    assert await asyncio.gather(*(answers.get("DescribeNamespace", fetch) for _ in range(5))) == [b"answer"] * 5
    assert len(fetched) == 2, "a refused fetch keeps nothing; the answer is kept"
    now[0] = 10.9
    await answers.get("DescribeNamespace", fetch)
    assert len(fetched) == 2
    now[0] = 11.0
    await answers.get("DescribeNamespace", fetch)
    assert len(fetched) == 3, "fetched again once stale"


async def describe_namespace_in_loops(channel: grpc.aio.Channel, loops: int, seconds: float) -> Counter:
    """``DescribeNamespace`` from ``loops`` loops at once for ``seconds``: how the calls ended."""
    request = DescribeNamespaceRequest(namespace="default").SerializeToString()
    codes: Counter = Counter()
    end = asyncio.get_running_loop().time() + seconds

    async def ask() -> None:
        while asyncio.get_running_loop().time() < end:
            codes[await code_of(call(channel, "DescribeNamespace")(request, timeout=5))] += 1

    await asyncio.gather(*(ask() for _ in range(loops)))
    return codes


async def test_a_node_over_its_rate_starts_no_start_up_fetch_and_the_budget_never_goes_below_empty() -> None:
    """While the frontend fails, a node over its own rate asks ``DescribeNamespace``, then asks it
    16 at once for a second. Before, each call started a fetch, outside the node's rate, taking a
    token whatever the budget held (a failed fetch was not kept): about a thousand tokens below
    empty, and a node that never called was refused (for minutes at the default budget). Now the
    call that starts a fetch takes one of its node's calls (over its rate, it is refused without a
    fetch) and a token only if the budget holds one."""
    async with counting_gateway(None, calls_per_second=1.0, call_burst=3, upstream_calls_per_second=10.0) as (
            frontend, pki, access, gateway):
        frontend.failing = {"DescribeNamespace", "PollActivityTaskQueue"}
        node = unique("looping")
        channel = node_channel(access, credentials(pki, node))
        try:
            # Its own rate spent on polls (each forwarded, and failed upstream).
            while await code_of(call(channel, "PollActivityTaskQueue")(poll_request(node), timeout=5)) \
                    != grpc.StatusCode.RESOURCE_EXHAUSTED:
                pass
            over_its_rate = await code_of(call(channel, "DescribeNamespace")(
                DescribeNamespaceRequest(namespace="default").SerializeToString(), timeout=5))
            fetched_over_its_rate = frontend.calls["DescribeNamespace"]
            codes = await describe_namespace_in_loops(channel, 16, 1.0)
            never_called_admitted = gateway.budget.admit(unique("never-called"))
        finally:
            await channel.close()
    assert over_its_rate == grpc.StatusCode.RESOURCE_EXHAUSTED and not fetched_over_its_rate, (
        over_its_rate, "a node over its own rate started a fetch")
    assert never_called_admitted, (
        f"a node that never called was refused: {frontend.calls['DescribeNamespace']} fetches for "
        f"{dict(codes)} calls took the budget below empty")


#: Certificates, each with a key of its own, a node presents one after another to a gateway whose
#: upstream budget is ``LOOKUP_RATE`` a second: each is a (node, key) no verdict is kept for.
KEYS, LOOKUP_RATE = 60, 1.0


async def test_a_nodes_liveness_lookups_reach_the_frontend_within_its_share(temporal_env) -> None:
    """A node presents a certificate with a new key on each call (a kubelet may renew its own
    through an approver that does not ask gpufleet; without a cluster, as here, every key is looked
    up in Temporal). Each is a liveness lookup no cached verdict answers, and each lookup went to
    the frontend beside the budget: 60 certificates, 60 DescribeWorkflowExecution. Now each lookup
    is one of the node's calls and takes a token of the upstream budget, and one over either is
    answered RESOURCE_EXHAUSTED without a lookup."""
    control = temporal_env.client
    node = unique("many-keys")
    await live_entity(control, node)
    loop = asyncio.get_running_loop()
    codes: Counter = Counter()
    info = GetSystemInfoRequest().SerializeToString()
    try:
        async with counting_gateway(control, lookups_counted=True,
                                    upstream_calls_per_second=LOOKUP_RATE) as (frontend, pki, access, gateway):
            certificates = [credentials(pki, node) for _ in range(KEYS)]
            started = loop.time()
            for certificate in certificates:
                channel = node_channel(access, certificate)
                try:
                    codes[await code_of(call(channel, "GetSystemInfo")(info, timeout=10))] += 1
                finally:
                    await channel.close()
            elapsed = loop.time() - started
            lookups = frontend.calls["DescribeWorkflowExecution"] + frontend.calls["CountWorkflowExecutions"]
            burst = gateway.budget.burst
    finally:
        await end_entity(control, node)

    assert codes[grpc.StatusCode.OK] >= 1, codes
    assert lookups <= burst + LOOKUP_RATE * elapsed, (
        f"{lookups} liveness lookups of one node's {KEYS} certificates reached the frontend in {elapsed:.1f} s "
        f"(the budget: {burst:g} + {LOOKUP_RATE:g}/s); answers: {dict(codes)}")
    assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] > 0, codes


# -- many nodes, each within its own budget ------------------------------------------------------
#: The gateway's budgets in the many-nodes test: each node's, and every node's together. The
#: attackers together ask for ``ATTACKERS`` × ``NODE_RATE``, six times the budget, each within its own.
NODE_RATE, NODE_BURST = 5.0, 10
UPSTREAM_RATE = 10.0
ATTACKERS = 12
#: The honest node's watches, one a second: each a poll and a result, a fifth of the budget.
HONEST_WATCHES, HONEST_PAUSE = 10, 1.0
#: Polls each attacker opens and cancels (at twice its own rate), at least, and on until the honest node's
#: watches are done too.
ATTACK_CYCLES = 60


@pytest.fixture
async def budgeted(temporal_env):
    """A gateway of its own (``NODE_RATE``, ``NODE_BURST``, ``UPSTREAM_RATE``), forwarding through
    a ``CountingFrontend``."""
    async with counting_gateway(temporal_env.client, calls_per_second=NODE_RATE, call_burst=NODE_BURST,
                                upstream_calls_per_second=UPSTREAM_RATE) as counted:
        yield counted


async def test_many_nodes_each_within_its_budget_reach_the_frontend_as_one_budget(temporal_env, budgeted) -> None:
    """Twelve nodes (a compromised site) each open and cancel polls at twice their own rate, while
    another node's honest agent runs its watches through the same gateway. Before, each node's
    calls went upstream as its own bucket allowed: twelve buckets' worth. Now the frontend gets at
    most the gateway's one budget however many nodes call, and the honest node, whose tasks pay
    for its calls, is never refused while they are: each of its watches' polls and results
    reaches the frontend."""
    frontend, pki, access, gateway = budgeted
    refused: list[str] = []  # each call refused, by its node (the log says so once a minute)
    over_limit = gateway._over_limit
    gateway._over_limit = lambda node, why: (refused.append(node), over_limit(node, why))
    control = temporal_env.client
    attackers = [unique(f"site-{i}") for i in range(ATTACKERS)]
    honest = unique("honest")
    for name in (*attackers, honest):
        await live_entity(control, name)
    channels = {name: node_channel(access, credentials(pki, name)) for name in attackers}
    loop = asyncio.get_running_loop()
    try:
        async with honest_agent(control, access, pki, honest) as queue:
            before = sum(frontend.calls.values())
            started = loop.time()
            codes: Counter = Counter()
            cycles: Counter = Counter()
            watched: asyncio.Future | None = None
            attack_on = 0  # refusals before every attacker called at its rate

            async def open_and_cancel_polls(name: str) -> None:
                while cycles[name] < ATTACK_CYCLES or watched is None or not watched.done():
                    cycles[name] += 1
                    await open_and_cancel_poll(channels[name], name, codes, 1 / (2 * NODE_RATE))

            async def watch_once_the_attack_is_on() -> None:
                # Once every attacker has asked for twice its burst: each is calling at its
                # own rate, the budget shared among them all.
                nonlocal watched, attack_on
                while min(cycles[name] for name in attackers) < 2 * NODE_BURST:
                    await asyncio.sleep(0.05)
                attack_on = len(refused)
                watched = asyncio.ensure_future(control.execute_workflow(
                    "SecurityWatches", [honest, HONEST_WATCHES, HONEST_PAUSE], id=unique("security-watches"),
                    task_queue=queue, execution_timeout=timedelta(seconds=120)))
                await watched

            await asyncio.gather(watch_once_the_attack_is_on(),
                                 *(open_and_cancel_polls(name) for name in attackers))
            elapsed = loop.time() - started
            assert await watched == list(range(1, HONEST_WATCHES + 1)), "the honest node's watches completed"
            upstream = sum(frontend.calls.values()) - before
            attackers_upstream = {name: frontend.polls[node_queue(name)] for name in attackers}
            honest_polls = frontend.polls[node_queue(honest)]
            honest_results = frontend.completions[f"node:{honest}"]
    finally:
        for channel in channels.values():
            await channel.close()
        for name in (*attackers, honest):
            await end_entity(control, name)

    asked = sum(cycles.values())
    budget = gateway.budget.burst + UPSTREAM_RATE * elapsed
    startup_fetches = 2 * (1 + math.ceil(elapsed / STARTUP_ANSWER_SECONDS))
    assert asked >= 3 * budget, f"the test proves nothing: the nodes asked {asked} calls, the budget is {budget:.0f}"
    assert upstream <= budget + startup_fetches, (
        f"{upstream} calls reached the frontend in {elapsed:.1f} s (the budget: {gateway.budget.burst:g} + "
        f"{UPSTREAM_RATE:g}/s); the {ATTACKERS} nodes' polls: {attackers_upstream}, answers: {dict(codes)}")
    assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] > 0 and gateway.stats.over_budget > 0, codes
    # Every poll that brought the honest node a watch, and each watch's result, went upstream.
    assert honest_results == HONEST_WATCHES and honest_polls >= HONEST_WATCHES, (honest_polls, honest_results)
    # Once the attack is on. As it begins, each attacker new, the honest node's calls of the
    # second before are the most of anyone's, and max-min fairness may refuse one (its agent
    # retries): a node is refused only while every node that used as much or more is.
    assert honest not in refused[attack_on:], Counter(refused[attack_on:])
    assert refused[attack_on:], "the test proves nothing: no call was refused once the attack was on"


#: How long the frontend fails while a node loops on ``DescribeNamespace``.
FAILING_SECONDS = 2.0


async def test_a_node_looping_on_a_failing_start_up_call_leaves_the_frontend_and_the_budget_alone(
        temporal_env) -> None:
    """The frontend answers ``DescribeNamespace`` UNAVAILABLE (a Temporal restart) while one node
    asks it 16 at once, at 5 calls a second of its own and 10 for the whole gateway. Before, every
    call started a fetch: 3,507 reached the frontend in 3 s and took the budget 3,457 tokens below
    empty, and once the frontend was back another node's first poll was refused (about six minutes
    to refill). Now a failed fetch answers every call for a second, so the frontend gets at most
    one a second, and the other node's poll goes through."""
    control = temporal_env.client
    looping, honest = unique("looping"), unique("honest")
    for name in (looping, honest):
        await live_entity(control, name)
    loop = asyncio.get_running_loop()
    try:
        async with counting_gateway(control, calls_per_second=NODE_RATE, call_burst=NODE_BURST,
                                    upstream_calls_per_second=UPSTREAM_RATE) as (frontend, pki, access, _):
            frontend.failing = {"DescribeNamespace"}
            channel = node_channel(access, credentials(pki, looping))
            honest_channel = node_channel(access, credentials(pki, honest))
            try:
                started = loop.time()
                codes = await describe_namespace_in_loops(channel, 16, FAILING_SECONDS)
                elapsed = loop.time() - started
                fetches = frontend.calls["DescribeNamespace"]
                frontend.failing.clear()  # the frontend is back
                # A long poll the frontend holds until its deadline, then answers with no task.
                honest_poll = await code_of(call(honest_channel, "PollActivityTaskQueue")(
                    poll_request(honest), timeout=MIN_UPSTREAM_POLL_SECONDS + 1))
            finally:
                await channel.close()
                await honest_channel.close()
    finally:
        for name in (looping, honest):
            await end_entity(control, name)

    assert fetches <= 1 + math.ceil(elapsed / FAILED_STARTUP_ANSWER_SECONDS), (
        f"{fetches} DescribeNamespace reached the failing frontend in {elapsed:.1f} s; answers: {dict(codes)}")
    assert honest_poll == grpc.StatusCode.OK and frontend.polls[node_queue(honest)] == 1, honest_poll


def test_the_upstream_budget_is_shared_max_min_fairly() -> None:
    """Fifty nodes each asking 20 calls a second of a budget of 500, beside a node asking 3 and one
    asking one every two seconds: the two are never refused, the fifty get the rest in equal
    parts, and no more than the budget goes through."""
    now = [0.0]
    budget = FleetBudget(500.0, clock=lambda: now[0])
    asks = {**{f"heavy-{i}": 20.0 for i in range(50)}, "moderate": 3.0, "light": 0.5}
    admitted, refused = Counter(), Counter()
    step, seconds = 0.001, 60.0
    due = {node: (i % 50) / 1000 for i, node in enumerate(asks)}
    while now[0] < seconds:
        for node, rate in asks.items():
            if due[node] <= now[0]:
                due[node] += 1 / rate
                (admitted if budget.admit(node) else refused)[node] += 1
        now[0] += step
    assert refused["moderate"] == refused["light"] == 0, refused
    heavy = [admitted[f"heavy-{i}"] for i in range(50)]
    assert sum(admitted.values()) <= budget.burst + 500 * seconds
    assert sum(admitted.values()) >= 0.95 * 500 * seconds, "the budget was spent: the heavy nodes asked for more"
    assert max(heavy) <= 1.05 * min(heavy), heavy


def test_the_gateways_own_calls_never_take_the_budget_below_empty() -> None:
    """The gateway's own calls (``spend``: the start-up answers' fetches) go only while the bucket
    holds a token. Before, each took one whatever it held: 100,000 of them left the budget of
    1,000 a second 38,000 below empty a minute later, every node refused for 38 s more."""
    now = [0.0]
    budget = FleetBudget(1000.0, clock=lambda: now[0])
    spent = sum(bool(budget.spend()) for _ in range(100_000))
    assert spent == budget.burst, spent
    now[0] += 0.01  # ten tokens back
    assert budget.admit("never-called"), "a node that never called was refused: the budget below empty"


def test_a_node_whose_tasks_pay_for_its_calls_stays_a_light_caller() -> None:
    """Twenty nodes flood a budget of 100 a second while one node works through 30 tasks a second
    (a poll that brings each and its result: 60 calls a second, more than an equal share). Its
    calls paid by its tasks, it is never refused; the same calls unpaid, it gets an equal share."""
    for pays in (True, False):
        now = [0.0]
        budget = FleetBudget(100.0, clock=lambda: now[0])
        admitted, refused = Counter(), Counter()
        step, seconds = 0.001, 30.0
        due = {**{f"flood-{i}": i / 1000 for i in range(20)}, "busy": 0.0}
        poll_next = True
        while now[0] < seconds:
            for node in due:
                if due[node] <= now[0]:
                    due[node] += 1 / 60 if node == "busy" else 1 / 20
                    ok = budget.admit(node)
                    (admitted if ok else refused)[node] += 1
                    if node == "busy" and ok:
                        if poll_next and pays:
                            budget.paid(node, CALLS_PER_TASK)
                        poll_next = not poll_next
            now[0] += step
        if pays:
            assert refused["busy"] == 0 and admitted["busy"] >= 60 * seconds - 1, (admitted["busy"], refused["busy"])
        else:
            flood = [admitted[f"flood-{i}"] for i in range(20)]
            assert admitted["busy"] <= 1.1 * max(flood), (admitted["busy"], flood)
        assert sum(admitted.values()) <= budget.burst + 100 * seconds


def test_a_node_calling_every_replica_gets_one_share_of_the_whole_gateway() -> None:
    """Two replicas, each with half of a budget of 200 a second: ten nodes flood each replica, each
    node connected to one, and one node floods both (it reconnected until it had a connection on
    each). Judged by what each replica saw alone, it got a share on each: twice what each honest
    node got. Each replica now counts what the other forwarded for a node (``report``, ``heard``,
    exchanged every second by ``peers.PeerUsage``): it gets about one share in all."""
    for told in (True, False):
        now = [0.0]
        replicas = [FleetBudget(100.0, clock=lambda: now[0]) for _ in range(2)]
        on = {**{f"first-{i}": [0] for i in range(10)}, **{f"second-{i}": [1] for i in range(10)}, "both": [0, 1]}
        admitted: Counter = Counter()
        step, seconds, told_at = 0.001, 60.0, 0.0
        due = {node: (i % 20) / 1000 for i, node in enumerate(on)}
        while now[0] < seconds:
            if told and now[0] >= told_at:
                told_at += 1.0
                first, second = (replica.report() for replica in replicas)
                replicas[0].heard(second)
                replicas[1].heard(first)
            for node, where in on.items():
                if due[node] <= now[0]:
                    due[node] += 1 / 20  # 20 a second to each replica it is connected to
                    admitted[node] += sum(replicas[r].admit(node) for r in where)
            now[0] += step
        honest = sorted(admitted[node] for node in on if node != "both")
        assert sum(admitted.values()) <= sum(r.burst for r in replicas) + 200 * seconds
        if told:
            assert admitted["both"] <= 1.15 * honest[len(honest) // 2], (admitted["both"], honest)
        else:
            assert admitted["both"] >= 1.6 * honest[len(honest) // 2], "the test proves nothing"


async def test_the_replicas_tell_each_other_what_they_forwarded_and_a_report_only_they_make_counts(tmp_path) -> None:
    """Each replica serves its report on its peer port, sealed with the key every replica holds,
    and reads the others' (its own, found under the same name, skipped). A report sealed with a key
    the replicas do not hold (a pod a node labelled as the gateway) counts for nothing, and what a
    replica that went away said stops counting once stale: its nodes, reconnecting to the others,
    are not judged by it. A replica serves the report it sealed at most a round ago."""
    from workers.gateway.peers import PEER_SECONDS, STALE_SECONDS, PeerUsage

    now = [1_000.0]
    keys = token_keys_as_deployed(tmp_path / "keys")
    budgets = [FleetBudget(100.0) for _ in range(3)]
    addresses: list[tuple[str, int]] = []

    async def peers() -> list[tuple[str, int]]:
        return list(addresses)

    replicas = [PeerUsage(budgets[0], keys, peers, clock=lambda: now[0]),
                PeerUsage(budgets[1], keys, peers, clock=lambda: now[0]),
                PeerUsage(budgets[2], token_keys_as_deployed(tmp_path / "foreign"), peers, clock=lambda: now[0])]
    try:
        for replica in replicas:
            addresses.append(("127.0.0.1", await replica.start("127.0.0.1", 0)))
        for _ in range(20):
            budgets[0].admit("busy")
            budgets[2].admit("honest")  # the foreign "replica" says the honest node is heavy
        now[0] += PEER_SECONDS  # the next round: what each sealed at its start is resealed
        await replicas[1].read_peers()
        elsewhere = budgets[1].elsewhere
        assert elsewhere.get("busy", 0) > 5, elsewhere
        assert "honest" not in elsewhere, "a report under a key the replicas do not hold counts for nothing"
        assert replicas[1].replicas_heard() == 1, "the one other replica (gpufleet_gateway_peers_heard)"
        await replicas[0].read_peers()
        assert "busy" not in budgets[0].elsewhere, "a replica's own report is not counted twice"
        await replicas[0].stop()
        addresses.pop(0)
        now[0] += STALE_SECONDS + 1
        await replicas[1].read_peers()
        assert budgets[1].elsewhere == {}, "what a replica gone said stops counting"
        assert replicas[1].replicas_heard() == 0
    finally:
        for replica in replicas[1:]:
            await replica.stop()


async def test_a_burst_of_peer_connections_is_served_one_sealed_report_and_no_more_than_the_cap(tmp_path) -> None:
    """Anyone who reaches the peer port (a GPU node's host, where the CNI enforces no policy) used
    to have the usage table sorted and ~60 KB sealed for each connection, as many at once as it
    liked, and read every node's name and rate in it. 50 connections at once: the report is sealed
    once for them all, those over the cap are closed unanswered, and what is sent names no node;
    a replica opens it. A round later the report is sealed anew."""
    import socket

    from workers.gateway import peers as peer_module
    from workers.gateway.peers import PEER_SECONDS, PeerUsage

    now = [1_000.0]
    keys = token_keys_as_deployed(tmp_path / "keys")
    budget = FleetBudget(100.0)
    for _ in range(20):
        budget.admit("busy-node")
    built = Counter()
    report = budget.report

    def counted() -> dict[str, float]:
        built["reports"] += 1
        return report()

    budget.report = counted

    async def no_peers() -> list[tuple[str, int]]:
        return []

    replica, reader = PeerUsage(budget, keys, no_peers, clock=lambda: now[0]), PeerUsage(FleetBudget(100.0), keys,
                                                                                         no_peers, clock=lambda: now[0])
    port = await replica.start("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    try:
        # Connected before the replica accepts any (the kernel's handshakes): all at once to it.
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]

        def read_all(client: socket.socket) -> bytes:
            with client:
                client.settimeout(10)
                got = b""
                try:
                    while more := client.recv(1 << 16):
                        got += more
                except ConnectionResetError:
                    pass
                return got

        with ThreadPoolExecutor(8) as pool:
            answers = await asyncio.gather(*(loop.run_in_executor(pool, read_all, c) for c in clients))
        answered = [a for a in answers if a]
        assert built["reports"] == 1, "the report is sealed once for every connection of a round"
        assert 1 <= len(answered) <= peer_module.MAX_CONNECTIONS, len(answered)
        assert len(set(answered)) == 1 and all(b"busy-node" not in a for a in answered), "no node named in clear"
        assert reader.open(answered[0])[1].get("busy-node", 0) > 5

        now[0] += PEER_SECONDS
        opened = reader.open(await loop.run_in_executor(None, read_all, socket.create_connection(("127.0.0.1", port))))
        assert built["reports"] == 2 and opened is not None
    finally:
        await replica.stop()


async def test_a_peer_connection_that_does_not_read_is_dropped_after_the_write_timeout(tmp_path, monkeypatch) -> None:
    """A connection that takes nothing (its receive window full) once held its slot and the report's
    bytes for ever; now for ``WRITE_SECONDS``, then it is dropped, the report not all sent."""
    import socket

    from workers.gateway import peers as peer_module
    from workers.gateway.peers import PeerUsage

    monkeypatch.setattr(peer_module, "WRITE_SECONDS", 0.3)

    async def no_peers() -> list[tuple[str, int]]:
        return []

    replica = PeerUsage(FleetBudget(100.0), token_keys_as_deployed(tmp_path / "keys"), no_peers)
    total = 16 << 20  # more than any socket buffers hold
    large = b"x" * total
    replica.sealed_report = lambda: large
    port = await replica.start("127.0.0.1", 0)
    try:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port))
        await asyncio.sleep(1.5)  # reading nothing, well past the write timeout

        def read_all() -> int:
            with client:
                client.settimeout(10)
                got = 0
                try:
                    while more := client.recv(1 << 20):
                        got += len(more)
                except ConnectionResetError:
                    pass
                return got

        got = await asyncio.get_running_loop().run_in_executor(None, read_all)
        assert got < total, "dropped once the write timeout passed"
    finally:
        await replica.stop()


async def test_mirror_pods_posing_as_the_gateway_cannot_keep_the_replicas_from_hearing_each_other(tmp_path) -> None:
    """Were a node's mirror pods labelled as the gateway endpoints of the peer Service (the
    admission policy that keeps them out of gpufleet missing: this is defence in depth), many
    of them, at addresses listed before the real replicas, once left no room for the replicas among
    the addresses a round reads, and each node got a share on every replica again. A replica whose
    report opened is read every round from then on; the rest are tried in turn."""
    from workers.gateway.peers import MAX_PEERS, PeerUsage

    keys = token_keys_as_deployed(tmp_path / "keys")
    budgets = [FleetBudget(100.0) for _ in range(2)]
    addresses: list[tuple[str, int]] = []

    async def posing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"\0" * 64)  # anything: a node holds no key the replicas take
        writer.close()

    async def peers() -> list[tuple[str, int]]:
        return list(addresses)

    fakes = [await asyncio.start_server(posing, "127.0.0.1", 0) for _ in range(2 * MAX_PEERS)]
    replicas = [PeerUsage(budget, keys, peers) for budget in budgets]
    try:
        addresses += [("127.0.0.1", fake.sockets[0].getsockname()[1]) for fake in fakes]
        for replica in replicas:
            addresses.append(("127.0.0.1", await replica.start("127.0.0.1", 0)))
        for _ in range(20):
            budgets[0].admit("busy")
        for _ in range(30):
            await replicas[1].read_peers()
            if budgets[1].elsewhere:
                break
        assert budgets[1].elsewhere.get("busy", 0) > 5, "the other replica was never read"
        for _ in range(10):  # once found, read every round
            budgets[0].admit("busy")
            await replicas[1].read_peers()
            assert budgets[1].elsewhere.get("busy", 0) > 5
    finally:
        for replica in replicas:
            await replica.stop()
        for fake in fakes:
            fake.close()


async def test_callers_holding_every_peer_connection_cannot_keep_a_replica_from_reading_the_report(
        tmp_path, monkeypatch) -> None:
    """Where the CNI enforces no policy, whoever reaches the peer port could open ``MAX_CONNECTIONS``
    connections and read nothing: each held its slot for ``WRITE_SECONDS`` (the kernel takes ~46 KB
    of a ~60 KB report on a real network, so the close waits), the replicas' reads were closed
    unanswered and each node was judged per replica again. Now one address holds ``PER_ADDRESS``
    connections at most, and the addresses the peer Service resolved to (the replicas) are served
    apart from everyone else's ``MAX_CONNECTIONS``: neither one caller (127.0.0.2) nor many
    (127.0.0.3 on; Linux routes 127/8 to loopback) keeps the other replica (127.0.0.1) from it."""
    import socket

    from workers.gateway import peers as peer_module
    from workers.gateway.peers import MAX_CONNECTIONS, STALE_SECONDS, PeerUsage

    monkeypatch.setattr(peer_module, "WRITE_SECONDS", 5.0)  # held through the test, however slow the machine
    keys = token_keys_as_deployed(tmp_path / "keys")
    budgets = [FleetBudget(100.0) for _ in range(2)]
    report = budgets[0].report
    # As many nodes as a real report names (~60 KB), the one that calls heaviest among them.
    budgets[0].report = lambda: {**{f"node-{i:04d}.gpu.example": 1.0 for i in range(1_800)}, **report()}
    addresses: list[tuple[str, int]] = []

    async def peers() -> list[tuple[str, int]]:
        return list(addresses)

    now = [1_000.0]  # moved on past what the replica heard before each read the test makes
    replicas = [PeerUsage(budget, keys, peers, clock=lambda: now[0]) for budget in budgets]
    held: list[socket.socket] = []

    def hold(source: str, count: int) -> None:
        for _ in range(count):
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and reads nothing
            client.bind((source, 0))
            client.connect(("127.0.0.1", addresses[0][1]))
            held.append(client)

    def served(clients: list[socket.socket]) -> int:
        """How many of ``clients`` were sent any of the report (the rest were closed unanswered)."""
        count = 0
        for client in clients:
            client.settimeout(2)
            try:
                count += bool(client.recv(1))
            except OSError:
                pass
        return count

    for _ in range(20):
        budgets[0].admit("busy")
    try:
        for replica in replicas:
            addresses.append(("127.0.0.1", await replica.start("127.0.0.1", 0)))
        # What a real network's kernel takes of a report at once (loopback's would take it all).
        replicas[0]._server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
        await replicas[0].read_peers()  # the replicas' addresses, as every round resolves them

        hold("127.0.0.2", 2 * MAX_CONNECTIONS)
        await asyncio.sleep(0.5)  # each accepted and served, or closed
        now[0] += STALE_SECONDS + 1
        await replicas[1].read_peers()
        assert budgets[1].elsewhere.get("busy", 0) > 5, "one caller's connections kept the replica from reading"
        assert served(held) <= peer_module.PER_ADDRESS

        for source in range(MAX_CONNECTIONS):
            hold(f"127.0.0.{3 + source}", peer_module.PER_ADDRESS)
        await asyncio.sleep(0.5)
        now[0] += STALE_SECONDS + 1
        await replicas[1].read_peers()
        assert budgets[1].elsewhere.get("busy", 0) > 5, "many callers' connections kept the replica from reading"
    finally:
        for client in held:
            client.close()
        for replica in replicas:
            await replica.stop()


async def test_a_replica_of_the_release_before_which_serves_no_peer_port_costs_a_round_nothing(
        tmp_path, caplog) -> None:
    """While the release that brings the exchange rolls out, the peer Service may name a replica of
    the release before, which serves no peer port (and reads none). A new replica's read of it is
    refused at once, not waited on: the round still hears the other new replicas well within
    ``READ_SECONDS``, logs nothing, and the nodes on the old replica are just not counted until it
    is replaced. No report format of before is kept: the exchange never shipped before."""
    import logging
    import socket
    import time

    from workers.gateway.peers import READ_SECONDS, PeerUsage

    keys = token_keys_as_deployed(tmp_path / "keys")
    budgets = [FleetBudget(100.0) for _ in range(2)]
    for _ in range(20):
        budgets[0].admit("busy")
    old = socket.socket()  # the old replica's address: bound, nothing listening on it
    old.bind(("127.0.0.1", 0))
    addresses = [old.getsockname()]

    async def peers() -> list[tuple[str, int]]:
        return list(addresses)

    replicas = [PeerUsage(budget, keys, peers) for budget in budgets]
    try:
        for replica in replicas:
            addresses.append(("127.0.0.1", await replica.start("127.0.0.1", 0)))
        caplog.set_level(logging.WARNING, logger="gpufleet.node_gateway")
        for _ in range(3):
            started = time.monotonic()
            await replicas[1].read_peers()
            assert time.monotonic() - started < READ_SECONDS, "the old replica's read was waited on (timed out)"
            assert budgets[1].elsewhere.get("busy", 0) > 5
        assert not caplog.records, caplog.records
    finally:
        old.close()
        for replica in replicas:
            await replica.stop()
