"""What `kubectl apply -k deploy/kubernetes` would create, and the images it names: the
Containerfiles copy only paths that exist and start modules that import; every
control-plane container runs as non-root on a read-only root filesystem; the node agent
is the one exception, with exactly one added capability; metrics are exposed."""

from __future__ import annotations

import importlib
import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.realk8s.image import instructions
from tests.tools import require

ROOT = Path(__file__).resolve().parents[1]
CONTAINERS = ROOT / "deploy" / "containers"
CONTAINERFILES = sorted(CONTAINERS.glob("Containerfile.*"))


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
    # Where the build left it (~/.cache/gpufleet/realk8s), else PATH; skipped without it, failed in CI.
    kubectl = require("kubectl")
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


# -- placement: the control plane never on a GPU node (issue 35) -----------------------------
CONTROL_PLANE_ROLE = "node-role.kubernetes.io/control-plane"


def registered_taints() -> list[str]:
    """The taints a gpufleet machine registers with, from the shipped bootstrap template."""
    from providers.cluster.bootstrap import JoinParams, read_join_configuration, registration_taints, render_user_data

    user_data = render_user_data(JoinParams(api_server="203.0.113.1:6443", ca_data="Y2E=", token="abcdef.0123456789abcdef",
                                            node_name="n1", provider_id="gpufleet://aws/a/n1",
                                            site="aws-use1"))
    return registration_taints(read_join_configuration(user_data))


def tolerations_of(pod: dict) -> list:
    from fleet.demand import Toleration

    return [Toleration(**t) for t in pod.get("tolerations") or []]


def test_gpu_nodes_keep_the_fleet_taint_after_admission() -> None:
    from fleet.cluster import FLEET_TAINT, UNPROVEN_TAINT
    from providers.cluster.base import apply_taints

    taints = registered_taints()
    assert UNPROVEN_TAINT in taints and FLEET_TAINT in taints
    # Admission (``admit_node``) lifts the unproven taint by key and effect, nothing else.
    assert apply_taints(taints, remove=[UNPROVEN_TAINT]) == [FLEET_TAINT]


def test_control_plane_and_gateway_run_only_on_control_plane_hosts() -> None:
    """Their service-account tokens and the Temporal and provider credentials must never sit on
    a GPU node: they select kubeadm's control-plane role (a kubelet cannot set it on itself),
    tolerate its taint, and tolerate no taint a GPU node carries, admitted or not."""
    found = workloads(rendered())
    gpu_node_taints = registered_taints()
    for name in ("gpufleet-control-plane", "gpufleet-node-gateway"):
        pod = found[name]["spec"]["template"]["spec"]
        assert pod.get("nodeSelector") == {CONTROL_PLANE_ROLE: ""}, name
        tolerations = tolerations_of(pod)
        assert any(t.tolerates(f"{CONTROL_PLANE_ROLE}:NoSchedule") for t in tolerations), name
        assert not [taint for taint in gpu_node_taints if any(t.tolerates(taint) for t in tolerations)], name
        assert "affinity" not in pod, f"{name}: nothing widens the selector"


def test_gpu_workloads_tolerate_every_taint_an_admitted_gpu_node_keeps() -> None:
    from fleet.cluster import UNPROVEN_TAINT, ServingSpec
    from providers.cluster.kubernetes import render_pod_template

    kept = [t for t in registered_taints() if t != UNPROVEN_TAINT]
    agent = workloads(rendered())["gpufleet-node-agent"]["spec"]["template"]["spec"]
    assert all(any(t.tolerates(taint) for t in tolerations_of(agent)) for taint in registered_taints()), \
        "the node agent runs on unproven nodes too (the smoke test)"
    serving = render_pod_template(ServingSpec(model="m", site="s", image="i"))["spec"]
    assert all(any(t.tolerates(taint) for t in tolerations_of(serving)) for taint in kept)
    assert not any(t.tolerates(UNPROVEN_TAINT) for t in tolerations_of(serving)), "nothing serves before the smoke test"


