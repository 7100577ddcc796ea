"""The gateway's replicas tell each other what they forwarded for each node, so that a node gets
one fair share of the whole gateway's budget however many replicas it reaches
(``fleet_budget``'s docstring says why this and not a design without it).

No shared store: each replica serves its ``FleetBudget.report()`` on its peer port
(``GPUFLEET_GATEWAY_PEERS``' port), and every ``PEER_SECONDS`` reads every other replica's, found
by the name the headless Service ``gpufleet-node-gateway-peers`` resolves to (the ready
replicas' addresses). A report is sealed with AES-GCM under a key derived from the task-token key
every replica holds: only a replica can read one (which nodes call and how often is the fleet's
operational data, not a GPU node's to read) or make one a replica takes, so no one else can make an
honest node look heavy nor a node look light. Who may reach the port at all is the gateway's
NetworkPolicy's (deploy/kubernetes/node-gateway.yaml: the gateway's own pods only), and no node may
create a pod in ``gpufleet`` (the mirror-pod admission policy), so an endpoint of that Service
that is no replica is not expected; the seal and the random order below are defence in depth,
for a cluster whose CNI enforces no policy. A report is taken only while fresh
(``STALE_SECONDS``): one replaying an old one, or a replica gone, counts for nothing within
seconds, and the nodes it served are judged by what they send the others from then on.

What any one who connects can make a replica spend is bounded: the report is sealed at most once
a ``PEER_SECONDS`` and those bytes are served to every caller, each for at most ``WRITE_SECONDS``,
and at most ``MAX_CONNECTIONS`` at a time from the addresses the peer Service resolved to and as
many from all others, at most ``PER_ADDRESS`` from any one of them (more are closed at once,
unanswered): whoever else connects, however many and from however many addresses, cannot take the
replicas' own connections.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import random
import secrets
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from workers.gateway.fleet_budget import FleetBudget
from workers.gateway.task_tokens import TokenKeys

log = logging.getLogger("gpufleet.node_gateway")

#: How often a replica reads the others' reports (and how old what it knows of them gets).
PEER_SECONDS = 1.0
#: A report sent longer ago than this (by its own clock, or received by ours) is not taken.
STALE_SECONDS = 3.0 * PEER_SECONDS
#: How long a replica waits for another's report.
READ_SECONDS = 0.5
#: A report is at most ``fleet_budget.REPORTED_NODES`` nodes; anything longer is not one.
REPORT_BYTES = 1024 * 1024
#: Addresses read a round at most (a name resolving to more is not the gateway's few). Those whose
#: last report opened are read first and the rest in a random order, in depth: were pods that are no
#: replica endpoints of the peer Service (the admission policy that keeps a node's mirror pods out of
#: ``gpufleet`` missing), many of them, at addresses sorted first, would otherwise keep the real
#: replicas from being read (each node judged per replica again).
MAX_PEERS = 16
#: Peer connections served at once from the addresses the peer Service resolved to last round (the
#: replicas): every replica reading this one, twice over (a replica reads at most ``MAX_PEERS``
#: addresses a round); and as many again from all other addresses (a replica started since, or
#: whoever the CNI lets through). Any more are closed at once, unanswered. One pool for everyone
#: once let a caller that opened this many, reading nothing, keep the replicas' reads out.
MAX_CONNECTIONS = 2 * MAX_PEERS
#: Connections served at once from any one address the peer Service did not resolve to: a replica
#: reads an address once a round, so two are one read still closing as the next begins. (Those it
#: resolved to are at most ``MAX_PEERS``, bounded together by ``MAX_CONNECTIONS``.)
PER_ADDRESS = 2
#: How long a reader has to take the report (a replica reads it in ``READ_SECONDS``).
WRITE_SECONDS = 2 * READ_SECONDS
#: What the report key is derived for: no other use of the task-token key makes the same key.
_PURPOSE = b"gpufleet node gateway peer usage\x00"
_NONCE_BYTES = 12

#: The other replicas' peer addresses (host, port), asked again every round.
Peers = Callable[[], Awaitable[list[tuple[str, int]]]]


def dns_peers(address: str) -> Peers:
    """``host:port``: every address ``host`` resolves to (the headless Service's ready replicas,
    this one included: its own report is known by its id and skipped), each at ``port``."""
    host, _, port = address.rpartition(":")

    async def resolve() -> list[tuple[str, int]]:
        found = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        return sorted({(info[4][0], int(port)) for info in found})

    return resolve


class PeerUsage:
    """Serves this replica's report and reads the others', for ``budget.heard``."""

    def __init__(self, budget: FleetBudget, keys: TokenKeys, peers: Peers, clock=time.time) -> None:
        self.budget, self.peers, self.clock = budget, peers, clock
        # AES-256-GCM keys, derived from the current task-token key (sealing, and opening) and the
        # previous one (opening, while the keys rotate).
        self._keys = tuple(AESGCM(hmac.new(k, _PURPOSE, hashlib.sha256).digest())
                           for k in (keys.current, keys.previous) if k)
        self.replica = secrets.token_hex(8)
        self._heard: dict[str, tuple[float, dict[str, float]]] = {}  # replica → (when read, its report)
        self._answered: set[tuple[str, int]] = set()  # addresses whose last report opened
        self._sealed: tuple[float, bytes] | None = None  # (when sealed, the report served)
        self._replicas: frozenset[str] = frozenset()  # hosts the peer Service resolved to last round
        self._serving = {True: 0, False: 0}  # peer connections open now: from those hosts, from others
        self._open_from: Counter[str] = Counter()  # peer connections open now from each address
        self._server: asyncio.base_events.Server | None = None
        self._task: asyncio.Task | None = None

    def _seal(self, payload: bytes) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        return nonce + self._keys[0].encrypt(nonce, payload, _PURPOSE)

    def sealed_report(self) -> bytes:
        """This replica's report, sealed: the one sealed less than ``PEER_SECONDS`` ago, else a new
        one (sorting the usage table and sealing ~60 KB is the work, done once for every caller)."""
        now = self.clock()
        if self._sealed is None or not 0 <= now - self._sealed[0] < PEER_SECONDS:
            self._sealed = now, self._seal(json.dumps({"replica": self.replica, "sent": now,
                                                       "usage": self.budget.report()}).encode())
        return self._sealed[1]

    def open(self, sealed: bytes) -> tuple[str, dict[str, float]] | None:
        """(the replica, its report) when ``sealed`` is a fresh report under a key this replica
        holds; None for anything else."""
        nonce, ciphertext = sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:]
        for key in self._keys:
            try:
                payload = key.decrypt(nonce, ciphertext, _PURPOSE)
                break
            except (InvalidTag, ValueError):
                continue
        else:
            return None
        try:
            report = json.loads(payload)
            replica, sent = str(report["replica"]), float(report["sent"])
            usage = {str(node): max(0.0, float(rate)) for node, rate in report["usage"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        if abs(self.clock() - sent) > STALE_SECONDS:
            return None
        return replica, usage

    def replicas_heard(self) -> int:
        """How many other replicas this one holds a fresh report of now: the replicas less one
        while every replica reaches every other's peer port; below that, a node calling a replica
        not heard is judged by what it sends here alone (more than one share across them)."""
        now = self.clock()
        return sum(1 for when, _usage in self._heard.values() if 0 <= now - when <= STALE_SECONDS)

    async def start(self, host: str, port: int) -> int:
        """Serve this replica's report on ``host:port`` and read the others' every ``PEER_SECONDS``;
        the port served on."""
        self._server = await asyncio.start_server(self._serve, host, port)
        self._task = asyncio.create_task(self._run())
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address = (writer.get_extra_info("peername") or ("",))[0]
        replica = address in self._replicas
        if self._serving[replica] >= MAX_CONNECTIONS or (not replica and self._open_from[address] >= PER_ADDRESS):
            writer.transport.abort()  # more than the replicas make: nothing sealed or sent for it
            return
        self._serving[replica] += 1
        self._open_from[address] += 1
        try:
            async with asyncio.timeout(WRITE_SECONDS):
                writer.write(self.sealed_report())
                await writer.drain()
                writer.close()
                await writer.wait_closed()  # counted until the reader has it all
        except (OSError, TimeoutError):
            writer.transport.abort()
        finally:
            self._serving[replica] -= 1
            self._open_from[address] -= 1
            if not self._open_from[address]:
                del self._open_from[address]

    async def _run(self) -> None:
        while True:
            try:
                await self.read_peers()
            except Exception as error:  # noqa: BLE001 - the next round tries again; the budget keeps what it knew
                log.warning("reading the other replicas' usage failed: %s", error)
            await asyncio.sleep(PEER_SECONDS)

    async def read_peers(self) -> None:
        """One round: every other replica's report read, the stale ones dropped, the sum heard."""
        found = await self.peers()
        known = [address for address in found if address in self._answered]
        others = [address for address in found if address not in self._answered]
        random.shuffle(others)
        addresses = (known + others)[:MAX_PEERS]
        self._replicas = frozenset(host for host, _port in addresses)
        answers = await asyncio.gather(*(self._read(host, port) for host, port in addresses))
        self._answered = {address for address, opened in zip(addresses, answers) if opened is not None}
        for opened in answers:
            if opened is not None and opened[0] != self.replica:
                self._heard[opened[0]] = (self.clock(), opened[1])
        now = self.clock()
        self._heard = {r: heard for r, heard in self._heard.items() if now - heard[0] <= STALE_SECONDS}
        elsewhere: dict[str, float] = {}
        for _when, usage in self._heard.values():
            for node, rate in usage.items():
                elsewhere[node] = elsewhere.get(node, 0.0) + rate
        self.budget.heard(elsewhere)

    async def _read(self, host: str, port: int) -> tuple[str, dict[str, float]] | None:
        try:
            async with asyncio.timeout(READ_SECONDS):
                reader, writer = await asyncio.open_connection(host, port)
                try:
                    sealed = await reader.read(REPORT_BYTES + 1)
                    while len(sealed) <= REPORT_BYTES and (more := await reader.read(REPORT_BYTES + 1 - len(sealed))):
                        sealed += more
                finally:
                    writer.close()
        except (OSError, TimeoutError):
            return None  # a replica starting or gone: what it said before goes stale
        return self.open(sealed) if len(sealed) <= REPORT_BYTES else None
