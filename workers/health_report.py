"""The node agent's health probe loop: probe every few seconds, tell the Node entity
only when something changed (no signal storms).

A report goes to ``node/<name>`` by signal-with-start (``health_report``), so
the entity exists from a node's first report on. What counts as a change is
``fleet.repair_policy.fingerprint``: counters, states, new XID events, the boot
id, and temperature only as at/below the slowdown threshold.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable

from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy

from activities.models import HealthReport
from fleet import search_attributes as sa
from fleet.models import GpuHealth
from fleet.repair_policy import fingerprint

log = logging.getLogger("gpufleet.health")

#: Probe interval, seconds (``GPUFLEET_HEALTH_SECONDS``).
DEFAULT_HEALTH_SECONDS = float(os.environ.get("GPUFLEET_HEALTH_SECONDS", "5"))

Probe = Callable[[], tuple[str, list[GpuHealth]]]


#: ``node name -> (site, provider)``, or None when not known (yet).
Placement = Callable[[str], "tuple[str, str] | None"]


def node_start_attributes(node_name: str, placement: "tuple[str, str] | None") -> TypedSearchAttributes:
    """``NodeName`` (and ``Site``, ``Provider`` when known): a Node entity is findable by
    site from its first report, not only after its first repair."""
    pairs = [SearchAttributePair(sa.NODE_NAME, node_name)]
    if placement is not None:
        site, provider = placement
        pairs += [SearchAttributePair(sa.SITE, site), SearchAttributePair(sa.PROVIDER, provider)]
    return TypedSearchAttributes(pairs)


async def send_report(client: Client, task_queue: str, report: HealthReport,
                      placement: "tuple[str, str] | None" = None) -> None:
    await client.start_workflow(
        "Node", {"node_name": report.node_name}, id=f"node/{report.node_name}", task_queue=task_queue,
        start_signal="health_report", start_signal_args=[report],
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=node_start_attributes(report.node_name, placement),
        static_summary=f"node {report.node_name}: health, repairs",
    )


class HealthReporter:
    """Change detection for one or many agents (the sim host runs all of them)."""

    def __init__(self, client: Client, task_queue: str, interval_s: float = DEFAULT_HEALTH_SECONDS,
                 placement: Placement | None = None) -> None:
        self.client = client
        self.placement = placement or (lambda _name: None)
        self.task_queue = task_queue
        self.interval_s = interval_s
        self._last: dict[str, str] = {}
        self._next: dict[str, float] = {}
        self.sent = 0

    def wake(self, node_name: str | None = None) -> None:
        """Probe now, not at the next interval: a GPU fault was just signalled (one node, or all)."""
        if node_name is None:
            self._next.clear()
        else:
            self._next.pop(node_name, None)

    def forget(self, node_name: str) -> None:
        self._last.pop(node_name, None)
        self._next.pop(node_name, None)

    async def check(self, agents: dict[str, Probe]) -> int:
        """Probe the agents that are due (in one thread hop); send the changed reports."""
        now = time.monotonic()
        due = {name: probe for name, probe in agents.items() if self._next.get(name, 0.0) <= now}
        if not due:
            return 0
        for name in due:
            self._next[name] = now + self.interval_s

        def probe_all() -> list[HealthReport]:
            reports = []
            for name, probe in due.items():
                try:
                    boot_id, gpus = probe()
                except Exception as error:  # noqa: BLE001 - one broken probe must not stop the others
                    log.warning("probe of %s failed: %s", name, error)
                    continue
                reports.append(HealthReport(node_name=name, boot_id=boot_id, gpus=gpus))
            return reports

        changed = [r for r in await asyncio.to_thread(probe_all)
                   if fingerprint(r.boot_id, r.gpus) != self._last.get(r.node_name)]

        async def send(report: HealthReport) -> None:
            try:
                await send_report(self.client, self.task_queue, report, self.placement(report.node_name))
            except Exception as error:  # noqa: BLE001 - Temporal unreachable: try again next probe
                log.warning("health report for %s not sent: %s", report.node_name, error)
                return
            self._last[report.node_name] = fingerprint(report.boot_id, report.gpus)
            self.sent += 1

        await asyncio.gather(*(send(r) for r in changed))
        return len(changed)


async def watch_real_node(client: Client, task_queue: str, node_name: str, gpus, stop: asyncio.Event,
                          interval_s: float = DEFAULT_HEALTH_SECONDS,
                          placement: "tuple[str, str] | None" = None) -> None:
    """A real node's probe loop (NVML backend): every ``interval_s``, and at once when the
    backend's XID waiter sees an event, so a repair starts while the operator still looks.

    ``placement`` (site, provider) defaults to ``GPUFLEET_SITE`` / ``GPUFLEET_PROVIDER``
    (the DaemonSet sets them from the node's labels)."""
    if placement is None and os.environ.get("GPUFLEET_SITE"):
        placement = (os.environ["GPUFLEET_SITE"], os.environ.get("GPUFLEET_PROVIDER", ""))
    reporter = HealthReporter(client, task_queue, interval_s, placement=lambda _name: placement)
    probe: Probe = lambda: (gpus.boot_id(), gpus.probe())  # noqa: E731
    loop = asyncio.get_running_loop()
    xid = asyncio.Event()
    if hasattr(gpus, "on_xid"):
        gpus.on_xid = lambda: loop.call_soon_threadsafe(xid.set)  # called from the NVML waiter thread
    while not stop.is_set():
        await reporter.check({node_name: probe})
        stopping, woken = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(xid.wait())
        await asyncio.wait([stopping, woken], timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        woken.cancel()
        if xid.is_set():
            xid.clear()
            reporter.wake(node_name)
