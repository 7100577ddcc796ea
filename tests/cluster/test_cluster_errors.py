"""Cluster errors are typed like provider errors (issue 13, item 4).

A permanent answer (422 invalid label value, 403 RBAC denial) leaves the Kubernetes adapter as
a named, non-retryable error and reaches a workflow as an ``ApplicationError`` of that type
after one attempt: against the real API server, ``tests/realk8s/test_adapter_objects.py``.

Here, against the fake API server, the answers a real one cannot be made to give on cue: a 409
on exactly the next N writes (re-read and tried again inside the adapter, and past its bound a
retryable ``ClusterConflict`` Temporal retries) and a 5xx (transient); and the requests the
client never sends or never has answered (a token no header can carry, a proxy that is down),
whose failures quote the request and stay out of our errors.
"""

from __future__ import annotations

import logging
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from kubernetes import client as k8s
from temporalio import workflow
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.testing import ActivityEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.capacity import CapacityActivities
from activities.env import FleetEnv
from fleet.messages.capacity import SiteNode, SiteNodesInput
from fleet.cluster import FLEET_TAINT, LABEL_SITE, LABEL_ZONE, UNPROVEN_TAINT
from fleet.config import load_config
from fleet.errors import NON_RETRYABLE_TYPES, ClusterConflict, ClusterForbidden, ClusterInvalid, Transient
from fleet.settings import Settings
from providers.cluster import kubernetes
from providers.cluster.kubernetes import KubernetesCluster, load_api_client
from tests.conftest import write_fleet
from tests.ports import free_port


@pytest.fixture
def activities(kube, tmp_path) -> CapacityActivities:
    env = FleetEnv(Settings(state_dir=tmp_path), load_config(write_fleet(tmp_path)), kube)
    return CapacityActivities(env)


def _patches(fake, resource: str = "nodes") -> int:
    return sum(1 for verb, _, res, _, _ in fake.requests if (verb, res) == ("patch", resource))


#: The Site entity's reconcile (``site_nodes``): it writes a node of the site that lacks the site's
#: placement labels and the fleet taint, one label patch and one taint patch.
SITE = SiteNodesInput(site="site-a")


def _run(acts: CapacityActivities, inp: SiteNodesInput) -> list[SiteNode]:
    return ActivityEnvironment().run(acts.site_nodes, inp)


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


def test_a_strictly_refused_patch_names_the_field_and_quotes_nothing_of_the_node(kube, fake):
    # Fake: the adapter's node patches write only fields every Kubernetes declares. The answer is
    # a real API server's to a merge patch refused by strict field validation (kube-apiserver
    # v1.36, as tests/realk8s/test_adapter_routing.py meets it for a Service): it quotes the
    # whole patched object, here a Node whose annotation its (hostile) node wrote.
    fake.add_node("gpu-1")
    node_wrote = r'strict decoding error: unknown field \"spec.podCIDR\" (hunter2)'
    patched = '{\\"kind\\":\\"Node\\",\\"metadata\\":{\\"annotations\\":{\\"x\\":\\"' + node_wrote + '\\"}}}'
    fake.fail("patch", "nodes", 422, "Invalid", f' "" is invalid: patch: Invalid value: "{patched}": '
              'strict decoding error: unknown field "spec.newerThanTheCluster"', times=1)
    with pytest.raises(ClusterInvalid) as caught:
        kube.cordon("gpu-1")
    message = str(caught.value)
    assert message.startswith("patch node gpu-1: refused, nothing written: this cluster's object schema lacks "
                              "spec.newerThanTheCluster, which gpufleet writes"), message
    assert "Kubernetes 1.31 or later" in message and not caught.value.retryable
    assert "hunter2" not in message and "podCIDR" not in message


