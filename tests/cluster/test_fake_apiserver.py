"""The fake API server keeps the semantics the adapter tests rely on (checked
through the official client, as the adapter uses it)."""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.cluster.fake_apiserver import label_selector_matches


@pytest.fixture
def core(fake):
    return client.CoreV1Api(fake.api_client())


def _status(error: ApiException) -> dict:
    return json.loads(error.body)


@pytest.mark.parametrize("selector, expected", [
    ("app=web", True), ("app==web", True), ("app!=web", False), ("app", True), ("!app", False),
    ("app in (web,db)", True), ("app notin (web)", False), ("tier notin (x)", True), ("tier in (x)", False),
    ("app=web,tier", False), ("app=web,!tier", True),
])
def test_label_selectors(selector, expected):
    assert label_selector_matches(selector, {"app": "web"}) is expected


def test_field_selector_on_pods_and_unsupported_fields(fake, core):
    fake.add_node("n1")
    fake.add_pod("n1", "a")
    fake.add_pod("n2", "b", namespace="other")
    pods = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    assert [p.metadata.name for p in pods.items] == ["a"]
    with pytest.raises(ApiException) as error:
        core.list_pod_for_all_namespaces(field_selector="spec.schedulerName=x")
    assert error.value.status == 400 and "field label not supported" in _status(error.value)["message"]


def test_not_found_is_a_status_object(core):
    with pytest.raises(ApiException) as error:
        core.read_node("ghost")
    status = _status(error.value)
    assert (error.value.status, status["kind"], status["reason"]) == (404, "Status", "NotFound")


def test_json_patch_needs_a_list_and_the_client_sends_dicts_as_strategic_merge(fake, core):
    fake.add_node("n1")
    code, status = fake.handle("PATCH", "/api/v1/nodes/n1", "application/json-patch+json",
                               b'{"metadata": {"labels": {"a": "b"}}}')
    assert code == 500 and "jsonpatch" in status["message"]
    core.patch_node("n1", {"metadata": {"labels": {"a": "b"}}})  # the client turns this into a strategic merge
    core.patch_node("n1", [{"op": "add", "path": "/metadata/labels/c", "value": "d"}])
    labels = core.read_node("n1").metadata.labels
    assert labels["a"] == "b" and labels["c"] == "d"


def test_strategic_merge_merges_taints_by_key_and_merge_patch_replaces(fake, core):
    fake.add_node("n1", taints=[{"key": "a", "effect": "NoSchedule"}])
    smp = "application/strategic-merge-patch+json"
    core.patch_node("n1", {"spec": {"taints": [{"key": "b", "effect": "NoSchedule"}]}}, _content_type=smp)
    assert [t.key for t in core.read_node("n1").spec.taints] == ["a", "b"]
    core.patch_node("n1", {"spec": {"taints": [{"key": "c", "effect": "NoSchedule"}]}},
                    _content_type="application/merge-patch+json")
    assert [t.key for t in core.read_node("n1").spec.taints] == ["c"]


def test_resource_version_preconditions_and_no_op_writes(fake, core):
    fake.add_node("n1")
    version = core.read_node("n1").metadata.resource_version
    merge = "application/merge-patch+json"
    core.patch_node("n1", {"metadata": {"labels": {"kubernetes.io/hostname": "n1"}}}, _content_type=merge)
    assert core.read_node("n1").metadata.resource_version == version  # no-op
    with pytest.raises(ApiException) as error:
        core.patch_node("n1", {"metadata": {"resourceVersion": "1", "labels": {"x": "y"}}}, _content_type=merge)
    assert error.value.status == 409 and _status(error.value)["reason"] == "Conflict"
    core.patch_node("n1", {"metadata": {"resourceVersion": version, "labels": {"x": "y"}}}, _content_type=merge)
    assert int(core.read_node("n1").metadata.resource_version) > int(version)


def test_create_conflict_and_string_data(core):
    body = {"metadata": {"name": "s"}, "stringData": {"k": "v"}}
    created = core.create_namespaced_secret("ns", body)
    assert created.data == {"k": "dg=="}
    with pytest.raises(ApiException) as error:
        core.create_namespaced_secret("ns", body)
    assert error.value.status == 409 and _status(error.value)["reason"] == "AlreadyExists"


def test_eviction_respects_pdb(fake, core):
    fake.add_pod("n1", "w1", labels={"app": "w"})
    fake.set_pdb("default", "w-pdb", {"app": "w"}, min_available=1)
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "w1", "namespace": "default"}}
    with pytest.raises(ApiException) as error:
        core.create_namespaced_pod_eviction("w1", "default", body)
    status = _status(error.value)
    assert error.value.status == 429 and status["reason"] == "TooManyRequests"
    assert "w-pdb" in status["details"]["causes"][0]["message"]
    pdb = client.PolicyV1Api(fake.api_client()).read_namespaced_pod_disruption_budget("w-pdb", "default")
    assert pdb.status.disruptions_allowed == 0 and pdb.status.current_healthy == 1
    fake.add_pod("n2", "w2", labels={"app": "w"})
    core.create_namespaced_pod_eviction("w1", "default", body)
    assert [p.metadata.name for p in core.list_namespaced_pod("default").items] == ["w2"]
