"""Inputs and results of the capacity workflows and their activities (one model each)."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fleet.config import Site
from fleet.models import AccountState, Carried, DAY, EpochSeconds, MaybeName, Name, Offer, Strict, Text, UtcDatetime, fields_of
from fleet.placement import AccountView, Constraints
from fleet.messages.acquire import (  # noqa: F401 - moved to ``acquire``, still imported from here
    ATTEMPT_MESSAGE_CHARS, ATTEMPTS_KEPT, CapacityCarry, CapacityRequest, CapacityRequestFields, ExcludedOffer,
    Exclusion, JoinAttempt,
)
from fleet.messages.evacuation import EvacuationFields, IncidentCarry, IncidentView
from fleet.messages.join import JoinedNode


# -- activities -----------------------------------------------------------------------------
class GetCatalogInput(BaseModel):
    #: A stored catalog younger than this is used as is; older (or ``force``) is refreshed.
    max_age_seconds: float = 60
    force: bool = False


class CatalogRefreshInput(BaseModel):
    """CatalogRefresh takes nothing (or ``{}``): anything else is a mistake worth saying."""

    model_config = ConfigDict(extra="forbid")


class Catalog(BaseModel):
    offers: list[Offer] = Field(default_factory=list)
    sites: list[Site] = Field(default_factory=list)
    accounts: dict[str, AccountView] = Field(default_factory=dict)
    #: site → "Type: message" for sites whose offers could not be listed.
    errors: dict[str, str] = Field(default_factory=dict)
    refreshed_at: float = 0.0

    def offers_digest(self) -> str:
        """The offers as one value, the same for the same offers in any order: what a catalog
        refresh compares with the last one's to tell whether the waiting requests have news."""
        lines = sorted(json.dumps(o.model_dump(mode="json"), sort_keys=True) for o in self.offers)
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()


#: AcquireCapacity's ``FleetState`` while nothing can start: the requests a catalog refresh wakes.
WAITING_FOR_CAPACITY = "waiting-for-capacity"


class WakeRequestsInput(BaseModel):
    """Which waiting requests ``wake_waiting_requests`` wakes, and how they read the catalog then."""

    #: A catalog refresh's ``Catalog.offers_digest`` of what it listed: the requests are woken only
    #: when it differs from the last refresh's, and read the catalog as listed (no listing of their
    #: own). Empty (an account unblocked): every waiting request is woken and lists it again.
    offers_digest: str = ""


class ReportAccountInput(BaseModel):
    """Also the ProviderAccount ``report`` signal's payload."""

    account: Name
    kind: Literal["OverQuota", "BadCredentials"]
    offer: MaybeName = ""
    message: Text = ""


class AccountRecordInput(BaseModel):
    account: str
    provider: str
    state: AccountState
    blocked_offers: list[str] = Field(default_factory=list)
    reason: str = ""


class AccountInput(BaseModel):
    account: str


class QueuedDeletesInput(AccountInput):
    """``queued_deletes``' input: the account, and whether only the first ``MAX_QUEUED_DELETES_SHOWN``
    machines are wanted (``QueuedDeletes.machines`` bounded, ``count`` all of them), as a
    ProviderAccount run reads them: what lands in its history stays small however many are queued.
    False (every caller from before the field): every machine queued."""

    shown_only: bool = False


class AccountConfigInput(BaseModel):
    """A ProviderAccount entity's account and provider, to check against the fleet config."""

    account: str
    provider: str


class NotifyInput(BaseModel):
    subject: str
    workflow_id: str
    details: dict = Field(default_factory=dict)


class DrainNodeInput(BaseModel):
    node_name: str
    deadline_seconds: float = Field(ge=0)
    force: bool = False
    #: Who the cordon is marked as (``fleet.cluster.ANNOTATION_CORDONED_BY``); none: unmarked.
    cordoned_by: str | None = None
    #: The machine goes whoever holds the node (a spot reclaim): its pods are evicted even where
    #: someone else holds it, and its cordon is marked ``cordoned_by`` only where this drain is what
    #: cordons it. A node cordoned already (a person's ``kubectl cordon``, a repair's) keeps its
    #: cordon and mark as they are: the owner's cancel uncordons only its own.
    machine_goes: bool = False


