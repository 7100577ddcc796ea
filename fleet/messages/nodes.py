"""Inputs and results of the join, node, repair and node-agent activities: one model per
activity, so fields can be added without breaking callers."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, StrictStr, StringConstraints

from fleet.cluster import JoinTokenRef
from fleet.config import Site
from fleet.messages.repair import NodeWatchResult
from fleet.models import CapacityType, GpuHealth, Machine, MachineSpec, UtcDatetime
from fleet.repair_policy import RepairSettings


class ResolveSiteInput(BaseModel):
    site: str


class SiteConfigured(BaseModel):
    """Whether the fleet config of the worker that answered names a site, and, where it does not,
    what the cluster still has there (``fleet.site_use``): what decides whether the site's Site
    entity may end."""

    configured: bool
    #: Nodes in the cluster labelled for the site (or whose join recorded it).
    nodes: list[str] = Field(default_factory=list)
    #: (node, machine) of each identity record of a node no longer in the cluster, whose machine
    #: may still be billed.
    gone: list[tuple[str, str]] = Field(default_factory=list)


class ProvisionJoinInput(BaseModel):
    """Token, user data and machine in one activity: the rendered bootstrap (it holds the
    token's secret) exists only inside it."""

    site: str
    #: Absent: the activity builds it from the site's config, with ``name`` and ``tags`` (the join
    #: then needs no lookup of its own before it).
    spec: MachineSpec | None = None
    #: The join's id: the provider's idempotency key, and the key its token is kept under.
    idempotency_key: str
    ttl_seconds: int = Field(3600, gt=0, le=3600)
    #: The node's name, and the machine's tags, where ``spec`` is absent.
    name: str = ""
    tags: dict[str, str] = Field(default_factory=dict)


class ProvisionedMachine(BaseModel):
    machine: Machine
    token: JoinTokenRef
    #: What the machine's kubelet was told to register as its providerID.
    provider_id: str
    #: The site it was bought at, as the activity found it in the config (absent from older workers).
    site: Site | None = None


class AwaitRegistrationInput(BaseModel):
    site: str
    node_name: str
    machine_id: str
    provider_id: str
    join_id: str
    #: Absolute, so a retried attempt keeps the original deadline.
    deadline: UtcDatetime
    poll_seconds: float = 1.0
    #: Once the registration is this join's machine: our labels and taints on the node.
    labels: dict[str, str] = Field(default_factory=dict)
    add_taints: list[str] = Field(default_factory=list)


class RevokeNodeTokensInput(BaseModel):
    node_name: str


class DeleteMachineInput(BaseModel):
    site: str
    machine_id: str


class ReleaseProvisionInput(BaseModel):
    """A provision that failed: whatever an earlier attempt created under this key goes."""

    site: str
    #: The machine's name, which every adapter derives from the idempotency key.
    name: str
    idempotency_key: str


class AdmitNodeInput(BaseModel):
    node_name: str
    site: str
    machine_id: str
    #: The node's state from its smoke test, for its new Node entity.
    first_state: NodeWatchResult | None = None


class StartedEntity(BaseModel):
    """A Node entity the site sweep started again, and how the run before it had ended."""

    node_name: str
    site: str
    #: How its last run closed ("terminated", "failed", "timed-out", "canceled", "completed"), or
    #: "none" where Temporal has no run of it on record (never started, or past its retention).
    was: str
    closed_at: UtcDatetime | None = None


#: Node entities one sweep pass starts at most (a fleet whose entities were all terminated at once
#: comes back over a few passes); the names a pass's result keeps.
MAX_ENTITY_STARTS = 200
MAX_STARTED_NAMED = 20


class NodeEntitiesStarted(BaseModel):
    """What ``ensure_node_entities`` found: the Node entities running, those it started again (the
    first ``MAX_STARTED_NAMED`` named), and the unwatched nodes left for the next pass."""

    running: int = 0
    started: int = 0
    named: list[StartedEntity] = Field(default_factory=list)
    left: int = 0


class StoppedSpotReclaims(BaseModel):
    """What ``reclaim_stopped_spot`` found: the spot nodes NotReady whose machine their provider
    reports stopped or terminated, taken without a notice the node agent read. ``started``: a
    SpotReclaim started for each; ``running``: one already ran, left alone; ``repairing``: a GpuRepair
    of the node runs (a reboot stops the machine); ``skipped``: ``<site>: why`` its provider was not
    asked or did not answer (the next pass asks again); ``left_to_a_person``: ``<node> (why, until
    when)`` for a node whose last reclaim a person cancelled or terminated a while ago (a person who
    starts the machine again): not started again meanwhile."""

    started: list[str] = Field(default_factory=list)
    running: list[str] = Field(default_factory=list)
    repairing: list[str] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)
    left_to_a_person: list[str] = Field(default_factory=list)


