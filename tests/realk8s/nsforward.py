"""Byte pipes between a network namespace and the host, through Unix sockets.

A pod of the real tier (``tests/realk8s/pod.py``) runs in a network namespace of its own, where
the addresses its manifest names exist (the ``kubernetes`` Service's ClusterIP, the Temporal
frontend's name, its own ``containerPort``).  Unix sockets on a path are not namespaced, so:

* ``--listen ADDR=SOCK``: inside the namespace, a TCP listener on ADDR whose connections go to SOCK
  (on the host side a ``UnixRelay`` leads SOCK on to the real server);
* ``--serve SOCK=ADDR``: inside the namespace, SOCK's connections go to the pod's own ADDR (on
  the host side a ``TcpToUnix`` listener leads a loopback port to SOCK).

Run as ``python -m tests.realk8s.nsforward ...`` inside the namespace; it runs until killed.
"""

from __future__ import annotations

import argparse
import socket
import threading
from pathlib import Path

from tests.realk8s.relay import UnixRelay, no_delay


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class TcpToUnix:
    """A TCP listener on ``listen`` whose every connection is piped to the Unix socket ``path``."""

    def __init__(self, listen: tuple[str, int], path: Path) -> None:
        self.path = path
        self._listener = socket.create_server(listen, backlog=64)
        self.address = self._listener.getsockname()[:2]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"tcp→{path.name}").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                inbound, _ = self._listener.accept()
            except OSError:
                return
            no_delay(inbound)
            outbound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                outbound.connect(str(self.path))
            except OSError:
                inbound.close()
                outbound.close()
                continue
            for source, sink in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=UnixRelay._pipe, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", action="append", default=[], help="ADDR=SOCK: TCP here to a Unix socket")
    parser.add_argument("--serve", action="append", default=[], help="SOCK=ADDR: a Unix socket to TCP here")
    args = parser.parse_args(argv)
    relays: list[object] = []
    for spec in args.listen:
        address, _, path = spec.partition("=")
        relays.append(TcpToUnix(_split(address), Path(path)))
    for spec in args.serve:
        path, _, address = spec.partition("=")
        relays.append(UnixRelay(Path(path), _split(address)))
    print("forwarding", flush=True)
    threading.Event().wait()  # until SIGTERM (its default action ends the process)


if __name__ == "__main__":
    main()
