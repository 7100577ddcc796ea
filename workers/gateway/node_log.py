"""The gateway's warnings about what a node's calls did (refused, over its limits, not verifiable),
at most one line per node and reason a window, and one more saying how many it left out.

A node decides how often it calls: a line per call let one node (a retired one whose certificate
is still valid, one over its budget) write the gateway's log, and the cluster's log pipeline that
every component shares, at its full call rate. Operators still see at once that a node is
refused and why (the first of each kind), and how often (the count at the window's end); the
metrics count every call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

#: One window per (node, what, reason): its first warning is logged at once, the rest counted and
#: logged as one line when it ends (or at the next warning after it). A minute is as soon as an
#: operator watching a node needs the count, and costs the shared log pipeline at most two lines
#: a minute per node and reason, whatever the node's call rate.
NODE_LOG_SECONDS = 60.0
#: Windows open at once. Each key's node is a name the CA signed (a node cannot make up more), but
#: one node may open about 150 (the workflow service's 123 calls, the reasons an agent's calls are
#: refused for) and a fleet has thousands of nodes. Past this the oldest
#: window is closed early (its count logged): memory stays bounded, and a new key costs at most
#: one more line than it would have.
NODE_LOG_WINDOWS = 10_000


@dataclass
class _Window:
    started: float
    more: int = 0  # warnings left out since the one logged
    timer: asyncio.TimerHandle | None = None


class NodeLog:
    """Warnings about nodes, each (node, what, reason) logged at most once per ``seconds``."""

    def __init__(self, logger: logging.Logger, seconds: float = NODE_LOG_SECONDS, windows: int = NODE_LOG_WINDOWS,
                 clock=time.monotonic) -> None:
        self.logger, self.seconds, self.windows, self.clock = logger, seconds, windows, clock
        self._windows: OrderedDict[tuple[str, str, str], _Window] = OrderedDict()  # oldest first

    def warn(self, node: str, what: str, reason: str, message: str, *args: object) -> None:
        """``message % args`` now, if it opens a window for (``node``, ``what``, ``reason``);
        otherwise counted, and at the window's end logged as "node N: K more <what> (<reason>)
        in the last 60 s". ``what`` and ``reason`` are the gateway's own words (a call's name
        it knows, a reason without what the node sent): a node cannot open windows at will."""
        key = (node, what, reason)
        window = self._windows.get(key)
        if window is not None and self.clock() - window.started >= self.seconds:
            self._close(key)  # its end passed before its timer ran: its count first
            window = None
        if window is not None:
            window.more += 1
            return
        while len(self._windows) >= self.windows:
            self._close(next(iter(self._windows)))
        self.logger.warning(message, *args)
        window = self._windows[key] = _Window(self.clock())
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: closed by the next warning after its end
            return
        window.timer = loop.call_later(self.seconds, self._close, key)

    def _close(self, key: tuple[str, str, str]) -> None:
        window = self._windows.pop(key, None)
        if window is None:
            return
        if window.timer is not None:
            window.timer.cancel()
        if window.more:
            node, what, reason = key
            seconds = round(min(self.clock() - window.started, self.seconds), 1)
            self.logger.warning("node %s: %d more %s%s in the last %g s", node, window.more, what,
                                f" ({reason})" if reason else "", seconds)
