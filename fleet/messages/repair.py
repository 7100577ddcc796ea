"""Inputs, signals, queries and results of the Node entity and GpuRepair."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from fleet.models import Carried, EpochSeconds, GpuHealth, MaybeName, Name, Strict, Text, UtcDatetime, XidEvent, append_bounded
from fleet.repair_policy import Finding, Ledger, RepairSettings, Rung


class RunningRepair(BaseModel):
    """A GpuRepair of the node still running when its Node entity continued as new
    (``node-continues-while-repairing``): the next run follows it to its end (``repair_end``)."""

    repair_id: str
    #: The finding it was started for: a person's retry starts from it if the repair ends unproven.
    finding: Finding


class NodeCarry(BaseModel):
    """Everything a Node entity knows, handed whole to its next run on continue-as-new
    (it continues only with no action slot held and no message waiting; since
    ``node-continues-while-repairing`` with repairs of its node running, which it carries)."""

    ledger: Ledger = Field(default_factory=Ledger)
    seen_xids: list[str] = Field(default_factory=list)
    baseline: dict[str, list[str]] = Field(default_factory=dict)
    boot_id: str = ""
    reports: int = 0
    state: str = "ready"
    log: list[str] = Field(default_factory=list)
    #: GPU → the finding on hold for a recheck (node still joining, site holding repairs).
    deferred: dict[int, Finding] = Field(default_factory=dict)
    #: GPUs this entity fenced (their node cordoned) that no repair has taken over yet: a
    #: finding on hold whose GPU heals is un-fenced by the entity itself.
    fenced: list[int] = Field(default_factory=list)
    #: GPU → its last reported health: a recheck forgets a finding whose GPU healed. Only GPUs the
    #: node can have, each with one XID event at most (``workflows.node._last_seen``).
    latest: dict[int, GpuHealth] = Field(default_factory=dict)
    #: The node's recent disruptive actions: a later node-wide one (a reboot, reinstall or replace)
    #: covers another GPU's repair detected before it; a reset covers no other repair.
    actions: list[NodeAction] = Field(default_factory=list)
    #: The pulled health watch (``watch_node``): the last result's sequence number and state
    #: digest, and the spot notice acted on. Carried, so a new run's first watch returns at
    #: once when the node's state differs from what this run saw (level-triggered).
    watch_seq: int = 0
    watch_digest: str = ""
    reclaim_at: float | None = None
    #: Watch results the entity refused (``NodeReport``): in all, and since the last good one
    #: (carried, so a hostile node cannot clear its count by waiting for a continue-as-new).
    bad_reports: int = 0
    bad_reports_in_a_row: int = 0
    #: The watch's pace (``workflows.node._pace_watch``): answers in a row long before their wait,
    #: all and those that changed nothing, and until when the next watch waits (epoch seconds).
    #: Carried, so a node cannot clear its pace by driving its entity to continue as new (padded
    #: answers pass the server's history-size suggestion every few answers).
    watch_early_answers: int = 0
    watch_idle_answers: int = 0
    watch_paced_until: float | None = None
    #: Until when the bytes its watch answers wrote are paid for at the repair settings' ``watch_bytes_kib_per_hour``
    #: (epoch seconds; ``_pace_watch``): every answer, early or not, moves it on by its size's worth.
    watch_bytes_until: float | None = None
    #: The reasons of quarantines not yet handed to a repair: such a finding is about the node's
    #: word, not its GPU, so a clean GPU snapshot while it waits does not forget it.
    quarantine_reasons: list[str] = Field(default_factory=list)
    #: Since when the cluster says the node is NotReady (its Site entity's watch told, epoch
    #: seconds); None while it is Ready.
    not_ready_since: float | None = None
    #: GPU → why a person must look: its repair ended without proving it (cancelled, terminated,
    #: failed), so it stays fenced and the node cordoned. The entity's state is ``needs-person``
    #: while any is here; a new repair of the GPU takes it over, or a person's ``return_gpu``
    #: un-fences it, or ``repair_gpu`` starts one.
    needs_person: dict[int, str] = Field(default_factory=dict)
    #: GPU in ``needs_person`` → the finding its ended repair was started for: a person's
    #: ``repair_gpu`` with no rung starts where the policy would for it (none known: a reset).
    left_findings: dict[int, Finding] = Field(default_factory=dict)
    #: GPU → its repair still running when the run continued as new (``node-continues-while-repairing``;
    #: none of them holding or waiting for the node's action slot then): the next run follows each to
    #: its end (``repair_end``) as the run before did. Written only as the run continues; empty meanwhile.
    repairs: dict[int, RunningRepair] = Field(default_factory=dict)
    #: When its site saw the node deleted from the cluster (epoch seconds), told while a repair of it
    #: ran (``node-takes-told-deleted-after-its-repair``): once none runs, the entity asks the cluster
    #: and ends if it does not know the node. None: no such word waits.
    deleted_seen_at: float | None = None


class NodeWatchInput(BaseModel):
    """The Node entity's ``watch_node`` activity, on the node's own queue: return when the
    node's state differs from ``digest`` (or a spot notice differs from ``reclaim_at``),
    else with the same state after ``max_wait_seconds``, heartbeating meanwhile."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    node_name: Name
    seq: int = Field(0, ge=0)
    digest: str = Field("", max_length=128)
    reclaim_at: float | None = None
    max_wait_seconds: float = Field(300, gt=0, le=3600)


