"""The cluster's own daemons of ``deploy/network`` run where they must: on GPU nodes, which keep
gpufleet's fleet taint for their whole life (issue 35).

The manifests are applied unchanged, as ``deploy/network/README.md`` says to: the Konnectivity
kustomization with ``kubectl apply -k``, and the CoreDNS patch server-side over the CoreDNS that
``kubeadm init phase addon coredns`` installs. The GPU nodes are Node objects registered with the
taints of the JoinConfiguration the shipped cloud-init renders (a real machine registering with
them, and keeping the fleet taint after admission, is tests/realk8s/test_placement.py); the real
DaemonSet controller and kube-scheduler decide, no kubelet is needed for that.

``gpufleet cluster check`` also reads each Konnectivity server's ``--server-count`` from its mirror
pod and flags one that is not the number of servers running.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli.cluster import cluster_app
from fleet.cluster import FLEET_TAINT, LABEL_SITE, LABEL_ZONE, UNPROVEN_TAINT
from providers.cluster.bootstrap import JoinParams, read_join_configuration, render_user_data
from providers.cluster.check import TunnelReport, check_tunnels
from tests.realk8s.cluster import RealCluster
from tests.realk8s.test_adapter import _kubeconfig
from tests.realk8s.test_adapter_objects import nodes  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parents[2]
NETWORK = REPO / "deploy" / "network"
CONTROL_PLANE_ROLE = "node-role.kubernetes.io/control-plane"


def registration_taints() -> list[dict]:
    """The taints a GPU node registers with: the JoinConfiguration of the shipped cloud-init."""
    user_data = render_user_data(JoinParams(api_server="10.0.0.1:6443", ca_data="Y2E=",
                                            token="abcdef.0123456789abcdef", node_name="gpu-probe",
                                            provider_id="probe://1", site="probe"))
    taints = read_join_configuration(user_data)["nodeRegistration"]["taints"]
    assert {f"{t['key']}:{t['effect']}" for t in taints} >= {UNPROVEN_TAINT, FLEET_TAINT}
    return taints


def gpu_labels(site: str) -> dict[str, str]:
    """What a joined GPU node carries: the kubelet's own, the site gpufleet set at the join."""
    return {"kubernetes.io/os": "linux", LABEL_SITE: site, LABEL_ZONE: site}


def kube_system_pods(real: RealCluster, selector: str) -> list[dict]:
    status, listed = real.request("GET", f"/api/v1/namespaces/kube-system/pods?labelSelector={selector}", admin=True)
    assert status == 200, listed
    return [p for p in listed["items"] if not p["metadata"].get("deletionTimestamp")]


def wait_for(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while True:
        if found := predicate():
            return found
        assert time.monotonic() < deadline, f"{what}: not within {seconds:.0f} s"
        time.sleep(0.2)


def bound(real: RealCluster, namespace: str, name: str) -> str:
    """The node the scheduler bound the pod to, or '' (and the scheduler's refusal raised)."""
    status, pod = real.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}", admin=True)
    assert status == 200, pod
    for condition in pod["status"].get("conditions") or []:
        if condition["type"] == "PodScheduled" and condition.get("reason") == "Unschedulable":
            raise AssertionError(f"{name}: {condition.get('message')}")
    return pod["spec"].get("nodeName") or ""


@pytest.fixture
def network_applied(real_cluster: RealCluster):
    """deploy/network's Konnectivity and CoreDNS as an operator applies them; the DaemonSet and
    CoreDNS taken away afterwards (the tier's other tests boot GPU machines of their own)."""
    real_cluster.kubectl("apply", "--server-side", "-k", str(NETWORK / "konnectivity"))
    config = real_cluster.root / "kubeadm.yaml"
    real_cluster.kubeadm("init", "phase", "addon", "coredns", "--config", str(config),
                         "--kubeconfig", str(real_cluster.admin_kubeconfig))
    patch = real_cluster.kubectl("kustomize", str(NETWORK / "dns")).stdout
    real_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=patch)
    try:
        yield real_cluster
    finally:
        real_cluster.kubectl("delete", "-n", "kube-system", "daemonset/konnectivity-agent", "deployment/coredns",
                             "--wait=false", "--ignore-not-found")


