"""Site entity (min/max), SpotReclaim, and the entities' continue-as-new."""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from fleet.messages.capacity import AccountStatus, CapacityResult, SiteStatus, SpotReclaimResult
from tests.can_server import server_suggesting_continue_as_new
from tests.capacity_fleet import (FAST_JOIN, CapStack, capacity_fleet, details, failed_pass_cleared, failed_pass_shown,
                                  open_stack, replay_and_record)
from tests.conftest import wait_for, write_before_next_cordon
from tests.evacuation_helpers import poll

FILL = {"join_timeouts": FAST_JOIN, "backoff_seconds": 1}


@pytest.fixture
async def cap(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[CapStack]:
    uid = uuid.uuid4().hex[:6]
    fleet = capacity_fleet(uid, cheap={"min_nodes": 2, "max_nodes": 3}, mid={"max_nodes": 1})
    address = temporal_env.client.service_client.config.target_host
    async for stack in open_stack(temporal_env.client, address, tmp_path, fleet, uid):
        yield stack


def live(stack: CapStack, site: str) -> list:
    return stack.world.machines(stack.site(site))


async def start_site(stack: CapStack, name: str, **extra):
    return await stack.client.start_workflow(
        "Site", {"site": stack.site(name), "fill_request": FILL, "drain_seconds": 5, **extra},
        id=f"site/{stack.site(name)}", task_queue=stack.settings.task_queue,
    )


async def test_site_below_min_fills_and_above_max_retires_the_newest(cap: CapStack) -> None:
    # Below min (2): the entity acquires at its own site only.
    handle = await start_site(cap, "cheap")
    await wait_for(lambda: len(live(cap, "cheap")) == 2, timeout=30)
    await wait_for(lambda: all(n.ready for n in cap.cluster.list_nodes({"node-restriction.kubernetes.io/gpufleet-site": cap.site("cheap")}))
                   and len(cap.cluster.list_nodes({"node-restriction.kubernetes.io/gpufleet-site": cap.site("cheap")})) == 2, timeout=30)
    assert live(cap, "mid") == [] and live(cap, "dear") == []

    # Above max (1) at mid: join two, then the sweep reconciles; the newest goes.
    await cap.client.execute_workflow("NodeJoin", {"site": cap.site("mid"), "timeouts": FAST_JOIN},
                                      id=f"join/{cap.site('mid')}/first", task_queue=cap.settings.task_queue)
    await cap.client.execute_workflow("NodeJoin", {"site": cap.site("mid"), "timeouts": FAST_JOIN},
                                      id=f"join/{cap.site('mid')}/second", task_queue=cap.settings.task_queue)
    first, second = live(cap, "mid")
    await cap.client.execute_workflow("SiteSweep", {"sites": [cap.site("mid")]}, id=f"sweep-{cap.uid}",
                                      task_queue=cap.settings.task_queue)
    mid = cap.client.get_workflow_handle(f"site/{cap.site('mid')}")
    await wait_for(lambda: [m["id"] for m in live(cap, "mid")] == [first["id"]], timeout=30)
    assert cap.cluster.get_node(second["name"]) is None
    status = await mid.query("status", result_type=SiteStatus)
    assert status.max_nodes == 1
    await wait_for(lambda: status.last, timeout=5)
    await replay_and_record(handle, "site_fill_below_min")
    await replay_and_record(mid, "site_retire_above_max")


async def test_a_site_the_cluster_refuses_to_list_stays_up_says_so_and_fills_once_it_may(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """cheap (min 2) starts while the control plane may not list its nodes (an RBAC mistake: 403,
    ``ClusterForbidden``, which no retry helps; the API server away past the ten retries ends the
    same way, as ``Transient``). The entity stays up, its details saying what failed and when it
    tries again; once listing is allowed again it fills to its min as usual. Before, the failed
    reconcile failed the Site entity: min/max, retirement and the incident rule stopped at the site
    until the sweep started it again, with none of its carried state."""
    from fleet.cluster import LABEL_SITE
    from fleet.errors import ClusterForbidden
    from sim.cluster import SimCluster

    cheap, listed = cap.site("cheap"), SimCluster.list_nodes
    refusing = [True]

    def list_nodes(self, selector=None):
        if refusing[0] and (selector or {}).get(LABEL_SITE) == cheap:
            # As the Kubernetes adapter raises a 403 (providers/cluster/kubernetes/api.py).
            raise ClusterForbidden('list nodes: nodes is forbidden: User "system:serviceaccount:gpufleet:'
                                   'control-plane" cannot list resource "nodes"', code="403")
        return listed(self, selector)

    monkeypatch.setattr(SimCluster, "list_nodes", list_nodes)
    handle = await start_site(cap, "cheap")

    shown = await failed_pass_shown(handle)
    assert re.search(r"could not reconcile \(ClusterForbidden: list nodes: nodes is forbidden: .*\); "
                     r"next try at \d\d:\d\d:\d\d UTC", shown), shown
    assert live(cap, "cheap") == [], "nothing bought on a count it could not make"

    refusing[0] = False  # the RBAC fixed
    await wait_for(lambda: len(live(cap, "cheap")) == 2, timeout=60)
    await failed_pass_cleared(handle)
    await replay_and_record(handle, "site_reconcile_refused_then_fills")


async def test_a_fill_that_fails_holds_the_next_one_back_saying_why_and_until_when(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """cheap (min 2) while its provider refuses every machine as an ``InvalidRequest`` (an image the
    account may not use: no retry and no other offer helps). Its fill fails; the entity says why and
    when the next fill starts, in its status, details and ``FleetState``, and starts none before
    (``site-paces-failed-fills``); the image fixed, a person's ``reconcile_now`` fills the site at once.
    Before, the failed fill asked for a reconcile that started the next fill at once, for ever: about
    five fills a second, each calling the provider, the details saying only "below min (0 < 2): acquiring 2"."""
    from fleet.errors import InvalidRequest
    from fleet.naming import fill_workflow_id
    from sim.provider import SimProvider

    cheap, created = cap.site("cheap"), SimProvider.create_machine
    refusing = [True]

    def create_machine(self, spec, idempotency_key, user_data=""):
        if refusing[0] and self.site.name == cheap:
            raise InvalidRequest("image gpufleet-node-1.4 is not available to this account", provider=self.name)
        return created(self, spec, idempotency_key, user_data)

    monkeypatch.setattr(SimProvider, "create_machine", create_machine)
    handle = await start_site(cap, "cheap")

    async def paused() -> SiteStatus | None:
        status = await handle.query("status", result_type=SiteStatus)
        return status if "next fill at" in status.last else None

    status = await poll(paused, timeout=30)
    first = fill_workflow_id(cheap, 1)
    assert re.fullmatch(
        rf"below min \(0 < 2\): fill {re.escape(first)} failed \(InvalidRequest: .*image gpufleet-node-1\.4 is not "
        r"available to this account.*\); next fill at \d\d:\d\d:\d\d UTC \(`reconcile_now` starts one at once\)",
        status.last), status.last
    assert status.filling == ""
    with pytest.raises(RPCError) as missing:  # no second fill started behind the failed one
        await cap.client.get_workflow_handle(fill_workflow_id(cheap, 2)).describe()
    assert missing.value.status == RPCStatusCode.NOT_FOUND
    assert "next fill at" in await details(handle)
    described = await handle.describe()
    assert "fill-failed" in str(described.search_attributes.get("FleetState")), described.search_attributes
    assert live(cap, "cheap") == []

    refusing[0] = False  # the image fixed
    answer = await handle.execute_update("reconcile_now", result_type=str)
    assert "its last fill failed" in answer and "acquires 2 nodes now" in answer, answer
    await wait_for(lambda: len(live(cap, "cheap")) == 2, timeout=60)
    await replay_and_record(handle, "site_paces_a_failed_fill")


async def test_above_max_retires_free_nodes_and_leaves_held_ones_to_their_holders(cap: CapStack) -> None:
    """mid (max 1) has three nodes: the newest is a repair's (a GPU fenced), the next a person's
    (marked theirs). The site retires the free one and says who holds the others, deleting neither;
    once the repair ends (its uncordon) that node is free and retired. Before, the newest two were
    chosen, drained and deleted under the repair (which then climbs its ladder to replace a node
    that vanished) and under the person."""
    from activities.repair import fence_key
    from fleet.cluster import ANNOTATION_CORDONED_BY

    mid = cap.site("mid")
    names = []
    for name in ("first", "second", "third"):
        joined = await cap.client.execute_workflow("NodeJoin", {"site": mid, "timeouts": FAST_JOIN},
                                                   id=f"join/{mid}/{name}", task_queue=cap.settings.task_queue)
        names.append(joined["nodes"][0]["node_name"])
    free, alices, repaired = names
    cap.cluster.annotate_node(repaired, {fence_key(1): "reset"})  # as fence_gpu does
    cap.cluster.cordon(repaired, True)
    cap.cluster.cordon(alices, by="alice")
    machines = {m["name"]: m["id"] for m in live(cap, "mid")}
    site = await start_site(cap, "mid")

    async def status() -> SiteStatus:
        return await site.query("status", result_type=SiteStatus)

    await wait_for(lambda: cap.cluster.get_node(free) is None, timeout=30)
    await wait_for(lambda: sorted(m["name"] for m in live(cap, "mid")) == sorted([alices, repaired]), timeout=10)
    for _ in range(100):
        last = (await status()).last
        if "nothing retired" in last:
            break
        await asyncio.sleep(0.1)
    assert f"{repaired} (cordoned by its repair (GPU 1 fenced))" in last, last
    assert f"{alices} (cordoned by 'alice' ({ANNOTATION_CORDONED_BY}))" in last, last
    await asyncio.sleep(2)  # more reconciles: still neither
    assert cap.cluster.get_node(repaired) is not None and cap.cluster.get_node(alices) is not None

    cap.cluster.annotate_node(repaired, {fence_key(1): None})  # the repair ends: as uncontain_gpu does
    cap.cluster.cordon(repaired, False)
    await wait_for(lambda: [m["id"] for m in live(cap, "mid")] == [machines[alices]], timeout=30)
    assert cap.cluster.get_node(repaired) is None and cap.cluster.get_node(alices).unschedulable
    await replay_and_record(site, "site_above_max_leaves_held_nodes_to_their_holders")


async def test_above_max_keeps_a_node_a_repair_took_during_its_drain(cap: CapStack) -> None:
    """mid (max 1) retires its newest node; while a PodDisruptionBudget holds the drain a repair
    fences a GPU of it, then the drain passes. The retirement looks again before it deletes: the
    node, its machine and its cordon are the repair's, the site says so and, the node held, retires
    the other one. Before, the node was deleted under the repair."""
    from activities.repair import fence_key
    from fleet.cluster import ANNOTATION_CORDONED_BY

    mid = cap.site("mid")
    names = []
    for name in ("first", "second"):
        joined = await cap.client.execute_workflow("NodeJoin", {"site": mid, "timeouts": FAST_JOIN},
                                                   id=f"join/{mid}/{name}", task_queue=cap.settings.task_queue)
        names.append(joined["nodes"][0]["node_name"])
    first, newest = names
    machines = {m["name"]: m["id"] for m in live(cap, "mid")}
    cap.cluster.add_pod(newest, "keeper", labels={"app": "keeper"})
    cap.cluster.set_pdb("default", "keeper", {"app": "keeper"}, min_available=1)
    site = await start_site(cap, "mid", drain_seconds=30)
    await wait_for(lambda: cap.cluster.get_node(newest).unschedulable, timeout=30)  # its drain began
    cap.cluster.annotate_node(newest, {fence_key(1): "reset"})  # as fence_gpu does (already cordoned)
    cap.cluster.delete_pdb("default", "keeper")  # the drain passes
    await wait_for(lambda: cap.cluster.get_node(first) is None, timeout=30)
    assert [m["id"] for m in live(cap, "mid")] == [machines[newest]], "its machine stays"
    assert cap.cluster.get_node(newest).unschedulable, "the cordon is left to the repair"
    assert ANNOTATION_CORDONED_BY not in cap.cluster.annotate_node(newest, {}), "the cordon is the repair's now"
    await replay_and_record(site, "site_above_max_keeps_a_node_a_repair_took_during_its_drain")


async def _join(cap: CapStack, site: str, *names: str) -> list[str]:
    joined = []
    for name in names:
        result = await cap.client.execute_workflow("NodeJoin", {"site": cap.site(site), "timeouts": FAST_JOIN},
                                                   id=f"join/{cap.site(site)}/{name}", task_queue=cap.settings.task_queue)
        joined.append(result["nodes"][0]["node_name"])
    return joined


async def test_back_within_its_max_the_site_uncordons_a_node_its_blocked_drain_left(cap: CapStack) -> None:
    """mid (max 1) retires its newest node; a PodDisruptionBudget blocks the drain, so the node
    stays cordoned, marked the Site's. Then the other node leaves (an operator deletes it): the
    site is within its max, and the Site uncordons the node (its mark dropped) and says so. Before,
    nothing ever uncordoned it: paid for, idle and unusable for good."""
    from fleet.cluster import ANNOTATION_CORDONED_BY, CORDONED_BY_SURPLUS

    first, newest = await _join(cap, "mid", "first", "second")
    cap.cluster.add_pod(newest, "keeper", labels={"app": "keeper"})
    cap.cluster.set_pdb("default", "keeper", {"app": "keeper"}, min_available=1)
    site = await start_site(cap, "mid", drain_seconds=1)
    await wait_for(lambda: cap.cluster.annotate_node(newest, {}).get(ANNOTATION_CORDONED_BY) == CORDONED_BY_SURPLUS,
                   timeout=30)  # its drain began
    await asyncio.sleep(3)  # the drain (1 s) blocks on the PodDisruptionBudget
    assert cap.cluster.get_node(newest).unschedulable and cap.cluster.get_node(first) is not None

    cap.cluster.remove_node(first)  # the site is back within its max
    await wait_for(lambda: not cap.cluster.get_node(newest).unschedulable, timeout=30)
    # The status said so only until the uncordon woke the Site again: its history keeps the release.
    history = await site.fetch_history()
    released = [e.activity_task_scheduled_event_attributes.input.payloads[0].data for e in history.events
                if e.activity_task_scheduled_event_attributes.activity_type.name == "release_cordons"]
    assert len(released) == 1 and newest.encode() in released[0], released
    assert ANNOTATION_CORDONED_BY not in cap.cluster.annotate_node(newest, {}), "the uncordon drops the mark"
    assert [m["name"] for m in live(cap, "mid") if m["name"] == newest], "its machine stays"
    await replay_and_record(site, "site_back_within_max_uncordons_its_blocked_drain")


async def test_above_its_max_the_site_first_retires_a_node_its_blocked_drain_left(cap: CapStack) -> None:
    """mid (max 1) has two nodes; the older one is cordoned with the Site's mark (an earlier run's
    drain blocked, then that run ended). The new run knows it as its own from the cluster and
    retires it, already drained, keeping the newest, in service. Before, the newest was drained and
    retired and the cordoned one stayed, idle, within the max, for good."""
    first, newest = await _join(cap, "mid", "first", "second")
    from fleet.cluster import CORDONED_BY_SURPLUS

    cap.cluster.cordon(first, by=CORDONED_BY_SURPLUS)  # as the blocked drain left it
    site = await start_site(cap, "mid")
    await wait_for(lambda: cap.cluster.get_node(first) is None or cap.cluster.get_node(newest) is None, timeout=30)
    assert cap.cluster.get_node(first) is None, "the node its own drain left cordoned goes first"
    assert [m["name"] for m in live(cap, "mid")] == [newest] and not cap.cluster.get_node(newest).unschedulable
    await replay_and_record(site, "site_above_max_retires_its_blocked_drain_first")


async def test_release_cordons_uncordons_only_its_owners_free_cordons(cap: CapStack) -> None:
    """The Site's release of its own cordons leaves every other: a person's mark, the demand loop's,
    a cordon without a mark (a person's `kubectl cordon`), a node whose GPU a repair fenced since."""
    from temporalio.testing import ActivityEnvironment

    from activities.capacity import CapacityActivities
    from activities.repair import fence_key
    from fleet.cluster import ANNOTATION_CORDONED_BY, CORDONED_BY_DEMAND, CORDONED_BY_SURPLUS
    from fleet.messages.capacity import ReleaseCordonsInput

    mine, alices, demands, fenced = await _join(cap, "dear", "a", "b", "c", "d")
    (unmarked,) = await _join(cap, "mid", "e")
    for node in (mine, fenced):
        cap.cluster.cordon(node, by=CORDONED_BY_SURPLUS)
    cap.cluster.cordon(alices, by="alice")
    cap.cluster.cordon(demands, by=CORDONED_BY_DEMAND)
    cap.cluster.cordon(unmarked, True)
    cap.cluster.annotate_node(fenced, {fence_key(0): "reset"})  # a repair took it since
    release = CapacityActivities(cap.env).release_cordons
    asked = ReleaseCordonsInput(nodes=[mine, alices, demands, unmarked, fenced, "gone"], cordoned_by=CORDONED_BY_SURPLUS)
    assert ActivityEnvironment().run(release, asked) == [mine]
    assert not cap.cluster.get_node(mine).unschedulable
    assert ANNOTATION_CORDONED_BY not in cap.cluster.annotate_node(mine, {})
    for node in (alices, demands, unmarked, fenced):
        assert cap.cluster.get_node(node).unschedulable, node
    assert cap.cluster.annotate_node(alices, {})[ANNOTATION_CORDONED_BY] == "alice"


async def test_release_cordons_leaves_a_node_a_repair_fenced_between_its_look_and_its_uncordon(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Site's release reads a node's marks (its own cordon, no one else's) and uncordons it; a
    repair fences a GPU of it and cordons it right in between. The uncordon, made on the marks
    read, is refused; read again, the node is the repair's and stays cordoned. Before, the
    uncordon lifted the repair's cordon: the node took pods on a GPU under repair."""
    from temporalio.testing import ActivityEnvironment

    from activities.capacity import CapacityActivities
    from activities.repair import fence_key
    from fleet.cluster import CORDONED_BY_SURPLUS
    from fleet.messages.capacity import ReleaseCordonsInput

    (node,) = await _join(cap, "dear", "a")
    cap.cluster.cordon(node, by=CORDONED_BY_SURPLUS)

    def repair_fences() -> None:  # as fence_gpu does
        cap.cluster.annotate_node(node, {fence_key(0): "reset"})
        cap.cluster.cordon(node, True)

    raced = write_before_next_cordon(monkeypatch, cap.cluster, node, repair_fences)
    asked = ReleaseCordonsInput(nodes=[node], cordoned_by=CORDONED_BY_SURPLUS)
    assert ActivityEnvironment().run(CapacityActivities(cap.env).release_cordons, asked) == []
    assert raced, "the repair fenced between the release's look and its uncordon"
    assert cap.cluster.get_node(node).unschedulable, "the repair's cordon stays"
    assert fence_key(0) in cap.cluster.annotate_node(node, {})


async def test_a_join_tells_its_site_entity_at_once(cap: CapStack) -> None:
    """A node joined from outside the entity (CLI, temporal CLI) is in its status
    when the join ends, not at the next reconcile minutes later."""
    site = await start_site(cap, "dear", reconcile_seconds=3600)
    await wait_for(lambda: True)

    async def status() -> SiteStatus:
        return await site.query("status", result_type=SiteStatus)

    for _ in range(100):
        if (await status()).last:
            break
        await asyncio.sleep(0.1)
    assert (await status()).nodes == {}
    joined = await cap.client.execute_workflow(
        "NodeJoin", {"site": cap.site("dear"), "timeouts": FAST_JOIN}, id=f"join/{cap.site('dear')}/told",
        task_queue=cap.settings.task_queue,
    )
    node_name = joined["nodes"][0]["node_name"]
    for _ in range(100):
        if (await status()).nodes.get(node_name) == "ready":
            break
        await asyncio.sleep(0.1)
    assert (await status()).nodes == {node_name: "ready"}


async def test_spot_reclaim_drains_honoring_pdb_and_replaces_elsewhere(cap: CapStack) -> None:
    spot = cap.site("spot")
    await cap.client.execute_workflow("NodeJoin", {"site": spot, "timeouts": FAST_JOIN}, id=f"join/{spot}/r1",
                                      task_queue=cap.settings.task_queue)
    (machine,) = live(cap, "spot")
    node = machine["name"]
    for pod in ("web-1", "web-2"):
        cap.cluster.add_pod(node, pod, labels={"app": "web"})
    cap.cluster.set_pdb("default", "web", {"app": "web"}, min_available=1)

    cap.world.post_reclaim_notice(machine["id"], seconds=20)  # the node agent's watcher starts SpotReclaim
    handle = cap.client.get_workflow_handle(f"reclaim/{node}")
    await wait_for(lambda: [p.name for p in cap.cluster.pods(node)] in (["web-1"], ["web-2"]), timeout=20)
    # The PDB holds the last pod while no other replica runs; the replacement joins meanwhile.
    replacement = await wait_for(lambda: [n for n in cap.cluster.list_nodes() if n.name != node and n.ready], timeout=20)
    assert len(cap.cluster.pods(node)) == 1, "PDB honoured: the last replica stays until another runs"
    cap.cluster.add_pod(replacement[0].name, "web-3", labels={"app": "web"})  # rescheduled on the new node

    result = SpotReclaimResult.model_validate(await handle.result())
    assert result.drained and result.blocked == []
    (new,) = result.replacement.nodes
    assert new.site != spot and new.site == cap.site("cheap")
    assert cap.cluster.get_node(node) is None
    assert cap.world.machine(machine["id"])["deleted_at"] is not None
    await replay_and_record(handle, "spot_reclaim")


#: The Schedule's SiteSweep pass that starts the SpotReclaim of a spot node whose machine stopped
#: without a notice (``sweep-reclaims-stopped-spot``), and that reclaim's run, terminating at once.
RECORDED_STOPPED_SPOT_SWEEP = "site_sweep_reclaims_stopped_spot"
RECORDED_STOPPED_SPOT_RECLAIM = "spot_reclaim_of_a_machine_stopped_without_a_notice"


async def test_a_spot_machine_stopped_without_a_notice_is_reclaimed_and_replaced_by_the_site_sweep(
        cap: CapStack) -> None:
    """Nebius preempts a spot machine without a notice the node agent can read: the machine stops
    (``on_preemption: STOP``) and its node turns NotReady. Before, nothing drained or replaced it: it
    stayed, counted toward its site's min_nodes, until a person started or deleted the machine. The
    Schedule's SiteSweep pass sees its provider report the machine stopped and starts its SpotReclaim,
    terminating now: the node is retired, its machine deleted, and a replacement joins elsewhere. An
    on-demand machine stopped (a person may have stopped it) is left as it is, and a second pass
    starts no second reclaim."""
    spot, mid = cap.site("spot"), cap.site("mid")
    for site in (spot, mid):
        await cap.client.execute_workflow("NodeJoin", {"site": site, "timeouts": FAST_JOIN}, id=f"join/{site}/s1",
                                          task_queue=cap.settings.task_queue)
    (taken,), (stopped,) = live(cap, "spot"), live(cap, "mid")
    for machine in (taken, stopped):
        cap.world.preempt_machine(machine["id"])
    await wait_for(lambda: not any(cap.cluster.get_node(m["name"]).ready for m in (taken, stopped)), timeout=20)

    async def sweep_pass(n: int) -> str:
        handle = await cap.client.start_workflow("SiteSweep", {}, id=f"site-sweep-{cap.uid}-{n}",
                                                 task_queue=cap.settings.task_queue, result_type=list[str])
        await handle.result()
        if n == 1:
            await replay_and_record(handle, RECORDED_STOPPED_SPOT_SWEEP)
        return await details(handle)

    said = await sweep_pass(1)
    assert f"reclaim started for {taken['name']} (spot machine stopped without a notice)" in said, said
    assert stopped["name"] not in said, said
    reclaim = cap.client.get_workflow_handle(f"reclaim/{taken['name']}")
    first_run = (await reclaim.describe()).run_id
    said = await sweep_pass(2)  # the reclaim running (or done: the node gone) is left alone
    assert "reclaim started" not in said, said
    assert (await reclaim.describe()).run_id == first_run

    result = SpotReclaimResult.model_validate(await asyncio.wait_for(reclaim.result(), timeout=60))
    (new,) = result.replacement.nodes
    assert new.site != spot and cap.cluster.get_node(new.node_name).ready
    assert cap.cluster.get_node(taken["name"]) is None
    assert cap.world.machine(taken["id"])["deleted_at"] is not None
    # The on-demand machine: no reclaim, kept (stopped) with its node, as a person left it.
    assert [w async for w in cap.client.list_workflows(f'WorkflowId = "reclaim/{stopped["name"]}"')] == []
    assert cap.world.machine(stopped["id"])["deleted_at"] is None
    assert not cap.cluster.get_node(stopped["name"]).ready
    await replay_and_record(reclaim, RECORDED_STOPPED_SPOT_RECLAIM)


async def test_a_reclaim_a_person_cancelled_is_not_started_again_by_the_sweep_while_the_machine_stays_stopped(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A person cancels the SpotReclaim of a spot node whose machine the provider shows stopped (to
    start the machine again themselves): the node is uncordoned and kept. The next SiteSweep pass
    started a reclaim again, and every pass after it. Now a pass leaves the node to the person for
    ``RECLAIM_LEFT_TO_A_PERSON`` after the cancel, its details saying so and until when; past that,
    the machine still stopped, it is reclaimed."""
    import activities.control_plane

    spot = cap.site("spot")
    await cap.client.execute_workflow("NodeJoin", {"site": spot, "timeouts": FAST_JOIN}, id=f"join/{spot}/c1",
                                      task_queue=cap.settings.task_queue)
    (machine,) = live(cap, "spot")
    node = machine["name"]
    reclaim = await reclaim_cancelled_while_stopped(cap, machine)
    cancelled_run = (await reclaim.describe()).run_id

    for n in (1, 2):
        said = await sweep_pass(cap, n)
        assert "reclaim started" not in said, f"pass {n} started the cancelled reclaim again: {said}"
        assert re.search(rf"reclaim ended by a person, left to them: {node} \(its reclaim was canceled at "
                         r"[-\d: ]+ UTC: not started again before [-\d: ]+ UTC while its machine stays stopped\)",
                         said), said
        assert (await reclaim.describe()).run_id == cancelled_run
    assert cap.world.machine(machine["id"])["deleted_at"] is None, "the machine is the person's"

    monkeypatch.setattr(activities.control_plane, "RECLAIM_LEFT_TO_A_PERSON", activities.control_plane.timedelta(0))
    said = await sweep_pass(cap, 3)  # the person's time is up, the machine still stopped
    assert f"reclaim started for {node} (spot machine stopped without a notice)" in said, said
    assert (await reclaim.describe()).run_id != cancelled_run


async def reclaim_cancelled_while_stopped(cap: CapStack, machine: dict):
    """The provider stops the spot machine, its SpotReclaim starts and a person cancels it; until
    its node is NotReady and uncordoned. Returns the reclaim's handle."""
    import time

    from fleet.cluster import CORDONED_BY_RECLAIM
    from tests.test_reclaim_deadline import cancelled, cordon_mark, start_reclaim

    node = machine["name"]
    cap.world.preempt_machine(machine["id"])
    await wait_for(lambda: not cap.cluster.get_node(node).ready, timeout=20)
    reclaim = await start_reclaim(cap, node, machine["id"], time.time() + 600)
    await wait_for(lambda: cordon_mark(cap, node) == CORDONED_BY_RECLAIM, timeout=20)
    await cancelled(reclaim)
    await wait_for(lambda: not cap.cluster.get_node(node).unschedulable, timeout=20)
    return reclaim


async def sweep_pass(cap: CapStack, n: int) -> str:
    """One SiteSweep pass (``site-sweep-<uid>-<n>``): its details once it ended."""
    handle = await cap.client.start_workflow("SiteSweep", {}, id=f"site-sweep-{cap.uid}-{n}",
                                             task_queue=cap.settings.task_queue, result_type=list[str])
    await handle.result()
    return await details(handle)


async def test_a_cancelled_reclaim_holds_neither_a_terminated_machine_nor_one_whose_node_was_ready_since(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two spot nodes whose reclaims a person cancelled while their machines were stopped. One
    machine the provider then reports terminated: it cannot be started again, yet the hold kept
    its node NotReady and unreplaced for 6 hours, counted toward min_nodes. The other the person
    started again, its node Ready, and the provider took it again an hour later: the hold still
    ran from the cancel. The next pass starts the reclaim of both."""
    from sim.provider import SimProvider

    spot = cap.site("spot")
    for n in (1, 2):
        await cap.client.execute_workflow("NodeJoin", {"site": spot, "timeouts": FAST_JOIN}, id=f"join/{spot}/t{n}",
                                          task_queue=cap.settings.task_queue)
    terminated, restarted = live(cap, "spot")
    for machine in (terminated, restarted):
        await reclaim_cancelled_while_stopped(cap, machine)
    said = await sweep_pass(cap, 1)
    assert "reclaim started" not in said, said
    assert all(f"{m['name']} (its reclaim was canceled at" in said for m in (terminated, restarted)), said

    cap.world.start_machine(restarted["id"])  # the person's doing
    await wait_for(lambda: cap.cluster.get_node(restarted["name"]).ready, timeout=20)
    cap.world.preempt_machine(restarted["id"])  # the provider's, again
    await wait_for(lambda: not cap.cluster.get_node(restarted["name"]).ready, timeout=20)
    listed = SimProvider.list_machines
    monkeypatch.setattr(SimProvider, "list_machines", lambda self: [
        m.model_copy(update={"state": "terminated"}) if m.id == terminated["id"] else m for m in listed(self)])

    said = await sweep_pass(cap, 2)
    both = ", ".join(sorted(m["name"] for m in (terminated, restarted)))
    assert f"reclaim started for {both} (spot machine stopped without a notice)" in said, said


async def test_joins_within_max_are_counted_without_listing_the_site_and_one_past_it_is_retired(
        cap: CapStack) -> None:
    """A fleet coming up sends each Site entity one transition per join: a join within max is
    counted from its transition (the site is not listed again), and the join that takes the site
    past its max makes the entity reconcile at once and retire the newest, no sweep needed."""
    site = await start_site(cap, "mid", reconcile_seconds=3600)

    async def status() -> SiteStatus:
        return await site.query("status", result_type=SiteStatus)

    async def listings() -> int:
        history = await site.fetch_history()
        return sum(e.activity_task_scheduled_event_attributes.activity_type.name == "site_nodes"
                   for e in history.events if e.HasField("activity_task_scheduled_event_attributes"))

    for _ in range(100):
        if (await status()).last:
            break
        await asyncio.sleep(0.1)
    assert await listings() == 1, "the run's first reconcile"

    async def join(name: str) -> str:
        joined = await cap.client.execute_workflow(
            "NodeJoin", {"site": cap.site("mid"), "timeouts": FAST_JOIN}, id=f"join/{cap.site('mid')}/{name}",
            task_queue=cap.settings.task_queue)
        return joined["nodes"][0]["node_name"]

    first = await join("first")
    (kept,) = live(cap, "mid")
    for _ in range(100):
        if (await status()).nodes.get(first) == "ready":
            break
        await asyncio.sleep(0.1)
    assert (await status()).nodes == {first: "ready"}
    assert await listings() == 1, "a join within max is counted, not listed"

    second = await join("second")
    # The retirement deletes the machine, then removes its Node: wait for both.
    await wait_for(lambda: [m["id"] for m in live(cap, "mid")] == [kept["id"]]
                   and cap.cluster.get_node(second) is None, timeout=30)
    assert cap.cluster.get_node(first) is not None
    # The join past max reconciled at once (the safety reconcile is an hour away). Its transition
    # and the site's watch (which also saw the site above its max) may each wake one: at least one.
    assert await listings() >= 2, "the join past max: listed again"
    await replay_and_record(site, "site_counts_joins")


@pytest.mark.integration  # a dev server with a low continue-as-new threshold
async def test_a_site_continues_as_new_only_between_its_retirements(tmp_path: Path) -> None:
    """The server suggests continue-as-new while the Site drains its surplus beside its loop, the
    drain held by a PodDisruptionBudget for its 4 s: the run continues once that drain has ended,
    never leaving one in flight behind it, and before it starts the next (a budget that never
    yields must not keep it from continuing for good); the next run retires the node once the
    budget goes."""
    from temporalio.api.enums.v1 import EventType

    async with server_suggesting_continue_as_new(20) as env:
        address, uid = env.client.service_client.config.target_host, uuid.uuid4().hex[:6]
        fleet = capacity_fleet(uid, mid={"max_nodes": 1})
        async for stack in open_stack(env.client, address, tmp_path, fleet, uid):
            first, newest = await _join(stack, "mid", "first", "second")
            stack.cluster.add_pod(newest, "keeper", labels={"app": "keeper"})
            stack.cluster.set_pdb("default", "keeper", {"app": "keeper"}, min_available=1)
            site = await start_site(stack, "mid", drain_seconds=4)
            first_run = (await site.describe()).run_id

            async def continued() -> bool:
                history = await env.client.get_workflow_handle(site.id, run_id=first_run).fetch_history()
                return history.events[-1].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW

            for _ in range(200):
                if await continued():
                    break
                await asyncio.sleep(0.1)
            events = (await env.client.get_workflow_handle(site.id, run_id=first_run).fetch_history()).events
            drains = [e.event_id for e in events if e.HasField("activity_task_scheduled_event_attributes")
                      and e.activity_task_scheduled_event_attributes.activity_type.name == "drain_within"]
            ended = [e.event_id for e in events if e.HasField("activity_task_completed_event_attributes")
                     and e.activity_task_completed_event_attributes.scheduled_event_id in drains]
            suggested = [e.event_id for e in events if e.HasField("workflow_task_started_event_attributes")
                         and e.workflow_task_started_event_attributes.suggest_continue_as_new]
            assert events[-1].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
            assert len(drains) == 1 and len(ended) == 1, "one drain, ended in the run that began it"
            assert suggested and suggested[0] < ended[0], "suggested while it drained"
            assert not any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED for e in events)

            stack.cluster.delete_pdb("default", "keeper")
            await wait_for(lambda: stack.cluster.get_node(newest) is None, timeout=60)
            assert [m["name"] for m in live(stack, "mid")] == [first]


async def test_entities_continue_as_new(tmp_path: Path) -> None:
    """A dev server of its own, suggesting continue-as-new after 40 events."""
    async with server_suggesting_continue_as_new(40) as env:
        address = env.client.service_client.config.target_host
        async for stack in open_stack(env.client, address, tmp_path):
            site = await start_site(stack, "dear")
            for i in range(25):
                await site.signal("node_transition", {"node_name": f"n{i}", "state": "ready"})
            await wait_for(lambda: True)

            async def runs(handle) -> int:
                return len([w async for w in env.client.list_workflows(f'WorkflowId = "{handle.id}"')])

            for _ in range(100):
                if await runs(site) > 1:
                    break
                await asyncio.sleep(0.1)
            assert await runs(site) > 1, "the Site entity continued as new"
            status = await site.query("status", result_type=SiteStatus)
            assert status.site == stack.site("dear")
            desc = await site.describe()
            assert desc.status == WorkflowExecutionStatus.RUNNING

            # ProviderAccount: many reports (new offers each time) → continues as new, state kept.
            stack.world.set_site(stack.site("cheap"), quota=0)
            account = stack.account_handle("lambda", "a")
            await env.client.start_workflow(
                "ProviderAccount", {"account": stack.account("a"), "provider": "lambda"}, id=account.id,
                task_queue=stack.settings.task_queue,
            )
            for i in range(12):
                await account.signal("report", {"account": stack.account("a"), "kind": "OverQuota",
                                                "offer": f"x{i}/t", "message": "quota"})
            for _ in range(150):
                if await runs(account) > 1:
                    break
                await asyncio.sleep(0.1)
            assert await runs(account) > 1, "the ProviderAccount entity continued as new"
            status = await account.query("status", result_type=AccountStatus)
            await wait_for(lambda: True)
            assert status.state == "quota-blocked" and len(status.blocked_offers) >= 1




async def _fill_runs(cap: CapStack, name: str) -> dict[str, int]:
    """How many runs Temporal has behind each of the site's fill ids ``capacity/site-<site>-<n>``."""
    runs: dict[str, int] = {}
    query = f'WorkflowType = "AcquireCapacity" AND TaskQueue = "{cap.settings.task_queue}"'
    async for wf in cap.client.list_workflows(query):
        if wf.id.startswith(f"capacity/site-{cap.site(name)}-"):
            runs[wf.id] = runs.get(wf.id, 0) + 1
    return runs


async def _filling(site) -> str:
    """The fill the Site entity says it is filling with, for ``poll``."""
    try:
        return (await site.query("status", result_type=SiteStatus)).filling
    except Exception:  # noqa: BLE001 - its first task may not have run yet
        return ""


async def _fill_result(cap: CapStack, fill_id: str) -> CapacityResult:
    """The fill's result. The site says ``filling`` from the workflow task that starts the fill, and a
    query can answer before the server has taken that task's commands, so the fill may not exist yet."""
    async def result() -> object:
        while True:
            try:
                return await cap.client.get_workflow_handle(fill_id).result()
            except RPCError as error:
                if error.status != RPCStatusCode.NOT_FOUND:
                    raise
                await asyncio.sleep(0.1)
    return CapacityResult.model_validate(await asyncio.wait_for(result(), 30))


async def test_a_site_entity_started_again_numbers_its_next_fill_past_those_on_record(cap: CapStack) -> None:
    """A Site entity terminated (or reset, or its state lost) and started again counted its fills
    from 1 again: its next fill put a second run behind ``capacity/site-<site>-1``, and `gpufleet
    capacity`, the status and the site's ``filling`` read that one for both. Now it numbers past every
    fill of its site on record; the first fill stays the only run behind its id."""
    cheap = cap.site("cheap")
    first, second = f"capacity/site-{cheap}-1", f"capacity/site-{cheap}-2"
    site = await start_site(cap, "cheap")
    assert await poll(lambda: _filling(site), timeout=30) == first
    assert len((await _fill_result(cap, first)).nodes) == 2
    await site.terminate("test: stuck, an operator terminates it (its carried state is lost)")
    cap.cluster.remove_node(live(cap, "cheap")[0]["name"])  # the site is below its min again
    site = await start_site(cap, "cheap")  # as the sweep or `gpufleet site reconcile` start it again

    assert await poll(lambda: _filling(site), timeout=30) == second
    assert len((await _fill_result(cap, second)).nodes) == 1
    assert await _fill_runs(cap, "cheap") == {first: 1, second: 1}
    # Each listed by its site from its start: the next run started afresh numbers past them.
    listed = await cap.listed(f'WorkflowType = "AcquireCapacity" AND Site = "{cheap}"')
    assert sorted(w.id for w in listed) == [first, second]
    await wait_for(lambda: len(live(cap, "cheap")) == 3, timeout=10)
    await poll(lambda: _not_filling(site), timeout=10)
    await replay_and_record(site, "site_numbers_fills_past_those_on_record")


async def _not_filling(site) -> bool:
    return (await site.query("status", result_type=SiteStatus)).filling == ""


async def test_a_site_entity_started_again_mid_fill_takes_the_running_fill_as_its_own(cap: CapStack) -> None:
    """The Site entity stopped mid-fill (terminated, reset; its fill outlives it on purpose) and was
    started again. Before: the start of ``capacity/site-<site>-1`` failed (already running), the fill
    counted as failed and the next reconcile started fill 2 beside it: both bought, four machines
    for a site whose min is 2 (max 3), one then retired. Now the running fill is its fill: the site
    says so, starts no other and reconciles once it ends; two machines bought, one fill on record."""
    cheap = cap.site("cheap")
    first = f"capacity/site-{cheap}-1"
    cap.world.set_site(cheap, capacity=0)  # the fill waits for capacity
    site = await start_site(cap, "cheap")
    assert await poll(lambda: _filling(site), timeout=30) == first
    await site.terminate("test: the entity stops mid-fill")
    site = await start_site(cap, "cheap")

    assert await poll(lambda: _filling(site), timeout=30) == first
    await asyncio.sleep(2)  # it reconciles meanwhile (it just started): no other fill starts
    cap.world.set_site(cheap, capacity=4)
    await cap.refresh_catalog()
    assert len((await _fill_result(cap, first)).nodes) == 2
    await poll(lambda: _not_filling(site), timeout=10)
    await asyncio.sleep(2)  # time for anything else to buy (nothing must)
    assert cap.world.calls(cap.account("a"), "create") == 2
    assert len(live(cap, "cheap")) == 2
    assert await _fill_runs(cap, "cheap") == {first: 1}
    await replay_and_record(site, "site_takes_a_running_fill_as_its_own")


# -- a site taken out of the fleet config (``site-ends-once-removed-from-config``) ------------------
#: The Site entity of a site emptied and then taken out of the config, which ends by itself; its
#: ``_before`` twin is the same scenario on the code before, which asked after the unknown site
#: every 5 minutes for ever (recorded on it; it replays).
REMOVED = "site_removed_from_the_config_ends"
REMOVED_BEFORE = f"{REMOVED}_before"
#: ... one taken out with a node left, which runs on and says why; and a run started after its
#: site left the config (started by hand, continued as new, renewed), which ends at once.
REMOVED_WITH_A_NODE = "site_removed_from_the_config_with_a_node_runs_on"
STARTED_AFTER_REMOVAL = "site_started_after_it_left_the_config_ends"


def _without(fleet: dict, site: str) -> dict:
    return {**fleet, "sites": [s for s in fleet["sites"] if s["name"] != site]}


async def _said(site, words: str) -> bool:
    try:
        return words in (await site.query("status", result_type=SiteStatus)).last
    except Exception:  # noqa: BLE001 - its first task may not have run yet
        return False


async def _looks(site) -> int:
    """How many times the entity asked whether the config still names its site."""
    return len([e async for e in site.fetch_history_events()
                if e.HasField("activity_task_scheduled_event_attributes")
                and e.activity_task_scheduled_event_attributes.activity_type.name == "site_configured"])


async def test_a_site_emptied_and_taken_out_of_the_config_ends_its_entity(cap: CapStack) -> None:
    """docs/operations.md's "Remove a site": mid is empty (its max_nodes 0 step done), its entry is
    taken out and the control plane restarted. Before, its Site entity asked after the unknown site
    every 5 minutes for ever (an activity's failure and a timer each time, GpufleetSiteNotConfigured)
    until a person terminated it. Now it looks whether the config still names the site and what is
    left there, three times at least over ``removed_seconds``, and completes saying why. Back in the
    config, the site gets its entity again from the next SiteSweep."""
    mid, fleet = cap.site("mid"), cap.fleet()
    site = await start_site(cap, "mid", removed_seconds=1)
    await poll(lambda: _said(site, "within min/max"), timeout=30)
    await cap.restart_worker(_without(fleet, mid))

    result = await asyncio.wait_for(site.result(), timeout=90)
    assert result == f"site {mid} is no longer in the fleet config; nothing left there"
    assert await _looks(site) >= 3, "one answer is never enough"
    await replay_and_record(site, REMOVED)

    await cap.restart_worker(fleet)  # the site is back
    started = await cap.client.execute_workflow("SiteSweep", {}, id=f"site-sweep-{cap.uid}",
                                                task_queue=cap.settings.task_queue)
    assert mid in started
    again = cap.client.get_workflow_handle(f"site/{mid}")
    assert (await again.describe()).status == WorkflowExecutionStatus.RUNNING
    await poll(lambda: _said(again, "within min/max"), timeout=30)


async def test_a_site_taken_out_of_the_config_with_a_node_left_keeps_its_entity_which_says_why(
        cap: CapStack) -> None:
    """mid taken out of the config while a node is still there (against the procedure; `gpufleet
    config check --fleet` refuses such a file): its entity must not end, or nothing would look after
    that node. It runs on, however many looks, and its details say what is left and what to do."""
    mid = cap.site("mid")
    [node] = await _join(cap, "mid", "first")
    site = await start_site(cap, "mid", removed_seconds=1)
    await poll(lambda: _said(site, "within min/max"), timeout=30)
    await cap.restart_worker(_without(cap.fleet(), mid))

    await poll(lambda: _looked(site, 3), timeout=60)  # what ends an empty site's entity
    shown = await details(site)
    assert f"{mid}: not in the fleet config, but the cluster still has 1 node(s) there ({node})" in shown, shown
    assert f"the config must name {mid}, with min_nodes: 0 and max_nodes: 0, until it has none" in shown, shown
    assert "This entity runs on until then" in shown, shown
    assert (await site.describe()).status == WorkflowExecutionStatus.RUNNING
    assert cap.cluster.get_node(node) is not None
    await replay_and_record(site, REMOVED_WITH_A_NODE)


async def _looked(site, times: int) -> bool:
    return await _looks(site) >= times


async def test_a_site_entity_started_after_its_site_left_the_config_ends_too(cap: CapStack) -> None:
    """A run that starts after its site left the config (by hand, or continued as new: `gpufleet
    patches renew` moves on a run from before this change) has its first read of the config refused.
    Before, that failed the run; now it looks as a running one does and ends with the same result."""
    mid = cap.site("mid")
    await cap.restart_worker(_without(cap.fleet(), mid))
    site = await start_site(cap, "mid", removed_seconds=1)
    result = await asyncio.wait_for(site.result(), timeout=60)
    assert result == f"site {mid} is no longer in the fleet config; nothing left there"
    await replay_and_record(site, STARTED_AFTER_REMOVAL)


async def test_a_refusal_from_a_worker_whose_config_lacks_the_site_never_ends_its_entity(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """During a rolling deploy that adds a site, an old worker refuses it as unknown while the new
    ones' config names it. The entity's look finds it named: however many refusals, it runs on, and
    reconciles once the deploy is done."""
    from activities.env import FleetEnv
    from fleet.errors import InvalidRequest

    mid, known = cap.site("mid"), FleetEnv.site
    refusing = [False]

    def site(self, name: str):
        if refusing[0] and name == mid:
            raise InvalidRequest(f"site: unknown site {name!r}; known sites: (an old worker's)")
        return known(self, name)

    monkeypatch.setattr(FleetEnv, "site", site)
    handle = await start_site(cap, "mid", removed_seconds=0)
    await poll(lambda: _said(handle, "within min/max"), timeout=30)
    refusing[0] = True
    await handle.signal("reconcile")
    await poll(lambda: _looked(handle, 3), timeout=60)  # what ends an empty site's entity
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
    assert "not in the fleet config" not in await details(handle)
    refusing[0] = False  # the deploy is done
    await failed_pass_cleared(handle, timeout=60)
    await poll(lambda: _said(handle, "within min/max"), timeout=30)