class SiteNodesInput(BaseModel):
    site: str


class SiteNode(BaseModel):
    node_name: str
    machine_id: str = ""
    ready: bool = False
    unproven: bool = False
    registered_at: UtcDatetime | None = None
    price_per_gpu_hour: float = 0.0
    #: Who holds the node, where someone does (``activities.capacity.who_holds``): a repair that
    #: fenced a GPU of it, a person's cordon mark. Never chosen as a site's surplus. Empty: free
    #: (and in every result recorded before the field).
    held: str = ""
    #: Cordoned with the Site's own mark (``CORDONED_BY_SURPLUS``) and held by no one else: its
    #: retirement above the max left it so (a drain that blocked). False in every result recorded
    #: before the field.
    surplus_cordon: bool = False


class ReleaseCordonsInput(BaseModel):
    """Uncordon the nodes still cordoned with ``cordoned_by`` (their owner's mark) that no one else
    holds by now; any other is left as it is."""

    nodes: list[str]
    cordoned_by: str


class ChildNumberInput(BaseModel):
    """``incident_number``, ``fill_number``: the site, and the least number its Site entity's next
    incident (or fill) may take."""

    site: Name
    at_least: int = Field(1, ge=1)


class ChildNumber(BaseModel):
    """The number of a Site entity's incident (``evacuate/<site>/<n>``) or fill
    (``capacity/site-<site>-<n>``): one no run on record has, or (``running``) one whose run still
    runs, begun by an earlier run of the entity."""

    n: int
    running: bool = False


class FillRef(BaseModel):
    """``fill_end``: the Site entity's ``n``-th fill of ``site``."""

    site: Name
    n: int = Field(ge=1)


class SignalSitesInput(BaseModel):
    """Also SiteSweep's input."""

    model_config = ConfigDict(extra="forbid")

    sites: list[Name] = Field(default_factory=list, max_length=1000)  # empty: the Schedule's sweep of every site


class RetireMachineInput(BaseModel):
    site: str
    node_name: str
    machine_id: str
    #: The retiring owner's cordon mark (``fleet.cluster.ANNOTATION_CORDONED_BY``): set, a node
    #: someone else holds by now (a GPU fenced by its repair, another mark) is kept, not deleted.
    #: None: retired whoever holds it (its repair's own replace, a reclaim whose machine goes).
    cordoned_by: str | None = None


# -- workflows ------------------------------------------------------------------------------
class CapacityResult(BaseModel):
    requested: int
    nodes: list[JoinedNode] = Field(default_factory=list)
    complete: bool = False
    #: Why it was cancelled (the ``cancel`` update's reason); empty when it was not.
    cancelled: str = ""
    #: Why the rest did not join (empty when complete).
    why: list[str] = Field(default_factory=list)
    #: The newest joins tried (``ATTEMPTS_KEPT``).
    attempts: list[JoinAttempt] = Field(default_factory=list)
    cost_per_hour: float = 0.0


class CapacityProgress(BaseModel):
    step: str
    joined: int = 0
    requested: int = 0
    in_flight: list[str] = Field(default_factory=list)
    candidates: list[str] = Field(default_factory=list)
    rejected: list[str] = Field(default_factory=list)
    attempts: list[JoinAttempt] = Field(default_factory=list)
    #: While it waits: when it looks again (sooner when offers change) ...
    wait_until: UtcDatetime | None = None
    #: ... what it waits for (each qualifying offer it may not buy now, and who can change
    #: that), and when it gives up (returning what joined).
    waiting_for: list[str] = Field(default_factory=list)
    deadline: UtcDatetime | None = None
    #: The joins in flight by workflow id (``in_flight`` names their offers).
    joins: list[str] = Field(default_factory=list)
    #: Set once cancelled: why, and each join it stopped (its machine deleted by the join).
    cancelled: str = ""
    released: list[str] = Field(default_factory=list)
    #: Ended (done, partial, failed or cancelled): nothing more will be bought.
    finished: bool = False


#: The most queued deletes an account's status names (``AccountStatus.deletes_queued``); the count
#: is of them all.
MAX_QUEUED_DELETES_SHOWN = 20


