"""The simulated world: providers, machines and GPUs in one SQLite file.

Everything ``gpufleet dev`` and the tests simulate lives in ``<state-dir>/sim.db``
so that the worker, the node-agent host and the CLI (``gpufleet sim ...``) see and
change the same world while the stack runs. ``SimProvider`` is the ``Provider``
for every simulated site; it raises the same taxonomy a real adapter does.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

from fleet.config import Account, FleetConfig, Site
from fleet.errors import BadCredentials, InvalidRequest, NoCapacity, NotFound, OverQuota
from fleet.models import CapacityType, GpuHealth, Machine, MachineSpec, Offer, XidEvent
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
            for table, column, kind in BOOTSTRAP_COLUMNS:
                have = {r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}
                if column not in have:  # a sim.db made before machines got user data
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

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


class SimProvider:
    """``Provider`` for one simulated site: capacity, quota, credentials, latency."""

    def __init__(self, site: Site, account: Account, world: SimWorld) -> None:
        self.site = site
        self.account = account
        self.world = world
        self.name = site.provider

    def _call(self, op: str) -> sqlite3.Row:
        """Count the call, enforce credentials, pay half the API latency on
        the way in (``_respond`` pays the other half on the way out)."""
        self.world.count_call(self.account.name, op)
        row = self.world.site_row(self.site.name)
        if row["api_latency_ms"]:
            time.sleep(row["api_latency_ms"] / 2000)
        valid = self.world.query("SELECT credentials_valid FROM accounts WHERE name=?", self.account.name)
        if not valid or not valid[0][0]:
            raise BadCredentials(
                f"account {self.account.name}: credentials rejected", provider=self.name, code="sim/unauthorized"
            )
        return row

    def create_machine(self, spec: MachineSpec, idempotency_key: str, user_data: str = "") -> Machine:
        site = self._call("create")
        if spec.site != self.site.name:
            raise InvalidRequest(f"spec is for site {spec.site}, provider is {self.site.name}", provider=self.name)
        with self.world.tx() as db:
            existing = db.execute(
                "SELECT * FROM machines WHERE idempotency_key=?", (idempotency_key,)
            ).fetchone()
            if existing:
                return _machine(existing, self.name)
            running = db.execute(
                "SELECT COUNT(*) FROM machines WHERE site=? AND deleted_at IS NULL", (self.site.name,)
            ).fetchone()[0]
            capacity = db.execute("SELECT capacity FROM sites WHERE name=?", (self.site.name,)).fetchone()[0]
            if running >= site["quota"]:
                raise OverQuota(
                    f"{self.site.name}: quota of {site['quota']} machines reached", provider=self.name,
                    code="sim/quota-exceeded",
                )
            if capacity <= 0:
                raise NoCapacity(
                    f"{self.site.name}: no {spec.instance_type} available", provider=self.name,
                    code="sim/insufficient-capacity",
                )
            now = _now()
            machine_id = f"sim-{uuid.uuid4().hex[:12]}"
            db.execute(
                "INSERT INTO machines(id, idempotency_key, name, site, account, instance_type, capacity_type,"
                " gpu, gpus, created_at, boot_at, boot_id, user_data, user_data_pending)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (machine_id, idempotency_key, spec.name, self.site.name, self.account.name, spec.instance_type,
                 spec.capacity_type.value, spec.gpu, spec.gpus, now, now + site["boot_seconds"],
                 uuid.uuid4().hex, user_data or None, int(bool(user_data))),
            )
            db.execute("UPDATE sites SET capacity = capacity - 1 WHERE name=?", (self.site.name,))
            for i in range(spec.gpus):
                db.execute(
                    "INSERT INTO gpus(machine_id, idx, uuid, name, memory_gb) VALUES (?,?,?,?,?)",
                    (machine_id, i, f"GPU-{uuid.uuid4()}", f"NVIDIA {spec.gpu}", self.site.gpu_memory_gb),
                )
            row = db.execute("SELECT * FROM machines WHERE id=?", (machine_id,)).fetchone()
        # The machine exists now even if the caller never hears back.
        time.sleep(site["api_latency_ms"] / 2000)
        return _machine(row, self.name)

    def _live(self, machine_id: str) -> sqlite3.Row:
        row = self.world.machine(machine_id)
        if row is None or row["site"] != self.site.name or row["deleted_at"] is not None:
            raise NotFound(f"machine {machine_id} not found at {self.site.name}", provider=self.name)
        return row

    def delete_machine(self, machine_id: str) -> None:
        self._call("delete")
        with self.world.tx() as db:
            changed = db.execute(
                "UPDATE machines SET deleted_at=? WHERE id=? AND site=? AND deleted_at IS NULL",
                (_now(), machine_id, self.site.name),
            ).rowcount
            if changed:
                db.execute("UPDATE sites SET capacity = capacity + 1 WHERE name=?", (self.site.name,))
                db.execute("DELETE FROM bootstrap WHERE machine_id=?", (machine_id,))
                self.world.record_action(db, machine_id, "delete")

    def get_machine(self, machine_id: str) -> Machine:
        self._call("get")
        return _machine(self._live(machine_id), self.name)

    def list_machines(self) -> list[Machine]:
        self._call("list")
        return [_machine(row, self.name) for row in self.world.machines(self.site.name)]

    def _restart(self, machine_id: str, op: str, rung: str, user_data: str = "") -> None:
        site = self._call(op)
        self._live(machine_id)
        with self.world.tx() as db:
            db.execute(
                f"UPDATE machines SET boot_at=?, boot_id=?, {op}s = {op}s + 1 WHERE id=?",
                (_now() + site["boot_seconds"], uuid.uuid4().hex, machine_id),
            )
            if user_data:  # a fresh install runs its (new) user data on first boot
                db.execute("UPDATE machines SET user_data=?, user_data_pending=1 WHERE id=?", (user_data, machine_id))
            self.world.record_action(db, machine_id, op)
        self.world.clear_faults(machine_id, rung)

    def reboot_machine(self, machine_id: str) -> None:
        self._restart(machine_id, "reboot", "reboot")

    def reinstall_machine(self, machine_id: str, user_data: str = "") -> None:
        self._restart(machine_id, "reinstall", "reinstall", user_data)

    def list_offers(self) -> list[Offer]:
        site = self._call("offers")
        return [
            Offer(
                site=self.site.name, provider=self.name, instance_type=self.site.instance_type,
                gpu=self.site.gpu, gpus=self.site.gpus_per_machine, gpu_memory_gb=self.site.gpu_memory_gb,
                price_per_gpu_hour=self.site.price_per_gpu_hour, capacity_type=self.site.capacity_type,
                interruption_risk=site["interruption_risk"], available=site["capacity"] > 0,
                region=self.site.region,
            )
        ]


class SimGpuBackend:
    """A simulated machine's GPUs as its node agent sees them."""

    def __init__(self, world: SimWorld, machine_id: str) -> None:
        self.world = world
        self.machine_id = machine_id

    def boot_id(self) -> str:
        row = self.world.machine(self.machine_id)
        return row["boot_id"] if row else ""

    def probe(self) -> list[GpuHealth]:
        return self.world.gpu_health(self.machine_id)

    def compute_check(self, index: int) -> str | None:
        return None if self.world.compute_ok(self.machine_id, index) else f"GPU {index}: compute check produced wrong results"

    def reset_gpu(self, index: int) -> str:
        """``nvidia-smi -r -i N``, simulated: refused while processes hold the GPU."""
        if self.world.gpu_held(self.machine_id, index):
            raise RuntimeError(f"GPU {index}: reset refused, processes still hold the GPU")
        cleared = self.world.clear_faults(self.machine_id, "reset", index)
        with self.world.tx() as db:
            self.world.record_action(db, self.machine_id, "gpu_reset", index)
        return f"GPU {index} reset ({cleared} simulated faults cleared)"

    def reinstall_driver(self) -> str:
        """Driver reinstall, simulated: clears what a reinstall clears, boot id unchanged."""
        cleared = self.world.clear_faults(self.machine_id, "reinstall")
        with self.world.tx() as db:
            self.world.record_action(db, self.machine_id, "driver_reinstall")
        return f"driver reinstalled ({cleared} simulated faults cleared)"
