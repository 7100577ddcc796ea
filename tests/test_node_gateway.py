"""The node gateway: a node reaches only its own queue and its own tasks (mutual TLS, per-node
certificates from a CSR), a retired node is cut off, a gateway restart costs no retry; and the
Node entity pulls health through it."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid
from datetime import timedelta

import pytest
from cryptography import x509
from temporalio import activity, workflow
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import (
    GetSystemInfoRequest,
    GetWorkflowExecutionHistoryRequest,
    PollActivityTaskQueueRequest,
    PollWorkflowTaskQueueRequest,
    RecordActivityTaskHeartbeatRequest,
    RespondActivityTaskCompletedRequest,
)
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.common import RetryPolicy
from temporalio.service import RPCError, RPCStatusCode, TLSConfig
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from fleet import search_attributes as sa
from tests.doc_recipes import ROOT, run_openssl_lines, secrets_as_written, shell_block
from tests.gateway_keys import keys_from_mount, token_keys_as_deployed
from tests.replay import replay_and_record
from tests.tools import require
from tests.security.gateway_helpers import refused_once_its_verdict_is_stale, retire
from tests.conftest import NODE_GATEWAYS, Stack, SessionGateway, start_test_gateway, wait_for
from workers.node_agent import cert_key_fingerprint, connect_via_gateway
from fleet.settings import Settings
from workers.gateway.liveness import LiveCache, Verdict, node_liveness
from workers.gateway.node_identity import GatewayAccess, node_key_and_csr
from workers.gateway.pki import Pki
from workers.gateway.proxy import start_gateway

ECHO_QUEUE_PREFIX = "gw-test"


@activity.defn(name="echo")
async def echo(text: str) -> str:
    return f"{activity.info().task_queue}: {text}"


#: Set when ``beat_until_released`` may return.
RELEASED = asyncio.Event()


@activity.defn(name="beat_until_released")
async def beat_until_released(text: str) -> str:
    """Heartbeats (the SDK sends one at most every 0.8 × the heartbeat timeout) until released."""
    while not RELEASED.is_set():
        activity.heartbeat()
        await asyncio.sleep(0.1)
    return f"attempt {activity.info().attempt}: {text}"


@workflow.defn(name="GatewayEcho")
class GatewayEcho:
    @workflow.run
    async def run(self, args: list[str]) -> str:
        queue, activity_name, text = args
        return await workflow.execute_activity(
            activity_name, text, task_queue=queue, start_to_close_timeout=timedelta(seconds=90),
            heartbeat_timeout=timedelta(seconds=10),
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_attempts=10),
        )


def gateway(temporal_env) -> SessionGateway:
    return NODE_GATEWAYS[temporal_env.client.service_client.config.target_host]


async def live_node(client: Client, name: str) -> None:
    """A running ``node/<name>`` (no worker runs it: only its status matters to the gateway)."""
    await client.start_workflow("Node", {"node_name": name}, id=f"node/{name}", task_queue=f"idle-{name}")


def bound_credentials(cluster, pki: Pki, name: str, machine_id: str) -> tuple[bytes, bytes, str]:
    """(certificate, key, key fingerprint) for ``name``, its key bound to the node as the
    cluster's signer binds the key it signs for the machine that holds the node."""
    key, csr = node_key_and_csr(name)
    cert = pki.sign_node_csr(csr, name)
    fingerprint = cert_key_fingerprint(cert)
    assert cluster.bind_client_key(name, machine_id, fingerprint)
    return cert, key, fingerprint


async def as_node(gw: SessionGateway, name: str, pki: Pki | None = None, **sign) -> Client:
    pki = pki or gw.pki
    key, csr = node_key_and_csr(name)
    cert = pki.sign_node_csr(csr, name, **sign)
    return await connect_via_gateway(gw.access, "default", cert, key)


def denied(error: BaseException) -> bool:
    cause = error
    while cause is not None and not isinstance(cause, RPCError):
        cause = cause.__cause__
    return isinstance(cause, RPCError) and cause.status == RPCStatusCode.PERMISSION_DENIED


async def refused(call) -> None:
    with pytest.raises(Exception) as caught:
        await call
    assert denied(caught.value), f"not PERMISSION_DENIED: {caught.value!r}"


