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
import dataclasses
import json
import threading
import time
import uuid
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.address_memo import NONE_KEPT_SECONDS, AddressMemo
from activities.control_plane import ControlPlaneActivities, machine_addresses
from activities.env import FleetEnv
from activities import watches
from activities.watches import WatchActivities
from fleet.cluster import NODE_IDENTITY_KIND, NodeIdentity
from fleet.config import load_config
from fleet.errors import Transient
from fleet.messages.csr import VERDICT_NAME_CHARS, VERDICTS_NAMED
from fleet.messages import watches as watch_messages
from fleet.messages.watches import CSR_FLOOD_PACE_SECONDS, CSRS_MARKED, CsrMark, CsrWatchInput, CsrWatchResult
from fleet.models import Machine
from fleet.routing import shortened
from fleet.settings import Settings
from providers.cluster.base import CLIENT_SIGNER, SERVING_SIGNER
from providers.cluster.kubernetes.csrs import SERVING_PER_WINDOW
from tests.cluster import fake_apiserver
from tests.cluster.sim_kubelet import csr_pem, unreadable_csr_pem
from tests.conftest import wait_for, write_fleet
from tests.replay import replay_and_record
from workers.control_plane import build_worker
from workflows.csr_approver import CSR_RUN_SECONDS

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


def watch(env: FleetEnv, last: CsrWatchResult | None, wait: float, pace: float = 10.0, beats: list | None = None,
          **old) -> CsrWatchResult:
    """The watch as ``CsrApprover`` runs it, told what the ``last`` one saw (``old``: an input from before
    the mark, ``known`` and ``known_cut``). ``beats`` collects its heartbeats under a heartbeat timeout of
    1 s: one after each watch chunk (a second at least) it waited through, none if it returned at once."""
    mark = None if old else last.mark if last is not None else CsrMark()
    inp = CsrWatchInput(mark=mark, max_wait_seconds=wait, pace_seconds=pace, **old)
    activity_env = ActivityEnvironment()
    if beats is not None:
        activity_env.info = dataclasses.replace(activity_env.info, heartbeat_timeout=timedelta(seconds=1))
        activity_env.on_heartbeat = beats.append
    return activity_env.run(WatchActivities(env).watch_csrs, inp)


def genuine(fake, kube, name: str = "genuine") -> None:
    """A renewal by the kubelet of ``gpu-live``, a node gpufleet knows: approved."""
    identity = NodeIdentity(node_name="gpu-live", machine_id="m-gpu-live", provider="p", account="a", site="s")
    kube.update_state(NODE_IDENTITY_KIND, "gpu-live", lambda _old: identity.state())
    fake.put(*CSRS, {"metadata": {"name": name}, "spec": {
        "request": base64.b64encode(csr_pem("system:node:gpu-live", ["system:nodes"])).decode(),
        "signerName": CLIENT_SIGNER, "username": "system:node:gpu-live", "groups": ["system:nodes"],
        "usages": ["digital signature", "client auth"]}})


def test_a_pass_over_thousands_of_csrs_decides_each_and_lists_a_few_in_a_few_kb(env, fake, kube) -> None:
    """Each client renewal of a node gpufleet does not know is denied, on its CSR; the pass's result,
    which goes into ``CsrApprover``'s history each round, lists ``VERDICTS_NAMED`` of them, names cut,
    and counts them all, and a genuine renewal the flood would hide is listed first. Before, it listed
    a hundred, 253-character names and all (43 KB a pass), the approval not among them."""
    names = flood(fake, 600, "renew", CLIENT_SIGNER)
    genuine(fake, kube)
    result = asyncio.run(ActivityEnvironment().run(ControlPlaneActivities(env).approve_node_csrs))
    assert payload_bytes(result) < 4 * 1024, payload_bytes(result)
    assert (result.approved, result.denied) == (1, 600)
    assert result.decided[0].name == "genuine" and result.decided[0].approve
    assert [v.name for v in result.decided[1:]] == [shortened(n, VERDICT_NAME_CHARS) for n in names[:VERDICTS_NAMED - 1]]
    conditions = {c["metadata"]["name"]: c["status"]["conditions"] for c in fake.objects(*CSRS)}
    assert all([c["type"] for c in conditions[name]] == ["Denied"] for name in names)


