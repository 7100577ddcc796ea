"""The ``gpufleet`` command as an operator runs it, against the test server."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from temporalio.testing import ActivityEnvironment

from fleet.messages.nodes import ProbeGpusInput, SmokeTestInput
from cli.dev import temporal_binary
from activities.node_agent import NodeAgentActivities
from sim.gpu import SimGpuBackend
from tests.conftest import Stack
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
