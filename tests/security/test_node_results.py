"""Issue 35: every result a node's agent returns is untrusted input, not only the health watch's
(tests/security/test_node_reports.py). The smoke test (a join's and a repair's proof), the GPU
reset and the driver reinstall are each taken undecoded and validated in workflow code: a
malformed answer is a failed smoke test or a failed rung whose detail names the field ("bad
report from <node>: <activity> result.<field>: ..."), counted in ``gpufleet_node_bad_reports``,
and never a failed workflow task. (``probe_gpus`` is on the agent's queue but no workflow calls
it; ``watch_node`` is the other test's.)

The node joins the simulated fleet as usual; its agent is the real one, except that an armed
forgery answers one activity for one workflow.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import math
import time
import uuid
from datetime import timedelta
from typing import Any, AsyncIterator, Callable

import pytest
from hypothesis import strategies as st
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.common import RawValue
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Worker

import workers.node_agent
from fleet.messages.nodes import ReinstallDriverInput, ResetGpuInput, SmokeTestInput
from activities.node_agent import NodeAgentActivities
from fleet.messages.join import JoinedNode
from fleet.messages.repair import GpuRepairInput, LadderState
from fleet.repair_policy import RepairSettings, Rung
from fleet.naming import node_queue
from tests.bad_input_helpers import task_failures
from tests.conftest import Stack
from tests.repair_helpers import REPAIR, eventually, exists, join_node, repair_handle, running_stack
from tests.security.test_node_reports import HOSTILE_VALUES, as_json, nested
from tests.test_bad_input_property import draw

Forgery = Callable[[], Payload]
#: Drawn attacks per activity (derandomized): each is one short GpuRepair run (a fraction of a second here).
EXAMPLES = 20


class HostileAgent:
    """The node's agent, except that an armed forgery answers its activity once, for the
    workflow it was armed for (every other call is answered honestly)."""

    def __init__(self) -> None:
        self._armed: dict[tuple[str, str], Forgery] = {}
        self.answered: list[tuple[str, str]] = []

    def arm(self, activity_name: str, workflow_id: str, forgery: Forgery) -> None:
        self._armed[(activity_name, workflow_id)] = forgery

    def _forged(self, name: str) -> RawValue | None:
        forgery = self._armed.pop((name, activity.info().workflow_id), None)
        if forgery is None:
            return None
        self.answered.append((name, activity.info().workflow_id))
        forged = forgery()
        if isinstance(forged, BaseException):
            raise forged  # a failure the node chose (its type, its flag)
        return RawValue(forged)

    def build_agent(self, client, node_name, gpus, executor, watch=None) -> Worker:
        agent = NodeAgentActivities(node_name, gpus, watch)

        @activity.defn(name="smoke_test")
        def smoke_test(input: SmokeTestInput) -> Any:
            return self._forged("smoke_test") or agent.smoke_test(input)

        @activity.defn(name="reset_gpu")
        def reset_gpu(input: ResetGpuInput) -> Any:
            return self._forged("reset_gpu") or agent.reset_gpu(input)

        @activity.defn(name="reinstall_driver")
        def reinstall_driver(input: ReinstallDriverInput) -> Any:
            return self._forged("reinstall_driver") or agent.reinstall_driver(input)

        forged = {"smoke_test", "reset_gpu", "reinstall_driver"}
        others = [a for a in agent.all() if getattr(a, "__name__", "") not in forged]
        return Worker(client, task_queue=node_queue(node_name), activities=[*others, smoke_test, reset_gpu,
                                                                            reinstall_driver],
                      activity_executor=executor, max_concurrent_activities=5)


@pytest.fixture
async def hostile(temporal_env, tmp_path, monkeypatch) -> AsyncIterator[tuple[Stack, JoinedNode, HostileAgent]]:
    agent = HostileAgent()
    monkeypatch.setattr(workers.node_agent, "build_agent", agent.build_agent)
    async for stack in running_stack(temporal_env.client, tmp_path):
        yield stack, await join_node(stack), agent


# -- forged answers ------------------------------------------------------------------------------
def state(node_name: str) -> dict[str, Any]:
    """A well-formed smoke-test state (a watch result), as a join asks for it."""
    return {"node_name": node_name, "seq": 1, "digest": "d" * 64, "boot_id": "b" * 36,
            "gpus": [{"index": 0, "uuid": "GPU-0", "name": "H100", "memory_gb": 80, "temperature_c": 40,
                      "ecc_uncorrected": 0, "xid_events": [{"xid": 13, "at": "2026-01-01T00:00:00Z",
                                                            "message": "m"}]}],
            "reclaim_at": None, "observed_at": None}


def smoke(node_name: str, gpus: int) -> dict[str, Any]:
    """A well-formed smoke test that passed: each attack below breaks exactly one field of it."""
    return {"passed": True, "gpus_seen": gpus, "boot_id": "b" * 36, "failures": ["GPU 0: fine"],
            "state": state(node_name)}


def bytes_of(data: bytes, encoding: bytes = b"json/plain") -> Forgery:
    return lambda: Payload(metadata={"encoding": encoding}, data=data)


def replacing(answer: dict[str, Any], path: tuple, value: Any) -> Forgery:
    answer = copy.deepcopy(answer)
    *parents, last = path
    holder = answer
    for key in parents:
        holder = holder[key]
    holder[last] = value
    return lambda: as_json(answer)


#: Every field of a smoke test's answer, its state's included.
SMOKE_FIELDS = [("passed",), ("gpus_seen",), ("boot_id",), ("failures",), ("failures", 0), ("state",),
                ("state", "node_name"), ("state", "seq"), ("state", "digest"), ("state", "boot_id"),
                ("state", "gpus"), ("state", "reclaim_at"), ("state", "observed_at"),
                ("state", "gpus", 0, "index"), ("state", "gpus", 0, "temperature_c"),
                ("state", "gpus", 0, "xid_events", 0, "at"), ("state", "gpus", 0, "xid_events", 0, "message")]
#: What an attacker sends where a string is expected (the reset's and the reinstall's answer):
#: HOSTILE_VALUES' huge strings are all over the 1,000 characters a node's text may have.
SAID_ATTACKS = HOSTILE_VALUES


def field_name(activity_name: str, path: tuple = ()) -> str:
    return ".".join([f"{activity_name} result", *map(str, path)])


def cases(node: JoinedNode) -> list[tuple[str, Rung, str, Forgery, str]]:
    """(activity, the rung that calls it, what, forgery, the field its bad report must name)."""
    base = smoke(node.node_name, node.gpus)
    out = [
        ("smoke_test", Rung.RESET, '"yes" for passed', replacing(base, ("passed",), "yes"), field_name("smoke_test", ("passed",))),
        ("smoke_test", Rung.RESET, "state.reclaim_at NaN", replacing(base, ("state", "reclaim_at"), math.nan),
         field_name("smoke_test", ("state", "reclaim_at"))),
        ("smoke_test", Rung.RESET, "not JSON", bytes_of(b"{not json"), field_name("smoke_test")),
        ("reset_gpu", Rung.RESET, "an encoding nobody speaks", bytes_of(b"\x00", b"binary/hostile"),
         field_name("reset_gpu")),
        ("reset_gpu", Rung.RESET, "a number", lambda: as_json(42), field_name("reset_gpu")),
        ("reinstall_driver", Rung.REINSTALL, "deep nesting", lambda: as_json(nested(100)), field_name("reinstall_driver")),
    ]
    for path, value in draw(st.tuples(st.sampled_from(SMOKE_FIELDS), HOSTILE_VALUES), EXAMPLES):
        out.append(("smoke_test", Rung.RESET, f"{path} = {str(value)[:40]}", replacing(base, path, value),
                    field_name("smoke_test", path)))
    for name, rung in (("reset_gpu", Rung.RESET), ("reinstall_driver", Rung.REINSTALL)):
        for value in draw(SAID_ATTACKS, EXAMPLES):
            out.append((name, rung, str(value)[:40], lambda v=value: as_json(v), field_name(name)))
    return out


def repair_input(node: JoinedNode, rung: Rung) -> dict[str, Any]:
    """A repair of GPU 0 from ``rung`` that may climb no higher: a rung that fails leaves it
    exhausted (contained, waiting for a person) instead of trying the next one."""
    settings = RepairSettings.model_validate({**copy.deepcopy(REPAIR), "max_rung": rung.value,
                                             "reinstall_via": "agent"})
    return GpuRepairInput(node_name=node.node_name, gpu=0, site=node.site, machine_id=node.machine_id,
                          gpus=node.gpus, rung=rung, reasons=["a forged answer"],
                          settings=settings).model_dump(mode="json")


async def exhausted(handle: WorkflowHandle) -> LadderState | None:
    try:
        ladder = await handle.query("ladder", result_type=LadderState)
    except Exception:  # noqa: BLE001 - its first task not run yet
        return None
    return ladder if ladder.outcome == "exhausted" or ladder.done else None


async def test_malformed_node_results_fail_a_rung_or_a_smoke_test_never_a_workflow_task(hostile) -> None:
    """Property: over every node-facing result a repair acts on (the smoke test that proves it,
    its state included; the reset; the driver reinstall), NaN, infinities, huge strings, wrong
    types and deep nesting in any field fail that rung, naming the field, with no failed
    workflow task; the node's own entity watches on."""
    stack, node, agent = hostile
    run = uuid.uuid4().hex[:6]
    for number, (name, rung, what, forgery, field) in enumerate(cases(node)):
        workflow_id = f"forged/{run}/{number}"
        agent.arm(name, workflow_id, forgery)
        handle = await stack.client.start_workflow("GpuRepair", repair_input(node, rung), id=workflow_id,
                                                   task_queue=stack.settings.task_queue)
        ladder = await eventually(lambda: exhausted(handle), timeout=30)
        assert (name, workflow_id) in agent.answered, f"{what}: the forgery was never asked for"
        (attempt,) = ladder.attempts
        assert attempt.outcome == "failed", f"{name} {what}: {attempt}"
        assert f"bad report from {node.node_name}: {field}" in attempt.detail, f"{name} {what}: {attempt.detail}"
        assert await task_failures(handle) == 0, f"{name} {what}"
        await handle.terminate("forgery judged")

    # The node's entity was never touched, and its watch is alive: a real fault starts its repair.
    entity = stack.client.get_workflow_handle(f"node/{node.node_name}")
    assert await task_failures(entity) == 0
    stack.world.inject_fault(node.machine_id, 1, "xid", 48, clears_on="reset")
    await eventually(lambda: exists(repair_handle(stack, node.node_name, 1)), timeout=30)


