"""Every workflow the control-plane worker runs. Add a new workflow here."""

from workflows.account import ProviderAccount
from workflows.advisor import Advisor
from workflows.evacuation import SiteEvacuation
from workflows.capacity import AcquireCapacity, CatalogRefresh
from workflows.csr_approver import CsrApprover
from workflows.demand import Demand
from workflows.entity_update import EntityUpdate
from workflows.node import NodeEntity
from workflows.node_join import NodeJoin
from workflows.reclaim import SpotReclaim
from workflows.repair import GpuRepair
from workflows.rollout import ModelRollout
from workflows.routing import RoutingEntity
from workflows.site import SiteEntity, SiteSweep
from workflows.sweep import FleetSweep

ALL_WORKFLOWS = [
    NodeJoin, AcquireCapacity, CatalogRefresh, ProviderAccount, SiteEntity, SiteSweep, SpotReclaim,
    NodeEntity, GpuRepair, ModelRollout, SiteEvacuation, FleetSweep, Advisor, RoutingEntity, Demand,
    EntityUpdate, CsrApprover,
]
