"""Issue 35, finding 2: one node cannot starve every other node.

Before, the gateway capped nothing per node: with the frontend's default budget of 1,200
concurrent polls per namespace, one node holding more took all of it, and another node's
activity round trip went from 54-82 ms to 2.3-10.4 s; 40 polls of 3 MB each added 535 MB to
the gateway and 625 MB to the Temporal server.

Here, as deployed: the gateway is a Pod the real ReplicaSet controller made of
deploy/kubernetes/node-gateway.yaml (applied unchanged to a real control plane of this test's
own, ``tests/realk8s/cluster.py``), run by ``tests/realk8s/pod.py`` as the kubelet runs its
container: the Deployment's command and env (``GPUFLEET_CONFIG``, so liveness asks the real API
server, as the gateway's service account, for each node's identity record and bound keys; mutual
TLS to ``temporal-frontend.temporal.svc:7233`` with the ``gpufleet-temporal-client`` Secret), its
Secrets and ConfigMap created as an operator creates them, the image's Python install, uid 10001
and read-only root, in cgroups holding its ``resources`` (the 1Gi memory limit). Its frontend is
a TLS-terminating proxy (``tests/test_temporal_tls.py``) in front of a Temporal dev server with
the production frontend's default poll budget (1,200; the suite's shared server raises it for
the fleet benches). The attacker and the victim are nodes the control plane recorded (identity
record and client key, as the join and the CSR approver write them), with certificates of the
cluster CA. What still differs from a cluster: one of the Deployment's two replicas runs (a
node's connection reaches one replica; the limits and the memory limit are each replica's), and
the pod's network is ``pod.py``'s (loopback relays where a Service and a load balancer would be).

A victim node's agent (the SDK's Worker, one poller) goes through it, and the attacker in a
process of its own holds 1,300 polls and 40 polls of 3 MB each (the gateway takes 16 of its
calls, two upstream, holds 32 more, ``HELD_CALLS_PER_NODE``, and refuses the rest). The victim's
round trips (server event times, scheduled → completed) with the attack on and off alternate in
short batches in one run; its p99 with the attack may be at most 1.2 times its p99 without (the
issue's 20%), or above it by no more than this run's own noise, measured in it (how far apart
the quiet batches' slowest round trips are, at least 10 ms: other test workers share the two
cores); and the gateway's peak resident memory stays within the limit its manifest sets.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from kubernetes.utils import parse_quantity
from prometheus_client.parser import text_string_to_metric_families
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import PollerBehaviorSimpleMaximum, UnsandboxedWorkflowRunner, Worker

from bench.common import pct
from bench.gateway import RoundTrips, noop, round_trips
from cli.dev import DEV_SERVER_DYNAMIC_CONFIG, temporal_binary
from fleet import search_attributes
from fleet.cluster import NODE_IDENTITY_KIND, NODE_KEYS_KIND, NodeIdentity, with_key
from providers.cluster.kubernetes import KubernetesCluster
from tests.realk8s import build, machine
from tests.realk8s.cluster import RealCluster
from tests.realk8s.conftest import shipped_cluster
from tests.realk8s.pod import created_pods, run_pod
from tests.realk8s.test_node_agent import create_gateway_objects, gateway_deployment
from tests.security.gateway_helpers import NodeCredentials, credentials, end_entity, live_entity, unique
from tests.test_temporal_manifests import frontend_pki
from tests.test_temporal_tls import start_tls_proxy
from workers.node_agent import connect_via_gateway
from workers.gateway.node_identity import GatewayAccess
from workers.gateway.pki import Pki
from workers.gateway.proxy import HELD_CALLS_PER_NODE

pytestmark = pytest.mark.integration
#: The issue's bound: another node's round-trip p99 moves by at most 20%.
MAX_P99_RATIO = 1.2
#: The least noise a p99 of a few hundred round trips on two cores shared with other test
#: workers has (one scheduler pause); below the noise, no ratio says anything about the attack.
NOISE_FLOOR_SECONDS = 0.010

ROOT = Path(__file__).resolve().parents[2]
#: Temporal's own default for ``frontend.namespaceCount`` (concurrent long polls per namespace
#: and frontend instance), which a production frontend runs with.
FRONTEND_POLL_BUDGET = 1200
ROUNDS, BATCH = 16, 20
#: A batch takes about a second here; starved (every poll slot the attacker's) it never ends.
BATCH_SECONDS = 60
ATTACK_POLLS, BIG_POLLS = 1300, 40


def manifest_memory_limit() -> int:
    (container,) = gateway_deployment()["spec"]["template"]["spec"]["containers"]
    return int(parse_quantity(container["resources"]["limits"]["memory"]))


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
async def production_frontend():
    """A dev server of its own whose frontend keeps Temporal's default poll budget."""
    tuning = {**DEV_SERVER_DYNAMIC_CONFIG, "frontend.namespaceCount": FRONTEND_POLL_BUDGET}
    flags = [arg for key, value in tuning.items() for arg in ("--dynamic-config-value", f"{key}={json.dumps(value)}")]
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), data_converter=pydantic_data_converter,
        search_attributes=search_attributes.ALL, dev_server_log_level="error", dev_server_extra_args=flags)
    yield env
    await env.shutdown()


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory) -> RealCluster:
    """A real Kubernetes control plane of this module's own, the shipped manifests applied (as the
    real tier's ``real_cluster``): the gateway's Pod comes from its Deployment there, and its
    liveness asks that API server. Skipped where the real tier cannot run, failed so in CI."""
    reason = build.missing_reason() or machine.missing_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the gateway as deployed: {reason}")
        pytest.skip(reason)
    with shipped_cluster(tmp_path_factory.mktemp("flood-k8s")) as cluster:
        yield cluster


