"""AcquireCapacity and ProviderAccount on the real dev server and the simulated providers."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from fleet.messages.capacity import AccountStatus, CapacityProgress, CapacityResult
from activities.control_plane import ControlPlaneActivities
from fleet.messages.nodes import DeleteMachineInput
from tests.capacity_fleet import (
    FAST_JOIN, CapStack, details, failed_pass_cleared, failed_pass_shown, open_stack, replay_and_record,
)
from tests.bad_input_helpers import wait_for_async
from tests.conftest import wait_for


@pytest.fixture
async def cap(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[CapStack]:
    address = temporal_env.client.service_client.config.target_host
    async for stack in open_stack(temporal_env.client, address, tmp_path):
        yield stack


async def result_of(handle) -> CapacityResult:
    return CapacityResult.model_validate(await handle.result())


async def progress(handle) -> CapacityProgress:
    return await handle.query("progress", result_type=CapacityProgress)


async def test_no_capacity_at_first_choice_uses_the_second(cap: CapStack) -> None:
    await cap.refresh_catalog()  # the catalog still says the cheapest site has capacity
    cap.world.set_site(cap.site("cheap"), capacity=0)
    handle = await cap.request({"constraints": {"gpu": "H100"}, "count": 1, "catalog_max_age_seconds": 600})
    result = await result_of(handle)
    assert result.complete
    assert [n.site for n in result.nodes] == [cap.site("mid")]
    assert [(a.offer, a.outcome) for a in result.attempts] == [
        (cap.offer("cheap"), "NoCapacity"), (cap.offer("mid"), "joined"),
    ]
    assert cap.world.calls(cap.account("a"), "create") == 1
    assert cap.cluster.get_node(result.nodes[0].node_name).ready
    # Each join was started carrying its site's search attributes: findable by Site from the start.
    query = f'WorkflowType = "NodeJoin" AND Site IN ("{cap.site("cheap")}", "{cap.site("mid")}")'
    joins = [w async for w in cap.client.list_workflows(query)]
    assert len(joins) == 2
    for join in joins:
        started = (await cap.client.get_workflow_handle(join.id).fetch_history()).events[0]
        fields = started.workflow_execution_started_event_attributes.search_attributes.indexed_fields
        assert {"Site", "Provider", "Account", "NodeName", "FleetState"} <= set(fields)
    await replay_and_record(handle, "capacity_no_capacity_fallback")


async def joins_of(handle) -> int:
    """The joins (NodeJoin children) the request has started so far."""
    return sum(1 for e in (await handle.fetch_history()).events
               if e.HasField("start_child_workflow_execution_initiated_event_attributes"))


async def test_an_offer_that_said_no_capacity_at_a_ttl_of_0_is_tried_again_only_after_a_wait(cap: CapStack) -> None:
    """``unavailable_ttl_seconds: 0`` keeps no offer out past the request's next look at the offers,
    but the offer that has just said NoCapacity is not joined again before that look: the request
    waits for capacity (its backoff, or a wake), saying why and until when, then tries it again
    at once. Before, the exclusion ended as it began, and a join started on the same offer at once,
    again and again, each a NodeJoin and a provider create call, until the deadline (an hour by
    default): NoCapacity counts toward no limit."""
    site, account, offer = cap.site("cheap"), cap.account("a"), cap.offer("cheap")
    await cap.refresh_catalog()  # the catalog still says the site has capacity
    cap.world.set_site(site, capacity=0)
    handle = await cap.request({"constraints": {"sites": [site]}, "unavailable_ttl_seconds": 0,
                                "catalog_max_age_seconds": 600, "backoff_seconds": 600, "deadline_seconds": 120})
    waiting = await cap.listed(f'WorkflowId = "{handle.id}" AND FleetState = "waiting-for-capacity"', timeout=5)
    creates, joins = cap.world.calls(account, "create"), await joins_of(handle)
    assert (creates, joins) == (1, 1), f"{creates} provider create calls and {joins} joins before it waited"
    assert waiting, "the request waits for capacity"
    now = await progress(handle)
    assert now.waiting_for == [f"{offer}: no capacity (tried again at the next look at the offers)"], now
    assert now.wait_until is not None and now.wait_until <= now.deadline
    assert f"look again at {now.wait_until.isoformat(timespec='seconds')} or when offers change" in await details(handle)

    cap.world.set_site(site, capacity=4)
    await handle.signal("offers_changed")  # an account unblocked: the request lists the offers again
    result = await result_of(handle)
    assert result.complete and [n.site for n in result.nodes] == [site]
    assert [(a.offer, a.outcome) for a in result.attempts] == [(offer, "NoCapacity"), (offer, "joined")]
    assert cap.world.calls(account, "create") == 2
    await replay_and_record(handle, "capacity_no_capacity_at_ttl_0_waits")


async def test_over_quota_blocks_the_offer_until_a_person_raises_it(cap: CapStack) -> None:
    cap.world.set_site(cap.site("cheap"), quota=0)
    handle = await cap.request({"constraints": {"gpu": "H100"}, "count": 1})
    result = await result_of(handle)
    assert [n.site for n in result.nodes] == [cap.site("mid")]
    assert result.attempts[0].outcome == "OverQuota"

    account = cap.account_handle("lambda", "a")
    listed = await cap.listed(f'WorkflowId = "{account.id}" AND FleetState = "needs-person"')
    assert len(listed) == 1, "the UI lists the account as waiting for a person"
    status = await account.query("status", result_type=AccountStatus)
    assert status.state == "quota-blocked"
    assert list(status.blocked_offers) == [cap.offer("cheap")]

    # Blocked: a second request does not even try the cheapest offer (no provider call).
    creates = cap.world.calls(cap.account("a"), "create")
    second = await result_of(await cap.request({"constraints": {"gpu": "H100"}, "count": 1}))
    assert second.nodes[0].site == cap.site("mid")
    assert cap.world.calls(cap.account("a"), "create") == creates

    with pytest.raises(WorkflowUpdateFailedError):  # the validator names what is blocked
        await account.execute_update("quota_raised", {"offers": ["nope/x"]})
    cap.world.set_site(cap.site("cheap"), quota=8)
    # "All" is never implied: no offers (what Temporal's HTTP API makes of an empty list, too) is
    # refused naming the field, and changes nothing.
    for vague in ({"offers": []}, {}, None):
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await account.execute_update("quota_raised", vague)
        cause = refused.value.cause
        assert cause.type == "InvalidInput" and cause.message.removeprefix("InvalidInput: ").startswith("offers:"), vague
    still = AccountStatus.model_validate(await account.query("status"))
    assert list(still.blocked_offers) == [cap.offer("cheap")]
    cleared = AccountStatus.model_validate(await account.execute_update("quota_raised", {"all": True}))
    assert cleared.state == "healthy" and cleared.blocked_offers == {}
    assert await cap.listed(f'WorkflowId = "{account.id}" AND FleetState = "healthy"')
    third = await result_of(await cap.request({"constraints": {"gpu": "H100"}, "count": 1}))
    assert third.nodes[0].site == cap.site("cheap")
    await replay_and_record(handle, "capacity_over_quota")
    # Named for the newest ProviderAccount patch (``quota-raised-all-explicit``); the older file
    # stays (its run raised the quota with no offers, which meant all then).
    await replay_and_record(account, "account_quota_raised_all_explicit")


async def test_revoked_credentials_stop_every_call_until_rotated(cap: CapStack) -> None:
    a = cap.account("a")
    # A machine at the account, to be deleted while the account is revoked.
    (machine,) = [m for m in (await result_of(await cap.request({"constraints": {"sites": [cap.site("cheap")]}}))).nodes]
    cap.world.set_credentials_valid(a, False)
    handle = await cap.request({"constraints": {"gpu": "H100"}, "count": 1})
    result = await result_of(handle)
    assert result.nodes[0].site == cap.site("mid")
    assert result.attempts[0].outcome == "BadCredentials"
    account = cap.account_handle("lambda", "a")
    await wait_for(lambda: cap.env.accounts.get(a).state == "credentials-revoked")
    calls = cap.world.calls(a)

    # Nothing calls the account now: requests, catalog refreshes, deletes.
    again = await result_of(await cap.request({"constraints": {"gpu": "H100"}, "count": 1}))
    assert again.nodes[0].site == cap.site("mid")
    await cap.refresh_catalog()
    acts = ControlPlaneActivities(cap.env)
    await ActivityEnvironment().run(acts.delete_machine, DeleteMachineInput(site=cap.site("cheap"),
                                                                            machine_id=machine.machine_id))
    assert cap.world.calls(a) == calls, "zero provider calls to a revoked account"
    assert cap.world.machine(machine.machine_id)["deleted_at"] is None, "the delete is queued"
    assert [p.machine_id for p in cap.env.accounts.pending_deletes(a)] == [machine.machine_id]
    status = await account.query("status", result_type=AccountStatus)
    assert status.state == "credentials-revoked"

    with pytest.raises(WorkflowUpdateFailedError):  # still bad at the provider: not accepted
        await account.execute_update("credentials_rotated")
    assert (await account.query("status", result_type=AccountStatus)).state == "credentials-revoked"
    cap.world.set_credentials_valid(a, True)
    rotated = AccountStatus.model_validate(await account.execute_update("credentials_rotated"))
    assert rotated.state == "healthy"
    assert cap.world.machine(machine.machine_id)["deleted_at"] is not None, "the queued delete ran after the fix"
    assert cap.env.accounts.pending_deletes(a) == []
    await replay_and_record(handle, "capacity_bad_credentials")
    await replay_and_record(account, "account_credentials_rotated")


async def over_quota_beside_a_refusing_guard(cap: CapStack, monkeypatch: pytest.MonkeyPatch, *,
                                             refusing: bool) -> tuple[str, list[bool], WorkflowHandle]:
    """Account ``a``'s ProviderAccount entity, told one of its offers is over quota, beside a guard
    store that refuses every write of its record while ``refusing[0]`` (as the cluster's store raises
    a 403 after an RBAC mistake: providers/cluster/kubernetes/api.py)."""
    from activities.account_store import AccountStore
    from fleet.errors import ClusterForbidden

    a, put = cap.account("a"), AccountStore.put
    flag = [refusing]

    def refused(self, record) -> None:
        if flag[0] and record.name == a:
            raise ClusterForbidden('update configmaps "gpufleet-accounts" is forbidden: User '
                                   '"system:serviceaccount:gpufleet:control-plane" cannot update', code="403")
        put(self, record)

    monkeypatch.setattr(AccountStore, "put", refused)
    account = await cap.client.start_workflow(
        "ProviderAccount", {"account": a, "provider": "lambda"}, id=cap.account_handle("lambda", "a").id,
        task_queue=cap.settings.task_queue)
    await account.signal("report", {"account": a, "kind": "OverQuota", "offer": cap.offer("cheap"),
                                    "message": "quota reached"})
    return a, flag, account


async def test_an_account_whose_guard_store_refuses_its_write_stays_up_says_so_and_writes_it_later(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A report reaches the ProviderAccount entity while its guard store (the cluster, in a real
    deployment) refuses the write: a 403 after an RBAC mistake, which no retry helps (the API server
    away past the retries ends the same way). The entity stays up with what it was told, its
    details saying what failed and when it tries again; once the store takes writes again the
    record lands and a person is notified. Before, the failed write failed the entity: the record
    a person fixes the account from was gone, and its updates had nothing to reach."""
    a, refusing, account = await over_quota_beside_a_refusing_guard(cap, monkeypatch, refusing=True)

    shown = await failed_pass_shown(account)
    assert re.search(r"could not write the account guard \(ClusterForbidden: update configmaps .*\); "
                     r"next try at \d\d:\d\d:\d\d UTC", shown), shown
    status = await account.query("status", result_type=AccountStatus)
    assert status.state == "quota-blocked" and list(status.blocked_offers) == [cap.offer("cheap")]
    assert cap.env.accounts.get(a).state == "healthy", "not written yet"

    refusing[0] = False  # the RBAC fixed
    await wait_for(lambda: cap.env.accounts.get(a).blocked_offers == [cap.offer("cheap")], timeout=30)
    assert cap.env.accounts.get(a).state == "quota-blocked"
    await failed_pass_cleared(account)
    history = await account.fetch_history()
    notified = [e for e in history.events if e.HasField("activity_task_scheduled_event_attributes")
                and e.activity_task_scheduled_event_attributes.activity_type.name == "notify_person"]
    assert len(notified) == 1, "a person is told once the record is written"
    await replay_and_record(account, "account_guard_write_refused_then_written")


