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
from cli.cluster import cluster_app
from cli.common import (
    Address,
    OutputFormat,
    failure,
    show_rows,
    ConfigPath,
    StateDir,
    console,
    err,
    fail,
    fleet_client,
    fleet_env,
    report_config,
    run,
    settings,
    sim_world,
)
from cli.common import connect as connect_or_exit
from cli.config_check import stock_image_warnings
from cli import demand as demand_commands
from cli.advisor import advisor
from cli.gameday import gameday_app
from cli.repair import repair_app
from cli.rollout import rollout_app
from cli.top import top
from cli.weights import weights_app
from fleet.config import ConfigError, load_config
from fleet.settings import Settings

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
app.add_typer(gameday_app, name="gameday")
app.add_typer(weights_app, name="weights")
demand_commands.register(app, sim_app)
app.command("top")(top)
app.command("advisor")(advisor)


@app.command("node-gateway", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def node_gateway(ctx: typer.Context) -> None:
    """Run the node gateway (mutual TLS in front of Temporal; see ``workers/node_gateway.py``)."""
    from workers.node_gateway import cli as gateway_cli  # grpc and cryptography load only here

    gateway_cli(ctx)


# -- dev stack -------------------------------------------------------------------------------
class DevTemporal(str, enum.Enum):
    """``gpufleet dev --temporal``: the Temporal the dev stack runs."""

    dev_server = "dev-server"
    cluster = "cluster"


@app.command()
def dev(
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
    port: Annotated[int, typer.Option(help="Temporal frontend port")] = 7233,
    ui_port: Annotated[int, typer.Option(help="Temporal UI port")] = 8233,
    http_port: Annotated[Optional[int], typer.Option(
        help="Temporal HTTP API port, plain JSON (default: --port + 10, i.e. 7243)")] = None,
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
                               http_port=port + 10 if http_port is None else http_port, temporal=temporal.value))


# -- config ----------------------------------------------------------------------------------


@config_app.command("check")
def config_check(file: Annotated[Path, typer.Argument(help="sites.yaml to check")]) -> None:
    """Validate a fleet config; exit 2 naming the site and field of every problem."""
    try:
        config = load_config(file)
    except ConfigError as error:
        report_config(error)
    console.print(f"[green]ok[/]: {len(config.sites)} sites, {len(config.accounts)} accounts ({config.mode} mode)")
    if config.mode == "real":
        for warning in stock_image_warnings(config):
            err.print(f"[yellow]warning[/]: {escape(warning)}")




