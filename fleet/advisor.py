"""The advisor's counterfactual: what each workload's GPU-hours would have cost on the
cheapest qualifying placement. Pure functions (no Temporal, no I/O): the Advisor
workflow calls them with what its read-only activities fetched.

Prices, one rule on both sides of the comparison: a GPU-hour costs its price; on
spot it costs ``price * (1 + interruption risk)`` (placement's ``effective_price``),
plus each reclaim at ``reclaim_cost_hours`` machine-hours of the reclaimed offer.
"Now" counts the reclaims the ledger measured on the workload's own machines; a
candidate offer counts the reclaims measured on that offer over the period (per
machine-hour), scaled to the machine-hours the workload would have bought there.

A workload is a model's Deployment at a site; the site's machine GPU-hours (idle
ones too: they were bought for it) are split between the workloads served there
by the GPUs each asks for. Machines at a site that serves nothing show as the
workload ``(none)``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from fleet.config import Site
from fleet.messages.advisor import AdvisorReport, LedgerEntry, SiteRate, Usage, Workload, WorkloadAdvice
from fleet.models import CapacityType, Offer, listing
from fleet.placement import AccountView, Constraints, effective_price, offer_key, rank, replacement_constraints

HOUR = 3600.0
_UNITS = {"h": 1.0, "d": 24.0, "w": 168.0}
#: The workload name of machines at a site that serves no model.
NO_WORKLOAD = "(none)"


def unserved_constraints(constraints: dict[str, Constraints], workloads: list[Workload]) -> list[tuple[str, str]]:
    """``(field, problem)`` for each model ``constraints`` names that no workload serves: its
    constraints apply to nothing (a mistyped key was dropped, and the report priced the model
    with its site's defaults while its reader believed the constraint applied)."""
    served = {w.model for w in workloads}
    return [(f"constraints.{model}", f"no workload serves a model {model!r}, so its constraints would apply "
             f"to nothing (served: {listing(served)})")
            for model in sorted(constraints) if model not in served]


def period_hours(since: str) -> float:
    """``7d`` -> 168.0 (the AdvisorInput pattern: digits then h, d or w)."""
    match = re.fullmatch(r"([1-9][0-9]*)([hdw])", since)
    if not match:
        raise ValueError(f"since: {since!r} is not like 36h, 7d or 2w")
    return int(match.group(1)) * _UNITS[match.group(2)]


def workload_constraints(site: Site, asked: Constraints | None) -> Constraints:
    """The workload's own constraints over its site's (same GPU product, at least its
    memory), except compliance: a compliance site's geography (fleet.replacement) always
    applies, whatever was asked. Machine size is free: GPU-hours are what is compared."""
    rule = replacement_constraints(site).model_dump(mode="json", exclude_defaults=True)
    rule.pop("gpus_per_machine", None)
    rule["gpu_memory_gb_min"] = site.gpu_memory_gb
    mine = asked.model_dump(mode="json", exclude_unset=True) if asked is not None else {}
    if "gpu_class" in mine:
        rule.pop("gpu", None)
    merged = {**rule, **mine}
    for key in ("geographies", "sites"):
        if key in rule:
            merged[key] = rule[key]
    return Constraints.model_validate(merged)


def _overlap_hours(entry: LedgerEntry, start: float, end: float) -> float:
    if entry.joined_at is None:
        return 0.0
    until = entry.retired_at if entry.retired_at is not None else end
    return max(0.0, min(until, end) - max(entry.joined_at, start)) / HOUR


def _reclaimed_within(entry: LedgerEntry, start: float, end: float) -> bool:
    return entry.reclaimed and entry.retired_at is not None and start <= entry.retired_at <= end


def _spot_rate(price: float, capacity_type: CapacityType, risk: float) -> float:
    """$ per GPU-hour net of interruption risk (the placement rule, on a ledger entry too)."""
    return effective_price(Offer(site="", provider="", instance_type="", gpu="", gpus=1, price_per_gpu_hour=price,
                                 capacity_type=capacity_type, interruption_risk=risk))


@dataclass
class _SiteUsage:
    gpu_hours: float = 0.0
    cost: float = 0.0
    reclaims: int = 0
    offers: set[str] = field(default_factory=set)


def _site_usage(entries: list[LedgerEntry], start: float, end: float, reclaim_cost_hours: float,
                risks: dict[str, float]) -> dict[str, _SiteUsage]:
    """Per site: GPU-hours, net cost and reclaims. A spot machine's risk is the catalog's
    figure for its offer when listed (the one its alternatives are priced with), else the
    figure recorded when it joined."""
    usage: dict[str, _SiteUsage] = defaultdict(_SiteUsage)
    for e in entries:
        hours = _overlap_hours(e, start, end)
        reclaimed = _reclaimed_within(e, start, end)
        if hours <= 0 and not reclaimed:
            continue
        u = usage[e.site]
        u.gpu_hours += e.gpus * hours
        risk = risks.get(offer_key(e.site, e.offer), e.interruption_risk)
        u.cost += e.gpus * hours * _spot_rate(e.price_per_gpu_hour, e.capacity_type, risk)
        if reclaimed:
            u.reclaims += 1
            u.cost += reclaim_cost_hours * e.gpus * e.price_per_gpu_hour
        u.offers.add(offer_key(e.site, e.offer))
    return usage


def _reclaim_rates(entries: list[LedgerEntry], start: float, end: float) -> dict[str, float]:
    """Offer key -> reclaims per machine-hour measured over the period."""
    hours: dict[str, float] = defaultdict(float)
    reclaims: dict[str, int] = defaultdict(int)
    for e in entries:
        key = offer_key(e.site, e.offer)
        hours[key] += _overlap_hours(e, start, end)
        reclaims[key] += _reclaimed_within(e, start, end)
    return {key: reclaims[key] / hours[key] for key in hours if hours[key] > 0 and reclaims[key]}


def offer_cost(offer: Offer, gpu_hours: float, reclaim_rate: float, reclaim_cost_hours: float) -> float:
    """What ``gpu_hours`` would cost on ``offer``: net of risk, plus the reclaims expected
    at the measured rate over the machine-hours it would take."""
    cost = gpu_hours * effective_price(offer)
    if offer.capacity_type == CapacityType.SPOT and reclaim_rate and offer.gpus:
        machine_hours = gpu_hours / offer.gpus
        cost += reclaim_rate * machine_hours * reclaim_cost_hours * offer.gpus * offer.price_per_gpu_hour
    return cost


def _shares(workloads: list[Workload]) -> list[tuple[Workload, float]]:
    asks = [max(w.replicas, 0) * max(w.gpus_per_replica, 0) for w in workloads]
    total = sum(asks)
    if total == 0:
        return [(w, 1 / len(workloads)) for w in workloads]
    return [(w, ask / total) for w, ask in zip(workloads, asks)]


def advise(
    usage: Usage,
    offers: list[Offer],
    sites: list[Site],
    *,
    start: float,
    end: float,
    since: str = "",
    constraints: dict[str, Constraints] | None = None,
    accounts: dict[str, AccountView] | None = None,
    reclaim_cost_hours: float = 1.0,
    catalog_errors: dict[str, str] | None = None,
) -> AdvisorReport:
    """The report: per workload and in total, now, advised and the saving."""
    constraints = constraints or {}
    by_site = {s.name: s for s in sites}
    risks = {offer_key(o.site, o.instance_type): o.interruption_risk for o in offers}
    used = _site_usage(usage.entries, start, end, reclaim_cost_hours, risks)
    rates = _reclaim_rates(usage.entries, start, end)
    served: dict[str, list[Workload]] = defaultdict(list)
    for w in usage.workloads:
        served[w.site].append(w)
    hours = max(end - start, 0.0) / HOUR
    report = AdvisorReport(since=since, start=start, end=end, hours=round(hours, 6),
                           catalog_errors=dict(catalog_errors or {}))
    now_at: dict[str, float] = defaultdict(float)
    advised_at: dict[str, float] = defaultdict(float)
    for site_name in sorted(used):
        u = used[site_name]
        if u.gpu_hours <= 0 and u.cost <= 0:
            continue
        here = sorted(served.get(site_name, []), key=lambda w: w.model) or [Workload(model=NO_WORKLOAD, site=site_name)]
        for workload, share in _shares(here):
            advice = _advise_one(workload, share, u, by_site.get(site_name), offers, sites, constraints, accounts,
                                 rates, reclaim_cost_hours)
            report.workloads.append(advice)
            now_at[advice.site] += advice.now
            advised_at[advice.advised_site] += advice.advised
    report.now = round(sum(w.now for w in report.workloads), 2)
    report.advised = round(sum(w.advised for w in report.workloads), 2)
    report.saving = round(report.now - report.advised, 2)
    per_hour = (lambda dollars: round(dollars / hours, 4)) if hours > 0 else (lambda _d: 0.0)
    report.sites = [SiteRate(site=s, now_per_hour=per_hour(now_at.get(s, 0.0)),
                             advised_per_hour=per_hour(advised_at.get(s, 0.0)))
                    for s in sorted(set(now_at) | set(advised_at))]
    report.markdown = markdown(report)
    return report


def _advise_one(workload: Workload, share: float, u: _SiteUsage, site: Site | None, offers: list[Offer],
                sites: list[Site], constraints: dict[str, Constraints], accounts: dict[str, AccountView] | None,
                rates: dict[str, float], reclaim_cost_hours: float) -> WorkloadAdvice:
    gpu_hours = u.gpu_hours * share
    now = u.cost * share
    current = next(iter(u.offers)) if len(u.offers) == 1 else ""
    stay = WorkloadAdvice(model=workload.model, site=workload.site, gpu_hours=round(gpu_hours, 4), now=round(now, 2),
                          advised=round(now, 2), saving=0.0, advised_offer=current, advised_site=workload.site,
                          current_offer=current, reclaims=u.reclaims)
    if site is None:
        stay.note = "site no longer in the fleet config: nothing to compare against"
        return stay
    if gpu_hours <= 0:
        return stay
    wanted = workload_constraints(site, constraints.get(workload.model))
    placement = rank(offers, sites, wanted, accounts)
    stay.current_qualifies = any(c.key == current for c in placement.candidates)
    priced = sorted(((offer_cost(c.offer, gpu_hours, rates.get(c.key, 0.0), reclaim_cost_hours), i, c)
                     for i, c in enumerate(placement.candidates)), key=lambda t: (t[0], t[1]))
    per_gpu_hour_now = now / gpu_hours
    offer_of = {offer_key(o.site, o.instance_type): o for o in offers}
    stay.rejected = [f"{r.key}: {r.reason}" for r in placement.rejected
                     if r.key != current and r.key in offer_of
                     and offer_of[r.key].price_per_gpu_hour < per_gpu_hour_now - 1e-9]
    if not priced:
        stay.note = "no offer qualifies under the workload's constraints"
        stay.current_qualifies = False
        return stay
    cost, _, best = priced[0]
    if stay.current_qualifies and (best.key == current or cost >= now - 1e-9):
        stay.note = "already on the cheapest qualifying offer"
        return stay
    stay.advised, stay.advised_offer, stay.advised_site = round(cost, 2), best.key, best.offer.site
    stay.saving = round(stay.now - stay.advised, 2)
    if not stay.current_qualifies:
        stay.note = "the current placement breaks the workload's constraints"
    return stay


def markdown(report: AdvisorReport) -> str:
    """The report as a Markdown summary (plain ``$``: callers showing it in the Temporal UI
    escape it, as ``workflows.steps.show_details`` does)."""
    lines = [
        f"**Advisor, last {report.since or f'{report.hours:g}h'}**: now ${report.now:,.2f}, "
        f"advised ${report.advised:,.2f}, saving ${report.saving:,.2f}",
        "",
        "| model | site | GPU-h | now | advised | saving | advised offer |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for w in report.workloads:
        lines.append(f"| {w.model} | {w.site} | {w.gpu_hours:,.1f} | ${w.now:,.2f} | ${w.advised:,.2f} | "
                     f"${w.saving:,.2f} | {w.advised_offer or '-'} |")
    rejected = [(w, r) for w in report.workloads for r in w.rejected]
    if rejected:
        lines += ["", "Cheaper offers not advised:"]
        lines += [f"- {w.model} at {w.site}: {r}" for w, r in rejected]
    if report.catalog_errors:
        lines += ["", "Sites whose offers could not be listed:"]
        lines += [f"- {site}: {error}" for site, error in sorted(report.catalog_errors.items())]
    return "\n".join(lines)
