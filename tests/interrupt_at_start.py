"""``python -m tests.interrupt_at_start METHOD ARGS...``: `gpufleet ARGS...`, with a Ctrl-C (a
real SIGINT) landing just as the client's start call METHOD returns: the server has started the
request, the command has not yet heard so. An operator's Ctrl-C can land there; what the command
started must still be stopped. The only change to the command is the moment of the signal."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from client.fleet import FleetClient


def interrupt_after(method: str) -> None:
    started = getattr(FleetClient, method)

    async def started_then_interrupted(self, *args, **kwargs):
        handle = await started(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(60)  # the interrupt is taken here, before the handle is returned
        return handle

    setattr(FleetClient, method, started_then_interrupted)


if __name__ == "__main__":
    interrupt_after(sys.argv[1])
    sys.argv = ["gpufleet", *sys.argv[2:]]
    from cli.main import main

    main()
