"""Signals and Temporal actions a queue for one node's action slot costs, by queue length.

GpuRepair workflows of one node share its one disruptive-action slot through the Node entity:
``node_action_request`` and ``node_action_done`` to the entity, ``node_action_grant`` and
``node_action_wait`` (who holds the slot and until when) to each repair. For each Q it joins a
fresh 8-GPU node, holds its slot with GPU 0's reboot (the machine slow to boot), queues Q-1
resets behind it (faults on GPUs 1..Q-1, reported one at a time; a reset covers no other GPU's
repair, so each takes the slot in turn), lets the reboot end and waits for every repair. It then
counts, from the histories, the four signals and the billed actions (``bench/actions.py``'s
``BILLED_EVENTS``) of the Node entity and the Q repairs since the faults.

Each Q runs twice on the same dev server and worker: "before", a Node entity answered False for
``node-tells-the-queue-once`` (the path a run from before that patch takes: every waiter told
again each time the slot changes hands), and "now". Targets: ``node_action_wait`` now at most
2Q-3 (each waiter told once as it queues and once more as the next in line), linear in Q, where
the path before sends Q(Q-1)/2. It can send fewer here: a simulated reset takes milliseconds, and a
hand-over that lands while the entity is still telling the queue cuts that round short (the rest
are told only the newest holder); a real reset or reboot outlasts the round.

    python -m bench.slot_queue [--queues 2,4,8]
    python -m bench.slot_queue --smoke      # Q = 2, 4 (the suite runs this)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Annotated, Iterator

import typer
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from activities.env import FleetEnv
from bench.actions import billed_in
from bench.common import Smoke, bench_args, bench_env, command_line, fleet, run, start_node_host, until, usage_error
from fleet.contracts import workflows as flows
from fleet.messages.nodes import HealthReport
from fleet.messages.repair import GpuRepairResult, LadderState
from fleet.models import GpuHealth, XidEvent
from fleet.naming import node_workflow_id, repair_workflow_id
from workers.control_plane import build_worker
from workers.health_report import send_report
from workflows.node import NODE_TELLS_THE_QUEUE_ONCE

SLOT_SIGNALS = (flows.Node.node_action_request, flows.GpuRepair.node_action_grant,
                flows.GpuRepair.node_action_wait, flows.Node.node_action_done)
#: The holder's reboot waits for a boot this far off; the bench ends it by hand once the queue is full.
HOLD_SECONDS = 600


def linear_bound(q: int) -> int:
    """``node_action_wait`` signals for Q repairs queued together, told once each and once more as
    the next in line (the first behind the holder only once)."""
    return max(2 * q - 3, 0)


def quadratic(q: int) -> int:
    """The same before ``node-tells-the-queue-once``: each hand-over told every waiter again."""
    return q * (q - 1) // 2


@contextmanager
def path_before() -> Iterator[None]:
    """Node entities started meanwhile take the path before the patch: ``workflow.patched`` answers
    False for it, as it does replaying a run from before it (no marker), so no marker is recorded.
    The workflow sandbox passes ``temporalio`` through, so its runs see this module's function."""
    patched = workflow.patched
    workflow.patched = lambda patch_id: False if patch_id == NODE_TELLS_THE_QUEUE_ONCE else patched(patch_id)
    try:
        yield
    finally:
        workflow.patched = patched


