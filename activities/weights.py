"""Weights replication to each site's S3-compatible object store (product rule 10).

``replicate_weights`` copies a manifest's files from the source bucket to one
site's store, one file at a time, streaming (memory is bounded by
``concurrency x part_size``, never by the file):

- a file already at the destination with the manifest's sha256 (our ``sha256``
  metadata, or the store's own full-object ChecksumSHA256) is skipped; one
  ListObjectsV2 of the destination prefix says which files may be there (only
  those are HEADed);
- the sha256 is computed while the bytes stream through; each upload carries its
  ChecksumSHA256 in a signed header (for a single PUT that same digest; for
  multipart, each part's, hashed in the part's upload thread) so a store that
  checks it (AWS S3) rejects corrupted bytes; for stores configured
  ``checksum_verification: read-back`` the copy is streamed back and hashed.
  Because that checksum covers the body, the SDK does not hash the body again
  to sign it (``payload_signing_enabled: False``: what botocore already does over
  TLS when a checksum header is present). Bytes are copied once, from the
  source's chunks into the buffer that is sent;
- a mismatch deletes the bad copy and copies the file again; a second mismatch
  fails the site (``ChecksumMismatch``, non-retryable);
- heartbeat details (``Checkpoint``) carry the finished files, bytes done and the
  open multipart upload with its finished parts: a retried attempt (the worker
  died) skips finished files without touching them and continues the open
  upload after its last contiguous finished part;
- a copy its rollout stops (an abort, Temporal's cancel: the activity hears
  ``cancel_requested`` at its next heartbeat, as the rollout waits for it) aborts its
  open multipart upload (AbortMultipartUpload) before it reports cancelled: no try
  comes back to continue it, and its parts would stay stored, and billed, for good.
  One cut short otherwise (its worker shutting down, its heartbeat timed out: the
  attempt then hears ``not_found``, while the retry resumes the upload from the
  heartbeat details; Temporal pausing or resetting it) keeps the upload for the try
  that continues it. What a copy still leaves open (a stop that lands between tries,
  an attempt that never answers) ``abort_weights_uploads`` aborts: the rollout lists
  the uploads open under its own key prefix once every copy of it has ended.

The store itself (client, credentials read at call time, error map) is
``providers.object_store``.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable

from temporalio import activity
from temporalio.exceptions import ApplicationError, CancelledError

from activities import metrics
from activities.env import FleetEnv
from activities.errors import typed_errors
from fleet.messages.rollout import (
    AbortUploadsInput, AbortedUploads, Checkpoint, OpenUpload, Part, ReplicateInput, ReplicateResult,
)
from fleet.config import ObjectStore
from fleet.errors import InvalidRequest
from fleet.rollout import WeightFile, part_size_for
from providers.object_store import Throttle, cause, classify, head, is_digest_error, make_s3_client

#: Test hook: ``fn(site, path, attempt, data) -> data`` applied to bytes on their way
#: to the destination store (simulates corruption in transit). None in production.
TRANSIT_FAULT: Callable[[str, str, int, bytes], bytes] | None = None


class ChecksumMismatch(Exception):
    pass


def b64_digest(digest: bytes) -> str:
    return base64.b64encode(digest).decode()




class Replicator:
    """Copies one manifest to one store; usable without Temporal (the benchmark does)."""

    def __init__(
        self,
        input: ReplicateInput,
        dest: ObjectStore,
        src_client: Any,
        dst_client: Any,
        checkpoint: Checkpoint | None = None,
        heartbeat: Callable[[Checkpoint], None] = lambda cp: None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        self.input, self.dest, self.src, self.dst = input, dest, src_client, dst_client
        self.opts = input.options
        self.resumed = checkpoint is not None
        self.cp = checkpoint or Checkpoint()
        self.cp.bytes_total = sum(f.size for f in input.files)
        self.cp.files_total = len(input.files)
        self._heartbeat = heartbeat
        self._cancelled = cancelled
        self._last_beat = 0.0
        #: The part uploads of the file being copied (``_upload_parts``), while they run.
        self._parts: ThreadPoolExecutor | None = None
        self.throttle = Throttle(self.opts.bandwidth_limit_bytes_per_s)
        self.copied = self.skipped = 0
        self._listing: dict[str, int] | None = None
        self._list_failed = False

    # -- helpers ----------------------------------------------------------------------
    def beat(self, force: bool = False) -> None:
        """Heartbeat (at most every 0.5 s unless ``force``). A copy whose activity was cancelled stops
        here, at a step's end, with what it has open known (``cp.current``): the activity runs it
        shielded from the SDK's cancel, which would be raised wherever the copy is (inside a store
        call it came out as that call's failure, or was taken for a listing refused)."""
        if self._cancelled():
            raise CancelledError("the copy was cancelled")
        now = time.monotonic()
        if force or now - self._last_beat >= 0.5:
            self._last_beat = now
            self._heartbeat(self.cp)

    def _src_key(self, f: WeightFile) -> str:
        return f"{self.input.source.prefix}{f.path}"

    def _dst_key(self, f: WeightFile) -> str:
        return f"{self.input.dest_prefix}{f.path}"

    def _call(self, what: str, fn: Callable, **kwargs):
        try:
            return fn(**kwargs)
        except Exception as error:  # noqa: BLE001 - classified below
            if is_digest_error(error):
                raise ChecksumMismatch(f"{what}: store rejected the checksum") from error
            raise classify(error, what) from cause(error)

    def _stream(self, f: WeightFile, start: int = 0, end: int | None = None):
        """Chunks of the source file from ``start`` (to ``end`` exclusive)."""
        if end is not None and end <= start:
            return
        kwargs: dict[str, Any] = {"Bucket": self.input.source.bucket, "Key": self._src_key(f)}
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-" + ("" if end is None else str(end - 1))
        body = self._call(f"read s3://{self.input.source.bucket}/{self._src_key(f)}", self.src.get_object, **kwargs)["Body"]
        try:
            while chunk := body.read(self.opts.chunk_size_bytes):
                yield chunk
        finally:
            body.close()

    def _transit(self, f: WeightFile, attempt: int, data: bytearray) -> bytes | bytearray:
        return TRANSIT_FAULT(self.input.site, f.path, attempt, bytes(data)) if TRANSIT_FAULT else data

    # -- the copy ---------------------------------------------------------------------
    def run(self) -> ReplicateResult:
        outcomes: dict[str, str] = {}
        for f in self.input.files:
            if f.path in self.cp.done:
                outcomes[f.path] = "resumed"
                continue
            outcome = self._replicate_file(f)
            outcomes[f.path] = outcome
            self.cp.done[f.path] = outcome
            self.cp.current = None
            self.beat(force=True)
        metrics.weights_replicated(self.input.site, self.copied, self.skipped)
        return ReplicateResult(
            site=self.input.site, files=outcomes, bytes_total=self.cp.bytes_total,
            bytes_copied=self.copied, bytes_skipped=self.skipped, resumed=self.resumed,
        )

    def _replicate_file(self, f: WeightFile) -> str:
        while True:
            resuming = self._resumable(f)
            if not resuming and not self.cp.mismatches.get(f.path) and self._already_there(f):
                self.cp.bytes_done += f.size
                self.skipped += f.size
                return "skipped"
            attempt = self.cp.mismatches.get(f.path, 0) + 1
            try:
                self._copy(f, attempt)
                if self.dest.checksum_verification == "read-back":
                    self._read_back(f)
                self.copied += f.size
                return "copied" if attempt == 1 else "recopied"
            except ChecksumMismatch as mismatch:
                sizes = {w.path: w.size for w in self.input.files}
                self.cp.bytes_done = sum(sizes.get(p, 0) for p in self.cp.done)
                self.cp.current = None
                self.cp.mismatches[f.path] = attempt
                self.beat(force=True)
                if activity.in_activity():
                    activity.logger.warning("%s: %s (attempt %d)", self.input.site, mismatch, attempt)
                if attempt >= 2:
                    raise ApplicationError(
                        f"{self.input.site}: checksum mismatch twice for {f.path}: {mismatch}",
                        {"site": self.input.site, "path": f.path}, type="ChecksumMismatch", non_retryable=True,
                    ) from None

    def _resumable(self, f: WeightFile) -> bool:
        """Whether the checkpoint holds an open upload of ``f`` that can be continued.

        One that is gone (the attempt that died completed it, or it was aborted) or
        was cut into other parts is dropped, its parts no longer count as done, and
        the file is looked for at the destination before it is copied again."""
        upload = self.cp.current
        if upload is None or upload.path != f.path:
            return False
        usable = upload.part_size == part_size_for(f.size, self.opts.part_size_bytes)
        if usable:
            try:
                self.dst.list_parts(Bucket=self.dest.bucket, Key=self._dst_key(f), UploadId=upload.upload_id)
            except Exception:  # noqa: BLE001 - gone or unreadable: start the file again
                usable = False
        if not usable:
            self.cp.bytes_done -= sum(p.size for p in upload.parts)
            self.cp.current = None
        return usable

    def _listed(self) -> dict[str, int] | None:
        """Key -> size of what is under the destination prefix: one paginated
        ListObjectsV2 instead of a HEAD per file. None when the store will not list
        (then every file is HEADed, as a store without ListBucket needs)."""
        if self._listing is None and not self._list_failed:
            try:
                sizes: dict[str, int] = {}
                pages = self.dst.get_paginator("list_objects_v2").paginate(
                    Bucket=self.dest.bucket, Prefix=self.input.dest_prefix)
                for page in pages:
                    for obj in page.get("Contents", []):
                        sizes[obj["Key"]] = obj["Size"]
                self._listing = sizes
            except Exception:  # noqa: BLE001 - fall back to HEAD, which classifies its own errors
                self._list_failed = True
        return self._listing

    def _already_there(self, f: WeightFile) -> bool:
        listed = self._listed()
        if listed is not None and listed.get(self._dst_key(f)) != f.size:
            return False  # absent, or another size: no need to ask about it
        found = head(self.dst, self.dest.bucket, self._dst_key(f))
        if found is None or found.get("ContentLength") != f.size:
            return False
        full = b64_digest(bytes.fromhex(f.sha256))
        return found.get("Metadata", {}).get("sha256") == f.sha256 or found.get("ChecksumSHA256") == full

    def _copy(self, f: WeightFile, attempt: int) -> None:
        part_size = part_size_for(f.size, self.opts.part_size_bytes)
        if f.size <= part_size:
            self._copy_single(f, attempt)
        else:
            self._copy_multipart(f, attempt, part_size)

    def _copy_single(self, f: WeightFile, attempt: int) -> None:
        # One buffer of the manifest's size, filled in place: no growing and no
        # bytes() copy; a bytearray body goes out in one sendall.
        digest, data, size = hashlib.sha256(), bytearray(f.size), 0
        with memoryview(data) as view:
            for chunk in self._stream(f):
                digest.update(chunk)
                end = size + len(chunk)
                if end <= f.size:
                    view[size:end] = chunk
                size = end
                self.throttle(len(chunk))
                self.beat()
        self._check_source(f, size, digest)
        self._call(
            f"write s3://{self.dest.bucket}/{self._dst_key(f)}", self.dst.put_object,
            Bucket=self.dest.bucket, Key=self._dst_key(f), Body=self._transit(f, attempt, data),
            ChecksumSHA256=b64_digest(digest.digest()), Metadata={"sha256": f.sha256},
        )
        self.cp.bytes_done += f.size

    def _check_source(self, f: WeightFile, size: int, digest) -> None:
        if size != f.size:
            raise ChecksumMismatch(f"{f.path}: source has {size} bytes, manifest says {f.size}")
        if digest.hexdigest() != f.sha256:
            raise ChecksumMismatch(f"{f.path}: source sha256 {digest.hexdigest()} is not the manifest's {f.sha256}")

    def _copy_multipart(self, f: WeightFile, attempt: int, part_size: int) -> None:
        bucket, key = self.dest.bucket, self._dst_key(f)
        upload = self._open_upload(f, attempt, part_size, bucket, key)
        offset = self._keep_contiguous_parts(upload)
        # Re-hash (not re-copy) the bytes of the finished parts.
        digest = hashlib.sha256()
        for chunk in self._stream(f, 0, offset):
            digest.update(chunk)
        try:
            size = self._upload_parts(f, attempt, part_size, bucket, key, upload, offset, digest)
            self._check_source(f, size, digest)
        except ChecksumMismatch:
            self._abort(bucket, key, upload.upload_id)
            raise
        self._complete_upload(bucket, key, upload)

    def _open_upload(self, f: WeightFile, attempt: int, part_size: int, bucket: str, key: str) -> OpenUpload:
        """The checkpoint's open upload of ``f``, else a new multipart upload."""
        # An open upload in the checkpoint was checked by _resumable.
        upload = self.cp.current if self.cp.current and self.cp.current.path == f.path else None
        if upload is None:
            created = self._call(
                f"start upload s3://{bucket}/{key}", self.dst.create_multipart_upload,
                Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256", Metadata={"sha256": f.sha256},
            )
            upload = OpenUpload(path=f.path, upload_id=created["UploadId"], part_size=part_size, attempt=attempt)
            self.cp.current = upload  # open from here on: what ``abandon`` aborts
        return upload

    def _keep_contiguous_parts(self, upload: OpenUpload) -> int:
        """Keeps the upload's contiguous run of finished parts (those after a gap are sent
        again), checkpoints it as the open upload and returns the offset to continue from."""
        # Continue after the contiguous run of finished parts.
        parts: list[Part] = []
        for part in sorted(upload.parts, key=lambda p: p.number):
            if part.number != len(parts) + 1:
                break
            parts.append(part)
        self.cp.bytes_done -= sum(p.size for p in upload.parts) - sum(p.size for p in parts)  # sent again
        upload.parts = parts
        offset = sum(p.size for p in parts)
        self.cp.current = upload
        self.beat(force=True)
        return offset

    def _upload_parts(self, f: WeightFile, attempt: int, part_size: int, bucket: str, key: str,
                      upload: OpenUpload, offset: int, digest) -> int:
        """Uploads the source from ``offset`` as parts, at most ``concurrency`` at a time,
        each finished part added to the upload and heartbeaten; returns the source's size."""
        with ThreadPoolExecutor(self.opts.concurrency, thread_name_prefix="s3-part") as pool:
            self._parts = pool
            inflight: set[Future] = set()
            number = len(upload.parts) + 1

            def submit(data: bytearray) -> None:
                nonlocal number
                collect(block=False)
                inflight.add(pool.submit(self._upload_part, f, attempt, bucket, key, upload.upload_id, number, data))
                number += 1

            def collect(block: bool) -> None:
                while inflight and (block or len(inflight) >= self.opts.concurrency):
                    finished, _ = wait(inflight, return_when=FIRST_COMPLETED)
                    for future in finished:
                        inflight.discard(future)
                        part = future.result()
                        upload.parts.append(part)
                        self.cp.bytes_done += part.size
                    self.beat(force=True)  # each finished part is resumable

            size = self._cut_parts(f, offset, part_size, digest, submit)
            collect(block=True)
        self._parts = None
        return size

    def _cut_parts(self, f: WeightFile, offset: int, part_size: int, digest,
                   submit: Callable[[bytearray], None]) -> int:
        """Streams the source from ``offset`` into parts of ``part_size`` (the last one
        shorter), hashing it on the way, and hands each to ``submit`` in order; returns
        the source's size."""
        size = offset
        # The part being filled, in place: memory is at most `concurrency` parts
        # in flight plus this one.
        buffer: bytearray | None = None
        filled = 0
        for chunk in self._stream(f, offset):
            digest.update(chunk)
            size += len(chunk)
            rest = memoryview(chunk)
            while rest:
                if buffer is None:
                    buffer, filled = bytearray(part_size), 0
                n = min(len(rest), part_size - filled)
                buffer[filled:filled + n] = rest[:n]
                filled += n
                rest = rest[n:]
                if filled == part_size:
                    submit(buffer)
                    buffer = None
            self.throttle(len(chunk))
            self.beat()
        if buffer is not None:
            del buffer[filled:]
            submit(buffer)
            buffer = None
        return size

    def _complete_upload(self, bucket: str, key: str, upload: OpenUpload) -> None:
        self._call(
            f"complete upload s3://{bucket}/{key}", self.dst.complete_multipart_upload,
            Bucket=bucket, Key=key, UploadId=upload.upload_id,
            MultipartUpload={"Parts": [
                {"PartNumber": p.number, "ETag": p.etag, "ChecksumSHA256": p.checksum}
                for p in sorted(upload.parts, key=lambda p: p.number)
            ]},
        )

    def _upload_part(self, f: WeightFile, attempt: int, bucket: str, key: str, upload_id: str, number: int,
                     data: bytearray) -> Part:
        # Hashed here, in the part's thread (hashlib releases the GIL), while the
        # reader fills the next part.
        checksum = b64_digest(hashlib.sha256(data).digest())
        response = self._call(
            f"upload part {number} of s3://{bucket}/{key}", self.dst.upload_part,
            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
            Body=self._transit(f, attempt, data), ChecksumSHA256=checksum,
        )
        return Part(number=number, etag=response["ETag"], checksum=checksum, size=len(data))

    def abandon(self) -> str | None:
        """The copy is stopped for good (its rollout cancelled it): abort the open multipart upload,
        which no later try continues, once its part uploads in flight have ended (a part that lands
        after the abort could be stored again). The key of the upload aborted, if one was open."""
        if self._parts is not None:
            self._parts.shutdown(wait=True, cancel_futures=True)
        upload = self.cp.current
        if upload is None:
            return None
        key = f"{self.input.dest_prefix}{upload.path}"
        self._abort(self.dest.bucket, key, upload.upload_id)
        self.cp.current = None
        return key

    def _abort(self, bucket: str, key: str, upload_id: str) -> None:
        try:
            self.dst.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:  # noqa: BLE001 - best effort: the rollout's abort_weights_uploads finds one left open
            pass

    def _read_back(self, f: WeightFile) -> None:
        bucket, key = self.dest.bucket, self._dst_key(f)
        body = self._call(f"read back s3://{bucket}/{key}", self.dst.get_object, Bucket=bucket, Key=key)["Body"]
        digest, size = hashlib.sha256(), 0
        try:
            while chunk := body.read(self.opts.chunk_size_bytes):
                digest.update(chunk)
                size += len(chunk)
                self.beat()
        finally:
            body.close()
        if size != f.size or digest.hexdigest() != f.sha256:
            try:
                self.dst.delete_object(Bucket=bucket, Key=key)
            except Exception:  # noqa: BLE001
                pass
            raise ChecksumMismatch(f"{f.path}: copy at s3://{bucket}/{key} has sha256 {digest.hexdigest()}")


class WeightsActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    def all(self) -> list:
        return [self.replicate_weights, self.abort_weights_uploads]

    def client(self, store: ObjectStore, pool: int = 16):
        key = store.model_dump_json()
        with self._lock:
            if key not in self._clients:
                self._clients[key] = make_s3_client(store, pool)
            return self._clients[key]

    def source(self, input: ReplicateInput) -> ObjectStore:
        """The store to copy from: the fleet config's named store, its prefix extended by the manifest's."""
        if input.source_store is None:
            if input.source is None:
                raise InvalidRequest("source_store: no weights source given")
            return input.source
        store = self.env.config.object_stores.get(input.source_store)
        if store is None:
            raise InvalidRequest(f"source_store: unknown object store {input.source_store!r}")
        return store.model_copy(update={"prefix": store.prefix + input.source_prefix})

    @activity.defn
    @typed_errors
    def replicate_weights(self, input: ReplicateInput) -> ReplicateResult:
        site = self.env.site(input.site)
        if site.object_store is None:
            raise InvalidRequest(f"site {input.site} has no object_store configured")
        input = input.model_copy(update={"source": self.source(input)})
        details = activity.info().heartbeat_details
        checkpoint = Checkpoint.model_validate(details[0]) if details else None
        pool = max(16, input.options.concurrency * 2)
        replicator = Replicator(
            input, site.object_store, self.client(input.source, pool), self.client(site.object_store, pool),
            checkpoint=checkpoint, heartbeat=lambda cp: activity.heartbeat(cp.model_dump(mode="json")),
            cancelled=activity.is_cancelled,
        )
        # Shielded from the SDK's cancel, raised in this thread wherever the copy is: the copy looks at
        # its next beat (``Replicator.beat``) and stops there; the cancel is raised as the shield ends.
        with activity.shield_thread_cancel_exception():
            try:
                return replicator.run()
            except BaseException:
                stopped = activity.cancellation_details()
                if stopped is None or not stopped.cancel_requested:
                    raise  # a failure, or a try cut short (not_found, worker shutdown, paused): a retry resumes
                # The rollout stopped the copy (its abort, its cancel) and waits for this: no try resumes
                # the upload.
                key = replicator.abandon()
                activity.logger.info("%s: copy stopped by its rollout; %s", input.site,
                                     f"open upload of {key} aborted" if key else "no upload was open")
                raise CancelledError("copy stopped by its rollout"
                                     + (f"; open upload of {key} aborted" if key else "")) from None

    @activity.defn
    @typed_errors
    def abort_weights_uploads(self, input: AbortUploadsInput) -> AbortedUploads:
        """Abort every multipart upload open under ``input.prefix`` in the site's store: what the
        rollout's copies left (a stop that landed between two tries, a try that never answered, one
        that failed for good). Run once no copy of the rollout runs; the model's rollout claim keeps
        every other rollout off that prefix (``models/<model>/<version>/``)."""
        site = self.env.site(input.site)
        if site.object_store is None:
            raise InvalidRequest(f"site {input.site} has no object_store configured")
        store = site.object_store
        return AbortedUploads(site=input.site, keys=abort_open_uploads(self.client(store), store.bucket, input.prefix))


