"""Issue 13.8: a rollout's source is one of the fleet config's named object stores; the
manifest names it and can choose neither an endpoint nor credentials."""

from __future__ import annotations

from tests.replay import replay_and_record
from tests.rollout.conftest import RolloutStack
from tests.rollout.test_rollout_workflow import failure_of


async def test_unknown_source_store_fails_naming_the_field_before_copying(rollout_stack: RolloutStack) -> None:
    stack = rollout_stack
    bad = stack.request({"site-a": 1})
    bad["weights"]["source"] = {"store": "somewhere-else"}
    handle = await stack.start(bad, "unknown-store")
    error = await failure_of(handle)
    assert error.type == "InvalidInput" and "weights.source.store: unknown object store 'somewhere-else'" in str(error)
    assert "known: source" in str(error)
    await replay_and_record(handle, "rollout_unknown_source_store")
    store = stack.stores["site-a"]
    assert stack.s3.client(store).list_objects_v2(Bucket=store.bucket).get("KeyCount", 0) == 0


async def test_manifest_choosing_an_endpoint_is_refused(rollout_stack: RolloutStack) -> None:
    stack = rollout_stack
    bad = stack.request({"site-a": 1})
    bad["weights"]["source"] = {"store": "source", "endpoint_url": "http://attacker.example",
                                "credentials": {"env": "ROLLOUT_S3_KEY"}}
    error = await failure_of(await stack.start(bad, "endpoint"))
    assert error.type == "InvalidInput" and "endpoint_url" in str(error)
