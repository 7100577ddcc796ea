"""What a node agent knows about its GPUs: NVML for health, CUDA for a compute check.

``GpuBackend`` is implemented by ``NvmlBackend`` (a real node, through
``pynvml`` from nvidia-ml-py and the CUDA driver API via ctypes) and by
``sim.gpu.SimGpuBackend`` (a simulated node with injectable faults).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from fleet.models import GpuHealth, XidEvent


def read_boot_id() -> str:
    """The kernel's boot ID: changes on every boot, proves a reboot happened."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


class ComputeCheckUnavailable(RuntimeError):
    """The compute check could not run on this node: its tooling is missing or broken (libcuda not
    in the agent's image, ``providers.gpu`` not importable by the child, the interpreter not
    starting), or the agent's own limits stopped it before it had an answer (the child killed by
    SIGKILL: the memory limit's OOM kill; the child stuck before it reached the GPU). No verdict
    on any GPU: the smoke test says so (``ComputeCheckUnavailable``), and the control plane
    neither passes the GPU nor repairs it for it.

    ``transient``: it may pass if tried again (a kill, a fork that failed for want of memory, a
    hang before the GPU); otherwise the node's agent needs a person (its image, its config)."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class GpuBackend(Protocol):
    def boot_id(self) -> str: ...

    def probe(self) -> list[GpuHealth]: ...

    def compute_check(self, index: int) -> str | None:
        """None when GPU ``index`` computes correctly, else why not (the GPU's verdict). Raises
        ``ComputeCheckUnavailable`` when the check could not run on this node at all: that says
        nothing about the GPU."""
        ...

    def reset_gpu(self, index: int) -> str:
        """Reset one GPU (``nvidia-smi -r -i N``); raises when it cannot (processes hold it)."""
        ...

    def reinstall_driver(self) -> str:
        """Reinstall the GPU driver on this node; raises when it cannot."""
        ...


class NvmlBackend:
    """A real node's GPUs. XID events are collected by a background waiter on
    ``nvmlEventSetWait`` and reported (then forgotten) by the next probe.

    A driver reinstall (``reinstall_driver``) needs the driver's kernel modules unloaded, which
    NVML prevents while it is initialised (its device files stay open): for the script's run the
    backend lets go of NVML (waiter stopped, event set freed, ``nvmlShutdown``) and takes it up
    again afterwards, whatever the script did."""

    #: How long ``nvmlEventSetWait`` blocks before the waiter looks whether it should stop.
    XID_WAIT_MS = 5000

    def __init__(self, nvml=None) -> None:
        """``nvml``: the pynvml module (default); tests pass a fake with the same calls."""
        if nvml is None:
            import pynvml as nvml

        self.nvml = nvml
        nvml.nvmlInit()
        #: nvmlInit calls this backend made and has not shut down: NVML counts them, and lets go
        #: of the driver only once as many nvmlShutdown calls came.
        self._inits = 1
        #: Called (from the waiter thread) after each XID event is recorded: the report loop
        #: wakes on it instead of waiting for its next interval.
        self.on_xid = None
        self._xids: dict[int, list[XidEvent]] = {}
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._watching = False  # watch_xids was asked for: a reinstall restarts the waiter
        self._stop_watching = threading.Event()
        #: Guards the NVML lifecycle: probes count themselves in (``_probing``) and a reinstall
        #: waits for them to end before NVML is shut down; while ``_reinstalling`` no probe calls NVML.
        self._driver = threading.Condition()
        self._probing = 0
        self._reinstalling = False
        self._last_report: list[GpuHealth] | None = None

    def boot_id(self) -> str:
        return read_boot_id()

    def watch_xids(self) -> None:
        """Start the XID event waiter thread (once)."""
        self._watching = True
        if self._watcher is None:
            self._start_waiter()

    def _start_waiter(self) -> None:
        self._stop_watching.clear()
        self._watcher = threading.Thread(target=self._wait_for_xids, name="nvml-xid", daemon=True)
        self._watcher.start()

    def _stop_waiter(self) -> None:
        """Make the waiter return (at its next wait's timeout at the latest); it frees its event set."""
        watcher = self._watcher
        if watcher is None:
            return
        self._stop_watching.set()
        watcher.join(timeout=self.XID_WAIT_MS / 1000 * 3)
        if watcher.is_alive():
            self._stop_watching.clear()  # it keeps watching: NVML cannot be shut down under it
            raise RuntimeError("driver reinstall not started: the NVML XID waiter did not stop")
        self._watcher = None

    def _wait_for_xids(self) -> None:
        nvml = self.nvml
        events = nvml.nvmlEventSetCreate()
        try:
            # Registered at each start: after a driver reinstall the GPUs' handles are new ones.
            for i in range(nvml.nvmlDeviceGetCount()):
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(i)
                    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
                except nvml.NVMLError:
                    continue  # some GPUs (or vGPUs) do not support XID events
            while not self._stop_watching.is_set():
                try:
                    data = nvml.nvmlEventSetWait(events, self.XID_WAIT_MS)
                except nvml.NVMLError_Timeout:
                    continue
                except nvml.NVMLError:
                    return
                index = nvml.nvmlDeviceGetIndex(data.device)
                with self._lock:
                    self._xids.setdefault(index, []).append(
                        XidEvent(xid=int(data.eventData), at=datetime.now(timezone.utc),
                                 message="nvmlEventTypeXidCriticalError")
                    )
                if self.on_xid is not None:
                    self.on_xid()
        finally:
            try:
                nvml.nvmlEventSetFree(events)  # here, once no wait uses it any more
            except nvml.NVMLError:
                pass

    def probe(self) -> list[GpuHealth]:
        with self._driver:
            if self._reinstalling and self._last_report is not None:
                # NVML is shut down for the driver reinstall: the GPUs as last seen, without XIDs
                # (none are watched now); the reinstall's own smoke test follows it.
                return [gpu.model_copy(update={"xid_events": []}) for gpu in self._last_report]
            self._driver.wait_for(lambda: not self._reinstalling)  # never probed yet: after it
            if not self._inits:  # NVML did not start again after a reinstall: try once more
                self._take_up_nvml()
            self._probing += 1
        try:
            report = self._probe()
        finally:
            with self._driver:
                self._probing -= 1
                self._driver.notify_all()
        self._last_report = report
        return report

    def _probe(self) -> list[GpuHealth]:
        nvml = self.nvml
        report = []
        for i in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(handle)
            except nvml.NVMLError as error:
                lost = getattr(error, "value", None) == nvml.NVML_ERROR_GPU_IS_LOST
                report.append(GpuHealth(index=i, uuid=f"unknown-{i}", lost=lost))
                continue
            health = GpuHealth(index=i, uuid=uuid, name=_optional(nvml.nvmlDeviceGetName, handle) or "")
            memory = _optional(nvml.nvmlDeviceGetMemoryInfo, handle)
            health.memory_gb = round(memory.total / 2**30, 1) if memory else 0
            health.temperature_c = _optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU) or 0
            health.slowdown_temperature_c = (
                _optional(nvml.nvmlDeviceGetTemperatureThreshold, handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN) or 0
            )
            health.ecc_uncorrected = (
                _optional(
                    nvml.nvmlDeviceGetTotalEccErrors, handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
                or 0
            )
            remap = _optional(nvml.nvmlDeviceGetRemappedRows, handle)
            if remap:
                _corr, _unc, pending, failure = remap
                health.remapped_rows_pending, health.remapped_rows_failure = bool(pending), bool(failure)
            health.nvlink_down = sum(
                1
                for link in range(nvml.NVML_NVLINK_MAX_LINKS)
                if _optional(nvml.nvmlDeviceGetNvLinkState, handle, link) == nvml.NVML_FEATURE_DISABLED
            )
            action = _optional(nvml.nvmlDeviceGetFieldValues, handle, [nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
            if action and action[0].nvmlReturn == nvml.NVML_SUCCESS:
                health.recovery_action = int(action[0].value.uiVal)
            retired = _optional(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
            health.retired_pages_pending = bool(retired) and retired == nvml.NVML_FEATURE_ENABLED
            with self._lock:
                health.xid_events = self._xids.pop(i, [])
            report.append(health)
        return report

    def compute_check(self, index: int) -> str | None:
        """``cuda_memory_check`` in a child process of its own (``compute_check_in_child``); raises
        ``ComputeCheckUnavailable`` where the check could not run."""
        return compute_check_in_child(index)

    def reset_gpu(self, index: int) -> str:
        """``nvidia-smi -r -i N``: fails while any process still holds the GPU, an NVML client with
        events registered on it included (this agent's XID waiter), so it runs with the driver let
        go of as the reinstall does (``_driver_let_go``)."""
        import subprocess

        with self._driver_let_go():
            done = subprocess.run(["nvidia-smi", "-r", "-i", str(index)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"GPU {index}: nvidia-smi -r failed: {(done.stderr or done.stdout).strip()}")
        return done.stdout.strip() or f"GPU {index} reset"

    def reinstall_driver(self) -> str:
        """Run the driver reinstall command (``GPUFLEET_DRIVER_REINSTALL_CMD``): as
        deploy/driver-reinstall sets it, the node image's own script in the host's namespaces.

        For the script's run this process holds no NVML: the XID waiter stops (its event set
        freed), NVML is shut down as often as it was initialised, so the script can unload the
        kernel modules; then NVML starts again and the waiter registers every GPU anew (new
        handles), whether the script succeeded or not. XID events while NVML is down are lost
        by design: nothing watches the driver while it is being replaced, and the rung's smoke
        test after it probes the GPUs afresh. Probes meanwhile answer the GPUs as last seen."""
        from fleet.settings import NodeAgentEnv

        command = NodeAgentEnv.get("driver_reinstall_cmd")
        if not command:
            raise RuntimeError("no driver reinstall command configured (GPUFLEET_DRIVER_REINSTALL_CMD): the node "
                               "agent's DaemonSet sets it with deploy/driver-reinstall (Helm: "
                               "nodeAgent.driverReinstall=true)")
        with self._driver_let_go():
            return self._run_reinstall(command)

    @contextlib.contextmanager
    def _driver_let_go(self):
        """This process holds no NVML for the block (a reinstall's script, a reset): the XID
        waiter stops (its event set freed) and NVML is shut down as often as it was initialised;
        after it NVML starts again and the waiter registers every GPU anew, whatever the block
        did. One block at a time; probes meanwhile answer the GPUs as last seen."""
        with self._driver:
            self._driver.wait_for(lambda: not self._reinstalling)  # one at a time
            self._reinstalling = True
            self._driver.wait_for(lambda: self._probing == 0)
        try:
            # XID events from here until the waiter is back are lost, by design: NVML is shut
            # down so the driver can be unloaded or the GPU reset, and the rung's smoke test
            # probes afresh.
            self._stop_waiter()
            try:
                self._let_go_of_nvml()
                yield
            finally:
                self._take_up_nvml()
        finally:
            with self._driver:
                self._reinstalling = False
                self._driver.notify_all()

    def _let_go_of_nvml(self) -> None:
        nvml = self.nvml
        while self._inits:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                self._inits = 0  # NVML says it is not initialised: nothing more to let go of
                break
            self._inits -= 1

    def _take_up_nvml(self) -> None:
        """NVML again (it may fail: a driver the script left broken; the next reinstall or probe
        says so), then the XID waiter, if one was watching."""
        if not self._inits:
            try:
                self.nvml.nvmlInit()
                self._inits = 1
            except self.nvml.NVMLError:
                return
        if self._watching and self._watcher is None:
            self._start_waiter()

    @staticmethod
    def _run_reinstall(command: str) -> str:
        import shlex
        import subprocess

        try:
            done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=3600)
        except OSError as error:  # no such program here: a failed rung, not a retried activity
            raise RuntimeError(f"driver reinstall failed: {error}") from error
        if done.returncode != 0:
            raise RuntimeError(f"driver reinstall failed: {(done.stderr or done.stdout).strip()[-500:]}")
        return "driver reinstalled"


def _optional(call, *args):
    """NVML calls a GPU or driver may not support answer None, not an error."""
    try:
        return call(*args)
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends
        return None


#: How long the compute check's child process may take (64 MiB written and read back: about a second).
COMPUTE_CHECK_SECONDS = 120
#: What the child writes to its stdout, each line this prefix and a JSON object: ``{"stage": "checking"}``
#: once it imported the check and starts it (from there on a hang or a crash is the GPU's, as CUDA
#: runs), then ``{"verdict": "ok" | "gpu" | "unavailable", "said": ...}``.
CHILD_SAYS = "gpufleet-compute-check "
#: The child: the check's module imported (a failure to is the agent image's, never a GPU's),
#: then the check. What the check returns is the GPU's verdict; what it raises is not: GPU faults
#: come back as CUDA error codes, which ``cuda_memory_check`` turns into its answer, so an
#: exception is the check's own tooling (``ComputeCheckUnavailable``: no libcuda) or code (a
#: ctypes symbol missing from a stub libcuda, a MemoryError under the agent's limit).
_CHILD = f"""
import json, sys
def say(**said):
    print({CHILD_SAYS!r} + json.dumps(said), flush=True)
try:
    from providers.gpu import cuda_memory_check
except BaseException as error:
    say(verdict="unavailable", said=f"cannot import the check (providers.gpu): {{type(error).__name__}}: {{error}}")
    sys.exit(0)
say(stage="checking")
try:
    said = cuda_memory_check(int(sys.argv[1]))
except Exception as error:
    name = type(error).__name__
    say(verdict="unavailable", said=str(error) if name == "ComputeCheckUnavailable" else
        f"the check's own code failed: {{name}}: {{error}}")
    sys.exit(0)
say(verdict="gpu" if said else "ok", said=said or "")
"""


def _child_said(output: str | bytes | None) -> tuple[bool, dict | None]:
    """(whether the child reached the check, its verdict if it gave one) from its stdout so far."""
    import json

    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    checking, verdict = False, None
    for line in (output or "").splitlines():
        if not line.startswith(CHILD_SAYS):
            continue
        try:
            said = json.loads(line[len(CHILD_SAYS):])
        except ValueError:
            continue
        if not isinstance(said, dict):
            continue
        checking = checking or said.get("stage") == "checking"
        if said.get("verdict") in ("ok", "gpu", "unavailable"):
            verdict = said
    return checking, verdict


def compute_check_in_child(index: int) -> str | None:
    """``cuda_memory_check(index)`` run by a short-lived child process, its answer read back: None
    (GPU ``index`` computes correctly) or why not. Raises ``ComputeCheckUnavailable`` when the
    child could not run the check: that is the node agent's problem, not the GPU's.

    Not in the agent's own process: CUDA has no shutdown, so a process that once called
    ``cuInit`` keeps the driver's device files open (``/dev/nvidiactl``, ``/dev/nvidia-uvm``) until
    it exits, which would leave the agent holding the driver for good after its first smoke test:
    ``nvidia-smi -r`` (the reset rung) refuses a GPU a process holds, and the reinstall rung's
    script cannot unload the kernel modules (``reinstall_driver`` lets go of NVML for it, which
    is all it can let go of).

    Which is which: the child says when it starts the check (``CHILD_SAYS``). Before that, nothing
    touched a GPU, so a failure there (the interpreter, the imports, a hang, a kill) is the
    agent's. After it, the check's answer is the GPU's verdict; a hang or a crash in it too (CUDA
    stuck on the device, a fault in the driver while it ran), as before, except a SIGKILL: no GPU
    sends one, the agent's memory limit (the OOM killer) does. A failure that every GPU of the
    node would fail the same way must not send them all down the repair ladder."""
    import os
    import signal
    import subprocess
    import sys

    path = os.pathsep.join(entry for entry in sys.path if entry)  # the child imports providers.gpu as this process does
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(index)], capture_output=True, text=True,
                              timeout=COMPUTE_CHECK_SECONDS, env={**os.environ, "PYTHONPATH": path})
    except subprocess.TimeoutExpired as expired:
        checking, _ = _child_said(expired.stdout)
        if checking:  # stuck in CUDA: the GPU's
            return f"GPU {index}: the compute check did not end within {COMPUTE_CHECK_SECONDS} s"
        raise ComputeCheckUnavailable(
            f"the compute check's process did not reach the GPU within {COMPUTE_CHECK_SECONDS} s (its interpreter "
            "or imports hung)", transient=True) from None
    except OSError as error:  # no interpreter at sys.executable, no memory to fork: no child at all
        raise ComputeCheckUnavailable(
            f"the compute check's process could not start ({sys.executable}): {error}",
            transient=not isinstance(error, (FileNotFoundError, PermissionError))) from error
    checking, verdict = _child_said(done.stdout)
    last = (done.stderr.strip().splitlines() or ["no output"])[-1][:500]
    if verdict is not None and verdict["verdict"] == "unavailable":
        raise ComputeCheckUnavailable(str(verdict.get("said") or "the check could not run")[:500])
    if done.returncode == -signal.SIGKILL:
        raise ComputeCheckUnavailable(
            "the compute check's process was killed (SIGKILL: the agent's memory limit, the OOM killer)",
            transient=True)
    if not checking:
        raise ComputeCheckUnavailable(
            f"the compute check's process failed before it reached the GPU (exit {done.returncode}): {last}")
    if done.returncode != 0:  # crashed in CUDA: the GPU's (or its driver's), as it always was
        return f"GPU {index}: the compute check's process failed (exit {done.returncode}): {last}"
    if verdict is None:
        raise ComputeCheckUnavailable(f"the compute check's process ended without a verdict: {last}")
    return str(verdict.get("said") or f"GPU {index}: the compute check failed") if verdict["verdict"] == "gpu" else None


#: ``cuInit``'s answer where the libcuda loaded is the toolkit's stub (``libcuda.so`` in ``lib64/stubs``).
CUDA_ERROR_STUB_LIBRARY = 34


def cuda_memory_check(index: int, words: int = 1 << 24) -> str | None:
    """Allocate 64 MiB on the GPU, have the GPU fill it, read it back, compare.

    Uses the CUDA driver API (libcuda, present wherever the driver is), so the
    agent needs no CUDA toolkit or framework. Note: ordinal ``index`` is CUDA's
    enumeration, which matches NVML's when CUDA_DEVICE_ORDER=PCI_BUS_ID.

    Returns the GPU's verdict (None: it computed right); raises ``ComputeCheckUnavailable`` where
    the check cannot run here (no libcuda, the toolkit's stub): no verdict at all.
    """
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        # Not the GPU's: the driver's user-space library is not in the agent's container (the
        # NVIDIA container toolkit mounts it with the "compute" capability), while NVML, which
        # found the GPUs, works.
        raise ComputeCheckUnavailable(f"libcuda not loadable in the node agent: {error}") from error

    def check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed with CUDA error {result}")

    device, context, buffer = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    pattern = 0x5A5AA5A5
    try:
        if (result := cuda.cuInit(0)) == CUDA_ERROR_STUB_LIBRARY:
            # The CUDA toolkit's stub libcuda, found before the driver's: the image's, not the GPU's.
            raise ComputeCheckUnavailable("libcuda in the node agent is the CUDA toolkit's stub, not the driver's "
                                          "(cuInit: CUDA_ERROR_STUB_LIBRARY)")
        check(result, "cuInit")
        check(cuda.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
        check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
        try:
            check(cuda.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
            check(cuda.cuMemAlloc_v2(ctypes.byref(buffer), ctypes.c_size_t(words * 4)), "cuMemAlloc")
            try:
                check(cuda.cuMemsetD32_v2(buffer, ctypes.c_uint(pattern), ctypes.c_size_t(words)), "cuMemsetD32")
                host = (ctypes.c_uint32 * words)()
                check(cuda.cuMemcpyDtoH_v2(host, buffer, ctypes.c_size_t(words * 4)), "cuMemcpyDtoH")
                bad = sum(1 for value in host[:: 4096] if value != pattern)
                if bad:
                    return f"GPU {index}: {bad} sampled words read back wrong"
            finally:
                cuda.cuMemFree_v2(buffer)
                cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            cuda.cuDevicePrimaryCtxRelease_v2(device)
    except ComputeCheckUnavailable:
        raise  # a RuntimeError too, but no verdict on the GPU: not the handler's below
    except RuntimeError as error:
        return f"GPU {index}: {error}"
    return None
