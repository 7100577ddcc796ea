"""``gpufleet top``: the fleet on one screen, refreshed in place.

The same snapshot the control-plane worker's Prometheus gauges are computed from
(``workers.metrics.fleet_snapshot``): the cluster port, the simulated world, the
account guard's store and Temporal's visibility list.

On a terminal it refreshes in place, each table fitted to the terminal's width (columns
shorten or go in the order ``SITE_NARROW`` declares; ``-o wide`` keeps them all). Piped, or
with ``-o tsv``/``-o json``, it prints one snapshot and exits.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Group
from rich.measure import Measurement
from rich.text import Text

from cli.common import (Address, ConfigPath, OutputFormat, StateDir, console, fail, fit_table, fleet_env, piped_format,
                        print_table, print_tsv, settings, _plain)

#: The sites table at a narrow terminal, step by step: node-state headers shorten first (their
#: counts stay), then the provider goes (the site's name usually says it), then the rest shorten.
SITE_NARROW = (("provisioning", "prov"), ("unproven", "unpr"), ("cordoned", "cord"), ("not-ready", "down"),
               "provider", ("GPUs ok", "GPUs"), ("contained", "cont"), ("incidents", "inc"), ("weight", "wt"),
               "state")


@dataclass
class Section:
    """One table of the snapshot: what ``top`` draws, and what ``-o tsv``/``json`` print."""

    key: str
    title: str
    columns: list[str]
    rows: list[list] = field(default_factory=list)
    narrow: tuple = ()


def sections(snap) -> tuple[dict[str, str], list[Section]]:
    """The snapshot as a summary and tables: sites, repairs, incidents, accounts waiting for a
    person, pending demand, and the sources that could not be read."""
    from workers.metrics import NODE_STATES

    sites = Section("sites", "sites", ["site", "provider", *NODE_STATES, "GPUs ok", "contained", "incidents", "state",
                                       "weight", "$/h"], narrow=SITE_NARROW)
    def known(text: str, *sources: str) -> str:
        """A figure from a source that did not answer reads "?": it is not known, not 0."""
        return "?" if any(source in snap.errors for source in sources) else text

    total_spend = 0.0
    for site in snap.sites:
        nodes = snap.nodes.get(site.name, {})
        spend = snap.spend.get((site.name, site.provider), 0.0)
        total_spend += spend
        contained = snap.gpus_contained[site.name]
        sites.rows.append([
            site.name, site.provider, *(known(str(nodes.get(state, 0)), "cluster") for state in NODE_STATES),
            known(str(max(0, snap.gpus_total[site.name] - contained)), "cluster", "temporal"),
            known(f"[yellow]{contained}[/]" if contained else "0", "temporal"),
            known(f"[red]{snap.incidents[site.name]}[/]" if snap.incidents[site.name] else "0", "temporal"),
            known(snap.site_states.get(site.name, ""), "temporal"),
            known(str(snap.site_routes.get(site.name, "")), "routing"), known(f"{spend:.2f}", snap.spend_from),
        ])
    parts = [sites]
    open_repairs = [r for r in snap.repairs if r.open]
    if open_repairs:
        parts.append(Section("repairs", "open repairs", ["repair", "site", "rung", "since"],
                             [[r.workflow_id, r.site, r.rung, r.started.strftime("%H:%M:%S") if r.started else ""]
                              for r in open_repairs], narrow=("since",)))
    person = snap.needs_person()
    if person:
        parts.append(Section("accounts", "accounts needing a person", ["account", "provider", "state"],
                             [[name, provider, f"[red]{state}[/]"] for name, provider, state in person]))
    if snap.capacity_requests:
        parts.append(Section("demand", "pending demand", ["request", "state"],
                             [[wid, state] for wid, state in snap.capacity_requests]))
    if snap.errors:
        parts.append(Section("unavailable", "unavailable", ["source", "error"],
                             [[source, error] for source, error in sorted(snap.errors.items())]))
    summary = {
        "nodes": known(str(sum(sum(t.values()) for t in snap.nodes.values())), "cluster"),
        "GPUs": known(str(sum(snap.gpus_total.values())), "cluster"),
        "contained": known(str(sum(snap.gpus_contained.values())), "temporal"),
        "repairs open": known(str(len(open_repairs)), "temporal"),
        "incidents": known(str(sum(snap.incidents.values())), "temporal"),
        "pending requests": known(str(len(snap.capacity_requests)), "temporal"),
        "orphans": known(str(sum(snap.orphans.values())), "cluster", "temporal"),
        "spend $/h": known(f"{total_spend:.2f}", snap.spend_from),
        "at": time.strftime("%H:%M:%S", time.localtime(snap.taken_at)),
    }
    return summary, parts


def render(snap, width: int | None = None, wide: bool = False) -> Group:
    """One frame, each table fitted to ``width`` (the console's by default)."""
    width = console.width if width is None else width
    summary, parts = sections(snap)
    line = (f"nodes {summary['nodes']}  GPUs {summary['GPUs']} ({summary['contained']} contained)  "
            f"repairs open {summary['repairs open']}  incidents {summary['incidents']}  "
            f"pending requests {summary['pending requests']}  orphans {summary['orphans']}  "
            f"spend ${summary['spend $/h']}/h  at {summary['at']}")
    shown: list = [Text(line, style="bold")]
    for part in parts:
        if part.key == "unavailable":
            shown += [Text(f"{source}: unavailable ({error})", style="red") for source, error in part.rows]
            continue
        boxed = fit_table(part.title, part.columns, part.rows, width, wide=True, title_justify="left")
        if wide or Measurement.get(console, console.options.update_width(100_000), boxed).maximum <= width:
            shown.append(boxed)
            continue
        # Narrow: no lines between the columns and one space each (eleven fit 80 columns, every count
        # whole), then the declared steps.
        shown.append(fit_table(part.title, part.columns, part.rows, width, part.narrow, title_justify="left",
                               box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0)))
    return Group(*shown)


