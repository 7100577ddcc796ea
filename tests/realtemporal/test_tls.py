"""The frontend's mutual TLS as deploy/temporal/values.yaml ships it, on the real server.

A cluster of this tier (``cli/temporal_cluster.py``) with values.yaml's ``server.config.tls``
(the chart's ``global.tls``), its files from the Secrets values.yaml mounts, each made by
deploy/temporal/README.md's openssl and kubectl lines as written
(``temporal-frontend-tls``: a certificate for the name the control-plane manifest dials,
``TEMPORAL_TLS_SERVER_NAME``; ``temporal-client-tls``: Temporal's own clients'), created its
namespace over mutual TLS as the chart's namespace job does, with the admin tools' variables.
Then a client configured exactly as the control-plane Deployment's env configures it (its
Secret ``gpufleet-temporal-client`` at its mountPath) must run a workflow, the server's own
worker service must run a Schedule (its client certificate is values.yaml's ``systemWorker``),
and a client with no certificate, another CA's, or expecting another server name is refused.

The services among themselves (values.yaml's ``tls.internode``, from the Secret
``temporal-internode-tls``, of a CA of its own): everything above runs over it, and history's,
matching's and the worker service's gRPC, and every service's membership port, refuse a caller
in plaintext, one without a certificate, and one with a certificate of the frontend's CA.

The dev-server tests (tests/test_temporal_manifests.py, tests/realk8s) keep a TLS proxy in
front of the dev server: they run without the built server; this is where the real server's
TLS, and the shipped settings of it, are proven.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import socket
import ssl
import struct
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import AsyncIterator

import grpc
import pytest
from temporalio import workflow
from temporalio.client import Schedule, ScheduleActionStartWorkflow, ScheduleSpec
from temporalio.worker import Worker

from fleet.schedules import SCHEDULES
from fleet.settings import Settings
from fleet.temporal import connect
from tests.doc_recipes import ROOT, run_openssl_lines, secret_folder, secrets_as_written, shell_block
from tests.realtemporal.cluster import RealTemporal, internode_secret, internode_tls
from tests.test_temporal_manifests import as_its_manifest_starts_it, control_plane_secret, new_ca, pod_spec
from tests.tools import require

#: Where the certificates and Secrets come from: its openssl and kubectl lines, as written.
README = ROOT / "deploy" / "temporal" / "README.md"
#: The Secrets values.yaml mounts into the server's pods.
FRONTEND_SECRET = "temporal-frontend-tls"
CLIENT_SECRET = "temporal-client-tls"
INTERNODE_SECRET = internode_secret()
#: The name every service's internode certificate is checked for.
INTERNODE_NAME = internode_tls()["client"]["serverName"]


@workflow.defn(sandboxed=False)
class Hello:
    @workflow.run
    async def run(self, name: str) -> str:
        return f"hello {name}"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """The Secrets as deploy/temporal/README.md makes them ("A cluster of your own"): its openssl
    lines run as written, each Secret's files under the keys its kubectl lines give them (one CA
    for the frontend, Temporal's own clients and gpufleet; the internode certificate of a CA of
    its own); and a client certificate of another CA."""
    require("openssl")
    root = tmp_path_factory.mktemp("temporal-pki")
    made = root / "made"
    run_openssl_lines(shell_block(README, "ca temporal-internode-ca"), made)
    secrets = secrets_as_written(README.read_text())
    return {
        **{name: secret_folder(root / name, secrets[name], made)
           for name in (FRONTEND_SECRET, CLIENT_SECRET, INTERNODE_SECRET, "gpufleet-temporal-client")},
        "stranger": control_plane_secret(root / "stranger", new_ca("another CA")),
    }


@pytest.fixture(scope="module")
async def tls_temporal(temporal_server, tmp_path_factory, pki) -> AsyncIterator[RealTemporal]:
    running = RealTemporal(tmp_path_factory.mktemp("realtemporal-tls"),
                           tls_secrets={name: pki[name] for name in (FRONTEND_SECRET, CLIENT_SECRET, INTERNODE_SECRET)})
    await asyncio.to_thread(running.start)
    try:
        yield running
    finally:
        await asyncio.to_thread(running.stop)


def control_plane_env(tmp_path: Path, address: str, secret: Path, **changed: str | None) -> dict[str, str]:
    """The control-plane container's environment, its Secret ``secret``'s files at the
    manifest's mountPath (under ``tmp_path``), the frontend at ``address``; ``changed`` variables
    set (None: removed)."""
    files = {"temporal-client": {name: (secret / name).read_bytes() for name in ("tls.crt", "tls.key", "ca.crt")}}
    _, env = as_its_manifest_starts_it(pod_spec("gpufleet-control-plane"), tmp_path / "pod", files, address)
    for name, value in changed.items():
        if value is None:
            del env[name]
        else:
            env[name] = value
    return env


async def connect_as(env: dict[str, str], monkeypatch):
    """Connect as the control plane does (fleet.temporal.connect from the environment alone)."""
    for name in [n for n in os.environ if n.startswith("TEMPORAL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("TEMPORAL_"):
            monkeypatch.setenv(name, value)
    return await asyncio.wait_for(connect(Settings.from_env()), 60)


async def test_the_control_plane_runs_a_workflow_over_the_frontends_shipped_mutual_tls(
        tls_temporal, pki, tmp_path, monkeypatch) -> None:
    client = await connect_as(control_plane_env(tmp_path, tls_temporal.address, pki["gpufleet-temporal-client"]),
                              monkeypatch)
    queue = f"tls-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[Hello]):
        assert await client.execute_workflow(Hello.run, "fleet", id=f"hello-{queue}", task_queue=queue,
                                             execution_timeout=timedelta(seconds=60)) == "hello fleet"


async def test_temporals_own_worker_service_reaches_the_frontend_with_its_certificate(
        tls_temporal, pki, tmp_path, monkeypatch) -> None:
    """Schedules (gpufleet's periodic work) run in Temporal's worker service, a client of the
    frontend like any other: its certificate is values.yaml's ``systemWorker``."""
    client = await connect_as(control_plane_env(tmp_path, tls_temporal.address, pki["gpufleet-temporal-client"]),
                              monkeypatch)
    queue = f"tls-schedule-{uuid.uuid4().hex[:8]}"
    action = ScheduleActionStartWorkflow(Hello.run, "schedule", id=f"hello-{queue}", task_queue=queue)
    handle = await client.create_schedule(f"schedule-{queue}", Schedule(action=action, spec=ScheduleSpec()),
                                          trigger_immediately=True)
    try:
        async with Worker(client, task_queue=queue, workflows=[Hello]):
            deadline = asyncio.get_running_loop().time() + 90
            while not (await handle.describe()).info.recent_actions:
                assert asyncio.get_running_loop().time() < deadline, (
                    f"the scheduler started nothing in 90 s:\n{tls_temporal.log_tail()}")
                await asyncio.sleep(0.5)
            (started,) = (await handle.describe()).info.recent_actions
            run = client.get_workflow_handle(started.action.workflow_id, run_id=started.action.first_execution_run_id)
            assert await run.result() == "hello schedule"
    finally:
        await handle.delete()


#: How docs/production/index.md runs a command in the control plane's pod.
IN_THE_POD = re.compile(r"^\s*kubectl -n gpufleet exec deploy/gpufleet-control-plane -c worker -- gpufleet ([^#\n]+)",
                        re.M)


async def test_the_commands_the_install_runs_in_the_control_plane_pod_work_there(tls_temporal, pki, tmp_path) -> None:
    """The production page runs ``gpufleet search-attributes`` and ``schedules apply`` inside the
    control plane's pod (only there does the frontend's name resolve, its network policy admit
    the caller, and its client certificate sit): with nothing but that container's environment
    and mounts (no ``--address``), each command of the page works against the shipped mutual TLS."""
    page = (ROOT / "docs" / "production" / "index.md").read_text()
    commands = [shlex.split(found) for found in IN_THE_POD.findall(page)]
    assert {tuple(words[:2]) for words in commands} >= {("search-attributes",), ("schedules", "apply")}, commands
    secret = pki["gpufleet-temporal-client"]
    mounted = {"temporal-client": {name: (secret / name).read_bytes() for name in ("tls.crt", "tls.key", "ca.crt")},
               "config": {"sites.yaml": (ROOT / "deploy" / "sites.example.yaml").read_bytes()}}
    _, env = as_its_manifest_starts_it(pod_spec("gpufleet-control-plane"), tmp_path / "pod", mounted,
                                       tls_temporal.address)
    said = {}
    for words in commands:
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cli", *words], env=env, cwd=ROOT,
                                       capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"gpufleet {' '.join(words)}:\n{done.stdout}\n{done.stderr}"
        said[" ".join(words)] = done.stdout
    listed = {line.split("\t")[0] for line in said["schedules list"].splitlines()[1:]}  # piped: tab-separated
    assert listed == set(SCHEDULES), said


@pytest.mark.parametrize("refused", ["no client certificate", "another CA's certificate", "another server name"])
async def test_the_frontend_refuses_a_client_the_shipped_settings_do_not_admit(
        tls_temporal, pki, tmp_path, monkeypatch, refused: str) -> None:
    secret = pki["stranger" if refused == "another CA's certificate" else "gpufleet-temporal-client"]
    changed = {
        "no client certificate": {"TEMPORAL_TLS_CLIENT_CERT_PATH": None, "TEMPORAL_TLS_CLIENT_KEY_PATH": None},
        "another server name": {"TEMPORAL_TLS_SERVER_NAME": "temporal-frontend.elsewhere.svc"},
    }.get(refused, {})
    env = control_plane_env(tmp_path / "refused", tls_temporal.address, secret, **changed)
    if refused == "another CA's certificate":  # it trusts the frontend: only its own certificate is foreign
        Path(env["TEMPORAL_TLS_SERVER_CA_CERT_PATH"]).write_bytes((pki[CLIENT_SECRET] / "ca.crt").read_bytes())
    with pytest.raises(RuntimeError):
        await connect_as(env, monkeypatch)
    # Refused for that one difference: the manifest's own settings connect.
    admitted = control_plane_env(tmp_path / "admitted", tls_temporal.address, pki["gpufleet-temporal-client"])
    assert (await (await connect_as(admitted, monkeypatch)).count_workflows()).count >= 0


#: How a caller of the services' internal ports presents itself: plaintext, TLS without a client
#: certificate, TLS with the certificate of Temporal's own frontend clients (the web UI's, the
#: admin tools': the frontend's CA), and the services' own internode certificate.
CALLERS = ("plaintext", "no client certificate", "the frontend's CA's certificate", "the internode certificate")


def presented(pki: dict[str, Path], caller: str) -> Path | None:
    """The Secret whose certificate ``caller`` presents, if any. Every TLS caller trusts the
    services' certificate (the internode CA): only what it presents differs."""
    return {"the frontend's CA's certificate": pki[CLIENT_SECRET],
            "the internode certificate": pki[INTERNODE_SECRET]}.get(caller)


def grpc_credentials(pki: dict[str, Path], caller: str) -> grpc.ChannelCredentials | None:
    if caller == "plaintext":
        return None
    root, secret = (pki[INTERNODE_SECRET] / "ca.crt").read_bytes(), presented(pki, caller)
    if secret is None:
        return grpc.ssl_channel_credentials(root_certificates=root)
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=(secret / "tls.key").read_bytes(),
                                        certificate_chain=(secret / "tls.crt").read_bytes())


