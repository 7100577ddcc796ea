"""gpufleet's Helm chart on the real control plane (issue 39): the real helm (tests/helm/build.py)
against the tier's real kube-apiserver, where the conftest has already applied the kustomize base.

Two proofs, neither of which disturbs the base's objects the tier's other tests read:
- the chart's default rendering (images by version) is accepted by the real API server, every
  object validated and admitted as the update it would be (a server-side dry run);
- `helm install --take-ownership`, the way from `kubectl apply -k` to the chart, adopts every
  object the base created: the release is deployed, each object is the release's, and no
  workload's spec changed (no rollout), so the chart is the base. The release is then forgotten
  (its record and its labels removed, never its objects), leaving the base as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helm.chart import CHART, HELM_LABELS, by_key, containers, documents, helm, key, package_version, template
from tests.realk8s.cluster import RealCluster

#: The base's workloads (the tier's other tests add serving Deployments beside them).
WORKLOADS = (("deployment", "gpufleet-control-plane"), ("deployment", "gpufleet-node-gateway"),
             ("daemonset", "gpufleet-node-agent"))


@pytest.fixture
def helm_env(tmp_path: Path, real_cluster: RealCluster) -> tuple[list[str], dict[str, str]]:
    """helm's flags for the tier's cluster (its admin kubeconfig), and its own folders."""
    env = {f"HELM_{kind}_HOME": str(tmp_path / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}
    return ["--kubeconfig", str(real_cluster.admin_kubeconfig)], env


def live(cluster: RealCluster, kind: str, name: str, namespace: str = "gpufleet") -> dict:
    return json.loads(cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json").stdout)


def test_the_default_rendering_is_accepted_by_the_real_api_server(real_cluster: RealCluster) -> None:
    rendered = template()
    done = real_cluster.kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts",
                                "--field-manager=gpufleet-chart", "-o", "json", "-f", "-", input=rendered)
    accepted = json.loads(done.stdout)
    accepted = accepted["items"] if accepted.get("kind") == "List" else [accepted]
    wanted = by_key(documents(rendered))
    assert {key(o) for o in accepted} == set(wanted), "every object of the chart, validated and admitted"
    version = package_version()
    answered = by_key(accepted)
    for name in wanted:
        for container in containers(answered[name]):
            assert container["image"].endswith(f":{version}"), f"{name}: the server took the chart's image"
        labels = answered[name]["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", name
    # A dry run: the base's objects are as the conftest applied them.
    (worker,) = live(real_cluster, "deployment", "gpufleet-control-plane")["spec"]["template"]["spec"]["containers"]
    assert worker["image"] == f"gpufleet-control-plane:{version}"


def test_the_own_racks_seed_server_rendering_is_accepted_by_the_real_api_server(real_cluster: RealCluster) -> None:
    """``ownRacks.seedServer.enabled`` (deploy/own-racks through the chart, tests/test_helm.py): the
    real API server validates and admits the control plane with its seed server over the base's
    Deployment as the conftest applied it (a server-side dry run: no kubelet would run the pod),
    its rollout one pod at a time over the rollingUpdate the server defaulted for the base."""
    from tests.test_deploy import rendered as kustomized
    from tests.test_helm import seed_server_values

    rendered = template(*seed_server_values(kustomized("own-racks")))
    done = real_cluster.kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts",
                                "--field-manager=gpufleet-chart", "-o", "json", "-f", "-", input=rendered)
    accepted = json.loads(done.stdout)
    accepted = by_key(accepted["items"] if accepted.get("kind") == "List" else [accepted])
    wanted = by_key(documents(rendered))
    assert set(accepted) == set(wanted), "every object of the chart, validated and admitted"
    (name,) = [k for k in wanted if k[1] == "Deployment" and k[3] == "gpufleet-control-plane"]
    deployment, asked = accepted[name], wanted[name]
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    pod, asked_pod = deployment["spec"]["template"]["spec"], asked["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["worker", "own-rack-seeds"]
    for container, want in zip(pod["containers"], asked_pod["containers"], strict=True):
        assert container["command"] == want["command"] and container["image"] == want["image"]
        assert container["securityContext"] == want["securityContext"], container["name"]
        assert {(m["name"], m["mountPath"]) for m in container["volumeMounts"]} == {
            (m["name"], m["mountPath"]) for m in want["volumeMounts"]}, container["name"]
    (seeds,) = [c for c in pod["containers"] if c["name"] == "own-rack-seeds"]
    assert [(p["containerPort"], p["hostPort"]) for p in seeds["ports"]] == [(8470, 8470)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "seeds"]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Mi"}
    # A dry run: the base's pod as the conftest applied it.
    live_pod = live(real_cluster, "deployment", "gpufleet-control-plane")["spec"]["template"]["spec"]
    assert [c["name"] for c in live_pod["containers"]] == ["worker"]


def test_helm_takes_over_what_kubectl_apply_k_installed(real_cluster: RealCluster, helm_env, tmp_path: Path) -> None:
    flags, env = helm_env
    before = {(kind, name): live(real_cluster, kind, name) for kind, name in WORKLOADS}
    # The base names the images by the package version, as the chart's default values do: a user
    # moving from the base sets no image value.
    values: list[str] = []
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(template(*values))
    helm("install", "gpufleet", str(CHART), "--take-ownership", "--namespace", "default", *values, *flags, env=env)
    try:
        status = json.loads(helm("status", "gpufleet", "--namespace", "default", "-o", "json", *flags, env=env).stdout)
        assert status["info"]["status"] == "deployed"
        manifest = documents(helm("get", "manifest", "gpufleet", "--namespace", "default", *flags, env=env).stdout)
        assert {key(o) for o in manifest} == {key(o) for o in documents(rendered.read_text())}
        for obj in manifest:
            server = on_server(real_cluster, obj)
            annotations = server["metadata"].get("annotations") or {}
            assert annotations.get("meta.helm.sh/release-name") == "gpufleet", key(obj)
            assert server["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm", key(obj)
        # No rollout: each workload's spec as the base left it, and no new Deployment revision (a
        # Deployment's generation also counts annotation changes, so it is not the measure here).
        for (kind, name), was in before.items():
            now = live(real_cluster, kind, name)
            assert now["spec"] == was["spec"], f"{kind} {name}: the chart renders the base's spec"
            revision = "deployment.kubernetes.io/revision"
            assert now["metadata"]["annotations"].get(revision) == was["metadata"]["annotations"].get(revision)
    finally:
        forget_release(real_cluster, rendered)
    # The tier's objects as the conftest applied them, for the tests after this one.
    for (kind, name), was in before.items():
        assert live(real_cluster, kind, name)["metadata"]["labels"] == was["metadata"]["labels"]
    for obj in documents(rendered.read_text()):
        meta = on_server(real_cluster, obj)["metadata"]
        assert not [k for k in {**meta.get("labels", {}), **meta.get("annotations", {})}
                    if k in HELM_LABELS or k.startswith(("helm.sh/", "meta.helm.sh/"))], key(obj)


def on_server(cluster: RealCluster, obj: dict) -> dict:
    meta = obj["metadata"]
    scope = ["-n", meta["namespace"]] if meta.get("namespace") else []
    return json.loads(cluster.kubectl("get", resource_of(obj), meta["name"], *scope, "-o", "json").stdout)


def forget_release(cluster: RealCluster, rendered: Path) -> None:
    """Drop the release without deleting its objects (`helm uninstall` would delete the base the
    tier's other tests use): helm's record, then its labels and annotations on each object."""
    cluster.kubectl("delete", "secret", "-n", "default", "-l", "owner=helm,name=gpufleet")
    cluster.kubectl("label", "-f", str(rendered), *(f"{label}-" for label in HELM_LABELS))
    cluster.kubectl("annotate", "-f", str(rendered), "meta.helm.sh/release-name-", "meta.helm.sh/release-namespace-")
    cluster.kubectl("annotate", "namespace", "gpufleet", "gpufleet-bootstrap", "helm.sh/resource-policy-")


def resource_of(obj: dict) -> str:
    """`kind.group` for `kubectl get` (the core group: the kind alone)."""
    api = obj["apiVersion"]
    return obj["kind"].lower() + ("." + api.split("/")[0] if "/" in api else "")
