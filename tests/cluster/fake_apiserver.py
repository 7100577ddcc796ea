"""A small Kubernetes API server for the adapter tests (stdlib only, one thread per request).

The real API server (tests/realk8s/, a kubeadm-style control plane) is the test wherever it can
show what a test needs: the cluster port's contract suite (tests/realk8s/test_contract.py), the
joins of every provider with real kubelets, the ``mode: real`` worker tests (Advisor, CSR
approver, demand loop, durable state), the routing objects, drains, rollouts. This fake stays
only where a test needs what a real server is not made to show on cue, each test saying so:

* faults: a 5xx, a 409 on exactly the next N writes (``fail``), a server that accepts and then
  answers nothing (``response_delay_s``) -- tests/cluster/test_cluster_errors.py,
  tests/cluster/test_kubernetes_adapter.py;
* a cluster whose every node and kube-system pod the test fixes: ``gpufleet cluster check``'s
  Konnectivity verdict covers the whole cluster, and the real tier's control plane is shared by
  all its tests (tests/cluster/test_network.py);
* its own semantics (tests/cluster/test_fake_apiserver.py).

It keeps the real API's semantics for what the adapter uses (``tests/cluster/test_fake_apiserver.py``):

* paths, verbs and ``Status`` error objects (404 NotFound, 409 AlreadyExists /
  Conflict, 422 Invalid, 400 BadRequest, 415, 429 TooManyRequests);
* ``resourceVersion``: bumped on every real change, unchanged by a no-op write;
  PUT and patches carrying ``metadata.resourceVersion`` and deletes carrying
  preconditions are refused with 409 on a mismatch; ``generation`` bumped on
  spec changes of Deployments and HTTPRoutes;
* label selectors (``=``, ``==``, ``!=``, ``in``, ``notin``, exists, ``!``) and field
  selectors (``metadata.name``, ``metadata.namespace``, pods' ``spec.nodeName``
  and ``status.phase``; anything else is a 400 as on a real server);
* JSON merge patch, strategic merge patch (lists with a patch merge key merge
  by it; refused for custom resources) and JSON patch (an object instead of a
  list is refused as the real server does);
* Secrets' ``stringData`` folded into base64 ``data``;
* the Eviction subresource (policy/v1): 429 while the pod's
  PodDisruptionBudget allows no disruption, 500 for more than one PDB; PDB
  status is computed from the pods;
* a Deployment "controller": status (observedGeneration, replicas,
  updatedReplicas, availableReplicas) computed from the nodes by
  ``serving_capacity``, optionally ``rollout_delay_s`` after a spec change;
* SelfSubjectAccessReview answering allowed unless ``deny(...)``-ed;
* pods annotated ``fake.gpufleet.io/terminating-seconds`` take that long to go
  after a delete or eviction (deletionTimestamp set meanwhile);
* injected answers (``fail``, ``forbid``): an RBAC denial (403), a busy object
  (409), a sick server (5xx) for one verb on one resource, a number of times.

Every request is recorded as (verb, group, resource, subresource, namespace)
in ``requests`` so a test can compare what the adapter did with its RBAC table.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import socket
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, parse_qs, urlparse

from fleet.models import Node
from providers.cluster.base import format_taint, serving_capacity
from fleet.cluster import GPU_RESOURCE, LABEL_SITE
from tests.cluster.fake_auth import ADMIN, FakeAuth, Forbidden, Unauthorized

#: (group, resource) → (version, kind, namespaced)
RESOURCES: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("", "nodes"): ("v1", "Node", False),
    ("", "namespaces"): ("v1", "Namespace", False),
    ("", "pods"): ("v1", "Pod", True),
    ("", "secrets"): ("v1", "Secret", True),
    ("", "configmaps"): ("v1", "ConfigMap", True),
    ("", "services"): ("v1", "Service", True),
    ("apps", "deployments"): ("v1", "Deployment", True),
    ("policy", "poddisruptionbudgets"): ("v1", "PodDisruptionBudget", True),
    ("gateway.networking.k8s.io", "httproutes"): ("v1", "HTTPRoute", True),
    ("gateway.envoyproxy.io", "backendtrafficpolicies"): ("v1alpha1", "BackendTrafficPolicy", True),
    ("certificates.k8s.io", "certificatesigningrequests"): ("v1", "CertificateSigningRequest", False),
    # What `gpufleet cluster check` reads by name (kubeadm's bindings, gpufleet's admission policy).
    ("rbac.authorization.k8s.io", "clusterrolebindings"): ("v1", "ClusterRoleBinding", False),
    ("admissionregistration.k8s.io", "validatingadmissionpolicies"): ("v1", "ValidatingAdmissionPolicy", False),
    ("admissionregistration.k8s.io", "validatingadmissionpolicybindings"):
        ("v1", "ValidatingAdmissionPolicyBinding", False),
}
WITH_GENERATION = {("apps", "deployments"), ("gateway.networking.k8s.io", "httproutes"),
                   ("policy", "poddisruptionbudgets")}
#: Strategic-merge-patch merge keys of the list fields we meet.
MERGE_KEYS = {"taints": "key", "containers": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath",
              "conditions": "type", "ownerReferences": "uid", "tolerations": None}
FIELD_SELECTORS = {"pods": {"spec.nodeName", "status.phase"}, "secrets": {"type"}}
TERMINATING_ANNOTATION = "fake.gpufleet.io/terminating-seconds"
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
TAINT_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict[str, Any]:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


def _not_found(group: str, resource: str, name: str) -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(404, "NotFound", f'{qualified} "{name}" not found',
                    {"name": name, "group": group, "kind": resource})


def _conflict(group: str, resource: str, name: str) -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {qualified} "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                    {"name": name, "group": group, "kind": resource})


# -- selectors -------------------------------------------------------------------------
def _split_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
            continue
        depth += char == "("
        depth -= char == ")"
        current += char
    terms.append(current)
    return [t.strip() for t in terms if t.strip()]


def label_selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in _split_terms(selector):
        if m := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if op == "in" and (key not in labels or labels[key] not in values):
                return False
            if op == "notin" and key in labels and labels[key] in values:
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = re.split(r"==?", term, maxsplit=1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif re.fullmatch(r"[\w./-]+", term):
            if term not in labels:
                return False
        else:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")
    return True


def _field(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def field_selector_matches(selector: str, resource: str, obj: dict[str, Any]) -> bool:
    for term in _split_terms(selector):
        m = re.fullmatch(r"([\w.]+)\s*(==|=|!=)\s*(.*)", term)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector: {term!r}")
        path, op, value = m.groups()
        if path not in {"metadata.name", "metadata.namespace"} | FIELD_SELECTORS.get(resource, set()):
            raise ApiError(400, "BadRequest", f'field label not supported: {path}')
        if (_field(obj, path) == value) != (op != "!="):
            return False
    return True


# -- patches ---------------------------------------------------------------------------
def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, field: str = "") -> Any:
    if isinstance(patch, list):
        key = MERGE_KEYS.get(field)
        if key and isinstance(target, list) and all(isinstance(i, dict) for i in patch):
            merged = [copy.deepcopy(i) for i in target]
            for item in patch:
                found = next((i for i, old in enumerate(merged) if old.get(key) == item.get(key)), None)
                if item.get("$patch") == "delete":
                    if found is not None:
                        merged.pop(found)
                elif found is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merged[found] = strategic_merge_patch(merged[found], item)
            return merged
        return copy.deepcopy(patch)
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if value is None:
            result.pop(name, None)
        else:
            result[name] = strategic_merge_patch(result.get(name), value, name)
    return result


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(target: Any, operations: Any) -> Any:
    if not isinstance(operations, list):
        raise ApiError(500, "InternalError",
                       "json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(target)
    for op in operations:
        parts = _pointer(op["path"])
        parent: Any = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        kind = op["op"]
        if kind == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op.get("value"):
                raise ApiError(422, "Invalid", f"test operation failed at {op['path']}")
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                if kind == "add":
                    parent.insert(index, op["value"])
                else:
                    parent[index] = op["value"]
            else:
                if kind == "replace" and last not in parent:
                    raise ApiError(422, "Invalid", f"replace operation does not apply: {op['path']} is missing")
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                parent.pop(int(last))
            elif last in parent:
                del parent[last]
            else:
                raise ApiError(422, "Invalid", f"remove operation does not apply: {op['path']} is missing")
        else:
            raise ApiError(422, "Invalid", f"unsupported json patch op {kind}")
    return doc


def _comparable(obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj.get("metadata", {}).pop("resourceVersion", None)
    obj.get("metadata", {}).pop("managedFields", None)
    return obj


# -- watches ------------------------------------------------------------------------------
class Watch:
    """One watch request: ADDED/MODIFIED/DELETED events of the matching objects changed
    after ``resourceVersion`` (all of them, as ADDED, when it is 0 or absent), until
    ``timeoutSeconds`` (at most 60)."""

    def __init__(self, group: str, resource: str, namespace: str, query: dict[str, str]) -> None:
        self.group, self.resource, self.namespace = group, resource, namespace
        self.labels, self.fields = query.get("labelSelector", ""), query.get("fieldSelector", "")
        self.since = int(query.get("resourceVersion") or 0)
        self.timeout = min(float(query.get("timeoutSeconds") or 30), 60.0)

    def _matching(self, fake: "FakeKube") -> dict[tuple, dict[str, Any]]:
        with fake.lock:
            fake._reap()
            return {key: fake._render(self.group, self.resource, obj) for key, obj in fake.store.items()
                    if key[0] == self.group and key[1] == self.resource
                    and (not self.namespace or key[2] == self.namespace)
                    and (not self.labels or label_selector_matches(self.labels, obj["metadata"].get("labels") or {}))
                    and (not self.fields or field_selector_matches(self.fields, self.resource, obj))}

    def events(self, fake: "FakeKube"):
        deadline = time.monotonic() + self.timeout
        seen: dict[tuple, dict[str, Any]] = {}
        while True:
            current = self._matching(fake)
            for key, obj in current.items():
                version = int(obj["metadata"]["resourceVersion"])
                if key not in seen and version > self.since:
                    yield {"type": "ADDED", "object": obj}
                elif key in seen and seen[key]["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"]:
                    yield {"type": "MODIFIED", "object": obj}
            for key in seen.keys() - current.keys():
                yield {"type": "DELETED", "object": seen[key]}
            seen = current
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)


# -- the store ---------------------------------------------------------------------------
class FakeKube:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.store: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self._rv = 1000
        #: (verb, group, resource, subresource, namespace) of every API request.
        self.requests: list[tuple[str, str, str, str, str]] = []
        #: (method, path) of every write.
        self.writes: list[tuple[str, str]] = []
        self.denied: list[dict[str, str | None]] = []
        #: Injected answers (``fail``), checked in order before a request is served.
        self.faults: list[dict[str, Any]] = []
        self.rollout_delay_s = 0.0
        #: Seconds every response is held back (a slow or hung API server).
        self.response_delay_s = 0.0
        self._spec_changed_at: dict[tuple[str, str], float] = {}
        self._remove_at: dict[tuple[str, str, str, str], float] = {}
        self.server: ThreadingHTTPServer | None = None
        #: ``enable_bootstrap``: authentication, RBAC for non-admins, CSR controllers, NodeRestriction.
        self.auth: FakeAuth | None = None
        self._caller: tuple[str, list[str]] = ADMIN
        #: (user, verb, group, resource, subresource, namespace, name) of every non-admin request.
        self.others: list[tuple[str, str, str, str, str, str, str]] = []
        self.thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> "FakeKube":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def setup(self) -> None:
                super().setup()
                # Headers and body go out in two writes: without this, Nagle and
                # delayed ACKs cost ~40 ms a request.
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                code, body = fake.handle(self.command, self.path, self.headers.get("Content-Type", ""), raw,
                                         self.headers.get("Authorization", ""))
                if isinstance(body, Watch):
                    self._stream(body)
                    return
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, watch: "Watch") -> None:
                """A watch: one JSON event a line, chunked, until its timeout."""
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for event in watch.events(fake):
                    line = json.dumps(event).encode() + b"\n"
                    self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.close_connection = True

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that gave up is fine
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                                       name="fake-kube", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def api_client(self):
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = self.url
        return client.ApiClient(configuration)

    def kubeconfig(self, path, user: dict | None = None) -> str:
        """A kubeconfig file that points at this server, with ``user`` as its user entry (the
        admin's token by default)."""
        import yaml

        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": user or {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }
        path.write_text(yaml.safe_dump(config))
        return str(path)

    # -- test-facing helpers (no HTTP, not recorded) ------------------------------------
    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def put(self, group: str, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            return self._create(group, resource, obj["metadata"].get("namespace", ""), copy.deepcopy(obj))

    def get(self, group: str, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            self._reap()
            obj = self.store.get((group, resource, namespace, name))
            return self._render(group, resource, obj) if obj else None

    def objects(self, group: str, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            self._reap()
            return [self._render(group, resource, o) for (g, r, ns, _), o in sorted(self.store.items())
                    if g == group and r == resource and (namespace is None or ns == namespace)]

    def add_node(self, name: str, labels: dict[str, str] | None = None, gpus: int = 8, ready: bool = True,
                 machine_id: str = "", boot_id: str = "boot-1", taints: list[dict] | None = None,
                 provider_id: str = "") -> dict[str, Any]:
        node = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                         "annotations": {"gpufleet.io/machine-id": machine_id} if machine_id else {}},
            "spec": {**({"taints": taints} if taints else {}), **({"providerID": provider_id} if provider_id else {})},
            "status": {
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                "allocatable": {"cpu": "64", GPU_RESOURCE: str(gpus)},
                "capacity": {"cpu": "64", GPU_RESOURCE: str(gpus)},
                "nodeInfo": {"architecture": "amd64", "bootID": boot_id, "containerRuntimeVersion": "containerd://1.7",
                             "kernelVersion": "6.8.0", "kubeProxyVersion": "", "kubeletVersion": "v1.31.0",
                             "machineID": machine_id or name, "operatingSystem": "linux",
                             "osImage": "Ubuntu 24.04", "systemUUID": machine_id or name},
            },
        }
        return self.put("", "nodes", node)

    def set_node_ready(self, name: str, ready: bool) -> None:
        with self.lock:
            node = self.store[("", "nodes", "", name)]
            node["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
            node["metadata"]["resourceVersion"] = self._next_rv()

    def add_pod(self, node: str, name: str, namespace: str = "default", labels: dict[str, str] | None = None,
                owner_kind: str = "ReplicaSet", mirror: bool = False, phase: str = "Running",
                terminating_seconds: float = 0) -> dict[str, Any]:
        annotations = {}
        if mirror:
            annotations["kubernetes.io/config.mirror"] = "mirror-hash"
        if terminating_seconds:
            annotations[TERMINATING_ANNOTATION] = str(terminating_seconds)
        owners = [{"apiVersion": "apps/v1", "kind": owner_kind, "name": f"{name}-owner", "uid": str(uuid.uuid4()),
                   "controller": True}] if owner_kind else []
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {}, "annotations": annotations,
                         "ownerReferences": owners},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
            "status": {"phase": phase},
        }
        return self.put("", "pods", pod)

    def add_pending_pod(self, name: str, gpus: int, namespace: str = "default",
                        node_selector: dict[str, str] | None = None, tolerations: list[dict] | None = None,
                        labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
                        nominated_node: str = "", limits_only: bool = False) -> dict[str, Any]:
        """A pod the scheduler could not place: Pending, no node, ``PodScheduled=False``
        (reason ``Unschedulable``), as a real scheduler leaves it; ``nominated_node`` sets
        ``status.nominatedNodeName`` (a preemption in progress)."""
        resources = {"limits": {GPU_RESOURCE: str(gpus)}} if limits_only else \
            {"requests": {GPU_RESOURCE: str(gpus)}, "limits": {GPU_RESOURCE: str(gpus)}}
        status: dict[str, Any] = {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": f"0/1 nodes are available: 1 Insufficient {GPU_RESOURCE}."}]}
        if nominated_node:
            status["nominatedNodeName"] = nominated_node
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {},
                         "annotations": annotations or {}, "creationTimestamp": _now()},
            "spec": {"containers": [{"name": "server", "image": "vllm", "resources": resources}],
                     "nodeSelector": node_selector or {}, "tolerations": tolerations or []},
            "status": status,
        }
        return self.put("", "pods", pod)

    def delete_pod(self, namespace: str, name: str) -> None:
        with self.lock:
            self.store.pop(("", "pods", namespace, name), None)

    # -- pod readiness (the Konnectivity check, issue 17) ----------------------------------
    def set_pod_ready(self, namespace: str, name: str, ready: bool = True) -> None:
        """The Ready condition the kubelet reports (``add_pod`` makes pods without conditions)."""
        with self.lock:
            pod = self.store[("", "pods", namespace, name)]
            pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
            pod["metadata"]["resourceVersion"] = self._next_rv()

    def set_pdb(self, namespace: str, name: str, selector: dict[str, str], min_available: int | None = None,
                max_unavailable: int | None = None) -> dict[str, Any]:
        spec: dict[str, Any] = {"selector": {"matchLabels": selector}}
        if min_available is not None:
            spec["minAvailable"] = min_available
        if max_unavailable is not None:
            spec["maxUnavailable"] = max_unavailable
        with self.lock:
            self.store.pop(("policy", "poddisruptionbudgets", namespace, name), None)
            return self.put("policy", "poddisruptionbudgets", {
                "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": {"name": name, "namespace": namespace}, "spec": spec})

    def delete_pdb(self, namespace: str, name: str) -> None:
        with self.lock:
            self.store.pop(("policy", "poddisruptionbudgets", namespace, name), None)

    def deny(self, verb: str, resource: str, group: str = "", subresource: str = "",
             namespace: str | None = None) -> None:
        """SelfSubjectAccessReviews for this (``namespace`` None = any) answer allowed: false."""
        self.denied.append({"verb": verb, "group": group, "resource": resource, "subresource": subresource,
                            "namespace": namespace})

    def fail(self, verb: str, resource: str, code: int, reason: str, message: str = "", *, group: str = "",
             times: int | None = None) -> None:
        """The next ``times`` requests (None: every one) for ``verb`` on ``resource`` answer
        this ``Status`` instead of being served; they are still recorded in ``requests``."""
        self.faults.append({"verb": verb, "group": group, "resource": resource, "code": code, "reason": reason,
                            "message": message or f"injected {code} {reason}", "left": times})

    def forbid(self, verb: str, resource: str, group: str = "") -> None:
        """What an API server without that RBAC grant answers to every such request."""
        user = "system:serviceaccount:gpufleet:gpufleet-control-plane"
        self.fail(verb, resource, 403, "Forbidden", f'{resource} is forbidden: User "{user}" cannot {verb} '
                  f'resource "{resource}" in API group "{group}" at the cluster scope', group=group)

    def _injected(self, verb: str, group: str, resource: str) -> None:
        for fault in self.faults:
            if (fault["verb"], fault["group"], fault["resource"]) == (verb, group, resource) and fault["left"] != 0:
                if fault["left"] is not None:
                    fault["left"] -= 1
                raise ApiError(fault["code"], fault["reason"], fault["message"])

    # -- request handling ------------------------------------------------------------------
    def handle(self, method: str, raw_path: str, content_type: str, raw: bytes,
               authorization: str = "") -> tuple[int, dict[str, Any]]:
        if self.response_delay_s:
            time.sleep(self.response_delay_s)
        url = urlparse(raw_path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return 400, ApiError(400, "BadRequest", "request body is not JSON").status()
        with self.lock:
            self._reap()
            try:
                self._caller = self.auth.authenticate(authorization) if self.auth else ADMIN
            except Unauthorized:
                return 401, ApiError(401, "Unauthorized", "Unauthorized").status()
            try:
                # Names are path segments, percent-encoded by clients (kubeadm's RBAC names hold ':').
                return self._dispatch(method, unquote(url.path), query, content_type.split(";")[0].strip(), body)
            except Forbidden as error:
                return 403, ApiError(403, "Forbidden", str(error)).status()
            except ApiError as error:
                return error.code, error.status()
            except Exception as error:  # noqa: BLE001 - a bug here must show up as such in the test
                return 500, ApiError(500, "InternalError", f"fake API server bug: {error!r}").status()

    def _dispatch(self, method: str, path: str, query: dict[str, str], ctype: str, body: Any):
        if path == "/version":
            return 200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0-fake"}
        if m := re.fullmatch(r"/api/v1/(.+)", path):
            group, rest = "", m.group(1)
        elif m := re.fullmatch(r"/apis/([^/]+)/([^/]+)/(.+)", path):
            group, rest = m.group(1), m.group(3)
        else:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        parts = rest.strip("/").split("/")
        namespace = ""
        if parts[0] == "namespaces" and len(parts) >= 3:
            namespace, parts = parts[1], parts[2:]
        resource = parts[0]
        name = parts[1] if len(parts) > 1 else ""
        sub = parts[2] if len(parts) > 2 else ""
        verb = {"GET": "get" if name else ("watch" if query.get("watch") in ("1", "t", "T", "true", "True", "TRUE") else "list"),
                "POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if name else "deletecollection"}[method]
        if group == "authorization.k8s.io" and resource == "selfsubjectaccessreviews" and method == "POST":
            self.requests.append(("create", group, resource, "", ""))
            return 201, self._access_review(body or {})
        user, groups = self._caller
        if self._caller is ADMIN:
            self.requests.append((verb, group, resource, sub, namespace))
            if method != "GET":
                self.writes.append((method, path))
        else:  # a kubelet, a bootstrap token: not the adapter
            self.others.append((user, verb, group, resource, sub, namespace, name))
        self._injected(verb, group, resource)
        if (group, resource) not in RESOURCES:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        if self.auth:
            self.auth.authorize(user, groups, verb, group, resource, sub, namespace, name)
        if verb == "watch":
            return 200, Watch(group, resource, namespace, query)
        if sub:
            if (group, resource, sub, method) == ("", "pods", "eviction", "POST"):
                return self._evict(namespace, name, body or {})
            if (group, resource, sub, method) == ("certificates.k8s.io", "certificatesigningrequests", "approval", "PUT"):
                return 200, self._approval(name, body or {})
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        if self.auth and resource == "nodes" and method in ("POST", "PUT", "PATCH"):
            return self._admitted_node_write(method, name, query, ctype, body, user, groups)
        if self.auth and resource == "certificatesigningrequests" and method == "POST":
            self.auth.on_create_csr(user, groups, body or {})
            created = self._create(group, resource, namespace, body or {})
            stored = self.store[self._key(group, resource, "", created["metadata"]["name"])]
            if self.auth.controllers(stored):
                stored["metadata"]["resourceVersion"] = self._next_rv()
            return 201, self._render(group, resource, stored)
        if method == "GET":
            return (200, self._read(group, resource, namespace, name)) if name else (
                200, self._list(group, resource, namespace, query))
        if method == "POST":
            return 201, self._create(group, resource, namespace, body or {})
        if method == "PUT":
            return 200, self._update(group, resource, namespace, name, body or {})
        if method == "PATCH":
            return 200, self._patch(group, resource, namespace, name, ctype, body)
        if method == "DELETE" and name:
            return 200, self._delete(group, resource, namespace, name, body or {})
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")

    # -- joining: auth, CSRs, NodeRestriction (tests/cluster/fake_auth.py) -----------------
    def enable_bootstrap(self) -> "FakeKube":
        """Authentication, RBAC for bootstrap tokens and nodes, the CSR controllers and
        NodeRestriction, and kubeadm's ``kube-public/cluster-info`` with this server's CA."""
        with self.lock:
            self.auth = FakeAuth(self)
            if ("", "configmaps", "kube-public", "cluster-info") not in self.store:
                self._create("", "configmaps", "kube-public", self.auth.cluster_info(self.url))
        return self

    def _admitted_node_write(self, method: str, name: str, query: dict[str, str], ctype: str, body: Any,
                             user: str, groups: list[str]) -> tuple[int, dict[str, Any]]:
        key = ("", "nodes", "", name or ((body or {}).get("metadata") or {}).get("name", ""))
        old = copy.deepcopy(self.store.get(key))
        if method == "POST":
            code, result = 201, self._create("", "nodes", "", body or {})
        elif method == "PUT":
            code, result = 200, self._update("", "nodes", "", name, body or {})
        else:
            code, result = 200, self._patch("", "nodes", "", name, ctype, body)
        try:
            self.auth.admit_node(user, groups, old, self.store[key])
        except Forbidden:
            if old is None:
                self.store.pop(key, None)
            else:
                self.store[key] = old
            raise
        return code, result

    def _approval(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """The approval subresource: only the Approved/Denied conditions change; they are final."""
        stored = self._stored("certificates.k8s.io", "certificatesigningrequests", "", name)
        sent = (body.get("metadata") or {}).get("resourceVersion")
        if sent and sent != stored["metadata"]["resourceVersion"]:
            raise _conflict("certificates.k8s.io", "certificatesigningrequests", name)
        wanted = [c for c in (body.get("status") or {}).get("conditions") or []]
        types = {c.get("type") for c in wanted}
        if {"Approved", "Denied"} <= types or not types <= {"Approved", "Denied", "Failed"}:
            raise ApiError(422, "Invalid", "status.conditions: Approved and Denied conditions are mutually exclusive")
        had = {c.get("type") for c in (stored.get("status") or {}).get("conditions") or []}
        if had & {"Approved", "Denied"} and not had >= types:
            raise ApiError(422, "Invalid", "status.conditions: a CSR's approval or denial cannot be changed")
        stored.setdefault("status", {})["conditions"] = copy.deepcopy(wanted)
        self.auth.controllers(stored) if self.auth else None
        stored["metadata"]["resourceVersion"] = self._next_rv()
        return self._render("certificates.k8s.io", "certificatesigningrequests", stored)

    # -- verbs ------------------------------------------------------------------------------
    def _key(self, group: str, resource: str, namespace: str, name: str) -> tuple[str, str, str, str]:
        return (group, resource, namespace if RESOURCES[(group, resource)][2] else "", name)

    def _stored(self, group: str, resource: str, namespace: str, name: str) -> dict[str, Any]:
        obj = self.store.get(self._key(group, resource, namespace, name))
        if obj is None:
            raise _not_found(group, resource, name)
        return obj

    def _read(self, group: str, resource: str, namespace: str, name: str) -> dict[str, Any]:
        return self._render(group, resource, self._stored(group, resource, namespace, name))

    def _list(self, group: str, resource: str, namespace: str, query: dict[str, str]) -> dict[str, Any]:
        version, kind, _ = RESOURCES[(group, resource)]
        items = []
        for (g, r, ns, _), obj in sorted(self.store.items()):
            if g != group or r != resource or (namespace and ns != namespace):
                continue
            if query.get("labelSelector") and not label_selector_matches(
                    query["labelSelector"], obj["metadata"].get("labels") or {}):
                continue
            if query.get("fieldSelector") and not field_selector_matches(query["fieldSelector"], resource, obj):
                continue
            items.append(self._render(group, resource, obj))
        api_version = f"{group}/{version}" if group else version
        return {"apiVersion": api_version, "kind": f"{kind}List",
                "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _validate(self, group: str, resource: str, obj: dict[str, Any]) -> None:
        name = obj["metadata"].get("name", "")
        # RBAC objects take any path segment name (kubeadm's hold a ':').
        if not NAME_RE.fullmatch(name) and not (group == "rbac.authorization.k8s.io" and name and "/" not in name):
            raise ApiError(422, "Invalid", f'metadata.name: Invalid value: "{name}": a lowercase RFC 1123 subdomain')
        for key, value in (obj["metadata"].get("labels") or {}).items():
            if not isinstance(value, str) or len(value) > 63 or not re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?", value):
                # As a real API server says it: the field in the cause's ``field``, not in its message.
                raise ApiError(422, "Invalid", f'{obj.get("kind", "object")} "{name}" is invalid: metadata.labels: '
                               f'Invalid value: "{value}"', {"causes": [{
                                   "reason": "FieldValueInvalid", "field": "metadata.labels",
                                   "message": f'Invalid value: "{value}": a valid label must be an empty string or '
                                              "consist of alphanumeric characters"}]})
        if resource == "nodes":
            for taint in (obj.get("spec") or {}).get("taints") or []:
                if not taint.get("key") or taint.get("effect") not in TAINT_EFFECTS:
                    raise ApiError(422, "Invalid", f"spec.taints: Invalid value: {taint!r}")
        if resource == "configmaps":
            for key, value in (obj.get("data") or {}).items():
                if not re.fullmatch(r"[-._a-zA-Z0-9]+", key) or not isinstance(value, str):
                    raise ApiError(422, "Invalid", f"data[{key}]: Invalid value")
        if resource == "deployments":
            spec = obj.get("spec") or {}
            selector = (spec.get("selector") or {}).get("matchLabels") or {}
            labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
            if not selector or any(labels.get(k) != v for k, v in selector.items()):
                raise ApiError(422, "Invalid", "spec.template.metadata.labels: Invalid value: "
                               "`selector` does not match template `labels`")
            for container in ((spec.get("template") or {}).get("spec") or {}).get("containers") or []:
                resources = container.get("resources") or {}
                requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
                if GPU_RESOURCE in requests and requests.get(GPU_RESOURCE) != limits.get(GPU_RESOURCE):
                    raise ApiError(422, "Invalid", f"spec.template.spec.containers[{container.get('name')}]."
                                   f"resources.requests: Invalid value: must be equal to {GPU_RESOURCE} limit")
        if resource == "httproutes":
            for rule in (obj.get("spec") or {}).get("rules") or []:
                refs = rule.get("backendRefs") or []
                if len(refs) > 16:
                    raise ApiError(422, "Invalid", "spec.rules.backendRefs: Too many: must have at most 16 items")
                for ref in refs:
                    if not 0 <= ref.get("weight", 1) <= 1_000_000:
                        raise ApiError(422, "Invalid", "spec.rules.backendRefs.weight: must be <= 1000000")

    def _create(self, group: str, resource: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        version, kind, namespaced = RESOURCES[(group, resource)]
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if namespaced:
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the "
                               "namespace sent on the request")
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        obj["apiVersion"] = f"{group}/{version}" if group else version
        obj["kind"] = kind
        if resource == "secrets":
            self._fold_string_data(obj)
        self._validate(group, resource, obj)
        key = self._key(group, resource, meta.get("namespace", ""), meta["name"])
        if key in self.store:
            qualified = f"{resource}.{group}" if group else resource
            raise ApiError(409, "AlreadyExists", f'{qualified} "{meta["name"]}" already exists',
                           {"name": meta["name"], "group": group, "kind": resource})
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), creationTimestamp=_now())
        if (group, resource) in WITH_GENERATION:
            meta["generation"] = 1
            self._spec_changed_at[(meta["namespace"], meta["name"])] = time.monotonic()
        self.store[key] = obj
        return self._render(group, resource, obj)

    @staticmethod
    def _fold_string_data(obj: dict[str, Any]) -> None:
        string_data = obj.pop("stringData", None) or {}
        data = obj.setdefault("data", {}) or {}
        for key, value in string_data.items():
            data[key] = base64.b64encode(value.encode()).decode()
        obj["data"] = data

    def _commit(self, group: str, resource: str, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        """Store ``new`` in place of ``old``: a no-op keeps the resourceVersion."""
        meta, old_meta = new.setdefault("metadata", {}), old["metadata"]
        if meta.get("name") != old_meta["name"]:
            raise ApiError(400, "BadRequest", "metadata.name: the name of the object does not match the request")
        for field in ("uid", "creationTimestamp", "namespace", "generation"):
            if field in old_meta:
                meta[field] = old_meta[field]
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        if resource == "secrets":
            self._fold_string_data(new)
        if resource in ("deployments", "httproutes") and "status" in old:
            new["status"] = old["status"]  # status is a subresource
        elif resource in ("deployments", "httproutes"):
            new.pop("status", None)
        self._validate(group, resource, new)
        was = (old.get("spec") or {}).get("providerID") if resource == "nodes" else None
        if was and (new.get("spec") or {}).get("providerID") != was:
            raise ApiError(422, "Invalid", 'spec.providerID: Forbidden: node updates may not change providerID '
                           'except from "" to valid')
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if _comparable(new) == _comparable(old):
            return self._render(group, resource, old)
        if (group, resource) in WITH_GENERATION and new.get("spec") != old.get("spec"):
            meta["generation"] = old_meta.get("generation", 1) + 1
            self._spec_changed_at[(meta.get("namespace", ""), meta["name"])] = time.monotonic()
        meta["resourceVersion"] = self._next_rv()
        self.store[self._key(group, resource, meta.get("namespace", ""), meta["name"])] = new
        return self._render(group, resource, new)

    def _update(self, group: str, resource: str, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        old = self._stored(group, resource, namespace, name)
        new = copy.deepcopy(body)
        sent = (new.get("metadata") or {}).get("resourceVersion")
        if sent and sent != old["metadata"]["resourceVersion"]:
            raise _conflict(group, resource, name)
        return self._commit(group, resource, old, new)

    def _patch(self, group: str, resource: str, namespace: str, name: str, ctype: str, body: Any) -> dict[str, Any]:
        old = self._stored(group, resource, namespace, name)
        if ctype == "application/merge-patch+json":
            new = merge_patch(old, body)
        elif ctype == "application/strategic-merge-patch+json":
            if group in ("gateway.networking.k8s.io", "gateway.envoyproxy.io"):
                raise ApiError(415, "UnsupportedMediaType", "strategic merge patch is not supported for "
                               "custom resources")
            new = strategic_merge_patch(old, body)
        elif ctype == "application/json-patch+json":
            new = json_patch(old, body)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {ctype}")
        sent = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
        if sent and sent != old["metadata"]["resourceVersion"]:
            raise _conflict(group, resource, name)
        return self._commit(group, resource, old, copy.deepcopy(new))

    def _delete(self, group: str, resource: str, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        key = self._key(group, resource, namespace, name)
        obj = self._stored(group, resource, namespace, name)
        preconditions = body.get("preconditions") or {}
        if preconditions.get("resourceVersion") and preconditions["resourceVersion"] != obj["metadata"][
                "resourceVersion"]:
            raise _conflict(group, resource, name)
        if preconditions.get("uid") and preconditions["uid"] != obj["metadata"]["uid"]:
            raise _conflict(group, resource, name)
        self._remove(key, obj)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": name, "group": group, "kind": resource, "uid": obj["metadata"]["uid"]}}

    def _remove(self, key: tuple[str, str, str, str], obj: dict[str, Any]) -> None:
        delay = float((obj["metadata"].get("annotations") or {}).get(TERMINATING_ANNOTATION) or 0)
        if key[1] == "pods" and delay:
            if "deletionTimestamp" not in obj["metadata"]:
                obj["metadata"]["deletionTimestamp"] = _now()
                obj["metadata"]["resourceVersion"] = self._next_rv()
                self._remove_at[key] = time.monotonic() + delay
            return
        self.store.pop(key, None)

    def _reap(self) -> None:
        now = time.monotonic()
        for key, at in list(self._remove_at.items()):
            if at <= now:
                self.store.pop(key, None)
                del self._remove_at[key]

    # -- subresources and computed status ---------------------------------------------------------
    def _pdbs_for(self, pod: dict[str, Any]) -> list[dict[str, Any]]:
        labels = pod["metadata"].get("labels") or {}
        namespace = pod["metadata"]["namespace"]
        return [o for (g, r, ns, _), o in sorted(self.store.items())
                if (g, r, ns) == ("policy", "poddisruptionbudgets", namespace)
                and all(labels.get(k) == v for k, v in o["spec"]["selector"].get("matchLabels", {}).items())]

    def _pdb_status(self, pdb: dict[str, Any]) -> dict[str, Any]:
        selector = pdb["spec"]["selector"].get("matchLabels", {})
        namespace = pdb["metadata"]["namespace"]
        pods = [o for (g, r, ns, _), o in self.store.items()
                if (g, r, ns) == ("", "pods", namespace)
                and o["status"].get("phase") not in ("Succeeded", "Failed")
                and all((o["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())]
        healthy = sum(1 for p in pods if p["status"].get("phase") == "Running"
                      and "deletionTimestamp" not in p["metadata"])
        if "minAvailable" in pdb["spec"]:
            desired = int(pdb["spec"]["minAvailable"])
        else:
            desired = max(0, len(pods) - int(pdb["spec"].get("maxUnavailable", 0)))
        return {"observedGeneration": pdb["metadata"].get("generation", 1), "currentHealthy": healthy,
                "desiredHealthy": desired, "expectedPods": len(pods),
                "disruptionsAllowed": max(0, healthy - desired)}

    def _evict(self, namespace: str, name: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if body.get("kind") not in (None, "Eviction"):
            raise ApiError(400, "BadRequest", f"expected an Eviction, got {body.get('kind')}")
        key = ("", "pods", namespace, name)
        pod = self._stored("", "pods", namespace, name)
        if pod["status"].get("phase") not in ("Succeeded", "Failed") and "deletionTimestamp" not in pod["metadata"]:
            budgets = self._pdbs_for(pod)
            if len(budgets) > 1:
                raise ApiError(500, "InternalError", "This pod has more than one PodDisruptionBudget, which the "
                               "eviction subresource does not support.")
            if budgets:
                status = self._pdb_status(budgets[0])
                if status["disruptionsAllowed"] <= 0:
                    pdb = budgets[0]["metadata"]["name"]
                    raise ApiError(
                        429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget.",
                        {"causes": [{"reason": "DisruptionBudget",
                                     "message": f"The disruption budget {pdb} needs {status['desiredHealthy']} "
                                                f"healthy pods and has {status['currentHealthy']} currently"}]})
        self._remove(key, pod)
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _access_review(self, body: dict[str, Any]) -> dict[str, Any]:
        attrs = (body.get("spec") or {}).get("resourceAttributes") or {}
        asked = {k: attrs.get(k) or "" for k in ("verb", "group", "resource", "subresource", "namespace")}
        denied = any(
            all(rule[k] == asked[k] for k in ("verb", "group", "resource", "subresource"))
            and (rule["namespace"] is None or rule["namespace"] == asked["namespace"])
            for rule in self.denied
        )
        status = {"allowed": not denied}
        status["reason"] = "" if denied else 'RBAC: allowed by ClusterRoleBinding "fake"'
        return {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "metadata": {"creationTimestamp": None}, "spec": body.get("spec") or {}, "status": status}

    def _nodes(self) -> list[Node]:
        nodes = []
        for (g, r, _, _), obj in self.store.items():
            if (g, r) != ("", "nodes"):
                continue
            status, spec = obj.get("status") or {}, obj.get("spec") or {}
            nodes.append(Node(
                name=obj["metadata"]["name"], labels=obj["metadata"].get("labels") or {},
                taints=[format_taint(t["key"], t.get("value"), t["effect"]) for t in spec.get("taints") or []],
                ready=any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []),
                unschedulable=bool(spec.get("unschedulable")),
                gpus_allocatable=int((status.get("allocatable") or {}).get(GPU_RESOURCE, "0")),
            ))
        return nodes

    def _render(self, group: str, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(obj)
        if resource == "poddisruptionbudgets":
            out["status"] = self._pdb_status(obj)
        if resource == "deployments":
            out["status"] = self._deployment_status(obj)
        return out

    def _deployment_status(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta, spec = obj["metadata"], obj.get("spec") or {}
        generation = meta.get("generation", 1)
        desired = spec.get("replicas", 1)
        changed = self._spec_changed_at.get((meta["namespace"], meta["name"]), 0.0)
        if time.monotonic() - changed < self.rollout_delay_s:
            return obj.get("status") or {"observedGeneration": generation - 1}
        pod_spec = (spec.get("template") or {}).get("spec") or {}
        site = (pod_spec.get("nodeSelector") or {}).get(LABEL_SITE, "")
        containers = pod_spec.get("containers") or [{}]
        gpus = int(((containers[0].get("resources") or {}).get("limits") or {}).get(GPU_RESOURCE, "0"))
        available = min(desired, serving_capacity(self._nodes(), site, gpus))
        status = {"observedGeneration": generation, "replicas": desired, "updatedReplicas": desired,
                  "readyReplicas": available, "availableReplicas": available,
                  "unavailableReplicas": desired - available}
        obj["status"] = status  # what a later rollout starts from
        return status
