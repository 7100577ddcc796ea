"""Repair policy: which fault needs which repair, and when repeats escalate.

Pure data and functions (no Temporal, no I/O), so the Node entity and
GpuRepair workflows can call them deterministically and tests can check the
table without a server.

The ladder (product rule 4) is ordered: a cheaper rung is tried first and a
rung is left only when its proof failed::

    reset  <  reboot  <  reinstall  <  replace

Sources for the table below:

- [NV] NVIDIA, "XID Errors" catalog, the "Immediate action" column
  (https://docs.nvidia.com/deploy/xid-errors/): RESET_GPU, RESTART_BM / reboot
  (power cycle), CONTACT_SUPPORT, or "none / application" for errors the
  application caused.
- [EKS] Amazon EKS node monitoring agent, default GPU conditions and repair
  actions (https://docs.aws.amazon.com/eks/latest/userguide/node-health.html).
- [NVML] NVML API reference: ``nvmlDeviceGetRemappedRows``,
  ``nvmlDeviceGetRetiredPagesPendingStatus``, ``NVML_ERROR_GPU_IS_LOST`` and the
  field ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (values of
  ``nvmlDeviceGpuRecoveryAction_t``).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field

from fleet.models import GpuHealth, SettingSeconds, Strict


class Rung(StrEnum):
    RESET = "reset"
    REBOOT = "reboot"
    REINSTALL = "reinstall"
    REPLACE = "replace"

    @property
    def level(self) -> int:
        return LADDER.index(self)

    @property
    def node_level(self) -> bool:
        """Rungs that disrupt the whole node (serialized by the Node entity)."""
        return self is not Rung.RESET

    def next(self) -> "Rung | None":
        i = self.level + 1
        return LADDER[i] if i < len(LADDER) else None


LADDER: list[Rung] = [Rung.RESET, Rung.REBOOT, Rung.REINSTALL, Rung.REPLACE]


def higher(a: Rung | None, b: Rung | None) -> Rung | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a.level >= b.level else b


#: XID → the rung it starts at; ``None`` = the application's problem: count it, repair nothing.
XID_RUNG: dict[int, Rung | None] = {
    # -- the application's fault [NV: action "none" / restart the app] [EKS: event only] --
    13: None,  # Graphics Engine Exception: usually an app bug (illegal instruction, out-of-range access)
    31: None,  # GPU memory page fault: an app touched an invalid address
    43: None,  # GPU stopped processing: the app was killed / hit a user fault
    45: None,  # Preemptive cleanup after a previous error or an app being killed
    # -- GPU reset [NV: RESET_GPU] --
    48: Rung.RESET,  # Double-bit ECC error (DBE)
    63: Rung.RESET,  # ECC page retirement / row-remap recording event: reset applies the remap
    64: Rung.RESET,  # ECC page retirement / row-remapper recording failure
    94: Rung.RESET,  # Contained ECC error: the affected app died, the GPU needs a reset
    95: Rung.RESET,  # Uncontained ECC error: every app on the GPU is affected, reset the GPU
    119: Rung.RESET,  # GSP RPC timeout
    120: Rung.RESET,  # GSP error
    140: Rung.RESET,  # Unrecovered ECC error
    # -- node reboot / power cycle [NV: RESTART_BM / reboot] [EKS: Reboot] --
    74: Rung.REBOOT,  # NVLink error: link training / fatal NVLink error
    79: Rung.REBOOT,  # GPU has fallen off the bus: only a (cold) reboot brings it back
}

#: ``nvmlDeviceGpuRecoveryAction_t`` [NVML]: when the driver says what to do, that wins.
RECOVERY_ACTION_RUNG: dict[int, Rung | None] = {
    0: None,  # NVML_GPU_RECOVERY_ACTION_NONE
    1: Rung.RESET,  # NVML_GPU_RECOVERY_ACTION_GPU_RESET
    2: Rung.REBOOT,  # NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    3: Rung.RESET,  # NVML_GPU_RECOVERY_ACTION_DRAIN_P2P: drain peer-to-peer work, then reset
    4: Rung.RESET,  # NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET
}


class Finding(BaseModel):
    """What one GPU's health says should happen."""

    index: int
    #: Where the ladder starts; None = nothing to repair.
    rung: Rung | None = None
    reasons: list[str] = Field(default_factory=list)
    #: XIDs that need a repair, and XIDs that are the application's (count only).
    fatal_xids: list[int] = Field(default_factory=list)
    app_xids: list[int] = Field(default_factory=list)
    #: XIDs the table does not know: logged and counted, not repaired.
    unknown_xids: list[int] = Field(default_factory=list)


