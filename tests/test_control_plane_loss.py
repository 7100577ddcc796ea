"""Static stability: the control plane (Temporal and its worker) goes away and comes back.

- ``gpufleet gameday control-plane-loss`` against a stack laid out as `gpufleet dev` lays it
  out (a Temporal dev server on an SQLite file under the state dir, the control-plane worker as
  its own process, node agents through a node gateway, the front door when HAProxy is there):
  two sites of 4 nodes, and after the return 3 of each site's 4 nodes look NotReady for a few
  seconds (their kubelets unheard: the outage's shadow), which is the incident rule's
  max(3, 30 %). 0 false repairs, 0 false incidents, every request through the front door during
  the outage served, every real fault injected during the outage repaired after it, steady state.
- A health report observed too long ago is ignored with a log line; a fresh one is acted on.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

import yaml

from cli.dev import server_command
from cli.front_door import DevFrontDoor
from fleet import search_attributes
from fleet.cluster import ServingSpec
from fleet.config import load_config
from fleet.settings import Settings
from fleet.temporal import connect
from providers.haproxy import haproxy_binary
from tests.conftest import sim_host, start_test_gateway, terminate_running, wait_for
from tests.ports import free_port
from tests.evacuation_helpers import FAST_JOIN, incident_fleet, poll
from tests.replay import replay_and_record
from workers.control_plane import build_worker
from workers.node_agent import SimNodeHost, pki_signer

#: Short enough for a test: the Site entities notice a gap of more than check + 1 s, hold
#: repairs 2 s after the return, and a health observation older than 4 s is stale.
CONTROL_PLANE = {"return_grace_seconds": 2, "absence_seconds": 1, "max_report_age_seconds": 4}
#: The game day's shadow: kubelets post again between 2 and 4 s after the return, so the grace
#: (longer than that) covers it; the outage is long enough for a gap of more than check + 1 s.
KUBELET_LAG = 4
GAMEDAY_CONTROL_PLANE = {**CONTROL_PLANE, "return_grace_seconds": 6}
OUTAGE = 6
NODES_PER_SITE = 4


async def _server(settings: Settings) -> tuple[subprocess.Popen, object]:
    log = open(settings.state_dir / "temporal.log", "ab")
    # A port found free can be taken by another test's process before the server binds it (it
    # then exits: "address already in use"): such a start is tried again on fresh ports.
    for _ in range(3):
        # Below the ephemeral range (tests/ports.py): a port bind(0) found free can be a client's next.
        port, ui, http = free_port(), free_port(), free_port()
        settings.address = f"127.0.0.1:{port}"
        proc = subprocess.Popen(server_command(settings, port, ui, http), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        for _ in range(200):
            if proc.poll() is not None:
                break  # exited: its ports were taken meanwhile
            try:
                client = await connect(settings)
                await search_attributes.ensure_registered(client)
                return proc, client
            except Exception:  # noqa: BLE001 - not up yet
                await asyncio.sleep(0.1)
        else:
            break
    raise AssertionError("the test's Temporal server did not come up")


async def test_gameday_control_plane_loss(tmp_path) -> None:
    uid = uuid.uuid4().hex[:6]
    fleet = incident_fleet(uid)
    fleet["control_plane"] = GAMEDAY_CONTROL_PLANE
    fleet["incident"]["check_seconds"] = 1
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(fleet))
    settings = Settings(task_queue=f"cpl-{uid}", state_dir=tmp_path.resolve(), config=str(path))
    server, client = await _server(settings)
    env = {**os.environ, **settings.env(), "GPUFLEET_HEALTH_SECONDS": "0.2"}
    worker = subprocess.Popen([sys.executable, "-m", "workers.control_plane"], env=env,
                              stdout=open(tmp_path / "control-plane.log", "ab"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    gateway = await start_test_gateway(client)
    host = SimNodeHost(client, settings, poll_seconds=0.05, gateway=gateway.access, signer=pki_signer(gateway.pki))
    host.health_seconds = 0.2
    stop = asyncio.Event()
    host_task = asyncio.create_task(host.run(stop))
    door = None
    try:
        cfg = load_config(str(path))
        sites = (cfg.sites[0].name, cfg.sites[2].name)
        await asyncio.gather(*(client.execute_workflow(
            "NodeJoin", {"site": site, "count": NODES_PER_SITE, "timeouts": FAST_JOIN},
            id=f"join/{site}/{uid}", task_queue=settings.task_queue) for site in sites))
        port = None
        if haproxy_binary() is not None:  # CI installs it; only this part needs it
            for site in sites:  # one replica needs one node's 2 GPUs: the node the shadow spares
                host.cluster.apply_serving(ServingSpec(model=f"llm-{uid}", site=site, image="vllm:1", replicas=1,
                                                       gpus_per_replica=2))
            port = free_port()
            door = await DevFrontDoor(host.cluster, tmp_path / "front-door", bind=f"127.0.0.1:{port}",
                                      first_token_ms=1).start()
        out = tmp_path / "gameday.json"
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "cli", "gameday", "control-plane-loss", "--seconds", str(OUTAGE), "--faults", "2",
             "--kubelet-lag", str(KUBELET_LAG), "--timeout", "40", "--json", str(out),
             *(["--front-door-port", str(port)] if port else [])],
            env=env, capture_output=True, text=True, timeout=90,
        )
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
        report = json.loads(out.read_text())
        assert report["false_repairs"] == [] and report["false_incidents"] == [], report
        assert report["machines_disrupted_without_a_fault"] == []
        # The shadow was there to be mistaken: all but one node of each site NotReady after the return.
        assert report["nodes_not_ready_after_return"] == 2 * (NODES_PER_SITE - 1)
        assert report["real_faults"] == 2 and report["real_faults_repaired"] == 2
        assert report["seconds_to_steady_state"] is not None
        assert report["outage_seconds"] >= OUTAGE
        if port:
            served = report["requests_during_outage"]
            assert served["failed"] == 0 and served["served"] >= OUTAGE, report
        # Every Site entity saw the control plane go and come back (its own timer ran late).
        for site in (cfg.sites[0].name, cfg.sites[2].name):
            status = await client.get_workflow_handle(f"site/{site}").query("status")
            assert status["incident"]["control_plane_returned_at"] is not None, status
        await replay_and_record(client.get_workflow_handle(f"site/{cfg.sites[0].name}"), "site_control_plane_return")
    finally:
        if door is not None:
            await door.stop()
        stop.set()
        await host_task
        await gateway.running.stop(grace=None)
        for proc_ in (worker, server):
            proc_.terminate()
            try:
                proc_.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc_.kill()


async def test_stale_health_report_is_ignored_and_a_fresh_one_acted_on(temporal_env, tmp_path) -> None:
    uid = uuid.uuid4().hex[:6]
    fleet = incident_fleet(uid)
    fleet["control_plane"] = CONTROL_PLANE
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(fleet))
    client = temporal_env.client
    settings = Settings(address=client.service_client.config.target_host, task_queue=f"stale-{uid}",
                        state_dir=tmp_path, config=str(path))
    host = sim_host(client, settings, poll_seconds=0.05)
    host.health_seconds = 0.2
    stop = asyncio.Event()
    host_task = asyncio.create_task(host.run(stop))
    try:
        async with build_worker(client, settings):
            site = load_config(str(path)).sites[0].name
            await client.execute_workflow("NodeJoin", {"site": site, "count": 1, "timeouts": FAST_JOIN},
                                          id=f"join/{site}/{uid}", task_queue=settings.task_queue)
            [machine] = [m["id"] for m in host.world.machines(site)]
            node = next(n for n in host.cluster.list_nodes() if n.machine_id == machine)
            watch = await wait_for(lambda: host.watches.get(machine))
            # The node's clock says its first observation after the fault is a minute old: what a
            # result that waited out a control-plane outage in flight looks like.
            stale = iter([True])
            watch.clock = lambda: time.time() - (60 if next(stale, False) else 0)
            host.world.inject_fault(machine, 0, "xid", 48, clears_on="reset")
            handle = client.get_workflow_handle(f"node/{node.name}")

            async def log() -> list[str]:
                return (await handle.query("status"))["log"]

            lines = await poll(lambda: _with(log, "ignored a health report observed"), timeout=15)
            ignored = next(i for i, line in enumerate(lines) if "ignored a health report observed" in line)
            assert not any("repair/" in line for line in lines[:ignored]), lines
            # The fresh observation that follows is acted on: the GPU's repair runs and ends.
            lines = await poll(lambda: _with(log, "ended repaired"), timeout=30)
            assert any(f"repair/{node.name}/gpu0" in line for line in lines[ignored:]), lines
            await replay_and_record(handle, "node_entity_stale_report_ignored")
            await terminate_running(client, settings.task_queue)
    finally:
        stop.set()
        await host_task


async def _with(log, text: str) -> list[str] | None:
    lines = await log()
    return lines if any(text in line for line in lines) else None
