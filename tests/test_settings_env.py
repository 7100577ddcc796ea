"""fleet/settings.py is the one place that declares each ``GPUFLEET_*`` environment variable
(its name, type, default and why), and code reads the typed value from there: a name the code
or deploy/ mentions that is not declared there fails here, and so does a module that reads a
``GPUFLEET_*`` variable with ``os.environ`` / ``os.getenv`` itself. A bad value is an error
naming the variable."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleet import settings
from fleet.settings import (ELSEWHERE, MODELS, CliEnv, ControlPlaneEnv, NodeAgentEnv, NodeGatewayEnv, Settings,
                            SettingsError, WorkerEnv, declared)

ROOT = Path(__file__).resolve().parent.parent
#: The code: every package, the benches and bootstrap.py (tests/ sets its own GPUFLEET_TEST_* and
#: the like, for the suite alone).
CODE = ["cli", "client", "workers", "workflows", "activities", "sim", "providers", "fleet", "bench", "bootstrap.py"]
NAME = re.compile(r"\bGPUFLEET_[A-Z0-9][A-Z0-9_]*")

#: Modules that still read a GPUFLEET_* variable themselves, and why.
READS_ITS_OWN = {
    # stdlib only: it makes the virtual environment the settings module's pydantic lives in.
    "bootstrap.py": "GPUFLEET_VENV",
}


def sources() -> list[Path]:
    found = []
    for entry in CODE:
        path = ROOT / entry
        found += [path] if path.is_file() else [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
    return found


def mentioned() -> dict[str, set[str]]:
    """Every GPUFLEET_* name in the code and under deploy/ → the files that mention it."""
    names: dict[str, set[str]] = {}
    files = sources() + [p for p in (ROOT / "deploy").rglob("*") if p.is_file()]
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for name in NAME.findall(text):
            names.setdefault(name.rstrip("_"), set()).add(str(path.relative_to(ROOT)))
    return names


def test_every_variable_the_code_or_deploy_mentions_is_declared_in_the_settings_module() -> None:
    names = mentioned()
    assert {"GPUFLEET_CONFIG", "GPUFLEET_METRICS_PORT", "GPUFLEET_GATEWAY"} <= set(names), "the scan finds"
    missing = {name: sorted(files) for name, files in names.items() if name not in declared()}
    assert not missing, ("GPUFLEET_* variables not declared in fleet/settings.py (add each to the settings of the "
                         f"process that reads it, with its type, default and why): {missing}")


def test_each_variable_is_declared_once_with_a_reason() -> None:
    seen: dict[str, str] = {}
    for model in MODELS:
        for name, field in model.variables().items():
            assert name not in seen, f"{name}: declared by {seen[name]} and {model.__name__}"
            seen[name] = model.__name__
            assert name.startswith("GPUFLEET_") and NAME.fullmatch(name), name
            assert model.model_fields[field].description, f"{name}: no why"
    assert not set(seen) & set(ELSEWHERE), "declared twice"
    assert all(why for why in ELSEWHERE.values())


def env_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``os.environ.get(X)``, ``os.environ[X]``, ``os.getenv(X)`` and ``os.environ.setdefault``/
    ``pop`` of a GPUFLEET_* name: a literal or a module constant holding one."""
    constants = {t.id: node.value.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}

    def name_of(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return None

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ" or \
            isinstance(node, ast.Name) and node.id == "environ"

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) and (
                node.func.attr in ("get", "pop") and is_environ(node.func.value) or node.func.attr == "getenv"):
            key = node.args[0]
        name = name_of(key) if key is not None else None
        if name and name.startswith("GPUFLEET_"):
            found.append((node.lineno, name))
    return found


def test_code_reads_gpufleet_variables_through_the_settings_module() -> None:
    bypass = []
    for path in sources():
        relative = str(path.relative_to(ROOT))
        if relative == "fleet/settings.py":
            continue
        for line, name in env_reads(ast.parse(path.read_text())):
            if READS_ITS_OWN.get(relative) != name:
                bypass.append(f"{relative}:{line}: {name}")
    assert not bypass, ("read the typed value from fleet/settings.py (e.g. NodeAgentEnv.get(\"health_seconds\")) "
                        f"instead of os.environ: {bypass}")


def test_the_scan_sees_a_read() -> None:
    tree = ast.parse('import os\nX = "GPUFLEET_X"\nos.environ.get("GPUFLEET_Y", "")\nos.environ[X]\nos.getenv("A")\n')
    assert sorted(env_reads(tree)) == [(3, "GPUFLEET_Y"), (4, "GPUFLEET_X")]


