"""Ports for the servers a test starts.

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the same range
every outgoing connection takes its local port from: on a busy machine, a client connecting
somewhere can take it in the moment between "free" and the server's own bind (a server
that then exits at start-up). Ports below that range are never taken by a connection.
"""

from __future__ import annotations

import random
import socket

#: Below Linux's default ephemeral range (32768-60999), with room for the offsets `gpufleet dev`
#: adds to its --port (HTTP API +10, node gateway +67).
LOW, HIGH = 20000, 32600
#: The ports `gpufleet dev` takes from its --port when not given one each (cli/main.py ``dev``): the
#: server's own and its services' (+1 to +8), HTTP API, S3 emulator, node gateway, UI. It refuses
#: to start when one is taken (the front door and metrics ports are moved instead).
DEV_OFFSETS = (0, *range(1, 9), 10, 11, 67, 1000)


def free_port() -> int:
    """A TCP port on 127.0.0.1, outside the ephemeral range, that nothing holds right now."""
    for _ in range(200):
        port = random.randint(LOW, HIGH)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {LOW}-{HIGH}")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_dev_port() -> int:
    """A --port for `gpufleet dev` whose every derived port (``DEV_OFFSETS``) is free right now:
    with ``free_port()`` alone, a derived one held by a neighbouring test made the stack refuse."""
    for _ in range(200):
        port = random.randint(LOW, HIGH - 1000)
        if all(_free(port + offset) for offset in DEV_OFFSETS):
            return port
    raise OSError(f"no free block of dev ports in {LOW}-{HIGH}")
