"""Input and result of CsrApprover (one pass of gpufleet's kubelet CSR approver, run by
the Schedule ``gpufleet-csr-approver``)."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from fleet.models import Strict


class CsrApproverInput(Strict):
    """Nothing to choose: the Schedule starts it with no input (or ``{}``)."""


class CsrVerdict(BaseModel):
    """One CSR the pass decided. The reason names node names and addresses, never a key."""

    name: str
    requester: str
    approve: bool
    reason: str


#: The verdicts a pass (or a run) names: every node's kubelet may create CSRs, a pass may decide
#: thousands, and its result is bounded at 2 MiB. Each decision is also a condition on its CSR.
VERDICTS_NAMED = 100


class CsrApproverResult(BaseModel):
    #: At most ``VERDICTS_NAMED`` of the CSRs decided ...
    decided: list[CsrVerdict] = Field(default_factory=list)
    #: ... and how many were approved and denied in all (a result from before they were counted:
    #: those of ``decided``).
    approved: int = 0
    denied: int = 0

    @model_validator(mode="after")
    def _counted(self) -> "CsrApproverResult":
        if not {"approved", "denied"} & self.model_fields_set:
            self.approved = sum(v.approve for v in self.decided)
            self.denied = len(self.decided) - self.approved
        return self
