"""Which calls a node may make, decided on every call from its client certificate.

A node agent may only:

- ``PollActivityTaskQueue`` on ``node/<its own name>``;
- ``RespondActivityTask{Completed,Failed,Canceled}`` and ``RecordActivityTaskHeartbeat``
  with task tokens the gateway (any replica, before or after a restart) delivered to that same
  node: sealed for it with the gateway's key (``task_tokens``);
- make the read-only calls the SDK's worker makes at start-up and its ``ShutdownWorker``
  (see ``_START_UP``).

Everything else is refused (``Refused``: PERMISSION_DENIED, logged with the node's name: the
first of each call and reason a minute, then how many more, ``node_log``),
``RecordWorkerHeartbeat`` included (see ``_START_UP``). Each allowed request is rebuilt from
only the fields the policy allows (unknown fields, deployment and versioning options, embedded
worker heartbeats, heartbeat and cancellation details dropped; a failure rebuilt by
``clean_failure``, a result by ``clean_result``), with the caller's ``identity`` replaced by
``node:<name>``, so histories name the authenticated node.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
from dataclasses import dataclass, field

import grpc
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.enums.v1 import TaskQueueKind
from temporalio.api.failure.v1 import ApplicationFailureInfo, Failure
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import request_response_pb2 as wsr
from temporalio.api.workflowservice.v1 import service_pb2

from fleet.naming import node_queue
from workers.gateway.node_identity import NODE_GROUP, node_from_subject
from workers.gateway.node_log import NodeLog
from workers.gateway.task_tokens import TaskTokens

log = logging.getLogger("gpufleet.node_gateway")

SERVICE = "/temporal.api.workflowservice.v1.WorkflowService/"

#: Start-up calls a node agent's SDK worker makes (recorded from a real agent), each harmless:
#: - GetSystemInfo: the server's version and capability flags; no namespace or workflow data.
#: - DescribeNamespace: the worker checks its namespace exists; only the gateway's own namespace
#:   is answered (its retention and archival settings, no workflow data).
#: - ShutdownWorker: the worker's goodbye, which lets the server drop its pollers; a live node
#:   only (the same check as every call), for its own queue, with no sticky queue (an
#:   activity-only worker has none, and another worker's sticky queue is not the node's to
#:   drop) and without the worker heartbeat the SDK embeds (which would describe a worker, on
#:   whatever queue it names, to the server's worker list).
#: Not ``RecordWorkerHeartbeat`` (the SDK's periodic worker status for the server's worker
#: list): gpufleet's own agents send none (``workers/node_agent.py`` turns them off) and nothing
#: reads a node's, while each call may name new worker instance keys with kilobytes of text, so
#: one node could fill the server's memory with workers. It is refused as every other call; an
#: agent on the SDK's defaults logs the refusal and works on.
_START_UP = {"GetSystemInfo", "DescribeNamespace", "ShutdownWorker"}
_RESPONDS = {
    "RespondActivityTaskCompleted": wsr.RespondActivityTaskCompletedRequest,
    "RespondActivityTaskFailed": wsr.RespondActivityTaskFailedRequest,
    "RespondActivityTaskCanceled": wsr.RespondActivityTaskCanceledRequest,
    "RecordActivityTaskHeartbeat": wsr.RecordActivityTaskHeartbeatRequest,
}
#: Every call a node may make (each still checked in ``NodeAuthorization.authorize``).
ALLOWED = frozenset({"PollActivityTaskQueue", *_START_UP, *_RESPONDS})
#: The calls a refusal's log windows (``NodeLog``) are kept apart by: the workflow service's own
#: (a refused node's log says which it tried), a set Temporal's API fixes and no node can add to.
#: Any other name is the node's own invention, one window for all ("other calls"): a node making
#: up names would otherwise write a line per name.
NAMED_CALLS = frozenset({*service_pb2.DESCRIPTOR.services_by_name["WorkflowService"].methods_by_name, "(any)"})
#: The calls that carry an activity's result (they may be larger: ``proxy.RESULT_BYTES``).
RESULTS = {"RespondActivityTaskCompleted", "RespondActivityTaskFailed", "RespondActivityTaskCanceled"}
#: Only these of the caller's metadata go upstream: a node's own ``authorization`` never does.
FORWARDED_METADATA = {"client-name", "client-version", "supported-server-versions"}
#: Names a node sent that the gateway echoes (queues, namespaces, methods) are cut to this.
ECHO_CHARS = 64
#: The fields each forwarded request keeps (all others, unknown ones included, are dropped):
#: no deployment or versioning options, no resource ids, nothing a newer SDK adds unread.
#: No payloads but a completion's result either (validated by the workflow that takes it, and
#: rebuilt by ``clean_result``): the SDK decodes a failure's and a cancellation's details, and an
#: activity's last heartbeat details on its heartbeat timeout, before workflow code runs, so
#: details in an encoding the control plane does not speak would fail that workflow's task on
#: every retry. Nothing in gpufleet reads a node activity's heartbeat or cancellation details; a
#: failure is rebuilt by ``clean_failure``.
_KEPT = {
    "RespondActivityTaskCompleted": {"task_token", "result", "identity", "namespace"},
    "RespondActivityTaskFailed": {"task_token", "failure", "identity", "namespace", "cause"},
    "RespondActivityTaskCanceled": {"task_token", "identity", "namespace"},
    "RecordActivityTaskHeartbeat": {"task_token", "identity", "namespace"},
}
_INSTANCE_KEY = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
#: A node's failure message is cut to this many characters, its stack trace to its last this many.
FAILURE_MESSAGE_CHARS = 2_000
FAILURE_STACK_CHARS = 4_000
#: Causes kept under a node's failure (an ``ApplicationError`` raised ``from`` another error).
FAILURE_CAUSES = 1
#: The failure types a node's agent raises (``activities/node_agent.py``). Any other type a node
#: sends arrives as ``NodeError``: workflows and retry policies decide on a failure's type, and
#: some types mean something about more than the node ("BadCredentials" revokes a provider
#: account, "OverQuota" blocks an offer, "InvalidRequest" ends a whole capacity request).
#: "ComputeCheckUnavailable" (the smoke test's compute check cannot run on the node: its agent's
#: problem, no verdict on a GPU) is about that node alone: its own repair waits held for a person.
NODE_FAILURE_TYPES = frozenset({"GpuResetFailed", "DriverReinstallFailed", "InvalidInput", "ComputeCheckUnavailable"})
#: The one encoding a node's result keeps: what every node agent's converter writes (each node
#: activity returns a pydantic model or a string, JSON either way). The workflows take the result
#: undecoded (``RawValue``) and validate it in workflow code, but the SDK looks at a payload's
#: metadata before workflow code runs: an external-storage reference (its encoding, its marker
#: key) with no external storage configured, or a result of more or fewer than one payload, fails
#: the workflow task on every retry.
RESULT_ENCODING = b"json/plain"
#: What the workflow gets in place of a result in any other form: one payload in an encoding no
#: converter speaks, which the SDK passes to workflow code untouched and the workflow's own
#: validation finds undecodable (a bad report, a failed smoke test or rung). Its data says why,
#: for whoever reads the history.
REFUSED_RESULT_ENCODING = b"binary/refused-by-node-gateway"
#: The most bytes a result's data may take, by the activity type of its task (sealed in the task
#: token the node was handed: ``task_tokens``); a larger one is replaced as a result in any other
#: form is (``REFUSED_RESULT_ENCODING``): a bad report, a failed smoke test or rung. Every result
#: lands in the history of the workflow that scheduled its activity, in the store every workflow
#: shares; the gRPC bound (``proxy.RESULT_BYTES``, 512 KiB) let each watch answer carry half a
#: megabyte: 30 early answers free under the watch's pace, again after each slow one, about 62 MiB
#: an hour into a node's entity, ~20 GiB per node over the namespace's retention; and a site's
#: evacuation took every node's smoke result whole (100 nodes: 50 MB in one proof round). What an
#: honest agent (``activities/node_agent.py``, NVML's strings) sends, in JSON:
#: - ``watch_node`` (and ``probe_gpus``, the same GPUs): about 300 bytes a GPU and 90 an XID event
#:   it still holds (``MAX_XIDS``, 64 a GPU): 8 GPUs 3 KB, with full XID lists 52 KB; 16 GPUs with
#:   full lists 104 KB; 64 GPUs (``MAX_NODE_GPUS``) 22 KB, 121 KB with 16 events each.
#: - ``smoke_test``: its failures (one per problem and XID event of a GPU) and, for a join, the
#:   node's state as a watch answers it; the workflow accepts at most 4 × ``MAX_NODE_GPUS``
#:   failures (``SmokeReport``), so at most 256 XID events and 64 GPUs: about 53 KB.
#: - ``reset_gpu``, ``reinstall_driver``: a tool's output, accepted up to 1,000 characters
#:   (``NodeSaid``; 6,000 bytes as JSON escapes at worst).
#: A type not listed (none runs on a node's queue; an envelope from before types were sealed)
#: takes only the gRPC bound.
RESULT_LIMITS = {
    "watch_node": 128 * 1024,
    "probe_gpus": 128 * 1024,
    "smoke_test": 64 * 1024,
    "reset_gpu": 8 * 1024,
    "reinstall_driver": 8 * 1024,
}


class Refused(Exception):
    """A call the node may not make; the message is logged and returned."""


def echo(value: str) -> str:
    """``value`` as the gateway may repeat it in an error or a log line: quoted, cut short."""
    value = str(value)
    return repr(value[:ECHO_CHARS]) + (f"… ({len(value)} chars)" if len(value) > ECHO_CHARS else "")


#: Per respond call, the fields ``_only`` clears: every field of the message but the kept ones,
#: listed once at import (walking the descriptor on every call cost more than the clearing).
_CLEARED = {name: tuple(d.name for d in _RESPONDS[name].DESCRIPTOR.fields if d.name not in kept)
            for name, kept in _KEPT.items()}
_NORMAL = TaskQueueKind.TASK_QUEUE_KIND_NORMAL  # an enum wrapper's attribute costs a lookup a call
#: Rebuilt polls kept (one a node, for its latest worker instance key): a node's polls are the
#: same request each time, and every field of it comes from the node's name and that checked key.
MAX_POLLS_KEPT = 50_000


def _only(message, cleared: tuple[str, ...]):
    """``message`` without the ``cleared`` fields, unknown fields dropped (nested too)."""
    for name in cleared:
        message.ClearField(name)
    message.DiscardUnknownFields()
    return message


def clean_failure(failure: Failure, causes: int = FAILURE_CAUSES) -> Failure:
    """What a node's failure may tell the workflow: its message (cut short), its application
    type when it is one a node's agent raises (``NODE_FAILURE_TYPES``; any other is ``NodeError``)
    and its ``non_retryable`` flag (retry policies and workflows match on them), the end of its
    stack trace, and ``causes`` levels of cause, each cleaned
    the same way. No payloads (``details``, ``encoded_attributes``: the SDK decodes them before
    workflow code runs), no retry delay or category; a failure of any other kind (timeout,
    cancellation, ...) is an untyped, retryable application failure."""
    info = failure.application_failure_info
    kind = info.type if info.type in NODE_FAILURE_TYPES or not info.type else "NodeError"
    clean = Failure(message=failure.message[:FAILURE_MESSAGE_CHARS],
                    stack_trace=failure.stack_trace[-FAILURE_STACK_CHARS:],
                    application_failure_info=ApplicationFailureInfo(type=kind, non_retryable=info.non_retryable))
    if causes > 0 and failure.HasField("cause"):
        clean.cause.CopyFrom(clean_failure(failure.cause, causes - 1))
    return clean


def clean_result(result: Payloads | None, kind: str = "") -> tuple[Payloads, str]:
    """What a node's activity result may be to the workflow: exactly one payload, its data and
    ``encoding: json/plain`` and nothing else (other metadata keys, ``external_payloads``, unknown
    fields dropped), its data within its activity type's bound (``RESULT_LIMITS``, by ``kind``);
    or, for any other form, one payload of ``REFUSED_RESULT_ENCODING``. Returns it and why it
    was refused ("" when kept)."""
    payloads = result.payloads if result is not None else ()
    limit = RESULT_LIMITS.get(kind)
    if len(payloads) != 1:
        why = f"{len(payloads)} payloads, not one"
    elif (encoding := payloads[0].metadata.get("encoding", b"")) != RESULT_ENCODING:
        why = f"encoding {echo(encoding.decode(errors='replace'))}, not {RESULT_ENCODING.decode()}"
    elif limit is not None and len(payloads[0].data) > limit:
        why = f"{len(payloads[0].data)} bytes, over the {limit} a {kind} result may take"
    else:
        return Payloads(payloads=[Payload(metadata={"encoding": RESULT_ENCODING}, data=payloads[0].data)]), ""
    refused = Payload(metadata={"encoding": REFUSED_RESULT_ENCODING}, data=f"a result of {why}".encode())
    return Payloads(payloads=[refused]), why


@dataclass
class GatewayStats:
    """The gateway's counters (refusals counted here, the rest by the proxy), read by its metrics."""

    forwarded: int = 0
    refused: int = 0
    refusals: list[str] = field(default_factory=list)
    held_polls: int = 0
    #: Calls over a node's limits (held, then answered; or too big), since start.
    limited: int = 0
    #: Calls refused since start because every node's together reached the upstream budget
    #: (``fleet_budget.FleetBudget``) and their node had its share (counted in ``limited`` too).
    over_budget: int = 0
    #: Calls held now because their node is over its limits.
    held_over_limits: int = 0
    #: Bytes charged for the calls held now, each its request and ``proxy.HELD_CALL_BYTES``
    #: (``proxy.HELD_BYTES`` at most).
    held_bytes: int = 0
    #: node → serial of the certificate it last presented (agents reload rotated keys).
    serials: dict[str, int] = field(default_factory=dict)


