"""Prometheus metrics of a worker: the Temporal SDK's own and the fleet's, on one port.

- The SDK's metrics (schedule-to-start, task latencies, pollers, ...) come from the
  SDK runtime's telemetry: its Prometheus exporter listens on a loopback port of its
  own and ``/metrics`` here appends that page to ours, so a worker has one endpoint.
- The fleet's gauges are computed at scrape time from the sources of truth (the
  cluster port, the simulated world, the account guard's store and Temporal's
  visibility list with its search attributes), never kept in process memory, so a
  restarted worker reports the same values as the one before it. Counters of events
  live in ``activities/metrics.py``; events inside workflows (``gpufleet_node_bad_reports_total``,
  a node's malformed result) are counted with Temporal's workflow metric meter
  (``workflows.steps.count_bad_report``), which records nothing while a history replays, and
  reach this page with the SDK's metrics.

``fleet_snapshot`` is also what ``gpufleet top`` shows.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import urllib.request
from collections import Counter as Tally
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Callable, Iterable

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from fleet import search_attributes as sa
from fleet.cluster import SITE_ROUTES, UNPROVEN_TAINT
from fleet.contracts import workflows as flows
from fleet.models import AccountState
from fleet.settings import ControlPlaneEnv, SettingsError, WorkerEnv
from fleet.watched import nodes_under_repair, running_node_entities, unwatched_nodes

if TYPE_CHECKING:
    from activities.env import FleetEnv

log = logging.getLogger("gpufleet.metrics")

#: Every node state ``gpufleet_nodes`` reports (zero-filled per site, so absence never hides a drop).
NODE_STATES = ("provisioning", "unproven", "ready", "cordoned", "not-ready")
METRICS_PORT_ENV = WorkerEnv.variable("metrics_port")
METRICS_HOST_ENV = WorkerEnv.variable("metrics_host")
#: A machine without a node or a running join for longer than this is an orphan.
ORPHAN_GRACE_ENV = ControlPlaneEnv.variable("orphan_grace_seconds")
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


def metrics_port(flag: int | None) -> int | None:
    """``--metrics-port`` first, then ``GPUFLEET_METRICS_PORT``; None: no metrics endpoint."""
    if flag is not None:
        return flag
    try:
        return WorkerEnv.get("metrics_port")
    except SettingsError as error:
        raise SystemExit(str(error)) from None


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: How often an SDK worker sends the server its status (slots, pollers, host), the SDK's default.
WORKER_HEARTBEAT = timedelta(seconds=60)


#: Connections served at once; more are closed unanswered. Prometheus scrapes a target over one
#: connection at a time, so the rest are someone else's: in a cluster any pod may dial this port, a
#: GPU node's included, and a thread per connection would be theirs to multiply (each one, and the
#: page it asks for, taken from the worker that runs the fleet's workflows in this process).
MAX_CONNECTIONS = 8
#: How long a connection has to send its whole request; then it is closed (Prometheus' own scrape
#: timeout's default). Also the most a write to a reader that stopped reading may wait.
REQUEST_TIMEOUT_S = 10.0
#: A page is the answer to every scrape that asks within this long of it: any number of scrapers
#: (two Prometheus replicas, or a node asking in a loop) cost one page a second, not one each.
PAGE_REUSE_S = 1.0


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them; a connection over the bound
    is closed at once (counted in ``turned_away``)."""

    daemon_threads = True
    #: The listen backlog: connections over the bound are accepted and closed at once, so a
    #: longer queue holds nothing for long, and a scrape is not dropped behind a flood's.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int) -> None:
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_connections)
        self.turned_away = 0

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.turned_away += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()  # no thread started to give it back
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class MetricsServer:
    """``GET /metrics``: this process's registry, then the SDK runtime's page.

    What a caller can take from the process is bounded: ``max_connections`` at once, each closed
    if its request is not whole within ``request_timeout_s``, and one page per ``page_reuse_s``
    however many ask (tests/security/test_metrics_endpoint.py)."""

    def __init__(self, port: int, service: str, host: str | None = None,
                 registry: CollectorRegistry = REGISTRY, worker_heartbeats: bool = True, *,
                 max_connections: int = MAX_CONNECTIONS, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 page_reuse_s: float = PAGE_REUSE_S) -> None:
        self.sdk_port = _free_loopback_port()
        # Prometheus conventions: seconds, and counters end in _total.
        self.runtime = Runtime(telemetry=TelemetryConfig(
            metrics=PrometheusConfig(bind_address=f"127.0.0.1:{self.sdk_port}", durations_as_seconds=True,
                                     unit_suffix=True, counters_total_suffix=True),
            global_tags={"service": service},
        ), worker_heartbeat_interval=WORKER_HEARTBEAT if worker_heartbeats else None)
        self.registry = registry
        self.page_reuse_s = page_reuse_s
        self._page_lock = threading.Lock()
        self._page: tuple[float, bytes] | None = None  # (rendered when, page)
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout_s  # each read and write of the connection's socket

            def setup(self) -> None:
                super().setup()
                # The socket's timeout bounds one read; this bounds the whole request, which a
                # caller sending a byte at a time would otherwise stretch for ever.
                self._request_deadline = threading.Timer(request_timeout_s, self._give_up)
                self._request_deadline.daemon = True
                self._request_deadline.start()

            def _give_up(self) -> None:
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)  # the blocked read returns: the thread ends
                except OSError:
                    pass

            def finish(self) -> None:
                self._request_deadline.cancel()
                super().finish()

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._request_deadline.cancel()  # the request is whole; a page may take its time
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = server.page()
                self.send_response(200)
                self.send_header("Content-Type", TEXT_FORMAT)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # a scrape a second would flood the log
                pass

        self.httpd = _BoundedHTTPServer((host or WorkerEnv.get("metrics_host"), port), Handler, max_connections)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def page(self) -> bytes:
        """The page, rendered at most once per ``page_reuse_s``: scrapes that ask meanwhile (or
        while it renders: its age counts from when it was done) get the same one."""
        with self._page_lock:
            if self._page is None or time.monotonic() - self._page[0] >= self.page_reuse_s:
                page = self._render()
                self._page = (time.monotonic(), page)
            return self._page[1]

    def _render(self) -> bytes:
        # Always the 0.0.4 text format: two text pages concatenate, OpenMetrics pages (one # EOF) do not.
        ours = generate_latest(self.registry)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.sdk_port}/metrics", timeout=5) as answer:
                sdk = answer.read()
        except OSError as error:
            log.warning("the SDK's metrics page did not answer: %s", error)
            sdk = b""
        return ours + sdk

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# -- the fleet, as of now ----------------------------------------------------------------------


