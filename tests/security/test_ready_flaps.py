"""A node that flips its own Ready condition again and again (its kubelet may write its Node's
status, as often as it likes: NodeRestriction allows it), against its Site entity's watch.

``watch_site`` returns the moment a node of the site turns Ready or NotReady, and every return is
a workflow task of the Site entity (which every node of the site shares, on the control plane's
queue every site shares), a new watch activity, a signal to the node's entity and some ten history
events. A node flipping its condition woke it once per flip, as fast as the watch came back. Now
a node that changed its Ready more than ``FREE_CHANGES`` times within ``WINDOW_SECONDS`` is taken as
NotReady until it has stayed Ready ``HOLD_SECONDS`` (``activities/ready_flaps.py``): its flips wake
no watch meanwhile, while another node's change still wakes it at once.

The simulated cluster has one writer for every caller: the node's write here is the test's
``set_node_status``, which is what a kubelet's PATCH of its own Node's status is to the API server.
The watch runs as its worker runs it (``WatchActivities`` over the simulated fleet), the Site
entity's part played by the loop: each result's nodes are what the next watch is told it knows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from activities.env import FleetEnv
from activities.ready_flaps import FREE_CHANGES, HOLD_SECONDS, ReadyFlaps
from activities.watches import WatchActivities
from bench.common import fleet
from fleet.settings import Settings
from fleet.messages.watches import node_summary
from tests.test_watches import add_node, quiet_env, run, site_input, woken

FLIPS = 40


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env(tmp_path: Path) -> FleetEnv:
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(fleet(sites=2, capacity=8)))
    return FleetEnv.from_settings(Settings(state_dir=tmp_path, config=str(path)))


async def test_a_node_flipping_its_ready_condition_wakes_its_sites_watch_a_few_times(env: FleetEnv) -> None:
    clock = Clock()
    env.ready_flaps = ReadyFlaps(clock=clock)
    watches = WatchActivities(env)
    add_node(env, "hostile")
    add_node(env, "honest")
    first = await run(quiet_env(), watches.watch_site, site_input({}))
    known = {n.name: node_summary(n) for n in first.nodes}
    assert known == {"hostile": "ready", "honest": "ready"}

    # The node flips its condition before each watch, a second apart: each flip is a change the
    # watch, told what the entity last saw, finds at once.
    woke = 0
    for flip in range(FLIPS):
        clock.now += 1
        env.cluster.set_node_status("hostile", ready=flip % 2 == 1)
        seen = await run(quiet_env(), watches.watch_site, site_input(known, wait=0.05))
        woke += seen.changed
        known = {n.name: node_summary(n) for n in seen.nodes}
    # Its first changes are free (a reboot or two: NotReady, then Ready), the rest woke nothing.
    assert woke <= FREE_CHANGES + 1, f"{woke} of {FLIPS} flips woke the site's watch"
    # It ended Ready, as it said last, yet counts as NotReady while it flaps.
    assert env.cluster.get_node("hostile").ready and known["hostile"] == "not-ready"

    # Another node's change wakes the watch at once, as before (it waits ten minutes otherwise).
    env.cluster.set_node_status("honest", ready=False)
    seen = await woken(quiet_env(), watches.watch_site, site_input(known, wait=600))
    assert seen.changed and {n.name: node_summary(n) for n in seen.nodes} == {"hostile": "not-ready",
                                                                              "honest": "not-ready"}
    known = {n.name: node_summary(n) for n in seen.nodes}

    # Ready for the hold, it counts as Ready again: one more wake.
    clock.now += HOLD_SECONDS
    seen = await woken(quiet_env(), watches.watch_site, site_input(known, wait=600))
    assert seen.changed and node_summary(next(n for n in seen.nodes if n.name == "hostile")) == "ready"


def test_an_honest_nodes_reboots_are_each_seen() -> None:
    """A reboot is two changes (NotReady, then Ready): a node rebooted three times in a row (a
    repair's reboot and driver reinstall, and one more) is seen doing each, as it does it."""
    clock = Clock()
    flaps = ReadyFlaps(clock=clock)
    assert flaps.seen("gpu-1", True)
    said = []
    for ready in [False, True] * (FREE_CHANGES // 2):
        clock.now += 30
        said.append(flaps.seen("gpu-1", ready))
    assert said == [False, True] * (FREE_CHANGES // 2)