def classify(health: GpuHealth, xids: list[int] | None = None) -> Finding:
    """Classify one GPU. ``xids`` overrides ``health.xid_events`` (only the new ones)."""
    finding = Finding(index=health.index)
    rung: Rung | None = None
    for xid in health_xids(health) if xids is None else xids:
        if xid not in XID_RUNG:
            finding.unknown_xids.append(xid)
            continue
        xid_rung = XID_RUNG[xid]
        if xid_rung is None:
            finding.app_xids.append(xid)
        else:
            finding.fatal_xids.append(xid)
            finding.reasons.append(f"XID {xid}")
            rung = higher(rung, xid_rung)
    for condition, condition_rung in conditions(health).items():
        finding.reasons.append(condition)
        rung = higher(rung, condition_rung)
    if health.recovery_action:
        action = RECOVERY_ACTION_RUNG.get(health.recovery_action, Rung.REBOOT)
        finding.reasons.append(f"driver recovery action {health.recovery_action}")
        # The driver knows best: its action replaces what the table inferred
        # (a row-remap failure still means replace: no reset brings rows back).
        if action is not None:
            rung = Rung.REPLACE if health.remapped_rows_failure else action
    finding.rung = rung
    return finding


def health_xids(health: GpuHealth) -> list[int]:
    return [event.xid for event in health.xid_events]


def conditions(health: GpuHealth) -> dict[str, Rung]:
    """Counter / state problems (not XIDs) and the rung each starts at."""
    found: dict[str, Rung] = {}
    if health.remapped_rows_failure:
        found["row remapping failed"] = Rung.REPLACE  # [NV] no spare rows left: the board must go
    if health.lost:
        found["GPU is lost"] = Rung.REBOOT  # [NVML] NVML_ERROR_GPU_IS_LOST: like XID 79
    if health.nvlink_down:
        found[f"{health.nvlink_down} NVLink links down"] = Rung.REBOOT  # like XID 74
    if health.remapped_rows_pending:
        found["row remap pending"] = Rung.RESET  # [NVML] a pending remap is applied by a GPU reset
    if health.retired_pages_pending:
        found["page retirement pending"] = Rung.RESET  # [NVML] pre-Ampere: applied at the next reset
    if health.ecc_uncorrected:
        found[f"{health.ecc_uncorrected} uncorrected ECC errors"] = Rung.RESET  # volatile count: a reset clears it
    if health.slowdown_temperature_c and health.temperature_c >= health.slowdown_temperature_c:
        # Heat is rarely fixed by a reset, but the ladder escalates if the proof keeps failing.
        found["temperature at slowdown threshold"] = Rung.RESET
    return found


def fingerprint(boot_id: str, gpus: list[GpuHealth]) -> str:
    """What a report must differ in to be sent again (temperature only as hot/not hot)."""
    parts = [boot_id]
    for g in sorted(gpus, key=lambda g: g.index):
        hot = bool(g.slowdown_temperature_c and g.temperature_c >= g.slowdown_temperature_c)
        xids = ",".join(f"{e.xid}@{e.at.timestamp():.6f}" for e in g.xid_events)
        parts.append(
            f"{g.index}:{g.uuid}:{int(g.lost)}:{g.ecc_uncorrected}:{int(g.remapped_rows_pending)}:"
            f"{int(g.remapped_rows_failure)}:{int(g.retired_pages_pending)}:{g.nvlink_down}:{int(hot)}:"
            f"{g.recovery_action}:{xids}"
        )
    return "|".join(parts)


# -- escalation -------------------------------------------------------------------------
#: The ledger's hard cap on one GPU's XID hits in the window. The ledger is carried across
#: continue-as-new (a 2 MiB input), and a node can report fresh fatal XIDs in every answer.
MAX_XID_HITS_PER_GPU = 64


class RepairThresholds(Strict):
    #: The same fatal XID on one GPU this many times inside the window → replace (no more than
    #: the Node entity keeps of a GPU's fatal XIDs).
    same_xid_limit: int = Field(5, ge=1, le=MAX_XID_HITS_PER_GPU)
    same_xid_window_seconds: SettingSeconds = Field(24 * 3600, gt=0)
    #: This many remediations on one node inside the window → replace.
    node_remediation_limit: int = Field(5, ge=1)
    node_remediation_window_seconds: SettingSeconds = Field(7 * 24 * 3600, gt=0)
    #: Per-node repair stops at a site when more than this share of its nodes is unhealthy.
    site_unhealthy_fraction: float = Field(0.2, ge=0, le=1)


class XidHit(BaseModel):
    gpu: int
    xid: int
    at: float


