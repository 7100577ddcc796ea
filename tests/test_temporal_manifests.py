"""The shipped control plane reaches Temporal over mutual TLS, as its manifest says (issue 35).

The control-plane worker is started as a process with exactly the environment and files its
rendered Deployment gives it (``kubectl kustomize deploy/kubernetes``, read here, not re-typed):
its ``env`` list, and each mounted volume as a folder at the same path under a scratch root
(the Secret ``gpufleet-temporal-client`` holds a certificate of a test CA). Only the frontend's
address differs: ``temporal-frontend.temporal.svc`` is cluster DNS, so it becomes a loopback
port where a TLS-terminating proxy sits in front of the dev server and asks for a client
certificate. The server name stays the manifest's. A proxy, not the real server's own TLS: these
tests run on the suite's dev server, in every tier, without the built server; the real server
serving deploy/temporal/values.yaml's mutual TLS to this same manifest env is
tests/realtemporal/test_tls.py.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

from tests.conftest import TEST_FLEET
from tests.test_deploy import ROOT, rendered, workloads
from tests.test_temporal_tls import _cert, _name, start_tls_proxy

SECRET = "gpufleet-temporal-client"
#: The workloads that talk to Temporal with the control plane's credentials.
TEMPORAL_CLIENTS = ("gpufleet-control-plane", "gpufleet-node-gateway")


def pod_spec(name: str) -> dict:
    return workloads(rendered())[name]["spec"]["template"]["spec"]


def secret_mount(pod: dict, container: dict) -> str:
    (volume,) = [v["name"] for v in pod["volumes"] if (v.get("secret") or {}).get("secretName") == SECRET]
    (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume]
    return mount


@pytest.mark.parametrize("workload", TEMPORAL_CLIENTS)
def test_every_temporal_client_of_the_control_plane_uses_mutual_tls_from_its_secret(workload: str) -> None:
    pod = pod_spec(workload)
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mount = secret_mount(pod, container)
    # No plaintext fallback: the client certificate, its key and the frontend's CA all come
    # from the Secret, and nothing turns TLS off or hands over an API key in plain text.
    for variable, key in (("TEMPORAL_TLS_CLIENT_CERT_PATH", "tls.crt"), ("TEMPORAL_TLS_CLIENT_KEY_PATH", "tls.key"),
                          ("TEMPORAL_TLS_SERVER_CA_CERT_PATH", "ca.crt")):
        assert env[variable] == f"{mount}/{key}", (workload, variable)
    assert env["TEMPORAL_TLS_SERVER_NAME"] == env["TEMPORAL_ADDRESS"].rsplit(":", 1)[0]
    assert "TEMPORAL_TLS" not in env and "TEMPORAL_API_KEY" not in env
    volume = next(v for v in pod["volumes"] if (v.get("secret") or {}).get("secretName") == SECRET)
    assert not volume["secret"].get("optional"), "without the Secret the pod must not start"


def new_ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    return key, _cert(common_name, key, key, _name(common_name), ca=True)


def tls_secret(folder: Path, ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], who: str,
               san: list[x509.GeneralName], usage) -> Path:
    """A TLS Secret's files as cert-manager or ``kubectl create secret`` write them: ``tls.crt``
    (a certificate for ``who`` that ``ca`` signed), ``tls.key``, ``ca.crt``."""
    ca_key, ca_cert = ca
    folder.mkdir(parents=True)
    key = ec.generate_private_key(ec.SECP256R1())
    (folder / "tls.crt").write_bytes(_cert(who, key, ca_key, ca_cert.subject, san=san, usage=usage)
                                     .public_bytes(serialization.Encoding.PEM))
    (folder / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    (folder / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return folder


def control_plane_secret(folder: Path, ca) -> Path:
    """``gpufleet-temporal-client``'s files: the control plane's client certificate of ``ca``."""
    return tls_secret(folder, ca, "gpufleet-control-plane", [x509.DNSName("gpufleet-control-plane")],
                      ExtendedKeyUsageOID.CLIENT_AUTH)


def frontend_pki(root: Path, server_name: str) -> tuple[dict[str, Path], Path]:
    """A CA with a server certificate for the manifest's server name (and loopback), and the
    Secret's three files: the control plane's client certificate, its key, the CA."""
    ca = new_ca("temporal test CA")
    secret = control_plane_secret(root / "secret", ca)
    server = tls_secret(root / "server", ca, "server",
                        [x509.DNSName(server_name), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
                        ExtendedKeyUsageOID.SERVER_AUTH)
    return {"ca": secret / "ca.crt", "server": server / "tls.crt", "server_key": server / "tls.key"}, secret


def as_its_manifest_starts_it(pod: dict, root: Path, files: dict[str, dict[str, bytes]],
                              address: str) -> tuple[list[str], dict[str, str]]:
    """The container's command and environment, each mounted volume a folder under ``root``
    holding ``files[volume]``; only TEMPORAL_ADDRESS is replaced (cluster DNS)."""
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    for volume, path in mounts.items():
        folder = root / path.lstrip("/")
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.get(volume, {}).items():
            (folder / name).write_bytes(data)

    def relocated(value: str) -> str:
        return str(root / value.lstrip("/")) if any(value.startswith(p + "/") for p in mounts.values()) else value

    env = {e["name"]: relocated(e["value"]) for e in container["env"]}
    env["TEMPORAL_ADDRESS"] = address
    # Nothing of this machine's: no TEMPORAL_* of the test's, no ~/.config/temporal.
    env.update(PATH=os.environ["PATH"], HOME=str(root), TEMPORAL_CONFIG_FILE=str(root / "absent.toml"))
    command = [sys.executable if part == "python" else part for part in container["command"]]
    return command, env


async def pollers(client, task_queue: str) -> list[str]:
    answer = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
        namespace="default", task_queue=TaskQueue(name=task_queue)))
    return [p.identity for p in answer.pollers]


@pytest.mark.integration
async def test_the_control_plane_started_from_its_manifest_polls_temporal_over_mutual_tls(temporal_env, tmp_path):
    pod = pod_spec("gpufleet-control-plane")
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    pki, secret = frontend_pki(tmp_path, env["TEMPORAL_TLS_SERVER_NAME"])
    upstream = temporal_env.client.service_client.config.target_host
    server, port = await start_tls_proxy(pki, upstream)
    files = {
        "temporal-client": {name: (secret / name).read_bytes() for name in ("tls.crt", "tls.key", "ca.crt")},
        "config": {"sites.yaml": yaml.safe_dump(TEST_FLEET).encode()},
    }
    root = tmp_path / "pod"
    command, process_env = as_its_manifest_starts_it(pod, root, files, f"127.0.0.1:{port}")
    log = tmp_path / "control-plane.log"
    worker = subprocess.Popen(command, env=process_env, cwd=root, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        mine = f"{worker.pid}@"
        while not any(p.startswith(mine) for p in await pollers(temporal_env.client, env["GPUFLEET_TASK_QUEUE"])):
            assert worker.poll() is None, f"the worker exited {worker.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no poll from the worker within 90 s:\n{log.read_text()[-3000:]}"
            await asyncio.sleep(0.5)
    finally:
        worker.terminate()  # as the kubelet stops a pod; the proxy runs on this loop, so wait off it
        assert await asyncio.to_thread(worker.wait, 30) == 0, log.read_text()[-3000:]
        server.close()


@pytest.mark.integration
async def test_a_control_plane_whose_certificate_the_frontend_does_not_trust_never_reaches_it(temporal_env, tmp_path):
    """The same start with the Secret's certificate from another CA: the TLS handshake fails,
    and the worker exits saying it could not connect (the proxy is what a frontend with mTLS does)."""
    pod = pod_spec("gpufleet-control-plane")
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    for folder in ("frontend", "stranger"):
        (tmp_path / folder).mkdir()
    pki, _ = frontend_pki(tmp_path / "frontend", env["TEMPORAL_TLS_SERVER_NAME"])
    _, stranger = frontend_pki(tmp_path / "stranger", env["TEMPORAL_TLS_SERVER_NAME"])
    # The frontend's CA is trusted (so the worker gets as far as the handshake); its client
    # certificate is not the frontend's to accept.
    files = {"temporal-client": {"tls.crt": (stranger / "tls.crt").read_bytes(),
                                 "tls.key": (stranger / "tls.key").read_bytes(), "ca.crt": pki["ca"].read_bytes()},
             "config": {"sites.yaml": yaml.safe_dump(TEST_FLEET).encode()}}
    server, port = await start_tls_proxy(pki, temporal_env.client.service_client.config.target_host)
    root = tmp_path / "pod"
    command, process_env = as_its_manifest_starts_it(pod, root, files, f"127.0.0.1:{port}")
    try:
        done = await asyncio.to_thread(subprocess.run, command, env=process_env, cwd=root, capture_output=True,
                                       text=True, timeout=120)
    finally:
        server.close()
    assert done.returncode != 0, done.stdout + done.stderr
    assert "connect" in (done.stdout + done.stderr).lower(), done.stdout[-2000:] + done.stderr[-2000:]


NETWORK_POLICY = ROOT / "deploy" / "temporal" / "network-policy.yaml"
#: The pods of Temporal's Helm chart (1.6.0, the version values.yaml installs), by
#: app.kubernetes.io/component, with the ports each one opens (gRPC, membership, HTTP, metrics):
#: the server's services, then its admin tools, web UI and jobs (component `database`).
SERVER_PORTS = {"frontend": (7233, 6933, 7243, 9090), "internal-frontend": (7236, 6936, 7246, 9090),
                "history": (7234, 6934, 9090), "matching": (7235, 6935, 9090), "worker": (7239, 6939, 9090)}
TEMPORAL_TOOLS = ("admintools", "web", "database")


def chart_pod_labels(component: str) -> dict[str, str]:
    """The labels chart 1.6.0 puts on a pod of ``component`` (its templates' ``temporal.resourceLabels``,
    release `temporal`; `helm template` of values.yaml renders exactly these, deploy/temporal/README.md)."""
    return {"app.kubernetes.io/component": component, "app.kubernetes.io/name": "temporal",
            "helm.sh/chart": "temporal-1.6.0", "app.kubernetes.io/managed-by": "Helm",
            "app.kubernetes.io/instance": "temporal", "app.kubernetes.io/version": "1.31.2",
            "app.kubernetes.io/part-of": "temporal"}


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector's verdict on ``labels``."""
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        if not {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[operator]:
            return False
    return True


def ingress_admits(policies: list[dict], namespace: str, labels: dict[str, str], port: int,
                   source: tuple[str, dict[str, str]] | None) -> bool:
    """Whether ``policies`` let ``source`` (namespace, pod labels; None: a host, no pod's address)
    reach ``port`` of a pod with ``labels`` in ``namespace``, as a CNI enforcing them decides."""
    selecting = [p for p in policies if p["metadata"]["namespace"] == namespace
                 and "Ingress" in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], labels)]
    if not selecting:
        return True  # a pod no policy selects takes anything
    for rule in (r for p in selecting for r in p["spec"].get("ingress") or []):
        assert all(isinstance(p["port"], int) and "endPort" not in p for p in rule.get("ports") or []), rule
        if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
            continue
        for peer in rule.get("from") or [{"ipBlock": {"cidr": "0.0.0.0/0"}}]:  # no `from`: from anywhere
            if "ipBlock" in peer:
                return True  # an address range: a GPU node's hosts and pods are somewhere in it
            if source is None:
                continue
            source_namespace, source_labels = source
            namespace_ok = (selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": source_namespace})
                            if "namespaceSelector" in peer else source_namespace == namespace)
            if namespace_ok and selects(peer.get("podSelector") or {}, source_labels):
                return True
    return False


