"""``FleetClient``: every operator action on the fleet, as one typed async call.

Starts use the standard workflow ids with ``USE_EXISTING`` (the same call twice
attaches to the running workflow), the search attributes a workflow shows from
its first moment, and a static summary for the UI. Inputs are validated with the
workflow's own pydantic model before anything is sent; the workflow validates
them again, so a caller without this client (``temporal``, the HTTP API) gets
the same answer, only later.
"""

from __future__ import annotations

import asyncio
import math
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateHandle,
    WorkflowUpdateRPCTimeoutOrCancelledError,
    WorkflowUpdateStage,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy
from temporalio.exceptions import CancelledError
from temporalio.service import RPCError, RPCStatusCode

from client.errors import InvalidArgument, NoWorker, NotFound, Rejected, Unreachable, UpdateNotTaken, UpdateUnanswered
from fleet import search_attributes as sa
from fleet.config import ConfigError, FleetConfig, load_config
from fleet.messages.advisor import AdvisorInput, AdvisorReport
from fleet.messages.capacity import AccountStatus, CapacityProgress, CapacityRequest, CapacityResult, QuotaRaised, SiteInput, SiteStatus
from fleet.messages.evacuation import EvacuationProgress, EvacuationResult, SiteEvacuationInput
from fleet.messages.join import JoinProgress, NodeJoinInput, NodeJoinResult
from fleet.messages.repair import (
    GpuDecision, HoldInput, LadderState, NodeStatus, RepairGpuInput, ReturnGpuInput, SkipToInput,
)
from fleet.naming import (
    account_workflow_id, advisor_workflow_id, capacity_workflow_id, fan_out_join_id, join_workflow_id,
    manual_evacuation_id, site_workflow_id,
)
from fleet.repair_policy import Rung
from fleet.rollout import RolloutInput, RolloutProgress, RolloutResult, another_rollout_running
from fleet.settings import Settings
from fleet.site_use import join_refusal
from fleet.contracts import workflows as flows
from fleet.visibility import open_runs_query, utc_stamp
from fleet.watched import closed_as

M = TypeVar("M", bound=BaseModel)
USE_EXISTING = WorkflowIDConflictPolicy.USE_EXISTING

#: How long a query waits for a worker's answer. A worker answers from its cache in milliseconds,
#: one that must first replay a long history in seconds. Unbounded, a query to a workflow no
#: worker polls for (the control plane down) waited the server's own deadline, 30 s, and a command
#: that asks several waited minutes, then showed nothing or an empty status.
QUERY_TIMEOUT = timedelta(seconds=10)
#: How long naming the task queue of a workflow whose query went unanswered may take (a describe:
#: the server answers it itself, no worker needed).
DESCRIBE_TIMEOUT = timedelta(seconds=5)
#: How long an update waits for a worker to take it (run its validator and accept it), as a query
#: waits for its answer: a worker takes it with its next workflow task. Unbounded, an update to a
#: workflow no worker polls for (the control plane down) waited for ever, and its command with it,
#: saying nothing.
UPDATE_TIMEOUT = QUERY_TIMEOUT
#: How long an update's answer is waited for once a worker has taken it (``FleetClient``'s
#: ``update_answer_timeout``; a command with a --timeout of its own waits that). Its handler runs in
#: the workflow, mostly in milliseconds; some wait on an activity or on other work: a capacity
#: cancel for its joins to stop and delete their machines, a credentials check (60 s a try, three
#: tries). Unbounded, a worker that stopped as it ran the handler, or a handler that waited long,
#: left the command waiting for ever, saying nothing. Past it: :class:`UpdateUnanswered`, saying
#: that the update goes on in the workflow and how to look at it.
UPDATE_ANSWER_TIMEOUT = timedelta(minutes=5)
#: An answer not back this soon is said to be waited for, and until when (``FleetClient``'s
#: ``waiting``): most come back well within it.
UPDATE_ANSWER_QUIET = timedelta(seconds=2)


def capacity_id(request: str) -> str:
    """``capacity/<request>`` from itself or from the request id."""
    return request if request.startswith("capacity/") else capacity_workflow_id(request)


def rollout_workflow_id(rollout: str) -> str:
    """``rollout/<model>/<version>`` from itself or from ``<model>/<version>``."""
    return rollout if rollout.startswith("rollout/") else f"rollout/{rollout}"


def validate(model: type[M], value: M | Mapping[str, Any], what: str | None = None) -> M:
    """``value`` checked by ``model`` (a model instance is checked again: fields may have
    been assigned since), or :class:`InvalidArgument` naming each bad field."""
    raw = value.model_dump(mode="json", exclude_unset=True) if isinstance(value, BaseModel) else value
    if not isinstance(raw, Mapping):
        raise InvalidArgument([("(input)", f"expected {model.__name__} or a mapping, got {type(value).__name__}")],
                              what or model.__name__)
    try:
        return model.model_validate(dict(raw))
    except ValidationError as error:
        raise InvalidArgument.of(error, what or model.__name__) from None


def _text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument([(name, "must be a non-empty string")])
    return value


def _payload(model: BaseModel) -> dict[str, Any]:
    """What goes on the wire: plain JSON with only what the caller set."""
    return model.model_dump(mode="json", exclude_unset=True)


