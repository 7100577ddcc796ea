"""AcquireCapacity's request and what it carries over continue-as-new.

Apart from the rest of ``capacity``: the workflows that start an AcquireCapacity take some of its
fields to pass on (``CapacityRequestFields``), ``SiteEvacuation`` among them, whose messages
``capacity`` imports.

What a request holds is defined before it: the request is complete once imported, so checking
one inside the workflow sandbox (``CapacityRequestFields``) has no model left to build there."""

from __future__ import annotations


from pydantic import BaseModel, Field

from fleet.models import DAY, MAX_REQUEST_COUNT, Carried, Name, Strict, Text, UtcDatetime, fields_of
from fleet.placement import AccountView, Constraints
from fleet.messages.join import JoinedNode, JoinTimeouts


class JoinAttempt(BaseModel):
    """One join tried at one offer (a repair's try at one rung is ``fleet.messages.repair.Attempt``)."""

    offer: str
    outcome: str
    message: str = ""


#: The joins a request keeps in its ``attempts`` (progress, result and carry): the newest. A request
#: may try for days (a ``NoCapacity`` answer each few minutes) and continue as new with them, and
#: each of those payloads is bounded at 2 MiB.
ATTEMPTS_KEPT = 50
#: ... each message cut to this (a failed join's, ending with the node's or provider's words).
ATTEMPT_MESSAGE_CHARS = 1000


class ExcludedOffer(BaseModel):
    offer: str
    until: UtcDatetime
    reason: str


class CapacityCarry(BaseModel):
    """What AcquireCapacity carries over continue-as-new. Taken only while it waits with no
    join in flight (for capacity, or to read the catalog again), so the joins it started are
    all in ``joined`` or ``attempts``."""

    deadline: UtcDatetime
    joined: list[JoinedNode] = Field(default_factory=list)
    #: node name → machine cost per hour (the spend cap counts them).
    costs: dict[str, float] = Field(default_factory=dict)
    attempts: list[JoinAttempt] = Field(default_factory=list)
    excluded: list[ExcludedOffer] = Field(default_factory=list)
    other_failures: int = 0
    #: Joins started so far: the next join's id continues the numbering.
    seq: int = 0
    backoff_seconds: float
    #: What the request saw of accounts whose store it could not tell (a failed report): kept over
    #: every catalog read, so a revoked account is not called again (``AcquireCapacity._not_told``).
    not_told: dict[str, AccountView] = Field(default_factory=dict)
    #: The first run continued as new before any catalog read went through: the request is still
    #: to be checked against the catalog (what no configured site can ever serve is refused).
    unchecked: bool = False


class Exclusion(Strict):
    offer: Name
    reason: Text = "excluded by the caller"
    seconds: float = Field(600, ge=0, le=30 * DAY)


class CapacityRequest(Strict):
    """Start with plain JSON: ``{"constraints": {"gpu": "H100"}, "count": 4}``."""

    constraints: Constraints = Field(default_factory=Constraints)
    count: int = Field(1, ge=1, le=MAX_REQUEST_COUNT)
    #: Give up (returning what joined) this long after the start.
    deadline_seconds: float = Field(3600, gt=0, le=30 * DAY)
    #: Joins in flight at once.
    concurrency: int = Field(4, ge=1, le=64)
    #: How long a NoCapacity answer keeps an offer out of the ranking. 0: until the request next reads
    #: the catalog, after its wait for capacity (the backoff, or a wake), never at once.
    unavailable_ttl_seconds: float = Field(180, ge=0, le=7 * DAY)
    #: Waiting for capacity: first backoff, doubling up to the max.
    backoff_seconds: float = Field(300, gt=0, le=DAY)
    max_backoff_seconds: float = Field(1800, gt=0, le=DAY)
    #: Failed joins for reasons other than the three provider errors (smoke test, registration) before giving up.
    max_other_failures: int = Field(3, ge=0, le=1000)
    catalog_max_age_seconds: float = Field(60, ge=0, le=DAY)
    exclude: list[Exclusion] = Field(default_factory=list, max_length=1000)
    join_timeouts: JoinTimeouts | None = None
    #: Ask the Site entity after each join (set by Site itself).
    reason: Text = ""
    #: Set by the workflow itself when it continues as new; never by a caller.
    carry: Carried[CapacityCarry | None] = None


#: Some of a ``CapacityRequest``'s fields, merged into the requests a workflow starts
#: (``join_timeouts``, ``backoff_seconds``; tests shorten them): a bad one is refused at the start.
CapacityRequestFields = fields_of(CapacityRequest)
