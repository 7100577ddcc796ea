"""gpufleet's CSR approver (issues 24, 37) on the real control plane: the Schedule
``gpufleet-csr-approver`` starts ``CsrApprover`` in ``mode: real``: a pass, then a watch on CSRs
that wakes it for each new one (the Schedule's pass is only the safety sweep).

kubeadm's auto-approve bindings are removed here (as ``gpufleet cluster check`` advises, and as
many managed control planes never had them): nothing but gpufleet approves a renewal, so what is
approved below, gpufleet's approver approved. A kubelet-serving CSR is never auto-approved,
kubeadm or not. The node is a Node object the admin writes under a join's identity record (its
machine provisioned at Lambda Cloud's fake, which reports its addresses); its kubelet's CSRs are
made *as* ``system:node:<name>`` (the admin impersonates it), so the real API server writes
their requester. The approver runs as the control plane's service account.

Moved from tests/providers/test_csr_approver_real.py, which ran it against the fake API server.
"""

from __future__ import annotations

import asyncio
import base64
import uuid

from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from fleet.cluster import NODE_IDENTITY_KIND, NodeIdentity
from fleet.messages.csr import CsrApproverResult
from fleet.schedules import SCHEDULES, build_schedule
from fleet.settings import Settings
from providers.cluster.base import CLIENT_SIGNER, SERVING_SIGNER
from tests.cluster.sim_kubelet import csr_pem
from tests.conftest import wait_for
from tests.realk8s.cluster import RealCluster
from tests.realk8s.test_adapter_objects import CSRS, csrs, nodes  # noqa: F401 - fixtures
from tests.realk8s.test_blast_radius import kubeadm_bindings_restored  # noqa: F401 - a fixture
from tests.realk8s.test_join import RealJoining
from tests.replay import replay_and_record
from workers.control_plane import build_worker


def as_node(real: RealCluster, node: str, subject: str, signer: str = CLIENT_SIGNER, ips: list[str] = ()) -> str:
    """A CSR the node's kubelet sends (a client renewal, or a serving certificate for ``ips``)."""
    status, answer, name = post_as_node(real, node, subject, signer, ips)
    assert status == 201, answer
    return name


def post_as_node(real: RealCluster, node: str, subject: str, signer: str = CLIENT_SIGNER,
                 ips: list[str] = ()) -> tuple[int, dict, str]:
    name = f"csr-{uuid.uuid4().hex[:8]}"
    usages = ["digital signature", "server auth"] if signer == SERVING_SIGNER else ["digital signature", "client auth"]
    request = csr_pem(f"system:node:{subject}", ["system:nodes"], ips=list(ips),
                      dns=[subject] if signer == SERVING_SIGNER else [])
    status, answer = real.request("POST", CSRS, {
        "apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest", "metadata": {"name": name},
        "spec": {"request": base64.b64encode(request).decode(), "signerName": signer, "usages": usages}},
        admin=True, headers={"Impersonate-User": f"system:node:{node}", "Impersonate-Group": "system:nodes"})
    return status, answer, name


async def scheduled_pass(client, task_queue: str) -> WorkflowHandle:
    """Trigger the approver's Schedule (as defined by fleet/schedules.py) once; its run."""
    schedule_id = f"test-csr-approver-{uuid.uuid4().hex[:8]}"
    handle = await client.create_schedule(schedule_id, build_schedule("gpufleet-csr-approver", task_queue, 3600))
    try:
        await handle.trigger()

        async def started():
            return (await handle.describe()).info.recent_actions

        deadline = asyncio.get_running_loop().time() + 20
        while not (actions := await started()):
            assert asyncio.get_running_loop().time() < deadline, "the schedule started nothing"
            await asyncio.sleep(0.2)
        action = actions[0].action
        return client.get_workflow_handle(action.workflow_id, run_id=action.first_execution_run_id)
    finally:
        await handle.delete()


