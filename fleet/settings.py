"""Where things are: Temporal address, namespace, task queue, state dir, config; and every
other ``GPUFLEET_*`` environment variable.

Every entry point reads the same environment variables so that ``gpufleet dev``
can hand its children one environment. This module is the one place that declares each
``GPUFLEET_*`` variable: its name, type, default and why, as a field of the settings of the
process kind that reads it (``Settings``: every process; ``WorkerEnv``: every worker;
``ControlPlaneEnv``, ``NodeAgentEnv``, ``NodeGatewayEnv``, ``WeightsPullEnv``,
``CliEnv``), or in ``ELSEWHERE`` for the few that no Python process reads through a model.
Code reads the typed value (``NodeAgentEnv.from_env().health_seconds``), never
``os.environ``; a value its type refuses is a ``SettingsError`` naming the variable.
tests/test_settings_env.py fails on a ``GPUFLEET_*`` name the code or deploy/ mentions that is
not declared here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from fleet.naming import CONTROL_PLANE_QUEUE



def temporal_profile():
    """The Temporal client profile as the ``temporal`` CLI would load it: ``temporal.toml``
    (``TEMPORAL_CONFIG_FILE``, profile ``TEMPORAL_PROFILE``) under the ``TEMPORAL_*``
    variables (address, namespace, API key, ``TEMPORAL_TLS_*``)."""
    from temporalio.envconfig import ClientConfigProfile

    try:
        return ClientConfigProfile.load()
    except Exception as error:  # the bridge's ConfigError: a bad file or an unknown profile
        raise ValueError("Temporal environment configuration (TEMPORAL_PROFILE / temporal.toml): "
                         f"{unquoted_config_error(error)}") from None


#: A line of the TOML parser's excerpt of the file (``3 | api_key = "...``, ``  |   ^``).
_EXCERPT = re.compile(r"^\s*\d*\s*\|")
#: The value serde says it found (``invalid type: integer `5```, ``string "..."``).
_FOUND = re.compile(r"(invalid (?:type|value): [a-z ]+?) (?:`[^`]*`|\"(?:[^\"\\]|\\.)*\")")


def unquoted_config_error(error: BaseException) -> str:
    """What a temporal.toml that does not load may say: where and why (``TOML parse error at
    line 3, column 11; invalid basic string``), never the file's text. The parser quotes the line
    it stopped at and the value it refused, and the file's values are the API key, TLS keys and
    gRPC metadata: the message goes to every worker's log and the operator's terminal."""
    lines = [_FOUND.sub(r"\1", line).strip() for line in str(error).splitlines()
             if line.strip() and not _EXCERPT.match(line)]
    return "; ".join(lines) or type(error).__name__


# -- declaring a variable -------------------------------------------------------------------
class SettingsError(ValueError):
    """A ``GPUFLEET_*`` variable set to a value its type refuses; the message names it."""


def envvar(name: str, default: Any, why: str, *, invalid: str | None = None) -> Any:
    """A settings field read from the variable ``name`` (unset or blank: ``default``). ``why``:
    one line on what it is for. ``invalid``: the error for a value the field's type refuses
    (``{name}`` and ``{raw}`` filled in; default: the variable, pydantic's reason, the value)."""
    extra: dict[str, str] = {"env": name}
    if invalid:
        extra["invalid"] = invalid
    return Field(default, description=why, json_schema_extra=extra)


class EnvSettings(BaseModel):
    """Settings some of whose fields are declared with ``envvar``: ``from_env`` reads those."""

    model_config = ConfigDict(frozen=True)

    @classmethod
    def variables(cls) -> dict[str, str]:
        """Each of its fields' variables → the field's name."""
        return {field.json_schema_extra["env"]: name for name, field in cls.model_fields.items()
                if isinstance(field.json_schema_extra, dict) and "env" in field.json_schema_extra}

    @classmethod
    def variable(cls, field: str) -> str:
        """The variable a field is read from (``NodeAgentEnv.variable("gateway")``)."""
        return next(name for name, f in cls.variables().items() if f == field)

    @classmethod
    def environment(cls, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The fields whose variable is set (not blank) in ``environ`` (default: os.environ),
        as set, stripped."""
        environ = os.environ if environ is None else environ
        return {field: raw.strip() for name, field in cls.variables().items() if (raw := environ.get(name, "")).strip()}

    @classmethod
    def validated(cls, values: dict[str, Any]) -> Any:
        """``cls(**values)``, a refused value a ``SettingsError`` naming its variable."""
        try:
            return cls(**values)
        except ValidationError as error:
            problem = error.errors()[0]
            field = str(problem["loc"][0]) if problem["loc"] else ""
            extra = cls.model_fields[field].json_schema_extra if field in cls.model_fields else None
            if not isinstance(extra, dict) or "env" not in extra:
                raise
            template = extra.get("invalid") or "{name}: {reason}: {raw!r}"
            raise SettingsError(template.format(name=extra["env"], raw=values.get(field),
                                                reason=problem["msg"])) from None

    @classmethod
    def get(cls, field: str, environ: Mapping[str, str] | None = None) -> Any:
        """One field as the environment gives it (typed; unset: its default), reading only its
        own variable: ``WorkerEnv.get("metrics_host")``."""
        values = {k: v for k, v in cls.environment(environ).items() if k == field}
        return getattr(cls.validated(values), field)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Any:
        """The settings as the environment gives them; ``overrides`` (not None) win."""
        values: dict[str, Any] = dict(cls.environment(environ))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.validated(values)


# -- every process ----------------------------------------------------------------------------
class Settings(EnvSettings):
    model_config = ConfigDict(frozen=False)

    address: str = "localhost:7233"
    namespace: str = "default"
    task_queue: str = envvar("GPUFLEET_TASK_QUEUE", CONTROL_PLANE_QUEUE,
                             "the control plane's task queue: its worker polls it, clients start workflows on it")
    state_dir: Path = envvar("GPUFLEET_STATE_DIR", Path(".gpufleet"),
                             "where sim and dev state live (the simulated world's database, dev logs)")
    config: Optional[str] = envvar("GPUFLEET_CONFIG", None,
                                   "the fleet config (sites.yaml); unset: the built-in simulated fleet")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> "Settings":
        profile = temporal_profile()
        env = {
            # Temporal's own environment configuration: TEMPORAL_ADDRESS / TEMPORAL_NAMESPACE,
            # else the profile (TEMPORAL_PROFILE) of temporal.toml (TEMPORAL_CONFIG_FILE).
            "address": profile.address,
            "namespace": profile.namespace,
            **cls.environment(environ),
        }
        values = {k: v for k, v in env.items() if v}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.validated(values)

    @property
    def sim_db(self) -> Path:
        return self.state_dir / "sim.db"

    def env(self) -> dict[str, str]:
        """The environment a child process needs to see the same world."""
        env = {
            "TEMPORAL_ADDRESS": self.address,
            "TEMPORAL_NAMESPACE": self.namespace,
            TASK_QUEUE_ENV: self.task_queue,
            STATE_DIR_ENV: str(self.state_dir),
        }
        if self.config:
            env[CONFIG_ENV] = self.config
        return env


TASK_QUEUE_ENV = Settings.variable("task_queue")
STATE_DIR_ENV = Settings.variable("state_dir")
CONFIG_ENV = Settings.variable("config")


# -- each kind of process ---------------------------------------------------------------------
class WorkerEnv(EnvSettings):
    """Every worker process: the control plane's, a node agent, the node gateway."""

    # A number past 65535 (or below 1) passed as a port, and the worker died binding it with
    # Python's OverflowError, a traceback naming no variable.
    metrics_port: Annotated[Optional[int], Field(ge=1, le=65535)] = envvar("GPUFLEET_METRICS_PORT", None,
                                         "serve Prometheus /metrics here (--metrics-port first); unset: none",
                                         invalid="{name}: not a port number: {raw!r}")
    metrics_host: str = envvar("GPUFLEET_METRICS_HOST", "0.0.0.0",
                               "the address /metrics listens on (gpufleet dev: loopback)")


class ControlPlaneEnv(EnvSettings):
    """The control-plane worker (its activities: the providers, the cluster, the probes)."""

    # The SDK takes a count: 0 caches none (every task replays its workflow's history), and a
    # number below 0 went to it as it came.
    max_cached_workflows: Annotated[int, Field(ge=0)] = envvar(
        "GPUFLEET_MAX_CACHED_WORKFLOWS", 4000,
        "workflows kept in memory between tasks (every Node entity is one; an evicted one replays its "
        "history); above the SDK's 1,000 for 1,250 nodes; 0: none",
        invalid="{name}: a whole number of workflows, 0 or more, not {raw!r}")
    # A machine is an orphan once ``now - created >= grace`` (workers/metrics.py): nan made none
    # ever one, inf the same, a negative number every machine one the moment it was bought.
    orphan_grace_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = envvar(
        "GPUFLEET_ORPHAN_GRACE_SECONDS", 600.0,
        "seconds a machine without a node or a running join is not yet an orphan (0: at once)",
        invalid="{name}: a number of seconds, 0 or more, not {raw!r}")
    serving_namespace: str = envvar("GPUFLEET_NAMESPACE", "gpufleet",
                                    "the Kubernetes namespace of the model servers the serving probe calls")
    serving_url: Optional[str] = envvar("GPUFLEET_SERVING_URL", None,
                                        "the serving probe's URL template ({name}, {namespace}, {model}, {site}); "
                                        "unset: the model server's Service in the cluster")
    join_endpoint: str = envvar("GPUFLEET_JOIN_ENDPOINT", "",
                                "the API server address new nodes join (unset: cluster-info's)")
    bootstrap_template: Optional[Path] = envvar("GPUFLEET_BOOTSTRAP_TEMPLATE", None,
                                                "a site's cloud-init template (unset: deploy/bootstrap's)")
    node_install: Optional[Path] = envvar("GPUFLEET_NODE_INSTALL", None,
                                          "the node install step's pins (unset: deploy/bootstrap's)")


class NodeAgentEnv(EnvSettings):
    """A node agent (``workers.node_agent``; ``--sim``: the host of every simulated machine)."""

    gateway: Optional[str] = envvar("GPUFLEET_GATEWAY", None,
                                    "the node gateway's host:port; unset: Temporal directly (benches only)")
    gateway_ca: Optional[Path] = envvar("GPUFLEET_GATEWAY_CA", None,
                                        "the CA that signed the gateway's certificate (with GPUFLEET_GATEWAY)")
    gateway_server_name: str = envvar("GPUFLEET_GATEWAY_SERVER_NAME", "localhost",
                                      "the name the gateway's certificate is checked against")
    sim_signer_dir: Optional[Path] = envvar("GPUFLEET_SIM_SIGNER_DIR", None,
                                            "--sim: the dev CA's directory, to sign the simulated nodes' CSRs")
    spot_notice: str = envvar("GPUFLEET_SPOT_NOTICE", "",
                              "where spot reclaim notices come from: auto (the node's provider's, by the "
                              "providerID gpufleet gave it; the shipped DaemonSet's), aws or gcp metadata; "
                              "unset: none")
    # A waiting watch probes every interval when it is above 0 (activities/node_agent.py): nan,
    # inf or a negative number silently meant 0, probing only when woken.
    health_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = envvar(
        "GPUFLEET_HEALTH_SECONDS", 5.0, "a waiting health watch's probe interval, seconds (0: only when woken)",
        invalid="{name}: a number of seconds, 0 or more (0: probe only when woken), not {raw!r}")
    # One value for every node: what it runs is the node's own image's script (each site's image
    # carries its own), through the command deploy/driver-reinstall sets (fleet/repair_policy.py,
    # DRIVER_REINSTALL_SCRIPT).
    driver_reinstall_cmd: Optional[str] = envvar(
        "GPUFLEET_DRIVER_REINSTALL_CMD", None,
        "the command that reinstalls the node's GPU driver (repair.reinstall_via: agent); "
        "deploy/driver-reinstall: the node image's /usr/local/sbin/gpufleet-reinstall-driver in the host's "
        "namespaces; unset: none (the rung fails)")


class NodeGatewayEnv(EnvSettings):
    """The node gateway (``workers.node_gateway``; its ``--listen`` reads the variable)."""

    listen: str = envvar("GPUFLEET_GATEWAY_LISTEN", "127.0.0.1:7300", "host:port the gateway serves node agents on")
    token_keys: Optional[Path] = envvar(
        "GPUFLEET_GATEWAY_TOKEN_KEYS", None,
        "the directory of the Secret gpufleet-node-gateway-token-key: its file current (the key every "
        "replica binds the task tokens it hands a node with) and, while rotating, previous (accepted too); "
        "required but with --dev")
    # Sized in workers/gateway/proxy.py (CALLS_PER_SECOND, CALL_BURST: what an honest agent sends).
    # inf: each call found its node's bucket full again (refilled by elapsed x inf), none refused.
    calls_per_second: Annotated[float, Field(gt=0, allow_inf_nan=False)] = envvar(
        "GPUFLEET_GATEWAY_CALLS_PER_SECOND", 20.0,
        "calls one node may send upstream per second, on average (a task delivered to it pays for "
        "its poll and its result); beyond: RESOURCE_EXHAUSTED",
        invalid="{name}: a finite number of calls above 0, not {raw!r}")
    call_burst: Annotated[int, Field(gt=0)] = envvar(
        "GPUFLEET_GATEWAY_CALL_BURST", 60, "calls one node may send upstream at once before its rate applies",
        invalid="{name}: a whole number above 0, not {raw!r}")
    # Sized in workers/gateway/proxy.py (UPSTREAM_CALLS_PER_SECOND: under the frontend's defaults).
    upstream_calls_per_second: Annotated[float, Field(gt=0, allow_inf_nan=False)] = envvar(
        "GPUFLEET_GATEWAY_UPSTREAM_CALLS_PER_SECOND", 1000.0,
        "calls every node together may send upstream per second, through all the gateway's replicas "
        "(each takes its part, GPUFLEET_GATEWAY_REPLICAS), shared fairly among the nodes calling; "
        "a node with its share answered RESOURCE_EXHAUSTED beyond",
        invalid="{name}: a finite number of calls above 0, not {raw!r}")
    replicas: Annotated[int, Field(gt=0)] = envvar(
        "GPUFLEET_GATEWAY_REPLICAS", 1,
        "how many gateway replicas run: each sends upstream at most its part of "
        "GPUFLEET_GATEWAY_UPSTREAM_CALLS_PER_SECOND (the manifests set it to their replicas)",
        invalid="{name}: a whole number of replicas above 0, not {raw!r}")

    peers: Annotated[Optional[str], Field(pattern=r"^[^:\s]+:[0-9]+$")] = envvar(
        "GPUFLEET_GATEWAY_PEERS", None,
        "host:port: a name resolving to every replica (the headless Service gpufleet-node-gateway-peers) "
        "and the port each serves the others what it forwarded for each node on, so that a node gets "
        "one fair share of the upstream budget however many replicas it reaches; unset: one replica",
        invalid="{name}: host:port (a name resolving to every replica, and their peer port), not {raw!r}")

    @property
    def replica_upstream_calls_per_second(self) -> float:
        """What one replica may send upstream a second: its part of the whole gateway's."""
        return self.upstream_calls_per_second / self.replicas


class WeightsPullEnv(EnvSettings):
    """A serving pod's weights pull (``python -m workers.weights_pull``, ``gpufleet weights pull``)."""

    weights: str = envvar("GPUFLEET_WEIGHTS", "", "the WeightsPull spec (JSON) the pod is given, when no file is")


def _ports_low_high(value: str) -> str:
    """``LOW-HIGH`` (the pattern checked): the ports LOW to HIGH - 1, each a TCP port."""
    low, high = (int(part) for part in value.split("-", 1))
    if not 1 <= low < high <= 65536:
        raise ValueError("not 1 <= LOW < HIGH <= 65536")
    return value


class CliEnv(EnvSettings):
    """The ``gpufleet`` command line."""

    ui_url: str = envvar("GPUFLEET_UI_URL", "",
                         "the Temporal UI's base URL for links; unset: beside the frontend; none: no links")
    realtemporal_cache: Optional[Path] = envvar("GPUFLEET_REALTEMPORAL_CACHE", None,
                                                "where `gpufleet dev --temporal cluster` caches its binaries "
                                                "(unset: ~/.cache/gpufleet/realtemporal)")
    # cli/temporal_cluster.py picks a port from LOW to HIGH - 1: one past 65535 was bound as it came
    # (Python's OverflowError), a HIGH not above LOW was random's ValueError (tracebacks naming
    # nothing), a LOW of 0 handed out port 0.
    port_range: Annotated[str, StringConstraints(pattern=r"^[0-9]{4,5}-[0-9]{4,5}$"),
                          AfterValidator(_ports_low_high)] = envvar(
        "GPUFLEET_PORT_RANGE", "20000-32600",
        "LOW-HIGH: the loopback ports `gpufleet dev --temporal cluster` picks its services' "
        "from (processes starting servers side by side, the test suite's workers, give "
        "each its own)",
        invalid="{name}: LOW-HIGH, the ports from LOW up to HIGH (not taken), 1 <= LOW < HIGH <= 65536, "
                "not {raw!r}")


#: The settings of every kind of process.
MODELS: tuple[type[EnvSettings], ...] = (Settings, WorkerEnv, ControlPlaneEnv, NodeAgentEnv,
                                         NodeGatewayEnv, WeightsPullEnv, CliEnv)

#: Variables no process reads through a model: credentials references (providers.credentials
#: reads the variable a reference names), and those read before or outside Python's processes.
WEIGHTS_KEY_ENV = "GPUFLEET_WEIGHTS_KEY"
DEV_S3_KEY_ENV = "GPUFLEET_DEV_S3_KEY"
VENV_ENV = "GPUFLEET_VENV"
ELSEWHERE: dict[str, str] = {
    WEIGHTS_KEY_ENV: "a serving pod's object-store key, from a Secret (its weights pull's credentials reference)",
    DEV_S3_KEY_ENV: "the dev object stores' key (the dev config's credentials reference; gpufleet dev sets it)",
    VENV_ENV: "bootstrap.py's virtual environment (default: .venv); read before any dependency is installed",
}


def declared() -> dict[str, str]:
    """Every declared ``GPUFLEET_*`` variable → its one line of why."""
    found = {name: model.model_fields[field].description or "" for model in MODELS
             for name, field in model.variables().items()}
    return {**found, **ELSEWHERE}