def test_the_konnectivity_agent_and_coredns_run_on_gpu_nodes_that_keep_the_fleet_taint(network_applied, nodes) -> None:
    real = network_applied
    site, unique = "net-site", uuid.uuid4().hex[:6]
    taints = registration_taints()
    admitted_taints = [t for t in taints if f"{t['key']}:{t['effect']}" != UNPROVEN_TAINT]
    # A node still proving itself (both taints) and one admitted (the fleet taint, for good).
    proving = nodes(f"gpu-proving-{unique}", gpu_labels(site), taints=taints)
    admitted = nodes(f"gpu-admitted-{unique}", gpu_labels(site), taints=admitted_taints)
    host = nodes(f"control-plane-{unique}", {"kubernetes.io/os": "linux", CONTROL_PLANE_ROLE: ""},
                 taints=[{"key": CONTROL_PLANE_ROLE, "effect": "NoSchedule"}])

    # The Konnectivity agent: one per GPU node, unproven or admitted (`kubectl logs` works while a
    # smoke test runs), bound there by the real scheduler; none on the control-plane host.
    def agents() -> dict[str, str]:
        placed = {}
        for pod in kube_system_pods(real, "k8s-app%3Dkonnectivity-agent"):
            wanted = ((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(
                "requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [{}])
            targets = [f["values"][0] for t in wanted for f in t.get("matchFields") or []]
            if targets and targets[0] in (proving, admitted, host):
                placed[targets[0]] = pod["metadata"]["name"]
        return placed if {proving, admitted} <= set(placed) else None

    try:
        placed = wait_for(agents, 30, "a Konnectivity agent pod for each GPU node (the DaemonSet controller "
                                      "makes none for a node whose taints its pods do not tolerate)")
    except AssertionError:
        _, ds = real.request("GET", "/apis/apps/v1/namespaces/kube-system/daemonsets/konnectivity-agent", admin=True)
        raise AssertionError(f"DaemonSet status {ds.get('status')}; tolerations "
                             f"{ds['spec']['template']['spec'].get('tolerations')}") from None
    assert host not in placed
    for node in (proving, admitted):
        assert wait_for(lambda n=node: bound(real, "kube-system", placed[n]), 30, f"agent on {node} bound") == node

    # CoreDNS, patched: its Deployment's pod template, pinned to one node the way the DaemonSet
    # controller pins its pods, is bound by the scheduler to the admitted GPU node and still to a
    # control-plane host (the patch's tolerations replace kubeadm's list), never to a node that
    # has not passed its smoke test.
    _, deployment = real.request("GET", "/apis/apps/v1/namespaces/kube-system/deployments/coredns", admin=True)
    template = deployment["spec"]["template"]
    tolerated = {(t.get("key"), t.get("effect")) for t in template["spec"]["tolerations"]}
    assert {("gpufleet.io/demand", "NoSchedule"), (CONTROL_PLANE_ROLE, "NoSchedule")} <= tolerated, tolerated
    verdicts = {}
    for node in (admitted, host, proving):
        name = f"coredns-probe-{node}"[:63]
        spec = {**template["spec"], "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}}
        status, answer = real.request("POST", "/api/v1/namespaces/kube-system/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"gpufleet-test": "coredns-probe"}},
            "spec": spec}, admin=True)
        assert status == 201, answer
        verdicts[node] = name
    try:
        for node in (admitted, host):
            assert wait_for(lambda n=node: bound(real, "kube-system", verdicts[n]), 30, f"CoreDNS on {node}") == node

        def refused() -> str:
            try:
                where = bound(real, "kube-system", verdicts[proving])
            except AssertionError as error:
                return str(error)
            assert not where, f"CoreDNS bound to {where}, which has not passed its smoke test"
            return ""

        # 0/N nodes: the pinned one "had untolerated taint(s)" (the scheduler names no key).
        assert "1 node(s) had untolerated taint" in wait_for(refused, 30, "CoreDNS refused on the unproven node")
    finally:
        real.kubectl("delete", "pods", "-n", "kube-system", "-l", "gpufleet-test=coredns-probe", "--wait=false")


# -- the Konnectivity servers' --server-count, as `gpufleet cluster check` reads it ------------
SERVER_MANIFEST = NETWORK / "konnectivity" / "control-plane" / "konnectivity-server.yaml"


def server_mirror_pod(real: RealCluster, node: str, server_count: str | None) -> str:
    """The mirror pod a control-plane host's kubelet publishes for the shipped static pod (its
    spec, named ``<name>-<node>``, bound there, owned by the Node), with ``--server-count`` set to
    ``server_count`` (None: no flag, the upstream default), reported Running and Ready."""
    (pod,) = yaml.safe_load_all(SERVER_MANIFEST.read_text())
    (container,) = pod["spec"]["containers"]
    args = [a for a in container["args"] if not a.startswith("--server-count")]
    container["args"] = args + ([f"--server-count={server_count}"] if server_count is not None else [])
    _, owner = real.request("GET", f"/api/v1/nodes/{node}", admin=True)
    name = f"{pod['metadata']['name']}-{node}"
    pod["metadata"] |= {"name": name, "annotations": {"kubernetes.io/config.mirror": uuid.uuid4().hex,
                                                      "kubernetes.io/config.source": "file"},
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node,
                                             "uid": owner["metadata"]["uid"], "controller": True}]}
    pod["spec"] |= {"nodeName": node, "tolerations": [{"operator": "Exists", "effect": "NoExecute"}]}
    status, answer = real.request("POST", "/api/v1/namespaces/kube-system/pods", pod, admin=True)
    assert status == 201, answer
    status, answer = real.request("PATCH", f"/api/v1/namespaces/kube-system/pods/{name}/status", {"status": {
        "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
        admin=True, content_type="application/merge-patch+json")
    assert status == 200, answer
    return name


def delete_pods(real: RealCluster, names: list[str]) -> None:
    """Gone at once (no kubelet confirms a bound pod's graceful end here)."""
    for name in names:
        real.request("DELETE", f"/api/v1/namespaces/kube-system/pods/{name}", {"gracePeriodSeconds": 0}, admin=True)
    wait_for(lambda: all(real.request("GET", f"/api/v1/namespaces/kube-system/pods/{n}", admin=True)[0] == 404
                         for n in names), 30, "server pods deleted")


def test_cluster_check_flags_servers_whose_server_count_is_not_the_number_running(real_cluster, nodes,
                                                                                 tmp_path) -> None:
    """Two control-plane hosts' Konnectivity servers that each tell agents `--server-count` 1 (one
    by the flag, one by the upstream default): an agent holding one server stops dialling, so
    `kubectl logs/exec/port-forward` fail through the other host's API server. The check reads
    the count from the mirror pods it already lists (the control plane's own token: no new
    grant), flags both and names the number running; declaring 2, both are ok.

    The pods are the shipped static pod's spec as a kubelet mirrors it, not running servers: the
    real proxy-server cannot be built here (the Go module sigs.k8s.io/apiserver-network-proxy is
    refused by the module proxy, 403); what it does with the count is its v0.31.2 source
    (deploy/network/README.md)."""
    real, unique = real_cluster, uuid.uuid4().hex[:6]
    hosts = [nodes(f"cp-{side}-{unique}", {"kubernetes.io/os": "linux", CONTROL_PLANE_ROLE: ""},
                   taints=[{"key": CONTROL_PLANE_ROLE, "effect": "NoSchedule"}]) for side in "ab"]
    token = real.service_account_token("gpufleet", "gpufleet-control-plane")
    kubeconfig = _kubeconfig(real, tmp_path, token)

    def checked() -> tuple[TunnelReport, str, str]:
        """The report, the CLI's --server-count row, and its whole output."""
        report = check_tunnels(real.api_client(token))
        result = CliRunner().invoke(cluster_app, ["check", "--kubeconfig", kubeconfig], env={"COLUMNS": "400"})
        assert result.exit_code in (0, 1), result.output
        (line,) = [line for line in result.output.splitlines() if "--server-count" in line and "declares" in line]
        return report, line, result.output

    servers = [server_mirror_pod(real, hosts[0], "1"), server_mirror_pod(real, hosts[1], None)]
    try:
        report, line, output = checked()
        assert report.servers == sorted(servers) and report.server_counts == dict.fromkeys(sorted(servers), "1")
        assert report.miscounted == report.server_counts and not report.ok
        assert "WRONG" in line and "2 running" in line and "kubectl logs/exec/port-forward fail" in line
        assert "set --server-count=2" in output
        assert all(f"{name} declares 1" in line for name in servers), line
        delete_pods(real, servers)

        servers = [server_mirror_pod(real, host, "2") for host in hosts]
        report, line, output = checked()
        assert report.server_counts == dict.fromkeys(sorted(servers), "2") and not report.miscounted
        assert "ok" in line and "WRONG" not in line and "each of the 2 running server(s) declares 2" in line
        assert "server count wrong" not in output
    finally:
        delete_pods(real, servers)
