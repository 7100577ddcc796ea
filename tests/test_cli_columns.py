"""Lists read at 80 columns: a table drops or shortens columns in the order its call site
declares (never folding a header or a count), ``-o wide`` keeps them all, ``-o tsv``/``json``
are for scripts, piped output is tab-separated, and ``gpufleet top`` prints when piped."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

import cli.common
import cli.top
from fleet.config import load_config
from tests.ports import free_port
from workers.metrics import NODE_STATES, FleetSnapshot

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def terminal(monkeypatch):
    """An 80-column terminal in place of stdout's console; its text."""
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)
    monkeypatch.setattr(cli.common, "console", console)
    monkeypatch.setattr(cli.top, "console", console)
    return out


def header_cells(text: str) -> list[str]:
    """The header row's cells of a boxed table (the line between the first two rules)."""
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("┃"))
    return [cell.strip() for cell in header.strip("┃").split("┃")]


def gpufleet(*args: str, columns: int = 80, state_dir: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUFLEET_STATE_DIR": str(state_dir), "COLUMNS": str(columns)}
    env.pop("GPUFLEET_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "cli", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


NODE_COLUMNS = ["node", "site", "provider", "GPU", "ready", "schedulable", "taints", "machine"]
NODE_ORDER = ("provider", "machine", "GPU", ("schedulable", "sched"))  # cli/main.py's `nodes`


def node_rows(count: int = 3) -> list[list[str]]:
    return [[f"lambda-us-east-{i:04d}-9f3ab2", "lambda-us-east", "lambda", "NVIDIA-H100-80GB-HBM3", "yes",
             "[yellow]cordoned[/]", "gpufleet.io/repair=NoSchedule", f"i-0a1b2c3d4e5f6{i:04d}"] for i in range(count)]


def test_a_table_at_80_columns_keeps_whole_headers_and_drops_in_the_declared_order(terminal) -> None:
    cli.common.show_rows("nodes", NODE_COLUMNS, node_rows(), "table", drop_narrow=NODE_ORDER)
    text = terminal.getvalue()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    shown = header_cells(text)
    # Every header is whole (or its declared short form): none folded onto a second line.
    assert set(shown) <= set(NODE_COLUMNS) | {"sched"}, shown
    dropped = [c for c in NODE_COLUMNS if c not in shown and not (c == "schedulable" and "sched" in shown)]
    assert dropped and set(dropped) == {"provider", "machine", "GPU"}.intersection(
        ["provider", "machine", "GPU"][:len(dropped)]), (dropped, text)
    # The row's name stays whole; a cut cell ends in an ellipsis, never folds to a couple of letters.
    assert text.count("lambda-us-east-0000-9f3ab2") == 1
    for line in text.splitlines():
        if line.startswith("│"):
            cells = [cell.strip() for cell in line.strip("│").split("│")]
            assert all(len(cell) >= cli.common.WHOLE_CELL for cell in cells if cell.endswith("…")), line
            assert {"yes", "cordoned"} <= set(cells), line


def test_wide_shows_every_column_whatever_the_width(terminal) -> None:
    cli.common.show_rows("nodes", NODE_COLUMNS, node_rows(), cli.common.ChosenFormat("wide"), drop_narrow=NODE_ORDER)
    text = terminal.getvalue()
    assert header_cells(text) == NODE_COLUMNS
    assert "gpufleet.io/repair=NoSchedule" in text and "NVIDIA-H100-80GB-HBM3" in text and "…" not in text


def test_tsv_and_json_are_for_scripts(terminal, capsys) -> None:
    rows = node_rows(2)
    cli.common.show_rows("nodes", NODE_COLUMNS, rows, "tsv", drop_narrow=NODE_ORDER)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("\t") == NODE_COLUMNS
    assert lines[1].split("\t")[5] == "cordoned"  # markup gone
    cli.common.show_rows("nodes", NODE_COLUMNS, rows, "json", drop_narrow=NODE_ORDER)
    assert json.loads(capsys.readouterr().out)[1]["machine"] == rows[1][7]


def snapshot() -> FleetSnapshot:
    """The built-in fleet with three ready nodes a site, spend, one incident, one site's weight."""
    config = load_config(None)
    snap = FleetSnapshot(sites=list(config.sites), taken_at=time.time())
    for site in config.sites:
        snap.nodes[site.name]["ready"] = 3
        snap.gpus_total[site.name] = 24
        snap.spend[(site.name, site.provider)] = 71.76
        snap.site_states[site.name] = "serving"
        snap.site_routes[site.name] = 250
    snap.incidents[config.sites[0].name] = 1
    return snap


def test_top_reads_at_80_columns(terminal) -> None:
    """Before: every cell folded to about 2 letters at 80 columns."""
    snap = snapshot()
    cli.top.console.print(cli.top.render(snap))
    text = terminal.getvalue()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    header = next(line for line in lines if line.split()[:1] == ["site"]).split()
    # Headers whole, in their declared short forms, dropped only as SITE_NARROW says.
    declared = {name: short for name, short in (s for s in cli.top.SITE_NARROW if isinstance(s, tuple))}
    columns = ["site", "provider", *NODE_STATES, "GPUs ok", "contained", "incidents", "state", "weight", "$/h"]
    full_or_short = {c: {c, declared.get(c, c)} for c in columns}
    shown = [c for c in columns if set(header) & full_or_short[c] or c == "GPUs ok" and "GPUs" in header]
    assert "ready" in shown and "$/h" in shown and "site" in shown
    dropped = [c for c in columns if c not in shown]
    steps = [s for s in cli.top.SITE_NARROW if isinstance(s, str)]
    assert set(dropped) == set(steps[:len(dropped)]), (dropped, text)
    # Every site's name and counts are whole.
    for site in snap.sites:
        row = next(line for line in lines if line.startswith(site.name + " "))
        assert row.split()[-2:] == ["250", "71.76"] and "…" not in row, row


def test_top_says_unknown_not_zero_for_a_source_that_did_not_answer() -> None:
    """Before: a cluster that did not answer read as every site with 0 nodes and $0.00/h."""
    snap = snapshot()
    snap.errors["cluster"] = "ConnectionRefusedError: the API server is away"
    summary, parts = cli.top.sections(snap)
    sites = next(p for p in parts if p.key == "sites")
    columns = dict(zip(sites.columns, sites.rows[0]))
    assert [columns[state] for state in NODE_STATES] == ["?"] * len(NODE_STATES)
    assert (columns["GPUs ok"], columns["$/h"]) == ("?", "?")
    assert (columns["state"], columns["weight"]) == ("serving", "250")  # from the sources that answered
    assert (summary["nodes"], summary["GPUs"], summary["spend $/h"], summary["incidents"]) == ("?", "?", "?", "1")


@pytest.mark.integration  # python -m cli, piped
def test_top_prints_a_snapshot_when_piped(tmp_path: Path) -> None:
    """Before: piped, `gpufleet top` drew a live view nobody saw and printed nothing."""
    nowhere = f"127.0.0.1:{free_port()}"  # no Temporal there: the snapshot says so
    piped = gpufleet("top", "--address", nowhere, state_dir=tmp_path)
    assert piped.returncode == 0, piped.stderr
    lines = piped.stdout.splitlines()
    sites = lines.index("# sites")
    assert lines[sites + 1].split("\t")[:3] == ["site", "provider", "provisioning"]
    assert lines[sites + 2].split("\t")[0] == "lambda-us-east"
    assert "# unavailable" in lines and any(line.startswith("temporal\t") for line in lines)
    as_json = json.loads(gpufleet("top", "--address", nowhere, "-o", "json", state_dir=tmp_path).stdout)
    assert {s["site"] for s in as_json["sites"]} >= {"lambda-us-east", "own-dc-ber"}
    assert as_json["summary"]["nodes"] == "0"


@pytest.mark.integration  # python -m cli, piped
def test_every_list_takes_the_four_formats_and_refuses_others(tmp_path: Path) -> None:
    tsv = gpufleet("sim", "machines", "-o", "tsv", state_dir=tmp_path)
    assert tsv.returncode == 0, tsv.stderr
    assert tsv.stdout.splitlines()[0].split("\t") == ["machine", "name", "site", "type", "reboots", "deleted"]
    wide = gpufleet("nodes", "-o", "wide", state_dir=tmp_path)
    assert wide.returncode == 0 and "machine" in wide.stdout and "┃" in wide.stdout, wide.stdout + wide.stderr
    bad = gpufleet("nodes", "-o", "xml", state_dir=tmp_path)
    assert bad.returncode == 2
    assert "--output" in bad.stderr and "table, wide, json, tsv" in bad.stderr and "xml" in bad.stderr, bad.stderr


@pytest.mark.integration  # python -m cli, piped
def test_piped_output_is_tsv_unless_a_table_is_asked_for(tmp_path: Path) -> None:
    piped = gpufleet("sim", "machines", state_dir=tmp_path)
    assert piped.stdout.splitlines()[0] == "machine\tname\tsite\ttype\treboots\tdeleted"
    table = gpufleet("sim", "machines", "-o", "table", state_dir=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "┃" in table.stdout and "\t" not in table.stdout
    assert all(len(line) <= 80 for line in table.stdout.splitlines())
