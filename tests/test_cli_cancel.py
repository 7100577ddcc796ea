"""A command that started a request and ends before it cancels it (issue 36): `gpufleet join`
interrupted deletes the machine its join bought and buys nothing afterwards; `--detach` leaves
the join running and says how to follow and stop it; each command names its workflow's
Temporal UI page.

Against the real dev server, the control-plane worker and the simulated providers, with the
command as an operator runs it: a subprocess, its output piped, Ctrl-C as SIGINT."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid

import pytest

from temporalio.client import WorkflowExecutionStatus

from fleet.messages.join import NodeJoinResult
from tests.conftest import Stack, wait_for


def gpufleet(stack: Stack, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cli", *args], env={**stack.settings_env(), "COLUMNS": "250", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def finished(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, _ = await asyncio.to_thread(proc.communicate, timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


async def read_until(proc: subprocess.Popen, words: str, timeout: float = 60) -> str:
    """The command's output up to the first line containing ``words``."""
    seen: list[str] = []

    def read() -> str:
        for line in proc.stdout:
            seen.append(line)
            if words in line:
                return "".join(seen)
        raise AssertionError(f"{words!r} never printed (exit {proc.poll()}):\n" + "".join(seen))

    reading = asyncio.ensure_future(asyncio.to_thread(read))
    done, _ = await asyncio.wait({reading}, timeout=timeout)
    if not done:
        proc.kill()  # ends the read, which then says what was printed
    return await reading


def ui_port(stack: Stack) -> int:
    return int(stack.settings.address.rpartition(":")[2]) + 1000


