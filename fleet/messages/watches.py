"""Inputs and results of the event watches (``activities.watches``): the long-running activities
that return only when something the entity acts on changed, so an idle fleet costs Temporal
almost nothing (issue 37: every activity, timer, signal and heartbeat is a billed action).

- ``watch_site``: a Site entity's nodes in the cluster (a real watch: list, then watch from the
  list's resourceVersion, listed again on ``410 Gone``) and its provider's API; returns when a
  node is added, removed, turns Ready or NotReady, is cordoned or proven, or the API's answer
  changes.
- ``watch_demand_events``: the Demand loop's Pending GPU pods (a watch on pods), its purchases in flight
  and which nodes hold GPU pods (what consolidation reads).
- ``watch_csrs``: kubelet CSRs waiting for a decision (a watch on CSRs).
- ``watch_recovery``: a SiteEvacuation's site while it is down: its recovery probe (the provider
  API, every node Ready) every ``probe_seconds`` inside the activity, and in the needs-person wait
  which of its models nothing may take.

Each is level-triggered, like the Node entity's ``watch_node``: the caller passes what it last
saw, and the watch returns at once when the world already differs (a run that continued as new
loses nothing).
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, Field

from fleet.messages.demand import DemandBatch
from fleet.messages.evacuation import ProbeNode
from fleet.models import DAY, Name, Strict

#: The longest any watch waits before it returns unchanged (its caller's safety look).
MAX_WATCH_SECONDS = 3600.0


def node_summary(node: ProbeNode) -> str:
    """What a Site entity acts on of one node (a change of it ends the site's watch): Ready or
    not, cordoned, still being proven. Nothing the kubelet rewrites on every status post."""
    words = ["ready" if node.ready else "not-ready"]
    if node.unschedulable:
        words.append("cordoned")
    if node.unproven:
        words.append("unproven")
    return ",".join(words)


# -- watch_site -----------------------------------------------------------------------------
class SiteWatchInput(Strict):
    site: Name
    #: node name → ``node_summary`` as the entity last saw it (empty: return at once).
    known: dict[str, str] = Field(default_factory=dict, max_length=100_000)
    #: The provider API's last answer the entity has (None: not looked yet, return at once).
    api_ok: bool | None = None
    api_error_type: str = Field("", max_length=200)
    #: Return unchanged after this long.
    max_wait_seconds: float = Field(300, gt=0, le=MAX_WATCH_SECONDS)
    #: Look at the provider API this often while waiting (inside the activity: no action).
    api_check_seconds: float = Field(30, gt=0, le=DAY)
    #: The simulated cluster has no watch: it is looked at this often (a real watch ignores it).
    poll_seconds: float = Field(1.0, gt=0, le=60)
    #: Nobody watched for longer than this (the watcher's process stopped, or its attempt was
    #: lost): return at once and say so (``paused_seconds``), the control plane was away.
    absence_seconds: float = Field(30, gt=0, le=3600)
    #: The public placement labels (``fleet.demand.PUBLIC_PLACEMENT_LABELS``) the entity keeps on
    #: its nodes, from the site's config as its run read it. Every node's are put back at once
    #: when they differ from the config's; where the config says what the entity says (empty: an
    #: entity that does not ask), a node that changed its own returns the watch (``self_labelled``).
    placement: dict[str, str] = Field(default_factory=dict, max_length=16)
    #: Nodes already reported as self-labelled to this run: put back, not reported again.
    reported: list[str] = Field(default_factory=list, max_length=100_000)


class SiteWatchResult(BaseModel):
    nodes: list[ProbeNode] = Field(default_factory=list)
    api_ok: bool = True
    api_error_type: str = ""
    api_error: str = ""
    #: False: returned after ``max_wait_seconds`` with what the entity already knew.
    changed: bool = False
    #: When the watcher saw what it returns (epoch seconds, the worker's clock): a result the
    #: entity takes much later waited out a control-plane outage in flight.
    observed_at: float = 0.0
    #: How late the watcher's own clock ran (its process frozen), or how long nobody watched
    #: (a retried attempt, since the last heartbeat of the one that was lost): seconds.
    paused_seconds: float = 0.0
    #: Nodes that changed their own placement labels (put back already): node → ``key=value`` it set.
    self_labelled: dict[str, list[str]] = Field(default_factory=dict)


# -- watch_demand_events ---------------------------------------------------------------------------
#: The new Pending pods one ``DemandWake`` names. A pod's key is up to 317 characters (a 63-character
#: namespace, a 253-character name), so 1,000 keys stay under 320 KB of the 2 MiB result. Past it
#: the batch names the first 1,000 by key and the pass is the same: the plan lists every Pending pod
#: itself (``plan_demand``), so the rest are planned (bought for, covered or unplaceable) in that
#: pass too, and the next watch knows them; only the log's lines name the first ones.
MAX_NEW_PODS = 1000
#: The nodes holding GPU pods one ``DemandWake`` names (``busy``), the first by name: a node's name
#: is up to 253 characters, 2,000 of them 500 KB. Past it a node beyond the first 2,000 that goes
#: idle does not end the watch: the next consolidating pass (an idle node's TTL, the safety look
#: after ``wait_seconds``, an ended purchase) finds it. Mirror pods make no node busy.
MAX_BUSY_NODES = 2000


class DemandWatchInput(Strict):
    #: Pods the loop already has an answer for (bought, covered, unplaceable): no wake-up.
    known: list[str] = Field(default_factory=list)
    batch_idle_seconds: float = Field(1.0, ge=0, le=600)
    batch_max_seconds: float = Field(10.0, ge=0, le=3600)
    #: Return after this long even with nothing new (the loop's safety look, or an idle node's TTL).
    wait_seconds: float = Field(600, ge=0, le=DAY)
    #: The pods the purchases in flight were bought for: return when one of them is gone.
    tracked: list[str] = Field(default_factory=list)
    #: Those of ``tracked`` the loop already saw gone (a purchase's pod deleted while the others it
    #: was bought for wait on it): their absence returns nothing, else every watch after it returned
    #: at once, for as long as the purchase bought (a watch and a ``purchase_status`` each time, some
    #: 40 a second). One back (a pod made again under its name) is ``present`` again.
    gone: list[str] = Field(default_factory=list)
    #: The purchases in flight (AcquireCapacity ids): return when one of them is no longer running.
    #: Each is waited on with Temporal's long poll on its close event: the watch returns as it closes.
    purchases: list[str] = Field(default_factory=list)
    #: Nodes with a GPU pod as the loop last saw them: return when that changes (a node went idle
    #: or got its first pod). None: not compared (the loop looks at idle nodes anyway).
    busy: list[str] | None = None
    #: A purchase's long poll that Temporal did not answer (away, a deadline) is asked again after
    #: this long (before the long poll, the purchases were described this often).
    purchase_check_seconds: float = Field(5.0, gt=0, le=600)
    #: The simulated cluster has no watch: it is looked at this often (a real watch ignores it).
    poll_seconds: float = Field(0.2, gt=0, le=60)


class DemandWake(BaseModel):
    """What the loop acts on, never a list a node can grow: no mirror pod is in it, and each list
    is bounded, so the result stays far under Temporal's 2 MiB payload limit (a result over it
    fails the activity, and every pass with it)."""

    #: ``new``: at most ``MAX_NEW_PODS``; ``present``: only the pods of ``tracked`` still there
    #: (the purchases' pods, at most what the loop sent), not every GPU pod of the cluster.
    batch: DemandBatch = Field(default_factory=DemandBatch)
    #: Why the watch returned: "pods", "pods gone", "purchase ended", "idle", "timeout".
    why: str = "timeout"
    #: Nodes with a GPU pod now, mirror pods left out, at most ``MAX_BUSY_NODES`` (the next watch's ``busy``).
    busy: list[str] = Field(default_factory=list)


# -- watch_csrs -----------------------------------------------------------------------------
#: An old watch's result named the newest this many open CSRs (``pending``), which its caller
#: handed the next watch (``known``): up to 125 KB each way, every round, in ``CsrApprover``'s
#: history. Still honoured for one release, for a watch in flight at the deploy; then it goes.
CSRS_NAMED = 500
#: The open CSRs a watch remembers (``CsrMark``, what it returns and its caller hands the next
#: watch), the newest, by a digest each: a node's kubelet (or a bootstrap token) may post CSRs at
#: will, thousands, each name up to 253 characters, and the mark goes into the approver's history
#: twice a round. Some 500 bytes, whatever nodes post.
CSRS_MARKED = 32
#: Hex characters of a CSR's digest (``csr_digest``): 48 bits, so two open CSRs' digests collide
#: with odds of one in billions, and each is of the API server's creation time too, which no node
#: can aim at. A collision only makes the watch sleep through that new CSR until the next wakes it
#: (or the safety sweep).
CSR_DIGEST_CHARS = 12
#: A CSR watch that sees a new CSR returns no sooner than its ``pace_seconds`` after it began,
#: which is when the approver's pass before it ended: CSRs that keep coming (a node posting them by
#: the hundred) get one pass per pace at most. Each woke a pass of its own, two activities in
#: ``CsrApprover``'s history, which some 340 filled: the run ended, and no approver ran until the
#: Schedule's next start, up to ten minutes later. This is the pace while passes approve.
CSR_PACE_SECONDS = 10.0
#: While its passes approve nothing (a flood of junk: a node, or a bootstrap token, may post CSRs
#: at will) ``CsrApprover`` doubles its watch's pace up to this: a run's day holds 288 watches,
#: where 340 filled its history. Every pass decides every open CSR, so a genuine kubelet's CSR
#: posted during a flood waits one paced watch (and a pass or two) at most: half the ten minutes
#: the safety sweep alone would take (workflows/csr_approver.py says why that is soon enough).
CSR_FLOOD_PACE_SECONDS = 300.0


def csr_digest(created: str, name: str) -> str:
    """A CSR's digest: of its creation time too, so one deleted and posted again later is new."""
    return hashlib.sha256(f"{created} {name}".encode()).hexdigest()[:CSR_DIGEST_CHARS]


