"""Fixtures for ModelRollout: moto S3 servers (two site stores + a source bucket),
a three-site simulated fleet whose sites have object stores, and a running stack."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import yaml
from temporalio.testing import WorkflowEnvironment

from activities.env import FleetEnv
from activities.weights import make_s3_client
from fleet.config import ObjectStore
from fleet.models import CredentialsRef
from fleet.cluster import LABEL_SITE, ServingSpec, SiteRoute
from sim.probe import SimProbe
from tests.can_server import server_suggesting_continue_as_new
from tests.conftest import Stack, make_settings, terminate_running
from workers.control_plane import build_worker

MODEL = "llm"
CREDS = {"env": "ROLLOUT_S3_KEY"}


@dataclass
class MotoS3:
    endpoints: list[str]

    def store(self, i: int, bucket: str | None = None, **extra: Any) -> ObjectStore:
        return ObjectStore(endpoint_url=self.endpoints[i], bucket=bucket or f"b-{uuid.uuid4().hex[:10]}",
                           addressing_style="path", credentials=CredentialsRef(**CREDS), **extra)

    def client(self, store: ObjectStore):
        return make_s3_client(store)

    def bucket(self, store: ObjectStore, versioned: bool = False) -> ObjectStore:
        client = self.client(store)
        client.create_bucket(Bucket=store.bucket)
        if versioned:
            client.put_bucket_versioning(Bucket=store.bucket, VersioningConfiguration={"Status": "Enabled"})
        return store


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def moto_s3() -> MotoS3:
    """Two moto servers in their own processes (so memory measured here is ours)."""
    os.environ["ROLLOUT_S3_KEY"] = "testing:testing"
    # Small parts in tests (real S3 wants >= 5 MiB).
    env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": "1"}
    ports = [_free_port(), _free_port()]
    servers = [subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in ports]
    endpoints = [f"http://127.0.0.1:{port}" for port in ports]
    deadline = time.monotonic() + 60
    for port in ports:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    yield MotoS3(endpoints)
    for server in servers:
        server.terminate()
        server.wait()


def put_files(s3: MotoS3, source: ObjectStore, sizes: dict[str, int], seed: int = 0) -> list[dict]:
    """Random-ish files in the source bucket; returns manifest entries."""
    client = s3.client(source)
    files = []
    for path, size in sizes.items():
        data = hashlib.sha256(f"{seed}{path}".encode()).digest() * (size // 32 + 1)
        data = data[:size]
        client.put_object(Bucket=source.bucket, Key=f"{source.prefix}{path}", Body=data)
        files.append({"path": path, "size": size, "sha256": hashlib.sha256(data).hexdigest()})
    return files


def rollout_fleet(stores: dict[str, ObjectStore], source: ObjectStore | None = None) -> dict:
    accounts = [{"name": "acct-a", "provider": "lambda", "credentials": {"env": "SIM_A_KEY"}}]
    sites = []
    for name in ("site-a", "site-b", "site-c"):
        site = {"name": name, "provider": "lambda", "account": "acct-a", "region": "r", "gpu": "H100",
                "gpu_memory_gb": 80, "gpus_per_machine": 8, "instance_type": "gpu_8x_h100",
                "price_per_gpu_hour": 2.5, "max_nodes": 8,
                "sim": {"capacity": 8, "quota": 8, "api_latency_ms": 0, "boot_seconds": 0.1}}
        if name in stores:
            site["object_store"] = stores[name].model_dump(mode="json", exclude_none=True)
        sites.append(site)
    fleet = {"mode": "sim", "accounts": accounts, "sites": sites}
    if source is not None:  # the manifest names it: weights.source.store = "source"
        fleet["object_stores"] = {"source": source.model_dump(mode="json", exclude_none=True)}
    return fleet


def add_node(env: FleetEnv, site: str, gpus: int = 8) -> str:
    name, machine = f"{site}-n{uuid.uuid4().hex[:4]}", f"m-{uuid.uuid4().hex[:6]}"
    env.cluster.create_join_token(name, machine, 600)
    token = env.world.take_bootstrap_token(machine)
    env.cluster.register_with_token(machine, token, boot_id="boot-1", gpus=gpus)
    env.cluster.label_node(name, {LABEL_SITE: site})
    return name


@dataclass
class RolloutStack(Stack):
    env: FleetEnv | None = None
    s3: MotoS3 | None = None
    source: ObjectStore | None = None
    stores: dict[str, ObjectStore] = field(default_factory=dict)
    files: list[dict] = field(default_factory=list)

    @property
    def probe(self) -> SimProbe:
        return SimProbe(self.world, self.cluster)

    def serve_v1(self, sites: list[str]) -> None:
        for site in sites:
            self.cluster.apply_serving(ServingSpec(model=MODEL, site=site, image="img:v1", replicas=2))

    def image(self, site: str) -> str | None:
        status = self.cluster.serving_status(MODEL, site)
        return status.image if status else None

    def request(self, sites: dict[str, int], version: str = "v2", **strategy: Any) -> dict:
        gate = {"probe_requests": 5, "bake_seconds": 0.2, "ready_timeout_seconds": 10,
                **strategy.pop("gate", {})}
        return {
            "model": MODEL, "version": version, "image": f"img:{version}", "args": ["--max-model-len", "4096"],
            "weights": {"source": {"store": "source"}, "files": [dict(f) for f in self.files]},
            "sites": [{"site": s, "replicas": r} for s, r in sites.items()],
            "strategy": {"gate": gate, "evacuation_poll_seconds": 0.2, **strategy},
            "replication": {"part_size_bytes": 64 * 1024, "chunk_size_bytes": 16 * 1024, "heartbeat_seconds": 5},
        }

    def end_evacuation(self, sites: list[str]) -> None:
        """An evacuation ends: its restore of ``sites``' routes, and (without waiting out the Routing
        entity's next sample) the model's routes as that entity writes them."""
        self.cluster.set_site_routes({s: SiteRoute(weight=100) for s in sites})
        table = self.cluster.get_routing(MODEL)
        if table is not None:
            routes = {**table.sites, **{s: SiteRoute(weight=100) for s in sites}}
            self.cluster.set_routing_weights(MODEL, {s: r.weight for s, r in routes.items()},
                                             healthy={s: r.healthy for s, r in routes.items()},
                                             draining={s: r.draining for s, r in routes.items()},
                                             incident={s: r.incident for s, r in routes.items()})

    async def start(self, raw: dict, suffix: str | None = None):
        wid = f"rollout/{raw.get('model')}/{raw.get('version')}-{suffix or uuid.uuid4().hex[:6]}"
        return await self.client.start_workflow("ModelRollout", raw, id=wid, task_queue=self.settings.task_queue)


@pytest.fixture
async def rollout_stack(temporal_env, tmp_path: Path, moto_s3: MotoS3, request) -> AsyncIterator[RolloutStack]:
    """Parametrized indirectly, the fleet config's ``models:`` (none otherwise)."""
    async with open_rollout_stack(temporal_env, tmp_path, moto_s3, getattr(request, "param", {})) as stack:
        yield stack


