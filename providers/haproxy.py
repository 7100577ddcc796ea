"""HAProxy as the dev stack's front door: its configuration, its runtime API, its process.

What it does for a model's traffic (HAProxy 2.6, /work/shared/notes-platform.md):

- one backend per model (``/<model>/...`` is routed to it, the prefix stripped, as the
  production HTTPRoute matches ``/<model>``), one server per Ready replica of each site;
- stickiness on the ``x-session-id`` header (a stick table): every turn of a session goes
  to the same replica, so its prefix cache stays warm;
- a site's share of new sessions is the routing document's weight, split over the
  site's replicas (server weights 1..256); weight 0 takes new sessions away and keeps
  stuck ones (reweight); ``maint`` with ``option redispatch`` moves stuck ones too (drain);
- ``retry-on conn-failure empty-response``: a request is retried (on another server) only
  while no byte of the answer has come back; a stream cut after some tokens is never
  replayed (the client sees the error);
- a replica that refuses a connection is marked down at once (``observe layer4``), so retries
  go to live replicas; its next health check brings it back.

Weight and drain changes go through the runtime API (a Unix socket) and take effect at
once; a change in the set of replicas writes a new configuration and reloads.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fleet.routing import RoutingDocument
from providers.child_process import die_with

#: HAProxy's largest server weight.
MAX_WEIGHT = 256
SESSION_HEADER = "x-session-id"
INSTALL_HINT = "install HAProxy for the front door: apt-get install -y haproxy (Debian/Ubuntu), brew install haproxy"


class HAProxyError(RuntimeError):
    pass


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy")
                                            if os.access(p, os.X_OK)), None)


def _ident(value: str) -> str:
    """A name HAProxy accepts for a backend or server."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", value)


def backend_name(model: str) -> str:
    return f"m_{_ident(model)}"


def server_name(site: str, index: int) -> str:
    return f"{_ident(site)}__{index}"


@dataclass(frozen=True)
class Replica:
    """One Ready replica of a model at a site, as the front door reaches it."""

    site: str
    address: str  # host:port


def server_weights(document: RoutingDocument, replicas: dict[str, list[Replica]]) -> dict[str, dict[str, int]]:
    """Per-server weights of one model's backend: each site's weight split over its
    replicas, scaled so the heaviest server gets ``MAX_WEIGHT``; a site with a
    positive weight never rounds down to 0."""
    per_server = {site: document.sites[site].weight / len(reps) if site in document.sites else 0.0
                  for site, reps in replicas.items() if reps}
    top = max(per_server.values(), default=0.0)
    out: dict[str, dict[str, int]] = {}
    for site, reps in replicas.items():
        share = per_server.get(site, 0.0)
        weight = 0 if share <= 0 or top <= 0 else max(1, round(share / top * MAX_WEIGHT))
        out[site] = {server_name(site, i): weight for i in range(len(reps))}
    return out


def render_config(
    models: dict[str, dict[str, list[Replica]]],
    documents: dict[str, RoutingDocument],
    *,
    bind: str,
    socket_path: str,
    check_interval_ms: int = 500,
) -> str:
    """The whole configuration for these models' replicas, weighted by their documents."""
    lines = [
        "global",
        f"    stats socket {socket_path} mode 600 level admin",
        "    maxconn 4096",
        "defaults",
        "    mode http",
        "    timeout connect 2s",
        "    timeout client 10m",
        "    timeout server 10m",
        "    timeout http-keep-alive 30s",
        # Retry (on another server: redispatch on every retry) only while nothing of the
        # answer has arrived; after the first byte a failure is the client's to see.
        "    retries 3",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response",
        # Tokens are tiny writes: send each at once instead of waiting to coalesce them.
        "    option http-no-delay",
        "frontend front_door",
        f"    bind {bind}",
    ]
    for model in sorted(models):
        lines.append(f"    use_backend {backend_name(model)} if {{ path_beg /{model}/ }}")
    for model in sorted(models):
        doc = documents.get(model) or RoutingDocument(model=model, version=0)
        weights = server_weights(doc, models[model])
        lines += [
            f"backend {backend_name(model)}",
            "    balance roundrobin",
            "    stick-table type string len 64 size 100k expire 30m",
            f"    stick on req.hdr({SESSION_HEADER})",
            f"    http-request replace-path ^/{re.escape(model)}(/.*) \\1",
            "    option httpchk GET /health",
            # A replica that refuses a connection is out at once, not at its next health check: a
            # request's retries then go to live ones, never again to a dead one (with every retry
            # free to land on another dead replica, a site's death could use all of them up and
            # answer 503). Its health check brings it back (``rise 1``) once it answers.
            f"    default-server inter {check_interval_ms} fastinter {max(100, check_interval_ms // 2)} fall 2 rise 1 "
            "observe layer4 error-limit 1 on-error mark-down",
        ]
        for site in sorted(models[model]):
            draining = doc.sites[site].draining if site in doc.sites else False
            for i, replica in enumerate(models[model][site]):
                name = server_name(site, i)
                state = " disabled" if draining else ""
                lines.append(f"    server {name} {replica.address} weight {weights[site][name]} check{state}")
    return "\n".join(lines) + "\n"