#: The files a refusal names one by one; the rest are counted.
MISSING_NAMED = 5


def missing_from_source(client: Any, bucket: str, prefix: str, files: list[WeightFile]) -> list[str] | None:
    """The manifest's files that are not under ``prefix`` in the source store as it says (absent,
    or another size), each as ``weights.files[<i>].<field>: why``, the first ``MISSING_NAMED`` named
    and the rest counted: a version whose weights are not there, which every site's copy would fail
    on after copying the files before it. One paginated ListObjectsV2. None when the store will not
    list (a role without s3:ListBucket, the store away): nothing is known, and the copies find out."""
    try:
        sizes: dict[str, int] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                sizes[obj["Key"]] = obj["Size"]
    except Exception:  # noqa: BLE001 - nothing known: the copies look file by file
        return None
    problems = []
    for i, f in enumerate(files):
        where = f"s3://{bucket}/{prefix}{f.path}"
        found = sizes.get(prefix + f.path)
        if found is None:
            problems.append(f"weights.files[{i}].path: {f.path!r} is not in the source store ({where})")
        elif found != f.size:
            problems.append(f"weights.files[{i}].size: {f.size} bytes in the manifest, {found} at {where}")
    if len(problems) > MISSING_NAMED:
        more = len(problems) - MISSING_NAMED
        problems = problems[:MISSING_NAMED] + [f"weights.files: {more} more of the {len(files)} files not in the "
                                               f"source store as the manifest says (s3://{bucket}/{prefix})"]
    return problems


def abort_open_uploads(client: Any, bucket: str, prefix: str) -> list[str]:
    """ListMultipartUploads under ``prefix`` (every page), AbortMultipartUpload of each: the keys
    aborted. One already gone (NoSuchUpload) counts as aborted; the store refusing the list or an
    abort fails as classified (a 403: the store's credentials lack s3:ListBucketMultipartUploads or
    s3:AbortMultipartUpload)."""
    if not prefix:
        raise InvalidRequest("prefix: empty: would abort every upload in the bucket")
    where = f"s3://{bucket}/{prefix}"
    try:
        pages = list(client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix))
    except Exception as error:  # noqa: BLE001 - classified
        raise classify(error, f"list open uploads under {where}") from cause(error)
    aborted = []
    for page in pages:
        for upload in page.get("Uploads", []):
            key = upload["Key"]
            if not key.startswith(prefix):
                continue  # a store that ignores Prefix
            try:
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["UploadId"])
            except Exception as error:  # noqa: BLE001 - classified
                if getattr(error, "response", {}).get("Error", {}).get("Code") != "NoSuchUpload":
                    raise classify(error, f"abort upload of s3://{bucket}/{key}") from cause(error)
            aborted.append(key)
    return aborted
