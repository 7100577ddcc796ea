"""A real Temporal cluster on loopback, set up from what deploy/temporal/values.yaml names:
the server ``gpufleet dev --temporal cluster`` runs, and tests/realtemporal's fixture.

What runs, each its own process:

* **PostgreSQL** from Debian (``postgresql-15``): a throwaway cluster (``initdb`` into a fresh
  folder, password auth on 127.0.0.1 only). ``initdb`` and ``postgres`` refuse to run as root,
  so as root they run as the package's ``postgres`` user. Durability is off (``fsync``,
  ``synchronous_commit``, ``full_page_writes``): the data lives until the cluster stops.
* **The schema**, as the chart's schema job applies it: ``temporal-sql-tool create-database``,
  ``setup-schema -v 0.0``, ``update-schema --schema-dir .../versioned`` for both stores.
* **frontend, history, matching and worker**: ``temporal-server start --service X``, one process
  each, as the chart runs one Deployment each; they find each other through the database's
  membership table (ringpop on 127.0.0.1).

From values.yaml, unchanged: ``numHistoryShards``, both datastores (plugin, database names, pool
sizes; the address and password are this machine's), ``server.dynamicConfig`` (which is
deploy/temporal/dynamic-config.yaml; the file itself is what the services read), and the
namespaces with their retention, created as the chart's namespace job creates them.

Always values.yaml's internode mutual TLS (``server.config.tls.internode``, and membership over it:
the dynamic config's ``system.enableRingpopTLS``): history, matching and the worker service refuse
any caller without its certificate. Given the Secrets values.yaml mounts (``RealTemporal.tls_secrets``),
all of its ``server.config.tls`` (the frontend's mutual TLS too), each file at its Secret's folder
here, and the namespace job's client is the admin tools' (``admintools.additionalEnv``). Without
them (``gpufleet dev --temporal cluster``, the tier's shared cluster) the frontend is plaintext on
loopback, as the dev server is, and the internode Secret is a throwaway one, of a CA made for this
cluster alone; tests/realtemporal/test_tls.py runs the shipped TLS with an operator's Secrets.

The binaries are built by ``python3 tests/realtemporal/build.py`` (from the Go module proxy);
this module only finds them where that script puts them (``cache_dir`` below).

``python -m cli.temporal_cluster`` runs one until Ctrl-C and prints its address and
process ids (``bench.scale --address ... --server-pids ...`` measures against it).
"""

from __future__ import annotations

import asyncio
import copy
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from fleet.settings import CliEnv

#: Where tests/realtemporal/build.py puts what it builds (stdlib-only, run before any venv
#: exists, so it cannot import this; tests/realtemporal/test_dev_cluster.py checks the two agree).
TEMPORAL_VERSION = "v1.32.1"
BUILD_COMMAND = "python3 tests/realtemporal/build.py"
BUILT_BINARIES = ("temporal-server", "temporal-sql-tool")

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "temporal"
VALUES = DEPLOY / "values.yaml"
DYNAMIC_CONFIG = DEPLOY / "dynamic-config.yaml"
SERVICES = ("history", "matching", "frontend", "worker")
#: Keys of a datastore that only the chart reads (its Secret and schema job); it strips them
#: before rendering the server's config, and so does this.
CHART_ONLY_KEYS = ("existingSecret", "secretKey", "createDatabase", "manageSchema")
#: Where the chart's schema job finds each store's versioned schema (plugin postgres12).
SCHEMA_BY_STORE = {"default": "temporal", "visibility": "visibility"}
START_SECONDS = 180
#: The cluster's ports besides the frontend's gRPC and HTTP ones, in this order from one first port
#: (``gpufleet dev --cluster-port``, by default ``--port`` + 1: 7234-7241 beside the default 7233).
INTERNAL_PORTS = ("history", "matching", "worker", "frontend-membership", "history-membership",
                  "matching-membership", "worker-membership", "postgres")
#: Each service's Prometheus listener (``gpufleet dev`` puts them after its workers' metrics ports).
METRICS_PORTS = ("frontend-metrics", "history-metrics", "matching-metrics", "worker-metrics")


class ClusterFailed(RuntimeError):
    pass


def cache_dir() -> Path:
    root = CliEnv.get("realtemporal_cache") or Path.home() / ".cache" / "gpufleet" / "realtemporal"
    return root / TEMPORAL_VERSION


