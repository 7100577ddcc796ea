"""A node that writes its own placement labels (issue 35, finding 7), on the real dev server and the
simulated fleet: a kubelet may set ``topology.kubernetes.io/zone``, ``topology.kubernetes.io/region``
and ``nvidia.com/gpu.product`` on its own Node (NodeRestriction allows them), and the scheduler and
``PreferClose`` read them. The Site entity's watch puts the site's values back within seconds (not at
the next reconcile, an hour away here) and its Node entity quarantines the node, naming what it
wrote; the control plane's own labelling of a node that joins meanwhile trips nothing.

The simulated cluster has one writer for every caller: the node's write here is the test's
``label_node`` on it, which is what a kubelet's PATCH of its own Node is to the API server (the
real API server's NodeRestriction, and a real kubelet's credential, are in
tests/realk8s/test_labels.py). The recorded histories replay (tests/test_replay.py).
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.testing import WorkflowEnvironment

from fleet.cluster import LABEL_GPU_PRODUCT, LABEL_REGION, LABEL_ZONE
from fleet.messages.capacity import SiteStatus
from fleet.messages.repair import NodeStatus
from tests.evacuation_helpers import IncStack, incident_fleet, open_incident_stack, poll
from tests.replay import replay_and_record


@pytest.fixture
async def quiet(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[IncStack]:
    """The incident stack with no probe timer to speak of: whatever the site does, its watch saw."""
    uid = uuid.uuid4().hex[:6]
    async for stack in open_incident_stack(temporal_env.client, tmp_path, incident_fleet(
            uid, incident={"check_seconds": 3600}), uid):
        yield stack


async def node_status(inc: IncStack, name: str) -> NodeStatus | None:
    try:
        return await inc.client.get_workflow_handle(f"node/{name}").query("status", result_type=NodeStatus)
    except Exception:  # noqa: BLE001 - not started yet
        return None


def placement(inc: IncStack, name: str) -> dict[str, str]:
    labels = inc.cluster.get_node(name).labels
    return {k: labels.get(k) for k in (LABEL_ZONE, LABEL_REGION, LABEL_GPU_PRODUCT)}


async def test_a_node_that_changes_its_own_zone_is_put_back_within_seconds_and_quarantined(
        quiet, caplog: pytest.LogCaptureFixture) -> None:
    inc = quiet
    site = inc.site("a")
    await inc.join("a", 2)
    handle = await inc.start_site("a", reconcile_seconds=3600)  # the safety reconcile an hour away

    async def watching() -> bool:
        status = await handle.query("status", result_type=SiteStatus)
        return "within min/max" in status.last and status.incident is not None and status.incident.site_nodes >= 2

    await poll(watching, timeout=30)
    names = sorted(n.name for n in inc.cluster.list_nodes() if n.site == site)
    hostile, honest = names
    correct = {LABEL_ZONE: site, LABEL_REGION: "r1", LABEL_GPU_PRODUCT: "H100"}
    assert placement(inc, hostile) == correct

    # The node moves itself into another zone (PreferClose would send it another site's callers),
    # and claims another GPU product while at it.
    inc.cluster.label_node(hostile, {LABEL_ZONE: "victim-zone", LABEL_GPU_PRODUCT: "B200"})

    async def put_back() -> bool:
        return placement(inc, hostile) == correct

    # Put back by the site's watch, not at the next reconcile (an hour away): the bound only
    # guards against a hang.
    await poll(put_back, timeout=60, interval=0.05)

    async def quarantined() -> NodeStatus | None:
        status = await node_status(inc, hostile)
        return status if status and any("→ repair/" in line and "changed its own labels" in line
                                        for line in status.log) else None

    status = await poll(quarantined, timeout=30)
    reason = next(line for line in status.log if line.startswith("quarantined: "))
    assert f"{LABEL_ZONE}=victim-zone" in reason and f"{LABEL_GPU_PRODUCT}=B200" in reason, reason
    site_status = await handle.query("status", result_type=SiteStatus)
    assert hostile in site_status.last and "changed its own labels" in site_status.last

    # The control plane's own labelling trips nothing: a node joining now is labelled by its join
    # (and its zone written by the Demand pass and the reconcile would be the same values).
    await inc.join("a", 1)
    joined = sorted(set(n.name for n in inc.cluster.list_nodes() if n.site == site) - set(names))
    assert len(joined) == 1 and placement(inc, joined[0]) == correct

    async def seen_joined() -> bool:
        return (await handle.query("status", result_type=SiteStatus)).incident.site_nodes >= 3

    await poll(seen_joined, timeout=30)
    for name in (honest, joined[0]):
        status = await node_status(inc, name)
        assert status is not None and not any("quarantined" in line for line in status.log), (name, status.log)
    # Reported once: the put-back (the control plane's own write) is no second offence.
    hostile_status = await node_status(inc, hostile)
    assert sum(line.startswith("quarantined: ") for line in hostile_status.log) == 1, hostile_status.log

    await replay_and_record(handle, "site_self_labels_quarantine")
    # Named for the newest Node patch (``node-patches-at-start``); the older file stays (runs in flight).
    await replay_and_record(inc.client.get_workflow_handle(f"node/{hostile}"), "node_entity_self_labels_patches_at_start")

    # A node that writes its zone again and again has each put back, and the control plane's log
    # says so once a watch, not once a write (it logged each: the node's writes were its lines).
    caplog.set_level(logging.WARNING)
    caplog.clear()
    for i in range(20):
        inc.cluster.label_node(hostile, {LABEL_ZONE: f"flip-{i}"})
        await poll(put_back, timeout=30, interval=0.05)
    said = [r for r in caplog.records if f"node {hostile} changed its placement labels" in r.getMessage()]
    assert 1 <= len(said) <= 3, [r.getMessage() for r in said]
