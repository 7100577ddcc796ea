"""Pending GPU pods through the cluster port: the simulated scheduler (selectors, tolerations,
GPUs). The Kubernetes adapter's listing (field selectors, requests given as limits only,
nominated pods) and its watch run against the real API server and kube-scheduler:
``tests/realk8s/test_adapter.py``."""

from __future__ import annotations

from fleet.cluster import UNPROVEN_TAINT
from fleet.demand import (
    DEMAND_TAINT,
    DEMAND_TAINT_KEY,
    LABEL_FLEET,
    LABEL_GEOGRAPHY,
    GpuPod,
    Toleration,
)

#: A pod's opt-in to the fleet (also the real tier's pods', tests/realk8s/test_adapter.py).
OPT_IN = {"node_selector": {LABEL_FLEET: "true", LABEL_GEOGRAPHY: "eu"},
          "tolerations": [{"key": DEMAND_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]}


def gpu_node(sim, world, name, gpus=2, labels=None, taints=()):
    """A registered node, as the simulated kubelet leaves it, then the fleet's labels and taints."""
    with world.tx() as db:
        db.execute("INSERT INTO nodes(name, machine_id, labels, taints, unschedulable, ready, boot_id, gpus,"
                   " registered_at) VALUES (?,?,'{}','[]',0,1,'b',?,0)", (name, f"m-{name}", gpus))
    sim.label_node(name, labels or {})
    sim.set_taints(name, add=list(taints))


def pod(name, gpus=1, **selector):
    return GpuPod(namespace="ml", name=name, gpus=gpus, node_selector={LABEL_FLEET: "true", **selector},
                  tolerations=[Toleration(key=DEMAND_TAINT_KEY, operator="Exists")])


def test_the_simulated_scheduler_honours_selectors_taints_and_gpus(sim, world):
    gpu_node(sim, world, "eu-1", 2, {LABEL_FLEET: "true", LABEL_GEOGRAPHY: "eu"}, [DEMAND_TAINT])
    gpu_node(sim, world, "us-1", 8, {LABEL_FLEET: "true", LABEL_GEOGRAPHY: "us"}, ["other:NoSchedule"])
    gpu_node(sim, world, "new", 8, {LABEL_FLEET: "true", LABEL_GEOGRAPHY: "eu"}, [UNPROVEN_TAINT])
    for p in [pod("a", 1, **{LABEL_GEOGRAPHY: "eu"}), pod("b", 1, **{LABEL_GEOGRAPHY: "eu"}),
              pod("c", 1, **{LABEL_GEOGRAPHY: "eu"}), pod("us", 1, **{LABEL_GEOGRAPHY: "us"})]:
        sim.create_pod(p)
    pods = {p.key: p for p in sim.list_gpu_pods()}
    assert pods["ml/a"].node == pods["ml/b"].node == "eu-1"  # tolerates the fleet taint; 2 GPUs
    assert pods["ml/c"].pending and pods["ml/c"].unschedulable  # eu-1 is full; "new" is unproven
    assert pods["ml/us"].pending  # does not tolerate other:NoSchedule
    sim.set_taints("new", remove=[UNPROVEN_TAINT])
    assert {p.key: p.node for p in sim.list_gpu_pods()}["ml/c"] == "new"
    # The node goes: its pods are collected (the pod garbage collector).
    sim.remove_node("eu-1")
    assert {p.key for p in sim.list_gpu_pods()} == {"ml/c", "ml/us"}
    assert [p.key for p in sim.list_gpu_pods(pending_only=True)] == ["ml/us"]
