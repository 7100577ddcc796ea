"""bench/actions.py: what the fleet costs in Temporal actions (what Temporal Cloud bills and
rate-limits), read from the dev server's own ``action`` counter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from bench.actions import HEARTBEAT, Window, figures, idle_cycles, idle_window, parse_actions, projection

ROOT = Path(__file__).resolve().parent.parent

METRICS = """# HELP action action counter
# TYPE action counter
action{action_type="grpc_RecordActivityTaskHeartbeat",namespace="default",operation="RecordActivityTaskHeartbeat",service_name="frontend"} 12
action{action_type="command_StartTimer",namespace="default",operation="RespondWorkflowTaskCompleted",service_name="history"} 5
action{action_type="grpc_StartWorkflowExecution",namespace="temporal_system",operation="StartWorkflowExecution",service_name="frontend"} 2
action_other{action_type="x",namespace="default"} 99
"""


def test_the_action_counter_is_read_per_namespace_by_action_type() -> None:
    """The server's own system workflows (namespace temporal_system) are not the fleet's bill."""
    assert parse_actions(METRICS, "default") == {HEARTBEAT: 12, "command_StartTimer": 5}


def test_heartbeats_are_charged_to_nodes_and_the_projection_scales_with_them() -> None:
    """Heartbeats leave no history: the per-node figure must include the counter's heartbeats."""
    idle = Window(seconds=3600, by_action_type=parse_actions(METRICS, "default"))
    idle.by_workflow_type.update({"Site": 20, "Node": 8, "CsrApprover": 120})
    f = figures(idle, sites=2, nodes=4)
    assert f["site"] == 10 and f["node"] == (8 + 12) / 4 and f["schedules"] == 120
    small = projection(f, 1_250, {"health change": 2}, price=50)
    large = projection(f, 10_000, {"health change": 2}, price=50)
    assert large["per_s"] > small["per_s"] and large["usd_month"] > small["usd_month"]
    # 100 health changes/s at 10,000 nodes, 2 actions each: 200 actions/s for events alone.
    assert large["events"] == pytest.approx(200)


def test_a_check_judges_every_idle_cycle_at_its_share() -> None:
    """A 300 s idle window sees the Site's 30-minute reconcile once or never: ``--check`` waits
    past the longest cycle, a look says what it leaves out, a check that would leave one out is
    refused before anything starts."""
    window, missed = idle_window(None, check=True)
    assert window > max(idle_cycles().values()) and not missed
    window, missed = idle_window(None, check=False)
    assert window == 300 and missed["a Site's safety reconcile"] == 1800
    with pytest.raises(typer.BadParameter, match=r"a Site's safety reconcile \(every 1800 s\)"):
        idle_window(300, check=True)


@pytest.mark.timeout(300)
def test_smoke_run_prints_every_figure() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.actions", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=280)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    for figure in ("per idle site", "per evacuated site", "per idle node", "per idle model", "Schedules, all",
                   "per join", "per health change", "per spot reclaim", "per catalog refresh, offers unchanged"):
        assert re.search(rf"{figure}\s+[0-9,.]+ actions", out), f"{figure} missing:\n{out}"
    for nodes in ("1,250", "10,000"):
        assert re.search(rf"{nodes} nodes: .* actions/s idle .*\$[0-9,]+/month", out), out
    # The idle node's watch heartbeats were counted from the server's counter.
    assert re.search(rf"{HEARTBEAT}\s+[0-9,]+/hour", out), out
    assert out.count("target ") >= 6, out
    assert re.search(r"target idle model <= 30/hour\s+met", out), out
    # A request waiting for capacity is woken by no catalog refresh that changed nothing.
    assert re.search(r"target waiting request per refresh <= 0\s+met", out), out
    # The evacuated site's wait, against what its poll cost (30 s probes: 240 an hour).
    assert re.search(r"by construction: polled \(before\) 240/hour, .*; watched \(now\) 14/hour", out), out


def test_heartbeats_are_shared_out_by_what_each_workflow_types_activities_were_due_to_send() -> None:
    """The server's heartbeat count names no workflow: the Site entities' watches beat too, so the
    count is shared out by each type's due heartbeats, not all charged to the nodes."""
    idle = Window(seconds=3600, by_action_type=parse_actions(METRICS, "default"))  # 12 heartbeats
    idle.heartbeats_due.update({"Node": 6, "Site": 2})
    f = figures(idle, sites=1, nodes=3)
    assert f["node_heartbeats"] == 12 * 6 / 8 / 3 and f["site_heartbeats"] == 12 * 2 / 8
    assert f["node"] == f["node_heartbeats"] and f["site"] == f["site_heartbeats"]


def test_an_evacuated_site_is_its_evacuation_waiting_for_recovery_not_everything_else() -> None:
    """The SiteEvacuation of a site that is down (its history and its watch's heartbeats) is the
    evacuated site's figure, per evacuated site, not part of "everything else"."""
    idle = Window(seconds=3600, by_action_type=parse_actions(METRICS, "default"))  # 12 heartbeats
    idle.by_workflow_type.update({"SiteEvacuation": 2, "Demand": 3})
    idle.heartbeats_due.update({"Node": 2, "SiteEvacuation": 2})
    f = figures(idle, sites=1, nodes=2, evacuated=2)
    assert f["evacuated"] == (2 + 6) / 2 and f["evacuated_heartbeats"] == 3 and f["other"] == 3
    assert figures(idle, sites=1, nodes=2)["other"] == 3 + 2 + 6, "no site evacuated: everything else"


def test_an_idle_model_is_its_routing_entity_and_scales_the_projection_by_the_models() -> None:
    """Each served model has a Routing entity: its history and its watch's heartbeats are the
    model's figure (not "everything else"), and the projection counts them per model."""
    idle = Window(seconds=3600, by_action_type=parse_actions(METRICS, "default"))  # 12 heartbeats
    idle.by_workflow_type.update({"Routing": 4, "Demand": 3})
    idle.heartbeats_due.update({"Node": 2, "Routing": 2})
    f = figures(idle, sites=1, nodes=2, models=2)
    assert f["model"] == (4 + 6) / 2 and f["model_heartbeats"] == 3 and f["other"] == 3
    assert f["node"] == 6 / 2
    few = projection(f, 1_250, {}, price=50, models=10)
    many = projection(f, 1_250, {}, price=50, models=110)
    assert many["idle"] - few["idle"] == pytest.approx(100 * f["model"] / 3600)
