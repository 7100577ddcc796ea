"""`gpufleet evacuate start|abort|recovered` (issue 36): a provider incident by hand from the
command line. `start` follows the evacuation line by line when piped and names its UI page;
Ctrl-C on it aborts the evacuation, which puts back what it changed; `recovered` ends it
restored; `--detach` leaves it running; refusals name the field and exit non-zero.

Against the real dev server, the control-plane worker and the simulated providers (the
incident tests' four-site fleet), the command run as an operator runs it."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid

import pytest
from temporalio.client import WithStartWorkflowOperation, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy

from fleet.contracts import workflows as flows
from fleet.messages.evacuation import EvacuationResult
from tests.evacuation_helpers import IncStack, incident_fleet, open_incident_stack, poll
from tests.replay import replay_and_record
from tests.test_cli_cancel import finished, read_until


@pytest.fixture
async def inc(temporal_env, tmp_path):
    uid = uuid.uuid4().hex[:6]
    # One recovery probe when it starts waiting, then none for ten minutes: only the test ends the wait.
    fleet = incident_fleet(uid, incident={"probe_seconds": 600})
    async for stack in open_incident_stack(temporal_env.client, tmp_path, fleet, uid):
        yield stack


def gpufleet(inc: IncStack, *args: str) -> subprocess.Popen:
    import os

    return subprocess.Popen([sys.executable, "-m", "cli", *args], env={**os.environ, **inc.settings.env(), "COLUMNS": "250"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def ran(inc: IncStack, *args: str) -> tuple[int, str]:
    proc = gpufleet(inc, *args)
    out = await finished(proc, timeout=60)
    return proc.returncode, out


def cordoned(inc: IncStack, site: str) -> set[str]:
    return {n.name for n in inc.cluster.list_nodes({"node-restriction.kubernetes.io/gpufleet-site": site})
            if n.unschedulable}


async def evacuating(inc: IncStack, site: str) -> tuple[str, list[str]]:
    """Two nodes at ``site``, the site cut off (the provider is down, so the evacuation waits)."""
    machines = await inc.join("a", 2)
    inc.world.set_site(site, unreachable=1)
    return site, sorted(inc.world.machine(m)["name"] for m in machines)


async def test_ctrl_c_on_evacuate_start_aborts_and_puts_everything_back(inc: IncStack) -> None:
    site, names = await evacuating(inc, inc.site("a"))
    request = "int"
    workflow_id = f"evacuate/{site}/manual-{request}"
    proc = gpufleet(inc, "evacuate", "start", site, "--request", request, "--reason", "test: provider down")
    try:
        early = await read_until(proc, "waiting-for-recovery", timeout=60)  # piped: one line per change
        assert cordoned(inc, site) == set(names), "the evacuation drained the site"
        assert inc.cluster.get_site_routes().sites[site].weight == 0
        proc.send_signal(signal.SIGINT)
        out = early + await finished(proc, timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    port = int(inc.settings.address.rpartition(":")[2]) + 1000
    assert f"UI: http://127.0.0.1:{port}/namespaces/default/workflows/evacuate%2F{site}%2Fmanual-{request}" in out, out
    line = next(x for x in out.splitlines() if "waiting-for-recovery" in x)
    assert f"`gpufleet evacuate recovered {site}`" in line and "2 node(s) drained" in line, line
    assert f"aborted {workflow_id}: 2 drained node(s) uncordoned, routing weights as before" in out, out
    assert "Traceback" not in out, out
    assert cordoned(inc, site) == set(), "every node it cordoned is uncordoned"
    routes = inc.cluster.get_site_routes().sites[site]
    assert (routes.weight, routes.healthy, routes.draining) == (100, True, False)
    handle = inc.client.get_workflow_handle(workflow_id)
    assert EvacuationResult.model_validate(await handle.result()).outcome == "aborted"


async def test_a_cancel_from_temporal_while_evacuate_start_watches_says_what_it_put_back(inc: IncStack) -> None:
    """Someone presses Cancel in the UI (or `temporal workflow cancel`) while an operator's
    `evacuate start` follows the evacuation: the cancel puts back what it changed, as an abort
    does, and the command says so instead of calling it a failure."""
    site, names = await evacuating(inc, inc.site("a"))
    request = "ui-cancel"
    workflow_id = f"evacuate/{site}/manual-{request}"
    proc = gpufleet(inc, "evacuate", "start", site, "--request", request, "--reason", "test: provider down")
    try:
        early = await read_until(proc, "waiting-for-recovery", timeout=60)
        assert cordoned(inc, site) == set(names), "the evacuation drained the site"
        await inc.client.get_workflow_handle(workflow_id).cancel()
        out = early + await finished(proc, timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    assert f"cancelled {workflow_id}: 2 drained node(s) uncordoned, routing weights as before" in out, out
    assert "failed" not in out and "Traceback" not in out, out
    assert cordoned(inc, site) == set(), "every node it cordoned is uncordoned"
    assert (await inc.client.get_workflow_handle(workflow_id).describe()).status == WorkflowExecutionStatus.CANCELED


async def test_ctrl_c_while_the_start_call_returns_aborts_the_evacuation_it_started(inc: IncStack) -> None:
    """The server has started the evacuation; the Ctrl-C lands before the command heard so."""
    import os

    site, names = await evacuating(inc, inc.site("a"))
    workflow_id = f"evacuate/{site}/manual-int"
    proc = subprocess.Popen([sys.executable, "-m", "tests.interrupt_at_start", "evacuate_site", "evacuate", "start",
                             site, "--request", "int"],
                            env={**os.environ, **inc.settings.env(), "COLUMNS": "250"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = await finished(proc, timeout=120)
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    assert f"aborted {workflow_id}" in out, out
    result = EvacuationResult.model_validate(await inc.client.get_workflow_handle(workflow_id).result())
    assert result.outcome == "aborted"
    assert cordoned(inc, site) == set(), "whatever it had cordoned is uncordoned"
    routes = inc.cluster.get_site_routes().sites[site]
    assert (routes.weight, routes.healthy, routes.draining) == (100, True, False)


async def in_first_task(inc: IncStack, site: str, request: str, update, *args):
    """Start an evacuation of ``site`` with ``update`` in its first task (update-with-start puts it
    there every time); the update's answer and the evacuation's handle."""
    start = WithStartWorkflowOperation(
        flows.SiteEvacuation.TYPE, {"site": site, "reason": f"test: {request}"}, id=f"evacuate/{site}/manual-{request}",
        task_queue=inc.settings.task_queue, id_conflict_policy=WorkflowIDConflictPolicy.FAIL)
    said = await inc.client.execute_update_with_start_workflow(update, *args, start_workflow_operation=start)
    return said, await start.workflow_handle()


async def test_an_abort_in_the_evacuations_first_task_is_taken(inc: IncStack) -> None:
    """What the test above depends on: the command's abort, sent at once, can reach the run's
    first task (a loaded worker polls late), whose updates the SDK hands to their handlers before
    ``run`` has begun. Refused there ("still starting"), the command said "nothing to abort" and
    the evacuation went on to drain the site. Update-with-start puts the abort there every time."""
    site, names = await evacuating(inc, inc.site("a"))
    _, handle = await in_first_task(inc, site, "first-task", flows.SiteEvacuation.abort, "test: Ctrl-C")
    result = EvacuationResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert result.outcome == "aborted"
    assert cordoned(inc, site) == set(), "nothing drained"
    routes = inc.cluster.get_site_routes().sites[site]
    assert (routes.weight, routes.healthy, routes.draining) == (100, True, False)
    await replay_and_record(handle, "site_evacuation_aborted_in_its_first_task")


async def test_recovered_and_look_again_in_the_evacuations_first_task_are_taken(inc: IncStack) -> None:
    """An operator's `recovered` or `look_again` can land in a run's first task: with its start, or
    as a long wait for recovery continues as new, where ``run`` has not yet restored the progress.
    Both were refused "the evacuation is still starting"; they wait for the run and are taken."""
    site, names = await evacuating(inc, inc.site("a"))
    said, handle = await in_first_task(inc, site, "first-look", flows.SiteEvacuation.look_again)
    assert said.startswith("noted, but nothing waits for it: the evacuation is evacuating"), said
    await handle.execute_update(flows.SiteEvacuation.abort, "test: done looking")
    assert EvacuationResult.model_validate(await asyncio.wait_for(handle.result(), 60)).outcome == "aborted"
    await replay_and_record(handle, "site_evacuation_looked_at_in_its_first_task")

    inc.world.set_site(site, unreachable=0)  # the provider is back: the smoke tests can pass
    _, handle = await in_first_task(inc, site, "first-recovered", flows.SiteEvacuation.declare_recovered,
                                    "provider ticket closed")
    result = EvacuationResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert result.outcome == "restored"
    assert ("recovered", "provider ticket closed") in [(step.name, step.detail) for step in result.timeline]
    assert cordoned(inc, site) == set(), "nothing left cordoned"
    assert inc.cluster.get_site_routes().sites[site].weight == 100
    await replay_and_record(handle, "site_evacuation_recovered_in_its_first_task")


async def test_recovered_ends_a_watched_evacuation_restored(inc: IncStack) -> None:
    site, names = await evacuating(inc, inc.site("a"))
    proc = gpufleet(inc, "evacuate", "start", site, "--request", "rec")
    try:
        await read_until(proc, "waiting-for-recovery", timeout=60)
        inc.world.set_site(site, unreachable=0)  # the provider is back; the next probe is ten minutes away
        await poll(lambda: inc.workflows("SiteEvacuation", "a"), timeout=30)  # `recovered` finds it by listing
        code, said = await ran(inc, "evacuate", "recovered", site, "--note", "provider ticket closed")
        assert code == 0 and f"{site} declared recovered" in said, said
        out = await finished(proc, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert f"restored evacuate/{site}/manual-rec" in out, out
    assert cordoned(inc, site) == set()
    assert inc.cluster.get_site_routes().sites[site].weight == 100


async def test_refusals_name_the_field_and_detach_then_abort(inc: IncStack) -> None:
    site = inc.site("a")
    code, out = await ran(inc, "evacuate", "start", "mars-1")
    assert code == 2 and "site: unknown site 'mars-1'" in out and "started" not in out, out
    for command in ("abort", "recovered", "retry"):
        code, out = await ran(inc, "evacuate", command, "mars-1")
        assert code == 2 and "site: unknown site 'mars-1'" in out, out
        code, out = await ran(inc, "evacuate", command, site)
        assert code == 1 and f"no evacuation is running at {site}" in out, out

    await evacuating(inc, site)
    code, out = await ran(inc, "evacuate", "start", site, "--request", "det", "--detach")
    workflow_id = f"evacuate/{site}/manual-det"
    assert code == 0, out
    assert f"detached: {workflow_id} runs on" in out and f"gpufleet evacuate abort {site}" in out, out
    handle = inc.client.get_workflow_handle(workflow_id)

    async def waiting() -> bool:
        return (await handle.describe()).status == WorkflowExecutionStatus.RUNNING and \
            (await inc.client.get_workflow_handle(workflow_id).query("progress")).get("state") == "waiting-for-recovery"

    await poll(waiting, timeout=60)
    # Listed by then (visibility may lag a start by a moment): a second runbook there is refused.
    await poll(lambda: inc.workflows("SiteEvacuation", "a"), timeout=30)
    code, out = await ran(inc, "evacuate", "start", site, "--request", "second")
    assert code == 1 and f"site: {workflow_id} is already evacuating {site}" in out, out
    # Looking again answers, and says that nothing waited for it (the evacuation waits for the provider).
    code, out = await ran(inc, "evacuate", "retry", site)
    assert code == 0 and f"{site}: noted, but nothing waits for it: the evacuation is waiting-for-recovery" in out, out
    code, out = await ran(inc, "evacuate", "abort", site, "--reason", "test: a blip")
    assert code == 0 and f"aborting the evacuation of {site}" in out, out
    result = EvacuationResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert result.outcome == "aborted" and cordoned(inc, site) == set()
    code, out = await ran(inc, "evacuate", "retry", site)  # ended: refused, as an update to an ended run
    assert code == 1 and f"no evacuation is running at {site}" in out, out
