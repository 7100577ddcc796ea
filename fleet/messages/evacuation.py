"""Inputs, results and queries of provider incidents: the Site entity's incident
state, repair admission, SiteEvacuation and its activities (one model each)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field

from fleet.incident import Deficit, Failure, IncidentSettings, SiteFacts, Verdict, allowed_targets
from fleet.cluster import RoutingTable, ServingStatus
from fleet.messages.join import JoinedNode
from fleet.messages.acquire import CapacityRequestFields
from fleet.models import Carried, Name, Strict, Text, UtcDatetime


# -- repair admission (Node entity → Site entity) ---------------------------------------------
class AdmitRepairInput(BaseModel):
    """The Site entity's ``admit_repair`` update."""

    site: Name
    node_name: Name
    gpu: int = Field(0, ge=0, le=63)
    reasons: list[Text] = Field(default_factory=list, max_length=1000)


class RepairDecision(BaseModel):
    #: True: start the repair. False: the site has (or just opened) an incident; hold.
    repair: bool
    incident: str = ""
    why: str = ""


class IncidentClosed(BaseModel):
    """The Node entity's ``incident_closed`` signal: the Site entity that held its repairs for
    ``incident`` says it closed; the findings on hold are rechecked now."""

    site: Name
    incident: Text


class SiteRef(BaseModel):
    site: str


#: How many evacuations of a site are remembered as put back by its Site entity, newest kept: in the
#: entity's state (``IncidentCarry.put_back``) and with the site's evacuation claim, which outlives
#: the entity's runs (``EvacuationActivities.evacuation_put_back``). Each is put back once, however
#: long a repair keeps a node cordoned with its mark.
PUT_BACK_KEPT = 50
#: How many unfinished put-backs a Site entity carries (``IncidentCarry.put_back_unfinished``): as
#: many as ``closed_evacuations`` looks at. One more, the oldest is left to a person, said as such.
PUT_BACK_UNFINISHED_KEPT = 10
#: Tries of one put-back that stop (as its incident closes, at safety looks) before the Site entity
#: leaves it to a person (``IncidentCarry.put_back_given_up``): one a step refuses for good (a 403 on
#: a Deployment) cost activities at every look, for ever, and told no one.
PUT_BACK_TRIES = 5
#: The steps of a Site entity's put-back of a closed evacuation, in order: its cordons lifted, the
#: site's Deployments scaled back, waited for, the site's routing weight as before its incident, the
#: routing event telling the models' Routing entities, the replicas it added elsewhere scaled back.
PutBackStep = Literal["uncordon", "scale-here", "wait-here", "weight", "routing-event", "scale-elsewhere"]
PUT_BACK_STEPS: tuple[PutBackStep, ...] = get_args(PutBackStep)


class PutBackProgress(BaseModel):
    """How far a Site entity's put-back of a closed evacuation got before it stopped."""

    #: The step it stopped at: the steps before it are done.
    step: PutBackStep = PUT_BACK_STEPS[0]
    #: The targets of ``step`` done already (``<model>@<site>``: the scale steps set one Deployment
    #: each): a try that resumes the step skips them. Each is set to an absolute count: set again, the
    #: scaling a person or the demand loop did at one since was undone at every look.
    done: list[str] = Field(default_factory=list)
    #: Tries that stopped (``PUT_BACK_TRIES`` at most), and what stopped the last:
    #: ``<step> <target>: <error>``.
    tries: int = 0
    failing: str = ""


class ClosedEvacuationsInput(BaseModel):
    """``closed_evacuations``: the site, and the evacuations its Site entity has put back already
    (``IncidentCarry.put_back``) or left to a person (``IncidentCarry.put_back_given_up``), which it
    leaves out."""

    site: str
    put_back: list[str] = Field(default_factory=list, max_length=100)
    #: The evacuations whose put-back the entity began and did not finish
    #: (``IncidentCarry.put_back_unfinished``): looked at again even with nothing of theirs left to see.
    unfinished: list[str] = Field(default_factory=list, max_length=100)


# -- the Site entity's incident state ---------------------------------------------------------
class IncidentRecord(BaseModel):
    id: str
    reason: str
    opened_at: UtcDatetime
    closed_at: UtcDatetime | None = None
    outcome: str = ""