async def test_ctrl_c_on_gpufleet_join_deletes_its_machine_and_nothing_is_bought_afterwards(stack: Stack) -> None:
    request = f"int-{uuid.uuid4().hex[:6]}"
    workflow_id = f"join/site-a/{request}"
    stack.world.set_site("site-a", boot_seconds=60)  # the machine is bought, then boots for a minute
    proc = gpufleet(stack, "join", "--site", "site-a", "--request", request)
    try:
        early = await read_until(proc, "waiting for registration")  # piped: one plain line per change
        await wait_for(lambda: len(stack.world.machines("site-a")) == 1, timeout=20)
        (machine,) = stack.world.machines("site-a")
        proc.send_signal(signal.SIGINT)
        out = early + await finished(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert f"UI: http://127.0.0.1:{ui_port(stack)}/namespaces/default/workflows/join%2Fsite-a%2F{request}" in out, out
    assert f"cancelled {workflow_id}: machine {machine['id']} deleted, node {machine['name']} never admitted" in out, out
    assert "Traceback" not in out, out
    assert stack.world.machines("site-a") == [], "the join deleted its machine before the command ended"
    handle = stack.client.get_workflow_handle(workflow_id)
    # NodeJoin reports the cancellation of the step it was in as its failure, typed CancelledError.
    assert (await handle.describe()).status in (WorkflowExecutionStatus.CANCELED, WorkflowExecutionStatus.FAILED)
    # Time for anything still running to buy again (nothing must).
    stack.world.set_site("site-a", boot_seconds=0.2)
    await asyncio.sleep(4)
    assert len(stack.world.machines("site-a", include_deleted=True)) == 1 and stack.world.machines("site-a") == []
    assert [n for n in stack.cluster.list_nodes() if n.name == machine["name"]] == [], "never admitted"


async def test_sigterm_on_a_fan_out_cancels_every_join_it_started(stack: Stack) -> None:
    """SIGTERM (what `kill`, systemd and CI runners send) ends it like Ctrl-C: both joins stop."""
    request = f"term-{uuid.uuid4().hex[:6]}"
    stack.world.set_site("site-b", boot_seconds=60)
    proc = gpufleet(stack, "join", "--site", "site-b", "--count", "2", "--request", request)
    try:
        await wait_for(lambda: len(stack.world.machines("site-b")) == 2, timeout=40)
        proc.send_signal(signal.SIGTERM)
        out = await finished(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    for i in range(2):
        assert f"cancelled join/site-b/{request}-{i}: machine " in out, out
    assert stack.world.machines("site-b") == []
    stack.world.set_site("site-b", boot_seconds=0.2)
    await asyncio.sleep(3)
    assert len(stack.world.machines("site-b", include_deleted=True)) == 2 and stack.world.machines("site-b") == []


async def test_detach_leaves_the_join_running_and_says_how_to_follow_and_stop_it(stack: Stack) -> None:
    request = f"det-{uuid.uuid4().hex[:6]}"
    workflow_id = f"join/site-a/{request}"
    proc = gpufleet(stack, "join", "--site", "site-a", "--request", request, "--detach",
                    GPUFLEET_UI_URL="https://temporal.example.com/")
    out = await finished(proc, timeout=60)
    assert proc.returncode == 0, out
    assert f"UI: https://temporal.example.com/namespaces/default/workflows/join%2Fsite-a%2F{request}" in out, out
    assert f"detached: {workflow_id} runs on" in out, out
    assert f"temporal workflow query --workflow-id {workflow_id} --type progress" in out, "how to follow it"
    assert f"temporal workflow cancel --workflow-id {workflow_id}" in out, "how to stop it"
    # Nobody waits, and nobody cancels: the join completes by itself.
    result = NodeJoinResult.model_validate(await stack.client.get_workflow_handle(workflow_id).result())
    assert [m["name"] for m in stack.world.machines("site-a")] == [result.nodes[0].node_name]


async def test_capacity_names_its_ui_page_and_how_to_stop_it(stack: Stack) -> None:
    request = f"cap-{uuid.uuid4().hex[:6]}"
    proc = gpufleet(stack, "capacity", "--site", "site-a", "--request", request, "--detach")
    out = await finished(proc, timeout=60)
    assert proc.returncode == 0, out
    assert f"UI: http://127.0.0.1:{ui_port(stack)}/namespaces/default/workflows/capacity%2F{request}" in out, out
    assert f"gpufleet capacity-cancel capacity/{request}" in out, out
    await stack.client.get_workflow_handle(f"capacity/{request}").result()


def test_the_ui_link_follows_the_frontend_and_the_override(monkeypatch) -> None:
    from cli.requests import ui_link
    from fleet.settings import Settings

    monkeypatch.delenv("GPUFLEET_UI_URL", raising=False)
    assert ui_link(Settings(address="127.0.0.1:7233"), "join/a/b") == \
        "http://127.0.0.1:8233/namespaces/default/workflows/join%2Fa%2Fb", "the dev server's own default"
    assert ui_link(Settings(address="prod.abc12.tmprl.cloud:7233", namespace="prod.abc12"), "x") == \
        "https://cloud.temporal.io/namespaces/prod.abc12/workflows/x"
    monkeypatch.setenv("GPUFLEET_UI_URL", "https://temporal.internal/")
    assert ui_link(Settings(namespace="fleet"), "evacuate/s/manual-1") == \
        "https://temporal.internal/namespaces/fleet/workflows/evacuate%2Fs%2Fmanual-1"


async def test_a_cancel_no_worker_takes_is_not_said_to_be_taken(capsys) -> None:
    """Ctrl-C on `gpufleet capacity` while the control plane is down: the client's cancel is not
    taken (``UpdateNotTaken`` after its 10 s). The command said "cancel taken; the joins are still
    stopping" (the error is a TimeoutError, and the 300 s wait took it for its own), and the request
    went on buying unstopped; now the client's error reaches ``cli.common.run``, which says it was
    not applied and exits 1."""
    from cli.requests import cancel_capacity
    from client import UpdateNotTaken

    class ControlPlaneDown:
        async def cancel_capacity(self, workflow_id, reason, accepted=None):
            raise UpdateNotTaken(workflow_id, "cancel", "gpufleet", 10)

    with pytest.raises(UpdateNotTaken):
        await cancel_capacity(ControlPlaneDown(), "capacity/r1", "interrupted")
    assert "cancel taken" not in capsys.readouterr().err
