"""SpotReclaim (id ``reclaim/<node>``): the provider takes a spot machine; drain and replace.

Started by the node agent (signal-with-start, signal ``notice``) when the
provider posts a reclaim notice. The runbook: cordon and evict within the
notice, honouring PodDisruptionBudgets (deadline = the notice) → at the same
time, AcquireCapacity for one replacement that avoids the reclaimed offer for a
while → when the drain is over (and the replacement joined or the notice ran
out) mark the node gone: Node object removed, machine deleted.

The deadline is the newest notice's termination time (signal ``notice``): one that moves it
earlier cuts the drain and the wait for the replacement short then; one that moves it later gives
the pods still on the node and the replacement the extra time. Each wait names in the current
details what it waits for and until when (UTC).

The drain marks its cordon ``reclaim`` (``CORDONED_BY_RECLAIM``). Temporal's cancel (a person who
believes the notice was false: ``temporal workflow cancel``) stops the run and puts back what it
changed: the drain stopped, the replacement request stopped (its joins in flight delete their
machines; a node that joined stays), and the node uncordoned while it is still the reclaim's (a
repair's fence or a person's mark keeps it) unless the notice's time has come or the machine is
being retired, which then runs to its end; the run ends Canceled, ``FleetState`` ``cancelled``,
its details saying what was done.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ChildWorkflowError, FailureError, is_cancelled_exception
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import workflows as flows
    from fleet.contracts import activities as act
    from fleet.messages.capacity import (
        CapacityRequest, CapacityResult, SpotNotice, SpotReclaimInput, SpotReclaimResult,
    )
    from fleet.messages.nodes import ResolveSiteInput
    from fleet import search_attributes as sa
    from fleet.config import Site
    from fleet.naming import capacity_workflow_id
    from fleet.placement import offer_key, replacement_constraints
    from fleet.cluster import CORDONED_BY_RECLAIM, DrainResult
    from fleet.messages.capacity import ReleaseCordonsInput
    from workflows.inputs import parse_input, parse_signal
    from workflows.steps import (
        PROVIDER_RETRY, PUT_BACK_RETRY, PUT_BACK_UNTIL, QUICK, cancelled_by_request, cancelled_words, drain_node,
        failure_message, failure_text, retire_machine, show_details, to_its_end, to_its_end_taking_cancel,
        until_in,
    )
    from fleet.messages.join import TOKEN_CHECKS, JoinTimeouts
    from pydantic import ValidationError


#: The most time a notice is believed to give: providers give minutes (AWS two, GCP and Azure
#: thirty seconds); a later time is the node's word, and is cut to this after the run began.
MAX_NOTICE_SECONDS = 3600


def replacement_request_constraints(site: Site, asked: dict[str, Any] | None) -> dict[str, Any]:
    """The request's constraints over the replacement rule's (same GPU and GPUs per machine
    by default), except the compliance geography: the rule's ``geographies``/``sites``
    always apply, whatever the request asked for."""
    rule = replacement_constraints(site).model_dump(mode="json", exclude_defaults=True)
    merged = {**rule, **(asked or {})}
    for key in ("geographies", "sites"):
        if key in rule:
            merged[key] = rule[key]
    return merged


def replacement_join_timeouts(replacement: dict[str, Any]) -> JoinTimeouts:
    """The timeouts the replacement request gives its joins: its own ``join_timeouts``, or a join's
    defaults (a value the request would refuse shows the defaults: the request says why it refused)."""
    try:
        return JoinTimeouts.model_validate(replacement.get("join_timeouts") or {}, context={TOKEN_CHECKS: False})
    except ValidationError:
        return JoinTimeouts()


def buying_seconds(replacement: dict[str, Any]) -> float:
    """How long after its start the replacement request gives up buying: its own
    ``deadline_seconds``, or the request's default (a value the request would refuse shows the
    default: the request says why it refused)."""
    asked = replacement.get("deadline_seconds")
    if isinstance(asked, (int, float)) and not isinstance(asked, bool) and 0 < asked <= 30 * 86400:
        return float(asked)
    return CapacityRequest.model_fields["deadline_seconds"].default


@workflow.defn(name="SpotReclaim")
class SpotReclaim:
    def __init__(self) -> None:
        #: The newest notice's termination time (epoch seconds), earlier or later than the one
        #: before; the input's until a notice comes.
        self._terminate_at: float | None = None
        self._step = "starting"
        #: The drain in flight (the newest: a later notice drains again) and the replacement
        #: request, once started: what a cancel stops.
        self._drain: asyncio.Task[DrainResult] | None = None
        self._replace: asyncio.Task[CapacityResult] | None = None
        #: The machine's retirement began: a cancel lets it run to its end ...
        self._retiring = False
        #: ... and is taken then: the run ends as it asked once the machine is retired.
        self._cancel_taken = False

    @workflow.signal
    def notice(self, raw: dict[str, Any] | None = None) -> None:
        """The node agent saw the notice (again): a newer termination time wins."""
        notice = parse_signal(SpotNotice, raw, "notice") if raw is not None else None
        if notice is not None and notice.terminate_at:
            self._terminate_at = notice.terminate_at

    def _deadline(self) -> datetime:
        """When the provider takes the machine, as the newest notice says, and no later than
        ``MAX_NOTICE_SECONDS`` after the run began: the notice comes from the node, which may say
        2100 and so hold its own drain, and the wait for its replacement, open for good."""
        assert self._terminate_at is not None  # set from the input first thing in ``run``
        latest = workflow.info().start_time + timedelta(seconds=MAX_NOTICE_SECONDS)
        return min(datetime.fromtimestamp(self._terminate_at, timezone.utc), latest)

    def _left(self) -> float:
        return max((self._deadline() - workflow.now()).total_seconds(), 0.0)

    @workflow.query
    def step(self) -> str:
        return self._step

    def _show(self, step: str, detail: str = "") -> None:
        self._step = step
        show_details(step, detail=detail)

    @workflow.run
    async def run(self, raw: Any) -> SpotReclaimResult:
        args = parse_input(SpotReclaimInput, raw)
        workflow.upsert_search_attributes([
            sa.NODE_NAME.value_set(args.node_name), sa.SITE.value_set(args.site),
            sa.FLEET_STATE.value_set("reclaiming"),
        ])
        try:
            return await self._reclaim(args)
        # asyncio.CancelledError (a cancel in a wait) is a BaseException; GeneratorExit (Python closing
        # the run's coroutine after its worker stopped) is one too, and must pass untouched.
        except (Exception, asyncio.CancelledError) as error:
            if not cancelled_by_request(error):
                raise
            await self._put_back(args)
            raise  # the run ends Canceled: the SDK sees the cancel request and a cancel error

    async def _reclaim(self, args: SpotReclaimInput) -> SpotReclaimResult:
        node = args.node_name
        site: Site = await workflow.execute_activity(
            act.resolve_site, ResolveSiteInput(site=args.site), start_to_close_timeout=QUICK,
            retry_policy=PROVIDER_RETRY, summary=f"look up site {args.site}",
        )
        if self._terminate_at is None:  # no notice yet: the one the run was started with
            self._terminate_at = args.terminate_at
        terminate_at = self._deadline()
        left = self._left()
        self._show("draining", f"waiting for the drain of {node} (PDBs honoured) until {terminate_at:%H:%M:%S} UTC, "
                               "when the provider takes the machine; acquiring a replacement")

        drain = self._drain = asyncio.create_task(drain_node(
            node, left, summary=f"cordon and evict {node} before {terminate_at:%H:%M:%S}",
            cordoned_by=CORDONED_BY_RECLAIM, machine_goes=True))
        reclaimed = offer_key(site.name, site.instance_type)
        replacement_request = {
            "count": 1,
            **args.replacement,
            "constraints": replacement_request_constraints(site, args.replacement.get("constraints")),
            "exclude": [{"offer": reclaimed, "reason": f"spot offer reclaimed ({node})",
                         "seconds": args.exclude_seconds}],
            "reason": f"replace reclaimed {node}",
        }
        buys_until = workflow.now() + timedelta(seconds=buying_seconds(args.replacement))
        replace = self._replace = asyncio.create_task(workflow.execute_child_workflow(
            flows.AcquireCapacity.TYPE, replacement_request, id=capacity_workflow_id(f"reclaim-{node}"),
            result_type=CapacityResult, static_summary=f"replacement for reclaimed {node}",
            # The reclaim ended (terminated, cancelled): its replacement request and joins stop too.
            parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
        ))

        drained, cut_at = await self._drain_until_the_newest_notice(node, drain, terminate_at)
        blocked = [f"{p.key}: {p.reason}" for p in drained.blocked]
        if cut_at is not None:
            blocked.append(f"drain cut short at {cut_at:%H:%M:%S} UTC: a newer notice has the provider take "
                           "the machine then")
        step = "drained" if drained.completed else "drain incomplete at the notice"
        outcome = "; ".join(blocked) or f"{len(drained.evicted)} pods evicted"
        # The machine is gone at the notice anyway; wait for the replacement until then.
        await self._wait_for_replacement_until_the_newest_notice(replace, step, outcome)

        self._show("marking the node gone", node)
        await self._retire(site.name, node, args.machine_id)
        if self._cancel_taken:
            raise asyncio.CancelledError()  # cancelled while it retired: now what the cancel asked
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("gone")])

        replacement: CapacityResult | None = None
        if not replace.done():
            self._show("waiting for the replacement",
                       f"{capacity_workflow_id(f'reclaim-{node}')} buys until {buys_until:%H:%M:%S} UTC, "
                       "then ends with what joined")
        try:
            replacement = await self._replacement_to_its_end(replace)
            self._show("done", f"replacement: {', '.join(n.node_name + ' at ' + n.site for n in replacement.nodes) or 'none'}")
        except ChildWorkflowError as error:
            self._show("done", f"replacement failed: {failure_message(error)}")
        return SpotReclaimResult(node_name=node, drained=drained.completed, blocked=blocked, replacement=replacement)

    async def _retire(self, site: str, node: str, machine_id: str) -> None:
        """The machine deleted and the Node removed (a failure logged: the provider takes the machine
        anyway), to its end when Temporal's cancel lands meanwhile (``_cancel_taken``: the caller
        ends the run as it asked)."""
        self._retiring = True
        retiring = asyncio.ensure_future(retire_machine(site, node, machine_id, summary=f"node {node} gone"))
        try:
            await to_its_end_taking_cancel(self._take_cancel, retiring)
        except ActivityError as error:
            workflow.logger.warning("could not delete reclaimed machine %s: %s", machine_id, failure_message(error))

    def _take_cancel(self) -> None:
        """A cancel landed while the machine retires: kept in ``_cancel_taken``."""
        self._cancel_taken = True

    async def _replacement_to_its_end(self, replace: asyncio.Task[CapacityResult]) -> CapacityResult:
        """The replacement's result. Temporal's cancel meanwhile reaches the caller, to stop it
        (``_put_back``)."""
        return await asyncio.shield(replace)

    # -- a cancel ----------------------------------------------------------------------------
    async def _put_back(self, args: SpotReclaimInput) -> None:
        """What a cancelled reclaim puts back, each step to its end: the
        drain stopped; the replacement request stopped (its joins in flight delete their machines, a
        node that joined stays: its site's, like any other); the node uncordoned while its cordon is
        still the reclaim's, or, once the notice's time has come (the provider takes the machine) or
        its retirement began, retired. ``FleetState`` ``cancelled`` (``needs-person`` when the node
        could not be uncordoned), the details saying what was done."""
        node, where = args.node_name, self._step
        if self._drain is None:  # cancelled as it read the site: nothing changed yet
            self._end(f"{cancelled_words()} while {where}, before it changed anything")
            return
        if not self._drain.done():
            self._drain.cancel()  # stop evicting
            try:
                await self._drain
            except (asyncio.CancelledError, ActivityError):
                pass
        await self._stop_replacement(args)
        said, state = await self._put_node_back(args)
        said.append(await self._replacement_end(args))
        self._end(f"{cancelled_words()} while {where}: " + "; ".join(part for part in said if part), state)

    def _end(self, detail: str, state: str = "cancelled") -> None:
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(state)])
        self._show("cancelled", detail)

    async def _put_node_back(self, args: SpotReclaimInput) -> tuple[list[str], str]:
        """The node uncordoned (the machine stays) or retired; what was done, and the run's state."""
        node = args.node_name
        if self._retiring:
            return [f"{node} retired (the notice's time had come; its retirement had begun)"], "cancelled"
        if self._left() <= 0:
            self._show("marking the node gone", f"{node}: cancelled, but the notice's time has come")
            await self._retire(args.site, node, args.machine_id)
            return [f"{node} retired: the notice's time had come, the provider takes the machine"], "cancelled"
        self._show("uncordoning", f"{node}: cancelled before the notice's time, the machine stays: its uncordon "
                                  f"{PUT_BACK_UNTIL}")
        try:
            released: list[str] = await to_its_end(workflow.start_activity(
                act.release_cordons, ReleaseCordonsInput(nodes=[node], cordoned_by=CORDONED_BY_RECLAIM),
                # Retried until done: nothing else ever uncordons it. Refused for good: a person does.
                start_to_close_timeout=QUICK, retry_policy=PUT_BACK_RETRY,
                summary=f"uncordon {node}: the reclaim was cancelled",
            ))
        except ActivityError as error:
            return [f"{node} not uncordoned ({failure_text(error)}): a person uncordons it "
                    f"(`kubectl uncordon {node}`)"], "needs-person"
        if released:
            return [f"{node} uncordoned, the machine kept (the pods the drain moved stay where they went)"], "cancelled"
        return [f"{node} left cordoned: its cordon is not the reclaim's (a repair's, a person's, or one "
                "from before the drain)"], "cancelled"

    async def _stop_replacement(self, args: SpotReclaimInput) -> None:
        """Tell the replacement request to stop (its joins in flight delete their machines); its result,
        with any node that joined, still comes back. One that cannot be told (not started yet) is
        cancelled."""
        replace = self._replace
        if replace is None or replace.done():
            return
        child = capacity_workflow_id(f"reclaim-{args.node_name}")
        try:
            await workflow.get_external_workflow_handle(child).signal(
                flows.AcquireCapacity.stop, f"the reclaim of {args.node_name} was cancelled")
        except FailureError as error:
            workflow.logger.info("replacement %s not stopped: %s", child, failure_message(error))
            if not replace.done():
                replace.cancel()

    async def _replacement_end(self, args: SpotReclaimInput) -> str:
        """Waits for the replacement request's end; what it did, as the details say it."""
        replace = self._replace
        if replace is None:
            return ""
        if not replace.done():
            # Stopped, it cancels its joins in flight: each deletes its machine, a create under way
            # once it answers (its one try's bound), a node being admitted kept.
            provision = replacement_join_timeouts(args.replacement).provision_seconds
            self._show("stopping the replacement",
                       f"{args.node_name}: cancelled; waiting for {capacity_workflow_id(f'reclaim-{args.node_name}')} "
                       f"to end: told to stop, its joins in flight delete their machines (a create under way "
                       f"is awaited first: its try ends {until_in(provision)} at the latest)")
        try:
            result = await to_its_end(replace)
        except (ChildWorkflowError, asyncio.CancelledError) as error:
            if is_cancelled_exception(error):
                return "the replacement request cancelled: its joins in flight deleted their machines"
            return f"the replacement request failed: {failure_text(error)}"
        joined = ", ".join(f"{n.node_name} at {n.site}" for n in result.nodes)
        if not result.cancelled:
            return (f"the replacement had joined already and stays: {joined}" if joined
                    else "the replacement request had ended, nothing joined")
        return ("the replacement request stopped, its joins in flight deleted their machines"
                + (f"; joined before and stays: {joined}" if joined else ""))

    async def _drain_until_the_newest_notice(
            self, node: str, drain: asyncio.Task[DrainResult], given: datetime,
    ) -> tuple[DrainResult, datetime | None]:
        """The drain's result, and when it was cut short (None: it was not).

        ``given`` is the deadline the drain activity was started with. A newer notice that moves
        the deadline earlier cancels the drain when that time comes (the machine is gone then);
        one that moves it later lets the drain end at its own deadline and then drains again for
        the time the notice added, so the pods it left (PDBs) may still move."""
        while True:
            seen, until = self._terminate_at, self._deadline()
            self._show("draining", f"waiting for the drain of {node} (PDBs honoured) until {until:%H:%M:%S} UTC, "
                                   "when the provider takes the machine; acquiring a replacement")
            moved = lambda: drain.done() or self._terminate_at != seen  # noqa: E731 - one condition, twice
            if until >= given:  # the drain ends by itself by then
                await workflow.wait_condition(moved)
            else:
                try:
                    await workflow.wait_condition(moved, timeout=timedelta(seconds=max(self._left(), 0.001)),
                                                  timeout_summary=f"the machine goes at {until:%H:%M:%S} UTC")
                except asyncio.TimeoutError:
                    pass
                if not moved():  # the machine's time came first: stop evicting, it is gone
                    drain.cancel()
                    try:
                        await drain
                    except (asyncio.CancelledError, ActivityError):
                        pass
                    return DrainResult(node=node, completed=False), until
            if not drain.done():
                continue  # a newer notice: wait against its time
            drained = await drain
            until = self._deadline()
            if drained.completed or until <= given or self._left() <= 0:
                return drained, None
            # A later notice came while the drain ran: the pods it left get the time it added.
            given = until
            drain = self._drain = asyncio.create_task(drain_node(
                node, self._left(), summary=f"evict what is left on {node} before {until:%H:%M:%S} UTC (a later notice)",
                cordoned_by=CORDONED_BY_RECLAIM, machine_goes=True))

    async def _wait_for_replacement_until_the_newest_notice(
            self, replace: asyncio.Task[CapacityResult], step: str, outcome: str) -> None:
        """Until the replacement has joined, or the newest notice's time (the machine is gone)."""
        while not replace.done() and self._left() > 0:
            seen, until = self._terminate_at, self._deadline()
            self._show(step, f"{outcome}; waiting for the replacement until {until:%H:%M:%S} UTC, "
                             "when the provider takes the machine")
            try:
                await workflow.wait_condition(lambda: replace.done() or self._terminate_at != seen,
                                              timeout=timedelta(seconds=self._left()),
                                              timeout_summary=f"the replacement, until {until:%H:%M:%S} UTC")
            except asyncio.TimeoutError:
                return
        if replace.done() or self._left() <= 0:
            self._show(step, outcome)
