"""Inputs and results of the rollout activities (weights replication and per-site
serving), importable by workflows without the activity code behind them."""

from __future__ import annotations

from pydantic import BaseModel, Field

from fleet.config import ObjectStore
from fleet.models import Carried, UtcDatetime
from fleet.rollout import Replication, RolloutInput, RolloutProgress, WeightFile, WeightsManifest
from fleet.cluster import ServingSpec, ServingStatus


class ReplicateInput(BaseModel):
    site: str
    #: The fleet config's ``object_stores`` entry the weights come from (only its name
    #: travels through history; the activity looks the store up).
    source_store: str | None = None
    #: Key prefix inside that store (after the store's own prefix).
    source_prefix: str = ""
    #: A whole store: rollouts recorded before sources came from the config, and direct callers.
    source: ObjectStore | None = None
    files: list[WeightFile]
    #: Key prefix at the destination (the source keys are ``source.prefix + path``).
    dest_prefix: str
    options: Replication = Field(default_factory=Replication)


class Part(BaseModel):
    number: int
    etag: str
    checksum: str
    size: int


class OpenUpload(BaseModel):
    path: str
    upload_id: str
    part_size: int
    attempt: int = 1
    parts: list[Part] = Field(default_factory=list)


class Checkpoint(BaseModel):
    """Heartbeat details: where a retried attempt continues from."""

    done: dict[str, str] = Field(default_factory=dict)
    bytes_done: int = 0
    bytes_total: int = 0
    files_total: int = 0
    current: OpenUpload | None = None
    mismatches: dict[str, int] = Field(default_factory=dict)


class ReplicateResult(BaseModel):
    site: str
    #: path -> copied | recopied | skipped (already there) | resumed (finished by an earlier attempt)
    files: dict[str, str]
    bytes_total: int
    bytes_copied: int
    bytes_skipped: int
    #: This attempt continued from an earlier attempt's heartbeat.
    resumed: bool = False


class AbortUploadsInput(BaseModel):
    """The multipart uploads open under ``prefix`` in ``site``'s store, to abort (``abort_weights_uploads``)."""

    site: str
    #: The rollout's own key prefix there (``RolloutInput.dest_prefix``); never empty.
    prefix: str = Field(min_length=1)


class AbortedUploads(BaseModel):
    site: str
    #: The keys whose open upload was aborted.
    keys: list[str] = Field(default_factory=list)


class ResolveRolloutSitesInput(BaseModel):
    sites: list[str]
    #: The rollout's model, claimed for the rollout (another of it running is refused), checked
    #: against the models the cluster serves and the fleet config names, and its route against
    #: the sites it is served at (none in an input recorded before it: nothing checked).
    model: str | None = None
    #: The manifest, its files looked for in its source store: a version whose weights are not
    #: there (or not at the manifest's sizes) is refused before any copy (none in an input
    #: recorded before it: nothing checked).
    weights: WeightsManifest | None = None


class RolloutSites(BaseModel):
    #: Every site in the fleet config.
    known: list[str]
    #: The asked-for sites that exist, with their object store (None: none configured).
    stores: dict[str, ObjectStore | None]
    #: The names of the fleet config's ``object_stores`` (a manifest's possible sources).
    object_stores: list[str] = Field(default_factory=list)
    #: The asked-for sites that exist, with their machines' GPU count (none in a result recorded
    #: before it: nothing to check against).
    gpus_per_machine: dict[str, int] = Field(default_factory=dict)
    #: Why the model may not roll out, each naming its field (none in a result recorded before it).
    problems: list[str] = Field(default_factory=list)


class ServingRef(BaseModel):
    model: str
    site: str


class UpdateServingInput(BaseModel):
    spec: ServingSpec


class WaitServingInput(BaseModel):
    model: str
    site: str
    #: Absolute, so a retried attempt keeps the original deadline.
    deadline: UtcDatetime
    poll_seconds: float = 2.0


class ProbeServingInput(BaseModel):
    model: str
    site: str
    requests: int
    timeout_seconds: float = 30


class RollbackSiteInput(BaseModel):
    model: str
    site: str
    #: The Deployment existed before the rollout: go back to its previous template.
    #: Otherwise the rollout created it: delete it.
    had_previous: bool
    #: The generation our update produced; a higher one means the rollback already happened.
    #: (Only where no template names were recorded: a scale raises the generation too.)
    updated_generation: int = 0
    #: The pod templates (``ServingStatus.template``) before and after our update: the rollback
    #: swaps back only while ours is live; the one before means it already happened; any other
    #: is someone else's change since, which stays.
    previous_template: str = ""
    updated_template: str = ""
    #: Replicas before and as our update set them: put back unless changed since.
    previous_replicas: int | None = None
    updated_replicas: int | None = None
    #: Set where our update gave no answer (it failed, perhaps after it wrote the Deployment; a
    #: cancel came): the image it asked for. ``updated_template`` is then unknown: ours is live
    #: where the template is not the one before and runs this image.
    unanswered_image: str = ""


class EvacuationInput(BaseModel):
    model: str
    sites: list[str]


class EvacuationWaitInput(BaseModel):
    """``wait_site_evacuations``: the sites a rollout waits for, as its last look saw them
    (site -> why it is under evacuation)."""

    model: str
    seen: dict[str, str]
    #: Absolute, so a retried attempt keeps the original bound: then the rollout looks again.
    until: UtcDatetime
    #: How often the worker reads the routes meanwhile (``strategy.evacuation_poll_seconds``).
    poll_seconds: float = 60


class RolloutCarry(BaseModel):
    """What ModelRollout carries over continue-as-new, taken only while it waits for evacuated
    sites: no site is being updated, no activity is open, every site already updated is done."""

    progress: RolloutProgress
    #: Each target site's object store, as the validation found it.
    stores: dict[str, ObjectStore | None]
    #: Each updated site's Deployment before and after the update, and the generation the update
    #: produced: what an abort or a cancel rolls back to, and how it knows it already did.
    before: dict[str, ServingStatus] = Field(default_factory=dict)
    after: dict[str, ServingStatus] = Field(default_factory=dict)
    updated_generation: dict[str, int] = Field(default_factory=dict)
    paused: bool = False
    #: The reason as the runbook last said it (``RolloutProgress.reason`` adds what a person must do).
    reason: str = ""


class RolloutRunInput(RolloutInput):
    """ModelRollout's input as the workflow reads it: a caller's ``RolloutInput`` (which has no
    ``carry``: the client and ``gpufleet rollout start`` refuse one), and the state a run that
    continued as new hands its next run."""

    carry: Carried[RolloutCarry | None] = None

