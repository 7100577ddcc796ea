"""Input and result of CsrApprover (one pass of gpufleet's kubelet CSR approver, run by
the Schedule ``gpufleet-csr-approver``)."""

from __future__ import annotations

from typing import Iterable, Protocol

from pydantic import BaseModel, Field, model_validator

from fleet.models import Strict
from fleet.routing import shortened


class CsrApproverInput(Strict):
    """Nothing to choose: the Schedule starts it with no input (or ``{}``)."""


class CsrVerdict(BaseModel):
    """One CSR the pass decided. The reason names node names and addresses, never a key."""

    name: str
    requester: str
    approve: bool
    reason: str


#: The verdicts a pass (or a run) names, approvals first: every node's kubelet (or a bootstrap
#: token) may create CSRs at will, a pass may decide thousands, and each pass's result goes into
#: ``CsrApprover``'s history, where a hundred verdicts of 253-character names (some 43 KB a pass)
#: filled it within hours of a flood. Each decision is also a condition on its CSR (and a line in
#: the worker's log), in full; the result counts them all.
VERDICTS_NAMED = 10
#: A listed verdict's name and requester are cut to this (both are the node's to choose, up to
#: 253 characters) ...
VERDICT_NAME_CHARS = 64
#: ... and its reason to this (it may name the node twice): a verdict is some 350 bytes at most.
VERDICT_REASON_CHARS = 200


class Decided(Protocol):
    """A pass's decision on one CSR (``providers.cluster.base.CsrDecision``, a layer above this)."""

    name: str
    requester: str
    approve: bool
    reason: str


def named_verdicts(decisions: Iterable[Decided]) -> list[CsrVerdict]:
    """What a pass's result lists of its decisions: approvals first (the few a flood's denials would
    hide), at most ``VERDICTS_NAMED``, each cut to a few hundred bytes."""
    listed = sorted(decisions, key=lambda d: not d.approve)[:VERDICTS_NAMED]
    return [CsrVerdict(name=shortened(d.name, VERDICT_NAME_CHARS), requester=shortened(d.requester, VERDICT_NAME_CHARS),
                       approve=d.approve, reason=shortened(d.reason, VERDICT_REASON_CHARS)) for d in listed]


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
