"""Site (entity, id ``site/<name>``): keep the site between its min and max.

Min/max come from the fleet config. Node workflows tell it their transitions
(``node_transition``); the reconcile sweep (a Schedule) and a timer send
``reconcile``. A joined node ("ready") is counted from its transition and
reconciles only when the count passes the max (patch ``count-joins``: a fleet
coming up would otherwise list the whole site once per join); any other
transition reconciles. Each reconcile counts the site's nodes in the cluster, then:

- below min: an AcquireCapacity restricted to this site for the missing nodes;
- above max: drain (PDBs honoured) and retire the surplus, most expensive first,
  then newest.

Provider incidents (product rule 5, ``fleet.incident``; recorded as patch
``incident-v1``): the entity also

- answers ``admit_repair`` (update) from its Node entities before any GPU
  repair, only for nodes of this site (the cluster's count; an unknown name is
  refused and never counts): the failure goes into the site's window; a short settle lets a burst
  arrive; while the rule is tripped or an incident is open the answer is "hold"
  (no new repairs here);
- every ``check_seconds`` probes its nodes (NotReady, not cordoned = unreachable)
  and the provider API (Transient failures for longer than T trip too);
- on a trip records the incident, holds the site's running GpuRepairs (each
  finishes its current rung), and starts SiteEvacuation ``evacuate/<site>/<n>``;
  a second trip while it runs starts nothing. When the evacuation ends the
  incident closes and held repairs are released. No min/max fill or retire
  while an incident is open.

Continues as new when the server suggests it, carrying its one state model
(``SiteState``: nodes, counters, the incident rule's failures and the open
incident, if any); never while a fill or an evacuation runs, and only once every
handler has finished. An admission still settling then can open an incident: it
is in the carried state, so the next run starts its evacuation.

SiteSweep (id ``site-sweep``, run by a Schedule): signal-with-start every site's
entity with ``reconcile``.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from fleet.messages.capacity import (
        CapacityResult,
        NodeTransition,
        SignalSitesInput,
        SiteInput,
        SiteNode,
        SiteNodesInput,
        SiteState,
        SiteStatus,
    )
    from activities.models import ResolveSiteInput
    from fleet import search_attributes as sa
    from fleet.config import Site
    from fleet.placement import surplus_to_retire
    from workflows.inputs import parse_input, parse_signal
    from workflows.steps import (
        CLUSTER_RETRY,
        PROVIDER_RETRY,
        QUICK,
        STORE_RETRY,
        drain_and_retire,
        failure_message,
        show_details,
    )
    from fleet.incident import (
        Failure,
        IncidentSettings,
        absence,
        count_unreachable,
        evaluate,
        forget_unreachable,
        in_return_grace,
        record,
    )
    from workflows.evacuation import evacuation_workflow_id
    from fleet.messages.evacuation import (
        AdmitRepairInput,
        EvacuationResult,
        HoldRepairsInput,
        IncidentCarry,
        IncidentRecord,
        IncidentView,
        RepairDecision,
        SiteProbe,
        SiteRef,
    )

#: Workflow patch: incident detection, repair admission and evacuation in the Site entity.
INCIDENT_PATCH = "incident-v1"
#: Workflow patch: ``admit_repair`` answers only for nodes the site has.
KNOWN_NODES_PATCH = "admit-known-nodes"
#: Workflow patch: the entity tells when the control plane was away, and reconciles (no repair,
#: no incident) for ``control_plane.return_grace_seconds`` after it returns.
CONTROL_PLANE_PATCH = "control-plane-return"
#: Workflow patch: a joined node is counted from its own transition; the site is listed again
#: only when that count passes the max (before, every join re-listed the whole site).
COUNT_JOINS_PATCH = "count-joins"



@workflow.defn(name="Site")
class SiteEntity:
    def __init__(self) -> None:
        #: Everything the entity knows, carried over continue-as-new (``run`` sets the real one).
        self.state = SiteState(status=SiteStatus(site=""))
        # Read again by every run: its input, the site's config and incident rule.
        self._args: SiteInput | None = None
        self._site: Site | None = None
        self._incident_settings: IncidentSettings | None = None
        # In flight (no continue-as-new while either runs).
        self._fill: asyncio.Task | None = None
        self._evac: asyncio.Task | None = None
        # Patched in: watch the gap between its own timer and its next task (``_note_presence``).
        self._returns = False
        self._sleep = 0.0
        # Patched in: a "ready" transition reconciles only when the count passes the max.
        self._count_joins = False

    @workflow.signal
    def reconcile(self) -> None:
        self.state.wanted = True

    @workflow.signal
    def node_transition(self, raw: dict[str, Any]) -> None:
        t = parse_signal(NodeTransition, raw, "node_transition")
        if t is None:
            return
        status = self.state.status
        status.nodes[t.node_name] = t.state
        if self._count_joins and t.state == "ready":
            # A node added: a fill that overshot or a join from outside can take the site past
            # its max, nothing else changes for min/max; the next reconcile lists it anyway.
            counted = sum(state != "gone" for state in status.nodes.values())
            if counted <= status.max_nodes:
                self._show(f"{t.node_name} joined")
                return
        self.state.wanted = True

    @workflow.query
    def status(self) -> SiteStatus:
        state = self.state
        if self._incident_settings is None:
            return state.status
        inc, v = state.incident, state.incident.verdict
        return state.status.model_copy(update={"incident": IncidentView(
            open=inc.open, failing=v.failing if v else [], threshold=v.threshold if v else 0,
            site_nodes=state.node_count, api_failing_since=inc.api_failing_since, history=inc.history,
            control_plane_returned_at=inc.returned_at,
            grace_until=(inc.returned_at + self._incident_settings.control_plane.return_grace_seconds
                         if inc.returned_at is not None else None),
        )})

    @workflow.update
    async def admit_repair(self, req: AdmitRepairInput) -> RepairDecision:
        """A Node entity asks before a GPU repair: repair, or hold for the site's incident."""
        # No lock: every change here is made between awaits, and the settle wait is there to let the other
        # admissions of a burst change the state meanwhile (a lock would queue the very burst it waits for).
        await workflow.wait_condition(lambda: self._incident_settings is not None)
        if workflow.patched(KNOWN_NODES_PATCH) and not await self._knows(req.node_name):
            # Invented names must not count towards the incident rule (three of them once
            # evacuated a site): only this site's nodes, as the cluster records them.
            return RepairDecision(repair=False, why=f"{req.node_name} is not a node of {self._site.name}: ignored")
        s, inc = self._incident_settings, self.state.incident  # the run's state is set by now
        if inc.open is not None:
            return RepairDecision(repair=False, incident=inc.open.id, why="incident open: no new repairs here")
        now = workflow.now().timestamp()
        if self._returns:
            # An admission can be the first task after an outage (before the entity's own timer's).
            self._note_presence(waking=False)
            if in_return_grace(inc.returned_at, now, s.control_plane):
                # Not recorded as a failure: the node asks again after its recheck interval.
                left = inc.returned_at + s.control_plane.return_grace_seconds - now
                return RepairDecision(repair=False, why=f"control plane back {now - inc.returned_at:.0f}s ago: "
                                                        f"the site reconciles first ({left:.0f}s more)")
        detail = f"GPU {req.gpu}: {', '.join(req.reasons)}"
        inc.failures = record(inc.failures, Failure(node=req.node_name, at=now, detail=detail), now, s)
        self._evaluate()
        if inc.open is None and s.settle_seconds > 0:
            try:
                await workflow.wait_condition(lambda: inc.open is not None,
                                              timeout=timedelta(seconds=s.settle_seconds),
                                              timeout_summary="settle: more failures at this site?")
            except asyncio.TimeoutError:
                pass
        if inc.open is not None:
            return RepairDecision(repair=False, incident=inc.open.id, why=inc.open.reason)
        v = inc.verdict
        return RepairDecision(repair=True, why=f"{len(v.failing)} failing, trips at {v.threshold}")

    async def _knows(self, node_name: str) -> bool:
        """A node of this site: in the last count, else in a fresh one (admitted since)."""
        if node_name in self.state.status.nodes:
            return True
        nodes: list[SiteNode] = await workflow.execute_activity(
            "site_nodes", SiteNodesInput(site=self._site.name), result_type=list[SiteNode],
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary=f"is {node_name} at {self._site.name}?",
        )
        for n in nodes:
            self.state.status.nodes.setdefault(n.node_name, "ready" if n.ready and not n.unproven else "joining")
        return any(n.node_name == node_name for n in nodes)

    def _site_nodes(self) -> int:
        return max(self.state.node_count, len(self.state.status.nodes))

    def _evaluate(self) -> None:
        """Run the rule; a trip opens the incident (the loop starts the evacuation)."""
        now, inc = workflow.now().timestamp(), self.state.incident
        inc.verdict = v = evaluate(inc.failures, self._site_nodes(), now, self._incident_settings,
                                   inc.api_failing_since)
        if v.trip and inc.open is None and not self._in_grace(now):
            inc.count += 1
            inc.open = IncidentRecord(id=evacuation_workflow_id(self._args.site, inc.count), reason=v.reason,
                                      opened_at=workflow.now())
            inc.evacuate = True

    @workflow.run
    async def run(self, raw: Any) -> None:
        args = parse_input(SiteInput, raw)
        self._args = args
        # Runs from before SiteState carried its parts in separate fields.
        self.state = args.state or SiteState(status=SiteStatus(site=args.site, nodes=dict(args.nodes)),
                                             fills=args.fills, incident=args.incident or IncidentCarry())
        self.state.wanted = True  # every run reconciles first: it reads the site's min/max again
        site: Site = await workflow.execute_activity(
            "resolve_site", ResolveSiteInput(site=args.site), result_type=Site, start_to_close_timeout=QUICK,
            retry_policy=PROVIDER_RETRY, summary=f"min/max of {args.site} from the config",
        )
        self._site = site
        status = self.state.status
        status.site, status.min_nodes, status.max_nodes = site.name, site.min_nodes, site.max_nodes
        workflow.upsert_search_attributes([
            sa.SITE.value_set(site.name), sa.PROVIDER.value_set(site.provider), sa.ACCOUNT.value_set(site.account),
            sa.FLEET_STATE.value_set("reconciling"),
        ])
        self._count_joins = workflow.patched(COUNT_JOINS_PATCH)
        incidents = workflow.patched(INCIDENT_PATCH)
        if incidents:
            self._returns = workflow.patched(CONTROL_PLANE_PATCH)
            self._incident_settings = await workflow.execute_activity(
                "incident_settings", SiteRef(site=site.name), result_type=IncidentSettings,
                start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY,
                summary=f"incident rule of {site.name}",
            )
        next_reconcile = workflow.now() + timedelta(seconds=args.reconcile_seconds)
        while True:
            timeout = args.reconcile_seconds
            if incidents:
                timeout = min(timeout, self._incident_settings.check_seconds)
            if self._returns:
                self.state.incident.last_seen, self._sleep = workflow.now().timestamp(), timeout
            timed_out = False
            try:
                await workflow.wait_condition(
                    lambda: (self.state.wanted or self.state.incident.evacuate
                             or workflow.info().is_continue_as_new_suggested()),
                    timeout=timedelta(seconds=timeout), timeout_summary="next reconcile",
                )
            except asyncio.TimeoutError:
                timed_out = True
            if self._returns:
                self._note_presence(waking=True)
            if timed_out:
                if not incidents or workflow.now() >= next_reconcile:
                    self.state.wanted = True
                if incidents:
                    await self._probe()
            if self.state.incident.evacuate:
                await self._start_evacuation()
            if self.state.wanted:
                self.state.wanted = False
                next_reconcile = workflow.now() + timedelta(seconds=args.reconcile_seconds)
                await self._reconcile()
            if workflow.info().is_continue_as_new_suggested() and self._fill is None and self._evac is None:
                # An admission still settling can open an incident meanwhile: it is in the state, carried.
                await workflow.wait_condition(workflow.all_handlers_finished)
                carried = args.model_copy(update={"state": self.state, "nodes": {}, "fills": 0, "incident": None})
                workflow.continue_as_new(carried.model_dump(mode="json"))

    # -- the control plane's own absence ------------------------------------------------------
    def _note_presence(self, waking: bool) -> None:
        """Was the control plane away while this entity slept? Its timer was due ``_sleep`` after
        ``last_seen``; a task much later than that means nothing could run it (Temporal or the
        control-plane worker was down). Then: reconcile first, and no repair or incident for the
        return grace. ``waking``: the loop's own wake-up, which ends this sleep."""
        inc, cp = self.state.incident, self._incident_settings.control_plane
        now = workflow.now().timestamp()
        away = absence(inc.last_seen, now, self._sleep, cp)
        if away:
            inc.returned_at = now
            # NotReady seen while it slept may be the outage's own shadow (agents and kubelets that
            # could not report); GPU faults a node reported itself stay.
            inc.failures = forget_unreachable(inc.failures, inc.last_seen)
            self.state.wanted = True
            workflow.logger.warning("site %s: control plane was away about %.0fs; reconciling, repairs and "
                                    "incidents wait %gs", self._site.name, away - self._sleep,
                                    cp.return_grace_seconds)
            self._show(f"control plane back after ~{away - self._sleep:.0f}s away: reconciling first "
                       f"({cp.return_grace_seconds:g}s grace)")
        # Awake, no sleep to judge; an admission that found a gap moves the mark (the loop's own
        # timer is then long due and wakes it at once).
        inc.last_seen = None if waking else (now if away else inc.last_seen)

    def _in_grace(self, now: float) -> bool:
        return self._returns and in_return_grace(self.state.incident.returned_at, now,
                                                 self._incident_settings.control_plane)

    # -- provider incidents -----------------------------------------------------------------
    async def _probe(self) -> None:
        """Unreachable nodes and the provider API, into the incident rule."""
        if self.state.incident.open is not None:
            return
        probe: SiteProbe = await workflow.execute_activity(
            "incident_probe", SiteRef(site=self._site.name), result_type=SiteProbe, start_to_close_timeout=QUICK,
            retry_policy=CLUSTER_RETRY, summary=f"unreachable nodes and provider API at {self._site.name}",
        )
        now, s, inc = workflow.now().timestamp(), self._incident_settings, self.state.incident
        self.state.node_count = len(probe.nodes)
        counted = not self._returns or count_unreachable(inc.returned_at, now, s.control_plane)
        for node in probe.nodes:
            if counted and not node.ready and not node.unproven and not node.unschedulable:
                inc.failures = record(inc.failures, Failure(node=node.name, at=now, kind="unreachable",
                                                            detail="NotReady"), now, s)
        if probe.api_ok or probe.api_error_type != "Transient":
            inc.api_failing_since = None
        elif inc.api_failing_since is None:
            inc.api_failing_since = now
        self._evaluate()

    async def _start_evacuation(self) -> None:
        inc = self.state.incident
        inc.evacuate = False
        incident = inc.open
        site = self._site.name
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("incident")])
        self._show(f"provider incident: {incident.reason}; evacuating ({incident.id})")
        await workflow.execute_activity(
            "hold_site_repairs", HoldRepairsInput(site=site, hold=True), result_type=list[str],
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary=f"running repairs at {site}: finish the rung, then hold",
        )
        raw = {**self._args.evacuation, "site": site, "reason": incident.reason}

        async def evacuate() -> None:
            try:
                result: EvacuationResult = await workflow.execute_child_workflow(
                    "SiteEvacuation", raw, id=incident.id, result_type=EvacuationResult,
                    # Outlives the entity on purpose: a reset or terminated entity must not stop an
                    # evacuation halfway (traffic off, nodes draining); the next run finds it by id.
                    parent_close_policy=ParentClosePolicy.ABANDON,
                    static_summary=f"evacuate {site}: {incident.reason}",
                )
                incident.outcome = result.outcome
            except Exception as error:  # noqa: BLE001 - a failed evacuation closes the incident for a person
                incident.outcome = f"failed: {failure_message(error)}"
            incident.closed_at = workflow.now()
            inc.history = [*inc.history, incident][-10:]
            inc.failures = []
            inc.api_failing_since = None
            inc.open = None
            await workflow.execute_activity(
                "hold_site_repairs", HoldRepairsInput(site=site, hold=False), result_type=list[str],
                start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary=f"release held repairs at {site}",
            )
            self._evac = None
            self.state.wanted = True

        self._evac = asyncio.create_task(evacuate())

    def _show(self, line: str) -> None:
        s = self.state.status
        s.last = line
        ready = sum(state == "ready" for state in s.nodes.values())
        lines = [f"{len(s.nodes)} nodes ({ready} ready), min {s.min_nodes}, max {s.max_nodes}"]
        if s.filling:
            lines.append(f"filling: {s.filling}")
        lines += [f"- retiring {n}" for n in s.retiring]
        show_details(line, *lines)

    async def _reconcile(self) -> None:
        site, s = self._site, self.state.status
        nodes: list[SiteNode] = await workflow.execute_activity(
            "site_nodes", SiteNodesInput(site=site.name), result_type=list[SiteNode],
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary=f"nodes at {site.name}",
        )
        s.nodes = {n.node_name: ("ready" if n.ready and not n.unproven else "joining") for n in nodes}
        count = len(nodes)
        self.state.node_count = count
        if self.state.incident.open is not None:
            self._show(f"{count} nodes; incident {self.state.incident.open.id} open: no fill or retire")
            return
        if self._fill is not None:
            self._show(f"{count} nodes; filling")
            return
        if count < site.min_nodes:
            self._start_fill(site.min_nodes - count)
            self._show(f"below min ({count} < {site.min_nodes}): acquiring {site.min_nodes - count}")
        elif count > site.max_nodes:
            await self._retire(surplus_to_retire(nodes, count - site.max_nodes), count)
        else:
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("ok")])
            self._show(f"{count} nodes, within min/max")

    def _start_fill(self, need: int) -> None:
        site = self._site
        self.state.fills += 1
        fill_id = f"capacity/site-{site.name}-{self.state.fills}"
        request = {
            "count": need, "reason": f"site {site.name} below min",
            **self._args.fill_request,
            "constraints": {**self._args.fill_request.get("constraints", {}), "sites": [site.name]},
        }
        self.state.status.filling = fill_id
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("filling")])

        async def fill() -> None:
            try:
                result: CapacityResult = await workflow.execute_child_workflow(
                    "AcquireCapacity", request, id=fill_id, result_type=CapacityResult,
                    # Outlives the entity on purpose: the fill is what the site needs whatever
                    # happens to this run, and its joins clean up after themselves.
                    parent_close_policy=ParentClosePolicy.ABANDON,
                    static_summary=f"fill {site.name} to its min ({need} nodes)",
                )
                self.state.status.last = f"fill {fill_id}: {len(result.nodes)} of {need} joined"
            except Exception as error:  # noqa: BLE001 - a failed fill is retried by the next reconcile
                self.state.status.last = f"fill {fill_id} failed: {failure_message(error)}"
            finally:
                self.state.status.filling = ""
                self._fill = None
                self.state.wanted = True

        self._fill = asyncio.create_task(fill())

    async def _retire(self, surplus: list[SiteNode], count: int) -> None:
        site, s = self._site, self.state.status
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("retiring")])
        s.retiring = [n.node_name for n in surplus]
        self._show(f"above max ({count} > {site.max_nodes}): retiring {len(surplus)}")
        for node in surplus:
            outcome = await drain_and_retire(site.name, node.node_name, node.machine_id, self._args.drain_seconds,
                                             why="above the site's max")
            if outcome.retired:
                s.nodes[node.node_name] = "gone"
            else:
                s.last = f"{node.node_name}: {outcome.blocked or outcome.failed}; next reconcile"
        s.retiring = []
        self._show(f"retired surplus at {site.name}")


@workflow.defn(name="SiteSweep")
class SiteSweep:
    """Signal-with-start every site's entity with ``reconcile``."""

    @workflow.run
    async def run(self, raw: Any = None) -> list[str]:
        sites: list[str] = await workflow.execute_activity(
            "signal_sites", parse_input(SignalSitesInput, raw or {}), result_type=list[str], start_to_close_timeout=QUICK,
            retry_policy=STORE_RETRY, summary="reconcile every site",
        )
        show_details("done", detail=f"reconcile sent to {len(sites)} sites")
        return sites
