"""A node as an attacker holds it: its certificate and key, and raw gRPC calls to the node
gateway (any bytes, any number of them, on as many connections as it likes)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from datetime import timedelta

import grpc
from temporalio import workflow
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import PollActivityTaskQueueRequest
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from fleet.messages.capacity import RetireMachineInput
from fleet.settings import Settings
from workers.node_agent import cert_key_fingerprint, connect_via_gateway
from workers.gateway.authorization import SERVICE
from workers.gateway.liveness import node_liveness
from workers.gateway.node_identity import GatewayAccess, node_key_and_csr
from workers.gateway.pki import Pki
from workers.gateway.proxy import RunningGateway, start_gateway
from tests.gateway_keys import token_keys_as_deployed

#: How old a verdict the gateway may answer with (``start_gateway``'s ``live_ttl``, as the tests start it).
VERDICT_TTL = 1.0


@dataclass
class NodeCredentials:
    name: str
    cert: bytes
    key: bytes

    @property
    def fingerprint(self) -> str:
        return cert_key_fingerprint(self.cert)


def credentials(pki: Pki, name: str, **sign) -> NodeCredentials:
    """A key made for ``name`` and the certificate the CA signs for it (not bound to any node)."""
    key, csr = node_key_and_csr(name)
    return NodeCredentials(name, pki.sign_node_csr(csr, name, **sign), key)


def bound_credentials(cluster, pki: Pki, name: str, machine_id: str) -> NodeCredentials:
    """The machine's own credentials: its key bound to the node, as the cluster's approver
    binds the key it signs for the machine that holds the node."""
    made = credentials(pki, name)
    assert cluster.bind_client_key(name, machine_id, made.fingerprint), "the machine holds the node"
    return made


def node_channel(access: GatewayAccess, node: NodeCredentials) -> grpc.aio.Channel:
    """A connection of its own (never shared with another channel to the same address)."""
    tls = grpc.ssl_channel_credentials(access.ca, node.key, node.cert)
    return grpc.aio.secure_channel(access.address, tls, options=[
        ("grpc.ssl_target_name_override", access.server_name), ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_send_message_length", 16 * 1024 * 1024)])


def call(channel: grpc.aio.Channel, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)


def poll_request(name: str, **fields) -> bytes:
    return PollActivityTaskQueueRequest(namespace="default", task_queue=TaskQueue(name=f"node/{name}"),
                                        **fields).SerializeToString()


async def code_of(pending) -> grpc.StatusCode:
    """How a raw call ended: OK, or its error's status code."""
    try:
        await pending
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


async def live_entity(client: Client, name: str) -> None:
    """A running ``node/<name>`` (no worker runs it: only its status matters to liveness)."""
    await client.start_workflow("Node", {"node_name": name}, id=f"node/{name}", task_queue=f"idle-{name}")


async def end_entity(client: Client, name: str) -> None:
    try:
        await client.get_workflow_handle(f"node/{name}").terminate("test over")
    except Exception:  # noqa: BLE001 - ended already
        pass


async def gather_codes(pending: list) -> list[grpc.StatusCode]:
    return list(await asyncio.gather(*(code_of(p) for p in pending)))


# -- a gateway that asks the test's own cluster (as deployed: ``node_liveness``) ---------------
@dataclass
class FleetGateway:
    running: "RunningGateway"
    pki: Pki
    access: GatewayAccess

    async def connect(self, node: NodeCredentials) -> Client:
        """The node agent's client, through this gateway, as ``node``."""
        return await connect_via_gateway(self.access, "default", node.cert, node.key)


async def start_fleet_gateway(client: Client, cluster, live_ttl: float = VERDICT_TTL) -> FleetGateway:
    pki = Pki.create("gpufleet security-test CA")
    cert, key = pki.server_cert()
    settings = Settings(address=client.service_client.config.target_host, namespace=client.namespace)
    running = await start_gateway(settings, cert, key, pki.ca_pem, token_keys_as_deployed(),
                                  live=node_liveness(client, cluster),
                                  live_ttl=live_ttl)
    return FleetGateway(running, pki, GatewayAccess(running.address, pki.ca_pem))


@workflow.defn(name="SecurityRetireOne", sandboxed=False)
class RetireOne:
    """The step every retire path ends in (surplus, consolidation, evacuation, reclaim,
    replace): the ``retire_machine`` activity on the control plane's queue."""

    @workflow.run
    async def run(self, args: list) -> None:
        queue, retire = args
        await workflow.execute_activity("retire_machine", RetireMachineInput.model_validate(retire), task_queue=queue,
                                        start_to_close_timeout=timedelta(seconds=30))


async def retire(stack, site: str, node_name: str, machine_id: str) -> None:
    """Retire a node as every retire path does (``retire_machine``: machine deleted, Node removed)."""
    queue = unique("security-retire")
    async with Worker(stack.client, task_queue=queue, workflows=[RetireOne], workflow_runner=UnsandboxedWorkflowRunner()):
        await stack.client.execute_workflow(
            "SecurityRetireOne", [stack.settings.task_queue,
                                  {"site": site, "node_name": node_name, "machine_id": machine_id}],
            id=unique("security-retire"), task_queue=queue)


def rpc_status(error: BaseException):
    """The RPCError's status inside whatever the SDK raised (None: no RPC error)."""
    from temporalio.service import RPCError

    cause = error
    while cause is not None and not isinstance(cause, RPCError):
        cause = cause.__cause__
    return cause.status if cause is not None else None


async def refused_once_its_verdict_is_stale(call, ttl: float = VERDICT_TTL, status=None) -> BaseException:
    """``call``, made once the gateway's verdicts from before now are past ``ttl`` (a lookup in
    flight now has ended too: twice ``ttl``), is refused (PERMISSION_DENIED unless ``status``);
    the refusal. One call, after the cache's life: a refusal that takes longer is the cache's
    bug, and the machine being busy cannot make this fail."""
    from temporalio.service import RPCStatusCode

    await asyncio.sleep(2 * ttl)
    try:
        await call()
    except Exception as error:  # noqa: BLE001 - judged below
        if rpc_status(error) == (status or RPCStatusCode.PERMISSION_DENIED):
            return error
        raise
    raise AssertionError(f"still served {2 * ttl:g} s after: its verdict of before outlived the cache's {ttl:g} s")
