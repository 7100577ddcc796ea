"""Routing policy, pure: which share of a model's new sessions each site gets.

Product rules (seeds 000, 001, 004): the site is picked first, by health, load,
latency to the caller's geography and cost; a session then stays at its site
(stickiness lives in the front door, not here); traffic moves only when a site
cannot serve. ``compute_weights`` turns per-site facts into integer weights
that sum to ``TOTAL``; the ``Routing`` entity (``workflows/routing.py``) calls
it on every site event and load sample and writes the result as one versioned
``RoutingDocument``. No Temporal, no I/O.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Iterable

from pydantic import Field

from fleet.models import Strict

#: Weights of one model always sum to this (or are all 0: nothing can serve).
TOTAL = 1000
#: Sites one model can be routed to. Its HTTPRoute holds one weighted backendRef per site
#: serving it, in one rule, and Gateway API allows 16 backendRefs in a rule (the CRD's
#: ``maxItems``: the API server refuses a 17th). Weights split traffic only among one rule's
#: backends, so more rules would not help: a model's serving policy and a rollout name at
#: most this many sites.
MAX_ROUTED_SITES = 16
#: The most a site's ``queue_depth`` may be.
MAX_SITE_QUEUE = 1e9


class Strategy(StrEnum):
    CHEAPEST = "cheapest"
    NEAREST = "nearest"
    LEAST_LOADED = "least-loaded"


class Mode(StrEnum):
    #: Every healthy site with Ready replicas takes traffic.
    ACTIVE_ACTIVE = "active-active"
    #: Only primaries take traffic; secondaries only when no primary can serve.
    ACTIVE_PASSIVE = "active-passive"
    #: Primaries first; secondaries join when no primary can serve or primaries are saturated.
    BURST = "burst"



class SiteLoad(Strict):
    """What routing knows about one site for one model."""

    site: str = Field(min_length=1, max_length=253)
    #: Ready replicas only: a replica still loading its weights serves nothing.
    ready_replicas: int = Field(0, ge=0, le=100_000)
    #: Requests waiting across the site's replicas (vLLM ``vllm:num_requests_waiting``); a load
    #: sample's is ``site_queue_depth`` of its servers' figures, which no one server of three or
    #: more decides.
    queue_depth: float = Field(0, ge=0, le=MAX_SITE_QUEUE)
    #: Round trip from the callers' geography to the site.
    latency_ms: float = Field(0, ge=0, le=600_000)
    price_per_gpu_hour: float = Field(0, ge=0, le=1e6)
    #: In ``active-passive`` and ``burst``: primaries serve first.
    primary: bool = True
    healthy: bool = True
    #: Evacuation: no new sessions, stuck sessions move (``maint`` in the front door).
    draining: bool = False
    #: Evacuation's ceiling, as percent of what the policy would give the site.
    cap_percent: int = Field(100, ge=0, le=100)
    #: An open incident at the site (one line), shown in the document.
    incident: str = Field("", max_length=500)

    @property
    def can_serve(self) -> bool:
        return self.healthy and not self.draining and self.ready_replicas > 0 and self.cap_percent > 0

    @property
    def queue_per_replica(self) -> float:
        return self.queue_depth / self.ready_replicas if self.ready_replicas else 0.0


class RoutingPolicy(Strict):
    strategy: Strategy = Strategy.LEAST_LOADED
    mode: Mode = Mode.ACTIVE_ACTIVE
    #: A recomputed share that moves no site by more than this keeps the old weights:
    #: load samples wobble, and every change costs sessions their warm prefix cache.
    hysteresis: float = Field(0.05, ge=0, le=0.5)
    #: Share a serving site never drops below (active-active): a warm site stays warm.
    warm_floor: float = Field(0.02, ge=0, le=0.5)
    #: ``burst``: primaries count as saturated above this many waiting requests per replica
    #: (``queue_depth`` per replica, which no one server decides: ``site_queue_depth``).
    burst_queue_per_replica: float = Field(8, gt=0, le=1e6)
    #: How sharply the strategy prefers its best site (share ~ (best/value) ** sharpness).
    sharpness: float = Field(4, ge=0, le=16)


def candidates(sites: Iterable[SiteLoad], policy: RoutingPolicy) -> list[SiteLoad]:
    """The sites that take new sessions under the model's mode."""
    serving = [s for s in sites if s.can_serve]
    primaries = [s for s in serving if s.primary]
    secondaries = [s for s in serving if not s.primary]
    if policy.mode is Mode.ACTIVE_ACTIVE or not primaries:
        return serving
    if policy.mode is Mode.BURST and all(s.queue_per_replica > policy.burst_queue_per_replica for s in primaries):
        return primaries + secondaries
    return primaries


