"""GPU faults are reported as they happen: the node's ``watch_node`` activity wakes on an
NVML XID event (a fake NVML library, the real ``NvmlBackend`` and XID waiter) and returns the
node's whole state; with what it returned it waits, with an older state it returns at once
(level-triggered: a Node entity that continued as new loses nothing)."""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from temporalio.testing import ActivityEnvironment

from activities import node_agent
from activities.node_agent import NodeAgentActivities, NodeWatch
from fleet.messages.repair import NodeWatchInput, NodeWatchResult
from providers.gpu import NvmlBackend
from workers.health_report import xid_wakes


class FakeNvml:
    """The slice of pynvml that NvmlBackend calls: two GPUs, XID events on demand."""

    class NVMLError(Exception):
        pass

    class NVMLError_Timeout(NVMLError):
        pass

    NVML_NVLINK_MAX_LINKS = 0

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()

    def __getattr__(self, name: str):
        if name.startswith("NVML_"):
            return 0
        if name.startswith("nvml"):  # a query this fake does not answer: "not supported"
            def unsupported(*_args):
                raise self.NVMLError(f"{name}: not supported")
            return unsupported
        raise AttributeError(name)

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int):
        return SimpleNamespace(index=index)

    def nvmlDeviceGetUUID(self, handle) -> str:
        return f"GPU-fake-{handle.index}"

    def nvmlDeviceGetIndex(self, handle) -> int:
        return handle.index

    def nvmlEventSetCreate(self):
        return object()

    def nvmlDeviceRegisterEvents(self, *_args) -> None:
        pass

    def nvmlEventSetWait(self, _events, timeout_ms: int):
        try:
            return self.events.get(timeout=min(timeout_ms, 200) / 1000)
        except queue.Empty:
            raise self.NVMLError_Timeout() from None

    def xid(self, gpu: int, xid: int) -> None:
        self.events.put(SimpleNamespace(device=SimpleNamespace(index=gpu), eventData=xid))


#: How long a watch that must return at once (its probe and its end ten minutes away) may take:
#: a guard against a hang only.
HANG_GUARD_SECONDS = 60


class WatchClock:
    """The watch's clock (``activities.node_agent``'s ``time.monotonic``), moved only by the
    watch's own waits: the pace of its heartbeats is exact however busy the machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class ClockedWatch(NodeWatch):
    """A NodeWatch whose waits move ``clock`` instead of taking time (nothing wakes it)."""

    def __init__(self, gpus, clock: WatchClock) -> None:
        super().__init__(gpus, interval_s=600)
        self._clock = clock

    async def wait(self, seconds: float) -> None:
        self._clock.now += seconds
        await asyncio.sleep(0)


async def test_an_xid_wakes_the_watch_at_once_and_the_watch_is_level_triggered() -> None:
    nvml = FakeNvml()
    gpus = NvmlBackend(nvml)
    # A probe interval far longer than the test: only the XID wake-up can end the second watch.
    watch = NodeWatch(gpus, interval_s=600)
    xid_wakes(gpus, watch)
    gpus.watch_xids()
    agent = NodeAgentActivities("xid-node", gpus, watch)
    env = ActivityEnvironment()

    first: NodeWatchResult = await env.run(agent.watch_node, NodeWatchInput(node_name="xid-node"))
    assert first.seq == 1 and len(first.gpus) == 2, "a new entity gets the whole state at once"

    waiting = asyncio.ensure_future(env.run(agent.watch_node, NodeWatchInput(
        node_name="xid-node", seq=first.seq, digest=first.digest, max_wait_seconds=600)))
    await asyncio.sleep(0.5)
    assert not waiting.done(), "nothing changed: the watch waits"
    nvml.xid(1, 79)
    # The next probe and the watch's end are ten minutes away: only the XID can end it (the
    # bound guards against a hang).
    second: NodeWatchResult = await asyncio.wait_for(waiting, HANG_GUARD_SECONDS)
    assert second.seq == 2 and second.digest != first.digest
    assert [e.xid for e in second.gpus[1].xid_events] == [79]

    # A run that continued as new with the older state: answered at once, with the whole state.
    again: NodeWatchResult = await asyncio.wait_for(env.run(agent.watch_node, NodeWatchInput(
        node_name="xid-node", seq=first.seq, digest=first.digest, max_wait_seconds=600)), HANG_GUARD_SECONDS)
    assert again.digest == second.digest and [e.xid for e in again.gpus[1].xid_events] == [79]
    # Once the entity has it (its next watch names that digest), the XID is not carried again...
    cleared: NodeWatchResult = await asyncio.wait_for(env.run(agent.watch_node, NodeWatchInput(
        node_name="xid-node", seq=second.seq, digest=second.digest, max_wait_seconds=600)), HANG_GUARD_SECONDS)
    assert cleared.seq == 3 and cleared.gpus[1].xid_events == []
    # ...and with nothing new the watch waits until its end: the same state, the same number.
    quiet: NodeWatchResult = await env.run(agent.watch_node, NodeWatchInput(
        node_name="xid-node", seq=cleared.seq, digest=cleared.digest, max_wait_seconds=0.3))
    assert (quiet.seq, quiet.digest) == (cleared.seq, cleared.digest)


async def test_a_watch_for_another_node_is_refused() -> None:
    nvml = FakeNvml()
    agent = NodeAgentActivities("this-node", NvmlBackend(nvml))
    try:
        await ActivityEnvironment().run(agent.watch_node, NodeWatchInput(node_name="other-node"))
    except Exception as error:  # noqa: BLE001
        assert "node_name" in str(error)
    else:
        raise AssertionError("answered a watch for another node")



def test_a_world_change_wakes_only_the_watches_of_the_machines_it_touched(tmp_path) -> None:
    """The sim's node host wakes a watch only when its own machine changed (a fault, a spot
    notice, a reboot), as a real node's XID waiter does: a change elsewhere probes no one else."""
    from activities.env import FleetEnv
    from fleet.settings import Settings
    from fleet.models import MachineSpec

    env = FleetEnv.from_settings(Settings(state_dir=tmp_path))
    site = env.config.sites[0]
    spec = MachineSpec(site=site.name, instance_type=site.instance_type, gpu=site.gpu, gpus=site.gpus_per_machine,
                       region=site.region, capacity_type=site.capacity_type, name="n")
    a, b, c = (env.provider(site.name).create_machine(spec.model_copy(update={"name": f"n{i}"}), f"k{i}").id
               for i in range(3))
    world = env.world
    start = world.changes_since(0).seq
    world.inject_fault(a, 1, "xid", 48, clears_on="reset")
    world.post_reclaim_notice(b, 60)
    changes = world.changes_since(start)
    assert changes.machines == {a, b} and not changes.kubelet and not changes.everything
    world.clear_faults(a, "reset", 1)
    cleared = world.changes_since(changes.seq)
    assert cleared.machines == {a}, "a cleared fault is a change too"
    assert world.changes_since(cleared.seq).machines == set(), "nothing new: nothing to look at"
    # A reboot is something its kubelet acts on; a change log trimmed past a reader tells it to look at everything.
    env.provider(site.name).reboot_machine(c)
    rebooted = world.changes_since(cleared.seq)
    assert c in rebooted.machines and rebooted.kubelet
    world.forget_changes(rebooted.seq)
    world.inject_fault(a, 2, "xid", 48, clears_on="reset")
    assert world.changes_since(cleared.seq).everything
    assert not world.changes_since(rebooted.seq).everything


