"""The README's examples, in order, as an operator runs them on a fresh ``gpufleet dev``.

The commands are read from the README itself (the fenced ``bash`` blocks of the dev-stack
"Try" list, the ``temporal`` CLI, the game day and the rollout), so the document and this
test cannot drift. Only addresses and ports are substituted (a free port per server, the
S3 emulator's port in a copy of the built-in fleet); a placeholder such as ``<node>`` gets
a real value from the output before it. A comment "exits N" is the exit code the README
promises; every other command must exit 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
# The tour moved from the README to the docs site; the name stays for the tests that read it.
README = ROOT / "docs" / "getting-started.md"
VENV_BIN = Path(sys.executable).parent


def bash_blocks(section: str) -> list[list[str]]:
    """The ``bash`` blocks under a README heading (up to the next heading of any level)."""
    text = README.read_text()
    start = text.index(section)
    end = re.search(r"\n#{2,4} ", text[start + len(section):])
    body = text[start:start + len(section) + (end.start() if end else len(text))]
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", body, re.S):
        commands = []
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.strip().startswith("#"):
                commands.append(line.strip())
        blocks.append(commands)
    return blocks


def walked() -> list[str]:
    commands = []
    commands += bash_blocks("Try, in a second shell")[0]
    commands += bash_blocks("### From the `temporal` CLI")[0]
    commands += bash_blocks("### Provider incidents")[0]
    commands += bash_blocks("### Model rollouts")[0]
    return commands


def expected_code(command: str) -> int:
    found = re.search(r"#.*\bexits (\d+)", command)
    return int(found.group(1)) if found else 0


@pytest.fixture(scope="module")
def dev_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("walk")
    port, ui_port, http_port, s3_port = free_port(), free_port(), free_port(), free_port()
    config = tmp / "sites.yaml"
    builtin = (ROOT / "fleet" / "default_sites.yaml").read_text()
    assert "127.0.0.1:7244" in builtin
    config.write_text(builtin.replace("127.0.0.1:7244", f"127.0.0.1:{s3_port}"))
    env = {**os.environ, "GPUFLEET_STATE_DIR": str(tmp / "state"), "GPUFLEET_CONFIG": str(config),
           "TEMPORAL_ADDRESS": f"127.0.0.1:{port}", "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    for name in ("GPUFLEET_TASK_QUEUE", "GPUFLEET_DEV_S3_KEY"):
        env.pop(name, None)
    log = tmp / "dev.log"
    proc = subprocess.Popen([sys.executable, "-m", "cli", "dev", "--port", str(port), "--ui-port", str(ui_port),
                             "--http-port", str(http_port)], env=env, cwd=ROOT, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while "gpufleet dev is up" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    yield {"env": env, "port": port, "tmp": tmp, "log": log}
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)


def sh(env: dict, command: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(420)
def test_readme_examples_run_as_written(dev_stack) -> None:
    env, last_nodes = dev_stack["env"], ""
    commands = walked()
    assert any(c.startswith("gpufleet gameday provider-loss") for c in commands)
    assert any(c.startswith("gpufleet rollout start") for c in commands)
    for command in commands:
        if "<node>" in command:
            names = [line.split("\t")[0] for line in last_nodes.splitlines()[1:]
                     if "\tlambda-us-east\t" in line]
            assert names, f"no node to put into {command!r}:\n{last_nodes}"
            command = command.replace("<node>", names[0])
        assert "<" not in command.split("#")[0], f"placeholder without a value: {command}"
        started = time.monotonic()
        done = sh(env, command)
        took = time.monotonic() - started
        assert done.returncode == expected_code(command), (
            f"{command}\nexit {done.returncode} after {took:.1f}s\n{done.stdout}\n{done.stderr}")
        if command.startswith("gpufleet nodes"):
            last_nodes = done.stdout
        if command.startswith("gpufleet gameday"):
            # The timeline arrived line by line although stdout was a pipe, and the site tripped.
            assert "lambda-us-east: detected" in done.stdout and "lambda-us-east: restored" in done.stdout, done.stdout
        if command.startswith("gpufleet rollout start"):
            assert "rollout/demo-llm/v1: completed" in done.stdout, done.stdout
        assert "errors.pydantic.dev" not in done.stdout + done.stderr
    # What the text says the commands did.
    nodes = json.loads(sh(env, "gpufleet nodes --output json").stdout)
    assert sum(n["site"] == "lambda-us-east" for n in nodes) >= 3
    status = sh(env, "gpufleet rollout status rollout/demo-llm/v1 --output json")
    assert json.loads(status.stdout)["phase"] == "completed"
    summaries = sh(env, "temporal workflow describe --workflow-id join/lambda-us-east/manual-1 --output json")
    assert "join a node at lambda-us-east" in summaries.stdout


def test_dev_refuses_a_busy_port_before_starting_anything(dev_stack) -> None:
    env = dev_stack["env"]
    done = subprocess.run([sys.executable, "-m", "cli", "dev", "--port", str(dev_stack["port"]),
                           "--ui-port", str(free_port()), "--http-port", str(free_port()),
                           "--state-dir", str(dev_stack["tmp"] / "second")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--port: port {dev_stack['port']} is already in use" in done.stdout + done.stderr
    assert "is up" not in done.stdout
    assert not (dev_stack["tmp"] / "second" / "temporal.db").exists()


def test_join_validates_before_starting(dev_stack) -> None:
    env = dev_stack["env"]
    unknown = sh(env, "gpufleet join --site nowhere")
    assert unknown.returncode == 2 and "--site: unknown site 'nowhere'" in unknown.stderr
    too_many = sh(env, "gpufleet join --site lambda-us-east --count 100")
    assert too_many.returncode == 2 and "--count:" in too_many.stderr and "max_nodes 8" in too_many.stderr
    assert "started" not in unknown.stdout + too_many.stdout


def test_temporal_cli_fan_out_is_findable_and_refuses_more_than_max_nodes(dev_stack) -> None:
    env = dev_stack["env"]
    start = ("temporal workflow start --type NodeJoin --task-queue gpufleet --workflow-id join/aws-us-east-1/many "
             "--input '{\"site\": \"aws-us-east-1\", \"count\": 5}'")
    assert sh(env, start).returncode == 0
    result = sh(env, "temporal workflow result --workflow-id join/aws-us-east-1/many --output json")
    assert "max_nodes" in result.stdout + result.stderr
    query = ("temporal workflow list --query 'WorkflowId=\"join/aws-us-east-1/many\" AND Site=\"aws-us-east-1\" "
             "AND FleetState=\"failed\"'")
    deadline = time.monotonic() + 15  # visibility is eventually consistent
    while "join/aws-us-east-1/many" not in (found := sh(env, query)).stdout:
        assert time.monotonic() < deadline, found.stdout + found.stderr
        time.sleep(0.5)
    progress = sh(env, "temporal workflow query --workflow-id join/aws-us-east-1/many --type progress")
    assert '"failed"' in progress.stdout, progress.stdout


def test_gameday_interrupted_leaves_the_site_reachable(dev_stack) -> None:
    env = dev_stack["env"]
    proc = subprocess.Popen(["gpufleet", "gameday", "provider-loss", "--site", "aws-us-east-1-spot", "--timeout", "120"],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = proc.stdout.readline()
    assert "aws-us-east-1-spot: lost" in first, first
    sites = {s["site"]: s for s in json.loads(sh(env, "gpufleet sites --output json").stdout)}
    assert sites["aws-us-east-1-spot"]["reachable"] == "no"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode != 0
    sites = {s["site"]: s for s in json.loads(sh(env, "gpufleet sites --output json").stdout)}
    assert sites["aws-us-east-1-spot"]["reachable"] == "yes", out
