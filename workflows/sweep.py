"""FleetSweep (id ``fleet-sweep``, run by a Schedule): the bound on any leaked machine.

The runbook: list what accounts for machines (the cluster's nodes, the running
joins) → for every site, list the account's machines there and delete the orphans:
fleet-marked, accounted for by nothing, older than the grace period
(``sweep.grace_seconds``, default 30 min); a node still unproven whose join no longer runs
(terminated after its node registered: a terminate runs no clean-up) accounts for nothing, and
goes with its machine, its Node and identity record removed. A machine without the fleet's marker is
never touched; a revoked account is skipped without a call (rule 6), and a
BadCredentials/OverQuota answer is reported to its ProviderAccount. What it found
is its current details and its result. Then the node identity records whose Node is
gone (past the same grace) are deleted, so a name that is no node of ours any more gets
no kubelet certificate from gpufleet's approver.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import activities as act
    from fleet.messages.sweep import (
        FleetSweepInput,
        FleetSweepResult,
        IdentitySweepReport,
        SiteSweepReport,
        SweepIdentitiesInput,
        SweepKnown,
        SweepSiteInput,
    )
    from workflows.inputs import parse_input
    from workflows.steps import (
        CLUSTER_RETRY,
        PROVIDER_RETRY,
        QUICK,
        STORE_RETRY,
        WAIT_HEARTBEAT,
        failure_text,
        show_details,
    )


@workflow.defn(name="FleetSweep")
class FleetSweep:
    @workflow.run
    async def run(self, raw: Any = None) -> FleetSweepResult:
        args = parse_input(FleetSweepInput, raw or {})
        first_seen = self._first_seen()
        show_details("listing nodes and running joins")
        known: SweepKnown = await workflow.execute_activity(
            act.sweep_known, start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary="what accounts for a machine: nodes, running joins",
        )
        sites: list[dict] = await workflow.execute_activity(
            act.fleet_sites, start_to_close_timeout=QUICK, retry_policy=STORE_RETRY,
            summary="every site of the config",
        )
        names = [s["name"] for s in sites]
        show_details("listing machines", f"{len(names)} sites; {len(known.node_names)} nodes, "
                                         f"{len(known.joining)} joins running"
                                         + (f"; {len(known.unidentified)} nodes without an identity record "
                                            f"account for no machine" if known.unidentified else ""))

        async def one(site: str) -> SiteSweepReport:
            try:
                return await workflow.execute_activity(
                    act.sweep_site,
                    SweepSiteInput(site=site, known=known, grace_seconds=args.grace_seconds, dry_run=args.dry_run,
                                   first_seen=first_seen.get(site, {})),
                    start_to_close_timeout=timedelta(minutes=5),
                    # Listing and deleting at a provider can take minutes: the activity heartbeats
                    # meanwhile, so a lost worker's site is retried within a minute, not after 5.
                    heartbeat_timeout=WAIT_HEARTBEAT,
                    retry_policy=PROVIDER_RETRY, summary=f"orphans at {site}",
                )
            except ActivityError as error:
                return SiteSweepReport(site=site, skipped=failure_text(error))

        reports = list(await asyncio.gather(*(one(site) for site in names)))
        identities = await workflow.execute_activity(
            act.sweep_identities,
            SweepIdentitiesInput(joining=known.joining, grace_seconds=args.grace_seconds, dry_run=args.dry_run,
                                 first_seen=self._identities_first_seen()),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary="identity records of gone nodes",
        )
        result = FleetSweepResult(
            sites=reports, deleted=sum(len(r.deleted) for r in reports), young=sum(len(r.young) for r in reports),
            skipped=sum(bool(r.skipped) for r in reports), dry_run=args.dry_run, identities=identities,
        )
        verb = "would delete" if args.dry_run else "deleted"
        lines = [self._line(r, verb) for r in reports]
        if identities is not None and (identities.deleted or identities.young):
            lines.append(f"- identity records of gone nodes: {verb} {len(identities.deleted)}"
                         + (f", young: {', '.join(identities.young)}" if identities.young else ""))
        show_details("done", *lines,
                     detail=f"{verb} {result.deleted} orphans, {result.young} young, {result.skipped} sites skipped")
        return result

    @staticmethod
    def _first_seen() -> dict[str, dict[str, float]]:
        """Per site, when the previous sweep (the Schedule's last run) first saw each undated machine."""
        if not workflow.has_last_completion_result():
            return {}
        try:
            last = workflow.get_last_completion_result(FleetSweepResult)
        except Exception:  # noqa: BLE001 - an older result shape: count ages from now
            return {}
        return {r.site: dict(r.first_seen) for r in last.sites} if isinstance(last, FleetSweepResult) else {}

    @staticmethod
    def _identities_first_seen() -> dict[str, float]:
        """When the previous sweep first saw each identity record without its Node."""
        if not workflow.has_last_completion_result():
            return {}
        try:
            last = workflow.get_last_completion_result(FleetSweepResult)
        except Exception:  # noqa: BLE001 - an older result shape: count from now
            return {}
        if not isinstance(last, FleetSweepResult) or last.identities is None:
            return {}
        return dict(last.identities.first_seen)

    @staticmethod
    def _line(r: SiteSweepReport, verb: str) -> str:
        if r.skipped:
            return f"- `{r.site}`: skipped ({r.skipped})"
        parts = [f"{r.listed} listed", f"{r.known} nodes", f"{r.joining} joining", f"{r.unmarked} not ours"]
        if r.young:
            parts.append(f"{len(r.young)} young: {', '.join(r.young)}")
        if r.deleted:
            parts.append(f"{verb}: {', '.join(r.deleted)}")
        if r.abandoned:
            removed = verb.replace("delete", "remove")
            parts.append(f"{removed} nodes left unproven by a join no longer running: {', '.join(r.abandoned)}")
        if r.failed:
            parts.append(f"failed: {'; '.join(r.failed)}")
        return f"- `{r.site}`: " + ", ".join(parts)
