"""A node's own placement labels on the real control plane (issue 35, finding 7).

A machine joins from its user data and its real kubelet registers; the join labels it as the
control plane does (site, provider, region, GPU product; the zone is its site). The node then
uses its own credential, the kubelet's client certificate, to move itself into another zone:
the real API server's NodeRestriction lets it (``topology.kubernetes.io/*`` is a key a kubelet
may set on itself) and refuses the control plane's own ``node-restriction.kubernetes.io/`` site
label. The Site entity's watch (``watch_site``, as the control-plane service account with the
shipped RBAC) returns within seconds, having put the zone back, and names the node and what it
wrote: what the entity turns into the Node entity's quarantine (tests/security/test_self_labels.py).

The marks the control plane keeps or retires a node by (gpufleet.io/ annotations, its cordon) the
node may not write at all: the shipped admission policy refuses them (gpufleet-node-marks).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import datetime, timedelta, timezone

from temporalio.testing import ActivityEnvironment

from fleet.messages.nodes import AwaitRegistrationInput
from activities.watches import WatchActivities
from fleet.cluster import (
    ANNOTATION_CORDONED_BY, CORDONED_BY_SURPLUS, FENCE_PREFIX, LABEL_GPU_PRODUCT, LABEL_PROVIDER, LABEL_REGION, LABEL_SITE,
    LABEL_ZONE, UNPROVEN_TAINT,
)
from fleet.demand import public_placement_labels
from fleet.messages.watches import SiteWatchInput, SiteWatchResult, node_summary
from activities.watches import probe_nodes
from providers.cluster.check import ADMISSION_POLICIES, NODE_MARKS_POLICY
from tests.providers.test_join_real import run
from tests.realk8s.test_join import RealJoining, one  # noqa: F401 - the fixture


def as_the_node(one: RealJoining, name: str, labels: dict[str, str]) -> tuple[int, dict]:
    """A label write on its own Node with the real kubelet's client certificate."""
    return node_write(one, name, {"metadata": {"labels": labels}})


def node_write(one: RealJoining, name: str, patch: dict, subresource: str = "") -> tuple[int, dict]:
    """A merge patch of its own Node (or its status, ``/status``) with the real kubelet's client certificate."""
    return one.real.request("PATCH", f"/api/v1/nodes/{name}{subresource}", patch,
                            cert=one.machines[0].client_pem, content_type="application/merge-patch+json")


def test_a_node_that_moves_itself_to_another_zone_is_put_back_within_seconds_and_reported(one: RealJoining) -> None:
    provisioned = one.provision()
    one.machine(provisioned.machine.id).boot()
    site = one.site
    node = run(one.acts.await_registration, AwaitRegistrationInput(
        site=site.name, node_name=one.node_name, machine_id=provisioned.machine.id,
        provider_id=provisioned.provider_id, join_id=one.join_id, poll_seconds=0.2,
        deadline=datetime.now(timezone.utc) + timedelta(seconds=90),
        labels={LABEL_SITE: site.name, LABEL_PROVIDER: site.provider, LABEL_REGION: site.region,
                LABEL_GPU_PRODUCT: site.gpu}, add_taints=[UNPROVEN_TAINT]))
    wanted = public_placement_labels(site)
    assert {k: node.labels.get(k) for k in wanted} == wanted, "labelled by the join"

    # The node may not write the control plane's site label ...
    status, answer = as_the_node(one, node.name, {LABEL_SITE: "another-site"})
    assert status == 403, answer

    watches = WatchActivities(one.env)
    activity_env = ActivityEnvironment()
    activity_env.info = dataclasses.replace(activity_env.info, heartbeat_timeout=timedelta(minutes=10))
    known = {n.name: node_summary(n) for n in probe_nodes(one.cluster.list_nodes({LABEL_SITE: site.name}))}
    found: list[SiteWatchResult] = []
    watcher = threading.Thread(target=lambda: found.append(activity_env.run(watches.watch_site, SiteWatchInput(
        site=site.name, known=known, api_ok=True, max_wait_seconds=600, api_check_seconds=600,
        placement=wanted))), daemon=True)
    watcher.start()
    time.sleep(3)  # the watch is listed and following
    assert not found, f"the watch returned with nothing changed: {found}"

    # ... but it may write its zone (and region, GPU product): NodeRestriction allows topology keys.
    status, answer = as_the_node(one, node.name, {LABEL_ZONE: "victim-zone"})
    assert status == 200, answer
    watcher.join(timeout=120)  # a guard against a hang: the watch's own wait is ten minutes
    assert found, "the watch did not return on the node's own label change"
    [result] = found
    assert result.self_labelled == {node.name: [f"{LABEL_ZONE}=victim-zone"]}, result
    status, stored = one.real.request("GET", f"/api/v1/nodes/{node.name}", admin=True)
    assert status == 200 and stored["metadata"]["labels"][LABEL_ZONE] == site.name, "put back on the API server"

    # Reported nodes are put back again without a second report, and a watch of a run that
    # enforces another config's values (or none) puts back without judging the node.
    status, answer = as_the_node(one, node.name, {LABEL_ZONE: "victim-zone"})
    assert status == 200, answer
    again = activity_env.run(watches.watch_site, SiteWatchInput(
        site=site.name, known=known, api_ok=True, max_wait_seconds=3, api_check_seconds=600,
        placement=wanted, reported=[node.name]))
    assert again.self_labelled == {}
    status, stored = one.real.request("GET", f"/api/v1/nodes/{node.name}", admin=True)
    assert stored["metadata"]["labels"][LABEL_ZONE] == site.name


