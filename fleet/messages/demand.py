"""Inputs, results and state of the demand loop (``Demand``, id ``demand``) and its activities."""

from __future__ import annotations

from pydantic import BaseModel, Field

from fleet.consolidation import IdleNode
from fleet.demand_planner import DemandPlan, ModelUsage, NodeRoom, PlannedMachine
from fleet.messages.acquire import CapacityRequestFields
from fleet.models import CapacityType, Carried, DAY, Offer, Strict
from fleet.placement import AccountView



# -- activities -----------------------------------------------------------------------------
class WatchDemandInput(BaseModel):
    #: Pods the loop already has an answer for (bought, covered, unplaceable): no wake-up.
    known: list[str] = Field(default_factory=list)
    batch_idle_seconds: float = 1.0
    batch_max_seconds: float = 10.0
    #: Return after this long even with nothing new (purchases, consolidation).
    wait_seconds: float = 30.0
    poll_seconds: float = 0.2


class DemandBatch(BaseModel):
    #: Opted-in Pending GPU pods not in ``known`` when the batch closed.
    new: list[str] = Field(default_factory=list)
    #: Pods that request GPUs and have not finished (Pending or bound), mirror pods left out:
    #: ``watch_demand_events`` names only those of its ``tracked`` (the purchases' pods, all the
    #: loop reads of it); ``watch_demand`` (runs from before the event watch) every one.
    present: list[str] = Field(default_factory=list)
    #: Seconds from the first new pod to the batch's close (the window).
    window_seconds: float = 0.0


class JoiningMachine(BaseModel):
    """A purchase in flight, as the planner counts it."""

    purchase: str
    site: str
    gpus: int
    capacity_type: CapacityType
    #: model → GPUs of the pods it was bought for (the spot share counts them).
    model_gpus: dict[str, int] = Field(default_factory=dict)


class PlanDemandInput(BaseModel):
    offers: list[Offer] = Field(default_factory=list)
    accounts: dict[str, AccountView] = Field(default_factory=dict)
    joining: list[JoiningMachine] = Field(default_factory=list)
    #: offer key → why it is out (a purchase there just failed).
    excluded: dict[str, str] = Field(default_factory=dict)


class PlanDemandResult(BaseModel):
    plan: DemandPlan
    rooms: list[NodeRoom] = Field(default_factory=list)
    usage: dict[str, ModelUsage] = Field(default_factory=dict)
    down: dict[str, str] = Field(default_factory=dict)
    labelled: list[str] = Field(default_factory=list)


class PlanAndBuyInput(BaseModel):
    """The loop's one step from new Pending pods to their purchases (``plan_and_buy``): the catalog
    read, the plan, each planned machine's purchase started, numbered on from ``seq``."""

    joining: list[JoiningMachine] = Field(default_factory=list)
    #: offer key → why it is out (a purchase there just failed).
    excluded: dict[str, str] = Field(default_factory=dict)
    #: The loop's last purchase number: the purchases this step starts are ``seq + 1`` on.
    seq: int = 0
    series: str = Field("", max_length=64)
    #: What every purchase asks beside its offer (``purchase_request``).
    deadline_seconds: float
    capacity_request: dict = Field(default_factory=dict)


class PlanAndBuyResult(PlanDemandResult):
    #: The purchases started, numbered on from the input's ``seq``: first those an earlier try of
    #: the step started that the loop never heard of (the step failed after their start), then this
    #: plan's machines.
    purchases: list[Purchase] = Field(default_factory=list)
    #: The last purchase number taken (a number an unknown purchase runs under is skipped).
    seq: int = 0


class StartedPurchasesInput(BaseModel):
    """The purchases a ``plan_and_buy`` started under the numbers after ``seq`` (``started_purchases``)."""

    seq: int = 0
    series: str = Field("", max_length=64)


class StartPurchaseInput(BaseModel):
    workflow_id: str
    request: dict
    summary: str


class PurchaseStatusInput(BaseModel):
    workflow_ids: list[str] = Field(default_factory=list)


class PurchaseState(BaseModel):
    workflow_id: str
    #: running, completed, failed, cancelled, terminated, timed-out, missing.
    status: str
    nodes: list[str] = Field(default_factory=list)
    why: list[str] = Field(default_factory=list)


class CancelPurchaseInput(BaseModel):
    workflow_id: str
    site: str
    reason: str


class CancelOutcome(BaseModel):
    cancelled: bool
    reason: str


class IdleNodesResult(BaseModel):
    idle: list[IdleNode] = Field(default_factory=list)
    site_nodes: dict[str, int] = Field(default_factory=dict)
    site_min: dict[str, int] = Field(default_factory=dict)
    #: site → GPUs warm headroom keeps there (the models' primary sites).
    keep_warm: dict[str, int] = Field(default_factory=dict)
    #: Fleet nodes that are cordoned, idle or not, whoever cordoned them.
    cordoned: list[str] = Field(default_factory=list)
    #: Cordoned nodes whose cordon the cluster marks as the demand loop's own (a drain of its that
    #: blocked, in this run or one whose carried state is lost) and that nothing else holds.
    own_cordon: list[str] = Field(default_factory=list)
    #: Cordoned node → who holds it now, where the cluster says so: a GPU fenced by its repair, a
    #: cordon marked as someone else's. The loop lets such a node go even if it cordoned it first.
    held: dict[str, str] = Field(default_factory=dict)


