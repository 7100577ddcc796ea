"""Temporal over mutual TLS, configured only through Temporal's standard environment
variables: a test CA (``cryptography``) signs a server and a client certificate, and a
TLS-terminating proxy sits in front of the dev server (``start-dev`` serves no TLS of its own).
What is under test is the client side, in the unit tier's speed and without the built server;
the real server serving the shipped mutual TLS is tests/realtemporal/test_tls.py."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleet.settings import Settings
from fleet.temporal import connect

TLS_VARS = ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "TEMPORAL_API_KEY", "TEMPORAL_PROFILE", "TEMPORAL_CONFIG_FILE",
            "TEMPORAL_TLS", "TEMPORAL_TLS_SERVER_CA_CERT_PATH", "TEMPORAL_TLS_CLIENT_CERT_PATH",
            "TEMPORAL_TLS_CLIENT_KEY_PATH", "TEMPORAL_TLS_SERVER_NAME")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer_key, issuer: x509.Name, *, ca: bool = False, san=None, usage=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage if isinstance(usage, list) else [usage]),
                                        critical=False)
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(tmp: Path) -> dict[str, Path]:
    """A CA, a server certificate for localhost and a client certificate, as PEM files."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("gpufleet test CA", ca_key, ca_key, _name("gpufleet test CA"), ca=True)
    paths = {"ca": tmp / "ca.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for who, san, usage in (
        ("server", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
         ExtendedKeyUsageOID.SERVER_AUTH),
        ("client", [x509.DNSName("gpufleet-worker")], ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(who if who == "client" else "localhost", key, ca_key, ca.subject, san=san, usage=usage)
        paths[who] = tmp / f"{who}.pem"
        paths[who].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{who}_key"] = tmp / f"{who}.key"
        paths[f"{who}_key"].write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths


async def start_tls_proxy(pki: dict[str, Path], upstream: str) -> tuple[asyncio.base_events.Server, int]:
    """Terminate mutual TLS (HTTP/2 by ALPN, as gRPC wants) and pipe the bytes to the dev server."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki["ca"]))
    context.load_cert_chain(pki["server"], pki["server_key"])
    context.verify_mode = ssl.CERT_REQUIRED  # mTLS: no client certificate, no connection
    context.set_alpn_protocols(["h2"])
    host, port = upstream.rsplit(":", 1)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(client_reader, client_writer) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    return server, server.sockets[0].getsockname()[1]


@pytest.fixture
async def tls_env(temporal_env, tmp_path: Path, monkeypatch):
    for name in TLS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(tmp_path / "absent.toml"))  # no ~/.config/temporal here
    pki = make_pki(tmp_path)
    server, port = await start_tls_proxy(pki, temporal_env.client.service_client.config.target_host)
    env = {"TEMPORAL_ADDRESS": f"localhost:{port}", "TEMPORAL_NAMESPACE": "default",
           "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(pki["ca"]), "TEMPORAL_TLS_SERVER_NAME": "localhost",
           "TEMPORAL_TLS_CLIENT_CERT_PATH": str(pki["client"]), "TEMPORAL_TLS_CLIENT_KEY_PATH": str(pki["client_key"])}
    try:
        yield env, monkeypatch
    finally:
        server.close()


async def test_a_client_configured_only_by_the_standard_variables_connects_over_mtls(tls_env) -> None:
    env, monkeypatch = tls_env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings.from_env()
    assert settings.address == env["TEMPORAL_ADDRESS"]
    client = await connect(settings)
    assert (await client.count_workflows()).count >= 0
    # The CLI, a separate process, the same way (its own --address default yields to the variable).
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cli", "search-attributes"],
                                   env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "registered" in done.stdout


async def test_the_proxy_refuses_a_client_without_its_certificate(tls_env) -> None:
    env, monkeypatch = tls_env
    for name, value in env.items():
        if "CLIENT" not in name:
            monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(connect(Settings.from_env()), 30)


#: temporal.toml files that do not load, each holding a secret on the line the parser stops at (or
#: as the value it refuses): a quote left open, a key given twice while rotating, a number where a
#: string goes, a key put where a table goes.
BROKEN_TOML = {
    "open quote": ('api_key = "{secret}\n', 3, "invalid basic string"),
    "given twice": ('api_key = "sk-old"\napi_key = "{secret}"\n', 4, "duplicate key"),
    "a number": ("api_key = {number}\n", 3, "invalid type: integer, expected a string"),
    "key as the tls table": ('tls = "{secret}"\n', 3, "invalid type: string, expected struct"),
    "metadata": ('[profile.default.grpc_meta]\nauthorization = "Bearer {secret}\x01"\n', 4, "invalid basic string"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_TOML))
def test_a_temporal_toml_that_does_not_load_is_named_without_quoting_its_secrets(case, tmp_path, monkeypatch) -> None:
    """Every worker and CLI command reads temporal.toml first (Settings.from_env, the gateway's
    upstream channel). The TOML parser's error quotes the line it stopped at, and the value it
    refused: the API key, a TLS key's line, an authorization header, in the worker's log and the
    operator's terminal. The error names the line and the reason, never the text."""
    for name in TLS_VARS:
        monkeypatch.delenv(name, raising=False)
    secret, number = "sk-" + os.urandom(8).hex(), "7" + "".join(str(b % 10) for b in os.urandom(12))
    body, line, reason = BROKEN_TOML[case]
    path = tmp_path / "temporal.toml"
    path.write_text('[profile.default]\naddress = "localhost:7233"\n' + body.format(secret=secret, number=number))
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(path))
    with pytest.raises(ValueError) as raised:
        Settings.from_env()
    message = str(raised.value)
    assert secret not in message and number not in message, message
    assert f"line {line}" in message and reason in message, message