@dataclass
class RepairRow:
    workflow_id: str
    node: str
    gpu: int
    site: str
    rung: str
    outcome: str  # in-progress, repaired, needs-person, replaced, ... or the closed status
    open: bool
    started: datetime | None = None


@dataclass
class FleetSnapshot:
    """The fleet as its sources of truth say it is now. A source that failed is named
    in ``errors`` and its part is left empty, never guessed."""

    sites: list = field(default_factory=list)  # fleet.config.Site
    nodes: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))  # site → state → n
    gpus_total: Tally = field(default_factory=Tally)  # site → GPUs on its nodes
    gpus_contained: Tally = field(default_factory=Tally)  # site → GPUs under repair
    repairs: list[RepairRow] = field(default_factory=list)
    site_states: dict[str, str] = field(default_factory=dict)  # site entity's FleetState
    incidents: Tally = field(default_factory=Tally)  # site → open evacuations
    #: site → running Node entities whose FleetState is ``needs-person``: a GPU whose repair ended
    #: unproven (cancelled, failed) is held fenced for a person.
    nodes_needing_a_person: Tally = field(default_factory=Tally)
    accounts: list = field(default_factory=list)  # (account, provider, state, blocked offers)
    spend: dict[tuple[str, str], float] = field(default_factory=dict)  # (site, provider) → $/h
    routing: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, site) → weight
    site_routes: dict[str, int] = field(default_factory=dict)  # site → fleet-wide weight
    capacity_requests: list[tuple[str, str]] = field(default_factory=list)  # (workflow id, FleetState) open
    orphans: Tally = field(default_factory=Tally)  # (site, provider) → machines
    #: Nodes whose Node entity runs (visibility; None: not asked), and by site the nodes that must
    #: have one and do not (``fleet.watched``): nothing watches their health or repairs them.
    watched: set[str] | None = None
    #: Nodes a GpuRepair runs on: a NotReady one among them waits for its entity, so it must have one.
    under_repair: set[str] = field(default_factory=set)
    unwatched: Tally = field(default_factory=Tally)
    #: The source ``spend`` is counted from: the cluster's nodes, or (sim) the providers' machines.
    spend_from: str = "cluster"
    errors: dict[str, str] = field(default_factory=dict)  # source → what went wrong
    taken_at: float = 0.0

    def needs_person(self) -> list[tuple[str, str, str]]:
        return [(name, provider, state) for name, provider, state, blocked in self.accounts
                if state != AccountState.HEALTHY.value or blocked]


