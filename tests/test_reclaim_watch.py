"""A node's spot notice sources (``workers.reclaim_watch``) as a node reads them: AWS's IMDSv2
from AWS's own EC2 metadata mock, GCE's ``instance/preempted`` from a loopback stand-in, and
``auto``, what the shipped DaemonSet sets, picking the source of the provider gpufleet named in
the node's providerID."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
from temporalio.testing import ActivityEnvironment

from activities.node_agent import NodeAgentActivities, NodeWatch
from fleet.cluster import gpufleet_provider_id
from fleet.messages.repair import NodeWatchInput
from tests.ec2_metadata_mock import build as aemm
from tests.ports import free_port
from tests.tools import skip_or_fail
from workers import reclaim_watch
from workers.reclaim_watch import aws_spot_notice, gcp_preempted, spot_notice_source

NOTICE_AT = "2026-05-01T12:02:00Z"
INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
PREEMPTED = "/computeMetadata/v1/instance/preempted"


@pytest.fixture
def ec2_metadata_mock(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """``start(*spot_flags)``: AWS's EC2 metadata mock (tests/ec2_metadata_mock/build.py) serving
    ``spot`` on loopback with IMDSv2 required (``-I``), as gpufleet launches its instances; its URL."""
    reason = aemm.missing_reason()
    if reason:
        skip_or_fail(reason)
    started: list[subprocess.Popen] = []

    def start(*spot_flags: str) -> str:
        port = free_port()
        log = tmp_path / f"aemm-{port}.log"
        # HOME and the working folder: no aemm-config.json of anyone's is read.
        with log.open("wb") as out:
            mock = subprocess.Popen(
                [str(aemm.mock_path()), "spot", "-I", "-n", "127.0.0.1", "-p", str(port), *spot_flags],
                cwd=tmp_path, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}, stdout=out, stderr=subprocess.STDOUT)
        started.append(mock)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 15
        while True:
            try:
                httpx.get(f"{url}/latest/meta-data", timeout=1)
                return url
            except httpx.TransportError:
                if mock.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the EC2 metadata mock did not start:\n{log.read_text()}")
                time.sleep(0.1)

    yield start
    for mock in started:
        mock.terminate()
        try:
            mock.wait(5)
        except subprocess.TimeoutExpired:
            mock.kill()
            mock.wait()


@pytest.mark.integration  # the mock is a process
def test_the_aws_source_reads_no_notice_before_the_interruption(ec2_metadata_mock) -> None:
    """The interruption an hour away: IMDS answers 404, the node has no notice."""
    imds = ec2_metadata_mock("--mock-delay-sec", "3600")
    assert aws_spot_notice(imds) is None


@pytest.mark.integration  # the mock is a process
def test_the_aws_source_reads_the_interruption_time_with_an_imdsv2_token(ec2_metadata_mock) -> None:
    """With the interruption posted: its termination time. IMDSv2 only: a read without a session
    token is refused, so the source's read goes through its token."""
    imds = ec2_metadata_mock("--time", NOTICE_AT)
    assert httpx.get(f"{imds}{INSTANCE_ACTION}").status_code == 401
    assert aws_spot_notice(imds) == datetime(2026, 5, 1, 12, 2, tzinfo=timezone.utc).timestamp()


class StandInGceMetadata:
    """GCE's metadata server, the slice the GCP source reads. A stand-in because no registry
    publishes an emulator of it that serves ``instance/preempted`` (searched: PyPI, npm and the Go
    module proxy; the Go proxy refuses the GitHub ones). As GCE documents it: a request without
    ``Metadata-Flavor: Google`` gets 403, every answer carries that header, an unknown key 404,
    and ``preempted`` is ``FALSE`` until the preemption, then ``TRUE``. ``answer`` replaces the
    server's answer (status, body) to play a broken one; ``flavored = False`` drops the
    ``Metadata-Flavor`` header from its answers, to play something else on the path (a proxy, a
    captive portal, a pod listening on the link-local address) that answers anything."""

    def __init__(self) -> None:
        self.preempted = False
        self.answer: tuple[int, bytes] | None = None
        self.flavored = True
        self.flavors: list[str | None] = []  # each request's Metadata-Flavor header
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stand_in.flavors.append(self.headers.get("Metadata-Flavor"))
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._answer(403, b"Missing required header: Metadata-Flavor")
                if stand_in.answer is not None:
                    return self._answer(*stand_in.answer)
                if self.path != PREEMPTED:
                    return self._answer(404, b"Not Found")
                self._answer(200, b"TRUE" if stand_in.preempted else b"FALSE")

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                if stand_in.flavored:
                    self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", "application/text")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def gce(monkeypatch) -> Iterator[StandInGceMetadata]:
    monkeypatch.setattr(reclaim_watch, "_first_seen", {})  # each test's preemption is seen first in it
    monkeypatch.setattr(reclaim_watch, "_impostors_warned", set())  # and each test's impostor warned of in it
    stand_in = StandInGceMetadata()
    yield stand_in
    stand_in.server.shutdown()
    stand_in.server.server_close()


