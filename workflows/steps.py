"""The one kit of steps every workflow shares: retry policies, failure helpers,
the node and serving steps, and the current-details helper.

Each step is a plain async function that schedules the same activity (by name)
the workflows always scheduled, so recorded histories replay unchanged; a step
exists once, with one retry count and the reason for it next to it.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Awaitable, Callable

from pydantic import TypeAdapter, ValidationError
from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError, FailureError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import activities as act
    from fleet.messages.nodes import SmokeResult, SmokeTestInput
    from fleet.messages.rollout import WaitServingInput
    from fleet import search_attributes as sa
    from fleet.cluster import DrainResult, ServingStatus
    from fleet.errors import NON_RETRYABLE_TYPES
    from fleet.messages.capacity import DrainNodeInput, RetireMachineInput
    from fleet.messages.join import JoinTimeouts
    from fleet.messages.repair import NodeReport, NodeWatchResult, SmokeReport
    from fleet.naming import node_queue
    from workflows.inputs import describe, first_problem

# -- retry policies -------------------------------------------------------------------------
#: Provider calls: transient errors back off up to a minute, a bounded number of times
#: (a provider that is down for longer is an incident, not something to hammer).
PROVIDER_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2,
    maximum_interval=timedelta(seconds=60),
    maximum_attempts=8,
    non_retryable_error_types=NON_RETRYABLE_TYPES,
)
#: Our own cluster and our own stores (account guard, Temporal itself): conflicts and 5xx
#: retry, bounded (10 attempts over about 3 minutes), because a cluster that keeps refusing
#: must fail the step (and the join deletes its machine) rather than bill behind an endless
#: retry; 403/404/422 and the other permanent answers never retry.
CLUSTER_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), backoff_coefficient=2, maximum_interval=timedelta(seconds=30),
    maximum_attempts=10, non_retryable_error_types=NON_RETRYABLE_TYPES,
)
#: The same policy, named for calls to our own stores and entities rather than the cluster.
STORE_RETRY = CLUSTER_RETRY
#: Start-to-close of a call that answers at once (no waiting inside the activity).
QUICK = timedelta(seconds=60)
#: A smoke test gets 3 attempts: one lost agent poll or a GPU still settling after a reset must
#: not fail a node, while a node that fails three times in a row is not going to pass.
SMOKE_RETRY = RetryPolicy(maximum_attempts=3)
#: The smoke test's error type where its compute check cannot run on the node (``activities.node_agent``:
#: the node agent's problem, no verdict on any GPU).
CHECK_UNAVAILABLE = "ComputeCheckUnavailable"
#: Heartbeat of the activities that wait inside (drain, serving ready).
WAIT_HEARTBEAT = timedelta(seconds=30)
#: An entity's long watch of the cluster (a site's nodes, a model's load, the CSRs, the demand
#: events): its heartbeat timeout, a beat at half of it, each an action, so a watch lost with
#: its worker is replaced within it ...
LONG_WATCH_HEARTBEAT = timedelta(minutes=10)
#: ... retried while the cluster does not answer, backing off to a minute (each attempt an
#: action) ...
LONG_WATCH_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=60),
                               non_retryable_error_types=NON_RETRYABLE_TYPES)
#: ... and one refused for good (an unknown site, a forbidden list) shown and tried again this
#: much later.
LONG_WATCH_PAUSE = timedelta(minutes=5)
#: What one run may have in flight of each kind, Temporal's per-run limits (the server's
#: ``limit.numPendingActivities.error``, ``numPendingSignals``, ``numPendingChildExecutions``,
#: ``numPendingCancelRequests``: 2,000 each by default, fixed at 2,000 on Temporal Cloud): a workflow
#: task that goes past one fails (``PENDING_..._LIMIT_EXCEEDED``), and fails again on every retry.
#: What acts on every node of a site does it in turns (a site may hold ``MAX_SITE_NODES``).
TEMPORAL_PENDING_PER_RUN = 2000
#: How long one wait for another's evacuation (or fill) to end lasts (then it is asked again): one
#: that follows the first, a Site entity's incident or fill begun by an earlier run of it.
FOLLOW_WAIT = timedelta(days=1)
#: A step that puts back what an operation changed (a site's held repairs released): the same
#: policy as the long watch's, retried until done. A bounded retry would leave the change in place
#: for good once the store it needs (Temporal's visibility) is away for a few minutes.
PUT_BACK_RETRY = LONG_WATCH_RETRY
#: What the details of a step waiting on such a call say of its bound: it has none, and why.
PUT_BACK_UNTIL = "retried until the cluster answers (no deadline: a put-back that gave up would leave the change in place)"


# -- failures -------------------------------------------------------------------------------
def failure_type(error: BaseException) -> str:
    """The ApplicationError type at the root of an activity/child failure."""
    while isinstance(error, FailureError):
        if isinstance(error, ApplicationError) and error.type:
            return error.type
        if isinstance(error, (ActivityError, ChildWorkflowError)) and error.cause is not None:
            error = error.cause
            continue
        break
    return type(error).__name__


def failure_message(error: BaseException) -> str:
    """The message of the failure at the root of an activity/child failure."""
    while isinstance(error, (ActivityError, ChildWorkflowError)) and error.cause is not None:
        error = error.cause
    return str(error)


def cancelled_words() -> str:
    """``cancelled``, with the reason the cancel gave, for a run's progress and timeline."""
    reason = workflow.cancellation_reason()
    return f"cancelled ({reason})" if reason else "cancelled"