class QueuedDelete(BaseModel):
    """A machine whose delete the account guard store holds queued (queued while the account was revoked)."""

    machine_id: str
    site: str = ""
    #: When (ISO, UTC) it was queued.
    queued_at: str = ""


class AccountStatus(BaseModel):
    account: str
    provider: str
    state: AccountState = AccountState.HEALTHY
    #: offer key → ISO time it was blocked.
    blocked_offers: dict[str, str] = Field(default_factory=dict)
    since: str = ""
    reason: str = ""
    history: list[str] = Field(default_factory=list)
    #: Webhook notifications that failed (each after its retries), and the last reason.
    notify_failures: int = 0
    notify_error: str = ""
    #: Since when (ISO) the deletes queued while the account was revoked are owed: a rotation was
    #: taken, but ``run_queued_deletes`` failed past its retries (a provider outage, a refusal), so
    #: their machines are still up. The entity tries them again until they run (not while the
    #: account is revoked again: the next rotation runs them). Empty: none owed (and in every status
    #: carried before the field).
    deletes_owed_since: str = ""
    #: While deletes are owed: why the last try failed, which try it was and when the next is.
    deletes_failing: str = ""
    #: The deletes the account guard store holds queued for the account (queued while it was
    #: revoked; their machines are still up, billed), oldest first, as the entity last read them
    #: (``deletes_queued_read``): at most ``MAX_QUEUED_DELETES_SHOWN`` of them; ``deletes_queued_count``
    #: counts them all. The entity reads the store while the account is revoked (again after a pause
    #: that doubles from 5 s to 5 minutes, from 5 s again when they changed), after a try of them
    #: failed, and in a run started afresh; they are gone once a try ran them. Carried over
    #: continue-as-new; empty in every status from before the fields (patch
    #: ``account-shows-queued-deletes``).
    deletes_queued: list[QueuedDelete] = Field(default_factory=list)
    deletes_queued_count: int = 0
    #: When (ISO, UTC) the entity last read them; empty: never.
    deletes_queued_read: str = ""
    #: A run started afresh whose read of the account guard store's record failed (patch
    #: ``account-started-afresh-takes-the-guard``) has not taken it yet: the loop reads the store again
    #: until a read lands, then takes it. Carried over continue-as-new (patch
    #: ``account-carries-the-guard-unread``), so the next run reads it too; False in every status from
    #: before the field (and once read).
    guard_unread: bool = False


class QueuedDeletes(BaseModel):
    """What the account guard store holds for an account, as a ProviderAccount run started afresh
    reads it (``queued_deletes``): the deletes queued while it was revoked that have not run, and the
    account's record there (its state, blocked offers)."""

    #: The machines whose delete is queued, oldest first: all of them, or, read with ``shown_only``
    #: (``QueuedDeletesInput``), the first ``MAX_QUEUED_DELETES_SHOWN``.
    machines: list[str] = Field(default_factory=list)
    #: How many are queued in all; None from a worker from before the field, whose ``machines``
    #: are all of them (``total``).
    count: int | None = None
    #: When (ISO, UTC) the oldest of them was queued; empty when none is.
    oldest: str = ""
    #: Whether the guard has the account revoked (then the next rotation runs them).
    revoked: bool = False
    #: The first ``MAX_QUEUED_DELETES_SHOWN`` of ``machines`` with their site and when each was
    #: queued (empty from a worker from before the field: ``machines`` and ``oldest`` say it then).
    queued: list[QueuedDelete] = Field(default_factory=list)
    #: The account as the guard holds it (what every activity enforces): its state, blocked offers,
    #: the reason given and since when (ISO, UTC; empty while healthy). A ProviderAccount run started
    #: afresh takes it as its own (patch ``account-started-afresh-takes-the-guard``). ``state`` is None
    #: from a worker from before the fields (``revoked`` says as much as it knows then).
    state: AccountState | None = None
    blocked_offers: list[str] = Field(default_factory=list)
    reason: str = ""
    since: str = ""

    @property
    def total(self) -> int:
        """How many deletes are queued in all (``count``; ``machines`` from a worker before it)."""
        return len(self.machines) if self.count is None else self.count


class ProviderAccountInput(Strict):
    account: Name
    provider: Name
    #: Set by the entity itself when it continues as new; never by a caller.
    status: Carried[AccountStatus | None] = None


