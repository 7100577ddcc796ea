"""``mode: real`` keeps no control-plane state on local disk (issue 13, item 6).

The control-plane worker runs against the wire-level fakes (Lambda Cloud's API, sushy-tools'
Redfish BMCs) and a Kubernetes API server: the real control plane, as the control plane's service
account (tests/realk8s/test_durable_state.py runs ``restarted_control_plane_forgets_nothing``
there). It allocates a rack machine, a Lambda account is revoked and a delete in it is queued;
then the worker stops and a new one starts with an empty state dir and an empty HOME, while the
ProviderAccount entity keeps running. The new worker still refuses the revoked account without a
single call to it, never hands the allocated rack machine out again, and runs the queued delete
once a person says the credentials are rotated.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio import workflow
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.service import RPCError
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.env import FleetEnv
from fleet.messages.capacity import AccountStatus
from fleet.models import AccountState
from fleet.naming import account_workflow_id
from fleet.settings import Settings
from tests.conftest import terminate_running
from tests.providers import harness_lambda, harness_own_dc
from workers.control_plane import build_worker


@workflow.defn(name="TestRunActivity")
class RunActivity:
    """Runs one control-plane activity, once, on the control plane's task queue: what a
    workflow step does, without the rest of the workflow."""

    @workflow.run
    async def run(self, args: dict[str, Any]) -> Any:
        return await workflow.execute_activity(
            args["activity"], args["input"], task_queue=args["queue"],
            start_to_close_timeout=timedelta(seconds=60), retry_policy=RetryPolicy(maximum_attempts=1),
        )


def _fleet(suffix: str, lambda_url: str) -> dict[str, Any]:
    machines = [{"name": s["name"], "bmc_url": "BMC", "system_id": s["uuid"]} for s in harness_own_dc.SYSTEMS]
    return {
        "mode": "real",
        "accounts": [
            {"name": f"lam-{suffix}", "provider": "lambda", "credentials": {"env": harness_lambda.CREDENTIALS_ENV},
             "options": {"api_base": lambda_url, "ssh_key_names": ["gpufleet"], "timeout": 5}},
            {"name": f"dc-{suffix}", "provider": "own-dc", "credentials": {"env": harness_own_dc.CREDENTIALS_ENV},
             "options": {"machines": machines, "timeout": 10}},
        ],
        "sites": [
            {"name": f"lambda-{suffix}", "provider": "lambda", "account": f"lam-{suffix}", "region": "us-east-1",
             "gpu": "H100", "gpu_memory_gb": 80, "gpus_per_machine": 8, "instance_type": "gpu_8x_h100_sxm5",
             "price_per_gpu_hour": 2.99, "max_nodes": 4},
            {"name": f"rack-{suffix}", "provider": "own-dc", "account": f"dc-{suffix}", "region": "fra1",
             "gpu": "H100", "gpu_memory_gb": 80, "gpus_per_machine": 8, "instance_type": "hgx-h100",
             "price_per_gpu_hour": 1.10, "capacity_type": "owned", "max_nodes": 3},
        ],
    }


def _spec(site: str, name: str, instance_type: str, region: str, capacity_type: str = "on-demand") -> dict:
    return {"name": name, "site": site, "region": region, "instance_type": instance_type, "gpu": "H100",
            "gpus": 8, "capacity_type": capacity_type}


def _files(*dirs: Path) -> list[Path]:
    return sorted(p for d in dirs for p in d.rglob("*") if p.is_file())


async def restarted_control_plane_forgets_nothing(
    temporal_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, kubeconfig: Path,
) -> None:
    """The test, with ``kubeconfig`` for the Kubernetes API server the workers use."""
    client = temporal_env.client
    lam = harness_lambda.shared_fake(request.config)
    lam.reset()
    bmc = harness_own_dc.shared_bmc(request.config)
    bmc.reset()
    monkeypatch.setenv(harness_lambda.CREDENTIALS_ENV, harness_lambda.SECRET)
    monkeypatch.setenv(harness_own_dc.CREDENTIALS_ENV, harness_own_dc.SECRET)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))

    suffix = uuid.uuid4().hex[:6]
    fleet = _fleet(suffix, lam.url)
    for machine in fleet["accounts"][1]["options"]["machines"]:
        machine["bmc_url"] = bmc.url
    fleet["accounts"][1]["options"]["seed_dir"] = str(tmp_path / "seeds")  # a config without it is refused
    config = tmp_path / "sites.yaml"
    config.write_text(yaml.safe_dump(fleet))
    lam_site, rack_site = f"lambda-{suffix}", f"rack-{suffix}"
    lam_account = f"lam-{suffix}"
    queue = f"gpufleet-durable-{suffix}"
    driver_queue = f"{queue}-driver"

    def control_plane(n: int) -> tuple[Worker, list[Path]]:
        """A control-plane worker as a fresh pod starts it: its own empty state dir and HOME."""
        state, home = tmp_path / f"state-{n}", tmp_path / f"home-{n}"
        state.mkdir()
        home.mkdir()
        monkeypatch.setenv("HOME", str(home))
        settings = Settings(address=client.service_client.config.target_host, task_queue=queue,
                            state_dir=state, config=str(config))
        return build_worker(client, settings, FleetEnv.from_settings(settings)), [state, home]

    async def run(activity: str, payload: dict[str, Any]) -> Any:
        return await client.execute_workflow(
            RunActivity.run, {"activity": activity, "input": payload, "queue": queue},
            id=f"durable-{activity}-{uuid.uuid4().hex[:8]}", task_queue=driver_queue,
        )

    async def provision(site: str, spec: dict, key: str) -> dict:
        """A join's machine (its token issued, its user data handed over), as NodeJoin buys it."""
        provisioned = await run("provision_joining_machine", {"site": site, "spec": spec, "idempotency_key": key})
        return provisioned["machine"]

    async def refused(activity: str, payload: dict[str, Any]) -> str:
        with pytest.raises(WorkflowFailureError) as failure:
            await run(activity, payload)
        return getattr(failure.value.cause.cause, "type", "")

    def lambda_spec(name: str) -> dict:
        return _spec(lam_site, name, "gpu_8x_h100_sxm5", "us-east-1")

    def rack_spec(name: str) -> dict:
        return _spec(rack_site, name, "hgx-h100", "fra1", "owned")

    entity = client.get_workflow_handle(account_workflow_id("lambda", lam_account))

    async def entity_state(state: AccountState) -> None:
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            try:
                if (await entity.query("status", result_type=AccountStatus)).state == state:
                    return
            except RPCError:
                pass  # not started yet
            assert asyncio.get_running_loop().time() < deadline, f"account never became {state}"
            await asyncio.sleep(0.1)

    driver = Worker(client, task_queue=driver_queue, workflows=[RunActivity],
                    workflow_runner=UnsandboxedWorkflowRunner())
    async with driver:
        try:
            # -- the first pod ----------------------------------------------------------------
            first, first_dirs = control_plane(1)
            async with first:
                doomed = await provision(lam_site, lambda_spec(f"gpu-l1-{suffix}"), f"k-l1-{suffix}")
                racked = await provision(rack_site, rack_spec(f"gpu-r1-{suffix}"), f"k-r1-{suffix}")
                # The Lambda key is revoked; a workflow meets it and reports it.
                monkeypatch.setenv(harness_lambda.CREDENTIALS_ENV, "secret_revoked-key")
                await run("report_account", {"account": lam_account, "kind": "BadCredentials",
                                             "message": "401 invalid API key"})
                await entity_state(AccountState.CREDENTIALS_REVOKED)
                # Deleting a machine of the revoked account queues the delete: no call.
                calls = len(lam.requests)
                await run("delete_machine", {"site": lam_site, "machine_id": doomed["id"]})
                assert len(lam.requests) == calls
                assert [i["id"] for i in lam.live_instances()] == [doomed["id"]]

            # Nothing of it was written to the pod's disk.
            assert _files(*first_dirs) == []

            # -- the pod is replaced: a new worker, an empty disk; the entity ran on meanwhile --
            second, second_dirs = control_plane(2)
            async with second:
                calls = len(lam.requests)
                # Still revoked: refused before any call to the account.
                assert await refused("provision_joining_machine", {
                    "site": lam_site, "spec": lambda_spec(f"gpu-l2-{suffix}"), "idempotency_key": f"k-l2-{suffix}",
                }) == "BadCredentials"
                assert len(lam.requests) == calls

                # The rack machine allocated by the first pod is not handed out again...
                other = await provision(rack_site, rack_spec(f"gpu-r2-{suffix}"), f"k-r2-{suffix}")
                assert other["id"] != racked["id"]
                # ...and the first allocation's key still finds its machine.
                again = await provision(rack_site, rack_spec(f"gpu-r1-{suffix}"), f"k-r1-{suffix}")
                assert again["id"] == racked["id"]

                # A person rotates the key: the entity checks it and runs the queued delete.
                monkeypatch.setenv(harness_lambda.CREDENTIALS_ENV, harness_lambda.SECRET)
                status = await entity.execute_update("credentials_rotated", result_type=AccountStatus)
                assert status.state == AccountState.HEALTHY
                assert lam.live_instances() == []
                terminates = [r for r in lam.requests if r[1].endswith("/instance-operations/terminate")]
                assert [r[2]["instance_ids"] for r in terminates] == [[doomed["id"]]]

                for machine in (racked, other):
                    await run("delete_machine", {"site": rack_site, "machine_id": machine["id"]})
                for machine in (doomed, racked, other):  # their joins end here: no token stays behind
                    await run("revoke_node_tokens", {"node_name": machine["name"]})
                await terminate_running(client, queue)
            assert _files(*second_dirs) == []
        finally:
            await terminate_running(client, queue)


def test_the_manifests_keep_no_state_on_an_empty_dir() -> None:
    """An emptyDir dies with its pod: the control plane may use one only as scratch (/tmp)."""
    deploy = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
    workloads = [d for f in sorted(deploy.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
                 if d and d.get("kind") in ("Deployment", "StatefulSet", "DaemonSet")]
    assert {w["metadata"]["name"] for w in workloads} >= {"gpufleet-control-plane"}
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        scratch = {v["name"] for v in pod.get("volumes") or [] if "emptyDir" in v}
        for container in pod["containers"] + pod.get("initContainers", []):
            for mount in container.get("volumeMounts") or []:
                if mount["name"] in scratch:
                    assert mount["mountPath"] == "/tmp", (workload["metadata"]["name"], mount)
            env = {e["name"] for e in container.get("env") or []}
            assert "GPUFLEET_STATE_DIR" not in env, workload["metadata"]["name"]
