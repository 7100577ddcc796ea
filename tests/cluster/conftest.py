"""Fixtures: the simulated cluster and its contract harness, which puts nodes, pods and PDBs into
it as ``tests/realk8s/contract.py``'s ``RealHarness`` puts them into the real control plane (the
contract suite runs on both: tests/realk8s/test_contract.py); and the fake API server with the
adapter over it, for the tests that need a fault a real server cannot be made to show."""

from __future__ import annotations

import uuid

import pytest

from fleet.demand import GpuPod
from providers.cluster.base import PodInfo
from fleet.cluster import LABEL_PROVIDER, LABEL_SITE
from providers.cluster.kubernetes import KubernetesCluster, access_table
from sim.cluster import SimCluster
from sim.world import SimWorld
from tests.cluster.fake_apiserver import FakeKube


def _covered(request: tuple[str, str, str, str, str], namespace: str) -> bool:
    verb, group, resource, sub, ns = request
    return any(
        (r.verb, r.group, r.resource, r.subresource) == (verb, group, resource, sub)
        and (r.namespace == "" or r.namespace == ns)
        for r in access_table(namespace)
    )


@pytest.fixture
def fake():
    server = FakeKube().start()
    yield server
    server.stop()


@pytest.fixture
def kube(fake):
    """The adapter against the fake server. Afterwards: every request it made is
    in the adapter's access table (so the RBAC manifests cover it)."""
    cluster = KubernetesCluster(api_client=fake.api_client(), namespace="gpufleet")
    yield cluster
    cluster.api_client.close()
    uncovered = {r for r in fake.requests if r[2] != "selfsubjectaccessreviews" and not _covered(r, "gpufleet")}
    assert not uncovered, f"requests outside providers.cluster.kubernetes.ACCESS: {sorted(uncovered)}"


@pytest.fixture
def world(tmp_path):
    return SimWorld(tmp_path / "sim.db")


@pytest.fixture
def sim(world):
    return SimCluster(world)


class SimHarness:
    kind = "sim"
    #: Nodes the test did not add: none in a fresh simulated world.
    foreign: frozenset[str] = frozenset()

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster

    def add_node(self, name: str, site: str = "site-a", gpus: int = 8, ready: bool = True,
                 machine_id: str = "", boot_id: str = "boot-1") -> None:
        machine_id = machine_id or f"m-{name}"
        ref = self.cluster.create_join_token(name, machine_id, 600)
        token = self.cluster.world.take_bootstrap_token(machine_id)
        self.cluster.register_with_token(machine_id, token, boot_id, gpus)
        self.cluster.revoke_join_token(ref.token_id)
        self.cluster.label_node(name, {LABEL_SITE: site, LABEL_PROVIDER: "sim"})
        if not ready:
            self.cluster.set_node_status(name, ready=False)

    def set_ready(self, name: str, ready: bool) -> None:
        self.cluster.set_node_status(name, ready=ready)

    def add_pod(self, node: str, name: str, namespace: str = "default", labels: dict | None = None,
                owner_kind: str = "ReplicaSet", mirror: bool = False, gpus: int = 0) -> None:
        if gpus:  # one that holds GPUs: a pod with a spec (the demand loop's kind), bound and running
            self.cluster.create_pod(GpuPod(namespace=namespace, name=name, node=node, phase="Running", gpus=gpus,
                                           labels=labels or {}, owner_kinds=[owner_kind], mirror=mirror))
            return
        self.cluster.add_pod(node, name, namespace, labels, owner_kind, mirror)

    def set_pdb(self, namespace: str, name: str, selector: dict, min_available: int | None = None,
                max_unavailable: int | None = None) -> None:
        self.cluster.set_pdb(namespace, name, selector, min_available, max_unavailable)

    def delete_pdb(self, namespace: str, name: str) -> None:
        self.cluster.delete_pdb(namespace, name)

    def pods(self, node: str) -> list[PodInfo]:
        return self.cluster.pods(node)

    def take_bootstrap_token(self, machine_id: str) -> str | None:
        return self.cluster.world.take_bootstrap_token(machine_id)


@pytest.fixture(params=["sim"])
def harness(request):
    """The contract suite on the simulated cluster; the Kubernetes adapter's run of the same
    tests is against the real control plane (tests/realk8s/test_contract.py)."""
    return SimHarness(request.getfixturevalue("sim"))


@pytest.fixture
def unique():
    return uuid.uuid4().hex[:6]
