"""Domain types shared by workflows, activities, providers and the CLI."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from enum import StrEnum
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo
from pydantic_core import PydanticCustomError, PydanticKnownError

# Bounds for what workflows take from outside (inputs, signals, updates): every number
# has a range, every float is finite, every string a length.
DAY = 86400.0
#: The providers gpufleet has an adapter for (``providers/``), as ``sites.yaml`` names them.
PROVIDERS = ("aws", "lambda", "nebius", "hetzner", "own-dc")
#: The account options a provider's adapter joins no machine without (option: what it is for):
#: ``sites.yaml`` must set them on an account whose sites can join (``fleet.config_checks``), so
#: a missing one is refused at load, not by every join after the worker started.
JOIN_OPTIONS: dict[str, dict[str, str]] = {
    "lambda": {"ssh_key_names": "the name of an SSH key registered in the Lambda account: Lambda launches "
                                "no instance without one"},
    "nebius": {"parent_id": "the project the instances are created in",
               "subnet_id": "the subnet each instance's network interface is attached to"},
    "own-dc": {"seed_dir": "the folder the worker writes each joining machine's bootstrap (NoCloud seed) to, "
                           "which the seed server (python -m providers.own_dc_seed) hands out"},
}
#: The most machines one capacity request asks for (``CapacityRequest.count``): also the most a site's
#: ``min_nodes`` may be in ``sites.yaml``, since its Site entity fills it with one request.
MAX_REQUEST_COUNT = 256
#: The most nodes a site's ``max_nodes`` may be in ``sites.yaml``: every site's nodes join the fleet's
#: one Kubernetes cluster, which is built for at most 5,000 nodes (Kubernetes' "Considerations for
#: large clusters"), so a site cannot hold more. Far below 2**53: the Site entity carries the number
#: over continue-as-new, and the workers' input guard refuses a larger one at every workflow start.
MAX_SITE_NODES = 5000
#: Sites, accounts, nodes, machine ids, offer keys: Kubernetes' name limit is plenty.
Name = Annotated[str, StringConstraints(min_length=1, max_length=253)]
MaybeName = Annotated[str, StringConstraints(max_length=253)]
MAX_TEXT = 2000
#: Free text carried along (a reason, a provider's error message): a long one is cut, never
#: refused, because senders build these from error messages inside workflow code.
Text = Annotated[str, AfterValidator(lambda text: text[:MAX_TEXT])]
#: Epoch seconds between 1970 and 2100.
EpochSeconds = Annotated[float, Field(ge=0, le=4_102_444_800, allow_inf_nan=False)]
#: The longest duration a setting in ``sites.yaml`` may name (a window, a timeout, a wait): longer
#: is a typo (``SettingSeconds``).
MAX_SETTING_SECONDS = 30 * 86400
#: The dearest GPU-hour a site may be configured at, or a provider may answer, in any currency:
#: beyond it a price is a typo or garbage, and costs summed from it could overflow to infinity.
MAX_PRICE_PER_GPU_HOUR = 100_000.0
#: Validation context key: ``{SITES_YAML: True}`` holds the settings models to the caps a person's
#: ``sites.yaml`` gets (``fleet.config.parse_config``: loading, ``gpufleet config check``). Workflows
#: decode the same models from their inputs, carries and recorded activity results without it: a
#: value an older release took (a 60-day window) must still decode there, or every open entity that
#: recorded it fails its input on replay once the operator lowers the value to start the new workers.
SITES_YAML = "sites_yaml"
#: A century, longer than epoch time has run (so no age reaches it): a duration setting decodes as
#: at most this, so workflow code may add it to a time (``timedelta`` overflows past 1e14 seconds,
#: ``datetime`` past the year 9999). Clamped, not refused: what an older run recorded still decodes.
LONGEST_SECONDS = 100 * 365 * DAY


def _capped_in_sites_yaml(cap: float, longest: float) -> Any:
    def check(value: float, info: ValidationInfo) -> float:
        if value > cap and (info.context or {}).get(SITES_YAML):
            raise PydanticKnownError("less_than_equal", {"le": cap})  # what ``le=cap`` raises
        return min(value, longest)

    return AfterValidator(check)


def setting_seconds(cap: float = MAX_SETTING_SECONDS, longest: float = LONGEST_SECONDS) -> Any:
    """A duration in ``sites.yaml`` that workflows also take (a window, a timeout, a wait): at most
    ``cap`` in ``sites.yaml``; anywhere else at most ``longest``, longer taken as that."""
    return Annotated[float, _capped_in_sites_yaml(cap, longest), Field(json_schema_extra={"maximum": cap})]


SettingSeconds = setting_seconds()
#: A site's configured price: at most ``MAX_PRICE_PER_GPU_HOUR`` in ``sites.yaml``, as given elsewhere.
SettingPrice = Annotated[float, _capped_in_sites_yaml(MAX_PRICE_PER_GPU_HOUR, math.inf),
                         Field(json_schema_extra={"maximum": MAX_PRICE_PER_GPU_HOUR})]


def _utc_if_naive(value: datetime) -> datetime:
    # Workflow code compares times with ``workflow.now()``, which has a zone: a time without one
    # (typed by hand, ``temporal workflow signal --input '{..."2026-12-06T10:00:00"}'``) raised
    # TypeError there, in the workflow task, on every replay. Taken as UTC, as the fleet's times
    # are; one with a zone is kept as given, so what recorded runs decoded is unchanged.
    return value.replace(tzinfo=timezone.utc) if value.utcoffset() is None else value


#: A time in a workflow's input, signal, update, carry or activity result: always aware.
UtcDatetime = Annotated[datetime, AfterValidator(_utc_if_naive)]


class Strict(BaseModel):
    """Unknown keys are an error, so a typo never silently becomes a default; floats are finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def fields_of(model: type[BaseModel]) -> Any:
    """The type of a JSON object of some of ``model``'s fields (each of which has a default) that
    workflow code merges into a ``model`` it passes on, a child's input. Checked as a ``model``
    when it arrives, so a bad value is refused at the start, naming its field
    (``capacity_request.constraints``), instead of failing the workflow task that merges it; kept
    as given, so what is merged, carried over continue-as-new and recorded is as before."""
    def check(value: dict[str, Any]) -> dict[str, Any]:
        model.model_validate(value)  # its errors name their fields under this one
        carried = carried_by_caller(model, value)
        if carried is not None:  # the child would refuse it at its start, after this workflow did its part
            raise PydanticCustomError("carried_by_caller", f"{carried}: {CARRIED_BY_CALLER}")
        return value

    return Annotated[dict[str, Any], AfterValidator(check)]


