"""A node's watch answers are charged by their bytes whatever their timing (``_pace_watch``,
``node-charges-every-answer-bytes``). Before it an answer at half the watch's wait set the early
answers' count back to 0 and was not charged: a node padding every answer to the gateway's 128 KiB
answered 4 early, then one at half the wait, and again, about 2.5 MiB of history an hour.

A slow answer takes half the watch's wait (15 minutes) of the server's clock, which neither the dev
server (real time) nor the time-skipping server (its clock held while an activity runs) gives a
test in seconds: here ``_pace_watch`` itself is driven, answer after answer, on a clock of the
test's own that its pauses move on, as the watch loop calls it. The dev-server run of a padding node
is ``tests/security/test_watch_pacing.py::test_a_node_padding_past_its_bytes_budget_waits_until_they_are_paid_for``."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

import pytest
from temporalio import workflow

from fleet.messages.repair import NodeCarry, RepairSettings
from workflows.node import NodeEntity

#: A padded answer (~120 KB, under the gateway's 128 KiB) and an honest one (8 GPUs).
PADDED = 120_000
HONEST = 3_000
WAIT_HALF = 900.0  # half the watch's wait (30 minutes) where the cluster tells the node's readiness


class Driven:
    """A Node entity's watch pace, on a clock the test moves (an answer's wait) and its pauses move."""

    def __init__(self, monkeypatch) -> None:
        self.t = 1_800_000_000.0
        self.paused = 0.0
        self.asked: list[str] = []
        entity = object.__new__(NodeEntity)
        entity.state, entity._node, entity._facts = NodeCarry(), "site-a-driven", None
        entity._settled_7 = entity._told_by_cluster = True
        entity._joined_settings, entity._resting = RepairSettings(), set()
        self.entity = entity

        async def sleep(duration, summary=None) -> None:
            seconds = duration.total_seconds() if isinstance(duration, timedelta) else float(duration)
            self.t += seconds
            self.paused += seconds

        def patched(patch_id: str) -> bool:
            self.asked.append(patch_id)
            return True

        monkeypatch.setattr(workflow, "now", lambda: datetime.fromtimestamp(self.t, timezone.utc))
        monkeypatch.setattr(workflow, "patched", patched)
        monkeypatch.setattr(workflow, "sleep", sleep)
        monkeypatch.setattr(workflow, "logger", logging.getLogger("driven-node"))

    async def answers(self, pattern: list[tuple[float, int, bool]], hours: float) -> tuple[int, int]:
        """Answers in ``pattern`` (seconds each took, its bytes, whether it changed something), again
        and again for ``hours`` of the clock: how many were taken and their bytes."""
        end, taken, written = self.t + hours * 3600, 0, 0
        while True:
            took, size, moved = pattern[taken % len(pattern)]
            self.t += took
            if self.t > end:
                return taken, written
            taken, written = taken + 1, written + size
            await self.entity._pace_watch(timedelta(seconds=took), moved, size)


async def test_a_node_padding_early_answers_then_one_at_half_the_wait_is_charged_for_them(monkeypatch) -> None:
    """4 padded early answers (a new digest each), then a padded one at half the watch's wait, and
    again: each early one counted as 8 for the pace, the slow one set the count back to 0 and was
    not charged: ~20 answers, 2.4 MB an hour (9.5 MB in 4 hours). Now every answer's bytes are
    charged against 512 KiB and 256 KiB an hour: 1.6 MiB in 4 hours at most (and one answer)."""
    driven = Driven(monkeypatch)
    pattern = [(0.0, PADDED, True)] * 4 + [(WAIT_HALF, PADDED, True)]
    taken, written = await driven.answers(pattern, hours=4)
    most = 512 * 1024 + 4 * 256 * 1024 + 128 * 1024
    assert written <= most, f"{taken} padded answers, {written / 1e6:.2f} MB in 4 hours"
    assert any("until they are paid for" in line for line in driven.entity.state.log), driven.entity.state.log
    # Paid for: the pauses kept it near the rate (not merely the free part, then nothing).
    assert written >= 3 * 256 * 1024, f"{written / 1e6:.2f} MB"


@pytest.mark.parametrize("early", [1, 10, 30])
async def test_an_honest_node_answering_slowly_then_early_for_a_change_is_not_paced(monkeypatch, early) -> None:
    """An honest agent answers at the watch's wait when nothing changed (3 KB for 8 GPUs), early
    only for a change (a burst of them while its state moves): never paced, and the patch never asked
    (its runs record no marker)."""
    driven = Driven(monkeypatch)
    pattern = [(1800.0, HONEST, False), (1800.0, HONEST, False), *[(5.0, HONEST, True)] * early]
    taken, written = await driven.answers(pattern, hours=48)
    assert driven.paused == 0, f"paused {driven.paused:.0f}s over {taken} answers ({written:,} bytes)"
    assert driven.asked == [], driven.asked
    assert not driven.entity.state.log
