"""``gpufleet backup export FILE`` / ``gpufleet backup restore FILE``: gpufleet's state in the
cluster, in one versioned YAML document.

What a fleet cannot rebuild from its config and its providers lives in control-plane state objects
(``Cluster.update_state``: ConfigMaps labelled ``gpufleet.io/state`` in the control plane's
namespace; the sim keeps them in ``sim.db``): the provider accounts' states (quota-blocked offers,
revoked credentials, deletes queued while revoked), own-rack allocations, the identity record and
bound client keys of every node, the usage ledger, which evacuation acts at each site and which
rollout on each model. ``BACKED_UP`` names each kind; ``LEFT_OUT`` names those a backup leaves out,
and why (a test keeps the two together equal to every kind the product writes). The sim keeps its
account guard in tables of ``sim.db`` rather than state objects (``activities.account_store``): the
document holds them exactly as a real control plane's ``account`` objects, so a backup reads the
same in both modes.

No secret is ever read, so none can be written: provider credentials (Secrets, files and
variables the config names), join tokens and the join-token key (Secrets in ``kube-system`` and
``gpufleet-bootstrap``) and every private key stay where they are; state objects are ConfigMaps,
and a client key's record holds the SHA-256 of a public key.

The export writes a digest of what the document holds (``document_digest``) before its state:
restore refuses a file that no longer matches it (cut short by a copy that stopped part way, or
changed since), and one that YAML would read otherwise than written (a key given twice, nesting
too deep: ``fleet.yaml_input``), before anything is written. A backup of a gpufleet before the
digest has none to check.

Restore refuses a document of another schema version, and, unless ``--force``, any object the
target holds with other data than the file's: that is state written since the backup was taken
(or by another fleet), which a restore would lose. What the target holds and the file does not is
kept. Temporal's own state (the workflows, the entities) is not here: that is Temporal's database's
backup (docs/production/index.md, "Backup and restore").
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.markup import escape

from cli.common import ConfigPath, Context, Kubeconfig, Namespace, StateDir, console, err, report_config

if TYPE_CHECKING:
    from fleet.config import FleetConfig

backup_app = typer.Typer(
    help="Export gpufleet's state in the cluster (accounts, own-rack allocations, node identities, "
         "the usage ledger) to one file, and restore it.", no_args_is_help=True)

#: The document's layout; a restore reads exactly this one.
SCHEMA_VERSION = 1
DOCUMENT_KIND = "GpufleetBackup"
NO_SECRETS = ("none: provider credentials, join tokens, the join-token key and private keys are never "
              "read by `gpufleet backup export`, so never written here")
HEADER = f"""\
# gpufleet backup (schema version {SCHEMA_VERSION}): the control plane's state in the cluster, as
# `gpufleet backup export` read it. Restore with `gpufleet backup restore FILE`.
# It holds no secret: provider credentials, join tokens, the join-token key and private keys are
# never read by the export (state objects are ConfigMaps; a client key's record is a public key's
# SHA-256), so none is in this file.
"""

#: Kinds of state a backup holds, in the order a restore writes them, and what each is.
BACKED_UP = {
    "account": "provider account states: quota-blocked offers, revoked credentials, deletes queued while revoked",
    "own-dc": "own-rack allocations: which rack machine is which node's",
    "usage": "the usage ledger: every machine's join and retirement (the advisor's input)",
    "node-client-keys": "the client keys bound to each node (SHA-256 of public keys): the node gateway's check",
    "node-identity": "each node's identity record: its machine, provider, account and site",
    # A claim whose evacuation has ended is replaced by the next one, so an old claim restored does
    # no harm; a claim lost while its evacuation runs on in Temporal lets a second one act beside it.
    "evacuation-claim": "which SiteEvacuation acts at each site: without it a second evacuation "
                        "started at that site would act beside one still running; and the closed ones "
                        "the Site entity put back: without it one is put back again",
    # As an evacuation's: a rollout claim whose rollout has ended is taken by the next one.
    "rollout-claim": "which ModelRollout acts on each model: without it one still running is known to the "
                     "next rollout of its model only by Temporal's list, which shows a run a moment late",
}
#: Kinds a backup leaves out, and why.
LEFT_OUT = {
    "join-token": "records of join tokens (an hour at most): their Secrets are not in a backup, so restored "
                  "records would approve nothing; a join in flight gets a new token",
    "serving-endpoints": "model-server addresses, published again by whoever starts the servers",
    "catalog": "the digest of the offers the last catalog refresh listed: without it the next refresh "
               "wakes the requests waiting for capacity once",
}


# -- where the state is ---------------------------------------------------------------------------
class Store:
    """The state a backup reads and writes: the cluster's state objects; in the sim, the account
    guard is ``sim.db``'s tables (``AccountStore``), read and written as ``account`` objects."""

    def __init__(self, config: "FleetConfig", cluster, accounts=None) -> None:
        self.config = config
        self.cluster = cluster
        #: The sim's ``AccountStore``; None where accounts are state objects (mode real).
        self.accounts = accounts

    def kinds(self) -> list[str]:
        return sorted(set(self.cluster.state_kinds()) | ({"account"} if self.accounts is not None else set()))

    def read(self, kind: str) -> dict[str, dict[str, str]]:
        if kind == "account" and self.accounts is not None:
            return self._sim_accounts()
        return self.cluster.list_state(kind)

    def write(self, kind: str, key: str, data: dict[str, str], expect: dict[str, str] | None, force: bool) -> None:
        """Write ``data`` while the object is still ``expect`` (None: absent), else refuse
        (``Changed``): someone wrote it since the plan was made. ``force`` writes regardless."""
        if kind == "account" and self.accounts is not None:
            current = self._sim_accounts().get(key)
            if current != expect and not force:
                raise Changed(kind, key)
            self._put_sim_account(key, data)
            return

        def change(current: dict[str, str]) -> dict[str, str]:
            if (current or None) != expect and not force:
                raise Changed(kind, key)
            return data

        self.cluster.update_state(kind, key, change)

    # The sim's account guard as ``ClusterAccountStore`` keeps it in the cluster.
    def _sim_accounts(self) -> dict[str, dict[str, str]]:
        from activities.account_store import _PENDING, _RECORD

        out: dict[str, dict[str, str]] = {r.name: {_RECORD: r.model_dump_json()} for r in self.accounts.all()}
        pending: dict[str, dict[str, dict]] = {}
        for p in self.accounts.pending_deletes():
            pending.setdefault(p.account, {})[p.machine_id] = {"site": p.site, "queued_at": p.queued_at}
        for account, machines in pending.items():
            out.setdefault(account, {})[_PENDING] = json.dumps(machines, sort_keys=True)
        return out

    def _put_sim_account(self, name: str, data: dict[str, str]) -> None:
        from activities.account_store import _PENDING, _RECORD, AccountRecord

        if data.get(_RECORD):
            self.accounts.put(AccountRecord.model_validate_json(data[_RECORD]))
        machines = json.loads(data.get(_PENDING) or "{}")
        # AccountStore queues a delete at the time it is asked; a restore keeps when it was queued
        # (the order the ProviderAccount entity runs them in), so it writes the row as queue_delete does.
        with self.accounts.tx() as db:
            db.execute("DELETE FROM pending_deletes WHERE account=?", (name,))
            for machine_id, entry in machines.items():
                db.execute("INSERT OR REPLACE INTO pending_deletes(machine_id, site, account, queued_at)"
                           " VALUES (?,?,?,?)", (machine_id, entry["site"], name, entry["queued_at"]))

    def origin(self) -> dict[str, Any]:
        return {"mode": self.config.mode, **self.cluster.state_origin(),
                "sites": sorted(s.name for s in self.config.sites),
                "accounts": sorted(a.name for a in self.config.accounts)}


