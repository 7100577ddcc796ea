"""The network model (issue 17): nodes only dial out.

* every kustomization under deploy/ renders, and nothing rendered for a GPU node listens
  (no NodePort/LoadBalancer Service, no hostPort, no host network) or dials a ``.svc`` name;
* the API server reaches kubelets through Konnectivity tunnels the nodes open
  (``gpufleet cluster check`` reports them, against the fake API server: its report lists every
  gpufleet node of the cluster, which a real tier shared by many tests cannot hold to a known set);
* a site is a topology zone: a joined node carries ``topology.kubernetes.io/zone=<site>``
  (simulated fleet here; on the real API server, with the reconcile sweep putting it back:
  tests/realk8s/test_adapter_objects.py);
* the one Service that spans sites prefers the caller's site (the objects written, on the real
  API server: tests/realk8s/test_adapter_objects.py); a replica stays in one site;
* node agents dial the node gateway's public endpoint from the fleet config.
"""

from __future__ import annotations

import re
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli.cluster import cluster_app
from tests.cluster.test_cluster_check import install_admission_policy
from fleet.cluster import (
    LABEL_MODEL,
    LABEL_SITE,
    LABEL_ZONE,
    ServingSpec,
)
from fleet.config import ConfigError, parse_config
from fleet.messages.join import NodeJoinResult
from providers.cluster.check import check_tunnels
from providers.cluster.kubernetes import (
    render_deployment,
    render_model_service,
    render_service,
)
from tests.conftest import write_fleet
from tests.tools import require

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml")
                        if yaml.safe_load(p.read_text()).get("kind") != "Component")
#: Kustomize components: each renders only within a kustomization, here beside the base.
COMPONENTS = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml")
                    if yaml.safe_load(p.read_text()).get("kind") == "Component")
runner = CliRunner()


# -- deploy/: what runs on a node ---------------------------------------------------------------
def _render(directory: Path) -> list[dict]:
    # Where the build left it (~/.cache/gpufleet/realk8s), else PATH; skipped without it, failed in CI.
    kubectl = require("kubectl")
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, f"{directory}: {done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _with_base(component: Path, tmp_path: Path) -> list[dict]:
    from tests.test_deploy import kustomization_with

    return _render(kustomization_with(tmp_path / component.name, ["kubernetes"], [component.name]))


def _rendered(tmp_path: Path) -> list[dict]:
    """Every kustomization's objects, and every component's beside the base."""
    return [*(doc for directory in KUSTOMIZATIONS for doc in _render(directory)),
            *(doc for component in COMPONENTS for doc in _with_base(component, tmp_path))]


