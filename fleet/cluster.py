"""The fleet's vocabulary inside Kubernetes: label, taint and annotation names, and
the documents the control plane reads and writes about nodes, drains, serving and
routing. Pure data: the cluster port (``providers.cluster``) speaks it, workflows
carry it."""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, Field

from fleet.models import UtcDatetime
from fleet.weights_pull import WeightsPull

#: Taint every new node carries until its smoke test passes.
UNPROVEN_TAINT = "gpufleet.io/unproven:NoSchedule"
#: The fleet taint: every GPU node gpufleet joins carries it from registration on (its
#: JoinConfiguration) and keeps it after admission, so only what tolerates it lands there:
#: serving pods, the node agent, pods of the demand opt-in contract (``fleet.demand``) and the
#: cluster's own tolerate-everything daemons. The control plane and the node gateway never
#: tolerate it: a GPU node must not host their credentials (README "Running for real", step 4).
#: A kubelet cannot change its own taints (NodeRestriction); the site reconcile puts it back.
FLEET_TAINT_KEY = "gpufleet.io/demand"
FLEET_TAINT = f"{FLEET_TAINT_KEY}:NoSchedule"
#: Placement and compliance labels live under ``node-restriction.kubernetes.io/``: the
#: NodeRestriction admission plugin refuses a kubelet that sets or changes such a key on its
#: own Node, so a node cannot move itself into another site (or compliance geography).
LABEL_SITE = "node-restriction.kubernetes.io/gpufleet-site"
LABEL_PROVIDER = "node-restriction.kubernetes.io/gpufleet-provider"
LABEL_REGION = "topology.kubernetes.io/region"
#: A node's site, under the name Kubernetes' topology-aware routing reads: a Service with
#: ``trafficDistribution: PreferClose`` then keeps a caller's traffic inside its site.
#: The kubelet may set this key (and region, GPU product) on itself (NodeRestriction allows it):
#: the site's watch puts it back within seconds and quarantines the node (``watch_site``).
LABEL_ZONE = "topology.kubernetes.io/zone"
LABEL_GPU_PRODUCT = "nvidia.com/gpu.product"
LABEL_MODEL = "gpufleet.io/model"
#: On join-token Secrets (never on Nodes: a node's kubelet may write its own annotations,
#: so the machine behind a node comes from the control plane's identity record).
ANNOTATION_MACHINE_ID = "gpufleet.io/machine-id"
#: On a cordoned Node: who of gpufleet's cordoned it, when that is an owner that must recognise
#: its own cordon from the cluster alone (``CORDONED_BY_DEMAND``). ``Cluster.cordon(by=...)`` writes
#: it with the cordon; an uncordon through the port removes it. A person takes a node over by
#: overwriting it (``kubectl annotate node N gpufleet.io/cordoned-by=<who> --overwrite``). The
#: node's kubelet may not write it, nor any ``gpufleet.io/`` annotation or its cordon: a node that
#: could would keep itself for good (deploy/kubernetes/admission-policy.yaml, gpufleet-node-marks).
ANNOTATION_CORDONED_BY = "gpufleet.io/cordoned-by"
#: The demand loop's mark: it cordoned the node to retire it (a drain that may have blocked).
CORDONED_BY_DEMAND = "demand"
#: The Site entity's mark: it cordoned the node to retire it above the site's max. A node left
#: cordoned so (its drain blocked) is the Site's to retire first, or to uncordon once the site is
#: back within its max.
CORDONED_BY_SURPLUS = "surplus"
#: An evacuation's mark: it cordoned a node it bought to retire it as it ends. Its own, not the
#: Site's: the Site must not uncordon a node the evacuation is draining.
CORDONED_BY_EVACUATION = "evacuation"
# An evacuation's drain of its own site marks each node it cordons with the evacuation's workflow id
# (``evacuate/<site>/<n>``, a person's ``evacuate/<site>/manual-<request>``): a cordon it left behind
# (the run terminated) is then told from a person's and from a repair's, and whose it is says whether
# its owner still runs. Unmarked, such cordons read as a person's (``gpufleet`` said ``operator``), and
# the next evacuation kept them as "cordoned before" it (``fleet.naming.is_evacuation_of``); now it takes
# over what one that ended left (``EvacuationFacts.left``), and its put-back lifts only the cordons still
# so marked (one a person marked theirs since stays).

