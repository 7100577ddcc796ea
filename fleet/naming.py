"""Every workflow id and task queue, formatted in one place, and the names derived from them
(safe to call in workflows: pure and deterministic). Workflow types, signals, updates and
queries: ``fleet/contracts/workflows.py``."""

from __future__ import annotations

import hashlib

#: The control-plane worker's task queue.
CONTROL_PLANE_QUEUE = "gpufleet"

#: The one demand loop of a fleet.
DEMAND_WORKFLOW_ID = "demand"


#: The Schedules' workflows (``fleet/schedules.py``): one id each.
SITE_SWEEP_ID = "site-sweep"
CATALOG_REFRESH_ID = "catalog-refresh"
FLEET_SWEEP_ID = "fleet-sweep"
CSR_APPROVER_ID = "csr-approver"


def node_queue(node_name: str) -> str:
    """The task queue a node's agent polls."""
    return f"node/{node_name}"


def node_name_for(site: str, join_id: str, nonce: str = "") -> str:
    """A node name that a retried or replayed join always computes the same. ``nonce``: the
    join's per-start nonce (its first run id): a later join started with the same id gets a
    new name, so an earlier machine's certificate for the old name never becomes a live
    node's again. Without one (joins started before the nonce), the name of the id alone."""
    seed = f"{join_id}#{nonce}" if nonce else join_id
    return f"{site}-{hashlib.sha256(seed.encode()).hexdigest()[:8]}"


def node_workflow_id(node_name: str) -> str:
    """The node's ``Node`` entity (the same string as its queue: one per node)."""
    return f"node/{node_name}"


def join_workflow_id(site: str, request: str) -> str:
    return f"join/{site}/{request}"


def account_workflow_id(provider: str, account: str) -> str:
    return f"account/{provider}/{account}"


def site_workflow_id(site: str) -> str:
    return f"site/{site}"


def capacity_workflow_id(request: str) -> str:
    return f"capacity/{request}"


def purchase_workflow_id(seq: int, series: str = "") -> str:
    """The AcquireCapacity a demand purchase runs as (``capacity/<request>``): the loop's ``seq``-th
    in its ``series`` (a loop started before series: none, ``capacity/demand-<seq>``)."""
    return capacity_workflow_id(f"demand-{series}-{seq}" if series else f"demand-{seq}")


def reclaim_workflow_id(node_name: str) -> str:
    return f"reclaim/{node_name}"


def repair_workflow_id(node_name: str, gpu: int) -> str:
    return f"repair/{node_name}/gpu{gpu}"


def evacuation_workflow_id(site: str, n: int) -> str:
    """The Site entity's n-th incident."""
    return f"evacuate/{site}/{n}"


def manual_evacuation_id(site: str, request_id: str) -> str:
    """A SiteEvacuation started by a person: its own series beside the Site entity's
    ``evacuate/<site>/<n>``, so the entity's next incident never collides with it."""
    return f"evacuate/{site}/manual-{request_id}"


def advisor_workflow_id(since: str) -> str:
    """The Advisor for a period (a Schedule's runs: ``advisor/<since>-<time>``)."""
    return f"advisor/{since}"


def routing_workflow_id(model: str) -> str:
    """The model's ``Routing`` entity: the one writer of its routes."""
    return f"routing/{model}"


def rollout_id(model: str, version: str) -> str:
    return f"rollout/{model}/{version}"