async def test_a_malformed_join_smoke_test_fails_the_join_naming_the_field(hostile) -> None:
    """The join's smoke test (with the state the node's entity starts from) is the same untrusted
    answer: a garbled one fails the join as a failed smoke test, naming the field, its machine
    deleted, and no workflow task fails."""
    stack, node, agent = hostile
    attacks = [(("passed",), "yes"), (("state", "reclaim_at"), math.nan), (("failures", 0), "x" * 5000)]
    for path, value in attacks:
        join_id = f"join/{node.site}/forged-{uuid.uuid4().hex[:6]}"
        agent.arm("smoke_test", join_id, replacing(smoke("ignored", node.gpus), path, value))
        handle = await stack.client.start_workflow("NodeJoin", {"site": node.site}, id=join_id,
                                                   task_queue=stack.settings.task_queue)
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), 60)
        cause = failed.value.cause
        assert getattr(cause, "type", "") == "SmokeTestFailed", cause
        assert "bad report from " in cause.message and field_name("smoke_test", path) in cause.message, cause.message
        assert len(cause.message) < 1000
        assert await task_failures(handle) == 0
    # Each failed join deleted its machine: only the node that joined honestly is left.
    assert [m["name"] for m in stack.world.machines(node.site)] == [node.node_name]


async def test_smoke_tests_failing_at_their_models_limits_leave_a_capacity_request_short_answers(hostile) -> None:
    """A well-formed failed smoke test may name 256 failures (of up to 1,000 characters each), as
    many as fit the 64 KiB the node gateway lets a smoke result be (``RESULT_LIMITS``; before it,
    512 KiB). Before, each join repeated them whole in its failure, and AcquireCapacity kept each
    failed join's message in its attempts: six joins failing so (at 512 KiB each) made its result
    about 3 MB, past Temporal's 2 MiB payload limit, and the request could not end. Now a node's
    failures are summarised where its answer is checked (the first few, each cut, and how many
    more), and the request ends with what it tried, in a few kilobytes."""
    from fleet.messages.capacity import CapacityResult
    from workers.gateway.authorization import RESULT_LIMITS

    stack, node, agent = hostile
    failures = [f"GPU {i % 8}: " + "é" * 120 for i in range(256)]
    answer = {**smoke("ignored", node.gpus), "passed": False, "failures": failures}
    forged = json.dumps(answer, ensure_ascii=False).encode()  # what an agent's converter writes
    assert RESULT_LIMITS["smoke_test"] - 4 * 1024 < len(forged) <= RESULT_LIMITS["smoke_test"]
    request = f"verbose-{uuid.uuid4().hex[:6]}"
    joins = [f"join/{node.site}/{request}-{seq}" for seq in range(1, 7)]
    for join_id in joins:
        agent.arm("smoke_test", join_id, bytes_of(forged))
    handle = await stack.client.start_workflow(
        "AcquireCapacity", {"constraints": {"sites": [node.site]}, "count": 6, "concurrency": 6},
        id=f"capacity/{request}", task_queue=stack.settings.task_queue)
    result = CapacityResult.model_validate(await asyncio.wait_for(handle.result(), 120))

    assert not result.complete and len(result.attempts) == 6, result.attempts
    for attempt in result.attempts:
        assert attempt.outcome == "SmokeTestFailed", attempt
        assert f"smoke test failed on {node.site}-" in attempt.message and "GPU 0: éééé" in attempt.message
        assert attempt.message.endswith("; and 251 more") and len(attempt.message) < 1000, attempt.message
    assert len(result.model_dump_json()) < 16 * 1024
    assert await task_failures(handle) == 0
    # A join's own failure: the smoke test's (its cause) says the same in its details.
    with pytest.raises(WorkflowFailureError) as failed:
        await stack.client.get_workflow_handle(joins[0]).result()
    smoke_failure = failed.value.cause.cause
    (details,) = smoke_failure.details
    assert len(smoke_failure.message) < 1000, smoke_failure.message
    assert len(details["failures"]) == 6 and details["failures"][-1] == "and 251 more", details
    assert [m["name"] for m in stack.world.machines(node.site)] == [node.node_name], "each failed join deleted its machine"


