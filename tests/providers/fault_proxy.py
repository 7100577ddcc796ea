"""A loopback HTTP proxy in front of a fake provider, for injecting faults.

Requests pass through to ``upstream`` unchanged unless a one-shot rule claims
them. A rule is called with each ``Request`` until it returns something:

* a ``Reply``: answered directly (a canned error body in the provider's format);
* a ``Request``: forwarded instead of the original (e.g. with wrong credentials,
  so the real fake produces its real error);
* a callable ``Reply -> Reply``: the request is forwarded and the fake's answer
  passed through the callable (e.g. to hide a BMC capability).

Every request is recorded in ``requests`` so tests can assert on the wire.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "proxy-connection"}


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""

    def with_header(self, name: str, value: str) -> "Request":
        headers = {k: v for k, v in self.headers.items() if k.lower() != name.lower()}
        headers[name] = value
        return replace(self, headers=headers)


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


Rule = Callable[[Request], "Reply | Request | Callable[[Reply], Reply] | None"]


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.requests: list[Request] = []
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - silence
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                request = Request(self.command, self.path, dict(self.headers.items()), self.rfile.read(length))
                reply = proxy.handle(request)
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    if name.lower() not in HOP_BY_HOP:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def once(self, rule: Rule) -> None:
        """Apply ``rule`` to requests until it claims one, then drop it."""
        with self._lock:
            self._rules.append(rule)

    def reset(self) -> None:
        with self._lock:
            self._rules.clear()
            self.requests.clear()

    def handle(self, request: Request) -> Reply:
        outcome = None
        with self._lock:
            self.requests.append(request)
            for rule in list(self._rules):
                outcome = rule(request)
                if outcome is not None:
                    self._rules.remove(rule)
                    break
        if isinstance(outcome, Reply):
            return outcome
        if isinstance(outcome, Request):
            return self.forward(outcome)
        reply = self.forward(request)
        return outcome(reply) if callable(outcome) else reply

    def forward(self, request: Request) -> Reply:
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=30)
        try:
            # Keep the client's Host so absolute redirects point back at the proxy.
            headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP - {"host"}}
            if request.body or request.method in ("POST", "PUT", "PATCH"):
                headers["Content-Length"] = str(len(request.body))
            conn.request(request.method, request.path, body=request.body or None, headers=headers)
            response = conn.getresponse()
            return Reply(response.status, response.read(), dict(response.getheaders()))
        finally:
            conn.close()
