"""The baseline workflow benchmarks compare against: N no-op activities in a row."""

from __future__ import annotations

from datetime import timedelta

from temporalio import activity, workflow


@activity.defn
def noop(step: int) -> int:
    return step


@workflow.defn
class NoopSteps:
    @workflow.run
    async def run(self, steps: int) -> None:
        for step in range(steps):
            await workflow.execute_activity(noop, step, start_to_close_timeout=timedelta(seconds=30))
