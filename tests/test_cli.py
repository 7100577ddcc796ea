"""The ``gpufleet`` command as an operator runs it, against the test server."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import time
import uuid

import pytest
from temporalio import workflow
from temporalio.testing import ActivityEnvironment

from fleet.messages.nodes import ProbeGpusInput, SmokeTestInput
from cli.dev import temporal_binary
from activities.node_agent import NodeAgentActivities
from sim.gpu import SimGpuBackend
from tests.conftest import TEST_FLEET, Stack, write_fleet
from fleet.messages.join import NodeJoinResult


async def gpufleet(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    env = {**stack.settings_env(), "COLUMNS": "200"}
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


async def test_join_wait_shows_ready_nodes_and_tables(stack: Stack) -> None:
    done = await gpufleet(stack, "join", "--site", "site-a", "--count", "2", "--wait")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("ready") >= 2
    nodes = await gpufleet(stack, "nodes")
    assert nodes.returncode == 0
    names = [m["name"] for m in stack.world.machines("site-a")]
    assert len(names) == 2 and all(name in nodes.stdout for name in names)
    sites = await gpufleet(stack, "sites")
    assert "site-a" in sites.stdout and "2/2" in sites.stdout


async def test_join_failure_exits_non_zero_with_the_typed_error(stack: Stack) -> None:
    # An unknown site is refused before anything starts (issue 15): usage error, exit 2.
    unknown = await gpufleet(stack, "join", "--site", "atlantis", "--wait")
    assert unknown.returncode == 2
    assert "--site: unknown site 'atlantis'" in unknown.stderr and "started" not in unknown.stdout

    capacity = await gpufleet(stack, "sim", "capacity", "site-b", "0")
    assert capacity.returncode == 0
    none_left = await gpufleet(stack, "join", "--site", "site-b", "--wait")
    assert none_left.returncode == 1
    assert "NoCapacity" in none_left.stderr

    zero = await gpufleet(stack, "join", "--site", "site-a", "--count", "0")
    assert zero.returncode == 2 and "--count" in zero.stderr
    assert stack.world.calls("acct-a") == 0


async def test_sim_commands_change_the_world(fleet_world: Stack) -> None:
    stack = fleet_world
    assert (await gpufleet(stack, "sim", "quota", "site-a", "3")).returncode == 0
    assert (await gpufleet(stack, "sim", "latency", "site-a", "250")).returncode == 0
    assert (await gpufleet(stack, "sim", "unreachable", "site-b")).returncode == 0
    assert (await gpufleet(stack, "sim", "revoke", "acct-b")).returncode == 0
    row = stack.world.site_row("site-a")
    assert (row["quota"], row["api_latency_ms"]) == (3, 250)
    assert stack.world.site_row("site-b")["unreachable"] == 1
    assert stack.world.query("SELECT credentials_valid FROM accounts WHERE name='acct-b'")[0][0] == 0
    bad = await gpufleet(stack, "sim", "capacity", "nowhere", "1")
    assert bad.returncode == 2 and "nowhere" in bad.stderr


async def test_sim_fault_reaches_the_node_agents_probe(stack: Stack) -> None:
    handle = await stack.start_join({"site": "site-a"})
    (node,) = NodeJoinResult.model_validate(await handle.result()).nodes
    fault = await gpufleet(stack, "sim", "fault", node.node_name, "--gpu", "1", "--xid", "79")
    assert fault.returncode == 0, fault.stderr

    agent = NodeAgentActivities(node.node_name, SimGpuBackend(stack.world, node.machine_id))
    probe = ActivityEnvironment().run(agent.probe_gpus, ProbeGpusInput())
    assert [e.xid for e in probe.gpus[1].xid_events] == [79]
    assert probe.gpus[0].xid_events == []
    smoke = ActivityEnvironment().run(agent.smoke_test, SmokeTestInput(expected_gpus=2))
    assert not smoke.passed and smoke.failures == ["GPU 1: XID 79"]


async def test_tracing_is_off_by_default_and_exports_when_configured(stack: Stack) -> None:
    quiet = await gpufleet(stack, "join", "--site", "site-a", "--request", "quiet", "--wait")
    assert quiet.returncode == 0 and "trace_id" not in quiet.stdout
    env_run = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "cli", "join", "--site", "site-a", "--request", "traced", "--wait"],
        env={**stack.settings_env(), "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "gpufleet-test"},
        capture_output=True, text=True, timeout=120,
    )
    assert env_run.returncode == 0, env_run.stderr
    assert "StartWorkflow:NodeJoin" in env_run.stdout
    assert "gpufleet-test" in env_run.stdout


async def test_the_temporal_cli_starts_a_join_with_plain_json(stack: Stack) -> None:
    """The README's `temporal workflow start` and `temporal workflow list --query` lines."""
    temporal = [temporal_binary(), "--address", stack.settings.address]
    started = await asyncio.to_thread(subprocess.run, [
        *temporal, "workflow", "start", "--type", "NodeJoin", "--task-queue", stack.settings.task_queue,
        "--workflow-id", "join/site-b/from-cli", "--input", '{"site": "site-b"}',
    ], capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    result = await stack.client.get_workflow_handle("join/site-b/from-cli").result()
    node_name = NodeJoinResult.model_validate(result).nodes[0].node_name

    query = f'Site="site-b" AND FleetState="ready" AND NodeName="{node_name}"'
    for _ in range(50):
        listed = await asyncio.to_thread(subprocess.run, [
            *temporal, "workflow", "list", "--query", query, "--output", "json",
        ], capture_output=True, text=True)
        if "join/site-b/from-cli" in listed.stdout:
            break
        await asyncio.sleep(0.1)
    assert "join/site-b/from-cli" in listed.stdout, listed.stderr


async def test_reconcile_says_what_the_site_will_do_and_refuses_an_unknown_site(stack: Stack) -> None:
    """`gpufleet reconcile SITE`: the Site entity's ``reconcile_now`` update (started if need be),
    answered with what the reconcile will do; an unknown site is refused before anything is sent."""
    unknown = await gpufleet(stack, "reconcile", "atlantis")
    assert unknown.returncode == 2 and "atlantis" in unknown.stderr, unknown.stderr
    assert not [w async for w in stack.client.list_workflows('WorkflowId = "site/atlantis"')]
    done = await gpufleet(stack, "reconcile", "site-a")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("site-a: ") and len(done.stdout.strip()) > len("site-a: "), done.stdout
    described = await stack.client.get_workflow_handle("site/site-a").describe()
    assert described.workflow_type == "Site"


# -- watches while no worker answers (the control plane down) -----------------------------------
def no_worker_line(workflow_id: str, query: str, stack: Stack) -> str:
    return (f"no worker answered `{query}` of `{workflow_id}` within 10 s: is the control plane running "
            f"(its worker polls `{stack.settings.task_queue}`)?")


async def said_after_one_poll(fleet, query: str, watch) -> None:
    """Run ``watch`` until it asks ``fleet.<query>`` a second time, then stop it (as Ctrl-C
    would): whatever it printed by then, it printed after one poll."""
    second_poll = asyncio.Event()
    asked = 0
    real = getattr(fleet, query)

    async def counted(*args):
        nonlocal asked
        asked += 1
        if asked > 1:
            second_poll.set()
            await asyncio.Event().wait()  # the watch is cancelled here
        return await real(*args)

    setattr(fleet, query, counted)
    watching, polled = asyncio.ensure_future(watch), asyncio.ensure_future(second_poll.wait())
    try:
        await asyncio.wait({watching, polled}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watching, polled):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert asked == 2, f"the watch asked {asked} time(s), then stopped"


async def test_gpufleet_join_with_no_worker_says_why_after_one_poll_and_keeps_watching(fleet_world: Stack,
                                                                                        capsys) -> None:
    """The join runs but no worker polls its queue (the control plane down, or mid-deploy): each
    progress query was swallowed, and `gpufleet join` showed `starting` for ever. After one
    unanswered poll it says which query went unanswered, where the worker should poll, and that
    it goes on watching (the worker may come back); it asks again."""
    from cli.main import _watch_joins
    from client import FleetClient

    fleet = FleetClient(fleet_world.settings, fleet_world.client)
    handle = await fleet.start_join({"site": "site-a"}, request_id=f"no-worker-{uuid.uuid4().hex[:6]}")
    try:
        await said_after_one_poll(fleet, "join_progress", _watch_joins(fleet, [handle]))
    finally:
        await handle.terminate()
    said = capsys.readouterr().out
    assert f"{handle.id}: starting\n" in said, said
    assert f"{no_worker_line(handle.id, 'progress', fleet_world)} (gpufleet dev / kubectl -n gpufleet get pods); " \
           "still watching; Ctrl-C to stop\n" in said, said


@pytest.mark.parametrize("workflow_type, workflow_id, query, watch", [
    ("SiteEvacuation", "evacuate/site-a/manual-", "evacuation_progress", "cli.evacuate:_watch"),  # watch_until_done
    ("ModelRollout", "rollout/no-worker/", "rollout_progress", "cli.rollout:_wait"),
])
async def test_a_watched_request_with_no_worker_says_why_after_one_poll(fleet_world: Stack, capsys, workflow_type,
                                                                       workflow_id, query, watch) -> None:
    """`watch_until_done` (gpufleet evacuate start, gpufleet capacity) and `gpufleet rollout start
    --wait` swallowed every failed progress query: with no worker they printed nothing at all.
    After one unanswered poll each says why, and that it goes on watching."""
    import importlib

    from client import FleetClient

    module, _, name = watch.partition(":")
    fleet = FleetClient(fleet_world.settings, fleet_world.client)
    handle = await fleet_world.client.start_workflow(workflow_type, {}, id=workflow_id + uuid.uuid4().hex[:6],
                                                     task_queue=fleet_world.settings.task_queue)
    try:
        await said_after_one_poll(fleet, query, getattr(importlib.import_module(module), name)(fleet, handle))
    finally:
        await handle.terminate()
    said = capsys.readouterr().out
    assert said.startswith(no_worker_line(handle.id, "progress", fleet_world)), said
    assert said.endswith("; still watching; Ctrl-C to stop\n"), said


@pytest.mark.parametrize("workflow_type, argv, update", [
    ("ModelRollout", ["rollout", "pause", "rollout/no-worker/{tag}"], "pause"),  # FleetClient._update
    ("Node", ["repair", "return", "lost-{tag}", "0", "--reason", "checked by hand"], "return_gpu"),
    ("AcquireCapacity", ["capacity-cancel", "capacity/lost-{tag}"], "cancel"),  # start_update, then its result
    ("Site", ["reconcile", "lost-{tag}"], "reconcile_now"),  # update-with-start: the CLI starts the Site itself
])
async def test_an_update_no_worker_takes_says_why_and_exits_non_zero(fleet_world: Stack, tmp_path, workflow_type,
                                                                     argv, update) -> None:
    """An update waits for a worker to take it: with the control plane down, `gpufleet rollout
    pause`, `repair return`, `capacity-cancel` and `reconcile` waited for ever and printed nothing
    (the SDK sends the update again each time the server says it is only admitted). Each now says,
    within the query's bound, which update no worker took, where the worker should poll, and that
    it may still be taken; exit 1."""
    from fleet.naming import site_workflow_id

    tag = uuid.uuid4().hex[:6]
    argv = [a.format(tag=tag) for a in argv]
    (tmp_path / "own").mkdir()
    fleet = dict(TEST_FLEET, sites=[dict(TEST_FLEET["sites"][0], name=f"lost-{tag}")])  # an id no other test uses
    env = {**fleet_world.settings_env(), "GPUFLEET_CONFIG": str(write_fleet(tmp_path / "own", fleet)), "COLUMNS": "400"}
    workflow_id = {"ModelRollout": argv[-1], "Node": f"node/lost-{tag}", "AcquireCapacity": argv[-1],
                   "Site": site_workflow_id(f"lost-{tag}")}[workflow_type]
    if workflow_type != "Site":
        await fleet_world.client.start_workflow(workflow_type, {}, id=workflow_id,
                                                task_queue=fleet_world.settings.task_queue)
    try:  # before: still waiting when this bound came
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cli", *argv], env=env,
                                       capture_output=True, text=True, timeout=90)
    finally:
        await fleet_world.client.get_workflow_handle(workflow_id).terminate()
    assert done.returncode == 1, (done.stdout, done.stderr)
    said = " ".join(done.stderr.split())
    assert said.startswith(f"error: no worker took the update `{update}` of `{workflow_id}` within 10 s: is the "
                           f"control plane running (its worker polls `{fleet_world.settings.task_queue}`)? "), said
    assert said.endswith("it is not applied, but the server may still hand it to a worker that starts soon: "
                         "look at the workflow before sending it again"), said


