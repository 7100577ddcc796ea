"""The dev stack's front door: HAProxy in front of simulated streaming model servers.

``gpufleet dev`` runs this as a child (``python -m cli.front_door``) when HAProxy is
installed, and says how to get it when not. It keeps one simulated OpenAI-compatible
server (``sim/model_server.py``) per Ready replica of each model at each site
of the simulated cluster, and HAProxy in front of them, then follows the routing
tables that the ``Routing`` entities write: a new table version is applied through
HAProxy's runtime API at once; a new set of replicas rewrites the configuration and
reloads. When a model's Ready replicas change it tells the model's ``Routing`` entity
(a ``scale`` site event, started if needed), so a rollout's new site gets a route.

    curl -N localhost:8080/<model>/v1/completions -H 'x-session-id: s1' \\
         -d '{"prompt": "hi", "stream": true}'
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Annotated, Any, Callable

import typer

from fleet.cluster import RoutingTable
from fleet.routing import ENDPOINTS_KIND, TOTAL, RoutingDocument, SiteRouteState, endpoints_key
from providers.haproxy import INSTALL_HINT, HAProxy, Replica, haproxy_binary
from sim.model_server import SimModelServer
from fleet.contracts import workflows as flows

DEFAULT_PORT = 8080
log = logging.getLogger("gpufleet.front_door")


def document_from_table(table: RoutingTable | None, model: str, sites: list[str]) -> RoutingDocument:
    """The routing table as a document; before any is written, every site equally."""
    if table is None or not table.sites:
        share = {s: TOTAL // len(sites) if sites else 0 for s in sites}
        return RoutingDocument(model=model, version=0, sites={s: SiteRouteState(weight=w) for s, w in share.items()})
    total = sum(r.weight for r in table.sites.values())
    return RoutingDocument(model=model, version=table.version, sites={
        s: SiteRouteState(weight=round(r.weight * TOTAL / total) if total else 0, draining=r.draining,
                          healthy=r.healthy, incident=r.incident[:500])
        for s, r in table.sites.items()})


class DevFrontDoor:
    """Sim servers per Ready replica, HAProxy in front, routing tables applied as they change."""

    def __init__(self, cluster: Any, workdir: Path, bind: str = f"127.0.0.1:{DEFAULT_PORT}",
                 first_token_ms: float = 50, poll_seconds: float = 0.25,
                 on_replicas: Callable[[str, str], Any] | None = None) -> None:
        self.cluster = cluster
        self.proxy = HAProxy(workdir, bind=bind)
        self.first_token_ms = first_token_ms
        self.poll_seconds = poll_seconds
        #: ``(model, site)`` whose Ready replicas changed: tell its Routing entity.
        self.on_replicas = on_replicas
        self.servers: dict[tuple[str, str], list[SimModelServer]] = {}
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return self.proxy.url

    async def start(self) -> "DevFrontDoor":
        await self._sync_replicas(initial=True)
        await asyncio.to_thread(self.proxy.start)
        await self._sync_routes()
        self._task = asyncio.create_task(self._follow())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await asyncio.to_thread(self.proxy.stop)
        for servers in self.servers.values():
            for s in servers:
                await s.stop()

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                await self._sync_replicas()
                await self._sync_routes()
            except Exception:  # noqa: BLE001 - the front door keeps serving through a bad poll
                log.exception("front door: sync failed; retrying")

    async def _sync_replicas(self, initial: bool = False) -> None:
        serving = await asyncio.to_thread(self.cluster.list_serving)
        wanted = {(s.model, s.site): s.available_replicas for s in serving}
        changed: set[str] = set()
        for key in set(self.servers) | set(wanted):
            have = self.servers.setdefault(key, [])
            want = wanted.get(key, 0)
            if len(have) == want:
                continue
            changed.add(key[0])
            while len(have) < want:
                have.append(await SimModelServer(site=key[1], model=key[0], first_token_ms=self.first_token_ms).start())
            while len(have) > want:
                await have.pop().stop()
            # The Routing entity's load sample reads each server's queue from these.
            urls = {s.name: f"http://{s.address}" for s in have}
            await asyncio.to_thread(self.cluster.update_state, ENDPOINTS_KIND, endpoints_key(*key),
                                    lambda _, urls=urls: urls)
            if self.on_replicas is not None:
                await self.on_replicas(*key)
        for model in changed:
            replicas = {site: [Replica(site, s.address) for s in servers]
                        for (m, site), servers in self.servers.items() if m == model and servers}
            if initial:
                self.proxy.models[model] = replicas
            else:
                await asyncio.to_thread(self.proxy.set_replicas, model, replicas)

    async def _sync_routes(self) -> None:
        for model, sites in list(self.proxy.models.items()):
            table = await asyncio.to_thread(self.cluster.get_routing, model)
            document = document_from_table(table, model, sorted(sites))
            known = self.proxy.documents.get(model)
            if known is None or document.version > known.version or (document.version == 0 and known != document):
                if document.version == 0:  # no table yet: keep re-applying the even split
                    self.proxy.documents.pop(model, None)
                await asyncio.to_thread(self.proxy.apply, document)


def front_door_command(python: str, port: int = DEFAULT_PORT) -> list[str] | None:
    """The child ``gpufleet dev`` starts; None when HAProxy is not installed."""
    if haproxy_binary() is None:
        return None
    return [python, "-m", "cli.front_door", "--port", str(port)]


def missing_hint() -> str:
    return f"front door       off: haproxy not found; {INSTALL_HINT}"


async def _run(port: int, first_token_ms: float) -> None:
    from temporalio.common import WorkflowIDConflictPolicy

    from activities.env import FleetEnv
    from fleet.messages.routing import RoutingInput
    from fleet.naming import routing_workflow_id
    from fleet.settings import Settings
    from fleet.temporal import connect

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # `gpufleet dev` stops us with SIGTERM: take HAProxy along
        loop.add_signal_handler(sig, stop.set)
    settings = Settings.from_env()
    env = FleetEnv.from_settings(settings)
    client = await connect(settings)

    async def tell(model: str, site: str) -> None:
        await client.start_workflow(
            flows.Routing.TYPE, RoutingInput(model=model).model_dump(mode="json", exclude_none=True),
            id=routing_workflow_id(model), task_queue=settings.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING, start_signal=flows.Routing.site_event,
            start_signal_args=[{"kind": "scale", "site": site, "detail": "Ready replicas changed"}],
            static_summary=f"routing of {model}: the one writer of its routes",
        )

    door = DevFrontDoor(env.cluster, settings.state_dir / "front-door", bind=f"127.0.0.1:{port}",
                        first_token_ms=first_token_ms, on_replicas=tell)
    await door.start()
    print(f"front door on {door.url}: /<model>/v1/completions, /<model>/v1/models", flush=True)
    try:
        await stop.wait()
    finally:
        await door.stop()


def cli(
    port: Annotated[int, typer.Option(help="the front door's port")] = DEFAULT_PORT,
    first_token_ms: Annotated[float, typer.Option(help="the simulated model servers' first-token latency")] = 50,
) -> None:
    """The dev stack's front door: HAProxy in front of a simulated model server per site."""
    logging.basicConfig(level=logging.INFO)
    asyncio.run(_run(port, first_token_ms))


if __name__ == "__main__":
    typer.run(cli)
