"""The node agent as its DaemonSet starts it completes a health watch through the node gateway.

The agent is the Pod the real DaemonSet controller made of ``deploy/kubernetes/node-agent.yaml``
(applied unchanged) for a machine that joined from its user data and was labelled as NodeJoin
labels it, bound to that node by the real scheduler, run by ``tests/realk8s/pod.py`` as the
kubelet would run its container: its command and env (``fieldRef: spec.nodeName``, the
``gpufleet-node-gateway`` ConfigMap as ``gpufleet cluster node-config`` printed it and kubectl
applied it, ``GPUFLEET_METRICS_PORT`` and ``GPUFLEET_SPOT_NOTICE`` as shipped), the ConfigMap's CA,
the real kubelet's own ``/var/lib/kubelet/pki`` and the flags kubeadm's join code wrote for it
(``hostPath``s) at their mountPaths, read-only root, uid 0 with
CAP_SYS_ADMIN only, its cgroups holding the manifest's memory limit, a network namespace of its
own in which the gateway's public endpoint (a name only the ConfigMap gives) leads to the
gateway's Service, and its metrics port served back to the host, where the test scrapes what
the dashboard's "Node agents running" panel reads.

The gateway is its own Deployment's processes too (``tests/realk8s/pod.py``): each of the
Deployment's replicas, a Pod the real ReplicaSet controller made from
``deploy/kubernetes/node-gateway.yaml`` and the real scheduler bound to a control-plane host, on
a pod network at the address its (stand-in) kubelet reported, where the name
``GPUFLEET_GATEWAY_PEERS`` gives answers what the real EndpointSlice controller made of the shipped
peer Service (so the replicas read each other's usage reports, as in a cluster, and serve
``gpufleet_gateway_peers_heard``), in cgroups holding its ``resources``, its command and env,
its Secrets and ConfigMap (created as an operator creates them, read back from the API server)
bind-mounted at their mountPaths in a mount namespace of its own, and a real bound
service-account token at ``/var/run/secrets/kubernetes.io/serviceaccount``, from which the
Kubernetes client's in-cluster loader asks the real API server, as the gateway's service
account, whether the node is bound to that key. Its Temporal frontend
(``temporal-frontend.temporal.svc:7233``, mutual TLS from ``gpufleet-temporal-client``) is a
TLS-terminating proxy in front of the dev server (``tests/test_temporal_manifests.py``): the
rest of the test drives that dev server, and the real server's own mutual TLS, as
deploy/temporal/values.yaml ships it, is proven in ``tests/realtemporal/test_tls.py``. The
nodes reach the replicas through one address, as through the gateway's Service (``ServiceFront``).
"""

from __future__ import annotations

import asyncio
import http.client
import secrets
import subprocess
import sys
import textwrap
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote

import yaml
from kubernetes.utils import parse_quantity
from prometheus_client.parser import text_string_to_metric_families
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

from fleet.cluster import LABEL_GPU_PRODUCT, LABEL_PROVIDER, LABEL_REGION, LABEL_SITE, UNPROVEN_TAINT
from fleet.messages.repair import NodeWatchInput, NodeWatchResult
from fleet.naming import node_queue
from tests.realk8s.cluster import RealCluster
from tests.realk8s.pod import PodNetwork, ServiceFront, created_pods, daemon_pod, run_pod
from tests.realk8s.test_adapter_objects import nodes  # noqa: F401 - a fixture
from tests.realk8s.test_join import RealJoining, one, wait_for  # noqa: F401
from tests.test_observability import dashboard, referenced_metrics
from tests.test_temporal_manifests import frontend_pki
from tests.test_temporal_tls import start_tls_proxy
from workers.gateway.pki import Pki

REPO = Path(__file__).resolve().parents[2]
#: The node gateway's public endpoint (``node_gateway.endpoint``: its Service's load balancer,
#: port 443): a name nothing here resolves but the agent pod's /etc/hosts.
GATEWAY_ENDPOINT = "nodes.gpufleet.example:443"
#: linux/capability.h
CAP_SYS_ADMIN = 21
#: kubeadm's label and taint of a control-plane host, where the gateway's pods run.
CONTROL_PLANE_ROLE = "node-role.kubernetes.io/control-plane"
#: The pod network's addresses the stand-in kubelet gives the gateway's pods (a CNI's pod CIDR).
POD_ADDRESSES = "10.244.0.{}"

