"""Property (issue 13, item 2): for every workflow, signal and update in the registry,
generated bad payloads either fail the workflow fast with ``InvalidInput`` (a start),
are dropped (a signal) or are refused (an update). Never a ``WorkflowTaskFailed``
event, never a provider call.

Targets come from the workflow classes' definitions, so a new workflow, signal or
update is covered as soon as it is registered (a new workflow with handlers also
needs a valid start input in ``VALID_STARTS`` so that it has a running instance).
Examples are drawn with hypothesis, derandomized, a few per target.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError
from temporalio.workflow import _Definition

from tests.bad_input_helpers import (
    idle_workflows,
    invalid_input,
    processed,
    raw,
    start_raw,
    task_failures,
)
from tests.conftest import Stack
from workflows import ALL_WORKFLOWS
from workflows.inputs import MAX_NOTE, MAX_STRING

EXAMPLES = 6


def valid_starts() -> dict[str, dict]:
    """One valid input per workflow that has signals or updates (it must be running to get them)."""
    soon = time.time() + 3600
    return {
        "ProviderAccount": {"account": "acct-a", "provider": "lambda"},
        "AcquireCapacity": {"constraints": {"gpu": "H100"}},  # {} is refused at start (issue 36)
        "Demand": {"consolidate": False},
        "Site": {"site": "site-a"},
        "SpotReclaim": {"node_name": "site-a-prop", "site": "site-a", "terminate_at": soon},
        "Node": {"node_name": "site-a-prop"},
        "GpuRepair": {"node_name": "site-a-prop", "gpu": 0, "site": "site-a"},
        "SiteEvacuation": {"site": "site-a"},
        "ModelRollout": {"model": "m", "version": "v1", "image": "img:1",
                         "weights": {"source": {"store": "models"},
                                     "files": [{"path": "a.bin", "size": 1, "sha256": "0" * 64}]},
                         "sites": [{"site": "site-a", "replicas": 1}]},
        "Routing": {"model": "m"},
        "EntityUpdate": {"entity": "account/lambda/acct-a", "update": "quota_raised"},
        "CsrApprover": {},
    }


@dataclass(frozen=True)
class Target:
    workflow: str
    kind: str  # start | signal | update
    name: str
    fn: Callable

    @property
    def params(self) -> list[inspect.Parameter]:
        return [p for p in inspect.signature(self.fn).parameters.values() if p.name != "self"]

    def __str__(self) -> str:
        return f"{self.workflow}.{self.name}" if self.kind != "start" else f"{self.workflow} start"


def targets() -> list[Target]:
    found = []
    for cls in ALL_WORKFLOWS:
        defn = _Definition.must_from_class(cls)
        found.append(Target(defn.name, "start", "run", defn.run_fn))
        found += [Target(defn.name, "signal", name, s.fn) for name, s in defn.signals.items() if name]
        found += [Target(defn.name, "update", name, u.fn) for name, u in defn.updates.items() if name]
    return found


@pytest.fixture
async def idle_fleet(fleet_world: Stack) -> AsyncIterator[Stack]:
    async with idle_workflows(fleet_world) as stack:
        yield stack


# -- bad payloads, as the JSON text an operator would type -------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
#: Values no field of any input may hold, whatever its type.
poison = st.sampled_from([
    "1e400", "-1e400", "NaN", "Infinity", "1" + "0" * 30, "-" + "9" * 20, "1e300",
    json.dumps("x" * (MAX_STRING + 1)), '"\\ud800"',
])
keys = st.text(min_size=1, max_size=8).map(lambda k: "zz_" + k)


def dump(value: Any) -> str:
    return json.dumps(value)


def one_bad_argument(text_param: bool, optional: bool) -> st.SearchStrategy[str]:
    """One argument that no handler of this kind may take."""
    if text_param:  # free text (a reason, a note): anything but a bounded string
        not_strings = json_values.filter(lambda v: not isinstance(v, str))
        return st.one_of(not_strings.map(dump), st.just(json.dumps("r" * (MAX_NOTE + 1))), poison)
    non_objects = json_values.filter(lambda v: not isinstance(v, dict) and not (v is None and optional))
    unknown_field = st.tuples(st.dictionaries(st.text(max_size=8), json_values, max_size=2), keys, json_values).map(
        lambda t: dump({**t[0], t[1]: t[2]}))
    poisoned = st.tuples(keys, poison).map(lambda t: '{"%s": %s}' % (json.dumps(t[0])[1:-1], t[1]))
    return st.one_of(non_objects.map(dump), unknown_field, poisoned, poison)


def bad_arguments(target: Target) -> st.SearchStrategy[tuple[str, ...]]:
    params = target.params
    if not params:  # nothing to be wrong about but the count
        return st.lists(json_values.map(dump), min_size=1, max_size=2).map(tuple)
    text_param = isinstance(params[0].default, str)
    optional = params[0].default is not inspect.Parameter.empty
    one = one_bad_argument(text_param, optional)
    wrong_count = st.tuples(one | json_values.map(dump), json_values.map(dump))
    choices = [one.map(lambda a: (a,)), wrong_count]
    if not optional:
        choices.append(st.just(()))
    return st.one_of(*choices)


def draw(strategy: st.SearchStrategy, n: int = EXAMPLES) -> list:
    """``n`` derandomized examples (no shrinking: a failure names its payload)."""
    drawn: list = []

    @settings(max_examples=n, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example) -> None:
        drawn.append(example)

    collect()
    return drawn


def test_every_workflow_with_handlers_has_a_valid_start() -> None:
    with_handlers = {t.workflow for t in targets() if t.kind != "start"}
    assert with_handlers <= set(valid_starts()), with_handlers - set(valid_starts())


async def test_bad_starts_fail_fast_without_provider_calls(stack: Stack) -> None:
    """With the real control-plane worker and the simulated providers."""
    for target in [t for t in targets() if t.kind == "start"]:
        for args in draw(bad_arguments(target)):
            handle = await start_raw(stack, target.workflow, *args)
            try:
                await invalid_input(handle)
            except BaseException as error:
                raise AssertionError(f"{target} with {[a[:80] for a in args]}: {error}") from error
    assert stack.world.calls("acct-a") + stack.world.calls("acct-b") == 0
    assert stack.world.machines(include_deleted=True) == []


async def running(stack: Stack, workflow: str) -> WorkflowHandle:
    handle = await stack.client.start_workflow(
        workflow, valid_starts()[workflow], id=f"prop/{workflow}/{uuid.uuid4().hex[:8]}",
        task_queue=stack.settings.task_queue,
    )
    await processed(handle, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED)
    return handle


async def still_well(handle: WorkflowHandle, what: str) -> None:
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING, what
    assert await task_failures(handle) == 0, what


async def test_bad_signals_are_dropped_and_bad_updates_refused(idle_fleet: Stack) -> None:
    """Workflows without activities: each instance waits at its first step, nothing else moves."""
    stack = idle_fleet
    handles: dict[str, WorkflowHandle] = {}
    for target in [t for t in targets() if t.kind != "start"]:
        if target.workflow not in handles:
            handles[target.workflow] = await running(stack, target.workflow)
        handle = handles[target.workflow]
        for args in draw(bad_arguments(target)):
            what = f"{target} with {[a[:80] for a in args]}"
            if target.kind == "signal":
                await handle.signal(target.name, args=[raw(a) for a in args])
                await processed(handle, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
            elif target.params:
                # Refused as bad input whatever the entity's state: non-retryable ``InvalidInput``
                # naming the field, never a retryable ``ValueError`` or the SDK's "Failed decoding
                # arguments" (an undecodable payload included).
                with pytest.raises(WorkflowUpdateFailedError) as caught:
                    await asyncio.wait_for(handle.execute_update(target.name, args=[raw(a) for a in args]), 15)
                cause = caught.value.cause
                assert isinstance(cause, ApplicationError), what
                assert cause.type == "InvalidInput" and cause.non_retryable, f"{what}: {cause.type}: {cause.message}"
                assert "Failed decoding" not in cause.message, what
            else:
                # A handler without parameters never sees arguments (the SDK drops them): whether
                # its validator accepts depends on the state; a refusal is then the state's, typed
                # and non-retryable (``WrongState``), never a retryable ``ValueError``.
                try:
                    await asyncio.wait_for(handle.execute_update(target.name, args=[raw(a) for a in args]), 15)
                except WorkflowUpdateFailedError as error:
                    cause = error.cause
                    assert isinstance(cause, ApplicationError) and cause.non_retryable, f"{what}: {cause}"
                    assert cause.type in ("InvalidInput", "WrongState"), f"{what}: {cause.type}: {cause.message}"
            await still_well(handle, what)


#: Payloads of encodings other than JSON, as ``temporal workflow signal --input-meta encoding=...``,
#: the HTTP API or a client's ``None`` send them: the SDK hands each over as it decodes (None,
#: bytes, a protobuf message) whatever the handler's parameter is typed with.
OTHER_ENCODINGS = {
    "binary/null": Payload(metadata={"encoding": b"binary/null"}),
    "binary/plain": Payload(metadata={"encoding": b"binary/plain"}, data=b'{"node_name": "site-a-prop"}'),
    "json/protobuf": Payload(metadata={"encoding": b"json/protobuf",
                                       "messageType": b"temporal.api.common.v1.Payload"}, data=b"{}"),
}


async def test_signals_and_updates_in_other_encodings_never_fail_a_workflow_task(idle_fleet: Stack) -> None:
    """A Node's ``health_report``, ``node_action_request`` and ``node_action_done`` take a model: sent
    as binary/null or binary/plain, the handler got None or bytes and failed the workflow task, on
    every retry, the node's entity wedged for good. Now every signal given such a payload is dropped
    and every update refuses it (``InvalidInput``), the workflow carries on."""
    stack = idle_fleet
    handles: dict[str, WorkflowHandle] = {}
    for target in [t for t in targets() if t.kind != "start" and t.params]:
        if target.workflow not in handles:
            handles[target.workflow] = await running(stack, target.workflow)
        handle = handles[target.workflow]
        for encoding, payload in OTHER_ENCODINGS.items():
            what = f"{target} with {encoding}"
            if target.kind == "signal":
                await handle.signal(target.name, RawValue(payload))
                await processed(handle, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
            else:
                try:
                    await asyncio.wait_for(handle.execute_update(target.name, RawValue(payload)), 15)
                except WorkflowUpdateFailedError as error:
                    cause = error.cause
                    assert isinstance(cause, ApplicationError) and cause.non_retryable, f"{what}: {cause}"
                    assert cause.type == "InvalidInput", f"{what}: {cause.type}: {cause.message}"
            await still_well(handle, what)
