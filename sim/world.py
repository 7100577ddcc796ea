"""The simulated world: providers, machines and GPUs in one SQLite file.

Everything ``gpufleet dev`` and the tests simulate lives in ``<state-dir>/sim.db``
so that the worker, the node-agent host and the CLI (``gpufleet sim ...``) see and
change the same world while the stack runs. ``sim/provider.py`` is the ``Provider``
for every simulated site, ``sim/gpu.py`` a simulated machine's GPUs, ``sim/cluster.py``
the simulated cluster, all on this world.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

from fleet.config import FleetConfig
from fleet.models import CapacityType, GpuHealth, Machine, XidEvent
from providers.sqlite import SqliteDb

SCHEMA = """
CREATE TABLE IF NOT EXISTS sites (
    name TEXT PRIMARY KEY, provider TEXT, account TEXT, region TEXT,
    capacity INTEGER, quota INTEGER, api_latency_ms INTEGER, boot_seconds REAL,
    interruption_risk REAL, unreachable INTEGER DEFAULT 0
);
CREATE TABLE IF NOT EXISTS accounts (
    name TEXT PRIMARY KEY, provider TEXT, credentials_valid INTEGER DEFAULT 1
);
CREATE TABLE IF NOT EXISTS machines (
    id TEXT PRIMARY KEY, idempotency_key TEXT UNIQUE, name TEXT, site TEXT, account TEXT,
    instance_type TEXT, capacity_type TEXT, gpu TEXT, gpus INTEGER,
    created_at REAL, boot_at REAL, boot_id TEXT, deleted_at REAL,
    reboots INTEGER DEFAULT 0, reinstalls INTEGER DEFAULT 0
);
CREATE TABLE IF NOT EXISTS gpus (
    machine_id TEXT, idx INTEGER, uuid TEXT, name TEXT, memory_gb INTEGER,
    PRIMARY KEY (machine_id, idx)
);
CREATE TABLE IF NOT EXISTS gpu_faults (
    id INTEGER PRIMARY KEY AUTOINCREMENT, machine_id TEXT, idx INTEGER,
    kind TEXT, value INTEGER, clears_on TEXT, at REAL
);
CREATE TABLE IF NOT EXISTS calls (
    account TEXT, op TEXT, n INTEGER, PRIMARY KEY (account, op)
);
CREATE TABLE IF NOT EXISTS bootstrap (
    machine_id TEXT PRIMARY KEY, token TEXT
);
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY, machine_id TEXT, labels TEXT, taints TEXT,
    unschedulable INTEGER DEFAULT 0, ready INTEGER DEFAULT 1, boot_id TEXT,
    gpus INTEGER, registered_at REAL
);
CREATE TABLE IF NOT EXISTS reclaim_notices (
    machine_id TEXT PRIMARY KEY, posted_at REAL, terminate_at REAL
);
CREATE TABLE IF NOT EXISTS join_tokens (
    id TEXT PRIMARY KEY, secret_sha256 TEXT, node_name TEXT, machine_id TEXT,
    expires_at REAL, used_at REAL
);
CREATE TABLE IF NOT EXISTS actions (
    id INTEGER PRIMARY KEY AUTOINCREMENT, machine_id TEXT, gpu INTEGER, op TEXT, at REAL
);
CREATE TABLE IF NOT EXISTS kubelet_silence (
    machine_id TEXT PRIMARY KEY, until REAL
);
-- A silenced kubelet's status posts are lost on the way (``SimWorld.silence_kubelets``): the node
-- stays NotReady whoever writes Ready for it, until the silence ends.
CREATE TRIGGER IF NOT EXISTS kubelet_silenced BEFORE UPDATE OF ready ON nodes
WHEN NEW.ready = 1 AND EXISTS (
    SELECT 1 FROM kubelet_silence s
    WHERE s.machine_id = NEW.machine_id AND s.until > (julianday('now') - 2440587.5) * 86400.0)
