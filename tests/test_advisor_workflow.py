"""The Advisor workflow on the simulated fleet: joins and a spot reclaim write the usage
ledger as they happen; the Advisor reads it and the catalog and makes no provider write
call (counted at the sim); its report is its result and its current details."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import AsyncIterator

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from activities.ledger import UsageLedger
from client import FleetClient
from fleet.cluster import ServingSpec
from fleet.messages.advisor import AdvisorReport, LedgerEntry
from fleet.messages.capacity import SpotReclaimResult
from fleet.models import CapacityType
from tests.capacity_fleet import FAST_JOIN, CapStack, capacity_fleet, open_stack, replay_and_record

H = 3600.0
WRITES = ("create", "delete")


@pytest.fixture
async def cap(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[CapStack]:
    uid = uuid.uuid4().hex[:6]
    address = temporal_env.client.service_client.config.target_host
    async for stack in open_stack(temporal_env.client, address, tmp_path, capacity_fleet(uid), uid):
        yield stack


async def started(handle, timeout: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await handle.describe()
            return
        except RPCError:
            assert asyncio.get_running_loop().time() < deadline, f"{handle.id} never started"
            await asyncio.sleep(0.1)


def writes(cap: CapStack) -> int:
    return sum(cap.world.calls(cap.account(a), op) for a in "abcd" for op in WRITES)


async def test_the_ledger_is_written_as_it_happens_and_the_advisor_only_reads(cap: CapStack) -> None:
    spot, mid = cap.site("spot"), cap.site("mid")
    await cap.client.execute_workflow("NodeJoin", {"site": spot, "timeouts": FAST_JOIN}, id=f"join/{spot}/adv",
                                      task_queue=cap.settings.task_queue)
    (machine,) = cap.world.machines(spot)
    ledger = UsageLedger(cap.cluster)
    [joined] = ledger.entries()
    assert (joined.machine_id, joined.site, joined.capacity_type, joined.price_per_gpu_hour, joined.gpus) == (
        machine["id"], spot, CapacityType.SPOT, 1.5, 2)
    assert joined.joined_at and joined.retired_at is None

    cap.world.post_reclaim_notice(machine["id"], seconds=2)  # the node agent's watcher starts SpotReclaim
    reclaim = cap.client.get_workflow_handle(f"reclaim/{machine['name']}")
    await started(reclaim)
    SpotReclaimResult.model_validate(await reclaim.result())
    by_id = {e.machine_id: e for e in ledger.entries()}
    assert by_id[machine["id"]].reclaimed and by_id[machine["id"]].retired_at is not None
    assert any(e.site == cap.site("cheap") and e.joined_at for e in by_id.values()), "the replacement's join"

    # Ten hours of history at mid (what an earlier week's joins wrote), serving "chat".
    until = time.time()
    ledger.joined(LedgerEntry(machine_id="i-hist", site=mid, offer="mid.2xh100", gpu="H100", gpus=2,
                              gpu_memory_gb=80, price_per_gpu_hour=2.5, joined_at=until - 10 * H))
    cap.cluster.apply_serving(ServingSpec(model="chat", site=mid, image="img", replicas=1, gpus_per_replica=2))

    before, nodes = writes(cap), sorted(n.name for n in cap.cluster.list_nodes())
    fleet = FleetClient(cap.settings, temporal=cap.client)
    handle = await fleet.start_advisor({"since": "1d", "until": until,
                                        "constraints": {"chat": {"capacity_types": ["on-demand"]}}})
    assert handle.id == "advisor/1d"
    report: AdvisorReport = await handle.result()
    assert writes(cap) == before, "the advisor created or deleted a machine"
    assert sorted(n.name for n in cap.cluster.list_nodes()) == nodes

    chat = next(w for w in report.workloads if w.model == "chat")
    # 2 GPUs x 10 h at $2.50 = $50; on-demand only: cheap at $2.00 = $40 (spot at $1.50 x 1.8 is not allowed).
    assert (chat.gpu_hours, chat.now, chat.advised, chat.saving, chat.advised_site) == (
        20.0, 50.0, 40.0, 10.0, cap.site("cheap"))
    assert f"{cap.offer('spot')}: spot not allowed" in chat.rejected
    reclaimed = next(w for w in report.workloads if w.site == spot)
    assert reclaimed.reclaims == 1 and reclaimed.model == "(none)"

    metadata = await handle.query("__temporal_workflow_metadata")
    details = metadata.current_details if hasattr(metadata, "current_details") else metadata["currentDetails"]
    assert "**done**" in details and r"\$50.00" in details and "$50.00" not in details.replace(r"\$", "")
    await replay_and_record(handle, "advisor_report")


async def gpufleet(cap: CapStack, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **cap.settings.env(), "COLUMNS": "200"}
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "cli", *args], env=env, capture_output=True, text=True, timeout=120)


def chat_served_at_mid(cap: CapStack, machine_id: str) -> None:
    """Three hours of a machine at mid in the ledger, and "chat" served there."""
    mid = cap.site("mid")
    UsageLedger(cap.cluster).joined(LedgerEntry(machine_id=machine_id, site=mid, offer="mid.2xh100", gpu="H100",
                                                gpus=2, gpu_memory_gb=80, price_per_gpu_hour=2.5,
                                                joined_at=time.time() - 3 * H))
    cap.cluster.apply_serving(ServingSpec(model="chat", site=mid, image="img", replicas=1, gpus_per_replica=2))


async def test_the_cli_shows_the_table_the_markdown_and_writes_a_png_chart(cap: CapStack, tmp_path: Path) -> None:
    chat_served_at_mid(cap, "i-cli")
    chart = tmp_path / "advisor.png"
    table = await gpufleet(cap, "advisor", "--since", "2d", "--chart", str(chart))
    assert table.returncode == 0, table.stderr
    assert "chat" in table.stdout and cap.site("cheap") in table.stdout and "total: now $" in table.stdout
    # A PNG, written by matplotlib (its Software chunk), of a sensible size.
    data = chart.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and b"matplotlib" in data[:400] and len(data) > 5000

    md = await gpufleet(cap, "advisor", "--since", "2d", "--format", "md")
    assert md.returncode == 0 and md.stdout.startswith("**Advisor, last 2d**") and "| chat |" in md.stdout
    as_json = await gpufleet(cap, "advisor", "--since", "2d", "--format", "json")
    assert json.loads(as_json.stdout)["workloads"][0]["model"] == "chat"

    bad = await gpufleet(cap, "advisor", "--since", "7y")
    assert bad.returncode == 2 and "since" in bad.stderr


async def test_constraints_for_a_model_no_workload_serves_are_refused_naming_the_key(cap: CapStack,
                                                                                     tmp_path: Path) -> None:
    """A mistyped model key (``chta`` for ``chat``) was dropped: the report priced chat with its
    site's defaults (spot allowed) while the operator believed on-demand only applied."""
    chat_served_at_mid(cap, "i-typo")
    constraints = tmp_path / "constraints.yaml"
    constraints.write_text("chta:\n  capacity_types: [on-demand]\n")

    shown = await gpufleet(cap, "advisor", "--since", "4d", "--constraints", str(constraints))
    assert shown.returncode == 1, shown.stdout
    assert ("constraints.chta: no workload serves a model 'chta', so its constraints would apply to nothing "
            "(served: chat)") in " ".join(shown.stderr.split()), shown.stderr
    assert "total: now" not in shown.stdout

    handle = cap.client.get_workflow_handle("advisor/4d")
    with pytest.raises(WorkflowFailureError) as caught:
        await handle.result()
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidInput" and cause.non_retryable, cause
    assert cause.message.startswith("invalid AdvisorInput: constraints.chta: "), cause.message
    assert cause.details == ({"fields": ["constraints.chta"]},)
    await replay_and_record(handle, "advisor_refused_unserved_constraints")


