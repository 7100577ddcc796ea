"""A Unix socket that leads to a TCP address on the host's loopback.

A machine of the real tier lives in a network namespace of its own (its own interfaces and
addresses, as the provider reports them); Unix sockets are not namespaced, so this is how the
API server on the host's 127.0.0.1 reaches into it: the machine's side listens on the address
its kubeconfig names and connects to this socket (``gpufleet-join --forward``).
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path


def no_delay(connection: socket.socket) -> None:
    """Each write on the wire at once, as a gRPC stack sends it: with Nagle's algorithm a pipe
    holds a small write back until the peer acknowledges the last, which it delays (40 ms), so a
    round trip through a relay would take tens of milliseconds that no network adds."""
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class UnixRelay:
    def __init__(self, path: Path, target: tuple[str, int]) -> None:
        self.path = path
        self.target = target
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if path.exists():
            path.unlink()
        self._listener.bind(str(path))
        self._listener.listen(64)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"relay {path.name}").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                inbound, _ = self._listener.accept()
            except OSError:
                return
            try:
                outbound = socket.create_connection(self.target, timeout=10)
                outbound.settimeout(None)
                no_delay(outbound)
            except OSError:
                inbound.close()
                continue
            for source, sink in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
