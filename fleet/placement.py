"""Placement: which offer to buy next (product rule 7). Pure functions, no Temporal.

``rank`` joins the provider catalog (offers) with the fleet config (sites: account,
geography), filters by the caller's constraints, and orders what is left by
effective price (spot made dearer by its interruption risk), then the caller's
site preference, then latency. Every offer it does not return comes back in
``rejected`` with the reason, so a workflow can show why it did not pick it.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleet.config import Site
from fleet.models import AccountState, CapacityType, Offer

#: How much dearer a spot offer counts per unit of interruption risk: a spot offer
#: at risk r ranks as if it cost ``price * (1 + SPOT_RISK_WEIGHT * r)``.
SPOT_RISK_WEIGHT = 1.0


class Constraints(BaseModel):
    """What the caller will accept. Every field is optional; none set = anything."""

    model_config = ConfigDict(extra="forbid")

    #: One GPU type ("H100") ...
    gpu: str | None = None
    #: ... or a class of acceptable types (["H100", "H200"]).
    gpu_class: list[str] | None = None
    gpu_memory_gb_min: int = Field(0, ge=0)
    #: Exact GPUs per machine, when set.
    gpus_per_machine: int | None = Field(None, ge=1)
    #: Allowed sites (None = all).
    sites: list[str] | None = None
    #: Allowed geography tags (None = all), e.g. ["eu"].
    geographies: list[str] | None = None
    capacity_types: list[CapacityType] = Field(
        default_factory=lambda: [CapacityType.ON_DEMAND, CapacityType.SPOT, CapacityType.OWNED]
    )
    max_price_per_gpu_hour: float | None = Field(None, ge=0)
    #: $/hour for the whole request (every node it buys together).
    spend_cap_per_hour: float | None = Field(None, ge=0)
    #: Sites in order of preference: the tie-breaker after effective price.
    prefer_sites: list[str] = Field(default_factory=list)
    #: Measured latency per site (ms): the tie-breaker after preference.
    latency_ms: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_gpu_rule(self) -> "Constraints":
        if self.gpu and self.gpu_class:
            raise ValueError("give gpu or gpu_class, not both")
        if not self.capacity_types:
            raise ValueError("capacity_types: allow at least one capacity type")
        return self

    def gpu_types(self) -> set[str] | None:
        if self.gpu:
            return {self.gpu}
        return set(self.gpu_class) if self.gpu_class else None


def replacement_constraints(origin: Site) -> Constraints:
    """What an AcquireCapacity for a replacement of an ``origin`` machine may buy: the
    same GPU and GPUs per machine, inside ``origin``'s geography when it is a compliance
    site (SpotReclaim's replacement; the rule itself is ``fleet.replacement``)."""
    return Constraints(
        gpu=origin.gpu, gpus_per_machine=origin.gpus_per_machine,
        geographies=[origin.geography] if origin.compliance and origin.geography else None,
        sites=[origin.name] if origin.compliance and not origin.geography else None,
    )


def offer_key(site: str, instance_type: str) -> str:
    """How an offer is named in exclusions, account blocks and reasons."""
    return f"{site}/{instance_type}"


class AccountView(BaseModel):
    """What placement needs to know of a provider account."""

    state: AccountState = AccountState.HEALTHY
    #: Offer keys blocked by quota (the rest of the account may still sell).
    blocked_offers: list[str] = Field(default_factory=list)


class Candidate(BaseModel):
    key: str
    offer: Offer
    account: str
    geography: str | None = None
    effective_price: float
    #: $/hour for one machine of this offer.
    machine_cost_per_hour: float


class Rejection(BaseModel):
    key: str
    site: str
    reason: str


class Placement(BaseModel):
    candidates: list[Candidate] = Field(default_factory=list)
    rejected: list[Rejection] = Field(default_factory=list)

    def reasons(self) -> list[str]:
        return [f"{r.key}: {r.reason}" for r in self.rejected]


def effective_price(offer: Offer, risk_weight: float = SPOT_RISK_WEIGHT) -> float:
    if offer.capacity_type == CapacityType.SPOT:
        return offer.price_per_gpu_hour * (1 + risk_weight * offer.interruption_risk)
    return offer.price_per_gpu_hour


def _why_not(
    offer: Offer,
    site: Site | None,
    c: Constraints,
    account: AccountView | None,
    key: str,
    excluded: dict[str, str],
    budget_left: float | None,
) -> str | None:
    if site is None:
        return "offer names a site that is not in the fleet config"
    if account is not None and account.state == AccountState.CREDENTIALS_REVOKED:
        return f"account {site.account} credentials revoked (waiting for a person)"
    if account is not None and key in account.blocked_offers:
        return f"account {site.account} over quota for this offer (waiting for a person)"
    if key in excluded:
        return excluded[key]
    types = c.gpu_types()
    if types is not None and offer.gpu not in types:
        return f"GPU {offer.gpu} is not {' or '.join(sorted(types))}"
    memory = offer.gpu_memory_gb or site.gpu_memory_gb
    if memory < c.gpu_memory_gb_min:
        return f"{memory} GB GPU memory < {c.gpu_memory_gb_min} GB"
    if c.gpus_per_machine is not None and offer.gpus != c.gpus_per_machine:
        return f"{offer.gpus} GPUs per machine, want {c.gpus_per_machine}"
    if c.sites is not None and offer.site not in c.sites:
        return "site not allowed"
    if c.geographies is not None and site.geography not in c.geographies:
        return f"geography {site.geography or '(none)'} not in {', '.join(c.geographies)}"
    if offer.capacity_type not in c.capacity_types:
        return f"{offer.capacity_type.value} not allowed"
    if c.max_price_per_gpu_hour is not None and offer.price_per_gpu_hour > c.max_price_per_gpu_hour:
        return f"${offer.price_per_gpu_hour:.2f}/GPU-h > max ${c.max_price_per_gpu_hour:.2f}"
    cost = offer.price_per_gpu_hour * offer.gpus
    if c.spend_cap_per_hour is not None and cost > c.spend_cap_per_hour:
        return f"${cost:.2f}/h per machine > spend cap ${c.spend_cap_per_hour:.2f}/h"
    if budget_left is not None and cost > budget_left + 1e-9:
        return f"${cost:.2f}/h would exceed the spend cap (${budget_left:.2f}/h left)"
    if not offer.available:
        return "provider reports no capacity"
    return None


def rank(
    offers: list[Offer],
    sites: list[Site],
    constraints: Constraints,
    accounts: dict[str, AccountView] | None = None,
    excluded: dict[str, str] | None = None,
    budget_left: float | None = None,
    risk_weight: float = SPOT_RISK_WEIGHT,
) -> Placement:
    """Rank ``offers`` for ``constraints``.

    ``accounts``: account name → its state (missing = healthy). ``excluded``: offer
    key → why it may not be used now (remembered NoCapacity, a reclaimed offer).
    ``budget_left``: $/hour the request may still add (spend cap minus committed).
    """
    by_name = {s.name: s for s in sites}
    accounts = accounts or {}
    excluded = excluded or {}
    placement = Placement()
    seen: set[str] = set()
    for offer in offers:
        key = offer_key(offer.site, offer.instance_type)
        if key in seen:
            continue
        seen.add(key)
        site = by_name.get(offer.site)
        account = accounts.get(site.account) if site else None
        reason = _why_not(offer, site, constraints, account, key, excluded, budget_left)
        if reason:
            placement.rejected.append(Rejection(key=key, site=offer.site, reason=reason))
            continue
        placement.candidates.append(Candidate(
            key=key, offer=offer, account=site.account, geography=site.geography,
            effective_price=round(effective_price(offer, risk_weight), 6),
            machine_cost_per_hour=offer.price_per_gpu_hour * offer.gpus,
        ))
    prefer = {name: i for i, name in enumerate(constraints.prefer_sites)}
    placement.candidates.sort(key=lambda c: (
        c.effective_price,
        prefer.get(c.offer.site, len(prefer)),
        constraints.latency_ms.get(c.offer.site, 0.0),
        c.key,
    ))
    placement.rejected.sort(key=lambda r: r.key)
    return placement


def offers_from_config(sites: list[Site], available: bool = True) -> list[Offer]:
    """The offers the config says each site sells (a catalog before any refresh)."""
    return [
        Offer(site=s.name, provider=s.provider, instance_type=s.instance_type, gpu=s.gpu, gpus=s.gpus_per_machine,
              gpu_memory_gb=s.gpu_memory_gb, price_per_gpu_hour=s.price_per_gpu_hour, capacity_type=s.capacity_type,
              available=available, region=s.region)
        for s in sites
    ]


def expired(until: datetime, now: datetime) -> bool:
    return now >= until


def surplus_to_retire(nodes: list, n: int) -> list:
    """The ``n`` nodes to retire above a site's max: first those an earlier retirement of the
    site's left cordoned (``surplus_cordon``: a drain that blocked, already partly drained), then
    the most expensive, then the newest; never one someone holds (``held``: a repair fenced a GPU
    of it, a person marked it theirs), so fewer than ``n`` when too few are free. A held node is
    its holder's business: it counts, and is retired once free again (its repair's uncordon wakes
    the site), if the site is still above its max.

    ``nodes`` have ``price_per_gpu_hour``, ``registered_at`` (None sorts oldest), ``held`` and
    ``surplus_cordon``."""
    nodes = [node for node in nodes if not node.held]
    if n <= 0:
        return []
    epoch = datetime.min.replace(tzinfo=None)

    def when(node) -> datetime:
        at = node.registered_at
        return at.replace(tzinfo=None) if at is not None else epoch

    return sorted(nodes, key=lambda node: (node.surplus_cordon, node.price_per_gpu_hour, when(node), node.node_name),
                  reverse=True)[:n]
