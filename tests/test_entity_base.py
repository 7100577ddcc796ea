"""The entity discipline (docs/design/entities.md, ``workflows.entity``): every entity uses the
base, and the base's gate waits for what it says it waits for.

The first tests read the workflow classes (no Temporal); the last run a small entity on the
time-skipping test server, whose clock jumps over the waits.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import re
import textwrap
import typing
import uuid
from typing import AsyncIterator

import pytest
from pydantic import BaseModel, Field
from temporalio import workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from workflows.entity import Entity
from workflows.registry import ALL_WORKFLOWS

#: The long-lived workflows that continue as new, one per thing they stand for.
ENTITIES = {"Node", "Site", "ProviderAccount", "Routing", "Demand"}
#: Long-lived by its Schedule, but no entity of the base: each run ends (the Schedule starts the
#: next), carries nothing and has no handler and no task of its own (docs/design/entities.md).
ENDS_INSTEAD = {"CsrApprover"}
#: Workflows that are not entities but continue as new in a long wait, by themselves.
SHORT_BUT_CONTINUING = {
    "AcquireCapacity": "backs off until its deadline",
    "SiteEvacuation": "waits for its site to recover",
    "ModelRollout": "waits out the evacuations of the sites it holds back",
}
#: What an entity leaves to the base's gate instead of calling it itself.
GATE_CALLS = {"continue_as_new", "all_handlers_finished", "is_continue_as_new_suggested"}


def defn_name(cls: type) -> str:
    return workflow._Definition.must_from_class(cls).name


@functools.cache
def source(fn_or_cls: object) -> str:
    return textwrap.dedent(inspect.getsource(fn_or_cls))


@functools.cache
def tree(fn_or_cls: object) -> ast.Module:
    return ast.parse(source(fn_or_cls))


def gate_calls(cls: type) -> list[str]:
    """``workflow.continue_as_new(...)`` and the like, called in the class's own source."""
    return [f"{node.func.attr} (line {node.lineno})" for node in ast.walk(tree(cls))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in GATE_CALLS]


# Parsed once, here, while the module is collected: CPython 3.11's ast (``inspect.getsource`` of
# a class parses its whole module) can fail with "AST constructor recursion depth mismatch" when
# another thread of the test process (a Temporal worker's) compiles at the same moment.
for _cls in ALL_WORKFLOWS:
    tree(_cls)
    tree(workflow._Definition.must_from_class(_cls).run_fn)


def state_type(cls: type) -> object:
    for base in getattr(cls, "__orig_bases__", ()):
        if typing.get_origin(base) is Entity:
            return typing.get_args(base)[0]
    raise AssertionError(f"{cls.__name__} does not subclass Entity[<its state>]")


def test_every_entity_uses_the_base_and_nothing_else_does() -> None:
    by_name = {defn_name(cls): cls for cls in ALL_WORKFLOWS}
    assert ENTITIES <= set(by_name), sorted(ENTITIES - set(by_name))
    assert {name for name, cls in by_name.items() if issubclass(cls, Entity)} == ENTITIES


@pytest.mark.parametrize("name", sorted(ENTITIES))
def test_an_entitys_state_is_one_model_named_state(name: str) -> None:
    cls = next(cls for cls in ALL_WORKFLOWS if defn_name(cls) == name)
    kinds = [t for t in typing.get_args(state_type(cls)) or (state_type(cls),) if t is not type(None)]
    assert len(kinds) == 1 and issubclass(kinds[0], BaseModel), f"{name}'s state is not one pydantic model"
    # The names the entities' state had before the base (rule 1: one name, ``state``).
    for old in ("self._carry", "self._status", "self._lock"):
        assert not re.search(rf"{re.escape(old)}\b", source(cls)), f"{name} keeps state (or its lock) in {old}"