def test_unset_or_blank_is_the_default_and_a_value_is_typed() -> None:
    assert NodeAgentEnv.get("health_seconds", {}) == 5.0
    assert NodeAgentEnv.get("health_seconds", {"GPUFLEET_HEALTH_SECONDS": "  "}) == 5.0
    assert NodeAgentEnv.get("health_seconds", {"GPUFLEET_HEALTH_SECONDS": "0.2"}) == 0.2
    assert WorkerEnv.get("metrics_port", {"GPUFLEET_METRICS_PORT": " 9464 "}) == 9464
    assert WorkerEnv.get("metrics_port", {}) is None
    assert ControlPlaneEnv.get("max_cached_workflows", {}) == 4000
    assert Settings.get("config", {"GPUFLEET_CONFIG": "sites.yaml"}) == "sites.yaml"
    # Reading one variable reads only it: another's bad value is not this one's error.
    assert WorkerEnv.get("metrics_host", {"GPUFLEET_METRICS_PORT": "x"}) == "0.0.0.0"
    env = Settings(task_queue="q", state_dir=Path("/s"), config="c.yaml").env()
    assert {k: v for k, v in env.items() if k.startswith("GPUFLEET_")} == {
        "GPUFLEET_TASK_QUEUE": "q", "GPUFLEET_STATE_DIR": "/s", "GPUFLEET_CONFIG": "c.yaml"}
    assert settings.CONFIG_ENV == "GPUFLEET_CONFIG"


@pytest.mark.parametrize(("model", "field", "raw", "message"), [
    (ControlPlaneEnv, "max_cached_workflows", "lots", "GPUFLEET_MAX_CACHED_WORKFLOWS: a whole number of workflows"),
    (WorkerEnv, "metrics_port", "http", "GPUFLEET_METRICS_PORT: not a port number: 'http'"),
    (WorkerEnv, "metrics_port", "99999", "GPUFLEET_METRICS_PORT: not a port number: '99999'"),
    (NodeAgentEnv, "health_seconds", "soon", "GPUFLEET_HEALTH_SECONDS: "),
    (ControlPlaneEnv, "orphan_grace_seconds", "ten", "GPUFLEET_ORPHAN_GRACE_SECONDS: "),
    # Numbers their use has no meaning for (nan, inf, below 0, 0 where it is no size): before, the
    # health watch took each of nan, inf and -1 for 0 (probing only when woken), the orphan gauge
    # read 0 with nan or inf and every machine at once with -1, the SDK was handed a cache size
    # below 0, a gateway with inf calls a second refused no call, and a port range past 65535 or
    # empty died in a bind or in random with a traceback naming nothing.
    *[(NodeAgentEnv, "health_seconds", raw, "GPUFLEET_HEALTH_SECONDS: a number of seconds, 0 or more")
      for raw in ("nan", "inf", "-inf", "-1", "-0.5")],
    *[(ControlPlaneEnv, "orphan_grace_seconds", raw, "GPUFLEET_ORPHAN_GRACE_SECONDS: a number of seconds, 0 or more")
      for raw in ("nan", "inf", "-inf", "-1")],
    *[(ControlPlaneEnv, "max_cached_workflows", raw, "GPUFLEET_MAX_CACHED_WORKFLOWS: a whole number of workflows, "
       "0 or more") for raw in ("-1", "-4000", "nan", "inf")],
    *[(NodeGatewayEnv, field, raw, f"{NodeGatewayEnv.variable(field)}: a finite number of calls above 0")
      for field in ("calls_per_second", "upstream_calls_per_second") for raw in ("nan", "inf", "-inf", "0", "-1")],
    *[(NodeGatewayEnv, field, raw, f"{NodeGatewayEnv.variable(field)}: a whole number")
      for field in ("call_burst", "replicas") for raw in ("0", "-1", "nan", "inf")],
    (WorkerEnv, "metrics_port", "0", "GPUFLEET_METRICS_PORT: not a port number: '0'"),
    (WorkerEnv, "metrics_port", "-1", "GPUFLEET_METRICS_PORT: not a port number: '-1'"),
    *[(CliEnv, "port_range", raw, "GPUFLEET_PORT_RANGE: LOW-HIGH") for raw in
      ("60000-70000", "30000-30000", "32600-20000", "0000-1000", "20000", "a-b")],
])
def test_a_bad_value_is_an_error_naming_the_variable(model, field, raw, message) -> None:
    name = model.variable(field)
    with pytest.raises(SettingsError) as caught:
        model.get(field, {name: raw})
    assert str(caught.value).startswith(message) and repr(raw) in str(caught.value), str(caught.value)
    with pytest.raises(SettingsError, match=name):
        model.from_env({name: raw})