class Changed(Exception):
    def __init__(self, kind: str, key: str) -> None:
        super().__init__(f"{kind}/{key}")
        self.kind, self.key = kind, key


def open_store(state_dir: Path | None, config: str | None, kubeconfig: str | None, context: str | None,
               namespace: str, *, must_exist: bool = False) -> Store:
    """The fleet's state as the config's mode keeps it; exit 2, saying why, when it cannot be read."""
    from cli.common import fleet_env, settings
    from fleet.config import ConfigError, load_config

    try:
        fleet = load_config(config)
    except ConfigError as error:
        report_config(error)
    if fleet.mode == "sim":
        db = settings(state_dir=state_dir, config=config).sim_db
        if must_exist and not db.exists():
            _exit(2, f"no simulated fleet at {db} (--state-dir)")
        env = fleet_env(state_dir, config)
        return Store(fleet, env.cluster, env.accounts)
    from providers.cluster.kubernetes import KubernetesCluster

    try:
        return Store(fleet, KubernetesCluster(kubeconfig=kubeconfig, context=context, namespace=namespace))
    except Exception as error:  # noqa: BLE001 - no kubeconfig, a bad one: one line, exit 2
        _exit(2, f"cannot reach the cluster: {type(error).__name__}: {error}".splitlines()[0])


