"""A task token is the node's own, through any of the gateway's replicas and across its restarts:
each token the gateway hands a node is sealed for that node with the key every replica mounts
(``workers/gateway/task_tokens.py``), and a heartbeat or an answer is forwarded only when its
envelope opens for the calling node under the current or the previous key.

The nodes speak raw gRPC with their own certificates to gateways in front of the real Temporal
dev server; every gateway takes its keys as the shipped manifest gives them (the Secret's files
at the folder its environment names), from the Secret the production page's commands make.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from temporalio import workflow
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.failure.v1 import Failure
from temporalio.api.workflowservice.v1 import (
    PollActivityTaskQueueResponse,
    RecordActivityTaskHeartbeatRequest,
    RespondActivityTaskCanceledRequest,
    RespondActivityTaskCompletedRequest,
    RespondActivityTaskFailedRequest,
)
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

from fleet.settings import SettingsError
from tests.conftest import start_test_gateway
from tests.doc_recipes import ROOT, run_openssl_lines, secret_folder, secrets_in_order, shell_block
from tests.gateway_keys import TOKEN_KEY_SECRET, keys_from_mount, token_keys_as_deployed
from tests.security.gateway_helpers import (
    call,
    code_of,
    credentials,
    end_entity,
    live_entity,
    node_channel,
    poll_request,
    unique,
)
from tests.tools import require
from workers.gateway.pki import Pki
from workers.gateway.task_tokens import MAC_BYTES, TaskTokens, TokenKeys

OK, DENIED = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED
PAGE = ROOT / "docs" / "production" / "index.md"
DONE = Payloads(payloads=[Payload(metadata={"encoding": b"json/plain"}, data=b'"done"')])


@workflow.defn(name="SecurityTokenTask", sandboxed=False)
class TokenTask:
    """One activity on a node's queue (the node polls and answers it itself), tried once: an
    answer refused would show as the workflow's failure, never as a retry that hides it."""

    @workflow.run
    async def run(self, queue: str) -> str:
        return await workflow.execute_activity("token_task", task_queue=queue, result_type=str,
                                               start_to_close_timeout=timedelta(minutes=5),
                                               heartbeat_timeout=timedelta(minutes=5),
                                               retry_policy=RetryPolicy(maximum_attempts=1))


@pytest.fixture
async def nodes(temporal_env):
    """Two live nodes (their entities run)."""
    names = unique("tok-a"), unique("tok-b")
    for name in names:
        await live_entity(temporal_env.client, name)
    yield names
    for name in names:
        await end_entity(temporal_env.client, name)


@asynccontextmanager
async def replicas(client, *keys: TokenKeys):
    """One gateway per ``keys`` (replicas, or one gateway before and after a restart or a key
    rotation), the same CA and server certificate: (the CA, the gateways)."""
    pki = Pki.create("gpufleet token-test CA")
    cert, key = pki.server_cert()
    gateways = [await start_test_gateway(client, pki=pki, cert=cert, key=key, token_keys=k) for k in keys]
    try:
        yield pki, gateways
    finally:
        for gateway in gateways:
            await gateway.running.stop(grace=None)


@asynccontextmanager
async def connected(pki: Pki, gateways, name: str):
    """``name``'s connection to each of ``gateways``, with its one certificate."""
    node = credentials(pki, name)
    channels = [node_channel(gateway.access, node) for gateway in gateways]
    try:
        yield channels
    finally:
        for channel in channels:
            await channel.close()


async def deliver(client, queue: str, channel, name: str):
    """A TokenTask for node ``name``, its task polled through ``channel``: (its handle, the token
    the node was handed)."""
    handle = await client.start_workflow(TokenTask.run, f"node/{name}", id=unique("tok"), task_queue=queue)
    task = PollActivityTaskQueueResponse.FromString(
        await call(channel, "PollActivityTaskQueue")(poll_request(name), timeout=10))
    assert task.task_token, "the node was handed its task"
    return handle, task.task_token


async def heartbeat(channel, token: bytes) -> grpc.StatusCode:
    request = RecordActivityTaskHeartbeatRequest(namespace="default", task_token=token)
    return await code_of(call(channel, "RecordActivityTaskHeartbeat")(request.SerializeToString(), timeout=5))


