"""What a workflow's current details say (the UI's "User Metadata" tab), and the bound a wait in
them must name: "until HH:MM:SS UTC", from the workflow's own clock in the task that began the wait.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHandle


async def current_details(handle: WorkflowHandle) -> str:
    metadata = await handle.query("__temporal_workflow_metadata")  # the UI reads its details here
    return metadata.current_details if hasattr(metadata, "current_details") else metadata["currentDetails"]


async def decided(handle: WorkflowHandle, command: Callable[[HistoryEvent], bool], *,
                  last: bool = False) -> tuple[datetime, HistoryEvent] | None:
    """When the workflow issued the first command ``command`` matches (``last``: the latest), by its
    own clock (``workflow.now()`` in a task is that task's WorkflowTaskStarted time), and the
    command's event; None before it did."""
    found, task_time = None, None
    for event in (await handle.fetch_history()).events:
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            task_time = event.event_time.ToDatetime(tzinfo=timezone.utc)
        elif command(event):
            found = (task_time, event)
            if not last:
                break
    return found


async def scheduled(handle: WorkflowHandle, activity_type: str, *,
                    last: bool = False) -> tuple[datetime, dict[str, Any]] | None:
    """When the workflow scheduled ``activity_type`` (``decided``), and the activity's input as JSON."""
    found = await decided(handle, lambda event: (
        event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and event.activity_task_scheduled_event_attributes.activity_type.name == activity_type), last=last)
    if found is None:
        return None
    payloads = found[1].activity_task_scheduled_event_attributes.input.payloads
    return found[0], json.loads(payloads[0].data) if payloads else {}


def until(at: datetime, seconds: float = 0) -> str:
    """The bound as the details say it."""
    return f"until {at + timedelta(seconds=seconds):%H:%M:%S} UTC"


def held(monkeypatch, owner: type, name: str) -> tuple[threading.Event, threading.Event]:
    """``owner.<name>`` (a plain method of the simulated fleet: a provider's create, a GPU's reset)
    holds every call until the returned ``release`` is set (30 s at most), and sets ``entered`` as
    one comes in: a step held open while a test reads what its workflow says of the wait."""
    entered, release, answer = threading.Event(), threading.Event(), getattr(owner, name)

    def holding(self, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(30)
        return answer(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, holding)
    return entered, release
