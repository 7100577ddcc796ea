"""The Temporal Schedules for gpufleet's periodic work, applied idempotently
(``gpufleet schedules apply``; ``gpufleet dev`` applies them at start)."""

from __future__ import annotations

from datetime import timedelta

from fleet.contracts import workflows as flows
from fleet.naming import CATALOG_REFRESH_ID, CSR_APPROVER_ID, FLEET_SWEEP_ID, SITE_SWEEP_ID, advisor_workflow_id

SCHEDULES = {
    # A safety sweep: starts every Site entity that is not running (a running one wakes on its watch),
    # and every Node entity of a Ready node that is not running (terminated, failed: fleet.watched).
    "gpufleet-site-reconcile": (flows.SiteSweep.TYPE, SITE_SWEEP_ID,
                                "start every site and node entity that is not running"),
    "gpufleet-catalog-refresh": (flows.CatalogRefresh.TYPE, CATALOG_REFRESH_ID, "refresh provider offers, wake waiting requests"),
    "gpufleet-fleet-sweep": (flows.FleetSweep.TYPE, FLEET_SWEEP_ID, "delete orphaned machines (fleet-marked, past the grace)"),
    # Its runs are advisor/7d-<time>: the same series as `gpufleet advisor --since 7d`.
    "gpufleet-advisor": (flows.Advisor.TYPE, advisor_workflow_id("7d"), "advisor: last 7 days' cost vs the cheapest qualifying placement"),
    # gpufleet's approver, woken by new CSRs (a watch); each pass of this Schedule starts it again
    # if its run ended or was lost (overlap SKIP: nothing while it runs).
    "gpufleet-csr-approver": (flows.CsrApprover.TYPE, CSR_APPROVER_ID, "approve or deny kubelet CSRs of gpufleet's nodes "
                                                             "(woken by new CSRs)"),
}
#: Schedules whose first pass runs when they are created, not an interval later: the site
#: reconcile starts every Site entity, and until one runs a site has no incident detection and
#: its first GPU fault waits for the entity to start before its repair is admitted.
FIRST_PASS_AT_ONCE = ("gpufleet-site-reconcile",)
#: Seconds between the CSR approver Schedule's passes: a safety sweep. The approver's run watches
#: for new CSRs and answers each as it comes; this pass starts a run when none is running (the
#: last one ended or was lost), so a renewal waits at most this long (a kubelet asks at 70-90% of
#: its certificate's life and retries). A pass every half minute cost 240 actions an hour.
CSR_APPROVER_EVERY = 600.0


def build_schedule(schedule_id: str, task_queue: str, every: float):
    """The Schedule for one entry of ``SCHEDULES`` (overlap SKIP: a slow pass is not stacked)."""
    from temporalio.client import (
        Schedule,
        ScheduleActionStartWorkflow,
        ScheduleIntervalSpec,
        ScheduleOverlapPolicy,
        SchedulePolicy,
        ScheduleSpec,
    )

    workflow_type, workflow_id, what = SCHEDULES[schedule_id]
    return Schedule(
        action=ScheduleActionStartWorkflow(workflow_type, None, id=workflow_id, task_queue=task_queue,
                                           static_summary=what),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=timedelta(seconds=every))]),
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
    )


async def apply_schedules(client, task_queue: str, site_every: float, catalog_every: float,
                          sweep_every: float = 600, advisor_every: float = 86400,
                          csr_every: float = CSR_APPROVER_EVERY) -> list[tuple[str, str]]:
    """Create or update each schedule (overlap SKIP). Returns (id, "created"|"updated")."""
    from temporalio.client import ScheduleUpdate
    from temporalio.service import RPCError, RPCStatusCode

    every = {"gpufleet-site-reconcile": site_every, "gpufleet-catalog-refresh": catalog_every,
             "gpufleet-fleet-sweep": sweep_every, "gpufleet-advisor": advisor_every,
             "gpufleet-csr-approver": csr_every}
    done = []
    for schedule_id in SCHEDULES:
        schedule = build_schedule(schedule_id, task_queue, every[schedule_id])
        handle = client.get_schedule_handle(schedule_id)
        try:
            await handle.describe()
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            await client.create_schedule(schedule_id, schedule,
                                         trigger_immediately=schedule_id in FIRST_PASS_AT_ONCE)
            done.append((schedule_id, "created"))
            continue
        await handle.update(lambda _input, s=schedule: ScheduleUpdate(schedule=s))
        done.append((schedule_id, "updated"))
    return done