@pytest.mark.timeout(120)  # a guard against a hang: its last watch waits up to ten minutes
def test_the_csr_watch_marks_thousands_in_a_few_hundred_bytes_and_still_wakes_for_a_new_one(env, fake) -> None:
    """8,500 open kubelet CSRs (a node's renewals that no pass has denied yet). The watch named the
    newest 500, 126 KB that the approver handed its next watch: 250 KB of its history a round. Now it
    counts them and marks the newest ``CSRS_MARKED`` by digest; the next watch, told the mark, waits
    rather than waking for the older ones it was not told of, and wakes for a new CSR."""
    flood(fake, 8500, "unjudged", CLIENT_SIGNER)
    first = watch(env, None, wait=5, pace=1.0)  # the pace is the test below's
    assert payload_bytes(first) < 1024, payload_bytes(first)
    assert first.changed and first.open_count == 8500 and first.pending == []

    beats: list = []
    # Three seconds, not one: listing 8,500 CSRs takes over a second on a loaded machine, and a wait
    # that ran out while the watch listed returned with no chunk waited through, so no beat.
    quiet = watch(env, first, wait=3, pace=1.0, beats=beats)
    assert not quiet.changed and beats, "nothing new: it waited (a beat after its chunk), not woken by the older CSRs"

    # A second later (a newer creation time than the flood's), a kubelet's renewal. The watch's
    # wait is ten minutes: it returns on the renewal (the test's timeout guards against a hang).
    renewal = threading.Timer(1.5, lambda: flood(fake, 1, "renewal", CLIENT_SIGNER))
    renewal.start()
    woken = watch(env, quiet, wait=600, pace=1.0)
    renewal.join()
    assert woken.changed
    assert woken.open_count == 8501 and payload_bytes(woken) < 1024


@pytest.mark.timeout(120)  # a guard against a hang: the watch a new CSR wakes waits up to ten minutes
def test_the_csr_watch_wakes_for_one_posted_in_the_second_it_saw_and_not_for_one_gone(env, fake, monkeypatch) -> None:
    """What the watch saw is a mark of a few hundred bytes, not its CSRs' names, and still exact while
    at most ``CSRS_MARKED`` are open: one posted in the same second as those it saw (whole seconds, the
    API server's creation time), whose name sorts first, wakes the next watch; one it saw does not, nor
    one decided or cleaned up meanwhile. A watch in flight at the deploy, told what it knows by name
    (an input from before the mark), still waits for a new one, and answers with a mark."""
    monkeypatch.setattr(fake_apiserver, "_now", lambda: "2026-12-06T12:00:00Z")  # every CSR, one second
    names = flood(fake, CSRS_MARKED, "seen", CLIENT_SIGNER)
    first = watch(env, None, wait=5, pace=0.1)
    assert first.changed and first.open_count == CSRS_MARKED and payload_bytes(first) < 1024, payload_bytes(first)

    with fake.lock:  # cleaned up (or denied) meanwhile: nothing new
        del fake.store[(*CSRS, "", names[0])]
    beats: list = []
    quiet = watch(env, first, wait=1, pace=0.1, beats=beats)
    assert not quiet.changed and quiet.open_count == CSRS_MARKED - 1 and beats, "it waited (a beat after its chunk)"

    # Its wait is ten minutes, so only the new CSR returns it (a watch that ran out would say changed too).
    posted = threading.Timer(0.5, lambda: flood(fake, 1, "a-new", CLIENT_SIGNER))  # the same second, first by name
    posted.start()
    woken = watch(env, quiet, wait=600, pace=0.1)
    posted.join()
    assert woken.changed and woken.open_count == CSRS_MARKED

    # A watch the approver started before the deploy: ``known`` names the CSRs it saw.
    old = watch(env, None, wait=1, pace=0.1, known=names[1:], known_cut=False)
    assert old.changed, "a-new is not among them"
    beats = []
    old = watch(env, None, wait=1, pace=0.1, beats=beats, known=names[1:] + [f"a-new{'x' * 241}-000000"],
                known_cut=False)
    assert not old.changed and beats, "it waited (a beat after its chunk)"
    assert old.mark == woken.mark and payload_bytes(old) < 1024


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


