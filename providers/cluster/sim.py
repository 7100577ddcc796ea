"""The simulated cluster: nodes, labels, taints and join tokens in ``sim.db``.

The machine's half of joining (reading the bootstrap token and registering,
which kubelet does for real) is ``register_with_token``, called by the
simulated node host.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import string
import time

from fleet.models import Node
from providers.cluster.base import JoinTokenRef
from providers.sim import SimWorld, _utc


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _taint_key(taint: str) -> str:
    """``key[=value]:Effect`` → ``key:Effect`` (what identifies a taint)."""
    key_value, _, effect = taint.partition(":")
    return f"{key_value.split('=')[0]}:{effect}"


class JoinRejected(Exception):
    pass


class SimCluster:
    def __init__(self, world: SimWorld) -> None:
        self.world = world

    # -- join tokens ------------------------------------------------------------------
    def create_join_token(self, node_name: str, machine_id: str, ttl_seconds: int) -> JoinTokenRef:
        if not 0 < ttl_seconds <= 3600:
            raise ValueError("join token TTL must be within (0, 3600] seconds")
        # Same shape as a Kubernetes bootstrap token: [a-z0-9]{6}.[a-z0-9]{16}
        alphabet = string.ascii_lowercase + string.digits
        token_id = "".join(secrets.choice(alphabet) for _ in range(6))
        secret = "".join(secrets.choice(alphabet) for _ in range(16))
        expires = time.time() + ttl_seconds
        with self.world.tx() as db:
            db.execute(
                "INSERT INTO join_tokens(id, secret_sha256, node_name, machine_id, expires_at) VALUES (?,?,?,?,?)",
                (token_id, _hash(secret), node_name, machine_id, expires),
            )
            # The machine's bootstrap channel: what user-data / a metadata fetch gives it.
            db.execute(
                "INSERT OR REPLACE INTO bootstrap(machine_id, token) VALUES (?, ?)",
                (machine_id, f"{token_id}.{secret}"),
            )
        return JoinTokenRef(token_id=token_id, node_name=node_name, expires_at=_utc(expires))

    def revoke_join_token(self, token_id: str) -> None:
        with self.world.tx() as db:
            row = db.execute("SELECT machine_id FROM join_tokens WHERE id=?", (token_id,)).fetchone()
            db.execute("DELETE FROM join_tokens WHERE id=?", (token_id,))
            if row:
                db.execute("DELETE FROM bootstrap WHERE machine_id=? AND token LIKE ?", (row[0], f"{token_id}.%"))

    def register_with_token(self, machine_id: str, token: str, boot_id: str, gpus: int) -> Node:
        """Kubelet's TLS bootstrap, simulated: the token is single-use and expires."""
        token_id, _, secret = token.partition(".")
        with self.world.tx() as db:
            row = db.execute("SELECT * FROM join_tokens WHERE id=?", (token_id,)).fetchone()
            if row is None or not hmac.compare_digest(row["secret_sha256"], _hash(secret)):
                raise JoinRejected("unknown join token")
            if row["used_at"] is not None:
                raise JoinRejected("join token already used")
            if row["expires_at"] < time.time():
                raise JoinRejected("join token expired")
            if row["machine_id"] != machine_id:
                raise JoinRejected("join token belongs to another machine")
            now = time.time()
            db.execute("UPDATE join_tokens SET used_at=? WHERE id=?", (now, token_id))
            name = row["node_name"]
            db.execute(
                "INSERT OR REPLACE INTO nodes(name, machine_id, labels, taints, unschedulable, ready, boot_id,"
                " gpus, registered_at) VALUES (?,?,?,?,0,1,?,?,?)",
                (name, machine_id, json.dumps({"kubernetes.io/hostname": name}), "[]", boot_id, gpus, now),
            )
        return self.get_node(name)

    def set_node_status(self, name: str, *, ready: bool, boot_id: str | None = None) -> None:
        """Kubelet's heartbeat, simulated."""
        with self.world.tx() as db:
            db.execute("UPDATE nodes SET ready=? WHERE name=?", (int(ready), name))
            if boot_id:
                db.execute("UPDATE nodes SET boot_id=? WHERE name=?", (boot_id, name))

    # -- nodes ------------------------------------------------------------------------
    def _node(self, row) -> Node:
        labels = json.loads(row["labels"])
        return Node(
            name=row["name"], machine_id=row["machine_id"], labels=labels, taints=json.loads(row["taints"]),
            ready=bool(row["ready"]), unschedulable=bool(row["unschedulable"]), boot_id=row["boot_id"] or "",
            gpus_allocatable=row["gpus"] or 0, registered_at=_utc(row["registered_at"]),
            site=labels.get("gpufleet.io/site", ""), provider=labels.get("gpufleet.io/provider", ""),
        )

    def get_node(self, name: str) -> Node | None:
        rows = self.world.query("SELECT * FROM nodes WHERE name=?", name)
        return self._node(rows[0]) if rows else None

    def list_nodes(self, selector: dict[str, str] | None = None) -> list[Node]:
        nodes = [self._node(r) for r in self.world.query("SELECT * FROM nodes ORDER BY name")]
        if selector:
            nodes = [n for n in nodes if all(n.labels.get(k) == v for k, v in selector.items())]
        return nodes

    def _update(self, name: str, column: str, change) -> Node:
        with self.world.tx() as db:
            row = db.execute(f"SELECT {column} FROM nodes WHERE name=?", (name,)).fetchone()
            if row is None:
                raise LookupError(f"node {name} not found")
            db.execute(f"UPDATE nodes SET {column}=? WHERE name=?", (change(row[0]), name))
        return self.get_node(name)

    def label_node(self, name: str, labels: dict[str, str]) -> Node:
        return self._update(name, "labels", lambda old: json.dumps({**json.loads(old), **labels}))

    def set_taints(self, name: str, add: list[str] = (), remove: list[str] = ()) -> Node:
        def change(old: str) -> str:
            drop = {_taint_key(t) for t in [*add, *remove]}
            kept = [t for t in json.loads(old) if _taint_key(t) not in drop]
            return json.dumps(kept + list(add))

        return self._update(name, "taints", change)

    def cordon(self, name: str, unschedulable: bool = True) -> Node:
        return self._update(name, "unschedulable", lambda _old: int(unschedulable))

    def remove_node(self, name: str) -> None:
        with self.world.tx() as db:
            db.execute("DELETE FROM nodes WHERE name=?", (name,))
