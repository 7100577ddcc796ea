"""What each node's machine reported as its addresses, kept a while across approver passes.

A CSR pass asks the provider for the addresses of each node with a serving request open, and
passes run about once a second for each join and reboot wait in flight, besides ``CsrApprover``'s
own. A node's requests are its own to post: one fresh request with wrong addresses before each
pass, or one left open while the provider answers nothing (its account already rate limited),
cost its provider account a call a pass, enough past Hetzner's 3,600 an hour to trip the site's
provider-API incident, which evacuates the site. Kept here, a node costs its provider at most one
call per ``KEPT_SECONDS`` while its machine answers and one per ``NONE_KEPT_SECONDS`` while it
does not, whatever it posts and however many passes run in this process.

One memo per worker process (``FleetEnv`` is built once per process), so across the fleet a node
costs at most that times the number of control-plane worker processes.

A kept answer can be out of date: a machine's addresses change (a floating IP moved, a second NIC
up, a rack re-addressed), and its kubelet asks for a serving certificate naming the new one at once.
Denied on the kept answer, the kubelet backed off and asked again, denied again while the answer
was kept, and went without a serving certificate (``kubectl logs``/``exec`` to it failing) for
minutes. So a serving request is denied only on an answer the provider gave for its judgment
(``Answer.kept`` false). One naming an address a kept answer lacks is ``recheck``ed: the provider
is asked afresh, once per kept answer, and its answer kept in place of the old one, so a machine
re-addressed has its node's new request approved in the pass that sees it. Asking afresh for every
such request would give a node a call a pass again, so an answer the provider gave once a request
already lacked an address in it (a recheck's, or the pass's own ask that a request was denied on)
is not rechecked: it is the provider's word on such requests until it expires, and they are denied
on it. Not left open: ``CsrApprover`` passes when a new request comes (or at its 10-minute safety
sweep), and a kubelet waits 15 minutes on an open one, while a denied kubelet asks again within 32 s
(client-go's backoff), so a node whose provider was still catching up with its new address is asked
about afresh within a minute and half, not at the sweep. A node posting wrong addresses before every
pass has each denied, on one provider call per ``KEPT_SECONDS``.
An answer no request was denied on comes from a pass in which every request of the node that
asked matched it, its newest approved (``SERVING_PER_WINDOW`` an hour), or from a join's
registration check: a recheck after one is a call that a node can add a few times an hour.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable, NamedTuple

#: How long a machine's reported addresses answer its node's serving requests: a machine keeps
#: its addresses, and one replaced is another machine id, looked up afresh.
KEPT_SECONDS = 60.0
#: How long no answer does (the provider failed, or the machine reports no addresses yet: one just
#: bought): short, as a new machine's first serving certificate waits at most this once they show.
NONE_KEPT_SECONDS = 10.0
#: Machines kept at most, the one asked about longest ago forgotten first (the keys come from identity
#: records and joins, never from what a node writes; the bound is for a fleet's churn).
MOST_KEPT = 4096

#: (node, site, machine id): a node's machine replaced under the same name is looked up afresh.
Key = tuple[str, str, str]


class Answer(NamedTuple):
    """What ``AddressMemo`` handed a pass for a key: the addresses (None: none), whether they were
    ``kept`` from an earlier ask (not the provider's answer for this judgment), and which ask gave
    them (``serial``: a pass hands it back to ``recheck``)."""
    addresses: list[str] | None
    kept: bool
    serial: int


class _Kept:
    """One key's kept answer: until when, the addresses, which ask, and whether a request was found
    naming an address it lacks (``doubted``: not rechecked again; see the module doc)."""
    __slots__ = ("until", "found", "serial", "doubted")

    def __init__(self, until: float, found: tuple[str, ...], serial: int, doubted: bool) -> None:
        self.until, self.found, self.serial, self.doubted = until, found, serial, doubted


class AddressMemo:
    """``addresses(key, ask)``: what ``ask()`` (the provider call) answered for the key, kept a while;
    passes asking for the same key meanwhile wait for the one call in flight, not make their own.
    ``answer`` says whether it was kept, and ``recheck`` asks again for a request a kept one lacks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._kept: OrderedDict[Key, _Kept] = OrderedDict()
        self._asking: dict[Key, Future] = {}
        self._serial = 0

    def addresses(self, key: Key, ask: Callable[[], list[str] | None], fresh: bool = False) -> list[str] | None:
        """``ask()``'s answer for ``key`` (None: no addresses), from the memo unless it has expired or
        ``fresh`` (a check that must see the provider's answer now; it is kept for the passes after)."""
        return self.answer(key, ask, fresh).addresses

    def answer(self, key: Key, ask: Callable[[], list[str] | None], fresh: bool = False) -> Answer:
        """``addresses``, saying whether the answer was kept from an earlier ask (``Answer.kept``)."""
        with self._lock:
            kept = self._valid(key)
            if kept is not None and not fresh:
                return Answer(_copied(kept.found), True, kept.serial)
        return self._ask(key, ask, doubted=False)

    def recheck(self, key: Key, ask: Callable[[], list[str] | None], held: Answer) -> Answer:
        """A serving request names an address that ``held`` (this key's ``answer`` for a pass) lacks:
        the answer to judge it on. Not kept (``kept`` false): the provider's answer since the pass
        looked (``held`` itself where it was asked for the pass, or one another pass asked meanwhile),
        the request denied if it lacks the address too; so also where the kept answer was given once a
        request already lacked an address in it (a request was denied on it, or it is a recheck's):
        no more asking until it expires. Otherwise the provider is asked afresh, once, and its answer
        kept in place of the old one.
        Whichever is handed back is marked: a request found lacking against it asks no more."""
        with self._lock:
            kept = self._valid(key)
            if kept is not None and kept.serial != held.serial:
                kept.doubted = True  # asked since the pass looked: the provider's answer to this request
                return Answer(_copied(kept.found), False, kept.serial)
            if not held.kept:
                if kept is not None:
                    kept.doubted = True  # the pass denies on it: a later wrong request waits for the next ask
                return held
            if kept is not None and kept.doubted:
                # Asked once a request already lacked an address in it: the provider's word on such
                # requests until it expires (denied, so the kubelet asks again within 32 s).
                return Answer(_copied(kept.found), False, kept.serial)
        return self._ask(key, ask, doubted=True)

    def _valid(self, key: Key) -> _Kept | None:
        """The key's kept answer, unless it has expired (the lock held)."""
        kept = self._kept.get(key)
        return kept if kept is not None and self._clock() < kept.until else None

    def _ask(self, key: Key, ask: Callable[[], list[str] | None], doubted: bool) -> Answer:
        """The provider's answer now: the call in flight for the key if there is one, else ``ask()``."""
        with self._lock:
            asking = self._asking.get(key)
            if asking is None:
                self._asking[key] = mine = Future()
        if asking is not None:
            answer = asking.result()  # a slow or failing provider is asked once, not by every pass waiting
            if doubted:
                with self._lock:
                    if (kept := self._valid(key)) is not None and kept.serial == answer.serial:
                        kept.doubted = True
            return answer._replace(addresses=_copied(answer.addresses))
        try:
            found = list(ask() or []) or None
        except BaseException as error:
            with self._lock:
                del self._asking[key]
            mine.set_exception(error)
            raise
        with self._lock:
            del self._asking[key]
            self._serial += 1
            serial = self._serial
            self._kept[key] = _Kept(self._clock() + (KEPT_SECONDS if found else NONE_KEPT_SECONDS),
                                    tuple(found or ()), serial, doubted)
            self._kept.move_to_end(key)
            while len(self._kept) > MOST_KEPT:
                self._kept.popitem(last=False)
        mine.set_result(Answer(found, False, serial))
        return Answer(_copied(found), False, serial)


def _copied(found: list[str] | None) -> list[str] | None:
    """A list of its own for each pass handed the answer."""
    return list(found) if found else None