#: The one thing not as on a real node: this machine has no GPU, so ``pynvml`` (which the
#: agent's NvmlBackend imports) is a stand-in reporting two healthy GPUs, bind-mounted over the
#: image's module inside the pod (as on a GPU node the NVIDIA runtime mounts the driver's NVML
#: into the container): the pod's env and PYTHONPATH stay the image's. Everything above NVML
#: (the backend, the watch, the worker, TLS, the gateway) is the shipped code.
FAKE_PYNVML = textwrap.dedent('''
    """pynvml stand-in for tests/realk8s/test_node_agent.py: two healthy GPUs, no XID events."""
    import time
    from types import SimpleNamespace


    class NVMLError(Exception):
        pass


    class NVMLError_Timeout(NVMLError):
        pass


    NVML_NVLINK_MAX_LINKS = 0


    def nvmlInit():
        pass


    def nvmlDeviceGetCount():
        return 2


    def nvmlDeviceGetHandleByIndex(index):
        return SimpleNamespace(index=index)


    def nvmlDeviceGetUUID(handle):
        return f"GPU-stand-in-{handle.index}"


    def nvmlDeviceGetIndex(handle):
        return handle.index


    def nvmlEventSetCreate():
        return object()


    def nvmlDeviceRegisterEvents(*_args):
        pass


    def nvmlEventSetWait(_events, timeout_ms):
        time.sleep(min(timeout_ms, 200) / 1000)
        raise NVMLError_Timeout()


    def __getattr__(name):
        if name.startswith("NVML_"):
            return 0
        if name.startswith("nvml"):  # a query a real GPU may not support either
            def unsupported(*_args):
                raise NVMLError(f"{name}: not supported")
            return unsupported
        raise AttributeError(name)
''')


@workflow.defn(sandboxed=False)
class OneHealthWatch:
    """What the Node entity does each round, once: ``watch_node`` on the node's own queue."""

    @workflow.run
    async def run(self, node_name: str) -> NodeWatchResult:
        return await workflow.execute_activity(
            "watch_node", NodeWatchInput(node_name=node_name, max_wait_seconds=1), task_queue=node_queue(node_name),
            result_type=NodeWatchResult, start_to_close_timeout=timedelta(seconds=60),
            heartbeat_timeout=timedelta(seconds=30), retry_policy=RetryPolicy(maximum_attempts=20))


def rendered_node_config(tmp: Path, endpoint: str, ca: bytes) -> str:
    """The ConfigMap as an operator makes it: ``gpufleet cluster node-config`` on a fleet
    config whose ``node_gateway`` names the gateway's endpoint and CA."""
    (tmp / "gateway-ca.pem").write_bytes(ca)
    config = tmp / "sites.yaml"
    config.write_text(yaml.safe_dump({"mode": "real", "accounts": [], "sites": [], "node_gateway": {
        "endpoint": endpoint, "ca": {"file": str(tmp / "gateway-ca.pem")}}}))
    done = subprocess.run([sys.executable, "-m", "cli.main", "cluster", "node-config", "--config", str(config)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def create_gateway_objects(cluster: RealCluster, tmp: Path, gateway_pki: Pki, temporal_secret: Path,
                           public_hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> None:
    """What node-gateway.yaml says an operator creates: its server certificate (for
    ``public_hosts``, its public endpoint's), the cluster CA, the key its replicas bind task
    tokens with, the control plane's Temporal client certificate, and the fleet config (real mode)."""
    cert, key = gateway_pki.server_cert(public_hosts)
    (tmp / "gateway.crt").write_bytes(cert)
    (tmp / "gateway.key").write_bytes(key)
    (tmp / "cluster-ca.crt").write_bytes(cluster.ca_pem)
    (tmp / "gateway-token.key").write_text(secrets.token_hex(32) + "\n")
    (tmp / "fleet.yaml").write_text(yaml.safe_dump({"mode": "real", "accounts": [], "sites": []}))
    for kind in (["secret", "tls", "gpufleet-node-gateway-tls", f"--cert={tmp / 'gateway.crt'}",
                  f"--key={tmp / 'gateway.key'}"],
                 ["secret", "generic", "gpufleet-cluster-ca", f"--from-file=ca.crt={tmp / 'cluster-ca.crt'}"],
                 ["secret", "generic", "gpufleet-node-gateway-token-key",
                  f"--from-file=current={tmp / 'gateway-token.key'}"],
                 ["secret", "generic", "gpufleet-temporal-client",
                  *(f"--from-file={name}={temporal_secret / name}" for name in ("tls.crt", "tls.key", "ca.crt"))],
                 ["configmap", "gpufleet-config", f"--from-file=sites.yaml={tmp / 'fleet.yaml'}"]):
        made = cluster.kubectl("-n", "gpufleet", "create", *kind, "--dry-run=client", "-o", "yaml")
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=made.stdout)


def node_agent_container() -> dict:
    """The DaemonSet's container as shipped (what kubectl applied unchanged)."""
    docs = yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "node-agent.yaml").read_text())
    (container,) = next(d for d in docs if d and d["kind"] == "DaemonSet")["spec"]["template"]["spec"]["containers"]
    return container