@pytest.fixture
async def nodes(temporal_env):
    a, b = f"gw-a-{uuid.uuid4().hex[:6]}", f"gw-b-{uuid.uuid4().hex[:6]}"
    client = temporal_env.client
    for name in (a, b):
        await live_node(client, name)
    yield a, b
    for name in (a, b):
        await client.get_workflow_handle(f"node/{name}").terminate("test over")


async def test_a_node_reaches_only_its_own_queue_and_its_own_tasks(temporal_env, nodes, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="gpufleet.node_gateway")
    a, b = nodes
    gw, control = gateway(temporal_env), temporal_env.client
    node_a, node_b = await as_node(gw, a), await as_node(gw, b)
    control_queue = f"{ECHO_QUEUE_PREFIX}-{uuid.uuid4().hex[:6]}"
    async with Worker(control, task_queue=control_queue, workflows=[GatewayEcho],
                      workflow_runner=UnsandboxedWorkflowRunner()):
        # Polling node/A as A works: a workflow's activity runs on A's agent, through the gateway.
        async with Worker(node_a, task_queue=f"node/{a}", activities=[echo]):
            handle = await control.start_workflow("GatewayEcho", [f"node/{a}", "echo", "hi"],
                                                  id=f"gw-{uuid.uuid4().hex[:6]}", task_queue=control_queue)
            assert await asyncio.wait_for(handle.result(), 20) == f"node/{a}: hi"
        started = [e for e in (await handle.fetch_history()).events if e.HasField("activity_task_started_event_attributes")]
        assert started[0].activity_task_started_event_attributes.identity == f"node:{a}", "histories name the node"

        service = node_a.workflow_service
        # Another node's queue, the control-plane queue, workflow tasks.
        for queue in (f"node/{b}", "gpufleet", control_queue):
            await refused(service.poll_activity_task_queue(PollActivityTaskQueueRequest(
                namespace="default", task_queue=TaskQueue(name=queue))))
        await refused(service.poll_workflow_task_queue(PollWorkflowTaskQueueRequest(
            namespace="default", task_queue=TaskQueue(name=f"node/{a}"))))
        # Start, signal, signal-with-start, update, query, list, describe, history, schedules.
        target = node_a.get_workflow_handle(handle.id)
        await refused(node_a.start_workflow("SpotReclaim", {"node_name": b}, id=f"reclaim/{b}", task_queue="gpufleet"))
        await refused(node_a.start_workflow("Node", {"node_name": b}, id=f"node/{b}", task_queue="gpufleet",
                                            start_signal="health_report", start_signal_args=[{}]))
        await refused(node_a.get_workflow_handle(f"node/{b}").signal("health_report", {}))
        await refused(node_a.get_workflow_handle(f"site/x").execute_update("admit_repair", {}))
        await refused(node_a.get_workflow_handle(f"node/{a}").query("status"))
        await refused(target.describe())
        await refused(service.get_workflow_execution_history(GetWorkflowExecutionHistoryRequest(
            namespace="default", execution=WorkflowExecution(workflow_id=handle.id))))
        await refused(node_a.count_workflows())

        async def listing() -> None:
            async for _ in node_a.list_workflows():
                pass

        await refused(listing())
        async def schedules() -> None:
            async for _ in await node_a.list_schedules():
                pass

        await refused(schedules())
        await refused(target.terminate("no"))

        # A task token delivered to B: A can neither complete nor heartbeat it; B can.
        handle_b = await control.start_workflow("GatewayEcho", [f"node/{b}", "echo", "for b"],
                                                id=f"gw-{uuid.uuid4().hex[:6]}", task_queue=control_queue)
        task = await node_b.workflow_service.poll_activity_task_queue(PollActivityTaskQueueRequest(
            namespace="default", task_queue=TaskQueue(name=f"node/{b}"), identity="b"))
        assert task.task_token
        payload = (await control.data_converter.encode(["completed by B"]))[0]
        await refused(service.respond_activity_task_completed(RespondActivityTaskCompletedRequest(
            namespace="default", task_token=task.task_token)))
        await refused(service.record_activity_task_heartbeat(RecordActivityTaskHeartbeatRequest(
            namespace="default", task_token=task.task_token)))
        from temporalio.api.common.v1 import Payloads

        await node_b.workflow_service.respond_activity_task_completed(RespondActivityTaskCompletedRequest(
            namespace="default", task_token=task.task_token, result=Payloads(payloads=[payload])))
        assert await asyncio.wait_for(handle_b.result(), 20) == "completed by B"
    lines = [r.getMessage() for r in caplog.records if r.name == "gpufleet.node_gateway"]
    assert any(a in line and "StartWorkflowExecution" in line for line in lines), "refusals name the node"
    assert any(a in line and "RespondActivityTaskCompleted" in line and "did not deliver" in line for line in lines)


