"""A serving request is judged on the addresses the provider reports for its node's machine, kept a
while per worker process (activities/address_memo.py) so that a node posting requests cannot set
the pace of calls to its provider. A kept answer can be out of date: the machine re-addressed (a
floating IP moved, a second NIC up), its kubelet asks at once for a certificate naming the new
address, and was denied on the old answer, backing off and asking again, for up to a minute. Now a
request is denied only on an answer the provider gave once a request lacked an address in it: a
kept one is rechecked once, and a node posting wrong addresses still costs its provider about one
call per ``KEPT_SECONDS``.

Here the memo and the approver's judgement (``csr_decision``) alone, with a clock of the test's; the
same through the approver's passes against the fake API server: tests/cluster/test_csr_flood.py."""

from __future__ import annotations

import base64
from collections import Counter
from types import SimpleNamespace

import pytest

from activities.address_memo import KEPT_SECONDS, AddressMemo
from activities.control_plane import machine_addresses
from fleet.models import Machine
from providers.cluster.base import SERVING_SIGNER, Reported, csr_decision
from tests.cluster.sim_kubelet import csr_pem

NODE, MACHINE = "gpu-a", "m-gpu-a"


class Provider:
    """The node's machine as its provider reports it, and how many times it was asked."""

    def __init__(self, address: str) -> None:
        self.address, self.calls = address, Counter()

    def get_machine(self, machine_id: str) -> Machine:
        self.calls[machine_id] += 1
        return Machine(id=machine_id, name=machine_id, site="site-a", provider="lambda", state="running",
                       addresses=[self.address])


class World:
    """A worker process's memo on the test's clock, and the lookup a pass of its approver uses."""

    def __init__(self, address: str) -> None:
        self.now = 0.0
        self.provider = Provider(address)
        env = SimpleNamespace(address_memo=AddressMemo(clock=lambda: self.now), provider=lambda _site: self.provider)
        self.lookup = machine_addresses(env, {NODE: ("site-a", MACHINE)})

    @property
    def calls(self) -> int:
        return self.provider.calls[MACHINE]

    def one_pass(self, *csrs: dict):
        """Each CSR judged as one approver pass judges them (``review_csrs``): the node's requests
        share one lookup, and the answer a recheck gives."""
        held: dict[str, Reported] = {}

        def reported(node: str) -> Reported:
            if node not in held:
                held[node] = self.lookup.reported(node)
            return held[node]

        def recheck(node: str) -> Reported:
            held[node] = self.lookup.recheck(node, reported(node))
            return held[node]

        return [csr_decision(csr, lambda _t: None, {NODE}.__contains__, reported, recheck=recheck) for csr in csrs]


def serving(name: str, ips: list[str], dns: list[str] = (NODE,)) -> dict:
    """A serving CSR from the node's kubelet, for its own name unless ``dns`` says otherwise."""
    request = csr_pem(f"system:node:{NODE}", ["system:nodes"], ips=ips, dns=list(dns))
    return {"metadata": {"name": name}, "spec": {
        "signerName": SERVING_SIGNER, "username": f"system:node:{NODE}", "groups": ["system:nodes"],
        "usages": ["digital signature", "server auth"], "request": base64.b64encode(request).decode()}}


def verdict(decision) -> str:
    return "open" if decision is None else "approved" if decision.approve else "denied"


def test_a_request_the_kept_answer_lacks_is_asked_about_afresh_and_approved() -> None:
    """The node's serving certificate was approved for 10.0.0.7; twenty seconds later the machine's
    floating IP moved and its kubelet asked for one naming 203.0.113.9. Judged on the answer kept
    from the first pass, it was denied. Now the provider is asked again, and it is approved."""
    world = World("10.0.0.7")
    assert [verdict(d) for d in world.one_pass(serving("a", ["10.0.0.7"]))] == ["approved"]
    world.now, world.provider.address = 20.0, "203.0.113.9"
    assert [verdict(d) for d in world.one_pass(serving("b", ["203.0.113.9"]))] == ["approved"]
    assert world.calls == 2


