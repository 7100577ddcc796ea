"""Input and result of the Advisor workflow, and the usage ledger's entries it reads."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints, field_validator

from fleet.models import CapacityType, EpochSeconds, Name, Strict
from fleet.placement import Constraints

#: ``7d``, ``36h``, ``2w``: how far back the report looks (a week by default).
Period = Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]{0,3}[hdw]$")]
#: More models than this in one request is a mistake, not a fleet.
MAX_WORKLOADS = 500


class AdvisorInput(Strict):
    """Advisor (id ``advisor/<since>``); everything optional: ``{}`` reports the last 7 days."""

    since: Period = "7d"
    #: End of the period (epoch seconds); default: when the workflow runs.
    until: EpochSeconds | None = None
    #: A model's own placement constraints (GPU product or class, memory, geography,
    #: capacity types, max price); a model not named gets its site's GPU and memory.
    #: A compliance site's geography always applies, whatever is asked.
    constraints: dict[Name, Constraints] = Field(default_factory=dict, max_length=MAX_WORKLOADS)
    #: Machine-hours one spot reclaim costs at the reclaimed offer's price: the replacement's
    #: join and warm-up, bought while the reclaimed machine no longer serves.
    reclaim_cost_hours: float = Field(1.0, ge=0, le=48)

    @field_validator("constraints")
    @classmethod
    def _no_spend_cap(cls, value: dict[str, Constraints]) -> dict[str, Constraints]:
        # A per-request $/h cap means nothing for GPU-hours already used; say so rather than ignore it.
        for model, c in value.items():
            if c.spend_cap_per_hour is not None:
                raise ValueError(f"{model}: spend_cap_per_hour does not apply to the advisor; use "
                                 "max_price_per_gpu_hour")
        return value


class LedgerEntry(BaseModel):
    """One machine as the usage ledger knows it (activities/ledger.py)."""

    machine_id: str
    site: str
    node_name: str = ""
    provider: str = ""
    #: The instance type bought (with ``site``, the offer key).
    offer: str = ""
    gpu: str = ""
    gpus: int = 0
    gpu_memory_gb: int = 0
    price_per_gpu_hour: float = 0.0
    capacity_type: CapacityType = CapacityType.ON_DEMAND
    #: The offer's interruption risk when it joined (spot).
    interruption_risk: float = 0.0
    #: None: its join was not recorded (deleted before admission, or before the ledger).
    joined_at: float | None = None
    retired_at: float | None = None
    reclaimed: bool = False


class Workload(BaseModel):
    """A model's Deployment at a site, as the cluster serves it now."""

    model: str
    site: str
    replicas: int = 0
    gpus_per_replica: int = 0


class Usage(BaseModel):
    """What ``read_usage`` returns: the ledger's machines and the workloads served now."""

    entries: list[LedgerEntry] = Field(default_factory=list)
    workloads: list[Workload] = Field(default_factory=list)


class WorkloadAdvice(BaseModel):
    model: str
    site: str
    gpu_hours: float
    #: Net cost of the period where it ran: billed, spot made dearer by its risk, plus its reclaims.
    now: float
    advised: float
    saving: float
    #: Offer key (``site/instance_type``) of the advised placement; the current one to stay.
    advised_offer: str
    advised_site: str
    #: The current offer; empty when the workload's machines were not all of one offer.
    current_offer: str = ""
    #: False when the current placement breaks the workload's own constraints.
    current_qualifies: bool = True
    reclaims: int = 0
    #: Why each offer listed cheaper per GPU-hour than the current net price was not advised.
    rejected: list[str] = Field(default_factory=list)
    note: str = ""


class SiteRate(BaseModel):
    site: str
    now_per_hour: float = 0.0
    advised_per_hour: float = 0.0


class AdvisorReport(BaseModel):
    since: str
    start: float
    end: float
    hours: float
    workloads: list[WorkloadAdvice] = Field(default_factory=list)
    sites: list[SiteRate] = Field(default_factory=list)
    now: float = 0.0
    advised: float = 0.0
    saving: float = 0.0
    #: site -> why its offers could not be listed (the report then advises from the rest).
    catalog_errors: dict[str, str] = Field(default_factory=dict)
    markdown: str = ""