def cluster_ca(cluster: RealCluster) -> Pki:
    """The cluster CA (what signs kubelet client certificates, the gateway's ``--client-ca``)."""
    return Pki(serialization.load_pem_private_key((cluster.pki / "ca.key").read_bytes(), None),
               x509.load_pem_x509_certificate(cluster.ca_pem))


def recorded(cluster: RealCluster, node: NodeCredentials) -> None:
    """What the control plane writes for a node, as its service account: the identity record
    (the join) and the node's client key bound (the CSR approver) — what the gateway's liveness reads."""
    kube = KubernetesCluster(api_client=cluster.api_client(
        cluster.service_account_token("gpufleet", "gpufleet-control-plane")), namespace="gpufleet")
    identity = NodeIdentity(node_name=node.name, machine_id=f"m-{node.name}", provider="own-dc", account="own",
                            site="dc-1")
    kube.update_state(NODE_IDENTITY_KIND, node.name, lambda _old: identity.state())
    kube.update_state(NODE_KEYS_KIND, node.name, lambda old: with_key(old, node.fingerprint))


def gateway_figures(metrics: str) -> dict[str, float]:
    """Polls the gateway forwards and holds now, calls it holds for nodes over their limits, and
    calls over limits (held or refused) since it started."""
    page = httpx.get(f"http://{metrics}/metrics", timeout=5).text
    samples = {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples}
    return {"polls": samples.get("gpufleet_gateway_held_polls", 0.0),
            "over_limits": samples.get("gpufleet_gateway_held_over_limits", 0.0),
            "limited": samples.get("gpufleet_gateway_limited_total", 0.0)}


