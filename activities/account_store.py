"""The account guard's store: what every activity checks before a provider call.

The ``ProviderAccount`` entity workflow is the record a person sees; this store
is its write-through mirror that activities read, so that a revoked account gets
zero provider calls from *any* workflow (checked in ``FleetEnv.provider``, before
an SDK is touched). It also holds the deletes queued while an account is revoked,
and the last provider catalog.

Where it lives: in sim mode, tables in ``<state-dir>/sim.db`` (the simulated
world's file); in real mode, ``<state-dir>/accounts.db`` beside the control-plane
worker (one control-plane worker per fleet; put the state dir on a persistent
volume). A lost file is rebuilt: the entities write their state again on their
next change, and the catalog refreshes itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pydantic import BaseModel, Field

from fleet.models import AccountState, Offer
from providers.sqlite import SqliteDb

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
        record = self.get(name)
        if record.state != AccountState.CREDENTIALS_REVOKED:
            record.state, record.since = AccountState.CREDENTIALS_REVOKED, time.time()
        record.provider, record.reason = provider or record.provider, reason
        self.put(record)

    def block_offer(self, name: str, provider: str, offer: str, reason: str) -> None:
        record = self.get(name)
        if offer not in record.blocked_offers:
            record.blocked_offers.append(offer)
        if record.state == AccountState.HEALTHY:
            record.state, record.since = AccountState.QUOTA_BLOCKED, time.time()
        record.provider, record.reason = provider or record.provider, reason
        self.put(record)

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