class Ledger(BaseModel):
    """The Node entity's memory of faults and repairs (carried across continue-as-new, so each
    part is bounded whatever a node reports)."""

    #: Fatal XIDs in the window, oldest first: per GPU and XID the newest ``same_xid_limit``, per
    #: GPU at most ``MAX_XID_HITS_PER_GPU`` (``record_xids``).
    xid_hits: list[XidHit] = Field(default_factory=list)
    remediations: list[float] = Field(default_factory=list)
    #: Keyed by the table's application XIDs only (``classify`` sorts any other XID a node names
    #: into ``unknown_xids``): four keys at most.
    app_xids: dict[str, int] = Field(default_factory=dict)

    def prune(self, now: float, limits: RepairThresholds) -> None:
        self.xid_hits = [h for h in self.xid_hits if now - h.at < limits.same_xid_window_seconds]
        self.remediations = [t for t in self.remediations if now - t < limits.node_remediation_window_seconds]

    def record_xids(self, gpu: int, xids: list[int], now: float, limits: RepairThresholds) -> int:
        """Record a GPU's new fatal XIDs; how many hits the per-GPU cap dropped (0 unless a GPU
        reported more than ``MAX_XID_HITS_PER_GPU`` in the window).

        Pruned here, not only when a repair starts: a node reporting fresh XIDs in every answer
        (or on a GPU it does not have, whose findings never reach ``escalate``) would grow the
        carried list without end. Of one GPU and XID only the newest ``same_xid_limit`` are kept:
        ``escalate`` asks whether there are that many, so the rest change no decision."""
        hits = [h for h in [*self.xid_hits, *(XidHit(gpu=gpu, xid=x, at=now) for x in xids)]
                if now - h.at < limits.same_xid_window_seconds]
        per_xid: dict[tuple[int, int], int] = {}
        per_gpu: dict[int, int] = {}
        kept: list[XidHit] = []
        dropped = 0
        for hit in reversed(hits):  # newest first
            if per_xid.get((hit.gpu, hit.xid), 0) >= limits.same_xid_limit:
                continue
            if per_gpu.get(hit.gpu, 0) >= MAX_XID_HITS_PER_GPU:
                dropped += 1
                continue
            per_xid[(hit.gpu, hit.xid)] = per_xid.get((hit.gpu, hit.xid), 0) + 1
            per_gpu[hit.gpu] = per_gpu.get(hit.gpu, 0) + 1
            kept.append(hit)
        self.xid_hits = kept[::-1]
        return dropped

    def record_app_xids(self, xids: list[int]) -> None:
        for x in xids:
            self.app_xids[str(x)] = self.app_xids.get(str(x), 0) + 1

    def record_remediation(self, now: float) -> None:
        self.remediations.append(now)

    def escalate(self, finding: Finding, now: float, limits: RepairThresholds) -> tuple[Rung | None, str]:
        """The rung to start at, after repeat-fault escalation, and why it escalated."""
        if finding.rung is None:
            return None, ""
        self.prune(now, limits)
        for xid in set(finding.fatal_xids):
            hits = sum(1 for h in self.xid_hits if h.gpu == finding.index and h.xid == xid)
            if hits >= limits.same_xid_limit:
                return Rung.REPLACE, f"XID {xid} hit GPU {finding.index} {hits} times in the window"
        # This repair would be one more remediation.
        if len(self.remediations) + 1 >= limits.node_remediation_limit:
            return Rung.REPLACE, f"{len(self.remediations) + 1} remediations on this node in the window"
        return finding.rung, ""


