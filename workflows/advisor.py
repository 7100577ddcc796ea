"""Advisor (id ``advisor/<since>``; a Schedule's runs ``advisor/<since>-<time>``): what each
workload's GPU-hours would have cost on the cheapest qualifying placement. Read-only.

The runbook: read the usage ledger and the workloads served now (``read_usage``) and
the provider catalog (``get_catalog``: offers and account states; a fresh-enough
stored catalog is used as is, otherwise providers are *listed*) → constraints for a
model no workload serves are refused (``InvalidInput`` naming ``constraints.<model>``)
→ the counterfactual
(fleet.advisor, pure) → the report is the result and the current details. Nothing
here buys, deletes, labels or scales: no activity it runs calls a provider's or the
cluster's write API.
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import activities as act
    from fleet.advisor import HOUR, advise, period_hours, unserved_constraints
    from fleet.messages.advisor import AdvisorInput, AdvisorReport, Usage
    from fleet.messages.capacity import Catalog, GetCatalogInput
    from workflows.inputs import parse_input, refusal
    from workflows.steps import PROVIDER_RETRY, QUICK, STORE_RETRY, show_details

#: A catalog listed within the hour is recent enough to price a week of history.
CATALOG_MAX_AGE = 3600.0
#: Workload lines in the current details; the result holds them all.
DETAIL_LINES = 40


@workflow.defn(name="Advisor")
class Advisor:
    def __init__(self) -> None:
        self._step = "starting"

    @workflow.query
    def step(self) -> str:
        return self._step

    @workflow.run
    async def run(self, raw: Any = None) -> AdvisorReport:
        args = parse_input(AdvisorInput, raw or {})
        end = args.until if args.until is not None else workflow.now().timestamp()
        start = end - period_hours(args.since) * HOUR
        self._step = "reading"
        show_details("reading", detail="the usage ledger, the workloads served, the provider catalog")
        usage, catalog = await asyncio.gather(
            workflow.execute_activity(act.read_usage, start_to_close_timeout=QUICK,
                                      retry_policy=STORE_RETRY, summary="usage ledger and workloads (read)"),
            workflow.execute_activity(act.get_catalog, GetCatalogInput(max_age_seconds=CATALOG_MAX_AGE),
                                      start_to_close_timeout=QUICK,
                                      retry_policy=PROVIDER_RETRY, summary="provider catalog (list offers)"),
        )
        unserved = unserved_constraints(args.constraints, usage.workloads)
        if unserved:
            self._step = "refused"
            refused = refusal("AdvisorInput", unserved)
            show_details("refused", detail=refused.message)
            raise refused
        report = advise(usage, catalog.offers, catalog.sites, start=start, end=end, since=args.since,
                        constraints=args.constraints, accounts=catalog.accounts,
                        reclaim_cost_hours=args.reclaim_cost_hours, catalog_errors=catalog.errors)
        self._step = "done"
        lines = report.markdown.splitlines()[1:]
        if len(report.workloads) > DETAIL_LINES:
            lines = lines[:3 + DETAIL_LINES] + [f"... and {len(report.workloads) - DETAIL_LINES} more in the result"]
        show_details("done", *lines, detail=f"last {args.since}: now ${report.now:,.2f}, "
                                            f"advised ${report.advised:,.2f}, saving ${report.saving:,.2f}")
        return report
