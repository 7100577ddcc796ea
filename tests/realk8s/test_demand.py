"""The demand loop's activities in ``mode: real`` (issue 18), on the real control plane.

Pods and nodes live in the real API server (field-selected pod lists and a real watch, node label
patches, the Eviction subresource with a real PodDisruptionBudget and the disruption controller);
offers and machines come from the real provider adapters against their wire-level fakes (the
Lambda Cloud fake, moto for a spot EC2 site). The activities run as the control-plane worker runs
them, as its service account under the shipped RBAC (in a namespace of the test's own, where the
account guard's store and the joins' identity records are), with the account guard's store in
the cluster, as ``mode: real`` keeps it.

Nodes are Node objects the admin writes (Ready, GPUs allocatable, the fleet taint); their pods
are bound and reported Running as their kubelet would. The Pending pods name a scheduler of the
test's own, which records that it could not place them (``PodScheduled=False``, ``Unschedulable``,
and a nomination) as kube-scheduler does: the plan's inputs stay what the test says while the
loop reads them, where kube-scheduler would bind "fits" the moment the watch labels the node.
kube-scheduler's own verdicts, read by the loop: tests/realk8s/test_fleet.py.

Moved from tests/providers/test_demand_real.py, which ran it against the fake API server.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from temporalio.testing import ActivityEnvironment

from activities.capacity import CapacityActivities
from activities.demand import DemandActivities
from activities.env import FleetEnv
from activities.watches import WatchActivities
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
from fleet.messages.watches import DemandWatchInput
from fleet.models import CapacityType, MachineSpec
from fleet.settings import Settings
from providers.cluster.kubernetes import KubernetesCluster
from tests.realk8s.cluster import RealCluster
from tests.realk8s.contract import bind_serving_role, ensure_namespace, now
from tests.realk8s.test_adapter import record_requests

TOLERATE = [{"key": DEMAND_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
LAMBDA_H100 = "gpu_8x_h100_sxm5"
LAMBDA_A10 = "gpu_1x_a10"
#: The scheduler the Pending pods name: the test's own (see the module doc).
SCHEDULER = "gpufleet-test-scheduler"
MERGE = "application/merge-patch+json"


def run(activity_fn, *args):
    """The activity as the worker runs it (sync tests: no event loop of their own)."""
    result = ActivityEnvironment().run(activity_fn, *args)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def _ok(answer, *expected):
    status, body = answer
    assert status in (expected or (200, 201)), (status, body)
    return body


@dataclass
class Fleet:
    real: RealCluster
    cluster: KubernetesCluster
    env: FleetEnv
    demand: DemandActivities
    capacity: CapacityActivities
    sites: dict[str, Site]
    east: Site
    west: Site
    spot: Site
    #: Where the pods live (``ml`` on the fake API server): ``ml-<suffix>``.
    ns: str
    seen: list = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)

    def key(self, name: str) -> str:
        return f"{self.ns}/{name}"

    def node(self, name: str) -> str:
        """The cluster-wide name of the test's node ``name`` (Nodes are shared by the tier's tests)."""
        return f"{name}-{self.ns}"

    def pending(self, name: str, gpus: int, *, nominated: str = "", opted_in: bool = True, **selector: str) -> None:
        """A pod the scheduler could not place; opted in: the fleet toleration and node selector."""
        _ok(self.real.request("POST", f"/api/v1/namespaces/{self.ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": self.ns},
            "spec": {"schedulerName": SCHEDULER, "automountServiceAccountToken": False,
                     "nodeSelector": {LABEL_FLEET: "true", **selector} if opted_in else selector,
                     "tolerations": TOLERATE if opted_in else [],
                     "containers": [{"name": "c", "image": "vllm", "resources": {
                         "requests": {GPU_RESOURCE: str(gpus)}, "limits": {GPU_RESOURCE: str(gpus)}}}]}},
            admin=True), 201)
        status = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                  "lastTransitionTime": now(),
                                  "message": f"0/1 nodes are available: 1 Insufficient {GPU_RESOURCE}."}]}
        if nominated:
            status["nominatedNodeName"] = self.node(nominated)
        _ok(self.real.request("PATCH", f"/api/v1/namespaces/{self.ns}/pods/{name}/status", {"status": status},
                              admin=True, content_type=MERGE), 200)

    def running(self, node: str, name: str, gpus: int = 0, labels: dict[str, str] | None = None) -> None:
        """A pod bound to ``node`` and running, as the kubelet leaves it."""
        resources = {"requests": {GPU_RESOURCE: str(gpus)}, "limits": {GPU_RESOURCE: str(gpus)}} if gpus else {}
        _ok(self.real.request("POST", f"/api/v1/namespaces/{self.ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": self.ns, "labels": labels or {}},
            "spec": {"nodeName": self.node(node), "tolerations": TOLERATE, "automountServiceAccountToken": False,
                     "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": "vllm", "resources": resources}]}}, admin=True), 201)
        _ok(self.real.request("PATCH", f"/api/v1/namespaces/{self.ns}/pods/{name}/status", {"status": {
            "phase": "Running", "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now()}]}},
            admin=True, content_type=MERGE), 200)

    def mirror_pods(self, node: str, count: int, gpus: int) -> list[str]:
        """Static pods' mirrors as ``node``'s kubelet publishes them, each asking for ``gpus`` and
        named as long as a pod may be (253 characters): made as ``system:node:<node>`` under
        NodeRestriction (bound to itself, annotated ``kubernetes.io/config.mirror``, owned by its
        Node), what a hostile node may write at will. Their keys."""
        name, uid = self.node(node), self.get_node(node)["metadata"]["uid"]
        as_node = {"Impersonate-User": f"system:node:{name}", "Impersonate-Group": "system:nodes"}
        names = [f"{i:05d}-{'m' * 247}" for i in range(count)]

        def publish(pod: str) -> None:
            _ok(self.real.request("POST", f"/api/v1/namespaces/{self.ns}/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": {
                    "name": pod, "namespace": self.ns, "annotations": {"kubernetes.io/config.mirror": "static"},
                    "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid,
                                         "controller": True}]},
                "spec": {"nodeName": name, "tolerations": TOLERATE, "automountServiceAccountToken": False,
                         "containers": [{"name": "c", "image": "static", "resources": {
                             "limits": {GPU_RESOURCE: str(gpus)}}}]}}, admin=True, headers=as_node), 201)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(publish, names))
        return [self.key(pod) for pod in names]

    def add_node(self, node: str, labels: dict[str, str], gpus: int = 8, provider_id: str = "") -> None:
        """A Node as its kubelet registered it, Ready, with the fleet taint every gpufleet node keeps."""
        name = self.node(node)
        _ok(self.real.request("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
            "spec": {"taints": [{"key": DEMAND_TAINT_KEY, "effect": "NoSchedule"}],
                     **({"providerID": provider_id} if provider_id else {})}}, admin=True), 201)
        self.nodes.append(name)
        resources = {GPU_RESOURCE: str(gpus), "cpu": "64", "memory": "256Gi", "pods": "110"}
        _ok(self.real.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": {
            "capacity": resources, "allocatable": resources, "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now(),
                 "lastTransitionTime": now()}]}}, admin=True, content_type=MERGE), 200)
        deadline = time.monotonic() + 30
        while any(t["key"].startswith("node.kubernetes.io/") for t in self.get_node(node)["spec"].get("taints") or []):
            assert time.monotonic() < deadline, f"the controller kept {name} tainted"
            time.sleep(0.05)

    def get_node(self, node: str) -> dict | None:
        status, answer = self.real.request("GET", f"/api/v1/nodes/{self.node(node)}", admin=True)
        assert status in (200, 404), answer
        return answer if status == 200 else None

    def get_pod(self, name: str) -> dict | None:
        status, answer = self.real.request("GET", f"/api/v1/namespaces/{self.ns}/pods/{name}", admin=True)
        assert status in (200, 404), answer
        return answer if status == 200 else None

    def set_pdb(self, name: str, selector: dict[str, str], min_available: int) -> None:
        path = f"/apis/policy/v1/namespaces/{self.ns}/poddisruptionbudgets"
        _ok(self.real.request("POST", path, {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                                             "metadata": {"name": name}, "spec": {
                                                 "minAvailable": min_available, "selector": {"matchLabels": selector}}},
                              admin=True), 201)
        deadline = time.monotonic() + 30  # the disruption controller's first look, which evictions wait for
        while (_ok(self.real.request("GET", f"{path}/{name}", admin=True), 200).get("status") or {}).get(
                "observedGeneration") != 1:
            assert time.monotonic() < deadline, f"the disruption controller did not observe {name}"
            time.sleep(0.05)

    def delete_pdb(self, name: str) -> None:
        _ok(self.real.request("DELETE", f"/apis/policy/v1/namespaces/{self.ns}/poddisruptionbudgets/{name}",
                              admin=True), 200)

    def joined(self, site: Site, node: str, gpus: int = 8) -> str:
        """A machine bought at the provider fake and its node registered, as a join leaves
        them: the Node object with the site label, and the join's identity record."""
        name = self.node(node)
        account = self.env.config.account_for(site)
        machine = self.env.provider(site.name).create_machine(MachineSpec(
            name=name, site=site.name, region=site.region, instance_type=site.instance_type, gpu=site.gpu,
            gpus=site.gpus_per_machine, capacity_type=site.capacity_type, image=site.image), f"join/{name}")
        provider_id = gpufleet_provider_id(site.provider, account.name, name)
        self.add_node(node, {LABEL_SITE: site.name}, gpus=gpus, provider_id=provider_id)
        identity = NodeIdentity(node_name=name, machine_id=machine.id, provider=site.provider, account=account.name,
                                site=site.name, provider_id=provider_id, join_id=f"join/{name}")
        self.cluster.update_state(NODE_IDENTITY_KIND, name, lambda _old: identity.state())
        return machine.id