async def test_the_gateway_counts_what_it_forwards_and_refuses_on_its_metrics_page(temporal_env, nodes) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from workers.gateway.proxy import GatewayCollector

    gw = gateway(temporal_env)
    registry = CollectorRegistry()
    registry.register(GatewayCollector(gw.running.gateway))

    def sample(name: str) -> float:
        page = generate_latest(registry).decode()
        return next(s.value for f in text_string_to_metric_families(page) for s in f.samples if s.name == name)

    a, b = nodes
    node_a = await as_node(gw, a)
    refused_before = sample("gpufleet_gateway_refused_total")
    await refused(node_a.workflow_service.poll_activity_task_queue(PollActivityTaskQueueRequest(
        namespace="default", task_queue=TaskQueue(name=f"node/{b}")), retry=False))
    assert sample("gpufleet_gateway_refused_total") >= refused_before + 1
    assert sample("gpufleet_gateway_forwarded_total") > 0  # node A's start-up calls
    assert sample("gpufleet_gateway_nodes") >= 1


async def test_other_ca_expired_missing_or_non_node_certificates_are_refused(temporal_env, nodes) -> None:
    a, _b = nodes
    gw = gateway(temporal_env)
    assert await (await as_node(gw, a)).workflow_service.get_system_info(
        __import__("temporalio.api.workflowservice.v1", fromlist=["x"]).GetSystemInfoRequest())
    with pytest.raises(RuntimeError):  # the TLS handshake fails: another CA
        await as_node(gw, a, pki=Pki.create("someone else's CA"))
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)
    with pytest.raises(RuntimeError):  # expired an hour ago
        await as_node(gw, a, not_before=past, lifetime=dt.timedelta(hours=1))
    with pytest.raises(RuntimeError):  # no client certificate at all
        await Client.connect(gw.access.address, tls=TLSConfig(server_root_ca_cert=gw.pki.ca_pem, domain="localhost"))
    # Signed by the right CA, but not a node's certificate.
    from cryptography.hazmat.primitives.asymmetric import ec

    from workers.gateway.node_identity import pem_private_key, subject_name

    key = ec.generate_private_key(ec.SECP256R1())
    admin = gw.pki._issue(subject_name("admin", "system:masters"), key.public_key(), dt.timedelta(hours=1),
                          [x509.ExtendedKeyUsageOID.CLIENT_AUTH])
    with pytest.raises(RuntimeError) as caught:
        await connect_via_gateway(gw.access, "default", admin, pem_private_key(key))
    assert "PermissionDenied" in str(caught.value) or "not a node certificate" in str(caught.value)


async def test_a_node_accepts_the_gateway_certificate_the_production_page_makes(
        temporal_env, nodes, tmp_path, monkeypatch) -> None:
    """docs/production/index.md, "The node gateway", as an operator follows it: its openssl lines
    make the certificate the gateway serves (the files its kubectl line puts in
    gpufleet-node-gateway-tls), and ``gpufleet cluster node-config --config
    deploy/sites.example.yaml``, run where they were made, renders the ConfigMap the DaemonSet
    gives each agent: the endpoint's name to check and the CA that signed that certificate. A
    node checking the gateway that way (its TLS is the agent's own) gets through."""
    import yaml
    from typer.testing import CliRunner

    from cli.cluster import cluster_app

    require("openssl")
    page = ROOT / "docs" / "production" / "index.md"
    run_openssl_lines(shell_block(page, "gpufleet-node-gateway-tls"), tmp_path)
    served = secrets_as_written(page.read_text())["gpufleet-node-gateway-tls"]
    monkeypatch.chdir(tmp_path)  # the example's `ca: {file: node-gateway-ca.crt}` is read from here
    example = ROOT / "deploy" / "sites.example.yaml"
    rendered = CliRunner().invoke(cluster_app, ["node-config", "--config", str(example)])
    assert rendered.exit_code == 0, rendered.output
    agents = yaml.safe_load(rendered.stdout)["data"]
    assert agents["ca.crt"] == (tmp_path / "node-gateway-ca.crt").read_text()
    cluster_ca = Pki.create("the cluster CA")  # signs the kubelets' client certificates
    gw = await start_test_gateway(temporal_env.client, cluster_ca, cert=(tmp_path / served["tls.crt"]).read_bytes(),
                                  key=(tmp_path / served["tls.key"]).read_bytes())
    try:
        as_configured = GatewayAccess(gw.access.address, agents["ca.crt"].encode(), agents["server-name"])
        a, _b = nodes
        key, csr = node_key_and_csr(a)
        node = await connect_via_gateway(as_configured, "default", cluster_ca.sign_node_csr(csr, a), key)
        assert await node.workflow_service.get_system_info(GetSystemInfoRequest())
        with pytest.raises(RuntimeError):  # the name checked is the certificate's, not any
            await connect_via_gateway(GatewayAccess(gw.access.address, agents["ca.crt"].encode(), "gateway.elsewhere"),
                                      "default", cluster_ca.sign_node_csr(csr, a), key)
    finally:
        await gw.running.stop()


