"""A node answers its activity not with a result but with a failure, a heartbeat or a
cancellation carrying payloads nobody can decode.

The SDK decodes an activity failure's payloads in the workflow's activation, before any
workflow code can catch the ``ActivityError``: an ``ApplicationError``'s ``details`` (and
``encoded_attributes``, and every ``cause``'s), a ``TimeoutError``'s last heartbeat details, a
cancellation's details (temporalio's failure converter, ``from_failure``). Before the fix the
gateway forwarded a node's ``RespondActivityTaskFailed`` failure whole and its heartbeat and
cancellation details untouched, so one detail in an encoding nobody speaks
(``binary/hostile``) failed, on every retry, the workflow task of whichever workflow scheduled
the activity: the Node entity's watch stopped (two failed tasks within seconds), and a
SiteEvacuation whose proof ran on that node was stuck with its site at weight 0.

Now the gateway rebuilds every failure a node sends (``authorization.clean_failure``): its
message (cut short), its application type and ``non_retryable`` flag (the retry policies and
workflows match on them), the end of its stack trace and one cause, cleaned the same way; no
payloads. Heartbeat and cancellation details are dropped (nothing in gpufleet reads a node
activity's).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from temporalio import activity, workflow
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.failure.v1 import ApplicationFailureInfo, Failure, TimeoutFailureInfo
from temporalio.api.workflowservice.v1 import (
    RecordActivityTaskHeartbeatRequest,
    RespondActivityTaskCanceledRequest,
    RespondActivityTaskCompletedRequest,
    RespondActivityTaskFailedRequest,
)
from temporalio.client import WorkflowExecutionStatus
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.node_agent import NodeAgentActivities
from fleet.messages.nodes import SmokeTestInput
from fleet.naming import node_queue
from tests.bad_input_helpers import task_failures
from tests.conftest import NODE_GATEWAYS
from tests.evacuation_helpers import open_incident_stack
from tests.gateway_keys import token_keys_as_deployed
from tests.repair_helpers import eventually
from tests.security.gateway_helpers import credentials, end_entity, live_entity, unique
from tests.security.test_node_reports import entity, hostile  # noqa: F401 - the fixture
from workers.gateway.authorization import (
    FAILURE_MESSAGE_CHARS,
    FAILURE_STACK_CHARS,
    REFUSED_RESULT_ENCODING,
    GatewayStats,
    NodeAuthorization,
)
from workers.gateway.task_tokens import TaskTokens
from workers.node_agent import connect_via_gateway

HOSTILE = Payload(metadata={"encoding": b"binary/hostile"}, data=b"\x00")
HOSTILE_DETAILS = Payloads(payloads=[HOSTILE])


def _authorized(name: str, request) -> bytes:
    """``request`` as the gateway forwards it from node n1, its token (``tok``) as delivered to n1."""
    auth = NodeAuthorization("default", GatewayStats(), TaskTokens(token_keys_as_deployed()))
    request.task_token = auth.tokens.seal("n1", request.task_token)
    forwarded, token = auth.authorize("n1", name, request.SerializeToString())
    assert token == b"tok"
    return forwarded


def _hostile_failure(message: str, type: str, depth: int) -> Failure:
    failure = Failure(message=message, source="PythonSDK", stack_trace="s" * 10_000,
                      encoded_attributes=HOSTILE,
                      application_failure_info=ApplicationFailureInfo(type=type, non_retryable=True,
                                                                      details=HOSTILE_DETAILS))
    failure.application_failure_info.next_retry_delay.FromSeconds(0)
    if depth:
        failure.cause.CopyFrom(_hostile_failure(f"cause {depth}", f"Cause{depth}", depth - 1))
    return failure


def test_a_nodes_failure_is_forwarded_as_message_type_and_flag_without_payloads() -> None:
    request = RespondActivityTaskFailedRequest(
        namespace="default", task_token=b"tok", failure=_hostile_failure("m" * 100_000, "GpuResetFailed", 3),
        last_heartbeat_details=HOSTILE_DETAILS)
    out = RespondActivityTaskFailedRequest.FromString(_authorized("RespondActivityTaskFailed", request))
    failure = out.failure
    assert failure.message == "m" * FAILURE_MESSAGE_CHARS
    assert failure.application_failure_info == ApplicationFailureInfo(type="GpuResetFailed", non_retryable=True)
    assert len(failure.stack_trace) == FAILURE_STACK_CHARS
    assert not failure.HasField("encoded_attributes") and not failure.source
    assert not out.HasField("last_heartbeat_details")
    # One cause, cleaned the same way; none below it.
    assert failure.cause.message == "cause 3"
    # A type no node agent raises arrives as NodeError (workflows decide on types).
    assert failure.cause.application_failure_info == ApplicationFailureInfo(type="NodeError", non_retryable=True)
    assert not failure.cause.HasField("encoded_attributes") and not failure.cause.HasField("cause")
    # A failure of another kind (here a timeout with heartbeat details) is an untyped, retryable one.
    timeout = Failure(message="late", timeout_failure_info=TimeoutFailureInfo(last_heartbeat_details=HOSTILE_DETAILS))
    out = RespondActivityTaskFailedRequest.FromString(_authorized(
        "RespondActivityTaskFailed", RespondActivityTaskFailedRequest(namespace="default", task_token=b"tok",
                                                                      failure=timeout)))
    assert out.failure == Failure(message="late", application_failure_info=ApplicationFailureInfo())


@pytest.mark.parametrize("kind", ["BadCredentials", "OverQuota", "InvalidRequest", "NoCapacity", "x" * 200])
def test_a_node_cannot_send_a_failure_type_its_agent_never_raises(kind: str) -> None:
    """A type decides things (``BadCredentials`` revokes a provider account, ``OverQuota`` blocks
    an offer, ``InvalidRequest`` ends a capacity request): a node's failure keeps its type only when
    it is one a node's agent raises; any other is ``NodeError``, its flag and message kept."""
    request = RespondActivityTaskFailedRequest(
        namespace="default", task_token=b"tok",
        failure=Failure(message="forged", application_failure_info=ApplicationFailureInfo(type=kind, non_retryable=True)))
    out = RespondActivityTaskFailedRequest.FromString(_authorized("RespondActivityTaskFailed", request))
    assert out.failure.application_failure_info == ApplicationFailureInfo(type="NodeError", non_retryable=True)
    assert out.failure.message == "forged"


