"""gpufleet's Helm chart (deploy/helm/gpufleet), linted and rendered by the real helm (v3, built
from its Go module by tests/helm/build.py).

With default values it renders exactly the objects of the kustomize base (`kubectl kustomize
deploy/kubernetes`), object by object, apart from helm's own labels (both name the images by the
package version): the two cannot drift apart without this failing.
Each value reaches the objects it is for; a misspelt value, or a Temporal connection with no
credentials, is refused before anything renders. The real control plane applies the rendering
in tests/realk8s/test_helm.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import (
    CHART,
    IMAGES,
    by_key,
    containers,
    documents,
    helm,
    package_version,
    template,
    without_helm_metadata,
)
from tests.realk8s.image import Containerfile, image_name
from tests.tools import needs, require
from workers.reclaim_watch import KUBELET_FLAGS

pytestmark = pytest.mark.integration  # runs helm (and kubectl kustomize)


def kustomize(folder: Path) -> list[dict[str, Any]]:
    done = subprocess.run([require("kubectl"), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return documents(done.stdout)


def base(name: str) -> list[dict[str, Any]]:
    return kustomize(CHART.parents[1] / name)


def chart_as_kubectl_reads_it(tmp_path, *values: str) -> list[dict[str, Any]]:
    """The chart's rendering read by kubectl's own YAML parser, as the base's is: Go's and
    Python's parsers disagree on some block scalars (the admission policy's folded CEL), so
    both sides of the comparison go through the same one."""
    (tmp_path / "chart.yaml").write_text(template(*values))
    (tmp_path / "kustomization.yaml").write_text("resources: [chart.yaml]\n")
    return kustomize(tmp_path)


def assert_same_objects(chart: list[dict[str, Any]], base: list[dict[str, Any]]) -> None:
    """Object by object: the same set, and each equal once helm's labels are set aside and the
    images named by the package version in both."""
    rendered, wanted = by_key(chart), by_key(base)
    assert sorted(set(rendered) - set(wanted)) == [], "objects the chart renders and the base has not"
    assert sorted(set(wanted) - set(rendered)) == [], "objects of the base the chart does not render"
    version = package_version()
    for name, obj in wanted.items():
        for container in containers(rendered[name]):
            assert container["image"].rsplit(":", 1)[1] == version, f"{name}: images are named by version"
        ours = without_helm_metadata(rendered[name])
        assert ours == obj, f"{name} differs from the base:\n" + "\n".join(_diff(obj, ours))


def _diff(base: dict[str, Any], chart: dict[str, Any]) -> list[str]:
    import difflib

    def lines(o: dict[str, Any]) -> list[str]:
        return json.dumps(o, indent=1, sort_keys=True).splitlines()
    return list(difflib.unified_diff(lines(base), lines(chart), "kustomize", "helm", lineterm="", n=2))


def workload(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet") and d["metadata"]["name"] == name]
    return found


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def pod_of(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


# -- the chart itself -----------------------------------------------------------------------------
def test_chart_is_named_by_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == chart["version"] == package_version(), \
        "Chart.yaml's version and appVersion follow pyproject.toml's"


def test_helm_is_the_pinned_release() -> None:
    from tests.helm import build

    assert helm("version", "--template", "{{.Version}}").stdout == build.HELM_VERSION


def test_a_cluster_without_validating_admission_policy_v1_is_refused() -> None:
    """Kubernetes 1.30 or later (the admission policy's API); helm's own default, when no cluster
    is asked, is stamped at build time to the Kubernetes its client-go is (1.36), so the default
    renderings above pass the same check."""
    done = helm("template", "gpufleet", str(CHART), "--kube-version", "1.29.4", check=False)
    assert done.returncode != 0 and ">=1.30.0-0" in done.stderr, done.stderr
    helm("template", "gpufleet", str(CHART), "--kube-version", "1.30.0")


def test_chart_lints_strictly() -> None:
    done = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in done.stdout
    # Also with the non-default modes a user sets.
    helm("lint", "--strict", str(CHART), "--set", "temporal.apiKey.secretName=gpufleet-temporal-api-key",
         "--set", "metrics.serviceMonitor.enabled=true", "--set", "sites.config=mode: sim")
    helm("lint", "--strict", str(CHART), "--set", "ownRacks.seedServer.enabled=true",
         "--set", "ownRacks.seedServer.url=http://10.0.0.2:8470")


# -- no drift from the kustomize base ------------------------------------------------------------
@needs("kubectl")
def test_default_rendering_is_the_kustomize_base_object_by_object(tmp_path) -> None:
    assert_same_objects(chart_as_kubectl_reads_it(tmp_path), base("kubernetes"))


@needs("kubectl")
def test_driver_reinstall_rendering_is_the_base_with_its_component(tmp_path) -> None:
    """``nodeAgent.driverReinstall=true`` renders what the base with deploy/driver-reinstall
    renders (the node agent's command, privileged, hostPID: tests/test_deploy.py says what it
    runs); the default, the base alone."""
    from tests.test_deploy import kustomization_with

    (tmp_path / "chart").mkdir()
    assert_same_objects(chart_as_kubectl_reads_it(tmp_path / "chart", "--set", "nodeAgent.driverReinstall=true"),
                        kustomize(kustomization_with(tmp_path, ["kubernetes"], ["driver-reinstall"])))


def seed_server_values(overlay: list[dict[str, Any]]) -> tuple[str, ...]:
    """The chart's values for the seed server deploy/own-racks runs: its account and URL, read
    from the overlay's own command (an operator sets both there, or here)."""
    (_, seeds) = pod_of(workload(overlay, "gpufleet-control-plane"))["containers"]
    args = dict(zip(seeds["command"][3::2], seeds["command"][4::2]))
    return ("--set", "ownRacks.seedServer.enabled=true", "--set", f"ownRacks.seedServer.account={args['--account']}",
            "--set", f"ownRacks.seedServer.url={args['--url']}")


@needs("kubectl")
def test_own_racks_seed_server_rendering_is_the_own_racks_overlay(tmp_path) -> None:
    """Own racks join only through the seed server beside the worker: ``ownRacks.seedServer``
    on renders what ``kubectl apply -k deploy/own-racks`` does (the second container on the
    worker's in-memory seed_dir, its host's port, the rollout one pod at a time; tests/test_deploy.py
    says what each is for), object by object, so a Helm install needs no post-renderer; off, with
    the other seed-server values set, the base alone."""
    overlay = base("own-racks")
    values = seed_server_values(overlay)
    (tmp_path / "on").mkdir()
    assert_same_objects(chart_as_kubectl_reads_it(tmp_path / "on", *values), overlay)
    (tmp_path / "off").mkdir()
    off = (*values, "--set", "ownRacks.seedServer.enabled=false")
    assert_same_objects(chart_as_kubectl_reads_it(tmp_path / "off", *off), base("kubernetes"))


def test_the_seed_server_values_reach_its_container(monkeypatch) -> None:
    """The port moves what the server listens on and what its host publishes together; the
    seed_dir moves both containers' mounts of the one volume; the server's own CLI takes the
    command (tests/test_deploy.py). One control-plane replica only, and the URL is required."""
    from tests.test_deploy import seed_server_cli_args

    docs = documents(template("--set", "ownRacks.seedServer.enabled=true", "--set", "ownRacks.seedServer.account=dc-ber",
                              "--set", "ownRacks.seedServer.url=http://192.0.2.7:9470", "--set",
                              "ownRacks.seedServer.port=9470", "--set", "ownRacks.seedServer.seedDir=/run/seeds"))
    pod = pod_of(workload(docs, "gpufleet-control-plane"))
    worker, seeds = pod["containers"]
    asked = seed_server_cli_args(seeds["command"], monkeypatch)
    assert (asked["account"], asked["url"], asked["listen"]) == ("dc-ber", "http://192.0.2.7:9470", ("0.0.0.0", 9470))
    assert seeds["ports"] == [{"name": "seeds", "containerPort": 9470, "hostPort": 9470}]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "seeds"]
    assert volume["emptyDir"]["medium"] == "Memory"
    for container in (worker, seeds):
        assert [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "seeds"] == ["/run/seeds"]

    done = helm("template", "gpufleet", str(CHART), "--set", "ownRacks.seedServer.enabled=true", check=False)
    assert done.returncode != 0 and "ownRacks.seedServer.url is required" in done.stderr, done.stderr
    done = helm("template", "gpufleet", str(CHART), "--set", "ownRacks.seedServer.enabled=true",
                "--set", "ownRacks.seedServer.url=http://10.0.0.2:8470", "--set", "controlPlane.replicas=2", check=False)
    assert done.returncode != 0 and "controlPlane.replicas must be 1" in done.stderr, done.stderr


