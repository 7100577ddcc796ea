"""What every ``gpufleet`` sub-command shares: option types, the two consoles,
settings, the Temporal connection, and how a failure is reported."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console

from fleet.config import ConfigError
from fleet.settings import CONFIG_ENV, STATE_DIR_ENV, Settings

console = Console()
err = Console(stderr=True, soft_wrap=True)

Address = Annotated[str, typer.Option("--address", envvar="TEMPORAL_ADDRESS", help="Temporal frontend host:port")]
StateDir = Annotated[Path, typer.Option("--state-dir", envvar=STATE_DIR_ENV, help="where sim and dev state live")]
ConfigPath = Annotated[Optional[str], typer.Option("--config", envvar=CONFIG_ENV,
                                                   help="sites.yaml (default: the built-in simulated fleet)")]
Kubeconfig = Annotated[Optional[str], typer.Option(
    "--kubeconfig", envvar="KUBECONFIG",
    help="mode real: kubeconfig file(s), ':'-separated (default: in-cluster, then ~/.kube/config)")]
Context = Annotated[Optional[str], typer.Option("--context", help="mode real: kubeconfig context")]
Namespace = Annotated[str, typer.Option(
    "--namespace", "-n", help="mode real: the control plane's namespace, where its state objects are")]

DEFAULT_ADDRESS = "localhost:7233"
DEFAULT_STATE_DIR = Path(".gpufleet")


def settings(address: str | None = None, state_dir: Path | None = None, config: str | None = None) -> Settings:
    """The same settings every entry point reads: flags first, then ``TEMPORAL_*``/``GPUFLEET_*``."""
    # The options' default address yields to a temporal.toml profile (TEMPORAL_PROFILE).
    return Settings.from_env(address=None if address == DEFAULT_ADDRESS else address, state_dir=state_dir, config=config)


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[red]error:[/] {message}")
    raise typer.Exit(code)


def report_config(error: ConfigError) -> NoReturn:
    err.print(f"[red]{error.source}: invalid fleet config[/]")
    for problem in error.problems:
        err.print(f"  {problem}")
    raise typer.Exit(2)


def unreachable(error) -> NoReturn:
    fail(f"cannot reach Temporal at {error.address} ({error.reason}); is `gpufleet dev` running?")


def fleet_client(config: Settings, update_answer_timeout: float | None = None):
    """The client every command steers workflows through (it connects on first use). An update
    whose answer is slow to come is said on stderr, with until when it is waited for (the client's
    ``UPDATE_ANSWER_TIMEOUT``, or ``update_answer_timeout`` seconds: a command's own --timeout; one
    not above 0 leaves the default). Imported here, not at the top: commands that never talk to
    Temporal start quicker."""
    from client import FleetClient

    if update_answer_timeout is not None and not update_answer_timeout > 0:
        update_answer_timeout = None
    return FleetClient(config, update_answer_timeout=update_answer_timeout,
                       waiting=lambda line: err.print(line, markup=False, highlight=False))


def run(coro):
    """``asyncio.run`` for a command: an unreachable server exits 1 saying where it was expected; a
    query no worker answered exits 1 saying which, and where the worker should have been; an update
    taken but not answered in time exits 1 saying that it goes on, and how to look at it."""
    from rich.markup import escape

    from client import NoWorker, Unreachable, UpdateUnanswered

    try:
        return asyncio.run(coro)
    except Unreachable as error:
        unreachable(error)
    except (NoWorker, UpdateUnanswered) as error:
        fail(escape(str(error)))


async def connect(config: Settings):
    """A Temporal client, or exit 1 saying where the server was expected."""
    from client import Unreachable

    try:
        return await fleet_client(config).temporal()
    except Unreachable as error:
        unreachable(error)


def fleet_env(state_dir: Path | None, config: str | None):
    """The fleet as the activities see it (config, cluster, simulated world)."""
    from activities.env import FleetEnv

    try:
        return FleetEnv.from_settings(settings(state_dir=state_dir, config=config))
    except ConfigError as error:
        report_config(error)


def sim_world(state_dir: Path | None, config: str | None):
    env = fleet_env(state_dir, config)
    if env.world is None:
        fail("`gpufleet sim` needs a config in sim mode", 2)
    return env.world


def sim_machine(state_dir: Path | None, config: str | None, node: str):
    """The simulated world and its machine named ``node`` (exit 2, naming it, when there is none)."""
    world = sim_world(state_dir, config)
    machine = world.machine_by_name(node)
    if machine is None:
        fail(f"node: no simulated machine named {node!r}", 2)
    return world, machine


# -- what the user reads -----------------------------------------------------------------------
import re as _re
import sys as _sys

OUTPUT_FORMATS = ("table", "wide", "json", "tsv")


class ChosenFormat(str):
    """An ``--output`` the user gave (a default stays a plain ``str``): an explicit ``-o table``
    is a table even when piped, where the default is tab-separated lines."""


def _check_output(ctx: typer.Context, param: typer.CallbackParam, value: str | None):
    if value is None:
        return value
    if value not in OUTPUT_FORMATS:
        raise typer.BadParameter(f"must be one of {', '.join(OUTPUT_FORMATS)}, not {value!r}")
    # By name: typer carries a click of its own, whose ParameterSource is not click's.
    source = ctx.get_parameter_source(param.name)
    return value if source is None or source.name == "DEFAULT" else ChosenFormat(value)


OutputFormat = Annotated[str, typer.Option(
    "--output", "-o", callback=_check_output,
    help="table (fits the terminal: columns go in a set order when narrow), wide (every column), "
         "json (one object per row), tsv (tab-separated, with a header; the default when piped)")]
_PYDANTIC_URL = _re.compile(r"\s*For further information visit https://errors\.pydantic\.dev\S*")


def human(message: str, kind: str | None = None) -> str:
    """One prefix per cause and no library URLs: ``InvalidRequest: InvalidRequest: x`` reads
    ``InvalidRequest: x``; pydantic's "For further information visit ..." goes."""
    text = _PYDANTIC_URL.sub("", str(message)).strip()
    while True:  # "X: X: msg" or "X: X while ...: msg" said once
        match = _re.match(r"^([A-Z][A-Za-z]+): (\1\b.*)$", text, _re.S)
        if not match:
            break
        text = match.group(2)
    head = _re.match(r"^([A-Z][A-Za-z]+)\b", text)
    if head:  # "X while doing: X: msg": the inner repeat says nothing new
        text = text.replace(f": {head.group(1)}: ", ": ")
    if kind and not text.startswith(kind):
        text = f"{kind}: {text}"
    return text


