"""Fleet configuration (``sites.yaml``): accounts and sites, the schema and its loading.

``load_config`` turns every problem into one ``ConfigError`` whose lines each
name the site (or account) and the field, so ``gpufleet config check`` can
print them and exit 2: the schema's field errors and the cross-checks between
fields and entries (``fleet.config_checks``).
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from datetime import date
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from fleet.config_checks import cross_check
from fleet.incident import ControlPlaneSettings, IncidentSettings
from fleet.models import (
    MAX_REQUEST_COUNT, MAX_SITE_NODES, PROVIDERS, SITES_YAML, CapacityType, CredentialsRef, MachineSpec, Offer, SettingPrice, SettingSeconds, Strict,
)
from fleet.naming import LABEL_VALUE_PATTERN, MAX_SITE_NAME, SITE_NAME_PATTERN, label_value_problem, site_name_problem
from fleet.repair_policy import RepairSettings
from fleet.routing import MAX_ROUTED_SITES
from fleet.settings import Settings
from fleet.yaml_input import NotYaml, read_yaml

#: The built-in simulated fleet that ``gpufleet dev`` runs when no file is given.
DEFAULT_CONFIG = "default_sites.yaml"


class SimSiteSettings(Strict):
    """How the simulated provider behaves for one site (sim mode only)."""

    capacity: int = Field(8, ge=0, description="machines the site can still sell")
    quota: int = Field(16, ge=0, description="machines the account may run at this site")
    api_latency_ms: int = Field(0, ge=0)
    boot_seconds: SettingSeconds = Field(1.0, ge=0)
    interruption_risk: float = Field(0.0, ge=0, le=1)


class Account(Strict):
    name: str
    provider: Literal["aws", "lambda", "nebius", "hetzner", "own-dc"]
    credentials: CredentialsRef | None = None
    #: Provider-specific knobs (API endpoint, project id, BMC inventory...).
    options: dict[str, Any] = Field(default_factory=dict)

    def option(self, key: str, default: Any) -> Any:
        """An option's value; ``default`` when it is missing or null."""
        value = self.options.get(key)
        return default if value is None else value


class ObjectStore(Strict):
    """An S3-compatible bucket (AWS S3, Nebius, Hetzner object storage, MinIO...).

    ``credentials`` is a reference whose value is either JSON
    ``{"access_key_id": ..., "secret_access_key": ..., "session_token": ...}`` or
    ``ACCESS_KEY_ID:SECRET_ACCESS_KEY``; without it boto3's default chain is used
    (instance role, ``AWS_*`` env). Read inside activities only: they are the control plane's,
    which writes and deletes weights, and never reach a node.

    ``pull_credentials`` is what a site's GPU nodes are given to pull weights from it: a
    ``secret:`` reference put into each serving pod (its kubelet, so a hostile node, may read
    that whole Secret). Make it read-only (``s3:GetObject`` on ``prefix``); without it a node
    pulls with its own role (an instance profile) or anonymously.
    """

    endpoint_url: str | None = None
    bucket: str = Field(min_length=1)
    region: str = "us-east-1"
    #: Key prefix inside the bucket ("" or ending in "/").
    prefix: str = ""
    credentials: CredentialsRef | None = None
    #: The key a site's GPU nodes pull weights with (a ``secret: gpufleet/<name>#<key>`` in a Secret
    #: of its own, read-only on this store): never ``credentials``, which the control plane writes with.
    pull_credentials: CredentialsRef | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    #: ``store``: the store checks each upload's ChecksumSHA256 (AWS S3 does);
    #: ``read-back``: stream the copy back and hash it (stores that ignore checksums).
    checksum_verification: Literal["store", "read-back"] = "store"

    @field_validator("pull_credentials")
    @classmethod
    def _pull_credentials_in_a_secret(cls, ref: CredentialsRef | None) -> CredentialsRef | None:
        # An env or file reference names something of the control plane's process, never the node's.
        if ref is not None and not (ref.secret and all(ref.secret_location())):
            raise ValueError("a node is given its key only as `secret: gpufleet/<name>#<key>` "
                             "(a Secret of its own, read-only on the store)")
        return ref


#: In the schema for editors only: loading checks these with messages that say why.
_LABEL_VALUE_SCHEMA = {"pattern": LABEL_VALUE_PATTERN, "minLength": 1, "maxLength": 63}


