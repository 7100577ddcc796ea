"""Nodes: reading them (with the identity their join recorded), labels, annotations, taints,
cordon, drain and removal, and following them (``watch_nodes``).

Node identity: which machine, provider, account and site a node is comes
from the join's record (control-plane state ``node-identity``), never from
the node's labels or annotations, which its kubelet may write.

Nodes: only our labels, annotations and taints are touched (label and
annotation patches are merges; taints are read-modify-write under the
node's resourceVersion, retried on 409; a cordon decided on a read of the
node's marks is written under that read's resourceVersion, and a 409 is the
caller's to decide on again: ``NodeChanged``).
"""

from __future__ import annotations

import hashlib
import json

from datetime import datetime
from typing import Any, Callable

from kubernetes.client.exceptions import ApiException

from fleet.cluster import (
    ANNOTATION_CORDONED_BY,
    GPU_RESOURCE,
    LABEL_PROVIDER,
    LABEL_SITE,
    NODE_IDENTITY_KIND,
    NODE_KEYS_KIND,
    NodeIdentity,
)
from fleet.errors import Transient
from fleet.models import Node
from providers.cluster.base import (
    EvictOutcome,
    NodeChanged,
    NodeMarks,
    NodeNotFound,
    PodInfo,
    apply_taints,
    format_taint,
    parse_taint,
    EvictionDrain,
)
from providers.cluster.kubernetes.api import MERGE, PROVIDER, STRATEGIC, _Conflict, _message, _translate
from providers.cluster.kubernetes.gpu_pods import MIRROR_ANNOTATION, gpu_count
from providers.cluster.kubernetes.state import ControlPlaneState
from providers.cluster.kubernetes.watch import Watches


class Nodes(EvictionDrain, Watches, ControlPlaneState):
    """Reading, labelling, tainting, cordoning, draining and removing nodes."""

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
        ready_changed = next((c.get("lastTransitionTime") for c in conditions if c.get("type") == "Ready"), None)
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
            ready_changed_at=_timestamp(ready_changed),
            unschedulable=bool(spec.get("unschedulable")),
            boot_id=_boot_id((status.get("nodeInfo") or {}).get("bootID", "")),
            # The kubelet's word: any quantity the API server takes (see ``MOST_GPUS``).
            gpus_allocatable=gpu_count(gpus),
            registered_at=_timestamp(created),
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

    def annotate_node(self, name: str, annotations: dict[str, str | None], *,
                      version: str | None = None) -> dict[str, str]:
        body: dict[str, Any] = {"metadata": {"annotations": dict(annotations)}}
        if version is None:
            node = self._retry_on_conflict(f"node {name}", lambda: self._patch_node(name, body, MERGE))
        else:
            node = self._patch_node_as_read(name, body, version)
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

    def cordon(self, name: str, unschedulable: bool = True, *, by: str | None = None,
               version: str | None = None) -> Node:
        body: dict[str, Any] = {"spec": {"unschedulable": True if unschedulable else None}}
        # One patch: the cordon and who made it land together (an uncordon drops the mark).
        if not unschedulable:
            body["metadata"] = {"annotations": {ANNOTATION_CORDONED_BY: None}}
        elif by:
            body["metadata"] = {"annotations": {ANNOTATION_CORDONED_BY: by}}
        if version is None:
            return self._node(self._retry_on_conflict(f"node {name}", lambda: self._patch_node(name, body, MERGE)))
        return self._node(self._patch_node_as_read(name, body, version))

    def _patch_node_as_read(self, name: str, body: dict[str, Any], version: str) -> dict[str, Any]:
        """Merge ``body`` into the node only if it is still at ``version``: the API server refuses a
        patch carrying a resourceVersion the node no longer has (409), and that is the caller's to
        decide on again (``NodeChanged``), not retried here."""
        body.setdefault("metadata", {})["resourceVersion"] = version
        try:
            return self._patch_node(name, body, MERGE)
        except _Conflict as error:
            raise NodeChanged(f"node {name} changed since it was read: nothing written", code="409") from error

    def node_marks(self, name: str) -> NodeMarks:
        node = self._read_node(name)
        meta = node["metadata"]
        return NodeMarks(annotations=dict(meta.get("annotations") or {}),
                         unschedulable=bool((node.get("spec") or {}).get("unschedulable")),
                         version=meta["resourceVersion"])

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
            if error.status == 403 and _namespace_terminating(error):
                # As ``kubectl drain``: no eviction is possible in a namespace being deleted, and
                # none is needed: the namespace's deletion removes the pod, waited for as evicted.
                return "evicted", ""
            if error.status in (401, 403):
                raise _translate(error, f"evict {namespace}/{name}") from error
            # 429: a PodDisruptionBudget allows no disruption now; 500: more than
            # one PDB matches; anything else: retried until the deadline too.
            return "blocked", _message(error)
        except Transient as error:
            return "blocked", str(error)

    def _delete_pod(self, namespace: str, name: str) -> None:
        self._delete(f"delete pod {namespace}/{name}", self.core.delete_namespaced_pod, name, namespace)

    def watch_nodes(self, selector: dict[str, str] | None, until: Callable[[list[Node]], bool], timeout_s: float,
                    recheck_s: float = 30.0, heartbeat: Callable[[], None] | None = None,
                    poll_s: float = 1.0) -> list[Node]:
        label_selector = ",".join(f"{k}={v}" for k, v in sorted((selector or {}).items()))
        return self._follow("nodes", self.core.list_node, self._node, until, timeout_s, recheck_s, heartbeat,
                            **({"label_selector": label_selector} if label_selector else {}))


def _namespace_terminating(error: ApiException) -> bool:
    """The API server refused the eviction because the pod's namespace is being deleted."""
    try:
        causes = (json.loads(error.body or "{}").get("details") or {}).get("causes") or []
    except (ValueError, AttributeError):
        return False
    return any(isinstance(c, dict) and c.get("reason") == "NamespaceTerminating" for c in causes)


def _identified(node: Node, identity: NodeIdentity | None) -> Node:
    """The node with the machine, provider, account and site its join recorded."""
    if identity is None:
        return node
    return node.model_copy(update={"machine_id": identity.machine_id, "provider": identity.provider,
                                   "account": identity.account, "site": identity.site})


#: A boot id is a UUID (36 characters), and every read of a node's facts carries it into workflow
#: history (its entity's, its repairs', their reboot's input and mark). Its kubelet may write any
#: string there (the API server took 100,000 characters): a longer one is read as its digest, short
#: and still telling one boot from another.
MAX_BOOT_ID = 64


def _boot_id(value: Any) -> str:
    text = value if isinstance(value, str) else ""
    return text if len(text) <= MAX_BOOT_ID else "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _machine_from_provider_id(provider_id: str) -> str:
    """``aws:///us-east-1a/i-0abc`` → ``i-0abc``; ``hcloud://123`` → ``123`` (best effort).
    A ``gpufleet://`` providerID names no provider id: the identity record has the machine."""
    if not provider_id or provider_id.startswith("gpufleet://"):
        return ""
    _scheme, _, rest = provider_id.partition("://")
    parts = [p for p in (rest or provider_id).split("/") if p]
    return parts[-1] if parts else ""


def _timestamp(value: str | None) -> datetime | None:
    """An API server timestamp (RFC 3339, ``Z``) as an aware datetime; None where absent."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None