async def test_one_node_holding_1300_polls_and_3_mb_requests_moves_no_other_nodes_p99(production_frontend,
                                                                                     control_plane, tmp_path) -> None:
    client = production_frontend.client
    shipped = gateway_deployment()
    (pod, *_) = created_pods(control_plane, "gpufleet", "gpufleet-node-gateway", shipped["spec"]["replicas"])
    (container,) = pod["spec"]["containers"]
    manifest_env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    temporal_pki, temporal_secret = frontend_pki(tmp_path, manifest_env["TEMPORAL_TLS_SERVER_NAME"])
    frontend, frontend_port = await start_tls_proxy(temporal_pki, client.service_client.config.target_host)
    gateway_pki = Pki.create("gpufleet flood-test gateway CA")
    create_gateway_objects(control_plane, tmp_path, gateway_pki, temporal_secret)
    ca = cluster_ca(control_plane)
    attacker, victim = credentials(ca, unique("attacker")), credentials(ca, unique("victim"))
    (tmp_path / "gateway-ca").write_bytes(gateway_pki.ca_pem)
    (tmp_path / "attacker.pem").write_bytes(attacker.cert)
    (tmp_path / "attacker.key").write_bytes(attacker.key)
    for node in (attacker, victim):
        recorded(control_plane, node)
        await live_entity(client, node.name)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(manifest_env["GPUFLEET_METRICS_PORT"]) == ports["metrics"]
    gateway = await asyncio.to_thread(run_pod, control_plane, pod, tmp_path / "gateway-pod",
                                      {manifest_env["TEMPORAL_ADDRESS"]: ("127.0.0.1", frontend_port)})
    attack: subprocess.Popen | None = None
    quiet, attacked, most_held = [], [], 0.0
    try:
        await asyncio.to_thread(gateway.wait_ready, 90)
        metrics = gateway.ports[ports["metrics"]]
        # The gateway's own process (the container's), in cgroups holding the manifest's memory limit.
        assert b"workers.node_gateway" in Path(f"/proc/{gateway.process.pid}/cmdline").read_bytes()
        held_to = gateway.cgroup_values()
        assert held_to.get("memory.limit_in_bytes", held_to.get("memory.max")) == str(manifest_memory_limit()), held_to
        access = GatewayAccess(gateway.ports[ports["nodes"]], gateway_pki.ca_pem)
        agent = await connect_via_gateway(access, "default", victim.cert, victim.key)
        attack = subprocess.Popen(
            [sys.executable, "-m", "tests.security.flood_attacker", access.address, str(tmp_path / "gateway-ca"),
             str(tmp_path / "attacker.pem"), str(tmp_path / "attacker.key"), attacker.name,
             "--polls", str(ATTACK_POLLS), "--big", str(BIG_POLLS)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        async def attacking(on: bool) -> float:
            """Switch the attack on (each of its calls over its limits held at the gateway, or
            refused beyond what the gateway holds of a node) or off (every call gone); how many
            calls of it the gateway holds."""
            attack.stdin.write("on\n" if on else "off\n")
            attack.stdin.flush()
            answer = await asyncio.to_thread(attack.stdout.readline)
            assert answer.startswith("holding" if on else "quiet"), answer
            deadline = asyncio.get_running_loop().time() + 20
            before = None
            while True:
                now = await asyncio.to_thread(gateway_figures, metrics)
                # Off: the victim's own poll, and at most a couple of the attacker's that the
                # gateway has not yet seen cancelled (each ends within its deadline anyway).
                # On: as many held as the gateway holds of one node, and the burst of calls the
                # attacker sent all judged (no more counted over limits, as before the per-node
                # held limit, when the round began once its calls were all held).
                settled = before is not None and now["limited"] == before["limited"]
                if (settled and now["over_limits"] >= HELD_CALLS_PER_NODE) if on \
                        else (now["polls"] + now["over_limits"] <= 3):
                    return now["over_limits"]
                assert asyncio.get_running_loop().time() < deadline, f"attack {'on' if on else 'off'}: {now}"
                before = now
                await asyncio.sleep(0.25 if on else 0.1)

        control_queue = f"flood-{uuid.uuid4().hex[:6]}"
        quiet_rounds: list[list[float]] = []
        async with Worker(client, task_queue=control_queue, workflows=[RoundTrips],
                          workflow_runner=UnsandboxedWorkflowRunner()), \
                Worker(agent, task_queue=f"node/{victim.name}", activities=[noop],
                       activity_task_poller_behavior=PollerBehaviorSimpleMaximum(1)):
            await round_trips(client, control_queue, f"node/{victim.name}", 10)  # warm-up
            # Short batches, in the order quiet-attacked, attacked-quiet, ...: load from anything else
            # on the two shared cores falls on both sides alike.
            for i in range(ROUNDS):
                for on in ((False, True) if i % 2 == 0 else (True, False)):
                    held = await attacking(on)
                    most_held = max(most_held, held)
                    try:
                        batch = await asyncio.wait_for(
                            round_trips(client, control_queue, f"node/{victim.name}", BATCH), BATCH_SECONDS)
                    except asyncio.TimeoutError:
                        raise AssertionError(f"{BATCH} round trips of the victim took over {BATCH_SECONDS} s "
                                             f"with the attack {'on' if on else 'off'}") from None
                    (attacked if on else quiet).extend(batch)
                    if not on:
                        quiet_rounds.append(batch)
            await attacking(False)
        peak, limit = peak_rss(gateway.process.pid), manifest_memory_limit()
    finally:
        if attack is not None:
            attack.kill()
            attack.wait(10)
        # As the kubelet stops it; the frontend's proxy runs on this loop, so wait off it.
        stopped = await asyncio.to_thread(gateway.stop)
        frontend.close()
        for node in (attacker, victim):
            await end_entity(client, node.name)
    # Killed in its cgroup (over the manifest's memory limit) it would not have exited cleanly.
    assert stopped == 0, gateway.log_tail()
    ratio = pct(attacked, 99) / pct(quiet, 99)
    # The noise of this run, measured in it and nowhere else: how far apart the quiet batches'
    # own slowest round trips are (each batch ran between attacked ones, on the same two shared
    # cores). A p99 of 160 samples is their second-highest, so one pause of a neighbouring test
    # worker moves it by tens of ms, and such a pause falls on a quiet batch as it falls on an
    # attacked one: an attacked p99 above the quiet one by no more than the quiet batches differ
    # among themselves (and never less than 10 ms) is no effect of the attack. Starved, before
    # the per-node limits, the victim's round trips took seconds (2.3 to 10.4 s).
    slowest = [max(batch) for batch in quiet_rounds]
    noise = max(NOISE_FLOOR_SECONDS, max(slowest) - min(slowest))
    figures = (f"victim round trip p99 {pct(quiet, 99) * 1000:.1f} ms quiet, {pct(attacked, 99) * 1000:.1f} ms "
               f"attacked (ratio {ratio:.2f}); p50 {sorted(quiet)[len(quiet) // 2] * 1000:.1f} / "
               f"{sorted(attacked)[len(attacked) // 2] * 1000:.1f} ms; gateway held {most_held:.0f} calls over limits, "
               f"peak RSS {peak / 2**20:.0f} MiB of {limit / 2**20:.0f} MiB; noise {noise * 1000:.1f} ms")
    print(figures)
    assert ratio <= MAX_P99_RATIO or pct(attacked, 99) - pct(quiet, 99) <= noise, figures
    assert peak < limit, figures
    assert most_held == HELD_CALLS_PER_NODE, figures
