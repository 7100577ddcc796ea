"""A machine's bootstrap document: cloud-init that writes a kubeadm JoinConfiguration.

Rendered from ``deploy/bootstrap/cloud-init.yaml`` inside the activity that creates the
machine (the token must be in it before the provider's own id exists) and handed to the
provider's user-data field. The rendered text carries the join token's secret: it is
never returned from an activity, logged or put in an exception. ``BootstrapToken`` and
``JoinParams`` hide the secret from ``repr`` so a stray log line or traceback shows none.

The document carries the install step too (``deploy/bootstrap/install-node.sh`` with the
pins of ``deploy/bootstrap/node-install.yaml``): on a machine whose image lacks kubelet,
kubeadm or a CRI-enabled containerd it fetches them, each checked against its pinned sha256,
before ``kubeadm join`` runs; on a prepared image it changes nothing.

Also the machine's side (``read_join_configuration``): what kubeadm reads back out of
the user data, used by the simulated kubelet and the tests.
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
import string
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from string import Template
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleet.cluster import FLEET_TAINT, MAX_JOIN_TOKEN_TTL_S, UNPROVEN_TAINT, JoinTokenRef
from fleet.naming import MAX_SITE_NAME, SITE_NAME_PATTERN
from fleet.settings import ControlPlaneEnv

#: Where the template lives in the repository (and in the control-plane image).
TEMPLATE_ENV = ControlPlaneEnv.variable("bootstrap_template")
DEFAULT_TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "bootstrap" / "cloud-init.yaml"
#: The install step's script and its pins (versions, sha256 sums), in the repository.
INSTALL_SCRIPT = DEFAULT_TEMPLATE.parent / "install-node.sh"
NODE_INSTALL_ENV = ControlPlaneEnv.variable("node_install")
DEFAULT_NODE_INSTALL = DEFAULT_TEMPLATE.parent / "node-install.yaml"
#: Where the rendered document puts the install step on the machine.
INSTALL_SCRIPT_PATH = "/etc/gpufleet/install-node.sh"
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
    # The site the machine joins: a lowercase DNS label (fleet.naming), so a label value too.
    "site": re.compile(rf"(?=.{{1,{MAX_SITE_NAME}}}$){SITE_NAME_PATTERN}"),
}


def check_join_ttl(ttl_seconds: int) -> None:
    """A join token lives at most ``MAX_JOIN_TOKEN_TTL_S``: a machine that boots later needs a new one."""
    if not 0 < ttl_seconds <= MAX_JOIN_TOKEN_TTL_S:
        raise ValueError(f"join token TTL must be within (0, {MAX_JOIN_TOKEN_TTL_S}] seconds")


def new_token_parts() -> tuple[str, str]:
    """A new bootstrap token's id and secret, in kubeadm's shape: ``[a-z0-9]{6}.[a-z0-9]{16}``."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(6)), "".join(secrets.choice(alphabet) for _ in range(16))


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
    #: The site the machine joins: its kubelet registers the Node in that topology zone
    #: (``--node-labels=topology.kubernetes.io/zone=<site>``; NodeRestriction lets a kubelet set it).
    site: str = ""

    def checked(self) -> dict[str, str]:
        values = {name: getattr(self, name) for name in PATTERNS}
        for name, value in values.items():
            if not isinstance(value, str) or not PATTERNS[name].fullmatch(value):
                raise BootstrapError(f"bootstrap {name}: not a valid value for the join document")
        return values


_SHA256 = r"^([0-9a-f]{64})?$"
_RELEASE = r"^[0-9]{1,4}\.[0-9]{1,4}\.[0-9]{1,4}$"
ARCHITECTURES = ("amd64", "arm64")


