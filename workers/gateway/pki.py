"""The dev stack's and the tests' CA: its key, the signer of node CSRs, and the gateway's
server certificate. Production uses the cluster CA's signer (gpufleet's CSR approver).

The node agent never imports this module (pyproject.toml's import-linter contract): a
node makes its key and CSR with ``node_identity``; only a signer holds a CA key.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from providers.private_files import private_folder, write_private
from workers.gateway.node_identity import NODE_GROUP, NODE_PREFIX, node_key_and_csr, pem_private_key, subject_name


class Pki:
    """A CA (the dev stack's stand-in for the cluster CA), its signer and the gateway's server
    certificate. Kept under ``directory`` when given (``gpufleet dev``: ``<state>/pki``)."""

    def __init__(self, ca_key, ca_cert) -> None:
        self.ca_key, self.ca_cert = ca_key, ca_cert

    @classmethod
    def create(cls, name: str = "gpufleet dev node CA") -> "Pki":
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(subject_name(name)).issuer_name(subject_name(name))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=365))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    @classmethod
    def load_or_create(cls, directory: Path) -> "Pki":
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        ca_pem, key_pem = directory / "ca.pem", directory / "ca.key"
        if ca_pem.exists() and key_pem.exists():
            return cls(serialization.load_pem_private_key(key_pem.read_bytes(), None),
                       x509.load_pem_x509_certificate(ca_pem.read_bytes()))
        pki = cls.create()
        private_folder(directory)
        write_private(key_pem, pem_private_key(pki.ca_key))
        ca_pem.write_bytes(pki.ca_pem)
        return pki

    @property
    def ca_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self.ca_cert.public_bytes(serialization.Encoding.PEM)

    def _issue(self, subject, public_key, lifetime: dt.timedelta, usages: list, sans=None,
               not_before: dt.datetime | None = None) -> bytes:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization

        start = not_before or dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(self.ca_cert.subject)
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(start + lifetime)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(self.ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    def server_cert(self, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) for the gateway's listener."""
        from cryptography import x509

        return self.certificate("gpufleet node gateway", hosts, [x509.ExtendedKeyUsageOID.SERVER_AUTH])

    def certificate(self, common_name: str, hosts: tuple[str, ...], usages: list) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) for ``hosts`` (addresses or DNS names), valid a year for
        these extended key usages."""
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
        sans = []
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        cert = self._issue(subject_name(common_name), key.public_key(), dt.timedelta(days=365), usages, sans)
        return cert, pem_private_key(key)

    def sign_node_csr(self, csr_pem: bytes, node_name: str, lifetime: dt.timedelta = dt.timedelta(days=1),
                      not_before: dt.datetime | None = None) -> bytes:
        """The signer: a node certificate only for the name it was asked for (as the cluster's
        CSR approver checks a kubelet's CSR against the node it bootstrapped)."""
        from cryptography import x509

        csr = x509.load_pem_x509_csr(csr_pem)
        if not csr.is_signature_valid:
            raise ValueError("csr: bad signature")
        cns = [a.value for a in csr.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)]
        if cns != [f"{NODE_PREFIX}{node_name}"]:
            raise ValueError(f"csr: subject {cns} is not {NODE_PREFIX}{node_name}")
        return self._issue(subject_name(f"{NODE_PREFIX}{node_name}", NODE_GROUP), csr.public_key(), lifetime,
                           [x509.ExtendedKeyUsageOID.CLIENT_AUTH], not_before=not_before)

    def node_credentials(self, node_name: str, lifetime: dt.timedelta = dt.timedelta(days=1)) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM): the node's half (key, CSR) and the signer's, in one call."""
        key, csr = node_key_and_csr(node_name)
        return self.sign_node_csr(csr, node_name, lifetime), key


def dev_gateway_files(state_dir: Path) -> dict[str, Path]:
    """The dev stack's CA and gateway certificate, and the gateway's task-token key (the folder
    ``GPUFLEET_GATEWAY_TOKEN_KEYS`` names), made once under ``<state>/pki``: a restarted dev
    gateway takes the answers to tasks it delivered before."""
    pki_dir = private_folder(state_dir / "pki")
    pki = Pki.load_or_create(pki_dir)
    files = {"ca": pki_dir / "ca.pem", "ca_key": pki_dir / "ca.key",
             "cert": pki_dir / "gateway.pem", "key": pki_dir / "gateway.key",
             "token_keys": pki_dir / "token-keys"}
    if not files["cert"].exists() or not files["key"].exists():
        cert, key = pki.server_cert()
        write_private(files["key"], key)
        files["cert"].write_bytes(cert)
    current = private_folder(files["token_keys"]) / "current"
    if not current.exists():
        import secrets

        write_private(current, secrets.token_hex(32) + "\n")
    for secret in (files["ca_key"], files["key"], current):
        secret.chmod(0o600)  # kept from before (restored by ``cp``, say): its owner's only, whatever it was
    return files

