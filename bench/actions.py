"""Temporal actions the fleet spends, idle and per event: what Temporal Cloud bills and rate-limits.

Temporal Cloud counts *actions* (workflow starts incl. continue-as-new, activities
scheduled, heartbeats, timers, signals, updates, queries, search-attribute upserts),
~$50 per million, 500 actions/s per namespace by default. This bench runs the fleet
as ``gpufleet dev`` does (control-plane worker, Schedules, the Demand loop, a node
host in its own process, and a ``Routing`` entity per served model) on a dev server with
metrics, and measures:

- the server's own ``action`` counter (``/metrics``), by ``action_type``, around each
  window (its labels carry no workflow type);
- per workflow type: the billable events in each workflow's history inside the window
  (started, activity scheduled, timer started, signaled, update accepted, search
  attributes / properties upserted); heartbeats leave no history, so they are taken
  from the counter (``grpc_RecordActivityTaskHeartbeat``) and shared out by what each type's
  long activities (the Node, Site and Routing watches) were due to send.

Windows: idle (nothing happens but one evacuated site waiting for its recovery: the fleet's empty
site, evacuated by hand before the window, whose SiteEvacuation waits for as long as the window
lasts, the site having no nodes to come back; aborted after it), then events, each charged with the billed history events of
the workflows it ran (every type but the Schedules', which pass on their own clock) and the
heartbeats, less their idle rate over the same time (the server counter's delta less its idle
rate is printed beside it): joins, health changes, spot reclaims (notice →
SpotReclaim done). A health change is what a node's watch returns most of the time, the
traffic "100 health changes a second" stands for: an application XID on a GPU (XID 13),
counted by the Node entity, nothing repaired; a GPU fault that needs a repair is a repair
(its ladder, its own bill), not a health change. Last, a request waiting for capacity at the
empty site (what a site below its min with none to buy runs) through catalog refreshes whose
offers did not change: its own billed events only. Prints actions/hour per idle site,
per evacuated site (its SiteEvacuation, on top of its Site entity), per idle node, per idle
model (its Routing entity) and for the Schedules, actions per event,
the projection for 1,250 and 10,000 nodes at 10 sites and ``MODELS_PROJECTED`` models, and the
targets.

    python -m bench.actions [--idle-seconds 300] [--check]   # --check: an idle window of 1,860 s
    python -m bench.actions --smoke        # short windows (the suite runs this)
"""

from __future__ import annotations

import asyncio
import re
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, AsyncIterator

import httpx
import typer
import yaml
from temporalio.api.enums.v1 import EventType
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from activities.env import FleetEnv
from bench.common import bench_args, command_line, fleet, start_node_host, until, usage_error
from cli.demand import start_demand_loop
from cli.dev import dev_server_tuning_flags, temporal_binary
from fleet import search_attributes
from fleet.cluster import ServingSpec
from fleet.messages.capacity import CapacityProgress, SiteInput
from fleet.messages.routing import RoutingInput
from fleet.incident import IncidentSettings
from fleet.naming import manual_evacuation_id, reclaim_workflow_id, routing_workflow_id
from fleet.schedules import SCHEDULES, apply_schedules
from fleet.settings import Settings
from workers.control_plane import build_worker
from workflows.csr_approver import CSR_WATCH_SECONDS
from workflows.node import WATCH_LONG_WAIT
from workflows.site import SITE_WATCH_SECONDS
from workflows.steps import LONG_WATCH_HEARTBEAT
from fleet.contracts import workflows as flows

#: History events that are billed actions. A child's start and an external signal are
#: counted once, on the receiving workflow (its Started / Signaled event).
BILLED_EVENTS = {
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED: "workflow started",
    EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED: "activity scheduled",
    EventType.EVENT_TYPE_TIMER_STARTED: "timer started",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED: "signal",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED: "update",
    EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES: "search attributes",
    EventType.EVENT_TYPE_WORKFLOW_PROPERTIES_MODIFIED: "memo",
    # Local activities and patches: the server counts a workflow task's markers as one action
    # (``command_BatchMarkers``); counted here each, a little over.
    EventType.EVENT_TYPE_MARKER_RECORDED: "marker",
}
HEARTBEAT = "grpc_RecordActivityTaskHeartbeat"
#: Workflow types the Schedules start (their starts and everything they do).
SCHEDULED_TYPES = {workflow_type for workflow_type, _id, _what in SCHEDULES.values()}
SITES_PROJECTED = 10
#: Models served in the projection, each with its Routing entity (stated in the output).
MODELS_PROJECTED = 50

