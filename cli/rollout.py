"""``gpufleet rollout ...``: start and drive ModelRollout workflows."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.progress_bar import ProgressBar
from rich.table import Table

from cli.common import Address, console, err, fleet_client, run, settings

rollout_app = typer.Typer(no_args_is_help=True)
Reason = Annotated[str, typer.Option("--reason", help="why (shown in the workflow's details)")]
RolloutId = Annotated[str, typer.Argument(help="rollout/<model>/<version> (or <model>/<version>)")]


@rollout_app.callback()
def rollout() -> None:
    """Model rollouts: weights to every site, canary, gated batches, rollback."""


def _id(rollout_id: str) -> str:
    from client.fleet import rollout_workflow_id

    return rollout_workflow_id(rollout_id)


@rollout_app.command("start")
def start(
    file: Annotated[Path, typer.Argument(help="rollout spec (YAML or JSON): model, version, weights, image, sites...")],
    address: Address = "localhost:7233",
) -> None:
    """Start a ModelRollout (idempotent: the same model/version attaches to the running one)."""
    from client import InvalidArgument

    try:
        raw = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as error:
        err.print(f"[red]{file}: cannot read: {error}[/]")
        raise typer.Exit(2) from None
    fleet = fleet_client(settings(address))
    try:
        handle = run(fleet.start_rollout(raw))
    except InvalidArgument as error:
        err.print(f"[red]{file}: invalid rollout[/]")
        for where, message in error.problems:
            err.print(f"  {'(top level)' if where == '(input)' else where}: {message}")
        raise typer.Exit(2) from None
    console.print(f"started [bold]{handle.id}[/]")


@rollout_app.command("status")
def status(
    rollout_id: RolloutId,
    as_json: Annotated[bool, typer.Option("--json", help="print the progress as JSON")] = False,
    address: Address = "localhost:7233",
) -> None:
    """Phase, and per site: state, a weights progress bar, and what it is doing."""
    from client import NotFound

    try:
        status_ = run(fleet_client(settings(address)).rollout_status(rollout_id))
    except NotFound as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    progress, live = status_.progress, status_.replicating
    if progress is None:
        state = status_.status.name.lower() if status_.status else "unknown"
        console.print(f"{_id(rollout_id)}: starting ({state})")
        return
    if as_json:
        console.print_json(progress.model_dump_json())
        return
    title = f"{progress.rollout_id}: {progress.phase}" + (" (paused)" if progress.paused else "")
    if progress.batches:
        title += f", batch {progress.batch}/{progress.batches}"
    table = Table("site", "replicas", "state", "weights", "", "detail", title=title)
    for site in progress.sites:
        done, total = site.bytes_done, site.bytes_total
        if site.site in live:
            done, total = live[site.site].get("bytes_done", done), live[site.site].get("bytes_total", total) or total
        pct = f"{100 * done / total:.0f}%" if total else "-"
        table.add_row(site.site + (" (canary)" if site.canary else ""), str(site.replicas), site.state.value,
                      ProgressBar(total=max(total, 1), completed=done, width=24), pct, site.detail)
    console.print(table)
    if progress.reason:
        console.print(progress.reason)


def _update(name: str, rollout_id: str, reason: str, address: str) -> None:
    from client import NotFound, Rejected

    fleet = fleet_client(settings(address))
    call = {"pause": fleet.pause_rollout, "resume": fleet.resume_rollout, "abort": fleet.abort_rollout}[name]
    try:
        progress = run(call(rollout_id, reason))
    except (Rejected, NotFound) as error:
        err.print(f"[red]{name} rejected:[/] {error}")
        raise typer.Exit(1) from None
    console.print(f"{_id(rollout_id)}: {name} accepted (phase {progress.phase})")


@rollout_app.command("pause")
def pause(rollout_id: RolloutId, reason: Reason = "", address: Address = "localhost:7233") -> None:
    """Hold before the next batch (the batch in flight finishes its gate)."""
    _update("pause", rollout_id, reason, address)


@rollout_app.command("resume")
def resume(rollout_id: RolloutId, reason: Reason = "", address: Address = "localhost:7233") -> None:
    """Continue a paused rollout."""
    _update("resume", rollout_id, reason, address)


@rollout_app.command("abort")
def abort(rollout_id: RolloutId, reason: Reason = "", address: Address = "localhost:7233") -> None:
    """Stop and roll back every site already updated."""
    _update("abort", rollout_id, reason, address)