class Site(Strict):
    #: Names the site's nodes (``<name>-<8 hex digits>``, also their hostname label) and is a
    #: label on each: lowercase letters, digits and '-', at most 54 characters.
    name: str = Field(json_schema_extra={"pattern": SITE_NAME_PATTERN, "maxLength": MAX_SITE_NAME})
    provider: Literal["aws", "lambda", "nebius", "hetzner", "own-dc"]
    account: str
    #: The provider's region; also the nodes' ``topology.kubernetes.io/region`` label, so a
    #: Kubernetes label value (letters, digits, '-', '_', '.'; at most 63 characters).
    region: str = Field(json_schema_extra=_LABEL_VALUE_SCHEMA)
    #: Compliance and placement geography (``eu``, ``us-east``); also the nodes'
    #: ``node-restriction.kubernetes.io/gpufleet-geography`` label, so a Kubernetes label value.
    geography: str | None = Field(None, json_schema_extra=_LABEL_VALUE_SCHEMA)
    #: The GPU model (``H100``); also the nodes' ``nvidia.com/gpu.product`` label, so a Kubernetes
    #: label value (``H100-SXM``, not ``H100 SXM``).
    gpu: str = Field(json_schema_extra=_LABEL_VALUE_SCHEMA)
    gpus_per_machine: int = Field(ge=1)
    gpu_memory_gb: int = Field(0, ge=0)
    instance_type: str
    price_per_gpu_hour: SettingPrice = Field(ge=0)
    capacity_type: CapacityType = CapacityType.ON_DEMAND
    #: The Site entity keeps at least this many nodes, buying the missing ones in one capacity
    #: request, so at most 256 (a request's most).
    min_nodes: int = Field(0, ge=0, json_schema_extra={"maximum": MAX_REQUEST_COUNT})
    #: The Site entity keeps at most this many nodes, retiring the surplus; so at most 5,000, since
    #: every site's nodes join the fleet's one Kubernetes cluster, which is built for that many.
    max_nodes: int = Field(ge=0, json_schema_extra={"maximum": MAX_SITE_NODES})
    image: str = ""
    sim: SimSiteSettings = Field(default_factory=SimSiteSettings)
    #: Where this site's model weights are replicated to (rule 10); optional.
    object_store: ObjectStore | None = None
    #: Compliance geography: this site's replicas may only move to sites of the same
    #: ``geography`` (an evacuation never takes them out of it). Needs ``geography``.
    compliance: bool = False
    #: Provider-incident rule for this site; replaces the top-level ``incident:`` block.
    incident: IncidentSettings | None = None

    # The join writes the name, region, GPU and geography as node labels and names nodes after
    # the site: a value the API server refuses would fail every join after its machine was bought.
    @field_validator("name", "region", "gpu", "geography")
    @classmethod
    def _kubernetes_name(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or (info.field_name == "geography" and value == ""):
            return value  # no geography: no label (``fleet.demand.site_labels``)
        problem = (site_name_problem if info.field_name == "name" else label_value_problem)(value)
        if problem:
            raise ValueError(problem)
        return value

    def machine_spec(self, name: str, tags: dict[str, str]) -> MachineSpec:
        """What a join asks the site's provider for: one machine of its offer, named ``name``."""
        return MachineSpec(
            name=name, site=self.name, region=self.region, instance_type=self.instance_type, gpu=self.gpu,
            gpus=self.gpus_per_machine, capacity_type=self.capacity_type, image=self.image, tags=tags,
        )

    def offer(self, provider: str, **reported: Any) -> Offer:
        """What the site sells, as configured here; ``reported`` holds the fields the provider's own
        answer sets (whether it sells now, what a machine really has, a measured price or risk)."""
        configured = dict(site=self.name, provider=provider, instance_type=self.instance_type, gpu=self.gpu,
                          gpus=self.gpus_per_machine, gpu_memory_gb=self.gpu_memory_gb,
                          price_per_gpu_hour=self.price_per_gpu_hour, capacity_type=self.capacity_type,
                          region=self.region)
        return Offer(**(configured | reported))


class SweepSettings(Strict):
    """``sweep:`` in sites.yaml: FleetSweep, the bound on any leaked machine (README, "Leaks")."""

    #: A fleet-marked machine no join and no node accounts for is deleted once it is this old:
    #: long enough for a join to provision and register (its node then accounts for it).
    grace_seconds: float = Field(1800, ge=60, le=7 * 86400, allow_inf_nan=False)


class ServingPolicy(Strict):
    """``models.<name>:`` in sites.yaml: how one model's capacity is spread (README,
    "Capacity follows demand"). The demand loop buys by it; the front door routes by it.

    - ``active-active``: every site in ``sites`` serves; capacity is bought at the cheapest.
    - ``active-passive``: ``sites`` serve; ``standby_sites`` hold nothing (scale to zero)
      until no primary can take the model's pods (no capacity, at max, an incident), then
      serve, and go back to zero when idle again (consolidation).
    - ``burst``: ``sites`` serve; ``standby_sites`` take only the overflow the primaries
      have no capacity for, while the primaries keep serving.
    """

    mode: Literal["active-active", "active-passive", "burst"] = "active-active"
    #: Primary sites (every serving site in ``active-active``), in order of preference. With
    #: ``standby_sites``, at most 16: the model's route reaches no more (Gateway API's limit).
    sites: list[str] = Field(default_factory=list, json_schema_extra={"maxItems": MAX_ROUTED_SITES})
    #: Passive (``active-passive``) or burst (``burst``) sites; none in ``active-active``.
    standby_sites: list[str] = Field(default_factory=list, json_schema_extra={"maxItems": MAX_ROUTED_SITES})
    #: At most this share of the model's GPUs on spot capacity (0: never spot) ...
    spot_share: float = Field(1.0, ge=0, le=1, allow_inf_nan=False)
    #: ... and never fewer than this many on-demand or owned GPUs (a reclaim cannot take them).
    on_demand_floor_gpus: int = Field(0, ge=0, le=100_000)
    #: Spare GPUs kept ready, as a share of the GPUs the model's new pods take, so that a
    #: scale-out lands on slack instead of waiting for a machine.
    warm_headroom: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)

    @model_validator(mode="after")
    def _routable(self) -> "ServingPolicy":
        named = len(self.sites) + len(self.standby_sites)
        if named > MAX_ROUTED_SITES:
            raise ValueError(f"sites and standby_sites: {named} sites; a model is routed to at most "
                             f"{MAX_ROUTED_SITES} (its HTTPRoute's backendRefs, Gateway API's limit)")
        return self


