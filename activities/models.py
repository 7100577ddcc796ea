"""One input model per activity, so fields can be added without breaking callers."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from fleet.models import GpuHealth, MachineSpec


class ResolveSiteInput(BaseModel):
    site: str


class ProvisionMachineInput(BaseModel):
    site: str
    spec: MachineSpec
    idempotency_key: str


class DeleteMachineInput(BaseModel):
    site: str
    machine_id: str


class IssueJoinTokenInput(BaseModel):
    node_name: str
    machine_id: str
    ttl_seconds: int = Field(3600, gt=0, le=3600)


class RevokeJoinTokenInput(BaseModel):
    token_id: str


class WaitForRegistrationInput(BaseModel):
    node_name: str
    #: Absolute, so a retried attempt keeps the original deadline.
    deadline: datetime
    poll_seconds: float = 1.0


class PrepareNodeInput(BaseModel):
    node_name: str
    labels: dict[str, str]
    add_taints: list[str] = Field(default_factory=list)
    remove_taints: list[str] = Field(default_factory=list)


class RemoveNodeInput(BaseModel):
    node_name: str


class ProbeGpusInput(BaseModel):
    pass


class ProbeResult(BaseModel):
    node_name: str
    boot_id: str
    gpus: list[GpuHealth]


class SmokeTestInput(BaseModel):
    expected_gpus: int = Field(ge=1)


class SmokeResult(BaseModel):
    passed: bool
    gpus_seen: int
    boot_id: str = ""
    failures: list[str] = Field(default_factory=list)
