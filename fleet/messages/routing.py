"""The ``Routing`` entity's input, carried state, signals and activity payloads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleet.messages.watches import MAX_WATCH_SECONDS
from fleet.models import Carried, Name, Strict, Text, append_bounded
from fleet.routing import MAX_REASON, REASON_EVENTS, RoutingDocument, RoutingPolicy, SiteLoad, reason_for, shortened

DAY = 86400


class SiteOverride(Strict):
    """What site events said about one site, on top of what samples show."""

    healthy: bool = True
    draining: bool = False
    cap_percent: int = Field(100, ge=0, le=100)
    incident: Text = ""


def apply_override(load: SiteLoad, override: SiteOverride | None) -> SiteLoad:
    """A sampled site as the site events left it: the entity (deciding) and its watch (judging
    whether the entity would decide anything new) must agree, so both call this."""
    if override is None:
        return load
    return load.model_copy(update={
        "healthy": load.healthy and override.healthy,
        "draining": load.draining or override.draining,
        "cap_percent": min(load.cap_percent, override.cap_percent),
        "incident": override.incident or load.incident,
    })


class RoutingState(Strict):
    """Everything a ``Routing`` entity carries over continue-as-new."""

    overrides: dict[str, SiteOverride] = Field(default_factory=dict)
    document: RoutingDocument | None = None
    #: Site events taken, in all runs (the entity's details show it).
    events: int = Field(0, ge=0)
    #: Of those, how many the last written document reflects: a caller that saw ``events``
    #: reach n after its signal knows its event is in the routes once ``applied`` >= n.
    applied: int = Field(0, ge=0)
    #: Why a recompute is wanted (events since the last one, the latest ``REASON_EVENTS``: a
    #: reason names no more); empty: none pending. ``add_pending`` keeps it within its bounds,
    #: however many events arrive while a recompute waits on the cluster.
    pending: list[Text] = Field(default_factory=list, max_length=1000)
    #: Events since the last recompute older than those in ``pending``: counted, not kept.
    pending_earlier: int = Field(0, ge=0)

    def add_pending(self, event: str) -> None:
        self.pending_earlier += append_bounded(self.pending, shortened(event, MAX_REASON), REASON_EVENTS)

    def take_pending(self) -> str:
        """The reason for a recompute from the pending events, which it takes: none pending after."""
        reason = reason_for(self.pending, self.pending_earlier)
        self.pending, self.pending_earlier = [], 0
        return reason


class RoutingInput(Strict):
    """Start (or signal-with-start) ``routing/<model>``."""

    model: Name
    policy: RoutingPolicy = Field(default_factory=RoutingPolicy)
    #: The callers' geography, for the latency to each site (none: every site equally near).
    geography: str | None = Field(None, max_length=128)
    #: Load is looked at this often between events: by the entity's own timer and sample
    #: (runs from before ``routing-events``), since then inside its watch, in the worker (no action).
    sample_seconds: float = Field(30, gt=0, le=DAY)
    #: The watch returns unchanged after this long (the entity's safety look; ``routing-events``).
    watch_seconds: float = Field(1800, gt=0, le=MAX_WATCH_SECONDS)
    #: Set by the entity itself when it continues as new; never by a caller.
    state: Carried[RoutingState | None] = None


EventKind = Literal["incident", "restore", "rollout", "scale", "drain"]


class SiteEvent(Strict):
    """The ``site_event`` signal: something happened at a site that routing must reflect now.

    ``incident``/``drain`` take the site out (drain also moves its stuck sessions);
    ``restore`` puts it back (``cap_percent`` steps it back in); ``rollout``/``scale``
    only ask for a fresh sample (new or fewer Ready replicas)."""

    kind: EventKind
    site: Name
    detail: Text = ""
    cap_percent: int | None = Field(None, ge=0, le=100)


class SiteEventInput(Strict):
    """The ``routing_event`` activity: tell each model's entity (started if needed)."""

    event: SiteEvent
    #: The models to tell; empty: every model served at the site.
    models: list[Name] = Field(default_factory=list, max_length=10_000)
    #: Return only once each entity has written routes that reflect the event (an evacuation
    #: must not drain a site that new sessions still go to); 0: signal and return.
    wait_seconds: float = Field(0, ge=0, le=3600)


class RoutingModelInput(Strict):
    """``routing_model_problems``: whether a fresh Routing entity's model is one the fleet has."""

    model: Name


class RoutingSampleInput(Strict):
    model: Name
    geography: str | None = None


class RoutingSample(Strict):
    sites: list[SiteLoad] = Field(default_factory=list)


class RoutingWatchInput(Strict):
    """``watch_routing``: look at the model's load in the worker until the document the entity
    would write from a sample differs from ``previous`` (``next_document``, with the policy's
    hysteresis, over the sites as ``overrides`` leave them), or ``max_wait_seconds`` pass."""

    model: Name
    geography: str | None = Field(None, max_length=128)
    policy: RoutingPolicy = Field(default_factory=RoutingPolicy)
    overrides: dict[str, SiteOverride] = Field(default_factory=dict)
    #: The entity's current document (None: none yet, the first sample is a change).
    previous: RoutingDocument | None = None
    #: A sample this often while waiting (inside the activity: no action).
    look_seconds: float = Field(30, gt=0, le=DAY)
    #: Return unchanged after this long.
    max_wait_seconds: float = Field(1800, gt=0, le=MAX_WATCH_SECONDS)
    #: Return on a change no sooner than this: set by an entity whose last watch saw a change
    #: it did not (worker and workflow code out of step), so the two cannot spin.
    hold_seconds: float = Field(0, ge=0, le=MAX_WATCH_SECONDS)


class RoutingWatchResult(Strict):
    #: The last sample the watch took; the entity decides the document from it.
    sample: RoutingSample = Field(default_factory=RoutingSample)
    #: False: returned after ``max_wait_seconds`` with no change.
    changed: bool = False


class RoutingProgress(Strict):
    """The ``progress`` query: site events taken and reflected in the routes."""

    events: int = 0
    applied: int = 0
    version: int = 0
