"""The entities (Site, Node, ProviderAccount) keep all their state in one carried model and
lose none of it over continue-as-new; their handlers and loops take turns on it.

The continue-as-new tests run on a dev server of their own that suggests continuing as new
after 50 events, so a few signals or rechecks are enough.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import yaml
from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor, Worker

from activities import control_plane_activities
from activities.env import FleetEnv
from fleet.cluster import UNPROVEN_TAINT
from fleet.messages.capacity import AccountStatus, SiteStatus
from fleet.messages.evacuation import AdmitRepairInput, RepairDecision
from fleet.models import AccountState
from fleet.settings import Settings
from tests.can_server import (
    FirstTaskHeldBack,
    history_length,
    runs,
    server_suggesting_continue_as_new,
    update_in_first_task,
)
from tests.capacity_fleet import capacity_fleet
from tests.evacuation_helpers import incident_fleet, open_incident_stack
from tests.repair_helpers import eventually, exists, join_node, node_status, repair_handle, running_stack
from tests.replay import replay_and_record
from workers.control_plane import worker_interceptors
from workers.workflow_runner import workflow_runner
from workflows import ALL_WORKFLOWS

#: The server suggests continue-as-new from this many events on (a Site entity on events starts
#: with its watch's first looks and, started afresh, its incidents and fills on record: about 60
#: events; room for the scenario after them).
CAN_EVENTS = 80


@pytest.fixture(scope="module")
async def can_env() -> AsyncIterator[WorkflowEnvironment]:
    async with server_suggesting_continue_as_new(CAN_EVENTS) as env:
        yield env


# -- Site -------------------------------------------------------------------------------------
async def test_site_incident_opened_while_waiting_to_continue_as_new_is_evacuated(can_env, tmp_path) -> None:
    """A repair admission keeps the entity from continuing as new while it settles; two more
    admissions open an incident during that wait. The next run still evacuates the site."""
    uid = uuid.uuid4().hex[:6]
    # A long settle: the first admission is still open when the server asks to continue as new.
    fleet = incident_fleet(uid, incident={"settle_seconds": 60, "check_seconds": 600})
    async for inc in open_incident_stack(can_env.client, tmp_path, fleet, uid):
        site = inc.site("a")
        await inc.join("a", 3)  # the Site entity admits repairs only for its own nodes
        n1, n2, n3 = sorted(m["name"] for m in inc.world.machines(site))
        handle = await inc.start_site("a", reconcile_seconds=3600)

        async def status() -> SiteStatus:
            return await handle.query("status", result_type=SiteStatus)

        await eventually(lambda: _has(status, lambda s: s.last and s.incident is not None), timeout=30)
        assert await history_length(handle) < CAN_EVENTS - 10, "room for the scenario before continue-as-new"

        def admit(node: str) -> asyncio.Task:
            return asyncio.create_task(handle.execute_update(
                "admit_repair", AdmitRepairInput(site=site, node_name=node, gpu=0, reasons=["XID 79"]),
                result_type=RepairDecision,
            ))

        first = admit(n1)
        await eventually(lambda: _has(status, lambda s: s.incident.failing == [n1]), timeout=15)
        # Reconciles until the server suggests continue-as-new: the entity now waits for `first`.
        while await history_length(handle) < CAN_EVENTS + 5:
            await handle.signal("reconcile")
            await asyncio.sleep(0.3)
        assert await runs(inc.client, handle.id) == 1, "no continue-as-new while an admission settles"
        assert not first.done()

        # Two more GPUs fail at the site while it waits: 3 nodes trip the rule (threshold 3).
        decisions = await asyncio.wait_for(asyncio.gather(first, admit(n2), admit(n3)), 30)
        incident = f"evacuate/{site}/1"
        assert [(d.repair, d.incident) for d in decisions] == [(False, incident)] * 3

        await eventually(lambda: _more_runs(inc.client, handle.id, 1), timeout=20)
        # The next run knows the incident and starts its evacuation.
        await eventually(lambda: exists(inc.evacuation("a")), timeout=20)
        now = await status()
        assert incident in [i.id for i in ([now.incident.open] if now.incident.open else []) + now.incident.history]
        assert len(await inc.workflows("SiteEvacuation", "a")) == 1
        await replay_and_record(handle, "site_incident_carried")


# -- Node -------------------------------------------------------------------------------------
async def test_node_findings_on_hold_survive_continue_as_new(can_env, tmp_path) -> None:
    """A sick GPU on a node still joining waits (rechecked every 0.5 s) over several runs;
    once the node is admitted the repair starts."""
    async for stack in running_stack(can_env.client, tmp_path):
        node = await join_node(stack)
        stack.cluster.set_taints(node.node_name, add=[UNPROVEN_TAINT])  # not proven: no repair may start yet
        stack.world.inject_fault(node.machine_id, 0, "xid", 48, clears_on="reset")
        node_id = f"node/{node.node_name}"

        await eventually(lambda: _has(lambda: node_status(stack, node.node_name), lambda s: s.deferred == [0]))
        await eventually(lambda: _more_runs(stack.client, node_id, 1), timeout=30)
        status = await node_status(stack, node.node_name)
        assert status.deferred == [0], "the finding on hold was carried into the next run"
        assert not await exists(repair_handle(stack, node.node_name, 0))

        stack.cluster.set_taints(node.node_name, remove=[UNPROVEN_TAINT])
        await eventually(lambda: exists(repair_handle(stack, node.node_name, 0)), timeout=30)
        await replay_and_record(stack.client.get_workflow_handle(node_id), "node_entity_deferred_carried")


# -- ProviderAccount ---------------------------------------------------------------------------
class SlowStoreWrite(Interceptor):
    """Holds the next guard-store write after ``arm()`` until ``release`` is set: a slow write
    (a busy disk, an attempt retried after a timeout). The write itself runs unchanged."""

    def __init__(self) -> None:
        self.armed = False
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self.written = asyncio.Event()

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        gate = self

        class Inbound(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                if not (gate.armed and activity.info().activity_type == "write_account_state"):
                    return await super().execute_activity(input)
                gate.armed = False
                gate.holding.set()
                await gate.release.wait()
                result = await super().execute_activity(input)
                gate.written.set()
                return result

        return Inbound(next)


async def test_account_credentials_rotated_during_a_report_write_leaves_guard_and_entity_equal(
    temporal_env, tmp_path: Path,
) -> None:
    uid = uuid.uuid4().hex[:6]
    slow = SlowStoreWrite()
    account = f"a-{uid}"
    offer = f"cheap-{uid}/cheap.2xh100"
    client = temporal_env.client
    env, settings, worker = _account_worker(client, tmp_path, uid, slow)
    async with worker:
        handle = await client.start_workflow(
            "ProviderAccount", {"account": account, "provider": "lambda"}, id=f"account/lambda/{account}",
            task_queue=settings.task_queue, start_signal="report",
            start_signal_args=[{"account": account, "kind": "BadCredentials", "message": "401"}],
        )

        async def entity() -> AccountStatus:
            return await handle.query("status", result_type=AccountStatus)

        await eventually(lambda: _has(entity, lambda s: s.state == AccountState.CREDENTIALS_REVOKED))
        await eventually(lambda: _stored(env, account, AccountState.CREDENTIALS_REVOKED))

        # A quota report arrives while revoked: the loop's write of it is slow ...
        slow.armed = True
        await handle.signal("report", {"account": account, "kind": "OverQuota", "offer": offer, "message": "quota"})
        await asyncio.wait_for(slow.holding.wait(), 15)
        # ... and a person rotates the credentials meanwhile.
        rotated = asyncio.create_task(handle.execute_update("credentials_rotated", result_type=AccountStatus))
        await asyncio.wait({rotated}, timeout=3)
        slow.release.set()
        status = await asyncio.wait_for(rotated, 30)
        await asyncio.wait_for(slow.written.wait(), 30)  # both writes done: the store is what it will stay
        assert (status.state, list(status.blocked_offers)) == (AccountState.QUOTA_BLOCKED, [offer])
        stored = env.accounts.get(account)
        assert (stored.state, stored.blocked_offers) == (status.state, list(status.blocked_offers)), \
            "the guard store says what the entity says"
        final = await entity()
        assert (final.state, list(final.blocked_offers)) == (AccountState.QUOTA_BLOCKED, [offer])
        await replay_and_record(handle, "account_rotated_during_report_write")
        await handle.terminate("test over")


async def test_an_update_in_a_continued_accounts_first_task_sees_its_carried_state(temporal_env, tmp_path: Path) -> None:
    """A run continued as new gets the account's status in its input; an update that reaches its
    first task (a person's ``gpufleet accounts rotated`` at that moment) met the state
    ``__init__`` made (none) and was refused: "credentials are not revoked: nothing to rotate",
    of an account whose credentials were revoked. Now it waits for ``run`` to take its state
    (``Entity.until_started``). The run continues as new for real (``renew``), its first task
    held back a moment (``FirstTaskHeldBack``) for the update to reach it."""
    uid = uuid.uuid4().hex[:6]
    account = f"a-{uid}"
    client = temporal_env.client
    env, settings, worker = _account_worker(client, tmp_path, uid, *worker_interceptors(), FirstTaskHeldBack())
    async with worker:
        handle = await client.start_workflow("ProviderAccount", {"account": account, "provider": "lambda"},
                                             id=f"account/lambda/{account}", task_queue=settings.task_queue)
        await handle.signal("report", {"account": account, "kind": "BadCredentials", "message": "401"})
        await eventually(lambda: _has(lambda: handle.query("status", result_type=AccountStatus),
                                      lambda s: s.state == AccountState.CREDENTIALS_REVOKED))
        await handle.signal("renew")
        await eventually(lambda: _more_runs(client, handle.id, 1))
        latest = client.get_workflow_handle(handle.id)
        rotated = await latest.execute_update("credentials_rotated", result_type=AccountStatus)
        assert rotated.state == AccountState.HEALTHY, rotated
        assert env.accounts.get(account).state == AccountState.HEALTHY, "the guard store says so too"
        assert await update_in_first_task(latest), "the update reached a later task, not the run's first"
        # And one that has nothing to act on is still refused, naming the state: checked in the
        # handler once the run has its state (the validator could not).
        await latest.signal("renew")
        await eventually(lambda: _more_runs(client, handle.id, 2))
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await latest.execute_update("credentials_rotated")
        assert "nothing to rotate" in str(refused.value.cause), refused.value.cause
        assert await update_in_first_task(latest), "the update reached a later task, not the run's first"
        # A reset keeps the run's start event: a continued run reset to its first task is judged as
        # a continued run by the input guard, its carried status taken, not refused.
        continued = (await latest.describe()).run_id
        await client.workflow_service.reset_workflow_execution(ResetWorkflowExecutionRequest(
            namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=handle.id, run_id=continued),
            reason="test: reset to the first task", workflow_task_finish_event_id=4, request_id=uuid.uuid4().hex))
        reset = client.get_workflow_handle(handle.id)
        await eventually(lambda: _has(lambda: reset.query("status", result_type=AccountStatus),
                                      lambda s: s.state == AccountState.HEALTHY and s.account == account))
        assert (await reset.describe()).run_id != continued
        events = (await reset.fetch_history()).events
        assert events[0].workflow_execution_started_event_attributes.continued_execution_run_id, "a continued run's"
        failed = [e.workflow_task_failed_event_attributes.cause for e in events
                  if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
        assert failed == [WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_WORKFLOW], failed
        await reset.terminate("test over")


# -- helpers ------------------------------------------------------------------------------------
def _account_worker(client: Client, tmp_path: Path, uid: str,
                    *interceptors: Interceptor) -> tuple[FleetEnv, Settings, Worker]:
    """The capacity fleet's environment and a control-plane worker on a queue of its own."""
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(capacity_fleet(uid)))
    settings = Settings(address=client.service_client.config.target_host,
                        task_queue=f"acct-{uid}", state_dir=tmp_path, config=str(path))
    env = FleetEnv.from_settings(settings)
    worker = Worker(
        client, task_queue=settings.task_queue, workflows=ALL_WORKFLOWS, activities=control_plane_activities(env),
        activity_executor=ThreadPoolExecutor(max_workers=16), interceptors=list(interceptors),
        workflow_runner=workflow_runner(client.data_converter),
    )
    return env, settings, worker


async def _has(get, check) -> bool:
    try:
        value = await get()
    except Exception:  # noqa: BLE001 - not started yet, or its first task not run
        return False
    return value is not None and bool(check(value))


async def _more_runs(client: Client, workflow_id: str, than: int) -> bool:
    return await runs(client, workflow_id) > than


async def _stored(env: FleetEnv, account: str, state: AccountState) -> bool:
    return env.accounts.get(account).state == state
