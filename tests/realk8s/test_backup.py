"""``gpufleet backup`` against the real control plane: one namespace's gpufleet state (a
quota-blocked account, a revoked one with a queued delete, an own-rack allocation, a node's
identity record and client key, the usage ledger) exported with `gpufleet backup export`, restored
with `gpufleet backup restore` into a fresh namespace, where the control plane carries on: its
account guard refuses what it refused, the node gateway takes the node for live, the allocation
and the ledger are the same. Restoring again changes nothing; state written since is refused
unless ``--force``. The export needs nothing beyond the control plane's own RBAC.

The sim's run, and the refusals of a bad file, are tests/test_backup.py; this one stays short (a
few seconds of the tier's minutes).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from activities.account_store import AccountRecord, ClusterAccountStore
from activities.env import FleetEnv
from activities.ledger import UsageLedger
from cli.main import app
from fleet.cluster import NODE_IDENTITY_KIND, NODE_KEYS_KIND, NodeIdentity, with_key
from fleet.config import load_config
from fleet.errors import AccountRevoked, OfferBlocked
from fleet.messages.advisor import LedgerEntry
from fleet.settings import Settings
from providers.cluster.kubernetes import JOIN_TOKEN_KIND, KubernetesCluster
from providers.own_dc import ClusterAllocations
from tests.conftest import write_fleet
from tests.realk8s.cluster import RealCluster
from tests.test_backup import KEY, NODE, NodeEntitiesRun
from tests.test_config import _real_fleet
from workers.gateway.liveness import Verdict, node_liveness


def gpufleet(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def control_plane_kubeconfig(real: RealCluster, tmp_path: Path) -> Path:
    """A kubeconfig for the control plane's service account (the shipped RBAC)."""
    token = real.service_account_token("gpufleet", "gpufleet-control-plane")
    ca = tmp_path / "ca.crt"
    ca.write_bytes(real.ca_pem)
    path = tmp_path / "control-plane.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gpufleet",
        "clusters": [{"name": "real", "cluster": {"server": real.server, "certificate-authority": str(ca)}}],
        "users": [{"name": "gpufleet-control-plane", "user": {"token": token}}],
        "contexts": [{"name": "gpufleet", "context": {"cluster": "real", "user": "gpufleet-control-plane"}}]}))
    return path


@pytest.fixture
def namespaces(real_cluster: RealCluster):
    unique = uuid.uuid4().hex[:6]
    names = (f"backup-{unique}", f"restored-{unique}")
    for name in names:
        real_cluster.kubectl("create", "namespace", name)
    yield names
    real_cluster.kubectl("delete", "namespace", *names, "--wait=false", check=False)


def test_a_fresh_namespace_restored_from_a_backup_carries_on(real_cluster: RealCluster, namespaces, tmp_path) -> None:
    source_ns, target_ns = namespaces
    config_path = write_fleet(tmp_path, _real_fleet({"name": "lam", "provider": "lambda", "account": "la"},
                                                     {"name": "hz", "provider": "hetzner", "account": "hc"}))
    config = load_config(str(config_path))
    old = KubernetesCluster(api_client=real_cluster.api_client(), namespace=source_ns)
    new = KubernetesCluster(api_client=real_cluster.api_client(), namespace=target_ns)

    accounts = ClusterAccountStore(old)
    accounts.block_offer("la", "lambda", "lam/t", "quota exceeded")
    accounts.mark_revoked("hc", "hetzner", "401 unauthorized")
    accounts.queue_delete("hz", "hc", "hz-4711")
    ClusterAllocations(old, "racks").update(lambda state: state["allocations"].update(
        {"rack1-node1": {"key": "join/racks/1", "node": "racks-n1"}}))
    identity = NodeIdentity(node_name=NODE, machine_id="m-1", provider="lambda", account="la", site="lam",
                            join_id="join/lam/1")
    old.update_state(NODE_IDENTITY_KIND, NODE, lambda _old: identity.state())
    old.update_state(NODE_KEYS_KIND, NODE, lambda record: with_key(record, KEY))
    UsageLedger(old).joined(LedgerEntry(machine_id="m-1", site="lam", node_name=NODE, gpu="H100", gpus=8,
                                        joined_at=1_700_000_000.0))
    # A join token's record: left out of a backup (a spent or short-lived secret's handle), and said so.
    old.update_state(JOIN_TOKEN_KIND, "abcdef", lambda _old: {"node-name": NODE})

    backup = tmp_path / "backup.yaml"
    admin = ["--config", str(config_path), "--kubeconfig", str(real_cluster.admin_kubeconfig)]
    exported = gpufleet("backup", "export", str(backup), *admin, "--namespace", source_ns)
    assert exported.exit_code == 0, exported.output
    assert f"left out: {JOIN_TOKEN_KIND}: 1" in exported.output, exported.output
    source = yaml.safe_load(backup.read_text())["source"]
    assert source == {"mode": "real", "cluster": real_cluster.server, "namespace": source_ns,
                      "sites": ["hz", "lam"], "accounts": ["hc", "la"]}

    gateway = node_liveness(NodeEntitiesRun(), new)
    assert asyncio.run(gateway(NODE, KEY)) is Verdict.RETIRED, "a fresh namespace knows no node"
    restored = gpufleet("backup", "restore", str(backup), *admin, "--namespace", target_ns)
    assert restored.exit_code == 0, restored.output
    assert "account: 2 restored" in restored.output and "node-identity: 1 restored" in restored.output

    # The control plane reading the restored namespace carries on where the other one was.
    env = FleetEnv(Settings(config=str(config_path)), config, new)
    with pytest.raises(OfferBlocked):
        env.check_account("lam", "t")
    with pytest.raises(AccountRevoked):
        env.check_account("hz")
    assert [p.machine_id for p in env.accounts.pending_deletes("hc")] == ["hz-4711"]
    assert asyncio.run(gateway(NODE, KEY)) is Verdict.LIVE
    assert ClusterAllocations(new, "racks").read() == ClusterAllocations(old, "racks").read()
    assert UsageLedger(new).entries() == UsageLedger(old).entries()
    assert new.list_state(JOIN_TOKEN_KIND) == {}, "no join token comes back"

    again = gpufleet("backup", "restore", str(backup), *admin, "--namespace", target_ns)
    assert again.exit_code == 0 and "account: 0 restored, 2 already so" in again.output, again.output
    # A person rotated hc's credentials in the new namespace since: kept, unless forced.
    ClusterAccountStore(new).put(AccountRecord(name="hc", provider="hetzner"))
    refused = gpufleet("backup", "restore", str(backup), *admin, "--namespace", target_ns)
    assert refused.exit_code == 1 and "account/hc" in refused.output, refused.output
    env.check_account("hz")  # healthy: nothing was written
    forced = gpufleet("backup", "restore", str(backup), *admin, "--namespace", target_ns, "--force")
    assert forced.exit_code == 0 and "1 overwritten" in forced.output, forced.output
    with pytest.raises(AccountRevoked):
        env.check_account("hz")

    # The control plane's own credentials may export its namespace (nothing beyond its RBAC).
    ours = gpufleet("backup", "export", str(tmp_path / "gpufleet.yaml"), "--config", str(config_path),
                    "--kubeconfig", str(control_plane_kubeconfig(real_cluster, tmp_path)))
    assert ours.exit_code == 0, ours.output
    assert yaml.safe_load((tmp_path / "gpufleet.yaml").read_text())["source"]["namespace"] == "gpufleet"
