"""The demand planner (product rule 13), pure: which machines to buy for the Pending GPU
pods that opted in (``fleet.demand``, the contract), placed first on room that exists or
is joining. No Temporal, no I/O; same input, same plan.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from fleet.cluster import UNPROVEN_TAINT
from fleet.config import ServingPolicy, Site
from fleet.demand import GpuPod, fits, opted_in, pod_constraints
from fleet.models import CapacityType, Offer
from fleet.placement import AccountView, effective_price, rank
from fleet.replacement import may_move


# -- what the planner sees ------------------------------------------------------------------
class NodeRoom(BaseModel):
    """A node (or a machine being joined) that pods may land on."""

    name: str
    site: str
    labels: dict[str, str] = Field(default_factory=dict)
    taints: list[str] = Field(default_factory=list)
    gpus: int = 0
    #: GPUs requested by pods bound to it (or, for a join, by the pods it was bought for).
    gpus_used: int = 0
    #: A join in flight (``name`` is the purchase id) rather than a node.
    joining: bool = False


class PlannedMachine(BaseModel):
    """One machine to buy, and the pods it is for."""

    offer: str
    site: str
    instance_type: str
    gpu: str
    gpus: int
    capacity_type: CapacityType
    price_per_gpu_hour: float
    effective_price: float
    pods: list[str] = Field(default_factory=list)
    #: GPUs the pods use; the rest is slack (``headroom_gpus`` of it asked for by warm headroom).
    gpus_used: int = 0
    headroom_gpus: int = 0
    model: str = ""
    reason: str = ""

    @property
    def cost_per_hour(self) -> float:
        return self.price_per_gpu_hour * self.gpus


class DemandPlan(BaseModel):
    machines: list[PlannedMachine] = Field(default_factory=list)
    #: pod → where it will run without buying (a node with room, a join in flight).
    covered: dict[str, str] = Field(default_factory=dict)
    #: pod → why nothing can be bought for it now.
    unplaceable: dict[str, str] = Field(default_factory=dict)
    #: pod → why the loop leaves it alone (not opted in, nominated, not Pending).
    ignored: dict[str, str] = Field(default_factory=dict)

    @property
    def cost_per_hour(self) -> float:
        return round(sum(m.cost_per_hour for m in self.machines), 6)

    @property
    def gpus_bought(self) -> int:
        return sum(m.gpus for m in self.machines)


class ModelUsage(BaseModel):
    """GPUs a model already holds (bound pods, joins in flight), by capacity type."""

    spot_gpus: int = 0
    other_gpus: int = 0


# -- the bin-packing ------------------------------------------------------------------------
class _Offer:
    __slots__ = ("offer", "site", "eff", "machine_eff", "key", "room")

    def __init__(self, offer: Offer, site: Site, room: int) -> None:
        self.offer, self.site = offer, site
        self.eff = effective_price(offer)
        self.machine_eff = self.eff * offer.gpus
        self.key = f"{offer.site}/{offer.instance_type}"
        self.room = room


def _site_room(sites: list[Site], nodes: list[NodeRoom]) -> dict[str, int]:
    """Machines each site may still add: max_nodes minus nodes and joins it has."""
    count: dict[str, int] = defaultdict(int)
    for node in nodes:
        count[node.site] += 1
    return {s.name: max(0, s.max_nodes - count[s.name]) for s in sites}


def _tiers(policy: ServingPolicy | None, sites: list[Site], down: dict[str, str]) -> list[set[str] | None]:
    """Sites a model may buy at, in order: the primaries, then (active-passive, burst) the
    standby sites, used only for what no primary can take. ``None``: any site."""
    if policy is None:
        return [None]
    by_name = {s.name: s for s in sites}
    anchor = by_name.get(policy.sites[0]) if policy.sites else None
    # A compliance primary keeps the model inside its geography (fleet.replacement).
    allowed = [n for n in [*policy.sites, *policy.standby_sites]
               if n in by_name and (anchor is None or may_move(anchor, by_name[n]))]
    primaries = {n for n in policy.sites if n in allowed and n not in down}
    standby = {n for n in policy.standby_sites if n in allowed and n not in down}
    if policy.mode == "active-active":
        return [primaries | standby]
    return [primaries, standby]


#: A machine bought for pods: the offer, its pods, the GPUs they use, the GPUs kept warm on it.
_Opened = tuple[_Offer, list[GpuPod], int, int]


@dataclass(frozen=True)
class _Batch:
    """What both packing attempts for one batch share: the pods that need a machine, the
    offers (each with its site's room), the models' spot budgets and the ranked candidates."""

    wanted: list[GpuPod]
    offers: list[Offer]
    sites: list[Site]
    policies: dict[str, ServingPolicy]
    accounts: dict[str, AccountView] | None
    excluded: dict[str, str] | None
    down: dict[str, str]
    site_room: dict[str, int]
    offer_objs: dict[str, _Offer]
    spot_left: dict[str, float]
    #: constraint signature → (ranked offer keys, why the others were rejected).
    ranked: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)


def plan_demand(
    pods: list[GpuPod],
    nodes: list[NodeRoom],
    offers: list[Offer],
    sites: list[Site],
    *,
    policies: dict[str, ServingPolicy] | None = None,
    usage: dict[str, ModelUsage] | None = None,
    accounts: dict[str, AccountView] | None = None,
    excluded: dict[str, str] | None = None,
    down: dict[str, str] | None = None,
) -> DemandPlan:
    """Place each Pending, opted-in pod on room that exists or is joining; buy the cheapest
    machines (effective $/GPU-hour, spot made dearer by its risk) for the rest.

    ``nodes``: ready nodes and joins in flight, each with the GPUs already taken.
    ``policies``: model → serving policy; ``usage``: model → GPUs held (spot share).
    ``down``: site → why it may not be bought at (an open incident, draining).
    Pure and deterministic: same input, same plan.
    """
    policies, usage, down = policies or {}, usage or {}, down or {}
    plan = DemandPlan()
    wanted = _cover_on_room(pods, nodes, plan)
    if not wanted:
        return plan
    site_room = _site_room(sites, nodes)
    batch = _Batch(wanted=wanted, offers=offers, sites=sites, policies=policies, accounts=accounts,
                   excluded=excluded, down=down, site_room=site_room,
                   offer_objs=_offer_objects(offers, sites, site_room),
                   spot_left=_spot_budgets(wanted, policies, usage))
    # Two greedy rules, the cheaper plan wins: cost per GPU a machine would actually hold
    # (packs well), and plain cheapest $/GPU-hour first (wins when big machines are cheap).
    tries = [_attempt(plan, batch, score) for score in ("per-used-gpu", "per-gpu")]
    plan = min(tries, key=lambda p: (len(p.unplaceable), sum(m.effective_price * m.gpus for m in p.machines)))
    plan.machines.sort(key=lambda m: (m.site, m.offer, m.pods))
    return plan


def _cover_on_room(pods: list[GpuPod], nodes: list[NodeRoom], plan: DemandPlan) -> list[GpuPod]:
    """Largest, then oldest pods first: note the pods the loop leaves alone, place each other
    Pending pod on room that exists or is joining; returns the pods that need a machine."""
    rooms = [n.model_copy() for n in nodes]
    # Joins first: they were bought for these pods, and nodes are shared by everyone.
    rooms.sort(key=lambda n: (not n.joining, n.name))
    wanted: list[GpuPod] = []
    for pod in sorted(pods, key=lambda p: (-p.gpus, p.created_at, p.key)):
        if not pod.pending:
            continue
        why = _why_ignored(pod)
        if why:
            plan.ignored[pod.key] = why
            continue
        room = next((r for r in rooms if fits(pod, r.labels, [t for t in r.taints if t != UNPROVEN_TAINT],
                                              r.gpus - r.gpus_used)), None)
        if room is not None:
            room.gpus_used += pod.gpus
            plan.covered[pod.key] = (f"joining {room.name}" if room.joining
                                     else f"fits on {room.name} (room for {pod.gpus} GPU)")
        else:
            wanted.append(pod)
    return wanted


def _why_ignored(pod: GpuPod) -> str:
    """Why the loop leaves a Pending pod alone; empty when it is the loop's to place."""
    if not opted_in(pod):
        return "not opted in (fleet toleration and node selector)"
    if pod.gpus <= 0:
        return "requests no GPUs"
    if pod.nominated_node:
        return f"the scheduler nominated {pod.nominated_node}"
    return ""


def _offer_objects(offers: list[Offer], sites: list[Site], site_room: dict[str, int]) -> dict[str, _Offer]:
    """The offers at known sites, one per site and instance type (the first one listed)."""
    by_site = {s.name: s for s in sites}
    offer_objs: dict[str, _Offer] = {}
    for o in offers:
        site = by_site.get(o.site)
        if site is not None:
            offer_objs.setdefault(f"{o.site}/{o.instance_type}", _Offer(o, site, site_room.get(o.site, 0)))
    return offer_objs


def _spot_budgets(wanted: list[GpuPod], policies: dict[str, ServingPolicy],
                  usage: dict[str, ModelUsage]) -> dict[str, float]:
    """Spot GPUs each model may still buy in this batch."""
    # Spot budget per model: spot GPUs may reach ``spot_share`` of the model's GPUs and
    # never eat into the on-demand floor.
    batch_gpus: dict[str, int] = defaultdict(int)
    for pod in wanted:
        batch_gpus[pod.model] += pod.gpus
    spot_left: dict[str, float] = {}
    for model, gpus in batch_gpus.items():
        policy = policies.get(model)
        if policy is None:
            spot_left[model] = math.inf
            continue
        held = usage.get(model, ModelUsage())
        total = held.spot_gpus + held.other_gpus + gpus
        cap = min(policy.spot_share * total, total - policy.on_demand_floor_gpus)
        spot_left[model] = max(0.0, cap - held.spot_gpus)
    return spot_left


def _attempt(plan: DemandPlan, batch: _Batch, score: str) -> DemandPlan:
    """``plan`` with machines bought for the batch by one greedy rule: tier by tier (a model's
    primaries, then its standby sites), each tier packing what the ones before could not."""
    out = plan.model_copy(deep=True)
    for offer in batch.offer_objs.values():
        offer.room = batch.site_room.get(offer.offer.site, 0)
    budget = dict(batch.spot_left)
    remaining = batch.wanted
    tier_index = 0
    while remaining:
        buckets, later = _bucket_tier(batch, remaining, tier_index, out)
        headroom = _warm_headroom(buckets, batch.policies)
        leftovers = _pack(buckets, batch.offer_objs, headroom, budget, out, tier_index, score)
        remaining = later + [p for p in leftovers
                             if tier_index + 1 < len(_tiers(batch.policies.get(p.model), batch.sites, batch.down))]
        for pod in leftovers:
            if pod not in remaining:
                out.unplaceable[pod.key] = "the qualifying sites are at max_nodes or out of spot share"
        tier_index += 1
    return out


def _bucket_tier(batch: _Batch, remaining: list[GpuPod], tier_index: int,
                 out: DemandPlan) -> tuple[dict[tuple, list[GpuPod]], list[GpuPod]]:
    """The pods to pack at this tier, bucketed by model and candidate offers, and the pods
    that wait for a later tier; a pod with nothing to buy at its last tier is unplaceable."""
    # Bucket pods: (model, constraint signature, tier) → pods, so a machine is evaluated per
    # bucket, not per pod (1,000 pods, 40 offers stay well under a second).
    # Every model's pods at this tier (a model without a policy has one tier: anywhere).
    buckets: dict[tuple, list[GpuPod]] = defaultdict(list)
    later: list[GpuPod] = []
    for pod in remaining:
        tiers = _tiers(batch.policies.get(pod.model), batch.sites, batch.down)
        if tier_index >= len(tiers):
            continue
        cands = _candidates(batch, pod, tiers[tier_index])
        if isinstance(cands, str):
            if tier_index + 1 < len(tiers):
                later.append(pod)
            else:
                out.unplaceable[pod.key] = cands
            continue
        buckets[(pod.model, tuple(c.key for c in cands))].append(pod)
    return buckets, later


def _candidates(batch: _Batch, pod: GpuPod, tier: set[str] | None) -> list[_Offer] | str:
    """The offers ``pod`` may land on within ``tier``, best ranked first, or why there is none."""
    constraints = pod_constraints(pod, batch.policies.get(pod.model))
    if isinstance(constraints, str):
        return constraints
    sig = constraints.model_dump_json()
    if sig not in batch.ranked:
        placement = rank(batch.offers, batch.sites, constraints, batch.accounts, batch.excluded)
        batch.ranked[sig] = ([c.key for c in placement.candidates], placement.reasons())
    keys, reasons = batch.ranked[sig]
    offer_objs, down = batch.offer_objs, batch.down
    found = [offer_objs[k] for k in keys if k in offer_objs and (tier is None or offer_objs[k].offer.site in tier)
             and offer_objs[k].offer.site not in down]
    if not found:
        why = reasons[:3] + [f"{s}: {r}" for s, r in sorted(down.items())][:2]
        if tier is not None:
            why.append(f"the model's sites here are {', '.join(sorted(tier)) or '(none)'}")
        return "no qualifying offer: " + ("; ".join(why) or "no offer for this GPU")
    return found


def _warm_headroom(buckets: dict[tuple, list[GpuPod]], policies: dict[str, ServingPolicy]) -> dict[str, int]:
    """Spare GPUs each model's machines should carry at this tier."""
    # Warm headroom: a model's machines carry that share of its new GPUs as slack.
    headroom: dict[str, int] = {}
    for (model, _), group in buckets.items():
        policy = policies.get(model)
        if policy is not None and policy.warm_headroom > 0:
            headroom[model] = headroom.get(model, 0) + math.ceil(policy.warm_headroom * sum(p.gpus for p in group))
    return headroom


def _machine(offer: _Offer, pods: list[GpuPod], used: int, headroom: int, tier: int) -> PlannedMachine:
    o = offer.offer
    models = sorted({p.model for p in pods})
    return PlannedMachine(
        offer=offer.key, site=o.site, instance_type=o.instance_type, gpu=o.gpu, gpus=o.gpus,
        capacity_type=o.capacity_type, price_per_gpu_hour=o.price_per_gpu_hour, effective_price=round(offer.eff, 6),
        pods=[p.key for p in pods], gpus_used=used, headroom_gpus=headroom, model=",".join(m for m in models if m),
        reason=(f"cheapest qualifying for {len(pods)} pod(s): ${offer.eff:.2f}/GPU-h effective, "
                f"{used}/{o.gpus} GPUs used" + (f", {headroom} kept warm" if headroom else "")
                + (" (standby site: no primary could take them)" if tier else "")),
    )


def _merge(opened: list[_Opened], pod_offers: dict[str, set[str]]) -> list[_Opened]:
    """Greedy choice by cost per used GPU can open a small machine for a pod that a big
    machine opened later has room for: move every pod of such a machine into the others'
    free GPUs (each pod only where it qualifies, never onto spot from elsewhere) and drop it."""
    machines = [[offer, list(taken), used, hr] for offer, taken, used, hr in opened]
    changed = True
    while changed:
        changed = False
        order = sorted(range(len(machines)), key=lambda i: -machines[i][0].machine_eff / max(machines[i][2], 1))
        for i in order:
            offer, taken = machines[i][0], machines[i][1]
            free = {j: m[0].offer.gpus - m[2] for j, m in enumerate(machines) if j != i}
            moves: list[tuple[GpuPod, int]] = []
            for pod in sorted(taken, key=lambda p: -p.gpus):
                target = next((j for j in sorted(free, key=lambda j: (free[j], j))
                               if free[j] >= pod.gpus and machines[j][0].key in pod_offers[pod.key]
                               and (machines[j][0].offer.capacity_type != CapacityType.SPOT
                                    or offer.offer.capacity_type == CapacityType.SPOT)), None)
                if target is None:
                    break
                free[target] -= pod.gpus
                moves.append((pod, target))
            if len(moves) != len(taken) or not taken:
                continue
            for pod, j in moves:
                machines[j][1].append(pod)
                machines[j][2] += pod.gpus
                machines[j][3] = min(machines[j][3], machines[j][0].offer.gpus - machines[j][2])
            offer.room += 1
            del machines[i]
            changed = True
            break
    return [(m[0], m[1], m[2], m[3]) for m in machines]


def _pack(buckets: dict[tuple, list[GpuPod]], offer_objs: dict[str, _Offer], headroom: dict[str, int],
          spot_left: dict[str, float], plan: DemandPlan, tier: int, rule: str = "per-used-gpu") -> list[GpuPod]:
    """Greedy set cover: open the machine with the lowest effective cost per GPU it would
    actually use (filled largest pods first), until every pod has one; then move each
    machine to the cheapest offer that still holds what it got. Returns the pods left over."""
    queues, pod_offers = _size_queues(buckets)
    serves = _buckets_served(queues)
    headroom = dict(headroom)
    opened = _open_greedily(queues, serves, offer_objs, headroom, spot_left, rule)
    _buy_headroom(queues, offer_objs, headroom, plan)
    opened = _merge(opened, pod_offers)
    downsized = _downsize(opened, offer_objs, pod_offers)
    leftover = [p for q in queues.values() for pods in q.values() for p in pods]
    placed = [p for _, taken, _, _ in downsized for p in taken]
    if not leftover and not any(hr for *_, hr in downsized) and len(placed) <= EXACT_PODS:
        downsized = _improve_exactly(placed, downsized, offer_objs, pod_offers, spot_left)
    for offer, taken, used, hr in downsized:
        plan.machines.append(_machine(offer, taken, used, hr, tier))
    return leftover


def _size_queues(buckets: dict[tuple, list[GpuPod]]) -> tuple[dict[tuple, dict[int, list[GpuPod]]],
                                                               dict[str, set[str]]]:
    """Each bucket's pods queued by size (largest size first), and each pod's offer keys."""
    # bucket → GPUs per pod → pods (oldest first).
    queues: dict[tuple, dict[int, list[GpuPod]]] = {}
    pod_offers: dict[str, set[str]] = {}
    for key, group in buckets.items():
        sizes: dict[int, list[GpuPod]] = defaultdict(list)
        for pod in sorted(group, key=lambda p: (p.created_at, p.key)):
            sizes[pod.gpus].append(pod)
            pod_offers[pod.key] = set(key[1])
        queues[key] = dict(sorted(sizes.items(), reverse=True))
    return queues, pod_offers


def _buckets_served(queues: dict[tuple, dict[int, list[GpuPod]]]) -> dict[str, list[tuple]]:
    """Offer key → the buckets a machine of it may take pods from, in the order it fills."""
    serves: dict[str, list[tuple]] = defaultdict(list)
    # Pods with the fewest choices go in first: the flexible ones fill what is left.
    for key in sorted(queues, key=lambda k: (len(k[1]), k)):
        for offer_key in key[1]:
            serves[offer_key].append(key)
    return serves


def _open_greedily(queues: dict[tuple, dict[int, list[GpuPod]]], serves: dict[str, list[tuple]],
                   offer_objs: dict[str, _Offer], headroom: dict[str, int], spot_left: dict[str, float],
                   rule: str) -> list[_Opened]:
    """Open the best-scoring machine (by ``rule``) until every pod has one or no site has room."""
    opened: list[_Opened] = []
    while any(pods for q in queues.values() for pods in q.values()):
        best = None
        for offer_key in sorted(serves):
            offer = offer_objs[offer_key]
            if offer.room <= 0:
                continue
            taken, used, hr = _fill(offer, serves, queues, headroom, spot_left, dry=True)
            if not taken:
                continue
            score = ((offer.machine_eff / (used + hr), -used, offer.eff, offer.key) if rule == "per-used-gpu"
                     else (offer.eff, -used, offer.machine_eff, offer.key))
            if best is None or score < best[0]:
                best = (score, offer)
        if best is None:
            break
        offer = best[1]
        taken, used, hr = _fill(offer, serves, queues, headroom, spot_left, dry=False)
        offer.room -= 1
        opened.append((offer, taken, used, hr))
    return opened


def _fill(offer: _Offer, serves: dict[str, list[tuple]], queues: dict[tuple, dict[int, list[GpuPod]]],
          headroom: dict[str, int], spot_left: dict[str, float], dry: bool) -> tuple[list[GpuPod], int, int]:
    """The pods a machine of ``offer`` would take (largest sizes first, within the spot
    budgets), the GPUs they use and its warm headroom; unless ``dry``, take them for real."""
    free = offer.offer.gpus
    spot = offer.offer.capacity_type == CapacityType.SPOT
    budget = dict(spot_left) if dry else spot_left
    taken: list[GpuPod] = []
    for key in serves[offer.key]:
        model = key[0]
        for size, pods in queues[key].items():
            if size > free or not pods:
                continue
            n = min(len(pods), free // size)
            if spot and budget[model] != math.inf:
                n = min(n, int(budget[model] // size))
            if n <= 0:
                continue
            if spot:
                budget[model] -= n * size
            taken += pods[:n]
            if not dry:
                del pods[:n]
            free -= n * size
        if free == 0:
            break
    used = offer.offer.gpus - free
    models = sorted({p.model for p in taken})
    hr = min(free, sum(headroom.get(m, 0) for m in models))
    if not dry:
        _spend_headroom(headroom, models, hr)
    return taken, used, hr


def _spend_headroom(headroom: dict[str, int], models: list[str], gpus: int) -> None:
    """Count ``gpus`` of slack against the models' headroom, in model order."""
    left = gpus
    for m in models:
        give = min(left, headroom.get(m, 0))
        headroom[m] = headroom.get(m, 0) - give
        left -= give


def _buy_headroom(queues: dict[tuple, dict[int, list[GpuPod]]], offer_objs: dict[str, _Offer],
                  headroom: dict[str, int], plan: DemandPlan) -> None:
    """Buy machines of their own for the headroom the pods' machines have no slack for."""
    # Headroom the pods' machines have no slack for gets machines of its own (the model's
    # cheapest qualifying offer).
    for key in queues:
        model = key[0]
        for offer_key in sorted(key[1], key=lambda k: (offer_objs[k].eff, k)):
            offer = offer_objs[offer_key]
            while headroom.get(model, 0) > 0 and offer.room > 0:
                hr = min(offer.offer.gpus, headroom[model])
                headroom[model] -= hr
                offer.room -= 1
                o = offer.offer
                plan.machines.append(PlannedMachine(
                    offer=offer.key, site=o.site, instance_type=o.instance_type, gpu=o.gpu, gpus=o.gpus,
                    capacity_type=o.capacity_type, price_per_gpu_hour=o.price_per_gpu_hour,
                    effective_price=round(offer.eff, 6), headroom_gpus=hr, model=model,
                    reason=f"warm headroom for {model}: {hr} spare GPUs, ${offer.eff:.2f}/GPU-h effective"))


def _downsize(opened: list[_Opened], offer_objs: dict[str, _Offer], pod_offers: dict[str, set[str]]) -> list[_Opened]:
    """Each machine moved to the cheapest offer that still holds what it got, where there is one."""
    # A machine opened early may end up holding less than it was chosen for: the cheapest
    # machine that still holds its pods (and that each of them accepts) replaces it.
    downsized = []
    for offer, taken, used, hr in opened:
        was_spot = offer.offer.capacity_type == CapacityType.SPOT
        options = [o for o in offer_objs.values()
                   if o.room > 0 and o.offer.gpus >= used + hr and o.machine_eff < offer.machine_eff - 1e-9
                   and all(o.key in pod_offers[p.key] for p in taken)
                   and (was_spot or o.offer.capacity_type != CapacityType.SPOT)]
        if options:
            better = min(options, key=lambda o: (o.machine_eff, o.key))
            better.room -= 1
            offer.room += 1
            offer, hr = better, min(hr, better.offer.gpus - used)
        downsized.append((offer, taken, used, hr))
    return downsized


#: A batch this small is packed exactly (branch and bound from the greedy plan); greedy
#: set cover alone was up to 40% dearer than the optimum on 6-pod batches (bench/demand.py).
EXACT_PODS = 10
#: Search steps the exact packing may take; past them it keeps the best plan found so far.
EXACT_STEPS = 40_000


def _improve_exactly(pods: list[GpuPod], greedy: list[_Opened], offer_objs: dict[str, _Offer],
                     pod_offers: dict[str, set[str]], spot_left: dict[str, float]) -> list[_Opened]:
    """The cheapest machines (effective $/h) that hold ``pods``, each where it qualifies, within
    each offer's room and each model's spot budget; ``greedy`` (already applied to the rooms and
    budgets) is the bound to beat and what is returned when nothing cheaper exists."""
    best_cost = sum(o.machine_eff for o, *_ in greedy)
    # Undo the greedy plan's use of rooms and spot budgets; the winner applies its own.
    spent: dict[str, float] = defaultdict(float)
    for offer, taken, _, _ in greedy:
        offer.room += 1
        if offer.offer.capacity_type == CapacityType.SPOT:
            for pod in taken:
                spent[pod.model] += pod.gpus
    budget = {m: spot_left[m] + spent.get(m, 0.0) for m in spot_left}
    order = sorted(pods, key=lambda p: (-p.gpus, p.created_at, p.key))
    choices = [sorted((offer_objs[k] for k in pod_offers[p.key] if k in offer_objs), key=lambda o: (o.eff, o.key))
               for p in order]
    search = _ExactSearch(order, choices, {k: o.room for k, o in offer_objs.items()}, dict(budget), best_cost)
    search.place(0, 0.0)
    best = search.best
    chosen = greedy if best is None else [(o, taken, sum(p.gpus for p in taken), 0) for o, taken in best]
    for offer, taken, _, _ in chosen:
        offer.room -= 1
        if offer.offer.capacity_type == CapacityType.SPOT:
            for pod in taken:
                budget[pod.model] -= pod.gpus
    spot_left.update(budget)
    return chosen


class _ExactSearch:
    """Branch and bound: each pod of ``order`` (largest first) goes into a machine already
    open or onto a new one of its ``choices`` (cheapest first), within ``room`` and the
    ``spot`` budgets; ``best`` is the cheapest complete plan under ``best_cost`` found."""

    def __init__(self, order: list[GpuPod], choices: list[list[_Offer]], room: dict[str, int],
                 spot: dict[str, float], best_cost: float) -> None:
        self.order, self.choices, self.room, self.spot = order, choices, room, spot
        self.cheapest = [c[0].eff if c else math.inf for c in choices]
        # bins: [offer, pods, free GPUs]
        self.bins: list[list] = []
        self.best: list[tuple[_Offer, list[GpuPod]]] | None = None
        self.best_cost = best_cost
        self.steps = 0

    def lower_bound(self, i: int, cost: float) -> float:
        need = sum(p.gpus for p in self.order[i:]) - sum(b[2] for b in self.bins)
        return cost + max(0, need) * min(self.cheapest[i:], default=0.0)

    def place(self, i: int, cost: float) -> None:
        """Place the pods from ``order[i]`` on, the machines so far costing ``cost``."""
        self.steps += 1
        if self.steps > EXACT_STEPS or self.lower_bound(i, cost) >= self.best_cost - 1e-9:
            return
        if i == len(self.order):
            self.best, self.best_cost = [(b[0], list(b[1])) for b in self.bins], cost
            return
        self._into_open_machine(i, cost)
        self._onto_new_machine(i, cost)

    def _into_open_machine(self, i: int, cost: float) -> None:
        pod, spot = self.order[i], self.spot
        allowed = {o.key for o in self.choices[i]}
        # Open machines of one offer with the same free GPUs lead to the same plans: try one.
        tried: set[tuple[str, int]] = set()
        for b in self.bins:
            offer = b[0]
            if b[2] < pod.gpus or offer.key not in allowed or (offer.key, b[2]) in tried:
                continue
            is_spot = offer.offer.capacity_type == CapacityType.SPOT
            if is_spot and spot.get(pod.model, math.inf) < pod.gpus:
                continue
            tried.add((offer.key, b[2]))
            b[1].append(pod)
            b[2] -= pod.gpus
            if is_spot:
                spot[pod.model] = spot.get(pod.model, math.inf) - pod.gpus
            self.place(i + 1, cost)
            if is_spot:
                spot[pod.model] += pod.gpus
            b[2] += pod.gpus
            b[1].pop()

    def _onto_new_machine(self, i: int, cost: float) -> None:
        pod, spot, room = self.order[i], self.spot, self.room
        for offer in self.choices[i]:
            is_spot = offer.offer.capacity_type == CapacityType.SPOT
            if room[offer.key] <= 0 or offer.offer.gpus < pod.gpus or (
                    is_spot and spot.get(pod.model, math.inf) < pod.gpus):
                continue
            room[offer.key] -= 1
            self.bins.append([offer, [pod], offer.offer.gpus - pod.gpus])
            if is_spot:
                spot[pod.model] = spot.get(pod.model, math.inf) - pod.gpus
            self.place(i + 1, cost + offer.machine_eff)
            if is_spot:
                spot[pod.model] += pod.gpus
            self.bins.pop()
            room[offer.key] += 1