class MachineLookups:
    """Site ``site-a``'s provider as the approver uses it: the addresses of each machine, and how many
    times it was asked (each a call against the account's rate limit, shared by all its sites)."""

    def __init__(self, addresses: dict[str, "str | Exception"]) -> None:
        self.addresses, self.calls = addresses, Counter()

    def get_machine(self, machine_id: str) -> Machine:
        """The machine, with its address ("": none yet, as one just bought); an exception is raised."""
        self.calls[machine_id] += 1
        answer = self.addresses[machine_id]
        if isinstance(answer, Exception):
            raise answer
        return Machine(id=machine_id, name=machine_id, site="site-a", provider="lambda", state="running",
                       addresses=[answer] if answer else [])


def live_serving_nodes(env: FleetEnv, kube, addresses: dict[str, str]) -> MachineLookups:
    """Live nodes at ``site-a`` (node → its machine's address; machine ``m-<node>``) and the provider."""
    for node in addresses:
        identity = NodeIdentity(node_name=node, machine_id=f"m-{node}", provider="lambda", account="acct-a",
                                site="site-a")
        kube.update_state(NODE_IDENTITY_KIND, node, lambda _old, identity=identity: identity.state())
    lookups = MachineLookups({f"m-{node}": address for node, address in addresses.items()})
    env._providers["site-a"] = lookups
    return lookups


def serving_csrs(fake, names: list[str], node: str, address: str, approved_at: datetime | None = None) -> None:
    """Serving CSRs from ``node``'s kubelet for its own name and address, one request (a node may reuse
    it); ``approved_at``: approved then."""
    request = base64.b64encode(csr_pem(f"system:node:{node}", ["system:nodes"], ips=[address], dns=[node])).decode()
    status = {"conditions": [{"type": "Approved", "status": "True", "reason": "GpufleetApproved",
                              "lastUpdateTime": approved_at.strftime("%Y-%m-%dT%H:%M:%SZ")}]} if approved_at else {}
    for name in names:
        fake.put(*CSRS, {"metadata": {"name": name}, "status": status, "spec": {
            "request": request, "signerName": SERVING_SIGNER, "username": f"system:node:{node}",
            "groups": ["system:nodes"], "usages": ["digital signature", "server auth"]}})


def test_a_live_nodes_flood_of_serving_csrs_asks_its_provider_once_a_pass(env, fake, kube) -> None:
    """A live node's kubelet posted 400 serving CSRs for its own name and address. Each was judged
    against the provider before any was decided: 400 calls against its account's rate limit a pass,
    and every join's 1 s poll runs a pass; rate limited, the provider probe fails and the site is
    evacuated. Now a pass asks the provider once per node, approves the newest (the one its kubelet
    waits on) and denies the rest as superseded; an honest node's request posted after the flood is
    approved, and written before the flood's 399 denials."""
    lookups = live_serving_nodes(env, kube, {"gpu-hostile": "10.0.0.66", "gpu-honest": "10.0.0.7"})
    flood_names = [f"a-flood-{i:04d}" for i in range(400)]
    serving_csrs(fake, flood_names, "gpu-hostile", "10.0.0.66")
    serving_csrs(fake, ["z-honest"], "gpu-honest", "10.0.0.7")

    result = asyncio.run(ActivityEnvironment().run(ControlPlaneActivities(env).approve_node_csrs))
    assert lookups.calls == {"m-gpu-hostile": 1, "m-gpu-honest": 1}, lookups.calls
    assert (result.approved, result.denied) == (2, 399)
    csrs = {c["metadata"]["name"]: c for c in fake.objects(*CSRS)}
    verdicts = {name: [k["type"] for k in c["status"]["conditions"]] for name, c in csrs.items()}
    assert verdicts == {"z-honest": ["Approved"], flood_names[-1]: ["Approved"],
                        **{name: ["Denied"] for name in flood_names[:-1]}}
    # Written in that order (the fake's resourceVersion counts writes): no approval waits on a flood's denials.
    written = {name: int(c["metadata"]["resourceVersion"]) for name, c in csrs.items()}
    assert written["z-honest"] < min(written[name] for name in flood_names[:-1])