@pytest.mark.parametrize(("model", "field", "raw", "value"), [
    # What the repo sets (deploy/, the chart, the tests, the benches) and each bound itself.
    (NodeAgentEnv, "health_seconds", "0", 0.0),  # only when woken (bench/join_overhead.py, bench/scale.py)
    (NodeAgentEnv, "health_seconds", "3600", 3600.0),
    (NodeAgentEnv, "health_seconds", "1", 1.0),
    (ControlPlaneEnv, "orphan_grace_seconds", "0", 0.0),  # tests/test_observability.py
    (ControlPlaneEnv, "orphan_grace_seconds", "600", 600.0),
    (ControlPlaneEnv, "max_cached_workflows", "6000", 6000),  # tests/test_worker_cache.py
    (ControlPlaneEnv, "max_cached_workflows", "0", 0),  # the SDK's "no cache"
    (NodeGatewayEnv, "replicas", "2", 2),  # deploy/kubernetes/node-gateway.yaml
    (NodeGatewayEnv, "upstream_calls_per_second", "1500", 1500.0),  # tests/test_helm.py
    (NodeGatewayEnv, "calls_per_second", "0.5", 0.5),
    (NodeGatewayEnv, "call_burst", "1", 1),
    (WorkerEnv, "metrics_port", "1", 1),
    (WorkerEnv, "metrics_port", "65535", 65535),
    (CliEnv, "port_range", "20000-32600", "20000-32600"),  # tests/conftest.py's slices of it too
    (CliEnv, "port_range", "1024-65536", "1024-65536"),  # HIGH is not taken
])
def test_a_value_in_bounds_is_taken_as_it_is(model, field, raw, value) -> None:
    assert model.get(field, {model.variable(field): raw}) == value


@pytest.mark.integration  # the worker as a process
@pytest.mark.parametrize(("args", "name", "raw"), [
    (["workers.control_plane"], "GPUFLEET_ORPHAN_GRACE_SECONDS", "nan"),
    (["workers.control_plane"], "GPUFLEET_MAX_CACHED_WORKFLOWS", "-1"),
    (["workers.node_agent", "--sim"], "GPUFLEET_HEALTH_SECONDS", "-1"),
    (["workers.node_gateway", "--dev"], "GPUFLEET_GATEWAY_CALLS_PER_SECOND", "inf"),
])
def test_a_worker_given_a_number_out_of_bounds_stops_at_once_naming_it(args, name, raw, tmp_path) -> None:
    """Before, the control plane took an orphan grace of nan (its orphan gauge then read 0) and
    handed the SDK -1 workflows to cache, the node agent probed with a health interval of -1 as
    with 0, and the gateway refused no call at inf calls a second. Now each stops before it
    starts anything, its one line naming the variable (not a traceback)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")},
           "GPUFLEET_STATE_DIR": str(tmp_path), name: raw}
    done = subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Traceback" not in output, output
    assert f"{name}: " in output and repr(raw) in output, output


@pytest.mark.integration  # the worker as a process
@pytest.mark.parametrize("worker", ["workers.control_plane", "workers.node_agent"])
@pytest.mark.parametrize("how", ["variable", "flag"])
def test_a_worker_given_a_metrics_port_past_65535_stops_naming_it(worker: str, how: str) -> None:
    """``GPUFLEET_METRICS_PORT=99999`` (or ``--metrics-port 99999``) went as it came to the metrics
    server's bind: the worker died with Python's OverflowError ("bind(): port must be 0-65535"), a
    traceback naming neither the variable nor the flag. Now it stops at once saying which."""
    env = {k: v for k, v in os.environ.items() if k != "GPUFLEET_METRICS_PORT"}
    args = [sys.executable, "-m", worker, *(["--sim"] if worker == "workers.node_agent" else [])]
    if how == "variable":
        env["GPUFLEET_METRICS_PORT"] = "99999"
    else:
        args += ["--metrics-port", "99999"]
    done = subprocess.run(args, env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Traceback" not in output and "OverflowError" not in output, output
    assert ("GPUFLEET_METRICS_PORT: not a port number: '99999'" if how == "variable"
            else "Invalid value for '--metrics-port'") in output, output
