"""The node agent's spot-reclaim watcher: notice seen → signal-with-start SpotReclaim.

- Sim: ``SimWorld.reclaim_notices()`` (``gpufleet sim reclaim NODE`` posts one).
- AWS: IMDSv2 ``/latest/meta-data/spot/instance-action`` (404 until a notice;
  then ``{"action": "terminate", "time": "2026-...Z"}``).
- GCP: ``computeMetadata/v1/instance/preempted`` answers ``TRUE`` (30 s notice).

Signal-with-start (``reclaim/<node>``, conflict policy USE_EXISTING) is
idempotent: polling the same notice again only re-signals the running workflow.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Callable

import httpx
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy

from fleet.naming import reclaim_workflow_id

log = logging.getLogger("gpufleet.reclaim")

IMDS = "http://169.254.169.254"
GCP_METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"


async def signal_reclaim(
    client: Client, task_queue: str, node_name: str, site: str, machine_id: str, terminate_at: float
) -> None:
    await client.start_workflow(
        "SpotReclaim",
        {"node_name": node_name, "site": site, "machine_id": machine_id, "terminate_at": terminate_at},
        id=reclaim_workflow_id(node_name), task_queue=task_queue,
        start_signal="notice", start_signal_args=[{"terminate_at": terminate_at}],
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary=f"spot reclaim of {node_name}: drain and replace",
    )


def aws_spot_notice(http: httpx.Client | None = None) -> float | None:
    """Termination time (epoch s) from AWS IMDSv2, or None without a notice."""
    http = http or httpx.Client(timeout=2)
    token = http.put(f"{IMDS}/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"}).text
    response = http.get(f"{IMDS}/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token})
    if response.status_code == 404:
        return None
    response.raise_for_status()
    when = response.json().get("time")
    return datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp() if when else time.time() + 120


def gcp_preempted(http: httpx.Client | None = None) -> float | None:
    http = http or httpx.Client(timeout=2)
    response = http.get(GCP_METADATA, headers={"Metadata-Flavor": "Google"})
    return time.time() + 30 if response.status_code == 200 and response.text.strip() == "TRUE" else None


class ReclaimWatcher:
    """Poll a notice source; signal once per new termination time."""

    def __init__(self, client: Client, task_queue: str) -> None:
        self.client = client
        self.task_queue = task_queue
        self.signalled: dict[str, float] = {}

    async def check(self, node_name: str, site: str, machine_id: str, notice: Callable[[], float | None]) -> None:
        try:
            terminate_at = notice()
        except Exception as error:  # noqa: BLE001 - metadata service hiccup: next poll
            log.debug("reclaim notice poll failed for %s: %s", node_name, error)
            return
        if terminate_at is None or self.signalled.get(node_name) == terminate_at:
            return
        await signal_reclaim(self.client, self.task_queue, node_name, site, machine_id, terminate_at)
        self.signalled[node_name] = terminate_at
        log.warning("reclaim notice for %s: terminates at %s", node_name, time.ctime(terminate_at))


async def watch_real_node(client: Client, task_queue: str, node_name: str, source: str, stop, poll_s: float = 5) -> None:
    """A real node's watcher (``GPUFLEET_SPOT_NOTICE=aws|gcp``; site and machine id
    from ``GPUFLEET_SITE`` and ``GPUFLEET_MACHINE_ID``). Runs until ``stop`` is set."""
    import asyncio
    import os

    notice = {"aws": aws_spot_notice, "gcp": gcp_preempted}[source]
    watcher = ReclaimWatcher(client, task_queue)
    site, machine_id = os.environ.get("GPUFLEET_SITE", ""), os.environ.get("GPUFLEET_MACHINE_ID", "")
    while not stop.is_set():
        await watcher.check(node_name, site, machine_id, lambda: notice())
        try:
            await asyncio.wait_for(stop.wait(), poll_s)
        except asyncio.TimeoutError:
            pass
