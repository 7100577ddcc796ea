"""FleetSweep's activities: what accounts for each machine, and one site's sweep.

A machine is an orphan when it carries the fleet's ownership marker (``Machine.owned``,
defined per adapter), no node in the cluster and no running join accounts for it, and
it is older than the grace period. Only orphans are deleted; an unmarked machine is
counted and never touched, and a revoked account is not called at all (rule 6).
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime

from temporalio import activity

from activities.capacity import reports_account
from activities.env import FleetEnv
from activities.errors import typed_errors
from fleet.cluster import LABEL_SITE, NODE_IDENTITY_KIND, UNPROVEN_TAINT, NodeIdentity
from fleet.contracts import workflows as flows
from fleet.errors import AccountRevoked, FleetError, NotFound
from fleet.messages.sweep import (
    IdentitySweepReport,
    SiteSweepReport,
    SweepIdentitiesInput,
    SweepKnown,
    SweepSiteInput,
)
from fleet.models import Machine
from fleet.naming import node_name_for
from fleet.search_attributes import NODE_NAME

#: A failed delete's message in the report, cut (a provider's answer can be long).
FAILURE_SHOWN = 300

RUNNING_JOINS = f'WorkflowType = "{flows.NodeJoin.TYPE}" AND ExecutionStatus = "Running"'


def join_node_name(workflow_id: str, node_name: str | None) -> str | None:
    """The node name a running join provisions: its ``NodeName`` search attribute, else
    derived from a ``join/<site>/<request>`` id as the join itself derives it."""
    if node_name:
        return node_name
    parts = workflow_id.split("/")
    if len(parts) >= 3 and parts[0] == "join":
        return node_name_for(parts[1], workflow_id)
    return None


def classify(machines: list[Machine], known: SweepKnown, now: float, grace: float,
             first_seen: dict[str, float], report: SiteSweepReport) -> list[Machine]:
    """Fill ``report`` (counts, young, first_seen) and return the orphans to delete."""
    names, ids, joining = set(known.node_names), set(known.machine_ids), set(known.joining)
    orphans = []
    for machine in machines:
        if machine.state == "terminated":
            continue
        report.listed += 1
        if not machine.owned:
            report.unmarked += 1
        elif machine.name in names or machine.id in ids:
            report.known += 1
        elif machine.name in joining:
            report.joining += 1
        else:
            born = machine.created_at.timestamp() if isinstance(machine.created_at, datetime) else None
            if born is None:
                born = first_seen.get(machine.id, now)
                report.first_seen[machine.id] = born
            if now - born < grace:
                report.young.append(machine.id)
            else:
                orphans.append(machine)
    return orphans


class SweepActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env

    def all(self) -> list:
        return [self.sweep_known, self.sweep_site, self.sweep_identities]

    @activity.defn
    @typed_errors
    async def sweep_known(self) -> SweepKnown:
        """The running joins' node names, then the machines of the cluster's identified, admitted nodes.

        A node accounts for a machine only through its identity record (what its join recorded),
        never through its Node object: a retired machine's kubelet, its certificate still valid,
        can create its Node again (NodeRestriction lets it), under its own name and with any
        providerID; that must not keep its own machine, or another orphan, from the sweep.

        Nor does a node still tainted unproven whose join no longer runs (``SweepKnown.abandoned``):
        its join was terminated (or reset, or timed out) after the node registered, and a terminate
        runs no clean-up. Nothing admits it, no Node entity watches it, and its machine was billed
        for good while the Site counted it toward its min.

        In this order: a join running as the joins are listed keeps its node and machine; one that
        ended before has admitted its node (the taint lifted) or cleaned up; one that started after
        bought its machine after the listing (young)."""
        cluster = self.env.cluster
        joining = set()
        async for wf in activity.client().list_workflows(RUNNING_JOINS):
            name = join_node_name(wf.id, wf.typed_search_attributes.get(NODE_NAME))
            if name:
                joining.add(name)
        nodes = await asyncio.to_thread(cluster.list_nodes)
        records = await asyncio.to_thread(cluster.list_state, NODE_IDENTITY_KIND)
        identities = {n.name: NodeIdentity.from_state(records.get(n.name, {})) for n in nodes}
        abandoned = {n.name: (identities[n.name].site if identities[n.name] else "") or n.labels.get(LABEL_SITE, "")
                     for n in nodes if UNPROVEN_TAINT in n.taints and n.name not in joining}
        identified = {name: identity for name, identity in identities.items() if identity is not None}
        admitted = {name: identity for name, identity in identified.items() if name not in abandoned}
        return SweepKnown(node_names=sorted(admitted),
                          machine_ids=sorted(i.machine_id for i in admitted.values() if i.machine_id),
                          joining=sorted(joining),
                          unidentified=sorted(set(identities) - set(identified)),
                          abandoned=dict(sorted(abandoned.items())))

    @activity.defn
    @typed_errors
    @reports_account(lambda input: input.site)
    def sweep_site(self, input: SweepSiteInput) -> SiteSweepReport:
        """List the site's machines, delete its orphans (unless ``dry_run``)."""
        site = self.env.site(input.site)
        report = SiteSweepReport(site=site.name, account=site.account)
        try:
            provider = self.env.provider(site.name)  # the guard: a revoked account is not called
        except AccountRevoked as error:
            report.skipped = f"credentials revoked: {error}"
            return report
        grace = self.env.config.sweep.grace_seconds if input.grace_seconds is None else input.grace_seconds
        machines = provider.list_machines()
        orphans = classify(machines, input.known, time.time(), grace, input.first_seen, report)
        for machine in orphans:
            if input.dry_run:
                report.deleted.append(machine.id)
                if machine.name in input.known.abandoned:
                    report.abandoned.append(machine.name)
                continue
            try:
                provider.delete_machine(machine.id)
            except NotFound:
                pass  # gone already: the delete is done
            except FleetError as error:
                if error.type_name in ("BadCredentials", "OverQuota"):
                    raise
                report.failed.append(f"{machine.id}: {type(error).__name__}: {str(error)[:FAILURE_SHOWN]}")
                continue
            except Exception as error:  # noqa: BLE001 - one machine's failure must not hide the others
                # Not one of our typed errors, whose messages are written not to quote a request: its
                # own text may (a transport failure quotes a header it refused, a key with it).
                report.failed.append(f"{machine.id}: {type(error).__name__}")
                continue
            report.deleted.append(machine.id)
            activity.logger.warning("sweep deleted orphan %s (%s) at %s", machine.id, machine.name, site.name)
            if machine.name in input.known.abandoned:
                self._remove_abandoned(machine.name, report)
        # A node its join left unproven whose machine is gone already (a person deleted it, an
        # earlier pass removed the machine and not the Node): its Node and record go too.
        live = {m.name for m in machines if m.state != "terminated"}
        for name, at in input.known.abandoned.items():
            if at == site.name and name not in live and name not in report.abandoned:
                if input.dry_run:
                    report.abandoned.append(name)
                else:
                    self._remove_abandoned(name, report)
        return report

    def _remove_abandoned(self, name: str, report: SiteSweepReport) -> None:
        """The Node of a join that no longer runs, left unproven, and its identity record: its
        machine is gone. Counted by the Site toward its min, and by the demand loop as capacity on
        its way, until then."""
        try:
            self.env.cluster.remove_node(name)
        except FleetError as error:  # the next pass tries again; the others go on
            report.failed.append(f"node {name}: {type(error).__name__}: {str(error)[:FAILURE_SHOWN]}")
            return
        except Exception as error:  # noqa: BLE001 - as a machine's: its own text may quote a request
            report.failed.append(f"node {name}: {type(error).__name__}")
            return
        report.abandoned.append(name)
        activity.logger.warning("sweep removed node %s, left unproven by a join that no longer runs", name)

    @activity.defn
    @typed_errors
    def sweep_identities(self, input: SweepIdentitiesInput) -> IdentitySweepReport:
        """Delete the identity records whose Node is gone (``remove_node`` deletes a retired
        node's own; these are what a ``kubectl delete node`` or a crash in between left) once
        they have been without a Node for the grace period: a kubelet whose Node was deleted
        registers it again within seconds, and must find its record still there.

        Records are listed before nodes: a record is written only after its Node registered,
        so one written meanwhile has its Node in the listing."""
        cluster = self.env.cluster
        records = cluster.list_state(NODE_IDENTITY_KIND)
        present = {node.name for node in cluster.list_nodes()} | set(input.joining)
        grace = self.env.config.sweep.grace_seconds if input.grace_seconds is None else input.grace_seconds
        now = time.time()
        report = IdentitySweepReport(listed=len(records))
        for name, data in sorted(records.items()):
            if name in present:
                continue
            since = input.first_seen.get(name, now)
            if now - since < grace:
                report.young.append(name)
                report.first_seen[name] = since
                continue
            # Only the record judged: a join that wrote it again since keeps it.
            if input.dry_run or cluster.delete_state(NODE_IDENTITY_KIND, name, only_if=data):
                report.deleted.append(name)
                if not input.dry_run:
                    activity.logger.warning("sweep deleted the identity record of gone node %s", name)
        return report
