"""The event watches (issue 37): long-running activities that return only when something their
entity acts on changed, so a fleet where nothing happens costs Temporal almost nothing.

Every activity scheduled, every timer, signal and heartbeat is a billed (and rate-limited)
Temporal action. A watch here holds one activity open for minutes, follows the cluster with a
real watch (``Cluster.watch_nodes`` and friends: list, then watch from the list's
resourceVersion, listed again on ``410 Gone``), does its periodic looks inside the activity
(a provider probe: no action), waits on a workflow's end with Temporal's long poll (a read, no
action), and heartbeats at most once per half its heartbeat timeout. Each is level-triggered:
the entity passes what it last saw and the watch returns at once when the world already
differs, so a run that continued as new loses nothing.

- ``watch_site``: a Site entity's nodes (Ready, cordoned, proven; added, removed) and its
  provider's API (Transient failures trip the incident rule). It puts the public placement
  labels (zone, region, GPU product) back the moment a node's differ from the site's config, and
  returns when a node changed its own (the entity quarantines it). It also reports how long nobody
  watched: its own loop running late (its process frozen) or, on a retried attempt, the time
  since the lost attempt's last heartbeat; the entity takes that as the control plane's absence.
- ``watch_demand_events``: the Demand loop's new Pending GPU pods (batched as before), the pods of its
  purchases in flight, those purchases ending (a long poll on each one's close), and which nodes
  hold GPU pods (consolidation). A node's own mirror pods count for none of these.
- ``watch_csrs``: a new kubelet CSR for gpufleet's approver.
- ``watch_recovery``: a SiteEvacuation's site while it is down (and while nothing may take its
  replicas): the recovery probe every ``probe_seconds`` inside the activity, returning when the site
  is back or, in the needs-person wait, when what nothing may take changes. Polled from the workflow,
  a probe and a timer each time, it cost 240 actions an hour per evacuated site (360 to 480 in the
  needs-person wait), about 3,000 over a 12-hour outage.
- ``ensure_sites``: the Schedule's safety sweep starts every Site entity that is not running
  (one that runs has its own watch and safety timer: no signal, no action).
"""

from __future__ import annotations

import asyncio
import threading
import time

from temporalio import activity
from temporalio.client import WorkflowExecutionStatus, WorkflowHistoryEventFilterType
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.service import RPCError, RPCStatusCode

from activities.env import FleetEnv
from activities.errors import typed_errors
from activities.evacuation import EvacuationActivities, provider_api_answers
from activities.ready_flaps import FREE_CHANGES, HOLD_SECONDS, WINDOW_SECONDS, ReadyFlaps
from fleet.cluster import LABEL_SITE, UNPROVEN_TAINT
from fleet.errors import Transient
from fleet.demand import opted_in, placement_drift, public_placement_labels
from providers.cluster.base import NodeNotFound, OpenCsr
from fleet.messages.capacity import SignalSitesInput
from fleet.messages.demand import DemandBatch
from fleet.messages.evacuation import ProbeNode
from fleet.messages.watches import (
    MAX_BUSY_NODES,
    MAX_NEW_PODS,
    CsrMark,
    CsrWatchInput,
    CsrWatchResult,
    DemandWake,
    DemandWatchInput,
    RecoveryWatchInput,
    RecoveryWatchResult,
    SiteWatchInput,
    SiteWatchResult,
    node_summary,
)
from fleet.naming import site_workflow_id
from fleet.contracts import workflows as flows

#: A watch's own loop looks at least this often (its chunks, its rechecks), whatever it waits for.
RECHECK_SECONDS = 30.0
#: Slack on top of the recheck before a late look counts as the watcher's process having stopped
#: (a real watch's chunk may take a connect timeout longer than asked).
LATE_SLACK_SECONDS = 10.0
#: While opted-in pods are Pending, the fleet's labels are put on new nodes this often (a bought
#: node must carry them before the scheduler can bind the pods it was bought for).
LABEL_SECONDS = 2.0


