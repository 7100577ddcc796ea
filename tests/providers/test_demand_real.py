"""The demand loop's activities in ``mode: real`` (issue 18), without the simulator.

Pods and nodes live in the fake Kubernetes API server (field-selected pod lists, node
label patches, the Eviction subresource with PodDisruptionBudgets); offers and machines
come from the real provider adapters against their wire-level fakes (the Lambda Cloud
fake, moto for a spot EC2 site). The activities run as the control-plane worker runs
them, and the account guard's store is in the cluster, as ``mode: real`` keeps it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from dataclasses import dataclass

import pytest
from temporalio.testing import ActivityEnvironment

from activities.capacity import CapacityActivities
from activities.demand import DemandActivities
from activities.env import FleetEnv
from fleet.cluster import (
    GPU_RESOURCE,
    LABEL_GPU_PRODUCT,
    LABEL_SITE,
    NODE_IDENTITY_KIND,
    NodeIdentity,
    gpufleet_provider_id,
)
from fleet.config import FleetConfig, Site
from fleet.consolidation import ConsolidationSettings, consolidate
from fleet.demand import (
    DEMAND_TAINT_KEY,
    LABEL_CAPACITY_TYPE,
    LABEL_FLEET,
    LABEL_GEOGRAPHY,
    site_labels,
)
from fleet.messages.capacity import DrainNodeInput, GetCatalogInput, RetireMachineInput
from fleet.messages.demand import JoiningMachine, PlanDemandInput, WatchDemandInput
from fleet.models import CapacityType, MachineSpec
from fleet.settings import Settings
from providers.cluster.kubernetes import KubernetesCluster
from tests.cluster.fake_apiserver import FakeKube

TOLERATE = [{"key": DEMAND_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
LAMBDA_H100 = "gpu_8x_h100_sxm5"
LAMBDA_A10 = "gpu_1x_a10"


def run(activity_fn, *args):
    """The activity as the worker runs it (sync tests: no event loop of their own)."""
    result = ActivityEnvironment().run(activity_fn, *args)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


@dataclass
class Fleet:
    fake: FakeKube
    cluster: KubernetesCluster
    env: FleetEnv
    demand: DemandActivities
    capacity: CapacityActivities
    sites: dict[str, Site]
    east: Site
    west: Site
    spot: Site

    def pending(self, name: str, gpus: int, *, nominated: str = "", opted_in: bool = True, **selector: str) -> None:
        """A pod the scheduler could not place; opted in: the fleet toleration and node selector."""
        self.fake.add_pending_pod(
            name, gpus, namespace="ml", nominated_node=nominated,
            node_selector={LABEL_FLEET: "true", **selector} if opted_in else selector,
            tolerations=TOLERATE if opted_in else [])

    def running(self, node: str, name: str, gpus: int = 0, labels: dict[str, str] | None = None) -> None:
        """A pod bound to ``node`` and running, as the kubelet leaves it."""
        resources = {"requests": {GPU_RESOURCE: str(gpus)}, "limits": {GPU_RESOURCE: str(gpus)}} if gpus else {}
        self.fake.put("", "pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml", "labels": labels or {},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{name}-rs",
                                              "uid": str(uuid.uuid4()), "controller": True}]},
            "spec": {"nodeName": node, "tolerations": TOLERATE,
                     "containers": [{"name": "c", "image": "vllm", "resources": resources}]},
            "status": {"phase": "Running"},
        })

    def joined(self, site: Site, node: str, gpus: int = 8) -> str:
        """A machine bought at the provider fake and its node registered, as a join leaves
        them: the Node object with the site label, and the join's identity record."""
        account = self.env.config.account_for(site)
        machine = self.env.provider(site.name).create_machine(MachineSpec(
            name=node, site=site.name, region=site.region, instance_type=site.instance_type, gpu=site.gpu,
            gpus=site.gpus_per_machine, capacity_type=site.capacity_type, image=site.image), f"join/{node}")
        provider_id = gpufleet_provider_id(site.provider, account.name, node)
        self.fake.add_node(node, labels={LABEL_SITE: site.name}, gpus=gpus, provider_id=provider_id,
                           taints=[{"key": DEMAND_TAINT_KEY, "effect": "NoSchedule"}])
        identity = NodeIdentity(node_name=node, machine_id=machine.id, provider=site.provider, account=account.name,
                                site=site.name, provider_id=provider_id, join_id=f"join/{node}")
        self.cluster.update_state(NODE_IDENTITY_KIND, node, lambda _old: identity.state())
        return machine.id


