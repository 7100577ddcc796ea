"""What a node holds and shows the gateway: its certificate's subject (the kubelet's shape),
its key and the CSR that asks for its certificate (both made on the node: the key never
leaves it), and where the gateway is (``GatewayAccess``).

The node agent imports this module and no other part of the gateway: nothing here signs,
holds a CA, or decides what a node may do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from fleet.settings import NodeAgentEnv, SettingsError

#: Subject of a node certificate: kubelet's ``system:node:<name>`` in group ``system:nodes``.
NODE_PREFIX = "system:node:"
NODE_GROUP = "system:nodes"
_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")


def node_from_subject(common_name: str) -> str | None:
    if not common_name.startswith(NODE_PREFIX):
        return None
    name = common_name.removeprefix(NODE_PREFIX)
    return name if _NAME.fullmatch(name) else None


def subject_name(cn: str, org: str | None = None):
    """An X.509 name: ``O=org, CN=cn``."""
    from cryptography import x509

    attrs = [x509.NameAttribute(x509.NameOID.COMMON_NAME, cn)]
    if org:
        attrs.insert(0, x509.NameAttribute(x509.NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def pem_private_key(key) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM."""
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def node_key_and_csr(node_name: str) -> tuple[bytes, bytes]:
    """Made on the node: a fresh key (never leaves the node) and the CSR that asks for its
    certificate. Returns (key PEM, CSR PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    csr = x509.CertificateSigningRequestBuilder().subject_name(
        subject_name(f"{NODE_PREFIX}{node_name}", NODE_GROUP)).sign(key, hashes.SHA256())
    return pem_private_key(key), csr.public_bytes(serialization.Encoding.PEM)


@dataclass
class GatewayAccess:
    """What a node agent needs to reach the gateway: its address and the CA that signed the
    gateway's certificate. Its own certificate comes from a ``CertSource``."""

    address: str
    ca: bytes
    server_name: str = "localhost"

    def env(self, ca_path: Path) -> dict[str, str]:
        return {NodeAgentEnv.variable("gateway"): self.address,
                NodeAgentEnv.variable("gateway_ca"): str(ca_path)}

    @classmethod
    def from_env(cls) -> "GatewayAccess | None":
        settings = NodeAgentEnv.from_env()
        if not settings.gateway:
            return None
        if settings.gateway_ca is None:
            raise SettingsError(f"{NodeAgentEnv.variable('gateway_ca')}: required with "
                                f"{NodeAgentEnv.variable('gateway')} (the CA that signed the gateway's certificate)")
        return cls(settings.gateway, settings.gateway_ca.read_bytes(), settings.gateway_server_name)