async def test_a_node_failing_its_join_smoke_test_does_not_choose_the_joins_failure_type(hostile) -> None:
    """AcquireCapacity decides on a join's failure type: ``BadCredentials`` revokes the provider
    account, ``OverQuota`` blocks the offer, ``InvalidInput``/``InvalidRequest`` end the whole
    request (its other joins cancelled, each deleting its machine). Before, a joining node that
    failed its own smoke test chose that type: ``InvalidInput`` passed the gateway (a type node
    agents raise) and the join failed with it. Now the join fails as ``SmokeTestFailed``, the
    node's words in the message; and the gateway forwards only the types agents raise."""
    from temporalio.exceptions import ApplicationError

    stack, node, agent = hostile
    for kind in ("InvalidInput", "BadCredentials", "InvalidRequest"):
        join_id = f"join/{node.site}/chooses-{kind}-{uuid.uuid4().hex[:6]}"
        agent.arm("smoke_test", join_id,
                  lambda kind=kind: ApplicationError(f"forged {kind}", type=kind, non_retryable=True))
        handle = await stack.client.start_workflow("NodeJoin", {"site": node.site}, id=join_id,
                                                   task_queue=stack.settings.task_queue)
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), 60)
        cause = failed.value.cause
        assert getattr(cause, "type", "") == "SmokeTestFailed", (kind, cause)
        assert f"forged {kind}" in cause.message, cause.message
        assert await task_failures(handle) == 0
    assert [m["name"] for m in stack.world.machines(node.site)] == [node.node_name], "each failed join deleted its machine"


