"""The workers' garbage-collection settings: a collection that stops a worker is logged."""

from __future__ import annotations

import gc
import logging
from contextlib import contextmanager
from typing import Iterator

import pytest

from workers.gc_tuning import CollectionTimer


@contextmanager
def timing(timer: CollectionTimer, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    gc.callbacks.append(timer)
    try:
        with caplog.at_level(logging.WARNING, logger="gpufleet.gc"):
            yield
    finally:
        gc.callbacks.remove(timer)


def test_a_collection_longer_than_the_limit_is_logged_with_its_generation(caplog: pytest.LogCaptureFixture) -> None:
    timer = CollectionTimer(slow_seconds=0.0)  # every collection counts as slow here
    with timing(timer, caplog):
        gc.collect(2)
    # Young collections may come too (the log line itself allocates, other threads run): the
    # full collection asked for is the one that must be there.
    assert 2 in [generation for _, _, generation in timer.slow], list(timer.slow)
    assert any("gc: generation 2 collection stopped this process for" in r.getMessage() for r in caplog.records)


def test_a_quick_collection_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    timer = CollectionTimer(slow_seconds=60.0)
    with timing(timer, caplog):
        gc.collect(0)
    assert not [r for r in caplog.records if r.name == "gpufleet.gc"] and not timer.slow
