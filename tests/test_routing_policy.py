"""fleet/routing.py: per-site weights from health, load, latency and cost."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.routing import (
    MAX_SERVER_QUEUE, TOTAL, Mode, RoutingPolicy, SiteLoad, Strategy, compute_weights, next_document, site_queue_depth,
)


def site(name: str, **kw) -> SiteLoad:
    return SiteLoad(site=name, **{"ready_replicas": 2, "latency_ms": 20, "price_per_gpu_hour": 2.0, **kw})


def test_each_strategy_prefers_its_site():
    sites = [site("cheap", price_per_gpu_hour=1.0, latency_ms=80), site("near", price_per_gpu_hour=3.0, latency_ms=5),
             site("idle", price_per_gpu_hour=3.0, latency_ms=80, queue_depth=0)]
    sites[0] = sites[0].model_copy(update={"queue_depth": 20})
    sites[1] = sites[1].model_copy(update={"queue_depth": 20})
    for strategy, best in [(Strategy.CHEAPEST, "cheap"), (Strategy.NEAREST, "near"), (Strategy.LEAST_LOADED, "idle")]:
        weights = compute_weights(sites, RoutingPolicy(strategy=strategy))
        assert max(weights, key=weights.get) == best, (strategy, weights)
        assert sum(weights.values()) == TOTAL


def test_sites_that_cannot_serve_get_nothing():
    weights = compute_weights([site("a"), site("b", ready_replicas=0), site("c", healthy=False),
                               site("d", draining=True)], RoutingPolicy())
    assert weights == {"a": TOTAL, "b": 0, "c": 0, "d": 0}
    assert compute_weights([site("b", ready_replicas=0)], RoutingPolicy()) == {"b": 0}


def test_passive_and_burst_sites_serve_only_when_primaries_cannot():
    primary, passive = site("p"), site("s", primary=False, price_per_gpu_hour=0.5)
    for mode in (Mode.ACTIVE_PASSIVE, Mode.BURST):
        policy = RoutingPolicy(mode=mode, strategy=Strategy.CHEAPEST)
        assert compute_weights([primary, passive], policy) == {"p": TOTAL, "s": 0}
        down = primary.model_copy(update={"healthy": False})
        assert compute_weights([down, passive], policy) == {"p": 0, "s": TOTAL}
    saturated = primary.model_copy(update={"queue_depth": 100})
    assert compute_weights([saturated, passive], RoutingPolicy(mode=Mode.BURST))["s"] > 0
    assert compute_weights([saturated, passive], RoutingPolicy(mode=Mode.ACTIVE_PASSIVE))["s"] == 0
    assert compute_weights([primary, passive], RoutingPolicy(mode=Mode.ACTIVE_ACTIVE))["s"] > 0


def test_the_floor_keeps_a_warm_site_warm():
    far = site("far", latency_ms=400)
    weights = compute_weights([site("near", latency_ms=5), far], RoutingPolicy(strategy=Strategy.NEAREST))
    assert weights["far"] >= 0.02 * TOTAL


def test_an_evacuation_cap_scales_a_site_down():
    full = compute_weights([site("a"), site("b")], RoutingPolicy())
    capped = compute_weights([site("a"), site("b", cap_percent=25)], RoutingPolicy())
    assert capped["b"] < full["b"] and capped["b"] > 0


def test_documents_are_versioned_and_unchanged_input_keeps_the_version():
    policy = RoutingPolicy()
    one = next_document("llm", [site("a"), site("b")], policy, None, "start")
    assert one.version == 1 and sum(one.weights.values()) == TOTAL
    assert next_document("llm", [site("a"), site("b")], policy, one, "sample") is one
    two = next_document("llm", [site("a"), site("b", healthy=False)], policy, one, "incident at b")
    assert two.version == 2 and two.weights == {"a": TOTAL, "b": 0}


def busy(queue_depth: float, ready_replicas: int) -> float:
    """How busy a site reads, 0 to 1: its queue per replica ``q`` as ``q / (1 + q)``."""
    per = queue_depth / ready_replicas
    return per / (1 + per)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.floats(0, 500), min_size=1, max_size=16), st.integers(1, 20), st.data())
def test_one_model_server_moves_its_sites_load_by_at_most_its_part(honest, ready, data):
    """A server's figure is its node's word: whatever one of N servers claims, from none waiting
    to the most a queue is read as, its site reads at most 1/N busier or idler than with that
    server's honest figure. Before, the site's load was the servers' sum, and one claim of a
    million made its site a million waiting busier, its share of the model at the floor."""
    liar = data.draw(st.integers(0, len(honest) - 1))
    claim = data.draw(st.one_of(st.just(MAX_SERVER_QUEUE), st.just(0.0), st.floats(0, MAX_SERVER_QUEUE)))
    lied = [claim if i == liar else q for i, q in enumerate(honest)]
    moved = abs(busy(site_queue_depth(lied, ready), ready) - busy(site_queue_depth(honest, ready), ready))
    assert moved <= 1 / len(honest) + 1e-9


def test_even_load_reads_as_its_sum_and_uneven_load_counts_each_server_for_its_part():
    """Load spread evenly over a site's servers is the site's load, as when it was summed: a site
    whose every server is saturated reads saturated and loses its share. Uneven load still shows,
    each server for its part: one of four servers with 100 waiting takes a quarter of its site's
    free capacity (not none, as a median would: nor all of it, as the sum did)."""
    assert site_queue_depth([64.0] * 4, 4) == 256.0
    assert site_queue_depth([3.0, 3.0], 2) == 6.0
    assert site_queue_depth([], 4) == 0.0 and site_queue_depth([5.0], 0) == 0.0
    one_busy = site_queue_depth([100.0, 0.0, 0.0, 0.0], 4)
    assert busy(one_busy, 4) > 0.24
    weights = compute_weights([site("uneven", ready_replicas=4, queue_depth=one_busy),
                               site("idle", ready_replicas=4),
                               site("saturated", ready_replicas=4, queue_depth=site_queue_depth([64.0] * 4, 4))],
                              RoutingPolicy())
    assert weights["idle"] > weights["uneven"] > weights["saturated"] == RoutingPolicy().warm_floor * TOTAL
    # Even the most one server is read as leaves the number a SiteLoad takes.
    assert SiteLoad(site="a", ready_replicas=100_000,
                    queue_depth=site_queue_depth([MAX_SERVER_QUEUE], 100_000)).queue_depth == 1e9


loads = st.builds(
    SiteLoad,
    site=st.sampled_from(["a", "b", "c", "d", "e"]),
    ready_replicas=st.integers(0, 20),
    queue_depth=st.floats(0, 200),
    latency_ms=st.floats(0, 300),
    price_per_gpu_hour=st.floats(0, 10),
    primary=st.booleans(),
    healthy=st.booleans(),
    draining=st.booleans(),
    cap_percent=st.sampled_from([100, 100, 50, 0]),
)
fleets = st.lists(loads, min_size=1, max_size=5, unique_by=lambda s: s.site)
policies = st.builds(RoutingPolicy, strategy=st.sampled_from(list(Strategy)), mode=st.sampled_from(list(Mode)))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(fleets, policies)
def test_weights_sum_to_total_and_only_serving_sites_get_any(sites, policy):
    weights = compute_weights(sites, policy)
    serving = {s.site for s in sites if s.can_serve}
    assert sum(weights.values()) == (TOTAL if serving else 0)
    assert all(weights[s.site] == 0 for s in sites if not s.can_serve)
    assert all(w >= 0 for w in weights.values())


@settings(max_examples=300, deadline=None, derandomize=True)
@given(fleets, policies, st.lists(st.floats(-0.01, 0.01), min_size=10, max_size=10))
def test_small_changes_in_load_latency_and_price_do_not_move_weights(sites, policy, wobble):
    """No flapping: a 1% wobble in every sample keeps the weights already published."""
    before = compute_weights(sites, policy)
    wobbled = [s.model_copy(update={
        "queue_depth": s.queue_depth * (1 + wobble[i]), "latency_ms": s.latency_ms * (1 + wobble[i + 5]),
        "price_per_gpu_hour": s.price_per_gpu_hour * (1 - wobble[i]),
    }) for i, s in enumerate(sites)]
    assert compute_weights(wobbled, policy, previous=before) == before
    # And back again: still the same, however often the samples alternate.
    assert compute_weights(sites, policy, previous=before) == before


@settings(max_examples=200, deadline=None, derandomize=True)
@given(fleets, policies)
def test_a_site_that_stops_serving_loses_its_weight_at_once_despite_hysteresis(sites, policy):
    before = compute_weights(sites, policy)
    gone = sites[0].model_copy(update={"healthy": False})
    after = compute_weights([gone, *sites[1:]], policy, previous=before)
    assert after[gone.site] == 0
    assert sum(after.values()) in (0, TOTAL)
