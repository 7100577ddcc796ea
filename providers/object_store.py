"""S3-compatible object stores (AWS S3, Nebius, Hetzner, MinIO...) through boto3.

The adapter under weights replication (``activities.weights``): the client for a
configured ``ObjectStore`` (credentials read from its reference at call time, one
shared boto3 session), and the store's errors mapped onto the fleet taxonomy
(rule 6) in one table. Nothing here knows about manifests or checkpoints.
"""

from __future__ import annotations

import time

import threading
from typing import Any

from fleet.config import ObjectStore
from fleet.errors import BadCredentials, InvalidRequest, NotFound, ProviderError, Transient
from providers.base import transport_failure
from providers.credentials import aws_keys, read_secret

PROVIDER = "s3"

#: Error code -> taxonomy, consulted before the HTTP status.
ERROR_CODES: dict[str, type[ProviderError]] = {
    "InvalidAccessKeyId": BadCredentials,
    "SignatureDoesNotMatch": BadCredentials,
    "AccessDenied": BadCredentials,
    "ExpiredToken": BadCredentials,
    "NoSuchKey": NotFound,
    "NoSuchBucket": NotFound,
    "NoSuchUpload": NotFound,
    "404": NotFound,
    "SlowDown": Transient,
    "RequestTimeout": Transient,
    "Throttling": Transient,
}

#: Codes with which a store refuses bytes whose checksum does not match what was sent.
DIGEST_ERRORS = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "InvalidChecksum"}


def credentials(store: ObjectStore) -> dict[str, str]:
    """boto3 key arguments for ``store``; none (boto3's default chain) without a reference."""
    if store.credentials is None:
        return {}
    return aws_keys(read_secret(store.credentials, provider=PROVIDER), store.credentials, provider=PROVIDER)


_session_lock = threading.Lock()
_session: Any = None


def make_s3_client(store: ObjectStore, pool: int = 16):
    """A client for ``store``. Clients share one boto3 session (a new session parses
    the S3 service model again: ~0.1 s of CPU per client); creating a client from
    it is not thread-safe, so that is done under a lock. The clients themselves are."""
    global _session
    import boto3
    from botocore.config import Config

    config = Config(
        region_name=store.region,
        retries={"max_attempts": 4, "mode": "standard"},
        s3={
            "addressing_style": store.addressing_style,
            # Every body we send carries its ChecksumSHA256 in a signed header (and
            # read-back stores are read back), so the SDK need not SHA256 the body a
            # second time to sign it; botocore already skips that over TLS when a
            # checksum header is present, this extends it to plain-HTTP endpoints.
            "payload_signing_enabled": False,
        },
        max_pool_connections=pool,
        # We send our own SHA256 checksums; no extra CRC32 pass over every body.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    keys = credentials(store)
    with _session_lock:
        if _session is None:
            _session = boto3.session.Session()
        return _session.client("s3", endpoint_url=store.endpoint_url, config=config, **keys)


def _answer(error: Exception) -> tuple[str, int] | None:
    """(code, HTTP status) of a store's answer; None for an error without one."""
    from botocore.exceptions import ClientError

    if not isinstance(error, ClientError):
        return None
    code = error.response.get("Error", {}).get("Code", "")
    return code, error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)


def classify(error: Exception, what: str) -> ProviderError:
    """An S3/botocore error as our taxonomy (rule 6): the code table, then the status
    (401/403 BadCredentials, 404 NotFound, 429 and 5xx Transient, other 4xx
    InvalidRequest); no answer at all (connection, timeout) is Transient."""
    answer = _answer(error)
    if answer is None:  # its message would quote urllib3's: a header it refused, the session token's
        return Transient(f"{what}: {transport_failure(error)}", provider=PROVIDER)
    code, status = answer
    message = f"{what}: {code or status} {error.response.get('Error', {}).get('Message', '')}".strip()
    cls: type[ProviderError]
    if code in ERROR_CODES:
        cls = ERROR_CODES[code]
    elif status in (401, 403):
        cls = BadCredentials
    elif status == 404:
        cls = NotFound
    elif status >= 500 or status == 429:
        cls = Transient
    else:
        cls = InvalidRequest
    return cls(message, provider=PROVIDER, code=code)


def cause(error: Exception) -> Exception | None:
    """What ``classify``'s error is raised from: ``error`` when it is the store's answer, else
    nothing (a cause travels into workflow history and worker logs, and one without an answer
    is the transport's, whose message can quote a request header)."""
    return error if _answer(error) is not None else None


def is_digest_error(error: Exception) -> bool:
    """Whether the store refused the bytes because their checksum did not match."""
    answer = _answer(error)
    return answer is not None and answer[0] in DIGEST_ERRORS


def head(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """HEAD of one object with its stored checksum; None when there is none."""
    try:
        return client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    except Exception as error:  # noqa: BLE001 - classified below
        answer = _answer(error)
        if answer is not None and answer[1] == 404:
            return None
        raise classify(error, f"head s3://{bucket}/{key}") from cause(error)


class Throttle:
    """At most ``rate`` bytes/s (0: no cap), so a copy does not saturate the link it shares
    (a site's store during a rollout, a node's uplink while it pulls weights)."""

    def __init__(self, rate: int) -> None:
        self.rate, self.start, self.sent = rate, time.monotonic(), 0

    def __call__(self, n: int) -> None:
        if not self.rate:
            return
        self.sent += n
        ahead = self.sent / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            time.sleep(ahead)