def test_the_control_plane_worker_polls_every_partition_of_its_queue() -> None:
    """The worker keeps polls on each partition the shipped dynamic config gives its queue: with
    more partitions than polls, those without one only forward their tasks (the SDK's defaults held
    one workflow poll on it for four partitions)."""
    from fleet.naming import CONTROL_PLANE_QUEUE
    from workers import control_plane as worker

    config = yaml.safe_load((ROOT / "deploy" / "temporal" / "dynamic-config.yaml").read_text())
    for key in ("matching.numTaskqueueReadPartitions", "matching.numTaskqueueWritePartitions"):
        (partitions,) = [entry["value"] for entry in config[key]
                         if entry.get("constraints") == {"taskQueueName": CONTROL_PLANE_QUEUE}]
        assert partitions == worker.QUEUE_PARTITIONS, key
    nonsticky = worker.WORKFLOW_TASK_POLLS * worker.NONSTICKY_POLL_RATIO
    assert nonsticky >= 2 * worker.QUEUE_PARTITIONS
    assert worker.ACTIVITY_TASK_POLLS >= 2 * worker.QUEUE_PARTITIONS


# -- own racks: the seed server beside the worker (deploy/own-racks) ---------------------------
def seed_server_cli_args(command: list[str], monkeypatch: pytest.MonkeyPatch) -> dict:
    """What ``python -m providers.own_dc_seed`` makes of ``command``'s arguments: its own CLI
    parses them, and the server it would start is asked for with them."""
    import typer
    from typer.testing import CliRunner

    from providers import own_dc_seed

    asked: dict = {}

    def server_for_account(config, account, url, listen):
        asked.update(config=config, account=account, url=url, listen=listen)
        raise SystemExit(0)

    assert command[:3] == ["python", "-m", "providers.own_dc_seed"]
    app = typer.Typer()
    app.command()(own_dc_seed.cli)
    monkeypatch.setattr(own_dc_seed, "server_for_account", server_for_account)
    done = CliRunner().invoke(app, command[3:])
    assert done.exit_code == 0 and asked, done.output
    return asked


def under(path: str, mounts: list[dict], volume: str) -> bool:
    return any(m["name"] == volume and Path(path).is_relative_to(m["mountPath"]) for m in mounts)


