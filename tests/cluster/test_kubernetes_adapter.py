"""What only the Kubernetes adapter has: the objects it writes, how it writes
them (patch types, resourceVersion checks, write counts) and error mapping."""

from __future__ import annotations

import base64
import json
import re
import time
from datetime import datetime, timedelta, timezone

import pytest

from fleet.errors import BadCredentials, ClusterForbidden, Transient
from fleet.cluster import (
    ANNOTATION_PREVIOUS_TEMPLATE,
    ANNOTATION_TEMPLATE,
    GPU_RESOURCE,
    LABEL_MODEL,
    LABEL_SITE,
    UNPROVEN_TAINT,
    ServingSpec,
)
from providers.cluster.kubernetes import (
    ROUTING_CONFIGMAP,
    KubernetesCluster,
    _machine_from_provider_id,
    bootstrap_secret_name,
)

GW = "gateway.networking.k8s.io"


def _data(secret: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def _writes(fake, fragment: str) -> list[str]:
    return [method for method, path in fake.writes if fragment in path]


# -- join tokens -------------------------------------------------------------------------
def test_join_token_is_a_bootstrap_token_secret(kube, fake):
    before = datetime.now(timezone.utc)
    ref = kube.create_join_token("gpu-1", "i-0ABC_1", 3600)
    secret = fake.get("", "secrets", "kube-system", f"bootstrap-token-{ref.token_id}")
    assert secret["type"] == "bootstrap.kubernetes.io/token"
    data = _data(secret)
    assert data["token-id"] == ref.token_id
    assert re.fullmatch(r"[a-z0-9]{16}", data["token-secret"])
    assert data["usage-bootstrap-authentication"] == "true"
    assert data["usage-bootstrap-signing"] == "true"
    assert data["auth-extra-groups"].startswith("system:bootstrappers:")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", data["expiration"])
    expiration = datetime.fromisoformat(data["expiration"].replace("Z", "+00:00"))
    assert expiration == ref.expires_at
    assert expiration <= before + timedelta(hours=1, seconds=1)
    # The bootstrap channel holds the full token; the workflow's ref does not.
    channel = fake.get("", "secrets", "gpufleet-bootstrap", bootstrap_secret_name("i-0ABC_1"))
    assert bootstrap_secret_name("i-0ABC_1") == "gpufleet-bootstrap-i-0abc-1"
    assert _data(channel)["token"] == f"{ref.token_id}.{data['token-secret']}"
    assert _data(channel)["node-name"] == "gpu-1"
    assert channel["metadata"]["labels"]["gpufleet.io/token-id"] == ref.token_id
    assert data["token-secret"] not in ref.model_dump_json()


def test_revoke_deletes_both_secrets(kube, fake):
    ref = kube.create_join_token("gpu-1", "m-1", 600)
    kube.revoke_join_token(ref.token_id)
    assert fake.objects("", "secrets") == []
    kube.revoke_join_token(ref.token_id)  # 404s are success
    with pytest.raises(ValueError):
        kube.revoke_join_token("../../x")


def test_a_new_token_for_the_same_machine_supersedes_the_old(kube, fake):
    old = kube.create_join_token("gpu-1", "m-1", 600)
    new = kube.create_join_token("gpu-1", "m-1", 600)
    names = {s["metadata"]["name"] for s in fake.objects("", "secrets", "kube-system")}
    assert names == {f"bootstrap-token-{new.token_id}"}
    assert kube.take_bootstrap_token("m-1").startswith(f"{new.token_id}.")
    assert fake.objects("", "secrets", "gpufleet-bootstrap") == []
    assert old.token_id != new.token_id


def test_bootstrap_fetch_is_once_even_when_raced(kube, fake):
    kube.create_join_token("gpu-1", "m-1", 600)
    secret = fake.get("", "secrets", "gpufleet-bootstrap", bootstrap_secret_name("m-1"))
    # Someone replaces the channel between our read and delete: the delete's
    # precondition fails and we hand out nothing rather than a stale token.
    original = fake._delete

    def replaced_meanwhile(group, resource, namespace, name, body):
        fake.store[(group, resource, namespace, name)]["metadata"]["resourceVersion"] = "999999"
        return original(group, resource, namespace, name, body)

    fake._delete = replaced_meanwhile
    assert kube.take_bootstrap_token("m-1") is None
    fake._delete = original
    assert secret is not None


# -- nodes ------------------------------------------------------------------------------------
def test_label_patch_is_a_merge_and_a_repeat_writes_nothing(kube, fake):
    fake.add_node("gpu-1", {"team": "infra"})
    kube.label_node("gpu-1", {"gpufleet.io/state": "proving"})
    version = fake.get("", "nodes", "", "gpu-1")["metadata"]["resourceVersion"]
    kube.label_node("gpu-1", {"gpufleet.io/state": "proving"})
    node = fake.get("", "nodes", "", "gpu-1")
    assert node["metadata"]["resourceVersion"] == version
    assert node["metadata"]["labels"]["team"] == "infra"
    assert all(m == "PATCH" for m in _writes(fake, "/nodes/"))


def test_taints_keep_foreign_taints_and_their_fields(kube, fake):
    foreign = {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute", "timeAdded": "2024-01-01T00:00:00Z"}
    fake.add_node("gpu-1", taints=[foreign])
    node = kube.set_taints("gpu-1", add=[UNPROVEN_TAINT])
    assert node.taints == ["node.kubernetes.io/not-ready:NoExecute", UNPROVEN_TAINT]
    stored = fake.get("", "nodes", "", "gpu-1")["spec"]["taints"]
    assert stored[0] == foreign
    assert stored[1] == {"key": "gpufleet.io/unproven", "effect": "NoSchedule"}
    writes = len(fake.writes)
    kube.set_taints("gpu-1", add=[UNPROVEN_TAINT])
    assert len(fake.writes) == writes  # nothing to change, nothing written
    kube.set_taints("gpu-1", remove=[UNPROVEN_TAINT, "node.kubernetes.io/not-ready:NoExecute"])
    assert "taints" not in fake.get("", "nodes", "", "gpu-1")["spec"]


def test_taints_retry_on_a_conflicting_writer(kube, fake):
    fake.add_node("gpu-1")
    original = fake._patch
    raced = []

    def other_writer_first(group, resource, namespace, name, ctype, body):
        if resource == "nodes" and not raced:
            raced.append(1)
            node = fake.store[("", "nodes", "", name)]
            node["spec"]["taints"] = [{"key": "other", "effect": "NoSchedule"}]
            node["metadata"]["resourceVersion"] = fake._next_rv()
        return original(group, resource, namespace, name, ctype, body)

    fake._patch = other_writer_first
    node = kube.set_taints("gpu-1", add=[UNPROVEN_TAINT])
    assert sorted(node.taints) == sorted(["other:NoSchedule", UNPROVEN_TAINT])
    assert _writes(fake, "/nodes/gpu-1") == ["PATCH", "PATCH"]


def test_cordon_patches_spec_unschedulable(kube, fake):
    fake.add_node("gpu-1")
    kube.cordon("gpu-1")
    assert fake.get("", "nodes", "", "gpu-1")["spec"]["unschedulable"] is True
    kube.cordon("gpu-1", False)
    assert "unschedulable" not in fake.get("", "nodes", "", "gpu-1")["spec"]


@pytest.mark.parametrize("provider_id, machine", [
    ("aws:///us-east-1a/i-0abc123", "i-0abc123"),
    ("hcloud://4711", "4711"),
    ("gce://proj/europe-west4-a/gpu-node-1", "gpu-node-1"),
    ("", ""),
])
def test_machine_id_from_provider_id(provider_id, machine):
    assert _machine_from_provider_id(provider_id) == machine


def test_a_node_written_machine_id_annotation_is_ignored(kube, fake):
    """The kubelet may write its Node's annotations: no machine id comes from there."""
    fake.add_node("gpu-1", machine_id="m-annotated", provider_id="aws:///us-east-1a/i-0abc")
    assert kube.get_node("gpu-1").machine_id == "i-0abc"


def test_the_identity_record_names_the_machine(kube, fake):
    from fleet.cluster import NODE_IDENTITY_KIND, NodeIdentity, gpufleet_provider_id

    provider_id = gpufleet_provider_id("aws", "acct-1", "gpu-1")
    fake.add_node("gpu-1", {"gpufleet.io/site": "elsewhere"}, machine_id="someone-elses", provider_id=provider_id)
    assert kube.get_node("gpu-1").machine_id == "", "a gpufleet providerID names no provider id"
    identity = NodeIdentity(node_name="gpu-1", machine_id="i-0real", provider="aws", account="acct-1",
                            site="aws-use1", provider_id=provider_id)
    kube.update_state(NODE_IDENTITY_KIND, "gpu-1", lambda _old: identity.state())
    for node in (kube.get_node("gpu-1"), kube.list_nodes()[0]):
        assert (node.machine_id, node.site, node.provider, node.account) == ("i-0real", "aws-use1", "aws", "acct-1")


# -- drain ------------------------------------------------------------------------------------
def test_drain_uses_the_eviction_api_and_lists_by_field_selector(kube, fake):
    fake.add_node("gpu-1")
    fake.add_pod("gpu-1", "web-1")
    fake.add_pod("gpu-1", "ds-1", owner_kind="DaemonSet")
    assert kube.drain_node("gpu-1", deadline_s=2).completed
    verbs = {(v, r, s) for v, _g, r, s, _ns in fake.requests if r == "pods"}
    assert verbs == {("list", "pods", ""), ("create", "pods", "eviction")}
    assert fake.get("", "pods", "default", "ds-1") is not None


def test_drain_waits_for_evicted_pods_to_terminate(kube, fake):
    fake.add_node("gpu-1")
    fake.add_pod("gpu-1", "slow-1", terminating_seconds=0.5)
    result = kube.drain_node("gpu-1", deadline_s=5)
    assert result.completed and result.elapsed_s >= 0.4
    fake.add_pod("gpu-1", "slower-1", terminating_seconds=30)
    result = kube.drain_node("gpu-1", deadline_s=0.5)
    assert not result.completed
    assert [(p.key, p.reason) for p in result.blocked] == [("default/slower-1", "evicted but still terminating")]


def test_drain_with_two_pdbs_reports_the_server_message(kube, fake):
    fake.add_node("gpu-1")
    fake.add_pod("gpu-1", "web-1", labels={"app": "web", "tier": "a"})
    fake.set_pdb("default", "pdb-1", {"app": "web"}, max_unavailable=1)
    fake.set_pdb("default", "pdb-2", {"tier": "a"}, max_unavailable=1)
    result = kube.drain_node("gpu-1", deadline_s=0.3)
    assert "more than one PodDisruptionBudget" in result.blocked[0].reason


# -- serving ----------------------------------------------------------------------------------
def test_serving_objects(kube, fake):
    spec = ServingSpec(model="llama-3-8b", site="site-a", image="vllm:0.6", replicas=2, gpus_per_replica=4,
                       args=["--tp", "4"], weights_path="/models/llama", env={"HF_HOME": "/cache"})
    kube.apply_serving(spec)
    deployment = fake.get("apps", "deployments", "gpufleet", "llama-3-8b-site-a")
    labels = {LABEL_MODEL: "llama-3-8b", LABEL_SITE: "site-a"}
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {LABEL_SITE: "site-a"}
    (container,) = pod["containers"]
    assert container["image"] == "vllm:0.6" and container["args"] == ["--tp", "4"]
    assert container["resources"]["limits"][GPU_RESOURCE] == "4" == container["resources"]["requests"][GPU_RESOURCE]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"MODEL_NAME": "llama-3-8b", "MODEL_WEIGHTS": "/models/llama", "HF_HOME": "/cache"}
    assert container["volumeMounts"] == [{"name": "weights", "mountPath": "/models/llama", "readOnly": True}]
    assert pod["volumes"][0]["hostPath"]["path"] == "/models/llama"
    assert json.loads(deployment["metadata"]["annotations"][ANNOTATION_TEMPLATE]) == deployment["spec"]["template"]
    service = fake.get("", "services", "gpufleet", "llama-3-8b-site-a")
    assert service["spec"]["selector"] == labels
    assert service["spec"]["ports"][0]["port"] == 8000


def test_serving_ready_waits_for_the_controller(kube, fake):
    fake.add_node("gpu-1", {LABEL_SITE: "site-a"})
    fake.rollout_delay_s = 0.4
    spec = ServingSpec(model="m", site="site-a", image="img:1", replicas=1)
    status = kube.apply_serving(spec)
    assert not status.ready and status.observed_generation < status.generation
    time.sleep(0.45)
    assert kube.serving_status("m", "site-a").ready
    status = kube.apply_serving(spec.model_copy(update={"image": "img:2"}))
    assert not status.ready and status.generation == 2
    time.sleep(0.45)
    status = kube.serving_status("m", "site-a")
    assert status.ready and status.observed_generation == 2


def test_update_and_rollback_keep_templates_in_annotations(kube, fake):
    fake.add_node("gpu-1", {LABEL_SITE: "site-a"})
    spec = ServingSpec(model="m", site="site-a", image="img:1")
    kube.apply_serving(spec)
    assert _writes(fake, "/deployments") == ["POST"]
    kube.apply_serving(spec)
    assert _writes(fake, "/deployments") == ["POST"]  # nothing changed, nothing written
    kube.apply_serving(spec.model_copy(update={"image": "img:2"}))
    deployment = fake.get("apps", "deployments", "gpufleet", "m-site-a")
    previous = json.loads(deployment["metadata"]["annotations"][ANNOTATION_PREVIOUS_TEMPLATE])
    assert previous["spec"]["containers"][0]["image"] == "img:1"
    kube.rollback_serving("m", "site-a")
    deployment = fake.get("apps", "deployments", "gpufleet", "m-site-a")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "img:1"
    assert _writes(fake, "/deployments") == ["POST", "PUT", "PUT"]


def test_foreign_changes_to_the_deployment_survive_apply(kube, fake):
    fake.add_node("gpu-1", {LABEL_SITE: "site-a"})
    spec = ServingSpec(model="m", site="site-a", image="img:1")
    kube.apply_serving(spec)
    stored = fake.store[("apps", "deployments", "gpufleet", "m-site-a")]
    stored["metadata"]["annotations"]["argocd.argoproj.io/sync"] = "x"
    stored["spec"]["revisionHistoryLimit"] = 3
    kube.apply_serving(spec.model_copy(update={"replicas": 2}))
    stored = fake.get("apps", "deployments", "gpufleet", "m-site-a")
    assert stored["spec"]["revisionHistoryLimit"] == 3 and stored["spec"]["replicas"] == 2
    assert stored["metadata"]["annotations"]["argocd.argoproj.io/sync"] == "x"


# -- routing ----------------------------------------------------------------------------------
def test_routing_update_is_one_write_per_object_and_repeats_write_nothing(kube, fake):
    kube.set_routing_weights("llama-3-8b", {"site-a": 80, "site-b": 20})
    assert _writes(fake, "/configmaps") == ["POST"] and _writes(fake, "/httproutes") == ["POST"]
    route = fake.get(GW, "httproutes", "gpufleet", "llama-3-8b")
    refs = route["spec"]["rules"][0]["backendRefs"]
    assert [(r["name"], r["weight"], r["port"]) for r in refs] == [
        ("llama-3-8b-site-a", 80, 8000), ("llama-3-8b-site-b", 20, 8000)]
    assert route["spec"]["parentRefs"][0]["name"] == "gpufleet"
    configmap = fake.get("", "configmaps", "gpufleet", ROUTING_CONFIGMAP)
    versions = (configmap["metadata"]["resourceVersion"], route["metadata"]["resourceVersion"])

    kube.set_routing_weights("llama-3-8b", {"site-a": 80, "site-b": 20})
    assert len(_writes(fake, "/configmaps")) == 1 and len(_writes(fake, "/httproutes")) == 1
    configmap = fake.get("", "configmaps", "gpufleet", ROUTING_CONFIGMAP)
    route = fake.get(GW, "httproutes", "gpufleet", "llama-3-8b")
    assert (configmap["metadata"]["resourceVersion"], route["metadata"]["resourceVersion"]) == versions

    kube.set_routing_weights("llama-3-8b", {"site-a": 50, "site-b": 50})
    assert _writes(fake, "/configmaps") == ["POST", "PUT"] and _writes(fake, "/httproutes") == ["POST", "PUT"]
    configmap = fake.get("", "configmaps", "gpufleet", ROUTING_CONFIGMAP)
    entry = json.loads(configmap["data"]["llama-3-8b"])
    assert entry["version"] == 2
    assert entry["sites"]["site-a"] == {"weight": 50, "healthy": True, "draining": False, "incident": ""}
    route = fake.get(GW, "httproutes", "gpufleet", "llama-3-8b")
    assert [r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]] == [50, 50]
    assert route["metadata"]["generation"] == 2