async def answers(channel, token: bytes) -> list[grpc.StatusCode]:
    """How each answer to the task with ``token`` ended: completed, failed, canceled."""
    requests = {"RespondActivityTaskCompleted": RespondActivityTaskCompletedRequest(
                    namespace="default", task_token=token, result=DONE),
                "RespondActivityTaskFailed": RespondActivityTaskFailedRequest(
                    namespace="default", task_token=token, failure=Failure(message="no")),
                "RespondActivityTaskCanceled": RespondActivityTaskCanceledRequest(namespace="default", task_token=token)}
    return [await code_of(call(channel, method)(request.SerializeToString(), timeout=5))
            for method, request in requests.items()]


async def complete(channel, token: bytes) -> grpc.StatusCode:
    request = RespondActivityTaskCompletedRequest(namespace="default", task_token=token, result=DONE)
    return await code_of(call(channel, "RespondActivityTaskCompleted")(request.SerializeToString(), timeout=5))


def the_pages_keys(folder: Path) -> tuple[TokenKeys, list[TokenKeys]]:
    """docs/production/index.md as an operator follows it: the key its install block makes (the
    Secret its ``create secret`` line writes, mounted as the manifest mounts it), and the Secret of
    each step of its rotation block, each made in ``folder``."""
    install = shell_block(PAGE, "gpufleet-node-gateway-tls")
    run_openssl_lines(install, folder)
    ((_, installed),) = [s for s in secrets_in_order(install) if s[0] == TOKEN_KEY_SECRET]
    rotation = shell_block(PAGE, "previous=node-gateway-token.new")
    # Its first line reads the Secret's current key back into this file: the install's key.
    (folder / "node-gateway-token.old").write_bytes((folder / installed["current"]).read_bytes())
    run_openssl_lines(rotation, folder)
    steps = [keys for name, keys in secrets_in_order(rotation) if name == TOKEN_KEY_SECRET]
    assert [sorted(step) for step in steps] == [["current", "previous"]] * 2, steps
    mounted = [keys_from_mount(secret_folder(folder / f"mount-{n}", keys, folder))
               for n, keys in enumerate([installed, *steps])]
    return mounted[0], mounted[1:]


async def test_a_task_delivered_through_one_replica_is_answered_through_the_other(temporal_env, nodes) -> None:
    """The gateway's two replicas share the key: a node's task delivered by one takes its
    heartbeat and its result through the other (a node reconnecting lands on either); a second
    answer Temporal refuses. The replicas used to keep delivered tokens each in its own memory:
    the other refused both."""
    a, _b = nodes
    client = temporal_env.client
    queue = unique("tok-wf")
    keys = token_keys_as_deployed()
    async with Worker(client, task_queue=queue, workflows=[TokenTask]), replicas(client, keys, keys) as (pki, gws), \
            connected(pki, gws, a) as (first, second):
        handle, token = await deliver(client, queue, first, a)
        assert await heartbeat(second, token) == OK
        assert await complete(second, token) == OK
        assert await handle.result() == "done"
        assert [g.running.gateway.stats.refused for g in gws] == [0, 0]
        # Answered once: Temporal refuses it again (the gateway keeps nothing per token to).
        assert await complete(first, token) == grpc.StatusCode.NOT_FOUND


async def test_a_token_delivered_to_one_node_is_refused_from_another(temporal_env, nodes) -> None:
    """Node B holding node A's token (sniffed, guessed, passed on by a compromised A) can neither
    heartbeat it nor answer it in any way, through either replica; A still can."""
    a, b = nodes
    client = temporal_env.client
    queue = unique("tok-wf")
    keys = token_keys_as_deployed()
    async with Worker(client, task_queue=queue, workflows=[TokenTask]), replicas(client, keys, keys) as (pki, gws), \
            connected(pki, gws, a) as (a_first, a_second), connected(pki, gws, b) as b_channels:
        handle, token = await deliver(client, queue, a_first, a)
        for theirs in b_channels:
            assert await heartbeat(theirs, token) == DENIED
            assert await answers(theirs, token) == [DENIED] * 3
        assert await heartbeat(a_second, token) == OK
        assert await complete(a_second, token) == OK
        assert await handle.result() == "done", "nothing B sent reached the workflow"


