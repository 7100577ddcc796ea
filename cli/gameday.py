"""``gpufleet gameday ...``: break a simulated site (or a whole geography) on
purpose and measure how the control plane evacuates and restores it.

Sim only. The break is the simulated world's ``unreachable`` knob: the site's
machines stop dialing home, so their nodes go NotReady. The Site entity's
incident rule trips, SiteEvacuation runs; once the site is drained the game day
heals the site (``--heal-after`` seconds later) and waits for the restore.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.live import Live
from rich.table import Table

from cli.common import Address, ConfigPath, StateDir, console, fail, fleet_client, run, settings
from fleet.contracts import workflows as flows
from fleet.naming import node_workflow_id, repair_workflow_id

gameday_app = typer.Typer(no_args_is_help=True)
HealAfter = Annotated[float, typer.Option(help="seconds after the drain before the site is healed")]
Timeout = Annotated[float, typer.Option(help="give up after this many seconds")]
JsonOut = Annotated[Optional[Path], typer.Option("--json", help="also write the measurements here")]

#: The timeline milestones shown and measured, and the SiteEvacuation step that marks each.
MILESTONES = [
    ("detected", "detected"),
    ("weight 0", "weight 0"),
    ("capacity requested", "capacity requested"),
    ("replicas ready elsewhere", "replicas ready elsewhere"),
    ("drained", "drained"),
    ("recovered", "recovered"),
    ("restored", "restored"),
]


@gameday_app.callback()
def gameday() -> None:
    """Game days on the simulated fleet: break sites, watch the evacuation, measure it."""


@gameday_app.command("provider-loss")
def provider_loss(
    site: Annotated[str, typer.Option(help="the site whose provider goes away")],
    heal_after: HealAfter = 2.0,
    timeout: Timeout = 900.0,
    json_out: JsonOut = None,
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Lose one site's provider: detection → weight 0 → capacity elsewhere → drain → recovery → restore.

    Refused before anything breaks (exit 2, naming the join that fixes it) where the site's incident
    rule cannot trip: fewer nodes that can go unreachable (neither cordoned nor unproven) than it
    trips at (incident.min_nodes, 3 by default), or its detection off."""
    _run_gameday(lambda cfg: [_known(cfg, site)], heal_after, timeout, json_out, address, state_dir, config)