def health_check(port: int, credentials: grpc.ChannelCredentials | None) -> bytes:
    """grpc.health.v1.Health/Check of the server on ``port`` (plaintext without ``credentials``):
    the response's bytes; any gRPC server of Temporal's answers it to whoever it admits."""
    target = f"127.0.0.1:{port}"
    channel = (grpc.secure_channel(target, credentials, [("grpc.ssl_target_name_override", INTERNODE_NAME)])
               if credentials else grpc.insecure_channel(target))
    with channel:
        return channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=20)


@pytest.mark.parametrize("service", ["history", "matching", "worker"])
@pytest.mark.parametrize("caller", CALLERS)
async def test_the_services_internal_grpc_admits_only_the_internode_certificate(
        tls_temporal, pki, service: str, caller: str) -> None:
    """Whoever reaches history's or matching's port and is admitted could poll any task queue,
    complete tasks with results of its own, signal or terminate any workflow: no authorizer
    stands behind these ports, only the internode certificate."""
    call = asyncio.to_thread(health_check, tls_temporal.ports[service], grpc_credentials(pki, caller))
    if caller == "the internode certificate":
        assert await call == b"\x08\x01"  # SERVING: refused callers differ only in their credentials
        return
    with pytest.raises(grpc.RpcError) as refused:
        await call
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value