def _exit(code: int, message: str) -> NoReturn:
    err.print(f"[red]error:[/] {escape(message)}")
    raise typer.Exit(code)


def _where(origin: dict[str, Any]) -> str:
    """``https://api:6443 namespace gpufleet``; the sim: its database file."""
    if origin.get("namespace"):
        return f"{origin.get('cluster', '?')} namespace {origin['namespace']}"
    return f"the simulated fleet {origin['database']}" if origin.get("database") else str(origin.get("cluster", "?"))


# -- export ---------------------------------------------------------------------------------------
def export_document(store: Store) -> tuple[dict[str, Any], dict[str, int]]:
    """The backup document, and the objects of each kind it leaves out (by kind)."""
    from importlib.metadata import version

    present = store.kinds()
    state = {kind: dict(sorted(store.read(kind).items())) for kind in BACKED_UP}
    left = {kind: len(store.cluster.list_state(kind)) for kind in present if kind not in BACKED_UP}
    document = {
        "kind": DOCUMENT_KIND,
        "schema_version": SCHEMA_VERSION,
        "gpufleet_version": version("gpufleet"),
        "taken_at": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "source": store.origin(),
        "secrets": NO_SECRETS,
    }
    # Before ``state``, so a file cut short keeps it: whatever the cut leaves no longer matches it.
    document["digest"] = document_digest({**document, "state": state})
    document["state"] = state
    return document, left