async def test_an_account_update_whose_guard_write_fails_changes_nothing_and_can_be_sent_again(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A person's ``credentials_rotated`` or ``quota_raised`` reaches the ProviderAccount entity while
    its guard store refuses the write (a 403 after an RBAC mistake; the API server away past the
    retries ends the same way). The update fails saying so, and the entity is as it was: still
    revoked and blocked, ``needs-person``, equal to the guard, so the same update, sent again once the
    store takes writes, is taken. Before, the entity said healthy while the guard still blocked every
    call (revoked) or the offers (quota), and the update sent again was refused ("credentials are
    not revoked", "has no quota-blocked offer"): the account stayed blocked for good."""
    a, refusing, account = await over_quota_beside_a_refusing_guard(cap, monkeypatch, refusing=False)
    await account.signal("report", {"account": a, "kind": "BadCredentials", "message": "key revoked"})
    await wait_for(lambda: cap.env.accounts.get(a).state == "credentials-revoked", timeout=30)

    refusing[0] = True
    for update, args in (("credentials_rotated", []), ("quota_raised", [{"all": True}])):
        with pytest.raises(WorkflowUpdateFailedError) as failed:
            await account.execute_update(update, args=args)
        status = await account.query("status", result_type=AccountStatus)
        assert status.state == "credentials-revoked", f"{update}: the entity is as before the update"
        assert list(status.blocked_offers) == [cap.offer("cheap")]
        assert cap.env.accounts.get(a).state == "credentials-revoked", "the guard was not written"
        said = failed.value.cause.message
        assert "could not write the account guard" in said and "ClusterForbidden" in said, said
        assert f"nothing changed: send {update} again" in said, said
    assert await cap.listed(f'WorkflowId = "{account.id}" AND FleetState = "needs-person"')
    assert "credentials_rotated not taken: could not write the account guard" in await details(account)

    refusing[0] = False  # the RBAC fixed: the same updates, sent again, are taken
    rotated = AccountStatus.model_validate(await account.execute_update("credentials_rotated"))
    assert rotated.state == "quota-blocked" and cap.env.accounts.get(a).state == "quota-blocked"
    raised = AccountStatus.model_validate(await account.execute_update("quota_raised", {"all": True}))
    assert raised.state == "healthy" and raised.blocked_offers == {}
    assert cap.env.accounts.get(a).state == "healthy" and cap.env.accounts.get(a).blocked_offers == []
    assert await cap.listed(f'WorkflowId = "{account.id}" AND FleetState = "healthy"')
    await replay_and_record(account, "account_update_write_refused_puts_back")


async def test_a_rotation_whose_queued_deletes_fail_is_taken_and_the_entity_runs_them_until_they_do(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine's delete is queued while its account is revoked; a person rotates the credentials
    (``credentials_rotated``, written to the guard) while the provider refuses the delete (a refusal no
    retry helps; an outage past the retry policy ends the same way). The rotation is taken and the
    update says the deletes are owed: the entity tries them again after a pause, each try shown
    with why and when the next is, keeps them owed while the account is revoked again (the next
    rotation runs them), and runs them once the provider takes them: the machine goes. Before, the
    update failed ("Activity task failed") with the rotation saved, the same update sent again was
    refused ("credentials are not revoked"), and nothing ran the deletes: the machine stayed up, billed."""
    a, account, machine = await revoked_with_a_queued_delete(cap)
    refusing = refuse_deletes(cap, monkeypatch)
    cap.world.set_credentials_valid(a, True)

    async def status() -> AccountStatus:
        return await account.query("status", result_type=AccountStatus)

    # The rotation is taken, and the update says the deletes are owed, why, and when they are tried.
    rotated = AccountStatus.model_validate(await account.execute_update("credentials_rotated"))
    assert rotated.state == "healthy" and cap.env.accounts.get(a).state == "healthy"
    assert rotated.deletes_owed_since, "the deletes are owed"
    assert re.search(r"could not run the deletes queued while revoked \(InvalidRequest: instance-operations/"
                     r"terminate: 400 .*\); try 1, next try at \d\d:\d\d:\d\d UTC", rotated.deletes_failing), \
        rotated.deletes_failing
    assert cap.world.machine(machine.machine_id)["deleted_at"] is None
    assert [p.machine_id for p in cap.env.accounts.pending_deletes(a)] == [machine.machine_id]
    # Its loop tries them again after a pause, each try shown with why and when the next is.
    shown = await wait_for_async(lambda: details(account), lambda text: "try 2, next try at" in text)
    assert "deletes owed since" in shown and "nothing to send" in shown, shown
    listed = await cap_cli(cap, "accounts", "list", "--output", "json")
    assert listed.returncode == 0, listed.stderr
    (row,) = [r for r in json.loads(listed.stdout) if r["account"] == account.id]
    assert (row["state"], row["deletes owed"]) == ("healthy", f"since {rotated.deletes_owed_since}"), row
    with pytest.raises(WorkflowUpdateFailedError) as refused:  # nothing to send again, and it says why
        await account.execute_update("credentials_rotated")
    assert "nothing to rotate (the deletes owed since" in refused.value.cause.message, refused.value.cause.message

    # Revoked again meanwhile: still owed, tried no more until the next rotation, which runs them.
    await account.signal("report", {"account": a, "kind": "BadCredentials", "message": "key revoked again"})
    revoked = await wait_for_async(status, lambda s: s.state == "credentials-revoked")
    assert revoked.deletes_owed_since == rotated.deletes_owed_since
    assert "they run once the credentials are rotated" in await details(account)
    again = AccountStatus.model_validate(await account.execute_update("credentials_rotated"))
    assert again.state == "healthy" and again.deletes_owed_since == rotated.deletes_owed_since
    assert "try 1, next try at" in again.deletes_failing, "a person's rotation starts the pauses again"

    refusing[0] = False  # the provider takes the delete: the entity's next try runs it
    await wait_for(lambda: cap.world.machine(machine.machine_id)["deleted_at"] is not None, timeout=30)
    done = await wait_for_async(status, lambda s: not s.deletes_owed_since)
    assert done.deletes_failing == "" and done.state == "healthy"
    assert cap.env.accounts.pending_deletes(a) == []
    assert any("the deletes owed since" in line and "ran" in line for line in done.history), done.history
    assert "still up" not in await details(account), "no deletes owed shown any more"
    await replay_and_record(account, "account_rotation_owes_failed_deletes")


async def test_deletes_owed_are_carried_over_continue_as_new(cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deletes owed after a rotation are part of the account's state: a run that continues as
    new (here asked by ``renew``, as by Temporal's suggestion) carries them, and its loop tries them
    at once and until they run."""
    a, account, machine = await revoked_with_a_queued_delete(cap)
    refusing = refuse_deletes(cap, monkeypatch)
    cap.world.set_credentials_valid(a, True)
    rotated = AccountStatus.model_validate(await account.execute_update("credentials_rotated"))
    assert rotated.deletes_owed_since
    first = (await account.describe()).run_id
    await account.signal("renew")
    await wait_for_async(account.describe, lambda d: d.run_id != first, timeout=30)
    carried = await account.query("status", result_type=AccountStatus)
    assert (carried.state, carried.deletes_owed_since) == ("healthy", rotated.deletes_owed_since)
    assert cap.world.machine(machine.machine_id)["deleted_at"] is None

    refusing[0] = False
    await wait_for(lambda: cap.world.machine(machine.machine_id)["deleted_at"] is not None, timeout=30)
    done = await wait_for_async(lambda: account.query("status", result_type=AccountStatus),
                                lambda s: not s.deletes_owed_since)
    assert cap.env.accounts.pending_deletes(a) == [] and done.deletes_failing == ""
    await replay_and_record(account, "account_deletes_owed_carried_over_continue_as_new")


async def test_deletes_owed_by_a_terminated_account_run_are_run_by_the_run_started_again(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator terminates the ProviderAccount entity (``temporal workflow terminate``) while it
    owes deletes; the next report about the account (a request's OverQuota) starts it again, afresh,
    with no state carried. The deletes are still queued in the account guard store: the new run reads
    them there, owes them (since they were queued: ``gpufleet accounts list`` shows them), tries them
    and runs them once the provider takes them, and the machine goes. Before, the new run started
    owing nothing: the deletes stayed queued until the account was revoked and rotated again, and the
    machine stayed up, billed, shown nowhere."""
    a, account, machine = await revoked_with_a_queued_delete(cap)
    refusing = refuse_deletes(cap, monkeypatch)
    cap.world.set_credentials_valid(a, True)
    rotated = AccountStatus.model_validate(await account.execute_update("credentials_rotated"))
    assert rotated.state == "healthy" and rotated.deletes_owed_since, "the deletes are owed"
    first = (await account.describe()).run_id
    await account.terminate("by hand")
    queued_at = cap.env.accounts.pending_deletes(a)[0].queued_at

    # A request meets the account's quota: its report starts the entity again, afresh.
    cap.world.set_site(cap.site("cheap"), quota=0)
    await result_of(await cap.request({"constraints": {"gpu": "H100"}, "count": 1}))
    again = await wait_for_async(account.describe, lambda d: d.run_id != first and d.status.name == "RUNNING",
                                 timeout=30)
    started = (await account.fetch_history()).events[0].workflow_execution_started_event_attributes
    assert "status" not in json.loads(started.input.payloads[0].data), "a fresh run: nothing carried"

    async def status() -> AccountStatus:
        return await account.query("status", result_type=AccountStatus)

    owing = await wait_for_async(status, lambda s: s.deletes_owed_since and s.state == "quota-blocked")
    assert datetime.fromisoformat(owing.deletes_owed_since).timestamp() == pytest.approx(queued_at, abs=1)
    shown = await wait_for_async(lambda: details(account), lambda text: "try 1, next try at" in text)
    assert "deletes owed since" in shown and "still up" in shown, shown
    assert cap.world.machine(machine.machine_id)["deleted_at"] is None, "the provider still refuses the delete"

    refusing[0] = False  # the provider takes the delete: the new run's next try runs it
    await wait_for(lambda: cap.world.machine(machine.machine_id)["deleted_at"] is not None, timeout=30)
    done = await wait_for_async(status, lambda s: not s.deletes_owed_since)
    assert cap.env.accounts.pending_deletes(a) == [] and done.deletes_failing == ""
    assert any(f"ran 1 queued deletes: {machine.machine_id}" in line for line in done.history), done.history
    assert (await account.describe()).run_id == again.run_id
    await replay_and_record(account, "account_started_again_runs_the_deletes_owed")


async def accounts_cli(cap: CapStack, *args: str) -> str:
    """``gpufleet accounts <args>`` through the typer app, as an operator runs it against this stack."""
    from typer.testing import CliRunner

    from cli.main import app

    more = ["--config", cap.settings.config] if args[0] == "show" else []
    ran = await asyncio.to_thread(CliRunner().invoke, app, ["accounts", *args, "--address", cap.settings.address,
                                                            *more], env={**cap.settings.env(), "COLUMNS": "250"})
    assert ran.exit_code == 0, ran.output
    return ran.output


async def listed_row(cap: CapStack, account: WorkflowHandle) -> dict:
    (row,) = [r for r in json.loads(await accounts_cli(cap, "list", "--output", "json")) if r["account"] == account.id]
    return row


async def test_machines_owed_a_delete_while_revoked_are_shown_until_the_rotation_runs_them(
        cap: CapStack) -> None:
    """A machine's delete is queued while its account's credentials are revoked: the machine is
    still up, billed, until a person rotates them. The operator sees it where they look: ``gpufleet
    accounts list`` counts it, ``gpufleet accounts show`` names it, its site and how long it has
    waited, and so do the entity's ``status`` and its details in the UI; a run that continues as new
    shows it still. Once the rotation runs the delete, it is shown no more. Before, a delete queued
    while revoked was shown nowhere: the entity never learnt of it."""
    a, account, machine = await revoked_with_a_queued_delete(cap)
    queued_at = cap.env.accounts.pending_deletes(a)[0].queued_at

    async def status() -> AccountStatus:
        return await account.query("status", result_type=AccountStatus)

    shown = await wait_for_async(status, lambda s: s.deletes_queued_count == 1, timeout=30)
    assert shown.state == "credentials-revoked"
    assert [(d.machine_id, d.site) for d in shown.deletes_queued] == [(machine.machine_id, cap.site("cheap"))]
    assert datetime.fromisoformat(shown.deletes_queued[0].queued_at).timestamp() == pytest.approx(queued_at, abs=1)
    text = await details(account)
    assert "1 machine(s) owed a delete" in text and machine.machine_id in text, text

    row = await listed_row(cap, account)
    assert (row["state"], row["deletes queued"]) == ("credentials-revoked", "1"), row
    said = await accounts_cli(cap, "show", a)
    assert "1 machine(s) owed a delete" in said and "they run once the credentials are rotated" in said, said
    (line,) = [line for line in said.splitlines() if machine.machine_id in line and "ran " not in line
               and "queued in the account guard:" not in line]
    assert cap.site("cheap") in line and re.search(r"\d+m \d+s", line), said
    (listed,) = json.loads(await accounts_cli(cap, "show", a, "--output", "json"))["deletes_queued"]
    assert listed["machine_id"] == machine.machine_id and listed["waited"], listed

    # A run that continues as new (asked by ``renew``, as by Temporal's suggestion) shows it still.
    first = (await account.describe()).run_id
    await account.signal("renew")
    await wait_for_async(account.describe, lambda d: d.run_id != first, timeout=30)
    carried = await status()
    assert (carried.state, carried.deletes_queued_count) == ("credentials-revoked", 1), carried
    assert (await listed_row(cap, account))["deletes queued"] == "1"

    # The rotation runs the delete: the machine goes, and nothing is shown owed any more.
    cap.world.set_credentials_valid(a, True)
    rotated = AccountStatus.model_validate(await account.execute_update("credentials_rotated"))
    assert cap.world.machine(machine.machine_id)["deleted_at"] is not None
    assert (rotated.state, rotated.deletes_queued_count, rotated.deletes_queued) == ("healthy", 0, [])
    assert (await listed_row(cap, account))["deletes queued"] == ""
    assert "no machine owed a delete" in await accounts_cli(cap, "show", a)
    assert "owed a delete" not in await details(account)
    await replay_and_record(account, "account_shows_queued_deletes")
    # The run that was revoked, read the store and continued as new.
    await replay_and_record(cap.client.get_workflow_handle(account.id, run_id=first),
                            "account_shows_queued_deletes_then_continued")


async def test_a_run_started_afresh_while_revoked_shows_the_machines_owed_a_delete(cap: CapStack) -> None:
    """An operator terminates the ProviderAccount entity while its account is revoked and a delete is
    queued; a report starts it again, afresh, nothing carried. The new run reads the delete in the
    guard store and shows it (``gpufleet accounts list`` counts it, ``show`` names it) until the
    rotation runs it. Before, the fresh run logged it and showed nothing."""
    a, account, machine = await revoked_with_a_queued_delete(cap)
    await account.terminate("by hand")
    await cap.client.start_workflow("ProviderAccount", {"account": a, "provider": "lambda"}, id=account.id,
                                    task_queue=cap.settings.task_queue)
    await account.signal("report", {"account": a, "kind": "BadCredentials", "message": "key revoked"})

    async def status() -> AccountStatus:
        return await account.query("status", result_type=AccountStatus)

    shown = await wait_for_async(status, lambda s: s.state == "credentials-revoked" and s.deletes_queued_count == 1,
                                 timeout=30)
    assert [d.machine_id for d in shown.deletes_queued] == [machine.machine_id]
    assert (await listed_row(cap, account))["deletes queued"] == "1"
    assert machine.machine_id in await accounts_cli(cap, "show", a)

    cap.world.set_credentials_valid(a, True)
    rotated = AccountStatus.model_validate(await account.execute_update("credentials_rotated"))
    assert cap.world.machine(machine.machine_id)["deleted_at"] is not None
    assert rotated.deletes_queued_count == 0 and (await listed_row(cap, account))["deletes queued"] == ""
    await replay_and_record(account, "account_started_afresh_shows_queued_deletes")


async def started_again_by_hand(cap: CapStack, account: WorkflowHandle) -> WorkflowHandle:
    """An operator terminates the account's entity (stuck, say) and starts it again by hand, afresh:
    nothing carried, and no report with it (every call to a revoked account or a blocked offer is
    refused by the guard, which tells the entity nothing again)."""
    a = account.id.rsplit("/", 1)[1]
    await account.terminate("by hand")
    return await cap.client.start_workflow("ProviderAccount", {"account": a, "provider": "lambda"}, id=account.id,
                                           task_queue=cap.settings.task_queue)


async def test_a_run_started_afresh_while_revoked_says_so_and_takes_the_rotation(cap: CapStack) -> None:
    """The account is revoked in the guard store, a delete queued; an operator terminates its
    ProviderAccount entity and starts it again by hand. The new run takes the guard's record as its
    own: its ``status``, ``gpufleet accounts list`` and its details say credentials-revoked, the UI
    lists it as needing a person (``FleetState``), and ``credentials_rotated`` is taken: the queued
    delete runs and the account sells again. Before, the fresh run said healthy while the guard
    refused every call to the account, and refused the rotation ("credentials are not revoked")
    until a new bad-credentials report came, which no refused call sends: the account stayed
    blocked, the machine up, billed."""
    a, account, machine = await revoked_with_a_queued_delete(cap)
    revoked_since = cap.env.accounts.get(a).since
    account = await started_again_by_hand(cap, account)

    async def status() -> AccountStatus:
        return await account.query("status", result_type=AccountStatus)

    shown = await wait_for_async(status, lambda s: s.state == "credentials-revoked" and s.deletes_queued_count == 1,
                                 timeout=30)
    assert datetime.fromisoformat(shown.since).timestamp() == pytest.approx(revoked_since, abs=1)
    assert shown.reason, "the guard's reason"
    assert await cap.listed(f'RunId = "{account.result_run_id}" AND FleetState = "needs-person"')
    text = await details(account)
    assert "send the `credentials_rotated` update" in text and machine.machine_id in text, text
    assert (await listed_row(cap, account))["state"] == "credentials-revoked"
    assert cap.env.accounts.get(a).state == "credentials-revoked", "the guard as it was"

    cap.world.set_credentials_valid(a, True)
    rotated = AccountStatus.model_validate(await account.execute_update("credentials_rotated"))
    assert (rotated.state, rotated.deletes_queued_count) == ("healthy", 0)
    assert cap.world.machine(machine.machine_id)["deleted_at"] is not None, "the queued delete ran"
    assert cap.env.accounts.get(a).state == "healthy" and cap.env.accounts.pending_deletes(a) == []
    assert await cap.listed(f'RunId = "{account.result_run_id}" AND FleetState = "healthy"')
    # Capacity at the account is allowed again.
    (node,) = (await result_of(await cap.request({"constraints": {"sites": [cap.site("cheap")]}}))).nodes
    assert node.site == cap.site("cheap")
    await replay_and_record(account, "account_started_afresh_takes_the_guard")


async def test_a_run_started_afresh_takes_the_offers_the_guard_blocks_and_only_those(cap: CapStack) -> None:
    """An offer is quota-blocked in the guard store; the operator terminates the account's entity and
    starts it again by hand. The new run shows the offer blocked (``status``, ``FleetState``
    needs-person, details), and ``quota_raised`` for it is taken: the offer sells again. Started
    afresh once more, with the store blocking nothing now, it blocks nothing either. Before, the fresh
    run said healthy and refused ``quota_raised`` ("has no quota-blocked offer") while the guard kept
    the offer blocked for good."""
    a, cheap = cap.account("a"), cap.offer("cheap")
    cap.world.set_site(cap.site("cheap"), quota=0)
    assert [n.site for n in (await result_of(await cap.request({"constraints": {"gpu": "H100"}}))).nodes] \
        == [cap.site("mid")]
    await wait_for(lambda: cap.env.accounts.get(a).blocked_offers == [cheap])
    account = await started_again_by_hand(cap, cap.account_handle("lambda", "a"))

    async def status() -> AccountStatus:
        return await account.query("status", result_type=AccountStatus)

    shown = await wait_for_async(status, lambda s: s.state == "quota-blocked", timeout=30)
    assert list(shown.blocked_offers) == [cheap]
    assert await cap.listed(f'RunId = "{account.result_run_id}" AND FleetState = "needs-person"')
    assert f"- quota-blocked: {cheap}" in await details(account)

    cap.world.set_site(cap.site("cheap"), quota=8)
    raised = AccountStatus.model_validate(await account.execute_update("quota_raised", {"offers": [cheap]}))
    assert (raised.state, raised.blocked_offers) == ("healthy", {})
    assert cap.env.accounts.get(a).blocked_offers == [] and cap.env.accounts.get(a).state == "healthy"
    assert [n.site for n in (await result_of(await cap.request({"constraints": {"gpu": "H100"}}))).nodes] \
        == [cap.site("cheap")], "the offer sells again"
    await replay_and_record(account, "account_started_afresh_takes_the_guard_quota")

    # Started afresh again, the store blocking nothing: neither does the run.
    again = await started_again_by_hand(cap, account)
    fresh = await wait_for_async(lambda: again.query("status", result_type=AccountStatus),
                                 lambda s: s.deletes_queued_read, timeout=30)
    assert (fresh.state, fresh.blocked_offers) == ("healthy", {})
    assert await cap.listed(f'RunId = "{again.result_run_id}" AND FleetState = "healthy"')


async def test_a_run_started_afresh_asked_to_continue_before_it_reads_the_guard_still_takes_it(
        cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The account is revoked in the guard store, a delete queued; an operator starts its entity
    again by hand while the store refuses reads (a 403 after an RBAC mistake), so the fresh run cannot
    take the guard's record; before a read lands it is asked to continue as new (``gpufleet patches
    renew``, or the server's suggestion). The next run still reads the store once it answers: it says
    credentials-revoked, and ``credentials_rotated`` is taken, the queued delete run. Before, the
    continued run (it carries a status) never read the guard: it said healthy while the guard refused
    every call, refused the rotation ("credentials are not revoked"), and tried the deletes owed
    against the refusing guard for good."""
    from fleet.errors import ClusterForbidden

    a, account, machine = await revoked_with_a_queued_delete(cap)
    store = type(cap.env.accounts)
    pending, refusing = store.pending_deletes, [True]

    def refused(self, name: str | None = None):
        if refusing[0] and name == a:
            raise ClusterForbidden('get configmaps "gpufleet-accounts" is forbidden: User '
                                   '"system:serviceaccount:gpufleet:control-plane" cannot get', code="403")
        return pending(self, name)

    monkeypatch.setattr(store, "pending_deletes", refused)
    account = await started_again_by_hand(cap, account)
    first = account.result_run_id

    async def status() -> AccountStatus:
        return await account.query("status", result_type=AccountStatus)

    # The fresh run's read failed: it knows nothing of the guard's record yet (the deletes owed, unread).
    unread = await wait_for_async(status, lambda s: bool(s.deletes_owed_since), timeout=30)
    assert unread.state == "healthy", unread
    await account.signal("renew")
    second = (await wait_for_async(account.describe, lambda d: d.run_id != first, timeout=30)).run_id
    assert (await status()).guard_unread, "the next run knows the guard's record is still to be read"

    refusing[0] = False  # the store answers again: the continued run takes the guard's record
    taken = await wait_for_async(status, lambda s: s.state == "credentials-revoked", timeout=30)
    assert not taken.guard_unread and taken.deletes_queued_count == 1, taken
    assert await cap.listed(f'RunId = "{second}" AND FleetState = "needs-person"')
    assert "send the `credentials_rotated` update" in await details(account)

    cap.world.set_credentials_valid(a, True)
    rotated = AccountStatus.model_validate(await account.execute_update("credentials_rotated"))
    assert rotated.state == "healthy"
    assert cap.world.machine(machine.machine_id)["deleted_at"] is not None, "the queued delete ran"
    assert cap.env.accounts.get(a).state == "healthy" and cap.env.accounts.pending_deletes(a) == []
    done = await wait_for_async(status, lambda s: not s.deletes_owed_since, timeout=30)
    assert done.deletes_queued_count == 0 and (await account.describe()).run_id == second
    await replay_and_record(cap.client.get_workflow_handle(account.id, run_id=first),
                            "account_carries_the_guard_unread")
    await replay_and_record(account, "account_carries_the_guard_unread_then_read")


async def test_the_entity_reads_of_many_deletes_queued_stay_small_in_its_history(cap: CapStack) -> None:
    """500 machines' deletes are queued while the account is revoked. The entity, which reads them
    every 5 s to 5 minutes while revoked, shows how many (500) and names the first 20; what each
    read puts in its history is that, not every machine: its history does not grow with the
    machines queued times the reads. A caller that asks for every machine still gets them all."""
    from activities.capacity import CapacityActivities
    from fleet.messages.capacity import AccountInput, MAX_QUEUED_DELETES_SHOWN, QueuedDeletes, QueuedDeletesInput

    a, account, machine = await revoked_with_a_queued_delete(cap)
    for i in range(499):
        cap.env.accounts.queue_delete(cap.site("cheap"), a, f"{machine.machine_id}-gone-{i:03d}")

    async def status() -> AccountStatus:
        return await account.query("status", result_type=AccountStatus)

    shown = await wait_for_async(status, lambda s: s.deletes_queued_count == 500, timeout=60)
    assert len(shown.deletes_queued) == MAX_QUEUED_DELETES_SHOWN == 20
    assert shown.deletes_queued[0].machine_id == machine.machine_id, "oldest first"
    assert "500 machine(s) owed a delete" in (text := await details(account)) and "and 480 more" in text, text
    assert (await listed_row(cap, account))["deletes queued"] == "500"

    history = await account.fetch_history()
    reads = {e.event_id for e in history.events
             if e.HasField("activity_task_scheduled_event_attributes")
             and e.activity_task_scheduled_event_attributes.activity_type.name == "queued_deletes"}
    results = [e.activity_task_completed_event_attributes.result.payloads[0].data for e in history.events
               if e.HasField("activity_task_completed_event_attributes")
               and e.activity_task_completed_event_attributes.scheduled_event_id in reads]
    assert results, "the entity read the deletes queued"
    read = [QueuedDeletes.model_validate_json(data) for data in results]
    assert all(len(r.machines) <= MAX_QUEUED_DELETES_SHOWN and len(r.queued) <= MAX_QUEUED_DELETES_SHOWN
               for r in read), [len(r.machines) for r in read]
    assert read[-1].total == 500 and max(len(data) for data in results) < 8192, [len(d) for d in results]

    # A caller from before the flag (its payload: the account alone) gets every machine, as before.
    every = ActivityEnvironment().run(CapacityActivities(cap.env).queued_deletes,  # (a sync activity)
                                      QueuedDeletesInput.model_validate(AccountInput(account=a).model_dump()))
    assert (len(every.machines), every.total) == (500, 500), "a caller asking for every machine gets them all"


async def revoked_with_a_queued_delete(cap: CapStack):
    """Account a revoked (a request's BadCredentials reported it), with the delete of a machine it
    had queued meanwhile: (the account, its entity, the machine)."""
    a = cap.account("a")
    (machine,) = (await result_of(await cap.request({"constraints": {"sites": [cap.site("cheap")]}}))).nodes
    cap.world.set_credentials_valid(a, False)
    await result_of(await cap.request({"constraints": {"gpu": "H100"}, "count": 1}))  # reports BadCredentials
    await wait_for(lambda: cap.env.accounts.get(a).state == "credentials-revoked")
    await ActivityEnvironment().run(ControlPlaneActivities(cap.env).delete_machine,
                                    DeleteMachineInput(site=cap.site("cheap"), machine_id=machine.machine_id))
    assert [p.machine_id for p in cap.env.accounts.pending_deletes(a)] == [machine.machine_id], "queued"
    return a, cap.account_handle("lambda", "a"), machine


def refuse_deletes(cap: CapStack, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Account a's provider refuses every delete (a refusal no retry helps) while ``[0]`` holds."""
    from fleet.errors import InvalidRequest
    from sim.provider import SimProvider

    a, delete, refusing = cap.account("a"), SimProvider.delete_machine, [True]

    def refused(self, machine_id: str) -> None:
        if refusing[0] and self.account.name == a:
            raise InvalidRequest("instance-operations/terminate: 400 instance is not in a state that can be "
                                 "terminated", provider=self.name)
        delete(self, machine_id)

    monkeypatch.setattr(SimProvider, "delete_machine", refused)
    return refusing


async def cap_cli(cap: CapStack, *args: str) -> subprocess.CompletedProcess:
    """``gpufleet <args>`` as an operator runs it against this stack."""
    env = {**os.environ, **cap.settings.env(), "COLUMNS": "250"}
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cli", *args], env=env,
                                   capture_output=True, text=True, timeout=120)


async def test_all_exhausted_waits_and_resumes_when_capacity_appears(cap: CapStack) -> None:
    for site in ("cheap", "mid", "dear", "spot"):
        cap.world.set_site(cap.site(site), capacity=0)
    handle = await cap.request({"constraints": {"gpu": "H100"}, "count": 1, "backoff_seconds": 120,
                                "deadline_seconds": 300})
    await cap.listed(f'WorkflowId = "{handle.id}" AND FleetState = "waiting-for-capacity"')
    waiting = await progress(handle)
    assert waiting.step == "waiting for capacity"
    assert any("no capacity" in r for r in waiting.rejected)
    cap.world.set_site(cap.site("dear"), capacity=1)
    assert await cap.refresh_catalog() >= 1  # wakes the waiting request long before its backoff
    result = await result_of(handle)
    assert [n.site for n in result.nodes] == [cap.site("dear")]
    await replay_and_record(handle, "capacity_wait_then_resume")


async def signals_to(handle, name: str = "offers_changed") -> int:
    history = await handle.fetch_history()
    return sum(1 for e in history.events if e.HasField("workflow_execution_signaled_event_attributes")
               and e.workflow_execution_signaled_event_attributes.signal_name == name)


def offer_listings(cap: CapStack) -> int:
    return sum(cap.world.calls(cap.account(a), "offers") for a in "abcd")


async def test_a_refresh_with_unchanged_offers_wakes_no_request(cap: CapStack) -> None:
    # The Schedule refreshes every 10 minutes: a waiting request woken each time for nothing paid a
    # signal, a forced listing of every provider, a timer and two upserts, and its backoff never
    # grew past the refresh's period.
    for site in ("cheap", "mid", "dear", "spot"):
        cap.world.set_site(cap.site(site), capacity=0)
    assert await cap.refresh_catalog() == 0  # nobody waits yet: what it listed is what it compares with
    handle = await cap.request({"constraints": {"gpu": "H100"}, "count": 1, "backoff_seconds": 120,
                                "deadline_seconds": 300})
    assert await cap.listed(f'WorkflowId = "{handle.id}" AND FleetState = "waiting-for-capacity"')
    refresh = await cap.client.start_workflow("CatalogRefresh", None, id=f"catalog-refresh-{cap.uid}-same",
                                              task_queue=cap.settings.task_queue)
    assert await refresh.result() == 0
    assert await signals_to(handle) == 0
    assert (await progress(handle)).step == "waiting for capacity"
    await replay_and_record(refresh, "catalog_refresh_offers_unchanged")
    await handle.execute_update("cancel", "the test is done")


async def test_a_refresh_with_changed_offers_wakes_only_the_requests_waiting_for_capacity(cap: CapStack) -> None:
    cap.world.set_site(cap.site("cheap"), capacity=0)
    cap.world.set_site(cap.site("dear"), boot_seconds=600)  # its join stays in flight
    await cap.refresh_catalog()
    waiting = await cap.request({"constraints": {"sites": [cap.site("cheap")]}, "count": 1,
                                 "backoff_seconds": 120, "deadline_seconds": 300}, name="waits")
    joining = await cap.request({"constraints": {"sites": [cap.site("dear")]}, "count": 1, "deadline_seconds": 300,
                                 "join_timeouts": {**FAST_JOIN, "registration_seconds": 900}}, name="joins")
    assert await cap.listed(f'WorkflowId = "{waiting.id}" AND FleetState = "waiting-for-capacity"')
    await wait_for_async(lambda: progress(joining), lambda p: p.in_flight)
    cap.world.set_site(cap.site("mid"), capacity=0)  # an offer the waiting request cannot buy either
    assert await cap.refresh_catalog() >= 1
    assert await signals_to(waiting) == 1
    assert await signals_to(joining) == 0, "a request with a join in flight looks again as it ends"
    for handle in (waiting, joining):
        await handle.execute_update("cancel", "the test is done")


async def test_a_request_woken_by_a_refresh_reads_its_listing_and_lists_nothing(cap: CapStack) -> None:
    for site in ("cheap", "mid", "dear", "spot"):
        cap.world.set_site(cap.site(site), capacity=0)
    handle = await cap.request({"constraints": {"gpu": "H100"}, "count": 1, "backoff_seconds": 120,
                                "deadline_seconds": 300})
    assert await cap.listed(f'WorkflowId = "{handle.id}" AND FleetState = "waiting-for-capacity"')
    listed = offer_listings(cap)
    cap.world.set_site(cap.site("dear"), capacity=1)
    assert await cap.refresh_catalog() >= 1
    result = await result_of(handle)
    assert [n.site for n in result.nodes] == [cap.site("dear")]
    # One listing per site, the refresh's: W woken requests cost no more provider calls than one.
    assert offer_listings(cap) == listed + 4
    await replay_and_record(handle, "capacity_woken_reads_the_refreshed_catalog")


async def test_spend_cap_and_max_price_are_respected(cap: CapStack) -> None:
    # cheap: 2 GPUs x $2.00 = $4/h per machine; mid $5/h; dear $7/h (above max price).
    handle = await cap.request({
        "constraints": {"gpu": "H100", "max_price_per_gpu_hour": 3.0, "spend_cap_per_hour": 9.5,
                        "capacity_types": ["on-demand"]},
        "count": 3, "deadline_seconds": 2, "backoff_seconds": 1,
    })
    result = await result_of(handle)
    assert not result.complete
    assert len(result.nodes) == 2 and result.cost_per_hour <= 9.5
    assert "1 of 3 not joined" in result.why[0]
    assert any("spend cap" in w for w in result.why)
    assert any(cap.offer("dear") in w and "max" in w for w in result.why)
    assert cap.world.calls(cap.account("c"), "create") == 0


async def test_geography_is_respected(cap: CapStack) -> None:
    result = await result_of(await cap.request({"constraints": {"gpu": "H100", "geographies": ["eu"],
                                                                "capacity_types": ["on-demand"]}, "count": 2}))
    assert {n.site for n in result.nodes} == {cap.site("mid")}
    assert cap.world.calls(cap.account("a"), "create") == 0


async def test_invalid_request_fails_the_request(cap: CapStack) -> None:
    from temporalio.client import WorkflowFailureError

    handle = await cap.request({"constraints": {"gpu": "H100", "gpu_class": ["H200"]}})
    with pytest.raises(WorkflowFailureError) as caught:
        await handle.result()
    assert caught.value.cause.type == "InvalidInput"
