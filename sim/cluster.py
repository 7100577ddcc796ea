"""The simulated cluster: nodes, labels, taints and join tokens in ``sim.db``.

The machine's half of joining (reading the bootstrap token and registering,
which kubelet does for real) is ``register_with_token``, called by the
simulated node host.

Pods, PodDisruptionBudgets, serving Deployments and the routing table live in
the tables created below. The simulated scheduler for serving is ``_roll_out``: a
site's serving Deployments, the oldest first, take the GPUs of its ready,
schedulable, untainted nodes that its other pods leave; an update is instant once
it can start (a surge replica's GPUs to spare, or replacing one at a time).
``add_pod``/``set_pdb``/``delete_pod`` are the test- and CLI-facing knobs that
mirror what the tests' fake API server offers.

A serving Deployment's replicas are also pods on nodes (``serving_pods``, ``_run_serving``),
for what a drain meets: it evicts them under the Deployment's PodDisruptionBudget, as on a
real cluster (``_evict_replica``). They are a drain's business only: the demand loop's GPU
pods (``list_gpu_pods``) and the serving status do not read them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid
from collections import defaultdict
from typing import NamedTuple

from fleet.models import Node
from providers.cluster.base import (
    CsrDecision,
    format_taint,
    EvictOutcome,
    NodeChanged,
    NodeMarks,
    NodeNotFound,
    NoPreviousTemplate,
    OpenCsr,
    PodInfo,
    ServingNotFound,
    StateChange,
    WeightedRouting,
    apply_taints,
    check_state_data,
    EvictionDrain,
    poll_watch,
    selector_matches,
    gpus_held_by_pods,
    serving_capacity,
    serving_name,
    takes_serving,
)
from fleet.cluster import (
    ANNOTATION_CORDONED_BY,
    LABEL_PROVIDER,
    LABEL_SITE,
    NODE_IDENTITY_KIND,
    NODE_KEYS_KIND,
    NodeIdentity,
    with_key,
    JoinTokenRef,
    RoutingTable,
    ServingSpec,
    SITE_ROUTES,
    ServingStatus,
    SiteRoute,
    template_fingerprint,
)
from fleet.demand import GpuPod, Toleration, fits
from providers.cluster.bootstrap import (
    BootstrapToken, check_join_ttl, join_token, kubelet_args, new_token_parts, read_join_configuration,
)
from sim.world import SimWorld, _utc


def _valid_token(db, token: str, now: float):
    """The join token's row, when ``token`` is one that may still authenticate (known, its
    secret matches, unused, unexpired); what it is bound to, each caller checks."""
    token_id, _, secret = token.partition(".")
    row = db.execute("SELECT * FROM join_tokens WHERE id=?", (token_id,)).fetchone()
    if row is None or not hmac.compare_digest(row["secret_sha256"], _hash(secret)):
        raise JoinRejected("unknown join token")
    if row["used_at"] is not None:
        raise JoinRejected("join token already used")
    if row["expires_at"] < now:
        raise JoinRejected("join token expired")
    return row


def _pods_template(row, template: str) -> str | None:
    """What a serving row's pods run once its template is ``template``: the template they ran
    before it while they still do (an update waiting for room), None when they run it."""
    running = row["pods_template"] or row["template"]
    return None if running == template else running


def _without_surge(template: str | None) -> str | None:
    return template and json.dumps({k: v for k, v in json.loads(template).items() if k != "max_surge"}, sort_keys=True)


def _registration_taints(config: dict) -> list[str]:
    """``nodeRegistration.taints`` as the kubelet registers them."""
    taints = (config.get("nodeRegistration") or {}).get("taints") or []
    return [format_taint(t["key"], t.get("value"), t["effect"]) for t in taints if "key" in t and "effect" in t]

CLUSTER_SCHEMA = """
CREATE TABLE IF NOT EXISTS node_annotations (
    name TEXT PRIMARY KEY, annotations TEXT
);
CREATE TABLE IF NOT EXISTS pods (
    namespace TEXT, name TEXT, node TEXT, labels TEXT, owner_kind TEXT,
    mirror INTEGER DEFAULT 0, phase TEXT DEFAULT 'Running',
    PRIMARY KEY (namespace, name)
);
CREATE TABLE IF NOT EXISTS pdbs (
    namespace TEXT, name TEXT, selector TEXT, min_available INTEGER, max_unavailable INTEGER,
    PRIMARY KEY (namespace, name)
);
CREATE TABLE IF NOT EXISTS serving (
    model TEXT, site TEXT, name TEXT, template TEXT, previous_template TEXT,
    replicas INTEGER, generation INTEGER, max_surge INTEGER DEFAULT 1, pods_template TEXT,
    PRIMARY KEY (model, site)
);
CREATE TABLE IF NOT EXISTS serving_pods (
    id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT UNIQUE, model TEXT, site TEXT, node TEXT
);
CREATE TABLE IF NOT EXISTS routing (
    model TEXT PRIMARY KEY, version INTEGER, sites TEXT
);
CREATE TABLE IF NOT EXISTS control_state (
    kind TEXT, key TEXT, data TEXT, version INTEGER,
    PRIMARY KEY (kind, key)
);
"""

#: A pod's spec, as far as the simulated scheduler and the demand loop read it.
POD_SPEC_COLUMNS = (
    ("gpus", "INTEGER DEFAULT 0"), ("node_selector", "TEXT DEFAULT '{}'"), ("tolerations", "TEXT DEFAULT '[]'"),
    ("annotations", "TEXT DEFAULT '{}'"), ("nominated", "TEXT DEFAULT ''"), ("unschedulable", "INTEGER DEFAULT 0"),
    ("created_at", "REAL DEFAULT 0"),
)

#: What the Eviction API answers when a PodDisruptionBudget refuses (HTTP 429).
PDB_REFUSAL = "The disruption budget {pdb} needs {need} healthy pods and has {have} currently"
#: The namespace of the serving replicas' pods (the Kubernetes adapter's default).
SERVING_NAMESPACE = "gpufleet"


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


#: A node's row and its annotations in one read (one statement: one snapshot of both).
_NODE_AND_MARKS = ("SELECT n.*, a.annotations AS annotations FROM nodes n "
                   "LEFT JOIN node_annotations a ON a.name = n.name WHERE n.name=?")


def _node_and_marks(rows: list, name: str) -> tuple[dict, dict[str, str]]:
    """``_NODE_AND_MARKS``'s answer: the node's row and its annotations. Raises ``NodeNotFound``."""
    if not rows:
        raise NodeNotFound(f"node {name} not found", provider="sim", code="404")
    row = dict(zip(rows[0].keys(), rows[0]))
    return row, json.loads(row["annotations"] or "{}")


def _version(row: dict) -> str:
    """The simulated node's resourceVersion: a digest of it as stored, annotations and all, so that
    any write to it changes it. (A change undone since reads as none: for a write decided on what
    was read, that is the same node.)"""
    return hashlib.sha256(json.dumps(row, sort_keys=True).encode()).hexdigest()[:16]


def _unchanged_since(name: str, row: dict, version: str | None) -> None:
    """A write made on the node as read at ``version`` (any, when None) finds it so, or is refused."""
    if version is not None and version != _version(row):
        raise NodeChanged(f"node {name} changed since it was read: nothing written", code="409")


class KubeletView(NamedTuple):
    name: str
    ready: bool
    boot_id: str


class JoinRejected(Exception):
    pass


class SimCluster(EvictionDrain, WeightedRouting):
    def __init__(self, world: SimWorld) -> None:
        self.world = world
        with self.world.tx() as db:
            db.executescript(CLUSTER_SCHEMA)
            # A sim.db made before pods had specs gains the columns (the demand loop's pods).
            have = {r[1] for r in db.execute("PRAGMA table_info(pods)").fetchall()}
            for column, kind in POD_SPEC_COLUMNS:
                if column not in have:
                    db.execute(f"ALTER TABLE pods ADD COLUMN {column} {kind}")
            if "max_surge" not in {r[1] for r in db.execute("PRAGMA table_info(serving)").fetchall()}:
                # One made before the rolling update was simulated: the strategy leaves the templates.
                db.execute("ALTER TABLE serving ADD COLUMN max_surge INTEGER DEFAULT 1")
                db.execute("ALTER TABLE serving ADD COLUMN pods_template TEXT")
                for row in db.execute("SELECT rowid, template, previous_template FROM serving").fetchall():
                    db.execute("UPDATE serving SET template=?, previous_template=? WHERE rowid=?",
                               (_without_surge(row[1]), _without_surge(row[2]), row[0]))

    # -- join tokens ------------------------------------------------------------------
    def create_join_token(self, node_name: str, machine_id: str, ttl_seconds: int) -> JoinTokenRef:
        check_join_ttl(ttl_seconds)
        token_id, secret = new_token_parts()  # the shape of a Kubernetes bootstrap token
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
        token_id = token.partition(".")[0]
        with self.world.tx() as db:
            row = _valid_token(db, token, time.time())
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

    # -- bootstrap through user data -----------------------------------------------------
    #: What the simulated machines "discover": no real API server stands behind it.
    SIM_ENDPOINT = "sim.gpufleet.invalid:6443"
    #: The sim's "cluster CA": nothing checks it (no TLS in the sim), but it has a CA's shape.
    SIM_CA_DATA = base64.b64encode(b"-----BEGIN CERTIFICATE-----\ngpufleet simulated cluster CA\n"
                                   b"-----END CERTIFICATE-----\n").decode()

    def issue_bootstrap_token(self, node_name: str, join_key: str, ttl_seconds: int) -> BootstrapToken:
        check_join_ttl(ttl_seconds)
        now = time.time()
        with self.world.tx() as db:
            row = db.execute(
                "SELECT * FROM join_tokens WHERE join_key=? AND node_name=? AND used_at IS NULL AND expires_at>?"
                " ORDER BY expires_at DESC", (join_key, node_name, now + 60)).fetchone()
            if row is not None and row["token"]:
                token_id, _, secret = row["token"].partition(".")
                return BootstrapToken(token_id=token_id, node_name=node_name, expires_at=_utc(row["expires_at"]),
                                      secret=secret)
            token_id, secret = new_token_parts()
            expires = float(int(now) + ttl_seconds)
            # Kept whole, as a bootstrap token Secret keeps it: a retried join re-renders the same user data.
            db.execute(
                "INSERT INTO join_tokens(id, secret_sha256, node_name, machine_id, expires_at, join_key, token)"
                " VALUES (?,?,?,?,?,?,?)", (token_id, _hash(secret), node_name, "", expires, join_key,
                                            f"{token_id}.{secret}"))
        return BootstrapToken(token_id=token_id, node_name=node_name, expires_at=_utc(expires), secret=secret)

    def revoke_node_tokens(self, node_name: str) -> list[str]:
        with self.world.tx() as db:
            ids = [r[0] for r in db.execute("SELECT id FROM join_tokens WHERE node_name=?", (node_name,))]
            db.execute("DELETE FROM join_tokens WHERE node_name=?", (node_name,))
        return ids

    def bootstrap_endpoint(self) -> tuple[str, str]:
        return self.SIM_ENDPOINT, self.SIM_CA_DATA

    def review_csrs(self, addresses) -> list[CsrDecision]:
        """The sim has no CSRs: ``register_from_user_data`` binds the token to its node itself."""
        return []

    def node_identity(self, name: str) -> NodeIdentity | None:
        return NodeIdentity.from_state(self.read_state(NODE_IDENTITY_KIND, name)) if name else None

    def bind_client_key(self, node_name: str, machine_id: str, fingerprint: str) -> bool:
        """The sim's CSR approver, for the key a machine's agent certificate is signed for:
        bound to the node only while that machine's kubelet holds the node (it registered
        with the token issued for the name), as gpufleet's approver binds a kubelet's key
        only for the node its bootstrap token was issued for (or its own renewal)."""
        with self.world.tx() as db:
            row = db.execute("SELECT machine_id FROM nodes WHERE name=?", (node_name,)).fetchone()
            if row is None or row["machine_id"] != machine_id:
                return False
            found = db.execute("SELECT data, version FROM control_state WHERE kind=? AND key=?",
                               (NODE_KEYS_KIND, node_name)).fetchone()
            data = with_key(json.loads(found["data"]) if found else {}, fingerprint)
            db.execute("INSERT OR REPLACE INTO control_state(kind, key, data, version) VALUES (?,?,?,?)",
                       (NODE_KEYS_KIND, node_name, json.dumps(data, sort_keys=True),
                        (found["version"] if found else 0) + 1))
        return True

    def register_from_user_data(self, machine_id: str, user_data: str, boot_id: str, gpus: int) -> Node:
        """The machine's side, from nothing but its user data: kubeadm reads the
        JoinConfiguration, authenticates with the token, gets a certificate only for the
        node name the token was issued for, and the kubelet registers (or, reinstalled,
        re-registers) that Node with its providerID. A used or expired token fails."""
        config = read_join_configuration(user_data)
        token = join_token(config)
        name = (config.get("nodeRegistration") or {}).get("name", "")
        provider_id = kubelet_args(config).get("provider-id", "")
        token_id = token.partition(".")[0]
        now = time.time()
        with self.world.tx() as db:
            row = _valid_token(db, token, now)
            if row["node_name"] != name:
                raise JoinRejected(f"certificate for node {name} denied: the token was issued for {row['node_name']}")
            db.execute("UPDATE join_tokens SET used_at=? WHERE id=?", (now, token_id))
            if db.execute("SELECT 1 FROM nodes WHERE name=?", (name,)).fetchone():
                # The Node is still there (a reinstall): the kubelet takes it over, keeping labels and taints.
                db.execute("UPDATE nodes SET machine_id=?, ready=1, boot_id=?, gpus=?, provider_id=? WHERE name=?",
                           (machine_id, boot_id, gpus, provider_id, name))
            else:
                db.execute(
                    "INSERT INTO nodes(name, machine_id, labels, taints, unschedulable, ready, boot_id, gpus,"
                    " registered_at, provider_id) VALUES (?,?,?,?,0,1,?,?,?,?)",
                    (name, machine_id, json.dumps({"kubernetes.io/hostname": name}),
                     json.dumps(_registration_taints(config)), boot_id, gpus, now, provider_id),
                )
        return self.get_node(name)

    def set_node_status(self, name: str, *, ready: bool, boot_id: str | None = None) -> None:
        """Kubelet's heartbeat, simulated."""
        with self.world.tx() as db:
            db.execute("UPDATE nodes SET ready=? WHERE name=?", (int(ready), name))
            if boot_id:
                db.execute("UPDATE nodes SET boot_id=? WHERE name=?", (boot_id, name))

    # -- control-plane state ---------------------------------------------------------------
    # One SQLite write transaction is the compare-and-swap: a second writer waits for the
    # first and then reads what it wrote, as the adapter's re-read after a 409 does.
    def read_state(self, kind: str, key: str) -> dict[str, str]:
        rows = self.world.query("SELECT data FROM control_state WHERE kind=? AND key=?", kind, key)
        return json.loads(rows[0]["data"]) if rows else {}

    def update_state(self, kind: str, key: str, change: StateChange) -> dict[str, str]:
        with self.world.tx() as db:
            row = db.execute("SELECT data, version FROM control_state WHERE kind=? AND key=?", (kind, key)).fetchone()
            data = json.loads(row["data"]) if row else {}
            wanted = change(dict(data))
            if wanted is None or (row is not None and wanted == data):
                return data
            check_state_data(wanted)
            db.execute(
                "INSERT OR REPLACE INTO control_state(kind, key, data, version) VALUES (?,?,?,?)",
                (kind, key, json.dumps(wanted, sort_keys=True), (row["version"] if row else 0) + 1),
            )
            return wanted

    def list_state(self, kind: str) -> dict[str, dict[str, str]]:
        rows = self.world.query("SELECT key, data FROM control_state WHERE kind=? ORDER BY key", kind)
        return {r["key"]: json.loads(r["data"]) for r in rows}

    def delete_state(self, kind: str, key: str, only_if: dict[str, str] | None = None) -> bool:
        with self.world.tx() as db:
            row = db.execute("SELECT data FROM control_state WHERE kind=? AND key=?", (kind, key)).fetchone()
            if row is None or (only_if is not None and json.loads(row["data"]) != only_if):
                return False
            db.execute("DELETE FROM control_state WHERE kind=? AND key=?", (kind, key))
            return True

    # -- backup (cli/backup.py) ---------------------------------------------------------------
    def state_origin(self) -> dict[str, str]:
        return {"cluster": "sim", "database": str(self.world.path.resolve())}

    def state_kinds(self) -> list[str]:
        return [r["kind"] for r in self.world.query("SELECT DISTINCT kind FROM control_state ORDER BY kind")]

    # -- nodes ------------------------------------------------------------------------
    def _node(self, row, identity: NodeIdentity | None = None) -> Node:
        labels = json.loads(row["labels"])
        node = Node(
            name=row["name"], machine_id=row["machine_id"], labels=labels, taints=json.loads(row["taints"]),
            ready=bool(row["ready"]), ready_changed_at=_utc(row["ready_changed_at"]),
            unschedulable=bool(row["unschedulable"]), boot_id=row["boot_id"] or "",
            gpus_allocatable=row["gpus"] or 0, registered_at=_utc(row["registered_at"]),
            site=labels.get(LABEL_SITE, ""), provider=labels.get(LABEL_PROVIDER, ""),
            provider_id=row["provider_id"] or "",
        )
        if identity is None:
            return node
        # What the join recorded, not what the node says of itself.
        return node.model_copy(update={"machine_id": identity.machine_id, "provider": identity.provider,
                                       "account": identity.account, "site": identity.site})

    def get_node(self, name: str) -> Node | None:
        rows = self.world.query("SELECT * FROM nodes WHERE name=?", name)
        return self._node(rows[0], self.node_identity(name)) if rows else None

    def kubelet_view(self) -> dict[str, KubeletView]:
        """machine id → what each node's kubelet knows of itself (cheaper than list_nodes)."""
        rows = self.world.query("SELECT machine_id, name, ready, boot_id FROM nodes")
        return {r["machine_id"]: KubeletView(r["name"], bool(r["ready"]), r["boot_id"] or "") for r in rows}

    def list_nodes(self, selector: dict[str, str] | None = None) -> list[Node]:
        # The selector is applied where the rows are, as an API server applies a label selector:
        # a site's Site entity lists its own nodes often, and reading a whole fleet's to keep a
        # tenth of them cost the control-plane worker a third of its CPU at 1,250 nodes.
        where, args = [], []
        for key, value in (selector or {}).items():
            if '"' in key:  # no label key has one (nor could a JSON path name it)
                return []
            where.append("json_extract(labels, ?) = ?")
            args += [f'$."{key}"', value]
        rows = self.world.query("SELECT * FROM nodes" + (" WHERE " + " AND ".join(where) if where else "")
                                + " ORDER BY name", *args)
        if selector:
            names = [r["name"] for r in rows]
            identities = {r["key"]: json.loads(r["data"]) for r in self.world.query(
                f"SELECT key, data FROM control_state WHERE kind=? AND key IN ({','.join('?' * len(names))})",
                NODE_IDENTITY_KIND, *names)} if names else {}
        else:
            identities = self.list_state(NODE_IDENTITY_KIND)
        return [self._node(r, NodeIdentity.from_state(identities.get(r["name"], {}))) for r in rows]

    # -- watches (the sim has none: its tables are looked at, ``poll_watch``) ------------------
    def _nodes_matching(self, selector: dict[str, str] | None) -> list[Node]:
        """``list_nodes`` without the identity records, as a watch's objects come."""
        where, args = [], []
        for key, value in (selector or {}).items():
            if '"' in key:
                return []
            where.append("json_extract(labels, ?) = ?")
            args += [f'$."{key}"', value]
        rows = self.world.query("SELECT * FROM nodes" + (" WHERE " + " AND ".join(where) if where else "")
                                + " ORDER BY name", *args)
        return [self._node(r) for r in rows]

    def watch_nodes(self, selector, until, timeout_s, recheck_s=30.0, heartbeat=None, poll_s=1.0) -> list[Node]:
        return poll_watch(lambda: self._nodes_matching(selector), until, timeout_s, recheck_s, heartbeat, poll_s)

    def watch_gpu_pods(self, until, timeout_s, recheck_s=30.0, heartbeat=None, poll_s=0.2,
                       wake_at=None) -> list[GpuPod]:
        return poll_watch(self.list_gpu_pods, until, timeout_s, recheck_s, heartbeat, poll_s, wake_at=wake_at)

    def watch_open_csrs(self, until, timeout_s, recheck_s=30.0, heartbeat=None) -> list[OpenCsr]:
        # No CSRs in the sim (``review_csrs``): nothing ever changes, so look seldom.
        return poll_watch(lambda: [], until, timeout_s, recheck_s, heartbeat, poll_s=min(recheck_s, 1.0))

    def _update(self, name: str, column: str, change) -> Node:
        with self.world.tx() as db:
            row = db.execute(f"SELECT {column} FROM nodes WHERE name=?", (name,)).fetchone()
            if row is None:
                raise NodeNotFound(f"node {name} not found", provider="sim", code="404")
            db.execute(f"UPDATE nodes SET {column}=? WHERE name=?", (change(row[0]), name))
        return self.get_node(name)

    def label_node(self, name: str, labels: dict[str, str]) -> Node:
        def change(old: str) -> str:
            merged = {**json.loads(old), **labels}
            return json.dumps({k: v for k, v in merged.items() if v is not None})

        return self._update(name, "labels", change)

    def set_taints(self, name: str, add: list[str] = (), remove: list[str] = ()) -> Node:
        return self._update(name, "taints", lambda old: json.dumps(apply_taints(json.loads(old), add, remove)))

    def cordon(self, name: str, unschedulable: bool = True, *, by: str | None = None,
               version: str | None = None) -> Node:
        with self.world.tx() as db:  # the cordon and its mark land together, on the version read
            row, annotations = _node_and_marks(db.execute(_NODE_AND_MARKS, (name,)).fetchall(), name)
            _unchanged_since(name, row, version)
            if not unschedulable:
                annotations.pop(ANNOTATION_CORDONED_BY, None)
            elif by:
                annotations[ANNOTATION_CORDONED_BY] = by
            db.execute("UPDATE nodes SET unschedulable=? WHERE name=?", (int(unschedulable), name))
            db.execute("INSERT OR REPLACE INTO node_annotations(name, annotations) VALUES (?, ?)",
                       (name, json.dumps(annotations)))
        return self.get_node(name)

    def node_marks(self, name: str) -> NodeMarks:
        row, annotations = _node_and_marks(self.world.query(_NODE_AND_MARKS, name), name)
        return NodeMarks(annotations=annotations, unschedulable=bool(row["unschedulable"]), version=_version(row))

    def remove_node(self, name: str) -> None:
        with self.world.tx() as db:
            db.execute("DELETE FROM nodes WHERE name=?", (name,))
            db.execute("DELETE FROM node_annotations WHERE name=?", (name,))
            db.execute("DELETE FROM control_state WHERE kind IN (?,?) AND key=?",
                       (NODE_IDENTITY_KIND, NODE_KEYS_KIND, name))

    def annotate_node(self, name: str, annotations: dict[str, str | None], *,
                      version: str | None = None) -> dict[str, str]:
        with self.world.tx() as db:
            row, current = _node_and_marks(db.execute(_NODE_AND_MARKS, (name,)).fetchall(), name)
            _unchanged_since(name, row, version)
            for key, value in annotations.items():
                if value is None:
                    current.pop(key, None)
                else:
                    current[key] = value
            db.execute(
                "INSERT OR REPLACE INTO node_annotations(name, annotations) VALUES (?, ?)", (name, json.dumps(current))
            )
        return current

    # -- pods and PodDisruptionBudgets (what workloads put on nodes) ----------------------
    def add_pod(
        self,
        node: str,
        name: str,
        namespace: str = "default",
        labels: dict[str, str] | None = None,
        owner_kind: str = "ReplicaSet",
        mirror: bool = False,
        phase: str = "Running",
    ) -> None:
        """Test/CLI knob: a pod bound to ``node`` (``owner_kind`` "DaemonSet" is left
        alone by drains, as are ``mirror`` pods)."""
        with self.world.tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO pods(namespace, name, node, labels, owner_kind, mirror, phase)"
                " VALUES (?,?,?,?,?,?,?)",
                (namespace, name, node, json.dumps(labels or {}), owner_kind, int(mirror), phase),
            )

    def create_pod(self, pod: GpuPod) -> GpuPod:
        """Test/CLI knob: a pod with GPU requests, node selector and tolerations; Pending
        unless ``pod.node`` binds it. The scheduler (``schedule``) places it."""
        with self.world.tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO pods(namespace, name, node, labels, owner_kind, mirror, phase, gpus,"
                " node_selector, tolerations, annotations, nominated, unschedulable, created_at)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,0,?)",
                (pod.namespace, pod.name, pod.node or None, json.dumps(pod.labels),
                 pod.owner_kinds[0] if pod.owner_kinds else "ReplicaSet", int(pod.mirror),
                 pod.phase if pod.node else "Pending",
                 pod.gpus, json.dumps(pod.node_selector), json.dumps([t.model_dump() for t in pod.tolerations]),
                 json.dumps(pod.annotations), pod.nominated_node, pod.created_at or time.time()),
            )
        return pod

    def _gpu_pod(self, row) -> GpuPod:
        return GpuPod(
            namespace=row["namespace"], name=row["name"], uid=f"{row['namespace']}/{row['name']}",
            node=row["node"] or "", phase=row["phase"], gpus=row["gpus"] or 0, labels=json.loads(row["labels"] or "{}"),
            annotations=json.loads(row["annotations"] or "{}"), node_selector=json.loads(row["node_selector"] or "{}"),
            tolerations=[Toleration(**t) for t in json.loads(row["tolerations"] or "[]")],
            nominated_node=row["nominated"] or "", unschedulable=bool(row["unschedulable"]),
            owner_kinds=[row["owner_kind"]] if row["owner_kind"] else [], created_at=row["created_at"] or 0.0,
            mirror=bool(row["mirror"]),
        )

    def schedule(self) -> list[tuple[str, str]]:
        """The simulated kube-scheduler, one pass: each Pending pod (oldest first) is bound to
        the first ready, schedulable node whose labels match its node selector, whose
        NoSchedule/NoExecute taints it tolerates and that has its GPUs free (its nominated
        node first); one that fits nowhere is marked unschedulable. Pods bound to a node that
        is gone are deleted (the pod garbage collector). Returns (pod, node) bindings."""
        bound: list[tuple[str, str]] = []
        with self.world.tx() as db:
            nodes = [self._node(r) for r in db.execute("SELECT * FROM nodes ORDER BY name").fetchall()]
            names = {n.name for n in nodes}
            rows = db.execute("SELECT * FROM pods ORDER BY created_at, namespace, name").fetchall()
            used: dict[str, int] = {}
            for row in rows:
                if row["node"] and row["node"] not in names:
                    db.execute("DELETE FROM pods WHERE namespace=? AND name=?", (row["namespace"], row["name"]))
                elif row["node"] and row["phase"] not in ("Succeeded", "Failed"):
                    used[row["node"]] = used.get(row["node"], 0) + (row["gpus"] or 0)
            for row in rows:
                if row["node"] or row["phase"] != "Pending":
                    continue
                pod = self._gpu_pod(row)
                order = sorted(nodes, key=lambda n: n.name != pod.nominated_node)
                target = next((n for n in order if n.ready and not n.unschedulable
                               and fits(pod, n.labels, n.taints, n.gpus_allocatable - used.get(n.name, 0))), None)
                if target is None:
                    db.execute("UPDATE pods SET unschedulable=1 WHERE namespace=? AND name=?",
                               (pod.namespace, pod.name))
                    continue
                used[target.name] = used.get(target.name, 0) + pod.gpus
                db.execute("UPDATE pods SET node=?, phase='Running', unschedulable=0, nominated='' "
                           "WHERE namespace=? AND name=?", (target.name, pod.namespace, pod.name))
                bound.append((pod.key, target.name))
        return bound

    def list_gpu_pods(self, pending_only: bool = False) -> list[GpuPod]:
        self.schedule()
        sql = "SELECT * FROM pods WHERE gpus > 0" + (" AND phase='Pending' AND node IS NULL" if pending_only else "")
        return [self._gpu_pod(r) for r in self.world.query(sql + " ORDER BY namespace, name")]

    def delete_pod(self, namespace: str, name: str) -> bool:
        with self.world.tx() as db:
            return db.execute("DELETE FROM pods WHERE namespace=? AND name=?", (namespace, name)).rowcount > 0

    def pods(self, node: str | None = None) -> list[PodInfo]:
        """The pods on ``node`` (every pod without one), the serving replicas' among them."""
        where, args = ("", []) if node is None else (" WHERE node=?", [node])
        with self.world.tx() as db:
            self._run_serving(db, self._site_of(db, node) if node is not None else None)
            found = [
                PodInfo(namespace=r["namespace"], name=r["name"], mirror=bool(r["mirror"]),
                        owner_kinds=[r["owner_kind"]] if r["owner_kind"] else [])
                for r in db.execute("SELECT * FROM pods" + where, args).fetchall()
            ] + [
                PodInfo(namespace=SERVING_NAMESPACE, name=r["name"], owner_kinds=["ReplicaSet"])
                for r in db.execute("SELECT name FROM serving_pods" + where, args).fetchall()
            ]
        return sorted(found, key=lambda p: (p.namespace, p.name))

    def set_pdb(
        self,
        namespace: str,
        name: str,
        selector: dict[str, str],
        min_available: int | None = None,
        max_unavailable: int | None = None,
    ) -> None:
        """Test/CLI knob: a PodDisruptionBudget (integer minAvailable or maxUnavailable)."""
        if (min_available is None) == (max_unavailable is None):
            raise ValueError("give exactly one of min_available and max_unavailable")
        with self.world.tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO pdbs(namespace, name, selector, min_available, max_unavailable)"
                " VALUES (?,?,?,?,?)",
                (namespace, name, json.dumps(selector), min_available, max_unavailable),
            )

    def delete_pdb(self, namespace: str, name: str) -> None:
        with self.world.tx() as db:
            db.execute("DELETE FROM pdbs WHERE namespace=? AND name=?", (namespace, name))

    def _evict(self, namespace: str, name: str) -> tuple[EvictOutcome, str]:
        """The Eviction API, simulated: refuse while the pod's PDB allows no disruption."""
        with self.world.tx() as db:
            if (replica := self._replica(db, namespace, name)) is not None:
                return self._evict_replica(db, replica)
            pod = db.execute("SELECT * FROM pods WHERE namespace=? AND name=?", (namespace, name)).fetchone()
            if pod is None:
                return "gone", ""
            if pod["phase"] not in ("Succeeded", "Failed"):
                labels = json.loads(pod["labels"])
                budgets = [
                    b for b in db.execute("SELECT * FROM pdbs WHERE namespace=?", (namespace,)).fetchall()
                    if selector_matches(json.loads(b["selector"]), labels)
                ]
                if len(budgets) > 1:
                    return "blocked", "This pod has more than one PodDisruptionBudget, which the eviction " \
                                      "subresource does not support."
                if budgets:
                    budget = budgets[0]
                    selector = json.loads(budget["selector"])
                    matching = [
                        p for p in db.execute("SELECT * FROM pods WHERE namespace=?", (namespace,)).fetchall()
                        if selector_matches(selector, json.loads(p["labels"])) and p["phase"] not in ("Succeeded", "Failed")
                    ]
                    healthy = sum(p["phase"] == "Running" for p in matching)
                    if budget["min_available"] is not None:
                        need = budget["min_available"]
                    else:
                        need = max(0, len(matching) - budget["max_unavailable"])
                    if healthy - need <= 0:
                        return "blocked", PDB_REFUSAL.format(pdb=budget["name"], need=need, have=healthy)
            db.execute("DELETE FROM pods WHERE namespace=? AND name=?", (namespace, name))
        return "evicted", ""

    def _pods_on(self, node: str) -> list[PodInfo]:
        return self.pods(node)

    def _delete_pod(self, namespace: str, name: str) -> None:
        with self.world.tx() as db:
            if (replica := self._replica(db, namespace, name)) is not None:
                db.execute("DELETE FROM serving_pods WHERE id=?", (replica["id"],))
                self._run_serving(db, replica["site"])  # its ReplicaSet replaces it
                return
        self.delete_pod(namespace, name)

    # -- serving replicas as pods (what a drain meets) ----------------------------------
    @staticmethod
    def _site_of(db, node: str) -> str | None:
        row = db.execute("SELECT labels FROM nodes WHERE name=?", (node,)).fetchone()
        return json.loads(row["labels"]).get(LABEL_SITE) if row else None

    def _replica(self, db, namespace: str, name: str):
        """The serving replica pod ``namespace/name``'s row, its site's replicas run first; None
        when it is no serving replica (or gone)."""
        if namespace != SERVING_NAMESPACE:
            return None
        row = db.execute("SELECT site FROM serving_pods WHERE name=?", (name,)).fetchone()
        if row is None:
            return None
        self._run_serving(db, row["site"])
        return db.execute("SELECT * FROM serving_pods WHERE name=?", (name,)).fetchone()

    def _run_serving(self, db, site: str | None = None) -> None:
        """The ReplicaSet controller and the scheduler for the serving replicas (at ``site``; None:
        everywhere), one pass. Each Deployment has a pod per replica: one whose Deployment or node
        is gone goes, and is replaced; scaled down, the Pending ones go first, then the newest (as a
        ReplicaSet picks). A Pending one is bound to the node of its site that ``takes_serving``
        with the most GPUs free among those it fits (the default scheduler spreads), or stays
        Pending. A cordon moves no pod: what runs on the node stays until it is evicted."""
        by_site, args = ("", []) if site is None else (" WHERE site=?", [site])
        servings = {(r["model"], r["site"]): r for r in db.execute(
            "SELECT model, site, template, replicas FROM serving" + by_site, args).fetchall()}
        sites = {s for _, s in servings} if site is None else {site}
        nodes = [self._node(r) for r in db.execute("SELECT * FROM nodes ORDER BY name").fetchall()
                 if json.loads(r["labels"]).get(LABEL_SITE) in sites]
        names = {r["name"] for r in db.execute("SELECT name FROM nodes").fetchall()}
        gpus = {key: json.loads(r["template"])["gpus_per_replica"] for key, r in servings.items()}
        free = {n.name: n.gpus_allocatable for n in nodes}
        pods: dict[tuple[str, str], list] = defaultdict(list)
        for pod in db.execute("SELECT * FROM serving_pods" + by_site + " ORDER BY id", args).fetchall():
            key = (pod["model"], pod["site"])
            if key not in servings or (pod["node"] and pod["node"] not in names):
                db.execute("DELETE FROM serving_pods WHERE id=?", (pod["id"],))
                continue
            pods[key].append(pod)
            if pod["node"] in free:
                free[pod["node"]] -= gpus[key]
        for key, serving in servings.items():
            surplus = len(pods[key]) - serving["replicas"]
            for pod in sorted(pods[key], key=lambda p: (p["node"] is not None, -p["id"]))[:max(surplus, 0)]:
                db.execute("DELETE FROM serving_pods WHERE id=?", (pod["id"],))
                if pod["node"] in free:
                    free[pod["node"]] += gpus[key]
            for _ in range(-surplus):
                db.execute("INSERT INTO serving_pods(name, model, site, node) VALUES (?,?,?,NULL)",
                           (f"{serving_name(*key)}-{uuid.uuid4().hex[:5]}", *key))
        pending = "SELECT * FROM serving_pods WHERE node IS NULL" + ("" if site is None else " AND site=?")
        for pod in db.execute(pending + " ORDER BY id", args).fetchall():
            need = gpus[(pod["model"], pod["site"])]
            fits = [n for n in nodes if takes_serving(n, pod["site"]) and free[n.name] >= need]
            if fits:
                target = max(fits, key=lambda n: free[n.name])  # the first by name of those as free
                free[target.name] -= need
                db.execute("UPDATE serving_pods SET node=? WHERE id=?", (target.name, pod["id"]))

    def _evict_replica(self, db, replica) -> tuple[EvictOutcome, str]:
        """The Eviction API for a serving replica, under its Deployment's PodDisruptionBudget
        (``render_pdb``: maxUnavailable 1 of the Deployment's replicas): refused (HTTP 429) unless
        all the others are healthy (bound to a ready node). One evicted is replaced at once; a
        replacement that cannot schedule (every node of its site cordoned) keeps the next eviction
        refused until the drain's deadline, as on a real cluster. A Pending pod is evicted anyway."""
        if replica["node"] is not None:
            serving = db.execute("SELECT name, replicas FROM serving WHERE model=? AND site=?",
                                 (replica["model"], replica["site"])).fetchone()
            healthy = db.execute(
                "SELECT COUNT(*) FROM serving_pods p JOIN nodes n ON n.name = p.node AND n.ready = 1"
                " WHERE p.model=? AND p.site=?", (replica["model"], replica["site"])).fetchone()[0]
            need = max(0, serving["replicas"] - 1)
            if healthy - need <= 0:
                return "blocked", PDB_REFUSAL.format(pdb=serving["name"], need=need, have=healthy)
        db.execute("DELETE FROM serving_pods WHERE id=?", (replica["id"],))
        self._run_serving(db, replica["site"])
        return "evicted", ""

    # -- serving ----------------------------------------------------------------------
    @staticmethod
    def _template(spec: ServingSpec) -> str:
        # ``weights`` only when set: a spec written before it existed keeps its template. The
        # strategy (``max_surge``) is the Deployment's, not its pod template's.
        exclude = {"model", "site", "replicas", "max_surge"} | ({"weights"} if spec.weights is None else set())
        return json.dumps(spec.model_dump(mode="json", exclude=exclude), sort_keys=True)

    def serving_template(self, spec: ServingSpec) -> str:
        return template_fingerprint(self._template(spec))

    def _roll_out(self, site: str | None = None) -> dict[tuple[str, str], int]:
        """The simulated scheduler and Deployment controller for serving, one pass: at each site,
        the Deployments in the order they were made take the GPUs its other pods leave (a replica
        that fits nowhere is Pending). An update whose pods still run the template before
        (``pods_template``) goes through, at once, where the Deployment replaces one at a time
        (``max_surge`` 0) or the site has a replica's GPUs to spare for the surge pod; without,
        as with a real Deployment (maxSurge 1, maxUnavailable 0: no old pod goes before a new
        one is available), it waits, the old replicas serving. Returns the replicas available
        per (model, site)."""
        available: dict[tuple[str, str], int] = {}
        nodes = [self._node(r) for r in self.world.query("SELECT * FROM nodes ORDER BY name")]
        pods = [self._gpu_pod(r) for r in self.world.query("SELECT * FROM pods WHERE gpus > 0")]
        rows = self.world.query("SELECT rowid, * FROM serving" + (" WHERE site=?" if site else "") + " ORDER BY rowid",
                                *((site,) if site else ()))
        rolled = []
        for where in dict.fromkeys(row["site"] for row in rows):
            at_site = [row for row in rows if row["site"] == where]
            left = serving_capacity(nodes, where, 1) - gpus_held_by_pods(
                nodes, pods, where, [(row["model"], where) for row in at_site])
            for row in at_site:
                gpus, desired = json.loads(row["template"])["gpus_per_replica"], row["replicas"]
                fit = serving_capacity(nodes, where, gpus)
                if gpus:
                    fit = min(fit, max(0, left) // gpus)
                if row["pods_template"] is not None and (not row["max_surge"] or not desired or fit > desired):
                    rolled.append(row)
                available[(row["model"], where)] = min(desired, fit)
                left -= min(desired, fit) * gpus
        if rolled:  # a write only when an update goes through, and only to the update that was read
            with self.world.tx() as db:
                for row in rolled:
                    db.execute("UPDATE serving SET pods_template=NULL WHERE rowid=? AND template=? AND pods_template=?",
                               (row["rowid"], row["template"], row["pods_template"]))
        return available

    def _serving_row(self, model: str, site: str):
        rows = self.world.query("SELECT * FROM serving WHERE model=? AND site=?", model, site)
        return rows[0] if rows else None

    def _serving_status(self, row, available: int) -> ServingStatus:
        template = json.loads(row["template"])
        desired = row["replicas"]
        # An update waiting for room: its surge pod Pending (updated, not available), the old serving.
        waiting = row["pods_template"] is not None
        return ServingStatus(
            model=row["model"], site=row["site"], name=row["name"], image=template["image"],
            desired_replicas=desired, generation=row["generation"], observed_generation=row["generation"],
            replicas=desired + (1 if waiting else 0), updated_replicas=1 if waiting else desired, available_replicas=available,
            ready=available == desired and not waiting, can_rollback=bool(row["previous_template"]),
            gpus_per_replica=template["gpus_per_replica"], template=template_fingerprint(row["template"]),
            max_surge=row["max_surge"],
        )

    def apply_serving(self, spec: ServingSpec) -> ServingStatus:
        template = self._template(spec)
        with self.world.tx() as db:
            row = db.execute("SELECT * FROM serving WHERE model=? AND site=?", (spec.model, spec.site)).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO serving(model, site, name, template, previous_template, replicas, generation,"
                    " max_surge) VALUES (?,?,?,?,NULL,?,1,?)",
                    (spec.model, spec.site, serving_name(spec.model, spec.site), template, spec.replicas,
                     spec.max_surge),
                )
            elif row["template"] != template or row["replicas"] != spec.replicas:
                changed = row["template"] != template
                previous = row["template"] if changed else row["previous_template"]
                # As the Kubernetes adapter: the strategy is written with a new template.
                db.execute(
                    "UPDATE serving SET template=?, previous_template=?, replicas=?, generation=generation+1,"
                    " max_surge=?, pods_template=? WHERE model=? AND site=?",
                    (template, previous, spec.replicas, spec.max_surge if changed else row["max_surge"],
                     _pods_template(row, template), spec.model, spec.site),
                )
            self._run_serving(db, spec.site)
        return self.serving_status(spec.model, spec.site)

    def serving_status(self, model: str, site: str) -> ServingStatus | None:
        available = self._roll_out(site)
        row = self._serving_row(model, site)
        return self._serving_status(row, available.get((model, site), 0)) if row else None

    def _serving_or_raise(self, db, model: str, site: str):
        row = db.execute("SELECT * FROM serving WHERE model=? AND site=?", (model, site)).fetchone()
        if row is None:
            raise ServingNotFound(f"no serving of {model} at {site}", provider="sim", code="404")
        return row

    def scale_serving(self, model: str, site: str, replicas: int) -> ServingStatus:
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        with self.world.tx() as db:
            row = self._serving_or_raise(db, model, site)
            if row["replicas"] != replicas:
                db.execute(
                    "UPDATE serving SET replicas=?, generation=generation+1 WHERE model=? AND site=?",
                    (replicas, model, site),
                )
            self._run_serving(db, site)  # scaled down: its pods end now (no grace in the sim)
        return self.serving_status(model, site)

    def rollback_serving(self, model: str, site: str) -> ServingStatus:
        with self.world.tx() as db:
            row = self._serving_or_raise(db, model, site)
            if not row["previous_template"]:
                raise NoPreviousTemplate(f"{row['name']}: no previous template to roll back to", provider="sim")
            db.execute(
                "UPDATE serving SET template=?, previous_template=?, pods_template=?, generation=generation+1"
                " WHERE model=? AND site=?",
                (row["previous_template"], row["template"], _pods_template(row, row["previous_template"]), model, site),
            )
        return self.serving_status(model, site)

    def delete_serving(self, model: str, site: str) -> None:
        with self.world.tx() as db:
            db.execute("DELETE FROM serving WHERE model=? AND site=?", (model, site))
            self._run_serving(db, site)

    # -- routing ----------------------------------------------------------------------
    def store_routes(self, model: str, sites: dict[str, SiteRoute]) -> RoutingTable:
        wanted = json.dumps({site: route.model_dump() for site, route in sites.items()}, sort_keys=True)
        with self.world.tx() as db:
            row = db.execute("SELECT version, sites FROM routing WHERE model=?", (model,)).fetchone()
            if row is not None and row["sites"] == wanted:
                return RoutingTable(model=model, version=row["version"], sites=sites)
            version = (row["version"] if row else 0) + 1
            db.execute("INSERT OR REPLACE INTO routing(model, version, sites) VALUES (?,?,?)", (model, version, wanted))
        return RoutingTable(model=model, version=version, sites=sites)

    def get_routing(self, model: str) -> RoutingTable | None:
        rows = self.world.query("SELECT version, sites FROM routing WHERE model=?", model)
        if not rows:
            return None
        sites = {site: SiteRoute.model_validate(r) for site, r in json.loads(rows[0]["sites"]).items()}
        return RoutingTable(model=model, version=rows[0]["version"], sites=sites)

    # -- additive: listing serving, the fleet-wide site routes -----------------------------
    def list_serving(self, site: str | None = None) -> list[ServingStatus]:
        available = self._roll_out(site)
        sql, args = "SELECT * FROM serving", []
        if site is not None:
            sql, args = sql + " WHERE site=?", [site]
        return [self._serving_status(r, available.get((r["model"], r["site"]), 0))
                for r in self.world.query(sql + " ORDER BY model, site", *args)]

    def set_site_routes(self, sites: dict[str, SiteRoute]) -> RoutingTable:
        weights = {name: route.weight for name, route in sites.items()}
        return self.set_routing_weights(
            SITE_ROUTES, weights, healthy={n: r.healthy for n, r in sites.items()},
            draining={n: r.draining for n, r in sites.items()}, incident={n: r.incident for n, r in sites.items()},
        )

    def get_site_routes(self) -> RoutingTable | None:
        return self.get_routing(SITE_ROUTES)
