"""Every activity the workflows schedule: its name, input and result types, declared once.

Workflows call these by reference (``workflow.execute_activity(act.watch_node, ...)``): the
SDK takes the name from the declaration and the result type from its annotation, an editor
goes from the call to here, and a type checker checks the input. The bodies live in
``activities/`` (the control-plane worker) and ``activities/node_agent.py`` (the node agent),
registered under the same names; ``tests/test_registration.py`` checks that every declaration
here has exactly one registered body with the same input and result types. Declared here,
in ``fleet``, so a workflow never imports the activity code (and the providers behind it).
"""

from __future__ import annotations

from temporalio import activity
from temporalio.common import RawValue

from fleet.cluster import DrainResult, ServingStatus
from fleet.config import Site
from fleet.incident import IncidentSettings
from fleet.messages.advisor import Usage
from fleet.messages.capacity import (
    AccountConfigInput, AccountInput, AccountRecordInput, CapacityResult, Catalog, ChildNumber, ChildNumberInput,
    DrainNodeInput, FillRef, GetCatalogInput, NotifyInput, QueuedDeletes, QueuedDeletesInput, ReleaseCordonsInput, ReportAccountInput,
    RetireMachineInput, SignalSitesInput, SiteNode, SiteNodesInput, WakeRequestsInput,
)
from fleet.messages.csr import CsrApproverResult
from fleet.messages.demand import (
    CancelOutcome, CancelPurchaseInput, DemandBatch, IdleNodesResult, PlanAndBuyInput, PlanAndBuyResult,
    PlanDemandInput, PlanDemandResult, Purchase, PurchaseState, PurchaseStatusInput, StartedPurchasesInput,
    StartPurchaseInput, WatchDemandInput,
)
from fleet.contracts.entity_update import EntityUpdateInput, EntityUpdateResult
from fleet.messages.evacuation import (
    AdmitRepairInput, ClosedEvacuationsInput, EvacuationFacts, EvacuationLeftovers, EvacuationRef, FreeGpusInput,
    HoldRepairsInput, ReleaseNodesInput, ReleaseNodesResult, RepairDecision, ScaleInput, SiteProbe, SiteRef,
    SiteWeightInput, SiteWeightResult,
)
from fleet.messages.nodes import (
    AdmitNodeInput, AwaitRegistrationInput, ContainInput, ContainResult, DeleteMachineInput,
    FenceInput, GpuProbeResult, NodeEntitiesStarted, NodeFacts, NodeFactsInput,
    ProbeGpusInput, ProvisionJoinInput,
    ProvisionedMachine, ReinstallDriverInput, ReleaseProvisionInput, RemoveNodeInput,
    ReplacementSitesInput, ResetGpuInput, ResolveSiteInput, RestartMachineInput,
    RevokeNodeTokensInput, SiteConfigured, SiteHealth, SiteHealthInput, SmokeResult,
    SmokeTestInput, StoppedSpotReclaims, UncontainInput, UncontainResult, WaitForBootInput,
)
from fleet.messages.repair import GpuRepairResult, NodeLeft, NodeWatchInput, NodeWatchResult, RepairRef
from fleet.messages.rollout import (
    AbortUploadsInput, AbortedUploads, EvacuationInput, EvacuationWaitInput, ProbeServingInput, ReplicateInput,
    ReplicateResult, ResolveRolloutSitesInput, RollbackSiteInput, RolloutSites, ServingRef, UpdateServingInput,
    WaitServingInput,
)
from fleet.messages.routing import (
    RoutingModelInput, RoutingSample, RoutingSampleInput, RoutingWatchInput, RoutingWatchResult, SiteEventInput,
)
from fleet.messages.sweep import (
    IdentitySweepReport, SiteSweepReport, SweepIdentitiesInput, SweepKnown, SweepSiteInput,
)
from fleet.messages.watches import (
    CsrWatchInput, CsrWatchResult, DemandWake, DemandWatchInput, RecoveryWatchInput, RecoveryWatchResult,
    SiteWatchInput, SiteWatchResult,
)
from fleet.models import Node
from fleet.rollout import ProbeResult
from fleet.routing import RoutingDocument