# -- targets (issue 37) --------------------------------------------------------------------
IDLE_SITE_MAX = 30.0      # actions/hour
#: actions/hour of a site's SiteEvacuation while it waits for the site's recovery (its watch's
#: heartbeats included): what its Site entity costs idle, again
EVACUATED_SITE_MAX = 30.0
IDLE_NODE_MAX = 30.0      # actions/hour, its watch's heartbeats included
IDLE_MODEL_MAX = 30.0     # actions/hour per served model (its Routing entity), heartbeats included
SCHEDULES_MAX = 300.0     # actions/hour, all Schedules together
HEALTH_CHANGE_MAX = 4.0   # actions per health change
#: Actions a request waiting for capacity (a site below its min with none to buy: its fill) spends
#: per catalog refresh (the Schedule's, every 10 minutes) whose offers did not change.
WAITING_REFRESH_MAX = 0.0
NAMESPACE_MAX = 500.0     # actions/s: 10,000 idle nodes at 10 sites + 100 health changes/s
#: The per-node event rates the projection assumes (stated in the output).
HEALTH_CHANGES_PER_NODE_S = 100 / 10_000
JOINS_PER_NODE_HOUR = 1 / (30 * 24)        # each node replaced about once a month
RECLAIMS_PER_NODE_HOUR = 1 / (7 * 24)      # a spot node reclaimed about once a week


def idle_cycles() -> dict[str, float]:
    """What the idle fleet does on a clock of its own, with its period in seconds (the shipped
    defaults). An idle window shorter than a period sees that cycle once or not at all, where its
    share is window / period: a figure from such a window is low by up to that cycle's actions."""
    return {
        "a Site's safety reconcile": SiteInput.model_fields["reconcile_seconds"].default,
        "a Site's watch answering unchanged": SITE_WATCH_SECONDS,
        "a Node's long watch answering unchanged": WATCH_LONG_WAIT,
        "a Routing entity's watch answering unchanged": RoutingInput.model_fields["watch_seconds"].default,
        "an evacuation's recovery watch answering": IncidentSettings().recovery_watch_seconds,
        "the CSR approver's safety sweep": CSR_WATCH_SECONDS,
    }


#: Past the longest idle cycle, so that ``--check`` judges every cycle at its share.
CHECK_IDLE_SECONDS = max(idle_cycles().values()) + 60


def idle_window(seconds: float | None, check: bool) -> tuple[float, dict[str, float]]:
    """The idle window's length (given, else ``CHECK_IDLE_SECONDS`` for ``--check`` and 300 s for
    a look) and the cycles longer than it. ``--check`` with a window that misses one is refused:
    its targets would be judged on a count that leaves out that cycle's actions."""
    window = seconds if seconds is not None else (CHECK_IDLE_SECONDS if check else 300.0)
    missed = {what: every for what, every in idle_cycles().items() if every > window}
    if check and missed:
        what, every = max(missed.items(), key=lambda kv: kv[1])
        usage_error(f"--idle-seconds {window:g} is shorter than {what} (every {every:g} s): its actions would "
                    f"go uncounted and the targets judged without them; give --idle-seconds "
                    f"{CHECK_IDLE_SECONDS:g} or more, or leave it out")
    return window, missed


