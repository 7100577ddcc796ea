"""`gpufleet sites` as site status: nodes serving, cordoned (and by what), joining, and the last
incident; readable at 80 columns. The same on a live fleet (a real repair, the game day's incident,
an aborted evacuation): tests/test_readme_walk.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli.site_status import Holds, summarize
from fleet.cluster import LABEL_SITE, UNPROVEN_TAINT
from fleet.models import Node

ROOT = Path(__file__).resolve().parents[1]
SITES = ["a", "b"]


def node(name: str, site: str = "a", ready: bool = True, cordoned: bool = False, unproven: bool = False) -> Node:
    return Node(name=name, labels={LABEL_SITE: site}, ready=ready, unschedulable=cordoned,
                taints=[UNPROVEN_TAINT] if unproven else [])


def test_cordoned_nodes_are_counted_by_what_holds_them() -> None:
    nodes = [node("serving"), node("not-ready", ready=False), node("fenced", cordoned=True),
             node("quarantined", cordoned=True), node("by-hand", cordoned=True), node("new", unproven=True),
             node("b-1", site="b", cordoned=True), node("b-2", site="b", cordoned=True)]
    holds = Holds(repairs={"fenced": ["XID 79"], "quarantined": ["changed its own labels"]},
                  quarantined={"quarantined"}, evacuating={"b"}, joining={"a": {"new", "provisioning-1"}},
                  last_incident={"b": ("evacuate/b/1", "waiting-for-recovery")})
    now = summarize(SITES, nodes, holds)
    a, b = now["a"], now["b"]
    # Cordoned, NotReady and unproven nodes are not serving: "5 ready" read as serving was wrong.
    assert (a.serving, a.nodes) == (1, 6)
    assert a.cordoned_cell() == "3: quarantine 1, repair 1, operator 1"
    assert a.joining == 2 and a.last_incident == "none"  # the unproven node and a machine still provisioning
    assert b.cordoned_cell() == "2: evacuation 2" and b.serving == 0
    assert b.last_incident == "evacuate/b/1 waiting-for-recovery"


def test_an_open_incident_holds_what_nothing_else_does_and_a_repair_outlasts_an_evacuation() -> None:
    nodes = [node("x", cordoned=True), node("y", cordoned=True)]
    assert summarize(SITES, nodes, Holds(incident_open={"a"}))["a"].cordoned_cell() == "2: incident 2"
    both = Holds(repairs={"x": []}, evacuating={"a"})
    assert summarize(SITES, nodes, both)["a"].cordoned_cell() == "2: repair 1, evacuation 1"


def test_a_cordon_the_demand_loop_or_a_person_marked_is_theirs_not_an_operators() -> None:
    """The demand loop's retirement drain marks its cordon (``gpufleet.io/cordoned-by: demand``), a
    person who takes a node over writes their own: ``sites`` reads the mark, where before each read
    ``operator``. A repair still outranks the mark (it took the node), and a node's overlong mark is cut."""
    from cli.site_status import cordon_marks
    from fleet.cluster import ANNOTATION_CORDONED_BY, CORDONED_BY_DEMAND

    nodes = [node("retiring", cordoned=True), node("taken", cordoned=True), node("by-hand", cordoned=True),
             node("repaired", cordoned=True), node("loud", cordoned=True), node("serving")]
    annotations = {"retiring": {ANNOTATION_CORDONED_BY: CORDONED_BY_DEMAND},
                   "taken": {ANNOTATION_CORDONED_BY: "alice"}, "repaired": {ANNOTATION_CORDONED_BY: CORDONED_BY_DEMAND},
                   "loud": {ANNOTATION_CORDONED_BY: "x" * 300}, "serving": {ANNOTATION_CORDONED_BY: "stale"}}

    class Cluster:
        def annotate_node(self, name: str, changes: dict) -> dict:
            assert changes == {}, "only read"
            return annotations.get(name, {})

    marks = cordon_marks(Cluster(), nodes)
    assert set(marks) == {"retiring", "taken", "repaired", "loud"}, "cordoned nodes with a mark only"
    cell = summarize(SITES, nodes, Holds(repairs={"repaired": ["XID 79"]}), marks)["a"].cordoned_cell()
    assert cell == f"5: repair 1, demand loop 1, operator 1, alice 1, {'x' * 24} 1"