@pytest.fixture(scope="module")
async def can_env() -> AsyncIterator[WorkflowEnvironment]:
    """A dev server of its own that suggests continue-as-new after 50 events (the real one after
    4,096): a rollout is told to continue as new once its canary is done."""
    async with server_suggesting_continue_as_new(50) as env:
        yield env


@pytest.fixture
async def continuing_rollout_stack(can_env, tmp_path: Path, moto_s3: MotoS3) -> AsyncIterator[RolloutStack]:
    async with open_rollout_stack(can_env, tmp_path, moto_s3, {}) as stack:
        yield stack


@asynccontextmanager
async def open_rollout_stack(temporal_env: WorkflowEnvironment, tmp_path: Path, moto_s3: MotoS3,
                             models: dict) -> AsyncIterator[RolloutStack]:
    source = moto_s3.bucket(moto_s3.store(0))
    stores = {"site-a": moto_s3.bucket(moto_s3.store(0, checksum_verification="read-back")),
              "site-b": moto_s3.bucket(moto_s3.store(1)),
              "site-c": moto_s3.bucket(moto_s3.store(1))}
    settings = make_settings(temporal_env, tmp_path)
    fleet = {**rollout_fleet(stores, source), "models": models}
    (tmp_path / "sites.yaml").write_text(yaml.safe_dump(fleet))
    env = FleetEnv.from_settings(settings)
    for site in stores:
        add_node(env, site)
    files = put_files(moto_s3, source, {"config.json": 2_000, "model-00001.safetensors": 200_000,
                                       "model-00002.safetensors": 150_000})
    stack = RolloutStack(temporal_env.client, settings, env.world, env.cluster, env=env, s3=moto_s3,
                         source=source, stores=stores, files=files)
    async with build_worker(temporal_env.client, settings):
        yield stack
        # The model's Routing entity (told by each site's switch) never ends by itself.
        await terminate_running(temporal_env.client, settings.task_queue)