class NodeWatchResult(BaseModel):
    """The node's whole state as its agent sees it (level-triggered: never a delta)."""

    node_name: str
    #: ``seq`` of the input, plus one when the state changed.
    seq: int
    digest: str
    boot_id: str
    gpus: list[GpuHealth] = Field(default_factory=list)
    #: Spot reclaim: when the provider takes the machine (epoch seconds), if it posted a notice.
    reclaim_at: float | None = None
    #: When the node observed this state (epoch seconds, the node's clock); None from older agents.
    #: A result that waited out a control-plane outage in flight is too old to act on.
    observed_at: float | None = None


# -- what a node says about itself, as the control plane accepts it ----------------------------
# A node agent runs on a third party's machine: its answers are untrusted input. The Node entity
# receives a watch result undecoded and validates it against these models in workflow code, so a
# malformed one is a bad report from that node, never a failed workflow task, and nothing
# unbounded (a huge string, a NaN, a year-0 timestamp) reaches the entity's state or its next
# ``NodeWatchInput``. They subclass the wire models: a checked report is a ``NodeWatchResult``.
MAX_NODE_GPUS = 64
#: The agent keeps at most this many XID events per GPU (``activities.node_agent.MAX_XIDS``).
MAX_REPORTED_XIDS = 64
MAX_REPORTED_COUNT = 2**31
#: Digests (sha256 hex: 64), boot ids (a UUID: 36) and GPU UUIDs fit in this with room to spare.
NodeToken = Annotated[str, StringConstraints(max_length=128)]
NodeText = Annotated[str, StringConstraints(max_length=1000)]
Count = Annotated[int, Field(ge=0, le=MAX_REPORTED_COUNT)]


def _epoch_datetime(value: datetime) -> datetime:
    # The entity keys XID events by ``at.timestamp()``: a datetime it cannot convert or one outside
    # 1970..2100 is refused here rather than raised in the entity.
    try:
        seconds = value.timestamp()
    except (ValueError, OverflowError, OSError):
        raise ValueError("not a representable time") from None
    if not 0 <= seconds <= 4_102_444_800:
        raise ValueError("must be between 1970 and 2100")
    return value


class ReportedXid(XidEvent):
    model_config = ConfigDict(allow_inf_nan=False)

    xid: Count
    at: Annotated[UtcDatetime, AfterValidator(_epoch_datetime)]
    message: NodeText = ""