@pytest.fixture
def fleet(lambda_harness, aws_harness, tmp_path):
    """Three sites: H100 on-demand (Lambda, us-east), A10 (Lambda, us-west), H100 spot (EC2, us-east)."""
    lam = lambda_harness.fake
    # The fake sells A10s in us-west-1 for this test (its default lists no region with capacity).
    lam.instance_types[LAMBDA_A10]["regions_with_capacity_available"] = [
        {"name": "us-west-1", "description": "California, USA"}]
    suffix = uuid.uuid4().hex[:6]
    # The config's price is not the catalog's: the plan must price from the adapter's answer.
    east = lambda_harness.site.model_copy(update={"geography": "us-east", "price_per_gpu_hour": 3.5})
    west = lambda_harness.site.model_copy(update={
        "name": f"lambda-us-west-1-{suffix}", "region": "us-west-1", "geography": "us-west", "gpu": "A10",
        "gpus_per_machine": 1, "gpu_memory_gb": 24, "instance_type": LAMBDA_A10, "price_per_gpu_hour": 0.75})
    spot = aws_harness.site.model_copy(update={
        "geography": "us-east", "capacity_type": CapacityType.SPOT, "price_per_gpu_hour": 1.5})
    fake = FakeKube().start()
    cluster = KubernetesCluster(api_client=fake.api_client(), namespace="gpufleet")
    config = FleetConfig(mode="real", accounts=[lambda_harness.account, aws_harness.account],
                         sites=[east, west, spot])
    env = FleetEnv(Settings(state_dir=tmp_path), config, cluster)  # providers from config: the real adapters
    yield Fleet(fake, cluster, env, DemandActivities(env), CapacityActivities(env),
                {s.name: s for s in config.sites}, east, west, spot)
    fake.stop()


async def test_pending_pods_buy_capacity_that_satisfies_them_in_real_mode(fleet: Fleet, temporal_env,
                                                                          lambda_harness) -> None:
    f = fleet
    # plan_demand asks Temporal for SpotReclaims' replacements in flight (none here).
    env = ActivityEnvironment(client=temporal_env.client)
    # A fleet node at the east site, 6 of its 8 GPUs taken; only the join's site label so far.
    f.fake.add_node("gpu-existing", labels={LABEL_SITE: f.east.name}, gpus=8,
                    taints=[{"key": DEMAND_TAINT_KEY, "effect": "NoSchedule"}])
    f.running("gpu-existing", "busy", gpus=6)
    f.pending("west", 1, **{LABEL_GEOGRAPHY: "us-west"})
    f.pending("h100", 8, **{LABEL_GPU_PRODUCT: "H100"})
    f.pending("no-spot", 8, **{LABEL_GPU_PRODUCT: "H100", LABEL_CAPACITY_TYPE: "on-demand"})
    f.pending("fits", 2, **{LABEL_GEOGRAPHY: "us-east"})
    f.pending("nominated", 2, nominated="gpu-existing", **{LABEL_GEOGRAPHY: "us-east"})
    f.pending("plain", 1, opted_in=False)

    batch = await env.run(f.demand.watch_demand, WatchDemandInput(
        batch_idle_seconds=0.2, batch_max_seconds=2, wait_seconds=5, poll_seconds=0.05))
    assert batch.new == ["ml/fits", "ml/h100", "ml/no-spot", "ml/west"], "opted in, Pending, not nominated"
    assert set(batch.present) == {f"ml/{n}" for n in ("busy", "west", "h100", "no-spot", "fits", "nominated",
                                                      "plain")}
    assert any(r[:3] == ("list", "", "pods") for r in f.fake.requests)
    # The watch put the fleet's labels on the node through the API server ("fits" selects one).
    node_labels = f.fake.get("", "nodes", "", "gpu-existing")["metadata"]["labels"]
    assert {k: node_labels.get(k) for k in site_labels(f.east)} == site_labels(f.east)
    assert ("patch", "", "nodes", "", "") in f.fake.requests

    catalog = await env.run(f.capacity.get_catalog, GetCatalogInput(max_age_seconds=60))
    prices = {f"{o.site}/{o.instance_type}": o.price_per_gpu_hour for o in catalog.offers}
    assert prices[f"{f.east.name}/{LAMBDA_H100}"] == 2.99  # 2392 cents for 8 GPUs, from the fake
    assert prices[f"{f.west.name}/{LAMBDA_A10}"] == 0.75

    result = await env.run(f.demand.plan_demand, PlanDemandInput(offers=catalog.offers, accounts=catalog.accounts))
    plan = result.plan
    assert result.labelled == [], "the watch labelled it already"
    assert plan.covered == {"ml/fits": "fits on gpu-existing (room for 2 GPU)"}
    assert set(plan.ignored) == {"ml/nominated", "ml/plain"}
    assert "nominated gpu-existing" in plan.ignored["ml/nominated"]
    assert plan.unplaceable == {}
    bought = {pod: m for m in plan.machines for pod in m.pods}
    assert set(bought) == {"ml/west", "ml/h100", "ml/no-spot"} and len(plan.machines) == 3
    pods = {p.key: p for p in f.cluster.list_gpu_pods()}
    for key, machine in bought.items():
        labels = site_labels(f.sites[machine.site])
        assert all(labels.get(k) == v for k, v in pods[key].node_selector.items()), (key, machine.offer)
        assert machine.gpus >= pods[key].gpus
        assert machine.price_per_gpu_hour == prices[machine.offer], "priced from the adapter's catalog"
    assert bought["ml/west"].offer == f"{f.west.name}/{LAMBDA_A10}"
    assert bought["ml/h100"].offer == f"{f.spot.name}/{f.spot.instance_type}", "the cheapest H100 is spot"
    assert bought["ml/no-spot"].offer == f"{f.east.name}/{LAMBDA_H100}"
    assert bought["ml/no-spot"].capacity_type == CapacityType.ON_DEMAND
    assert lambda_harness.machine_count() == 0, "planning buys nothing by itself"

    # Seen again while those purchases join: nothing is bought twice, nothing wakes the loop.
    joining = [JoiningMachine(purchase=f"capacity/demand-{i}", site=m.site, gpus=m.gpus,
                              capacity_type=m.capacity_type) for i, m in enumerate(plan.machines)]
    again = await env.run(f.demand.plan_demand, PlanDemandInput(
        offers=catalog.offers, accounts=catalog.accounts, joining=joining))
    assert again.plan.machines == []
    assert set(again.plan.covered) == {"ml/fits", "ml/west", "ml/h100", "ml/no-spot"}
    quiet = await env.run(f.demand.watch_demand, WatchDemandInput(
        known=batch.new, batch_idle_seconds=0.2, batch_max_seconds=2, wait_seconds=0.3, poll_seconds=0.05))
    assert quiet.new == []


