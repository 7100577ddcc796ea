"""The node agent's compute check tells a GPU's verdict from a check that could not run.

``compute_check_in_child`` runs ``cuda_memory_check`` in a child process. A child that cannot
import its check, cannot start, or is killed by the agent's own limits said nothing about the GPU,
but its failure came back as the GPU's: every GPU of an honest node whose agent image was broken
failed its smoke tests and climbed the repair ladder (reset, reboot, reinstall), the text blaming
the GPUs. Here the child imports a stand-in ``providers.gpu`` put first on its path (the test's
working directory: ``python -c`` puts it before ``PYTHONPATH``), so each case is a real child.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

import providers.gpu as gpu_module
from activities.node_agent import NodeAgentActivities
from fleet.messages.nodes import (
    ContainInput,
    ContainResult,
    NodeFacts,
    NodeFactsInput,
    SmokeTestInput,
    UncontainInput,
    UncontainResult,
)
from fleet.models import GpuHealth
from providers.gpu import ComputeCheckUnavailable, NvmlBackend, compute_check_in_child

pytestmark = pytest.mark.integration  # each check is a process of its own


def the_child_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """The child's ``providers.gpu`` is ``source`` (the agent's own stays this process's)."""
    package = tmp_path / "image" / "providers"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "gpu.py").write_text(source)
    monkeypatch.chdir(package.parent)


def test_a_child_that_cannot_import_its_cuda_module_is_no_verdict_on_the_gpu(tmp_path, monkeypatch) -> None:
    """The agent's image lacks the module the check needs: the child fails at its import, before
    any GPU is touched. Before, "GPU 0: the compute check's process failed (exit 1):
    ModuleNotFoundError" was GPU 0's failure."""
    the_child_imports(tmp_path, monkeypatch, "import cuda_driver_bindings_not_in_this_image\n")
    with pytest.raises(ComputeCheckUnavailable) as raised:
        compute_check_in_child(0)
    said = str(raised.value)
    assert "cannot import the check" in said and "cuda_driver_bindings_not_in_this_image" in said, said
    assert not said.startswith("GPU 0"), said
    assert not raised.value.transient, "a module missing from the image is not there next time either"


def test_the_backend_raises_it_too(tmp_path, monkeypatch) -> None:
    """``NvmlBackend.compute_check``, what the agent calls, says the same."""
    the_child_imports(tmp_path, monkeypatch, "raise ImportError('libcudart.so.12: cannot open shared object file')\n")
    backend = NvmlBackend.__new__(NvmlBackend)  # no NVML needed for the compute check
    with pytest.raises(ComputeCheckUnavailable, match="libcudart.so.12"):
        backend.compute_check(3)


