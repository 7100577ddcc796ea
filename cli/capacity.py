"""``gpufleet capacity``, ``gpufleet schedules ...``, ``gpufleet accounts ...``, ``gpufleet sim reclaim``."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from cli.common import (
    Address, ConfigPath, OutputFormat, StateDir, clock, console, err, fail, fleet_client, run, show_rows, sim_machine,
)
from cli.common import connect as _connect
from cli.common import settings as _settings
from cli.requests import announce, cancel_capacity, cancel_summary, detached, owned, watch_until_done
from fleet.schedules import SCHEDULES, apply_schedules


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
    detach: Annotated[bool, typer.Option(
        "--detach", help="start it and return: the request runs on (cancel it with `gpufleet capacity-cancel`); "
                         "without it, a command that ends before the request cancels it")] = False,
    address: Address = "localhost:7233",
    config: ConfigPath = None,
) -> None:
    """Acquire nodes: cheapest qualifying offers first, falling back across providers.

    Shows progress until the request ends. Interrupted (Ctrl-C, SIGTERM, a closed terminal),
    it cancels the request: joins in flight delete their machines, joined nodes stay."""
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

    settings = _settings(address, config=config)
    fleet = fleet_client(settings)
    try:  # before connecting: a bad or impossible request exits 2 even without a server
        fleet.check_capacity_request(raw)
    except InvalidArgument as error:
        err.print(f"[red]invalid request:[/] {'; '.join(f'{_flag(f)}: {m}' for f, m in error.problems)}")
        raise typer.Exit(2) from None
    code = run(_capacity(fleet, raw, request or uuid.uuid4().hex[:8], detach))
    raise typer.Exit(code)


#: A request field → the option that sets it (refusals name what the operator typed).
FLAGS = {"constraints.gpu": "--gpu", "constraints.gpu_class": "--gpu-class", "constraints.sites": "--site",
         "constraints.geographies": "--geo", "constraints.max_price_per_gpu_hour": "--max-price",
         "constraints.spend_cap_per_hour": "--spend-cap", "constraints.gpu_memory_gb_min": "--min-gpu-memory",
         "constraints.capacity_types": "--on-demand", "count": "--count", "deadline_seconds": "--deadline"}


def _flag(field: str) -> str:
    return ", ".join(FLAGS.get(f.strip(), f.strip()) for f in field.split(","))


def _clock(at) -> str:
    return clock(at) if at is not None else "-"


def capacity_line(workflow_id: str, p) -> str:
    """One line that says where the request is, and while it waits, why and until when."""
    line = f"{workflow_id}: {p.step}, {p.joined} of {p.requested} joined"
    if p.in_flight:
        line += f"; joining at {', '.join(p.in_flight)}"
    if p.wait_until is not None:
        line += f"; looks again at {_clock(p.wait_until)} or when offers change"
    if p.deadline is not None and not p.finished:
        line += f"; gives up at {_clock(p.deadline)}"
    if p.waiting_for:
        line += "; waiting for: " + " | ".join(p.waiting_for)
    return line


async def _capacity(fleet, raw: dict, request: str, detach: bool) -> int:
    from temporalio.client import WorkflowFailureError

    from fleet.naming import capacity_workflow_id

    if detach:
        handle = await fleet.acquire_capacity(raw, request_id=request)
        announce(fleet.settings, handle.id)
        detached(handle.id, f"gpufleet top, or `temporal workflow query --workflow-id {handle.id} --type progress`",
                 f"gpufleet capacity-cancel {handle.id}")
        return 0

    async def start_and_watch():
        handle = await fleet.acquire_capacity(raw, request_id=request)
        announce(fleet.settings, handle.id)
        return await _watch(fleet, handle)

    # Owned from just before the start call: a Ctrl-C while it is in flight (the server may have
    # started the request already) cancels the request too, instead of leaving it buying.
    # Connected first, so an unreachable server is reported as that, with no cancel attempted.
    await fleet.temporal()
    workflow_id = capacity_workflow_id(request)
    try:
        result = await owned(start_and_watch, lambda why: cancel_capacity(fleet, workflow_id, why),
                             "gpufleet capacity", ended=(WorkflowFailureError,))
    except WorkflowFailureError as error:
        from cli.common import failure

        err.print(f"[red]{workflow_id} failed:[/] {failure(error)[1]}")
        return 1
    if isinstance(result, int):  # interrupted: cancelled
        return result
    for node in result.nodes:
        console.print(f"[green]joined[/] {node.node_name} at {node.site} ({node.gpus} GPUs)")
    console.print(f"{len(result.nodes)} of {result.requested} joined, ${result.cost_per_hour:.2f}/h")
    for why in result.why:
        console.print(f"  [yellow]{escape(why)}[/]")
    return 0 if result.complete else 3


async def _watch(fleet, handle):
    """Until the request ends: a live table on a terminal, one line per change when piped."""
    return await watch_until_done(handle, lambda: fleet.capacity_progress(handle.id),
                                  lambda p: capacity_line(handle.id, p),
                                  lambda p, line: _capacity_table(handle.id, p, line))


def _capacity_table(workflow_id: str, p, line: str) -> Table:
    table = Table(title=escape(line), title_justify="left", expand=False)
    table.add_column("what")
    table.add_column("offer / outcome", overflow="fold")
    for w in p.waiting_for:
        table.add_row("[yellow]waiting for[/]", escape(w))
    for c in p.candidates[:5]:
        table.add_row("candidate", escape(c))
    for c in p.in_flight:
        table.add_row("joining", escape(c))
    for r in p.rejected:
        table.add_row("[dim]rejected[/]", escape(r))
    for a in p.attempts[-5:]:
        table.add_row("tried", escape(f"{a.offer}: {a.outcome}"))
    return table


def capacity_cancel(
    request: Annotated[str, typer.Argument(help="capacity/<id> or the request id")],
    reason: Annotated[str, typer.Option(help="why (shown in the request's history)")] = "cancelled by an operator",
    address: Address = "localhost:7233",
) -> None:
    """Cancel a capacity request: joins in flight delete their machines, joined nodes stay."""
    from client import InvalidArgument, NotFound, Rejected
    from client.fleet import capacity_id

    fleet = fleet_client(_settings(address))
    try:
        p = run(fleet.cancel_capacity(request, reason))
    except InvalidArgument as error:
        fail(str(error), 2)
    except (Rejected, NotFound) as error:
        err.print(f"[red]rejected:[/] {error}")
        raise typer.Exit(1) from None
    console.print(cancel_summary(capacity_id(request), p))


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
    """Every ProviderAccount entity and its state, how many of its machines are owed a delete
    (queued while it was revoked: still up, billed; `gpufleet accounts show` names them) and since
    when deletes are owed (they failed after the rotation; the entity tries them again until they run)."""
    from fleet.naming import account_workflow_id

    statuses = run(fleet_client(_settings(address)).accounts(needs_person))
    rows = [[account_workflow_id(s.provider, s.account), s.state.value, str(s.since or ""),
             ", ".join(s.blocked_offers), str(s.deletes_queued_count) if s.deletes_queued_count else "",
             f"since {s.deletes_owed_since}" if s.deletes_owed_since else "", s.reason]
            for s in statuses]
    show_rows("provider accounts",
              ["account", "state", "since", "quota-blocked offers", "deletes queued", "deletes owed", "reason"],
              rows, output, drop_narrow=("since",))


@accounts_app.command("show")
def accounts_show(
    account: str,
    output: OutputFormat = "table",
    address: Address = "localhost:7233", config: ConfigPath = None,
) -> None:
    """One account's state, its blocked offers, and each machine still owed a delete (queued while
    it was revoked: still up, billed until the delete runs), with how long it has waited."""
    import json
    from datetime import datetime, timezone

    from client import InvalidArgument, NotFound
    from fleet.naming import account_workflow_id

    try:
        s = run(fleet_client(_settings(address, config=config)).account_status(account))
    except InvalidArgument as error:
        fail(str(error), 2)
    except NotFound as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    now = datetime.now(timezone.utc)
    waited = {d.machine_id: _waited(now, d.queued_at) for d in s.deletes_queued}
    if output == "json":
        print(json.dumps({**s.model_dump(mode="json"), "deletes_queued": [
            {**d.model_dump(mode="json"), "waited": waited[d.machine_id]} for d in s.deletes_queued]}, indent=2),
            flush=True)
        return
    plain = {"markup": False, "highlight": False, "soft_wrap": True}
    console.print(f"{account_workflow_id(s.provider, s.account)}: {s.state.value}"
                  + (f" since {s.since}" if s.since else "") + (f": {s.reason}" if s.reason else ""), **plain)
    for offer, since in s.blocked_offers.items():
        console.print(f"  quota-blocked: {offer} (since {since})", **plain)
    if s.deletes_owed_since:
        console.print(f"deletes owed since {s.deletes_owed_since}: {s.deletes_failing}", **plain)
    if s.deletes_queued_count:
        then = ("they run once the credentials are rotated (`gpufleet accounts credentials-rotated "
                f"{s.account}`)" if s.state.value == "credentials-revoked" else "the entity runs them")
        console.print(f"{s.deletes_queued_count} machine(s) owed a delete, queued in the account guard (still up, "
                      f"billed; read {s.deletes_queued_read}): {then}", **plain)
        rows = [[d.machine_id, d.site, d.queued_at, waited[d.machine_id]] for d in s.deletes_queued]
        show_rows("machines owed a delete", ["machine", "site", "queued at", "waited"], rows, output)
        more = s.deletes_queued_count - len(s.deletes_queued)
        if more:
            console.print(f"and {more} more (the oldest are shown)", **plain)
    else:
        read = f" (read {s.deletes_queued_read})" if s.deletes_queued_read else ""
        console.print(f"no machine owed a delete{read}", **plain)
    for line in s.history[-5:]:
        console.print(f"  - {line}", **plain)


def _waited(now, queued_at: str) -> str:
    """How long since ``queued_at`` (ISO): ``2d 3h``, ``3h 12m``, ``4m 10s``; "" when not known."""
    from datetime import datetime

    if not queued_at:
        return ""
    seconds = max(0, int((now - datetime.fromisoformat(queued_at)).total_seconds()))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s"


@accounts_app.command("quota-raised")
def accounts_quota_raised(
    account: str,
    offer: Annotated[Optional[list[str]], typer.Option(help="offer site/instance-type (repeat)")] = None,
    all_offers: Annotated[bool, typer.Option("--all", help="every blocked offer of the account")] = False,
    address: Address = "localhost:7233", config: ConfigPath = None,
) -> None:
    """Tell gpufleet a person raised the quota: the offers sell again (name them with --offer, or --all)."""
    if bool(offer) == all_offers:
        err.print("[red]error:[/] --offer: name the offers that sell again (site/instance-type, repeat), "
                  "or give --all" + (", not both" if offer else ""))
        raise typer.Exit(2)
    _update(address, config, lambda fleet: fleet.quota_raised(account, offer or [], all=all_offers))


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
    if status.deletes_owed_since:  # the rotation was taken; the deletes queued while revoked were not run
        console.print(f"deletes owed since {status.deletes_owed_since}: {status.deletes_failing}; the entity tries "
                      "them again until they run (nothing to send again; `gpufleet accounts list` shows them)",
                      markup=False, highlight=False, soft_wrap=True)


# -- sim -----------------------------------------------------------------------------------
def add_sim_commands(sim_app: typer.Typer) -> None:
    @sim_app.command("reclaim")
    def sim_reclaim(
        node: Annotated[str, typer.Argument(help="node (machine) name")],
        seconds: Annotated[float, typer.Option(help="notice before the machine is taken")] = 120,
        state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None,
    ) -> None:
        """Post a spot reclaim notice for a simulated spot machine (its Node entity starts SpotReclaim)."""
        world, machine = sim_machine(state_dir, config, node)
        if machine["capacity_type"] != "spot":
            # Its Node entity would take the notice for a lie from the node: a bad report, nothing reclaimed.
            fail(f"node: {node} is at {machine['site']}, a site of {machine['capacity_type']} machines: "
                 "a provider reclaims only spot machines", 2)
        world.post_reclaim_notice(machine["id"], seconds)
        console.print(f"{node}: reclaim notice, taken in {seconds:.0f}s")
        # Unlike every other knob there is no undo line: a provider that reclaims takes the machine.
        console.print(f"no undo: a spot reclaim cannot be undone, not even by `gpufleet sim reset`: the provider "
                      f"takes {node}, and reclaim/{node} drains it and buys a replacement elsewhere",
                      markup=False, highlight=False, soft_wrap=True)
        console.print(f"instead, to try it on a node you can lose: gpufleet join --site {machine['site']}, "
                      "then gpufleet sim reclaim <that new node>", markup=False, highlight=False, soft_wrap=True)
