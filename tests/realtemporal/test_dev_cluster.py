"""``gpufleet dev --temporal cluster``: the dev stack on the real Temporal cluster (PostgreSQL and
four services, deploy/temporal's shards, namespace and dynamic config) instead of the dev server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest

from cli import temporal_cluster
from tests.conftest import write_fleet
from tests.ports import free_port
from tests.realtemporal import build
from tests.test_dev_stack import child_logs, children_of, command_of, gpufleet, start_dev, stop_dev

#: PostgreSQL's initdb and the schema, then four services one after another, on a busy machine.
CLUSTER_UP_SECONDS = 540


def stack_port() -> int:
    """A ``--port`` whose derived node-gateway port (``--port`` + DEV_GATEWAY_OFFSET) is free too:
    other pytest-xdist workers hold ports of their own meanwhile."""
    import socket

    from cli.dev import DEV_GATEWAY_OFFSET

    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + DEV_GATEWAY_OFFSET))
            except OSError:
                continue
        return port
    raise OSError("no --port with a free gateway port")


def start_dev_cluster(env: dict, port: int, log: Path) -> subprocess.Popen:
    """tests/test_dev_stack.py's ``start_dev``, with ``--temporal cluster`` (no UI port: the cluster has none)."""
    return start_dev(env, port, None, log, "--temporal", "cluster", "--http-port", str(free_port()),
                     up_seconds=CLUSTER_UP_SECONDS)


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

    dev = start_dev_cluster(env, port, tmp_path / "dev.log")
    try:
        printed = (tmp_path / "dev.log").read_text()
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