class SlowGpus:
    """A GPU backend whose reset and driver reinstall take ``seconds`` (``nvidia-smi -r`` may take
    minutes on a busy GPU; a reinstall longer)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def reset_gpu(self, index: int) -> str:
        time.sleep(self.seconds)
        return f"GPU {index} reset"

    def reinstall_driver(self) -> str:
        time.sleep(self.seconds)
        return "driver reinstalled"


@pytest.mark.parametrize("action", ["reset_gpu", "reinstall_driver"])
def test_a_long_node_action_heartbeats_within_its_timeout_and_a_short_one_not_at_all(action) -> None:
    """The workflow gives a reset a heartbeat timeout (an agent that died mid-reset is seen within
    it, not after reset_seconds); the agent beats while the action runs, at least twice per timeout
    and at least every 30 s."""
    call = {"reset_gpu": ResetGpuInput(index=0), "reinstall_driver": ReinstallDriverInput()}[action]
    # Counted, not timed: 2 s of action under a 0.4 s heartbeat timeout is ten half-timeouts, nine
    # beats at twice per timeout (six at least on a busy machine); once per timeout would be five
    # at most, and an agent beating less than that is taken for dead.
    for seconds, timeout, least in ((2.0, 0.4, 6), (0.05, 0.4, 0)):
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, heartbeat_timeout=timedelta(seconds=timeout))
        beats: list[float] = []
        env.on_heartbeat = lambda *_details: beats.append(time.monotonic())
        agent = NodeAgentActivities("n", SlowGpus(seconds))
        assert env.run(getattr(agent, action), call)
        assert len(beats) >= least, (seconds, len(beats))
        if not least:
            assert beats == [], "an action that ends within half its timeout costs the server no heartbeat"


async def test_the_reset_is_scheduled_with_a_heartbeat_timeout(hostile) -> None:
    stack, node, _agent = hostile
    handle = await stack.client.start_workflow("GpuRepair", repair_input(node, Rung.RESET),
                                               id=f"reset/{uuid.uuid4().hex[:6]}", task_queue=stack.settings.task_queue)
    await asyncio.wait_for(handle.result(), 30)
    (scheduled,) = [e.activity_task_scheduled_event_attributes for e in (await handle.fetch_history()).events
                    if e.HasField("activity_task_scheduled_event_attributes")
                    and e.activity_task_scheduled_event_attributes.activity_type.name == "reset_gpu"]
    assert scheduled.heartbeat_timeout.ToTimedelta() == timedelta(seconds=REPAIR["timeouts"]["heartbeat_seconds"])
