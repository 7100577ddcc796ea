"""Health reports on a node: pulled, never pushed.

The Node entity pulls a node's health with ``watch_node`` (activities/node_agent.py),
a long-running activity on the node's own queue that returns the node's whole state
when it changed. What counts as a change is ``fleet.repair_policy.fingerprint``:
counters, states, new XID events, the boot id, and temperature only as at/below the
slowdown threshold. On a real node the NVML XID waiter wakes the watch at once
(``xid_wakes``), so a repair starts while the operator still looks.

``send_report`` is the control plane's own way in (benches, operators, tests that
inject a report): a signal-with-start of the Node entity. A node cannot call it: the
node gateway forwards no start and no signal.
"""

from __future__ import annotations

from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy

from fleet.messages.nodes import HealthReport
from activities.node_agent import NodeWatch
from fleet import search_attributes as sa
from fleet.contracts import workflows as flows
from fleet.naming import node_workflow_id
from fleet.settings import NodeAgentEnv

#: Probe interval of a waiting watch, seconds (``GPUFLEET_HEALTH_SECONDS``; 0: only when woken).
DEFAULT_HEALTH_SECONDS: float = NodeAgentEnv.get("health_seconds")


def xid_wakes(gpus, watch: NodeWatch) -> None:
    """The NVML backend's XID waiter (a thread) wakes the node's watch."""
    if hasattr(gpus, "on_xid"):
        gpus.on_xid = watch.wake


def node_start_attributes(node_name: str, placement: "tuple[str, str] | None") -> TypedSearchAttributes:
    """``NodeName`` (and ``Site``, ``Provider`` when known)."""
    pairs = [SearchAttributePair(sa.NODE_NAME, node_name)]
    if placement is not None:
        site, provider = placement
        pairs += [SearchAttributePair(sa.SITE, site), SearchAttributePair(sa.PROVIDER, provider)]
    return TypedSearchAttributes(pairs)


async def send_report(client: Client, task_queue: str, report: HealthReport,
                      placement: "tuple[str, str] | None" = None) -> None:
    """Control-plane identities only: signal-with-start ``node/<name>`` with a report."""
    await client.start_workflow(
        flows.Node.TYPE, {"node_name": report.node_name}, id=node_workflow_id(report.node_name), task_queue=task_queue,
        start_signal=flows.Node.health_report, start_signal_args=[report],
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=node_start_attributes(report.node_name, placement),
        static_summary=f"node {report.node_name}: health, repairs",
    )