@asynccontextmanager
async def metrics_env(fleet_config: dict, metrics_port: int) -> AsyncIterator[tuple[WorkflowEnvironment, Settings]]:
    """``bench.common.bench_env`` with the server's Prometheus metrics on ``metrics_port``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sites.yaml"
        path.write_text(yaml.safe_dump(fleet_config))
        env = await WorkflowEnvironment.start_local(
            dev_server_existing_path=temporal_binary(), data_converter=pydantic_data_converter,
            search_attributes=search_attributes.ALL, dev_server_log_level="error",
            dev_server_extra_args=[*dev_server_tuning_flags(), "--metrics-port", str(metrics_port)],
        )
        try:
            settings = Settings(
                address=env.client.service_client.config.target_host, state_dir=Path(tmp),
                config=str(path), task_queue=f"bench-{uuid.uuid4().hex[:6]}",
            )
            yield env, settings
        finally:
            await env.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ACTION = re.compile(r'^action\{([^}]*)\}\s+([0-9.eE+]+)$')


def parse_actions(text: str, namespace: str) -> Counter:
    """The server's ``action`` counter by ``action_type``, for one namespace."""
    counts: Counter = Counter()
    for line in text.splitlines():
        match = _ACTION.match(line)
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if labels.get("namespace") == namespace:
            counts[labels.get("action_type", "?")] += float(match.group(2))
    return counts


class Meter:
    def __init__(self, port: int, namespace: str) -> None:
        self.url, self.namespace = f"http://127.0.0.1:{port}/metrics", namespace

    async def read(self) -> Counter:
        # The server reports its metrics about once a second: wait one out so the window is whole.
        await asyncio.sleep(1.2)
        async with httpx.AsyncClient() as http:
            return parse_actions((await http.get(self.url, timeout=30)).text, self.namespace)


@dataclass
class Window:
    seconds: float
    by_action_type: Counter
    #: workflow type → billed history events inside the window
    by_workflow_type: Counter = field(default_factory=Counter)
    detail: dict[str, Counter] = field(default_factory=dict)
    #: workflow type → heartbeats its activities were due to send inside the window
    heartbeats_due: Counter = field(default_factory=Counter)

    @property
    def total(self) -> float:
        return sum(self.by_action_type.values())


def event_seconds(event) -> float:
    return event.event_time.seconds + event.event_time.nanos / 1e9


def billed_in(events, start: float, end: float) -> Counter:
    """One history's billed events in [start, end] (epoch seconds), by kind."""
    return Counter(BILLED_EVENTS[e.event_type] for e in events
                   if e.event_type in BILLED_EVENTS and start <= event_seconds(e) <= end)


async def billed_by_workflow_type(client, start: float, end: float) -> tuple[Counter, dict[str, Counter], Counter]:
    """Billed history events in [start, end] (epoch seconds), by workflow type and kind; and the
    heartbeats each workflow type's activities were due to send in the window (one per half
    heartbeat timeout from their start while open: how every long activity here beats), the key
    by which the server's heartbeat count, which names no workflow, is shared out."""
    by_type: Counter = Counter()
    detail: dict[str, Counter] = {}
    due: Counter = Counter()
    async for execution in client.list_workflows():
        if execution.close_time is not None and execution.close_time.timestamp() < start:
            continue
        history = await client.get_workflow_handle(execution.id, run_id=execution.run_id).fetch_history()
        billed = billed_in(history.events, start, end)
        if billed:
            by_type[execution.workflow_type] += sum(billed.values())
            detail.setdefault(execution.workflow_type, Counter()).update(billed)
        opened: dict[int, tuple[float, float]] = {}  # scheduled event id → (scheduled at, half timeout)
        closed: dict[int, float] = {}
        for event in history.events:
            at = event_seconds(event)
            if event.HasField("activity_task_scheduled_event_attributes"):
                timeout = event.activity_task_scheduled_event_attributes.heartbeat_timeout.ToTimedelta()
                if timeout.total_seconds() > 0:
                    opened[event.event_id] = (at, timeout.total_seconds() / 2)
            for name in ("activity_task_completed_event_attributes", "activity_task_failed_event_attributes",
                         "activity_task_timed_out_event_attributes", "activity_task_canceled_event_attributes"):
                if event.HasField(name):
                    closed[getattr(event, name).scheduled_event_id] = at
        for event_id, (scheduled, half) in opened.items():
            until = min(closed.get(event_id, end), end)
            beat = scheduled + half
            while beat < until:
                due[execution.workflow_type] += beat >= start
                beat += half
    return by_type, detail, due


