"""The objects a model's serving is made of, rendered from its ``ServingSpec``: the pod template,
the per-site Deployment, Service and PodDisruptionBudget, and the model-wide Service.
``deploy/kubernetes/serving-template.yaml`` shows the same objects; a test keeps them in step.
"""

from __future__ import annotations

from typing import Any

from fleet.cluster import ANNOTATION_TEMPLATE, GPU_RESOURCE, LABEL_MODEL, LABEL_SITE, SERVING_PORT, ServingSpec
from fleet.models import CredentialsRef
from fleet.weights_pull import CACHE_ROOT as WEIGHTS_CACHE_ROOT
from fleet.weights_pull import ENV as WEIGHTS_ENV
from fleet.weights_pull import KEY_ENV as WEIGHTS_KEY_ENV
from providers.cluster.base import ANNOTATION_MODEL, SERVING_TOLERATED, dns_label, serving_labels, serving_name
from providers.cluster.base import label_value as _label_value
from providers.cluster.kubernetes.api import _canonical


#: The model server's readiness: a replica that has not loaded its model answers no
#: traffic and counts for no capacity (OpenAI-compatible servers such as vLLM serve it).
READINESS_PROBE = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 2,
                   "failureThreshold": 3}


def _weights_init(spec: ServingSpec) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(init container, cache volume, path the server reads): the verified pull into the
    node-local cache. The pod is given only the store's ``pull_credentials`` (a node's key, read-only
    on the store), as a secretKeyRef; the spec in the pod names only the variable. The store's
    ``credentials`` are the control plane's, which write and delete every version at the site: a
    kubelet may read each Secret its pods name, and a node is hostile, so no pod names them."""
    pull = spec.weights
    store = pull.store
    env: list[dict[str, Any]] = []
    node_key = store.pull_credentials
    if node_key is not None and node_key.secret:
        _, name, key = node_key.secret_location()
        env.append({"name": WEIGHTS_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
        credentials: CredentialsRef | None = CredentialsRef(env=WEIGHTS_KEY_ENV)
    else:  # no key for nodes: the node's own role (an instance profile), or an anonymous read
        credentials = None
    store = store.model_copy(update={"credentials": credentials, "pull_credentials": None})
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


def _metadata(name: str, namespace: str, labels: dict[str, str], model: str,
              annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """The metadata of each object rendered for a model: gpufleet's, and naming the model in
    full (its label may be shortened, ``label_value``)."""
    return {
        "name": name,
        "namespace": namespace,
        "labels": {**labels, "app.kubernetes.io/managed-by": "gpufleet"},
        "annotations": {ANNOTATION_MODEL: model, **(annotations or {})},
    }


#: What every model server's pod spec carries, written by ``render_pod_template`` and put on a
#: template ``rollback_serving`` restores (one written before a field was here):
#: - no service-account token: the server calls no Kubernetes API, runs third-party model code,
#:   and runs on a GPU node, which is hostile (root there reads every container's files). Its
#:   account is its namespace's `default`, granted nothing: the kubelet may still ask a token of it
#:   for the pod (TokenRequest), so it must stay so;
#: - no service links: the kubelet would put <SERVICE>_PORT, <SERVICE>_SERVICE_HOST and the like of
#:   every Service in the namespace (each model's, gpufleet's own) into the server's environment,
#:   where a server reads them as its own settings (a model named vllm would set
#:   VLLM_PORT=tcp://..., which vLLM reads as its port).
SERVED_POD_HARDENING: dict[str, Any] = {"automountServiceAccountToken": False, "enableServiceLinks": False}


def render_pod_template(spec: ServingSpec) -> dict[str, Any]:
    labels = {**serving_labels(spec.model, spec.site), "app.kubernetes.io/managed-by": "gpufleet"}
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
        **SERVED_POD_HARDENING,
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
        "metadata": _metadata(serving_name(spec.model, spec.site), namespace, serving_labels(spec.model, spec.site),
                              spec.model, {ANNOTATION_TEMPLATE: _canonical(template)}),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": serving_labels(spec.model, spec.site)},
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
        "metadata": _metadata(serving_name(model, site), namespace, serving_labels(model, site), model),
        "spec": {
            "selector": serving_labels(model, site),
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
        "metadata": _metadata(dns_label(model), namespace, selector, model),
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
        "metadata": _metadata(serving_name(model, site), namespace, serving_labels(model, site), model),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": serving_labels(model, site)}},
    }