class _CarriedMark:
    def __repr__(self) -> str:
        return "CARRIED"


_CARRIED = _CarriedMark()
_T = TypeVar("_T")
#: A workflow input's field that the workflow itself sets, in the input of the run it continues
#: as new with (``carry: Carried[CapacityCarry | None] = None``): never a caller's. The input guard
#: (workers/input_guard.py) refuses one a run that is no continuation got, before the workflow reads it.
Carried = Annotated[_T, _CARRIED]


CARRIED_BY_CALLER = "set by the workflow itself when it continues as new; never by a caller"


def carried_by_caller(model: type[BaseModel], value: dict[str, Any]) -> str | None:
    """The first of ``model``'s ``Carried`` fields that ``value`` (a caller's, not a continued
    run's) sets to other than its default; else None."""
    if not model.__pydantic_complete__:
        model.model_rebuild()  # a field naming a model defined below it is read once that is resolved
    return next((name for name, field in model.model_fields.items()
                 if _CARRIED in field.metadata and name in value
                 and value[name] != field.get_default(call_default_factory=True)), None)


def listing(names: set[str] | list[str], limit: int = 12) -> str:
    """Names for a message, sorted, at most ``limit`` of them (then how many in all); ``none``."""
    ordered = sorted(set(names))
    shown = ", ".join(ordered[:limit])
    return shown + (f", … ({len(ordered)} in all)" if len(ordered) > limit else "") if ordered else "none"