def test_the_seed_server_follows_sites_config_and_carries_its_ipxe_template(tmp_path) -> None:
    """With ``sites.config`` the chart holds the seed server to it: the account must be an own-dc
    one whose seed_dir is the volume's (the worker writes where the server reads), and the iPXE
    template the account names goes into the chart's ConfigMap under that name (a ConfigMap helm
    owns takes no file added by hand); a changed template rolls the pod (the server reads it when
    it starts)."""
    sites = tmp_path / "sites.yaml"
    sites.write_text((CHART.parents[1] / "sites.example.yaml").read_text())
    ipxe = tmp_path / "own-rack.ipxe"
    ipxe.write_text((CHART.parents[1] / "bootstrap" / "own-rack.ipxe").read_text())
    on = ("--set-file", f"sites.config={sites}", "--set", "ownRacks.seedServer.enabled=true",
          "--set", "ownRacks.seedServer.url=http://10.0.0.2:8470")
    docs = documents(template(*on, "--set-file", f"ownRacks.seedServer.ipxeTemplate={ipxe}"))
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config["data"]["own-rack.ipxe"] == ipxe.read_text()
    assert yaml.safe_load(config["data"]["sites.yaml"]) == yaml.safe_load(sites.read_text())
    before = workload(docs, "gpufleet-control-plane")["spec"]["template"]["metadata"]["annotations"]
    ipxe.write_text(ipxe.read_text() + "\n# changed\n")
    after = workload(documents(template(*on, "--set-file", f"ownRacks.seedServer.ipxeTemplate={ipxe}")),
                     "gpufleet-control-plane")["spec"]["template"]["metadata"]["annotations"]
    assert before["gpufleet.io/own-rack-ipxe-sha256"] != after["gpufleet.io/own-rack-ipxe-sha256"]
    assert before["gpufleet.io/sites-config-sha256"] == after["gpufleet.io/sites-config-sha256"]

    def refused(*values: str) -> str:
        done = helm("template", "gpufleet", str(CHART), *on, *values, check=False)
        assert done.returncode != 0
        return done.stderr
    assert "ownRacks.seedServer.ipxeTemplate is required" in refused()
    assert 'no own-dc account "lambda-prod"' in refused("--set", "ownRacks.seedServer.account=lambda-prod",
                                                       "--set-file", f"ownRacks.seedServer.ipxeTemplate={ipxe}")
    assert 'has seed_dir "/run/gpufleet/seeds"' in refused("--set", "ownRacks.seedServer.seedDir=/var/seeds",
                                                          "--set-file", f"ownRacks.seedServer.ipxeTemplate={ipxe}")
    done = helm("template", "gpufleet", str(CHART), "--set-file", f"ownRacks.seedServer.ipxeTemplate={ipxe}",
                check=False)
    assert done.returncode != 0 and "ownRacks.seedServer.enabled is not" in done.stderr, done.stderr


