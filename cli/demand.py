"""``gpufleet demand`` (Pending pods, the loop's plans and purchases) and ``gpufleet sim pods``
(demand for the simulated cluster)."""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from cli.common import Address, ConfigPath, OutputFormat, StateDir, console, connect, fail, fleet_env, run, show_rows
from cli.common import settings as _settings
from cli.requests import announce
from fleet.cluster import LABEL_GPU_PRODUCT, LABEL_MODEL, LABEL_SITE
from fleet.demand import (
    DEMAND_TAINT_KEY,
    LABEL_CAPACITY_TYPE,
    LABEL_FLEET,
    LABEL_GEOGRAPHY,
    GpuPod,
    Toleration,
    opted_in,
)
from fleet.messages.demand import DemandStatus
from fleet.naming import DEMAND_WORKFLOW_ID
from fleet.contracts import workflows as flows

pods_app = typer.Typer(help="Pods with GPU requests in the simulated cluster (demand).", no_args_is_help=True)

#: The label `gpufleet sim pods add` puts on its pods: `gpufleet sim reset` removes those and no
#: others (a serving pod the fleet runs, a pod a test made, stays).
SIM_ADDED_LABEL = "gpufleet.io/added-by"
SIM_ADDED_BY = "gpufleet-sim-pods-add"


def demand(
    start: Annotated[bool, typer.Option("--start", help="start the demand loop (idempotent)")] = False,
    address: Address = "localhost:7233", state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None,
    output: OutputFormat = "table",
) -> None:
    """Pending GPU pods, and what the demand loop planned and bought for them (with why)."""
    settings = _settings(address, state_dir, config)
    env = fleet_env(state_dir, config)
    pods = [p for p in env.cluster.list_gpu_pods() if p.pending]
    status = run(_status(settings, start))
    rows = []
    for pod in pods:
        answer = (status.covered.get(pod.key) or status.unplaceable.get(pod.key)
                  or next((f"{p.workflow_id} ({p.status}) → {p.offer}" for p in status.purchases
                           if pod.key in p.pods), ""))
        rows.append([pod.key, str(pod.gpus), "yes" if opted_in(pod) else "no", pod.nominated_node or "-",
                     answer or ("not opted in" if not opted_in(pod) else "next batch")])
    show_rows("Pending GPU pods", ["pod", "GPUs", "opted in", "nominated", "answer"], rows, output,
              drop_narrow=(("opted in", "opt-in"), "nominated"))
    show_rows("purchases", ["purchase", "status", "offer", "pods", "why"],
              [[p.workflow_id, p.status, p.offer, str(len(p.pods)), p.reason] for p in status.purchases], output,
              drop_narrow=("pods",))
    if output == "table":
        for line in status.log[-15:]:
            console.print(f"  {line}")


async def start_demand_loop(client, task_queue: str) -> None:
    """Start the fleet's one demand loop unless it runs (``gpufleet demand --start``, ``gpufleet dev``)."""
    from temporalio.common import WorkflowIDConflictPolicy

    await client.start_workflow(
        flows.Demand.TYPE, {}, id=DEMAND_WORKFLOW_ID, task_queue=task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary="demand: Pending GPU pods buy capacity, idle nodes go back",
    )


async def _start(client, settings) -> None:
    """Start the loop unless it runs, and name it with its Temporal UI link like every command
    that starts a workflow."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError

    try:
        running = (await client.get_workflow_handle(DEMAND_WORKFLOW_ID).describe()).status \
            == WorkflowExecutionStatus.RUNNING
    except RPCError:  # never started, or its run is gone from retention
        running = False
    if not running:
        await start_demand_loop(client, settings.task_queue)
    announce(settings, DEMAND_WORKFLOW_ID, "already running" if running else "started")


async def _status(settings, start: bool) -> DemandStatus:
    """The loop's status; without ``start``, a loop not running is said to be, with how its last
    run ended (before, a cancelled or failed loop's last status read as a running loop's)."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError

    from client import NotFound, query_workflow

    client = await connect(settings)
    if start:
        await _start(client, settings)
    handle = client.get_workflow_handle(DEMAND_WORKFLOW_ID)
    if not start:
        try:
            described = await handle.describe()
        except RPCError:  # never started, or its run is gone from retention
            described = None
        if described is None or described.status != WorkflowExecutionStatus.RUNNING:
            ended = "" if described is None else (
                f": its last run ended {described.status.name.lower().replace('_', ' ')}"
                + (f" at {described.close_time:%Y-%m-%d %H:%M:%S} UTC" if described.close_time else "")
                + "; what it last said follows")
            console.print(f"[yellow]the demand loop is not running[/]{ended} (gpufleet demand --start)",
                          soft_wrap=True)
            if described is None:
                return DemandStatus()
    try:  # no worker answers: NoWorker, which the command reports (an empty status here read as an idle loop)
        return await query_workflow(client, DEMAND_WORKFLOW_ID, flows.Demand.status, DemandStatus,
                                    task_queue=settings.task_queue)
    except NotFound:  # gone from retention since the describe
        return DemandStatus()


