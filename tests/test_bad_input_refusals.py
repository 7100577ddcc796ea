"""How an operator's update is refused (issue 36): bad input is a non-retryable ``InvalidInput``
naming the field first; a refusal for the entity's state (not its input) is a non-retryable
``WrongState``. Neither is a retryable ``ValueError``/``RuntimeError`` (what ``admit_repair``,
``quota_raised`` and ``credentials_rotated`` answered), and a ``null`` argument (a wrong-shaped
call) never stands for "no reason" or "everything": it is refused naming the field.

Run on the control plane's workflows without activities (each waits at its first step), so
the entities stay in the state each case needs; then, with the real worker, an evacuation of
a site nobody configured."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import AsyncIterator

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateStage,
)
from temporalio.exceptions import ApplicationError

from client import FleetClient, InvalidArgument
from fleet.messages.repair import LadderState
from fleet.repair_policy import Rung
from tests.bad_input_helpers import idle_workflows, processed, raw, task_failures, wait_for_async
from tests.conftest import Stack
from tests.test_bad_input_property import valid_starts
from workflows.repair import GpuRepair


@pytest.fixture
async def idle_fleet(fleet_world: Stack) -> AsyncIterator[Stack]:
    async with idle_workflows(fleet_world) as stack:
        yield stack


async def running(stack: Stack, workflow: str, start: dict | None = None, workflow_id: str = "") -> WorkflowHandle:
    handle = await stack.client.start_workflow(
        workflow, start or valid_starts()[workflow], id=workflow_id or f"refusals/{workflow}/{uuid.uuid4().hex[:8]}",
        task_queue=stack.settings.task_queue,
    )
    await processed(handle, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED)
    return handle


async def refused(handle: WorkflowHandle, update: str, *args: str) -> ApplicationError:
    """The update's refusal (each argument the JSON text an operator typed), non-retryable."""
    with pytest.raises(WorkflowUpdateFailedError) as caught:
        await asyncio.wait_for(handle.execute_update(update, args=[raw(a) for a in args]), 15)
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError) and cause.non_retryable, f"{update}: {cause!r}"
    assert "Failed decoding" not in cause.message, cause.message
    return cause


def names_first(cause: ApplicationError, field: str) -> None:
    assert cause.type == "InvalidInput", f"{cause.type}: {cause.message}"
    message = cause.message.removeprefix("invalid AdmitRepairInput: ")
    assert message.startswith(f"{field}:"), cause.message


async def test_admit_repair_refuses_a_bad_payload_naming_the_field(idle_fleet: Stack) -> None:
    """Before, a payload the SDK could not decode as ``AdmitRepairInput`` was refused as the
    SDK's retryable "Failed decoding arguments", and unknown fields were taken silently."""
    site = await running(idle_fleet, "Site", {"site": "site-a"}, workflow_id=f"site/site-a-{uuid.uuid4().hex[:6]}")
    for payload, field in (
        ('"site-a-1"', "(input)"),
        ('{"site": "site-a"}', "node_name"),
        ('{"site": "site-a", "node_name": "site-a-1", "gpu": "zero"}', "gpu"),
        ('{"site": "site-a", "node_name": "site-a-1", "gpu": 64}', "gpu"),
        ('{"site": "site-a", "node": "site-a-1"}', "node"),  # a typo, no longer ignored
        ('{"site": "site-b", "node_name": "site-b-1"}', "site"),  # another site's node
    ):
        names_first(await refused(site, "admit_repair", payload), field)
    assert await task_failures(site) == 0


async def test_account_updates_refuse_bad_input_and_the_wrong_state_apart(idle_fleet: Stack) -> None:
    account = await running(idle_fleet, "ProviderAccount",
                            workflow_id=f"account/lambda/acct-a-{uuid.uuid4().hex[:6]}")
    # Healthy: nothing to raise, nothing to rotate. The entity's state, not the input.
    nothing = await refused(account, "quota_raised", '{"all": true}')
    assert nothing.type == "WrongState" and "no quota-blocked offer" in nothing.message, nothing.message
    rotated = await refused(account, "credentials_rotated")
    assert rotated.type == "WrongState" and "not revoked" in rotated.message, rotated.message
    assert await task_failures(account) == 0