@needs("kubectl")
def test_service_monitor_rendering_is_the_prometheus_operator_overlay(tmp_path) -> None:
    assert_same_objects(chart_as_kubectl_reads_it(tmp_path, "--set", "metrics.serviceMonitor.enabled=true"),
                        base("prometheus-operator"))


# -- values reach the objects they are for ------------------------------------------------------
def test_images_carry_the_version_and_the_registry() -> None:
    docs = documents(template())
    version = package_version()
    images = {c["name"]: c["image"] for d in docs for c in containers(d)}
    assert images == {"worker": f"gpufleet-control-plane:{version}", "gateway": f"gpufleet-control-plane:{version}",
                      "agent": f"gpufleet-node-agent:{version}"}
    docs = documents(template("--set", "images.registry=registry.example.com/ml/", "--set", "images.tag=0.1.0-rc1",
                              "--set", "images.pullPolicy=Always", "--set", "images.pullSecrets={pull}"))
    for d in docs:
        for c in containers(d):
            assert c["image"].startswith("registry.example.com/ml/gpufleet-") and c["image"].endswith(":0.1.0-rc1")
            assert c["image"].split("/")[-1].split(":")[0] in IMAGES
            assert c["imagePullPolicy"] == "Always"
        if containers(d):
            assert pod_of(d)["imagePullSecrets"] == [{"name": "pull"}]


