"""The cluster port over the official ``kubernetes`` client.

Every call goes through the generated client (paths, auth, TLS, kubeconfig) but
reads and writes plain JSON (``_preload_content=False``), so fields newer than
the client's models survive a read-modify-write.

Objects this adapter owns
-------------------------
* Join tokens: a bootstrap token Secret ``kube-system/bootstrap-token-<id>``
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
* Kubelet certificates: ``review_csrs`` is gpufleet's approver. A client CSR
  from ``system:bootstrap:<id>`` (the requester the API server authenticated,
  never the request body) is approved only when token ``<id>`` is gpufleet's
  and was issued for exactly the node in the CSR's subject; a renewal from
  ``system:node:<name>`` only for ``<name>``, and only while ``<name>`` is a live
  gpufleet node (its identity record) or a control-plane node (``CONTROL_PLANE_LABEL``);
  any other node's client renewal is denied, so kubeadm's self-renewal binding can go
  and a removed node's certificate is its last. A kubelet-serving CSR only when
  its names are the node's name and the addresses the provider reports for its
  machine. Other CSRs (other signers, other requesters) are left alone.
* Node identity: which machine, provider, account and site a node is comes
  from the join's record (control-plane state ``node-identity``), never from
  the node's labels or annotations, which its kubelet may write.
* The bootstrap channel (joins started before the bootstrap went into the
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
* Nodes: only our labels, annotations and taints are touched (label and
  annotation patches are merges; taints are read-modify-write under the
  node's resourceVersion, retried on 409).
* Serving: per model and site a Deployment and a Service named
  ``serving_name(model, site)`` in the adapter's namespace. The pod template we
  rendered is kept in the annotation ``gpufleet.io/template`` and the one before
  it in ``gpufleet.io/previous-template``; ``rollback_serving`` swaps them.
* Control-plane state (``read_state``/``update_state``/``list_state``/``delete_state``): one
  ConfigMap per (kind, key), ``state_object_name(kind, key)`` in the adapter's
  namespace, label ``gpufleet.io/state=<kind>``, the key in the annotation
  ``gpufleet.io/state-key``. Every write is a create (409 AlreadyExists: someone
  else created it first) or a replace under the resourceVersion read (409
  Conflict: someone else wrote first); either way the object is read again and
  the change applied again, so two writers never lose each other's change.
* Routing: per model one Gateway API ``HTTPRoute`` (``<model>``, one
  backendRef per site Service, weighted) and the ConfigMap ``gpufleet-routing``
  (key ``<model>``: JSON ``{"model", "version", "sites": {site: {weight,
  healthy, draining, incident}}}``). Each is written by one
  resourceVersion-checked replace, and only when its content changes.

``ACCESS`` is the one list of every API permission this adapter uses;
``providers.cluster.check`` asks the cluster about each, and the RBAC
manifests in ``deploy/kubernetes/rbac.yaml`` grant exactly these.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
import os
import random
import re
import secrets
import string
import time
from datetime import datetime, timezone
from typing import Any, Callable, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from fleet.demand import DEMAND_ANNOTATIONS, GpuPod, Toleration
from fleet.errors import ClusterConflict, ClusterError, ClusterForbidden, ClusterInvalid, NotFound, Transient
from fleet.models import CredentialsRef, Node
from fleet.weights_pull import CACHE_ROOT as WEIGHTS_CACHE_ROOT
from fleet.weights_pull import ENV as WEIGHTS_ENV
from fleet.weights_pull import KEY_ENV as WEIGHTS_KEY_ENV
from providers.cluster.bootstrap import BOOTSTRAP_GROUP, BootstrapToken, ca_cert_hash
from providers.cluster.envoy_gateway import (
    ENVOY_GROUP,
    ENVOY_VERSION,
    render_backend_traffic_policy,
    render_httproute,
    render_httproute_spec,
)
from providers.cluster.base import (
    ANNOTATION_MODEL,
    GATEWAY_GROUP,
    GATEWAY_VERSION,
    AccessRule,
    CLIENT_SIGNER,
    CONTROL_PLANE_LABEL,
    CsrDecision,
    csr_decision,
    EvictOutcome,
    NodeNotFound,
    NoPreviousTemplate,
    PodInfo,
    SERVING_TOLERATED,
    ServingNotFound,
    StateChange,
    apply_taints,
    check_state_data,
    dns_label,
    format_taint,
    label_value as _label_value,
    parse_taint,
    routing_sites,
    run_drain,
    serving_name,
    state_object_name,
)
from fleet.cluster import (
    ANNOTATION_MACHINE_ID,
    ANNOTATION_PREVIOUS_TEMPLATE,
    ANNOTATION_TEMPLATE,
    GPU_RESOURCE,
    NODE_IDENTITY_KIND,
    NODE_KEYS_KIND,
    NodeIdentity,
    bound_keys,
    client_key_fingerprint,
    with_key,
    LABEL_MODEL,
    LABEL_PROVIDER,
    LABEL_SITE,
    MAX_JOIN_TOKEN_TTL_S,
    SERVING_PORT,
    DrainResult,
    JoinTokenRef,
    RoutingTable,
    ServingSpec,
    ServingStatus,
    SITE_ROUTES,
    SiteRoute,
)

PROVIDER = "kubernetes"
TOKEN_NAMESPACE = "kube-system"
BOOTSTRAP_NAMESPACE = "gpufleet-bootstrap"
ROUTING_CONFIGMAP = "gpufleet-routing"
LABEL_TOKEN_ID = "gpufleet.io/token-id"
#: Control-plane state ConfigMaps: their kind (label) and their key as the caller spelled it.
LABEL_STATE = "gpufleet.io/state"
ANNOTATION_STATE_KEY = "gpufleet.io/state-key"
ANNOTATION_NODE_NAME = "gpufleet.io/node-name"
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
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
CSR_GROUP = "certificates.k8s.io"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
#: Stands for the adapter's namespace in ``ACCESS``.
SERVING_NS = "{namespace}"

_TOKEN_ID = re.compile(r"^[a-z0-9]{6}$")
JOIN_ENDPOINT_ENV = "GPUFLEET_JOIN_ENDPOINT"


def _rule(verb: str, group: str, resource: str, namespace: str, purpose: str, sub: str = "") -> AccessRule:
    return AccessRule(verb=verb, group=group, resource=resource, subresource=sub, namespace=namespace, purpose=purpose)


#: Every (verb, group, resource, subresource, namespace) the adapter calls.
#: Namespace "" means cluster-wide (a ClusterRole); ``SERVING_NS`` is the
#: adapter's own namespace. ``check_access`` and the RBAC test read this table.
ACCESS: tuple[AccessRule, ...] = (
    _rule("get", "", "nodes", "", "get_node, set_taints"),
    _rule("list", "", "nodes", "", "list_nodes"),
    _rule("watch", "", "nodes", "", "watch_nodes: a Site entity's nodes (Ready, cordoned, proven)"),
    _rule("patch", "", "nodes", "", "labels, annotations, taints, cordon"),
    _rule("delete", "", "nodes", "", "remove_node"),
    _rule("list", "", "pods", "", "drain: pods on the node; demand: Pending GPU pods (every namespace)"),
    _rule("watch", "", "pods", "", "watch_gpu_pods: the demand loop's Pending GPU pods (every namespace)"),
    _rule("create", "", "pods", "", "drain: Eviction API", sub="eviction"),
    _rule("delete", "", "pods", "", "drain --force: delete past the PDB"),
    _rule("create", "", "secrets", TOKEN_NAMESPACE, "join token: bootstrap token Secret"),
    _rule("delete", "", "secrets", TOKEN_NAMESPACE, "join token: revoke"),
    _rule("get", "", "configmaps", "kube-public", "join: API endpoint and CA hash (cluster-info)"),
    _rule("list", CSR_GROUP, "certificatesigningrequests", "", "CSR approver: pending kubelet CSRs"),
    _rule("watch", CSR_GROUP, "certificatesigningrequests", "", "CSR approver: new kubelet CSRs (watch_open_csrs)"),
    _rule("update", CSR_GROUP, "certificatesigningrequests", "", "CSR approver: approve or deny",
          sub="approval"),
    _rule("approve", CSR_GROUP, "signers", "", "CSR approver: kubelet client and serving signers"),
    _rule("create", "", "secrets", BOOTSTRAP_NAMESPACE, "join token: bootstrap channel; the token key"),
    _rule("get", "", "secrets", BOOTSTRAP_NAMESPACE, "bootstrap channel: fetch, replace; the token key"),
    _rule("list", "", "secrets", BOOTSTRAP_NAMESPACE, "join token: revoke (by token id)"),
    _rule("delete", "", "secrets", BOOTSTRAP_NAMESPACE, "bootstrap channel: revoke, fetch once"),
    _rule("get", "apps", "deployments", SERVING_NS, "serving status"),
    _rule("list", "apps", "deployments", SERVING_NS, "list_serving (site evacuation)"),
    _rule("create", "apps", "deployments", SERVING_NS, "apply_serving"),
    _rule("update", "apps", "deployments", SERVING_NS, "apply_serving, rollback_serving"),
    _rule("patch", "apps", "deployments", SERVING_NS, "scale_serving"),
    _rule("delete", "apps", "deployments", SERVING_NS, "delete_serving"),
    _rule("get", "", "services", SERVING_NS, "apply_serving"),
    _rule("create", "", "services", SERVING_NS, "apply_serving"),
    _rule("patch", "", "services", SERVING_NS, "apply_serving"),
    _rule("delete", "", "services", SERVING_NS, "delete_serving"),
    _rule("get", "policy", "poddisruptionbudgets", SERVING_NS, "apply_serving: one replica down at a time"),
    _rule("create", "policy", "poddisruptionbudgets", SERVING_NS, "apply_serving"),
    _rule("patch", "policy", "poddisruptionbudgets", SERVING_NS, "apply_serving"),
    _rule("get", "", "configmaps", SERVING_NS, "routing table, control-plane state (join tokens: CSR approver)"),
    _rule("list", "", "configmaps", SERVING_NS, "control-plane state: list_state (join tokens: retry, revoke)"),
    _rule("create", "", "configmaps", SERVING_NS, "routing table, control-plane state"),
    _rule("update", "", "configmaps", SERVING_NS, "routing table, control-plane state (resourceVersion-checked)"),
    _rule("delete", "", "configmaps", SERVING_NS, "control-plane state: a retired node's identity record"),
    _rule("get", GATEWAY_GROUP, "httproutes", SERVING_NS, "routing weights"),
    _rule("create", GATEWAY_GROUP, "httproutes", SERVING_NS, "routing weights"),
    _rule("update", GATEWAY_GROUP, "httproutes", SERVING_NS, "routing weights (resourceVersion-checked)"),
    _rule("get", "gateway.envoyproxy.io", "backendtrafficpolicies", SERVING_NS, "routing: stickiness, retries"),
    _rule("create", "gateway.envoyproxy.io", "backendtrafficpolicies", SERVING_NS, "routing: stickiness, retries"),
    _rule("update", "gateway.envoyproxy.io", "backendtrafficpolicies", SERVING_NS,
          "routing: stickiness, retries (resourceVersion-checked)"),
)


def access_table(namespace: str = "gpufleet") -> list[AccessRule]:
    """``ACCESS`` with the adapter's namespace filled in."""
    return [r.model_copy(update={"namespace": namespace}) if r.namespace == SERVING_NS else r for r in ACCESS]


