"""Shared set-up for benchmarks: one dev server, one simulated fleet, one process."""

from __future__ import annotations

import asyncio
import sys
import subprocess
import math
import os
import statistics
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, AsyncIterator, Awaitable, Callable, NoReturn

import typer
import yaml
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from fleet import search_attributes
from cli.dev import dev_server_tuning_flags, temporal_binary
from fleet.settings import NodeAgentEnv, Settings


def fleet(sites: int = 5, capacity: int = 100, latency_ms: int = 0, boot_seconds: float = 0.0) -> dict:
    """A zero-latency simulated fleet with ``sites`` sites."""
    return {
        "mode": "sim",
        "accounts": [{"name": f"acct-{i}", "provider": "lambda", "credentials": {"env": "X"}} for i in range(sites)],
        "sites": [
            {"name": f"site-{i}", "provider": "lambda", "account": f"acct-{i}", "region": "r", "gpu": "H100",
             "gpu_memory_gb": 80, "gpus_per_machine": 8, "instance_type": "gpu_8x_h100",
             "price_per_gpu_hour": 2.0 + i / 10, "max_nodes": capacity,
             "sim": {"capacity": capacity, "quota": capacity, "api_latency_ms": latency_ms, "boot_seconds": boot_seconds}}
            for i in range(sites)
        ],
    }


@asynccontextmanager
async def bench_env(fleet_config: dict) -> AsyncIterator[tuple[WorkflowEnvironment, Settings]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sites.yaml"
        path.write_text(yaml.safe_dump(fleet_config))
        env = await WorkflowEnvironment.start_local(
            dev_server_existing_path=temporal_binary(), data_converter=pydantic_data_converter,
            search_attributes=search_attributes.ALL, dev_server_log_level="error",
            dev_server_extra_args=dev_server_tuning_flags(),
        )
        try:
            settings = Settings(
                address=env.client.service_client.config.target_host, state_dir=Path(tmp),
                config=str(path), task_queue=f"bench-{uuid.uuid4().hex[:6]}",
            )
            yield env, settings
        finally:
            await env.shutdown()


def start_node_host(settings: Settings, health_seconds: float | None = None) -> subprocess.Popen:
    """The simulated nodes in their own process, as under ``gpufleet dev``, polling fast.

    ``health_seconds``: the agents' probe interval (0: no health reports)."""
    env = {**os.environ, **settings.env()}
    if health_seconds is not None:
        env[NodeAgentEnv.variable("health_seconds")] = str(health_seconds)
    return subprocess.Popen([sys.executable, "-m", "workers.node_agent", "--sim", "--poll-seconds", "0.05"], env=env)


def echo_worker(client, task_queue: str):
    """The signal-baseline worker (bench.echo), configured like the control-plane worker."""
    from concurrent.futures import ThreadPoolExecutor

    from temporalio.worker import Worker

    from bench.echo import Echo, mark
    from workers.control_plane import POLLERS
    from workers.workflow_runner import workflow_runner

    return Worker(client, task_queue=task_queue, workflows=[Echo], activities=[mark],
                  workflow_runner=workflow_runner(client.data_converter), activity_executor=ThreadPoolExecutor(8),
                  **POLLERS)


async def timed(run: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await run()
    return time.perf_counter() - start


async def until(predicate, timeout: float = 30, interval: float = 0.005) -> float:
    """Poll (in a thread) until truthy; returns perf_counter() when it was seen."""
    deadline = time.perf_counter() + timeout
    while not await predicate():
        if time.perf_counter() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(interval)
    return time.perf_counter()


def median(values: list[float]) -> float:
    return statistics.median(values)


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())


# -- the command line: every bench is a typer program (``python -m bench.<name> --help``) -------
#: ``--smoke``: the size tests/test_bench_smoke.py runs (seconds; a crash fails it).
Smoke = Annotated[bool, typer.Option("--smoke", help="the suite's size (tests/test_bench_smoke.py): seconds; "
                                                     "a crash fails it")]


def command_line(command: Callable[..., object], doc: str | None = None) -> None:
    """Run ``command`` as the bench's program: its parameters are the options (``--kebab-case``
    of each name, typer), ``doc``'s first paragraph (the module's docstring) the ``--help``.
    A command's return value is not the exit status: it raises SystemExit for that."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    app.command(help=(doc or command.__doc__ or "").strip().split("\n\n")[0] or None)(command)
    app()


def bench_args(values: dict[str, object]) -> SimpleNamespace:
    """A command's options (its ``locals()``) as the ``args`` the bench's code reads and its
    ``--smoke`` rewrites, as argparse's namespace was."""
    return SimpleNamespace(**values)


def usage_error(message: str) -> NoReturn:
    """A bad option or combination of options: the usage and ``message``, exit status 2 (as
    argparse's ``parser.error`` was)."""
    raise typer.BadParameter(message)


# -- figures: percentiles and other processes' CPU and memory (Linux /proc) -----------------
def pct(values: list[float], p: float) -> float:
    """Nearest rank: the smallest value with at least p% of the values at or below it (a p99 of
    fewer than 100 values is the largest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered) / 100) - 1))]


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of another process (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pid() -> int:
    """The dev server WorkflowEnvironment started as this process's child."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if name.endswith("(temporal") and int(rest.split()[1]) == os.getpid():
            return int(stat.parent.name)
    raise RuntimeError("no dev server child process")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb(pid: int) -> float:
    """The most resident memory the process has held so far (``VmHWM``), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")
