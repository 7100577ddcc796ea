"""Lambda Cloud harness: the real adapter and httpx against ``FakeLambdaCloud``."""

from __future__ import annotations

import threading
import uuid

import pytest

from fleet.config import Account, Site
from fleet.models import CredentialsRef, MachineSpec
from providers.lambda_cloud import LambdaProvider
from tests.providers.fake_lambda import FakeLambdaCloud

SECRET = "secret_gpufleet-test_5f3c1e0f9a2b4d6e8c7a1b2c3d4e5f60.0a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d"
CREDENTIALS_ENV = "GPUFLEET_TEST_LAMBDA_API_KEY"

_started: dict[str, FakeLambdaCloud] = {}
_guard = threading.Lock()


def shared_fake(config: pytest.Config) -> FakeLambdaCloud:
    """One fake per test session, stopped when the session ends."""
    with _guard:
        if "fake" not in _started:
            fake = FakeLambdaCloud(api_key=SECRET).start()
            _started["fake"] = fake

            def stop() -> None:
                fake.stop()
                _started.pop("fake", None)

            config.add_cleanup(stop)
        return _started["fake"]


class LambdaHarness:
    error_kinds = ("NoCapacity", "OverQuota", "BadCredentials", "Transient", "InvalidRequest")
    secret = SECRET
    unknown_id = "0920582c7ff041399e34823a0be62549"

    def __init__(self, fake: FakeLambdaCloud, **options: object) -> None:
        self.fake = fake
        suffix = uuid.uuid4().hex[:6]
        self.site = Site(
            name=f"lambda-us-east-1-{suffix}",
            provider="lambda",
            account="lambda-main",
            region="us-east-1",
            gpu="H100",
            gpus_per_machine=8,
            gpu_memory_gb=80,
            instance_type="gpu_8x_h100_sxm5",
            price_per_gpu_hour=2.99,
            max_nodes=4,
        )
        self.account = Account(
            name="lambda-main",
            provider="lambda",
            credentials=CredentialsRef(env=CREDENTIALS_ENV),
            options={"api_base": fake.url, "ssh_key_names": ["gpufleet"], "timeout": 5, **options},
        )
        self.provider = LambdaProvider(self.site, self.account)
        self.spec = MachineSpec(
            name=f"gpu-lambda-{suffix}",
            site=self.site.name,
            region=self.site.region,
            instance_type=self.site.instance_type,
            gpu="H100",
            gpus=8,
        )

    def fail_next_create(self, kind: str) -> None:
        self.fake.fail_next(kind)

    def machine_count(self) -> int:
        return len(self.fake.live_instances())


@pytest.fixture
def lambda_harness(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> LambdaHarness:
    fake = shared_fake(request.config)
    fake.reset()
    monkeypatch.setenv(CREDENTIALS_ENV, SECRET)
    return LambdaHarness(fake)
