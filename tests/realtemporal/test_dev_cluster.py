"""``gpufleet dev --temporal cluster``: the dev stack on the real Temporal cluster (PostgreSQL and
four services, deploy/temporal's shards, namespace and dynamic config) instead of the dev server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli import temporal_cluster
from cli.dev import DevPorts, port_in_use, start_cluster
from fleet.settings import Settings
from tests.conftest import write_fleet
from tests.ports import free_port
from tests.realtemporal import build
from tests.test_dev_stack import child_logs, children_of, command_of, gpufleet, start_dev, stop_dev

#: PostgreSQL's initdb and the schema, then four services one after another, on a busy machine.
CLUSTER_UP_SECONDS = 540


def derived_ports(port: int) -> dict[str, int]:
    """What ``gpufleet dev --temporal cluster --port PORT`` opens, by name, with no other port flag:
    each derived from PORT (the front door's only where HAProxy is installed and the port is free)."""
    ports = DevPorts.derive(port)
    metrics = DevPorts.derive(port, metrics=ports.metrics).metrics_ports(cluster=True)  # as derived, none swapped
    return {"frontend": port, "frontend-http": ports.http, "node-gateway": ports.gateway,
            "front-door": ports.front_door, **ports.cluster_ports(),
            **{name.removeprefix("temporal:"): number for name, number in metrics.items()}}


def stack_port() -> int:
    """A ``--port`` whose derived ports (``derived_ports``) are free too: other pytest-xdist workers
    hold ports of their own meanwhile."""
    for _ in range(50):
        port = free_port()
        if not any(port_in_use(number) for number in derived_ports(port).values()):
            return port
    raise OSError("no --port with its derived ports free")


def start_dev_cluster(env: dict, port: int, log: Path, *extra: str) -> subprocess.Popen:
    """tests/test_dev_stack.py's ``start_dev``, with ``--temporal cluster`` (no UI port: the cluster has none)."""
    return start_dev(env, port, None, log, "--temporal", "cluster", *extra, up_seconds=CLUSTER_UP_SECONDS)


def listening_ports(pids: list[int]) -> dict[int, str]:
    """The TCP ports these processes listen on, each with the command that holds it (Linux's /proc)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue  # ended meanwhile
    held: dict[int, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                held[int(fields[1].rsplit(":", 1)[1], 16)] = command_of(inodes[fields[9]])
    return held


def descendants_of(pid: int) -> list[int]:
    """Children, their children, ... (PostgreSQL's backends are its postmaster's)."""
    found, frontier = [], [pid]
    while frontier:
        children = [child for parent in frontier for child in children_of(parent)]
        found += children
        frontier = children
    return found


async def cluster_facts(address: str) -> tuple[object, set[str]]:
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
    from temporalio.api.workflowservice.v1 import GetClusterInfoRequest
    from temporalio.client import Client

    client = await Client.connect(address, namespace="default")
    info = await client.workflow_service.get_cluster_info(GetClusterInfoRequest())
    attributes = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace="default"))
    return info, set(attributes.custom_attributes)


@pytest.mark.timeout(900)
def test_dev_stack_on_the_real_cluster_joins_and_stops_cleanly(tmp_path: Path, temporal_server: Path) -> None:
    port = stack_port()
    state = tmp_path / "state"
    env = {**os.environ, "GPUFLEET_STATE_DIR": str(state), "GPUFLEET_CONFIG": str(write_fleet(tmp_path)),
           "TEMPORAL_ADDRESS": f"127.0.0.1:{port}", "COLUMNS": "250"}
    env.pop("GPUFLEET_TASK_QUEUE", None)
    env.pop("TEMPORAL_NAMESPACE", None)

    dev = start_dev_cluster(env, port, tmp_path / "dev.log")  # no other port flag: every port derives
    try:
        deadline = time.monotonic() + 30  # the "is up" block follows its first line
        while "Ctrl-C stops everything" not in (printed := (tmp_path / "dev.log").read_text()):
            assert time.monotonic() < deadline, printed
            time.sleep(0.2)
        processes = {pid: command_of(pid) for pid in descendants_of(dev.pid)}
        commands = list(processes.values())
        # The stack's Temporal is the cluster's four services and PostgreSQL, not the dev server.
        for service in temporal_cluster.SERVICES:
            assert sum(str(temporal_server) in c and f"--service {service}" in c for c in commands) == 1, commands
        assert any("postgres" in c and "-D" in c for c in commands), commands
        assert not any("start-dev" in c for c in commands), commands
        assert "a real cluster" in printed and "PostgreSQL" in printed, printed
        assert "Temporal UI      none" in printed, printed

        info, attributes = asyncio.run(cluster_facts(f"127.0.0.1:{port}"))
        assert info.history_shard_count == temporal_cluster.history_shards() >= 4
        assert "postgres" in info.persistence_store and "postgres" in info.visibility_store, info
        assert f"{info.history_shard_count} history shards" in printed
        # The search attributes, registered as on the dev path.
        from fleet import search_attributes

        assert {key.name for key in search_attributes.ALL} <= attributes
        # The services read deploy/temporal's dynamic config file, unchanged.
        assert (state / "temporal-cluster" / "dynamic-config.yaml").read_text() == \
            temporal_cluster.DYNAMIC_CONFIG.read_text()

        done = gpufleet(env, "join", "--site", "site-a", "--wait", timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr + child_logs(env)
        assert "ready" in done.stdout

        # Every port the cluster listens on derives from --port (before: PostgreSQL's and the services'
        # gRPC, membership and metrics ports were random), as the "is up" block says; so do the
        # workers' and the gateway's. (Each worker's SDK runtime also serves its own metrics page on
        # a free loopback port, which the worker's metrics port merges in: workers/metrics.py.)
        derived = derived_ports(port)
        everything = descendants_of(dev.pid)
        cluster_pids = [pid for pid in everything if str(temporal_server) in command_of(pid)
                        or "postgres" in command_of(pid).split(" ", 1)[0]]
        held = listening_ports(cluster_pids)
        stray = {number: command for number, command in held.items() if number not in derived.values()}
        assert not stray, "\n".join([f"{n}: {c}" for n, c in stray.items()] + [str(derived)])
        cluster_own = [derived[name] for name in ("frontend", "frontend-http", *temporal_cluster.INTERNAL_PORTS,
                                                  *temporal_cluster.METRICS_PORTS)]
        assert sorted(held) == sorted(cluster_own), (held, derived)
        stack = listening_ports(everything)
        for name in ("node-gateway", "control-plane", "node-agents"):
            assert derived[name] in stack, (name, derived, stack, printed, child_logs(env))
        assert f"PostgreSQL       127.0.0.1:{port + 8}" in printed, printed
        assert f"history {port + 1}, matching {port + 2}, worker {port + 3}" in printed, printed
    except BaseException:
        dev.send_signal(signal.SIGINT)
        dev.wait(timeout=180)
        raise
    stop_dev(dev)  # SIGINT: exit 0
    assert "Temporal cluster, PostgreSQL" in (tmp_path / "dev.log").read_text()
    left = [f"{pid}: {command}" for pid, command in processes.items() if Path(f"/proc/{pid}").exists()]
    assert not left, left


def test_dev_cluster_refuses_to_start_without_the_built_server(tmp_path: Path) -> None:
    """Nothing starts; the message names what to build (or, without PostgreSQL, what to install)."""
    state = tmp_path / "state"
    env = {**os.environ, "GPUFLEET_STATE_DIR": str(state), "GPUFLEET_CONFIG": str(write_fleet(tmp_path)),
           "GPUFLEET_REALTEMPORAL_CACHE": str(tmp_path / "no-build-here"), "COLUMNS": "250"}
    done = gpufleet(env, "dev", "--temporal", "cluster", "--port", str(free_port()), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    expected = ("apt-get install postgresql" if temporal_cluster.postgres_bin() is None
                else "python3 tests/realtemporal/build.py")
    assert expected in done.stdout, done.stdout
    assert "is up" not in done.stdout and not state.exists(), "nothing started"


def test_the_launcher_finds_what_build_py_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cli/temporal_cluster.py looks where tests/realtemporal/build.py (stdlib-only, so it cannot
    import the product) puts the server: the same version, folders and binaries."""
    for cache in (None, str(tmp_path)):
        if cache:
            monkeypatch.setenv("GPUFLEET_REALTEMPORAL_CACHE", cache)
        assert temporal_cluster.TEMPORAL_VERSION == build.TEMPORAL_VERSION
        assert temporal_cluster.bin_dir() == build.bin_dir()
        assert temporal_cluster.schema_dir() == build.schema_dir()
        assert temporal_cluster.built() == build.built()
    assert set(temporal_cluster.BUILT_BINARIES) == set(build.COMMANDS)


def test_every_cluster_port_derives_from_port_unless_cluster_port_is_given(tmp_path: Path) -> None:
    """``--temporal cluster``'s PostgreSQL and its services' gRPC, membership and metrics ports: from
    ``--port`` (before: random each start), or from ``--cluster-port``/``--metrics-port``."""
    ports = DevPorts.derive(7233)
    assert ports.cluster_ports() == {"history": 7234, "matching": 7235, "worker": 7236, "frontend-membership": 7237,
                                     "history-membership": 7238, "matching-membership": 7239,
                                     "worker-membership": 7240, "postgres": 7241}
    assert DevPorts.derive(20000, cluster=30000).cluster_ports()["postgres"] == 30007
    assert DevPorts.derive(20000, metrics=9000).metrics_ports(cluster=True) == {
        "control-plane": 9000, "node-agents": 9001, "temporal:frontend-metrics": 9002,
        "temporal:history-metrics": 9003, "temporal:matching-metrics": 9004, "temporal:worker-metrics": 9005}
    # What the stack hands the cluster: every port set, none left for it to pick at random.
    ports = DevPorts.derive(21000, metrics=24000)
    settings = Settings(state_dir=tmp_path, address="127.0.0.1:21000")
    planned = start_cluster(settings, ports, ports.metrics_ports(cluster=True)).planned_ports()
    assert planned == {"frontend": 21000, "frontend-http": 21010, **{name: 21001 + i for i, name in enumerate(
        temporal_cluster.INTERNAL_PORTS)}, **{name: 24002 + i for i, name in enumerate(temporal_cluster.METRICS_PORTS)}}
    # The dev server has no such ports: the flag alone is refused, nothing starts.
    done = gpufleet({**os.environ, "GPUFLEET_STATE_DIR": str(tmp_path / "state")}, "dev", "--port", str(free_port()),
                    "--cluster-port", str(free_port()), timeout=60)
    assert done.returncode == 2 and "--cluster-port: only with --temporal cluster" in done.stdout, done.stdout
    assert not (tmp_path / "state").exists()


def test_a_busy_cluster_port_is_refused_before_anything_starts(tmp_path: Path, temporal_server: Path) -> None:
    """Derived from --port or set by --cluster-port, a busy one exits 2 naming it; nothing starts."""
    import socket

    state = tmp_path / "state"
    env = {**os.environ, "GPUFLEET_STATE_DIR": str(state), "GPUFLEET_CONFIG": str(write_fleet(tmp_path)),
           "COLUMNS": "250"}
    port = stack_port()
    # --cluster-port's range apart from the one --port derives (each as many ports as the
    # cluster's internal services): two random picks may overlap, which the CLI refuses first.
    span = len(temporal_cluster.INTERNAL_PORTS) + len(temporal_cluster.METRICS_PORTS) + 16
    first = next(p for p in iter(stack_port, None) if abs(p - port) > span)
    for flags, busy, named in [((), port + 3, "--cluster-port (worker)"),
                               (("--cluster-port", str(first)), first + 7, "--cluster-port (postgres)")]:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", busy))
            holder.listen()
            done = gpufleet(env, "dev", "--temporal", "cluster", "--port", str(port), *flags, timeout=60)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"{named}: port {busy} is already in use" in done.stdout, done.stdout
        assert "is up" not in done.stdout and not state.exists(), "nothing started"
