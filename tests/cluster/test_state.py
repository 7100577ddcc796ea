"""Control-plane state through the cluster port (``read_state``/``update_state``/``list_state``):
the contract both implementations keep, and the Kubernetes adapter's compare-and-swap
against the fake API server (a write under a stale resourceVersion answers 409; the
loser reads again and applies its change to what the winner wrote)."""

from __future__ import annotations

import json
import threading

import pytest

from activities.account_store import ClusterAccountStore
from fleet.errors import ClusterConflict, InvalidRequest, NoCapacity
from fleet.models import AccountState
from providers.cluster.base import state_object_name
from providers.cluster.kubernetes import KubernetesCluster
from providers.own_dc import ClusterAllocations


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


# -- compare-and-swap in the Kubernetes adapter ---------------------------------------------
def _configmap(fake, kind: str, key: str) -> dict:
    return fake.get("", "configmaps", "gpufleet", state_object_name(kind, key))


def test_two_writers_one_wins_the_other_rereads_and_keeps_both(kube, fake):
    other = KubernetesCluster(api_client=fake.api_client(), namespace="gpufleet")
    kube.update_state("account", "acct", _add("record", "v0"))
    seen: list[dict] = []

    def slow_writer(data):
        seen.append(dict(data))
        if len(seen) == 1:
            # The other writer reads and writes after this one's read, before its write.
            other.update_state("account", "acct", _add("pending", "from-other"))
        return {**data, "record": "v1"}

    updates_before = sum(1 for r in fake.requests if r[:3] == ("update", "", "configmaps"))
    result = kube.update_state("account", "acct", slow_writer)
    assert seen == [{"record": "v0"}, {"record": "v0", "pending": "from-other"}]
    assert result == {"record": "v1", "pending": "from-other"}
    assert _configmap(fake, "account", "acct")["data"] == result
    # The loser's first replace carried the stale resourceVersion and was refused with 409, then it
    # replaced again: three replaces in all (the other writer's, the refused one, the retried one).
    updates = sum(1 for r in fake.requests if r[:3] == ("update", "", "configmaps")) - updates_before
    assert updates == 3


def test_two_creators_one_wins_the_other_rereads(kube, fake):
    other = KubernetesCluster(api_client=fake.api_client(), namespace="gpufleet")
    seen: list[dict] = []

    def slow_creator(data):
        seen.append(dict(data))
        if len(seen) == 1:
            other.update_state("own-dc", "rack", _add("allocations", json.dumps({"m1": {"key": "k-other"}})))
        allocations = json.loads(data.get("allocations") or "{}")
        free = next(m for m in ("m1", "m2") if m not in allocations)
        allocations[free] = {"key": "k-mine"}
        return {"allocations": json.dumps(allocations, sort_keys=True)}

    result = kube.update_state("own-dc", "rack", slow_creator)
    assert len(seen) == 2 and seen[0] == {}  # the first create met 409 AlreadyExists
    assert json.loads(result["allocations"]) == {"m1": {"key": "k-other"}, "m2": {"key": "k-mine"}}


def test_a_stale_resource_version_is_refused_by_the_api_server(kube, fake):
    kube.update_state("account", "acct", _add("record", "v0"))
    stale = _configmap(fake, "account", "acct")
    kube.update_state("account", "acct", _add("record", "v1"))
    stale["data"] = {"record": "lost update"}
    with pytest.raises(Exception) as refused:
        kube.core.replace_namespaced_config_map(stale["metadata"]["name"], "gpufleet", stale)
    assert getattr(refused.value, "status", None) == 409
    assert kube.read_state("account", "acct") == {"record": "v1"}


def test_writers_that_keep_losing_get_a_retryable_conflict(kube, fake):
    other = KubernetesCluster(api_client=fake.api_client(), namespace="gpufleet")
    kube.update_state("account", "acct", _add("n", "0"))
    calls = 0

    def always_overtaken(data):
        nonlocal calls
        calls += 1
        other.update_state("account", "acct", _add("n", str(calls)))
        return {**data, "mine": "x"}

    with pytest.raises(ClusterConflict) as error:
        kube.update_state("account", "acct", always_overtaken)
    assert error.value.retryable  # a later activity attempt may win
    assert "mine" not in kube.read_state("account", "acct")


def test_concurrent_increments_lose_nothing(kube, fake):
    clusters = [KubernetesCluster(api_client=fake.api_client(), namespace="gpufleet") for _ in range(4)]

    def increment(data):
        return {"n": str(int(data.get("n", "0")) + 1)}

    def worker(cluster):
        for _ in range(10):
            while True:
                try:
                    cluster.update_state("counter", "c", increment)
                    break
                except ClusterConflict:  # what the activity's retry would do
                    continue

    threads = [threading.Thread(target=worker, args=(c,)) for c in clusters]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert kube.read_state("counter", "c") == {"n": "40"}


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


def test_two_allocators_never_take_the_same_rack_machine(kube, fake):
    mine = ClusterAllocations(kube, "dc-fra")
    theirs = ClusterAllocations(KubernetesCluster(api_client=fake.api_client(), namespace="gpufleet"), "dc-fra")

    def reserve(store, key, interleave=None):
        def change(state):
            if interleave:
                interleave()
            allocations = state["allocations"]
            free = next(m for m in ("rack1-node1", "rack1-node2", "rack1-node3") if m not in allocations)
            allocations[free] = {"key": key}
            return free

        return store.update(change)

    once = []
    got_mine = reserve(mine, "k-mine", lambda: once or once.append(reserve(theirs, "k-theirs")))
    assert once == ["rack1-node1"] and got_mine == "rack1-node2"
    assert set(ClusterAllocations(kube, "dc-fra").read()["allocations"]) == {"rack1-node1", "rack1-node2"}
