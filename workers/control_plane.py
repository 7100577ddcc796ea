"""The control-plane worker: every workflow, and the provider/cluster activities.

    python -m workers.control_plane [--metrics-port 9464]   # TEMPORAL_*, GPUFLEET_STATE_DIR, GPUFLEET_CONFIG
"""

from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Optional

import typer
from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker

from activities import control_plane_activities
from activities.entity_update import EntityUpdateActivities
from activities.env import FleetEnv
from fleet.settings import ControlPlaneEnv, Settings, SettingsError
from fleet.temporal import connect, tracing_interceptors
from workers.input_guard import InputGuard
from workers.gc_tuning import settle_garbage_collection
from workers.metrics import start_metrics, watch_fleet
from workers.workflow_runner import workflow_runner
from workflows import ALL_WORKFLOWS

log = logging.getLogger("gpufleet.control_plane")


def precompile_workflows() -> None:
    """Byte-compile the workflow modules once.

    The sandbox re-imports a workflow's module for every workflow run; with
    PYTHONDONTWRITEBYTECODE set (common in containers and CI) each of those
    imports compiled the source again. A read-only install just skips this.
    """
    import compileall

    import workflows

    try:
        compileall.compile_dir(Path(workflows.__file__).parent, quiet=2)
    except OSError:
        pass


def worker_interceptors() -> list:
    """Every Worker and Replayer running gpufleet's workflows: the input guard first (a bad
    start, signal or update stops there, before tracing and workflow code), then tracing."""
    return [InputGuard(), *tracing_interceptors()]


#: Workflows kept in memory between their tasks. Every Node entity is one, and an entity
#: evicted from the cache replays its whole history on its next task: the SDK's default
#: (1,000) is below a fleet of 1,250 nodes plus its Site and account entities.
#: ``GPUFLEET_MAX_CACHED_WORKFLOWS`` sets another size (fleet.settings.ControlPlaneEnv).
MAX_CACHED_WORKFLOWS = ControlPlaneEnv.model_fields["max_cached_workflows"].default


def max_cached_workflows() -> int:
    try:
        return ControlPlaneEnv.get("max_cached_workflows")
    except SettingsError as error:
        raise SystemExit(str(error)) from None


#: The control plane's queue has four partitions (deploy/temporal/dynamic-config.yaml), and
#: each long poll waits on one of them. A partition with no poller waiting only forwards its
#: tasks to one that has, a hop for every task; so the worker keeps two polls per partition on
#: the queue, for workflow tasks and for activities. The SDK's defaults left one workflow poll
#: on it (five, four of them on the worker's sticky queue) and five activity polls: two of the
#: four workflow partitions were polled by no one (tests/realtemporal/test_config.py).
QUEUE_PARTITIONS = 4
POLLS_PER_PARTITION = 2
#: The non-sticky share of the workflow polls (the rest wait on the worker's own sticky queue,
#: one partition, where a cached workflow's next tasks go).
NONSTICKY_POLL_RATIO = 0.5
WORKFLOW_TASK_POLLS = int(QUEUE_PARTITIONS * POLLS_PER_PARTITION / NONSTICKY_POLL_RATIO)
ACTIVITY_TASK_POLLS = QUEUE_PARTITIONS * POLLS_PER_PARTITION
#: ``Worker`` options; the benchmarks' baseline workers take them too, to compare like with like.
POLLERS = dict(
    workflow_task_poller_behavior=PollerBehaviorSimpleMaximum(WORKFLOW_TASK_POLLS),
    nonsticky_to_sticky_poll_ratio=NONSTICKY_POLL_RATIO,
    activity_task_poller_behavior=PollerBehaviorSimpleMaximum(ACTIVITY_TASK_POLLS),
)


def build_worker(client: Client, settings: Settings, env: FleetEnv | None = None, *,
                 workflows: list[type] | None = None) -> Worker:
    """The control-plane worker; ``workflows`` replaces ``ALL_WORKFLOWS`` only for a test that runs
    another build of a workflow type (tests/test_upgrade.py: a release with one more patch)."""
    env = env or FleetEnv.from_settings(settings)
    precompile_workflows()
    return Worker(
        client,
        task_queue=settings.task_queue,
        workflows=workflows or ALL_WORKFLOWS,
        # The HTTP relay needs only the worker's Temporal client, not the fleet's providers.
        activities=[*control_plane_activities(env), *EntityUpdateActivities().all()],
        # Provider SDKs block: activities are sync and run in these threads.
        activity_executor=ThreadPoolExecutor(max_workers=128, thread_name_prefix="activity"),
        max_concurrent_activities=128,
        max_cached_workflows=max_cached_workflows(),
        **POLLERS,
        interceptors=worker_interceptors(),
        workflow_runner=workflow_runner(client.data_converter),
    )


async def main(metrics_port: int | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s control-plane %(levelname)s %(message)s")
    settings = Settings.from_env()
    try:  # its every variable checked before anything starts (the orphan grace is read only at a scrape)
        ControlPlaneEnv.from_env()
    except SettingsError as error:
        raise SystemExit(str(error)) from None
    metrics = start_metrics(metrics_port, "control-plane")
    client = await connect(settings, runtime=metrics.runtime if metrics else None)
    env = FleetEnv.from_settings(settings)
    if metrics:
        watch_fleet(env, client, settings.task_queue)
    worker = build_worker(client, settings, env)
    settle_garbage_collection()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("polling task queue %s at %s", settings.task_queue, settings.address)
    async with worker:
        await stop.wait()
    log.info("stopped")


def cli(
    metrics_port: Annotated[Optional[int], typer.Option(min=1, max=65535,
        help="serve Prometheus metrics on this port (default: $GPUFLEET_METRICS_PORT; unset: no metrics endpoint)")] = None,
) -> None:
    """The control-plane worker: every workflow, and the provider and cluster activities.
    Connection and state from the environment (TEMPORAL_*, GPUFLEET_STATE_DIR, GPUFLEET_CONFIG)."""
    from workers.process_exit import run_then_exit

    run_then_exit(lambda: main(metrics_port))


if __name__ == "__main__":
    typer.run(cli)
