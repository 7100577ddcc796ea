"""The dev server gpufleet starts keeps its metrics small: no series per node queue."""

from __future__ import annotations

import asyncio
import re
import uuid

import httpx
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from cli.dev import dev_server_tuning_flags, temporal_binary
from fleet import search_attributes
from tests.ports import free_port


async def test_a_node_queue_gets_no_metrics_series_of_its_own() -> None:
    """Every node polls a queue of its own: with the queue's name as a tag, a fleet of 1,250 nodes
    made the server's /metrics 115 MB. The queue's work is still counted, under ``__omitted__``."""
    port = free_port()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), data_converter=pydantic_data_converter,
        search_attributes=search_attributes.ALL, dev_server_log_level="error",
        dev_server_extra_args=[*dev_server_tuning_flags(), "--metrics-port", str(port)],
    )
    try:
        queue = f"node/probe-{uuid.uuid4().hex[:6]}"
        await env.client.start_workflow("Anything", id=f"probe-{queue}", task_queue=queue)
        await asyncio.sleep(2)  # the server's metrics are reported once a second
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    finally:
        await env.shutdown()
    assert 'taskqueue="__omitted__"' in text, "the queue's work is counted"
    # Prometheus label values keep [a-zA-Z0-9_]: node/probe-1a2b3c is tagged node_probe_1a2b3c.
    assert re.sub(r"[^a-zA-Z0-9_]", "_", queue) not in text