def test_temporal_connection_mutual_tls_by_default() -> None:
    docs = documents(template("--set", "temporal.address=frontend.temporal.example:7233",
                              "--set", "temporal.namespace=fleet-prod", "--set", "temporal.tls.clientSecret=my-client"))
    for name in ("gpufleet-control-plane", "gpufleet-node-gateway"):
        obj = workload(docs, name)
        (container,) = pod_of(obj)["containers"]
        env = env_of(container)
        assert env["TEMPORAL_ADDRESS"] == "frontend.temporal.example:7233"
        assert env["TEMPORAL_NAMESPACE"] == "fleet-prod"
        assert env["TEMPORAL_TLS_SERVER_NAME"] == "frontend.temporal.example", "the host of the address"
        assert "TEMPORAL_API_KEY" not in env
        (secret,) = [v["secret"] for v in pod_of(obj)["volumes"] if v["name"] == "temporal-client"]
        assert secret["secretName"] == "my-client"
        mounted = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounted["temporal-client"] == "/etc/gpufleet/temporal"
        assert {env[k].rsplit("/", 1)[0] for k in env if k.endswith("_PATH")} == {"/etc/gpufleet/temporal"}
    (agent,) = pod_of(workload(docs, "gpufleet-node-agent"))["containers"]
    assert env_of(agent)["TEMPORAL_NAMESPACE"] == "fleet-prod"
    assert "TEMPORAL_ADDRESS" not in env_of(agent), "a node never dials Temporal itself"


def test_temporal_cloud_api_key_replaces_the_client_certificate() -> None:
    docs = documents(template("--set", "temporal.address=fleet.a1b2c.tmprl.cloud:7233",
                              "--set", "temporal.apiKey.secretName=gpufleet-temporal-api-key"))
    for name in ("gpufleet-control-plane", "gpufleet-node-gateway"):
        pod = pod_of(workload(docs, name))
        (container,) = pod["containers"]
        env = env_of(container)
        assert env["TEMPORAL_API_KEY"] == {"secretKeyRef": {"name": "gpufleet-temporal-api-key", "key": "api-key"}}
        assert not [k for k in env if k.startswith("TEMPORAL_TLS")], "TLS with public CAs: no client certificate"
        assert "temporal-client" not in {v["name"] for v in pod["volumes"]}
        assert "temporal-client" not in {m["name"] for m in container["volumeMounts"]}
    assert not [d for d in docs if d["kind"] == "Secret"], "the chart names credentials' Secrets, never holds one"


def test_a_temporal_connection_without_credentials_is_refused() -> None:
    done = helm("template", "gpufleet", str(CHART), "--set", "temporal.tls.clientSecret=", check=False)
    assert done.returncode != 0
    assert "temporal.tls.clientSecret" in done.stderr and "temporal.apiKey.secretName" in done.stderr
    assert "no plaintext" in done.stderr


@pytest.mark.parametrize(("value", "field"), [
    ("temporal.adress=x:1", "adress"),                     # misspelt: refused, not ignored
    ("controlPlane.replicas=two", "/controlPlane/replicas"),
    ("temporal.address=no-port", "/temporal/address"),
    ("nodeGateway.service.type=NodePort", "/nodeGateway/service/type"),  # no node ports (README "Network model")
    ("metrics.ports.nodeAgent=70000", "/metrics/ports/nodeAgent"),
    ("nodeAgent.spotNotice=azure", "/nodeAgent/spotNotice"),     # a source the agent has not
    ("nodeGateway.upstreamCallsPerSecond=0", "/nodeGateway/upstreamCallsPerSecond"),
    ("metrics.prometheusNamespace=Monitoring", "/metrics/prometheusNamespace"),  # no namespace's name
    ("ownRacks.seedServer.enabled=yes", "/ownRacks/seedServer/enabled"),
    ("ownRacks.seedServer.port=70000", "/ownRacks/seedServer/port"),
    ("ownRacks.seedServer.seedDir=run/seeds", "/ownRacks/seedServer/seedDir"),  # the account's absolute seed_dir
    ("ownRacks.seedServer.url=10.0.0.2:8470", "/ownRacks/seedServer/url"),     # no scheme: not a URL iPXE fetches
    ("ownRacks.seedDir=/run/seeds", "seedDir"),
])
def test_bad_values_are_refused_naming_the_field(value: str, field: str) -> None:
    done = helm("template", "gpufleet", str(CHART), "--set", value, check=False)
    assert done.returncode != 0 and field in done.stderr, done.stderr