class IncidentCarry(BaseModel):
    """A Site entity's incident state (part of ``SiteState``, carried over continue-as-new)."""

    count: int = 0
    failures: list[Failure] = Field(default_factory=list)
    api_failing_since: float | None = None
    history: list[IncidentRecord] = Field(default_factory=list)
    #: The incident not yet closed. An admission can open one while the entity waits for its
    #: handlers before continuing as new: carried, so the next run still evacuates.
    open: IncidentRecord | None = None
    #: ``open`` still waits for its SiteEvacuation to start.
    evacuate: bool = False
    #: The nodes whose repair ``admit_repair`` held for the open incident (only the site's own: one
    #: entry a node): each Node entity is told when it closes (``incident_closed``), and rechecks now.
    held_nodes: list[str] = Field(default_factory=list)
    #: The rule's last answer (the ``status`` query shows it).
    verdict: Verdict | None = None
    #: The entity's last workflow task (epoch seconds): a longer gap than it ever sleeps means the
    #: control plane was away (``fleet.incident.absence``).
    last_seen: float | None = None
    #: When it last came back: repairs and incidents wait out ``control_plane.return_grace_seconds``.
    returned_at: float | None = None
    #: Evacuations of the site that closed without putting back, whose leftovers the entity has put
    #: back (or found none in), newest last and bounded (``PUT_BACK_KEPT``): never put
    #: back twice. A node left to a repair keeps its evacuation's cordon mark, so ``closed_evacuations``
    #: finds that evacuation at every safety look; put back again, the site's Deployments, its routing
    #: and the replicas elsewhere went back to before its incident, undoing what people changed since.
    put_back: list[str] = Field(default_factory=list)
    #: Evacuations whose put-back the entity began and did not finish (a step refused or out of its
    #: tries), each with how far it got, newest last and bounded (``PUT_BACK_UNFINISHED_KEPT``): tried
    #: again at each safety look from there on, ``PUT_BACK_TRIES`` times at most. Its last steps leave
    #: nothing for ``closed_evacuations`` to find by (the cordons are lifted, the routing entry
    #: restored): one that stopped at scaling back the replicas it added elsewhere left them there for
    #: good, their GPUs used for no one. The steps and targets done are not redone: each look scaled the
    #: site and set its weight back to before the incident again, undoing what people had changed since.
    put_back_unfinished: dict[str, PutBackProgress] = Field(default_factory=dict)
    #: Put-backs the entity stopped trying (out of tries, or pushed out of ``put_back_unfinished``),
    #: left to a person: evacuation id → what is left and where to look (the ``status`` query and the
    #: entity's details show it), newest last, ``PUT_BACK_KEPT`` kept. Never tried again by this run.
    put_back_given_up: dict[str, str] = Field(default_factory=dict)


class IncidentView(BaseModel):
    """``status`` query: the incident part."""

    open: IncidentRecord | None = None
    #: When the Site entity last saw the control plane come back (epoch seconds), and until when
    #: it holds repairs and incidents meanwhile.
    control_plane_returned_at: float | None = None
    grace_until: float | None = None
    failing: list[str] = Field(default_factory=list)
    threshold: int = 0
    site_nodes: int = 0
    api_failing_since: float | None = None
    history: list[IncidentRecord] = Field(default_factory=list)
    #: Put-backs of closed evacuations the entity gave up on, left to a person
    #: (``IncidentCarry.put_back_given_up``): evacuation id → what failed and the runbook.
    put_back_given_up: dict[str, str] = Field(default_factory=dict)


class ProbeNode(BaseModel):
    name: str
    ready: bool = False
    unproven: bool = False
    unschedulable: bool = False
    machine_id: str = ""


class SiteProbe(BaseModel):
    nodes: list[ProbeNode] = Field(default_factory=list)
    #: The provider API answered (list machines).
    api_ok: bool = True
    api_error_type: str = ""
    api_error: str = ""


class HoldRepairsInput(BaseModel):
    site: str
    #: True: hold (finish the current rung, then wait); False: release.
    hold: bool = True
    #: The hold's reason, shown on each held repair; a release lets go only of the repairs held
    #: with this reason (one an operator held for a reason of theirs stays held).
    reason: str = Field("", max_length=500)


# -- SiteEvacuation ---------------------------------------------------------------------------
class SiteEvacuationInput(Strict):
    """Start with plain JSON: ``{"site": "lambda-us-east", "reason": "manual"}`` (the Site entity does)."""

    site: Name
    reason: Text = "provider incident"
    #: Overrides the site's incident settings (tests shorten timers); None = from the config.
    settings: IncidentSettings | None = None
    #: Merged into the AcquireCapacity request (e.g. join_timeouts, backoff_seconds).
    capacity_request: CapacityRequestFields = Field(default_factory=dict)
    #: Set by the workflow itself when it continues as new; never by a caller.
    carry: Carried[EvacuationCarry | None] = None