# -- the activity boundary --------------------------------------------------------------------
def test_a_site_reconcile_rides_out_a_few_conflicts(activities, kube, fake):
    # Fake: a 409 on exactly the next N writes is an injected fault; a real server gives conflicts
    # only to a racing writer (that case, real: tests/realk8s/test_adapter_objects.py, taints).
    fake.add_node("gpu-1", labels={LABEL_SITE: "site-a"})  # no zone label, no fleet taint
    fake.fail("patch", "nodes", 409, "Conflict", times=3)
    assert [n.node_name for n in _run(activities, SITE)] == ["gpu-1"]
    node = kube.get_node("gpu-1")
    assert node.labels[LABEL_ZONE] == "site-a" and FLEET_TAINT in node.taints


# -- through Temporal, under a retry policy with no attempt limit ------------------------------
@workflow.defn(name="ClusterErrorsProbe", sandboxed=False)
class ClusterErrorsProbe:
    @workflow.run
    async def run(self, inp: SiteNodesInput) -> list[SiteNode]:
        return await workflow.execute_activity(
            "site_nodes", inp, result_type=list[SiteNode], start_to_close_timeout=timedelta(seconds=30),
            # Unbounded and no non-retryable types listed: the error's own non_retryable flag must end it.
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=100),
                                     maximum_interval=timedelta(milliseconds=200)),
        )


async def _execute(temporal_env, acts: CapacityActivities, inp: SiteNodesInput,
                   workflow_id: str = "") -> list[SiteNode]:
    queue = f"cluster-errors-{uuid.uuid4().hex[:8]}"
    workflow_id = workflow_id or f"cluster-errors/{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(4) as pool:
        async with Worker(temporal_env.client, task_queue=queue, workflows=[ClusterErrorsProbe],
                          activities=[acts.site_nodes], activity_executor=pool,
                          workflow_runner=UnsandboxedWorkflowRunner()):
            return await temporal_env.client.execute_workflow(
                ClusterErrorsProbe.run, inp, id=workflow_id, task_queue=queue,
                execution_timeout=timedelta(seconds=60),
            )


async def test_conflicts_past_the_adapters_bound_are_retried_by_temporal(temporal_env, activities, kube, fake):
    # Fake: a 409 on exactly the next N writes is an injected fault; a real server gives conflicts
    # only to a racing writer (that case, real: tests/realk8s/test_adapter_objects.py, taints).
    fake.add_node("gpu-1", labels={LABEL_SITE: "site-a"})  # no zone label, no fleet taint
    # The first attempt meets only conflicts (ClusterConflict, retryable); the second wins.
    fake.fail("patch", "nodes", 409, "Conflict", times=kubernetes._RETRY_CONFLICTS + 2)
    assert [n.node_name for n in await _execute(temporal_env, activities, SITE)] == ["gpu-1"]
    assert kube.get_node("gpu-1").labels[LABEL_ZONE] == "site-a"
    # and one more: the fleet taint the reconcile puts back on a node of the site
    assert _patches(fake) == kubernetes._RETRY_CONFLICTS + 3 + 1


# -- requests the client never sends, or never has answered -----------------------------------
#: A token as a kubeconfig may hold it; none of it may leave the worker.
SECRET = "gpufleet-t0ken-3f9c1e7a"


def _travelling(error: BaseException) -> list[BaseException]:
    """``error`` and every exception that travels with it: causes and contexts, suppressed or not."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        current = todo.pop()
        if current is None or any(current is e for e in seen):
            continue
        seen.append(current)
        todo += [current.__cause__, current.__context__, getattr(current, "cause", None)]
    return seen


def _shown(error: BaseException) -> str:
    """All an error says: each travelling exception's message, repr and args, and the traceback."""
    return "".join(f"{e}|{e!r}|{e.args!r}" for e in _travelling(error)) + "".join(traceback.format_exception(error))