def cancelled_by_request(error: BaseException) -> bool:
    """Whether ``error`` is the run's own cancel (Temporal's cancel, the UI's button) reaching the
    step it was in: a cancel of the run was requested, and what the step awaited ended cancelled
    (an activity or child cancelled with it, or the wait itself). A step that catches
    ``ActivityError`` to go on must not catch this one: the cancel would be taken for the step's
    failure, and lost."""
    return workflow.cancellation_reason() is not None and is_cancelled_exception(error)


def failure_text(error: BaseException) -> str:
    """``Type: message`` of the root failure, for progress lines (a message that already
    starts with its type, as the activities' typed errors do, is not prefixed twice)."""
    kind, message = failure_type(error), failure_message(error)
    return message if message.startswith(f"{kind}:") else f"{kind}: {message}"


# -- a step that puts back ------------------------------------------------------------------
async def to_its_end(step: Awaitable[Any]) -> Any:
    """Await a step that puts something back (an activity's handle) to its end, even when a cancel
    of the run lands meanwhile: cancelled, it would leave what it puts back half done. The cancel
    is taken (a cancel reaches a run once): what the caller does next is how the run ends."""
    try:
        return await asyncio.shield(step)
    except asyncio.CancelledError:
        return await step


async def to_its_end_taking_cancel(take_cancel: Callable[[], Any], step: asyncio.Future[Any]) -> Any:
    """``to_its_end`` for a step that ends by itself too: a cancel of the run that lands meanwhile
    is the caller's to take, ``take_cancel()`` called as it lands (the run ends as it asked once the
    step is done); the step's own end, cancelled, is raised. The step's result, or what it raised."""
    try:
        return await asyncio.shield(step)
    except asyncio.CancelledError:
        if step.cancelled():
            raise  # its own end, not the run's cancel
        take_cancel()
        return await step


# -- an update of a run's first task ---------------------------------------------------------
async def until_run_began(began: Callable[[], bool]) -> None:
    """An update handler, first thing, where what it acts on is what ``run`` builds. The SDK hands
    the updates of a run's first task (one sent with the start or the moment the run appeared,
    or as an entity continued as new) to their handlers before ``run`` begins: such an update
    waits for ``run`` rather than be refused (or act) against what ``__init__`` made. Issues no
    command when ``run`` has begun."""
    if not began():
        await workflow.wait_condition(began)


# -- current details ------------------------------------------------------------------------
_CODE_SPAN = re.compile(r"(`[^`]*`)")


def escape_markdown(text: str) -> str:
    """Escape ``$`` outside code spans: the Temporal UI renders ``$…$`` as math."""
    return "".join(part if part.startswith("`") and part.endswith("`") and len(part) > 1
                   else part.replace("$", r"\$")
                   for part in _CODE_SPAN.split(text))