def _attr(execution, key) -> object:
    return execution.typed_search_attributes.get(key)


def _repair_outcome(status: WorkflowExecutionStatus | None, state: str | None) -> str:
    if status == WorkflowExecutionStatus.RUNNING:
        return "in-progress"
    if status == WorkflowExecutionStatus.COMPLETED:
        return "repaired" if state in (None, "ready") else str(state)
    return status.name.lower().replace("_", "-") if status else "unknown"


async def _visibility(client: Client, task_queue: str, snap: FleetSnapshot, limit: int) -> set[str]:
    """Repairs, site states, incidents, open capacity requests and joins from Temporal's
    visibility (search attributes). Returns the node names of running joins."""
    queue = f'TaskQueue = "{task_queue}"'
    site_of_node: dict[str, str] = {}
    async for wf in client.list_workflows(f'{queue} AND WorkflowType = "{flows.GpuRepair.TYPE}"', limit=limit):
        node = str(_attr(wf, sa.NODE_NAME) or "")
        site = str(_attr(wf, sa.SITE) or "")
        running = wf.status == WorkflowExecutionStatus.RUNNING
        snap.repairs.append(RepairRow(
            workflow_id=wf.id, node=node, gpu=int(_attr(wf, sa.GPU_INDEX) or 0), site=site,
            rung=str(_attr(wf, sa.REPAIR_RUNG) or "unknown"),
            outcome=_repair_outcome(wf.status, _attr(wf, sa.FLEET_STATE)), open=running, started=wf.start_time,
        ))
        if running:
            snap.gpus_contained[site] += 1
            site_of_node[node] = site
    running = f'{queue} AND ExecutionStatus = "Running"'
    async for wf in client.list_workflows(f'{running} AND WorkflowType = "{flows.Site.TYPE}"', limit=limit):
        site = _attr(wf, sa.SITE) or wf.id.removeprefix("site/")
        snap.site_states[str(site)] = str(_attr(wf, sa.FLEET_STATE) or "")
    async for wf in client.list_workflows(f'{running} AND WorkflowType = "{flows.SiteEvacuation.TYPE}"', limit=limit):
        snap.incidents[str(_attr(wf, sa.SITE) or wf.id.split("/")[1])] += 1
    held = f'{running} AND WorkflowType = "{flows.Node.TYPE}" AND {sa.FLEET_STATE.name} = "needs-person"'
    async for wf in client.list_workflows(held, limit=limit):
        snap.nodes_needing_a_person[str(_attr(wf, sa.SITE) or "")] += 1
    async for wf in client.list_workflows(f'{running} AND WorkflowType = "{flows.AcquireCapacity.TYPE}"', limit=limit):
        snap.capacity_requests.append((wf.id, str(_attr(wf, sa.FLEET_STATE) or "")))
    snap.watched = await running_node_entities(client, task_queue)
    snap.under_repair = await nodes_under_repair(client, task_queue)
    joining: set[str] = set()
    async for wf in client.list_workflows(f'{running} AND WorkflowType = "{flows.NodeJoin.TYPE}"', limit=limit):
        if node := _attr(wf, sa.NODE_NAME):
            joining.add(str(node))
        if _attr(wf, sa.FLEET_STATE) == "provisioning" and (site := _attr(wf, sa.SITE)):
            snap.nodes[str(site)]["provisioning"] += 1
    return joining