def runtime(socket_path: str, command: str, timeout: float = 5.0) -> str:
    """One runtime API call (several commands joined by ``;``); the answer's text."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(socket_path)
        sock.sendall(command.encode() + b"\n")
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def apply_commands(document: RoutingDocument, replicas: dict[str, list[Replica]]) -> list[str]:
    """Runtime API commands that bring a running backend to ``document``."""
    backend = backend_name(document.model)
    weights = server_weights(document, replicas)
    commands = []
    for site in sorted(replicas):
        draining = document.sites[site].draining if site in document.sites else False
        for name, weight in weights[site].items():
            commands.append(f"set server {backend}/{name} weight {weight}")
            commands.append(f"set server {backend}/{name} state {'maint' if draining else 'ready'}")
    return commands


#: HAProxy 2.6 refuses a ``stats socket`` path longer than this ("socket path ... too long (max 97)").
MAX_SOCKET_PATH = 97


@dataclass
class HAProxy:
    """A front door process: start, reload on new replicas, apply documents at runtime."""

    workdir: Path
    bind: str = "127.0.0.1:0"
    check_interval_ms: int = 500
    models: dict[str, dict[str, list[Replica]]] = field(default_factory=dict)
    documents: dict[str, RoutingDocument] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    @property
    def socket_path(self) -> str:
        """The runtime API's socket: in the workdir, unless that path is longer than HAProxy takes
        (``MAX_SOCKET_PATH``; a deep state dir, as under pytest-xdist, passes it), then a short
        one in the temporary directory named by the workdir, so the same front door finds it again."""
        beside = str(self.workdir / "haproxy.sock")
        if len(beside) <= MAX_SOCKET_PATH:
            return beside
        digest = hashlib.sha256(str(self.workdir.resolve()).encode()).hexdigest()[:16]
        return str(Path(tempfile.gettempdir()) / f"gpufleet-haproxy-{digest}.sock")

    @property
    def config_path(self) -> Path:
        return self.workdir / "haproxy.cfg"

    @property
    def url(self) -> str:
        return f"http://{self.bind}"

    def start(self) -> "HAProxy":
        binary = haproxy_binary()
        if binary is None:
            raise HAProxyError(f"haproxy not found; {INSTALL_HINT}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.bind.endswith(":0"):
            with socket.socket() as sock:
                sock.bind((self.bind.rsplit(":", 1)[0], 0))
                self.bind = f"{self.bind.rsplit(':', 1)[0]}:{sock.getsockname()[1]}"
        self._launch(binary)
        return self

    def _launch(self, binary: str) -> None:
        self.config_path.write_text(render_config(self.models, self.documents, bind=self.bind,
                                                  socket_path=self.socket_path,
                                                  check_interval_ms=self.check_interval_ms))
        check = subprocess.run([binary, "-c", "-f", str(self.config_path)], capture_output=True, text=True)
        if check.returncode != 0:
            alerts = [line for line in (check.stderr + check.stdout).splitlines() if "[ALERT]" in line]
            raise HAProxyError(f"haproxy rejected {self.config_path}: {' '.join(alerts) or check.stderr.strip()}")
        old = self.process
        args = [binary, "-db", "-f", str(self.config_path)]
        if old is not None and old.poll() is None:
            args += ["-sf", str(old.pid)]  # the old process finishes its streams, then exits
        log = open(self.workdir / "haproxy.log", "ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                        preexec_fn=die_with(os.getpid()))
        log.close()
        self._wait_ready(old)

    def _wait_ready(self, old: subprocess.Popen | None) -> None:
        deadline = time.monotonic() + 10
        host, port = self.bind.rsplit(":", 1)
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise HAProxyError(f"haproxy exited with {self.process.returncode}; see {self.workdir / 'haproxy.log'}")
            try:
                if "Name" in runtime(self.socket_path, "show info", timeout=1):
                    if old is not None:
                        old.wait(timeout=10)
                    socket.create_connection((host, int(port)), timeout=1).close()
                    return
            except OSError:
                pass
            time.sleep(0.02)
        raise HAProxyError(f"haproxy did not come up within 10 s; see {self.workdir / 'haproxy.log'}")

    def set_replicas(self, model: str, replicas: dict[str, list[Replica]]) -> None:
        """A new set of replicas for ``model``: a new configuration and a reload."""
        if self.models.get(model) == replicas:
            return
        self.models[model] = replicas
        binary = haproxy_binary()
        if self.process is not None and binary is not None:
            self._launch(binary)

    def apply(self, document: RoutingDocument) -> bool:
        """Bring the running front door to ``document``; False when it already was
        there (an older or the same version)."""
        known = self.documents.get(document.model)
        if known is not None and known.version >= document.version:
            return False
        self.documents[document.model] = document
        replicas = self.models.get(document.model)
        if replicas and self.process is not None:
            answer = runtime(self.socket_path, ";".join(apply_commands(document, replicas)))
            problems = [ln for ln in answer.splitlines() if ln.strip() and "ok" not in ln.lower()]
            if problems:
                raise HAProxyError(f"runtime API refused routing v{document.version} of {document.model}: "
                                   + "; ".join(problems[:3]))
        return True

    def stick_table(self, model: str) -> str:
        return runtime(self.socket_path, f"show table {backend_name(model)}")

    def servers_up(self, model: str) -> dict[str, bool]:
        """Each of the model's servers: whether HAProxy sends it traffic now (its health as HAProxy
        judges it, checks and observed connections both)."""
        answer = runtime(self.socket_path, f"show servers state {backend_name(model)}")
        rows = [line.split() for line in answer.splitlines() if line and not line.startswith("#")]
        # Columns (HAProxy 2.6): be_id be_name srv_id srv_name srv_addr srv_op_state ...; 0 is stopped.
        return {row[3]: row[5] != "0" for row in rows if len(row) > 5}

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if not self.socket_path.startswith(str(self.workdir)):
            Path(self.socket_path).unlink(missing_ok=True)  # the short one outside the workdir
