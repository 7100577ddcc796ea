"""``gpufleet node-gateway``: the only door from a GPU node to Temporal.

GPU nodes run at third parties; one of them may be compromised. A node agent
therefore holds no Temporal credentials: it dials this gateway with mutual TLS,
presenting its node client certificate (``CN=system:node:<name>``, group
``system:nodes``, the same shape as a kubelet's), and the gateway forwards, over
the control plane's own connection (the standard ``TEMPORAL_*`` settings: mTLS
or API key), only what a node agent needs:

- ``PollActivityTaskQueue`` on ``node/<its own name>``;
- ``RespondActivityTask{Completed,Failed,Canceled}`` and
  ``RecordActivityTaskHeartbeat`` with task tokens this gateway delivered to
  that same node;
- the read-only calls the SDK's worker makes at start-up and its
  ``ShutdownWorker`` (see ``_START_UP``).

Everything else is ``PERMISSION_DENIED``, logged with the node's name. Each forwarded
request is rebuilt from only the fields the policy allows (unknown fields, deployment and
versioning options, embedded worker heartbeats dropped), with the caller's ``identity``
replaced by ``node:<name>``, so histories name the authenticated node.

Every call also checks the certificate (its expiry, so an open connection stops working
when it expires) and that the node is live (``node_liveness``): the certificate's key is
one the cluster's signer bound to the node at its join or a renewal, and its identity
record and Node entity (or its NodeJoin) exist. Certificates cannot be revoked; every
retire path deletes those records, so a retired node's certificate stops working within
the verdict cache's ``--live-ttl`` (1 s), and a Node object its kubelet re-creates, or a
certificate for its name from any other signer, opens nothing.

Per node, at most ``POLLS_PER_NODE`` polls and ``CALLS_PER_NODE`` calls go on at once,
over at most ``CONNECTIONS_PER_NODE`` connections, each request at most
``REQUEST_BYTES`` (results ``RESULT_BYTES``): a call over them is held, without going
upstream, and then answered (a poll with no task), so one node cannot take the frontend's
poll budget or the gateway's memory from the others.

The gateway is stateless but for the delivered tokens, kept in memory on purpose:
after a restart (or on another replica) a completion for a task delivered before it
is refused and the activity is retried when its timeout fires. Every node activity
is already retried after a node reboot or a lost connection and is safe to run twice
(a watch re-reads level-triggered state; a probe, smoke test, GPU reset or driver
reinstall done again ends in the same state), so persisting tokens would buy nothing
that replicas behind a load balancer could share anyway.

PKI helpers (dev stack, tests): ``Pki`` makes a CA and the gateway's server
certificate; ``node_key_and_csr`` runs on the node (the key never leaves it);
``Pki.sign_node_csr`` is the signer (the cluster's CSR approver in production).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import enum
import logging
import os
import re
import signal
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import grpc
import typer
from temporalio.api.enums.v1 import TaskQueueKind
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import request_response_pb2 as wsr

from fleet.settings import Settings, node_queue, temporal_profile
from providers.cluster.base import AccessRule

log = logging.getLogger("gpufleet.node_gateway")

SERVICE = "/temporal.api.workflowservice.v1.WorkflowService/"
#: Subject of a node certificate: kubelet's ``system:node:<name>`` in group ``system:nodes``.
NODE_PREFIX = "system:node:"
NODE_GROUP = "system:nodes"
_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")

#: Start-up calls a node agent's SDK worker makes (recorded from a real agent), each harmless:
#: - GetSystemInfo: the server's version and capability flags; no namespace or workflow data.
#: - DescribeNamespace: the worker checks its namespace exists; only the gateway's own namespace
#:   is answered (its retention and archival settings, no workflow data).
#: - ShutdownWorker: the worker's goodbye, which lets the server drop its pollers; a live node
#:   only (the same check as every call), for its own queue, with no sticky queue (an
#:   activity-only worker has none, and another worker's sticky queue is not the node's to
#:   drop) and without the worker heartbeat the SDK embeds (which would describe a worker, on
#:   whatever queue it names, to the server's worker list).
#: - RecordWorkerHeartbeat: the worker's periodic status (slots, pollers, host) for the
#:   server's worker list, about once a minute; only about the node's own queue, under the
#:   node's identity, without a deployment version. (gpufleet's own agents send none:
#:   ``workers/node_agent.py`` turns them off.)
_START_UP = {"GetSystemInfo", "DescribeNamespace", "ShutdownWorker", "RecordWorkerHeartbeat"}
_RESPONDS = {
    "RespondActivityTaskCompleted": wsr.RespondActivityTaskCompletedRequest,
    "RespondActivityTaskFailed": wsr.RespondActivityTaskFailedRequest,
    "RespondActivityTaskCanceled": wsr.RespondActivityTaskCanceledRequest,
    "RecordActivityTaskHeartbeat": wsr.RecordActivityTaskHeartbeatRequest,
}
#: Only these of the caller's metadata go upstream: a node's own ``authorization`` never does.
_FORWARDED_METADATA = {"client-name", "client-version", "supported-server-versions"}
#: Tokens remembered per node (a node agent runs at most a handful of activities at once).
MAX_TOKENS_PER_NODE = 64


class Refused(Exception):
    """A call the node may not make; the message is logged and returned."""


def node_from_subject(common_name: str) -> str | None:
    if not common_name.startswith(NODE_PREFIX):
        return None
    name = common_name.removeprefix(NODE_PREFIX)
    return name if _NAME.match(name) else None


# -- liveness: the node's identity, bound to this certificate, and a live join or entity -------
#: Every Kubernetes call the gateway makes (its liveness check: a node's identity record and
#: client keys, and a joining node's Node object), as deploy/kubernetes/node-gateway.yaml
#: grants them: nothing more.
ACCESS = (
    AccessRule(verb="get", group="", resource="nodes", purpose="liveness: a joining node's Node exists"),
    AccessRule(verb="get", group="", resource="configmaps", namespace="gpufleet",
               purpose="liveness: the node's identity record and client keys"),
)


class Verdict(enum.Enum):
    """What a liveness lookup found (``None`` from a lookup: it could not tell)."""

    LIVE = "live"
    #: No live identity for the name (retired, or never joined): PERMISSION_DENIED.
    RETIRED = "no live identity for this node (retired, or never joined)"
    #: The node is live but this certificate's key is not one its join or a renewal bound
    #: (a certificate some other signer issued for the name; or a renewal the approver has not
    #: seen yet): refused as UNAVAILABLE, so an agent retries rather than treat its identity as gone.
    UNBOUND = "this certificate's key was not bound to the node at its join or a renewal"


#: (node name, SHA-256 of the certificate's public key) → verdict; True/False are LIVE/RETIRED.
Liveness = Callable[[str, str], Awaitable["Verdict | bool | None"]]


def temporal_liveness(client) -> Liveness:
    """Live = the Node entity ``node/<name>`` runs, or a NodeJoin for that node name runs
    (a joining node polls its queue for the smoke test before its Node entity exists).
    Temporal alone, no certificate binding: only for the tests' shared gateway (one gateway in
    front of many simulated clusters); deployments use ``node_liveness`` with the cluster."""
    return node_liveness(client, None)


#: With a cluster to ask, a Node entity seen running is taken as still running for this long:
#: the identity record, read on every lookup, is what cuts a retired node off at once. Each node
#: calls every 20-60 s (watch heartbeats, held polls running out), so a shorter window would
#: still cost one Temporal read per call: about 90 a second at 1,250 nodes.
ENTITY_SEEN_SECONDS = 120.0


def node_liveness(client, cluster, entity_seen_seconds: float = ENTITY_SEEN_SECONDS) -> Liveness:
    """Live = the certificate's key is one the cluster's signer bound to this node (at its
    join, or a renewal: ``NODE_KEYS_KIND``, written by gpufleet's CSR approver) **and** either
    the node's identity record exists and its Node entity runs, or a NodeJoin for the name runs
    and the Node has registered (the smoke test comes before the entity).

    Every retire path (surplus, consolidation, evacuation, spot reclaim, replace, a failed
    join's clean-up) ends in ``remove_node``, which deletes the keys and the identity record:
    a retired node is refused at once, and nothing it can do brings it back. A kubelet may
    re-create its own Node object, and renew its own certificate through an approver that
    does not ask gpufleet, but neither writes those records. Node names carry a per-join nonce
    (``workflows/node_join.py``), so a later join never revives an old name either. An entity
    ended some other way loses the node its access within ``entity_seen_seconds``.
    ``cluster=None``: Temporal only, asked on every lookup, the key not checked."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError, RPCStatusCode

    from fleet.cluster import NODE_KEYS_KIND, bound_keys

    entity_seen: dict[str, float] = {}  # node → when its entity was last seen running

    async def entity_running(name: str) -> bool:
        try:
            described = await client.get_workflow_handle(f"node/{name}").describe()
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            return False
        return described.status == WorkflowExecutionStatus.RUNNING

    async def entity_recently_running(name: str) -> bool:
        now = time.monotonic()
        if cluster is not None and now - entity_seen.get(name, -entity_seen_seconds) < entity_seen_seconds:
            return True
        running = await entity_running(name)
        if running:
            if len(entity_seen) > 100_000:
                entity_seen.clear()
            entity_seen[name] = now
        else:
            entity_seen.pop(name, None)
        return running

    async def join_running(name: str) -> bool:
        # ``name`` matched _NAME (no quotes), so it is safe inside the query.
        query = f'WorkflowType = "NodeJoin" AND NodeName = "{name}" AND ExecutionStatus = "Running"'
        return (await client.count_workflows(query)).count > 0

    def records(name: str) -> tuple[bool, list[str]]:
        return cluster.node_identity(name) is not None, bound_keys(cluster.read_state(NODE_KEYS_KIND, name))

    async def live(name: str, key: str = "") -> Verdict:
        if cluster is None:
            if await entity_running(name) or await join_running(name):
                return Verdict.LIVE
            return Verdict.RETIRED
        identified, keys = await asyncio.to_thread(records, name)
        if key not in keys:
            return Verdict.UNBOUND if identified or keys else Verdict.RETIRED
        if identified:
            if await entity_recently_running(name) or await join_running(name):
                return Verdict.LIVE
            return Verdict.RETIRED
        # Registered, not yet recorded: a join between the kubelet's registration and its record.
        if await asyncio.to_thread(cluster.get_node, name) is not None and await join_running(name):
            return Verdict.LIVE
        return Verdict.RETIRED

    return live


class LiveCache:
    """Each (node, key) verdict, never older than ``ttl`` seconds: a retired node is refused
    within ``ttl``. A node that keeps calling has its verdict renewed in the background once it
    is half that old, so its calls do not wait for a lookup (cluster and Temporal reads) on the
    round trip's critical path."""

    def __init__(self, check: Liveness, ttl: float = 1.0) -> None:
        self.check, self.ttl = check, ttl
        self._seen: dict[tuple[str, str], tuple[float, Verdict | bool]] = {}
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()

    async def __call__(self, name: str, key: str = "") -> Verdict | bool | None:
        """A verdict (True/False are LIVE/RETIRED); None: cannot tell now (Temporal or the
        cluster did not answer)."""
        now, which = time.monotonic(), (name, key)
        hit = self._seen.get(which)
        if hit is not None and now - hit[0] < self.ttl:
            if now - hit[0] >= self.ttl / 2 and which not in self._inflight:
                self._start(which)
            return hit[1]
        inflight = self._inflight.get(which) or self._start(which)
        return await asyncio.shield(inflight)

    def _start(self, which: tuple[str, str]) -> asyncio.Future:
        """One lookup per (node, key) at a time (a burst of calls from one node shares it)."""
        future = asyncio.get_running_loop().create_future()
        self._inflight[which] = future
        # The loop keeps only weak references to tasks: hold each lookup until it is done.
        task = asyncio.create_task(self._lookup(which, future))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return future

    async def _lookup(self, which: tuple[str, str], future: asyncio.Future) -> None:
        # The verdict's age counts from before the lookup: a retire during it is not missed.
        started = time.monotonic()
        verdict: Verdict | bool | None = None
        known = False
        try:
            verdict = await self.check(*which)
            known = verdict is not None
        except Exception as error:  # noqa: BLE001 - cannot tell: refuse (fail closed), do not cache
            log.warning("liveness of %s unknown: %s", which[0], error)
        finally:
            self._inflight.pop(which, None)
            if known:
                if len(self._seen) > 100_000:
                    self._seen.clear()
                self._seen[which] = (started, verdict)
            else:
                self._seen.pop(which, None)
            future.set_result(verdict)

    def forget(self, name: str) -> None:
        for which in [w for w in self._seen if w[0] == name]:
            self._seen.pop(which, None)


# -- the gateway --------------------------------------------------------------------------------
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
#: A poll that got a slot with less time left than this is answered with no task, not
#: forwarded: the frontend refuses a long poll this short (FAILED_PRECONDITION).
MIN_UPSTREAM_POLL_SECONDS = 3.0
#: Names a node sent that the gateway echoes (queues, namespaces, methods) are cut to this.
ECHO_CHARS = 64
#: A node over its limits is logged at most this often (every such call is counted).
LIMIT_LOG_SECONDS = 60.0

_RESULTS = {"RespondActivityTaskCompleted", "RespondActivityTaskFailed", "RespondActivityTaskCanceled"}
#: The fields each forwarded request keeps (all others, unknown ones included, are dropped):
#: no deployment or versioning options, no resource ids, nothing a newer SDK adds unread.
_KEPT = {
    "RespondActivityTaskCompleted": {"task_token", "result", "identity", "namespace"},
    "RespondActivityTaskFailed": {"task_token", "failure", "identity", "namespace", "last_heartbeat_details", "cause"},
    "RespondActivityTaskCanceled": {"task_token", "details", "identity", "namespace"},
    "RecordActivityTaskHeartbeat": {"task_token", "details", "identity", "namespace"},
}
_INSTANCE_KEY = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
#: Worker heartbeats one RecordWorkerHeartbeat may carry (an agent process runs one worker).
MAX_WORKER_HEARTBEATS = 4


def echo(value: str) -> str:
    """``value`` as the gateway may repeat it in an error or a log line: quoted, cut short."""
    value = str(value)
    return repr(value[:ECHO_CHARS]) + (f"… ({len(value)} chars)" if len(value) > ECHO_CHARS else "")


def _only(message, kept: set[str]):
    """``message`` with only the ``kept`` fields, unknown fields dropped (nested too)."""
    for descriptor in message.DESCRIPTOR.fields:
        if descriptor.name not in kept:
            message.ClearField(descriptor.name)
    message.DiscardUnknownFields()
    return message


@dataclass
class GatewayStats:
    forwarded: int = 0
    refused: int = 0
    refusals: list[str] = field(default_factory=list)
    held_polls: int = 0
    #: Calls over a node's limits (held, then answered; or too big), since start.
    limited: int = 0
    #: Calls held now because their node is over its limits.
    held_over_limits: int = 0
    #: node → serial of the certificate it last presented (agents reload rotated keys).
    serials: dict[str, int] = field(default_factory=dict)


@dataclass
class NodeCert:
    """What the gateway keeps of a node's certificate, parsed once."""

    node: str
    key: str  # SHA-256 of its public key (``fleet.cluster.client_key_fingerprint``)
    not_after: float


@dataclass
class NodeLoad:
    """One node's calls in flight now."""

    polls: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(POLLS_PER_NODE))
    calls: int = 0
    held: int = 0
    upstream_polls: int = 0  # polls forwarded and not yet answered
    connections: Counter = field(default_factory=Counter)  # peer → its admitted calls

    @property
    def idle(self) -> bool:
        return not self.calls and not self.held


class NodeGateway(grpc.GenericRpcHandler):
    def __init__(self, upstream: grpc.aio.Channel, namespace: str, live: Liveness,
                 upstream_metadata: list[tuple[str, str]] | None = None,
                 poll_channels: list[grpc.aio.Channel] | None = None) -> None:
        self.upstream = upstream
        # Held long polls (at most two per node) ride connections of their own: a completion or
        # a heartbeat never queues behind a thousand open polls for an HTTP/2 stream.
        self.poll_channels = poll_channels or [upstream]
        self._next_poll = 0
        self.namespace = namespace
        self.live = live
        self.upstream_metadata = list(upstream_metadata or [])
        self.stats = GatewayStats()
        self._tokens: dict[str, OrderedDict[bytes, None]] = {}
        self._certs: dict[bytes, NodeCert] = {}  # certificate PEM → what it says
        self._stubs: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}
        self._load: dict[str, NodeLoad] = {}
        self._limit_logged: dict[str, float] = {}

    # grpc.GenericRpcHandler
    def service(self, details: grpc.HandlerCallDetails):
        method = details.method

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await self._handle(method, request, context)

        return grpc.unary_unary_rpc_method_handler(handle)

    def _refuse(self, node: str, method: str, why: str) -> Refused:
        self.stats.refused += 1
        call = echo(method.rsplit("/", 1)[-1]).strip("'")
        line = f"{node or '?'}: {call} refused: {why}"
        self.stats.refusals = [*self.stats.refusals, line][-200:]
        log.warning("node %s: %s refused: %s", node or "?", call, why)
        return Refused(why)

    def _over_limit(self, node: str, why: str) -> None:
        self.stats.limited += 1
        now = time.monotonic()
        if now - self._limit_logged.get(node, -LIMIT_LOG_SECONDS) >= LIMIT_LOG_SECONDS:
            if len(self._limit_logged) > 100_000:
                self._limit_logged.clear()
            self._limit_logged[node] = now
            log.warning("node %s over its limits (%s); its calls over them are held, then answered "
                        "(logged once a minute, each counted)", node, why)

    def _identify(self, context: grpc.aio.ServicerContext) -> NodeCert:
        """The caller's certificate, checked again on every call: an open connection stops
        working when its certificate expires (the TLS handshake checked it only once)."""
        auth = context.auth_context()
        pem = auth.get("x509_pem_cert", [b""])[0]
        known = self._certs.get(pem)
        if known is None:
            known = self._parse(pem, [n.decode(errors="replace") for n in auth.get("x509_common_name", [])])
        if time.time() >= known.not_after:
            raise self._refuse(known.node, "(any)", "certificate expired at "
                               + dt.datetime.fromtimestamp(known.not_after, dt.timezone.utc).isoformat())
        return known

    def _parse(self, pem: bytes, names: list[str]) -> NodeCert:
        node = node_from_subject(names[0]) if names else None
        if node is None or not pem:
            raise self._refuse("", "(any)", f"not a node certificate: {echo(names[0]) if names else 'none'}")
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        from fleet.cluster import client_key_fingerprint

        cert = x509.load_pem_x509_certificate(pem)
        groups = [a.value for a in cert.subject.get_attributes_for_oid(x509.NameOID.ORGANIZATION_NAME)]
        if NODE_GROUP not in groups:
            raise self._refuse(node, "(any)", f"certificate not in group {NODE_GROUP}")
        self.stats.serials[node] = cert.serial_number
        key = client_key_fingerprint(cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo))
        known = NodeCert(node, key, cert.not_valid_after_utc.timestamp())
        # The TLS handshake checked chain and validity; parsed once per certificate, not per call.
        if len(self._certs) > 50_000:
            self._certs.clear()
        self._certs[pem] = known
        return known

    def _namespace(self, node: str, name: str, namespace: str, empty_ok: bool = False) -> None:
        if namespace != self.namespace and not (empty_ok and not namespace):
            raise self._refuse(node, name, f"namespace {echo(namespace)}")

    def _authorize(self, node: str, name: str, request: bytes) -> tuple[bytes, bytes | None]:
        """The request to forward, rebuilt from only what the policy allows (identity rewritten,
        unknown fields and deployment options dropped), and the token it uses; or Refused."""
        identity, queue = f"node:{node}", node_queue(node)
        if name == "PollActivityTaskQueue":
            poll = wsr.PollActivityTaskQueueRequest.FromString(request)
            self._namespace(node, name, poll.namespace)
            if poll.task_queue.name != queue:
                raise self._refuse(node, name, f"task queue {echo(poll.task_queue.name)} is not {queue!r}")
            if poll.worker_control_task_queue:
                raise self._refuse(node, name, f"control queue {echo(poll.worker_control_task_queue)}")
            # No deployment or versioning options (they create Worker Deployments in the
            # namespace), no rate-limit metadata, no unknown fields held for a whole long poll.
            forward = wsr.PollActivityTaskQueueRequest(
                namespace=self.namespace, identity=identity,
                task_queue=TaskQueue(name=queue, kind=TaskQueueKind.TASK_QUEUE_KIND_NORMAL))
            if _INSTANCE_KEY.match(poll.worker_instance_key):
                forward.worker_instance_key = poll.worker_instance_key
            return forward.SerializeToString(), None
        if name in _RESPONDS:
            message = _RESPONDS[name].FromString(request)
            self._namespace(node, name, message.namespace, empty_ok=True)
            if message.task_token not in self._tokens.get(node, ()):
                raise self._refuse(node, name, "a task token this gateway did not deliver to this node")
            _only(message, _KEPT[name])
            message.identity = identity
            return message.SerializeToString(), message.task_token
        if name == "GetSystemInfo":
            return wsr.GetSystemInfoRequest().SerializeToString(), None
        if name == "DescribeNamespace":
            described = wsr.DescribeNamespaceRequest.FromString(request)
            if described.namespace != self.namespace or described.id:
                raise self._refuse(node, name, f"namespace {echo(described.namespace or described.id)}")
            return wsr.DescribeNamespaceRequest(namespace=self.namespace).SerializeToString(), None
        if name == "ShutdownWorker":
            bye = wsr.ShutdownWorkerRequest.FromString(request)
            self._namespace(node, name, bye.namespace)
            if bye.sticky_task_queue or bye.task_queue not in ("", queue):
                raise self._refuse(node, name, f"queue {echo(bye.task_queue or bye.sticky_task_queue)}")
            # Its own queue only, and no embedded worker heartbeat: that would describe a worker
            # (on any queue it names) to the server's worker list.
            forward = wsr.ShutdownWorkerRequest(namespace=self.namespace, identity=identity, task_queue=queue,
                                                reason=bye.reason[:ECHO_CHARS],
                                                task_queue_types=bye.task_queue_types)
            if _INSTANCE_KEY.match(bye.worker_instance_key):
                forward.worker_instance_key = bye.worker_instance_key
            return forward.SerializeToString(), None
        if name == "RecordWorkerHeartbeat":
            beat = wsr.RecordWorkerHeartbeatRequest.FromString(request)
            self._namespace(node, name, beat.namespace)
            queues = {h.task_queue for h in beat.worker_heartbeat}
            if not queues <= {queue} or len(beat.worker_heartbeat) > MAX_WORKER_HEARTBEATS:
                raise self._refuse(node, name, f"{len(beat.worker_heartbeat)} heartbeats for queues "
                                   + ", ".join(echo(q) for q in sorted(queues)[:3]))
            forward = wsr.RecordWorkerHeartbeatRequest(namespace=self.namespace, identity=identity)
            for heartbeat in beat.worker_heartbeat:
                kept = forward.worker_heartbeat.add()
                kept.CopyFrom(heartbeat)
                kept.DiscardUnknownFields()
                kept.ClearField("deployment_version")
                kept.worker_identity = identity
            return forward.SerializeToString(), None
        raise self._refuse(node, name, "not a node agent's call")

    async def _alive(self, node: str, key: str) -> Verdict | None:
        try:
            verdict = await self.live(node, key)
        except Exception as error:  # noqa: BLE001 - a bare liveness check (no LiveCache) that could not tell
            log.warning("liveness of %s unknown: %s", node, error)
            return None
        if verdict is True:
            return Verdict.LIVE
        return Verdict.RETIRED if verdict is False else verdict

    def _remember(self, node: str, token: bytes) -> None:
        tokens = self._tokens.setdefault(node, OrderedDict())
        tokens[token] = None
        while len(tokens) > MAX_TOKENS_PER_NODE:
            tokens.popitem(last=False)

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

    async def _hold(self, node: str, load: NodeLoad, polling: bool, why: str,
                    context: grpc.aio.ServicerContext) -> bytes:
        """A call over the node's limits: held, then answered, and nothing sent upstream."""
        self._over_limit(node, why)
        load.held += 1
        self.stats.held_over_limits += 1
        try:
            await asyncio.sleep(self._hold_seconds(context))
        finally:
            load.held -= 1
            self.stats.held_over_limits -= 1
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
            cert = self._identify(context)
            node = cert.node
            if not method.startswith(SERVICE):
                raise self._refuse(node, method, "not the workflow service")
        except Refused as refused:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"node gateway: {refused}")
        limit = RESULT_BYTES if name in _RESULTS else REQUEST_BYTES
        if len(request) > limit:
            self._over_limit(node, f"a {len(request)}-byte {echo(name)}")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"node gateway: a request of {len(request)} bytes; the limit is {limit}")
        polling = name == "PollActivityTaskQueue"
        load = self._load.get(node)
        if load is None:
            load = self._load[node] = NodeLoad()
        peer = context.peer()
        if peer not in load.connections and len(load.connections) >= CONNECTIONS_PER_NODE:
            return await self._hold(node, load, polling, f"more than {CONNECTIONS_PER_NODE} connections", context)
        if load.calls >= CALLS_PER_NODE:
            return await self._hold(node, load, polling, f"more than {CALLS_PER_NODE} calls at once", context)
        load.calls += 1
        load.connections[peer] += 1
        slot = False
        try:
            try:
                forward, token = self._authorize(node, name, request)
                verdict = await self._alive(node, cert.key)
                if verdict is None or verdict is Verdict.UNBOUND:
                    # Fail closed, but as a transient error: while the control plane is away (static
                    # stability), or a renewed key is not bound yet, an agent must keep retrying, not
                    # treat its identity as revoked.
                    if verdict is Verdict.UNBOUND:
                        log.warning("node %s: %s", node, verdict.value)
                    why = verdict.value if verdict else "cannot verify this node now (control plane unreachable)"
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"node gateway: {why}; retry")
                if verdict is not Verdict.LIVE:
                    raise self._refuse(node, name, verdict.value)
            except Refused as refused:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"node gateway: {refused}")
            del request  # the rebuilt request is what goes on
            if polling:
                try:
                    await asyncio.wait_for(load.polls.acquire(), self._hold_seconds(context))
                except asyncio.TimeoutError:
                    self._over_limit(node, f"more than {POLLS_PER_NODE} polls at once")
                    return b""  # no task: as a long poll that found none
                slot = True
                remaining = context.time_remaining()
                if remaining is not None and remaining < MIN_UPSTREAM_POLL_SECONDS:
                    return b""  # too late for a long poll upstream (the frontend refuses one this short)
            return await self._forward(method, node, name, forward, token, polling, context)
        finally:
            if slot:
                load.polls.release()
            load.calls -= 1
            load.connections[peer] -= 1
            if not load.connections[peer]:
                del load.connections[peer]
            self._release(node, load)

    async def _forward(self, method: str, node: str, name: str, forward: bytes, token: bytes | None,
                       polling: bool, context: grpc.aio.ServicerContext) -> bytes:
        metadata = [(k, v) for k, v in context.invocation_metadata() or () if k in _FORWARDED_METADATA]
        metadata += [("temporal-namespace", self.namespace), *self.upstream_metadata]
        remaining = context.time_remaining()
        load = self._load[node]
        self.stats.held_polls += polling
        load.upstream_polls += polling
        try:
            response = await self._stub(method)(forward, metadata=metadata,
                                                timeout=remaining if remaining and remaining < 1e6 else None)
        except grpc.aio.AioRpcError as error:
            # Temporal's typed failures ride in the trailers (grpc-status-details-bin): pass them on.
            context.set_trailing_metadata(tuple(error.trailing_metadata() or ()))
            await context.abort(error.code(), error.details() or "")
        finally:
            self.stats.held_polls -= polling
            load.upstream_polls -= polling
        self.stats.forwarded += 1
        if polling and response:
            delivered = _task_token(response)
            if delivered:
                self._remember(node, delivered)
        elif token is not None and name != "RecordActivityTaskHeartbeat":
            self._tokens.get(node, {}).pop(token, None)
        return response