def agents_running_gauge(address: str) -> float:
    """What the dashboard's "Node agents running" panel sums, as the agent at ``address`` serves it."""
    (panel,) = [p for p in dashboard()["panels"] if p.get("title") == "Node agents running"]
    (metric,) = referenced_metrics(panel["targets"][0]["expr"])
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
        page = answer.read().decode()
    return next(s.value for f in text_string_to_metric_families(page) for s in f.samples if s.name == metric)


def served(address: str, metric: str) -> float | None:
    """A sample's value on the page the worker at ``address`` serves (None: not on it, or no page
    yet: a gateway serves /metrics a moment after its nodes' port, which its readiness probes)."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
            page = answer.read().decode()
    except (OSError, http.client.HTTPException):
        return None
    return next((s.value for f in text_string_to_metric_families(page) for s in f.samples if s.name == metric), None)


async def until_served(address: str, metric: str, value: float, what: str, seconds: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while (now := await asyncio.to_thread(served, address, metric)) != value:
        assert asyncio.get_running_loop().time() < deadline, f"{what}: {metric} is {now}, not {value}"
        await asyncio.sleep(0.5)


def scheduled_and_reported(cluster: RealCluster, pods: list[dict], host: str) -> list[dict]:
    """The replicas once the real scheduler bound each to the control-plane host ``host``, each with
    a pod address and Ready, as its kubelet reports them (a stand-in here, which reports them before
    the processes start: each replica's cluster DNS is its /etc/hosts, written at its start).

    Found by their labels, not by ``pods``' names: a pod the ReplicaSet replaced meanwhile (the pod
    garbage collector deleting one that the tier's earlier tests left bound to a host since gone)
    is the replica now, of the same template."""
    app = pods[0]["metadata"]["labels"]["app.kubernetes.io/name"]
    listing = "/api/v1/namespaces/gpufleet/pods?labelSelector=" + quote(f"app.kubernetes.io/name={app}")

    def bound() -> list[dict] | None:
        found = [p for p in cluster.request("GET", listing, admin=True)[1].get("items", [])
                 if p["spec"].get("nodeName") == host and not p["metadata"].get("deletionTimestamp")]
        return sorted(found, key=lambda p: p["metadata"]["name"]) if len(found) == len(pods) else None

    reported = []
    for number, pod in enumerate(wait_for(bound, 60, f"{len(pods)} {app} pods bound to {host}")):
        path = f"/api/v1/namespaces/gpufleet/pods/{pod['metadata']['name']}"
        address = POD_ADDRESSES.format(10 + number)
        status, answer = cluster.request("PATCH", path + "/status", {"status": {
            "phase": "Running", "podIP": address, "podIPs": [{"ip": address}],
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]}},
            admin=True, content_type="application/merge-patch+json")
        assert status == 200, answer
        reported.append(answer)
    return reported


def ready_addresses(cluster: RealCluster, name: str, count: int) -> list[str]:
    """What the cluster DNS answers for the headless Service behind ``name``
    (``<service>.<namespace>.svc``): its EndpointSlices' ready addresses, once there are ``count``."""
    service, namespace = name.split(".")[:2]
    query = quote(f"kubernetes.io/service-name={service}")

    def found() -> list[str] | None:
        status, slices = cluster.request(
            "GET", f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices?labelSelector={query}", admin=True)
        assert status == 200, slices
        addresses = sorted(a for s in slices["items"] for e in s.get("endpoints") or []
                           if (e.get("conditions") or {}).get("ready") for a in e["addresses"])
        return addresses if len(addresses) == count else None

    return wait_for(found, 60, f"{count} ready endpoints of {service}")


def unbind(cluster: RealCluster, host: str) -> None:
    """The host gone and the pods bound to it with it: their ReplicaSets make new, Pending ones
    (the package's cluster has no control-plane host, as before)."""
    cluster.request("DELETE", f"/api/v1/nodes/{host}", admin=True)
    _, listed = cluster.request("GET", "/api/v1/namespaces/gpufleet/pods", admin=True)
    for pod in listed["items"]:
        if pod["spec"].get("nodeName") == host:
            cluster.request("DELETE", f"/api/v1/namespaces/gpufleet/pods/{pod['metadata']['name']}"
                                      "?gracePeriodSeconds=0", admin=True)


def gateway_deployment() -> dict:
    """The Deployment as shipped (what kubectl applied unchanged), for what the test expects of it."""
    docs = yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "node-gateway.yaml").read_text())
    return next(d for d in docs if d and d["kind"] == "Deployment")


