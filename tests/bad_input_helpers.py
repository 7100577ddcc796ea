"""Sending bad input the way an operator does, and checking that nothing wedged."""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from tests.conftest import Stack, terminate_running
from workers.control_plane import worker_interceptors
from workers.workflow_runner import workflow_runner
from workflows import ALL_WORKFLOWS


@asynccontextmanager
async def idle_workflows(fleet_world: Stack) -> AsyncIterator[Stack]:
    """The control plane's workflows with its interceptors but no activities: each workflow
    stops at its first activity, so nothing reaches a provider and entities stay running."""
    client = fleet_world.client
    async with Worker(client, task_queue=fleet_world.settings.task_queue, workflows=ALL_WORKFLOWS,
                      interceptors=worker_interceptors(), workflow_runner=workflow_runner(client.data_converter)):
        yield fleet_world
        await terminate_running(client, fleet_world.settings.task_queue)


def raw(text: str) -> RawValue:
    """A payload exactly as typed: what ``temporal ... --input TEXT`` sends."""
    return RawValue(Payload(metadata={"encoding": b"json/plain"}, data=text.encode()))


async def start_raw(stack: Stack, workflow_type: str, *inputs: str, workflow_id: str = "") -> WorkflowHandle:
    return await stack.client.start_workflow(
        workflow_type, args=[raw(text) for text in inputs],
        id=workflow_id or f"bad-input/{workflow_type}/{uuid.uuid4().hex[:8]}", task_queue=stack.settings.task_queue,
    )


async def task_failures(handle: WorkflowHandle) -> int:
    history = await handle.fetch_history()
    return sum(e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED for e in history.events)


async def invalid_input(handle: WorkflowHandle, *names: str) -> ApplicationError:
    """The workflow failed fast, non-retryable InvalidInput, naming ``names``, no task failure."""
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(handle.result(), 15)
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError), cause
    assert cause.type == "InvalidInput" and cause.non_retryable, cause
    for name in names:
        assert name in cause.message, cause.message
    assert "pydantic.dev" not in cause.message
    assert await task_failures(handle) == 0
    return cause


async def processed(handle: WorkflowHandle, event: EventType.ValueType) -> None:
    """Wait until a workflow task after the latest ``event`` (a signal) has ended one way or the other."""
    async def ended() -> bool:
        events = (await handle.fetch_history()).events
        marks = [e.event_id for e in events if e.event_type == event]
        return bool(marks) and any(
            e.event_id > marks[-1] and e.event_type in (EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED,
                                                        EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)
            for e in events
        )

    deadline = time.monotonic() + 15
    while not await ended():
        assert time.monotonic() < deadline, "the signal was never processed"
        await asyncio.sleep(0.1)


async def wait_for_async(read, check, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while True:
        value = await read()
        if check(value):
            return value
        assert time.monotonic() < deadline, f"condition not met: {value}"
        await asyncio.sleep(0.1)