@dataclass
class RolloutStatus:
    """A rollout as ``describe`` and the ``progress`` query see it, with the bytes each
    site's replication activity last heartbeated (fresher than the query)."""

    workflow_id: str
    status: WorkflowExecutionStatus | None
    progress: RolloutProgress | None
    replicating: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class JoinCancelled:
    """How a cancelled join ended (``FleetClient.cancel_join``)."""

    workflow_id: str
    #: ``canceled`` (also a join of the code before, which ended by failing its step as
    #: CancelledError); ``completed`` when it had admitted its node before the cancel; ``failed``
    #: when it failed on its own first.
    status: str
    #: The machine it bought ("" = none yet: nothing was bought). Deleted unless ``needs_person``
    #: or the join had completed (then it is the admitted node's, and stays).
    machine_id: str = ""
    node_name: str = ""
    #: The step the cancel stopped it at.
    step: str = ""
    #: Its clean-up could not delete the machine (the join's history says why).
    needs_person: bool = False
    #: The cancel came while the node was admitted, and the admit went through: the join completed,
    #: and its node stays.
    admitted: bool = False
    #: A fan-out's (``count`` > 1) joins, ``<workflow_id>/<i>``, each as it ended: they bought the
    #: machines, not the fan-out.
    joins: list[JoinCancelled] = field(default_factory=list)

    def summary(self) -> str:
        if self.joins:
            head = {"completed": f"{self.workflow_id} had ended before the cancel",
                    "failed": f"{self.workflow_id} had failed before the cancel"}.get(
                        self.status, f"cancelled {self.workflow_id} while {self.step}")
            return head + f"; its {len(self.joins)} joins:" + "".join(f"\n  {j.summary()}" for j in self.joins)
        if self.status == "completed" and self.admitted:
            return (f"{self.workflow_id}: the cancel came while node {self.node_name} was admitted; the admit "
                    f"went through, so that node stays (machine {self.machine_id})")
        if self.status == "completed":
            return f"{self.workflow_id} had joined {self.node_name} before the cancel: that node stays"
        if self.status == "failed":
            return f"{self.workflow_id} had failed before the cancel (its own clean-up deleted any machine it bought)"
        if not self.machine_id:
            return f"cancelled {self.workflow_id} while {self.step}: nothing was bought"
        if self.needs_person:
            return (f"cancelled {self.workflow_id}: machine {self.machine_id} could NOT be deleted "
                    "(FleetState needs-person; its history says why)")
        return f"cancelled {self.workflow_id}: machine {self.machine_id} deleted, node {self.node_name} never admitted"


@dataclass
class Renewed:
    """What ``FleetClient.renew_entities`` asked of one entity type's runs from before a deploy."""

    workflow_type: str
    #: Runs sent ``renew``: each continues as new at its next safe point.
    asked: int = 0
    #: Runs listed that had closed by the time they were asked (continued as new meanwhile, or
    #: ended): nothing to ask.
    closed: int = 0


