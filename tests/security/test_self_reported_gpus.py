"""A node's kubelet writes its own status, ``allocatable: nvidia.com/gpu`` included
(NodeRestriction lets a node update its own Node status). A hostile node that claims a thousand
GPUs must not be counted as a thousand: an evacuation would move every replica of a lost site
onto that node's site and buy no replacement capacity, and consolidation would count a thousand
GPUs of warm headroom there. The control plane believes at most what a machine at the node's
site has (the config's ``gpus_per_machine``); fewer is believed (a GPU that fell off the bus).

On the simulated cluster: the node's write is the ``gpus`` its kubelet reports, set here in the
simulated API server's table as a kubelet's status update sets it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from temporalio.testing import ActivityEnvironment

from activities.demand import DemandActivities
from activities.env import FleetEnv
from activities.evacuation import EvacuationActivities
from bench.common import fleet
from fleet.cluster import LABEL_SITE
from fleet.messages.evacuation import FreeGpusInput
from fleet.settings import Settings


@pytest.fixture
def env(tmp_path: Path) -> FleetEnv:
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(fleet(sites=2, capacity=8)))  # 8 GPUs per machine
    return FleetEnv.from_settings(Settings(state_dir=tmp_path, config=str(path)))


def node_reporting(env: FleetEnv, name: str, site: str, gpus: int) -> None:
    """A ready node at ``site`` whose kubelet reports ``gpus`` allocatable GPUs."""
    with env.world.tx() as db:
        db.execute("INSERT INTO nodes(name, machine_id, labels, taints, unschedulable, ready, boot_id, gpus,"
                   " registered_at) VALUES (?,?,'{}','[]',0,1,'b',?,0)", (name, f"m-{name}", gpus))
    env.cluster.label_node(name, {LABEL_SITE: site})


async def test_a_node_claiming_a_thousand_gpus_counts_as_one_machine(env: FleetEnv) -> None:
    node_reporting(env, "honest", "site-1", 8)
    node_reporting(env, "liar", "site-1", 1000)
    node_reporting(env, "one-gpu-lost", "site-1", 7)

    free = ActivityEnvironment().run(EvacuationActivities(env).free_gpus, FreeGpusInput(sites=["site-1"]))
    assert free == {"site-1": 8 + 8 + 7}, "an evacuation's room elsewhere counts what the machines have"

    idle = {n.name: n.gpus for n in (await ActivityEnvironment().run(DemandActivities(env).idle_nodes)).idle}
    assert idle == {"honest": 8, "liar": 8, "one-gpu-lost": 7}, "consolidation's count of warm GPUs too"


def test_a_node_at_no_configured_site_is_left_as_it_reports() -> None:
    from fleet.models import Node

    node = Node(name="n", gpus_allocatable=1000)
    assert node.believed(None).gpus_allocatable == 1000, "nothing to compare with: its own count (no site counts it)"
    assert node.believed(8).gpus_allocatable == 8


#: The list runs in a child process: ``int`` of a number of ten million digits holds the GIL, so
#: no bound in this one could cut the old code short.
LIST_NODES = """
import json, sys
from kubernetes import client
from providers.cluster.kubernetes import KubernetesCluster
configuration = client.Configuration()
configuration.host = sys.argv[1]
nodes = KubernetesCluster(api_client=client.ApiClient(configuration), namespace="gpufleet").list_nodes()
print(json.dumps({n.name: n.gpus_allocatable for n in nodes}))
"""


@pytest.mark.integration  # a process of its own: see LIST_NODES
def test_a_node_writing_its_gpus_as_a_number_of_ten_million_digits_is_read_at_once() -> None:
    """The real API server takes ``allocatable: {nvidia.com/gpu: 1e10000000}`` in a Node's status
    (non-negative, and its integer check overflows to 0) and serves it as ``10e9999999``: its
    kubelet may write that. The adapter made it an ``int``, ten million digits, over half an hour of
    one core with the GIL held (a million digits took 23 s), so the control plane's worker stood
    still, every workflow task, heartbeat and watch of the fleet, each time a list of nodes took the
    node in. Now it is compared as a quantity first and counts as ``MOST_GPUS``, believed as one of
    its site's machines."""
    import json
    import os
    import subprocess
    import sys

    from fleet.cluster import GPU_RESOURCE
    from providers.cluster.kubernetes.gpu_pods import MOST_GPUS
    from tests.cluster.fake_apiserver import FakeKube

    fake = FakeKube().start()
    try:
        fake.add_node("honest", gpus=8)
        fake.add_node("liar", gpus=8)
        with fake.lock:
            fake.store[("", "nodes", "", "liar")]["status"]["allocatable"][GPU_RESOURCE] = "10e9999999"
        repo = str(Path(__file__).resolve().parents[2])
        try:
            listed = subprocess.run([sys.executable, "-c", LIST_NODES, fake.url], capture_output=True, text=True,
                                    timeout=120, cwd=repo, env={**os.environ, "PYTHONPATH": repo})
        except subprocess.TimeoutExpired:
            pytest.fail("listing the nodes did not end: the liar's GPU count was being made a number")
    finally:
        fake.stop()
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == {"honest": 8, "liar": MOST_GPUS}
    from fleet.models import Node
    assert Node(name="liar", gpus_allocatable=MOST_GPUS).believed(8).gpus_allocatable == 8
