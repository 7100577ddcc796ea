"""The gateway's server: mutual TLS in front of the Temporal frontend, forwarding what
``authorization`` allows of each live (``liveness``) node, over the control plane's own
connection (the standard ``TEMPORAL_*`` settings: mTLS or API key).

Per node, at most ``POLLS_PER_NODE`` polls and ``CALLS_PER_NODE`` calls go on at once,
over at most ``CONNECTIONS_PER_NODE`` connections, each request at most
``REQUEST_BYTES`` (results ``RESULT_BYTES``, and each result's data the bound of its task's
activity type, ``authorization.RESULT_LIMITS``): a call over them is held, without going
upstream, and then answered (a poll with no task), up to ``HELD_CALLS_PER_NODE`` of them
(refused at once beyond), so one node cannot take the frontend's poll budget or the
gateway's memory from the others. At most ``CALLS_PER_SECOND`` of a node's calls a second go
upstream (``RESOURCE_EXHAUSTED`` beyond), and the start-up calls are answered from one copy
(``StartupAnswers``), so one node cannot spend the frontend's request rate either; nor can many
together: everything the gateway forwards takes from one budget (``FleetBudget``,
``UPSTREAM_CALLS_PER_SECOND``), shared max-min fairly among the nodes calling.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError
from temporalio.api.common.v1 import ActivityType
from temporalio.api.workflowservice.v1 import request_response_pb2 as wsr

from fleet.settings import NodeGatewayEnv, Settings, temporal_profile
from workers.gateway.authorization import (
    ALLOWED,
    FORWARDED_METADATA,
    RESULTS,
    SERVICE,
    GatewayStats,
    NodeAuthorization,
    Refused,
    echo,
)
from workers.gateway.fleet_budget import FleetBudget
from workers.gateway.liveness import LiveCache, Liveness, Verdict, default_liveness
from workers.gateway.node_log import NodeLog
from workers.gateway.peers import PeerUsage, Peers
from workers.gateway.task_tokens import CURRENT, PREVIOUS, TaskTokens, TokenKeys

log = logging.getLogger("gpufleet.node_gateway")

#: Per-node limits. A node agent runs one poller and at most five activities at once
#: (workers/node_agent.py); these leave it room, and give no node more of what all share: the
#: frontend's poll budget (1,200 concurrent polls per namespace and frontend by default), the
#: gateway's memory and its upstream connections.
POLLS_PER_NODE = 2
CALLS_PER_NODE = 16
#: Connections carrying a node's calls at once (an agent that switched to a renewed key keeps
#: its old connection until its held poll ends).
CONNECTIONS_PER_NODE = 4
#: Bytes per call: a result (``RespondActivityTask*``) may carry a node's report or a failure's
#: stack; every other call is a poll, a heartbeat or a start-up call of a few hundred bytes.
REQUEST_BYTES = 64 * 1024
RESULT_BYTES = 512 * 1024
#: Calls at once on one connection (HTTP/2 streams; a node agent needs about seven).
STREAMS_PER_CONNECTION = 32
#: A call over a node's limits is held this long at most (never past its deadline) and then
#: answered: a poll with no task, as a long poll that found none is, anything else with
#: RESOURCE_EXHAUSTED. Held, it costs a little memory and no CPU, nothing goes upstream, and a
#: node that keeps more calls open than its limits gets no more through than they allow.
HOLD_SECONDS = 60.0
#: Bytes held at once, per node and in all. A held call's request stays in memory until the
#: call ends (gRPC's frame that called the handler keeps it), and so does the call itself
#: (``HELD_CALL_BYTES``): without a bound, a node that opens connection after connection of
#: calls over its limits holds the gateway's memory, which every node's calls need. A call over
#: limits beyond either bound, or beyond ``HELD_CALLS_PER_NODE``, is refused at once
#: (RESOURCE_EXHAUSTED, naming the bound).
HELD_BYTES_PER_NODE = 4 * 1024 * 1024
HELD_BYTES = 256 * 1024 * 1024
#: What a held call costs beyond its request (gRPC's call and stream, the handler's coroutine
#: and timer), charged against the bounds above: 9,000 held calls with empty requests took
#: 223 MiB (about 25 KiB each), so ``HELD_BYTES`` holds at most 8,192 calls in all.
HELD_CALL_BYTES = 32 * 1024
#: Calls held at once per node. An honest agent is never held: its one poller, five activities
#: (a heartbeat or a result each) and a start-up call make about seven calls at once
#: (workers/node_agent.py), under ``CALLS_PER_NODE``, on one connection or two (while a renewed
#: key's replaces the old). Four times that: were an agent's calls ever held, none is refused;
#: a node that opens more gets no more of the gateway's memory.
HELD_CALLS_PER_NODE = 32
#: Activity heartbeats a node may send upstream, per second on average and at once. Each one is
#: a write of its workflow's state in the store every workflow shares; the SDK sends one per
#: activity at most every 0.8 × its heartbeat timeout, and an agent runs at most five
#: activities, so an honest node stays far below. Over the rate, a heartbeat is answered
#: RESOURCE_EXHAUSTED, not forwarded (the activity times out if it never gets one through).
HEARTBEATS_PER_SECOND = 10.0
HEARTBEAT_BURST = 30
#: Calls a node may send upstream, per second on average and at once
#: (``GPUFLEET_GATEWAY_CALLS_PER_SECOND``, ``GPUFLEET_GATEWAY_CALL_BURST``). The frontend's
#: request rate per namespace is shared by every node and the control plane, and a node calling
#: as fast as it could spent it (16 DescribeNamespace at once: 4,768 forwarded in 3 s; a poll
#: opened and cancelled in a loop: 350 upstream polls a second). What an honest agent sends of its own accord
#: (workers/node_agent.py): its one poller's long poll, renewed about once a minute while no task
#: comes; heartbeats, one per activity every 0.8 × its heartbeat timeout, five activities at most
#: (``HEARTBEATS_PER_SECOND`` caps them at 10); a goodbye; its start-up calls are answered from
#: ``StartupAnswers`` and cost nothing (one that starts a fetch costs a call). The rest it sends
#: because the control plane sent it a task: a poll that brings a task gives its call back and one
#: more for the task's result (``RateLimits.give``), so however many tasks the workflows send a
#: node, answering them costs it nothing. Twice the heartbeat cap a second, and a burst for an agent reconnecting with five
#: activities in flight, are far above what an honest agent needs; over them a call is answered
#: RESOURCE_EXHAUSTED at once, never forwarded (the SDK backs off and retries).
CALLS_PER_SECOND: float = NodeGatewayEnv.model_fields["calls_per_second"].default
CALL_BURST: int = NodeGatewayEnv.model_fields["call_burst"].default
#: Calls a task delivered to a node gives back: the poll that brought it and the result it asks for.
CALLS_PER_TASK = 2
#: Calls every node together may send upstream per second, through all the gateway's replicas
#: (``GPUFLEET_GATEWAY_UPSTREAM_CALLS_PER_SECOND``; each replica takes its part,
#: ``GPUFLEET_GATEWAY_REPLICAS``). Each node's own budget bounds one node; fifty hostile nodes of
#: a compromised site, each within its own, would still spend what the frontend admits of the
#: namespace: Temporal v1.32's defaults are 2,400 calls a second per frontend
#: (``frontend.namespaceRPS``, and ``frontend.rps`` for all namespaces) after a burst of twice
#: that, and the gateway's few upstream connections may all land on one frontend (a Service
#: balances connections, not calls), beside the control plane's own calls. 1,000 leaves the
#: control plane 1,400 of one frontend's 2,400 and is five times what an honest fleet of 10,000
#: idle nodes sends (a poll renewed about once a minute, a watch's heartbeat every five: about
#: 200 a second); a fleet reconnecting at once after a gateway restart is admitted over seconds (the
#: SDK backs off on RESOURCE_EXHAUSTED and polls again). Shared by ``FleetBudget``, max-min
#: fairly: however many nodes call at their own limit, each gets at most an equal share of
#: what the others leave, and a node that calls little, an honest one, is never refused while
#: they are.
UPSTREAM_CALLS_PER_SECOND: float = NodeGatewayEnv.model_fields["upstream_calls_per_second"].default
#: GetSystemInfo and DescribeNamespace (what the SDK asks on connecting) are answered from one
#: copy for every node, fetched upstream at most once per this many seconds: the server's
#: capabilities and the namespace's settings change rarely, and a node asking in a loop, or a
#: fleet's agents reconnecting after a gateway restart, would otherwise send one pair each.
STARTUP_ANSWER_SECONDS = 10.0
#: A fetch that failed answers every start-up call with its error for this long: while the
#: frontend is away or refusing under load, it gets at most one fetch of each a second from the
#: gateway, however many nodes reconnect or loop on it; a node's SDK retries anyway.
FAILED_STARTUP_ANSWER_SECONDS = 1.0
#: How long the gateway waits for the frontend's answer to a start-up call it fetches.
STARTUP_FETCH_SECONDS = 10.0
#: The calls answered from ``StartupAnswers``: the same request from every node (rebuilt from the
#: gateway's own namespace), the same answer.
STARTUP_ANSWERED = frozenset({"GetSystemInfo", "DescribeNamespace"})
#: A poll that got a slot with less time left than this is answered with no task, not
#: forwarded: the frontend refuses a long poll this short (FAILED_PRECONDITION).
MIN_UPSTREAM_POLL_SECONDS = 3.0


class RateLimits:
    """One token bucket per node, kept apart from ``NodeLoad``: a load goes when its node has
    nothing in flight, and a node sending one call at a time must not find a full bucket each time."""

    def __init__(self, rate: float, burst: int, clock=time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # node → (tokens, when)

    def take(self, node: str) -> bool:
        now = self.clock()
        tokens, then = self._buckets.get(node, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        if len(self._buckets) > 100_000:  # full buckets only: forgetting one gives nothing away
            self._buckets = {n: b for n, b in self._buckets.items()
                             if b[0] + (now - b[1]) * self.rate < self.burst}
        if tokens < 1.0:
            self._buckets[node] = (tokens, now)
            return False
        self._buckets[node] = (tokens - 1.0, now)
        return True

    def give(self, node: str, calls: float) -> None:
        """``calls`` back to ``node`` (never above its burst)."""
        if node in self._buckets:
            tokens, then = self._buckets[node]
            self._buckets[node] = (min(float(self.burst), tokens + calls), then)


class StartupAnswers:
    """The answers to the read-only start-up calls (``STARTUP_ANSWERED``), one copy for every
    node, fetched again once ``seconds`` old. Concurrent callers share one fetch. A fetch that
    failed is kept ``failed_seconds`` too, its error the answer to every call meanwhile: not kept,
    while the frontend answered errors (a restart, RESOURCE_EXHAUSTED under load) every call of
    every node started a fetch of its own, thousands a second from one node, when the frontend
    could least take them; kept, it gets at most one fetch a ``failed_seconds``."""

    def __init__(self, seconds: float, failed_seconds: float, clock=time.monotonic) -> None:
        self.seconds, self.failed_seconds, self.clock = seconds, failed_seconds, clock
        self._answers: dict[str, _Kept] = {}

    async def get(self, method: str, start: Callable[[], Awaitable[bytes]]) -> bytes:
        """``method``'s answer: the one kept, else the one ``start()`` fetches. ``start`` is
        called only when this call starts a fetch, and may raise to refuse the call (nothing is
        fetched or kept then)."""
        kept = self._answers.get(method)
        if kept is None or self._stale(kept):
            kept = _Kept(asyncio.ensure_future(start()))
            kept.answer.add_done_callback(lambda done, kept=kept: self._ended(kept))
            self._answers[method] = kept
        return await asyncio.shield(kept.answer)

    def _ended(self, kept: "_Kept") -> None:
        if kept.answer.cancelled():  # the gateway stopping: nothing learned of the frontend
            kept.until = -math.inf
        else:
            # Reading its error also keeps it from being logged as never retrieved when every caller left.
            kept.until = self.clock() + (self.failed_seconds if kept.answer.exception() else self.seconds)

    def _stale(self, kept: "_Kept") -> bool:
        return kept.answer.done() and self.clock() >= kept.until


@dataclass
class _Kept:
    """A start-up answer (or the fetch of it in flight), kept until ``until`` once it ended."""

    answer: asyncio.Future[bytes]
    until: float = math.inf


@dataclass
class NodeLoad:
    """One node's calls in flight now."""

    polls: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(POLLS_PER_NODE))
    calls: int = 0
    held: int = 0
    held_bytes: int = 0
    upstream_polls: int = 0  # polls forwarded and not yet answered
    connections: Counter = field(default_factory=Counter)  # peer → its admitted calls

    @property
    def idle(self) -> bool:
        return not self.calls and not self.held