async def test_an_altered_or_forged_token_is_refused(temporal_env, nodes) -> None:
    """Whatever a node makes of the envelope it was handed (its MAC or the token inside changed,
    cut short, Temporal's token bare, another version, one sealed with a key the gateway does not
    hold) is refused; the envelope as handed still works."""
    a, _b = nodes
    client = temporal_env.client
    queue = unique("tok-wf")
    async with Worker(client, task_queue=queue, workflows=[TokenTask]), \
            replicas(client, token_keys_as_deployed()) as (pki, gws), connected(pki, gws, a) as (channel,):
        handle, token = await deliver(client, queue, channel, a)
        kind_size = token[1 + MAC_BYTES]
        kind, inner = token[2 + MAC_BYTES:2 + MAC_BYTES + kind_size], token[2 + MAC_BYTES + kind_size:]
        assert kind, "the envelope names the task's activity type"
        forged = {
            "its MAC changed": token[:1] + bytes([token[1] ^ 1]) + token[2:],
            "the token inside changed": token[:-1] + bytes([token[-1] ^ 1]),
            "cut short": token[:-1],
            "Temporal's token bare": inner,
            "another version": b"\x03" + token[1:],
            "the first version, its type left out": b"\x01" + token[1:1 + MAC_BYTES] + inner,
            "another type": token[:2 + MAC_BYTES] + bytes([kind[0] ^ 1]) + token[3 + MAC_BYTES:],
            "no type": token[:1 + MAC_BYTES] + b"\x00" + inner,
            "sealed with another key": TaskTokens(token_keys_as_deployed()).seal(a, inner, kind.decode()),
            "empty": b"",
        }
        for what, made in forged.items():
            assert await heartbeat(channel, made) == DENIED, what
            assert await answers(channel, made) == [DENIED] * 3, what
        assert await complete(channel, token) == OK
        assert await handle.result() == "done"


async def test_a_key_rotation_as_the_production_page_does_it_refuses_only_keys_no_longer_held(
        temporal_env, nodes, tmp_path) -> None:
    """The page's two-step rotation: after step 1 (every replica accepts the new key) a replica of
    step 2 may bind tokens with it; a replica still on step 1 takes them, one still on the install's
    key alone would not (why step 1 comes first). A token bound with the old key is taken through
    step 2 (the previous key), and refused once a later rotation has dropped that key."""
    require("openssl")
    installed, (step_1, step_2) = the_pages_keys(tmp_path)
    assert (step_1.current, step_1.previous) == (installed.current, step_2.current)
    assert (step_2.current, step_2.previous) == (step_1.previous, installed.current)
    later = token_keys_as_deployed(tmp_path / "later", previous=step_2.current)  # the next rotation's step 2
    a, _b = nodes
    client = temporal_env.client
    queue = unique("tok-wf")
    async with Worker(client, task_queue=queue, workflows=[TokenTask]), \
            replicas(client, installed, step_1, step_2, later) as (pki, gws), \
            connected(pki, gws, a) as (on_install, on_step_1, on_step_2, on_later):
        handle, old = await deliver(client, queue, on_install, a)  # bound with the install's key
        assert await heartbeat(on_step_1, old) == OK
        assert await heartbeat(on_step_2, old) == OK
        assert await heartbeat(on_later, old) == DENIED, "a key no longer current or previous opens nothing"
        assert await complete(on_step_2, old) == OK
        assert await handle.result() == "done"

        handle, new = await deliver(client, queue, on_step_2, a)  # bound with the new key
        assert await heartbeat(on_step_1, new) == OK
        assert await heartbeat(on_install, new) == DENIED, "a replica without the new key refuses it"
        assert await complete(on_later, new) == OK
        assert await handle.result() == "done"


