"""A node's spot notice sources (``workers.reclaim_watch``): AWS's IMDSv2 as a node reads it
(a stub metadata service on loopback), and ``auto``, what the shipped DaemonSet sets, picking
the source of the provider gpufleet named in the node's providerID."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from fleet.cluster import gpufleet_provider_id
from workers.reclaim_watch import aws_spot_notice, gcp_preempted, spot_notice_source

TOKEN = "imds-token-1"
NOTICE_AT = "2026-05-01T12:02:00Z"


class StubImds:
    """IMDSv2: a token from ``PUT /latest/api/token``; ``spot/instance-action`` only with it,
    404 until a notice is posted."""

    def __init__(self) -> None:
        self.notice: dict | None = None
        self.calls: list[tuple[str, str]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                stub.calls.append(("PUT", self.path))
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                if self.path != "/latest/api/token" or not ttl:
                    return self._answer(400, b"")
                self._answer(200, TOKEN.encode())

            def do_GET(self) -> None:
                stub.calls.append(("GET", self.path))
                if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
                    return self._answer(401, b"")
                if self.path != "/latest/meta-data/spot/instance-action" or stub.notice is None:
                    return self._answer(404, b"")
                self._answer(200, json.dumps(stub.notice).encode())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def imds() -> Iterator[StubImds]:
    stub = StubImds()
    yield stub
    stub.server.shutdown()
    stub.server.server_close()


def test_the_aws_source_reads_the_notice_with_an_imdsv2_token(imds: StubImds) -> None:
    """No notice: 404, None. A notice: its termination time. Each read asks for a token first."""
    assert aws_spot_notice(imds.url) is None
    imds.notice = {"action": "terminate", "time": NOTICE_AT}
    assert aws_spot_notice(imds.url) == datetime(2026, 5, 1, 12, 2, tzinfo=timezone.utc).timestamp()
    assert imds.calls == [("PUT", "/latest/api/token"), ("GET", "/latest/meta-data/spot/instance-action")] * 2


def kubeadm_flags(tmp_path: Path, provider_id: str) -> Path:
    """``/var/lib/kubelet/kubeadm-flags.env`` as kubeadm join writes it from the JoinConfiguration
    of deploy/bootstrap/cloud-init.yaml (its kubeletExtraArgs)."""
    flags = tmp_path / "kubeadm-flags.env"
    flags.write_text('KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix:///run/containerd/containerd.sock '
                     f'--pod-infra-container-image=registry.k8s.io/pause:3.10 --provider-id={provider_id} '
                     '--rotate-server-certificates=true"\n')
    return flags


@pytest.mark.parametrize(("provider", "source"), [
    ("aws", aws_spot_notice),
    ("gcp", gcp_preempted),
    # No spot market (Lambda, Hetzner, own racks), or no notice the agent reads (Nebius): none.
    ("lambda", None), ("hetzner", None), ("own-dc", None), ("nebius", None),
])
def test_auto_reads_the_notice_of_the_provider_in_the_nodes_provider_id(tmp_path, provider, source) -> None:
    flags = kubeadm_flags(tmp_path, gpufleet_provider_id(provider, f"{provider}-prod", "gf-node-1"))
    assert spot_notice_source("auto", flags) is source


def test_auto_reads_none_on_a_node_gpufleet_did_not_join(tmp_path) -> None:
    """No kubeadm flags (the DaemonSet's FileOrCreate leaves an empty file), or a providerID
    that is not gpufleet's: no provider to trust, no notices."""
    assert spot_notice_source("auto", tmp_path / "absent") is None
    (empty := tmp_path / "empty.env").write_text("")
    assert spot_notice_source("auto", empty) is None
    assert spot_notice_source("auto", kubeadm_flags(tmp_path, "aws:///us-east-1a/i-0123456789abcdef0")) is None


def test_a_named_source_is_read_on_any_node_and_an_unknown_one_is_refused() -> None:
    assert spot_notice_source("aws") is aws_spot_notice
    assert spot_notice_source("") is None
    with pytest.raises(ValueError, match="GPUFLEET_SPOT_NOTICE: 'azure' is not auto, aws or gcp"):
        spot_notice_source("azure")
