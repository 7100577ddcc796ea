"""A child process that does not outlive the process that started it (Linux).

``gpufleet dev`` starts the Temporal server, workers and an S3 emulator; the front door starts
HAProxy. Each holds a port, so one left behind by a killed parent breaks the next start.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable


def die_with(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for a child of ``parent``: SIGTERM when ``parent`` dies, however it dies
    (a ``kill -9``, a parent that kills it). A parent killed between the fork and the ``prctl``
    sends no signal (it is then set for the parent the child has by then, init), so the child
    checks that it was not orphaned meanwhile and, if it was, exits before it runs.
    None off Linux, which has no such signal."""
    if not sys.platform.startswith("linux"):
        return None

    def die_with_parent() -> None:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:
            os._exit(1)

    return die_with_parent