def refused_by(answer) -> str:
    """Who refused a write: a shipped admission policy, NodeRestriction, or else the server's message."""
    message = answer.get("message", "") if isinstance(answer, dict) else str(answer)
    for policy in ADMISSION_POLICIES:
        if policy in message:
            return policy
    node_restriction = ("is not allowed to modify", "NodeRestriction", 'node "')
    return "NodeRestriction" if any(words in message for words in node_restriction) else message


def test_a_node_may_not_mark_cordon_or_uncordon_itself(one: RealJoining) -> None:
    """The control plane decides whether to keep or retire a node from the marks on its Node (a
    repair's fence, who cordoned it, spec.unschedulable): its kubelet's credential writes none of
    them (deploy/kubernetes/admission-policy.yaml), through the Node or its status. The kubelet
    registered with its taints and keeps its own writes (a non-gpufleet annotation)."""
    provisioned = one.provision()
    one.machine(provisioned.machine.id).boot()
    node = one.await_registration(provisioned, add_taints=[UNPROVEN_TAINT])
    assert node.ready and UNPROVEN_TAINT in node.taints, "registered with its taints under the policy"
    name = node.name
    # The API server loads admission policies asynchronously: give it until a dry run is refused.
    deadline = time.monotonic() + 30
    while node_write(one, name, {"spec": {"unschedulable": True}}, "?dryRun=All")[0] == 200:
        if time.monotonic() > deadline:
            break  # not enforced: the table below says what the node could do
        time.sleep(0.5)

    def outcome(patch: dict, subresource: str = "") -> str:
        status, answer = node_write(one, name, patch, subresource)
        return "allowed" if status == 200 else f"{status} {refused_by(answer)}"

    refused = f"403 {NODE_MARKS_POLICY}"
    fence, who = f"{FENCE_PREFIX}0", ANNOTATION_CORDONED_BY
    # Unmarked and schedulable: the node makes itself un-retirable, or cordons itself.
    found = {
        "add fence": outcome({"metadata": {"annotations": {fence: "reset"}}}),
        "add fence via status": outcome({"metadata": {"annotations": {fence: "reset"}}}, "/status"),
        "add cordoned-by person": outcome({"metadata": {"annotations": {who: "alice"}}}),
        "self-cordon": outcome({"spec": {"unschedulable": True}}),
        "own annotation": outcome({"metadata": {"annotations": {"example.com/kubelet-note": "x"}}}),
        "change a taint": outcome({"spec": {"taints": None}}),
    }
    # Marked by the control plane (a surplus cordon, a repair's fence), again before each write:
    # the node takes them over, drops them, or uncordons itself.

    def marked(patch: dict, subresource: str = "") -> str:
        one.cluster.cordon(name, by=CORDONED_BY_SURPLUS)
        one.cluster.annotate_node(name, {f"{FENCE_PREFIX}1": "reset"})
        return outcome(patch, subresource)

    found |= {
        "change cordoned-by": marked({"metadata": {"annotations": {who: "alice"}}}),
        "remove fence": marked({"metadata": {"annotations": {f"{FENCE_PREFIX}1": None}}}),
        "remove fence via status": marked({"metadata": {"annotations": {f"{FENCE_PREFIX}1": None}}}, "/status"),
        "self-uncordon": marked({"spec": {"unschedulable": None}}),
    }
    assert found == {
        "add fence": refused, "add fence via status": refused, "add cordoned-by person": refused,
        "self-cordon": refused, "own annotation": "allowed", "change a taint": "403 NodeRestriction",
        "change cordoned-by": refused, "remove fence": refused, "remove fence via status": refused,
        "self-uncordon": refused,
    }, found
    status, stored = one.real.request("GET", f"/api/v1/nodes/{name}", admin=True)
    marks = {k: v for k, v in stored["metadata"]["annotations"].items() if k.startswith("gpufleet.io/")}
    assert marks == {who: CORDONED_BY_SURPLUS, f"{FENCE_PREFIX}1": "reset"} and stored["spec"]["unschedulable"]
    # The control plane still writes them: it uncordons and lifts the fence.
    one.cluster.annotate_node(name, {f"{FENCE_PREFIX}1": None})
    assert not one.cluster.cordon(name, unschedulable=False).unschedulable
