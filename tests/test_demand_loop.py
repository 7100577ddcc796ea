"""The demand loop (workflow ``Demand``) on the real dev server and the simulated fleet:
Pending pods buy the cheapest qualifying machines once, the scheduler binds them, idle
nodes go back; active-passive fails over and returns to zero; spot share after a reclaim."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.testing import WorkflowEnvironment

from fleet.cluster import LABEL_GPU_PRODUCT, LABEL_MODEL, LABEL_SITE
from fleet.demand import DEMAND_TAINT_KEY, LABEL_CAPACITY_TYPE, LABEL_FLEET, LABEL_GEOGRAPHY, GpuPod, Toleration
from fleet.messages.demand import DemandStatus
from tests.capacity_fleet import FAST_JOIN, CapStack, capacity_fleet, open_stack
from tests.conftest import wait_for

FAST = {"tick_seconds": 0.5, "batch_idle_seconds": 0.3, "batch_max_seconds": 2, "idle_ttl_seconds": 1,
        "max_site_fraction": 1, "purchase_deadline_seconds": 20, "drain_seconds": 2,
        "capacity_request": {"join_timeouts": FAST_JOIN, "backoff_seconds": 1}}


def demand_pod(name: str, gpus: int = 1, model: str = "", **selector: str) -> GpuPod:
    return GpuPod(namespace="ml", name=name, gpus=gpus, labels={LABEL_MODEL: model} if model else {},
                  node_selector={LABEL_FLEET: "true", **selector},
                  tolerations=[Toleration(key=DEMAND_TAINT_KEY, operator="Exists", effect="NoSchedule")])


async def open_demand(temporal_env: WorkflowEnvironment, tmp_path: Path, models: dict | None = None,
                      **overrides) -> AsyncIterator[CapStack]:
    uid = uuid.uuid4().hex[:6]
    fleet = capacity_fleet(uid, **overrides)
    if models:
        fleet["models"] = {name: {**policy, "sites": [f"{s}-{uid}" for s in policy["sites"]],
                                  "standby_sites": [f"{s}-{uid}" for s in policy.get("standby_sites", [])]}
                           for name, policy in models.items()}
    address = temporal_env.client.service_client.config.target_host
    async for stack in open_stack(temporal_env.client, address, tmp_path, fleet=fleet, uid=uid):
        yield stack


async def start_demand(cap: CapStack, **overrides):
    return await cap.client.start_workflow(
        "Demand", {**FAST, **overrides}, id=f"demand-{cap.uid}", task_queue=cap.settings.task_queue)


async def status(handle) -> DemandStatus:
    return await handle.query("status", result_type=DemandStatus)


def bound(cap: CapStack) -> dict[str, str]:
    return {p.key: p.node for p in cap.cluster.list_gpu_pods() if p.node}


def purchases(cap: CapStack) -> int:
    return sum(1 for m in cap.world.query("SELECT * FROM machines") if True)


@pytest.fixture
async def cap(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[CapStack]:
    async for stack in open_demand(temporal_env, tmp_path):
        yield stack


async def test_pending_pods_buy_the_cheapest_qualifying_machines_once_and_idle_nodes_go_back(cap: CapStack):
    handle = await start_demand(cap)
    eu = [demand_pod(f"eu-{i}", **{LABEL_GEOGRAPHY: "eu", LABEL_CAPACITY_TYPE: "on-demand"}) for i in range(3)]
    us = demand_pod("us-0", 2, **{LABEL_GEOGRAPHY: "us-east", LABEL_GPU_PRODUCT: "H100"})
    for pod in [*eu, us]:
        cap.cluster.create_pod(pod)
    placed = await wait_for(lambda: len(bound(cap)) == 4 and bound(cap), timeout=60)
    nodes = {n.name: n for n in cap.cluster.list_nodes()}
    # eu on-demand: "mid" (the eu spot site is excluded); us-east: "cheap".
    assert {nodes[placed[p.key]].labels[LABEL_SITE] for p in eu} == {cap.site("mid")}
    assert nodes[placed["ml/us-0"]].labels[LABEL_SITE] == cap.site("cheap")
    assert len(nodes) == 3  # 3 eu GPUs on two 2-GPU machines, one for us-0: nothing else
    # Seen again and again (several ticks): nothing more is bought.
    await asyncio.sleep(2)
    assert len(cap.cluster.list_nodes()) == 3
    state = await status(handle)
    assert len([p for p in state.purchases]) == 3
    assert all("→" in line for line in state.log if "capacity/demand-" in line and "joined" not in line)
    # The pods go: the idle nodes are drained and retired (sites' min is 0).
    for key in placed:
        cap.cluster.delete_pod(*key.split("/"))
    await wait_for(lambda: not cap.cluster.list_nodes(), timeout=60)
    state = await status(handle)
    assert any(line.split(" ", 1)[1].startswith("retired") for line in state.log)


async def test_active_passive_fails_over_and_returns_to_zero(temporal_env, tmp_path):
    models = {"llm": {"mode": "active-passive", "sites": ["dear"], "standby_sites": ["cheap"]}}
    async for cap in open_demand(temporal_env, tmp_path, models=models):
        handle = await start_demand(cap)
        cap.cluster.create_pod(demand_pod("r0", model="llm"))
        await wait_for(lambda: bound(cap), timeout=60)
        assert {n.labels[LABEL_SITE] for n in cap.cluster.list_nodes()} == {cap.site("dear")}
        # The primary has no capacity: the passive site serves.
        cap.world.set_site(cap.site("dear"), capacity=0)
        await cap.refresh_catalog()
        cap.cluster.create_pod(demand_pod("r1", gpus=2, model="llm"))
        await wait_for(lambda: "ml/r1" in bound(cap), timeout=60)
        node = bound(cap)["ml/r1"]
        assert cap.cluster.get_node(node).labels[LABEL_SITE] == cap.site("cheap")
        # The primary serves again; the passive replica goes: the passive site returns to zero.
        cap.cluster.delete_pod("ml", "r1")
        await wait_for(lambda: not cap.cluster.list_nodes({LABEL_SITE: cap.site("cheap")}), timeout=60)
        assert cap.cluster.list_nodes({LABEL_SITE: cap.site("dear")})
        await handle.terminate("test over")
