"""The provider-incident rule and the evacuation planner: pure, no Temporal."""

from __future__ import annotations

import pytest

from fleet.config import ConfigError, parse_config
from fleet.incident import (
    Deficit,
    Failure,
    IncidentSettings,
    SiteFacts,
    allowed_targets,
    evaluate,
    nodes_needed,
    plan_moves,
    record,
    restore_weights,
    trip_threshold,
)
from tests.conftest import TEST_FLEET

S = IncidentSettings()


def fails(*nodes: str, at: float = 100.0, kind: str = "gpu") -> list[Failure]:
    return [Failure(node=n, at=at, kind=kind) for n in nodes]


@pytest.mark.parametrize("nodes, expected", [(0, 3), (2, 3), (8, 3), (10, 3), (11, 4), (20, 6), (100, 30)])
def test_threshold_is_max_of_floor_and_share(nodes, expected):
    assert trip_threshold(nodes, S) == expected


def test_four_of_eight_in_the_window_trips():
    v = evaluate(fails("a", "b", "c", "d"), 8, now=130, settings=S)
    assert v.trip and v.threshold == 3 and v.failing == ["a", "b", "c", "d"]
    assert "4 of 8" in v.reason


def test_failures_of_nodes_since_gone_do_not_read_as_more_than_the_site_has():
    """The runbook's small site: three nodes failed inside the window, two of them since replaced
    or removed, one node at the site now. The incident's reason read "3 of 1 nodes"."""
    v = evaluate(fails("a", "b", "c"), 1, now=100, settings=S)
    assert v.trip and v.failing == ["a", "b", "c"]
    assert "of 1 nodes" not in v.reason, v.reason
    assert v.reason.startswith("3 nodes (more than the 1 at the site now: those since replaced or removed count "
                               "too) unhealthy or unreachable within 300s (threshold 3)"), v.reason


def test_one_or_two_failures_do_not_trip():
    assert not evaluate(fails("a"), 8, now=100, settings=S).trip
    assert not evaluate(fails("a", "b"), 8, now=100, settings=S).trip


def test_failures_spread_over_longer_than_the_window_do_not_trip():
    spread = [Failure(node=n, at=t) for n, t in (("a", 0), ("b", 200), ("c", 400), ("d", 600))]
    assert not evaluate(spread, 8, now=600, settings=S).trip
    # Two of them inside the window is still two.
    assert evaluate(spread, 8, now=600, settings=S).failing == ["c", "d"]


def test_the_same_node_counts_once_and_unreachable_counts_too():
    failures: list[Failure] = []
    for node, kind in (("a", "gpu"), ("a", "gpu"), ("b", "unreachable"), ("b", "gpu")):
        failures = record(failures, Failure(node=node, at=10, kind=kind), now=10, settings=S)
    assert [f.node for f in failures] == ["a", "b"]
    failures = record(failures, Failure(node="c", at=20, kind="unreachable"), now=20, settings=S)
    assert evaluate(failures, 8, now=20, settings=S).trip


def test_record_drops_expired_failures():
    failures = record(fails("a", at=0), Failure(node="b", at=400), now=400, settings=S)
    assert [f.node for f in failures] == ["b"]


def test_transient_api_failures_longer_than_t_trip():
    assert not evaluate([], 8, now=1000, settings=S, api_failing_since=500).trip
    v = evaluate([], 8, now=1100, settings=S, api_failing_since=500)
    assert v.trip and "provider call" in v.reason


def test_per_site_settings_and_disable():
    small = IncidentSettings(min_nodes=2, fraction=0.5, window_seconds=10)
    assert trip_threshold(8, small) == 4
    assert evaluate(fails("a", "b", "c", "d"), 8, now=105, settings=small).trip
    assert not evaluate(fails("a", "b", "c", "d"), 8, now=111, settings=small).trip
    off = IncidentSettings(enabled=False)
    assert not evaluate(fails(*"abcdefgh"), 8, now=100, settings=off).trip


def test_compliance_keeps_replicas_in_the_geography():
    eu = SiteFacts(name="eu-1", geography="eu", compliance=True)
    sites = [eu, SiteFacts(name="eu-2", geography="eu"), SiteFacts(name="us-1", geography="us-east")]
    assert [s.name for s in allowed_targets(eu, sites)] == ["eu-2"]
    assert allowed_targets(eu, [eu, sites[2]]) == []
    free = SiteFacts(name="us-1", geography="us-east")
    assert [s.name for s in allowed_targets(free, sites)] == ["eu-1", "eu-2"]


def test_plan_places_what_fits_and_reports_the_rest():
    deficits = [Deficit(model="m", replicas=3, gpus_per_replica=2, targets=["x", "y"]),
                Deficit(model="n", replicas=1, gpus_per_replica=2, targets=[])]
    plan = plan_moves(deficits, {"x": 2, "y": 2})
    assert plan.moves == {"m": {"x": 1, "y": 1}}
    assert plan.missing == {"m": 1, "n": 1}
    assert "n" in plan.impossible and "m" not in plan.impossible
    assert plan.missing_gpus(deficits) == 4
    assert nodes_needed(4, 2) == 2 and nodes_needed(0, 8) == 0 and nodes_needed(3, 8) == 1


def test_restore_steps():
    assert restore_weights(100, [10, 50, 100]) == [10, 50, 100]
    assert restore_weights(5, [10, 50, 100]) == [1, 3, 5]
    assert restore_weights(0, [10, 50]) == [0]


def test_config_incident_block_and_compliance():
    raw = {**TEST_FLEET, "incident": {"min_nodes": 4}}
    raw["sites"] = [dict(s) for s in TEST_FLEET["sites"]]
    raw["sites"][1]["incident"] = {"fraction": 0.5, "window_seconds": 60}
    raw["sites"][1]["compliance"] = True
    config = parse_config(raw)
    assert config.incident_for(config.site("site-a")).min_nodes == 4
    assert config.incident_for(config.site("site-b")).fraction == 0.5
    assert config.site("site-b").compliance
    raw["sites"][1] = {**raw["sites"][1], "geography": None}
    with pytest.raises(ConfigError, match=r"site-b\)\.compliance"):
        parse_config(raw)
    raw["sites"][1] = {**raw["sites"][1], "geography": "eu", "incident": {"typo": 1}}
    with pytest.raises(ConfigError, match="unknown key"):
        parse_config(raw)
