"""How a machine joins: the bootstrap token it joins with, the bootstrap channel that hands one
to it, and the API endpoint and CA it is given (its CSRs are judged in ``csrs``).

Join tokens: a bootstrap token Secret ``kube-system/bootstrap-token-<id>``
(type ``bootstrap.kubernetes.io/token``, ``expiration`` at most one hour
away, usable for authentication and signing, extra group
``system:bootstrappers:gpufleet:nodes`` (``BOOTSTRAP_GROUP``), which
deploy/bootstrap/rbac.yaml binds to kubeadm's join RBAC and to no
auto-approval), annotated with the node name it was issued for and the join
that issued it. The control plane never reads kube-system Secrets back (its
RBAC cannot): each token has a record (control-plane state ``join-token``:
node, join, expiry, never the secret) written before its Secret, which the CSR
approver, revocation and a retried join read; a retried activity reuses its
token, whose secret is derived again (HMAC of the token id and the join with
the control plane's key, ``JOIN_TOKEN_KEY_SECRET``). A bootstrap token's
secret necessarily sits in plain form in its Secret: the API server
authenticates with it. It goes into the machine's user data
(``providers.cluster.bootstrap``) and nowhere else.

The bootstrap channel (joins started before the bootstrap went into the
user data, ``create_join_token``): the full token reaches the machine only
through the Secret ``gpufleet-bootstrap/gpufleet-bootstrap-<machine>``
(``bootstrap_secret_name``; keys ``token``, ``node-name``, ``expiration``,
label ``gpufleet.io/token-id``). The machine's bootstrap fetch, the one thing
that can prove it is that machine (a provider user-data step, or an endpoint
that checks the provider's instance identity), calls ``take_bootstrap_token``
once: it reads the Secret and deletes it under a resourceVersion
precondition, so a second reader gets nothing. Workflows only ever hold the
``JoinTokenRef``. ``revoke_join_token`` deletes both Secrets (404 = done);
the join workflow revokes as soon as the node registered (kubelet then holds
its own certificate) or the join failed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import string
import time
from datetime import datetime, timezone
from typing import Any

from fleet.cluster import ANNOTATION_MACHINE_ID, JoinTokenRef
from fleet.errors import ClusterConflict, ClusterInvalid, NotFound
from providers.cluster.bootstrap import BOOTSTRAP_GROUP, BootstrapToken, ca_cert_hash, check_join_ttl, new_token_parts
from providers.cluster.kubernetes.api import _Conflict
from providers.cluster.kubernetes.state import ControlPlaneState

TOKEN_NAMESPACE = "kube-system"
LABEL_TOKEN_ID = "gpufleet.io/token-id"
ANNOTATION_NODE_NAME = "gpufleet.io/node-name"
#: kubeadm's default bootstrap group: bound to auto-approval of node client certificates
#: for any node name, so gpufleet's tokens never carry it (they carry ``BOOTSTRAP_GROUP``).
JOIN_GROUP = "system:bootstrappers:kubeadm:default-node-token"
LABEL_JOIN_KEY = "gpufleet.io/join-key"
ANNOTATION_JOIN = "gpufleet.io/join"
#: Control-plane state (ConfigMaps in the adapter's namespace) recording each join token gpufleet
#: issued, keyed by token id: the node it is for, the join that asked, its expiry. Never its
#: secret. What the CSR approver, a retried join and revocation read, so the control plane
#: reads no Secret in kube-system (kubeadm's tokens, other controllers' credentials).
JOIN_TOKEN_KIND = "join-token"
#: The key a retried join's token secret is derived from (HMAC of the token id and the join),
#: so the secret is never read back: in the bootstrap namespace, which only the control plane
#: reads; created by the first join that needs it.
JOIN_TOKEN_KEY_SECRET = "gpufleet-join-token-key"

_TOKEN_ID = re.compile(r"^[a-z0-9]{6}$")


def _name_part(value: str) -> str:
    return re.sub(r"[^a-z0-9.-]+", "-", value.lower()).strip("-.") or "x"


def bootstrap_secret_name(machine_id: str) -> str:
    """The bootstrap channel Secret of a machine (what its bootstrap fetch reads)."""
    return f"gpufleet-bootstrap-{_name_part(machine_id)}"[:253]


def _bootstrap_token_body(token_id: str, token_secret: str, expiration: str, description: str,
                          labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
    """A bootstrap token Secret of gpufleet's: its extra group is ``BOOTSTRAP_GROUP``, never
    kubeadm's auto-approved ``JOIN_GROUP``."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": f"bootstrap-token-{token_id}",
            "namespace": TOKEN_NAMESPACE,
            "labels": {LABEL_TOKEN_ID: token_id, **labels, "app.kubernetes.io/managed-by": "gpufleet"},
            "annotations": annotations,
        },
        "type": "bootstrap.kubernetes.io/token",
        "stringData": {
            "description": description,
            "token-id": token_id,
            "token-secret": token_secret,
            "expiration": expiration,
            "usage-bootstrap-authentication": "true",
            "usage-bootstrap-signing": "true",
            "auth-extra-groups": BOOTSTRAP_GROUP,
        },
    }


