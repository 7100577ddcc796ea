"""GpuRepair (id ``repair/<node>/gpu<i>``): the repair ladder for one GPU.

The runbook: contain (fence the GPU, drain the node's pods honoring PDBs,
cordon) → recover at the current rung (reset → reboot → reinstall → replace)
→ prove (smoke test on the node's own queue) → pass: un-contain, the node
serves again; fail: climb one rung. A rung is left only when its proof failed.
Node-level actions take the node's one slot from the Node entity (the parent),
so two GPUs failing together cost one reboot, not two. A repair outlives its entity's run: one
that finds no run there (terminated, failed) to ask or give the slot back to fails nothing; its
request waits, saying so, for the run the site sweep starts next, which takes it from the ladder.

Operators: updates ``hold`` / ``release`` / ``skip_to`` (validated), query
``ladder``. A held ladder stays contained and does nothing at the next step (a grant of the
node's slot that reaches it held goes back unused). A cancel
(``temporal workflow cancel``, the UI) stops the ladder where it is: no next rung, no
replacement bought, and the GPU stays fenced (a possibly broken GPU never serves again by a
cancel) for a person, who is told so by the details and ``FleetState = "needs-person"``. Once a
replacement joined, a cancel is only noted: the node it replaced is retired all the same (it
would bill beside its replacement) and the repair ends replaced.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    ChildWorkflowError,
    FailureError,
    is_cancelled_exception,
)
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import workflows as flows
    from fleet.naming import join_workflow_id, node_queue, repair_workflow_id
    from fleet.contracts import activities as act
    from fleet.messages.nodes import (
        ContainInput,
        ContainResult,
        NodeFacts,
        NodeFactsInput,
        NodeSaid,
        ReinstallDriverInput,
        ReplacementSitesInput,
        ResetGpuInput,
        RestartMachineInput,
        UncontainInput,
        UncontainResult,
        WaitForBootInput,
    )
    from fleet import search_attributes as sa
    from fleet.repair_policy import Rung
    from workflows.inputs import invalid_input, parse_input
    from workflows.refusals import wrong_state
    from fleet.messages.join import JoinTimeouts, NodeJoinResult
    from workflows.steps import (
        CHECK_UNAVAILABLE,
        CLUSTER_RETRY,
        PROVIDER_RETRY,
        QUICK,
        cancelled_words,
        count_bad_report,
        failure_text,
        failure_type,
        join_until,
        node_answer,
        retire_machine,
        show_details,
        smoke_test_node,
        to_its_end,
        until,
        until_in,
        until_run_began,
    )
    from fleet.messages.repair import (
        Attempt,
        GpuRepairInput,
        GpuRepairResult,
        LadderState,
        NodeActionDone,
        NodeActionGrant,
        NodeActionRequest,
        NodeActionWait,
        HoldInput,
        SkipToInput,
    )

NODE_RETRY = RetryPolicy(maximum_attempts=2, non_retryable_error_types=["GpuResetFailed", "DriverReinstallFailed"])

#: Deprecated, to be removed in a later release (docs/design/patches.md, "The rule"): where the Node
#: entity's grant of the action slot reaches a ladder held while it waited for it (an operator's
#: ``hold``, or its site's for an incident), the slot goes back unused (``NodeActionDone.acted``
#: false), the ladder waits held, and asks for the slot again once released. Every repair open now
#: started after it; the call stays, deprecated, there, until no run holding its marker is open.
HOLD_AT_THE_GRANT_PATCH = "repair-holds-at-the-grant"
#: Deprecated, to be removed in a later release (docs/design/patches.md, "The rule"): once the
#: replacement joined, the old node's retirement (its facts, then ``retire_machine``) runs to its end
#: when a cancel lands meanwhile, and the repair ends "replaced", the cancel noted. Every repair open
#: now started after it; the call stays, deprecated, there, until no run holding its marker is open.
REPLACE_RETIRES_TO_ITS_END_PATCH = "repair-replace-retires-to-its-end"
#: Workflow patch, asked where a rung's proof could not run because the node's agent cannot run its
#: compute check (the smoke test's ``ComputeCheckUnavailable``: libcuda not in its image, its child
#: process unable to start or import the check, killed by the agent's own limits): no verdict on the
#: GPU. The ladder neither passes (nothing proved the GPU) nor climbs (a reboot or reinstall for the
#: agent's problem is a machine restarted for nothing, and at the top a GPU held as broken): it stays
#: at its rung, contained, held for a person (``FleetState`` needs-person), its details and log
#: naming the agent's problem; released, it proves again. Before it such a proof was a failed one:
#: every GPU of a node with a broken agent image climbed reset, reboot, reinstall to exhausted.
HOLDS_WHEN_THE_CHECK_CANNOT_RUN_PATCH = "repair-holds-when-the-check-cannot-run"
#: A proof that did not run is named by the node's own message, cut to this: it is repeated in the
#: details, the ladder (its hold reason, its attempts) and the result.
SMOKE_DID_NOT_RUN_CHARS = 1000
#: Workflow patch, asked where a proof could not run for a reason the node's agent calls transient
#: (``ComputeCheckUnavailable`` retryable: its check's child killed by the agent's memory limit, a
#: fork that failed for want of memory, a hang before the GPU), its activity retried to its policy's
#: end: the ladder proves again by itself after a pause (``TRANSIENT_CHECK_PAUSE_SECONDS``, doubling)
#: up to ``TRANSIENT_CHECK_TRIES`` times, its details saying why and when, and only then holds for a
#: person as ``repair-holds-when-the-check-cannot-run`` does. A person's release (prove now),
#: ``skip_to``, hold or a cancel during a pause is taken. Before it a passing blip held the ladder,
#: contained, until a person came, its details not saying it was transient.
PROVES_AGAIN_AFTER_A_TRANSIENT_CHECK_PATCH = "repair-proves-again-after-a-transient-check"
#: The first pause before such a proof is tried again; each next one is twice the last (1, 2, 4, 8 min).
TRANSIENT_CHECK_PAUSE_SECONDS = 60
#: How many times a proof that could not run for a transient reason is tried again before a person is asked.
TRANSIENT_CHECK_TRIES = 4
#: What the node said was transient is named in the details, cut to this.
TRANSIENT_WHY_CHARS = 300


@dataclass(frozen=True)
class CannotRun:
    """A proof that could not run on the node (its agent's compute check, ``CHECK_UNAVAILABLE``):
    whether the agent said it may pass next time, and why it did not run."""

    transient: bool
    why: str


def cannot_run(error: BaseException) -> CannotRun | None:
    """The proof's failure as ``CannotRun`` where it is ``CHECK_UNAVAILABLE``, else None. The node is
    untrusted and what it sent is only validated here, never relied on: transient only where the
    failure is retryable (its ``non_retryable`` flag, which the node gateway forwards) and its
    details, where they came through (the gateway drops them), are the agent's own
    (``{"transient": true, "problem": "..."}``); anything else, or anything unreadable, is not."""
    if failure_type(error) != CHECK_UNAVAILABLE:
        return None
    try:
        root = error
        while isinstance(root, (ActivityError, ChildWorkflowError)) and root.cause is not None:
            root = root.cause
        why = root.message if isinstance(root, FailureError) and isinstance(root.message, str) else str(root)
        if not isinstance(root, ApplicationError) or root.non_retryable:
            return CannotRun(False, why[:TRANSIENT_WHY_CHARS])
        details = list(root.details or ())
        if not details:
            return CannotRun(True, why[:TRANSIENT_WHY_CHARS])
        said = details[0]
        if not isinstance(said, dict) or said.get("transient") is not True:
            return CannotRun(False, why[:TRANSIENT_WHY_CHARS])
        problem = said.get("problem")
        return CannotRun(True, (problem if isinstance(problem, str) and problem else why)[:TRANSIENT_WHY_CHARS])
    except Exception:  # whatever the node sent: never a failed workflow task
        return CannotRun(False, "")


@workflow.defn(name="GpuRepair")
class GpuRepair:
    def __init__(self) -> None:
        self._state: LadderState | None = None
        self._grant: NodeActionGrant | None = None
        self._input: GpuRepairInput | None = None
        #: A hold that came before ``run`` built the ladder (see ``_require_running``).
        self._hold_at_start: HoldInput | None = None
        #: How many releases came (a pause before a proof is tried again ends at one: prove now).
        self._releases = 0

    # -- operator surface ---------------------------------------------------------------
    @workflow.query
    def ladder(self) -> LadderState:
        if self._state is None:
            raise ApplicationError("repair not started yet", type="NotStarted")
        return self._state

    def _ladder_built(self) -> bool:
        return self._state is not None

    def _require_running(self) -> None:
        """Refuse a repair that has ended (``WrongState``, naming how: a replaced node, for one).
        One still starting is running: an operator (or the site, for its incident) acts on a
        repair the moment it appears, and its run's first task hands that task's updates to
        their handlers before ``run`` has built the ladder."""
        if self._state is not None and self._state.done:
            raise wrong_state(f"the repair is not running: it has ended ({self._state.outcome})", self._state.outcome)

    @workflow.update
    async def hold(self, raw: Any = None) -> LadderState:
        asked = parse_input(HoldInput, {} if raw is None else raw)
        if self._state is None:
            # Before the ladder exists: run starts it held, so not even containment begins.
            self._hold_at_start = asked
            await until_run_began(self._ladder_built)
            return self._state
        self._state.held = True
        self._state.hold_reason = asked.reason
        self._show()
        return self._state

    @hold.validator
    def _validate_hold(self, raw: Any = None) -> None:
        parse_input(HoldInput, {} if raw is None else raw)  # only a reason: anything else is refused naming it
        self._require_running()

    @workflow.update
    async def release(self, raw: Any = None) -> LadderState:
        await until_run_began(self._ladder_built)
        self._state.held = False
        self._state.hold_reason = parse_input(HoldInput, {} if raw is None else raw).reason
        self._releases += 1
        self._show()
        return self._state

    @release.validator
    def _validate_release(self, raw: Any = None) -> None:
        if raw is None:  # a payload lost on the way (a wrong-shaped call) must not let a held ladder go
            raise invalid_input('release: send an object, e.g. {"reason": "vendor ticket closed"} (or {})', ["reason"])
        parse_input(HoldInput, raw)
        self._require_running()

    @workflow.update
    async def skip_to(self, raw: Any) -> LadderState:
        await until_run_began(self._ladder_built)
        self._state.skip_to = parse_input(SkipToInput, raw).rung
        self._show()
        return self._state

    @skip_to.validator
    def _validate_skip_to(self, raw: Any) -> None:
        parse_input(SkipToInput, raw)  # an unknown rung is refused naming the field
        self._require_running()  # a replaced node's repair has ended

    @workflow.signal
    def node_action_grant(self, grant: NodeActionGrant) -> None:
        self._grant = grant

    @workflow.signal
    def node_action_wait(self, wait: NodeActionWait) -> None:
        """Who holds the node's action slot this repair waits for, and until when: the Node entity
        says so when it queues the request, with when its own turn is expected if others are ahead,
        and again once it is next in line (a Node run from before ``node-tells-the-queue-once``:
        whenever the holder or the queue ahead changes). One that comes after the grant (or outside
        a wait) is old news."""
        s = self._state
        if s is None or self._grant is not None or s.step != "waiting for the node":
            return
        held = (f"held by {wait.holder} for its {wait.rung} since {wait.since:%H:%M:%S} UTC, "
                f"expected back by {wait.until:%H:%M:%S} UTC")
        if wait.ahead and wait.turn_by is not None:
            # Told once as it queued (the next in line is told again): what it was told then, and the
            # bound of its own turn, which stays true; the node's status lists the queue as it is now.
            s.waiting_for = (f"queued behind {wait.behind or 'the holder'} ({wait.ahead} ahead when it queued, the "
                             f"slot then {held}), its turn expected by {wait.turn_by:%H:%M:%S} UTC at the latest")
        else:
            ahead = f"; {wait.ahead} more queued ahead" if wait.ahead else ""
            s.waiting_for = f"the slot is {held}{ahead}"
        self._show(f"{s.rung} needs the node's action slot")

    # -- the ladder ---------------------------------------------------------------------
    def _step(self, step: str, detail: str = "") -> None:
        self._state.step = step
        self._show(detail)

    def _show(self, detail: str = "") -> None:
        s = self._state
        lines = [f"node `{s.node_name}` GPU {s.gpu}: " + ", ".join(s.reasons)]
        if s.waiting_for:
            lines.append(s.waiting_for)
        if s.slot_note:
            lines.append(s.slot_note)
        if s.held:
            # An operator's hold, or a site's for its incident (its reason says which).
            lines.append("**held** (contained, doing nothing until released)"
                         + (f": {s.hold_reason}" if s.hold_reason else ""))
        if s.skip_to:
            lines.append(f"operator asked to skip to {s.skip_to}")
        lines += [f"- {a.rung}: {a.outcome}" + (f" ({a.detail})" if a.detail else "") for a in s.attempts]
        show_details(f"{s.step} at rung {s.rung}", *lines, detail=detail)

    def _set_fleet_state(self, word: str) -> None:
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(word), sa.REPAIR_RUNG.value_set(self._state.rung.value)])

    @workflow.run
    async def run(self, raw: Any) -> GpuRepairResult:
        inp = parse_input(GpuRepairInput, raw)
        self._input = inp
        settings = inp.settings
        max_rung = settings.max_rung
        rung = inp.rung if inp.rung.level <= max_rung.level else max_rung
        self._state = LadderState(node_name=inp.node_name, gpu=inp.gpu, rung=rung, step="containing",
                                  reasons=list(inp.reasons))
        if self._hold_at_start is not None:
            self._state.held, self._state.hold_reason = True, self._hold_at_start.reason
        if inp.escalated_because:
            self._state.reasons.append(f"escalated: {inp.escalated_because}")
        if workflow.info().parent is None:  # the Node entity gives the count from the same facts
            await self._check_against_the_node()
        workflow.upsert_search_attributes([
            sa.NODE_NAME.value_set(inp.node_name), sa.SITE.value_set(inp.site), sa.GPU_INDEX.value_set(inp.gpu),
            sa.REPAIR_RUNG.value_set(rung.value), sa.FLEET_STATE.value_set("containing"),
        ])
        try:
            return await self._ladder(rung)
        # asyncio.CancelledError (a cancel in a wait) is a BaseException; GeneratorExit (Python closing
        # the run's coroutine after its worker stopped) is one too, and must pass untouched: no
        # workflow call works then, outside any workflow's event loop.
        except (Exception, asyncio.CancelledError) as error:
            if not self._cancelled(error):
                raise
            where = self._state.step
            self._stopped_by_cancel()
            if is_cancelled_exception(error):
                raise  # the run ends cancelled: the SDK sees the cancel request and a cancel error
            # What the cancel ended surfaced as a failure (a replacement join that cleaned up after
            # it was cancelled fails): the run still ends cancelled, not failed.
            raise CancelledError(f"repair cancelled while {where}") from error

    async def _check_against_the_node(self) -> None:
        """Refuse, before anything is contained, a ``gpus`` that is not the node's GPU count or a
        ``site`` that is not its site, as the cluster knows them. A node the cluster does not know
        is left to the ladder."""
        inp = self._input
        facts = await self._facts()
        if not facts.found:
            return
        if facts.gpus != inp.gpus:
            self._refuse(f"gpus: {inp.gpus}, but node {inp.node_name} has {facts.gpus} GPUs: every proof would fail; "
                         f"start it with gpus={facts.gpus}", "gpus")
        if facts.site and facts.site != inp.site:
            self._refuse(f"site: {inp.site}, but node {inp.node_name} is at {facts.site}: a reboot, a replacement and the "
                         f"machine's retirement would go to the wrong site; start it with site={facts.site}", "site")

    def _refuse(self, problem: str, field: str) -> None:
        self._state.outcome, self._state.done = "refused", True
        message = f"invalid GpuRepairInput: {problem}"
        self._step("refused", message)
        raise invalid_input(message, [field])

    async def _ladder(self, rung: Rung) -> GpuRepairResult:
        """Contain, then recover and prove rung by rung until repaired, replaced or exhausted."""
        inp, settings = self._input, self._input.settings
        max_rung = settings.max_rung
        await self._hold_point()
        # The activity's limit is one try's (a try that fails is tried again, ``CLUSTER_RETRY``).
        self._step("containing", "fence the GPU, drain its pods (PDBs honoured), cordon, "
                                 f"{until_in(settings.timeouts.contain_seconds)} (per try)")
        contained: ContainResult = await workflow.execute_activity(
            act.contain_gpu,
            ContainInput(node_name=inp.node_name, gpu=inp.gpu, rung=rung.value,
                         drain_seconds=settings.timeouts.drain_seconds),
            start_to_close_timeout=timedelta(seconds=settings.timeouts.contain_seconds),
            heartbeat_timeout=timedelta(seconds=settings.timeouts.heartbeat_seconds),
            retry_policy=CLUSTER_RETRY, summary=f"contain GPU {inp.gpu}: fence, drain, cordon",
        )
        if contained.blocked:
            self._state.reasons.append(f"drain left {len(contained.blocked)} pods (PDB): {contained.blocked[0]}")

        while True:
            await self._hold_point()
            if self._state.skip_to is not None:
                rung, self._state.skip_to = self._state.skip_to, None
            self._state.rung = rung
            attempt = Attempt(rung=rung, started_at=workflow.now())
            attempt_no = self._state.add_attempt(attempt)
            self._set_fleet_state("repairing")
            self._step("recovering", f"{rung}")

            ok, outcome, detail = await self._recover(rung, attempt_no)
            if outcome == "replaced":
                attempt.outcome, attempt.detail, attempt.finished_at = "replaced", detail, workflow.now()
                return self._finish("replaced")
            if ok:
                await self._hold_point()
                self._set_fleet_state("proving")
                self._step("proving", f"smoke test on {node_queue(inp.node_name)} "
                                      f"{until_in(settings.timeouts.smoke_test_seconds)}")
                proved, proof, unavailable = await self._prove()
                tried = 0  # proofs tried again by the ladder itself, the agent having said transient
                while unavailable and workflow.patched(HOLDS_WHEN_THE_CHECK_CANNOT_RUN_PATCH):
                    attempt.detail = (f"{detail}; " if detail else "") + proof
                    # Asked only where a transient one happens: any other holds at once, as before.
                    if (unavailable.transient and tried < TRANSIENT_CHECK_TRIES
                            and workflow.patched(PROVES_AGAIN_AFTER_A_TRANSIENT_CHECK_PATCH)):
                        tried += 1
                        proved, proof, unavailable = await self._proves_again(proof, unavailable, tried)
                        continue
                    proved, proof, unavailable = await self._held_unproven(proof, tried)
                    tried = 0  # a person released it: a transient one next is tried again as the first
                ok, detail = proved, (f"{detail}; " if detail else "") + proof
            attempt.finished_at = workflow.now()
            attempt.outcome = ("covered" if outcome == "covered" else "passed") if ok else "failed"
            attempt.detail = detail
            if ok:
                await self._hold_point()
                self._step("un-containing", "unfence the GPU, uncordon when no other GPU is fenced")
                await workflow.execute_activity(
                    act.uncontain_gpu, UncontainInput(node_name=inp.node_name, gpu=inp.gpu),
                    start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                    summary=f"un-contain GPU {inp.gpu}",
                )
                return self._finish("repaired")
            if self._state.skip_to is not None:
                continue
            nxt = rung.next()
            if nxt is None or nxt.level > max_rung.level:
                # Stay contained; a person decides (skip_to re-enters the ladder).
                self._set_fleet_state("needs-person")
                self._state.outcome = "exhausted"
                self._step("exhausted", self._exhausted(rung, max_rung))
                await workflow.wait_condition(lambda: self._state.skip_to is not None)
                self._state.outcome = ""
                continue
            rung = nxt

    def _exhausted(self, rung: Rung, max_rung: Rung) -> str:
        """What an exhausted ladder waits for: a person, with no deadline, and how they decide."""
        node, gpu = self._input.node_name, self._input.gpu
        return (f"no rung above {rung} allowed (max {max_rung}); node stays contained. No deadline: a person "
                f"decides: `gpufleet repair skip-to {node} {gpu} <rung>` re-enters the ladder, or cancel this "
                f"repair (`temporal workflow cancel --workflow-id {workflow.info().workflow_id}`) and the GPU "
                f"stays fenced, held for a person: `gpufleet repair return {node} {gpu} --reason ...` puts it "
                "back in service")

    def _cancelled(self, error: BaseException) -> bool:
        """Whether ``error`` ends the repair because it was cancelled, rather than failing a rung:
        the repair was asked to cancel, and ``error`` is what ended the wait it was in. That is a
        cancel (the activity or the replacement NodeJoin cancelled with it) or a failure: a
        NodeJoin of the code before a cancelled join ended cancelled reported its cancel as its own
        failure. A join someone else cancelled is a failed site, as before."""
        return workflow.cancellation_reason() is not None and (is_cancelled_exception(error)
                                                               or isinstance(error, FailureError))

    def _stopped_by_cancel(self) -> None:
        """What a cancelled repair leaves, said where the operator looks (details, ladder query,
        ``FleetState``): the GPU stays fenced and the node cordoned. Whether the GPU is sound
        is unknown (the rung did not finish, nothing proved it), so no cancel puts it back in
        service: a person un-contains it or starts a repair."""
        s = self._state
        if s.attempts and s.attempts[-1].outcome == "running":
            s.attempts[-1].outcome, s.attempts[-1].finished_at = "cancelled", workflow.now()
        s.outcome, s.done, s.waiting_for = "cancelled", True, ""
        self._set_fleet_state("needs-person")
        # (A replacement that joined stays: the node's site's, as any node.)
        replaced = f"; its replacement `{s.replacement_node}` joined and stays" if s.replacement_node else ""
        self._step("cancelled", f"{cancelled_words()} while {s.step}: GPU {s.gpu} stays fenced and "
                                f"`{s.node_name}` cordoned; a person decides (nothing proved the GPU){replaced}")

    def _finish(self, outcome: str) -> GpuRepairResult:
        self._state.outcome, self._state.done = outcome, True
        self._set_fleet_state("ready" if outcome == "repaired" else outcome)
        self._step(outcome)
        return GpuRepairResult(
            node_name=self._state.node_name, gpu=self._state.gpu, outcome=outcome, rung=self._state.rung,
            attempts=self._state.attempts, earlier_attempts=self._state.earlier_attempts,
            replacement_node=self._state.replacement_node,
        )

    async def _hold_point(self, detail: str = "held") -> None:
        if self._state.held:
            self._set_fleet_state("held")
            self._show(detail)
            await workflow.wait_condition(lambda: not self._state.held)

    # -- recover --------------------------------------------------------------------------
    async def _acquire(self, rung: Rung) -> NodeActionGrant:
        """The node's disruptive-action slot from the Node entity (none without a parent)."""
        parent = workflow.info().parent
        if parent is None:
            return NodeActionGrant(go=True)
        self._grant = None
        self._step("waiting for the node", f"{rung} needs the node's action slot")
        try:
            await workflow.get_external_workflow_handle(parent.workflow_id).signal(
                flows.Node.node_action_request,
                NodeActionRequest(repair_id=workflow.info().workflow_id, rung=rung,
                                  detected_at=self._input.detected_at or workflow.info().start_time),
            )
        except FailureError as error:
            if self._cancelled(error):
                raise
            # The entity's run ended (terminated, failed) and none runs yet. The request is not sent
            # again: the sweep's next run takes it from this ladder's step (``node_left``), and a
            # second copy reaching a run that took it would be granted twice, holding the slot.
            self._state.waiting_for = (
                f"{self._entity_gone(parent.workflow_id, error)}: its request for the slot was not delivered and "
                f"stays pending since {workflow.now():%H:%M:%S} UTC, until the site sweep's next pass (Schedule "
                "gpufleet-site-reconcile) starts the entity again, whose run takes the request from this ladder")
            workflow.logger.warning("%s: %s", workflow.info().workflow_id, self._state.waiting_for)
            self._show(f"{rung} needs the node's action slot")
        await workflow.wait_condition(lambda: self._grant is not None)
        self._state.waiting_for = ""
        return self._grant

    async def _release(self, rung: Rung, ok: bool, acted: bool = True) -> None:
        parent = workflow.info().parent
        if parent is None:
            return
        try:
            await workflow.get_external_workflow_handle(parent.workflow_id).signal(
                flows.Node.node_action_done,
                NodeActionDone(repair_id=workflow.info().workflow_id, rung=rung, ok=ok, acted=acted),
            )
        except FailureError as error:
            if self._cancelled(error):
                raise
            # Not the repair's failure: the slot was the run's that ended, and the entity's next run,
            # following this repair, takes the slot as free once the repair is past its action.
            self._state.slot_note = (f"could not give the node's action slot back after its {rung} at "
                                     f"{workflow.now():%H:%M:%S} UTC: {self._entity_gone(parent.workflow_id, error)}; "
                                     "the entity's next run frees it as it follows this repair")
            workflow.logger.warning("%s: %s", workflow.info().workflow_id, self._state.slot_note)

    @staticmethod
    def _entity_gone(entity_id: str, error: FailureError) -> str:
        return f"the Node entity {entity_id} is not running ({failure_text(error)})"

    async def _recover(self, rung: Rung, attempt_no: int) -> tuple[bool, str, str]:
        """(recovered, outcome word, detail). Failures are outcomes, not exceptions."""
        grant = await self._acquire(rung)
        while grant.go and self._state.held:
            workflow.deprecate_patch(HOLD_AT_THE_GRANT_PATCH)
            grant = await self._held_at_the_grant(rung)
        if not grant.go:
            if grant.covered_by == Rung.REPLACE:
                return True, "replaced", grant.detail
            return True, "covered", grant.detail
        ok = False
        try:
            self._step("recovering", self._recovering(rung))
            if rung == Rung.RESET:
                detail = await self._reset(attempt_no)
            elif rung == Rung.REPLACE:
                detail = await self._replace(attempt_no)
                ok = True
                return True, "replaced", detail
            else:
                detail = await self._restart(rung)
            ok = True
            return True, "recovered", detail
        except (ActivityError, ChildWorkflowError, ApplicationError) as error:
            if self._cancelled(error):
                raise  # stopped, not failed: no next rung
            return False, "failed", failure_text(error)
        finally:
            # Also on a cancel: the slot goes back (the signal is a command a cancelled run may
            # still send; the Node entity frees the slot too when it sees the repair end).
            await self._release(rung, ok)

    async def _held_at_the_grant(self, rung: Rung) -> NodeActionGrant:
        """The slot came while the ladder was held (the hold reached it in the queue): a held ladder
        does nothing, so the slot goes back unused (the Node entity keeps no record of an action that
        never ran, which would cover the faults queued behind it; they take the slot now), the
        ladder waits for its release, then asks for the slot again."""
        await self._release(rung, ok=False, acted=False)
        self._state.step = "held"
        await self._hold_point(f"{rung}: the node's action slot came while held and went back unused; "
                               "asked for again once released")
        return await self._acquire(rung)

    def _recovering(self, rung: Rung) -> str:
        """The rung and when the node's action slot is expected back: what a repair queued behind
        this one is told (``RepairSettings.slot_seconds``, the rung's timeouts; a reboot's or
        reimage's wait for the new boot id then names its own deadline). Nothing bounds a
        replacement's join by it: the join has its own timeouts."""
        at = workflow.now() + timedelta(seconds=self._input.settings.slot_seconds(rung))
        if rung == Rung.REPLACE:
            return f"{rung}, expected done by {at:%H:%M:%S} UTC"
        return f"{rung} {until(at)}" + (" (the provider's call, then a new boot id)"
                                        if self._input.settings.through_provider(rung) else "")

    async def _reset(self, attempt_no: int) -> str:
        inp = self._input
        # Keyed to this attempt: a retried activity (lost reply, timeout) does not reset twice.
        key = f"{workflow.info().workflow_id}/{workflow.info().run_id}/{attempt_no}"
        # A heartbeat timeout: an agent that died mid-reset is seen within it, not after the whole
        # reset_seconds (the agent beats while the reset runs). Replay compares an activity's id
        # and type, not its timeouts, so runs from before replay as they ran.
        answer = await workflow.execute_activity(
            act.reset_gpu, ResetGpuInput(index=inp.gpu, key=key), task_queue=node_queue(inp.node_name),
            schedule_to_close_timeout=timedelta(seconds=inp.settings.timeouts.reset_seconds),
            heartbeat_timeout=timedelta(seconds=inp.settings.timeouts.heartbeat_seconds),
            retry_policy=NODE_RETRY, summary=f"nvidia-smi -r -i {inp.gpu}",
        )
        return self._said(answer, "reset_gpu")

    def _said(self, answer: RawValue, what: str) -> str:
        """What the node's agent said (its tool's output): untrusted, validated here (a bounded
        string). A malformed answer fails the rung, naming the field; never a workflow task."""
        said, problem = node_answer(answer, NodeSaid, f"{what} result")
        if said is None:
            count_bad_report(what, site=self._input.site)
            raise ApplicationError(f"bad report from {self._input.node_name}: {problem}", type="BadReport",
                                   non_retryable=True)
        return said

    async def _facts(self) -> NodeFacts:
        return await workflow.execute_activity(
            act.node_facts, NodeFactsInput(node_name=self._input.node_name),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary="node, site and boot id",
        )

    async def _restart(self, rung: Rung) -> str:
        """Reboot or reinstall, then wait for the node to come back with another boot id."""
        inp, timeouts = self._input, self._input.settings.timeouts
        if rung == Rung.REINSTALL and inp.settings.reinstall_via == "agent":
            answer = await workflow.execute_activity(
                act.reinstall_driver, ReinstallDriverInput(), task_queue=node_queue(inp.node_name),
                schedule_to_close_timeout=timedelta(seconds=timeouts.reinstall_seconds),
                heartbeat_timeout=timedelta(seconds=timeouts.heartbeat_seconds) if timeouts.reinstall_seconds > 60 else None,
                retry_policy=NODE_RETRY, summary="reinstall the GPU driver on the node",
            )
            return self._said(answer, "reinstall_driver")
        facts = await self._facts()
        if not facts.found:
            raise ApplicationError(f"node {inp.node_name} is gone", type="NodeGone", non_retryable=True)
        machine_id = facts.machine_id or inp.machine_id
        said: str = await workflow.execute_activity(
            {Rung.REBOOT: act.reboot_machine, Rung.REINSTALL: act.reinstall_machine}[rung],
            RestartMachineInput(site=inp.site, machine_id=machine_id, node_name=inp.node_name,
                                boot_id_before=facts.boot_id),
            start_to_close_timeout=timedelta(seconds=timeouts.provider_call_seconds),
            retry_policy=PROVIDER_RETRY, summary=f"{rung} machine {machine_id} (boot {facts.boot_id[:8]})",
        )
        seconds = timeouts.rung_seconds(rung)
        deadline = workflow.now() + timedelta(seconds=seconds)
        self._step("recovering", f"{rung}: waiting for a new boot id {until(deadline)}")
        await workflow.execute_activity(
            act.wait_for_boot,
            WaitForBootInput(node_name=inp.node_name, boot_id_before=facts.boot_id,
                             deadline=deadline, poll_seconds=1.0),
            start_to_close_timeout=timedelta(seconds=seconds + 60),
            heartbeat_timeout=timedelta(seconds=timeouts.heartbeat_seconds),
            retry_policy=CLUSTER_RETRY, summary=f"wait for {inp.node_name} to boot again",
        )
        return said

    async def _replace(self, attempt_no: int) -> str:
        """Join one node at the same site (else another allowed one), then retire this one."""
        inp = self._input
        sites: list[str] = await workflow.execute_activity(
            act.replacement_sites, ReplacementSitesInput(site=inp.site),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary="where a replacement may go",
        )
        failures = []
        joined = None
        for site in sites:
            # The join's own timeouts bound it (the slot's "expected done by" does not).
            self._step("recovering", f"replace: joining a node at {site} {join_until(workflow.now(), JoinTimeouts())}"
                                     f", then {inp.node_name} retired")
            try:
                join = await workflow.start_child_workflow(
                    flows.NodeJoin.TYPE, {"site": site},
                    id=join_workflow_id(site, f"replace-{inp.node_name}-gpu{inp.gpu}-{attempt_no}"),
                    result_type=NodeJoinResult, static_summary=f"replacement for {inp.node_name}",
                    # A repair ended (terminated, cancelled) must not leave a join buying on for it:
                    # the join is cancelled and deletes its machine.
                    parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
                )
                result: NodeJoinResult = await self._joined(join)
                joined = result.nodes[0]
                break
            except ChildWorkflowError as error:
                if self._cancelled(error):
                    raise  # the join was cancelled with the repair (and deleted its machine): buy no other
                failures.append(f"{site}: {failure_type(error)}")
        if joined is None:
            raise ApplicationError("no replacement joined: " + "; ".join(failures), type="NoReplacement",
                                   non_retryable=True)
        self._state.replacement_node = joined.node_name
        self._step("recovering", f"replace: retiring {inp.node_name}")
        workflow.deprecate_patch(REPLACE_RETIRES_TO_ITS_END_PATCH)
        # The replacement serves (and bills) now: a cancel from here on stops nothing but the
        # retirement of the machine it replaced, which would bill beside it for good.
        await to_its_end(asyncio.ensure_future(self._retire_replaced()))
        replaced = f"replaced by {joined.node_name} at {joined.site}"
        if workflow.cancellation_reason() is not None:
            replaced += f"; {cancelled_words()} after it joined: {inp.node_name} retired all the same"
        return replaced

    @staticmethod
    async def _joined(join: workflow.ChildWorkflowHandle[Any, NodeJoinResult]) -> NodeJoinResult:
        """The replacement's join to its end: a cancel of the repair while it runs cancels it (it
        deletes its machine and ends cancelled); a join that already ended is taken. Handed the join's
        end and the cancel in one workflow task, the SDK raises the cancel where the join is awaited,
        dropping its result, once it applies an activation's jobs as one batch (temporalio's logic
        flag 2; not its default in 1.35): the replacement billed unnamed, the old node never retired."""
        try:
            return await asyncio.shield(join)
        except asyncio.CancelledError:
            # Conditions are checked once nothing else is ready to run: by then a join whose end
            # came with the cancel has taken it. No command.
            await workflow.wait_condition(lambda: True)
            if not join.done():
                join.cancel()  # as the cancel reached an unshielded join: the same command
            return await join

    async def _retire_replaced(self) -> None:
        inp = self._input
        facts = await self._facts()
        await retire_machine(inp.site, inp.node_name, facts.machine_id or inp.machine_id,
                             summary=f"retire {inp.node_name}: node out, machine deleted")

    # -- prove ----------------------------------------------------------------------------
    async def _proves_again(self, proof: str, unavailable: CannotRun, tried: int) -> tuple[bool, str, CannotRun | None]:
        """The node's agent said its check could not run for a reason that may pass (its child
        killed by its memory limit, a fork without memory, a hang before the GPU), its activity
        retried to the end of its policy: the ladder waits ``TRANSIENT_CHECK_PAUSE_SECONDS``,
        doubling with each try (``tried`` of ``TRANSIENT_CHECK_TRIES``), its details saying why and
        when, then proves again: ``_prove``'s answer. Not held: a person's release ends the pause
        (prove now), a ``skip_to`` goes there (the proof counts as failed), a hold (a person's, its
        site's) waits for its release, a cancel stops the ladder where it is."""
        s, inp = self._state, self._input
        pause = TRANSIENT_CHECK_PAUSE_SECONDS * 2 ** (tried - 1)
        at = workflow.now() + timedelta(seconds=pause)
        s.waiting_for = (f"the node agent's check could not run (transient: {unavailable.why}); proving again at "
                         f"{at:%H:%M:%S} UTC ({tried} of {TRANSIENT_CHECK_TRIES})")
        workflow.logger.warning("%s: %s", workflow.info().workflow_id, s.waiting_for)
        self._step("waiting to prove again", "the proof could not run on the node (transient); `gpufleet repair "
                                             f"release {inp.node_name} {inp.gpu}` proves it now")
        releases = self._releases
        try:
            await workflow.wait_condition(lambda: s.held or s.skip_to is not None or self._releases != releases,
                                          timeout=timedelta(seconds=pause))
        except asyncio.TimeoutError:
            pass
        s.waiting_for = ""
        await self._hold_point()
        return await self._prove_again(proof, f" ({tried} of {TRANSIENT_CHECK_TRIES}, the last could not run)")

    async def _prove_again(self, proof: str, how: str) -> tuple[bool, str, CannotRun | None]:
        """After a pause or a hold on a proof that could not run: a ``skip_to`` that came meanwhile
        is taken (the proof counts as failed: the ladder goes there), else the GPU is proved again."""
        inp = self._input
        if self._state.skip_to is not None:
            return False, proof, None
        self._set_fleet_state("proving")
        self._step("proving", f"again{how}: smoke test on {node_queue(inp.node_name)} "
                              f"{until_in(inp.settings.timeouts.smoke_test_seconds)}")
        return await self._prove()

    async def _held_unproven(self, proof: str, tried: int = 0) -> tuple[bool, str, CannotRun | None]:
        """The node's agent could not run the compute check: nothing proved the GPU, nothing said it
        is broken. Held, contained, for a person (the agent's problem is not one a rung fixes); once
        released the GPU is proved again: ``_prove``'s answer. A ``skip_to`` meanwhile is taken
        after the release, as on any held ladder (the proof counts as failed: the ladder goes there).

        What the node said is only about this GPU's own ladder: a node that claims it cannot run
        its check keeps its GPU fenced, and decides nothing about any other machine."""
        s, inp = self._state, self._input
        s.held = True
        again = (f" (the node's agent said it was transient: proved again {tried} times, after pauses of "
                 f"{TRANSIENT_CHECK_PAUSE_SECONDS // 60} to {TRANSIENT_CHECK_PAUSE_SECONDS * 2 ** (tried - 1) // 60} "
                 "minutes, and it could not run each time)") if tried else ""
        s.hold_reason = (f"{proof}{again}. The node agent cannot run its compute check: GPU {inp.gpu} is neither proven nor "
                         f"failed, and no rung is climbed for the agent's problem. Fix the node agent on "
                         f"{inp.node_name} (its image, its limits), then `gpufleet repair release {inp.node_name} "
                         f"{inp.gpu}` proves it again")
        workflow.logger.warning("%s: held: %s", workflow.info().workflow_id, s.hold_reason)
        self._set_fleet_state("needs-person")
        self._step("held", "the proof could not run on the node (its agent's compute check)")
        await workflow.wait_condition(lambda: not s.held)
        return await self._prove_again(proof, ", released")

    async def _prove(self) -> tuple[bool, str, CannotRun | None]:
        """(proved, what the proof said, whether it could not run at all: the node's agent cannot
        run its compute check, ``CHECK_UNAVAILABLE``, no verdict on the GPU; None where it ran)."""
        inp, timeouts = self._input, self._input.settings.timeouts
        try:
            smoke = await smoke_test_node(
                inp.node_name, inp.gpus, only_gpus=[inp.gpu], timeout_seconds=timeouts.smoke_test_seconds,
                heartbeat=timedelta(seconds=timeouts.heartbeat_seconds),
                summary=f"prove GPU {inp.gpu}: counters, compute",
            )
        except ActivityError as error:
            if self._cancelled(error):
                raise
            # The node's message, bounded: it is repeated in the details, the ladder and the result.
            said = f"smoke test did not run: {failure_text(error)}"[:SMOKE_DID_NOT_RUN_CHARS]
            return False, said, cannot_run(error)
        if smoke.passed:
            return True, "smoke test passed", None
        return False, "smoke test failed: " + "; ".join(smoke.failures), None