@pytest.mark.integration  # kubectl kustomize, for gpufleet's pods
def test_every_temporal_service_takes_calls_only_from_temporals_services_and_the_frontends_clients() -> None:
    """History, matching and the worker service answer anyone who reaches them, unauthorized: a
    pod or a host of a GPU node that did could poll the control plane's queues and complete its
    tasks. Every port of every service is for the other services only; the frontend's gRPC port
    also for Temporal's tools (web UI, admin tools, jobs) and gpufleet's control plane and gateway."""
    policies = [d for d in yaml.safe_load_all(NETWORK_POLICY.read_text()) if d]
    assert {p["kind"] for p in policies} == {"NetworkPolicy"}
    temporal = {component: ("temporal", chart_pod_labels(component)) for component in [*SERVER_PORTS, *TEMPORAL_TOOLS]}
    gpufleet = {name: (w["metadata"]["namespace"], w["spec"]["template"]["metadata"]["labels"])
                for name, w in workloads(rendered()).items()}
    assert "gpufleet-node-agent" in gpufleet  # a GPU node's own pod
    sources = {**temporal, **gpufleet, "a GPU node's host": None}
    wrong = {}  # (component, port): (admitted but should not be, refused but should not be)
    for component, ports in SERVER_PORTS.items():
        for port in ports:
            admitted = {name for name, source in sources.items()
                        if ingress_admits(policies, "temporal", chart_pod_labels(component), port, source)}
            expected = set(SERVER_PORTS)
            if (component, port) == ("frontend", 7233):
                expected |= {*TEMPORAL_TOOLS, "gpufleet-control-plane", "gpufleet-node-gateway"}
            if admitted != expected:
                wrong[(component, port)] = (sorted(admitted - expected), sorted(expected - admitted))
    assert not wrong, wrong
