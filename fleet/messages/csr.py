"""Input and result of CsrApprover (one pass of gpufleet's kubelet CSR approver, run by
the Schedule ``gpufleet-csr-approver``)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from fleet.models import Strict


class CsrApproverInput(Strict):
    """Nothing to choose: the Schedule starts it with no input (or ``{}``)."""


class CsrVerdict(BaseModel):
    """One CSR the pass decided. The reason names node names and addresses, never a key."""

    name: str
    requester: str
    approve: bool
    reason: str


class CsrApproverResult(BaseModel):
    decided: list[CsrVerdict] = Field(default_factory=list)

    @property
    def approved(self) -> int:
        return sum(v.approve for v in self.decided)

    @property
    def denied(self) -> int:
        return sum(not v.approve for v in self.decided)
