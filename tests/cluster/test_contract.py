"""The cluster port's contract: the simulated cluster (here) and the Kubernetes adapter against the
real control plane (the same tests, collected again by tests/realk8s/test_contract.py with
``tests/realk8s/contract.py``'s harness) must both pass every test here."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import pytest

from providers.cluster.base import (
    Cluster, NodeChanged, NodeNotFound, NoPreviousTemplate, ServingNotFound, decide_on_node, free_gpus_at,
    serving_labels, serving_name,
)
from fleet.cluster import ANNOTATION_CORDONED_BY, CORDONED_BY_DEMAND, CORDONED_BY_SURPLUS, LABEL_SITE, UNPROVEN_TAINT, ServingSpec


def test_both_implement_the_port(harness):
    assert isinstance(harness.cluster, Cluster)


# -- join tokens -------------------------------------------------------------------------
def test_join_token_reaches_only_the_bootstrap_channel_once(harness):
    before = datetime.now(timezone.utc)
    ref = harness.cluster.create_join_token("gpu-1", "m-1", 600)
    assert ref.node_name == "gpu-1"
    assert len(ref.token_id) == 6 and ref.token_id.isalnum()
    assert before + timedelta(seconds=595) <= ref.expires_at <= before + timedelta(seconds=601)
    assert "secret" not in ref.model_dump_json()
    token = harness.take_bootstrap_token("m-1")
    token_id, _, secret = token.partition(".")
    assert token_id == ref.token_id and len(secret) == 16
    assert harness.take_bootstrap_token("m-1") is None


@pytest.mark.parametrize("ttl", [0, -5, 3601, 86400])
def test_join_token_ttl_is_at_most_an_hour(harness, ttl):
    with pytest.raises(ValueError):
        harness.cluster.create_join_token("gpu-1", "m-1", ttl)


def test_revoke_join_token_is_idempotent_and_closes_the_channel(harness):
    ref = harness.cluster.create_join_token("gpu-1", "m-1", 3600)
    harness.cluster.revoke_join_token(ref.token_id)
    harness.cluster.revoke_join_token(ref.token_id)
    assert harness.take_bootstrap_token("m-1") is None


# -- nodes --------------------------------------------------------------------------------
def test_get_node_maps_the_node(harness):
    assert harness.cluster.get_node("gpu-1") is None
    harness.add_node("gpu-1", site="site-a", gpus=8, machine_id="m-77", boot_id="boot-xyz")
    node = harness.cluster.get_node("gpu-1")
    assert node.name == "gpu-1"
    assert node.ready and not node.unschedulable
    assert node.gpus_allocatable == 8
    assert node.site == "site-a" and node.labels[LABEL_SITE] == "site-a"
    assert node.provider == "sim"
    assert node.machine_id == "m-77"
    assert node.boot_id == "boot-xyz"
    assert node.registered_at is not None
    before = datetime.now(timezone.utc) - timedelta(seconds=1)  # an API server's times are whole seconds
    harness.set_ready("gpu-1", False)
    node = harness.cluster.get_node("gpu-1")
    assert not node.ready
    # When it stopped being Ready (the Ready condition's lastTransitionTime): the site sweep's
    # hold of a cancelled spot reclaim ends once the node was Ready after the cancel.
    assert node.ready_changed_at is not None and node.ready_changed_at >= before


def test_list_nodes_by_label(harness):
    harness.add_node("a-1", site="site-a")
    harness.add_node("a-2", site="site-a")
    harness.add_node("b-1", site="site-b")
    # Every node: those this test added (a shared real cluster also lists the tier's others).
    assert [n.name for n in harness.cluster.list_nodes() if n.name not in harness.foreign] == ["a-1", "a-2", "b-1"]
    assert [n.name for n in harness.cluster.list_nodes({LABEL_SITE: "site-a"})] == ["a-1", "a-2"]
    assert harness.cluster.list_nodes({LABEL_SITE: "nowhere"}) == []
    harness.cluster.label_node("a-2", {"example.com/pool": "spare"})
    assert [n.name for n in harness.cluster.list_nodes({LABEL_SITE: "site-a", "example.com/pool": "spare"})] == ["a-2"]
    assert harness.cluster.list_nodes({LABEL_SITE: "site-b", "example.com/pool": "spare"}) == []


def test_labels_merge_and_are_idempotent(harness):
    harness.add_node("gpu-1")
    first = harness.cluster.label_node("gpu-1", {"gpufleet.io/state": "proving"})
    again = harness.cluster.label_node("gpu-1", {"gpufleet.io/state": "proving"})
    assert first.labels == again.labels
    assert again.labels["gpufleet.io/state"] == "proving"
    assert again.labels[LABEL_SITE] == "site-a"  # not ours to drop
    assert again.labels["kubernetes.io/hostname"] == "gpu-1"
    changed = harness.cluster.label_node("gpu-1", {"gpufleet.io/state": "ready"})
    assert changed.labels["gpufleet.io/state"] == "ready"
    removed = harness.cluster.label_node("gpu-1", {"gpufleet.io/state": None})
    assert "gpufleet.io/state" not in removed.labels and removed.labels[LABEL_SITE] == "site-a"


def test_taints_add_remove_idempotent(harness):
    harness.add_node("gpu-1")
    node = harness.cluster.set_taints("gpu-1", add=[UNPROVEN_TAINT, "other=x:NoExecute"])
    assert sorted(node.taints) == sorted([UNPROVEN_TAINT, "other=x:NoExecute"])
    assert harness.cluster.set_taints("gpu-1", add=[UNPROVEN_TAINT]).taints == node.taints
    # Same key and effect with a new value replaces the taint.
    node = harness.cluster.set_taints("gpu-1", add=["other=y:NoExecute"])
    assert sorted(node.taints) == sorted([UNPROVEN_TAINT, "other=y:NoExecute"])
    node = harness.cluster.set_taints("gpu-1", remove=[UNPROVEN_TAINT])
    assert node.taints == ["other=y:NoExecute"]
    assert harness.cluster.set_taints("gpu-1", remove=[UNPROVEN_TAINT]).taints == ["other=y:NoExecute"]
    with pytest.raises(ValueError):
        harness.cluster.set_taints("gpu-1", add=["no-effect"])


def test_cordon_and_uncordon(harness):
    harness.add_node("gpu-1")
    assert harness.cluster.cordon("gpu-1").unschedulable
    assert harness.cluster.cordon("gpu-1").unschedulable
    assert not harness.cluster.cordon("gpu-1", False).unschedulable


def test_a_cordon_says_who_made_it_and_an_uncordon_forgets_it(harness):
    """The demand loop knows its own cordon from the cluster alone (its carried state may be lost):
    its cordon marks it; a later cordon by someone else (a drain's own) leaves the mark and the
    fences; an uncordon drops the mark, so a person's later ``kubectl cordon`` never reads as the
    loop's."""
    harness.add_node("gpu-1")
    harness.cluster.annotate_node("gpu-1", {"gpufleet.io/fenced-gpu-0": "reset"})
    harness.cluster.cordon("gpu-1", by=CORDONED_BY_DEMAND)
    assert harness.cluster.drain_node("gpu-1", deadline_s=1).completed
    assert harness.cluster.get_node("gpu-1").unschedulable
    assert harness.cluster.annotate_node("gpu-1", {})[ANNOTATION_CORDONED_BY] == CORDONED_BY_DEMAND
    assert harness.cluster.cordon("gpu-1").unschedulable
    assert harness.cluster.annotate_node("gpu-1", {})[ANNOTATION_CORDONED_BY] == CORDONED_BY_DEMAND
    assert not harness.cluster.cordon("gpu-1", False).unschedulable
    # Only gpufleet's own marks: a real cluster's controllers add theirs (the TTL controller's).
    ours = {k: v for k, v in harness.cluster.annotate_node("gpu-1", {}).items() if k.startswith("gpufleet.io/")}
    assert ours == {"gpufleet.io/fenced-gpu-0": "reset"}
    harness.cluster.cordon("gpu-1")
    assert ANNOTATION_CORDONED_BY not in harness.cluster.annotate_node("gpu-1", {})


def test_a_cordon_decided_on_a_read_lands_only_on_the_node_as_read(harness):
    """A cordon or uncordon made with the version of a ``node_marks`` read is refused
    (``NodeChanged``, nothing written) once anyone wrote the node since: here a repair's fence, then
    a person's mark. Read again, it lands."""
    harness.add_node("gpu-1")
    harness.cluster.cordon("gpu-1", by=CORDONED_BY_SURPLUS)
    marks = harness.cluster.node_marks("gpu-1")
    assert marks.unschedulable and marks.annotations[ANNOTATION_CORDONED_BY] == CORDONED_BY_SURPLUS
    harness.cluster.annotate_node("gpu-1", {"gpufleet.io/fenced-gpu-0": "reset"})  # a repair, since
    with pytest.raises(NodeChanged):
        harness.cluster.cordon("gpu-1", False, version=marks.version)
    assert harness.cluster.get_node("gpu-1").unschedulable
    marks = harness.cluster.node_marks("gpu-1")
    assert marks.annotations["gpufleet.io/fenced-gpu-0"] == "reset"
    harness.cluster.cordon("gpu-1", by="alice")  # a person, since
    with pytest.raises(NodeChanged):
        harness.cluster.cordon("gpu-1", by=CORDONED_BY_DEMAND, version=marks.version)
    assert harness.cluster.node_marks("gpu-1").annotations[ANNOTATION_CORDONED_BY] == "alice"
    # As the activities do: decided again on a fresh read (a real cluster's controllers write nodes too).
    decide_on_node(harness.cluster, "gpu-1", lambda marks: harness.cluster.cordon("gpu-1", False, version=marks.version))
    assert not harness.cluster.get_node("gpu-1").unschedulable
    assert ANNOTATION_CORDONED_BY not in harness.cluster.node_marks("gpu-1").annotations
    with pytest.raises(NodeNotFound):
        harness.cluster.node_marks("gone")


def test_annotations_written_on_a_read_land_only_on_the_node_as_read(harness):
    """Annotations merged with the version of a ``node_marks`` read (the drop of an owner's mark
    from a node its repair took) are refused (``NodeChanged``, nothing written) once anyone wrote
    the node since: here a person's mark. On a fresh read they land, and say what the node has."""
    harness.add_node("gpu-1")
    harness.cluster.cordon("gpu-1", by=CORDONED_BY_DEMAND)
    harness.cluster.annotate_node("gpu-1", {"gpufleet.io/fenced-gpu-0": "reset"})
    marks = harness.cluster.node_marks("gpu-1")
    harness.cluster.cordon("gpu-1", by="alice")  # a person, since
    with pytest.raises(NodeChanged):
        harness.cluster.annotate_node("gpu-1", {ANNOTATION_CORDONED_BY: None}, version=marks.version)
    assert harness.cluster.node_marks("gpu-1").annotations[ANNOTATION_CORDONED_BY] == "alice"
    fresh = harness.cluster.node_marks("gpu-1")
    after = harness.cluster.annotate_node("gpu-1", {ANNOTATION_CORDONED_BY: None}, version=fresh.version)
    assert ANNOTATION_CORDONED_BY not in after and after["gpufleet.io/fenced-gpu-0"] == "reset"
    assert harness.cluster.node_marks("gpu-1").version != fresh.version, "a write is a new version"
    with pytest.raises(NodeNotFound):
        harness.cluster.annotate_node("gone", {"gpufleet.io/x": "1"}, version=fresh.version)


def test_annotations_merge_and_remove(harness):
    harness.add_node("gpu-1")
    first = harness.cluster.annotate_node("gpu-1", {"gpufleet.io/repair": "reboot", "gpufleet.io/x": "1"})
    assert first["gpufleet.io/repair"] == "reboot" and first["gpufleet.io/x"] == "1"
    after = harness.cluster.annotate_node("gpu-1", {"gpufleet.io/x": None})
    assert after["gpufleet.io/repair"] == "reboot" and "gpufleet.io/x" not in after


def test_missing_node_is_not_found_and_removal_is_idempotent(harness):
    for call in (
        lambda: harness.cluster.label_node("ghost", {"a": "b"}),
        lambda: harness.cluster.set_taints("ghost", add=[UNPROVEN_TAINT]),
        lambda: harness.cluster.cordon("ghost"),
        lambda: harness.cluster.annotate_node("ghost", {"a": "b"}),
    ):
        with pytest.raises(NodeNotFound):
            call()
    harness.add_node("gpu-1")
    harness.cluster.remove_node("gpu-1")
    harness.cluster.remove_node("gpu-1")
    assert harness.cluster.get_node("gpu-1") is None


# -- drain --------------------------------------------------------------------------------
def test_drain_evicts_workloads_and_leaves_daemonset_and_mirror_pods(harness):
    harness.add_node("gpu-1")
    harness.add_node("gpu-2")
    harness.add_pod("gpu-1", "web-1", labels={"app": "web"})
    harness.add_pod("gpu-1", "batch-1", namespace="jobs", owner_kind="Job")
    harness.add_pod("gpu-1", "dcgm-exporter-x", namespace="monitoring", owner_kind="DaemonSet")
    harness.add_pod("gpu-1", "kube-proxy-gpu-1", namespace="kube-system", owner_kind="Node", mirror=True)
    harness.add_pod("gpu-2", "web-2", labels={"app": "web"})
    result = harness.cluster.drain_node("gpu-1", deadline_s=5)
    assert result.completed and not result.blocked and not result.deleted
    assert {p.key for p in result.evicted} == {"default/web-1", "jobs/batch-1"}
    skipped = {p.key: p.reason for p in result.skipped}
    assert {key: skipped.pop(key, None) for key in ("monitoring/dcgm-exporter-x", "kube-system/kube-proxy-gpu-1")} == {
        "monitoring/dcgm-exporter-x": "DaemonSet pod",
        "kube-system/kube-proxy-gpu-1": "mirror pod",
    }
    # A real cluster's own DaemonSets (gpufleet's node agent runs on every gpufleet node) stay too.
    assert set(skipped.values()) <= {"DaemonSet pod"}, skipped
    assert {p.name for p in harness.pods("gpu-1")} == {"dcgm-exporter-x", "kube-proxy-gpu-1"}
    assert {p.name for p in harness.pods("gpu-2")} == {"web-2"}
    assert harness.cluster.get_node("gpu-1").unschedulable


def test_drain_waits_for_a_pdb_that_frees_up(harness):
    harness.add_node("gpu-1")
    harness.add_node("gpu-2")
    harness.add_pod("gpu-1", "web-1", labels={"app": "web"})
    harness.set_pdb("default", "web-pdb", {"app": "web"}, min_available=1)

    def replacement_becomes_ready():
        time.sleep(0.6)
        harness.add_pod("gpu-2", "web-2", labels={"app": "web"})

    helper = threading.Thread(target=replacement_becomes_ready)
    helper.start()
    result = harness.cluster.drain_node("gpu-1", deadline_s=15)
    helper.join()
    # Evicted once the budget allowed it (the replacement came 0.6 s in), before the deadline:
    # a drain that ran out would name web-1 blocked.
    assert result.completed and not result.blocked
    assert [p.key for p in result.evicted] == ["default/web-1"]
    assert harness.pods("gpu-1") == []


def test_drain_reports_the_pods_a_pdb_keeps_blocking(harness):
    harness.add_node("gpu-1")
    harness.add_pod("gpu-1", "db-0", namespace="data", labels={"app": "db"})
    harness.add_pod("gpu-1", "free-1", labels={"app": "free"})
    harness.set_pdb("data", "db-pdb", {"app": "db"}, max_unavailable=0)
    heartbeats = []
    result = harness.cluster.drain_node("gpu-1", deadline_s=0.8, heartbeat=lambda: heartbeats.append(1))
    assert not result.completed
    assert [p.key for p in result.evicted] == ["default/free-1"]
    assert [p.key for p in result.blocked] == ["data/db-0"]
    assert "db-pdb" in result.blocked[0].reason
    assert heartbeats, "refused, it was asked again (a heartbeat between rounds) until the deadline"
    assert [p.name for p in harness.pods("gpu-1")] == ["db-0"]


def test_drain_force_deletes_past_the_pdb_only_when_asked(harness):
    harness.add_node("gpu-1")
    harness.add_pod("gpu-1", "db-0", namespace="data", labels={"app": "db"})
    harness.set_pdb("data", "db-pdb", {"app": "db"}, min_available=1)
    result = harness.cluster.drain_node("gpu-1", deadline_s=0.3, force=True)
    assert result.completed and not result.blocked
    assert [p.key for p in result.deleted] == ["data/db-0"]
    assert "db-pdb" in result.deleted[0].reason
    assert harness.pods("gpu-1") == []


def test_drain_of_an_empty_node_completes_at_once(harness):
    harness.add_node("gpu-1")
    heartbeats = []
    result = harness.cluster.drain_node("gpu-1", deadline_s=60, heartbeat=lambda: heartbeats.append(1))
    assert result.completed and result.evicted == [] and heartbeats == [], "done at the first look, no round waited"


# -- serving ------------------------------------------------------------------------------
def _spec(**overrides):
    values = dict(model="llama-3-8b", site="site-a", image="vllm:0.6", replicas=2, gpus_per_replica=4,
                  args=["--max-model-len", "8192"], weights_path="/models/llama-3-8b")
    values.update(overrides)
    return ServingSpec(**values)


def _wait_ready(cluster, model, site, ready=True, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        status = cluster.serving_status(model, site)
        if status.ready == ready or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def test_serving_rolls_out_where_the_site_has_gpus(harness):
    harness.add_node("gpu-1", site="site-a", gpus=8)
    harness.add_node("gpu-b", site="site-b", gpus=8)
    assert harness.cluster.serving_status("llama-3-8b", "site-a") is None
    status = harness.cluster.apply_serving(_spec())
    assert status.name == serving_name("llama-3-8b", "site-a") == "llama-3-8b-site-a"
    assert status.image == "vllm:0.6" and status.desired_replicas == 2
    status = _wait_ready(harness.cluster, "llama-3-8b", "site-a")
    assert status.ready and status.available_replicas == 2 and status.updated_replicas == 2
    assert status.observed_generation >= status.generation
    assert not status.can_rollback
    # Three replicas of 4 GPUs do not fit on one 8-GPU node.
    status = harness.cluster.scale_serving("llama-3-8b", "site-a", 3)
    status = _wait_ready(harness.cluster, "llama-3-8b", "site-a", ready=False)
    assert not status.ready and status.desired_replicas == 3 and status.available_replicas == 2
    harness.add_node("gpu-2", site="site-a", gpus=8)
    assert _wait_ready(harness.cluster, "llama-3-8b", "site-a").available_replicas == 3


def test_serving_on_cordoned_or_unproven_nodes_is_not_available(harness):
    harness.add_node("gpu-1", site="site-a", gpus=8)
    harness.cluster.set_taints("gpu-1", add=[UNPROVEN_TAINT])
    harness.cluster.apply_serving(_spec(replicas=1))
    status = _wait_ready(harness.cluster, "llama-3-8b", "site-a", ready=False)
    assert status.available_replicas == 0
    harness.cluster.set_taints("gpu-1", remove=[UNPROVEN_TAINT])
    assert _wait_ready(harness.cluster, "llama-3-8b", "site-a").ready
    # A cordoned node takes no new replica. (What runs there keeps running on a real cluster;
    # the simulated one counts a cordoned node's replicas gone: either way, not ready at 2.)
    harness.cluster.cordon("gpu-1")
    harness.cluster.scale_serving("llama-3-8b", "site-a", 2)
    status = _wait_ready(harness.cluster, "llama-3-8b", "site-a", ready=False)
    assert not status.ready and status.available_replicas <= 1
    harness.cluster.cordon("gpu-1", False)
    assert _wait_ready(harness.cluster, "llama-3-8b", "site-a").available_replicas == 2


def test_apply_serving_is_idempotent(harness):
    harness.add_node("gpu-1", site="site-a")
    first = harness.cluster.apply_serving(_spec())
    again = harness.cluster.apply_serving(_spec())
    assert again.generation == first.generation
    assert not again.can_rollback


def test_rollback_goes_back_to_the_previous_template(harness):
    harness.add_node("gpu-1", site="site-a")
    with pytest.raises(ServingNotFound):
        harness.cluster.rollback_serving("llama-3-8b", "site-a")
    harness.cluster.apply_serving(_spec(image="vllm:0.6"))
    with pytest.raises(NoPreviousTemplate):
        harness.cluster.rollback_serving("llama-3-8b", "site-a")
    # Scaling is not a new template.
    harness.cluster.scale_serving("llama-3-8b", "site-a", 1)
    assert not harness.cluster.serving_status("llama-3-8b", "site-a").can_rollback
    updated = harness.cluster.apply_serving(_spec(image="vllm:0.7", replicas=1))
    assert updated.image == "vllm:0.7" and updated.can_rollback
    rolled = harness.cluster.rollback_serving("llama-3-8b", "site-a")
    assert rolled.image == "vllm:0.6" and rolled.generation > updated.generation
    assert rolled.desired_replicas == 1
    # Rolling back again returns to the newer template, like `kubectl rollout undo`.
    assert harness.cluster.rollback_serving("llama-3-8b", "site-a").image == "vllm:0.7"


def test_scale_and_delete_serving(harness):
    with pytest.raises(ServingNotFound):
        harness.cluster.scale_serving("llama-3-8b", "site-a", 2)
    harness.add_node("gpu-1", site="site-a")
    harness.cluster.apply_serving(_spec(replicas=1))
    status = harness.cluster.scale_serving("llama-3-8b", "site-a", 0)
    assert status.desired_replicas == 0
    assert _wait_ready(harness.cluster, "llama-3-8b", "site-a").ready  # zero of zero
    harness.cluster.delete_serving("llama-3-8b", "site-a")
    harness.cluster.delete_serving("llama-3-8b", "site-a")
    assert harness.cluster.serving_status("llama-3-8b", "site-a") is None


def _wait_status(cluster, model, site, until, timeout=30.0):
    """The serving's status once ``until(status)`` holds, or the last one read at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        status = cluster.serving_status(model, site)
        if until(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


#: How long a test watches for an update that must never complete: the real tier's controllers
#: and scheduler act within a second, the simulated cluster at once.
NEVER_S = 3.0


def test_serving_counts_the_gpus_other_replicas_and_pods_hold(harness):
    """A site's GPUs are shared: another model's replicas and other GPU pods (a training job)
    hold theirs, and a replica that finds none left is not available."""
    harness.add_node("gpu-1", site="site-a", gpus=8)
    harness.add_node("gpu-2", site="site-a", gpus=8)
    harness.add_pod("gpu-2", "train-0", namespace="jobs", gpus=4)
    harness.cluster.apply_serving(_spec(model="mistral-7b"))  # 2 replicas of 4 GPUs, of the 12 left
    assert _wait_ready(harness.cluster, "mistral-7b", "site-a").available_replicas == 2
    harness.cluster.apply_serving(_spec())  # 4 GPUs left: one replica of two
    status = _wait_status(harness.cluster, "llama-3-8b", "site-a", lambda s: s.available_replicas >= 1)
    time.sleep(NEVER_S / 3)  # a second replica, were there room, is scheduled meanwhile
    status = harness.cluster.serving_status("llama-3-8b", "site-a")
    assert not status.ready and status.available_replicas == 1
    assert harness.cluster.serving_status("mistral-7b", "site-a").available_replicas == 2


def test_a_nodes_own_pod_holds_no_gpu_of_another_node(harness):
    """A kubelet may create pods bound to its own node (the mirrors of its static pods, which
    NodeRestriction allows it) with any labels and any GPU request. Such a pod asking a thousand
    GPUs, labelled as another model's replica, is reported as the node's own (``mirror``); it
    holds that node's GPUs only, the site's other nodes count as free as before, and it is no
    replica of that model. Before, it took every GPU of the site from ``free_gpus_at`` (an
    evacuation's room, a rollout's surge) and, in the simulated cluster, from every Deployment."""
    harness.add_node("gpu-1", site="site-a", gpus=8)
    harness.add_node("gpu-2", site="site-a", gpus=8)
    harness.add_pod("gpu-1", "static-gpu-1", namespace="kube-system", owner_kind="Node", mirror=True, gpus=1000,
                    labels=serving_labels("mistral-7b", "site-a"))
    nodes = [n for n in harness.cluster.list_nodes({LABEL_SITE: "site-a"}) if n.name not in harness.foreign]
    [static] = [p for p in harness.cluster.list_gpu_pods() if p.name == "static-gpu-1"]
    assert static.mirror and static.node == "gpu-1"
    assert free_gpus_at(nodes, [], harness.cluster.list_gpu_pods(), "site-a") == 8, "gpu-2's, as before"

    harness.cluster.apply_serving(_spec(model="mistral-7b"))  # 2 replicas of 4 GPUs: gpu-2's
    assert _wait_ready(harness.cluster, "mistral-7b", "site-a").available_replicas == 2
    free = free_gpus_at(nodes, harness.cluster.list_serving(), harness.cluster.list_gpu_pods(), "site-a")
    assert free == 0, "the replicas hold gpu-2's GPUs, the node's own pod gpu-1's"


def test_an_update_needs_gpus_for_its_surge_replica(harness):
    """Deployment rolling-update semantics: with maxSurge 1 and maxUnavailable 0 a new replica
    starts before an old one goes. Where the replicas fill the site's GPUs that pod stays Pending
    and the update never completes (the old replicas serve on) until GPUs are freed or added.
    Rolled back, it is done at once (the old pods run that template); replacing one replica at a
    time (``max_surge`` 0: maxUnavailable 1) needs no GPU to spare."""
    harness.add_node("gpu-1", site="site-a", gpus=8)
    harness.cluster.apply_serving(_spec())  # 2 replicas of 4 GPUs: the node is full
    assert _wait_ready(harness.cluster, "llama-3-8b", "site-a").available_replicas == 2
    harness.cluster.apply_serving(_spec(image="vllm:0.7"))
    stuck = _wait_ready(harness.cluster, "llama-3-8b", "site-a", timeout=NEVER_S)
    assert not stuck.ready and stuck.available_replicas == 2 and stuck.max_surge == 1
    back = harness.cluster.rollback_serving("llama-3-8b", "site-a")
    assert back.image == "vllm:0.6"
    assert _wait_ready(harness.cluster, "llama-3-8b", "site-a").available_replicas == 2

    one_at_a_time = _spec(image="vllm:0.7", max_surge=0)
    assert harness.cluster.apply_serving(one_at_a_time).max_surge == 0
    done = _wait_ready(harness.cluster, "llama-3-8b", "site-a")
    assert done.ready and done.image == "vllm:0.7" and done.available_replicas == 2

    harness.cluster.apply_serving(_spec(image="vllm:0.8"))
    assert not _wait_ready(harness.cluster, "llama-3-8b", "site-a", timeout=NEVER_S).ready
    harness.add_node("gpu-2", site="site-a", gpus=8)  # room for the surge replica
    done = _wait_ready(harness.cluster, "llama-3-8b", "site-a")
    assert done.ready and done.image == "vllm:0.8" and done.available_replicas == 2


def test_serving_template_names_the_template_apply_leaves(harness):
    harness.add_node("gpu-1", site="site-a")
    spec = _spec()
    assert harness.cluster.apply_serving(spec).template == harness.cluster.serving_template(spec)
    # The strategy is the Deployment's, not its pods': applying another replaces no replica.
    assert harness.cluster.serving_template(_spec(max_surge=0)) == harness.cluster.serving_template(spec)
    assert harness.cluster.serving_template(_spec(image="vllm:0.7")) != harness.cluster.serving_template(spec)


def test_serving_names_are_dns_labels(harness):
    harness.add_node("gpu-1", site="site-a")
    status = harness.cluster.apply_serving(_spec(model="meta-llama/Llama-3.1-70B-Instruct", replicas=1))
    assert status.name == "meta-llama-llama-3-1-70b-instruct-site-a"
    assert harness.cluster.serving_status("meta-llama/Llama-3.1-70B-Instruct", "site-a").name == status.name

def _replicas_on(harness, node: str, name: str) -> list[str]:
    """The serving Deployment ``name``'s pods on ``node`` (``<name>-<suffix>``)."""
    return sorted(p.name for p in harness.pods(node) if p.name.startswith(f"{name}-"))


def test_a_drain_meets_the_models_own_pdb_once_its_replacement_cannot_schedule(harness):
    """Serving replicas are pods a drain must evict, under gpufleet's PodDisruptionBudget per model
    and site (``render_pdb``: maxUnavailable 1). Two replicas on the site's one node: the first
    eviction is allowed, its replacement is Pending (the node is cordoned, and it is the only one),
    and the Eviction API refuses the second (HTTP 429) until the drain's deadline, which then names
    it blocked. (What an evacuation that drained before scaling its site to 0 met: its own replicas
    held each drain for all of ``drain_seconds``.)"""
    name = serving_name("llama-3-8b", "site-a")
    harness.add_node("gpu-1", site="site-a", gpus=8)
    harness.cluster.apply_serving(_spec(replicas=2))  # 2 × 4 GPUs: both on gpu-1
    assert _wait_ready(harness.cluster, "llama-3-8b", "site-a").available_replicas == 2
    assert len(_replicas_on(harness, "gpu-1", name)) == 2
    rounds = []
    result = harness.cluster.drain_node("gpu-1", deadline_s=3, heartbeat=lambda: rounds.append(1))
    assert not result.completed
    assert [p.name.startswith(f"{name}-") for p in result.evicted] == [True]
    assert [p.name.startswith(f"{name}-") for p in result.blocked] == [True], result
    assert f"The disruption budget {name} needs 1 healthy pods" in result.blocked[0].reason, result.blocked
    # Refused until the deadline: asked again round after round (backing off from 0.1 s: five
    # rounds in 3 s), not given up at the first refusal.
    assert len(rounds) >= 3, rounds
    assert _replicas_on(harness, "gpu-1", name) == [result.blocked[0].name]


def test_a_serving_scaled_to_zero_leaves_the_drain_nothing_to_wait_for(harness):
    """The same node, its replicas scaled to 0 first (an evacuation's order): their pods are the
    Deployment's to end, no eviction is refused, and the drain completes at once."""
    name = serving_name("llama-3-8b", "site-a")
    harness.add_node("gpu-1", site="site-a", gpus=8)
    harness.cluster.apply_serving(_spec(replicas=2))
    assert _wait_ready(harness.cluster, "llama-3-8b", "site-a").available_replicas == 2
    harness.cluster.scale_serving("llama-3-8b", "site-a", 0)
    result = harness.cluster.drain_node("gpu-1", deadline_s=20)
    assert result.completed and not result.blocked, result
    assert _replicas_on(harness, "gpu-1", name) == []



# -- routing ------------------------------------------------------------------------------
def test_routing_versions_bump_once_per_change_and_not_on_repeats(harness):
    assert harness.cluster.get_routing("llama-3-8b") is None
    first = harness.cluster.set_routing_weights("llama-3-8b", {"site-a": 80, "site-b": 20})
    assert first.version == 1
    assert {s: r.weight for s, r in first.sites.items()} == {"site-a": 80, "site-b": 20}
    assert all(r.healthy and not r.draining and not r.incident for r in first.sites.values())
    assert harness.cluster.set_routing_weights("llama-3-8b", {"site-b": 20, "site-a": 80}).version == 1
    second = harness.cluster.set_routing_weights(
        "llama-3-8b", {"site-a": 100, "site-b": 0},
        healthy={"site-b": False}, draining={"site-b": True}, incident={"site-b": "inc-42"},
    )
    assert second.version == 2
    table = harness.cluster.get_routing("llama-3-8b")
    assert table == second
    assert table.sites["site-b"].incident == "inc-42" and not table.sites["site-b"].healthy
    assert table.sites["site-b"].draining
    # Health alone is a change too.
    assert harness.cluster.set_routing_weights("llama-3-8b", {"site-a": 100, "site-b": 0}).version == 3
    # Models are independent.
    assert harness.cluster.set_routing_weights("mistral-7b", {"site-a": 1}).version == 1
    assert harness.cluster.get_routing("llama-3-8b").version == 3


def test_routing_rejects_bad_input(harness):
    with pytest.raises(ValueError):
        harness.cluster.set_routing_weights("llama-3-8b", {"site-a": 1}, healthy={"site-z": True})
    with pytest.raises(ValueError):
        harness.cluster.set_routing_weights("llama-3-8b", {"site-a": -1})
    assert harness.cluster.get_routing("llama-3-8b") is None


# -- listing serving, fleet-wide site routes (site evacuation) ------------------------------
def test_list_serving_by_site(harness):
    harness.add_node("gpu-1", site="site-a")
    harness.add_node("gpu-2", site="site-b")
    assert harness.cluster.list_serving() == []
    harness.cluster.apply_serving(_spec(model="meta-llama/Llama-3.1-70B-Instruct", replicas=1))
    harness.cluster.apply_serving(_spec(site="site-b", replicas=1))
    harness.cluster.apply_serving(_spec(replicas=1))
    listed = harness.cluster.list_serving()
    assert [(s.model, s.site) for s in listed] == [
        ("llama-3-8b", "site-a"), ("llama-3-8b", "site-b"), ("meta-llama/Llama-3.1-70B-Instruct", "site-a"),
    ]
    assert all(s.gpus_per_replica == 4 and s.desired_replicas == 1 for s in listed)
    at_b = harness.cluster.list_serving("site-b")
    assert [(s.model, s.site) for s in at_b] == [("llama-3-8b", "site-b")]
    assert harness.cluster.serving_status("llama-3-8b", "site-b").gpus_per_replica == 4


def test_site_routes_are_one_versioned_document(harness):
    from fleet.cluster import SITE_ROUTES, SiteRoute

    assert harness.cluster.get_site_routes() is None
    first = harness.cluster.set_site_routes({"site-a": SiteRoute(weight=100), "site-b": SiteRoute(weight=100)})
    assert first.version == 1 and first.model == SITE_ROUTES
    assert harness.cluster.set_site_routes({"site-b": SiteRoute(weight=100), "site-a": SiteRoute(weight=100)}).version == 1
    second = harness.cluster.set_site_routes({
        "site-a": SiteRoute(weight=100),
        "site-b": SiteRoute(weight=0, healthy=False, draining=True, incident="evacuate/site-b/1"),
    })
    assert second.version == 2
    table = harness.cluster.get_site_routes()
    assert table.sites["site-b"].incident == "evacuate/site-b/1" and table.sites["site-b"].draining
    # The site document is not a model's table, and a model's table does not touch it.
    harness.cluster.set_routing_weights("llama-3-8b", {"site-a": 1})
    assert harness.cluster.get_site_routes().version == 2
