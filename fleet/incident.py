"""Provider incidents (product rule 5): when many nodes at one site fail together
it is the provider, not N GPUs, so per-node repair stops there and the site is
evacuated.

Pure data and functions (no Temporal, no I/O): the Site entity and SiteEvacuation
call them deterministically and tests check them without a server.

The rule (per site, every number configurable in ``sites.yaml``)::

    trip when  distinct unhealthy-or-unreachable nodes whose failure was first seen
               inside the last ``window_seconds``  >=  max(min_nodes, ceil(fraction * site nodes))
    or when    every provider call for the site's account has failed as Transient
               for longer than ``api_failure_seconds``

Defaults 3 nodes / 30 % / 5 min. Anchors: Karpenter and EKS node auto-repair stop
repairing when more than 20 % of a pool is unhealthy; NVIDIA NVSentinel's breaker
trips at 50 % of nodes in 5 minutes; medik8s' NodeHealthCheck keeps at least 51 %
healthy. 30 % with a floor of 3 nodes sits between them, and the floor stops a
small site (2 nodes) from calling one bad GPU an incident. Unlike NVSentinel's
breaker, which a person resets, an incident here closes itself by proof: the
site's nodes answer again and pass smoke tests, then traffic returns in steps.

Compliance geography: a site with ``compliance: true`` (and a ``geography``) keeps
its replicas inside its geography; an evacuation never moves them out of it and
waits for a person when nothing compliant can take them.
"""

from __future__ import annotations

import math
from typing import Literal, Mapping

from pydantic import BaseModel, Field

from fleet import replacement
from fleet.models import SettingSeconds, Strict, setting_seconds


#: How often a watch looks (``check_seconds``, ``probe_seconds``): at most a day, the bound of the
#: watch inputs workflow code builds from it (``SiteWatchInput``, ``RecoveryWatchInput``). Longer is
#: refused in sites.yaml and taken as a day elsewhere: refused in that workflow code, it failed the
#: workflow task on every replay.
WatchSeconds = setting_seconds(24 * 3600, longest=24 * 3600)


class ControlPlaneSettings(Strict):
    """``control_plane:`` at the top of sites.yaml: what the fleet does when its control
    plane (Temporal, the control-plane worker) was away and comes back (static stability)."""

    #: After the control plane returns, a Site entity reconciles first: no repair is admitted and
    #: no incident opens at the site for this long (a finding waiting meanwhile is asked again).
    return_grace_seconds: float = Field(60, ge=0, le=3600)
    #: A Site entity wakes at least every ``check_seconds``; a gap longer than that plus this
    #: between two of its workflow tasks means nothing ran it: the control plane was away.
    absence_seconds: float = Field(30, gt=0, le=3600)
    #: A node's health observation older than this when it reaches its Node entity is ignored
    #: (it waited out an outage in flight); the next watch brings a fresh one.
    max_report_age_seconds: float = Field(120, gt=0, le=3600)


