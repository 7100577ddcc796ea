"""Undecodable start (and update) arguments become a marker the input guard refuses.

The SDK decodes a workflow's start arguments before any interceptor runs, and a
payload it cannot decode at all (JSON the data converter's parser refuses, such
as a lone surrogate escape, which the ``temporal`` CLI lets through) fails the
workflow *task*, retried forever. This runner looks at each start argument first
and swaps an undecodable one for a small JSON object saying why; the input guard
(workers/input_guard.py) then fails the workflow with ``InvalidInput``. The same
bytes always get the same swap, so replay is unchanged; decodable input is never
touched.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from pydantic import ValidationError
from temporalio.api.common.v1 import Payload
from temporalio.worker import WorkflowInstance, WorkflowInstanceDetails, WorkflowRunner
from temporalio.workflow import _Definition

#: The one key of the object that stands in for an undecodable argument.
UNDECODABLE = "$gpufleet-undecodable"


def undecodable_reason(value: Any) -> str | None:
    """Why the argument could not be decoded, when ``value`` is the stand-in; else None."""
    if isinstance(value, dict) and len(value) == 1 and UNDECODABLE in value:
        return str(value[UNDECODABLE])
    return None


def _reason(error: BaseException) -> str:
    """The converter's words (pydantic's without the type tag and documentation URL)."""
    for candidate in (error, error.__cause__):
        if isinstance(candidate, ValidationError) and candidate.errors(include_url=False):
            return str(candidate.errors(include_url=False)[0]["msg"])
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


class StartInputRunner(WorkflowRunner):
    def __init__(self, inner: WorkflowRunner) -> None:
        self._inner = inner

    @property
    def inner(self) -> WorkflowRunner:
        """The runner that runs the workflows once their start arguments are decodable."""
        return self._inner

    def prepare_workflow(self, defn: _Definition) -> None:
        self._inner.prepare_workflow(defn)

    def create_instance(self, det: WorkflowInstanceDetails) -> WorkflowInstance:
        return _StartInputInstance(self._inner.create_instance(det), det)

    def set_worker_level_failure_exception_types(self, types: Sequence[type[BaseException]]) -> None:
        self._inner.set_worker_level_failure_exception_types(types)


class _StartInputInstance(WorkflowInstance):
    def __init__(self, inner: WorkflowInstance, det: WorkflowInstanceDetails) -> None:
        self._inner = inner
        self._det = det

    def activate(self, act):
        for job in act.jobs:
            if job.HasField("initialize_workflow"):
                self._swap_undecodable(job.initialize_workflow.arguments)
            elif job.HasField("do_update"):
                # The same for an update's arguments: the SDK would refuse it as "Failed decoding
                # arguments" (a retryable RuntimeError naming nothing); the guard refuses it as
                # InvalidInput. A refused update leaves no event, so replay never meets one.
                self._swap_undecodable(job.do_update.input)
        return self._inner.activate(act)

    def _swap_undecodable(self, arguments) -> None:
        converter = None
        for payload in arguments:
            converter = converter or self._det.payload_converter_factory()
            try:
                converter.from_payloads([payload], [Any])
            except Exception as error:  # noqa: BLE001 - whatever the converter refuses
                why = _reason(error)
                payload.CopyFrom(Payload(metadata={"encoding": b"json/plain"},
                                         data=json.dumps({UNDECODABLE: why[:500]}).encode()))

    def get_serialization_context(self, command_info):
        return self._inner.get_serialization_context(command_info)

    def get_external_store_context(self, command_info):
        return self._inner.get_external_store_context(command_info)

    def get_info(self):
        return self._inner.get_info()

    def get_thread_id(self):
        return self._inner.get_thread_id()