async def test_a_retired_nodes_certificate_stops_working(temporal_env) -> None:
    name = f"gw-c-{uuid.uuid4().hex[:6]}"
    await live_node(temporal_env.client, name)
    node = await as_node(gateway(temporal_env), name)
    poll = PollActivityTaskQueueRequest(namespace="default", task_queue=TaskQueue(name=f"node/{name}"))
    await temporal_env.client.get_workflow_handle(f"node/{name}").terminate("retired")
    await asyncio.sleep(1.1)  # the gateway's verdict cache (1 s)
    with pytest.raises(RPCError) as caught:
        await node.workflow_service.poll_activity_task_queue(poll)
    assert caught.value.status == RPCStatusCode.PERMISSION_DENIED and "retired" in caught.value.message


async def test_a_node_retired_by_the_common_retire_step_is_refused_at_once(stack: Stack) -> None:
    """Retired while its Node entity still runs (the entity learns only when its watch gives
    up, minutes later): the gateway, asking the cluster too, refuses the node within ~1 s."""
    joined = (await (await stack.start_join({"site": "site-a"})).result())["nodes"][0]
    name, machine = joined["node_name"], joined["machine_id"]
    pki = Pki.create("gpufleet retire-test CA")
    cert, key = pki.server_cert()
    settings = Settings(address=stack.settings.address, namespace=stack.settings.namespace)
    running = await start_gateway(settings, cert, key, pki.ca_pem, token_keys_as_deployed(),
                                  live=node_liveness(stack.client, stack.cluster))
    try:
        node_cert, node_key, _ = bound_credentials(stack.cluster, pki, name, machine)
        node = await connect_via_gateway(GatewayAccess(running.address, pki.ca_pem), "default", node_cert, node_key)
        from temporalio.api.workflowservice.v1 import GetSystemInfoRequest

        await node.workflow_service.get_system_info(GetSystemInfoRequest())  # live: entity runs, Node exists
        await retire(stack, "site-a", name, machine)
        # The gateway's verdict cache (1 s) is all that may still serve it.
        refused = await refused_once_its_verdict_is_stale(
            lambda: node.workflow_service.get_system_info(GetSystemInfoRequest()))
        assert "retired" in refused.message, refused
        entity = await stack.client.get_workflow_handle(f"node/{name}").describe()
        assert entity.status.name == "RUNNING", "refused by the Node record, not because the entity ended"
    finally:
        await running.stop(grace=None)


async def test_a_node_whose_entity_ended_is_refused_within_the_entity_window(stack: Stack) -> None:
    """The Node object is read on every lookup; a running entity is taken as running for
    ``entity_seen_seconds``. An entity ended some other way (an operator terminated it), its
    Node object left behind, still loses the node its access within that window."""
    joined = (await (await stack.start_join({"site": "site-a"})).result())["nodes"][0]
    name = joined["node_name"]
    _cert, _key, fingerprint = bound_credentials(stack.cluster, Pki.create(), name, joined["machine_id"])
    window = 1.0
    live = node_liveness(stack.client, stack.cluster, entity_seen_seconds=window)
    assert await live(name, fingerprint) is Verdict.LIVE
    await stack.client.get_workflow_handle(f"node/{name}").terminate("ended by an operator")
    await asyncio.sleep(window + 0.2)  # the window over: the next lookup asks Temporal again
    assert await live(name, fingerprint) is not Verdict.LIVE, "the node kept its access past the window"
    assert stack.cluster.get_node(name) is not None, "refused for its entity, its Node object is still there"