def print_snapshot(snap, output: str) -> None:
    """One snapshot in ``output``: ``tsv`` (each table under a ``# title`` line, the summary first)
    or ``json`` (one object: the summary and a list of rows per table)."""
    summary, parts = sections(snap)
    if output == "json":
        document = {"summary": summary} | {
            part.key: [dict(zip(part.columns, [_plain(cell) for cell in row])) for row in part.rows] for part in parts}
        print(json.dumps(document, indent=2), flush=True)
        return
    print("# summary")
    print_tsv(list(summary), [list(summary.values())])
    for part in parts:
        print(f"\n# {part.title}")
        print_tsv(part.columns, part.rows)


def top(
    once: Annotated[bool, typer.Option("--once", help="print one frame and exit (for scripts)")] = False,
    interval: Annotated[float, typer.Option(help="seconds between refreshes")] = 2.0,
    output: OutputFormat = "table",
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """A live view of the fleet: sites, nodes, GPUs, repairs, incidents, pending demand, spend per hour.
    Piped (or with -o tsv/json) it prints one snapshot and exits."""
    if interval <= 0:
        fail("--interval: must be more than 0", 2)
    chosen = piped_format(output)
    env = fleet_env(state_dir, config)
    asyncio.run(_top(env, settings(address, state_dir, config), once, interval, chosen))


async def _top(env, where, once: bool, interval: float, output: str = "table") -> None:
    from rich.live import Live

    from fleet.temporal import connect
    from workers.metrics import fleet_snapshot

    try:
        client = await connect(where)
    except RuntimeError:
        client = None  # the frame says Temporal is unavailable; the cluster and providers still show

    async def snapshot():
        snap = await fleet_snapshot(env, client, where.task_queue)
        if client is None:
            snap.errors["temporal"] = f"cannot reach Temporal at {where.address}"
        return snap

    wide = output == "wide"
    if output in ("tsv", "json"):
        print_snapshot(await snapshot(), output)
        return
    if once or not console.is_terminal:  # a live view has no terminal to redraw: one frame
        print_table(render(await snapshot(), wide=wide), wide=wide)
        return
    with Live(render(await snapshot(), wide=wide), console=console, refresh_per_second=4, screen=False) as live:
        try:
            while True:
                await asyncio.sleep(interval)
                live.update(render(await snapshot(), wide=wide))
        except (KeyboardInterrupt, asyncio.CancelledError):
            pass
