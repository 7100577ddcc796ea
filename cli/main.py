"""``gpufleet``: the operator's command line."""

from __future__ import annotations

import asyncio
import enum
import sys
import uuid
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from cli import capacity as capacity_commands
from cli.backup import backup_app
from cli.cluster import cluster_app
from cli.evacuate import evacuate_app
from cli.common import (
    Address,
    OutputFormat,
    failure,
    show_rows,
    ConfigPath,
    Context,
    Kubeconfig,
    Namespace,
    StateDir,
    console,
    err,
    fail,
    fleet_client,
    fleet_env,
    report_config,
    run,
    settings,
    sim_machine,
    sim_world,
)
from cli.common import connect as connect_or_exit
from cli.config_check import (
    driver_reinstall_warnings,
    node_key_warnings,
    stock_image_warnings,
    unannounced_spot_warnings,
)
from cli import demand as demand_commands
from cli.advisor import advisor
from cli.patches import patches_app
from workers.node_gateway import cli as node_gateway_cli
from cli.gameday import gameday_app
from cli.repair import repair_app
from cli.rollout import rollout_app
from cli.top import top
from cli.weights import weights_app
from fleet.config import ConfigError, load_config
from fleet.settings import Settings
from fleet.site_use import join_refusal, removed_site_refusal, removed_sites_in_use

app = typer.Typer(help="gpufleet: one Kubernetes cluster, GPU nodes at many providers, run by Temporal.",
                  no_args_is_help=True, pretty_exceptions_show_locals=False)
