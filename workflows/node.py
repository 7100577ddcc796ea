"""Node (entity, id ``node/<name>``): one node's state, its health, its repairs.

NodeJoin starts it when it admits the node (Site, Provider and NodeName from the
join's own record); the site sweep starts it again, from the same record, where its node is
Ready and it is not running (terminated, failed: ``fleet.watched``), and its log says so; that run
first takes from the cluster the fences and repairs the run before left (``STARTED_AGAIN_PATCH``). It
pulls the node's health: ``watch_node``, a long-running, heartbeating activity on the node's
own queue ``node/<name>``, returns the node's whole state (GPU health, spot notice, a sequence
number) when it changed, and the entity schedules the next one. The node's identity is the queue it answered on
(the node gateway lets a node poll only its own), never a name in a payload; the
state is level-triggered, so a run that continues as new loses nothing: its first
watch returns at once if the node changed meanwhile. A spot notice starts the
node's SpotReclaim if the node's site is a spot site (else it is a bad report). What the node returns is untrusted: each result is validated by the entity
(``NodeReport``); a malformed one is a bad report (logged, counted in the status, shown), the
watch goes on, and ``MAX_BAD_REPORTS_IN_A_ROW`` of them quarantine the node (cordoned, repair
ladder), as the ``quarantine`` signal does for a node that failed an evacuation's proof. A
background loop that raises is shown and restarted, never lost. (``health_report`` signals, from control-plane identities only,
are still handled.) The entity classifies each GPU (``fleet.repair_policy``),
escalates repeat faults, fences a sick GPU and cordons the node at once (before anyone
decides how to repair it), and starts one GpuRepair child per sick GPU. It owns
the node's single disruptive-action slot: children ask for it before a reset,
reboot, reinstall or replace, and a node-wide action (not a reset: one GPU's) that started after
a child's fault was detected covers that child (two GPUs failing together → one reboot). When
too many of a site's nodes are unhealthy it stops repairing there and hands the
decision to the Site entity: every repair is first admitted by ``site/<site>``
(``admit_repair``), which holds it while its provider-incident rule is tripped: the entity asks
again after a pause that doubles up to ``HELD_RECHECK_MAX``, and at once when the site says the
incident closed (``incident_closed``; ``NODE_PACES_HELD_RECHECKS``). A GPU whose
repair ended unproven (cancelled, failed, terminated) stays fenced, held for a person
(``needs_person``); the person's updates ``return_gpu`` (un-fence it) and ``repair_gpu`` (a new
repair, admitted like any finding's) are the way out. The entity never ends because a cluster call
failed: a finding it cannot act on because the cluster does not answer its read of the node is kept
on hold and acted on once it does (``_facts_or_wait``), its details saying until when.

An entity (``workflows.entity``, docs/design/entities.md): its one state is ``NodeCarry``
(ledger, findings on hold, last health, recent node actions, what the watch last acknowledged).
Each repair's watcher is an own task. It continues as new when the server suggests it, no
repair is running and nothing waits for the loop, through the base's gate; since
``NODE_CONTINUES_WHILE_REPAIRING`` also while repairs of its node run, none holding or waiting
for the node's action slot: it carries them (``NodeCarry.repairs``) and the next run follows each
to its end, as a run started again does (a ladder exhausted waits for a person for weeks, its
node's health watched all the while). Runs since ``NODE_WATCH_GATE_PATCH`` also wait until the
health-watch loop rests at its watch, so a step it is in the middle of (a spot notice starting its
SpotReclaim) finishes, and its writes to the state are carried, in the run that began it.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any, Awaitable, Callable

from pydantic import BaseModel, ValidationError
from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy, SearchAttributeKey, WorkflowIDReusePolicy
from temporalio.workflow import ParentClosePolicy
from temporalio.exceptions import ActivityError, ApplicationError, FailureError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import workflows as flows
    from fleet.naming import node_queue, node_workflow_id, reclaim_workflow_id, repair_workflow_id, site_workflow_id
    from fleet.contracts import activities as act
    from fleet.messages.nodes import (
        FenceInput,
        HealthReport,
        NodeFacts,
        NodeFactsInput,
        SiteHealth,
        SiteHealthInput,
        UncontainInput,
        UncontainResult,
    )
    from fleet import search_attributes as sa
    from fleet.models import CapacityType, GpuHealth
    from fleet.repair_policy import MAX_XID_HITS_PER_GPU, Finding, RepairSettings, Rung, classify, conditions
    from workflows.entity import Entity
    from workflows.inputs import describe, first_problem, invalid_input, parse_input, parse_signal
    from workflows.steps import (
        CLUSTER_RETRY, FOLLOW_WAIT, LONG_WATCH_HEARTBEAT, LONG_WATCH_RETRY, QUICK, count_bad_report, failure_message,
        failure_text, show_details,
    )
    from fleet.messages.evacuation import AdmitRepairInput, IncidentClosed, RepairDecision
    from fleet.messages.watches import ClusterNodeState
    from fleet.messages.repair import (
        MAX_NODE_GPUS,
        GpuDecision,
        GpuRepairInput,
        GpuRepairResult,
        LeftRepair,
        NodeAction,
        NodeActionDone,
        NodeActionGrant,
        NodeActionRequest,
        NodeActionWait,
        NodeCarry,
        NodeEntityInput,
        NodeLeft,
        NodeQuarantine,
        NodeReport,
        NodeStatus,
        NodeWatchInput,
        NodeWatchResult,
        RepairGpuInput,
        RepairRef,
        ReturnGpuInput,
        RunningRepair,
    )

#: Workflow patch: repairs are admitted by the Site entity (provider incidents, fleet.incident).
ADMISSION_PATCH = "site-admission"
#: Fencing is a quick write to the cluster: a few tries inside the workflow task, then the
#: repair's own containment (or the next recheck) takes over.
FENCE_RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_interval=timedelta(seconds=2),
                          maximum_attempts=3)
ADMISSION_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10),
                              maximum_attempts=3)

#: Workflow patch: health and spot notices pulled by ``watch_node`` on the node's own queue.
HEALTH_WATCH_PATCH = "health-watch"
#: A watch returns unchanged after this long: the history grows by a few events per interval.
WATCH_MAX_WAIT = 300.0
#: Workflow patch (issue 37): an idle node costs at most 30 Temporal actions an hour, its watch's
#: heartbeats included. The watch waits ``WATCH_LONG_WAIT`` and its heartbeat timeout is
#: ``WATCH_LONG_HEARTBEAT`` unless the repair settings set ``watch_heartbeat_seconds`` (the agent
#: beats once per half of it): two activities and twelve heartbeats an hour. A node that falls
#: silent is not found by a short heartbeat but by the cluster: its Site entity's watch sees it
#: NotReady and signals ``cluster_state``, shown in the status (``not_ready_since``); when it is
#: Ready again the watch in flight (maybe held by an agent that is gone) is replaced at once.
NOT_READY_PATCH = "cluster-not-ready"
WATCH_LONG_WAIT = 1800.0
WATCH_LONG_HEARTBEAT = 600.0
#: The retries of one watch (heartbeat timeouts while the node reboots or is cut off)
#: span at most this long; then the entity asks the cluster whether the node is still there.
WATCH_GIVE_UP = timedelta(minutes=15)
WATCH_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
#: Workflow patch: a watch result observed longer ago than ``max_report_age_seconds`` is ignored.
STALE_REPORT_PATCH = "stale-reports"
#: Workflow patch: the node's facts (one read of the cluster's record and the config) are a local
#: activity, run inside the workflow task that needs them: a fault's path to its repair is one
#: workflow task shorter.
LOCAL_FACTS_PATCH = "node-facts-local"
#: Workflow patch: a sick GPU is fenced and its node cordoned in the workflow task that saw the
#: fault (a local activity), before the Site entity admits the repair and the GpuRepair starts:
#: no new pod lands on it while they decide, or while a provider incident holds the repair.
CONTAIN_FIRST_PATCH = "contain-first"
#: Stale results in a row, each observed afresh by the next watch, mean the node's clock is off
#: (not an outage in flight): act on the next one rather than never.
MAX_STALE_IN_A_ROW = 3

#: Workflow patch: what a node returns (watch results, the join's smoke-test state) is untrusted
#: input. The entity takes a watch's result undecoded (``RawValue``) and validates it itself, in
#: workflow code, against ``NodeReport``: decoding and validating are pure functions of the
#: recorded payload, so replay decides the same, and a malformed result is a bad report from the
#: node (logged, counted, shown; the next watch is scheduled) instead of a decode error failing
#: every workflow task. A control-plane activity could validate too, but would cost an activity
#: per watch and still hand back a payload the workflow must decode. Under the same patch an
#: error in one of the entity's background loops is shown and the loop restarted, never lost.
#: Asked only when something is wrong, so runs with good reports record no marker.
NODE_REPORTS_PATCH = "node-reports-checked"
#: Bad reports in a row after which the node is quarantined: cordoned (its GPU 0 fenced, as any
#: finding does, for the whole node) and handed to the repair ladder from a reboot, which escalates
#: if it recurs. A quarantine that names GPUs (an evacuation's proof) fences and repairs those.
MAX_BAD_REPORTS_IN_A_ROW = 3
QUARANTINE_RUNG = Rung.REBOOT
#: A background loop that failed is restarted after this pause, doubling up to the maximum: a
#: loop that fails at once every time costs a timer per restart, not a spinning workflow task.
LOOP_RESTART_FIRST = timedelta(seconds=1)
LOOP_RESTART_MAX = timedelta(minutes=5)
#: A bad report is named in the log and details by its first problem, cut to this length.
MAX_PROBLEM_SHOWN = 300

#: Workflow patch: every patch above is decided once, by this one, in the run's first workflow
#: task, and a run that has it takes each one's new path without asking again. Asked where
#: each branch is (after a local activity), ``patched`` could not replay: a local activity's
#: result may reach the workflow in the next workflow task (the task is completed with the
#: activity's marker and a new one forced), while the replay resolves it from that marker in the
#: same task; a patch asked next is then asked one task early on replay, answers False, and its
#: marker one task later fails the replay ("patch marker ... no corresponding change command":
#: seen under load in tests/security/test_self_labels.py). Runs from before it ask as before.
#: The rule: docs/design/patches.md.
NODE_PATCHES_AT_START = "node-patches-at-start"
#: Workflow patch (issue 38, the entity gate): the health-watch loop is an own task of the entity,
#: resting at its watch (and at a restart's pause); continue-as-new waits until it rests. Before
#: it a run continued in the middle of the loop's step (a spot notice's facts read, its
#: SpotReclaim not yet started): the step and its writes to the state (the acknowledged watch
#: sequence, the notice) were lost, and the next run took the notice again. Asked at the start of
#: the run behind ``self._settled or`` (the rule for a new Node patch, docs/design/patches.md):
#: runs from before ``NODE_PATCHES_AT_START`` keep the old gate. A settled run already open when
#: this deploys takes the new gate on its next task, and its history still replays: the new
#: path differs from the old only where the old one continued as new, which ended that run.
NODE_WATCH_GATE_PATCH = "node-continue-when-watch-rests"
#: Workflow patch, asked first thing like ``NODE_PATCHES_AT_START`` and with a marker of its own
#: (each changes commands in the middle of a run open at the deploy, so ``self._settled or``
#: cannot carry them). Two changes:
#: - A ``cluster_state`` that lands in a run's first workflow task (sent while the run before
#:   continued as new, or with the start) counts. The SDK runs a first task's signal handlers
#:   before ``run``, when the run had not yet decided that the cluster tells it anything, so the
#:   NotReady was dropped: the node was not known silent, and its Ready-again did not replace
#:   the watch an agent that is gone may hold (up to its 10-minute heartbeat timeout).
#: - Watches are paced: an honest agent answers when the node's state changed or at the watch's
#:   wait (minutes). Answers long before it that change nothing (unchanged, bad, late or stale:
#:   more than ``WATCH_IDLE_FREE`` in a row) or too many early ones of any kind
#:   (``WATCH_EARLY_FREE``: a node flapping its state) are a node driving the control plane's
#:   load (a workflow task, an activity and up to half a megabyte of history each: 100 round
#:   trips in 10 s were measured). Past those, each next watch waits a pause that doubles (the
#:   repair settings' ``watch_pace_seconds`` to ``watch_pace_max_seconds``: 5 s to 5 minutes)
#:   until an answer comes at its wait.
NODE_PATCHES_AT_START_2 = "node-patches-at-start-2"
#: Workflow patch, asked first thing right after ``NODE_PATCHES_AT_START_2`` (runs that have it),
#: with a marker of its own for the same reason: a run open at the deploy may hold the old path's
#: commands in its middle. A repair that ended (cancelled, failed, terminated) while its request for
#: the node's action slot was queued no longer holds a place in the queue: its watcher drops the
#: request when it sees the repair end, and ``_grant_next`` skips a request of a repair this run saw
#: end. Before it the slot, once free, went to the ended repair: the grant signal went to a closed
#: workflow, and an action record for a reboot or reinstall that never ran was kept, started after
#: the faults queued behind it were detected, so it "covered" them and their repairs skipped their
#: own action (the GPU unrepaired, proven only by a smoke test). Under it, too, a grant the repair
#: never received (its signal failed: the repair had closed) leaves no action record.
NODE_PATCHES_AT_START_3 = "node-patches-at-start-3"
#: Workflow patch, asked first thing right after ``NODE_PATCHES_AT_START_3`` (runs that have it),
#: with a marker of its own for the same reason. A finding on a GPU an admitted node is known to
#: lack (its facts, read before, say it has fewer) is ignored without reading the facts again, with
#: one log line a report. Before it each such finding cost a facts read (a local activity) before
#: ``_act`` ignored it: a node naming fatal XIDs on all 64 GPUs a report may name drove a facts read
#: for each one it lacks, every report (62 for a 2-GPU node).
#: Under it, too, the facts read, the fence and the un-fence are regular activities, not local
#: ones: a query answered while a local activity ran lets the worker complete the workflow task
#: with the activity's marker and hand its result to the workflow only in the next task, together
#: with whatever happened meanwhile (a watch's answer, a signal). The code after the activity then
#: ran after the health-watch loop's next command, where a replay, resolving the activity from its
#: marker a task earlier, runs it before: a nondeterminism that wedges the entity once it is
#: replayed (a worker restart). A regular activity's result is an event of its own, in order.
NODE_PATCHES_AT_START_4 = "node-patches-at-start-4"
#: Workflow patch, asked first thing right after ``NODE_PATCHES_AT_START_4`` (runs that have it),
#: with a marker of its own for the same reason. A repair queued for the node's action slot is told
#: who holds it and until when it is expected back (``node_action_wait``: the holder, its rung, since
#: when, and that plus the rung's timeouts, ``RepairSettings.slot_seconds``), when it queues and again
#: whenever the holder or its place in the queue changes; its details say so. Before it a queued
#: repair said only that it waited, and nobody could tell a slow reboot ahead of it from a stuck one.
NODE_PATCHES_AT_START_5 = "node-patches-at-start-5"
#: Workflow patch, asked first thing right after ``NODE_PATCHES_AT_START_5`` (runs that have it),
#: with a marker of its own for the same reason. A reclaim notice from a node whose site is not
#: spot (on-demand, owned; or a site gone from the config), as the node's facts say (the join's
#: record and the config, never the node), is ignored: a bad report, logged once (an agent repeats
#: its notice in every answer; only a new one counts), and no SpotReclaim. Before it any node's
#: notice started ``reclaim/<node>``, which drains by the node's deadline, retires the machine
#: past PodDisruptionBudgets and buys a replacement.
NODE_PATCHES_AT_START_6 = "node-patches-at-start-6"
#: Workflow patch, asked first thing right after ``NODE_PATCHES_AT_START_6`` (runs that have it),
#: with a marker of its own for the same reason. Two changes:
#: - Only a node-wide action (a reboot, reinstall or replace) covers another repair's request for
#:   the slot. A reset is ``nvidia-smi -r -i <gpu>``: it resets its own GPU alone, and repair ids
#:   are one per GPU (``repair/<node>/gpu<i>``), so it covers no other repair. Before it GPU 0's
#:   reset "covered" GPU 1's reset queued behind it, and GPU 1 went to its proof never reset.
#: - Search attributes are upserted only where their value differs from the run's own
#:   (``workflow.info().typed_search_attributes``: set by the join's start, carried over
#:   continue-as-new). Before it every run upserted ``NodeName`` and ``FleetState`` at its start,
#:   and every facts read ``Site``: a continued run paid two upserts to change nothing.
#: The facts read at a continued run's start stays: it is how a running node's entity sees a change
#: of the config's repair settings (the watch's heartbeat and pace, the report age bound, the XID
#: thresholds), which a healthy node otherwise never reads again.
NODE_PATCHES_AT_START_7 = "node-patches-at-start-7"
#: Workflow patch, asked first thing right after ``NODE_PATCHES_AT_START_7`` (runs that have it),
#: with a marker of its own for the same reason. The watch's pace (its counts of early and idle
#: answers, and the pause it is in) goes over continue-as-new with the state, and a run's first
#: watch waits out the pause the run before was in. Before it each run counted afresh and watched
#: at once: a node answering at once with a new digest each time (30 early answers free) and
#: padding (each answer up to the gateway's 512 KiB, so the server suggests continue-as-new every
#: ~9 answers) was never paced, an endless chain of ~4 MB runs.
NODE_PATCHES_AT_START_8 = "node-patches-at-start-8"
#: Workflow patch, asked in a run the site sweep started again (``started_again``), first thing in
#: ``run`` once its input is read, with a marker of its own: such a run before it issued its first
#: watch where this path first reads what was left. Before its first step the run takes as its
#: state what the cluster and Temporal show of the node (``node_left``), which the run before kept
#: and took with it: a GPU fenced with no repair running is held for a person (``return_gpu`` and
#: ``repair_gpu`` take it; before, they refused it as "not held for a person", nothing alerted, and
#: the GPU stayed fenced, the node maybe cordoned, for good); a repair still running is followed to
#: its end (``repair_end``: an unproven end holds its GPU for a person, as a child's does), and its
#: request for the node's action slot, or its hold of it, taken over (before: its request had gone
#: to the run before and it waited for a grant for good, or a second repair was granted the slot
#: beside the action it ran). A cluster that does not answer leaves the run as it was before, logged.
STARTED_AGAIN_PATCH = "node-started-again-takes-what-was-left"
#: Workflow patch, asked in a run under ``STARTED_AGAIN_PATCH`` where what was left names a GPU fenced on
#: hold (``NodeLeft.on_hold``: the run before fenced it and its site or the cluster held the finding, no
#: repair started), behind ``self._settled_7 and`` (true in every such run: it runs no local activity, so
#: the patch may be asked there). The GPU's finding went with the run before: it is taken on hold again
#: (``LEFT_ON_HOLD``), its fence the entity's, and the next recheck asks its site again, as that run
#: would have; admitted, its repair starts at a reset. Before it the GPU was held for a person as if a
#: repair had ended unproven (``return`` or ``retry`` the only way out).
STARTED_AGAIN_RECHECKS_PATCH = "node-started-again-rechecks-what-was-on-hold"
#: The reason of a finding a run started again takes from a fence on hold (what the finding was went with
#: the run before): its recheck never takes a clean snapshot for healed (a fatal XID, an event, is not
#: undone by one), so the GPU is repaired once its site admits it.
LEFT_ON_HOLD = "fenced on hold when the entity was started again"
#: ``node_left``: a describe and up to ``LADDER_QUERY_TRIES`` ladder queries (10 s each) per GPU, the
#: GPUs read side by side; it heartbeats after each answer.
NODE_LEFT_TIMEOUT = timedelta(minutes=3)
NODE_LEFT_HEARTBEAT = timedelta(seconds=30)
WATCH_IDLE_FREE = 3
WATCH_EARLY_FREE = 30
#: Workflow patch, asked where an early watch answer (back before half its wait) is larger than
#: ``WATCH_FREE_BYTES`` (its payload's data, as the entity takes it undecoded), behind
#: ``self._settled_7 and`` (such a run runs no local activity, so it may be asked there). Such an
#: answer counts for the watch's pace as ``ceil(size / WATCH_FREE_BYTES)`` early answers (a 128 KiB
#: one, the gateway's bound, as 8 of the ``WATCH_EARLY_FREE``). An honest answer is small (about 300
#: bytes a GPU and 90 a pending XID event: 3 KB for 8 GPUs) and counts once, as before. Before it
#: every answer counted once, whatever its size: a node padding each early answer to the gateway's
#: bound and changing its digest wrote 30 of them free, again after every answer at half the
#: watch's wait, about 16 MiB an hour of history into the store every workflow shares (14 days
#: retention: ~5 GiB a node).
NODE_PACES_ANSWER_BYTES = "node-paces-answer-bytes"
WATCH_FREE_BYTES = 16 * 1024
#: Workflow patch, asked where the bytes a node's watch answers wrote outrun
#: ``repair.timeouts.watch_bytes_kib_per_hour`` (256 KiB) past a burst of ``watch_bytes_burst_kib``
#: (512 KiB) while the pace by counts would wait less (or not at all),
#: behind ``self._settled_7 and`` (such a run runs no local activity, so it may be asked there). Every
#: answer's bytes (its payload's data), early or at its wait, are charged against a budget that
#: refills with time, not with the answer's timing: the entity keeps ``NodeCarry.watch_bytes_until``,
#: the moment the bytes taken so far are paid for at that rate (a GCRA: each answer moves it
#: ``size / rate`` on from now or from where it was, whichever is later), and where that is more than
#: the burst's worth ahead of now, the next watch waits the difference (at most the largest answer's
#: worth, 30 minutes). In any hour a node writes at most the burst, the hour's refill and the one
#: answer that passed it (512 + 256 + 128 KiB: 0.9 MiB), and 256 KiB an hour for as long as it keeps
#: at it (~85 MiB over the 14 days' retention). The count of early answers is kept as it was (it
#: bounds round trips, not bytes). An honest node's answers (about 3 KB for 8 GPUs, 16 KiB at most)
#: come at the watch's wait, at most 12 an hour (36 KB, 192 KiB for the largest), and early only for
#: a change: a burst of the 30 free early ones is 90 KB (480 KiB at most), inside the burst, so the
#: patch is never asked for it and it is never paced by its bytes. Before it an answer at half the
#: watch's wait set the early answers' count back to 0 and was not charged at all: a node padding
#: every answer to the gateway's 128 KiB answered 4 early (32 counts, a pause of 10 s), then one at
#: half the wait, and again: about 20 answers of 128 KiB an hour, 2.5 MiB of history (~0.8 GiB a node
#: over retention).
NODE_CHARGES_EVERY_ANSWER_BYTES = "node-charges-every-answer-bytes"

#: A finding the entity cannot act on because the cluster did not answer its read of the node (the
#: API server away past the read's retries, a control-plane upgrade; or a refusal, ClusterForbidden
#: after an RBAC mistake) is kept on hold and the read tried again after a pause: the repair
#: settings' ``recheck_seconds`` at first, doubling up to this. The entity never ends for it: it
#: alone fences the node's GPUs, watches its health (spot notices too) and answers its repairs.
FACTS_RETRY_MAX = timedelta(minutes=10)

#: Bounded memory: XID event keys remembered for de-duplication, log lines kept.
MAX_SEEN = 512
MAX_LOG = 20

#: Workflow patch, asked where the run first tells its queue for the action slot (``_tell_the_queue``;
#: only in runs under ``NODE_PATCHES_AT_START_5``, which run no local activity, so it may be asked
#: there). A repair queued for the slot is told once, when it queues: the holder and until when, how
#: many are ahead of it, the request right ahead of it and when its own turn is expected at the latest
#: (the holder's expected return plus the slot times of those ahead); and once more only when it is
#: next in line behind a holder it was not told of. At most two ``node_action_wait`` per request: 2Q-3
#: for Q repairs queued together (13 for 8). Before it every waiter was told again each time the slot
#: changed hands or its place moved: Q(Q-1)/2 (28 for 8). The node's status lists the queue as it is.
NODE_TELLS_THE_QUEUE_ONCE = "node-tells-the-queue-once"
#: Workflow patch, asked in ``node_action_done`` where a repair gives the slot back unused
#: (``NodeActionDone.acted`` false: the grant reached a held repair, which ran nothing and asks
#: again once released), behind ``self._settled_7 and`` (such a run runs no local activity, so it may
#: be asked there). The grant's action record goes: no action ran, so none covers another repair's
#: fault. Before it the give-back finished the record like any action's, and a reboot (or a
#: replace) that never ran "covered" the repairs queued behind it, which skipped their own action
#: (a covering replace: they ended "replaced" with the machine still there).
NODE_SLOT_BACK_UNUSED = "node-slot-given-back-unused"
#: Workflow patch, asked where a watch failed before its heartbeat timeout could have ended it (the
#: node's agent failed it: an honest agent fails a watch by not answering, which takes that long),
#: behind ``self._settled_7 and`` (such a run runs no local activity, so it may be asked there). Such
#: a failure counts for the watch's pace as an early answer that changed nothing (``_pace_watch``):
#: past ``WATCH_IDLE_FREE`` in a row the next watch waits a pause. Before it the entity read the
#: node's facts and watched again at once: a node failing every watch non-retryably (the gateway
#: forwards the flag) drove 419 round trips in 10 s, each a workflow task on the shared queue, two
#: activities, two reads of the API server and a dozen history events (5,063 in 10 s), past
#: continue-as-new while a repair of it runs (the entity continues only with none).
NODE_PACES_FAILED_WATCHES = "node-paces-failed-watches"
#: Workflow patch, asked before a health watch where the run's history has passed
#: ``repair.timeouts.watch_pace_history_mib`` (16 MiB) or ``WATCH_PACE_HISTORY_EVENTS`` events, behind
#: ``self._settled_7 and`` (such a run runs no local activity, so it may be asked there). Only a run
#: that may not continue as new gets there (the server suggests it at 4 MB or 4,096 events): a
#: repair of the node runs, which the node itself can make last (it reports a fatal XID, holds its
#: reset), while each of its watch answers, a change or not, may add half a megabyte (the gateway's
#: bound) to the history. Since ``NODE_CONTINUES_WHILE_REPAIRING`` the run continues while repairs
#: run, so only one holding the node's action slot (or a request queued for it) keeps it: a ladder
#: exhausted that waits for a person no longer does, and is not paced. Each next watch then waits a
#: pause, from ``watch_pace_max_seconds`` doubling with every watch up to ``WATCH_PACE_HISTORY_MAX``,
#: or until the run may continue as new (no repair of the node runs; since
#: ``NODE_CONTINUES_WHILE_REPAIRING`` none holds or waits for the slot).
#: Before it the pace let a node through 30 free answers a change each, again after every answer at
#: half the watch's wait: about 15 MB of history every 15 minutes, and the server terminated the
#: entity at 50 MB ("Workflow history size exceeds limit"): its node watched by nothing, its
#: repairs' action slot answered by nobody, until the site sweep started it again.
NODE_PACES_A_LONG_HISTORY = "node-paces-a-long-history"
WATCH_PACE_HISTORY_EVENTS = 16_384
#: The longest of those pauses, and the shortest first one (``watch_pace_max_seconds`` may be set
#: lower): past the bound a node gets at most 17 answers more in the first year at the default pace
#: (8.5 MB), then one a year, and at most 26 (13 MB) at any pace, so at the highest bound the
#: settings allow (24 MiB) its history stays under 40 MB; Temporal's limits are 50 MB and 51,200 events.
WATCH_PACE_HISTORY_MAX = timedelta(days=365)
WATCH_PACE_HISTORY_FIRST = timedelta(seconds=0.5)
#: Workflow patch, asked where the site first holds a finding for its incident in a run
#: (``_admitted_by_site``, after the ``admit_repair`` activity), behind ``self._settled_7 and`` (such
#: a run runs no local activity, so it may be asked there). A finding held for an incident is
#: looked at again after a pause that doubles from the settings' ``recheck_seconds`` up to
#: ``HELD_RECHECK_MAX``, or at once when the Site entity says the incident closed (``incident_closed``,
#: sent by a Site under ``site-tells-held-nodes``); the node's details and status say until when.
#: Before it every held GPU was rechecked every ``recheck_seconds`` (30 s) for the whole incident: a
#: facts read, an ``admit_repair`` update on the Site entity and a log line each, about 360 Temporal
#: actions an hour per held GPU. Now a few an hour, and the repair is admitted within seconds of the
#: close. A hold that names no incident (the site reconciling after the control plane came back) is
#: short, and rechecked every ``recheck_seconds`` as before.
NODE_PACES_HELD_RECHECKS = "node-paces-held-rechecks"
#: The longest pause between two looks at a finding its site holds for an incident: a close the
#: node was not told of (a Site entity reset mid-incident) is seen this late at the latest.
HELD_RECHECK_MAX = timedelta(minutes=10)
#: Workflow patch, asked at the continue-as-new gate where the server (or ``renew``) asks the run to
#: continue while repairs of the node run, none holding or waiting for the node's action slot (and in
#: ``_pace_long_history``, past its bound with a repair running), behind ``self._settled_7 and`` (such a
#: run runs no local activity, so it may be asked there). The run continues as new all the same: each
#: repair's watcher rests at its wait for the repair's end, and the repairs go with the state
#: (``NodeCarry.repairs``: the repair id and the finding it was started for); the next run follows
#: each to its end (``repair_end``, as a run started again does: an unproven end holds its GPU for a
#: person), and the repairs' signals (``node_action_request``, ``node_action_done``) reach it, sent to
#: the workflow id. One that ends as the run continues is seen ending by the next run's ``repair_end``.
#: A repair acting with the slot, or a request queued for it, still holds the run (the holder and the
#: queue are not carried): ``NODE_PACES_A_LONG_HISTORY`` is the backstop there. Before it the run
#: continued only with no repair running: a ladder exhausted that waits for a person (weeks) kept it,
#: and past ``watch_pace_history_mib`` or ``WATCH_PACE_HISTORY_EVENTS`` (about ten days of an honest
#: node's watches) every next watch of its other GPUs waited a pause doubling up to a year.
NODE_CONTINUES_WHILE_REPAIRING = "node-continues-while-repairing"
#: Workflow patch, asked where a ``cluster_state`` says the node was deleted from the cluster (its Site
#: entity's watch saw its Node object go: retired, removed by hand; ``site-tells-deleted-nodes``), behind
#: ``self._settled_7 and`` (such a run runs no local activity, so it may be asked there). The word alone
#: ends nothing: the loop reads the node's facts, and only where the cluster does not know the node (a
#: node that joined again under the name since is there again, and watched on) is the watch in flight
#: cancelled and the entity ended, "replaced or removed", as for a watch that failed on a node the
#: cluster no longer knows. A repair of the node still running decides as before (the word is logged).
#: Before it (and in a run from before ``NODE_PATCHES_AT_START_7``) the word was taken as NotReady, and
#: the entity ran on, its watch pending on a queue no agent polls, listed as a live node, until the
#: watch's retries ran out (30 minutes' wait plus 3 heartbeat timeouts of 10: up to an hour).
NODE_ENDS_WHEN_TOLD_DELETED = "node-ends-when-told-deleted"
#: Workflow patch, asked where ``NODE_ENDS_WHEN_TOLD_DELETED``'s word comes while a repair of the node
#: runs, behind ``self._settled_7 and`` (such a run runs no local activity, so it may be asked there).
#: The word is kept (``NodeCarry.deleted_seen_at``, carried over continue-as-new) and taken again once
#: no repair runs: the facts read decides as for a word that came with none (the cluster does not know
#: the node: the entity ends "replaced or removed"; it has it again: the word dropped). Before, the word
#: was logged and dropped: a repair that ended other than replaced (a reset that failed and was
#: cancelled, a ladder exhausted, a cancel) left the entity on a node the cluster no longer has, maybe
#: holding it for a person (``GpufleetNodeNeedsPerson`` firing), until its watch's retries ran out.
NODE_TAKES_TOLD_DELETED_AFTER_REPAIR = "node-takes-told-deleted-after-its-repair"
#: Workflow patch, asked in the ``quarantine`` signal's handler where the signal names GPUs (``gpus``,
#: ``evacuation-quarantines-the-failing-gpus``) or holds the node for a person (``hold_for_person``,
#: ``evacuation-tells-the-node-it-waits-for-a-person``), not behind ``self._settled``: as
#: ``entity-renews``, where the signal is taken (a first task's signal comes before ``run`` asks its
#: at-start patches). A worker of the release before dropped such a payload (its ``NodeQuarantine``
#: knew neither field, extra="forbid"); a new worker replaying that run later would have taken it and
#: issued the fence and repair (or the hold) the history lacks: nondeterminism, the entity stuck.
#: Without the marker the payload is dropped as it was; a plain quarantine (a reason alone) asks nothing.
NODE_QUARANTINE_NAMES_PATCH = "node-quarantine-takes-gpus-and-holds"


def _xid_key(gpu: GpuHealth, index: int) -> str:
    event = gpu.xid_events[index]
    return f"{gpu.index}:{event.xid}:{event.at.timestamp():.6f}"


def _last_seen(gpu: GpuHealth) -> GpuHealth:
    """What the state keeps of a GPU's last health (``latest``): a recheck asks only whether the
    GPU still shows a problem (``problems()``, where any XID event is one), so one event without
    its message is enough; the ledger and ``seen_xids`` keep what the events decide. Carried
    whole, 64 events of 1,000-character messages per GPU made the state megabytes."""
    last = [event.model_copy(update={"message": ""}) for event in gpu.xid_events[-1:]]
    return gpu.model_copy(update={"xid_events": last})


def _condition_words(gpu: GpuHealth) -> list[str]:
    words = sorted(conditions(gpu))
    if gpu.recovery_action:
        words.append(f"recovery action {gpu.recovery_action}")
    return words


@workflow.defn(name="Node")
class NodeEntity(Entity[NodeCarry]):
    #: ``run``'s input: the input guard refuses its ``Carried`` fields in a run that did not continue as new.
    INPUT = NodeEntityInput

    def __init__(self) -> None:
        #: The state: everything the entity knows, carried over continue-as-new (findings on hold included).
        super().__init__(NodeCarry())
        self._node = ""
        # The cluster's view of the node, read again before each decision (and by each run).
        self._facts: NodeFacts | None = None
        # From the join that started this run, until the facts are read (and then outdated by them).
        self._joined_site = ""
        self._joined_settings: RepairSettings | None = None
        # In flight: messages not yet handled, running repairs (each watched by an own task), the
        # action slot. Continue-as-new waits until all are empty, so none of them needs carrying; since
        # ``NODE_CONTINUES_WHILE_REPAIRING`` all but the running repairs, which are carried
        # (``NodeCarry.repairs``: each with the finding it was started for, ``_repaired_for``).
        self._pending: list[HealthReport] = []
        self._active: dict[int, str] = {}
        self._repaired_for: dict[int, Finding] = {}
        #: ``NODE_CONTINUES_WHILE_REPAIRING``, asked where the run could first continue with repairs
        #: running (None: not yet asked).
        self._continues_repairing: bool | None = None
        self._requests: list[NodeActionRequest] = []
        self._holder: str | None = None
        self._wake = False
        self._gone = False
        self._watching: asyncio.Task | None = None
        self._stale_in_a_row = 0
        #: The join's smoke-test state: the first watch's result (taken once, not on a restart).
        self._first_state: Any = None
        #: A quarantine queued for the loop (K bad reports in a row, or the ``quarantine`` signal),
        #: which acts on it like on any finding.
        self._quarantine: Finding | None = None
        #: The GPUs that quarantine names (the ``quarantine`` signal's ``gpus``); empty: the whole node.
        self._quarantine_gpus: list[int] = []
        #: Quarantines that start no repair (``NodeQuarantine.hold_for_person``: the node's agent cannot
        #: run its compute check), queued for the loop, which holds the node for a person.
        self._person_holds: list[str] = []
        self._last_bad_report = ""
        self._loop_restarts = 0
        #: ``NOT_READY_PATCH``: the watch in flight (replaced when the node is Ready again).
        self._told_by_cluster = False
        self._watch_handle: workflow.ActivityHandle | None = None
        #: ``NODE_ENDS_WHEN_TOLD_DELETED``: its site saw the node deleted from the cluster (when, epoch
        #: seconds), not yet confirmed by the loop. Not carried: the gate does not continue with it set.
        self._told_deleted: float | None = None
        self._rewatch = False
        #: ``NODE_PATCHES_AT_START``: this run takes every patch's new path (asked once, first).
        self._settled = False
        #: ``NODE_WATCH_GATE_PATCH``: the health-watch loop is an own task (asked once, first).
        self._gate_waits_watch = False
        #: ``NODE_PATCHES_AT_START_2`` (asked once, first): first-task cluster_state; paced watches.
        self._settled_2 = False
        #: ``NODE_PATCHES_AT_START_3`` (asked once, first): an ended repair's slot requests are dropped.
        self._settled_3 = False
        #: ``NODE_PATCHES_AT_START_4`` (asked once, first): findings on GPUs known lacking read no facts.
        self._settled_4 = False
        #: ``NODE_PATCHES_AT_START_5`` (asked once, first): queued repairs are told who holds the slot.
        self._settled_5 = False
        #: Repair id → what it was last told while queued for the slot: the holder and how many ahead.
        self._told: dict[str, tuple[str, int]] = {}
        #: ``NODE_TELLS_THE_QUEUE_ONCE``, asked where the queue is first told (None: not yet asked).
        self._tells_once: bool | None = None
        #: ``NODE_PATCHES_AT_START_6`` (asked once, first): only a spot site's node is reclaimed.
        self._settled_6 = False
        #: ``NODE_PATCHES_AT_START_7`` (asked once, first): a reset covers no other repair; search
        #: attributes upserted only when they change.
        self._settled_7 = False
        #: Repairs this run watched end (``NODE_PATCHES_AT_START_3``): a request of one that reaches
        #: the queue late (sent as it ended) is never granted. One id per GPU at most; a new repair of
        #: the GPU (the same id) takes its id out again.
        self._ended: set[str] = set()
        #: ``STARTED_AGAIN_PATCH``: reading what the run before left (a person's update waits for it).
        self._taking_what_was_left = False
        #: ``STARTED_AGAIN_PATCH``: this run took what the run before left (it may have taken a holder of
        #: the action slot over), and the repairs whose ``node_action_done`` came while it read that:
        #: their action is over, whatever ``node_left`` read of them before.
        self._took_what_was_left = False
        self._done_while_taking: set[str] = set()
        #: ``NODE_PATCHES_AT_START_8`` (asked once, first): the watch's pace is carried.
        self._settled_8 = False
        #: ``NODE_PACES_A_LONG_HISTORY``: the watches this run paused for its long history (each
        #: pause twice the one before). Not carried: the next run's history starts short.
        self._long_history_pauses = 0
        #: The cluster did not answer the last read of the node: findings wait on hold, unread, until
        #: this time, then the read is tried again (``_facts_or_wait``); the pause doubles each time.
        self._facts_retry_at: datetime | None = None
        self._facts_pause = timedelta(0)
        #: ``NODE_PACES_HELD_RECHECKS``, asked where the site first holds a finding for an incident
        #: (None: not yet asked). The next look at such findings, the pause it ends, and an
        #: ``incident_closed`` from the site not yet acted on (the incident's id).
        self._paces_holds: bool | None = None
        self._held_until: datetime | None = None
        self._held_pause = timedelta(0)
        self._incident_closed = ""

    # -- signals and queries ---------------------------------------------------------------
    # No signal handler awaits: each changes the state in one step, most only queue for the loop.
    # Three writers change the state across awaits: the loop and a person's ``return_gpu`` and
    # ``repair_gpu`` (findings and repairs: on hold, fenced, held for a person, ledger) each hold
    # ``state_lock`` across their change (entity rule 2, ``workflows.entity``); the health-watch
    # loop changes its own part (what the node reported: the watch's sequence, digest and spot
    # notice, bad reports); the rest (the log, a quarantine's reason, a repair's end, the action
    # slot) changes in one step. The lock is never held at the continue-as-new gate, which waits
    # for the updates to finish.
    @workflow.signal
    def health_report(self, report: HealthReport) -> None:
        self._pending.append(report)

    def on_renewal_asked(self) -> None:
        # The loop's wait does not include the suggestion: it looks after each watch, which may
        # rest for hours on an idle node. Woken, it goes to its gate once nothing is in flight
        # (a repair's end or the action slot's return wakes it again; since
        # NODE_CONTINUES_WHILE_REPAIRING repairs running are carried), where the watch is left.
        self._wake = True

    @workflow.signal
    def quarantine(self, raw: Any) -> None:
        """The node failed someone else's proof (an evacuation's smoke test): the loop cordons
        it and hands it to the repair ladder, like K bad reports in a row."""
        if (order := parse_signal(NodeQuarantine, raw, "quarantine")) is not None:
            if (order.gpus or order.hold_for_person) and not workflow.patched(NODE_QUARANTINE_NAMES_PATCH):
                # A worker of the release before dropped this payload (its model knew neither field,
                # extra="forbid"): so does its replay, which issues nothing for it.
                workflow.logger.warning("dropped signal quarantine: gpus or hold_for_person (a run from before %s)",
                                        NODE_QUARANTINE_NAMES_PATCH)
                return
            if order.hold_for_person:
                # No repair: the loop holds the node for a person (``_hold_for_person``).
                self._person_holds.append(order.reason)
                self._wake = True
                return
            # Once ``run`` took its state (one sent before its first task keeps its reason).
            self.after_start(lambda: self._quarantined(order.reason, order.gpus or []))

    def _quarantined(self, reason: str, gpus: list[int]) -> None:
        # Shown before the loop acts (its repair's details replace these), and kept in the log.
        named = f" (failing: GPU {', '.join(map(str, gpus))})" if gpus else ""
        self._log(f"quarantined{named}: {reason}", warn=True)
        self._show(f"quarantined{named}: {reason}")
        self._quarantine_node(reason, gpus)

    @workflow.signal
    def incident_closed(self, raw: Any) -> None:
        """The Site entity that held this node's repairs for its incident says it closed: the
        findings on hold are looked at now, not at the end of their pause (``NODE_PACES_HELD_RECHECKS``;
        a run that rechecks every ``recheck_seconds`` takes no notice)."""
        if (told := parse_signal(IncidentClosed, raw, "incident_closed")) is not None:
            self._incident_closed = f"site/{told.site}: {told.incident} closed"

    @workflow.signal
    def cluster_state(self, raw: Any) -> None:
        """The node's Site entity saw it turn NotReady in the cluster (its kubelet fell silent) or
        Ready again. Ready after NotReady: the watch in flight may be held by an agent that is
        gone (its heartbeat timeout is long), so it is replaced now. Deleted from the cluster
        (``NODE_ENDS_WHEN_TOLD_DELETED``): confirmed by the cluster's record, the entity ends."""
        if (told := parse_signal(ClusterNodeState, raw, "cluster_state")) is not None:
            # Once ``run`` took its state and decided ``_told_by_cluster`` (one sent before its
            # first task counts under ``NODE_PATCHES_AT_START_2``).
            self.after_start(lambda: self._take_cluster_state(told))

    def _take_cluster_state(self, told: ClusterNodeState) -> None:
        if not self._told_by_cluster:
            return
        if told.deleted and self._settled_7 and workflow.patched(NODE_ENDS_WHEN_TOLD_DELETED):
            # Confirmed by the loop (a facts read): a signal handler never awaits.
            self._told_deleted = told.observed_at or workflow.now().timestamp()
            self._wake = True
            return
        carry = self.state
        if not told.ready:
            if carry.not_ready_since is None:
                carry.not_ready_since = told.observed_at or workflow.now().timestamp()
                self._log("NotReady in the cluster: its kubelet is silent", warn=True)
            return
        if carry.not_ready_since is None:
            return
        self._log(f"Ready again in the cluster after {told.observed_at - carry.not_ready_since:.0f}s "
                  "NotReady: watching afresh")
        carry.not_ready_since = None
        self._replace_watch()

    def _replace_watch(self) -> None:
        """Cancel the watch in flight; the loop schedules the next at once (no question to the
        cluster). For a watch an agent that is gone may hold until its long heartbeat timeout."""
        if self._watch_handle is not None and not self._watch_handle.done():
            self._rewatch = True
            self._watch_handle.cancel()

    @workflow.signal
    def node_action_request(self, request: NodeActionRequest) -> None:
        if self._took_what_was_left and request.repair_id == self._holder:
            # A repair asks for the slot only once its last action is done: one this run took over as
            # holding it (``_follow``) gave it back to no run that could hear it. Its new request is its
            # give-back, or it would wait behind itself for good, the node fenced, other repairs starved.
            self._log(f"{request.repair_id} asked for the node's action slot while holding it: its action "
                      "is taken as done", warn=True)
            self._finish_action(request.repair_id)
        self._requests.append(request)

    @workflow.signal
    def node_action_done(self, done: NodeActionDone) -> None:
        if self._taking_what_was_left:  # ``node_left`` may have read it acting: ``_follow`` must not hold it
            self._done_while_taking.add(done.repair_id)
        if not done.acted and self._settled_7 and workflow.patched(NODE_SLOT_BACK_UNUSED):
            self._drop_action(done.repair_id)
            self._log(f"{done.repair_id} gave the node's action slot back unused (held): no {done.rung} ran")
            return
        self._finish_action(done.repair_id)
        # The node booted again (its repair waited for a new boot id): the watch in flight was
        # held by the agent of the boot before, which may have died without a word. A reboot
        # quicker than the cluster's grace period is never seen NotReady, so ``cluster_state``
        # would not replace it and it would wait out its heartbeat timeout (10 minutes).
        if self._settled and self._told_by_cluster and done.rung in (Rung.REBOOT, Rung.REINSTALL):
            self._replace_watch()

    @workflow.query
    def status(self) -> NodeStatus:
        return NodeStatus(
            node_name=self._node, state=self.state.state, site=self._facts.site if self._facts else self._joined_site,
            boot_id=self.state.boot_id, reports=self.state.reports,
            active_repairs={str(k): v for k, v in self._active.items()}, app_xids=self.state.ledger.app_xids,
            remediations=len(self.state.ledger.remediations), node_actions=self.state.actions,
            slot_queue=[r.repair_id for r in self._queued()],
            deferred=sorted(self.state.deferred), fenced=sorted(self.state.fenced), log=self.state.log,
            held_until=self._held_until.timestamp() if self._held_until else None,
            bad_reports=self.state.bad_reports, bad_reports_in_a_row=self.state.bad_reports_in_a_row,
            last_bad_report=self._last_bad_report, loop_restarts=self._loop_restarts,
            not_ready_since=self.state.not_ready_since,
            needs_person={str(gpu): why for gpu, why in sorted(self.state.needs_person.items())},
        )

    # -- a person's decision on a GPU held for a person --------------------------------------
    # A GPU whose repair ended unproven (cancelled, failed, terminated) stays fenced and its node
    # cordoned (``needs_person``) until a new finding starts a repair, which a clean GPU never
    # reports. These two are a person's way out.
    @workflow.update
    async def return_gpu(self, raw: Any) -> GpuDecision:
        """Back in service on a person's word: un-fence the GPU; the node is uncordoned unless
        another GPU of it is fenced (one under repair is: its repair fenced it)."""
        order = parse_input(ReturnGpuInput, raw)
        index = order.gpu
        await self.until_started()  # the GPUs held for a person are the state's
        async with self.state_lock:  # the loop changes fences and repairs across its awaits too
            self._require_held(index)  # again: a repair may have taken it over while this waited
            result = await self._unfence(index, by=f"returned to service by a person ({order.reason})")
            if result is None:  # still fenced and held for a person; the log says why
                raise ApplicationError(f"GPU {index} of {self._node} is still fenced: the cluster did not answer; "
                                       "try again", type="ClusterUnavailable", non_retryable=True)
            self.state.needs_person.pop(index, None)
            self.state.left_findings.pop(index, None)
            detail = f"GPU {index} returned to service by a person"
            if not self._active and self.state.state == "needs-person":
                self._set_state(self._idle_state(), detail)
            else:
                self._show(detail)
        return GpuDecision(
            node_name=self._node, gpu=index, outcome="returned", uncordoned=result.uncordoned,
            still_fenced=result.still_fenced, state=self.state.state,
            detail=f"GPU {index} of {self._node} un-fenced" + (
                ", node uncordoned" if result.uncordoned
                else f"; the node stays cordoned: GPUs {', '.join(map(str, result.still_fenced))} still fenced"),
        )

    @return_gpu.validator
    def _validate_return_gpu(self, raw: Any) -> None:
        gpu = parse_input(ReturnGpuInput, raw).gpu
        if self.started and not self._taking_what_was_left:  # else the handler checks, once the run has its state
            self._require_held(gpu)

    @workflow.update
    async def repair_gpu(self, raw: Any) -> GpuDecision:
        """A new GpuRepair of the GPU, by the path a finding takes (fenced, admitted by the Site
        entity, the node's repeat-fault limits applied), at the person's rung or where the policy
        starts for the finding its ended repair was started for (none known: a reset). The repair
        takes over the GPU's containment; held by the site, it waits like any finding."""
        order = parse_input(RepairGpuInput, raw)
        index = order.gpu
        await self.until_started()
        async with self.state_lock:  # the loop changes fences and repairs across its awaits too
            self._require_held(index)  # again: a repair may have taken it over while this waited
            last = self.state.left_findings.get(index)
            asked = f"a person asked ({order.reason})"
            start_at = order.rung if order.rung is not None else (last.rung if last and last.rung else Rung.RESET)
            finding = Finding(index=index, rung=start_at, reasons=[*(last.reasons if last else []), asked],
                              fatal_xids=list(last.fatal_xids) if last else [])
            before = self.state.log  # ``_log`` makes a new list: then its last line is what ``_act`` said
            # The rung started at (escalated by the limits), or None. A cluster that does not answer
            # is the person's to hear now (ClusterUnavailable): the GPU stays held, they try again.
            rung = await self._act(finding, answer_now=True)
            said = self.state.log[-1] if self.state.log is not before and self.state.log else ""
            repair_id = self._active.get(index, "")
            if rung is not None and repair_id:
                outcome, detail = "repairing", f"{repair_id} started at {rung}"
            elif index in self.state.deferred:  # the GPU stays fenced and held for a person meanwhile
                outcome = "awaiting-site"
                detail = f"{said or self.state.state}; the repair starts once the site admits it"
            else:
                raise ApplicationError(f"no repair of GPU {index} started: {said or self.state.state}",
                                       type="RepairNotStarted", non_retryable=True)
        return GpuDecision(node_name=self._node, gpu=index, outcome=outcome, detail=detail, repair_id=repair_id,
                           rung=rung, state=self.state.state)

    @repair_gpu.validator
    def _validate_repair_gpu(self, raw: Any) -> None:
        gpu = parse_input(RepairGpuInput, raw).gpu
        if self.started and not self._taking_what_was_left:  # else the handler checks, once the run has its state
            self._require_held(gpu)

    def _require_held(self, index: int) -> None:
        """Refuse, naming ``gpu``, a GPU the entity does not hold for a person."""
        if index in self.state.needs_person:
            return
        held = ", ".join(map(str, sorted(self.state.needs_person))) or "none"
        now = f"; {self._active[index]} repairs it" if index in self._active else ""
        raise invalid_input(f"gpu: GPU {index} of {self._node or 'this node'} is not held for a person{now} "
                            f"(held for a person: {held})", ["gpu"])

    # -- the loop --------------------------------------------------------------------------
    def _log(self, line: str, warn: bool = False) -> None:
        (workflow.logger.warning if warn else workflow.logger.info)("node %s: %s", self._node, line)
        self.state.log = [*self.state.log, line][-MAX_LOG:]

    def _set_state(self, state: str, detail: str = "") -> None:
        if state != self.state.state:
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(state)])
        self.state.state = state
        self._show(detail)

    def _show(self, detail: str = "") -> None:
        lines = [f"- GPU {gpu}: repair `{wid}`" for gpu, wid in sorted(self._active.items())]
        lines += [f"- GPU {gpu}: **needs a person**: {why}" for gpu, why in sorted(self.state.needs_person.items())
                  if gpu not in self._active]
        if self._holder:
            lines.append(f"node action slot held by `{self._holder}`")
        show_details(self.state.state, *lines, detail=detail)

    @workflow.run
    async def run(self, raw: Any) -> NodeStatus:
        self._settled = workflow.patched(NODE_PATCHES_AT_START)  # first: before any local activity
        self._gate_waits_watch = self._settled or workflow.patched(NODE_WATCH_GATE_PATCH)  # the same
        self._settled_2 = self._settled and workflow.patched(NODE_PATCHES_AT_START_2)
        self._settled_3 = self._settled_2 and workflow.patched(NODE_PATCHES_AT_START_3)
        self._settled_4 = self._settled_3 and workflow.patched(NODE_PATCHES_AT_START_4)
        self._settled_5 = self._settled_4 and workflow.patched(NODE_PATCHES_AT_START_5)
        self._settled_6 = self._settled_5 and workflow.patched(NODE_PATCHES_AT_START_6)
        self._settled_7 = self._settled_6 and workflow.patched(NODE_PATCHES_AT_START_7)
        self._settled_8 = self._settled_7 and workflow.patched(NODE_PATCHES_AT_START_8)
        if self._settled_2:
            self._told_by_cluster = True  # before ``start_with``: a first task's cluster_state counts
        inp = parse_input(NodeEntityInput, raw)
        self._node = inp.node_name
        self.start_with(inp.carry)
        if not self._settled_8:  # each run counted its watch's pace afresh
            self.state.watch_early_answers = self.state.watch_idle_answers = 0
        self._joined_site, self._joined_settings = inp.site, inp.settings
        takes_what_was_left = bool(inp.started_again) and self._settled_7 and workflow.patched(STARTED_AGAIN_PATCH)
        if inp.started_again and not takes_what_was_left:  # a run from before the patch: a log line
            self._log(f"{inp.started_again}; what that run knew (its repairs, GPUs held for a person) is not carried",
                      warn=True)
        self._upsert_search_attributes((sa.NODE_NAME, self._node), (sa.FLEET_STATE, self.state.state))
        if self.state.repairs:  # the run before continued as new while they ran (NODE_CONTINUES_WHILE_REPAIRING)
            carried, self.state.repairs = self.state.repairs, {}
            for index, repair in sorted(carried.items()):
                self._follow_to_its_end(index, repair.repair_id, repair.finding)
                workflow.logger.info("node %s: GPU %d: %s still runs (carried over continue-as-new): following it",
                                     self._node, index, repair.repair_id)
        if takes_what_was_left:
            self._log(f"{inp.started_again}: taking its fences and repairs from the cluster", warn=True)
            self._taking_what_was_left = self._took_what_was_left = True
            try:
                async with self.state_lock:  # a person's return_gpu or repair_gpu waits for what it finds
                    await self._take_what_was_left()
            finally:
                self._taking_what_was_left = False
        if self.state.deferred:
            await self._facts_or_wait()  # findings carried on hold: their recheck interval is in the settings
        if self._settled or workflow.patched(HEALTH_WATCH_PATCH):
            self._told_by_cluster = self._settled or workflow.patched(NOT_READY_PATCH)
            self._first_state = inp.first_state
            self._watching = self._background("health watch", self._watch_node)
            if self._gate_waits_watch:
                self.own(self._watching)  # continue-as-new waits until it rests at its watch
        recheck_at = None
        while True:
            try:
                await workflow.wait_condition(
                    lambda: bool(self._pending or self._wake or self._quarantine or self._person_holds
                                 or (self._requests and self._holder is None)
                                 or (self._settled_5 and self._queue_news())
                                 or (self._paces_holds and self._incident_closed)
                                 or self._deleted_to_take()),
                    timeout=self._recheck_in(),
                )
            except asyncio.TimeoutError:
                recheck_at = workflow.now()
            if self._paces_holds and self._incident_closed:
                # The site's incident closed: what it held is asked again now, its pause over.
                if self.state.deferred:
                    self._log(f"{self._incident_closed}: asking again now")
                    recheck_at = workflow.now()
                self._incident_closed, self._held_until, self._held_pause = "", None, timedelta(0)
            self._wake = False
            await self._grant_next()
            if self._settled_5:
                await self._tell_the_queue()
            # Uncontended (no person's update running) the lock issues no command and never waits.
            async with self.state_lock:
                if self._told_deleted is not None:
                    observed_at, self._told_deleted = self._told_deleted, None
                    await self._take_deleted(observed_at)
                if self.state.deleted_seen_at is not None and not self._active:
                    # Told deleted while a repair ran (NODE_TAKES_TOLD_DELETED_AFTER_REPAIR): none runs now.
                    observed_at, self.state.deleted_seen_at = self.state.deleted_seen_at, None
                    await self._take_deleted(observed_at)
                while self._pending:
                    await self._handle(self._pending.pop(0))
                if self._quarantine is not None:
                    finding, self._quarantine = self._quarantine, None
                    await self._act_on_quarantine(finding)
                while self._person_holds:
                    await self._hold_for_person(self._person_holds.pop(0))
                if recheck_at is not None:
                    recheck_at = None
                    await self._recheck()
                if not self.state.deferred:  # nothing held: the next hold's pause starts short again
                    self._held_until, self._held_pause = None, timedelta(0)
            if self._gone and not self._active:
                self._set_state("gone", "replaced or removed")
                return self.status()
            if (
                self.continue_as_new_suggested()
                and not self._pending and not self._requests and self._holder is None
                and self._quarantine is None and not self._person_holds
                # Repairs running (none holding or waiting for the slot): carried, and followed by the next run.
                and (not self._active or self._continues_while_repairing())
            ):
                # Returns when work for the loop came in while the gate waited: the loop takes it first
                # (and a node found gone meanwhile ends the entity: for runs that wait for the watch).
                await self.continue_as_new_when_ready(
                    self._carried,
                    # (``_active``: a person's ``repair_gpu`` during the wait started a repair, which
                    # the loop watches out, unless the run continues while repairs run; nothing else
                    # starts one while the loop waits here.)
                    unless=lambda: bool(self._pending or self._requests or self._quarantine is not None
                                        or self._person_holds
                                        or (self._gate_waits_watch and self._gone)
                                        or self._told_deleted is not None or self._deleted_to_take()
                                        or (self._active and not self._continues_repairing)
                                        or (self._paces_holds and self._incident_closed)),
                )

    async def _take_deleted(self, observed_at: float) -> None:
        """Its site saw the node deleted from the cluster (``NODE_ENDS_WHEN_TOLD_DELETED``): the
        cluster's own record decides. Not there: the watch in flight is cancelled and the loop ends
        the entity ("replaced or removed"). There (joined again under its name since the site saw
        it go), or the cluster not answering: watched on, the word logged. A repair of the node
        still running: the word is kept and taken again once none runs (``NODE_TAKES_TOLD_DELETED_AFTER_REPAIR``;
        before, its repair decided)."""
        if self._gone:
            return
        at = datetime.fromtimestamp(observed_at, timezone.utc)
        seen = f"its site saw it deleted from the cluster at {at:%H:%M:%S} UTC"
        if self._active:
            running = ', '.join(sorted(self._active.values()))
            if self._settled_7 and workflow.patched(NODE_TAKES_TOLD_DELETED_AFTER_REPAIR):
                self.state.deleted_seen_at = observed_at
                self._log(f"{seen}, while {running} runs: asking the cluster once no repair runs")
                return
            self._log(f"{seen}, while {running} runs: its repair decides")
            return
        try:
            facts = await self._refresh_facts()
        except ActivityError as error:
            self._log(f"{seen}; not confirmed, the cluster did not answer ({failure_message(error)}): watching on",
                      warn=True)
            return
        if facts.found:
            self._log(f"{seen}, but the cluster has it again (machine {facts.machine_id or 'unknown'}): joined "
                      "again under its name, watching on")
            return
        self._log(f"{seen}, and the cluster does not know it: removed, its watch cancelled")
        self._gone = True
        self._wake = True
        self._replace_watch()

    def _deleted_to_take(self) -> bool:
        """A word that the node was deleted, kept while a repair ran (``NODE_TAKES_TOLD_DELETED_AFTER_REPAIR``),
        and no repair runs now: the loop asks the cluster."""
        return self.state.deleted_seen_at is not None and not self._active

    def _continues_while_repairing(self) -> bool:
        """``NODE_CONTINUES_WHILE_REPAIRING``: this run may continue as new while repairs of its node
        run (asked once, where it first matters; runs under ``NODE_PATCHES_AT_START_7`` only)."""
        if self._continues_repairing is None:
            self._continues_repairing = self._settled_7 and workflow.patched(NODE_CONTINUES_WHILE_REPAIRING)
        return self._continues_repairing

    def _carried(self) -> dict:
        """The next run's input: the state, with the repairs still running (none under the patch's old
        path, whose gate waits until none runs), which the next run follows to their end."""
        self.state.repairs = {index: RunningRepair(repair_id=repair_id,
                                                   finding=self._repaired_for.get(index) or Finding(index=index))
                              for index, repair_id in sorted(self._active.items())}
        return NodeEntityInput(node_name=self._node, carry=self.state).model_dump(mode="json")

    # -- a run started again ----------------------------------------------------------------
    async def _take_what_was_left(self) -> None:
        """What the run before left, read from the cluster and Temporal (``STARTED_AGAIN_PATCH``):
        each repair still running is followed as one this run started, with its place at the node's
        action slot; each GPU fenced that no repair holds is held for a person."""
        try:
            left: NodeLeft = await workflow.execute_activity(
                act.node_left, NodeFactsInput(node_name=self._node),
                start_to_close_timeout=NODE_LEFT_TIMEOUT, heartbeat_timeout=NODE_LEFT_HEARTBEAT,
                retry_policy=CLUSTER_RETRY, summary="fences and repairs left",
            )
        except ActivityError as error:
            self._log(f"could not read what the run before left ({failure_text(error)[:MAX_PROBLEM_SHOWN]}): a GPU "
                      "it fenced is not held for a person; see the node's gpufleet.io/fenced-gpu-* annotations",
                      warn=True)
            return
        if not left.found:
            return  # the node is gone: the watch ends the entity
        for repair in left.repairs:
            self._follow(repair)
        for index, rung in sorted(left.fenced.items()):
            if index in self._active:
                continue  # its repair holds the fence and takes it off
            if index in left.on_hold and self._settled_7 and workflow.patched(STARTED_AGAIN_RECHECKS_PATCH):
                self.state.deferred[index] = Finding(index=index, rung=Rung.RESET, reasons=[LEFT_ON_HOLD])
                self.state.fenced.append(index)
                self._log(f"GPU {index}: fenced on hold by the run before{f' (its mark says {rung})' if rung else ''}, "
                          "no repair running: its finding went with that run; asking its site again at the next "
                          "recheck", warn=True)
                continue
            # The rung in the fence is on the node's own object: shown, never where a retry starts (a
            # node that wrote "replace" would have its machine deleted and a new one bought).
            self.state.needs_person[index] = (f"fenced in the cluster{f' (its mark says {rung})' if rung else ''} "
                                              f"when its entity was started again, no repair running; node "
                                              f"{'cordoned' if left.cordoned else 'not cordoned'}; a retry starts "
                                              f"at a {Rung.RESET} unless it names a rung")
            self.state.left_findings[index] = Finding(index=index, rung=None,
                                                      reasons=["fenced when the entity was started again"])
            self._log(f"GPU {index}: fenced in the cluster and no repair runs: held for a person "
                      "(gpufleet repair return or retry)", warn=True)
        if self._active:
            self._set_state("repairing", "following the repairs the run before started")
        elif self.state.needs_person:
            self._set_state("needs-person", "GPUs the run before left fenced")
        elif self.state.deferred:
            self._set_state("awaiting-site", "GPUs the run before fenced on hold: asking their site again")

    def _follow(self, repair: LeftRepair) -> None:
        """A repair the run before started, still running: this run's, to its end (``repair_end``);
        waiting for the node's action slot, its request (sent to the run before) is queued here; acting,
        it holds the slot until it says it is done."""
        index, repair_id = repair.gpu, repair.repair_id
        if repair.slot == "waiting" and all(r.repair_id != repair_id for r in self._requests):
            self._requests.append(NodeActionRequest(repair_id=repair_id, rung=repair.rung, detected_at=repair.since))
        elif (repair.slot == "acting" and self._holder is None and repair_id not in self._done_while_taking
              and all(r.repair_id != repair_id for r in self._requests)):  # (asking again: its action is done)
            self._holder = repair_id
            self.state.actions = [*self.state.actions, NodeAction(repair_id=repair_id, rung=repair.rung,
                                                                  started_at=repair.since)][-MAX_LOG:]
        self._follow_to_its_end(index, repair_id, Finding(index=index, rung=repair.rung, reasons=repair.reasons))
        self._log(f"GPU {index}: {repair_id} still runs (at {repair.rung}"
                  + (", waiting for the node's action slot" if repair.slot == "waiting" else "")
                  + (", holding the node's action slot" if self._holder == repair_id else "")
                  + (", its action done as this run read it" if repair_id in self._done_while_taking else "")
                  + "): following it")

    def _follow_to_its_end(self, index: int, repair_id: str, finding: Finding) -> None:
        """A repair a run before this one started, still running (taken from the cluster, or carried over
        continue-as-new): this run's, watched to its end by ``repair_end``, whose failure says how it
        ended; ``finding`` is what a person's retry starts from if it ends unproven."""
        self._active[index] = repair_id
        self._repaired_for[index] = finding
        if index in self.state.fenced:
            self.state.fenced.remove(index)
        ended = workflow.execute_activity(
            act.repair_end, RepairRef(repair_id=repair_id),
            start_to_close_timeout=FOLLOW_WAIT, heartbeat_timeout=LONG_WATCH_HEARTBEAT,
            retry_policy=LONG_WATCH_RETRY, summary=f"until {repair_id} ends",
        )
        self.spawn(self._watch(index, repair_id, ended, finding, followed=True))

    # -- the pulled health watch -----------------------------------------------------------
    def _settings(self) -> RepairSettings | None:
        return self._facts.settings if self._facts is not None else self._joined_settings

    def _gpus_it_can_have(self) -> int:
        """How many GPUs the node can have, as ``_act`` judges a finding: the count in its facts
        once read (no more than a report may name: the count may be its kubelet's word), before
        that the most a report may name."""
        if self._facts is not None and self._facts.found:
            return min(self._facts.gpus, MAX_NODE_GPUS)
        return MAX_NODE_GPUS

    # -- background loops ------------------------------------------------------------------
    def _background(self, name: str, loop: Callable[[], Awaitable[None]]) -> asyncio.Task:
        """``loop`` as a task that is never lost: an exception in a task nobody awaits vanishes
        in a workflow (no log, no failed task), so a loop that raised is logged, shown in the
        entity's details and started again after a pause."""

        async def supervised() -> None:
            pause = LOOP_RESTART_FIRST
            while True:
                try:
                    await loop()
                    return
                except (workflow.NondeterminismError, workflow.ContinueAsNewError):
                    raise
                except Exception as error:  # noqa: BLE001 - anything else must not end the loop
                    if not (self._settled or workflow.patched(NODE_REPORTS_PATCH)):
                        raise  # a run from before the patch: the loop ended here when it ran
                    self._loop_restarts += 1
                    why = f"{type(error).__name__}: {str(error)[:MAX_PROBLEM_SHOWN]}"
                    failed = f"{name} failed ({why}); restarting at {workflow.now() + pause:%H:%M:%S} UTC"
                    self._log(failed, warn=True)
                    self._show(failed)
                    with self.resting():  # the next run starts the loop afresh
                        await workflow.sleep(pause)
                    pause = min(pause * 2, LOOP_RESTART_MAX)

        return asyncio.create_task(supervised())

    def _checked(self, answer: Any) -> NodeReport | None:
        """A watch's answer as the entity accepts it (``NodeReport``), or None: a bad report,
        counted and shown, and after ``MAX_BAD_REPORTS_IN_A_ROW`` the node is quarantined."""
        problem, value = "", None
        try:
            value = workflow.payload_converter().from_payload(answer.payload) if isinstance(answer, RawValue) \
                else answer
            if isinstance(value, BaseModel):  # the join's smoke-test state, decoded loosely by the join
                value = value.model_dump(mode="json")
            # Before pydantic: deep nesting, huge strings and non-finite numbers anywhere.
            if (found := first_problem(value)) is not None:
                problem = f"{found[0]}: {found[1]}"
            else:
                report = NodeReport.model_validate(value)
                self.state.bad_reports_in_a_row = 0
                return report
        except ValidationError as error:
            problem = describe(error)[0]
        except Exception as error:  # noqa: BLE001 - an undecodable payload (bad JSON, unknown encoding)
            problem = f"undecodable ({type(error).__name__})"
        if not (self._settled or workflow.patched(NODE_REPORTS_PATCH)):
            # A run from before the patch decoded it with the wire model (or failed its task).
            return NodeWatchResult.model_validate(value)
        self._bad_report(problem)
        return None

    def _bad_report(self, problem: str) -> None:
        """Counted and shown; after ``MAX_BAD_REPORTS_IN_A_ROW`` in a row the node is quarantined."""
        problem = problem[:MAX_PROBLEM_SHOWN]
        carry = self.state
        carry.bad_reports += 1
        carry.bad_reports_in_a_row += 1
        # The metric (no command: replay records nothing); the node is named in the log and details.
        count_bad_report("watch", site=self._facts.site if self._facts else self._joined_site)
        self._last_bad_report = problem
        self._log(f"bad report from {self._node} ({carry.bad_reports_in_a_row} in a row): {problem}", warn=True)
        self._show(f"bad report from {self._node}: {problem}")
        if carry.bad_reports_in_a_row >= MAX_BAD_REPORTS_IN_A_ROW:
            carry.bad_reports_in_a_row = 0
            self._quarantine_node(f"{MAX_BAD_REPORTS_IN_A_ROW} bad reports in a row from the node agent")

    def _quarantine_node(self, reason: str, gpus: list[int] | None = None) -> None:
        """Cordon the node and hand it to the repair ladder (the loop acts, ``_act_on_quarantine``:
        on the GPUs named, else on GPU 0 for the whole node). One not yet acted on is not lost: where
        either names GPUs, both are acted on (the whole node's as GPU 0)."""
        named = list(gpus or [])
        if self._quarantine is not None and (named or self._quarantine_gpus):
            named = sorted({*(self._quarantine_gpus or [0]), *(named or [0])})
        self.state.quarantine_reasons = [*self.state.quarantine_reasons, reason][-MAX_LOG:]
        self._quarantine = Finding(index=0, rung=QUARANTINE_RUNG, reasons=[reason])
        self._quarantine_gpus = named
        self._wake = True

    async def _hold_for_person(self, reason: str) -> None:
        """A quarantine that starts no repair (``NodeQuarantine.hold_for_person``: an evacuation's proof
        could not run, the node agent cannot run its compute check; no rung fixes that): the node,
        as its GPU 0, is held for a person with the sender's reason (``needs_person``, FleetState
        ``needs-person``: the alert), its GPU 0 fenced so that it stays cordoned (another GPU's repair
        that ends uncordons only a node with no GPU fenced). The person's ``return_gpu`` of GPU 0, once
        the agent is fixed, un-fences it and uncordons the node (unless another GPU of it is fenced);
        ``repair_gpu`` starts a repair at a reset. A repair of GPU 0 running meanwhile holds the fence."""
        held = (f"{reason}; no repair started (no rung fixes the node agent), node cordoned: fix the node agent, "
                f"then `gpufleet repair return {self._node} 0 --reason ...` uncordons it")
        if 0 not in self._active and 0 not in self.state.fenced:
            await self._fence(0, Finding(index=0, rung=None, reasons=[reason]))
        self.state.needs_person[0] = held[:1000]
        self.state.left_findings[0] = Finding(index=0, rung=None, reasons=[reason])
        self._log(f"held for a person: {reason}", warn=True)
        if self._active:  # the last repair's end sets the state (``_idle_state``)
            self._show(f"held for a person: {reason}")
        else:
            self._set_state("needs-person", f"held for a person: {reason}")

    async def _act_on_quarantine(self, finding: Finding) -> None:
        """A quarantine: ``finding`` (GPU 0, the whole node) where it names no GPU, as always; else a
        finding for each GPU it names that the node has by the cluster's count (read afresh; the last
        read when the cluster does not answer, and ``_act`` reads again), each with its own reason kept
        as a quarantine's (one held for an incident is not forgotten for a clean health snapshot: a
        proof's failure, a compute check's, is not in it). None of them the node's: the whole node."""
        gpus, self._quarantine_gpus = self._quarantine_gpus, []
        if not gpus:
            await self._act(finding)
            return
        facts = await self._facts_or_wait()
        if facts is not None and not facts.found:
            await self._act(finding)  # gone: ``_act`` says so
            return
        has = self._gpus_it_can_have()
        named = [index for index in gpus if 0 <= index < has]
        if not named:
            self._log(f"quarantine names GPU {', '.join(map(str, gpus))}, none of the node's {has}: "
                      "the whole node (GPU 0)", warn=True)
            await self._act(finding)
            return
        reason = finding.reasons[0]
        own = {index: reason if len(named) == 1 else f"{reason} (GPU {index})" for index in named}
        self.state.quarantine_reasons = [*(r for r in self.state.quarantine_reasons if r != reason),
                                         *own.values()][-MAX_LOG:]
        for index in named:
            await self._act(Finding(index=index, rung=finding.rung, reasons=[own[index]]))

    async def _watch_node(self) -> None:
        """One ``watch_node`` after another on the node's queue, for the entity's life.

        The first result is the state the node showed in the join's smoke test, if any (it
        came from the node's own queue too)."""
        first, self._first_state = self._first_state, None
        heartbeat = timedelta(seconds=RepairSettings().timeouts.watch_heartbeat())
        if self._settings() is None:
            try:
                await self._refresh_facts()  # the heartbeat timeout is a repair setting
            except ActivityError:
                pass
        took: timedelta | None = None  # how long the last watch took to answer ...
        moved = False  # ... and whether its answer changed what the entity knows
        size = 0  # ... and its size (bytes of its payload's data)
        if self._settled_8 and (paced_until := self.state.watch_paced_until) is not None:
            if (left := paced_until - workflow.now().timestamp()) > 0:  # the run before's pause, to its end
                with self.resting():
                    await workflow.sleep(left, summary=f"pace {self._node}'s watch: the pause before continue-as-new")
        while not self._gone:
            if (settings := self._settings()) is not None:
                heartbeat = timedelta(seconds=settings.timeouts.watch_heartbeat())
                if self._told_by_cluster and settings.timeouts.watch_heartbeat_seconds is None:
                    heartbeat = timedelta(seconds=WATCH_LONG_HEARTBEAT)
            carry = self.state
            if first is not None:
                answer, first = first, None
            else:
                if self._settled_2 and took is not None:
                    await self._pace_watch(took, moved, size)  # the last answer taken, before the next watch
                await self._pace_long_history()
                took, moved, size, asked_at = None, False, 0, workflow.now()
                try:
                    answer = await self._watch_once(carry, heartbeat)
                    took = workflow.now() - asked_at
                    size = len(answer.payload.data) if isinstance(answer, RawValue) else 0
                except ActivityError as error:
                    if self._rewatch:  # replaced on purpose (Ready again): no question to the cluster
                        self._rewatch = False
                        continue
                    failed_in = workflow.now() - asked_at
                    if failed_in < heartbeat and self._settled_7 and workflow.patched(NODE_PACES_FAILED_WATCHES):
                        took = failed_in  # paced as an answer that changed nothing
                    try:
                        facts = await self._refresh_facts()
                    except ActivityError:
                        continue
                    if not facts.found:
                        self._log(f"watch ended ({failure_message(error)}) and the cluster does not know the node")
                        self._gone = True
                        self._wake = True
                        return
                    continue
            streak = carry.bad_reports_in_a_row  # ``_checked`` ends it for a well-formed answer
            if (result := self._checked(answer)) is None:
                continue  # a bad report: the next watch asks again
            if result.node_name != self._node or result.seq < carry.watch_seq:
                continue  # a late answer: the state it carries is older than what the entity has
            if self._stale(result):
                continue  # not acknowledged: the next watch sees the same difference and observes it afresh
            moved = result.digest != carry.watch_digest or result.reclaim_at != carry.reclaim_at
            if result.digest != carry.watch_digest:
                self._pending.append(HealthReport(node_name=self._node, boot_id=result.boot_id, gpus=result.gpus))
            if result.reclaim_at is not None and result.reclaim_at != carry.reclaim_at:
                if refused := await self._reclaim(result.reclaim_at):
                    # Its health is taken; its notice makes it a bad report, in a row with those before.
                    carry.bad_reports_in_a_row = streak
                    self._bad_report(refused)
                    moved = result.digest != carry.watch_digest  # the notice changed nothing here
            carry.watch_seq, carry.watch_digest, carry.reclaim_at = result.seq, result.digest, result.reclaim_at
            self._wake = True  # also: the loop looks at continue-as-new after every watch

    def _watch_wait(self) -> float:
        """How long a watch waits for a change before it answers unchanged (seconds)."""
        return WATCH_LONG_WAIT if self._told_by_cluster else WATCH_MAX_WAIT

    async def _pace_watch(self, took: timedelta, moved: bool, size: int = 0) -> None:
        """Past ``WATCH_IDLE_FREE`` answers in a row long before their wait that changed nothing,
        or ``WATCH_EARLY_FREE`` early ones of any kind, a pause before the next watch, doubling
        while they go on (``NODE_PATCHES_AT_START_2``). An early answer of ``size`` bytes counts as
        one per ``WATCH_FREE_BYTES`` begun (``NODE_PACES_ANSWER_BYTES``). Every answer's bytes, early
        or not, are charged against a budget that refills with time; past it the pause is at least
        what refills it (``NODE_CHARGES_EVERY_ANSWER_BYTES``). Resting: the next run watches at
        once, or (``NODE_PATCHES_AT_START_8``) once the pause is over, counting on from here."""
        carry = self.state
        # The bytes, charged whatever the answer's timing (kept in every run: it changes no command,
        # and the patch is asked only where it paces where the counts would not).
        timeouts = (self._settings() or RepairSettings()).timeouts
        now = workflow.now().timestamp()
        rate = timeouts.watch_bytes_kib_per_hour * 1024 / 3600.0
        burst = timeouts.watch_bytes_burst_kib * 1024
        carry.watch_bytes_until = max(carry.watch_bytes_until or now, now) + size / rate
        owed = carry.watch_bytes_until - now - burst / rate  # seconds past the burst
        pause = timedelta(0)
        if took >= timedelta(seconds=self._watch_wait() / 2):
            carry.watch_early_answers = carry.watch_idle_answers = 0
            over = was = 0
        else:
            was = max(carry.watch_idle_answers - WATCH_IDLE_FREE, carry.watch_early_answers - WATCH_EARLY_FREE)
            counts = -(-size // WATCH_FREE_BYTES)  # one per WATCH_FREE_BYTES begun
            if counts <= 1 or not (self._settled_7 and workflow.patched(NODE_PACES_ANSWER_BYTES)):
                counts = 1  # asked only where the count differs: an honest answer is far smaller
            carry.watch_early_answers += counts
            carry.watch_idle_answers = 0 if moved else carry.watch_idle_answers + 1
            over = max(carry.watch_idle_answers - WATCH_IDLE_FREE, carry.watch_early_answers - WATCH_EARLY_FREE)
        if over > 0:
            # The doublings capped: the counts are carried, and days of answers at once would pass a float's range.
            doublings = min(over - 1, 32)
            pause = timedelta(seconds=min(timeouts.watch_pace_seconds * 2 ** doublings,
                                          timeouts.watch_pace_max_seconds))
            if over == 1 or was <= 0:  # the first past the free ones (a large answer may pass them by several)
                self._log(f"watch answers long before their wait ({carry.watch_early_answers} in a row, one per "
                          f"{WATCH_FREE_BYTES // 1024} KiB begun; {carry.watch_idle_answers} changing nothing): the "
                          f"next watches are paced, from {pause.total_seconds():.0f}s", warn=True)
        if owed > pause.total_seconds() and self._settled_7 and workflow.patched(NODE_CHARGES_EVERY_ANSWER_BYTES):
            if owed - size / rate < -1.0:  # the first answer past the burst (not one at its pause's end)
                self._log(f"watch answers past {timeouts.watch_bytes_burst_kib:g} KiB and "
                          f"{timeouts.watch_bytes_kib_per_hour:g} KiB an hour (this one {size:,} bytes): the next watch waits {owed:.0f}s, until they are "
                          "paid for", warn=True)
            pause = timedelta(seconds=owed)
        if pause <= timedelta(0):
            return
        carry.watch_paced_until = (workflow.now() + pause).timestamp()
        with self.resting():
            await workflow.sleep(pause, summary=f"pace {self._node}'s watch: it answers at once"
                                 if pause.total_seconds() > owed else f"pace {self._node}'s watch: its answers' bytes")

    async def _pace_long_history(self) -> None:
        """Past ``watch_pace_history_mib`` or ``WATCH_PACE_HISTORY_EVENTS`` of history (a run that
        may not continue as new: a repair of the node runs; since ``NODE_CONTINUES_WHILE_REPAIRING``
        one that holds or waits for the node's action slot), a pause before the next watch, doubling
        from ``watch_pace_max_seconds`` with every watch up to ``WATCH_PACE_HISTORY_MAX``; it ends
        early once the run may continue as new (``NODE_PACES_A_LONG_HISTORY``). Not carried."""
        info = workflow.info()
        timeouts = (self._settings() or RepairSettings()).timeouts
        size, events = info.get_current_history_size(), info.get_current_history_length()
        if size < timeouts.watch_pace_history_mib * 2**20 and events < WATCH_PACE_HISTORY_EVENTS:
            return
        if not self._active or not (self._settled_7 and workflow.patched(NODE_PACES_A_LONG_HISTORY)):
            return
        if self._continues_while_repairing() and not self._slot_busy():
            return  # the repairs running keep it no longer: it continues as new at the loop's next look
        # The doublings capped (a float's range), the pause capped far below that.
        first = max(timeouts.watch_pace_max_seconds, WATCH_PACE_HISTORY_FIRST.total_seconds())
        seconds = first * 2.0 ** min(self._long_history_pauses, 64)
        pause = timedelta(seconds=min(seconds, WATCH_PACE_HISTORY_MAX.total_seconds()))
        self._long_history_pauses += 1
        if self._continues_repairing:
            self._log(f"history at {size / 1e6:.1f} MB and {events:,} events while a repair holds or waits for the "
                      "node's action slot (it may not continue as new until the slot is free): the next watch waits "
                      f"{pause.total_seconds():g}s, twice as long each watch, or until the slot is free",
                      warn=self._long_history_pauses == 1)
        else:
            self._log(f"history at {size / 1e6:.1f} MB and {events:,} events while a repair runs (it may not continue "
                      f"as new until that ends): the next watch waits {pause.total_seconds():g}s, twice as long each "
                      "watch, or until no repair runs", warn=self._long_history_pauses == 1)
        with self.resting():
            try:
                await workflow.wait_condition(lambda: not self._active or (bool(self._continues_repairing)
                                                                           and not self._slot_busy()),
                                              timeout=pause,
                                              timeout_summary=f"pace {self._node}'s watch: a long history")
            except asyncio.TimeoutError:
                pass

    def _slot_busy(self) -> bool:
        """A repair holds the node's action slot or a request waits for it: what still keeps the run
        from continuing as new while repairs run (the holder and the queue are not carried)."""
        return self._holder is not None or bool(self._requests)

    async def _watch_once(self, carry: NodeCarry, heartbeat: timedelta) -> RawValue:
        # Undecoded: the node's answer is validated by ``_checked`` (see ``NODE_REPORTS_PATCH``).
        wait = self._watch_wait()
        options = dict(
            task_queue=node_queue(self._node),
            start_to_close_timeout=timedelta(seconds=wait) + heartbeat * 2,
            schedule_to_close_timeout=max(WATCH_GIVE_UP, timedelta(seconds=wait) + heartbeat * 3),
            heartbeat_timeout=heartbeat,
            retry_policy=WATCH_RETRY, summary=f"{self._node}: health and spot notices, on change",
        )
        watch = NodeWatchInput(node_name=self._node, seq=carry.watch_seq, digest=carry.watch_digest,
                               reclaim_at=carry.reclaim_at, max_wait_seconds=wait)
        # Resting while it waits: the watch is level-triggered, the next run's first one returns at
        # once if the node changed meanwhile (continue-as-new may leave this one).
        if not self._told_by_cluster:
            with self.resting():
                return await workflow.execute_activity(act.watch_node, watch, **options)
        # The same command; its handle kept, so a Ready-again node's watch can be replaced.
        self._watch_handle = workflow.start_activity(act.watch_node, watch, **options)
        try:
            with self.resting():
                return await self._watch_handle
        finally:
            self._watch_handle = None

    def _stale(self, result: NodeWatchResult) -> bool:
        """Observed too long ago to act on: it waited out a control-plane outage in flight."""
        if result.observed_at is None:
            return False
        bound = (self._settings() or RepairSettings()).max_report_age_seconds
        age = workflow.now().timestamp() - result.observed_at
        if age <= bound or not (self._settled or workflow.patched(STALE_REPORT_PATCH)):
            self._stale_in_a_row = 0
            return False
        self._stale_in_a_row += 1
        if self._stale_in_a_row > MAX_STALE_IN_A_ROW:
            self._log(f"watch results keep arriving {age:.0f}s old: the node's clock looks off; acting on it",
                      warn=True)
            self._stale_in_a_row = 0
            return False
        self._log(f"ignored a health report observed {age:.0f}s ago (bound {bound:g}s): watching again", warn=True)
        return True

    async def _reclaim(self, terminate_at: float) -> str:
        """The provider will take the machine: SpotReclaim drains and replaces it. Site and
        machine come from the cluster's record of the node, never from the node. Why the notice
        is refused (its site is no spot site: ``NODE_PATCHES_AT_START_6``), or ""."""
        facts = await self._refresh_facts()
        if not facts.found:
            return ""
        if self._settled_6 and facts.capacity_type is not CapacityType.SPOT:
            kind = f"an {facts.capacity_type} site" if facts.capacity_type else "a site not in the config"
            return (f"reclaim_at: a spot reclaim notice (terminates at {terminate_at:.0f}) from a node at "
                    f"{facts.site or 'no site'}, {kind}: only spot machines are reclaimed; ignored")
        self._log(f"spot reclaim notice: terminates at {terminate_at:.0f}", warn=True)
        try:
            await workflow.start_child_workflow(
                flows.SpotReclaim.TYPE, {"node_name": self._node, "site": facts.site, "machine_id": facts.machine_id,
                                "terminate_at": terminate_at},
                id=reclaim_workflow_id(self._node),
                # Outlives the entity on purpose: the drain and the replacement must finish.
                parent_close_policy=ParentClosePolicy.ABANDON,
                static_summary=f"spot reclaim of {self._node}: drain and replace",
            )
        except FailureError:  # already running: a newer termination time wins
            try:
                await workflow.get_external_workflow_handle(reclaim_workflow_id(self._node)).signal(
                    flows.SpotReclaim.notice, {"terminate_at": terminate_at})
            except FailureError as error:
                self._log(f"spot notice not passed on: {failure_message(error)}", warn=True)
        return ""

    # -- health reports --------------------------------------------------------------------
    async def _handle(self, report: HealthReport) -> None:
        if report.node_name != self._node:
            self._log(f"ignored a report for node {report.node_name!r}", warn=True)
            return
        carry, now = self.state, workflow.now()
        carry.reports += 1
        if report.boot_id and report.boot_id != carry.boot_id:
            if carry.boot_id:
                self._log(f"boot id changed {carry.boot_id[:8]} → {report.boot_id[:8]}")
            carry.boot_id = report.boot_id
        findings: list[Finding] = []
        seen = set(carry.seen_xids)
        # The state is carried across continue-as-new (a 2 MiB input): a GPU's last health and XID
        # hits are kept only for GPUs the node can have, so a node naming GPUs it lacks cannot grow
        # it (their findings still go to ``_act``, which names and ignores them).
        gpus = self._gpus_it_can_have()
        if any(not 0 <= index < gpus for index in carry.latest):  # kept before the facts were read
            carry.latest = {index: health for index, health in carry.latest.items() if 0 <= index < gpus}
        thresholds = (self._settings() or RepairSettings()).thresholds
        over_cap = 0
        for gpu in report.gpus:
            ours = 0 <= gpu.index < gpus
            if ours:
                carry.latest[gpu.index] = _last_seen(gpu)
            new_xids = []
            for i, event in enumerate(gpu.xid_events):
                key = _xid_key(gpu, i)
                if key not in seen:
                    seen.add(key)
                    carry.seen_xids.append(key)
                    new_xids.append(event.xid)
            words = _condition_words(gpu)
            new_words = set(words) - set(carry.baseline.get(str(gpu.index), []))
            # Up to the most GPUs a report may name, not the node's count: without its words, a GPU
            # the node lacks would send the same finding to ``_act`` (a facts read) every report.
            # A few short words each (``conditions``).
            if 0 <= gpu.index < MAX_NODE_GPUS:
                carry.baseline[str(gpu.index)] = words
            finding = classify(gpu, xids=new_xids)
            carry.ledger.record_app_xids(finding.app_xids)
            if finding.app_xids:
                self._log(f"GPU {gpu.index}: application XID {finding.app_xids} counted, no repair")
            if finding.unknown_xids:
                self._log(f"GPU {gpu.index}: XID {finding.unknown_xids} not in the table, counted, no repair")
            if ours:  # a GPU the node lacks is never repaired: its hits would only be carried
                over_cap += carry.ledger.record_xids(gpu.index, finding.fatal_xids, now.timestamp(), thresholds)
            if finding.rung is not None and (finding.fatal_xids or new_words):
                findings.append(finding)
        carry.seen_xids = carry.seen_xids[-MAX_SEEN:]
        if over_cap:  # one line a report (the log is carried too), not one an XID
            self._log(f"{over_cap} fatal XID hits not kept: the ledger keeps the newest "
                      f"{MAX_XID_HITS_PER_GPU} of a GPU in the window", warn=True)
        lacked = []
        for finding in findings:
            if self._settled_4 and self._known_to_lack(finding.index):
                lacked.append(finding.index)  # ``_act`` would read the facts again only to ignore it
                continue
            await self._act(finding)
        if lacked:  # one line a report (the log is carried too), not one a GPU
            shown = ", ".join(map(str, lacked[:5])) + (f" and {len(lacked) - 5} more" if len(lacked) > 5 else "")
            self._log(f"health report for unknown GPU{'s' if len(lacked) > 1 else ''} {shown} "
                      f"(node has {self._facts.gpus}): ignored", warn=True)

    def _known_to_lack(self, index: int) -> bool:
        """Whether the facts last read say the node has no GPU ``index``. Only for a node admitted
        (joined and proven), whose count is its site's: before that it may be its kubelet's
        allocatable count, which can still grow, and a real fault must not be missed for it."""
        facts = self._facts
        return facts is not None and facts.found and facts.admitted and not 0 <= index < facts.gpus

    async def _recheck(self) -> None:
        """Deferred findings: act if the GPU is still sick, forget them if it healed."""
        for index, finding in sorted(self.state.deferred.items()):
            latest = self.state.latest.get(index)
            # A fatal XID is an event, not a state: a clean snapshot since does not undo it.
            quarantined = any(reason in self.state.quarantine_reasons for reason in finding.reasons)
            # A GPU an ended repair left for a person is not un-fenced by a clean snapshot either, nor
            # one whose finding went with the run before (what it was is not known).
            left = index in self.state.needs_person or LEFT_ON_HOLD in finding.reasons
            if (not finding.fatal_xids and not quarantined and not left and latest is not None
                    and not latest.problems()):
                if index in self.state.fenced and await self._unfence(index) is None:
                    continue  # still fenced: the next recheck tries again
                self.state.deferred.pop(index)
                self._log(f"GPU {index}: healed while waiting, no repair")
                continue
            await self._act(finding)

    def _recheck_in(self) -> timedelta | None:
        """How long the loop waits before it rechecks the findings on hold: until the next read of
        the node when the cluster did not answer the last one (facts read or not), else the facts'
        ``recheck_seconds``; None: nothing on hold."""
        if not self.state.deferred:
            return None
        if self._facts_retry_at is not None:
            return max(self._facts_retry_at - workflow.now(), timedelta(seconds=1))
        if self._held_until is not None:  # held for an incident: to the end of the pause
            return max(self._held_until - workflow.now(), timedelta(milliseconds=100))
        if self._facts is not None:
            return timedelta(seconds=self._facts.settings.recheck_seconds)
        return None

    async def _facts_or_wait(self, finding: Finding | None = None, *, answer_now: bool = False) -> NodeFacts | None:
        """The node's facts read afresh, or None when the cluster did not answer (the read spent
        its retries, or was refused): ``finding`` is kept on hold, as one its site holds, and the
        recheck reads again at ``_facts_retry_at``; until then findings are kept without a read.
        ``answer_now``: a person waits for the answer, and hears ``ClusterUnavailable`` at once
        (nothing kept: the GPU stays held for them, to try again)."""
        if finding is not None and not answer_now and self._facts_retry_at is not None \
                and workflow.now() < self._facts_retry_at:
            self.state.deferred[finding.index] = finding
            self._log(f"GPU {finding.index}: {', '.join(finding.reasons)}: on hold until the cluster answers "
                      f"(next read of node {self._node} at {self._facts_retry_at:%H:%M:%S} UTC)", warn=True)
            return None
        try:
            facts = await self._refresh_facts()
        except ActivityError as error:
            why = failure_text(error)[:MAX_PROBLEM_SHOWN]
            if answer_now:
                raise ApplicationError(f"could not read node {self._node} from the cluster ({why}); GPU "
                                       f"{finding.index} stays held for a person: try again",
                                       type="ClusterUnavailable", non_retryable=True) from None
            first = timedelta(seconds=(self._settings() or RepairSettings()).recheck_seconds)
            self._facts_pause = min(max(first, self._facts_pause * 2), FACTS_RETRY_MAX)
            self._facts_retry_at = workflow.now() + self._facts_pause
            waits = (f"could not read node {self._node} from the cluster ({why}); "
                     f"trying again at {self._facts_retry_at:%H:%M:%S} UTC")
            if finding is not None:
                self.state.deferred[finding.index] = finding
                self._log(f"GPU {finding.index}: {', '.join(finding.reasons)} on hold: {waits}", warn=True)
            else:
                self._log(waits, warn=True)
            self._show(waits)
            return None
        self._facts_retry_at, self._facts_pause = None, timedelta(0)
        return facts

    async def _refresh_facts(self) -> NodeFacts:
        local = not self._settled_4 and (self._settled or workflow.patched(LOCAL_FACTS_PATCH))
        self._facts = await (workflow.execute_local_activity if local else workflow.execute_activity)(
            act.node_facts, NodeFactsInput(node_name=self._node),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary="node, site, repair settings",
        )
        if self._facts.site:
            self._upsert_search_attributes((sa.SITE, self._facts.site))
        return self._facts

    def _upsert_search_attributes(self, *values: tuple[SearchAttributeKey[str], str]) -> None:
        """Set these keyword attributes: under ``NODE_PATCHES_AT_START_7`` only those whose value
        differs from the run's own (set at its start, carried over continue-as-new, and kept by
        the SDK as this run upserts), so a run that changes nothing upserts nothing."""
        if self._settled_7:
            current = workflow.info().typed_search_attributes
            values = tuple((key, value) for key, value in values if current.get(key) != value)
        if values:
            workflow.upsert_search_attributes([key.value_set(value) for key, value in values])

    async def _act(self, finding: Finding, *, answer_now: bool = False) -> Rung | None:
        """A sick GPU: contain it, ask its site whether to repair now, start its GpuRepair. The
        rung its repair started at; None: none started (held by the site or until the cluster
        answers, the log says why). ``answer_now``: see ``_facts_or_wait``."""
        index = finding.index
        self.state.deferred.pop(index, None)
        if index in self._active:
            self._log(f"GPU {index}: {', '.join(finding.reasons)} while its repair runs; the repair handles it")
            return
        if (facts := await self._facts_or_wait(finding, answer_now=answer_now)) is None:
            return None
        if not facts.found:
            self._log("health report for a node the cluster does not know: ignored", warn=True)
            self._gone = True
            return
        if not 0 <= index < facts.gpus:
            self._log(f"health report for unknown GPU {index} (node has {facts.gpus}): ignored", warn=True)
            return
        if not facts.admitted:
            self.state.deferred[index] = finding
            self._set_state(self.state.state, f"GPU {index} sick while the node is still joining; waiting")
            return
        if index not in self.state.fenced and (self._settled or workflow.patched(CONTAIN_FIRST_PATCH)):
            await self._fence(index, finding)
        if self._settled or workflow.patched(ADMISSION_PATCH):
            admitted = await self._admitted_by_site(facts, finding)
        else:
            admitted = await self._site_healthy_enough(facts, finding)
        if admitted:
            return await self._start_repair(facts, finding)
        return None

    async def _admitted_by_site(self, facts: NodeFacts, finding: Finding) -> bool:
        """The Site entity owns the incident rule (fleet.incident): it admits or holds this repair.
        Held: the finding waits on hold (rechecked), the node shows whose incident holds it."""
        index = finding.index
        try:
            decision: RepairDecision = await workflow.execute_activity(
                act.admit_repair, AdmitRepairInput(site=facts.site, node_name=self._node, gpu=index,
                                                 reasons=finding.reasons),
                start_to_close_timeout=timedelta(minutes=2),
                heartbeat_timeout=timedelta(seconds=10),  # a lost worker is seen in seconds
                retry_policy=ADMISSION_RETRY, summary=f"site/{facts.site}: repair or provider incident?",
            )
        except ActivityError as error:
            decision = RepairDecision(repair=True, why=f"site/{facts.site} did not answer "
                                                       f"({failure_message(error)}): repairing")
        if decision.repair:
            self._held_until, self._held_pause = None, timedelta(0)
            return True
        self.state.deferred[index] = finding
        held = f"GPU {index}: held by site/{facts.site}: {decision.incident} {decision.why}".strip()
        if not decision.incident:  # a short hold (the site reconciles first): looked at every recheck_seconds
            self._held_until, self._held_pause = None, timedelta(0)
        elif self._paces_holds or (self._paces_holds is None and self._asks_paced()):
            if self._held_until is None or workflow.now() >= self._held_until:
                # The first hold, or the look its pause ended in: the next pause is twice as long.
                first = timedelta(seconds=facts.settings.recheck_seconds)
                self._held_pause = min(max(first, self._held_pause * 2), HELD_RECHECK_MAX)
                self._held_until = workflow.now() + self._held_pause
            # Else another GPU held within the pause: looked at with the others, at its end.
            waits = f"next look at {self._held_until:%H:%M:%S} UTC, or as soon as site/{facts.site} says it closed"
            self._set_state("awaiting-site", f"{facts.site}: {decision.incident}; no new repairs; {waits}")
            self._log(f"{held}; {waits}")
            return False
        self._set_state("awaiting-site", f"{facts.site}: {decision.incident or decision.why}; no new repairs")
        self._log(held)
        return False

    def _asks_paced(self) -> bool:
        """``NODE_PACES_HELD_RECHECKS``, asked once a run (a run from before it keeps rechecking every
        ``recheck_seconds``)."""
        self._paces_holds = self._settled_7 and workflow.patched(NODE_PACES_HELD_RECHECKS)
        return self._paces_holds

    async def _site_healthy_enough(self, facts: NodeFacts, finding: Finding) -> bool:
        """Runs from before ``ADMISSION_PATCH``: the node itself counts its site's unhealthy nodes
        and defers to the Site entity above the threshold."""
        index = finding.index
        health: SiteHealth = await workflow.execute_activity(
            act.site_health, SiteHealthInput(site=facts.site, node_name=self._node),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary=f"unhealthy nodes at {facts.site}",
        )
        share = (health.unhealthy_others + 1) / max(health.nodes, 1)
        if health.unhealthy_others >= 1 and share > facts.settings.thresholds.site_unhealthy_fraction:
            self.state.deferred[index] = finding
            self._set_state("awaiting-site", f"{share:.0%} of {facts.site} unhealthy: the Site entity decides")
            self._log(f"GPU {index}: {share:.0%} of {facts.site} unhealthy, repair deferred to site/{facts.site}")
            await self._tell_site(facts.site, index, share)
            return False
        return True

    async def _start_repair(self, facts: NodeFacts, finding: Finding) -> Rung | None:
        """The rung the ledger escalates to, as a GpuRepair child that outlives the entity; the
        rung it started at (None: not started, the log says why)."""
        index, settings = finding.index, facts.settings
        now = workflow.now()
        rung, why = self.state.ledger.escalate(finding, now.timestamp(), settings.thresholds)
        self.state.ledger.record_remediation(now.timestamp())
        repair_id = repair_workflow_id(self._node, index)
        try:
            handle = await workflow.start_child_workflow(
                flows.GpuRepair.TYPE,
                GpuRepairInput(
                    node_name=self._node, gpu=index, site=facts.site, machine_id=facts.machine_id, gpus=facts.gpus,
                    rung=rung, reasons=finding.reasons, escalated_because=why, detected_at=now, settings=settings,
                ).model_dump(mode="json"),
                id=repair_id, result_type=GpuRepairResult,
                # Outlives the entity on purpose: the entity continues as new while repairs run,
                # and a repair halfway up its ladder (GPU fenced, node cordoned) must finish.
                parent_close_policy=ParentClosePolicy.ABANDON,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                static_summary=f"repair {self._node} GPU {index}: {', '.join(finding.reasons)}",
            )
        except FailureError as error:  # already running (e.g. started by an operator)
            self._log(f"GPU {index}: could not start {repair_id}: {failure_message(error)}", warn=True)
            return None
        finally:
            # Either way a repair owns the GPU's containment from here (it un-contains when it ends).
            if index in self.state.fenced:
                self.state.fenced.remove(index)
        self._active[index] = repair_id
        self._repaired_for[index] = finding
        self._ended.discard(repair_id)  # a new run under the id of one that ended: its requests count
        self.state.needs_person.pop(index, None)  # this repair owns the GPU's containment now
        self.state.left_findings.pop(index, None)
        self.state.quarantine_reasons = [r for r in self.state.quarantine_reasons if r not in finding.reasons]
        self._log(f"GPU {index}: {', '.join(finding.reasons)} → {repair_id} at {rung}" + (f" ({why})" if why else ""))
        self._set_state("repairing", f"GPU {index} at {rung}")
        self.spawn(self._watch(index, repair_id, handle, finding))  # ends with the repair; never raises (below)
        return rung

    # -- containment before the decision ----------------------------------------------------
    def _cluster_write(self):
        """How a fence or un-fence runs: a regular activity under ``NODE_PATCHES_AT_START_4`` (a
        local one's result may reach the workflow a task late, out of order), local before it."""
        return workflow.execute_activity if self._settled_4 else workflow.execute_local_activity

    async def _fence(self, index: int, finding: Finding) -> None:
        """Fence the GPU and cordon the node, by the entity's own node name (never one from a
        report). A cluster that does not answer leaves it to the repair's containment."""
        try:
            await self._cluster_write()(
                act.fence_gpu, FenceInput(node_name=self._node, gpu=index, rung=finding.rung.value if finding.rung else ""),
                start_to_close_timeout=QUICK, retry_policy=FENCE_RETRY, summary=f"fence GPU {index}, cordon the node",
            )
        except ActivityError as error:
            self._log(f"GPU {index}: not fenced ({failure_message(error)}); its repair contains it", warn=True)
            return
        self.state.fenced.append(index)

    async def _unfence(self, index: int, by: str = "") -> UncontainResult | None:
        """Lift a fence the entity holds: a held finding whose GPU healed, or (``by``: who and
        why) a GPU held for a person that a person returned, whose fence its ended repair left.
        The node is uncordoned only when no other GPU of it is fenced (a GPU under repair is).
        None: the cluster did not answer, the GPU is still fenced."""
        try:
            result: UncontainResult = await self._cluster_write()(
                act.uncontain_gpu, UncontainInput(node_name=self._node, gpu=index),
                start_to_close_timeout=QUICK, retry_policy=FENCE_RETRY, summary=f"un-fence GPU {index}",
            )
        except ActivityError as error:
            self._log(f"GPU {index}: still fenced ({failure_message(error)})"
                      + ("" if by else "; the next recheck tries again"), warn=True)
            return None
        if index in self.state.fenced:
            self.state.fenced.remove(index)
        self._log(f"GPU {index}: " + (f"{by}: " if by else "") + "un-fenced"
                  + ("" if result.uncordoned else f", GPUs {result.still_fenced} still fenced"))
        return result

    async def _watch(self, index: int, repair_id: str, handle, finding: Finding, followed: bool = False) -> None:
        """Until the repair ends: its child handle, or (``followed``: one the run before started)
        ``repair_end``, whose failure says how it ended. Resting while it waits: a run that continues
        as new meanwhile (``NODE_CONTINUES_WHILE_REPAIRING``) carries the repair, and its next run
        follows it; the rest of this watcher runs in the task that sees the end, with no await."""
        try:
            with self.resting():
                result: GpuRepairResult = await handle
            self._log(f"GPU {index}: {repair_id} ended {result.outcome}")
            if result.outcome == "replaced":
                self._gone = True
        except FailureError as error:
            # It ended before proving the GPU (un-containing is its last step): the GPU stays
            # fenced and the node cordoned, which only a person may undo.
            how = (failure_message(error) if followed
                   else "cancelled" if is_cancelled_exception(error) else f"failed: {failure_message(error)}")
            self.state.needs_person[index] = f"{repair_id} {how}; GPU {index} left fenced, node cordoned"
            self.state.left_findings[index] = finding  # a person's retry starts from it
            self._log(f"GPU {index}: {repair_id} {how}; the GPU stays fenced: a person decides", warn=True)
        except (workflow.NondeterminismError, asyncio.CancelledError):
            raise
        except Exception as error:  # noqa: BLE001 - e.g. a result that does not decode
            # Lost silently, the GPU would stay "active" for ever and block continue-as-new.
            if not (self._settled or workflow.patched(NODE_REPORTS_PATCH)):
                raise
            self._loop_restarts += 1
            self._log(f"GPU {index}: watching {repair_id} failed ({type(error).__name__}: "
                      f"{str(error)[:MAX_PROBLEM_SHOWN]}); taken as ended", warn=True)
        self._active.pop(index, None)
        self._repaired_for.pop(index, None)
        if self._settled_3:
            self._forget_requests(index, repair_id)
        if self._holder == repair_id:
            self._finish_action(repair_id)
        if not self._active:
            self._set_state("gone" if self._gone else self._idle_state())
        self._wake = True

    def _idle_state(self) -> str:
        """The state with no repair running: ``needs-person`` while a GPU an ended repair left
        fenced waits for one (the fleet's word for it, ``FleetState``), else ``ready``."""
        return "needs-person" if self.state.needs_person else "ready"

    async def _tell_site(self, site: str, gpu: int, share: float) -> None:
        try:
            await workflow.get_external_workflow_handle(site_workflow_id(site)).signal(
                flows.Site.node_transition, {"node_name": self._node, "state": "unhealthy",
                                    "machine_id": self._facts.machine_id if self._facts else ""},
            )
        except FailureError as error:
            self._log(f"site/{site} not told ({failure_message(error)})")

    # -- the node's one disruptive-action slot ----------------------------------------------
    def _finish_action(self, repair_id: str) -> None:
        for action in self.state.actions:
            if action.repair_id == repair_id and action.finished_at is None:
                action.finished_at = workflow.now()
        if self._holder == repair_id:
            self._holder = None
            self._wake = True

    def _drop_action(self, repair_id: str) -> None:
        """The slot back from ``repair_id`` with no action run: its record goes (finished, it would
        cover the faults queued behind it), and the slot is free."""
        self.state.actions = [a for a in self.state.actions
                              if not (a.repair_id == repair_id and a.finished_at is None)]
        if self._holder == repair_id:
            self._holder = None
            self._wake = True

    def _forget_requests(self, index: int, repair_id: str) -> None:
        """An ended repair waits for nothing: its queued requests for the slot go (granted, the
        slot would go to a closed workflow and an action that never ran would cover later faults)."""
        self._ended.add(repair_id)
        self._told.pop(repair_id, None)
        queued = [r for r in self._requests if r.repair_id == repair_id]
        if queued:
            self._requests = [r for r in self._requests if r.repair_id != repair_id]
            self._log(f"GPU {index}: {repair_id} ended while waiting for the node's action slot "
                      f"({queued[0].rung}): its request is dropped")

    async def _grant_next(self) -> None:
        while self._requests and self._holder is None:
            request = self._requests.pop(0)
            self._told.pop(request.repair_id, None)  # out of the queue: a later request of it is told afresh
            if self._settled_3 and request.repair_id in self._ended:
                self._log(f"{request.repair_id} asked for the node's action slot after it ended: not granted")
                continue
            covering = [a for a in self.state.actions if self._covers(a, request)]
            handle = workflow.get_external_workflow_handle(request.repair_id)
            action: NodeAction | None = None
            if covering:
                by = covering[-1]
                grant = NodeActionGrant(go=False, covered_by=by.rung,
                                        detail=f"covered by the {by.rung} for {by.repair_id}")
            else:
                self._holder = request.repair_id
                action = NodeAction(repair_id=request.repair_id, rung=request.rung, started_at=workflow.now())
                self.state.actions = [*self.state.actions, action][-MAX_LOG:]
                grant = NodeActionGrant(go=True)
            try:
                await handle.signal(flows.GpuRepair.node_action_grant, grant)
            except FailureError as error:
                self._log(f"{request.repair_id} gone before its grant: {failure_message(error)}", warn=True)
                if self._settled_3 and action is not None:  # never granted: no action ran, none covers a later fault
                    self.state.actions = [a for a in self.state.actions if a is not action]
                if self._holder == request.repair_id:
                    self._finish_action(request.repair_id)
            if grant.go:
                self._set_state(self.state.state, f"{request.rung} for {request.repair_id}")

    def _covers(self, action: NodeAction, request: NodeActionRequest) -> bool:
        """Whether ``action``, another repair's, did what ``request`` asks the slot for: it finished,
        it started after the request's fault was detected, its rung is at least as strong, and
        (``NODE_PATCHES_AT_START_7``) it acted on the whole node. A reset acts on its own GPU alone
        and each GPU has one repair id, so a reset covers no other repair's request."""
        return (action.finished_at is not None and action.rung.level >= request.rung.level
                and action.started_at >= request.detected_at and action.repair_id != request.repair_id
                and (action.rung.node_level or not self._settled_7))

    def _queued(self) -> list[NodeActionRequest]:
        """The requests queued for the slot, in their order: a request sent twice is one place in
        the queue, and an ended repair's (dropped at its turn) none."""
        queued, seen = [], set()
        for request in self._requests:
            if request.repair_id not in self._ended and request.repair_id not in seen:
                seen.add(request.repair_id)
                queued.append(request)
        return queued

    def _queue_news(self) -> list[tuple[NodeActionRequest, tuple[str, int]]]:
        """Each repair queued for the held slot to tell now, with what: (holder, requests ahead of
        it). Under ``NODE_TELLS_THE_QUEUE_ONCE`` one not told yet, and the next in line told of
        another holder; before it (or not yet asked), each whose holder or place changed."""
        if self._holder is None:
            return []
        news = []
        for ahead, request in enumerate(self._queued()):
            told, last = (self._holder, ahead), self._told.get(request.repair_id)
            if self._tells_once:
                due = last is None or (ahead == 0 and last[0] != self._holder)
            else:
                due = last != told
            if due:
                news.append((request, told))
        return news

    async def _tell_the_queue(self) -> None:
        """Tell each repair queued for the slot who holds it and until when it is expected back
        (its details say so); under ``NODE_TELLS_THE_QUEUE_ONCE`` once when it queues, with when its
        own turn is expected, and once more as the next in line, so Q queued repairs cost 2Q-3
        signals, not one to every waiter each time the slot changes hands (Q(Q-1)/2)."""
        holding = next((a for a in reversed(self.state.actions)
                        if a.repair_id == self._holder and a.finished_at is None), None)
        if holding is None:
            return
        if self._tells_once is None and self._queue_news():
            # Asked here, not at the start: only a run under NODE_PATCHES_AT_START_5 tells its queue,
            # and it runs no local activity (NODE_PATCHES_AT_START_4) whose late result could move
            # the marker to another task.
            self._tells_once = self._settled_5 and workflow.patched(NODE_TELLS_THE_QUEUE_ONCE)
        settings = self._settings() or RepairSettings()
        until = holding.started_at + timedelta(seconds=settings.slot_seconds(holding.rung))
        queued = self._queued()
        for request, told in self._queue_news():
            if self._holder != holding.repair_id:
                return  # the slot changed hands meanwhile: the next pass tells the rest the new holder
            self._told[request.repair_id] = told
            wait = NodeActionWait(holder=holding.repair_id, rung=holding.rung, since=holding.started_at, until=until,
                                  ahead=told[1])
            if self._tells_once and told[1]:
                ahead_of_it = queued[:told[1]]
                wait.behind = ahead_of_it[-1].repair_id
                wait.turn_by = until + timedelta(seconds=sum(settings.slot_seconds(r.rung) for r in ahead_of_it))
            try:
                await workflow.get_external_workflow_handle(request.repair_id).signal(
                    flows.GpuRepair.node_action_wait, wait)
            except FailureError as error:
                self._log(f"{request.repair_id} not told who holds the node's action slot: {failure_message(error)}")