def _task_token(response: bytes) -> bytes:
    """``task_token`` (field 1) of a PollActivityTaskQueueResponse without decoding the rest
    (the input payloads): serializers write fields in number order, so it leads."""
    if response[:1] == b"\x0a":
        length, shift, i = 0, 0, 1
        while i < len(response) and i < 6:
            byte = response[i]
            length |= (byte & 0x7F) << shift
            i += 1
            if not byte & 0x80:
                return response[i:i + length]
            shift += 7
    return wsr.PollActivityTaskQueueResponse.FromString(response).task_token


# -- connections --------------------------------------------------------------------------------
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


async def default_liveness(settings: Settings) -> Liveness:
    """``node_liveness`` over the control plane's own Temporal connection and the fleet's
    cluster (``GPUFLEET_CONFIG``: the sim's over the state dir, or Kubernetes: the gateway's
    service account needs only ``get`` on nodes and the node-identity ConfigMaps)."""
    from fleet.temporal import connect

    client = await connect(settings)
    if not settings.config:
        log.warning("no fleet config (GPUFLEET_CONFIG): liveness from Temporal alone; a retired node "
                    "keeps access until its Node entity ends")
        return temporal_liveness(client)
    from activities.env import FleetEnv

    return node_liveness(client, FleetEnv.from_settings(settings).cluster)


