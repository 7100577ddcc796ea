"""A node fills the Temporal server's memory with ``RecordWorkerHeartbeat``.

The SDK's worker heartbeat describes a worker (its instance key, host, SDK version...) to the
server's worker list, which the server keeps in memory. Before the fix the gateway forwarded a
node's, bounded per call (4 heartbeats about its own queue) but not across calls: each call
could name new worker instance keys with ~15 kB of text each, so one node planted as many
"workers" as it liked (1,200 in 300 calls, about 18 MB of its text held by the server).

gpufleet's own agents send none (``workers/node_agent.py`` turns them off) and nothing reads a
node's, so the gateway now refuses the call (PERMISSION_DENIED, as every call a node agent does
not need); an agent on the SDK's defaults, which sends them, still runs its activities.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import grpc
from temporalio import activity, workflow
from temporalio.api.worker.v1 import WorkerHeartbeat, WorkerHostInfo
from temporalio.api.workflowservice.v1 import ListWorkersRequest, RecordWorkerHeartbeatRequest
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from fleet.naming import node_queue
from tests.security.gateway_helpers import call, code_of, credentials, end_entity, live_entity, unique
from tests.security.test_gateway_limits import attacker, gateway  # noqa: F401 - fixtures
from workers.node_agent import connect_via_gateway

CALLS = 50


async def _listed(client, prefix: str) -> int:
    listed, token = 0, b""
    while True:
        page = await client.workflow_service.list_workers(
            ListWorkersRequest(namespace="default", page_size=1000, next_page_token=token))
        listed += sum(w.worker_heartbeat.worker_instance_key.startswith(prefix) for w in page.workers_info)
        token = page.next_page_token
        if not token:
            return listed


async def test_one_node_plants_no_worker_with_worker_heartbeats(temporal_env, gateway, attacker) -> None:  # noqa: F811
    """50 calls, each with 4 heartbeats about the node's own queue under new instance keys and
    15 kB of SDK version: every one refused, no worker listed (before: 200 listed)."""
    node, channel = attacker
    beat = call(channel, "RecordWorkerHeartbeat")
    prefix = f"planted-{node.name}"
    pad = "p" * 15_000
    codes = []
    for i in range(CALLS):
        hearts = [WorkerHeartbeat(worker_instance_key=f"{prefix}-{i}-{j}", task_queue=f"node/{node.name}",
                                  sdk_name="temporal-python", sdk_version=pad,
                                  host_info=WorkerHostInfo(host_name=f"h{i}-{j}"))
                  for j in range(4)]
        request = RecordWorkerHeartbeatRequest(namespace="default", worker_heartbeat=hearts).SerializeToString()
        codes.append(await code_of(beat(request, timeout=5)))
    await asyncio.sleep(0.5)
    listed = await _listed(temporal_env.client, prefix)
    assert listed == 0, f"one node planted {listed} workers in the server's worker list"
    assert set(codes) == {grpc.StatusCode.PERMISSION_DENIED}, set(codes)


@activity.defn(name="ping")
async def ping(text: str) -> str:
    return f"pong {text}"


@workflow.defn(name="SecurityPingNode", sandboxed=False)
class PingNode:
    @workflow.run
    async def run(self, queue: str) -> str:
        return await workflow.execute_activity("ping", "a", task_queue=queue,
                                               start_to_close_timeout=timedelta(seconds=20))


async def test_an_agent_on_the_sdks_default_worker_heartbeats_still_runs_its_activities(
        temporal_env, gateway) -> None:  # noqa: F811
    """An agent whose runtime sends worker heartbeats (the SDK's default; here every second)
    has them refused and still polls, runs and completes its activities."""
    control, name = temporal_env.client, unique("beats")
    await live_entity(control, name)
    node = credentials(gateway.pki, name)
    stats = gateway.running.gateway.stats
    runtime = Runtime(telemetry=TelemetryConfig(), worker_heartbeat_interval=timedelta(seconds=1))
    try:
        node_client = await connect_via_gateway(gateway.access, "default", node.cert, node.key, runtime=runtime)
        queue = unique("security-ping")
        async with Worker(control, task_queue=queue, workflows=[PingNode], workflow_runner=UnsandboxedWorkflowRunner()), \
                Worker(node_client, task_queue=node_queue(name), activities=[ping]):
            for _ in range(50):  # the SDK's heartbeats reach the gateway and are refused
                if any(name in line and "RecordWorkerHeartbeat" in line for line in stats.refusals):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the agent sent no worker heartbeat: the test proves nothing")
            await asyncio.sleep(2.5)  # a few more, refused
            result = await control.execute_workflow("SecurityPingNode", node_queue(name),
                                                    id=f"security-ping-{uuid.uuid4().hex[:6]}", task_queue=queue,
                                                    execution_timeout=timedelta(seconds=30))
            assert result == "pong a"
    finally:
        await end_entity(control, name)