class NodeGateway(grpc.GenericRpcHandler):
    def __init__(self, upstream: grpc.aio.Channel, namespace: str, live: Liveness, token_keys: TokenKeys,
                 upstream_metadata: list[tuple[str, str]] | None = None,
                 poll_channels: list[grpc.aio.Channel] | None = None,
                 calls_per_second: float = CALLS_PER_SECOND, call_burst: int = CALL_BURST,
                 upstream_calls_per_second: float = UPSTREAM_CALLS_PER_SECOND,
                 budget: FleetBudget | None = None) -> None:
        self.upstream = upstream
        # Held long polls (at most two per node) ride connections of their own: a completion or
        # a heartbeat never queues behind a thousand open polls for an HTTP/2 stream.
        self.poll_channels = poll_channels or [upstream]
        self._next_poll = 0
        self.namespace = namespace
        self.live = live
        self.upstream_metadata = list(upstream_metadata or [])
        self.stats = GatewayStats()
        # Every warning a node's calls cause: at most one per node and reason a minute, and a count.
        self.node_log = NodeLog(log)
        self.authorization = NodeAuthorization(namespace, self.stats, TaskTokens(token_keys), self.node_log)
        self._stubs: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}
        self._load: dict[str, NodeLoad] = {}
        self._heartbeats = RateLimits(HEARTBEATS_PER_SECOND, HEARTBEAT_BURST)
        self._calls = RateLimits(calls_per_second, call_burst)
        # What every node's calls together may take of the frontend's rate (this replica's part);
        # the liveness lookups a node's calls start take from it too (``LiveCache``'s ``admit``).
        self.budget = budget or FleetBudget(upstream_calls_per_second)
        self._startup = StartupAnswers(STARTUP_ANSWER_SECONDS, FAILED_STARTUP_ANSWER_SECONDS)
        # Sent upstream with every call, after the node's few forwarded client-* entries.
        self._metadata = (("temporal-namespace", namespace), *self.upstream_metadata)
        # One handler per method the policy knows, made once (gRPC asks for it on every call);
        # any other method gets one made for that call, and is refused.
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        for name in ALLOWED:
            self._handlers[SERVICE + name] = self._handler(SERVICE + name)

    def _handler(self, method: str) -> grpc.RpcMethodHandler:
        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await self._handle(method, request, context)

        return grpc.unary_unary_rpc_method_handler(handle)

    # grpc.GenericRpcHandler
    def service(self, details: grpc.HandlerCallDetails):
        return self._handlers.get(details.method) or self._handler(details.method)

    def _over_limit(self, node: str, why: str) -> None:
        # One window per node whatever the limit (``why`` names what the node sent): the first
        # line says which limit, the count says how many calls in all.
        self.stats.limited += 1
        self.node_log.warn(node, "calls over its limits", "",
                           "node %s over its limits (%s); its calls over them are held, then answered, "
                           "or refused beyond what it may hold (logged once a minute, each counted)", node, why)

    async def _alive(self, node: str, key: str) -> Verdict | None:
        try:
            verdict = await self.live(node, key)
        except Exception as error:  # noqa: BLE001 - a bare liveness check (no LiveCache) that could not tell
            self.node_log.warn(node, "liveness checks failed", "", "liveness of %s unknown: %s", node, error)
            return None
        if verdict is True:
            return Verdict.LIVE
        return Verdict.RETIRED if verdict is False else verdict

    def admit_lookup(self, node: str) -> bool:
        """Whether a liveness lookup a call of ``node``'s starts may go upstream (``LiveCache``'s
        ``admit``: a key not found live before, a lookup that failed): one of the node's own calls,
        and a token of the budget counted, as a start-up fetch's, in no node's share. Counted in
        the node's share, an honest node's first lookups as it connected, while others spent the
        budget, made it look a heavy caller, and its polls were refused."""
        if not self._calls.take(node):
            return False
        if not self.budget.spend():
            self._calls.give(node, 1)
            return False
        return True

    async def _over_budget(self, node: str, context: grpc.aio.ServicerContext) -> NoReturn:
        self.stats.over_budget += 1
        why = (f"more than its share ({self.budget.share():.3g} a second) of the {self.budget.rate:g} "
               f"calls a second the {self.budget.calling()} nodes calling share")
        await self._slow_down(node, why, context)

    async def _slow_down(self, node: str, why: str, context: grpc.aio.ServicerContext) -> NoReturn:
        self._over_limit(node, why)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"node gateway: {why}; slow down")

    def _stub(self, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
        channel = self.upstream
        key = method
        if method.endswith("/PollActivityTaskQueue"):
            self._next_poll = (self._next_poll + 1) % len(self.poll_channels)
            channel, key = self.poll_channels[self._next_poll], f"{method}#{self._next_poll}"
        stub = self._stubs.get(key)
        if stub is None:
            stub = self._stubs[key] = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        return stub

    @staticmethod
    def _hold_seconds(context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        return HOLD_SECONDS if remaining is None else max(0.0, min(HOLD_SECONDS, remaining - 0.5))

    async def _hold(self, node: str, load: NodeLoad, polling: bool, why: str, size: int,
                    context: grpc.aio.ServicerContext) -> bytes:
        """A call over the node's limits: held, then answered, and nothing sent upstream. Beyond
        what may be held (``HELD_CALLS_PER_NODE``, ``HELD_BYTES_PER_NODE``, ``HELD_BYTES``),
        refused at once, polls too (an empty answer at once would only be polled again)."""
        cost = size + HELD_CALL_BYTES
        if load.held >= HELD_CALLS_PER_NODE:
            beyond = f"{HELD_CALLS_PER_NODE} of its calls held already"
        elif load.held_bytes + cost > HELD_BYTES_PER_NODE:
            beyond = f"{HELD_BYTES_PER_NODE // 2**20} MiB of its calls held already"
        elif self.stats.held_bytes + cost > HELD_BYTES:
            beyond = "the gateway holds all it keeps for nodes over their limits"
        else:
            beyond = None
        if beyond:
            self._over_limit(node, f"{why}, and {beyond}")
            self._release(node, load)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"node gateway: {why}, and {beyond}; slow down")
        self._over_limit(node, why)
        load.held += 1
        load.held_bytes += cost
        self.stats.held_over_limits += 1
        self.stats.held_bytes += cost
        try:
            await asyncio.sleep(self._hold_seconds(context))
        finally:
            load.held -= 1
            load.held_bytes -= cost
            self.stats.held_over_limits -= 1
            self.stats.held_bytes -= cost
            self._release(node, load)
        if polling:
            return b""  # no task: the agent polls again
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"node gateway: {why}; slow down")

    def load_of(self, node: str) -> NodeLoad:
        """What ``node`` has in flight now (an empty load when nothing)."""
        return self._load.get(node) or NodeLoad()

    def _release(self, node: str, load: NodeLoad) -> None:
        if load.idle and self._load.get(node) is load:
            del self._load[node]

    async def _handle(self, method: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        name = method.removeprefix(SERVICE)
        try:
            cert = self.authorization.identify(context)
            node = cert.node
            if not method.startswith(SERVICE):
                raise self.authorization.refuse(node, method, "not the workflow service")
        except Refused as refused:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"node gateway: {refused}")
        limit = RESULT_BYTES if name in RESULTS else REQUEST_BYTES
        if len(request) > limit:
            self._over_limit(node, f"a {len(request)}-byte {echo(name)}")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"node gateway: a request of {len(request)} bytes; the limit is {limit}")
        polling = name == "PollActivityTaskQueue"
        load = self._load.get(node)
        if load is None:
            load = self._load[node] = NodeLoad()
        peer = context.peer()
        # The limits come before authorization and the liveness check: a lookup can wait (the
        # control plane away), and the calls waiting on it must count within them.
        if peer not in load.connections and len(load.connections) >= CONNECTIONS_PER_NODE:
            return await self._hold(node, load, polling, f"more than {CONNECTIONS_PER_NODE} connections",
                                    len(request), context)
        if load.calls >= CALLS_PER_NODE:
            return await self._hold(node, load, polling, f"more than {CALLS_PER_NODE} calls at once",
                                    len(request), context)
        load.calls += 1
        load.connections[peer] += 1
        slot = False
        try:
            try:
                forward, _token = self.authorization.authorize(node, name, request)
                verdict = await self._alive(node, cert.key)
                if verdict is Verdict.OVER_BUDGET:
                    await self._over_budget(node, context)
                if verdict is None or verdict is Verdict.UNBOUND:
                    # Fail closed, but as a transient error: while the control plane is away (static
                    # stability), or a renewed key is not bound yet, an agent must keep retrying, not
                    # treat its identity as revoked.
                    if verdict is Verdict.UNBOUND:
                        self.node_log.warn(node, f"{name} refused", verdict.value, "node %s: %s", node, verdict.value)
                    why = verdict.value if verdict else "cannot verify this node now (control plane unreachable)"
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"node gateway: {why}; retry")
                if verdict is not Verdict.LIVE:
                    raise self.authorization.refuse(node, name, verdict.value)
            except Refused as refused:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"node gateway: {refused}")
            del request  # the rebuilt request is what goes on
            if name in STARTUP_ANSWERED:
                return await self._startup_answer(method, node, forward, context)
            if name == "RecordActivityTaskHeartbeat" and not self._heartbeats.take(node):
                await self._slow_down(node, f"more than {HEARTBEATS_PER_SECOND:g} heartbeats a second", context)
            if polling:
                if load.polls.locked():
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows the cancel of
                    # a caller that left as the slot came free, and its poll went upstream anyway
                    # (a task handed to nobody until it timed out).
                    try:
                        async with asyncio.timeout(self._hold_seconds(context)):
                            await load.polls.acquire()
                    except TimeoutError:
                        self._over_limit(node, f"more than {POLLS_PER_NODE} polls at once")
                        return b""  # no task: as a long poll that found none
                else:  # a free slot: taken at once, without a timer
                    await load.polls.acquire()
                slot = True
                remaining = context.time_remaining()
                if remaining is not None and remaining < MIN_UPSTREAM_POLL_SECONDS:
                    return b""  # too late for a long poll upstream (the frontend refuses one this short)
            if not self._calls.take(node):
                await self._slow_down(node, f"more than {self._calls.rate:g} calls a second", context)
            if not self.budget.admit(node):
                self._calls.give(node, 1)  # nothing went upstream: its own budget keeps the call
                await self._over_budget(node, context)
            return await self._forward(method, node, load, forward, polling, context)
        finally:
            if slot:
                load.polls.release()
            load.calls -= 1
            load.connections[peer] -= 1
            if not load.connections[peer]:
                del load.connections[peer]
            self._release(node, load)

    async def _forward(self, method: str, node: str, load: NodeLoad, forward: bytes, polling: bool,
                       context: grpc.aio.ServicerContext) -> bytes:
        metadata = (*(m for m in context.invocation_metadata() or () if m[0] in FORWARDED_METADATA),
                    *self._metadata)
        remaining = context.time_remaining()
        self.stats.held_polls += polling
        load.upstream_polls += polling
        try:
            response = await self._stub(method)(forward, metadata=metadata,
                                                timeout=remaining if remaining and remaining < 1e6 else None)
        except grpc.aio.AioRpcError as error:
            await _pass_on(error, context)
        finally:
            self.stats.held_polls -= polling
            load.upstream_polls -= polling
        self.stats.forwarded += 1
        if polling and response:
            delivered, rest = _task_token(response)
            if delivered:
                # The node gets the token sealed for it and the task's activity type (which bounds
                # its result: ``RESULT_LIMITS``): only it may answer, through any replica.
                sealed = self.authorization.tokens.seal(node, delivered, _activity_type(rest))
                response = _with_task_token(sealed, rest)
                self._calls.give(node, CALLS_PER_TASK)
                # Each of the task's calls may start a liveness lookup, which takes from the
                # budget too (``LiveCache``): the task pays for those as well.
                self.budget.paid(node, 2 * CALLS_PER_TASK)
        return response

    async def _startup_answer(self, method: str, node: str, forward: bytes,
                              context: grpc.aio.ServicerContext) -> bytes:
        """A start-up call's answer from ``StartupAnswers``: nothing upstream but its fetch."""
        async def fetch() -> bytes:
            answer = await self._stub(method)(forward, metadata=self._metadata, timeout=STARTUP_FETCH_SECONDS)
            self.stats.forwarded += 1
            return answer

        def start() -> Awaitable[bytes]:
            # The call that starts a fetch takes one of its node's calls, so a node over its own
            # rate is refused without one, and a token of the budget, only if there is one: before,
            # a node looping on a start-up call while the frontend failed sent a fetch with each
            # call, past its rate, each taking a token the budget did not have (thousands below
            # empty: every node refused for minutes after the frontend came back). The answer is
            # every node's, so the fetch counts in no node's share: counted in the caller's, the
            # first honest node to ask after the answer expired looked a heavy caller.
            if not self._calls.take(node):
                raise _OverLimit(f"more than {self._calls.rate:g} calls a second")
            if not self.budget.spend():
                self._calls.give(node, 1)  # nothing went upstream: its own budget keeps the call
                self.stats.over_budget += 1
                raise _OverLimit(f"the {self.budget.rate:g} calls a second every node shares are spent")
            return fetch()

        try:
            return await self._startup.get(method, start)
        except _OverLimit as over:
            await self._slow_down(node, str(over), context)
        except grpc.aio.AioRpcError as error:
            await _pass_on(error, context)