#: What a node agent answers: taken undecoded (the SDK hands the workflow the payload) and
#: validated in workflow code, so a hostile or broken node's malformed answer is a failed step
#: naming the field, never a workflow task that fails to decode. The body's own result type is
#: the shape the check expects (``tests/test_registration.py`` reads it from the body).
NodeAnswer = RawValue


@activity.defn(name="abort_weights_uploads")
async def abort_weights_uploads(input: AbortUploadsInput) -> AbortedUploads:
    """Abort the multipart uploads open under a rollout's key prefix in a site's store (its copies
    have ended). Body: ``activities/weights.py``, ``WeightsActivities.abort_weights_uploads``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="admit_node")
async def admit_node(input: AdmitNodeInput) -> Node:
    """Lift the unproven taint, then tell the Site entity the node is ready. Body:
    ``activities/control_plane.py``, ``ControlPlaneActivities.admit_node``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="admit_repair")
async def admit_repair(input: AdmitRepairInput) -> RepairDecision:
    """Ask ``site/<site>`` (started if needed) whether this GPU may be repaired now. Body:
    ``activities/evacuation.py``, ``EvacuationActivities.admit_repair``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="approve_node_csrs")
async def approve_node_csrs() -> CsrApproverResult:
    """gpufleet's CSR approver, one pass (kubelet certificate renewals, serving CSRs), for the
    ``CsrApprover`` workflow (woken by its CSR watch): what it decided and why. Body:
    ``activities/control_plane.py``, ``ControlPlaneActivities.approve_node_csrs``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="await_registration")
async def await_registration(input: AwaitRegistrationInput) -> Node:
    """Approve the kubelet's certificate (only for the node its token was issued for), wait until
    the node registers and is Ready, delete its token at once, and admit the registration only if it
    is this join's machine: its providerID the one the user data named and, where the provider
    reports addresses, its addresses the machine's. Body: ``activities/control_plane.py``,
    ``ControlPlaneActivities.await_registration``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="cancel_purchase")
async def cancel_purchase(input: CancelPurchaseInput) -> CancelOutcome:
    """Cancel a purchase whose pods all went, unless its join already asked the provider for a
    machine (then the node comes, and consolidation gives it back once idle). Body:
    ``activities/demand.py``, ``DemandActivities.cancel_purchase``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="account_config_problems")
async def account_config_problems(input: AccountConfigInput) -> list[tuple[str, str]]:
    """``(field, problem)`` for the account or provider of a ProviderAccount entity that the fleet
    config does not have; none when it does. Body: ``activities/capacity.py``,
    ``CapacityActivities.account_config_problems``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="check_credentials")
async def check_credentials(input: AccountInput) -> str:
    """One cheap authenticated call (list offers at one of its sites), past the guard. Body:
    ``activities/capacity.py``, ``CapacityActivities.check_credentials``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="closed_evacuations")
async def closed_evacuations(input: ClosedEvacuationsInput) -> list[str]:
    """The site's evacuations no longer running whose cordon marks or routing entry are still there,
    less those put back already; none while an evacuation acts at the site (it took them over). Body:
    ``activities/evacuation.py``, ``EvacuationActivities.closed_evacuations``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="contain_gpu")
async def contain_gpu(input: ContainInput) -> ContainResult:
    """Fence the GPU, then drain the node's pods honoring PodDisruptionBudgets. Body:
    ``activities/repair.py``, ``RepairActivities.contain_gpu``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="delete_machine")
async def delete_machine(input: DeleteMachineInput) -> None:
    """Body: ``activities/control_plane.py``, ``ControlPlaneActivities.delete_machine``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="demand_settings")
async def demand_settings() -> dict:
    """The config's ``demand:`` block (batch window, idle TTL, site fraction). Body:
    ``activities/demand.py``, ``DemandActivities.demand_settings``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="drain_within")
