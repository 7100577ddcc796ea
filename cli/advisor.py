"""``gpufleet advisor``: what each workload would have cost placed elsewhere (read-only)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from cli.common import (
    OUTPUT_FORMATS,
    Address,
    ConfigPath,
    StateDir,
    _check_output,
    console,
    err,
    fail,
    failure,
    fleet_client,
    piped_format,
    run,
    settings,
    show_rows,
)

def _check_advisor_output(ctx: typer.Context, param: typer.CallbackParam, value: str | None):
    """``-o`` as on every list (common's own check), and ``md``: the report as Markdown (a ticket, a PR)."""
    if value == "md":
        return value
    if value is not None and value not in OUTPUT_FORMATS:
        raise typer.BadParameter(f"must be one of {', '.join(OUTPUT_FORMATS)}, md, not {value!r}")
    return _check_output(ctx, param, value)


def advisor(
    since: Annotated[str, typer.Option(help="how far back: 36h, 7d, 2w")] = "7d",
    output: Annotated[str, typer.Option(
        "--output", "-o", callback=_check_advisor_output,
        help="table (fits the terminal), wide (every column), json (the whole report: workloads, sites, "
             "totals), tsv (one line per workload under a header; the default when piped), md (Markdown)")] = "table",
    format: Annotated[Optional[str], typer.Option(  # noqa: A002 - the option's old name
        "--format", "-f", help="deprecated: the old name of --output (table, json or md)")] = None,
    chart: Annotated[Optional[Path], typer.Option(help="also write a PNG of $/hour per site, now vs advised")] = None,
    constraints: Annotated[Optional[Path], typer.Option(
        help="YAML/JSON file: model -> its placement constraints (gpu or gpu_class, gpu_memory_gb_min, "
             "geographies, sites, capacity_types, max_price_per_gpu_hour)")] = None,
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Each workload's GPU-hours and cost over the period against the cheapest placement that
    meets its constraints (spot priced net of risk and reclaims). Changes nothing."""
    if format is not None:  # scripts written for --format keep working
        if format not in ("table", "json", "md"):
            fail(f"--format: must be one of table, json, md, not {format!r}", 2)
        output = format
    if chart is not None and chart.suffix.lower() != ".png":
        fail(f"--chart: {chart} must name a .png file", 2)
    request: dict[str, Any] = {"since": since}
    if constraints is not None:
        request["constraints"] = _read_constraints(constraints)
    report = run(_advise(settings(address, state_dir, config), request))
    shown = output if output == "md" else piped_format(output)
    if shown == "json":
        print(report.model_dump_json(indent=2), flush=True)
    elif shown == "md":
        print(report.markdown, flush=True)
    else:
        # An explicit -o tsv is the rows alone (the totals go to stderr); piped by default, as before.
        _rows(report, output, totals_to=err if output == "tsv" else None)
    if chart is not None:
        write_chart(report, chart)
        (console.print if shown in ("table", "wide") else err.print)(f"chart: {chart}")


def _read_constraints(path: Path) -> dict:
    from fleet.yaml_input import NotYaml, read_yaml

    try:
        loaded = read_yaml(path.read_text())
    except (OSError, NotYaml) as error:
        fail(f"--constraints: cannot read {escape(str(path))}: {escape(str(error))}", 2)
    if loaded.problems:
        # A model given twice: YAML keeps the last, the first one's constraints would be lost.
        fail(f"--constraints: {escape(str(path))}: {escape('; '.join(loaded.problems))}", 2)
    data = loaded.data
    if not isinstance(data, dict):
        fail(f"--constraints: {path} must hold a mapping of model -> constraints", 2)
    return data


async def _advise(config, request: dict):
    from temporalio.client import WorkflowFailureError

    from client import InvalidArgument

    fleet = fleet_client(config)
    try:
        handle = await fleet.start_advisor(request)
    except InvalidArgument as error:
        fail(str(error), 2)
    from cli.requests import ui_link

    # On stderr: stdout is the report (--format json/md pipe it on).
    link = ui_link(config, handle.id)
    err.print(handle.id + (f"  UI: {link}" if link else ""), markup=False, highlight=False)
    try:
        return await handle.result()
    except WorkflowFailureError as error:
        kind, message = failure(error)
        fail(f"{handle.id}: {message}")


def _rows(report, output: str, totals_to=None) -> None:
    """One row per workload in ``output`` (table, wide, tsv), then the totals and the sites whose
    offers could not be listed: on stdout, or on ``totals_to`` (a console) where stdout is rows only."""
    rows = [[w.model, w.site, f"{w.gpu_hours:,.1f}", f"{w.now:,.2f}", f"{w.advised:,.2f}", f"{w.saving:,.2f}",
             w.advised_offer or "-", w.note or (f"{len(w.rejected)} cheaper offers rejected" if w.rejected else "")]
            for w in report.workloads]
    show_rows(f"advisor: last {report.since}", ["model", "site", "GPU-h", "now $", "advised $", "saving $",
                                                "advised offer", "note"], rows, output, drop_narrow=("note", "advised offer"))
    say = (lambda line: totals_to.print(line, markup=False, highlight=False)) if totals_to is not None \
        else (lambda line: print(line, flush=True))
    say(f"total: now ${report.now:,.2f}, advised ${report.advised:,.2f}, saving ${report.saving:,.2f}")
    for site, error in sorted(report.catalog_errors.items()):
        say(f"not listed: {site}: {error}")


def write_chart(report, path: Path) -> None:
    """Grouped bars: $/hour per site now and advised (matplotlib's Agg backend: no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sites = [s.site for s in report.sites]
    x = list(range(len(sites)))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(sites) + 2), 4.5))
    try:
        ax.bar([i - 0.2 for i in x], [s.now_per_hour for s in report.sites], width=0.4, label="now")
        ax.bar([i + 0.2 for i in x], [s.advised_per_hour for s in report.sites], width=0.4, label="advised")
        ax.set_xticks(x, sites, rotation=30, ha="right")
        ax.set_ylabel("$ / hour")
        ax.set_title(f"last {report.since}: now \\${report.now:,.2f}, advised \\${report.advised:,.2f}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)
