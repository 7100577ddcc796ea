"""Workflow inputs and results. Inputs reject unknown keys so typos fail loudly."""

from __future__ import annotations

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from fleet.cluster import MAX_JOIN_TOKEN_TTL_S
from fleet.models import DAY, Strict


def _refuse(model: str, field: str, value: float, kind: str, message: str) -> ValidationError:
    """Raised under ``field``: a plain ValueError in a model validator would name only the model."""
    return ValidationError.from_exception_data(model, [{
        "type": PydanticCustomError(kind, message.replace("{", "{{").replace("}", "}}")), "loc": (field,), "input": value,
    }])


#: Validation context key: ``{TOKEN_CHECKS: False}`` leaves out the token checks below. A workflow
#: checks them once, where a person or a client started it (a NodeJoin with no parent, an
#: AcquireCapacity's first run), not in the runs it continues as or the joins it starts, which take
#: the input it checked; everywhere else (the CLI, the client) they apply.
TOKEN_CHECKS = "token_checks"


def _checks_tokens(info: ValidationInfo) -> bool:
    return (info.context or {}).get(TOKEN_CHECKS, True) is not False


class JoinTimeouts(Strict):
    provision_seconds: float = Field(600, gt=0, le=DAY)
    registration_seconds: float = Field(900, gt=0, le=DAY)
    smoke_test_seconds: float = Field(600, gt=0, le=DAY)
    #: How soon a dead worker's activity is noticed and retried elsewhere.
    heartbeat_seconds: float = Field(30, gt=0, le=3600)

    @property
    def until_registered_seconds(self) -> float:
        """The longest a join waits, from its token's issue, for its machine to register with it:
        the machine's create, then the registration wait."""
        return self.provision_seconds + self.registration_seconds

    @property
    def expected_seconds(self) -> float:
        """How long a join runs by its own timeouts, from its start: its machine's create (one
        try), the wait for it to register, the smoke test (the admit after them answers at once).
        A create tried again after a provider's error runs past it."""
        return self.provision_seconds + self.registration_seconds + self.smoke_test_seconds

    @model_validator(mode="after")
    def _registers_within_a_token(self, info: ValidationInfo) -> "JoinTimeouts":
        if not _checks_tokens(info):
            return self
        # Waiting past the longest token a join can have waits for a machine that can no longer
        # join, billing (AcquireCapacity passes these to every join it starts: refused there too).
        if self.until_registered_seconds > MAX_JOIN_TOKEN_TTL_S:
            raise _refuse(type(self).__name__, "registration_seconds", self.registration_seconds, "join_outlives_token",
                          f"provision_seconds + registration_seconds ({self.until_registered_seconds:.0f} s) must be "
                          f"at most {MAX_JOIN_TOKEN_TTL_S} s, the longest a join token lives: a machine not "
                          "registered by then never can")
        return self


class NodeJoinInput(Strict):
    """Start with plain JSON: ``{"site": "lambda-us-east"}``."""

    site: str = Field(min_length=1, max_length=253)
    #: More than one: the join fans out to one child NodeJoin per node.
    count: int = Field(1, ge=1, le=64)
    #: At least ``timeouts.provision_seconds + timeouts.registration_seconds`` (1500 s by default):
    #: the token is issued before the machine is created and must still work when it registers.
    token_ttl_seconds: int = Field(MAX_JOIN_TOKEN_TTL_S, gt=0, le=MAX_JOIN_TOKEN_TTL_S)
    timeouts: JoinTimeouts = Field(default_factory=JoinTimeouts)

    @model_validator(mode="after")
    def _token_outlives_the_wait(self, info: ValidationInfo) -> "NodeJoinInput":
        if not _checks_tokens(info):
            return self
        # A shorter token expires while the join still waits: the machine can never join and
        # bills until the registration wait ends. Refused before anything is bought.
        wait = self.timeouts.until_registered_seconds
        if self.token_ttl_seconds < wait:
            raise _refuse(type(self).__name__, "token_ttl_seconds", self.token_ttl_seconds, "token_expires_first",
                          f"{self.token_ttl_seconds} s expires before the machine can register: the join waits "
                          f"up to timeouts.provision_seconds + timeouts.registration_seconds ({wait:.0f} s) for "
                          f"it to register with this token; give at least {wait:.0f} or shorten the timeouts")
        return self


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
    #: A cancel came while the node was admitted, and the admit went through: the join ended ready
    #: and the node stays (its Node entity and Site were told it was ready; pods may be on it).
    admitted: bool = False