class ReportedGpu(GpuHealth):
    model_config = ConfigDict(allow_inf_nan=False)

    index: int = Field(ge=0, lt=MAX_NODE_GPUS)
    uuid: NodeToken
    name: NodeText = ""
    memory_gb: float = Field(0, ge=0, le=1_000_000)
    temperature_c: int = Field(0, ge=-273, le=1000)
    slowdown_temperature_c: int = Field(0, ge=-273, le=1000)
    ecc_uncorrected: Count = 0
    nvlink_down: Count = 0
    xid_events: list[ReportedXid] = Field(default_factory=list, max_length=MAX_REPORTED_XIDS)
    recovery_action: Count = 0


class NodeReport(NodeWatchResult):
    """A ``NodeWatchResult`` (a watch's answer, a smoke test's state) the control plane accepts."""

    model_config = ConfigDict(allow_inf_nan=False)

    node_name: Name
    seq: int = Field(ge=0, le=2**53)
    #: As bounded as the ``NodeWatchInput.digest`` the entity sends back with the next watch.
    digest: NodeToken
    boot_id: NodeToken
    gpus: list[ReportedGpu] = Field(default_factory=list, max_length=MAX_NODE_GPUS)
    reclaim_at: EpochSeconds | None = None
    observed_at: EpochSeconds | None = None


class SmokeReport(BaseModel):
    """A smoke test's answer (``SmokeResult``) as the control plane accepts it: ``passed`` must
    be a real boolean (a string "yes" proves nothing), the failures bounded."""

    model_config = ConfigDict(allow_inf_nan=False)

    passed: StrictBool
    gpus_seen: Count
    boot_id: NodeToken = ""
    failures: list[NodeText] = Field(default_factory=list, max_length=4 * MAX_NODE_GPUS)


#: A GPU index as a message may name one: below the most a node may have.
GpuIndex = Annotated[int, Field(ge=0, lt=MAX_NODE_GPUS)]


class NodeQuarantine(BaseModel):
    """Signal ``quarantine`` to a Node entity, from the control plane (never from a node): the
    node failed a proof someone else ran (an evacuation's smoke test); cordon it and let the
    repair ladder decide, as after the entity's own bad reports."""

    model_config = ConfigDict(extra="forbid")

    reason: Annotated[str, StringConstraints(min_length=1, max_length=1000)]
    #: The GPUs the proof found failing, as the sender read them from the node's validated report
    #: (``workflows.evacuation.failing_gpus``): those are fenced and repaired, each proving itself,
    #: and the entity acts only on those below the node's GPU count in the cluster. None (left out
    #: of the payload, as before it existed), or none of them the node's: the whole node, its
    #: repair on GPU 0 (a failure no GPU is named for shows in every GPU's proof).
    gpus: list[GpuIndex] | None = Field(None, min_length=1, max_length=MAX_NODE_GPUS)
    #: The proof could not run on the node: its node agent cannot run its compute check (its image,
    #: its limits; ``ComputeCheckUnavailable``), so nothing proved it and nothing said a GPU of it is
    #: broken. No rung fixes the agent: the entity starts no repair, holds the node (its GPU 0) for a
    #: person with this reason (``needs_person``: FleetState ``needs-person``, the
    #: ``GpufleetNodeNeedsPerson`` alert) and leaves it cordoned, and the person's ``return_gpu`` of
    #: GPU 0 (``gpufleet repair return <node> 0``), once the agent is fixed, uncordons it. False (left
    #: out of the payload, as before it existed): the repair ladder, as ever.
    hold_for_person: bool = False


class NodeEntityInput(BaseModel):
    """Start with plain JSON: ``{"node_name": "site-a-1a2b3c4d"}`` (the agent's signal-with-start does)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    node_name: Name
    #: Set by the entity itself when it continues as new; never by a caller.
    carry: Carried[NodeCarry | None] = None
    #: From the join that admitted the node (its own record, never the node's): the site, the
    #: repair settings, and the state the node showed in its smoke test. With them the first
    #: run starts watching at once, with no activity to read them again.
    site: MaybeName = ""
    settings: RepairSettings | None = None
    first_state: NodeWatchResult | None = None
    #: Set by the site sweep when it starts the entity of a node that had none running (its run
    #: before was terminated, or failed): how that run ended, for the new run's log.
    started_again: Text = ""


class NodeActionRequest(BaseModel):
    """A GpuRepair asks its Node entity for the node's one disruptive-action slot."""

    repair_id: Name
    rung: Rung
    #: When the fault was detected: another repair's node-wide action of at least this rung
    #: started later covers it.
    detected_at: UtcDatetime