def bin_dir() -> Path:
    return cache_dir() / "bin"


def schema_dir() -> Path:
    """``temporal/`` and ``visibility/`` for PostgreSQL, each with its ``versioned/`` steps."""
    return cache_dir() / "schema" / "postgresql"


def built() -> bool:
    stamp = cache_dir() / "built"
    return (stamp.exists() and stamp.read_text() == TEMPORAL_VERSION
            and all((bin_dir() / name).exists() for name in BUILT_BINARIES)
            and (schema_dir() / "temporal" / "versioned").is_dir())


def free_port() -> int:
    """A TCP port on 127.0.0.1 below the ephemeral range (32768-60999), which an outgoing
    connection could otherwise take between "free" and the service's own bind. Taken from
    ``GPUFLEET_PORT_RANGE`` (``LOW-HIGH``) where set: processes starting servers side by side
    (the test suite's workers) give each its own range, since a port another one found free a
    moment ago looks free here too until its service binds it."""
    import random

    low, high = (int(part) for part in CliEnv.get("port_range").split("-", 1))
    for _ in range(200):
        port = random.randint(low, high - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {low}-{high}")


def values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())


def history_shards() -> int:
    return values()["server"]["config"]["persistence"]["numHistoryShards"]


def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL server's bin folder (Debian: /usr/lib/postgresql/<v>/bin)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parent.parent.name)
                   if p.parent.parent.name.isdigit() else 0)
    return found[-1].parent if found else None