class _Pins(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PinnedVersions(_Pins):
    kubernetes: str = Field(pattern=r"^v[0-9]{1,4}\.[0-9]{1,4}\.[0-9]{1,4}$")
    containerd: str = Field(pattern=_RELEASE)
    runc: str = Field(pattern=_RELEASE)
    nvidia_container_toolkit: str = Field(pattern=_RELEASE)


class PinnedSums(_Pins):
    """The sha256 of each download for one architecture; empty: not pinned (a machine that
    lacks the part stops before ``kubeadm join``)."""

    kubelet: str = Field("", pattern=_SHA256)
    kubeadm: str = Field("", pattern=_SHA256)
    containerd: str = Field("", pattern=_SHA256)
    runc: str = Field("", pattern=_SHA256)
    nvidia_container_toolkit: str = Field("", pattern=_SHA256)


class NodeInstall(_Pins):
    """``deploy/bootstrap/node-install.yaml``: what the install step may fetch."""

    versions: PinnedVersions
    sha256: dict[str, PinnedSums] = Field(default_factory=dict)

    def shell_pins(self) -> str:
        """The pins as the shell assignments install-node.sh reads (every value matched a
        pattern of digits, dots and hex: nothing to quote)."""
        lines = [f"{name.upper()}_VERSION={value}" for name, value in self.versions.model_dump().items()]
        for arch in ARCHITECTURES:
            sums = self.sha256.get(arch) or PinnedSums()
            lines += [f"SHA256_{arch}_{part}={value}" for part, value in sums.model_dump().items()]
        return "\n".join(lines)

    def unpinned(self, arch: str = "amd64") -> list[str]:
        """The parts a machine of ``arch`` cannot install (no sha256 pinned)."""
        sums = self.sha256.get(arch) or PinnedSums()
        return [part for part, value in sums.model_dump().items() if not value]


def node_install_path() -> Path:
    return ControlPlaneEnv.get("node_install") or DEFAULT_NODE_INSTALL


_loaded: dict[tuple[str, int], NodeInstall] = {}


def load_node_install(path: Path | None = None) -> NodeInstall:
    """The pins file (read again only when it changes: every join renders a document)."""
    path = path or node_install_path()
    try:
        key = (str(path), path.stat().st_mtime_ns)
    except OSError as error:
        raise BootstrapError(f"node install pins {path}: cannot read ({error.strerror})") from None
    if key not in _loaded:
        try:
            _loaded[key] = NodeInstall.model_validate(yaml.safe_load(path.read_text()))
        except ValidationError as error:
            where = ", ".join(".".join(map(str, e["loc"])) for e in error.errors())
            raise BootstrapError(f"node install pins {path}: invalid {where}") from None
        except yaml.YAMLError:
            raise BootstrapError(f"node install pins {path}: not valid YAML") from None
    return _loaded[key]


def install_script(install: NodeInstall) -> str:
    """install-node.sh with the pins put in after its first line, without its comment lines
    (AWS takes 16 KB of user data; the script's heredocs hold no line starting with ``#``)."""
    shebang, code = _script_code()
    return f"{shebang}\n# gpufleet's install step: deploy/bootstrap/install-node.sh\n{install.shell_pins()}\n{code}\n"


_scripts: dict[int, tuple[str, str]] = {}


def _script_code() -> tuple[str, str]:
    """install-node.sh's first line and its code without comment lines (read again only when
    the file changes: every join renders a document)."""
    key = INSTALL_SCRIPT.stat().st_mtime_ns
    if key not in _scripts:
        shebang, _, body = INSTALL_SCRIPT.read_text().partition("\n")
        _scripts.clear()
        _scripts[key] = shebang, "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("#"))
    return _scripts[key]


def template_path() -> Path:
    return ControlPlaneEnv.get("bootstrap_template") or DEFAULT_TEMPLATE


def _block(text: str, indent: str) -> str:
    """``text`` as the lines of a YAML block scalar whose first line the template indents."""
    return text.rstrip("\n").replace("\n", "\n" + indent)


def render_user_data(params: JoinParams, template: str | None = None, install: NodeInstall | None = None) -> str:
    """The cloud-config for one machine."""
    text = template if template is not None else template_path().read_text()
    values = params.checked()
    if "${install_script}" in text:  # a site's own template may leave the install step out
        indent = re.search(r"^([ ]*)\$\{install_script\}", text, re.MULTILINE)
        values["install_script"] = _block(install_script(install or load_node_install()),
                                          indent.group(1) if indent else "")
    try:
        rendered = Template(text).substitute(values)
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


def written_file(doc: dict[str, Any], path: str) -> str | None:
    """The content the document's ``write_files`` writes to ``path``."""
    for entry in doc.get("write_files") or []:
        if isinstance(entry, dict) and entry.get("path") == path:
            return entry.get("content") or ""
    return None


def _written(doc: dict[str, Any], path: str) -> Any:
    content = written_file(doc, path)
    return None if content is None else _safe_load(content)


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