class _OverLimit(Exception):
    """A start-up call refused without a fetch: its node is over its rate, or the budget spent (why)."""


async def _pass_on(error: grpc.aio.AioRpcError, context: grpc.aio.ServicerContext) -> NoReturn:
    """The frontend's error, as the node's answer: Temporal's typed failures ride in the trailers
    (grpc-status-details-bin), passed on with it."""
    context.set_trailing_metadata(tuple(error.trailing_metadata() or ()))
    await context.abort(error.code(), error.details() or "")


def _task_token(response: bytes) -> tuple[bytes, bytes]:
    """``task_token`` (field 1) of a PollActivityTaskQueueResponse and the response's other
    fields, without decoding them (the input payloads): serializers write fields in number
    order, so it leads."""
    if response[:1] == b"\x0a":
        length, shift, i = 0, 0, 1
        while i < len(response) and i < 6:
            byte = response[i]
            length |= (byte & 0x7F) << shift
            i += 1
            if not byte & 0x80:
                if i + length <= len(response):
                    return response[i:i + length], response[i + length:]
                break
            shift += 7
    decoded = wsr.PollActivityTaskQueueResponse.FromString(response)
    token = decoded.task_token
    decoded.ClearField("task_token")
    return token, decoded.SerializeToString()


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _activity_type(rest: bytes) -> str:
    """The task's activity type (``activity_type.name``, field 5) in a PollActivityTaskQueueResponse
    (without its token), read by skipping the other fields undecoded (the input payloads)."""
    try:
        i = 0
        while i < len(rest):
            tag, i = _varint(rest, i)
            number, wire = tag >> 3, tag & 7
            if wire == 0:
                _, i = _varint(rest, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                size, i = _varint(rest, i)
                if number == 5:
                    return ActivityType.FromString(rest[i:i + size]).name
                i += size
            else:
                raise ValueError(f"wire type {wire}")
        return ""
    except (IndexError, ValueError, DecodeError):
        pass
    try:
        return wsr.PollActivityTaskQueueResponse.FromString(rest).activity_type.name
    except DecodeError:
        return ""  # sealed with no type: the result takes the gRPC bound only


def _with_task_token(token: bytes, rest: bytes) -> bytes:
    """A PollActivityTaskQueueResponse of ``rest`` (its fields but the token) with ``token``:
    the field is replaced, never added twice (a parser keeps the last of a repeated field)."""
    length, size = bytearray(), len(token)
    while size > 0x7F:
        length.append(size & 0x7F | 0x80)
        size >>= 7
    length.append(size)
    return b"\x0a" + bytes(length) + token + rest


def upstream_channel(settings: Settings, own_connection: bool = False) -> tuple[grpc.aio.Channel, list[tuple[str, str]]]:
    """A channel to the Temporal frontend with the control plane's own connection settings
    (``TEMPORAL_TLS_*`` / ``TEMPORAL_API_KEY`` / ``temporal.toml``), and the metadata to send."""
    profile = temporal_profile()
    metadata = [(k.lower(), v) for k, v in (profile.grpc_meta or {}).items()]
    if profile.api_key:
        metadata.append(("authorization", f"Bearer {profile.api_key}"))
    options = [("grpc.max_receive_message_length", 128 * 1024 * 1024),
               ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.optimization_target", "latency")]
    if own_connection:  # not shared with the process's other channels to the same address
        options.append(("grpc.use_local_subchannel_pool", 1))
    tls = profile.tls.to_connect_tls_config() if profile.tls is not None else (True if profile.api_key else False)
    if tls is False:
        return grpc.aio.insecure_channel(settings.address, options=options), metadata
    if tls is True:
        credentials = grpc.ssl_channel_credentials()
    else:
        credentials = grpc.ssl_channel_credentials(tls.server_root_ca_cert, tls.client_private_key, tls.client_cert)
        if tls.domain:
            options.append(("grpc.ssl_target_name_override", tls.domain))
    return grpc.aio.secure_channel(settings.address, credentials, options=options), metadata


class GatewayCollector:
    """The gateway's own figures, read from its stats at scrape time: what an operator watches
    for a node trying what it may not (refusals) and for the held polls the frontend carries."""

    def __init__(self, gateway: "NodeGateway", peer_usage: PeerUsage | None = None) -> None:
        self.gateway = gateway
        self.peer_usage = peer_usage

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.gateway.stats
        yield CounterMetricFamily("gpufleet_gateway_forwarded", "Node agent calls forwarded to Temporal.",
                                  value=stats.forwarded)
        yield CounterMetricFamily("gpufleet_gateway_refused",
                                  "Node agent calls refused (PERMISSION_DENIED), every one (the log has the "
                                  "first of each node and reason a minute, and how many more).",
                                  value=stats.refused)
        yield GaugeMetricFamily("gpufleet_gateway_held_polls", "Long polls the gateway holds open for nodes now.",
                                value=stats.held_polls)
        yield GaugeMetricFamily("gpufleet_gateway_nodes", "Distinct node identities seen since start.",
                                value=len(stats.serials))
        yield CounterMetricFamily("gpufleet_gateway_limited",
                                  "Node calls over the node's limits (held, then answered; too big; or over its rate).",
                                  value=stats.limited)
        yield CounterMetricFamily("gpufleet_gateway_over_budget",
                                  "Node calls refused because every node's calls together reached the "
                                  "gateway's upstream budget and the node had its share of it.",
                                  value=stats.over_budget)
        opened = CounterMetricFamily("gpufleet_gateway_task_tokens_opened",
                                     "Task tokens a node sent back that opened, by the key that opened them "
                                     "(current, previous): a rotation drops the previous key once its count "
                                     "stops rising.", labels=["key"])
        for key in (CURRENT, PREVIOUS):
            opened.add_metric([key], self.gateway.authorization.tokens.opened[key])
        yield opened
        yield GaugeMetricFamily("gpufleet_gateway_held_over_limits",
                                "Calls held now because their node is over its limits.",
                                value=stats.held_over_limits)
        yield GaugeMetricFamily("gpufleet_gateway_held_bytes",
                                "Bytes charged for the calls held now, each its request and HELD_CALL_BYTES "
                                "(bounded per node and in all).",
                                value=stats.held_bytes)
        if self.peer_usage is not None:  # GPUFLEET_GATEWAY_PEERS set: the replicas share one budget
            yield GaugeMetricFamily("gpufleet_gateway_peers_heard",
                                    "Other gateway replicas whose usage report this one holds fresh (read in the "
                                    "last 3 s): the replicas less one, or a node calling several replicas gets "
                                    "more than one share of the upstream budget.",
                                    value=self.peer_usage.replicas_heard())


@dataclass
class RunningGateway:
    server: grpc.aio.Server
    gateway: NodeGateway
    port: int
    channel: grpc.aio.Channel
    poll_channels: list[grpc.aio.Channel] = field(default_factory=list)
    peer_usage: PeerUsage | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace: float | None = 1.0) -> None:
        if self.peer_usage is not None:
            await self.peer_usage.stop()
        await self.server.stop(grace)
        for channel in [self.channel, *self.poll_channels]:
            await channel.close()


async def start_gateway(settings: Settings, server_cert: bytes, server_key: bytes, client_ca: bytes,
                        token_keys: TokenKeys, live: Liveness | None = None, host: str = "127.0.0.1", port: int = 0,
                        live_ttl: float = 1.0, poll_connections: int = 4,
                        calls_per_second: float = CALLS_PER_SECOND, call_burst: int = CALL_BURST,
                        upstream_calls_per_second: float = UPSTREAM_CALLS_PER_SECOND,
                        peers: Peers | None = None, peer_port: int = 0) -> RunningGateway:
    """Serve the gateway: mutual TLS, client certificates from ``client_ca`` required; each node
    sends at most ``calls_per_second`` calls upstream (``CALLS_PER_SECOND``), ``call_burst`` at once,
    and every node together ``upstream_calls_per_second`` (this gateway's part of
    ``UPSTREAM_CALLS_PER_SECOND``), shared fairly. ``token_keys`` bind the task tokens delivered to
    a node to it (``task_tokens``): every replica is given the same. ``peers``: the other
    replicas, told on ``peer_port`` what this one forwarded for each node, and asked the same
    (``peers``), so a node gets one share however many replicas it reaches; None: one replica."""
    channel, metadata = upstream_channel(settings, own_connection=True)
    polls = [upstream_channel(settings, own_connection=True)[0] for _ in range(poll_connections)]
    if live is None:
        live = await default_liveness(settings)
    budget = FleetBudget(upstream_calls_per_second)
    lookups = LiveCache(live, live_ttl)
    gateway = NodeGateway(channel, settings.namespace, lookups, token_keys,
                          metadata, polls, calls_per_second=calls_per_second, call_burst=call_burst, budget=budget)
    lookups.admit = gateway.admit_lookup
    # A request over RESULT_BYTES is refused by gRPC from its length prefix, before it is held
    # in memory; a connection carries at most STREAMS_PER_CONNECTION calls; one with none for
    # five minutes is closed (a node agent's always holds a poll).
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", RESULT_BYTES),
                                      ("grpc.so_reuseport", 0), ("grpc.optimization_target", "latency"),
                                      ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
                                      ("grpc.max_connection_idle_ms", 300_000),
                                      # Flow-control windows stay small (no BDP probing): a call
                                      # over the size limit is cut off within its first window,
                                      # not received (and decrypted) whole first.
                                      ("grpc.http2.bdp_probe", 0)],
                             maximum_concurrent_rpcs=None)
    server.add_generic_rpc_handlers((gateway,))
    credentials = grpc.ssl_server_credentials([(server_key, server_cert)], root_certificates=client_ca,
                                              require_client_auth=True)
    bound = server.add_secure_port(f"{host}:{port}", credentials)
    await server.start()
    peer_usage = None
    if peers is not None:
        peer_usage = PeerUsage(budget, token_keys, peers)
        await peer_usage.start(host, peer_port)
    return RunningGateway(server, gateway, bound, channel, polls, peer_usage)