def _node_state(node) -> str:
    if not node.ready:
        return "not-ready"
    if node.unschedulable:
        return "cordoned"
    if UNPROVEN_TAINT in node.taints:
        return "unproven"
    return "ready"


def _from_fleet(env: "FleetEnv", snap: FleetSnapshot, joining: set[str] | None, grace: float) -> None:
    """Nodes, GPUs, spend, accounts, routing and orphans from the cluster port, the
    account store and (sim) the simulated providers. Blocking: run in a thread."""
    sites = {s.name: s for s in env.config.sites}
    try:
        nodes = env.cluster.list_nodes()
        for node in nodes:
            site = node.labels.get("node-restriction.kubernetes.io/gpufleet-site") or node.site
            snap.nodes[site][_node_state(node)] += 1
            if site in sites:
                snap.gpus_total[site] += sites[site].gpus_per_machine
    except Exception as error:  # noqa: BLE001 - reported as a failed source
        snap.errors["cluster"] = f"{type(error).__name__}: {error}"
        nodes = None
    # What is billed: every machine the providers hold (sim), else every node of the fleet.
    if env.world is not None:
        snap.spend_from = "providers"
        machines = env.world.machines()
        held = Tally(m["site"] for m in machines)
    else:
        machines = []
        held = Tally(n.labels.get("node-restriction.kubernetes.io/gpufleet-site") or n.site for n in nodes or ())
    for name, count in held.items():
        if name in sites:
            s = sites[name]
            snap.spend[(name, s.provider)] = count * s.gpus_per_machine * s.price_per_gpu_hour
    if nodes is not None and snap.watched is not None:
        try:
            snap.unwatched.update(identity.site for identity
                                  in unwatched_nodes(env.cluster, nodes, snap.watched, snap.under_repair))
        except Exception as error:  # noqa: BLE001 - reported as a failed source
            snap.errors["cluster"] = f"{type(error).__name__}: {error}"
    if nodes is not None and joining is not None:
        known = {n.name for n in nodes} | {n.machine_id for n in nodes} | joining
        now = time.time()
        for m in machines:
            if m["name"] not in known and m["id"] not in known and now - (m["created_at"] or now) >= grace:
                snap.orphans[(m["site"], sites[m["site"]].provider if m["site"] in sites else "")] += 1
    try:
        for account in env.config.accounts:
            record = env.accounts.get(account.name)
            snap.accounts.append((account.name, account.provider, record.state.value, len(record.blocked_offers)))
    except Exception as error:  # noqa: BLE001
        snap.errors["accounts"] = f"{type(error).__name__}: {error}"
    try:
        for model in sorted({s.model for s in env.cluster.list_serving()}):
            table = env.cluster.get_routing(model)
            for site, route in (table.sites.items() if table else ()):
                snap.routing[(model, site)] = route.weight
        routes = env.cluster.get_site_routes()
        for site, route in (routes.sites.items() if routes else ()):
            snap.site_routes[site] = route.weight
    except Exception as error:  # noqa: BLE001
        snap.errors["routing"] = f"{type(error).__name__}: {error}"


async def fleet_snapshot(env: "FleetEnv", client: Client | None, task_queue: str, *,
                         repair_limit: int = 5000, orphan_grace_seconds: float | None = None) -> FleetSnapshot:
    """One consistent look at the fleet. ``client`` None: no Temporal (visibility parts empty)."""
    snap = FleetSnapshot(sites=list(env.config.sites), taken_at=time.time())
    grace = orphan_grace_seconds if orphan_grace_seconds is not None else ControlPlaneEnv.get("orphan_grace_seconds")
    joining = None
    if client is not None:
        try:
            joining = await _visibility(client, task_queue, snap, repair_limit)
        except Exception as error:  # noqa: BLE001
            snap.errors["temporal"] = f"{type(error).__name__}: {error}"
    await asyncio.to_thread(_from_fleet, env, snap, joining, grace)
    return snap


