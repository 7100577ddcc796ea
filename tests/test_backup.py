"""``gpufleet backup export`` / ``restore`` (cli/backup.py) on the simulated fleet: one fleet's
state (blocked and revoked accounts with a queued delete, a node's identity record and client
key, the usage ledger) exported, restored into a fresh fleet, and the fresh fleet carries on as
the first did: the account guard refuses what it refused, the node gateway takes the node for
live, the ledger has the same machines. The same code against the Kubernetes adapter and the
real control plane: tests/realk8s/test_backup.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from activities.account_store import ACCOUNT_STATE, AccountRecord
from activities.capacity import CATALOG_STATE
from activities.env import FleetEnv
from activities.evacuation import CLAIM_HOLDER, EVACUATION_CLAIM_KIND
from activities.ledger import USAGE_STATE, UsageLedger
from cli.backup import BACKED_UP, LEFT_OUT, SCHEMA_VERSION
from cli.main import app
from fleet.cluster import NODE_IDENTITY_KIND, NODE_KEYS_KIND, NodeIdentity, with_key
from fleet.errors import AccountRevoked, OfferBlocked
from fleet.messages.advisor import LedgerEntry
from fleet.models import AccountState
from fleet.routing import ENDPOINTS_KIND
from fleet.settings import Settings
from providers.own_dc import ALLOCATION_STATE
from tests.conftest import write_fleet

runner = CliRunner()
NODE = "site-a-n1"
KEY = "ab" * 32  # a client key's SHA-256, as the CSR approver binds it
SECRET = "sim-a-key-never-in-a-backup"


def gpufleet(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200", "SIM_A_KEY": SECRET})


class Fleet:
    """One simulated fleet: its state dir, config and what its activities see."""

    def __init__(self, root: Path) -> None:
        root.mkdir()
        self.state_dir, self.config = root / "state", write_fleet(root)
        self.env = FleetEnv.from_settings(Settings(state_dir=self.state_dir, config=str(self.config)))

    def args(self) -> list[str]:
        return ["--state-dir", str(self.state_dir), "--config", str(self.config)]


class NodeEntitiesRun:
    """Temporal, as the node gateway asks it: every Node entity runs (Temporal's own state is not
    what a gpufleet backup restores)."""

    def get_workflow_handle(self, _workflow_id: str):
        return self

    async def describe(self):
        from temporalio.client import WorkflowExecutionStatus

        return SimpleNamespace(status=WorkflowExecutionStatus.RUNNING)

    async def count_workflows(self, _query: str):
        return SimpleNamespace(count=0)


async def gateway_verdict(fleet: Fleet):
    from workers.gateway.liveness import node_liveness

    return await node_liveness(NodeEntitiesRun(), fleet.env.cluster)(NODE, KEY)


def populate(fleet: Fleet) -> None:
    accounts, cluster = fleet.env.accounts, fleet.env.cluster
    accounts.block_offer("acct-a", "lambda", "site-a/gpu_2x_h100", "quota exceeded for gpu_2x_h100")
    accounts.mark_revoked("acct-b", "nebius", "401 Unauthenticated")
    accounts.queue_delete("site-b", "acct-b", "vm-orphan")
    identity = NodeIdentity(node_name=NODE, machine_id="m-1", provider="lambda", account="acct-a", site="site-a",
                            provider_id=f"gpufleet://lambda/acct-a/{NODE}", join_id="join/site-a/1")
    cluster.update_state(NODE_IDENTITY_KIND, NODE, lambda _old: identity.state())
    cluster.update_state(NODE_KEYS_KIND, NODE, lambda old: with_key(old, KEY))
    UsageLedger(cluster).joined(LedgerEntry(machine_id="m-1", site="site-a", node_name=NODE, provider="lambda",
                                            offer="gpu_2x_h100", gpu="H100", gpus=2, price_per_gpu_hour=2.5,
                                            joined_at=1_700_000_000.0))
    # The evacuation acting at site-a (it runs on in Temporal, whose state is not this backup's).
    cluster.update_state(EVACUATION_CLAIM_KIND, "site-a", lambda _old: {CLAIM_HOLDER: "evacuate/site-a/1"})
    # Left out: a join's bootstrap token (its secret is in sim.db), a model server's address.
    cluster.issue_bootstrap_token(NODE, "join/site-a/2", 600)
    cluster.update_state(ENDPOINTS_KIND, "llm.site-a", lambda _old: {"server-1": "http://127.0.0.1:9"})


@pytest.fixture
def source(tmp_path) -> Fleet:
    fleet = Fleet(tmp_path / "source")
    populate(fleet)
    return fleet


#: Where a kind of state is written by a variable rather than a name: the restore itself, and the
#: claims' one writer (each claim's kind is named where ``take_claim`` is called).
WRITES_ANY_KIND = {"cli/backup.py", "activities/claims.py"}


def kinds_the_product_writes() -> tuple[set[str], list[str]]:
    """Every kind of state some product module writes (``update_state(KIND, ...)``, directly or
    through ``asyncio.to_thread``, or a claim's ``take_claim(client, cluster, KIND, ...)``), its
    argument resolved in that module; and the calls whose kind could not be resolved, outside
    ``WRITES_ANY_KIND``."""
    import ast
    import importlib
    import tomllib

    root = Path(__file__).resolve().parent.parent
    packages = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
    kinds, unresolved = set(), []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            if "update_state" not in text and "take_claim" not in text:
                continue
            where = path.relative_to(root).as_posix()
            module = None
            for node in ast.walk(ast.parse(text)):
                if not isinstance(node, ast.Call):
                    continue
                if isinstance(node.func, ast.Attribute) and node.func.attr == "update_state":
                    kind = node.args[0] if node.args else None
                elif node.args and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "update_state":
                    kind = node.args[1] if len(node.args) > 1 else None
                elif isinstance(node.func, ast.Name) and node.func.id == "take_claim":
                    kind = node.args[2] if len(node.args) > 2 else None
                else:
                    continue
                if isinstance(kind, ast.Constant):
                    value = kind.value
                else:
                    module = module or importlib.import_module(where.removesuffix(".py").replace("/", "."))
                    try:
                        value = eval(ast.unparse(kind), vars(module)) if kind is not None else None  # noqa: S307
                    except Exception:  # noqa: BLE001 - a local variable: not resolvable here
                        value = None
                if isinstance(value, str):
                    kinds.add(value)
                elif where not in WRITES_ANY_KIND:
                    unresolved.append(f"{where}:{node.lineno}")
    return kinds, unresolved


def test_every_kind_the_product_writes_is_backed_up_or_left_out_with_its_reason() -> None:
    # A kind added anywhere (a new activity's state) must not drop out of backups with only the
    # export's "a kind this gpufleet does not know" to say so.
    written, unresolved = kinds_the_product_writes()
    assert not unresolved, f"state written under a kind this test cannot name: {unresolved}"
    assert {ACCOUNT_STATE, ALLOCATION_STATE, USAGE_STATE, NODE_KEYS_KIND, NODE_IDENTITY_KIND, ENDPOINTS_KIND,
            CATALOG_STATE} <= written, "the scan finds the kinds known to be written"
    assert not set(BACKED_UP) & set(LEFT_OUT)
    assert set(BACKED_UP) | set(LEFT_OUT) == written, (
        f"not in BACKED_UP or LEFT_OUT: {sorted(written - set(BACKED_UP) - set(LEFT_OUT))}; "
        f"written by nothing: {sorted((set(BACKED_UP) | set(LEFT_OUT)) - written)}")


def test_the_production_page_names_every_kind_a_backup_holds() -> None:
    """docs/production/index.md's table of what a backup holds is what the export writes: it lacked
    ``rollout-claim`` while every export listed it."""
    import re

    page = (Path(__file__).parents[1] / "docs" / "production" / "index.md").read_text()
    section = page.split("## Backup and restore", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `([a-z-]+)` \|", section, re.M) == list(BACKED_UP)


def test_a_fresh_fleet_restored_from_a_backup_carries_on(source: Fleet, tmp_path: Path) -> None:
    backup = tmp_path / "fleet.backup.yaml"
    exported = gpufleet("backup", "export", str(backup), *source.args())
    assert exported.exit_code == 0, exported.output
    assert "left out: serving-endpoints: 1" in exported.output, exported.output
    assert "does not know" not in exported.output, "every kind the fleet wrote is backed up or left out, with why"

    text = backup.read_text()
    assert SECRET not in text and "join/site-a/2" not in text, "no credential, no join token in a backup"
    assert "It holds no secret" in text.split("\n\n")[0]
    document = yaml.safe_load(text)
    assert document["schema_version"] == SCHEMA_VERSION
    assert document["source"]["mode"] == "sim" and document["source"]["sites"] == ["site-a", "site-b"]
    assert set(document["state"]) == set(BACKED_UP)
    assert oct(backup.stat().st_mode & 0o777) == "0o600"

    fresh = Fleet(tmp_path / "fresh")
    assert fresh.env.accounts.get("acct-a").state == AccountState.HEALTHY
    import asyncio

    from workers.gateway.liveness import Verdict

    assert asyncio.run(gateway_verdict(fresh)) is Verdict.RETIRED, "a fleet without the records knows no node"

    restored = gpufleet("backup", "restore", str(backup), *fresh.args())
    assert restored.exit_code == 0, restored.output
    assert "node-identity: 1 restored" in restored.output and "account: 2 restored" in restored.output

    # The account guard refuses what it refused before, before any provider call.
    with pytest.raises(OfferBlocked):
        fresh.env.check_account("site-a", "gpu_2x_h100")
    with pytest.raises(AccountRevoked):
        fresh.env.check_account("site-b")
    assert [(p.machine_id, p.site, p.account) for p in fresh.env.accounts.pending_deletes()] == [
        ("vm-orphan", "site-b", "acct-b")]
    assert fresh.env.accounts.pending_deletes() == source.env.accounts.pending_deletes()
    assert fresh.env.accounts.all() == source.env.accounts.all()
    # A second evacuation started at site-a follows the one still running there, as before.
    assert fresh.env.cluster.read_state(EVACUATION_CLAIM_KIND, "site-a") == {CLAIM_HOLDER: "evacuate/site-a/1"}
    # The node gateway takes the node for live again; the advisor reads the same ledger.
    assert asyncio.run(gateway_verdict(fresh)) is Verdict.LIVE
    assert UsageLedger(fresh.env.cluster).entries() == UsageLedger(source.env.cluster).entries()

    again = gpufleet("backup", "restore", str(backup), *fresh.args())
    assert again.exit_code == 0 and "node-identity: 0 restored, 1 already so" in again.output, again.output


def test_restore_refuses_newer_state_unless_forced(source: Fleet, tmp_path: Path) -> None:
    backup = tmp_path / "fleet.backup.yaml"
    assert gpufleet("backup", "export", str(backup), *source.args()).exit_code == 0
    # Since the backup: a person rotated acct-b's credentials, and a new node joined.
    source.env.accounts.put(AccountRecord(name="acct-b", provider="nebius"))
    source.env.accounts.done_delete("vm-orphan")
    source.env.cluster.update_state(NODE_IDENTITY_KIND, "site-a-n2", lambda _old: {"node-name": "site-a-n2"})

    refused = gpufleet("backup", "restore", str(backup), *source.args())
    assert refused.exit_code == 1, refused.output
    assert "account/acct-b" in refused.output and "Nothing was written" in refused.output
    assert source.env.accounts.get("acct-b").state == AccountState.HEALTHY, "nothing written"

    dry = gpufleet("backup", "restore", str(backup), "--force", "--dry-run", *source.args())
    assert dry.exit_code == 0 and "account: 0 restored, 1 already so, 1 overwritten" in dry.output, dry.output
    assert source.env.accounts.get("acct-b").state == AccountState.HEALTHY, "a dry run writes nothing"

    forced = gpufleet("backup", "restore", str(backup), "--force", *source.args())
    assert forced.exit_code == 0, forced.output
    assert "node-identity: 0 restored, 1 already so, 0 overwritten, 1 kept" in forced.output
    assert source.env.accounts.get("acct-b").state == AccountState.CREDENTIALS_REVOKED
    assert [p.machine_id for p in source.env.accounts.pending_deletes("acct-b")] == ["vm-orphan"]
    assert source.env.cluster.read_state(NODE_IDENTITY_KIND, "site-a-n2"), "what the file lacks is kept"


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(schema_version=SCHEMA_VERSION + 1), "schema_version"),
    (lambda d: d.update(kind="ConfigMap"), "kind"),
    (lambda d: d["state"].update({"join-token": {}}), "state.join-token"),
    (lambda d: d["state"]["usage"].update({"site-a.2023-11": {"k": 1}}), "state.usage.site-a.2023-11.k"),
])
def test_restore_refuses_what_is_not_a_backup_it_reads(source: Fleet, tmp_path: Path, change, field) -> None:
    backup = tmp_path / "fleet.backup.yaml"
    assert gpufleet("backup", "export", str(backup), *source.args()).exit_code == 0
    document = yaml.safe_load(backup.read_text())
    change(document)
    backup.write_text(yaml.safe_dump(document))
    fresh = Fleet(tmp_path / "fresh")
    refused = gpufleet("backup", "restore", str(backup), *fresh.args())
    assert refused.exit_code == 2, refused.output
    assert f"error: {field}:" in " ".join(refused.output.split()), refused.output
    assert fresh.env.accounts.all() == [] and fresh.env.cluster.list_state(NODE_IDENTITY_KIND) == {}


def _cut_after_node_identity(text: str) -> str:
    """The file as a copy that stopped part way leaves it: whole lines, the claims lost."""
    return text[:text.index("  evacuation-claim:")]


def _revoked_account_edited(text: str) -> str:
    """A hand edit (or a flipped byte) in a record: it no longer reads as an account record."""
    assert '"state":"credentials-revoked"' in text
    return text.replace('"state":"credentials-revoked"', '"state":"revoked"', 1)


@pytest.mark.parametrize("damage, said", [
    # Before: a RecursionError traceback (exit 1).
    (lambda t: t.replace("secrets:", "note: " + "[" * 3000 + "]" * 3000 + "\nsecrets:", 1),
     "not valid YAML: nested too deeply"),
    # Before: restored without the accounts, exit 0 (YAML kept the second, empty, account: block).
    (lambda t: t + "  account: {}\n", "state.account: given twice (lines "),
    # Before: restored without the claims, exit 0, as if the backup had none.
    (_cut_after_node_identity, "digest: "),
    # Before: acct-a restored, then "restore stopped part way, at account" (exit 2, half written).
    (_revoked_account_edited, "digest: "),
], ids=["nested-too-deep", "key-given-twice", "cut-short", "changed"])
def test_restore_refuses_a_damaged_file_naming_why_before_writing_anything(source: Fleet, tmp_path: Path, damage,
                                                                          said: str) -> None:
    backup = tmp_path / "fleet.backup.yaml"
    assert gpufleet("backup", "export", str(backup), *source.args()).exit_code == 0
    text = backup.read_text()
    backup.write_text(damage(text))
    fresh = Fleet(tmp_path / "fresh")
    refused = gpufleet("backup", "restore", str(backup), *fresh.args())
    shown = " ".join(refused.output.split())
    assert refused.exit_code == 2 and f"error: {said}" in shown.replace(f"{backup}: ", ""), (shown, refused.exception)
    if said == "digest: ":
        assert "cut short (a copy that stopped part way) or changed since" in shown, shown
    assert fresh.env.accounts.all() == [] and fresh.env.cluster.list_state(NODE_IDENTITY_KIND) == {}, "nothing written"

    # The file as exported restores; so does a backup without a digest (a gpufleet before it wrote none).
    backup.write_text("".join(line for line in text.splitlines(keepends=True) if not line.startswith("digest: ")))
    restored = gpufleet("backup", "restore", str(backup), *fresh.args())
    assert restored.exit_code == 0 and "account: 2 restored" in restored.output, restored.output


def test_export_names_the_state_it_does_not_know(source: Fleet, tmp_path: Path) -> None:
    source.env.cluster.update_state("added-later", "x", lambda _old: {"a": "b"})
    done = gpufleet("backup", "export", str(tmp_path / "b.yaml"), *source.args())
    assert done.exit_code == 0
    assert "left out: added-later: 1 (a kind this gpufleet" in " ".join(done.output.split()), done.output


def test_export_of_no_fleet_is_refused(tmp_path: Path) -> None:
    config = write_fleet(tmp_path)
    done = gpufleet("backup", "export", str(tmp_path / "b.yaml"), "--state-dir", str(tmp_path / "none"),
                    "--config", str(config))
    assert done.exit_code == 2 and "no simulated fleet" in done.output
    assert not (tmp_path / "b.yaml").exists()
