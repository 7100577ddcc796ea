"""ModelRollout's pure parts: the input, manifest checks, batch planning, the
health-gate verdict and the per-site progress table. No Temporal, no I/O.

A rollout (``rollout/<model>/<version>``) replicates the weights to every target
site's object store, then updates the canary site(s), then the rest in batches,
each site passing its health gate (readiness + probe requests + bake) before the
next batch starts (product rules 10 and 11).
"""

from __future__ import annotations

import json
import math
import re
from enum import StrEnum
from typing import Any, Iterable, Mapping

from pydantic import BaseModel, Field, TypeAdapter, field_validator, model_validator

from fleet.config import ObjectStore
from fleet.models import Strict
from fleet.naming import rollout_id
from fleet.routing import MAX_ROUTED_SITES

SHA256_HEX = r"^[0-9a-f]{64}$"
MiB = 1024 * 1024
#: S3 allows at most this many parts in one multipart upload.
MAX_PARTS = 10_000
DAY = 86400
#: No model's weights come near this (1 PiB); a bigger number is a typo.
MAX_BYTES = 2**50
NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
#: An environment variable name every supported Kubernetes takes (1.31's ``IsEnvVarName``; 1.32 on
#: also take any printable ASCII but '=').
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
KiB = 1024
#: What a rollout's own input (its weights manifest, image, args and env) may take of a serving
#: pod template. The Kubernetes adapter keeps each template it writes, as JSON, in a Deployment
#: annotation, and the one before it in another (the rollback's), and Kubernetes refuses an
#: object whose annotations pass 256 KiB in all (apimachinery ``TotalAnnotationSizeLimitB``; the
#: ReplicaSets get copies): two such templates with their fixed part (labels, probes, the site's
#: store) leave room for the other annotations. The manifest also travels as one environment
#: variable of the weights step, which Linux caps at 128 KiB.
POD_TEMPLATE_BUDGET = 112 * KiB


class WeightFile(Strict):
    #: Relative to the manifest's source prefix, e.g. ``model-00001-of-00004.safetensors``.
    path: str = Field(min_length=1, max_length=1024)
    size: int = Field(ge=0, le=MAX_BYTES)
    sha256: str = Field(pattern=SHA256_HEX, description="lowercase hex sha256 of the whole file")

    @field_validator("path")
    @classmethod
    def _relative(cls, path: str) -> str:
        if path.startswith("/") or ".." in path.split("/"):
            raise ValueError("must be a relative path without '..'")
        return path


_FILES = TypeAdapter(list[WeightFile])


def pod_template_bytes(value: Any) -> int:
    """Bytes ``value`` takes in a serving pod template as the adapter stores it (compact JSON)."""
    return len(json.dumps(value, separators=(",", ":")))


def manifest_template_bytes(files: list[WeightFile]) -> int:
    """Bytes the manifest's files take in the template: their JSON, inside the weights step's
    environment variable (a JSON string in the template, so escaped once more)."""
    return pod_template_bytes(_FILES.dump_json(files).decode())


def _check_template_budget(size: int, what: str, remedy: str) -> None:
    """Refuse ``what`` taking ``size`` bytes of the serving pod template past the budget: before
    any copy, where every site's update would fail for good (422)."""
    if size > POD_TEMPLATE_BUDGET:
        raise ValueError(f"{what} take {size / KiB:.1f} KiB of the serving pod template; at most "
                         f"{POD_TEMPLATE_BUDGET // KiB} KiB fit (Kubernetes keeps a Deployment's annotations, "
                         f"which hold the template twice, under 256 KiB): {remedy}")