def clock(at: datetime) -> str:
    """``HH:MM:SS UTC``: the zone the workflows' details give their times in, whatever this
    machine's is, so a line the CLI adds to a step reads on the same clock as the step."""
    return f"{at.astimezone(timezone.utc):%H:%M:%S} UTC"


def failure(error: BaseException) -> tuple[str, str]:
    """(type, message) of a workflow failure's root cause, each said once."""
    cause = getattr(error, "cause", None) or error
    kind = getattr(cause, "type", None) or type(cause).__name__
    return kind, human(str(cause), kind)


def _cell(value):
    """A cell as Table.add_row takes it: markup strings and renderables as they are."""
    if isinstance(value, str) or hasattr(value, "__rich__") or hasattr(value, "__rich_console__"):
        return value
    return str(value)


#: A cell this wide or narrower is never cut (a count, a price, a state): its column goes first.
WHOLE_CELL = 10


def fit_table(title: str | None, columns: list[str], rows: list[list], width: int, narrow=(), wide: bool = False,
              **table_options):
    """A rich Table of ``rows`` that fits ``width`` and never folds a header.

    While it is wider than ``width``, the next step of ``narrow`` (the order the call site declares)
    either drops a column (a name) or shortens its header (``(name, short)``). What is still too
    wide then is cut with an ellipsis, the widest cells first, each column no narrower than its
    header or ``WHOLE_CELL``, the first column (what names the row) last. Only when even that does
    not fit do undeclared columns go, from the right; the first always stays unless a step names it.
    ``wide``: every column, as wide as its content."""
    from rich.cells import cell_len
    from rich.measure import Measurement
    from rich.table import Table

    headers = list(columns)
    keep = list(range(len(columns)))
    cells = [[_cell(row[i]) for i in range(len(columns))] for row in rows]
    unbounded = console.options.update_width(100_000)

    def content_width(cell) -> int:
        renderable = console.render_str(cell) if isinstance(cell, str) else cell
        return Measurement.get(console, unbounded, renderable).maximum

    contents = [max([0] + [content_width(row[i]) for row in cells]) for i in range(len(columns))]

    def full(i: int) -> int:
        return max(contents[i], cell_len(headers[i]))

    def floor(i: int) -> int:
        return max(cell_len(headers[i]), min(contents[i], WHOLE_CELL))

    def chrome() -> int:  # the borders and padding around the kept columns: their table with nothing in it
        return Measurement.get(console, unbounded, Table(*[""] * len(keep), **table_options)).maximum

    if not wide:
        for step in narrow:
            if chrome() + sum(full(i) for i in keep) <= width:
                break
            name, short = (step, None) if isinstance(step, str) else step
            if name not in columns or columns.index(name) not in keep:
                continue
            if short is None and len(keep) > 1:
                keep.remove(columns.index(name))
            elif short is not None:
                headers[columns.index(name)] = short
        for index in reversed(keep[1:]):
            if chrome() + sum(floor(i) for i in keep) <= width:
                break
            keep.remove(index)
    allotted = {i: full(i) for i in keep}
    if not wide:
        # The widest columns give way first, down to their floor; the first column after the rest.
        for cut in (keep[1:], keep):
            room = width - chrome() - sum(allotted[i] for i in keep if i not in cut)
            cap = max([allotted[i] for i in cut] or [0])
            while cap > 0 and sum(min(allotted[i], max(cap, floor(i))) for i in cut) > room:
                cap -= 1
            allotted |= {i: min(allotted[i], max(cap, floor(i))) for i in cut}
            if chrome() + sum(allotted.values()) <= width:
                break
    table = Table(*[headers[i] for i in keep], title=title, expand=False, **table_options)
    for column, i in zip(table.columns, keep):
        column.no_wrap, column.overflow, column.width = True, "ellipsis", allotted[i]
    for row in cells:
        table.add_row(*[row[i] for i in keep])
    return table


