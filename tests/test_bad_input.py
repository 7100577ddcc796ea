"""Nothing wedges on bad input (issue 13): each case an operator met, sent the way an
operator sends it (raw JSON payloads through a client, or the ``temporal`` CLI).

A bad start fails the workflow at once with a non-retryable ``InvalidInput`` naming
the field, before any provider call; a bad signal is dropped and the workflow carries
on; a bad update is refused naming the field. Never a ``WorkflowTaskFailed`` event.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from typing import AsyncIterator

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from cli.dev import temporal_binary
from fleet.cluster import ServingSpec
from fleet.messages.join import TOKEN_CHECKS
from tests.bad_input_helpers import (
    idle_workflows,
    invalid_input,
    processed,
    raw,
    start_raw,
    task_failures,
    wait_for_async,
)
from tests.capacity_fleet import details
from activities.env import FleetEnv
from tests.conftest import Stack, terminate_running
from workers.control_plane import build_worker
from tests.replay import replay_and_record
from workflows import ALL_WORKFLOWS


@pytest.fixture
async def idle_fleet(fleet_world: Stack) -> AsyncIterator[Stack]:
    async with idle_workflows(fleet_world) as stack:
        yield stack


def provider_calls(stack: Stack) -> int:
    return stack.world.calls("acct-a") + stack.world.calls("acct-b")


@pytest.mark.parametrize("workflow_type", ["NodeJoin", "AcquireCapacity"])
async def test_start_with_anything_but_one_object_fails_fast(stack: Stack, workflow_type: str) -> None:
    cases = {
        ('"lambda-us-east"',): "got a string",
        ('[{"site": "site-a"}]',): "got an array",
        ("null",): "got null",
        (): "takes 1 input, got 0",
        ('{"site": "site-a"}', '{"site": "site-a"}'): "takes 1 input, got 2",
        # Accepted by the CLI's JSON check, refused by the data converter's parser.
        ('"\\ud800"',): "cannot be decoded: Invalid JSON",
    }
    for inputs, words in cases.items():
        failure = await invalid_input(await start_raw(stack, workflow_type, *inputs), words)
        assert failure.message.startswith("invalid input:"), failure.message
    assert provider_calls(stack) == 0
    assert stack.world.machines(include_deleted=True) == []


@pytest.mark.parametrize("value", ["1e12", "1e400", "-1", "NaN"])
async def test_join_timeout_out_of_range_fails_before_provisioning(stack: Stack, value: str) -> None:
    handle = await start_raw(stack, "NodeJoin", '{"site": "site-a", "timeouts": {"registration_seconds": %s}}' % value)
    await invalid_input(handle, "timeouts.registration_seconds")
    assert provider_calls(stack) == 0
    assert stack.world.machines(include_deleted=True) == []


@pytest.mark.parametrize("workflow_type, start, field, words, history", [
    # The token is issued before the machine is created: at 30 s it expired while the machine
    # booted, and the join waited out its 900 s registration wait for a machine billing.
    ("NodeJoin", {"site": "site-a", "token_ttl_seconds": 30}, "token_ttl_seconds",
     "give at least 1500 or shorten the timeouts", "join_refused_a_token_that_expires_first"),
    ("NodeJoin", {"site": "site-a", "token_ttl_seconds": 600, "timeouts": {"registration_seconds": 60}},
     "token_ttl_seconds", "give at least 660", ""),
    # A wait past the longest token (3600 s): no token can cover it, for a join or for every
    # join a capacity request starts.
    ("NodeJoin", {"site": "site-a", "timeouts": {"registration_seconds": 3600}}, "timeouts.registration_seconds",
     "(4200 s) must be at most 3600 s", ""),
    ("AcquireCapacity", {"constraints": {"sites": ["site-a"]},
                         "join_timeouts": {"provision_seconds": 1800, "registration_seconds": 1801}},
     "join_timeouts.registration_seconds", "(3601 s) must be at most 3600 s",
     "capacity_refused_join_timeouts_past_a_token"),
])
async def test_a_join_token_that_expires_before_registration_fails_before_provisioning(
        stack: Stack, workflow_type: str, start: dict, field: str, words: str, history: str) -> None:
    handle = await start_raw(stack, workflow_type, json.dumps(start))
    failure = await invalid_input(handle, f"{field}: ", words)
    assert "expires before the machine can register" in failure.message or "longest a join token lives" in failure.message
    assert provider_calls(stack) == 0
    assert stack.world.machines(include_deleted=True) == []
    if history:
        await replay_and_record(handle, history)


#: A start as a continued run's input looks (copied from the UI, or written by hand): each
#: workflow type with state carried over continue-as-new, the field, and a start setting it.
CARRIED_BY_A_CALLER = [
    # A naive deadline failed every workflow task (compared with ``workflow.now()``), and the
    # join timeouts past the longest token (a fresh start refuses them) went unchecked.
    ("AcquireCapacity", "carry", {
        "constraints": {"sites": ["site-a"]}, "count": 1,
        "join_timeouts": {"provision_seconds": 1800, "registration_seconds": 1801},
        "carry": {"deadline": "2027-01-01T00:00:00", "backoff_seconds": 300}}),
    # The machines in ``acquired`` were retired at the evacuation's end, whatever they were.
    ("SiteEvacuation", "carry", {"site": "site-a", "carry": {
        "phase": "recovering", "progress": {"site": "site-a"}, "facts": {"site": {"name": "site-a"}, "settings": {}},
        "settings": {}, "acquired": [{"node_name": "site-b-victim", "machine_id": "m-victim", "site": "site-b",
                                     "provider": "lambda", "gpus": 8}]}}),
    ("Node", "carry", {"node_name": "site-a-0badc0de", "carry": {"state": "needs-person", "needs_person": {"0": "?"}}}),
    ("Demand", "carry", {"carry": {"seq": 41}}),
    ("ProviderAccount", "status", {"account": "acct-a", "provider": "lambda", "status": {
        "account": "acct-a", "provider": "lambda", "state": "quota-blocked",
        "blocked_offers": {"site-a/gpu_8x_h100": "2027-01-01T00:00:00+00:00"}}}),
    ("Routing", "state", {"model": "chat", "state": {}}),
    ("Site", "state", {"site": "site-a", "state": {"status": {"site": "site-a", "nodes": {"site-a-gone": "ready"}}}}),
    ("Site", "fills", {"site": "site-a", "fills": 41}),
    ("ModelRollout", "carry", {
        "model": "chat", "version": "v2", "image": "img:2", "sites": [{"site": "site-a", "replicas": 1}],
        "weights": {"source": {"store": "models"}, "files": [{"path": "a.bin", "size": 1, "sha256": "0" * 64}]},
        "carry": {"progress": {"rollout_id": "chat-v2", "model": "chat", "version": "v2"}, "stores": {}}}),
]


@pytest.mark.parametrize("workflow_type, field, start", CARRIED_BY_A_CALLER,
                         ids=[f"{w}.{f}" for w, f, _ in CARRIED_BY_A_CALLER])
async def test_state_carried_over_continue_as_new_is_refused_from_a_caller(
        stack: Stack, workflow_type: str, field: str, start: dict) -> None:
    """``temporal workflow start --type AcquireCapacity --input '{"count": 1, "carry": {...}}'``
    (or a continued run's input copied from the UI and started again) was taken for a continued
    run: every check of a fresh start was skipped, and the state was trusted as the workflow's own.
    Now the start fails at once, naming the field, before anything is done."""
    workflow = next(w for w in ALL_WORKFLOWS if w.__temporal_workflow_definition.name == workflow_type)
    # A well-formed carry, as a continued run reads it (its start's checks not made again): only
    # where it came from is wrong.
    workflow.INPUT.model_validate(start, context={TOKEN_CHECKS: False})
    victim = stack.world.add_foreign_machine("site-b", "victim")
    text = json.dumps(start).replace("m-victim", victim)
    handle = await start_raw(stack, workflow_type, text)
    failure = await invalid_input(handle, f"invalid input: {field}: set by the workflow itself when it "
                                          "continues as new; never by a caller")
    assert failure.details == ({"fields": [field]},)
    assert provider_calls(stack) == 0
    assert [m["id"] for m in stack.world.machines(include_deleted=True)] == [victim], "nothing bought or deleted"
    if workflow_type == "AcquireCapacity":
        await replay_and_record(handle, "capacity_refused_a_callers_carry")


#: Some of an AcquireCapacity request's fields that a workflow merges into the request it starts:
#: the workflow, a start without them, and where they go in it.
PASSED_ON = [
    ("SpotReclaim", {"node_name": "site-a-ghost", "site": "site-a"}, ("replacement",)),
    ("Site", {"site": "site-a"}, ("fill_request",)),
    ("Site", {"site": "site-a"}, ("evacuation", "capacity_request")),
    ("SiteEvacuation", {"site": "site-a"}, ("capacity_request",)),
    ("Demand", {}, ("capacity_request",)),
]


@pytest.mark.parametrize("workflow_type, start, path", PASSED_ON, ids=[f"{w}.{'.'.join(p)}" for w, _, p in PASSED_ON])
async def test_capacity_request_fields_to_pass_on_are_checked_at_the_start(
        idle_fleet: Stack, workflow_type: str, start: dict, path: tuple[str, ...]) -> None:
    """``{"constraints": "H100"}`` (or null, where the workflow spreads them) passed the start
    and failed the workflow task that merged them into the request, on every retry: a
    reclaim's as it asked for the replacement, a Site's at its fill, an evacuation's once the
    site's routing weight was already 0. Now the start is refused, naming the field, with
    nothing run. A reclaim's null stays what it was: the replacement rule's constraints alone."""
    if workflow_type == "SpotReclaim":
        start = {**start, "terminate_at": time.time() + 3600}
    for constraints, refused in (("H100", True), (None, workflow_type != "SpotReclaim")):
        fields = {"constraints": constraints}
        for key in reversed(path):
            fields = {key: fields}
        handle = await start_raw(idle_fleet, workflow_type, json.dumps({**start, **fields}))
        if not refused:  # it runs: its first activity asked for (none runs here)
            await wait_for_async(lambda: _ran(handle), bool)
            assert await task_failures(handle) == 0
            continue
        await invalid_input(handle, ".".join(path) + ".constraints")
        assert await _ran(handle) == []


@pytest.mark.parametrize("workflow_type, start, path", PASSED_ON, ids=[f"{w}.{'.'.join(p)}" for w, _, p in PASSED_ON])
async def test_a_carry_to_pass_on_to_a_capacity_request_is_refused_at_the_start(
        idle_fleet: Stack, workflow_type: str, start: dict, path: tuple[str, ...]) -> None:
    """A carry among the fields merged into the AcquireCapacity a workflow starts made that
    request a fresh start with a carry, which it refuses: the workflow found out only at its fill,
    purchase or evacuation, after it had done its part (an evacuation's site already at weight 0).
    Now its own start is refused, naming the field, with nothing run."""
    if workflow_type == "SpotReclaim":
        start = {**start, "terminate_at": time.time() + 3600}
    fields = {"carry": {"deadline": "2027-01-01T00:00:00+00:00", "backoff_seconds": 300}}
    for key in reversed(path):
        fields = {key: fields}
    handle = await start_raw(idle_fleet, workflow_type, json.dumps({**start, **fields}))
    await invalid_input(handle, ".".join(path) + ": carry: set by the workflow itself when it continues as new")
    assert await _ran(handle) == []


async def _ran(handle: WorkflowHandle) -> list[str]:
    """The activities and children the workflow asked for."""
    return [EventType.Name(e.event_type) for e in (await handle.fetch_history()).events
            if e.event_type in (EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
                                EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED)]


async def test_site_sweep_input_of_the_wrong_type(stack: Stack) -> None:
    await invalid_input(await start_raw(stack, "SiteSweep", '"site-a"'), "got a string")
    await invalid_input(await start_raw(stack, "SiteSweep", '{"sites": "site-a"}'), "sites")
    await invalid_input(await start_raw(stack, "SiteSweep", '{"site": ["site-a"]}'), "site: unknown field")


async def test_operator_cli_start_with_two_inputs_or_a_string(stack: Stack) -> None:
    """The exact commands from the issue, through the ``temporal`` CLI."""
    address = stack.client.service_client.config.target_host
    for flags in (["--input", '"site-a"'], ["--input", '{"site": "site-a"}', "--input", '{"site": "site-a"}']):
        workflow_id = f"bad-input/cli/{uuid.uuid4().hex[:8]}"
        await asyncio.to_thread(subprocess.run, [
            temporal_binary(), "workflow", "start", "--address", address, "--type", "NodeJoin",
            "--task-queue", stack.settings.task_queue, "--workflow-id", workflow_id, *flags,
        ], check=True, capture_output=True)
        await invalid_input(stack.client.get_workflow_handle(workflow_id), "invalid input")
    assert stack.world.machines(include_deleted=True) == []


async def account_entity(stack: Stack) -> WorkflowHandle:
    return await start_raw(stack, "ProviderAccount", '{"account": "acct-a", "provider": "lambda"}',
                           workflow_id=f"account/lambda/acct-a-{uuid.uuid4().hex[:6]}")


ENTITY_TYPOS = [
    ("ProviderAccount", {"account": "acct-c", "provider": "lambda"}, "account",
     "'acct-c' is not in the fleet config (accounts: acct-a, acct-b)", "account_refused_not_in_config"),
    ("ProviderAccount", {"account": "acct-a", "provider": "aws"}, "provider",
     "account acct-a is a lambda account in the fleet config, not aws", ""),
    ("Routing", {"model": "chta"}, "model",
     "no site serves 'chta' and the fleet config does not name it (models:); served: ", "routing_refused_unknown_model"),
]


@pytest.mark.parametrize("workflow_type, start, field, words, history", ENTITY_TYPOS,
                         ids=[f"{w}.{f}" for w, _, f, _, _ in ENTITY_TYPOS])
async def test_an_entity_started_by_hand_for_what_the_fleet_lacks_is_refused_naming_the_field(
        stack: Stack, workflow_type: str, start: dict, field: str, words: str, history: str) -> None:
    """``temporal workflow start --type Routing --input '{"model": "chta"}'`` (for chat) ran an
    entity for good that wrote an empty routing table for chta; a ProviderAccount for a typo (or
    the wrong provider) ran as a healthy account nothing reports to. The system starts both only
    for what the config and the cluster have, so a fresh start for anything else is a typo."""
    stack.cluster.apply_serving(ServingSpec(model="chat", site="site-a", image="img", replicas=0))
    workflow_id = (f"account/{start['provider']}/{start['account']}" if workflow_type == "ProviderAccount"
                   else f"routing/{start['model']}")
    handle = await start_raw(stack, workflow_type, json.dumps(start), workflow_id=workflow_id)
    failure = await invalid_input(handle, f"invalid {workflow_type}: {field}: ", words)
    assert failure.details == ({"fields": [field]},)
    if workflow_type == "Routing":
        assert "chat" in failure.message
        assert stack.cluster.get_routing("chta") is None, "a routing table written for the typo"
    if history:
        await replay_and_record(handle, history)


async def test_an_entity_whose_account_or_model_left_the_config_runs_on_and_says_so(fleet_world: Stack) -> None:
    """A continued run (its state carried) of an account the config no longer has, or of a model
    no site serves any more, is not refused: it keeps what it holds (a blocked offer, overrides)
    and its details say why nothing reaches it. Each run continues as new for real (``renew``,
    after a deploy whose config dropped the account and once its model's last Deployment went)."""
    client, settings = fleet_world.client, fleet_world.settings
    env = FleetEnv.from_settings(settings)
    fleet_world.cluster.apply_serving(ServingSpec(model="retired", site="site-a", image="img", replicas=0))
    blocked = "site-b/gpu-h100.2gpu"
    async with build_worker(client, settings, env):
        account = await start_raw(fleet_world, "ProviderAccount", json.dumps({"account": "acct-b", "provider": "nebius"}),
                                  workflow_id="account/nebius/acct-b")
        routing = await start_raw(fleet_world, "Routing", json.dumps({"model": "retired"}), workflow_id="routing/retired")
        await account.signal("report", {"account": "acct-b", "kind": "OverQuota", "offer": blocked,
                                        "message": "quota"})
        await wait_for_async(lambda: account.query("status"), lambda s: blocked in s["blocked_offers"])
        await wait_for_async(lambda: details(routing), lambda d: "retired" in d)
        env.config = env.config.model_copy(update={"accounts": env.config.accounts[:1], "sites": env.config.sites[:1]})
        fleet_world.cluster.delete_serving("retired", "site-a")
        first_runs = {account.first_execution_run_id, routing.first_execution_run_id}
        for handle in (account, routing):
            await handle.signal("renew")
        account, routing = (client.get_workflow_handle(h.id) for h in (account, routing))
        shown = await wait_for_async(lambda: details(account), lambda d: "not in the fleet config any more" in d)
        assert "'acct-b' is not in the fleet config (accounts: acct-a)" in shown, shown
        assert blocked in (await account.query("status"))["blocked_offers"]
        await wait_for_async(lambda: details(routing), lambda d: "no site serves this model now: nothing to route" in d)
        for handle in (account, routing):
            described = await handle.describe()
            assert described.status == WorkflowExecutionStatus.RUNNING and described.run_id not in first_runs
            assert await task_failures(handle) == 0
        await terminate_running(client, settings.task_queue)


@pytest.mark.parametrize("payload", ['{"x": 1}', '{"account": "acct-a", "kind": "Broken", "message": "?"}',
                                     '"OverQuota"', "[]"])
async def test_account_report_signal_with_a_bad_payload_is_dropped(stack: Stack, payload: str) -> None:
    handle = await account_entity(stack)
    await handle.signal("report", raw(payload))
    await processed(handle, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
    status = await handle.query("status")
    assert status["state"] == "healthy"
    # It carries on: the next good report is applied.
    await handle.signal("report", {"account": "acct-a", "kind": "OverQuota", "offer": "site-a/gpu_2x_h100",
                                   "message": "quota reached"})
    await wait_for_async(lambda: handle.query("status"), lambda s: s["state"] == "quota-blocked")
    assert await task_failures(handle) == 0


async def test_node_transition_with_missing_fields_is_dropped(stack: Stack) -> None:
    handle = await start_raw(stack, "Site", '{"site": "site-a"}', workflow_id=f"site/site-a-{uuid.uuid4().hex[:6]}")
    await wait_for_async(lambda: handle.query("status"), lambda s: s is not None)
    for payload in ('{"node_name": "site-a-1"}', '{"state": "ready"}', '{"node_name": "", "state": "ready"}'):
        await handle.signal("node_transition", raw(payload))
        await processed(handle, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
        assert "site-a-1" not in (await handle.query("status"))["nodes"]
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
    assert await task_failures(handle) == 0


async def test_spot_notice_with_a_bad_time_is_dropped(idle_fleet: Stack) -> None:
    # No activities run here: the reclaim stays at its first step while the notices arrive.
    stack = idle_fleet
    terminate_at = time.time() + 3600
    handle = await stack.client.start_workflow(
        "SpotReclaim", {"node_name": "site-a-ghost", "site": "site-a", "terminate_at": terminate_at},
        id=f"reclaim/site-a-ghost-{uuid.uuid4().hex[:6]}", task_queue=stack.settings.task_queue,
        start_signal="notice", start_signal_args=[raw('{"terminate_at": "soon"}')],
    )
    await processed(handle, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
    for payload in ('{"terminate_at": "soon"}', '{"terminate_at": 1e400}', '"soon"'):
        await handle.signal("notice", raw(payload))
        await processed(handle, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
    assert await handle.query("step")
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
    assert await task_failures(handle) == 0


async def test_skip_to_an_unknown_rung_is_refused_naming_the_field(idle_fleet: Stack) -> None:
    stack = idle_fleet  # the repair waits at its first step while the updates arrive
    handle = await stack.client.start_workflow(
        "GpuRepair", {"node_name": "site-a-ghost", "gpu": 0, "site": "site-a"},
        id=f"repair/site-a-ghost/{uuid.uuid4().hex[:6]}", task_queue=stack.settings.task_queue,
    )
    await wait_for_async(lambda: handle.query("ladder"), lambda s: s is not None)
    for payload, words in (('{"rung": "explode"}', "rung: Input should be"), ('"replace"', "(input)"),
                           ('{"rung": "reset", "now": true}', "now: unknown field")):
        with pytest.raises(WorkflowUpdateFailedError) as caught:
            await handle.execute_update("skip_to", raw(payload))
        cause = caught.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == "InvalidInput", cause
        assert words in cause.message and "Failed decoding" not in cause.message, cause.message
    with pytest.raises(WorkflowUpdateFailedError) as caught:
        await handle.execute_update("skip_to", args=[raw('{"rung": "reboot"}'), raw('{"rung": "reboot"}')])
    assert caught.value.cause.type == "InvalidInput" and "takes 1 input, got 2" in caught.value.cause.message
    assert (await handle.query("ladder"))["skip_to"] is None
    assert await task_failures(handle) == 0