class CsrMark(BaseModel):
    """The open CSRs a watch saw when it returned (under a signer gpufleet judges, oldest first by
    creation, then name), in some 500 bytes however many there were: a digest of each of the newest
    ``CSRS_MARKED``, and the creation time of the oldest of those. The next watch counts an open CSR
    as seen if its digest is here or, where more were open than it names, if it was created no later
    than ``since``: a CSR is open from its creation until it is denied or fails, which the API server
    does not take back, so an older one open now was open at the look, and one created after the
    look is no older than any the look saw (the API server stamps creation, in whole seconds). While
    at most ``CSRS_MARKED`` are open the mark is exact, as the names were, and a CSR gone wakes
    nothing; past that, only one posted in the very second of the oldest it names (a flood of dozens
    a second) may be taken as seen, and the flood's next CSR, or the safety sweep, wakes the pass
    that decides it. (A lenient model, not ``Strict``: the workflow decodes it from a result.)"""

    #: ``csr_digest`` of each of the newest open CSRs.
    digests: list[str] = Field(default_factory=list, max_length=CSRS_MARKED)
    #: More CSRs were open than ``digests`` names ...
    cut: bool = False
    #: ... and the oldest it names was created then (``metadata.creationTimestamp``; "" none open).
    since: str = Field("", max_length=64)

    @classmethod
    def of(cls, open_csrs: list[tuple[str, str]]) -> "CsrMark":
        """The mark of the open CSRs, each (creation time, name), oldest first."""
        newest = open_csrs[-CSRS_MARKED:]
        return cls(digests=sorted(csr_digest(created, name) for created, name in newest),
                   cut=len(open_csrs) > len(newest), since=newest[0][0] if newest else "")

    def seen(self, created: str, name: str) -> bool:
        return csr_digest(created, name) in self.digests or (self.cut and created <= self.since)


