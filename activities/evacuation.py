"""Provider-incident activities: repair admission through the Site entity, the
site probe, holding repairs, routing weights, serving moves, recovery. Each is
thin and idempotent under retries.
"""

from __future__ import annotations

import asyncio
import json

from temporalio import activity
from temporalio.client import WithStartWorkflowOperation, WorkflowExecutionStatus, WorkflowQueryFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.capacity import is_running, number_past_record, run_end
from activities.claims import CLAIM_HOLDER, take_claim
from activities.env import FleetEnv
from activities.errors import typed_errors
from fleet.config import Site
from fleet.errors import FleetError, Transient
from fleet.incident import IncidentSettings, SiteFacts, incident_of_hold, plan_moves, recovery, weight_at
from fleet.naming import evacuation_number, evacuation_workflow_id, is_evacuation_of, site_workflow_id
from providers.cluster.base import NodeMarks, NodeNotFound, decide_on_node, free_gpus_at
from fleet.cluster import ANNOTATION_CORDONED_BY, LABEL_SITE, UNPROVEN_TAINT, ServingStatus, SiteRoute, fenced_gpus
from fleet.messages.capacity import ChildNumber, ChildNumberInput
from fleet.messages.evacuation import (
    AdmitRepairInput,
    ClosedEvacuationsInput,
    EvacuationFacts,
    EvacuationLeftovers,
    EvacuationRef,
    EvacuationResult,
    FreeGpusInput,
    HoldRepairsInput,
    PUT_BACK_KEPT,
    ProbeNode,
    RecoveryProbe,
    RepairDecision,
    ScaleInput,
    SiteProbe,
    SiteRef,
    SiteWeightInput,
    SiteWeightResult,
    ReleaseNodesInput,
    ReleaseNodesResult,
)
from fleet.messages.repair import LadderState
from fleet.contracts import workflows as flows


def site_facts(site: Site) -> SiteFacts:
    return SiteFacts(name=site.name, geography=site.geography, compliance=site.compliance,
                     gpus_per_machine=site.gpus_per_machine, price_per_gpu_hour=site.price_per_gpu_hour,
                     max_nodes=site.max_nodes)



def provider_api_answers(env: FleetEnv, site: str) -> tuple[bool, str, str]:
    """(answers, error type, message) of the site's provider API, asked with one cheap list:
    what an incident's rule reads, from a probe or a watch."""
    try:
        env.provider(site).list_machines()
        return True, "", ""
    except FleetError as error:
        return False, error.type_name, str(error)
    except Exception as error:  # noqa: BLE001 - an SDK error nobody classified is Transient
        return False, Transient.__name__, str(error)

async def _running_repairs(client, site: str):
    """(workflow id, handle, ladder) of each GpuRepair running at ``site``; one that finished
    between the list and its query is left out."""
    query = f'WorkflowType = "{flows.GpuRepair.TYPE}" AND Site = "{site}" AND ExecutionStatus = "Running"'
    async for wf in client.list_workflows(query):
        handle = client.get_workflow_handle(wf.id, run_id=wf.run_id)
        try:
            ladder = await handle.query(flows.GpuRepair.ladder, result_type=LadderState)
        except Exception as error:  # noqa: BLE001 - finished meanwhile
            activity.logger.info("%s: no ladder to read (%s)", wf.id, error)
            continue
        yield wf.id, handle, ladder


#: Which SiteEvacuation acts at a site: state ``evacuation-claim``/<site> names it (``CLAIM_HOLDER``).
EVACUATION_CLAIM_KIND = "evacuation-claim"
#: The same record's evacuations of the site whose leftovers the Site entity put back (a JSON list of
#: ids, newest last, ``PUT_BACK_KEPT`` at most): kept beside the claim, which outlives the entity's
#: runs and is backed up, so that a Site entity started again does not put one back a second time.
CLAIM_PUT_BACK = "put-back"