@pytest.fixture
def fleet(lambda_harness, aws_harness, tmp_path, real_cluster):
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
    state_ns, ml = f"demand-{suffix}", f"ml-{suffix}"
    for namespace in (state_ns, ml):
        ensure_namespace(real_cluster, namespace)
    bind_serving_role(real_cluster, state_ns)
    token = real_cluster.service_account_token("gpufleet", "gpufleet-control-plane")
    cluster = KubernetesCluster(api_client=real_cluster.api_client(token), namespace=state_ns)
    config = FleetConfig(mode="real", accounts=[lambda_harness.account, aws_harness.account],
                         sites=[east, west, spot])
    env = FleetEnv(Settings(state_dir=tmp_path), config, cluster)  # providers from config: the real adapters
    made = Fleet(real_cluster, cluster, env, DemandActivities(env), CapacityActivities(env),
                 {s.name: s for s in config.sites}, east, west, spot, ml)
    made.seen = record_requests(cluster)
    yield made
    cluster.api_client.close()
    real_cluster.request("DELETE", f"/api/v1/namespaces/{ml}/pods", {"apiVersion": "v1", "kind": "DeleteOptions",
                                                                      "gracePeriodSeconds": 0}, admin=True)
    for name in made.nodes:
        real_cluster.request("DELETE", f"/api/v1/nodes/{name}", admin=True)
    for namespace in (state_ns, ml):
        real_cluster.request("DELETE", f"/api/v1/namespaces/{namespace}", admin=True)