def test_a_node_whose_serving_allowance_is_spent_costs_its_provider_no_call(env, fake, kube) -> None:
    """A live node approved ``SERVING_PER_WINDOW`` serving certificates this hour may get no more, and
    its requests were denied only after each was judged against the provider: a node that keeps
    asking cost a provider call for every request, on every pass. Now they are denied without one."""
    lookups = live_serving_nodes(env, kube, {"gpu-hostile": "10.0.0.66"})
    approved_at = datetime.now(timezone.utc) - timedelta(minutes=5)
    serving_csrs(fake, [f"a-approved-{i}" for i in range(SERVING_PER_WINDOW)], "gpu-hostile", "10.0.0.66",
                 approved_at=approved_at)
    flood_names = [f"b-flood-{i:04d}" for i in range(50)]
    serving_csrs(fake, flood_names, "gpu-hostile", "10.0.0.66")

    result = asyncio.run(ActivityEnvironment().run(ControlPlaneActivities(env).approve_node_csrs))
    assert lookups.calls == {}, lookups.calls
    assert (result.approved, result.denied) == (0, 50)
    denied = {c["metadata"]["name"]: c["status"]["conditions"] for c in fake.objects(*CSRS)
              if c["metadata"]["name"] in flood_names}
    assert all([k["type"] for k in conditions] == ["Denied"] for conditions in denied.values()), denied
    assert f"had {SERVING_PER_WINDOW} serving certificates approved" in denied[flood_names[-1]][0]["message"]


class PassClock:
    """The time the approver's passes see (``env.address_memo``'s clock), a pass a second as joins poll."""

    def __init__(self, env: FleetEnv) -> None:
        self.now = 0.0
        env.address_memo = AddressMemo(clock=lambda: self.now)


def approver_pass(env: FleetEnv):
    return asyncio.run(ActivityEnvironment().run(ControlPlaneActivities(env).approve_node_csrs))


def csr_verdicts(fake) -> dict[str, list[str]]:
    return {c["metadata"]["name"]: [k["type"] for k in (c.get("status") or {}).get("conditions") or []]
            for c in fake.objects(*CSRS)}


def test_a_node_posting_wrong_addresses_before_each_pass_costs_its_provider_a_call_a_minute(env, fake, kube) -> None:
    """A live node posted a fresh serving CSR naming an address not its machine's before each pass.
    Each is denied without counting against its allowance, and each pass asked its provider again:
    with a pass a second per join or reboot wait in flight, a few waits took its account past
    Hetzner's 3,600 calls an hour, and the provider-API incident evacuated the site. Now the machine's
    answer is kept a minute: two minutes of passes cost two calls, and an honest node's request is
    approved in the first pass that sees it. Every wrong request is denied in the pass that sees it:
    the first on the answer its pass asked, the rest of each minute on that answer, given once a
    request already lacked an address in it, with no call."""
    clock = PassClock(env)
    lookups = live_serving_nodes(env, kube, {"gpu-hostile": "10.0.0.66", "gpu-honest": "10.0.0.7"})
    for second in range(120):
        clock.now = float(second)
        serving_csrs(fake, [f"a-wrong-{second:03d}"], "gpu-hostile", "10.9.9.9")
        if second == 90:
            serving_csrs(fake, ["z-honest"], "gpu-honest", "10.0.0.7")
        result = approver_pass(env)
        assert (result.approved, result.denied) == (int(second == 90), 1), (second, result)
    assert lookups.calls == {"m-gpu-hostile": 2, "m-gpu-honest": 1}, lookups.calls
    verdicts = csr_verdicts(fake)
    assert verdicts.pop("z-honest") == ["Approved"]
    assert set(map(tuple, verdicts.values())) == {("Denied",)}, verdicts
    assert "are not node gpu-hostile's" in fake.objects(*CSRS)[0]["status"]["conditions"][0]["message"]


