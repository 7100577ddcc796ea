"""What ``gpufleet sites`` says about each site now: nodes serving, cordoned (and what holds each
cordoned node), unwatched (Ready, or NotReady under a running repair, its Node entity not running:
``fleet.watched``), joining, the site's last incident, and the put-backs of closed evacuations
its Site entity left to a person.

Each fact comes from where the product keeps it: the cluster's nodes (ready, cordoned, the
``unproven`` taint), Temporal's visibility (running GPU repairs by ``NodeName``, running joins,
every SiteEvacuation by ``Site``: the Site entity's own and those started by hand) and, only for
a cordoned node nothing else explains, the entities' queries (a Node entity's log says a repair
is a quarantine; a Site entity's status says its incident is open). A site with an evacuation on
record is asked for its status too: whether its entity gave up putting one back. Without Temporal
the counts still come from the cluster, and what Temporal would have said reads ``?``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from fleet.cluster import ANNOTATION_CORDONED_BY, CORDONED_BY_DEMAND, LABEL_SITE, UNPROVEN_TAINT

#: What can hold a node cordoned, in the order a node held for several reasons is shown by: the
#: one that outlasts the others first (a repair keeps its node after the evacuation ends). After
#: them, a cordon marked as someone else's shows the mark's value.
CORDON_REASONS = ("quarantine", "repair", "evacuation", "incident", "demand loop", "operator")
#: A cordon mark (``ANNOTATION_CORDONED_BY``) is shown cut to this: the node's kubelet can write it.
MARK_SHOWN = 24
#: The reason the Node entity gives when its agent's reports were bad too often in a row
#: (``workflows.node``): a quarantine, though no ``quarantine`` signal logged it.
BAD_REPORTS_QUARANTINE = "bad reports in a row from the node agent"
UNKNOWN = "?"


@dataclass
class Holds:
    """What Temporal says holds nodes and sites (``None`` fields: Temporal was not asked)."""

    #: node → reasons of its running GpuRepairs (one list per repair, flattened).
    repairs: dict[str, list[str]] = field(default_factory=dict)
    #: nodes whose running repair is a quarantine (their Node entity logged it so).
    quarantined: set[str] = field(default_factory=set)
    #: sites with a SiteEvacuation running.
    evacuating: set[str] = field(default_factory=set)
    #: sites whose Site entity has an incident open.
    incident_open: set[str] = field(default_factory=set)
    #: site → node names of its running single-node joins.
    joining: dict[str, set[str]] = field(default_factory=dict)
    #: site → (evacuation id, state) of its newest SiteEvacuation.
    last_incident: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Why what only a query tells could not be read (no worker answered): said once by the view.
    unanswered: str = ""
    #: Cordoned nodes whose hold only an unanswered query would have named: shown as ``?``.
    unread: set[str] = field(default_factory=set)
    #: Nodes whose Node entity runs (the rest of a site's Ready nodes may be unwatched: ``fleet.watched``).
    watched: set[str] = field(default_factory=set)
    #: Nodes a GpuRepair runs on (by its id): a NotReady one waits for its entity (``fleet.watched``).
    under_repair: set[str] = field(default_factory=set)
    #: site → evacuation id → the note its Site entity left when it gave up putting it back
    #: (``IncidentView.put_back_given_up``): a person finishes it (docs/operations.md).
    put_backs_left: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass
class SiteNow:
    nodes: int = 0
    serving: int = 0
    cordoned: Counter = field(default_factory=Counter)
    joining: int = 0
    last_incident: str = "none"
    #: Nodes that must have a running Node entity and have none (``fleet.watched``; None: Temporal not asked).
    unwatched: int | None = 0
    #: Put-backs of closed evacuations its Site entity gave up on (``Holds.put_backs_left``).
    put_backs_left: int = 0

    def incident_cell(self) -> str:
        if not self.put_backs_left:
            return self.last_incident
        many = "s" if self.put_backs_left > 1 else ""
        return f"{self.last_incident}; {self.put_backs_left} put-back{many} left to a person"

    def cordoned_cell(self) -> str:
        total = sum(self.cordoned.values())
        if not total:
            return "0"
        known = (*CORDON_REASONS, UNKNOWN)
        order = [*known, *sorted(reason for reason in self.cordoned if reason not in known)]
        parts = [f"{reason} {self.cordoned[reason]}" for reason in order if self.cordoned[reason]]
        return f"{total}: {', '.join(parts)}"


def cordon_reason(node, site: str, holds: Holds | None, mark: str = "") -> str:
    """Why a cordoned node is cordoned: the first of ``CORDON_REASONS`` that holds it; else who its
    cordon mark ``mark`` (``ANNOTATION_CORDONED_BY``) names: ``demand loop`` (its retirement's
    drain), or the mark's value (a person who took the node); ``operator`` for a cordon without a
    mark (a person's ``kubectl cordon``); ``?`` without Temporal, or where a query it needed went
    unanswered."""
    if holds is None or node.name in holds.unread:
        return UNKNOWN
    if node.name in holds.quarantined:
        return "quarantine"
    if node.name in holds.repairs:
        return "repair"
    if site in holds.evacuating:
        return "evacuation"
    if site in holds.incident_open:
        return "incident"
    if mark == CORDONED_BY_DEMAND:
        return "demand loop"
    return mark[:MARK_SHOWN] or "operator"


def cordon_marks(cluster, nodes: list) -> dict[str, str]:
    """Each cordoned node's cordon mark (``ANNOTATION_CORDONED_BY``), where it has one."""
    from fleet.errors import NotFound

    marks = {}
    for node in (n for n in nodes if n.unschedulable):
        try:
            mark = cluster.annotate_node(node.name, {}).get(ANNOTATION_CORDONED_BY, "")  # a read: nothing merged
        except NotFound:
            continue  # gone since the list
        if mark:
            marks[node.name] = mark
    return marks


def summarize(site_names: list[str], nodes: list, holds: Holds | None,
              marks: dict[str, str] | None = None, unwatched: list | None = None) -> dict[str, SiteNow]:
    """Per site: its nodes, those serving (Ready, schedulable, proven), those cordoned by reason
    (``marks``: node → its cordon mark), those joining (a running join's node or machine, or a node
    not yet proven), those unwatched (``unwatched``: the identity records ``fleet.watched`` found,
    by the site they record; None: not known), the last incident."""
    marks = marks or {}
    out = {name: SiteNow(unwatched=None if unwatched is None else 0) for name in site_names}
    for identity in unwatched or ():
        if identity.site in out:
            out[identity.site].unwatched += 1
    for node in nodes:
        site = node.labels.get(LABEL_SITE) or node.site
        now = out.get(site)
        if now is None:
            continue
        now.nodes += 1
        unproven = UNPROVEN_TAINT in node.taints
        if node.ready and not node.unschedulable and not unproven:
            now.serving += 1
        if node.unschedulable:
            now.cordoned[cordon_reason(node, site, holds, marks.get(node.name, ""))] += 1
    for name, now in out.items():
        registering = {n.name for n in nodes if (n.labels.get(LABEL_SITE) or n.site) == name
                       and UNPROVEN_TAINT in n.taints}
        if holds is None:
            now.joining = len(registering)
            now.last_incident = UNKNOWN
            continue
        now.joining = len(registering | holds.joining.get(name, set()))
        if name in holds.last_incident:
            evacuation, state = holds.last_incident[name]
            now.last_incident = f"{evacuation} {state}"
        now.put_backs_left = len(holds.put_backs_left.get(name, {}))
    return out


def _state(execution, fleet_state) -> str:
    from temporalio.client import WorkflowExecutionStatus

    state = execution.typed_search_attributes.get(fleet_state) or ""
    if execution.status in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.COMPLETED) and state:
        return str(state)
    return execution.status.name.lower().replace("_", "-") if execution.status else "unknown"


