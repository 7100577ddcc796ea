"""Weights replication against moto S3 in server mode (two site stores + a source)."""

from __future__ import annotations

import collections
import dataclasses
import threading
import tracemalloc

import pytest
from botocore.exceptions import ClientError
from temporalio.activity import ActivityCancellationDetails
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.testing import ActivityEnvironment

from activities import weights
from activities.errors import typed_errors
from activities.weights import Checkpoint, ReplicateInput, Replicator, WeightsActivities
from fleet.config import ObjectStore
from fleet.errors import InvalidRequest
from fleet.rollout import Replication, WeightFile
from providers.object_store import head
from tests.providers.harness import stored_failure
from tests.rollout.conftest import MotoS3, put_files

KiB = 1024


def make_input(source: ObjectStore, files: list[dict], site: str = "site-a", **options) -> ReplicateInput:
    opts = {"part_size_bytes": 64 * KiB, "chunk_size_bytes": 16 * KiB, "concurrency": 2, **options}
    return ReplicateInput(site=site, source=source, files=[WeightFile(**f) for f in files],
                          dest_prefix="models/llm/v2/", options=Replication(**opts))


def replicator(s3: MotoS3, input: ReplicateInput, dest: ObjectStore, **kwargs) -> Replicator:
    return Replicator(input, dest, s3.client(input.source), s3.client(dest), **kwargs)


def versions(s3: MotoS3, store: ObjectStore, key: str) -> int:
    listed = s3.client(store).list_object_versions(Bucket=store.bucket, Prefix=key)
    return len([v for v in listed.get("Versions", []) if v["Key"] == key])


@pytest.fixture
def source(moto_s3: MotoS3) -> ObjectStore:
    return moto_s3.bucket(moto_s3.store(0))


FILES = {"config.json": 1_500, "a.safetensors": 300 * KiB, "b.safetensors": 200 * KiB + 7}


def test_replicate_to_two_stores_and_skip_on_rerun(moto_s3: MotoS3, source: ObjectStore) -> None:
    files = put_files(moto_s3, source, FILES)
    dests = [moto_s3.bucket(moto_s3.store(0, checksum_verification="read-back")), moto_s3.bucket(moto_s3.store(1))]
    for dest in dests:
        result = replicator(moto_s3, make_input(source, files), dest).run()
        assert set(result.files.values()) == {"copied"}
        assert result.bytes_copied == sum(FILES.values())
        client = moto_s3.client(dest)
        for f in files:
            head = client.head_object(Bucket=dest.bucket, Key=f"models/llm/v2/{f['path']}")
            assert head["ContentLength"] == f["size"] and head["Metadata"]["sha256"] == f["sha256"]
            body = client.get_object(Bucket=dest.bucket, Key=f"models/llm/v2/{f['path']}")["Body"].read()
            import hashlib
            assert hashlib.sha256(body).hexdigest() == f["sha256"]
        again = replicator(moto_s3, make_input(source, files), dest).run()
        assert set(again.files.values()) == {"skipped"} and again.bytes_copied == 0


def test_corrupted_copy_is_recopied_and_second_mismatch_fails(moto_s3: MotoS3, source: ObjectStore, monkeypatch) -> None:
    files = put_files(moto_s3, source, FILES, seed=1)
    dest = moto_s3.bucket(moto_s3.store(1, checksum_verification="read-back"))

    def flip_first_attempt(site, path, attempt, data):
        return (bytes([data[0] ^ 0xFF]) + data[1:]) if path == "a.safetensors" and attempt == 1 else data

    monkeypatch.setattr(weights, "TRANSIT_FAULT", flip_first_attempt)
    result = replicator(moto_s3, make_input(source, files), dest).run()
    assert result.files == {"config.json": "copied", "a.safetensors": "recopied", "b.safetensors": "copied"}

    dest2 = moto_s3.bucket(moto_s3.store(1, checksum_verification="read-back"))
    monkeypatch.setattr(weights, "TRANSIT_FAULT", lambda site, path, attempt, data:
                        data[:-1] + b"\x00" if path == "config.json" else data)
    with pytest.raises(ApplicationError) as caught:
        replicator(moto_s3, make_input(source, files), dest2).run()
    assert caught.value.type == "ChecksumMismatch" and caught.value.non_retryable