def test_routing_applies_the_envoy_gateway_policy_with_the_route(kube, fake):
    """Stickiness and retry-before-response live in Envoy Gateway's BackendTrafficPolicy,
    attached to the model's HTTPRoute, written with it; repeats write nothing; drift is undone."""
    envoy = "gateway.envoyproxy.io"
    kube.set_routing_weights("llama-3-8b", {"site-a": 80, "site-b": 20})
    policy = fake.get(envoy, "backendtrafficpolicies", "gpufleet", "llama-3-8b")
    assert policy["spec"]["targetRefs"] == [{"group": GW, "kind": "HTTPRoute", "name": "llama-3-8b"}]
    assert policy["spec"]["loadBalancer"]["consistentHash"] == {"type": "Header", "header": {"name": "x-session-id"}}
    assert policy["spec"]["retry"]["retryOn"]["triggers"] == ["connect-failure", "refused-stream"]
    kube.set_routing_weights("llama-3-8b", {"site-a": 50, "site-b": 50})
    assert _writes(fake, "/backendtrafficpolicies") == ["POST"], "the policy does not change with the weights"

    edited = fake.get(envoy, "backendtrafficpolicies", "gpufleet", "llama-3-8b")
    edited["spec"]["retry"]["retryOn"]["triggers"] = ["5xx"]  # would replay a streamed answer
    fake.store[(envoy, "backendtrafficpolicies", "gpufleet", "llama-3-8b")]["spec"] = edited["spec"]
    kube.set_routing_weights("llama-3-8b", {"site-a": 40, "site-b": 60})
    assert _writes(fake, "/backendtrafficpolicies") == ["POST", "PUT"]
    policy = fake.get(envoy, "backendtrafficpolicies", "gpufleet", "llama-3-8b")
    assert policy["spec"]["retry"]["retryOn"]["triggers"] == ["connect-failure", "refused-stream"]


