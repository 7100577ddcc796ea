"""``gpufleet repair ...``: watch and steer GPU repair ladders."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.table import Table

from cli.common import Address, connect, console, err, settings

repair_app = typer.Typer(no_args_is_help=True)
Node = Annotated[str, typer.Argument(help="node name")]
Gpu = Annotated[int, typer.Argument(help="GPU index")]


@repair_app.callback()
def repair() -> None:
    """GPU repair ladders (GpuRepair workflows) and Node entities."""


async def _client(address: str):
    return await connect(settings(address))


def _run(coro) -> None:
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.service import RPCError

    try:
        asyncio.run(coro)
    except WorkflowUpdateFailedError as error:
        err.print(f"[red]refused:[/] {error.cause}")
        raise typer.Exit(1) from None
    except RPCError as error:
        err.print(f"[red]error:[/] {error.message}")
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
        client = await _client(address)
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
    from fleet.messages.repair import LadderState

    async def go() -> None:
        client = await _client(address)
        _show_ladder(await client.get_workflow_handle(f"repair/{node}/gpu{gpu}").query("ladder", result_type=LadderState))

    _run(go())


@repair_app.command("node")
def node_status(node: Node, address: Address = "localhost:7233") -> None:
    """The Node entity: state, running repairs, counters, recent decisions."""
    from fleet.messages.repair import NodeStatus

    async def go() -> None:
        client = await _client(address)
        s = await client.get_workflow_handle(f"node/{node}").query("status", result_type=NodeStatus)
        console.print(f"[bold]{s.node_name}[/] ({s.site or 'site unknown'}): {s.state}, boot {s.boot_id[:8]}, "
                      f"{s.reports} reports, {s.remediations} remediations in the window")
        for index, wid in sorted(s.active_repairs.items()):
            console.print(f"  GPU {index}: {wid}")
        if s.app_xids:
            console.print("  application XIDs: " + ", ".join(f"{x}×{n}" for x, n in s.app_xids.items()))
        for line in s.log:
            console.print(f"  - {line}")

    _run(go())


def _update(node: str, gpu: int, name: str, address: str, arg=None) -> None:
    from fleet.messages.repair import LadderState

    async def go() -> None:
        client = await _client(address)
        handle = client.get_workflow_handle(f"repair/{node}/gpu{gpu}")
        args = [] if arg is None else [arg]
        _show_ladder(await handle.execute_update(name, *args, result_type=LadderState))

    _run(go())


@repair_app.command("hold")
def hold(node: Node, gpu: Gpu, address: Address = "localhost:7233") -> None:
    """Stay contained and do nothing at the next step until released."""
    _update(node, gpu, "hold", address)


@repair_app.command("release")
def release(node: Node, gpu: Gpu, address: Address = "localhost:7233") -> None:
    """Let a held ladder go on."""
    _update(node, gpu, "release", address)


@repair_app.command("skip-to")
def skip_to(
    node: Node, gpu: Gpu,
    rung: Annotated[str, typer.Argument(help="reset, reboot, reinstall or replace")],
    address: Address = "localhost:7233",
) -> None:
    """Go to this rung next (also re-enters an exhausted ladder)."""
    from fleet.repair_policy import Rung
    from fleet.messages.repair import SkipToInput

    try:
        target = Rung(rung)
    except ValueError:
        err.print(f"[red]error:[/] rung must be one of {', '.join(r.value for r in Rung)}")
        raise typer.Exit(2) from None
    _update(node, gpu, "skip_to", address, SkipToInput(rung=target))
