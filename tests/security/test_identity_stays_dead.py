"""Issue 35, finding 3: a retired node's identity stays dead.

The node gateway here asks the test's own simulated cluster, as deployed (``node_liveness``):
a node is live while the certificate's key is one its join (or a renewal) bound to it and its
identity record and entity (or its join) exist. The attacker holds what a retired machine
keeps: its key and its certificate, valid for hours more.

- its kubelet creates its Node object again (NodeRestriction lets a kubelet create its own
  Node): access returned 0.21 s later before;
- a later join started with the same id derived the same node name, so the old machine's
  certificate became the new node's (it was handed a task, and could report the new machine's
  health);
- a certificate for a live node's name that no join of that machine asked for (any other
  signer's: kubeadm's bootstrap auto-approval signs any name a bootstrap token asks for);
- a connection opened before its certificate expired kept working after it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time

import grpc
import pytest
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest, GetSystemInfoRequest
from temporalio.service import RPCStatusCode

from tests.conftest import Stack
from tests.replay import replay_and_record
from tests.security.gateway_helpers import (
    bound_credentials,
    call,
    code_of,
    credentials,
    end_entity,
    live_entity,
    node_channel,
    poll_request,
    refused_once_its_verdict_is_stale,
    retire,
    rpc_status,
    start_fleet_gateway,
    unique,
)
from workers.gateway.node_identity import node_key_and_csr
from workers.gateway.pki import Pki


@pytest.fixture
async def fleet_gateway(stack: Stack):
    gateway = await start_fleet_gateway(stack.client, stack.cluster)
    yield gateway
    await gateway.running.stop(grace=None)


async def join(stack: Stack, request: str | None = None) -> dict:
    handle = await stack.start_join({"site": "site-a"}, request=request)
    # A join takes seconds here; before the name nonce, the same id started again never joined.
    result = await asyncio.wait_for(handle.result(), 90)
    return result["nodes"][0] | {"handle": handle}


def kubelet_registers_again(stack: Stack, name: str, machine_id: str) -> None:
    """What a retired machine's kubelet does with its still-valid certificate: create its own
    Node object again (the sim keeps Nodes in its world database; this is the kubelet's write)."""
    with stack.world.tx() as db:
        db.execute("INSERT INTO nodes(name, machine_id, labels, taints, unschedulable, ready, boot_id, gpus,"
                   " registered_at, provider_id) VALUES (?,?,?,?,0,1,?,?,?,?)",
                   (name, machine_id, json.dumps({"kubernetes.io/hostname": name}), "[]", "boot-again", 2,
                    time.time(), ""))


def system_info(client):
    return lambda: client.workflow_service.get_system_info(GetSystemInfoRequest(), retry=False)


async def test_a_node_object_its_kubelet_creates_again_revives_nothing(stack: Stack, fleet_gateway) -> None:
    node = await join(stack)
    name, machine = node["node_name"], node["machine_id"]
    stolen = bound_credentials(stack.cluster, fleet_gateway.pki, name, machine)
    agent = await fleet_gateway.connect(stolen)
    await system_info(agent)()  # live
    await retire(stack, "site-a", name, machine)
    await refused_once_its_verdict_is_stale(system_info(agent))

    kubelet_registers_again(stack, name, machine)
    assert stack.cluster.get_node(name) is not None
    entity = await stack.client.get_workflow_handle(f"node/{name}").describe()
    assert entity.status.name == "RUNNING", "its entity runs on (until its watch gives up): that revives nothing either"
    deadline = time.monotonic() + 3.0  # three verdict lifetimes, then some
    while time.monotonic() < deadline:
        with pytest.raises(Exception) as caught:
            await system_info(agent)()
        assert rpc_status(caught.value) == RPCStatusCode.PERMISSION_DENIED
        await asyncio.sleep(0.2)
    # A fresh connection with the same certificate, and a poll of its old queue: the same answer.
    async with node_channel(fleet_gateway.access, stolen) as channel:
        assert await code_of(call(channel, "PollActivityTaskQueue")(poll_request(name), timeout=5)) \
            == grpc.StatusCode.PERMISSION_DENIED


async def test_a_later_join_with_the_same_id_names_a_new_node(stack: Stack, fleet_gateway) -> None:
    first = await join(stack, request="twice")
    old = bound_credentials(stack.cluster, fleet_gateway.pki, first["node_name"], first["machine_id"])
    old_agent = await fleet_gateway.connect(old)
    await retire(stack, "site-a", first["node_name"], first["machine_id"])
    await refused_once_its_verdict_is_stale(system_info(old_agent))

    second = await join(stack, request="twice")  # the same workflow id, started again
    assert second["handle"].id == first["handle"].id
    assert second["node_name"] != first["node_name"], "a node name is never reused"
    new = bound_credentials(stack.cluster, fleet_gateway.pki, second["node_name"], second["machine_id"])
    await system_info(await fleet_gateway.connect(new))()  # the new machine is live

    # The old machine's certificate opens nothing: not its old name, not the new node's queue.
    for _ in range(3):
        with pytest.raises(Exception) as caught:
            await system_info(old_agent)()
        assert rpc_status(caught.value) == RPCStatusCode.PERMISSION_DENIED
        await asyncio.sleep(0.4)
    async with node_channel(fleet_gateway.access, old) as channel:
        for queue_of in (first["node_name"], second["node_name"]):
            assert await code_of(call(channel, "PollActivityTaskQueue")(poll_request(queue_of), timeout=5)) \
                == grpc.StatusCode.PERMISSION_DENIED
    await replay_and_record(second["handle"], "node_join_name_nonce")


async def test_a_certificate_for_a_live_name_that_its_join_did_not_bind_opens_nothing(stack: Stack,
                                                                                        fleet_gateway) -> None:
    """Signed by the CA the gateway trusts, for the live node's exact name, but for a key no
    join or renewal of that machine asked for (what kubeadm's bootstrap auto-approval issues to
    any bootstrap token's holder). Refused as UNAVAILABLE (a just-renewed key is bound at the
    approver's next pass), and nothing is forwarded."""
    node = await join(stack)
    name, machine = node["node_name"], node["machine_id"]
    await system_info(await fleet_gateway.connect(bound_credentials(stack.cluster, fleet_gateway.pki, name, machine)))()
    forged = credentials(fleet_gateway.pki, name)
    stats = fleet_gateway.running.gateway.stats
    forwarded = stats.forwarded
    async with node_channel(fleet_gateway.access, forged) as channel:
        describe = DescribeNamespaceRequest(namespace="default").SerializeToString()
        for _ in range(3):
            assert await code_of(call(channel, "DescribeNamespace")(describe, timeout=5)) == grpc.StatusCode.UNAVAILABLE
            assert await code_of(call(channel, "PollActivityTaskQueue")(poll_request(name), timeout=5)) \
                == grpc.StatusCode.UNAVAILABLE
            await asyncio.sleep(0.3)
    assert stats.forwarded == forwarded, "none of its calls went upstream"
    # Another machine cannot get its key bound to the node either (the signer binds only for
    # the machine that holds the node).
    assert not stack.cluster.bind_client_key(name, "m-someone-else", forged.fingerprint)


async def test_an_open_connection_stops_working_when_its_certificate_expires(temporal_env) -> None:
    """The TLS handshake checks a certificate once; the gateway checks it on every call."""
    name = unique("expiring")
    await live_entity(temporal_env.client, name)
    gateway = await start_fleet_gateway(temporal_env.client, None)  # Temporal-only liveness: the entity runs
    try:
        key, csr = node_key_and_csr(name)
        lifetime = dt.timedelta(seconds=60)
        start = dt.datetime.now(dt.timezone.utc) - lifetime + dt.timedelta(seconds=4)  # expires in 4 s
        expiring = type("C", (), {})()
        expiring.name, expiring.key, expiring.cert = name, key, gateway.pki.sign_node_csr(csr, name, lifetime, start)
        agent = await gateway.connect(expiring)
        async with node_channel(gateway.access, expiring) as channel:
            describe = DescribeNamespaceRequest(namespace="default").SerializeToString()
            assert await code_of(call(channel, "DescribeNamespace")(describe, timeout=5)) == grpc.StatusCode.OK
            await system_info(agent)()
            await asyncio.sleep(max(0.0, (start + lifetime - dt.datetime.now(dt.timezone.utc)).total_seconds()) + 0.5)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(channel, "DescribeNamespace")(describe, timeout=5)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED and "expired" in caught.value.details()
            with pytest.raises(Exception) as refused:
                await system_info(agent)()
            assert rpc_status(refused.value) == RPCStatusCode.PERMISSION_DENIED
    finally:
        await gateway.running.stop(grace=None)
        await end_entity(temporal_env.client, name)


async def sweep_now(stack: Stack):
    from fleet.messages.sweep import FleetSweepResult

    handle = await stack.client.start_workflow(
        "FleetSweep", {"grace_seconds": 0}, id=unique("fleet-sweep"),
        task_queue=stack.settings.task_queue, result_type=FleetSweepResult)
    return handle, await handle.result()


async def test_a_node_object_its_kubelet_creates_again_keeps_no_machine_from_the_sweep(stack: Stack) -> None:
    """A retire whose provider delete was lost leaves the machine running (paid for); the sweep
    is what deletes it. Its kubelet creating its Node again, under its own name, and another
    machine's kubelet naming that orphan's id, must not hide it."""
    retired, other = await join(stack), await join(stack)
    name, machine = retired["node_name"], retired["machine_id"]
    stack.cluster.remove_node(name)  # the retire's first half; its delete of the machine was lost
    kubelet_registers_again(stack, name, machine)
    kubelet_registers_again(stack, f"{name}-x", machine)  # another name, claiming the orphan's id

    handle, report = await sweep_now(stack)
    deleted = [m for r in report.sites for m in r.deleted]
    assert deleted == [machine], report
    assert stack.world.machine(machine)["deleted_at"] is not None, "the orphan is deleted"
    live = stack.world.machine(other["machine_id"])
    assert live["deleted_at"] is None, "the identified node's machine is kept"
    await replay_and_record(handle, "fleet_sweep_unidentified_nodes")