def render_details(title: str, *lines: str, detail: str = "") -> str:
    """``**title**: detail`` and then one Markdown line each, every ``$`` escaped."""
    head = f"**{escape_markdown(title)}**" + (f": {escape_markdown(detail)}" if detail else "")
    return "\n".join([head, *(escape_markdown(line) for line in lines)])


def show_details(title: str, *lines: str, detail: str = "") -> None:
    """Set the workflow's current details (the UI's "User Metadata" tab): the one way every
    workflow does it, so every page reads the same and no price turns into math."""
    workflow.set_current_details(render_details(title, *lines, detail=detail))


def until(at: datetime) -> str:
    """``until HH:MM:SS UTC``: how a wait's details say its bound (workflow time is UTC)."""
    return f"until {at:%H:%M:%S} UTC"


def until_in(seconds: float) -> str:
    """``until HH:MM:SS UTC``, ``seconds`` from now: a wait bounded by a timeout that starts now."""
    return until(workflow.now() + timedelta(seconds=seconds))


def join_until(started: datetime, timeouts: JoinTimeouts) -> str:
    """The bound of a NodeJoin started at ``started``, by its own timeouts (``JoinTimeouts``: its
    parent's deadline does not stop a join in flight): ``until HH:MM:SS UTC (its timeouts: ...)``."""
    at = started + timedelta(seconds=timeouts.expected_seconds)
    return (f"{until(at)} (its timeouts: provision {timeouts.provision_seconds:g} s a try, registration "
            f"{timeouts.registration_seconds:g} s, smoke test {timeouts.smoke_test_seconds:g} s)")


# -- what a node says -------------------------------------------------------------------------
#: A bad report is named by its first problem, cut to this length (the log, the details, errors).
MAX_PROBLEM_SHOWN = 300
#: What one smoke test may put into any message or detail (a join's failure, a repair attempt,
#: AcquireCapacity's attempts, an evacuation's proof): its first failures, each cut, then how many
#: more. Its model allows 256 failures of 1,000 characters (about 512 KB, what the node gateway
#: lets a result be), and repeated whole into each of those they passed Temporal's 2 MiB limit.
SMOKE_FAILURES_SHOWN = 5
SMOKE_FAILURE_CHARS = 160
#: The metric of bad reports (``_total`` is added by the SDK's Prometheus exporter): by site and
#: by what the node answered (watch, smoke_test, reset_gpu, reinstall_driver), not by node. Node
#: names are never reused (each carries its join's nonce), so a node label would add a series per
#: misbehaving node for the worker's whole life; the node is named in its entity's details, its
#: log and ``gpufleet`` status, and an alert on the site's rate leads there.
BAD_REPORTS_METRIC = "gpufleet_node_bad_reports"


def count_bad_report(source: str, site: str = "") -> None:
    """One bad report, on the worker's metrics page: Temporal's workflow metric meter, which
    records nothing while a history replays (a replayed bad report is not counted twice) and
    issues no command. ``site`` defaults to the workflow's ``Site`` search attribute."""
    if not site:
        site = str(workflow.info().typed_search_attributes.get(sa.SITE) or "")
    workflow.metric_meter().create_counter(
        BAD_REPORTS_METRIC, "Malformed results from node agents (a bad report: never a failed workflow task).",
    ).add(1, {"site": site or "unknown", "source": source})


def _decoded(answer: Any) -> tuple[Any, str]:
    """A ``RawValue``'s JSON (anything else as it is), or the problem: never raises."""
    if not isinstance(answer, RawValue):
        return answer, ""
    try:
        return workflow.payload_converter().from_payload(answer.payload), ""
    except Exception as error:  # noqa: BLE001 - bad JSON, an encoding nobody speaks
        return None, f"undecodable ({type(error).__name__})"


def node_answer(answer: Any, model: Any, what: str) -> tuple[Any, str]:
    """A node agent's result (``RawValue``: untrusted, decoded here; or a value decoded already)
    validated against ``model`` (a pydantic model or type): ``(value, "")``, or
    ``(None, "<what>.<field>: <problem>")``.

    In workflow code on purpose: decoding and validating are pure functions of the recorded
    payload, so replay decides the same, and a malformed answer is the caller's bad report
    instead of a decode error failing every workflow task. ``first_problem`` first: non-finite
    numbers, huge strings and deep nesting anywhere, before pydantic sees the value."""
    value, problem = _decoded(answer)
    field = ""
    if not problem:
        if (found := first_problem(value)) is not None:
            field, problem = found
        else:
            try:
                return TypeAdapter(model).validate_python(value), ""
            except ValidationError as error:
                text, fields = describe(error)  # "<field>: <problem>; ...", the first field first
                field, problem = fields[0], text.removeprefix(f"{fields[0]}: ")
    name = what if field in ("", "(input)") else f"{what}.{field}"
    return None, f"{name}: {problem}"[:MAX_PROBLEM_SHOWN]


