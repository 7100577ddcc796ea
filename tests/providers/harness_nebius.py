"""``nebius_harness``: the Nebius adapter pointed at a local fake Nebius gRPC API."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from fleet.config import Account, Site
from fleet.models import CredentialsRef, MachineSpec
from providers.nebius import NebiusProvider
from tests.providers.fake_nebius import FakeNebius, platform
from tests.providers.harness import Harness

TOKEN_ENV = "GPUFLEET_TEST_NEBIUS_TOKEN"
PROJECT = "project-e00gpufleettest"
SUBNET = "vpcsubnet-e00gpufleettest"
INSTANCE_TYPE = "gpu-h100-sxm.8gpu-128vcpu-1600gb"


def make_site(**overrides: object) -> Site:
    values: dict[str, object] = dict(
        name="nebius-eu-north",
        provider="nebius",
        account="nebius-main",
        region="eu-north1",
        gpu="H100",
        gpus_per_machine=8,
        gpu_memory_gb=80,
        instance_type=INSTANCE_TYPE,
        price_per_gpu_hour=2.95,
        max_nodes=8,
    )
    values.update(overrides)
    return Site.model_validate(values)


def make_account(address: str, **options: object) -> Account:
    return Account(
        name="nebius-main",
        provider="nebius",
        credentials=CredentialsRef(env=TOKEN_ENV),
        options={
            "address": address,
            "insecure": True,
            "parent_id": PROJECT,
            "subnet_id": SUBNET,
            "poll_interval_s": 0.02,
            "operation_wait_s": 10,
            "request_timeout_s": 10,
            **options,
        },
    )


def default_platforms() -> list:
    return [
        platform("gpu-h100-sxm", {"1gpu-16vcpu-200gb": 1, "8gpu-128vcpu-1600gb": 8}, 80),
        platform("gpu-l40s-a", {"1gpu-8vcpu-32gb": 1}, 48, preemptible=False),
        platform("cpu-d3", {"4vcpu-16gb": 0}, 0),
    ]


@dataclass
class NebiusHarness:
    provider: NebiusProvider
    spec: MachineSpec
    fake: FakeNebius
    token: str
    #: A well-formed id the fake does not know.
    unknown_id: str = "computeinstance-e00doesnotexist"

    @property
    def secret(self) -> str:
        """The credential the adapter reads; must never show up in models or errors."""
        return self.token

    def fail_next_create(self, kind: str) -> None:
        self.fake.fail_next("Create", kind)

    def machine_count(self) -> int:
        return len(self.fake.live_instances())


@pytest.fixture
def nebius_harness(monkeypatch: pytest.MonkeyPatch) -> Iterator[NebiusHarness]:
    token = "ne1-" + secrets.token_hex(24)
    monkeypatch.setenv(TOKEN_ENV, token)
    fake = FakeNebius(token, PROJECT, default_platforms()).start()
    site = make_site()
    provider = NebiusProvider(site, make_account(fake.address))
    spec = MachineSpec(
        name="gpu-nebius-1",
        site=site.name,
        region=site.region,
        instance_type=site.instance_type,
        gpu=site.gpu,
        gpus=site.gpus_per_machine,
        tags={"gpufleet.io/pool": "default"},
    )
    harness = NebiusHarness(provider=provider, spec=spec, fake=fake, token=token)
    try:
        assert isinstance(harness, Harness)
        yield harness
    finally:
        fake.stop()