#: A spot reclaim's mark: its drain cordoned the node, whose machine the provider takes at the
#: notice. A cancelled reclaim (the notice was false) uncordons a node still so marked, and no other.
CORDONED_BY_RECLAIM = "reclaim"
#: The marks of a cordon made to retire the node (its drain, then its machine deleted and the Node
#: removed): such a node's Node entity ends with it, and is not started again (``fleet.watched``).
RETIREMENT_MARKS = frozenset({CORDONED_BY_DEMAND, CORDONED_BY_SURPLUS, CORDONED_BY_EVACUATION, CORDONED_BY_RECLAIM})
#: On a Node, one annotation per GPU its repair fenced: ``gpufleet.io/fenced-gpu-<i>: <rung>``. The
#: node's device plugin treats a fenced GPU as unhealthy (not allocatable); while one is there the
#: node is its repair's, whoever cordoned it first.
FENCE_PREFIX = "gpufleet.io/fenced-gpu-"
#: The end of a fence's value (``<rung> on hold``) that a Node entity wrote before the GPU's repair
#: started (contain first: ``fence_gpu``), while its site or the cluster held the finding; the repair's
#: own containment writes its rung alone over it. A Node entity started again tells the two apart: a
#: fence still on hold was its run before's finding, which went with that run, and is checked again;
#: a repair's fence with no repair running was left by one that ended unproven, for a person.
FENCE_ON_HOLD = " on hold"


def fenced_gpus(annotations: dict[str, str]) -> list[str]:
    """The GPUs of a node that their repairs fenced, as its annotations (``FENCE_PREFIX``) name them."""
    return sorted(key.removeprefix(FENCE_PREFIX) for key in annotations if key.startswith(FENCE_PREFIX))


#: The control-plane state kind (``Cluster.update_state``) holding each joined node's
#: identity, written by the join when the node registered: a node cannot write it.
NODE_IDENTITY_KIND = "node-identity"
#: The serving pod template that ``apply_serving`` wrote, and the one before it.
ANNOTATION_TEMPLATE = "gpufleet.io/template"
ANNOTATION_PREVIOUS_TEMPLATE = "gpufleet.io/previous-template"
GPU_RESOURCE = "nvidia.com/gpu"
#: The port every serving Service exposes (the container port may differ).
SERVING_PORT = 8000
MAX_JOIN_TOKEN_TTL_S = 3600
#: The name of the fleet-wide per-site routing document (``set_site_routes``); no model is named so.
SITE_ROUTES = "_sites"



class JoinTokenRef(BaseModel):
    """What workflows may hold of a join token: never the secret."""

    token_id: str
    node_name: str
    expires_at: UtcDatetime


class NodeIdentity(BaseModel):
    """Which machine a node is, as the join that created it recorded it. Every action on
    machines (reboot, reinstall, replace, retire, reclaim, sweep) takes the machine from
    here, never from the node's own labels or annotations. The node gateway's liveness is
    this record together with the node's client keys (``NODE_KEYS_KIND``): a Node object a
    kubelet re-created, or a certificate for the name that no join of this machine asked
    for, opens nothing."""

    node_name: str
    machine_id: str
    provider: str
    account: str
    site: str
    #: What the kubelet was told to report (``gpufleet://<provider>/<account>/<node>``).
    provider_id: str = ""
    join_id: str = ""

    def state(self) -> dict[str, str]:
        return {k.replace("_", "-"): v for k, v in self.model_dump().items()}

    @classmethod
    def from_state(cls, data: dict[str, str]) -> "NodeIdentity | None":
        try:
            return cls(**{k.replace("-", "_"): v for k, v in data.items()})
        except (TypeError, ValueError):
            return None


#: The control-plane state kind holding, per node, the SHA-256 of each client key the cluster's
#: signer issued a certificate for at that node's join or renewal (written by gpufleet's CSR
#: approver; in the sim, by its signer), newest last. ``remove_node`` deletes it with the
#: identity record, so a retired node's certificates, and any certificate for its name that
#: the approver did not judge, stay refused by the node gateway.
NODE_KEYS_KIND = "node-client-keys"
#: Keys kept per node: the current one and those still on open connections after a renewal.
NODE_KEYS_KEPT = 4
#: The record's field naming the newest CSR a key was bound for (creation time, then name): an
#: approved CSR not newer than it had its key bound when it was approved, rotated out since.
NODE_KEYS_NEWEST_CSR = "newest-csr"


def client_key_fingerprint(public_key_der: bytes) -> str:
    """The record's name for a client key: SHA-256 of its DER SubjectPublicKeyInfo."""
    return hashlib.sha256(public_key_der).hexdigest()


def bound_keys(record: dict[str, str]) -> list[str]:
    """The key fingerprints in a ``NODE_KEYS_KIND`` record, oldest first."""
    return [k for k in (record.get("keys") or "").split(",") if k]


def with_key(record: dict[str, str], fingerprint: str, csr: str = "") -> dict[str, str]:
    """The record with ``fingerprint`` bound (newest), keeping the last ``NODE_KEYS_KEPT``; ``csr``:
    the CSR it is bound for (creation time, then name), kept when newer than ``NODE_KEYS_NEWEST_CSR``."""
    keys = [k for k in bound_keys(record) if k != fingerprint] + [fingerprint]
    newest = max(record.get(NODE_KEYS_NEWEST_CSR, ""), csr)
    return {"keys": ",".join(keys[-NODE_KEYS_KEPT:]), **({NODE_KEYS_NEWEST_CSR: newest} if newest else {})}


