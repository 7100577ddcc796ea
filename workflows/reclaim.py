"""SpotReclaim (id ``reclaim/<node>``): the provider takes a spot machine; drain and replace.

Started by the node agent (signal-with-start, signal ``notice``) when the
provider posts a reclaim notice. The runbook: cordon and evict within the
notice, honouring PodDisruptionBudgets (deadline = the notice) → at the same
time, AcquireCapacity for one replacement that avoids the reclaimed offer for a
while → when the drain is over (and the replacement joined or the notice ran
out) mark the node gone: Node object removed, machine deleted.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ChildWorkflowError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import workflows as flows
    from fleet.contracts import activities as act
    from fleet.messages.capacity import CapacityResult, SpotNotice, SpotReclaimInput, SpotReclaimResult
    from fleet.messages.nodes import ResolveSiteInput
    from fleet import search_attributes as sa
    from fleet.config import Site
    from fleet.naming import capacity_workflow_id
    from fleet.placement import offer_key, replacement_constraints
    from fleet.cluster import DrainResult
    from workflows.inputs import parse_input, parse_signal
    from workflows.steps import PROVIDER_RETRY, QUICK, drain_node, failure_message, retire_machine, show_details


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


@workflow.defn(name="SpotReclaim")
class SpotReclaim:
    def __init__(self) -> None:
        self._terminate_at: float | None = None
        self._step = "starting"

    @workflow.signal
    def notice(self, raw: dict[str, Any] | None = None) -> None:
        """The node agent saw the notice (again): a newer termination time wins."""
        notice = parse_signal(SpotNotice, raw, "notice") if raw is not None else None
        if notice is not None and notice.terminate_at:
            self._terminate_at = notice.terminate_at

    @workflow.query
    def step(self) -> str:
        return self._step

    def _show(self, step: str, detail: str = "") -> None:
        self._step = step
        show_details(step, detail=detail)

    @workflow.run
    async def run(self, raw: Any) -> SpotReclaimResult:
        args = parse_input(SpotReclaimInput, raw)
        node = args.node_name
        workflow.upsert_search_attributes([
            sa.NODE_NAME.value_set(node), sa.SITE.value_set(args.site), sa.FLEET_STATE.value_set("reclaiming"),
        ])
        site: Site = await workflow.execute_activity(
            act.resolve_site, ResolveSiteInput(site=args.site), start_to_close_timeout=QUICK,
            retry_policy=PROVIDER_RETRY, summary=f"look up site {args.site}",
        )
        terminate_at = datetime.fromtimestamp(self._terminate_at or args.terminate_at, timezone.utc)
        left = max((terminate_at - workflow.now()).total_seconds(), 0.0)
        self._show("draining", f"{node} within {left:.0f}s (PDBs honoured); acquiring a replacement")

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
        replace = asyncio.create_task(workflow.execute_child_workflow(
            flows.AcquireCapacity.TYPE, replacement_request, id=capacity_workflow_id(f"reclaim-{node}"),
            result_type=CapacityResult, static_summary=f"replacement for reclaimed {node}",
            # The reclaim ended (terminated, cancelled): its replacement request and joins stop too.
            parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
        ))

        drained: DrainResult = await drain
        blocked = [f"{p.key}: {p.reason}" for p in drained.blocked]
        self._show("drained" if drained.completed else "drain incomplete at the notice",
                   "; ".join(blocked) or f"{len(drained.evicted)} pods evicted")
        # The machine is gone at the notice anyway; wait for the replacement until then.
        left = max((terminate_at - workflow.now()).total_seconds(), 0.0)
        if not replace.done() and left > 0:
            await workflow.wait([replace], timeout=left)

        self._show("marking the node gone", node)
        try:
            await retire_machine(site.name, node, args.machine_id, summary=f"node {node} gone")
        except ActivityError as error:
            workflow.logger.warning("could not delete reclaimed machine %s: %s", args.machine_id,
                                    failure_message(error))
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("gone")])

        replacement: CapacityResult | None = None
        try:
            replacement = await replace
            self._show("done", f"replacement: {', '.join(n.node_name + ' at ' + n.site for n in replacement.nodes) or 'none'}")
        except ChildWorkflowError as error:
            self._show("done", f"replacement failed: {failure_message(error)}")
        return SpotReclaimResult(node_name=node, drained=drained.completed, blocked=blocked, replacement=replacement)
