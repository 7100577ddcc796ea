"""``gpufleet repair ...``: watch and steer GPU repair ladders."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from cli.common import Address, console, err, fleet_client, run, settings

repair_app = typer.Typer(no_args_is_help=True)
Node = Annotated[str, typer.Argument(help="node name")]
Gpu = Annotated[int, typer.Argument(help="GPU index")]


@repair_app.callback()
def repair() -> None:
    """GPU repair ladders (GpuRepair workflows) and Node entities."""


def _fleet(address: str):
    return fleet_client(settings(address))


def _run(coro):
    from client import InvalidArgument, NotFound, Rejected

    try:
        return run(coro)
    except InvalidArgument as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(2) from None
    except Rejected as error:
        err.print(f"[red]refused:[/] {error}")
        raise typer.Exit(1) from None
    except NotFound as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None


def _show_ladder(state) -> None:
    flags = " [yellow](held)[/]" if state.held else ""
    console.print(f"[bold]{state.node_name}[/] GPU {state.gpu}: rung [bold]{state.rung}[/], {state.step}{flags}"
                  + (f" → {state.outcome}" if state.outcome else ""))
    if state.reasons:
        console.print("  why: " + "; ".join(state.reasons))
    table = Table("rung", "outcome", "started", "finished", "detail")
    for a in state.attempts:
        table.add_row(a.rung, a.outcome, f"{a.started_at:%H:%M:%S}",
                      f"{a.finished_at:%H:%M:%S}" if a.finished_at else "", a.detail)
    console.print(table)


@repair_app.command("list")
def list_repairs(
    all_: Annotated[bool, typer.Option("--all", help="include finished repairs")] = False,
    address: Address = "localhost:7233",
) -> None:
    """Repairs, with their node, GPU, rung and state."""

    async def go() -> None:
        client = await _fleet(address).temporal()
        query = "WorkflowType = 'GpuRepair'" + ("" if all_ else " AND ExecutionStatus = 'Running'")
        table = Table("workflow", "node", "GPU", "rung", "state", "status")
        async for wf in client.list_workflows(query):
            sa = wf.search_attributes
            table.add_row(wf.id, str((sa.get("NodeName") or [""])[0]), str((sa.get("GpuIndex") or [""])[0]),
                          str((sa.get("RepairRung") or [""])[0]), str((sa.get("FleetState") or [""])[0]),
                          wf.status.name.lower() if wf.status else "")
        console.print(table)

    _run(go())


@repair_app.command("show")
def show(node: Node, gpu: Gpu, address: Address = "localhost:7233") -> None:
    """The ladder of one GPU: current rung and every attempt."""
    _show_ladder(_run(_fleet(address).repair_ladder(node, gpu)))


@repair_app.command("node")
def node_status(node: Node, address: Address = "localhost:7233") -> None:
    """The Node entity: state, running repairs, counters, recent decisions."""
    s = _run(_fleet(address).node_status(node))
    console.print(f"[bold]{s.node_name}[/] ({s.site or 'site unknown'}): {s.state}, boot {s.boot_id[:8]}, "
                  f"{s.reports} reports, {s.remediations} remediations in the window")
    for index, wid in sorted(s.active_repairs.items()):
        console.print(f"  GPU {index}: {wid}")
    if s.app_xids:
        console.print("  application XIDs: " + ", ".join(f"{x}×{n}" for x, n in s.app_xids.items()))
    for line in s.log:
        console.print(f"  - {line}")


@repair_app.command("hold")
def hold(node: Node, gpu: Gpu, address: Address = "localhost:7233") -> None:
    """Stay contained and do nothing at the next step until released."""
    _show_ladder(_run(_fleet(address).hold_repair(node, gpu)))


@repair_app.command("release")
def release(node: Node, gpu: Gpu, address: Address = "localhost:7233") -> None:
    """Let a held ladder go on."""
    _show_ladder(_run(_fleet(address).release_repair(node, gpu)))


@repair_app.command("skip-to")
def skip_to(
    node: Node, gpu: Gpu,
    rung: Annotated[str, typer.Argument(help="reset, reboot, reinstall or replace")],
    address: Address = "localhost:7233",
) -> None:
    """Go to this rung next (also re-enters an exhausted ladder)."""
    from fleet.repair_policy import Rung

    try:
        target = Rung(rung)
    except ValueError:
        err.print(f"[red]error:[/] rung must be one of {', '.join(r.value for r in Rung)}")
        raise typer.Exit(2) from None
    _show_ladder(_run(_fleet(address).skip_repair_to(node, gpu, target)))