class EvacuationFields(Strict):
    """``SiteInput.evacuation``: merged into the input of each SiteEvacuation the Site entity
    starts, which gives the site and the reason itself."""

    settings: IncidentSettings | None = None
    capacity_request: CapacityRequestFields = Field(default_factory=dict)


class EvacuationLeftovers(BaseModel):
    """What a SiteEvacuation changed and has not put back (its ``leftovers`` query): what its abort
    would put back, for its Site entity to put back once the run closed without doing so (terminated,
    timed out, a put-back that gave up), through the same activities, or for the next evacuation of
    its site begun before that to take over (``EvacuationFacts.left``)."""

    site: str = ""
    #: Nothing to put back: it put back what it changed (restored, aborted, cancelled), changed
    #: nothing, or followed another. Also the answer for a run still running (it puts back itself) or
    #: gone from Temporal's record.
    put_back: bool = True
    #: The weights before the incident (``SiteWeightInput``'s), and the sites its document lists.
    original_models: dict[str, int] = Field(default_factory=dict)
    original_site: int = 100
    all_sites: list[str] = Field(default_factory=list)
    #: Replicas of each model's Deployment at the site before its drain scaled them to 0.
    here: dict[str, int] = Field(default_factory=dict)
    #: Replicas before it, of each model at each site it moved replicas to (scaled back down).
    elsewhere: dict[str, dict[str, int]] = Field(default_factory=dict)
    #: Nodes it cordoned with its mark (its workflow id), but none it left to a repair (failed the proof).
    cordoned: list[str] = Field(default_factory=list)
    #: Why there is nothing to read, where that is so ("still running", "no longer on record").
    note: str = ""
    #: It is still running (it puts back itself): the one answer to ask again later.
    running: bool = False


class EvacuationFacts(BaseModel):
    site: SiteFacts
    #: Every site of the fleet (for compliance and geography).
    sites: list[SiteFacts] = Field(default_factory=list)
    settings: IncidentSettings
    #: Serving Deployments at the failed site and elsewhere.
    here: list[ServingStatus] = Field(default_factory=list)
    elsewhere: list[ServingStatus] = Field(default_factory=list)
    #: Routing before the evacuation: the site document and each model's table (None = none yet).
    site_routes: RoutingTable | None = None
    model_routes: dict[str, RoutingTable | None] = Field(default_factory=dict)
    nodes: list[ProbeNode] = Field(default_factory=list)
    #: What evacuations of the site no longer running changed and did not put back (terminated before
    #: their Site entity's put-back came), by id: the evacuation that reads these facts as it begins
    #: takes that over, and puts it back as its own (empty in facts recorded before they carried it).
    left: dict[str, EvacuationLeftovers] = Field(default_factory=dict)

    def deficits(self, site: str) -> list[Deficit]:
        """Each model's replicas at ``site`` to place elsewhere, with the sites that may take them:
        those that run the model's Deployment already, allowed by compliance, and never one that is
        itself under an incident (or otherwise out of routing). The evacuation plans from these, and
        its needs-person watch (``watch_recovery``) reads from them what nothing may take."""
        out_of_routing = {name for name, r in (self.site_routes.sites if self.site_routes else {}).items()
                          if r.incident or r.draining or not r.healthy}
        allowed = {t.name for t in allowed_targets(self.site, self.sites)} - out_of_routing
        out = []
        for here in self.here:
            if here.desired_replicas <= 0:
                continue
            targets = sorted(x.site for x in self.elsewhere if x.model == here.model and x.site in allowed
                             and x.site != site)
            out.append(Deficit(model=here.model, replicas=here.desired_replicas,
                               gpus_per_replica=here.gpus_per_replica, targets=targets))
        return out


class SiteWeightInput(BaseModel):
    site: str
    #: Percent of each original weight (0 = no new sessions).
    percent: int = Field(ge=0, le=100)
    healthy: bool
    draining: bool
    incident: str = ""
    #: The site's weight in each model's table before the incident, and in the site document.
    original_models: dict[str, int] = Field(default_factory=dict)
    original_site: int = 100
    #: Sites every new document lists (weight 100 when they have no entry yet).
    all_sites: list[str] = Field(default_factory=list)


