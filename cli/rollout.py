"""``gpufleet rollout ...``: start and drive ModelRollout workflows."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.progress_bar import ProgressBar
from rich.table import Table

from cli.common import Address, connect, console, err, settings

rollout_app = typer.Typer(no_args_is_help=True)
Reason = Annotated[str, typer.Option("--reason", help="why (shown in the workflow's details)")]
RolloutId = Annotated[str, typer.Argument(help="rollout/<model>/<version> (or <model>/<version>)")]


@rollout_app.callback()
def rollout() -> None:
    """Model rollouts: weights to every site, canary, gated batches, rollback."""


async def _client(address: str):
    config = settings(address)
    return await connect(config), config


def _id(rollout_id: str) -> str:
    return rollout_id if rollout_id.startswith("rollout/") else f"rollout/{rollout_id}"


@rollout_app.command("start")
def start(
    file: Annotated[Path, typer.Argument(help="rollout spec (YAML or JSON): model, version, weights, image, sites...")],
    address: Address = "localhost:7233",
) -> None:
    """Start a ModelRollout (idempotent: the same model/version attaches to the running one)."""
    from pydantic import ValidationError

    from fleet.rollout import RolloutInput

    try:
        raw = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as error:
        err.print(f"[red]{file}: cannot read: {error}[/]")
        raise typer.Exit(2) from None
    try:
        request = RolloutInput.model_validate(raw)
    except ValidationError as error:
        err.print(f"[red]{file}: invalid rollout[/]")
        for problem in error.errors():
            where = ".".join(str(p) for p in problem["loc"]) or "(top level)"
            err.print(f"  {where}: {problem['msg'].removeprefix('Value error, ')}")
        raise typer.Exit(2) from None

    async def go() -> str:
        from temporalio.common import WorkflowIDConflictPolicy

        client, settings = await _client(address)
        handle = await client.start_workflow(
            "ModelRollout", request.model_dump(mode="json"), id=request.rollout_id, task_queue=settings.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            static_summary=f"roll {request.model} {request.version} out to {len(request.sites)} sites",
        )
        return handle.id

    console.print(f"started [bold]{asyncio.run(go())}[/]")


async def _status(address: str, rollout_id: str) -> tuple:
    from fleet.rollout import RolloutProgress

    client, _ = await _client(address)
    handle = client.get_workflow_handle(_id(rollout_id))
    try:
        description = await handle.describe()
    except Exception as error:  # noqa: BLE001 - not found, unreachable
        err.print(f"[red]error:[/] {_id(rollout_id)}: {error}")
        raise typer.Exit(1) from None
    progress = await handle.query("progress", result_type=RolloutProgress)
    live: dict[str, dict] = {}
    for pending in description.raw_description.pending_activities:
        if pending.activity_id.startswith("replicate/") and pending.heartbeat_details.payloads:
            try:
                (details,) = await client.data_converter.decode(pending.heartbeat_details.payloads)
                live[pending.activity_id.removeprefix("replicate/")] = details
            except Exception:  # noqa: BLE001 - unreadable details: show what the query knows
                pass
    return description, progress, live


@rollout_app.command("status")
def status(
    rollout_id: RolloutId,
    as_json: Annotated[bool, typer.Option("--json", help="print the progress as JSON")] = False,
    address: Address = "localhost:7233",
) -> None:
    """Phase, and per site: state, a weights progress bar, and what it is doing."""
    description, progress, live = asyncio.run(_status(address, rollout_id))
    if progress is None:
        console.print(f"{_id(rollout_id)}: starting ({description.status.name.lower()})")
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
    async def go():
        from temporalio.client import WorkflowUpdateFailedError
        from temporalio.service import RPCError

        client, _ = await _client(address)
        try:
            return await client.get_workflow_handle(_id(rollout_id)).execute_update(name, reason)
        except WorkflowUpdateFailedError as error:
            err.print(f"[red]{name} rejected:[/] {error.cause}")
        except RPCError as error:
            err.print(f"[red]{name} rejected:[/] {error}")
        raise typer.Exit(1)

    result = asyncio.run(go())
    phase = result.get("phase") if isinstance(result, dict) else getattr(result, "phase", "")
    console.print(f"{_id(rollout_id)}: {name} accepted (phase {phase})")


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