def print_table(table, wide: bool = False) -> None:
    """``table`` at the console's width; ``wide``: at its own width (the terminal wraps long lines)."""
    if not wide:
        console.print(table)
        return
    from rich.measure import Measurement

    needed = Measurement.get(console, console.options.update_width(100_000), table).maximum
    before = console.width
    console.width = max(before, needed)
    try:
        console.print(table, crop=False)
    finally:
        console.width = before


def piped_format(output: str) -> str:
    """The format to print in: the default ``table`` is ``tsv`` when stdout is not a terminal."""
    if output not in OUTPUT_FORMATS:
        fail(f"--output: must be one of {', '.join(OUTPUT_FORMATS)}, not {output!r}", 2)
    if output == "table" and not isinstance(output, ChosenFormat) and not console.is_terminal:
        return "tsv"
    return str(output)


def print_tsv(columns: list[str], rows: list[list]) -> None:
    """A header line, then one line per row; a tab or newline inside a cell becomes a space."""
    def clean(cell) -> str:
        return _re.sub(r"[\t\r\n]+", " ", _plain(cell))

    print("\t".join(clean(c) for c in columns))
    for row in rows:
        print("\t".join(clean(cell) for cell in row))
    _sys.stdout.flush()


def show_rows(title: str, columns: list[str], rows: list[list], output: str = "table",
              drop_narrow: tuple = ()) -> None:
    """A list in the ``--output`` format: ``table`` fits the terminal's width (``drop_narrow``
    is the declared order in which columns go or shorten their header when it is narrow; see
    ``fit_table``), ``wide`` shows every column, ``json`` one object per row, ``tsv`` (the default
    when piped) tab-separated lines under a header."""
    import json

    output = piped_format(output)
    if output == "json":
        print(json.dumps([dict(zip(columns, [_plain(cell) for cell in row])) for row in rows], indent=2), flush=True)
        return
    if output == "tsv":
        print_tsv(columns, rows)
        return
    wide = output == "wide"
    print_table(fit_table(title, columns, rows, console.width, drop_narrow, wide=wide), wide=wide)


def _plain(cell) -> str:
    from rich.text import Text

    if isinstance(cell, str):
        return Text.from_markup(cell).plain
    if isinstance(cell, Text):
        return cell.plain
    return str(cell)
