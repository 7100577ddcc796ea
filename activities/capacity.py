"""Capacity activities: the provider catalog, the account guard, sites, drains, webhooks, and the
numbering of a Site entity's children (its fills here; its incidents' evacuations share the helpers).

Run by the control-plane worker. Every provider call here goes through
``FleetEnv.provider`` (which refuses a revoked account before an SDK is touched),
except ``check_credentials``: the one cheap authenticated call a person asks for
when they say the credentials are fixed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, TypeVar

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError, CancelledError, TerminatedError
from temporalio.service import RPCError, RPCStatusCode

from activities.account_store import AccountRecord, CatalogEntry
from fleet.messages.capacity import (
    AccountConfigInput,
    AccountInput,
    AccountRecordInput,
    CapacityResult,
    Catalog,
    ChildNumber,
    ChildNumberInput,
    DrainNodeInput,
    FillRef,
    GetCatalogInput,
    NotifyInput,
    MAX_QUEUED_DELETES_SHOWN,
    QueuedDelete,
    QueuedDeletes,
    QueuedDeletesInput,
    ReleaseCordonsInput,
    ReportAccountInput,
    RetireMachineInput,
    SignalSitesInput,
    SiteNode,
    SiteNodesInput,
    WAITING_FOR_CAPACITY,
    WakeRequestsInput,
)
from activities import notify
from activities.env import FleetEnv
from activities.errors import typed_errors
from activities.ledger import record_retire
from activities.waiting import heartbeat_or_stop
from fleet import search_attributes as sa
from fleet.errors import AccountRevoked, BadCredentials, FleetError, OfferBlocked, OverQuota, ProviderError
from fleet.models import AccountState, listing
from fleet.naming import account_workflow_id, fill_number_of, fill_workflow_id, site_workflow_id
from fleet.placement import AccountView
from fleet.cluster import (
    ANNOTATION_CORDONED_BY, CORDONED_BY_SURPLUS, FLEET_TAINT, LABEL_SITE, UNPROVEN_TAINT, DrainResult, fenced_gpus,
)
from fleet.demand import placement_drift, public_placement_labels
from providers.cluster.base import Cluster, NodeMarks, NodeNotFound, decide_on_node, uncordon_unless
from fleet.contracts import workflows as flows

R = TypeVar("R")

#: The cluster state object (kind, key, value key) with the digest of the offers the last catalog
#: refresh listed (``wake_waiting_requests``): in the cluster, so a restarted or second control
#: plane compares with what the waiting requests were last told. A backup leaves it out.
CATALOG_STATE, LAST_REFRESH, OFFERS_DIGEST = "catalog", "last-refresh", "offers-digest"


log = logging.getLogger("gpufleet.capacity")


async def report_to_account(env: FleetEnv, input: ReportAccountInput) -> None:
    """Block the account (or offer) in the guard store at once, then tell its ProviderAccount
    entity (signal-with-start ``report``). The store write is what stops the next call from
    any workflow; the entity is the record a person sees."""
    account = env.config.account(input.account)
    store = env.accounts
    if input.kind == "BadCredentials":
        await asyncio.to_thread(store.mark_revoked, account.name, account.provider, input.message)
    else:
        await asyncio.to_thread(store.block_offer, account.name, account.provider, input.offer, input.message)
    await activity.client().start_workflow(
        flows.ProviderAccount.TYPE, {"account": account.name, "provider": account.provider},
        id=account_workflow_id(account.provider, account.name), task_queue=activity.info().task_queue,
        start_signal=flows.ProviderAccount.report, start_signal_args=[input.model_dump(mode="json")],
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary=f"{account.provider} account {account.name}",
    )


#: The longest gap between two heartbeats of a long provider call, whatever its timeout.
HEARTBEAT_MAX_SECONDS = 30.0


async def heartbeating(work: Awaitable[R]) -> R:
    """Await ``work`` (a blocking provider call in a thread: creating a machine can take
    minutes) and heartbeat meanwhile, when the caller set a heartbeat timeout: a worker that
    dies mid-call is then noticed within that timeout and the attempt retried elsewhere (under
    the same idempotency key, so the retry finds what this attempt created), not only when the
    start-to-close timeout runs out. Every third of the timeout, at most 30 s; the first only
    after that long, so a call that answers within seconds costs no heartbeat."""
    timeout = activity.info().heartbeat_timeout
    if not timeout:
        return await work
    every = min(timeout.total_seconds() / 3, HEARTBEAT_MAX_SECONDS)
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every)
            if done:
                return task.result()
            activity.heartbeat()
    finally:
        task.cancel()  # the activity was cancelled: so is the wait (a thread's call runs to its end)


#: The event loop of the async activity whose body runs in a thread (``reports_account``).
_ACTIVITY_LOOP: contextvars.ContextVar[asyncio.AbstractEventLoop] = contextvars.ContextVar("activity_loop")


def heartbeat_from_body(*details: Any) -> None:
    """``activity.heartbeat`` from a ``reports_account`` body: it runs in a thread of an async
    activity, where the SDK's heartbeat needs the event loop, so it is handed to that loop (in
    order: before the body's result or error, so the attempt's completion waits for it)."""
    loop = _ACTIVITY_LOOP.get(None)
    if loop is None:
        activity.heartbeat(*details)
        return
    loop.call_soon_threadsafe(functools.partial(activity.heartbeat, *details), context=contextvars.copy_context())


async def is_running(client: Client, workflow_id: str) -> bool:
    """Whether ``workflow_id`` (its latest run) is running; one that is not on record is not."""
    try:
        return (await client.get_workflow_handle(workflow_id).describe()).status == WorkflowExecutionStatus.RUNNING
    except RPCError as error:
        if error.status == RPCStatusCode.NOT_FOUND:
            return False
        raise


async def number_past_record(workflow_type: str, site: str, workflow_id: Callable[[int], str],
                             number: Callable[[str], int | None], at_least: int) -> ChildNumber:
    """The number of a Site entity's next numbered child of ``workflow_type`` (an incident's
    evacuation, a fill), ``at_least`` or more: one no ``workflow_id(n)`` on record has (Temporal
    keeps a closed run under its id until the namespace's retention ends: a second run there hid
    the first from the CLI and the status reads), or that of one still running, begun by an earlier
    run of the entity (terminated, reset or started again), which the entity adopts rather than
    start a second. ``number`` reads ``n`` from an id of the entity's series (None for any other)."""
    client = activity.client()
    taken, running = [], []
    async for wf in client.list_workflows(f'WorkflowType = "{workflow_type}" AND Site = "{site}"'):
        n = number(wf.id)
        if n is not None:
            taken.append(n)
            if wf.status == WorkflowExecutionStatus.RUNNING:
                running.append(n)
    for n in sorted(running):
        if await is_running(client, workflow_id(n)):  # the list can be a moment behind
            return ChildNumber(n=n, running=True)
    # The list lags its writes (Elasticsearch by about a second), and lists no child without ``Site``
    # (an evacuation sets it in its first task; a fill started before ``site-fill-ids-unique`` has
    # none): each candidate is described, which does not lag.
    n = max([at_least - 1, *taken]) + 1
    while True:
        try:
            status = (await client.get_workflow_handle(workflow_id(n)).describe()).status
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                return ChildNumber(n=n)
            raise
        if status == WorkflowExecutionStatus.RUNNING:
            return ChildNumber(n=n, running=True)
        n += 1