class NodeActionGrant(BaseModel):
    #: True: go ahead (and signal node_action_done after). False: already covered.
    go: bool
    covered_by: Rung | None = None
    detail: Text = ""


class NodeActionWait(BaseModel):
    """The Node entity tells a repair queued for the node's action slot who holds it and until
    when (sent when it queues, and again whenever the holder or the queue ahead changes)."""

    #: The repair (its workflow id) that holds the slot, its rung and since when.
    holder: Name
    rung: Rung
    since: UtcDatetime
    #: When the holder is expected to give it back: ``since`` plus its rung's timeouts
    #: (``RepairSettings.slot_seconds``).
    until: UtcDatetime
    #: Requests queued before this one, granted (or covered) first.
    ahead: int = 0
    #: With ``ahead``: the request right ahead of this one, and when this one's turn is expected at
    #: the latest (``until`` plus the slot times of those ahead; a covered one takes less). A repair
    #: further back is told once, as it queues, and again only once it is next in line.
    behind: MaybeName = ""
    turn_by: UtcDatetime | None = None


class NodeActionDone(BaseModel):
    repair_id: Name
    rung: Rung
    ok: bool = True
    #: False: the slot is given back unused (the grant reached a held repair, which ran nothing and
    #: asks again once released): no action ran, so the Node entity keeps no record that would cover
    #: another repair's fault.
    acted: bool = True


class NodeAction(BaseModel):
    repair_id: str
    rung: Rung
    started_at: UtcDatetime
    finished_at: UtcDatetime | None = None


class NodeStatus(BaseModel):
    node_name: str
    state: str
    site: str = ""
    boot_id: str = ""
    reports: int = 0
    #: GPU index → repair workflow id.
    active_repairs: dict[str, str] = Field(default_factory=dict)
    app_xids: dict[str, int] = Field(default_factory=dict)
    remediations: int = 0
    node_actions: list[NodeAction] = Field(default_factory=list)
    #: The repairs queued for the node's action slot as it is now, next in line first (a queued
    #: repair was told its place once, as it queued).
    slot_queue: list[str] = Field(default_factory=list)
    deferred: list[int] = Field(default_factory=list)
    #: Until when the findings its site holds for an incident wait for their next look (epoch
    #: seconds; a pause that doubles up to ``workflows.node.HELD_RECHECK_MAX``), unless the Site
    #: entity says the incident closed first. None: none waits so.
    held_until: float | None = None
    #: GPUs the entity fenced (node cordoned) whose repair has not started: held by the site.
    fenced: list[int] = Field(default_factory=list)
    #: The last few things the entity decided (ignored reports, deferrals...).
    log: list[str] = Field(default_factory=list)
    #: Watch results refused as malformed: in all, in a row, and the latest one's problem.
    bad_reports: int = 0
    bad_reports_in_a_row: int = 0
    #: The watch's pace (``workflows.node._pace_watch``): answers in a row long before their wait,
    #: all and those that changed nothing, and until when the next watch waits (epoch seconds).
    #: Carried, so a node cannot clear its pace by driving its entity to continue as new (padded
    #: answers pass the server's history-size suggestion every few answers).
    watch_early_answers: int = 0
    watch_idle_answers: int = 0
    watch_paced_until: float | None = None
    last_bad_report: str = ""
    #: Background loops (the health watch, a repair's watcher) restarted after an error.
    loop_restarts: int = 0
    #: Since when the cluster says the node is NotReady (None: Ready, or not told otherwise).
    not_ready_since: float | None = None
    #: GPU index → why a person must look (its repair ended unproven; the GPU stays fenced).
    needs_person: dict[str, str] = Field(default_factory=dict)
    #: Whether the entity runs ("running"), else how its run closed ("terminated", "failed", ...)
    #: and when: set by the client from Temporal, not by the entity (a closed run's query answers
    #: with what it last knew, "ready" for a node it no longer watches).
    entity: str = "running"
    entity_closed_at: UtcDatetime | None = None