def test_the_gcp_source_reads_preempted_with_the_metadata_flavor_header(gce: StandInGceMetadata) -> None:
    """``FALSE``: no notice. ``TRUE``: 30 s from when it was first seen, the same time on each
    later probe. Every read says ``Metadata-Flavor: Google``, without which GCE answers 403."""
    assert gcp_preempted(gce.url) is None
    gce.preempted = True
    before = time.time()
    first = gcp_preempted(gce.url)
    assert first is not None and before + 30 <= first <= time.time() + 30
    assert gcp_preempted(gce.url) == first
    assert gce.flavors == ["Google"] * 3
    assert httpx.get(f"{gce.url}{PREEMPTED}").status_code == 403


def test_metadata_is_read_directly_whatever_proxy_the_node_names(gce: StandInGceMetadata, monkeypatch) -> None:
    """A node's ``HTTP_PROXY`` (set for its image pulls, say) is not the way to the machine's own
    metadata service: the proxy cannot reach it, or answers for it."""
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens: a read through it fails
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    gce.preempted = True
    assert gcp_preempted(gce.url) is not None


@pytest.mark.parametrize("answer", [
    (404, b"Not Found"),  # no such key on this metadata server
    (200, b"<html>a captive portal</html>"),
    (200, b"true-ish"),
    (503, b"TRUE"),  # an error page is no preemption, whatever it says
])
def test_the_gcp_source_reads_no_notice_from_a_missing_key_or_a_garbage_answer(gce, answer) -> None:
    gce.preempted, gce.answer = True, answer
    assert gcp_preempted(gce.url) is None


@pytest.mark.parametrize("body", [b"TRUE", b"FALSE"])
async def test_an_answer_without_the_metadata_flavor_header_is_neither_a_notice_nor_none(
        gce: StandInGceMetadata, body: bytes, caplog) -> None:
    """Whatever answers at the metadata address without GCE's ``Metadata-Flavor: Google`` is not
    GCE: its ``TRUE`` drains nothing, its ``FALSE`` vouches for nothing. The source does not answer
    (as an unreachable server does), says so once in the agent's log, and the agent's watch
    reports no notice and goes on; GCE answering again is read again."""
    gce.flavored, gce.answer = False, (200, body)
    with caplog.at_level(logging.WARNING, logger=reclaim_watch.__name__):
        for _ in range(2):
            with pytest.raises(reclaim_watch.NotTheMetadataServer):
                gcp_preempted(gce.url)
        watch = NodeWatch(NoGpus(), notice=lambda: gcp_preempted(gce.url), interval_s=0)
        agent = NodeAgentActivities("gcp-node", NoGpus(), watch)
        result = await ActivityEnvironment().run(agent.watch_node, NodeWatchInput(node_name="gcp-node"))
    assert result.reclaim_at is None
    assert gce.flavors == ["Google"] * 3, "the source asks with the header GCE requires"
    warned = [r.getMessage() for r in caplog.records if "Metadata-Flavor" in r.getMessage()]
    assert len(warned) == 1 and gce.url in warned[0] and "not read" in warned[0], warned
    gce.flavored, gce.answer, gce.preempted = True, None, True
    assert gcp_preempted(gce.url) is not None


class NoGpus:
    """A node's GPU backend with nothing to report: the test is the notice."""

    def boot_id(self) -> str:
        return "boot-1"

    def probe(self) -> list:
        return []


async def test_an_unreachable_metadata_server_gives_no_notice_and_the_agents_watch_goes_on() -> None:
    """``gcp`` chosen on a machine whose metadata server does not answer (nothing listens there):
    the agent's watch still returns the node's state, with no notice, and the next probe reads again."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(httpx.TransportError):
        gcp_preempted(nowhere)
    watch = NodeWatch(NoGpus(), notice=lambda: gcp_preempted(nowhere), interval_s=0)
    agent = NodeAgentActivities("gcp-node", NoGpus(), watch)
    result = await ActivityEnvironment().run(agent.watch_node, NodeWatchInput(node_name="gcp-node"))
    assert result.node_name == "gcp-node" and result.reclaim_at is None and result.seq == 1


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
    assert spot_notice_source("gcp") is gcp_preempted
    assert spot_notice_source("") is None
    with pytest.raises(ValueError, match="GPUFLEET_SPOT_NOTICE: 'azure' is not auto, aws or gcp"):
        spot_notice_source("azure")
