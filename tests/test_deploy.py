"""What `kubectl apply -k deploy/kubernetes` would create, and the images it names: the
Containerfiles copy only paths that exist and start modules that import; every
control-plane container runs as non-root on a read-only root filesystem; the node agent
is the one exception, with exactly one added capability; metrics are exposed."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONTAINERS = ROOT / "deploy" / "containers"
CONTAINERFILES = sorted(CONTAINERS.glob("Containerfile.*"))


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_there_is_an_image_for_each_worker() -> None:
    assert {p.name for p in CONTAINERFILES} == {"Containerfile.control-plane", "Containerfile.node-agent"}


@pytest.mark.parametrize("containerfile", CONTAINERFILES, ids=lambda p: p.name)
def test_containerfile_copies_what_exists_and_starts_a_module_that_imports(containerfile: Path) -> None:
    steps = instructions(containerfile)
    copies = [shlex.split(arg) for op, arg in steps if op == "COPY"]
    assert copies
    for *sources, _dest in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"{containerfile.name}: COPY {source}: no such path in the repo"
    copied = {Path(s).parts[0] for *sources, _ in copies for s in sources}
    (cmd,) = [json.loads(arg) for op, arg in steps if op in ("CMD", "ENTRYPOINT")]
    assert cmd[:2] == ["python", "-m"]
    module = cmd[2]
    assert module.split(".")[0] in copied, f"{module} is not copied into the image"
    importlib.import_module(module)
    # Every package pyproject.toml installs is in the image.
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", "README.md"} <= copied


def rendered(folder: str = "kubernetes") -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    done = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy" / folder)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def workloads(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")}


def test_kustomize_renders_and_control_plane_runs_non_root_read_only() -> None:
    docs = rendered()
    found = workloads(docs)
    assert set(found) == {"gpufleet-control-plane", "gpufleet-node-agent", "gpufleet-node-gateway"}
    for name, workload in found.items():
        if name == "gpufleet-node-agent":
            continue
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        for container in pod["containers"] + pod.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, container["name"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
            assert not sc.get("privileged")
            assert sc.get("runAsUser", pod["securityContext"]["runAsUser"]) != 0
        assert "gpufleet-control-plane" in pod["containers"][0]["image"]


def test_node_agent_is_the_one_exception_with_the_least_it_needs() -> None:
    agent = workloads(rendered())["gpufleet-node-agent"]
    pod = agent["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert not any(pod.get(k) for k in ("hostPID", "hostNetwork", "hostIPC"))
    assert "gpufleet-node-agent" in container["image"]


def test_metrics_are_served_and_scraped() -> None:
    assert not [d for d in rendered() if d["kind"] == "ServiceMonitor"], \
        "the base applies to a cluster without the Prometheus Operator's CRDs"
    docs = rendered("prometheus-operator")
    found = workloads(docs)
    services = [d for d in docs if d["kind"] == "Service"]
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitors and all(e["port"] == "metrics" for m in monitors for e in m["spec"]["endpoints"])
    for workload in found.values():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["GPUFLEET_METRICS_PORT"] == str(port)
        # A workload may have other Services too (the node gateway's public endpoint).
        service = next(s for s in services if s["spec"]["selector"].items() <= labels.items()
                       and any(p["name"] == "metrics" and p["targetPort"] == "metrics" for p in s["spec"]["ports"]))
        selector = monitors[0]["spec"]["selector"]["matchLabels"]
        assert selector.items() <= service["metadata"]["labels"].items()
