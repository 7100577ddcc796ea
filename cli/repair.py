"""``gpufleet repair ...``: watch and steer GPU repair ladders."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from cli.common import Address, OutputFormat, console, err, fleet_client, run, settings, show_rows
from fleet.contracts import workflows as flows

repair_app = typer.Typer(no_args_is_help=True)
Node = Annotated[str, typer.Argument(help="node name")]
Gpu = Annotated[int, typer.Argument(help="GPU index")]
Reason = Annotated[str, typer.Option("--reason", help="why (shown in the repair's details)")]
#: Required: un-fencing or repairing a GPU no proof passed is a person's decision, kept in the node's log.
PersonReason = Annotated[str, typer.Option("--reason", help="why (required; kept in the Node entity's log)")]


@repair_app.callback()
def repair() -> None:
    """GPU repair ladders (GpuRepair workflows) and Node entities."""


def _fleet(address: str):
    return fleet_client(settings(address))


def _run(coro, node: str | None = None, gpu: int | None = None, entity: bool = False):
    """``entity``: the call goes to ``node``'s Node entity (not found: it is not running)."""
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
        if entity:
            err.print(f"[red]error:[/] no running Node entity node/{node} ({escape(str(error))}): "
                      "is the node name right? (`gpufleet nodes`)")
            raise typer.Exit(1) from None
        if node is not None and gpu is not None:
            # Faults reach the Node entity within a second, and its repair starts after the
            # Site entity admits it (a few seconds): say so rather than "workflow not found".
            err.print(f"[yellow]no repair of {node} GPU {gpu} has started yet[/] (a fault is reported at once; "
                      "the repair starts once the site admits it, within seconds): try again shortly, "
                      f"or see `gpufleet repair node {node}`")
            raise typer.Exit(1) from None
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None


def _show_ladder(state) -> None:
    # Whose hold it is: the reason says (an operator's words, or the site's incident).
    held = f"held: {escape(state.hold_reason)}" if state.hold_reason else "held"
    flags = f" [yellow]({held})[/]" if state.held else ""
    # "step → outcome" only when they differ: a finished ladder's step already is its outcome.
    outcome = f" → {state.outcome}" if state.outcome and state.outcome != state.step else ""
    console.print(f"[bold]{state.node_name}[/] GPU {state.gpu}: rung [bold]{state.rung}[/], {state.step}{flags}{outcome}")
    if state.reasons:
        console.print("  why: " + "; ".join(state.reasons))
    if state.waiting_for:  # the node's action slot: who holds it, until when
        console.print("  waiting: " + escape(state.waiting_for))
    if state.skip_to is not None and not state.done:
        # A skip-to taken, not yet acted on: the ladder goes there once the rung it is on has not
        # proved the GPU (and, held, once released). Said, or the command's answer looks unchanged.
        console.print(f"  next: rung {state.skip_to.value} (an operator's skip-to), unless the "
                      f"{state.rung.value} it is on proves the GPU" + ("; once released" if state.held else ""))
    show_rows("attempts", ["rung", "outcome", "started", "finished", "detail"],
              [[a.rung, a.outcome, f"{a.started_at:%H:%M:%S}", f"{a.finished_at:%H:%M:%S}" if a.finished_at else "",
                a.detail] for a in state.attempts], drop_narrow=("started",))
    if state.earlier_attempts:
        console.print(f"  and {state.earlier_attempts} earlier attempts (only the newest are kept)")


@repair_app.command("list")
def list_repairs(
    all_: Annotated[bool, typer.Option("--all", help="include finished repairs")] = False,
    output: OutputFormat = "table",
    address: Address = "localhost:7233",
) -> None:
    """Repairs, with their node, GPU, rung and state."""

    async def go() -> None:
        client = await _fleet(address).temporal()
        query = f"WorkflowType = '{flows.GpuRepair.TYPE}'" + ("" if all_ else " AND ExecutionStatus = 'Running'")
        rows = []
        async for wf in client.list_workflows(query):
            sa = wf.search_attributes
            rows.append([wf.id, str((sa.get("NodeName") or [""])[0]), str((sa.get("GpuIndex") or [""])[0]),
                         str((sa.get("RepairRung") or [""])[0]), str((sa.get("FleetState") or [""])[0]),
                         wf.status.name.lower() if wf.status else ""])
        show_rows("repairs", ["workflow", "node", "GPU", "rung", "state", "status"], rows, output,
                  drop_narrow=("workflow",))

    _run(go())


