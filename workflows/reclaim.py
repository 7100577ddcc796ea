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
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ChildWorkflowError
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
    from fleet.cluster import DrainResult
    from workflows.inputs import parse_input, parse_signal
    from workflows.steps import PROVIDER_RETRY, QUICK, drain_node, failure_message, retire_machine, show_details


#: Workflow patch: the newest notice's termination time is the deadline the run acts against. One
#: that moves it earlier cuts the drain short then (the drain activity is cancelled) and the wait
#: for the replacement too; one that moves it later drains again for the time it adds (pods the
#: drain left) and waits that much longer for the replacement. Before, the run kept the time it
#: read at its start: a newer notice was stored and never used, so the run went on draining and
#: waiting past a machine already taken. Asked first thing in ``run``, before any command: both
#: waits take their new form from the start (they wake on a notice, a command the old run lacks).
NOTICE_MOVES_DEADLINE_PATCH = "reclaim-newest-notice-deadline"


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
        newest_notice_wins = workflow.patched(NOTICE_MOVES_DEADLINE_PATCH)
        node = args.node_name
        workflow.upsert_search_attributes([
            sa.NODE_NAME.value_set(node), sa.SITE.value_set(args.site), sa.FLEET_STATE.value_set("reclaiming"),
        ])
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

        drain = asyncio.create_task(
            drain_node(node, left, summary=f"cordon and evict {node} before {terminate_at:%H:%M:%S}"))
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
        replace = asyncio.create_task(workflow.execute_child_workflow(
            flows.AcquireCapacity.TYPE, replacement_request, id=capacity_workflow_id(f"reclaim-{node}"),
            result_type=CapacityResult, static_summary=f"replacement for reclaimed {node}",
            # The reclaim ended (terminated, cancelled): its replacement request and joins stop too.
            parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
        ))

        if newest_notice_wins:
            drained, cut_at = await self._drain_until_the_newest_notice(node, drain, terminate_at)
        else:
            drained, cut_at = await drain, None
        blocked = [f"{p.key}: {p.reason}" for p in drained.blocked]
        if cut_at is not None:
            blocked.append(f"drain cut short at {cut_at:%H:%M:%S} UTC: a newer notice has the provider take "
                           "the machine then")
        step = "drained" if drained.completed else "drain incomplete at the notice"
        outcome = "; ".join(blocked) or f"{len(drained.evicted)} pods evicted"
        # The machine is gone at the notice anyway; wait for the replacement until then.
        if newest_notice_wins:
            await self._wait_for_replacement_until_the_newest_notice(replace, step, outcome)
        else:
            left = max((terminate_at - workflow.now()).total_seconds(), 0.0)
            if not replace.done() and left > 0:
                self._show(step, f"{outcome}; waiting for the replacement until {terminate_at:%H:%M:%S} UTC, "
                                 "when the provider takes the machine")
                await workflow.wait([replace], timeout=left)
            else:
                self._show(step, outcome)

        self._show("marking the node gone", node)
        try:
            await retire_machine(site.name, node, args.machine_id, summary=f"node {node} gone")
        except ActivityError as error:
            workflow.logger.warning("could not delete reclaimed machine %s: %s", args.machine_id,
                                    failure_message(error))
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("gone")])

        replacement: CapacityResult | None = None
        if not replace.done():
            self._show("waiting for the replacement",
                       f"{capacity_workflow_id(f'reclaim-{node}')} buys until {buys_until:%H:%M:%S} UTC, "
                       "then ends with what joined")
        try:
            replacement = await replace
            self._show("done", f"replacement: {', '.join(n.node_name + ' at ' + n.site for n in replacement.nodes) or 'none'}")
        except ChildWorkflowError as error:
            self._show("done", f"replacement failed: {failure_message(error)}")
        return SpotReclaimResult(node_name=node, drained=drained.completed, blocked=blocked, replacement=replacement)

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
            drain = asyncio.create_task(drain_node(
                node, self._left(), summary=f"evict what is left on {node} before {until:%H:%M:%S} UTC (a later notice)"))

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