def test_source_not_matching_manifest_fails_site(moto_s3: MotoS3, source: ObjectStore) -> None:
    files = put_files(moto_s3, source, {"w.bin": 10_000})
    files[0]["sha256"] = "0" * 64
    dest = moto_s3.bucket(moto_s3.store(1))
    with pytest.raises(ApplicationError) as caught:
        replicator(moto_s3, make_input(source, files), dest).run()
    assert caught.value.type == "ChecksumMismatch"
    listed = moto_s3.client(dest).list_objects_v2(Bucket=dest.bucket)
    assert listed.get("KeyCount", 0) == 0, "a failed copy leaves nothing behind"


class Crash(BaseException):
    """The worker dying: nothing in the activity catches it."""


def test_resume_from_heartbeat_details(moto_s3: MotoS3, source: ObjectStore, tmp_path) -> None:
    """A crash mid-copy: the retried attempt starts from the last heartbeat, skips the
    finished files without touching them and continues the open multipart upload."""
    files = put_files(moto_s3, source, {"one.bin": 100 * KiB, "two.bin": 640 * KiB, "three.bin": 50 * KiB}, seed=2)
    dest = moto_s3.bucket(moto_s3.store(1), versioned=True)

    class Env:  # the slice of FleetEnv the activity uses
        def site(self, name):
            return type("S", (), {"object_store": dest})()

    acts = WeightsActivities(Env())  # type: ignore[arg-type]
    input = make_input(source, files, concurrency=1)
    beats: list[dict] = []

    def on_heartbeat(*details):
        beats.append(details[0])
        current = details[0].get("current") or {}
        if current.get("path") == "two.bin" and len(current.get("parts", [])) >= 3:
            raise Crash()

    first = ActivityEnvironment()
    first.on_heartbeat = on_heartbeat
    with pytest.raises(Crash):
        first.run(acts.replicate_weights, input)
    last = Checkpoint.model_validate(beats[-1])
    assert last.done == {"one.bin": "copied"} and len(last.current.parts) >= 3

    parts_seen: list[int] = []
    second = ActivityEnvironment()
    second.info = dataclasses.replace(second.info, heartbeat_details=[beats[-1]])
    second.on_heartbeat = lambda *d: parts_seen.append(
        len(d[0]["current"]["parts"]) if (d[0].get("current") or {}).get("path") == "two.bin" else 99)
    result = second.run(acts.replicate_weights, input)
    assert result.resumed
    assert result.files == {"one.bin": "resumed", "two.bin": "copied", "three.bin": "copied"}
    assert versions(moto_s3, dest, "models/llm/v2/one.bin") == 1, "a finished file is not copied again"
    assert parts_seen and min(parts_seen) >= 3, "the open upload continued after its finished parts"
    import hashlib
    body = moto_s3.client(dest).get_object(Bucket=dest.bucket, Key="models/llm/v2/two.bin")["Body"].read()
    assert hashlib.sha256(body).hexdigest() == files[1]["sha256"]


