"""Fleet configuration (``sites.yaml``): accounts and sites.

``load_config`` turns every problem into one ``ConfigError`` whose lines each
name the site (or account) and the field, so ``gpufleet config check`` can
print them and exit 2.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleet.incident import IncidentSettings
from fleet.models import CapacityType, CredentialsRef
from fleet.repair_policy import RepairSettings

PROVIDERS = ("aws", "lambda", "nebius", "hetzner", "own-dc")

#: The built-in simulated fleet that ``gpufleet dev`` runs when no file is given.
DEFAULT_CONFIG = "default_sites.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SimSiteSettings(_Strict):
    """How the simulated provider behaves for one site (sim mode only)."""

    capacity: int = Field(8, ge=0, description="machines the site can still sell")
    quota: int = Field(16, ge=0, description="machines the account may run at this site")
    api_latency_ms: int = Field(0, ge=0)
    boot_seconds: float = Field(1.0, ge=0)
    interruption_risk: float = Field(0.0, ge=0, le=1)


class Account(_Strict):
    name: str
    provider: Literal["aws", "lambda", "nebius", "hetzner", "own-dc"]
    credentials: CredentialsRef | None = None
    #: Provider-specific knobs (API endpoint, project id, BMC inventory...).
    options: dict[str, Any] = Field(default_factory=dict)

    def option(self, key: str, default: Any) -> Any:
        """An option's value; ``default`` when it is missing or null."""
        value = self.options.get(key)
        return default if value is None else value


class ObjectStore(_Strict):
    """An S3-compatible bucket (AWS S3, Nebius, Hetzner object storage, MinIO...).

    ``credentials`` is a reference whose value is either JSON
    ``{"access_key_id": ..., "secret_access_key": ..., "session_token": ...}`` or
    ``ACCESS_KEY_ID:SECRET_ACCESS_KEY``; without it boto3's default chain is used
    (instance role, ``AWS_*`` env). Read inside activities only.
    """

    endpoint_url: str | None = None
    bucket: str = Field(min_length=1)
    region: str = "us-east-1"
    #: Key prefix inside the bucket ("" or ending in "/").
    prefix: str = ""
    credentials: CredentialsRef | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    #: ``store``: the store checks each upload's ChecksumSHA256 (AWS S3 does);
    #: ``read-back``: stream the copy back and hash it (stores that ignore checksums).
    checksum_verification: Literal["store", "read-back"] = "store"


class Site(_Strict):
    name: str
    provider: Literal["aws", "lambda", "nebius", "hetzner", "own-dc"]
    account: str
    region: str
    geography: str | None = None
    gpu: str
    gpus_per_machine: int = Field(ge=1)
    gpu_memory_gb: int = Field(0, ge=0)
    instance_type: str
    price_per_gpu_hour: float = Field(ge=0)
    capacity_type: CapacityType = CapacityType.ON_DEMAND
    min_nodes: int = Field(0, ge=0)
    max_nodes: int = Field(ge=0)
    image: str = ""
    sim: SimSiteSettings = Field(default_factory=SimSiteSettings)
    #: Where this site's model weights are replicated to (rule 10); optional.
    object_store: ObjectStore | None = None
    #: Compliance geography: this site's replicas may only move to sites of the same
    #: ``geography`` (an evacuation never takes them out of it). Needs ``geography``.
    compliance: bool = False
    #: Provider-incident rule for this site; replaces the top-level ``incident:`` block.
    incident: IncidentSettings | None = None


class SweepSettings(_Strict):
    """``sweep:`` in sites.yaml: FleetSweep, the bound on any leaked machine (README, "Leaks")."""

    #: A fleet-marked machine no join and no node accounts for is deleted once it is this old:
    #: long enough for a join to provision and register (its node then accounts for it).
    grace_seconds: float = Field(1800, ge=60, le=7 * 86400, allow_inf_nan=False)


class FleetConfig(_Strict):
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

    def incident_for(self, site: Site) -> IncidentSettings:
        return site.incident or self.incident

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
        if isinstance(step, int):
            name = node[step].get("name") if isinstance(node, list) and isinstance(node[step], dict) else None
            parts[-1] += f"[{step}]" + (f" ({name})" if name else "")
            node = node[step] if isinstance(node, list) and step < len(node) else None
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
        config = FleetConfig.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = _where(raw, err["loc"]) or "(top level)"
            message = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                message = "unknown key"
            elif err["type"] == "literal_error" and err["loc"][-1] == "provider":
                message = f"unknown provider {err.get('input')!r}; expected one of {', '.join(PROVIDERS)}"
            elif err["type"] == "missing" and err["loc"][-1] == "account":
                message = "missing account reference"
            problems.append(f"{where}: {message}")
        # The cross-field checks read the raw mapping, so one `config check` names every
        # problem: an operator should not fix the field errors only to meet a second list.
        raise ConfigError(source, problems + [p for p in _cross_check(raw) if p not in problems]) from None
    problems = _cross_check(raw)
    if problems:
        raise ConfigError(source, problems)
    return config


def _entries(raw: dict[str, Any], key: str) -> list[tuple[int, dict[str, Any]]]:
    value = raw.get(key)
    return [(i, item) for i, item in enumerate(value) if isinstance(item, dict)] if isinstance(value, list) else []


def _cross_check(raw: dict[str, Any]) -> list[str]:
    """Problems between fields and entries, on the raw mapping: an entry whose own fields
    are wrong still takes part (its bad values are skipped, the field errors name them)."""
    problems: list[str] = []
    real = raw.get("mode") == "real"
    seen: set[str] = set()
    accounts: dict[str, Any] = {}
    for i, account in _entries(raw, "accounts"):
        name = account.get("name")
        where = f"accounts[{i}]" + (f" ({name})" if name else "")
        if isinstance(name, str):
            if name in seen:
                problems.append(f"{where}.name: duplicate account")
            seen.add(name)
            accounts.setdefault(name, account.get("provider"))
        if real and account.get("credentials") is None:
            problems.append(f"{where}.credentials: missing credentials reference")
    seen = set()
    for i, site in _entries(raw, "sites"):
        name = site.get("name")
        where = f"sites[{i}]" + (f" ({name})" if name else "")
        if isinstance(name, str):
            if name in seen:
                problems.append(f"{where}.name: duplicate site")
            seen.add(name)
        low, high = site.get("min_nodes", 0), site.get("max_nodes")
        if isinstance(low, int) and isinstance(high, int) and low > high:
            problems.append(f"{where}.min_nodes: min_nodes ({low}) is greater than max_nodes ({high})")
        if site.get("compliance") is True and not site.get("geography"):
            problems.append(f"{where}.compliance: a compliance site needs a geography")
        account = site.get("account")
        if isinstance(account, str):
            if account not in accounts:
                problems.append(f"{where}.account: unknown account reference {account!r}")
            elif site.get("provider") in PROVIDERS and accounts[account] in PROVIDERS \
                    and accounts[account] != site.get("provider"):
                problems.append(f"{where}.account: account {account!r} is a {accounts[account]} account, "
                                f"site is {site.get('provider')}")
    return problems


def load_config(path: str | os.PathLike[str] | None = None) -> FleetConfig:
    """Load ``path``, or ``$GPUFLEET_CONFIG``, or the built-in simulated fleet."""
    path = path or os.environ.get("GPUFLEET_CONFIG")
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
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"not valid YAML: {exc}"]) from None
    return parse_config(raw, source)