def test_a_re_addressed_machines_new_serving_request_is_approved_in_the_pass_that_sees_it(env, fake, kube) -> None:
    """A node's serving certificate was approved for its machine's address; seconds later the
    machine's floating IP moved, and its kubelet asked for one naming the new address. The approver
    judged it on the answer kept from the first pass and denied it, and again on each request the
    kubelet made as it backed off, for up to a minute: the node ran without a serving certificate
    (``kubectl logs``/``exec`` to it failing) for minutes. Now the kept answer that lacks the address
    is asked about afresh, once: the new request is approved in the pass that sees it. A request
    naming the address the machine no longer has is still denied, with no call: on the answer that
    recheck gave (asking again for each would cost a call a pass)."""
    clock = PassClock(env)
    lookups = live_serving_nodes(env, kube, {"gpu-moved": "10.0.0.7"})
    serving_csrs(fake, ["a-serving"], "gpu-moved", "10.0.0.7")
    assert approver_pass(env).approved == 1
    clock.now = 20.0
    lookups.addresses["m-gpu-moved"] = "203.0.113.9"  # the floating IP moved to this machine
    serving_csrs(fake, ["b-serving"], "gpu-moved", "203.0.113.9")
    result = approver_pass(env)
    assert (result.approved, result.denied) == (1, 0), result
    assert csr_verdicts(fake) == {"a-serving": ["Approved"], "b-serving": ["Approved"]}
    assert lookups.calls == {"m-gpu-moved": 2}, lookups.calls
    clock.now = 21.0
    serving_csrs(fake, ["c-serving"], "gpu-moved", "10.0.0.7")  # the address it no longer has
    result = approver_pass(env)
    assert (result.approved, result.denied) == (0, 1), result
    assert "'10.0.0.7' are not node gpu-moved's (the provider reports ['203.0.113.9'])" in result.decided[0].reason
    assert lookups.calls == {"m-gpu-moved": 2}, lookups.calls


@pytest.mark.parametrize("unanswered", [Transient("rate limited: 3600 requests per hour"), ""],
                         ids=["provider-rate-limited", "machine-reports-no-address-yet"])
def test_a_serving_csr_left_open_while_its_machine_gives_no_address_is_asked_about_every_ten_seconds(
        env, fake, kube, unanswered) -> None:
    """A node's serving CSR stays open while the provider gives no address for its machine: its account
    already rate limited, or a machine just bought that reports none yet. Every pass asked again, a call
    a second per wait in flight against a limit already hit. Now no answer is kept ``NONE_KEPT_SECONDS``:
    three calls in the 25 s it lasts, and once the machine reports its address the request is approved
    within that, so a new machine's first serving certificate waits seconds."""
    clock = PassClock(env)
    lookups = live_serving_nodes(env, kube, {"gpu-new": "10.0.0.8"})
    lookups.addresses["m-gpu-new"] = unanswered
    serving_csrs(fake, ["a-serving"], "gpu-new", "10.0.0.8")
    for second in range(25):
        clock.now = float(second)
        assert approver_pass(env).decided == [], second  # nothing to check its addresses against: left open
    assert lookups.calls == {"m-gpu-new": 3}, lookups.calls
    lookups.addresses["m-gpu-new"] = "10.0.0.8"  # answers from second 25
    second = 25
    while (result := approver_pass(env)).approved == 0:
        second += 1
        clock.now = float(second)
        assert second <= 25 + NONE_KEPT_SECONDS, lookups.calls
    assert csr_verdicts(fake) == {"a-serving": ["Approved"]}
    assert lookups.calls == {"m-gpu-new": 4}, lookups.calls


