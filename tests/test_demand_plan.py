"""The demand planner and consolidation (fleet.demand_planner, fleet.consolidation), pure:
constraints, no double buying, modes, spot share, consolidation rules; and the serving
policy's config checks."""

from __future__ import annotations

import pytest

from fleet.cluster import LABEL_GPU_PRODUCT, LABEL_MODEL, LABEL_SITE, UNPROVEN_TAINT
from fleet.config import ConfigError, parse_config
from fleet.consolidation import ConsolidationSettings, IdleNode, consolidate
from fleet.demand import (
    ANNOTATION_MAX_PRICE,
    DEMAND_TAINT_KEY,
    LABEL_CAPACITY_TYPE,
    LABEL_FLEET,
    LABEL_GEOGRAPHY,
    GpuPod,
    Toleration,
    opted_in,
    site_labels,
)
from fleet.demand_planner import ModelUsage, NodeRoom, plan_demand
from fleet.placement import offers_from_config


def fleet(models: dict | None = None, **overrides):
    def site(name, geo, gpu, gpus, price, ctype="on-demand", compliance=False):
        s = {"name": name, "provider": "lambda", "account": "a", "region": "r", "geography": geo, "gpu": gpu,
             "gpus_per_machine": gpus, "instance_type": f"{name}.x", "price_per_gpu_hour": price,
             "capacity_type": ctype, "max_nodes": 10, "compliance": compliance}
        s.update(overrides.get(name, {}))
        return s

    raw = {"accounts": [{"name": "a", "provider": "lambda"}], "sites": [
        site("us8", "us", "H100", 8, 2.0),
        site("us2", "us", "H100", 2, 2.2),
        site("eu2", "eu", "H100", 2, 2.6, compliance=True),
        site("eu-a100", "eu", "A100", 4, 1.2),
        site("us-spot", "us", "H100", 2, 1.0, "spot"),
    ]}
    if models:
        raw["models"] = models
    return parse_config(raw)


def pod(name, gpus=1, model="", created=0.0, annotations=None, **selector):
    return GpuPod(namespace="ml", name=name, gpus=gpus, created_at=created,
                  labels={LABEL_MODEL: model} if model else {}, annotations=annotations or {},
                  node_selector={LABEL_FLEET: "true", **selector},
                  tolerations=[Toleration(key=DEMAND_TAINT_KEY, operator="Exists")])


def plan(cfg, pods, nodes=(), **kw):
    return plan_demand(pods, list(nodes), offers_from_config(cfg.sites), cfg.sites, policies=cfg.models, **kw)


def test_the_opt_in_contract_needs_both_the_toleration_and_the_selector():
    assert opted_in(pod("a"))
    no_toleration = pod("b").model_copy(update={"tolerations": []})
    no_selector = pod("c").model_copy(update={"node_selector": {}})
    wrong_effect = pod("d").model_copy(update={"tolerations": [
        Toleration(key=DEMAND_TAINT_KEY, operator="Exists", effect="NoExecute")]})
    cfg = fleet()
    result = plan(cfg, [no_toleration, no_selector, wrong_effect])
    assert not result.machines
    assert set(result.ignored) == {"ml/b", "ml/c", "ml/d"}


def test_constraints_are_honoured_and_nothing_else_is_bought():
    cfg = fleet()
    pods = [
        pod("eu", **{LABEL_GEOGRAPHY: "eu", LABEL_GPU_PRODUCT: "H100"}),
        pod("a100", **{LABEL_GPU_PRODUCT: "A100"}),
        pod("no-spot", **{LABEL_CAPACITY_TYPE: "on-demand", LABEL_GEOGRAPHY: "us"}),
        pod("cheap", annotations={ANNOTATION_MAX_PRICE: "2.1"}, **{LABEL_CAPACITY_TYPE: "on-demand",
                                                                  LABEL_GPU_PRODUCT: "H100"}),
    ]
    result = plan(cfg, pods)
    where = {p: m for m in result.machines for p in m.pods}
    assert set(where) == {"ml/eu", "ml/a100", "ml/no-spot", "ml/cheap"}
    assert where["ml/eu"].site == "eu2"
    assert where["ml/a100"].site == "eu-a100"
    assert where["ml/no-spot"].capacity_type == "on-demand" and where["ml/no-spot"].site in ("us8", "us2")
    assert where["ml/cheap"].price_per_gpu_hour <= 2.1
    # Two 1-GPU US on-demand pods share one 2-GPU machine rather than each buying one.
    assert where["ml/no-spot"] is where["ml/cheap"]
    assert len(result.machines) == 3
    assert all(m.reason.startswith("cheapest qualifying") for m in result.machines)