def _score(site: SiteLoad, among: list[SiteLoad], policy: RoutingPolicy) -> float:
    # Capacity discounted by load under every strategy: a full site is a slow site.
    score = site.ready_replicas / (1 + site.queue_per_replica)
    k = policy.sharpness
    if policy.strategy is Strategy.CHEAPEST:
        best = min(s.price_per_gpu_hour for s in among)
        score *= ((best + 0.01) / (site.price_per_gpu_hour + 0.01)) ** k
    elif policy.strategy is Strategy.NEAREST:
        best = min(s.latency_ms for s in among)
        score *= ((best + 1) / (site.latency_ms + 1)) ** k
    else:
        score /= 1 + site.queue_per_replica
    return score * site.cap_percent / 100


def _with_floor(shares: dict[str, float], floor: float, floored: set[str]) -> dict[str, float]:
    """Lift the ``floored`` sites to ``floor``, taking it from the others pro rata."""
    if not floored or floor <= 0:
        return shares
    if floor * len(shares) >= 1:
        return {k: 1 / len(shares) for k in shares}
    fixed: set[str] = set()
    while True:
        low = {k for k in floored - fixed if shares[k] < floor}
        if not low:
            return shares
        fixed |= low
        rest = 1 - floor * len(fixed)
        free = {k: v for k, v in shares.items() if k not in fixed}
        total = sum(free.values())
        shares = {k: (floor if k in fixed else (free[k] / total * rest if total else rest / len(free)))
                  for k in shares}


def _integers(shares: dict[str, float], total: int) -> dict[str, int]:
    """Largest remainder: integers summing exactly to ``total``, ties by name."""
    raw = {k: v * total for k, v in shares.items()}
    out = {k: int(v) for k, v in raw.items()}
    left = total - sum(out.values())
    for k in sorted(raw, key=lambda k: (-(raw[k] - out[k]), k))[:left]:
        out[k] += 1
    return out


def compute_weights(
    sites: Iterable[SiteLoad], policy: RoutingPolicy, previous: dict[str, int] | None = None
) -> dict[str, int]:
    """Every site's weight (0 for those that take no new sessions), summing to ``TOTAL``
    unless no site can serve. With ``previous``: kept as is when the same sites take
    traffic and no share moved by more than ``policy.hysteresis``."""
    sites = list(sites)
    chosen = candidates(sites, policy)
    weights = {s.site: 0 for s in sites}
    if not chosen:
        return weights
    scores = {s.site: _score(s, chosen, policy) for s in chosen}
    total = sum(scores.values())
    shares = {k: (v / total if total else 1 / len(scores)) for k, v in scores.items()}
    # The floor keeps warm only what the mode chose and the evacuation did not cap.
    shares = _with_floor(shares, policy.warm_floor, {s.site for s in chosen if s.cap_percent == 100})
    weights.update(_integers(shares, TOTAL))
    if previous is not None and _within(previous, weights, policy.hysteresis):
        return {s.site: previous.get(s.site, 0) for s in sites}
    return weights


def _within(old: dict[str, int], new: dict[str, int], hysteresis: float) -> bool:
    """Same sites taking traffic, and no share moved by more than ``hysteresis``."""
    keys = set(old) | set(new)
    if {k for k in keys if old.get(k, 0) > 0} != {k for k in keys if new.get(k, 0) > 0}:
        return False
    return all(abs(old.get(k, 0) - new.get(k, 0)) <= hysteresis * TOTAL for k in keys)


class SiteRouteState(Strict):
    """One site in a routing document."""

    weight: int = Field(ge=0, le=TOTAL)
    ready_replicas: int = 0
    draining: bool = False
    healthy: bool = True
    incident: str = ""


