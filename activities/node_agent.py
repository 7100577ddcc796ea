"""Node-local activities, run by the node agent on task queue ``node/<name>``.

``watch_node`` is how the control plane learns a node's health and spot notices: the
Node entity schedules it on the node's own queue and the agent answers with the node's
whole state when it changed. The agent never starts or signals a workflow, so what a
node says arrives only as the result of a task on its own queue (the node gateway lets
it poll nothing else).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.waiting import Liveness
from fleet.messages.nodes import (
    GpuProbeResult,
    ProbeGpusInput,
    ReinstallDriverInput,
    ResetGpuInput,
    SmokeResult,
    SmokeTestInput,
)
from fleet.messages.repair import NodeWatchInput, NodeWatchResult
from fleet.repair_policy import fingerprint
from providers.gpu import ComputeCheckUnavailable, GpuBackend

#: Spot-notice source: the termination time (epoch seconds), or None without a notice.
Notice = Callable[[], "float | None"]


@dataclass
class NodeState:
    digest: str
    boot_id: str
    gpus: list
    reclaim_at: float | None


#: XID events a watch keeps per GPU until the entity has them.
MAX_XIDS = 64
#: The watch heartbeats once per this share of its heartbeat timeout, the first after it too
#: (see ``watch_node``): every heartbeat is a billed action and a write on the server.
WATCH_FIRST_HEARTBEAT_SHARE = 0.5


#: A node action that may take minutes (a GPU reset, a driver reinstall) heartbeats at least this
#: often while it runs, and twice per heartbeat timeout where that is shorter: the workflow sets a
#: heartbeat timeout, so an agent that died mid-action is seen within it, not after the whole
#: action's timeout. One that ends sooner sends none (the SDK also throttles what reaches the server).
ACTION_BEAT_SECONDS = 30.0


def _while_beating(action: Callable[[], str]) -> str:
    """``action()`` in a thread of its own, heartbeating from the activity's thread until it ends."""
    timeout = activity.info().heartbeat_timeout
    every = min(ACTION_BEAT_SECONDS, timeout.total_seconds() / 2) if timeout else ACTION_BEAT_SECONDS
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="node-action") as pool:
        running = pool.submit(action)
        while True:
            try:
                return running.result(timeout=every)
            except FutureTimeout:
                activity.heartbeat()


def _xid_key(index: int, event) -> str:
    return f"{index}:{event.xid}:{event.at.timestamp():.6f}"


class NodeWatch:
    """The node's own view, probed on demand: GPU health (``fleet.repair_policy.fingerprint``
    decides what counts as a change) and the provider's spot notice, if any."""

    def __init__(self, gpus: GpuBackend, notice: Notice | None = None, interval_s: float = 5.0) -> None:
        self.gpus = gpus
        self.notice = notice
        #: Probe this often while waiting (0: only when woken and at the watch's end).
        self.interval_s = interval_s
        #: The node's clock: each result says when it was observed (stale after an outage in flight).
        self.clock = time.time
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken: asyncio.Event | None = None
        # A backend reports an XID event once (NVML's queue is drained by the probe): the watch keeps
        # each one until the entity has it (its next watch names the digest that carried it), so a
        # result lost with a retried activity or a continue-as-new loses no XID.
        self._xids: dict[int, list] = {}
        self._acked: set[str] = set()
        self._delivered: dict[str, list[str]] = {}  # digest returned → the XID keys it carried

    def wake(self) -> None:
        """Probe now (an XID event, a world change in the sim); callable from any thread."""
        loop, woken = self._loop, self._woken
        if loop is not None and woken is not None:
            loop.call_soon_threadsafe(woken.set)

    def arm(self) -> None:
        """Before a probe: a wake-up from here on is not lost (the next wait returns at once)."""
        if self._woken is None:
            self._loop, self._woken = asyncio.get_running_loop(), asyncio.Event()
        self._woken.clear()

    async def wait(self, seconds: float) -> None:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that comes as
        # the wake-up does, and the watch the entity cancelled went on to its end beside the new one.
        try:
            async with asyncio.timeout(seconds):
                await self._woken.wait()
        except TimeoutError:
            pass

    def observe(self, acked_digest: str = "") -> NodeState:
        for key in self._delivered.pop(acked_digest, []):
            self._acked.add(key)
        if len(self._acked) > 4096:
            self._acked = set(list(self._acked)[-2048:])
        boot_id, gpus = self.gpus.boot_id(), self.gpus.probe()
        carried = []
        for gpu in gpus:
            kept = [e for e in self._xids.get(gpu.index, []) if _xid_key(gpu.index, e) not in self._acked]
            known = {_xid_key(gpu.index, e) for e in kept}
            kept += [e for e in gpu.xid_events
                     if _xid_key(gpu.index, e) not in known and _xid_key(gpu.index, e) not in self._acked]
            self._xids[gpu.index] = kept[-MAX_XIDS:]
            gpu.xid_events = list(self._xids[gpu.index])
            carried += [_xid_key(gpu.index, e) for e in gpu.xid_events]
        reclaim_at = None
        if self.notice is not None:
            try:
                reclaim_at = self.notice()
            except Exception as error:  # noqa: BLE001 - metadata service hiccup: the next probe
                activity.logger.debug("spot notice poll failed: %s", error)
        digest = hashlib.sha256(fingerprint(boot_id, gpus).encode()).hexdigest()
        if carried:
            self._delivered[digest] = carried
            while len(self._delivered) > 16:
                self._delivered.pop(next(iter(self._delivered)))
        return NodeState(digest, boot_id, gpus, reclaim_at)


