"""Garbage collection for the long-running worker processes.

At 1,250 nodes the control-plane worker holds millions of objects (every cached Node
entity's sandboxed module copies and state) and the simulated nodes' host a thousand SDK
workers. CPython's full collection walks every one of them: with its default thresholds
one ran every 10–15 s under the steady mix and stopped the worker for 0.5–1 s, which was
the tail of a fault's path to containment (``bench.scale``).
"""

from __future__ import annotations

import gc

#: Allocations between young collections (CPython's default is 700). An object that lives
#: through one workflow task then dies young, instead of being promoted and counted towards
#: the next full collection.
YOUNG_THRESHOLD = 50_000


def settle_garbage_collection() -> None:
    """Call once start-up's imports are done. What exists then (modules, classes, the SDK)
    lives as long as the process: frozen, no full collection walks it again."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 20, 10)
