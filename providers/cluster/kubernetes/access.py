"""``ACCESS`` is the one list of every API permission this adapter uses;
``providers.cluster.check`` asks the cluster about each, and the RBAC
manifests in ``deploy/kubernetes/rbac.yaml`` grant exactly these.
"""

from __future__ import annotations

from providers.cluster.base import GATEWAY_GROUP, AccessRule
from providers.cluster.kubernetes.api import BOOTSTRAP_NAMESPACE
from providers.cluster.kubernetes.tokens import TOKEN_NAMESPACE

CSR_GROUP = "certificates.k8s.io"
#: Stands for the adapter's namespace in ``ACCESS``.
SERVING_NS = "{namespace}"


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
