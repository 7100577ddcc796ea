"""Capacity follows demand (product rule 13): the contract by which a pod asks the fleet
for capacity, pure (no Temporal, no I/O). The planner that buys for such pods is
``fleet.demand_planner``; which idle nodes go back, ``fleet.consolidation``.

**The opt-in contract.** A pod asks the fleet for capacity by carrying both

* a toleration for the fleet taint ``gpufleet.io/demand`` (effect ``NoSchedule``, or
  any effect with ``operator: Exists``), and
* the node selector ``node-restriction.kubernetes.io/gpufleet: "true"``,

like a burst tier: an operator may taint fleet nodes ``gpufleet.io/demand:NoSchedule``
to keep everything else off them, and the label says "a node the fleet runs". It then
narrows what it accepts with node selectors the fleet sets on every node it runs
(``LABELS_THE_FLEET_SETS``): GPU product, site, geography, capacity type; and with
annotations for what a selector cannot say: ``gpufleet.io/gpu-class`` ("H100,H200"),
``gpufleet.io/gpu-memory-gb-min`` and ``gpufleet.io/max-price-per-gpu-hour``. Its
``gpufleet.io/model`` label names its model's serving policy (mode, spot share,
headroom: ``fleet.config.ServingPolicy``). A selector on any other key is one no
bought node is known to carry: that pod is left alone, with the reason.

The geography and capacity-type labels and the fleet marker live under the
``node-restriction.kubernetes.io/`` prefix, which a kubelet cannot set on its own Node
(NodeRestriction), so a node cannot talk its way into a compliance geography.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

from pydantic import BaseModel, Field

from fleet.cluster import (
    FLEET_TAINT,
    FLEET_TAINT_KEY,
    LABEL_GPU_PRODUCT,
    LABEL_MODEL,
    LABEL_PROVIDER,
    LABEL_REGION,
    LABEL_SITE,
    LABEL_ZONE,
)
from fleet.config import ServingPolicy, Site
from fleet.models import CapacityType
from fleet.placement import Constraints

#: The fleet taint an opted-in pod tolerates (every GPU node gpufleet joins carries it).
DEMAND_TAINT_KEY = FLEET_TAINT_KEY
DEMAND_TAINT = FLEET_TAINT
#: The node selector an opted-in pod carries (value ``"true"``); every fleet node has it.
LABEL_FLEET = "node-restriction.kubernetes.io/gpufleet"
LABEL_GEOGRAPHY = "node-restriction.kubernetes.io/gpufleet-geography"
LABEL_CAPACITY_TYPE = "node-restriction.kubernetes.io/gpufleet-capacity-type"
ANNOTATION_GPU_CLASS = "gpufleet.io/gpu-class"
ANNOTATION_GPU_MEMORY = "gpufleet.io/gpu-memory-gb-min"
ANNOTATION_MAX_PRICE = "gpufleet.io/max-price-per-gpu-hour"
DEMAND_ANNOTATIONS = (ANNOTATION_GPU_CLASS, ANNOTATION_GPU_MEMORY, ANNOTATION_MAX_PRICE)
#: Node selector keys whose value on a node the fleet decides (``site_labels``).
LABELS_THE_FLEET_SETS = (LABEL_FLEET, LABEL_SITE, LABEL_GPU_PRODUCT, LABEL_GEOGRAPHY, LABEL_CAPACITY_TYPE,
                         LABEL_PROVIDER, LABEL_REGION)
#: Set by Kubernetes itself on every node; a pod may select it (it then names one node).
LABEL_HOSTNAME = "kubernetes.io/hostname"


class Toleration(BaseModel):
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: str) -> bool:
        """Kubernetes' rule: an empty key with ``Exists`` tolerates everything; an empty
        effect matches every effect."""
        key_value, _, effect = taint.rpartition(":")
        key, _, value = key_value.partition("=")
        if self.effect and self.effect != effect:
            return False
        if not self.key:
            return self.operator == "Exists"
        if self.key != key:
            return False
        return self.operator == "Exists" or self.value == value


class GpuPod(BaseModel):
    """A pod that requests GPUs, as the cluster port reports it."""

    namespace: str
    name: str
    uid: str = ""
    #: ``spec.nodeName``: empty while unbound.
    node: str = ""
    phase: str = "Pending"
    gpus: int = Field(0, ge=0)
    labels: dict[str, str] = Field(default_factory=dict)
    #: Only the ``DEMAND_ANNOTATIONS``.
    annotations: dict[str, str] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    #: ``status.nominatedNodeName``: the scheduler already found it a place (preemption).
    nominated_node: str = ""
    #: The scheduler tried and found no node (``PodScheduled=False``, reason ``Unschedulable``).
    unschedulable: bool = False
    owner_kinds: list[str] = Field(default_factory=list)
    created_at: float = 0.0
    #: A static pod's mirror: a node's kubelet wrote it (NodeRestriction lets a node create a pod
    #: only so: bound to itself, annotated ``kubernetes.io/config.mirror``, owned by no one but
    #: that Node). Its labels and its GPU request are the node's word, and decide nothing else.
    mirror: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def model(self) -> str:
        return self.labels.get(LABEL_MODEL, "")

    @property
    def pending(self) -> bool:
        return self.phase == "Pending" and not self.node


def gpus_counted(pods: Iterable[GpuPod], node_gpus: Mapping[str, int]) -> list[tuple[GpuPod, int]]:
    """Each pod that holds GPUs on a node of ``node_gpus`` (node name → the GPUs it is believed
    to have, ``Node.believed``), with the GPUs counted for it: what it asks, but no more than
    its node has left. A node's pods never hold more than the node has, so a pod a node wrote
    itself (a mirror pod, which may ask for "1E", 10^18) takes at most that node's own GPUs;
    the pods others made count first. A pod bound elsewhere, or ended, is left out."""
    left = {name: max(0, gpus) for name, gpus in node_gpus.items()}
    counted = []
    for pod in sorted(pods, key=lambda p: (p.mirror, p.key)):
        if pod.node not in left or pod.phase in ("Succeeded", "Failed"):
            continue
        gpus = min(pod.gpus, left[pod.node])
        left[pod.node] -= gpus
        counted.append((pod, gpus))
    return counted


def opted_in(pod: GpuPod) -> bool:
    """The contract: the fleet toleration and the fleet node selector."""
    return pod.node_selector.get(LABEL_FLEET) == "true" and any(t.tolerates(DEMAND_TAINT) for t in pod.tolerations)


def site_labels(site: Site) -> dict[str, str]:
    """The labels the fleet keeps on every node of ``site`` (what a bought node will carry)."""
    return {
        LABEL_FLEET: "true", LABEL_SITE: site.name, LABEL_GPU_PRODUCT: site.gpu, LABEL_PROVIDER: site.provider,
        LABEL_REGION: site.region, LABEL_CAPACITY_TYPE: site.capacity_type.value,
        **({LABEL_GEOGRAPHY: site.geography} if site.geography else {}),
    }


#: The public labels the scheduler and ``PreferClose`` read, which a kubelet may set on its own Node
#: (NodeRestriction allows the ``topology.kubernetes.io/`` keys and any unprefixed or foreign one):
#: gpufleet decides nothing with them (it reads ``LABEL_SITE`` and the identity record), but the
#: cluster does, so their values come from the site's config and are put back on a watch
#: (``watch_site``); a node seen changing one is quarantined.
PUBLIC_PLACEMENT_LABELS = (LABEL_ZONE, LABEL_REGION, LABEL_GPU_PRODUCT)


def public_placement_labels(site: Site) -> dict[str, str]:
    """What ``PUBLIC_PLACEMENT_LABELS`` say on every node of ``site``: its name is its zone."""
    return {LABEL_ZONE: site.name, LABEL_REGION: site.region, LABEL_GPU_PRODUCT: site.gpu}


def placement_drift(labels: dict[str, str], wanted: dict[str, str]) -> list[str]:
    """``key=value`` for each wanted label the node does not carry as wanted (``key`` alone: removed)."""
    return [f"{k}={labels[k]}" if k in labels else k for k, v in sorted(wanted.items()) if labels.get(k) != v]


def repelling(taints: Iterable[str]) -> list[str]:
    return [t for t in taints if t.rpartition(":")[2] in ("NoSchedule", "NoExecute")]


def fits(pod: GpuPod, labels: dict[str, str], taints: Iterable[str], free_gpus: int) -> bool:
    """Whether the scheduler may bind ``pod`` to a node with these labels, taints and free GPUs."""
    if pod.gpus > free_gpus:
        return False
    if any(labels.get(k) != v for k, v in pod.node_selector.items()):
        return False
    return all(any(t.tolerates(taint) for t in pod.tolerations) for taint in repelling(taints))


def pod_constraints(pod: GpuPod, policy: ServingPolicy | None = None) -> Constraints | str:
    """What ``pod`` accepts, as placement ``Constraints``; a string says why no bought
    machine could ever satisfy it."""
    selector = dict(pod.node_selector)
    unknown = sorted(k for k in selector if k not in LABELS_THE_FLEET_SETS)
    if unknown:
        return f"node selector {', '.join(unknown)} is not a label the fleet sets on the nodes it buys"
    raw: dict = {}
    if LABEL_GPU_PRODUCT in selector:
        raw["gpu"] = selector[LABEL_GPU_PRODUCT]
    elif pod.annotations.get(ANNOTATION_GPU_CLASS):
        raw["gpu_class"] = [g.strip() for g in pod.annotations[ANNOTATION_GPU_CLASS].split(",") if g.strip()]
    if LABEL_SITE in selector:
        raw["sites"] = [selector[LABEL_SITE]]
    if LABEL_GEOGRAPHY in selector:
        raw["geographies"] = [selector[LABEL_GEOGRAPHY]]
    if LABEL_CAPACITY_TYPE in selector:
        try:
            raw["capacity_types"] = [CapacityType(selector[LABEL_CAPACITY_TYPE])]
        except ValueError:
            return f"capacity type {selector[LABEL_CAPACITY_TYPE]!r} is not on-demand, spot or owned"
    for annotation, field in ((ANNOTATION_GPU_MEMORY, "gpu_memory_gb_min"),
                              (ANNOTATION_MAX_PRICE, "max_price_per_gpu_hour")):
        if annotation in pod.annotations:
            try:
                value = float(pod.annotations[annotation])
                if not math.isfinite(value) or value < 0:
                    raise ValueError
            except ValueError:
                return f"annotation {annotation}: {pod.annotations[annotation]!r} is not a number >= 0"
            raw[field] = int(value) if field == "gpu_memory_gb_min" else value
    if policy is not None and policy.spot_share <= 0:
        types = raw.get("capacity_types") or [CapacityType.ON_DEMAND, CapacityType.SPOT, CapacityType.OWNED]
        raw["capacity_types"] = [t for t in types if t != CapacityType.SPOT]
        if not raw["capacity_types"]:
            return "the pod asks for spot and its model's spot share is 0"
    try:
        return Constraints(**raw)
    except ValueError as error:
        return f"constraints: {error}"