async def drain_within(input: DrainNodeInput) -> DrainResult:
    """Cordon and evict through the Eviction API (PDBs honoured) until the deadline; with
    ``cordoned_by``, a node someone else holds by now is left as it is (``held``). Body:
    ``activities/capacity.py``, ``CapacityActivities.drain_within``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="ensure_sites")
async def ensure_sites(input: SignalSitesInput) -> list[str]:
    """Start the entity of every site (of ``input.sites``, or the config's) that is not running; a
    running one is left alone: its watch and safety timer keep it current, and a signal would be an
    action for nothing. Body: ``activities/watches.py``, ``WatchActivities.ensure_sites``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="ensure_node_entities")
async def ensure_node_entities() -> NodeEntitiesStarted:
    """Start the entity of every node that must have one and has none running (Ready, proven,
    joined by gpufleet, not retired nor cordoned by a retirement: ``fleet.watched``), from the
    join's identity record. Body: ``activities/control_plane.py``,
    ``ControlPlaneActivities.ensure_node_entities``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="reclaim_stopped_spot")
async def reclaim_stopped_spot() -> StoppedSpotReclaims:
    """Start the SpotReclaim of every spot node NotReady whose machine its provider reports stopped
    or terminated (taken without a notice the node agent read), one provider list a site. Body:
    ``activities/control_plane.py``, ``ControlPlaneActivities.reclaim_stopped_spot``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="evacuation_begun_first")
async def evacuation_begun_first(input: EvacuationRef) -> str:
    """The running evacuation of the site begun before this one ("" when none). Body:
    ``activities/evacuation.py``, ``EvacuationActivities.evacuation_begun_first``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="evacuation_end")
async def evacuation_end(input: EvacuationRef) -> str:
    """Waits for that evacuation to end: its outcome. Body: ``activities/evacuation.py``,
    ``EvacuationActivities.evacuation_end``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="evacuation_leftovers")
async def evacuation_leftovers(input: EvacuationRef) -> EvacuationLeftovers:
    """What a closed evacuation changed and did not put back (its ``leftovers`` query). Body:
    ``activities/evacuation.py``, ``EvacuationActivities.evacuation_leftovers``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="evacuation_put_back")
async def evacuation_put_back(input: EvacuationRef) -> None:
    """Record with the site's evacuation claim that the Site entity put back what that closed
    evacuation left: ``closed_evacuations`` leaves it out from then on. Body:
    ``activities/evacuation.py``, ``EvacuationActivities.evacuation_put_back``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="evacuation_facts")
async def evacuation_facts(input: SiteRef) -> EvacuationFacts:
    """The site's serving, routing and nodes, and what closed evacuations of it left. Body:
    ``activities/evacuation.py``, ``EvacuationActivities.evacuation_facts``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="fence_gpu")
async def fence_gpu(input: FenceInput) -> None:
    """Fence the GPU and cordon the node: no new pod lands there. Body: ``activities/repair.py``,
    ``RepairActivities.fence_gpu``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="fill_end")
async def fill_end(input: FillRef) -> CapacityResult:
    """Waits for that fill (begun by an earlier run of the Site entity) to end: its result; one that
    ended otherwise fails this, saying how. Body: ``activities/capacity.py``, ``CapacityActivities.fill_end``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="fill_number")
async def fill_number(input: ChildNumberInput) -> ChildNumber:
    """The number of the site's next Site-entity fill: one no fill on record has, or one whose fill
    still runs (to adopt). Body: ``activities/capacity.py``, ``CapacityActivities.fill_number``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="fleet_sites")
async def fleet_sites() -> list:
    """Body: ``activities/capacity.py``, ``CapacityActivities.fleet_sites``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="free_gpus")
async def free_gpus(input: FreeGpusInput) -> dict[str, int]:
    """GPUs at each site not asked for by a serving Deployment (ready, schedulable nodes). Body:
    ``activities/evacuation.py``, ``EvacuationActivities.free_gpus``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="get_catalog")