# -- the workflow ---------------------------------------------------------------------------
class Purchase(BaseModel):
    workflow_id: str
    offer: str
    site: str
    gpus: int
    capacity_type: CapacityType
    pods: list[str] = Field(default_factory=list)
    model_gpus: dict[str, int] = Field(default_factory=dict)
    reason: str = ""
    #: buying, joined, failed, cancelled, kept (its pods went, but it was already provisioning or could
    #: not be asked: followed, and asked again, until it ends), stopped (the loop was cancelled while it
    #: was buying or kept: told to stop).
    status: str = "buying"
    nodes: list[str] = Field(default_factory=list)
    started_at: float = 0.0
    #: Its pods the loop saw gone while it buys, the others still waiting on it (none left: it is
    #: cancelled or kept): the loop's event watch is not woken for them again (``DemandWatchInput.gone``).
    gone: list[str] = Field(default_factory=list)

    @classmethod
    def of(cls, machine: PlannedMachine, workflow_id: str, started_at: float) -> Purchase:
        """The purchase of ``machine`` as the loop follows it."""
        return cls(workflow_id=workflow_id, offer=machine.offer, site=machine.site, gpus=machine.gpus,
                   capacity_type=machine.capacity_type, pods=machine.pods, reason=machine.reason,
                   model_gpus={name: machine.gpus_used for name in machine.model.split(",")} if machine.model else {},
                   started_at=started_at)


def purchase_request(machine: PlannedMachine, deadline_seconds: float, capacity_request: dict) -> dict:
    """The ``AcquireCapacity`` request that buys ``machine``: pinned to its offer, one machine."""
    return {
        "constraints": {"sites": [machine.site], "gpu": machine.gpu, "gpus_per_machine": machine.gpus,
                        "capacity_types": [machine.capacity_type.value]},
        "count": 1, "deadline_seconds": deadline_seconds,
        "backoff_seconds": min(60.0, deadline_seconds),
        "reason": f"demand: {len(machine.pods)} Pending pods",
        **capacity_request,
    }


def pods_named(pods: list[str]) -> str:
    """The first four of ``pods`` and how many more: a purchase's line in the log and its summary."""
    return ", ".join(pods[:4]) + (f" +{len(pods) - 4}" if len(pods) > 4 else "")


def purchase_summary(machine: PlannedMachine) -> str:
    """The purchase's static summary (the UI's list): its pods, its offer and why that one."""
    return f"demand: {pods_named(machine.pods)} → {machine.offer}: {machine.reason}"


class DemandCarry(BaseModel):
    """What the loop carries over continue-as-new (taken with no retirement in flight)."""

    seq: int = 0
    #: The loop's purchase ids are ``capacity/demand-<series>-<seq>`` (``fleet.naming``): a loop
    #: started afresh has a series of its own, so it never takes an earlier loop's purchase for one
    #: of its own. Empty in a loop started before series (``capacity/demand-<seq>``).
    series: str = Field("", max_length=64)
    purchases: list[Purchase] = Field(default_factory=list)
    idle_since: dict[str, float] = Field(default_factory=dict)
    excluded: dict[str, float] = Field(default_factory=dict)
    log: list[str] = Field(default_factory=list)
    #: Nodes the loop's own retirement left cordoned (its drain blocked, or the delete failed):
    #: the loop's to try again, unlike a node someone else cordoned.
    left_cordoned: list[str] = Field(default_factory=list)


class DemandInput(Strict):
    """Start with ``{}``: every setting comes from the fleet config's ``demand:`` block."""

    #: Longest wait between looks at purchases and idle nodes when nothing happens: a safety
    #: look, since the loop's watch wakes it for new pods, ended purchases and idle nodes.
    tick_seconds: float = Field(600, gt=0, le=DAY)
    #: Override the config's ``demand:`` settings (tests shorten them).
    batch_idle_seconds: float | None = Field(None, ge=0, le=600)
    batch_max_seconds: float | None = Field(None, ge=0, le=3600)
    idle_ttl_seconds: float | None = Field(None, ge=0, le=7 * DAY)
    max_site_fraction: float | None = Field(None, gt=0, le=1)
    #: A purchase pinned to one offer gives up after this long (the loop then buys elsewhere).
    purchase_deadline_seconds: float = Field(300, gt=0, le=DAY)
    #: How long an offer whose purchase failed stays out of the plan.
    exclude_seconds: float = Field(300, ge=0, le=DAY)
    drain_seconds: float = Field(300, ge=0, le=DAY)
    #: Fields merged into each AcquireCapacity request (``join_timeouts``; tests shorten them).
    capacity_request: CapacityRequestFields = Field(default_factory=dict)
    consolidate: bool = True
    #: How often the watch lists Pending pods (a real watch would be pushed; the list is cheap).
    poll_seconds: float = Field(0.2, gt=0, le=60)
    #: Set by the workflow itself when it continues as new; never by a caller.
    carry: Carried[DemandCarry | None] = None


class DemandStatus(BaseModel):
    pending: int = 0
    window_seconds: float = 0.0
    purchases: list[Purchase] = Field(default_factory=list)
    covered: dict[str, str] = Field(default_factory=dict)
    unplaceable: dict[str, str] = Field(default_factory=dict)
    retiring: dict[str, str] = Field(default_factory=dict)
    kept_idle: dict[str, str] = Field(default_factory=dict)
    #: The last decisions, newest last: pods → offer → join, retirements, cancellations.
    log: list[str] = Field(default_factory=list)
