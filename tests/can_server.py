"""A Temporal dev server of a test's own that suggests continue-as-new after a few events, so
an entity reaches its continue-as-new path within seconds (the default is thousands), and an
interceptor that holds one activity where the test wants a run caught mid-step."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, AsyncIterator, NoReturn

from temporalio import activity
from temporalio.client import Client, WorkflowHandle, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.api.enums.v1 import EventType
from temporalio.worker import (
    ActivityInboundInterceptor,
    ContinueAsNewInput,
    ExecuteActivityInput,
    Interceptor,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

from cli.dev import dev_server_tuning_flags, temporal_binary
from fleet import search_attributes


@asynccontextmanager
async def server_suggesting_continue_as_new(after_events: int) -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), data_converter=pydantic_data_converter,
        search_attributes=search_attributes.ALL, dev_server_log_level="error",
        dev_server_extra_args=[*dev_server_tuning_flags(), "--dynamic-config-value",
                               f"limit.historyCount.suggestContinueAsNew={after_events}"],
    )
    try:
        yield env
    finally:
        await env.shutdown()


async def runs(client: Client, workflow_id: str) -> int:
    """How many runs of ``workflow_id`` the server has (each continue-as-new adds one)."""
    return len([w async for w in client.list_workflows(f'WorkflowId = "{workflow_id}"')])


async def run_chain(client: Client, workflow_id: str, first_run_id: str) -> list[WorkflowHistory]:
    """The histories of every run, first to latest, following continue-as-new."""
    histories = []
    run_id = first_run_id
    while True:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        histories.append(history)
        last = history.events[-1]
        if not last.HasField("workflow_execution_continued_as_new_event_attributes"):
            return histories
        run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id


async def history_length(handle: WorkflowHandle) -> int:
    return (await handle.describe()).raw_description.workflow_execution_info.history_length


class Hold(Interceptor):
    """Holds the next run of one activity (a local one too) once ``armed``, until ``release``
    is set; ``holding`` is set while it holds."""

    def __init__(self, name: str) -> None:
        self.name, self.armed = name, False
        self.holding, self.release = asyncio.Event(), asyncio.Event()

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        gate = self

        class Inbound(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                if gate.armed and activity.info().activity_type == gate.name:
                    gate.armed = False
                    gate.holding.set()
                    await gate.release.wait()
                return await super().execute_activity(input)

        return Inbound(next)


class FirstTaskHeldBack(Interceptor):
    """Each run continued as new starts its first workflow task ``seconds`` later (the server's
    backoff, as a cron run's): long enough for a test's update to reach that first task, which a
    worker otherwise takes the moment the run before continues."""

    def __init__(self, seconds: float = 3.0) -> None:
        self.seconds = seconds

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
        delay = timedelta(seconds=self.seconds)

        class Outbound(WorkflowOutboundInterceptor):
            def continue_as_new(self, input: ContinueAsNewInput) -> NoReturn:
                input.backoff_start_interval = delay
                super().continue_as_new(input)

        class Inbound(WorkflowInboundInterceptor):
            def init(self, outbound: WorkflowOutboundInterceptor) -> None:
                super().init(Outbound(outbound))

        return Inbound


async def update_in_first_task(handle: WorkflowHandle) -> bool:
    """Whether the run's first update was accepted by its first workflow task."""
    kinds = [e.event_type for e in (await handle.fetch_history()).events]
    accepted = kinds.index(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED)
    return kinds[:accepted].count(EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED) == 1