#: A document's reason, one line. Events build it from what their senders wrote (any length),
#: so it is made to fit (``reason_for``, ``next_document``), never refused: a refusal would fail
#: the entity's workflow task on every retry, its routes frozen.
MAX_REASON = 500
#: A reason names at most this many events, the latest; earlier ones are only counted.
REASON_EVENTS = 5


def shortened(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, an ellipsis marking the cut."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def reason_for(events: list[str], earlier: int = 0) -> str:
    """The reason for a recompute from the events that asked for it (oldest first) and a count of
    ``earlier`` ones: the latest ``REASON_EVENTS``, each shortened to its share of ``MAX_REASON``,
    so one long event never hides the others."""
    named = events[-REASON_EVENTS:]
    if not named:
        return ""
    earlier += len(events) - len(named)
    tail = f" (and {earlier} earlier)" if earlier else ""
    share = max(1, (MAX_REASON - len(tail) - 2 * (len(named) - 1)) // len(named))
    return "; ".join(shortened(event, share) for event in named) + tail


class RoutingDocument(Strict):
    """The one thing the front doors render: a model's per-site weights, versioned.

    Written only by the model's ``Routing`` entity; the version goes up by one on
    every change, so a renderer can skip a document it has already applied."""

    model: str = Field(min_length=1, max_length=128)
    version: int = Field(ge=0)
    sites: dict[str, SiteRouteState] = Field(default_factory=dict)
    #: Why the last change was made (the event or sample that caused it).
    reason: str = Field("", max_length=MAX_REASON)

    @property
    def weights(self) -> dict[str, int]:
        return {k: v.weight for k, v in self.sites.items()}


def next_document(
    model: str, sites: list[SiteLoad], policy: RoutingPolicy, previous: RoutingDocument | None, reason: str
) -> RoutingDocument:
    """The document after an event or sample; ``previous`` itself when nothing changed."""
    weights = compute_weights(sites, policy, previous.weights if previous else None)
    entries = {
        s.site: SiteRouteState(weight=weights[s.site], ready_replicas=s.ready_replicas, draining=s.draining,
                               healthy=s.healthy, incident=s.incident)
        for s in sites
    }
    if previous is not None and previous.sites == entries:
        return previous
    return RoutingDocument(model=model, version=(previous.version + 1 if previous else 1), sites=entries,
                           reason=shortened(reason, MAX_REASON))


#: Control-plane state (``Cluster.read_state``) listing the model servers of one model at one
#: site, server name -> base URL, published by whoever runs them (the dev stack's front door),
#: so a load sample can read each server's queue.
ENDPOINTS_KIND = "serving-endpoints"
#: The gauge a load sample reads from each of a site's servers (vLLM's name for it).
QUEUE_METRIC = "vllm:num_requests_waiting"
#: The most one server's gauge is read as, far above a real queue: the page is served from a
#: node, and a claim of 1e300 must stay a number. What a server's word does to its site's figure
#: is bounded by ``site_queue_depth``, not by this.
MAX_SERVER_QUEUE = 1e6


def site_queue_depth(server_queues: Iterable[float]) -> float:
    """A site's ``queue_depth`` from the requests waiting at each of its model servers (those
    that answered a count). Each figure is its node's word, so at a site of three servers or more
    no one of them decides the figure: the highest and the lowest are set aside and the site reads
    as if every server waited the mean of the rest (that mean times the servers). Whatever one
    server claims, a million waiting or none, its site reads within what its neighbours report;
    two lying together move it within the others' range still, unless they are its extremes.

    Load spread evenly reads as its sum, as it always did: a site whose every server is saturated
    reads saturated and loses its share; one idle server beside saturated ones (a replica just
    Ready) does not hide it (20, 20, 20 and 0 waiting read 20 a server). A lone outlier is not its
    site's load: one server of four with 100 waiting and three idle reads idle, where the balancer
    sends new sessions. At a site of one or two servers the figure is their sum, as before: there
    each server's word is half its site or all of it (docs/security.md says so)."""
    queues = sorted(min(q, MAX_SERVER_QUEUE) for q in server_queues)
    if len(queues) >= 3:
        kept = queues[1:-1]
        return min(math.fsum(kept) / len(kept) * len(queues), MAX_SITE_QUEUE)
    return min(math.fsum(queues), MAX_SITE_QUEUE)


def endpoints_key(model: str, site: str) -> str:
    return f"{model}.{site}"


