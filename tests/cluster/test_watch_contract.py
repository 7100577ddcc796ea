"""The cluster port's watches (issue 37): the simulated cluster (here) and the Kubernetes adapter
against the real control plane (the same tests, collected again by tests/realk8s/test_contract.py:
list, then watch from its resourceVersion) return as soon as the caller's condition holds, and
not before; unchanged after their timeout. The adapter's ``410 Gone`` handling and its
pending-GPU-pod watch are tests/realk8s/test_watch.py and tests/realk8s/test_adapter.py."""

from __future__ import annotations

import threading
import time

import pytest

from fleet.cluster import LABEL_SITE


def _later(seconds: float, act) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), act()), daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(120)  # a guard against a hang: the watch's own timeout is 600 s
def test_a_node_watch_returns_on_the_change_it_waits_for_and_only_then(harness):
    harness.add_node("gpu-1", site="site-a")
    harness.add_node("gpu-2", site="site-a")
    harness.add_node("other", site="site-b")
    asked: list[list[str]] = []
    held: list[bool] = []

    def one_not_ready(nodes) -> bool:
        asked.append([n.name for n in nodes])
        held.append(any(not n.ready for n in nodes))
        return held[-1]

    changer = _later(0.6, lambda: harness.set_ready("gpu-2", False))
    nodes = harness.cluster.watch_nodes({LABEL_SITE: "site-a"}, one_not_ready, timeout_s=600, recheck_s=5,
                                        poll_s=0.05)
    changer.join()
    assert {n.name: n.ready for n in nodes} == {"gpu-1": True, "gpu-2": False}, "only the selector's nodes, changed"
    assert asked[0] == ["gpu-1", "gpu-2"], "the first look is the list"
    assert held.index(True) == len(held) - 1, f"returned at the first look the change held, not later: {held}"


@pytest.mark.timeout(120)  # a guard against a hang
def test_a_node_watch_with_nothing_to_wait_for_returns_unchanged_after_its_timeout_and_heartbeats(harness):
    harness.add_node("gpu-1", site="site-a")
    beats: list[float] = []
    looks: list[int] = []

    def never(nodes) -> bool:
        looks.append(len(nodes))
        return False

    nodes = harness.cluster.watch_nodes({LABEL_SITE: "site-a"}, never, timeout_s=2.5, recheck_s=0.5,
                                        heartbeat=lambda: beats.append(time.monotonic()), poll_s=0.05)
    assert [n.name for n in nodes] == ["gpu-1"]
    # It waited through its rechecks (one heartbeat each: four in 2.5 s, or 1 s chunks against a
    # real API server), not returning unchanged at once; and beat at each recheck, not each look.
    assert 2 <= len(beats) <= 6, f"{len(beats)} heartbeats, {len(looks)} looks"


def test_a_node_watch_sees_a_node_added_and_a_node_removed(harness):
    harness.add_node("gpu-1", site="site-a")
    changer = _later(0.4, lambda: harness.add_node("gpu-2", site="site-a"))
    nodes = harness.cluster.watch_nodes({LABEL_SITE: "site-a"}, lambda nodes: len(nodes) == 2, timeout_s=20,
                                        recheck_s=5, poll_s=0.05)
    changer.join()
    assert [n.name for n in nodes] == ["gpu-1", "gpu-2"]
    changer = _later(0.4, lambda: harness.cluster.remove_node("gpu-1"))
    nodes = harness.cluster.watch_nodes({LABEL_SITE: "site-a"}, lambda nodes: len(nodes) == 1, timeout_s=20,
                                        recheck_s=5, poll_s=0.05)
    changer.join()
    assert [n.name for n in nodes] == ["gpu-2"]