@pytest.mark.parametrize("name", sorted(ENTITIES))
def test_an_entity_continues_as_new_only_through_the_gate(name: str) -> None:
    cls = next(cls for cls in ALL_WORKFLOWS if defn_name(cls) == name)
    assert gate_calls(cls) == [], f"{name} decides continue-as-new itself: use Entity.continue_as_new_when_ready"


@pytest.mark.parametrize("name", sorted(ENTITIES))
def test_an_entitys_run_takes_its_state_through_start_with(name: str) -> None:
    """Rule 1: the SDK runs the signal handlers of a run's first task before ``run``; the state
    ``run`` starts with comes through ``start_with``, which then applies what they changed
    (``after_start``). A ``self.state = ...`` in ``run`` would throw that away."""
    cls = next(cls for cls in ALL_WORKFLOWS if defn_name(cls) == name)
    run = tree(workflow._Definition.must_from_class(cls).run_fn)
    assigned = [node.lineno for node in ast.walk(run)
                if isinstance(node, ast.Assign) and any(ast.unparse(t) == "self.state" for t in node.targets)]
    assert assigned == [], f"{name}.run sets self.state (lines {assigned} of run): use self.start_with"
    calls = [node for node in ast.walk(run) if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.start_with"]
    assert len(calls) == 1, f"{name}.run does not take its state through self.start_with"


def test_a_workflow_that_continues_as_new_is_an_entity_or_named_here() -> None:
    """A new workflow that continues as new is an entity (subclass the base) or a short one that
    waits long, named in ``SHORT_BUT_CONTINUING`` with why; ``ENDS_INSTEAD`` never continues."""
    continuing = {defn_name(cls) for cls in ALL_WORKFLOWS
                  if not issubclass(cls, Entity) and any(c.startswith("continue_as_new") for c in gate_calls(cls))}
    assert continuing == set(SHORT_BUT_CONTINUING)
    by_name = {defn_name(cls): cls for cls in ALL_WORKFLOWS}
    for name in ENDS_INSTEAD:
        assert not issubclass(by_name[name], Entity)
        assert not [c for c in gate_calls(by_name[name]) if c.startswith("continue_as_new ")], f"{name} continues as new"


# -- the gate, on a small entity -----------------------------------------------------------------
class ToyState(BaseModel):
    steps: list[str] = Field(default_factory=list)
    runs: int = 1


@workflow.defn(name="ToyEntity")
class ToyEntity(Entity[ToyState]):
    """Continues as new once told to; meanwhile a handler, an own task and a resting own task run."""

    def __init__(self) -> None:
        super().__init__(ToyState())
        self._go = False
        self._queued: list[str] = []
        self._at_gate = False

    @workflow.query
    def at_gate(self) -> bool:
        return self._at_gate

    @workflow.signal
    def go(self) -> None:
        self._go = True

    @workflow.signal
    def queue(self, item: str) -> None:
        self._queued.append(item)

    @workflow.signal
    async def slow(self) -> None:
        """A handler that awaits inside its change: it holds the state lock."""
        async with self.state_lock:
            await workflow.sleep(60)
            self.state.steps.append("handler")

    async def _step(self) -> None:
        await workflow.sleep(120)
        self.state.steps.append("task")

    async def _watch(self) -> None:
        with self.resting():  # may be left: the next run would start it again
            await workflow.sleep(10_000)

    @workflow.run
    async def run(self, carried: ToyState | None = None) -> ToyState:
        if carried is not None:
            return carried  # the next run: what the gate carried
        self.spawn(self._watch())
        self.own(asyncio.create_task(self._step()))  # own() takes a task already started
        while True:
            await workflow.wait_condition(lambda: self._go or bool(self._queued))
            self.state.steps += self._queued
            self._queued = []
            self._at_gate = True
            await self.continue_as_new_when_ready(
                lambda: self.state.model_copy(update={"runs": self.state.runs + 1}),
                unless=lambda: bool(self._queued),
            )


@workflow.defn(name="NoteEntity")
class NoteEntity(Entity[ToyState]):
    """Takes notes in its state; returns once it holds three."""

    def __init__(self) -> None:
        super().__init__(ToyState())

    @workflow.signal
    def note(self, text: str) -> None:
        self.after_start(lambda: self.state.steps.append(text))

    @workflow.run
    async def run(self, carried: ToyState | None = None) -> ToyState:
        self.start_with(carried)
        await workflow.wait_condition(lambda: len(self.state.steps) >= 3)
        return self.state


@pytest.fixture
async def toy(time_skipping_env: WorkflowEnvironment) -> AsyncIterator[tuple[WorkflowEnvironment, str]]:
    queue = f"toy-{uuid.uuid4().hex[:8]}"
    async with Worker(time_skipping_env.client, task_queue=queue, workflows=[ToyEntity, NoteEntity],
                      workflow_runner=UnsandboxedWorkflowRunner()):
        yield time_skipping_env, queue


async def test_the_gate_waits_for_handlers_and_own_tasks_not_for_resting_ones(toy) -> None:
    env, queue = toy
    handle = await env.client.start_workflow(ToyEntity.run, id=f"toy/{uuid.uuid4().hex[:6]}", task_queue=queue)
    await handle.signal(ToyEntity.slow)
    await handle.signal(ToyEntity.go)
    result = await asyncio.wait_for(handle.result(), 30)
    # The handler (60 s) and the own task (120 s) finished first, both carried ...
    assert (result.runs, sorted(result.steps)) == (2, ["handler", "task"])
    # ... and the resting watch (10,000 s) was left: the first run closed with its timer open.
    first = (await env.client.get_workflow_handle(handle.id, run_id=handle.first_execution_run_id)
             .fetch_history()).events
    watch = [e.event_id for e in first if e.HasField("timer_started_event_attributes")
             and e.timer_started_event_attributes.start_to_fire_timeout.seconds == 10_000]
    fired = {e.timer_fired_event_attributes.started_event_id for e in first if e.HasField("timer_fired_event_attributes")}
    assert len(watch) == 1 and watch[0] not in fired
    assert first[-1].HasField("workflow_execution_continued_as_new_event_attributes")


async def test_work_that_arrives_while_the_gate_waits_is_taken_before_continuing(toy) -> None:
    env, queue = toy
    handle = await env.client.start_workflow(ToyEntity.run, id=f"toy/{uuid.uuid4().hex[:6]}", task_queue=queue)
    await handle.signal(ToyEntity.go)
    # The gate waits for the own task (120 s of workflow time: the clock stands still until the
    # test awaits the result) ...
    for _ in range(100):
        if await handle.query(ToyEntity.at_gate):
            break
        await asyncio.sleep(0.05)
    await handle.signal(ToyEntity.queue, "queued while waiting")  # ... when this comes in
    result = await asyncio.wait_for(handle.result(), 30)
    # Taken by the loop at once (the gate returned to it, the own task still running), carried;
    # the gate asked again, waited for the task, and continued.
    assert (result.runs, result.steps) == (2, ["queued while waiting", "task"])


async def test_a_signal_in_the_first_task_lands_in_the_state_the_run_starts_with(toy) -> None:
    """Sent with the start, the signal's handler runs before ``run`` took its carried state;
    ``start_with`` applies it after (a run that set ``self.state`` itself lost it)."""
    env, queue = toy
    handle = await env.client.start_workflow(
        NoteEntity.run, ToyState(steps=["carried"], runs=2), id=f"note/{uuid.uuid4().hex[:6]}", task_queue=queue,
        start_signal=NoteEntity.note.__name__, start_signal_args=["sent with the start"])
    await handle.signal(NoteEntity.note, "sent later")
    result = await asyncio.wait_for(handle.result(), 30)
    assert (result.runs, result.steps) == (2, ["carried", "sent with the start", "sent later"])