class WeightsSource(Strict):
    """Where the weights come from: one of the fleet config's named ``object_stores``.

    Only a name and a key prefix: the endpoint and the credentials are the operator's
    (``sites.yaml``), never the manifest author's."""

    store: str = Field(min_length=1, max_length=128, pattern=NAME)
    #: Key prefix inside that store, relative to the store's own prefix ("" or ending in "/").
    prefix: str = Field("", max_length=1024)

    @field_validator("prefix")
    @classmethod
    def _relative_prefix(cls, prefix: str) -> str:
        if prefix.startswith("/") or ".." in prefix.split("/"):
            raise ValueError("must be a relative key prefix without '..'")
        if prefix and not prefix.endswith("/"):
            raise ValueError("must be empty or end with '/'")
        return prefix


class WeightsManifest(Strict):
    source: WeightsSource
    files: list[WeightFile] = Field(min_length=1, max_length=100_000)

    @field_validator("files")
    @classmethod
    def _unique(cls, files: list[WeightFile]) -> list[WeightFile]:
        seen: set[str] = set()
        for f in files:
            if f.path in seen:
                raise ValueError(f"duplicate file {f.path!r}")
            seen.add(f.path)
        return files

    @field_validator("files")
    @classmethod
    def _fits_a_deployment(cls, files: list[WeightFile]) -> list[WeightFile]:
        _check_template_budget(manifest_template_bytes(files), f"{len(files)} files", "use fewer, larger files")
        return files

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class HealthGate(Strict):
    #: How long the updated Deployment has to become fully ready.
    ready_timeout_seconds: float = Field(600, gt=0, le=DAY)
    #: Probe requests sent to the site's Service after it is ready (and again after the bake).
    probe_requests: int = Field(10, ge=0, le=1000)
    #: Largest share of failed probes that still passes (0 = every probe must succeed).
    max_error_rate: float = Field(0.0, ge=0, le=1)
    #: Watch time after the first gate, before the site counts as done.
    bake_seconds: float = Field(300, ge=0, le=7 * DAY)
    probe_timeout_seconds: float = Field(30, gt=0, le=3600)


class Strategy(Strict):
    #: Updated first, one at a time; default: the first target site.
    canary_sites: list[str] = Field(default_factory=list, max_length=1000)
    #: Sites updated together after the canary; one batch in flight at a time.
    batch_size: int = Field(1, ge=1, le=1000)
    gate: HealthGate = Field(default_factory=HealthGate)
    #: How often a site under evacuation is re-checked while it waits.
    evacuation_poll_seconds: float = Field(60, gt=0, le=DAY)


class Replication(Strict):
    #: Multipart part size (S3 wants >= 5 MiB except for the last part); also the memory bound.
    part_size_bytes: int = Field(64 * MiB, ge=1, le=5 * 1024 * MiB)
    #: Read size while streaming/hashing.
    chunk_size_bytes: int = Field(1 * MiB, ge=1, le=1024 * MiB)
    #: Parts uploaded concurrently per file (memory: concurrency x part size).
    concurrency: int = Field(4, ge=1, le=32)
    #: Optional cap on bytes/s per site (0 = none), so a copy does not saturate a site's link.
    bandwidth_limit_bytes_per_s: int = Field(0, ge=0, le=MAX_BYTES)
    heartbeat_seconds: float = Field(30, gt=0, le=3600)
    timeout_seconds: float = Field(6 * 3600, gt=0, le=7 * DAY)


class SiteTarget(Strict):
    site: str = Field(min_length=1, max_length=253)
    replicas: int = Field(ge=0, le=10_000)


