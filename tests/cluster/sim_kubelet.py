"""A simulated machine that knows only what it received: its user data.

What kubeadm and the kubelet do with it, against the fake API server: read the
JoinConfiguration out of the cloud-config, check the cluster's CA against the pinned
hash (``kube-public/cluster-info``), post a client CSR for ``system:node:<name>`` as
the bootstrap token, wait (a watch) for the certificate, then register the Node with
the providerID and taints the configuration names, as the node itself.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

import yaml

from providers.cluster.bootstrap import kubelet_args, read_join_configuration, read_join_discovery
from tests.cluster.fake_auth import CLIENT_SIGNER, SERVING_SIGNER, cert_token


class JoinFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def csr_pem(common_name: str, orgs: list[str], ips: list[str] = (), dns: list[str] = ()) -> bytes:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    subject.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name(subject))
    sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


@dataclass
class SimKubelet:
    user_data: str
    #: The machine's own addresses (what a kubelet reads off its interfaces).
    addresses: list[str] = field(default_factory=list)
    gpus: int = 8
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: Set after the join: the bearer standing for the kubelet's client certificate.
    credential: str = ""

    def __post_init__(self) -> None:
        self.config = read_join_configuration(self.user_data)
        discovery = read_join_discovery(self.user_data)
        self.endpoint = discovery.server.removeprefix("https://")
        self.token = discovery.token
        self.ca = discovery.ca_pem
        self.name = self.config["nodeRegistration"]["name"]
        self.provider_id = kubelet_args(self.config).get("provider-id", "")

    # -- HTTP -------------------------------------------------------------------------------
    def call(self, method: str, path: str, body: Any = None, bearer: str | None = None,
             content_type: str = "application/json") -> dict[str, Any]:
        request = urllib.request.Request(f"http://{self.endpoint}{path}", method=method,
                                         data=json.dumps(body).encode() if body is not None else None)
        request.add_header("Content-Type", content_type)
        request.add_header("Authorization", f"Bearer {bearer or self.credential or self.token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return json.loads(reply.read() or b"{}")
        except urllib.error.HTTPError as error:
            detail = json.loads(error.read() or b"{}").get("message", "")
            raise JoinFailed(error.code, detail) from None

    def watch_csr(self, name: str, timeout: int = 20) -> dict[str, Any]:
        """Until the CSR is decided (a watch, as kubeadm's TLS bootstrap waits)."""
        path = (f"/apis/certificates.k8s.io/v1/certificatesigningrequests?watch=true"
                f"&fieldSelector=metadata.name%3D{name}&timeoutSeconds={timeout}")
        request = urllib.request.Request(f"http://{self.endpoint}{path}")
        request.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(request, timeout=timeout + 5) as stream:
            for line in stream:
                csr = json.loads(line)["object"]
                status = csr.get("status") or {}
                if any(c["type"] == "Denied" for c in status.get("conditions") or []):
                    reason = next(c.get("message", "") for c in status["conditions"] if c["type"] == "Denied")
                    raise JoinFailed(403, f"certificate signing request denied: {reason}")
                if status.get("certificate"):
                    return csr
        raise JoinFailed(504, f"no decision on {name} within {timeout}s")

    # -- kubeadm join -------------------------------------------------------------------------
    def discover(self) -> None:
        info = self.call("GET", "/api/v1/namespaces/kube-public/configmaps/cluster-info")
        kubeconfig = yaml.safe_load(info["data"]["kubeconfig"])
        ca = base64.b64decode(kubeconfig["clusters"][0]["cluster"]["certificate-authority-data"])
        if ca != self.ca:
            raise JoinFailed(0, "cluster CA is not the one the user data trusts")

    def request_certificate(self, node_name: str | None = None) -> bytes:
        """The TLS bootstrap: a client CSR as the token, for ``node_name`` (default: its own)."""
        name = f"node-csr-{uuid.uuid4().hex[:10]}"
        csr = {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
               "metadata": {"name": name},
               "spec": {"request": base64.b64encode(csr_pem(f"system:node:{node_name or self.name}",
                                                             ["system:nodes"])).decode(),
                        "signerName": CLIENT_SIGNER, "usages": ["digital signature", "client auth"],
                        # What a liar writes here counts for nothing: the server sets who asked.
                        "username": "system:admin", "groups": ["system:masters"]}}
        self.call("POST", "/apis/certificates.k8s.io/v1/certificatesigningrequests", csr)
        return base64.b64decode(self.watch_csr(name)["status"]["certificate"])

    def register(self) -> dict[str, Any]:
        taints = self.config["nodeRegistration"].get("taints") or []
        node = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.name, "labels": {"kubernetes.io/hostname": self.name}},
            "spec": {"providerID": self.provider_id, **({"taints": taints} if taints else {})},
            "status": {
                "conditions": [{"type": "Ready", "status": "True"}],
                "addresses": [{"type": "InternalIP", "address": a} for a in self.addresses]
                + [{"type": "Hostname", "address": self.name}],
                "allocatable": {"cpu": "64", "nvidia.com/gpu": str(self.gpus)},
                "capacity": {"cpu": "64", "nvidia.com/gpu": str(self.gpus)},
                "nodeInfo": {"bootID": self.boot_id, "kubeletVersion": "v1.31.0", "machineID": self.boot_id},
            },
        }
        return self.call("POST", "/api/v1/nodes", node)

    def join(self) -> dict[str, Any]:
        self.discover()
        self.credential = cert_token(self.request_certificate())
        return self.register()

    def request_serving_certificate(self, ips: list[str]) -> str:
        """As the node: a kubelet-serving CSR for its name and ``ips``; the CSR's name."""
        name = f"csr-{uuid.uuid4().hex[:10]}"
        csr = {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
               "metadata": {"name": name},
               "spec": {"request": base64.b64encode(csr_pem(f"system:node:{self.name}", ["system:nodes"], ips=ips,
                                                             dns=[self.name])).decode(),
                        "signerName": SERVING_SIGNER,
                        "usages": ["digital signature", "server auth"]}}
        self.call("POST", "/apis/certificates.k8s.io/v1/certificatesigningrequests", csr)
        return name

    def patch_own_node(self, patch: dict[str, Any]) -> dict[str, Any]:
        return self.call("PATCH", f"/api/v1/nodes/{self.name}", patch,
                         content_type="application/merge-patch+json")
