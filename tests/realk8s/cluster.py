"""A real Kubernetes control plane on loopback, set up as ``kubeadm init`` sets one up.

Built by ``tests/realk8s/build.py`` from the published Go modules (one pinned minor). What runs:

* **kubeadm's own phases** make everything that needs no kubelet: ``certs all`` (the cluster CA,
  etcd's CA, the front-proxy CA, the service-account key pair and every serving and client
  certificate), ``kubeconfig all`` (``super-admin.conf``, ``admin.conf``, the controller-manager's
  and scheduler's), and once the API server is up ``upload-config all`` (the ``kubeadm-config``
  and ``kubelet-config`` ConfigMaps and their RBAC) and ``bootstrap-token`` (``cluster-info``
  with the CA inline, kubeadm's bootstrap RBAC, its auto-approve bindings and one token in
  kubeadm's default group, ``KUBEADM_TOKEN``).
* **etcd, kube-apiserver, kube-controller-manager and kube-scheduler** as processes, with the flags
  kubeadm's static-pod manifests give them (``kubeadm init phase control-plane`` only writes into
  the host's ``/etc/kubernetes/manifests``, so the flags are listed here, each as kubeadm sets it):
  TLS everywhere with the run's own CAs, ``--enable-bootstrap-token-auth``,
  ``--authorization-mode=Node,RBAC``, NodeRestriction admission, and the controller-manager's
  ``*,bootstrapsigner,tokencleaner`` controllers (so ``csrsigning`` with the cluster CA and
  ``csrapproving`` run as in any kubeadm cluster).  Ports are free ones on 127.0.0.1 instead
  of 6443/2379/10257/10259, and leader election is off (one of each).

Loopback only: every component binds 127.0.0.1, and machines (``tests/realk8s/machine.py``) take
127.0.0.2 and up.  Nothing resolves cluster-internal names (``*.svc``) here and no pod runs
a container, so a gpufleet process that would run in a pod is started as a process whose
in-cluster settings point at this API server: ``KUBERNETES_SERVICE_HOST=127.0.0.1``, the secure
port, and a service-account token minted with the TokenRequest API (``service_account_token``)
written where its manifest's projected volume would put it.
"""

from __future__ import annotations

import base64
import json
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.ports import free_port
from tests.realk8s import build

CLUSTER_NAME = "kubernetes"
#: kubeadm's default bootstrap group: kubeadm binds it to auto-approval of node client certificates.
KUBEADM_TOKEN_GROUP = "system:bootstrappers:kubeadm:default-node-token"
KUBEADM_TOKEN = "kubead.m0defaulttoken00"
#: An address machines reach the API server at that is not cluster-info's (a public endpoint in
#: front of a private control plane, GPUFLEET_JOIN_ENDPOINT): in the API server's certificate, as
#: an operator adds it (apiServer.certSANs), and routed only inside the machines' namespaces.
JOIN_ENDPOINT_IP = "203.0.113.50"


class ClusterFailed(RuntimeError):
    pass


