"""The node agent: a Temporal worker on each GPU node, polling ``node/<name>``.

It dials out to Temporal (no inbound port on the node). On a real node:

    python -m workers.node_agent --node-name "$NODE_NAME"

In sim mode one process hosts the agents of every simulated node and also
plays each simulated machine's boot: after its boot time a machine reads the
join token from its bootstrap channel and registers (what kubelet does), then
its agent starts; a reboot or an unreachable site stops the agent.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker

from activities.node_agent import NodeAgentActivities
from fleet.config import load_config
from fleet.settings import Settings, node_queue
from fleet.temporal import connect, tracing_interceptors
from providers.gpu import GpuBackend
from workers.metrics import agents_running, start_metrics

log = logging.getLogger("gpufleet.node_agent")


def build_agent(client: Client, node_name: str, gpus: GpuBackend, executor: ThreadPoolExecutor) -> Worker:
    return Worker(
        client,
        task_queue=node_queue(node_name),
        activities=NodeAgentActivities(node_name, gpus).all(),
        activity_executor=executor,
        max_concurrent_activities=4,
        # One poller per node keeps a host of hundreds of simulated agents light.
        activity_task_poller_behavior=PollerBehaviorSimpleMaximum(1),
        interceptors=tracing_interceptors(),
    )


class SimNodeHost:
    """Every simulated machine's boot, kubelet registration and node agent."""

    def __init__(self, client: Client, settings: Settings, poll_seconds: float = 0.2) -> None:
        from providers.cluster.sim import SimCluster
        from providers.sim import SimWorld

        self.client = client
        self.settings = settings
        self.world = SimWorld(settings.sim_db)
        self.config = load_config(settings.config)
        self.world.seed(self.config)
        self._placement: dict[str, tuple[str, str]] = {}
        self.cluster = SimCluster(self.world)
        self.poll_seconds = poll_seconds
        self.executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="agent")
        self.agents: dict[str, tuple[str, Worker, asyncio.Task]] = {}  # machine id → (boot id, worker, task)
        #: GPU health probe interval for every agent (None: ``GPUFLEET_HEALTH_SECONDS``, default 5;
        #: 0 turns health reports off).
        self.health_seconds: float | None = None
        self._next_boot = float("inf")  # when the next booting machine comes up
        self._next_health = 0.0

    def _health_interval(self) -> float:
        from workers.health_report import DEFAULT_HEALTH_SECONDS

        return self.health_seconds or DEFAULT_HEALTH_SECONDS

    async def run(self, stop: asyncio.Event) -> None:
        seen = None
        try:
            while not stop.is_set():
                # A full pass only when the world changed or a machine finished booting:
                # polling fast must stay cheap, it shares two cores with the server.
                stamp = (self.world.data_version(), time.time() >= self._next_boot)
                if stamp != seen:
                    if seen is not None and stamp[0] != seen[0] and hasattr(self, "health"):
                        # The world changed (e.g. `gpufleet sim fault`): probe now, as a real
                        # node's XID waiter wakes its report loop.
                        self.health.wake()
                        self._next_health = 0.0
                    seen = (stamp[0], False)
                    up, registered = await asyncio.to_thread(self._sync_kubelets)
                    await self._sync_agents(up, registered)
                    await self._watch_reclaims()
                if self.agents and self._health_interval() > 0 and time.monotonic() >= self._next_health:
                    self._next_health = time.monotonic() + min(1.0, self._health_interval())
                    await self._report_health()
                try:
                    await asyncio.wait_for(stop.wait(), self.poll_seconds)
                except asyncio.TimeoutError:
                    pass
        finally:
            await asyncio.gather(*(self._stop_agent(m) for m in list(self.agents)))
            self.executor.shutdown(wait=False, cancel_futures=True)

    def _up_machines(self) -> dict[str, tuple[str, str]]:
        """machine id → (node name, boot id) for machines booted at reachable sites."""
        now = time.time()
        unreachable = {row["name"] for row in self.world.sites() if row["unreachable"]}
        machines = self.world.machines()
        self._next_boot = min((row["boot_at"] for row in machines if row["boot_at"] > now), default=float("inf"))
        return {
            row["id"]: (row["name"], row["boot_id"])
            for row in machines
            if row["boot_at"] <= now and row["site"] not in unreachable
        }

    def _sync_kubelets(self) -> tuple[dict[str, tuple[str, str]], set[str]]:
        """Each booted machine's kubelet: register with its join token, report Ready.
        Returns the machines that are up and the ids of those registered."""
        from providers.cluster.sim import JoinRejected

        up = self._up_machines()
        nodes = self.cluster.kubelet_view()
        registered = set(nodes)
        waiting = self.world.bootstrap_waiting()
        for machine_id, (name, boot_id) in up.items():
            node = nodes.get(machine_id)
            if node is None:
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
        return up, registered

    async def _sync_agents(self, up: dict[str, tuple[str, str]], registered: set[str]) -> None:
        """An agent for each registered machine that is up; a rebooted machine's agent restarts."""
        from providers.sim import SimGpuBackend

        for machine_id in list(self.agents):
            boot_id = self.agents[machine_id][0]
            if machine_id not in up or up[machine_id][1] != boot_id:
                await self._stop_agent(machine_id)
        for machine_id, (name, boot_id) in up.items():
            if machine_id in registered and machine_id not in self.agents:
                worker = build_agent(self.client, name, SimGpuBackend(self.world, machine_id), self.executor)
                self.agents[machine_id] = (boot_id, worker, asyncio.create_task(worker.run()))
                log.info("agent for %s up (boot %s)", name, boot_id[:8])

    async def _watch_reclaims(self) -> None:
        """Each running agent's spot watcher, against the simulated provider's notices."""
        from workers.reclaim_watch import ReclaimWatcher

        if not hasattr(self, "reclaims"):
            self.reclaims = ReclaimWatcher(self.client, self.settings.task_queue)
        def notices() -> list[tuple]:
            posted = self.world.reclaim_notices()
            rows = [self.world.machine(m) for m in posted if m in self.agents]
            return [(r["name"], r["site"], r["id"], posted[r["id"]]) for r in rows if r is not None]

        for name, site, machine_id, terminate_at in await asyncio.to_thread(notices):
            await self.reclaims.check(name, site, machine_id, lambda t=terminate_at: t)

    async def _report_health(self) -> None:
        """Each running agent's GPU health probe; a changed report goes to its Node entity."""
        from providers.sim import SimGpuBackend
        from workers.health_report import DEFAULT_HEALTH_SECONDS, HealthReporter

        if not hasattr(self, "health"):
            self.health = HealthReporter(self.client, self.settings.task_queue,
                                         self.health_seconds or DEFAULT_HEALTH_SECONDS,
                                         placement=lambda name: self._placement.get(name))
        if not self.agents:
            return
        rows = await asyncio.to_thread(self.world.machines)
        names = {row["id"]: row["name"] for row in rows}
        providers = {site.name: site.provider for site in self.config.sites}
        self._placement = {row["name"]: (row["site"], providers.get(row["site"], "")) for row in rows}
        probes = {}
        for machine_id in self.agents:
            if machine_id in names:
                backend = SimGpuBackend(self.world, machine_id)
                probes[names[machine_id]] = lambda b=backend: (b.boot_id(), b.probe())
        await self.health.check(probes)

    async def _stop_agent(self, machine_id: str) -> None:
        _boot, worker, task = self.agents.pop(machine_id)
        await worker.shutdown()
        await asyncio.gather(task, return_exceptions=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node-name", help="this node's Kubernetes name (real mode)")
    parser.add_argument("--sim", action="store_true", help="host every simulated node's agent")
    parser.add_argument("--poll-seconds", type=float, default=0.2, help="sim: how often machines are checked")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port "
                        "(default: $GPUFLEET_METRICS_PORT; unset: no metrics endpoint)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node-agent %(levelname)s %(message)s")
    settings = Settings.from_env()
    metrics = start_metrics(args.metrics_port, "node-agent")
    client = await connect(settings, runtime=metrics.runtime if metrics else None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.sim:
        host = SimNodeHost(client, settings, poll_seconds=args.poll_seconds)
        if metrics:
            agents_running(lambda: len(host.agents))
        await host.run(stop)
        return
    if not args.node_name:
        parser.error("--node-name is required outside --sim")
    from providers.gpu import NvmlBackend

    gpus = NvmlBackend()
    gpus.watch_xids()
    worker = build_agent(client, args.node_name, gpus, ThreadPoolExecutor(max_workers=4))
    if metrics:
        agents_running(lambda: 1)
    log.info("agent for %s polling %s", args.node_name, node_queue(args.node_name))
    async with worker:
        if spot := os.environ.get("GPUFLEET_SPOT_NOTICE"):  # aws | gcp: watch for reclaim notices
            from workers.reclaim_watch import watch_real_node

            asyncio.create_task(watch_real_node(client, settings.task_queue, args.node_name, spot, stop))
        from workers.health_report import watch_real_node as watch_health

        asyncio.create_task(watch_health(client, settings.task_queue, args.node_name, gpus, stop))
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())