def test_sites_config_from_a_file_becomes_the_config_map(tmp_path) -> None:
    assert not [d for d in documents(template()) if d["kind"] == "ConfigMap"], "by default you create it"
    sites = tmp_path / "sites.yaml"
    sites.write_text((CHART.parents[1] / "sites.example.yaml").read_text())
    first = documents(template("--set-file", f"sites.config={sites}"))
    (config,) = [d for d in first if d["kind"] == "ConfigMap"]
    assert (config["metadata"]["namespace"], config["metadata"]["name"]) == ("gpufleet", "gpufleet-config")
    assert yaml.safe_load(config["data"]["sites.yaml"]) == yaml.safe_load(sites.read_text())
    # A changed file rolls the pods that read it.
    sites.write_text(sites.read_text() + "\n# changed\n")
    second = documents(template("--set-file", f"sites.config={sites}"))
    for name in ("gpufleet-control-plane", "gpufleet-node-gateway"):
        before, after = (workload(d, name)["spec"]["template"]["metadata"]["annotations"] for d in (first, second))
        assert before["gpufleet.io/sites-config-sha256"] != after["gpufleet.io/sites-config-sha256"]
    renamed = documents(template("--set", "sites.configMap=fleet-sites"))
    for name in ("gpufleet-control-plane", "gpufleet-node-gateway"):
        (volume,) = [v for v in pod_of(workload(renamed, name))["volumes"] if v["name"] == "config"]
        assert volume["configMap"]["name"] == "fleet-sites"


def _reference_fields(model: type, prefix: str = "") -> set[str]:
    """Where a fleet config's schema holds a credentials reference: ``accounts[].credentials``."""
    import types
    import typing

    from pydantic import BaseModel

    from fleet.models import CredentialsRef

    found = set()
    for name, field in model.model_fields.items():
        path, kinds = f"{prefix}{name}", [field.annotation]
        while kinds:
            kind = kinds.pop()
            origin, args = typing.get_origin(kind), typing.get_args(kind)
            if kind is CredentialsRef:
                found.add(path)
            elif isinstance(kind, type) and issubclass(kind, BaseModel):
                found |= _reference_fields(kind, f"{path}.")
            elif origin in (list, tuple):
                path += "[]"
                kinds += args
            elif origin is dict:
                path += "{}"
                kinds.append(args[1])
            elif origin in (typing.Union, types.UnionType):
                kinds += args
    return found