async def get_catalog(input: GetCatalogInput) -> Catalog:
    """Offers of every site (stored ones when fresh), with account states. Body:
    ``activities/capacity.py``, ``CapacityActivities.get_catalog``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="hold_site_repairs")
async def hold_site_repairs(input: HoldRepairsInput) -> list[str]:
    """Hold (or release) every running GpuRepair at the site: a held ladder finishes its current
    rung, then waits contained. Body: ``activities/evacuation.py``,
    ``EvacuationActivities.hold_site_repairs``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="idle_nodes")
async def idle_nodes() -> IdleNodesResult:
    """Fleet GPU nodes with no GPU pod on them, and what consolidation must respect. Body:
    ``activities/demand.py``, ``DemandActivities.idle_nodes``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="incident_number")
async def incident_number(input: ChildNumberInput) -> ChildNumber:
    """The number of the site's next Site-entity incident: one no evacuation on record has, or one
    whose evacuation still runs (to adopt). Body: ``activities/evacuation.py``,
    ``EvacuationActivities.incident_number``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="incident_probe")
async def incident_probe(input: SiteRef) -> SiteProbe:
    """The site's nodes (ready, cordoned) and whether its provider API answers. Body:
    ``activities/evacuation.py``, ``EvacuationActivities.incident_probe``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="incident_settings")
async def incident_settings(input: SiteRef) -> IncidentSettings:
    """Body: ``activities/evacuation.py``, ``EvacuationActivities.incident_settings``."""
    raise NotImplementedError("a declaration: the worker registers the body")



@activity.defn(name="node_facts")
async def node_facts(input: NodeFactsInput) -> NodeFacts:
    """Body: ``activities/repair.py``, ``RepairActivities.node_facts``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="node_left")
async def node_left(input: NodeFactsInput) -> NodeLeft:
    """What a Node entity started again takes as its state: the node's fenced GPUs and cordon, and its
    repairs still running. Body: ``activities/repair.py``, ``RepairActivities.node_left``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="notify_person")
async def notify_person(input: NotifyInput) -> bool:
    """POST to the configured webhook (activities.notify); none configured: nothing to do. Body:
    ``activities/capacity.py``, ``CapacityActivities.notify_person``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="plan_demand")
async def plan_demand(input: PlanDemandInput) -> PlanDemandResult:
    """Keep the fleet's labels on its nodes, list GPU pods, and plan (``fleet.demand_planner``): the
    loop's own purchases and SpotReclaims' replacements count as joining. Body:
    ``activities/demand.py``, ``DemandActivities.plan_demand``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="plan_and_buy")
async def plan_and_buy(input: PlanAndBuyInput) -> PlanAndBuyResult:
    """Read the catalog, plan as ``plan_demand`` and start each planned machine's purchase, numbered
    on from ``input.seq`` (purchases an earlier try started are taken as its own, not bought again).
    Body: ``activities/demand.py``, ``DemandActivities.plan_and_buy``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="probe_gpus")
async def probe_gpus(input: ProbeGpusInput) -> NodeAnswer:
    """Runs on the node (``activities/node_agent.py``, ``NodeAgentActivities.probe_gpus``); its
    answer, a ``GpuProbeResult``: no workflow schedules it yet, so nothing reads it."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="probe_serving")
async def probe_serving(input: ProbeServingInput) -> ProbeResult:
    """The probe requests, one after another (each up to its timeout: minutes in all), in a thread;
    heartbeating meanwhile when the rollout asks for it, so a lost worker's attempt is retried
    within the heartbeat timeout. Body: ``activities/serving.py``,
    ``ServingActivities.probe_serving``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="provision_joining_machine")
async def provision_joining_machine(input: ProvisionJoinInput) -> ProvisionedMachine:
    """Token first (kept under the join's id: a retry renders the same user data, and a machine
    found by the key carries it already), then the machine with its bootstrap document in the
    provider's user data. Body: ``activities/control_plane.py``,
    ``ControlPlaneActivities.provision_joining_machine``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="purchase_status")
async def purchase_status(input: PurchaseStatusInput) -> list[PurchaseState]:
    """Body: ``activities/demand.py``, ``DemandActivities.purchase_status``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="read_usage")
