"""The event watches (activities/watches.py, issue 37) against the simulated fleet: each returns
when what its entity acts on changes and waits otherwise, at no Temporal cost while it waits
(no heartbeat before half its timeout); each is level-triggered (what the caller saw last).
The Kubernetes adapter's watches are proven in tests/cluster/test_watch_contract.py and against
the real API server in tests/realk8s/test_watch.py."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from temporalio.exceptions import CancelledError
from temporalio.testing import ActivityEnvironment

from activities.env import FleetEnv
from activities.watches import WatchActivities
from bench.common import fleet
from fleet.cluster import LABEL_SITE
from fleet.demand import DEMAND_TAINT_KEY, LABEL_FLEET, GpuPod, Toleration
from fleet.messages.watches import CsrWatchInput, DemandWatchInput, SiteWatchInput, node_summary
from fleet.settings import Settings


@pytest.fixture
def env(tmp_path: Path) -> FleetEnv:
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(fleet(sites=2, capacity=8)))
    return FleetEnv.from_settings(Settings(state_dir=tmp_path, config=str(path)))


def add_node(env: FleetEnv, name: str, site: str = "site-0", ready: bool = True) -> None:
    with env.world.tx() as db:
        db.execute("INSERT INTO nodes(name, machine_id, labels, taints, unschedulable, ready, boot_id, gpus,"
                   " registered_at) VALUES (?,?,'{}','[]',0,?,'b',8,0)", (name, f"m-{name}", int(ready)))
    env.cluster.label_node(name, {LABEL_SITE: site})


def wanting(name: str) -> GpuPod:
    """An opted-in pod (the fleet's selector and toleration) nothing here can take (B200)."""
    return GpuPod(namespace="ml", name=name, gpus=8, node_selector={LABEL_FLEET: "true", "gpufleet.io/gpu": "B200"},
                  tolerations=[Toleration(key=DEMAND_TAINT_KEY, operator="Exists")])


def later(seconds: float, act) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), act()), daemon=True)
    thread.start()
    return thread


def site_input(known: dict[str, str], **extra) -> SiteWatchInput:
    return SiteWatchInput(site="site-0", known=known, api_ok=True, max_wait_seconds=extra.pop("wait", 30),
                          poll_seconds=0.05, **extra)


async def run(activity_env: ActivityEnvironment, fn, arg):
    """A sync watch (it blocks for its wait) in a thread, an async one on the loop."""
    if asyncio.iscoroutinefunction(fn):
        return await activity_env.run(fn, arg)
    return await asyncio.to_thread(activity_env.run, fn, arg)


#: A watch that should return on a change is given ten minutes to wait, and this long to return:
#: a guard against a hang only (the change comes within a second).
HANG_GUARD_SECONDS = 120


async def woken(activity_env: ActivityEnvironment, fn, arg):
    """``run``, for a watch a change must end long before its ten-minute wait."""
    return await asyncio.wait_for(run(activity_env, fn, arg), HANG_GUARD_SECONDS)


def quiet_env(heartbeat_seconds: float = 600, client=None) -> ActivityEnvironment:
    activity_env = ActivityEnvironment(client)
    activity_env.info = dataclasses.replace(activity_env.info, heartbeat_timeout=timedelta(seconds=heartbeat_seconds))
    return activity_env


async def test_the_site_watch_returns_at_once_when_the_entity_knows_less_and_then_on_notready(env) -> None:
    watches = WatchActivities(env)
    add_node(env, "gpu-1")
    add_node(env, "gpu-2")
    add_node(env, "elsewhere", site="site-1")
    # Nothing known (a new run): the nodes now, at once.
    first = await run(quiet_env(), watches.watch_site, SiteWatchInput(site="site-0", poll_seconds=0.05))
    assert first.changed and [n.name for n in first.nodes] == ["gpu-1", "gpu-2"]
    known = {n.name: node_summary(n) for n in first.nodes}
    # Knowing it all: the watch waits, until a node turns NotReady.
    beats: list = []
    activity_env = quiet_env()
    activity_env.on_heartbeat = beats.append
    changer = later(0.8, lambda: env.cluster.set_node_status("gpu-2", ready=False))
    seen = await woken(activity_env, watches.watch_site, site_input(known, wait=600))
    changer.join()
    assert seen.changed and {n.name: n.ready for n in seen.nodes} == {"gpu-1": True, "gpu-2": False}
    assert beats == [], "a watch a change ends early costs no heartbeat"


