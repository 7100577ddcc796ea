"""NodeJoin and the repair ladder with the bootstrap in the machine's user data (issue 24),
on the simulated fleet: the simulated machine joins from its user data alone.

* a node that registers under the expected name with another providerID is not
  admitted, and its machine is deleted;
* the reinstall rung re-bootstraps the machine with a fresh token and proves it with
  the smoke test;
* their histories replay against today's code (recorded with ``GPUFLEET_RECORD=1``).
"""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import ActivityEnvironment

from activities.capacity import CapacityActivities
from activities.env import FleetEnv
from fleet.cluster import FLEET_TAINT, LABEL_SITE, LABEL_ZONE, UNPROVEN_TAINT
from fleet.messages.capacity import SiteNodesInput
from fleet.messages.join import NodeJoinResult
from fleet.repair_policy import Rung
from providers.cluster.bootstrap import (
    DEFAULT_TEMPLATE,
    BootstrapError,
    JoinParams,
    kubelet_args,
    read_join_configuration,
    registration_taints,
    render_user_data,
)
from tests.conftest import Stack, run_node_host, wait_for
from tests.test_node_join import readable_history
from tests.replay import replay_and_record
from tests.repair_helpers import join_node, repair_handle, repair_result, running_stack
from workers.control_plane import build_worker


async def test_a_join_records_the_machine_it_created(stack: Stack) -> None:
    handle = await stack.start_join({"site": "site-a"}, request="bootstrap-happy")
    result = NodeJoinResult.model_validate(await handle.result()).nodes[0]
    identity = stack.cluster.node_identity(result.node_name)
    assert identity is not None and identity.machine_id == result.machine_id
    assert (identity.site, identity.provider, identity.account) == ("site-a", result.provider, result.account)
    node = stack.cluster.get_node(result.node_name)
    assert node.provider_id == identity.provider_id == kubelet_args(read_join_configuration(
        stack.world.user_data(result.machine_id)))["provider-id"]
    assert kubelet_args(read_join_configuration(stack.world.user_data(result.machine_id)))["node-labels"] \
        == f"{LABEL_ZONE}=site-a", "the kubelet registers in its site's zone"
    assert node.labels[LABEL_SITE] == "site-a"
    assert FLEET_TAINT in node.taints and UNPROVEN_TAINT not in node.taints, \
        "admitted: the unproven taint lifted, the fleet taint kept (the control plane never lands there)"
    # Someone lifts it (the kubelet cannot: NodeRestriction): the site reconcile puts it back.
    stack.cluster.set_taints(result.node_name, remove=[FLEET_TAINT])
    site_nodes = CapacityActivities(FleetEnv.from_settings(stack.settings)).site_nodes
    ActivityEnvironment().run(site_nodes, SiteNodesInput(site="site-a"))
    assert FLEET_TAINT in stack.cluster.get_node(result.node_name).taints
    assert stack.world.query("SELECT * FROM join_tokens") == [], "no token outlives the registration"
    token = read_join_configuration(stack.world.user_data(result.machine_id))["discovery"]["tlsBootstrapToken"]
    history = readable_history((await handle.fetch_history()).to_json_dict())
    assert token.split(".")[0] in history, "the join names its token by id"
    assert token.split(".")[1] not in history and "#cloud-config" not in history, "never its secret or user data"
    await replay_and_record(handle, "node_join_bootstrap_in_user_data")


async def test_a_node_with_another_provider_id_is_refused_and_its_machine_deleted(fleet_world: Stack) -> None:
    stack = fleet_world
    async with build_worker(stack.client, stack.settings):
        handle = await stack.start_join({"site": "site-a"}, request="liar")
        [row] = await wait_for(
            lambda: stack.world.query("SELECT id, user_data FROM machines WHERE user_data IS NOT NULL"), timeout=30)
        # Another machine answering to this one's name: same token, another providerID.
        forged = row["user_data"].replace("gpufleet://", "gpufleet://forged-")
        with stack.world.tx() as db:
            db.execute("UPDATE machines SET user_data=? WHERE id=?", (forged, row["id"]))
        stop = asyncio.Event()
        host = await run_node_host(stack.client, stack.settings, stop)
        try:
            with pytest.raises(WorkflowFailureError) as failed:
                await handle.result()
        finally:
            stop.set()
            await host
    assert failed.value.cause.type == "RegistrationMismatch"
    assert "providerID" in failed.value.cause.message
    assert stack.world.machine(row["id"])["deleted_at"] is not None, "its machine is deleted"
    assert stack.cluster.list_nodes() == [], "and it is not a node of ours"
    await replay_and_record(handle, "node_join_registration_mismatch")


@pytest.fixture
async def rstack(temporal_env, tmp_path):
    async for stack in running_stack(temporal_env.client, tmp_path):
        yield stack


async def test_the_reinstall_rung_rebootstraps_with_a_fresh_token(rstack: Stack) -> None:
    node = await join_node(rstack)
    first = rstack.world.user_data(node.machine_id)
    rstack.world.inject_fault(node.machine_id, 0, "xid", 79, clears_on="reinstall")
    result = await repair_result(rstack, node.node_name, 0, timeout=120)
    assert [(a.rung, a.outcome) for a in result.attempts] == [(Rung.REBOOT, "failed"), (Rung.REINSTALL, "passed")]
    machine = rstack.world.machine(node.machine_id)
    assert machine["reinstalls"] == 1 and machine["deleted_at"] is None
    fresh = rstack.world.user_data(node.machine_id)
    token = read_join_configuration(fresh)["discovery"]["tlsBootstrapToken"]
    assert fresh != first and token != read_join_configuration(first)["discovery"]["tlsBootstrapToken"]
    # The reinstalled machine's kubelet registers in its site's zone again, as at its join.
    assert kubelet_args(read_join_configuration(fresh))["node-labels"] == f"{LABEL_ZONE}=site-a"
    assert rstack.world.query("SELECT * FROM join_tokens") == [], "the fresh token is gone once the node is back"
    back = rstack.cluster.get_node(node.node_name)
    assert back.ready and back.machine_id == node.machine_id and back.labels[LABEL_SITE] == "site-a"
    history = readable_history((await repair_handle(rstack, node.node_name, 0).fetch_history()).to_json_dict())
    assert token.split(".")[1] not in history, "the fresh token's secret is in no history"
    assert "#cloud-config" not in history, "nor is the user data"
    await replay_and_record(repair_handle(rstack, node.node_name, 0), "gpu_repair_reinstall_rebootstrap")


def test_a_bootstrap_template_without_the_fleet_taint_is_refused_before_any_machine_is_bought() -> None:
    """A site's own template (GPUFLEET_BOOTSTRAP_TEMPLATE) that drops the fleet taint would
    register GPU nodes the control plane's pods could be scheduled onto."""
    template = DEFAULT_TEMPLATE.read_text()
    params = JoinParams(api_server="203.0.113.1:6443", ca_data="Y2E=", token="abcdef.0123456789abcdef",
                        node_name="n1", provider_id="gpufleet://aws/a/n1", site="aws-use1")
    assert FLEET_TAINT in registration_taints(read_join_configuration(render_user_data(params, template)))
    without = template.replace("          - key: gpufleet.io/demand\n            effect: NoSchedule\n", "")
    assert without != template
    with pytest.raises(BootstrapError) as refused:
        render_user_data(params, without)
    assert FLEET_TAINT in str(refused.value) and "abcdef" not in str(refused.value)