@dataclass
class NodeCert:
    """What the gateway keeps of a node's certificate, parsed once."""

    node: str
    key: str  # SHA-256 of its public key (``fleet.cluster.client_key_fingerprint``)
    not_after: float


class NodeAuthorization:
    """The policy for every node calling one gateway: who the caller is (its certificate,
    checked again on every call), whether it may make the call, and the request to forward in
    its place; ``tokens`` seals each task token delivered to a node for that node and opens
    what it sends back (``task_tokens``: nothing kept per token)."""

    def __init__(self, namespace: str, stats: GatewayStats, tokens: TaskTokens,
                 node_log: NodeLog | None = None) -> None:
        self.namespace = namespace
        self.stats = stats
        self.tokens = tokens
        self.node_log = node_log or NodeLog(log)
        self._certs: dict[bytes, NodeCert] = {}  # certificate PEM → what it says
        self._polls: dict[str, tuple[str, bytes]] = {}  # node → (worker instance key, the poll forwarded)

    def refuse(self, node: str, method: str, why: str, *sent: object) -> Refused:
        """The refusal of ``method``: ``why`` is the gateway's own words, each ``%s`` in it filled
        with one of ``sent`` (what the node sent), cut short. Counted every time; logged as the
        first of its (node, call, ``why``) in ``NodeLog``'s window, the rest as one count."""
        self.stats.refused += 1
        node = node or "?"
        name = method.rsplit("/", 1)[-1]
        call = echo(name).strip("'")
        reason = why % tuple(echo(value) for value in sent) if sent else why
        self.stats.refusals = [*self.stats.refusals, f"{node}: {call} refused: {reason}"][-200:]
        self.node_log.warn(node, f"{name if name in NAMED_CALLS else 'other calls'} refused",
                           why % (("…",) * len(sent)) if sent else why,
                           "node %s: %s refused: %s", node, call, reason)
        return Refused(reason)

    def identify(self, context: grpc.aio.ServicerContext) -> NodeCert:
        """The caller's certificate, checked again on every call: an open connection stops
        working when its certificate expires (the TLS handshake checked it only once)."""
        auth = context.auth_context()
        pem = auth.get("x509_pem_cert", [b""])[0]
        known = self._certs.get(pem)
        if known is None:
            known = self._parse(pem, [n.decode(errors="replace") for n in auth.get("x509_common_name", [])])
        if time.time() >= known.not_after:
            raise self.refuse(known.node, "(any)", "certificate expired at "
                               + dt.datetime.fromtimestamp(known.not_after, dt.timezone.utc).isoformat())
        return known

    def _parse(self, pem: bytes, names: list[str]) -> NodeCert:
        node = node_from_subject(names[0]) if names else None
        if node is None or not pem:
            raise self.refuse("", "(any)", "not a node certificate: %s" if names else "not a node certificate: none",
                              *names[:1])
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        from fleet.cluster import client_key_fingerprint

        cert = x509.load_pem_x509_certificate(pem)
        groups = [a.value for a in cert.subject.get_attributes_for_oid(x509.NameOID.ORGANIZATION_NAME)]
        if NODE_GROUP not in groups:
            raise self.refuse(node, "(any)", f"certificate not in group {NODE_GROUP}")
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
            raise self.refuse(node, name, "namespace %s", namespace)

    def authorize(self, node: str, name: str, request: bytes) -> tuple[bytes, bytes | None]:
        """The request to forward, rebuilt from only what the policy allows (identity rewritten,
        unknown fields and deployment options dropped, the task token taken out of its envelope),
        and Temporal's task token it carries; or Refused."""
        identity, queue = f"node:{node}", node_queue(node)
        if name == "PollActivityTaskQueue":
            poll = wsr.PollActivityTaskQueueRequest.FromString(request)
            self._namespace(node, name, poll.namespace)
            if poll.task_queue.name != queue:
                raise self.refuse(node, name, f"task queue %s is not {queue!r}", poll.task_queue.name)
            if poll.worker_control_task_queue:
                raise self.refuse(node, name, "control queue %s", poll.worker_control_task_queue)
            instance = poll.worker_instance_key
            if not _INSTANCE_KEY.fullmatch(instance):
                instance = ""
            kept = self._polls.get(node)
            if kept is not None and kept[0] == instance:
                forward = kept[1]
            else:
                # No deployment or versioning options (they create Worker Deployments in the
                # namespace), no rate-limit metadata, no unknown fields held for a whole long poll.
                message = wsr.PollActivityTaskQueueRequest(namespace=self.namespace, identity=identity,
                                                           task_queue=TaskQueue(name=queue, kind=_NORMAL))
                if instance:
                    message.worker_instance_key = instance
                if len(self._polls) >= MAX_POLLS_KEPT:
                    self._polls.clear()
                forward = message.SerializeToString()
                self._polls[node] = (instance, forward)
            return forward, None
        if name in _RESPONDS:
            message = _RESPONDS[name].FromString(request)
            self._namespace(node, name, message.namespace, empty_ok=True)
            opened = self.tokens.open_task(node, message.task_token)
            if opened is None:  # one reason for every kind of envelope refused: none tells a forger more
                raise self.refuse(node, name, "a task token this gateway did not deliver to this node")
            token, kind = opened
            message.task_token = token
            _only(message, _CLEARED[name])
            if name == "RespondActivityTaskFailed" and message.HasField("failure"):
                message.failure.CopyFrom(clean_failure(message.failure))
            if name == "RespondActivityTaskCompleted":
                result, why = clean_result(message.result if message.HasField("result") else None, kind)
                message.result.CopyFrom(result)
                if why:
                    self.node_log.warn(node, "results replaced", "over its bound" if "bytes, over" in why
                                       else "not one json/plain payload",
                                       "node %s: its result replaced: a result of %s", node, why)
            message.identity = identity
            return message.SerializeToString(), token
        if name == "GetSystemInfo":
            return wsr.GetSystemInfoRequest().SerializeToString(), None
        if name == "DescribeNamespace":
            described = wsr.DescribeNamespaceRequest.FromString(request)
            if described.namespace != self.namespace or described.id:
                raise self.refuse(node, name, "namespace %s", described.namespace or described.id)
            return wsr.DescribeNamespaceRequest(namespace=self.namespace).SerializeToString(), None
        if name == "ShutdownWorker":
            bye = wsr.ShutdownWorkerRequest.FromString(request)
            self._namespace(node, name, bye.namespace)
            if bye.sticky_task_queue or bye.task_queue not in ("", queue):
                raise self.refuse(node, name, "queue %s", bye.task_queue or bye.sticky_task_queue)
            # Its own queue only, and no embedded worker heartbeat: that would describe a worker
            # (on any queue it names) to the server's worker list.
            forward = wsr.ShutdownWorkerRequest(namespace=self.namespace, identity=identity, task_queue=queue,
                                                reason=bye.reason[:ECHO_CHARS],
                                                task_queue_types=bye.task_queue_types)
            if _INSTANCE_KEY.fullmatch(bye.worker_instance_key):
                forward.worker_instance_key = bye.worker_instance_key
            return forward.SerializeToString(), None
        if name == "RecordWorkerHeartbeat":
            raise self.refuse(node, name, "worker heartbeats are off for node agents "
                                          "(Runtime(worker_heartbeat_interval=None))")
        raise self.refuse(node, name, "not a node agent's call")
