"""``gpufleet dev``'s lifecycle: a child that dies comes back (with backoff, saying so) instead of
the stack going down; Ctrl-C, at any point, stops every child without a traceback and leaves
nothing holding a port; every port it opens has a flag and derives from ``--port``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.dev import DEV_S3_KEY, DevPorts, port_in_use
from tests.ports import free_dev_port, free_port
from tests.test_dev_stack import child_logs, children_of, command_of, gpufleet, start_dev

pytestmark = pytest.mark.integration  # `gpufleet dev` as a process


def descendants_of(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children_of(parent)]
        found += frontier
    return found


def alive(pids: list[int]) -> list[str]:
    """Those of ``pids`` still running (a zombie has exited), with their command lines."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                running.append(f"{pid} {command_of(pid)}")
        except (OSError, IndexError):
            pass
    return running


def wait_for(predicate, timeout: float, what: str, log: Path, env: dict) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}\n{log.read_text()}\n{child_logs(env)}"
        time.sleep(0.2)


def builtin_fleet_env(tmp_path: Path, port: int) -> dict:
    """The built-in fleet (its object stores need the S3 emulator), its state under tmp_path."""
    env = {**os.environ, "GPUFLEET_STATE_DIR": str(tmp_path / "state"), "TEMPORAL_ADDRESS": f"127.0.0.1:{port}",
           "COLUMNS": "200"}
    for name in ("GPUFLEET_CONFIG", "GPUFLEET_TASK_QUEUE", "GPUFLEET_DEV_S3_KEY", "GPUFLEET_METRICS_PORT"):
        env.pop(name, None)
    return env


def test_every_port_derives_from_port_unless_its_flag_is_given() -> None:
    assert DevPorts.derive(7233) == DevPorts(port=7233, ui=8233, http=7243, s3=7244, gateway=7300, front_door=8080,
                                             metrics=9464, cluster=7234)
    moved = DevPorts.derive(20000, s3=21000, front_door=None)
    assert (moved.ui, moved.http, moved.s3, moved.gateway, moved.front_door, moved.metrics, moved.cluster) == (
        21000, 20010, 21000, 20067, 20847, 22231, 20001)
    assert moved.given == {"s3"}