#: The scheme of the providerID of every machine gpufleet joins (``gpufleet_provider_id``).
PROVIDER_ID_SCHEME = "gpufleet://"


def gpufleet_provider_id(provider: str, account: str, node_name: str) -> str:
    """The providerID a gpufleet machine's kubelet sets: written into its user data before
    the provider's own id exists, so it names the machine by the name gpufleet chose."""
    return f"{PROVIDER_ID_SCHEME}{provider}/{account}/{node_name}"


def provider_of(provider_id: str) -> str | None:
    """The provider a ``gpufleet_provider_id`` names; None for any other providerID."""
    if not provider_id.startswith(PROVIDER_ID_SCHEME):
        return None
    return provider_id.removeprefix(PROVIDER_ID_SCHEME).split("/")[0] or None


class DrainPod(BaseModel):
    namespace: str
    name: str
    #: Why it was skipped or blocked (the PDB's message); empty when evicted.
    reason: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


#: How many left-alone pods a drain result names (the rest are counted).
SKIPPED_LISTED = 20


class DrainResult(BaseModel):
    node: str
    evicted: list[DrainPod] = Field(default_factory=list)
    #: Deleted past their PodDisruptionBudget (only with ``force=True``).
    deleted: list[DrainPod] = Field(default_factory=list)
    #: Left alone: DaemonSet-owned and mirror (static) pods, the first ``SKIPPED_LISTED`` of them. A
    #: node may create mirror pods bound to itself without limit, and this result is kept in workflow
    #: history, where one over 2 MiB is refused and the drain fails.
    skipped: list[DrainPod] = Field(default_factory=list)
    #: How many more were left alone than ``skipped`` lists.
    skipped_unlisted: int = 0
    #: Still on the node at the deadline, each with the reason.
    blocked: list[DrainPod] = Field(default_factory=list)
    completed: bool = False
    elapsed_s: float = 0.0
    #: Who holds the node, where a drain for an owner (``DrainNodeInput.cordoned_by``) found it
    #: someone else's (a GPU fenced by its repair, a person's cordon mark): nothing was cordoned
    #: or evicted. Empty in every result recorded before the field.
    held: str = ""


class ServingSpec(BaseModel):
    """One model served at one site: a Deployment and a Service named ``serving_name``."""

    model: str
    site: str
    image: str
    replicas: int = Field(1, ge=0)
    gpus_per_replica: int = Field(1, ge=0)
    args: list[str] = Field(default_factory=list)
    #: Path of the weights on the node; mounted read-only at the same path and
    #: passed as ``MODEL_WEIGHTS``.
    weights_path: str = ""
    env: dict[str, str] = Field(default_factory=dict)
    #: The container's HTTP port (the Service always listens on ``SERVING_PORT``).
    port: int = Field(SERVING_PORT, ge=1, le=65535)
    #: Extra replicas a rollout may start before old ones stop: > 0 loses no
    #: capacity during an update (needs spare GPUs); 0 replaces one at a time (what
    #: ``update_serving`` asks for at a site with no GPUs to spare).
    max_surge: int = Field(1, ge=0)
    #: Verified weights on the node: an init step pulls them into the node-local cache
    #: (``fleet.weights_pull``) and the server reads them from there; supersedes ``weights_path``.
    weights: WeightsPull | None = None


class ServingStatus(BaseModel):
    model: str
    site: str
    name: str
    image: str = ""
    #: What the spec asks for.
    desired_replicas: int = 0
    generation: int = 0
    observed_generation: int = 0
    #: Pods that exist / run the newest template / are available.
    replicas: int = 0
    updated_replicas: int = 0
    available_replicas: int = 0
    #: The newest template is fully rolled out and every replica is available.
    ready: bool = False
    #: A previous template is kept, so ``rollback_serving`` can go back to it.
    can_rollback: bool = False
    #: GPUs each replica asks for (from the pod template).
    gpus_per_replica: int = 0
    #: Which pod template the Deployment runs (``template_fingerprint``): a scale leaves it, an
    #: update or a rollback changes it. "" where the adapter could not say.
    template: str = ""
    #: Replicas the rolling update may start above ``desired_replicas`` (``ServingSpec.max_surge``):
    #: 0 replaces one at a time. None where the adapter could not say (a percentage).
    max_surge: int | None = None


def template_fingerprint(template_json: str) -> str:
    """A short, stable name for a pod template as the adapters store it (canonical JSON)."""
    return hashlib.sha256(template_json.encode()).hexdigest()[:16]


class SiteRoute(BaseModel):
    weight: int = Field(ge=0, le=1_000_000)
    healthy: bool = True
    draining: bool = False
    #: The open incident at this site (id or one line), empty when none.
    incident: str = ""


class RoutingTable(BaseModel):
    model: str
    #: Bumped by one on every change; unchanged when the same table is written again.
    version: int
    sites: dict[str, SiteRoute] = Field(default_factory=dict)