def test_routing_table_write_retries_on_conflict(kube, fake):
    kube.set_routing_weights("a", {"site-a": 1})
    original = fake._update
    raced = []

    def other_model_written_first(group, resource, namespace, name, body):
        if resource == "configmaps" and not raced:
            raced.append(1)
            stored = fake.store[("", "configmaps", namespace, name)]
            stored["data"]["b"] = json.dumps({"model": "b", "version": 7, "sites": {}})
            stored["metadata"]["resourceVersion"] = fake._next_rv()
        return original(group, resource, namespace, name, body)

    fake._update = other_model_written_first
    assert kube.set_routing_weights("a", {"site-a": 2}).version == 2
    data = fake.get("", "configmaps", "gpufleet", ROUTING_CONFIGMAP)["data"]
    assert json.loads(data["b"])["version"] == 7 and json.loads(data["a"])["version"] == 2
    assert _writes(fake, "/configmaps") == ["POST", "PUT", "PUT"]


# -- errors -----------------------------------------------------------------------------------
def test_unreachable_api_is_transient(fake):
    cluster = KubernetesCluster(api_client=fake.api_client())
    cluster.api_client.configuration.retries = 0
    fake.stop()
    with pytest.raises(Transient):
        cluster.get_node("gpu-1")


def test_a_hung_api_server_times_out_as_transient(fake):
    cluster = KubernetesCluster(api_client=fake.api_client(), request_timeout_s=0.2)
    fake.response_delay_s = 1.0
    started = time.monotonic()
    with pytest.raises(Transient):
        cluster.get_node("gpu-1")
    assert time.monotonic() - started < 5


def test_forbidden_is_cluster_forbidden(kube, fake):
    """Not BadCredentials: a cluster RBAC gap must never revoke a provider account."""
    original = fake._dispatch

    def forbid_nodes(method, path, query, ctype, body):
        if "/nodes" in path:
            from tests.cluster.fake_apiserver import ApiError

            raise ApiError(403, "Forbidden", 'nodes is forbidden: User "x" cannot list resource "nodes"')
        return original(method, path, query, ctype, body)

    fake._dispatch = forbid_nodes
    with pytest.raises(ClusterForbidden, match="forbidden") as caught:
        kube.list_nodes()
    assert not isinstance(caught.value, BadCredentials) and not caught.value.retryable
