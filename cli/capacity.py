"""``gpufleet capacity``, ``gpufleet schedules ...``, ``gpufleet accounts ...``, ``gpufleet sim reclaim``."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from cli.common import Address, ConfigPath, OutputFormat, StateDir, console, err, fail, fleet_client, run, show_rows, sim_world
from cli.common import connect as _connect
from cli.common import settings as _settings
from fleet.schedules import SCHEDULES, apply_schedules
from fleet.settings import Settings


schedules_app = typer.Typer(help="Temporal Schedules for the periodic work.", no_args_is_help=True)
accounts_app = typer.Typer(help="Provider accounts: what waits for a person, and telling gpufleet it is fixed.",
                           no_args_is_help=True)

#: Schedule id → (workflow type, workflow id, what it does).
# -- capacity ------------------------------------------------------------------------------
def capacity(
    gpu: Annotated[Optional[str], typer.Option(help="GPU type, e.g. H100")] = None,
    gpu_class: Annotated[Optional[list[str]], typer.Option("--gpu-class", help="acceptable GPU types (repeat)")] = None,
    count: Annotated[int, typer.Option(help="nodes wanted")] = 1,
    geo: Annotated[Optional[list[str]], typer.Option(help="allowed geography tag (repeat)")] = None,
    site: Annotated[Optional[list[str]], typer.Option(help="allowed site (repeat)")] = None,
    max_price: Annotated[Optional[float], typer.Option(help="max $ per GPU-hour")] = None,
    spend_cap: Annotated[Optional[float], typer.Option(help="max $ per hour for the whole request")] = None,
    min_gpu_memory: Annotated[int, typer.Option(help="GPU memory floor (GB)")] = 0,
    on_demand: Annotated[bool, typer.Option("--on-demand", help="no spot (on-demand and owned only)")] = False,
    deadline: Annotated[float, typer.Option(help="give up after this many seconds")] = 3600,
    request: Annotated[Optional[str], typer.Option(help="request id (default: random)")] = None,
    wait: Annotated[bool, typer.Option(help="show progress until done")] = True,
    address: Address = "localhost:7233",
) -> None:
    """Acquire nodes: cheapest qualifying offers first, falling back across providers."""
    constraints: dict = {"gpu_memory_gb_min": min_gpu_memory}
    if gpu:
        constraints["gpu"] = gpu
    if gpu_class:
        constraints["gpu_class"] = gpu_class
    if geo:
        constraints["geographies"] = geo
    if site:
        constraints["sites"] = site
    if max_price is not None:
        constraints["max_price_per_gpu_hour"] = max_price
    if spend_cap is not None:
        constraints["spend_cap_per_hour"] = spend_cap
    if on_demand:
        constraints["capacity_types"] = ["on-demand", "owned"]
    raw = {"constraints": constraints, "count": count, "deadline_seconds": deadline}
    from client import InvalidArgument
    from client.fleet import validate
    from fleet.messages.capacity import CapacityRequest

    try:  # before connecting: a bad request exits 2 even without a server
        validate(CapacityRequest, raw, "request")
    except InvalidArgument as error:
        err.print(f"[red]invalid request:[/] {'; '.join(f'{f}: {m}' for f, m in error.problems)}")
        raise typer.Exit(2) from None
    code = run(_capacity(_settings(address), raw, request or uuid.uuid4().hex[:8], wait))
    raise typer.Exit(code)


async def _capacity(settings: Settings, raw: dict, request: str, wait: bool) -> int:
    from rich.live import Live
    from temporalio.client import WorkflowFailureError

    fleet = fleet_client(settings)
    handle = await fleet.acquire_capacity(raw, request_id=request)
    console.print(f"started [bold]{handle.id}[/]")
    if not wait:
        return 0
    result_task = asyncio.ensure_future(handle.result())
    with Live(console=console, refresh_per_second=4) as live:
        while not result_task.done():
            try:
                p = await fleet.capacity_progress(handle.id)
                table = Table(title=f"{handle.id}: {p.step} — {p.joined} of {p.requested} joined")
                table.add_column("what")
                table.add_column("offer / outcome", overflow="fold")
                for c in p.candidates[:5]:
                    table.add_row("candidate", c)
                for c in p.in_flight:
                    table.add_row("joining", c)
                for r in p.rejected:
                    table.add_row("[dim]rejected[/]", r)
                for a in p.attempts[-5:]:
                    table.add_row("tried", f"{a.offer}: {a.outcome}")
                live.update(table)
            except Exception:  # noqa: BLE001 - the first task may not have run yet
                pass
            await asyncio.wait([result_task], timeout=0.5)
    try:
        result = result_task.result()
    except WorkflowFailureError as error:
        from cli.common import failure

        err.print(f"[red]{handle.id} failed:[/] {failure(error)[1]}")
        return 1
    for node in result.nodes:
        console.print(f"[green]joined[/] {node.node_name} at {node.site} ({node.gpus} GPUs)")
    console.print(f"{len(result.nodes)} of {result.requested} joined, ${result.cost_per_hour:.2f}/h")
    for why in result.why:
        console.print(f"  [yellow]{why}[/]")
    return 0 if result.complete else 3


# -- schedules -----------------------------------------------------------------------------
@schedules_app.command("apply")
def schedules_apply(
    site_every: Annotated[float, typer.Option(help="seconds between site reconcile sweeps")] = 300,
    catalog_every: Annotated[float, typer.Option(help="seconds between catalog refreshes")] = 600,
    address: Address = "localhost:7233",
) -> None:
    """Create or update (idempotently) the reconcile-sweep and catalog-refresh Schedules."""
    settings = _settings(address)

    async def go():
        return await apply_schedules(await _connect(settings), settings.task_queue, site_every, catalog_every)

    for schedule_id, what in asyncio.run(go()):
        console.print(f"{what} [bold]{schedule_id}[/]")


@schedules_app.command("list")
def schedules_list(address: Address = "localhost:7233", output: OutputFormat = "table") -> None:
    """gpufleet's Schedules, their interval and next run."""
    settings = _settings(address)

    async def go():
        client = await _connect(settings)
        rows = []
        async for entry in await client.list_schedules():
            if entry.id not in SCHEDULES:
                continue
            desc = await client.get_schedule_handle(entry.id).describe()
            every = ", ".join(f"{i.every.total_seconds():.0f}s" for i in desc.schedule.spec.intervals)
            upcoming = desc.info.next_action_times[:1]
            rows.append((entry.id, SCHEDULES[entry.id][0], every, upcoming[0].isoformat() if upcoming else "-",
                         "paused" if desc.schedule.state.paused else "active"))
        return rows

    show_rows("schedules", ["schedule", "workflow", "every", "next", "state"], [list(r) for r in asyncio.run(go())],
              output, drop_narrow=("workflow",))


