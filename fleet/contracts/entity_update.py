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
from fleet.messages.repair import HoldInput, RepairGpuInput, ReturnGpuInput, SkipToInput
from fleet.models import Strict
from fleet import naming
from fleet.contracts import workflows as flows

#: The same bound as an update's free text everywhere else (``workflows.inputs.MAX_NOTE``).
MAX_TEXT = 1000


class NoArgs(Strict):
    """``credentials_rotated``, ``look_again`` and ``reconcile_now`` take nothing."""


class ReasonArgs(Strict):
    reason: str = Field("", max_length=MAX_TEXT)


class NoteArgs(Strict):
    note: str = Field("", max_length=MAX_TEXT)


#: The handlers of these updates take no argument, or their one text field alone; every other
#: update's handler takes its ``args`` object.
_WIRE: dict[type[BaseModel], str] = {NoArgs: "none", ReasonArgs: "reason", NoteArgs: "note"}


@dataclass(frozen=True)
class EntityKind:
    """One kind of entity: its id's shape, its workflow type and the updates it takes."""

    workflow_type: str
    id_shape: str
    id_pattern: re.Pattern[str]
    #: update name -> the model of its ``args`` object.
    updates: dict[str, type[BaseModel]]

    @property
    def wire(self) -> dict[str, str]:
        """update name -> how ``args`` travel to the entity's handler: ``object`` (the dict, as the
        handler's one argument), ``none`` (no argument), or the name of the one text field."""
        return {name: _WIRE.get(model, "object") for name, model in self.updates.items()}


_SEGMENT = r"[^/\s]+"
KINDS: dict[str, EntityKind] = {
    "account": EntityKind(
        workflow_type=flows.ProviderAccount.TYPE, id_shape=naming.account_workflow_id("<provider>", "<account>"),
        id_pattern=re.compile(rf"account/{_SEGMENT}/{_SEGMENT}"),
        updates={flows.ProviderAccount.quota_raised: QuotaRaised,
                 flows.ProviderAccount.credentials_rotated: NoArgs},
    ),
    "repair": EntityKind(
        workflow_type=flows.GpuRepair.TYPE, id_shape=naming.repair_workflow_id("<node>", "<index>"),
        id_pattern=re.compile(rf"repair/{_SEGMENT}/gpu[0-9]{{1,3}}"),
        updates={flows.GpuRepair.hold: HoldInput, flows.GpuRepair.release: HoldInput,
                 flows.GpuRepair.skip_to: SkipToInput},
    ),
    "node": EntityKind(
        workflow_type=flows.Node.TYPE, id_shape=naming.node_workflow_id("<node>"),
        id_pattern=re.compile(rf"node/{_SEGMENT}"),
        # A person's decision on a GPU the entity holds for a person; its signals are the control
        # plane's (a node's health, repairs' slot requests), not an operator's.
        updates={flows.Node.return_gpu: ReturnGpuInput, flows.Node.repair_gpu: RepairGpuInput},
    ),
    "rollout": EntityKind(
        workflow_type=flows.ModelRollout.TYPE, id_shape=naming.rollout_id("<model>", "<version>"),
        id_pattern=re.compile(rf"rollout/{_SEGMENT}/{_SEGMENT}"),
        updates={flows.ModelRollout.pause: ReasonArgs, flows.ModelRollout.resume: ReasonArgs,
                 flows.ModelRollout.abort: ReasonArgs},
    ),
    "capacity": EntityKind(
        workflow_type=flows.AcquireCapacity.TYPE, id_shape=naming.capacity_workflow_id("<request>"),
        id_pattern=re.compile(r"capacity/[^\s]+"),
        updates={flows.AcquireCapacity.cancel: ReasonArgs},
    ),
    "evacuate": EntityKind(
        workflow_type=flows.SiteEvacuation.TYPE,
        id_shape=f"{naming.evacuation_workflow_id('<site>', '<n>')} or {naming.manual_evacuation_id('<site>', '<request>')}",
        id_pattern=re.compile(rf"evacuate/{_SEGMENT}/[^\s]+"),
        updates={flows.SiteEvacuation.declare_recovered: NoteArgs, flows.SiteEvacuation.abort: ReasonArgs,
                 flows.SiteEvacuation.look_again: NoArgs},
    ),
    "site": EntityKind(
        workflow_type=flows.Site.TYPE, id_shape=naming.site_workflow_id("<site>"),
        id_pattern=re.compile(rf"site/{_SEGMENT}"),
        # ``reconcile_now`` only: ``admit_repair`` is its Node entities' question, not an operator's.
        updates={flows.Site.reconcile_now: NoArgs},
    ),
}

UpdateName = Literal["quota_raised", "credentials_rotated", "hold", "release", "skip_to", "return_gpu", "repair_gpu",
                     "pause", "resume", "abort", "declare_recovered", "cancel", "look_again", "reconcile_now"]


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
    #: GpuDecision, RolloutProgress, EvacuationProgress, CapacityProgress, or a sentence for
    #: ``look_again`` and ``reconcile_now``).
    result: Any = None