async def test_pending_pods_buy_capacity_that_satisfies_them_in_real_mode(fleet: Fleet, temporal_env,
                                                                          lambda_harness) -> None:
    f = fleet
    # plan_demand asks Temporal for SpotReclaims' replacements in flight (none here).
    env = ActivityEnvironment(client=temporal_env.client)
    # A fleet node at the east site, 6 of its 8 GPUs taken; only the join's site label so far.
    f.add_node("gpu-existing", {LABEL_SITE: f.east.name}, gpus=8)
    f.running("gpu-existing", "busy", gpus=6)
    f.pending("west", 1, **{LABEL_GEOGRAPHY: "us-west"})
    f.pending("h100", 8, **{LABEL_GPU_PRODUCT: "H100"})
    f.pending("no-spot", 8, **{LABEL_GPU_PRODUCT: "H100", LABEL_CAPACITY_TYPE: "on-demand"})
    f.pending("fits", 2, **{LABEL_GEOGRAPHY: "us-east"})
    f.pending("nominated", 2, nominated="gpu-existing", **{LABEL_GEOGRAPHY: "us-east"})
    f.pending("plain", 1, opted_in=False)

    batch = await env.run(f.demand.watch_demand, WatchDemandInput(
        batch_idle_seconds=0.2, batch_max_seconds=2, wait_seconds=5, poll_seconds=0.05))
    mine = lambda keys: sorted(k for k in keys if k.startswith(f"{f.ns}/"))  # noqa: E731 - the tier's others aside
    assert mine(batch.new) == [f.key(n) for n in ("fits", "h100", "no-spot", "west")], "opted in, Pending, not nominated"
    assert mine(batch.present) == sorted(f.key(n) for n in ("busy", "west", "h100", "no-spot", "fits", "nominated",
                                                            "plain"))
    assert any(method == "GET" and path == "/api/v1/pods" for method, path, _ in f.seen)
    # The watch put the fleet's labels on the node through the API server ("fits" selects one).
    node_labels = f.get_node("gpu-existing")["metadata"]["labels"]
    assert {k: node_labels.get(k) for k in site_labels(f.east)} == site_labels(f.east)
    assert any(method == "PATCH" and path == f"/api/v1/nodes/{f.node('gpu-existing')}" for method, path, _ in f.seen)

    catalog = await env.run(f.capacity.get_catalog, GetCatalogInput(max_age_seconds=60))
    prices = {f"{o.site}/{o.instance_type}": o.price_per_gpu_hour for o in catalog.offers}
    assert prices[f"{f.east.name}/{LAMBDA_H100}"] == 2.99  # 2392 cents for 8 GPUs, from the fake
    assert prices[f"{f.west.name}/{LAMBDA_A10}"] == 0.75

    result = await env.run(f.demand.plan_demand, PlanDemandInput(offers=catalog.offers, accounts=catalog.accounts))
    plan = result.plan
    assert result.labelled == [], "the watch labelled it already"
    assert {k: v for k, v in plan.covered.items() if k.startswith(f"{f.ns}/")} == {
        f.key("fits"): f"fits on {f.node('gpu-existing')} (room for 2 GPU)"}
    assert mine(plan.ignored) == [f.key("nominated"), f.key("plain")]
    assert f"nominated {f.node('gpu-existing')}" in plan.ignored[f.key("nominated")]
    assert plan.unplaceable == {}
    bought = {pod: m for m in plan.machines for pod in m.pods}
    assert set(bought) == {f.key("west"), f.key("h100"), f.key("no-spot")} and len(plan.machines) == 3
    pods = {p.key: p for p in f.cluster.list_gpu_pods()}
    for key, machine in bought.items():
        labels = site_labels(f.sites[machine.site])
        assert all(labels.get(k) == v for k, v in pods[key].node_selector.items()), (key, machine.offer)
        assert machine.gpus >= pods[key].gpus
        assert machine.price_per_gpu_hour == prices[machine.offer], "priced from the adapter's catalog"
    assert bought[f.key("west")].offer == f"{f.west.name}/{LAMBDA_A10}"
    assert bought[f.key("h100")].offer == f"{f.spot.name}/{f.spot.instance_type}", "the cheapest H100 is spot"
    assert bought[f.key("no-spot")].offer == f"{f.east.name}/{LAMBDA_H100}"
    assert bought[f.key("no-spot")].capacity_type == CapacityType.ON_DEMAND
    assert lambda_harness.machine_count() == 0, "planning buys nothing by itself"

    # Seen again while those purchases join: nothing is bought twice, nothing wakes the loop.
    joining = [JoiningMachine(purchase=f"capacity/demand-{i}", site=m.site, gpus=m.gpus,
                              capacity_type=m.capacity_type) for i, m in enumerate(plan.machines)]
    again = await env.run(f.demand.plan_demand, PlanDemandInput(
        offers=catalog.offers, accounts=catalog.accounts, joining=joining))
    assert again.plan.machines == []
    assert mine(again.plan.covered) == sorted(f.key(n) for n in ("fits", "west", "h100", "no-spot"))
    quiet = await env.run(f.demand.watch_demand, WatchDemandInput(
        known=batch.new, batch_idle_seconds=0.2, batch_max_seconds=2, wait_seconds=0.3, poll_seconds=0.05))
    assert mine(quiet.new) == []


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
    f.set_pdb("keeper", {"app": "keeper"}, min_available=1)

    found = run(f.demand.idle_nodes)
    idle = {n.name: n for n in found.idle}
    idle_node, awaited_node = f.node("gpu-idle"), f.node("gpu-awaited")
    assert set(idle) == {idle_node, awaited_node}
    assert idle[idle_node].machine_id == idle_machine, "the machine from the join's identity record"
    assert idle[awaited_node].awaited and not idle[idle_node].awaited
    assert found.site_nodes == {site.name: 3}
    chosen, kept = consolidate(found.idle, found.site_nodes, found.site_min, {}, time.time() + 1,
                               ConsolidationSettings(idle_ttl_seconds=0, max_site_fraction=1))
    assert [(r.node, r.machine_id) for r in chosen] == [(idle_node, idle_machine)]
    assert awaited_node in kept

    blocked = run(f.capacity.drain_within, DrainNodeInput(node_name=idle_node, deadline_seconds=0.5))
    assert not blocked.completed
    assert [(p.key, "disruption budget" in p.reason) for p in blocked.blocked] == [(f.key("keeper"), True)]
    evictions = [r for r in f.seen if r[0] == "POST" and r[1].endswith("/pods/keeper/eviction")]
    assert evictions, "the drain asked the Eviction subresource"
    assert not [r for r in f.seen if r[0] == "DELETE" and "/pods/" in r[1]], "no PDB bypass"
    # Kept: cordoned, its pod still there, the machine still billing at the provider.
    assert f.get_node("gpu-idle")["spec"].get("unschedulable") is True
    assert f.get_pod("keeper") is not None
    live = {i["id"] for i in lambda_harness.fake.live_instances()}
    assert {idle_machine, awaited_machine} <= live

    # Without the budget the same drain completes through evictions, and the node is retired.
    f.delete_pdb("keeper")
    drained = run(f.capacity.drain_within, DrainNodeInput(node_name=idle_node, deadline_seconds=10))
    assert drained.completed and [p.key for p in drained.evicted] == [f.key("keeper")]
    assert f.get_pod("keeper") is None
    run(f.capacity.retire_machine, RetireMachineInput(site=site.name, node_name=idle_node,
                                                      machine_id=idle_machine))
    live = {i["id"] for i in lambda_harness.fake.live_instances()}
    assert idle_machine not in live and awaited_machine in live
    assert f.get_node("gpu-idle") is None
    assert f.cluster.node_identity(idle_node) is None
    assert {n.name for n in run(f.demand.idle_nodes).idle} == {awaited_node}