def credentials_objects(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [without_helm_metadata(d) for d in docs if d["metadata"]["name"] == "gpufleet-credentials"]


def test_the_credentials_role_is_rendered_from_sites_config_as_the_cli_renders_it(tmp_path) -> None:
    """With ``sites.config`` the chart lets the control plane get exactly the Secrets that config
    names, by name, as ``gpufleet cluster credentials-role`` does; ``credentials.secrets`` adds
    names (a ConfigMap you create yourself); with neither there is no Role (the base's rendering),
    never one whose empty resourceNames would be every Secret. A Secret outside `gpufleet` is
    refused, naming the field."""
    from fleet.config import FleetConfig, load_config
    from providers.credentials import credentials_role
    from tests.cluster.test_manifests import every_reference_config

    # The chart's template reads each of these by name: a new place needs it taught there too. A
    # store's pull_credentials are its nodes' key, which the control plane never reads: not taught.
    assert _reference_fields(FleetConfig) == {"notify_webhook", "object_stores{}.credentials", "accounts[].credentials",
                                              "sites[].object_store.credentials", "node_gateway.ca",
                                              "object_stores{}.pull_credentials",
                                              "sites[].object_store.pull_credentials"}
    path = every_reference_config(tmp_path)
    rendered = credentials_objects(documents(template("--set-file", f"sites.config={path}")))
    assert sorted(rendered, key=lambda d: d["kind"]) == credentials_role(load_config(path))

    (role, _) = sorted(credentials_objects(documents(template("--set", "credentials.secrets={app-key,bmc}"))),
                       key=lambda d: d["kind"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["app-key", "bmc"],
                              "verbs": ["get"]}]
    assert credentials_objects(documents(template())) == []
    assert credentials_objects(documents(template("--set", "sites.config=mode: sim"))) == []

    path.write_text(path.read_text().replace("gpufleet/pager-webhook#url", "kube-system/pager-webhook#url"))
    done = helm("template", "gpufleet", str(CHART), "--set-file", f"sites.config={path}", check=False)
    assert done.returncode != 0 and "sites.config: notify_webhook: secret:kube-system/pager-webhook#url" in done.stderr


def test_metrics_off_serves_none_and_ports_move() -> None:
    off = documents(template("--set", "metrics.enabled=false", "--set", "metrics.serviceMonitor.enabled=true"))
    assert not [d for d in off if d["metadata"]["name"].endswith("-metrics") or d["kind"] == "ServiceMonitor"]
    for d in off:
        for c in containers(d):
            # The environment the container runs with: its image's ENV under its own env.
            baked = Containerfile.read(image_name(c["image"])).env
            assert "GPUFLEET_METRICS_PORT" not in {**baked, **env_of(c)}, "unset: the worker serves no /metrics"
            assert "metrics" not in {p["name"] for p in c.get("ports", [])}
    moved = documents(template("--set", "metrics.ports.controlPlane=19464"))
    (worker,) = pod_of(workload(moved, "gpufleet-control-plane"))["containers"]
    assert env_of(worker)["GPUFLEET_METRICS_PORT"] == "19464"
    assert worker["ports"] == [{"name": "metrics", "containerPort": 19464}]
    (service,) = [d for d in moved if d["metadata"]["name"] == "gpufleet-control-plane-metrics"]
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 19464, "targetPort": "metrics"}]


@pytest.mark.parametrize("values", [(), ("--set", "metrics.enabled=false")], ids=["default", "metrics-off"])
def test_no_pod_gets_service_links(values: tuple[str, ...]) -> None:
    """Every pod the chart renders says ``enableServiceLinks: false``, whatever the values: with
    metrics off no manifest sets GPUFLEET_METRICS_PORT, and a model's Service named
    ``gpufleet-metrics`` in ``gpufleet`` set it for the workers, which then refused to start
    (tests/realk8s/test_service_links.py)."""
    found = {d["metadata"]["name"]: d for d in documents(template(*values)) if d["kind"] in ("Deployment", "DaemonSet")}
    assert set(found) == {"gpufleet-control-plane", "gpufleet-node-agent", "gpufleet-node-gateway"}
    for name, obj in found.items():
        assert pod_of(obj).get("enableServiceLinks") is False, name


def test_node_agents_read_the_spot_notices_of_their_own_provider() -> None:
    """By default each agent reads its own provider's notices (``auto``), from the providerID in
    the kubelet's flags, mounted read-only; another source reaches the env and mounts nothing."""
    pod = pod_of(workload(documents(template()), "gpufleet-node-agent"))
    (agent,) = pod["containers"]
    assert env_of(agent)["GPUFLEET_SPOT_NOTICE"] == "auto"
    (mount,) = [m for m in agent["volumeMounts"] if m["mountPath"] == str(KUBELET_FLAGS)]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["hostPath"] == {"path": str(KUBELET_FLAGS), "type": "FileOrCreate"}, "an agent starts on any node"
    for value, env in (("aws", "aws"), ("", "")):
        pod = pod_of(workload(documents(template("--set", f"nodeAgent.spotNotice={value}")), "gpufleet-node-agent"))
        (agent,) = pod["containers"]
        assert env_of(agent)["GPUFLEET_SPOT_NOTICE"] == env
        assert str(KUBELET_FLAGS) not in {m["mountPath"] for m in agent["volumeMounts"]}
        assert "kubelet-flags" not in {v["name"] for v in pod["volumes"]}