#: A person's words on a GPU the Node entity holds for a person (shown in its log and details).
PersonReason = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=500)]


class ReturnGpuInput(Strict):
    """The Node entity's ``return_gpu`` update: a person returns a GPU the entity holds for a
    person (``NodeCarry.needs_person``) to service: un-fenced, its node uncordoned unless another
    GPU of it is fenced (under repair or held)."""

    gpu: int = Field(ge=0, lt=MAX_NODE_GPUS)
    #: Why it may serve (a vendor's word, a manual test): required, it is a person's decision.
    reason: PersonReason


class RepairGpuInput(Strict):
    """The Node entity's ``repair_gpu`` update: a person starts a new GpuRepair of a GPU the
    entity holds for a person, through the same path as a finding (the Site entity admits it)."""

    gpu: int = Field(ge=0, lt=MAX_NODE_GPUS)
    #: The rung to start at; None: where the policy starts for the finding its ended repair was
    #: started for, else a reset. The node's repeat-fault limits apply as to any finding.
    rung: Rung | None = None
    reason: PersonReason


class GpuDecision(BaseModel):
    """What the Node entity did on a person's ``return_gpu`` or ``repair_gpu``."""

    node_name: str
    gpu: int
    #: returned (un-fenced), repairing (its GpuRepair started), awaiting-site (the Site entity holds
    #: the repair for its incident: it starts once admitted; the GPU stays fenced meanwhile).
    outcome: str
    #: One sentence saying what happened, for a person.
    detail: str
    #: ``returned``: the node is schedulable again, or the other GPUs still fenced keep it cordoned.
    uncordoned: bool = False
    still_fenced: list[int] = Field(default_factory=list)
    #: ``repairing``: the repair's workflow id and the rung it starts at.
    repair_id: str = ""
    rung: Rung | None = None
    #: The entity's state afterwards (``ready``, ``needs-person``, ``repairing``, ``awaiting-site``).
    state: str = ""


