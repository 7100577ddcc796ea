"""A node's kubelet may create pods bound to itself (the mirrors of its static pods: NodeRestriction
lets a node create no other), with any labels and any GPU request ("1E" is 10^18). Such a pod
decides nothing about another machine: it holds at most its own node's GPUs, so a site's other
nodes stay free for an evacuation's replicas and a rollout's surge, and its ``gpufleet.io/model``
label adds nothing to that model's GPUs (its spot share, its warm headroom).

On the simulated cluster: the node's write is a pod in the simulated API server's table, marked
mirror as the API server marks a kubelet's (the real API server's run of the same attack, made as
the node: ``test_a_nodes_own_pod_holds_no_gpu_of_another_node`` in tests/cluster/test_contract.py,
collected again by tests/realk8s/test_contract.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from temporalio.testing import ActivityEnvironment

from activities.demand import DemandActivities
from activities.env import FleetEnv
from activities.evacuation import EvacuationActivities
from activities.serving import ServingActivities
from bench.common import fleet
from fleet.cluster import LABEL_MODEL, ServingSpec
from fleet.demand import GpuPod
from fleet.demand_planner import ModelUsage
from fleet.messages.demand import PlanDemandInput
from fleet.messages.evacuation import FreeGpusInput
from fleet.messages.rollout import UpdateServingInput
from fleet.settings import Settings
from providers.cluster.base import PodInfo, run_drain
from providers.cluster.kubernetes.gpu_pods import MOST_GPUS, gpu_pod
from tests.security.test_self_reported_gpus import node_reporting


@pytest.fixture
def env(tmp_path: Path) -> FleetEnv:
    """Three 8-GPU nodes at site-1; a tenant's 4-GPU pod of ``victim`` on the first; the third
    node's own 1000-GPU pod labelled ``victim``."""
    path = tmp_path / "sites.yaml"
    config = fleet(sites=2, capacity=8)
    config["models"] = {"victim": {"sites": ["site-1"], "warm_headroom": 0.5}}
    path.write_text(yaml.safe_dump(config))
    env = FleetEnv.from_settings(Settings(state_dir=tmp_path, config=str(path)))
    for name in ("honest-1", "honest-2", "liar"):
        node_reporting(env, name, "site-1", 8)
    env.cluster.create_pod(GpuPod(namespace="ml", name="victim-0", node="honest-1", phase="Running", gpus=4,
                                  labels={LABEL_MODEL: "victim"}))
    env.cluster.create_pod(GpuPod(namespace="kube-system", name="static-liar", node="liar", phase="Running",
                                  gpus=1000, labels={LABEL_MODEL: "victim"}, owner_kinds=["Node"], mirror=True))
    return env


def test_a_nodes_own_pod_leaves_the_other_nodes_gpus_free(env: FleetEnv) -> None:
    free = ActivityEnvironment().run(EvacuationActivities(env).free_gpus, FreeGpusInput(sites=["site-1"]))
    assert free == {"site-1": 8 + 8 - 4}, "an evacuation's room: the liar's pod holds the liar's GPUs only"


def test_a_nodes_own_pod_does_not_stop_another_models_surge(env: FleetEnv) -> None:
    serving = ServingActivities(env)
    spec = ServingSpec(model="victim", site="site-1", image="img:v1", replicas=1, gpus_per_replica=4)
    ActivityEnvironment().run(serving.update_serving, UpdateServingInput(spec=spec))
    assert env.cluster.serving_status("victim", "site-1").available_replicas == 1
    updated = ActivityEnvironment().run(serving.update_serving,
                                        UpdateServingInput(spec=spec.model_copy(update={"image": "img:v2"})))
    assert updated.max_surge == 1, "8 GPUs of honest-2 free: room for the surge replica"


def test_a_nodes_own_pod_adds_nothing_to_the_spot_share_of_the_model_its_label_names(env: FleetEnv) -> None:
    usage = DemandActivities(env)._plan(PlanDemandInput()).usage
    assert usage == {"victim": ModelUsage(other_gpus=4)}, "the tenant's pod alone"


def test_a_nodes_own_pod_adds_nothing_to_the_warm_headroom_of_the_model_its_label_names(env: FleetEnv) -> None:
    assert DemandActivities(env)._idle().keep_warm == {"site-1": 2}, "half of victim's 4 GPUs"


@pytest.mark.parametrize("quantity, gpus", [("1E", MOST_GPUS), ("1e999999999", MOST_GPUS), ("-8", 0), ("NaN", 0),
                                            ("Infinity", 0), ("eight", 0), ("0.5", 0), ("2", 2)])
def test_a_gpu_request_that_is_garbage_counts_as_none_or_the_most(quantity: str, gpus: int) -> None:
    """Whatever a node's pod asks for is read without raising (and without building a number
    of a billion digits); a node's pods then hold no more than its own GPUs."""
    pod = gpu_pod({"metadata": {"name": "static", "namespace": "kube-system",
                                "annotations": {"kubernetes.io/config.mirror": "x"}},
                   "spec": {"nodeName": "liar", "containers": [
                       {"name": "c", "resources": {"limits": {"nvidia.com/gpu": quantity}}},
                       {"name": "d", "resources": {"limits": {"nvidia.com/gpu": quantity}}}]}})
    assert pod.mirror and pod.gpus == min(2 * gpus, MOST_GPUS)


def test_a_nodes_many_own_pods_keep_a_drain_of_it_within_what_history_takes() -> None:
    """A node may create mirror pods of itself without limit, and a drain leaves them alone. Its
    result named each: 10,000 long-named ones made it about 3 MB, over the 2 MiB Temporal takes, so
    the drain of that node failed (an evacuation failed and undid itself; a surplus node was kept
    and billed). Now it names the first few and counts the rest."""
    pods = [PodInfo(namespace="default", name=f"{i:05d}-" + "x" * 247, owner_kinds=["Node"], mirror=True)
            for i in range(10_000)]
    pods.append(PodInfo(namespace="ml", name="tenant-0"))
    evicted: list[str] = []
    result = run_drain("liar", 10, False, list_pods=lambda: [p for p in pods if p.name not in evicted],
                       evict=lambda ns, name: (evicted.append(name), ("gone", ""))[1],
                       delete=lambda ns, name: None, sleep=lambda s: None)
    assert evicted == ["tenant-0"] and result.completed
    assert len(result.model_dump_json()) < 64 * 1024
    assert len(result.skipped) + result.skipped_unlisted == 10_000
    assert result.skipped[0].reason == "mirror pod"
