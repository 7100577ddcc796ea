"""SiteEvacuation (id ``evacuate/<site>/<n>``): a provider incident's runbook.

Started by the Site entity when its incident rule trips (fleet.incident), or by
hand. Each step is stamped on a timeline (current details and the ``progress``
query):

1. **weight 0**: the site's routing weight goes to 0 for new sessions (each
   model's HTTPRoute/ConfigMap entry and the fleet-wide site document), marked
   unhealthy, draining, with the incident id;
2. **capacity**: the serving deficit (replicas per model at the site) is placed
   on other sites that already run the model's Deployment, honouring compliance
   geography; what does not fit is bought through AcquireCapacity restricted to
   those sites, at most what their ``max_nodes`` hold together (more is refused at
   its start; the timeline says "capacity capped"). Nothing compliant →
   ``needs-person``, waiting (``retry`` signal, or ``watch_recovery`` seeing a place or the
   site back) — never outside the geography;
3. **replicas elsewhere**: those Deployments scale up and must be ready;
4. **drain**: only then are the site's Deployments scaled to 0 and its nodes cordoned
   and drained (PDBs, deadline; ``DRAIN_AT_ONCE`` at a time at most): in that order, or each Deployment's own PodDisruptionBudget
   would hold the drain of its replicas to the deadline;
5. **wait for recovery**: a probe (provider API answers, every node's agent back) every
   ``probe_seconds`` inside one long activity, ``watch_recovery``, that returns when the site is
   back (no Temporal action per probe), or the operator update ``declare_recovered``; ``abort``
   (update), at any step, ends it and puts back what it changed (so do Temporal's cancel and a failed
   step), cutting short the wait in flight rather than waiting it out (the replicas elsewhere
   getting ready, the drain: its activity cancelled, a drain waited for until it stopped; the
   timeline says "abort taken while waiting"): its capacity request stopped, the nodes it
   cordoned uncordoned (not one cordoned before it began, nor one whose GPU a repair fences or
   whose cordon a person marked theirs since: ``held`` says why),
   the site's Deployments and routing weights as they were, what it added elsewhere gone.
   A cancel that comes while it puts back stops nothing (nor the wait for the capacity request
   an abort stopped, whose joined nodes are then retired): the put-back runs to its end, then
   an abort's run ends Canceled (a failed step's still fails);
6. **restore**: the nodes smoke-test (as many failing as would trip an incident →
   back to 5; fewer: each one that fails or garbles its answer stays cordoned and goes
   to its Node entity's repair ladder, on the GPUs its report named failing, else the whole
   node, but for one whose node agent cannot run its compute check, which stays cordoned for a
   person to fix the agent, no rung climbed for it; and the site returns with the others), the site's
   Deployments come back, the weight climbs in steps (10 → 50 → 100 % with a bake
   time between), the extra replicas elsewhere go, and the nodes bought for the
   evacuation are retired while their site is above its min, but not one someone holds (a
   repair fenced a GPU of it, a person marked it theirs): the timeline's "surplus drained"
   names each kept one and who holds it; it stays its site's, like any other node there. One
   whose drain blocked is uncordoned, its site's the same way, and named there with what
   blocked it.

What an evacuation of the site that ended left (terminated before its Site entity put it back) is
taken over as this one begins (``EvacuationFacts.left``): its cordons are this one's to lift, and
the site's Deployments, weights and the replicas it added elsewhere go back to how they were before
it, not to how this one found them.

One evacuation acts on a site at a time: one that finds another of its site running, begun first
(a person's ``gpufleet evacuate start`` beside the Site entity's), follows it (state
``following``): it changes nothing and ends when that one does, with its outcome.

The waits of steps 2 (no compliant site) and 5 (the one that runs for days; its watch returns
at least every ``recovery_watch_seconds``) continue as new when the server suggests it, carrying
the whole evacuation (``EvacuationCarry``); never while the AcquireCapacity
child or an activity is open.
"""

from __future__ import annotations

import asyncio
import re
from datetime import timedelta
from typing import Any, Awaitable, Callable

from pydantic import ValidationError
from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError, FailureError
from temporalio.workflow import ActivityCancellationType, ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import workflows as flows
    from fleet.naming import capacity_workflow_id, evacuation_workflow_id, node_queue, node_workflow_id
    from fleet.contracts import activities as act
    from fleet.messages.nodes import ResolveSiteInput, SmokeTestInput
    from fleet.messages.repair import MAX_NODE_GPUS, NodeQuarantine, SmokeReport
    from fleet.config import Site
    from fleet.models import append_bounded
    from fleet import search_attributes as sa
    from fleet.incident import (
        Deficit,
        IncidentSettings,
        Plan,
        nodes_needed,
        plan_moves,
        restore_percents,
        trip_threshold,
    )
    from fleet.messages.capacity import CapacityResult, ReleaseCordonsInput, SiteNodesInput, SiteNode
    from fleet.messages.evacuation import (
        EvacuationCarry,
        EvacuationFacts,
        EvacuationLeftovers,
        EvacuationProgress,
        EvacuationRef,
        EvacuationResult,
        FreeGpusInput,
        ReleaseNodesInput,
        ReleaseNodesResult,
        ScaleInput,
        SiteEvacuationInput,
        SiteRef,
        SiteWeightInput,
        SiteWeightResult,
        Step,
    )
    from workflows.inputs import check_text, describe, first_problem, parse_input
    from workflows.refusals import wrong_state
    from workflows.steps import (
        CHECK_UNAVAILABLE,
        CLUSTER_RETRY,
        FOLLOW_WAIT,
        LONG_WATCH_HEARTBEAT,
        LONG_WATCH_RETRY,
        PROVIDER_RETRY,
        PUT_BACK_RETRY,
        PUT_BACK_UNTIL,
        QUICK,
        SMOKE_RETRY,
        WAIT_HEARTBEAT,
        cancelled_by_request,
        cancelled_words,
        drain_and_retire,
        drain_node,
        failure_message,
        failure_text,
        failure_type,
        show_details,
        summarised,
        to_its_end_taking_cancel,
        until_in,
        until_run_began,
        wait_for_serving,
    )
    from fleet.cluster import CORDONED_BY_EVACUATION, ServingStatus
    from fleet.messages.routing import SiteEvent, SiteEventInput
    from fleet.messages.watches import RecoveryWatchInput, RecoveryWatchResult


