"""What every node together may send to the Temporal frontend through one gateway, shared fairly.

Each node's own bucket (``proxy.RateLimits``) bounds what one node sends; it does not bound what
many send together. The frontend's request rate (Temporal's ``frontend.namespaceRPS`` and
``frontend.rps``: 2,400 a second per frontend by default) is shared by every node and the control
plane, so fifty hostile nodes of one compromised site, each within its own budget, could still
spend it: the honest nodes' polls and results, and the control plane's own calls, answered
``ResourceExhausted`` by the frontend.

``FleetBudget`` is one token bucket for everything the gateway forwards, admitted with max-min
fairness among the nodes calling: a call goes through when the bucket holds more than a
threshold that grows with how much of the budget its node has used lately (its calls forwarded a
second, decayed over ``USAGE_SECONDS``: ``_Usage``) against the fair level, what each node gets
when the budget is shared max-min among the nodes' usage (``_fair_level``, computed again every
``SWEEP_SECONDS``). A node that used nothing needs one token; one at the fair level most of the
bucket (``STEEPNESS``). So while nodes ask for more than the budget, the bucket stays near full,
the heaviest callers taking each token as it comes back, and a lighter caller's call finds the
tokens it needs: at every moment, a node is refused only if every node that used as much as it
or more would be refused too. The heavy callers are cut down to one level (each gets about the same, a node
asking for less gets all it asks), and an honest node, whose long polls, heartbeats and results
use little, is never refused while they are.

A task delivered to a node is not the node's doing: the workflows decide how many tasks it gets.
Its poll and its result are taken off the node's usage (``paid``), as its own bucket gives them
back: the result before it is sent (the usage may go below nothing, as credit that decays as the
usage does), so a node working through a flood of tasks stays as light a caller as one that
makes no call at all. They still take tokens: the bucket counts what reaches the frontend,
whoever asked for it.

The bucket is never below empty: a call taken whatever it held leaves a debt every node then
waits out. The gateway's own calls (``spend``: the start-up answers' fetches, every node's) once
were, and while the frontend answered errors one node's loop on a start-up call took thousands
(3,457 tokens below empty in 3 s at 10 a second: every node refused for six minutes); now one goes
only when the bucket holds its token.

Each replica has a bucket of its own (its part of the gateway's budget), and a node may hold a
connection to every replica (the Service balances connections; a node reconnects until it has one
on each): judged by what it sent this replica alone, it was one of the lighter callers on each,
and got a share on each, N shares where an honest node, connected to one, got one. Judged by what
it sent all of them, it is a heavy caller everywhere: so a node's usage here is what this replica
forwarded for it plus what the other replicas forwarded for it lately (``heard``, from the reports
``peers.PeerUsage`` exchanges every second), and the heaviest callers, by their calls through every
replica, are cut down to one level: one node, one share of the whole gateway, however many
replicas it reaches. Other designs need less but are not sound: a replica cannot tell from what it
sees alone whether a node also calls another (counting every node's share as its share over the
replicas cuts the honest node as much as the attacker); pinning a node to one replica by its name
cannot be enforced (the load balancer, not the node, picks the replica) and starves the nodes that
landed on the other one while theirs restarts. A report older than ``peers.STALE_SECONDS`` is
dropped, so when a replica goes, what it forwarded stops counting within seconds, and its nodes,
reconnecting to the others, are judged by what they send from then on.
"""

from __future__ import annotations

import math
import time

#: Calls the bucket holds, as seconds of its rate: what the gateway may send at once after a quiet
#: spell (a fleet's agents reconnecting after a gateway restart). Two, as the frontend's own
#: bucket (``frontend.namespaceBurstRatio``: 2): the gateway's burst stays within the frontend's.
BURST_SECONDS = 2.0
#: A node's usage is its calls forwarded, each decayed with this time constant: the last ten
#: seconds or so, long enough that a node flooding in pulses is still seen as heavy, short enough
#: that a node that stops is soon a light caller again.
USAGE_SECONDS = 10.0
#: A node's calls a second are its decayed count over the time it has been calling, this at least
#: (a node's first few calls at once are not taken for a rate of thousands a second).
USAGE_AT_LEAST_SECONDS = 1.0
#: A node whose decayed count (or credit) fell below this is no longer calling: forgotten, no
#: longer one of the nodes the budget is shared among (about 46 s after its last call).
FORGOTTEN_BELOW = 0.01
#: How often the usage of every node is decayed, the forgotten ones dropped and the fair level
#: computed again (a sort of the nodes calling: about 5 ms for 10,000).
SWEEP_SECONDS = 0.25
#: How steeply the tokens a call needs grow with its node's usage against the fair level: a node
#: at the fair level needs 86% of the bucket (1 - e^-2), one at half of it 63%. Strictly growing,
#: so a heavier caller always needs more than a lighter one; steep, so the heavy callers keep the
#: bucket near full and the light callers' bursts (an agent's poll and result, several tasks in
#: a row) find it so.
STEEPNESS = 2.0
#: Nodes a replica tells the others about (``report``): the heaviest callers, the only ones whose
#: calls elsewhere can make them heavy callers here (about 60 KB of JSON a second to each replica).
REPORTED_NODES = 2_000


