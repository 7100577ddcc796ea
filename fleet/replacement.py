"""Where work from one site may go: compliance geography, one rule for every move.

A site with ``compliance: true`` keeps what runs there inside its ``geography``
(README, "compliance: true"): its replicas during an evacuation, the machine that
replaces a failed or reclaimed one. A site without it may go anywhere. Pure
functions (no Temporal, no I/O), deterministic, so workflows may call them too.
"""

from __future__ import annotations

from typing import Protocol, Sequence, TypeVar

# This rule imports no other fleet module: fleet.config imports fleet.incident, which imports
# it (pyproject.toml's acyclic contract keeps fleet's modules free of import circles).


class Located(Protocol):
    """What the rule needs of a site (``fleet.config.Site`` and ``incident.SiteFacts`` both are)."""

    name: str
    geography: str | None
    compliance: bool


S = TypeVar("S", bound=Located)


class Sold(Located, Protocol):
    """What ``replacement_sites`` reads of a site besides where it is (``fleet.config.Site``)."""

    gpu: str
    price_per_gpu_hour: float


R = TypeVar("R", bound=Sold)


def may_move(origin: Located, target: Located) -> bool:
    """Whether work of ``origin`` may run at ``target``: anywhere, unless ``origin`` is a
    compliance site; then only at a site of the same geography (none set: nowhere else)."""
    if not origin.compliance:
        return True
    return bool(origin.geography) and target.geography == origin.geography


def allowed_targets(origin: Located, candidates: Sequence[S]) -> list[S]:
    """The other sites among ``candidates`` that work of ``origin`` may move to, in their order."""
    return [s for s in candidates if s.name != origin.name and may_move(origin, s)]


def replacement_sites(origin: Sold, sites: Sequence[R]) -> list[str]:
    """Where a machine of ``origin`` is replaced: the same site first, then the other
    allowed sites selling the same GPU, cheapest per GPU-hour first (ties by name)."""
    others = sorted(
        (s for s in allowed_targets(origin, sites) if s.gpu == origin.gpu),
        key=lambda s: (s.price_per_gpu_hour, s.name),
    )
    return [origin.name, *(s.name for s in others)]

