"""EntityUpdate, the relay that lets a caller without an SDK (Temporal's HTTP API, which cannot
address an id containing ``/``) run an operator update on an entity: the request is checked
against the allow-list before anything is sent, the entity's answer is the result, and a
refusal or a missing entity fails the relay, non-retryable, with the entity's reason."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import AsyncIterator, get_args

import pytest
from pydantic import ValidationError
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.workflow import _Definition

from client import FleetClient, InvalidArgument
from fleet.contracts.entity_update import KINDS, EntityUpdateInput, EntityUpdateResult, UpdateName
from fleet.models import AccountState
from tests.bad_input_helpers import invalid_input, task_failures
from tests.capacity_fleet import FAST_JOIN, CapStack, open_stack
from tests.replay import replay_and_record
from workflows import ALL_WORKFLOWS


@pytest.mark.parametrize("raw, field, words", [
    ({"entity": "gpu/lambda-us-east-1", "update": "hold"}, "entity", "repair/<node>/gpu<index>"),
    ({"entity": "node/lambda-us-east-1", "update": "hold"}, "update", "a Node entity takes only return_gpu, repair_gpu"),
    ({"entity": "site/lambda-us-east", "update": "hold"}, "update", "a Site entity takes only reconcile_now"),
    ({"entity": "site/lambda-us-east", "update": "admit_repair"}, "update", "Input should be"),
    ({"entity": "site/lambda-us-east", "update": "reconcile_now", "args": {"now": True}}, "args.now", "Extra"),
    ({"entity": "repair/n1/gpu0/x", "update": "hold"}, "entity", "not an entity id"),
    ({"entity": "account/lambda/a", "update": "hold"}, "update", "quota_raised, credentials_rotated"),
    ({"entity": "account/lambda/a", "update": "terminate"}, "update", "Input should be"),
    ({"entity": "repair/n1/gpu0", "update": "skip_to", "args": {"rung": "zap"}}, "args.rung", "reset"),
    ({"entity": "repair/n1/gpu0", "update": "hold", "args": {"reason": "r" * 501}}, "args.reason", "at most 500"),
    ({"entity": "rollout/m/v1", "update": "pause", "args": {"why": "x"}}, "args.why", "Extra inputs"),
    ({"entity": "account/lambda/a", "update": "credentials_rotated", "args": {"offers": []}}, "args.offers", "Extra"),
    ({"entity": "account/lambda/a", "update": "quota_raised", "to": "x"}, "to", "Extra"),
])
def test_the_allow_list_names_the_bad_field(raw: dict, field: str, words: str) -> None:
    with pytest.raises(ValidationError) as caught:
        EntityUpdateInput.model_validate(raw)
    (error,) = caught.value.errors()
    assert ".".join(map(str, error["loc"])) == field and words in error["msg"], error


def test_arguments_travel_as_the_entity_handler_takes_them() -> None:
    """The same values FleetClient sends for the same update."""
    def wire(raw: dict) -> list:
        return EntityUpdateInput.model_validate(raw).wire_args()

    assert wire({"entity": "account/lambda/a", "update": "quota_raised", "args": {"offers": ["s/t"]}}) == [
        {"offers": ["s/t"]}]
    assert wire({"entity": "account/lambda/a", "update": "quota_raised", "args": {"offers": None}}) == [{}], \
        "Temporal's HTTP API sends an empty array as null: not given (and the entity refuses it: all is explicit)"
    assert wire({"entity": "account/lambda/a", "update": "credentials_rotated"}) == []
    assert wire({"entity": "repair/n1/gpu3", "update": "hold", "args": {"reason": "vendor ticket"}}) == [
        {"reason": "vendor ticket"}]
    assert wire({"entity": "repair/n1/gpu3", "update": "skip_to", "args": {"rung": "reboot"}}) == [{"rung": "reboot"}]
    assert wire({"entity": "rollout/m/v1", "update": "abort", "args": {"reason": "bad canary"}}) == ["bad canary"]
    assert wire({"entity": "evacuate/s1/manual-7", "update": "declare_recovered"}) == [""]
    assert wire({"entity": "site/s1", "update": "reconcile_now"}) == []
    assert wire({"entity": "node/n1", "update": "return_gpu", "args": {"gpu": 0, "reason": "vendor"}}) == [
        {"gpu": 0, "reason": "vendor"}]


def test_the_allow_list_names_real_updates_of_real_workflows() -> None:
    """A renamed update or workflow type would otherwise only show as a refused relay."""
    defined = {d.name: set(d.updates) for d in map(_Definition.must_from_class, ALL_WORKFLOWS)}
    for kind in KINDS.values():
        assert set(kind.updates) <= defined[kind.workflow_type], kind.workflow_type
        assert set(kind.wire) == set(kind.updates)
    assert {u for k in KINDS.values() for u in k.updates} == set(get_args(UpdateName))


@pytest.fixture
async def cap(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[CapStack]:
    address = temporal_env.client.service_client.config.target_host
    async for stack in open_stack(temporal_env.client, address, tmp_path):
        yield stack


async def relay(cap: CapStack, raw: object, name: str) -> WorkflowHandle:
    return await cap.client.start_workflow(
        "EntityUpdate", raw, id=f"update-{name}-{cap.uid}", task_queue=cap.settings.task_queue)


async def failure(handle: WorkflowHandle) -> ApplicationError:
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(handle.result(), 30)
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError) and cause.non_retryable, cause
    assert await task_failures(handle) == 0
    return cause


async def test_relay_raises_a_quota_and_reports_refusals(cap: CapStack) -> None:
    fleet = FleetClient(cap.settings, cap.client)
    account, entity = cap.account("a"), f"account/lambda/{cap.account('a')}"

    missing = await failure(await relay(cap, {"entity": entity, "update": "quota_raised"}, "missing"))
    assert missing.type == "EntityNotFound" and entity in missing.message

    # The cheap site answers OverQuota: its join fails and the account entity is blocked.
    cap.world.set_site(cap.site("cheap"), quota=0)
    join = await cap.client.start_workflow("NodeJoin", {"site": cap.site("cheap"), "timeouts": FAST_JOIN},
                                           id=f"join/{cap.site('cheap')}/{uuid.uuid4().hex[:6]}",
                                           task_queue=cap.settings.task_queue)
    with pytest.raises(WorkflowFailureError):
        await join.result()
    await cap.listed(f'WorkflowId = "{entity}" AND FleetState = "needs-person"')
    assert (await fleet.account_status(account)).state == AccountState.QUOTA_BLOCKED

    refused = await failure(await relay(
        cap, {"entity": entity, "update": "quota_raised", "args": {"offers": ["nowhere/none"]}}, "refused"))
    assert refused.type == "UpdateRejected" and "not blocked: nowhere/none" in refused.message, refused.message
    assert (await fleet.account_status(account)).state == AccountState.QUOTA_BLOCKED, "a refusal changes nothing"

    vague = await failure(await relay(cap, {"entity": entity, "update": "quota_raised"}, "vague"))
    assert vague.type == "UpdateRejected" and "offers: name the offers" in vague.message, vague.message

    raised = await relay(cap, {"entity": entity, "update": "quota_raised", "args": {"all": True}}, "raised")
    result = await raised.result(rpc_timeout=None)
    result = EntityUpdateResult.model_validate(result)
    assert (result.entity, result.update, result.workflow_type) == (entity, "quota_raised", "ProviderAccount")
    assert result.result["state"] == AccountState.HEALTHY and result.result["blocked_offers"] == {}
    assert (await fleet.account_status(account)).state == AccountState.HEALTHY, "the entity took it"
    updates = [e for e in (await cap.account_handle("lambda", "a").fetch_history()).events
               if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED]
    assert len(updates) == 1, "the refused update was never admitted; the accepted one once"

    again = await failure(await relay(cap, {"entity": entity, "update": "quota_raised", "args": {"all": True}}, "again"))
    assert again.type == "UpdateRejected" and "no quota-blocked offer" in again.message

    await cap.account_handle("lambda", "a").terminate("the account left the fleet")
    closed = await failure(await relay(cap, {"entity": entity, "update": "quota_raised"}, "closed"))
    assert closed.type == "EntityClosed" and "terminated" in closed.message, closed.message

    await replay_and_record(raised, "entity_update_quota_raised")
    await replay_and_record(cap.client.get_workflow_handle(f"update-refused-{cap.uid}"),
                            "entity_update_rejected")


async def test_a_bad_request_fails_before_anything_is_sent(cap: CapStack) -> None:
    handle = await relay(cap, {"entity": "node/" + cap.site("cheap"), "update": "quota_raised"}, "bad")
    await invalid_input(handle, "entity")
    history = await handle.fetch_history()
    assert not [e for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


async def test_a_site_reconciles_on_the_update_and_says_what_it_will_do(cap: CapStack) -> None:
    """The operator's ``reconcile`` has an update form, ``reconcile_now``, that answers; the client
    and the relay send it (the signal, from code and batch operations, still works)."""
    fleet = FleetClient(cap.settings, cap.client)
    site = cap.site("cheap")
    first = await fleet.reconcile_site(site)  # starts the entity (update-with-start)
    assert first.startswith(f"{site}: "), first
    answer = first
    for _ in range(100):  # once it has read its min/max, it says what the reconcile will do
        if "counting its nodes now" in answer:
            break
        await asyncio.sleep(0.1)
        answer = await fleet.reconcile_site(site)
    assert answer == (f"{site}: counting its nodes now (0 known, min 0, max 8); within min/max: nothing to change "
                      "unless the count differs"), answer

    relayed = await relay(cap, {"entity": f"site/{site}", "update": "reconcile_now"}, "reconcile")
    result = EntityUpdateResult.model_validate(await relayed.result(rpc_timeout=None))
    assert (result.entity, result.update, result.workflow_type) == (f"site/{site}", "reconcile_now", "Site")
    assert result.result.startswith(f"{site}: counting its nodes now"), result.result

    entity = cap.client.get_workflow_handle(f"site/{site}")
    await entity.signal("reconcile")  # what code and the README's batch operation send
    events = (await entity.fetch_history()).events
    updates = [e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name
               for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED]
    assert updates and set(updates) == {"reconcile_now"}, updates
    assert await task_failures(entity) == 0

    with pytest.raises(InvalidArgument) as unknown:
        await fleet.reconcile_site("mars-1")
    assert unknown.value.field == "site" and "unknown site 'mars-1'" in str(unknown.value)