async def test_a_node_the_gateway_cannot_verify_gets_a_retryable_error_not_a_revocation(temporal_env) -> None:
    """While the control plane cannot be asked (static stability), a node's calls are still not
    forwarded, but it hears UNAVAILABLE (retry) rather than PERMISSION_DENIED (revoked), and
    the first answer after the control plane is back lets it through."""
    name = f"gw-u-{uuid.uuid4().hex[:6]}"
    await live_node(temporal_env.client, name)
    reachable = {"now": True}

    async def check(node: str, key: str) -> Verdict:
        if not reachable["now"]:
            raise ConnectionError("control plane unreachable")
        return await node_liveness(temporal_env.client, None)(node, key)

    pki = Pki.create("gpufleet unavailable-test CA")
    cert, key = pki.server_cert()
    settings = Settings(address=temporal_env.client.service_client.config.target_host, namespace="default")
    running = await start_gateway(settings, cert, key, pki.ca_pem, token_keys_as_deployed(), live=check, live_ttl=0.2)
    try:
        node_key, csr = node_key_and_csr(name)
        node = await connect_via_gateway(GatewayAccess(running.address, pki.ca_pem), "default",
                                         pki.sign_node_csr(csr, name), node_key)
        from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest

        reachable["now"] = False
        await asyncio.sleep(0.3)  # past the verdict cache's TTL
        with pytest.raises(RPCError) as caught:
            await node.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace="default"), retry=False)
        assert caught.value.status == RPCStatusCode.UNAVAILABLE, caught.value
        reachable["now"] = True
        await node.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace="default"))
    finally:
        await running.stop(grace=None)
        await temporal_env.client.get_workflow_handle(f"node/{name}").terminate("test over")


async def test_liveness_verdicts_are_renewed_ahead_and_never_older_than_the_ttl() -> None:
    """A busy node never waits for a lookup, yet a changed verdict shows within the TTL; a
    lookup that fails answers "cannot tell" (None: the gateway refuses as UNAVAILABLE) and is
    not remembered."""
    verdict, lookups, fail = {"n": True}, [], []

    async def check(name: str, key: str) -> bool:
        lookups.append(name)
        await asyncio.sleep(0.02)
        if fail:
            raise RuntimeError("temporal unreachable")
        return verdict[name]

    cache = LiveCache(check, ttl=0.4)
    assert await cache("n") and len(lookups) == 1
    assert await cache("n") and len(lookups) == 1, "fresh: no lookup"
    await asyncio.sleep(0.25)  # past half the TTL: answered at once, renewed in the background
    verdict["n"] = False
    assert await cache("n") is True, "the cached verdict, at once"
    await asyncio.sleep(0.05)
    assert len(lookups) == 2 and await cache("n") is False, "the renewed verdict"
    await asyncio.sleep(0.45)  # expired: this call waits for the lookup
    verdict["n"] = True
    assert await cache("n") is True and len(lookups) == 3
    await asyncio.sleep(0.45)
    fail.append(1)
    assert await cache("n") is None and await cache("n") is None and len(lookups) == 5, "not cached"
    fail.clear()
    assert await cache("n") is True


async def test_a_cluster_token_no_header_can_carry_is_never_logged_by_the_gateway(tmp_path, caplog) -> None:
    """The gateway logs why it cannot tell a node's liveness: when the cluster's token holds a line
    break, http.client's refusal quotes the whole Authorization header; the log names where the
    token comes from instead."""
    from providers.cluster.kubernetes import KubernetesCluster
    from tests.cluster.fake_apiserver import FakeKube

    caplog.set_level(logging.DEBUG)
    secret = "gpufleet-t0ken-3f9c1e7a"
    fake = FakeKube().start()
    try:
        kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig", {"token": f"{secret}\nrest"})
        # The cluster is asked first (identity record, bound keys): Temporal is never reached.
        cache = LiveCache(node_liveness(None, KubernetesCluster(kubeconfig=kubeconfig)))
        assert await cache("gpu-1", "key") is None, "cannot tell: refused as UNAVAILABLE"
    finally:
        fake.stop()
    assert "liveness of gpu-1 unknown" in caplog.text and kubeconfig in caplog.text
    assert secret not in caplog.text


