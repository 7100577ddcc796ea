"""The baseline workflow benchmarks compare against: N no-op activities in a row."""

from __future__ import annotations

from datetime import timedelta

from temporalio import activity, workflow

with workflow.unsafe.imports_passed_through():
    from fleet import search_attributes as sa


@activity.defn
def noop(step: int) -> int:
    return step


@workflow.defn
class NoopSteps:
    @workflow.run
    async def run(self, steps: int) -> None:
        for step in range(steps):
            await workflow.execute_activity(noop, step, start_to_close_timeout=timedelta(seconds=30))


@workflow.defn
class NoopStepsWithMetadata:
    """The same no-op steps carrying what an operator-facing workflow adds:
    an activity summary and current details per step, and search attributes.
    It separates the cost of that metadata from the cost of our own logic."""

    @workflow.run
    async def run(self, steps: int) -> None:
        workflow.upsert_search_attributes([
            sa.SITE.value_set("bench"), sa.PROVIDER.value_set("bench"), sa.ACCOUNT.value_set("bench"),
            sa.NODE_NAME.value_set("bench"), sa.FLEET_STATE.value_set("provisioning"),
        ])
        for step in range(steps):
            workflow.set_current_details(f"**step {step}** of {steps}")
            if step in (3, 5):
                workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(f"step-{step}")])
            await workflow.execute_activity(
                noop, step, start_to_close_timeout=timedelta(seconds=30), summary=f"no-op step {step}"
            )
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("ready")])