def test_constraints_yaml_would_read_wrong_are_refused_naming_where_before_asking(tmp_path: Path) -> None:
    """`gpufleet advisor --constraints FILE`: a model given twice kept only the last one's constraints
    (YAML drops the first without a word) and the report was asked for with them; a file nested some
    thousand deep ended in a RecursionError traceback. Now each is refused (exit 2), naming where,
    before Temporal is asked (the address here answers nothing)."""
    from typer.testing import CliRunner

    from cli.main import app

    twice = tmp_path / "twice.yaml"
    twice.write_text("chat:\n  capacity_types: [on-demand]\nbatch: {}\nchat:\n  capacity_types: [spot]\n")
    deep = tmp_path / "deep.yaml"
    deep.write_text("chat: " + "[" * 3000 + "]" * 3000 + "\n")
    for path, said in [(twice, "chat: given twice (lines 1 and 4); YAML keeps only the last"),
                       (deep, "not valid YAML: nested too deeply")]:
        result = CliRunner().invoke(app, ["advisor", "--constraints", str(path), "--address", "127.0.0.1:1"])
        shown = " ".join(result.output.split())
        assert result.exit_code == 2 and "--constraints: " in shown and said in shown, (shown, result.exception)
        assert "cannot reach Temporal" not in shown, shown
