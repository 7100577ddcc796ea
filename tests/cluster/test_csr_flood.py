"""Nodes flooding the CSR approver: every node's kubelet may create CSRs (its credentials are
bound to ``system:node``'s create on them), thousands, each name up to 253 characters. What the
approver's activities tell ``CsrApprover`` stays bounded however many there are, and every CSR
is still decided or left alone as before; CSRs that keep coming wake ``CsrApprover`` at a pace,
not for a pass each, which grows while its passes only deny; and a request the approver cannot read is denied by itself, never failing
the pass that decides everyone else's.

Against the fake API server: thousands of CSRs are put into its store at once, where the real tier
(tests/realk8s/test_csr_approver.py, the approver's run end to end) would take minutes to post them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import uuid

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.control_plane import ControlPlaneActivities
from activities.env import FleetEnv
from activities import watches
from activities.watches import WatchActivities
from fleet.cluster import NODE_IDENTITY_KIND, NodeIdentity
from fleet.config import load_config
from fleet.messages.csr import VERDICTS_NAMED
from fleet.messages import watches as watch_messages
from fleet.messages.watches import CSRS_NAMED, CsrWatchInput, CsrWatchResult
from fleet.settings import Settings
from providers.cluster.base import CLIENT_SIGNER
from tests.cluster.sim_kubelet import csr_pem, unreadable_csr_pem
from tests.conftest import wait_for, write_fleet
from tests.replay import replay_and_record
from workers.control_plane import build_worker

CSRS = ("certificates.k8s.io", "certificatesigningrequests")
#: A node's request, once (its key is not what is judged here).
REQUEST = base64.b64encode(csr_pem("system:node:gone", ["system:nodes"])).decode()


@pytest.fixture
def env(kube, tmp_path) -> FleetEnv:
    return FleetEnv(Settings(state_dir=tmp_path), load_config(write_fleet(tmp_path)), kube)


def flood(fake, count: int, prefix: str, signer: str) -> list[str]:
    """``count`` CSRs from the kubelet of ``gone`` (a node gpufleet does not know), names of 253 characters."""
    names = [f"{prefix}{'x' * (246 - len(prefix))}-{i:06d}" for i in range(count)]
    for name in names:
        fake.put(*CSRS, {"metadata": {"name": name}, "spec": {
            "request": REQUEST, "signerName": signer, "username": "system:node:gone", "groups": ["system:nodes"],
            "usages": ["digital signature", "client auth"]}})
    return names


def payload_bytes(value) -> int:
    """What the worker's converter makes of an activity's result (Temporal bounds it at 2 MiB)."""
    return pydantic_data_converter.payload_converter.to_payloads([value])[0].ByteSize()


def watch(env: FleetEnv, known: CsrWatchResult | None, wait: float, pace: float = 10.0) -> CsrWatchResult:
    inp = CsrWatchInput(max_wait_seconds=wait, pace_seconds=pace)
    if known is not None:
        inp = CsrWatchInput(known=known.pending, known_cut=known.cut, max_wait_seconds=wait, pace_seconds=pace)
    return ActivityEnvironment().run(WatchActivities(env).watch_csrs, inp)


def test_a_pass_over_thousands_of_csrs_decides_each_and_names_a_few(env, fake) -> None:
    """Each client renewal of a node gpufleet does not know is denied, on its CSR; the pass's result
    names the first ``VERDICTS_NAMED`` and counts them all. Before, it named every one (each
    verdict with its 253-character name and its reason)."""
    names = flood(fake, 600, "renew", CLIENT_SIGNER)
    result = asyncio.run(ActivityEnvironment().run(ControlPlaneActivities(env).approve_node_csrs))
    assert payload_bytes(result) < 64 * 1024, payload_bytes(result)
    assert (result.approved, result.denied) == (0, 600)
    assert [v.name for v in result.decided] == names[:VERDICTS_NAMED]
    conditions = {c["metadata"]["name"]: c["status"]["conditions"] for c in fake.objects(*CSRS)}
    assert all([c["type"] for c in conditions[name]] == ["Denied"] for name in names)


def test_the_csr_watch_names_the_newest_of_thousands_and_still_wakes_for_a_new_one(env, fake) -> None:
    """8,500 open kubelet CSRs (a node's renewals that no pass has denied yet): 2.2 MB of names, which
    the watch returned whole, past the 2 MiB limit (and the approver handed them to its next watch).
    Now it names the newest ``CSRS_NAMED`` and counts them all; the next watch, told those, waits
    rather than waking for the older ones it was not told of, and wakes for a new CSR."""
    names = flood(fake, 8500, "unjudged", CLIENT_SIGNER)
    first = watch(env, None, wait=5, pace=1.0)  # the pace is the test below's
    assert payload_bytes(first) < 256 * 1024, payload_bytes(first)
    assert first.changed and first.open_count == 8500 and first.pending == names[-CSRS_NAMED:]

    started = time.monotonic()
    quiet = watch(env, first, wait=1, pace=1.0)
    assert not quiet.changed and time.monotonic() - started >= 0.9, "nothing new: it waited"

    # A second later (a newer creation time than the flood's), a kubelet's renewal.
    renewal = threading.Timer(1.5, lambda: flood(fake, 1, "renewal", CLIENT_SIGNER))
    renewal.start()
    started = time.monotonic()
    woken = watch(env, quiet, wait=30, pace=1.0)
    renewal.join()
    assert woken.changed and woken.pending[-1].startswith("renewal") and time.monotonic() - started < 15
    assert woken.open_count == 8501 and len(woken.pending) == CSRS_NAMED


def test_a_request_whose_extensions_cannot_be_read_is_denied_and_the_pass_decides_the_others(env, fake, kube) -> None:
    """A live node's kubelet may post a CSR with the right subject and usages whose KeyUsage is
    malformed, or given twice: the API server reads only its SAN extension and accepts it, and
    cryptography raised only once the approver read the extensions, which failed the whole pass
    (every other node's renewal, every join waiting on its CSR) until the CSR was collected a day
    later. Now that request is denied, saying why in a bounded reason, and the others are decided."""
    for node in ("gpu-honest", "gpu-hostile"):
        identity = NodeIdentity(node_name=node, machine_id=f"m-{node}", provider="p", account="a", site="s")
        kube.update_state(NODE_IDENTITY_KIND, node, lambda _old, identity=identity: identity.state())
    requests = {"a-renewal": ("gpu-honest", csr_pem("system:node:gpu-honest", ["system:nodes"])),
                **{f"b-{flaw}": ("gpu-hostile", unreadable_csr_pem("system:node:gpu-hostile", ["system:nodes"], flaw))
                   for flaw in ("key-usage", "duplicate")}}
    for name, (node, request) in requests.items():
        fake.put(*CSRS, {"metadata": {"name": name}, "spec": {
            "request": base64.b64encode(request).decode(), "signerName": CLIENT_SIGNER,
            "username": f"system:node:{node}", "groups": ["system:nodes"], "usages": ["digital signature", "client auth"]}})

    result = asyncio.run(ActivityEnvironment().run(ControlPlaneActivities(env).approve_node_csrs))
    verdicts = {v.name: v for v in result.decided}
    assert (result.approved, result.denied) == (1, 2) and verdicts["a-renewal"].approve
    for name in ("b-key-usage", "b-duplicate"):
        assert verdicts[name].reason.startswith("unparseable request") and len(verdicts[name].reason) <= 200
    conditions = {c["metadata"]["name"]: [k["type"] for k in c["status"]["conditions"]] for c in fake.objects(*CSRS)}
    assert conditions == {"a-renewal": ["Approved"], "b-key-usage": ["Denied"], "b-duplicate": ["Denied"]}


def test_a_csr_under_a_signer_gpufleet_does_not_judge_wakes_no_watch(env, fake) -> None:
    """Any node may post CSRs under any other signer, and they stay open a day: each woke the
    approver for a pass that decided nothing. Now the watch waits on, and names none of them."""
    flood(fake, 1, "foreign", "example.com/flood")
    posted = threading.Timer(0.5, lambda: flood(fake, 1, "later", "example.com/flood"))
    posted.start()
    quiet = watch(env, None, wait=3)
    posted.join()
    assert not quiet.changed and quiet.pending == [] and quiet.open_count == 0


async def test_a_steady_flood_of_junk_csrs_slows_the_approver_and_a_genuine_one_is_still_approved(
        env, fake, kube, monkeypatch, time_skipping_env: WorkflowEnvironment) -> None:
    """A node posting kubelet CSRs steadily (its kubelet, or a bootstrap token, may post them at
    will) woke ``CsrApprover`` every ``CSR_PACE_SECONDS`` for a pass that denied them, two
    activities in its history each: a steady flood filled it in about an hour, and the run ended,
    leaving the fleet without an approver until the Schedule's next start, up to ten minutes. Now
    while passes approve nothing the pace doubles, up to ``CSR_FLOOD_PACE_SECONDS``, and a pass
    that approves puts it back: the flood gets a pass per the bound, a genuine node's renewal posted
    during it is approved within that bound (one paced watch, and a pass or two), and every junk
    CSR is still denied. (Scaled: a base of 0.5 s, a bound of 4 s, a CSR every quarter second.)"""
    monkeypatch.setattr(watch_messages, "CSR_PACE_SECONDS", 0.5)
    monkeypatch.setattr(watch_messages, "CSR_FLOOD_PACE_SECONDS", 4.0)
    monkeypatch.setattr(watches, "RECHECK_SECONDS", 1.0)  # the worker's shutdown ends the watch in flight at once
    identity = NodeIdentity(node_name="gpu-live", machine_id="m-gpu-live", provider="p", account="a", site="s")
    kube.update_state(NODE_IDENTITY_KIND, "gpu-live", lambda _old: identity.state())
    settings = Settings(address=time_skipping_env.client.service_client.config.target_host,
                        task_queue=f"csr-pace-{uuid.uuid4().hex[:8]}", state_dir=env.settings.state_dir)
    client = time_skipping_env.client

    async def watches_and_passes() -> tuple[list[float], int]:
        """Each watch's pace (its input) and the passes so far, from the run's history."""
        paces, passes = [], 0
        async for event in run.fetch_history_events():
            if event.HasField("activity_task_scheduled_event_attributes"):
                scheduled = event.activity_task_scheduled_event_attributes
                if scheduled.activity_type.name == "watch_csrs":
                    paces.append(json.loads(scheduled.input.payloads[0].data)["pace_seconds"])
                passes += scheduled.activity_type.name == "approve_node_csrs"
        return paces, passes

    def decided(verdict: str) -> set[str]:
        return {csr["metadata"]["name"] for csr in fake.objects(*CSRS)
                if any(c["type"] == verdict for c in (csr.get("status") or {}).get("conditions") or [])}

    async with build_worker(client, settings, env):
        run = await client.start_workflow("CsrApprover", {}, id=f"csr-approver-{uuid.uuid4().hex[:6]}",
                                          task_queue=settings.task_queue)
        await wait_for(lambda: fake.requests and any(r[2] == "certificatesigningrequests" and r[0] == "watch"
                                                     for r in fake.requests), timeout=30)
        for i in range(112):  # one every quarter second, for 28 s: renewals of a node gpufleet does not know
            flood(fake, 1, f"j{i:03d}", CLIENT_SIGNER)
            if i == 96:  # 24 s of junk only; then, the flood going on, a live node's renewal
                _, junk_passes = await watches_and_passes()
                fake.put(*CSRS, {"metadata": {"name": "genuine"}, "spec": {
                    "request": base64.b64encode(csr_pem("system:node:gpu-live", ["system:nodes"])).decode(),
                    "signerName": CLIENT_SIGNER, "username": "system:node:gpu-live", "groups": ["system:nodes"],
                    "usages": ["digital signature", "client auth"]}})
                posted = time.monotonic()
                approved = asyncio.create_task(wait_for(lambda: "genuine" in decided("Approved") and time.monotonic(),
                                                        timeout=60))
            await asyncio.sleep(0.25)
        waited = await approved - posted
        await wait_for(lambda: len(decided("Denied")) == 112, timeout=30)
        paces, _ = await watches_and_passes()
        await run.cancel()
        await run.result()
        await replay_and_record(run, "csr_approver_paced_flood")
    # 24 s of junk: the first pass, four as the pace doubles to its bound (7.5 s), then one per 4 s:
    # ten at most; at the base pace, one per half second and a pass's time, it was twenty to forty.
    assert junk_passes <= 10, (junk_passes, paces)
    # The pace doubled to its bound while passes only denied, and the pass that approved reset it.
    assert paces[:5] == [0.5, 1.0, 2.0, 4.0, 4.0] and max(paces) == 4.0, paces
    assert 0.5 in paces[5:], paces
    # The renewal waited one watch at the bound (4 s) at most, and a pass or two (slack for a loaded
    # machine): approved by a pass of the run, not left to the safety sweep (600 s).
    assert waited < 4.0 + 5.0, waited