async def test_quota_raised_at_a_blocked_account_names_the_offers_not_blocked(stack: Stack) -> None:
    """Blocked by a report (its loop runs past the run's first activity, the account's check
    against the config, so with the real worker): an offer that is not blocked here is the
    caller's mistake, named."""
    account = await running(stack, "ProviderAccount", {"account": "acct-a", "provider": "lambda"},
                            workflow_id=f"account/lambda/acct-a-{uuid.uuid4().hex[:6]}")
    await account.signal("report", {"account": "acct-a", "kind": "OverQuota", "offer": "site-a/gpu_2x_h100"})
    await wait_for_async(lambda: account.query("status"), lambda s: "site-a/gpu_2x_h100" in s["blocked_offers"])
    unknown = await refused(account, "quota_raised", '{"offers": ["site-a/gpu_8x_h100"]}')
    names_first(unknown, "offers")
    assert "not blocked: site-a/gpu_8x_h100" in unknown.message and "site-a/gpu_2x_h100" in unknown.message
    names_first(await refused(account, "quota_raised", "null"), "offers")  # null is not "all"
    assert await task_failures(account) == 0


@pytest.mark.parametrize("workflow, update, field", [
    ("SiteEvacuation", "abort", "reason"),
    ("SiteEvacuation", "declare_recovered", "note"),
    ("ModelRollout", "resume", "reason"),
    ("ModelRollout", "abort", "reason"),
    ("ModelRollout", "pause", "reason"),
    ("AcquireCapacity", "cancel", "reason"),
])
async def test_a_null_argument_is_refused_naming_the_field(idle_fleet: Stack, workflow: str, update: str,
                                                           field: str) -> None:
    """A wrong-shaped call (``null`` where the text goes) changes nothing: it is not "no reason"."""
    handle = await running(idle_fleet, workflow)
    cause = await refused(handle, update, "null")
    names_first(cause, field)
    assert "got null" in cause.message, cause.message
    # The same update with its argument as the client and the CLI send it is not refused for its input
    # (accepted, or refused for the state the idle workflow is in).
    try:
        await asyncio.wait_for(handle.start_update(update, args=["by hand"],
                                                   wait_for_stage=WorkflowUpdateStage.ACCEPTED), 15)
    except WorkflowUpdateFailedError as error:
        assert error.cause.type == "WrongState" and error.cause.non_retryable, error.cause
    assert await task_failures(handle) == 0


async def test_a_rollout_refuses_for_its_state_with_a_type_of_its_own(idle_fleet: Stack) -> None:
    rollout = await running(idle_fleet, "ModelRollout")
    not_paused = await refused(rollout, "resume", '"go on"')
    assert not_paused.type == "WrongState" and not_paused.message == "not paused", not_paused
    await rollout.execute_update("pause", "look first")
    again = await refused(rollout, "pause", '"look again"')
    assert again.type == "WrongState" and again.message == "already paused", again
    assert await task_failures(rollout) == 0


async def _signals_received(handle: WorkflowHandle, name: str) -> list[dict]:
    history = await handle.fetch_history()
    return [json.loads(e.workflow_execution_signaled_event_attributes.input.payloads[0].data)
            for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
            and e.workflow_execution_signaled_event_attributes.signal_name == name]