class _Usage:
    """One node's calls forwarded, each decayed over ``USAGE_SECONDS``, since it started calling."""

    __slots__ = ("count", "when", "since")

    def __init__(self, now: float) -> None:
        self.count, self.when, self.since = 0.0, now, now

    def decayed(self, now: float) -> float:
        """The count now (below nothing: credit for calls its tasks paid for)."""
        self.count *= math.exp((self.when - now) / USAGE_SECONDS)
        self.when = now
        return self.count

    def rate(self, now: float) -> float:
        """Calls a second: the decayed count over the decayed time the node has been calling
        (so a node that started calling a second ago is judged by that second, not by ten)."""
        calling = max(now - self.since, USAGE_AT_LEAST_SECONDS)
        return max(0.0, self.decayed(now)) / (USAGE_SECONDS * -math.expm1(-calling / USAGE_SECONDS))


class FleetBudget:
    """``rate`` calls a second for every node together (``burst``, at most, at once), each call
    admitted by how much of it its node used lately; see the module's docstring."""

    def __init__(self, rate: float, burst: float | None = None, clock=time.monotonic) -> None:
        self.rate = rate
        self.burst = max(2.0, rate * BURST_SECONDS if burst is None else burst)
        self.clock = clock
        self._tokens, self._then = self.burst, clock()
        self._usage: dict[str, _Usage] = {}
        # Every node's calls its tasks paid for: they take tokens, but are no node's usage.
        self._paid = _Usage(self._then)
        self._swept = self._then
        self._level = rate  # calls a second: the fair level (no node called yet: the whole rate)
        #: node → calls a second the other replicas forwarded for it lately (``heard``).
        self.elsewhere: dict[str, float] = {}

    def admit(self, node: str) -> bool:
        """Whether ``node``'s call may go upstream now (its token taken if so)."""
        now = self._refill()
        usage = self._usage.get(node) or _Usage(now)
        if self._tokens < self._needed(usage.rate(now) + self.elsewhere.get(node, 0.0)):
            return False
        self._tokens -= 1.0
        usage.count += 1.0
        self._usage[node] = usage
        return True

    def spend(self) -> bool:
        """Whether a call of the gateway's own (a start-up answer's fetch, every node's) may go
        upstream now: its token taken if the bucket holds one, counted in no node's usage."""
        self._refill()
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def paid(self, node: str, calls: float) -> None:
        """``calls`` of ``node``'s are for a task delivered to it (the poll that brought it, the
        result to come): not its usage."""
        now = self.clock()
        usage = self._usage.setdefault(node, _Usage(now))
        usage.count = usage.decayed(now) - calls
        self._paid.count = self._paid.decayed(now) + calls

    def report(self) -> dict[str, float]:
        """What this replica forwarded for each node lately, calls a second (its tasks' calls not
        counted): the heaviest ``REPORTED_NODES`` callers, for the other replicas' ``heard``."""
        now = self.clock()
        rates = ((node, usage.rate(now)) for node, usage in self._usage.items())
        heaviest = sorted((item for item in rates if item[1] > 0), key=lambda item: -item[1])[:REPORTED_NODES]
        return {node: round(rate, 3) for node, rate in heaviest}

    def heard(self, elsewhere: dict[str, float]) -> None:
        """What the other replicas forwarded for each node lately (calls a second, summed over
        them): counted in the node's usage here."""
        self.elsewhere = elsewhere

    def share(self) -> float:
        """The fair level now (calls a second): what each of the heaviest callers gets."""
        return self._level

    def calling(self) -> int:
        """The nodes the budget is shared among now (each called in the last minute or so)."""
        return len(self._usage)

    def _needed(self, rate: float) -> float:
        """The tokens the bucket must hold for a call of a node using ``rate`` calls a second: one
        for a node that used nothing, more the more it used against the fair level."""
        return 1.0 + (self.burst - 1.0) * -math.expm1(-STEEPNESS * rate / self._level)

    def _refill(self) -> float:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._then) * self.rate)
        self._then = now
        if now - self._swept >= SWEEP_SECONDS:
            self._swept = now
            self._usage = {node: usage for node, usage in self._usage.items()
                           if abs(usage.decayed(now)) >= FORGOTTEN_BELOW}
            self._level = self._fair_level(now)
        return now

    def _fair_level(self, now: float) -> float:
        """The max-min fair level of the nodes' usage: the rate ``f`` at which every node using
        less than ``f`` keeps what it uses and every other gets ``f``, the budget spent (what the
        nodes' tasks paid for taken first). While the nodes together use less than the budget, the
        heaviest one's use and what is left over."""
        used = sorted(usage.rate(now) + self.elsewhere.get(node, 0.0) for node, usage in self._usage.items())
        left = max(self.rate - self._paid.rate(now), self.rate / 100)
        for lighter, rate in enumerate(used):
            if rate * (len(used) - lighter) >= left:
                return left / (len(used) - lighter)
            left -= rate
        return (used[-1] if used else 0.0) + left