class RepairTimeouts(Strict):
    contain_seconds: SettingSeconds = Field(300, gt=0)
    #: How long a drain may wait on PodDisruptionBudgets before reporting blocked pods.
    drain_seconds: SettingSeconds = Field(240, gt=0)
    reset_seconds: SettingSeconds = Field(300, gt=0)
    reboot_seconds: SettingSeconds = Field(900, gt=0)
    reinstall_seconds: SettingSeconds = Field(3600, gt=0)
    replace_seconds: SettingSeconds = Field(3600, gt=0)
    smoke_test_seconds: SettingSeconds = Field(600, gt=0)
    heartbeat_seconds: SettingSeconds = Field(30, gt=0)
    #: The health watch's heartbeat timeout (unset: twice ``heartbeat_seconds``). Every node's
    #: watch writes a heartbeat to the server about every 0.8x this, the fleet's steadiest load
    #: (at 1,250 nodes and 30 s, 52 writes a second); it is also how long a node whose agent
    #: restarted mid-watch goes unwatched before the watch is retried on the new agent.
    watch_heartbeat_seconds: float | None = Field(None, gt=0, le=3600)
    #: A node whose watch answers come long before their wait and change nothing (an honest agent
    #: answers on a change or at the wait) is paced: the next watch waits this long, doubling
    #: while it goes on, up to ``watch_pace_max_seconds``.
    watch_pace_seconds: float = Field(5, gt=0, le=3600)
    watch_pace_max_seconds: float = Field(300, gt=0, le=86400)
    #: A Node entity's run whose history passed this many MiB (or 16,384 events) while a repair of the
    #: node holds or waits for its action slot (it may not continue as new until the slot is free; repairs
    #: that do neither, a ladder waiting for a person, are carried over continue-as-new) waits before each
    #: next watch, from ``watch_pace_max_seconds`` doubling with every watch up to a year, or until the
    #: slot is free: a node's answers (up to 512 KiB each) cannot take its entity to Temporal's limits
    #: (50 MB, 51,200 events), where the server terminates it.
    watch_pace_history_mib: float = Field(16, gt=0, le=24)
    #: Every watch answer's bytes, early or at its wait, are charged against a budget of this many KiB
    #: that refills at ``watch_bytes_kib_per_hour``; past it the next watch waits until they are paid
    #: for (the node's answers are history in the store every workflow shares). An honest node's
    #: answers (about 3 KB for 8 GPUs, at most 12 an hour at the watch's wait, early only on a change)
    #: stay far inside the defaults; a node padding each to the gateway's 128 KiB gets 256 KiB an hour.
    watch_bytes_burst_kib: float = Field(512, ge=0, le=1_048_576)
    watch_bytes_kib_per_hour: float = Field(256, gt=0, le=1_048_576)
    #: One provider API call (reboot/reinstall request): a crashed worker's call is retried after this.
    provider_call_seconds: SettingSeconds = Field(120, gt=0)

    def watch_heartbeat(self) -> float:
        return self.watch_heartbeat_seconds or 2 * self.heartbeat_seconds

    def rung_seconds(self, rung: Rung) -> float:
        return {
            Rung.RESET: self.reset_seconds, Rung.REBOOT: self.reboot_seconds,
            Rung.REINSTALL: self.reinstall_seconds, Rung.REPLACE: self.replace_seconds,
        }[rung]


#: What the REINSTALL rung runs with ``reinstall_via: agent``: this script of the node's own image
#: (each site's image carries the reinstall its OS and driver need), run by the node agent in the
#: host's namespaces, as deploy/driver-reinstall (the chart's ``nodeAgent.driverReinstall``) sets
#: its ``GPUFLEET_DRIVER_REINSTALL_CMD``. The control plane decides whether it runs, never what:
#: no command travels to a node (deploy/bootstrap/README.md, "Driver reinstall").
DRIVER_REINSTALL_SCRIPT = "/usr/local/sbin/gpufleet-reinstall-driver"


class RepairSettings(Strict):
    """``repair:`` in sites.yaml. Every number here is configurable (tests make them small)."""

    thresholds: RepairThresholds = Field(default_factory=RepairThresholds)
    timeouts: RepairTimeouts = Field(default_factory=RepairTimeouts)
    #: The highest rung the ladder may climb to; past it the GPU stays contained for a person.
    max_rung: Rung = Rung.REPLACE
    #: ``provider`` (reimage through the provider API) or ``agent`` (driver reinstall on the node:
    #: the node image's ``DRIVER_REINSTALL_SCRIPT``, which the node agent runs only where its
    #: DaemonSet allows it, deploy/driver-reinstall; ``gpufleet config check`` warns).
    reinstall_via: str = Field("provider", pattern="^(provider|agent)$")
    #: While a finding waits (node still joining, site over its cap), look again this often; one
    #: held for a provider incident: after a pause doubling from this to 10 minutes, or when it closes.
    recheck_seconds: SettingSeconds = Field(30, gt=0)
    #: A watch result observed longer ago than this is ignored (set by ``control_plane:``).
    max_report_age_seconds: float = Field(120, gt=0, le=3600)

    def slot_seconds(self, rung: Rung) -> float:
        """How long a repair at ``rung`` is expected to hold its node's action slot: its rung's
        timeouts as the repair sets them (a reboot or reimage: the provider's call, then the wait
        for the new boot id). Retries can run past it; a holder still there after it is worth a look."""
        timeouts = self.timeouts
        return (timeouts.provider_call_seconds if self.through_provider(rung) else 0) + timeouts.rung_seconds(rung)

    def through_provider(self, rung: Rung) -> bool:
        """Whether ``rung`` restarts the machine through the provider's API (a reboot, a reimage),
        then waits for its new boot id."""
        return rung == Rung.REBOOT or (rung == Rung.REINSTALL and self.reinstall_via == "provider")