class DemandSettings(Strict):
    """``demand:`` in sites.yaml: the demand loop's batching and consolidation."""

    #: A batch closes after this long with no new Pending pod ...
    batch_idle_seconds: float = Field(1.0, ge=0, le=600, allow_inf_nan=False)
    #: ... or this long after its first pod, whichever comes first.
    batch_max_seconds: float = Field(10.0, ge=0, le=3600, allow_inf_nan=False)
    #: A GPU node empty this long goes back (consolidation).
    idle_ttl_seconds: float = Field(600, ge=0, le=7 * 86400, allow_inf_nan=False)
    #: At most this share of a site's nodes retiring at once (at least one).
    max_site_fraction: float = Field(0.25, gt=0, le=1, allow_inf_nan=False)


#: Names that only resolve inside a cluster (or through a pod's DNS search path): a node
#: outside the control plane's network cannot dial them (README "Network model").
_CLUSTER_INTERNAL = (".svc", ".cluster.local", ".local", ".internal")


class NodeGateway(Strict):
    """``node_gateway:`` in sites.yaml: where node agents dial the control plane (the node
    gateway, README "Network model"). The node-agent DaemonSet reads it from the
    ``gpufleet-node-gateway`` ConfigMap that ``gpufleet cluster node-config`` renders."""

    #: ``host:port`` of the gateway's public TLS endpoint, e.g. ``gateway.fleet.example.com:443``.
    endpoint: str = Field(min_length=3, max_length=260)
    #: The CA certificate (PEM) that signed the gateway's serving certificate; not a secret,
    #: but kept where the operator keeps the fleet's other material.
    ca: CredentialsRef

    @field_validator("endpoint")
    @classmethod
    def _public_host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{value!r} is not host:port")
        if "://" in value or "/" in host:
            raise ValueError(f"{value!r}: give host:port, without a scheme or path")
        try:
            ipaddress.ip_address(host)
            return value
        except ValueError:
            pass
        name = host.lower().rstrip(".")
        if "." not in name or name.endswith(_CLUSTER_INTERNAL) or ".svc." in name:
            raise ValueError(f"{value!r} is a cluster-internal name; nodes dial the gateway's public "
                             "TLS endpoint (a fully qualified DNS name or an IP)")
        return value