async def test_the_scheduled_pass_approves_a_renewal_and_denies_a_foreign_address(
        lambda_harness, tmp_path, temporal_env, real_cluster, nodes, csrs) -> None:  # noqa: F811
    assert SCHEDULES["gpufleet-csr-approver"][0] == "CsrApprover"
    one = RealJoining(lambda_harness, tmp_path, real_cluster)
    try:
        provisioned = await asyncio.to_thread(one.provision)
        machine = lambda_harness.provider.get_machine(provisioned.machine.id)
        node = nodes(one.node_name, provider_id=provisioned.provider_id)
        site = one.site
        identity = NodeIdentity(node_name=node, machine_id=provisioned.machine.id, provider=site.provider,
                                account=site.account, site=site.name, provider_id=provisioned.provider_id,
                                join_id=one.join_id)
        one.cluster.update_state(NODE_IDENTITY_KIND, node, lambda _old: identity.state())

        own = as_node(real_cluster, node, node)
        # A renewal for another node's name: the real API server's NodeRestriction refuses a node's
        # CSR for a name not its own before any approver sees it (the fake accepted it).
        status, answer, _ = post_as_node(real_cluster, node, "someone-elses-node")
        assert status == 403 and "can only create a node CSR with CN=system:node:" in answer["message"], answer
        # What a node can still ask that gpufleet must deny: a serving certificate for an address
        # the provider does not report for its machine.
        other = as_node(real_cluster, node, node, SERVING_SIGNER, ips=["198.51.100.99"])
        serving = as_node(real_cluster, node, node, SERVING_SIGNER, ips=[a for a in machine.addresses if "/" not in a])
        csrs.extend([own, other, serving])

        def decided() -> dict[str, dict]:
            _, listed = real_cluster.request("GET", CSRS, admin=True)
            return {c["metadata"]["name"]: c for c in listed["items"]}

        assert not any(decided()[n].get("status", {}).get("conditions") for n in (own, other, serving)), \
            "nobody decided yet"

        settings = Settings(address=temporal_env.client.service_client.config.target_host,
                            task_queue=f"gpufleet-test-{uuid.uuid4().hex[:8]}", state_dir=tmp_path)
        async with build_worker(temporal_env.client, settings, one.env):
            run = await scheduled_pass(temporal_env.client, settings.task_queue)
            await wait_for(lambda: all(decided()[n].get("status", {}).get("conditions") for n in (own, other, serving)),
                           timeout=30)
            # The run goes on watching: a renewal posted now is approved within seconds, by the
            # watch (the Schedule's safety sweep is ten minutes away, and its run is still this one).
            later = as_node(real_cluster, node, node)
            csrs.append(later)
            await wait_for(lambda: decided()[later].get("status", {}).get("conditions"), timeout=20)
            # The pass that decided it has reported to the run: a pass still in flight when the run
            # is cancelled is cancelled too, and its decisions are on their CSRs, not in the result
            # (a CI run cancelled in that moment and missed ``later`` in the result).
            await _reported(run, later)
            assert (await run.describe()).status == WorkflowExecutionStatus.RUNNING
            await run.cancel()  # a cancelled approver ends with what it decided
            result = CsrApproverResult.model_validate(await asyncio.wait_for(run.result(), 30))

        verdicts = {v.name: v for v in result.decided}
        assert set(verdicts) >= {own, other, serving, later}
        assert verdicts[own].approve and verdicts[serving].approve and verdicts[later].approve
        assert not verdicts[other].approve and "198.51.100.99" in verdicts[other].reason
        assert verdicts[own].requester == f"system:node:{node}"
        # Issued by the real signer, for what gpufleet approved only.
        def issued() -> dict[str, dict] | None:
            d = decided()
            return d if d[own]["status"].get("certificate") and d[serving]["status"].get("certificate") else None

        found = await wait_for(issued, timeout=20)
        assert [c["reason"] for c in found[own]["status"]["conditions"]] == ["GpufleetApproved"]
        assert [c["type"] for c in found[other]["status"]["conditions"]] == ["Denied"]
        assert "certificate" not in found[other]["status"]
        assert [c["reason"] for c in found[later]["status"]["conditions"]] == ["GpufleetApproved"]
        await replay_and_record(run, "csr_approver_watch")
    finally:
        one.stop()


async def _reported(run: WorkflowHandle, csr_name: str, timeout: float = 20) -> None:
    """Until a completed ``approve_node_csrs`` in the run's history names ``csr_name``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        passes = set()  # the scheduled event ids of approve_node_csrs (a watch's result names CSRs too)
        async for event in run.fetch_history_events():
            if event.HasField("activity_task_scheduled_event_attributes"):
                if event.activity_task_scheduled_event_attributes.activity_type.name == "approve_node_csrs":
                    passes.add(event.event_id)
            elif event.HasField("activity_task_completed_event_attributes"):
                done = event.activity_task_completed_event_attributes
                if done.scheduled_event_id in passes and any(csr_name.encode() in p.data for p in done.result.payloads):
                    return
        assert asyncio.get_running_loop().time() < deadline, f"no pass reported {csr_name} to the run"
        await asyncio.sleep(0.2)
