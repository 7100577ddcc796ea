"""The Advisor in ``mode: real``: the control-plane worker against Lambda Cloud's wire-level
fake and the fake Kubernetes API server. The usage ledger lives in ConfigMaps; the
Advisor reads them and lists offers, and sends no write request to either."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import yaml

from activities.env import FleetEnv
from activities.ledger import UsageLedger
from fleet.messages.advisor import AdvisorReport, LedgerEntry
from fleet.settings import Settings
from tests.cluster.fake_apiserver import FakeKube
from tests.conftest import terminate_running
from tests.providers import harness_lambda
from workers.control_plane import build_worker

H = 3600.0
KUBE_WRITES = {"create", "update", "patch", "delete", "deletecollection"}


async def test_the_advisor_makes_no_write_request_in_real_mode(
    temporal_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
) -> None:
    client = temporal_env.client
    lam = harness_lambda.shared_fake(request.config)
    lam.reset()
    kube = FakeKube().start()
    request.addfinalizer(kube.stop)
    monkeypatch.setenv(harness_lambda.CREDENTIALS_ENV, harness_lambda.SECRET)
    monkeypatch.setenv("KUBECONFIG", kube.kubeconfig(tmp_path / "kubeconfig"))
    suffix = uuid.uuid4().hex[:6]
    site = f"lambda-{suffix}"
    config = tmp_path / "sites.yaml"
    config.write_text(yaml.safe_dump({
        "mode": "real",
        "accounts": [{"name": f"lam-{suffix}", "provider": "lambda",
                      "credentials": {"env": harness_lambda.CREDENTIALS_ENV},
                      "options": {"api_base": lam.url, "ssh_key_names": ["gpufleet"], "timeout": 5}}],
        "sites": [{"name": site, "provider": "lambda", "account": f"lam-{suffix}", "region": "us-east-1",
                   "gpu": "H100", "gpu_memory_gb": 80, "gpus_per_machine": 8, "instance_type": "gpu_8x_h100_sxm5",
                   "price_per_gpu_hour": 2.99, "max_nodes": 4}],
    }))
    settings = Settings(address=client.service_client.config.target_host, task_queue=f"advisor-real-{suffix}",
                        state_dir=tmp_path / "state", config=str(config))
    env = FleetEnv.from_settings(settings)
    until = time.time()
    # What the join activities write in real mode: a ConfigMap per site and month.
    UsageLedger(env.cluster).joined(LedgerEntry(
        machine_id="0920582c7ff041399e34823a0be62549", site=site, offer="gpu_8x_h100_sxm5", gpu="H100", gpus=8,
        gpu_memory_gb=80, price_per_gpu_hour=2.99, joined_at=until - 2 * H))

    async with build_worker(client, settings, env):
        try:
            lam_before, kube_before = len(lam.requests), len(kube.requests)
            report = await client.execute_workflow(
                "Advisor", {"since": "1d", "until": until}, id=f"advisor/1d-real-{suffix}",
                task_queue=settings.task_queue, result_type=AdvisorReport)
            lam_seen, kube_seen = lam.requests[lam_before:], kube.requests[kube_before:]
        finally:
            await terminate_running(client, settings.task_queue)

    [workload] = report.workloads
    assert (workload.gpu_hours, workload.now) == (16.0, round(16 * 2.99, 2))
    assert lam_seen, "the catalog was listed at the provider"
    assert [r for r in lam_seen if r[0] != "GET"] == [], "a write request to Lambda Cloud"
    assert kube_seen and [r for r in kube_seen if r[0] in KUBE_WRITES] == [], "a write request to Kubernetes"