class FleetConfig(Strict):
    #: ``sim`` drives every site through the simulated provider and cluster.
    mode: Literal["sim", "real"] = "sim"
    #: POSTed (JSON) when a person must act, e.g. an account is quota-blocked or its credentials revoked.
    #: A credentials reference (``{env|file|secret}``) to the URL: a webhook URL usually carries
    #: its secret in the path, so only the reference travels in config, history and logs.
    notify_webhook: CredentialsRef | None = None
    accounts: list[Account] = Field(default_factory=list)
    sites: list[Site] = Field(default_factory=list)
    #: GPU repair ladder thresholds and timeouts.
    repair: RepairSettings = Field(default_factory=RepairSettings)
    #: Provider-incident rule (fleet.incident) for every site without its own ``incident:``.
    incident: IncidentSettings = Field(default_factory=IncidentSettings)
    #: Named S3-compatible stores a rollout manifest may copy weights from (``weights.source.store``).
    #: Endpoints and credentials live here, with the operator, so whoever writes a manifest
    #: cannot point the control plane's credentials at a server of their choosing.
    object_stores: dict[str, ObjectStore] = Field(default_factory=dict)
    sweep: SweepSettings = Field(default_factory=SweepSettings)
    #: Where node agents dial in (mode ``real``); see ``NodeGateway``.
    node_gateway: NodeGateway | None = None
    #: Per-model serving policy: mode, spot share, warm headroom (``ServingPolicy``).
    models: dict[str, ServingPolicy] = Field(default_factory=dict)
    demand: DemandSettings = Field(default_factory=DemandSettings)
    #: After a control-plane outage: return grace, how a Site entity tells, stale health reports.
    control_plane: ControlPlaneSettings = Field(default_factory=ControlPlaneSettings)

    @model_validator(mode="after")
    def _one_control_plane_block(self) -> "FleetConfig":
        # The Site and Node entities read these through their incident and repair settings;
        # written there too, two values would disagree, so only ``control_plane:`` sets them.
        blocks = [self.incident, *(s.incident for s in self.sites if s.incident is not None)]
        if any("control_plane" in b.model_fields_set for b in blocks):
            raise ValueError("incident.control_plane: set `control_plane:` at the top level instead")
        self.repair.max_report_age_seconds = self.control_plane.max_report_age_seconds
        return self

    def incident_for(self, site: Site) -> IncidentSettings:
        return (site.incident or self.incident).model_copy(update={"control_plane": self.control_plane})

    def site(self, name: str) -> Site:
        for site in self.sites:
            if site.name == name:
                return site
        raise KeyError(name)

    def account(self, name: str) -> Account:
        for account in self.accounts:
            if account.name == name:
                return account
        raise KeyError(name)

    def account_for(self, site: Site) -> Account:
        return self.account(site.account)