# -- accounts ------------------------------------------------------------------------------
@accounts_app.command("list")
def accounts_list(
    needs_person: Annotated[bool, typer.Option("--needs-person", help="only those waiting for a person")] = False,
    output: OutputFormat = "table",
    address: Address = "localhost:7233",
) -> None:
    """Every ProviderAccount entity and its state."""
    from fleet.naming import account_workflow_id

    statuses = run(fleet_client(_settings(address)).accounts(needs_person))
    rows = [[account_workflow_id(s.provider, s.account), s.state.value, str(s.since or ""),
             ", ".join(s.blocked_offers), s.reason] for s in statuses]
    show_rows("provider accounts", ["account", "state", "since", "quota-blocked offers", "reason"], rows, output,
              drop_narrow=("since",))


@accounts_app.command("quota-raised")
def accounts_quota_raised(
    account: str,
    offer: Annotated[Optional[list[str]], typer.Option(help="offer site/instance-type (repeat; default all)")] = None,
    address: Address = "localhost:7233", config: ConfigPath = None,
) -> None:
    """Tell gpufleet a person raised the quota: the offers sell again."""
    _update(address, config, lambda fleet: fleet.quota_raised(account, offer or []))


@accounts_app.command("credentials-rotated")
def accounts_credentials_rotated(account: str, address: Address = "localhost:7233", config: ConfigPath = None) -> None:
    """Tell gpufleet the credentials are fixed (checked with one call before it is accepted)."""
    _update(address, config, lambda fleet: fleet.credentials_rotated(account))


def _update(address: str, config: str | None, call) -> None:
    from client import InvalidArgument, NotFound, Rejected
    from fleet.naming import account_workflow_id

    try:
        status = run(call(fleet_client(_settings(address, config=config))))
    except InvalidArgument as error:
        fail(str(error), 2)
    except (Rejected, NotFound) as error:
        err.print(f"[red]rejected:[/] {error}")
        raise typer.Exit(1) from None
    console.print(f"{account_workflow_id(status.provider, status.account)}: [bold]{status.state.value}[/]")


# -- sim -----------------------------------------------------------------------------------
def add_sim_commands(sim_app: typer.Typer) -> None:
    @sim_app.command("reclaim")
    def sim_reclaim(
        node: Annotated[str, typer.Argument(help="node (machine) name")],
        seconds: Annotated[float, typer.Option(help="notice before the machine is taken")] = 120,
        state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None,
    ) -> None:
        """Post a spot reclaim notice for a simulated machine (its agent starts SpotReclaim)."""
        world = sim_world(state_dir, config)
        machine = world.machine_by_name(node)
        if machine is None:
            fail(f"no simulated machine named {node!r}", 2)
        world.post_reclaim_notice(machine["id"], seconds)
        console.print(f"{node}: reclaim notice, taken in {seconds:.0f}s")
