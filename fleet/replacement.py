"""Where work from one site may go: compliance geography, one rule for every move.

A site with ``compliance: true`` keeps what runs there inside its ``geography``
(README, "compliance: true"): its replicas during an evacuation, the machine that
replaces a failed or reclaimed one. A site without it may go anywhere. Pure
functions (no Temporal, no I/O), deterministic, so workflows may call them too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, TypeVar

if TYPE_CHECKING:  # fleet.config imports fleet.incident, which imports this rule
    from fleet.config import Site
    from fleet.placement import Constraints


class Located(Protocol):
    """What the rule needs of a site (``fleet.config.Site`` and ``incident.SiteFacts`` both are)."""

    name: str
    geography: str | None
    compliance: bool


S = TypeVar("S", bound=Located)


def may_move(origin: Located, target: Located) -> bool:
    """Whether work of ``origin`` may run at ``target``: anywhere, unless ``origin`` is a
    compliance site; then only at a site of the same geography (none set: nowhere else)."""
    if not origin.compliance:
        return True
    return bool(origin.geography) and target.geography == origin.geography


def allowed_targets(origin: Located, candidates: Sequence[S]) -> list[S]:
    """The other sites among ``candidates`` that work of ``origin`` may move to, in their order."""
    return [s for s in candidates if s.name != origin.name and may_move(origin, s)]


def replacement_sites(origin: Site, sites: Sequence[Site]) -> list[str]:
    """Where a machine of ``origin`` is replaced: the same site first, then the other
    allowed sites selling the same GPU, cheapest per GPU-hour first (ties by name)."""
    others = sorted(
        (s for s in allowed_targets(origin, sites) if s.gpu == origin.gpu),
        key=lambda s: (s.price_per_gpu_hour, s.name),
    )
    return [origin.name, *(s.name for s in others)]


def replacement_constraints(origin: Site) -> Constraints:
    """What an AcquireCapacity for a replacement of an ``origin`` machine may buy: the
    same GPU and GPUs per machine, inside ``origin``'s geography when it is a compliance
    site (SpotReclaim's replacement)."""
    from fleet.placement import Constraints

    return Constraints(
        gpu=origin.gpu, gpus_per_machine=origin.gpus_per_machine,
        geographies=[origin.geography] if origin.compliance and origin.geography else None,
        sites=[origin.name] if origin.compliance and not origin.geography else None,
    )
