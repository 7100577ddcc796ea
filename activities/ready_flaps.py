"""Which nodes flip their Ready condition again and again, kept across a worker process's site watches.

A node's Ready condition is its kubelet's word about itself, and NodeRestriction lets a kubelet
write its own Node's status as often as it likes. A Site entity's watch (``watch_site``) returns the
moment a node of the site turns Ready or NotReady, and each return is a workflow task of the Site
entity (every node of the site shares it, on the control plane's queue every site shares), a new
watch activity, a signal to the node's entity and some ten history events: a node flipping its
condition woke its site's entity once per flip, as fast as the watch came back.

So a node that changed its Ready more than ``FREE_CHANGES`` times within ``WINDOW_SECONDS`` is taken
as NotReady (what it says half the time, and what an honest node that flaps so is) until it has
stayed Ready for ``HOLD_SECONDS`` in a row: its flips wake no watch meanwhile, and it costs its site
at most two wakes a hold (Ready again once the hold is over, NotReady at its next flip). Another
node's change wakes the watch at once, as before. An honest node's reboots (NotReady, then Ready:
two changes) are each seen as they happen, three in a window.

One record per worker process (``FleetEnv`` is built once per process), each watch adding what it
sees: a site's watch retried on another process starts from that one's. The keys are the names
of the nodes the watch lists (the control plane's site label, which no kubelet may write); the
bound is for a fleet's churn.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

#: Changes of a node's Ready (either way) seen within ``WINDOW_SECONDS`` before it counts as flapping:
#: three reboots (a repair's reboot, its driver reinstall's, one more).
FREE_CHANGES = 6
WINDOW_SECONDS = 600.0
#: A flapping node counts as Ready again once it has stayed Ready this long.
HOLD_SECONDS = 60.0
#: Nodes kept at most, the one seen longest ago forgotten first.
MOST_KEPT = 20_000


@dataclass
class _Node:
    ready: bool
    since: float  # when ``ready`` last changed (or was first seen)
    changes: deque = field(default_factory=lambda: deque(maxlen=FREE_CHANGES + 1))  # when, the newest last
    flapping: bool = False


class ReadyFlaps:
    """``seen(node, ready)``: the node's Ready as a site's watch takes it (False while it flaps)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: OrderedDict[str, _Node] = OrderedDict()

    def seen(self, name: str, ready: bool) -> bool:
        """What the watch is to take of ``name``'s Ready condition, which says ``ready`` now."""
        return self.look(name, ready)[0]

    def look(self, name: str, ready: bool) -> tuple[bool, bool]:
        """(``seen``'s answer, whether the node started flapping at this look)."""
        now = self._clock()
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                node = self._nodes[name] = _Node(ready, now)
            started = False
            if node.ready != ready:
                node.ready, node.since = ready, now
                node.changes.append(now)
                if len(node.changes) > FREE_CHANGES and now - node.changes[0] < WINDOW_SECONDS:
                    started, node.flapping = not node.flapping, True
            elif node.flapping and ready and now - node.since >= HOLD_SECONDS:
                node.flapping = False  # Ready for the hold: its next change is judged afresh
            self._nodes.move_to_end(name)
            while len(self._nodes) > MOST_KEPT:
                self._nodes.popitem(last=False)
            return ready and not node.flapping, started