# -- connecting ------------------------------------------------------------------------
def _gpu_count(container: dict[str, Any]) -> int:
    resources = container.get("resources") or {}
    # An extended resource may be given as a limit only: the request then equals it.
    value = (resources.get("requests") or {}).get(GPU_RESOURCE, (resources.get("limits") or {}).get(GPU_RESOURCE, 0))
    try:
        return int(parse_quantity(str(value)))
    except ValueError:
        return 0


def gpu_pod(pod: dict[str, Any]) -> GpuPod:
    """A Pod object as the demand loop reads it (its effective GPU request: the containers'
    sum, or an init container's, whichever is larger, as the scheduler counts it)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    gpus = max(sum(_gpu_count(c) for c in spec.get("containers") or []),
               max((_gpu_count(c) for c in spec.get("initContainers") or []), default=0))
    conditions = status.get("conditions") or []
    created = meta.get("creationTimestamp")
    try:
        created_at = datetime.fromisoformat(str(created).replace("Z", "+00:00")).timestamp() if created else 0.0
    except ValueError:
        created_at = 0.0
    return GpuPod(
        namespace=meta.get("namespace", ""), name=meta.get("name", ""), uid=meta.get("uid", ""),
        node=spec.get("nodeName") or "", phase=status.get("phase") or "Pending", gpus=gpus,
        labels=meta.get("labels") or {},
        annotations={k: v for k, v in (meta.get("annotations") or {}).items() if k in DEMAND_ANNOTATIONS},
        node_selector=spec.get("nodeSelector") or {},
        tolerations=[Toleration(key=t.get("key") or "", operator=t.get("operator") or "Equal",
                                value=t.get("value") or "", effect=t.get("effect") or "")
                     for t in spec.get("tolerations") or []],
        nominated_node=status.get("nominatedNodeName") or "",
        unschedulable=any(c.get("type") == "PodScheduled" and c.get("status") == "False"
                          and c.get("reason") == "Unschedulable" for c in conditions),
        owner_kinds=[o.get("kind", "") for o in meta.get("ownerReferences") or []],
        created_at=created_at,
    )


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> k8s.ApiClient:
    """``kubeconfig`` (and ``context``) if given; else the in-cluster service
    account when running in a pod; else ``$KUBECONFIG`` / ``~/.kube/config``."""
    if kubeconfig:
        return k8s_config.new_client_from_config(config_file=kubeconfig, context=context)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not context:
        configuration = k8s.Configuration()
        k8s_config.load_incluster_config(client_configuration=configuration)
        return k8s.ApiClient(configuration)
    return k8s_config.new_client_from_config(context=context)


# -- naming ----------------------------------------------------------------------------
def _name_part(value: str) -> str:
    return re.sub(r"[^a-z0-9.-]+", "-", value.lower()).strip("-.") or "x"


def bootstrap_secret_name(machine_id: str) -> str:
    """The bootstrap channel Secret of a machine (what its bootstrap fetch reads)."""
    return f"gpufleet-bootstrap-{_name_part(machine_id)}"[:253]


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _is_subset(want: Any, have: Any) -> bool:
    """Whether ``have`` holds everything in ``want`` (the server may add defaults)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_is_subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(_is_subset, want, have))
    return want == have


# -- rendering (deploy/kubernetes/serving-template.yaml and httproute-template.yaml
#    show the same objects; a test keeps them in step) ------------------------------------
def _serving_labels(spec_model: str, site: str) -> dict[str, str]:
    return {LABEL_MODEL: _label_value(dns_label(spec_model)), LABEL_SITE: _label_value(site)}


#: The model server's readiness: a replica that has not loaded its model answers no
#: traffic and counts for no capacity (OpenAI-compatible servers such as vLLM serve it).
READINESS_PROBE = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 2,
                   "failureThreshold": 3}


