"""EntityUpdate: an operator update relayed to an entity for a caller that cannot address it.

Temporal's HTTP API routes on the workflow id in the URL path and decodes ``%2F``
before routing, so no entity id (they all contain ``/``) can be named there. The
relay is started with an id of its own and carries the entity's id in its input.
It relays only the operator updates below: a table, not a pass-through, so an HTTP
caller can do no more than the ``gpufleet`` command for the same entity, and every
argument is checked here before anything is sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from fleet.messages.capacity import QuotaRaised
from fleet.messages.repair import HoldInput, SkipToInput
from fleet.models import Strict

#: The same bound as an update's free text everywhere else (``workflows.inputs.MAX_NOTE``).
MAX_TEXT = 1000


class NoArgs(Strict):
    """``credentials_rotated``, ``look_again`` and ``reconcile_now`` take nothing."""


class ReasonArgs(Strict):
    reason: str = Field("", max_length=MAX_TEXT)


class NoteArgs(Strict):
    note: str = Field("", max_length=MAX_TEXT)


@dataclass(frozen=True)
class EntityKind:
    """One kind of entity: its id's shape, its workflow type and the updates it takes."""

    workflow_type: str
    id_shape: str
    id_pattern: re.Pattern[str]
    #: update name -> the model of its ``args`` object.
    updates: dict[str, type[BaseModel]]
    #: update name -> how ``args`` travel to the entity's handler: ``object`` (the dict, as the
    #: handler's one argument), ``none`` (no argument), or the name of the one text field.
    wire: dict[str, str]


_SEGMENT = r"[^/\s]+"
KINDS: dict[str, EntityKind] = {
    "account": EntityKind(
        workflow_type="ProviderAccount", id_shape="account/<provider>/<account>",
        id_pattern=re.compile(rf"account/{_SEGMENT}/{_SEGMENT}"),
        updates={"quota_raised": QuotaRaised, "credentials_rotated": NoArgs},
        wire={"quota_raised": "object", "credentials_rotated": "none"},
    ),
    "repair": EntityKind(
        workflow_type="GpuRepair", id_shape="repair/<node>/gpu<index>",
        id_pattern=re.compile(rf"repair/{_SEGMENT}/gpu[0-9]{{1,3}}"),
        updates={"hold": HoldInput, "release": HoldInput, "skip_to": SkipToInput},
        wire={"hold": "object", "release": "object", "skip_to": "object"},
    ),
    "rollout": EntityKind(
        workflow_type="ModelRollout", id_shape="rollout/<model>/<version>",
        id_pattern=re.compile(rf"rollout/{_SEGMENT}/{_SEGMENT}"),
        updates={"pause": ReasonArgs, "resume": ReasonArgs, "abort": ReasonArgs},
        wire={"pause": "reason", "resume": "reason", "abort": "reason"},
    ),
    "capacity": EntityKind(
        workflow_type="AcquireCapacity", id_shape="capacity/<request>",
        id_pattern=re.compile(r"capacity/[^\s]+"),
        updates={"cancel": ReasonArgs}, wire={"cancel": "reason"},
    ),
    "evacuate": EntityKind(
        workflow_type="SiteEvacuation", id_shape="evacuate/<site>/<n> or evacuate/<site>/manual-<request>",
        id_pattern=re.compile(rf"evacuate/{_SEGMENT}/[^\s]+"),
        updates={"declare_recovered": NoteArgs, "abort": ReasonArgs, "look_again": NoArgs},
        wire={"declare_recovered": "note", "abort": "reason", "look_again": "none"},
    ),
    "site": EntityKind(
        workflow_type="Site", id_shape="site/<site>",
        id_pattern=re.compile(rf"site/{_SEGMENT}"),
        # ``reconcile_now`` only: ``admit_repair`` is its Node entities' question, not an operator's.
        updates={"reconcile_now": NoArgs}, wire={"reconcile_now": "none"},
    ),
}

UpdateName = Literal["quota_raised", "credentials_rotated", "hold", "release", "skip_to", "pause", "resume",
                     "abort", "declare_recovered", "cancel", "look_again", "reconcile_now"]


def kind_of(entity: str) -> EntityKind | None:
    kind = KINDS.get(entity.split("/", 1)[0])
    return kind if kind is not None and kind.id_pattern.fullmatch(entity) else None


def _shapes() -> str:
    return "; ".join(k.id_shape for k in KINDS.values())


class EntityUpdateInput(Strict):
    """EntityUpdate's start input: ``{"entity": "account/lambda/lambda-main", "update":
    "quota_raised", "args": {"offers": ["lambda-us-east/gpu_8x_h100"]}}``."""

    #: The entity's workflow id (see ``KINDS`` for the shapes).
    entity: str = Field(min_length=1, max_length=512)
    update: UpdateName
    #: The update's arguments as one JSON object (``{}`` or absent: none / defaults).
    args: dict[str, Any] = Field(default_factory=dict, max_length=1000)

    @field_validator("entity")
    @classmethod
    def _entity_shape(cls, entity: str) -> str:
        if kind_of(entity) is None:
            raise PydanticCustomError("entity_id", "not an entity id that takes operator updates; one of: {shapes}",
                                      {"shapes": _shapes()})
        return entity

    @model_validator(mode="after")
    def _update_fits(self) -> "EntityUpdateInput":
        kind = kind_of(self.entity)
        model = kind.updates.get(self.update)
        if model is None:
            raise ValidationError.from_exception_data(type(self).__name__, [{
                "type": PydanticCustomError("update_not_taken", "a {workflow} entity takes only {updates}",
                                            {"workflow": kind.workflow_type, "updates": ", ".join(kind.updates)}),
                "loc": ("update",), "input": self.update,
            }])
        # Temporal's HTTP API delivers an empty JSON array as null: a null argument means "not given".
        given = {name: value for name, value in self.args.items() if value is not None}
        try:
            checked = model.model_validate(given)
        except ValidationError as error:
            # Re-raised under ``args`` so the refusal names ``args.reason``, not a bare ``reason``.
            raise ValidationError.from_exception_data(type(self).__name__, [
                {"type": e["type"], "loc": ("args", *e["loc"]), "input": e["input"],
                 **({"ctx": e["ctx"]} if "ctx" in e else {})}
                for e in error.errors(include_url=False)
            ]) from None
        self.args = checked.model_dump(mode="json", exclude_unset=True)
        return self

    @property
    def kind(self) -> EntityKind:
        kind = kind_of(self.entity)
        assert kind is not None  # the validator refused every other id
        return kind

    def wire_args(self) -> list[Any]:
        """The arguments exactly as the entity's update handler takes them (the same values
        ``FleetClient`` sends)."""
        how = self.kind.wire[self.update]
        if how == "none":
            return []
        if how == "object":
            return [self.args]
        return [self.args.get(how, "")]


class EntityUpdateResult(BaseModel):
    entity: str
    update: str
    #: Workflow type of the entity that took the update.
    workflow_type: str
    #: The update's result as the entity returned it (plain JSON: AccountStatus, LadderState,
    #: RolloutProgress, EvacuationProgress, CapacityProgress, or a sentence for ``look_again`` and
    #: ``reconcile_now``).
    result: Any = None