def append_bounded(items: list[Any], item: Any, newest: int, first: int = 0) -> int:
    """Append ``item``, keeping the ``first`` items and the ``newest`` after them; how many between
    were let go. For a list a workflow carries or returns, which must stay bounded whatever comes
    (a payload is at most 2 MiB, and attempts, events and steps can come for days)."""
    items.append(item)
    over = len(items) - first - newest
    if over <= 0:
        return 0
    del items[first:first + over]
    return over


class CapacityType(StrEnum):
    ON_DEMAND = "on-demand"
    SPOT = "spot"
    OWNED = "owned"


class AccountState(StrEnum):
    HEALTHY = "healthy"
    QUOTA_BLOCKED = "quota-blocked"
    CREDENTIALS_REVOKED = "credentials-revoked"


class NodeState(StrEnum):
    PROVISIONING = "provisioning"
    REGISTERED = "registered"
    PROVING = "proving"
    READY = "ready"
    CONTAINING = "containing"
    REPAIRING = "repairing"
    RETIRING = "retiring"
    GONE = "gone"
    FAILED = "failed"


class CredentialsRef(Strict):
    """Where an account's secret lives. Exactly one of the three is set.

    Only this reference travels in workflow data; the value is read inside an
    activity at call time.
    """

    #: An environment variable of the worker's process. The shipped control-plane pod sets none
    #: for credentials: there, use ``secret``.
    env: str | None = None
    #: A file the worker can read. The shipped control-plane pod mounts none for credentials:
    #: there, use ``secret``.
    file: str | None = None
    #: Kubernetes Secret as ``namespace/name#key``. The control plane may get the Secrets in
    #: ``gpufleet`` its config names, each by name (``gpufleet cluster credentials-role``).
    secret: str | None = None

    def secret_location(self) -> tuple[str, str, str]:
        """(namespace, name, key) of the ``secret`` reference; a part not given is ""."""
        namespace_name, _, key = (self.secret or "").partition("#")
        namespace, _, name = namespace_name.partition("/")
        return namespace, name, key

    def describe(self) -> str:
        if self.env:
            return f"env:{self.env}"
        if self.file:
            return f"file:{self.file}"
        return f"secret:{self.secret}"


class Offer(BaseModel):
    """Something a site can sell now."""

    # Workflow data: an infinite price would be sent as null, which no workflow can decode.
    model_config = ConfigDict(allow_inf_nan=False)

    site: str
    provider: str
    instance_type: str
    gpu: str
    gpus: int
    gpu_memory_gb: int = 0
    price_per_gpu_hour: float
    capacity_type: CapacityType
    #: 0 (never reclaimed) .. 1 (reclaimed almost surely within the hour).
    interruption_risk: float = 0.0
    available: bool = True
    region: str = ""


#: The tags (labels, where the provider calls them that) every machine the fleet buys carries:
#: its site (an adapter lists and owns only its site's machines by it) and the join that bought it.
MACHINE_TAG_SITE = "gpufleet.io/site"
MACHINE_TAG_JOIN = "gpufleet.io/join"


class MachineSpec(BaseModel):
    """What to ask a provider for. ``name`` becomes the Kubernetes node name."""

    name: str
    site: str
    region: str
    instance_type: str
    gpu: str
    gpus: int
    capacity_type: CapacityType = CapacityType.ON_DEMAND
    image: str = ""
    tags: dict[str, str] = Field(default_factory=dict)