def heartbeats_by_type(heartbeats: float, due: Counter) -> dict[str, float]:
    """The server's heartbeat count shared out by what each workflow type's activities were due
    to send (all to the Node entities' watches when nothing says otherwise)."""
    total = sum(due.values())
    if not total:
        return {"Node": heartbeats}
    return {kind: heartbeats * count / total for kind, count in due.items()}


def per_hour(count: float, seconds: float) -> float:
    return count * 3600 / seconds if seconds > 0 else 0.0


def figures(idle: Window, sites: int, nodes: int, models: int = 0, evacuated: int = 0) -> dict[str, float]:
    """Actions/hour per idle site, per idle node, per idle model (its Routing entity) and per
    evacuated site (its SiteEvacuation waiting for recovery; their watches' heartbeats included),
    for the Schedules (the workflows they start, heartbeats included), and the rest."""
    beats = heartbeats_by_type(idle.by_action_type.get(HEARTBEAT, 0.0), idle.heartbeats_due)
    w = Counter(idle.by_workflow_type)
    w.update(beats)
    site = per_hour(w.get("Site", 0), idle.seconds) / sites
    node = (per_hour(w.get("Node", 0), idle.seconds) / nodes) if nodes else 0.0
    model = (per_hour(w.get("Routing", 0), idle.seconds) / models) if models else 0.0
    evacuation = (per_hour(w.get(flows.SiteEvacuation.TYPE, 0), idle.seconds) / evacuated) if evacuated else 0.0
    schedules = per_hour(sum(v for k, v in w.items() if k in SCHEDULED_TYPES), idle.seconds)
    own = ({"Site", "Node"} | ({"Routing"} if models else set())
           | ({flows.SiteEvacuation.TYPE} if evacuated else set()))
    other = per_hour(sum(v for k, v in w.items() if k not in SCHEDULED_TYPES | own), idle.seconds)
    return {"site": site, "node": node, "node_heartbeats": per_hour(beats.get("Node", 0.0), idle.seconds) / max(nodes, 1),
            "site_heartbeats": per_hour(beats.get("Site", 0.0), idle.seconds) / max(sites, 1),
            "model": model, "model_heartbeats": per_hour(beats.get("Routing", 0.0), idle.seconds) / max(models, 1),
            "evacuated": evacuation,
            "evacuated_heartbeats": per_hour(beats.get(flows.SiteEvacuation.TYPE, 0.0), idle.seconds) / max(evacuated, 1),
            "schedules": schedules, "other": other}


def polled_recovery_per_hour(settings: IncidentSettings) -> float:
    """What the wait for recovery cost when it polled (before ``watch_recovery``, whose patch is
    retired), by construction: a ``recovery_probe`` and a timer every ``probe_seconds``."""
    return 2 * 3600 / settings.probe_seconds


def watched_recovery_per_hour(settings: IncidentSettings) -> float:
    """What it costs now, by construction: the watch's return (an activity) every
    ``recovery_watch_seconds`` and its heartbeats, one per half its heartbeat timeout."""
    return 3600 / settings.recovery_watch_seconds + 3600 / (LONG_WATCH_HEARTBEAT.total_seconds() / 2)


def projection(f: dict[str, float], nodes: int, per_event: dict[str, float], price: float,
               models: int = MODELS_PROJECTED) -> dict[str, float]:
    """Actions/s and $/month for ``nodes`` nodes at ``SITES_PROJECTED`` sites serving ``models``
    models."""
    idle = (f["site"] * SITES_PROJECTED + f["node"] * nodes + f.get("model", 0.0) * models
            + f["schedules"] + f["other"]) / 3600
    events = nodes * (HEALTH_CHANGES_PER_NODE_S * per_event.get("health change", 0.0)
                      + JOINS_PER_NODE_HOUR / 3600 * per_event.get("join", 0.0)
                      + RECLAIMS_PER_NODE_HOUR / 3600 * per_event.get("spot reclaim", 0.0))
    per_s = idle + events
    return {"idle": idle, "events": events, "per_s": per_s, "usd_month": per_s * 86400 * 30 * price / 1e6}


