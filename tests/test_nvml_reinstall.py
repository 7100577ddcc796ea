"""The node agent lets go of the driver for the driver reinstall (``reinstall_via: agent``): the
node image's script must be able to unload the NVIDIA kernel modules, which it cannot while the
agent keeps NVML initialised or its XID waiter registered on the GPUs ("Module nvidia is in use").

A fake NVML library (refcounted like the real one: the driver is let go of only once every
nvmlInit has its nvmlShutdown) and the real ``NvmlBackend`` with its XID waiter; the script is a
shell script that writes to the same log as the fake library, so the log is the order of what
happened. The script waits for the test to let it finish, so a probe can be made meanwhile.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from providers.gpu import ComputeCheckUnavailable, NvmlBackend

pytestmark = pytest.mark.integration  # the script is a process of its own

#: A guard against a hang only: how long the test waits for the reinstall's script to start.
HANG_GUARD_SECONDS = 60

#: The stand-in for the node image's script: says so in the log, then waits for the test's go.
SCRIPT = """#!/bin/sh
echo "script" >> {log}
i=0
while [ ! -e {go} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i + 1)); done
echo "script done" >> {log}
exit {code}
"""


class FakeNvml:
    """The slice of pynvml NvmlBackend calls. Every call but the waiter's waits is logged (to
    the file the script writes too); a call while NVML is not initialised is an error logged as
    such, as the real library answers NVML_ERROR_UNINITIALIZED. Handles and event sets carry the
    generation of the nvmlInit that made them: after a reinstall the old ones are stale."""

    class NVMLError(Exception):
        pass

    class NVMLError_Timeout(NVMLError):
        pass

    class NVMLError_Uninitialized(NVMLError):
        pass

    NVML_NVLINK_MAX_LINKS = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, log: Path) -> None:
        self.log = log
        self.refcount = 0
        self.generation = 0
        self.waiting = 0  # waits in progress
        self.problems: list[str] = []
        self._mutex = threading.Lock()
        self._pending: list[tuple[int, int]] = []  # (gpu, xid) waiting for the next nvmlEventSetWait

    def _write(self, line: str) -> None:
        with self._mutex, self.log.open("a") as out:
            out.write(line + "\n")

    def _needs_init(self, name: str) -> None:
        if self.refcount == 0:
            self.problems.append(f"{name} while NVML is shut down")
            raise self.NVMLError_Uninitialized(name)

    def __getattr__(self, name: str):
        if name.startswith("NVML_"):
            return 0
        if name.startswith("nvml"):  # a query this fake does not answer: "not supported"
            def unsupported(*_args):
                self._write(name)
                self._needs_init(name)
                raise self.NVMLError(f"{name}: not supported")
            return unsupported
        raise AttributeError(name)

    def nvmlInit(self) -> None:
        self.refcount += 1
        if self.refcount == 1:
            self.generation += 1
        self._write(f"nvmlInit refcount={self.refcount}")

    def nvmlShutdown(self) -> None:
        self._write(f"nvmlShutdown waits={self.waiting}")
        self._needs_init("nvmlShutdown")
        if self.waiting:
            self.problems.append("nvmlShutdown while the XID waiter waits")
        self.refcount -= 1
        self._write(f"refcount={self.refcount}")

    def nvmlDeviceGetCount(self) -> int:
        self._write("nvmlDeviceGetCount")
        self._needs_init("nvmlDeviceGetCount")
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int):
        self._write(f"nvmlDeviceGetHandleByIndex {index}")
        self._needs_init("nvmlDeviceGetHandleByIndex")
        return SimpleNamespace(index=index, generation=self.generation)

    def nvmlDeviceGetUUID(self, handle) -> str:
        self._write("nvmlDeviceGetUUID")
        self._needs_init("nvmlDeviceGetUUID")
        return f"GPU-fake-{handle.index}"

    def nvmlDeviceGetIndex(self, handle) -> int:
        return handle.index

    def nvmlEventSetCreate(self):
        self._needs_init("nvmlEventSetCreate")
        events = SimpleNamespace(generation=self.generation, freed=False)
        self._write(f"nvmlEventSetCreate generation={events.generation}")
        return events

    def nvmlDeviceRegisterEvents(self, handle, event_types, events) -> None:
        self._write(f"nvmlDeviceRegisterEvents gpu={handle.index} generation={handle.generation}")
        self._needs_init("nvmlDeviceRegisterEvents")
        if handle.generation != self.generation or events.generation != self.generation:
            self.problems.append("events registered with a handle or set from before nvmlShutdown")

    def nvmlEventSetFree(self, events) -> None:
        self._write(f"nvmlEventSetFree generation={events.generation}")
        self._needs_init("nvmlEventSetFree")
        events.freed = True

    def nvmlEventSetWait(self, events, timeout_ms: int):
        if events.freed:
            self.problems.append("nvmlEventSetWait on a freed event set")
        self._needs_init("nvmlEventSetWait")
        self.waiting += 1
        try:
            time.sleep(min(timeout_ms, 20) / 1000)
            with self._mutex:
                if self._pending:
                    gpu, xid = self._pending.pop(0)
                    return SimpleNamespace(device=SimpleNamespace(index=gpu), eventData=xid)
            raise self.NVMLError_Timeout()
        finally:
            self.waiting -= 1

    def xid(self, gpu: int, xid: int) -> None:
        with self._mutex:
            self._pending.append((gpu, xid))


def lines(log: Path) -> list[str]:
    return log.read_text().splitlines()


def lifecycle(log: Path) -> list[str]:
    """The log's NVML lifecycle and script lines (not the probes' queries)."""
    keep = ("nvmlInit", "nvmlShutdown", "refcount=", "nvmlEventSet", "nvmlDeviceRegisterEvents", "script")
    return [line for line in lines(log) if line.startswith(keep)]


def wait_for_line(log: Path, line: str, writer: threading.Thread | None = None) -> None:
    deadline = time.monotonic() + HANG_GUARD_SECONDS
    while line not in lines(log):
        assert time.monotonic() < deadline, f"no {line!r} in the log: {lines(log)}"
        assert writer is None or writer.is_alive() or line in lines(log), f"no {line!r} in the log: {lines(log)}"
        time.sleep(0.02)


@pytest.fixture
def agent(tmp_path: Path):
    """A backend as the node agent starts it (NVML up, the XID waiter registered on both GPUs),
    probed once, with its log."""
    log = tmp_path / "log"
    log.touch()
    nvml = FakeNvml(log)
    backend = NvmlBackend(nvml)
    backend.watch_xids()
    wait_for_line(log, "nvmlDeviceRegisterEvents gpu=1 generation=1")
    assert [gpu.uuid for gpu in backend.probe()] == ["GPU-fake-0", "GPU-fake-1"]
    yield SimpleNamespace(nvml=nvml, backend=backend, log=log, go=tmp_path / "go")
    # The waiter stopped: left, it would poll the fake library for the rest of the session.
    backend._stop_waiter()


def reinstall_with(monkeypatch: pytest.MonkeyPatch, agent, code: int) -> dict:
    """Start the backend's reinstall with a script exiting ``code``; once the script runs, probe;
    then let the script end. What the reinstall and the probe answered, and the log by then."""
    script = agent.log.parent / "reinstall.sh"
    script.write_text(SCRIPT.format(log=agent.log, go=agent.go, code=code))
    monkeypatch.setenv("GPUFLEET_DRIVER_REINSTALL_CMD", f"sh {script}")
    return while_the_script_runs(agent, agent.backend.reinstall_driver)


def while_the_script_runs(agent, call) -> dict:
    """``call()`` in a thread of its own; once its script runs, a probe; then the script let end."""
    answer: dict = {}

    def reinstall() -> None:
        try:
            answer["said"] = call()
        except RuntimeError as error:
            answer["error"] = str(error)

    running = threading.Thread(target=reinstall)
    running.start()
    try:
        wait_for_line(agent.log, "script", running)
        before = len(lines(agent.log))
        answer["probed"] = agent.backend.probe()
        answer["probe_calls"] = lines(agent.log)[before:]
    finally:
        agent.go.touch()
        running.join(HANG_GUARD_SECONDS)
    assert not running.is_alive()
    return answer


def assert_let_go_then_taken_up(agent) -> None:
    """The waiter stopped and its set freed, NVML shut down to refcount 0, and only then the
    script; after it NVML up again and the waiter registered on every GPU with new handles."""
    steps = lifecycle(agent.log)
    let_go = ["nvmlEventSetFree generation=1", "nvmlShutdown waits=0", "refcount=0", "script"]
    assert "nvmlEventSetFree generation=1" in steps and steps[steps.index(let_go[0]):][:4] == let_go, (
        f"the script ran with NVML held: {steps}")
    wait_for_line(agent.log, "nvmlDeviceRegisterEvents gpu=1 generation=2")  # the waiter's thread registers
    steps = lifecycle(agent.log)
    assert steps[steps.index(let_go[0]):] == [
        "nvmlEventSetFree generation=1",  # the waiter returned, then freed its set
        "nvmlShutdown waits=0",  # as many shutdowns as inits: NVML lets go of the driver
        "refcount=0",
        "script",
        "script done",
        "nvmlInit refcount=1",
        "nvmlEventSetCreate generation=2",
        "nvmlDeviceRegisterEvents gpu=0 generation=2",
        "nvmlDeviceRegisterEvents gpu=1 generation=2",
    ], steps
    assert agent.nvml.problems == []


def test_the_agent_lets_go_of_nvml_while_the_reinstall_script_runs(monkeypatch: pytest.MonkeyPatch, agent) -> None:
    answer = reinstall_with(monkeypatch, agent, code=0)
    assert answer.get("said") == "driver reinstalled", answer
    assert_let_go_then_taken_up(agent)
    # A probe while the script ran did not call NVML: it answered the GPUs as last seen.
    assert answer["probe_calls"] == []
    assert [gpu.uuid for gpu in answer["probed"]] == ["GPU-fake-0", "GPU-fake-1"]
    # The waiter watches again: an XID after the reinstall is reported.
    agent.nvml.xid(1, 79)
    deadline = time.monotonic() + HANG_GUARD_SECONDS
    while not (seen := [e.xid for gpu in agent.backend.probe() for e in gpu.xid_events]):
        assert time.monotonic() < deadline, "the XID after the reinstall was not reported"
        time.sleep(0.02)
    assert seen == [79]
    assert agent.nvml.problems == []


def test_a_failed_script_still_gets_nvml_and_the_waiter_back(monkeypatch: pytest.MonkeyPatch, agent) -> None:
    answer = reinstall_with(monkeypatch, agent, code=3)
    assert answer.get("error", "").startswith("driver reinstall failed"), answer
    assert_let_go_then_taken_up(agent)
    assert answer["probe_calls"] == []
    # NVML answers probes again.
    assert [gpu.uuid for gpu in agent.backend.probe()] == ["GPU-fake-0", "GPU-fake-1"]
    assert agent.nvml.problems == []


def test_the_agent_lets_go_of_nvml_while_it_resets_a_gpu(monkeypatch: pytest.MonkeyPatch, agent) -> None:
    """``nvidia-smi -r`` refuses a GPU any process holds, an NVML client with events registered on
    it included: the agent's own XID waiter. The reset rung ran it with the waiter registered on
    every GPU; it now lets go of NVML for it as the reinstall does, and takes it up after."""
    smi = agent.log.parent / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(SCRIPT.format(log=agent.log, go=agent.go, code=0))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    answer = while_the_script_runs(agent, lambda: agent.backend.reset_gpu(1))
    assert answer.get("said") == "GPU 1 reset", answer
    assert_let_go_then_taken_up(agent)
    assert answer["probe_calls"] == []


def test_the_compute_check_runs_in_a_process_of_its_own(monkeypatch) -> None:
    """CUDA has no shutdown: a process that called ``cuInit`` holds the driver's device files until
    it exits. The agent's compute check (every smoke test) ran CUDA in the agent itself, so after
    its first one the agent held the driver for good: the reset rung's ``nvidia-smi -r`` and the
    reinstall script's module unload found the GPU in use. Here no libcuda loads in this process
    (it fails the test if tried); the child loads its own (none on this machine: it says so)."""
    import ctypes

    def not_here(name, *args, **kwargs):
        raise AssertionError(f"{name} loaded in the agent's own process")

    monkeypatch.setattr(ctypes, "CDLL", not_here)
    backend = NvmlBackend.__new__(NvmlBackend)  # no NVML needed for the compute check
    try:
        answer = backend.compute_check(0)  # the old in-process check raised here
    except ComputeCheckUnavailable as error:
        # Its child's answer where the machine has no libcuda (tests/test_compute_check.py): the child
        # ran the check, which found no libcuda; one that could not run it (no providers.gpu to import)
        # would say so instead.
        assert str(error).startswith("libcuda not loadable"), error
        return
    # On a GPU machine GPU 0's own (None where it computes).
    assert answer is None or answer.startswith("GPU 0: "), answer
    assert answer is None or "the compute check's process failed" not in answer, answer