def test_consolidation_drains_through_the_eviction_api_and_honours_pdbs(fleet: Fleet, lambda_harness) -> None:
    f = fleet
    site = f.east
    idle_machine = f.joined(site, "gpu-idle")
    awaited_machine = f.joined(site, "gpu-awaited")
    f.joined(site, "gpu-busy")
    f.running("gpu-busy", "server", gpus=8)
    f.pending("next", 8, nominated="gpu-awaited", **{LABEL_GPU_PRODUCT: "H100"})
    # No GPU pod, but a CPU pod whose budget allows no disruption.
    f.running("gpu-idle", "keeper", labels={"app": "keeper"})
    f.fake.set_pdb("ml", "keeper", {"app": "keeper"}, min_available=1)

    found = run(f.demand.idle_nodes)
    idle = {n.name: n for n in found.idle}
    assert set(idle) == {"gpu-idle", "gpu-awaited"}
    assert idle["gpu-idle"].machine_id == idle_machine, "the machine from the join's identity record"
    assert idle["gpu-awaited"].awaited and not idle["gpu-idle"].awaited
    assert found.site_nodes == {site.name: 3}
    chosen, kept = consolidate(found.idle, found.site_nodes, found.site_min, {}, time.time() + 1,
                               ConsolidationSettings(idle_ttl_seconds=0, max_site_fraction=1))
    assert [(r.node, r.machine_id) for r in chosen] == [("gpu-idle", idle_machine)]
    assert "gpu-awaited" in kept

    blocked = run(f.capacity.drain_within, DrainNodeInput(node_name="gpu-idle", deadline_seconds=0.5))
    assert not blocked.completed
    assert [(p.key, "disruption budget" in p.reason) for p in blocked.blocked] == [("ml/keeper", True)]
    evictions = [r for r in f.fake.requests if r[:4] == ("create", "", "pods", "eviction")]
    assert evictions, "the drain asked the Eviction subresource"
    assert not [r for r in f.fake.requests if r[:3] == ("delete", "", "pods")], "no PDB bypass"
    # Kept: cordoned, its pod still there, the machine still billing at the provider.
    assert f.fake.get("", "nodes", "", "gpu-idle")["spec"].get("unschedulable") is True
    assert f.fake.get("", "pods", "ml", "keeper") is not None
    live = {i["id"] for i in lambda_harness.fake.live_instances()}
    assert {idle_machine, awaited_machine} <= live

    # Without the budget the same drain completes through evictions, and the node is retired.
    f.fake.delete_pdb("ml", "keeper")
    drained = run(f.capacity.drain_within, DrainNodeInput(node_name="gpu-idle", deadline_seconds=5))
    assert drained.completed and [p.key for p in drained.evicted] == ["ml/keeper"]
    assert f.fake.get("", "pods", "ml", "keeper") is None
    run(f.capacity.retire_machine, RetireMachineInput(site=site.name, node_name="gpu-idle",
                                                      machine_id=idle_machine))
    live = {i["id"] for i in lambda_harness.fake.live_instances()}
    assert idle_machine not in live and awaited_machine in live
    assert f.fake.get("", "nodes", "", "gpu-idle") is None
    assert f.cluster.node_identity("gpu-idle") is None
    assert {n.name for n in run(f.demand.idle_nodes).idle} == {"gpu-awaited"}