async def waiting_request_per_refresh(client, queue: str, world, site: str, refreshes: int) -> Counter:
    """A request waiting for capacity at ``site`` (none left there: what a site below its min with
    none to buy runs, its fill), then ``refreshes`` catalog refreshes as the Schedule runs them, the
    offers unchanged: the billed events of the request's history in that window, by kind."""
    world.set_site(site, capacity=0)

    async def refresh() -> None:
        await client.execute_workflow(flows.CatalogRefresh.TYPE, None, id=f"catalog-refresh-bench-{uuid.uuid4().hex[:6]}",
                                      task_queue=queue)

    await refresh()  # the offers as they now are: the window's refreshes find them unchanged
    handle = await client.start_workflow(
        flows.AcquireCapacity.TYPE, {"constraints": {"sites": [site]}, "count": 1, "deadline_seconds": 3600},
        id=f"capacity/bench-waiting-{uuid.uuid4().hex[:6]}", task_queue=queue)

    async def waits() -> bool:
        return (await handle.query(flows.AcquireCapacity.progress, result_type=CapacityProgress)).step == \
            "waiting for capacity"

    await until(waits, timeout=60, interval=0.2)
    start = time.time()
    for _ in range(refreshes):
        await refresh()
    await asyncio.sleep(3)  # a request woken reads the catalog and waits again within a second
    billed = billed_in((await handle.fetch_history()).events, start, time.time())
    await handle.execute_update(flows.AcquireCapacity.cancel, "the bench is done")
    return billed


