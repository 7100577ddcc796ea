"""What the fake API server needs to let a machine join it, with the real semantics:

* authentication: ``Authorization: Bearer <token>`` yields a user and groups. A
  bootstrap token ``<id>.<secret>`` authenticates as ``system:bootstrap:<id>`` with
  groups ``system:bootstrappers`` plus its Secret's ``auth-extra-groups``, only while
  the Secret in kube-system exists, matches, allows authentication and has not expired.
  A kubelet's client certificate stands in as ``Bearer cert-<sha256 of the cert>``
  (this server speaks plain HTTP): it authenticates as the certificate's CN and O.
  No header (what the adapter's tests send) or ``fake-token`` is the cluster admin.
* authorization for everyone but the admin: RBAC bindings read from
  ``deploy/bootstrap/rbac.yaml`` plus kubeadm's defaults (its default bootstrap group is
  bound to the node-bootstrapper role and to auto-approval of node client
  certificates), and the Node authorizer for ``system:node:<name>``.
* the CSR API (certificates.k8s.io/v1): ``spec.username``/``groups``/``uid`` are set from
  the authenticated caller, never from the body; the ``approval`` subresource; the
  kube-controller-manager's approver (auto-approves node client CSRs of groups bound to
  ``nodeclient`` and renewals of groups bound to ``selfnodeclient``) and its signer (an
  approved kubelet CSR gets a certificate from this server's CA).
* NodeRestriction: a node may create and change only its own Node; it may not set or
  change labels under ``node-restriction.kubernetes.io/`` or the reserved
  ``kubernetes.io``/``k8s.io`` keys, nor change its taints; nobody may change a
  providerID once set.
* ``kube-public/cluster-info`` (kubeadm's discovery document) with this server's CA.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
from pathlib import Path
from typing import Any

import yaml

ADMIN = ("system:admin", ["system:masters", "system:authenticated"])
CLIENT_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
SERVING_SIGNER = "kubernetes.io/kubelet-serving"
BOOTSTRAPPER_ROLE = "system:node-bootstrapper"
NODECLIENT = "system:certificates.k8s.io:certificatesigningrequests:nodeclient"
SELFNODECLIENT = "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient"
KUBEADM_GROUP = "system:bootstrappers:kubeadm:default-node-token"
#: kubeadm init's bindings (ClusterRoleBinding subject group → roles it binds).
KUBEADM_BINDINGS = [
    (KUBEADM_GROUP, BOOTSTRAPPER_ROLE),
    (KUBEADM_GROUP, NODECLIENT),
    (KUBEADM_GROUP, "kubeadm:get-nodes"),
    ("system:nodes", SELFNODECLIENT),
]
RBAC_FILE = Path(__file__).resolve().parents[2] / "deploy" / "bootstrap" / "rbac.yaml"
#: Keys under kubernetes.io / k8s.io a kubelet may still set on its Node.
KUBELET_LABELS = {
    "kubernetes.io/hostname", "kubernetes.io/arch", "kubernetes.io/os", "beta.kubernetes.io/arch",
    "beta.kubernetes.io/os", "beta.kubernetes.io/instance-type", "node.kubernetes.io/instance-type",
    "failure-domain.beta.kubernetes.io/region", "failure-domain.beta.kubernetes.io/zone",
    "topology.kubernetes.io/region", "topology.kubernetes.io/zone", "node.kubernetes.io/windows-build",
}


class Forbidden(Exception):
    pass


class Unauthorized(Exception):
    pass


def restricted_label(key: str) -> bool:
    """A label NodeRestriction keeps from the kubelet."""
    prefix, _, _ = key.rpartition("/")
    if prefix == "node-restriction.kubernetes.io" or prefix.endswith(".node-restriction.kubernetes.io"):
        return True
    if key in KUBELET_LABELS or prefix in ("kubelet.kubernetes.io", "node.kubernetes.io"):
        return False
    return any(prefix == d or prefix.endswith("." + d) for d in ("kubernetes.io", "k8s.io"))


class FakeAuth:
    def __init__(self, fake: Any, rbac_file: Path = RBAC_FILE) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.fake = fake
        #: bearer token → (user, groups) of issued client certificates.
        self.users: dict[str, tuple[str, list[str]]] = {}
        self.bindings: list[tuple[str, str]] = list(KUBEADM_BINDINGS)
        for doc in yaml.safe_load_all(rbac_file.read_text()):
            if doc and doc.get("kind") in ("ClusterRoleBinding", "RoleBinding"):
                for subject in doc.get("subjects") or []:
                    if subject.get("kind") == "Group":
                        self.bindings.append((subject["name"], doc["roleRef"]["name"]))
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
        now = dt.datetime.now(dt.timezone.utc)
        self.ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(self.key, hashes.SHA256()))
        self.ca_pem = self.ca.public_bytes(serialization.Encoding.PEM)

    # -- discovery -------------------------------------------------------------------------
    def cluster_info(self, server: str) -> dict[str, Any]:
        kubeconfig = {"apiVersion": "v1", "kind": "Config", "clusters": [{"name": "", "cluster": {
            "server": server, "certificate-authority-data": base64.b64encode(self.ca_pem).decode()}}]}
        return {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "cluster-info", "namespace": "kube-public"},
                "data": {"kubeconfig": yaml.safe_dump(kubeconfig)}}

    # -- authentication --------------------------------------------------------------------
    def authenticate(self, header: str) -> tuple[str, list[str]]:
        if not header:
            return ADMIN
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("Unauthorized")
        if token == "fake-token":
            return ADMIN
        if token in self.users:
            return self.users[token]
        token_id, dot, secret = token.partition(".")
        if dot and len(token_id) == 6 and len(secret) == 16:
            stored = self.fake.store.get(("", "secrets", "kube-system", f"bootstrap-token-{token_id}"))
            data = {k: base64.b64decode(v).decode() for k, v in ((stored or {}).get("data") or {}).items()}
            expiration = data.get("expiration", "")
            expired = bool(expiration) and dt.datetime.fromisoformat(
                expiration.replace("Z", "+00:00")) < dt.datetime.now(dt.timezone.utc)
            if (stored and stored.get("type") == "bootstrap.kubernetes.io/token"
                    and data.get("token-secret") == secret and data.get("usage-bootstrap-authentication") == "true"
                    and not expired):
                extra = [g.strip() for g in data.get("auth-extra-groups", "").split(",") if g.strip()]
                return f"system:bootstrap:{token_id}", ["system:bootstrappers", *extra, "system:authenticated"]
        raise Unauthorized("Unauthorized")

    # -- authorization ---------------------------------------------------------------------
    def roles(self, groups: list[str]) -> set[str]:
        return {role for group, role in self.bindings if group in groups}

    def authorize(self, user: str, groups: list[str], verb: str, group: str, resource: str, sub: str,
                  namespace: str, name: str) -> None:
        if "system:masters" in groups:
            return
        roles = self.roles(groups)
        csr = group == "certificates.k8s.io" and resource == "certificatesigningrequests" and not sub
        if csr and verb in ("create", "get", "list", "watch") and (
                BOOTSTRAPPER_ROLE in roles or "system:nodes" in groups):
            return
        if (group, resource) == ("", "nodes") and verb == "get" and "kubeadm:get-nodes" in roles:
            return
        if ((group, resource, namespace, verb) == ("", "configmaps", "kube-system", "get")
                and (name == "kubeadm-config" and "kubeadm:nodes-kubeadm-config" in roles
                     or name == "kubelet-config" and "kubeadm:kubelet-config" in roles)):
            return
        if (group, resource, namespace, name, verb) == ("", "configmaps", "kube-public", "cluster-info", "get"):
            return  # kubeadm discovery reads it anonymously
        if user.startswith("system:node:") and "system:nodes" in groups and (group, resource) == ("", "nodes"):
            if verb in ("get", "list", "watch") or (verb in ("create", "update", "patch")
                                                    and name in ("", user.removeprefix("system:node:"))):
                return
        raise Forbidden(f'User "{user}" cannot {verb} resource "{resource + ("/" + sub if sub else "")}" '
                        f'in API group "{group}"' + (f' in the namespace "{namespace}"' if namespace else ""))

    # -- NodeRestriction -------------------------------------------------------------------
    def admit_node(self, user: str, groups: list[str], old: dict | None, new: dict) -> None:
        if not user.startswith("system:node:") or "system:nodes" not in groups:
            return
        node = user.removeprefix("system:node:")
        name = new["metadata"]["name"]
        if name != node:
            raise Forbidden(f'node "{node}" is not allowed to modify node "{name}"')
        old_labels = ((old or {}).get("metadata") or {}).get("labels") or {}
        new_labels = new["metadata"].get("labels") or {}
        changed = {k for k in set(old_labels) | set(new_labels) if old_labels.get(k) != new_labels.get(k)}
        refused = sorted(k for k in changed if restricted_label(k))
        if refused:
            raise Forbidden(f'node "{node}" is not allowed to modify labels: {", ".join(refused)}')
        if old is not None and (old.get("spec") or {}).get("taints") != (new.get("spec") or {}).get("taints"):
            raise Forbidden(f'node "{node}" is not allowed to modify taints')

    # -- CSRs ------------------------------------------------------------------------------
    def on_create_csr(self, user: str, groups: list[str], obj: dict) -> None:
        spec = obj.setdefault("spec", {})
        spec["username"], spec["groups"], spec["uid"] = user, list(groups), hashlib.sha1(user.encode()).hexdigest()
        if not spec.get("signerName") or not spec.get("request"):
            from tests.cluster.fake_apiserver import ApiError

            raise ApiError(422, "Invalid", "spec.signerName, spec.request: Required value")
        obj.setdefault("status", {})

    def controllers(self, obj: dict) -> bool:
        """kube-controller-manager's csrapproving and csrsigning on one CSR; True if changed."""
        spec, status = obj.get("spec") or {}, obj.setdefault("status", {})
        conditions = status.setdefault("conditions", [])
        decided = {c.get("type") for c in conditions}
        changed = False
        if not decided and spec.get("signerName") == CLIENT_SIGNER:
            roles = self.roles(spec.get("groups") or [])
            subject = self._subject(spec)
            own = subject is not None and subject[0] == spec.get("username")
            if subject and subject[0].startswith("system:node:") and (
                    NODECLIENT in roles or (SELFNODECLIENT in roles and own)):
                conditions.append({"type": "Approved", "status": "True", "reason": "AutoApproved",
                                   "message": "Auto approving kubelet client certificate after SubjectAccessReview."})
                decided.add("Approved")
                changed = True
        if "Approved" in decided and "Denied" not in decided and not status.get("certificate"):
            status["certificate"] = base64.b64encode(self._sign(spec)).decode()
            changed = True
        return changed

    @staticmethod
    def _subject(spec: dict) -> tuple[str, list[str]] | None:
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        try:
            request = x509.load_pem_x509_csr(base64.b64decode(spec.get("request") or ""))
        except ValueError:
            return None
        common = [a.value for a in request.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
        orgs = [a.value for a in request.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
        return (common[0] if common else ""), orgs

    def _sign(self, spec: dict) -> bytes:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization

        request = x509.load_pem_x509_csr(base64.b64decode(spec["request"]))
        now = dt.datetime.now(dt.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(request.subject).issuer_name(self.ca.subject)
                   .public_key(request.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(hours=1)))
        for extension in request.extensions:
            builder = builder.add_extension(extension.value, extension.critical)
        cert = builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
        if spec.get("signerName") == CLIENT_SIGNER:
            common, orgs = self._subject(spec) or ("", [])
            self.users[cert_token(cert)] = (common, [*orgs, "system:authenticated"])
        return cert


def cert_token(cert_pem: bytes) -> str:
    """The bearer token standing for TLS client authentication with ``cert_pem``."""
    return "cert-" + hashlib.sha256(cert_pem).hexdigest()
