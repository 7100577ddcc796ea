"""What each node's machine reported as its addresses, kept a while across approver passes.

A CSR pass asks the provider for the addresses of each node with a serving request open, and
passes run about once a second for each join and reboot wait in flight, besides ``CsrApprover``'s
own. A node's requests are its own to post: one fresh request with wrong addresses before each
pass, or one left open while the provider answers nothing (its account already rate limited),
cost its provider account a call a pass, enough past Hetzner's 3,600 an hour to trip the site's
provider-API incident, which evacuates the site. Kept here, a node costs its provider at most one
call per ``KEPT_SECONDS`` while its machine answers and one per ``NONE_KEPT_SECONDS`` while it
does not, whatever it posts and however many passes run in this process.

One memo per worker process (``FleetEnv`` is built once per process), so across the fleet a node
costs at most that times the number of control-plane worker processes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable

#: How long a machine's reported addresses answer its node's serving requests: a machine keeps
#: its addresses, and one replaced is another machine id, looked up afresh.
KEPT_SECONDS = 60.0
#: How long no answer does (the provider failed, or the machine reports no addresses yet: one just
#: bought): short, as a new machine's first serving certificate waits at most this once they show.
NONE_KEPT_SECONDS = 10.0
#: Machines kept at most, the one asked about longest ago forgotten first (the keys come from identity
#: records and joins, never from what a node writes; the bound is for a fleet's churn).
MOST_KEPT = 4096

#: (node, site, machine id): a node's machine replaced under the same name is looked up afresh.
Key = tuple[str, str, str]


class AddressMemo:
    """``addresses(key, ask)``: what ``ask()`` (the provider call) answered for the key, kept a while;
    passes asking for the same key meanwhile wait for the one call in flight, not make their own."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._kept: OrderedDict[Key, tuple[float, tuple[str, ...]]] = OrderedDict()  # key → (until, addresses)
        self._asking: dict[Key, Future] = {}

    def addresses(self, key: Key, ask: Callable[[], list[str] | None], fresh: bool = False) -> list[str] | None:
        """``ask()``'s answer for ``key`` (None: no addresses), from the memo unless it has expired or
        ``fresh`` (a check that must see the provider's answer now; it is kept for the passes after)."""
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None and not fresh and self._clock() < kept[0]:
                return list(kept[1]) or None
            asking = self._asking.get(key)
            if asking is None:
                self._asking[key] = mine = Future()
        if asking is not None:
            return _copied(asking.result())  # a slow or failing provider is asked once, not by every pass waiting
        try:
            found = list(ask() or []) or None
        except BaseException as error:
            with self._lock:
                del self._asking[key]
            mine.set_exception(error)
            raise
        with self._lock:
            del self._asking[key]
            self._kept[key] = (self._clock() + (KEPT_SECONDS if found else NONE_KEPT_SECONDS), tuple(found or ()))
            self._kept.move_to_end(key)
            while len(self._kept) > MOST_KEPT:
                self._kept.popitem(last=False)
        mine.set_result(found)
        return _copied(found)


def _copied(found: list[str] | None) -> list[str] | None:
    """A list of its own for each pass handed the answer."""
    return list(found) if found else None