@pytest.mark.parametrize("heard", ["cancel_requested", "not_found"])
def test_a_copy_aborts_its_open_upload_only_when_its_rollout_stops_it(
        moto_s3: MotoS3, source: ObjectStore, heard: str) -> None:
    """A copy cancelled part-way through a file's multipart upload: stopped by its rollout (the
    activity hears ``cancel_requested``: an abort, Temporal's cancel) it aborts the upload, which no try
    continues; cut short otherwise (``not_found``: its heartbeat timed out while a retry takes over)
    it leaves the upload open, in its heartbeat details, and the retry continues it."""
    files = put_files(moto_s3, source, {"two.bin": 640 * KiB}, seed=5)
    dest = moto_s3.bucket(moto_s3.store(1))

    class Env:  # the slice of FleetEnv the activity uses
        def site(self, name):
            return type("S", (), {"object_store": dest})()

    acts = WeightsActivities(Env())  # type: ignore[arg-type]
    input = make_input(source, files, concurrency=1)
    stopped = ActivityEnvironment()
    beats: list[dict] = []

    def on_heartbeat(*details) -> None:
        beats.append(details[0])
        if len((details[0].get("current") or {}).get("parts", [])) >= 2:
            stopped.cancel(ActivityCancellationDetails(**{heard: True}))

    stopped.on_heartbeat = on_heartbeat
    with pytest.raises(CancelledError):
        stopped.run(acts.replicate_weights, input)
    left = moto_s3.client(dest).list_multipart_uploads(Bucket=dest.bucket).get("Uploads", [])
    if heard == "cancel_requested":
        assert left == []
        return
    last = Checkpoint.model_validate(beats[-1])
    assert [u["UploadId"] for u in left] == [last.current.upload_id] and len(last.current.parts) >= 2
    retry = ActivityEnvironment()
    retry.info = dataclasses.replace(retry.info, heartbeat_details=[beats[-1]])
    result = retry.run(acts.replicate_weights, input)
    assert result.resumed and result.files == {"two.bin": "copied"}
    assert moto_s3.client(dest).list_multipart_uploads(Bucket=dest.bucket).get("Uploads", []) == []


def test_abort_open_uploads_aborts_only_under_its_prefix(moto_s3: MotoS3) -> None:
    """The rollout's clean-up (``abort_weights_uploads``) aborts the uploads open under its own key
    prefix, and none of another version's (``v20`` after ``v2``)."""
    dest = moto_s3.bucket(moto_s3.store(1))
    client = moto_s3.client(dest)
    mine = [f"models/llm/v2/shard-{i}.bin" for i in range(3)]
    for key in [*mine, "models/llm/v20/shard-0.bin"]:
        client.create_multipart_upload(Bucket=dest.bucket, Key=key)
    assert sorted(weights.abort_open_uploads(client, dest.bucket, "models/llm/v2/")) == mine
    assert [u["Key"] for u in client.list_multipart_uploads(Bucket=dest.bucket)["Uploads"]] == [
        "models/llm/v20/shard-0.bin"]
    with pytest.raises(InvalidRequest):
        weights.abort_open_uploads(client, dest.bucket, "")


def test_large_file_streams_in_constant_memory(moto_s3: MotoS3, source: ObjectStore) -> None:
    size = 6 * 1024 * KiB
    files = put_files(moto_s3, source, {"big.bin": size}, seed=3)
    dest = moto_s3.bucket(moto_s3.store(1, checksum_verification="read-back"))
    input = make_input(source, files, part_size_bytes=128 * KiB, chunk_size_bytes=32 * KiB, concurrency=2)
    rep = replicator(moto_s3, input, dest)
    tracemalloc.start()
    try:
        result = rep.run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.files == {"big.bin": "copied"}
    assert peak < size / 4, f"peak {peak} bytes while copying a {size}-byte file"


def test_checkpointed_upload_that_was_completed_is_not_copied_again(moto_s3: MotoS3, source: ObjectStore) -> None:
    """The worker died after completing a multipart upload but before the heartbeat
    that says so: the retry finds the upload gone, looks at the destination, and
    skips the file instead of copying it again."""
    files = put_files(moto_s3, source, {"one.bin": 10 * KiB, "two.bin": 320 * KiB}, seed=4)
    dest = moto_s3.bucket(moto_s3.store(1), versioned=True)
    input = make_input(source, files, concurrency=1)
    beats: list[dict] = []
    replicator(moto_s3, input, dest, heartbeat=lambda cp: beats.append(cp.model_dump(mode="json"))).run()
    last_open = [b for b in beats if (b.get("current") or {}).get("path") == "two.bin"][-1]
    assert len(last_open["current"]["parts"]) == 5 and "two.bin" not in last_open["done"]

    resumed: list[Checkpoint] = []
    result = replicator(moto_s3, input, dest, checkpoint=Checkpoint.model_validate(last_open),
                        heartbeat=lambda cp: resumed.append(cp.model_copy(deep=True))).run()
    assert result.files == {"one.bin": "resumed", "two.bin": "skipped"}
    assert versions(moto_s3, dest, "models/llm/v2/two.bin") == 1, "a finished file is not copied again"
    assert resumed[-1].bytes_done == resumed[-1].bytes_total, "the dropped upload's parts are not counted twice"


