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
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.live import Live
from rich.table import Table

from cli.common import Address, ConfigPath, StateDir, console, fail, fleet_client, run, settings

gameday_app = typer.Typer(no_args_is_help=True)
HealAfter = Annotated[float, typer.Option(help="seconds after the drain before the site is healed")]
Timeout = Annotated[float, typer.Option(help="give up after this many seconds")]

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
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the measurements here")] = None,
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Lose one site's provider: detection → weight 0 → capacity elsewhere → drain → recovery → restore."""
    _run_gameday(lambda cfg: [_known(cfg, site)], heal_after, timeout, json_out, address, state_dir, config)


@gameday_app.command("region-loss")
def region_loss(
    geo: Annotated[str, typer.Option(help="every site with this geography goes away")],
    heal_after: HealAfter = 2.0,
    timeout: Timeout = 900.0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the measurements here")] = None,
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Lose every site of a geography at once."""

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


def _run_gameday(pick, heal_after, timeout, json_out, address, state_dir, config) -> None:
    from fleet.config import ConfigError, load_config
    config_ = settings(address, state_dir, config)
    try:
        cfg = load_config(config_.config)
    except ConfigError as error:
        fail(str(error), 2)
    if cfg.mode != "sim":
        fail("game days break simulated sites only (config mode is not sim)", 2)
    sites = pick(cfg)
    import signal

    # SIGTERM ends a game day like Ctrl-C does, so its `finally` heals the sites.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        report = run(_gameday(config_, sites, heal_after, timeout))
    except KeyboardInterrupt:
        console.print(f"interrupted: {', '.join(sites)} reachable again")
        raise typer.Exit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    console.print(_durations_table(report))
    text = json.dumps(report, indent=2)
    console.print_json(text)
    if json_out:
        json_out.write_text(text)
    if any(s["outcome"] != "restored" for s in report["sites"].values()):
        raise typer.Exit(1)


async def _gameday(settings, sites: list[str], heal_after: float, timeout: float) -> dict:
    from providers.sim import SimWorld

    fleet = fleet_client(settings)
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
    state = {s: {"evacuation": "", "progress": None, "healed": None} for s in sites}

    def table() -> Table:
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

    printed: set[tuple[str, str]] = set()

    def lines() -> None:
        """Each milestone once, as it happens: a pipe or a log gets the timeline live too."""
        for site in sites:
            for label, seconds in _marks(state[site]["progress"], broke_at).items():
                if (site, label) not in printed:
                    printed.add((site, label))
                    print(f"{time.strftime('%H:%M:%S')} {site}: {label} (+{seconds:.1f}s)", flush=True)

    print(f"{time.strftime('%H:%M:%S')} {', '.join(sites)}: lost (machines cut off from the control plane)",
          flush=True)

    class _Lines:
        def update(self, _table) -> None:
            lines()

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

    deadline = time.monotonic() + timeout
    view = Live(table(), console=console, refresh_per_second=4) if console.is_terminal else _Lines()
    with view as live:
        while time.monotonic() < deadline:
            for site in sites:
                s = state[site]
                if not s["evacuation"]:
                    status = await fleet.site_status(site)
                    inc = status.incident if status else None
                    if inc and inc.open:
                        s["evacuation"] = inc.open.id
                    elif inc and len(inc.history) > before[site]:
                        s["evacuation"] = inc.history[-1].id
                if s["evacuation"]:
                    try:
                        s["progress"] = await fleet.evacuation_progress(s["evacuation"])
                    except Exception:  # noqa: BLE001 - its first task has not run yet
                        pass
                p = s["progress"]
                drained = p is not None and any(step.name == "drained" for step in p.timeline)
                if drained and s["healed"] is None:
                    s["healed"] = time.time() + heal_after
                if s["healed"] is not None and time.time() >= s["healed"] and s["healed"] > 0:
                    world.set_site(site, unreachable=0)
                    s["healed"] = -1.0  # once
                    print(f"{time.strftime('%H:%M:%S')} {site}: healed (reachable again)", flush=True)
            live.update(table())
            if all(s["progress"] is not None and s["progress"].state in ("restored", "aborted")
                   for s in state.values()):
                break
            await asyncio.sleep(0.25)
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
