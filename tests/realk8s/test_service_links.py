"""No Service in ``gpufleet`` reaches the environment of gpufleet's pods or of a model server's.

Beside a container's ``env`` the kubelet gives it variables for every Service of its pod's
namespace (``<NAME>_PORT=tcp://<ip>:<port>``, ``<NAME>_SERVICE_HOST`` and the like:
``tests/realk8s/pod.py`` ``service_link_env``) unless the pod says ``enableServiceLinks: false``.
The adapter writes each model's Services into ``gpufleet``, named after the model, beside
gpufleet's own pods: a model named ``gpufleet-metrics`` makes ``GPUFLEET_METRICS_PORT=tcp://...``,
the variable a worker reads its metrics port from. A manifest that sets the variable wins over
it; one that does not (the chart's ``metrics.enabled=false``) left the Service's, which the worker
refused, and did not start. A model server (third-party code) reads its own settings from its
environment the same way (a model named ``vllm`` makes ``VLLM_PORT``, vLLM's port).

Here the model's Services are the adapter's own, on the real API server; each pod is the one
the real controller made from the shipped object (the control plane's and the gateway's
ReplicaSets', a model's Deployment's) or, where none runs here, the Pod the real API server
admits from the shipped template (a dry run: the node agent's DaemonSet, the chart's
workloads); its environment is what the kubelet would give it.
"""

from __future__ import annotations

import pytest

from fleet.settings import ControlPlaneEnv, NodeAgentEnv, NodeGatewayEnv, SettingsError, WorkerEnv
from providers.cluster.kubernetes import render_pod_template
from providers.cluster.kubernetes.api import _canonical
from fleet.cluster import ANNOTATION_PREVIOUS_TEMPLATE, ServingSpec
from tests.helm.chart import documents, template
from tests.realk8s.cluster import RealCluster
from tests.realk8s.pod import container_env, created_pods, service_link_env
from tests.realk8s.test_adapter import kube, unique  # noqa: F401 - fixtures
from tests.realk8s.test_adapter_objects import _deployment, _get, _pods_of
from tests.realk8s.test_join import wait_for
from tests.realk8s.test_node_agent import GATEWAY_ENDPOINT, rendered_node_config
from workers.gateway.pki import Pki

#: Each gpufleet workload → the settings its process reads at start, beside every worker's.
WORKERS = {"gpufleet-control-plane": ControlPlaneEnv, "gpufleet-node-gateway": NodeGatewayEnv,
           "gpufleet-node-agent": NodeAgentEnv}
#: A model named as a worker setting's prefix: its Service is ``gpufleet-metrics``.
MODEL = "gpufleet-metrics"


@pytest.fixture
def model_services(kube, unique):  # noqa: F811
    """A model named ``gpufleet-metrics`` served at a site: the adapter's Deployment, its Service
    there and the model's own Service (``gpufleet-metrics``), in ``gpufleet``."""
    site = f"site-{unique}"
    kube.apply_serving(ServingSpec(model=MODEL, site=site, image="img:1"))
    yield site
    kube.delete_serving(MODEL, site)


@pytest.fixture
def node_config(real_cluster: RealCluster, tmp_path):
    """The node agents' ConfigMap (``gpufleet-node-gateway``, their env reads it) as an operator
    makes it, where no test made it yet; removed again then."""
    if _get(real_cluster, "/api/v1/namespaces/gpufleet/configmaps/gpufleet-node-gateway") is not None:
        yield
        return
    ca = Pki.create("gpufleet test gateway CA").ca_pem
    real_cluster.kubectl("apply", "--server-side", "-f", "-",
                         input=rendered_node_config(tmp_path, GATEWAY_ENDPOINT, ca))
    yield
    real_cluster.kubectl("-n", "gpufleet", "delete", "configmap", "gpufleet-node-gateway")


def admitted_pod(cluster: RealCluster, workload: dict, name: str) -> dict:
    """The Pod ``workload``'s controller makes of its template, as the real API server admits and
    defaults it (``enableServiceLinks`` among the defaults): a dry run."""
    template_ = workload["spec"]["template"]
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "gpufleet", "labels": template_["metadata"].get("labels") or {}},
            "spec": template_["spec"]}
    status, pod = cluster.request("POST", "/api/v1/namespaces/gpufleet/pods?dryRun=All", body, admin=True)
    assert status == 201, pod
    return pod


def every_pods_own(cluster: RealCluster) -> set[str]:
    """What every pod's environment holds whatever it says: the ``kubernetes`` Service's links."""
    return set(service_link_env(cluster, {"metadata": {"namespace": "gpufleet"},
                                          "spec": {"enableServiceLinks": False}}))


