"""The visibility query of the runs a deploy left behind, one spelling for the CLI
(``gpufleet patches``) and the client (``FleetClient.renew_entities``): both must count and ask
the same runs. Light on purpose: the CLI imports it at start."""

from __future__ import annotations

from datetime import datetime, timezone


def utc_stamp(moment: datetime) -> str:
    """RFC 3339 in UTC, the fraction kept when there is one (a query's bound must not move)."""
    utc = moment.astimezone(timezone.utc)
    return utc.strftime("%Y-%m-%dT%H:%M:%S") + (f".{utc.microsecond:06d}Z" if utc.microsecond else "Z")


def open_runs_query(workflow_type: str, task_queue: str, deployed_since: datetime) -> str:
    """The open runs of ``workflow_type`` on ``task_queue`` started before ``deployed_since``."""
    return (f'WorkflowType = "{workflow_type}" AND ExecutionStatus = "Running" AND TaskQueue = "{task_queue}" '
            f'AND StartTime < "{utc_stamp(deployed_since)}"')