class RolloutInput(Strict):
    """Start with plain JSON (see ``gpufleet rollout start FILE``)."""

    model: str = Field(min_length=1, max_length=128, pattern=NAME)
    version: str = Field(min_length=1, max_length=128, pattern=NAME)
    weights: WeightsManifest
    image: str = Field(min_length=1, max_length=1024)
    args: list[str] = Field(default_factory=list, max_length=1000)
    env: dict[str, str] = Field(default_factory=dict, max_length=1000)
    gpus_per_replica: int = Field(1, ge=0, le=64)
    port: int = Field(8000, ge=1, le=65535)
    sites: list[SiteTarget] = Field(min_length=1)
    strategy: Strategy = Field(default_factory=Strategy)
    replication: Replication = Field(default_factory=Replication)
    #: Where the weights appear on the node (``<weights_root>/<model>/<version>``).
    weights_root: str = Field("/models", max_length=1024)

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        # Each key names a variable of the server's container: one the API server refuses would
        # fail the canary's Deployment write (422), after the weights were copied to every site.
        for name in env:
            if not ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name Kubernetes takes (a letter, "
                                 "'-', '.' or '_', then letters, digits, '-', '.' and '_')")
        return env

    @model_validator(mode="after")
    def _check(self) -> "RolloutInput":
        names = [t.site for t in self.sites]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"sites: listed more than once: {', '.join(dupes)}")
        if all(t.replicas == 0 for t in self.sites):
            raise ValueError("sites: zero replicas everywhere")
        unknown = [c for c in self.strategy.canary_sites if c not in names]
        if unknown:
            raise ValueError(f"strategy.canary_sites: not among the target sites: {', '.join(unknown)}")
        if len(names) > MAX_ROUTED_SITES:
            raise ValueError(f"sites: {len(names)} target sites; a model is routed to at most {MAX_ROUTED_SITES} "
                             "(its HTTPRoute's backendRefs, Gateway API's limit)")
        _check_template_budget(manifest_template_bytes(self.weights.files)
                              + pod_template_bytes([self.image, self.args, self.env]),
                              "weights.files, image, args and env together", "shorten them")
        return self

    @property
    def rollout_id(self) -> str:
        return rollout_id(self.model, self.version)

    @property
    def canaries(self) -> list[str]:
        return list(self.strategy.canary_sites) or [self.sites[0].site]

    def replicas(self, site: str) -> int:
        return next(t.replicas for t in self.sites if t.site == site)

    @property
    def weights_path(self) -> str:
        return f"{self.weights_root.rstrip('/')}/{self.model}/{self.version}"

    def dest_prefix(self, store: ObjectStore) -> str:
        """Key prefix of this version's weights in a site's store."""
        return f"{store.prefix}models/{self.model}/{self.version}/"


def check_source(request: RolloutInput, object_stores: Iterable[str]) -> list[str]:
    """The manifest's source must name one of the fleet config's ``object_stores``."""
    names = sorted(object_stores)
    if request.weights.source.store in names:
        return []
    return [f"weights.source.store: unknown object store {request.weights.source.store!r}; "
            + (f"known: {', '.join(names)}" if names else "the fleet config names none (object_stores:)")]


def check_sites(request: RolloutInput, stores: dict[str, ObjectStore | None], known: Iterable[str],
                gpus_per_machine: Mapping[str, int]) -> list[str]:
    """Problems that need the fleet config: unknown sites, sites without an object store, sites
    whose machines have fewer GPUs than a replica asks for (its pods could never be scheduled:
    the rollout would copy the weights, wait out ``ready_timeout_seconds`` and roll back)."""
    known = set(known)
    problems = []
    for i, target in enumerate(request.sites):
        if target.site not in known:
            problems.append(f"sites[{i}].site: unknown site {target.site!r}; known sites: {', '.join(sorted(known))}")
        elif stores.get(target.site) is None:
            problems.append(f"sites[{i}].site: site {target.site!r} has no object_store configured for weights")
    # A site given no replicas schedules no pod: whatever its machines, it fits.
    too_small = [t.site for t in request.sites if t.replicas and t.site in gpus_per_machine
                 and gpus_per_machine[t.site] < request.gpus_per_replica]
    if too_small:
        where = ", ".join(f"{site} ({gpus_per_machine[site]} GPUs per machine)" for site in too_small)
        problems.append(f"gpus_per_replica: {request.gpus_per_replica} GPUs per replica, more than one machine has "
                        f"at {where}: its pods could never be scheduled there")
    return problems


