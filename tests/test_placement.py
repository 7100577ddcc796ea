"""Placement as pure functions: no Temporal, no sim."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from fleet.messages.capacity import SiteNode
from fleet.config import Site
from fleet.models import AccountState, CapacityType
from fleet.placement import AccountView, Constraints, offers_from_config, rank, surplus_to_retire


def site(name, price, gpu="H100", geo="us-east", kind="on-demand", gpus=8, memory=80, account=None) -> Site:
    return Site(name=name, provider="lambda", account=account or f"acct-{name}", region="r", geography=geo, gpu=gpu,
                gpus_per_machine=gpus, gpu_memory_gb=memory, instance_type=f"{name}-type", price_per_gpu_hour=price,
                capacity_type=CapacityType(kind), max_nodes=8)


SITES = [
    site("a", 2.0), site("b", 2.5, geo="eu"), site("c", 3.5), site("s", 1.5, geo="eu", kind="spot"),
    site("l", 1.0, gpu="L40S", memory=48), site("h", 4.0, gpu="H200", memory=141), site("o", 2.2, kind="owned"),
]


def ranked(constraints: Constraints, **kw):
    offers = offers_from_config(SITES)
    for offer in offers:
        if offer.site == "s":
            offer.interruption_risk = 0.8
    return rank(offers, SITES, constraints, **kw)


def names(placement) -> list[str]:
    return [c.offer.site for c in placement.candidates]


def reasons(placement) -> dict[str, str]:
    return {r.site: r.reason for r in placement.rejected}


def test_orders_by_effective_price_with_spot_risk() -> None:
    p = ranked(Constraints(gpu="H100"))
    # spot $1.50 at risk 0.8 counts as $2.70: after b ($2.50), before c ($3.50).
    assert names(p) == ["a", "o", "b", "s", "c"]
    assert reasons(p) == {"l": "GPU L40S is not H100", "h": "GPU H200 is not H100"}


def test_gpu_class_memory_and_gpus_per_machine() -> None:
    assert names(ranked(Constraints(gpu_class=["H100", "H200"], gpu_memory_gb_min=100))) == ["h"]
    p = ranked(Constraints(gpu_class=["L40S"], gpus_per_machine=4))
    assert names(p) == [] and reasons(p)["l"] == "8 GPUs per machine, want 4"
    with pytest.raises(ValidationError):
        Constraints(gpu="H100", gpu_class=["H200"])


def test_sites_geography_and_capacity_types() -> None:
    assert names(ranked(Constraints(gpu="H100", geographies=["eu"]))) == ["b", "s"]
    assert names(ranked(Constraints(gpu="H100", sites=["c", "b"]))) == ["b", "c"]
    p = ranked(Constraints(gpu="H100", capacity_types=["on-demand"]))
    assert names(p) == ["a", "b", "c"]
    assert reasons(p)["s"] == "spot not allowed" and reasons(p)["o"] == "owned not allowed"


def test_max_price_and_spend_cap() -> None:
    p = ranked(Constraints(gpu="H100", max_price_per_gpu_hour=2.4))
    assert names(p) == ["a", "o", "s"]  # the cap is on the real price, spot's risk only orders it
    assert "max $2.40" in reasons(p)["b"]
    p = ranked(Constraints(gpu="H100", spend_cap_per_hour=17.0))
    assert names(p) == ["a", "s"]  # $16/h and $12/h fit; o is $17.60/h
    p = ranked(Constraints(gpu="H100"), budget_left=12.5)
    assert names(p) == ["s"] and "would exceed the spend cap" in reasons(p)["a"]


def test_preference_then_latency_break_ties() -> None:
    sites = [site("x", 2.0), site("y", 2.0), site("z", 2.0)]
    offers = offers_from_config(sites)
    assert names(rank(offers, sites, Constraints(prefer_sites=["z"]))) == ["z", "x", "y"]
    assert names(rank(offers, sites, Constraints(latency_ms={"x": 80, "y": 20, "z": 50}))) == ["y", "z", "x"]


def test_accounts_exclusions_and_availability() -> None:
    offers = offers_from_config(SITES)
    offers[0].available = False
    p = rank(offers, SITES, Constraints(gpu="H100"), accounts={
        "acct-b": AccountView(state=AccountState.CREDENTIALS_REVOKED),
        "acct-o": AccountView(state=AccountState.QUOTA_BLOCKED, blocked_offers=["o/o-type"]),
    }, excluded={"c/c-type": "no capacity (until 12:00)"})
    assert names(p) == ["s"]
    r = reasons(p)
    assert r["a"] == "provider reports no capacity"
    assert "credentials revoked" in r["b"] and "over quota" in r["o"] and r["c"] == "no capacity (until 12:00)"
    assert all(line.count(": ") >= 1 for line in p.reasons())


def test_surplus_is_most_expensive_then_newest() -> None:
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    nodes = [
        SiteNode(node_name="old-cheap", price_per_gpu_hour=2.0, registered_at=now),
        SiteNode(node_name="new-cheap", price_per_gpu_hour=2.0, registered_at=now + timedelta(hours=1)),
        SiteNode(node_name="old-dear", price_per_gpu_hour=3.0, registered_at=now - timedelta(hours=1)),
    ]
    assert [n.node_name for n in surplus_to_retire(nodes, 2)] == ["old-dear", "new-cheap"]
    assert surplus_to_retire(nodes, 0) == []


def test_surplus_is_never_a_node_someone_holds() -> None:
    """A node a repair fenced a GPU of, or a person marked theirs, is never surplus, however dear or
    new: the free ones go first, and with too few free the site retires fewer. Before, the newest
    (the one a repair had just fenced) was drained and deleted under the repair."""
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    nodes = [
        SiteNode(node_name="old", price_per_gpu_hour=2.0, registered_at=now),
        SiteNode(node_name="repaired", price_per_gpu_hour=2.0, registered_at=now + timedelta(hours=2),
                 held="cordoned by its repair (GPU 1 fenced)"),
        SiteNode(node_name="new", price_per_gpu_hour=2.0, registered_at=now + timedelta(hours=1)),
        SiteNode(node_name="alices", price_per_gpu_hour=3.0, registered_at=now,
                 held="cordoned by 'alice' (gpufleet.io/cordoned-by)"),
    ]
    assert [n.node_name for n in surplus_to_retire(nodes, 1)] == ["new"]
    assert [n.node_name for n in surplus_to_retire(nodes, 3)] == ["new", "old"], "only the free ones"
