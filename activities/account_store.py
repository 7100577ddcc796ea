"""The account guard's store: what every activity checks before a provider call.

The ``ProviderAccount`` entity workflow is the record a person sees; this store
is its write-through mirror that activities read, so that a revoked account gets
zero provider calls from *any* workflow (checked in ``FleetEnv.provider``, before
an SDK is touched). It also holds the deletes queued while an account is revoked,
and the last provider catalog.

Where it lives: in sim mode, tables in ``<state-dir>/sim.db`` (the simulated
world's file, ``AccountStore``). In real mode, in the Kubernetes API
(``ClusterAccountStore``): one state object per account through the cluster
port, written by compare-and-swap, so a restarted control-plane pod (or a
second one) reads exactly what the last one wrote and two writers never lose
each other's change; nothing of it is on local disk. The catalog is a cache of
what providers list: in real mode it is kept in memory and rebuilt by the next
refresh.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from fleet.models import AccountState, Offer
from providers.sqlite import SqliteDb

if TYPE_CHECKING:
    from providers.cluster.base import Cluster

SCHEMA = """
CREATE TABLE IF NOT EXISTS account_states (
    name TEXT PRIMARY KEY, provider TEXT, state TEXT, blocked_offers TEXT, reason TEXT, since REAL
);
CREATE TABLE IF NOT EXISTS pending_deletes (
    machine_id TEXT PRIMARY KEY, site TEXT, account TEXT, queued_at REAL
);
CREATE TABLE IF NOT EXISTS catalog (
    site TEXT PRIMARY KEY, offers TEXT, error_type TEXT, error TEXT, refreshed_at REAL
);
"""


class AccountRecord(BaseModel):
    name: str
    provider: str = ""
    state: AccountState = AccountState.HEALTHY
    blocked_offers: list[str] = Field(default_factory=list)
    reason: str = ""
    since: float | None = None


class PendingDelete(BaseModel):
    machine_id: str
    site: str
    account: str
    queued_at: float


class CatalogEntry(BaseModel):
    site: str
    offers: list[Offer] = Field(default_factory=list)
    error_type: str = ""
    error: str = ""
    refreshed_at: float = 0.0


class AccountStore(SqliteDb):
    def __init__(self, path: str | Path) -> None:
        super().__init__(path, SCHEMA)

    # -- account states ------------------------------------------------------------------
    def get(self, name: str) -> AccountRecord:
        row = self._conn().execute("SELECT * FROM account_states WHERE name=?", (name,)).fetchone()
        if row is None:
            return AccountRecord(name=name)
        return AccountRecord(
            name=name, provider=row["provider"] or "", state=AccountState(row["state"]),
            blocked_offers=json.loads(row["blocked_offers"] or "[]"), reason=row["reason"] or "", since=row["since"],
        )

    def all(self) -> list[AccountRecord]:
        names = [r["name"] for r in self._conn().execute("SELECT name FROM account_states ORDER BY name")]
        return [self.get(n) for n in names]

    def put(self, record: AccountRecord) -> None:
        with self.tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO account_states(name, provider, state, blocked_offers, reason, since)"
                " VALUES (?,?,?,?,?,?)",
                (record.name, record.provider, record.state.value, json.dumps(sorted(set(record.blocked_offers))),
                 record.reason, record.since),
            )

    def mark_revoked(self, name: str, provider: str, reason: str) -> None:
        self.put(_revoke(self.get(name), provider, reason))

    def block_offer(self, name: str, provider: str, offer: str, reason: str) -> None:
        self.put(_block(self.get(name), provider, offer, reason))

    # -- deletes queued while an account is revoked ----------------------------------------
    def queue_delete(self, site: str, account: str, machine_id: str) -> None:
        with self.tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO pending_deletes(machine_id, site, account, queued_at) VALUES (?,?,?,?)",
                (machine_id, site, account, time.time()),
            )

    def pending_deletes(self, account: str | None = None) -> list[PendingDelete]:
        sql, args = "SELECT * FROM pending_deletes", []
        if account:
            sql, args = sql + " WHERE account=?", [account]
        return [PendingDelete(**dict(r)) for r in self._conn().execute(sql + " ORDER BY queued_at", args)]

    def done_delete(self, machine_id: str) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM pending_deletes WHERE machine_id=?", (machine_id,))

    # -- catalog ---------------------------------------------------------------------------
    def put_catalog(self, entry: CatalogEntry) -> None:
        with self.tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO catalog(site, offers, error_type, error, refreshed_at) VALUES (?,?,?,?,?)",
                (entry.site, json.dumps([o.model_dump(mode="json") for o in entry.offers]), entry.error_type,
                 entry.error, entry.refreshed_at),
            )

    def catalog(self) -> list[CatalogEntry]:
        return [
            CatalogEntry(site=r["site"], offers=[Offer.model_validate(o) for o in json.loads(r["offers"] or "[]")],
                         error_type=r["error_type"] or "", error=r["error"] or "", refreshed_at=r["refreshed_at"] or 0)
            for r in self._conn().execute("SELECT * FROM catalog ORDER BY site")
        ]


#: The cluster port's state kind of the account objects.
ACCOUNT_STATE = "account"
_RECORD, _PENDING = "record", "pending-deletes"


def _revoke(record: AccountRecord, provider: str, reason: str) -> AccountRecord:
    if record.state != AccountState.CREDENTIALS_REVOKED:
        record.state, record.since = AccountState.CREDENTIALS_REVOKED, time.time()
    record.provider, record.reason = provider or record.provider, reason
    return record


def _block(record: AccountRecord, provider: str, offer: str, reason: str) -> AccountRecord:
    if offer not in record.blocked_offers:
        record.blocked_offers.append(offer)
    if record.state == AccountState.HEALTHY:
        record.state, record.since = AccountState.QUOTA_BLOCKED, time.time()
    record.provider, record.reason = provider or record.provider, reason
    return record


class ClusterAccountStore:
    """The guard store of ``mode: real``: per account one state object in the cluster
    (``record``: the ``AccountRecord``; ``pending-deletes``: machine id -> site and
    when), each change one compare-and-swap, the catalog in memory. Same methods as
    ``AccountStore``."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._catalog: dict[str, CatalogEntry] = {}
        self._catalog_lock = threading.Lock()

    @staticmethod
    def _record(name: str, data: dict[str, str]) -> AccountRecord:
        raw = data.get(_RECORD)
        return AccountRecord.model_validate_json(raw) if raw else AccountRecord(name=name)

    @staticmethod
    def _pending(data: dict[str, str]) -> dict[str, dict]:
        return json.loads(data.get(_PENDING) or "{}")

    def _change_record(self, name: str, change) -> None:
        def apply(data: dict[str, str]) -> dict[str, str]:
            record = change(self._record(name, data))
            record.blocked_offers = sorted(set(record.blocked_offers))
            return {**data, _RECORD: record.model_dump_json()}

        self.cluster.update_state(ACCOUNT_STATE, name, apply)

    # -- account states ------------------------------------------------------------------
    def get(self, name: str) -> AccountRecord:
        return self._record(name, self.cluster.read_state(ACCOUNT_STATE, name))

    def all(self) -> list[AccountRecord]:
        objects = self.cluster.list_state(ACCOUNT_STATE)
        return [self._record(name, data) for name, data in sorted(objects.items()) if _RECORD in data]

    def put(self, record: AccountRecord) -> None:
        self._change_record(record.name, lambda _old: record.model_copy(deep=True))

    def mark_revoked(self, name: str, provider: str, reason: str) -> None:
        self._change_record(name, lambda record: _revoke(record, provider, reason))

    def block_offer(self, name: str, provider: str, offer: str, reason: str) -> None:
        self._change_record(name, lambda record: _block(record, provider, offer, reason))

    # -- deletes queued while an account is revoked ----------------------------------------
    def queue_delete(self, site: str, account: str, machine_id: str) -> None:
        queued_at = time.time()

        def apply(data: dict[str, str]) -> dict[str, str] | None:
            pending = self._pending(data)
            if machine_id in pending:
                return None
            pending[machine_id] = {"site": site, "queued_at": queued_at}
            return {**data, _PENDING: json.dumps(pending, sort_keys=True)}

        self.cluster.update_state(ACCOUNT_STATE, account, apply)

    def pending_deletes(self, account: str | None = None) -> list[PendingDelete]:
        if account:
            objects = {account: self.cluster.read_state(ACCOUNT_STATE, account)}
        else:
            objects = self.cluster.list_state(ACCOUNT_STATE)
        found = [
            PendingDelete(machine_id=machine_id, site=entry["site"], account=name, queued_at=entry["queued_at"])
            for name, data in objects.items()
            for machine_id, entry in self._pending(data).items()
        ]
        return sorted(found, key=lambda p: (p.queued_at, p.machine_id))

    def done_delete(self, machine_id: str) -> None:
        def apply(data: dict[str, str]) -> dict[str, str] | None:
            pending = self._pending(data)
            if pending.pop(machine_id, None) is None:
                return None
            return {**data, _PENDING: json.dumps(pending, sort_keys=True)}

        for name, data in self.cluster.list_state(ACCOUNT_STATE).items():
            if machine_id in self._pending(data):
                self.cluster.update_state(ACCOUNT_STATE, name, apply)

    # -- catalog (a cache: kept in memory, rebuilt by the next refresh) ---------------------
    def put_catalog(self, entry: CatalogEntry) -> None:
        with self._catalog_lock:
            self._catalog[entry.site] = entry.model_copy(deep=True)

    def catalog(self) -> list[CatalogEntry]:
        with self._catalog_lock:
            return [self._catalog[site].model_copy(deep=True) for site in sorted(self._catalog)]
