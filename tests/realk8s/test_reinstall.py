"""A rack machine's reinstall on the real control plane: kubeadm's existing-Node check
(``gpufleet-join``'s kubelet-start step, as ``kubeadm join`` makes it) refuses to join while a
Ready Node of the machine's name exists, so the reinstall rung powers the machine off, waits
for the real node lifecycle controller to mark the Node NotReady (its grace period after the
kubelet's last heartbeat), and only then boots the fresh install with a fresh token. The
rejoined machine's kubelet gets its certificate from gpufleet's approver and the same Node,
labels and all, is Ready again."""

from __future__ import annotations

import threading
import time

from activities.models import PrepareNodeInput, RestartMachineInput
from activities.repair import RepairActivities
from fleet.cluster import LABEL_SITE
from providers.cluster.bootstrap import read_join_configuration
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
        node = world.await_registration(provisioned)
        run(world.acts.prepare_node, PrepareNodeInput(node_name=node.name, labels={LABEL_SITE: world.site.name}))
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
            run(world.acts.review_node_csrs)  # the approver's pass (its Schedule runs it every 30 s)
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
            world.cluster, token, node.name, identity.provider_id), name="too-early").boot()
        failed = early.failure(60)
        assert failed.step == "existing-node-check" and "status Ready already exists" in str(failed), failed
    finally:
        world.stop()
