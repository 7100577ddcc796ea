"""A rack machine's reinstall on the real control plane: kubeadm's existing-Node check
(``gpufleet-join``'s kubelet-start step, as ``kubeadm join`` makes it) refuses to join while a
Ready Node of the machine's name exists, so the reinstall rung powers the machine off, waits
for the real node lifecycle controller to mark the Node NotReady (its grace period after the
kubelet's last heartbeat), and only then boots the fresh install with a fresh token. The
rejoined machine's kubelet gets its certificate from gpufleet's approver and the same Node,
labels and all, is Ready again. A Node that stays Ready leaves the machine off and no token."""

from __future__ import annotations

import base64
import threading
import time
from datetime import datetime, timezone

import pytest
from temporalio.exceptions import ApplicationError

from fleet.messages.nodes import RestartMachineInput, RevokeNodeTokensInput
from activities.repair import RepairActivities
from fleet.cluster import LABEL_SITE, NODE_IDENTITY_KIND, NodeIdentity
from providers.cluster.bootstrap import BOOTSTRAP_GROUP, read_join_configuration
from tests.providers.test_join_real import (
    _activity_with_time,
    _booted_again,
    _powered_off,
    _rack_machine_booted_long_ago,
    run,
    user_data_of,
)
from tests.realk8s.test_join import RealJoining


def _ready(world: RealJoining, name: str) -> bool | None:
    status, node = world.real.request("GET", f"/api/v1/nodes/{name}", admin=True)
    if status != 200:
        return None
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions") or [])


def test_a_reinstalled_rack_machine_rejoins_once_its_old_node_is_not_ready(own_dc_harness, tmp_path, real_cluster):
    world = RealJoining(own_dc_harness, tmp_path, real_cluster)
    try:
        provisioned = world.provision()
        machine_id = provisioned.machine.id
        old = world.machine(machine_id, name="first-install").boot()
        node = world.await_registration(provisioned, labels={LABEL_SITE: world.site.name})
        deadline = time.monotonic() + 60
        while not _ready(world, node.name) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _ready(world, node.name), world.diagnosis()
        first = user_data_of(world.harness, machine_id)

        _rack_machine_booted_long_ago(world)
        repair = RepairActivities(world.env)
        outcome: dict = {}

        def reinstall() -> None:
            try:
                outcome["said"] = _activity_with_time(repair.reinstall_machine, RestartMachineInput(
                    site=world.site.name, machine_id=machine_id, node_name=node.name, boot_id_before=node.boot_id),
                    seconds=240)
            except Exception as error:  # noqa: BLE001 - reported to the test
                outcome["error"] = error

        thread = threading.Thread(target=reinstall)
        thread.start()
        deadline = time.monotonic() + 30
        while not _powered_off(world) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _powered_off(world), outcome
        old.stop()  # the power cut: its kubelet is gone
        powered_off_at = time.monotonic()
        assert not _booted_again(world) and _ready(world, node.name), "the Node is still Ready: nothing boots"
        thread.join(220)
        assert outcome.get("said") == "reinstall requested", outcome
        waited = time.monotonic() - powered_off_at
        assert _ready(world, node.name) is False and _booted_again(world)

        fresh = user_data_of(world.harness, machine_id)
        assert read_join_configuration(fresh)["discovery"]["tlsBootstrapToken"] != \
            read_join_configuration(first)["discovery"]["tlsBootstrapToken"]
        rejoined = world.machine(machine_id, fresh, name="reinstalled").boot()
        rejoined.wait_step("kubelet-start", 60)  # past kubeadm's existing-Node check
        deadline = time.monotonic() + 90
        while not _ready(world, node.name) and time.monotonic() < deadline:
            run(world.acts.approve_node_csrs)  # the approver's pass (the CsrApprover runs it on each new CSR)
            time.sleep(1)
        assert _ready(world, node.name), world.diagnosis()
        status, stored = world.real.request("GET", f"/api/v1/nodes/{node.name}", admin=True)
        assert stored["metadata"]["labels"][LABEL_SITE] == world.site.name, "the same Node, labels kept"
        print(f"reinstall waited {waited:.0f} s for NotReady")
    finally:
        world.stop()


