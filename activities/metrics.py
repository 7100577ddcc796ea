"""Counters of events that happen inside activities (Prometheus, ``prometheus-client``).

Only events live here: a counter restarting at 0 with its worker is what Prometheus
expects of a ``_total`` (``rate``/``increase`` handle resets). Every fleet *gauge* is
computed at scrape time from the source of truth by the control-plane worker
(``workers/metrics.py``), so it is right straight after a restart.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from prometheus_client import Counter

from fleet.errors import FleetError

CAPACITY_ATTEMPTS = Counter(
    "gpufleet_capacity_attempts",
    "Machine creations asked of a provider, by provider, site and result (ok or the error class).",
    ["provider", "site", "result"],
)
WEIGHTS_REPLICATED_BYTES = Counter(
    "gpufleet_weights_replicated_bytes",
    "Model-weight bytes copied to a site's object store and verified there by sha256.",
    ["site"],
)
WEIGHTS_VERIFIED_BYTES = Counter(
    "gpufleet_weights_verified_bytes",
    "Model-weight bytes verified at a site's object store: copied now, or found there with the right sha256.",
    ["site"],
)


def error_class(error: BaseException) -> str:
    """The taxonomy name of a fleet error (NoCapacity, OverQuota, ...); anything else is "other",
    so one bug cannot mint unbounded label values."""
    return type(error).__name__ if isinstance(error, FleetError) else "other"


@contextmanager
def capacity_attempt(provider: str, site: str) -> Iterator[None]:
    """Count one provider create call by how it ended; the error still propagates."""
    try:
        yield
    except BaseException as error:
        CAPACITY_ATTEMPTS.labels(provider, site, error_class(error)).inc()
        raise
    CAPACITY_ATTEMPTS.labels(provider, site, "ok").inc()


def weights_replicated(site: str, copied: int, skipped: int) -> None:
    """One replication's verified bytes: ``copied`` passed the store's checksum now,
    ``skipped`` were already there with the manifest's sha256."""
    WEIGHTS_REPLICATED_BYTES.labels(site).inc(copied)
    WEIGHTS_VERIFIED_BYTES.labels(site).inc(copied + skipped)
