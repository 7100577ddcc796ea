"""The ProviderAccount entity's continue-as-new on a real dev server: it waits for a running
update, and a report that arrives meanwhile is taken, never stranded (patch
``account-continue-when-ready``).

The server here suggests continuing as new after ``CAN_EVENTS`` events, so a few signals are
enough to bring the entity to its wait.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator

import pytest
import yaml
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities import control_plane_activities
from activities.env import FleetEnv
from fleet.messages.capacity import AccountStatus
from fleet.models import AccountState
from fleet.settings import Settings
from tests.can_server import Hold, history_length, runs, server_suggesting_continue_as_new
from tests.capacity_fleet import capacity_fleet
from tests.repair_helpers import eventually
from tests.replay import replay_and_record
from workers.workflow_runner import workflow_runner
from workflows import ALL_WORKFLOWS

#: (80 before ``account-shows-queued-deletes``, whose reads of the deletes queued while revoked add a few events.)
CAN_EVENTS = 100


@pytest.fixture(scope="module")
async def can_env() -> AsyncIterator[WorkflowEnvironment]:
    async with server_suggesting_continue_as_new(CAN_EVENTS) as env:
        yield env


# -- ProviderAccount ------------------------------------------------------------------------------
async def test_a_report_while_the_account_waits_for_an_update_to_continue_is_taken(can_env, tmp_path: Path) -> None:
    """The account is asked to continue as new while a person's ``credentials_rotated`` runs its
    queued deletes; an over-quota report arrives during that wait. Before the patch the entity then
    waited for an empty report queue that only it could empty: the report was never taken and
    the entity never continued (a stuck account). Now the report blocks its offer, then the
    entity continues as new, carrying it."""
    uid = uuid.uuid4().hex[:6]
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(capacity_fleet(uid)))
    client = can_env.client
    settings = Settings(address=client.service_client.config.target_host, task_queue=f"gate-{uid}",
                        state_dir=tmp_path, config=str(path))
    env = FleetEnv.from_settings(settings)
    deletes = Hold("run_queued_deletes")
    worker = Worker(client, task_queue=settings.task_queue, workflows=ALL_WORKFLOWS,
                    activities=control_plane_activities(env), activity_executor=ThreadPoolExecutor(max_workers=8),
                    interceptors=[deletes], workflow_runner=workflow_runner(client.data_converter))
    async with worker:
        try:
            await _report_during_the_gate(client, settings.task_queue, env, deletes, f"a-{uid}", uid)
        finally:
            deletes.release.set()  # the worker stops only once its held activity has ended


async def _report_during_the_gate(client: Client, queue: str, env: FleetEnv, deletes: Hold, account: str,
                                  uid: str) -> None:
    first_offer, second_offer = f"cheap-{uid}/cheap.2xh100", f"mid-{uid}/mid.2xh100"

    def over_quota(offer: str) -> dict[str, str]:
        return {"account": account, "kind": "OverQuota", "offer": offer, "message": "quota"}

    handle = await client.start_workflow(
        "ProviderAccount", {"account": account, "provider": "lambda"}, id=f"account/lambda/{account}",
        task_queue=queue, start_signal="report",
        start_signal_args=[{"account": account, "kind": "BadCredentials", "message": "401"}],
    )

    async def status() -> AccountStatus:
        return await handle.query("status", result_type=AccountStatus)

    await handle.signal("report", over_quota(first_offer))
    await eventually(lambda: _has(status, lambda s: first_offer in s.blocked_offers))
    # A person rotates the credentials; the deletes queued while revoked take their time.
    deletes.armed = True
    rotated = asyncio.create_task(handle.execute_update("credentials_rotated", result_type=AccountStatus))
    await asyncio.wait_for(deletes.holding.wait(), 15)
    assert await history_length(handle) < CAN_EVENTS - 5, "room for the scenario"
    # Reports that change nothing, until the server asks the entity to continue as new: it now
    # waits for the update.
    while await history_length(handle) < CAN_EVENTS + 2:
        await handle.signal("report", over_quota(first_offer))
        await asyncio.sleep(0.2)
    assert await runs(client, handle.id) == 1 and not rotated.done()
    await handle.signal("report", over_quota(second_offer))  # arrives while the entity waits
    await asyncio.sleep(1)
    deletes.release.set()
    assert (await asyncio.wait_for(rotated, 30)).state == AccountState.QUOTA_BLOCKED

    await eventually(lambda: _more_runs(client, handle.id, 1), timeout=30)
    now = await status()  # the next run's, from its carried state
    assert (now.state, sorted(now.blocked_offers)) == (AccountState.QUOTA_BLOCKED, sorted([first_offer, second_offer]))
    assert sorted(env.accounts.get(account).blocked_offers) == sorted(now.blocked_offers), \
        "the guard store blocks it too"
    await replay_and_record(client.get_workflow_handle(handle.id, run_id=handle.first_execution_run_id),
                            "account_continue_when_ready")
    await handle.terminate("test over")


async def _has(get, check) -> bool:
    try:
        value = await get()
    except Exception:  # noqa: BLE001 - not started yet
        return False
    return value is not None and bool(check(value))


async def _more_runs(client: Client, workflow_id: str, than: int) -> bool:
    return await runs(client, workflow_id) > than
