"""A machine of the real tier: ``gpufleet-join`` booted from the user data gpufleet rendered.

The Go harness (``tests/realk8s/harness/join``) runs kubeadm's join code, the kubelet's TLS
bootstrap and the real kubelet on kubemark's fake runtime.  This starts it as a machine: in a
network namespace of its own (``unshare --net``; needs root) with an ``eth0`` carrying the
addresses the provider reports for the machine and a default route, so the kubelet finds and
reports those addresses as a real one does; with its own root folder (its ``/etc/kubernetes`` and
``/var/lib/kubelet``); and with the API server's address, as ``cluster-info`` advertises it,
relayed into that namespace through a Unix socket (``tests/realk8s/relay.py``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.realk8s import build
from tests.realk8s.relay import UnixRelay


def missing_reason() -> str | None:
    """None when machines can start here, else why not (one line)."""
    if os.geteuid() != 0:
        return "machines of the real Kubernetes tier need root (a network namespace each, `unshare --net`)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"machines of the real Kubernetes tier need `{tool}` (util-linux, iproute2)"
    return None


class MachineFailed(RuntimeError):
    def __init__(self, step: str, error: str) -> None:
        super().__init__(f"{step}: {error}")
        self.step = step
        self.error = error


@dataclass
class Machine:
    user_data: str
    root: Path
    #: The machine's own addresses: what the provider reports for it.
    addresses: list[str]
    #: TCP addresses inside the machine's network that lead to the host's loopback: what the
    #: machine reaches the API server at (``cluster-info``'s ``server``, a join endpoint).
    routes: dict[str, tuple[str, int]]
    gpus: int = 8
    steps: list[dict[str, Any]] = field(default_factory=list)
    process: subprocess.Popen | None = None
    relays: list[UnixRelay] = field(default_factory=list)

    def _argv(self, *extra: str) -> list[str]:
        self.root.mkdir(parents=True, exist_ok=True)
        user_data = self.root / "user-data"
        user_data.write_text(self.user_data)
        forwards = []
        if not self.relays:  # a Unix socket's path has ~100 bytes: a short folder of its own
            sockets = Path(tempfile.mkdtemp(prefix="gfm-"))
            self.relays = [UnixRelay(sockets / f"{n}.sock", target)
                           for n, target in enumerate(self.routes[listen] for listen in sorted(self.routes))]
        for listen, relay in zip(sorted(self.routes), self.relays):
            forwards.append(f"--forward={listen}={relay.path}")
        # eth0 is one end of a veth pair whose other end stays in the namespace too: an interface
        # with a carrier and no way out (the dummy driver is not in every kernel).
        network = ["ip link set lo up", "ip link add eth0 type veth peer name eth0-peer",
                   "ip link set eth0-peer up", "ip link set eth0 up"]
        for address in self.addresses:
            try:
                ip = ipaddress.ip_address(address)
            except ValueError:
                continue  # a network (Hetzner reports its IPv6 /64), not an address
            network.append(f"ip addr add {ip}/{32 if ip.version == 4 else 128} dev eth0")
        network.append("ip route add default dev eth0")
        for listen in self.routes:  # an address the machine reaches the API server at, routed locally
            host = listen.rsplit(":", 1)[0].strip("[]")
            if not ipaddress.ip_address(host).is_loopback and host not in self.addresses:
                network.append(f"ip addr add {host}/32 dev lo")
        harness = [str(build.bin_dir() / "gpufleet-join"), "join", f"--user-data={user_data}", f"--root={self.root}",
                   f"--gpus={self.gpus}", *forwards, *extra]
        # The kubelet's scratch folders (kubemark makes them under $TMPDIR) go with the machine.
        (self.root / "tmp").mkdir(exist_ok=True)
        script = (f"set -e; export TMPDIR={shlex.quote(str(self.root / 'tmp'))}; " + "; ".join(network)
                  + "; exec " + shlex.join(harness))
        return ["unshare", "--net", "--", "sh", "-c", script]

    def discover(self, *extra: str) -> dict[str, Any]:
        """kubeadm's discovery and preflight reads only (no kubelet): the last step it printed."""
        done = subprocess.run(self._argv("--discover-only", *extra), capture_output=True, text=True, timeout=120)
        self.steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        self._raise_on_error(done.stderr)
        return self.steps[-1]

    def boot(self) -> "Machine":
        """Start the machine; it joins and then runs its kubelet in the background."""
        argv = self._argv()
        with (self.root / "machine.log").open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                            start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.process and self.process.stdout
        for line in self.process.stdout:
            if line.startswith("{"):
                try:
                    self.steps.append(json.loads(line))
                except ValueError:
                    pass

    def _raise_on_error(self, stderr: str = "") -> None:
        for step in self.steps:
            if "error" in step:
                raise MachineFailed(step["step"], step["error"])
        if not self.steps and stderr:
            raise MachineFailed("start", stderr[-2000:])

    def wait_step(self, step: str, seconds: float = 60) -> dict[str, Any]:
        """Block until the machine printed ``step``; raise as soon as it failed or exited."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for seen in self.steps:
                if seen.get("step") == step and "error" not in seen:
                    return seen
            self._raise_on_error()
            if self.process is not None and self.process.poll() is not None:
                time.sleep(0.2)  # let the reader take the last lines
                self._raise_on_error()
                raise MachineFailed(step, f"the machine exited ({self.process.returncode}) before it; "
                                          f"log: {self.log_tail()}")
            time.sleep(0.1)
        raise MachineFailed(step, f"not reached in {seconds:.0f} s; steps so far: {[s['step'] for s in self.steps]}")

    def failure(self, seconds: float = 60) -> MachineFailed:
        """Wait for the machine to fail; the failure it reported."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                self._raise_on_error()
            except MachineFailed as failed:
                return failed
            time.sleep(0.1)
        raise AssertionError(f"the machine did not fail in {seconds:.0f} s: {[s['step'] for s in self.steps]}")

    def log_tail(self, chars: int = 3000) -> str:
        path = self.root / "machine.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def renew(self, expiration_seconds: int = 600) -> dict[str, Any]:
        """A client-certificate renewal with the node's current certificate, from inside the
        machine's network while it runs (the address its kubeconfig names, a join endpoint, is
        routed only there)."""
        argv = [str(build.bin_dir() / "gpufleet-join"), "renew", f"--root={self.root}",
                f"--expiration-seconds={expiration_seconds}"]
        if self.process is not None and self.process.poll() is None:
            argv = ["nsenter", f"--net=/proc/{self.process.pid}/ns/net", "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=90)
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        for line in lines:
            if "error" in line:
                raise MachineFailed(line["step"], line["error"])
        if not lines:
            raise MachineFailed("renew", done.stderr[-2000:])
        return lines[-1]

    @property
    def static_pod_dir(self) -> Path:
        """Where its kubelet reads static pod manifests: each file there is a pod it runs and
        publishes as a mirror pod. kubemark makes the folder in a root folder of its own under
        /tmp (whatever $TMPDIR says), which its kubelet names in its log."""
        [root] = set(re.findall(r"Using (\S+) as root dir for hollow-kubelet", self.log_tail(10_000_000)))
        [found] = Path(root).glob("static-pods*")
        return found

    @property
    def kubeconfig(self) -> Path:
        return self.root / "etc" / "kubernetes" / "kubelet.conf"

    @property
    def client_pem(self) -> Path:
        """The kubelet's client certificate and key (one PEM file, as the kubelet keeps it)."""
        return self.root / "var" / "lib" / "kubelet" / "pki" / "kubelet-client-current.pem"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for relay in self.relays:
            relay.close()
            shutil.rmtree(relay.path.parent, ignore_errors=True)
        self.relays.clear()
