"""Whether a capacity request could ever be served: refused at start, never waited on.

``request_problems`` looks at the request's constraints against what the fleet is
configured to sell (every site's offer, whatever the provider says about capacity
now, whatever state its account is in) and names the field of each thing no
configured site can ever satisfy: an empty request (it would buy the cheapest
machine anywhere), an unknown site, GPU or geography, an empty list (``[]`` never
means "all"), or a combination of constraints that rules out every site. What a
person or time can change (an account revoked or over quota, no capacity now, a
spend cap used up by machines already bought) is not a problem here: the request
waits for those and says why. ``count_problems`` refuses a count more than the sites it may buy
at can ever hold (their ``max_nodes``). Pure functions, deterministic: the workflow calls
them on its catalog, the client on its config.
"""

from __future__ import annotations

from fleet.config import Site
from fleet.models import AccountState, Offer, listing
from fleet.placement import AccountView, Constraints, Placement, offer_key, offers_from_config

#: What an empty request is told: naming what to buy is the caller's job.
EMPTY = ("an empty request would buy the cheapest machine anywhere: name a GPU "
         "(constraints.gpu or constraints.gpu_class) or the sites to buy at (constraints.sites)")


def _unknown(field: str, asked: list[str] | None, known: set[str], what: str) -> list[tuple[str, str]]:
    if asked is None:
        return []
    if not asked:
        return [(field, f"an empty list allows no {what}; leave the field out to allow every {what}")]
    missing = [name for name in asked if name not in known]
    if not missing:
        return []
    names = ", ".join(repr(name) for name in missing)
    return [(field, f"unknown {what} {names} (configured: {listing(known)})")]


def _blocking(offer: Offer, site: Site, c: Constraints) -> tuple[str, str] | None:
    """The first constraint that rules ``offer`` out for good (in ``placement._why_not``'s
    order), as ``(field, why)``; None when only the moment stands in its way."""
    types = c.gpu_types()
    if types is not None and offer.gpu not in types:
        return ("constraints.gpu" if c.gpu else "constraints.gpu_class",
                f"GPU {offer.gpu} is not {' or '.join(sorted(types))}")
    memory = offer.gpu_memory_gb or site.gpu_memory_gb
    if memory < c.gpu_memory_gb_min:
        return "constraints.gpu_memory_gb_min", f"{memory} GB GPU memory < {c.gpu_memory_gb_min} GB"
    if c.gpus_per_machine is not None and offer.gpus != c.gpus_per_machine:
        return "constraints.gpus_per_machine", f"{offer.gpus} GPUs per machine, want {c.gpus_per_machine}"
    if c.sites is not None and offer.site not in c.sites:
        return "constraints.sites", "site not allowed"
    if c.geographies is not None and site.geography not in c.geographies:
        return "constraints.geographies", f"geography {site.geography or '(none)'} not in {', '.join(c.geographies)}"
    if offer.capacity_type not in c.capacity_types:
        return "constraints.capacity_types", f"{offer.capacity_type.value} not allowed"
    price = min(offer.price_per_gpu_hour, site.price_per_gpu_hour)
    if c.max_price_per_gpu_hour is not None and price > c.max_price_per_gpu_hour:
        return "constraints.max_price_per_gpu_hour", f"${price:.2f}/GPU-h > max ${c.max_price_per_gpu_hour:.2f}"
    cost = price * offer.gpus
    if c.spend_cap_per_hour is not None and cost > c.spend_cap_per_hour:
        return "constraints.spend_cap_per_hour", f"${cost:.2f}/h per machine > spend cap ${c.spend_cap_per_hour:.2f}/h"
    return None


