"""The usage ledger: every machine's site, offer, price, capacity type, join and retire
times and reclaims, written by the control plane as it happens.

Where it lives: the cluster port's state objects (``Cluster.update_state``), the same
durable place as the account guard: a ConfigMap per object in real mode (written by
compare-and-swap, so a restarted or second control plane loses nothing), the
``control_state`` table of sim.db in sim mode. Not workflow histories: those expire
with the namespace's retention.

Layout: kind ``usage``, one object per site per calendar month (UTC) of the event
(``<site>.<YYYY-MM>``, spilling into ``<site>.<YYYY-MM>.1``, ``.2``... when one nears
what a ConfigMap holds); in it one value per machine and event,
``<machine>.joined`` / ``<machine>.retired``. Activities run at least once: an event
already recorded is not written again, and the reader merges what a retry across a
month boundary may have written twice (earliest time wins).

Recording never fails the step it rides on: a ledger that cannot be written costs
an advisor figure, never a join or a delete (it is logged).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from temporalio import activity

from activities.errors import typed_errors
from fleet.messages.advisor import LedgerEntry, Usage, Workload
from fleet.models import CapacityType

if TYPE_CHECKING:
    from activities.env import FleetEnv

log = logging.getLogger("gpufleet.ledger")

#: The cluster port's state kind of the ledger's objects.
USAGE_STATE = "usage"
#: Bytes of values one object may hold before the next shard is used: a ConfigMap holds
#: 1 MiB in all (names, metadata); this leaves room for both.
MAX_OBJECT_BYTES = 900_000
#: Shards per site and month before the ledger gives up on an event (≈ 9 MB: far beyond
#: any fleet's month; a bound so a bug cannot walk the store forever).
MAX_SHARDS = 10
JOINED, RETIRED = "joined", "retired"
_SAFE = re.compile(r"^[-._a-zA-Z0-9]{1,200}$")


def value_key(machine_id: str, event: str) -> str:
    """A state value key (``[-._a-zA-Z0-9]+``) for the machine's event; ids with other
    characters keep a readable part and a digest, so two ids never share a key."""
    if _SAFE.fullmatch(machine_id):
        return f"{machine_id}.{event}"
    digest = hashlib.sha256(machine_id.encode()).hexdigest()[:12]
    readable = re.sub(r"[^-._a-zA-Z0-9]+", "_", machine_id)[:180]
    return f"{readable}-h-{digest}.{event}"


def shard_key(site: str, at: float, n: int = 0) -> str:
    month = datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m")
    return f"{site}.{month}" + (f".{n}" if n else "")


class UsageLedger:
    """Reads and writes the ledger through a cluster port (``providers.cluster.base.Cluster``)."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster

    def _record(self, site: str, machine_id: str, event: str, value: dict, at: float) -> bool:
        """Write ``value`` once; True when written now, False when it was there already."""
        key = value_key(machine_id, event)
        raw = json.dumps(value, sort_keys=True, separators=(",", ":"))
        for n in range(MAX_SHARDS):
            outcome = ""

            def change(data: dict[str, str]) -> dict[str, str] | None:
                nonlocal outcome
                if key in data:
                    outcome = "there"
                    return None
                if data and sum(len(k) + len(v) for k, v in data.items()) + len(key) + len(raw) > MAX_OBJECT_BYTES:
                    outcome = "full"
                    return None
                outcome = "written"
                return {**data, key: raw}

            self.cluster.update_state(USAGE_STATE, shard_key(site, at, n), change)
            if outcome != "full":
                return outcome == "written"
        raise RuntimeError(f"usage ledger: {shard_key(site, at)} and its {MAX_SHARDS - 1} spill shards are full")

    def joined(self, entry: LedgerEntry) -> bool:
        """Record the join (at ``entry.joined_at``, default now)."""
        at = entry.joined_at if entry.joined_at is not None else time.time()
        value = entry.model_dump(mode="json", exclude={"retired_at", "reclaimed"})
        value["joined_at"] = at
        return self._record(entry.site, entry.machine_id, JOINED, value, at)

    def retired(self, site: str, machine_id: str, *, reclaimed: bool = False, at: float | None = None) -> bool:
        at = at or time.time()
        return self._record(site, machine_id, RETIRED,
                            {"machine_id": machine_id, "site": site, "retired_at": at, "reclaimed": reclaimed}, at)

    def entries(self) -> list[LedgerEntry]:
        """Every machine, its events merged (earliest join and retire, reclaimed if any said so)."""
        merged: dict[tuple[str, str], LedgerEntry] = {}
        for _name, data in sorted(self.cluster.list_state(USAGE_STATE).items()):
            for key, raw in sorted(data.items()):
                event = key.rsplit(".", 1)[-1]
                if event not in (JOINED, RETIRED):
                    continue
                value = json.loads(raw)
                ident = (value["site"], value["machine_id"])
                entry = merged.setdefault(ident, LedgerEntry(machine_id=value["machine_id"], site=value["site"]))
                if event == JOINED:
                    first = entry.joined_at is None or value["joined_at"] < entry.joined_at
                    if first:
                        kept = entry.model_dump(include={"retired_at", "reclaimed"})
                        entry = LedgerEntry.model_validate({**value, **kept})
                else:
                    if entry.retired_at is None or value["retired_at"] < entry.retired_at:
                        entry.retired_at = value["retired_at"]
                    entry.reclaimed = entry.reclaimed or bool(value.get("reclaimed"))
                merged[ident] = entry
        return sorted(merged.values(), key=lambda e: (e.site, e.joined_at or 0.0, e.machine_id))