@workflow.defn(name="AnswersWhenReleased")
class AnswersWhenReleased:
    """Takes the update ``pause`` at once (no validator) and answers it once the signal ``release``
    has come: a worker that stops between the two leaves it taken and unanswered."""

    def __init__(self) -> None:
        self.released = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.signal
    def release(self) -> None:
        self.released = True

    @workflow.update
    async def pause(self, reason: str) -> dict:
        await workflow.wait_condition(lambda: self.released)
        return {"rollout_id": workflow.info().workflow_id, "model": "m", "version": "v1", "phase": "paused",
                "paused": True, "reason": reason}


async def test_an_update_whose_worker_stops_after_taking_it_says_it_goes_on_and_exits_non_zero(fleet_world: Stack,
                                                                                            capsys, monkeypatch) -> None:
    """A worker took `pause` and stopped before answering it: the update's taking was bounded, its
    answer was not, so `gpufleet rollout pause` waited for ever, saying nothing. Within its bound (the
    client's update_answer_timeout, a few seconds here; the commands' is UPDATE_ANSWER_TIMEOUT) it says
    it waits and until when, then that the workflow took the update, that it goes on there and is not
    to be sent again, and how to look at it; exit 1. A worker that polls again answers it, under the
    update id the message names."""
    from temporalio.api.enums.v1 import EventType
    from temporalio.worker import UnsandboxedWorkflowRunner, Worker

    import typer

    from cli.common import run
    from client import FleetClient, UpdateUnanswered
    from fleet.rollout import RolloutProgress
    from tests.evacuation_helpers import poll

    client, tag = fleet_world.client, uuid.uuid4().hex[:6]
    queue, workflow_id = f"answers-{tag}", f"rollout/stuck-{tag}/v1"
    waited: list[str] = []
    from datetime import timedelta

    # Told it waits well within its bound: with the default 2 s quiet period and a 3 s bound, a loop
    # stalled a second (a loaded machine) passed the bound before the message, and none was said.
    monkeypatch.setattr("client.fleet.UPDATE_ANSWER_QUIET", timedelta(seconds=0.2))
    fleet = FleetClient(fleet_world.settings, client, update_answer_timeout=3, waiting=waited.append)

    def worker() -> Worker:
        return Worker(client, task_queue=queue, workflows=[AnswersWhenReleased],
                      workflow_runner=UnsandboxedWorkflowRunner())

    async def taken() -> bool:
        return any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
                   for e in (await handle.fetch_history()).events)

    handle = await client.start_workflow("AnswersWhenReleased", id=workflow_id, task_queue=queue)
    try:
        async with worker():
            paused = asyncio.ensure_future(fleet.pause_rollout(workflow_id, "hold on"))
            await poll(taken)
        await handle.signal("release")  # it would answer now, had it a worker
        with pytest.raises(UpdateUnanswered) as unanswered:
            await asyncio.wait_for(paused, 60)  # before: still waiting here (TimeoutError)
        error = unanswered.value
        assert re.fullmatch(rf"`{workflow_id}` accepted the update `pause`; waiting for its answer until "
                            r"\d\d:\d\d:\d\d UTC \(Ctrl-C stops the waiting, not the update\)", " ".join(waited)), waited
        assert str(error) == (
            f"`{workflow_id}` accepted the update `pause` but gave no answer within 3 s: it is in the workflow's "
            "history and goes on there (its worker may have stopped as it ran it: the next worker to poll the queue "
            "carries it on; or it waits on something slow), so do not send it again; look: `temporal workflow "
            f"update describe --workflow-id {workflow_id} --update-id {error.update_id}` or `gpufleet rollout status "
            f"{workflow_id}`")

        async def unanswered_command() -> None:  # the command's end: what `cli.common.run` makes of it
            raise error

        with pytest.raises(typer.Exit) as exited:
            await asyncio.to_thread(run, unanswered_command())
        assert exited.value.exit_code == 1
        assert " ".join(capsys.readouterr().err.split()) == f"error: {error}"

        async with worker():  # the update went on: a worker answers it
            answer = await asyncio.wait_for(handle.get_update_handle(
                error.update_id, result_type=RolloutProgress).result(), 60)
        assert (answer.phase, answer.reason) == ("paused", "hold on")
    finally:
        await handle.terminate()


