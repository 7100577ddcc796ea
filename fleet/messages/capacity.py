"""Inputs and results of the capacity workflows and their activities (one model each)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fleet.config import Site
from fleet.models import AccountState, Offer
from fleet.placement import AccountView, Constraints
from fleet.messages.evacuation import IncidentCarry, IncidentView
from fleet.messages.join import JoinedNode, JoinTimeouts


# -- activities -----------------------------------------------------------------------------
class GetCatalogInput(BaseModel):
    #: A stored catalog younger than this is used as is; older (or ``force``) is refreshed.
    max_age_seconds: float = 60
    force: bool = False


class Catalog(BaseModel):
    offers: list[Offer] = Field(default_factory=list)
    sites: list[Site] = Field(default_factory=list)
    accounts: dict[str, AccountView] = Field(default_factory=dict)
    #: site → "Type: message" for sites whose offers could not be listed.
    errors: dict[str, str] = Field(default_factory=dict)
    refreshed_at: float = 0.0


class ReportAccountInput(BaseModel):
    account: str
    kind: Literal["OverQuota", "BadCredentials"]
    offer: str = ""
    message: str = ""


class AccountRecordInput(BaseModel):
    account: str
    provider: str
    state: AccountState
    blocked_offers: list[str] = Field(default_factory=list)
    reason: str = ""


class AccountInput(BaseModel):
    account: str


class NotifyInput(BaseModel):
    subject: str
    workflow_id: str
    details: dict = Field(default_factory=dict)


class DrainNodeInput(BaseModel):
    node_name: str
    deadline_seconds: float = Field(ge=0)
    force: bool = False


class SiteNodesInput(BaseModel):
    site: str


class SiteNode(BaseModel):
    node_name: str
    machine_id: str = ""
    ready: bool = False
    unproven: bool = False
    registered_at: datetime | None = None
    price_per_gpu_hour: float = 0.0


class SignalSitesInput(BaseModel):
    sites: list[str] = Field(default_factory=list)  # empty: every site in the config


class RetireMachineInput(BaseModel):
    site: str
    node_name: str
    machine_id: str


# -- workflows ------------------------------------------------------------------------------
class Exclusion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    offer: str
    reason: str = "excluded by the caller"
    seconds: float = Field(600, ge=0)


class CapacityRequest(BaseModel):
    """Start with plain JSON: ``{"constraints": {"gpu": "H100"}, "count": 4}``."""

    model_config = ConfigDict(extra="forbid")

    constraints: Constraints = Field(default_factory=Constraints)
    count: int = Field(1, ge=1, le=256)
    #: Give up (returning what joined) this long after the start.
    deadline_seconds: float = Field(3600, gt=0)
    #: Joins in flight at once.
    concurrency: int = Field(4, ge=1, le=64)
    #: How long a NoCapacity answer keeps an offer out of the ranking.
    unavailable_ttl_seconds: float = Field(180, ge=0)
    #: Waiting for capacity: first backoff, doubling up to the max.
    backoff_seconds: float = Field(300, gt=0)
    max_backoff_seconds: float = Field(1800, gt=0)
    #: Failed joins for reasons other than the three provider errors (smoke test, registration) before giving up.
    max_other_failures: int = Field(3, ge=0)
    catalog_max_age_seconds: float = Field(60, ge=0)
    exclude: list[Exclusion] = Field(default_factory=list)
    join_timeouts: JoinTimeouts | None = None
    #: Ask the Site entity after each join (set by Site itself).
    reason: str = ""


class Attempt(BaseModel):
    offer: str
    outcome: str
    message: str = ""


class CapacityResult(BaseModel):
    requested: int
    nodes: list[JoinedNode] = Field(default_factory=list)
    complete: bool = False
    #: Why the rest did not join (empty when complete).
    why: list[str] = Field(default_factory=list)
    attempts: list[Attempt] = Field(default_factory=list)
    cost_per_hour: float = 0.0


class CapacityProgress(BaseModel):
    step: str
    joined: int = 0
    requested: int = 0
    in_flight: list[str] = Field(default_factory=list)
    candidates: list[str] = Field(default_factory=list)
    rejected: list[str] = Field(default_factory=list)
    attempts: list[Attempt] = Field(default_factory=list)
    wait_until: datetime | None = None


class AccountStatus(BaseModel):
    account: str
    provider: str
    state: AccountState = AccountState.HEALTHY
    #: offer key → ISO time it was blocked.
    blocked_offers: dict[str, str] = Field(default_factory=dict)
    since: str = ""
    reason: str = ""
    history: list[str] = Field(default_factory=list)


class ProviderAccountInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    account: str
    provider: str
    status: AccountStatus | None = None


class QuotaRaised(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Offer keys (site/instance-type); empty = every blocked offer.
    offers: list[str] = Field(default_factory=list)


class SiteInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    site: str
    #: Carried over continue-as-new.
    nodes: dict[str, str] = Field(default_factory=dict)
    fills: int = 0
    #: Seconds between reconciles without a signal.
    reconcile_seconds: float = Field(300, gt=0)
    #: Passed to the AcquireCapacity it starts (tests shorten them).
    fill_request: dict = Field(default_factory=dict)
    drain_seconds: float = Field(300, ge=0)
    #: Provider incidents: state carried over continue-as-new, and fields merged into the
    #: SiteEvacuation input it starts (``settings``, ``capacity_request``; tests shorten them).
    incident: IncidentCarry | None = None
    evacuation: dict = Field(default_factory=dict)


class NodeTransition(BaseModel):
    node_name: str
    state: str
    machine_id: str = ""


class SiteStatus(BaseModel):
    site: str
    min_nodes: int = 0
    max_nodes: int = 0
    nodes: dict[str, str] = Field(default_factory=dict)
    filling: str = ""
    retiring: list[str] = Field(default_factory=list)
    last: str = ""
    #: Provider incidents (fleet.incident): the open one, failures in the window, past ones.
    incident: IncidentView | None = None


class SpotReclaimInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_name: str
    machine_id: str = ""
    site: str
    #: When the provider takes the machine (epoch seconds).
    terminate_at: float
    #: How long the replacement avoids the reclaimed offer.
    exclude_seconds: float = Field(1800, ge=0)
    replacement: dict = Field(default_factory=dict)


class SpotReclaimResult(BaseModel):
    node_name: str
    drained: bool
    blocked: list[str] = Field(default_factory=list)
    replacement: CapacityResult | None = None