class QuotaRaised(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Offer keys (site/instance-type) that sell again.
    offers: list[Name] = Field(default_factory=list, max_length=1000)
    #: Every blocked offer sells again. Explicit: no offers is a mistake (Temporal's HTTP API
    #: sends an empty list as null), never "all" (the ProviderAccount's validator refuses it).
    all: bool = False


class SiteInput(Strict):
    site: Name
    #: Set by the entity itself when it continues as new; never by a caller.
    state: Carried[SiteState | None] = None
    #: What runs before ``state`` carried (read when a run of theirs continues as new).
    nodes: Carried[dict[str, str]] = Field(default_factory=dict)
    fills: Carried[int] = Field(0, ge=0, le=10**9)
    #: Seconds between reconciles without a signal: a safety net, since the site's watch and its
    #: nodes' transitions wake it for every change (each reconcile is billed Temporal actions).
    reconcile_seconds: float = Field(1800, gt=0, le=DAY)
    #: Passed to the AcquireCapacity it starts (tests shorten them).
    fill_request: CapacityRequestFields = Field(default_factory=dict)
    drain_seconds: float = Field(300, ge=0, le=DAY)
    #: How long the config must go on not naming the site, with nothing left there, before its
    #: entity ends (looked at three times at least): longer than a rolling deploy, whose old
    #: worker may lack a site just added (tests shorten it).
    removed_seconds: float = Field(300, ge=0, le=DAY)
    #: Provider incidents: state carried by runs before ``state``, and fields merged into the
    #: SiteEvacuation input it starts (``settings``, ``capacity_request``; tests shorten them).
    incident: Carried[IncidentCarry | None] = None
    evacuation: fields_of(EvacuationFields) = Field(default_factory=dict)


class NodeTransition(BaseModel):
    """The Site entity's ``node_transition`` signal."""

    node_name: Name
    state: str = Field(min_length=1, max_length=64)
    machine_id: MaybeName = ""


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


class SiteState(BaseModel):
    """Everything a Site entity knows, carried whole over continue-as-new (the site's config
    is read again by each run; a fill or an evacuation in flight blocks continue-as-new)."""

    #: Nodes, min/max, what it is doing (``incident`` is filled in by the ``status`` query).
    status: SiteStatus
    #: Fills started so far: the next one's id continues the numbering.
    fills: int = 0
    #: A reconcile is due (a signal, a node's transition, a timer, an ended fill or evacuation).
    wanted: bool = True
    #: Nodes the last probe or reconcile counted: the incident rule's site size.
    node_count: int = 0
    incident: IncidentCarry = Field(default_factory=IncidentCarry)
    #: What the site's watch last returned: node → ``fleet.messages.watches.node_summary``
    #: (Ready or not, cordoned, proven). Carried: a transition across continue-as-new is seen.
    watched: dict[str, str] = Field(default_factory=dict)
    #: Fills in a row that failed (``workflows.site.FILL_PACED_PATCH``), when the next may start
    #: (epoch seconds; None: at once) and what the details say until then. Carried: a continue-as-new
    #: during the pause does not cut it.
    fills_failed: int = 0
    next_fill_at: float | None = None
    fill_failed: str = ""


class ReplacementRequest(CapacityRequest):
    """``SpotReclaimInput.replacement``: merged into the request for the replacement, whose
    ``constraints`` are these over the replacement rule's (null: the rule's alone)."""

    constraints: Constraints | None = None


class SpotReclaimInput(Strict):
    node_name: Name
    machine_id: MaybeName = ""
    site: Name
    #: When the provider takes the machine (epoch seconds).
    terminate_at: EpochSeconds
    #: How long the replacement avoids the reclaimed offer.
    exclude_seconds: float = Field(1800, ge=0, le=7 * DAY)
    replacement: fields_of(ReplacementRequest) = Field(default_factory=dict)


class SpotNotice(BaseModel):
    """SpotReclaim's ``notice`` signal: the node agent saw the provider's notice (again)."""

    model_config = ConfigDict(extra="forbid")

    terminate_at: EpochSeconds


class SpotReclaimResult(BaseModel):
    node_name: str
    drained: bool
    blocked: list[str] = Field(default_factory=list)
    replacement: CapacityResult | None = None
