"""AcquireCapacity's deadline: once it has passed, no join starts, so nothing more is bought; the
joins in flight finish (each may still deliver its node) and the request returns what joined, its
result and its details naming the deadline.

Against the real dev server, the control-plane worker and the simulated providers."""

from __future__ import annotations

import asyncio
from datetime import datetime

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle

from fleet.messages.join import JoinTimeouts
from tests.capacity_fleet import FAST_JOIN, CapStack
from tests.details_helpers import decided, until
from tests.replay import replay, replay_and_record
from tests.test_capacity import cap, progress, result_of  # noqa: F401 - cap: the fixture


async def details(handle: WorkflowHandle) -> str:
    """The workflow's current details (the UI's "User Metadata" tab)."""
    metadata = await handle.query("__temporal_workflow_metadata")
    return metadata.current_details if hasattr(metadata, "current_details") else metadata["currentDetails"]


async def joins_started(handle: WorkflowHandle) -> list[float]:
    """Seconds after the request started at which each of its joins (a child) was started."""
    events = (await handle.fetch_history()).events
    first = events[0].event_time.ToDatetime()
    return [(e.event_time.ToDatetime() - first).total_seconds() for e in events
            if e.HasField("start_child_workflow_execution_initiated_event_attributes")]


#: The event of a child workflow's start (a join).
START_CHILD = EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED


def at(deadline: datetime | None) -> str:
    assert deadline is not None
    return deadline.isoformat(timespec="seconds")


async def test_a_join_that_ends_past_the_deadline_starts_no_other(cap: CapStack) -> None:
    """Each join outlives the 2 s deadline: the first one finishes and delivers its node, no second
    one is bought (before: a join started at each end, 3 machines for a 2 s request)."""
    cap.world.set_site(cap.site("cheap"), boot_seconds=4)
    handle = await cap.request({"constraints": {"sites": [cap.site("cheap")]}, "count": 3,
                                "concurrency": 1, "deadline_seconds": 2})
    result = await result_of(handle)
    started = await joins_started(handle)
    assert [s for s in started if s > 2] == [], f"joins started {started} s after start, past the 2 s deadline"
    assert len(cap.world.machines(include_deleted=True)) == 1, "one machine bought: the join in flight at the deadline"
    assert len(result.nodes) == 1 and not result.complete, "the join in flight finished and its node counts"
    now = await progress(handle)
    deadline = at(now.deadline)
    assert result.why[:2] == ["2 of 3 not joined by the deadline",
                              f"the deadline passed at {deadline}: no join starts after it"]
    text = await details(handle)
    assert now.step == "partial" and f"stopped: the deadline passed at {deadline}" in text, text
    await replay_and_record(handle, "capacity_deadline_join_in_flight")


async def test_capacity_that_appears_as_the_wait_ends_at_the_deadline_is_not_bought(cap: CapStack) -> None:
    """The wait for capacity ends at the deadline and reads the catalog once more: what it finds
    then is not bought (before: a join started past the deadline)."""
    cap.world.set_site(cap.site("cheap"), capacity=0)
    handle = await cap.request({"constraints": {"sites": [cap.site("cheap")]}, "count": 1,
                                "deadline_seconds": 3, "backoff_seconds": 60})
    assert await cap.listed(f'WorkflowId = "{handle.id}" AND FleetState = "waiting-for-capacity"')
    cap.world.set_site(cap.site("cheap"), capacity=4)  # no catalog refresh: the request sleeps on
    result = await result_of(handle)
    assert await joins_started(handle) == []
    assert cap.world.machines(include_deleted=True) == [], "nothing bought past the deadline"
    deadline = at((await progress(handle)).deadline)
    assert result.nodes == [] and result.why[1] == f"the deadline passed at {deadline}: no join starts after it"
    assert f"stopped: the deadline passed at {deadline}" in await details(handle)
    await replay_and_record(handle, "capacity_deadline_after_wait")


async def test_the_joins_in_flight_at_the_deadline_finish_and_say_so(cap: CapStack) -> None:
    """Two joins in flight (the second at the next site: the cheapest had room for one); the quick
    one ends past the deadline: its place is not filled, the details say the rest finish first, and
    the slow one still delivers its node."""
    cap.world.set_site(cap.site("cheap"), capacity=1, boot_seconds=6)
    cap.world.set_site(cap.site("mid"), boot_seconds=10)
    handle = await cap.request({"constraints": {"sites": [cap.site("cheap"), cap.site("mid")]}, "count": 3,
                                "concurrency": 2, "deadline_seconds": 4})

    for _ in range(300):  # the quick join ends about 6 s in
        now = await progress(handle)
        if now.step == "finishing the joins in flight" or now.finished:
            break
        await asyncio.sleep(0.1)
    assert now.step == "finishing the joins in flight", now
    assert now.in_flight == [cap.offer("mid")] and now.joined == 1
    text = await details(handle)
    assert "no join starts past the deadline; it returns what joined once the joins in flight (1) end" in text, text
    assert f"deadline passed at {at(now.deadline)}" in text, text
    result = await result_of(handle)
    assert sorted(n.site for n in result.nodes) == [cap.site("cheap"), cap.site("mid")]
    assert [a.outcome for a in result.attempts].count("NoCapacity") == 1
    assert len(cap.world.machines(include_deleted=True)) == 2, "no third machine bought past the deadline"
    await replay(await handle.fetch_history())


async def test_the_joins_in_flight_say_until_when_by_their_own_timeouts(cap: CapStack) -> None:
    """The deadline stops no join in flight: each runs to its own timeouts (``join_timeouts``). While
    they run, and once the deadline has passed, the details say until when the last one started
    runs by them, in UTC. Before: "joining: 2 in flight", then "it returns what joined once the joins
    in flight (1) end", no time at all past the deadline."""
    cap.world.set_site(cap.site("cheap"), capacity=1, boot_seconds=6)
    cap.world.set_site(cap.site("mid"), boot_seconds=10)
    handle = await cap.request({"constraints": {"sites": [cap.site("cheap"), cap.site("mid")]}, "count": 3,
                                "concurrency": 2, "deadline_seconds": 4})
    timeouts = JoinTimeouts.model_validate(FAST_JOIN)
    said = ("(its timeouts: provision {p:g} s a try, registration {r:g} s, smoke test {s:g} s)"
            .format(p=timeouts.provision_seconds, r=timeouts.registration_seconds, s=timeouts.smoke_test_seconds))
    seconds = timeouts.provision_seconds + timeouts.registration_seconds + timeouts.smoke_test_seconds

    async def head_once(step: str) -> str | None:
        head = (await details(handle)).split("\n")[0]
        return head if head.startswith(f"**{step}**") else None

    head = await wait_for_async(lambda: head_once("joining"))
    began, _ = await decided(handle, lambda e: e.event_type == START_CHILD, last=True)
    assert head == f"**joining**: 2 in flight, the last {until(began, seconds)} {said}", head
    head = await wait_for_async(lambda: head_once("finishing the joins in flight"))
    # The last join started as of now: one may have started since the first look (a finished join's
    # place taken before the deadline), and the details name the last one.
    began, _ = await decided(handle, lambda e: e.event_type == START_CHILD, last=True)
    assert head == ("**finishing the joins in flight**: no join starts past the deadline; it returns what joined "
                    f"once the joins in flight (1) end, the last {until(began, seconds)} {said}"), head
    result = await result_of(handle)
    assert len(result.nodes) == 2, result


async def wait_for_async(probe, timeout: float = 30):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        found = await probe()
        if found:
            return found
        assert asyncio.get_running_loop().time() < deadline, "never came"
        await asyncio.sleep(0.1)