async def test_a_restarted_gateway_takes_the_heartbeats_and_result_of_a_task_delivered_before(
        temporal_env, nodes, tmp_path) -> None:
    """A task delivered to the node, then the gateway restarted (a new instance, the same key
    from the same Secret: every control-plane upgrade rolls it): the agent's next heartbeat and
    its result go through the new gateway, and the workflow proceeds on the same attempt. The
    gateway used to remember delivered tokens in memory only: the new one refused both, and the
    activity waited out its heartbeat timeout (a watch's is 10 minutes) to be tried again."""
    a, _b = nodes
    control = temporal_env.client
    first = await start_test_gateway(control, token_keys=token_keys_as_deployed(tmp_path / "token-keys"))
    port = first.running.port
    key, csr = node_key_and_csr(a)
    node = await connect_via_gateway(first.access, "default", first.pki.sign_node_csr(csr, a), key)
    control_queue = f"{ECHO_QUEUE_PREFIX}-{uuid.uuid4().hex[:6]}"
    second = None
    RELEASED.clear()
    try:
        async with Worker(control, task_queue=control_queue, workflows=[GatewayEcho],
                          workflow_runner=UnsandboxedWorkflowRunner()), \
                Worker(node, task_queue=f"node/{a}", activities=[beat_until_released]):
            handle = await control.start_workflow(
                "GatewayEcho", [f"node/{a}", "beat_until_released", "survived"],
                id=f"gw-{uuid.uuid4().hex[:6]}", task_queue=control_queue)
            restarted = await heartbeat_after(handle, None)  # delivered through the first, beating
            await first.running.stop(grace=None)
            await asyncio.sleep(1.0)
            # The pod started again: the same Secret, read from its mount as at any start.
            second = await start_test_gateway(control, pki=first.pki, port=port, cert=first.cert, key=first.key,
                                              token_keys=keys_from_mount(tmp_path / "token-keys"))
            await heartbeat_after(handle, restarted)  # a heartbeat the new gateway forwarded
            RELEASED.set()
            result = await asyncio.wait_for(handle.result(), 30)
        assert result == "attempt 1: survived", "the task delivered before the restart was answered, not retried"
        assert second.running.gateway.stats.refused == 0, second.running.gateway.stats.refusals
    finally:
        RELEASED.set()
        if second is not None:
            await second.running.stop(grace=None)


async def heartbeat_after(handle, since, timeout: float = 30):
    """The time of the activity's last heartbeat the server took, once it is later than ``since``
    (None: any); it fails when none comes within ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        pending = (await handle.describe()).raw_description.pending_activities
        if pending and pending[0].HasField("last_heartbeat_time"):
            beat = pending[0].last_heartbeat_time.ToDatetime()
            if since is None or beat > since:
                assert pending[0].attempt == 1, f"the activity was tried again: attempt {pending[0].attempt}"
                return beat
        assert asyncio.get_running_loop().time() < deadline, \
            f"no heartbeat taken since {since} (the gateway refused it?); pending: {pending}"
        await asyncio.sleep(0.2)


async def test_health_arrives_through_the_pulled_watch(stack: Stack, temporal_env) -> None:
    """A joined node's entity was started by the join (attributes from the join's record) and
    learns of a fault from its watch on the node's own queue, through the gateway."""
    gw = gateway(temporal_env)
    handle = await stack.start_join({"site": "site-a"})
    result = await handle.result()
    node, machine = result["nodes"][0]["node_name"], result["nodes"][0]["machine_id"]
    entity = stack.client.get_workflow_handle(f"node/{node}")
    attributes = (await entity.describe()).typed_search_attributes
    assert (attributes.get(sa.SITE), attributes.get(sa.PROVIDER), attributes.get(sa.NODE_NAME)) == \
        ("site-a", "lambda", node)
    assert node in gw.running.gateway.stats.serials, "the agent came through the gateway"
    # The entity starts from what the node showed in the join's smoke test (its own queue too):
    # the node's boot and GPUs are known at admission, with no activity to read them again.
    status = await entity.query("status")
    assert status["site"] == "site-a" and status["boot_id"] and status["reports"] == 1
    history = await entity.fetch_history()
    first = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
             if e.HasField("activity_task_scheduled_event_attributes")]
    assert first[:1] == ["watch_node"], f"the first activity is the watch, got {first}"
    stack.world.inject_fault(machine, 1, "xid", 13, clears_on="reset")  # application XID: counted, no repair

    async def counted():
        status = await entity.query("status")
        return status if status["app_xids"].get("13") == 1 else None

    deadline = asyncio.get_running_loop().time() + 20
    while not await counted():
        assert asyncio.get_running_loop().time() < deadline, "the fault never arrived"
        await asyncio.sleep(0.1)
    history = await entity.fetch_history()
    kinds = [e.activity_task_scheduled_event_attributes for e in history.events
             if e.HasField("activity_task_scheduled_event_attributes")]
    watches = [k for k in kinds if k.activity_type.name == "watch_node"]
    assert watches and all(k.task_queue.name == f"node/{node}" for k in watches)
    assert not any(e.HasField("workflow_execution_signaled_event_attributes") for e in history.events), \
        "nothing signalled: the node answered its watch"
    await replay_and_record(entity, "node_entity_watch_from_join_state")