async def read_usage() -> Usage:
    """The ledger's machines and the workloads the cluster serves now. Body:
    ``activities/ledger.py``, ``LedgerActivities.read_usage``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="reboot_machine")
async def reboot_machine(input: RestartMachineInput) -> str:
    """Body: ``activities/repair.py``, ``RepairActivities.reboot_machine``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="reinstall_driver")
async def reinstall_driver(input: ReinstallDriverInput) -> NodeAnswer:
    """Runs on the node (``activities/node_agent.py``, ``NodeAgentActivities.reinstall_driver``);
    its answer, a ``str``, is checked by ``GpuRepair._said``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="reinstall_machine")
async def reinstall_machine(input: RestartMachineInput) -> str:
    """Body: ``activities/repair.py``, ``RepairActivities.reinstall_machine``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="relay_entity_update")
async def relay_entity_update(input: EntityUpdateInput) -> EntityUpdateResult:
    """Body: ``activities/entity_update.py``, ``EntityUpdateActivities.relay_entity_update``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="release_cordons")
async def release_cordons(input: ReleaseCordonsInput) -> list[str]:
    """Uncordon the nodes still cordoned with their owner's mark that no one else holds; which
    ones. Body: ``activities/capacity.py``, ``CapacityActivities.release_cordons``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="release_nodes")
async def release_nodes(input: ReleaseNodesInput) -> ReleaseNodesResult:
    """Uncordon the nodes an evacuation cordoned, except one held for a reason of its own: a GPU
    still fenced by its repair (the repair uncordons it when done), a cordon a person or another owner
    marked theirs since. Body:
    ``activities/evacuation.py``, ``EvacuationActivities.release_nodes``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="release_orphaned_holds")
async def release_orphaned_holds(input: SiteRef) -> list[str]:
    """Releases the site's repairs held for an incident whose evacuation no longer runs. Body:
    ``activities/evacuation.py``, ``EvacuationActivities.release_orphaned_holds``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="release_provision")
async def release_provision(input: ReleaseProvisionInput) -> list[str]:
    """After a failed provision: delete what an earlier attempt may have created under the key (it
    timed out after the provider made the machine, a later attempt then failed). Body:
    ``activities/control_plane.py``, ``ControlPlaneActivities.release_provision``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="remove_node")
async def remove_node(input: RemoveNodeInput) -> None:
    """Body: ``activities/control_plane.py``, ``ControlPlaneActivities.remove_node``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="repair_end")
async def repair_end(input: RepairRef) -> GpuRepairResult:
    """Waits for a repair a Node entity started again follows to end: its result; one that ended
    otherwise (cancelled, terminated, failed) fails this, saying how. Body: ``activities/repair.py``,
    ``RepairActivities.repair_end``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="replacement_sites")
async def replacement_sites(input: ReplacementSitesInput) -> list[str]:
    """Where the replacement may join (``fleet.replacement``: compliance geography); none for a site
    gone from the config. Body: ``activities/repair.py``, ``RepairActivities.replacement_sites``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="replicate_weights")
async def replicate_weights(input: ReplicateInput) -> ReplicateResult:
    """Body: ``activities/weights.py``, ``WeightsActivities.replicate_weights``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="report_account")
async def report_account(input: ReportAccountInput) -> None:
    """OverQuota / BadCredentials seen: block in the store now, tell the entity. Body:
    ``activities/capacity.py``, ``CapacityActivities.report_account``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="reset_gpu")
async def reset_gpu(input: ResetGpuInput) -> NodeAnswer:
    """``nvidia-smi -r -i N``. Runs on the node (``activities/node_agent.py``,
    ``NodeAgentActivities.reset_gpu``); its answer, a ``str``, is checked by ``GpuRepair._said``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="resolve_rollout_sites")
async def resolve_rollout_sites(input: ResolveRolloutSitesInput) -> RolloutSites:
    """Body: ``activities/serving.py``, ``ServingActivities.resolve_rollout_sites``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="resolve_site")
