"""Determinism of ModelRollout: fresh histories replay against today's code.

Record with ``GPUFLEET_RECORD=1 pytest tests/test_replay_rollout.py`` and commit the files
under tests/histories/ with the workflow change; tests/test_replay.py replays them all.
"""

from __future__ import annotations


import pytest
from temporalio.client import WorkflowFailureError

from fleet.cluster import SiteRoute
from tests.replay import replay_and_record
from tests.rollout.conftest import MODEL, RolloutStack, moto_s3, rollout_stack  # noqa: F401 - fixtures
from tests.rollout.test_rollout_workflow import states, until

#: A rollout that succeeds, one whose canary fails, and one deferred behind an evacuation, then
#: paused, resumed and aborted. The first two were re-recorded once ``rollout-source-from-config``
#: and ``rollout-weights-pull-and-routing`` were removed (their files held the two markers
#: undeprecated); the third, recorded while those were deprecated, holds their deprecated markers,
#: which a replay skips with no call.
NAMES = ("rollout_happy_routed", "rollout_canary_failed_routed", "rollout_aborted_routed")


async def test_fresh_rollout_histories_replay(rollout_stack: RolloutStack) -> None:  # noqa: F811
    stack = rollout_stack
    stack.serve_v1(["site-a", "site-b", "site-c"])
    happy = await stack.start(stack.request({"site-a": 1, "site-b": 2}), "replay-happy")
    await happy.result()

    stack.probe.set_error_rate(MODEL, "site-a", 1.0, image="img:v3")
    failed = await stack.start(stack.request({"site-a": 1, "site-b": 1}, version="v3"), "replay-canary")
    with pytest.raises(WorkflowFailureError):
        await failed.result()

    stack.cluster.set_site_routes({"site-a": SiteRoute(weight=100), "site-b": SiteRoute(weight=100),
                                   "site-c": SiteRoute(weight=0, draining=True)})  # site-c is being evacuated
    aborted = await stack.start(stack.request({"site-a": 1, "site-b": 1, "site-c": 1}, version="v4"), "replay-abort")
    await until(aborted, lambda p: states(p).get("site-c") == "deferred" and states(p)["site-b"] == "done")
    await aborted.execute_update("pause")
    await aborted.execute_update("resume")
    await aborted.execute_update("abort", "replay")
    await aborted.result()

    for name, handle in zip(NAMES, (happy, failed, aborted)):
        await replay_and_record(handle, name)
