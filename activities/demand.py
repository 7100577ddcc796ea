"""The demand loop's activities: watch Pending GPU pods, plan, buy, look at idle nodes.

Thin: the planning and the consolidation choice are pure functions in ``fleet.demand_planner``
and ``fleet.consolidation`` (the pods' opt-in contract: ``fleet.demand``);
these read the cluster and Temporal and hand them what they need.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from datetime import datetime, timezone

from temporalio import activity
from temporalio.client import (
    Client, WorkflowExecution, WorkflowExecutionStatus, WorkflowQueryFailedError, WorkflowQueryRejectedError,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from activities.capacity import CapacityActivities, who_holds
from activities.env import FleetEnv
from activities.errors import typed_errors
from fleet.cluster import CORDONED_BY_DEMAND, LABEL_SITE, UNPROVEN_TAINT
from fleet.consolidation import IdleNode
from fleet.demand import gpus_counted, opted_in, site_labels
from fleet.errors import NotFound
from fleet.demand_planner import ModelUsage, NodeRoom, PlannedMachine, plan_demand
from fleet.messages.capacity import CapacityProgress, CapacityResult, GetCatalogInput
from fleet.messages.demand import (
    CancelOutcome,
    CancelPurchaseInput,
    DemandBatch,
    IdleNodesResult,
    JoiningMachine,
    PlanAndBuyInput,
    PlanAndBuyResult,
    PlanDemandInput,
    PlanDemandResult,
    Purchase,
    PurchaseState,
    PurchaseStatusInput,
    StartedPurchasesInput,
    StartPurchaseInput,
    WatchDemandInput,
    purchase_request,
    purchase_summary,
)
from fleet.messages.join import JoinProgress
from fleet.models import CapacityType
from fleet.naming import capacity_workflow_id, purchase_workflow_id, site_of_node_name
from fleet.placement import offer_key
from fleet.contracts import workflows as flows

#: NodeJoin steps before the provider is asked for a machine: cancelling then buys nothing.
BEFORE_PROVISIONING = ("starting", "resolving site")
#: The AcquireCapacity a SpotReclaim starts for its replacement (``workflows/reclaim.py``).
RECLAIM_REPLACEMENT_PREFIX = capacity_workflow_id("reclaim-")
#: A reclaim's replacement that has not chosen where to buy this long after it started is not
#: reading the catalog but failing to: the pods it would hold back are planned as any others.
REPLACEMENT_CHOOSES_WITHIN_SECONDS = 120
#: The memo key under which a purchase ``plan_and_buy`` started keeps what the loop follows it as.
PURCHASE_MEMO = "demand_purchase"
#: The catalog the loop plans on may be this old (a purchase reads its own again).
CATALOG_MAX_AGE_SECONDS = 60


def _status_name(status: WorkflowExecutionStatus | None) -> str:
    return status.name.lower().replace("_", "-") if status else "unknown"


def _already_ended(workflow_id: str, how: str) -> CancelOutcome:
    return CancelOutcome(cancelled=False, reason=f"{workflow_id} already ended ({how}): nothing to cancel")


async def _join_keeps(client: Client, join_id: str) -> str:
    """Why this join keeps its purchase (it is past provisioning, or cannot be asked), or ``""``
    when cancelling it buys nothing: it is before provisioning, not started yet, or ended."""
    join = client.get_workflow_handle(join_id)
    try:
        described = await join.describe()
        if described.status != WorkflowExecutionStatus.RUNNING:
            return ""
        step = (await join.query(flows.NodeJoin.progress, result_type=JoinProgress)).step
    except RPCError as error:
        if error.status == RPCStatusCode.NOT_FOUND:
            return ""  # the purchase is starting it: it has not asked for anything yet
        return f"could not be asked where it is ({error.message})"
    except (WorkflowQueryFailedError, WorkflowQueryRejectedError) as error:
        return f"could not be asked where it is ({error})"
    return "" if step in BEFORE_PROVISIONING else f"is past provisioning ({step})"


class DemandActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env

    def all(self) -> list:
        return [self.demand_settings, self.watch_demand, self.plan_demand, self.plan_and_buy, self.start_purchase,
                self.started_purchases, self.purchase_status, self.cancel_purchase, self.idle_nodes]

    @activity.defn
    def demand_settings(self) -> dict:
        """The config's ``demand:`` block (batch window, idle TTL, site fraction)."""
        return self.env.config.demand.model_dump(mode="json")

    # -- watching -----------------------------------------------------------------------------
    def _label_fleet_nodes(self) -> tuple[list, list[str]]:
        """The fleet's own labels on each of its nodes, from its config (``site_labels``):
        what a pod's selector matches and what the planner predicts a bought node carries.
        A join sets them as its node registers; kept here for nodes joined before it did, and put
        back where someone changed them."""
        sites = {s.name: s for s in self.env.config.sites}
        labelled = []
        nodes = self.env.nodes()
        for node in nodes:
            site = sites.get(node.labels.get(LABEL_SITE, ""))
            if site is None:
                continue
            wanted = site_labels(site)
            if any(node.labels.get(k) != v for k, v in wanted.items()):
                node.labels = self.env.cluster.label_node(node.name, wanted).labels
                labelled.append(node.name)
        return nodes, labelled

    def _pending(self) -> tuple[list[str], list[str]]:
        self._label_fleet_nodes()
        # A mirror pod is its node's own (any number, any name): never demand, never in the result.
        pods = [p for p in self.env.cluster.list_gpu_pods() if not p.mirror]
        pending = [p.key for p in pods if p.pending and opted_in(p) and not p.nominated_node]
        return pending, [p.key for p in pods]

    @activity.defn
    @typed_errors
    async def watch_demand(self, input: WatchDemandInput) -> DemandBatch:
        """Until opted-in Pending pods the loop has no answer for appear, then until the batch
        closes: ``batch_idle_seconds`` without another new pod, or ``batch_max_seconds``
        after the first (Karpenter's window). Gives up after ``wait_seconds``."""
        known = set(input.known)
        loop = asyncio.get_running_loop()
        start = loop.time()
        first = last = None
        seen: set[str] = set()
        present: list[str] = []
        while True:
            pending, present = await asyncio.to_thread(self._pending)
            new = {k for k in pending if k not in known}
            now = loop.time()
            if new - seen:
                first = first if first is not None else now
                last = now
                seen |= new
            seen &= new | known  # a pod that went before the batch closed is not in it
            if first is not None and (now - last >= input.batch_idle_seconds or now - first >= input.batch_max_seconds):
                return DemandBatch(new=sorted(seen), present=present, window_seconds=round(now - first, 3))
            if first is None and now - start >= input.wait_seconds:
                return DemandBatch(present=present)
            activity.heartbeat(len(seen))
            await asyncio.sleep(input.poll_seconds)

    # -- planning -----------------------------------------------------------------------------
    async def _reclaim_replacements(self, input: PlanDemandInput) -> list[NodeRoom]:
        """The machines SpotReclaims are buying right now, as joining rooms. A reclaim's
        evicted pods come back Pending while its replacement joins (or reads the catalog still);
        counted as joining, they wait for that machine instead of the loop buying a second one."""
        sites = {s.name: s for s in self.env.config.sites}
        offers = {f"{o.site}/{o.instance_type}": o for o in input.offers}
        client = activity.client()
        query = (f"WorkflowType = '{flows.AcquireCapacity.TYPE}' AND ExecutionStatus = 'Running' "
                 f"AND TaskQueue = '{activity.info().task_queue}' "
                 f"AND WorkflowId STARTS_WITH '{RECLAIM_REPLACEMENT_PREFIX}'")
        rooms = []
        async for found in client.list_workflows(query, limit=200):
            try:
                progress = await client.get_workflow_handle(found.id).query(flows.AcquireCapacity.progress, result_type=CapacityProgress)
            except RPCError:
                continue  # finished in between: its node, if any, is a node now
            wanted = max(0, progress.requested - progress.joined)
            # Before its first join (reading the catalog, waiting for capacity) the best
            # candidate is where it will buy.
            keys = progress.in_flight or [c.split(" ", 1)[0] for c in progress.candidates[:1]]
            if not keys and self._still_choosing(found, progress):
                # It has not read the catalog yet: the machine it replaces stands in, so the pods
                # that machine held (Pending again as the drain evicts them) wait for it rather than
                # buy beside it. The next plan, once it has chosen, counts where it buys.
                reclaimed = site_of_node_name(found.id.removeprefix(RECLAIM_REPLACEMENT_PREFIX))
                keys = [offer_key(reclaimed, sites[reclaimed].instance_type)] if reclaimed in sites else []
            for key in keys[:wanted]:
                site = sites.get(key.split("/", 1)[0])
                if site is None:
                    continue
                offer = offers.get(key)
                rooms.append(NodeRoom(name=found.id, site=site.name, labels=site_labels(site),
                                      gpus=offer.gpus if offer else site.gpus_per_machine, joining=True))
        return rooms

    @staticmethod
    def _still_choosing(found: WorkflowExecution, progress: CapacityProgress) -> bool:
        """A reclaim's replacement that has not chosen where to buy yet, and is young enough that
        it is reading the catalog rather than failing to (``REPLACEMENT_CHOOSES_WITHIN_SECONDS``)."""
        if progress.finished or progress.candidates or progress.attempts or progress.wait_until is not None:
            return False
        age = (datetime.now(timezone.utc) - found.start_time).total_seconds()
        return age <= REPLACEMENT_CHOOSES_WITHIN_SECONDS

    def _plan(self, input: PlanDemandInput, replacing: list[NodeRoom] | None = None) -> PlanDemandResult:
        config, cluster = self.env.config, self.env.cluster
        sites = {s.name: s for s in config.sites}
        nodes, labelled = self._label_fleet_nodes()
        pods = cluster.list_gpu_pods()
        used: dict[str, int] = defaultdict(int)
        usage: dict[str, ModelUsage] = defaultdict(ModelUsage)
        node_site = {n.name: sites.get(n.labels.get(LABEL_SITE, "")) for n in nodes}
        for pod, gpus in gpus_counted(pods, {n.name: n.gpus_allocatable for n in nodes}):
            used[pod.node] += gpus
            site = node_site.get(pod.node)
            # A mirror pod's label is its node's word: no model's spot share counts it.
            if pod.model and not pod.mirror and site is not None:
                held = usage[pod.model]
                if site.capacity_type == CapacityType.SPOT:
                    held.spot_gpus += gpus
                else:
                    held.other_gpus += gpus
        rooms = [
            # The fleet's own labels from the config over what the node carries: a kubelet may
            # write its GPU product or region itself, and no plan may believe it.
            NodeRoom(name=n.name, site=n.labels.get(LABEL_SITE, ""),
                     labels={**n.labels, **(site_labels(node_site[n.name]) if node_site.get(n.name) else {})},
                     taints=n.taints,
                     gpus=n.gpus_allocatable, gpus_used=used[n.name])
            for n in nodes
            # Ready and schedulable, or still being proven (it is on its way).
            if (n.ready and not n.unschedulable) or UNPROVEN_TAINT in n.taints
        ]
        for machine in input.joining:
            site = sites.get(machine.site)
            if site is None:
                continue
            rooms.append(NodeRoom(name=machine.purchase, site=machine.site, labels=site_labels(site),
                                  gpus=machine.gpus, joining=True))
            for model, gpus in machine.model_gpus.items():
                held = usage[model]
                if machine.capacity_type == CapacityType.SPOT:
                    held.spot_gpus += gpus
                else:
                    held.other_gpus += gpus
        rooms += replacing or []
        down: dict[str, str] = {}
        routes = cluster.get_site_routes()
        for name, route in (routes.sites.items() if routes else []):
            if route.incident or route.draining or not route.healthy:
                down[name] = route.incident or ("draining" if route.draining else "unhealthy")
        plan = plan_demand(
            pods, rooms, input.offers or [], config.sites, policies=config.models, usage=dict(usage),
            accounts=input.accounts, excluded=input.excluded, down=down,
        )
        # Rooms the plan counted at max_nodes include every node, cordoned or not.
        return PlanDemandResult(plan=plan, usage=dict(usage), down=down, labelled=labelled,
                                rooms=[r for r in rooms if r.joining])

    @activity.defn
    @typed_errors
    async def plan_demand(self, input: PlanDemandInput) -> PlanDemandResult:
        """Keep the fleet's labels on its nodes, list GPU pods, and plan (``fleet.demand_planner``):
        the loop's own purchases and SpotReclaims' replacements count as joining."""
        replacing = await self._reclaim_replacements(input)
        return await asyncio.to_thread(self._plan, input, replacing)

    @activity.defn
    @typed_errors
    async def plan_and_buy(self, input: PlanAndBuyInput) -> PlanAndBuyResult:
        """The loop's one step from new Pending pods to their purchases: read the catalog, plan as
        ``plan_demand``, and start each planned machine's ``AcquireCapacity``, numbered on from
        ``input.seq``. One activity where three ran one after the other (``get_catalog``,
        ``plan_demand``, ``start_purchase``): the pods wait on each one's round trip through the loop.

        The loop hears of the purchases only from this answer, so a step that failed after a start
        (Temporal away for the next one, the worker gone) must not buy again: each purchase carries
        what the loop follows it as in its memo, and the step first takes those an earlier try of it
        started under the numbers it would use as its own, named first in the answer (one still
        running counts as joining in the plan, so its pods buy nothing more)."""
        (earlier, taken), catalog = await asyncio.gather(
            self._started_earlier(input.seq, input.series),
            CapacityActivities(self.env).read_catalog(GetCatalogInput(max_age_seconds=CATALOG_MAX_AGE_SECONDS)))
        joining = [*input.joining, *(JoiningMachine(purchase=p.workflow_id, site=p.site, gpus=p.gpus,
                                                    capacity_type=p.capacity_type, model_gpus=p.model_gpus)
                                     for p, running in earlier if running)]
        planning = PlanDemandInput(offers=catalog.offers, accounts=catalog.accounts, joining=joining,
                                   excluded=input.excluded)
        replacing = await self._reclaim_replacements(planning)
        planned = await asyncio.to_thread(self._plan, planning, replacing)
        seq = input.seq + taken
        started: list[Purchase] = []
        for n, machine in enumerate(planned.plan.machines, start=1):
            # One after another, in number order: a start that fails ends the step with no number
            # after it started, so the next try's look (up to the first free number) finds every
            # purchase this one started. Side by side, a later number could start as an earlier one
            # failed: unseen behind that gap, its pods were planned and bought for again.
            started.append(await self._start(purchase_workflow_id(seq + n, input.series), machine, input))
        return PlanAndBuyResult(**dict(planned), purchases=[*(p for p, _ in earlier), *started],
                                seq=seq + len(started))

    @activity.defn
    async def started_purchases(self, input: StartedPurchasesInput) -> list[Purchase]:
        """The purchases still running that a ``plan_and_buy`` started under the numbers after
        ``input.seq`` (each as the loop follows it): what a step that failed after a start left, for
        a loop that will not plan again (cancelled) to stop."""
        earlier, _ = await self._started_earlier(input.seq, input.series)
        return [purchase for purchase, running in earlier if running]

    async def _started_earlier(self, seq: int, series: str) -> tuple[list[tuple[Purchase, bool]], int]:
        """The purchases under the numbers after ``seq`` that an earlier try of the step started
        (its memo says how the loop follows it), each with whether it still runs, and how many
        numbers are taken, up to the first free one (the step starts its numbers in order, so
        none it started lies past it). A number one of no step's runs under (an earlier loop's,
        from before purchases had a series) is skipped while it runs: never joined."""
        client = activity.client()
        found: list[tuple[Purchase, bool]] = []
        taken = 0
        while True:
            workflow_id = purchase_workflow_id(seq + taken + 1, series)
            try:
                described = await client.get_workflow_handle(workflow_id).describe()
            except RPCError as error:
                if error.status == RPCStatusCode.NOT_FOUND:
                    return found, taken
                raise
            running = described.status == WorkflowExecutionStatus.RUNNING
            purchase = await described.memo_value(PURCHASE_MEMO, None, type_hint=Purchase)
            if purchase is None and not running:
                return found, taken  # ended, of no step's: its number is free (a start makes a new run)
            taken += 1
            if purchase is not None:
                found.append((purchase, running))

    async def _start(self, workflow_id: str, machine: PlannedMachine, input: PlanAndBuyInput) -> Purchase:
        purchase = Purchase.of(machine, workflow_id, started_at=time.time())
        await activity.client().start_workflow(
            flows.AcquireCapacity.TYPE, purchase_request(machine, input.deadline_seconds, input.capacity_request),
            id=workflow_id, task_queue=activity.info().task_queue, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            static_summary=purchase_summary(machine)[:400], memo={PURCHASE_MEMO: purchase},
            # Its first workflow task comes back in the start's answer, to this worker (it runs
            # AcquireCapacity on this queue), rather than through the queue's matching: the pods wait
            # on it. A server that does not start eagerly starts it as usual.
            request_eager_start=True,
        )
        return purchase

    # -- buying -------------------------------------------------------------------------------
    @activity.defn
    async def start_purchase(self, input: StartPurchaseInput) -> str:
        """Start the purchase's AcquireCapacity (a retried start finds the one it started)."""
        handle = await activity.client().start_workflow(
            flows.AcquireCapacity.TYPE, input.request, id=input.workflow_id, task_queue=activity.info().task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING, static_summary=input.summary[:400],
        )
        return handle.id

    @activity.defn
    async def purchase_status(self, input: PurchaseStatusInput) -> list[PurchaseState]:
        client = activity.client()
        found = []
        for workflow_id in input.workflow_ids:
            handle = client.get_workflow_handle(workflow_id)
            try:
                described = await handle.describe()
            except RPCError as error:
                if error.status != RPCStatusCode.NOT_FOUND:
                    raise  # Temporal did not answer: retried, never taken for a purchase that is gone
                found.append(PurchaseState(workflow_id=workflow_id, status="missing"))
                continue
            status = described.status
            if status == WorkflowExecutionStatus.RUNNING:
                found.append(PurchaseState(workflow_id=workflow_id, status="running"))
            elif status == WorkflowExecutionStatus.COMPLETED:
                result = CapacityResult.model_validate(await handle.result())
                found.append(PurchaseState(workflow_id=workflow_id, status="completed" if result.complete else "failed",
                                           nodes=[n.node_name for n in result.nodes], why=result.why[:5]))
            else:
                name = status.name.lower().replace("_", "-") if status else "missing"
                found.append(PurchaseState(workflow_id=workflow_id, status=name))
        return found

    @activity.defn
    async def cancel_purchase(self, input: CancelPurchaseInput) -> CancelOutcome:
        """Cancel a purchase whose pods all went, unless one of its joins already asked the
        provider for a machine (then the node comes, and consolidation gives it back once idle).
        The loop asks again at each pass while a purchase it kept runs: one kept because it could not
        be asked, or whose join failed and that buys on, is cancelled once nothing of it is past provisioning.

        The purchase itself says which joins it runs (its ``progress`` query): a purchase may run
        several, numbered on, each at whichever site it chose. A join that already ended does not
        keep it (a joined node stays whatever the cancel does, a failed join deleted its machine).
        Whatever cannot be asked keeps the purchase: a wrong cancel deletes a machine being paid for."""
        client = activity.client()
        purchase = client.get_workflow_handle(input.workflow_id)
        try:
            described = await purchase.describe()
            if described.status != WorkflowExecutionStatus.RUNNING:
                return _already_ended(input.workflow_id, _status_name(described.status))
            progress = await purchase.query(flows.AcquireCapacity.progress, result_type=CapacityProgress)
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                return _already_ended(input.workflow_id, "not found")
            return CancelOutcome(cancelled=False, reason=f"could not ask {input.workflow_id} which joins it runs "
                                                         f"({error.message}): kept")
        except (WorkflowQueryFailedError, WorkflowQueryRejectedError) as error:
            return CancelOutcome(cancelled=False, reason=f"could not ask {input.workflow_id} which joins it runs "
                                                         f"({error}): kept")
        if progress.finished:
            return _already_ended(input.workflow_id, progress.step)
        # ``in_flight`` names the offers of ``joins``, in the same order.
        offers = progress.in_flight if len(progress.in_flight) == len(progress.joins) else [""] * len(progress.joins)
        for join_id, offer in zip(progress.joins, offers):
            keeps = await _join_keeps(client, join_id)
            if keeps:
                at = f" ({offer})" if offer else ""
                return CancelOutcome(cancelled=False, reason=f"its join {join_id}{at} {keeps}: kept")
        try:
            await purchase.cancel()
        except RPCError as error:
            return CancelOutcome(cancelled=False, reason=f"cancel failed: {error.message}")
        return CancelOutcome(cancelled=True, reason=input.reason)

    # -- consolidation ------------------------------------------------------------------------
    def _idle(self) -> IdleNodesResult:
        config, cluster = self.env.config, self.env.cluster
        sites = {s.name: s for s in config.sites}
        every_node = self.env.nodes()
        nodes = [n for n in every_node if n.labels.get(LABEL_SITE) in sites]
        pods = cluster.list_gpu_pods()
        # A mirror pod is its node's word: a static pod asking for a GPU keeps no node (and its bill) on.
        busy = {p.node for p in pods if p.node and not p.mirror}
        awaited = {p.nominated_node for p in pods if p.nominated_node}
        result = IdleNodesResult(site_min={s.name: s.min_nodes for s in config.sites})
        for node in nodes:
            site = node.labels[LABEL_SITE]
            result.site_nodes[site] = result.site_nodes.get(site, 0) + 1
            if node.unschedulable:
                result.cordoned.append(node.name)
                self._who_holds(node.name, result)
            if node.name in busy or UNPROVEN_TAINT in node.taints or not node.ready or node.gpus_allocatable <= 0:
                continue
            result.idle.append(IdleNode(
                name=node.name, site=site, machine_id=node.machine_id, price_per_gpu_hour=sites[site].price_per_gpu_hour,
                gpus=node.gpus_allocatable, awaited=node.name in awaited, idle_since=time.time(),
            ))
        # Warm headroom: the share of each model's GPUs in use kept spare at its first primary.
        in_use: dict[str, int] = defaultdict(int)
        for pod, gpus in gpus_counted(pods, {n.name: n.gpus_allocatable for n in every_node}):
            if pod.model and not pod.mirror:  # a mirror pod's label is its node's word
                in_use[pod.model] += gpus
        for model, policy in config.models.items():
            if policy.warm_headroom > 0 and policy.sites and in_use.get(model):
                site = policy.sites[0]
                result.keep_warm[site] = result.keep_warm.get(site, 0) + math.ceil(policy.warm_headroom * in_use[model])
        return result

    def _who_holds(self, name: str, result: IdleNodesResult) -> None:
        """A cordoned node's marks: the loop's own cordon (``CORDONED_BY_DEMAND``), or who holds it
        now (``activities.capacity.who_holds``)."""
        try:
            held, by = who_holds(self.env.cluster, name, CORDONED_BY_DEMAND)
        except NotFound:
            return  # gone since the list: nothing to hold
        if held:
            result.held[name] = held
        elif by == CORDONED_BY_DEMAND:
            result.own_cordon.append(name)

    @activity.defn
    @typed_errors
    async def idle_nodes(self) -> IdleNodesResult:
        """Fleet GPU nodes with no GPU pod on them, and what consolidation must respect."""
        return await asyncio.to_thread(self._idle)