#: The mirror pods the hostile node publishes: 263-character keys, about 80 KB of names.
MIRRORS = 300
#: What the Demand watch's result may weigh here, whatever the node publishes: a few pods' and
#: nodes' names (its lists' own caps, ``MAX_NEW_PODS`` and ``MAX_BUSY_NODES``, keep it under
#: 2 MiB however many Pending pods and busy nodes there are).
WAKE_BYTES = 16 * 1024


async def test_a_nodes_mirror_pods_neither_grow_the_demand_watch_nor_keep_the_node_and_a_pending_pod_is_bought_for(
        fleet: Fleet, temporal_env) -> None:
    """A node is hostile. Its kubelet may publish mirror pods of any name, each asking for GPUs:
    about 6,600 with the longest names carried the Demand watch's result (every GPU pod's key)
    past Temporal's 2 MiB payload limit, failing every pass, and the fleet bought nothing for
    real Pending pods. The watch's result names none of them and stays the same small size; a
    real Pending pod is still planned onto a machine; and the node, whose only GPU pods are its own
    static ones, is idle (consolidation gives it back)."""
    from temporalio.contrib.pydantic import pydantic_data_converter

    f = fleet
    env = ActivityEnvironment(client=temporal_env.client)
    f.joined(f.east, "gpu-hostile")
    mirrors = f.mirror_pods("gpu-hostile", MIRRORS, gpus=1)
    assert len(mirrors[0]) > 260
    f.pending("h100", 8, **{LABEL_GPU_PRODUCT: "H100"})

    wake = await env.run(WatchActivities(f.env).watch_demand_events, DemandWatchInput(
        batch_idle_seconds=0.2, batch_max_seconds=2, wait_seconds=10, poll_seconds=0.05))
    assert wake.why == "pods" and [k for k in wake.batch.new if k.startswith(f"{f.ns}/")] == [f.key("h100")]
    (payload,) = pydantic_data_converter.payload_converter.to_payloads([wake])
    assert payload.ByteSize() < WAKE_BYTES, f"the watch's result is {payload.ByteSize()} bytes"
    assert not set(mirrors) & {*wake.batch.new, *wake.batch.present}
    assert f.node("gpu-hostile") not in wake.busy, "its own static pods make no node busy"

    catalog = await env.run(f.capacity.get_catalog, GetCatalogInput(max_age_seconds=60))
    plan = (await env.run(f.demand.plan_demand, PlanDemandInput(offers=catalog.offers,
                                                                accounts=catalog.accounts))).plan
    assert f.key("h100") in {pod for machine in plan.machines for pod in machine.pods}, plan
    idle = await env.run(f.demand.idle_nodes)
    assert f.node("gpu-hostile") in {n.name for n in idle.idle}


