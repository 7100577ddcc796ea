"""What every ``gpufleet`` sub-command shares: option types, the two consoles,
settings, the Temporal connection, and how a failure is reported."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console

from fleet.config import ConfigError
from fleet.settings import Settings

console = Console()
err = Console(stderr=True, soft_wrap=True)

Address = Annotated[str, typer.Option("--address", envvar="TEMPORAL_ADDRESS", help="Temporal frontend host:port")]
StateDir = Annotated[Path, typer.Option("--state-dir", envvar="GPUFLEET_STATE_DIR", help="where sim and dev state live")]
ConfigPath = Annotated[Optional[str], typer.Option("--config", envvar="GPUFLEET_CONFIG",
                                                   help="sites.yaml (default: the built-in simulated fleet)")]

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


def fleet_client(config: Settings):
    """The client every command steers workflows through (it connects on first use).
    Imported here, not at the top: commands that never talk to Temporal start quicker."""
    from client import FleetClient

    return FleetClient(config)


def run(coro):
    """``asyncio.run`` for a command: an unreachable server exits 1 saying where it was expected."""
    from client import Unreachable

    try:
        return asyncio.run(coro)
    except Unreachable as error:
        unreachable(error)


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


# -- what the user reads -----------------------------------------------------------------------
import re as _re
import sys as _sys

OutputFormat = Annotated[str, typer.Option("--output", "-o", help="table, or json (one object per row)")]
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


def failure(error: BaseException) -> tuple[str, str]:
    """(type, message) of a workflow failure's root cause, each said once."""
    cause = getattr(error, "cause", None) or error
    kind = getattr(cause, "type", None) or type(cause).__name__
    return kind, human(str(cause), kind)


def show_rows(title: str, columns: list[str], rows: list[list], output: str = "table",
              drop_narrow: tuple[str, ...] = ()) -> None:
    """A list as a table on a terminal (wrapped to its width; ``drop_narrow`` columns go
    first when it is narrow), as plain tab-separated lines when piped, or as JSON."""
    import json

    if output not in ("table", "json"):
        fail(f"--output: must be table or json, not {output!r}", 2)
    plain = [[_plain(cell) for cell in row] for row in rows]
    if output == "json":
        print(json.dumps([dict(zip(columns, row)) for row in plain], indent=2), flush=True)
        return
    if not console.is_terminal:
        print("\t".join(columns))
        for row in plain:
            print("\t".join(row))
        _sys.stdout.flush()
        return
    from rich.table import Table

    keep = list(range(len(columns)))
    if console.width < 100:
        keep = [i for i in keep if columns[i] not in drop_narrow]
    table = Table(*[columns[i] for i in keep], title=title, expand=False)
    for column in table.columns:
        column.overflow = "fold"
    for row in rows:
        table.add_row(*[row[i] if isinstance(row[i], str) or hasattr(row[i], "__rich__") or hasattr(row[i], "__rich_console__") else str(row[i]) for i in keep])
    console.print(table)


def _plain(cell) -> str:
    from rich.text import Text

    if isinstance(cell, str):
        return Text.from_markup(cell).plain
    return str(cell)