async def test_a_quiet_site_watch_returns_unchanged_after_its_wait(env) -> None:
    add_node(env, "gpu-1")
    first = await run(quiet_env(), WatchActivities(env).watch_site, SiteWatchInput(site="site-0", poll_seconds=0.05))
    known = {n.name: node_summary(n) for n in first.nodes}
    env.cluster.cordon("gpu-1")  # a cordon is a change too ...
    cordoned = await run(quiet_env(), WatchActivities(env).watch_site, site_input(known, wait=5))
    assert cordoned.changed and node_summary(cordoned.nodes[0]) == "ready,cordoned"
    known = {n.name: node_summary(n) for n in cordoned.nodes}
    # A heartbeat timeout of 1 s: the watch beats at each half of it while it waits (four in its
    # 2.5 s), so its beats show it waited rather than returned unchanged at once.
    beats: list = []
    activity_env = quiet_env(heartbeat_seconds=1)
    activity_env.on_heartbeat = beats.append
    quiet = await run(activity_env, WatchActivities(env).watch_site, site_input(known, wait=2.5))
    assert not quiet.changed and 2 <= len(beats) <= 5, beats


async def test_a_retried_site_watch_says_how_long_nobody_watched(env) -> None:
    """The attempt before was lost (its worker died): its last heartbeat says since when nobody
    watched, and the watch returns at once so the entity knows its control plane was away."""
    add_node(env, "gpu-1")
    first = await run(quiet_env(), WatchActivities(env).watch_site, SiteWatchInput(site="site-0", poll_seconds=0.05))
    known = {n.name: node_summary(n) for n in first.nodes}
    retried = quiet_env()
    last_beat = time.time() - 120
    retried.info = dataclasses.replace(retried.info, attempt=2, heartbeat_details=[last_beat])
    # Returned at once (its wait is ten minutes), saying how long since that attempt's last beat
    # (to the millisecond it rounds to).
    seen = await woken(retried, WatchActivities(env).watch_site, site_input(known, absence_seconds=30, wait=600))
    assert 120 <= seen.paused_seconds <= time.time() - last_beat + 0.001, seen.paused_seconds


async def test_the_demand_watch_wakes_on_a_new_opted_in_pod_and_on_a_node_going_idle(env) -> None:
    watches = WatchActivities(env)
    add_node(env, "gpu-1")
    env.cluster.create_pod(GpuPod(namespace="ml", name="running", gpus=8, node="gpu-1", phase="Running"))
    first = await run(quiet_env(), watches.watch_demand_events, DemandWatchInput(wait_seconds=0, poll_seconds=0.05))
    assert first.why == "timeout" and first.busy == ["gpu-1"]
    # A pod that opts in: the batch closes 0.3 s after it (nothing else came).
    changer = later(0.5, lambda: env.cluster.create_pod(wanting("want")))
    wake = await run(quiet_env(), watches.watch_demand_events, DemandWatchInput(
        busy=first.busy, wait_seconds=30, batch_idle_seconds=0.3, batch_max_seconds=5, poll_seconds=0.05))
    changer.join()
    assert wake.why == "pods" and wake.batch.new == ["ml/want"]
    # Known now: the running pod ends, its node goes idle.
    changer = later(0.5, lambda: env.cluster.delete_pod("ml", "running"))
    wake = await run(quiet_env(), watches.watch_demand_events, DemandWatchInput(
        known=["ml/want"], busy=first.busy, wait_seconds=30, poll_seconds=0.05))
    changer.join()
    assert wake.why == "idle" and wake.busy == []


async def test_the_demand_watch_wakes_when_a_purchases_pods_are_gone(env) -> None:
    env.cluster.create_pod(wanting("bought-for"))
    changer = later(0.5, lambda: env.cluster.delete_pod("ml", "bought-for"))
    wake = await run(quiet_env(), WatchActivities(env).watch_demand_events, DemandWatchInput(
        known=["ml/bought-for"], tracked=["ml/bought-for"], wait_seconds=30, poll_seconds=0.05))
    changer.join()
    assert wake.why == "pods gone" and "ml/bought-for" not in wake.batch.present


