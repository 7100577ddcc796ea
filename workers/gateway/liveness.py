"""Whether a node is still live, asked on every call (through ``LiveCache``): the
certificate's key is one the cluster's signer bound to the node at its join or a renewal,
and its identity record and Node entity (or its NodeJoin) exist.

Certificates cannot be revoked; every retire path deletes those records, so a retired
node's certificate stops working within the verdict cache's ``--live-ttl`` (1 s), and a
Node object its kubelet re-creates, or a certificate for its name from any other signer,
opens nothing.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import Awaitable, Callable

from fleet.contracts import workflows as flows
from fleet.naming import node_workflow_id
from fleet.settings import Settings
from providers.cluster.base import AccessRule
from workers.gateway.node_log import NodeLog

log = logging.getLogger("gpufleet.node_gateway")

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
    #: Not looked up: the node's lookups are over its rate, or the gateway's upstream budget is
    #: spent (``LiveCache``'s ``admit``): RESOURCE_EXHAUSTED, as a call over either is.
    OVER_BUDGET = "its liveness lookups are over its share of the upstream budget"


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
            described = await client.get_workflow_handle(node_workflow_id(name)).describe()
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
        # ``name`` matched node_identity._NAME (no quotes), so it is safe inside the query.
        query = f'WorkflowType = "{flows.NodeJoin.TYPE}" AND NodeName = "{name}" AND ExecutionStatus = "Running"'
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
    round trip's critical path. A lookup that fails is logged through ``node_log`` (a failure
    is not kept, so each call of the node's can start another).

    What a node decides, it can make lookups of: a certificate with a new key is a new (node, key)
    (a kubelet's renewals may be approved by others than gpufleet, and without a cluster every key
    is looked up in Temporal), a failed lookup is kept by no cache, and every call after the
    verdict went stale starts one. So a lookup of a key not found live before, or after a failed
    one, is admitted by ``admit`` (``NodeGateway.admit_lookup``: one of the node's own calls and a
    token of the gateway's upstream budget): a lookup is up to two Temporal calls and two reads of
    the API server, and a node over its rate, or with the budget spent, is answered
    ``OVER_BUDGET`` rather than looked up. A renewal of a verdict still fresh is not charged, nor a
    lookup of a key last found live: it needs a call on that very key (one bound to the node at
    its join or a renewal) within ``ttl``, and a node holds at most ``proxy.CONNECTIONS_PER_NODE``
    connections (a key each) at once, so it is bounded per node by the cache."""

    def __init__(self, check: Liveness, ttl: float = 1.0, node_log: NodeLog | None = None,
                 admit: Callable[[str], bool] | None = None) -> None:
        self.check, self.ttl = check, ttl
        self.admit = admit or (lambda node: True)
        self.node_log = node_log or NodeLog(log)
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
        inflight = self._inflight.get(which)
        if inflight is None:
            # A key last found live is looked up again free: at most one lookup per ``ttl`` for each
            # key bound to the node, few. Charged, those lookups refused an honest node coming back
            # from a long poll while others spent the budget (its verdict had gone stale meanwhile).
            renewal = hit is not None and (hit[1] is True or hit[1] is Verdict.LIVE)
            if not renewal and not self.admit(name):
                return Verdict.OVER_BUDGET
            inflight = self._start(which)
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
            self.node_log.warn(which[0], "liveness checks failed", "", "liveness of %s unknown: %s", which[0], error)
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