def document_digest(document: dict[str, Any]) -> str:
    """``sha256:<hex>`` of the document but its ``digest``, as JSON with sorted keys: what it holds,
    not how the YAML is laid out (comments, quoting, indentation). It catches a file cut short or
    changed since the export (a copy that stopped part way, an edit); it is no signature."""
    import hashlib

    content = {key: value for key, value in document.items() if key != "digest"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def write_document(path: Path, document: dict[str, Any]) -> None:
    """Whole or not at all (a temporary file renamed over it), readable by its owner only."""
    import yaml

    text = HEADER + yaml.safe_dump(document, sort_keys=False, width=10_000, allow_unicode=True)
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(temporary, path)


@backup_app.command("export")
def export(
    file: Annotated[Path, typer.Argument(help="where to write the backup (YAML)", dir_okay=False)],
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
    kubeconfig: Kubeconfig = None,
    context: Context = None,
    namespace: Namespace = "gpufleet",
) -> None:
    """Write gpufleet's state in the cluster to FILE: provider account states, own-rack
    allocations, node identity records and client keys, the usage ledger, which evacuation acts
    at each site.

    One YAML document with its schema version and the cluster, namespace and sites it came
    from. No secret is read, so none is written. Exit 0 written, 2 when the fleet's state
    cannot be read."""
    store = open_store(state_dir, config, kubeconfig, context, namespace, must_exist=True)
    try:
        document, left = export_document(store)
    except Exception as error:  # noqa: BLE001 - unreachable, refused: one line, exit 2
        _exit(2, f"cannot read the fleet's state: {type(error).__name__}: {error}".splitlines()[0])
    write_document(file, document)
    console.print(f"wrote {escape(str(file))}: gpufleet's state at {escape(_where(document['source']))} "
                  f"(schema {SCHEMA_VERSION}, {document['taken_at']})")
    for kind, objects in document["state"].items():
        console.print(f"  {kind}: {len(objects)}  ({BACKED_UP[kind]})")
    for kind, count in sorted(left.items()):
        why = LEFT_OUT.get(kind, f"a kind this gpufleet ({document['gpufleet_version']}) does not know: "
                                 "not backed up")
        err.print(f"  left out: {kind}: {count}  ({why})")


# -- restore --------------------------------------------------------------------------------------
class BadBackup(Exception):
    """The file is not a backup this gpufleet restores; the message names the field first."""


def read_document(path: Path) -> dict[str, Any]:
    from pydantic import BaseModel, ConfigDict, ValidationError

    from fleet.yaml_input import NotYaml, read_yaml

    class Document(BaseModel):
        model_config = ConfigDict(extra="forbid")
        kind: str
        schema_version: int
        gpufleet_version: str
        taken_at: str
        source: dict[str, Any]
        secrets: str
        #: None in a backup of a gpufleet before it (nothing to check).
        digest: str | None = None
        state: dict[str, dict[str, dict[str, str]]]

    try:
        loaded = read_yaml(path.read_text())
    except OSError as error:
        raise BadBackup(f"{path}: not readable: {error}".splitlines()[0]) from None
    except NotYaml as error:
        raise BadBackup(f"{path}: {error}".splitlines()[0]) from None
    if loaded.problems:
        # A key given twice: YAML keeps the last (a second ``account:`` would drop every account).
        raise BadBackup("; ".join(loaded.problems))
    raw = loaded.data
    if not isinstance(raw, dict) or raw.get("kind") != DOCUMENT_KIND:
        raise BadBackup(f"kind: {path} is not a gpufleet backup (kind {DOCUMENT_KIND} expected)")
    # The version first: a later layout may differ in any other field.
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise BadBackup(f"schema_version: {raw.get('schema_version')!r} (written by gpufleet "
                        f"{raw.get('gpufleet_version', '?')}); this gpufleet restores schema version "
                        f"{SCHEMA_VERSION} only")
    try:
        document = Document.model_validate(raw).model_dump()
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise BadBackup(f"{field}: {first['msg']}") from None
    unknown = sorted(set(document["state"]) - set(BACKED_UP))
    if unknown:
        raise BadBackup(f"state.{unknown[0]}: not a kind schema version {SCHEMA_VERSION} holds "
                        f"(it holds {', '.join(BACKED_UP)})")
    if raw.get("digest") is not None and document_digest(raw) != raw["digest"]:
        raise BadBackup(f"digest: {path} does not hold what `gpufleet backup export` wrote: it was cut short "
                        "(a copy that stopped part way) or changed since. Restore a whole copy; to restore a "
                        "file changed on purpose, remove its digest line")
    return document


def plan_restore(store: Store, document: dict[str, Any]) -> dict[str, dict[str, list]]:
    """Per kind: ``restore`` (key, data) absent in the target, ``same`` keys already as in the
    file, ``newer`` (key, data, what the target holds) keys the target holds otherwise, ``kept``
    keys the target holds and the file does not."""
    plan: dict[str, dict[str, list]] = {}
    for kind in BACKED_UP:
        objects = document["state"].get(kind, {})
        current = store.read(kind)
        entry = plan[kind] = {"restore": [], "same": [], "newer": [], "kept": sorted(set(current) - set(objects))}
        for key, data in objects.items():
            have = current.get(key) or None
            if have is None:
                entry["restore"].append((key, data))
            elif have == data:
                entry["same"].append(key)
            else:
                entry["newer"].append((key, data, have))
    return plan


@backup_app.command("restore")
def restore(
    file: Annotated[Path, typer.Argument(help="a file `gpufleet backup export` wrote", exists=True, dir_okay=False)],
    force: Annotated[bool, typer.Option(
        "--force", help="overwrite objects the target holds with other data than the file's "
                        "(state written since the backup, which is lost)")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="say what would be restored; write nothing")] = False,
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
    kubeconfig: Kubeconfig = None,
    context: Context = None,
    namespace: Namespace = "gpufleet",
) -> None:
    """Restore FILE (from `gpufleet backup export`) into this fleet's cluster.

    Objects the target lacks are written; those it already holds as in the file stay; those it
    holds with other data (state written since the backup was taken, or by another fleet) are
    refused, all of them before anything is written, unless --force. What the target holds and
    the file does not is kept. Run it before the control plane's workers start (or with them
    scaled to zero): a worker that starts first writes state of its own.

    Exit 0 restored (or nothing to do), 1 refused (newer state), 2 a file of another schema
    version or not a backup, or a fleet that cannot be reached."""
    try:
        document = read_document(file)
    except BadBackup as error:
        _exit(2, str(error))
    store = open_store(state_dir, config, kubeconfig, context, namespace)
    source = document["source"]
    console.print(f"backup of {escape(_where(source))} taken {document['taken_at']} "
                  f"by gpufleet {escape(document['gpufleet_version'])}")
    here = store.origin()
    strange = sorted(set(source.get("sites") or []) - set(here["sites"]))
    if strange:
        err.print(f"[yellow]warning:[/] sites of the backup this fleet's config does not have: "
                  f"{escape(', '.join(strange))} (records naming them are restored as they are)")
    try:
        plan = plan_restore(store, document)
    except Exception as error:  # noqa: BLE001 - unreachable, refused: one line, exit 2
        _exit(2, f"cannot read the fleet's state: {type(error).__name__}: {error}".splitlines()[0])
    newer = [(kind, key) for kind, entry in plan.items() for key, *_ in entry["newer"]]
    if newer and not force:
        shown = ", ".join(f"{kind}/{key}" for kind, key in newer[:10]) + (" ..." if len(newer) > 10 else "")
        err.print(f"[red]refused:[/] the target holds {len(newer)} object(s) with other data than the backup "
                  f"(written since it was taken, or by another fleet): {escape(shown)}. Nothing was written; "
                  "--force overwrites them (what they hold now is lost).")
        raise typer.Exit(1)
    changed: list[str] = []
    if not dry_run:
        try:
            for kind, entry in plan.items():
                for key, data in entry["restore"]:
                    try:
                        store.write(kind, key, data, None, force)
                    except Changed:
                        changed.append(f"{kind}/{key}")
                for key, data, have in entry["newer"]:
                    store.write(kind, key, data, have, force=True)
        except Exception as error:  # noqa: BLE001 - refused, unreachable: one line, exit 2
            _exit(2, f"restore stopped part way, at {kind}: {type(error).__name__}: {error}".splitlines()[0]
                     + " (run it again: what is restored already counts as already so)")
    console.print(f"{'dry run, nothing written: would restore' if dry_run else 'restored'} into "
                  f"{escape(_where(here))}")
    for kind, entry in plan.items():
        console.print(f"  {kind}: {len(entry['restore'])} restored, {len(entry['same'])} already so, "
                      f"{len(entry['newer'])} overwritten, {len(entry['kept'])} kept (not in the backup)")
    if changed:
        err.print(f"[red]written meanwhile, so not restored:[/] {escape(', '.join(changed))} "
                  "(someone wrote them during the restore: stop the workers, then restore again)")
        raise typer.Exit(1)
