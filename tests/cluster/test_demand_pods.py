"""Pending GPU pods through the cluster port: the real adapter against the fake API server
(field selectors, requests given as limits only, nominated pods) and the simulated
scheduler (selectors, tolerations, GPUs)."""

from __future__ import annotations

from fleet.cluster import LABEL_MODEL, UNPROVEN_TAINT
from fleet.demand import (
    DEMAND_TAINT,
    DEMAND_TAINT_KEY,
    LABEL_FLEET,
    LABEL_GEOGRAPHY,
    GpuPod,
    Toleration,
    opted_in,
)

OPT_IN = {"node_selector": {LABEL_FLEET: "true", LABEL_GEOGRAPHY: "eu"},
          "tolerations": [{"key": DEMAND_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]}


def test_the_adapter_lists_pending_gpu_pods_with_field_selectors(kube, fake):
    fake.add_node("n1", gpus=8)
    fake.add_pending_pod("want", 2, namespace="ml", labels={LABEL_MODEL: "llm"},
                         annotations={"gpufleet.io/max-price-per-gpu-hour": "3", "other": "x"}, **OPT_IN)
    fake.add_pending_pod("limits", 4, namespace="ml", limits_only=True, **OPT_IN)
    fake.add_pending_pod("nominated", 1, namespace="ml", nominated_node="n1", **OPT_IN)
    fake.add_pending_pod("plain", 1, namespace="other")
    fake.add_pod("n1", "cpu-only", namespace="ml")  # running, no GPUs
    fake.add_pending_pod("finished", 1, namespace="ml", **OPT_IN)
    fake.store[("", "pods", "ml", "finished")]["status"] = {"phase": "Succeeded"}

    pending = {p.key: p for p in kube.list_gpu_pods(pending_only=True)}
    assert set(pending) == {"ml/want", "ml/limits", "ml/nominated", "other/plain"}
    want = pending["ml/want"]
    assert (want.gpus, want.model, want.unschedulable, want.node) == (2, "llm", True, "")
    assert want.annotations == {"gpufleet.io/max-price-per-gpu-hour": "3"}
    assert opted_in(want) and not opted_in(pending["other/plain"])
    assert pending["ml/limits"].gpus == 4
    assert pending["ml/nominated"].nominated_node == "n1"
    # Every GPU pod that has not finished: the finished one and the CPU-only one are not listed.
    assert {p.key for p in kube.list_gpu_pods()} == set(pending)
    selectors = [r for r in fake.requests if r[2] == "pods"]
    assert selectors and all(r[0] == "list" for r in selectors)


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