async def resolve_site(input: ResolveSiteInput) -> Site:
    """The site's config, or InvalidRequest naming ``site`` when unknown. Body:
    ``activities/control_plane.py``, ``ControlPlaneActivities.resolve_site``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="retire_machine")
async def retire_machine(input: RetireMachineInput) -> str | None:
    """Machine deleted (queued if the account is revoked), then the Node object out; or, with
    ``cordoned_by``, who holds the node now, nothing deleted. Body:
    ``activities/capacity.py``, ``CapacityActivities.retire_machine``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="revoke_node_tokens")
async def revoke_node_tokens(input: RevokeNodeTokensInput) -> list[str]:
    """Every join token issued for the node (a join that failed before registration). Body:
    ``activities/control_plane.py``, ``ControlPlaneActivities.revoke_node_tokens``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="rollback_site")
async def rollback_site(input: RollbackSiteInput) -> ServingStatus | None:
    """Body: ``activities/serving.py``, ``ServingActivities.rollback_site``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="routing_event")
async def routing_event(input: SiteEventInput) -> list[str]:
    """Signal ``routing/<model>`` (started if needed) with the event; the models told. Body:
    ``activities/routing.py``, ``RoutingActivities.routing_event``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="routing_model_problems")
async def routing_model_problems(input: RoutingModelInput) -> list[tuple[str, str]]:
    """``[("model", problem)]`` when no site serves the model (a Deployment of it, at any replica
    count) and the fleet config does not name it (``models:``); none otherwise. Body:
    ``activities/routing.py``, ``RoutingActivities.routing_model_problems``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="queued_deletes")
async def queued_deletes(input: QueuedDeletesInput) -> QueuedDeletes:
    """The deletes the account guard store holds queued for the account (and whether it has the
    account revoked): read by a ProviderAccount run started afresh, and by a run while revoked or
    after a try of them failed, to show them. ``shown_only``: the first ``MAX_QUEUED_DELETES_SHOWN``
    machines and the count (what a run reads: its history stays small however many are queued);
    else every machine. Body: ``activities/capacity.py``,
    ``CapacityActivities.queued_deletes``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="routing_sample")
async def routing_sample(input: RoutingSampleInput) -> RoutingSample:
    """Each site serving the model: Ready replicas, queue depth (``vllm:num_requests_waiting``
    summed over the site's published model servers), latency, price, and what an evacuation decided
    for the site (the fleet-wide site document). Body: ``activities/routing.py``,
    ``RoutingActivities.routing_sample``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="run_queued_deletes")
async def run_queued_deletes(input: AccountInput) -> list[str]:
    """The deletes queued while the account was revoked (the store says healthy now). Body:
    ``activities/capacity.py``, ``CapacityActivities.run_queued_deletes``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="scale_serving")
async def scale_serving(input: ScaleInput) -> ServingStatus:
    """Body: ``activities/evacuation.py``, ``EvacuationActivities.scale_serving``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="serving_snapshot")
async def serving_snapshot(input: ServingRef) -> ServingStatus | None:
    """Body: ``activities/serving.py``, ``ServingActivities.serving_snapshot``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="set_site_weight")
async def set_site_weight(input: SiteWeightInput) -> SiteWeightResult:
    """The evacuation's decision for the site (``percent`` of its weight, healthy/draining/
    incident) in the fleet-wide site document, one atomic write. Body: ``activities/evacuation.py``,
    ``EvacuationActivities.set_site_weight``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="signal_sites")
async def signal_sites(input: SignalSitesInput) -> list[str]:
    """Signal-with-start ``site/<name>`` of each named site with ``reconcile``. Body:
    ``activities/capacity.py``, ``CapacityActivities.signal_sites``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="site_configured")
async def site_configured(input: ResolveSiteInput) -> SiteConfigured:
    """Whether this worker's fleet config names the site, and where it does not, the nodes and
    identity records the cluster still has there: a Site entity whose site was refused as unknown
    asks before it ends. Body: ``activities/control_plane.py``,
    ``ControlPlaneActivities.site_configured``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="site_evacuations")