class CsrWatchInput(Strict):
    #: What the last watch saw open (its result's ``mark``): a CSR it saw wakes nothing. None: an
    #: input from before the mark (a watch in flight at the deploy), which ``known`` says.
    mark: CsrMark | None = None
    #: Before the mark: the last watch's ``pending`` (open CSRs by name); read only without a mark.
    known: list[str] = Field(default_factory=list, max_length=100_000)
    #: ``known`` is the newest of them only (the last watch's ``pending``, cut): an open CSR older
    #: than the oldest of ``known`` still open is known too.
    known_cut: bool = False
    max_wait_seconds: float = Field(600, gt=0, le=MAX_WATCH_SECONDS)
    #: Having seen a new CSR, the watch returns no sooner than this after it began (an input
    #: recorded before the field: the base pace, as its watch had).
    pace_seconds: float = Field(CSR_PACE_SECONDS, gt=0, le=CSR_FLOOD_PACE_SECONDS)


class CsrWatchResult(BaseModel):
    #: The CSRs under a signer gpufleet judges still open when the watch returned: neither Denied
    #: nor Failed, so pending, or approved and not yet cleaned up (``watch_open_csrs``). An approved
    #: one counts: one that kubeadm's auto-approval approved before the watch saw it still wants a
    #: pass to bind its key. (None: a result from before the mark, which ``pending`` names.)
    mark: CsrMark | None = None
    #: Before the mark: the newest ``CSRS_NAMED`` of them by name, oldest first (empty now).
    pending: list[str] = Field(default_factory=list)
    #: How many were open.
    open_count: int = 0
    changed: bool = False

    @property
    def cut(self) -> bool:
        """A result from before the mark named only the newest of the open CSRs."""
        return self.open_count > len(self.pending)