class ConfigError(ValueError):
    """One or more problems in a fleet config; each line names where."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


def _where(raw: dict[str, Any], loc: tuple[Any, ...]) -> str:
    """``sites[1] (hetzner-fsn1).price_per_gpu_hour`` from a pydantic error location."""
    parts: list[str] = []
    node: Any = raw
    for step in loc:
        if isinstance(step, int) and isinstance(node, list) and parts:
            name = node[step].get("name") if step < len(node) and isinstance(node[step], dict) else None
            parts[-1] += f"[{step}]" + (f" ({name})" if name else "")
            node = node[step] if step < len(node) else None
        else:
            if step in ("function-after",) or str(step).startswith(("function-", "literal[")):
                continue
            parts.append(str(step))
            node = node.get(step) if isinstance(node, dict) else None
    return ".".join(parts)


def parse_config(raw: Any, source: str = "<config>") -> FleetConfig:
    if not isinstance(raw, dict):
        raise ConfigError(source, ["the file must be a mapping with 'sites' (and 'accounts')"])
    try:
        config = FleetConfig.model_validate(raw, context={SITES_YAML: True})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc, kind = err["loc"], err["type"]
            if kind == "invalid_key" or (loc and loc[-1] == "[key]"):
                # A key YAML read as no string (``on:``, ``yes:``, ``1:``, a date): a block's
                # (``invalid_key``, the key last) or a name's (``models``: the key, then "[key]").
                where = _where(raw, loc[:-1] if kind == "invalid_key" else loc[:-2]) or "(top level)"
                given = err.get("input")
                what = {bool: "a boolean", int: "a number", float: "a number", type(None): "null"}.get(
                    type(given), "a date" if isinstance(given, date) else type(given).__name__)
                message = (f"the key {given} is {what} to YAML, not a string (so is an unquoted yes, no, on, off, "
                           f"null, number or date): quote it")
                problems.append(f"{where}: {message}")
                continue
            where = _where(raw, loc) or "(top level)"
            message = err["msg"].removeprefix("Value error, ")
            if kind == "extra_forbidden":
                message = "unknown key"
            elif kind == "literal_error" and loc[-1] == "provider":
                message = f"unknown provider {err.get('input')!r}; expected one of {', '.join(PROVIDERS)}"
            elif kind == "missing" and loc[-1] == "account":
                message = "missing account reference"
            problems.append(f"{where}: {message}")
        # The cross-field checks read the raw mapping, so one `config check` names every
        # problem: an operator should not fix the field errors only to meet a second list.
        raise ConfigError(source, problems + [p for p in cross_check(raw) if p not in problems]) from None
    problems = cross_check(raw)
    if problems:
        raise ConfigError(source, problems)
    return config


#: The image a site boots when neither it nor its account names one: (account option, default)
#: as the adapters use them (providers/hetzner.py ``DEFAULT_IMAGE``, providers/nebius.py
#: ``DEFAULT_IMAGE_FAMILY``; tests/test_config.py keeps them equal).
DEFAULT_IMAGES: dict[str, tuple[str, str]] = {
    "hetzner": ("image", "ubuntu-24.04"),
    "nebius": ("image_family", "ubuntu22.04-cuda12"),
}
#: Images gpufleet knows have no kubeadm (a provider's own stock images), with what else they
#: lack. Lambda boots only its own images, and none of them has kubeadm or the kubelet.
_STOCK_IMAGES: dict[str, list[tuple[re.Pattern[str], tuple[str, ...]]]] = {
    "hetzner": [(re.compile(r"^(ubuntu|debian|fedora|centos-stream|centos|rocky|alma|opensuse)-[0-9][0-9.]*$"),
                 ("kubeadm", "the NVIDIA driver"))],
    "nebius": [(re.compile(r"^[a-z]+[0-9][0-9.]*-cuda[0-9.]*$"), ("kubeadm",)),
               (re.compile(r"^[a-z]+[0-9][0-9.]*-driverless$"), ("kubeadm", "the NVIDIA driver"))],
    "lambda": [(re.compile(r".*", re.DOTALL), ("kubeadm",))],
}


@dataclass(frozen=True)
class StockImage:
    """A site whose machines boot a stock image without kubeadm (``gpufleet config check``)."""

    where: str
    site: str
    provider: str
    image: str
    lacks: tuple[str, ...]


def site_image(site: Site, account: Account | None) -> str:
    """The image the site's machines boot (as its adapter picks it); "" for the provider's own
    default where gpufleet does not name one (Lambda: the latest Lambda Stack)."""
    if site.image:
        return site.image
    option, default = DEFAULT_IMAGES.get(site.provider, ("", ""))
    return str((account.option(option, default) if account is not None and option else default) or "")


def stock_images(config: FleetConfig) -> list[StockImage]:
    """Sites whose image is one gpufleet knows lacks kubeadm: their machines must install it at
    first boot (the user data's install step), or stop before ``kubeadm join`` when they cannot."""
    found: list[StockImage] = []
    for i, site in enumerate(config.sites):
        try:
            account = config.account_for(site)
        except KeyError:
            account = None
        image = site_image(site, account)
        for pattern, lacks in _STOCK_IMAGES.get(site.provider, []):
            if pattern.match(image.removeprefix("family:")):
                found.append(StockImage(f"sites[{i}] ({site.name}).image", site.name, site.provider,
                                        image or f"{site.provider}'s default", lacks))
                break
    return found


def load_config(path: str | os.PathLike[str] | None = None) -> FleetConfig:
    """Load ``path``, or ``$GPUFLEET_CONFIG``, or the built-in simulated fleet."""
    path = path or Settings.get("config")
    if path:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(source, [f"cannot read: {exc.strerror}"]) from None
    else:
        source = f"(built-in) {DEFAULT_CONFIG}"
        text = resources.files("fleet").joinpath(DEFAULT_CONFIG).read_text()
    try:
        document = read_yaml(text)
    except NotYaml as exc:
        raise ConfigError(source, [str(exc)]) from None
    # A key YAML reads as no string is named by parse_config, with the schema's other problems.
    twice = document.twice
    try:
        config = parse_config(document.data, source)
    except ConfigError as error:
        raise ConfigError(source, twice + error.problems) from None
    if twice:
        raise ConfigError(source, twice)
    return config
