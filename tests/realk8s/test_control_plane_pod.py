"""The control-plane worker as its Deployment starts it does its job on the real control plane.

The Pod is the one the real ReplicaSet controller made of ``deploy/kubernetes/control-plane.yaml``
(applied unchanged), run as a process by ``tests/realk8s/pod.py`` as the kubelet would run its
container: the manifest's command and env, the ``gpufleet-config`` ConfigMap and the
``gpufleet-temporal-client`` Secret at their mountPaths (created as an operator creates them),
a real bound service-account token where the Kubernetes client's in-cluster loader reads it,
its own network and mount namespaces, read-only root, uid 10001, no capabilities, its cgroups
holding the manifest's resources. Its Temporal frontend (``temporal-frontend.temporal.svc:7233``,
mutual TLS only) is a TLS-terminating proxy in front of the dev server, as for the gateway
(``test_node_agent.py``; the real server's own TLS is ``tests/realtemporal/test_tls.py``).

Its Python is the image's install (``tests/realk8s/image.py``): the venv ``pip install .`` makes,
with no test extras, and the WORKDIR its Containerfile lays out.

What it must do with only that: poll its queue and approve a live node's client-certificate
renewal as ``gpufleet-control-plane`` (the identity record read, the CSR's approval written:
each a verb of the shipped RBAC), and stop cleanly on SIGTERM.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import yaml
from kubernetes.utils import parse_quantity

from fleet.cluster import NODE_IDENTITY_KIND, NodeIdentity
from fleet.messages.csr import CsrApproverResult
from providers.cluster.kubernetes import KubernetesCluster
from tests.conftest import wait_for
from tests.realk8s import image
from tests.realk8s.cluster import RealCluster
from tests.realk8s.pod import created_pods, run_pod
from tests.realk8s.test_adapter_objects import CSRS, csrs, nodes  # noqa: F401 - fixtures
from tests.realk8s.test_blast_radius import kubeadm_bindings_restored  # noqa: F401 - a fixture
from tests.realk8s.test_csr_approver import as_node
from tests.realk8s.test_node_agent import create_gateway_objects
from tests.test_temporal_manifests import frontend_pki
from tests.test_temporal_tls import start_tls_proxy
from workers.gateway.pki import Pki

REPO = Path(__file__).resolve().parents[2]


def control_plane_deployment() -> dict:
    """The Deployment as shipped (what kubectl applied unchanged), for what the test expects of it."""
    docs = yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "control-plane.yaml").read_text())
    return next(d for d in docs if d and d["kind"] == "Deployment")


def assert_runs_what_the_image_installs(pid: int, image_name: str) -> None:
    """The pod's process runs the image's Python install (``pip install .``, no extras) from the
    WORKDIR its Containerfile lays out: gpufleet from there, its dependencies from the image's
    venv, and nothing of the dev venv (which has the ``[test]`` extras) nor of the repository, so
    a runtime import only the test extras satisfy would fail here as in production."""
    seen = image.imports_of(pid, ["workers", "providers.cluster", "temporalio", "pytest", "hypothesis", "tests"])
    workdir = image.workdir(image_name)
    assert {m: seen.found[m] for m in ("pytest", "hypothesis", "tests")} == {
        "pytest": None, "hypothesis": None, "tests": None}, seen
    assert Path(seen.found["workers"]).is_relative_to(workdir), seen
    assert Path(seen.found["providers.cluster"]).is_relative_to(workdir), seen
    assert Path(seen.found["temporalio"]).is_relative_to(image.VENV), seen
    # The process itself loaded its compiled dependencies (Temporal's core, pydantic's) from there.
    assert seen.mapped and all(path.is_relative_to(image.VENV) for path in seen.mapped), seen.mapped


async def test_the_control_plane_worker_started_from_its_deployment_approves_a_live_nodes_renewal(
        real_cluster: RealCluster, temporal_env, tmp_path, nodes, csrs) -> None:  # noqa: F811
    client = temporal_env.client
    shipped = control_plane_deployment()
    (shipped_container,) = shipped["spec"]["template"]["spec"]["containers"]
    manifest_env = {e["name"]: e["value"] for e in shipped_container["env"] if "value" in e}
    (pod,) = created_pods(real_cluster, "gpufleet", "gpufleet-control-plane", shipped["spec"]["replicas"])
    (container,) = pod["spec"]["containers"]
    assert container["resources"] == shipped_container["resources"]

    temporal_pki, temporal_secret = frontend_pki(tmp_path, manifest_env["TEMPORAL_TLS_SERVER_NAME"])
    frontend, frontend_port = await start_tls_proxy(temporal_pki, client.service_client.config.target_host)
    create_gateway_objects(real_cluster, tmp_path, Pki.create("gpufleet test gateway CA"), temporal_secret)
    frontend_host, _, port = manifest_env["TEMPORAL_ADDRESS"].rpartition(":")

    # A live gpufleet node: its Node, and the identity record its join wrote (in the control
    # plane's namespace, where the worker's adapter reads it).
    node = nodes(f"cp-pod-{uuid.uuid4().hex[:6]}")
    admin = KubernetesCluster(api_client=real_cluster.api_client(), namespace="gpufleet")
    identity = NodeIdentity(node_name=node, machine_id="m-cp-pod", provider="lambda", account="la", site="lam",
                            join_id=f"join/lam/{node}")
    admin.update_state(NODE_IDENTITY_KIND, node, lambda _old: identity.state())
    worker = await asyncio.to_thread(run_pod, real_cluster, pod, tmp_path / "control-plane-pod",
                                     {f"{frontend_host}:{port}": ("127.0.0.1", frontend_port)})
    code = None
    try:
        # Started: it says so once connected to Temporal, before it polls (it has no readinessProbe).
        await wait_for(lambda: "polling task queue" in worker.log_tail(20_000) or worker.process.poll() is not None,
                       timeout=60, interval=0.3)
        assert worker.process.poll() is None, worker.log_tail()
        assert_runs_what_the_image_installs(worker.process.pid, "control-plane")
        values = worker.cgroup_values()  # as the kubelet sets them (cgroup v1 or v2)
        assert values.get("memory.limit_in_bytes", values.get("memory.max")) == str(
            int(parse_quantity(shipped_container["resources"]["limits"]["memory"]))), values

        renewal = as_node(real_cluster, node, node)
        csrs.append(renewal)
        # The approver, on the queue the manifest names: only the pod's worker polls it.
        handle = await client.start_workflow("CsrApprover", {}, id=f"csr-approver-pod-{uuid.uuid4().hex[:6]}",
                                             task_queue=manifest_env["GPUFLEET_TASK_QUEUE"])

        def decided() -> list[dict] | None:
            _, csr = real_cluster.request("GET", f"{CSRS}/{renewal}", admin=True)
            return (csr.get("status") or {}).get("conditions") or None

        try:
            conditions = await wait_for(decided, timeout=90, interval=0.5)
        except AssertionError:
            raise AssertionError(f"the pod's worker decided nothing in 90 s:\n{worker.log_tail()}") from None
        assert [(c["type"], c["reason"]) for c in conditions] == [("Approved", "GpufleetApproved")], conditions
        await handle.cancel()  # a cancelled approver ends with what it decided
        result = CsrApproverResult.model_validate(await asyncio.wait_for(handle.result(), 30))
        assert [(v.name, v.approve, v.requester) for v in result.decided if v.name == renewal] == [
            (renewal, True, f"system:node:{node}")]
        assert worker.process.poll() is None, worker.log_tail()
        assert "Traceback" not in worker.log_tail(20_000), worker.log_tail()
    finally:
        code = await asyncio.to_thread(worker.stop)  # SIGTERM, as the kubelet stops it
        frontend.close()
        admin.delete_state(NODE_IDENTITY_KIND, node)
    assert code == 0, worker.log_tail()