class IncidentSettings(Strict):
    """``incident:`` at the top of sites.yaml (every site) or on one site (replaces it for that site)."""

    #: False: never trip at this site (failures are always repaired one by one).
    enabled: bool = True
    #: Trip at max(min_nodes, ceil(fraction × site nodes)) failed nodes inside the window.
    min_nodes: int = Field(3, ge=1)
    fraction: float = Field(0.3, gt=0, le=1)
    window_seconds: SettingSeconds = Field(300, gt=0)
    #: Every provider call for the site's account failing as Transient this long also trips.
    api_failure_seconds: SettingSeconds = Field(600, gt=0)
    #: A repair request waits this long for other failures at the site before it is admitted
    #: (node agents report every few seconds, unsynchronized: a burst is seen over a few seconds).
    settle_seconds: SettingSeconds = Field(10, ge=0)
    #: How often the Site entity looks for unreachable nodes and probes the provider API.
    check_seconds: WatchSeconds = Field(30, gt=0)  # the site watch's ``api_check_seconds``
    #: SiteEvacuation: replicas elsewhere must be ready within this; nodes drain within drain_seconds.
    ready_seconds: SettingSeconds = Field(900, gt=0)
    drain_seconds: SettingSeconds = Field(300, ge=0)
    #: Replacement capacity: AcquireCapacity's deadline.
    capacity_deadline_seconds: SettingSeconds = Field(1800, gt=0)
    #: Recovery probe interval while the site is down.
    probe_seconds: WatchSeconds = Field(30, gt=0)  # the recovery watch's ``probe_seconds``
    #: SiteEvacuation probes inside one long activity (no Temporal action per probe) while its site
    #: is down and while nothing may take its replicas; that activity returns when the site is back
    #: or what nothing may take changes, else after this long (a fresh look, the details said again).
    recovery_watch_seconds: float = Field(1800, gt=0, le=3600)
    #: Routing weight comes back in these steps (percent of the weight before the incident) ...
    restore_steps: list[int] = Field(default_factory=lambda: [10, 50, 100], min_length=1)
    #: ... with this long between steps.
    bake_seconds: SettingSeconds = Field(300, ge=0)
    #: Smoke test on each node before the site serves again.
    smoke_test_seconds: SettingSeconds = Field(600, gt=0)
    #: Filled in from the top-level ``control_plane:`` block (``FleetConfig.incident_for``).
    control_plane: ControlPlaneSettings = Field(default_factory=ControlPlaneSettings)


class Failure(BaseModel):
    """One node seen unhealthy (a GPU fault asking for repair) or unreachable (NotReady)."""

    node: str
    #: Epoch seconds (workflow time) the failure was first seen.
    at: float
    kind: Literal["gpu", "unreachable"] = "gpu"
    detail: str = ""


class Verdict(BaseModel):
    trip: bool
    reason: str = ""
    #: Distinct nodes failed inside the window.
    failing: list[str] = Field(default_factory=list)
    threshold: int = 0


def trip_threshold(site_nodes: int, settings: IncidentSettings) -> int:
    """max(N, X % of the site), rounded up: 8 nodes at 30 % → max(3, 3) = 3; 20 nodes → 6."""
    share = math.ceil(settings.fraction * max(site_nodes, 0) - 1e-9)
    return max(settings.min_nodes, share)


def recent(failures: list[Failure], now: float, settings: IncidentSettings) -> list[Failure]:
    """Failures first seen inside the window (the rest no longer count)."""
    return [f for f in failures if 0 <= now - f.at <= settings.window_seconds]


def evaluate(
    failures: list[Failure],
    site_nodes: int,
    now: float,
    settings: IncidentSettings,
    api_failing_since: float | None = None,
) -> Verdict:
    """Whether the site is having a provider incident now."""
    threshold = trip_threshold(site_nodes, settings)
    failing = sorted({f.node for f in recent(failures, now, settings)})
    if not settings.enabled:
        return Verdict(trip=False, failing=failing, threshold=threshold, reason="incident detection disabled")
    if len(failing) >= threshold:
        # The window keeps the failures of nodes since replaced or removed (they count: the site lost
        # them), so ``failing`` can outnumber the nodes at the site now: then not "3 of 1 nodes".
        of = (f"{len(failing)} of {site_nodes} nodes" if len(failing) <= site_nodes else
              f"{len(failing)} nodes (more than the {site_nodes} at the site now: those since replaced or "
              "removed count too)")
        return Verdict(
            trip=True, failing=failing, threshold=threshold,
            reason=f"{of} unhealthy or unreachable within {settings.window_seconds:g}s (threshold {threshold})",
        )
    if api_failing_since is not None and now - api_failing_since >= settings.api_failure_seconds:
        return Verdict(
            trip=True, failing=failing, threshold=threshold,
            reason=f"every provider call failed (Transient) for {now - api_failing_since:.0f}s "
                   f"(limit {settings.api_failure_seconds:g}s)",
        )
    return Verdict(trip=False, failing=failing, threshold=threshold)


