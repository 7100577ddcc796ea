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


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.floats(0, 500), min_size=2, max_size=16), st.data())
def test_no_one_model_server_of_three_or_more_decides_its_sites_load(others, data):
    """A server's figure is its node's word: whatever one server beside two or more others claims,
    from none waiting to the most a queue is read as, its site reads as if every server waited
    something within what the others report. Before, the site's load was the servers' sum, and
    one claim of a million made its site a million waiting busier, its share of the model at the
    floor."""
    claim = data.draw(st.one_of(st.just(MAX_SERVER_QUEUE), st.just(0.0), st.floats(0, MAX_SERVER_QUEUE)))
    where = data.draw(st.integers(0, len(others)))
    queues = [*others[:where], claim, *others[where:]]
    per_server = site_queue_depth(queues) / len(queues)
    assert min(others) - 1e-6 <= per_server <= max(others) + 1e-6


def test_even_load_reads_as_its_sum_and_one_idle_server_does_not_hide_it():
    """Load spread evenly over a site's servers is the site's load, as when it was summed: a site
    whose every server is saturated reads saturated and loses its share; one idle server beside
    them (a replica just Ready) does not hide it, nor keep a primary from bursting. A lone busy
    server among idle ones is not its site's load. One or two servers: their sum, as before."""
    assert site_queue_depth([64.0] * 4) == 256.0
    assert site_queue_depth([3.0, 3.0]) == 6.0 and site_queue_depth([5.0]) == 5.0
    assert site_queue_depth([]) == 0.0
    assert site_queue_depth([20.0, 20.0, 20.0, 0.0]) == 80.0
    assert site_queue_depth([100.0, 0.0, 0.0, 0.0]) == 0.0
    saturated = site("saturated", ready_replicas=4, queue_depth=site_queue_depth([64.0, 64.0, 64.0, 0.0]))
    weights = compute_weights([site("idle", ready_replicas=4), saturated], RoutingPolicy())
    assert weights["saturated"] == RoutingPolicy().warm_floor * TOTAL
    burst = RoutingPolicy(mode=Mode.BURST)
    primary = site("primary", ready_replicas=4, primary=True, queue_depth=site_queue_depth([20.0, 20.0, 20.0, 0.0]))
    assert compute_weights([primary, site("secondary", ready_replicas=4, primary=False)], burst)["secondary"] > 0
    # Even the most one server is read as leaves the number a SiteLoad takes.
    assert SiteLoad(site="a", ready_replicas=100_000, queue_depth=site_queue_depth([MAX_SERVER_QUEUE] * 2000)).queue_depth == 1e9


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