class Machine(BaseModel):
    """A provider's view of one machine."""

    id: str
    name: str
    site: str
    provider: str
    instance_type: str = ""
    #: pending, running, rebooting, stopped, terminated (provider words mapped).
    state: str = "pending"
    capacity_type: CapacityType = CapacityType.ON_DEMAND
    created_at: UtcDatetime | None = None
    #: Whether it carries the fleet's ownership marker (each adapter defines its own: a tag,
    #: a label, a name prefix, an allocation record). The sweep never touches one without.
    owned: bool = False
    #: IP addresses the provider reports for it (private and public); empty where it reports none.
    addresses: list[str] = Field(default_factory=list)


class XidEvent(BaseModel):
    xid: int
    at: UtcDatetime
    message: str = ""


class GpuHealth(BaseModel):
    """One probe of one GPU, as NVML reports it."""

    index: int
    uuid: str
    name: str = ""
    memory_gb: float = 0
    temperature_c: int = 0
    slowdown_temperature_c: int = 0
    ecc_uncorrected: int = 0
    remapped_rows_pending: bool = False
    remapped_rows_failure: bool = False
    #: Older (pre-Ampere) GPUs: ECC page retirement waiting for a reset.
    retired_pages_pending: bool = False
    nvlink_down: int = 0
    xid_events: list[XidEvent] = Field(default_factory=list)
    #: NVML's GPU recovery action where the driver exposes it (0 = none).
    recovery_action: int = 0
    lost: bool = False

    def problems(self) -> list[str]:
        """Why this GPU would fail a smoke test; empty when clean."""
        found = []
        if self.lost:
            found.append("GPU is lost")
        if self.ecc_uncorrected:
            found.append(f"{self.ecc_uncorrected} uncorrected ECC errors")
        if self.remapped_rows_failure:
            found.append("row remapping failed")
        if self.remapped_rows_pending:
            found.append("row remap pending (needs reset)")
        if self.retired_pages_pending:
            found.append("page retirement pending (needs reset)")
        if self.nvlink_down:
            found.append(f"{self.nvlink_down} NVLink links down")
        if self.slowdown_temperature_c and self.temperature_c >= self.slowdown_temperature_c:
            found.append(f"temperature {self.temperature_c}C at slowdown threshold")
        if self.recovery_action:
            found.append(f"driver asks for recovery action {self.recovery_action}")
        found.extend(f"XID {e.xid}" for e in self.xid_events)
        return found


class Gpu(BaseModel):
    node: str
    index: int
    uuid: str
    health: GpuHealth | None = None


class Node(BaseModel):
    """One machine in the cluster, as the cluster port reports it."""

    name: str
    machine_id: str = ""
    site: str = ""
    provider: str = ""
    account: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    taints: list[str] = Field(default_factory=list)
    ready: bool = False
    #: When ``ready`` last changed (the Ready condition's ``lastTransitionTime``): for a NotReady
    #: node, when it stopped being Ready. None where the cluster did not say.
    ready_changed_at: UtcDatetime | None = None
    unschedulable: bool = False
    boot_id: str = ""
    gpus_allocatable: int = 0
    registered_at: UtcDatetime | None = None
    #: What the kubelet reported: ``spec.providerID`` and ``status.addresses`` (IPs).
    provider_id: str = ""
    addresses: list[str] = Field(default_factory=list)

    def believed(self, gpus_per_machine: int | None) -> "Node":
        """This node with no more GPUs than a machine at its site has (``None``: no site known).
        ``gpus_allocatable`` is what the node's own kubelet wrote (NodeRestriction lets a node
        write its status): a node claiming a thousand GPUs must not make the control plane move
        replicas to it, or stop buying for pods it says it can take. Fewer is believed: a GPU
        that fell off the bus is gone."""
        if gpus_per_machine is None or self.gpus_allocatable <= gpus_per_machine:
            return self
        return self.model_copy(update={"gpus_allocatable": gpus_per_machine})