async def test_a_slot_request_whose_detection_time_has_no_zone_is_read_as_utc(idle_fleet: Stack) -> None:
    """``temporal workflow signal --name node_action_request --input '{..., "detected_at":
    "2020-01-01T10:00:00"}'``: the entity compared the time with its actions' (which have a zone)
    when the request's turn came, and failed its workflow task on every replay, the node's
    entity stuck for good. Read as UTC, a reboot that ran since covers it, as for any request."""
    node = await running(idle_fleet, "Node", {"node_name": "site-a-naive"},
                         workflow_id=f"node/site-a-naive-{uuid.uuid4().hex[:6]}")
    # The repairs the entity answers: any running workflow takes a signal.
    rebooted, covered = await running(idle_fleet, "ModelRollout"), await running(idle_fleet, "ModelRollout")
    await node.signal("node_action_request", raw(json.dumps(
        {"repair_id": rebooted.id, "rung": "reboot", "detected_at": "2020-01-01T09:00:00+00:00"})))
    await processed(node, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
    await node.signal("node_action_done", raw(json.dumps({"repair_id": rebooted.id, "rung": "reboot"})))
    await processed(node, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
    await node.signal("node_action_request", raw(json.dumps(
        {"repair_id": covered.id, "rung": "reset", "detected_at": "2020-01-01T10:00:00"})))
    await processed(node, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
    assert await task_failures(node) == 0
    assert [g["go"] for g in await _signals_received(rebooted, "node_action_grant")] == [True]
    grants = await wait_for_async(lambda: _signals_received(covered, "node_action_grant"), bool)
    assert [(g["go"], g["covered_by"]) for g in grants] == [(False, "reboot")], grants


@pytest.mark.parametrize("validator, argument", [
    (GpuRepair._validate_hold, {"reason": "look"}),
    (GpuRepair._validate_release, {"reason": "go"}),
    (GpuRepair._validate_skip_to, {"rung": "reboot"}),
])
def test_a_repair_that_has_ended_refuses_its_updates_for_its_state(validator, argument: dict) -> None:
    """A repair ends in the task that ends its run, so only an update that races its last task
    meets its validator with the ladder done: called here on that state. It was a retryable
    ``ValueError`` ("the repair is not running"; skip_to after a replacement, "the node was
    already replaced"), which says neither that the input was fine nor to stop retrying."""
    repair = GpuRepair()
    repair._state = LadderState(node_name="site-a-1", gpu=0, rung=Rung.REPLACE, step="replaced",
                                done=True, outcome="replaced")
    with pytest.raises(ApplicationError) as caught:
        validator(repair, argument)
    refusal = caught.value
    assert refusal.type == "WrongState" and refusal.non_retryable, repr(refusal)
    assert refusal.message == "the repair is not running: it has ended (replaced)", refusal.message
    assert refusal.details == ({"state": "replaced"},)


async def test_an_evacuation_of_an_unknown_site_says_so_at_the_top(stack: Stack) -> None:
    """Before, the failure's top message was "Activity task failed" (the activity retried an
    ``InvalidRequest`` cause); now the workflow fails with the cause itself."""
    fleet = FleetClient(stack.settings, stack.client)
    with pytest.raises(InvalidArgument) as before_start:
        await fleet.evacuate_site({"site": "mars-1", "reason": "test"}, request_id="unknown")
    assert before_start.value.field == "site" and "unknown site 'mars-1'" in str(before_start.value)

    # A caller without the client (``temporal``, the HTTP API) reaches the workflow.
    handle = await stack.client.start_workflow("SiteEvacuation", {"site": "mars-1", "reason": "test"},
                                               id=f"evacuate/mars-1/manual-{uuid.uuid4().hex[:6]}",
                                               task_queue=stack.settings.task_queue)
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(handle.result(), 30)
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError), cause
    assert cause.message.startswith("site: unknown site 'mars-1'"), cause.message
    assert cause.type == "InvalidInput" and cause.non_retryable, cause
    assert "site-a" in cause.message, "the known sites are named"
    history = await handle.fetch_history()
    kinds = {e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
             if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED}
    attempts = [e.activity_task_started_event_attributes.attempt for e in history.events
                if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
                and kinds[e.activity_task_started_event_attributes.scheduled_event_id] == "evacuation_facts"]
    assert attempts == [1], "refused once, never retried"
    assert await task_failures(handle) == 0


async def test_an_evacuation_by_hand_with_bad_capacity_request_fields_is_refused_before_it_starts(
        fleet_world: Stack) -> None:
    """They went on to the workflow, whose task failed after the site's routing weight was 0."""
    fleet = FleetClient(fleet_world.settings, fleet_world.client)
    for constraints in ("H100", None):
        with pytest.raises(InvalidArgument) as caught:
            await fleet.evacuate_site({"site": "site-a", "capacity_request": {"constraints": constraints}},
                                      request_id=uuid.uuid4().hex[:6])
        assert caught.value.field == "capacity_request.constraints", caught.value