def test_a_selector_the_fleet_does_not_set_and_a_site_without_room_buy_nothing():
    cfg = fleet(**{"eu2": {"max_nodes": 1}})
    full = NodeRoom(name="eu2-n1", site="eu2", labels=site_labels(cfg.site("eu2")), gpus=2, gpus_used=2)
    pods = [pod("odd", **{"example.com/rack": "r1"}), pod("eu", **{LABEL_SITE: "eu2"})]
    result = plan(cfg, pods, [full])
    assert not result.machines
    assert "not a label the fleet sets" in result.unplaceable["ml/odd"]
    assert "ml/eu" in result.unplaceable


def test_pods_that_fit_nodes_or_joins_buy_nothing_and_a_nominated_pod_buys_nothing():
    cfg = fleet()
    node = NodeRoom(name="us8-n1", site="us8", labels=site_labels(cfg.site("us8")), gpus=8, gpus_used=6)
    joining = NodeRoom(name="capacity/demand-1", site="us2", labels=site_labels(cfg.site("us2")), gpus=2,
                       joining=True)
    unproven = NodeRoom(name="us2-n2", site="us2", labels=site_labels(cfg.site("us2")), gpus=2,
                        taints=[UNPROVEN_TAINT])
    pods = [pod(f"p{i}", **{LABEL_GEOGRAPHY: "us", LABEL_CAPACITY_TYPE: "on-demand"}) for i in range(6)]
    nominated = pod("n").model_copy(update={"nominated_node": "us8-n1"})
    result = plan(cfg, [*pods, nominated], [node, joining, unproven])
    assert not result.machines
    assert sorted(result.covered.values()).count("joining capacity/demand-1") == 2
    assert "scheduler nominated" in result.ignored["ml/n"]
    # The same pods seen again, with the purchase still joining: still nothing to buy.
    again = plan(cfg, pods, [node, joining, unproven])
    assert not again.machines
    # A seventh pod does not fit anywhere: exactly one more machine.
    more = plan(cfg, [*pods, pod("p7", **{LABEL_GEOGRAPHY: "us", LABEL_CAPACITY_TYPE: "on-demand"})],
                [node, joining, unproven])
    assert [len(m.pods) for m in more.machines] == [1]


def test_active_passive_buys_at_the_passive_site_only_when_the_primary_cannot():
    models = {"llm": {"mode": "active-passive", "sites": ["us2"], "standby_sites": ["us8"]}}
    cfg = fleet(models)
    pods = [pod(f"r{i}", model="llm", **{LABEL_GPU_PRODUCT: "H100"}) for i in range(2)]
    assert {m.site for m in plan(cfg, pods).machines} == {"us2"}  # us8 is cheaper, but passive
    offers = [o.model_copy(update={"available": o.site != "us2"}) for o in offers_from_config(cfg.sites)]
    failed_over = plan_demand(pods, [], offers, cfg.sites, policies=cfg.models)
    assert {m.site for m in failed_over.machines} == {"us8"}
    assert "standby" in failed_over.machines[0].reason
    incident = plan(cfg, pods, down={"us2": "incident inc-1"})
    assert {m.site for m in incident.machines} == {"us8"}


def test_burst_takes_only_the_overflow_the_primaries_have_no_room_for():
    models = {"llm": {"mode": "burst", "sites": ["us2"], "standby_sites": ["us8"]}}
    cfg = fleet(models, us2={"max_nodes": 1})
    pods = [pod(f"r{i}", model="llm") for i in range(4)]
    result = plan(cfg, pods)
    by_site = {m.site: len(m.pods) for m in result.machines}
    assert by_site == {"us2": 2, "us8": 2}


def test_spot_share_and_on_demand_floor_hold_after_a_reclaim():
    models = {"llm": {"sites": ["us-spot", "us2"], "spot_share": 0.5, "on_demand_floor_gpus": 2}}
    cfg = fleet(models)
    # A spot node was reclaimed: its 2 pods are Pending again; 2 on-demand GPUs still run.
    pods = [pod("r1", model="llm"), pod("r2", model="llm")]
    result = plan(cfg, pods, usage={"llm": ModelUsage(spot_gpus=0, other_gpus=2)})
    spot = sum(m.gpus_used for m in result.machines if m.capacity_type == "spot")
    assert spot == 2  # 50% of 4, and 2 on-demand remain: the floor holds
    # Had the on-demand ones gone too, the floor keeps 2 of 4 on demand.
    four = [pod(f"q{i}", model="llm") for i in range(4)]
    result = plan(cfg, four, usage={"llm": ModelUsage()})
    spot = sum(m.gpus_used for m in result.machines if m.capacity_type == "spot")
    assert spot <= 2 and 4 - spot >= 2
    no_spot = fleet({"llm": {"sites": ["us-spot", "us2"], "spot_share": 0}})
    assert all(m.capacity_type != "spot" for m in plan(no_spot, four).machines)


