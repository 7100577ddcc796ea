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


async def test_a_version_whose_weights_are_not_in_its_source_is_refused_before_copying(
        rollout_stack: RolloutStack) -> None:
    """A manifest naming files its source store does not hold (a version never uploaded, a file
    left out, one uploaded at another size) is refused at the rollout's first step, naming each
    file's field, and nothing is copied. Before, every site's copy went through the files before
    the missing one (the whole version, bar the last shard), then failed; a file of another size
    failed its checksum twice at every site."""
    stack = rollout_stack
    request = stack.request({"site-a": 1, "site-b": 1}, version="v9")
    files = request["weights"]["files"]
    files.append({"path": "model-00003.safetensors", "size": 10, "sha256": "0" * 64})
    files[1]["size"] += 1
    handle = await stack.start(request, "not-in-source")
    error = await failure_of(handle)
    source = f"s3://{stack.source.bucket}/{stack.source.prefix}"
    assert error.type == "InvalidInput", error
    assert (f"weights.files[3].path: 'model-00003.safetensors' is not in the source store "
            f"({source}model-00003.safetensors)") in str(error), str(error)
    assert (f"weights.files[1].size: {files[1]['size']} bytes in the manifest, {files[1]['size'] - 1} at "
            f"{source}model-00001.safetensors") in str(error), str(error)
    for site in ("site-a", "site-b"):
        store = stack.stores[site]
        assert stack.s3.client(store).list_objects_v2(Bucket=store.bucket).get("KeyCount", 0) == 0, site
    await replay_and_record(handle, "rollout_weights_not_in_source")
