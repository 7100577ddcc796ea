"""Signal baselines for bench.repair_latency (own module: the workflow sandbox imports it)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from temporalio import activity, workflow

#: seq → perf_counter() when the activity for that signal ran (same process as the bench).
ran: dict[int, float] = {}
_lock = threading.Lock()


@activity.defn
def mark(seq: int) -> None:
    with _lock:
        ran[seq] = time.perf_counter()


@workflow.defn
class Echo:
    def __init__(self) -> None:
        self.seen = 0
        self.todo: list[int] = []

    @workflow.signal
    def ping(self, seq: int) -> None:
        self.seen = seq
        self.todo.append(seq)

    @workflow.query
    def last(self) -> int:
        return self.seen

    @workflow.run
    async def run(self, with_activity: bool) -> None:
        while True:
            await workflow.wait_condition(lambda: bool(self.todo))
            seq = self.todo.pop(0)
            if with_activity:
                await workflow.execute_activity(mark, seq, start_to_close_timeout=timedelta(seconds=30))