def tchannel_init_request() -> bytes:
    """TChannel's first frame (init req, version 2), which ringpop's membership port answers with
    an init res (frame type 0x02) before any gossip."""
    headers = b"".join(struct.pack(">H", len(text)) + text
                       for pair in ((b"host_port", b"127.0.0.1:1"), (b"process_name", b"gpufleet-test"))
                       for text in pair)
    body = struct.pack(">HH", 2, 2) + headers
    return struct.pack(">HBBI8x", 16 + len(body), 0x01, 0, 1) + body


def membership_answer(port: int, pki: dict[str, Path], caller: str) -> bytes:
    """The first frame header the membership port at ``port`` answers an init req with (b"" when it
    refuses the caller: closes, or a TLS alert)."""
    context = None
    if caller != "plaintext":
        context = ssl.create_default_context(cafile=str(pki[INTERNODE_SECRET] / "ca.crt"))
        secret = presented(pki, caller)
        if secret is not None:
            context.load_cert_chain(secret / "tls.crt", secret / "tls.key")
    answer = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as raw:
            conn = context.wrap_socket(raw, server_hostname=INTERNODE_NAME) if context else raw
            conn.sendall(tchannel_init_request())
            while len(answer) < 16:
                received = conn.recv(16 - len(answer))
                if not received:
                    break
                answer += received
    except (ssl.SSLError, ConnectionError):
        return b""
    return answer


@pytest.mark.parametrize("service", ["frontend", "history", "matching", "worker"])
@pytest.mark.parametrize("caller", CALLERS)
async def test_the_services_membership_admits_only_the_internode_certificate(
        tls_temporal, pki, service: str, caller: str) -> None:
    """A stranger admitted to the ring (ringpop) could join it and be handed history shards."""
    answer = await asyncio.to_thread(membership_answer, tls_temporal.ports[f"{service}-membership"], pki, caller)
    is_init_response = answer[2:3] == b"\x02"
    assert is_init_response == (caller == "the internode certificate"), answer
