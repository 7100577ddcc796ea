"""deploy/temporal is what the real cluster runs: the Helm values' shard count, stores, namespace
and retention, and the dynamic config file, each in effect on the running server.

The chart itself cannot be fetched here, so the proof is this tier's cluster: it is set up from
values.yaml and reads deploy/temporal/dynamic-config.yaml, and the tests below ask the running
services what they actually do with it.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import uuid
from datetime import timedelta

import pytest
import yaml
from temporalio.api.enums.v1 import TaskQueueKind, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import (
    DescribeNamespaceRequest,
    DescribeTaskQueueRequest,
    GetClusterInfoRequest,
    ListTaskQueuePartitionsRequest,
    PollActivityTaskQueueRequest,
)
from temporalio.service import RPCError, RPCStatusCode

from fleet import search_attributes as sa
from fleet.naming import CONTROL_PLANE_QUEUE
from tests.realtemporal.cluster import DEPLOY, DYNAMIC_CONFIG, VALUES, RealTemporal
from tests.realtemporal.conftest import CAN_NAMESPACE

#: The dev server's and a default cluster's cap on concurrent long polls per namespace, frontend and
#: API (``frontend.namespaceCount``): a fleet of 1,250 nodes holds more than this.
DEFAULT_POLL_CAP = 1200
FLEET_POLLS = 1300


def load(path):
    return yaml.safe_load(path.read_text())


def test_the_helm_values_carry_the_dynamic_config_file_verbatim() -> None:
    """The chart renders server.dynamicConfig into the ConfigMap every service reads: it must be
    the file this tier's cluster runs with, key for key."""
    assert load(VALUES)["server"]["dynamicConfig"] == load(DYNAMIC_CONFIG)


def test_the_10000_node_values_change_only_the_sizes() -> None:
    """The larger fleet keeps the shards per node of the tested 1,250-node values, and overrides
    neither the dynamic config nor the stores and namespaces the fixture proves."""
    base, large = load(VALUES)["server"], load(DEPLOY / "values-10000-nodes.yaml")["server"]
    shards = large["config"]["persistence"].pop("numHistoryShards")
    assert shards / 10_000 == pytest.approx(base["config"]["persistence"]["numHistoryShards"] / 1_250, rel=0.05)
    assert large["config"]["persistence"] == {} and set(large["config"]) == {"persistence"}
    assert set(large) == {"config", "frontend", "history", "matching"}
    assert all(set(large[service]) == {"replicaCount"} for service in ("frontend", "history", "matching"))
    assert large["frontend"]["replicaCount"] >= base["frontend"]["replicaCount"]