BEGIN SELECT RAISE(IGNORE); END;
-- What the simulated nodes' host has to look at again (``SimWorld.changes_since``), written by
-- triggers so that every writer (control plane, CLI, tests) is seen without knowing of it:
-- kubelet 0, only what the machine's health watch reads; 1, also what its kubelet acts on.
CREATE TABLE IF NOT EXISTS world_changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, machine_id TEXT, kubelet INTEGER
);
"""

#: table → (its machine id column, whether its kubelet acts on it), one change row per write.
CHANGE_SOURCES = {
    "gpus": ("machine_id", 0), "gpu_faults": ("machine_id", 0), "reclaim_notices": ("machine_id", 0),
    "machines": ("id", 1), "bootstrap": ("machine_id", 1), "kubelet_silence": ("machine_id", 1),
    "nodes": ("machine_id", 1), "sites": ("NULL", 1),
}
#: Only what a kubelet reads of its node: a cordon or a label is not its business.
CHANGE_COLUMNS = {"nodes": " OF ready, boot_id, machine_id"}


def _change_trigger(table: str, op: str) -> str:
    column, kubelet = CHANGE_SOURCES[table]
    row = "OLD" if op == "DELETE" else "NEW"
    columns = CHANGE_COLUMNS.get(table, "") if op == "UPDATE" else ""
    return (f"CREATE TRIGGER IF NOT EXISTS {table}_{op.lower()}_changes AFTER {op}{columns} ON {table}"
            f" BEGIN INSERT INTO world_changes(machine_id, kubelet)"
            f" VALUES ({column if column == 'NULL' else f'{row}.{column}'}, {kubelet}); END;\n")


SCHEMA += "".join(_change_trigger(table, op) for table in CHANGE_SOURCES for op in ("INSERT", "UPDATE", "DELETE"))

#: What the bootstrap through user data added: the machine's user data (and whether its
#: install has still to run it), the join a token was issued for with the token itself
#: (as a bootstrap token Secret holds it), and the providerID the kubelet registered.
BOOTSTRAP_COLUMNS = (
    ("machines", "user_data", "TEXT"),
    ("machines", "user_data_pending", "INTEGER DEFAULT 0"),
    ("join_tokens", "join_key", "TEXT"),
    ("join_tokens", "token", "TEXT"),
    ("nodes", "provider_id", "TEXT"),
)
#: When the provider stopped the machine (``SimWorld.preempt_machine``); NULL: it was not.
STOP_COLUMNS = (("machines", "stopped_at", "REAL"),)
#: When a node's ``ready`` last changed (its Ready condition's ``lastTransitionTime``), written by
#: ``READY_CHANGED`` for every writer (kubelet, host, tests); made after the column is there.
READY_COLUMNS = (("nodes", "ready_changed_at", "REAL"),)
READY_CHANGED = """
CREATE TRIGGER IF NOT EXISTS nodes_ready_registered AFTER INSERT ON nodes
BEGIN UPDATE nodes SET ready_changed_at = (julianday('now') - 2440587.5) * 86400.0 WHERE name = NEW.name; END;
CREATE TRIGGER IF NOT EXISTS nodes_ready_changed AFTER UPDATE OF ready ON nodes WHEN OLD.ready IS NOT NEW.ready
BEGIN UPDATE nodes SET ready_changed_at = (julianday('now') - 2440587.5) * 86400.0 WHERE name = NEW.name; END;
"""

#: How strong a repair clears a simulated fault: a fault clears at its rung or any stronger one.
RUNGS = ("reset", "reboot", "reinstall", "never")


def _now() -> float:
    return time.time()


def _utc(ts: float | None) -> datetime | None:
    return datetime.fromtimestamp(ts, timezone.utc) if ts is not None else None


class WorldChanges(NamedTuple):
    seq: int  # the last change read: the next ``changes_since`` starts after it
    machines: set[str]  # machine ids whose rows changed
    kubelet: bool  # a change some kubelet acts on (a machine, node, token, site, silence)
    everything: bool  # changes were forgotten unread: look at every machine


class SimWorld(SqliteDb):
    """Handle on ``sim.db``. Safe to use from many threads and processes."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path, SCHEMA)
        with self.tx() as db:
            for table, column, kind in BOOTSTRAP_COLUMNS + STOP_COLUMNS + READY_COLUMNS:
                have = {r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}
                if column not in have:  # a sim.db made before machines got user data
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            db.executescript(READY_CHANGED)

    # -- setup -------------------------------------------------------------------
    def seed(self, config: FleetConfig) -> None:
        """Add the config's sites and accounts; keeps what the CLI changed before."""
        with self.tx() as db:
            for account in config.accounts:
                db.execute(
                    "INSERT OR IGNORE INTO accounts(name, provider) VALUES (?, ?)", (account.name, account.provider)
                )
            for site in config.sites:
                s = site.sim
                db.execute(
                    "INSERT OR IGNORE INTO sites(name, provider, account, region, capacity, quota,"
                    " api_latency_ms, boot_seconds, interruption_risk) VALUES (?,?,?,?,?,?,?,?,?)",
                    (site.name, site.provider, site.account, site.region, s.capacity, s.quota,
                     s.api_latency_ms, s.boot_seconds, s.interruption_risk),
                )

    # -- what the CLI and tests change ---------------------------------------------
    def set_site(self, site: str, **fields: Any) -> None:
        allowed = {"capacity", "quota", "api_latency_ms", "boot_seconds", "unreachable", "interruption_risk"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown site fields: {sorted(unknown)}")
        with self.tx() as db:
            if not db.execute("SELECT 1 FROM sites WHERE name=?", (site,)).fetchone():
                raise KeyError(site)
            for key, value in fields.items():
                db.execute(f"UPDATE sites SET {key}=? WHERE name=?", (value, site))

    #: The site knobs ``reset`` puts back, each from the site's ``sim:`` block (unreachable: 0).
    SITE_KNOBS = ("capacity", "quota", "api_latency_ms", "boot_seconds", "interruption_risk", "unreachable")

    def reset(self, config: FleetConfig) -> list[str]:
        """Every knob back to the config's defaults: each site's capacity, quota, API latency, boot
        time, interruption risk and reachability, each account's credentials valid, every injected
        GPU fault gone. Machines, nodes and what runs on them stay. Returns one line per change."""
        changes: list[str] = []
        with self.tx() as db:
            for site in config.sites:
                row = db.execute("SELECT * FROM sites WHERE name=?", (site.name,)).fetchone()
                if row is None:
                    continue
                wanted = {knob: getattr(site.sim, knob) for knob in self.SITE_KNOBS if knob != "unreachable"}
                wanted["unreachable"] = 0
                for knob, value in wanted.items():
                    if row[knob] != value:
                        db.execute(f"UPDATE sites SET {knob}=? WHERE name=?", (value, site.name))
                        changes.append(f"{site.name}: {knob} {row[knob]} -> {value}")
            for account in config.accounts:
                found = db.execute("UPDATE accounts SET credentials_valid=1 WHERE name=? AND credentials_valid=0",
                                   (account.name,)).rowcount
                if found:
                    changes.append(f"{account.name}: credentials revoked -> valid")
            faults = db.execute(
                "SELECT COALESCE(m.name, f.machine_id) AS machine, f.idx, f.kind, COUNT(*) AS n FROM gpu_faults f"
                " LEFT JOIN machines m ON m.id = f.machine_id GROUP BY machine, f.idx, f.kind ORDER BY machine, f.idx"
            ).fetchall()
            db.execute("DELETE FROM gpu_faults")
            changes += [f"{f['machine']} GPU {f['idx']}: {f['kind']} fault cleared" + (f" (x{f['n']})" if f["n"] > 1 else "")
                        for f in faults]
        return changes

    def set_credentials_valid(self, account: str, valid: bool) -> None:
        with self.tx() as db:
            if not db.execute("SELECT 1 FROM accounts WHERE name=?", (account,)).fetchone():
                raise KeyError(account)
            db.execute("UPDATE accounts SET credentials_valid=? WHERE name=?", (int(valid), account))

    def inject_fault(self, machine_id: str, gpu: int, kind: str, value: int = 1, clears_on: str = "reset") -> None:
        """Break a GPU. ``kind``: xid, ecc, remap_pending, remap_failure, lost,
        nvlink_down, hot, compute, recovery_action, retired_pending, held (processes
        hold the GPU: a reset is refused). ``clears_on``: the weakest
        repair rung that fixes it (reset, reboot, reinstall, never)."""
        if clears_on not in RUNGS:
            raise ValueError(f"clears_on must be one of {RUNGS}")
        with self.tx() as db:
            if not db.execute("SELECT 1 FROM gpus WHERE machine_id=? AND idx=?", (machine_id, gpu)).fetchone():
                raise KeyError(f"{machine_id} gpu{gpu}")
            db.execute(
                "INSERT INTO gpu_faults(machine_id, idx, kind, value, clears_on, at) VALUES (?,?,?,?,?,?)",
                (machine_id, gpu, kind, value, clears_on, _now()),
            )

    def clear_faults(self, machine_id: str, rung: str, gpu: int | None = None) -> int:
        """Apply a repair of strength ``rung``; returns how many faults it cleared."""
        strong = RUNGS[: RUNGS.index(rung) + 1]
        marks = ",".join("?" * len(strong))
        sql = f"DELETE FROM gpu_faults WHERE machine_id=? AND clears_on IN ({marks})"
        args: list[Any] = [machine_id, *strong]
        if gpu is not None:
            sql += " AND idx=?"
            args.append(gpu)
        with self.tx() as db:
            return db.execute(sql, args).rowcount

    def post_reclaim_notice(self, machine_id: str, seconds: float = 120) -> float:
        """The provider announces it will reclaim this (spot) machine in ``seconds``
        (AWS spot/instance-action, GCP preempted). Returns the termination time."""
        if self.machine(machine_id) is None:
            raise KeyError(machine_id)
        now = _now()
        with self.tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO reclaim_notices(machine_id, posted_at, terminate_at) VALUES (?,?,?)",
                (machine_id, now, now + seconds),
            )
        return now + seconds

    def preempt_machine(self, machine_id: str) -> None:
        """The provider takes this spot machine without a notice (Nebius's preemption,
        ``on_preemption: STOP``): the machine stays, stopped (``Machine.state`` "stopped"), its
        kubelet and agent gone with it, so its node turns NotReady."""
        with self.tx() as db:
            if not db.execute("UPDATE machines SET stopped_at=? WHERE id=? AND deleted_at IS NULL",
                              (_now(), machine_id)).rowcount:
                raise KeyError(machine_id)
            self.record_action(db, machine_id, "preempt")

    def start_machine(self, machine_id: str) -> None:
        """A person starts a machine its provider stopped (``preempt_machine``) again: it boots
        (``Machine.state`` "running"), and its kubelet reports its node Ready again."""
        with self.tx() as db:
            if not db.execute("UPDATE machines SET stopped_at=NULL WHERE id=? AND deleted_at IS NULL",
                              (machine_id,)).rowcount:
                raise KeyError(machine_id)
            self.record_action(db, machine_id, "start")

    def add_foreign_machine(self, site: str, name: str, age_seconds: float = 0.0) -> str:
        """A machine someone else launched into the site's account (no fleet marker)."""
        row = self.site_row(site)
        machine_id = f"foreign-{uuid.uuid4().hex[:12]}"
        created = _now() - age_seconds
        with self.tx() as db:
            db.execute(
                "INSERT INTO machines(id, idempotency_key, name, site, account, instance_type, capacity_type,"
                " gpu, gpus, created_at, boot_at, boot_id) VALUES (?,NULL,?,?,?,?,?,?,?,?,?,?)",
                (machine_id, name, site, row["account"], "other", "on-demand", "H100", 0, created, created,
                 uuid.uuid4().hex),
            )
        return machine_id

    def silence_kubelets(self, until: dict[str, float]) -> None:
        """The cluster's API server has not heard these machines' kubelets (machine id → when each
        posts its status again, epoch seconds): their nodes are NotReady until then, while the
        machines, their agents and what they serve run on. What a control plane that was away
        finds when it returns: every heartbeat as old as the outage, until each kubelet's next one."""
        with self.tx() as db:
            for machine_id, at in until.items():
                db.execute("INSERT OR REPLACE INTO kubelet_silence(machine_id, until) VALUES (?, ?)", (machine_id, at))
                db.execute("UPDATE nodes SET ready=0 WHERE machine_id=?", (machine_id,))

    def age_machine(self, machine_id: str, seconds: float) -> None:
        """Move a machine's creation time ``seconds`` into the past (tests of the sweep's grace)."""
        with self.tx() as db:
            db.execute("UPDATE machines SET created_at = created_at - ? WHERE id=?", (seconds, machine_id))

    def reclaim_notices(self) -> dict[str, float]:
        """machine id → termination time, for every posted notice (what each machine's IMDS answers)."""
        return {row[0]: row[1] for row in self.query("SELECT machine_id, terminate_at FROM reclaim_notices")}

    def changes_since(self, seq: int) -> WorldChanges:
        """What changed after change ``seq`` (0: never looked): the machines touched, and whether
        any kubelet has something to act on. O(changes), whatever the fleet's size: the node
        host wakes only the watches whose machine changed, as a real node's XID waiter wakes
        only its own. Changes forgotten before the caller read them (``forget_changes``) make
        ``everything`` true."""
        rows = self.query("SELECT seq, machine_id, kubelet FROM world_changes WHERE seq > ? ORDER BY seq", seq)
        if rows:
            return WorldChanges(seq=rows[-1]["seq"], machines={r["machine_id"] for r in rows if r["machine_id"]},
                                kubelet=any(r["kubelet"] for r in rows), everything=rows[0]["seq"] != seq + 1)
        last = self.query("SELECT seq FROM sqlite_sequence WHERE name='world_changes'")
        newest = last[0]["seq"] if last else 0
        return WorldChanges(seq=max(seq, newest), machines=set(), kubelet=False, everything=newest > seq)

    def forget_changes(self, through: int) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM world_changes WHERE seq <= ?", (through,))

    def next_silence_end(self) -> float:
        """When the next kubelet silence ends (epoch s; inf: none)."""
        row = self.query("SELECT min(until) FROM kubelet_silence WHERE until > ?", _now())[0]
        return row[0] if row[0] is not None else float("inf")

    # -- what tests and the CLI read ----------------------------------------------
    def calls(self, account: str, op: str | None = None) -> int:
        sql, args = "SELECT COALESCE(SUM(n), 0) FROM calls WHERE account=?", [account]
        if op:
            sql += " AND op=?"
            args.append(op)
        return self.query(sql, *args)[0][0]

    def machines(self, site: str | None = None, include_deleted: bool = False) -> list[sqlite3.Row]:
        sql, args = "SELECT * FROM machines WHERE 1=1", []
        if site:
            sql += " AND site=?"
            args.append(site)
        if not include_deleted:
            sql += " AND deleted_at IS NULL"
        return self.query(sql + " ORDER BY created_at", *args)

    def machine(self, machine_id: str) -> sqlite3.Row | None:
        rows = self.query("SELECT * FROM machines WHERE id=?", machine_id)
        return rows[0] if rows else None

    def machine_by_name(self, name: str) -> sqlite3.Row | None:
        rows = self.query("SELECT * FROM machines WHERE name=? AND deleted_at IS NULL", name)
        return rows[0] if rows else None

    def sites(self) -> list[sqlite3.Row]:
        return self.query("SELECT * FROM sites ORDER BY name")

    def site_row(self, name: str) -> sqlite3.Row:
        rows = self.query("SELECT * FROM sites WHERE name=?", name)
        if not rows:
            raise KeyError(name)
        return rows[0]

    def gpu_health(self, machine_id: str) -> list[GpuHealth]:
        """What NVML would report for each GPU of a simulated machine."""
        gpus = self.query("SELECT * FROM gpus WHERE machine_id=? ORDER BY idx", machine_id)
        faults = self.query("SELECT * FROM gpu_faults WHERE machine_id=? ORDER BY id", machine_id)
        report = []
        for gpu in gpus:
            health = GpuHealth(
                index=gpu["idx"], uuid=gpu["uuid"], name=gpu["name"], memory_gb=gpu["memory_gb"],
                temperature_c=45, slowdown_temperature_c=90,
            )
            for f in (f for f in faults if f["idx"] == gpu["idx"]):
                kind, value = f["kind"], f["value"]
                if kind == "xid":
                    health.xid_events.append(XidEvent(xid=value, at=_utc(f["at"]), message=f"simulated XID {value}"))
                elif kind == "ecc":
                    health.ecc_uncorrected += value
                elif kind == "remap_pending":
                    health.remapped_rows_pending = True
                elif kind == "remap_failure":
                    health.remapped_rows_failure = True
                elif kind == "lost":
                    health.lost = True
                elif kind == "nvlink_down":
                    health.nvlink_down += value
                elif kind == "hot":
                    health.temperature_c = health.slowdown_temperature_c + value
                elif kind == "recovery_action":
                    health.recovery_action = value
                elif kind == "retired_pending":
                    health.retired_pages_pending = True
                # kind "held": processes hold the GPU (a reset fails); invisible to NVML health.
            report.append(health)
        return report

    def gpu_held(self, machine_id: str, gpu: int) -> bool:
        """Whether processes hold the GPU (a ``held`` fault), so ``nvidia-smi -r`` refuses."""
        return bool(self.query(
            "SELECT 1 FROM gpu_faults WHERE machine_id=? AND idx=? AND kind='held'", machine_id, gpu
        ))

    def compute_ok(self, machine_id: str, gpu: int) -> bool:
        return not self.query(
            "SELECT 1 FROM gpu_faults WHERE machine_id=? AND idx=? AND kind IN ('compute','lost')", machine_id, gpu
        )

    # -- the machine's side of bootstrap (sim kubelet) ------------------------------
    def bootstrap_waiting(self) -> set[str]:
        """Machines whose join token waits in their bootstrap channel."""
        return {row[0] for row in self.query("SELECT machine_id FROM bootstrap")}

    def pending_user_data(self) -> dict[str, str]:
        """machine id → user data its install has not run yet (cloud-init's first boot)."""
        rows = self.query("SELECT id, user_data FROM machines WHERE user_data_pending=1 AND deleted_at IS NULL")
        return {row["id"]: row["user_data"] for row in rows}

    def user_data_ran(self, machine_id: str) -> None:
        with self.tx() as db:
            db.execute("UPDATE machines SET user_data_pending=0 WHERE id=?", (machine_id,))

    def user_data(self, machine_id: str) -> str:
        """What the machine received, as its metadata service would give it back."""
        row = self.machine(machine_id)
        return (row["user_data"] or "") if row is not None else ""

    def take_bootstrap_token(self, machine_id: str) -> str | None:
        with self.tx() as db:
            row = db.execute("SELECT token FROM bootstrap WHERE machine_id=?", (machine_id,)).fetchone()
            db.execute("DELETE FROM bootstrap WHERE machine_id=?", (machine_id,))
        return row["token"] if row else None

    def actions(self, machine_id: str | None = None) -> list[sqlite3.Row]:
        """Every disruptive action that took effect (reboot, reinstall, delete, gpu_reset,
        driver_reinstall), oldest first: what a soak counts to find an action repeated by a retry."""
        if machine_id is None:
            return self.query("SELECT * FROM actions ORDER BY id")
        return self.query("SELECT * FROM actions WHERE machine_id=? ORDER BY id", machine_id)

    def record_action(self, db: sqlite3.Connection, machine_id: str, op: str, gpu: int | None = None) -> None:
        """Inside the transaction that made the change, so a crash cannot split them."""
        db.execute("INSERT INTO actions(machine_id, gpu, op, at) VALUES (?,?,?,?)", (machine_id, gpu, op, _now()))

    def count_call(self, account: str, op: str) -> None:
        with self.tx() as db:
            db.execute(
                "INSERT INTO calls(account, op, n) VALUES (?, ?, 1)"
                " ON CONFLICT(account, op) DO UPDATE SET n = n + 1",
                (account, op),
            )


def _machine(row: sqlite3.Row, provider: str) -> Machine:
    now = _now()
    if row["deleted_at"] is not None:
        state = "terminated"
    elif row["stopped_at"] is not None:
        state = "stopped"
    elif row["boot_at"] > now:
        state = "pending" if row["reboots"] == 0 and row["reinstalls"] == 0 else "rebooting"
    else:
        state = "running"
    return Machine(
        id=row["id"], name=row["name"], site=row["site"], provider=provider,
        instance_type=row["instance_type"], state=state,
        capacity_type=CapacityType(row["capacity_type"]), created_at=_utc(row["created_at"]),
        # The ownership marker: the fleet creates every machine under an idempotency key;
        # ``add_foreign_machine`` (someone else's) has none.
        owned=row["idempotency_key"] is not None,
    )
