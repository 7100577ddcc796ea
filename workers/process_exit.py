"""Leave a worker process once it has stopped, without interpreter finalization.

The Temporal SDK's native runtime keeps threads of its own after ``asyncio.run`` returns. When
the interpreter then finalizes under them, one of them can release the GIL from a thread state
that is gone, and the process aborts (``Fatal Python error: PyGILState_Release``, exit -6),
seen after a clean SIGTERM stop. A kubelet reads that as a crash. By then the worker has
drained and every log line is written, so the process flushes and exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Awaitable, Callable


def run_then_exit(main: Callable[[], Awaitable[None]]) -> None:
    """``asyncio.run(main())``, then exit 0 without finalizing (an exception still propagates)."""
    asyncio.run(main())
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
