"""Determinism checks shared by every workflow's tests.

A scenario test replays its fresh history against today's code with
``replay_and_record``; run with ``GPUFLEET_RECORD=1`` it also writes the history
to tests/histories/, where ``tests/test_replay.py`` replays every recorded file.
Commit recorded files together with the workflow change they belong to.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from temporalio.client import WorkflowHandle, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer
from temporalio.workflow import _Definition

from workers.input_guard import InputGuard
from workers.workflow_runner import workflow_runner
from workflows import ALL_WORKFLOWS

HISTORIES = Path(__file__).parent / "histories"
RECORD = os.environ.get("GPUFLEET_RECORD") == "1"


def replayer(history: WorkflowHistory | None = None) -> Replayer:
    """A replayer as the control plane's worker runs its workflows; for ``history``, of its workflow
    type alone: a replayer checks each type it is given in the sandbox as it starts, and checking all
    seventeen for every replay took most of its time (a history's replay runs its own type only)."""
    workflows = ALL_WORKFLOWS
    if history is not None:
        started = history.events[0].workflow_execution_started_event_attributes.workflow_type.name
        workflows = [defn for defn in ALL_WORKFLOWS if _Definition.must_from_class(defn).name == started] or ALL_WORKFLOWS
    return Replayer(workflows=workflows, data_converter=pydantic_data_converter,
                    interceptors=[InputGuard()], workflow_runner=workflow_runner(pydantic_data_converter))


async def replay(history: WorkflowHistory) -> None:
    """Replay ``history`` against today's code (a replayer of its own workflow type)."""
    await replayer(history).replay_workflow(history)


async def replay_and_record(handle: WorkflowHandle, name: str) -> None:
    """Replay this run's history against today's code; keep it when recording."""
    history = await handle.fetch_history()
    try:
        await replay(history)
    except Exception as error:
        # The evidence of a nondeterminism: the history that did not replay, to replay by hand.
        kept = Path(tempfile.gettempdir()) / f"gpufleet-unreplayable-{name}-{os.getpid()}.json"
        kept.write_text(json.dumps(history.to_json_dict(), indent=1))
        raise AssertionError(f"{handle.id} did not replay against today's code; its history: {kept}") from error
    if RECORD:
        HISTORIES.mkdir(exist_ok=True)
        (HISTORIES / f"{name}.json").write_text(json.dumps(history.to_json_dict(), indent=1))


async def replay_file(path: Path) -> None:
    await replay_history(json.loads(path.read_text()), path.stem)


async def replay_history(data: dict, name: str) -> None:
    """Replay a history as ``fetch_history().to_json_dict()`` gives it (a recorded file's content)."""
    workflow_id = data["events"][0]["workflowExecutionStartedEventAttributes"].get("workflowId", name)
    await replay(WorkflowHistory.from_json(workflow_id, data))
