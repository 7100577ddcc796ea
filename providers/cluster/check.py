"""``gpufleet cluster check``: may our credentials do everything the adapter does, and
can the API server reach the kubelets of nodes behind a provider's NAT?

One SelfSubjectAccessReview per row of ``providers.cluster.kubernetes.ACCESS``
(the same table the RBAC manifests are tested against), so a missing verb is
found before a workflow trips over it; then the Konnectivity server and agents
(``check_tunnels``).
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, Field

from fleet.cluster import LABEL_SITE
from providers.cluster.base import AccessRule
from providers.cluster.kubernetes import access_table


class AccessRow(AccessRule):
    allowed: bool
    #: The authorizer's reason, or why the review itself failed.
    reason: str = ""

    @property
    def what(self) -> str:
        resource = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return f"{resource}.{self.group}" if self.group else resource


def check_access(api_client: k8s.ApiClient, namespace: str = "gpufleet") -> list[AccessRow]:
    """Ask the API server, for each permission the adapter uses, whether we have it."""
    authorization = k8s.AuthorizationV1Api(api_client)
    rows = []
    for rule in access_table(namespace):
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {
                "resourceAttributes": {
                    "verb": rule.verb,
                    "group": rule.group,
                    "resource": rule.resource,
                    "subresource": rule.subresource,
                    "namespace": rule.namespace,
                }
            },
        }
        status = authorization.create_self_subject_access_review(review).status
        reason = status.reason or status.evaluation_error or ""
        rows.append(AccessRow(**rule.model_dump(), allowed=bool(status.allowed), reason=reason))
    return rows


# -- API server → kubelet tunnels (Konnectivity) ----------------------------------------
#: Where the Konnectivity server and agents run (deploy/network/konnectivity/).
TUNNEL_NAMESPACE = "kube-system"
TUNNEL_SERVER = "konnectivity-server"
TUNNEL_AGENT = "konnectivity-agent"


class TunnelReport(BaseModel):
    """Can the API server reach every gpufleet node's kubelet (logs, exec, port-forward)?
    Each node sits behind its provider's NAT, so only through a tunnel the node dialled out.
    The API server's EgressSelectorConfiguration cannot be read through the API: the
    README's checklist covers it."""

    #: Running, ready Konnectivity server pods (a static pod per control-plane node, or a DaemonSet).
    servers: list[str] = Field(default_factory=list)
    #: gpufleet node → the running, ready agent pod on it.
    agents: dict[str, str] = Field(default_factory=dict)
    #: gpufleet nodes (the ones with a site label) with no running agent.
    missing: list[str] = Field(default_factory=list)
    #: Why the cluster could not be read, when it could not.
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.servers) and not self.missing


def _is(pod: dict[str, Any], component: str) -> bool:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    # The upstream static pod carries no labels; its mirror pod is named "<name>-<node>".
    return component in (labels.get("k8s-app"), labels.get("component")) or meta.get("name", "").startswith(
        f"{component}-") or meta.get("name") == component


def _running(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return status.get("phase") == "Running" and ready and not (pod.get("metadata") or {}).get("deletionTimestamp")


def check_tunnels(api_client: k8s.ApiClient) -> TunnelReport:
    """Which Konnectivity servers run, and which gpufleet nodes have a running agent.
    Two list calls the control plane's RBAC already grants (pods, nodes)."""
    core = k8s.CoreV1Api(api_client)
    try:
        pods = core.list_namespaced_pod(TUNNEL_NAMESPACE, _preload_content=False)
        nodes = core.list_node(label_selector=LABEL_SITE, _preload_content=False)
        pods, nodes = (json.loads(r.data).get("items") or [] for r in (pods, nodes))
    except ApiException as error:
        return TunnelReport(error=f"{error.status} {error.reason}")
    running = [p for p in pods if _running(p)]
    servers = sorted(p["metadata"]["name"] for p in running if _is(p, TUNNEL_SERVER))
    agents = {p["spec"].get("nodeName", ""): p["metadata"]["name"] for p in running if _is(p, TUNNEL_AGENT)}
    names = sorted(n["metadata"]["name"] for n in nodes)
    return TunnelReport(servers=servers, agents={n: agents[n] for n in names if n in agents},
                        missing=[n for n in names if n not in agents])