def test_every_failure_type_a_node_agent_raises_is_forwarded() -> None:
    """The list the gateway keeps cannot fall behind the agent's code."""
    import re
    from pathlib import Path

    from workers.gateway.authorization import NODE_FAILURE_TYPES

    source = (Path(__file__).resolve().parents[2] / "activities" / "node_agent.py").read_text()
    raised = set(re.findall(r'type="([A-Za-z]+)"', source))
    assert raised and raised <= NODE_FAILURE_TYPES, raised - NODE_FAILURE_TYPES


def test_a_nodes_heartbeat_and_cancellation_details_are_dropped() -> None:
    beat = RecordActivityTaskHeartbeatRequest(namespace="default", task_token=b"tok", details=HOSTILE_DETAILS)
    out = RecordActivityTaskHeartbeatRequest.FromString(_authorized("RecordActivityTaskHeartbeat", beat))
    assert out == RecordActivityTaskHeartbeatRequest(namespace="default", task_token=b"tok", identity="node:n1")
    bye = RespondActivityTaskCanceledRequest(namespace="default", task_token=b"tok", details=HOSTILE_DETAILS)
    out = RespondActivityTaskCanceledRequest.FromString(_authorized("RespondActivityTaskCanceled", bye))
    assert out == RespondActivityTaskCanceledRequest(namespace="default", task_token=b"tok", identity="node:n1")