class RemoveNodeInput(BaseModel):
    node_name: str


class ProbeGpusInput(BaseModel):
    pass


class GpuProbeResult(BaseModel):
    """What ``probe_gpus`` saw on one node (a model's serving probe is ``fleet.rollout.ProbeResult``)."""

    node_name: str
    boot_id: str
    gpus: list[GpuHealth]


class SmokeTestInput(BaseModel):
    expected_gpus: int = Field(ge=1)
    #: Check only these GPUs' counters and compute (all must still be visible); None = every GPU.
    only_gpus: list[int] | None = None
    #: Also return the node's whole state as a health watch would (a join hands it to the
    #: node's new entity, whose first watch then waits for a change).
    include_state: bool = False


class SmokeResult(BaseModel):
    """What the node's agent answers (its wire type). A workflow never decodes a node's answer
    into it directly: it takes the payload undecoded and validates it as untrusted input
    (``workflows.steps.checked_smoke``: ``fleet.messages.repair.SmokeReport``, its state a
    ``NodeReport``), then builds one of these from what passed."""

    passed: bool
    gpus_seen: int
    boot_id: str = ""
    failures: list[str] = Field(default_factory=list)
    state: NodeWatchResult | None = None


# -- GPU repair ---------------------------------------------------------------------------
class HealthReport(BaseModel):
    """What a node agent sends its Node entity when its GPUs' health changed."""

    node_name: str
    boot_id: str
    gpus: list[GpuHealth] = Field(default_factory=list)


class ResetGpuInput(BaseModel):
    index: int = Field(ge=0)
    #: The repair attempt this reset belongs to (``<repair id>/<attempt>``): a retried
    #: activity with the same key does not reset the GPU again. Empty: not keyed.
    key: str = Field("", max_length=300)


class ReinstallDriverInput(BaseModel):
    pass


#: What an agent's ``reset_gpu`` or ``reinstall_driver`` answers (its tool's output), as a
#: workflow accepts it (``workflows.steps.node_answer``): a string, at most this long.
NodeSaid = Annotated[StrictStr, StringConstraints(max_length=1000)]


class NodeFactsInput(BaseModel):
    node_name: str


class NodeFacts(BaseModel):
    """The node as the cluster and the config see it, with the repair settings."""

    node_name: str
    found: bool = False
    site: str = ""
    provider: str = ""
    #: Where it was bought (site, provider, account and machine come from the join's record).
    account: str = ""
    machine_id: str = ""
    #: Its site's, as the config says: only a spot machine is ever reclaimed. None: no site, or
    #: one gone from the config (and every result recorded before the field).
    capacity_type: CapacityType | None = None
    gpus: int = 0
    boot_id: str = ""
    ready: bool = False
    #: Joined and proven (site label set, no unproven taint): repairs may start.
    admitted: bool = False
    settings: RepairSettings = Field(default_factory=RepairSettings)


class SiteHealthInput(BaseModel):
    site: str
    node_name: str


class SiteHealth(BaseModel):
    site: str
    nodes: int
    #: Other nodes at the site that are not ready or cordoned.
    unhealthy_others: int


class ContainInput(BaseModel):
    node_name: str
    gpu: int
    rung: str
    drain_seconds: float = 240


class ContainResult(BaseModel):
    evicted: int = 0
    blocked: list[str] = Field(default_factory=list)
    completed: bool = True


class FenceInput(BaseModel):
    """Fence one GPU and cordon its node, nothing more (no drain): the Node entity's first
    answer to a fault, before the Site entity and the ladder decide what follows."""

    node_name: str
    gpu: int
    rung: str


class UncontainInput(BaseModel):
    node_name: str
    gpu: int


class UncontainResult(BaseModel):
    #: The node is schedulable again (no other GPU on it is still fenced).
    uncordoned: bool
    still_fenced: list[int] = Field(default_factory=list)


class RestartMachineInput(BaseModel):
    site: str
    machine_id: str
    node_name: str
    #: The boot id before the restart: a retried call that finds it changed does nothing.
    boot_id_before: str


class WaitForBootInput(BaseModel):
    node_name: str
    boot_id_before: str
    deadline: UtcDatetime
    poll_seconds: float = 1.0


class ReplacementSitesInput(BaseModel):
    site: str