class WatchedCluster:
    """The cluster as ``fleet.watched`` reads it: every node's identity record but "foreign"'s, and
    the cordon marks given (node → its ``cordoned-by``)."""

    def __init__(self, marks: dict[str, str]) -> None:
        self.marks = marks

    def node_identity(self, name: str):
        from fleet.cluster import NodeIdentity

        if name == "foreign":
            return None
        return NodeIdentity(node_name=name, machine_id=f"m-{name}", provider="lambda", account="x", site="a")

    def node_marks(self, name: str):
        from fleet.cluster import ANNOTATION_CORDONED_BY
        from providers.cluster.base import NodeMarks

        return NodeMarks(annotations={ANNOTATION_CORDONED_BY: self.marks[name]}, unschedulable=True, version="1")


def test_a_ready_node_without_a_running_entity_is_unwatched_unless_its_retirement_holds_it() -> None:
    """``fleet.watched``, which the site sweep starts entities from, the metrics count and `sites`
    shows: a Ready, proven node with the join's identity record and no running Node entity is
    unwatched, whatever site its own label says (the record's counts); not a node whose entity runs,
    a NotReady or unproven one, one gpufleet has no record of (not joined by it, or retired), nor one
    cordoned for its retirement. A node cordoned by a person or a repair still needs its entity."""
    from fleet.cluster import CORDONED_BY_SURPLUS
    from fleet.watched import unwatched_nodes

    nodes = [node("watched"), node("lost", site="b"), node("not-ready", ready=False), node("new", unproven=True),
             node("foreign"), node("retiring", cordoned=True), node("held", cordoned=True)]
    marks = {"retiring": CORDONED_BY_SURPLUS, "held": "alice"}

    found = unwatched_nodes(WatchedCluster(marks), nodes, watched={"watched"})
    assert [i.node_name for i in found] == ["held", "lost"]
    now = summarize(SITES, nodes, Holds(watched={"watched"}), unwatched=found)
    assert (now["a"].unwatched, now["b"].unwatched) == (2, 0), "counted at the site its record names"
    assert summarize(SITES, nodes, None)["a"].unwatched is None, "unknown without Temporal"


def test_a_not_ready_node_a_repair_runs_on_needs_its_entity_unless_its_retirement_holds_it() -> None:
    """A GpuRepair asks the node's entity for its action slot and, the entity gone, waits for the
    site sweep to start one. Its reboot timed out, the node stays NotReady, and the sweep, which
    looked only at Ready nodes, never started the entity: the repair waited for good. A NotReady
    node under a running repair (``repair/<node>/gpu<N>``) needs its entity, from the join's record
    and not while cordoned for its retirement; a NotReady node no repair runs on does not."""
    from fleet.cluster import CORDONED_BY_SURPLUS
    from fleet.naming import repair_node_name, repair_workflow_id
    from fleet.watched import unwatched_nodes

    nodes = [node("rebooted", ready=False), node("stopped", ready=False), node("foreign", ready=False),
             node("retiring", ready=False, cordoned=True), node("fenced", ready=False, cordoned=True)]
    marks = {"retiring": CORDONED_BY_SURPLUS, "fenced": "repair/fenced/gpu1"}

    repairs = [repair_workflow_id(n, 1) for n in ("rebooted", "foreign", "retiring", "fenced")]
    under_repair = {repair_node_name(r) for r in repairs + ["repair/x/y/gpu0", "repair/z/gpux", "reclaim/stopped"]}
    assert under_repair == {"rebooted", "foreign", "retiring", "fenced", None}
    found = unwatched_nodes(WatchedCluster(marks), nodes, watched=set(), under_repair=under_repair - {None})
    assert [i.node_name for i in found] == ["fenced", "rebooted"]
    watched = {"rebooted", "fenced"}
    assert unwatched_nodes(WatchedCluster(marks), nodes, watched=watched, under_repair=under_repair) == []
    assert unwatched_nodes(WatchedCluster(marks), nodes, watched=set()) == [], "without a repair a NotReady node waits"