def check_routed_sites(model: str, targets: list[str], served: Iterable[str]) -> list[str]:
    """The model's route past ``MAX_ROUTED_SITES`` once this rollout is done: its HTTPRoute has a
    backendRef for every site with the model's Deployment, which is each site it is ``served``
    at (a rollout retires none) and each target (given one even at 0 replicas). No other rollout
    of the model adds to it: one runs at a time. Refused at start: the API server would refuse
    the route's write only after the copies and the Deployments."""
    more = sorted(set(served) - set(targets))
    counted = len(set(targets)) + len(more)
    if counted <= MAX_ROUTED_SITES:
        return []
    parts = [f"the target sites ({', '.join(targets)})"] + (
        [f"the sites it is served at already ({', '.join(more)})"] if more else [])
    return [f"sites: {model!r} would be routed to {counted} sites, at most {MAX_ROUTED_SITES} (its HTTPRoute's "
            f"backendRefs, Gateway API's limit): {'; '.join(parts)}. A rollout retires no site: target fewer sites "
            "it is not served at"]


def another_rollout_running(running: str) -> str:
    """The problem of a rollout started while ``running``, another rollout of its model, runs: each
    scales and rolls the model's Deployments to its own version, so two at once fight over them."""
    return (f"model: {running} is still running, and a model is rolled out by one rollout at a time: wait for it "
            f"to end, or stop it (gpufleet rollout abort {running}), then start this one again")


def plan_batches(sites: list[str], canaries: list[str], batch_size: int) -> list[list[str]]:
    """Each canary alone first, then the other sites in order, ``batch_size`` at a time."""
    rest = [s for s in sites if s not in canaries]
    return [[c] for c in canaries] + [rest[i:i + batch_size] for i in range(0, len(rest), batch_size)]


def next_batch(queue: list[str], evacuating: Iterable[str], batch_size: int) -> tuple[list[str], list[str]]:
    """(the next batch, the sites deferred because they are under evacuation).

    Sites keep their queue order; a deferred site stays queued for a later batch."""
    evacuating = set(evacuating)
    deferred = [s for s in queue if s in evacuating]
    ready = [s for s in queue if s not in evacuating]
    return ready[:batch_size], deferred


class ProbeResult(BaseModel):
    site: str
    sent: int = 0
    errors: int = 0
    #: The first few error messages.
    samples: list[str] = Field(default_factory=list)


class GateVerdict(BaseModel):
    passed: bool
    reason: str


def evaluate_gate(gate: HealthGate, ready: bool, probe: ProbeResult | None) -> GateVerdict:
    """Readiness, then the probe error rate against ``max_error_rate``."""
    if not ready:
        return GateVerdict(passed=False, reason="serving is not ready")
    if probe is None or gate.probe_requests == 0:
        return GateVerdict(passed=True, reason="ready (no probes configured)")
    if probe.sent < gate.probe_requests:
        return GateVerdict(passed=False, reason=f"only {probe.sent} of {gate.probe_requests} probes could be sent")
    rate = probe.errors / probe.sent if probe.sent else 1.0
    detail = f"{probe.errors} of {probe.sent} probes failed ({rate:.0%}, allowed {gate.max_error_rate:.0%})"
    if rate > gate.max_error_rate + 1e-9:
        sample = f": {probe.samples[0]}" if probe.samples else ""
        return GateVerdict(passed=False, reason=detail + sample)
    return GateVerdict(passed=True, reason=detail)


def part_size_for(size: int, part_size: int) -> int:
    """The part size to use for a file: ``part_size``, raised so the file fits in MAX_PARTS parts."""
    return max(part_size, math.ceil(size / MAX_PARTS))


class SiteState(StrEnum):
    PENDING = "pending"
    REPLICATING = "replicating"
    REPLICATED = "replicated"
    DEFERRED = "deferred"
    UPDATING = "updating"
    GATING = "gating"
    BAKING = "baking"
    DONE = "done"
    FAILED = "failed"
    ROLLING_BACK = "rolling-back"
    ROLLED_BACK = "rolled-back"
    SKIPPED = "skipped"