def fleet_families(snap: FleetSnapshot) -> Iterable[GaugeMetricFamily]:
    """A snapshot as Prometheus gauge families (names and labels after Prometheus conventions)."""
    sites = {s.name: s for s in snap.sites}
    # A source's families only when it answered, never as zeros (a cluster that did not answer
    # is not a fleet of 0 ready nodes: that paged GpufleetSiteBelowMinimum for every site);
    # gpufleet_source_up says which did not. The configured bounds need no source.
    cluster = "cluster" not in snap.errors
    if cluster:
        yield _nodes_family(snap, sites)
    yield from _bounds_families(snap)
    if cluster:
        yield _gpus_family(snap, sites)
        yield _not_configured_family(snap, sites, entities="temporal" not in snap.errors)
    if "temporal" not in snap.errors:
        yield from _visibility_families(snap, sites, orphans=cluster)
    if "accounts" not in snap.errors:
        yield from _account_families(snap)
    if snap.spend_from not in snap.errors:
        yield _spend_family(snap, sites)
    if "routing" not in snap.errors:
        yield from _routing_families(snap)
    yield _source_up_family(snap)


def _nodes_family(snap: FleetSnapshot, sites: dict) -> GaugeMetricFamily:
    """Nodes by site and state (the cluster's; provisioning: the running joins)."""
    nodes = GaugeMetricFamily("gpufleet_nodes", "Nodes by site and lifecycle state.", labels=["site", "provider", "state"])
    for name in sorted(set(sites) | set(snap.nodes)):
        provider = sites[name].provider if name in sites else ""
        for state in NODE_STATES:
            nodes.add_metric([name, provider, state], snap.nodes.get(name, Tally())[state])
    return nodes


def _not_configured_family(snap: FleetSnapshot, sites: dict, entities: bool) -> GaugeMetricFamily:
    """Sites the config does not name that the cluster still has nodes at (a site removed before it
    was empty) or, where Temporal answered (``entities``), a Site entity still runs for: nothing
    reconciles, sweeps or counts what is there, and the other figures leave it out. The value is
    the site's nodes (0: only its entity is left)."""
    family = GaugeMetricFamily("gpufleet_site_not_configured", "Sites the fleet config does not name that still "
                               "have nodes (the value) or a running Site entity: nothing reconciles, sweeps or "
                               "prices them.", labels=["site"])
    held = {name: sum(tally.values()) for name, tally in snap.nodes.items() if name and sum(tally.values())}
    for name in sorted((set(held) | (set(snap.site_states) if entities else set())) - set(sites)):
        family.add_metric([name], held.get(name, 0))
    return family


def _bounds_families(snap: FleetSnapshot) -> Iterable[GaugeMetricFamily]:
    """Each site's configured minimum and maximum of nodes."""
    for metric, help_, attr in (("gpufleet_site_min_nodes", "A site's configured minimum of nodes.", "min_nodes"),
                                ("gpufleet_site_max_nodes", "A site's configured maximum of nodes.", "max_nodes")):
        family = GaugeMetricFamily(metric, help_, labels=["site", "provider"])
        for s in snap.sites:
            family.add_metric([s.name, s.provider], getattr(s, attr))
        yield family


def _gpus_family(snap: FleetSnapshot, sites: dict) -> GaugeMetricFamily:
    """Each site's GPUs, healthy or contained by a repair."""
    gpus = GaugeMetricFamily("gpufleet_gpus", "GPUs on the fleet's nodes by site: healthy, or contained by a repair.",
                             labels=["site", "state"])
    for name in sorted(set(sites) | set(snap.gpus_total)):
        contained = snap.gpus_contained[name]
        gpus.add_metric([name, "contained"], contained)
        gpus.add_metric([name, "healthy"], max(0, snap.gpus_total[name] - contained))
    return gpus


def _by_site(family: GaugeMetricFamily, sites: dict, counts: Tally) -> GaugeMetricFamily:
    """``family`` (labelled by site) with a count for every configured site (0 where none), and for
    any other site the count names."""
    for name in sorted(set(sites) | set(counts)):
        family.add_metric([name], counts[name])
    return family