@pytest.mark.parametrize("field", ["token", "tokenFile"])
def test_a_kubeconfig_token_ending_in_a_newline_is_sent_without_it(fake, tmp_path, field):
    # `kubectl create token ... > file`, `echo` and a Secret made from such a file end the token in
    # a newline; kubectl (client-go) trims a token file, the Python client sent it as it was read.
    fake.enable_bootstrap()  # authenticates each request: "Bearer fake-token" is the admin, else 401
    fake.add_node("gpu-1")
    if field == "tokenFile":
        (tmp_path / "token").write_text("fake-token\n")
        user = {"tokenFile": str(tmp_path / "token")}
    else:
        user = {"token": "fake-token\n"}
    cluster = KubernetesCluster(kubeconfig=fake.kubeconfig(tmp_path / "kubeconfig", user))
    assert cluster.get_node("gpu-1").name == "gpu-1"


def test_the_in_cluster_token_ending_in_a_newline_is_sent_without_it(tmp_path, monkeypatch):
    """The control plane's own path: a pod's service account token (read again each minute). The
    client's in-cluster loader points every request at the service's https address, which the
    fake does not serve: what it puts in the Authorization header is read where requests read it."""
    from kubernetes.config import incluster_config

    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("fake-token\n")
    ca.write_text("a CA bundle")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    configuration = load_api_client().configuration
    assert configuration.auth_settings()["BearerToken"]["value"] == "bearer fake-token"
    assert str(token) in configuration.credentials


@pytest.mark.parametrize("token", [f"{SECRET}\nrest", f"{SECRET}\u20ac"], ids=["line-break", "beyond-latin-1"])
async def test_a_token_no_header_can_carry_is_cluster_forbidden_and_never_shown(
        temporal_env, fake, tmp_path, caplog, token):
    """http.client refuses the Authorization header with an error quoting it whole: neither the
    adapter's error, nor anything chained to it, nor the activity's failure in workflow history,
    nor the worker's log may hold any of the token. No retry mends the token: non-retryable."""
    caplog.set_level(logging.DEBUG)
    fake.add_node("gpu-1")
    kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig", {"token": token})
    cluster = KubernetesCluster(kubeconfig=kubeconfig)

    with pytest.raises(ClusterForbidden) as caught:
        cluster.get_node("gpu-1")
    assert kubeconfig in str(caught.value) and SECRET not in _shown(caught.value)

    acts = CapacityActivities(FleetEnv(Settings(state_dir=tmp_path), load_config(write_fleet(tmp_path)), cluster))
    workflow_id = f"cluster-errors/{uuid.uuid4().hex[:8]}"
    with pytest.raises(WorkflowFailureError) as failed:
        await _execute(temporal_env, acts, SITE, workflow_id)
    activity_failure = failed.value.cause.cause
    assert (activity_failure.type, activity_failure.non_retryable) == ("ClusterForbidden", True)
    assert kubeconfig in activity_failure.message
    history = await temporal_env.client.get_workflow_handle(workflow_id).fetch_history()
    assert history.to_json().count('"activityTaskFailedEventAttributes"') == 1  # one attempt
    for said in (_shown(failed.value), history.to_json(), caplog.text):
        assert SECRET not in said
    assert not [r for r in caplog.records if r.exc_info and SECRET in _shown(r.exc_info[1])]


def test_a_transport_failure_quoting_the_request_stays_out_of_the_error():
    """urllib3's error for a proxied request quotes the URL it was sending, a password in the
    server's address included: our error names the failure's type and the server without it."""
    configuration = k8s.Configuration()
    configuration.host = f"http://admin:{SECRET}@127.0.0.1:{free_port()}"
    configuration.proxy = f"http://127.0.0.1:{free_port()}"  # nothing listens: the proxy is down
    cluster = KubernetesCluster(api_client=k8s.ApiClient(configuration), request_timeout_s=2)
    with pytest.raises(Transient) as caught:
        cluster.get_node("gpu-1")
    assert caught.value.retryable and "127.0.0.1" in str(caught.value)
    assert SECRET not in _shown(caught.value)