#: States in which the site's Deployment may already run the new version.
TOUCHED = {SiteState.UPDATING, SiteState.GATING, SiteState.BAKING, SiteState.DONE}


class SiteProgress(BaseModel):
    site: str
    replicas: int
    canary: bool = False
    state: SiteState = SiteState.PENDING
    bytes_total: int = 0
    #: Bytes replicated (copied or found already there), known when replication ends.
    bytes_done: int = 0
    files_total: int = 0
    files_done: int = 0
    #: The Deployment generation before the update (None: the model was not served there).
    previous_generation: int | None = None
    previous_image: str = ""
    detail: str = ""


class RolloutProgress(BaseModel):
    rollout_id: str
    model: str
    version: str
    phase: str = "starting"
    paused: bool = False
    aborting: bool = False
    batch: int = 0
    batches: int = 0
    sites: list[SiteProgress] = Field(default_factory=list)
    reason: str = ""
    #: Each site whose rollback failed (refused for good: anything else is retried until done),
    #: with why: it may still serve what the rollout put there.
    rollback_failed: dict[str, str] = Field(default_factory=dict)
    #: What a person must do, once something only a person can fix happened ("" until then).
    #: Never cleared: a later phase changes ``phase`` and ``reason``, not this.
    needs_person: str = ""

    def site(self, name: str) -> SiteProgress:
        return next(s for s in self.sites if s.site == name)

    def rollback_failed_at(self, site: str, why: str) -> None:
        """``site`` could not be put back: it joins ``rollback_failed``, and ``needs_person``
        names every such site and why."""
        self.rollback_failed[site] = why
        sites = ", ".join(self.rollback_failed)
        whys = "; ".join(f"{name}: {text}" for name, text in self.rollback_failed.items())
        self.needs_person = f"rollback failed at {sites}: needs a person ({whys})"

    def with_needs_person(self, reason: str) -> str:
        """``reason``, followed by what a person must do once that is set."""
        return "; ".join(part for part in (reason, self.needs_person) if part)


class RolloutResult(BaseModel):
    rollout_id: str
    #: completed, completed-with-failures, aborted
    outcome: str
    sites: list[SiteProgress]
    reason: str = ""
    #: Set when a site's rollback failed: which sites and why (``RolloutProgress.needs_person``).
    needs_person: str = ""


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


#: Phases a pause does not describe: the hold itself (``paused``), a rollback, an end. A rollout
#: aborted or cancelled while paused keeps ``paused`` set; "aborted (paused)" read as one a
#: ``resume`` would go on with.
NOT_PAUSED_PHASES = frozenset({"paused", "aborting", "aborted", "cancelling", "cancelled", "failed", "completed",
                               "completed-with-failures"})


def paused_note(progress: RolloutProgress) -> str:
    """" (paused)" after the phase while a pause holds the rollout in it; "" otherwise."""
    return " (paused)" if progress.paused and progress.phase not in NOT_PAUSED_PHASES else ""


def render_details(progress: RolloutProgress) -> str:
    """Markdown for ``set_current_details``: the phase, then a site x state table."""
    head = (f"**{progress.phase}**" + paused_note(progress)
            + (" (aborting)" if progress.aborting else "") + (" (needs a person)" if progress.needs_person else ""))
    if progress.batches:
        head += f" - batch {progress.batch} of {progress.batches}"
    lines = [head]
    if progress.reason:
        lines.append(progress.reason)
    lines += ["", "| site | replicas | state | weights | detail |", "|---|---|---|---|---|"]
    for s in progress.sites:
        name = s.site + (" (canary)" if s.canary else "")
        weights = f"{s.files_done}/{s.files_total} files, {_size(s.bytes_done)}/{_size(s.bytes_total)}"
        lines.append(f"| {name} | {s.replicas} | {s.state.value} | {weights} | {s.detail.replace('|', '/')} |")
    return "\n".join(lines)