@dataclass
class RealCluster:
    """One control plane in ``root``; ``start()`` brings it up, ``stop()`` ends every process."""

    root: Path
    bin: Path = field(default_factory=build.bin_dir)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    api_port: int = 0
    #: A Node list's resourceVersion as the cluster came up, and when (``time.monotonic()``): a
    #: version the API server's watch cache lets go of once it is older than the cache's freshness
    #: (75 s). The watch test that needs a gone version takes this one, minutes old by the time it
    #: runs, rather than wait those 75 s itself.
    first_nodes_version: tuple[str, float] = ("", 0.0)

    # -- paths --------------------------------------------------------------------------------
    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def kubeconfigs(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def admin_kubeconfig(self) -> Path:
        """system:masters (kubeadm's super-admin.conf): the fixture's own hand."""
        return self.kubeconfigs / "super-admin.conf"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def ca_pem(self) -> bytes:
        return (self.pki / "ca.crt").read_bytes()

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    # -- start and stop -----------------------------------------------------------------------
    def start(self) -> "RealCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(exist_ok=True)
        self.api_port = free_port()
        etcd_client, etcd_peer = free_port(), free_port()
        config = self._kubeadm_config()
        self.kubeadm("init", "phase", "certs", "all", "--config", str(config))
        self.kubeadm("init", "phase", "kubeconfig", "all", "--config", str(config),
                     "--kubeconfig-dir", str(self.kubeconfigs))
        # kubeadm points the controller-manager's and scheduler's kubeconfigs at the local API
        # endpoint (the advertise address); here the API server listens on loopback only.
        for path in self.kubeconfigs.glob("*.conf"):
            doc = yaml.safe_load(path.read_text())
            for entry in doc["clusters"]:
                entry["cluster"]["server"] = self.server
            path.write_text(yaml.safe_dump(doc))
        pki = self.pki
        self._spawn("etcd", [
            "--name=control-plane", f"--data-dir={self.root / 'etcd'}",
            f"--listen-client-urls=https://127.0.0.1:{etcd_client}",
            f"--advertise-client-urls=https://127.0.0.1:{etcd_client}",
            f"--listen-peer-urls=https://127.0.0.1:{etcd_peer}",
            f"--initial-advertise-peer-urls=https://127.0.0.1:{etcd_peer}",
            f"--initial-cluster=control-plane=https://127.0.0.1:{etcd_peer}",
            f"--listen-metrics-urls=http://127.0.0.1:{free_port()}",
            f"--cert-file={pki / 'etcd/server.crt'}", f"--key-file={pki / 'etcd/server.key'}",
            "--client-cert-auth=true", f"--trusted-ca-file={pki / 'etcd/ca.crt'}",
            f"--peer-cert-file={pki / 'etcd/peer.crt'}", f"--peer-key-file={pki / 'etcd/peer.key'}",
            "--peer-client-cert-auth=true", f"--peer-trusted-ca-file={pki / 'etcd/ca.crt'}",
            "--snapshot-count=10000",
            # A test cluster's data dies with the run: no fsync (the API's semantics are untouched).
            "--unsafe-no-fsync=true",
        ])
        self._spawn("kube-apiserver", [
            "--bind-address=127.0.0.1", f"--secure-port={self.api_port}",
            "--allow-privileged=true", "--authorization-mode=Node,RBAC",
            f"--client-ca-file={pki / 'ca.crt'}", "--enable-admission-plugins=NodeRestriction",
            "--enable-bootstrap-token-auth=true",
            f"--etcd-cafile={pki / 'etcd/ca.crt'}", f"--etcd-certfile={pki / 'apiserver-etcd-client.crt'}",
            f"--etcd-keyfile={pki / 'apiserver-etcd-client.key'}", f"--etcd-servers=https://127.0.0.1:{etcd_client}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            "--kubelet-preferred-address-types=InternalIP,ExternalIP,Hostname",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            "--requestheader-allowed-names=front-proxy-client",
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-username-headers=X-Remote-User",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/12",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
        ])
        self._wait_ready("/readyz", 120)
        cm = self.kubeconfigs / "controller-manager.conf"
        self._spawn("kube-controller-manager", [
            f"--authentication-kubeconfig={cm}", f"--authorization-kubeconfig={cm}", f"--kubeconfig={cm}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}", f"--client-ca-file={pki / 'ca.crt'}",
            f"--cluster-name={CLUSTER_NAME}", f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}", "--controllers=*,bootstrapsigner,tokencleaner",
            "--leader-elect=false", f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            f"--root-ca-file={pki / 'ca.crt'}", f"--service-account-private-key-file={pki / 'sa.key'}",
            "--use-service-account-credentials=true",
        ])
        scheduler = self.kubeconfigs / "scheduler.conf"
        self._spawn("kube-scheduler", [
            f"--authentication-kubeconfig={scheduler}", f"--authorization-kubeconfig={scheduler}",
            f"--kubeconfig={scheduler}", "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
            "--leader-elect=false",
        ])
        admin = ["--kubeconfig", str(self.admin_kubeconfig)]
        self.kubeadm("init", "phase", "upload-config", "all", "--config", str(config), *admin)
        self.kubeadm("init", "phase", "bootstrap-token", "--config", str(config), *admin)
        self._wait_cluster_info_signed(60)
        status, nodes = self.request("GET", "/api/v1/nodes?limit=1", admin=True)
        assert status == 200, nodes
        self.first_nodes_version = (nodes["metadata"]["resourceVersion"], time.monotonic())
        return self

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            process = self.processes.pop(name)
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def _kubeadm_config(self) -> Path:
        init = {
            "apiVersion": "kubeadm.k8s.io/v1beta4", "kind": "InitConfiguration",
            # No advertiseAddress: kubeadm refuses loopback there and takes the default interface's
            # address; every component still binds 127.0.0.1, and the cluster's endpoint (what
            # cluster-info carries and every kubeconfig names) is controlPlaneEndpoint below.
            "localAPIEndpoint": {"bindPort": self.api_port},
            "bootstrapTokens": [{"token": KUBEADM_TOKEN, "groups": [KUBEADM_TOKEN_GROUP], "ttl": "1h",
                                 "usages": ["signing", "authentication"]}],
            "nodeRegistration": {"name": "control-plane", "criSocket": "unix:///run/containerd/containerd.sock"},
        }
        cluster = {
            "apiVersion": "kubeadm.k8s.io/v1beta4", "kind": "ClusterConfiguration",
            # Explicit, or kubeadm asks the internet for the latest stable version.
            "kubernetesVersion": build.KUBERNETES_VERSION, "clusterName": CLUSTER_NAME,
            "controlPlaneEndpoint": f"127.0.0.1:{self.api_port}",
            "certificatesDir": str(self.pki),
            "apiServer": {"certSANs": [JOIN_ENDPOINT_IP]},
            "networking": {"serviceSubnet": "10.96.0.0/12", "dnsDomain": "cluster.local"},
            "etcd": {"local": {"dataDir": str(self.root / "etcd")}},
        }
        path = self.root / "kubeadm.yaml"
        path.write_text(yaml.safe_dump_all([init, cluster]))
        return path

    def kubeadm(self, *args: str) -> str:
        return self._run("kubeadm", list(args))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                kubeconfig: Path | None = None) -> subprocess.CompletedProcess:
        done = subprocess.run([str(self.bin / "kubectl"), "--kubeconfig", str(kubeconfig or self.admin_kubeconfig),
                               *args], input=input, capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            raise ClusterFailed(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done

    def _run(self, name: str, args: list[str]) -> str:
        done = subprocess.run([str(self.bin / name), *args], capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise ClusterFailed(f"{name} {' '.join(args[:4])}: {done.stderr.strip()[-3000:]}")
        return done.stdout

    def _spawn(self, name: str, args: list[str]) -> None:
        log = self.log(name).open("ab")
        self.processes[name] = subprocess.Popen([str(self.bin / name), *args], stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                tail = self.log(name).read_text(errors="replace")[-3000:]
                raise ClusterFailed(f"{name} exited with {process.returncode}:\n{tail}")

    # -- talking to it ------------------------------------------------------------------------
    def ssl_context(self, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cadata=self.ca_pem.decode())
        if cert is not None:
            context.load_cert_chain(str(cert), str(key) if key else None)
        return context

    def admin_cert(self) -> tuple[Path, Path]:
        """super-admin.conf's client certificate and key, as files (for plain HTTP clients)."""
        doc = yaml.safe_load(self.admin_kubeconfig.read_text())
        user = doc["users"][0]["user"]
        cert, key = self.root / "super-admin.crt", self.root / "super-admin.key"
        if not cert.exists():
            cert.write_bytes(base64.b64decode(user["client-certificate-data"]))
            key.write_bytes(base64.b64decode(user["client-key-data"]))
            key.chmod(0o600)
        return cert, key

    def request(self, method: str, path: str, body: Any = None, *, bearer: str | None = None,
                cert: Path | None = None, key: Path | None = None, admin: bool = False,
                content_type: str = "application/json", headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """One API call: as the admin, as a bearer token, as a client certificate, or anonymously."""
        if admin:
            cert, key = self.admin_cert()
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        request = urllib.request.Request(self.server + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", content_type)
        if bearer:
            request.add_header("Authorization", f"Bearer {bearer}")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            with urllib.request.urlopen(request, context=self.ssl_context(cert, key), timeout=30) as response:
                return response.status, _decoded(response.read())
        except urllib.error.HTTPError as error:
            return error.code, _decoded(error.read())

    def _wait_ready(self, path: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            self.check_alive()
            try:
                status, _ = self.request("GET", path, admin=True)
                if status == 200:
                    return
            except (OSError, ssl.SSLError):
                pass
            if time.monotonic() > deadline:
                raise ClusterFailed(f"{path} not ready after {seconds:.0f} s")
            time.sleep(0.3)

    def _wait_cluster_info_signed(self, seconds: float) -> None:
        """kubeadm's token discovery needs the bootstrap signer's JWS on cluster-info."""
        token_id = KUBEADM_TOKEN.split(".")[0]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            status, info = self.request("GET", "/api/v1/namespaces/kube-public/configmaps/cluster-info", admin=True)
            if status == 200 and f"jws-kubeconfig-{token_id}" in (info.get("data") or {}):
                return
            self.check_alive()
            time.sleep(0.3)
        raise ClusterFailed("cluster-info was not signed by the bootstrap signer in time")

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A bound token for a service account (TokenRequest), what a pod's projected volume holds."""
        status, answer = self.request(
            "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": seconds}},
            admin=True)
        if status != 201:
            raise ClusterFailed(f"token for {namespace}/{name}: {status} {answer}")
        return answer["status"]["token"]

    def rules(self, user: str, namespace: str, groups: tuple[str, ...] = ()) -> dict[str, Any]:
        """What the real authorizer grants ``user`` in ``namespace``: a SelfSubjectRulesReview made
        as that user (impersonated by the admin), as ``kubectl auth can-i --list --as`` does."""
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview",
                  "spec": {"namespace": namespace}}
        request = urllib.request.Request(self.server + "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
                                         data=json.dumps(review).encode(), method="POST")
        request.add_header("Content-Type", "application/json")
        request.add_header("Impersonate-User", user)
        for group in groups:  # urllib joins repeated headers; the API server wants one per group
            request.add_unredirected_header("Impersonate-Group", group)
        cert, key = self.admin_cert()
        with urllib.request.urlopen(request, context=self.ssl_context(cert, key), timeout=30) as response:
            return json.loads(response.read())["status"]

    def may(self, user: str, verb: str, resource: str, namespace: str, name: str = "", group: str = "",
            groups: tuple[str, ...] = ()) -> bool:
        """Whether the real authorizer lets ``user`` (in ``groups``) do ``verb`` on that object: a
        SubjectAccessReview asked by the admin, as ``kubectl auth can-i --as`` does."""
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": {"user": user, "groups": list(groups),
                           "resourceAttributes": {"verb": verb, "group": group, "resource": resource,
                                                  "namespace": namespace, "name": name}}}
        status, answer = self.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review,
                                      admin=True)
        if status != 201:
            raise ClusterFailed(f"SubjectAccessReview: {status} {answer}")
        return bool(answer["status"].get("allowed"))

    def api_client(self, token: str | None = None):
        """The official Python client against this server: as the admin, or with a bearer token."""
        from kubernetes import client as k8s

        configuration = k8s.Configuration()
        configuration.host = self.server
        ca = self.root / "ca.crt"
        if not ca.exists():
            ca.write_bytes(self.ca_pem)
        configuration.ssl_ca_cert = str(ca)
        if token:
            configuration.api_key = {"authorization": f"Bearer {token}"}
        else:
            configuration.cert_file, configuration.key_file = (str(p) for p in self.admin_cert())
        return k8s.ApiClient(configuration)


def _decoded(body: bytes) -> Any:
    """JSON where the server answered JSON (objects, Status errors), else the text (``/readyz``)."""
    try:
        return json.loads(body) if body else None
    except ValueError:
        return body.decode(errors="replace")