def test_a_nodes_result_is_one_json_payload_and_nothing_else() -> None:
    """The SDK looks at a result's metadata before workflow code runs: a result keeps one payload,
    its data and ``encoding: json/plain``; any other form is one payload nobody decodes, saying
    why (end to end: ``test_node_reports.test_a_result_in_a_form_the_sdk_acts_on_fails_no_task``)."""
    def completed(result: Payloads | None) -> Payloads:
        request = RespondActivityTaskCompletedRequest(namespace="default", task_token=b"tok", result=result)
        return RespondActivityTaskCompletedRequest.FromString(_authorized("RespondActivityTaskCompleted", request)).result

    report = Payload(metadata={"encoding": b"json/plain", "__temporal_external_storage_reference": b"true",
                               "messageType": b"x"}, data=b'{"seq": 1}',
                     external_payloads=[Payload.ExternalPayloadDetails(size_bytes=1)])
    assert completed(Payloads(payloads=[report])) == Payloads(
        payloads=[Payload(metadata={"encoding": b"json/plain"}, data=b'{"seq": 1}')])
    plain = Payload(metadata={"encoding": b"json/plain"}, data=b"1")
    refused = {
        "encoding 'json/external-storage-reference'": Payloads(payloads=[
            Payload(metadata={"encoding": b"json/external-storage-reference"}, data=b"{}")]),
        "encoding 'json/protobuf'": Payloads(payloads=[Payload(metadata={
            "encoding": b"json/protobuf", "messageType": b"temporal.api.sdk.v1.ExternalStorageReference"})]),
        "encoding 'binary/protobuf'": Payloads(payloads=[Payload(metadata={
            "encoding": b"binary/protobuf", "messageType": b"temporal.api.common.v1.Payload"}, data=b"\x0a\x01x")]),
        "encoding ''": Payloads(payloads=[Payload(data=b"1")]),
        "2 payloads": Payloads(payloads=[plain, plain]),
        "0 payloads": Payloads(),
    }
    for why, result in [*refused.items(), ("0 payloads", None)]:
        (payload,) = completed(result).payloads
        assert payload.metadata == {"encoding": REFUSED_RESULT_ENCODING}, why
        assert why in payload.data.decode(), (why, payload.data)


# -- end to end: a workflow that schedules an activity on a node's queue -----------------------
@activity.defn(name="fail_with_hostile_details")
async def fail_with_hostile_details(_: str) -> None:
    try:
        raise RuntimeError("the reset tool said no")
    except RuntimeError as error:
        raise ApplicationError("reset failed", RawValue(HOSTILE), type="GpuResetFailed",
                               non_retryable=True) from error


@activity.defn(name="stall_after_a_hostile_heartbeat")
async def stall_after_a_hostile_heartbeat(_: str) -> None:
    activity.heartbeat(RawValue(HOSTILE))
    await asyncio.sleep(10)  # past its heartbeat timeout


@workflow.defn(name="SecurityNodeFailure", sandboxed=False)
class NodeFailure:
    """Runs one activity on a node's queue and says what failure the workflow code saw."""

    @workflow.run
    async def run(self, args: list) -> dict[str, Any]:
        queue, name, attempts = args
        try:
            await workflow.execute_activity(name, "x", task_queue=queue, start_to_close_timeout=timedelta(seconds=20),
                                            heartbeat_timeout=timedelta(seconds=1),
                                            retry_policy=RetryPolicy(maximum_attempts=attempts))
        except ActivityError as error:
            cause, root = error.cause, error.cause.__cause__ if error.cause else None
            return {"kind": type(cause).__name__, "type": getattr(cause, "type", None),
                    "non_retryable": getattr(cause, "non_retryable", None), "message": cause.message,
                    "details": len(getattr(cause, "details", ()) or ()), "attempts": error.retry_state.name,
                    "root": getattr(root, "type", None), "root_message": getattr(root, "message", None)}
        return {}


