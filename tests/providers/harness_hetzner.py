"""``hetzner_harness``: the Hetzner adapter pointed at a local fake Hetzner API."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from fleet.config import Account, Site
from fleet.models import CredentialsRef, MachineSpec
from providers.hetzner import HetznerProvider
from tests.providers.fake_hetzner import FakeHetzner, server_type
from tests.providers.harness import Harness

TOKEN_ENV = "GPUFLEET_TEST_HCLOUD_TOKEN"
SERVER_TYPE = "gx-l40s-1"


def make_site(**overrides: object) -> Site:
    values: dict[str, object] = dict(
        name="hetzner-fsn1",
        provider="hetzner",
        account="hetzner-main",
        region="fsn1",
        gpu="L40S",
        gpus_per_machine=1,
        gpu_memory_gb=48,
        instance_type=SERVER_TYPE,
        price_per_gpu_hour=1.25,
        max_nodes=4,
    )
    values.update(overrides)
    return Site.model_validate(values)


def make_account(endpoint: str, **options: object) -> Account:
    return Account(
        name="hetzner-main",
        provider="hetzner",
        credentials=CredentialsRef(env=TOKEN_ENV),
        options={"api_endpoint": endpoint, "poll_interval_s": 0.01, "action_wait_s": 5, "timeout_s": 5, **options},
    )


def default_server_types() -> list[dict]:
    return [
        server_type(101, SERVER_TYPE, cores=16, memory=128.0, disk=960, sold_in={"fsn1": True, "nbg1": False}),
        server_type(102, "ccx63", cores=48, memory=192.0, disk=960, sold_in={"fsn1": True, "hel1": True}),
    ]


@dataclass
class HetznerHarness:
    provider: HetznerProvider
    spec: MachineSpec
    fake: FakeHetzner
    token: str
    #: A well-formed id the fake does not know.
    unknown_id: str = "999999"

    @property
    def secret(self) -> str:
        """The credential the adapter reads; must never show up in models or errors."""
        return self.token

    def fail_next_create(self, kind: str) -> None:
        self.fake.fail_next("POST /servers", kind)

    def machine_count(self) -> int:
        return len(self.fake.live_servers())


@pytest.fixture
def hetzner_harness(monkeypatch: pytest.MonkeyPatch) -> Iterator[HetznerHarness]:
    token = "hcloud-" + secrets.token_hex(16)
    monkeypatch.setenv(TOKEN_ENV, token)
    fake = FakeHetzner(token, default_server_types()).start()
    site = make_site()
    provider = HetznerProvider(site, make_account(fake.url))
    spec = MachineSpec(
        name="gpu-hetzner-1",
        site=site.name,
        region=site.region,
        instance_type=site.instance_type,
        gpu=site.gpu,
        gpus=site.gpus_per_machine,
        tags={"gpufleet.io/pool": "default"},
    )
    harness = HetznerHarness(provider=provider, spec=spec, fake=fake, token=token)
    try:
        assert isinstance(harness, Harness)
        yield harness
    finally:
        fake.stop()