def put_back_recorded(claim: dict[str, str]) -> list[str]:
    """The evacuations the claim record says were put back, oldest first; none where the record is
    unreadable (edited by hand): at worst one is put back again, as before the record."""
    try:
        ids = json.loads(claim.get(CLAIM_PUT_BACK, "[]"))
    except ValueError:
        return []
    return [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []


class EvacuationActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env

    def all(self) -> list:
        return [
            self.admit_repair, self.incident_settings, self.incident_probe, self.hold_site_repairs,
            self.release_orphaned_holds, self.incident_number,
            self.evacuation_begun_first, self.evacuation_end, self.evacuation_leftovers, self.evacuation_put_back,
            self.closed_evacuations,
            self.evacuation_facts, self.set_site_weight, self.free_gpus, self.scale_serving,
            self.release_nodes,
        ]

    # -- the Site entity's side ---------------------------------------------------------------
    @activity.defn
    async def admit_repair(self, input: AdmitRepairInput) -> RepairDecision:
        """Ask ``site/<site>`` (started if needed) whether this GPU may be repaired now."""
        client = activity.client()
        start = WithStartWorkflowOperation(
            "Site", {"site": input.site}, id=site_workflow_id(input.site), task_queue=activity.info().task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            static_summary=f"site {input.site}: min/max reconcile, incidents",
        )
        asking = asyncio.ensure_future(client.execute_update_with_start_workflow(
            flows.Site.admit_repair, input, start_workflow_operation=start, result_type=RepairDecision,
        ))
        # The Site entity may hold the answer for its settle window: heartbeat meanwhile, so a
        # worker lost mid-question is noticed in seconds, not at the start-to-close timeout.
        while True:
            done, _ = await asyncio.wait({asking}, timeout=2.0)
            if done:
                return asking.result()
            activity.heartbeat()

    @activity.defn
    @typed_errors
    def incident_settings(self, input: SiteRef) -> IncidentSettings:
        return self.env.config.incident_for(self.env.site(input.site))

    def _nodes(self, site: str) -> list[ProbeNode]:
        return [
            ProbeNode(name=n.name, ready=n.ready, unproven=UNPROVEN_TAINT in n.taints or not n.labels.get(LABEL_SITE),
                      unschedulable=n.unschedulable, machine_id=n.machine_id)
            for n in self.env.cluster.list_nodes({LABEL_SITE: site})
        ]

    def _api(self, site: str) -> tuple[bool, str, str]:
        return provider_api_answers(self.env, site)

    @activity.defn
    @typed_errors
    def incident_probe(self, input: SiteRef) -> SiteProbe:
        """The site's nodes (ready, cordoned) and whether its provider API answers."""
        ok, kind, message = self._api(input.site)
        return SiteProbe(nodes=self._nodes(input.site), api_ok=ok, api_error_type=kind, api_error=message)

    @activity.defn
    async def hold_site_repairs(self, input: HoldRepairsInput) -> list[str]:
        """Hold every running GpuRepair at the site with ``input.reason`` (a held ladder finishes
        its current rung, then waits contained), or release the ones held with that reason.
        A repair someone else holds, for a reason of theirs, is theirs: not held again, not
        released. Returns the repairs held (or released). Run again, it does nothing twice."""
        reached = []
        async for repair_id, handle, ladder in _running_repairs(activity.client(), input.site):
            ours = ladder.held and ladder.hold_reason == input.reason
            if ladder.done or (ladder.held and not ours) or (not input.hold and not ours):
                continue  # over, someone else's hold, or (releasing) not held: nothing to do
            if input.hold and ours:
                reached.append(repair_id)  # held by an earlier attempt: not held twice
                continue
            try:
                update = flows.GpuRepair.hold if input.hold else flows.GpuRepair.release
                await handle.execute_update(update, {"reason": input.reason})
            except Exception as error:  # noqa: BLE001 - finished meanwhile: nothing to hold or release
                activity.logger.info("%s not %s: %s", repair_id, "held" if input.hold else "released", error)
                continue
            reached.append(repair_id)
        return reached

    @activity.defn
    async def release_orphaned_holds(self, input: SiteRef) -> list[str]:
        """Release every running GpuRepair at the site held for a provider incident of its Site
        entity whose evacuation is no longer running: an entity reset (or terminated and started
        again) mid-incident forgot the hold, so nothing else would ever release it. A hold of an
        operator's, or of an evacuation still running, stays. Returns the repairs released."""
        client = activity.client()
        released = []
        async for repair_id, handle, ladder in _running_repairs(client, input.site):
            incident = incident_of_hold(input.site, ladder.hold_reason) if ladder.held else None
            if incident is None or await is_running(client, incident):
                continue
            try:
                await handle.execute_update(flows.GpuRepair.release, {"reason": ladder.hold_reason})
            except Exception as error:  # noqa: BLE001 - finished meanwhile: nothing to release
                activity.logger.info("%s not released: %s", repair_id, error)
                continue
            released.append(repair_id)
        return released

    @activity.defn
    async def evacuation_leftovers(self, input: EvacuationRef) -> EvacuationLeftovers:
        """What the closed evacuation ``input.workflow_id`` of ``input.site`` changed and did not put
        back (its ``leftovers`` query, which replays its history): nothing for one still running (it
        puts back itself) or gone from Temporal's record. One whose history no longer replays (closed
        before a patch was removed) cannot say: that fails this, for good, naming it."""
        if not is_evacuation_of(input.site, input.workflow_id):
            raise ApplicationError(f"workflow_id: {input.workflow_id[:200]!r} is no evacuation of {input.site}",
                                   type="InvalidInput", non_retryable=True)
        handle = activity.client().get_workflow_handle(input.workflow_id)
        try:
            if (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
                return EvacuationLeftovers(site=input.site, running=True, note="still running")
            left = await handle.query(flows.SiteEvacuation.leftovers, result_type=EvacuationLeftovers)
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            return EvacuationLeftovers(site=input.site, note="no longer on record")
        except WorkflowQueryFailedError as error:
            raise ApplicationError(f"{input.workflow_id}: what it left could not be read ({error})"[:500],
                                   type="QueryFailed", non_retryable=True) from None
        if left.site != input.site:  # its own input named another site: not this site's to put back
            return EvacuationLeftovers(site=input.site, note=f"an evacuation of {left.site[:100]}")
        return left

    @activity.defn
    @typed_errors
    def evacuation_put_back(self, input: EvacuationRef) -> None:
        """Record, with the site's evacuation claim, that the Site entity put back what the closed
        evacuation ``input.workflow_id`` left (or found nothing to): ``closed_evacuations`` leaves it out
        from then on, whichever run of the entity looks. The newest ``PUT_BACK_KEPT`` are kept; the
        claim's holder is left as it is. Run again, it changes nothing."""
        if not is_evacuation_of(input.site, input.workflow_id):
            raise ApplicationError(f"workflow_id: {input.workflow_id[:200]!r} is no evacuation of {input.site}",
                                   type="InvalidInput", non_retryable=True)

        def add(data: dict[str, str]) -> dict[str, str]:
            kept = [i for i in put_back_recorded(data) if i != input.workflow_id]
            ids = [*kept, input.workflow_id][-PUT_BACK_KEPT:]
            return {**data, CLAIM_PUT_BACK: json.dumps(ids)}

        self.env.cluster.update_state(EVACUATION_CLAIM_KIND, input.site, add)

    @activity.defn
    @typed_errors
    async def closed_evacuations(self, input: ClosedEvacuationsInput) -> list[str]:
        """The site's evacuations no longer running that left something behind for all to see: a
        cordon marked theirs (``fleet.cluster.ANNOTATION_CORDONED_BY``) on a node of the site, or the
        site's entry in the routing document still naming them. What the Site entity's safety look
        asks ``evacuation_leftovers`` of; and those whose put-back the entity began and did not finish
        (``input.unfinished``: its last steps leave neither). A node's own annotations name at most one
        id each, and only ids of this site's evacuations count (at most ten looked at), none the entity
        put back already (``input.put_back``, and the claim's record of them: ``evacuation_put_back``). None at all
        while an evacuation of the site runs (the holder of its ``evacuation-claim``, or one Temporal's
        visibility lists: begun, not yet claimed): it took over
        what they left as it began (``EvacuationFacts.left``) and puts back what it changed as it ends;
        a put-back meanwhile would route to the site and scale it up under it."""
        site, cluster, client = input.site, self.env.cluster, activity.client()
        claim = await asyncio.to_thread(cluster.read_state, EVACUATION_CLAIM_KIND, site)
        if claim.get(CLAIM_HOLDER) and await is_running(client, claim[CLAIM_HOLDER]):
            return []
        running = f'WorkflowType = "{flows.SiteEvacuation.TYPE}" AND Site = "{site}" AND ExecutionStatus = "Running"'
        async for _ in client.list_workflows(running, limit=1):
            return []
        return await self._closed(site, set(input.put_back), claim, set(input.unfinished))

    async def _closed(self, site: str, put_back: set[str] = frozenset(), claim: dict[str, str] | None = None,
                      unfinished: set[str] = frozenset()) -> list[str]:
        """``closed_evacuations``, whoever acts at the site, with ``unfinished``, less ``put_back`` and
        those the site's evacuation ``claim`` (read here when not given) records as put back."""
        cluster, client = self.env.cluster, activity.client()
        if claim is None:
            claim = await asyncio.to_thread(cluster.read_state, EVACUATION_CLAIM_KIND, site)
        found: set[str] = {workflow_id for workflow_id in unfinished if is_evacuation_of(site, workflow_id)}
        doc = await asyncio.to_thread(cluster.get_site_routes)
        route = doc.sites.get(site) if doc else None
        if route is not None and is_evacuation_of(site, route.incident):
            found.add(route.incident)
        for node in await asyncio.to_thread(cluster.list_nodes, {LABEL_SITE: site}):
            if not node.unschedulable:
                continue
            try:
                marks = await asyncio.to_thread(cluster.node_marks, node.name)
            except NodeNotFound:
                continue  # gone since the list
            mark = marks.annotations.get(ANNOTATION_CORDONED_BY, "")
            if is_evacuation_of(site, mark):
                found.add(mark)
        found -= put_back | set(put_back_recorded(claim))
        return [workflow_id for workflow_id in sorted(found)[:10] if not await is_running(client, workflow_id)]

    async def _left_by_closed(self, site: str) -> dict[str, EvacuationLeftovers]:
        """What the site's evacuations no longer running changed and did not put back, by id
        (``EvacuationFacts.left``). One that cannot say (its history no longer replays), or a look
        that fails, is left out: the Site entity's put-back is then its way back, as before."""
        try:
            closed = await self._closed(site)
        except (FleetError, RPCError) as error:
            activity.logger.warning("site %s: evacuations' leftovers not looked for (%s)", site, error)
            return {}
        left = {}
        for workflow_id in closed:
            try:
                found = await self.evacuation_leftovers(EvacuationRef(site=site, workflow_id=workflow_id))
            except (ApplicationError, RPCError) as error:
                activity.logger.warning("%s: what it left not read (%s)", workflow_id, error)
                continue
            if not found.put_back:
                left[workflow_id] = found
        return left

    @activity.defn
    async def incident_number(self, input: ChildNumberInput) -> ChildNumber:
        """The number of the site's next Site-entity incident, ``input.at_least`` or more: one no
        ``evacuate/<site>/<n>`` on record has (a second run there hid the first from `gpufleet
        evacuate` and the progress reads), or that of one still running (to adopt as its open
        incident). A person's ``manual-<request>`` evacuations are not the entity's: never counted."""
        site = input.site
        return await number_past_record(flows.SiteEvacuation.TYPE, site, lambda n: evacuation_workflow_id(site, n),
                                        lambda workflow_id: evacuation_number(site, workflow_id), input.at_least)

    # -- SiteEvacuation -----------------------------------------------------------------------
    @activity.defn
    @typed_errors
    async def evacuation_begun_first(self, input: EvacuationRef) -> str:
        """The SiteEvacuation that acts at ``input.site``, when that is not ``input.workflow_id``;
        "" when this one acts. One record per site names the one acting, taken by compare-and-swap
        in the cluster's state store: the first to take it acts, and one that finds it held by an
        evacuation still running follows that one; a holder that ended is replaced. (Temporal's
        visibility, asked before, is eventually consistent: two evacuations started within its lag,
        such as a person's beside the Site entity's at the same outage, each listed none and both
        acted.)"""
        return await take_claim(activity.client(), self.env.cluster, EVACUATION_CLAIM_KIND, input.site,
                                input.workflow_id)

    @activity.defn
    async def evacuation_end(self, input: EvacuationRef) -> str:
        """Wait for ``input.workflow_id`` to end (through its continue-as-new runs): its outcome,
        or how it closed ("failed: …", "terminated"). Heartbeats while it waits."""
        result, how = await run_end(input.workflow_id, EvacuationResult)
        return result.outcome if result is not None else how

    @activity.defn
    @typed_errors
    async def evacuation_facts(self, input: SiteRef) -> EvacuationFacts:
        facts = await asyncio.to_thread(self._facts, input.site)
        facts.left = await self._left_by_closed(input.site)
        return facts

    def _facts(self, name: str, whole: bool = True) -> EvacuationFacts:
        """``evacuation_facts``; not ``whole``: without the models' routes and the site's nodes, which
        planning does not read."""
        site = self._known_site(name)
        cluster = self.env.cluster
        serving = cluster.list_serving()
        here = [s for s in serving if s.site == site.name]
        models = sorted({s.model for s in here})
        return EvacuationFacts(
            site=site_facts(site), sites=[site_facts(s) for s in self.env.config.sites],
            settings=self.env.config.incident_for(site), here=here,
            elsewhere=[s for s in serving if s.site != site.name and s.model in models],
            site_routes=cluster.get_site_routes(),
            model_routes={m: cluster.get_routing(m) for m in models} if whole else {},
            nodes=self._nodes(site.name) if whole else [],
        )

    def unplaceable(self, site: str) -> list[str]:
        """The models at ``site`` whose replicas nothing may take now (``Plan.impossible``, planned
        from the facts as the evacuation plans): what holds an evacuation in its needs-person wait."""
        return sorted(plan_moves(self._facts(site, whole=False).deficits(site), {}).impossible)

    def _known_site(self, name: str) -> Site:
        """The site, or the evacuation's bad input: an unknown site is the caller's mistake (never
        retried), named first so that the workflow's failure reads as it (the workflow raises this
        message at its top)."""
        try:
            return self.env.config.site(name)
        except KeyError:
            known = [s.name for s in self.env.config.sites]
            raise ApplicationError(f"site: unknown site {name!r}; known: {', '.join(known)}",
                                   {"fields": ["site"], "known": known}, type="InvalidInput",
                                   non_retryable=True) from None

    @activity.defn
    @typed_errors
    def set_site_weight(self, input: SiteWeightInput) -> SiteWeightResult:
        """The evacuation's decision for the site (``percent`` of its weight, healthy/draining/
        incident) in the fleet-wide site document, one atomic write. The models' routes are
        not written here: each model's Routing entity reads this document in its sample and
        is the one writer of those (the evacuation tells it through ``routing_event``).
        ``weights``: the ceiling each model's weight at the site is now under."""
        cluster = self.env.cluster
        result = SiteWeightResult(site_routes_version=0)
        route = dict(healthy=input.healthy, draining=input.draining, incident=input.incident)
        for model, original in sorted(input.original_models.items()):
            result.weights[model] = weight_at(original, input.percent)
        doc = cluster.get_site_routes()
        sites = dict(doc.sites) if doc else {}
        for name in input.all_sites:
            sites.setdefault(name, SiteRoute(weight=100))
        sites[input.site] = SiteRoute(weight=weight_at(input.original_site, input.percent), **route)
        result.site_routes_version = cluster.set_site_routes(sites).version
        return result

    @activity.defn
    @typed_errors
    def free_gpus(self, input: FreeGpusInput) -> dict[str, int]:
        """GPUs at each site neither a serving Deployment nor another pod (a training job) holds
        or asks for, on ready, schedulable nodes (``providers.cluster.base.free_gpus_at``)."""
        cluster = self.env.cluster
        nodes, serving, pods = self.env.nodes(), cluster.list_serving(), cluster.list_gpu_pods()
        return {site: free_gpus_at(nodes, serving, pods, site) for site in input.sites}

    @activity.defn
    @typed_errors
    def scale_serving(self, input: ScaleInput) -> ServingStatus:
        return self.env.cluster.scale_serving(input.model, input.site, input.replicas)

    @activity.defn
    @typed_errors
    def release_nodes(self, input: ReleaseNodesInput) -> ReleaseNodesResult:
        """Uncordon the nodes an evacuation cordoned, except one someone took since: a repair that
        fenced a GPU of it (the repair uncordons it when done), or a person or another owner who marked
        the cordon theirs (``ANNOTATION_CORDONED_BY``; the evacuation's drain marked it with its id, the
        calling workflow's). ``keep_cordoned`` (cordoned before it began) stay as they are, but for one
        whose cordon is marked with the id of an evacuation it took over (``adopted``): that cordon is
        its own now. Returns each node's outcome, with why a held one stays cordoned."""
        cluster, out = self.env.cluster, ReleaseNodesResult()
        ours = {activity.info().workflow_id, *input.adopted}
        before = set(input.keep_cordoned)

        def release(name: str, marks: NodeMarks) -> None:
            fenced = fenced_gpus(marks.annotations)
            by = marks.annotations.get(ANNOTATION_CORDONED_BY, "")
            if fenced:
                out.held[name] = (f"GPU {', '.join(fenced)} fenced by its repair (its Node entity uncordons "
                                  f"it when the GPU is healthy)")
            elif name in before and by not in ours:
                out.held[name] = "cordoned before the evacuation began (left as it was found)"
            elif by and by not in ours:
                # Bounded: the node's own annotation, said in the evacuation's outcome.
                out.held[name] = (f"cordoned by {by[:40]!r} ({ANNOTATION_CORDONED_BY}): the cordon is no "
                                  "longer the evacuation's, left as it is")
            else:
                if marks.unschedulable:
                    # On the marks read: a repair's fence or a person's mark since refuses it, and is seen.
                    cluster.cordon(name, False, version=marks.version)
                out.uncordoned.append(name)

        for name in [*input.nodes, *input.keep_cordoned]:
            try:
                decide_on_node(cluster, name, lambda marks: release(name, marks))
            except NodeNotFound:
                out.gone.append(name)
        return out

    def recovery_verdict(self, site: str) -> RecoveryProbe:
        """The site's provider API and nodes, judged by ``fleet.incident.recovery`` (each look of
        ``watch_recovery``). A cluster API that does not answer is an answer too: not recovered
        yet. Raised, it failed the watch after its attempts (a few minutes of API-server trouble),
        that failed the evacuation, and the evacuation's undo sent traffic back to the site that was
        still down."""
        ok, kind, message = self._api(site)
        try:
            nodes = {} if not ok else {n.name: n.ready for n in self._nodes(site)}
        except Transient as error:
            return RecoveryProbe(recovered=False, detail=f"the cluster API did not answer: {error}"[:500])
        verdict = recovery(None if ok else f"{kind}: {message}", nodes)
        return RecoveryProbe(recovered=verdict.recovered, detail=verdict.detail)

