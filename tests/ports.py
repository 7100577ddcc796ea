"""Ports for the servers a test starts.

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the same range
every outgoing connection takes its local port from: on a busy machine, a client connecting
somewhere can take it in the moment between "free" and the server's own bind (a server
that then exits at start-up). Ports below that range are never taken by a connection.
"""

from __future__ import annotations

import os
import random
import socket

#: Below Linux's default ephemeral range (32768-60999), with room for the offsets `gpufleet dev`
#: adds to its --port (HTTP API +10, node gateway +67).
LOW, HIGH = 20000, 32600


def worker_port_range() -> tuple[int, int]:
    """This pytest-xdist worker's own slice of ``LOW``-``HIGH``. "Free" is true only until the
    server binds: a neighbouring worker's Temporal server binds its services' ports (+1 to +8)
    seconds after its --port was chosen, and one of them was once the UI port a test here had
    just found free (the server then exits at start-up). Disjoint slices cannot meet."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    if count <= 1 or index >= count:
        return LOW, HIGH
    width = (HIGH - LOW) // count
    return LOW + index * width, LOW + (index + 1) * width
#: The ports `gpufleet dev` takes from its --port when not given one each (cli/main.py ``dev``): the
#: server's own and its services' (+1 to +8), HTTP API, S3 emulator, node gateway, UI. It refuses
#: to start when one is taken (the front door and metrics ports are moved instead).
DEV_OFFSETS = (0, *range(1, 9), 10, 11, 67, 1000)


#: The ports this process handed out: a test asks for several before its server binds any (`gpufleet
#: dev`'s --ui-port, --http-port, ...), and a second ask must not get the first one's port again
#: (it is still free: "port 27083 is also --front-door-port's").
_HANDED: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1, outside the ephemeral range, that nothing holds right now and
    this process has not handed out before."""
    low, high = worker_port_range()
    for _ in range(200):
        port = random.randint(low, high - 1)
        if port not in _HANDED and _free(port):
            _HANDED.add(port)
            return port
    raise OSError(f"no free port in {low}-{high}")


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
    low, high = worker_port_range()
    for _ in range(200):
        port = random.randint(low, high - 1 - max(DEV_OFFSETS))
        block = {port + offset for offset in DEV_OFFSETS}
        if not block & _HANDED and all(_free(p) for p in block):
            _HANDED.update(block)
            return port
    raise OSError(f"no free block of dev ports in {low}-{high}")
