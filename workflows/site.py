"""Site (entity, id ``site/<name>``): keep the site between its min and max.

Min/max come from the fleet config. Node workflows tell it their transitions
(``node_transition``); the reconcile sweep (a Schedule) and a timer send
``reconcile``; a person sends ``reconcile_now`` (an update: it answers with what the
reconcile will do). A joined node ("ready") is counted from its transition and
reconciles only when the count passes the max (patch ``count-joins``: a fleet
coming up would otherwise list the whole site once per join); any other
transition reconciles. Each reconcile counts the site's nodes in the cluster, then:

- below min: an AcquireCapacity restricted to this site for the missing nodes; after one that
  failed, the next waits a pause doubling from 1 to 30 minutes, saying why and until when
  (``FILL_PACED_PATCH``; a person's ``reconcile_now`` starts it at once);
- above max: drain (PDBs honoured) and retire the surplus, most expensive first,
  then newest, never a node someone holds (a repair fenced a GPU of it, a person marked it
  theirs: ``SiteNode.held``). Held nodes count; with only held ones above the max the site
  waits, saying who holds them, and retires such a node once it is free again (its repair's
  uncordon wakes the watch). The drain marks its cordon ``CORDONED_BY_SURPLUS``, so a node
  taken during the drain is kept (``retire_machine``'s last look), and a node its blocked
  drain left cordoned is recognised from the cluster: retired first while the site is above
  its max, uncordoned (the mark dropped) once it is not. The retirement is a task of the entity's
  own (patch ``site-retires-beside-its-loop``): the loop takes watch results and opens and
  evacuates an incident meanwhile, a reconcile starts no second one, and an incident that opens
  stops it (the surplus is moot while the site is evacuated): its drain in flight is cancelled and
  its node left cordoned with the Site's mark, for the first reconcile after the incident.

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
  incident closes, the nodes whose repairs it held are told (``incident_closed``,
  ``TELLS_HELD_NODES_PATCH``) and held repairs are released. No min/max fill or retire
  while an incident is open.
- numbers its incidents past every ``evacuate/<site>/<n>`` Temporal has on record, so an entity
  started again (terminated, reset) never puts a second run behind an earlier incident's id; one
  of them still running is its open incident, watched to its end, never started twice.

Its fills (``capacity/site-<site>-<n>``) are numbered the same way: past every one on record, and
one still running, begun by an earlier run of the entity, is its fill, waited for, never bought twice.

Its watch also keeps its nodes' public placement labels (zone, region, GPU product) as the
site's config says, within seconds of a change; a node that changed its own is told to
quarantine (``SELF_LABELS_PATCH``).

An entity (``workflows.entity``, docs/design/entities.md): its one state is ``SiteState``
(nodes, counters, the incident rule's failures and the open incident, if any). A fill, a
retirement and an evacuation are its own tasks; it continues as new when the server
suggests it and none runs (the watch and the timer cancelled: the next run starts them
again), through the base's gate, once every handler has finished. ``admit_repair`` awaits
without the state lock (see it). An admission still settling at the gate can open an incident:
it is in the carried state, so the next run starts its evacuation. A reconcile (or probe) that fails
past its retries (the API server away, a 403) never ends the entity: it is shown and tried again
after a growing pause (``workflows.passes``), its state kept.

The one way it ends (patch ``site-ends-once-removed-from-config``): its site taken out of the fleet
config, emptied first as docs/operations.md says. An activity that refuses the site as unknown
(``InvalidRequest``: the reconcile's count, the run's first read of its config; a refused watch asks
for a reconcile) makes it ask ``site_configured``: is the site named, and if not, what does the
cluster still have there. Not named, no node and no identity record left there, at three looks or
more spanning ``removed_seconds`` (the failed passes' pauses space them), and the run ends, through
the base's gate (its fill, retirement or evacuation ended first), with "site <name> is no longer in
the fleet config; nothing left there". A look that finds it named (one refusal from a worker whose
config differs, during a rolling deploy) or something there starts the count again; with nodes left
it keeps running, its details saying what is there and what to do (``GpufleetSiteNotConfigured``).
The site back in the config, the next SiteSweep starts its entity again.

SiteSweep (id ``site-sweep``, run by a Schedule): start every site's entity that is not running,
and every node's (``SWEEP_NODE_ENTITIES_PATCH``), and the SpotReclaim of every spot node whose
machine its provider stopped without a notice (``SWEEP_RECLAIMS_STOPPED_SPOT_PATCH``); with sites
named, signal-with-start their entities with ``reconcile``.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any, Awaitable

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.exceptions import ActivityError, FailureError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import workflows as flows
    from fleet.contracts import activities as act
    from fleet.messages.capacity import (
        CapacityResult,
        ChildNumber,
        ChildNumberInput,
        FillRef,
        NodeTransition,
        ReleaseCordonsInput,
        SignalSitesInput,
        SiteInput,
        SiteNode,
        SiteNodesInput,
        SiteState,
        SiteStatus,
    )
    from fleet.messages.nodes import NodeEntitiesStarted, ResolveSiteInput, SiteConfigured, StoppedSpotReclaims
    from fleet import search_attributes as sa
    from fleet.config import Site
    from fleet.demand import public_placement_labels
    from fleet.messages.repair import NodeQuarantine
    from fleet.placement import surplus_to_retire
    from fleet.site_use import SiteInUse, removed_site_refusal
    from fleet.cluster import CORDONED_BY_SURPLUS
    from workflows.entity import Entity
    from workflows.inputs import invalid_input, parse_input, parse_signal
    from workflows.passes import FailedPasses
    from workflows.steps import (
        CLUSTER_RETRY,
        FOLLOW_WAIT,
        LONG_WATCH_HEARTBEAT,
        LONG_WATCH_PAUSE,
        LONG_WATCH_RETRY,
        PROVIDER_RETRY,
        PUT_BACK_RETRY,
        QUICK,
        STORE_RETRY,
        Retirement,
        drain_and_retire,
        drain_node,
        MAX_PROBLEM_SHOWN,
        failure_message,
        failure_text,
        failure_type,
        retire_drained,
        show_details,
        until_in,
        wait_for_serving,
    )
    from fleet.incident import (
        Failure,
        IncidentSettings,
        absence,
        count_unreachable,
        evaluate,
        forget_unreachable,
        in_return_grace,
        incident_hold_reason,
        record,
    )
    from fleet.naming import evacuation_workflow_id, fill_workflow_id, node_workflow_id
    from fleet.messages.watches import ClusterNodeState, SiteWatchInput, SiteWatchResult, node_summary
    from fleet.messages.evacuation import (
        AdmitRepairInput,
        ClosedEvacuationsInput,
        EvacuationLeftovers,
        EvacuationResult,
        EvacuationRef,
        HoldRepairsInput,
        IncidentCarry,
        IncidentClosed,
        IncidentRecord,
        IncidentView,
        PUT_BACK_KEPT,
        PUT_BACK_STEPS,
        PUT_BACK_TRIES,
        PUT_BACK_UNFINISHED_KEPT,
        PutBackProgress,
        PutBackStep,
        RepairDecision,
        ScaleInput,
        SiteProbe,
        SiteRef,
        SiteWeightInput,
    )
    from fleet.messages.routing import SiteEvent, SiteEventInput

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
#: Workflow patch: the entity wakes on events, never on a short timer (issue 37): its site's watch
#: (``watch_site``: nodes Ready/NotReady, cordoned, proven, added, removed; the provider API's
#: answer), its nodes' transitions, signals, and one timer at a time for a real deadline (the
#: safety reconcile every ``reconcile_seconds``, a provider API failing past its limit, the end
#: of a return grace). It tells a Node entity when its node turns NotReady or Ready again, and
#: upserts its search attribute only when the value changes.
EVENTS_PATCH = "site-events"
#: Workflow patch (issue 35): the site's watch keeps the public placement labels (zone, region, GPU
#: product: what the scheduler and ``PreferClose`` read, and a kubelet may write on its own Node)
#: as the site's config says, putting them back within seconds of a change; a node seen changing
#: its own is reported once per run, and the entity tells its Node entity to quarantine it.
SELF_LABELS_PATCH = "self-labels-quarantine"
#: Workflow patch: each safety reconcile with no incident open releases the site's repairs held
#: for an incident of its own whose evacuation no longer runs (``release_orphaned_holds``). Before,
#: an entity reset, or terminated and started again, mid-incident forgot its hold: the repairs
#: stayed held for good, until a person ran `gpufleet repair release` on each. (At the safety
#: reconcile, not at a run's start: one activity more per run start kept an entity on a low
#: continue-as-new threshold continuing for ever.)
ORPHANED_HOLDS_PATCH = "site-releases-orphaned-holds"
#: Workflow patch: an incident's evacuation id is one Temporal has no run of, and an evacuation of the
#: entity's still running is its incident. A run with no carried state (the entity's first, or one
#: started again after it was terminated) numbers its incidents on from the highest
#: ``evacuate/<site>/<n>`` on record and takes one of them still running as its open incident (its
#: hold, no fill or retire, the release when it ends); each incident's number is checked before its
#: evacuation starts (``incident_number``: a reset run carries an old count), which starts with
#: ``REJECT_DUPLICATE``. Before, such a run counted from 1 again: the next incident started a second
#: run behind ``evacuate/<site>/1`` (`gpufleet evacuate`, the progress and the incident record read
#: the newest), or, the first still running, its start failed and the incident closed "failed:
#: Workflow execution already started", releasing the running evacuation's hold of the site's
#: repairs; a drained site (its nodes cordoned, so not unreachable) opened none, and min/max and
#: repairs went on under the evacuation. Asked at such a run's start and at each evacuation's start.
EVACUATION_IDS_PATCH = "site-evacuation-ids-unique"
#: Workflow patch: a fill's id (``capacity/site-<site>-<n>``) is one Temporal has no run of, and a
#: fill of the entity's still running is its fill. A run with no carried state numbers its fills on
#: from the highest on record and takes one of them still running as its fill (``filling``, waited
#: for with ``fill_end``, no second started meanwhile); each fill's number is checked as it starts
#: (``fill_number``: a reset run carries an old count), and it starts with ``REJECT_DUPLICATE`` and
#: its ``Site`` search attribute. Before, such a run counted from 1 again: its next fill put a second
#: run behind ``capacity/site-<site>-1`` (the CLI and ``filling`` read the newest), or, the first
#: still running (it outlives the entity on purpose), the start failed "already started", the fill
#: counted as failed and the next reconcile started fill 2 beside it: the site bought for twice, then
#: retired what passed its max. Asked at such a run's start and at each fill's start.
FILL_IDS_PATCH = "site-fill-ids-unique"
#: Workflow patch: the surplus above the max is drained and retired by a task of the entity's own,
#: beside its loop, as a fill is; the details say "retiring N: draining <node> until HH:MM:SS UTC".
#: The loop goes on taking watch results (its Node entities told NotReady) and an incident that
#: opens is evacuated at once; a reconcile meanwhile starts no second retirement; the incident
#: stops the retirement (the drain in flight cancelled, its node left cordoned with the Site's
#: mark, no further node drained). A run the server asks to continue as new does so once the
#: retirement ends, before it starts another (the next run reconciles first). Before, the loop
#: drained the surplus one node at a time, up to ``drain_seconds`` (300 s by default) each where
#: PodDisruptionBudgets held it: an incident opened meanwhile said "no new repairs" and evacuated
#: nothing for up to k times that. Asked as a retirement starts, in the loop on events only.
RETIRE_BESIDE_PATCH = "site-retires-beside-its-loop"
#: Workflow patch: what an evacuation of the site changed and did not put back (a run terminated,
#: timed out, or whose own put-back gave up) is put back by the entity, through the activities its
#: abort uses: the cordons marked with its id (none a person's or a repair's: ``release_cordons``),
#: the site's Deployments, its routing weight, the replicas it added elsewhere (``leftovers``, its
#: query). Asked as its incident closes, where the evacuation ended neither restored nor aborted
#: (before the incident closes: no next evacuation meanwhile takes its cordons for "cordoned before"
#: it), and at each safety reconcile with no incident open and no evacuation of the site running, for
#: one the entity did not start or forgot (a person's, an entity reset). Each is put back once
#: (``PUT_BACK_KEPT``): a node a repair holds keeps its mark. Before, the site stayed cordoned (read as
#: a person's: billed, idle), at weight 0 and its Deployments at 0, with no alert; the next evacuation
#: there "restored" the weight and kept both.
PUT_BACK_PATCH = "site-puts-back-closed-evacuations"
#: Workflow patch: a Site whose site the fleet config no longer names, with nothing left there, ends
#: (``_removed_for_sure``). Asked where an activity's refusal of the site as unknown is taken (the
#: reconcile's ``site_nodes``, the run's first ``resolve_site``, the watch), before anything else
#: is done about it: after a regular activity, never a local one. Before, such a run showed the
#: refusal and tried again every 5 minutes for ever (an activity's failure and a timer each time, an
#: alert), until a person terminated it; a new run of it (continued as new, ``renew``) failed.
REMOVED_PATCH = "site-ends-once-removed-from-config"
#: Workflow patch: an evacuation put back (or found with nothing to put back) is recorded with the
#: site's evacuation claim too (``evacuation_put_back``), which ``closed_evacuations`` reads: the
#: claim outlives the entity's runs. Asked where it is put back once, after its last activity.
#: Before, only the run's state (``IncidentCarry.put_back``) remembered it: a Site entity terminated
#: and started again found it once more by the cordon mark a repair's node kept, and put it back a
#: second time (the site's Deployments and routing as before its incident, the replicas added
#: elsewhere since taken away), undoing what people had changed since.
PUT_BACK_RECORDED_PATCH = "site-records-put-backs-with-the-claim"
#: Workflow patch: a put-back of a closed evacuation that did not finish (a step refused, or out of
#: its tries) is remembered with the step it stopped at and the targets of it done
#: (``IncidentCarry.put_back_unfinished``) and tried again from there at each safety look until done
#: (``closed_evacuations`` is handed it): the steps and Deployments done are not redone, which undid
#: people's and the demand loop's scaling and the site's weight every look. ``PUT_BACK_TRIES`` tries
#: at most, then it is left to a person (``IncidentCarry.put_back_given_up``: logged at error, shown
#: in the status), as is one pushed out of the ``PUT_BACK_UNFINISHED_KEPT`` carried. Asked where a
#: put-back fails. Before, one that stopped after the site's routing was restored (scaling back the
#: replicas it added elsewhere) was never found again, neither cordon nor routing entry naming it:
#: those replicas stayed for good, their GPUs used for no one, their nodes never idle for the demand
#: loop to give back.
PUT_BACK_FINISHED_PATCH = "site-finishes-unfinished-put-backs"
#: Workflow patch: a fill that failed (raised: refused at its start, a fatal join failure such as
#: the provider refusing the machine as an ``InvalidRequest`` or the cluster a ``ClusterForbidden``, a
#: person's terminate) holds the next fill back for a pause that doubles from ``FILL_FIRST_PAUSE`` to
#: ``FILL_MAX_PAUSE`` (carried: ``SiteState.next_fill_at``), the details, ``last`` and ``FleetState``
#: (``fill-failed``) saying why and until when; a fill that ends (however many joined) resets it, and
#: a person's ``reconcile_now`` starts the next fill at once. Before, the failed fill asked for a
#: reconcile that started the next at once, for ever: about five fills a second, each calling the
#: provider (buying a machine, where the join failed past its create) while the details said only
#: "below min: acquiring". Asked where a fill's failure is taken, in the loop on events only.
FILL_PACED_PATCH = "site-paces-failed-fills"
#: The most Node entities one watch result tells at once (``_take``): the rest are told in turns of
#: this many, each once the one before is delivered. A site may hold up to ``MAX_SITE_NODES`` (5,000)
#: nodes, and every one of them turning NotReady at once (the provider down) is one watch result.
TELL_AT_ONCE = 250
#: Telling more than ``TELL_AT_ONCE`` nodes, the entity tells them in turns. Before, one watch result
#: told every node in one workflow task: past Temporal's 2,000 pending signals (a site of more than
#: 2,000 nodes going NotReady at once: a provider outage) that task failed, and failed again on every
#: retry, so the entity stopped (no incident, no evacuation, no reconcile) until the watch changed.
#: Asked in ``_take`` only where a result tells more than ``TELL_AT_ONCE``: a run from before that told
#: as many (up to 2,000) in one task replays that way.
TELL_IN_TURNS_PATCH = "site-tells-nodes-in-turns"
#: Workflow patch: each node whose repair ``admit_repair`` held for the open incident is remembered
#: (``IncidentCarry.held_nodes``, one entry a node) and its Node entity told when the incident closes,
#: before the release of the running repairs (``incident_closed``, a signal each): it asks again now,
#: where its pause between two looks (``node-paces-held-rechecks``) may be minutes. Asked where an
#: admission is held for an incident. Before, nobody was told: each held GPU asked again every
#: ``recheck_seconds`` (30 s) for the whole incident, an ``admit_repair`` update here each time.
TELLS_HELD_NODES_PATCH = "site-tells-held-nodes"
#: Workflow patch: a node the watch saw go from the cluster (in the last result, not in this one:
#: retired, removed by hand, ``kubectl delete node``) has its Node entity told (``cluster_state`` with
#: ``deleted``), in turns with the rest (``TELL_AT_ONCE``); a node still being proven has no entity and
#: is not told. The entity confirms it with the cluster's own record and ends within seconds
#: (``node-ends-when-told-deleted``). Before, nobody told it: it ran on, its watch pending on a queue
#: no agent polls, listed as a live node, until that watch's retries ran out (up to an hour) and a
#: facts read found the node gone. Asked in ``_take`` only where a result lacks a node the last one had.
TELLS_DELETED_PATCH = "site-tells-deleted-nodes"
#: The pause after a failed fill, doubled by each that fails again, up to the safety reconcile's period.
FILL_FIRST_PAUSE = 60.0
FILL_MAX_PAUSE = 1800.0
#: Put-backs left to a person the entity's details show (the newest): the ``status`` query has them all.
PUT_BACK_SHOWN = 3
#: Looks (``site_configured``) that must find the site unnamed, nothing left there, in a row, and
#: span ``SiteInput.removed_seconds``, before the entity ends: one answer is not enough.
REMOVED_LOOKS = 3
#: How long a put-back waits for the site's replicas before its routing returns (the evacuation's
#: ``ready_seconds`` at most): a site still down does not hold the entity's loop for long.
PUT_BACK_READY_SECONDS = 120.0
#: SiteSweep's patch: the Schedule's pass also starts every node's entity that must run and does not
#: (``ensure_node_entities``: Ready, or NotReady under a running GpuRepair; proven, joined by gpufleet
#: and not retired, not cordoned by a retirement; ``fleet.watched``). A Node entity is started by its
#: join alone: terminated (the UI, ``temporal workflow terminate``, a reset gone wrong) or failed, its
#: node went on serving unwatched for good, its agent refused by the gateway and its faults repaired
#: by no one. One activity a pass, whatever the fleet's size. Asked after the sites' activity, where
#: the pass was done before.
SWEEP_NODE_ENTITIES_PATCH = "sweep-starts-node-entities"
#: SiteSweep's patch: the Schedule's pass also starts the SpotReclaim (terminating now) of every spot
#: node that is NotReady while its provider reports its machine stopped or terminated
#: (``reclaim_stopped_spot``): taken without a notice the node agent read (Nebius posts none; an agent
#: that was down missed one). Before, nothing drained or replaced such a node: it stayed NotReady,
#: counted toward its site's min_nodes, until a person started or deleted the machine. One activity a
#: pass, one provider list per spot site with a NotReady node. Asked after the node entities' activity.
SWEEP_RECLAIMS_STOPPED_SPOT_PATCH = "sweep-reclaims-stopped-spot"
#: ``incident_number``, ``fill_number`` (a visibility list and a describe or two): a few quick tries;
#: an evacuation or a fill does not wait on it longer (refused, the entity numbers as before, and the
#: start still refuses a used id).
NUMBER_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)
#: The site's watch returns unchanged after this long; its heartbeat timeout (a beat at half of
#: it): a control-plane worker lost without a word is noticed within it, a retried watch then
#: says how long nobody watched. Two watches and twelve heartbeats an hour.
SITE_WATCH_SECONDS = 1800.0
#: The sim has no watch: its nodes are looked at this often at most (``check_seconds`` if shorter).
SIM_POLL_SECONDS = 1.0



def _unique_start(site: str) -> dict[str, Any]:
    """How a numbered child (an incident's evacuation, a fill) whose number was checked starts:
    never a second run behind its id, and listed by its site from its start (``*_number`` finds it)."""
    return dict(id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=TypedSearchAttributes([SearchAttributePair(sa.SITE, site)]))


def _starting_state(args: SiteInput) -> SiteState:
    """The state a run starts with: the one carried, or a new one (from the separate fields runs
    carried before ``SiteState``)."""
    return args.state or SiteState(status=SiteStatus(site=args.site, nodes=dict(args.nodes)),
                                   fills=args.fills, incident=args.incident or IncidentCarry())


@workflow.defn(name="Site")
class SiteEntity(Entity[SiteState]):
    #: ``run``'s input: the input guard refuses its ``Carried`` fields in a run that did not continue as new.
    INPUT = SiteInput

    def __init__(self) -> None:
        #: Everything the entity knows, carried over continue-as-new (``run`` takes the real one).
        super().__init__(SiteState(status=SiteStatus(site="")))
        # Read again by every run: its input, the site's config and incident rule.
        self._args: SiteInput | None = None
        self._site: Site | None = None
        self._incident_settings: IncidentSettings | None = None
        # Own tasks (``spawn``), each watching its child: no continue-as-new while either runs.
        self._fill: asyncio.Task | None = None
        self._evac: asyncio.Task | None = None
        # Patched in (``RETIRE_BESIDE_PATCH``): the retirement of the surplus, whether a reconcile
        # waits for its end, and whether this run retires beside its loop.
        self._retirement: asyncio.Task | None = None
        self._recount = False
        self._retires_beside = False
        # Patched in: watch the gap between its own timer and its next task (``_note_presence``).
        self._returns = False
        self._sleep = 0.0
        # Patched in: a "ready" transition reconciles only when the count passes the max.
        self._count_joins = False
        # Patched in (``EVENTS_PATCH``): the site's watch in flight and its last result not yet
        # taken, the one timer for the next deadline, the provider API's last answer, the
        # search attribute's value (upserted on change only).
        self._events = False
        self._watch: asyncio.Task | None = None
        self._seen: SiteWatchResult | None = None
        self._timer: asyncio.Task | None = None
        self._timer_at: float | None = None
        self._api: tuple[bool, str] | None = None
        self._fleet_state = ""
        self._stopping = False
        # Patched in (``SELF_LABELS_PATCH``): nodes this run told to quarantine for their own labels.
        self._self_labels = False
        self._reported: set[str] = set()
        # A reconcile (or probe) that failed past its retries: shown, and tried again after a pause.
        self._passes = FailedPasses()
        # Patched in (``EVACUATION_IDS_PATCH``): the evacuation this run found running at its start,
        # its open incident (watched to its end, not started again).
        self._adopted = ""
        # Patched in (``REMOVED_PATCH``): the looks in a row that found the site unnamed by the
        # config with nothing left there (the first one's time), what the details say meanwhile,
        # and why the run ends, once it is sure.
        self._unnamed_since: float | None = None
        self._unnamed_looks = 0
        self._unnamed = ""
        self._removed = ""

    @workflow.signal
    def reconcile(self) -> None:
        """Reconcile now. From code and batch operations (a signal is never refused); a person
        uses ``reconcile_now``, which answers with what it will do."""
        self.state.wanted = True

    @workflow.update
    def reconcile_now(self) -> str:
        """``reconcile`` for a person: reconcile now, and say what that will do, from what the
        entity knows at this moment (the reconcile counts the site's nodes again first)."""
        answer = self._reconcile_answer()
        self.state.wanted = True
        self.state.next_fill_at = None  # a person asks: a fill held back after a failed one starts now
        return answer

    def _reconcile_answer(self) -> str:
        site, s = self._site, self.state.status
        if site is None:
            name = self._args.site if self._args is not None else workflow.info().workflow_id.removeprefix("site/")
            return f"{name}: starting; it reconciles first thing, once it has read its min/max from the config"
        known = sum(state != "gone" for state in s.nodes.values())
        if self._passes.failing:  # the loop waits out its pause: the answer says until when
            return (f"{site.name}: {self._passes.failing}; it reconciles then ({known} known, "
                    f"min {site.min_nodes}, max {site.max_nodes})")
        head = f"{site.name}: counting its nodes now ({known} known, min {site.min_nodes}, max {site.max_nodes})"
        incident = self.state.incident.open
        if incident is not None:
            return f"{head}; incident {incident.id} is open ({incident.reason}): no fill or retire until it closes"
        if s.retiring:
            return f"{head}; retiring {', '.join(s.retiring)} (above its max): it counts again once that is done"
        if s.filling:
            return (f"{head}; {s.filling} is still filling it: another fill starts only after that one ends, "
                    "if the site is still below its min")
        if known < site.min_nodes and self._fill_paused():
            return (f"{head}; below its min, its last fill failed ({self.state.fill_failed}): acquires "
                    f"{site.min_nodes - known} nodes now, not waiting out the pause, unless the count finds more")
        if known < site.min_nodes:
            return f"{head}; below its min: acquires {site.min_nodes - known} nodes unless the count finds more"
        if known > site.max_nodes:
            return (f"{head}; above its max: drains and retires {known - site.max_nodes} (most expensive first, "
                    "then newest; never a node a repair or a person holds) unless the count finds fewer")
        return f"{head}; within min/max: nothing to change unless the count differs"

    @workflow.signal
    def node_transition(self, raw: dict[str, Any]) -> None:
        t = parse_signal(NodeTransition, raw, "node_transition")
        if t is not None:
            self.after_start(lambda: self._take_transition(t))  # once ``run`` took its state

    def _take_transition(self, t: NodeTransition) -> None:
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
            put_back_given_up=inc.put_back_given_up,
            control_plane_returned_at=inc.returned_at,
            grace_until=(inc.returned_at + self._incident_settings.control_plane.return_grace_seconds
                         if inc.returned_at is not None else None),
        )})

    @workflow.update
    async def admit_repair(self, raw: Any) -> RepairDecision:
        """A Node entity asks before a GPU repair: repair, or hold for the site's incident."""
        # Raw JSON, checked by the validator: a typed parameter the SDK cannot decode is refused as
        # "Failed decoding arguments" (a retryable RuntimeError that names nothing).
        req = parse_input(AdmitRepairInput, raw)
        # No lock: every change here is made between awaits, and the settle wait is there to let the other
        # admissions of a burst change the state meanwhile (a lock would queue the very burst it waits for).
        await workflow.wait_condition(lambda: self._incident_settings is not None)
        if workflow.patched(KNOWN_NODES_PATCH) and not await self._knows(req.node_name):
            # Invented names must not count towards the incident rule (three of them once
            # evacuated a site): only this site's nodes, as the cluster records them.
            return RepairDecision(repair=False, why=f"{req.node_name} is not a node of {self._site.name}: ignored")
        s, inc = self._incident_settings, self.state.incident  # the run's state is set by now
        if inc.open is not None:
            return self._hold(req.node_name, "incident open: no new repairs here")
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
        if self._events:
            self._record_unreachable(now)
        self._evaluate()
        if inc.open is None and s.settle_seconds > 0:
            try:
                await workflow.wait_condition(lambda: inc.open is not None,
                                              timeout=timedelta(seconds=s.settle_seconds),
                                              timeout_summary="settle: more failures at this site?")
            except asyncio.TimeoutError:
                pass
        if inc.open is not None:
            return self._hold(req.node_name, inc.open.reason)
        v = inc.verdict
        return RepairDecision(repair=True, why=f"{len(v.failing)} failing, trips at {v.threshold}")

    def _hold(self, node_name: str, why: str) -> RepairDecision:
        """Hold the node's repair for the open incident, the node remembered to be told when it closes."""
        inc = self.state.incident
        if workflow.patched(TELLS_HELD_NODES_PATCH) and node_name not in inc.held_nodes:
            inc.held_nodes.append(node_name)
        return RepairDecision(repair=False, incident=inc.open.id, why=why)

    async def _tell_held_nodes(self, incident_id: str) -> None:
        """The incident closed: each node whose repair it held asks again now (``TELLS_HELD_NODES_PATCH``),
        all told at once. One not told (its entity not running) asks again at the end of its pause."""
        inc, site = self.state.incident, self._site.name
        nodes, inc.held_nodes = inc.held_nodes, []

        async def tell(node: str) -> None:
            try:
                await workflow.get_external_workflow_handle(node_workflow_id(node)).signal(
                    flows.Node.incident_closed, IncidentClosed(site=site, incident=incident_id))
            except FailureError as error:
                workflow.logger.info("site %s: node/%s not told %s closed (%s)", site, node, incident_id,
                                     failure_message(error))

        await asyncio.gather(*(tell(node) for node in nodes))

    @admit_repair.validator
    def _check_admit_repair(self, raw: Any) -> None:
        if isinstance(raw, dict):
            # The model ignores unknown fields; a person's typo (``node`` for ``node_name``) must not.
            extra = sorted(str(key) for key in raw if key not in AdmitRepairInput.model_fields)
            if extra:
                raise invalid_input(f"{extra[0]}: unknown field (takes {', '.join(AdmitRepairInput.model_fields)})",
                                    extra)
        req = parse_input(AdmitRepairInput, raw)
        if self._args is not None and req.site != self._args.site:
            raise invalid_input(f"site: {req.site!r} is not this entity's site ({self._args.site})", ["site"])

    async def _knows(self, node_name: str) -> bool:
        """A node of this site: in the last count, else in a fresh one (admitted since)."""
        if node_name in self.state.status.nodes:
            return True
        nodes: list[SiteNode] = await workflow.execute_activity(
            act.site_nodes, SiteNodesInput(site=self._site.name),
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
    async def run(self, raw: Any) -> str | None:
        args = parse_input(SiteInput, raw)
        self._args = args
        self.start_with(_starting_state(args))
        self.state.wanted = True  # every run reconciles first: it reads the site's min/max again
        site = await self._site_from_config(args)
        if site is None:
            # Nothing of its own started yet, and no Node entity asks about a site with no node.
            return self._removed
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
            settings: IncidentSettings = await workflow.execute_activity(
                act.incident_settings, SiteRef(site=site.name),
                start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY,
                summary=f"incident rule of {site.name}",
            )
            if args.state is None and args.incident is None and workflow.patched(EVACUATION_IDS_PATCH):
                await self._learn_incidents()  # before any admission can open one (they wait for the settings)
            self._incident_settings = settings
        self._fleet_state = "reconciling"
        if args.state is None and args.incident is None and workflow.patched(FILL_IDS_PATCH):
            await self._learn_fills()  # before its first reconcile, which would start a fill beside it
        if incidents and workflow.patched(EVENTS_PATCH):
            self._events = True
            self._self_labels = workflow.patched(SELF_LABELS_PATCH)
            return await self._run_on_events(args)
        # Runs from before ``EVENTS_PATCH``: a probe on a short timer (kept for their replay).
        next_reconcile = workflow.now() + timedelta(seconds=args.reconcile_seconds)
        while True:
            timeout = args.reconcile_seconds
            if incidents:
                timeout = min(timeout, self._incident_settings.check_seconds)
            if self._returns:
                self.state.incident.last_seen, self._sleep = workflow.now().timestamp(), timeout
            timed_out = False
            try:
                # Asked to renew, it wakes once it may continue (``_may_continue``): woken while a fill
                # runs, it would find no way on and wake again at once, for ever. On the server's
                # suggestion it wakes as the runs of this path always did.
                await workflow.wait_condition(
                    lambda: (self.state.wanted or self.state.incident.evacuate
                             or (self._may_continue() if self.renewal_asked else self.continue_as_new_suggested())),
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
                    await self._passes.attempt("probe its nodes and provider API", self._probe, self._show,
                                               wake=lambda: self.state.incident.evacuate)
            if self.state.incident.evacuate:
                await self._start_evacuation()
            if self.state.wanted:
                self.state.wanted = False
                next_reconcile = workflow.now() + timedelta(seconds=args.reconcile_seconds)
                await self._reconcile_or_later()
            if self._removed:
                return await self._end_removed()
            if self._may_continue():
                # An admission still settling can open an incident meanwhile: it is in the state, carried.
                await self.continue_as_new_when_ready(lambda: args.model_copy(
                    update={"state": self.state, "nodes": {}, "fills": 0, "incident": None}).model_dump(mode="json"))

    # -- on events (``EVENTS_PATCH``) -----------------------------------------------------------
    async def _run_on_events(self, args: SiteInput) -> str:
        """Sleep until something happens: the watch returns (a node changed, the provider API's
        answer changed, or its safety look), a signal or transition, an admission that opened an
        incident, an ended fill or evacuation, or the one timer's deadline. Nothing on a short
        timer: an idle site costs its watch (two activities and twelve heartbeats an hour) and
        its safety reconcile."""
        every = args.reconcile_seconds
        next_reconcile = workflow.now().timestamp() + every
        while True:
            if self._watch is None:
                self._watch = asyncio.create_task(self._watch_site())
            self._arm(self._next_deadline(next_reconcile))
            await workflow.wait_condition(
                lambda: (self.state.wanted or self.state.incident.evacuate or self._seen is not None
                         or (self._timer is not None and self._timer.done()) or self._may_continue()),
            )
            now = workflow.now().timestamp()
            safety = False
            if self._timer is not None and self._timer.done():
                self._timer, self._timer_at = None, None
                if now >= next_reconcile:
                    self.state.wanted = safety = True  # the safety reconcile: what no event told
                self._record_unreachable(now)  # a grace ended, or the API failed for its limit
                self._evaluate()
                if self.state.next_fill_at is not None and now >= self.state.next_fill_at:
                    self.state.next_fill_at, self.state.wanted = None, True  # a failed fill's pause is over
            if self._seen is not None:
                seen, self._seen = self._seen, None
                await self._take(seen)
            if self.state.incident.evacuate:
                await self._start_evacuation()
            if self.state.wanted:
                self.state.wanted = False
                next_reconcile = workflow.now().timestamp() + every
                await self._reconcile_or_later()
            if self._removed:
                return await self._end_removed()
            if (safety and self.state.incident.open is None and self._evac is None
                    and workflow.patched(ORPHANED_HOLDS_PATCH)):
                await self._release_orphaned_holds()
            if (safety and self.state.incident.open is None and self._evac is None
                    and workflow.patched(PUT_BACK_PATCH)):
                await self._put_back_closed_evacuations()
            if self._may_continue():
                # An admission still settling can open an incident meanwhile: it is in the state, carried.
                self._stopping = True  # the watch's cancel is no failure to retry after a pause
                for task in (self._watch, self._timer):
                    if task is not None:
                        task.cancel()
                await self.continue_as_new_when_ready(lambda: args.model_copy(
                    update={"state": self.state, "nodes": {}, "fills": 0, "incident": None}).model_dump(mode="json"))

    def _may_continue(self) -> bool:
        """Continue as new only with no fill, retirement or evacuation in flight: waiting on the
        server's suggestion while one runs would wake the loop again at once, for ever (a spinning
        entity). Each task clears its field however it ends (``finally``), so none holds the run for
        good (a retirement: ``drain_seconds`` a node it drains, plus its retire's retries and a failed
        pass's pause, up to 5 minutes; an incident stops it)."""
        return (self.may_continue_as_new() and self._fill is None and self._evac is None
                and self._retirement is None)

    def _next_deadline(self, next_reconcile: float) -> float:
        """The earliest real deadline: the safety reconcile, a provider API failing for its limit
        (the rule trips then), the end of the return grace (NotReady counts again)."""
        s, inc = self._incident_settings, self.state.incident
        at = next_reconcile
        if inc.open is None and inc.api_failing_since is not None:
            at = min(at, inc.api_failing_since + s.api_failure_seconds)
        if self._returns and inc.returned_at is not None and self._in_grace(workflow.now().timestamp()):
            at = min(at, inc.returned_at + s.control_plane.return_grace_seconds)
        if self.state.next_fill_at is not None:  # the pause after a failed fill (``FILL_PACED_PATCH``)
            at = min(at, self.state.next_fill_at)
        return at

    def _arm(self, at: float) -> None:
        """One timer, for ``at``: a timer is a billed action, so one is started only when the
        deadline moves, never per wake-up."""
        if self._timer is not None and not self._timer.done() and self._timer_at == at:
            return
        if self._timer is not None and not self._timer.done():
            self._timer.cancel()
        self._timer_at = at
        seconds = max(at - workflow.now().timestamp(), 0.001)
        self._timer = asyncio.create_task(workflow.sleep(seconds, summary="next deadline (safety reconcile, "
                                                                        "API failure limit, return grace)"))

    async def _watch_site(self) -> None:
        """One ``watch_site`` (its result for the loop); a watch refused for good is shown and
        tried again later. Cancelled by continue-as-new."""
        s, site = self._incident_settings, self._site.name
        api_ok, api_type = self._api if self._api is not None else (None, "")
        try:
            self._seen = await workflow.execute_activity(
                act.watch_site,
                SiteWatchInput(site=site, known=self.state.watched, api_ok=api_ok, api_error_type=api_type,
                               max_wait_seconds=SITE_WATCH_SECONDS, api_check_seconds=s.check_seconds,
                               poll_seconds=min(SIM_POLL_SECONDS, s.check_seconds),
                               absence_seconds=s.control_plane.absence_seconds,
                               placement=public_placement_labels(self._site) if self._self_labels else {},
                               reported=sorted(self._reported)),
                start_to_close_timeout=timedelta(seconds=SITE_WATCH_SECONDS) + QUICK,
                heartbeat_timeout=LONG_WATCH_HEARTBEAT, retry_policy=LONG_WATCH_RETRY,
                summary=f"{site}: nodes Ready/NotReady, cordons, joins, provider API; on change",
            )
        except ActivityError as error:
            if self._stopping:
                return  # cancelled for continue-as-new: the next run watches
            if self._refused_as_unknown(error):
                self.state.wanted = True  # the config may no longer name the site: the reconcile looks
            self._show(f"site watch failed ({failure_message(error)}); again in {LONG_WATCH_PAUSE}")
            await workflow.sleep(LONG_WATCH_PAUSE, summary="site watch failed: try again")
        finally:
            self._watch = None

    async def _take(self, seen: SiteWatchResult) -> None:
        """A watch result: the control plane's absence it saw, node counts and transitions (each
        Node entity told when its node turns NotReady or Ready, or since ``TELLS_DELETED_PATCH`` is
        deleted from the cluster), NotReady nodes and the provider API into the incident rule."""
        now, s, inc = workflow.now().timestamp(), self._incident_settings, self.state.incident
        if self._returns:
            # Nobody watched for a while (the watcher stopped, its attempt was lost), or the result
            # waited long to be taken: the control plane was away. NotReady seen meanwhile may be
            # its shadow; reconcile first, no repair or incident for the grace.
            away = max(seen.paused_seconds, now - seen.observed_at if seen.observed_at else 0.0)
            if absence(now - away, now, 0.0, s.control_plane):
                inc.returned_at = now
                inc.failures = forget_unreachable(inc.failures, now - away)
                self.state.wanted = True
                workflow.logger.warning("site %s: control plane was away about %.0fs; reconciling, repairs and "
                                        "incidents wait %gs", self._site.name, away, s.control_plane.return_grace_seconds)
                self._show(f"control plane back after ~{away:.0f}s away: reconciling first "
                           f"({s.control_plane.return_grace_seconds:g}s grace)")
        before = self.state.watched
        after = {n.name: node_summary(n) for n in seen.nodes}
        self.state.watched = after
        self.state.node_count = len(after)
        status = self.state.status
        if set(before) - set(after) or len(after) > status.max_nodes:
            self.state.wanted = True  # a node gone (below min?) or too many: min/max
        for n in seen.nodes:
            status.nodes.setdefault(n.name, "ready" if n.ready and not n.unproven else "joining")
        told = []
        for n in seen.nodes:
            was = before.get(n.name)
            if n.unproven or (was is None and n.ready) or (was is not None and was.startswith("ready") == n.ready):
                continue  # no transition (a node still being proven has no entity to tell yet)
            told.append(self._tell_node(n.name, n.ready, seen.observed_at))
        # Gone from the cluster since the last result (a node still being proven has no entity yet).
        deleted = sorted(name for name in set(before) - set(after) if "unproven" not in before[name].split(","))
        if deleted and workflow.patched(TELLS_DELETED_PATCH):
            told += [self._tell_node(name, False, seen.observed_at, deleted=True) for name in deleted]
        if self._self_labels:
            told += [self._quarantine_self_labelled(name, changes) for name, changes in sorted(seen.self_labelled.items())
                     if name not in self._reported]
        if len(told) > TELL_AT_ONCE and workflow.patched(TELL_IN_TURNS_PATCH):
            # In turns: at most TELL_AT_ONCE signals in flight, far under Temporal's pending limit.
            for at in range(0, len(told), TELL_AT_ONCE):
                await asyncio.gather(*told[at:at + TELL_AT_ONCE])
        elif told:
            await asyncio.gather(*told)
        self._api = (seen.api_ok, seen.api_error_type)
        if inc.open is None:
            if seen.api_ok or seen.api_error_type != "Transient":
                inc.api_failing_since = None
            elif inc.api_failing_since is None:
                inc.api_failing_since = now
            self._record_unreachable(now)
            self._evaluate()

    def _record_unreachable(self, now: float) -> None:
        """Every node NotReady now (not cordoned, proven) is a failure, first seen when the rule
        first saw it inside the window: what a probe at this moment would have recorded."""
        s, inc = self._incident_settings, self.state.incident
        if inc.open is not None or (self._returns and not count_unreachable(inc.returned_at, now, s.control_plane)):
            return
        for name, summary in sorted(self.state.watched.items()):
            if summary == "not-ready":
                inc.failures = record(inc.failures, Failure(node=name, at=now, kind="unreachable", detail="NotReady"),
                                      now, s)

    async def _tell_node(self, node: str, ready: bool, observed_at: float, deleted: bool = False) -> None:
        """The node's entity learns from the cluster that its node fell silent (or answers again),
        or (``deleted``, ``TELLS_DELETED_PATCH``) that its Node object is gone: it need not wait out a
        heartbeat timeout, or its watch's retries, to know."""
        told = ClusterNodeState(ready=ready, observed_at=observed_at, deleted=deleted)
        try:
            await workflow.get_external_workflow_handle(node_workflow_id(node)).signal(flows.Node.cluster_state, told)
        except FailureError as error:
            workflow.logger.info("site %s: node/%s not told it is %s (%s)", self._site.name, node,
                                 "deleted" if deleted else "Ready" if ready else "NotReady", failure_message(error))

    async def _quarantine_self_labelled(self, node: str, changes: list[str]) -> None:
        """A node wrote its own placement labels (put back by the watch already): nobody else writes
        a value the config does not say on a node the control plane labelled. Its Node entity
        quarantines it (cordoned, the repair ladder decides), with the reason in its log."""
        self._reported.add(node)
        reason = f"changed its own labels: {', '.join(changes)}"[:1000]
        workflow.logger.warning("site %s: node %s %s; put back, quarantining", self._site.name, node, reason)
        self._show(f"{node} {reason}: put back, quarantined")
        try:
            await workflow.get_external_workflow_handle(node_workflow_id(node)).signal(
                flows.Node.quarantine, NodeQuarantine(reason=reason))
        except FailureError as error:
            workflow.logger.warning("site %s: node/%s not told to quarantine (%s)", self._site.name, node,
                                    failure_message(error))

    def _set_fleet_state(self, value: str) -> None:
        """The ``FleetState`` search attribute; under ``EVENTS_PATCH`` only when it changes (each
        upsert is a billed action, and the safety reconcile finds "ok" again and again)."""
        if self._events and value == self._fleet_state:
            return
        self._fleet_state = value
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(value)])

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
            act.incident_probe, SiteRef(site=self._site.name), start_to_close_timeout=QUICK,
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

    async def _release_orphaned_holds(self) -> None:
        """Repairs held for an incident this entity no longer knows (a reset, a restart): released.
        Refused (Temporal's visibility away), the next run tries again; the entity goes on."""
        site = self._site.name
        try:
            released = await workflow.execute_activity(
                act.release_orphaned_holds, SiteRef(site=site), start_to_close_timeout=QUICK,
                retry_policy=STORE_RETRY, summary=f"repairs at {site} held for an incident no longer running",
            )
        except ActivityError as error:
            workflow.logger.warning("site %s: orphaned repair holds not looked for (%s)", site, failure_message(error))
            return
        if released:
            workflow.logger.warning("site %s: released %d repairs held for an incident no longer running: %s",
                                    site, len(released), ", ".join(released))

    async def _put_back_closed_evacuations(self) -> None:
        """What evacuations of the site no longer running left behind (their cordon marks, the
        site's routing entry), or what this entity's put-back of one did not finish: put back. One of a
        person's, or of an incident an entity reset forgot; the entity's own incidents are put back as
        they close. Each once (``IncidentCarry.put_back``), none while an evacuation of the site runs.
        Bounded tries: the next safety look tries again (``IncidentCarry.put_back_unfinished``), until
        one is left to a person (``IncidentCarry.put_back_given_up``), never tried again."""
        site = self._site.name
        inc = self.state.incident
        # Left out: those put back, and those left to a person (never tried again).
        ask = ClosedEvacuationsInput(site=site, put_back=[*inc.put_back, *inc.put_back_given_up],
                                     unfinished=list(inc.put_back_unfinished))
        try:
            closed: list[str] = await workflow.execute_activity(
                act.closed_evacuations, ask,
                start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                summary=f"evacuations of {site} no longer running that left something",
            )
        except ActivityError as error:
            workflow.logger.warning("site %s: evacuations' leftovers not looked for (%s)", site, failure_message(error))
            return
        for evacuation_id in closed:
            note = await self._put_back_closed(evacuation_id, CLUSTER_RETRY)
            if note:
                self._show(f"{evacuation_id}{note.removeprefix(';')}")

    async def _put_back_closed(self, evacuation_id: str, retry: RetryPolicy) -> str:
        """Put back what the closed evacuation ``evacuation_id`` changed and left (its ``leftovers``),
        as its abort would, through the same activities: its cordons uncordoned (only those still
        marked its own: a node a person took or a repair fenced since stays), the site's Deployments
        scaled back and waited for (``PUT_BACK_READY_SECONDS`` at most), its routing weight as before
        the incident, the replicas it added elsewhere gone. Nodes it bought are their sites' (their
        max retires them). What the incident's outcome adds ("" when nothing was left).

        An earlier try that stopped (``IncidentCarry.put_back_unfinished``) is resumed where it
        stopped: the steps it did, and the Deployments of the step it stopped at that it scaled, are not
        done again, for people or the demand loop may have changed them since (``PUT_BACK_STEPS``)."""
        site = self._site.name
        earlier = self.state.incident.put_back_unfinished.get(evacuation_id)
        resume = earlier.step if earlier is not None else PUT_BACK_STEPS[0]
        progress = earlier.model_copy(deep=True) if earlier is not None else PutBackProgress()
        under_way = "reading what it left"  # for the note where it stops: the step, and its target

        def due(step: PutBackStep) -> bool:
            """Whether ``step`` is still to do (not done by an earlier try); if so, it is the one under way."""
            nonlocal under_way
            if PUT_BACK_STEPS.index(step) < PUT_BACK_STEPS.index(progress.step):
                return False
            if step != progress.step:
                progress.step, progress.done = step, []
            under_way = step
            return True

        async def scale_back(model: str, at: str, replicas: int) -> None:
            """One Deployment of the step under way, unless an earlier try of the step scaled it."""
            nonlocal under_way
            target = f"{model}@{at}"
            if target in progress.done:
                return
            under_way = f"{progress.step} {target}"
            await self._scale(model, at, replicas, retry)
            progress.done.append(target)

        released: list[str] = []
        late: list[str] = []
        deadline = workflow.now()
        try:
            left: EvacuationLeftovers = await workflow.execute_activity(
                act.evacuation_leftovers, EvacuationRef(site=site, workflow_id=evacuation_id),
                start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                summary=f"what {evacuation_id} changed and did not put back",
            )
            if left.put_back:
                if not left.running:
                    await self._put_back_once(evacuation_id)  # nothing to put back: not asked again
                return ""
            if earlier is None:
                workflow.logger.warning("site %s: %s closed without putting back what it changed: putting it back",
                                        site, evacuation_id)
            else:
                workflow.logger.warning("site %s: putting back the rest of what %s left, from its %s step on",
                                        site, evacuation_id, resume)
            if due("uncordon"):
                released = await workflow.execute_activity(
                    act.release_cordons, ReleaseCordonsInput(nodes=left.cordoned, cordoned_by=evacuation_id),
                    start_to_close_timeout=QUICK, retry_policy=retry,
                    summary=f"uncordon the nodes {evacuation_id} cordoned at {site} (none someone else holds)",
                )
            if due("scale-here"):
                for model, replicas in sorted(left.here.items()):
                    await scale_back(model, site, replicas)
            if due("wait-here"):
                deadline = workflow.now() + timedelta(seconds=min(self._incident_settings.ready_seconds,
                                                                  PUT_BACK_READY_SECONDS))
                for model in sorted(m for m, replicas in left.here.items() if replicas > 0):
                    try:
                        await wait_for_serving(model, site, deadline, poll_seconds=1.0,
                                               summary=f"wait for {model} back at {site}")
                    except ActivityError as error:
                        late.append(f"{model} ({failure_message(error)})")
            if due("weight"):
                await workflow.execute_activity(
                    act.set_site_weight,
                    SiteWeightInput(site=site, percent=100, healthy=True, draining=False, incident="",
                                    original_models=left.original_models, original_site=left.original_site,
                                    all_sites=left.all_sites),
                    start_to_close_timeout=QUICK, retry_policy=retry, summary=f"routing weight of {site} as before",
                )
            if due("routing-event"):
                event = SiteEvent(kind="restore", site=site, cap_percent=100,
                                  detail=f"restored to 100% ({evacuation_id} closed without putting back)")
                await workflow.execute_activity(
                    act.routing_event,
                    SiteEventInput(event=event, models=sorted(left.original_models), wait_seconds=50),
                    start_to_close_timeout=QUICK, heartbeat_timeout=timedelta(seconds=10), retry_policy=retry,
                    summary=f"routing of {len(left.original_models)} models: restore {site}",
                )
            if due("scale-elsewhere"):
                for model, where in sorted(left.elsewhere.items()):
                    for at, replicas in sorted(where.items()):
                        await scale_back(model, at, replicas)
        except ActivityError as error:
            workflow.logger.error("site %s: what %s left not all put back (%s): see the runbook", site,
                                  evacuation_id, failure_message(error))
            if workflow.patched(PUT_BACK_FINISHED_PATCH):
                progress.tries += 1
                # Cut: carried in the state (up to PUT_BACK_KEPT of them) and shown in the status.
                progress.failing = f"{under_way}: {failure_message(error)}"[:500]
                return self._put_back_stopped(evacuation_id, progress)
            return (f"; what it left not all put back ({failure_message(error)}): see GpufleetIncidentOpen in "
                    "docs/operations.md")
        await self._put_back_once(evacuation_id)
        elsewhere = sum(len(w) for w in left.elsewhere.values())
        if earlier is None:
            note = (f"; put back what it left: {len(released)} nodes uncordoned, {len(left.here)} models' replicas "
                    f"and routing at {site}, {elsewhere} scaled back elsewhere")
        else:
            note = (f"; put back the rest of what it left, from its {resume} step on (an earlier try did the steps "
                    f"before): {elsewhere} scaled back elsewhere")
        if late:
            note += f"; not ready again by {deadline:%H:%M:%S} UTC: {', '.join(late)}"
        workflow.logger.warning("site %s: %s%s", site, evacuation_id, note)
        return note

    def _put_back_stopped(self, evacuation_id: str, progress: PutBackProgress) -> str:
        """Remember how far the put-back of ``evacuation_id`` got, for the next safety look to go on
        from, or leave it to a person once out of tries (``PUT_BACK_TRIES``); as is the oldest
        unfinished one past ``PUT_BACK_UNFINISHED_KEPT``: never dropped unsaid. What the incident's
        outcome adds."""
        inc = self.state.incident
        unfinished = {i: p for i, p in inc.put_back_unfinished.items() if i != evacuation_id}
        if progress.tries >= PUT_BACK_TRIES:
            inc.put_back_unfinished = unfinished
            return f"; {self._give_up_put_back(evacuation_id, progress)}"
        unfinished[evacuation_id] = progress  # newest last
        while len(unfinished) > PUT_BACK_UNFINISHED_KEPT:
            oldest = next(iter(unfinished))
            self._give_up_put_back(oldest, unfinished.pop(oldest),
                                   why=f"more than {PUT_BACK_UNFINISHED_KEPT} put-backs unfinished at once")
        inc.put_back_unfinished = unfinished
        return (f"; what it left not all put back ({progress.failing}): tried again from there at the next safety "
                f"look (try {progress.tries} of {PUT_BACK_TRIES}); see GpufleetIncidentOpen in docs/operations.md")

    def _give_up_put_back(self, evacuation_id: str, progress: PutBackProgress, why: str = "") -> str:
        """Leave the put-back of ``evacuation_id`` to a person: logged at error, kept in the status
        (``IncidentCarry.put_back_given_up``) and in the details, never tried again by this run. What
        a person is told, after the evacuation's id."""
        inc = self.state.incident
        done = f"the steps before {progress.step}" + "".join(f", {t}" for t in progress.done)
        note = (f"what it left not all put back, left to a person ({why or f'{progress.tries} tries'}): "
                f"{progress.failing}; done: {done}; see \"Put-backs left to a person\" under GpufleetIncidentOpen "
                "in docs/operations.md")
        workflow.logger.error("site %s: %s %s", self._site.name, evacuation_id, note)
        given_up = {i: n for i, n in inc.put_back_given_up.items() if i != evacuation_id}
        given_up[evacuation_id] = note  # newest last
        inc.put_back_given_up = dict(list(given_up.items())[-PUT_BACK_KEPT:])
        return note

    async def _put_back_once(self, evacuation_id: str) -> None:
        """Never put back ``evacuation_id`` again: the cordons a repair holds keep its mark (a safety
        look finds it again), and a second put-back would scale the site and route to it as before its
        incident, undoing whatever people changed since. Remembered by this run, and recorded with the
        site's evacuation claim for the runs after it (a run started afresh carries nothing)."""
        inc = self.state.incident
        inc.put_back = [*(i for i in inc.put_back if i != evacuation_id), evacuation_id][-PUT_BACK_KEPT:]
        inc.put_back_unfinished.pop(evacuation_id, None)
        if not workflow.patched(PUT_BACK_RECORDED_PATCH):
            return
        site = self._site.name
        try:
            await workflow.execute_activity(
                act.evacuation_put_back, EvacuationRef(site=site, workflow_id=evacuation_id),
                start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                summary=f"record {evacuation_id} as put back",
            )
        except ActivityError as error:  # this run still remembers it; a run started afresh would not
            workflow.logger.warning("site %s: %s not recorded as put back (%s)", site, evacuation_id,
                                    failure_message(error))

    async def _scale(self, model: str, site: str, replicas: int, retry: RetryPolicy) -> None:
        await workflow.execute_activity(
            act.scale_serving, ScaleInput(model=model, site=site, replicas=replicas),
            start_to_close_timeout=QUICK, retry_policy=retry, summary=f"{model} at {site} → {replicas}",
        )

    async def _number(self, series: str, at_least: int) -> ChildNumber | None:
        """The next number of the entity's incidents (``series`` "incident": ``incident_number``) or
        fills ("fill": ``fill_number``), ``at_least`` or more, no run on record has, or one still
        running; None where Temporal did not answer (logged: the caller goes on)."""
        site, fills = self._site.name, series == "fill"
        runs = "fill" if fills else "evacuation"
        try:
            return await workflow.execute_activity(
                act.fill_number if fills else act.incident_number, ChildNumberInput(site=site, at_least=at_least),
                start_to_close_timeout=QUICK, retry_policy=NUMBER_RETRY,
                summary=f"{site}: the next {series} number no {runs} has, or one still running",
            )
        except ActivityError as error:
            workflow.logger.warning("site %s: %ss on record not read (%s)", site, runs, failure_message(error))
            return None

    async def _learn_incidents(self) -> None:
        """A run with no carried state (the entity's first, or one started again after it was
        terminated): its incidents go on from the highest number on record, and an evacuation of its
        own still running (the entity was stopped mid-incident) is its open incident."""
        inc, site = self.state.incident, self._site.name
        found = await self._number("incident", 1)
        if found is None:
            return  # each incident's number is checked again as its evacuation starts
        inc.count = found.n if found.running else found.n - 1
        if found.running:
            self._adopted = evacuation_workflow_id(site, found.n)
            inc.open = IncidentRecord(id=self._adopted, opened_at=workflow.now(),
                                      reason="begun by an earlier run of this entity, still evacuating")
            inc.evacuate = True

    async def _check_number(self, incident: IncidentRecord) -> tuple[bool, bool]:
        """(whether the incident's evacuation runs already, whether its number was checked:
        ``EVACUATION_IDS_PATCH``). Its provisional number may be on record (a reset run carries an
        old count): it takes the one ``incident_number`` gives."""
        if incident.id == self._adopted:
            return True, True
        if not workflow.patched(EVACUATION_IDS_PATCH):
            return False, False
        found = await self._number("incident", self.state.incident.count)
        if found is None:
            return False, True
        self.state.incident.count = found.n
        incident.id = evacuation_workflow_id(self._site.name, found.n)
        return found.running, True

    async def _evacuation_outcome(self, incident: IncidentRecord, running: bool, checked: bool) -> str:
        """Its evacuation's outcome: started as the entity's child, or (``running``, begun by an
        earlier run of the entity) waited for."""
        site = self._site.name
        if running:
            return await workflow.execute_activity(
                act.evacuation_end, EvacuationRef(site=site, workflow_id=incident.id),
                start_to_close_timeout=FOLLOW_WAIT, heartbeat_timeout=LONG_WATCH_HEARTBEAT,
                retry_policy=LONG_WATCH_RETRY, summary=f"until {incident.id} ends",
            )
        unique = _unique_start(site) if checked else {}
        result: EvacuationResult = await workflow.execute_child_workflow(
            flows.SiteEvacuation.TYPE, {**self._args.evacuation, "site": site, "reason": incident.reason},
            id=incident.id, result_type=EvacuationResult,
            # Outlives the entity on purpose: a reset or terminated entity must not stop an
            # evacuation halfway (traffic off, nodes draining); the next run finds it.
            parent_close_policy=ParentClosePolicy.ABANDON,
            static_summary=f"evacuate {site}: {incident.reason}", **unique,
        )
        return result.outcome

    async def _start_evacuation(self) -> None:
        inc = self.state.incident
        inc.evacuate = False
        incident = inc.open
        site = self._site.name
        running, checked = await self._check_number(incident)
        self._set_fleet_state("incident")
        if running:
            self._show(f"provider incident: {incident.id} still evacuating, begun before this run of the entity: "
                       "watching it")
        else:
            self._show(f"provider incident: {incident.reason}; evacuating ({incident.id})")
        # The same reason at the hold and the release: the release lets go only of what this held.
        held_for = incident_hold_reason(site, incident.id)
        try:
            await workflow.execute_activity(
                act.hold_site_repairs, HoldRepairsInput(site=site, hold=True, reason=held_for),
                start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                summary=f"running repairs at {site}: finish the rung, then hold",
            )
        except ActivityError as error:
            # The evacuation matters more than the hold: new repairs are refused while the incident
            # is open (``admit_repair``); the running ones go on. (Raised, it failed the Site entity.)
            workflow.logger.warning("site %s: running repairs not held (%s); evacuating all the same",
                                    site, failure_message(error))
            self._show(f"provider incident: {incident.reason}; evacuating ({incident.id}); running repairs "
                       f"not held: {failure_message(error)}")

        async def evacuate() -> None:
            try:
                incident.outcome = await self._evacuation_outcome(incident, running, checked)
            except Exception as error:  # noqa: BLE001 - a failed evacuation closes the incident for a person
                incident.outcome = f"failed: {failure_message(error)}"
            if incident.outcome not in ("restored", "aborted") and workflow.patched(PUT_BACK_PATCH):
                # Terminated, timed out, or its own put-back gave up: what it left is put back while
                # the incident is still open, so no next evacuation takes it for "as it was".
                incident.outcome += await self._put_back_closed(incident.id, PUT_BACK_RETRY)
            incident.closed_at = workflow.now()
            inc.history = [*inc.history, incident][-10:]
            inc.failures = []
            inc.api_failing_since = None
            inc.open = None
            try:
                await self._tell_held_nodes(incident.id)  # they ask again now, before the release
                # Until done: a release that gave up left the site's repairs held for good, and the
                # entity (this task never ending) unable to continue as new.
                await workflow.execute_activity(
                    act.hold_site_repairs, HoldRepairsInput(site=site, hold=False, reason=held_for),
                    start_to_close_timeout=QUICK, retry_policy=PUT_BACK_RETRY,
                    summary=f"release held repairs at {site}",
                )
            except ActivityError as error:  # refused for good: a person releases them
                workflow.logger.error("site %s: held repairs not released (%s): release each with "
                                      "`gpufleet repair release`", site, failure_message(error))
                incident.outcome = (f"{incident.outcome}; held repairs not released ({failure_message(error)}): "
                                    "release each with `gpufleet repair release`")
            finally:
                self._evac = None
                self.state.wanted = True

        self._evac = self.spawn(evacuate())

    def _show(self, line: str) -> None:
        s = self.state.status
        s.last = line
        ready = sum(state == "ready" for state in s.nodes.values())
        lines = [f"{len(s.nodes)} nodes ({ready} ready), min {s.min_nodes}, max {s.max_nodes}"]
        if s.filling:
            lines.append(f"filling: {s.filling}")
        lines += [f"- retiring {n}" for n in s.retiring]
        if self._passes.failing and self._passes.failing != line:
            lines.append(self._passes.failing)  # until a reconcile works, whatever else is shown
        if self._fill_paused() and self.state.fill_failed not in line:
            lines.append(self.state.fill_failed)  # until its pause is over, whatever else is shown
        if self._unnamed and self._unnamed != line:
            lines.append(self._unnamed)
        # Left to a person: shown whatever else is (the status query lists them all).
        given_up = list(self.state.incident.put_back_given_up.items())[-PUT_BACK_SHOWN:]
        lines += [f"- put-back of {evacuation_id}: {note}" for evacuation_id, note in given_up]
        show_details(line, *lines)

    # -- the site taken out of the fleet config (``REMOVED_PATCH``) -----------------------------
    async def _site_from_config(self, args: SiteInput) -> Site | None:
        """The site's entry in the config, the run's first activity. Refused as unknown (a run
        started, or continued as new, after the site left the config; or one whose read reached a
        worker whose config lacks a site just added): looked at as a reconcile's refusal is, and
        read again after a pause until the config names the site, or the run ends (None)."""
        while True:
            try:
                return await workflow.execute_activity(
                    act.resolve_site, ResolveSiteInput(site=args.site), start_to_close_timeout=QUICK,
                    retry_policy=PROVIDER_RETRY, summary=f"min/max of {args.site} from the config",
                )
            except ActivityError as error:
                if not self._refused_as_unknown(error):
                    raise
                if await self._removed_for_sure(args.site):
                    return None
                await self._passes.pause_after(error, step="read its site's config", show=self._show)

    @staticmethod
    def _refused_as_unknown(error: ActivityError) -> bool:
        """An activity refused the site (``InvalidRequest``: the worker's config does not name it),
        and this run takes that path (``REMOVED_PATCH``, asked here, in the task that took the
        failure)."""
        return failure_type(error) == "InvalidRequest" and workflow.patched(REMOVED_PATCH)

    async def _removed_for_sure(self, site: str) -> bool:
        """An activity refused ``site`` as unknown: does the config no longer name it, with nothing
        left there, for sure? One look (``site_configured``) each time; ``REMOVED_LOOKS`` in a row
        spanning ``removed_seconds`` are sure (``self._removed`` then says why). A look that finds
        it named (the refusal came from a worker whose config differs: a rolling deploy) or that
        finds nodes or identity records there starts again; one that fails counts nothing."""
        try:
            found: SiteConfigured = await workflow.execute_activity(
                act.site_configured, ResolveSiteInput(site=site), start_to_close_timeout=QUICK,
                retry_policy=CLUSTER_RETRY, summary=f"is {site} still in the fleet config? what is left there?",
            )
        except ActivityError as error:
            workflow.logger.warning("site %s: whether the config still names it not read (%s)", site,
                                    failure_message(error))
            return False
        now = workflow.now().timestamp()
        if found.configured or found.nodes or found.gone:
            self._unnamed_since, self._unnamed_looks = None, 0
            self._unnamed = "" if found.configured else self._left_there(site, found)
            return False
        if self._unnamed_since is None:
            self._unnamed_since = now
        self._unnamed_looks += 1
        ends = self._unnamed_since + self._args.removed_seconds
        if self._unnamed_looks >= REMOVED_LOOKS and now >= ends:
            self._removed = f"site {site} is no longer in the fleet config; nothing left there"
            return True
        since = datetime.fromtimestamp(self._unnamed_since, timezone.utc)
        self._unnamed = (f"not in the fleet config since {since:%H:%M:%S} UTC, nothing left there: this entity "
                         f"ends at its first look after {datetime.fromtimestamp(ends, timezone.utc):%H:%M:%S} UTC "
                         f"({REMOVED_LOOKS} looks at least) unless the config names the site again")
        return False

    @staticmethod
    def _left_there(site: str, found: SiteConfigured) -> str:
        """Why the entity of a site the config no longer names runs on, and what to do: what
        ``gpufleet config check --fleet`` and ``gpufleet sites`` say of it."""
        use = SiteInUse(site, tuple(found.nodes), tuple(tuple(pair) for pair in found.gone))
        return f"{removed_site_refusal(use, 'the fleet config')}. This entity runs on until then"

    async def _end_removed(self) -> str:
        """The site left the config with nothing there (``_removed_for_sure``): the run ends with
        why, once its own work in flight (a fill, a retirement, an evacuation) has ended, through
        the base's gate. The watch and the timer are cancelled: nothing starts them again."""
        self._stopping = True  # the watch's cancel is no failure to retry after a pause
        for task in (self._watch, self._timer):
            if task is not None:
                task.cancel()
        self._unnamed = ""
        waiting = [what for what, task in (("its fill", self._fill), ("its retirement", self._retirement),
                                           ("its evacuation", self._evac)) if task is not None]
        self._show(self._removed + (f": ends once {' and '.join(waiting)} has ended" if waiting else ""))
        await self.until_ready_to_end()
        workflow.logger.warning("site %s: %s: the entity ends", self._site.name, self._removed)
        self._show(self._removed)
        return self._removed

    async def _reconcile_or_later(self) -> None:
        """A reconcile that failed (the cluster away past its retries, or refusing: a 403) is
        shown and tried again after a pause, with everything the entity carries: raised, it failed
        the entity, and min/max, retirement and the incident rule stopped at its site. An incident
        to evacuate does not wait out the pause."""
        if self._retirement is not None:
            # Once it is done, as a reconcile waited for the retirement before it ran beside the loop:
            # counted now, the nodes it drains would be chosen twice, or uncordoned as "left cordoned".
            self._recount = True
            return
        if self._retires_beside and self._may_continue():
            # The next run reconciles first: a retirement started now would hold the continue-as-new
            # for another drain, for ever where a PodDisruptionBudget never yields.
            self.state.wanted = True
            return
        if not await self._passes.attempt("reconcile", self._reconcile, self._show,
                                          wake=lambda: self.state.incident.evacuate):
            self.state.wanted = True

    async def _reconcile(self) -> None:
        site, s = self._site, self.state.status
        try:
            nodes: list[SiteNode] = await workflow.execute_activity(
                act.site_nodes, SiteNodesInput(site=site.name),
                start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary=f"nodes at {site.name}",
            )
        except ActivityError as error:
            if self._refused_as_unknown(error) and await self._removed_for_sure(site.name):
                return  # the loop ends the run
            raise  # a failed pass: shown, tried again after a pause
        self._unnamed_since, self._unnamed_looks, self._unnamed = None, 0, ""
        s.nodes = {n.node_name: ("ready" if n.ready and not n.unproven else "joining") for n in nodes}
        count = len(nodes)
        self.state.node_count = count
        if self.state.incident.open is not None:
            self._show(f"{count} nodes; incident {self.state.incident.open.id} open: no fill or retire")
            return
        # Nodes its own retirement left cordoned (a drain that blocked): retired first while the
        # site is above its max (``surplus_to_retire``), else uncordoned, or they stay idle for good.
        own = [n for n in nodes if n.surplus_cordon]
        released = await self._release(own, "the site is within its max again") if count <= site.max_nodes else ""
        if self._fill is not None:
            self._show(f"{count} nodes; filling{released}")
            return
        if count < site.min_nodes:
            if self._fill_paused():
                # A fill failed a moment ago: the next waits out its pause (``FILL_PACED_PATCH``).
                self._set_fleet_state("fill-failed")
                self._show(f"below min ({count} < {site.min_nodes}): {self.state.fill_failed}{released}")
            elif await self._start_fill(site.min_nodes - count):
                self._show(f"below min ({count} < {site.min_nodes}): {self.state.status.filling} still filling it, "
                           f"begun before this run of the entity: waiting for it{released}")
            else:
                self._show(f"below min ({count} < {site.min_nodes}): acquiring {site.min_nodes - count}{released}")
        elif count > site.max_nodes:
            surplus = surplus_to_retire(nodes, count - site.max_nodes)
            chosen = {n.node_name for n in surplus}
            released = await self._release([n for n in own if n.node_name not in chosen],
                                           "not needed to bring the site to its max")
            # Held nodes are named only where they leave the site above its max.
            held = [n for n in nodes if n.held] if len(surplus) < count - site.max_nodes else []
            if surplus:
                await self._retire(surplus, count, held, released)
            else:
                # Only held nodes above the max: the site waits for their holders; a repair's
                # uncordon wakes it (the watch), and a node free again is retired then.
                self._show(f"above max ({count} > {site.max_nodes}): nothing retired, the nodes past it are held: "
                           + self._holders(held) + released)
        else:
            self._set_fleet_state("ok")
            self._show(f"{count} nodes, within min/max{released}")

    async def _release(self, own: list[SiteNode], why: str) -> str:
        """Uncordon the nodes its own retirement left cordoned that it no longer retires: nothing
        else would (a node marked so is no one else's), and each, paid for, would stay idle for
        good. ``release_cordons`` leaves one someone took since the count. What the status says."""
        if not own:
            return ""
        site = self._site.name
        names = [n.node_name for n in own]
        try:
            released: list[str] = await workflow.execute_activity(
                act.release_cordons, ReleaseCordonsInput(nodes=names, cordoned_by=CORDONED_BY_SURPLUS),
                start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                summary=f"uncordon {', '.join(names[:5])} at {site}: left cordoned by its retirement above the max",
            )
        except ActivityError as error:
            workflow.logger.warning("site %s: %s not uncordoned (%s); next reconcile", site, ", ".join(names),
                                    failure_message(error))
            return f"; {', '.join(names)} not uncordoned ({failure_message(error)}): next reconcile"
        if not released:
            return ""
        note = (f"uncordoned {', '.join(released)}, left cordoned by its retirement above the max "
                f"(a drain that blocked): {why}")
        workflow.logger.info("site %s: %s", site, note)
        return f"; {note}"

    async def _learn_fills(self) -> None:
        """A run with no carried state (the entity's first, or one started again after it was
        terminated): its fills go on from the highest number on record, and a fill of its own still
        running (the entity was stopped mid-fill; the fill outlives it on purpose) is its fill."""
        found = await self._number("fill", 1)
        if found is None:
            return  # each fill's number is checked again as it starts
        if found.running:
            self._adopt_fill(found.n)
        else:
            self.state.fills = found.n - 1

    async def _start_fill(self, need: int) -> bool:
        """Start a fill for ``need`` nodes; or (``FILL_IDS_PATCH``) take the fill of the site's still
        running, begun by an earlier run of the entity (a reset run carries an old count), rather
        than buy for the site twice. True where it took one."""
        site = self._site
        checked = workflow.patched(FILL_IDS_PATCH)
        found = await self._number("fill", self.state.fills + 1) if checked else None
        if found is not None and found.running:
            self._adopt_fill(found.n)
            return True
        self.state.fills = found.n if found is not None else self.state.fills + 1
        self.state.next_fill_at = None
        fill_id = fill_workflow_id(site.name, self.state.fills)
        request = {
            "count": need, "reason": f"site {site.name} below min",
            **self._args.fill_request,
            "constraints": {**self._args.fill_request.get("constraints", {}), "sites": [site.name]},
        }
        unique = _unique_start(site.name) if checked else {}
        self._follow_fill(fill_id, workflow.execute_child_workflow(
            flows.AcquireCapacity.TYPE, request, id=fill_id, result_type=CapacityResult,
            # Outlives the entity on purpose: the fill is what the site needs whatever
            # happens to this run, and its joins clean up after themselves; the next run takes it.
            parent_close_policy=ParentClosePolicy.ABANDON,
            static_summary=f"fill {site.name} to its min ({need} nodes)", **unique,
        ))
        return False

    def _adopt_fill(self, n: int) -> None:
        """The site's ``n``-th fill, begun by an earlier run of the entity and still running, is
        this run's: waited for to its end (``fill_end``), never started again."""
        site = self._site.name
        self.state.fills = max(self.state.fills, n)
        fill_id = fill_workflow_id(site, n)
        self._follow_fill(fill_id, workflow.execute_activity(
            act.fill_end, FillRef(site=site, n=n),
            start_to_close_timeout=FOLLOW_WAIT, heartbeat_timeout=LONG_WATCH_HEARTBEAT,
            retry_policy=LONG_WATCH_RETRY, summary=f"until {fill_id} ends",
        ))

    def _follow_fill(self, fill_id: str, ended: Awaitable[CapacityResult]) -> None:
        """The entity's fill task: the site is ``filling`` (no other fill, no retire) until ``ended``
        (the fill's result) answers; then it reconciles."""
        self.state.status.filling = fill_id
        self._set_fleet_state("filling")

        async def fill() -> None:
            try:
                result = await ended
                self.state.status.last = f"fill {fill_id}: {len(result.nodes)} of {result.requested} joined"
                self.state.fills_failed, self.state.next_fill_at, self.state.fill_failed = 0, None, ""
            except Exception as error:  # noqa: BLE001 - a failed fill is retried by the next reconcile
                self.state.status.last = f"fill {fill_id} failed: {failure_message(error)}"
                if self._events and workflow.patched(FILL_PACED_PATCH):
                    self._pace_fills(fill_id, error)
            finally:
                self.state.status.filling = ""
                self._fill = None
                self.state.wanted = True

        self._fill = self.spawn(fill())

    def _pace_fills(self, fill_id: str, error: BaseException) -> None:
        """A fill failed (``FILL_PACED_PATCH``): the next one waits a pause doubling from
        ``FILL_FIRST_PAUSE`` to ``FILL_MAX_PAUSE``, said with why. What failed it (a refusal, a
        provider or cluster that refuses every join alike) fails the next one started at once the same way."""
        state = self.state
        state.fills_failed += 1
        pause = min(FILL_FIRST_PAUSE * 2 ** min(state.fills_failed - 1, 10), FILL_MAX_PAUSE)
        at = workflow.now() + timedelta(seconds=pause)
        state.next_fill_at = at.timestamp()
        times = f", {state.fills_failed} in a row" if state.fills_failed > 1 else ""
        state.fill_failed = (f"fill {fill_id} failed ({failure_text(error)[:MAX_PROBLEM_SHOWN]}){times}; "
                             f"next fill at {at:%H:%M:%S} UTC (`reconcile_now` starts one at once)")
        workflow.logger.warning("site %s: %s", self._site.name, state.fill_failed)

    def _fill_paused(self) -> bool:
        """A failed fill's pause is on: no fill starts until ``next_fill_at`` (``FILL_PACED_PATCH``)."""
        at = self.state.next_fill_at
        return at is not None and workflow.now().timestamp() < at

    @staticmethod
    def _holders(held: list[SiteNode]) -> str:
        shown = "; ".join(f"{n.node_name} ({n.held})" for n in held[:5])
        more = f"; {len(held) - 5} more" if len(held) > 5 else ""
        return f"{shown}{more}: retired once free, if the site is still above its max"

    async def _retire(self, surplus: list[SiteNode], count: int, held: list[SiteNode], released: str) -> None:
        site, s = self._site, self.state.status
        self._set_fleet_state("retiring")
        s.retiring = [n.node_name for n in surplus]
        above = f"above max ({count} > {site.max_nodes})"
        held_note = f"; held, so not chosen: {self._holders(held)}" if held else ""
        # Only in the loop on events: the loop from before wakes on the server's suggestion alone,
        # and would spin on it while a retirement of its own ran.
        if self._events and workflow.patched(RETIRE_BESIDE_PATCH):
            self._retires_beside = True
            self._retirement = self.spawn(self._retire_beside(surplus, above, held_note, released))
            return
        self._show(f"{above}: retiring {len(surplus)}" + held_note)
        notes: list[str] = []
        try:
            for node in surplus:
                # Marked, the cordon is the surplus retirement's; a node someone takes during the
                # drain (a repair fences a GPU) is kept, and the next reconcile no longer chooses it.
                outcome = await drain_and_retire(site.name, node.node_name, node.machine_id, self._args.drain_seconds,
                                                 why="above the site's max", cordoned_by=CORDONED_BY_SURPLUS)
                notes += self._retired(node, outcome)
        finally:
            s.retiring = []  # a drain that failed (the cluster away) too: the next reconcile chooses again
        self._show("; ".join([f"retired surplus at {site.name}", *notes]) + released)

    def _retired(self, node: SiteNode, outcome: Retirement) -> list[str]:
        """What the retirement says of a node it drained."""
        if outcome.retired:
            self.state.status.nodes[node.node_name] = "gone"
            return []
        if outcome.kept:
            return [f"kept {node.node_name}: {outcome.kept} since it was chosen; the cordon is theirs"]
        return [f"{node.node_name}: {outcome.blocked or outcome.failed}; next reconcile"]

    async def _retire_beside(self, surplus: list[SiteNode], above: str, held_note: str, released: str) -> None:
        """The retirement as a task of its own (``RETIRE_BESIDE_PATCH``): one node at a time, each
        drain up to ``drain_seconds``, while the loop goes on. An incident that opens stops it: the
        surplus is moot while the site is evacuated. The drain in flight is cancelled and its node
        left cordoned with the Site's mark, as a blocked drain leaves one: the evacuation keeps a
        node cordoned before it began as it found it, and the first reconcile after the incident
        retires it first while the site is above its max, else uncordons it. (Uncordoned here, it
        could race the evacuation's own look: taken for cordoned before it, then cordoned by its
        drain with no mark, it stayed cordoned for good.)"""
        site, s = self._site, self.state.status
        notes: list[str] = []
        stopped = ""
        try:
            try:
                for done, node in enumerate(surplus):
                    if self.state.incident.open is not None:
                        stopped = self._stopped(surplus[done:], draining="")
                        break
                    self._show(f"{above}: retiring {len(surplus) - done}: draining {node.node_name} "
                               f"{until_in(self._args.drain_seconds)}" + held_note)
                    # Marked, the cordon is the surplus retirement's; a node someone takes during the
                    # drain (a repair fences a GPU) is kept, and the next reconcile no longer chooses it.
                    drain = asyncio.create_task(drain_node(
                        node.node_name, self._args.drain_seconds, cordoned_by=CORDONED_BY_SURPLUS,
                        summary=f"drain {node.node_name} (above the site's max; PDBs honoured)"))
                    await workflow.wait_condition(lambda: drain.done() or self.state.incident.open is not None)
                    if self.state.incident.open is not None:
                        if not drain.done():
                            drain.cancel()
                            try:
                                await drain
                            except (asyncio.CancelledError, ActivityError):
                                pass  # cancelled: it evicts no more
                        stopped = self._stopped(surplus[done:], draining=node.node_name)
                        break
                    outcome = await retire_drained(site.name, node.node_name, node.machine_id, drain.result(),
                                                   cordoned_by=CORDONED_BY_SURPLUS)
                    notes += self._retired(node, outcome)
            except ActivityError as error:
                # A drain that failed past its retries (the cluster away, refusing): shown, and after
                # the pause the next reconcile chooses again. An incident does not wait on the pause.
                s.retiring, self._recount = [], True
                await self._passes.pause_after(error, step="retire the surplus", show=self._show,
                                               wake=lambda: self.state.incident.open is not None)
                return
            s.retiring = []
            if stopped:
                workflow.logger.info("site %s: %s", site.name, stopped)
            self._show("; ".join([stopped or f"retired surplus at {site.name}", *notes]) + released)
        finally:
            s.retiring = []
            self._retirement = None
            # The reconcile that waited for it; stopped, the incident's end reconciles.
            self.state.wanted = self.state.wanted or (self._recount and not stopped)
            self._recount = False

    def _stopped(self, left: list[SiteNode], draining: str) -> str:
        """Why the retirement stopped (an incident opened), and what it leaves."""
        names = ", ".join(n.node_name for n in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        line = f"retirement of the surplus stopped, incident {self.state.incident.open.id} open: {names} not retired"
        if draining:
            line += (f"; {draining}'s drain cancelled, left cordoned (the Site's mark): after the incident it is "
                     "retired first if the site is still above its max, else uncordoned")
        return line


@workflow.defn(name="SiteSweep")
class SiteSweep:
    """Start every site's entity that is not running (the Schedule's safety sweep: a running entity
    wakes on its own watch and safety timer), then (``SWEEP_NODE_ENTITIES_PATCH``) every node's that
    must run and does not, and (``SWEEP_RECLAIMS_STOPPED_SPOT_PATCH``) the SpotReclaim of every spot
    node whose machine its provider stopped without a notice; signal-with-start the named sites'
    entities with ``reconcile`` (``{"sites": [...]}``)."""

    @workflow.run
    async def run(self, raw: Any = None) -> list[str]:
        request = parse_input(SignalSitesInput, raw or {})
        if not request.sites:
            started: list[str] = await workflow.execute_activity(
                act.ensure_sites, request, start_to_close_timeout=QUICK,
                retry_policy=STORE_RETRY, summary="start every site entity that is not running",
            )
            detail = f"{len(started)} site entities started" + (
                f": {', '.join(started[:20])}" if started else " (every one runs)")
            if workflow.patched(SWEEP_NODE_ENTITIES_PATCH):
                nodes: NodeEntitiesStarted = await workflow.execute_activity(
                    act.ensure_node_entities, start_to_close_timeout=QUICK, retry_policy=STORE_RETRY,
                    summary="start every node entity that must run and is not running",
                )
                detail += "; " + self._nodes_line(nodes)
            if workflow.patched(SWEEP_RECLAIMS_STOPPED_SPOT_PATCH):
                detail += "; " + await self._reclaim_stopped_spot()
            show_details("done", detail=detail)
            return started
        sites: list[str] = await workflow.execute_activity(
            act.signal_sites, request, start_to_close_timeout=QUICK,
            retry_policy=STORE_RETRY, summary="reconcile the named sites",
        )
        show_details("done", detail=f"reconcile sent to {len(sites)} sites")
        return sites

    @staticmethod
    async def _reclaim_stopped_spot() -> str:
        """The SpotReclaims of the spot nodes whose machines their provider stopped without a
        notice; what the pass says of them. A failure past its retries is said, not raised: the
        sites' and nodes' entities were started, and the next pass looks again."""
        try:
            found: StoppedSpotReclaims = await workflow.execute_activity(
                act.reclaim_stopped_spot, start_to_close_timeout=timedelta(minutes=5),
                retry_policy=CLUSTER_RETRY, summary="reclaim the spot nodes whose machines stopped without a notice",
            )
        except ActivityError as error:
            workflow.logger.warning("site sweep: stopped spot machines not looked at: %s", failure_message(error))
            return f"stopped spot machines not looked at ({failure_message(error)}): next pass"
        parts = []
        if found.started:
            workflow.logger.warning("site sweep: spot machines stopped without a notice, reclaim started for %s",
                                    ", ".join(found.started))
            parts.append(f"reclaim started for {', '.join(found.started)} (spot machine stopped without a notice)")
        if found.running:
            parts.append(f"reclaim already running for {', '.join(found.running)}")
        if found.repairing:
            parts.append(f"machine stopped under a running repair, not reclaimed: {', '.join(found.repairing)}")
        if found.left_to_a_person:
            parts.append(f"reclaim ended by a person, left to them: {'; '.join(found.left_to_a_person)}")
        if found.skipped:
            parts.append(f"not asked: {'; '.join(found.skipped)}")
        return "; ".join(parts) or "no spot machine stopped under a NotReady node"

    @staticmethod
    def _nodes_line(nodes: NodeEntitiesStarted) -> str:
        if not nodes.started and not nodes.left:
            return f"{nodes.running} node entities running, none missing"
        named = ", ".join(f"{n.node_name} (was {n.was})" for n in nodes.named)
        more = f" and {nodes.started - len(nodes.named)} more" if nodes.started > len(nodes.named) else ""
        left = f"; {nodes.left} more unwatched, for the next pass" if nodes.left else ""
        workflow.logger.warning("site sweep: %d node entities were not running and were started again: %s%s%s",
                                nodes.started, named, more, left)
        return f"{nodes.started} node entities started again (not running): {named}{more}{left}"