def summarised(failures: list[str]) -> list[str]:
    """A node's smoke-test failures as any message may repeat them: at most about 850 characters."""
    shown = [failure[:SMOKE_FAILURE_CHARS] for failure in failures[:SMOKE_FAILURES_SHOWN]]
    if len(failures) > SMOKE_FAILURES_SHOWN:
        shown.append(f"and {len(failures) - SMOKE_FAILURES_SHOWN} more")
    return shown


def checked_smoke(node_name: str, answer: Any) -> SmokeResult:
    """A smoke test's answer as a workflow acts on it: ``SmokeReport`` (``passed`` a real
    boolean, bounded failures and boot id) and its state, if any, a ``NodeReport``. A malformed
    one is a failed smoke test whose one failure names the field: never a passed one, never a
    failed workflow task. Its failures are ``summarised``: no workflow sees more."""
    value, problem = _decoded(answer)
    report = state = None
    if problem:
        problem = f"smoke_test result: {problem}"
    else:
        report, problem = node_answer(value, SmokeReport, "smoke_test result")
    if report is not None and value.get("state") is not None:
        checked, problem = node_answer(value["state"], NodeReport, "smoke_test result.state")
        state = NodeWatchResult.model_validate(checked.model_dump()) if checked is not None else None
    if problem:
        count_bad_report("smoke_test")
        return SmokeResult(passed=False, gpus_seen=0, failures=[f"bad report from {node_name}: {problem}"])
    return SmokeResult(passed=report.passed, gpus_seen=report.gpus_seen, boot_id=report.boot_id,
                       failures=summarised(report.failures), state=state)


# -- node steps -----------------------------------------------------------------------------
#: The SDK's default cancel of an activity: the caller goes on at once, the activity stops when told.
TRY_CANCEL = workflow.ActivityCancellationType.TRY_CANCEL


async def drain_node(node_name: str, deadline_seconds: float, *, summary: str,
                     cordoned_by: str | None = None, machine_goes: bool = False,
                     cancellation_type: workflow.ActivityCancellationType = TRY_CANCEL) -> DrainResult:
    """Cordon and evict within the deadline, PodDisruptionBudgets honoured (``DrainNodeInput``:
    ``cordoned_by`` marks the cordon, ``machine_goes`` drains a node someone else holds too).

    Retried as a cluster call: the drain activity is idempotent (a second cordon and the
    evictions of pods already gone change nothing) and returns what was left, never raises
    for a blocked pod. It stops at its next heartbeat once cancelled; ``WAIT_CANCELLATION_COMPLETED``
    makes a cancelled drain's caller wait for that stop (no eviction after it goes on)."""
    return await workflow.execute_activity(
        act.drain_within, DrainNodeInput(node_name=node_name, deadline_seconds=deadline_seconds,
                                         cordoned_by=cordoned_by, machine_goes=machine_goes),
        start_to_close_timeout=timedelta(seconds=deadline_seconds + 60),
        heartbeat_timeout=WAIT_HEARTBEAT, retry_policy=CLUSTER_RETRY, summary=summary,
        cancellation_type=cancellation_type,
    )


async def smoke_test_node(node_name: str, expected_gpus: int, *, timeout_seconds: float, summary: str,
                          only_gpus: list[int] | None = None, include_state: bool = False,
                          heartbeat: timedelta | None = None) -> SmokeResult:
    """The node proves itself on its own task queue (its agent runs the checks), ``SMOKE_RETRY``
    attempts within ``timeout_seconds`` in all. Its answer is untrusted (``checked_smoke``):
    taken undecoded, the same command as ever."""
    answer = await workflow.execute_activity(
        act.smoke_test, SmokeTestInput(expected_gpus=expected_gpus, only_gpus=only_gpus, include_state=include_state),
        task_queue=node_queue(node_name), schedule_to_close_timeout=timedelta(seconds=timeout_seconds),
        start_to_close_timeout=timedelta(seconds=min(timeout_seconds, 300)), heartbeat_timeout=heartbeat,
        retry_policy=SMOKE_RETRY, summary=summary,
    )
    return checked_smoke(node_name, answer)