def _digest(value: str) -> str:
    """A label value standing for ``value`` (join ids hold ``/`` and may be long)."""
    return hashlib.sha256(value.encode()).hexdigest()[:40]


def _expiry(value: str) -> datetime | None:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _token_secret(key: bytes, token_id: str, join_key: str, node_name: str) -> str:
    """A bootstrap token's 16-character secret, derived from the control plane's key: a retried
    join renders the same token without reading its Secret back."""
    digest = hmac.new(key, f"{token_id}\0{join_key}\0{node_name}".encode(), hashlib.sha256).digest()
    number, alphabet, out = int.from_bytes(digest, "big"), string.ascii_lowercase + string.digits, []
    for _ in range(16):
        number, index = divmod(number, len(alphabet))
        out.append(alphabet[index])
    return "".join(out)


class JoinTokens(ControlPlaneState):
    """Join tokens and their records, the bootstrap channel, the join's API endpoint."""

    # -- join tokens ----------------------------------------------------------------------
    def create_join_token(self, node_name: str, machine_id: str, ttl_seconds: int) -> JoinTokenRef:
        check_join_ttl(ttl_seconds)
        token_id, token_secret = new_token_parts()
        # Whole seconds, rounded down: never later than asked.
        expires_at = datetime.fromtimestamp(int(time.time()) + ttl_seconds, timezone.utc)
        expiration = expires_at.strftime("%Y-%m-%dT%H:%M:%SZ")
        annotations = {ANNOTATION_NODE_NAME: node_name, ANNOTATION_MACHINE_ID: machine_id}
        token = _bootstrap_token_body(token_id, token_secret, expiration, f"gpufleet join of {node_name}",
                                      {}, annotations)
        self._record_token(token_id, node_name, "", expiration)
        self._do("create bootstrap token", self.core.create_namespaced_secret, TOKEN_NAMESPACE, token)
        try:
            self._put_bootstrap_channel(machine_id, node_name, f"{token_id}.{token_secret}", token_id, expiration)
        except BaseException:
            self._delete("delete bootstrap token", self.core.delete_namespaced_secret,
                         f"bootstrap-token-{token_id}", TOKEN_NAMESPACE)
            self.delete_state(JOIN_TOKEN_KIND, token_id)
            raise
        return JoinTokenRef(token_id=token_id, node_name=node_name, expires_at=expires_at)

    def _record_token(self, token_id: str, node_name: str, join_key: str, expiration: str) -> None:
        """Before the token's Secret exists: a token without its record is one nobody approves."""
        record = {"node-name": node_name, "join": join_key, "expiration": expiration}
        self.update_state(JOIN_TOKEN_KIND, token_id, lambda _current: record)

    def _token_key(self) -> bytes:
        """The control plane's key for token secrets (``JOIN_TOKEN_KEY_SECRET``), made once."""
        for _ in range(3):
            found = self._get("read join token key", self.core.read_namespaced_secret, JOIN_TOKEN_KEY_SECRET,
                              self.bootstrap_namespace)
            value = ((found or {}).get("data") or {}).get("key")
            if value:
                return base64.b64decode(value)
            body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": {"name": JOIN_TOKEN_KEY_SECRET, "namespace": self.bootstrap_namespace,
                                 "labels": {"app.kubernetes.io/managed-by": "gpufleet"}},
                    "data": {"key": base64.b64encode(secrets.token_bytes(32)).decode()}}
            try:
                self._write("create join token key", self.core.create_namespaced_secret, self.bootstrap_namespace, body)
            except _Conflict:
                continue  # another worker made it first: read theirs
        raise ClusterConflict("the join token key could not be read or created", code="409")

    def _put_bootstrap_channel(self, machine_id: str, node_name: str, token: str, token_id: str, exp: str) -> None:
        name = bootstrap_secret_name(machine_id)
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": name,
                "namespace": self.bootstrap_namespace,
                "labels": {LABEL_TOKEN_ID: token_id, "app.kubernetes.io/managed-by": "gpufleet"},
                "annotations": {ANNOTATION_NODE_NAME: node_name, ANNOTATION_MACHINE_ID: machine_id},
            },
            "type": "Opaque",
            "stringData": {"token": token, "node-name": node_name, "expiration": exp},
        }

        def create() -> None:
            try:
                self._write("create bootstrap channel", self.core.create_namespaced_secret,
                            self.bootstrap_namespace, body)
            except _Conflict:
                self._supersede_channel(name, token_id)
                raise

        self._retry_on_conflict(f"bootstrap channel {name}", create)

    def _supersede_channel(self, name: str, token_id: str) -> None:
        """An older token's channel for this machine is in the way: that token is superseded."""
        old = self._get("read bootstrap channel", self.core.read_namespaced_secret, name, self.bootstrap_namespace)
        if old is None:
            return
        old_id = ((old.get("metadata") or {}).get("labels") or {}).get(LABEL_TOKEN_ID, "")
        if _TOKEN_ID.fullmatch(old_id) and old_id != token_id:
            self._delete("revoke superseded token", self.core.delete_namespaced_secret,
                         f"bootstrap-token-{old_id}", TOKEN_NAMESPACE)
        self._delete("delete superseded bootstrap channel", self.core.delete_namespaced_secret,
                     name, self.bootstrap_namespace)

    def take_bootstrap_token(self, machine_id: str) -> str | None:
        """The machine's side: read its token once (the Secret is deleted)."""
        name = bootstrap_secret_name(machine_id)
        secret = self._get("read bootstrap channel", self.core.read_namespaced_secret, name, self.bootstrap_namespace)
        if secret is None:
            return None
        version = secret["metadata"].get("resourceVersion")
        try:
            self._write("take bootstrap channel", self.core.delete_namespaced_secret, name, self.bootstrap_namespace,
                        body={"preconditions": {"resourceVersion": version}})
        except _Conflict:
            return None  # someone else took (or replaced) it first
        except NotFound:
            return None
        value = (secret.get("data") or {}).get("token")
        return base64.b64decode(value).decode() if value else None

    def revoke_join_token(self, token_id: str) -> None:
        if not _TOKEN_ID.fullmatch(token_id):
            raise ValueError(f"not a bootstrap token id: {token_id!r}")
        self._delete("revoke bootstrap token", self.core.delete_namespaced_secret,
                     f"bootstrap-token-{token_id}", TOKEN_NAMESPACE)
        self.delete_state(JOIN_TOKEN_KIND, token_id)
        channels = self._do("list bootstrap channels", self.core.list_namespaced_secret, self.bootstrap_namespace,
                            label_selector=f"{LABEL_TOKEN_ID}={token_id}")
        for item in channels.get("items", []):
            self._delete("revoke bootstrap channel", self.core.delete_namespaced_secret,
                         item["metadata"]["name"], self.bootstrap_namespace)

    # -- bootstrap (node-bound tokens, the API endpoint) --------------------------------
    def issue_bootstrap_token(self, node_name: str, join_key: str, ttl_seconds: int) -> BootstrapToken:
        check_join_ttl(ttl_seconds)
        now = time.time()
        key = self._token_key()
        for token_id, record in self.list_state(JOIN_TOKEN_KIND).items():
            expires_at = _expiry(record.get("expiration", ""))
            # Reused while it has a minute left: the machine created with it may still be booting.
            # Its secret is derived again, never read back from kube-system.
            if (expires_at is not None and record.get("join") == join_key and record.get("node-name") == node_name
                    and _TOKEN_ID.fullmatch(token_id) and expires_at.timestamp() > now + 60):
                return BootstrapToken(token_id=token_id, node_name=node_name, expires_at=expires_at,
                                      secret=_token_secret(key, token_id, join_key, node_name))
        token_id, _ = new_token_parts()
        token_secret = _token_secret(key, token_id, join_key, node_name)  # derived: see above
        expires_at = datetime.fromtimestamp(int(now) + ttl_seconds, timezone.utc)
        expiration = expires_at.strftime("%Y-%m-%dT%H:%M:%SZ")
        body = _bootstrap_token_body(token_id, token_secret, expiration, f"gpufleet join of node {node_name}",
                                     {LABEL_JOIN_KEY: _digest(join_key)},
                                     {ANNOTATION_NODE_NAME: node_name, ANNOTATION_JOIN: join_key})
        self._record_token(token_id, node_name, join_key, expiration)
        self._do("create bootstrap token", self.core.create_namespaced_secret, TOKEN_NAMESPACE, body)
        return BootstrapToken(token_id=token_id, node_name=node_name, expires_at=expires_at, secret=token_secret)

    def revoke_node_tokens(self, node_name: str) -> list[str]:
        """Delete every gpufleet join token issued for ``node_name`` (by their records); the ids
        deleted. Records of tokens past their expiry go too (the token cleaner took the Secret)."""
        gone = []
        now = time.time()
        for token_id, record in self.list_state(JOIN_TOKEN_KIND).items():
            if not _TOKEN_ID.fullmatch(token_id):
                continue
            if record.get("node-name") == node_name:
                self.revoke_join_token(token_id)
                gone.append(token_id)
            elif (expires_at := _expiry(record.get("expiration", ""))) is None or expires_at.timestamp() < now:
                self.delete_state(JOIN_TOKEN_KIND, token_id)
        return gone

    def bootstrap_endpoint(self) -> tuple[str, str]:
        """(API server ``host:port`` machines join and then use, the cluster CA as base64 PEM):
        from kubeadm's own discovery document ``kube-public/cluster-info``; the endpoint may be
        overridden (``join_endpoint``: an address remote machines reach)."""
        info = self._get("read cluster-info", self.core.read_namespaced_config_map, "cluster-info", "kube-public")
        if info is None:
            raise ClusterInvalid("kube-public/cluster-info is missing: it is what `kubeadm join` discovers the "
                                 "cluster from (kubeadm init creates it)", code="cluster-info")
        import yaml

        kubeconfig = yaml.safe_load((info.get("data") or {}).get("kubeconfig") or "") or {}
        cluster = ((kubeconfig.get("clusters") or [{}])[0] or {}).get("cluster") or {}
        ca = cluster.get("certificate-authority-data")
        if not ca:
            raise ClusterInvalid("cluster-info names no certificate authority", code="cluster-info")
        endpoint = self.join_endpoint or re.sub(r"^https?://", "", cluster.get("server") or "").rstrip("/")
        try:
            ca_cert_hash(base64.b64decode(ca))  # a certificate, or the join fails here and not on the machine
        except ValueError:
            raise ClusterInvalid("cluster-info's certificate authority is not a PEM certificate",
                                 code="cluster-info") from None
        return endpoint, ca
