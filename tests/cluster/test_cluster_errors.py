"""Cluster errors are typed like provider errors (issue 13, item 4).

A permanent answer (422 invalid label value, 403 RBAC denial) leaves the Kubernetes adapter as
a named, non-retryable error and reaches a workflow as an ``ApplicationError`` of that type
after one attempt: against the real API server, ``tests/realk8s/test_adapter_objects.py``.

Here, against the fake API server, the answers a real one cannot be made to give on cue: a 409
on exactly the next N writes (re-read and tried again inside the adapter, and past its bound a
retryable ``ClusterConflict`` Temporal retries) and a 5xx (transient).
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.testing import ActivityEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.control_plane import ControlPlaneActivities
from activities.env import FleetEnv
from fleet.messages.nodes import PrepareNodeInput
from fleet.cluster import LABEL_SITE, UNPROVEN_TAINT
from fleet.config import load_config
from fleet.errors import NON_RETRYABLE_TYPES, ClusterConflict
from fleet.models import Node
from fleet.settings import Settings
from providers.cluster import kubernetes
from tests.conftest import write_fleet


@pytest.fixture
def activities(kube, tmp_path) -> ControlPlaneActivities:
    env = FleetEnv(Settings(state_dir=tmp_path), load_config(write_fleet(tmp_path)), kube)
    return ControlPlaneActivities(env)


def _patches(fake, resource: str = "nodes") -> int:
    return sum(1 for verb, _, res, _, _ in fake.requests if (verb, res) == ("patch", resource))


def _run(acts: ControlPlaneActivities, inp: PrepareNodeInput) -> Node:
    return ActivityEnvironment().run(acts.prepare_node, inp)


# -- the adapter ------------------------------------------------------------------------------
def test_a_conflict_is_read_again_then_bounded(kube, fake):
    # Fake: a 409 on exactly the next N writes is an injected fault; a real server gives conflicts
    # only to a racing writer (that case, real: tests/realk8s/test_adapter_objects.py, taints).
    fake.add_node("gpu-1")
    fake.fail("patch", "nodes", 409, "Conflict", times=2)
    node = kube.set_taints("gpu-1", add=[UNPROVEN_TAINT])
    assert UNPROVEN_TAINT in node.taints and _patches(fake) == 3

    fake.fail("patch", "nodes", 409, "Conflict")
    with pytest.raises(ClusterConflict, match="kept conflicting") as caught:
        kube.set_taints("gpu-1", remove=[UNPROVEN_TAINT])
    assert caught.value.retryable
    assert _patches(fake) == 3 + kubernetes._RETRY_CONFLICTS


@pytest.mark.parametrize("code", [500, 503])
def test_a_server_error_is_transient(kube, fake, code):
    # Fake: a real API server is not made to answer 500/503 on cue.
    fake.add_node("gpu-1")
    fake.fail("patch", "nodes", code, "InternalError", times=1)
    with pytest.raises(Exception) as caught:
        kube.cordon("gpu-1")
    assert type(caught.value).__name__ == "Transient" and caught.value.retryable


def test_the_cluster_types_are_named_non_retryable():
    assert {"ClusterForbidden", "ClusterInvalid", "NotFound"} <= set(NON_RETRYABLE_TYPES)
    assert "ClusterConflict" not in NON_RETRYABLE_TYPES and "Transient" not in NON_RETRYABLE_TYPES


# -- the activity boundary --------------------------------------------------------------------
def test_prepare_node_rides_out_a_few_conflicts(activities, fake):
    # Fake: a 409 on exactly the next N writes is an injected fault; a real server gives conflicts
    # only to a racing writer (that case, real: tests/realk8s/test_adapter_objects.py, taints).
    fake.add_node("gpu-1")
    fake.fail("patch", "nodes", 409, "Conflict", times=3)
    node = _run(activities, PrepareNodeInput(node_name="gpu-1", labels={LABEL_SITE: "site-a"},
                                             add_taints=[UNPROVEN_TAINT]))
    assert node.labels[LABEL_SITE] == "site-a" and UNPROVEN_TAINT in node.taints


# -- through Temporal, under a retry policy with no attempt limit ------------------------------
@workflow.defn(name="ClusterErrorsProbe", sandboxed=False)
class ClusterErrorsProbe:
    @workflow.run
    async def run(self, inp: PrepareNodeInput) -> Node:
        return await workflow.execute_activity(
            "prepare_node", inp, result_type=Node, start_to_close_timeout=timedelta(seconds=30),
            # Unbounded and no non-retryable types listed: the error's own non_retryable flag must end it.
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=100),
                                     maximum_interval=timedelta(milliseconds=200)),
        )


async def _execute(temporal_env, acts: ControlPlaneActivities, inp: PrepareNodeInput) -> Node:
    queue = f"cluster-errors-{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(4) as pool:
        async with Worker(temporal_env.client, task_queue=queue, workflows=[ClusterErrorsProbe],
                          activities=[acts.prepare_node], activity_executor=pool,
                          workflow_runner=UnsandboxedWorkflowRunner()):
            return await temporal_env.client.execute_workflow(
                ClusterErrorsProbe.run, inp, id=f"cluster-errors/{uuid.uuid4().hex[:8]}", task_queue=queue,
                execution_timeout=timedelta(seconds=60),
            )


async def test_conflicts_past_the_adapters_bound_are_retried_by_temporal(temporal_env, activities, fake):
    # Fake: a 409 on exactly the next N writes is an injected fault; a real server gives conflicts
    # only to a racing writer (that case, real: tests/realk8s/test_adapter_objects.py, taints).
    fake.add_node("gpu-1")
    # The first attempt meets only conflicts (ClusterConflict, retryable); the second wins.
    fake.fail("patch", "nodes", 409, "Conflict", times=kubernetes._RETRY_CONFLICTS + 2)
    node = await _execute(temporal_env, activities, PrepareNodeInput(node_name="gpu-1", labels={LABEL_SITE: "site-a"}))
    assert node.labels[LABEL_SITE] == "site-a"
    # and one more: the fleet taint every node of a site gets with its site label
    assert _patches(fake) == kubernetes._RETRY_CONFLICTS + 3 + 1
