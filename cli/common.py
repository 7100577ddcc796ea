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
