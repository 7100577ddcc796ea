"""A node's own placement labels on the real control plane (issue 35, finding 7).

A machine joins from its user data and its real kubelet registers; the join labels it as the
control plane does (site, provider, region, GPU product; the zone is its site). The node then
uses its own credential, the kubelet's client certificate, to move itself into another zone:
the real API server's NodeRestriction lets it (``topology.kubernetes.io/*`` is a key a kubelet
may set on itself) and refuses the control plane's own ``node-restriction.kubernetes.io/`` site
label. The Site entity's watch (``watch_site``, as the control-plane service account with the
shipped RBAC) returns within seconds, having put the zone back, and names the node and what it
wrote: what the entity turns into the Node entity's quarantine (tests/security/test_self_labels.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import datetime, timedelta, timezone

from temporalio.testing import ActivityEnvironment

from fleet.messages.nodes import AwaitRegistrationInput
from activities.watches import WatchActivities
from fleet.cluster import LABEL_GPU_PRODUCT, LABEL_PROVIDER, LABEL_REGION, LABEL_SITE, LABEL_ZONE, UNPROVEN_TAINT
from fleet.demand import public_placement_labels
from fleet.messages.watches import SiteWatchInput, SiteWatchResult, node_summary
from activities.watches import probe_nodes
from tests.providers.test_join_real import run
from tests.realk8s.test_join import RealJoining, one  # noqa: F401 - the fixture


def as_the_node(one: RealJoining, name: str, labels: dict[str, str]) -> tuple[int, dict]:
    """A label write on its own Node with the real kubelet's client certificate."""
    return one.real.request("PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": labels}},
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
        site=site.name, known=known, api_ok=True, max_wait_seconds=120, api_check_seconds=600,
        placement=wanted))), daemon=True)
    watcher.start()
    time.sleep(3)  # the watch is listed and following
    assert not found, f"the watch returned with nothing changed: {found}"

    # ... but it may write its zone (and region, GPU product): NodeRestriction allows topology keys.
    status, answer = as_the_node(one, node.name, {LABEL_ZONE: "victim-zone"})
    assert status == 200, answer
    changed_at = time.monotonic()
    watcher.join(timeout=60)
    took = time.monotonic() - changed_at
    assert found, "the watch did not return on the node's own label change"
    assert took < 15, f"returned {took:.1f}s after the change"
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