async def test_the_metrics_page_shows_when_the_previous_key_stops_opening_tokens(temporal_env, nodes,
                                                                                  tmp_path) -> None:
    """What the rotation's last step waits for: a replica of step 2 counts each token it opens by
    the key that opened it (``gpufleet_gateway_task_tokens_opened_total``, ``key`` current or
    previous). A token bound before the rotation rises the previous key's count; once nodes answer
    only tasks delivered since, only the current key's rises, and the previous key can go. Before,
    no figure told the operator when that was."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from workers.gateway.proxy import GatewayCollector

    old = token_keys_as_deployed(tmp_path / "old")
    rotated = token_keys_as_deployed(tmp_path / "rotated", previous=old.current)
    a, _b = nodes
    client = temporal_env.client
    queue = unique("tok-wf")
    async with Worker(client, task_queue=queue, workflows=[TokenTask]), \
            replicas(client, old, rotated) as (pki, (before, after)), \
            connected(pki, (before, after), a) as (on_old, on_rotated):
        registry = CollectorRegistry()
        registry.register(GatewayCollector(after.running.gateway))

        def opened() -> dict[str, float]:
            page = generate_latest(registry).decode()
            return {s.labels["key"]: s.value for f in text_string_to_metric_families(page) for s in f.samples
                    if s.name == "gpufleet_gateway_task_tokens_opened_total"}

        assert opened() == {"current": 0, "previous": 0}
        handle, bound_before = await deliver(client, queue, on_old, a)
        assert await heartbeat(on_rotated, bound_before) == OK
        assert await complete(on_rotated, bound_before) == OK
        await handle.result()
        assert opened() == {"current": 0, "previous": 2}, "a token bound before the rotation"
        handle, bound_after = await deliver(client, queue, on_rotated, a)
        assert await heartbeat(on_rotated, bound_after) == OK
        assert await complete(on_rotated, bound_after) == OK
        await handle.result()
        assert opened() == {"current": 2, "previous": 2}, "only the current key's count rises now"
        assert await heartbeat(on_rotated, b"\x01" + b"x" * 40) == DENIED
        assert opened() == {"current": 2, "previous": 2}, "what opens under no key is counted by neither"


async def test_the_key_is_never_in_a_log_line_or_an_error(temporal_env, nodes, tmp_path, caplog) -> None:
    """The key is a secret: not in the gateway's log (its refusals included), not in what a
    refused node hears, not in ``TokenKeys``' repr, not in the error of a key that is refused."""
    caplog.set_level(logging.DEBUG)
    keys = token_keys_as_deployed(tmp_path / "keys", previous=b"p" * 64)
    secrets = [keys.current.decode(), keys.previous.decode()]
    a, b = nodes
    client = temporal_env.client
    queue = unique("tok-wf")
    heard = []
    async with Worker(client, task_queue=queue, workflows=[TokenTask]), replicas(client, keys) as (pki, gws), \
            connected(pki, gws, a) as (channel,), connected(pki, gws, b) as (theirs,):
        handle, token = await deliver(client, queue, channel, a)
        for made in (token, token[:-1], b"\x01" + b"k" * 40):
            request = RecordActivityTaskHeartbeatRequest(namespace="default", task_token=made).SerializeToString()
            try:
                await call(theirs, "RecordActivityTaskHeartbeat")(request, timeout=5)
            except grpc.aio.AioRpcError as error:
                heard.append(error.details() or "")
        assert await complete(channel, token) == OK
        await handle.result()
    assert len(heard) == 3 and all("did not deliver to this node" in h for h in heard), heard
    assert "did not deliver" in caplog.text, "the refusals were logged"
    for secret in secrets:
        assert secret not in caplog.text and not any(secret in h for h in heard)
        assert secret not in repr(keys)
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "current").write_text("s3cr3t-but-short")
    with pytest.raises(SettingsError) as refused:
        keys_from_mount(tmp_path / "short")
    assert "s3cr3t" not in str(refused.value) and "GPUFLEET_GATEWAY_TOKEN_KEYS" in str(refused.value)
    with pytest.raises(SettingsError) as missing:
        keys_from_mount(tmp_path / "none")
    assert "current" in str(missing.value), missing.value


@pytest.mark.parametrize("size", [1, 127, 128, 300, 20_000])
def test_the_token_a_node_is_handed_replaces_temporals_and_nothing_else_of_the_task(size: int) -> None:
    """The poll's answer is passed on undecoded but for its token (field 1, which serializers
    write first): it is replaced by the envelope, never added beside it (a parser keeps the last
    of a repeated field); an answer whose token does not lead is decoded and rebuilt."""
    from temporalio.api.common.v1 import ActivityType, WorkflowExecution

    from workers.gateway.proxy import _task_token, _with_task_token

    token = bytes(range(256)) * (size // 256) + b"t" * (size % 256)
    task = PollActivityTaskQueueResponse(task_token=token, activity_id="a1", attempt=3,
                                         activity_type=ActivityType(name="watch_node"),
                                         workflow_execution=WorkflowExecution(workflow_id="node/n1", run_id="r"),
                                         input=DONE)
    sealed = TaskTokens(token_keys_as_deployed()).seal("n1", token)
    rest_first = PollActivityTaskQueueResponse(activity_id="a1").SerializeToString()
    for response in (task.SerializeToString(),
                     # the same fields, the token last (any field order is valid protobuf)
                     rest_first + PollActivityTaskQueueResponse(
                         task_token=token, attempt=3, activity_type=task.activity_type,
                         workflow_execution=task.workflow_execution, input=DONE).SerializeToString()):
        delivered, rest = _task_token(response)
        assert delivered == token
        handed = PollActivityTaskQueueResponse.FromString(_with_task_token(sealed, rest))
        expected = PollActivityTaskQueueResponse()
        expected.CopyFrom(task)
        expected.task_token = sealed
        assert handed == expected