def test_an_interpreter_that_does_not_start_is_no_verdict_on_the_gpu(tmp_path, monkeypatch) -> None:
    """No interpreter where the agent's own was (an image rebuilt under it): no child at all.
    Before, the OSError escaped the smoke test as an unexpected error, retried as any."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python-here"))
    with pytest.raises(ComputeCheckUnavailable, match="could not start"):
        compute_check_in_child(0)


def test_a_child_killed_by_the_agents_limits_is_no_verdict_on_the_gpu(tmp_path, monkeypatch) -> None:
    """SIGKILL is what the agent's memory limit (the OOM killer) sends, never a GPU: retryable,
    not a failure of GPU 1. Before: "GPU 1: the compute check's process failed (exit -9)"."""
    the_child_imports(tmp_path, monkeypatch, (
        "import os, signal\n"
        "def cuda_memory_check(index):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"))
    with pytest.raises(ComputeCheckUnavailable, match="SIGKILL") as raised:
        compute_check_in_child(1)
    assert raised.value.transient


def test_a_child_stuck_before_it_reached_the_gpu_is_no_verdict_on_it(tmp_path, monkeypatch) -> None:
    """The child hung in its imports (a stuck mount in the image): it never reached the GPU."""
    the_child_imports(tmp_path, monkeypatch, "import time\ntime.sleep(600)\n")
    monkeypatch.setattr(gpu_module, "COMPUTE_CHECK_SECONDS", 2)
    with pytest.raises(ComputeCheckUnavailable, match="did not reach the GPU") as raised:
        compute_check_in_child(0)
    assert raised.value.transient


def test_what_the_check_says_of_the_gpu_is_still_its_verdict(tmp_path, monkeypatch) -> None:
    """Once the check ran, its answer is the GPU's: wrong words read back, a CUDA error, a crash
    in CUDA (a fault in the driver as the GPU was used) fail the GPU as they always did."""
    the_child_imports(tmp_path, monkeypatch, (
        "import ctypes, os, signal\n"
        "def cuda_memory_check(index):\n"
        "    if index == 0: return None\n"
        "    if index == 1: return 'GPU 1: 3 sampled words read back wrong'\n"
        "    if index == 2: return 'GPU 2: cuMemAlloc failed with CUDA error 999'\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n"))
    assert compute_check_in_child(0) is None
    assert compute_check_in_child(1) == "GPU 1: 3 sampled words read back wrong"
    assert compute_check_in_child(2) == "GPU 2: cuMemAlloc failed with CUDA error 999"
    crashed = compute_check_in_child(3)
    assert crashed is not None and crashed.startswith("GPU 3: the compute check's process failed (exit -11)"), crashed


def test_no_libcuda_in_the_agent_is_no_verdict_on_the_gpu() -> None:
    """The real check, on a machine whose agent has no libcuda (the container toolkit did not mount
    the driver's library): not GPU 0's failure. Before: "libcuda not loadable: ..." failed GPU 0."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("libcuda loads here: tests/test_gpu_real.py checks the GPUs")
    with pytest.raises(ComputeCheckUnavailable, match="libcuda not loadable"):
        compute_check_in_child(0)


def test_the_toolkits_stub_libcuda_is_no_verdict_on_the_gpu(monkeypatch) -> None:
    """The agent's image finds the CUDA toolkit's stub libcuda before the driver's: ``cuInit``
    answers CUDA_ERROR_STUB_LIBRARY (34). Not GPU 0's failure. Before, the ComputeCheckUnavailable
    raised for it was a RuntimeError caught by the check's own CUDA-error handler: "GPU 0: libcuda
    in the node agent is the CUDA toolkit's stub" failed GPU 0 and sent it down the ladder."""
    calls: list[str] = []

    class StubLibcuda:
        def __init__(self, name: str) -> None:
            assert name == "libcuda.so.1", name

        def cuInit(self, flags: int) -> int:
            calls.append("cuInit")
            return gpu_module.CUDA_ERROR_STUB_LIBRARY

        def __getattr__(self, name: str):
            def called(*args) -> int:
                calls.append(name)
                return 0
            return called

    monkeypatch.setattr(gpu_module.ctypes, "CDLL", StubLibcuda)
    with pytest.raises(ComputeCheckUnavailable, match="CUDA_ERROR_STUB_LIBRARY") as raised:
        gpu_module.cuda_memory_check(0)
    assert not str(raised.value).startswith("GPU 0"), raised.value
    assert not raised.value.transient, "the image finds the stub next time too"
    assert calls == ["cuInit"], calls  # no GPU was touched


class NodeWhoseAgentImageLacksTheCheck:
    """Two clean GPUs as NVML sees them, and the real compute check (its child process)."""

    def __init__(self, *, ecc_on_gpu1: int = 0) -> None:
        self.ecc_on_gpu1 = ecc_on_gpu1

    def boot_id(self) -> str:
        return "boot-1"

    def probe(self) -> list[GpuHealth]:
        return [GpuHealth(index=0, uuid="GPU-0"), GpuHealth(index=1, uuid="GPU-1", ecc_uncorrected=self.ecc_on_gpu1)]

    compute_check = NvmlBackend.compute_check  # compute_check_in_child, as the agent runs it


def test_a_smoke_test_whose_check_cannot_run_fails_no_gpu_and_says_why(tmp_path, monkeypatch) -> None:
    """The smoke test raises ``ComputeCheckUnavailable`` (no failing ``SmokeResult``: no GPU
    failed, nothing for the control plane to repair), naming the node and what is missing; not
    retried, as the image will lack it next time too. Before, the result failed both GPUs."""
    the_child_imports(tmp_path, monkeypatch, "import cuda_driver_bindings_not_in_this_image\n")
    agent = NodeAgentActivities("gpu-node-7", NodeWhoseAgentImageLacksTheCheck())
    with pytest.raises(ApplicationError) as raised:
        ActivityEnvironment().run(agent.smoke_test, SmokeTestInput(expected_gpus=2))
    error = raised.value
    assert error.type == "ComputeCheckUnavailable" and error.non_retryable, error
    assert "cannot run on gpu-node-7" in error.message and "cuda_driver_bindings_not_in_this_image" in error.message
    assert "not its GPUs'" in error.message, error.message
    assert error.details[0]["node"] == "gpu-node-7", error.details


def test_what_nvml_found_still_fails_the_smoke_test(tmp_path, monkeypatch) -> None:
    """NVML's findings are verdicts of their own: GPU 1's ECC errors fail the test, which also
    says the compute check did not run (not that it failed)."""
    the_child_imports(tmp_path, monkeypatch, "import cuda_driver_bindings_not_in_this_image\n")
    agent = NodeAgentActivities("gpu-node-7", NodeWhoseAgentImageLacksTheCheck(ecc_on_gpu1=2))
    result = ActivityEnvironment().run(agent.smoke_test, SmokeTestInput(expected_gpus=2))
    assert not result.passed
    assert result.failures[0] == "GPU 1: 2 uncorrected ECC errors", result.failures
    assert len(result.failures) == 2 and result.failures[1].startswith("the compute check cannot run on gpu-node-7")
    assert result.failures[1].endswith("(not run)"), result.failures


# -- the repair ladder: a proof whose check cannot run ----------------------------------------------
@pytest.fixture
async def rstack(temporal_env, tmp_path):
    from tests.repair_helpers import running_stack

    async for stack in running_stack(temporal_env.client, tmp_path):
        yield stack


def the_agent_cannot_run_its_check(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """From here on the simulated nodes' agents answer as one whose image lacks libcuda, until the
    returned switch's ``broken`` is set false (the image fixed)."""
    from sim.gpu import SimGpuBackend

    switch = {"broken": True}
    checked = SimGpuBackend.compute_check

    def compute_check(self, index: int) -> str | None:
        if switch["broken"]:
            raise ComputeCheckUnavailable("libcuda not loadable in the node agent: libcuda.so.1: cannot open shared "
                                          "object file: No such file or directory")
        return checked(self, index)

    monkeypatch.setattr(SimGpuBackend, "compute_check", compute_check)
    return switch


async def test_a_repair_whose_proof_cannot_run_climbs_no_rung_and_says_why(rstack, monkeypatch) -> None:
    """GPU 0's XID 48 is reset; the reset's proof cannot run: the node's agent has no libcuda.
    Nothing proved the GPU and nothing said it is broken: the ladder stays at its rung, contained
    and held for a person (``FleetState`` needs-person), its hold reason naming the agent's problem;
    no reboot. The image fixed and the ladder released, it proves again and the GPU serves.
    Before, the proof that did not run was a failed one: reset, reboot, reinstall, then exhausted,
    the machine restarted twice for the agent's problem."""
    from fleet import search_attributes as sa
    from fleet.repair_policy import Rung
    from tests.repair_helpers import eventually, join_node, ladder, repair_handle, repair_result
    from tests.replay import replay_and_record

    stack = rstack
    node = await join_node(stack)
    switch = the_agent_cannot_run_its_check(monkeypatch)
    stack.world.inject_fault(node.machine_id, 0, "xid", 48, clears_on="reset")
    handle = repair_handle(stack, node.node_name, 0)

    async def held_unproven():
        state = await ladder(stack, node.node_name, 0)
        return state if state is not None and state.held and state.step == "held" else None

    state = await eventually(held_unproven, timeout=60)
    assert [(a.rung, a.outcome) for a in state.attempts] == [(Rung.RESET, "running")], state.attempts
    assert "ComputeCheckUnavailable" in state.attempts[0].detail, state.attempts[0].detail
    assert "libcuda not loadable in the node agent" in state.hold_reason, state.hold_reason
    assert "neither proven nor failed" in state.hold_reason and "release" in state.hold_reason, state.hold_reason
    assert (await handle.describe()).typed_search_attributes.get(sa.FLEET_STATE) == "needs-person"
    machine = stack.world.machine(node.machine_id)
    assert (machine["reboots"], machine["reinstalls"]) == (0, 0), "no machine restarted for the agent's problem"
    assert stack.cluster.get_node(node.node_name).unschedulable, "nothing proved the GPU: it stays contained"

    switch["broken"] = False  # the agent's image fixed
    await handle.execute_update("release", {"reason": "agent image fixed"})
    result = await repair_result(stack, node.node_name, 0)
    assert result.outcome == "repaired", result
    assert [(a.rung, a.outcome) for a in result.attempts] == [(Rung.RESET, "passed")], result.attempts
    assert result.attempts[0].detail.endswith("smoke test passed"), result.attempts[0].detail
    machine = stack.world.machine(node.machine_id)
    assert (machine["reboots"], machine["reinstalls"]) == (0, 0)
    await replay_and_record(handle, "gpu_repair_held_when_the_check_cannot_run")


async def test_a_join_whose_check_cannot_run_is_not_admitted_and_says_why(rstack, monkeypatch) -> None:
    """The join's proof: a node whose agent cannot run its check proved nothing, so it is not
    admitted (its machine deleted, as for a failed test), and the join's failure names the agent's
    problem, not a GPU. One try: the agent says its image lacks libcuda, which no retry fixes."""
    from temporalio.client import WorkflowFailureError

    stack = rstack
    the_agent_cannot_run_its_check(monkeypatch)
    handle = await stack.start_join({"site": "site-a"})
    with pytest.raises(WorkflowFailureError) as failed:
        await handle.result()
    error = failed.value.cause
    assert isinstance(error, ApplicationError) and error.type == "SmokeTestFailed", error
    assert "smoke test did not run on " in error.message and "smoke test failed" not in error.message, error.message
    assert "ComputeCheckUnavailable" in error.message and "libcuda not loadable in the node agent" in error.message
    assert stack.world.machines("site-a") == [], "nothing proved the node: its machine is deleted"
    history = await handle.fetch_history()
    scheduled = {e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                 if e.HasField("activity_task_scheduled_event_attributes")}
    attempts = [e.activity_task_started_event_attributes.attempt for e in history.events
                if e.HasField("activity_task_started_event_attributes")
                and scheduled[e.activity_task_started_event_attributes.scheduled_event_id] == "smoke_test"]
    assert attempts == [1], attempts  # not retried


# -- the repair ladder: a proof that could not run for a reason that passes (time-skipping server) --
class NodeWhoseCheckIsKilled:
    """Two clean GPUs; GPU 0's compute check's child killed by the agent's memory limit (the OOM
    killer: transient) for its first ``killed`` checks, then it runs and passes."""

    def __init__(self, killed: int) -> None:
        self.killed, self.checks, self.resets = killed, 0, 0

    def boot_id(self) -> str:
        return "boot-1"

    def probe(self) -> list[GpuHealth]:
        return [GpuHealth(index=0, uuid="GPU-0"), GpuHealth(index=1, uuid="GPU-1")]

    def compute_check(self, index: int) -> str | None:
        self.checks += 1
        if self.checks <= self.killed:
            raise ComputeCheckUnavailable("the compute check's process was killed (SIGKILL: the agent's memory "
                                          "limit, the OOM killer)", transient=True)
        return None

    def reset_gpu(self, index: int) -> str:
        self.resets += 1
        return f"GPU {index} reset"


def control_plane_activities():
    """The repair's own activities, answered as for a node the cluster knows (two GPUs at site-a)."""
    @activity.defn(name="node_facts")
    async def node_facts(input: NodeFactsInput) -> NodeFacts:
        return NodeFacts(node_name=input.node_name, found=True, site="site-a", gpus=2, boot_id="boot-1")

    @activity.defn(name="contain_gpu")
    async def contain_gpu(input: ContainInput) -> ContainResult:
        return ContainResult()

    @activity.defn(name="uncontain_gpu")
    async def uncontain_gpu(input: UncontainInput) -> UncontainResult:
        return UncontainResult(uncordoned=True)

    return [node_facts, contain_gpu, uncontain_gpu]


@pytest.fixture
async def ladder_of(time_skipping_env):
    """``ladder_of(node)``: a GpuRepair of GPU 0 at the reset rung, on the time-skipping server, its
    proof run by the real node agent's smoke test on ``node``'s backend; yields its handle."""
    import uuid
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import AsyncExitStack

    from temporalio.worker import Worker

    from fleet.naming import node_queue, repair_workflow_id
    from workers.control_plane import worker_interceptors
    from workers.workflow_runner import workflow_runner
    from workflows.repair import GpuRepair

    client = time_skipping_env.client
    async with AsyncExitStack() as workers:
        async def start(node):
            name = f"gpu-node-{uuid.uuid4().hex[:6]}"
            queue = f"repair-{uuid.uuid4().hex[:6]}"
            agent = NodeAgentActivities(name, node)
            await workers.enter_async_context(Worker(
                client, task_queue=queue, workflows=[GpuRepair], activities=control_plane_activities(),
                interceptors=worker_interceptors(), workflow_runner=workflow_runner(client.data_converter)))
            await workers.enter_async_context(Worker(
                client, task_queue=node_queue(name), activities=[agent.smoke_test, agent.reset_gpu],
                activity_executor=ThreadPoolExecutor(max_workers=2)))
            return await client.start_workflow(
                "GpuRepair", {"node_name": name, "gpu": 0, "site": "site-a", "gpus": 2, "rung": "reset",
                              "reasons": ["XID 48 on GPU 0"]},
                id=repair_workflow_id(name, 0), task_queue=queue)

        yield start


async def fleet_states(handle) -> list[str]:
    """Every ``FleetState`` the run set, in order."""
    import json

    events = (await handle.fetch_history()).events
    return [json.loads(e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields["FleetState"].data)
            for e in events if e.HasField("upsert_workflow_search_attributes_event_attributes")
            and "FleetState" in e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields]


async def timers(handle) -> list[float]:
    events = (await handle.fetch_history()).events
    return [e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta().total_seconds()
            for e in events if e.HasField("timer_started_event_attributes")]


async def test_a_proof_that_could_not_run_once_for_a_transient_reason_is_tried_again_without_a_person(
        ladder_of) -> None:
    """The reset's proof meets an agent whose check's child the OOM killer took, every try of the
    activity's retry policy (three): transient, the agent says. A minute later the ladder proves
    again by itself; the check runs and passes: repaired, at the reset rung, no person asked, no
    rung climbed. Before, it held for a person (FleetState needs-person) until one came."""
    from fleet.messages.repair import GpuRepairResult
    from fleet.repair_policy import Rung
    from tests.repair_helpers import eventually
    from tests.replay import replay_and_record

    node = NodeWhoseCheckIsKilled(killed=3)
    handle = await ladder_of(node)
    ended = asyncio.ensure_future(handle.result())  # awaiting it lets the server skip the pause

    async def ended_or_held():
        if ended.done():
            return True
        state = await handle.query("ladder")
        return state if state["held"] else None

    settled = await eventually(ended_or_held, timeout=60)
    assert settled is True, f"held for a person: {settled['hold_reason']}"
    result = GpuRepairResult.model_validate(ended.result())
    assert result.outcome == "repaired", result
    assert [(a.rung, a.outcome) for a in result.attempts] == [(Rung.RESET, "passed")], result.attempts
    assert result.attempts[0].detail.endswith("smoke test passed"), result.attempts[0].detail
    assert node.resets == 1 and node.checks == 4, (node.resets, node.checks)
    assert "needs-person" not in await fleet_states(handle)
    assert await timers(handle) == [60]
    await replay_and_record(handle, "gpu_repair_proves_again_after_a_transient_check")


async def test_a_proof_that_stays_unable_to_run_is_tried_again_four_times_then_held_for_a_person(
        ladder_of, time_skipping_env) -> None:
    """The agent's check is killed every time: the ladder proves again after 1, 2, 4 and 8 minutes,
    its details saying each time that it is transient, why, and when it proves again; then it holds
    for a person (needs-person) as a check that cannot run at all does, still at the reset rung. A
    person's release, the agent fixed, proves it again and it passes."""
    import re
    from datetime import timedelta

    from fleet.messages.repair import GpuRepairResult
    from fleet.repair_policy import Rung
    from tests.repair_helpers import eventually
    from tests.replay import replay_and_record

    node = NodeWhoseCheckIsKilled(killed=10**6)
    handle = await ladder_of(node)
    said = []
    for tried, pause in enumerate([60, 120, 240, 480], start=1):
        async def waiting(tried=tried):
            state = await handle.query("ladder")
            assert not state["held"], f"held before it tried again {tried} times: {state['hold_reason']}"
            return state if f"({tried} of 4)" in state["waiting_for"] else None

        state = await eventually(waiting, timeout=60)
        assert state["step"] == "waiting to prove again", state
        assert state["waiting_for"].startswith("the node agent's check could not run (transient: "), state["waiting_for"]
        assert "SIGKILL" in state["waiting_for"], state["waiting_for"]
        assert re.search(r"; proving again at \d\d:\d\d:\d\d UTC \(\d of 4\)$", state["waiting_for"]), state["waiting_for"]
        said.append(state["waiting_for"])
        await time_skipping_env.sleep(timedelta(seconds=pause + 1))

    async def held():
        state = await handle.query("ladder")
        return state if state["held"] and state["step"] == "held" else None

    state = await eventually(held, timeout=60)
    assert "transient" in state["hold_reason"] and "proved again 4 times" in state["hold_reason"], state["hold_reason"]
    assert "release" in state["hold_reason"], state["hold_reason"]
    assert [(a["rung"], a["outcome"]) for a in state["attempts"]] == [("reset", "running")], state["attempts"]
    assert node.resets == 1 and node.checks == 15, (node.resets, node.checks)  # five proofs of three tries
    assert (await fleet_states(handle))[-1] == "needs-person"
    assert await timers(handle) == [60, 120, 240, 480]
    # Each "proving again at" was when its pause ended, by the workflow's clock.
    events = (await handle.fetch_history()).events
    ends = [(e.event_time.ToDatetime() + e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta())
            for e in events if e.HasField("timer_started_event_attributes")]
    for text, end in zip(said, ends):
        hh, mm, ss = map(int, re.search(r"at (\d\d):(\d\d):(\d\d) UTC", text).groups())
        gap = abs((hh * 3600 + mm * 60 + ss) - (end.hour * 3600 + end.minute * 60 + end.second)) % 86400
        assert min(gap, 86400 - gap) <= 2, (text, end)

    node.killed = 0  # the agent's limit raised
    await handle.execute_update("release", {"reason": "agent memory limit raised"})
    result = GpuRepairResult.model_validate(await handle.result())
    assert result.outcome == "repaired" and [(a.rung, a.outcome) for a in result.attempts] == [(Rung.RESET, "passed")]
    assert node.resets == 1
    await replay_and_record(handle, "gpu_repair_proves_again_after_a_transient_check_then_held")


def test_what_a_node_says_is_transient_is_read_safely_and_otherwise_not_transient() -> None:
    """The node is untrusted: its failure is transient only where it is retryable and its details,
    where they came through (the node gateway drops them), are the agent's own; any other shape is
    not transient (a person is asked at once), and none raises."""
    from workflows.repair import CHECK_UNAVAILABLE, cannot_run

    def said(*details, non_retryable=False, type=CHECK_UNAVAILABLE):
        return cannot_run(ApplicationError("the compute check's process was killed (SIGKILL)", *details, type=type,
                                           non_retryable=non_retryable))

    assert said({"node": "n", "problem": "killed (SIGKILL)", "transient": True}).transient
    assert said({"problem": "killed (SIGKILL)", "transient": True}).why == "killed (SIGKILL)"
    assert said().transient, "the gateway forwards the type and the flag, not the details"
    assert not said(non_retryable=True).transient
    assert not said({"transient": True}, non_retryable=True).transient
    for bad in ({"transient": "yes"}, {"transient": 1}, {}, ["transient"], "transient", None, 42):
        assert not said(bad).transient, bad
    assert said({"problem": 7, "transient": True}).why.startswith("the compute check's process was killed")
    assert said({"transient": True}, type="NodeError") is None
