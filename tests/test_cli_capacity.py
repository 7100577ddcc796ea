"""``gpufleet capacity``, ``schedules``, ``accounts`` and ``sim reclaim`` as an operator runs them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.testing import WorkflowEnvironment

from tests.capacity_fleet import CapStack, open_stack
from tests.conftest import wait_for


@pytest.fixture
async def cap(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[CapStack]:
    address = temporal_env.client.service_client.config.target_host
    async for stack in open_stack(temporal_env.client, address, tmp_path):
        yield stack


async def gpufleet(stack: CapStack, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **stack.settings.env(), "COLUMNS": "250"}
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


async def test_capacity_command_acquires_and_reports(cap: CapStack) -> None:
    done = await gpufleet(cap, "capacity", "--gpu", "H100", "--count", "2", "--geo", "eu", "--max-price", "3",
                          "--on-demand", "--request", f"cli-{cap.uid}")
    assert done.returncode == 0, done.stderr
    assert "2 of 2 joined" in done.stdout
    assert len(cap.world.machines(cap.site("mid"))) == 2
    bad = await gpufleet(cap, "capacity", "--gpu", "H100", "--gpu-class", "H200")
    assert bad.returncode == 2


async def test_schedules_apply_is_idempotent_and_listed(cap: CapStack) -> None:
    first = await gpufleet(cap, "schedules", "apply", "--site-every", "3600")
    assert first.returncode == 0, first.stderr
    # The reconcile's first pass runs at once, not an hour later: every site has its entity.
    for site in ("cheap", "mid"):
        assert await cap.listed(f'WorkflowId = "site/{cap.site(site)}" AND ExecutionStatus = "Running"'), site
    second = await gpufleet(cap, "schedules", "apply", "--site-every", "1800")
    assert second.returncode == 0, second.stderr
    assert second.stdout.count("updated") == 5
    listed = await gpufleet(cap, "schedules", "list")
    assert "gpufleet-site-reconcile" in listed.stdout and "1800s" in listed.stdout
    assert "gpufleet-catalog-refresh" in listed.stdout and "CatalogRefresh" in listed.stdout
    assert "gpufleet-fleet-sweep" in listed.stdout and "FleetSweep" in listed.stdout
    assert "gpufleet-advisor" in listed.stdout and "Advisor" in listed.stdout
    assert "gpufleet-csr-approver" in listed.stdout and "CsrApprover" in listed.stdout
    for schedule_id in ("gpufleet-site-reconcile", "gpufleet-catalog-refresh", "gpufleet-fleet-sweep",
                        "gpufleet-advisor", "gpufleet-csr-approver"):
        await cap.client.get_schedule_handle(schedule_id).delete()


async def test_accounts_commands_and_sim_reclaim(cap: CapStack) -> None:
    cap.world.set_site(cap.site("cheap"), quota=0)
    done = await gpufleet(cap, "capacity", "--gpu", "H100", "--site", cap.site("cheap"), "--site", cap.site("spot"))
    assert done.returncode == 0, done.stderr
    await cap.listed(f'WorkflowId = "account/lambda/{cap.account("a")}" AND FleetState = "needs-person"')
    listed = await gpufleet(cap, "accounts", "list", "--needs-person")
    assert cap.account("a") in listed.stdout and "quota-blocked" in listed.stdout
    # "All" is said, never implied: no offer named and no --all is refused before anything is sent.
    vague = await gpufleet(cap, "accounts", "quota-raised", cap.account("a"))
    assert vague.returncode == 2 and "--offer" in vague.stderr and "--all" in vague.stderr, vague.stderr
    raised = await gpufleet(cap, "accounts", "quota-raised", cap.account("a"), "--all")
    assert raised.returncode == 0 and "healthy" in raised.stdout, raised.stderr
    again = await gpufleet(cap, "accounts", "credentials-rotated", cap.account("a"))
    assert again.returncode == 1 and "not revoked" in again.stderr

    (machine,) = cap.world.machines(cap.site("spot"))  # a spot machine: only its notice is obeyed
    await wait_for(lambda: cap.cluster.get_node(machine["name"]), timeout=10)
    posted = await gpufleet(cap, "sim", "reclaim", machine["name"], "--seconds", "5")
    assert posted.returncode == 0, posted.stderr
    # The notice reaches the node's watch, then its Node entity starts the reclaim: maybe not
    # yet when the command returns.
    reclaim_id = f"reclaim/{machine['name']}"
    assert await cap.listed(f'WorkflowId = "{reclaim_id}"', timeout=30), "no SpotReclaim started"
    handle = cap.client.get_workflow_handle(reclaim_id)
    await handle.result()
    assert cap.world.machine(machine["id"])["deleted_at"] is not None
