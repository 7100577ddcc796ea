"""Issue 35, finding 2: one node cannot starve every other node.

Before, the gateway capped nothing per node: with the frontend's default budget of 1,200
concurrent polls per namespace, one node holding more took all of it, and another node's
activity round trip went from 54-82 ms to 2.3-10.4 s; 40 polls of 3 MB each added 535 MB to
the gateway and 625 MB to the Temporal server.

Here, as deployed: the gateway in its own process (``python -m workers.node_gateway``) in front
of a Temporal dev server with the production frontend's default poll budget (1,200; the
suite's shared server raises it for the fleet benches), a victim node's agent (the SDK's
Worker, one poller) through it, and the attacker in a process of its own holding 1,300 polls
and 40 polls of 3 MB each (the gateway takes 16 of its calls, two upstream, holds 32 more,
``HELD_CALLS_PER_NODE``, and refuses the rest). The victim's round trips (server event times,
scheduled → completed) with the attack on and off alternate in short batches in one run; its p99 with the
attack may be at most 1.2 times its p99 without (the issue's 20%), or above it by no more than
this run's own noise, measured in it (how far apart the quiet batches' slowest round trips are,
at least 10 ms: other test workers share the two cores); and the gateway's peak resident memory
stays within the limit its manifest sets (deploy/kubernetes/node-gateway.yaml).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from kubernetes.utils import parse_quantity
from prometheus_client.parser import text_string_to_metric_families
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import PollerBehaviorSimpleMaximum, UnsandboxedWorkflowRunner, Worker

from bench.common import pct
from bench.gateway import RoundTrips, noop, round_trips
from cli.dev import DEV_SERVER_DYNAMIC_CONFIG, temporal_binary, wait_for_port
from fleet import search_attributes
from tests.ports import free_port
from tests.security.gateway_helpers import credentials, end_entity, live_entity, unique
from workers.node_agent import connect_via_gateway
from workers.gateway.node_identity import GatewayAccess
from workers.gateway.pki import Pki
from workers.gateway.proxy import HELD_CALLS_PER_NODE

pytestmark = pytest.mark.integration
#: The issue's bound: another node's round-trip p99 moves by at most 20%.
MAX_P99_RATIO = 1.2
#: The least noise a p99 of a few hundred round trips on two cores shared with other test
#: workers has (one scheduler pause); below the noise, no ratio says anything about the attack.
NOISE_FLOOR_SECONDS = 0.010

ROOT = Path(__file__).resolve().parents[2]
#: Temporal's own default for ``frontend.namespaceCount`` (concurrent long polls per namespace
#: and frontend instance), which a production frontend runs with.
FRONTEND_POLL_BUDGET = 1200
ROUNDS, BATCH = 16, 20
#: A batch takes about a second here; starved (every poll slot the attacker's) it never ends.
BATCH_SECONDS = 60
ATTACK_POLLS, BIG_POLLS = 1300, 40


def manifest_memory_limit() -> int:
    docs = yaml.safe_load_all((ROOT / "deploy/kubernetes/node-gateway.yaml").read_text())
    (deployment,) = [d for d in docs if d and d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return int(parse_quantity(container["resources"]["limits"]["memory"]))


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
async def production_frontend():
    """A dev server of its own whose frontend keeps Temporal's default poll budget."""
    tuning = {**DEV_SERVER_DYNAMIC_CONFIG, "frontend.namespaceCount": FRONTEND_POLL_BUDGET}
    flags = [arg for key, value in tuning.items() for arg in ("--dynamic-config-value", f"{key}={json.dumps(value)}")]
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), data_converter=pydantic_data_converter,
        search_attributes=search_attributes.ALL, dev_server_log_level="error", dev_server_extra_args=flags)
    yield env
    await env.shutdown()


def gateway_figures(metrics_port: int) -> dict[str, float]:
    """Polls the gateway forwards and holds now, calls it holds for nodes over their limits, and
    calls over limits (held or refused) since it started."""
    page = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    samples = {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples}
    return {"polls": samples.get("gpufleet_gateway_held_polls", 0.0),
            "over_limits": samples.get("gpufleet_gateway_held_over_limits", 0.0),
            "limited": samples.get("gpufleet_gateway_limited_total", 0.0)}