async def site_evacuations(input: EvacuationInput) -> dict[str, str]:
    """site -> why it is under evacuation, for the asked sites that are: what the evacuation decided
    (the fleet-wide site document, written as it happens), or what the model's routes say (written
    by its Routing entity, a moment later). Body: ``activities/serving.py``,
    ``ServingActivities.site_evacuations``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="wait_site_evacuations")
async def wait_site_evacuations(input: EvacuationWaitInput) -> dict[str, str]:
    """The evacuations of the sites a rollout waits for, once they differ from what it saw (a site
    came back) or at its bound; the routes are read in the worker meanwhile. Body:
    ``activities/serving.py``, ``ServingActivities.wait_site_evacuations``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="site_health")
async def site_health(input: SiteHealthInput) -> SiteHealth:
    """Body: ``activities/repair.py``, ``RepairActivities.site_health``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="site_nodes")
async def site_nodes(input: SiteNodesInput) -> list[SiteNode]:
    """Body: ``activities/capacity.py``, ``CapacityActivities.site_nodes``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="smoke_test")
async def smoke_test(input: SmokeTestInput) -> NodeAnswer:
    """All GPUs visible, clean counters, and each GPU computes correctly. Runs on the node
    (``activities/node_agent.py``, ``NodeAgentActivities.smoke_test``); its answer, a
    ``SmokeResult``, is checked by ``workflows/steps.checked_smoke``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="start_purchase")
async def start_purchase(input: StartPurchaseInput) -> str:
    """Start the purchase's AcquireCapacity (a retried start finds the one it started). Body:
    ``activities/demand.py``, ``DemandActivities.start_purchase``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="started_purchases")
async def started_purchases(input: StartedPurchasesInput) -> list[Purchase]:
    """The purchases still running that a ``plan_and_buy`` started under the numbers after
    ``input.seq``, each as the loop follows it. Body: ``activities/demand.py``,
    ``DemandActivities.started_purchases``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="sweep_identities")
async def sweep_identities(input: SweepIdentitiesInput) -> IdentitySweepReport:
    """Delete the identity records whose Node is gone (``remove_node`` deletes a retired node's own;
    these are what a ``kubectl delete node`` or a crash in between left) once they have been without
    a Node for the grace period: a kubelet whose Node was deleted registers it again within seconds,
    and must find its record still there. Body: ``activities/sweep.py``,
    ``SweepActivities.sweep_identities``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="sweep_known")
async def sweep_known() -> SweepKnown:
    """Nodes in the cluster (names, machine ids), then the running joins' node names. Body:
    ``activities/sweep.py``, ``SweepActivities.sweep_known``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="sweep_site")
async def sweep_site(input: SweepSiteInput) -> SiteSweepReport:
    """List the site's machines, delete its orphans (unless ``dry_run``). Body:
    ``activities/sweep.py``, ``SweepActivities.sweep_site``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="uncontain_gpu")
async def uncontain_gpu(input: UncontainInput) -> UncontainResult:
    """Body: ``activities/repair.py``, ``RepairActivities.uncontain_gpu``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="update_serving")
async def update_serving(input: UpdateServingInput) -> ServingStatus:
    """Create or update the Deployment (idempotent: the same spec changes nothing). Where the
    site has no GPUs for a surge replica the update replaces one replica at a time (the answer's
    ``max_surge`` is 0), or is refused (``NoRoomToUpdate``) where that would leave the model served
    nowhere. Body: ``activities/serving.py``, ``ServingActivities.update_serving``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="wait_for_boot")
async def wait_for_boot(input: WaitForBootInput) -> Node:
    """Until the node is Ready with a boot id other than ``boot_id_before``. Body:
    ``activities/repair.py``, ``RepairActivities.wait_for_boot``."""
    raise NotImplementedError("a declaration: the worker registers the body")