async def _step(client: Client, repair_id: str) -> tuple[str, list[str]]:
    """A repair's step (its ``ladder``) and the activities it scheduled; ("", []) before it runs."""
    handle = client.get_workflow_handle(repair_id)
    try:
        state = await handle.query(flows.GpuRepair.ladder, result_type=LadderState)
        history = await handle.fetch_history()
    except Exception:  # noqa: BLE001 - not started yet, or its first task not run
        return "", []
    return state.step, [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


async def _queued(client: Client, repair_id: str) -> bool:
    """The repair waits for its grant, its request delivered to the Node entity (not only sent)."""
    step, _ = await _step(client, repair_id)
    if step != "waiting for the node":
        return False
    history = await client.get_workflow_handle(repair_id).fetch_history()
    return any(e.event_type == EventType.EVENT_TYPE_EXTERNAL_WORKFLOW_EXECUTION_SIGNALED for e in history.events)


async def _report_reset_fault(client: Client, task_queue: str, node: str, gpu: int) -> None:
    """A double-bit ECC error (XID 48, a reset) on ``gpu``, reported by the control plane: the
    node's agent is down for the reboot."""
    event = XidEvent(xid=48, at=datetime.now(timezone.utc))
    await send_report(client, task_queue, HealthReport(
        node_name=node, boot_id="", gpus=[GpuHealth(index=gpu, uuid=f"GPU-{gpu}", xid_events=[event])]))


async def queue_round(client: Client, settings, env: FleetEnv, q: int) -> dict[str, object]:
    """One node, Q repairs queued for its slot: the counts from their histories."""
    joined = await client.execute_workflow(flows.NodeJoin.TYPE, {"site": "site-0"},
                                           id=f"join/site-0/q{q}-{time.time_ns()}", task_queue=settings.task_queue)
    node, machine = joined["nodes"][0]["node_name"], joined["nodes"][0]["machine_id"]
    repairs = [repair_workflow_id(node, gpu) for gpu in range(q)]
    started = time.time()
    env.world.set_site("site-0", boot_seconds=HOLD_SECONDS)
    env.world.inject_fault(machine, 0, "xid", 79, clears_on="reboot")  # fell off the bus: a reboot
    await until(lambda: _holds_for_its_reboot(client, repairs[0]), timeout=60, interval=0.05)
    env.world.set_site("site-0", boot_seconds=0)  # the held reboot's boot time is set; joins boot at once
    for gpu in range(1, q):
        await _report_reset_fault(client, settings.task_queue, node, gpu)
        await until(lambda: _queued(client, repairs[gpu]), timeout=60, interval=0.05)
    with env.world.tx() as db:  # the reboot ends now: the machine comes back with a new boot id
        db.execute("UPDATE machines SET boot_at=? WHERE id=?", (time.time(), machine))
    outcomes = [GpuRepairResult.model_validate(await client.get_workflow_handle(r).result()).outcome for r in repairs]
    ended = time.time() + 1  # the last done signal reaches the entity after the repair's result
    await asyncio.sleep(1)
    signals: Counter = Counter()
    billed: Counter = Counter()
    node_history = await client.get_workflow_handle(node_workflow_id(node)).fetch_history()
    for event in node_history.events:
        if event.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            signals[event.signal_external_workflow_execution_initiated_event_attributes.signal_name] += 1
        elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            signals[event.workflow_execution_signaled_event_attributes.signal_name] += 1
    billed.update(billed_in(node_history.events, started, ended))
    for repair in repairs:
        billed.update(billed_in((await client.get_workflow_handle(repair).fetch_history()).events, started, ended))
    return {"outcomes": outcomes, "signals": {name: signals[name] for name in SLOT_SIGNALS},
            "slot": sum(signals[name] for name in SLOT_SIGNALS), "actions": sum(billed.values())}


async def _holds_for_its_reboot(client: Client, repair_id: str) -> bool:
    _, scheduled = await _step(client, repair_id)
    return "wait_for_boot" in scheduled


async def main(args) -> None:
    config = fleet(sites=1, capacity=4 * len(args.queues) + 2)  # 8 GPUs a machine
    config["repair"] = {"timeouts": {"drain_seconds": 1, "smoke_test_seconds": 10, "heartbeat_seconds": 5,
                                     "reset_seconds": 5, "reboot_seconds": HOLD_SECONDS, "provider_call_seconds": 4},
                        "recheck_seconds": 0.5,
                        # Q repairs of one node are Q remediations: none may climb to a replace for it.
                        "thresholds": {"node_remediation_limit": 20}}
    config["incident"] = {"settle_seconds": 0, "enabled": False}
    async with bench_env(config) as (temporal, settings):
        client, env = temporal.client, FleetEnv.from_settings(settings)
        host = start_node_host(settings, health_seconds=0.2)
        rows = []
        try:
            async with build_worker(client, settings):
                for q in args.queues:
                    with path_before():
                        before = await queue_round(client, settings, env, q)
                    now = await queue_round(client, settings, env, q)
                    rows.append((q, before, now))
        finally:
            host.terminate()
            host.wait(10)
    print("one 8-GPU node, Q repairs queued for its action slot (GPU 0's reboot holds it, Q-1 resets wait)")
    print(f"{'Q':>3}  {'wait before':>11}  {'wait now':>8}  {'Q(Q-1)/2':>8}  {'2Q-3':>4}  "
          f"{'slot signals before/now':>23}  {'actions before/now':>18}")
    met = True
    for q, before, now in rows:
        wait_before = before["signals"][flows.GpuRepair.node_action_wait]
        wait_now = now["signals"][flows.GpuRepair.node_action_wait]
        met = met and wait_now <= linear_bound(q)
        print(f"{q:>3}  {wait_before:>11}  {wait_now:>8}  {quadratic(q):>8}  {linear_bound(q):>4}  "
              f"{before['slot']:>11}/{now['slot']:<11}  {before['actions']:>9}/{now['actions']:<8}")
        if set(before["outcomes"]) | set(now["outcomes"]) != {"repaired"}:
            print(f"    not every repair was repaired: before {before['outcomes']}, now {now['outcomes']}")
            met = False
    last_q, last_before, last_now = rows[-1]
    wait_before = last_before["signals"][flows.GpuRepair.node_action_wait]
    wait_now = last_now["signals"][flows.GpuRepair.node_action_wait]
    print(f"node_action_wait at Q={last_q}: before {wait_before}, now {wait_now}; "
          f"ratio now / 2Q-3: {wait_now / max(linear_bound(last_q), 1):.2f} (target <= 1: {'met' if met else 'NOT met'})")
    if not met:
        raise SystemExit(1)


def command(
    queues: Annotated[str, typer.Option(help="queue lengths Q to run, comma-separated (2 to 8)")] = "2,4,8",
    smoke: Smoke = False,
) -> None:
    args = bench_args(locals())
    try:
        args.queues = [int(q) for q in ("2,4" if smoke else queues).split(",")]
    except ValueError:
        usage_error(f"--queues: comma-separated numbers, not {queues!r}")
    if not all(2 <= q <= 8 for q in args.queues):
        usage_error("--queues: each Q from 2 to 8 (the node has 8 GPUs)")
    run(lambda: main(args))


if __name__ == "__main__":
    command_line(command, __doc__)