class NodeAgentActivities:
    def __init__(self, node_name: str, gpus: GpuBackend, watch: NodeWatch | None = None) -> None:
        self.node_name = node_name
        self.gpus = gpus
        self.watch = watch or NodeWatch(gpus)
        #: Reset key -> what the reset said: a retried reset of the same repair attempt
        #: (the reply was lost, the activity timed out) answers again without resetting.
        #: Kept for the agent's life; an agent restarted mid-repair resets once more at
        #: most, which the ladder tolerates (a reset of a healthy GPU is harmless).
        self._resets: dict[str, str] = {}

    def all(self) -> list:
        return [self.probe_gpus, self.smoke_test, self.reset_gpu, self.reinstall_driver, self.watch_node]

    @activity.defn
    async def watch_node(self, input: NodeWatchInput) -> NodeWatchResult:
        """Long-running: return the node's state once it differs from what the entity saw,
        or unchanged after ``max_wait_seconds``; heartbeat while waiting. Async, so a waiting
        watch holds no thread (a sim host runs one per node)."""
        if input.node_name != self.node_name:
            raise ApplicationError(f"node_name: this agent is {self.node_name!r}, not {input.node_name!r}",
                                   type="InvalidInput", non_retryable=True)
        deadline = time.monotonic() + input.max_wait_seconds
        info = activity.info()
        # A look every quarter of the timeout: a beat, due each half, is sent on time.
        beat = (info.heartbeat_timeout.total_seconds() / 4) if info.heartbeat_timeout else 10.0
        # A heartbeat is a billed action and a write on the server, and every node runs a watch,
        # restarted at each change: one beat per half the timeout, the first at half, so a watch
        # that a change ends sooner (most of the health traffic) costs none, an idle one two per
        # timeout, and a lost agent is still seen within the timeout.
        every = (info.heartbeat_timeout.total_seconds() * WATCH_FIRST_HEARTBEAT_SHARE
                 if info.heartbeat_timeout else None)
        next_beat = time.monotonic() + every if every else float("inf")
        while True:
            self.watch.arm()
            observed_at = self.watch.clock()
            state = await asyncio.to_thread(self.watch.observe, input.digest)
            changed = state.digest != input.digest or state.reclaim_at != input.reclaim_at
            if changed or time.monotonic() >= deadline:
                return NodeWatchResult(node_name=self.node_name, seq=input.seq + changed, digest=state.digest,
                                       boot_id=state.boot_id, gpus=state.gpus, reclaim_at=state.reclaim_at,
                                       observed_at=observed_at)
            if time.monotonic() >= next_beat:
                activity.heartbeat(input.seq)
                next_beat = time.monotonic() + every
            pause = min(beat, max(deadline - time.monotonic(), 0.0))
            if self.watch.interval_s > 0:
                pause = min(pause, self.watch.interval_s)
            await self.watch.wait(pause)

    @activity.defn
    def probe_gpus(self, input: ProbeGpusInput) -> GpuProbeResult:
        return GpuProbeResult(node_name=self.node_name, boot_id=self.gpus.boot_id(), gpus=self.gpus.probe())

    @activity.defn
    def smoke_test(self, input: SmokeTestInput) -> SmokeResult:
        """All GPUs visible, clean counters, and each GPU computes correctly.

        A compute check that cannot run on this node (``ComputeCheckUnavailable``: the agent's
        image lacks libcuda, its child cannot start or import the check, the agent's own limits
        killed it) is no verdict on any GPU: with nothing else wrong the test raises
        ``ComputeCheckUnavailable`` (an ``ApplicationError``, retried only where it may pass next
        time) instead of failing, so that no GPU is failed, and none repaired, for the agent's
        problem, and none passes unproven either. What NVML found wrong still fails the test."""
        liveness = Liveness()
        gpus = self.gpus.probe()
        failures = []
        unavailable: ComputeCheckUnavailable | None = None
        if len(gpus) != input.expected_gpus:
            failures.append(f"{len(gpus)} of {input.expected_gpus} GPUs visible")
        for gpu in gpus:
            if input.only_gpus is not None and gpu.index not in input.only_gpus:
                continue
            failures += [f"GPU {gpu.index}: {problem}" for problem in gpu.problems()]
            liveness.beat(gpu.index)
            if gpu.lost or unavailable is not None:  # one that cannot run here runs on no GPU of the node
                continue
            try:
                if problem := self.gpus.compute_check(gpu.index):
                    failures.append(problem)
            except ComputeCheckUnavailable as error:
                unavailable = error
                activity.logger.error("node %s: the compute check cannot run on this node (no GPU verdict): %s",
                                      self.node_name, error)
        if unavailable is not None:
            said = f"the compute check cannot run on {self.node_name}: {unavailable}"[:900]
            if not failures:
                raise ApplicationError(
                    f"{said}; the node agent's problem (its image, its limits), not its GPUs': nothing proven",
                    {"node": self.node_name, "problem": str(unavailable)[:500], "transient": unavailable.transient},
                    type="ComputeCheckUnavailable", non_retryable=not unavailable.transient)
            failures.append(f"{said} (not run)")  # NVML's findings fail the test; this says what was not checked
        state = None
        if input.include_state:
            seen = self.watch.observe()
            state = NodeWatchResult(node_name=self.node_name, seq=1, digest=seen.digest, boot_id=seen.boot_id,
                                    gpus=seen.gpus, reclaim_at=seen.reclaim_at, observed_at=self.watch.clock())
        return SmokeResult(passed=not failures, gpus_seen=len(gpus), boot_id=self.gpus.boot_id(), failures=failures,
                           state=state)

    @activity.defn
    def reset_gpu(self, input: ResetGpuInput) -> str:
        """``nvidia-smi -r -i N``. Refused while processes still hold the GPU: that is
        not retried here (the workflow decides: the rung failed)."""
        key = f"{input.key}/gpu{input.index}" if input.key else ""
        if key and key in self._resets:
            return self._resets[key]
        try:
            said = _while_beating(lambda: self.gpus.reset_gpu(input.index))
        except RuntimeError as error:
            raise ApplicationError(str(error), type="GpuResetFailed", non_retryable=True) from error
        if key:
            self._resets[key] = said
        return said

    @activity.defn
    def reinstall_driver(self, input: ReinstallDriverInput) -> str:
        try:
            return _while_beating(self.gpus.reinstall_driver)
        except RuntimeError as error:
            raise ApplicationError(str(error), type="DriverReinstallFailed", non_retryable=True) from error
