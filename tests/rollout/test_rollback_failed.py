"""A rollback that fails says so: which sites were not put back, why, and that a person must act.

Before: a site whose rollback failed was reported "rolled back" (the failure's message, the
abort's "rolled back: <sites>"), and the next phase overwrote ``FleetState=needs-person`` with
``failed``/``aborted``, so neither ``gpufleet rollout status`` nor the Temporal UI said a person
was needed. The Deployment is deleted behind the rollout's back: its rollback then fails for good
(``ServingNotFound``), at once.
"""

from __future__ import annotations

from temporalio.client import WorkflowHandle

from fleet import search_attributes as sa
from fleet.cluster import SiteRoute
from fleet.rollout import RolloutProgress, RolloutResult
from tests.replay import replay_and_record
from tests.rollout.conftest import MODEL, RolloutStack
from tests.rollout.test_rollout_workflow import failure_of, states, until


async def details(handle: WorkflowHandle) -> str:
    """The workflow's current details (the UI's "User Metadata" tab)."""
    metadata = await handle.query("__temporal_workflow_metadata")
    return metadata.current_details if hasattr(metadata, "current_details") else metadata["currentDetails"]


async def fleet_state(handle: WorkflowHandle) -> str | None:
    return (await handle.describe()).typed_search_attributes.get(sa.FLEET_STATE)


async def test_a_failed_sites_rollback_that_fails_is_not_reported_rolled_back(rollout_stack: RolloutStack) -> None:
    stack = rollout_stack
    stack.serve_v1(["site-a"])
    # No GPUs for 20 replicas: the readiness wait fails at its deadline, and the site is rolled back.
    handle = await stack.start(stack.request({"site-a": 20}, gate={"ready_timeout_seconds": 8}), "rollback-fails")
    await until(handle, lambda p: "to be ready" in p.site("site-a").detail)
    stack.cluster.delete_serving(MODEL, "site-a")  # nothing left to roll back: ServingNotFound, for good

    error = await failure_of(handle)
    assert error.type == "RolloutFailed"
    message = str(error)
    assert "rolled back" not in message.replace("rollback failed", ""), message
    assert "rollback failed at site-a: needs a person" in message and "NotFound" in message, message
    progress = await handle.query("progress", result_type=RolloutProgress)
    assert progress.phase == "failed" and states(progress) == {"site-a": "failed"}
    assert set(progress.rollback_failed) == {"site-a"} and "NotFound" in progress.rollback_failed["site-a"]
    assert progress.needs_person.startswith("rollback failed at site-a: needs a person")


async def test_needs_person_outlives_the_phases_after_it(rollout_stack: RolloutStack) -> None:
    """An abort rolls back two sites: site-b's rollback fails, site-a's works, then the rollout
    ends ``aborted``. That last phase keeps FleetState, the details and the result saying a
    person is needed at site-b, and "rolled back" names only site-a."""
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b", "site-c"])
    # site-c is under evacuation: the rollout updates a and b, then waits for c.
    stack.cluster.set_site_routes({"site-a": SiteRoute(weight=100), "site-b": SiteRoute(weight=100),
                                   "site-c": SiteRoute(weight=0, draining=True)})
    handle = await stack.start(stack.request({"site-a": 1, "site-b": 1, "site-c": 1}), "abort-rollback-fails")
    await until(handle, lambda p: states(p) == {"site-a": "done", "site-b": "done", "site-c": "deferred"})
    stack.cluster.delete_serving(MODEL, "site-b")
    await handle.execute_update("abort", "bad numbers")

    result = RolloutResult.model_validate(await handle.result())
    assert await fleet_state(handle) == "needs-person", "the phase after the failed rollback overwrote it"
    assert result.outcome == "aborted"
    assert {s.site: s.state.value for s in result.sites} == {
        "site-a": "rolled-back", "site-b": "failed", "site-c": "skipped"}
    assert "rolled back: site-a;" in result.reason and "site-b" not in result.reason.split("; rollback failed")[0]
    assert "rollback failed at site-b: needs a person" in result.reason, result.reason
    assert result.needs_person.startswith("rollback failed at site-b: needs a person (site-b: ServingNotFound")
    assert stack.image("site-a") == "img:v1"

    progress = await handle.query("progress", result_type=RolloutProgress)
    assert progress.phase == "aborted" and progress.needs_person == result.needs_person
    shown = await details(handle)
    assert shown.startswith("**aborted**: (needs a person)"), shown
    assert "rollback failed at site-b: needs a person" in shown, shown
    await replay_and_record(handle, "rollout_aborted_rollback_failed")