async def test_a_nodes_typed_failure_and_heartbeat_with_undecodable_details_reach_the_workflow(temporal_env) -> None:
    """The workflow still sees the node's typed, non-retryable error (message, type, flag and
    the error it was raised from), and a heartbeat timeout, with no failed workflow task."""
    gateway = NODE_GATEWAYS[temporal_env.client.service_client.config.target_host]
    control, name = temporal_env.client, unique("fail")
    await live_entity(control, name)
    node = credentials(gateway.pki, name)
    try:
        node_client = await connect_via_gateway(gateway.access, "default", node.cert, node.key)
        queue = unique("security-failure")
        async with Worker(control, task_queue=queue, workflows=[NodeFailure], workflow_runner=UnsandboxedWorkflowRunner()), \
                Worker(node_client, task_queue=node_queue(name),
                       activities=[fail_with_hostile_details, stall_after_a_hostile_heartbeat]):
            failed = await control.start_workflow("SecurityNodeFailure", [node_queue(name), "fail_with_hostile_details", 3],
                                                  id=unique("security-failure"), task_queue=queue)
            stalled = await control.start_workflow("SecurityNodeFailure",
                                                   [node_queue(name), "stall_after_a_hostile_heartbeat", 1],
                                                   id=unique("security-stall"), task_queue=queue)
            seen = await asyncio.wait_for(failed.result(), 20)
            assert seen == {"kind": "ApplicationError", "type": "GpuResetFailed", "non_retryable": True,
                            "message": "reset failed", "details": 0, "attempts": "NON_RETRYABLE_FAILURE",
                            # The cause's own type (a Python exception's name) is not one an agent raises.
                            "root": "NodeError", "root_message": "the reset tool said no"}
            timed_out = await asyncio.wait_for(stalled.result(), 20)
            assert timed_out["kind"] == "TimeoutError" and timed_out["details"] == 0, timed_out
            assert await task_failures(failed) == 0 and await task_failures(stalled) == 0
    finally:
        await end_entity(control, name)


async def test_a_failure_with_undecodable_details_fails_no_entity_task(hostile) -> None:  # noqa: F811
    """The node's watch fails, non-retryable, with one detail in an encoding nobody speaks:
    the entity counts a bad report and watches on, with no failed workflow task."""
    stack, node, watch = hostile
    handle = entity(stack, node)
    before = len(watch.inputs)

    def failing(_input):
        raise ApplicationError("the node says no", RawValue(HOSTILE), non_retryable=True)

    if watch._newest is not None and not watch._newest.done():
        watch._newest.set_result(failing)
    else:
        watch._queued = failing

    async def settled() -> bool:
        return len(watch.inputs) > before or await task_failures(handle) > 0

    await eventually(settled, timeout=20)
    await asyncio.sleep(3)  # a failed workflow task would be retried (and fail) within this
    failures = await task_failures(handle)
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
    assert failures == 0, f"{failures} failed workflow tasks of node/{node.node_name}: the entity is stuck"
    assert len(watch.inputs) > before, "the entity scheduled no further watch"


async def test_a_failed_proof_with_undecodable_details_does_not_stick_the_evacuation(
        temporal_env, tmp_path, monkeypatch) -> None:
    """Three of a site's four nodes fail (an incident: the site goes to weight 0) and recover;
    the fourth fails its proof with an undecodable detail. The evacuation ends, with no failed
    workflow task, and the site is back at weight 100 (before: stuck at 0)."""
    liars: set[str] = set()
    honest = NodeAgentActivities.smoke_test

    @activity.defn(name="smoke_test")
    def smoke_test(self, input: SmokeTestInput) -> Any:  # no hint on self: the SDK skips it
        if self.node_name in liars and activity.info().workflow_type == "SiteEvacuation":
            raise ApplicationError("no", RawValue(HOSTILE), non_retryable=True)
        return honest(self, input)

    monkeypatch.setattr(NodeAgentActivities, "smoke_test", smoke_test)
    async for inc in open_incident_stack(temporal_env.client, tmp_path):
        evacuation, _liar = await inc.evacuate_with_a_liar("a", liars.add)
        try:
            await asyncio.wait_for(evacuation.result(), 90)
        except asyncio.TimeoutError:
            pass
        failures = await task_failures(evacuation)
        weight = inc.cluster.get_site_routes().sites[inc.site("a")].weight
        assert failures == 0 and weight == 100, f"{failures} failed workflow tasks; site weight {weight}"
