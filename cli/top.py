"""``gpufleet top``: the fleet on one screen, refreshed in place.

The same snapshot the control-plane worker's Prometheus gauges are computed from
(``workers.metrics.fleet_snapshot``): the cluster port, the simulated world, the
account guard's store and Temporal's visibility list.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from cli.common import Address, ConfigPath, StateDir, console, fail, fleet_env, settings


def render(snap) -> Group:
    """One frame: sites, repairs, incidents, accounts waiting for a person, pending demand."""
    from workers.metrics import NODE_STATES

    sites = Table("site", "provider", *NODE_STATES, "GPUs ok", "contained", "incidents", "state", "weight", "$/h",
                  title="sites", title_justify="left")
    total_spend = 0.0
    for site in snap.sites:
        nodes = snap.nodes.get(site.name, {})
        spend = snap.spend.get((site.name, site.provider), 0.0)
        total_spend += spend
        contained = snap.gpus_contained[site.name]
        sites.add_row(
            site.name, site.provider, *(str(nodes.get(state, 0)) for state in NODE_STATES),
            str(max(0, snap.gpus_total[site.name] - contained)),
            f"[yellow]{contained}[/]" if contained else "0",
            f"[red]{snap.incidents[site.name]}[/]" if snap.incidents[site.name] else "0",
            snap.site_states.get(site.name, ""), str(snap.site_routes.get(site.name, "")), f"{spend:.2f}",
        )
    parts: list = [sites]
    open_repairs = [r for r in snap.repairs if r.open]
    if open_repairs:
        repairs = Table("repair", "site", "rung", "since", title="open repairs", title_justify="left")
        for r in open_repairs:
            repairs.add_row(r.workflow_id, r.site, r.rung, r.started.strftime("%H:%M:%S") if r.started else "")
        parts.append(repairs)
    person = snap.needs_person()
    if person:
        accounts = Table("account", "provider", "state", title="accounts needing a person", title_justify="left")
        for name, provider, state in person:
            accounts.add_row(name, provider, f"[red]{state}[/]")
        parts.append(accounts)
    if snap.capacity_requests:
        demand = Table("request", "state", title="pending demand", title_justify="left")
        for wid, state in snap.capacity_requests:
            demand.add_row(wid, state)
        parts.append(demand)
    orphans = sum(snap.orphans.values())
    summary = (f"nodes {sum(sum(t.values()) for t in snap.nodes.values())}  "
               f"GPUs {sum(snap.gpus_total.values())} ({sum(snap.gpus_contained.values())} contained)  "
               f"repairs open {len(open_repairs)}  incidents {sum(snap.incidents.values())}  "
               f"pending requests {len(snap.capacity_requests)}  orphans {orphans}  "
               f"spend ${total_spend:.2f}/h  at {time.strftime('%H:%M:%S', time.localtime(snap.taken_at))}")
    parts.insert(0, Text(summary, style="bold"))
    for source, error in sorted(snap.errors.items()):
        parts.append(Text(f"{source}: unavailable ({error})", style="red"))
    return Group(*parts)


def top(
    once: Annotated[bool, typer.Option("--once", help="print one frame and exit (for scripts)")] = False,
    interval: Annotated[float, typer.Option(help="seconds between refreshes")] = 2.0,
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """A live view of the fleet: sites, nodes, GPUs, repairs, incidents, pending demand, spend per hour."""
    if interval <= 0:
        fail("--interval: must be more than 0", 2)
    env = fleet_env(state_dir, config)
    asyncio.run(_top(env, settings(address, state_dir, config), once, interval))


async def _top(env, where, once: bool, interval: float) -> None:
    from rich.live import Live

    from fleet.temporal import connect
    from workers.metrics import fleet_snapshot

    try:
        client = await connect(where)
    except RuntimeError:
        client = None  # the frame says Temporal is unavailable; the cluster and providers still show

    async def frame() -> Group:
        snap = await fleet_snapshot(env, client, where.task_queue)
        if client is None:
            snap.errors["temporal"] = f"cannot reach Temporal at {where.address}"
        return render(snap)

    if once:
        console.print(await frame())
        return
    with Live(await frame(), console=console, refresh_per_second=4, screen=False) as live:
        try:
            while True:
                await asyncio.sleep(interval)
                live.update(await frame())
        except (KeyboardInterrupt, asyncio.CancelledError):
            pass
