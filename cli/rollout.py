"""``gpufleet rollout ...``: start and drive ModelRollout workflows."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.text import Text

from cli.common import (Address, OutputFormat, console, err, fit_table, fleet_client, piped_format, print_table, run,
                        settings, show_rows)

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
    wait: Annotated[bool, typer.Option(help="print each change until the rollout ends; exit 1 unless it completed. "
                                            "Ctrl-C stops watching only: the rollout goes on (it says how to stop it)")] = False,
    address: Address = "localhost:7233",
) -> None:
    """Start a ModelRollout (idempotent: the same model/version attaches to the running one)."""
    from client import InvalidArgument
    from fleet.yaml_input import NotYaml, read_yaml

    try:
        spec = read_yaml(file.read_text())
    except (OSError, NotYaml) as error:
        _refuse(file, f"cannot read: {error}", [])
    if spec.problems:
        # A key given twice (a second `sites:` block: YAML keeps the last, the first's sites are
        # lost) or YAML reads as no string: refused before anything starts, with the spec's other
        # problems as the client names them.
        from client.fleet import validate
        from fleet.rollout import RolloutInput

        problems = list(spec.problems)
        try:
            validate(RolloutInput, spec.data, "rollout")
        except InvalidArgument as error:
            # (A key that is no string is named above, where it stands.)
            problems += [f"{'(top level)' if where == '(input)' else where}: {message}"
                         for where, message in error.problems if message != "Keys should be strings"]
        _refuse(file, "invalid rollout", problems)
    raw = spec.data
    fleet = fleet_client(settings(address))
    try:
        handle = run(fleet.start_rollout(raw))
    except InvalidArgument as error:
        err.print(f"[red]{file}: invalid rollout[/]")
        for where, message in error.problems:
            err.print(f"  {'(top level)' if where == '(input)' else where}: {message}")
        raise typer.Exit(2) from None
    from cli.requests import announce

    announce(fleet.settings, handle.id)  # and its Temporal UI page
    if wait:
        try:
            code = run(_wait(fleet, handle))
        except KeyboardInterrupt:
            # A rollout is not a purchase: stopping it is a decision (abort rolls the sites back),
            # so an interrupted watch leaves it running and names the commands.
            err.print(f"stopped watching; {handle.id} goes on. Watch it: gpufleet rollout status {handle.id}; "
                      f"hold it: gpufleet rollout pause {handle.id}; roll it back: gpufleet rollout abort {handle.id}",
                      markup=False, highlight=False)
            raise typer.Exit(130) from None
        raise typer.Exit(code)


def _refuse(file: Path, what: str, problems: list[str]) -> NoReturn:
    """``<file>: <what>`` and each problem on a line of its own (as written: brackets are text), exit 2."""
    err.print(f"[red]{escape(f'{file}: {what}')}[/]")
    for problem in problems:
        err.print(f"  {problem}", markup=False, highlight=False)
    raise typer.Exit(2)


def _phase_line(rollout_id: str, progress) -> str:
    return f"{rollout_id}: {progress.phase}" + (f" ({progress.reason})" if progress.reason else "")


def _site_line(site) -> str:
    return f"  {site.site}: {site.state.value}" + (f" - {site.detail}" if site.detail else "")


def _live_view(rollout_id: str, progress):
    """The terminal's view while waiting: the phase over each site's state and what it does or
    waits for. The detail wraps rather than being cut: a deferred site's says until when."""
    from rich.table import Table

    if progress is None:
        return Text(f"{rollout_id}: starting")
    from fleet.rollout import paused_note

    title = f"{rollout_id}: {progress.phase}" + paused_note(progress)
    if progress.batches:
        title += f", batch {progress.batch}/{progress.batches}"
    title += f" ({progress.reason})" if progress.reason else ""
    # Text, not markup: a reason or detail may hold brackets.
    table = Table(title=Text(title), title_justify="left", expand=False)
    table.add_column("site", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for site in progress.sites:
        table.add_row(Text(site.site + (" (canary)" if site.canary else "")), site.state.value, Text(site.detail))
    return table


async def _wait(fleet, handle) -> int:
    """Until the rollout ends: on a terminal a live view redrawn in place (``_live_view``), piped
    one line per change (the phase, or a site's state and detail); while no worker answers, a
    line that says so (``UnansweredQueries``)."""
    import asyncio

    from rich.live import Live
    from temporalio.client import WorkflowFailureError

    from cli.common import failure
    from cli.waits import UnansweredQueries

    result = asyncio.ensure_future(handle.result())
    unanswered = UnansweredQueries()
    shown = None  # the last progress answered
    seen: dict[str, str] = {}
    # Piped, a redrawn view would be a stream of cursor moves: plain lines instead.
    live = Live(_live_view(handle.id, None), console=console, refresh_per_second=4) if console.is_terminal else None
    try:
        if live is not None:
            live.start()
        while True:
            done = result.done()
            try:
                progress = await unanswered.ask(lambda: fleet.rollout_progress(handle.id))
            except Exception:  # noqa: BLE001 - not queryable yet (first task) or already gone
                progress = None
            if progress is not None:
                shown = progress
                if live is None:
                    for key, line in [("phase", _phase_line(handle.id, progress))] + [
                            (s.site, _site_line(s)) for s in progress.sites]:
                        if seen.get(key) != line:
                            seen[key] = line
                            print(line, flush=True)
            if live is not None:
                live.update(unanswered.beneath(_live_view(handle.id, shown)))
            elif (news := unanswered.news()) is not None:
                print(news, flush=True)
            if done:
                break
            await asyncio.wait([result], timeout=1.0)
    finally:
        if live is not None:
            live.stop()  # the last view stays on the screen
        if not result.done():
            result.cancel()
    try:
        outcome = result.result()
    except WorkflowFailureError as error:
        err.print(f"[red]{handle.id} failed:[/] {failure(error)[1]}")
        return 1
    if live is not None:
        console.print(f"{handle.id}: {outcome.outcome}", markup=False, highlight=False)
    else:
        print(f"{handle.id}: {outcome.outcome}", flush=True)
    return 0 if outcome.outcome == "completed" else 1


@rollout_app.command("status")
def status(
    rollout_id: RolloutId,
    as_json: Annotated[bool, typer.Option("--json", help="print the progress as JSON")] = False,
    output: OutputFormat = "table",
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
    if as_json or output == "json":
        print(progress.model_dump_json(indent=2), flush=True)
        return
    from fleet.rollout import paused_note

    title = f"{progress.rollout_id}: {progress.phase}" + paused_note(progress)
    if progress.batches:
        title += f", batch {progress.batch}/{progress.batches}"
    if piped_format(output) == "tsv":  # piped (or -o tsv): the rows as show_rows prints them
        print(title)
        rows = []
        for site in progress.sites:
            done, total = site.bytes_done, site.bytes_total
            if site.site in live:
                done, total = live[site.site].get("bytes_done", done), live[site.site].get("bytes_total", total) or total
            rows.append([site.site + (" (canary)" if site.canary else ""), str(site.replicas), site.state.value,
                         f"{100 * done / total:.0f}%" if total else "-", site.detail])
        show_rows(title, ["site", "replicas", "state", "weights", "detail"], rows, output)
        if progress.reason:
            print(progress.reason, flush=True)
        return
    rows = []
    for site in progress.sites:
        done, total = site.bytes_done, site.bytes_total
        if site.site in live:
            done, total = live[site.site].get("bytes_done", done), live[site.site].get("bytes_total", total) or total
        pct = f"{100 * done / total:.0f}%" if total else "-"
        rows.append([site.site + (" (canary)" if site.canary else ""), str(site.replicas), site.state.value,
                     ProgressBar(total=max(total, 1), completed=done, width=24), pct, site.detail])
    wide = output == "wide"
    # Narrow: the bar goes before the detail is cut (the percentage says the same).
    print_table(fit_table(title, ["site", "replicas", "state", "weights", "copied", "detail"], rows, console.width,
                          narrow=(("replicas", "rep"), "weights"), wide=wide), wide=wide)
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

