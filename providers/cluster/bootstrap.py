"""A machine's bootstrap document: cloud-init that writes a kubeadm JoinConfiguration.

Rendered from ``deploy/bootstrap/cloud-init.yaml`` inside the activity that creates the
machine (the token must be in it before the provider's own id exists) and handed to the
provider's user-data field. The rendered text carries the join token's secret: it is
never returned from an activity, logged or put in an exception. ``BootstrapToken`` and
``JoinParams`` hide the secret from ``repr`` so a stray log line or traceback shows none.

Also the machine's side (``read_join_configuration``): what kubeadm reads back out of
the user data, used by the simulated kubelet and the tests.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from string import Template
from typing import Any

import yaml

from fleet.cluster import FLEET_TAINT, UNPROVEN_TAINT, JoinTokenRef

#: Where the template lives in the repository (and in the control-plane image).
TEMPLATE_ENV = "GPUFLEET_BOOTSTRAP_TEMPLATE"
DEFAULT_TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "bootstrap" / "cloud-init.yaml"
#: Where the rendered document puts the JoinConfiguration on the machine.
JOIN_CONFIG_PATH = "/etc/gpufleet/join.yaml"
#: ... and the discovery kubeconfig it names (the API server's address and the cluster CA).
DISCOVERY_CONFIG_PATH = "/etc/gpufleet/discovery.conf"
#: The group every gpufleet join token carries (``auth-extra-groups``). It must match
#: ``system:bootstrappers:[a-z0-9:-]*``; deploy/bootstrap/rbac.yaml binds it to kubeadm's
#: join RBAC and to nothing that approves certificates: gpufleet approves its own.
BOOTSTRAP_GROUP = "system:bootstrappers:gpufleet:nodes"

TOKEN_ID = re.compile(r"^[a-z0-9]{6}$")
TOKEN = re.compile(r"^[a-z0-9]{6}\.[a-z0-9]{16}$")
#: What each template value may hold: nothing that could end a YAML scalar or a line.
PATTERNS = {
    "api_server": re.compile(r"^[A-Za-z0-9.\[\]:-]{1,253}$"),
    # The cluster CA, base64 of its PEM (as kubeconfigs carry it): at most a few certificates.
    "ca_data": re.compile(r"^[A-Za-z0-9+/]{1,16384}={0,2}$"),
    "token": TOKEN,
    "node_name": re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"),
    "provider_id": re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,511}$"),
}


class BootstrapError(ValueError):
    """A value that may not go into a bootstrap document (names the field, never its value)."""


@dataclass(frozen=True)
class BootstrapToken:
    """A join token as the cluster port hands it to the activity that renders user data."""

    token_id: str
    node_name: str
    expires_at: datetime
    secret: str = field(repr=False)

    @property
    def value(self) -> str:
        return f"{self.token_id}.{self.secret}"

    @property
    def ref(self) -> JoinTokenRef:
        return JoinTokenRef(token_id=self.token_id, node_name=self.node_name, expires_at=self.expires_at)


@dataclass(frozen=True)
class JoinParams:
    #: ``host:port`` the machine reaches the API server at, for discovery and everything after.
    api_server: str
    #: The cluster CA the machine trusts (base64 of the PEM, from ``cluster-info``).
    ca_data: str
    token: str = field(repr=False)
    node_name: str = ""
    provider_id: str = ""

    def checked(self) -> dict[str, str]:
        values = {name: getattr(self, name) for name in PATTERNS}
        for name, value in values.items():
            if not isinstance(value, str) or not PATTERNS[name].match(value):
                raise BootstrapError(f"bootstrap {name}: not a valid value for the join document")
        return values


def template_path() -> Path:
    return Path(os.environ.get(TEMPLATE_ENV) or DEFAULT_TEMPLATE)


def render_user_data(params: JoinParams, template: str | None = None) -> str:
    """The cloud-config for one machine."""
    text = template if template is not None else template_path().read_text()
    try:
        rendered = Template(text).substitute(params.checked())
    except (KeyError, ValueError) as error:
        raise BootstrapError(f"bootstrap template: {error.__class__.__name__} for {error}") from None
    # The document must read back as what it claims to be (a broken template fails here,
    # before any machine is bought with it).
    config = read_join_configuration(rendered)
    missing = [t for t in (UNPROVEN_TAINT, FLEET_TAINT) if t not in registration_taints(config)]
    if missing:  # a site's own template that lost them would put the control plane's pods in reach
        raise BootstrapError(f"bootstrap template: nodeRegistration.taints lacks {', '.join(missing)}")
    return rendered


def registration_taints(config: dict[str, Any]) -> list[str]:
    """``nodeRegistration.taints`` of a JoinConfiguration, as ``key[=value]:Effect``: what the
    kubelet registers the Node with."""
    taints = (config.get("nodeRegistration") or {}).get("taints") or []
    return [f"{t['key']}{'=' + t['value'] if t.get('value') else ''}:{t['effect']}"
            for t in taints if isinstance(t, dict) and t.get("key") and t.get("effect")]


def ca_cert_hash(ca_pem: bytes) -> str:
    """kubeadm's discovery hash: SHA-256 of the CA certificate's SubjectPublicKeyInfo."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    cert = x509.load_pem_x509_certificate(ca_pem)
    spki = cert.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(spki).hexdigest()


