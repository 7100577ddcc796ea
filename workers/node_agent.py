"""The node agent: a Temporal worker on each GPU node, polling ``node/<name>``.

It dials out (no inbound port on the node) to the node gateway, never to Temporal
itself: mutual TLS with the node's own client certificate (``CN=system:node:<name>``,
the kubelet's), so it can poll only its own queue and answer only its own tasks. It
starts and signals no workflow: its Node entity pulls health and spot notices with
``watch_node`` (activities/node_agent.py). On a real node:

    GPUFLEET_GATEWAY=gw.example:7300 GPUFLEET_GATEWAY_CA=/etc/gpufleet/gateway-ca.pem \
    python -m workers.node_agent --node-name "$NODE_NAME" \
        --cert /var/lib/kubelet/pki/kubelet-client-current.pem

The certificate file is read again when it changes (kubelet rotates it), and the
worker switches to a connection with the new key.

In sim mode one process hosts the agents of every simulated node and also
plays each simulated machine's boot: after its boot time a machine reads the
join token from its bootstrap channel and registers (what kubelet does), makes
its key and a CSR, which the sim's signer (the dev CA, standing in for the
cluster's CSR approver) signs, then its agent starts; a reboot or an unreachable
site stops the agent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from dataclasses import dataclass
from typing import Annotated, Callable, Optional

import typer

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.service import TLSConfig
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker

from activities.node_agent import NodeAgentActivities, NodeWatch
from fleet.config import load_config
from fleet.settings import NodeAgentEnv, Settings, SettingsError
from fleet.naming import node_queue
from fleet.temporal import connect, tracing_interceptors
from providers.gpu import GpuBackend
from workers.gc_tuning import settle_garbage_collection
from workers.metrics import agents_running, start_metrics
from workers.gateway.node_identity import GatewayAccess, node_key_and_csr

log = logging.getLogger("gpufleet.node_agent")

#: A stopping agent cancels its running activities at once; their last reports then take a
#: round trip or two. Far longer means a call that will never return.
AGENT_STOP_SECONDS = 20
#: An agent that could not reach the node gateway (not up yet) tries again this much later.
AGENT_RETRY_SECONDS = 1.0
#: The world's change log is trimmed behind the host this often.
CHANGES_KEPT_SECONDS = 30.0
#: The simulated machines' host yields the CPU to the control plane it shares it with: a real
#: node's agent has a machine of its own, while here a fleet's agents would compete on equal
#: terms with the server and the worker that their reports wait on.
SIM_HOST_NICE = 10


def build_agent(client: Client, node_name: str, gpus: GpuBackend, executor: ThreadPoolExecutor,
                watch: NodeWatch | None = None) -> Worker:
    return Worker(
        client,
        task_queue=node_queue(node_name),
        activities=NodeAgentActivities(node_name, gpus, watch).all(),
        activity_executor=executor,
        # The health watch holds one slot for the agent's life; repairs and smoke tests use the rest.
        max_concurrent_activities=5,
        # One poller per node keeps a host of hundreds of simulated agents light.
        activity_task_poller_behavior=PollerBehaviorSimpleMaximum(1),
        interceptors=tracing_interceptors(),
    )


async def connect_via_gateway(gateway: GatewayAccess, namespace: str, cert: bytes, key: bytes,
                              runtime=None) -> Client:
    """A client that reaches Temporal only through the node gateway, as this node."""
    return await Client.connect(
        gateway.address, namespace=namespace, data_converter=pydantic_data_converter, runtime=runtime,
        tls=TLSConfig(server_root_ca_cert=gateway.ca, client_cert=cert, client_private_key=key,
                      domain=gateway.server_name),
    )


def cert_expiry(cert_pem: bytes) -> float:
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc.timestamp()


def cert_key_fingerprint(cert_pem: bytes) -> str:
    """The node-keys record's name for a certificate's key (``fleet.cluster.client_key_fingerprint``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from fleet.cluster import client_key_fingerprint

    public = x509.load_pem_x509_certificate(cert_pem).public_key()
    return client_key_fingerprint(public.public_bytes(serialization.Encoding.DER,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))


#: Signs a node's CSR for that node name: (CSR PEM, node name, lifetime s) → certificate PEM.
Signer = Callable[[bytes, str, float], bytes]


def pki_signer(pki) -> Signer:
    """The sim's stand-in for the cluster's CSR approver and signer."""
    import datetime as dt

    return lambda csr, name, lifetime: pki.sign_node_csr(csr, name, dt.timedelta(seconds=lifetime))


class SimNodeHost:
    """Every simulated machine's boot, kubelet registration and node agent.

    With ``gateway`` (and the sim's ``signer``) each agent has a key of its own, a
    certificate signed from its CSR, and its own connection through the node gateway;
    certificates are renewed at two thirds of ``cert_lifetime`` and the agent switches
    to the new key. Without, agents share ``client`` (a direct connection: benches only)."""

    def __init__(self, client: Client | None, settings: Settings, poll_seconds: float = 0.2,
                 gateway: GatewayAccess | None = None, signer: Signer | None = None,
                 cert_lifetime: float = 24 * 3600, runtime=None) -> None:
        from sim.cluster import SimCluster
        from sim.world import SimWorld

        self.client = client
        self.settings = settings
        self.world = SimWorld(settings.sim_db)
        self.config = load_config(settings.config)
        self.world.seed(self.config)
        self.cluster = SimCluster(self.world)
        self.poll_seconds = poll_seconds
        self.gateway, self.signer, self.cert_lifetime = gateway, signer, cert_lifetime
        if gateway is not None and signer is None:
            raise ValueError("gateway: a signer is needed to give each simulated node its certificate")
        if gateway is None and client is None:
            raise ValueError("client: needed without a gateway")
        self.runtime = runtime or (client.service_client.config.runtime if client is not None else None)
        self.executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="agent")
        self.agents: dict[str, tuple[str, Worker, asyncio.Task]] = {}  # machine id → (boot id, worker, task)
        self.watches: dict[str, NodeWatch] = {}  # machine id → its agent's health watch
        #: machine id → (renew at, the agent's own client): gateway mode only.
        self.identities: dict[str, tuple[float, Client]] = {}
        #: GPU health probe interval of every agent's watch (None: ``GPUFLEET_HEALTH_SECONDS``,
        #: default 5; 0: probe only when the world changes).
        self.health_seconds: float | None = None
        #: When the kubelets must look again though nothing changed: a machine finishes booting,
        #: a kubelet silence ends, an agent that could not reach the gateway tries again.
        self._next_kubelet_pass = float("inf")
        self._next_renewal = float("inf")  # the soonest certificate renewal
        self._change_seq = 0  # the last world change looked at (``SimWorld.changes_since``)
        self._forgotten_at = time.monotonic()
        #: Machines whose install ran user data that could not join: their kubelet has no credentials.
        self._unjoined: set[str] = set()

    async def _look_at_changes(self) -> bool:
        """Wake the watch of each machine the world's changes touched; whether a kubelet has
        something to act on."""
        changes = await asyncio.to_thread(self.world.changes_since, self._change_seq)
        self._change_seq = changes.seq
        for machine_id, watch in self.watches.items():
            if changes.everything or machine_id in changes.machines:
                watch.wake()
        if time.monotonic() - self._forgotten_at > CHANGES_KEPT_SECONDS:
            self._forgotten_at = time.monotonic()
            await asyncio.to_thread(self.world.forget_changes, self._change_seq)
        return changes.kubelet or changes.everything

    def _health_interval(self) -> float:
        from workers.health_report import DEFAULT_HEALTH_SECONDS

        return DEFAULT_HEALTH_SECONDS if self.health_seconds is None else self.health_seconds

    async def run(self, stop: asyncio.Event) -> None:
        seen = None
        try:
            while not stop.is_set():
                # Work only when the world changed, and then only on what changed: polling fast
                # must stay cheap at a thousand machines, it shares two cores with the server.
                version = self.world.data_version()
                changed, due = version != seen, time.time() >= self._next_kubelet_pass
                if changed or due:
                    # A change (a fault, a spot notice, a reboot) wakes the watch of each machine it
                    # touched, as a real node's XID waiter wakes its own: waking all of them would
                    # cost a probe per node for every change anywhere in the fleet.
                    kubelets = await self._look_at_changes() if changed else False
                    if seen is None or kubelets or due:
                        # A machine that went down or rebooted loses its agent before its kubelet
                        # says so (as a real reboot kills it first): the old boot's agent must not
                        # take a watch the control plane schedules once it sees the new boot.
                        up = await asyncio.to_thread(self._up_machines)
                        await self._stop_stale_agents(up)
                        registered = await asyncio.to_thread(self._sync_kubelets, up)
                        await self._sync_agents(up, registered)
                    seen = version
                if time.time() >= self._next_renewal:
                    await self._renew_certificates()
                try:
                    async with asyncio.timeout(self.poll_seconds):
                        await stop.wait()
                except TimeoutError:
                    pass
        finally:
            await asyncio.gather(*(self._stop_agent(m) for m in list(self.agents)))
            self.executor.shutdown(wait=False, cancel_futures=True)

    async def _identity(self, machine_id: str, name: str) -> tuple[float, Client]:
        """The node's half (a key made here, a CSR) and the signer's, which also binds the key
        to the node as the cluster's CSR approver does (only while this machine holds the node:
        the node gateway lets no other key through); then a connection as the node."""
        def issue() -> tuple[bytes, bytes]:
            key, csr = node_key_and_csr(name)
            cert = self.signer(csr, name, self.cert_lifetime)
            if not self.cluster.bind_client_key(name, machine_id, cert_key_fingerprint(cert)):
                raise RuntimeError(f"machine {machine_id} no longer holds node {name}")
            return cert, key

        cert, key = await asyncio.to_thread(issue)
        client = await connect_via_gateway(self.gateway, self.settings.namespace, cert, key, runtime=self.runtime)
        now = time.time()
        return now + (cert_expiry(cert) - now) * 2 / 3, client

    async def _renew_certificates(self) -> None:
        now = time.time()
        for machine_id, (renew_at, _client) in list(self.identities.items()):
            if now < renew_at or machine_id not in self.agents:
                continue
            name = self.agents[machine_id][1].task_queue.removeprefix("node/")
            try:
                self.identities[machine_id] = renewed = await self._identity(machine_id, name)
            except Exception as error:  # noqa: BLE001 - gateway or signer away: try again next pass
                log.warning("certificate of %s not renewed: %s", name, error)
                continue
            self.agents[machine_id][1].client = renewed[1]
            log.info("node %s: new key and certificate in use", name)
        self._next_renewal = min((at for at, _client in self.identities.values()), default=float("inf"))

    def _up_machines(self) -> dict[str, tuple[str, str]]:
        """machine id → (node name, boot id) for machines booted, not stopped, at reachable sites."""
        now = time.time()
        unreachable = {row["name"] for row in self.world.sites() if row["unreachable"]}
        machines = self.world.machines()
        next_boot = min((row["boot_at"] for row in machines if row["boot_at"] > now), default=float("inf"))
        self._next_kubelet_pass = min(next_boot, self.world.next_silence_end())
        return {
            row["id"]: (row["name"], row["boot_id"])
            for row in machines
            if row["boot_at"] <= now and row["site"] not in unreachable and row["stopped_at"] is None
        }

    def _sync_kubelets(self, up: dict[str, tuple[str, str]]) -> set[str]:
        """Each booted machine's kubelet (``up``: ``_up_machines``): register with its join token,
        report Ready. Returns the ids of the machines registered."""
        from sim.cluster import JoinRejected

        nodes = self.cluster.kubelet_view()
        registered = set(nodes)
        waiting = self.world.bootstrap_waiting()
        fresh = self.world.pending_user_data()
        for machine_id, (name, boot_id) in up.items():
            node = nodes.get(machine_id)
            if machine_id in fresh:
                # A new install's first boot: cloud-init runs `kubeadm join` from the user data alone.
                self.world.user_data_ran(machine_id)
                try:
                    gpus = len(self.world.gpu_health(machine_id))
                    self.cluster.register_from_user_data(machine_id, fresh[machine_id], boot_id, gpus)
                    registered.add(machine_id)
                    self._unjoined.discard(machine_id)
                    log.info("node %s registered from its user data", name)
                except (JoinRejected, ValueError) as error:
                    self._unjoined.add(machine_id)
                    log.warning("machine %s: join rejected: %s", machine_id, error)
            elif machine_id in self._unjoined:
                continue
            elif node is None:
                token = self.world.take_bootstrap_token(machine_id) if machine_id in waiting else None
                if token:
                    gpus = len(self.world.gpu_health(machine_id))
                    try:
                        self.cluster.register_with_token(machine_id, token, boot_id, gpus)
                        registered.add(machine_id)
                        log.info("node %s registered", name)
                    except JoinRejected as error:
                        log.warning("machine %s: join rejected: %s", machine_id, error)
            elif not node.ready or node.boot_id != boot_id:
                self.cluster.set_node_status(node.name, ready=True, boot_id=boot_id)
        for machine_id, node in nodes.items():
            if machine_id not in up and node.ready:
                self.cluster.set_node_status(node.name, ready=False)
        return registered

    async def _sync_agents(self, up: dict[str, tuple[str, str]], registered: set[str]) -> None:
        """An agent for each registered machine that is up; a rebooted machine's agent restarts."""
        from sim.gpu import SimGpuBackend

        await self._stop_stale_agents(up)
        for machine_id, (name, boot_id) in up.items():
            if machine_id in registered and machine_id not in self.agents:
                client = self.client
                if self.gateway is not None:
                    try:
                        self.identities[machine_id] = identity = await self._identity(machine_id, name)
                    except Exception as error:  # noqa: BLE001 - gateway not up yet: next pass
                        log.warning("agent for %s: no connection through the gateway: %s", name, error)
                        self._next_kubelet_pass = min(self._next_kubelet_pass, time.time() + AGENT_RETRY_SECONDS)
                        continue
                    self._next_renewal = min(self._next_renewal, identity[0])
                    client = identity[1]
                gpus = SimGpuBackend(self.world, machine_id)
                watch = NodeWatch(gpus, notice=lambda m=machine_id: self.world.reclaim_notices().get(m),
                                  interval_s=self._health_interval())
                worker = build_agent(client, name, gpus, self.executor, watch)
                self.watches[machine_id] = watch
                self.agents[machine_id] = (boot_id, worker, asyncio.create_task(worker.run()))
                log.info("agent for %s up (boot %s)", name, boot_id[:8])

    async def _stop_stale_agents(self, up: dict[str, tuple[str, str]]) -> None:
        """Stop the agent of each machine not up, or up with another boot than its agent's."""
        for machine_id in list(self.agents):
            if machine_id not in up or up[machine_id][1] != self.agents[machine_id][0]:
                await self._stop_agent(machine_id)

    async def _stop_agent(self, machine_id: str) -> None:
        _boot, worker, task = self.agents.pop(machine_id)
        self.watches.pop(machine_id, None)
        self.identities.pop(machine_id, None)
        try:
            async with asyncio.timeout(AGENT_STOP_SECONDS):
                await worker.shutdown()
        except TimeoutError:
            # One agent whose last call never returns (a gateway gone mid-poll) must not
            # hold up the host's stop, or every other machine's agent with it.
            log.warning("agent %s: not stopped after %d s; abandoned", worker.task_queue, AGENT_STOP_SECONDS)
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class CertFile:
    """The node's certificate and key, read again when the file changes (kubelet rotates
    ``kubelet-client-current.pem``, cert and key in one file)."""

    def __init__(self, cert: Path, key: Path | None = None) -> None:
        self.cert, self.key = cert, key or cert
        self.stamp: tuple[float, float] | None = None

    def changed(self) -> bool:
        return self._stamp() != self.stamp

    def _stamp(self) -> tuple[float, float]:
        return (self.cert.stat().st_mtime, self.key.stat().st_mtime)

    def read(self) -> tuple[bytes, bytes]:
        import re

        self.stamp = self._stamp()
        cert_text, key_text = self.cert.read_bytes(), self.key.read_bytes()
        certs = re.findall(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----\n?", cert_text, re.S)
        keys = re.findall(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----.+?-----END [A-Z ]*PRIVATE KEY-----\n?", key_text, re.S)
        if not certs or not keys:
            raise ValueError(f"--cert/--key: no certificate or key in {self.cert} / {self.key}")
        return b"".join(certs), keys[0]


async def follow_rotation(worker: Worker, source: CertFile, gateway: GatewayAccess, namespace: str,
                          stop: asyncio.Event, every_s: float = 30) -> None:
    """When the certificate file changes, connect with the new key and switch the worker to it."""
    while not stop.is_set():
        try:
            async with asyncio.timeout(every_s):
                await stop.wait()
        except TimeoutError:
            pass
        try:
            if stop.is_set() or not source.changed():
                continue
            cert, key = source.read()
            worker.client = await connect_via_gateway(gateway, namespace, cert, key,
                                                      runtime=worker.client.service_client.config.runtime)
            log.info("rotated certificate in use (expires %s)", time.ctime(cert_expiry(cert)))
        except Exception as error:  # noqa: BLE001 - half-written file, gateway away: next look
            log.warning("certificate rotation not picked up yet: %s", error)


@dataclass(frozen=True)
class AgentOptions:
    node_name: str | None = None
    sim: bool = False
    poll_seconds: float = 0.2
    nice: int = SIM_HOST_NICE
    cert: str | None = None
    key: str | None = None
    metrics_port: int | None = None


async def main(args: AgentOptions) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node-agent %(levelname)s %(message)s")
    settings = Settings.from_env()
    try:  # its every variable checked before anything starts (--sim reads the health interval per agent)
        NodeAgentEnv.from_env()
    except SettingsError as error:
        raise SystemExit(str(error)) from None
    # No SDK worker heartbeats: nothing reads a node agent's (its liveness is its health watch's
    # own heartbeat), and a fleet's agents would send the gateway and Temporal one per node a minute.
    metrics = start_metrics(args.metrics_port, "node-agent", worker_heartbeats=False)
    runtime = metrics.runtime if metrics else Runtime(telemetry=TelemetryConfig(), worker_heartbeat_interval=None)
    gateway = GatewayAccess.from_env()
    client = None
    if gateway is None:
        log.warning("GPUFLEET_GATEWAY unset: connecting to Temporal directly (benches only: a node "
                    "must reach Temporal through the node gateway)")
        client = await connect(settings, runtime=runtime)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.sim:
        if args.nice:
            os.nice(args.nice)
        signer = None
        if gateway is not None:
            from workers.gateway.pki import Pki

            signer_dir = NodeAgentEnv.get("sim_signer_dir")
            if signer_dir is None:
                raise SystemExit(f"{NodeAgentEnv.variable('sim_signer_dir')} is required with --sim and "
                                 f"{NodeAgentEnv.variable('gateway')} (the dev CA's directory)")
            signer = pki_signer(Pki.load_or_create(signer_dir))
        host = SimNodeHost(client, settings, poll_seconds=args.poll_seconds, gateway=gateway, signer=signer,
                           runtime=runtime)
        if metrics:
            agents_running(lambda: len(host.agents))
        settle_garbage_collection()
        await host.run(stop)
        return
    if not args.node_name:
        raise SystemExit("--node-name is required outside --sim")
    from providers.gpu import NvmlBackend
    from workers.health_report import DEFAULT_HEALTH_SECONDS, xid_wakes
    from workers.reclaim_watch import spot_notice_source

    source = None
    if gateway is not None:
        if not args.cert:
            raise SystemExit("--cert is required with GPUFLEET_GATEWAY (the node's client certificate)")
        source = CertFile(Path(args.cert), Path(args.key) if args.key else None)
        cert, key = source.read()
        client = await connect_via_gateway(gateway, settings.namespace, cert, key, runtime=runtime)
    gpus = NvmlBackend()
    watch = NodeWatch(gpus, notice=spot_notice_source(NodeAgentEnv.get("spot_notice")),
                      interval_s=DEFAULT_HEALTH_SECONDS)
    xid_wakes(gpus, watch)
    gpus.watch_xids()
    worker = build_agent(client, args.node_name, gpus, ThreadPoolExecutor(max_workers=4), watch)
    if metrics:
        agents_running(lambda: 1)
    log.info("agent for %s polling %s", args.node_name, node_queue(args.node_name))
    async with worker:
        if source is not None:
            asyncio.create_task(follow_rotation(worker, source, gateway, settings.namespace, stop))
        await stop.wait()


def cli(
    node_name: Annotated[Optional[str], typer.Option(help="this node's Kubernetes name (real mode)")] = None,
    sim: Annotated[bool, typer.Option("--sim", help="host every simulated node's agent")] = False,
    poll_seconds: Annotated[float, typer.Option(help="sim: how often machines are checked")] = 0.2,
    nice: Annotated[int, typer.Option(
        help="sim: CPU niceness of the host of every simulated machine (0: as the control plane)")] = SIM_HOST_NICE,
    cert: Annotated[Optional[str], typer.Option(
        help="real mode: the node's client certificate (PEM; may hold the key too, as "
             "kubelet-client-current.pem does); read again when it changes")] = None,
    key: Annotated[Optional[str], typer.Option(help="its private key, when not in --cert")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(min=1, max=65535,
        help="serve Prometheus metrics on this port (default: $GPUFLEET_METRICS_PORT; unset: no metrics endpoint)")] = None,
) -> None:
    """The node agent: a GPU node's health watch and node-side activities on its own queue,
    through the node gateway (GPUFLEET_GATEWAY); with --sim, every simulated machine's."""
    from workers.process_exit import run_then_exit

    options = AgentOptions(node_name, sim, poll_seconds, nice, cert, key, metrics_port)
    if not sim and not node_name:
        raise typer.BadParameter("required outside --sim", param_hint="--node-name")
    if not sim and NodeAgentEnv.get("gateway") and not cert:
        raise typer.BadParameter("required with GPUFLEET_GATEWAY (the node's client certificate)", param_hint="--cert")
    run_then_exit(lambda: main(options))


if __name__ == "__main__":
    typer.run(cli)