def test_passes_asking_while_the_provider_is_slow_to_answer_make_one_call(env, kube) -> None:
    """A rate-limited provider answers slowly, and the passes of every wait in flight ask for the same
    node meanwhile: each made its own call, more the slower it got. Now they wait for the one in flight."""
    lookups = live_serving_nodes(env, kube, {"gpu-slow": "10.0.0.9"})
    asked, answer = threading.Event(), threading.Event()
    get_machine = lookups.get_machine

    def slow(machine_id: str) -> Machine:
        asked.set()
        answer.wait(10)
        return get_machine(machine_id)

    lookups.get_machine = slow
    found: list = []
    passes = [threading.Thread(target=lambda: found.append(machine_addresses(env)("gpu-slow"))) for _ in range(5)]
    passes[0].start()
    assert asked.wait(10)
    for waiting in passes[1:]:
        waiting.start()
    time.sleep(0.5)  # each at its ask by then (one that came later would find the answer kept: no call either)
    answer.set()
    for each in passes:
        each.join(10)
    assert found == [["10.0.0.9"]] * 5 and lookups.calls == {"m-gpu-slow": 1}, (found, lookups.calls)


def test_a_csr_under_a_signer_gpufleet_does_not_judge_wakes_no_watch(env, fake) -> None:
    """Any node may post CSRs under any other signer, and they stay open a day: each woke the
    approver for a pass that decided nothing. Now the watch waits on, and names none of them."""
    flood(fake, 1, "foreign", "example.com/flood")
    posted = threading.Timer(0.5, lambda: flood(fake, 1, "later", "example.com/flood"))
    posted.start()
    quiet = watch(env, None, wait=3)
    posted.join()
    assert not quiet.changed and quiet.pending == [] and quiet.open_count == 0


# A real-time flood of half a minute (the pace is the watch's, in seconds): the full suite runs it,
# the fast tier (under a minute in all) does not.
@pytest.mark.integration
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
    settings = Settings(address=time_skipping_env.client.service_client.config.target_host,
                        task_queue=f"csr-pace-{uuid.uuid4().hex[:8]}", state_dir=env.settings.state_dir)
    client = time_skipping_env.client

    async def watches_and_passes() -> tuple[list[float], list[int]]:
        """Each watch's pace (its input) and what each pass so far approved (0 while in flight), in the
        order the run scheduled them, from its history."""
        paces: list[float] = []
        approved: list[int] = []
        pass_at: dict[int, int] = {}  # a pass's scheduled event: which pass it is
        async for event in run.fetch_history_events():
            if event.HasField("activity_task_scheduled_event_attributes"):
                scheduled = event.activity_task_scheduled_event_attributes
                if scheduled.activity_type.name == "watch_csrs":
                    paces.append(json.loads(scheduled.input.payloads[0].data)["pace_seconds"])
                elif scheduled.activity_type.name == "approve_node_csrs":
                    pass_at[event.event_id] = len(approved)
                    approved.append(0)
            elif event.HasField("activity_task_completed_event_attributes"):
                completed = event.activity_task_completed_event_attributes
                if completed.scheduled_event_id in pass_at:
                    result = json.loads(completed.result.payloads[0].data)
                    approved[pass_at[completed.scheduled_event_id]] = result["approved"]
        return paces, approved

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
                junk_passes = len((await watches_and_passes())[1])
                genuine(fake, kube)
                # The passes scheduled once it is posted: the next one lists it, so approves it.
                passes_at_post = len((await watches_and_passes())[1])
                approved = asyncio.create_task(wait_for(lambda: "genuine" in decided("Approved"), timeout=60))
            await asyncio.sleep(0.25)
        await approved
        await wait_for(lambda: len(decided("Denied")) == 112, timeout=30)
        # The pass that approved puts the pace back: the watch after it is scheduled at the base once
        # the run has taken that pass's completion, a workflow task after the approval the cluster
        # shows (on a loaded machine, a while after).
        deadline = asyncio.get_running_loop().time() + 30
        while 0.5 not in (found := await watches_and_passes())[0][5:]:
            assert asyncio.get_running_loop().time() < deadline, f"the pace was not put back: {found[0]}"
            await asyncio.sleep(0.2)
        paces, approvals = found
        await run.cancel()
        await run.result()
        await replay_and_record(run, "csr_approver_paced_flood")
    # 24 s of junk: the first pass, four as the pace doubles to its bound (7.5 s), then one per 4 s:
    # ten at most; at the base pace, one per half second and a pass's time, it was twenty to forty.
    assert junk_passes <= 10, (junk_passes, paces)
    # The pace doubled to its bound while passes only denied, and the pass that approved reset it.
    assert paces[:5] == [0.5, 1.0, 2.0, 4.0, 4.0] and max(paces) == 4.0, paces
    assert 0.5 in paces[5:], paces
    # The renewal waited one watch at the bound (4 s) at most: it was approved by the first pass
    # scheduled after it was posted (or the one then in flight), not a pass or more later, nor left
    # to the safety sweep (600 s). Counted in passes, not seconds: a loaded machine's are slower.
    assert sum(approvals) == 1 and approvals.index(1) <= passes_at_post, (passes_at_post, approvals)