async def run_end(workflow_id: str, result_type: type[R]) -> tuple[R | None, str]:
    """Wait for ``workflow_id`` to end (through its continue-as-new runs), heartbeating: its result,
    or None and how it closed otherwise ("failed: …", "terminated", "cancelled", "no longer on record")."""
    handle = activity.client().get_workflow_handle(workflow_id, result_type=result_type)
    try:
        return await heartbeating(handle.result()), ""
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        return None, "no longer on record"
    except WorkflowFailureError as error:
        cause = error.cause
        if isinstance(cause, (TerminatedError, CancelledError)):
            return None, "terminated" if isinstance(cause, TerminatedError) else "cancelled"
        return None, f"failed: {getattr(cause, 'message', None) or cause}"[:500]


def reports_account(site_of: Callable[[Any], str], offer_of: Callable[[Any], str | None] = lambda _: None):
    """Run a provider-calling activity body (sync, in a thread) and report a provider's own
    ``BadCredentials`` or ``OverQuota`` to the account before it is raised (rule 6).

    The one place every path meets those answers (joins however started, repair
    replacements and restarts, reclaims, sweeps), so the guard holds for all of them. The
    guard's own refusals (``AccountRevoked``/``OfferBlocked``) were reported already.
    While the body runs it heartbeats (``heartbeating``) when the caller asked for it."""

    def wrap(fn: Callable[[Any, Any], R]) -> Callable[[Any, Any], Awaitable[R]]:
        @functools.wraps(fn)
        async def run(self, input):
            _ACTIVITY_LOOP.set(asyncio.get_running_loop())  # the body's thread gets a copy of this context
            try:
                return await heartbeating(asyncio.to_thread(fn, self, input))
            except (BadCredentials, OverQuota) as error:
                if isinstance(error, (AccountRevoked, OfferBlocked)):
                    raise
                env: FleetEnv = self.env
                site = env.site(site_of(input))
                offer = offer_of(input) or site.instance_type
                kind = BadCredentials.__name__ if isinstance(error, BadCredentials) else OverQuota.__name__
                try:
                    await report_to_account(env, ReportAccountInput(
                        account=site.account, kind=kind, offer=f"{site.name}/{offer}", message=str(error)))
                except Exception as lost:  # noqa: BLE001 - the typed answer must still reach the caller
                    # The guard store is written first; only the entity's record can be missing here.
                    log.warning("could not tell account %s about %s: %s", site.account, kind, lost)
                raise

        return run  # type: ignore[return-value]

    return wrap