async def test_a_short_watch_costs_the_server_no_heartbeat_and_a_long_one_beats_within_its_timeout(
        monkeypatch) -> None:
    """Every node runs a watch, restarted at each change: a heartbeat is a write on the server,
    so a watch that ends early sends none; one that waits proves its agent alive in time. On the
    watch's own clock (``WatchClock``), which only its waits move."""
    clock = WatchClock()
    monkeypatch.setattr(node_agent, "time", SimpleNamespace(monotonic=clock.monotonic, time=time.time))
    gpus = NvmlBackend(FakeNvml())
    agent = NodeAgentActivities("quiet-node", gpus, ClockedWatch(gpus, clock))
    first: NodeWatchResult = await ActivityEnvironment().run(agent.watch_node, NodeWatchInput(node_name="quiet-node"))
    timeout = 2.0
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, heartbeat_timeout=timedelta(seconds=timeout))
    beats: list[float] = []
    env.on_heartbeat = lambda *_details: beats.append(clock.now)

    def quiet_watch(seconds: float) -> NodeWatchInput:
        return NodeWatchInput(node_name="quiet-node", seq=first.seq, digest=first.digest, max_wait_seconds=seconds)

    await env.run(agent.watch_node, quiet_watch(0.35 * timeout))
    assert beats == [], "a watch ended before half its heartbeat timeout wrote a heartbeat"

    started = clock.now
    await env.run(agent.watch_node, quiet_watch(2.2 * timeout))
    ended = clock.now
    assert ended - started == pytest.approx(2.2 * timeout), "the watch waited its whole wait"
    assert beats, "a watch longer than its heartbeat timeout never heartbeat"
    since_last = [later - earlier for earlier, later in zip([started, *beats], [*beats, ended])]
    assert beats[0] - started >= 0.5 * timeout, "the first heartbeat came before half the timeout"
    assert max(since_last) < timeout, f"heartbeats further apart than the timeout: {since_last}"
    # Each heartbeat is a billed action: one per half timeout, not one per look (issue 37).
    assert min(later - earlier for earlier, later in zip(beats, beats[1:])) >= 0.5 * timeout, beats
    assert len(beats) <= 4, f"{len(beats)} heartbeats in 2.2 heartbeat timeouts: more than one per half"


async def test_a_watch_cancelled_as_it_is_woken_stops() -> None:
    """The Node entity cancels a watch when it starts a new one. On Python 3.11 ``asyncio.wait_for``
    swallows a cancel that comes while the awaited wake-up completes: the watch looked again, saw no
    change and waited out its whole ``max_wait_seconds`` beside its replacement (two watches held
    the node's poll slots; a stopping agent waited for it)."""
    gpus = NvmlBackend(FakeNvml())
    watch = NodeWatch(gpus, interval_s=600)
    agent = NodeAgentActivities("busy-node", gpus, watch)
    first: NodeWatchResult = await ActivityEnvironment().run(agent.watch_node, NodeWatchInput(node_name="busy-node"))
    env = ActivityEnvironment()
    running = asyncio.create_task(env.run(agent.watch_node, NodeWatchInput(
        node_name="busy-node", seq=first.seq, digest=first.digest, max_wait_seconds=600)))
    await asyncio.sleep(0.2)  # waiting: nothing changed
    watch.wake()  # a look (nothing changed again) ...
    await asyncio.sleep(0)
    env.cancel()  # ... and, at that moment, the entity's cancel
    try:  # ended by the cancel, not at its ten-minute wait
        result = await asyncio.wait_for(asyncio.shield(running), HANG_GUARD_SECONDS)
    except asyncio.TimeoutError:
        running.cancel()
        raise AssertionError("the cancelled watch went on waiting (its cancel was lost)") from None
    except asyncio.CancelledError:  # the cancel, as the activity's end
        pass
    else:
        raise AssertionError(f"the cancelled watch returned as if it had waited: {result}")