def postgres_user() -> str | None:
    """Who runs PostgreSQL: this user, or ``postgres`` when this is root (initdb refuses root)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise ClusterFailed("running as root needs the `postgres` user (apt-get install postgresql creates it)")
    return "postgres"


def missing_reason() -> str | None:
    """None when the tier can run; else one line saying what is missing."""
    if postgres_bin() is None:
        return "a real Temporal cluster needs PostgreSQL's server: apt-get install postgresql"
    if not built():
        if shutil.which("go") is None:
            return (f"the Temporal server {TEMPORAL_VERSION} is not built, and building it needs Go (`go` on PATH): "
                    f"install Go, then run `{BUILD_COMMAND}`")
        return f"the Temporal server {TEMPORAL_VERSION} is not built: run `{BUILD_COMMAND}`"
    return None


@dataclass
class Postgres:
    """A throwaway PostgreSQL on 127.0.0.1, owned by ``postgres`` when run as root."""

    port: int = field(default_factory=free_port)
    user: str = "temporal"
    password: str = field(default_factory=lambda: secrets.token_hex(12))
    root: Path | None = None
    process: subprocess.Popen | None = None

    def _run_as(self) -> list[str]:
        """The prefix that runs a command as the ``postgres`` user (none when not root).

        ``setpriv`` (util-linux), not ``subprocess``'s ``user=``/``group=``: those make Python fork
        and switch user in the child before exec, and in a process with gRPC's threads running (a
        test worker that has used the node gateway) gRPC's fork handlers then broke the child:
        initdb failed with only gRPC's "epoll_wait error: Bad file descriptor". A plain command is
        spawned without running anything of this process in the child, and ``setpriv`` execs the
        program in its own place (its pid is the server's: signals reach it)."""
        who = postgres_user()
        if not who:
            return []
        setpriv = shutil.which("setpriv", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/bin"]))
        if setpriv is None:
            raise ClusterFailed("setpriv (util-linux) is needed to run PostgreSQL as its own user under root")
        return [setpriv, f"--reuid={who}", f"--regid={who}", "--init-groups", "--"]

    def start(self) -> "Postgres":
        bindir = postgres_bin()
        if bindir is None:
            raise ClusterFailed(missing_reason())
        # Not under pytest's tmp folders: they are 0700 root's, and the postgres user must reach this.
        self.root = Path(tempfile.mkdtemp(prefix="gpufleet-postgres-"))
        as_user = self._run_as()
        owner = pwd.getpwnam(postgres_user()) if as_user else None
        if owner is not None:
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
        password_file = self.root / "password"
        password_file.write_text(self.password)
        if owner is not None:
            os.chown(password_file, owner.pw_uid, owner.pw_gid)
        data = self.root / "data"
        done = subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(data), "-U", self.user,
                               f"--pwfile={password_file}", "--auth=scram-sha-256", "--no-locale", "-E", "UTF8",
                               "--no-sync"], capture_output=True, text=True)
        if done.returncode != 0:
            raise ClusterFailed(f"initdb failed: {done.stderr[-2000:]}")
        password_file.unlink()
        with open(self.root / "postgres.log", "w") as log:  # the child keeps its own copy
            self.process = subprocess.Popen(
                [*as_user, str(bindir / "postgres"), "-D", str(data), "-p", str(self.port),
                 "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.root}",
                 "-c", "max_connections=300", "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while subprocess.run([str(bindir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)]).returncode:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise ClusterFailed(f"PostgreSQL did not start: {(self.root / 'postgres.log').read_text()[-2000:]}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # a fast shutdown
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)


def datastores(pg: Postgres) -> dict[str, Any]:
    """values.yaml's persistence block as the server reads it: chart-only keys stripped, as the
    chart strips them, and this machine's PostgreSQL address and password."""
    persistence = copy.deepcopy(values()["server"]["config"]["persistence"])
    for store in persistence["datastores"].values():
        sql = store["sql"]
        for key in CHART_ONLY_KEYS:
            sql.pop(key, None)
        sql.update(connectAddr=f"127.0.0.1:{pg.port}", user=pg.user, password=pg.password)
    return persistence


def mounted_secrets(component: str) -> dict[str, str]:
    """The Secrets values.yaml mounts into ``component``'s pods (``server``, ``admintools``,
    ``web``: ``additionalVolumes`` and ``additionalVolumeMounts``), by name: their mountPath."""
    settings = values().get(component) or {}
    by_volume = {v["name"]: v["secret"]["secretName"] for v in settings.get("additionalVolumes") or ()
                 if "secret" in v}
    return {by_volume[m["name"]]: m["mountPath"].rstrip("/") for m in settings.get("additionalVolumeMounts") or ()
            if m["name"] in by_volume}


def relocated(value: Any, component: str, secrets: dict[str, Path]) -> Any:
    """``value`` (values.yaml's, any nesting) with every path under a Secret's mountPath in
    ``component``'s pods moved to that Secret's folder on this machine (``secrets``: name → folder)."""
    if isinstance(value, dict):
        return {key: relocated(item, component, secrets) for key, item in value.items()}
    if isinstance(value, list):
        return [relocated(item, component, secrets) for item in value]
    if isinstance(value, str):
        for name, mount in mounted_secrets(component).items():
            if value.startswith(mount + "/"):
                if name not in secrets:
                    raise ClusterFailed(f"values.yaml's {component} reads {value} from the Secret {name}: "
                                        f"give its files (tls_secrets)")
                return str(secrets[name] / value[len(mount) + 1:])
    return value


def server_tls(secrets: dict[str, Path], frontend: bool = True) -> dict[str, Any]:
    """values.yaml's ``server.config.tls`` as the server reads it (the chart renders it verbatim as
    ``global.tls``), its files those of ``secrets``; without ``frontend``, less what serves and
    calls the frontend (``frontend``, ``systemWorker``): its clients connect in plaintext."""
    tls = values()["server"]["config"].get("tls") or {}
    if not frontend:
        tls = {key: value for key, value in tls.items() if key not in ("frontend", "systemWorker")}
    return relocated(tls, "server", secrets)


def internode_tls() -> dict[str, Any]:
    """values.yaml's ``server.config.tls.internode``: how the services serve and call each other."""
    return values()["server"]["config"]["tls"]["internode"]


def internode_secret() -> str:
    """The Secret values.yaml's internode TLS reads its certificate from."""
    cert = internode_tls()["server"]["certFile"]
    (name,) = [name for name, mount in mounted_secrets("server").items() if cert.startswith(mount + "/")]
    return name


def throwaway_internode_secret(folder: Path) -> Path:
    """Files as the internode Secret holds them (``tls.crt``, ``tls.key``, ``ca.crt``), of a CA made
    for one cluster and never kept: one certificate for the name the services check
    (``internode.client.serverName``), for serving and for calling, as each service uses it."""
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from providers.private_files import private_folder, write_private
    from workers.gateway.pki import Pki

    pki = Pki.create("gpufleet throwaway Temporal internode CA")
    cert, key = pki.certificate("temporal-internode", (internode_tls()["client"]["serverName"],),
                                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    private_folder(folder)
    write_private(folder / "tls.key", key)
    (folder / "tls.crt").write_bytes(cert)
    (folder / "ca.crt").write_bytes(pki.ca_pem)
    return folder


def admintools_env(secrets: dict[str, Path]) -> dict[str, str]:
    """The admin tools' ``additionalEnv`` (the namespace job's too), its files those of ``secrets``."""
    env = values().get("admintools", {}).get("additionalEnv") or ()
    return {e["name"]: relocated(e["value"], "admintools", secrets) for e in env}


@dataclass
class RealTemporal:
    """The cluster: PostgreSQL, the schema, four services, the namespaces and search attributes."""

    root: Path
    #: Extra dynamic config appended to deploy/temporal/dynamic-config.yaml (tests only: keys
    #: the file does not have, constrained to a namespace of their own; see test_config.py).
    extra_dynamic_config: str = ""
    extra_namespaces: tuple[str, ...] = ()
    #: The frontend's gRPC and HTTP ports (``gpufleet dev --port/--http-port``); free ones when unset.
    frontend_port: int | None = None
    frontend_http_port: int | None = None
    #: Any other port by its name (``INTERNAL_PORTS``, ``METRICS_PORTS``): ``gpufleet dev`` sets them
    #: all, from its ``--port``; each one not named here is a free one (the test tier's clusters).
    fixed_ports: dict[str, int] = field(default_factory=dict)
    #: The Secrets values.yaml mounts, by name: a folder holding each one's files (``tls.crt``,
    #: ``tls.key``, ``ca.crt``). Given, the services serve all of values.yaml's mutual TLS from
    #: them; None, the frontend plaintext (see the module's docstring).
    tls_secrets: dict[str, Path] | None = None
    #: The Secrets the services read, by name: ``tls_secrets``, or a throwaway internode one.
    secret_files: dict[str, Path] = field(default_factory=dict)
    postgres: Postgres = field(default_factory=Postgres)
    ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    started_seconds: float = 0.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['frontend']}"

    @property
    def namespaces(self) -> list[tuple[str, timedelta]]:
        """values.yaml's namespaces (with their retention), then the extra ones (1 day)."""
        listed = [(n["name"], parse_retention(n["retention"]))
                  for n in values()["server"]["config"]["namespaces"]["namespace"]]
        return listed + [(name, timedelta(days=1)) for name in self.extra_namespaces]

    @property
    def dynamic_config_path(self) -> Path:
        return self.root / "dynamic-config.yaml"

    def pids(self) -> dict[str, int]:
        """Every process of the cluster (PostgreSQL's postmaster; its backends are its children)."""
        return {**{name: p.pid for name, p in self.processes.items()}, "postgres": self.postgres.process.pid}

    def server_config(self, service: str) -> dict[str, Any]:
        rpc = {name: {"rpc": {"grpcPort": self.ports[name], "membershipPort": self.ports[f"{name}-membership"],
                              "bindOnLocalHost": True}} for name in SERVICES}
        rpc["frontend"]["rpc"]["httpPort"] = self.ports["frontend-http"]
        return {
            "log": {"stdout": True, "level": "warn"},
            "persistence": datastores(self.postgres),
            "global": {
                "membership": {"maxJoinDuration": "30s", "broadcastAddress": "127.0.0.1"},
                # Each process its own metrics port (they are separate processes, as in the chart).
                "metrics": {"prometheus": {"framework": "tally", "timerType": "histogram",
                                           "listenAddress": f"127.0.0.1:{self.ports[f'{service}-metrics']}"}},
                "tls": server_tls(self.secret_files, frontend=self.tls_secrets is not None),
            },
            "services": rpc,
            "clusterMetadata": {
                "enableGlobalNamespace": False, "failoverVersionIncrement": 10,
                "masterClusterName": "active", "currentClusterName": "active",
                "clusterInformation": {"active": {"enabled": True, "initialFailoverVersion": 1,
                                                  "rpcName": "frontend", "rpcAddress": self.address}},
            },
            "dcRedirectionPolicy": {"policy": "noop"},
            "dynamicConfigClient": {"filepath": str(self.dynamic_config_path), "pollInterval": "10s"},
        }

    def planned_ports(self) -> dict[str, int]:
        """Every port the cluster opens, by name: the frontend's, ``INTERNAL_PORTS`` and
        ``METRICS_PORTS``; those not set (``frontend_port``, ``fixed_ports``) free ones."""
        unknown = set(self.fixed_ports) - {*INTERNAL_PORTS, *METRICS_PORTS}
        if unknown:
            raise ValueError(f"fixed_ports: unknown ports {sorted(unknown)}")
        chosen = {"frontend": self.frontend_port, "frontend-http": self.frontend_http_port,
                  "postgres": self.postgres.port, **self.fixed_ports}
        names = ("frontend", "frontend-http", *INTERNAL_PORTS, *METRICS_PORTS)
        planned = {name: chosen[name] for name in names if chosen.get(name) is not None}
        for name in names:
            while name not in planned or (chosen.get(name) is None and list(planned.values()).count(planned[name]) > 1):
                planned[name] = free_port()  # not bound until the service starts: two picks could be one port
        return {name: planned[name] for name in names}

    def start(self) -> "RealTemporal":
        started = time.monotonic()
        reason = missing_reason()
        if reason:
            raise ClusterFailed(reason)
        self.root.mkdir(parents=True, exist_ok=True)
        self.secret_files = (dict(self.tls_secrets) if self.tls_secrets is not None else
                             {internode_secret(): throwaway_internode_secret(self.root / internode_secret())})
        self.ports = self.planned_ports()
        self.postgres.port = self.ports["postgres"]
        text = DYNAMIC_CONFIG.read_text()
        self.dynamic_config_path.write_text(text + ("\n" + self.extra_dynamic_config if self.extra_dynamic_config
                                                    else ""))
        try:
            self.postgres.start()
            self.setup_schema()
            self.start_services(*SERVICES[:-1])
            asyncio.run(self.until_frontend_answers())
            # The worker service (Temporal's own system workflows) gives up if the frontend does
            # not answer within seconds of its start: it starts once the frontend does.
            self.start_services("worker")
            asyncio.run(self.create_namespaces())
        except BaseException:
            self.stop()
            raise
        self.started_seconds = time.monotonic() - started
        return self

    def sql_tool(self, store: str, *args: str) -> None:
        sql = datastores(self.postgres)["datastores"][store]["sql"]
        env = {**os.environ, "SQL_PLUGIN": sql["pluginName"], "SQL_HOST": "127.0.0.1",
               "SQL_PORT": str(self.postgres.port), "SQL_DATABASE": sql["databaseName"],
               "SQL_USER": sql["user"], "SQL_PASSWORD": sql["password"]}
        done = subprocess.run([str(bin_dir() / "temporal-sql-tool"), *args], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise ClusterFailed(f"temporal-sql-tool {' '.join(args)} ({store}) failed: {done.stderr[-2000:]}")

    def setup_schema(self) -> None:
        """The chart's schema job, store by store."""
        for store, schema in SCHEMA_BY_STORE.items():
            self.sql_tool(store, "create-database")
            self.sql_tool(store, "setup-schema", "-v", "0.0")
            self.sql_tool(store, "update-schema", "--schema-dir", str(schema_dir() / schema / "versioned"))

    def start_services(self, *services: str) -> None:
        for service in services:
            config = self.root / f"{service}.yaml"
            config.write_text(yaml.safe_dump(self.server_config(service), sort_keys=False))
            with open(self.root / f"{service}.log", "w") as log:  # the child keeps its own copy
                self.processes[service] = subprocess.Popen(
                    [str(bin_dir() / "temporal-server"), "--config-file", str(config), "--allow-no-auth",
                     "start", "--service", service],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            # One at a time: the first to start writes the cluster's metadata row, and two that
            # start together race for it (the loser exits "failed to initialize current cluster
            # metadata"). A service listens once it has done so.
            self.until_listening(service)

    def until_listening(self, service: str) -> None:
        deadline = time.monotonic() + START_SECONDS
        while True:
            self.check_running()
            with socket.socket() as probe:
                probe.settimeout(1)
                if probe.connect_ex(("127.0.0.1", self.ports[service])) == 0:
                    return
            if time.monotonic() > deadline:
                raise ClusterFailed(f"temporal-server {service} did not listen within {START_SECONDS} s:\n"
                                    f"{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, chars: int = 3000) -> str:
        parts = []
        for service in SERVICES:
            path = self.root / f"{service}.log"
            if path.exists():
                parts.append(f"--- {service}.log\n{path.read_text()[-chars:]}")
        return "\n".join(parts)

    def check_running(self) -> None:
        for service, process in self.processes.items():
            if process.poll() is not None:
                raise ClusterFailed(f"temporal-server {service} exited ({process.returncode}):\n{self.log_tail()}")

    async def connect(self, namespace: str | None = None, address: str | None = None):
        """A client of the frontend; over mutual TLS, as the admin tools connect (the namespace
        job's client: ``admintools_env``, read as the ``temporal`` CLI reads it)."""
        from temporalio.client import Client
        from temporalio.contrib.pydantic import pydantic_data_converter
        from temporalio.envconfig import ClientConfigProfile

        tls: Any = False
        if self.tls_secrets is not None:
            profile = ClientConfigProfile.load(disable_file=True, override_env_vars=admintools_env(self.tls_secrets))
            tls = profile.to_client_connect_config().get("tls", False)
        return await Client.connect(address or self.address, namespace=namespace or self.namespaces[0][0],
                                    data_converter=pydantic_data_converter, tls=tls)

    async def until_frontend_answers(self) -> None:
        """Once history and matching have joined the ring, the frontend serves."""
        from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
        from temporalio.service import RPCError

        deadline = time.monotonic() + START_SECONDS
        while True:
            self.check_running()
            try:
                client = await self.connect(namespace="temporal-system")
                await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace="temporal-system"))
                return
            except (RPCError, RuntimeError) as error:
                if time.monotonic() > deadline:
                    raise ClusterFailed(f"the frontend did not answer within {START_SECONDS} s ({error}):\n"
                                        f"{self.log_tail()}") from error
                await asyncio.sleep(0.5)

    async def create_namespaces(self) -> None:
        """Each namespace with its retention (as the chart's namespace job: create if missing),
        then gpufleet's search attributes on each (``gpufleet search-attributes`` does the same)."""
        from google.protobuf.duration_pb2 import Duration
        from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
        from temporalio.service import RPCError, RPCStatusCode

        from fleet import search_attributes

        deadline = time.monotonic() + START_SECONDS
        client = await self.connect(namespace="temporal-system")
        for name, retention in self.namespaces:
            try:
                period = Duration()
                period.FromTimedelta(retention)
                await client.workflow_service.register_namespace(
                    RegisterNamespaceRequest(namespace=name, workflow_execution_retention_period=period))
            except RPCError as error:
                if error.status != RPCStatusCode.ALREADY_EXISTS:
                    raise
        for name, _ in self.namespaces:
            while True:  # a new namespace reaches the frontend's registry on its next refresh
                try:
                    await search_attributes.ensure_registered(await self.connect(namespace=name))
                    break
                except RPCError as error:
                    if error.status != RPCStatusCode.NOT_FOUND or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.postgres.stop()


def parse_retention(text: str) -> timedelta:
    """The chart's retention format (``14d``, ``72h``, as `temporal operator namespace create --retention`)."""
    match = re.fullmatch(r"(\d+)([dhm])", str(text))
    if not match:
        raise ValueError(f"retention: {text!r} is not like 14d or 72h")
    amount, unit = int(match.group(1)), match.group(2)
    return {"d": timedelta(days=amount), "h": timedelta(hours=amount), "m": timedelta(minutes=amount)}[unit]


def main() -> int:
    """Run a cluster until Ctrl-C (for ``bench.scale --address``)."""
    root = Path(tempfile.mkdtemp(prefix="gpufleet-realtemporal-"))
    cluster = RealTemporal(root)
    try:
        cluster.start()
    except ClusterFailed as error:
        print(error, file=sys.stderr)
        return 1
    pids = cluster.pids()
    print(f"Temporal {TEMPORAL_VERSION} on {cluster.address}, namespace {cluster.namespaces[0][0]}, "
          f"{history_shards()} history shards, started in {cluster.started_seconds:.0f} s (logs: {root})", flush=True)
    print(f"  --address {cluster.address} --server-pids {','.join(str(p) for p in pids.values())}", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.5)
            cluster.check_running()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
