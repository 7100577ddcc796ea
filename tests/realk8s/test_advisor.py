"""The Advisor in ``mode: real``: the control-plane worker against Lambda Cloud's wire-level fake
and the real control plane, as the control plane's service account (the shipped RBAC, in a
namespace of the test's own so the ledger it reads is only this test's). The usage ledger lives in
ConfigMaps; the Advisor reads them and lists offers, and sends no write request to either.

Moved from tests/providers/test_advisor_real.py, which ran it against the fake API server."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import yaml

from activities.env import FleetEnv
from activities.ledger import UsageLedger
from fleet.config import load_config
from fleet.messages.advisor import AdvisorReport, LedgerEntry
from fleet.settings import Settings
from providers.cluster.kubernetes import KubernetesCluster
from tests.conftest import terminate_running
from tests.providers import harness_lambda
from tests.realk8s.cluster import RealCluster
from tests.realk8s.contract import bind_serving_role, ensure_namespace
from tests.realk8s.test_adapter import record_requests
from workers.control_plane import build_worker

H = 3600.0
WRITES = {"POST", "PUT", "PATCH", "DELETE"}


async def test_the_advisor_makes_no_write_request_in_real_mode(
    temporal_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
    real_cluster: RealCluster,
) -> None:
    client = temporal_env.client
    lam = harness_lambda.shared_fake(request.config)
    lam.reset()
    monkeypatch.setenv(harness_lambda.CREDENTIALS_ENV, harness_lambda.SECRET)
    suffix = uuid.uuid4().hex[:6]
    namespace = f"advisor-{suffix}"
    ensure_namespace(real_cluster, namespace)
    bind_serving_role(real_cluster, namespace)
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
    token = real_cluster.service_account_token("gpufleet", "gpufleet-control-plane")
    cluster = KubernetesCluster(api_client=real_cluster.api_client(token), namespace=namespace)
    env = FleetEnv(settings, load_config(settings.config), cluster)  # as from_settings makes it, in this namespace
    until = time.time()
    # What the join activities write in real mode: a ConfigMap per site and month.
    UsageLedger(env.cluster).joined(LedgerEntry(
        machine_id="0920582c7ff041399e34823a0be62549", site=site, offer="gpu_8x_h100_sxm5", gpu="H100", gpus=8,
        gpu_memory_gb=80, price_per_gpu_hour=2.99, joined_at=until - 2 * H))
    seen = record_requests(env.cluster)

    try:
        async with build_worker(client, settings, env):
            try:
                lam_before, kube_before = len(lam.requests), len(seen)
                report = await client.execute_workflow(
                    "Advisor", {"since": "1d", "until": until}, id=f"advisor/1d-real-{suffix}",
                    task_queue=settings.task_queue, result_type=AdvisorReport)
                lam_seen, kube_seen = lam.requests[lam_before:], seen[kube_before:]
            finally:
                await terminate_running(client, settings.task_queue)
    finally:
        cluster.api_client.close()
        real_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)

    [workload] = report.workloads
    assert (workload.gpu_hours, workload.now) == (16.0, round(16 * 2.99, 2))
    assert lam_seen, "the catalog was listed at the provider"
    assert [r for r in lam_seen if r[0] != "GET"] == [], "a write request to Lambda Cloud"
    assert kube_seen, "the ledger was read from the API server"
    assert [r for r in kube_seen if r[0] in WRITES] == [], "a write request to Kubernetes"
