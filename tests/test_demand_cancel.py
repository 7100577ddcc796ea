"""The demand loop's ``cancel_purchase``: a purchase whose pods all went is cancelled only when
none of the joins it runs has asked a provider for a machine; otherwise it is kept (its node comes,
and consolidation gives it back once idle), since cancelling it would delete a machine already
bought. The loop asks again at each pass while a kept purchase runs (tests/test_demand_loop.py).

The purchase (an AcquireCapacity) and its joins (NodeJoins) are stand-ins here that answer the
real workflows' ``progress`` queries with the real messages, so each case (which join is where)
is set exactly; the real activity asks them through Temporal's time-skipping test server."""

from __future__ import annotations

from typing import AsyncIterator

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.demand import DemandActivities
from fleet.messages.capacity import CapacityProgress, JoinAttempt
from fleet.messages.demand import CancelOutcome, CancelPurchaseInput
from fleet.messages.join import JoinProgress
from fleet.naming import join_workflow_id, purchase_workflow_id

QUEUE = "demand-cancel"
POD_GONE = "every pod it was bought for is gone"


@workflow.defn(name="AcquireCapacity")
class PurchaseStandIn:
    """A purchase in the middle of buying: its progress is what the test set; it runs until cancelled."""

    def __init__(self) -> None:
        self._progress = CapacityProgress(step="starting")

    @workflow.run
    async def run(self, progress: CapacityProgress) -> None:
        self._progress = progress
        await workflow.wait_condition(lambda: False)

    @workflow.query
    def progress(self) -> CapacityProgress:
        return self._progress


@workflow.defn(name="NodeJoin")
class JoinStandIn:
    """A join held at one step (``failed``: it ends failed, as a join whose offer had no capacity)."""

    def __init__(self) -> None:
        self._step = "starting"

    @workflow.run
    async def run(self, step: str) -> None:
        self._step = step
        if step == "failed":
            raise ApplicationError("NoCapacity while provisioning: sold out", type="NoCapacity", non_retryable=True)
        await workflow.wait_condition(lambda: False)

    @workflow.query
    def progress(self) -> JoinProgress:
        return JoinProgress(step=self._step)


@workflow.defn(name="AcquireCapacity")
class PurchaseWithoutProgress:
    """A purchase that cannot answer ``progress`` (whatever the reason, it cannot be asked)."""

    @workflow.run
    async def run(self, progress: CapacityProgress) -> None:
        await workflow.wait_condition(lambda: False)


@pytest.fixture
async def client(time_skipping_env: WorkflowEnvironment) -> AsyncIterator[Client]:
    async with Worker(time_skipping_env.client, task_queue=QUEUE, workflows=[PurchaseStandIn, JoinStandIn],
                      workflow_runner=UnsandboxedWorkflowRunner()):
        yield time_skipping_env.client


async def buying(client: Client, purchase_id: str, joins: dict[str, str], **progress) -> WorkflowHandle:
    """A purchase running the joins given (join id → the step it is at)."""
    for join_id, step in joins.items():
        await client.start_workflow("NodeJoin", step, id=join_id, task_queue=QUEUE)
    offers = [join_id.split("/")[1] + "/gpu_2x_h100" for join_id in joins]
    return await client.start_workflow(
        "AcquireCapacity", CapacityProgress(step="joining", joins=list(joins), in_flight=offers, **progress),
        id=purchase_id, task_queue=QUEUE)


async def cancel_purchase(client: Client, purchase_id: str, site: str) -> CancelOutcome:
    return await ActivityEnvironment(client=client).run(
        DemandActivities(None).cancel_purchase,  # type: ignore[arg-type]
        CancelPurchaseInput(workflow_id=purchase_id, site=site, reason=POD_GONE))


async def cancel_asked(handle: WorkflowHandle) -> bool:
    """Whether anyone asked Temporal to cancel it (the server records it as the request returns)."""
    return any(e.HasField("workflow_execution_cancel_requested_event_attributes")
               for e in (await handle.fetch_history()).events)


async def ends_cancelled(handle: WorkflowHandle) -> bool:
    with pytest.raises(WorkflowFailureError) as ended:
        await handle.result()
    return isinstance(ended.value.cause, CancelledError)


def request_of(purchase_id: str) -> str:
    return purchase_id.removeprefix("capacity/")