class GatewayCollector:
    """The gateway's own figures, read from its stats at scrape time: what an operator watches
    for a node trying what it may not (refusals) and for the held polls the frontend carries."""

    def __init__(self, gateway: "NodeGateway") -> None:
        self.gateway = gateway

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.gateway.stats
        yield CounterMetricFamily("gpufleet_gateway_forwarded", "Node agent calls forwarded to Temporal.",
                                  value=stats.forwarded)
        yield CounterMetricFamily("gpufleet_gateway_refused",
                                  "Node agent calls refused (PERMISSION_DENIED), each logged with the node.",
                                  value=stats.refused)
        yield GaugeMetricFamily("gpufleet_gateway_held_polls", "Long polls the gateway holds open for nodes now.",
                                value=stats.held_polls)
        yield GaugeMetricFamily("gpufleet_gateway_nodes", "Distinct node identities seen since start.",
                                value=len(stats.serials))
        yield CounterMetricFamily("gpufleet_gateway_limited",
                                  "Node calls over the node's limits (held, then answered; or too big).",
                                  value=stats.limited)
        yield GaugeMetricFamily("gpufleet_gateway_held_over_limits",
                                "Calls held now because their node is over its limits.",
                                value=stats.held_over_limits)


@dataclass
class RunningGateway:
    server: grpc.aio.Server
    gateway: NodeGateway
    port: int
    channel: grpc.aio.Channel
    poll_channels: list[grpc.aio.Channel] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace: float | None = 1.0) -> None:
        await self.server.stop(grace)
        for channel in [self.channel, *self.poll_channels]:
            await channel.close()


