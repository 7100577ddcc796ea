"""The typed client (``client.FleetClient``) against the dev server and a running worker:
each call starts its workflow under the standard id with its search attributes, a repeated
call attaches, and a bad argument is refused, naming the field, before anything starts."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from client import FleetClient, InvalidArgument, NotFound, Rejected
from fleet import search_attributes as sa
from fleet.messages.capacity import AccountStatus, CapacityResult, SiteStatus
from fleet.messages.evacuation import EvacuationResult
from fleet.messages.join import NodeJoinResult
from fleet.models import AccountState
from fleet.naming import node_name_for
from tests.capacity_fleet import FAST_JOIN, CapStack, open_stack
from tests.conftest import TEST_FLEET, Stack, write_fleet
from tests.evacuation_helpers import IncStack, incident_fleet, open_incident_stack, poll


async def never_started(client: Client, workflow_id: str) -> bool:
    """Describe reads the execution itself (no visibility lag): NOT_FOUND means nothing started."""
    try:
        await client.get_workflow_handle(workflow_id).describe()
    except RPCError as error:
        return error.status == RPCStatusCode.NOT_FOUND
    return False


async def test_start_join_uses_the_standard_id_attributes_and_attaches(stack: Stack) -> None:
    fleet = FleetClient(stack.settings, stack.client)
    request = f"client-{uuid.uuid4().hex[:6]}"
    handle = await fleet.start_join({"site": "site-a"}, request_id=request)
    assert handle.id == f"join/site-a/{request}"
    attributes = (await handle.describe()).typed_search_attributes
    assert attributes.get(sa.SITE) == "site-a"
    assert (attributes.get(sa.PROVIDER), attributes.get(sa.ACCOUNT)) == ("lambda", "acct-a")
    # From the id alone at start; the join's own name (with its nonce) from its first task on.
    named = node_name_for("site-a", handle.id, handle.first_execution_run_id)
    assert attributes.get(sa.NODE_NAME) in (node_name_for("site-a", handle.id), named)

    again = await fleet.start_join({"site": "site-a"}, request_id=request)
    assert again.run_id == handle.run_id, "a repeated call attaches to the running join"
    result = await again.result()
    assert isinstance(result, NodeJoinResult) and result.nodes[0].node_name == named
    assert (await fleet.join_progress(handle.id)).step == "ready"


async def test_bad_join_arguments_are_refused_before_anything_starts(stack: Stack) -> None:
    fleet = FleetClient(stack.settings, stack.client)
    with pytest.raises(InvalidArgument) as refused:
        await fleet.start_join({"site": "site-a", "count": 0}, request_id="bad-count")
    assert refused.value.field == "count"
    assert await never_started(stack.client, "join/site-a/bad-count")
    with pytest.raises(InvalidArgument) as refused:
        await fleet.start_join({"site": "site-a", "colour": "red"}, request_id="bad-key")
    assert refused.value.field == "colour" and "unknown field" in str(refused.value)
    assert await never_started(stack.client, "join/site-a/bad-key")
    with pytest.raises(InvalidArgument) as refused:
        await fleet.start_join({"site": "site-a"}, request_id="")
    assert refused.value.field == "request_id"
    assert stack.world.calls("acct-a") == 0


async def test_invalid_arguments_need_no_server() -> None:
    """Refused before the client even connects (nothing listens at this address)."""
    from fleet.settings import Settings

    fleet = FleetClient(Settings(address="127.0.0.1:1"))
    with pytest.raises(InvalidArgument) as refused:
        await fleet.acquire_capacity({"count": 0}, request_id="x")
    assert refused.value.field == "count"
    with pytest.raises(InvalidArgument) as refused:
        await fleet.acquire_capacity({"constraints": {"gpu": "H100", "gpu_class": ["H200"]}}, request_id="x")
    assert refused.value.field == "constraints" and "not both" in str(refused.value)
    with pytest.raises(InvalidArgument) as refused:
        await fleet.start_rollout({"model": "llm", "version": "bad version!"})
    assert "version" in [field for field, _ in refused.value.problems]
    with pytest.raises(InvalidArgument) as refused:
        await fleet.hold_repair("node-1", -1)
    assert refused.value.field == "gpu"
    with pytest.raises(InvalidArgument) as refused:
        await fleet.skip_repair_to("node-1", 0, "warp")
    assert refused.value.field == "rung"
    with pytest.raises(InvalidArgument) as refused:
        await fleet.quota_raised("nobody")
    assert refused.value.field == "account"
    with pytest.raises(InvalidArgument) as refused:
        await fleet.evacuate_site({"site": ""}, request_id="x")
    assert refused.value.field == "site"
    assert fleet._client is None, "nothing was sent"


async def test_a_join_its_site_cannot_take_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """As ``gpufleet join`` refuses it: a site the fleet config does not name, and more nodes than
    the site's max_nodes (a site being emptied has 0), each of which its Site entity would retire.
    Before, the client started the join: an unknown site failed in the workflow, and one node at a
    site whose max_nodes is 0 was bought, joined and retired. Refused before the client connects
    (nothing listens at this address)."""
    from fleet.settings import Settings

    fleet_config = copy.deepcopy(TEST_FLEET)
    fleet_config["sites"][0].update(min_nodes=0, max_nodes=0)
    fleet = FleetClient(Settings(address="127.0.0.1:1", config=str(write_fleet(tmp_path, fleet_config))))
    with pytest.raises(InvalidArgument) as refused:
        await fleet.start_join({"site": "atlantis"}, request_id="x")
    assert refused.value.problems == [("site", "unknown site 'atlantis'; known: site-a, site-b")]
    with pytest.raises(InvalidArgument) as refused:
        await fleet.start_join({"site": "site-a"}, request_id="x")
    assert refused.value.problems == [("count", "1 is more than site-a's max_nodes (0)")]
    with pytest.raises(InvalidArgument) as refused:
        await fleet.start_join({"site": "site-b", "count": 9}, request_id="x")
    assert refused.value.problems == [("count", "9 is more than site-b's max_nodes (8)")]
    assert fleet._client is None, "nothing was sent"


def test_gpufleet_join_refuses_with_the_same_check_and_counts_the_nodes_there(tmp_path: Path) -> None:
    """``gpufleet join`` shares the client's check (``fleet.site_use.join_refusal``), and also
    counts the nodes the cluster has at the site: the person at the terminal is told the room left."""
    from typer.testing import CliRunner

    from cli.main import app

    fleet_config = copy.deepcopy(TEST_FLEET)
    fleet_config["sites"][0].update(min_nodes=0, max_nodes=0)
    config = str(write_fleet(tmp_path, fleet_config))
    where = ["--address", "127.0.0.1:1", "--config", config, "--state-dir", str(tmp_path / "state")]
    for asked, said in ((["--site", "atlantis"], "--site: unknown site 'atlantis'; known: site-a, site-b"),
                        (["--site", "site-a"], "--count: site-a can take 0 more node(s) (max_nodes 0, 0 there now); "
                                               "asked for 1"),
                        (["--site", "site-b", "--count", "9"], "--count: site-b can take 8 more node(s) (max_nodes 8, "
                                                               "0 there now); asked for 9")):
        refused = CliRunner().invoke(app, ["join", *asked, *where], env={"COLUMNS": "250"})
        assert refused.exit_code == 2, refused.output
        assert said in refused.output, refused.output


@pytest.fixture
async def cap(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[CapStack]:
    address = temporal_env.client.service_client.config.target_host
    async for stack in open_stack(temporal_env.client, address, tmp_path):
        yield stack


async def test_capacity_and_the_account_entity(cap: CapStack) -> None:
    fleet = FleetClient(cap.settings, cap.client)
    cheap, mid = cap.site("cheap"), cap.site("mid")
    cap.world.set_site(cheap, quota=0)  # the cheapest offer answers OverQuota: its account needs a person
    request = {"constraints": {"gpu": "H100", "sites": [cheap, mid]}, "count": 1, "join_timeouts": FAST_JOIN}
    handle = await fleet.acquire_capacity(request, request_id=f"client-{cap.uid}")
    assert handle.id == f"capacity/client-{cap.uid}"
    again = await fleet.acquire_capacity(request, request_id=f"client-{cap.uid}")
    assert again.run_id == handle.run_id
    result = await handle.result()
    assert isinstance(result, CapacityResult) and result.complete and result.nodes[0].site == mid

    account = cap.account("a")
    await cap.listed(f'WorkflowId = "account/lambda/{account}" AND FleetState = "needs-person"')
    blocked = await fleet.account_status(account)
    assert blocked.state == AccountState.QUOTA_BLOCKED and cap.offer("cheap") in blocked.blocked_offers
    assert account in [s.account for s in await fleet.accounts(needs_person=True)]

    with pytest.raises(Rejected) as rejected:
        await fleet.quota_raised(account, ["nowhere/none"])
    assert "not blocked" in rejected.value.reason
    with pytest.raises(Rejected) as rejected:  # neither offers nor all: "all" is never implied
        await fleet.quota_raised(account)
    assert rejected.value.reason.startswith("offers:") or "offers:" in rejected.value.reason, rejected.value.reason
    status = await fleet.quota_raised(account, all=True)
    assert isinstance(status, AccountStatus) and status.state == AccountState.HEALTHY
    with pytest.raises(Rejected) as rejected:
        await fleet.credentials_rotated(account)
    assert "not revoked" in rejected.value.reason
    with pytest.raises(NotFound):
        await fleet.credentials_rotated(cap.account("d"))  # never reported: no entity yet


async def test_repair_and_node_calls_name_what_is_missing(stack: Stack) -> None:
    fleet = FleetClient(stack.settings, stack.client)
    with pytest.raises(NotFound) as missing:
        await fleet.hold_repair("no-such-node", 0)
    assert missing.value.workflow_id == "repair/no-such-node/gpu0"
    with pytest.raises(NotFound) as missing:
        await fleet.node_status("no-such-node")
    assert missing.value.workflow_id == "node/no-such-node"


async def test_a_node_entity_terminated_before_its_first_step_is_shown_at_its_site(stack: Stack) -> None:
    """A Node entity terminated before its first workflow task ran (an operator's slip the moment
    it was listed) answers its status query with nothing it learned, its site among it: `gpufleet
    repair node` said "site unknown". The control plane starts every entity with its site as a search
    attribute, which the status now falls back on."""
    from datetime import timedelta

    from temporalio.common import SearchAttributePair, TypedSearchAttributes

    from fleet.contracts import workflows as flows
    from fleet.naming import node_workflow_id

    node = node_name_for("site-a", f"early-{uuid.uuid4().hex[:6]}")
    handle = await stack.client.start_workflow(
        flows.Node.TYPE, {"node_name": node, "site": "site-a"}, id=node_workflow_id(node),
        task_queue=stack.settings.task_queue, start_delay=timedelta(hours=1),  # its first task never runs
        search_attributes=TypedSearchAttributes([SearchAttributePair(sa.SITE, "site-a"),
                                                 SearchAttributePair(sa.NODE_NAME, node)]))
    await handle.terminate("an operator's slip in the Temporal UI")
    status = await FleetClient(stack.settings, stack.client).node_status(node)
    assert (status.site, status.state, status.entity) == ("site-a", "unwatched", "terminated"), status


@pytest.fixture
async def inc(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[IncStack]:
    uid = uuid.uuid4().hex[:6]
    async for stack in open_incident_stack(temporal_env.client, tmp_path, incident_fleet(uid), uid=uid):
        yield stack


async def test_site_entity_and_an_evacuation_by_hand(inc: IncStack) -> None:
    fleet = FleetClient(inc.settings, inc.client)
    a = inc.site("a")
    # The entity starts with the update form of ``reconcile``, which answers with what it will do.
    assert (await fleet.reconcile_site(a)).startswith(f"{a}: ")
    site = inc.client.get_workflow_handle(f"site/{a}")
    run_id = (await site.describe()).run_id
    assert (await fleet.reconcile_site(a)).startswith(f"{a}: ")
    assert (await site.describe()).run_id == run_id, "a second call reaches the running entity"
    status = await poll(lambda: fleet.site_status(a), timeout=20)
    assert isinstance(status, SiteStatus) and status.site == a
    await site.terminate("the evacuation below is by hand")

    with pytest.raises(InvalidArgument) as refused:
        await fleet.evacuate_site({"site": a, "reason": "test", "colour": "red"}, request_id="t1")
    assert refused.value.field == "colour"
    assert await never_started(inc.client, f"evacuate/{a}/manual-t1")
    with pytest.raises(InvalidArgument) as refused:  # as the CLI does: not started at all
        await fleet.evacuate_site({"site": "mars-1", "reason": "test"}, request_id="t2")
    assert refused.value.field == "site" and "unknown site 'mars-1'" in str(refused.value)
    assert await never_started(inc.client, "evacuate/mars-1/manual-t2")
    with pytest.raises(NotFound):
        await fleet.declare_site_recovered(a)

    await inc.join("a", 1)
    inc.world.set_site(a, unreachable=1)  # not back by itself: the operator declares it
    request = {"site": a, "reason": "provider maintenance (test)"}
    handle = await fleet.evacuate_site(request, request_id="t1")
    assert handle.id == f"evacuate/{a}/manual-t1"
    assert (await handle.describe()).typed_search_attributes.get(sa.SITE) == a
    assert (await fleet.evacuate_site(request, request_id="t1")).run_id == handle.run_id

    async def waiting():
        p = await fleet.evacuation_progress(handle.id)
        return p if p is not None and p.state == "waiting-for-recovery" else None

    await poll(waiting, timeout=40)
    assert await fleet.running_evacuation(a) == handle.id
    # A second one (by code, or a person's second request) follows the first and changes nothing:
    # the site's evacuation, the one to declare recovered, is still the first.
    second = await fleet.evacuate_site({"site": a, "reason": "again (test)"}, request_id="t3")

    async def following():
        p = await fleet.evacuation_progress(second.id)
        return p if p is not None and p.state == "following" else None

    assert (await poll(following, timeout=20)).following == handle.id
    assert await fleet.running_evacuation(a) == handle.id
    inc.world.set_site(a, unreachable=0)
    progress = await fleet.declare_site_recovered(a, "provider says it is back")
    assert progress.site == a
    result = await handle.result()
    assert isinstance(result, EvacuationResult) and result.outcome == "restored"
    assert (await second.result()).outcome == f"followed {handle.id}: restored"
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED


async def test_a_query_no_worker_answers_is_no_worker_naming_its_queue(fleet_world: Stack) -> None:
    """A running workflow whose queue no worker polls (the control plane down): its query waited the
    server's 30 s and raised a bare RPCError. It raises NoWorker within QUERY_TIMEOUT, naming the
    query and the workflow's own task queue (read from the workflow, not the configured one)."""
    import time

    from client import NoWorker

    fleet = FleetClient(fleet_world.settings, fleet_world.client)
    queue = f"{fleet_world.settings.task_queue}-elsewhere"
    workflow_id = f"evacuate/site-a/manual-{uuid.uuid4().hex[:8]}"
    handle = await fleet_world.client.start_workflow("SiteEvacuation", {}, id=workflow_id, task_queue=queue)
    try:
        began = time.monotonic()
        with pytest.raises(NoWorker) as unanswered:
            await fleet.evacuation_progress(workflow_id)
        took = time.monotonic() - began
        assert took < 15, f"took {took:.0f} s"
        error = unanswered.value
        assert (error.workflow_id, error.query, error.task_queue) == (workflow_id, "progress", queue)
        assert str(error).startswith(f"no worker answered `progress` of `{workflow_id}` within 10 s: "
                                     f"is the control plane running (its worker polls `{queue}`)?"), str(error)
    finally:
        await handle.terminate()


