"""Workflow inputs and results. Inputs reject unknown keys so typos fail loudly."""

from __future__ import annotations

from pydantic import BaseModel, Field

from fleet.models import DAY, Strict


class JoinTimeouts(Strict):
    provision_seconds: float = Field(600, gt=0, le=DAY)
    registration_seconds: float = Field(900, gt=0, le=DAY)
    smoke_test_seconds: float = Field(600, gt=0, le=DAY)
    #: How soon a dead worker's activity is noticed and retried elsewhere.
    heartbeat_seconds: float = Field(30, gt=0, le=3600)


class NodeJoinInput(Strict):
    """Start with plain JSON: ``{"site": "lambda-us-east"}``."""

    site: str = Field(min_length=1, max_length=253)
    #: More than one: the join fans out to one child NodeJoin per node.
    count: int = Field(1, ge=1, le=64)
    token_ttl_seconds: int = Field(3600, gt=0, le=3600)
    timeouts: JoinTimeouts = Field(default_factory=JoinTimeouts)


class JoinedNode(BaseModel):
    node_name: str
    machine_id: str
    site: str
    provider: str
    gpus: int
    #: The provider account it was bought in (with site, provider and machine: its identity).
    account: str = ""


class NodeJoinResult(BaseModel):
    nodes: list[JoinedNode]


class JoinProgress(BaseModel):
    step: str
    node_name: str = ""
    machine_id: str = ""
    done: list[str] = Field(default_factory=list)
    #: The step a cancel stopped it at (then ``step`` is ``cancelled``); "" = not cancelled.
    cancelled_while: str = ""
