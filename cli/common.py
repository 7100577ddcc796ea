"""What every ``gpufleet`` sub-command shares: option types, the two consoles,
settings, the Temporal connection, and how a failure is reported."""

from __future__ import annotations

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
    return Settings.from_env(address=address, state_dir=state_dir, config=config)


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[red]error:[/] {message}")
    raise typer.Exit(code)


def report_config(error: ConfigError) -> NoReturn:
    err.print(f"[red]{error.source}: invalid fleet config[/]")
    for problem in error.problems:
        err.print(f"  {problem}")
    raise typer.Exit(2)


async def connect(config: Settings):
    """A Temporal client, or exit 1 saying where the server was expected."""
    from fleet.temporal import connect as temporal_connect

    try:
        return await temporal_connect(config)
    except RuntimeError as error:
        fail(f"cannot reach Temporal at {config.address} ({error}); is `gpufleet dev` running?")


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
