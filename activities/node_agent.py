"""Node-local activities, run by the node agent on task queue ``node/<name>``."""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.waiting import Liveness
from activities.models import (
    GpuProbeResult,
    ProbeGpusInput,
    ReinstallDriverInput,
    ResetGpuInput,
    SmokeResult,
    SmokeTestInput,
)
from providers.gpu import GpuBackend


class NodeAgentActivities:
    def __init__(self, node_name: str, gpus: GpuBackend) -> None:
        self.node_name = node_name
        self.gpus = gpus
        #: Reset key -> what the reset said: a retried reset of the same repair attempt
        #: (the reply was lost, the activity timed out) answers again without resetting.
        #: Kept for the agent's life; an agent restarted mid-repair resets once more at
        #: most, which the ladder tolerates (a reset of a healthy GPU is harmless).
        self._resets: dict[str, str] = {}

    def all(self) -> list:
        return [self.probe_gpus, self.smoke_test, self.reset_gpu, self.reinstall_driver]

    @activity.defn
    def probe_gpus(self, input: ProbeGpusInput) -> GpuProbeResult:
        return GpuProbeResult(node_name=self.node_name, boot_id=self.gpus.boot_id(), gpus=self.gpus.probe())

    @activity.defn
    def smoke_test(self, input: SmokeTestInput) -> SmokeResult:
        """All GPUs visible, clean counters, and each GPU computes correctly."""
        liveness = Liveness()
        gpus = self.gpus.probe()
        failures = []
        if len(gpus) != input.expected_gpus:
            failures.append(f"{len(gpus)} of {input.expected_gpus} GPUs visible")
        for gpu in gpus:
            if input.only_gpus is not None and gpu.index not in input.only_gpus:
                continue
            failures += [f"GPU {gpu.index}: {problem}" for problem in gpu.problems()]
            liveness.beat(gpu.index)
            if not gpu.lost and (problem := self.gpus.compute_check(gpu.index)):
                failures.append(problem)
        return SmokeResult(passed=not failures, gpus_seen=len(gpus), boot_id=self.gpus.boot_id(), failures=failures)

    @activity.defn
    def reset_gpu(self, input: ResetGpuInput) -> str:
        """``nvidia-smi -r -i N``. Refused while processes still hold the GPU: that is
        not retried here (the workflow decides: the rung failed)."""
        key = f"{input.key}/gpu{input.index}" if input.key else ""
        if key and key in self._resets:
            return self._resets[key]
        try:
            said = self.gpus.reset_gpu(input.index)
        except RuntimeError as error:
            raise ApplicationError(str(error), type="GpuResetFailed", non_retryable=True) from error
        if key:
            self._resets[key] = said
        return said

    @activity.defn
    def reinstall_driver(self, input: ReinstallDriverInput) -> str:
        try:
            return self.gpus.reinstall_driver()
        except RuntimeError as error:
            raise ApplicationError(str(error), type="DriverReinstallFailed", non_retryable=True) from error
