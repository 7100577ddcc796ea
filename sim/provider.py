"""``SimProvider``: the ``Provider`` for every simulated site. It buys, lists, restarts and
deletes machines in the simulated world (``sim/world.py``) with the site's capacity, quota,
credentials and API latency, and raises the same taxonomy a real adapter does."""

from __future__ import annotations

import sqlite3
import time
import uuid

from fleet.config import Account, Site
from fleet.errors import BadCredentials, InvalidRequest, NoCapacity, NotFound, OverQuota
from fleet.models import Machine, MachineSpec, Offer
from sim.world import SimWorld, _machine, _now


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
        return [self.site.offer(self.name, interruption_risk=site["interruption_risk"],
                                available=site["capacity"] > 0)]
