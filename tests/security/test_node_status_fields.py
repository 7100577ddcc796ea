"""What a node's kubelet writes in its Node's status beyond Ready and its GPUs (NodeRestriction
lets a node update its own status with any values the API server's validation takes) and the
control plane reads: here its boot id (``nodeInfo.bootID``).

On the fake API server: the Node as the real one serves it after the kubelet's write (the real
API server took a boot id of 100,000 characters; the object's limit is some 1.5 MB)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fleet.messages.nodes import NodeFacts
from providers.cluster.kubernetes import KubernetesCluster
from tests.cluster.fake_apiserver import FakeKube


@pytest.fixture
def kube() -> Iterator[tuple[FakeKube, KubernetesCluster]]:
    fake = FakeKube().start()
    cluster = KubernetesCluster(api_client=fake.api_client(), namespace="gpufleet")
    try:
        yield fake, cluster
    finally:
        cluster.api_client.close()
        fake.stop()


def test_a_boot_id_a_node_writes_at_a_megabyte_is_read_short_and_still_tells_its_boots_apart(kube) -> None:
    """A boot id is a UUID (36 characters) and goes into workflow history with every read of the
    node's facts (the Node entity's on each finding, spot notice or failed watch; a repair's, which
    also hands it to its reboot and its wait for the boot, and writes it in the node's reboot mark).
    A kubelet writing a megabyte made each of those a megabyte: the node's own entity and repairs
    driven toward Temporal's 2 MB payload and 50 MB history limits many times faster than by any
    report, and its reboot mark (``<op>:<boot id>``, an annotation) past the 256 KB the API server
    takes for a Node's annotations.
    Now a boot id over 64 characters is read as its digest: short, and a new one still a new boot."""
    fake, cluster = kube
    fake.add_node("honest", boot_id="0f8fad5b-d9cb-469f-a165-70867728950e")
    fake.add_node("liar", boot_id="a" * 1_000_000)
    honest, liar = cluster.get_node("honest"), cluster.get_node("liar")
    assert honest.boot_id == "0f8fad5b-d9cb-469f-a165-70867728950e"
    assert len(liar.boot_id) <= 128
    facts = NodeFacts(node_name="liar", found=True, boot_id=liar.boot_id)
    assert len(facts.model_dump_json()) < 2_000, "a facts read of the node costs what an honest one does"
    assert {n.name: n.boot_id for n in cluster.list_nodes()}["liar"] == liar.boot_id

    with fake.lock:
        fake.store[("", "nodes", "", "liar")]["status"]["nodeInfo"]["bootID"] = "a" * 999_999 + "b"
    rebooted = cluster.get_node("liar")
    assert rebooted.boot_id != liar.boot_id and len(rebooted.boot_id) <= 128, "another boot reads as another"
