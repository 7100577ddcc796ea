"""Garbage collection for the long-running worker processes.

At 1,250 nodes the control-plane worker holds millions of objects (every cached Node
entity's sandboxed module copies and state) and the simulated nodes' host a thousand SDK
workers. CPython's full collection walks every one of them: with its default thresholds
one ran every 10–15 s under the steady mix and stopped the worker for 0.5–1 s, which was
the tail of a fault's path to containment (``bench.scale``). A collection that still stops
a process for longer than ``SLOW_COLLECTION_SECONDS`` is logged, so such a pause can be
told from a slow Temporal or a busy machine.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque

log = logging.getLogger("gpufleet.gc")

#: Allocations between young collections (CPython's default is 700). An object that lives
#: through one workflow task then dies young, instead of being promoted and counted towards
#: the next full collection.
YOUNG_THRESHOLD = 50_000
#: Young collections between collections of the middle generation (CPython's default is 10).
#: Everything that outlived a young collection waits there: at 20, a fleet's worth of new Node
#: entities (a join wave) was walked in one 0.7 s stop; at 5 the same work comes in quarters.
MIDDLE_THRESHOLD = 5
#: A collection this long is a visible stall (a workflow task, a watch result, a cordon waits).
SLOW_COLLECTION_SECONDS = 0.05


class CollectionTimer:
    """``gc.callbacks`` hook: how long each collection stopped the process; the slow ones logged."""

    def __init__(self, slow_seconds: float = SLOW_COLLECTION_SECONDS) -> None:
        self.slow_seconds = slow_seconds
        #: (wall clock, seconds, generation) of the slow ones, the latest hundred.
        self.slow: deque[tuple[float, float, int]] = deque(maxlen=100)
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        if took >= self.slow_seconds:
            self.slow.append((time.time(), took, info["generation"]))
            log.warning("gc: generation %d collection stopped this process for %.0f ms (%d collected)",
                        info["generation"], took * 1000, info["collected"])


def settle_garbage_collection() -> CollectionTimer:
    """Call once start-up's imports are done. What exists then (modules, classes, the SDK)
    lives as long as the process: frozen, no full collection walks it again."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, 10)
    timer = next((c for c in gc.callbacks if isinstance(c, CollectionTimer)), None)
    if timer is None:
        timer = CollectionTimer()
        gc.callbacks.append(timer)
    return timer