@activity.defn(name="wait_serving_ready")
async def wait_serving_ready(input: WaitServingInput) -> ServingStatus:
    """Body: ``activities/serving.py``, ``ServingActivities.wait_serving_ready``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="wake_waiting_requests")
async def wake_waiting_requests(input: WakeRequestsInput | None = None) -> int:
    """Signal each AcquireCapacity waiting for capacity: offers changed, look again; from a catalog
    refresh, only when its offers differ from the last refresh's (none: every one). Body:
    ``activities/capacity.py``, ``CapacityActivities.wake_waiting_requests``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="watch_csrs")
async def watch_csrs(input: CsrWatchInput) -> CsrWatchResult:
    """Until a CSR the approver has not seen appears (a new name among those still open); unchanged
    after ``max_wait_seconds``. Body: ``activities/watches.py``, ``WatchActivities.watch_csrs``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="watch_demand")
async def watch_demand(input: WatchDemandInput) -> DemandBatch:
    """Until opted-in Pending pods the loop has no answer for appear, then until the batch closes:
    ``batch_idle_seconds`` without another new pod, or ``batch_max_seconds`` after the first
    (Karpenter's window). Body: ``activities/demand.py``, ``DemandActivities.watch_demand``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="watch_demand_events")
async def watch_demand_events(input: DemandWatchInput) -> DemandWake:
    """Until opted-in Pending GPU pods the loop has no answer for appear (then until the batch
    closes, as ``watch_demand`` did: ``batch_idle_seconds`` without another, at most
    ``batch_max_seconds``), a pod a purchase was bought for goes, a purchase ends, or the nodes
    holding GPU pods change; after ``wait_seconds`` with nothing of that. Body:
    ``activities/watches.py``, ``WatchActivities.watch_demand_events``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="watch_node")
async def watch_node(input: NodeWatchInput) -> NodeAnswer:
    """Long-running: return the node's state once it differs from what the entity saw, or unchanged
    after ``max_wait_seconds``; heartbeat while waiting. Runs on the node
    (``activities/node_agent.py``, ``NodeAgentActivities.watch_node``); its answer, a
    ``NodeWatchResult``, is checked by ``NodeEntity._checked``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="watch_recovery")
async def watch_recovery(input: RecoveryWatchInput) -> RecoveryWatchResult:
    """A SiteEvacuation's site while it is down: its recovery probe every ``probe_seconds`` inside the
    activity, until the verdict differs from ``recovered`` or (in the needs-person wait) the models
    nothing may take differ from ``impossible``; unchanged after ``max_wait_seconds``. Body:
    ``activities/watches.py``, ``WatchActivities.watch_recovery``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="watch_routing")
async def watch_routing(input: RoutingWatchInput) -> RoutingWatchResult:
    """Sample every ``look_seconds`` here, in the worker (no Temporal action), until the document
    the entity would decide from a sample differs from ``previous``; after ``max_wait_seconds`` the
    last sample, unchanged. Body: ``activities/routing.py``, ``RoutingActivities.watch_routing``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="watch_site")
async def watch_site(input: SiteWatchInput) -> SiteWatchResult:
    """Until a node of the site changes what the entity acts on (``node_summary``), a node comes or
    goes, or the provider API's answer changes; unchanged after ``max_wait_seconds``. Body:
    ``activities/watches.py``, ``WatchActivities.watch_site``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="write_account_state")
async def write_account_state(input: AccountRecordInput) -> None:
    """The ProviderAccount entity's write-through to the store activities check. Body:
    ``activities/capacity.py``, ``CapacityActivities.write_account_state``."""
    raise NotImplementedError("a declaration: the worker registers the body")


@activity.defn(name="write_routing")
async def write_routing(document: RoutingDocument) -> int:
    """Store the document as the model's routing table; the table's version. Body:
    ``activities/routing.py``, ``RoutingActivities.write_routing``."""
    raise NotImplementedError("a declaration: the worker registers the body")
