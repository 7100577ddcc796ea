"""GPU pods, as the demand loop reads them: each pod's effective GPU request and what decides
where it can run (selectors, tolerations, whether the scheduler found no node)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Callable

from kubernetes.utils import parse_quantity

from fleet.cluster import GPU_RESOURCE
from fleet.demand import DEMAND_ANNOTATIONS, GpuPod, Toleration
from providers.cluster.kubernetes.watch import Watches

#: What the kubelet writes on a static pod's mirror, the one kind of pod a node may create.
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
#: More GPUs than any pod asks for or any machine has in earnest. A node's own mirror pod may ask
#: for any quantity, and its kubelet may write any as its Node's allocatable GPUs ("1E" is 10^18;
#: the API server keeps 1e10000000 as "10e9999999", and ``int`` of it runs for some 40 minutes
#: holding the GIL): a larger one counts as this many; what a node's pods hold is capped at its own
#: GPUs (``fleet.demand.gpus_counted``), and what a node has at its site's machine
#: (``fleet.models.Node.believed``).
MOST_GPUS = 1 << 20


def gpu_count(value: Any) -> int:
    """A GPU quantity as a count, compared as a quantity before it is made one: 0 for a value
    that is no quantity or not above zero, ``MOST_GPUS`` for more."""
    try:
        quantity = parse_quantity(str(value))
    except ValueError:
        return 0
    if not quantity.is_finite() or quantity <= 0:
        return 0
    return MOST_GPUS if quantity > MOST_GPUS else int(quantity)


def container_gpus(container: dict[str, Any]) -> int:
    """The GPUs a container asks for: 0 for none, or for a value that is no quantity or below
    zero; ``MOST_GPUS`` for more."""
    resources = container.get("resources") or {}
    # An extended resource may be given as a limit only: the request then equals it.
    return gpu_count((resources.get("requests") or {}).get(GPU_RESOURCE,
                                                          (resources.get("limits") or {}).get(GPU_RESOURCE, 0)))


def gpu_pod(pod: dict[str, Any]) -> GpuPod:
    """A Pod object as the demand loop reads it (its effective GPU request: the containers'
    sum, or an init container's, whichever is larger, as the scheduler counts it)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    gpus = min(MOST_GPUS, max(sum(container_gpus(c) for c in spec.get("containers") or []),
                              max((container_gpus(c) for c in spec.get("initContainers") or []), default=0)))
    conditions = status.get("conditions") or []
    owners = [o.get("kind", "") for o in meta.get("ownerReferences") or []]
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
        owner_kinds=owners,
        created_at=created_at,
        mirror=MIRROR_ANNOTATION in (meta.get("annotations") or {}) or "Node" in owners,
    )


class GpuPods(Watches):
    """The GPU pods of every namespace: listed, or followed until the caller's condition holds."""

    def list_gpu_pods(self, pending_only: bool = False) -> list[GpuPod]:
        # The field selectors the scheduler's own "unscheduled pods" view uses: the server
        # filters, so a cluster of many finished pods costs one small list.
        selector = ("status.phase=Pending,spec.nodeName=" if pending_only
                    else "status.phase!=Succeeded,status.phase!=Failed")
        pods = self._do("list GPU pods", self.core.list_pod_for_all_namespaces, field_selector=selector)
        found = [gpu_pod(pod) for pod in pods.get("items", [])]
        return sorted((p for p in found if p.gpus > 0), key=lambda p: p.key)

    def watch_gpu_pods(self, until: Callable[[list[GpuPod]], bool], timeout_s: float, recheck_s: float = 30.0,
                       heartbeat: Callable[[], None] | None = None, poll_s: float = 0.2,
                       wake_at: Callable[[], float | None] | None = None) -> list[GpuPod]:
        def convert(obj: dict[str, Any]) -> GpuPod | None:
            pod = gpu_pod(obj)
            return pod if pod.gpus > 0 else None

        return self._follow("GPU pods", self.core.list_pod_for_all_namespaces, convert, until, timeout_s, recheck_s,
                            heartbeat, wake_at, field_selector="status.phase!=Succeeded,status.phase!=Failed")