def test_a_machine_re_addressed_after_a_denial_is_approved_once_the_answer_it_was_denied_on_expires() -> None:
    """A request with a wrong address was denied on the provider's answer; ten seconds later the
    machine was re-addressed and its kubelet asked for a certificate naming the new address. The
    answer kept was given once a request already lacked an address in it, so it is not asked about
    again: each request the kubelet makes meanwhile is denied on it, with no call (denied, a kubelet
    asks again within 32 s; left open, it would wait for the approver's 10-minute sweep), and the
    first pass after it expires asks the provider and approves the new address."""
    world = World("10.0.0.7")
    denied = world.one_pass(serving("a-wrong", ["10.9.9.9"]))[0]
    assert not denied.approve and "(the provider reports ['10.0.0.7'])" in denied.reason
    world.provider.address = "10.0.0.8"
    for second in range(10, int(KEPT_SECONDS)):
        world.now = float(second)
        assert [verdict(d) for d in world.one_pass(serving(f"b-moved-{second}", ["10.0.0.8"]))] == ["denied"], second
    assert world.calls == 1
    world.now = KEPT_SECONDS
    assert [verdict(d) for d in world.one_pass(serving("c-moved", ["10.0.0.8"]))] == ["approved"]
    assert world.calls == 2


def test_a_wrong_address_is_denied_once_the_answer_is_fresh() -> None:
    """A request naming an address the machine does not have is denied on the answer asked for it:
    the pass's own lookup, or the recheck of a kept one. Another name than the node's own, or no
    address at all, is denied at once, whatever the provider says and without asking it."""
    world = World("10.0.0.7")
    assert [verdict(d) for d in world.one_pass(serving("a", ["10.0.0.7"]))] == ["approved"]
    world.now = 5.0
    wrong = world.one_pass(serving("b-wrong", ["10.9.9.9"]), serving("c-wrong", ["10.9.9.8"]))
    assert [verdict(d) for d in wrong] == ["denied", "denied"], "the node's other request judged on the recheck"
    assert world.calls == 2
    world.now = 6.0
    names = world.one_pass(serving("d-name", ["10.0.0.7"], dns=["kubernetes.default"]), serving("e-none", []))
    assert [verdict(d) for d in names] == ["denied", "denied"] and world.calls == 2
    assert "'kubernetes.default' are not node gpu-a's" in names[0].reason
    assert "without an address" in names[1].reason
    # And so with no memo at all: a list is the provider's answer for the judgment.
    assert not csr_decision(serving("f", ["10.9.9.9"]), lambda _t: None, {NODE}.__contains__,
                            lambda _n: ["10.0.0.7"]).approve
    kept = Reported(("10.0.0.7",), kept=True)
    assert csr_decision(serving("g", ["10.9.9.9"]), lambda _t: None, {NODE}.__contains__, lambda _n: kept,
                        recheck=lambda _n: kept) is None, "never denied on a kept answer"


@pytest.mark.parametrize("honest_first", [False, True], ids=["wrong-from-the-start", "after-an-approval"])
def test_a_node_posting_wrong_addresses_every_pass_costs_one_call_per_kept_seconds(honest_first) -> None:
    """Five minutes of passes, a second apart, each with a fresh request from the node naming an
    address not its machine's (after one honest approval, whose answer may be rechecked once). The
    provider is asked once per ``KEPT_SECONDS`` (and once for the recheck), every request is denied
    in the pass that sees it, and none is approved."""
    world = World("10.0.0.7")
    if honest_first:
        assert [verdict(d) for d in world.one_pass(serving("honest", ["10.0.0.7"]))] == ["approved"]
    open_requests: list[dict] = []
    seconds = 300
    for second in range(1, seconds + 1):
        world.now = float(second)
        open_requests.append(serving(f"wrong-{second:03d}", ["10.9.9.9"]))
        before = world.calls
        verdicts = [verdict(d) for d in world.one_pass(*open_requests)]
        assert verdicts == ["denied"], (second, verdicts)
        open_requests = []
        assert world.calls - before <= 1, second
    assert world.calls == int(honest_first) + seconds / KEPT_SECONDS, world.calls