def who_holds(cluster: Cluster, name: str, mine: str, marks: NodeMarks | None = None) -> tuple[str, str]:
    """Who holds the node ``name`` now (its ``marks`` as read already, else read here), other than
    the owner whose cordon mark is ``mine`` (``ANNOTATION_CORDONED_BY``), and the mark it carries:
    ``(who, mark)``, ``who`` empty when no one else does. A GPU fenced by its repair outranks any
    cordon mark; a repair that fenced a node ``mine`` cordoned has taken the cordon over, so
    ``mine`` is dropped (once its fences go by hand the node must not read as ``mine`` again; the
    repair's own uncordon drops it anyway), on the marks read: given ``marks``, a node changed
    since raises ``NodeChanged`` for the caller's ``decide_on_node`` to read again. The node's
    kubelet can write these annotations, so they decide only about that node, and what is said of
    them is bounded. Raises ``NotFound`` for a node gone."""
    if marks is None:
        return decide_on_node(cluster, name, lambda read: who_holds(cluster, name, mine, read))
    annotations = marks.annotations
    fenced = fenced_gpus(annotations)
    by = annotations.get(ANNOTATION_CORDONED_BY, "")
    if fenced:
        if by == mine:
            # Only ours as read: a person's mark written since is theirs, never dropped.
            cluster.annotate_node(name, {ANNOTATION_CORDONED_BY: None}, version=marks.version)
        gpus = ", ".join(gpu[:8] for gpu in fenced[:4]) + (f" +{len(fenced) - 4}" if len(fenced) > 4 else "")
        return f"cordoned by its repair (GPU {gpus} fenced)", by
    if by and by != mine:
        return f"cordoned by {by[:40]!r} ({ANNOTATION_CORDONED_BY})", by
    return "", by


def take_node(cluster: Cluster, name: str, mine: str) -> str:
    """Cordon the node marked ``mine``, its owner's, unless someone else holds it (``who_holds``):
    who does, or "" once it is taken. The cordon is written on the marks it was decided on, so a
    fence or a person's mark that lands in between is never overwritten: it is seen and kept."""

    def take(marks: NodeMarks) -> str:
        held, _ = who_holds(cluster, name, mine, marks)
        if not held:
            cluster.cordon(name, True, by=mine, version=marks.version)
        return held

    return decide_on_node(cluster, name, take)


def cordon_if_schedulable(cluster: Cluster, name: str, mine: str) -> None:
    """Cordon the node marked ``mine`` where it is schedulable and no one else holds it, on the marks
    it was decided on: that cordon is then its owner's to take back. A node cordoned already (by
    anyone: its mark, or none, as it is; the owner's own from an earlier attempt) or held (a GPU
    fenced) is left to the drain's own cordon, which marks nothing."""

    def cordon(marks: NodeMarks) -> None:
        if marks.unschedulable:
            return
        held, _ = who_holds(cluster, name, mine, marks)
        if not held:
            cluster.cordon(name, True, by=mine, version=marks.version)

    decide_on_node(cluster, name, cordon)


class CapacityActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env

    def all(self) -> list:
        return [
            self.get_catalog,
            self.report_account,
            self.write_account_state,
            self.account_config_problems,
            self.check_credentials,
            self.run_queued_deletes,
            self.queued_deletes,
            self.notify_person,
            self.wake_waiting_requests,
            self.drain_within,
            self.site_nodes,
            self.signal_sites,
            self.retire_machine,
            self.release_cordons,
            self.fleet_sites,
            self.fill_number,
            self.fill_end,
        ]

    # -- catalog ----------------------------------------------------------------------------
    def _refresh(self) -> list[CatalogEntry]:
        """List every site's offers; a revoked account is skipped without a call."""
        sites = self.env.config.sites

        def one(site) -> CatalogEntry:
            entry = CatalogEntry(site=site.name, refreshed_at=time.time())
            try:
                entry.offers = self.env.provider(site.name).list_offers()
            except FleetError as error:
                # The class, not the type workflows see: the guard's own refusal
                # (AccountRevoked) stays told apart from a provider's BadCredentials.
                entry.error_type, entry.error = type(error).__name__, str(error)
            return entry

        with ThreadPoolExecutor(max_workers=min(16, max(1, len(sites)))) as pool:
            entries = list(pool.map(one, sites))
        for entry in entries:
            self.env.accounts.put_catalog(entry)
        return entries

    @activity.defn
    @typed_errors
    async def get_catalog(self, input: GetCatalogInput) -> Catalog:
        """Offers of every site (stored ones when fresh), with account states (``read_catalog``)."""
        return await self.read_catalog(input)

    async def read_catalog(self, input: GetCatalogInput) -> Catalog:
        """Offers of every site (stored ones when fresh), with account states.

        A site whose provider answers BadCredentials is reported to its
        ProviderAccount entity here, so a refresh alone stops further calls; a site
        the guard skipped (``AccountRevoked``: already reported) is not reported again."""
        entries = await asyncio.to_thread(self.env.accounts.catalog)
        known = {e.site for e in entries}
        oldest = min((e.refreshed_at for e in entries), default=0.0)
        stale = time.time() - oldest > input.max_age_seconds
        if input.force or stale or known != {s.name for s in self.env.config.sites}:
            entries = await asyncio.to_thread(self._refresh)
        catalog = Catalog(sites=self.env.config.sites, refreshed_at=min((e.refreshed_at for e in entries), default=0))
        for entry in entries:
            catalog.offers += entry.offers
            if entry.error_type:
                catalog.errors[entry.site] = f"{entry.error_type}: {entry.error}"
                if entry.error_type == BadCredentials.__name__:
                    site = self.env.site(entry.site)
                    await self._report(ReportAccountInput(account=site.account, kind="BadCredentials",
                                                          message=entry.error))
        for record in await asyncio.to_thread(self.env.accounts.all):
            catalog.accounts[record.name] = AccountView(state=record.state, blocked_offers=record.blocked_offers)
        return catalog

    # -- the account guard ------------------------------------------------------------------
    async def _report(self, input: ReportAccountInput) -> None:
        await report_to_account(self.env, input)

    @activity.defn
    async def report_account(self, input: ReportAccountInput) -> None:
        """OverQuota / BadCredentials seen: block in the store now, tell the entity."""
        await self._report(input)

    @activity.defn
    def write_account_state(self, input: AccountRecordInput) -> None:
        """The ProviderAccount entity's write-through to the store activities check."""
        current = self.env.accounts.get(input.account)
        since = current.since if current.state == input.state else time.time()
        self.env.accounts.put(AccountRecord(
            name=input.account, provider=input.provider, state=input.state, blocked_offers=input.blocked_offers,
            reason=input.reason, since=since if input.state != AccountState.HEALTHY else None,
        ))

    @activity.defn
    def account_config_problems(self, input: AccountConfigInput) -> list[tuple[str, str]]:
        """What the fleet config says against a ProviderAccount entity's account and provider:
        ``(field, problem)`` for each it does not have (an entity started by hand for a typo, or
        one whose account left the config); none when it does. Reads the config only."""
        accounts = self.env.config.accounts
        account = next((a for a in accounts if a.name == input.account), None)
        if account is None:
            return [("account", f"{input.account!r} is not in the fleet config (accounts: "
                                f"{listing([a.name for a in accounts])})")]
        if account.provider != input.provider:
            return [("provider", f"account {input.account} is a {account.provider} account in the fleet config, "
                                 f"not {input.provider}")]
        return []

    @activity.defn
    @typed_errors
    def check_credentials(self, input: AccountInput) -> str:
        """One cheap authenticated call (list offers at one of its sites), past the guard."""
        sites = [s for s in self.env.config.sites if s.account == input.account]
        if not sites:
            raise BadCredentials(f"account {input.account}: no site uses it, nothing to check with")
        offers = self.env.provider(sites[0].name, guard=False).list_offers()
        return f"{sites[0].name}: authenticated, {len(offers)} offers"

    @activity.defn
    @typed_errors
    def run_queued_deletes(self, input: AccountInput) -> list[str]:
        """The deletes queued while the account was revoked (the store says healthy now)."""
        done = []
        for pending in self.env.accounts.pending_deletes(input.account):
            self.env.provider(pending.site).delete_machine(pending.machine_id)
            self.env.accounts.done_delete(pending.machine_id)
            done.append(pending.machine_id)
            activity.heartbeat(len(done))
        return done

    @activity.defn
    def queued_deletes(self, input: QueuedDeletesInput) -> QueuedDeletes:
        """The deletes the guard store holds queued for the account, and whether it has the account
        revoked: a ProviderAccount run started afresh (its run before terminated, owing them) reads
        what it owes from here, and a run shows them from here (``AccountStatus.deletes_queued``).
        With them, the account's record in the store (its state, blocked offers, reason, since when),
        which a run started afresh takes as its own. Reads the store only. ``shown_only`` (how a run
        reads them, every 5 s to 5 minutes while revoked): ``machines`` holds the first
        ``MAX_QUEUED_DELETES_SHOWN`` only, ``count`` all of them, so what lands in the run's history
        stays small however many are queued; else every machine."""
        pending = self.env.accounts.pending_deletes(input.account)
        record = self.env.accounts.get(input.account)
        oldest = min((p.queued_at for p in pending), default=None)

        def iso(at: float) -> str:
            return datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="seconds")

        return QueuedDeletes(
            machines=[p.machine_id for p in (pending[:MAX_QUEUED_DELETES_SHOWN] if input.shown_only else pending)],
            count=len(pending), revoked=record.state == AccountState.CREDENTIALS_REVOKED,
            oldest="" if oldest is None else iso(oldest),
            queued=[QueuedDelete(machine_id=p.machine_id, site=p.site, queued_at=iso(p.queued_at))
                    for p in pending[:MAX_QUEUED_DELETES_SHOWN]],
            state=record.state, blocked_offers=sorted(record.blocked_offers), reason=record.reason,
            since="" if record.since is None or record.state == AccountState.HEALTHY else iso(record.since),
        )

    @activity.defn
    async def notify_person(self, input: NotifyInput) -> bool:
        """POST to the configured webhook (activities.notify); none configured: nothing to do."""
        return await notify.post(self.env.config.notify_webhook, input.model_dump(mode="json"))

    @activity.defn
    async def wake_waiting_requests(self, input: WakeRequestsInput | None = None) -> int:
        """Signal each AcquireCapacity waiting for capacity (one with joins in flight looks again
        as each ends): offers changed, look again. From a catalog refresh (``offers_digest``), only
        when the offers differ from the last refresh's, and the signal says the catalog is listed:
        W waiting requests then cost that one listing, not W more. The digest is written once they
        are signalled, so a wake cut short is done again by its retry."""
        input = input or WakeRequestsInput()
        cluster = self.env.cluster
        if input.offers_digest:
            last = await asyncio.to_thread(cluster.read_state, CATALOG_STATE, LAST_REFRESH)
            if last.get(OFFERS_DIGEST) == input.offers_digest:
                return 0
        client = activity.client()
        woken = 0
        query = (f'WorkflowType = "{flows.AcquireCapacity.TYPE}" AND ExecutionStatus = "Running" '
                 f'AND {sa.FLEET_STATE.name} = "{WAITING_FOR_CAPACITY}"')
        async for wf in client.list_workflows(query):
            try:
                await client.get_workflow_handle(wf.id, run_id=wf.run_id).signal(
                    flows.AcquireCapacity.offers_changed, bool(input.offers_digest))
                woken += 1
            except Exception:  # noqa: BLE001 - it may have finished meanwhile
                pass
        if input.offers_digest:
            await asyncio.to_thread(cluster.update_state, CATALOG_STATE, LAST_REFRESH,
                                    lambda _old: {OFFERS_DIGEST: input.offers_digest})
        return woken

    # -- sites and nodes --------------------------------------------------------------------
    @activity.defn
    def fleet_sites(self) -> list:
        return [s.model_dump(mode="json") for s in self.env.config.sites]

    @activity.defn
    @typed_errors
    def site_nodes(self, input: SiteNodesInput) -> list[SiteNode]:
        site = self.env.site(input.site)
        nodes = self.env.cluster.list_nodes({LABEL_SITE: site.name})
        wanted = public_placement_labels(site)
        for n in nodes:
            # The kubelet may relabel its own zone, region or GPU product; a wrong one would steer
            # PreferClose Services to another site's replicas, or the scheduler. The site's watch
            # puts them back within seconds (``watch_site``); each reconcile does too.
            if placement_drift(n.labels, wanted):
                try:
                    self.env.cluster.label_node(n.name, wanted)
                except NodeNotFound:
                    pass  # gone since the list: nothing to label
            # The kubelet cannot drop the fleet taint (NodeRestriction), but a person or another
            # controller can: without it the control plane's pods could land on a GPU node.
            if FLEET_TAINT not in n.taints:
                try:
                    self.env.cluster.set_taints(n.name, add=[FLEET_TAINT])
                except NodeNotFound:
                    pass  # gone since the list
        return [
            SiteNode(node_name=n.name, machine_id=n.machine_id, ready=n.ready, unproven=UNPROVEN_TAINT in n.taints,
                     registered_at=n.registered_at, price_per_gpu_hour=site.price_per_gpu_hour,
                     **(self._held(n.name) if n.unschedulable else {}))
            for n in nodes
        ]

    @activity.defn
    async def fill_number(self, input: ChildNumberInput) -> ChildNumber:
        """The number of the site's next Site-entity fill, ``input.at_least`` or more: one no
        ``capacity/site-<site>-<n>`` on record has, or that of one still running (to adopt, not to
        buy for twice). A person's or the demand loop's requests are other series: never counted."""
        site = input.site
        return await number_past_record(flows.AcquireCapacity.TYPE, site, lambda n: fill_workflow_id(site, n),
                                        lambda workflow_id: fill_number_of(site, workflow_id), input.at_least)

    @activity.defn
    async def fill_end(self, input: FillRef) -> CapacityResult:
        """Wait for the site's ``n``-th fill to end (heartbeats meanwhile): its result. One that
        ended otherwise (failed, terminated, no longer on record) fails this, saying how; not retried."""
        result, how = await run_end(fill_workflow_id(input.site, input.n), CapacityResult)
        if result is None:
            raise ApplicationError(how.removeprefix("failed: "), non_retryable=True)
        return result

    def _held(self, name: str) -> dict:
        """Who holds a cordoned node of the site (a fence, a person's mark: never without a cordon),
        so that a retirement of the site's surplus does not choose it; else whether the cordon is
        the Site's own (a surplus drain of its that blocked)."""
        try:
            held, by = who_holds(self.env.cluster, name, CORDONED_BY_SURPLUS)
        except NodeNotFound:
            return {}  # gone since the list: nothing holds it
        return {"held": held, "surplus_cordon": not held and by == CORDONED_BY_SURPLUS}

    @activity.defn
    @typed_errors
    def release_cordons(self, input: ReleaseCordonsInput) -> list[str]:
        """Uncordon each node still cordoned with its owner's mark that no one else holds now (the
        uncordon drops the mark); which ones. A node taken since its owner looked (a repair fenced a
        GPU, a person marked it theirs), uncordoned or gone is left as it is."""
        cluster, mine = self.env.cluster, input.cordoned_by

        def kept(name: str, marks: NodeMarks) -> bool:
            held, by = who_holds(cluster, name, mine, marks)
            return bool(held) or by != mine

        return uncordon_unless(cluster, input.nodes, kept)

    @activity.defn
    async def signal_sites(self, input: SignalSitesInput) -> list[str]:
        """Signal-with-start ``site/<name>`` of each named site with ``reconcile`` (a sweep that names
        sites; the Schedule's, naming none, only starts those not running: ``ensure_sites``)."""
        client = activity.client()
        names = input.sites
        for name in names:
            await client.start_workflow(
                flows.Site.TYPE, {"site": name}, id=site_workflow_id(name), task_queue=activity.info().task_queue,
                start_signal=flows.Site.reconcile, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                static_summary=f"site {name}: min/max reconcile",
            )
        return names

    @activity.defn
    @typed_errors
    def drain_within(self, input: DrainNodeInput) -> DrainResult:
        """Cordon and evict through the Eviction API (PDBs honoured) until the deadline.
        A node already gone has nothing left to drain (a reclaim the provider finished first).
        With ``cordoned_by`` (its owner's mark), a node someone else holds by now (a repair fenced
        a GPU, a person marked it theirs since its owner chose it) is left as it is: ``held`` says
        who holds it, nothing cordoned or evicted; with ``machine_goes`` (a reclaim: the machine goes
        anyway) it is drained all the same, its cordon marked only where this drain cordons it."""
        try:
            if input.cordoned_by is not None and input.machine_goes:
                cordon_if_schedulable(self.env.cluster, input.node_name, input.cordoned_by)
            elif input.cordoned_by is not None:
                held = take_node(self.env.cluster, input.node_name, input.cordoned_by)
                if held:
                    return DrainResult(node=input.node_name, held=held)
            # Its cordon leaves the mark just written (or whoever's lands since: the retire looks again).
            return self.env.cluster.drain_node(
                input.node_name, input.deadline_seconds, force=input.force, heartbeat=heartbeat_or_stop,
            )
        except NodeNotFound:
            return DrainResult(node=input.node_name, completed=True)

    def _machine_gone(self, site: str, machine_id: str) -> bool:
        """``FleetEnv.machine_gone``, a provider that does not answer read as "not gone": the node
        held is kept, as when the provider was not asked, and the next retirement asks again. The
        retire does not wait on, nor fail with, a provider it needs only for a ghost."""
        try:
            return self.env.machine_gone(site, machine_id)
        except ProviderError as error:
            log.warning("could not ask %s whether machine %s is gone (%s: %s): kept as held",
                        site, machine_id, error.type_name, error)
            return False

    @activity.defn
    @typed_errors
    @reports_account(lambda input: input.site)
    def retire_machine(self, input: RetireMachineInput) -> str | None:
        """Machine deleted (queued if the account is revoked), then the Node object out; returns
        None. With ``cordoned_by`` (after its owner's drain, which cordoned it), a node someone
        else took since its owner chose it (a repair fenced a GPU during the drain) or put back to
        work (uncordoned it) is kept: returns why, deletes nothing.

        The decision to delete is written on the node as it was read (its cordon again, with that
        read's version) before anything is deleted: a fence, an uncordon or a person's mark that
        lands after the look refuses it, and is seen on a fresh read.

        Only a node whose machine lives is kept so: one whose machine is gone already (an earlier
        attempt deleted it before the Node's removal failed, a reclaim took it) is a ghost, and
        goes whoever holds it. The provider is asked only then, on a node found held; one that does
        not answer leaves the node held (the next retirement asks again).

        The machine first: it bills until deleted, and a Node that cannot be removed
        (the cluster refusing) must not keep the delete from running."""
        gone = False
        if input.cordoned_by is not None:
            cluster, name, mine = self.env.cluster, input.node_name, input.cordoned_by

            def claim(marks: NodeMarks) -> str:
                held, _ = who_holds(cluster, name, mine, marks)
                if not held and not marks.unschedulable:
                    held = "uncordoned since its drain: someone put it back to work"
                if not held:
                    cluster.cordon(name, True, version=marks.version)  # changes nothing: the node as read
                return held

            try:
                held = decide_on_node(cluster, name, claim)
            except NodeNotFound:
                held = ""  # the Node is gone: its machine still goes
            if held:
                gone = bool(input.machine_id) and self._machine_gone(input.site, input.machine_id)
                if not gone:
                    return held
        if input.machine_id:
            if not gone:
                self.env.delete_machine(input.site, input.machine_id)
            record_retire(self.env, input.site, input.machine_id)  # a reclaim when SpotReclaim retires it
        # Not on the version claimed: with its machine gone, a Node kept for a change since is a ghost.
        self.env.cluster.remove_node(input.node_name)
        return None