def test_warm_headroom_buys_slack():
    cfg = fleet({"llm": {"sites": ["us2"], "warm_headroom": 0.5}})
    result = plan(cfg, [pod(f"r{i}", model="llm") for i in range(4)])
    assert sum(m.gpus for m in result.machines) == 6
    assert sum(m.headroom_gpus for m in result.machines) == 2


def test_compliance_keeps_a_model_in_its_geography():
    with pytest.raises(ConfigError, match="outside compliance site eu2"):
        fleet({"llm": {"mode": "burst", "sites": ["eu2"], "standby_sites": ["us8"]}})
    with pytest.raises(ConfigError, match="active-passive needs"):
        fleet({"llm": {"mode": "active-passive", "sites": ["us2"]}})
    with pytest.raises(ConfigError, match="unknown site"):
        fleet({"llm": {"sites": ["nowhere"]}})


def idle(name, site, price, gpus=2, since=0.0, awaited=False):
    return IdleNode(name=name, site=site, price_per_gpu_hour=price, gpus=gpus, idle_since=since, awaited=awaited)


def test_consolidation_rules():
    settings = ConsolidationSettings(idle_ttl_seconds=60, max_site_fraction=0.5)
    nodes = [idle("a1", "a", 2.0), idle("a2", "a", 3.0), idle("a3", "a", 2.5), idle("a4", "a", 4.0, awaited=True),
             idle("b1", "b", 9.0), idle("c1", "c", 1.0, since=90)]
    chosen, kept = consolidate(nodes, {"a": 4, "b": 1, "c": 3}, {"a": 1, "b": 1, "c": 0}, {}, now=100,
                               settings=settings)
    # Site a: 4 nodes, half may go at once: the two most expensive idle ones, not the awaited one.
    assert [r.node for r in chosen] == ["a2", "a3"]
    assert "Pending pod" in kept["a4"]
    assert "minimum" in kept["b1"]
    assert "idle 10s" in kept["c1"]
    assert "already retiring" in kept["a1"]
    # Retirements already running count against the fraction.
    chosen, kept = consolidate(nodes, {"a": 4, "b": 1, "c": 3}, {"a": 0}, {"a": 2}, now=100, settings=settings)
    assert not [r for r in chosen if r.site == "a"]
    # Warm headroom keeps the cheapest idle GPUs.
    chosen, kept = consolidate(nodes[:3], {"a": 10}, {}, {}, now=100, settings=settings, keep_warm={"a": 2})
    assert "warm" in kept["a1"] and {r.node for r in chosen} == {"a2", "a3"}


def test_consolidation_leaves_a_node_someone_else_cordoned():
    """A repair's contained node, an evacuation's drained one: idle, but not the loop's to retire,
    nor warm headroom (it takes no pod)."""
    settings = ConsolidationSettings(idle_ttl_seconds=60, max_site_fraction=1)
    nodes = [idle("a1", "a", 2.0), idle("a2", "a", 3.0), idle("a3", "a", 4.0)]
    chosen, kept = consolidate(nodes, {"a": 3}, {}, {}, now=100, settings=settings, cordoned={"a1"},
                               keep_warm={"a": 2})
    assert "cordoned" in kept["a1"] and "warm" in kept["a2"] and [r.node for r in chosen] == ["a3"]


def test_a_machine_the_fleet_named_gives_back_its_site_and_no_other_name_does():
    """A reclaim's replacement that has not chosen yet stands in at the reclaimed machine's site,
    read back from the machine's name (``node_name_for``): a name the fleet did not make names no site."""
    from fleet.naming import node_name_for, site_of_node_name

    for site in ("spot", "eu-west-spot-2", "a"):
        assert site_of_node_name(node_name_for(site, "join-1", nonce="run")) == site
    for other in ("rack-12", "gpu-node", "spot-1234567", "spot-1234567G", "-0123abcd", "0123abcd"):
        assert site_of_node_name(other) is None, other