class RareHeartbeat:
    """An activity's heartbeats, at most one per half its heartbeat timeout (the first at half):
    each one is a billed action and a write on the server, and a watch waits for minutes. The
    detail is the wall-clock time of the beat, so an attempt retried after this one was lost
    knows how long nobody watched (``since_lost_attempt``)."""

    def __init__(self) -> None:
        timeout = activity.info().heartbeat_timeout
        self.every = timeout.total_seconds() / 2 if timeout else None
        self._next = time.monotonic() + self.every if self.every else float("inf")

    def __call__(self) -> None:
        if time.monotonic() >= self._next:
            activity.heartbeat(time.time())
            self._next = time.monotonic() + self.every

    @staticmethod
    def since_lost_attempt() -> float:
        """Seconds since the previous attempt's last heartbeat (0: first attempt, or none)."""
        info = activity.info()
        if info.attempt <= 1 or not info.heartbeat_details:
            return 0.0
        try:
            return max(0.0, time.time() - float(info.heartbeat_details[0]))
        except (TypeError, ValueError):
            return 0.0


def stop_if_asked() -> None:
    """A watch's thread ends when its activity is cancelled (the entity continued as new) or its
    worker stops: a watch waits for minutes, and a worker's shutdown waits for its activities."""
    if activity.is_cancelled():
        raise CancelledError("the watch was cancelled")
    if activity.is_worker_shutdown():
        # A failure the server takes (a CancelledError nobody asked for is refused): retried on
        # another worker at once, not after the heartbeat timeout.
        raise ApplicationError("the watch's worker is stopping", type="WorkerStopping")


def busy_nodes(pods) -> set[str]:
    """The nodes holding one of ``pods`` (mirror pods already left out), the first
    ``MAX_BUSY_NODES`` by name: what ``DemandWake.busy`` names and the next watch compares."""
    return set(sorted({p.node for p in pods if p.node})[:MAX_BUSY_NODES])


def probe_nodes(nodes, flaps: ReadyFlaps | None = None, site: str = "") -> list[ProbeNode]:
    """The nodes as a site's entity acts on them; with ``flaps``, a node flipping its own Ready
    condition again and again is taken as NotReady until it stays Ready (``activities.ready_flaps``):
    each flip woke the site's watch, and so its entity."""
    return [ProbeNode(name=n.name, ready=_ready(n, flaps, site),
                      unproven=UNPROVEN_TAINT in n.taints or not n.labels.get(LABEL_SITE),
                      unschedulable=n.unschedulable, machine_id=n.machine_id) for n in nodes]


def _ready(node, flaps: ReadyFlaps | None, site: str) -> bool:
    if flaps is None:
        return node.ready
    ready, started = flaps.look(node.name, node.ready)
    if started:
        activity.logger.warning("site %s: node %s changed its Ready condition more than %d times in %g s: taken "
                                "as NotReady until it stays Ready %g s", site, node.name, FREE_CHANGES,
                                WINDOW_SECONDS, HOLD_SECONDS)
    return ready


class WatchActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env

    def all(self) -> list:
        return [self.watch_site, self.watch_demand_events, self.watch_csrs, self.watch_recovery, self.ensure_sites]

    # -- a Site entity's nodes and provider ---------------------------------------------------
    def _api(self, site: str) -> tuple[bool, str, str]:
        return provider_api_answers(self.env, site)

    @activity.defn
    @typed_errors
    def watch_site(self, input: SiteWatchInput) -> SiteWatchResult:
        """Until a node of the site changes what the entity acts on (``node_summary``), a node
        comes or goes, or the provider API's answer changes; unchanged after ``max_wait_seconds``."""
        site = self.env.site(input.site).name
        beat = RareHeartbeat()
        paused = RareHeartbeat.since_lost_attempt()
        recheck = min(RECHECK_SECONDS, input.api_check_seconds, beat.every or RECHECK_SECONDS)
        api = (input.api_ok, input.api_error_type, "") if input.api_ok is not None else None
        api_at = time.monotonic() if api is not None else 0.0
        last_look = time.monotonic()
        # A real watch's chunk may end a connect timeout late; the sim's looks are its own sleeps.
        late_after = max(recheck, input.poll_seconds) + (LATE_SLACK_SECONDS if self.env.world is None else 0.0)

        wanted = public_placement_labels(self.env.site(input.site))
        # The entity enforces what the config says (a run that read another config, or that does
        # not ask, gets its labels put back without a report): only then is a difference the node's.
        judged = bool(input.placement) and input.placement == wanted
        reported = set(input.reported)
        self_labelled: dict[str, list[str]] = {}
        # Said once a watch for each node: a node may write its labels again as fast as it likes,
        # and each put-back is a write of ours, but it gets no log line of ours each time.
        warned: set[str] = set()

        def put_back(nodes) -> bool:
            """Every node of the site is one the control plane labelled (``LABEL_SITE`` is its, set in
            the same write as these): a value other than the config's was written by someone else.
            True: a node not reported yet changed its own."""
            new = False
            for n in nodes:
                drift = placement_drift(n.labels, wanted)
                if not drift:
                    continue
                try:
                    n.labels = self.env.cluster.label_node(n.name, wanted).labels
                except NodeNotFound:
                    continue  # gone since the look
                if n.name not in warned:
                    warned.add(n.name)
                    activity.logger.warning("site %s: node %s changed its placement labels (%s): put back "
                                            "(again each time it does, said once a watch)", site, n.name,
                                            ", ".join(d[:200] for d in drift))
                if judged and n.name not in reported:
                    self_labelled[n.name] = [d[:200] for d in drift]
                    reported.add(n.name)
                    new = True
            return new

        def until(nodes) -> bool:
            nonlocal api, api_at, last_look, paused
            stop_if_asked()
            if put_back(nodes):
                return True
            now = time.monotonic()
            # A look much later than the loop makes them: this process was stopped (or starved).
            if now - last_look > late_after + input.absence_seconds:
                paused = max(paused, now - last_look - late_after)
            last_look = now
            if api is None or now - api_at >= input.api_check_seconds:
                api, api_at = self._api(site), now
            if paused > input.absence_seconds:
                return True
            if api[0] != input.api_ok or (not api[0] and api[1] != input.api_error_type):
                return True
            return {n.name: node_summary(n) for n in probe_nodes(nodes, self.env.ready_flaps, site)} != input.known

        nodes = self.env.cluster.watch_nodes({LABEL_SITE: site}, until, input.max_wait_seconds, recheck_s=recheck,
                                             heartbeat=beat, poll_s=input.poll_seconds)
        put_back(nodes)  # the watch's last look may be one ``until`` did not see (its timeout)
        found = probe_nodes(nodes, self.env.ready_flaps, site)
        ok, kind, message = api if api is not None else self._api(site)
        changed = ({n.name: node_summary(n) for n in found} != input.known or ok != input.api_ok
                   or (not ok and kind != input.api_error_type) or bool(self_labelled))
        return SiteWatchResult(nodes=found, api_ok=ok, api_error_type=kind, api_error=message[:500], changed=changed,
                               observed_at=time.time(), paused_seconds=round(paused, 3), self_labelled=self_labelled)

    # -- the Demand loop ----------------------------------------------------------------------
    @staticmethod
    async def _purchase_closed(workflow_id: str, retry_seconds: float) -> None:
        """Returns once the purchase ``workflow_id`` is no longer running (or was never found).

        Temporal's long poll on its close event (``GetWorkflowExecutionHistory``, waiting for a new
        event, close events only): the server answers the moment the run closes, so the watch wakes
        as the purchase ends, at no action (a read, never billed). A run that closed by continuing
        as new (or a retry) is followed: the purchase runs on in its new run. A long poll Temporal
        did not answer (away, a deadline) is asked again after ``retry_seconds``: that answer is
        the purchase's state then, so a purchase that ended meanwhile is seen at the retry."""
        client = activity.client()
        while True:
            handle = client.get_workflow_handle(workflow_id)
            try:
                closed = False
                async for _close in handle.fetch_history_events(
                        wait_new_event=True, event_filter_type=WorkflowHistoryEventFilterType.CLOSE_EVENT,
                        skip_archival=True):
                    closed = True
                    break
                if closed:
                    described = await handle.describe()
                    if described.status != WorkflowExecutionStatus.RUNNING:
                        return
                    continue  # continued as new: wait on its new run
            except RPCError as error:
                if error.status == RPCStatusCode.NOT_FOUND:
                    return  # gone (or never started): not running
            await asyncio.sleep(retry_seconds)

    async def _first_purchase_closed(self, ids: list[str], retry_seconds: float) -> None:
        """Returns when the first of the purchases ``ids`` is no longer running (one long poll each)."""
        waits = [asyncio.ensure_future(self._purchase_closed(i, retry_seconds)) for i in dict.fromkeys(ids)]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in done:
                wait.result()  # a failure of its own (no client: a bug) is no purchase's end
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    @activity.defn
    @typed_errors
    async def watch_demand_events(self, input: DemandWatchInput) -> DemandWake:
        """Until opted-in Pending GPU pods the loop has no answer for appear (then until the batch
        closes, as ``watch_demand`` did: ``batch_idle_seconds`` without another, at most
        ``batch_max_seconds``), a pod a purchase was bought for goes (one not ``input.gone``
        already), a purchase ends, or the
        nodes holding GPU pods change; after ``wait_seconds`` with nothing of that.

        A mirror pod (a static pod a node's kubelet wrote, bound to itself) counts for nothing
        here: it is never Pending demand, never a pod a purchase was bought for, and it makes no
        node busy. A node may write thousands of them, with names of any length. The result names
        only what the loop acts on, each list bounded (``DemandWake``)."""
        from activities.demand import DemandActivities

        labels = DemandActivities(self.env)
        cluster = self.env.cluster
        beat = RareHeartbeat()
        known, tracked = set(input.known), set(input.tracked)
        watched = tracked - set(input.gone)  # a pod the loop saw go ends no watch again
        busy_before = set(input.busy) if input.busy is not None else None
        loop = asyncio.get_running_loop()
        start = loop.time()
        first = last = None
        seen: set[str] = set()
        why = "timeout"
        #: The pods as the watch's last look saw them (``decide`` runs in the watch's thread).
        pods: list | None = None
        #: Set once a purchase ended: the watch's thread changes nothing more and ends at its next look.
        ended = False
        lock = threading.Lock()
        await asyncio.to_thread(labels._label_fleet_nodes)

        def batch_closes_at() -> float | None:
            """When the open batch closes if no other new pod comes (``loop.time()``, the watch's
            clock too: ``time.monotonic()``); None: no batch is open. Called with ``lock`` held."""
            if first is None:
                return None
            return min(last + input.batch_idle_seconds, first + input.batch_max_seconds)

        def wake_at() -> float | None:
            """The watch asks ``decide`` again then, though no pod changed: a real watch's server
            may send nothing for a whole chunk (30 s), while the batch promises its window."""
            with lock:
                return batch_closes_at()

        def decide(found) -> bool:
            nonlocal first, last, seen, why, pods
            with lock:
                if ended:
                    return True
                stop_if_asked()
                pods = [p for p in found if not p.mirror]
                now = loop.time()
                pending = {p.key for p in pods if p.pending and opted_in(p) and not p.nominated_node}
                new = pending - known
                if new - seen:
                    first = first if first is not None else now
                    last = now
                seen = (seen | new) & (new | known)  # a pod that went before the batch closed is not in it
                if first is not None:
                    if now >= batch_closes_at():
                        why = "pods"
                        return True
                    return False
                if watched - {p.key for p in pods}:
                    why = "pods gone"
                    return True
                if busy_before is not None and busy_nodes(pods) != busy_before:
                    why = "idle"
                    return True
                return False

        # One long poll per purchase in flight, for the whole watch: it returns as one closes.
        closing = (asyncio.ensure_future(self._first_purchase_closed(input.purchases, input.purchase_check_seconds))
                   if input.purchases else None)
        watching = None
        try:
            while True:
                now = loop.time()
                left = max(0.0, start + input.wait_seconds - now)
                # One watch for the whole wait (it asks ``decide`` as an open batch's window closes:
                # ``wake_at``), cut short where something else must be looked at: the labels of new nodes.
                chunk = left
                with lock:
                    closes = batch_closes_at()
                if closes is not None:
                    chunk = max(chunk, closes - now)  # a batch open as the wait ends still gets its window
                if seen or any(p.pending and opted_in(p) for p in pods or []):
                    chunk = min(chunk, LABEL_SECONDS)
                if beat.every:
                    chunk = min(chunk, beat.every)  # heartbeats go from this loop, never from the watch's thread
                watching = asyncio.ensure_future(asyncio.to_thread(
                    cluster.watch_gpu_pods, decide, chunk, min(RECHECK_SECONDS, chunk + 1), None, input.poll_seconds,
                    wake_at=wake_at))
                await asyncio.wait([w for w in (watching, closing) if w is not None],
                                   return_when=asyncio.FIRST_COMPLETED)
                if closing is not None and closing.done():
                    closing.result()  # the long poll's own failure (no client) is the activity's, never "ended"
                    with lock:
                        ended = True
                        if why == "timeout":  # the watch's own reason, taken in the same instant, comes first
                            why = "purchase ended"
                    if pods is None:  # before the watch's first look, which ``ended`` ends at once
                        pods = [p for p in await watching if not p.mirror]
                    # The node a purchase joined carries the fleet's labels (what its pods select)
                    # now, not after the pass this wakes has planned: the scheduler binds them at once.
                    await asyncio.to_thread(labels._label_fleet_nodes)
                    break
                found = watching.result()
                if why != "timeout":
                    break
                if decide(found):  # an open batch's window may have closed at the chunk's end
                    break
                if any(p.pending and opted_in(p) for p in pods or []):
                    await asyncio.to_thread(labels._label_fleet_nodes)
                if loop.time() - start >= input.wait_seconds and first is None:
                    break
                beat()
        finally:
            with lock:
                ended = True
            if watching is not None and not watching.done():
                # A real watch may wait up to its chunk (``RECHECK_SECONDS``) for its next event: its
                # thread ends on its own then (``ended``), its answer no longer wanted: the last
                # look's pods (``decide`` sees every change) are what it would say.
                watching.add_done_callback(lambda done: done.cancelled() or done.exception())
            if closing is not None:
                closing.cancel()
                await asyncio.gather(closing, return_exceptions=True)
        pods = pods or []
        window = round(loop.time() - first, 3) if first is not None else 0.0
        return DemandWake(batch=DemandBatch(new=sorted(seen)[:MAX_NEW_PODS] if why == "pods" else [],
                                            present=sorted(tracked & {p.key for p in pods}), window_seconds=window),
                          why=why, busy=sorted(busy_nodes(pods)))

    # -- gpufleet's CSR approver --------------------------------------------------------------
    @activity.defn
    @typed_errors
    def watch_csrs(self, input: CsrWatchInput) -> CsrWatchResult:
        """Until a CSR the approver has not seen appears (one not in ``input.mark`` among those
        still open under a signer gpufleet judges), but no sooner than ``input.pace_seconds`` after
        it began; unchanged after ``max_wait_seconds``. A CSR gone (decided, cleaned up) wakes
        nothing. Counts the open CSRs and marks them (``CsrMark``) for the next watch."""
        known = set(input.known)  # an input from before the mark (a watch in flight at the deploy)
        beat = RareHeartbeat()
        recheck = min(RECHECK_SECONDS, beat.every or RECHECK_SECONDS)

        def unseen(open_: list[OpenCsr]) -> bool:
            if input.mark is not None:
                return any(not input.mark.seen(*csr) for csr in open_)
            return unseen_by_name([csr.name for csr in open_])

        def unseen_by_name(open_: list[str]) -> bool:
            if input.known_cut:
                # Only the newest were named: the CSRs before the oldest of them still open (oldest
                # first) were seen too. None left open: every open CSR counts as new (one pass more).
                open_ = open_[next((i for i, name in enumerate(open_) if name in known), 0):]
            return any(name not in known for name in open_)

        def new_one(open_: list[OpenCsr]) -> bool:
            stop_if_asked()
            return unseen(open_)

        def stopped(_open: list[OpenCsr]) -> bool:
            stop_if_asked()
            return False

        started = time.monotonic()
        found = self.env.cluster.watch_open_csrs(new_one, input.max_wait_seconds, recheck_s=recheck, heartbeat=beat)
        early = min(input.pace_seconds, input.max_wait_seconds) - (time.monotonic() - started)
        if early > 0 and unseen(found):
            # Those that come meanwhile are this pass's too; it is told the open CSRs as they are then.
            found = self.env.cluster.watch_open_csrs(stopped, early, recheck_s=recheck, heartbeat=beat)
        return CsrWatchResult(mark=CsrMark.of(found), open_count=len(found), changed=unseen(found))

    # -- a SiteEvacuation's site while it is down ------------------------------------------------
    @activity.defn
    @typed_errors
    def watch_recovery(self, input: RecoveryWatchInput) -> RecoveryWatchResult:
        """Until the site's recovery verdict (``recovery_verdict``, looked at every ``probe_seconds``)
        differs from ``input.recovered`` or, given ``input.impossible``, the models nothing may take
        differ from it; unchanged after ``max_wait_seconds``. A cluster API away while it reads what
        may take the replicas changes nothing (the next look reads again)."""
        evacuation = EvacuationActivities(self.env)
        beat = RareHeartbeat()
        known = sorted(input.impossible) if input.impossible is not None else None
        until = time.monotonic() + input.max_wait_seconds
        while True:
            stop_if_asked()
            verdict = evacuation.recovery_verdict(input.site)
            placing = known
            if known is not None:
                try:
                    placing = evacuation.unplaceable(input.site)
                except Transient as error:
                    activity.logger.info("site %s: what may take its replicas not read (%s)", input.site, error)
            if input.recovered is None or verdict.recovered != input.recovered or placing != known:
                return RecoveryWatchResult(recovered=verdict.recovered, detail=verdict.detail,
                                           placing_changed=placing != known)
            if time.monotonic() >= until:
                return RecoveryWatchResult(recovered=verdict.recovered, detail=verdict.detail)
            beat()
            look = min(time.monotonic() + input.probe_seconds, until)
            while (left := look - time.monotonic()) > 0:
                time.sleep(min(left, 1.0))  # the worker's stop (or a cancel a heartbeat brought) within a second
                stop_if_asked()

    # -- the Schedule's safety sweep ----------------------------------------------------------
    @activity.defn
    async def ensure_sites(self, input: SignalSitesInput) -> list[str]:
        """Start the entity of every site (of ``input.sites``, or the config's) that is not running;
        a running one is left alone: its watch and safety timer keep it current, and a signal
        would be an action for nothing. Returns the sites started."""
        client = activity.client()
        names = input.sites or [s.name for s in self.env.config.sites]
        running = set()
        query = f'WorkflowType = "{flows.Site.TYPE}" AND ExecutionStatus = "Running" AND TaskQueue = "{activity.info().task_queue}"'
        async for found in client.list_workflows(query):
            running.add(found.id)
        started = []
        for name in names:
            if site_workflow_id(name) in running:
                continue
            # USE_EXISTING: one started meanwhile (or that visibility did not list yet) is kept.
            await client.start_workflow(
                flows.Site.TYPE, {"site": name}, id=site_workflow_id(name), task_queue=activity.info().task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                static_summary=f"site {name}: min/max reconcile, incidents",
            )
            started.append(name)
        return started
