"""Which of the fleet's nodes no Node entity watches.

A node's entity (``node/<name>``) is started once, by its join (``admit_node``). Terminated (the
Temporal UI, ``temporal workflow terminate``, a reset gone wrong) or failed, nothing else would
start it: the node stays Ready and serving, its agent refused by the node gateway, its faults
repaired by no one. The site sweep (``SiteSweep``'s ``ensure_node_entities``) starts such a node's
entity again, the fleet's metrics count such nodes (``gpufleet_nodes_unwatched``) and
``gpufleet sites`` shows them; all three decide here. A node that is not Ready needs its entity
too while a GpuRepair of it runs: the repair asks the entity for the node's action slot and waits
for a run to take the request over (a reboot that timed out leaves the node NotReady; its
reinstall is what brings it back).
"""

from __future__ import annotations

from typing import Iterable

from fleet.contracts import workflows as flows
from fleet.cluster import ANNOTATION_CORDONED_BY, RETIREMENT_MARKS, UNPROVEN_TAINT, NodeIdentity
from fleet.errors import NotFound
from fleet.naming import node_workflow_id, repair_node_name


def running_entities_query(task_queue: str) -> str:
    """The visibility query of the running Node entities on the control plane's queue."""
    return f'WorkflowType = "{flows.Node.TYPE}" AND ExecutionStatus = "Running" AND TaskQueue = "{task_queue}"'


async def running_node_entities(client, task_queue: str) -> set[str]:
    """The names of the nodes whose Node entity runs, as Temporal's visibility lists them (it
    lags a second or so behind a start: check a node it leaves out with a describe)."""
    prefix = node_workflow_id("")
    return {found.id.removeprefix(prefix) async for found in client.list_workflows(running_entities_query(task_queue))}


async def nodes_under_repair(client, task_queue: str) -> set[str]:
    """The names of the nodes a GpuRepair runs on, on the control plane's queue: from each run's
    id (``repair/<node>/gpu<N>``, which a Node entity run takes over by: ``node_left``)."""
    query = (f'WorkflowType = "{flows.GpuRepair.TYPE}" AND ExecutionStatus = "Running" '
             f'AND TaskQueue = "{task_queue}"')
    return {name async for found in client.list_workflows(query) if (name := repair_node_name(found.id))}


def closed_as(status) -> str:
    """How a run stands in words (a ``WorkflowExecutionStatus``): "terminated", "timed-out", ..."""
    return status.name.lower().replace("_", "-") if status else "unknown"


def unwatched_nodes(cluster, nodes: Iterable, watched: set[str],
                    under_repair: frozenset[str] | set[str] = frozenset()) -> list[NodeIdentity]:
    """The nodes among ``nodes`` that must have a running Node entity and are not in ``watched``:
    Ready, or not Ready while a GpuRepair of it runs (``under_repair``: waiting for the entity to
    grant it the node's action slot, it would wait for good); proven (its join lifts the unproven taint, then starts the entity); joined by gpufleet
    and not retired (the join's identity record, which no node can write, is there: a retirement
    removes it with the Node); and not cordoned by a retirement in flight (``RETIREMENT_MARKS``:
    its entity ends with the node). Returns their identity records, in name order: an entity
    started again takes its site and provider from there, never from the node's own labels.

    Only the nodes not watched are read again (their record, a cordoned one's mark): an idle
    fleet's check is one list of nodes."""
    found = []
    for node in sorted(nodes, key=lambda n: n.name):
        if node.name in watched or UNPROVEN_TAINT in node.taints:
            continue
        if not node.ready and node.name not in under_repair:
            continue
        identity = cluster.node_identity(node.name)
        if identity is None:
            continue
        if retiring(cluster, node):
            continue
        found.append(identity)
    return found


def retiring(cluster, node) -> bool:
    """Whether ``node`` (as listed) is cordoned by a retirement in flight (``RETIREMENT_MARKS``: its
    machine goes on purpose), or removed since the list (retired). Only a cordoned node is read again."""
    if not node.unschedulable:
        return False
    try:
        mark = cluster.node_marks(node.name).annotations.get(ANNOTATION_CORDONED_BY, "")
    except NotFound:
        return True
    return mark in RETIREMENT_MARKS