# -- the Node entity's word from the cluster ------------------------------------------------
class ClusterNodeState(BaseModel):
    """The ``cluster_state`` signal a Site entity sends a Node entity when its watch saw the
    node turn NotReady (its kubelet fell silent) or Ready again, or (``deleted``) saw its Node
    object go from the cluster (retired, removed by hand)."""

    ready: bool
    #: When the Site entity's watch saw it (epoch seconds).
    observed_at: float = 0.0
    #: The node is gone from the cluster (with ``ready`` false): the Node entity confirms it with the
    #: cluster's own record before it ends (``node-ends-when-told-deleted``); a run of the code before
    #: the field takes it as NotReady. Default false: every payload sent before it stays valid.
    deleted: bool = False


# -- watch_recovery -------------------------------------------------------------------------
class RecoveryWatchInput(Strict):
    site: Name
    #: The recovery verdict the evacuation last saw (None: none yet, return after the first look).
    recovered: bool | None = None
    #: In the needs-person wait: the models the evacuation found nothing may take (``Plan.impossible``);
    #: the watch returns when that differs. None: not watched (the wait for recovery).
    impossible: list[Name] | None = Field(None, max_length=10_000)
    #: Look this often (inside the activity: no action).
    probe_seconds: float = Field(30, gt=0, le=DAY)
    #: Return unchanged after this long.
    max_wait_seconds: float = Field(1800, gt=0, le=MAX_WATCH_SECONDS)


class RecoveryWatchResult(BaseModel):
    #: The last look's verdict (``fleet.incident.recovery``) and why.
    recovered: bool
    detail: str = ""
    #: The models nothing may take differ from the input's ``impossible``.
    placing_changed: bool = False
