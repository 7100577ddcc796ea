"""The benches' verdicts: each judges its figure against a baseline measured in the same run
(docs/benchmarks.md), never against seconds alone. Pure functions, in-process."""

from __future__ import annotations

import math

import pytest

from bench.demand import PER_POD_RATIO, scaling_verdict
from bench.gateway import FLOOD_P99_RATIO, ROUND_TRIP_RATIO, Flood, RoundTripRun, flood_verdict, round_trip_verdict
from bench.incident import CAPACITY_RATIO, WEIGHT0_RATIO, incident_verdict
from bench.repair_latency import CONTAIN_RATIO, contain_verdict
from bench.scale import P99_GROWTH, growth_verdict

MS = 0.001


def test_the_gateway_round_trip_is_judged_against_a_proxy_that_only_forwards_in_its_worst_run() -> None:
    """What is judged is what the gateway adds over the floor any Python proxy pays, not over a
    direct round trip (which a faster server makes shorter, and every proxy's share larger); the
    worst run of several decides."""
    quiet_server = RoundTripRun(direct=[2.5 * MS] * 10, passthrough=[3.5 * MS] * 10, gateway=[3.8 * MS] * 10)
    assert round_trip_verdict([quiet_server]) == (pytest.approx(3.8 / 3.5), True)
    # Each proxy adds its 0.5 ms per hop over the direct 2.5 ms, so gateway / direct is 1.4; the gateway's own
    # checks add nothing over the floor.
    assert round_trip_verdict([RoundTripRun([2.5 * MS], [3.5 * MS], [3.5 * MS])]) == (pytest.approx(1.0), True)
    slow_checks = RoundTripRun(direct=[2.5 * MS] * 10, passthrough=[3.5 * MS] * 10, gateway=[4.5 * MS] * 10)
    ratio, ok = round_trip_verdict([quiet_server, slow_checks])
    assert ratio == pytest.approx(4.5 / 3.5) and ratio > ROUND_TRIP_RATIO and not ok


def flood(quiet: list[list[float]], attacked: list[list[float]], batch: int) -> Flood:
    return Flood(batch=batch, quiet=quiet, attacked=attacked, most_held=32)


def test_a_flood_is_judged_on_the_victims_p99_against_its_own_quiet_batches() -> None:
    quiet = [[6 * MS] * 9 + [10 * MS]] * 4
    assert flood_verdict(flood(quiet, [[6 * MS] * 9 + [11 * MS]] * 4, 10)) == (pytest.approx(1.1), True)
    ratio, ok = flood_verdict(flood(quiet, [[6 * MS] * 9 + [13 * MS]] * 4, 10))
    assert ratio == pytest.approx(1.3) and ratio > FLOOD_P99_RATIO and not ok


def test_a_starved_victim_fails_the_flood_target_whatever_its_p99() -> None:
    """A round trip that never ended has no time: a batch cut short leaves the attacked p99 made
    of the round trips that did get through, which may look as fast as the quiet ones."""
    quiet = [[6 * MS] * 10] * 2
    starved = flood(quiet, [[6 * MS] * 10, [6 * MS] * 3], 10)
    assert starved.done("attacked") == (13, 20)
    ratio, ok = flood_verdict(starved)
    assert ratio == pytest.approx(1.0) and not ok
    ratio, ok = flood_verdict(flood(quiet, [[], []], 10))
    assert math.isnan(ratio) and not ok


def test_planning_is_judged_per_pod_against_a_tenth_the_size() -> None:
    """Linear planning meets the target; quadratic (ten times the cost per pod) does not, however
    fast the machine."""
    assert scaling_verdict([0.030] * 3, [0.300] * 3) == (pytest.approx(1.0), True)
    assert scaling_verdict([0.030] * 3, [0.300 * PER_POD_RATIO] * 3)[1]
    ratio, ok = scaling_verdict([0.001] * 3, [0.100] * 3)
    assert ratio == pytest.approx(10.0) and not ok


def test_containment_is_judged_at_p50_and_at_p99_against_signal_to_activity() -> None:
    """A slow tail fails the target even when the median is well within it."""
    baseline = [7 * MS] * 90 + [20 * MS] * 10
    assert contain_verdict([20 * MS] * 90 + [60 * MS] * 10, baseline) == (pytest.approx(20 / 7), pytest.approx(3.0),
                                                                         True)
    p50, p99, ok = contain_verdict([20 * MS] * 90 + [20 * MS * (CONTAIN_RATIO + 1)] * 10, baseline)
    assert p50 <= CONTAIN_RATIO < p99 and not ok


def test_an_incident_is_judged_on_both_stops_against_the_signal_round_trip() -> None:
    rtt = [30 * MS] * 5
    assert incident_verdict(rtt, [250 * MS] * 5, [350 * MS] * 5) == ((pytest.approx(250 / 30), pytest.approx(350 / 30)),
                                                                     True)
    (weight, capacity), ok = incident_verdict(rtt, [250 * MS] * 5, [30 * MS * (CAPACITY_RATIO + 1)] * 5)
    assert weight <= WEIGHT0_RATIO and capacity > CAPACITY_RATIO and not ok


def test_the_fleet_at_size_is_judged_against_its_first_size() -> None:
    first = [50 * MS] * 30
    assert growth_verdict(first, [50 * MS * P99_GROWTH] * 105) == (pytest.approx(P99_GROWTH), True)
    ratio, ok = growth_verdict(first, [50 * MS * (P99_GROWTH + 1)] * 105)
    assert ratio > P99_GROWTH and not ok
    # No fault contained at one size: nothing to judge against, and nothing met.
    ratio, ok = growth_verdict([], [50 * MS] * 105)
    assert math.isnan(ratio) and not ok
