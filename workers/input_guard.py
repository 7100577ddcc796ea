"""The input guard: no start input, signal or update argument can wedge a workflow.

With temporalio's pydantic converter, a workflow started with no input, two
inputs, or a JSON value its ``run`` cannot take does not fail: every workflow
task raises and is retried forever (a signal handler called with the wrong
number of arguments does the same). The SDK decodes arguments before any
interceptor runs, so workflows type raw inputs as ``Any`` (decoding cannot fail
for JSON) and this inbound interceptor checks their shape before workflow code:

- start: the argument count, a JSON object where ``run`` takes one, and no
  argument the data converter could not decode (workers/start_input.py); a bad
  start fails the workflow at once with a non-retryable ``InvalidInput`` (``run``
  then validates the object against its model the same way);
- signal: the argument count; a bad signal is logged with the reason and dropped
  (handlers validate their payload with ``workflows.inputs.parse_signal``, or
  take a model the SDK decodes, dropping what it cannot; a payload of another
  encoding than JSON, which the SDK hands over undecoded as None, bytes or a
  protobuf message, is dropped here);
- update: the argument count; a bad update is refused with ``InvalidInput``
  (validators check their payload with ``parse_input`` / ``check_text``).

Every argument also passes ``workflows.inputs.first_problem`` (finite numbers,
bounded strings and nesting). Valid input passes through untouched: no command
changes, so recorded histories replay as before.

A start input's ``Carried`` fields (``carry``, an entity's ``state``: what a run hands the run
it continues as new with, ``INPUT`` on the workflow class names the model) are refused in a run
that did not continue as new (``workflow.info().continued_run_id`` is None): a caller's carry
made the workflow take the start for a continued one and skip every check of a fresh start (a
join-token lifetime, a count the site can hold, constraints that name nothing), and its state
was trusted as the workflow's own (a naive deadline failed every workflow task; an evacuation's
``acquired`` machines were retired at its end). A reset run keeps its first run's start event,
so it is judged as that run was; a cron or retry run holds its first run's input.
"""

from __future__ import annotations

import inspect
import types
import typing
import weakref
from typing import Any, Callable

from pydantic import BaseModel
from temporalio import workflow
from temporalio.workflow import _Definition
from temporalio.worker import (
    ExecuteWorkflowInput,
    HandleSignalInput,
    HandleUpdateInput,
    Interceptor,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)

from fleet.models import CARRIED_BY_CALLER, carried_by_caller
from workers.start_input import undecodable_reason
from workflows.inputs import first_problem, invalid_input, json_kind


class InputGuard(Interceptor):
    """Pass to every ``Worker`` and ``Replayer`` that runs gpufleet's workflows."""

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
        return _GuardInbound


def _model(hint: Any) -> tuple[type[BaseModel] | None, bool]:
    """A parameter typed with a model (``HealthReport``, optionally ``| None``): the model, and
    whether it may be None; ``(None, True)`` for any other parameter."""
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return hint, False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1 and set(args) <= {models[0], type(None)}:
            return models[0], type(None) in args
    return None, True


def _wants_object(hint: Any) -> bool:
    """A raw-JSON parameter (``Any``, ``dict``, optionally ``| None``): it must get a JSON object."""
    if hint is Any or hint is object or hint is dict or typing.get_origin(hint) is dict:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_wants_object(a) for a in typing.get_args(hint) if a is not type(None))
    return False


#: The sandbox re-imports workflow modules per run: weak keys let each run's functions go.
_shapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shape(fn: Callable) -> tuple[inspect.Signature, tuple[bool, ...], tuple[bool, ...], tuple[tuple[Any, bool], ...]]:
    """The function's signature without ``self``; per parameter: wants an object, is optional,
    the model it is typed with (see ``_model``)."""
    known = _shapes.get(fn)
    if known is not None:
        return known
    signature = inspect.signature(fn)
    params = [p for p in signature.parameters.values() if p.name != "self"]
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable hints: check the count only
        hints = {}
    wants = tuple(_wants_object(hints.get(p.name, None)) for p in params)
    optional = tuple(p.default is not inspect.Parameter.empty for p in params)
    models = tuple(_model(hints.get(p.name, None)) for p in params)
    _shapes[fn] = shape = (signature.replace(parameters=params), wants, optional, models)
    return shape


def _count_problem(what: str, fn: Callable, args: typing.Sequence[Any]) -> str | None:
    signature, _, optional, _ = _shape(getattr(fn, "__func__", fn))
    try:
        signature.bind(*args)
    except TypeError:
        required, most = optional.count(False), len(optional)
        takes = f"{required}" if required == most else f"{required} to {most}"
        return f"{what} takes {takes} input{'s' if most != 1 else ''}, got {len(args)}"
    return None


