"""gpufleet's CSR approver (issues 24, 37): the Schedule ``gpufleet-csr-approver`` starts
``CsrApprover`` in ``mode: real`` against the fake API server: a pass, then a watch on CSRs
that wakes it for each new one (the Schedule's pass is only the safety sweep).

The fake cluster here has no ``selfnodeclient`` binding for ``system:nodes`` (kubeadm
creates one, many managed control planes do not): nothing but gpufleet approves a renewal,
so what is approved below the scheduled pass approved. A kubelet-serving CSR is never
auto-approved, kubeadm or not.
"""

from __future__ import annotations

import asyncio
import base64
import uuid

from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from fleet.messages.csr import CsrApproverResult
from fleet.schedules import SCHEDULES, build_schedule
from fleet.settings import Settings
from tests.cluster.fake_auth import CLIENT_SIGNER, SELFNODECLIENT
from tests.cluster.sim_kubelet import SimKubelet, csr_pem
from tests.conftest import wait_for
from tests.providers.test_join_real import Joining
from tests.replay import replay_and_record
from workers.control_plane import build_worker

CSRS = "/apis/certificates.k8s.io/v1/certificatesigningrequests"


def renewal(kubelet: SimKubelet, subject_node: str) -> str:
    """A client certificate renewal, posted with the node's own certificate."""
    name = f"renew-{uuid.uuid4().hex[:8]}"
    kubelet.call("POST", CSRS, {
        "apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest", "metadata": {"name": name},
        "spec": {"request": base64.b64encode(csr_pem(f"system:node:{subject_node}", ["system:nodes"])).decode(),
                 "signerName": CLIENT_SIGNER, "usages": ["digital signature", "client auth"]}},
        bearer=kubelet.credential)
    return name


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


async def test_the_scheduled_pass_approves_a_renewal_and_denies_another_name(lambda_harness, tmp_path,
                                                                              temporal_env) -> None:
    assert SCHEDULES["gpufleet-csr-approver"][0] == "CsrApprover"
    one = Joining(lambda_harness, tmp_path)
    try:
        one.fake.auth.bindings.remove(("system:nodes", SELFNODECLIENT))
        provisioned = await asyncio.to_thread(one.provision)
        kubelet = one.kubelet(provisioned.machine.id)
        node, outcome = await asyncio.to_thread(one.join_alongside, kubelet, provisioned)
        assert node.ready and "error" not in outcome

        own = await asyncio.to_thread(renewal, kubelet, kubelet.name)
        other = await asyncio.to_thread(renewal, kubelet, "someone-elses-node")
        serving = await asyncio.to_thread(kubelet.request_serving_certificate, kubelet.addresses)
        csrs = lambda: {c["metadata"]["name"]: c for c in one.fake.objects(  # noqa: E731
            "certificates.k8s.io", "certificatesigningrequests")}
        assert not any(csrs()[n]["status"].get("conditions") for n in (own, other, serving)), "nobody decided yet"

        settings = Settings(address=temporal_env.client.service_client.config.target_host,
                            task_queue=f"gpufleet-test-{uuid.uuid4().hex[:8]}", state_dir=tmp_path)
        async with build_worker(temporal_env.client, settings, one.env):
            run = await scheduled_pass(temporal_env.client, settings.task_queue)
            await wait_for(lambda: all(csrs()[n]["status"].get("conditions") for n in (own, other, serving)),
                           timeout=30)
            # The run goes on watching: a renewal posted now is approved within seconds, by the
            # watch (the Schedule's safety sweep is ten minutes away, and its run is still this one).
            later = await asyncio.to_thread(renewal, kubelet, kubelet.name)
            await wait_for(lambda: csrs()[later]["status"].get("conditions"), timeout=20)
            assert (await run.describe()).status == WorkflowExecutionStatus.RUNNING
            await run.cancel()  # a cancelled approver ends with what it decided
            result = CsrApproverResult.model_validate(await asyncio.wait_for(run.result(), 30))

        verdicts = {v.name: v for v in result.decided}
        assert set(verdicts) == {own, other, serving, later}
        assert verdicts[own].approve and verdicts[serving].approve and verdicts[later].approve
        assert not verdicts[other].approve and "someone-elses-node" in verdicts[other].reason
        assert verdicts[own].requester == f"system:node:{kubelet.name}"
        decided = await wait_for(lambda: csrs() if csrs()[own]["status"].get("certificate") else None)
        assert [c["reason"] for c in decided[own]["status"]["conditions"]] == ["GpufleetApproved"]
        assert [c["type"] for c in decided[other]["status"]["conditions"]] == ["Denied"]
        assert "certificate" not in decided[other]["status"]
        assert decided[serving]["status"].get("certificate")
        assert [c["reason"] for c in decided[later]["status"]["conditions"]] == ["GpufleetApproved"]
        # csr_approver_pass.json stays the history of a run from before the watch (one pass).
        await replay_and_record(run, "csr_approver_watch")
    finally:
        one.stop()