#: Deprecated, to be removed in a later release (docs/design/patches.md, "The rule"): an abort cuts
#: short the waits of the way out, the replicas elsewhere getting ready (up to ``ready_seconds``, 15
#: minutes by default) and the drain (up to ``drain_seconds``): the step in flight is cancelled and
#: the put-back begins. Every evacuation open now started after it; the call stays, deprecated, as
#: the first of those waits begins, until no run holding its marker is open.
ABORT_CUTS_WAITS_PATCH = "evacuation-abort-cuts-waits"
#: The timeline keeps its first steps (how the evacuation began) and its newest (the end of a
#: restore fits whole); those between are counted. Each failed proof adds two steps: a site that
#: flapped for days grew the timeline, carried whole over continue-as-new and shown in the details,
#: toward Temporal's 2 MiB payload limit.
TIMELINE_FIRST, TIMELINE_NEWEST = 10, 40
#: The most drains (``_drain``) and proof smoke tests (``_prove``) the evacuation has in flight at
#: once; the others start as those end. A site may hold up to ``MAX_SITE_NODES`` (5,000) nodes, one
#: activity each: far under Temporal's pending-activities limit, yet enough that a site whose every
#: drain a PodDisruptionBudget holds to ``drain_seconds`` drains in ten rounds at 5,000 nodes.
DRAIN_AT_ONCE = 500
#: Deprecated, to be removed in a later release (docs/design/patches.md, "The rule"): more than
#: ``DRAIN_AT_ONCE`` nodes to drain or smoke-test, the evacuation runs at most that many at once
#: (before, one activity per node in one workflow task, past Temporal's 2,000 pending activities a
#: task that failed on every retry). Every evacuation open now started after it; the call stays,
#: deprecated, where the site has more than ``DRAIN_AT_ONCE`` nodes, until no run holding its marker
#: is open.
DRAINS_IN_TURNS_PATCH = "evacuation-drains-in-turns"
#: After an operator's ``declare_recovered``, a proof that no node passed restores the site when its
#: failing nodes are fewer than would trip an incident on their own: they are single nodes' faults,
#: handed to their Node entities (cordoned, the repair ladder decides) as when some node passed.
#: Before, "no node passed" sent the site back to waiting whatever the operator said: a site of one
#: or two nodes whose GPUs failed (three nodes' faults in the window trip the incident, replaced
#: ones included) waited for ever, for proofs its nodes could not pass while the incident held the
#: repairs that would fix them. Asked only there, so runs from before replay as they were.
DECLARED_RECOVERED_PATCH = "evacuation-declared-recovered-restores-unproven"
#: A node that failed the proof is handed to its Node entity with the GPUs its smoke test found
#: failing (``failing_gpus``, read from its validated report): those are fenced and repaired, each
#: repair proving its own GPU. Before, the quarantine carried a reason alone and the entity fenced
#: and repaired GPU 0, whatever GPU failed: a healthy GPU 0 was taken out of scheduling, and its
#: repair's proof (that GPU's counters and compute) passed, so the node served again with the GPU
#: that failed still broken. Asked in ``_quarantine_unproven`` only where a report named a GPU, so
#: runs from before, and proofs naming none, send what they sent.
QUARANTINES_FAILING_GPUS_PATCH = "evacuation-quarantines-the-failing-gpus"
#: A node whose proof ended ``ComputeCheckUnavailable`` (its node agent cannot run the compute check:
#: its image, its limits; no verdict on any GPU) stays cordoned and unproven, the site restored
#: without it, but is not handed to its Node entity's repair ladder: no rung fixes the agent, and
#: the quarantine began at a reboot (the machine restarted for nothing before the repair's own
#: hold, ``repair-holds-when-the-check-cannot-run``, caught its proof). Its reason (``progress.held``,
#: the timeline) names the agent's problem and the way back: a person fixes the node agent, then
#: uncordons the node. Before, it was quarantined like a node whose GPU failed. Asked in
#: ``_quarantine_unproven`` only where such a node is among the unproven, so runs from before, and
#: proofs with none, send what they sent. What the node says decides only about itself: it keeps
#: itself out of service (as any failed proof would), and no other machine.
HOLDS_WHERE_THE_CHECK_CANNOT_RUN_PATCH = "evacuation-holds-where-the-check-cannot-run"
#: Such a node (``HOLDS_WHERE_THE_CHECK_CANNOT_RUN_PATCH``) is still told to its Node entity: a
#: ``quarantine`` with ``hold_for_person``, which starts no repair and holds the node (its GPU 0) for a
#: person, the agent's words its reason: the entity's FleetState is ``needs-person`` (the
#: ``gpufleet_nodes_needing_a_person`` metric, the ``GpufleetNodeNeedsPerson`` alert), and the
#: person's ``gpufleet repair return <node> 0`` uncordons it once the agent is fixed. Before, the node
#: was sent nothing: it stayed cordoned with no alert (the incident's cleared as the site came back)
#: and only a ``kubectl uncordon`` nobody was reminded of brought it back. Asked in
#: ``_quarantine_unproven`` only where such a node is held, so runs from before send nothing for it.
TELLS_THE_NODE_IT_WAITS_PATCH = "evacuation-tells-the-node-it-waits-for-a-person"
#: The node's own message about why its check cannot run, cut to this wherever it is repeated.
CHECK_UNAVAILABLE_CHARS = 300
#: How the node agent's smoke test names the GPU a failure is about (``activities.node_agent.smoke_test``:
#: its counters' problems and its compute check both begin so).
_GPU_FAILURE = re.compile(r"GPU (\d{1,3}): ")
#: A failure no GPU is named for that every GPU's repair proof finds again (its smoke test checks
#: how many GPUs are visible whatever GPUs it tests): it asks for no more than those repairs.
_VISIBLE_FAILURE = re.compile(r"\d+ of \d+ GPUs visible")
#: The line a smoke test adds where its compute check cannot run but NVML found something
#: (``activities.node_agent.smoke_test``: "the compute check cannot run on <node>: ... (not run)"): it
#: says what was not checked, no fault of any GPU, so it asks for no GPU (not the whole node's GPU 0).
_NOT_RUN_FAILURE = re.compile(r"the compute check cannot run on .*\(not run\)", re.DOTALL)


def failing_gpus(failures: list[str], gpus: int) -> list[int] | None:
    """The GPUs a node's failed smoke test names failing (``failures``: its validated report's), each
    below ``gpus``, the site's count per machine (the control plane's, never the node's; at most
    ``MAX_NODE_GPUS``). The node's word decides only about its own GPUs, and only within that count.
    A failure that names no GPU, or one past the count (a node-wide fault, or a lie), adds GPU 0, the
    whole node's fallback. None: no GPU named (the whole node, as a quarantine always was)."""
    limit = min(gpus, MAX_NODE_GPUS)
    named: set[int] = set()
    whole_node = False
    for failure in failures:
        if (found := _GPU_FAILURE.match(failure)) is not None and int(found.group(1)) < limit:
            named.add(int(found.group(1)))
        elif _VISIBLE_FAILURE.fullmatch(failure) is None and _NOT_RUN_FAILURE.fullmatch(failure) is None:
            whole_node = True
    if not named:
        return None
    return sorted(named | ({0} if whole_node else set()))


class Aborted(Exception):
    pass