async def start_gateway(settings: Settings, server_cert: bytes, server_key: bytes, client_ca: bytes,
                        live: Liveness | None = None, host: str = "127.0.0.1", port: int = 0,
                        live_ttl: float = 1.0, poll_connections: int = 4) -> RunningGateway:
    """Serve the gateway: mutual TLS, client certificates from ``client_ca`` required."""
    channel, metadata = upstream_channel(settings, own_connection=True)
    polls = [upstream_channel(settings, own_connection=True)[0] for _ in range(poll_connections)]
    if live is None:
        live = await default_liveness(settings)
    gateway = NodeGateway(channel, settings.namespace, LiveCache(live, live_ttl), metadata, polls)
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
    return RunningGateway(server, gateway, bound, channel, polls)


# -- PKI: dev stack and tests; production uses the cluster CA's signer -------------------------
def _name(cn: str, org: str | None = None):
    from cryptography import x509

    attrs = [x509.NameAttribute(x509.NameOID.COMMON_NAME, cn)]
    if org:
        attrs.insert(0, x509.NameAttribute(x509.NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def node_key_and_csr(node_name: str) -> tuple[bytes, bytes]:
    """Made on the node: a fresh key (never leaves the node) and the CSR that asks for its
    certificate. Returns (key PEM, CSR PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    csr = x509.CertificateSigningRequestBuilder().subject_name(
        _name(f"{NODE_PREFIX}{node_name}", NODE_GROUP)).sign(key, hashes.SHA256())
    return _pem_key(key), csr.public_bytes(serialization.Encoding.PEM)


class Pki:
    """A CA (the dev stack's stand-in for the cluster CA), its signer and the gateway's server
    certificate. Kept under ``directory`` when given (``gpufleet dev``: ``<state>/pki``)."""

    def __init__(self, ca_key, ca_cert) -> None:
        self.ca_key, self.ca_cert = ca_key, ca_cert

    @classmethod
    def create(cls, name: str = "gpufleet dev node CA") -> "Pki":
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=365))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    @classmethod
    def load_or_create(cls, directory: Path) -> "Pki":
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        ca_pem, key_pem = directory / "ca.pem", directory / "ca.key"
        if ca_pem.exists() and key_pem.exists():
            return cls(serialization.load_pem_private_key(key_pem.read_bytes(), None),
                       x509.load_pem_x509_certificate(ca_pem.read_bytes()))
        pki = cls.create()
        directory.mkdir(parents=True, exist_ok=True)
        key_pem.touch(mode=0o600)
        key_pem.write_bytes(_pem_key(pki.ca_key))
        ca_pem.write_bytes(pki.ca_pem)
        return pki

    @property
    def ca_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self.ca_cert.public_bytes(serialization.Encoding.PEM)

    def _issue(self, subject, public_key, lifetime: dt.timedelta, usage, sans=None,
               not_before: dt.datetime | None = None) -> bytes:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization

        start = not_before or dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(self.ca_cert.subject)
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(start + lifetime)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(self.ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    def server_cert(self, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) for the gateway's listener."""
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
        sans = []
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        cert = self._issue(_name("gpufleet node gateway"), key.public_key(), dt.timedelta(days=365),
                           x509.ExtendedKeyUsageOID.SERVER_AUTH, sans)
        return cert, _pem_key(key)

    def sign_node_csr(self, csr_pem: bytes, node_name: str, lifetime: dt.timedelta = dt.timedelta(days=1),
                      not_before: dt.datetime | None = None) -> bytes:
        """The signer: a node certificate only for the name it was asked for (as the cluster's
        CSR approver checks a kubelet's CSR against the node it bootstrapped)."""
        from cryptography import x509

        csr = x509.load_pem_x509_csr(csr_pem)
        if not csr.is_signature_valid:
            raise ValueError("csr: bad signature")
        cns = [a.value for a in csr.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)]
        if cns != [f"{NODE_PREFIX}{node_name}"]:
            raise ValueError(f"csr: subject {cns} is not {NODE_PREFIX}{node_name}")
        return self._issue(_name(f"{NODE_PREFIX}{node_name}", NODE_GROUP), csr.public_key(), lifetime,
                           x509.ExtendedKeyUsageOID.CLIENT_AUTH, not_before=not_before)

    def node_credentials(self, node_name: str, lifetime: dt.timedelta = dt.timedelta(days=1)) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM): the node's half (key, CSR) and the signer's, in one call."""
        key, csr = node_key_and_csr(node_name)
        return self.sign_node_csr(csr, node_name, lifetime), key


@dataclass
class GatewayAccess:
    """What a node agent needs to reach the gateway: its address and the CA that signed the
    gateway's certificate. Its own certificate comes from a ``CertSource``."""

    address: str
    ca: bytes
    server_name: str = "localhost"

    def env(self, ca_path: Path) -> dict[str, str]:
        return {"GPUFLEET_GATEWAY": self.address, "GPUFLEET_GATEWAY_CA": str(ca_path)}

    @classmethod
    def from_env(cls) -> "GatewayAccess | None":
        address = os.environ.get("GPUFLEET_GATEWAY")
        if not address:
            return None
        ca = Path(os.environ["GPUFLEET_GATEWAY_CA"]).read_bytes()
        return cls(address, ca, os.environ.get("GPUFLEET_GATEWAY_SERVER_NAME", "localhost"))


def dev_gateway_files(state_dir: Path) -> dict[str, Path]:
    """The dev stack's CA and gateway certificate, made once under ``<state>/pki``."""
    pki_dir = state_dir / "pki"
    pki = Pki.load_or_create(pki_dir)
    files = {"ca": pki_dir / "ca.pem", "ca_key": pki_dir / "ca.key",
             "cert": pki_dir / "gateway.pem", "key": pki_dir / "gateway.key"}
    if not files["cert"].exists() or not files["key"].exists():
        cert, key = pki.server_cert()
        files["key"].touch(mode=0o600)
        files["key"].write_bytes(key)
        files["cert"].write_bytes(cert)
    return files


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gpufleet node-gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default=os.environ.get("GPUFLEET_GATEWAY_LISTEN", "127.0.0.1:7300"),
                        help="host:port for node agents")
    parser.add_argument("--cert", help="the gateway's server certificate (PEM)")
    parser.add_argument("--key", help="its private key (PEM)")
    parser.add_argument("--client-ca", help="CA that signs node client certificates (the cluster CA)")
    parser.add_argument("--dev", action="store_true", help="make/load a dev CA and certificate under the state dir")
    parser.add_argument("--live-ttl", type=float, default=1.0, help="seconds a node's liveness verdict is kept")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve /metrics here (default: GPUFLEET_METRICS_PORT; unset: none)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node-gateway %(levelname)s %(message)s")
    settings = Settings.from_env()
    if args.dev:
        files = dev_gateway_files(settings.state_dir)
        args.cert, args.key, args.client_ca = files["cert"], files["key"], files["ca"]
    if not (args.cert and args.key and args.client_ca):
        parser.error("--cert, --key and --client-ca are required (or --dev)")
    host, _, port = args.listen.rpartition(":")
    running = await start_gateway(settings, Path(args.cert).read_bytes(), Path(args.key).read_bytes(),
                                  Path(args.client_ca).read_bytes(), host=host or "127.0.0.1", port=int(port),
                                  live_ttl=args.live_ttl)
    log.info("node gateway on %s:%s → %s (namespace %s)", host, running.port, settings.address, settings.namespace)
    from prometheus_client import REGISTRY

    from workers.metrics import start_metrics

    metrics = start_metrics(args.metrics_port, "node-gateway")
    if metrics is not None:
        REGISTRY.register(GatewayCollector(running.gateway))
    from workers.gc_tuning import settle_garbage_collection

    settle_garbage_collection()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop()


def serve(argv: list[str] | None = None) -> None:
    """Run ``main`` on uvloop when it is installed: every forwarded call is a handful of event
    loop callbacks on the gateway's one thread, and uvloop's are cheaper."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(argv))
    else:
        uvloop.run(main(argv))


def cli(ctx: typer.Context) -> None:
    """The node gateway between GPU nodes and Temporal (``--help`` for its options)."""
    serve(ctx.args)


if __name__ == "__main__":
    serve()
