"""Putting a child workflow's end and the parent's cancel in one workflow task, under either way
temporalio runs an activation's jobs (tests/test_repair_cancel.py, tests/test_capacity_converges.py)."""

from __future__ import annotations

import threading
import time

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle

from workers.workflow_runner import _ContextFreeInstance

#: The ways to run a workflow task's jobs (a stack fixture's params, for ``jobs_applied``).
JOB_MODES = ["jobs-in-sets", "jobs-as-one-batch"]


def jobs_applied(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """New workflow tasks run as temporalio 1.35 does by default (an activation's jobs applied in
    sets, each set then run: ``jobs-in-sets``), or apply all of an activation's jobs before running
    any (``jobs-as-one-batch``: its logic flag 2, PROCESS_WORKFLOW_ACTIVATION_JOBS_AS_SINGLE_BATCH,
    which a later temporalio turns on by default: a child's end and a cancel in one task then raise
    the cancel where the child is awaited). Call before the worker is built."""
    if mode == "jobs-as-one-batch":
        from temporalio.worker import _workflow
        from temporalio.worker._workflow_instance import _WorkflowLogicFlag

        monkeypatch.setattr(_workflow, "_DEFAULT_ENABLED_WORKFLOW_LOGIC_FLAGS",
                            frozenset({_WorkflowLogicFlag.PROCESS_WORKFLOW_ACTIVATION_JOBS_AS_SINGLE_BATCH}))


def in_one_task(monkeypatch: pytest.MonkeyPatch, workflow_id: str, first: str, then: str) -> threading.Event:
    """Every workflow task of ``workflow_id`` whose activation carries a ``first`` job (a job's
    variant: ``cancel_workflow``, ``resolve_child_workflow_execution``) and no ``then`` one fails,
    so the server hands the run both in one task once ``then`` came. Returns: a task was held."""
    held_one = threading.Event()
    activate = _ContextFreeInstance.activate

    def holding(self: _ContextFreeInstance, act):
        jobs = {job.WhichOneof("variant") for job in act.jobs}
        if self._context.workflow_id == workflow_id and first in jobs and then not in jobs:
            held_one.set()
            time.sleep(0.2)  # not spinning while `then` comes
            raise RuntimeError(f"test: this task waits for {then}")
        return activate(self, act)

    monkeypatch.setattr(_ContextFreeInstance, "activate", holding)
    return held_one


async def one_task_had_both(handle: WorkflowHandle) -> bool:
    """A child's end and the cancel request came in one workflow task (with the failed ones)."""
    kinds = [e.event_type for e in (await handle.fetch_history()).events]
    ends = {EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED,
            EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED}
    between = kinds[min(kinds.index(k) for k in ends):max(kinds.index(k) for k in ends)]
    return EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED not in between