async def one_health_watch(client, queue: str, node_name: str, log: Path, gateways) -> NodeWatchResult:
    async with Worker(client, task_queue=queue, workflows=[OneHealthWatch]):
        # The entity's id: the gateway admits a node whose Node entity runs.
        handle = await client.start_workflow(OneHealthWatch.run, node_name, id=f"node/{node_name}", task_queue=queue)
        try:
            return await asyncio.wait_for(handle.result(), 120)
        except asyncio.TimeoutError:
            raise AssertionError(f"no health watch within 120 s:\n{log.read_text()[-4000:]}\n" + "".join(
                f"gateway {n}:\n{g.log_tail()}\n" for n, g in enumerate(gateways))) from None


async def test_the_node_agent_started_from_its_daemonset_completes_a_health_watch_through_the_gateway(
        one: RealJoining, temporal_env, tmp_path, nodes) -> None:  # noqa: F811
    """Through either of the gateway Deployment's replicas: both Pods the ReplicaSet made run,
    each in cgroups holding the manifest's resources, behind one Service address; once the
    replica the agent reached stops (a rollout, a lost host), its next health watch goes
    through the other. Each replica reads the other's usage report at the name and port its
    manifest gives (``GPUFLEET_GATEWAY_PEERS``: the peer Service's ready endpoints), so a node
    calling both gets one share of the budget, and says so (``gpufleet_gateway_peers_heard``);
    the one left stops counting the stopped one within seconds. The agent's pod serves its
    metrics on the port its manifest names, with the gauge the dashboard counts running agents by."""
    # The join's activities run their own event loops (tests.providers.test_join_real.run).
    provisioned = await asyncio.to_thread(one.provision)
    machine = await asyncio.to_thread(lambda: one.machine(provisioned.machine.id).boot())
    # Labelled and tainted as NodeJoin's registration step leaves it: what the DaemonSet selects.
    site = one.site
    node = await asyncio.to_thread(one.await_registration, provisioned, labels={
        LABEL_SITE: site.name, LABEL_PROVIDER: site.provider, LABEL_REGION: site.region,
        LABEL_GPU_PRODUCT: site.gpu}, add_taints=[UNPROVEN_TAINT])

    client = temporal_env.client
    gateway_pki = Pki.create("gpufleet test gateway CA")
    shipped = gateway_deployment()
    (shipped_container,) = shipped["spec"]["template"]["spec"]["containers"]
    gateway_pods = created_pods(one.real, "gpufleet", "gpufleet-node-gateway", shipped["spec"]["replicas"])
    assert len(gateway_pods) == shipped["spec"]["replicas"] == 2, [p["metadata"]["name"] for p in gateway_pods]
    for pod in gateway_pods:
        (container,) = pod["spec"]["containers"]
        assert container["resources"] == shipped_container["resources"], pod["metadata"]["name"]
    manifest_env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    temporal_pki, temporal_secret = frontend_pki(tmp_path, manifest_env["TEMPORAL_TLS_SERVER_NAME"])
    frontend, frontend_port = await start_tls_proxy(temporal_pki, client.service_client.config.target_host)
    create_gateway_objects(one.real, tmp_path, gateway_pki, temporal_secret,
                           public_hosts=(GATEWAY_ENDPOINT.rpartition(":")[0],))
    frontend_host, _, port = manifest_env["TEMPORAL_ADDRESS"].rpartition(":")
    # A control-plane host for the real scheduler to bind the replicas to, each at its pod address;
    # the peer name answers the peer Service's ready endpoints, as the cluster DNS does.
    host = nodes(f"gateway-host-{uuid.uuid4().hex[:6]}", {"kubernetes.io/os": "linux", CONTROL_PLANE_ROLE: ""},
                 taints=[{"key": CONTROL_PLANE_ROLE, "effect": "NoSchedule"}])
    network = PodNetwork()
    gateways: list = []
    try:
        gateway_pods = await asyncio.to_thread(scheduled_and_reported, one.real, gateway_pods, host)
        peers = manifest_env["GPUFLEET_GATEWAY_PEERS"].rpartition(":")[0]
        answered = await asyncio.to_thread(ready_addresses, one.real, peers, len(gateway_pods))
        assert answered == sorted(pod["status"]["podIP"] for pod in gateway_pods)
        started = await asyncio.gather(*(asyncio.to_thread(
            run_pod, one.real, pod, tmp_path / f"gateway-pod-{number}",
            {f"{frontend_host}:{port}": ("127.0.0.1", frontend_port)}, dns={peers: answered}, pod_network=network)
            for number, pod in enumerate(gateway_pods)), return_exceptions=True)
        gateways = [g for g in started if not isinstance(g, BaseException)]
        for failed in started:
            if isinstance(failed, BaseException):
                raise failed
    except BaseException:
        for gateway in gateways:
            gateway.stop()
        network.close()
        unbind(one.real, host)
        raise
    (nodes_port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "nodes"]
    service = ServiceFront([gateway.ports[nodes_port] for gateway in gateways])
    gateway_metrics = int(manifest_env["GPUFLEET_METRICS_PORT"])

    agent = None
    codes: dict[int, int | None] = {}  # replica → its exit code once stopped
    try:
        await asyncio.gather(*(asyncio.to_thread(gateway.wait_ready, 90) for gateway in gateways))
        # Each replica holds the other's fresh usage report: they share one upstream budget.
        for number, gateway in enumerate(gateways):
            await until_served(gateway.ports[gateway_metrics], "gpufleet_gateway_peers_heard", len(gateways) - 1,
                               f"gateway {number}:\n{gateway.log_tail()}")
        limits, requests = shipped_container["resources"]["limits"], shipped_container["resources"]["requests"]
        for gateway in gateways:  # as the kubelet sets them on cgroup v1 (pod.py says v2's too)
            values = gateway.cgroup_values()
            assert values.get("memory.limit_in_bytes", values.get("memory.max")) == str(
                int(parse_quantity(limits["memory"]))), values
            assert values.get("cpu.shares") in (None, str(int(parse_quantity(requests["cpu"]) * 1024))), values
        one.real.kubectl("apply", "--server-side", "-f", "-",
                         input=rendered_node_config(tmp_path, GATEWAY_ENDPOINT, gateway_pki.ca_pem))
        agent_pod = await asyncio.to_thread(daemon_pod, one.real, "gpufleet", "gpufleet-node-agent", node.name)
        assert [o["kind"] for o in agent_pod["metadata"]["ownerReferences"]] == ["DaemonSet"]
        (agent_container,) = agent_pod["spec"]["containers"]
        assert agent_container["resources"] == node_agent_container()["resources"]
        (stand_in := tmp_path / "pynvml.py").write_text(FAKE_PYNVML)
        # The node's /var/lib/kubelet/pki and kubeadm's flags are the joined machine's; its gateway
        # endpoint, only the pod's netns knows, leads to the gateway Deployment's Service.
        service_host, _, service_port = service.address.rpartition(":")
        kubelet = machine.client_pem.parents[1]
        agent = await asyncio.to_thread(
            run_pod, one.real, agent_pod, tmp_path / "agent-pod", {GATEWAY_ENDPOINT: (service_host, int(service_port))},
            host_paths={"/var/lib/kubelet/pki": kubelet / "pki",
                        "/var/lib/kubelet/kubeadm-flags.env": kubelet / "kubeadm-flags.env"},
            stand_in_modules={"pynvml": stand_in})
        log = agent.log
        queue = f"health-watch-{uuid.uuid4().hex[:6]}"
        result = await one_health_watch(client, queue, node.name, log, gateways)
        assert result.node_name == node.name
        assert len(result.gpus) == 2 and result.digest, result
        assert agent.process.poll() is None, agent.log_tail()
        # As the manifest runs it: root with CAP_SYS_ADMIN alone, in its 512Mi memory limit.
        proc_status = dict(line.split(":\t", 1) for line in
                      Path(f"/proc/{agent.process.pid}/status").read_text().splitlines() if ":\t" in line)
        assert proc_status["Uid"].split()[0] == "0", proc_status
        assert int(proc_status["CapEff"], 16) == 1 << CAP_SYS_ADMIN, proc_status
        # Spot notices of the node's own provider: the agent runs with the manifest's choice and
        # read the provider from the providerID kubeadm's join wrote into the kubelet's flags
        # (Lambda sells no spot: it reads none; tests/test_reclaim_watch.py has AWS's).
        environ = dict(entry.split("=", 1) for entry in
                       Path(f"/proc/{agent.process.pid}/environ").read_text().split("\0") if "=" in entry)
        assert environ.get("GPUFLEET_SPOT_NOTICE") == "auto", sorted(environ)
        assert one.site.provider == "lambda"
        assert "spot notices: none (lambda has no spot notice source)" in log.read_text(), agent.log_tail()
        values = agent.cgroup_values()
        assert values.get("memory.limit_in_bytes", values.get("memory.max")) == str(
            int(parse_quantity(agent_container["resources"]["limits"]["memory"]))), values
        # The "Node agents running" panel's gauge, on the port the manifest's env names.
        metrics_port = int({e["name"]: e.get("value") for e in agent_container["env"]}["GPUFLEET_METRICS_PORT"])
        assert metrics_port in [p["containerPort"] for p in agent_container["ports"]]
        assert await asyncio.to_thread(agents_running_gauge, agent.ports[metrics_port]) == 1, agent.log_tail()
        assert all(gateway.process.poll() is None for gateway in gateways), [g.log_tail() for g in gateways]

        # The replica the agent's connection went to stops, as the kubelet stops it.
        reached = service.backends.index(service.chosen[0])
        codes[reached] = await asyncio.to_thread(gateways[reached].stop)
        result = await one_health_watch(client, queue, node.name, log, gateways)
        assert result.node_name == node.name and len(result.gpus) == 2, result
        assert service.backends[1 - reached] in service.chosen, "the other replica served the agent"
        assert agent.process.poll() is None, agent.log_tail()
        # What the stopped replica said stops counting within seconds (its nodes, reconnected to
        # the other, are judged by what they send from then on).
        await until_served(gateways[1 - reached].ports[gateway_metrics], "gpufleet_gateway_peers_heard", 0,
                           "the replica left")
    finally:
        agent_code = await asyncio.to_thread(agent.stop) if agent is not None else None
        service.close()
        # As the kubelet stops them; the frontend's proxy runs on this loop, so wait off it.
        for number, gateway in enumerate(gateways):
            if number not in codes:
                codes[number] = await asyncio.to_thread(gateway.stop)
        frontend.close()
        network.close()
        unbind(one.real, host)
    assert codes == {0: 0, 1: 0}, [g.log_tail() for g in gateways]
    assert agent_code == 0, agent.log_tail()
