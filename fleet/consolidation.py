"""Consolidation (product rule 13), pure: which idle fleet nodes go back, most expensive
first, within each site's minimum and retirement fraction and the warm headroom models
keep. No Temporal, no I/O; the demand loop (workflows/demand.py) calls it in the workflow.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, Field


class IdleNode(BaseModel):
    """A fleet GPU node with no GPU pod on it."""

    name: str
    site: str
    machine_id: str = ""
    price_per_gpu_hour: float = 0.0
    gpus: int = 0
    #: Epoch seconds since it was first seen empty.
    idle_since: float = 0.0
    #: A Pending pod is bound or nominated to it.
    awaited: bool = False


class Retire(BaseModel):
    node: str
    site: str
    machine_id: str = ""
    reason: str


class ConsolidationSettings(BaseModel):
    idle_ttl_seconds: float = Field(600, ge=0, le=7 * 86400, allow_inf_nan=False)
    #: At most this share of a site's nodes retiring at once (at least one node).
    max_site_fraction: float = Field(0.25, gt=0, le=1, allow_inf_nan=False)


def consolidate(
    idle: list[IdleNode],
    site_nodes: dict[str, int],
    site_min: dict[str, int],
    retiring: dict[str, int],
    now: float,
    settings: ConsolidationSettings,
    keep_warm: dict[str, int] | None = None,
    cordoned: set[str] | None = None,
) -> tuple[list[Retire], dict[str, str]]:
    """Which idle nodes go back now, most expensive first: idle past the TTL, never a node
    a Pending pod waits for, never one someone else cordoned (``cordoned``), never below a
    site's ``min_nodes``, never more than ``max_site_fraction`` of a site (counting retirements
    already running), and never the GPUs a model's warm headroom keeps at a site
    (``keep_warm``: site → GPUs).
    Returns the retirements and, for each idle node kept, why."""
    cordoned = cordoned or set()
    keep_warm = dict(keep_warm or {})
    # The cheapest idle nodes of a site are the ones kept warm (a cordoned one takes no pod).
    warm: set[str] = set()
    for node in sorted(idle, key=lambda n: (n.price_per_gpu_hour, n.name)):
        if keep_warm.get(node.site, 0) > 0 and not node.awaited and node.name not in cordoned:
            keep_warm[node.site] -= node.gpus
            warm.add(node.name)
    chosen: list[Retire] = []
    kept: dict[str, str] = {}
    going = dict(retiring)
    for node in sorted(idle, key=lambda n: (-n.price_per_gpu_hour * max(n.gpus, 1), -n.price_per_gpu_hour, n.name)):
        total = site_nodes.get(node.site, 0)
        idle_for = now - node.idle_since
        if node.name in cordoned:
            # Idle because someone emptied it on purpose: a repair containing a GPU (or holding it
            # for a person), an evacuation, an operator. Retiring it would take the machine from
            # under them (a repair whose node vanished climbs to replace it, buying another).
            kept[node.name] = "cordoned by a repair, an evacuation or a person: not the loop's to retire"
        elif node.awaited:
            kept[node.name] = "a Pending pod is bound or nominated to it"
        elif idle_for < settings.idle_ttl_seconds:
            kept[node.name] = f"idle {idle_for:.0f}s of {settings.idle_ttl_seconds:.0f}s"
        elif total - going.get(node.site, 0) <= site_min.get(node.site, 0):
            kept[node.name] = f"{node.site} at its minimum ({site_min.get(node.site, 0)} nodes)"
        elif going.get(node.site, 0) >= max(1, math.floor(settings.max_site_fraction * total)):
            kept[node.name] = f"{node.site}: {going.get(node.site, 0)} of {total} nodes already retiring"
        elif node.name in warm:
            kept[node.name] = "warm headroom for a model at this site"
        else:
            going[node.site] = going.get(node.site, 0) + 1
            chosen.append(Retire(node=node.name, site=node.site, machine_id=node.machine_id,
                                 reason=f"idle {idle_for:.0f}s (TTL {settings.idle_ttl_seconds:.0f}s), "
                                        f"${node.price_per_gpu_hour:.2f}/GPU-h"))
    return chosen, kept