@gameday_app.command("region-loss")
def region_loss(
    geo: Annotated[str, typer.Option(help="every site with this geography goes away")],
    heal_after: HealAfter = 2.0,
    timeout: Timeout = 900.0,
    json_out: JsonOut = None,
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Lose every site of a geography at once (refused, as provider-loss is, where any of them cannot trip)."""

    def sites(cfg) -> list[str]:
        found = [s.name for s in cfg.sites if s.geography == geo]
        if not found:
            fail(f"--geo: no site has geography {geo!r}", 2)
        return found

    _run_gameday(sites, heal_after, timeout, json_out, address, state_dir, config)


def _known(cfg, site: str) -> str:
    try:
        cfg.site(site)
    except KeyError:
        fail(f"--site: unknown site {site!r}; known: {', '.join(s.name for s in cfg.sites)}", 2)
    return site


def trip_refusal(cfg, site: str, nodes: list) -> str | None:
    """Why breaking ``site`` cannot set off its incident rule, whose trip the game day waits for,
    or None when it can. The break takes the site's nodes off the control plane only (the provider
    API still answers), so the rule trips only when enough of ``nodes`` (the site's, as the cluster
    lists them now) go NotReady: those neither cordoned nor unproven, which its Site entity counts
    (``max(incident.min_nodes, incident.fraction x the site's nodes)``); or never, with detection
    off. Otherwise the site would stay broken to --timeout, its nodes NotReady, and end ``not
    detected``."""
    from fleet.cluster import UNPROVEN_TAINT
    from fleet.incident import trip_threshold

    settings = cfg.incident_for(cfg.site(site))
    if not settings.enabled:
        return f"{site}: its incident detection is off (incident.enabled: false): breaking it sets off no evacuation"
    can_fail = sum(not n.unschedulable and UNPROVEN_TAINT not in n.taints for n in nodes)
    threshold = trip_threshold(len(nodes), settings)
    if can_fail >= threshold:
        return None
    more = next((k for k in range(1, 1001) if can_fail + k >= trip_threshold(len(nodes) + k, settings)), None)
    join = f"; join {more} more first (gpufleet join --site {site} --count {more})" if more else ""
    return (f"{site}: its incident rule trips at {threshold} unreachable nodes (incident.min_nodes "
            f"{settings.min_nodes}, fraction {settings.fraction:g} of its {len(nodes)}), and it has {can_fail} "
            f"that can go unreachable (neither cordoned nor unproven): breaking it would leave them NotReady "
            f"until --timeout and detect nothing{join}")


def _check_can_trip(cfg, sites: list[str], state_dir, config) -> None:
    """Refuse (exit 2, before anything is broken) a game day whose sites' incident rule cannot trip
    (``trip_refusal``). A cluster that cannot be read from here is no reason to refuse."""
    from cli.common import fleet_env
    from fleet.cluster import LABEL_SITE

    cluster = fleet_env(state_dir, config).cluster
    problems = []
    for site in sites:
        try:
            nodes = cluster.list_nodes({LABEL_SITE: site})
        except Exception:  # noqa: BLE001 - the Site entity still counts them
            continue
        problem = trip_refusal(cfg, site, nodes)
        if problem is not None:
            problems.append(problem)
    if problems:
        from rich.markup import escape

        fail(escape("; ".join(problems)), 2)


def _sim_fleet(address, state_dir, config, breaks: str):
    """The connection settings and the fleet config of a game day, which must be simulated."""
    from fleet.config import ConfigError, load_config

    config_ = settings(address, state_dir, config)
    try:
        cfg = load_config(config_.config)
    except ConfigError as error:
        fail(str(error), 2)
    if cfg.mode != "sim":
        fail(f"game days break {breaks} only (config mode is not sim)", 2)
    return config_, cfg


def _run_gameday(pick, heal_after, timeout, json_out, address, state_dir, config) -> None:
    config_, cfg = _sim_fleet(address, state_dir, config, "simulated sites")
    sites = pick(cfg)
    _check_can_trip(cfg, sites, state_dir, config)
    report = _run_interruptible(_gameday(config_, sites, heal_after, timeout),
                                f"{', '.join(sites)} reachable again")
    console.print(_durations_table(report))
    _print_report(report, json_out)
    if any(s["outcome"] != "restored" for s in report["sites"].values()):
        raise typer.Exit(1)


def _run_interruptible(game_day: Coroutine[Any, Any, dict], undone: str) -> dict:
    """The game day's report. SIGTERM ends it like Ctrl-C does (exit 130), so its `finally` puts
    back what it broke (``undone`` says what)."""
    import signal

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return run(game_day)
    except KeyboardInterrupt:
        console.print(f"interrupted: {undone}")
        raise typer.Exit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _print_report(report: dict, json_out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    console.print_json(text)
    if json_out:
        json_out.write_text(text)


async def _gameday(settings, sites: list[str], heal_after: float, timeout: float) -> dict:
    from sim.world import SimWorld

    fleet = fleet_client(settings, update_answer_timeout=timeout)
    await fleet.temporal()
    world = SimWorld(settings.sim_db)
    for site in sites:  # the Site entities watch their sites (the sweep would start them too)
        await fleet.reconcile_site(site)
    # Evacuations already on record, so the game day watches the new one.
    before: dict[str, int] = {}
    for site in sites:
        status = await fleet.site_status(site)
        before[site] = len(status.incident.history) if status and status.incident else 0

    broke_at = time.time()
    try:
        for site in sites:
            world.set_site(site, unreachable=1)
        return await _watch(fleet, world, sites, before, broke_at, heal_after, timeout)
    finally:  # never leave the sim broken: also on Ctrl-C, SIGTERM or an error
        for site in sites:
            world.set_site(site, unreachable=0)


async def _watch(fleet, world, sites: list[str], before: dict[str, int], broke_at: float, heal_after: float,
                 timeout: float) -> dict:
    from datetime import datetime, timedelta, timezone

    from cli.waits import UnansweredQueries

    state = {s: {"evacuation": "", "progress": None, "healed": None} for s in sites}
    print(f"{time.strftime('%H:%M:%S')} {', '.join(sites)}: lost (machines cut off from the control plane)",
          flush=True)
    deadline = time.monotonic() + timeout
    unanswered = UnansweredQueries(until=datetime.now(timezone.utc) + timedelta(seconds=timeout))
    view = (Live(_timeline_table(sites, state, broke_at), console=console, refresh_per_second=4)
            if console.is_terminal else _MilestoneLines(sites, state, broke_at, unanswered))
    with view as live:
        while time.monotonic() < deadline:
            for site in sites:
                await _follow_site(fleet, world, site, state[site], before[site], heal_after, unanswered)
            live.update(unanswered.beneath(_timeline_table(sites, state, broke_at)))
            if all(s["progress"] is not None and s["progress"].state in ("restored", "aborted")
                   for s in state.values()):
                break
            await asyncio.sleep(0.25)
    return _watch_report(sites, state, broke_at)


def _timeline_table(sites: list[str], state: dict[str, dict], broke_at: float) -> Table:
    """The live view on a terminal: each site's milestones so far, seconds after the break."""
    t = Table(title=f"game day: {', '.join(sites)} lost at {time.strftime('%H:%M:%S', time.localtime(broke_at))}")
    t.add_column("site")
    for label, _ in MILESTONES:
        t.add_column(label, justify="right")
    t.add_column("state")
    for site in sites:
        marks = _marks(state[site]["progress"], broke_at)
        p = state[site]["progress"]
        t.add_row(site, *[f"{marks[label]:.1f}s" if label in marks else "…" for label, _ in MILESTONES],
                  p.state if p else "watching")
    return t


class _MilestoneLines:
    """The view where the console is no terminal, in place of rich's ``Live``: its ``update`` prints
    the new milestones, and when queries stop (and start again) being answered."""

    def __init__(self, sites: list[str], state: dict[str, dict], broke_at: float, unanswered) -> None:
        self.sites, self.state, self.broke_at, self.unanswered = sites, state, broke_at, unanswered
        self.printed: set[tuple[str, str]] = set()

    def update(self, _table) -> None:
        """Each milestone once, as it happens: a pipe or a log gets the timeline live too."""
        for site in self.sites:
            for label, seconds in _marks(self.state[site]["progress"], self.broke_at).items():
                if (site, label) not in self.printed:
                    self.printed.add((site, label))
                    print(f"{time.strftime('%H:%M:%S')} {site}: {label} (+{seconds:.1f}s)", flush=True)
        if (news := self.unanswered.news()) is not None:
            print(f"{time.strftime('%H:%M:%S')} {news}", flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


async def _follow_site(fleet, world, site: str, s: dict, evacuations_before: int, heal_after: float,
                       unanswered) -> None:
    """One look at a lost site: find its (new) evacuation, read its progress, heal the site
    ``heal_after`` seconds after it is drained. Updates ``s``, the site's watch state. A query
    no worker answers is skipped (``unanswered`` says why): the next look asks again."""
    if not s["evacuation"]:
        status = await unanswered.ask(lambda: fleet.site_status(site))
        inc = status.incident if status else None
        if inc and inc.open:
            s["evacuation"] = inc.open.id
        elif inc and len(inc.history) > evacuations_before:
            s["evacuation"] = inc.history[-1].id
    if s["evacuation"]:
        try:
            progress = await unanswered.ask(lambda: fleet.evacuation_progress(s["evacuation"]))
        except Exception:  # noqa: BLE001 - its first task has not run yet
            progress = None
        if progress is not None:  # unanswered: the last progress stands
            s["progress"] = progress
    p = s["progress"]
    drained = p is not None and any(step.name == "drained" for step in p.timeline)
    if drained and s["healed"] is None:
        s["healed"] = time.time() + heal_after
    if s["healed"] is not None and time.time() >= s["healed"] and s["healed"] > 0:
        world.set_site(site, unreachable=0)
        s["healed"] = -1.0  # once
        print(f"{time.strftime('%H:%M:%S')} {site}: healed (reachable again)", flush=True)


def _watch_report(sites: list[str], state: dict[str, dict], broke_at: float) -> dict:
    return {
        "broke_at": broke_at,
        "sites": {
            site: {
                "evacuation": state[site]["evacuation"],
                "outcome": state[site]["progress"].state if state[site]["progress"] else "not detected",
                "seconds_after_break": _marks(state[site]["progress"], broke_at),
            }
            for site in sites
        },
    }


def _marks(progress, broke_at: float) -> dict[str, float]:
    if progress is None:
        return {}
    seen = {}
    for step in progress.timeline:
        seen.setdefault(step.name, round(step.at.timestamp() - broke_at, 3))
    return {label: seen[name] for label, name in MILESTONES if name in seen}


def _durations_table(report: dict) -> Table:
    t = Table(title="measured durations (seconds after the break)")
    t.add_column("milestone")
    for site in report["sites"]:
        t.add_column(site, justify="right")
    for label, _ in MILESTONES:
        t.add_row(label, *[
            f"{s['seconds_after_break'][label]:.2f}" if label in s["seconds_after_break"] else "-"
            for s in report["sites"].values()
        ])
    return t


# -- control-plane loss ------------------------------------------------------------------------
#: The dev stack's control plane: its Temporal server and its control-plane worker. The node gateway,
#: the node agents and the front door stay up (they run beside the nodes in a real deployment).
CONTROL_PLANE = ("temporal", "control-plane")


def control_plane_processes(state_dir: Path) -> dict[str, int]:
    """The pids of the dev stack (``gpufleet dev --state-dir``) Temporal server and control-plane
    worker, found by what `gpufleet dev` starts them with: the server's ``--db-filename`` under the
    state dir, the worker's ``GPUFLEET_STATE_DIR``. Linux (/proc)."""
    state_dir = state_dir.resolve()
    db = str(state_dir / "temporal.db")
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            args = [a.decode(errors="replace") for a in argv if a]
            if "start-dev" in args and "--db-filename" in args:
                given = args[args.index("--db-filename") + 1]
                if given == db or str(Path(given).resolve()) == db:
                    found["temporal"] = int(entry.name)
            elif "workers.control_plane" in args:
                environ = (entry / "environ").read_bytes().split(b"\0")
                wanted = f"GPUFLEET_STATE_DIR={state_dir}".encode()
                if wanted in environ:
                    found["control-plane"] = int(entry.name)
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
            continue
    return found


@gameday_app.command("control-plane-loss")
def control_plane_loss(
    minutes: Annotated[float, typer.Option(help="how long the control plane is away")] = 5.0,
    seconds: Annotated[Optional[float], typer.Option(help="the same in seconds (overrides --minutes)")] = None,
    faults: Annotated[int, typer.Option(help="real GPU faults injected on this many nodes during the outage")] = 2,
    kubelet_lag: Annotated[float, typer.Option(
        help="after the return, each site's kubelets post their status again over this many seconds "
             "(their nodes look NotReady till then: the outage's shadow)")] = 10.0,
    front_door_port: Annotated[int, typer.Option(help="the dev stack's front door (cli.front_door)")] = 8080,
    timeout: Timeout = 900.0,
    json_out: JsonOut = None,
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Lose the control plane (Temporal and its worker) while the fleet serves, then bring it back.

    The processes are stopped (SIGSTOP: frozen, as behind a partition) and continued (SIGCONT);
    `gpufleet dev` keeps owning them. Prints the timeline and exits 1 unless every request was
    served, no healthy node was repaired, no incident opened and every real fault was repaired."""
    config_, cfg = _sim_fleet(address, state_dir, config, "the simulated fleet")
    outage = seconds if seconds is not None else minutes * 60
    if not 0 < outage <= 24 * 3600:
        fail("--minutes/--seconds: the outage must be longer than 0 and at most a day", 2)
    if faults < 0:
        fail("--faults: must be 0 or more", 2)
    if not 0 <= kubelet_lag <= 3600:
        fail("--kubelet-lag: must be between 0 and 3600 seconds", 2)
    if not 0 < front_door_port < 65536:
        fail("--front-door-port: must be a TCP port (1-65535)", 2)
    if kubelet_lag >= cfg.control_plane.return_grace_seconds:
        console.print(f"note: --kubelet-lag {kubelet_lag:g}s is not below control_plane.return_grace_seconds "
                      f"({cfg.control_plane.return_grace_seconds:g}s): the shadow outlasts the grace")
    procs = control_plane_processes(config_.state_dir)
    missing = [name for name in CONTROL_PLANE if name not in procs]
    if missing:
        fail(f"--state-dir: no {' or '.join(missing)} process of a `gpufleet dev` stack with state in "
             f"{config_.state_dir.resolve()} (is it running?)", 2)
    report = _run_interruptible(
        _ControlPlaneLoss(config_, procs, outage, faults, kubelet_lag, front_door_port, timeout).run(),
        "the control plane runs again")
    _print_report(report, json_out)
    if report["problems"]:
        raise typer.Exit(1)


def _freeze(procs: dict[str, int], stop: bool) -> None:
    import os
    import signal

    # The server first when stopping (nothing completes behind it), first again when continuing.
    for name in CONTROL_PLANE:
        try:
            os.kill(procs[name], signal.SIGSTOP if stop else signal.SIGCONT)
        except ProcessLookupError:
            pass


class _Traffic:
    """Requests through the front door, one after another per model, counted by period."""

    def __init__(self, port: int, models: list[str]) -> None:
        self.port, self.models = port, models
        self.counts: dict[str, list[int]] = {}  # period → [served, failed]
        self.period = "before"
        self._stop = asyncio.Event()

    async def run(self) -> None:
        import httpx

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=10) as http:
            while not self._stop.is_set():
                for model in self.models:
                    period = self.period
                    try:
                        r = await http.post(f"/{model}/v1/completions",
                                            json={"prompt": "game day", "max_tokens": 2},
                                            headers={"x-session-id": "gameday"})
                        ok = r.status_code < 400
                    except httpx.HTTPError:
                        ok = False
                    self.counts.setdefault(period, [0, 0])[0 if ok else 1] += 1
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()


def _front_door_models(world, port: int) -> list[str]:
    from cli.dev import wait_for_port
    from sim.cluster import SimCluster

    try:
        wait_for_port(port, timeout=0.5)
    except OSError:
        return []
    return sorted({s.model for s in SimCluster(world).list_serving() if s.available_replicas})


def _shadow(by_site: dict[str, list], at: float, lag: float) -> dict[str, float]:
    """machine id → when its kubelet posts again: at each site the first at once (so the site still
    serves), the others one after another over the second half of ``lag``. Right after the return
    all but one node of every site look NotReady: enough to trip the incident rule (3 of 4 nodes)
    unless the Site entity knows that it was the control plane, not the site, that was away."""
    until = {}
    for nodes in by_site.values():
        rest = nodes[1:]
        for i, node in enumerate(rest):
            until[node.machine_id] = at + lag / 2 + lag / 2 * i / max(1, len(rest) - 1)
    return until


def _fault_targets(by_site: dict[str, list], faults: int) -> list:
    """The ``faults`` nodes that get a real GPU fault during the outage."""
    # Spread over sites, one node each first: a fault here is a GPU's, never a provider incident.
    picked = []
    left = {site: list(site_nodes) for site, site_nodes in by_site.items()}
    while len(picked) < faults and any(left.values()):
        for site in sorted(left):
            if left[site] and len(picked) < faults:
                picked.append(left[site].pop(0))
    return picked


class _ControlPlaneLoss:
    """One control-plane game day, phase by phase (``run``). A phase leaves on ``self`` what the later
    ones read (the nodes, the faults, the boot ids, when the control plane stopped and came back):
    too many values to hand from one to the next as arguments."""

    def __init__(self, settings, procs: dict[str, int], outage: float, faults: int, lag: float, port: int,
                 timeout: float) -> None:
        self.settings, self.procs, self.outage, self.faults = settings, procs, outage, faults
        self.lag, self.port, self.timeout = lag, port, timeout
        self.timeline: list[tuple[float, str]] = []

    async def run(self) -> dict:
        await self._survey()
        traffic = self.traffic = _Traffic(self.port, self.models) if self.models else None
        self.t0 = time.time()
        traffic_task = asyncio.create_task(traffic.run()) if traffic else None
        if traffic:
            self._mark(f"traffic through the front door for {', '.join(self.models)}")
            await asyncio.sleep(1)
        await self._stop_control_plane()
        shadow_until = self._bring_back()
        try:
            steady, state = await _until_steady(self.fleet, self.client, self.settings, self.world, self.sites,
                                                self.picked, self.returned_at, shadow_until, self.timeout)
        finally:
            if traffic:
                traffic.stop()
                await traffic_task
        if steady is not None:
            self._mark("steady state")
        else:
            self._mark(f"no steady state within {self.timeout:g}s: {state['waiting']}")
        report = await self._report(steady, state)
        report["problems"] = _problems(report)
        return report

    def _mark(self, what: str) -> None:
        self.timeline.append((round(time.time() - self.t0, 2), what))
        print(f"{time.strftime('%H:%M:%S')} +{time.time() - self.t0:6.1f}s {what}", flush=True)

    async def _survey(self) -> None:
        """The fleet before the outage: its ready nodes by site, those picked for faults, every
        site's entity running, each machine's boot id, the models the front door serves."""
        from sim.cluster import SimCluster
        from sim.world import SimWorld

        self.fleet = fleet_client(self.settings, update_answer_timeout=self.timeout)
        self.client = await self.fleet.temporal()
        self.world = SimWorld(self.settings.sim_db)
        cluster = SimCluster(self.world)
        self.nodes = [n for n in cluster.list_nodes() if n.ready and n.machine_id and n.site]
        self.by_site: dict[str, list] = {}
        for node in sorted(self.nodes, key=lambda n: n.name):
            self.by_site.setdefault(node.site, []).append(node)
        self.picked = _fault_targets(self.by_site, self.faults)
        self.sites = sorted({n.site for n in self.nodes})
        for site in self.sites:  # every site's entity runs before the outage (the sweep would start them too)
            await self.fleet.reconcile_site(site)
        self.boots = {row["id"]: row["boot_id"] for row in self.world.machines()}
        self.models = await asyncio.to_thread(_front_door_models, self.world, self.port)

    async def _stop_control_plane(self) -> None:
        """The outage: the control plane frozen for ``outage`` seconds while real faults happen, and
        the kubelets' shadow written before it runs again."""
        procs = self.procs
        self._mark(f"control plane stopped ({', '.join(f'{n} pid {procs[n]}' for n in CONTROL_PLANE)}) "
                   f"for {self.outage:g}s")
        if self.traffic:
            self.traffic.period = "outage"
        self.stopped_at = time.time()
        try:
            _freeze(procs, stop=True)
            for node in self.picked:  # faults keep happening, spread over the outage
                await asyncio.sleep(self.outage / (len(self.picked) + 1))
                self.world.inject_fault(node.machine_id, 0, "xid", 48, clears_on="reset")
                self._mark(f"fault: {node.name} GPU 0 XID 48 ({node.site})")
            await asyncio.sleep(max(0.0, self.stopped_at + self.outage - time.time()))
            # Written before the control plane runs again, so its first look finds them.
            self.shadow = _shadow(self.by_site, time.time(), self.lag)
            self.world.silence_kubelets(self.shadow)
        finally:  # never leave the control plane stopped: also on Ctrl-C, SIGTERM or an error
            _freeze(procs, stop=False)

    def _bring_back(self) -> float:
        """The control plane runs again; when the last silenced kubelet posts again."""
        self.returned_at = time.time()
        shadow_until = max(self.shadow.values(), default=self.returned_at)
        self._mark(f"{len(self.shadow)} of {len(self.nodes)} nodes NotReady (their kubelets unheard) until "
                   f"+{shadow_until - self.t0:.1f}s")
        if self.traffic:
            self.traffic.period = "after"
        self._mark("control plane back")
        return shadow_until

    async def _report(self, steady: float | None, state: dict) -> dict:
        """The measurements: requests served, false repairs and incidents, machines disturbed."""
        client, settings, picked, traffic = self.client, self.settings, self.picked, self.traffic
        repairs = await _workflows(client, settings, flows.GpuRepair.TYPE, self.stopped_at - 1)
        incidents = await _workflows(client, settings, flows.SiteEvacuation.TYPE, self.stopped_at - 1)
        faulted = {repair_workflow_id(n.name, 0) for n in picked}
        false_repairs = sorted(set(repairs) - faulted)
        disrupted = sorted(
            row["name"] for row in self.world.machines(include_deleted=True)
            if row["id"] in self.boots and row["id"] not in {n.machine_id for n in picked}
            and (row["deleted_at"] is not None or row["boot_id"] != self.boots[row["id"]])
        )
        served = traffic.counts.get("outage", [0, 0]) if traffic else None
        after = traffic.counts.get("after", [0, 0]) if traffic else None
        return {
            "outage_seconds": round(self.returned_at - self.stopped_at, 2),
            "front_door_models": self.models,
            "requests_during_outage": {"served": served[0], "failed": served[1]} if served else None,
            "requests_after_return": {"served": after[0], "failed": after[1]} if after else None,
            "nodes_not_ready_after_return": len(self.shadow),
            "false_repairs": false_repairs,
            "false_incidents": sorted(incidents),
            "machines_disrupted_without_a_fault": disrupted,
            "real_faults": len(picked),
            "real_faults_repaired": state["repaired"],
            "seconds_to_steady_state": round(steady - self.returned_at, 2) if steady is not None else None,
            "timeline": self.timeline,
        }


def _problems(report: dict) -> list[str]:
    """What the control-plane game day's report shows went wrong (it exits 1 on any)."""
    problems = []
    served = report["requests_during_outage"]
    if served and (served["failed"] or not served["served"]):
        problems.append(f"{served['failed']} of {served['served'] + served['failed']} requests failed "
                        "during the outage")
    if report["false_repairs"]:
        problems.append(f"false repairs: {', '.join(report['false_repairs'])}")
    if report["false_incidents"]:
        problems.append(f"false incidents: {', '.join(report['false_incidents'])}")
    if report["machines_disrupted_without_a_fault"]:
        problems.append("healthy machines rebooted or deleted: "
                        + ", ".join(report["machines_disrupted_without_a_fault"]))
    if report["real_faults_repaired"] != report["real_faults"]:
        problems.append(f"{report['real_faults'] - report['real_faults_repaired']} real faults not repaired")
    if report["seconds_to_steady_state"] is None:
        problems.append("no steady state")
    return problems


async def _workflows(client, settings, workflow_type: str, since: float) -> list[str]:
    from datetime import datetime, timezone

    at = datetime.fromtimestamp(since, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    query = f'WorkflowType = "{workflow_type}" AND StartTime >= "{at}" AND TaskQueue = "{settings.task_queue}"'
    return sorted({wf.id async for wf in client.list_workflows(query)})


async def _until_steady(fleet, client, settings, world, sites, picked, returned_at: float, shadow_until: float,
                        timeout: float):
    """Steady: every Site entity answers and has finished its return grace, every real fault is
    repaired (its GpuRepair closed, the GPU healthy), nothing open retries an activity, and no Node
    entity holds a finding for a healthy GPU. Returns (when, what it last saw). While no worker
    answers a query, a line says so at once (and another once one does)."""
    from datetime import datetime, timedelta, timezone
    from functools import partial

    from cli.waits import UnansweredQueries

    state = {"repaired": 0, "waiting": "the control plane to answer"}
    deadline = time.monotonic() + timeout
    unanswered = UnansweredQueries(until=datetime.now(timezone.utc) + timedelta(seconds=timeout))
    look = partial(_unsteady, fleet, client, settings, world, sites, picked, returned_at, shadow_until, state)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        try:
            waiting = await unanswered.ask(look)
        except Exception as error:  # noqa: BLE001 - the control plane is still waking up
            waiting = [f"the control plane to answer ({type(error).__name__})"]
        if (news := unanswered.news()) is not None:
            print(f"{time.strftime('%H:%M:%S')} {news}", flush=True)
        if waiting is None:
            waiting = [f"the control plane to answer ({unanswered.error})"]
        state["waiting"] = "; ".join(waiting[:4])
        if not waiting:
            return time.time(), state
    return None, state


async def _unsteady(fleet, client, settings, world, sites, picked, returned_at: float, shadow_until: float,
                    state: dict) -> list[str]:
    """One look: what the fleet still waits for before it is steady (``_until_steady``); none when
    it is. Counts the real faults repaired in ``state``."""
    waiting = [] if time.time() >= shadow_until else ["kubelets to post their status again"]
    for site in sites:
        status = await fleet.site_status(site)
        inc = status.incident
        if inc is None or (inc.grace_until is not None and inc.grace_until > time.time()):
            waiting.append(f"site/{site} reconciling")
    repaired = 0
    for node in picked:
        healthy = not any(g.problems() for g in world.gpu_health(node.machine_id))
        closed = False
        try:
            described = await client.get_workflow_handle(repair_workflow_id(node.name, 0)).describe()
            closed = described.status is not None and described.status.name == "COMPLETED" \
                and described.start_time.timestamp() >= returned_at - 600
        except Exception:  # noqa: BLE001 - not started yet
            pass
        repaired += healthy and closed
    state["repaired"] = repaired
    if repaired < len(picked):
        waiting.append(f"{len(picked) - repaired} faults being repaired")
    query = f'TaskQueue = "{settings.task_queue}" AND ExecutionStatus = "Running"'
    async for wf in client.list_workflows(query):
        described = await client.get_workflow_handle(wf.id, run_id=wf.run_id).describe()
        retrying = [a for a in described.raw_description.pending_activities if a.attempt > 3]
        if retrying:
            waiting.append(f"{wf.id} retrying {retrying[0].activity_type.name}")
        if wf.workflow_type == flows.Node.TYPE:
            status = await fleet.node_status(wf.id.removeprefix("node/"))
            if status.deferred and not any(wf.id == node_workflow_id(n.name) for n in picked):
                waiting.append(f"{wf.id} holds a finding")
    return waiting