def _weights_init(spec: ServingSpec) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(init container, cache volume, path the server reads): the verified pull into the
    node-local cache. A store key held in a Kubernetes Secret reaches the init container as
    a secretKeyRef; the spec in the pod names only the variable."""
    pull = spec.weights
    store = pull.store
    env: list[dict[str, Any]] = []
    if store.credentials is not None and store.credentials.secret:
        ref = store.credentials.secret
        name, _, key = ref.partition("/")[2].partition("#")
        env.append({"name": WEIGHTS_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
        store = store.model_copy(update={"credentials": CredentialsRef(env=WEIGHTS_KEY_ENV)})
    else:  # a control-plane env/file reference means nothing on the node: the node's own role
        store = store.model_copy(update={"credentials": None})
    doc = pull.model_copy(update={"store": store}).model_dump_json(exclude_none=True)
    init = {
        "name": "weights",
        "image": pull.image,
        "command": ["python", "-m", "workers.weights_pull", "--cache", WEIGHTS_CACHE_ROOT],
        "env": [{"name": WEIGHTS_ENV, "value": doc}, *env],
        "volumeMounts": [{"name": "weights-cache", "mountPath": WEIGHTS_CACHE_ROOT}],
    }
    volume = {"name": "weights-cache", "hostPath": {"path": WEIGHTS_CACHE_ROOT, "type": "DirectoryOrCreate"}}
    return init, volume, pull.cache_dir()


def render_pod_template(spec: ServingSpec) -> dict[str, Any]:
    labels = {**_serving_labels(spec.model, spec.site), "app.kubernetes.io/managed-by": "gpufleet"}
    env = [{"name": "MODEL_NAME", "value": spec.model}]
    if spec.weights is not None:
        init, volume, weights_dir = _weights_init(spec)
        env.append({"name": "MODEL_WEIGHTS", "value": weights_dir})
    elif spec.weights_path:
        env.append({"name": "MODEL_WEIGHTS", "value": spec.weights_path})
    env += [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    gpus = str(spec.gpus_per_replica)
    container: dict[str, Any] = {
        "name": "server",
        "image": spec.image,
        "args": list(spec.args),
        "env": env,
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        "resources": {"requests": {GPU_RESOURCE: gpus}, "limits": {GPU_RESOURCE: gpus}},
        "readinessProbe": READINESS_PROBE,
    }
    pod: dict[str, Any] = {
        "nodeSelector": {LABEL_SITE: spec.site},
        # The GPU nodes' taints: the usual ``nvidia.com/gpu`` and the fleet taint every gpufleet
        # node keeps (what keeps the control plane off them).
        "tolerations": [{"key": key, "operator": "Exists", "effect": "NoSchedule"} for key in SERVING_TOLERATED],
        "containers": [container],
    }
    if spec.weights is not None:
        # The server starts only after the init step verified every file (it exits non-zero
        # on a mismatch), and reads the shared cache read-only.
        pod["initContainers"] = [init]
        container["volumeMounts"] = [{"name": "weights-cache", "mountPath": WEIGHTS_CACHE_ROOT, "readOnly": True}]
        pod["volumes"] = [volume]
    elif spec.weights_path:
        container["volumeMounts"] = [{"name": "weights", "mountPath": spec.weights_path, "readOnly": True}]
        pod["volumes"] = [{"name": "weights", "hostPath": {"path": spec.weights_path, "type": "Directory"}}]
    return {"metadata": {"labels": labels}, "spec": pod}


def render_deployment(spec: ServingSpec, namespace: str) -> dict[str, Any]:
    template = render_pod_template(spec)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": serving_name(spec.model, spec.site),
            "namespace": namespace,
            "labels": {**_serving_labels(spec.model, spec.site), "app.kubernetes.io/managed-by": "gpufleet"},
            "annotations": {ANNOTATION_MODEL: spec.model, ANNOTATION_TEMPLATE: _canonical(template)},
        },
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": _serving_labels(spec.model, spec.site)},
            # Surge keeps serving capacity during an update; without spare GPUs
            # (max_surge 0) pods are replaced one at a time instead.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxSurge": spec.max_surge, "maxUnavailable": 0 if spec.max_surge else 1}},
            "template": template,
        },
    }


def render_service(model: str, site: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": serving_name(model, site),
            "namespace": namespace,
            "labels": {**_serving_labels(model, site), "app.kubernetes.io/managed-by": "gpufleet"},
            "annotations": {ANNOTATION_MODEL: model},
        },
        "spec": {
            "selector": _serving_labels(model, site),
            "ports": [{"name": "http", "port": SERVING_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_model_service(model: str, namespace: str) -> dict[str, Any]:
    """The one Service that spans sites: every replica of ``model``, for callers inside the
    cluster (``<model>.<namespace>.svc``). ``PreferClose`` keeps a call among the caller's
    own zone, which is its site (``LABEL_ZONE``), while that site has a ready replica; only
    then does it cross sites (over the overlay; README "Network model"). Needs Kubernetes
    >= 1.31. The front door does not use it: it routes to the per-site Services by weight."""
    selector = {LABEL_MODEL: _label_value(dns_label(model))}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": dns_label(model),
            "namespace": namespace,
            "labels": {**selector, "app.kubernetes.io/managed-by": "gpufleet"},
            "annotations": {ANNOTATION_MODEL: model},
        },
        "spec": {
            "selector": selector,
            "trafficDistribution": "PreferClose",
            "ports": [{"name": "http", "port": SERVING_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_pdb(model: str, site: str, namespace: str) -> dict[str, Any]:
    """One replica of a model at a site down at a time: a node drain cannot take every
    replica at once, and one replica (an evacuation's last) can still be drained."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": serving_name(model, site),
            "namespace": namespace,
            "labels": {**_serving_labels(model, site), "app.kubernetes.io/managed-by": "gpufleet"},
            "annotations": {ANNOTATION_MODEL: model},
        },
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _serving_labels(model, site)}},
    }


# -- errors ----------------------------------------------------------------------------
def _status_of(error: ApiException) -> dict[str, Any]:
    try:
        body = json.loads(error.body or b"{}")
        return body if isinstance(body, dict) else {}
    except (TypeError, ValueError):
        return {}


def _message(error: ApiException) -> str:
    status = _status_of(error)
    # A real API server names the field in each cause's ``field``, not in its message (and may
    # repeat a cause): the field goes first, each cause once, so the error names what was wrong.
    causes: list[str] = []
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("message"):
            text = f"{cause['field']}: {cause['message']}" if cause.get("field") else cause["message"]
            if text not in causes:
                causes.append(text)
    return "; ".join(causes) or status.get("message") or error.reason or f"HTTP {error.status}"


#: HTTP status -> the permanent answers, each its own non-retryable type. 404 is the
#: shared ``NotFound``; 409 is ``_Conflict`` inside the adapter (re-read and tried
#: again, bounded) and ``ClusterConflict`` (retryable) past that. Everything else
#: (429, 5xx, timeouts, a refused connection, a status nobody listed) is ``Transient``.
ERROR_STATUSES: dict[int, type[ClusterError]] = {
    401: ClusterForbidden,
    403: ClusterForbidden,
    400: ClusterInvalid,
    405: ClusterInvalid,
    406: ClusterInvalid,
    413: ClusterInvalid,
    414: ClusterInvalid,
    415: ClusterInvalid,
    422: ClusterInvalid,
}


def _translate(error: Exception, what: str) -> Exception:
    if isinstance(error, ApiException):
        code, message = error.status, f"{what}: {_message(error)}"
        if code in ERROR_STATUSES:
            return ERROR_STATUSES[code](message, code=str(code))
        if code == 404:
            return NotFound(message, provider=PROVIDER, code="404")
        if code == 409:
            return ClusterConflict(message, code="409")
        return Transient(message, provider=PROVIDER, code=str(code))
    return Transient(f"{what}: {error}", provider=PROVIDER, code=type(error).__name__)


class _Gone(Exception):
    """A watch's resourceVersion is gone (410): list again."""


class _Conflict(Exception):
    pass


#: Re-reads of one object after a 409 before the call gives up as ``ClusterConflict``
#: (a write loses only to another writer, which is done in milliseconds).
_RETRY_CONFLICTS = 12
#: The first pause after a conflict (doubled per try, jittered, at most the max).
_CONFLICT_PAUSE_S, _CONFLICT_PAUSE_MAX_S = 0.01, 0.5

T = TypeVar("T")