@pytest.mark.integration  # kubectl kustomize
def test_the_own_racks_overlay_is_the_base_with_a_seed_server_on_the_workers_seed_dir(monkeypatch) -> None:
    """deploy/own-racks changes only the control-plane pod, and its NetworkPolicy for the seed port
    (tests/cluster/test_manifests.py): a second container runs the seed server
    (deploy/bootstrap/README.md, own-rack.ipxe) from the worker's image, as locked down as the
    worker, on the one in-memory volume both mount at the seed_dir of the own-dc account it serves
    (deploy/sites.example.yaml's), reading the fleet config and the iPXE template from the
    worker's ConfigMap mount, where the account's ipxe_template names it; it listens on the port
    it publishes on its host. Its documented predecessor was a snippet no test applied, naming
    the image without its version tag (a `:latest` that is never built)."""
    from fleet.config import load_config

    base, overlay = rendered(), rendered("own-racks")
    def key(doc: dict) -> tuple[str, str, str]:
        return doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"]

    added_or_removed = {key(d) for d in overlay} ^ {key(d) for d in base}
    differing = {key(d) for d in overlay if d not in base}
    assert added_or_removed | differing == {("Deployment", "gpufleet", "gpufleet-control-plane"),
                                            ("NetworkPolicy", "gpufleet", "gpufleet-control-plane")}

    was = workloads(base)["gpufleet-control-plane"]["spec"]["template"]["spec"]
    pod = workloads(overlay)["gpufleet-control-plane"]["spec"]["template"]["spec"]
    worker, seeds = pod["containers"]
    (was_worker,) = was["containers"]
    assert seeds["name"] == "own-rack-seeds"
    assert {k: v for k, v in worker.items() if k != "volumeMounts"} == {
        k: v for k, v in was_worker.items() if k != "volumeMounts"}, "the worker is the base's"
    assert seeds["image"] == worker["image"] and seeds["securityContext"] == worker["securityContext"]
    assert {k: v for k, v in pod.items() if k not in ("containers", "volumes")} == {
        k: v for k, v in was.items() if k not in ("containers", "volumes")}, "the pod runs where and as the base's"
    (volume,) = [v for v in pod["volumes"] if v not in was["volumes"]]
    assert volume["emptyDir"]["medium"] == "Memory", "a join token touches no disk"

    asked = seed_server_cli_args(seeds["command"], monkeypatch)
    config_path = {e["name"]: e.get("value") for e in worker["env"]}["GPUFLEET_CONFIG"]
    assert asked["config"] == config_path and under(config_path, seeds["volumeMounts"], "config")
    (account,) = [a for a in load_config(str(ROOT / "deploy" / "sites.example.yaml")).accounts
                  if a.name == asked["account"]]
    assert account.provider == "own-dc"
    for container in (worker, seeds):
        assert [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume["name"]] == [
            account.options["seed_dir"]], container["name"]
    template = account.options["ipxe_template"]
    assert under(template, seeds["volumeMounts"], "config")
    assert Path(template).name == "own-rack.ipxe" and (ROOT / "deploy" / "bootstrap" / "own-rack.ipxe").exists()
    ((port,),) = [[p for p in seeds["ports"] if p["containerPort"] == asked["listen"][1]]]
    assert port.get("hostPort") == port["containerPort"], "the machines' own addresses reach it unchanged"


def pods_at_once_in_a_rollout(deployment: dict) -> int:
    """The most pods of ``deployment`` the Deployment controller keeps at once while it replaces
    them: its replicas, plus its surge under RollingUpdate (the API server's default strategy,
    maxSurge 25% rounded up, so one for one replica); Recreate deletes the old pods first."""
    import math

    replicas = deployment["spec"].get("replicas", 1)
    strategy = deployment["spec"].get("strategy") or {}
    if strategy.get("type", "RollingUpdate") == "Recreate":
        return replicas
    surge = (strategy.get("rollingUpdate") or {}).get("maxSurge", "25%")
    if isinstance(surge, str):
        surge = math.ceil(replicas * int(surge.rstrip("%")) / 100)
    return replicas + surge


@pytest.mark.integration  # kubectl kustomize
def test_the_own_racks_control_plane_rolls_out_on_a_single_control_plane_host() -> None:
    """The seed server publishes its host's port: a host holds one pod of the control plane at a
    time. Under the default RollingUpdate the new pod was made first, beside the old one, and
    with one control-plane host it stayed Pending on the port: every rollout of the overlay stuck.
    maxSurge 0 stops the old pod first (the base, publishing no host port, keeps the default)."""
    for folder in ("kubernetes", "own-racks"):
        deployment = workloads(rendered(folder))["gpufleet-control-plane"]
        pod = deployment["spec"]["template"]["spec"]
        host_ports = [p for c in pod["containers"] for p in c.get("ports") or [] if p.get("hostPort")]
        if folder == "kubernetes":
            assert not host_ports and "strategy" not in deployment["spec"]
            continue
        assert host_ports, "the seed server's port is its host's"
        assert pods_at_once_in_a_rollout(deployment) == 1, deployment["spec"].get("strategy")


