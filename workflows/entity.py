"""The entity discipline: what every long-lived workflow shares (docs/design/entities.md).

The entities (Node, Site, ProviderAccount, Routing, Demand) run for the life of what they
stand for and continue as new when their history grows. Each subclasses ``Entity``, after
temporalio/samples-python ``message_passing/safe_message_handlers``. Three rules:

1. **One state, ``self.state``.** Everything the entity must not lose is one pydantic model,
   and continue-as-new carries exactly that model into the next run. What a run reads again
   (the config, the cluster's facts) or holds only in flight (a queue the loop has not taken, a
   watch) sits beside it under its own name, and is not carried. ``run`` takes the state it
   starts with through ``start_with(carried)``, and a signal handler changes the state through
   ``after_start(change)``: the SDK hands the signals of a run's first task (one sent with the
   start, one that reached a continued run before its first task) to their handlers *before*
   ``run`` begins, and a change made then to the state ``run`` replaces would be lost. Updates
   of that task come before ``run`` too: one whose checks read the state waits
   (``until_started``) rather than be refused against the state ``__init__`` made.
   (Not ``@workflow.init``: an ``__init__`` that takes the input fails the workflow *task*,
   for ever, on a start with the wrong number of inputs, before the input guard can refuse it.)
2. **One lock policy.** The workflow runs one coroutine at a time, so a change made between two
   awaits is atomic. A handler that awaits *inside* a change (reads the state, awaits, writes
   from what it read) holds ``self.state_lock`` across it, and so does every other writer of
   that state across an await (the loop, an own task): their changes then land whole and in
   order. Handlers that never await, or change the state only between awaits, take no lock.
   A wait whose point is to let others change the state (Site's settle) must not hold it.
3. **One continue-as-new gate.** ``await self.continue_as_new_when_ready(carried)`` waits until
   every signal and update handler has finished *and* every task the entity started as its own
   (``spawn``/``own``) has ended or rests at an await where it may be left (``resting``), then
   continues as new with ``carried()``, built after the wait, so nothing a handler or task did
   meanwhile is lost. A loop asks ``continue_as_new_suggested()``: the server's suggestion, or an
   operator's ``renew`` (``gpufleet patches renew``: the runs from before a deploy move on).

Tasks the loop cancels itself before the gate (a watch whose next run asks again) are not own
tasks.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Any, Callable, Coroutine, Generic, Iterator, TypeVar

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.steps import until_run_began

StateT = TypeVar("StateT")

#: Workflow patch, asked where ``renew`` is taken (``Entity.renew``), before it changes anything.
#: A worker of the release before has no handler: during a rolling deploy, or when ``gpufleet
#: patches renew`` reaches a run on such a worker, the SDK keeps the signal (it stays in the
#: history) and the run goes on recording its next commands (Demand's next watch, the Node's).
#: Replayed by this code without the patch, the handler would run at the signal's place: Demand's
#: watch cancelled, the Node's loop continuing as new, commands that history does not hold (a
#: nondeterminism on every workflow task: the entity stuck). With it, that replay finds no marker
#: and ignores the signal as the code before did; the SDK keeps that answer for the run, so such a
#: run ignores every later ``renew`` too, and continues as new when Temporal next suggests it. A
#: run that takes the signal live records the marker in that task and renews.
#: Asked in the signal handler itself, never behind the Node entity's ``self._settled or``: a
#: settled run may hold a signal an old worker kept (``node_entity_renewed_before``), and taking the
#: new path without a marker there is the very divergence. A signal is taken in the workflow task
#: of its event, live and on replay, so the marker is among that task's commands (no entity asks it
#: right after a local activity: only the Node's runs from before ``node-patches-at-start-4`` run
#: any, and this is no code after one).
ENTITY_RENEW_PATCH = "entity-renews"


class Entity(Generic[StateT]):
    """Base of every entity workflow class (not a workflow itself)."""

    #: Everything the entity carries over continue-as-new (rule 1).
    state: StateT

    def __init__(self, state: StateT) -> None:
        self.state = state
        #: Held across an await inside a change of ``state`` (rule 2).
        self.state_lock = asyncio.Lock()
        self._started = False
        self._before_start: list[Callable[[], None]] = []
        self._own: list[asyncio.Task] = []
        self._resting: set[asyncio.Task] = set()
        self._renewal_asked = False

    # -- own tasks ----------------------------------------------------------------------------
    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``work`` as a task of the entity's own: the gate waits until it ends or rests."""
        return self.own(asyncio.create_task(work))

    def own(self, task: asyncio.Task) -> asyncio.Task:
        """``task`` (already started) is the entity's own: the gate waits until it ends or rests."""
        self._own = [t for t in self._own if not t.done()]
        self._own.append(task)
        return task

    @contextmanager
    def resting(self) -> Iterator[None]:
        """Around an await inside an own task where continuing as new may leave the task: the
        next run starts it again and loses nothing (a level-triggered watch, a pause)."""
        task = asyncio.current_task()
        assert task is not None, "resting() is for an await inside a task"
        self._resting.add(task)
        try:
            yield
        finally:
            self._resting.discard(task)

    def own_work_done(self) -> bool:
        """Nothing of the entity's own is mid-step: every own task ended or rests."""
        return all(task.done() or task in self._resting for task in self._own)

    # -- the state a run starts with (rule 1) ---------------------------------------------------
    def start_with(self, carried: StateT | None) -> None:
        """``run``, first thing: the state carried in (None: keep the new one ``__init__`` made),
        then every change a signal of the run's first task asked for before ``run`` began."""
        if carried is not None:
            self.state = carried
        self._started = True
        changes, self._before_start = self._before_start, []
        for change in changes:
            change()

    @property
    def started(self) -> bool:
        """``run`` has taken its state (``start_with``)."""
        return self._started

    async def until_started(self) -> None:
        """An update handler whose checks read the state, first thing. An update of a run's first
        task (one sent with the start, or the moment a run continued as new) reaches its validator
        and handler before ``run`` took its state: checked against the state ``__init__`` made, it
        was refused for what the entity did not yet know. Its validator skips the state's checks
        until ``started``; its handler waits here, then makes them."""
        await until_run_began(lambda: self._started)

    def after_start(self, change: Callable[[], None]) -> None:
        """A handler's change of the state: made now, or, for a signal handled before ``run``
        took its state, once it has (``start_with``)."""
        if self._started:
            change()
        else:
            self._before_start.append(change)

    # -- continue-as-new ------------------------------------------------------------------------
    def continue_as_new_suggested(self) -> bool:
        """The server asks this run to continue as new (its history grew long), or an operator
        did (``renew``): every entity's loop asks here, never the server alone."""
        return self._renewal_asked or workflow.info().is_continue_as_new_suggested()

    @workflow.signal  # fleet.contracts.workflows.Entity.renew: every entity type answers it
    def renew(self) -> None:
        """Continue as new at the next safe point, through the same gate as on the server's
        suggestion: ``gpufleet patches renew`` sends it to every run from before a deploy, so that
        none is left holding the patches of the code before (an idle entity's history may not grow
        long for weeks). The request is this run's alone, not carried: the next run starts on the
        code deployed then and does not continue again.

        Behind ``ENTITY_RENEW_PATCH``: a signal a worker without this handler kept is ignored, as
        it was then."""
        if not workflow.patched(ENTITY_RENEW_PATCH):
            return
        self._renewal_asked = True
        self.on_renewal_asked()

    @property
    def renewal_asked(self) -> bool:
        """``renew`` came: the loop continues as new at its next safe point."""
        return self._renewal_asked

    def on_renewal_asked(self) -> None:
        """An entity whose loop may not look at ``continue_as_new_suggested`` for long (it waits
        on what the suggestion does not wake, or awaits a long watch) wakes it here, at a point
        where it may continue. The server's suggestion comes with new events, which wake the
        loop anyway; an operator's request to an idle entity comes with nothing else."""

    def may_continue_as_new(self) -> bool:
        """Suggested, and nothing of its own runs: what a loop that keeps serving while its own
        work runs waits on (on the suggestion alone it would wake again at once, for ever)."""
        return self.continue_as_new_suggested() and self.own_work_done()

    def ready_to_continue(self) -> bool:
        """Every handler finished and nothing of the entity's own mid-step."""
        return workflow.all_handlers_finished() and self.own_work_done()

    async def continue_as_new_when_ready(
        self, carried: Callable[[], Any], *, unless: Callable[[], bool] | None = None,
        until: Callable[[], bool] | None = None,
    ) -> None:
        """Once ``ready_to_continue``, continue as new with ``carried()`` (the next run's input,
        built then). Returns only when ``unless`` holds.

        ``unless``: work for the loop that may come in while it waits (a queued message): the
        gate then returns at once, the loop takes the work and asks again. ``until``: one more
        condition to wait for (kept for the runs of an older path that waited for it)."""

        def opens() -> bool:
            return self.ready_to_continue() and (until is None or until())

        await workflow.wait_condition(lambda: (unless is not None and unless()) or opens())
        if unless is not None and unless():
            return
        workflow.continue_as_new(carried())

    async def until_ready_to_end(self) -> None:
        """The same gate for a run that ends instead (what the entity stands for is gone for good:
        a Site the config no longer names, nothing left there): every handler finished and nothing
        of its own mid-step, then the run returns its result, carrying nothing. What the loop would
        start again (a watch, a timer) it cancels before."""
        await workflow.wait_condition(self.ready_to_continue)
