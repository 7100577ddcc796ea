"""``gpufleet dev`` as a person runs it: up, join, Ctrl-C, up again, resumed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cli.dev import SERVER_START_SECONDS
from tests.conftest import write_fleet
from workers.node_agent import SIM_HOST_NICE
from tests.ports import free_dev_port, free_port




def gpufleet(env: dict, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def start_dev(env: dict, port: int, ui_port: int | None, log: Path, *extra: str,
              up_seconds: float | None = None) -> subprocess.Popen:
    """``gpufleet dev`` (``extra``: more of its options), once it says it is up."""
    ui = ["--ui-port", str(ui_port)] if ui_port is not None else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "dev", *extra, "--port", str(port), *ui],
        env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
    )
    # Generous: a fresh CI machine's first start (cold disk, new database) is far slower
    # than a warm one (`gpufleet dev` itself gives the server SERVER_START_SECONDS); the
    # stack's own logs say where it stood.
    deadline = time.monotonic() + (SERVER_START_SECONDS + 60 if up_seconds is None else up_seconds)
    while "gpufleet dev is up" not in log.read_text():
        assert proc.poll() is None, f"{log.read_text()}\n{child_logs(env)}"
        if time.monotonic() > deadline:
            proc.send_signal(signal.SIGINT)  # its children stop with it
            proc.wait(timeout=120)
            pytest.fail(f"not up in time:\n{log.read_text()}\n{child_logs(env)}")
        time.sleep(0.2)
    return proc


def child_logs(env: dict) -> str:
    logs = Path(env["GPUFLEET_STATE_DIR"]) / "logs"
    return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}"
                     for path in sorted(logs.glob("*.log")))


def stop_dev(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0


def children_of(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(status.parent.name))
    return found


def command_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


@pytest.mark.timeout(600)
def test_dev_stack_stops_cleanly_and_resumes_open_joins(tmp_path: Path) -> None:
    port, ui_port = free_dev_port(), free_port()
    env = {**os.environ, "GPUFLEET_STATE_DIR": str(tmp_path / "state"), "GPUFLEET_CONFIG": str(write_fleet(tmp_path)),
           "TEMPORAL_ADDRESS": f"127.0.0.1:{port}", "COLUMNS": "200"}
    env.pop("GPUFLEET_TASK_QUEUE", None)

    dev = start_dev(env, port, ui_port, tmp_path / "dev1.log")
    children = children_of(dev.pid)
    # "is up" means up: every metrics page it lists answers at once (before, the node host's could
    # still be importing, and a scrape or a test right after found nothing on its port).
    pages = re.findall(r"metrics +(http://\S+/metrics)", (tmp_path / "dev1.log").read_text())
    assert len(pages) == 3, (tmp_path / "dev1.log").read_text()  # control-plane, node-agents, the dev server
    for page in pages:
        with urllib.request.urlopen(page, timeout=10) as answer:
            assert answer.status == 200, page
    # The front door (HAProxy) is a fourth child where haproxy is installed and port 8080 free.
    front_door = "front door       http" in (tmp_path / "dev1.log").read_text()
    assert len(children) == 4 + front_door, "temporal server, control-plane worker, node gateway, node-agent host[, front door]"
    assert f"http://127.0.0.1:{ui_port}" in (tmp_path / "dev1.log").read_text()
    # A --ui-port that is not --port + 1000: other shells are told the UI's URL, the children know it.
    assert f"export GPUFLEET_UI_URL=http://127.0.0.1:{ui_port}" in (tmp_path / "dev1.log").read_text()
    # The simulated machines yield the CPU to the control plane they share it with.
    host = next(pid for pid in children if "workers.node_agent" in command_of(pid))
    worker = next(pid for pid in children if "workers.control_plane" in command_of(pid))
    assert f"GPUFLEET_UI_URL=http://127.0.0.1:{ui_port}".encode() in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
    deadline = time.monotonic() + 60  # the host lowers its own priority once it has started
    while nice_of(host) != nice_of(worker) + SIM_HOST_NICE:
        assert time.monotonic() < deadline, f"node host at nice {nice_of(host)}, worker at {nice_of(worker)}"
        time.sleep(0.5)
    schedules = gpufleet(env, "schedules", "list")
    assert "gpufleet-site-reconcile" in schedules.stdout and "gpufleet-catalog-refresh" in schedules.stdout
    # The demand loop runs from the start: a Pending pod on a fresh stack buys its node.
    assert gpufleet(env, "sim", "pods", "add", "want", "--gpus", "1", "--site", "site-a").returncode == 0
    deadline = time.monotonic() + 60
    while not json.loads(gpufleet(env, "sim", "pods", "list", "--output", "json").stdout)[0]["node"].startswith("site-a"):
        assert time.monotonic() < deadline, gpufleet(env, "demand").stdout + child_logs(env)
        time.sleep(0.5)
    done = gpufleet(env, "join", "--site", "site-a", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr

    # A join that cannot finish yet: its machines cannot reach the control plane.
    assert gpufleet(env, "sim", "unreachable", "site-b").returncode == 0
    assert gpufleet(env, "join", "--site", "site-b", "--request", "across-restart", "--detach").returncode == 0
    time.sleep(2)
    stop_dev(dev)
    assert not any(Path(f"/proc/{pid}").exists() for pid in children), "every child stopped"
    assert (tmp_path / "state" / "temporal.db").exists()

    dev = start_dev(env, port, ui_port, tmp_path / "dev2.log")
    try:
        assert gpufleet(env, "sim", "unreachable", "site-b", "--restore").returncode == 0
        result = subprocess.run(
            [sys.executable, "-m", "cli", "join", "--site", "site-b", "--request", "across-restart", "--wait"],
            env=env, capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "ready" in result.stdout
        nodes = gpufleet(env, "nodes")
        assert nodes.stdout.count("site-a") >= 1 and nodes.stdout.count("site-b") >= 1
    finally:
        stop_dev(dev)


def test_dev_reports_a_server_that_cannot_start(tmp_path: Path) -> None:
    """A dev server that dies at start-up is reported at once, with its own last words."""
    state = tmp_path / "state"
    (state / "temporal.db").mkdir(parents=True)  # SQLite cannot open a folder
    env = {**os.environ, "GPUFLEET_STATE_DIR": str(state), "GPUFLEET_CONFIG": str(write_fleet(tmp_path)),
           "COLUMNS": "200"}
    port = free_dev_port()
    # At once: the server's exit is what it reports, not a start-up wait run out (240 s, and
    # "did not answer" said). The timeout only guards against a hang.
    done = gpufleet(env, "dev", "--port", str(port), "--ui-port", str(free_port()), "--http-port", str(free_port()),
                    timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the Temporal server exited" in done.stdout, done.stdout + done.stderr
    assert "last lines of" in done.stdout and "temporal.log" in done.stdout
    assert "is up" not in done.stdout and "did not answer" not in done.stdout