def test_the_server_knows_every_key_and_type_of_the_dynamic_config(temporal_server) -> None:
    """A misspelt key or a wrong type is silently ignored by a running server (the default stays);
    the server's own checker names it."""
    done = subprocess.run([str(temporal_server), "validate-dynamic-config", str(DYNAMIC_CONFIG)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "warning" not in (done.stdout + done.stderr).lower(), done.stdout + done.stderr


async def test_the_cluster_runs_the_shards_stores_and_namespace_the_values_name(real_temporal: RealTemporal,
                                                                                temporal_env) -> None:
    values = load(VALUES)["server"]["config"]
    client = temporal_env.client
    info = await client.workflow_service.get_cluster_info(GetClusterInfoRequest())
    assert info.history_shard_count == values["persistence"]["numHistoryShards"] >= 4
    assert (info.persistence_store, info.visibility_store) == ("postgres12", "postgres12")
    (namespace,) = values["namespaces"]["namespace"]
    described = await client.workflow_service.describe_namespace(
        DescribeNamespaceRequest(namespace=namespace["name"]))
    assert described.config.workflow_execution_retention_ttl.ToTimedelta() == timedelta(days=14)
    assert namespace["retention"] == "14d" and client.namespace == namespace["name"]
    # gpufleet's search attributes, in SQL visibility's columns, in both namespaces.
    for name in (namespace["name"], CAN_NAMESPACE):
        assert await sa.ensure_registered(await real_temporal.connect(namespace=name)) == []


def test_the_services_read_the_shipped_file_and_only_a_test_namespace_differs(real_temporal: RealTemporal) -> None:
    """The file every service was started with: the shipped one, then one key of this tier's own
    that applies to the continue-as-new namespace alone."""
    running = real_temporal.dynamic_config_path.read_text()
    assert running.startswith(DYNAMIC_CONFIG.read_text())
    for service in ("frontend", "history", "matching", "worker"):
        config = load(real_temporal.root / f"{service}.yaml")
        assert config["dynamicConfigClient"]["filepath"] == str(real_temporal.dynamic_config_path)
        assert config["persistence"]["numHistoryShards"] == load(VALUES)["server"]["config"]["persistence"][
            "numHistoryShards"]
    added = {key: value for key, value in load(real_temporal.dynamic_config_path).items()
             if key not in load(DYNAMIC_CONFIG)}
    assert added and all(entry["constraints"] == {"namespace": CAN_NAMESPACE}
                         for entries in added.values() for entry in entries)
    assert set(load(real_temporal.dynamic_config_path)) - set(added) == set(load(DYNAMIC_CONFIG))


async def test_the_control_plane_queue_has_its_partitions_and_a_node_queue_one(temporal_env) -> None:
    client = temporal_env.client

    async def partitions(queue: str) -> tuple[int, int]:
        listed = await client.workflow_service.list_task_queue_partitions(ListTaskQueuePartitionsRequest(
            namespace=client.namespace, task_queue=TaskQueue(name=queue, kind=TaskQueueKind.TASK_QUEUE_KIND_NORMAL)))
        return len(listed.workflow_task_queue_partitions), len(listed.activity_task_queue_partitions)

    assert await partitions(CONTROL_PLANE_QUEUE) == (4, 4)
    assert await partitions(f"node/{CONTROL_PLANE_QUEUE}-a1b2c3d4") == (1, 1)


async def test_one_frontend_holds_more_node_polls_than_the_default_cap(temporal_env) -> None:
    """1,300 agents' long polls at once (a 1,250-node fleet and its control plane): every one is held
    by the frontend; with the default cap of 1,200 about a hundred are refused at once."""
    client = temporal_env.client
    queue = f"node/poll-cap-{uuid.uuid4().hex[:6]}"  # one queue: the cap counts polls, not queues

    async def poll() -> str:
        request = PollActivityTaskQueueRequest(namespace=client.namespace, identity="poll-cap-test",
                                               task_queue=TaskQueue(name=queue))
        try:
            await client.workflow_service.poll_activity_task_queue(request, timeout=timedelta(seconds=6))
        except RPCError as error:
            return error.status.name
        return "answered"

    outcomes = await asyncio.gather(*(poll() for _ in range(FLEET_POLLS)))
    refused = outcomes.count(RPCStatusCode.RESOURCE_EXHAUSTED.name)
    assert FLEET_POLLS > DEFAULT_POLL_CAP
    assert refused == 0, f"{refused} of {FLEET_POLLS} polls refused: {sorted(set(outcomes))}"
    # Each was held until its own deadline (nothing to hand out on this queue).
    assert set(outcomes) <= {RPCStatusCode.DEADLINE_EXCEEDED.name, RPCStatusCode.CANCELLED.name, "answered"}


def test_the_cloud_steps_add_every_search_attribute_with_its_type() -> None:
    """Temporal Cloud has no `gpufleet search-attributes`: the README's tcld command is the list."""
    guide = (DEPLOY / "README.md").read_text()
    listed = dict(re.findall(r"--sa (\w+)=(\w+)", guide))
    assert listed == {key.name: key.indexed_value_type.name.removeprefix("INDEXED_VALUE_TYPE_").title()
                      for key in sa.ALL}


async def test_the_control_plane_runs_on_its_queue_with_a_poller_on_every_partition(stack) -> None:
    """The suite's stacks on this cluster run on the production queue (this tier's end-to-end tests
    with them), and the worker as built polls each of its four partitions, workflow and activity
    tasks alike: a partition no one polls only forwards its tasks to one that is polled, a hop for
    every task, and with fewer pollers than partitions some are always without one."""
    assert stack.settings.task_queue == CONTROL_PLANE_QUEUE
    handle = await stack.start_join({"site": "site-a"}, request=f"partitions-{uuid.uuid4().hex[:6]}")
    await handle.result()
    assert (await handle.describe()).task_queue == CONTROL_PLANE_QUEUE
    client = stack.client

    async def pollers(partition: str, kind: TaskQueueType.ValueType) -> set[str]:
        described = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
            namespace=client.namespace, task_queue=TaskQueue(name=partition, kind=TaskQueueKind.TASK_QUEUE_KIND_NORMAL),
            task_queue_type=kind))
        return {poller.identity for poller in described.pollers}

    names = [CONTROL_PLANE_QUEUE] + [f"/_sys/{CONTROL_PLANE_QUEUE}/{n}" for n in range(1, 4)]
    for kind in (TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY):
        without = [name for name in names if not await pollers(name, kind)]
        assert not without, f"{TaskQueueType.Name(kind)} partitions no one polls: {without}"