async def test_an_approver_cancelled_in_its_first_pass_ends_with_what_it_decided(
        env, fake, kube, monkeypatch, time_skipping_env: WorkflowEnvironment) -> None:
    """A cancelled approver ends with what it decided (its docstring, `gpufleet` and the Schedule's
    runs read that result); one cancelled while its first pass was in flight ended cancelled, with
    no result, the first pass standing outside the run's cancel handling (the real-cluster tier's
    pod test cancels the approver as soon as the node's renewal is approved, which the pass's
    completion may not yet have told the run: it failed so). Behind
    ``approver-cancelled-in-its-first-pass-ends`` it ends as a later cancel does."""
    from fleet.messages.csr import CsrApproverResult
    from tests.details_helpers import current_details

    settings = Settings(address=time_skipping_env.client.service_client.config.target_host,
                        task_queue=f"csr-cancel-{uuid.uuid4().hex[:8]}", state_dir=env.settings.state_dir)
    client = time_skipping_env.client
    review, in_pass, may_end = env.cluster.review_csrs, threading.Event(), threading.Event()

    def slow_review(addresses):
        in_pass.set()
        may_end.wait(timeout=30)  # the pass is in flight until the run was cancelled
        return review(addresses)

    monkeypatch.setattr(env.cluster, "review_csrs", slow_review)
    genuine(fake, kube)
    async with build_worker(client, settings, env):
        run = await client.start_workflow("CsrApprover", {}, id=f"csr-approver-{uuid.uuid4().hex[:6]}",
                                          task_queue=settings.task_queue)
        try:
            assert await asyncio.to_thread(in_pass.wait, 30), "the first pass never began"
            await run.cancel()
            result = CsrApproverResult.model_validate(await asyncio.wait_for(run.result(), 30))
        finally:
            may_end.set()
        assert (result.approved, result.denied) == (0, 0), result  # the pass in flight told it nothing
        assert (await run.describe()).status.name == "COMPLETED"
        assert "cancelled" in await current_details(run)
        await replay_and_record(run, "csr_approver_cancelled_in_its_first_pass")


#: What one round of ``CsrApprover`` (a watch and the pass it woke) may write to its history, however
#: many CSRs nodes post and however long their names: the events' protobuf bytes, what Temporal counts
#: against the 4 MB at which it suggests a new run.
ROUND_BYTES = 8 * 1024
#: Temporal suggests continuing as new at this history size; the approver's run then ends.
SUGGEST_CONTINUE_AS_NEW_BYTES = 4 * 1024 * 1024