#: The Demand watch's whole wait in the batch tests: longer than a watch chunk (``RECHECK_SECONDS``),
#: so the first chunk's 30 s, not the wait, is what an unbounded read would end at.
BATCH_WAIT_SECONDS = 60
#: Far above any batch window here: only a watch that hangs meets it (no timing is asserted by it).
BATCH_HANG_GUARD_SECONDS = 120


async def _pods_added_while_the_demand_watch_waits(f: Fleet, input: DemandWatchInput, *pods: tuple[float, str]):
    """The Demand watch's wake, each of ``pods`` (seconds after the first, name) created as an
    opted-in Pending pod once the watch's real watch streams (the API server answered it): each
    comes as events in a chunk already running, with nothing after it."""
    async def add() -> None:
        while not any(r[1] == "/api/v1/pods" and "watch=" in r[2] and r.status == 200 for r in f.seen):
            await asyncio.sleep(0.05)
        started = time.monotonic()
        for at, name in pods:
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            await asyncio.to_thread(f.pending, name, 8, **{LABEL_GPU_PRODUCT: "H100"})

    adding = asyncio.ensure_future(add())
    env = ActivityEnvironment()
    try:
        wake = await asyncio.wait_for(env.run(WatchActivities(f.env).watch_demand_events, input),
                                      BATCH_HANG_GUARD_SECONDS)
    finally:
        adding.cancel()
    await asyncio.gather(adding, return_exceptions=True)
    return wake