async def main(args) -> int:
    if args.smoke:
        args.sites, args.nodes, args.models, args.idle_seconds, args.warmup_seconds = 3, 2, 1, 20, 5
        args.events, args.settle_seconds = 1, 8
    args.idle_seconds, missed = idle_window(args.idle_seconds, args.check and not args.smoke)
    port = free_port()
    config = fleet(sites=args.sites, capacity=args.nodes + 2 * args.events + 4)
    for site in config["sites"]:  # the reclaim burst: only a spot node's notice is acted on
        site["capacity_type"] = "spot"
    # The joined nodes hold no pods: the Demand loop would retire them after its idle TTL (10
    # minutes), in the middle of a long idle window, which is then not idle. Kept for the run.
    config["demand"] = {"idle_ttl_seconds": 7 * 86400}
    # Sites with nodes and sites without: the last site stays empty when there are two or more.
    occupied = max(1, args.sites - 1) if args.sites > 1 else 1
    async with metrics_env(config, port) as (env, settings):
        client, queue = env.client, settings.task_queue
        meter = Meter(port, settings.namespace)
        world = FleetEnv.from_settings(settings).world
        host = start_node_host(settings)
        try:
            async with build_worker(client, settings):
                await apply_schedules(client, queue, site_every=300, catalog_every=600)
                await start_demand_loop(client, queue)
                # Each model served at every site with nodes, its Routing entity started as a site
                # event would (the shipped defaults: a look at load every 30 s, in the worker).
                cluster = FleetEnv.from_settings(settings).cluster
                models = [f"bench-model-{i}" for i in range(args.models)]
                for model in models:
                    for i in range(occupied):
                        cluster.apply_serving(ServingSpec(model=model, site=f"site-{i}", image="vllm:bench"))
                    await client.start_workflow(flows.Routing.TYPE, RoutingInput(model=model).model_dump(mode="json",
                                                exclude_none=True), id=routing_workflow_id(model), task_queue=queue)
                joins = [client.execute_workflow(flows.NodeJoin.TYPE, {"site": f"site-{i % occupied}"},
                                                 id=f"join/site-{i % occupied}/{uuid.uuid4().hex[:6]}",
                                                 task_queue=queue) for i in range(args.nodes)]
                await asyncio.gather(*joins)
                # An evacuated site for the whole run: the empty site (it never comes back: no nodes).
                evacuated = [f"site-{args.sites - 1}"] if args.sites > 1 else []
                for site in evacuated:
                    await client.start_workflow(flows.SiteEvacuation.TYPE, {"site": site, "reason": "bench: site down"},
                                                id=manual_evacuation_id(site, "bench"), task_queue=queue)
                await asyncio.sleep(args.warmup_seconds)

                # -- idle window ----------------------------------------------------------
                before, t0 = await meter.read(), time.time()
                await asyncio.sleep(args.idle_seconds)
                after, t1 = await meter.read(), time.time()
                idle = Window(t1 - t0, after - before)
                # The evacuated site's figure stands only while its evacuation waits for recovery.
                waiting = {site: (await client.get_workflow_handle(manual_evacuation_id(site, "bench")).query(
                    flows.SiteEvacuation.progress) or {}).get("state", "?") for site in evacuated}
                # Ended before the events: a node bought for them at the empty site would "recover"
                # it, and its restore would be charged to that burst.
                for site in evacuated:
                    evacuation = client.get_workflow_handle(manual_evacuation_id(site, "bench"))
                    await evacuation.execute_update(flows.SiteEvacuation.abort, "bench: the idle window is over")
                    await evacuation.result()
                idle.by_workflow_type, idle.detail, idle.heartbeats_due = await billed_by_workflow_type(client, t0, t1)
                idle_rate = idle.total / idle.seconds
                # The idle rate of what an event is charged with: histories of every workflow but
                # the Schedules' (they run on their clock whatever happens), and heartbeats.
                idle_history = sum(v for k, v in idle.by_workflow_type.items() if k not in SCHEDULED_TYPES)
                idle_event_rate = (idle_history + idle.by_action_type.get(HEARTBEAT, 0.0)) / idle.seconds

                # -- events, each burst against the idle rate -------------------------------
                event_kinds: dict[str, Counter] = {}
                event_types: dict[str, dict[str, Counter]] = {}
                counted: dict[str, float] = {}

                async def burst(name: str, act) -> float:
                    start_count, start = await meter.read(), time.time()
                    await act()
                    await asyncio.sleep(args.settle_seconds)
                    end_count, end = await meter.read(), time.time()
                    event_kinds[name] = end_count - start_count
                    by_type, event_types[name], _due = await billed_by_workflow_type(client, start, end)
                    counted[name] = max(0.0, sum((end_count - start_count).values()) - idle_rate * (end - start))
                    # Charged: the billed history events of the workflows the events ran (every
                    # type but the Schedules') and the heartbeats, less their idle rate.
                    spent = (sum(v for k, v in by_type.items() if k not in SCHEDULED_TYPES)
                             + (end_count - start_count).get(HEARTBEAT, 0.0) - idle_event_rate * (end - start))
                    return max(0.0, spent) / args.events

                per_event: dict[str, float] = {}

                async def join() -> None:
                    await asyncio.gather(*[client.execute_workflow(
                        flows.NodeJoin.TYPE, {"site": "site-0"}, id=f"join/site-0/{uuid.uuid4().hex[:6]}", task_queue=queue)
                        for _ in range(args.events)])

                per_event["join"] = await burst("join", join)
                machines = [m for m in world.machines() if m["name"]]

                async def health() -> None:
                    # An application XID: the node's watch returns the change, its entity counts it.
                    for m in machines[: args.events]:
                        world.inject_fault(m["id"], 1, "xid", 13, clears_on="reset")

                per_event["health change"] = await burst("health change", health)

                async def reclaim() -> None:
                    victims = machines[-args.events:]
                    for m in victims:
                        world.post_reclaim_notice(m["id"], seconds=30)

                    async def done() -> bool:
                        for m in victims:
                            try:
                                d = await client.get_workflow_handle(reclaim_workflow_id(m["name"])).describe()
                            except Exception:  # noqa: BLE001 - not started yet
                                return False
                            if d.status is None or d.status.name == "RUNNING":
                                return False
                        return True

                    try:
                        await until(done, timeout=120, interval=0.5)
                    except TimeoutError:
                        print("  (spot reclaims still running after 120 s: counted so far)")

                per_event["spot reclaim"] = await burst("spot reclaim", reclaim)
                waiting = await waiting_request_per_refresh(client, queue, world, f"site-{args.sites - 1}", args.events)
        finally:
            host.terminate()
            host.wait()

    f = figures(idle, args.sites, args.nodes, args.models, len(evacuated))
    incident = IncidentSettings()  # the bench's fleet sets none: the shipped defaults
    waiting_detail = ", ".join(f"{k} {v / args.events:,.1f}" for k, v in waiting.most_common())
    waiting_per_refresh = sum(waiting.values()) / args.events
    print(f"Temporal actions: {args.sites} sites ({occupied if args.sites > 1 else 1} with nodes), {args.nodes} nodes, "
          f"{args.models} models, idle window {idle.seconds:.0f} s")
    if missed:
        print(f"  the idle window is shorter than {len(missed)} of the idle cycles, each seen once or not at all: "
              + "; ".join(f"{what} (every {every:g} s)" for what, every in missed.items())
              + f"; the idle figures may be low by their share (--check waits {CHECK_IDLE_SECONDS:g} s)")
    print(f"  server counter, idle: {per_hour(idle.total, idle.seconds):,.0f} actions/hour in all")
    for action_type, count in idle.by_action_type.most_common():
        if count:
            print(f"    {action_type:44s}{per_hour(count, idle.seconds):10,.0f}/hour")
    if not idle.by_action_type.get(HEARTBEAT):  # read from the counter all the same: none this window
        print(f"    {HEARTBEAT:44s}{0:10,.0f}/hour")
    print("  billed history events, idle, by workflow type, and the heartbeats its activities were due to send "
          "(the counter's heartbeats shared out by those):")
    beats = heartbeats_by_type(idle.by_action_type.get(HEARTBEAT, 0.0), idle.heartbeats_due)
    for workflow_type in sorted(set(idle.by_workflow_type) | set(beats),
                                key=lambda t: -(idle.by_workflow_type.get(t, 0) + beats.get(t, 0))):
        count = idle.by_workflow_type.get(workflow_type, 0) + beats.get(workflow_type, 0.0)
        kinds = [f"{k} {per_hour(v, idle.seconds):,.0f}" for k, v in idle.detail.get(workflow_type, Counter()).most_common()]
        if beats.get(workflow_type):
            kinds.append(f"heartbeats {per_hour(beats[workflow_type], idle.seconds):,.0f}")
        print(f"    {workflow_type:24s}{per_hour(count, idle.seconds):10,.0f}/hour   ({', '.join(kinds)})")
    print(f"  per idle site           {f['site']:10,.1f} actions/hour   (target <= {IDLE_SITE_MAX:g}; "
          f"{f['site_heartbeats']:,.1f} of them heartbeats)")
    if evacuated:
        print(f"  per evacuated site      {f['evacuated']:10,.1f} actions/hour   (target <= {EVACUATED_SITE_MAX:g}; "
              f"{f['evacuated_heartbeats']:,.1f} of them heartbeats; its SiteEvacuation waiting for recovery, "
              f"on top of its Site entity; {', '.join(f'{k} {v}' for k, v in waiting.items())} at the window's end)")
        print(f"      by construction: polled (before) {polled_recovery_per_hour(incident):,.0f}/hour, a probe and a "
              f"timer every {incident.probe_seconds:g} s; watched (now) {watched_recovery_per_hour(incident):,.0f}/hour, "
              f"its watch's return every {incident.recovery_watch_seconds:g} s and its heartbeats")
    print(f"  per idle node           {f['node']:10,.1f} actions/hour   (target <= {IDLE_NODE_MAX:g}; "
          f"{f['node_heartbeats']:,.1f} of them heartbeats)")
    print(f"  per idle model          {f['model']:10,.1f} actions/hour   (target <= {IDLE_MODEL_MAX:g}; "
          f"{f['model_heartbeats']:,.1f} of them heartbeats; its Routing entity)")
    print(f"  Schedules, all          {f['schedules']:10,.1f} actions/hour   (target <= {SCHEDULES_MAX:g})")
    print(f"  everything else         {f['other']:10,.1f} actions/hour   (Demand loop and the like)")
    for name, value in per_event.items():
        target = f"   (target <= {HEALTH_CHANGE_MAX:g})" if name == "health change" else ""
        kinds = ", ".join(f"{k.removeprefix('command_').removeprefix('grpc_')} {v / args.events:,.1f}"
                          for k, v in event_kinds[name].most_common() if v > 0)
        print(f"  per {name:20s}{value:10,.1f} actions{target}")
        print(f"      server counter in its window, less its idle rate: {counted[name] / args.events:,.1f} "
              f"(Schedules' passes included: {kinds})")
        for workflow_type, found in sorted(event_types[name].items()):
            print(f"      {workflow_type:22s}" + ", ".join(f"{k} {v / args.events:,.1f}" for k, v in found.most_common()))
    print(f"  per waiting request, per catalog refresh, offers unchanged {waiting_per_refresh:,.1f} actions   "
          f"(target <= {WAITING_REFRESH_MAX:g}; a site below its min with none to buy: its fill"
          + (f"; {waiting_detail})" if waiting_detail else ")"))
    print(f"  projection at {SITES_PROJECTED} sites and {MODELS_PROJECTED} models, ${args.price_per_million:g} per "
          f"million actions; assumed per node: "
          f"{HEALTH_CHANGES_PER_NODE_S:g} health changes/s, a join every {1 / JOINS_PER_NODE_HOUR / 24:.0f} days, "
          f"a spot reclaim every {1 / RECLAIMS_PER_NODE_HOUR / 24:.0f} days")
    projected = {}
    for nodes in (1_250, 10_000):
        p = projected[nodes] = projection(f, nodes, per_event, args.price_per_million)
        print(f"    {nodes:6,} nodes: {p['idle']:8.1f} actions/s idle + {p['events']:8.1f} for events = "
              f"{p['per_s']:8.1f}/s, ${p['usd_month']:,.0f}/month")
    checks = {
        f"idle site <= {IDLE_SITE_MAX:g}/hour": f["site"] <= IDLE_SITE_MAX,
        **({f"evacuated site <= {EVACUATED_SITE_MAX:g}/hour": f["evacuated"] <= EVACUATED_SITE_MAX} if evacuated else {}),
        f"idle node <= {IDLE_NODE_MAX:g}/hour": f["node"] <= IDLE_NODE_MAX,
        f"idle model <= {IDLE_MODEL_MAX:g}/hour": f["model"] <= IDLE_MODEL_MAX,
        f"Schedules <= {SCHEDULES_MAX:g}/hour": f["schedules"] <= SCHEDULES_MAX,
        f"health change <= {HEALTH_CHANGE_MAX:g} actions": per_event["health change"] <= HEALTH_CHANGE_MAX,
        f"waiting request per refresh <= {WAITING_REFRESH_MAX:g}": waiting_per_refresh <= WAITING_REFRESH_MAX,
        f"10,000 nodes + 100 health changes/s <= {NAMESPACE_MAX:g}/s": projected[10_000]["per_s"] <= NAMESPACE_MAX,
    }
    for name, ok in checks.items():
        print(f"  target {name:48s}{'met' if ok else 'NOT met'}")
    return 1 if args.check and not all(checks.values()) else 0


def cli(
    sites: Annotated[int, typer.Option()] = 5,
    nodes: Annotated[int, typer.Option()] = 6,
    models: Annotated[int, typer.Option(help="models served, each with its Routing entity")] = 2,
    idle_seconds: Annotated[float | None, typer.Option(
        help="the idle window; 300 by default, past the longest idle cycle with --check")] = None,
    warmup_seconds: Annotated[float, typer.Option(
        help="after the joins, before the idle window (first reconciles, first watches)")] = 60,
    events: Annotated[int, typer.Option(help="joins, health changes and reclaims, each")] = 3,
    settle_seconds: Annotated[float, typer.Option(help="after each burst of events")] = 20,
    price_per_million: Annotated[float, typer.Option()] = 50.0,
    smoke: Annotated[bool, typer.Option("--smoke", help="short windows, few events (the suite's size)")] = False,
    check: Annotated[bool, typer.Option("--check", help="exit 1 when a target is not met")] = False,
) -> None:
    sys.exit(asyncio.run(main(bench_args(locals()))))


if __name__ == "__main__":
    command_line(cli, __doc__)