def test_put_backs_left_to_a_person_are_counted_beside_the_last_incident() -> None:
    """A Site entity that gave up putting back a closed evacuation said so only in its status query,
    details and log; `gpufleet sites` counts them beside the site's last incident (an older
    evacuation's too)."""
    holds = Holds(last_incident={"a": ("evacuate/a/3", "restored"), "b": ("evacuate/b/1", "aborted")},
                  put_backs_left={"a": {"evacuate/a/1": "what it left not all put back, left to a person",
                                        "evacuate/a/2": "what it left not all put back, left to a person"}})
    now = summarize(SITES, [], holds)
    assert now["a"].incident_cell() == "evacuate/a/3 restored; 2 put-backs left to a person"
    assert now["b"].incident_cell() == "evacuate/b/1 aborted"
    assert summarize(SITES, [], None)["a"].incident_cell() == "?"


def test_without_temporal_the_counts_stand_and_what_it_would_say_is_unknown() -> None:
    now = summarize(SITES, [node("x", cordoned=True), node("new", unproven=True)], None)["a"]
    assert now.cordoned_cell() == "1: ? 1" and now.joining == 1 and now.last_incident == "?"


@pytest.mark.integration  # runs the command as an operator does
def test_sites_shows_the_status_columns_and_fits_80_columns(tmp_path: Path) -> None:
    # No Temporal at this address: the command still answers, from the cluster, and says so.
    env = {"GPUFLEET_STATE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "COLUMNS": "80",
           "TEMPORAL_ADDRESS": "127.0.0.1:9"}
    table = subprocess.run([sys.executable, "-m", "cli", "sites", "-o", "table"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, table.stdout
    header = next(line for line in lines if "site" in line and "cordoned" in line)
    for column in ("serving", "cordoned", "join", "incident"):
        assert column in header, table.stdout
    assert "did not answer" in table.stderr
    as_json = subprocess.run([sys.executable, "-m", "cli", "sites", "-o", "json"], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    row = json.loads(as_json.stdout)[0]
    assert {"serving/nodes": "0/0", "cordoned": "0", "unwatched": "?", "joining": "0",
            "last incident": "?"}.items() <= row.items()
    assert "region" in row and "reachable" in row  # JSON keeps every column


async def test_sites_says_once_that_no_worker_answered_and_asks_no_more(fleet_world, monkeypatch) -> None:
    """Three cordoned nodes whose Node entities run on a queue no worker polls (the control plane
    down): each node's hold lookup waited the server's 30 s and was swallowed, so `gpufleet sites`
    took 90 s and named their cordons `operator`. It stops asking after the first unanswered query,
    says once why the holds could not be read, and shows them as `?`."""
    import asyncio
    import uuid

    from typer.testing import CliRunner

    from cli.main import app
    from fleet.naming import node_workflow_id
    from fleet.settings import TASK_QUEUE_ENV
    from sim.cluster import SimCluster

    queue = fleet_world.settings.task_queue
    cordoned = [node(f"no-worker-{uuid.uuid4().hex[:6]}-{i}", site="site-a", cordoned=True) for i in range(3)]
    handles = [await fleet_world.client.start_workflow("Node", {}, id=node_workflow_id(n.name), task_queue=queue)
               for n in cordoned]
    monkeypatch.setattr(SimCluster, "list_nodes", lambda self, selector=None: cordoned)
    import client as client_package

    asked: list[str] = []
    real_query = client_package.query_workflow

    async def counted(temporal, workflow_id, *args, **kwargs):
        asked.append(workflow_id)
        return await real_query(temporal, workflow_id, *args, **kwargs)

    monkeypatch.setattr(client_package, "query_workflow", counted)
    args = ["sites", "-o", "wide", "--address", fleet_world.settings.address,
            "--state-dir", str(fleet_world.settings.state_dir), "--config", fleet_world.settings.config]
    try:
        shown = await asyncio.to_thread(CliRunner().invoke, app, args, env={TASK_QUEUE_ENV: queue})
    finally:
        for handle in handles:
            await handle.terminate()
    said = " ".join(shown.output.split())
    assert shown.exit_code == 0, said
    assert asked == [node_workflow_id(cordoned[0].name)], asked  # one unanswered query, not one per node
    assert said.count("no worker answered") == 1, said
    assert (f"what holds a cordoned node could not all be read (those show ?): no worker answered `status` of "
            f"`{node_workflow_id(cordoned[0].name)}` within 10 s: is the control plane running "
            f"(its worker polls `{queue}`)?") in said, said
    assert "3: ? 3" in said, said