class SiteWeightResult(BaseModel):
    site_routes_version: int
    model_versions: dict[str, int] = Field(default_factory=dict)
    weights: dict[str, int] = Field(default_factory=dict)


class FreeGpusInput(BaseModel):
    sites: list[str]


class ScaleInput(BaseModel):
    model: str
    site: str
    replicas: int = Field(ge=0)


class ReleaseNodesInput(BaseModel):
    """The nodes an evacuation cordoned, to uncordon as it ends (however it ends)."""

    nodes: list[str]
    #: Nodes it drained that were cordoned already when it began: left cordoned, with why.
    keep_cordoned: list[str] = Field(default_factory=list)
    #: The closed evacuations whose leftovers it took over (``EvacuationFacts.left``): a cordon marked
    #: with one of their ids is its own to uncordon, as one marked with its own id is.
    adopted: list[str] = Field(default_factory=list)


class ReleaseNodesResult(BaseModel):
    uncordoned: list[str] = Field(default_factory=list)
    #: Node → why it stays cordoned: held for a reason of its own (a repair's fenced GPU).
    held: dict[str, str] = Field(default_factory=dict)
    #: No longer in the cluster (retired meanwhile): nothing to uncordon.
    gone: list[str] = Field(default_factory=list)


class RecoveryProbe(BaseModel):
    recovered: bool
    detail: str = ""


class Step(BaseModel):
    name: str
    at: UtcDatetime
    detail: str = ""


class EvacuationProgress(BaseModel):
    site: str
    step: str = "starting"
    #: What the step waits for and until when (the Temporal UI shows the same in its details).
    step_detail: str = ""
    state: str = "evacuating"
    #: Its first steps (how it began) and its newest; those between are counted in
    #: ``timeline_left_out`` (a site that flaps for days adds two steps per failed proof).
    timeline: list[Step] = Field(default_factory=list)
    timeline_left_out: int = 0
    moves: dict[str, dict[str, int]] = Field(default_factory=dict)
    capacity_request: str = ""
    acquired: list[str] = Field(default_factory=list)
    drained: list[str] = Field(default_factory=list)
    needs_person: str = ""
    weights: dict[str, int] = Field(default_factory=dict)
    #: Nodes it drained that stay cordoned after it ended, each with why (a repair holds a GPU
    #: of it, it failed the proof, it was cordoned before the evacuation began, a person or another
    #: owner marked the cordon theirs since).
    held: dict[str, str] = Field(default_factory=dict)
    #: The evacuation of the same site that began first, which this one follows (state
    #: ``following``): it changes nothing itself and ends when that one does.
    following: str = ""


class EvacuationRef(BaseModel):
    """One SiteEvacuation of a site, by its workflow id."""

    site: Name
    workflow_id: Text


class EvacuationResult(BaseModel):
    site: str
    #: restored | aborted | "followed <id>: <how that one ended>"
    outcome: str
    timeline: list[Step] = Field(default_factory=list)
    #: As ``EvacuationProgress.timeline_left_out``.
    timeline_left_out: int = 0
    #: As ``EvacuationProgress.held``.
    held: dict[str, str] = Field(default_factory=dict)


class EvacuationCarry(BaseModel):
    """What SiteEvacuation carries over continue-as-new. Taken only in a wait with no child
    (AcquireCapacity) and no activity open: looking for a compliant site (``placing``) or
    waiting for the provider to recover (``recovering``)."""

    phase: Literal["placing", "recovering"]
    progress: EvacuationProgress
    #: The facts the runbook acts on (the latest read: the site's Deployments, routing, nodes).
    facts: EvacuationFacts
    settings: IncidentSettings
    #: Weights before the incident, restored at the end.
    original_models: dict[str, int] = Field(default_factory=dict)
    original_site: int = 100
    all_sites: list[str] = Field(default_factory=list)
    #: What closed evacuations of the site left, taken over as it began (``EvacuationFacts.left``).
    adopted: dict[str, EvacuationLeftovers] = Field(default_factory=dict)
    #: Nodes bought for the evacuation (retired at the end while their site is above its min).
    acquired: list[JoinedNode] = Field(default_factory=list)
    #: Capacity purchases so far (at most one per evacuation).
    bought: int = 0
    failed_proofs: int = 0
    retry: int = 0
    #: An operator's ``declare_recovered`` note not yet acted on.
    recovered: str = ""