def test_the_gateways_network_policy_opens_the_ports_it_serves_and_the_peer_port_to_itself() -> None:
    """The policy follows the gateway's ports (the default rendering is the base's, whose policy
    tests/cluster/test_manifests.py judges): its metrics port where it moves, none with metrics
    off; its peer port admitted from its own pods only, whatever the values."""
    for values, metrics in (((), 9466), (("--set", "metrics.ports.nodeGateway=19466"), 19466),
                            (("--set", "metrics.enabled=false"), None)):
        docs = documents(template(*values))
        (gateway,) = pod_of(workload(docs, "gpufleet-node-gateway"))["containers"]
        ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
        (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"
                     and d["metadata"]["name"] == "gpufleet-node-gateway"]
        anyone, own = policy["spec"]["ingress"]
        assert "from" not in anyone
        assert [p["port"] for p in anyone["ports"]] == [ports["nodes"]] + ([metrics] if metrics else []), values
        assert ports.get("metrics") == metrics, values
        assert own == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gpufleet-node-gateway"}}}],
                       "ports": [{"protocol": "TCP", "port": ports["peers"]}]}


def test_the_control_planes_network_policy_admits_prometheus_to_its_metrics_port_only() -> None:
    """The policy follows the control plane's metrics port and Prometheus's namespace (the default
    rendering is the base's, whose policy tests/cluster/test_manifests.py judges); with metrics
    off it admits nothing at all (the worker serves no port then)."""
    for values, port, namespace in (((), 9464, "monitoring"),
                                    (("--set", "metrics.ports.controlPlane=19464"), 19464, "monitoring"),
                                    (("--set", "metrics.prometheusNamespace=observability"), 9464, "observability"),
                                    (("--set", "metrics.enabled=false"), None, None)):
        docs = documents(template(*values))
        (worker,) = pod_of(workload(docs, "gpufleet-control-plane"))["containers"]
        (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"
                     and d["metadata"]["name"] == "gpufleet-control-plane"]
        assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "gpufleet-control-plane"}}
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert [p["containerPort"] for p in worker.get("ports", [])] == ([port] if port else []), values
        if port is None:
            assert "ingress" not in policy["spec"], "no rule: nothing admitted"
            continue
        (rule,) = policy["spec"]["ingress"]
        assert rule == {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
                        "ports": [{"protocol": "TCP", "port": port}]}, values


def test_node_gateway_endpoint_and_namespaces() -> None:
    docs = documents(template("--set", "nodeGateway.service.type=ClusterIP", "--set", "nodeGateway.replicas=3",
                              "--set", "namespaces.create=false"))
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "gpufleet-node-gateway"]
    assert service["spec"]["type"] == "ClusterIP"
    assert "allocateLoadBalancerNodePorts" not in service["spec"] and "externalTrafficPolicy" not in service["spec"]
    assert workload(docs, "gpufleet-node-gateway")["spec"]["replicas"] == 3
    # Each of the three replicas sends the frontend a third of the gateway's upstream budget.
    (gateway,) = pod_of(workload(docs, "gpufleet-node-gateway"))["containers"]
    assert env_of(gateway)["GPUFLEET_GATEWAY_REPLICAS"] == "3"
    assert "GPUFLEET_GATEWAY_UPSTREAM_CALLS_PER_SECOND" not in env_of(gateway), "unset: the settings' default"
    budget = documents(template("--set", "nodeGateway.upstreamCallsPerSecond=1500"))
    (gateway,) = pod_of(workload(budget, "gpufleet-node-gateway"))["containers"]
    assert env_of(gateway)["GPUFLEET_GATEWAY_UPSTREAM_CALLS_PER_SECOND"] == "1500"
    # Every replica mounts the one task-token key, where its environment says.
    keyed = pod_of(workload(documents(template("--set", "nodeGateway.tokenKeySecret=my-token-key")),
                            "gpufleet-node-gateway"))
    (secret,) = [v["secret"] for v in keyed["volumes"] if v["name"] == "token-keys"]
    assert secret["secretName"] == "my-token-key"
    (gateway,) = keyed["containers"]
    mounted = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    assert env_of(gateway)["GPUFLEET_GATEWAY_TOKEN_KEYS"] == mounted["token-keys"]
    assert not [d for d in docs if d["kind"] == "Namespace"]
    # The namespaces hold gpufleet's state: `helm uninstall` keeps them.
    for ns in (d for d in documents(template()) if d["kind"] == "Namespace"):
        assert ns["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