@repair_app.command("show")
def show(node: Node, gpu: Gpu, output: OutputFormat = "table", address: Address = "localhost:7233") -> None:
    """The ladder of one GPU: current rung and every attempt."""
    state = _run(_fleet(address).repair_ladder(node, gpu), node, gpu)
    if output == "json":
        print(state.model_dump_json(indent=2), flush=True)
        return
    _show_ladder(state)


@repair_app.command("node")
def node_status(node: Node, output: OutputFormat = "table", address: Address = "localhost:7233") -> None:
    """The Node entity: state, running repairs, counters, recent decisions."""
    s = _run(_fleet(address).node_status(node))
    if output == "json":
        print(s.model_dump_json(indent=2), flush=True)
        return
    counts = f"boot {s.boot_id[:8]}, {s.reports} reports, {s.remediations} remediations in the window"
    if s.entity != "running" and s.state != "gone":
        when = f" at {s.entity_closed_at:%Y-%m-%d %H:%M:%S} UTC" if s.entity_closed_at else ""
        console.print(f"[bold]{s.node_name}[/] ({s.site or 'site unknown'}): [red]{s.state}[/]: its entity "
                      f"node/{s.node_name} is not running ({s.entity}{when}): nothing watches its health or "
                      "repairs it; the site sweep starts it again at its next pass while the node is Ready and "
                      "not being retired")
        console.print(f"  as that run left it: {counts}")
    else:
        console.print(f"[bold]{s.node_name}[/] ({s.site or 'site unknown'}): {s.state}, {counts}")
    for index, wid in sorted(s.active_repairs.items()):
        console.print(f"  GPU {index}: {wid}")
    if s.slot_queue:
        console.print(f"  queued for the node's action slot, next first: {', '.join(s.slot_queue)}")
    for index, why in sorted(s.needs_person.items()):
        console.print(f"  GPU {index}: [yellow]needs a person[/]: {escape(why)}")
    waits = (f" (its incident: next look at {datetime.fromtimestamp(s.held_until, timezone.utc):%H:%M:%S} UTC, "
             "or as soon as it closes)" if s.held_until else "")
    for index in s.fenced:
        if str(index) not in s.needs_person:
            console.print(f"  GPU {index}: fenced, node cordoned; its repair waits for site/{s.site}{waits}")
    if s.app_xids:
        console.print("  application XIDs: " + ", ".join(f"{x}×{n}" for x, n in s.app_xids.items()))
    for line in s.log:
        console.print(f"  - {line}")


@repair_app.command("hold")
def hold(node: Node, gpu: Gpu, reason: Reason = "", address: Address = "localhost:7233") -> None:
    """Stay contained and do nothing at the next step until released."""
    _show_ladder(_run(_fleet(address).hold_repair(node, gpu, reason), node, gpu))


@repair_app.command("release")
def release(node: Node, gpu: Gpu, reason: Reason = "", address: Address = "localhost:7233") -> None:
    """Let a held ladder go on."""
    _show_ladder(_run(_fleet(address).release_repair(node, gpu, reason), node, gpu))


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
    _show_ladder(_run(_fleet(address).skip_repair_to(node, gpu, target), node, gpu))


def _show_decision(decision, output: str) -> None:
    if output == "json":
        print(decision.model_dump_json(indent=2), flush=True)
        return
    console.print(f"[bold]{decision.node_name}[/] GPU {decision.gpu}: {decision.outcome}: {escape(decision.detail)}")
    if decision.repair_id:
        console.print(f"  watch it: gpufleet repair show {decision.node_name} {decision.gpu}")
    console.print(f"  node state: {decision.state}")


@repair_app.command("return")
def return_gpu(node: Node, gpu: Gpu, reason: PersonReason, output: OutputFormat = "table",
               address: Address = "localhost:7233") -> None:
    """Return a GPU held for a person (its repair ended unproven) to service: un-fence it, and
    uncordon the node unless another GPU of it is fenced."""
    _show_decision(_run(_fleet(address).return_gpu(node, gpu, reason), node, gpu, entity=True), output)


@repair_app.command("retry")
def retry(
    node: Node, gpu: Gpu, reason: PersonReason,
    rung: Annotated[str | None, typer.Option(
        "--rung", help="reset, reboot, reinstall or replace (default: where the policy starts for the finding "
                       "of the repair that ended, else reset)")] = None,
    output: OutputFormat = "table",
    address: Address = "localhost:7233",
) -> None:
    """Repair a GPU held for a person again: a new repair, admitted by its site like any finding."""
    _show_decision(_run(_fleet(address).retry_repair(node, gpu, reason, rung), node, gpu, entity=True), output)