@pytest.mark.integration  # kubectl kustomize
@pytest.mark.parametrize("folder", ["kubernetes", "own-racks"])
def test_no_pod_shipped_or_rendered_gets_service_links(folder: str) -> None:
    """The kubelet gives a pod's containers variables for every Service of its namespace
    (``<NAME>_PORT=tcp://...``) unless it says ``enableServiceLinks: false``; the adapter writes
    each model's Services into ``gpufleet``, where gpufleet's own pods and the model servers run,
    so a model's name would set a worker's or a server's setting (tests/realk8s/test_service_links.py
    runs the pods' environment on the real API server)."""
    from fleet.cluster import ServingSpec
    from providers.cluster.kubernetes import render_deployment

    rendered_workloads = workloads(rendered(folder))
    assert set(rendered_workloads) == {"gpufleet-control-plane", "gpufleet-node-agent", "gpufleet-node-gateway"}
    serving = render_deployment(ServingSpec(model="m", site="s", image="img:1"), "gpufleet")
    for name, workload in {**rendered_workloads, "a model server": serving}.items():
        assert workload["spec"]["template"]["spec"].get("enableServiceLinks") is False, name


# -- the driver reinstall of the repair ladder on the node (deploy/driver-reinstall) ------------
def kustomization_with(tmp_path: Path, resources: list[str], components: list[str]) -> Path:
    """A kustomization of an operator's own: these folders of deploy/ as its resources and
    components, named by relative paths (kustomize takes no absolute one)."""
    import os

    folder = tmp_path / "mine"
    folder.mkdir(parents=True)

    def named(name: str) -> str:
        return os.path.relpath(ROOT / "deploy" / name, folder)
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [named(n) for n in resources], "components": [named(n) for n in components]}))
    return folder


def rendered_at(folder: Path) -> list[dict]:
    done = subprocess.run([require("kubectl"), "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def manifest_values(container: dict) -> dict[str, str]:
    """The container's env entries that are values (the ones a test can read without a cluster)."""
    return {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}


@pytest.mark.integration  # kubectl kustomize
@pytest.mark.parametrize("base_folder", ["kubernetes", "own-racks"])
def test_the_driver_reinstall_component_lets_the_agent_run_the_node_images_script(tmp_path, base_folder) -> None:
    """``reinstall_via: agent`` needs GPUFLEET_DRIVER_REINSTALL_CMD on the node agent, which the
    shipped DaemonSet never set: the rung failed at every node ("no driver reinstall command
    configured"). The component deploy/driver-reinstall, beside the base or the own-racks overlay,
    changes only the node agent: its command runs the node image's DRIVER_REINSTALL_SCRIPT in the
    host's namespaces (PID 1's, the host's init with hostPID), privileged; the base's agent keeps
    CAP_SYS_ADMIN alone and no command. What the agent runs is the manifest's value alone: no
    input of the activity names one (tests/test_driver_reinstall.py runs it)."""
    import shlex

    from fleet.messages.nodes import ReinstallDriverInput
    from fleet.repair_policy import DRIVER_REINSTALL_SCRIPT
    from fleet.settings import NodeAgentEnv

    base = rendered(base_folder)
    mine = rendered_at(kustomization_with(tmp_path, [base_folder], ["driver-reinstall"]))
    changed = [d for d in mine if d not in base]
    assert [(d["kind"], d["metadata"]["name"]) for d in changed] == [("DaemonSet", "gpufleet-node-agent")]
    assert len(mine) == len(base)

    (was,) = workloads(base)["gpufleet-node-agent"]["spec"]["template"]["spec"]["containers"]
    assert NodeAgentEnv.from_env(manifest_values(was)).driver_reinstall_cmd is None
    pod = workloads(mine)["gpufleet-node-agent"]["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    command = NodeAgentEnv.from_env(manifest_values(agent)).driver_reinstall_cmd
    assert shlex.split(command) == ["nsenter", "--target", "1", "--mount", "--uts", "--ipc", "--net", "--pid",
                                    "--", DRIVER_REINSTALL_SCRIPT]
    assert pod["hostPID"] is True and agent["securityContext"]["privileged"] is True
    assert {k: v for k, v in agent.items() if k not in ("env", "securityContext")} == {
        k: v for k, v in was.items() if k not in ("env", "securityContext")}
    assert ReinstallDriverInput.model_fields == {}, "the control plane names no command"