def _visibility_families(snap: FleetSnapshot, sites: dict, orphans: bool) -> Iterable[GaugeMetricFamily]:
    """What Temporal's visibility says: repairs, incidents, site states, open capacity
    requests, and (``orphans``: the cluster answered too) the machines neither a node nor a
    running join holds."""
    repairs = GaugeMetricFamily("gpufleet_repairs", "GPU repairs Temporal's visibility holds, by rung (current or "
                                "last) and outcome (in-progress while open).", labels=["rung", "outcome"])
    for (rung, outcome), n in sorted(Tally((r.rung, r.outcome) for r in snap.repairs).items()):
        repairs.add_metric([rung, outcome], n)
    yield repairs
    open_ = GaugeMetricFamily("gpufleet_repair_in_progress", "1 for each open GPU repair on its current rung "
                              "(a new rung is a new series: alert with `for:`).",
                              labels=["repair", "node", "gpu", "site", "rung"])
    for r in snap.repairs:
        if r.open:
            open_.add_metric([r.workflow_id, r.node, str(r.gpu), r.site, r.rung], 1)
    yield open_
    yield _by_site(GaugeMetricFamily("gpufleet_incidents_open", "Open provider incidents (running evacuations) by "
                                     "site.", labels=["site"]), sites, snap.incidents)
    yield _by_site(GaugeMetricFamily("gpufleet_nodes_needing_a_person", "Nodes whose entity holds a GPU for a person "
                                     "(its repair ended unproven: the GPU stays fenced until `gpufleet repair return` "
                                     "or `retry`), by site.", labels=["site"]), sites, snap.nodes_needing_a_person)
    state = GaugeMetricFamily("gpufleet_site_state", "1 for the state each Site entity reports (FleetState).",
                              labels=["site", "state"])
    for name, word in sorted(snap.site_states.items()):
        state.add_metric([name, word], 1)
    yield state
    yield GaugeMetricFamily("gpufleet_capacity_requests_open", "Open AcquireCapacity requests (pending demand).",
                            value=len(snap.capacity_requests))
    if not orphans:
        return
    yield _by_site(GaugeMetricFamily("gpufleet_nodes_unwatched", "Nodes of the fleet (joined by it, not being "
                                     "retired), Ready or NotReady under a running GpuRepair (which waits for the "
                                     "entity), whose Node entity is not running (terminated, failed): nothing watches "
                                     "their health or repairs them; the site sweep starts each again.",
                                     labels=["site"]), sites, snap.unwatched)
    orphaned = GaugeMetricFamily("gpufleet_orphaned_machines", "Machines a provider holds with neither a node nor "
                                  "a running join, past the grace period.", labels=["site", "provider"])
    for name in sorted(sites):
        orphaned.add_metric([name, sites[name].provider], snap.orphans[(name, sites[name].provider)])
    yield orphaned


def _account_families(snap: FleetSnapshot) -> Iterable[GaugeMetricFamily]:
    """Per provider account: whether a person must act, and its offers blocked over quota."""
    person = GaugeMetricFamily("gpufleet_account_needs_person", "1 when a person must act on a provider account "
                               "(credentials revoked or an offer quota-blocked).", labels=["provider", "account", "state"])
    blocked = GaugeMetricFamily("gpufleet_account_blocked_offers", "Offers blocked over quota per account.",
                                labels=["provider", "account"])
    for name, provider, state_word, n_blocked in snap.accounts:
        needs = state_word != AccountState.HEALTHY.value or n_blocked > 0
        person.add_metric([provider, name, state_word], 1 if needs else 0)
        blocked.add_metric([provider, name], n_blocked)
    yield person
    yield blocked


def _spend_family(snap: FleetSnapshot, sites: dict) -> GaugeMetricFamily:
    """Dollars per hour of the machines held, every configured site (0 when it holds none)."""
    spend = GaugeMetricFamily("gpufleet_spend_dollars_per_hour", "What the machines held cost per hour, by site and "
                              "provider.", labels=["site", "provider", "capacity_type"])
    for name in sorted(sites):
        s = sites[name]
        spend.add_metric([name, s.provider, s.capacity_type.value], snap.spend.get((name, s.provider), 0.0))
    return spend


