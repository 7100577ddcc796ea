"""Control-plane state through the cluster port (``read_state``/``update_state``/``list_state``):
the contract both implementations keep. The Kubernetes adapter's compare-and-swap under real
``resourceVersion`` conflicts (a write under a stale version answers 409; the loser reads again
and applies its change to what the winner wrote) runs against the real API server:
``tests/realk8s/test_adapter.py`` and ``tests/realk8s/test_fleet.py``."""

from __future__ import annotations

import pytest

from activities.account_store import ClusterAccountStore
from fleet.errors import InvalidRequest, NoCapacity
from fleet.models import AccountState


def _add(entry: str, value: str):
    return lambda data: {**data, entry: value}


# -- the contract (sim and Kubernetes) -------------------------------------------------------
def test_state_starts_empty_and_keeps_what_was_written(harness):
    cluster = harness.cluster
    assert cluster.read_state("account", "acct-a") == {}
    assert cluster.update_state("account", "acct-a", _add("record", "one")) == {"record": "one"}
    assert cluster.update_state("account", "acct-a", _add("pending", "two")) == {"record": "one", "pending": "two"}
    assert cluster.read_state("account", "acct-a") == {"record": "one", "pending": "two"}
    assert cluster.read_state("account", "acct-b") == {}


def test_list_state_is_by_kind_and_keeps_the_callers_key(harness):
    cluster = harness.cluster
    # Two keys whose readable parts agree must stay two objects.
    cluster.update_state("account", "A_b", _add("record", "upper"))
    cluster.update_state("account", "a-b", _add("record", "lower"))
    cluster.update_state("own-dc", "A_b", _add("allocations", "{}"))
    assert cluster.list_state("account") == {"A_b": {"record": "upper"}, "a-b": {"record": "lower"}}
    assert cluster.list_state("own-dc") == {"A_b": {"allocations": "{}"}}
    assert cluster.list_state("nothing") == {}


def test_a_change_that_returns_none_or_raises_writes_nothing(harness):
    cluster = harness.cluster
    cluster.update_state("account", "x", _add("record", "kept"))
    assert cluster.update_state("account", "x", lambda data: None) == {"record": "kept"}

    def refuse(data):
        raise NoCapacity("pool exhausted")

    with pytest.raises(NoCapacity):
        cluster.update_state("account", "x", refuse)
    assert cluster.read_state("account", "x") == {"record": "kept"}


def test_data_a_state_object_cannot_hold_is_refused_naming_the_key(harness):
    with pytest.raises(InvalidRequest, match="bad/key"):
        harness.cluster.update_state("account", "x", _add("bad/key", "v"))
    assert harness.cluster.read_state("account", "x") == {}


# -- the stores over it -----------------------------------------------------------------------
def test_account_store_in_the_cluster_is_shared_by_every_worker(harness):
    first, second = ClusterAccountStore(harness.cluster), ClusterAccountStore(harness.cluster)
    first.mark_revoked("acct-a", "lambda", "401 from the API")
    first.block_offer("acct-b", "nebius", "site-b/gpu-h100", "over quota")
    first.queue_delete("site-a", "acct-a", "i-1")
    first.queue_delete("site-a", "acct-a", "i-2")
    first.queue_delete("site-a", "acct-a", "i-1")  # queued once
    # A second worker (or the same pod restarted) with nothing in memory sees all of it.
    assert second.get("acct-a").state == AccountState.CREDENTIALS_REVOKED
    assert second.get("acct-b").blocked_offers == ["site-b/gpu-h100"]
    assert second.get("acct-c").state == AccountState.HEALTHY
    assert [r.name for r in second.all()] == ["acct-a", "acct-b"]
    assert [p.machine_id for p in second.pending_deletes("acct-a")] == ["i-1", "i-2"]
    assert [p.machine_id for p in second.pending_deletes()] == ["i-1", "i-2"]
    second.done_delete("i-1")
    assert [p.machine_id for p in first.pending_deletes("acct-a")] == ["i-2"]
    # The record and the queue share one object: writing one keeps the other.
    first.put(first.get("acct-a").model_copy(update={"state": AccountState.HEALTHY}))
    assert [p.machine_id for p in second.pending_deletes("acct-a")] == ["i-2"]
    assert second.get("acct-a").state == AccountState.HEALTHY
