"""A Site entity of more nodes than Temporal lets one workflow have signals in flight (its
``limit.numPendingSignals.error``: 2,000 by default, and fixed at 2,000 on Temporal Cloud), all of
them NotReady in one watch result (the provider down): every Node entity is told, in turns
(``TELL_AT_ONCE``), and the entity goes on. Before, it told them all in one workflow task, which the
server failed (``PENDING_SIGNALS_LIMIT_EXCEEDED``) on every retry: the entity stopped. A site may
hold up to ``MAX_SITE_NODES`` (5,000). On the real dev server, whose limit is the production
default; the watch's result is the test's (the simulated world joins a handful of nodes)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import AsyncIterator

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.watches import WatchActivities
from fleet.messages.evacuation import ProbeNode
from fleet.messages.watches import SiteWatchInput, SiteWatchResult
from fleet.models import MAX_SITE_NODES
from tests.evacuation_helpers import IncStack, failed_tasks, incident_fleet, open_incident_stack, poll
from tests.replay import replay_and_record
from workflows.steps import TEMPORAL_PENDING_PER_RUN
from workflows.site import TELL_AT_ONCE


def silent_site(monkeypatch, count: int) -> None:
    """The site's watch sees ``count`` nodes, all NotReady, at once; then nothing changes."""
    names = [f"node-{i:04d}" for i in range(count)]

    @activity.defn(name="watch_site")
    def watch_site(self, input: SiteWatchInput) -> SiteWatchResult:
        if input.known:
            time.sleep(1.0)  # nothing changes: the entity waits on its next watch
        return SiteWatchResult(nodes=[ProbeNode(name=name, ready=False) for name in names], changed=not input.known,
                               observed_at=time.time())

    monkeypatch.setattr(WatchActivities, "watch_site", watch_site)


def fleet_stack(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[IncStack]:
    """The incident stack (its worker built now: after the watch was replaced), the probe timer an hour."""
    uid = uuid.uuid4().hex[:6]
    return open_incident_stack(temporal_env.client, tmp_path, incident_fleet(uid, incident={"check_seconds": 3600}), uid)


async def told_every_node(handle: WorkflowHandle, count: int) -> bool:
    history = await handle.fetch_history()
    failed = failed_tasks(history)
    assert not failed, failed[0].workflow_task_failed_event_attributes.failure.message
    sent = sum(e.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED for e in history.events)
    return sent >= count


def test_a_site_may_hold_more_nodes_than_temporal_lets_one_task_signal() -> None:
    """The premise, from the code's own constants: a site's nodes outnumber the pending-signal
    limit, and one turn stays well under it."""
    assert MAX_SITE_NODES > TEMPORAL_PENDING_PER_RUN
    assert TELL_AT_ONCE * 4 <= TEMPORAL_PENDING_PER_RUN


async def test_a_site_of_more_nodes_than_temporals_pending_signal_limit_tells_every_node_it_saw_go_silent(
        temporal_env, tmp_path, monkeypatch) -> None:
    count = TEMPORAL_PENDING_PER_RUN + 100
    silent_site(monkeypatch, count)
    async for inc in fleet_stack(temporal_env, tmp_path):
        handle = await inc.start_site("a", reconcile_seconds=3600)
        # The poll's bound only guards against a hang: before, the task failed at once, every retry.
        await poll(lambda: told_every_node(handle, count), timeout=180, interval=0.5)


async def test_a_site_tells_a_few_hundred_nodes_in_turns(temporal_env, tmp_path, monkeypatch) -> None:
    """More than one turn (recorded: tests/test_replay.py replays it, and its ``_before`` twin, a
    run of the code before that told them in one task)."""
    count = TELL_AT_ONCE + 50
    silent_site(monkeypatch, count)
    async for inc in fleet_stack(temporal_env, tmp_path):
        handle = await inc.start_site("a", reconcile_seconds=3600)
        await poll(lambda: told_every_node(handle, count), timeout=120, interval=0.5)
        await replay_and_record(handle, "site_tells_nodes_in_turns")



def vanishing_site(monkeypatch, count: int) -> None:
    """The site's watch sees ``count`` Ready nodes, then none of them (all deleted from the cluster
    at once: a site retiring them, a person deleting them); then nothing changes."""
    names = [f"node-{i:04d}" for i in range(count)]

    @activity.defn(name="watch_site")
    def watch_site(self, input: SiteWatchInput) -> SiteWatchResult:
        if not input.known:
            return SiteWatchResult(nodes=[ProbeNode(name=name, ready=True) for name in names], changed=True,
                                   observed_at=time.time())
        if len(input.known) < count:
            time.sleep(1.0)  # nothing changes: the entity waits on its next watch
        return SiteWatchResult(nodes=[], changed=bool(input.known), observed_at=time.time())

    monkeypatch.setattr(WatchActivities, "watch_site", watch_site)


async def test_a_site_whose_nodes_are_all_deleted_at_once_tells_each_entity_in_turns(
        temporal_env, tmp_path, monkeypatch) -> None:
    """More nodes than Temporal lets one workflow have signals in flight, all gone from the cluster
    in one watch result: each Node entity is told it was deleted (``site-tells-deleted-nodes``), in
    turns, and the site goes on (no failed workflow task)."""
    count = TEMPORAL_PENDING_PER_RUN + 100
    vanishing_site(monkeypatch, count)
    async for inc in fleet_stack(temporal_env, tmp_path):
        handle = await inc.start_site("a", reconcile_seconds=3600)
        # The poll's bound only guards against a hang.
        await poll(lambda: told_every_node(handle, count), timeout=180, interval=0.5)
        history = await handle.fetch_history()
        told = {e.signal_external_workflow_execution_initiated_event_attributes.workflow_execution.workflow_id
                for e in history.events
                if e.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED}
        assert told >= {f"node/node-{i:04d}" for i in range(count)}