async def holds(client, task_queue: str, site_names: list[str], nodes: list, limit: int = 1000) -> Holds:
    """One look at what Temporal holds: three visibility lists, and queries only for cordoned
    nodes a running repair holds (is it a quarantine?) and for sites whose cordoned nodes nothing
    else explains (is an incident open?). Once a query goes unanswered (no worker) no other is
    asked: each would wait as long."""
    from temporalio.client import WorkflowExecutionStatus

    from client import NoWorker, query_workflow
    from fleet import search_attributes as sa
    from fleet.messages.capacity import SiteStatus
    from fleet.messages.repair import LadderState, NodeStatus
    from fleet.contracts import workflows as flows
    from fleet.naming import node_workflow_id, repair_node_name, site_workflow_id
    from fleet.watched import running_node_entities

    found = Holds()
    found.watched = await running_node_entities(client, task_queue)
    queue = f'TaskQueue = "{task_queue}"'
    running = f'{queue} AND ExecutionStatus = "Running"'
    repair_ids: dict[str, list[str]] = {}
    async for wf in client.list_workflows(f'{running} AND WorkflowType = "{flows.GpuRepair.TYPE}"', limit=limit):
        if node := wf.typed_search_attributes.get(sa.NODE_NAME):
            repair_ids.setdefault(str(node), []).append(wf.id)
        if node := repair_node_name(wf.id):
            found.under_repair.add(node)
    async for wf in client.list_workflows(f'{running} AND WorkflowType = "{flows.NodeJoin.TYPE}"', limit=limit):
        node, site = wf.typed_search_attributes.get(sa.NODE_NAME), wf.typed_search_attributes.get(sa.SITE)
        if node and site:  # a single-node join (a fan-out names no node: its children do)
            found.joining.setdefault(str(site), set()).add(str(node))
    newest: dict[str, datetime] = {}
    async for wf in client.list_workflows(f'{queue} AND WorkflowType = "{flows.SiteEvacuation.TYPE}"', limit=limit):
        site = str(wf.typed_search_attributes.get(sa.SITE) or wf.id.split("/")[1])
        if wf.status == WorkflowExecutionStatus.RUNNING:
            found.evacuating.add(site)
        if site not in newest or wf.start_time > newest[site]:
            newest[site] = wf.start_time
            found.last_incident[site] = (wf.id, _state(wf, sa.FLEET_STATE))

    cordoned = [n for n in nodes if n.unschedulable]

    async def query(workflow_id: str, name: str, kind):
        if found.unanswered:
            return None
        try:
            return await query_workflow(client, workflow_id, name, kind, task_queue=task_queue)
        except NoWorker as error:
            found.unanswered = str(error)
            return None
        except Exception:  # noqa: BLE001 - closed meanwhile, not started, not there: no hold
            return None

    for node in cordoned:
        if node.name not in repair_ids:
            # A GPU fenced whose repair has not started (the site holds new repairs): a repair's hold.
            status = await query(node_workflow_id(node.name), flows.Node.status, NodeStatus)
            if status is not None and status.fenced:
                found.repairs[node.name] = [f"GPU {', '.join(map(str, status.fenced))} fenced, repair held"]
            continue
        reasons: list[str] = []
        for repair_id in repair_ids[node.name]:
            ladder = await query(repair_id, flows.GpuRepair.ladder, LadderState)
            reasons += ladder.reasons if ladder else []
        found.repairs[node.name] = reasons
        status = await query(node_workflow_id(node.name), flows.Node.status, NodeStatus)
        logged = set(status.log) if status else set()
        if any(f"quarantined: {r}" in logged or BAD_REPORTS_QUARANTINE in r for r in reasons):
            found.quarantined.add(node.name)
    site_statuses: dict[str, SiteStatus | None] = {}

    async def site_status(site: str) -> SiteStatus | None:
        if site not in site_statuses:
            site_statuses[site] = await query(site_workflow_id(site), flows.Site.status, SiteStatus)
        return site_statuses[site]

    unexplained = {n.labels.get(LABEL_SITE) or n.site for n in cordoned
                   if n.name not in found.repairs} - found.evacuating
    for site in sorted(unexplained & set(site_names)):
        status = await site_status(site)
        if status is not None and status.incident is not None and status.incident.open is not None:
            found.incident_open.add(site)
    # Only a site with an evacuation on record can have a put-back left to a person: only those
    # are asked (each query is an action). One whose evacuations visibility no longer keeps (past
    # the namespace's retention) is not; its status query still says.
    for site in sorted(set(found.last_incident) & set(site_names)):
        status = await site_status(site)
        if status is not None and status.incident is not None and status.incident.put_back_given_up:
            found.put_backs_left[site] = dict(status.incident.put_back_given_up)
    if found.unanswered:  # a fenced GPU or an open incident may hold these: not known, not "operator"
        found.unread = {n.name for n in cordoned if n.name not in found.repairs
                        and (n.labels.get(LABEL_SITE) or n.site) not in found.evacuating | found.incident_open}
    return found