# -- the machine's side -----------------------------------------------------------------------
def decode_user_data(raw: str | bytes) -> str:
    """User data as a provider hands it back (AWS returns it base64-encoded)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    if text.startswith("#cloud-config"):
        return text
    try:
        decoded = base64.b64decode(text, validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return text
    return decoded if decoded.startswith("#cloud-config") else text


def _safe_load(text: str) -> Any:
    """``yaml.safe_load`` through libyaml where PyYAML has it: each join reads its user data
    back twice (once rendering it, once on the machine), and the pure-Python parser was the
    largest share of a join's CPU in ``bench.join_overhead``."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - a safe loader


def read_cloud_config(user_data: str | bytes) -> dict[str, Any]:
    text = decode_user_data(user_data)
    if not text.startswith("#cloud-config"):
        raise BootstrapError("user data: not a #cloud-config document")
    doc = _safe_load(text)
    if not isinstance(doc, dict):
        raise BootstrapError("user data: not a mapping")
    return doc


def _written(doc: dict[str, Any], path: str) -> Any:
    for entry in doc.get("write_files") or []:
        if isinstance(entry, dict) and entry.get("path") == path:
            return _safe_load(entry.get("content") or "")
    return None


def _join_configuration(doc: dict[str, Any]) -> dict[str, Any]:
    config = _written(doc, JOIN_CONFIG_PATH)
    if isinstance(config, dict) and config.get("kind") == "JoinConfiguration":
        return config
    raise BootstrapError(f"user data: no JoinConfiguration written to {JOIN_CONFIG_PATH}")


def read_join_configuration(user_data: str | bytes) -> dict[str, Any]:
    """The JoinConfiguration the user data writes for kubeadm."""
    return _join_configuration(read_cloud_config(user_data))


@dataclass(frozen=True)
class JoinDiscovery:
    """What kubeadm discovers the cluster from, as the user data gives it to the machine."""

    #: ``https://host:port``: discovery, the TLS bootstrap and the kubelet all use it.
    server: str
    ca_pem: bytes
    token: str = field(repr=False)


def join_token(config: dict[str, Any]) -> str:
    """The bootstrap token a JoinConfiguration authenticates with (file or token discovery)."""
    discovery = config.get("discovery") or {}
    return discovery.get("tlsBootstrapToken") or (discovery.get("bootstrapToken") or {}).get("token") or ""


def read_join_discovery(user_data: str | bytes) -> JoinDiscovery:
    """The discovery kubeconfig the JoinConfiguration names, read as kubeadm reads it."""
    doc = read_cloud_config(user_data)
    config = _join_configuration(doc)
    path = ((config.get("discovery") or {}).get("file") or {}).get("kubeConfigPath")
    kubeconfig = _written(doc, path) if path else None
    if not isinstance(kubeconfig, dict):
        raise BootstrapError(f"user data: no discovery kubeconfig written to {path or DISCOVERY_CONFIG_PATH}")
    cluster = ((kubeconfig.get("clusters") or [{}])[0] or {}).get("cluster") or {}
    return JoinDiscovery(server=cluster.get("server", ""),
                         ca_pem=base64.b64decode(cluster.get("certificate-authority-data") or ""),
                         token=join_token(config))


def kubelet_args(config: dict[str, Any]) -> dict[str, str]:
    """``nodeRegistration.kubeletExtraArgs`` (v1beta4: a list of ``{name, value}``) as a dict."""
    args = (config.get("nodeRegistration") or {}).get("kubeletExtraArgs") or []
    return {a["name"]: a["value"] for a in args if isinstance(a, dict) and "name" in a}