def test_two_of_the_stacks_ports_on_one_number_are_refused_before_anything_starts(tmp_path: Path) -> None:
    port = free_dev_port()
    env = builtin_fleet_env(tmp_path, port)
    done = gpufleet(env, "dev", "--port", str(port), "--ui-port", str(free_port()), "--s3-port", str(port + 67),
                    timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"port {port + 67} is also --s3-port's" in done.stdout and "is up" not in done.stdout
    assert not (tmp_path / "state" / "temporal.db").exists()


@pytest.mark.parametrize("flags, message", [
    # --port 64000 is a port, but the metrics port derived from it (+ 2231) is not.
    (["--port", "64000", "--ui-port", "{ui}"],
     "--metrics-port: 66231 (--port 64000 + 2231) is not a TCP port (1-65535); give --metrics-port or a lower --port"),
    (["--port", "{port}", "--ui-port", "70000"], "--ui-port: 70000 is not a TCP port (1-65535)"),
    (["--port", "{port}", "--ui-port", "{ui}", "--metrics-port", "65534"],
     "--metrics-port: 65534 and the next two (up to 65536) are not all TCP ports (1-65535)"),
])
def test_a_port_past_65535_is_refused_naming_its_flag_before_anything_starts(
        tmp_path: Path, flags: list[str], message: str) -> None:
    """A port past 65535, given or derived from --port, was bound as it came: Python's OverflowError
    ("bind(): port must be 0-65535"), a traceback naming no flag. Now refused, naming the flag."""
    port = free_dev_port()
    env = builtin_fleet_env(tmp_path, port)
    done = gpufleet(env, "dev", *(f.format(port=port, ui=free_port()) for f in flags), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr and "is up" not in done.stdout
    assert not (tmp_path / "state" / "temporal.db").exists()


def test_a_port_range_past_65535_is_refused_naming_its_variable_before_anything_starts(tmp_path: Path) -> None:
    """GPUFLEET_PORT_RANGE is read once the real cluster's services are being started: a range past
    65535 ended the command there with a traceback (the settings' error its last line). Now
    refused first, the one line naming the variable, exit 2."""
    port = free_dev_port()
    env = {**builtin_fleet_env(tmp_path, port), "GPUFLEET_PORT_RANGE": "60000-70000"}
    done = gpufleet(env, "dev", "--temporal", "cluster", "--port", str(port), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "GPUFLEET_PORT_RANGE: LOW-HIGH" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr and "is up" not in done.stdout


@pytest.mark.timeout(600)
def test_a_killed_child_comes_back_and_ctrl_c_leaves_nothing_behind(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_dev_port()
    ports = {"--ui-port": free_port(), "--http-port": free_port(), "--s3-port": free_port(),
             "--gateway-port": free_port(), "--front-door-port": free_port()}
    env = builtin_fleet_env(tmp_path, port)
    log = tmp_path / "dev.log"
    extra = [arg for flag, number in ports.items() if flag != "--ui-port" for arg in (flag, str(number))]
    dev = start_dev(env, port, ports["--ui-port"], log, *extra)
    try:
        shown = log.read_text()
        # The flags' ports are the ones it opened.
        assert f"node gateway     127.0.0.1:{ports['--gateway-port']}" in shown
        assert f"object stores    http://127.0.0.1:{ports['--s3-port']}" in shown
        assert f"http://127.0.0.1:{ports['--http-port']}/api/v1" in shown
        assert "front door       off: haproxy" in shown or f"http://127.0.0.1:{ports['--front-door-port']}/" in shown
        # The built-in fleet's object stores moved to --s3-port: the stack's config says so.
        env["GPUFLEET_CONFIG"] = str(tmp_path / "state" / "sites.dev.yaml")
        assert f"127.0.0.1:{ports['--s3-port']}" in Path(env["GPUFLEET_CONFIG"]).read_text()

        def child(module: str) -> int | None:
            return next((pid for pid in children_of(dev.pid) if module in command_of(pid) and alive([pid])), None)

        # kill -9 of each of the fleet's processes in turn: each comes back, saying so. The node host
        # goes before the gateway, so the restarted host also has to find its way through a restarted
        # gateway; one join afterwards then needs all three.
        for module, label in (("workers.control_plane", "control-plane worker"), ("workers.node_agent", "node host"),
                              ("workers.node_gateway", "node gateway")):
            pid = child(module)
            assert pid is not None, module
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda label=label: f"{label} restarted" in log.read_text(), 60, f"the {label} did not come back",
                     log, env)
            assert f"{label} exited (code -9); restarting in 1 s" in log.read_text()
            assert dev.poll() is None, "the stack stayed up"
            again = child(module)
            assert again is not None and again != pid, module
        # The restarted worker, host and gateway run the fleet: a join completes.
        done = gpufleet(env, "join", "--site", "lambda-us-east", "--wait", timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr + child_logs(env)
        assert "ready" in done.stdout

        # The S3 emulator keeps its objects in memory: a restarted one gets the demo model again.
        emulator = child("moto.server")
        os.kill(emulator, signal.SIGKILL)
        wait_for(lambda: re.search(r"S3 emulator \(port \d+\) restarted", log.read_text()), 60,
                 "the S3 emulator did not come back", log, env)
        from fleet.config import load_config
        from providers.object_store import make_s3_client

        source = load_config(env["GPUFLEET_CONFIG"]).object_stores["demo-weights"]
        monkeypatch.setenv(*DEV_S3_KEY)  # the stores' credentials reference, as the stack sets it
        s3 = make_s3_client(source)

        def seeded() -> bool:
            try:
                s3.head_object(Bucket=source.bucket, Key=f"{source.prefix}demo-llm/v1/config.json")
                return True
            except Exception:  # noqa: BLE001 - not yet
                return False

        wait_for(seeded, 60, "the demo model was not seeded again", log, env)
        everything = descendants_of(dev.pid)  # the front door's HAProxy too
    finally:
        dev.send_signal(signal.SIGINT)  # what Ctrl-C in its terminal sends it
        code = dev.wait(timeout=90)
    assert code == 0, log.read_text()
    assert "Traceback" not in log.read_text()
    assert "stopped: " in log.read_text()
    deadline = time.monotonic() + 30
    while alive(everything) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(everything), alive(everything)
    # So the next start finds its ports free.
    assert not [flag for flag, number in {"--port": port, **ports}.items() if port_in_use(number)]


@pytest.mark.timeout(300)
def test_ctrl_c_while_starting_stops_what_started_without_a_traceback(tmp_path: Path) -> None:
    """Before: Ctrl-C during start-up went on to start every worker and say "up" first."""
    port = free_dev_port()
    env = builtin_fleet_env(tmp_path, port)
    log = tmp_path / "dev.log"
    dev = subprocess.Popen([sys.executable, "-m", "cli", "dev", "--port", str(port), "--ui-port", str(free_port()),
                            "--http-port", str(free_port()), "--s3-port", str(free_port())],
                           env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "starting the Temporal server" in log.read_text(), 120, "did not get to the server",
                 log, env)
        started = descendants_of(dev.pid)
        assert any("moto.server" in command for command in alive(started)), alive(started)
        dev.send_signal(signal.SIGINT)
        code = dev.wait(timeout=90)
    finally:
        if dev.poll() is None:
            dev.kill()
    assert code == 130, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text and "is up" not in text and "control-plane" not in text.split("stopped:")[-1]
    assert not alive(started), alive(started)


def test_ctrl_c_inside_a_childs_spawn_stops_that_child_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race behind a CI failure: the Ctrl-C came while Popen was still inside its constructor
    (the Temporal server forked, ``child.proc`` not yet set), so the stop that followed knew nothing
    of the server, and it kept running. Here the signal lands at that exact point, every time."""
    import cli.dev as dev

    spawned: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen_then_ctrl_c(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        spawned.append(proc)
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next bytecodes, still in here
        for _ in range(10_000):
            pass
        return proc

    stack = dev._Stack(dict(os.environ), tmp_path)
    previous = signal.signal(signal.SIGINT, stack.on_signal)
    monkeypatch.setattr(dev.subprocess, "Popen", popen_then_ctrl_c)
    try:
        with pytest.raises(dev.Interrupted):
            stack.start("temporal", [sys.executable, "-c", "import time; time.sleep(120)"])
        monkeypatch.undo()
        stack.stop_all()
    finally:
        signal.signal(signal.SIGINT, previous)
        for proc in spawned:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                pytest.fail(f"the child the interrupted spawn started (pid {proc.pid}) outlived the stack's stop")
    assert spawned and spawned[0].returncode is not None


def test_ctrl_c_while_waiting_for_the_server_is_not_taken_for_not_up_yet(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The race behind a CI failure: the Ctrl-C landed while start-up waited for the Temporal server
    to answer, inside the ``except Exception`` that retries "not up yet". The interrupt was swallowed
    there, every worker was started, and `gpufleet dev` exited 0. Here it lands there every time."""
    import cli.dev as dev
    from fleet.settings import Settings

    attempts: list[int] = []

    async def connect_then_ctrl_c(_settings):
        attempts.append(1)
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next bytecodes, still in here
        for _ in range(10_000):
            pass
        raise ConnectionRefusedError("not up yet")

    stack = dev._Stack(dict(os.environ), tmp_path)
    previous = signal.signal(signal.SIGINT, stack.on_signal)
    monkeypatch.setattr(dev, "connect", connect_then_ctrl_c)
    try:
        with pytest.raises(dev.Interrupted):
            dev._server_answers(Settings(address="127.0.0.1:9"), subprocess.Popen([sys.executable, "-c", "pass"]),
                                tmp_path / "none.log")
        # Nothing more starts once Ctrl-C has come, even where the interrupt was caught on the way.
        with pytest.raises(dev.Interrupted):
            stack.start("control-plane", [sys.executable, "-c", "import time; time.sleep(120)"])
    finally:
        signal.signal(signal.SIGINT, previous)
        stack.stop_all()
    assert len(attempts) == 1
    assert "control-plane" not in stack.children


@pytest.mark.timeout(300)
def test_a_killed_stack_takes_its_children_with_it(tmp_path: Path) -> None:
    """Before: `kill -9` of `gpufleet dev` (or a parent that kills it, as `bootstrap.py dev` did on
    Ctrl-C) orphaned every child, the S3 emulator holding its port, so the next start exited 2."""
    port, s3_port = free_dev_port(), free_port()
    env = builtin_fleet_env(tmp_path, port)
    log = tmp_path / "dev.log"
    dev = subprocess.Popen([sys.executable, "-m", "cli", "dev", "--port", str(port), "--ui-port", str(free_port()),
                            "--http-port", str(free_port()), "--s3-port", str(s3_port)],
                           env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "starting the Temporal server" in log.read_text(), 120, "did not get to the server",
                 log, env)
        started = descendants_of(dev.pid)
        assert started
    finally:
        dev.kill()
        dev.wait()
    deadline = time.monotonic() + 30
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(started), alive(started)
    assert not port_in_use(s3_port)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_whose_stack_died_before_it_could_ask_for_the_death_signal_exits() -> None:
    """The stack killed between a child's fork and its ``prctl`` (a loaded machine; the full suite
    saw a Temporal server live on, orphaned, holding its ports): the signal is then set for the
    child's new parent and never comes. The child finds its parent is not the stack and exits
    before it runs. Here the stack's pid is one that is not the child's parent."""
    from providers.child_process import die_with

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             preexec_fn=die_with(os.getpid() + 1_000_000))
    try:
        assert child.wait(timeout=20) == 1
    finally:
        child.kill()
    same = subprocess.Popen([sys.executable, "-c", "pass"], preexec_fn=die_with(os.getpid()))
    assert same.wait(timeout=20) == 0, "a child of the live stack runs"


@pytest.mark.timeout(300)
def test_ctrl_c_on_bootstrap_dev_stops_everything_without_a_traceback(tmp_path: Path) -> None:
    port = free_dev_port()
    env = {**builtin_fleet_env(tmp_path, port), "GPUFLEET_VENV": str(Path(sys.executable).parent.parent)}
    log = tmp_path / "dev.log"
    root = Path(__file__).resolve().parents[1]
    # A session of its own, as a terminal's foreground job: Ctrl-C is SIGINT to its whole process group.
    boot = subprocess.Popen([sys.executable, str(root / "bootstrap.py"), "dev", "--port", str(port),
                             "--ui-port", str(free_port()), "--http-port", str(free_port()),
                             "--s3-port", str(free_port()), "--front-door-port", str(free_port()),
                             "--gateway-port", str(free_port())],
                            env=env, stdout=open(log, "w"), stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: "gpufleet dev is up" in log.read_text(), 240, "not up", log, env)
        everything = descendants_of(boot.pid)
        os.killpg(boot.pid, signal.SIGINT)
        _, stderr = boot.communicate(timeout=90)
    finally:
        if boot.poll() is None:
            os.killpg(boot.pid, signal.SIGKILL)
    assert boot.returncode == 0, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "stopped: " in log.read_text()
    deadline = time.monotonic() + 30
    while alive(everything) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(everything), alive(everything)