@pods_app.command("add")
def pods_add(
    name: Annotated[str, typer.Argument(help="pod name (with --count: a prefix)")],
    gpus: Annotated[int, typer.Option(min=1, max=64)] = 1,
    count: Annotated[int, typer.Option(min=1, max=1000)] = 1,
    namespace: str = "default",
    model: Annotated[Optional[str], typer.Option(help="the model label (its serving policy)")] = None,
    gpu: Annotated[Optional[str], typer.Option(help="GPU product selector, e.g. H100")] = None,
    site: Annotated[Optional[str], typer.Option(help="site selector")] = None,
    geo: Annotated[Optional[str], typer.Option(help="geography selector")] = None,
    capacity_type: Annotated[Optional[str], typer.Option(help="on-demand, spot or owned")] = None,
    opt_in: Annotated[bool, typer.Option(help="carry the fleet toleration and selector")] = True,
    state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None,
) -> None:
    """Create Pending pods that request GPUs (opted in to the fleet by default)."""
    env = fleet_env(state_dir, config)
    if env.world is None:
        fail("sim pods: only the simulated cluster (mode: sim)", 2)
    selector = {k: v for k, v in ((LABEL_GPU_PRODUCT, gpu), (LABEL_SITE, site), (LABEL_GEOGRAPHY, geo),
                                  (LABEL_CAPACITY_TYPE, capacity_type)) if v}
    if opt_in:
        selector[LABEL_FLEET] = "true"
    tolerations = [Toleration(key=DEMAND_TAINT_KEY, operator="Exists", effect="NoSchedule")] if opt_in else []
    names = [name] if count == 1 else [f"{name}-{i}" for i in range(count)]
    labels = {SIM_ADDED_LABEL: SIM_ADDED_BY, **({LABEL_MODEL: model} if model else {})}
    for pod_name in names:
        env.cluster.create_pod(GpuPod(namespace=namespace, name=pod_name, gpus=gpus, node_selector=selector,
                                      labels=labels, tolerations=tolerations, created_at=time.time()))
    console.print(f"{len(names)} Pending pods, {gpus} GPU each" + (f", selecting {selector}" if selector else ""))
    # Like every sim knob: the command that takes it back (the nodes bought for them go back once
    # idle past the TTL). `gpufleet sim reset` removes every pod this command added.
    undo = ["gpufleet", "sim", "pods", "delete", *names, *(["--namespace", namespace] if namespace != "default" else [])]
    console.print(f"undo: {shlex.join(undo)}   (or gpufleet sim reset)", markup=False, highlight=False, soft_wrap=True)


def remove_added_pods(env) -> list[str]:
    """Delete every pod `gpufleet sim pods add` made (``gpufleet sim reset``); one line per pod."""
    if env.world is None:
        return []
    added = [p for p in env.cluster.list_gpu_pods() if p.labels.get(SIM_ADDED_LABEL) == SIM_ADDED_BY]
    return [f"{pod.key}: pod added by `gpufleet sim pods add` deleted" + (f" (it ran on {pod.node})" if pod.node else "")
            for pod in added if env.cluster.delete_pod(pod.namespace, pod.name)]


@pods_app.command("delete")
def pods_delete(names: Annotated[list[str], typer.Argument(help="pod names")], namespace: str = "default",
                state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None) -> None:
    """Delete pods (a scale-down): their nodes go back once idle past the TTL."""
    env = fleet_env(state_dir, config)
    gone = [n for n in names if env.cluster.delete_pod(namespace, n)]
    console.print(f"deleted {len(gone)} of {len(names)}")


@pods_app.command("list")
def pods_list(state_dir: StateDir = Path(".gpufleet"), config: ConfigPath = None,
              output: OutputFormat = "table") -> None:
    """GPU pods: Pending or bound, and where (the simulated scheduler runs first)."""
    env = fleet_env(state_dir, config)
    rows = [[p.key, str(p.gpus), p.phase, p.node or "-", ", ".join(f"{k}={v}" for k, v in p.node_selector.items())]
            for p in env.cluster.list_gpu_pods()]
    show_rows("GPU pods", ["pod", "GPUs", "phase", "node", "selector"], rows, output, drop_narrow=("selector",))


def register(app: typer.Typer, sim_app: typer.Typer) -> None:
    app.command("demand")(demand)
    sim_app.add_typer(pods_app, name="pods")