# -- what the recording activities call (one line each) ---------------------------------------
def _offer_facts(env: FleetEnv, site) -> tuple[float, float]:
    """Price and interruption risk of the site's offer from the cached catalog (no provider
    call); the config's price when the catalog has not listed it yet."""
    try:
        for entry in env.accounts.catalog():
            for offer in entry.offers if entry.site == site.name else ():
                if offer.instance_type == site.instance_type:
                    return offer.price_per_gpu_hour, offer.interruption_risk
    except Exception:  # noqa: BLE001 - a cache: the config's figures are a fine fallback
        pass
    return site.price_per_gpu_hour, 0.0


def _record_join(env: FleetEnv, site_name: str, machine_id: str, node_name: str) -> None:
    site = env.site(site_name)
    price, risk = _offer_facts(env, site)
    UsageLedger(env.cluster).joined(LedgerEntry(
        machine_id=machine_id, site=site.name, node_name=node_name, provider=site.provider, offer=site.instance_type,
        gpu=site.gpu, gpus=site.gpus_per_machine, gpu_memory_gb=site.gpu_memory_gb, price_per_gpu_hour=price,
        capacity_type=site.capacity_type, interruption_risk=risk if site.capacity_type == CapacityType.SPOT else 0.0,
    ))


def record_join(env: FleetEnv, site: str, machine_id: str, node_name: str = "") -> None:
    """The machine joined the fleet (its node was admitted). Never raises."""
    if not machine_id:
        return
    try:
        _record_join(env, site, machine_id, node_name)
    except Exception as error:  # noqa: BLE001 - see the module docstring
        log.warning("usage ledger: join of %s at %s not recorded: %s", machine_id, site, error)


def record_retire(env: FleetEnv, site: str, machine_id: str, *, reclaimed: bool | None = None) -> None:
    """The machine left the fleet (deleted, or its delete queued). ``reclaimed`` None: a
    reclaim when the calling activity runs for SpotReclaim. Never raises."""
    if not machine_id:
        return
    try:
        if reclaimed is None:
            reclaimed = activity.in_activity() and activity.info().workflow_type == "SpotReclaim"
        UsageLedger(env.cluster).retired(site, machine_id, reclaimed=reclaimed)
    except Exception as error:  # noqa: BLE001 - see the module docstring
        log.warning("usage ledger: retire of %s at %s not recorded: %s", machine_id, site, error)


async def record_join_async(env: FleetEnv, site: str, machine_id: str, node_name: str = "") -> None:
    await asyncio.to_thread(record_join, env, site, machine_id, node_name)


# -- the Advisor's read-only activity -----------------------------------------------------------
class LedgerActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env

    def all(self) -> list:
        return [self.read_usage]

    @activity.defn
    @typed_errors
    def read_usage(self) -> Usage:
        """The ledger's machines and the workloads the cluster serves now. Reads only."""
        ledger = UsageLedger(self.env.cluster)
        workloads = [Workload(model=s.model, site=s.site, replicas=s.desired_replicas,
                              gpus_per_replica=s.gpus_per_replica)
                     for s in self.env.cluster.list_serving()]
        return Usage(entries=ledger.entries(), workloads=workloads)