def problem_with(what: str, fn: Callable, args: typing.Sequence[Any], objects: bool = False) -> tuple[str, str] | None:
    """``(field, problem)`` when ``args`` cannot be passed to ``fn`` as they are; else None.

    ``objects``: a raw-JSON parameter must get a JSON object (a start input; handlers
    that take free text or a model check their own arguments)."""
    for arg in args:
        reason = undecodable_reason(arg)
        if reason is not None:
            return "(input)", f"{what} got input that cannot be decoded: {reason}"
    count = _count_problem(what, fn, args)
    if count is not None:
        return "(input)", count
    _, wants, optional, models = _shape(getattr(fn, "__func__", fn))
    for want, opt, (model, nullable), arg in zip(wants, optional, models, args):
        if objects and want and not isinstance(arg, (dict, BaseModel)) and not (arg is None and opt):
            return "(input)", f"{what} takes a JSON object, got {json_kind(arg)}"
        # The SDK validates a JSON payload against the model, but a payload of another encoding
        # (binary/null, binary/plain, a protobuf one: ``--input-meta encoding=...``, the HTTP API,
        # a client's None) is handed over as it decoded, a None or bytes the handler then fails on.
        if model is not None and not isinstance(arg, model) and not (arg is None and nullable):
            return "(input)", f"{what} takes a JSON object ({model.__name__}), got {json_kind(arg)}"
    return first_problem(list(args) if len(args) != 1 else args[0])


#: Asked only where a run that did not continue as new got a ``Carried`` field, before the
#: refusal: runs started so before it (recorded ones among them: a run's first task sent an update
#: against a state it was started with) replay without its marker and go on as they did.
CALLER_CARRY_PATCH = "input-guard-refuses-callers-carry"


def _carried_by_caller(workflow_class: type, args: typing.Sequence[Any]) -> str | None:
    """The first ``Carried`` field of the workflow's ``INPUT`` that its start input sets, in a run
    that did not continue as new; else None."""
    model = getattr(workflow_class, "INPUT", None)
    if model is None or len(args) != 1 or not isinstance(args[0], dict) or workflow.info().continued_run_id:
        return None
    return carried_by_caller(model, args[0])


def _handler(kind: str, name: str) -> Callable | None:
    """The handler's own function: the SDK hands out bound wrappers whose signature is ``*args``."""
    defn = _Definition.from_class(type(workflow.instance()))
    handlers = getattr(defn, kind) if defn else {}
    found = handlers.get(name)  # a dynamic handler takes whatever comes: not checked
    return found.fn if found else None


class _GuardInbound(WorkflowInboundInterceptor):
    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        problem = problem_with(workflow.info().workflow_type, input.run_fn, input.args, objects=True)
        if problem is not None:
            field, message = problem
            raise invalid_input(f"invalid input: {message}" if field == "(input)" else f"invalid input: {field}: {message}",
                                [field])
        carried = _carried_by_caller(input.type, input.args)
        if carried is not None and workflow.patched(CALLER_CARRY_PATCH):
            raise invalid_input(f"invalid input: {carried}: {CARRIED_BY_CALLER}", [carried])
        return await super().execute_workflow(input)

    async def handle_signal(self, input: HandleSignalInput) -> None:
        handler = _handler("signals", input.signal)
        problem = problem_with(f"signal {input.signal}", handler, input.args) if handler else None
        if problem is not None:
            # A signal cannot be refused: say why it is dropped and carry on.
            workflow.logger.warning("dropped signal %s: %s", input.signal,
                                    problem[1] if problem[0] == "(input)" else f"{problem[0]}: {problem[1]}")
            return
        await super().handle_signal(input)

    def _check_update(self, input: HandleUpdateInput) -> None:
        handler = _handler("updates", input.update)
        problem = problem_with(f"update {input.update}", handler, input.args) if handler else None
        if problem is not None:
            field, message = problem
            raise invalid_input(message if field == "(input)" else f"{field}: {message}", [field])

    def handle_update_validator(self, input: HandleUpdateInput) -> None:
        self._check_update(input)
        super().handle_update_validator(input)

    async def handle_update_handler(self, input: HandleUpdateInput) -> Any:
        # Updates without a validator (and accepted ones on replay) come here unchecked.
        self._check_update(input)
        return await super().handle_update_handler(input)