async def test_the_demand_watch_returns_as_a_purchase_ends(env, temporal_env) -> None:
    """A purchase in flight ends (here terminated; joined or failed alike): the watch returns
    because it closed, its pod still there, with the fleet's labels on the node it joined. Before, the watch learned it from a describe
    of each purchase every ``purchase_check_seconds`` (5 s by default), and the pod bought for
    waited that long for the loop to label its new node; here that pause is longer than the
    watch's whole wait, so only the purchase's close can end it."""
    client = temporal_env.client
    uid = uuid.uuid4().hex[:6]
    # No worker serves their queue: each runs until it is terminated.
    ending, buying = [await client.start_workflow("AcquireCapacity", {}, id=f"capacity/demand-watch-{uid}-{n}",
                                                  task_queue=f"nobody-{uid}") for n in (1, 2)]
    env.cluster.create_pod(wanting("bought-for"))
    activity_env = quiet_env(client=client)

    async def end_it() -> None:
        await asyncio.sleep(0.5)
        add_node(env, "bought")  # the node its join admitted: only the join's site label so far
        await ending.terminate("the purchase ends")
    ender = asyncio.ensure_future(end_it())
    try:
        wake = await run(activity_env, WatchActivities(env).watch_demand_events, DemandWatchInput(
            known=["ml/bought-for"], tracked=["ml/bought-for"], purchases=[buying.id, ending.id],
            wait_seconds=10, purchase_check_seconds=600, poll_seconds=0.05))
        await ender
        assert wake.why == "purchase ended"
        assert wake.batch.present == ["ml/bought-for"] and wake.batch.new == []
        # The fleet's labels, which the pod's selector needs, are on its node as the watch returns.
        assert env.cluster.get_node("bought").labels.get(LABEL_FLEET) == "true"
    finally:
        await buying.terminate("test over")


async def test_a_cancelled_watch_stops_its_thread(env) -> None:
    """A watch waits for minutes in a thread: cancelled (its entity continued as new) or its worker
    stopping, it ends at its next look rather than holding the worker's shutdown."""
    add_node(env, "gpu-1")
    first = await run(quiet_env(), WatchActivities(env).watch_site, SiteWatchInput(site="site-0", poll_seconds=0.05))
    known = {n.name: node_summary(n) for n in first.nodes}
    activity_env = quiet_env()
    running = asyncio.ensure_future(run(activity_env, WatchActivities(env).watch_site, site_input(known, wait=600)))
    await asyncio.sleep(0.5)
    activity_env.cancel()
    # It ends as cancelled (not at its ten-minute wait: the guard would raise TimeoutError).
    with pytest.raises(CancelledError):
        await asyncio.wait_for(running, HANG_GUARD_SECONDS)


async def test_the_csr_watch_in_the_sim_waits_its_whole_wait(env) -> None:
    """The sim has no CSRs: the watch returns unchanged after its wait, having found nothing. It
    waited: with a heartbeat timeout of 1 s it beats at each half of it (four in its 2.5 s)."""
    beats: list = []
    activity_env = quiet_env(heartbeat_seconds=1)
    activity_env.on_heartbeat = beats.append
    seen = await run(activity_env, WatchActivities(env).watch_csrs, CsrWatchInput(max_wait_seconds=2.5))
    assert not seen.changed and seen.pending == [] and 2 <= len(beats) <= 5, beats


async def test_the_site_watch_puts_placement_labels_back_and_reports_a_node_that_changed_its_own(env) -> None:
    """Zone, region and GPU product come from the site's config: put back at every look. A node's
    own change ends the watch at once, reported once; a run that enforces other values (a config
    changed since it read it) or none gets them put back without judging the node."""
    from fleet.cluster import LABEL_ZONE
    from fleet.demand import public_placement_labels

    watches = WatchActivities(env)
    wanted = public_placement_labels(env.site("site-0"))
    for name in ("gpu-1", "gpu-2"):
        add_node(env, name)
        env.cluster.label_node(name, wanted)
    known = {"gpu-1": "ready", "gpu-2": "ready"}

    def placement(name: str) -> dict[str, str]:
        return {k: env.cluster.get_node(name).labels.get(k) for k in wanted}

    # Another config's values (or none): put back, nobody reported, the watch waits on.
    env.cluster.label_node("gpu-1", {LABEL_ZONE: "elsewhere"})
    stale = {**wanted, LABEL_ZONE: "old-name"}
    quiet = await run(quiet_env(), watches.watch_site, site_input(known, placement=stale, wait=0.5))
    assert not quiet.changed and quiet.self_labelled == {} and placement("gpu-1") == wanted

    # The values the run enforces: the node's own change returns the watch, named and put back.
    changer = later(0.3, lambda: env.cluster.label_node("gpu-2", {LABEL_ZONE: "elsewhere"}))
    seen = await woken(quiet_env(), watches.watch_site, site_input(known, placement=wanted, wait=600))
    changer.join()
    assert seen.changed and seen.self_labelled == {"gpu-2": [f"{LABEL_ZONE}=elsewhere"]}
    assert placement("gpu-2") == wanted

    # Reported already: put back again, not reported twice.
    env.cluster.label_node("gpu-2", {LABEL_ZONE: "elsewhere"})
    again = await run(quiet_env(), watches.watch_site, site_input(known, placement=wanted, reported=["gpu-2"],
                                                                  wait=0.5))
    assert again.self_labelled == {} and placement("gpu-2") == wanted