class KubernetesCluster:
    def __init__(
        self,
        api_client: k8s.ApiClient | None = None,
        kubeconfig: str | None = None,
        namespace: str = "gpufleet",
        *,
        context: str | None = None,
        gateway: str = "gpufleet",
        gateway_namespace: str | None = None,
        bootstrap_namespace: str = BOOTSTRAP_NAMESPACE,
        request_timeout_s: float = 30.0,
        join_endpoint: str | None = None,
    ) -> None:
        self.api_client = api_client or load_api_client(kubeconfig, context)
        #: (connect, read) timeout of every call, so a hung API server cannot hold an activity forever.
        self.request_timeout = (min(10.0, request_timeout_s), request_timeout_s)
        self.namespace = namespace
        self.gateway = gateway
        self.gateway_namespace = gateway_namespace or namespace
        self.bootstrap_namespace = bootstrap_namespace
        self.core = k8s.CoreV1Api(self.api_client)
        self.apps = k8s.AppsV1Api(self.api_client)
        self.policy = k8s.PolicyV1Api(self.api_client)
        self.custom = k8s.CustomObjectsApi(self.api_client)
        self.certificates = k8s.CertificatesV1Api(self.api_client)
        #: Where machines reach the API server, when not what ``kube-public/cluster-info`` says.
        self.join_endpoint = join_endpoint if join_endpoint is not None else os.environ.get(JOIN_ENDPOINT_ENV, "")

    # -- plumbing -------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Call ``fn`` and return the response body as JSON; API errors stay ``ApiException``."""
        try:
            response = fn(*args, _preload_content=False, _request_timeout=self.request_timeout, **kwargs)
        except ApiException:
            raise
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise _translate(error, what) from error
        data = response.data
        return json.loads(data) if data else {}

    def _do(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``_call`` with every API error turned into the fleet taxonomy."""
        try:
            return self._call(what, fn, *args, **kwargs)
        except ApiException as error:
            raise _translate(error, what) from error

    def _get(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        try:
            return self._call(what, fn, *args, **kwargs)
        except ApiException as error:
            if error.status == 404:
                return None
            raise _translate(error, what) from error

    def _delete(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Delete; ``False`` when it was already gone."""
        try:
            self._call(what, fn, *args, **kwargs)
            return True
        except ApiException as error:
            if error.status == 404:
                return False
            raise _translate(error, what) from error

    def _write(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """A write whose 409 (conflict / already exists) the caller retries."""
        try:
            return self._call(what, fn, *args, **kwargs)
        except ApiException as error:
            if error.status == 409:
                raise _Conflict(_message(error)) from error
            raise _translate(error, what) from error

    @staticmethod
    def _retry_on_conflict(what: str, attempt: Callable[[], T]) -> T:
        """Run ``attempt`` (read, decide, write under the resourceVersion read) again
        while its write meets a 409, after a jittered, growing pause (writers that collided
        would otherwise collide again: on a real API server six writers of one object starved
        each other through eight immediate retries); past ``_RETRY_CONFLICTS`` tries,
        ``ClusterConflict``."""
        for tries in range(_RETRY_CONFLICTS):
            try:
                return attempt()
            except _Conflict:
                time.sleep(random.uniform(0, min(_CONFLICT_PAUSE_S * 2 ** tries, _CONFLICT_PAUSE_MAX_S)))
        raise ClusterConflict(f"{what} kept conflicting", code="409")

    # -- join tokens ----------------------------------------------------------------------
    def create_join_token(self, node_name: str, machine_id: str, ttl_seconds: int) -> JoinTokenRef:
        if not 0 < ttl_seconds <= MAX_JOIN_TOKEN_TTL_S:
            raise ValueError(f"join token TTL must be within (0, {MAX_JOIN_TOKEN_TTL_S}] seconds")
        alphabet = string.ascii_lowercase + string.digits
        token_id = "".join(secrets.choice(alphabet) for _ in range(6))
        token_secret = "".join(secrets.choice(alphabet) for _ in range(16))
        # Whole seconds, rounded down: never later than asked.
        expires_at = datetime.fromtimestamp(int(time.time()) + ttl_seconds, timezone.utc)
        expiration = expires_at.strftime("%Y-%m-%dT%H:%M:%SZ")
        annotations = {ANNOTATION_NODE_NAME: node_name, ANNOTATION_MACHINE_ID: machine_id}
        token = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": f"bootstrap-token-{token_id}",
                "namespace": TOKEN_NAMESPACE,
                "labels": {LABEL_TOKEN_ID: token_id, "app.kubernetes.io/managed-by": "gpufleet"},
                "annotations": annotations,
            },
            "type": "bootstrap.kubernetes.io/token",
            "stringData": {
                "description": f"gpufleet join of {node_name}",
                "token-id": token_id,
                "token-secret": token_secret,
                "expiration": expiration,
                "usage-bootstrap-authentication": "true",
                "usage-bootstrap-signing": "true",
                "auth-extra-groups": BOOTSTRAP_GROUP,
            },
        }
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
        if _TOKEN_ID.match(old_id) and old_id != token_id:
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
        if not _TOKEN_ID.match(token_id):
            raise ValueError(f"not a bootstrap token id: {token_id!r}")
        self._delete("revoke bootstrap token", self.core.delete_namespaced_secret,
                     f"bootstrap-token-{token_id}", TOKEN_NAMESPACE)
        self.delete_state(JOIN_TOKEN_KIND, token_id)
        channels = self._do("list bootstrap channels", self.core.list_namespaced_secret, self.bootstrap_namespace,
                            label_selector=f"{LABEL_TOKEN_ID}={token_id}")
        for item in channels.get("items", []):
            self._delete("revoke bootstrap channel", self.core.delete_namespaced_secret,
                         item["metadata"]["name"], self.bootstrap_namespace)

    # -- bootstrap (node-bound tokens, the API endpoint, gpufleet's CSR approver) ----------
    def issue_bootstrap_token(self, node_name: str, join_key: str, ttl_seconds: int) -> BootstrapToken:
        if not 0 < ttl_seconds <= MAX_JOIN_TOKEN_TTL_S:
            raise ValueError(f"join token TTL must be within (0, {MAX_JOIN_TOKEN_TTL_S}] seconds")
        now = time.time()
        key = self._token_key()
        for token_id, record in self.list_state(JOIN_TOKEN_KIND).items():
            expires_at = _expiry(record.get("expiration", ""))
            # Reused while it has a minute left: the machine created with it may still be booting.
            # Its secret is derived again, never read back from kube-system.
            if (expires_at is not None and record.get("join") == join_key and record.get("node-name") == node_name
                    and _TOKEN_ID.match(token_id) and expires_at.timestamp() > now + 60):
                return BootstrapToken(token_id=token_id, node_name=node_name, expires_at=expires_at,
                                      secret=_token_secret(key, token_id, join_key, node_name))
        alphabet = string.ascii_lowercase + string.digits
        token_id = "".join(secrets.choice(alphabet) for _ in range(6))
        token_secret = _token_secret(key, token_id, join_key, node_name)
        expires_at = datetime.fromtimestamp(int(now) + ttl_seconds, timezone.utc)
        expiration = expires_at.strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": f"bootstrap-token-{token_id}",
                "namespace": TOKEN_NAMESPACE,
                "labels": {LABEL_TOKEN_ID: token_id, LABEL_JOIN_KEY: _digest(join_key),
                           "app.kubernetes.io/managed-by": "gpufleet"},
                "annotations": {ANNOTATION_NODE_NAME: node_name, ANNOTATION_JOIN: join_key},
            },
            "type": "bootstrap.kubernetes.io/token",
            "stringData": {
                "description": f"gpufleet join of node {node_name}",
                "token-id": token_id,
                "token-secret": token_secret,
                "expiration": expiration,
                "usage-bootstrap-authentication": "true",
                "usage-bootstrap-signing": "true",
                "auth-extra-groups": BOOTSTRAP_GROUP,
            },
        }
        self._record_token(token_id, node_name, join_key, expiration)
        self._do("create bootstrap token", self.core.create_namespaced_secret, TOKEN_NAMESPACE, body)
        return BootstrapToken(token_id=token_id, node_name=node_name, expires_at=expires_at, secret=token_secret)

    def revoke_node_tokens(self, node_name: str) -> list[str]:
        """Delete every gpufleet join token issued for ``node_name`` (by their records); the ids
        deleted. Records of tokens past their expiry go too (the token cleaner took the Secret)."""
        gone = []
        now = time.time()
        for token_id, record in self.list_state(JOIN_TOKEN_KIND).items():
            if not _TOKEN_ID.match(token_id):
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

    def review_csrs(self, addresses: Callable[[str], list[str] | None]) -> list[CsrDecision]:
        """Approve or deny the pending kubelet CSRs that are gpufleet's to judge (see the
        module doc); ``addresses(node)`` is what the provider reports for that node's machine
        (None: not a gpufleet node)."""
        listed = self._do("list CSRs", self.certificates.list_certificate_signing_request)
        decisions = []
        tokens: dict[str, str | None] = {}
        identities = self.list_state(NODE_IDENTITY_KIND)
        control_plane: list[set[str]] = []

        def renewable(node: str) -> bool:
            """A control-plane node's kubelet renews through gpufleet too (kubeadm's self-renewal
            binding removed): the Node exists and carries the label only an admin can set."""
            if not control_plane:
                found = self._do("list control-plane nodes", self.core.list_node, label_selector=CONTROL_PLANE_LABEL)
                control_plane.append({n["metadata"]["name"] for n in found.get("items", [])})
            return node in control_plane[0]

        keys: list[dict[str, dict[str, str]]] = []  # NODE_KEYS_KIND, listed when first needed

        def judge(csr: dict[str, Any]) -> CsrDecision | None:
            return csr_decision(csr, lambda token_id: self._token_node(token_id, tokens),
                                lambda node: node in identities, addresses, renewable)

        def bind_key(node: str, fingerprint: str) -> None:
            keys[0][node] = self.update_state(NODE_KEYS_KIND, node, lambda old: with_key(old, fingerprint))

        for csr in listed.get("items", []):
            status = csr.get("status") or {}
            judged = {c.get("type") for c in status.get("conditions") or []}
            if "Denied" in judged or "Failed" in judged:
                continue
            client_key = _client_csr_key(csr)
            if client_key is not None and not keys:
                keys.append(self.list_state(NODE_KEYS_KIND))
            unbound = client_key is not None and client_key[1] not in bound_keys(keys[0].get(client_key[0], {}))
            if "Approved" in judged:
                # Approved by another approver (kubeadm's auto-approval): its key opens the node
                # gateway only where gpufleet's own judgement approves it too.
                if unbound and (decision := judge(csr)) is not None and decision.approve:
                    bind_key(*client_key)
                continue
            decision = judge(csr)
            if decision is None:
                continue
            if decision.approve and unbound:
                bind_key(*client_key)  # before the approval: no certificate is ever out unbound
            self._decide(csr, decision)
            decisions.append(decision)
        return decisions

    def _token_node(self, token_id: str, cache: dict[str, str | None]) -> str | None:
        """The node a gpufleet token was issued for, from its record (None: not one of gpufleet's)."""
        if token_id not in cache:
            record = self.read_state(JOIN_TOKEN_KIND, token_id) if _TOKEN_ID.match(token_id) else {}
            cache[token_id] = record.get("node-name") or None
        return cache[token_id]

    def _decide(self, csr: dict[str, Any], decision: CsrDecision) -> None:
        name = csr["metadata"]["name"]
        body = copy.deepcopy(csr)
        conditions = (body.setdefault("status", {}).get("conditions") or [])
        conditions.append({"type": "Approved" if decision.approve else "Denied", "status": "True",
                           "reason": "GpufleetApproved" if decision.approve else "GpufleetDenied",
                           "message": decision.reason,
                           "lastUpdateTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
        body["status"]["conditions"] = conditions
        try:
            self._call(f"decide CSR {name}", self.certificates.replace_certificate_signing_request_approval,
                       name, body)
        except ApiException as error:
            if error.status in (404, 409):
                return  # gone, or changed meanwhile: judged again on the next review
            raise _translate(error, f"decide CSR {name}") from error

    def node_identity(self, name: str) -> NodeIdentity | None:
        return NodeIdentity.from_state(self.read_state(NODE_IDENTITY_KIND, name)) if name else None

    # -- nodes ----------------------------------------------------------------------------
    @staticmethod
    def _node(obj: dict[str, Any]) -> Node:
        meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        conditions = status.get("conditions") or []
        gpus = (status.get("allocatable") or {}).get(GPU_RESOURCE, "0")
        created = meta.get("creationTimestamp")
        del annotations  # the node's kubelet may write them: no identity comes from there
        return Node(
            name=meta["name"],
            # A gpufleet node's machine comes from its identity record (``_identified``): its
            # providerID names the machine by the node's name, not by the provider's id.
            machine_id=_machine_from_provider_id(spec.get("providerID", "")),
            site=labels.get(LABEL_SITE, ""),
            provider=labels.get(LABEL_PROVIDER, ""),
            provider_id=spec.get("providerID", ""),
            addresses=[a["address"] for a in status.get("addresses") or []
                       if a.get("type") in ("InternalIP", "ExternalIP") and a.get("address")],
            labels=labels,
            taints=[format_taint(t["key"], t.get("value"), t["effect"]) for t in spec.get("taints") or []],
            ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
            unschedulable=bool(spec.get("unschedulable")),
            boot_id=(status.get("nodeInfo") or {}).get("bootID", ""),
            gpus_allocatable=int(parse_quantity(gpus)),
            registered_at=datetime.fromisoformat(created.replace("Z", "+00:00")) if created else None,
        )

    def _read_node(self, name: str) -> dict[str, Any]:
        node = self._get(f"read node {name}", self.core.read_node, name)
        if node is None:
            raise NodeNotFound(f"node {name} not found", provider=PROVIDER, code="404")
        return node

    def _patch_node(self, name: str, body: dict[str, Any], content_type: str) -> dict[str, Any]:
        try:
            return self._call(f"patch node {name}", self.core.patch_node, name, body, _content_type=content_type)
        except ApiException as error:
            if error.status == 404:
                raise NodeNotFound(f"node {name} not found", provider=PROVIDER, code="404") from error
            if error.status == 409:
                raise _Conflict(_message(error)) from error
            raise _translate(error, f"patch node {name}") from error

    def get_node(self, name: str) -> Node | None:
        node = self._get(f"read node {name}", self.core.read_node, name)
        if not node:
            return None
        return _identified(self._node(node), self.node_identity(name))

    def list_nodes(self, selector: dict[str, str] | None = None) -> list[Node]:
        label_selector = ",".join(f"{k}={v}" for k, v in sorted((selector or {}).items()))
        nodes = self._do("list nodes", self.core.list_node, label_selector=label_selector or None)
        identities = self.list_state(NODE_IDENTITY_KIND) if nodes.get("items") else {}
        return sorted((_identified(self._node(n), NodeIdentity.from_state(identities.get(n["metadata"]["name"], {})))
                       for n in nodes.get("items", [])), key=lambda n: n.name)

    def label_node(self, name: str, labels: dict[str, str]) -> Node:
        body = {"metadata": {"labels": dict(labels)}}
        return self._node(self._retry_on_conflict(f"node {name}", lambda: self._patch_node(name, body, STRATEGIC)))

    def annotate_node(self, name: str, annotations: dict[str, str | None]) -> dict[str, str]:
        body = {"metadata": {"annotations": dict(annotations)}}
        node = self._retry_on_conflict(f"node {name}", lambda: self._patch_node(name, body, MERGE))
        return dict(node["metadata"].get("annotations") or {})

    def set_taints(self, name: str, add: list[str] = (), remove: list[str] = ()) -> Node:
        def attempt() -> Node:
            node = self._read_node(name)
            raw = (node.get("spec") or {}).get("taints") or []
            by_text = {format_taint(t["key"], t.get("value"), t["effect"]): t for t in raw}
            current = list(by_text)
            wanted = apply_taints(current, add, remove)
            if wanted == current:
                return self._node(node)
            taints = []
            for text in wanted:
                if text in by_text:
                    taints.append(by_text[text])  # keeps timeAdded and friends
                else:
                    key, value, effect = parse_taint(text)
                    taints.append({"key": key, "effect": effect, **({"value": value} if value else {})})
            body = {
                "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                "spec": {"taints": taints or None},
            }
            return self._node(self._patch_node(name, body, MERGE))

        return self._retry_on_conflict(f"node {name}: taints", attempt)

    def cordon(self, name: str, unschedulable: bool = True) -> Node:
        body = {"spec": {"unschedulable": True if unschedulable else None}}
        return self._node(self._retry_on_conflict(f"node {name}", lambda: self._patch_node(name, body, MERGE)))

    def remove_node(self, name: str) -> None:
        # The node's client keys first: its certificates stop opening the node gateway at once.
        self.delete_state(NODE_KEYS_KIND, name)
        self._delete(f"delete node {name}", self.core.delete_node, name)
        # After the Node: a retry after a failure in between still finds the record to delete.
        self.delete_state(NODE_IDENTITY_KIND, name)

    # -- drain ----------------------------------------------------------------------------
    def _pods_on(self, node: str) -> list[PodInfo]:
        pods = self._do(f"list pods on {node}", self.core.list_pod_for_all_namespaces,
                        field_selector=f"spec.nodeName={node}")
        found = []
        for pod in pods.get("items", []):
            meta = pod["metadata"]
            found.append(PodInfo(
                namespace=meta["namespace"],
                name=meta["name"],
                owner_kinds=[o.get("kind", "") for o in meta.get("ownerReferences") or []],
                mirror=MIRROR_ANNOTATION in (meta.get("annotations") or {}),
            ))
        return found

    def _evict(self, namespace: str, name: str) -> tuple[EvictOutcome, str]:
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}
        try:
            self._call(f"evict {namespace}/{name}", self.core.create_namespaced_pod_eviction, name, namespace, body)
            return "evicted", ""
        except ApiException as error:
            if error.status == 404:
                return "gone", ""
            if error.status in (401, 403):
                raise _translate(error, f"evict {namespace}/{name}") from error
            # 429: a PodDisruptionBudget allows no disruption now; 500: more than
            # one PDB matches; anything else: retried until the deadline too.
            return "blocked", _message(error)
        except Transient as error:
            return "blocked", str(error)

    def _delete_pod(self, namespace: str, name: str) -> None:
        self._delete(f"delete pod {namespace}/{name}", self.core.delete_namespaced_pod, name, namespace)

    def drain_node(
        self, name: str, deadline_s: float, force: bool = False, heartbeat: Callable[[], None] | None = None
    ) -> DrainResult:
        self.cordon(name)
        return run_drain(
            name, deadline_s, force,
            list_pods=lambda: self._pods_on(name),
            evict=self._evict,
            delete=self._delete_pod,
            heartbeat=heartbeat,
        )

    # -- demand ---------------------------------------------------------------------------
    def list_gpu_pods(self, pending_only: bool = False) -> list[GpuPod]:
        # The field selectors the scheduler's own "unscheduled pods" view uses: the server
        # filters, so a cluster of many finished pods costs one small list.
        selector = ("status.phase=Pending,spec.nodeName=" if pending_only
                    else "status.phase!=Succeeded,status.phase!=Failed")
        pods = self._do("list GPU pods", self.core.list_pod_for_all_namespaces, field_selector=selector)
        found = [gpu_pod(pod) for pod in pods.get("items", [])]
        return sorted((p for p in found if p.gpus > 0), key=lambda p: p.key)

    # -- watches (issue 37): the event-driven entities wait on these -------------------------
    def _follow(self, what: str, list_fn: Callable[..., Any], convert: Callable[[dict[str, Any]], T | None],
                until: Callable[[list[T]], bool], timeout_s: float, recheck_s: float,
                heartbeat: Callable[[], None] | None, **selectors: Any) -> list[T]:
        """List, then follow the changes from the list's resourceVersion until ``until`` holds
        for the objects (``convert``: None leaves an object out) or ``timeout_s`` passed.

        The watch runs in chunks of at most ``recheck_s`` (the server's ``timeoutSeconds``), each
        resumed from the last resourceVersion seen (bookmarks included), so ``until`` and
        ``heartbeat`` are called at least that often and a hung connection is given up after one
        chunk. A version the server no longer has (``410 Gone``: etcd compacted past it, or it is
        older than the watch cache) is met by listing again: the objects are then the list's,
        and an event the watch missed is in it."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        objects, version = self._list_for_watch(what, list_fn, convert, **selectors)
        while True:
            current = [objects[key] for key in sorted(objects)]
            if until(current) or time.monotonic() >= deadline:
                return current
            chunk = max(1, int(min(recheck_s, max(deadline - time.monotonic(), 1.0))))
            try:
                for kind, obj in self._watch_chunk(what, list_fn, version, chunk, **selectors):
                    meta = obj.get("metadata") or {}
                    version = meta.get("resourceVersion") or version
                    if kind == "BOOKMARK":
                        continue
                    key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
                    converted = convert(obj) if kind != "DELETED" else None
                    if converted is None:
                        objects.pop(key, None)
                    else:
                        objects[key] = converted
                    current = [objects[k] for k in sorted(objects)]
                    if until(current):
                        return current
            except _Gone:
                objects, version = self._list_for_watch(what, list_fn, convert, **selectors)
            if heartbeat is not None:
                heartbeat()

    def _list_for_watch(self, what: str, list_fn: Callable[..., Any], convert: Callable[[dict[str, Any]], T | None],
                        **selectors: Any) -> tuple[dict[str, T], str]:
        listed = self._do(f"list {what}", list_fn, **selectors)
        objects: dict[str, T] = {}
        for obj in listed.get("items", []):
            meta = obj.get("metadata") or {}
            if (converted := convert(obj)) is not None:
                objects[f"{meta.get('namespace', '')}/{meta.get('name', '')}"] = converted
        return objects, (listed.get("metadata") or {}).get("resourceVersion", "")

    def _watch_chunk(self, what: str, list_fn: Callable[..., Any], version: str, seconds: int, **selectors: Any):
        """(type, object) of each watch event from ``version`` for ``seconds`` (plain JSON)."""
        from kubernetes.watch.watch import iter_resp_lines

        try:
            response = list_fn(watch=True, resource_version=version, timeout_seconds=seconds,
                               allow_watch_bookmarks=True, _preload_content=False,
                               _request_timeout=(self.request_timeout[0], seconds + self.request_timeout[0]),
                               **selectors)
        except ApiException as error:
            if error.status == 410:
                raise _Gone(_message(error)) from error
            raise _translate(error, f"watch {what}") from error
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise _translate(error, f"watch {what}") from error
        try:
            for line in iter_resp_lines(response):
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone(obj.get("message", "resourceVersion too old"))
                    raise _translate(ApiException(status=obj.get("code") or 500, reason=obj.get("message", "")),
                                     f"watch {what}")
                yield event.get("type", ""), obj
        except (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ProtocolError, OSError):
            return  # the chunk's connection ended early or hung: the next chunk resumes from ``version``
        finally:
            response.close()
            response.release_conn()

    def watch_nodes(self, selector: dict[str, str] | None, until: Callable[[list[Node]], bool], timeout_s: float,
                    recheck_s: float = 30.0, heartbeat: Callable[[], None] | None = None,
                    poll_s: float = 1.0) -> list[Node]:
        label_selector = ",".join(f"{k}={v}" for k, v in sorted((selector or {}).items()))
        return self._follow("nodes", self.core.list_node, self._node, until, timeout_s, recheck_s, heartbeat,
                            **({"label_selector": label_selector} if label_selector else {}))

    def watch_gpu_pods(self, until: Callable[[list[GpuPod]], bool], timeout_s: float, recheck_s: float = 30.0,
                       heartbeat: Callable[[], None] | None = None, poll_s: float = 0.2) -> list[GpuPod]:
        def convert(obj: dict[str, Any]) -> GpuPod | None:
            pod = gpu_pod(obj)
            return pod if pod.gpus > 0 else None

        return self._follow("GPU pods", self.core.list_pod_for_all_namespaces, convert, until, timeout_s, recheck_s,
                            heartbeat, field_selector="status.phase!=Succeeded,status.phase!=Failed")

    def watch_open_csrs(self, until: Callable[[list[str]], bool], timeout_s: float, recheck_s: float = 30.0,
                        heartbeat: Callable[[], None] | None = None) -> list[str]:
        def convert(obj: dict[str, Any]) -> str | None:
            conditions = (obj.get("status") or {}).get("conditions") or []
            if any(c.get("type") in ("Denied", "Failed") for c in conditions):
                return None
            return (obj.get("metadata") or {}).get("name") or None

        return self._follow("CSRs", self.certificates.list_certificate_signing_request, convert, until, timeout_s,
                            recheck_s, heartbeat)

    # -- serving --------------------------------------------------------------------------
    def _read_deployment(self, name: str) -> dict[str, Any] | None:
        return self._get(f"read deployment {name}", self.apps.read_namespaced_deployment, name, self.namespace)

    def apply_serving(self, spec: ServingSpec) -> ServingStatus:
        desired = render_deployment(spec, self.namespace)
        name = desired["metadata"]["name"]
        template_json = desired["metadata"]["annotations"][ANNOTATION_TEMPLATE]

        def attempt() -> None:
            current = self._read_deployment(name)
            if current is None:
                self._write(f"create deployment {name}", self.apps.create_namespaced_deployment,
                            self.namespace, desired)
                return
            annotations = current["metadata"].get("annotations") or {}
            live = annotations.get(ANNOTATION_TEMPLATE) or _canonical(current["spec"].get("template"))
            if (
                annotations.get(ANNOTATION_TEMPLATE) == template_json
                and current["spec"].get("replicas") == spec.replicas
                and _is_subset(desired["metadata"]["labels"], current["metadata"].get("labels"))
            ):
                return
            body = current
            body["metadata"].setdefault("labels", {}).update(desired["metadata"]["labels"])
            body["metadata"]["annotations"] = {**annotations, ANNOTATION_MODEL: spec.model}
            if live != template_json:
                body["metadata"]["annotations"][ANNOTATION_PREVIOUS_TEMPLATE] = live
                body["metadata"]["annotations"][ANNOTATION_TEMPLATE] = template_json
                body["spec"]["template"] = desired["spec"]["template"]
                body["spec"]["strategy"] = desired["spec"]["strategy"]
            body["spec"]["replicas"] = spec.replicas
            body.pop("status", None)
            self._write(f"update deployment {name}", self.apps.replace_namespaced_deployment,
                        name, self.namespace, body)

        self._retry_on_conflict(f"deployment {name}", attempt)
        self._apply_service(spec.model, spec.site)
        self._apply_pdb(spec.model, spec.site)
        return self._status_or_raise(spec.model, spec.site)

    def _apply_pdb(self, model: str, site: str) -> None:
        desired = render_pdb(model, site, self.namespace)
        name = desired["metadata"]["name"]

        def attempt() -> None:
            current = self._get(f"read poddisruptionbudget {name}",
                                self.policy.read_namespaced_pod_disruption_budget, name, self.namespace)
            if current is None:
                self._write(f"create poddisruptionbudget {name}",
                            self.policy.create_namespaced_pod_disruption_budget, self.namespace, desired)
                return
            if _is_subset(desired["spec"], current.get("spec")):
                return
            patch = {"metadata": {"labels": desired["metadata"]["labels"]}, "spec": desired["spec"]}
            self._do(f"patch poddisruptionbudget {name}", self.policy.patch_namespaced_pod_disruption_budget,
                     name, self.namespace, patch, _content_type=MERGE)

        self._retry_on_conflict(f"poddisruptionbudget {name}", attempt)

    def _apply_service(self, model: str, site: str) -> None:
        self._apply_service_doc(render_service(model, site, self.namespace))
        self._apply_service_doc(render_model_service(model, self.namespace), only_own=True)

    def _apply_service_doc(self, desired: dict[str, Any], only_own: bool = False) -> None:
        name = desired["metadata"]["name"]

        def attempt() -> None:
            current = self._get(f"read service {name}", self.core.read_namespaced_service, name, self.namespace)
            if current is None:
                self._write(f"create service {name}", self.core.create_namespaced_service, self.namespace, desired)
                return
            if only_own and not _same_service(current, desired):
                # "<model>" can be another model's "<model>-<site>": the model-wide Service is a
                # convenience, so it yields rather than take over (and re-route) the other one.
                return
            if _is_subset(desired["spec"], current.get("spec")) and _is_subset(
                desired["metadata"]["labels"], current["metadata"].get("labels")
            ):
                return
            patch = {"metadata": {"labels": desired["metadata"]["labels"]}, "spec": desired["spec"]}
            self._do(f"patch service {name}", self.core.patch_namespaced_service, name, self.namespace, patch,
                     _content_type=MERGE)

        self._retry_on_conflict(f"service {name}", attempt)

    def _status(self, model: str, site: str, deployment: dict[str, Any]) -> ServingStatus:
        meta, spec, status = deployment["metadata"], deployment.get("spec") or {}, deployment.get("status") or {}
        desired = spec.get("replicas", 1)
        containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or [{}]
        generation = meta.get("generation", 0)
        observed = status.get("observedGeneration", 0)
        replicas = status.get("replicas", 0)
        updated = status.get("updatedReplicas", 0)
        available = status.get("availableReplicas", 0)
        return ServingStatus(
            model=model, site=site, name=meta["name"], image=containers[0].get("image", ""),
            desired_replicas=desired, generation=generation, observed_generation=observed,
            replicas=replicas, updated_replicas=updated, available_replicas=available,
            ready=observed >= generation and replicas == updated == available == desired,
            can_rollback=bool((meta.get("annotations") or {}).get(ANNOTATION_PREVIOUS_TEMPLATE)),
            gpus_per_replica=_gpus_of(containers[0]),
        )

    def serving_status(self, model: str, site: str) -> ServingStatus | None:
        deployment = self._read_deployment(serving_name(model, site))
        return self._status(model, site, deployment) if deployment else None

    def _status_or_raise(self, model: str, site: str) -> ServingStatus:
        status = self.serving_status(model, site)
        if status is None:
            raise ServingNotFound(f"no serving of {model} at {site}", provider=PROVIDER, code="404")
        return status

    def scale_serving(self, model: str, site: str, replicas: int) -> ServingStatus:
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        name = serving_name(model, site)
        try:
            deployment = self._call(f"scale deployment {name}", self.apps.patch_namespaced_deployment, name,
                                    self.namespace, {"spec": {"replicas": replicas}}, _content_type=MERGE)
        except ApiException as error:
            if error.status == 404:
                raise ServingNotFound(f"no serving of {model} at {site}", provider=PROVIDER, code="404") from error
            raise _translate(error, f"scale deployment {name}") from error
        return self._status(model, site, deployment)

    def rollback_serving(self, model: str, site: str) -> ServingStatus:
        name = serving_name(model, site)

        def attempt() -> ServingStatus:
            current = self._read_deployment(name)
            if current is None:
                raise ServingNotFound(f"no serving of {model} at {site}", provider=PROVIDER, code="404")
            annotations = current["metadata"].get("annotations") or {}
            previous = annotations.get(ANNOTATION_PREVIOUS_TEMPLATE)
            if not previous:
                raise NoPreviousTemplate(f"{name}: no previous template to roll back to", provider=PROVIDER)
            live = annotations.get(ANNOTATION_TEMPLATE) or _canonical(current["spec"].get("template"))
            current["metadata"]["annotations"] = {
                **annotations, ANNOTATION_TEMPLATE: previous, ANNOTATION_PREVIOUS_TEMPLATE: live,
            }
            current["spec"]["template"] = json.loads(previous)
            current.pop("status", None)
            deployment = self._write(f"roll back deployment {name}", self.apps.replace_namespaced_deployment,
                                     name, self.namespace, current)
            return self._status(model, site, deployment)

        return self._retry_on_conflict(f"deployment {name}", attempt)

    def delete_serving(self, model: str, site: str) -> None:
        name = serving_name(model, site)
        self._delete(f"delete deployment {name}", self.apps.delete_namespaced_deployment, name, self.namespace)
        self._delete(f"delete service {name}", self.core.delete_namespaced_service, name, self.namespace)
        wide = render_model_service(model, self.namespace)
        name = wide["metadata"]["name"]
        if not any(s.model == model for s in self.list_serving()):  # the model's last site
            current = self._get(f"read service {name}", self.core.read_namespaced_service, name, self.namespace)
            if current is not None and _same_service(current, wide):
                self._delete(f"delete service {name}", self.core.delete_namespaced_service, name, self.namespace)

    # -- routing --------------------------------------------------------------------------
    def set_routing_weights(
        self,
        model: str,
        weights: dict[str, int],
        healthy: dict[str, bool] | None = None,
        draining: dict[str, bool] | None = None,
        incident: dict[str, str] | None = None,
    ) -> RoutingTable:
        sites = routing_sites(weights, healthy, draining, incident)
        self._write_httproute(model, sites)
        self._write_backend_traffic_policy(model)
        return self._write_routing_table(model, sites)

    def _write_backend_traffic_policy(self, model: str) -> None:
        """Envoy Gateway's policy on the model's HTTPRoute: sessions stick to their site, and
        only a request that got no response byte is retried (HTTPRoute alone can say neither)."""
        body = render_backend_traffic_policy(model, self.namespace)
        name = body["metadata"]["name"]
        args = (ENVOY_GROUP, ENVOY_VERSION, self.namespace, "backendtrafficpolicies")

        def attempt() -> None:
            current = self._get(f"read backendtrafficpolicy {name}", self.custom.get_namespaced_custom_object,
                                *args, name)
            if current is None:
                self._write(f"create backendtrafficpolicy {name}", self.custom.create_namespaced_custom_object,
                            *args, body)
                return
            if _is_subset(body["spec"], current.get("spec")):
                return
            current["spec"] = body["spec"]
            current.pop("status", None)
            self._write(f"update backendtrafficpolicy {name}", self.custom.replace_namespaced_custom_object,
                        *args, name, current)

        self._retry_on_conflict(f"backendtrafficpolicy {name}", attempt)

    def _write_httproute(self, model: str, sites: dict[str, SiteRoute]) -> None:
        name = dns_label(model)
        spec = render_httproute_spec(model, sites, self.gateway, self.gateway_namespace)
        args = (GATEWAY_GROUP, GATEWAY_VERSION, self.namespace, "httproutes")

        def attempt() -> None:
            current = self._get(f"read httproute {name}", self.custom.get_namespaced_custom_object, *args, name)
            if current is None:
                body = render_httproute(model, sites, self.namespace, self.gateway, self.gateway_namespace)
                self._write(f"create httproute {name}", self.custom.create_namespaced_custom_object, *args, body)
                return
            if _is_subset(spec, current.get("spec")):
                return
            current["spec"] = spec
            current.pop("status", None)
            self._write(f"update httproute {name}", self.custom.replace_namespaced_custom_object,
                        *args, name, current)

        self._retry_on_conflict(f"httproute {name}", attempt)

    def _read_routing_configmap(self) -> dict[str, Any] | None:
        return self._get("read routing table", self.core.read_namespaced_config_map, ROUTING_CONFIGMAP, self.namespace)

    def _write_routing_table(self, model: str, sites: dict[str, SiteRoute], key: str | None = None) -> RoutingTable:
        key = key or dns_label(model)
        wanted = {site: route.model_dump() for site, route in sorted(sites.items())}

        def attempt() -> RoutingTable:
            current = self._read_routing_configmap()
            entry = _routing_entry(current, key)
            if entry is not None and entry.get("sites") == wanted:
                return RoutingTable(model=model, version=entry["version"], sites=sites)
            version = (entry or {}).get("version", 0) + 1
            value = _canonical({"model": model, "version": version, "sites": wanted})
            if current is None:
                body = {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {
                        "name": ROUTING_CONFIGMAP,
                        "namespace": self.namespace,
                        "labels": {"app.kubernetes.io/managed-by": "gpufleet"},
                    },
                    "data": {key: value},
                }
                self._write("create routing table", self.core.create_namespaced_config_map, self.namespace, body)
            else:
                current["data"] = {**(current.get("data") or {}), key: value}
                self._write("update routing table", self.core.replace_namespaced_config_map,
                            ROUTING_CONFIGMAP, self.namespace, current)
            return RoutingTable(model=model, version=version, sites=sites)

        return self._retry_on_conflict("routing table", attempt)

    def get_routing(self, model: str) -> RoutingTable | None:
        entry = _routing_entry(self._read_routing_configmap(), dns_label(model))
        if entry is None:
            return None
        sites = {site: SiteRoute.model_validate(route) for site, route in entry.get("sites", {}).items()}
        return RoutingTable(model=model, version=entry["version"], sites=sites)

    # -- additive: listing serving, the fleet-wide site routes -----------------------------
    def list_serving(self, site: str | None = None) -> list[ServingStatus]:
        selector = "app.kubernetes.io/managed-by=gpufleet"
        if site is not None:
            selector += f",{LABEL_SITE}={_label_value(site)}"
        listed = self._do("list deployments", self.apps.list_namespaced_deployment, self.namespace,
                          label_selector=selector)
        out = []
        for item in listed.get("items") or []:
            meta = item.get("metadata") or {}
            labels = meta.get("labels") or {}
            model = (meta.get("annotations") or {}).get(ANNOTATION_MODEL) or labels.get(LABEL_MODEL, "")
            where = labels.get(LABEL_SITE, "")
            if model and where and (site is None or where == site):
                out.append(self._status(model, where, item))
        return sorted(out, key=lambda s: (s.model, s.site))

    def set_site_routes(self, sites: dict[str, SiteRoute]) -> RoutingTable:
        # One key of the routing ConfigMap; a leading underscore is never a model's DNS label.
        return self._write_routing_table(SITE_ROUTES, dict(sites), key=SITE_ROUTES)

    def get_site_routes(self) -> RoutingTable | None:
        entry = _routing_entry(self._read_routing_configmap(), SITE_ROUTES)
        if entry is None:
            return None
        sites = {site: SiteRoute.model_validate(route) for site, route in entry.get("sites", {}).items()}
        return RoutingTable(model=SITE_ROUTES, version=entry["version"], sites=sites)


    # -- control-plane state ------------------------------------------------------------
    def _read_state_object(self, name: str) -> dict[str, Any] | None:
        return self._get(f"read state {name}", self.core.read_namespaced_config_map, name, self.namespace)

    def read_state(self, kind: str, key: str) -> dict[str, str]:
        current = self._read_state_object(state_object_name(kind, key))
        return dict((current or {}).get("data") or {})

    def update_state(self, kind: str, key: str, change: StateChange) -> dict[str, str]:
        name = state_object_name(kind, key)

        def attempt() -> dict[str, str]:
            current = self._read_state_object(name)
            data = dict((current or {}).get("data") or {})
            wanted = change(dict(data))
            if wanted is None or (current is not None and wanted == data):
                return data
            check_state_data(wanted)
            if current is None:
                body = {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {
                        "name": name,
                        "namespace": self.namespace,
                        "labels": {"app.kubernetes.io/managed-by": "gpufleet", LABEL_STATE: _label_value(kind)},
                        "annotations": {ANNOTATION_STATE_KEY: key},
                    },
                    "data": wanted,
                }
                self._write(f"create state {name}", self.core.create_namespaced_config_map, self.namespace, body)
            else:
                # ``current`` carries the resourceVersion read above: a write in between answers 409.
                current["data"] = wanted
                self._write(f"update state {name}", self.core.replace_namespaced_config_map,
                            name, self.namespace, current)
            return wanted

        return self._retry_on_conflict(f"state {name}", attempt)

    def list_state(self, kind: str) -> dict[str, dict[str, str]]:
        listed = self._do("list state", self.core.list_namespaced_config_map, self.namespace,
                          label_selector=f"{LABEL_STATE}={_label_value(kind)}")
        out: dict[str, dict[str, str]] = {}
        for item in listed.get("items") or []:
            meta = item.get("metadata") or {}
            key = (meta.get("annotations") or {}).get(ANNOTATION_STATE_KEY)
            # The label is shortened; the name is exact: only objects of exactly this kind.
            if key is not None and meta.get("name") == state_object_name(kind, key):
                out[key] = dict(item.get("data") or {})
        return out

    def delete_state(self, kind: str, key: str, only_if: dict[str, str] | None = None) -> bool:
        name = state_object_name(kind, key)
        if only_if is None:
            return self._delete(f"delete state {name}", self.core.delete_namespaced_config_map, name, self.namespace)
        current = self._read_state_object(name)
        if current is None or dict(current.get("data") or {}) != only_if:
            return False
        # Under the resourceVersion read: a write in between answers 409 and wins.
        precondition = {"preconditions": {"resourceVersion": current["metadata"]["resourceVersion"]}}
        try:
            self._call(f"delete state {name}", self.core.delete_namespaced_config_map, name, self.namespace,
                       body=precondition)
        except ApiException as error:
            if error.status in (404, 409):
                return False
            raise _translate(error, f"delete state {name}") from error
        return True

    # -- backup (cli/backup.py) ---------------------------------------------------------------
    def state_origin(self) -> dict[str, str]:
        return {"cluster": self.api_client.configuration.host, "namespace": self.namespace}

    def state_kinds(self) -> list[str]:
        # One list of the state ConfigMaps (the label exists, whatever its value): what
        # ``list_state`` of each kind would read, in one call the control plane's RBAC allows.
        listed = self._do("list state", self.core.list_namespaced_config_map, self.namespace,
                          label_selector=LABEL_STATE)
        kinds = {((item.get("metadata") or {}).get("labels") or {}).get(LABEL_STATE, "")
                 for item in listed.get("items") or []}
        return sorted(kind for kind in kinds if kind)


def _same_service(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    """``current`` is the Service ``desired`` describes (same model, same selector keys), not
    another object that happens to carry its name."""
    meta = current.get("metadata") or {}
    return ((meta.get("annotations") or {}).get(ANNOTATION_MODEL) == desired["metadata"]["annotations"][ANNOTATION_MODEL]
            and set(((current.get("spec") or {}).get("selector") or {})) == set(desired["spec"]["selector"]))


def _gpus_of(container: dict[str, Any]) -> int:
    resources = container.get("resources") or {}
    value = (resources.get("limits") or {}).get(GPU_RESOURCE) or (resources.get("requests") or {}).get(GPU_RESOURCE)
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _routing_entry(configmap: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    if configmap is None:
        return None
    raw = (configmap.get("data") or {}).get(key)
    if not raw:
        return None
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("version"), int) else None


def _client_csr_key(csr: dict[str, Any]) -> tuple[str, str] | None:
    """(node, key fingerprint) of a kubelet client CSR (``system:node:<node>``), or None."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import NameOID

    spec = csr.get("spec") or {}
    if spec.get("signerName") != CLIENT_SIGNER:
        return None
    try:
        request = x509.load_pem_x509_csr(base64.b64decode(spec.get("request") or ""))
        public = request.public_key().public_bytes(serialization.Encoding.DER,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)
    except (ValueError, TypeError):
        return None
    common = [a.value for a in request.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if len(common) != 1 or not str(common[0]).startswith("system:node:"):
        return None
    return str(common[0]).removeprefix("system:node:"), client_key_fingerprint(public)


def _identified(node: Node, identity: NodeIdentity | None) -> Node:
    """The node with the machine, provider, account and site its join recorded."""
    if identity is None:
        return node
    return node.model_copy(update={"machine_id": identity.machine_id, "provider": identity.provider,
                                   "account": identity.account, "site": identity.site})


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


def _machine_from_provider_id(provider_id: str) -> str:
    """``aws:///us-east-1a/i-0abc`` → ``i-0abc``; ``hcloud://123`` → ``123`` (best effort).
    A ``gpufleet://`` providerID names no provider id: the identity record has the machine."""
    if not provider_id or provider_id.startswith("gpufleet://"):
        return ""
    _scheme, _, rest = provider_id.partition("://")
    parts = [p for p in (rest or provider_id).split("/") if p]
    return parts[-1] if parts else ""
