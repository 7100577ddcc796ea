"""Thin Temporal activities. ``control_plane_activities`` is what the
control-plane worker registers; add a new activity class to it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from activities.env import FleetEnv


def control_plane_activities(env: "FleetEnv") -> list[Callable]:
    from activities.capacity import CapacityActivities
    from activities.control_plane import ControlPlaneActivities
    from activities.demand import DemandActivities
    from activities.evacuation import EvacuationActivities
    from activities.ledger import LedgerActivities
    from activities.repair import RepairActivities
    from activities.routing import RoutingActivities
    from activities.serving import ServingActivities
    from activities.sweep import SweepActivities
    from activities.watches import WatchActivities
    from activities.weights import WeightsActivities

    classes = [ControlPlaneActivities, CapacityActivities, RepairActivities, WeightsActivities, ServingActivities,
               EvacuationActivities, SweepActivities, LedgerActivities, RoutingActivities, DemandActivities,
               WatchActivities]
    return [fn for cls in classes for fn in cls(env).all()]