@pytest.mark.parametrize("where", ["second join of two", "join at the second-choice site"])
async def test_a_purchase_is_kept_when_any_of_its_joins_has_asked_for_a_machine(client: Client, where: str) -> None:
    purchase_id = purchase_workflow_id(7)
    request = request_of(purchase_id)
    if where == "second join of two":
        # Two machines at site-a: join -1 still looking the site up, join -2 buying its machine.
        first, provisioning = join_workflow_id("site-a", f"{request}-1"), join_workflow_id("site-a", f"{request}-2")
        joins = {first: "resolving site", provisioning: "provisioning"}
    else:
        # Planned at site-a, which had no capacity: its only join runs at site-b and waits for its node.
        provisioning = join_workflow_id("site-b", f"{request}-2")
        joins = {provisioning: "waiting for registration"}
    purchase = await buying(client, purchase_id, joins, requested=len(joins))

    outcome = await cancel_purchase(client, purchase_id, site="site-a")

    assert not outcome.cancelled, outcome.reason
    assert provisioning in outcome.reason, "the reason names the join that keeps it"
    assert not await cancel_asked(purchase), "a cancel would have deleted the machine that join is buying"


async def test_a_purchase_none_of_whose_joins_has_asked_for_a_machine_is_cancelled(client: Client) -> None:
    purchase_id = purchase_workflow_id(7)
    request = request_of(purchase_id)
    joins = {join_workflow_id("site-a", f"{request}-1"): "resolving site",
             join_workflow_id("site-a", f"{request}-2"): "starting"}
    purchase = await buying(client, purchase_id, joins, requested=2)

    outcome = await cancel_purchase(client, purchase_id, site="site-a")

    assert outcome == CancelOutcome(cancelled=True, reason=POD_GONE)
    assert await ends_cancelled(purchase)


async def test_a_purchase_whose_first_join_failed_and_that_waits_for_capacity_is_cancelled(client: Client) -> None:
    """It has bought nothing (its join had no capacity, nothing in flight): keeping it would buy a
    machine for pods that are gone once capacity returns."""
    purchase_id = purchase_workflow_id(7)
    first_join = join_workflow_id("site-a", f"{request_of(purchase_id)}-1")
    failed = await client.start_workflow("NodeJoin", "failed", id=first_join, task_queue=QUEUE)
    with pytest.raises(WorkflowFailureError):
        await failed.result()
    purchase = await client.start_workflow(
        "AcquireCapacity", CapacityProgress(step="waiting for capacity", requested=1,
                                            attempts=[JoinAttempt(offer="site-a/gpu_2x_h100", outcome="NoCapacity")]),
        id=purchase_id, task_queue=QUEUE)

    outcome = await cancel_purchase(client, purchase_id, site="site-a")

    assert outcome.cancelled, outcome.reason
    assert await ends_cancelled(purchase)


async def test_a_purchase_that_already_ended_is_left_alone_and_says_so(client: Client) -> None:
    purchase_id = purchase_workflow_id(7)
    purchase = await buying(client, purchase_id, {})
    await purchase.terminate("ended before the pods went")

    outcome = await cancel_purchase(client, purchase_id, site="site-a")

    assert not outcome.cancelled
    assert "already ended (terminated)" in outcome.reason
    assert not await cancel_asked(purchase)


async def test_a_purchase_that_cannot_say_which_joins_it_runs_is_kept(time_skipping_env: WorkflowEnvironment) -> None:
    client = time_skipping_env.client
    purchase_id = purchase_workflow_id(7)
    async with Worker(client, task_queue=QUEUE, workflows=[PurchaseWithoutProgress],
                      workflow_runner=UnsandboxedWorkflowRunner()):
        purchase = await client.start_workflow("AcquireCapacity", CapacityProgress(step="joining"),
                                               id=purchase_id, task_queue=QUEUE)

        outcome = await cancel_purchase(client, purchase_id, site="site-a")

        assert not outcome.cancelled
        assert outcome.reason.startswith(f"could not ask {purchase_id} which joins it runs")
        assert not await cancel_asked(purchase)


async def test_a_purchase_temporal_does_not_describe_now_is_not_taken_for_gone(client: Client) -> None:
    """``purchase_status`` says "missing" (the loop plans its pods again) only for a purchase Temporal
    does not know. A describe Temporal did not answer (unavailable, a timeout) is the activity's
    retried failure, and after its retries the loop's failed pass. Before, any error read as a
    purchase gone: a purchase still buying was taken for failed, and its pods bought for twice."""
    from temporalio.service import RPCError, RPCStatusCode

    from fleet.messages.demand import PurchaseStatusInput

    status_of = DemandActivities(None).purchase_status  # type: ignore[arg-type]
    never = PurchaseStatusInput(workflow_ids=[purchase_workflow_id(404, "nosuch")])
    assert [s.status for s in await ActivityEnvironment(client=client).run(status_of, never)] == ["missing"]

    class Unavailable:
        """A client whose Temporal frontend does not answer."""

        def get_workflow_handle(self, workflow_id: str) -> "Unavailable":
            return self

        async def describe(self) -> None:
            raise RPCError("failed to connect: connection refused", RPCStatusCode.UNAVAILABLE, b"")

    with pytest.raises(RPCError, match="connection refused"):
        await ActivityEnvironment(client=Unavailable()).run(status_of, never)  # type: ignore[arg-type]