def _gpu_node_pods(docs: list[dict]) -> dict[str, dict]:
    """Pod templates that land on GPU nodes: by their node affinity or node selector."""
    found = {}
    for doc in docs:
        if doc["kind"] not in ("DaemonSet", "Deployment", "StatefulSet", "Job"):
            continue
        pod = doc["spec"]["template"]["spec"]
        terms = (((pod.get("affinity") or {}).get("nodeAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
        keys = {e["key"] for t in terms for e in t.get("matchExpressions") or []} | set(pod.get("nodeSelector") or {})
        tolerated = {t.get("key") for t in pod.get("tolerations") or []}
        if doc["kind"] == "DaemonSet" or keys & {"nvidia.com/gpu.present", LABEL_SITE} or "nvidia.com/gpu" in tolerated:
            found[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return found


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_kustomization_renders(directory: Path) -> None:
    assert _render(directory)


@pytest.mark.integration  # kubectl kustomize
@pytest.mark.parametrize("component", COMPONENTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_component_renders_beside_the_base(component: Path, tmp_path: Path) -> None:
    assert _with_base(component, tmp_path)


def test_the_network_parts_are_kustomizations() -> None:
    assert {str(p.relative_to(DEPLOY)) for p in KUSTOMIZATIONS} >= {
        "kubernetes", "network/konnectivity", "network/dns"}
    assert [str(p.relative_to(DEPLOY)) for p in COMPONENTS] == ["driver-reinstall"]


def test_nothing_listens_on_a_gpu_node(tmp_path: Path) -> None:
    docs = _rendered(tmp_path)
    # A LoadBalancer opens a port on every node unless it sends to pods directly (no node ports).
    exposed = [(d["metadata"]["name"], d["spec"].get("type")) for d in docs if d["kind"] == "Service"
               and (d["spec"].get("type") == "NodePort" or d["spec"].get("type") == "LoadBalancer"
                    and d["spec"].get("allocateLoadBalancerNodePorts") is not False)]
    assert not exposed
    workloads = _gpu_node_pods(docs)
    assert {"DaemonSet/gpufleet-node-agent", "DaemonSet/konnectivity-agent"} <= set(workloads)
    reinstalling = [d for d in _with_base(DEPLOY / "driver-reinstall", tmp_path / "again") if d["kind"] == "DaemonSet"]
    for name, doc in workloads.items():
        pod = doc["spec"]["template"]["spec"]
        assert not any(pod.get(k) for k in ("hostNetwork", "hostIPC")), name
        # The host's processes, no port: only the node agent the driver reinstall needs root on
        # the host for (deploy/driver-reinstall, opted into) shares them.
        assert not pod.get("hostPID") or doc in reinstalling, name
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            assert not any("hostPort" in p for p in container.get("ports") or []), name


def _strings(value) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def test_nothing_on_a_node_dials_a_cluster_internal_name(tmp_path: Path) -> None:
    docs = _rendered(tmp_path)
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for name, doc in _gpu_node_pods(docs).items():
        pod = doc["spec"]["template"]["spec"]
        containers = pod.get("containers", []) + pod.get("initContainers", [])
        texts = _strings(containers)
        for ref in re.findall(r"'name': '([^']+)'", str([c.get("env") for c in containers])):
            if ref in configmaps:
                texts += _strings(configmaps[ref].get("data") or {})
        internal = [t for t in texts if re.search(r"\.svc(\.|:|$)|\.cluster\.local", t)]
        assert not internal, f"{name} dials {internal}"


def test_node_agent_dials_the_gateway_from_its_configmap() -> None:
    (agent,) = [d for d in _render(DEPLOY / "kubernetes") if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "gpufleet-node-agent"]
    pod = agent["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["GPUFLEET_GATEWAY"]["valueFrom"]["configMapKeyRef"] == {"name": "gpufleet-node-gateway",
                                                                       "key": "endpoint"}
    assert env["GPUFLEET_GATEWAY_SERVER_NAME"]["valueFrom"]["configMapKeyRef"] == {
        "name": "gpufleet-node-gateway", "key": "server-name"}
    assert "TEMPORAL_ADDRESS" not in env, "a node never dials Temporal itself"
    ca_path = Path(env["GPUFLEET_GATEWAY_CA"]["value"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(ca_path.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "gpufleet-node-gateway"
    assert volume["configMap"]["items"] == [{"key": "ca.crt", "path": ca_path.name}]


def test_konnectivity_agents_dial_out_on_443_on_the_node_agents_nodes() -> None:
    docs = _render(DEPLOY / "network" / "konnectivity")
    (agent,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (node_agent,) = [d for d in _render(DEPLOY / "kubernetes") if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "gpufleet-node-agent"]
    pod, theirs = agent["spec"]["template"]["spec"], node_agent["spec"]["template"]["spec"]
    assert pod["affinity"] == theirs["affinity"], "a tunnel on every node the node agent runs on"
    assert {"key": "gpufleet.io/unproven", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    (container,) = pod["containers"]
    args = dict(a.lstrip("-").split("=", 1) for a in container["args"] if "=" in a)
    assert args["agent-identifiers"] == "host=$(HOST_IP)"
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    env = {e["name"]: e["valueFrom"] for e in container["env"]}
    assert env["PROXY_SERVER_HOST"]["configMapKeyRef"]["name"] == config["metadata"]["name"]
    assert config["data"]["proxy-server-port"] == "443"
    assert "." in config["data"]["proxy-server-host"]
    volume = pod["volumes"][0]["projected"]["sources"][0]["serviceAccountToken"]
    assert volume["audience"] == "system:konnectivity-server"


def _tolerates(pod: dict, taint: dict) -> bool:
    return any((t.get("key") in (None, taint["key"]) if t.get("operator") == "Exists" else t.get("key") == taint["key"])
               and t.get("effect") in (None, "", taint["effect"]) for t in pod.get("tolerations") or [])


def test_the_cluster_daemons_tolerate_the_taints_a_gpu_node_keeps() -> None:
    """A GPU node registers with the taints of its JoinConfiguration and keeps the fleet taint
    for life: the tunnel agent tolerates all of them, CoreDNS the fleet taint but not unproven
    (and, its list replacing kubeadm's under server-side apply, kubeadm's control-plane one).
    The real scheduler's verdict: tests/realk8s/test_network.py."""
    from providers.cluster.bootstrap import JoinParams, read_join_configuration, render_user_data

    taints = read_join_configuration(render_user_data(JoinParams(
        api_server="10.0.0.1:6443", ca_data="Y2E=", token="abcdef.0123456789abcdef", node_name="gpu-1",
        provider_id="probe://1", site="probe")))["nodeRegistration"]["taints"]
    # The files as kustomize takes them (rendering them needs kubectl; the real tier renders them).
    (agent,) = [d for d in yaml.safe_load_all((DEPLOY / "network/konnectivity/agent.yaml").read_text())
                if d and d["kind"] == "DaemonSet"]
    for taint in taints:
        assert _tolerates(agent["spec"]["template"]["spec"], taint), taint
    (coredns,) = [d for d in yaml.safe_load_all((DEPLOY / "network/dns/coredns.yaml").read_text())
                  if d and d["kind"] == "Deployment"]
    pod = coredns["spec"]["template"]["spec"]
    assert _tolerates(pod, {"key": "gpufleet.io/demand", "effect": "NoSchedule"})
    assert not _tolerates(pod, {"key": "gpufleet.io/unproven", "effect": "NoSchedule"})
    assert _tolerates(pod, {"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"})


def test_the_api_servers_egress_goes_to_the_konnectivity_socket() -> None:
    control = DEPLOY / "network" / "konnectivity" / "control-plane"
    (egress,) = yaml.safe_load_all((control / "egress-selector-configuration.yaml").read_text())
    (server,) = yaml.safe_load_all((control / "konnectivity-server.yaml").read_text())
    assert egress["kind"] == "EgressSelectorConfiguration"
    (selection,) = egress["egressSelections"]
    assert selection["name"] == "cluster"
    args = dict(a.lstrip("-").split("=", 1) for a in server["spec"]["containers"][0]["args"] if "=" in a)
    assert selection["connection"]["transport"]["uds"]["udsName"] == args["uds-name"]
    assert args["proxy-strategies"].startswith("destHost")
    assert args["authentication-audience"] == "system:konnectivity-server"


def test_the_server_count_is_set_by_hand_for_an_ha_control_plane_and_agents_get_no_lease_grants() -> None:
    """An agent stops dialling the load balancer once it holds as many distinct servers as the
    servers' ``--server-count`` (apiserver-network-proxy v0.31.2); with 1 behind a three-host
    kubeadm HA control plane, `kubectl logs/exec/port-forward` fail through two API servers of
    three. The count is shipped for that typical HA plane and set by hand; ``gpufleet cluster
    check`` compares it with the servers running. Agents do not count the servers' Leases
    instead: that would grant every GPU node's agent token (a hostile node's) list and watch of
    all Leases in kube-system, and every agent would watch every Lease there."""
    konnectivity = DEPLOY / "network" / "konnectivity"
    (server_pod,) = yaml.safe_load_all((konnectivity / "control-plane" / "konnectivity-server.yaml").read_text())
    (server,) = server_pod["spec"]["containers"]
    (agent_set,) = [d for d in yaml.safe_load_all((konnectivity / "agent.yaml").read_text())
                    if d and d["kind"] == "DaemonSet"]
    (agent,) = agent_set["spec"]["template"]["spec"]["containers"]
    server_args = dict(a.lstrip("-").split("=", 1) for a in server["args"] if "=" in a)
    assert server_args.get("server-count") == "3", "one server per host of a three-host control plane"
    flags = [a.split("=", 1)[0] for a in server["args"] + agent["args"]]
    assert not {"--enable-lease-controller", "--count-server-leases"} & set(flags), flags
    # No Role or ClusterRole shipped for Konnectivity names Leases.
    for path in sorted(konnectivity.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for rule in (doc or {}).get("rules") or []:
                assert "leases" not in rule.get("resources", []), (path.name, rule)


def test_overlay_templates_listen_only_at_the_hub() -> None:
    wireguard = DEPLOY / "network" / "wireguard"
    hub, spoke = (wireguard / "hub.conf.template").read_text(), (wireguard / "spoke.conf.template").read_text()
    assert re.search(r"^ListenPort = 443$", hub, re.MULTILINE)
    hub_peer = spoke.split("[Peer]")[1]
    assert "Endpoint = ${HUB_PUBLIC_NAME}:443" in hub_peer and "PersistentKeepalive" in hub_peer


# -- Konnectivity in `gpufleet cluster check` -----------------------------------------------------
# Fake: the report lists every gpufleet node of the cluster and every kube-system pod; the real
# tier's control plane is shared by all its tests, whose nodes would be in any such list.
def _tunnels(fake, nodes=("gpu-1", "gpu-2"), agents_on=("gpu-1", "gpu-2"), server=True):
    fake.add_node("cp-1", {"node-role.kubernetes.io/control-plane": ""})
    for node in nodes:
        fake.add_node(node, {LABEL_SITE: "site-a"})
    if server:  # the upstream static pod: no labels, mirror named <name>-<node>
        fake.add_pod("cp-1", "konnectivity-server-cp-1", "kube-system", owner_kind="", mirror=True)
        fake.set_pod_ready("kube-system", "konnectivity-server-cp-1")
    for node in agents_on:
        name = f"konnectivity-agent-{node}"
        fake.add_pod(node, name, "kube-system", {"k8s-app": "konnectivity-agent"}, owner_kind="DaemonSet")
        fake.set_pod_ready("kube-system", name)


def test_tunnels_found(fake):
    # Fake: the report's verdict covers every gpufleet node and kube-system pod of the cluster (see above).
    _tunnels(fake)
    report = check_tunnels(fake.api_client())
    assert report.ok and report.servers == ["konnectivity-server-cp-1"]
    assert report.agents == {"gpu-1": "konnectivity-agent-gpu-1", "gpu-2": "konnectivity-agent-gpu-2"}


def test_a_node_without_a_ready_agent_is_named(fake):
    # Fake: the report's verdict covers every gpufleet node and kube-system pod of the cluster (see above).
    _tunnels(fake, nodes=("gpu-1", "gpu-2", "gpu-3"), agents_on=("gpu-1", "gpu-2"))
    fake.set_pod_ready("kube-system", "konnectivity-agent-gpu-2", ready=False)
    report = check_tunnels(fake.api_client())
    assert not report.ok and report.missing == ["gpu-2", "gpu-3"]


def test_no_server_is_not_ok(fake):
    # Fake: the report's verdict covers every gpufleet node and kube-system pod of the cluster (see above).
    _tunnels(fake, server=False)
    report = check_tunnels(fake.api_client())
    assert not report.ok and report.servers == [] and not report.missing


def test_a_gpu_nodes_own_pod_named_like_a_server_is_no_server(fake):
    """A node is hostile, and its kubelet may publish a mirror pod of any name in kube-system:
    one posing as a Konnectivity server neither stands in for a missing server nor changes the
    count the real servers' --server-count is held to."""
    # Fake: the report's verdict covers every gpufleet node and kube-system pod of the cluster (see above).
    _tunnels(fake)
    fake.add_pod("gpu-1", "konnectivity-server-gpu-1", "kube-system", owner_kind="", mirror=True)
    fake.set_pod_ready("kube-system", "konnectivity-server-gpu-1")
    report = check_tunnels(fake.api_client())
    assert report.servers == ["konnectivity-server-cp-1"] and not report.miscounted and report.ok


def test_cli_reports_the_tunnels(fake, tmp_path):
    # Fake: the report's verdict covers every gpufleet node and kube-system pod of the cluster (see above).
    install_admission_policy(fake)
    _tunnels(fake, nodes=("gpu-1", "gpu-2"), agents_on=("gpu-1",))
    kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
    result = runner.invoke(cluster_app, ["check", "--kubeconfig", kubeconfig], env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    assert "all" in result.output and "permissions granted" in result.output
    line = next(line for line in result.output.splitlines() if "konnectivity-agent" in line)
    assert "MISSING" in line and "on 1 of 2 gpufleet nodes" in line and "gpu-2" in line
    assert "tunnels missing" in result.output
    fake.add_pod("gpu-2", "konnectivity-agent-gpu-2", "kube-system", {"k8s-app": "konnectivity-agent"})
    fake.set_pod_ready("kube-system", "konnectivity-agent-gpu-2")
    result = runner.invoke(cluster_app, ["check", "--kubeconfig", kubeconfig], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "tunnels running" in result.output


# -- a site is a zone -------------------------------------------------------------------------------
async def test_a_joined_node_carries_its_site_as_zone_in_the_sim(stack) -> None:
    handle = await stack.start_join({"site": "site-a"}, request="zone")
    (joined,) = NodeJoinResult.model_validate(await handle.result()).nodes
    node = stack.cluster.get_node(joined.node_name)
    assert node.labels[LABEL_ZONE] == node.labels[LABEL_SITE] == "site-a"


# -- Services that stay inside a site --------------------------------------------------------------
def test_only_the_model_wide_service_spans_sites_and_it_prefers_close() -> None:
    per_site = render_service("llama-3-8b", "site-a", "gpufleet")
    assert per_site["spec"]["selector"][LABEL_SITE] == "site-a"
    wide = render_model_service("llama-3-8b", "gpufleet")
    assert LABEL_SITE not in wide["spec"]["selector"] and wide["spec"]["selector"][LABEL_MODEL] == "llama-3-8b"
    assert wide["spec"]["trafficDistribution"] == "PreferClose"
    assert wide["spec"].get("type", "ClusterIP") == "ClusterIP"


def test_a_replica_never_straddles_sites() -> None:
    deployment = render_deployment(ServingSpec(model="m", site="site-a", image="i", replicas=3), "gpufleet")
    assert deployment["spec"]["selector"]["matchLabels"][LABEL_SITE] == "site-a"
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {LABEL_SITE: "site-a"}


# -- the node gateway in the fleet config ------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["gateway.fleet.example.com:443", "203.0.113.7:443"])
def test_node_gateway_takes_a_public_endpoint(endpoint):
    config = parse_config({"node_gateway": {"endpoint": endpoint, "ca": {"file": "/etc/ca.pem"}}})
    assert config.node_gateway.endpoint == endpoint


@pytest.mark.parametrize("endpoint", ["temporal-frontend.temporal.svc:7233", "gpufleet-gateway:443",
                                      "gw.gpufleet.svc.cluster.local:443", "gw.example.com",
                                      "https://gw.example.com:443", "gw.example.com:70000"])
def test_node_gateway_refuses_internal_names_and_non_host_ports(endpoint):
    with pytest.raises(ConfigError) as caught:
        parse_config({"node_gateway": {"endpoint": endpoint, "ca": {"file": "/etc/ca.pem"}}})
    assert any(p.startswith("node_gateway.endpoint:") for p in caught.value.problems), caught.value.problems


def test_node_gateway_needs_its_ca():
    with pytest.raises(ConfigError) as caught:
        parse_config({"node_gateway": {"endpoint": "gw.example.com:443"}})
    assert caught.value.problems == ["node_gateway.ca: Field required"]


def _ca_pem() -> str:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpufleet node gateway CA")])
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def test_node_config_renders_the_configmap_the_daemonset_reads(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text(_ca_pem())
    fleet = yaml.safe_load(write_fleet(tmp_path).read_text())
    fleet["node_gateway"] = {"endpoint": "gateway.fleet.example.com:443", "ca": {"file": str(ca)}}
    (tmp_path / "sites.yaml").write_text(yaml.safe_dump(fleet))
    result = runner.invoke(cluster_app, ["node-config", "--config", str(tmp_path / "sites.yaml")])
    assert result.exit_code == 0, result.output
    doc = yaml.safe_load(result.stdout)
    assert doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "gpufleet-node-gateway"
    assert doc["data"]["endpoint"] == "gateway.fleet.example.com:443"
    assert doc["data"]["ca.crt"] == ca.read_text()

    ca.write_text("not a certificate")
    result = runner.invoke(cluster_app, ["node-config", "--config", str(tmp_path / "sites.yaml")])
    assert result.exit_code == 2 and "not a PEM certificate" in result.output


def test_node_config_without_a_gateway_exits_2(tmp_path):
    result = runner.invoke(cluster_app, ["node-config", "--config", str(write_fleet(tmp_path))])
    assert result.exit_code == 2 and "node_gateway: missing" in result.output


# -- the README ------------------------------------------------------------------------------------
def test_the_readme_has_the_network_model_and_a_checklist_whose_paths_exist():
    section = (ROOT / "docs" / "production" / "network.md").read_text()  # moved from the README
    for party in ("kubelet", "node agent", "Konnectivity agent", "API server", "node gateway", "front door",
                  "object store"):
        assert party in section, party
    steps = re.findall(r"^\s*(\d+)\. ", section[section.index("**Checklist"):], re.MULTILINE)
    assert [int(s) for s in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 8
    for path in set(re.findall(r"deploy/[\w./-]+[\w]", section)):
        assert (ROOT / path).exists(), path
    assert "gpufleet cluster check" in section and "gpufleet cluster node-config" in section