def environment(cluster: RealCluster, pod: dict) -> dict[str, str]:
    """What the kubelet gives the pod's one container: its env and its service links."""
    (container,) = pod["spec"]["containers"]
    return container_env(cluster, pod, container)


def assert_the_environment_is_the_manifests(cluster: RealCluster, pod: dict, env: dict[str, str], what: str) -> None:
    (container,) = pod["spec"]["containers"]
    declared = {variable["name"] for variable in container.get("env") or []}
    assert sorted(set(env) - declared - every_pods_own(cluster)) == [], f"{what}: service links in its environment"


def test_no_models_service_reaches_gpufleets_own_pods(real_cluster: RealCluster, model_services, node_config) -> None:
    """The base's pods and the chart's with ``metrics.enabled=false``: their environment is their
    manifest's env, and each worker's settings read from it."""
    links = service_link_env(real_cluster, {"metadata": {"namespace": "gpufleet"}, "spec": {}})
    assert links["GPUFLEET_METRICS_PORT"].startswith("tcp://"), "the model's Service, as a pod with links sees it"
    with pytest.raises(SettingsError, match="GPUFLEET_METRICS_PORT"):
        WorkerEnv.from_env(links)

    pods = {"gpufleet-control-plane": created_pods(real_cluster, "gpufleet", "gpufleet-control-plane", 1)[0],
            "gpufleet-node-gateway": created_pods(real_cluster, "gpufleet", "gpufleet-node-gateway", 2)[0],
            "gpufleet-node-agent": admitted_pod(real_cluster, _get(
                real_cluster, "/apis/apps/v1/namespaces/gpufleet/daemonsets/gpufleet-node-agent"), "node-agent-pod")}
    for name, pod in pods.items():
        env = environment(real_cluster, pod)
        WorkerEnv.from_env(env)
        WORKERS[name].from_env(env)
        assert_the_environment_is_the_manifests(real_cluster, pod, env, name)

    off = {d["metadata"]["name"]: d for d in documents(template("--set", "metrics.enabled=false"))
           if d["kind"] in ("Deployment", "DaemonSet")}
    assert set(off) == set(WORKERS)
    for name, workload in off.items():
        pod = admitted_pod(real_cluster, workload, f"{name}-chart")
        env = environment(real_cluster, pod)
        assert WorkerEnv.from_env(env).metrics_port is None, f"{name}: serves no /metrics"  # it starts
        WORKERS[name].from_env(env)
        assert_the_environment_is_the_manifests(real_cluster, pod, env, f"{name} (chart, metrics off)")


def test_a_model_servers_environment_holds_no_other_models_services(real_cluster: RealCluster, kube, unique,
                                                                    model_services) -> None:  # noqa: F811
    """The pod the real Deployment controller makes of the Deployment the adapter writes: its
    environment is its template's env, whatever Services the namespace holds. A rollback to a
    template written before (which did not say so) brings no links back; the annotation keeps
    that template as written."""
    model, site = f"m-{unique}", f"site-{unique}"
    spec = ServingSpec(model=model, site=site, image="img:2")
    kube.apply_serving(spec)
    try:
        assert _deployment(real_cluster, f"{model}-{site}")["spec"]["template"]["spec"]["enableServiceLinks"] is False
        (pod, *_) = wait_for(lambda: _pods_of(real_cluster, model, site, "img:2"), 60, "the Deployment's pod")
        assert_the_environment_is_the_manifests(real_cluster, pod, environment(real_cluster, pod), "a model server")

        before = render_pod_template(spec.model_copy(update={"image": "img:1"}))
        del before["spec"]["enableServiceLinks"]
        status, answer = real_cluster.request(
            "PATCH", f"/apis/apps/v1/namespaces/gpufleet/deployments/{model}-{site}",
            {"metadata": {"annotations": {ANNOTATION_PREVIOUS_TEMPLATE: _canonical(before)}}},
            admin=True, content_type="application/merge-patch+json")
        assert status == 200, answer
        kube.rollback_serving(model, site)
        assert _deployment(real_cluster, f"{model}-{site}")["spec"]["template"]["spec"]["enableServiceLinks"] is False
        (pod, *_) = wait_for(lambda: _pods_of(real_cluster, model, site, "img:1"), 60, "the rolled-back pod")
        assert_the_environment_is_the_manifests(real_cluster, pod, environment(real_cluster, pod),
                                                "a rolled-back model server")
    finally:
        kube.delete_serving(model, site)