config_app = typer.Typer(help="Fleet configuration (sites.yaml).", no_args_is_help=True)
sim_app = typer.Typer(help="Change the simulated world while the dev stack runs.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(sim_app, name="sim")
app.command("capacity")(capacity_commands.capacity)
app.command("capacity-cancel")(capacity_commands.capacity_cancel)
app.add_typer(capacity_commands.schedules_app, name="schedules")
app.add_typer(capacity_commands.accounts_app, name="accounts")
capacity_commands.add_sim_commands(sim_app)
app.add_typer(cluster_app, name="cluster")
app.add_typer(rollout_app, name="rollout")
app.add_typer(repair_app, name="repair")
app.add_typer(evacuate_app, name="evacuate")
app.add_typer(gameday_app, name="gameday")
app.add_typer(weights_app, name="weights")
app.add_typer(backup_app, name="backup")
demand_commands.register(app, sim_app)
app.command("top")(top)
app.command("advisor")(advisor)
app.add_typer(patches_app, name="patches")


# grpc and cryptography load only when it runs (workers/node_gateway.py's main).
app.command("node-gateway")(node_gateway_cli)


# -- dev stack -------------------------------------------------------------------------------
class DevTemporal(str, enum.Enum):
    """``gpufleet dev --temporal``: the Temporal the dev stack runs."""

    dev_server = "dev-server"
    cluster = "cluster"


@app.command()
def dev(
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
    port: Annotated[int, typer.Option(help="Temporal frontend port; every other port derives from it")] = 7233,
    ui_port: Annotated[Optional[int], typer.Option(help="Temporal UI port (default: --port + 1000, i.e. 8233)")] = None,
    http_port: Annotated[Optional[int], typer.Option(
        help="Temporal HTTP API port, plain JSON (default: --port + 10, i.e. 7243)")] = None,
    s3_port: Annotated[Optional[int], typer.Option(
        help="S3 emulator port for the config's loopback object stores (default: --port + 11, i.e. 7244, "
             "for the built-in fleet; a --config keeps the port its endpoints name)")] = None,
    gateway_port: Annotated[Optional[int], typer.Option(
        help="node gateway port (default: --port + 67, i.e. 7300)")] = None,
    front_door_port: Annotated[Optional[int], typer.Option(
        help="front door (HAProxy) port (default: --port + 847, i.e. 8080; left off when that is busy)")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(
        help="metrics port of the control-plane worker; the node host and the dev server take the next two "
             "(--temporal cluster: the node host and its four services the next five) "
             "(default: --port + 2231, i.e. 9464; a busy default is swapped for a free port)")] = None,
    cluster_port: Annotated[Optional[int], typer.Option(
        help="with --temporal cluster: the first of the cluster's 8 other ports (history, matching and worker "
             "gRPC, the four services' membership, PostgreSQL; default: --port + 1, i.e. 7234-7241)")] = None,
    temporal: Annotated[DevTemporal, typer.Option(
        help="Which Temporal the stack runs: `dev-server` (one process, SQLite, with its UI; kept across "
             "restarts) or `cluster` (PostgreSQL + frontend, history, matching and worker services with "
             "deploy/temporal's shards, namespace and dynamic config; thrown away on Ctrl-C)",
        case_sensitive=False)] = DevTemporal.dev_server,
) -> None:
    """Run the dev stack: Temporal dev server + UI, control-plane worker, simulated fleet."""
    from cli.dev import run_dev

    try:
        load_config(config)
    except ConfigError as error:
        report_config(error)
    raise typer.Exit(run_dev(settings(state_dir=state_dir, config=config), port=port, ui_port=ui_port,
                             http_port=http_port, temporal=temporal.value, s3_port=s3_port, gateway_port=gateway_port,
                             front_door_port=front_door_port, metrics_port=metrics_port, cluster_port=cluster_port))


# -- config ----------------------------------------------------------------------------------


@config_app.command("check")
def config_check(
    file: Annotated[Path, typer.Argument(help="sites.yaml to check")],
    fleet: Annotated[bool, typer.Option(
        "--fleet", help="also check it against the fleet running now (mode real: the cluster at --kubeconfig; "
                        "sim: --state-dir): refuse a site it drops while the cluster still has nodes there")] = False,
    state_dir: StateDir = Path(".gpufleet"),
    kubeconfig: Kubeconfig = None,
    context: Context = None,
    namespace: Namespace = "gpufleet",
) -> None:
    """Validate a fleet config; exit 2 naming the site and field of every problem.

    With --fleet, before applying it to a running fleet: exit 1 naming each site it drops that
    the cluster still has nodes (or identity records of nodes, whose machines may still be
    billed) at; nothing would reconcile, sweep or count those once it is applied. Empty such a
    site first (min_nodes and max_nodes 0). Exit 2 when the fleet cannot be read."""
    from cli.config_check import FleetUnreadable, fleet_now

    try:
        config = load_config(file)
    except ConfigError as error:
        report_config(error)
    console.print(f"[green]ok[/]: {len(config.sites)} sites, {len(config.accounts)} accounts ({config.mode} mode)")
    if config.mode == "real":
        for warning in (stock_image_warnings(config) + unannounced_spot_warnings(config) + node_key_warnings(config)
                        + driver_reinstall_warnings(config)):
            err.print(f"[yellow]warning[/]: {escape(warning)}")
    if not fleet:
        return
    try:
        nodes, records = fleet_now(config, state_dir, kubeconfig, context, namespace)
    except FleetUnreadable as error:
        fail(escape(str(error)), 2)
    removed = removed_sites_in_use(config, nodes, records)
    for use in removed:
        err.print(f"[red]refused[/]: {escape(removed_site_refusal(use, str(file)))}")
    if removed:
        raise typer.Exit(1)
    console.print(f"[green]ok[/]: every site the running fleet has nodes at is in {escape(str(file))}")




# -- joining ---------------------------------------------------------------------------------
@app.command()
def join(
    site: Annotated[str, typer.Option(help="site to add nodes at")],
    count: Annotated[int, typer.Option(help="how many nodes")] = 1,
    wait: Annotated[bool, typer.Option(
        "--wait", help="show progress until every node is ready (the default; kept for scripts)")] = True,
    detach: Annotated[bool, typer.Option(
        "--detach", help="start the joins and return: they run on (stop one with `temporal workflow cancel`); "
                         "without it, a command that ends before its joins cancels them, deleting any machine "
                         "not yet admitted")] = False,
    request: Annotated[Optional[str], typer.Option(help="request id (default: random; the same id attaches "
                                                        "to a join still running)")] = None,
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Join nodes at a site: one NodeJoin workflow per node.

    Shows progress until every node is ready. Interrupted (Ctrl-C, SIGTERM, a closed terminal) or
    failing, it cancels its joins: a machine bought and not yet admitted is deleted, a node already
    admitted stays; Ctrl-C says which."""
    del wait  # waiting is the default now; --detach returns at once
    if count < 1:
        fail("--count: must be at least 1", 2)
    _check_join(state_dir, config, site, count)
    raise typer.Exit(run(_join(settings(address, state_dir, config), site, count, detach,
                               request or uuid.uuid4().hex[:8])))


def _check_join(state_dir: Path, config: str | None, site: str, count: int) -> None:
    """Refuse before anything starts: an unknown site, or more nodes than the site can still
    take (its max_nodes less the nodes it has; NodeJoin itself refuses count > max_nodes)."""
    env = fleet_env(state_dir, config)
    have = None  # unknown: the client's check alone (a site the config does not name, max_nodes)
    if any(s.name == site for s in env.config.sites):
        try:
            have = sum(n.labels.get("node-restriction.kubernetes.io/gpufleet-site") == site
                       for n in env.cluster.list_nodes())
        except Exception:  # noqa: BLE001 - the cluster cannot be read from here: max_nodes is still checked
            pass
    refused = join_refusal(env.config, site, count, have)
    if refused is not None:
        field, message = refused
        fail(f"--{field}: {message}", 2)


async def _join(settings: Settings, site: str, count: int, detach: bool, request: str) -> int:
    """Start the joins; unless detached, watch them to the end, and cancel them if we end first."""
    from temporalio.client import WorkflowFailureError

    from cli.requests import announce, cancel_joins, detached, owned

    fleet = fleet_client(settings)
    handles: list = []
    #: Every join asked for, from just before its start call: an interrupt mid-start cancels it too.
    asked: list[str] = []

    async def start_and_watch() -> int:
        from client import InvalidArgument
        from fleet.naming import join_workflow_id

        for i in range(count):
            request_id = request if count == 1 else f"{request}-{i}"
            asked.append(join_workflow_id(site, request_id))
            try:
                handle = await fleet.start_join({"site": site}, request_id=request_id)
            except InvalidArgument as error:
                err.print(f"[red]error:[/] {escape(str(error))}")
                return 2
            handles.append(handle)
            announce(settings, handle.id)
        if detach:
            # Not `gpufleet join --request` again: once a join has ended, that starts (and buys) anew.
            detached(", ".join(h.id for h in handles),
                     "the UI link above, or " + "; ".join(f"temporal workflow query --workflow-id {h.id} --type progress"
                                                         for h in handles),
                     "; ".join(f"temporal workflow cancel --workflow-id {h.id}" for h in handles)
                     + "   (deletes a machine not yet admitted)")
            return 0
        return await _watch_joins(fleet, handles)

    if detach:
        return await start_and_watch()
    return await owned(start_and_watch, lambda why: cancel_joins(fleet, asked, why),
                       "gpufleet join", ended=(WorkflowFailureError,))


async def _watch_joins(fleet, handles: list) -> int:
    """Until every join ends: a live table on a terminal, one line per change when piped; while
    no worker answers, a line that says so (``UnansweredQueries``)."""
    from rich.live import Live
    from temporalio.client import WorkflowFailureError
    from temporalio.exceptions import CancelledError

    from cli.waits import UnansweredQueries

    unanswered = UnansweredQueries()

    def render(states: dict[str, str]):
        table = Table("workflow", "step")
        for wid, step in states.items():
            table.add_row(wid, step)
        return unanswered.beneath(table)

    states = {h.id: "starting" for h in handles}
    failures = []
    # Piped, a live table would print nothing useful: each change is one plain line instead.
    live_view = Live(render(states), console=console, refresh_per_second=4) if console.is_terminal else None
    shown: dict[str, str] = {}

    class _Plain:
        def update(self, _table) -> None:
            for wid, step in states.items():
                if shown.get(wid) != step:
                    shown[wid] = step
                    print(f"{wid}: {Text.from_markup(step).plain}", flush=True)
            if (news := unanswered.news()) is not None:
                print(news, flush=True)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

    async def steps_of(running: list) -> list[str | None]:
        """Each join's step, asked together; None where it went unanswered or raced the join's
        first task (a query may)."""
        answers = await unanswered.ask_together([lambda h=h: fleet.join_progress(h.id) for h in running])
        return [a.step if a is not None and not isinstance(a, BaseException) else None for a in answers]

    pending = {h.id: asyncio.ensure_future(h.result()) for h in handles}
    loop = asyncio.get_running_loop()
    next_look: dict[str, float] = {}
    waits: dict[str, list[str]] = {}
    try:
        with (live_view or _Plain()) as live:
            while pending:
                await asyncio.wait(pending.values(), timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                for handle in handles:
                    task = pending.get(handle.id)
                    if task is None:
                        continue
                    if task.done():
                        pending.pop(handle.id)
                        try:
                            result = task.result()
                            states[handle.id] = "[green]ready[/] " + ", ".join(n.node_name for n in result.nodes)
                        except WorkflowFailureError as error:
                            if isinstance(error.cause, CancelledError):  # by someone else: not a failure of its own
                                kind, message = "Cancelled", await _cancelled_join(fleet, handle.id)
                                states[handle.id] = f"[yellow]{escape(message)}[/]"
                            else:
                                kind, message = failure(error)
                                states[handle.id] = f"[red]{escape(message)}[/]"
                            failures.append((handle.id, kind, message))
                # Asked together: with no worker each query waits its whole bound.
                running = [h for h in handles if h.id in pending]
                for handle, step in zip(running, await steps_of(running)):
                    if step is not None:
                        # Why the step waits (a worker gone, a failed attempt): asked every
                        # few seconds, not every refresh (a describe is a server call).
                        if loop.time() >= next_look.get(handle.id, 0.0):
                            next_look[handle.id] = loop.time() + WAIT_LOOK_SECONDS
                            waits[handle.id] = await _activity_waits(handle)
                        states[handle.id] = step + "".join(f"; {escape(w)}" for w in waits.get(handle.id, []))
                live.update(render(states))
    finally:
        for task in pending.values():
            task.cancel()
    for wid, kind, message in failures:
        if kind == "Cancelled":
            err.print(f"[yellow]{escape(message)}[/]")
        else:
            err.print(f"[red]{wid} failed:[/] {escape(message)}")
    return 1 if failures else 0


async def _cancelled_join(fleet, workflow_id: str) -> str:
    """What a join cancelled elsewhere left: its machine deleted, or nothing bought (the same
    words as ``gpufleet join``'s own cancel; the cancel of an ended join changes nothing)."""
    try:
        return (await fleet.cancel_join(workflow_id)).summary()
    except Exception:  # noqa: BLE001 - the server away: at least how it ended
        return f"cancelled {workflow_id}"


#: How often a watched join's activities are described (cli/waits.py).
WAIT_LOOK_SECONDS = 3.0


async def _activity_waits(handle) -> list[str]:
    from cli.waits import activity_waits

    try:
        return activity_waits((await handle.describe()).raw_description.pending_activities)
    except Exception:  # noqa: BLE001 - the server busy or the run just ended: the next look says
        return []


@app.command()
def reconcile(
    site: Annotated[str, typer.Argument(help="site (as in sites.yaml)")],
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Have a site's entity reconcile now: fill to its min_nodes, retire above its max_nodes. Says
    what it will do (or why not now: an incident open, a fill running); the safety reconcile does
    the same on its own."""
    from client import InvalidArgument, NotFound, Rejected

    fleet = fleet_client(settings(address, state_dir, config))
    try:
        answer = run(fleet.reconcile_site(site))
    except InvalidArgument as error:
        fail(str(error), 2)
    except (Rejected, NotFound) as error:
        fail(f"refused: {error}", 1)
    console.print(f"{site}: {answer}", markup=False, highlight=False)


# -- looking at the fleet --------------------------------------------------------------------


@app.command()
def sites(state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None, output: OutputFormat = "table",
          address: Address = "localhost:7233") -> None:
    """Every site: provider, GPUs, price, min/max; its nodes serving, cordoned (by what: repair,
    quarantine, evacuation, incident, demand loop, a mark's owner, operator), unwatched (Ready, or
    NotReady under a running repair, its Node entity not running: the site sweep starts it again),
    joining; its last incident, and how many put-backs of closed evacuations its Site entity left
    to a person (each named after the list, with what failed and the runbook).

    A cordon nothing running holds is named by its mark (gpufleet.io/cordoned-by): the demand loop's
    retirement, or whoever a person wrote; ``operator`` without one. With the sim: its knobs too."""
    from cli import site_status
    from fleet.watched import unwatched_nodes

    env = fleet_env(state_dir, config)
    nodes = env.cluster.list_nodes()
    names = [site.name for site in env.config.sites]
    holds = run(_site_holds(settings(address, state_dir, config), names, nodes))
    unwatched = unwatched_nodes(env.cluster, nodes, holds.watched, holds.under_repair) if holds is not None else None
    now = site_status.summarize(names, nodes, holds, site_status.cordon_marks(env.cluster, nodes), unwatched)
    columns = ["site", "provider", "region", "geo", "GPU", "$/GPU-h", "type", "min", "max", "serving/nodes",
               "cordoned", "unwatched", "joining", "last incident"]
    sim = {row["name"]: row for row in env.world.sites()} if env.world else {}
    if sim:
        columns += ["capacity", "quota", "latency", "reachable"]
    rows = []
    for site in env.config.sites:
        here = now[site.name]
        row = [site.name, site.provider, site.region, site.geography or "", f"{site.gpus_per_machine}x {site.gpu}",
               f"{site.price_per_gpu_hour:.2f}", site.capacity_type.value, str(site.min_nodes), str(site.max_nodes),
               f"{here.serving}/{here.nodes}",
               f"[yellow]{escape(here.cordoned_cell())}[/]" if sum(here.cordoned.values()) else "0",
               "?" if here.unwatched is None else f"[red]{here.unwatched}[/]" if here.unwatched else "0",
               str(here.joining), escape(here.incident_cell())]
        if site.name in sim:
            s = sim[site.name]
            row += [str(s["capacity"]), str(s["quota"]), f"{s['api_latency_ms']} ms",
                    "[red]no[/]" if s["unreachable"] else "yes"]
        rows.append(row)
    if output != "json" and holds is None:
        err.print(f"Temporal at {settings(address, state_dir, config).address} did not answer: what holds a "
                  "cordoned node, the joins in flight and the last incident show ?")
    elif output != "json" and holds.unanswered:
        err.print(f"what holds a cordoned node could not all be read (those show ?): {escape(holds.unanswered)}")
    # When narrow the site's static facts go first (-o wide and -o json keep every column), then the
    # sim's knobs; what is going on now (serving, cordoned, joining, last incident) stays.
    show_rows("sites", columns, rows, output,
              drop_narrow=("region", "type", "min", "max", "latency", "geo", "quota", "capacity", "$/GPU-h",
                           "provider", ("serving/nodes", "serving"), "GPU", ("last incident", "incident"),
                           ("reachable", "up"), ("joining", "join"), ("unwatched", "unw")))
    # A site dropped from the config while it had nodes is in no row: nothing reconciles, sweeps
    # or counts them, so say so, with what to do.
    for use in removed_sites_in_use(env.config, nodes):
        err.print(f"[yellow]warning[/]: {escape(removed_site_refusal(use, 'the fleet config'))}")
    if output != "json" and holds is not None:
        for site, notes in sorted(holds.put_backs_left.items()):
            for evacuation, note in notes.items():
                err.print(f"[yellow]warning[/]: site {escape(site)}: {escape(evacuation)}: {escape(note)}",
                          soft_wrap=True)


async def _site_holds(config: Settings, names: list[str], nodes: list):
    """What Temporal says holds each site's nodes, or None when it does not answer (the counts
    still come from the cluster)."""
    import socket

    from temporalio.service import RPCError

    from cli import site_status
    from client import Unreachable

    host, _, port = config.address.rpartition(":")
    try:  # a quick look first: a client's connect retries for seconds before it gives up
        socket.create_connection((host or "localhost", int(port)), timeout=2).close()
    except (OSError, ValueError):
        return None
    try:
        client = await fleet_client(config).temporal()
        return await site_status.holds(client, config.task_queue, names, nodes)
    except (Unreachable, RPCError):
        return None


@app.command()
def nodes(state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None, output: OutputFormat = "table") -> None:
    """Cluster nodes with their site, readiness and taints."""
    env = fleet_env(state_dir, config)
    rows = [[node.name, node.labels.get("node-restriction.kubernetes.io/gpufleet-site", ""), node.labels.get("node-restriction.kubernetes.io/gpufleet-provider", ""),
             node.labels.get("nvidia.com/gpu.product", ""), "yes" if node.ready else "[red]no (NotReady)[/]",
             "[yellow]cordoned[/]" if node.unschedulable else "yes", ", ".join(node.taints), node.machine_id]
            for node in env.cluster.list_nodes()]
    show_rows("nodes", ["node", "site", "provider", "GPU", "ready", "schedulable", "taints", "machine"], rows, output,
              drop_narrow=("provider", "machine", "GPU", ("schedulable", "sched")))


@app.command("search-attributes")
def register_search_attributes(address: Address = "localhost:7233") -> None:
    """Register gpufleet's search attributes on the namespace (idempotent)."""
    from fleet import search_attributes

    async def go() -> list[str]:
        return await search_attributes.ensure_registered(await connect_or_exit(settings(address)))

    added = asyncio.run(go())
    console.print(f"added: {', '.join(added)}" if added else "all search attributes already registered")


# -- the simulated world ---------------------------------------------------------------------
# Every knob says the command that undoes it, and `gpufleet sim reset` undoes them all: a tour
# that breaks a site can always put it back.


def _undo(command: str) -> None:
    console.print(f"undo: {command}", markup=False, highlight=False, soft_wrap=True)


def _site_knob(state_dir: Path, config: str | None, site: str, field: str, value, undo) -> None:
    """Set one site knob; ``undo(before)`` is the command that sets it back."""
    world = sim_world(state_dir, config)
    try:
        before = world.site_row(site)[field]
        world.set_site(site, **{field: value})
    except KeyError:
        fail(f"site: unknown site {site!r}; known: {', '.join(r['name'] for r in world.sites())}", 2)
    console.print(f"{site}: {field}={value}" + (" (unchanged)" if before == value else f" (was {before})"))
    _undo(undo(before))


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@sim_app.command("capacity")
def sim_capacity(site: str, machines: int, state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None) -> None:
    """How many more machines a site can sell (0 = NoCapacity)."""
    _site_knob(state_dir, config, site, "capacity", machines, lambda was: f"gpufleet sim capacity {site} {_number(was)}")


@sim_app.command("quota")
def sim_quota(site: str, machines: int, state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None) -> None:
    """How many machines the account may run at the site (reaching it = OverQuota)."""
    _site_knob(state_dir, config, site, "quota", machines, lambda was: f"gpufleet sim quota {site} {_number(was)}")


@sim_app.command("latency")
def sim_latency(site: str, ms: int, state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None) -> None:
    """Provider API latency for the site."""
    _site_knob(state_dir, config, site, "api_latency_ms", ms, lambda was: f"gpufleet sim latency {site} {_number(was)}")


@sim_app.command("unreachable")
def sim_unreachable(
    site: str,
    restore: Annotated[bool, typer.Option("--restore", help="make it reachable again")] = False,
    state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None,
) -> None:
    """Cut the site's machines off the control plane (agents stop, nodes go NotReady)."""
    _site_knob(state_dir, config, site, "unreachable", 0 if restore else 1,
               lambda was: f"gpufleet sim unreachable {site}" + ("" if was else " --restore"))


@sim_app.command("revoke")
def sim_revoke(
    account: str,
    restore: Annotated[bool, typer.Option("--restore", help="make the credentials valid again")] = False,
    state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None,
) -> None:
    """Revoke an account's credentials: every call to it answers BadCredentials."""
    world = sim_world(state_dir, config)
    was = world.query("SELECT credentials_valid FROM accounts WHERE name=?", account)
    try:
        world.set_credentials_valid(account, restore)
    except KeyError:
        known = ", ".join(r[0] for r in world.query("SELECT name FROM accounts ORDER BY name"))
        fail(f"account: unknown account {account!r}; known: {known}", 2)
    console.print(f"{account}: credentials {'valid' if restore else 'revoked'}")
    _undo(f"gpufleet sim revoke {account}" + (" --restore" if was and was[0][0] else ""))


@sim_app.command("fault")
def sim_fault(
    node: Annotated[str, typer.Argument(help="node (machine) name")],
    gpu: Annotated[int, typer.Option(help="GPU index")] = 0,
    xid: Annotated[Optional[int], typer.Option(help="inject this XID")] = None,
    kind: Annotated[str, typer.Option(help="xid, ecc, remap_pending, remap_failure, lost, nvlink_down, hot, compute")] = "xid",
    clears_on: Annotated[str, typer.Option(help="weakest repair that fixes it: reset, reboot, reinstall, never")] = "reset",
    clear: Annotated[bool, typer.Option("--clear", help="remove every simulated fault of this GPU instead")] = False,
    state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None,
) -> None:
    """Break one simulated GPU (or, with --clear, heal it)."""
    world, machine = sim_machine(state_dir, config, node)
    if clear:
        cleared = world.clear_faults(machine["id"], "never", gpu)
        console.print(f"{node} GPU {gpu}: {cleared} simulated fault(s) cleared")
        return
    value = xid if xid is not None else 1
    try:
        world.inject_fault(machine["id"], gpu, kind if xid is None else "xid", value, clears_on)
    except (KeyError, ValueError) as error:
        fail(str(error), 2)
    console.print(f"{node} GPU {gpu}: {'XID ' + str(xid) if xid is not None else kind} (clears on {clears_on})")
    _undo(f"gpufleet sim fault {node} --gpu {gpu} --clear   (the node's repair, if one started, goes on)")


@sim_app.command("reset")
def sim_reset(state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None) -> None:
    """Every knob back to the config's defaults, and the pods `gpufleet sim pods add` made deleted.

    The knobs: each site's capacity, quota, latency and reachability, every account's
    credentials, every injected GPU fault. Machines and nodes stay."""
    env = fleet_env(state_dir, config)
    if env.world is None:
        fail("`gpufleet sim` needs a config in sim mode", 2)
    changes = env.world.reset(env.config)
    pods = demand_commands.remove_added_pods(env)
    for change in changes:
        console.print(f"reset {change}", markup=False, highlight=False)
        if change.endswith(": credentials revoked -> valid"):
            account = change.split(":")[0]
            # A call that failed meanwhile left its ProviderAccount waiting for a person.
            console.print(f"  if gpufleet called it meanwhile: gpufleet accounts credentials-rotated {account}",
                          markup=False, highlight=False)
    for change in pods:
        console.print(f"reset {change}", markup=False, highlight=False)
    if not changes and not pods:
        console.print("nothing to reset: every knob is at its default")
        return
    console.print(", ".join([f"{len(changes)} knob(s) reset"] + ([f"{len(pods)} pod(s) deleted"] if pods else [])))


@sim_app.command("machines")
def sim_machines(state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None,
                 all_: Annotated[bool, typer.Option("--all", help="include deleted")] = False,
                 output: OutputFormat = "table") -> None:
    """Machines the simulated providers hold."""
    world = sim_world(state_dir, config)
    rows = [[m["id"], m["name"], m["site"], m["instance_type"], str(m["reboots"]), "yes" if m["deleted_at"] else ""]
            for m in world.machines(include_deleted=all_)]
    show_rows("simulated machines", ["machine", "name", "site", "type", "reboots", "deleted"], rows, output,
              drop_narrow=("type", "reboots"))


def main() -> None:
    """The ``gpufleet`` console script.

    Ends the process with ``os._exit`` once the command is done and its output and
    traces are flushed: the Temporal client's native threads can abort CPython's
    finalization of a short-lived process ("PyGILState_Release ... finalizing",
    temporalio/sdk-python#300), turning a successful command into exit code -6.
    """
    import os
    import traceback

    from fleet.settings import SettingsError

    try:
        app()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except SettingsError as error:  # a variable refused: the line naming it, as the workers print it
        print(f"gpufleet: {error}", file=sys.stderr)
        code = 2
    except BaseException:  # noqa: BLE001 - shown like the interpreter would, then a clean exit
        traceback.print_exc()
        code = 1
    from fleet.temporal import flush_tracing

    flush_tracing()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