def rounds_written(history) -> list[int]:
    """The bytes each whole round wrote: from a watch's scheduling to the next's (the first pass, and
    the last round, which the cancel cut, left out)."""
    rounds: list[int] = []
    for event in history.events:
        scheduled = event.activity_task_scheduled_event_attributes if event.HasField(
            "activity_task_scheduled_event_attributes") else None
        if scheduled is not None and scheduled.activity_type.name == "watch_csrs":
            rounds.append(0)
        if rounds:
            rounds[-1] += event.ByteSize()
    return rounds[:-1]


# Rounds of a real-time flood (over ten seconds): the full suite runs it, the fast tier does not.
@pytest.mark.integration
async def test_a_flood_of_long_named_csrs_writes_a_few_kb_a_round_to_the_approvers_history(
        env, fake, kube, monkeypatch, time_skipping_env: WorkflowEnvironment) -> None:
    """A node posting junk kubelet CSRs with 253-character names, hundreds between two passes: each
    round wrote the CSRs open at the watch's end (up to 500 names) into its result and again into the
    next watch's input, and a hundred verdicts into the pass's result, some 200 KB a round, so even at
    the flood pace (a round per 5 minutes) the history reached 4 MB, and the run ended, within hours.
    Now a round writes a mark and ten verdicts, a few KB whatever the flood: at the flood pace a day's
    288 rounds stay well under 4 MB, and the run lasts its day. Every CSR is still decided, and a
    genuine renewal posted during the flood is approved by a pass of the run. (Scaled as the test
    above: a base pace of 0.5 s, a bound of 4 s.)"""
    monkeypatch.setattr(watch_messages, "CSR_PACE_SECONDS", 0.5)
    monkeypatch.setattr(watch_messages, "CSR_FLOOD_PACE_SECONDS", 4.0)
    monkeypatch.setattr(watches, "RECHECK_SECONDS", 1.0)
    settings = Settings(address=time_skipping_env.client.service_client.config.target_host,
                        task_queue=f"csr-bytes-{uuid.uuid4().hex[:8]}", state_dir=env.settings.state_dir)
    client = time_skipping_env.client

    def denied() -> int:
        return sum(any(c["type"] == "Denied" for c in (csr.get("status") or {}).get("conditions") or [])
                   for csr in fake.objects(*CSRS))

    async with build_worker(client, settings, env):
        run = await client.start_workflow("CsrApprover", {}, id=f"csr-approver-{uuid.uuid4().hex[:6]}",
                                          task_queue=settings.task_queue)
        await wait_for(lambda: any(r[2] == "certificatesigningrequests" and r[0] == "watch" for r in fake.requests),
                       timeout=30)
        for burst in range(6):  # 300 junk CSRs every 2 s, and a live node's renewal among them
            flood(fake, 300, f"b{burst}-", CLIENT_SIGNER)
            if burst == 3:
                genuine(fake, kube)
            await asyncio.sleep(2)
        await wait_for(lambda: denied() == 1800 or None, timeout=60)
        await wait_for(lambda: any(c["type"] == "Approved" for c in (
            fake.get(*CSRS, "", "genuine")["status"].get("conditions") or [])), timeout=30)
        await run.cancel()
        await run.result()
        history = await run.fetch_history()
        await replay_and_record(run, "csr_approver_compact_flood")
    written = rounds_written(history)
    assert len(written) >= 3 and max(written) <= ROUND_BYTES, written
    # The run's day at the flood pace: ``CSR_FLOOD_PACE_SECONDS`` (unscaled, 5 minutes) a round at
    # least, 288 rounds, and what a round writes does not grow with the flood.
    assert CSR_RUN_SECONDS / CSR_FLOOD_PACE_SECONDS * ROUND_BYTES < SUGGEST_CONTINUE_AS_NEW_BYTES