@workflow.defn(name="SiteEvacuation")
class SiteEvacuation:
    #: ``run``'s input: the input guard refuses its ``Carried`` fields in a run that did not continue as new.
    INPUT = SiteEvacuationInput

    def __init__(self) -> None:
        self._progress: EvacuationProgress | None = None
        #: Whether this run knows if it follows another evacuation begun first (its first
        #: activity asks): what ``declare_recovered`` is refused or taken against.
        self._follow_known = False
        self._recovered = ""
        #: An operator's ``declare_recovered`` the next proof has not yet judged (``_prove``). Not
        #: carried: the run never continues as new between the declaration and that proof.
        self._declared = False
        #: The proof that restores the site passed no node (declared recovered, under
        #: ``DECLARED_RECOVERED_PATCH``): nothing there can serve until their repairs, which wait for
        #: this evacuation to end, so ``_restore`` does not wait for the replicas back.
        self._none_proven = False
        #: How many nodes the last failed proof found whose agent cannot run its compute check (details only).
        self._agent_cannot_check = 0
        self._recovered_placing = False  # back before anything moved: nothing to move or drain
        self._abort = ""
        self._retry = 0
        self._acquired: list = []
        self._bought = 0
        #: In ``_restore``: the cluster calls retry until done (``_cluster_retry``).
        self._putting_back = False
        self._failed_proofs = 0
        #: Node → why it failed the proof that restored the site (it stays cordoned).
        self._unproven: dict[str, str] = {}
        #: Node → the GPUs its last failed smoke test named failing (``failing_gpus``; none: not there).
        self._failing_gpus: dict[str, list[int]] = {}
        #: Node → what its agent said, where the last proof's smoke test could not run its compute
        #: check there (``CHECK_UNAVAILABLE``): nothing proved the node, nothing said a GPU of it is broken.
        self._cannot_check: dict[str, str] = {}
        #: The unproven nodes left cordoned and not handed to the repair ladder (their agent cannot
        #: run its check: ``HOLDS_WHERE_THE_CHECK_CANNOT_RUN_PATCH``).
        self._not_handed: set[str] = set()
        #: ``TELLS_THE_NODE_IT_WAITS_PATCH``: those were told to their Node entity, held for a person there.
        self._tells_held = False
        #: The AcquireCapacity child while it runs (an abort stops it and waits for its result).
        self._capacity: asyncio.Task | None = None
        self._facts: EvacuationFacts | None = None
        #: A cancel of the run landed while it put back, and stopped nothing (``_undo``).
        self._cancel_taken = False
        #: Nodes whose cordon-and-drain began (``progress.drained`` has those it finished; a
        #: run never continues as new mid-drain, so this one need not be carried).
        self._cordoning: list[str] = []
        #: When this run last cancelled a ``watch_recovery`` still running: the watch hears the cancel
        #: at its next heartbeat, so until a heartbeat timeout later it may still be open.
        self._watch_cut_at = None
        #: ``_restore`` ran to its end: nothing it changed is left (``leftovers``).
        self._put_back_all = False
        #: What closed evacuations of the site left, taken over as it began (``EvacuationFacts.left``):
        #: put back with what it changed itself, as if it had changed it.
        self._adopted: dict[str, EvacuationLeftovers] = {}

    # -- operator surface -----------------------------------------------------------------
    @workflow.update
    async def declare_recovered(self, note: Any = "") -> EvacuationProgress:
        """The operator says the provider is back: restore now (nodes must still pass smoke tests)."""
        # In a run's first task (the operator's `recovered` as the evacuation continued as new, or
        # with its start) it was refused "still starting": it waits for the run, then is checked.
        await until_run_began(lambda: self._follow_known)
        self._check_recoverable()
        self._recovered = note or "declared recovered by an operator"
        self._declared = True
        return self._progress

    @declare_recovered.validator
    def _validate_recovered(self, note: Any = "") -> None:
        check_text("note", note)
        if self._follow_known:  # still starting: checked once it knows (above)
            self._check_recoverable()

    def _check_recoverable(self) -> None:
        self._require_running()
        if self._progress.following:
            raise wrong_state(f"this evacuation follows {self._progress.following}, which began first: "
                              "declare the site recovered there", "following")

    @workflow.update
    async def abort(self, reason: Any = "") -> EvacuationProgress:
        """Stop, and put back what it changed: nodes it cordoned uncordoned (unless held for a
        reason of their own), the site's Deployments and routing weights as they were, the
        replicas it added elsewhere and the capacity it bought gone. Answers at once (watch
        ``progress``: state ``restoring``, then ``aborted``)."""
        # An abort of the run's first task (``gpufleet evacuate start`` interrupted as its start
        # call returned), refused, left the command saying "nothing to abort" while the
        # evacuation went on draining the site.
        await until_run_began(lambda: self._progress is not None)
        self._abort = reason or "aborted by an operator"
        return self._progress

    @abort.validator
    def _validate_abort(self, reason: Any = "") -> None:
        check_text("reason", reason)
        if self._progress is not None:  # still starting: taken once it has (above)
            self._require_running()

    @workflow.signal
    def retry(self) -> None:
        """Look again now (after a person added capacity or a compliant site). From code; a
        person uses ``look_again``, which answers."""
        self._retry += 1

    @workflow.update
    async def look_again(self) -> str:
        """``retry`` for a person: look again now, and say whether that woke a wait."""
        # In a continued run's first task it was refused "still starting" (and a count taken
        # before ``run`` would be overwritten by the carried one): it waits for the run.
        await until_run_began(lambda: self._progress is not None)
        self._require_running()
        self._retry += 1
        p = self._progress
        if p.state == "needs-person":
            return f"looking again now for a place for the replicas (was: {p.needs_person})"
        return (f"noted, but nothing waits for it: the evacuation is {p.state} ({p.step}); it looks "
                "for a place by itself whenever it needs one")

    @look_again.validator
    def _validate_look_again(self) -> None:
        if self._progress is not None:  # still starting: checked once it has (above)
            self._require_running()

    def _require_running(self) -> None:
        """The evacuation's state, not the input, refuses: it has not started or has ended."""
        if self._progress is None:
            raise wrong_state("the evacuation is still starting", "starting")
        if self._progress.state in ("restored", "aborted", "followed", "cancelled"):
            raise wrong_state(f"the evacuation is not running (it has {self._progress.state})", self._progress.state)

    @workflow.query
    def progress(self) -> EvacuationProgress:
        return self._progress

    @workflow.query
    def leftovers(self) -> EvacuationLeftovers:
        """What it changed and has not put back: what its abort would put back. Asked of a closed run
        by its Site entity (``SiteEntity._put_back_closed``): a terminated run put back nothing. A run
        continues as new only while it waits (``EvacuationCarry``), so a continued run's cordons are
        all in ``drained``."""
        p = self._progress
        if p is None or self._facts is None or p.following or self._put_back_all:
            return EvacuationLeftovers(site=p.site if p else "", put_back=True)
        cordoned = [*p.drained, *(name for name in self._cordoning if name not in p.drained)]
        return EvacuationLeftovers(
            site=p.site, put_back=False, original_models=self._original_models, original_site=self._original_site,
            all_sites=self._all_sites, here={x.model: self._here_before(x) for x in self._facts.here},
            elsewhere={model: {target: self._replicas_before(model, target) for target in where}
                       for model, where in self._moved().items()},
            cordoned=[name for name in cordoned if name not in self._unproven],
        )

    def _state(self, state: str) -> None:
        if state != self._progress.state:
            self._progress.state = state
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(state)])

    def _mark(self, name: str, detail: str = "") -> None:
        p = self._progress
        p.timeline_left_out += append_bounded(p.timeline, Step(name=name, at=workflow.now(), detail=detail),
                                              TIMELINE_NEWEST, first=TIMELINE_FIRST)
        self._show(name)

    def _show(self, step: str, detail: str = "") -> None:
        p = self._progress
        p.step, p.step_detail = step, detail
        start = p.timeline[0].at if p.timeline else workflow.now()
        lines = [f"evacuating {p.site}"]
        if p.needs_person:
            lines.append(f"**needs a person**: {p.needs_person}")
        lines += [f"- stays cordoned: `{node}`: {why}" for node, why in sorted(p.held.items())]
        steps = [
            f"- {s.at.isoformat(timespec='seconds')} (+{(s.at - start).total_seconds():.1f}s) {s.name}"
            + (f": {s.detail}" if s.detail else "")
            for s in p.timeline
        ]
        if p.timeline_left_out:
            steps.insert(TIMELINE_FIRST, f"- … {p.timeline_left_out} steps left out")
        show_details(step, *lines, *steps, detail=detail)

    def _check(self) -> None:
        if self._abort:
            raise Aborted(self._abort)

    @staticmethod
    def _abort_cuts_waits() -> None:
        """An abort cuts the waits of the way out short (``_unless_aborted``): the deprecated patch's
        call, where the first of them begins."""
        workflow.deprecate_patch(ABORT_CUTS_WAITS_PATCH)

    async def _unless_aborted(self, waiting_for: str, *steps: Awaitable[Any]) -> list[Any]:
        """``steps``, a wait of the way out (the replicas elsewhere getting ready, the drains of the
        site's nodes), to their end: their results, or the first failure. An abort meanwhile cancels
        them and is taken at once: the timeline says which wait it cut, and ``Aborted`` goes to the
        put-back, which restores what the evacuation changed so far. Before, the abort was looked at
        once the wait was over (up to ``ready_seconds``, 15 minutes by default), the site at weight 0
        all that time. The run's own cancel meanwhile cancels them too, and is raised (the put-back
        follows, as for an abort)."""
        self._abort_cuts_waits()
        running = [asyncio.ensure_future(step) for step in steps]
        all_of = asyncio.gather(*running)
        try:
            await workflow.wait_condition(lambda: all_of.done() or bool(self._abort))
        except asyncio.CancelledError:
            await self._cut_short(running, all_of)
            raise
        if all_of.done():
            failed = all_of.exception()
            if failed is not None:
                # One step failed (a drain past its retries): the others are stopped before the
                # put-back that follows uncordons their nodes, or a retry of theirs would cordon and
                # evict there again after it.
                await self._cut_short(running, all_of)
                raise failed
            return all_of.result()
        self._show("abort taken", f"stopping the wait for {waiting_for}, then putting back what it changed")
        await self._cut_short(running, all_of)
        self._mark("abort taken while waiting", f"the wait for {waiting_for} cut short: {self._abort}")
        raise Aborted(self._abort)

    async def _cut_short(self, running: list[asyncio.Future], all_of: asyncio.Future) -> None:
        """Cancel each step still running and wait until every one has ended: a wait for serving (a
        read, ``TRY_CANCEL``) ends at once, a drain once its activity heard the cancel at a heartbeat
        (``WAIT_CANCELLATION_COMPLETED``), so nothing it does lands after the put-back began. To the
        end even when the run's cancel lands meanwhile (after an abort): the cancel is taken, and the
        run ends as it asked once all is put back (``_cancel_taken``)."""
        for step in running:
            step.cancel()
        if any(not step.done() for step in running):
            await to_its_end_taking_cancel(self._take_cancel, asyncio.ensure_future(workflow.wait(running)))
        if all_of.done() and not all_of.cancelled():
            all_of.exception()  # how they ended (cancelled) is not wanted: taken, not left unretrieved

    def _cancelled(self, error: BaseException) -> bool:
        """Whether ``error`` is this evacuation's cancel reaching the step it was in: it then ends as
        an abort does, never as the step's failure."""
        return cancelled_by_request(error)

    def _end_cancelled(self, why: str) -> None:
        self._mark("ended", why)
        self._state("cancelled")

    async def _wait(self, seconds: float, until, summary: str) -> bool:
        """Wait ``seconds`` or until ``until()`` / an abort; True when ``until()`` came true."""
        try:
            await workflow.wait_condition(lambda: bool(until() or self._abort), timeout=timedelta(seconds=seconds),
                                          timeout_summary=summary)
        except asyncio.TimeoutError:
            pass
        self._check()
        return bool(until())

    async def _continue_as_new_if_suggested(self, phase: str) -> None:
        """Called only where no child and no activity is open: nothing is cut off or orphaned."""
        if not workflow.info().is_continue_as_new_suggested():
            return
        if self._watch_cut_at is not None and workflow.now() - self._watch_cut_at < LONG_WATCH_HEARTBEAT:
            return  # a watch cancelled since may be open still: the next look continues
        await workflow.wait_condition(workflow.all_handlers_finished)
        self._check()
        carry = EvacuationCarry(
            phase=phase, progress=self._progress, facts=self._facts, settings=self._s,
            original_models=self._original_models, original_site=self._original_site, all_sites=self._all_sites,
            acquired=self._acquired, bought=self._bought, failed_proofs=self._failed_proofs, retry=self._retry,
            recovered=self._recovered, adopted=self._adopted,
        )
        workflow.continue_as_new(self._args.model_copy(update={"carry": carry}).model_dump(mode="json"))

    def _resume(self, carry: EvacuationCarry) -> None:
        self._progress, self._facts, self._s = carry.progress, carry.facts, carry.settings
        self._original_models, self._original_site = carry.original_models, carry.original_site
        self._all_sites, self._acquired = carry.all_sites, carry.acquired
        self._bought, self._failed_proofs, self._retry = carry.bought, carry.failed_proofs, carry.retry
        self._recovered = carry.recovered
        self._adopted = carry.adopted

    # -- the runbook ----------------------------------------------------------------------
    @workflow.run
    async def run(self, raw: Any) -> EvacuationResult:
        args = parse_input(SiteEvacuationInput, raw)
        self._args = args
        site = args.site
        if args.carry is not None:
            self._resume(args.carry)  # search attributes carry over by themselves
            self._follow_known = True  # a run that follows another never continues as new
            self._show(self._progress.step)
        else:
            self._progress = EvacuationProgress(site=site)
            workflow.upsert_search_attributes([sa.SITE.value_set(site), sa.FLEET_STATE.value_set("evacuating")])
            self._mark("detected", args.reason)
            try:
                first: str = await workflow.execute_activity(
                    act.evacuation_begun_first, EvacuationRef(site=site, workflow_id=workflow.info().workflow_id),
                    start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                    summary=f"another evacuation of {site} begun first?",
                )
            except (ActivityError, asyncio.CancelledError) as error:
                # A cancel comes as the activity cancelled, or (the activity completed as the
                # cancel came) as the wait's own cancel.
                if self._cancelled(error):
                    self._end_cancelled(f"{cancelled_words()} before it changed anything")
                    raise
                if isinstance(error, asyncio.CancelledError):
                    raise
                # Temporal's visibility away for minutes: acting is safer than not evacuating.
                first = ""
                self._mark("acting without knowing of others", failure_text(error))
            self._follow_known = True
            if first:
                return await self._follow(first)
        try:
            await self._evacuate(args.carry.phase if args.carry else "")
            outcome = "restored"
            self._state("restored")
            self._mark("restored")
        except Aborted as stop:
            await self._undo(f"aborted: {stop}")
            if self._cancel_taken:
                # Cancelled while it put back: all is back, and the run ends as the cancel asked.
                self._end_cancelled(f"{cancelled_words()} as it put back what it changed (aborted: {stop})")
                raise asyncio.CancelledError()
            outcome = "aborted"
            self._state("aborted")
            self._mark("aborted", str(stop))
        except (FailureError, asyncio.CancelledError) as error:
            # Failed (a step out of retries) or cancelled: the incident ends here too, so what it
            # changed goes back before the failure is reported.
            if self._cancelled(error):
                # As an abort, and the run ends cancelled (the SDK sees the request and a cancel error).
                why = cancelled_words()
                await self._undo(why)
                self._end_cancelled(why)
                raise
            why = "cancelled" if isinstance(error, asyncio.CancelledError) else f"failed: {failure_text(error)}"
            await self._undo(why)
            if self._cancel_taken:
                # Cancelled while it put back after a failure: the failure is what ended it, and stands.
                why += f"; {cancelled_words()} as it put back what it changed"
            self._mark("ended", why)
            if isinstance(error, (ActivityError, ChildWorkflowError)):
                # The root cause at the top ("site: unknown site 'x'", InvalidInput), not "Activity task
                # failed": what a person reads first in the UI, the CLI and the HTTP API. The step's
                # failure stays below it as the cause.
                root = error
                while isinstance(root, (ActivityError, ChildWorkflowError)) and root.cause is not None:
                    root = root.cause
                message = root.message if isinstance(root, FailureError) else str(root)  # without "Type: "
                raise ApplicationError(message, type=failure_type(error), non_retryable=True) from error
            raise
        return EvacuationResult(site=site, outcome=outcome, timeline=self._progress.timeline,
                                timeline_left_out=self._progress.timeline_left_out, held=self._progress.held)

    async def _follow(self, first: str) -> EvacuationResult:
        """Another evacuation of this site began first: wait for it to end, changing nothing (an
        abort of this one stops the wait; there is nothing to put back)."""
        p, site = self._progress, self._args.site
        p.following = first
        self._state("following")
        self._mark("following", f"{first} began evacuating {site} first")
        # No deadline of its own: it waits for the one it follows, which ends when the site recovers
        # or a person ends it (the commands at the site act on that one).
        self._show(f"following {first}", f"{first} began evacuating {site} first: this one changes nothing "
                                         f"and ends when it does. No deadline: that one ends once {site} recovers, "
                                         f"or when a person ends it (`gpufleet evacuate recovered {site}`, "
                                         f"`gpufleet evacuate abort {site}` act on it); watch it: "
                                         f"`temporal workflow query --workflow-id {first} --type progress`")
        ended = workflow.start_activity(
            act.evacuation_end, EvacuationRef(site=site, workflow_id=first), start_to_close_timeout=FOLLOW_WAIT,
            heartbeat_timeout=LONG_WATCH_HEARTBEAT, retry_policy=LONG_WATCH_RETRY, summary=f"until {first} ends",
        )
        try:
            await workflow.wait_condition(lambda: ended.done() or bool(self._abort))
        except asyncio.CancelledError as error:
            if self._cancelled(error):  # nothing to put back: it changed nothing
                ended.cancel()
                self._end_cancelled(f"{cancelled_words()} while following {first}")
            raise
        if not ended.done():
            ended.cancel()
            self._state("aborted")
            self._mark("aborted", self._abort)
            return EvacuationResult(site=site, outcome="aborted", timeline=p.timeline)
        how: str = ended.result()
        self._state("followed")
        self._mark("followed", f"{first}: {how}")
        return EvacuationResult(site=site, outcome=f"followed {first}: {how}", timeline=p.timeline)

    async def _evacuate(self, resume_at: str) -> None:
        if not resume_at:
            await self._weight_zero()
        if resume_at in ("", "placing"):
            # 2. the deficit, and capacity for it elsewhere.
            moves = await self._place()
            if not self._recovered_placing:  # back before anything moved: nothing to move or drain
                # 3. replicas elsewhere, ready.
                await self._scale_elsewhere(moves)
                # 4. drain the site.
                await self._drain()
        # 5. wait for recovery, 6. restore (smoke tests first; a failure goes back to waiting).
        while True:
            await self._wait_recovery()
            if await self._prove():
                break
            # Not yet: back off before the next proof (an operator's declare_recovered skips the wait).
            self._failed_proofs += 1
            backoff = min(self._s.probe_seconds * 2 ** self._failed_proofs, 600)
            at = workflow.now() + timedelta(seconds=backoff)
            agent = (f" (the node agent cannot run its compute check on {self._agent_cannot_check} nodes: fix it)"
                     if self._agent_cannot_check else "")
            self._show("backing off before the next proof", f"proof {self._failed_proofs} failed{agent}; next at "
                                                             f"{at:%H:%M:%S} UTC (or at once on `recovered`)")
            await self._wait(backoff, lambda: bool(self._recovered), "back off before the next proof")
        await self._restore()

    async def _weight_zero(self) -> None:
        """1. routing weight 0 for new sessions."""
        site = self._args.site
        facts: EvacuationFacts = await workflow.execute_activity(
            act.evacuation_facts, SiteRef(site=site), start_to_close_timeout=QUICK,
            retry_policy=PROVIDER_RETRY, summary=f"serving, routing and nodes at {site}",
        )
        self._facts = facts
        self._s: IncidentSettings = self._args.settings or facts.settings
        incident = workflow.info().workflow_id
        self._original_models = {}
        for serving in facts.here:
            table = facts.model_routes.get(serving.model)
            route = table.sites.get(site) if table else None
            self._original_models[serving.model] = route.weight if route and not route.incident and route.weight else 100
        route = facts.site_routes.sites.get(site) if facts.site_routes else None
        self._original_site = route.weight if route and not route.incident and route.weight else 100
        self._all_sites = [x.name for x in facts.sites]
        if facts.left:
            self._take_over(facts.left)
        await self._weight(0, healthy=False, draining=True, incident=incident)
        self._mark("weight 0", f"{len(self._original_models)} models")
        self._check()

    def _take_over(self, left: dict[str, EvacuationLeftovers]) -> None:
        """Take over what the closed evacuations ``left`` changed and did not put back (terminated
        before their Site entity put it back): the site as it was before them is the one to put back
        (its weights, its Deployments' replicas, the replicas they added elsewhere), and their cordons
        are this one's to uncordon (``release_nodes``, ``adopted``). Before, it took the site as it
        found it: their cordons kept as "cordoned before" (billed, idle), the Deployments they scaled
        to 0 put back at 0 and the replicas they added elsewhere kept."""
        self._adopted = left
        for model in self._original_models:
            self._original_models[model] = next(
                (x.original_models[model] for x in left.values() if model in x.original_models),
                self._original_models[model])
        self._original_site = next(iter(left.values())).original_site
        self._mark("took over what closed evacuations left", "; ".join(
            f"{workflow_id}: {len(x.cordoned)} nodes it cordoned, the replicas of "
            f"{len(x.here) + sum(len(where) for where in x.elsewhere.values())} Deployments before it"
            for workflow_id, x in sorted(left.items())))

    def _here_before(self, here: ServingStatus) -> int:
        """Replicas of the Deployment ``here`` at the site to put back: as before the evacuations it
        took over, else as it found them."""
        return next((x.here[here.model] for x in self._adopted.values() if here.model in x.here),
                    here.desired_replicas)

    def _moved(self) -> dict[str, list[str]]:
        """Each model's sites it added replicas to, or an evacuation it took over did: scaled back."""
        moved = {model: set(where) for model, where in self._progress.moves.items()}
        for left in self._adopted.values():
            for model, where in left.elsewhere.items():
                moved.setdefault(model, set()).update(where)
        return {model: sorted(where) for model, where in sorted(moved.items())}

    def _replicas_before(self, model: str, site: str) -> int:
        """Replicas of ``model`` at another ``site`` before the evacuation moved any there: before
        one it took over did, else from the last facts read before the move (a Deployment a person
        added meanwhile counts)."""
        taken = next((x.elsewhere[model][site] for x in self._adopted.values()
                      if site in x.elsewhere.get(model, {})), None)
        if taken is not None:
            return taken
        return next((x.desired_replicas for x in self._facts.elsewhere if (x.model, x.site) == (model, site)), 0)

    async def _weight(self, percent: int, healthy: bool, draining: bool, incident: str) -> SiteWeightResult:
        if percent > 0:
            draining = False  # a site on its way back takes new sessions up to its cap
        result: SiteWeightResult = await workflow.execute_activity(
            act.set_site_weight,
            SiteWeightInput(site=self._args.site, percent=percent, healthy=healthy, draining=draining,
                            incident=incident, original_models=self._original_models,
                            original_site=self._original_site, all_sites=self._all_sites),
            start_to_close_timeout=QUICK, retry_policy=self._cluster_retry(),
            summary=f"routing weight of {self._args.site} → {percent}%",
        )
        self._progress.weights = result.weights
        await self._tell_routing(percent, incident)
        return result

    async def _tell_routing(self, percent: int, incident: str) -> None:
        """Each model's Routing entity takes the decision, and the activity returns once the
        routes reflect it: the drain that follows weight 0 must find no new sessions coming."""
        site = self._args.site
        if percent == 0:
            event = SiteEvent(kind="drain", site=site, detail=incident)
        else:
            event = SiteEvent(kind="restore", site=site, cap_percent=percent,
                              detail=f"restored to {percent}%" + (f" ({incident})" if incident else ""))
        await workflow.execute_activity(
            act.routing_event, SiteEventInput(event=event, models=sorted(self._original_models), wait_seconds=50),
            start_to_close_timeout=QUICK, heartbeat_timeout=timedelta(seconds=10),
            retry_policy=self._cluster_retry(), summary=f"routing of {len(self._original_models)} models: {event.kind} "
                                                f"{site}" + (f" at {percent}%" if percent else ""),
        )

    def _deficits(self) -> list[Deficit]:
        return self._facts.deficits(self._args.site)

    async def _free(self, deficits: list[Deficit]) -> dict[str, int]:
        sites = sorted({t for d in deficits for t in d.targets})
        if not sites:
            return {}
        return await workflow.execute_activity(
            act.free_gpus, FreeGpusInput(sites=sites), start_to_close_timeout=QUICK,
            retry_policy=CLUSTER_RETRY, summary="free GPUs at the target sites",
        )

    async def _place(self) -> dict[str, dict[str, int]]:
        p, site = self._progress, self._args.site
        prices = {x.name: x.price_per_gpu_hour for x in self._facts.sites}
        while True:
            deficits = self._deficits()
            free = await self._free(deficits)
            prefer = sorted(free, key=lambda name: (prices.get(name, 0), name))
            plan: Plan = plan_moves(deficits, free, prefer)
            if plan.impossible:
                geo = self._facts.site.geography
                p.needs_person = "; ".join(
                    f"{m}: {why}" + (f" inside geography {geo!r}" if self._facts.site.compliance else "")
                    for m, why in sorted(plan.impossible.items())
                )
                self._state("needs-person")
                await self._watch_placing(sorted(plan.impossible))
                if self._recovered:
                    self._back_while_placing()
                    return {}
                self._facts = await workflow.execute_activity(
                    act.evacuation_facts, SiteRef(site=site),
                    start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY, summary="serving again",
                )
                await self._continue_as_new_if_suggested("placing")
                continue
            if p.needs_person:
                p.needs_person = ""
                self._state("evacuating")
            missing = plan.missing_gpus(deficits)
            if missing and self._bought == 0:
                self._bought += 1
                await self._acquire(deficits, plan, missing)
                continue
            if missing:
                p.needs_person = f"{sum(plan.missing.values())} replicas have no room elsewhere (capacity short)"
                self._show("capacity short; moving what fits")
            p.moves = plan.moves
            return plan.moves

    async def _watch_placing(self, impossible: list[str]) -> None:
        """The needs-person wait: until the watch sees the site back (``_recovered``) or what nothing
        may take differ from ``impossible``, or ``retry``, ``declare_recovered`` or an abort; each
        return of the watch with nothing changed (its safety bound) starts the next one."""
        s, site = self._s, self._args.site
        seen = self._retry
        while True:
            self._show("waiting: nothing may take the replicas",
                       f"probing every {s.probe_seconds:g} s for a place and for {site}'s recovery, next look "
                       f"{until_in(s.recovery_watch_seconds)} at most (or `gpufleet evacuate retry`); a site "
                       "that recovers meanwhile comes back")
            found = await self._watch_recovery(False, impossible, lambda: self._retry != seen,
                                               f"{site} back, or a place for its {len(impossible)} models?")
            self._check()
            if found is not None and found.recovered:
                self._recovered = found.detail
            if found is None or found.recovered or found.placing_changed:
                return
            await self._continue_as_new_if_suggested("placing")

    async def _watch_recovery(self, recovered: bool | None, impossible: list[str] | None, wake: Callable[[], bool],
                              summary: str) -> RecoveryWatchResult | None:
        """One ``watch_recovery``: its answer, or None when ``wake()``, ``declare_recovered`` or an
        abort came first (the watch is cancelled then, as on the run's cancel)."""
        s = self._s
        watch = workflow.start_activity(
            act.watch_recovery,
            RecoveryWatchInput(site=self._args.site, recovered=recovered, impossible=impossible,
                               probe_seconds=s.probe_seconds, max_wait_seconds=s.recovery_watch_seconds),
            start_to_close_timeout=timedelta(seconds=s.recovery_watch_seconds) + QUICK,
            heartbeat_timeout=LONG_WATCH_HEARTBEAT, retry_policy=LONG_WATCH_RETRY, summary=summary,
        )
        try:
            await workflow.wait_condition(lambda: watch.done() or wake() or bool(self._recovered or self._abort))
        finally:
            if not watch.done():
                watch.cancel()
                self._watch_cut_at = workflow.now()
        if not watch.done():
            return None
        return watch.result()  # a watch that failed for good fails the step, as its probe did

    def _back_while_placing(self) -> None:
        """The site is back (declared, or the watch saw it) in the needs-person wait: nothing moves
        and nothing drains, the proof and the restore follow."""
        p = self._progress
        self._recovered_placing = True
        p.needs_person = ""
        self._state("evacuating")
        self._mark("recovered before anything moved", self._recovered)

    async def _acquire(self, deficits: list[Deficit], plan: Plan, missing_gpus: int) -> None:
        p, s, site = self._progress, self._s, self._args.site
        targets = sorted({t for d in deficits if d.model in plan.missing for t in d.targets})
        per_machine = min((x.gpus_per_machine for x in self._facts.sites if x.name in targets), default=1)
        count = nodes_needed(missing_gpus, per_machine)
        # The request refuses a count its sites can never hold: ask for what they can (None: facts
        # recorded before they carried max_nodes, asked for the whole count as then).
        limits = [x.max_nodes for x in self._facts.sites if x.name in targets]
        most = None if None in limits else sum(limits)
        if most is not None and count > most:
            self._mark("capacity capped", f"{count} nodes needed ({missing_gpus} GPUs), {most} at most: "
                                          f"the max_nodes of {', '.join(targets)} together")
            count = most
            if count == 0:
                return  # nothing may be bought there: what fits moves
        base = dict(self._args.capacity_request)
        request = {
            **base, "count": count, "reason": f"evacuate {site}",
            "deadline_seconds": base.get("deadline_seconds", s.capacity_deadline_seconds),
            "constraints": {**base.get("constraints", {}), "sites": targets},
        }
        child_id = capacity_workflow_id(workflow.info().workflow_id.replace("/", "-"))
        p.capacity_request = child_id
        self._mark("capacity requested", f"{count} nodes ({missing_gpus} GPUs) at {', '.join(targets)}")
        self._show("waiting for capacity", f"{count} nodes from {child_id} {self._until(request['deadline_seconds'])} "
                                           "at most; then the replicas move to what joined")
        self._capacity = asyncio.ensure_future(workflow.execute_child_workflow(
            flows.AcquireCapacity.TYPE, request, id=child_id, result_type=CapacityResult,
            # Cancel, not terminate: its joins then delete their machines (a terminated
            # request would leave them joining, or joined, for nobody).
            parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
            static_summary=f"replacement capacity for {site}'s replicas",
        ))
        try:
            # An abort stops the purchase now, not after its deadline: the request stops its joins
            # and still answers with the nodes that joined (retired as the evacuation restores).
            aborted = asyncio.ensure_future(workflow.wait_condition(lambda: bool(self._abort)))
            await workflow.wait([self._capacity, aborted], return_when=asyncio.FIRST_COMPLETED)
            if not aborted.done():
                aborted.cancel()
            if not self._capacity.done():
                await self._stop_capacity(f"the evacuation of {site} was aborted")
            result: CapacityResult = await self._capacity_to_its_end()
            self._acquired = result.nodes
            p.acquired = [n.node_name for n in result.nodes]
            self._mark("capacity joined", f"{len(result.nodes)} of {count} nodes")
            self._capacity = None
        except ChildWorkflowError as error:
            self._capacity = None
            self._acquired = []
            self._mark("capacity failed", failure_text(error))
        # Cancelled meanwhile: ``_capacity`` stays set, so the undo stops it and takes its nodes.
        self._check()

    async def _capacity_to_its_end(self) -> CapacityResult:
        """The result of the capacity request an abort stopped, waited for to the end even when
        Temporal's cancel lands meanwhile: a cancelled wait would cancel the request too, and lose its
        result (the nodes it joined, for the put-back to retire). The cancel is taken
        (``_cancel_taken``): the run ends as it asked once all is put back."""
        return await to_its_end_taking_cancel(self._take_cancel, self._capacity)

    def _take_cancel(self) -> None:
        """A cancel landed during a step that runs to its end: the run ends as the cancel asked once
        all is back (``_cancel_taken``)."""
        self._cancel_taken = True

    @staticmethod
    def _until(seconds: Any) -> str:
        """``until HH:MM:SS UTC`` that many seconds from now; "until its deadline" for a value a
        caller passed in ``capacity_request`` that is no number of seconds (the request refuses it)."""
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 < seconds <= 366 * 86400:
            return f"until {workflow.now() + timedelta(seconds=seconds):%H:%M:%S} UTC"
        return "until its deadline"

    async def _stop_capacity(self, why: str) -> None:
        """Tell the capacity request in flight to stop (its joins delete their machines); its
        result, with the nodes that joined before, still comes back through ``_capacity``."""
        try:
            await workflow.get_external_workflow_handle(self._progress.capacity_request).signal(flows.AcquireCapacity.stop, why)
        except FailureError as error:  # closed meanwhile: its result is there already
            workflow.logger.info("capacity request %s not stopped: %s", self._progress.capacity_request,
                                 failure_message(error))

    async def _scale_elsewhere(self, moves: dict[str, dict[str, int]]) -> None:
        deadline = workflow.now() + timedelta(seconds=self._s.ready_seconds)
        waits = []
        for model, where in sorted(moves.items()):
            for target, extra in sorted(where.items()):
                replicas = self._replicas_before(model, target) + extra
                await self._scale(model, target, replicas)
                waits.append((model, target))
        self._check()
        if waits:
            self._show("waiting for the replicas elsewhere",
                       f"{len(waits)} ready by {deadline:%H:%M:%S} UTC at most; then the site drains")
        for model, target in waits:
            try:
                await self._unless_aborted(f"{model} at {target} to be ready (by {deadline:%H:%M:%S} UTC at most)",
                                           wait_for_serving(model, target, deadline, poll_seconds=1.0,
                                                            summary=f"wait for {model} at {target}"))
            except ActivityError as error:
                if self._cancelled(error):
                    raise
                self._progress.needs_person = f"{model} at {target} not ready: {failure_message(error)}"
                self._show("replicas elsewhere not all ready; draining anyway")
            self._check()
        self._mark("replicas ready elsewhere", ", ".join(f"{m}@{t}" for m, t in waits) or "nothing to move")

    async def _scale(self, model: str, site: str, replicas: int) -> None:
        await workflow.execute_activity(
            act.scale_serving, ScaleInput(model=model, site=site, replicas=replicas),
            start_to_close_timeout=QUICK, retry_policy=self._cluster_retry(), summary=f"{model} at {site} → {replicas}",
        )

    async def _drain(self) -> None:
        p, s, site = self._progress, self._s, self._args.site
        blocked = []
        # Its replicas elsewhere are ready: the site's go first, so no drain waits on their
        # PodDisruptionBudgets (a replacement could never schedule on the cordoned site).
        for here in self._facts.here:
            await self._scale(here.model, site, 0)
        self._check()  # aborted meanwhile: nothing cordoned, the Deployments go back

        # Its cordons are marked its own (its id): one it leaves behind (the run terminated) is then no
        # person's, and its Site entity puts it back (``leftovers``). Every node drains all the same,
        # one someone else holds too (``machine_goes``: the site is lost), but only a schedulable one is
        # marked: a node cordoned before keeps its cordon, and its mark or none, as it was.
        mine = workflow.info().workflow_id

        # An abort cuts the drain short: the put-back that follows uncordons these nodes, so it waits
        # for each drain to stop (at its next heartbeat) rather than race its evictions and cordon.
        self._abort_cuts_waits()
        cancel = ActivityCancellationType.WAIT_CANCELLATION_COMPLETED

        total = len(self._facts.nodes)
        # A large site drains DRAIN_AT_ONCE nodes at a time, under Temporal's pending-activities limit.
        room = asyncio.Semaphore(DRAIN_AT_ONCE) if self._in_turns(total) else None

        async def drain_one(name: str) -> None:
            self._cordoning.append(name)  # cordoned from here on, even if the drain then fails
            result = await drain_node(name, s.drain_seconds, summary=f"cordon and drain {name} (PDBs honoured)",
                                      cordoned_by=mine, machine_goes=True, cancellation_type=cancel)
            p.drained.append(name)
            blocked.extend(f"{b.key}: {b.reason}" for b in result.blocked)

        def show_turns() -> None:
            self._show("draining", f"draining {DRAIN_AT_ONCE} at a time: {len(p.drained):,} of {total:,} done "
                                   f"(cordoned and drained, PodDisruptionBudgets honoured, each for {s.drain_seconds:g} s "
                                   "at most, then the pods left are named)")

        async def drain(name: str) -> None:
            if room is None:
                return await drain_one(name)
            async with room:  # a node not yet started when an abort cuts the drain short is never started
                if self._abort:
                    return
                await drain_one(name)
                show_turns()

        by = workflow.now() + timedelta(seconds=s.drain_seconds)
        if room is None:
            self._show("draining", f"{total} nodes cordoned and drained, PodDisruptionBudgets honoured "
                                   f"until {by:%H:%M:%S} UTC (then the pods left are named)")
            waiting_for = f"the drain of {total} nodes (until {by:%H:%M:%S} UTC at most)"
        else:
            show_turns()
            # Each turn lasts a drain's deadline at most: the last ends by then.
            last = workflow.now() + timedelta(seconds=s.drain_seconds * -(-total // DRAIN_AT_ONCE))
            waiting_for = (f"the drain of {total:,} nodes ({DRAIN_AT_ONCE} at a time, until "
                           f"{last:%H:%M:%S} UTC at most)")
        await self._unless_aborted(waiting_for, *(drain(n.name) for n in self._facts.nodes))
        self._check()
        self._mark("drained", f"{len(p.drained)} nodes" + (f"; blocked: {'; '.join(blocked)}" if blocked else ""))

    def _in_turns(self, nodes: int) -> bool:
        """Whether ``nodes`` drains or smoke tests run ``DRAIN_AT_ONCE`` at a time: past that many (the
        deprecated patch's call only there, where it was asked)."""
        if nodes <= DRAIN_AT_ONCE:
            return False
        workflow.deprecate_patch(DRAINS_IN_TURNS_PATCH)
        return True

    async def _wait_recovery(self) -> None:
        self._state("waiting-for-recovery")
        self._show("waiting for recovery")
        await self._watch_until_recovered()
        self._check()
        self._mark("recovered", self._recovered)

    async def _watch_until_recovered(self) -> None:
        """Until the site is back: the watch's first look says why not (at once), the next waits for
        the verdict to flip; ``declare_recovered`` or an abort cuts it short. Each return with nothing
        changed (its safety bound) says the why again and starts the next."""
        s, site = self._s, self._args.site
        seen: bool | None = None
        while not self._recovered:
            found = await self._watch_recovery(seen, None, lambda: False, f"is {site} back?")
            if found is None:
                return  # declared recovered, or aborted: the caller checks
            if found.recovered:
                self._recovered = found.detail
                return
            seen = False
            self._show("waiting for recovery", f"{found.detail}; probing every {s.probe_seconds:g} s, next look "
                                               f"{until_in(s.recovery_watch_seconds)} at most "
                                               "(or `gpufleet evacuate recovered`)")
            await self._continue_as_new_if_suggested("recovering")

    async def _prove(self) -> bool:
        """Every node at the site passes a smoke test; a failure sends us back to waiting."""
        s, site = self._s, self._args.site
        self._state("restoring")
        nodes = await workflow.execute_activity(
            act.site_nodes, SiteNodesInput(site=site), start_to_close_timeout=QUICK,
            retry_policy=CLUSTER_RETRY, summary=f"nodes at {site}",
        )
        gpus = self._facts.site.gpus_per_machine
        failures = []
        unproven: dict[str, str] = {}
        # A large site is smoke-tested DRAIN_AT_ONCE nodes at a time, under Temporal's pending-activities limit.
        room = asyncio.Semaphore(DRAIN_AT_ONCE) if self._in_turns(len(nodes)) else None
        tested: list[str] = []
        self._failing_gpus = {}  # this proof's (``_smoke_checked``)
        self._cannot_check = {}  # this proof's

        def show_turns() -> None:
            self._show("smoke-testing the nodes", f"smoke-testing {DRAIN_AT_ONCE} at a time: {len(tested):,} of "
                                                  f"{len(nodes):,} done (each answers within {s.smoke_test_seconds:g} s "
                                                  "of its start or fails its proof)")

        if room is None:
            by = workflow.now() + timedelta(seconds=s.smoke_test_seconds)
            self._show("smoke-testing the nodes", f"{len(nodes)} nodes at {site} until {by:%H:%M:%S} UTC at most (one "
                                                  "that has not answered by then fails its proof)")
        else:
            show_turns()

        async def smoke(name: str) -> None:
            if room is None:
                return await smoke_one(name)
            async with room:
                await smoke_one(name)
                tested.append(name)
                show_turns()

        async def smoke_one(name: str) -> None:
            try:
                why = await self._smoke_checked(name, gpus)
                if why:
                    failures.append(f"{name}: {why}")
                    unproven[name] = why
            except ActivityError as error:
                if self._cancelled(error):
                    raise
                unproven[name] = f"smoke test did not run ({failure_type(error)})"
                if failure_type(error) == CHECK_UNAVAILABLE:
                    # The node's own words (bounded): its agent, not a GPU, is what failed.
                    said = failure_message(error)[:CHECK_UNAVAILABLE_CHARS]
                    self._cannot_check[name] = said
                    failures.append(f"{name}: smoke test did not run ({CHECK_UNAVAILABLE}): the node agent cannot "
                                    f"run its compute check, its GPUs neither proven nor failed ({said})")
                else:
                    failures.append(f"{name}: smoke test did not run ({failure_type(error)})")

        await asyncio.gather(*(smoke(n.node_name) for n in nodes))
        self._check()
        proven = [n.node_name for n in nodes if n.node_name not in unproven]
        # Per node: the site waits only while its failing nodes would trip an incident on their
        # own (the provider is not back); fewer than that are single nodes' faults (or lies). With
        # no node passing, it waits too, unless an operator declared the provider back.
        declared, self._declared = self._declared, False
        too_many = len(unproven) >= trip_threshold(len(nodes), s) or (
            not proven and not (declared and unproven and workflow.patched(DECLARED_RECOVERED_PATCH)))
        self._none_proven = not too_many and not proven
        # A node whose agent cannot run its check counts among the unproven here too: nothing proved
        # it. A site whose every node has a broken agent image (one image for all) then waits, and does
        # not come back with each node cordoned for a person to lift by hand: it proves again after
        # each back-off (10 minutes apart at most, or at once on `recovered`), and the first proof
        # after the agent is fixed restores the site, its nodes uncordoned. So that this wait does
        # not read as the provider still down, the timeline and details say it is the agent's.
        cannot = sorted(name for name in unproven if name in self._cannot_check)
        self._agent_cannot_check = len(cannot) if too_many else 0
        if too_many:
            self._recovered = ""
            self._state("waiting-for-recovery")
            # Every round that fails says this: a few nodes' failures, and how many more.
            if cannot and len(cannot) == len(unproven):
                self._mark("compute check cannot run", self._agent_said(cannot, len(nodes))
                           + ": " + "; ".join(summarised(failures)))
            else:
                self._mark("smoke tests failed", "; ".join(summarised(failures)) or "no nodes")
            return False
        if unproven:
            self._unproven = unproven
            await self._quarantine_unproven()
        self._mark("nodes proven", f"{len(proven)} nodes passed smoke tests"
                   + (f"; unproven, left cordoned: {'; '.join(failures)}" if unproven else ""))
        return True

    @staticmethod
    def _agent_said(cannot: list[str], nodes: int) -> str:
        """What a proof that waits because node agents cannot run their compute check says."""
        return (f"the node agent cannot run its compute check on {len(cannot)} of {nodes} nodes (their GPUs neither "
                "proven nor failed; not the provider's fault): fix the node agent (its image, its limits); the next "
                "proof restores the site")

    async def _smoke_checked(self, name: str, gpus: int) -> str:
        """"" when the node proved itself, else why not. The answer comes from the node's own
        queue (an untrusted agent): taken undecoded and validated here, in workflow code (pure
        functions of the recorded payload, so replay decides the same)."""
        s = self._s
        answer: RawValue = await workflow.execute_activity(
            act.smoke_test, SmokeTestInput(expected_gpus=gpus), task_queue=node_queue(name),
            schedule_to_close_timeout=timedelta(seconds=s.smoke_test_seconds),
            start_to_close_timeout=timedelta(seconds=min(s.smoke_test_seconds, 300)), retry_policy=SMOKE_RETRY,
            # The agent heartbeats per GPU checked: a node lost mid-test is retried within a minute,
            # not at the start-to-close timeout (up to 5 minutes).
            heartbeat_timeout=WAIT_HEARTBEAT, summary=f"smoke test {name}",
        )
        try:
            value = workflow.payload_converter().from_payload(answer.payload)
            if (found := first_problem(value)) is not None:
                return f"bad report: {found[0]}: {found[1]}"[:300]
            report = SmokeReport.model_validate(value)
        except ValidationError as error:
            return f"bad report: {describe(error)[0]}"[:300]
        except Exception as error:  # noqa: BLE001 - undecodable (bad JSON, unknown encoding)
            return f"bad report: undecodable ({type(error).__name__})"
        if report.passed:
            return ""
        if (named := failing_gpus(report.failures, gpus)) is not None:
            self._failing_gpus[name] = named
        return "; ".join(summarised(report.failures)) or "failed"

    async def _quarantine_unproven(self) -> None:
        """Each node that failed the proof goes to its Node entity: cordoned, the repair ladder
        decides (held by the Site entity while its incident is open, then repaired): the GPUs its
        report named failing (``QUARANTINES_FAILING_GPUS_PATCH``), else the whole node. Not one
        whose agent cannot run its compute check (``HOLDS_WHERE_THE_CHECK_CANNOT_RUN_PATCH``): it
        stays cordoned, unproven, for a person."""
        cannot = {name for name in self._unproven if name in self._cannot_check}
        if cannot and workflow.patched(HOLDS_WHERE_THE_CHECK_CANNOT_RUN_PATCH):
            # No rung fixes the agent: cordoned, unproven, for a person (``_release`` says so).
            self._not_handed = cannot
        named = {name: gpus for name, gpus in self._failing_gpus.items() if name in self._unproven}
        if not (named and workflow.patched(QUARANTINES_FAILING_GPUS_PATCH)):
            named = {}
        if self._not_handed and workflow.patched(TELLS_THE_NODE_IT_WAITS_PATCH):
            self._tells_held = True
        for name, why in sorted(self._unproven.items()):
            if name in self._not_handed:
                if not self._tells_held:
                    continue
                # No repair: its Node entity holds it for a person (FleetState needs-person, the alert).
                order = NodeQuarantine(
                    reason=(f"unproven by {workflow.info().workflow_id}: the node agent cannot run its compute check "
                            f"({self._cannot_check.get(name, why)}); fix the node agent")[:1000],
                    hold_for_person=True)
            else:
                order = NodeQuarantine(reason=f"failed the smoke test of {workflow.info().workflow_id}: {why}"[:1000],
                                       gpus=named.get(name))
            try:
                # No ``gpus`` or ``hold_for_person`` key where not set: the payload a Node entity took
                # before they existed.
                await workflow.get_external_workflow_handle(node_workflow_id(name)).signal(
                    flows.Node.quarantine, order.model_dump(mode="json", exclude_none=True, exclude_defaults=True))
            except FailureError as error:
                self._mark("node not handed to repair", f"{name}: {failure_message(error)}")

    async def _release(self) -> None:
        """Uncordon the nodes this evacuation cordoned; the others stay, each with its reason:
        it failed the proof (its Node entity repairs it), it was cordoned before the evacuation
        began, or a repair holds a GPU of it."""
        p, site = self._progress, self._args.site
        before = {n.name for n in self._facts.nodes if n.unschedulable} if self._facts else set()
        held = {name: self._held_unproven(name, why) for name, why in self._unproven.items()}
        cordoned = [*p.drained, *(name for name in self._cordoning if name not in p.drained)]
        release = [name for name in cordoned if name not in held and name not in before]
        keep = [name for name in cordoned if name not in held and name in before]
        # Those an evacuation it took over cordoned, drained by this one or not: uncordoned where still so marked.
        theirs = {name for left in self._adopted.values() for name in left.cordoned}
        keep += sorted(theirs - set(cordoned) - set(held))
        if release or keep:
            released: ReleaseNodesResult = await workflow.execute_activity(
                act.release_nodes, ReleaseNodesInput(nodes=release, keep_cordoned=keep, adopted=sorted(self._adopted)),
                start_to_close_timeout=QUICK, retry_policy=self._cluster_retry(),
                summary=f"uncordon the {len(release)} nodes it cordoned at {site} (not those a repair holds)",
            )
            held.update(released.held)
        p.held = held
        if held:
            self._mark("nodes held", "; ".join(f"{node}: {why}" for node, why in sorted(held.items())))

    def _held_unproven(self, name: str, why: str) -> str:
        """Why a node that failed the proof stays cordoned (``progress.held``, the timeline)."""
        if name not in self._not_handed:
            return f"failed the proof: {why}"
        said = f"unproven: the node agent cannot run its compute check ({self._cannot_check.get(name, why)}); not " \
               f"handed to the repair ladder (no rung fixes the agent: no reset or reboot for it). "
        if self._tells_held:
            return (said + f"Its Node entity holds it for a person (needs-person, the GpufleetNodeNeedsPerson alert): "
                    f"a person fixes the node agent on {name} (its image, its limits), then returns it "
                    f"(`gpufleet repair return {name} 0 --reason ...`), which uncordons it")
        return (said + f"A person fixes the node agent on {name} (its image, its limits), then uncordons it "
                f"(`kubectl uncordon {name}`): nothing else lifts this cordon")

    async def _undo(self, why: str) -> None:
        """``_put_back``, to its end even when Temporal's cancel lands meanwhile (during an abort's
        put-back or a failed step's), which would leave the site half restored. The cancel is taken
        (it reaches a run once): ``_cancel_taken`` says so, for the run to end as it asked once all
        is back."""
        await to_its_end_taking_cancel(self._take_cancel, asyncio.ensure_future(self._put_back(why)))

    async def _put_back(self, why: str) -> None:
        """Put back what this evacuation changed (it ends without restoring): the capacity request
        stopped, then ``_restore`` in one step (no proof: the operator chose to end it; nodes a
        repair holds stay cordoned). A failure on the way is left to a person, said in progress."""
        p = self._progress
        self._state("restoring")
        self._show("restoring what it changed", why)
        try:
            if self._capacity is not None:
                await self._stop_capacity(f"the evacuation of {self._args.site} ended ({why})")
                try:
                    self._acquired = (await self._capacity).nodes
                except ChildWorkflowError as error:
                    self._mark("capacity failed", failure_text(error))
                self._capacity = None
            if self._facts is None:
                return  # ended before it changed anything
            await self._restore(undo=True)
        except FailureError as error:
            p.needs_person = f"could not put everything back after it {why}: {failure_text(error)}"
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("needs-person")])
            self._mark("restore incomplete", p.needs_person)

    def _cluster_retry(self) -> RetryPolicy:
        """Bounded on the way out (a cluster away that long fails the step, and the evacuation puts
        back what it changed); until done on the way back: a put-back that gave up after its ten
        attempts (a few minutes of API-server trouble) left the site at weight 0, its nodes
        cordoned and its Deployments at 0 for good, the incident closed and nobody retrying."""
        return PUT_BACK_RETRY if self._putting_back else CLUSTER_RETRY

    async def _restore(self, undo: bool = False) -> None:
        p, s, site = self._progress, self._s, self._args.site
        self._putting_back = True
        await self._release()
        deadline = workflow.now() + timedelta(seconds=s.ready_seconds)
        for here in self._facts.here:
            await self._scale(here.model, site, self._here_before(here))
        # Every node there failed its proof (declared recovered): a replica can start only once a
        # repair proves one, and the repairs wait for this evacuation to end. Waiting up to
        # ``ready_seconds`` would only keep them waiting (the site's Deployments come back as the nodes do).
        unservable = self._none_proven and not undo
        if unservable:
            self._mark("replicas back", f"{len(self._facts.here)} models at {site}, not waited for: no node there "
                                        "passed its proof (they start as its repairs prove the nodes)")
        elif any(self._here_before(here) > 0 for here in self._facts.here):
            # Routing returns, and the replicas elsewhere go, once the site serves again.
            self._show("waiting for the replicas back", f"at {site} until {deadline.isoformat(timespec='seconds')} "
                                                        "at most; then routing returns")
        for here in self._facts.here:
            if self._here_before(here) <= 0 or unservable:
                continue
            try:
                await wait_for_serving(here.model, site, deadline, poll_seconds=1.0,
                                       summary=f"wait for {here.model} back at {site}")
            except ActivityError as error:
                # A cancel while restoring puts back the rest at once, as an abort would; one while
                # putting back (an abort's) must not stop it: the undo goes on to the end.
                if not undo and self._cancelled(error):
                    raise
                p.needs_person = f"{here.model} at {site} not ready again: {failure_message(error)}"
            if not undo:
                self._check()
        if not unservable:
            self._mark("replicas back", f"{len(self._facts.here)} models at {site}")
        # Undone: the weights as they were at once (the operator ended it; nothing to bake).
        steps = [100] if undo else restore_percents(s.restore_steps)
        for i, percent in enumerate(steps):
            last = i == len(steps) - 1
            await self._weight(percent, healthy=True, draining=not last,
                               incident="" if last else workflow.info().workflow_id)
            self._mark(f"weight {percent}%")
            if not last and s.bake_seconds:
                at = workflow.now() + timedelta(seconds=s.bake_seconds)
                self._show(f"baking at {percent}%", f"until {at:%H:%M:%S} UTC, then {steps[i + 1]}%")
                await self._wait(s.bake_seconds, lambda: False, f"bake at {percent}%")
        if undo:
            self._mark("routing restored", f"weights as before the incident at {site}")
        # Surplus elsewhere back toward each site's min.
        moved = self._moved()
        if moved:
            self._show("scaling back the replicas it added elsewhere",
                       ", ".join(f"{model} at {', '.join(where)}" for model, where in moved.items())
                       + f"; each call {PUT_BACK_UNTIL}")
        for model, where in moved.items():
            for target in where:
                await self._scale(model, target, self._replicas_before(model, target))
        retired, kept = await self._retire_acquired()
        self._mark("surplus drained", f"{retired} nodes retired"
                   + "".join(f"; kept {node}: {why}" for node, why in kept.items()))
        self._put_back_all = True

    async def _retire_acquired(self) -> tuple[int, dict[str, str]]:
        """Retire the nodes it bought while their site is above its min; how many, and each one
        kept because someone holds it (a repair fenced a GPU of it, a person marked it theirs):
        that node is its holder's business, then its site's min/max and the demand loop's, like
        any other node there. Its drain marks the cordon ``CORDONED_BY_EVACUATION``, so a node taken
        during the drain is kept too (``retire_machine``'s last look), and one whose drain blocked
        is uncordoned: the evacuation ends, and nothing else would."""
        s = self._s
        retired, kept = 0, {}
        for i, node in enumerate(self._acquired):
            # Each one's wait said, with how many follow: before, the details went on saying the
            # step before ("weight 100%", "routing restored") through drains of minutes each.
            after = len(self._acquired) - i - 1
            follows = f"; {after} more after it" if after else ""
            self._show("retiring the nodes it bought", f"`{node.node_name}` at {node.site}: looking at its "
                                                       f"site's min_nodes and who holds it{follows}")
            nodes = await workflow.execute_activity(
                act.site_nodes, SiteNodesInput(site=node.site),
                start_to_close_timeout=QUICK, retry_policy=self._cluster_retry(), summary=f"nodes at {node.site}",
            )
            if len(nodes) <= await self._min_nodes(node.site):
                continue
            held = next((n.held for n in nodes if n.node_name == node.node_name), "")
            if held:
                kept[node.node_name] = held
                continue
            by = workflow.now() + timedelta(seconds=s.drain_seconds)
            self._show("retiring the nodes it bought",
                       f"`{node.node_name}` at {node.site}: drained, PodDisruptionBudgets honoured, until "
                       f"{by:%H:%M:%S} UTC at most, then its machine deleted (a drain still blocked then keeps it, "
                       f"uncordoned){follows}")
            outcome = await drain_and_retire(node.site, node.node_name, node.machine_id, s.drain_seconds,
                                             why="bought for the evacuation", cordoned_by=CORDONED_BY_EVACUATION)
            retired += outcome.retired
            if outcome.kept:
                kept[node.node_name] = outcome.kept
            if outcome.blocked:
                kept[node.node_name] = await self._release_blocked(node.site, node.node_name, outcome.blocked)
            if outcome.failed:
                self._progress.needs_person = f"{node.node_name}: {outcome.failed}"
        return retired, kept

    async def _release_blocked(self, site: str, node: str, blocked: str) -> str:
        """Uncordon a node it bought whose drain blocked (a PodDisruptionBudget, the deadline), unless
        someone took it meanwhile: it stays its site's, serving, like any other node there (the
        Site's max and the demand loop's consolidation decide on it). What the timeline says."""
        try:
            released = await workflow.execute_activity(
                act.release_cordons, ReleaseCordonsInput(nodes=[node], cordoned_by=CORDONED_BY_EVACUATION),
                start_to_close_timeout=QUICK, retry_policy=self._cluster_retry(),
                summary=f"uncordon {node} at {site}: its drain blocked",
            )
        except ActivityError as error:
            self._progress.needs_person = f"{node}: {blocked}; not uncordoned ({failure_message(error)})"
            return f"{blocked}; not uncordoned ({failure_message(error)}): uncordon it by hand"
        if released:
            return f"{blocked}; uncordoned, its site's like any other node there"
        return f"{blocked}; its cordon is no longer the evacuation's: left as it is"

    async def _min_nodes(self, site: str) -> int:
        resolved: Site = await workflow.execute_activity(
            act.resolve_site, ResolveSiteInput(site=site), start_to_close_timeout=QUICK,
            retry_policy=PROVIDER_RETRY, summary=f"min of {site}",
        )
        return resolved.min_nodes