def _routing_families(snap: FleetSnapshot) -> Iterable[GaugeMetricFamily]:
    """Published routing weights: each model's per site, and each site's fleet-wide."""
    weight = GaugeMetricFamily("gpufleet_routing_weight", "Routing weight of each model at each site (published "
                               "routing document).", labels=["model", "site"])
    for (model, site), w in sorted(snap.routing.items()):
        # The fleet-wide site routes are their own family below.
        if model != SITE_ROUTES:
            weight.add_metric([model, site], w)
    yield weight
    site_weight = GaugeMetricFamily("gpufleet_site_routing_weight", "Fleet-wide weight of each site for new "
                                    "sessions (0: drained or evacuating).", labels=["site"])
    for site, w in sorted(snap.site_routes.items()):
        site_weight.add_metric([site], w)
    yield site_weight


def _source_up_family(snap: FleetSnapshot) -> GaugeMetricFamily:
    """Which sources answered this scrape, so a missing family reads as a failed source."""
    up = GaugeMetricFamily("gpufleet_source_up", "1 when a source of the fleet metrics answered this scrape.",
                           labels=["source"])
    for source in ("cluster", "temporal", "accounts", "routing"):
        up.add_metric([source], 0 if source in snap.errors else 1)
    return up


class FleetCollector:
    """A custom collector: each scrape takes a fresh snapshot on the worker's event loop
    (at most one per ``min_interval`` seconds, so parallel scrapers share it)."""

    def __init__(self, take: Callable[[], "asyncio.Future"], loop: asyncio.AbstractEventLoop,
                 min_interval: float = 1.0, timeout: float = 20.0) -> None:
        self._take = take
        self._loop = loop
        self._min_interval = min_interval
        self._timeout = timeout
        self._lock = threading.Lock()
        self._last: FleetSnapshot | None = None

    def describe(self) -> list:
        return []  # no snapshot at registration time

    def collect(self) -> Iterable[GaugeMetricFamily]:
        with self._lock:
            if self._last is None or time.time() - self._last.taken_at >= self._min_interval:
                try:
                    self._last = asyncio.run_coroutine_threadsafe(self._take(), self._loop).result(self._timeout)
                except Exception as error:  # noqa: BLE001 - a scrape must still answer
                    log.warning("fleet snapshot failed: %s", error)
                    snap = FleetSnapshot(taken_at=time.time())
                    snap.errors = {s: str(error) for s in ("cluster", "temporal", "accounts", "routing")}
                    self._last = snap
            snap = self._last
        return fleet_families(snap)


def watch_fleet(env: "FleetEnv", client: Client, task_queue: str,
                registry: CollectorRegistry = REGISTRY) -> FleetCollector:
    """Register the fleet gauges for this worker (call from inside its event loop)."""
    collector = FleetCollector(lambda: fleet_snapshot(env, client, task_queue), asyncio.get_running_loop())
    registry.register(collector)
    return collector


def start_metrics(flag: int | None, service: str, worker_heartbeats: bool = True) -> MetricsServer | None:
    """The worker's metrics endpoint when a port is configured (``--metrics-port`` or
    ``GPUFLEET_METRICS_PORT``; ``gpufleet dev`` and the manifests set one). ``worker_heartbeats``:
    whether its SDK workers send the server their status every ``WORKER_HEARTBEAT``."""
    port = metrics_port(flag)
    if port is None:
        return None
    server = MetricsServer(port, service, worker_heartbeats=worker_heartbeats)
    log.info("metrics on :%d/metrics (Temporal SDK metrics included)", server.port)
    return server


def agents_running(count: Callable[[], int], registry: CollectorRegistry = REGISTRY):
    """``gpufleet_node_agents_running``: node agents this process runs now (read at scrape)."""
    from prometheus_client import Gauge

    gauge = Gauge("gpufleet_node_agents_running", "Node agents (one per node, polling node/<name>) this process runs.",
          registry=registry)
    gauge.set_function(count)
    return gauge
