"""GPU faults are reported as they happen: the node agent's report loop wakes on an
NVML XID event (a fake NVML library, the real ``NvmlBackend`` and report loop), and the
Node entity it starts carries ``Site``, ``Provider`` and ``NodeName`` from its first moment."""

from __future__ import annotations

import asyncio
import queue
import time
import uuid
from types import SimpleNamespace

from temporalio.api.enums.v1 import EventType

from fleet import search_attributes as sa
from providers.gpu import NvmlBackend
from workers.health_report import watch_real_node


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


async def signals(handle) -> int:
    count = 0
    async for event in handle.fetch_history_events():
        count += event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
    return count


async def test_an_xid_is_reported_at_once_and_the_node_entity_is_findable_by_site(temporal_env) -> None:
    client = temporal_env.client
    node, queue_name = f"xid-{uuid.uuid4().hex[:6]}", f"nobody-{uuid.uuid4().hex[:6]}"  # no worker: history only
    nvml = FakeNvml()
    gpus = NvmlBackend(nvml)
    gpus.watch_xids()
    stop = asyncio.Event()
    # An interval far longer than the test: only the XID wake-up can send the second report.
    task = asyncio.create_task(watch_real_node(client, queue_name, node, gpus, stop, interval_s=600,
                                               placement=("lambda-us-east", "lambda")))
    try:
        handle = client.get_workflow_handle(f"node/{node}")
        deadline = time.monotonic() + 10
        while True:
            try:
                if await signals(handle) >= 1:
                    break
            except Exception:  # noqa: BLE001 - not started yet
                pass
            assert time.monotonic() < deadline, "first report never sent"
            await asyncio.sleep(0.1)
        attributes = (await handle.describe()).typed_search_attributes
        assert attributes.get(sa.SITE) == "lambda-us-east"
        assert attributes.get(sa.PROVIDER) == "lambda"
        assert attributes.get(sa.NODE_NAME) == node

        sent = time.monotonic()
        nvml.xid(1, 79)
        while await signals(handle) < 2:
            assert time.monotonic() - sent < 5, "the XID waited for the next interval"
            await asyncio.sleep(0.1)
        report = None
        async for event in handle.fetch_history_events():
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                report = event.workflow_execution_signaled_event_attributes
        assert b'"xid":79' in report.input.payloads[0].data.replace(b" ", b"")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await client.get_workflow_handle(f"node/{node}").terminate("test over")