def test_a_machine_booting_over_a_ready_node_of_its_name_is_refused_by_kubeadms_check(
        own_dc_harness, tmp_path, real_cluster) -> None:
    """Why the reinstall waits: the same machine's fresh install booted while its old Node is
    still Ready stops at kubeadm's existing-Node check."""
    world = RealJoining(own_dc_harness, tmp_path, real_cluster)
    try:
        provisioned = world.provision()
        world.machine(provisioned.machine.id, name="first-install").boot()
        node = world.await_registration(provisioned)
        deadline = time.monotonic() + 60
        while not _ready(world, node.name) and time.monotonic() < deadline:
            time.sleep(0.5)
        token = world.cluster.issue_bootstrap_token(node.name, f"reinstall/{node.name}/early", 600)
        from activities.control_plane import bootstrap_user_data

        identity = world.cluster.node_identity(node.name)
        early = world.machine(provisioned.machine.id, bootstrap_user_data(
            world.cluster, token, node.name, identity.provider_id, identity.site), name="too-early").boot()
        failed = early.failure(60)
        assert failed.step == "existing-node-check" and "status Ready already exists" in str(failed), failed
    finally:
        world.stop()


def _gpufleet_token_ids(world: RealJoining) -> set[str]:
    """The ids of gpufleet's bootstrap tokens in kube-system (its group's)."""
    status, secrets = world.real.request("GET", "/api/v1/namespaces/kube-system/secrets", admin=True)
    assert status == 200, secrets
    return {base64.b64decode(s["data"]["token-id"]).decode() for s in secrets["items"]
            if s.get("type") == "bootstrap.kubernetes.io/token"
            and base64.b64decode(s["data"].get("auth-extra-groups", "")).decode() == BOOTSTRAP_GROUP}


def test_a_reinstall_whose_node_stays_ready_leaves_the_machine_off_and_no_token(own_dc_harness, tmp_path,
                                                                                 real_cluster) -> None:
    """Powered off, its Node still Ready when the activity's time is up: the reinstall stops there,
    retryable; the machine stays off with its old user data, and the fresh token, which never
    reached a machine, is revoked. The machine needs no boot for that: its Node is one the admin
    writes Ready, as its kubelet left it, registered under the join's identity."""
    world = RealJoining(own_dc_harness, tmp_path, real_cluster)
    try:
        provisioned = world.provision()
        machine_id = provisioned.machine.id
        run(world.acts.revoke_node_tokens, RevokeNodeTokensInput(node_name=world.node_name))  # as at registration
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        status, answer = world.real.request("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": world.node_name},
            "spec": {"providerID": provisioned.provider_id}}, admin=True)
        assert status == 201, answer
        status, answer = world.real.request("PATCH", f"/api/v1/nodes/{world.node_name}/status", {"status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": stamp,
                            "lastTransitionTime": stamp}], "nodeInfo": {"bootID": "boot-1"}}},
            admin=True, content_type="application/merge-patch+json")
        assert status == 200, answer
        site = world.site
        identity = NodeIdentity(node_name=world.node_name, machine_id=machine_id, provider=site.provider,
                                account=site.account, site=site.name, provider_id=provisioned.provider_id,
                                join_id=world.join_id)
        world.cluster.update_state(NODE_IDENTITY_KIND, world.node_name, lambda _old: identity.state())
        first = user_data_of(world.harness, machine_id)
        tokens = _gpufleet_token_ids(world)
        _rack_machine_booted_long_ago(world)
        repair = RepairActivities(world.env)
        with pytest.raises(ApplicationError) as waited:
            _activity_with_time(repair.reinstall_machine, RestartMachineInput(
                site=site.name, machine_id=machine_id, node_name=world.node_name, boot_id_before="boot-1"),
                seconds=23)
        assert waited.value.type == "NodeStillReady" and not waited.value.non_retryable
        assert "still Ready at" in waited.value.message and "kubeadm refuses" in waited.value.message
        assert _powered_off(world) and not _booted_again(world)
        assert user_data_of(world.harness, machine_id) == first
        assert _gpufleet_token_ids(world) == tokens, "the reinstall's token never reached a machine: revoked"
    finally:
        world.real.request("DELETE", f"/api/v1/nodes/{world.node_name}", admin=True)
        world.stop()
