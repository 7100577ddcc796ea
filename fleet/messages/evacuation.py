"""Inputs, results and queries of provider incidents: the Site entity's incident
state, repair admission, SiteEvacuation and its activities (one model each)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from fleet.incident import Failure, IncidentSettings, SiteFacts
from fleet.cluster import RoutingTable, ServingStatus


# -- repair admission (Node entity → Site entity) ---------------------------------------------
class AdmitRepairInput(BaseModel):
    site: str
    node_name: str
    gpu: int = 0
    reasons: list[str] = Field(default_factory=list)


class RepairDecision(BaseModel):
    #: True: start the repair. False: the site has (or just opened) an incident; hold.
    repair: bool
    incident: str = ""
    why: str = ""


class SiteRef(BaseModel):
    site: str


# -- the Site entity's incident state ---------------------------------------------------------
class IncidentRecord(BaseModel):
    id: str
    reason: str
    opened_at: datetime
    closed_at: datetime | None = None
    outcome: str = ""


class IncidentCarry(BaseModel):
    """What a Site entity carries over continue-as-new about incidents."""

    count: int = 0
    failures: list[Failure] = Field(default_factory=list)
    api_failing_since: float | None = None
    history: list[IncidentRecord] = Field(default_factory=list)


class IncidentView(BaseModel):
    """``status`` query: the incident part."""

    open: IncidentRecord | None = None
    failing: list[str] = Field(default_factory=list)
    threshold: int = 0
    site_nodes: int = 0
    api_failing_since: float | None = None
    history: list[IncidentRecord] = Field(default_factory=list)


class ProbeNode(BaseModel):
    name: str
    ready: bool = False
    unproven: bool = False
    unschedulable: bool = False
    machine_id: str = ""


class SiteProbe(BaseModel):
    nodes: list[ProbeNode] = Field(default_factory=list)
    #: The provider API answered (list machines).
    api_ok: bool = True
    api_error_type: str = ""
    api_error: str = ""


class HoldRepairsInput(BaseModel):
    site: str
    #: True: hold (finish the current rung, then wait); False: release.
    hold: bool = True


# -- SiteEvacuation ---------------------------------------------------------------------------
class SiteEvacuationInput(BaseModel):
    """Start with plain JSON: ``{"site": "lambda-us-east", "reason": "manual"}`` (the Site entity does)."""

    model_config = ConfigDict(extra="forbid")

    site: str = Field(min_length=1)
    reason: str = "provider incident"
    #: Overrides the site's incident settings (tests shorten timers); None = from the config.
    settings: IncidentSettings | None = None
    #: Merged into the AcquireCapacity request (e.g. join_timeouts, backoff_seconds).
    capacity_request: dict = Field(default_factory=dict)


class EvacuationFacts(BaseModel):
    site: SiteFacts
    #: Every site of the fleet (for compliance and geography).
    sites: list[SiteFacts] = Field(default_factory=list)
    settings: IncidentSettings
    #: Serving Deployments at the failed site and elsewhere.
    here: list[ServingStatus] = Field(default_factory=list)
    elsewhere: list[ServingStatus] = Field(default_factory=list)
    #: Routing before the evacuation: the site document and each model's table (None = none yet).
    site_routes: RoutingTable | None = None
    model_routes: dict[str, RoutingTable | None] = Field(default_factory=dict)
    nodes: list[ProbeNode] = Field(default_factory=list)


class SiteWeightInput(BaseModel):
    site: str
    #: Percent of each original weight (0 = no new sessions).
    percent: int = Field(ge=0, le=100)
    healthy: bool
    draining: bool
    incident: str = ""
    #: The site's weight in each model's table before the incident, and in the site document.
    original_models: dict[str, int] = Field(default_factory=dict)
    original_site: int = 100
    #: Sites every new document lists (weight 100 when they have no entry yet).
    all_sites: list[str] = Field(default_factory=list)


class SiteWeightResult(BaseModel):
    site_routes_version: int
    model_versions: dict[str, int] = Field(default_factory=dict)
    weights: dict[str, int] = Field(default_factory=dict)


class FreeGpusInput(BaseModel):
    sites: list[str]


class ScaleInput(BaseModel):
    model: str
    site: str
    replicas: int = Field(ge=0)


class UncordonInput(BaseModel):
    nodes: list[str]


class RecoveryProbe(BaseModel):
    recovered: bool
    detail: str = ""


class Step(BaseModel):
    name: str
    at: datetime
    detail: str = ""


class EvacuationProgress(BaseModel):
    site: str
    step: str = "starting"
    state: str = "evacuating"
    timeline: list[Step] = Field(default_factory=list)
    moves: dict[str, dict[str, int]] = Field(default_factory=dict)
    capacity_request: str = ""
    acquired: list[str] = Field(default_factory=list)
    drained: list[str] = Field(default_factory=list)
    needs_person: str = ""
    weights: dict[str, int] = Field(default_factory=dict)


class EvacuationResult(BaseModel):
    site: str
    outcome: str  # restored | aborted
    timeline: list[Step] = Field(default_factory=list)
