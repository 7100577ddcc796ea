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
process of its own (``bench.flood_attacker``) holds 1,300 polls and 40 polls of 3 MB each (the
gateway takes 16 of its calls, two upstream, holds 32 more, ``HELD_CALLS_PER_NODE``, and refuses
the rest). The victim's round trips run in short batches with the attack on and off: every one
of them is done (a starved node's batch never ends; each is counted, not timed), the gateway
holds exactly its bound of the attacker's calls, and its peak resident memory stays within the
limit its manifest sets. How much the attack moves the victim's p99 is a figure, not a test:
``python -m bench.gateway --part flood`` prints it against the same run's quiet batches.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from kubernetes.utils import parse_quantity
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from bench.common import peak_rss_mb
from bench.gateway import alternate, start_attacker
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

#: Temporal's own default for ``frontend.namespaceCount`` (concurrent long polls per namespace
#: and frontend instance), which a production frontend runs with.
FRONTEND_POLL_BUDGET = 1200
#: Pairs of batches (the attack off and on): enough for the attack to be switched on after
#: a quiet batch and after an attacked one, and off likewise.
ROUNDS, BATCH = 4, 10
#: A batch takes about a second here; starved (every poll slot the attacker's) it never ends.
BATCH_SECONDS = 60
ATTACK_POLLS, BIG_POLLS = 1300, 40


def manifest_memory_limit() -> int:
    (container,) = gateway_deployment()["spec"]["template"]["spec"]["containers"]
    return int(parse_quantity(container["resources"]["limits"]["memory"]))


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


async def test_one_node_holding_1300_polls_and_3_mb_requests_starves_no_other_node(production_frontend,
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
    (tmp_path / "ca.pem").write_bytes(gateway_pki.ca_pem)
    (tmp_path / f"{attacker.name}.pem").write_bytes(attacker.cert)
    (tmp_path / f"{attacker.name}.key").write_bytes(attacker.key)
    for node in (attacker, victim):
        recorded(control_plane, node)
        await live_entity(client, node.name)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(manifest_env["GPUFLEET_METRICS_PORT"]) == ports["metrics"]
    gateway = await asyncio.to_thread(run_pod, control_plane, pod, tmp_path / "gateway-pod",
                                      {manifest_env["TEMPORAL_ADDRESS"]: ("127.0.0.1", frontend_port)})
    attack: subprocess.Popen | None = None
    try:
        await asyncio.to_thread(gateway.wait_ready, 90)
        metrics = gateway.ports[ports["metrics"]]
        # The gateway's own process (the container's), in cgroups holding the manifest's memory limit.
        assert b"workers.node_gateway" in Path(f"/proc/{gateway.process.pid}/cmdline").read_bytes()
        held_to = gateway.cgroup_values()
        assert held_to.get("memory.limit_in_bytes", held_to.get("memory.max")) == str(manifest_memory_limit()), held_to
        access = GatewayAccess(gateway.ports[ports["nodes"]], gateway_pki.ca_pem)
        agent = await connect_via_gateway(access, "default", victim.cert, victim.key)
        attack = start_attacker(access, tmp_path, attacker.name, ATTACK_POLLS, BIG_POLLS)
        flood = await alternate(client, agent, f"node/{victim.name}", attack, metrics, ROUNDS, BATCH, BATCH_SECONDS)
        peak, limit = peak_rss_mb(gateway.process.pid) * 2**20, manifest_memory_limit()
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
    # Not starved: every round trip the victim asked for done, the attack on as off. Before the
    # per-node limits the attacker took every poll slot and the victim's batches never ended.
    asked = ROUNDS * BATCH
    assert {side: flood.done(side) for side in ("quiet", "attacked")} == \
        {"quiet": (asked, asked), "attacked": (asked, asked)}
    # The attacker's calls over its limits held up to the gateway's bound for one node, no more.
    assert flood.most_held == HELD_CALLS_PER_NODE, flood.most_held
    assert peak < limit, f"gateway peak RSS {peak / 2**20:.0f} MiB of {limit / 2**20:.0f} MiB"