async def test_a_query_to_a_queue_whose_worker_went_away_is_no_worker() -> None:
    """A worker that polled and then crashed: once it has been gone a while (20 s on the dev server
    1.32), the server answers the query with FAILED_PRECONDITION "no poller seen for task queue
    recently", which the client raised as a bare RPCError. It is NoWorker too; a precondition
    that is not about pollers stays the server's own error."""
    from types import SimpleNamespace

    from client import NoWorker
    from fleet.settings import Settings

    class Handle:
        def __init__(self, error: RPCError) -> None:
            self.error = error

        async def query(self, *args, **kwargs):
            raise self.error

        async def describe(self, **kwargs):
            return SimpleNamespace(task_queue="gpufleet")

    def fleet_raising(error: RPCError) -> FleetClient:
        temporal = SimpleNamespace(get_workflow_handle=lambda workflow_id: Handle(error))
        return FleetClient(Settings(address="127.0.0.1:1", task_queue="configured"), temporal)

    gone = RPCError("no poller seen for task queue recently, worker may be down", RPCStatusCode.FAILED_PRECONDITION, b"")
    with pytest.raises(NoWorker) as unanswered:
        await fleet_raising(gone).site_status("site-a")
    assert (unanswered.value.workflow_id, unanswered.value.query, unanswered.value.task_queue) == \
        ("site/site-a", "status", "gpufleet")
    other = RPCError("something else", RPCStatusCode.FAILED_PRECONDITION, b"")
    with pytest.raises(RPCError) as raised:
        await fleet_raising(other).site_status("site-a")
    assert not isinstance(raised.value, NoWorker) and raised.value.message == "something else"


@pytest.mark.parametrize("seconds", [float("inf"), float("nan"), 0, -1])
def test_an_update_answer_timeout_that_is_no_bound_is_refused_naming_it(seconds) -> None:
    """An infinite or NaN bound raised OverflowError or ValueError from timedelta: refused as
    every bad argument is, naming it, before anything connects."""
    with pytest.raises(InvalidArgument) as refused:
        FleetClient(update_answer_timeout=seconds)
    assert "update_answer_timeout" in str(refused.value)
