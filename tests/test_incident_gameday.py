"""``gpufleet gameday provider-loss`` against a running (test) stack: it breaks the
site, watches the evacuation through to the restore, and prints the durations."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from tests.evacuation_helpers import open_incident_stack


async def test_gameday_provider_loss_measures_the_timeline(temporal_env, tmp_path) -> None:
    async for inc in open_incident_stack(temporal_env.client, tmp_path):
        a = inc.site("a")
        await inc.join("a", 3)
        await inc.join("d", 1)
        inc.serve("llm", "a", replicas=1)
        inc.serve("llm", "d", replicas=0)
        out = tmp_path / "gameday.json"
        env = {**os.environ, **inc.settings.env()}
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "cli", "gameday", "provider-loss", "--site", a, "--heal-after", "0.2",
             "--timeout", "90", "--json", str(out)],
            env=env, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "measured durations" in proc.stdout
        report = json.loads(out.read_text())
        marks = report["sites"][a]["seconds_after_break"]
        assert report["sites"][a]["outcome"] == "restored"
        order = ["detected", "weight 0", "replicas ready elsewhere", "drained", "recovered", "restored"]
        assert [m for m in order if m in marks] == order
        assert [marks[m] for m in order] == sorted(marks[m] for m in order)
        assert inc.world.site_row(a)["unreachable"] == 0


async def test_gameday_region_loss_evacuates_every_site_of_the_geography(temporal_env, tmp_path) -> None:
    async for inc in open_incident_stack(temporal_env.client, tmp_path):
        a, c = inc.site("a"), inc.site("c")
        await inc.join("a", 3)
        await inc.join("c", 3)
        await inc.join("d", 1)
        inc.serve("llm", "a", replicas=1)
        inc.serve("llm", "c", replicas=1)
        inc.serve("llm", "d", replicas=0)
        out = tmp_path / "region.json"
        env = {**os.environ, **inc.settings.env()}
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "cli", "gameday", "region-loss", "--geo", "us-east", "--heal-after", "0.2",
             "--timeout", "120", "--json", str(out)],
            env=env, capture_output=True, text=True, timeout=180,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = json.loads(out.read_text())
        assert set(report["sites"]) == {a, c}, "both us-east sites were broken, nothing else"
        for site in (a, c):
            marks = report["sites"][site]["seconds_after_break"]
            assert report["sites"][site]["outcome"] == "restored"
            assert marks["weight 0"] <= marks["drained"]
            assert inc.world.site_row(site)["unreachable"] == 0
        assert inc.world.site_row(inc.site("d"))["unreachable"] == 0
        unknown = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "cli", "gameday", "region-loss", "--geo", "mars"],
            env=env, capture_output=True, text=True, timeout=60,
        )
        assert unknown.returncode == 2 and "mars" in unknown.stderr


async def test_a_game_day_whose_incident_rule_cannot_trip_is_refused_before_breaking_anything(temporal_env,
                                                                                               tmp_path) -> None:
    """Breaking a site takes its nodes off the control plane, and its incident rule trips only
    when at least incident.min_nodes (3) of them go NotReady. With two nodes at one site and none
    at the other of its geography, the game day broke the sites anyway, left their nodes NotReady
    to --timeout and ended `not detected` (exit 1). It is refused at once (exit 2), naming what
    each site lacks and the join that fixes it, and nothing is broken."""
    async for inc in open_incident_stack(temporal_env.client, tmp_path):
        a, c = inc.site("a"), inc.site("c")
        await inc.join("a", 2)
        env = {**os.environ, **inc.settings.env()}
        for args in (["provider-loss", "--site", a], ["region-loss", "--geo", "us-east"]):
            proc = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "cli", "gameday", *args, "--timeout", "5"],
                env=env, capture_output=True, text=True, timeout=120,
            )
            said = " ".join(proc.stderr.split())  # the error wraps at the console's width
            assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
            assert "lost" not in proc.stdout, proc.stdout
            assert (f"{a}: its incident rule trips at 3 unreachable nodes" in said
                    and "it has 2 that can go unreachable" in said
                    and f"join 1 more first (gpufleet join --site {a} --count 1)" in said), said
            if args[0] == "region-loss":
                assert f"{c}: its incident rule trips at 3" in said and f"--site {c} --count 3" in said, said
            assert inc.world.site_row(a)["unreachable"] == 0 and inc.world.site_row(c)["unreachable"] == 0
        assert all(n.ready for n in inc.cluster.list_nodes()), "no node was cut off"


def test_trip_refusal_counts_the_nodes_the_site_entity_counts() -> None:
    """Only a node neither cordoned nor unproven can count towards the trip; with detection off
    nothing does; with enough, the game day goes ahead."""
    import uuid

    from cli.gameday import trip_refusal
    from fleet.cluster import UNPROVEN_TAINT
    from fleet.models import Node
    from fleet.config import FleetConfig
    from tests.evacuation_helpers import incident_fleet

    uid = uuid.uuid4().hex[:6]
    cfg = FleetConfig.model_validate(incident_fleet(uid, **{"c": {"incident": {"enabled": False}}}))
    a, c = f"a-{uid}", f"c-{uid}"

    def node(i: int, **kw) -> Node:
        return Node(name=f"n{i}", ready=True, **kw)

    assert trip_refusal(cfg, a, [node(i) for i in range(3)]) is None
    cordoned = trip_refusal(cfg, a, [node(0), node(1), node(2, unschedulable=True)])
    assert cordoned is not None and "it has 2 that can go unreachable" in cordoned, cordoned
    unproven = trip_refusal(cfg, a, [node(0), node(1), node(2, taints=[UNPROVEN_TAINT])])
    assert unproven is not None and "join 1 more" in unproven, unproven
    off = trip_refusal(cfg, c, [node(i) for i in range(5)])
    assert off is not None and "incident detection is off" in off, off