async def test_one_node_holding_1300_polls_and_3_mb_requests_moves_no_other_nodes_p99(production_frontend,
                                                                                     tmp_path) -> None:
    client = production_frontend.client
    pki = Pki.create("gpufleet flood-test CA")
    server_cert, server_key = pki.server_cert()
    files = {"ca": pki.ca_pem, "cert": server_cert, "key": server_key}
    attacker, victim = credentials(pki, unique("attacker")), credentials(pki, unique("victim"))
    files |= {"attacker.pem": attacker.cert, "attacker.key": attacker.key}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    for node in (attacker, victim):
        await live_entity(client, node.name)
    port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET_", "TEMPORAL_"))}
    env |= {"TEMPORAL_ADDRESS": client.service_client.config.target_host, "TEMPORAL_NAMESPACE": "default",
            "GPUFLEET_METRICS_PORT": str(metrics_port)}
    gateway = subprocess.Popen([sys.executable, "-m", "workers.node_gateway", "--listen", f"127.0.0.1:{port}",
                                "--cert", str(tmp_path / "cert"), "--key", str(tmp_path / "key"),
                                "--client-ca", str(tmp_path / "ca")], env=env, cwd=ROOT)
    attack: subprocess.Popen | None = None
    quiet, attacked, most_held = [], [], 0.0
    try:
        wait_for_port(port)
        wait_for_port(metrics_port)
        access = GatewayAccess(f"127.0.0.1:{port}", pki.ca_pem)
        agent = await connect_via_gateway(access, "default", victim.cert, victim.key)
        attack = subprocess.Popen(
            [sys.executable, "-m", "tests.security.flood_attacker", access.address, str(tmp_path / "ca"),
             str(tmp_path / "attacker.pem"), str(tmp_path / "attacker.key"), attacker.name,
             "--polls", str(ATTACK_POLLS), "--big", str(BIG_POLLS)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        async def attacking(on: bool) -> float:
            """Switch the attack on (each of its calls over its limits held at the gateway, or
            refused beyond what the gateway holds of a node) or off (every call gone); how many
            calls of it the gateway holds."""
            attack.stdin.write("on\n" if on else "off\n")
            attack.stdin.flush()
            answer = await asyncio.to_thread(attack.stdout.readline)
            assert answer.startswith("holding" if on else "quiet"), answer
            deadline = asyncio.get_running_loop().time() + 20
            before = None
            while True:
                now = await asyncio.to_thread(gateway_figures, metrics_port)
                # Off: the victim's own poll, and at most a couple of the attacker's that the
                # gateway has not yet seen cancelled (each ends within its deadline anyway).
                # On: as many held as the gateway holds of one node, and the burst of calls the
                # attacker sent all judged (no more counted over limits, as before the per-node
                # held limit, when the round began once its calls were all held).
                settled = before is not None and now["limited"] == before["limited"]
                if (settled and now["over_limits"] >= HELD_CALLS_PER_NODE) if on \
                        else (now["polls"] + now["over_limits"] <= 3):
                    return now["over_limits"]
                assert asyncio.get_running_loop().time() < deadline, f"attack {'on' if on else 'off'}: {now}"
                before = now
                await asyncio.sleep(0.25 if on else 0.1)

        control_queue = f"flood-{uuid.uuid4().hex[:6]}"
        quiet_rounds: list[list[float]] = []
        async with Worker(client, task_queue=control_queue, workflows=[RoundTrips],
                          workflow_runner=UnsandboxedWorkflowRunner()), \
                Worker(agent, task_queue=f"node/{victim.name}", activities=[noop],
                       activity_task_poller_behavior=PollerBehaviorSimpleMaximum(1)):
            await round_trips(client, control_queue, f"node/{victim.name}", 10)  # warm-up
            # Short batches, in the order quiet-attacked, attacked-quiet, ...: load from anything else
            # on the two shared cores falls on both sides alike.
            for i in range(ROUNDS):
                for on in ((False, True) if i % 2 == 0 else (True, False)):
                    held = await attacking(on)
                    most_held = max(most_held, held)
                    try:
                        batch = await asyncio.wait_for(
                            round_trips(client, control_queue, f"node/{victim.name}", BATCH), BATCH_SECONDS)
                    except asyncio.TimeoutError:
                        raise AssertionError(f"{BATCH} round trips of the victim took over {BATCH_SECONDS} s "
                                             f"with the attack {'on' if on else 'off'}") from None
                    (attacked if on else quiet).extend(batch)
                    if not on:
                        quiet_rounds.append(batch)
            await attacking(False)
        peak, limit = peak_rss(gateway.pid), manifest_memory_limit()
    finally:
        if attack is not None:
            attack.kill()
            attack.wait(10)
        gateway.terminate()
        gateway.wait(15)
        for node in (attacker, victim):
            await end_entity(client, node.name)
    ratio = pct(attacked, 99) / pct(quiet, 99)
    # The noise of this run, measured in it and nowhere else: how far apart the quiet batches'
    # own slowest round trips are (each batch ran between attacked ones, on the same two shared
    # cores). A p99 of 160 samples is their second-highest, so one pause of a neighbouring test
    # worker moves it by tens of ms, and such a pause falls on a quiet batch as it falls on an
    # attacked one: an attacked p99 above the quiet one by no more than the quiet batches differ
    # among themselves (and never less than 10 ms) is no effect of the attack. Starved, before
    # the per-node limits, the victim's round trips took seconds (2.3 to 10.4 s).
    slowest = [max(batch) for batch in quiet_rounds]
    noise = max(NOISE_FLOOR_SECONDS, max(slowest) - min(slowest))
    figures = (f"victim round trip p99 {pct(quiet, 99) * 1000:.1f} ms quiet, {pct(attacked, 99) * 1000:.1f} ms "
               f"attacked (ratio {ratio:.2f}); p50 {sorted(quiet)[len(quiet) // 2] * 1000:.1f} / "
               f"{sorted(attacked)[len(attacked) // 2] * 1000:.1f} ms; gateway held {most_held:.0f} calls over limits, "
               f"peak RSS {peak / 2**20:.0f} MiB of {limit / 2**20:.0f} MiB; noise {noise * 1000:.1f} ms")
    print(figures)
    assert ratio <= MAX_P99_RATIO or pct(attacked, 99) - pct(quiet, 99) <= noise, figures
    assert peak < limit, figures
    assert most_held == HELD_CALLS_PER_NODE, figures