def _pending_now(f: Fleet) -> list[str]:
    """Pending pods the tier's other tests left (the loop would have an answer for them)."""
    return [p.key for p in f.cluster.list_gpu_pods(pending_only=True)]


async def test_a_pending_pod_closes_its_batch_after_the_idle_window_with_no_further_event(fleet: Fleet) -> None:
    """One opted-in Pending pod, then nothing: the batch closes ``batch_idle_seconds`` after it, as
    the loop's window promises, on a real API server whose watch sends nothing more. Before, the
    real watch looked at the batch's deadlines only at its next event or at its chunk's end (up to
    30 s): the batch closed then, with ``window_seconds`` the rest of the chunk, far past
    ``batch_max_seconds``."""
    f = fleet
    input = DemandWatchInput(known=_pending_now(f), batch_idle_seconds=1, batch_max_seconds=10,
                             wait_seconds=BATCH_WAIT_SECONDS, poll_seconds=0.05)
    wake = await _pods_added_while_the_demand_watch_waits(f, input, (0.0, "alone"))
    assert wake.why == "pods" and wake.batch.new == [f.key("alone")], wake
    assert input.batch_idle_seconds <= wake.batch.window_seconds < input.batch_max_seconds / 2, wake.batch


async def test_a_pending_pod_inside_the_idle_window_joins_the_batch_which_closes_after_it(fleet: Fleet) -> None:
    """A second Pending pod 1 s after the first, inside the 2 s idle window: one batch holds both,
    closed the idle window after the second (not at the chunk's end, nor at the first's window)."""
    f = fleet
    input = DemandWatchInput(known=_pending_now(f), batch_idle_seconds=2, batch_max_seconds=10,
                             wait_seconds=BATCH_WAIT_SECONDS, poll_seconds=0.05)
    wake = await _pods_added_while_the_demand_watch_waits(f, input, (0.0, "first"), (1.0, "second"))
    assert wake.why == "pods" and wake.batch.new == [f.key("first"), f.key("second")], wake
    assert input.batch_idle_seconds <= wake.batch.window_seconds < input.batch_max_seconds / 2, wake.batch
