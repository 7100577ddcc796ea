"""The workflow runner of gpufleet's workers: the SDK's sandbox, minus one per-payload cost.

For every payload of every activation, temporalio 1.35 asks the sandboxed
workflow which serialization context and which external-storage context the
payload belongs to, each time by compiling and exec'ing a code string inside
the sandbox. Under bench/join_overhead that was about 30% of the control-plane
worker's CPU. The contexts exist for converters, codecs and storage drivers that
vary by activity or child workflow. gpufleet's data converter (pydantic, no
codec, no external storage) ignores them. While that holds, the instances made
here answer from outside the sandbox with the workflow's own contexts. Anything
else (activations, the sandbox and its restrictions, deadlock detection) is
still the SDK's.
"""

from __future__ import annotations

from typing import Sequence

from temporalio.converter import DataConverter, WithSerializationContext, WorkflowSerializationContext
from temporalio.worker import (
    WorkflowInstance,
    WorkflowInstanceDetails,
    WorkflowRunner,
)
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner
from temporalio.workflow import _Definition

from workers.start_input import StartInputRunner


def ignores_context(data_converter: DataConverter) -> bool:
    """True when no part of the converter changes with the serialization context."""
    parts = (data_converter.payload_converter, data_converter.payload_codec, data_converter.failure_converter)
    probe = WorkflowSerializationContext(namespace="probe", workflow_id="probe")
    return (
        data_converter.external_storage is None
        and data_converter.payload_codec is None
        and all(not isinstance(p, WithSerializationContext) or p.with_context(probe) is p for p in parts)
    )


def workflow_runner(data_converter: DataConverter) -> WorkflowRunner:
    """The runner for a worker (or replayer) using ``data_converter``."""
    sandbox = SandboxedWorkflowRunner()
    return StartInputRunner(ContextFreeRunner(sandbox) if ignores_context(data_converter) else sandbox)


class ContextFreeRunner(WorkflowRunner):
    def __init__(self, inner: WorkflowRunner) -> None:
        self._inner = inner

    def prepare_workflow(self, defn: _Definition) -> None:
        self._inner.prepare_workflow(defn)

    def create_instance(self, det: WorkflowInstanceDetails) -> WorkflowInstance:
        return _ContextFreeInstance(self._inner.create_instance(det), det)

    def set_worker_level_failure_exception_types(self, types: Sequence[type[BaseException]]) -> None:
        self._inner.set_worker_level_failure_exception_types(types)


class _ContextFreeInstance(WorkflowInstance):
    def __init__(self, inner: WorkflowInstance, det: WorkflowInstanceDetails) -> None:
        self._inner = inner
        # What the SDK uses for a payload not tied to a command; the worker keeps a
        # converter ready for exactly this context, so no converter is built per payload.
        self._context = WorkflowSerializationContext(namespace=det.info.namespace, workflow_id=det.info.workflow_id)
        self._store_context = None

    def activate(self, act):
        return self._inner.activate(act)

    def get_serialization_context(self, command_info):
        return self._context

    def get_external_store_context(self, command_info):
        # Read only by an external storage driver, and there is none: ask the sandbox once.
        if self._store_context is None:
            self._store_context = self._inner.get_external_store_context(None)
        return self._store_context

    def get_info(self):
        return self._inner.get_info()

    def get_thread_id(self):
        return self._inner.get_thread_id()
