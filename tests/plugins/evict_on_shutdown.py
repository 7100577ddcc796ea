"""A worker shut down in the suite's process evicts the workflow runs it still caches, as it would
at its process's exit, so none of them can wake inside another test's workflow.

The SDK (temporalio 1.35) does not evict its cached runs when a worker shuts down: it relies on
the process ending. The suite's process outlives hundreds of workers (each test's stack, and the
crash tests' second worker beside the first's runs), so the dropped runs' coroutines are
garbage-collected later, at any moment, on whatever thread the collection falls. There
``GeneratorExit`` runs their ``finally`` blocks, and a block that awaits an activity (NodeJoin's
revoke of its join token, an entity's clean-up) takes the *running* event loop for its own: when
that thread is mid-activation of another run, the command lands in that run's history (CI saw a
Site run record two ``revoke_node_tokens``, which its code never schedules, then fail replay).

Here each run the worker still holds gets the eviction the SDK gives a run it drops from a full
cache (``RemoveFromCache``), in its own event loop: its tasks are cancelled and their clean-up
runs where it belongs, any command it tries refused as the SDK refuses them during an eviction.
A run that stays alive through its eviction would, in a real worker, retry its eviction for ever
and hold the worker's shutdown: that is reported as a warning naming the run (the stack says
where), never dropped silently.

Test-only, and on the SDK's private worker internals (pinned to its minor in pyproject.toml):
nothing in production shuts a workflow worker down without its process ending.
"""

from __future__ import annotations

import asyncio
import logging
import warnings

logger = logging.getLogger(__name__)

#: An eviction runs the run's clean-up up to its first command (each is refused): milliseconds. One
#: still going after this long is stuck in the run's own code; the SDK's deadlock limit is 2 s.
EVICTION_SECONDS = 10


def install() -> None:
    from temporalio.worker import _workflow

    run = _workflow._WorkflowWorker.run
    if getattr(run, "evicts_on_shutdown", False):
        return

    async def run_then_evict(self: _workflow._WorkflowWorker) -> None:
        try:
            await run(self)
        finally:
            await evict_cached_runs(self)

    run_then_evict.evicts_on_shutdown = True
    _workflow._WorkflowWorker.run = run_then_evict


async def evict_cached_runs(worker) -> None:
    """Evict each run ``worker`` (a ``_WorkflowWorker`` whose polling ended) still caches."""
    from temporalio.bridge.proto.workflow_activation import RemoveFromCache, WorkflowActivation, WorkflowActivationJob

    left = dict(worker._running_workflows)
    worker._running_workflows.clear()
    for run_id, running in left.items():
        eviction = WorkflowActivation(run_id=run_id, jobs=[WorkflowActivationJob(remove_from_cache=RemoveFromCache(
            message="the worker shut down", reason=RemoveFromCache.EvictionReason.LANG_REQUESTED))])
        try:
            # On a thread of its own, as the SDK activates a run: the eviction runs the run's loop.
            await asyncio.wait_for(asyncio.to_thread(running.activate, eviction), EVICTION_SECONDS)
        except Exception as error:  # noqa: BLE001 - reported: the run outlived its eviction
            warnings.warn(f"workflow {running.workflow_id} (run {run_id}) stayed alive through its eviction as "
                          f"its worker shut down: {error}", RuntimeWarning, stacklevel=1)
            logger.warning("run %s of %s not evicted", run_id, running.workflow_id, exc_info=error)