def record(failures: list[Failure], failure: Failure, now: float, settings: IncidentSettings) -> list[Failure]:
    """Add a failure unless the node already has one in the window; drop expired ones."""
    kept = recent(failures, now, settings)
    if any(f.node == failure.node for f in kept):
        return kept
    return [*kept, failure]


# -- the control plane's own absence ---------------------------------------------------------
def absence(last_seen: float | None, now: float, sleep_seconds: float, settings: ControlPlaneSettings) -> float:
    """Seconds the control plane was away, judged by a Site entity from its own timer: it began
    to sleep at ``last_seen`` for at most ``sleep_seconds``, and its next workflow task runs at
    ``now``. Later than that by more than ``absence_seconds``: nothing could run it. 0 otherwise.

    Its own clock, not a heartbeat elsewhere: a frozen Temporal server and a stopped control-plane
    worker both show as a gap, and no other component has to be up to tell."""
    if last_seen is None:
        return 0.0
    gap = now - last_seen
    return gap if gap > sleep_seconds + settings.absence_seconds else 0.0


def in_return_grace(returned_at: float | None, now: float, settings: ControlPlaneSettings) -> bool:
    """Still reconciling after the control plane came back: repairs and incidents wait."""
    return returned_at is not None and 0 <= now - returned_at < settings.return_grace_seconds


def count_unreachable(returned_at: float | None, now: float, settings: ControlPlaneSettings) -> bool:
    """Whether a NotReady node counts as a failure now. Not inside the return grace: nodes whose
    agents (or kubelets) could not reach the control plane look unreachable until they report
    again, and that is the control plane's outage, not their site's."""
    return not in_return_grace(returned_at, now, settings)


def forget_unreachable(failures: list[Failure], since: float) -> list[Failure]:
    """On return: drop the unreachable failures seen from ``since`` (the last task before the gap)
    on; they may be the outage's own shadow. GPU faults stay (a node reported them itself)."""
    return [f for f in failures if f.kind != "unreachable" or f.at < since]


# -- evacuation planning -------------------------------------------------------------------
class SiteFacts(BaseModel):
    """What the planner needs of one site."""

    name: str
    geography: str | None = None
    compliance: bool = False
    gpus_per_machine: int = 1
    price_per_gpu_hour: float = 0.0
    #: The site's configured most nodes (None in facts recorded before it: nothing to cap by).
    max_nodes: int | None = None


def incident_hold_reason(site: str, incident_id: str) -> str:
    """The reason the Site entity holds its site's repairs with while incident ``incident_id``
    (its evacuation's workflow id) is open; the release names the same reason."""
    return f"site {site}: provider incident {incident_id}"[:500]


def incident_of_hold(site: str, reason: str) -> str | None:
    """The incident (evacuation id) a hold of ``site``'s repairs was taken for, or None when the
    hold is not the Site entity's (an operator's, or another site's)."""
    prefix = incident_hold_reason(site, "")
    if not reason.startswith(prefix):
        return None
    return reason[len(prefix):] or None


def allowed_targets(failed: SiteFacts, candidates: list[SiteFacts]) -> list[SiteFacts]:
    """Where the failed site's replicas may go: any other site, or inside its
    geography when it is a compliance site (``fleet.replacement``, the one rule)."""
    return replacement.allowed_targets(failed, candidates)


class Deficit(BaseModel):
    model: str
    replicas: int = Field(ge=0)
    gpus_per_replica: int = Field(1, ge=0)
    #: Sites that may take this model's replicas (already have its Deployment, allowed by compliance).
    targets: list[str] = Field(default_factory=list)