# -- joining ---------------------------------------------------------------------------------
@app.command()
def join(
    site: Annotated[str, typer.Option(help="site to add nodes at")],
    count: Annotated[int, typer.Option(help="how many nodes")] = 1,
    wait: Annotated[bool, typer.Option(help="wait and show progress until every node is ready")] = False,
    request: Annotated[Optional[str], typer.Option(help="request id (default: random)")] = None,
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Join nodes at a site: one NodeJoin workflow per node."""
    if count < 1:
        fail("--count: must be at least 1", 2)
    _check_join(state_dir, config, site, count)
    run(_join(settings(address, state_dir, config), site, count, wait, request or uuid.uuid4().hex[:8]))


def _check_join(state_dir: Path, config: str | None, site: str, count: int) -> None:
    """Refuse before anything starts: an unknown site, or more nodes than the site can still
    take (its max_nodes less the nodes it has; NodeJoin itself refuses count > max_nodes)."""
    env = fleet_env(state_dir, config)
    try:
        where = env.config.site(site)
    except KeyError:
        fail(f"--site: unknown site {site!r}; known: {', '.join(s.name for s in env.config.sites)}", 2)
    try:
        have = sum(n.labels.get("node-restriction.kubernetes.io/gpufleet-site") == site for n in env.cluster.list_nodes())
    except Exception:  # noqa: BLE001 - the cluster cannot be read from here: the workflow still checks max_nodes
        have = 0
    room = max(where.max_nodes - have, 0)
    if count > room:
        fail(f"--count: {site} can take {room} more node(s) (max_nodes {where.max_nodes}, {have} there now); "
             f"asked for {count}", 2)


async def _join(settings: Settings, site: str, count: int, wait: bool, request: str) -> None:
    from rich.live import Live
    from temporalio.client import WorkflowFailureError

    from client import InvalidArgument

    fleet = fleet_client(settings)
    handles = []
    for i in range(count):
        try:
            handle = await fleet.start_join({"site": site},
                                            request_id=request if count == 1 else f"{request}-{i}")
        except InvalidArgument as error:
            fail(str(error), 2)
        handles.append(handle)
        console.print(f"started [bold]{handle.id}[/]")
    if not wait:
        return

    def render(states: dict[str, str]) -> Table:
        table = Table("workflow", "step")
        for wid, step in states.items():
            table.add_row(wid, step)
        return table

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

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

    with (live_view or _Plain()) as live:
        pending = {h.id: asyncio.ensure_future(h.result()) for h in handles}
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
                        kind, message = failure(error)
                        states[handle.id] = f"[red]{escape(message)}[/]"
                        failures.append((handle.id, kind, message))
                else:
                    try:
                        states[handle.id] = (await fleet.join_progress(handle.id)).step
                    except Exception:  # noqa: BLE001 - a query can race the workflow's first task
                        pass
            live.update(render(states))
    if failures:
        for wid, _kind, message in failures:
            err.print(f"[red]{wid} failed:[/] {escape(message)}")
        raise typer.Exit(1)


# -- looking at the fleet --------------------------------------------------------------------


@app.command()
def sites(state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None, output: OutputFormat = "table") -> None:
    """Every site: provider, GPUs, price, min/max, nodes now (and the sim's knobs)."""
    env = fleet_env(state_dir, config)
    nodes = env.cluster.list_nodes()
    columns = ["site", "provider", "region", "geo", "GPU", "$/GPU-h", "type", "min", "max", "ready/nodes"]
    sim = {row["name"]: row for row in env.world.sites()} if env.world else {}
    if sim:
        columns += ["capacity", "quota", "latency", "reachable"]
    rows = []
    for site in env.config.sites:
        here = [n for n in nodes if n.labels.get("node-restriction.kubernetes.io/gpufleet-site") == site.name]
        row = [site.name, site.provider, site.region, site.geography or "", f"{site.gpus_per_machine}x {site.gpu}",
               f"{site.price_per_gpu_hour:.2f}", site.capacity_type.value, str(site.min_nodes), str(site.max_nodes),
               f"{sum(n.ready for n in here)}/{len(here)}"]
        if site.name in sim:
            s = sim[site.name]
            row += [str(s["capacity"]), str(s["quota"]), f"{s['api_latency_ms']} ms",
                    "[red]no[/]" if s["unreachable"] else "yes"]
        rows.append(row)
    show_rows("sites", columns, rows, output, drop_narrow=("region", "geo", "type", "min", "latency"))


@app.command()
def nodes(state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None, output: OutputFormat = "table") -> None:
    """Cluster nodes with their site, readiness and taints."""
    env = fleet_env(state_dir, config)
    rows = [[node.name, node.labels.get("node-restriction.kubernetes.io/gpufleet-site", ""), node.labels.get("node-restriction.kubernetes.io/gpufleet-provider", ""),
             node.labels.get("nvidia.com/gpu.product", ""), "yes" if node.ready else "[red]no (NotReady)[/]",
             "[yellow]cordoned[/]" if node.unschedulable else "yes", ", ".join(node.taints), node.machine_id]
            for node in env.cluster.list_nodes()]
    show_rows("nodes", ["node", "site", "provider", "GPU", "ready", "schedulable", "taints", "machine"], rows, output,
              drop_narrow=("provider", "GPU", "machine"))


@app.command("search-attributes")
def register_search_attributes(address: Address = "localhost:7233") -> None:
    """Register gpufleet's search attributes on the namespace (idempotent)."""
    from fleet import search_attributes

    async def go() -> list[str]:
        return await search_attributes.ensure_registered(await connect_or_exit(settings(address)))

    added = asyncio.run(go())
    console.print(f"added: {', '.join(added)}" if added else "all search attributes already registered")


# -- the simulated world ---------------------------------------------------------------------


def _site_knob(state_dir: Path, config: str | None, site: str, **fields) -> None:
    try:
        sim_world(state_dir, config).set_site(site, **fields)
    except KeyError:
        fail(f"unknown site {site!r}", 2)
    console.print(f"{site}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))


@sim_app.command("capacity")
def sim_capacity(site: str, machines: int, state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None) -> None:
    """How many more machines a site can sell (0 = NoCapacity)."""
    _site_knob(state_dir, config, site, capacity=machines)


@sim_app.command("quota")
def sim_quota(site: str, machines: int, state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None) -> None:
    """How many machines the account may run at the site (reaching it = OverQuota)."""
    _site_knob(state_dir, config, site, quota=machines)


@sim_app.command("latency")
def sim_latency(site: str, ms: int, state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None) -> None:
    """Provider API latency for the site."""
    _site_knob(state_dir, config, site, api_latency_ms=ms)


@sim_app.command("unreachable")
def sim_unreachable(
    site: str,
    restore: Annotated[bool, typer.Option("--restore", help="make it reachable again")] = False,
    state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None,
) -> None:
    """Cut the site's machines off the control plane (agents stop, nodes go NotReady)."""
    _site_knob(state_dir, config, site, unreachable=0 if restore else 1)


@sim_app.command("revoke")
def sim_revoke(
    account: str,
    restore: Annotated[bool, typer.Option("--restore", help="make the credentials valid again")] = False,
    state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None,
) -> None:
    """Revoke an account's credentials: every call to it answers BadCredentials."""
    try:
        sim_world(state_dir, config).set_credentials_valid(account, restore)
    except KeyError:
        fail(f"unknown account {account!r}", 2)
    console.print(f"{account}: credentials {'valid' if restore else 'revoked'}")


@sim_app.command("fault")
def sim_fault(
    node: Annotated[str, typer.Argument(help="node (machine) name")],
    gpu: Annotated[int, typer.Option(help="GPU index")] = 0,
    xid: Annotated[Optional[int], typer.Option(help="inject this XID")] = None,
    kind: Annotated[str, typer.Option(help="xid, ecc, remap_pending, remap_failure, lost, nvlink_down, hot, compute")] = "xid",
    clears_on: Annotated[str, typer.Option(help="weakest repair that fixes it: reset, reboot, reinstall, never")] = "reset",
    state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None,
) -> None:
    """Break one simulated GPU."""
    world = sim_world(state_dir, config)
    machine = world.machine_by_name(node)
    if machine is None:
        fail(f"no simulated machine named {node!r}", 2)
    value = xid if xid is not None else 1
    try:
        world.inject_fault(machine["id"], gpu, kind if xid is None else "xid", value, clears_on)
    except (KeyError, ValueError) as error:
        fail(str(error), 2)
    console.print(f"{node} GPU {gpu}: {'XID ' + str(xid) if xid is not None else kind} (clears on {clears_on})")


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

    try:
        app()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
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