async def test_site_admits_repairs_only_for_its_own_nodes(stack: Stack) -> None:
    result = await (await stack.start_join({"site": "site-a"})).result()
    node = result["nodes"][0]["node_name"]
    site = await stack.client.start_workflow("Site", {"site": "site-a"}, id="site/site-a",
                                             task_queue=stack.settings.task_queue,
                                             id_conflict_policy=WorkflowIDConflictPolicy.TERMINATE_EXISTING)
    invented = await site.execute_update("admit_repair", {"site": "site-a", "node_name": "invented-1", "gpu": 0,
                                                          "reasons": ["XID 79"]})
    assert invented["repair"] is False and "not a node of site-a" in invented["why"]
    real = await site.execute_update("admit_repair", {"site": "site-a", "node_name": node, "gpu": 0,
                                                      "reasons": ["XID 79"]})
    assert real["repair"] is True
    status = await site.query("status")
    assert "invented-1" not in str(status["incident"]["failing"]), "an unknown name never counts"
    await replay_and_record(site, "site_admit_known_nodes")



def test_the_dev_keys_are_their_owners_only_whatever_was_there(tmp_path) -> None:
    """A CA key written into a ``ca.key`` left behind (its ``ca.pem`` lost in a crash), or a gateway
    key and token folder restored by ``cp`` with loose modes: ``touch(mode=0o600)`` and
    ``mkdir(exist_ok=True)`` kept the old mode, so the dev CA's key (which signs node certificates)
    and the task-token key were world-readable. Each is now its owner's only."""
    import stat

    from workers.gateway.pki import dev_gateway_files

    pki_dir = tmp_path / "pki"
    pki_dir.mkdir(mode=0o755)
    (pki_dir / "ca.key").write_text("left behind")
    (pki_dir / "token-keys").mkdir(mode=0o755)
    for loose in (pki_dir, pki_dir / "ca.key", pki_dir / "token-keys"):
        loose.chmod(0o777 if loose.is_dir() else 0o644)
    files = dev_gateway_files(tmp_path)
    assert (pki_dir / "ca.key").read_text().startswith("-----BEGIN"), "a new CA key was written"
    files["key"].chmod(0o644)  # the gateway's key restored by cp
    files = dev_gateway_files(tmp_path)

    def mode(path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    assert {name: mode(files[name]) for name in ("ca_key", "key")} == {"ca_key": 0o600, "key": 0o600}
    assert mode(files["token_keys"] / "current") == 0o600
    assert mode(pki_dir) == 0o700 and mode(files["token_keys"]) == 0o700


@pytest.mark.parametrize("common_name", ["system:node:node-1\n", "system:node:Node-1", "system:node:", "node-1"])
def test_a_certificate_names_a_node_only_by_its_whole_name(common_name: str) -> None:
    """The name after ``system:node:`` is taken whole: a pattern's ``$`` would take one line break
    after it, and ``node-1\\n`` is not ``node-1``."""
    from workers.gateway.node_identity import node_from_subject

    assert node_from_subject(common_name) is None
    assert node_from_subject("system:node:node-1") == "node-1"