def request_problems(constraints: Constraints, sites: list[Site],
                     offers: list[Offer] | None = None) -> list[tuple[str, str]]:
    """``(field, problem)`` for each reason no configured site can ever serve ``constraints``
    (empty: it may be served, now or once the moment allows). ``offers``: a catalog's offers,
    looked at together with the offer each site's config describes."""
    c = constraints
    if not c.gpu and c.gpu_class is None and c.sites is None:
        return [("constraints", EMPTY)]
    by_name = {s.name: s for s in sites}
    catalog = [*offers_from_config(sites), *(offers or [])]
    problems = _unknown("constraints.sites", c.sites, set(by_name), "site")
    gpus = {o.gpu for o in catalog if o.site in by_name}
    if c.gpu and c.gpu not in gpus:
        problems.append(("constraints.gpu", f"no configured site sells GPU {c.gpu!r} (sold: {listing(gpus)})"))
    problems += _unknown("constraints.gpu_class", c.gpu_class, gpus, "GPU")
    problems += _unknown("constraints.geographies", c.geographies,
                         {s.geography for s in sites if s.geography}, "geography")
    if problems:
        return problems
    blocked: dict[str, tuple[str, str]] = {}
    for offer in catalog:
        site = by_name.get(offer.site)
        if site is None:
            continue
        why = _blocking(offer, site, c)
        if why is None:
            return []
        blocked.setdefault(offer_key(offer.site, offer.instance_type), why)
    fields = sorted({field for field, _ in blocked.values()})
    reasons = "; ".join(f"{key}: {why}" for key, (_, why) in sorted(blocked.items())[:12])
    return [(", ".join(fields) or "constraints",
             f"no configured site can ever satisfy this combination ({reasons or 'no sites configured'})")]


def eligible_sites(constraints: Constraints, sites: list[Site], offers: list[Offer] | None = None) -> list[Site]:
    """The configured sites with an offer ``constraints`` allow for good: those a request may
    ever buy at, whatever the moment says."""
    by_name = {s.name: s for s in sites}
    allowed = {o.site for o in [*offers_from_config(sites), *(offers or [])]
               if o.site in by_name and _blocking(o, by_name[o.site], constraints) is None}
    return [s for s in sites if s.name in allowed]


def count_problems(count: int, constraints: Constraints, sites: list[Site],
                   offers: list[Offer] | None = None) -> list[tuple[str, str]]:
    """``[("count", why)]`` when the eligible sites can never hold ``count`` nodes together: the sum
    of their configured ``max_nodes`` (not the room they have now, which changes). Such a request
    would buy what it can, past a site's max for its Site entity to retire, or wait out its deadline."""
    eligible = eligible_sites(constraints, sites, offers)
    most = sum(s.max_nodes for s in eligible)
    if count <= most:
        return []
    held = ", ".join(f"{s.name} {s.max_nodes}" for s in eligible[:12])
    held += f", … ({len(eligible)} sites)" if len(eligible) > 12 else ""
    return [("count", f"{count} nodes is more than the eligible sites can ever hold together: {most} "
                      f"(max_nodes: {held or 'no eligible site'})")]


def waiting_for(placement: Placement, offers: list[Offer], sites: list[Site], constraints: Constraints,
                accounts: dict[str, AccountView] | None = None,
                errors: dict[str, str] | None = None) -> list[str]:
    """Why a request that may be served cannot buy now: one line per offer its constraints
    allow but the moment does not (an account revoked or over quota, no capacity, the spend
    cap, a site whose offers could not be listed: ``errors``, site → why), with what ends the
    wait when a person has to act."""
    by_name = {s.name: s for s in sites}
    accounts = accounts or {}
    errors = errors or {}
    listed = {o.site for o in offers}
    allowed = {offer_key(o.site, o.instance_type) for o in offers
               if o.site in by_name and _blocking(o, by_name[o.site], constraints) is None}
    reasons = [(r.key, r.site, r.reason) for r in placement.rejected if r.key in allowed]
    for offer in offers_from_config(sites):  # a site the catalog has no offer of: why not
        site = by_name[offer.site]
        if offer.site in listed or _blocking(offer, site, constraints) is not None:
            continue
        view = accounts.get(site.account)
        if view is not None and view.state == AccountState.CREDENTIALS_REVOKED:
            why = f"account {site.account} credentials revoked (waiting for a person)"
        else:
            why = f"offers not listed ({errors.get(offer.site, 'the provider listed none')})"
        reasons.append((offer_key(offer.site, offer.instance_type), offer.site, why))
    lines = []
    for key, site_name, reason in sorted(reasons):
        site = by_name[site_name]
        view = accounts.get(site.account)
        line = f"{key}: {reason}"
        if view is not None and view.state == AccountState.CREDENTIALS_REVOKED:
            line += (f"; a person fixes the credentials of {site.account}, then "
                     f"`gpufleet accounts credentials-rotated {site.account}`")
        elif view is not None and key in view.blocked_offers:
            line += (f"; a person raises the quota of {site.account}, then "
                     f"`gpufleet accounts quota-raised {site.account} --offer {key}`")
        lines.append(line)
    return lines