class Plan(BaseModel):
    #: model → site → replicas to add there.
    moves: dict[str, dict[str, int]] = Field(default_factory=dict)
    #: model → replicas with no room yet.
    missing: dict[str, int] = Field(default_factory=dict)
    #: model → why nothing may take it (no allowed target at all).
    impossible: dict[str, str] = Field(default_factory=dict)

    def missing_gpus(self, deficits: list[Deficit]) -> int:
        per = {d.model: d.gpus_per_replica for d in deficits}
        return sum(n * per.get(m, 1) for m, n in self.missing.items())


def plan_moves(deficits: list[Deficit], free_gpus: dict[str, int], prefer: list[str] | None = None) -> Plan:
    """Place each model's missing replicas on its targets' free GPUs, the most free
    first (ties: ``prefer`` order, then name). Deterministic."""
    free = dict(free_gpus)
    order = {name: i for i, name in enumerate(prefer or [])}
    plan = Plan()
    for d in sorted(deficits, key=lambda d: (-d.replicas * max(d.gpus_per_replica, 1), d.model)):
        if d.replicas == 0:
            continue
        if not d.targets:
            plan.impossible[d.model] = "no other site may serve it (no Deployment there, or compliance)"
            plan.missing[d.model] = d.replicas
            continue
        left = d.replicas
        while left:
            room = [t for t in d.targets if free.get(t, 0) >= max(d.gpus_per_replica, 0) and
                    (d.gpus_per_replica > 0 or t in free)]
            if not room:
                break
            best = sorted(room, key=lambda t: (-free.get(t, 0), order.get(t, len(order)), t))[0]
            plan.moves.setdefault(d.model, {})
            plan.moves[d.model][best] = plan.moves[d.model].get(best, 0) + 1
            free[best] = free.get(best, 0) - d.gpus_per_replica
            left -= 1
        if left:
            plan.missing[d.model] = left
    return plan


def nodes_needed(missing_gpus: int, gpus_per_machine: int) -> int:
    return math.ceil(missing_gpus / max(gpus_per_machine, 1)) if missing_gpus > 0 else 0


def restore_percents(steps: list[int]) -> list[int]:
    """The percents traffic comes back through: each step kept within 1..100, in
    order, ending at 100 (10/50 → [10, 50, 100])."""
    return sorted({min(max(p, 1), 100) for p in steps} | {100})


def weight_at(original: int, percent: int) -> int:
    """A site's routing weight at ``percent`` of ``original``: 0 at 0 %; otherwise rounded
    up and at least 1, so a site on its way back always gets some traffic."""
    if original <= 0 or percent <= 0:
        return 0
    return max(1, math.ceil(original * min(percent, 100) / 100))


def restore_weights(original: int, steps: list[int]) -> list[int]:
    """The weights routing climbs back through: 100 with steps 10/50/100 → [10, 50, 100].
    Every step is at least 1 while the original is positive; the last is the original."""
    if original <= 0:
        return [0]
    return sorted({weight_at(original, p) for p in restore_percents(steps)})


# -- recovery -------------------------------------------------------------------------------
class Recovery(BaseModel):
    recovered: bool
    detail: str


def recovery(api_error: str | None, nodes_ready: Mapping[str, bool]) -> Recovery:
    """Whether a site is back: its provider API answers (``api_error`` None) and it has
    nodes, every one Ready (its agent reports again). Smoke tests come after this."""
    if api_error is not None:
        return Recovery(recovered=False, detail=f"provider API: {api_error}")
    if not nodes_ready:
        return Recovery(recovered=False, detail="no nodes at the site")
    down = sorted(name for name, ready in nodes_ready.items() if not ready)
    if down:
        return Recovery(recovered=False, detail=f"{len(down)} of {len(nodes_ready)} nodes not ready: "
                                                 f"{', '.join(down[:5])}{' …' if len(down) > 5 else ''}")
    return Recovery(recovered=True, detail=f"API answers, {len(nodes_ready)} nodes ready")
