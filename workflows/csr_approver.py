"""CsrApprover (started by the Schedule ``gpufleet-csr-approver``): one pass of gpufleet's
kubelet CSR approver.

Joins and repairs run the approver while they wait for a kubelet, but a kubelet also asks
on its own: it renews its client certificate (as ``system:node:<name>``) before it expires
and asks for a serving certificate. Nothing else approves those for gpufleet's nodes (its
token group is bound to no auto-approval), so without a timer a fleet that is not joining
or repairing would lose its kubelets when their certificates lapse. A Schedule bounds the
wait (its interval, overlap SKIP); a Schedule rather than a long-running loop because each
pass is a short, independent workflow with nothing to carry, visible and pausable in the UI.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from fleet.messages.csr import CsrApproverInput, CsrApproverResult
    from workflows.inputs import parse_input
    from workflows.steps import CLUSTER_RETRY, show_details


@workflow.defn(name="CsrApprover")
class CsrApprover:
    @workflow.run
    async def run(self, raw: Any = None) -> CsrApproverResult:
        parse_input(CsrApproverInput, raw or {})
        result: CsrApproverResult = await workflow.execute_activity(
            "approve_node_csrs", result_type=CsrApproverResult, start_to_close_timeout=timedelta(minutes=2),
            retry_policy=CLUSTER_RETRY, summary="approve or deny pending kubelet CSRs of gpufleet's nodes",
        )
        show_details("done", *(f"- `{v.name}` ({v.requester}): {'approved' if v.approve else 'denied'}, {v.reason}"
                               for v in result.decided[:20]),
                     detail=f"{result.approved} approved, {result.denied} denied")
        return result