async def retire_machine(site: str, node_name: str, machine_id: str, *, summary: str,
                         cordoned_by: str | None = None) -> str:
    """Machine deleted at the provider (queued while its account is revoked), Node object out;
    returns "". With ``cordoned_by`` (the caller's cordon mark), a node someone else holds by now
    is kept: returns who holds it.

    ``PROVIDER_RETRY``: a provider call, bounded, because a delete that keeps failing must
    reach a person (every caller reports it) rather than bill on behind an endless retry."""
    held = await workflow.execute_activity(
        act.retire_machine, RetireMachineInput(site=site, node_name=node_name, machine_id=machine_id,
                                               cordoned_by=cordoned_by),
        start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY, summary=summary,
    )
    return held or ""  # None: retired (and every history recorded before the check)


@dataclass
class Retirement:
    """How ``drain_and_retire`` went: retired, or why not (never raised)."""

    retired: bool
    #: The drain did not complete (PodDisruptionBudgets): the node serves on, try again later.
    blocked: str = ""
    #: Drained, but the provider delete failed after its retries: a person looks.
    failed: str = ""
    #: Someone else took the node since it was chosen (who holds it), before its drain (nothing
    #: cordoned or evicted) or during it: nothing deleted, the cordon is theirs.
    kept: str = ""


async def drain_and_retire(site: str, node_name: str, machine_id: str, drain_seconds: float, *,
                           why: str, cordoned_by: str | None = None) -> Retirement:
    """Drain (its cordon marked ``cordoned_by``), then retire only a node whose drain completed
    and, with ``cordoned_by``, that no one else holds, before the drain (a person marked it
    theirs) or by its end (a repair fenced a GPU of it)."""
    drained = await drain_node(node_name, drain_seconds, summary=f"drain {node_name} ({why}; PDBs honoured)",
                               cordoned_by=cordoned_by)
    return await retire_drained(site, node_name, machine_id, drained, cordoned_by=cordoned_by)


async def retire_drained(site: str, node_name: str, machine_id: str, drained: DrainResult, *,
                         cordoned_by: str | None = None) -> Retirement:
    """``drain_and_retire`` past its drain: retire only a node whose drain completed and, with
    ``cordoned_by``, that no one else holds."""
    if drained.held:  # never in a result recorded before the field: those take the branches below
        return Retirement(False, kept=drained.held)
    if not drained.completed:
        return Retirement(False, blocked="drain blocked (" + "; ".join(p.reason for p in drained.blocked) + ")")
    try:
        held = await retire_machine(site, node_name, machine_id, summary=f"retire {node_name} (machine {machine_id})",
                                    cordoned_by=cordoned_by)
    except ActivityError as error:
        return Retirement(False, failed=f"retire failed: {failure_message(error)}")
    return Retirement(False, kept=held) if held else Retirement(True)


# -- serving steps --------------------------------------------------------------------------
async def wait_for_serving(model: str, site: str, deadline: datetime, *, summary: str,
                           poll_seconds: float | None = None) -> ServingStatus:
    """Until the model's Deployment at the site is ready, or the deadline (then it raises).

    ``CLUSTER_RETRY``: the deadline is absolute, so a retried attempt (a lost worker) waits
    only for what is left of it; the activity heartbeats while it waits."""
    extra = {} if poll_seconds is None else {"poll_seconds": poll_seconds}
    left = max((deadline - workflow.now()).total_seconds(), 0.0)
    return await workflow.execute_activity(
        act.wait_serving_ready, WaitServingInput(model=model, site=site, deadline=deadline, **extra),
        start_to_close_timeout=timedelta(seconds=left + 60),
        heartbeat_timeout=WAIT_HEARTBEAT, retry_policy=CLUSTER_RETRY, summary=summary,
    )