async def test_a_game_day_with_no_worker_says_why_and_until_when_and_watches_to_its_timeout(fleet_world: Stack,
                                                                                           capsys) -> None:
    """The game day's watch asks the Site entity for its incident: with no worker that query
    ended the game day with the server's error. It says why and until when it watches, and
    watches to its --timeout."""
    from cli.gameday import _watch
    from client import FleetClient
    from fleet.naming import site_workflow_id

    fleet = FleetClient(fleet_world.settings, fleet_world.client)
    site = f"lost-{uuid.uuid4().hex[:6]}"
    handle = await fleet_world.client.start_workflow("Site", {}, id=site_workflow_id(site),
                                                     task_queue=fleet_world.settings.task_queue)
    try:  # the timeout has passed once the first look is done: one look
        report = await asyncio.wait_for(_watch(fleet, fleet_world.world, [site], {site: 0}, time.time(), 2.0,
                                               timeout=0.5), 60)
    finally:
        await handle.terminate()
    said = capsys.readouterr().out
    assert report["sites"][site]["outcome"] == "not detected", report
    assert no_worker_line(site_workflow_id(site), "status", fleet_world) in said, said
    assert re.search(r"; still watching until \d\d:\d\d:\d\d UTC; Ctrl-C to stop\n", said), said