class FleetClient:
    """gpufleet's operator actions. Connects on first use with the same settings as every
    other entry point (``TEMPORAL_ADDRESS``, ``TEMPORAL_NAMESPACE``, ``GPUFLEET_TASK_QUEUE``,
    ``GPUFLEET_CONFIG``), so an invalid argument is refused even without a server.

    ``update_answer_timeout`` (a timedelta, or seconds): how long an update taken by a worker is
    waited for (default ``UPDATE_ANSWER_TIMEOUT``). ``waiting``: told, in one line, of an update
    whose answer has not come within ``UPDATE_ANSWER_QUIET`` (what is waited for, and until when)."""

    def __init__(self, settings: Settings | None = None, temporal: Client | None = None, *,
                 update_answer_timeout: timedelta | float | None = None,
                 waiting: Callable[[str], None] | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self._client = temporal
        self._config: FleetConfig | None = None
        if update_answer_timeout is None:
            update_answer_timeout = UPDATE_ANSWER_TIMEOUT
        elif not isinstance(update_answer_timeout, timedelta):
            if not math.isfinite(update_answer_timeout):
                raise InvalidArgument([("update_answer_timeout", "must be a finite number of seconds")])
            update_answer_timeout = timedelta(seconds=update_answer_timeout)
        if update_answer_timeout <= timedelta(0):
            raise InvalidArgument([("update_answer_timeout", "must be more than 0 s")])
        self.update_answer_timeout: timedelta = update_answer_timeout
        self.waiting = waiting

    async def temporal(self) -> Client:
        """The Temporal client (pydantic payloads, tracing), connected once."""
        if self._client is None:
            from fleet.temporal import connect

            try:
                self._client = await connect(self.settings)
            except RuntimeError as error:
                raise Unreachable(self.settings.address, str(error)) from None
        return self._client

    def config(self) -> FleetConfig | None:
        """The fleet config this client was given (None when it cannot be read: the
        workflows, which read their own, name the problem)."""
        if self._config is None:
            try:
                self._config = load_config(self.settings.config)
            except ConfigError:
                return None
        return self._config

    # -- joins and capacity ----------------------------------------------------------------
    async def start_join(self, request: NodeJoinInput | Mapping[str, Any], *,
                         request_id: str) -> WorkflowHandle[Any, NodeJoinResult]:
        """Start NodeJoin ``join/<site>/<request_id>`` (or attach to it).

        Refused before anything starts (:class:`InvalidArgument`), as ``gpufleet join`` refuses it:
        a site the fleet config does not name (``site``), and more nodes than the site's
        ``max_nodes`` (``count``; 0 for a site being emptied), whose Site entity would retire each
        machine bought past it. The nodes already there are not counted (no cluster is read here):
        a node joined to a full site, say to replace a failing one, is the Site entity's to weigh."""
        args = validate(NodeJoinInput, request)
        _text("request_id", request_id)
        workflow_id = join_workflow_id(args.site, request_id)
        attributes = None
        config = self.config()
        if config is not None:  # none to read: the join itself names an unknown site, or max_nodes
            refused = join_refusal(config, args.site, args.count)
            if refused is not None:
                raise InvalidArgument([refused])
            site = config.site(args.site)
            attributes = sa.join_start_attributes(site.name, site.provider, site.account, workflow_id)
        client = await self.temporal()
        return await client.start_workflow(
            flows.NodeJoin.TYPE, _payload(args), id=workflow_id, task_queue=self.settings.task_queue,
            id_conflict_policy=USE_EXISTING, result_type=NodeJoinResult, search_attributes=attributes,
            static_summary=f"join a node at {args.site}" if args.count == 1 else f"join {args.count} nodes at {args.site}",
        )

    async def join_progress(self, workflow_id: str) -> JoinProgress:
        return await self._query(workflow_id, flows.NodeJoin.progress, JoinProgress)

    async def cancel_join(self, workflow_id: str, reason: str = "") -> JoinCancelled:
        """Stop a join (Temporal's cancel): a machine it bought and has not admitted is deleted
        (a fan-out's children each delete theirs); a node it already admitted stays, one whose admit
        was under way as the cancel came too, once the admit went through. Returns once the join has
        ended, saying which of those happened."""
        _text("workflow_id", workflow_id)
        if not isinstance(reason, str):
            raise InvalidArgument([("reason", "must be a string")])
        client = await self.temporal()
        handle = client.get_workflow_handle(workflow_id)
        try:
            await handle.cancel(reason=reason)
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:  # "already completed" is fine: say how it ended
                raise _rpc(workflow_id, error) from None
        ended = await self._join_ended(handle)
        if not ended.machine_id:  # a fan-out buys through its joins: each says what it bought
            ended.joins = await self._fan_out_joins(client, workflow_id)
        return ended

    async def _join_ended(self, handle: WorkflowHandle) -> JoinCancelled:
        """How a join that was cancelled (or had ended before) ended, once it has."""
        workflow_id = handle.id
        status = "completed"
        try:
            await handle.result()
        except WorkflowFailureError as error:
            # A join ends Canceled; one of the code before reported the cancel as its failure, typed so.
            cause = error.cause
            cancelled = isinstance(cause, CancelledError) or getattr(cause, "type", None) == "CancelledError"
            status = "canceled" if cancelled else "failed"
        except RPCError as error:  # never started (NotFound)
            raise _rpc(workflow_id, error) from None
        try:
            description = await handle.describe()
        except RPCError as error:
            raise _rpc(workflow_id, error) from None
        try:
            progress = await self.join_progress(workflow_id)
        except Exception:  # noqa: BLE001 - ended before its first task: nothing was bought
            progress = JoinProgress(step="starting")
        state = description.typed_search_attributes.get(sa.FLEET_STATE) or ""
        return JoinCancelled(workflow_id=workflow_id, status=status, machine_id=progress.machine_id,
                             node_name=progress.node_name, step=progress.cancelled_while or progress.step,
                             needs_person=state == "needs-person", admitted=progress.admitted)

    async def _fan_out_joins(self, client: Client, workflow_id: str) -> list[JoinCancelled]:
        """A fan-out's joins (``<workflow_id>/<i>``, cancelled with it and ended before it), each as
        it ended; none for a single join, or a fan-out cancelled before it started any."""
        joins: list[JoinCancelled] = []
        while True:
            child = client.get_workflow_handle(fan_out_join_id(workflow_id, len(joins)))
            try:
                await child.describe()
            except RPCError as error:
                if error.status == RPCStatusCode.NOT_FOUND:
                    return joins
                raise _rpc(child.id, error) from None
            joins.append(await self._join_ended(child))

    def check_capacity_request(self, request: CapacityRequest | Mapping[str, Any]) -> CapacityRequest:
        """The request, or :class:`InvalidArgument` naming each field no configured site can
        ever satisfy (an empty request, an unknown site or GPU, an impossible combination, a
        ``count`` more than the eligible sites' ``max_nodes`` together), checked against this
        client's fleet config; the workflow checks the same at start."""
        from fleet.feasibility import EMPTY, count_problems, request_problems

        args = validate(CapacityRequest, request)
        config = self.config()
        problems = request_problems(args.constraints, config.sites if config else [])
        if config is None:  # no config to check against: only what needs none
            problems = [p for p in problems if p[1] == EMPTY]
        elif not problems:
            problems = count_problems(args.count, args.constraints, config.sites)
        if problems:
            raise InvalidArgument(problems, "CapacityRequest")
        return args

    async def acquire_capacity(self, request: CapacityRequest | Mapping[str, Any], *,
                               request_id: str) -> WorkflowHandle[Any, CapacityResult]:
        """Start AcquireCapacity ``capacity/<request_id>`` (or attach to it). A request no
        configured site can ever serve is refused before anything starts."""
        args = self.check_capacity_request(request)
        _text("request_id", request_id)
        client = await self.temporal()
        return await client.start_workflow(
            flows.AcquireCapacity.TYPE, _payload(args), id=capacity_workflow_id(request_id),
            task_queue=self.settings.task_queue, id_conflict_policy=USE_EXISTING, result_type=CapacityResult,
            static_summary=f"capacity: {args.count} x {args.constraints.gpu or 'any GPU'}",
        )

    async def capacity_progress(self, workflow_id: str) -> CapacityProgress:
        return await self._query(capacity_id(_text("request", workflow_id)), flows.AcquireCapacity.progress, CapacityProgress)

    async def cancel_capacity(self, request: str, reason: str = "", *,
                              accepted: Callable[[], None] | None = None) -> CapacityProgress:
        """Stop a capacity request (``capacity/<id>`` or its request id): every join in flight
        is cancelled and deletes its machine; nodes already joined stay. Returns once that is
        done, naming each join it stopped (``released``); not done within ``update_answer_timeout``,
        :class:`UpdateUnanswered` (the cancel goes on). ``accepted`` is called as soon as the
        request has taken the cancel (from then on it happens even if this caller goes away)."""
        workflow_id = capacity_id(_text("request", request))
        if not isinstance(reason, str):
            raise InvalidArgument([("reason", "must be a string")])
        client = await self.temporal()
        handle = client.get_workflow_handle(workflow_id)
        try:
            update = await self._taken(handle, flows.AcquireCapacity.cancel, lambda: handle.start_update(
                flows.AcquireCapacity.cancel, reason, wait_for_stage=WorkflowUpdateStage.ACCEPTED, result_type=CapacityProgress))
            if accepted is not None:
                accepted()
            return await self._answered(handle, flows.AcquireCapacity.cancel, update)
        except WorkflowUpdateFailedError as error:
            raise Rejected(workflow_id, flows.AcquireCapacity.cancel, str(error.cause)) from error
        except RPCError as error:
            raise _rpc(workflow_id, error, flows.AcquireCapacity.cancel) from None

    # -- rollouts --------------------------------------------------------------------------
    async def start_rollout(self, request: RolloutInput | Mapping[str, Any]) -> WorkflowHandle[Any, RolloutResult]:
        """Start ModelRollout ``rollout/<model>/<version>`` (the same version attaches). A rollout
        the fleet config rules out (an unknown object store or site, a site with no object store,
        a replica wanting more GPUs than a site's machine has) is refused before anything starts."""
        args = validate(RolloutInput, request, "rollout")
        config = self.config()
        if config is not None:  # the workflow checks the same against its own config
            from fleet.rollout import check_sites, check_source

            sites = {s.name: s for s in config.sites}
            asked = [t.site for t in args.sites if t.site in sites]
            problems = check_source(args, config.object_stores) + check_sites(
                args, {name: sites[name].object_store for name in asked}, sites,
                {name: sites[name].gpus_per_machine for name in asked})
            if problems:
                raise InvalidArgument([(field, message) for field, _, message in
                                       (p.partition(": ") for p in problems)], "rollout")
        running = await self.running_rollout(args.model)
        if running is not None and running != args.rollout_id:  # the same version attaches
            field, _, message = another_rollout_running(running).partition(": ")
            raise InvalidArgument([(field, message)], "rollout")
        client = await self.temporal()
        return await client.start_workflow(
            flows.ModelRollout.TYPE, _payload(args), id=args.rollout_id, task_queue=self.settings.task_queue,
            id_conflict_policy=USE_EXISTING, result_type=RolloutResult,
            search_attributes=TypedSearchAttributes([SearchAttributePair(sa.MODEL, args.model),
                                                     SearchAttributePair(sa.MODEL_VERSION, args.version)]),
            static_summary=f"roll {args.model} {args.version} out to {len(args.sites)} sites",
        )

    async def running_rollout(self, model: str) -> str | None:
        """The id of the rollout of ``model`` running now, as Temporal's list shows it (a moment
        after its start: one started within that moment is refused by the rollout's first step,
        which claims the model, instead)."""
        client = await self.temporal()
        query = (f'WorkflowType = "{flows.ModelRollout.TYPE}" AND ExecutionStatus = "Running" '
                 f'AND TaskQueue = "{self.settings.task_queue}" AND Model = "{_text("model", model)}"')
        async for wf in client.list_workflows(query):
            # The list lags a close too: the run itself says whether it still runs.
            try:
                described = await client.get_workflow_handle(wf.id).describe()
            except RPCError as error:
                if error.status == RPCStatusCode.NOT_FOUND:
                    continue
                raise
            if described.status == WorkflowExecutionStatus.RUNNING:
                return wf.id
        return None

    async def rollout_progress(self, rollout: str) -> RolloutProgress | None:
        """None while the rollout is still starting."""
        return await self._query(rollout_workflow_id(_text("rollout", rollout)), flows.ModelRollout.progress, RolloutProgress)

    async def rollout_status(self, rollout: str) -> RolloutStatus:
        workflow_id = rollout_workflow_id(_text("rollout", rollout))
        client = await self.temporal()
        handle = client.get_workflow_handle(workflow_id)
        try:
            description = await handle.describe()
        except RPCError as error:
            raise _rpc(workflow_id, error) from None
        progress = await self._query(workflow_id, flows.ModelRollout.progress, RolloutProgress)
        live: dict[str, dict[str, Any]] = {}
        for pending in description.raw_description.pending_activities:
            if pending.activity_id.startswith("replicate/") and pending.heartbeat_details.payloads:
                try:
                    (details,) = await client.data_converter.decode(pending.heartbeat_details.payloads)
                    live[pending.activity_id.removeprefix("replicate/")] = details
                except Exception:  # noqa: BLE001 - unreadable details: the query's numbers stand
                    pass
        return RolloutStatus(workflow_id, description.status, progress, live)

    async def pause_rollout(self, rollout: str, reason: str = "") -> RolloutProgress:
        workflow_id = rollout_workflow_id(_text("rollout", rollout))
        return await self._update(workflow_id, flows.ModelRollout.pause, [reason], RolloutProgress,
                                  _rollout_look(workflow_id))

    async def resume_rollout(self, rollout: str, reason: str = "") -> RolloutProgress:
        workflow_id = rollout_workflow_id(_text("rollout", rollout))
        return await self._update(workflow_id, flows.ModelRollout.resume, [reason], RolloutProgress,
                                  _rollout_look(workflow_id))

    async def abort_rollout(self, rollout: str, reason: str = "") -> RolloutProgress:
        workflow_id = rollout_workflow_id(_text("rollout", rollout))
        return await self._update(workflow_id, flows.ModelRollout.abort, [reason], RolloutProgress,
                                  _rollout_look(workflow_id))

    # -- GPU repairs and nodes -------------------------------------------------------------
    async def repair_ladder(self, node: str, gpu: int) -> LadderState:
        return await self._query(self._repair_id(node, gpu), flows.GpuRepair.ladder, LadderState)

    async def hold_repair(self, node: str, gpu: int, reason: str = "") -> LadderState:
        """Stay contained and do nothing at the next step until released."""
        held = validate(HoldInput, {"reason": reason})
        return await self._update(self._repair_id(node, gpu), flows.GpuRepair.hold, [_payload(held)], LadderState,
                                  f"gpufleet repair show {node} {gpu}")

    async def release_repair(self, node: str, gpu: int, reason: str = "") -> LadderState:
        released = validate(HoldInput, {"reason": reason})
        return await self._update(self._repair_id(node, gpu), flows.GpuRepair.release, [_payload(released)],
                                  LadderState, f"gpufleet repair show {node} {gpu}")

    async def skip_repair_to(self, node: str, gpu: int, rung: Rung | str | SkipToInput) -> LadderState:
        """Go to ``rung`` next (also re-enters an exhausted ladder)."""
        target = rung if isinstance(rung, SkipToInput) else validate(SkipToInput, {"rung": rung})
        return await self._update(self._repair_id(node, gpu), flows.GpuRepair.skip_to, [target], LadderState,
                                  f"gpufleet repair show {node} {gpu}")

    async def return_gpu(self, node: str, gpu: int, reason: str) -> GpuDecision:
        """A GPU the node's entity holds for a person (its repair ended unproven: ``needs_person``
        in ``node_status``) back in service on a person's word: un-fenced, the node uncordoned
        unless another GPU of it is fenced. Refused (:class:`Rejected`, naming ``gpu``) for a GPU
        not held for a person; :class:`NotFound` when the node's entity is not running."""
        order = validate(ReturnGpuInput, {"gpu": gpu, "reason": reason})
        return await self._update(self._node_id(node), flows.Node.return_gpu, [_payload(order)], GpuDecision,
                                  f"gpufleet repair node {node}")

    async def retry_repair(self, node: str, gpu: int, reason: str, rung: Rung | str | None = None) -> GpuDecision:
        """A new GpuRepair of a GPU the node's entity holds for a person, admitted by its Site
        entity like any finding: at ``rung``, or (None) where the policy starts for the finding
        its ended repair was started for (a reset when none is known). Refused as ``return_gpu``."""
        order = validate(RepairGpuInput, {"gpu": gpu, "reason": reason, **({} if rung is None else {"rung": rung})})
        return await self._update(self._node_id(node), flows.Node.repair_gpu, [_payload(order)], GpuDecision,
                                  f"gpufleet repair node {node}")

    async def node_status(self, node: str) -> NodeStatus:
        """The Node entity's status; where its run has closed (terminated, failed: nothing watches the
        node until the site sweep starts it again) ``entity`` says how and ``entity_closed_at`` when,
        and ``state`` is ``unwatched``: a closed run's query still answers with what it last knew
        ("ready"). A run that ended with its node (``gone``) keeps its state."""
        workflow_id = self._node_id(node)
        client = await self.temporal()
        try:
            described = await client.get_workflow_handle(workflow_id).describe()
        except RPCError as error:
            raise _rpc(workflow_id, error) from None
        if described.status == WorkflowExecutionStatus.RUNNING:
            return await self._query(workflow_id, flows.Node.status, NodeStatus)
        try:
            status = await self._query(workflow_id, flows.Node.status, NodeStatus)
        except Exception:  # noqa: BLE001 - a closed run's query replays its history: no worker, old code
            status = NodeStatus(node_name=_text("node", node), state="")
        closed = {"entity": closed_as(described.status), "entity_closed_at": described.close_time}
        if status.state != "gone":
            closed["state"] = "unwatched"
        if not status.site:
            # A run that ended before it learned its node's facts (terminated as it started) knows no
            # site; the control plane started it with its site as a search attribute.
            closed["site"] = described.typed_search_attributes.get(sa.SITE) or ""
        return status.model_copy(update=closed)

    @staticmethod
    def _node_id(node: str) -> str:
        from fleet.naming import node_workflow_id

        return node_workflow_id(_text("node", node))

    @staticmethod
    def _repair_id(node: str, gpu: int) -> str:
        from fleet.naming import repair_workflow_id

        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise InvalidArgument([("gpu", "must be a GPU index (an integer >= 0)")])
        return repair_workflow_id(_text("node", node), gpu)

    # -- provider accounts -----------------------------------------------------------------
    async def quota_raised(self, account: str, offers: list[str] | QuotaRaised | None = None, *,
                           all: bool = False, provider: str | None = None) -> AccountStatus:
        """A person raised the quota: these offers (``site/instance-type``), or with ``all``
        every blocked one, sell again. Neither is refused (``InvalidInput`` naming ``offers``)."""
        request = offers if isinstance(offers, QuotaRaised) else \
            validate(QuotaRaised, {"offers": offers or [], "all": all})
        return await self._update(self._account_id(account, provider), flows.ProviderAccount.quota_raised,
                                  [request.model_dump(mode="json")], AccountStatus, "gpufleet accounts list")

    async def credentials_rotated(self, account: str, *, provider: str | None = None) -> AccountStatus:
        """The credentials are fixed: accepted after one authenticated call succeeds."""
        return await self._update(self._account_id(account, provider), flows.ProviderAccount.credentials_rotated, [],
                                  AccountStatus, "gpufleet accounts list")

    async def account_status(self, account: str, *, provider: str | None = None) -> AccountStatus:
        return await self._query(self._account_id(account, provider), flows.ProviderAccount.status, AccountStatus)

    async def accounts(self, needs_person: bool = False) -> list[AccountStatus]:
        """Every running ProviderAccount entity (only those waiting for a person)."""
        client = await self.temporal()
        query = f'WorkflowType = "{flows.ProviderAccount.TYPE}" AND ExecutionStatus = "Running"'
        if needs_person:
            query += ' AND FleetState = "needs-person"'
        found = []
        async for wf in client.list_workflows(query):
            found.append(await self._query(wf.id, flows.ProviderAccount.status, AccountStatus))
        return found

    def _account_id(self, account: str, provider: str | None) -> str:
        _text("account", account)
        if provider is None:
            config = self.config()
            try:
                provider = config.account(account).provider if config else None
            except KeyError:
                provider = None
            if provider is None:
                raise InvalidArgument([("account", f"unknown account {account!r}")])
        return account_workflow_id(_text("provider", provider), account)

    # -- sites and evacuations -------------------------------------------------------------
    async def reconcile_site(self, site: str) -> str:
        """Tell the Site entity to reconcile now (its ``reconcile_now`` update), starting it if it
        is not running; returns its answer: what the reconcile will do (fill, retire, nothing, or
        why not now). A site the fleet config does not name is refused before anything is sent."""
        args = validate(SiteInput, {"site": _text("site", site)})
        self._known_site(args.site)
        client = await self.temporal()
        start = WithStartWorkflowOperation(
            flows.Site.TYPE, _payload(args), id=site_workflow_id(args.site), task_queue=self.settings.task_queue,
            id_conflict_policy=USE_EXISTING, static_summary=f"site {args.site}: min/max reconcile",
        )
        workflow_id = site_workflow_id(args.site)
        try:
            handle = client.get_workflow_handle(workflow_id)
            update = await self._taken(handle, flows.Site.reconcile_now,
                                       lambda: client.start_update_with_start_workflow(
                                           flows.Site.reconcile_now, start_workflow_operation=start,
                                           wait_for_stage=WorkflowUpdateStage.ACCEPTED, result_type=str))
            return await self._answered(handle, flows.Site.reconcile_now, update, "gpufleet sites")
        except WorkflowUpdateFailedError as error:
            raise Rejected(workflow_id, flows.Site.reconcile_now, str(error.cause)) from error
        except RPCError as error:
            raise _rpc(workflow_id, error, flows.Site.reconcile_now) from None

    def _known_site(self, site: str) -> None:
        """:class:`InvalidArgument` naming ``site`` when the fleet config has no such site (no
        config to check against: the workflow names it)."""
        config = self.config()
        if config is not None and site not in {s.name for s in config.sites}:
            known = ", ".join(s.name for s in config.sites)
            raise InvalidArgument([("site", f"unknown site {site!r}; known: {known}")])

    async def site_status(self, site: str) -> SiteStatus:
        return await self._query(site_workflow_id(_text("site", site)), flows.Site.status, SiteStatus)

    async def evacuate_site(self, request: SiteEvacuationInput | Mapping[str, Any], *,
                            request_id: str) -> WorkflowHandle[Any, EvacuationResult]:
        """Evacuate a site by hand: SiteEvacuation ``evacuate/<site>/manual-<request_id>``.

        The Site entity does not know about it: its own incident rule still runs. Where another
        evacuation of the site began first, this one follows it: it changes nothing and ends with
        that one's outcome. A site the fleet config does not name is refused before anything starts."""
        args = validate(SiteEvacuationInput, request)
        _text("request_id", request_id)
        self._known_site(args.site)
        client = await self.temporal()
        return await client.start_workflow(
            flows.SiteEvacuation.TYPE, _payload(args), id=manual_evacuation_id(args.site, request_id),
            task_queue=self.settings.task_queue, id_conflict_policy=USE_EXISTING, result_type=EvacuationResult,
            search_attributes=TypedSearchAttributes([SearchAttributePair(sa.SITE, args.site)]),
            static_summary=f"evacuate {args.site} by hand: {args.reason}",
        )

    async def evacuation_progress(self, evacuation_id: str) -> EvacuationProgress | None:
        return await self._query(_text("evacuation_id", evacuation_id), flows.SiteEvacuation.progress, EvacuationProgress)

    async def running_evacuation(self, site: str) -> str | None:
        """The id of the evacuation acting at ``site``: the Site entity's open incident, else one
        started by hand; where that one follows another (begun first at the same site: it changes
        nothing itself), the one it follows, which is the one to abort, declare recovered or watch."""
        _text("site", site)
        client = await self.temporal()
        try:
            status = await self.site_status(site)
        except NotFound:
            status = None
        found = None
        if status is not None and status.incident is not None and status.incident.open is not None:
            found = status.incident.open.id
        else:
            query = f'WorkflowType = "{flows.SiteEvacuation.TYPE}" AND ExecutionStatus = "Running" AND Site = "{site}"'
            async for wf in client.list_workflows(query, limit=1):
                found = wf.id
        if found is None:
            return None
        try:
            progress = await self.evacuation_progress(found)
        except NotFound:
            return None  # ended meanwhile
        return progress.following if progress is not None and progress.following else found

    async def declare_site_recovered(self, site: str, note: str = "", *,
                                     evacuation_id: str | None = None) -> EvacuationProgress:
        """The provider is back: the evacuation restores now (nodes still pass smoke tests)."""
        workflow_id = evacuation_id or await self._evacuation_of(site)
        return await self._update(workflow_id, flows.SiteEvacuation.declare_recovered, [note], EvacuationProgress)

    async def abort_evacuation(self, site: str, reason: str = "", *,
                               evacuation_id: str | None = None) -> EvacuationProgress:
        """Stop the evacuation and put back what it changed (nodes uncordoned unless held for a
        reason of their own, Deployments and routing weights as they were, what it added
        elsewhere gone). Answers at once; its state goes ``restoring``, then ``aborted``."""
        workflow_id = evacuation_id or await self._evacuation_of(site)
        return await self._update(workflow_id, flows.SiteEvacuation.abort, [reason], EvacuationProgress)

    async def retry_evacuation(self, site: str, *, evacuation_id: str | None = None) -> str:
        """Look again now for a place for the site's replicas (after adding capacity or a
        compliant site); answers whether a wait was woken."""
        workflow_id = evacuation_id or await self._evacuation_of(site)
        return await self._update(workflow_id, flows.SiteEvacuation.look_again, [], str)

    async def _evacuation_of(self, site: str) -> str:
        found = await self.running_evacuation(site)
        if found is None:
            raise NotFound(site_workflow_id(site), f"no evacuation is running at {site}")
        return found

    # -- the advisor (read-only) -----------------------------------------------------------
    async def start_advisor(self, request: AdvisorInput | Mapping[str, Any] | None = None
                            ) -> WorkflowHandle[Any, AdvisorReport]:
        """Start Advisor ``advisor/<since>`` (or attach to the one running for that period)."""
        args = validate(AdvisorInput, request or {}, "advisor")
        client = await self.temporal()
        return await client.start_workflow(
            flows.Advisor.TYPE, _payload(args), id=advisor_workflow_id(args.since), task_queue=self.settings.task_queue,
            id_conflict_policy=USE_EXISTING, result_type=AdvisorReport,
            static_summary=f"advisor: last {args.since}, cost now vs the cheapest qualifying placement",
        )

    async def advisor(self, request: AdvisorInput | Mapping[str, Any] | None = None) -> AdvisorReport:
        """The advisor's report (starts the run, waits for it)."""
        return await (await self.start_advisor(request)).result()

    # -- upgrades ----------------------------------------------------------------------------
    async def renew_entities(self, deployed_since: datetime, workflow_types: Iterable[str] | None = None, *,
                             task_queue: str | None = None) -> list[Renewed]:
        """Send ``renew`` to every running entity run (of ``workflow_types``, default every entity
        type) started before ``deployed_since`` (no offset: UTC): each continues as new at its next
        safe point, on the code deployed since, and stops holding the patches of the code before
        (docs/design/patches.md). The run ids listed are the ones asked, so a run that continued as
        new meanwhile (started after the deploy) is not asked again. Only entities continue as new:
        another type is refused, naming ``workflow``."""
        types = sorted(flows.ENTITIES) if workflow_types is None else list(dict.fromkeys(workflow_types))
        not_entities = [t for t in types if t not in flows.ENTITIES]
        if not_entities:
            raise InvalidArgument([("workflow", f"{t!r} is no entity type ({', '.join(sorted(flows.ENTITIES))}): "
                                    "its runs end by themselves, none continues as new") for t in not_entities])
        if deployed_since.tzinfo is None:
            deployed_since = deployed_since.replace(tzinfo=timezone.utc)
        if deployed_since > datetime.now(timezone.utc):
            raise InvalidArgument([("deployed_since", f"{utc_stamp(deployed_since)} is in the future: "
                                                      "the deploy has not finished yet")])
        client = await self.temporal()
        queue = task_queue or self.settings.task_queue
        renewed = []
        for workflow_type in types:
            done = Renewed(workflow_type)
            async for run in client.list_workflows(open_runs_query(workflow_type, queue, deployed_since)):
                try:
                    await client.get_workflow_handle(run.id, run_id=run.run_id).signal(
                        flows.ENTITIES[workflow_type].renew)
                except RPCError as error:
                    if error.status != RPCStatusCode.NOT_FOUND:
                        raise
                    done.closed += 1
                else:
                    done.asked += 1
            renewed.append(done)
        return renewed

    # -- the two primitives ----------------------------------------------------------------
    async def _query(self, workflow_id: str, name: str, result_type: type[M]) -> M:
        return await query_workflow(await self.temporal(), workflow_id, name, result_type,
                                    task_queue=self.settings.task_queue)

    async def _update(self, workflow_id: str, name: str, args: list[Any], result_type: type[M], look: str = "") -> M:
        """The answer to update ``name`` of ``workflow_id``: taken within ``UPDATE_TIMEOUT``, answered
        within ``update_answer_timeout`` (``look``: a gpufleet command showing the workflow, named
        when it is not)."""
        client = await self.temporal()
        handle = client.get_workflow_handle(workflow_id)
        try:
            update = await self._taken(handle, name, lambda: handle.start_update(
                name, args=args, wait_for_stage=WorkflowUpdateStage.ACCEPTED, result_type=result_type))
            return await self._answered(handle, name, update, look)
        except WorkflowUpdateFailedError as error:
            raise Rejected(workflow_id, name, str(error.cause)) from error
        except RPCError as error:
            raise _rpc(workflow_id, error, name) from None

    async def _taken(self, handle: WorkflowHandle, name: str,
                     send: Callable[[], Awaitable[WorkflowUpdateHandle[Any]]]) -> WorkflowUpdateHandle[Any]:
        """``send()``'s update once a worker has taken it, within ``UPDATE_TIMEOUT``; else
        :class:`UpdateNotTaken` naming the workflow's task queue (the configured one when even
        that cannot be read)."""
        bound = asyncio.timeout(UPDATE_TIMEOUT.total_seconds())
        try:
            async with bound:
                return await send()
        except (TimeoutError, WorkflowUpdateRPCTimeoutOrCancelledError, asyncio.CancelledError):
            if not bound.expired():
                raise  # the caller's own cancel (Ctrl-C), or the server's deadline: not this bound
        raise UpdateNotTaken(handle.id, name, await _task_queue(handle, self.settings.task_queue),
                             UPDATE_TIMEOUT.total_seconds())

    async def _answered(self, handle: WorkflowHandle, name: str, update: WorkflowUpdateHandle[Any],
                        look: str = "") -> Any:
        """The answer of ``update``, which a worker has taken, within ``update_answer_timeout``; else
        :class:`UpdateUnanswered` (the update goes on in the workflow). Not back within
        ``UPDATE_ANSWER_QUIET``, ``waiting`` is told what is waited for, and until when. A refusal or
        failure of the handler comes as the result's own error."""
        bound = self.update_answer_timeout
        until = datetime.now(timezone.utc) + bound
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound.total_seconds()
        answer = asyncio.ensure_future(update.result())
        try:
            done, _ = await asyncio.wait({answer}, timeout=min(UPDATE_ANSWER_QUIET, bound).total_seconds())
            if not done and deadline > loop.time():
                if self.waiting is not None:
                    self.waiting(f"`{handle.id}` accepted the update `{name}`; waiting for its answer until "
                                 f"{until:%H:%M:%S} UTC (Ctrl-C stops the waiting, not the update)")
                done, _ = await asyncio.wait({answer}, timeout=deadline - loop.time())
            if done:
                return answer.result()
        finally:
            if not answer.done():  # this bound, or the caller's own cancel (Ctrl-C)
                answer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await answer
        raise UpdateUnanswered(handle.id, name, update.id, bound.total_seconds(), look)


async def query_workflow(client: Client, workflow_id: str, name: str, result_type: type[M], *, task_queue: str) -> M:
    """The answer to ``workflow_id``'s query ``name`` within ``QUERY_TIMEOUT``; :class:`NotFound`
    when there is no such workflow, :class:`NoWorker` when no worker answered in time (naming the
    workflow's task queue, or ``task_queue``, the configured one, when even that cannot be read)."""
    handle = client.get_workflow_handle(workflow_id)
    try:
        return await handle.query(name, result_type=result_type, rpc_timeout=QUERY_TIMEOUT)
    except RPCError as error:
        if not _unanswered(error):
            raise _rpc(workflow_id, error) from None
    raise NoWorker(workflow_id, name, await _task_queue(handle, task_queue), QUERY_TIMEOUT.total_seconds())


async def _task_queue(handle: WorkflowHandle, configured: str) -> str:
    """The task queue ``handle``'s workflow runs on, where the worker that did not answer should
    poll; ``configured`` when even that cannot be read."""
    try:
        return (await handle.describe(rpc_timeout=DESCRIBE_TIMEOUT)).task_queue or configured
    except RPCError:
        return configured  # the configured queue is the control plane's: where its worker would poll


def _rollout_look(workflow_id: str) -> str:
    return f"gpufleet rollout status {workflow_id}"


def _unanswered(error: RPCError) -> bool:
    """A query no worker took in time, as the dev server (1.32) says it: this client's deadline
    passed (CANCELLED "Timeout expired"), the server's did (DEADLINE_EXCEEDED "query timed out
    before a worker could process it"), or the server has seen no worker poll the queue lately
    (FAILED_PRECONDITION "no poller seen for task queue recently, worker may be down")."""
    return error.status in (RPCStatusCode.CANCELLED, RPCStatusCode.DEADLINE_EXCEEDED) or (
        error.status == RPCStatusCode.FAILED_PRECONDITION and "no poller" in error.message)


def _rpc(workflow_id: str, error: RPCError, update: str | None = None) -> Exception:
    if error.status == RPCStatusCode.NOT_FOUND:
        return NotFound(workflow_id, error.message)
    if update is not None and error.status == RPCStatusCode.FAILED_PRECONDITION:
        return Rejected(workflow_id, update, error.message)
    return error
