"""The cluster watches (issue 37) on the real control plane, as the control-plane service account
(the shipped RBAC: ``watch`` on nodes, pods and CSRs): a watch whose resourceVersion the API
server no longer has (``410 Gone``) lists again and goes on, and returns on a Node change; a
node whose kubelet falls silent is seen NotReady, through the watch, when the real node
lifecycle controller marks it so; a new CSR wakes the CSR watch.

Nodes here are Node objects the admin writes (no kubelet behind them): their status is what the
API server and its controllers make of it, which is all a watch sees.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timezone

import pytest

from fleet.cluster import LABEL_SITE
from providers.cluster.kubernetes import KubernetesCluster
from tests.realk8s.cluster import RealCluster


def control_plane(cluster: RealCluster) -> KubernetesCluster:
    token = cluster.service_account_token("gpufleet", "gpufleet-control-plane")
    return KubernetesCluster(api_client=cluster.api_client(token), namespace="gpufleet")


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def add_node(cluster: RealCluster, name: str, site: str) -> None:
    status, answer = cluster.request("POST", "/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {LABEL_SITE: site}}}, admin=True)
    assert status == 201, answer
    set_ready(cluster, name, True)


def set_ready(cluster: RealCluster, name: str, ready: bool) -> None:
    """The Ready condition as a kubelet posts it (a heartbeat now)."""
    condition = {"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady" if ready else
                 "KubeletNotReady", "lastHeartbeatTime": now(), "lastTransitionTime": now()}
    status, answer = cluster.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": {"conditions": [condition]}},
                                     admin=True, content_type="application/strategic-merge-patch+json")
    assert status == 200, answer


def label(cluster: RealCluster, name: str, key: str, value: str) -> None:
    status, answer = cluster.request("PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": {key: value}}},
                                     admin=True, content_type="application/merge-patch+json")
    assert status == 200, answer


class Looks:
    """A watch's ``until``, recording what it answered at each look: a watch that returns on the
    change returns at the first look its condition held (at its timeout, or a look later, it
    would have answered True before)."""

    def __init__(self, condition) -> None:
        self.condition, self.held = condition, []

    def __call__(self, objects) -> bool:
        self.held.append(bool(self.condition(objects)))
        return self.held[-1]

    def returned_on_the_change(self) -> bool:
        return True in self.held and self.held.index(True) == len(self.held) - 1


def later(seconds: float, act) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), act()), daemon=True)
    thread.start()
    return thread


#: The API server's watch cache keeps a window of events: a version older than its oldest is
#: gone (410). The window moves once events older than its freshness (75 s) are pushed out by
#: newer ones beyond its capacity (100 at the least; more where the tier's earlier tests wrote
#: many at once): a hundred at a time until it has.
CACHE_FRESHNESS_SECONDS = 80
EVENTS_AT_A_TIME, EVENTS_AT_MOST = 100, 5000


@pytest.mark.timeout(300)
def test_a_watch_whose_version_is_gone_lists_again_and_returns_on_a_node_change(real_cluster: RealCluster,
                                                                                monkeypatch) -> None:
    """A watch resumed from a resourceVersion it kept while it waited (here: the first list's,
    a real one, aged out of the API server's watch cache) meets ``410 Gone``: it lists again, and
    still returns on the Node change that follows."""
    site = f"watch-{uuid.uuid4().hex[:6]}"
    # Aged: the cluster's first Node list's version (long past the cache's freshness when the
    # tier's earlier tests ran first; waited out here when this test runs alone).
    aged, taken_at = real_cluster.first_nodes_version
    add_node(real_cluster, f"{site}-1", site)
    add_node(real_cluster, f"{site}-2", site)
    add_node(real_cluster, f"{site}-noise", f"{site}-elsewhere")
    time.sleep(max(0.0, CACHE_FRESHNESS_SECONDS - (time.monotonic() - taken_at)))
    def gone(answer: object) -> bool:
        return isinstance(answer, dict) and answer.get("object", {}).get("code") == 410

    answer: object = None
    for written in range(0, EVENTS_AT_MOST, EVENTS_AT_A_TIME):
        for i in range(written, written + EVENTS_AT_A_TIME):
            label(real_cluster, f"{site}-noise", "example.com/noise", str(i))
        status, answer = real_cluster.request(
            "GET", f"/api/v1/nodes?watch=true&resourceVersion={aged}&timeoutSeconds=1", admin=True)
        if gone(answer):
            break
    assert gone(answer), f"not gone yet: {answer}"
    for name in (f"{site}-1", f"{site}-2"):  # their "kubelets" post again (the controller marked them by now)
        set_ready(real_cluster, name, True)

    cluster = control_plane(real_cluster)
    lists: list[str] = []
    real_list = KubernetesCluster._list_for_watch

    def list_once_then_age(self, what, list_fn, convert, **selectors):
        """The first list's objects with the version the watch kept; then real lists."""
        objects, version = real_list(self, what, list_fn, convert, **selectors)
        lists.append(version)
        return objects, (aged if len(lists) == 1 else version)

    monkeypatch.setattr(KubernetesCluster, "_list_for_watch", list_once_then_age)
    changer = later(3, lambda: set_ready(real_cluster, f"{site}-2", False))
    looks = Looks(lambda nodes: any(not n.ready for n in nodes))
    # Its timeout is ten minutes: the test's own timeout guards against a hang.
    nodes = cluster.watch_nodes({LABEL_SITE: site}, looks, timeout_s=600, recheck_s=10)
    changer.join()
    assert len(lists) == 2, "the 410 Gone was met by a second list"
    assert {n.name: n.ready for n in nodes} == {f"{site}-1": True, f"{site}-2": False}
    assert looks.returned_on_the_change(), f"returned on the change, not at its timeout: {looks.held}"


@pytest.mark.timeout(120)  # a guard against a hang: the watch's own timeout is ten minutes
def test_a_watch_returns_on_the_change_it_waits_for_and_not_on_others(real_cluster: RealCluster) -> None:
    """A label the kubelet or anyone writes is an event the watch takes and waits on; the change
    asked for (a cordon) ends it. One list, then the watch from its resourceVersion."""
    site = f"watch-{uuid.uuid4().hex[:6]}"
    add_node(real_cluster, f"{site}-1", site)
    cluster = control_plane(real_cluster)
    looks = Looks(lambda nodes: any(n.unschedulable for n in nodes))
    noise = later(1, lambda: label(real_cluster, f"{site}-1", "example.com/noise", "1"))
    cordon = later(4, lambda: cluster.cordon(f"{site}-1"))
    nodes = cluster.watch_nodes({LABEL_SITE: site}, looks, timeout_s=600, recheck_s=30)
    noise.join(), cordon.join()
    assert nodes[0].unschedulable and looks.returned_on_the_change(), looks.held
    assert len(looks.held) >= 3, "the list, the label's event (waited on), the cordon's"


@pytest.mark.timeout(240)
def test_a_node_whose_kubelet_falls_silent_is_seen_notready_through_the_watch(real_cluster: RealCluster) -> None:
    """No kubelet posts for this node after its first Ready: the real node lifecycle controller
    marks it Unknown after its grace period, and the watch returns on that (not a poll, not a
    heartbeat of ours): what a Site entity's ``watch_site`` turns into ``cluster_state``."""
    site = f"watch-{uuid.uuid4().hex[:6]}"
    add_node(real_cluster, f"{site}-1", site)
    cluster = control_plane(real_cluster)
    # The controller's grace (node-monitor-grace-period, 50 s) and its look (every 5 s), then the
    # watch returns on its update (the test's timeout guards against a hang).
    looks = Looks(lambda nodes: not nodes[0].ready)
    nodes = cluster.watch_nodes({LABEL_SITE: site}, looks, timeout_s=180, recheck_s=30)
    assert not nodes[0].ready, "the controller never marked the silent node"
    assert looks.returned_on_the_change(), f"returned on the controller's mark, not at its timeout: {looks.held}"


@pytest.mark.timeout(120)  # a guard against a hang: the watch's own timeout is ten minutes
def test_a_new_kubelet_csr_wakes_the_csr_watch_and_another_signers_does_not(real_cluster: RealCluster) -> None:
    import base64

    from providers.cluster.base import CLIENT_SIGNER
    from tests.cluster.sim_kubelet import csr_pem

    cluster = control_plane(real_cluster)
    before = set(cluster.watch_open_csrs(lambda found: True, timeout_s=1))

    def post(name: str, signer: str, usages: list[str]) -> None:
        request = csr_pem("system:node:watch-test", ["system:nodes"])
        body = {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
                "metadata": {"name": name}, "spec": {"request": base64.b64encode(request).decode(),
                                                     "signerName": signer, "usages": usages}}
        status, answer = real_cluster.request("POST", "/apis/certificates.k8s.io/v1/certificatesigningrequests",
                                              body, admin=True)
        assert status == 201, answer

    foreign, name = f"watch-foreign-{uuid.uuid4().hex[:6]}", f"watch-{uuid.uuid4().hex[:6]}"
    creators = [later(1, lambda: post(foreign, "example.com/watch-test", ["digital signature"])),
                later(3, lambda: post(name, CLIENT_SIGNER, ["digital signature", "client auth"]))]
    looks = Looks(lambda found: bool(set(found) - before))
    found = cluster.watch_open_csrs(looks, timeout_s=600, recheck_s=30)
    names = [csr.name for csr in found]
    for creator in creators:
        creator.join()
    # Woken by the kubelet's CSR only (had the other signer's woken it, the kubelet's, 2 s later,
    # would not be in what it returned): gpufleet judges no other signer's, so a pass would decide nothing.
    assert name in names and foreign not in names and looks.returned_on_the_change(), looks.held