class Counting:
    """A boto3 client that counts the calls made through it (and can refuse some)."""

    def __init__(self, client, refuse: set[str] = frozenset()) -> None:
        self.client, self.refuse, self.calls = client, refuse, collections.Counter()

    def __getattr__(self, name: str):
        attr = getattr(self.client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls[name] += 1
            if name in self.refuse:
                raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"},
                                   "ResponseMetadata": {"HTTPStatusCode": 403}}, name)
            return attr(*args, **kwargs)
        return call


def test_one_listing_instead_of_a_head_per_file(moto_s3: MotoS3, source: ObjectStore) -> None:
    files = put_files(moto_s3, source, FILES, seed=5)
    dest = moto_s3.bucket(moto_s3.store(1))

    def run(dst: Counting):
        return Replicator(make_input(source, files), dest, moto_s3.client(source), dst).run()

    fresh = Counting(moto_s3.client(dest))
    assert set(run(fresh).files.values()) == {"copied"}
    assert fresh.calls["get_paginator"] == 1 and fresh.calls["head_object"] == 0, "nothing there: nothing HEADed"

    present = Counting(moto_s3.client(dest))
    assert set(run(present).files.values()) == {"skipped"}
    assert present.calls["head_object"] == len(files), "listed with the right size: HEAD for the checksum"

    unlisted = Counting(moto_s3.client(dest), refuse={"get_paginator"})
    assert set(run(unlisted).files.values()) == {"skipped"}, "a store that will not list: a HEAD per file"
    assert unlisted.calls["head_object"] == len(files)


def test_a_store_transport_failure_quoting_the_session_token_stays_out_of_history() -> None:
    """urllib3 refuses a header with a newline in it with an error quoting the header whole; the
    session token's too (a token made BadCredentials by the store's own credentials check aside)."""
    import boto3

    token = "FwoGZXIvYXdzEBYaDH7gpufleetSESSIONTOKEN"
    client = boto3.session.Session().client(
        "s3", endpoint_url="http://127.0.0.1:9", region_name="us-east-1", aws_access_key_id="AKIAIOSFODNN7EXAMPLE",
        aws_secret_access_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", aws_session_token=f"Fwo\n{token}")
    with pytest.raises(ApplicationError) as failure:
        typed_errors(head)(client, "bucket", "models/llm/v2/config.json")
    assert failure.value.type == "Transient"
    assert token not in stored_failure(failure.value)


def test_the_look_for_a_versions_weights_names_five_counts_the_rest_and_knows_nothing_unlisted() -> None:
    """``missing_from_source``: each file absent or of another size under the prefix, the first five
    named with their key and the rest counted (a version never uploaded would name every shard);
    None when the store will not list (a role without s3:ListBucket): nothing known, no refusal."""
    files = [WeightFile(path=f"model-{i:05d}.safetensors", size=10, sha256="0" * 64) for i in range(8)]

    class Listing:
        def __init__(self, pages):
            self.pages = pages

        def get_paginator(self, _name):
            return self

        def paginate(self, **_kwargs):
            if self.pages is None:
                raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "ListObjectsV2")
            return self.pages

    held = Listing([{"Contents": [{"Key": "v/model-00000.safetensors", "Size": 10},
                                  {"Key": "v/model-00001.safetensors", "Size": 11}]}])
    problems = weights.missing_from_source(held, "b", "v/", files)
    assert problems[:2] == ["weights.files[1].size: 10 bytes in the manifest, 11 at s3://b/v/model-00001.safetensors",
                            "weights.files[2].path: 'model-00002.safetensors' is not in the source store "
                            "(s3://b/v/model-00002.safetensors)"], problems
    assert len(problems) == 6 and problems[-1] == ("weights.files: 2 more of the 8 files not in the source store "
                                                   "as the manifest says (s3://b/v/)"), problems
    assert weights.missing_from_source(Listing([{"Contents": [{"Key": f"v/{f.path}", "Size": 10} for f in files]}]),
                                       "b", "v/", files) == []
    assert weights.missing_from_source(Listing(None), "b", "v/", files) is None
