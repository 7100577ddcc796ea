"""A simulated OpenAI-compatible model server for the dev stack's front door.

One per Ready replica: ``/health``, ``/v1/models`` and ``/v1/completions``
(``stream: true`` answers as server-sent events, one token each ``token_ms``
after a first token at ``first_token_ms``). Every answer names the site and the
server that produced it (``x-gpufleet-site``/``x-gpufleet-server`` headers and
the ``site`` field of each chunk), so ``curl`` through the front door shows
where a session landed. Plain asyncio streams: no web framework, so a test or
the benchmark can run dozens in one event loop.

Load: with ``max_running`` set, at most that many completions run at once and the
rest wait, as in vLLM's scheduler; ``/metrics`` exposes the same gauges vLLM does
(``vllm:num_requests_waiting``, ``vllm:num_requests_running``), which the
``Routing`` entity's load sample reads.

Faults for tests and game days: ``die_after_tokens`` drops the connection
mid-stream (a crashed replica); ``stop()`` closes the listener (connections
refused). ``requests`` counts every completion request that arrived, so a test
can prove a request was not replayed anywhere.

    python -m sim.model_server --site site-a --port 9001 [--first-token-ms 50]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Annotated

import typer

MAX_HEADER = 64 * 1024
MAX_BODY = 1024 * 1024


@dataclass
class SimModelServer:
    site: str
    name: str = ""
    model: str = "llm"
    host: str = "127.0.0.1"
    port: int = 0
    first_token_ms: float = 50
    token_ms: float = 5
    tokens: int = 8
    #: Drop the connection after this many streamed tokens (None: never).
    die_after_tokens: int | None = None
    #: ``/health`` answers 503 while False (a replica still loading its weights).
    ready: bool = True
    requests: int = 0
    #: Completions running at once (0: no limit); the rest wait their turn.
    max_running: int = 0
    running: int = 0
    waiting: int = 0
    health_checks: int = 0
    sessions: dict[str, int] = field(default_factory=dict)
    _server: asyncio.base_events.Server | None = None
    _open: set = field(default_factory=set)
    _turn: asyncio.Condition | None = None

    async def start(self) -> "SimModelServer":
        self._server = await asyncio.start_server(self._serve, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self.name = self.name or f"{self.site}-{self.port}"
        return self

    async def stop(self) -> None:
        """Close the listener: from now on connections are refused."""
        if self._server is not None:
            self._server.close()
            self._server = None
        # Open keep-alive connections are cut too, as a dead process's would be.
        for writer in list(self._open):
            writer.transport.abort()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        except asyncio.CancelledError:
            # The loop is shutting down with this connection open: nothing left to answer.
            pass
        finally:
            self._open.discard(writer)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection is done."""
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > MAX_HEADER:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        length = int(headers.get("content-length", "0") or 0)
        body = await reader.readexactly(min(length, MAX_BODY)) if length else b""
        keep = headers.get("connection", "").lower() != "close"
        path = path.split("?", 1)[0]
        if path == "/health":
            self.health_checks += 1
            status = 200 if self.ready else 503
            await self._send(writer, status, {"status": "ok" if self.ready else "loading"}, keep)
        elif path == "/metrics":
            await self._send_text(writer, self._metrics(), keep)
        elif path == "/v1/models":
            await self._send(writer, 200, {"object": "list", "data": [{"id": self.model, "object": "model",
                                                                        "owned_by": self.site}]}, keep)
        elif path == "/v1/completions" and method == "POST":
            self.requests += 1
            session = headers.get("x-session-id", "")
            if session:
                self.sessions[session] = self.sessions.get(session, 0) + 1
            try:
                request = json.loads(body or b"{}")
            except ValueError:
                await self._send(writer, 400, {"error": {"message": "body: not JSON"}}, keep)
                return keep
            if not isinstance(request, dict):
                await self._send(writer, 400, {"error": {"message": "body: must be a JSON object"}}, keep)
                return keep
            async with self._slot():
                if request.get("stream"):
                    return await self._stream(writer, request, keep)
                await asyncio.sleep(self.first_token_ms / 1000)
                await self._send(writer, 200, self._completion("".join(self._words(request))), keep)
        else:
            await self._send(writer, 404, {"error": {"message": f"no route {method} {path}"}}, keep)
        return keep

    @contextlib.asynccontextmanager
    async def _slot(self):
        """A running slot; waits (counted in ``waiting``) while ``max_running`` are taken."""
        if self._turn is None:
            self._turn = asyncio.Condition()
        async with self._turn:
            self.waiting += 1
            try:
                await self._turn.wait_for(lambda: not self.max_running or self.running < self.max_running)
            finally:
                self.waiting -= 1
            self.running += 1
        try:
            yield
        finally:
            async with self._turn:
                self.running -= 1
                self._turn.notify_all()

    def _metrics(self) -> str:
        label = f'{{model_name="{self.model}"}}'
        return (
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{label} {float(self.waiting)}\n"
            "# HELP vllm:num_requests_running Number of requests currently running.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{label} {float(self.running)}\n"
        )

    async def _send_text(self, writer: asyncio.StreamWriter, text: str, keep: bool) -> None:
        body = text.encode()
        writer.write(self._head(200, "text/plain; version=0.0.4", f"content-length: {len(body)}\r\n", keep) + body)
        await writer.drain()

    def _words(self, request: dict) -> list[str]:
        n = request.get("max_tokens", self.tokens)
        n = n if isinstance(n, int) and 0 < n <= 4096 else self.tokens
        return [f" tok{i}" for i in range(n)]

    def _completion(self, text: str) -> dict:
        return {"id": f"cmpl-{self.name}", "object": "text_completion", "created": int(time.time()),
                "model": self.model, "site": self.site, "server": self.name,
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}]}

    def _head(self, status: int, kind: str, extra: str, keep: bool) -> bytes:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}.get(status, "OK")
        return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: {kind}\r\nx-gpufleet-site: {self.site}\r\n"
                f"x-gpufleet-server: {self.name}\r\n{extra}connection: {'keep-alive' if keep else 'close'}"
                "\r\n\r\n").encode()

    async def _send(self, writer: asyncio.StreamWriter, status: int, doc: dict, keep: bool) -> None:
        body = json.dumps(doc).encode()
        writer.write(self._head(status, "application/json", f"content-length: {len(body)}\r\n", keep) + body)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, request: dict, keep: bool) -> bool:
        writer.write(self._head(200, "text/event-stream", "transfer-encoding: chunked\r\n", keep))
        await writer.drain()
        await asyncio.sleep(self.first_token_ms / 1000)
        for i, word in enumerate(self._words(request)):
            if i and self.token_ms:
                await asyncio.sleep(self.token_ms / 1000)
            if self.die_after_tokens is not None and i >= self.die_after_tokens:
                # A crash: no terminating chunk, the socket just goes.
                writer.transport.abort()
                return False
            chunk = self._completion(word)
            chunk["choices"][0]["finish_reason"] = None
            await self._chunk(writer, f"data: {json.dumps(chunk)}\n\n".encode())
        await self._chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return keep

    @staticmethod
    async def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()


async def _main(site: str, model: str, host: str, port: int, first_token_ms: float, token_ms: float) -> None:
    server = await SimModelServer(site=site, model=model, host=host, port=port,
                                  first_token_ms=first_token_ms, token_ms=token_ms).start()
    print(f"sim model server {server.name} for {model} at {site} on http://{server.address}", flush=True)
    await asyncio.Event().wait()


def cli(
    site: Annotated[str, typer.Option(help="the site it serves for")],
    model: Annotated[str, typer.Option(help="the model it serves")] = "llm",
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on (0: any free one)")] = 0,
    first_token_ms: Annotated[float, typer.Option(help="latency before the first token")] = 50,
    token_ms: Annotated[float, typer.Option(help="latency between tokens")] = 5,
) -> None:
    """A simulated model server (an OpenAI-style streaming endpoint) for the dev stack."""
    try:
        asyncio.run(_main(site, model, host, port, first_token_ms, token_ms))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    typer.run(cli)