class GpuRepairInput(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    node_name: Name
    gpu: int = Field(ge=0, le=63)
    site: Name
    machine_id: MaybeName = ""
    #: The node's GPU count: the proof expects that many visible. A repair started by hand (no
    #: Node entity as parent) is refused when it is not the count the cluster knows.
    gpus: int = Field(1, ge=1, le=64)
    rung: Rung = Rung.RESET
    reasons: list[Text] = Field(default_factory=list, max_length=1000)
    escalated_because: Text = ""
    detected_at: UtcDatetime | None = None
    settings: RepairSettings = Field(default_factory=RepairSettings)

    @model_validator(mode="after")
    def _gpu_on_the_node(self) -> "GpuRepairInput":
        # Raised under ``gpu``: a plain ValueError here would name only ``(input)``.
        if self.gpu >= self.gpus:
            raise ValidationError.from_exception_data(type(self).__name__, [{
                "type": PydanticCustomError("gpu_not_on_node", "must be less than gpus ({gpus}), the node's GPU "
                                            "count: its GPUs are 0 to {last}", {"gpus": self.gpus, "last": self.gpus - 1}),
                "loc": ("gpu",), "input": self.gpu,
            }])
        return self


class Attempt(BaseModel):
    rung: Rung
    started_at: UtcDatetime
    finished_at: UtcDatetime | None = None
    #: passed, failed (recovery or proof), covered (another repair's action did it), replaced,
    #: cancelled (the repair was cancelled during it).
    outcome: str = "running"
    detail: str = ""


#: The attempts a repair keeps (its ladder query and its result): the newest. A person may re-run an
#: exhausted ladder (``skip_to``) any number of times, each attempt's detail holds what the node
#: said, and the result is bounded at 2 MiB.
ATTEMPTS_KEPT = 20


class LadderState(BaseModel):
    node_name: str
    gpu: int
    rung: Rung
    step: str
    held: bool = False
    #: The reason given with the last hold or release.
    hold_reason: str = ""
    skip_to: Rung | None = None
    done: bool = False
    #: repaired, replaced, exhausted (contained, needs a person), gone, cancelled (stopped where
    #: it was, still contained: needs a person), refused (its input, at start: nothing done).
    outcome: str = ""
    reasons: list[str] = Field(default_factory=list)
    #: The newest ``ATTEMPTS_KEPT`` attempts ...
    attempts: list[Attempt] = Field(default_factory=list)
    #: ... and how many came before them.
    earlier_attempts: int = 0
    replacement_node: str = ""
    #: While the ladder waits for the node's action slot: who holds it and until when (as its details say).
    waiting_for: str = ""
    #: The node's action slot given back to no Node entity run (terminated, failed): said, not an error.
    slot_note: str = ""

    def add_attempt(self, attempt: Attempt) -> int:
        """``attempt`` added (the oldest beyond ``ATTEMPTS_KEPT`` let go); its number, from 1."""
        self.earlier_attempts += append_bounded(self.attempts, attempt, ATTEMPTS_KEPT)
        return self.earlier_attempts + len(self.attempts)


class HoldInput(BaseModel):
    """GpuRepair's ``hold`` and ``release`` updates: optional, and only a reason."""

    model_config = ConfigDict(extra="forbid")

    #: Why (shown in the repair's details); a person's words, so kept short.
    reason: str = Field("", max_length=500)


class SkipToInput(BaseModel):
    """GpuRepair's ``skip_to`` update."""

    model_config = ConfigDict(extra="forbid")

    rung: Rung


class GpuRepairResult(BaseModel):
    node_name: str
    gpu: int
    outcome: str
    rung: Rung
    #: As ``LadderState``'s.
    attempts: list[Attempt] = Field(default_factory=list)
    earlier_attempts: int = 0
    replacement_node: str = ""


class LeftRepair(BaseModel):
    """A GpuRepair of the node still running when its Node entity was started again: the new run
    follows it (``repair_end``) and, where it waits for or holds the node's action slot, takes
    that over from the run before, which its requests went to."""

    gpu: int = Field(ge=0, lt=MAX_NODE_GPUS)
    repair_id: Name
    rung: Rung
    reasons: list[Text] = Field(default_factory=list, max_length=20)
    #: "waiting": for the node's action slot (its request went to the run before); "acting": it holds
    #: the slot (its rung's action runs); "": neither (containing, proving), or no Node entity is its parent.
    slot: str = ""
    #: When its fault was detected (the repair's start) or, "acting", when its action began.
    since: UtcDatetime


class NodeLeft(BaseModel):
    """``node_left``: what the cluster and Temporal show of a node that a Node entity started again
    must know: GPUs fenced (``gpufleet.io/fenced-gpu-<i>``, each with the rung it was fenced for), the
    node's cordon, and the node's repairs still running."""

    found: bool = False
    #: GPU index → the rung written in its fence ("" where it names none this code knows): the node's
    #: own object, shown to a person, never where a repair starts.
    fenced: dict[int, str] = Field(default_factory=dict)
    #: GPUs of ``fenced`` whose fence their Node entity wrote before a repair started (``FENCE_ON_HOLD``:
    #: its site or the cluster held the finding) and no repair's containment replaced since.
    on_hold: list[int] = Field(default_factory=list)
    cordoned: bool = False
    repairs: list[LeftRepair] = Field(default_factory=list)


class RepairRef(BaseModel):
    """``repair_end``: one GpuRepair of a node, by its workflow id (``repair/<node>/gpu<i>``)."""

    repair_id: Name
