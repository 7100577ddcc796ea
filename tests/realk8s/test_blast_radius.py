"""What the control plane's credential and a node's certificate can reach, on the real control plane.

RBAC lets the ``gpufleet-control-plane`` service account create kube-system Secrets, and cannot
limit that by content. With kubeadm's ``kubeadm:node-autoapprove-bootstrap`` binding a Secret in
kubeadm's token group would be a certificate for any node name, and a service-account-token
Secret would be a token of any kube-system service account; the shipped admission policy
(deploy/kubernetes/admission-policy.yaml) refuses both, as the real API server's CEL evaluates
it. ``gpufleet cluster check`` reports kubeadm's two auto-approve bindings and how to remove
them; once removed, gpufleet's approver renews a live node's client certificate and denies a
removed node's, so a removed node's credential ends with its certificate.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from typer.testing import CliRunner

from cli.cluster import cluster_app
from providers.cluster.bootstrap import BOOTSTRAP_GROUP
from providers.cluster.check import ADMISSION_POLICY, KUBEADM_AUTOAPPROVE_BOOTSTRAP, KUBEADM_AUTOAPPROVE_ROTATION
from tests.providers.test_join_real import run
from tests.realk8s.cluster import KUBEADM_TOKEN, KUBEADM_TOKEN_GROUP, RealCluster
from tests.realk8s.machine import MachineFailed
from tests.realk8s.test_join import RealJoining, conditions

KUBEADM_BINDINGS = (KUBEADM_AUTOAPPROVE_BOOTSTRAP, KUBEADM_AUTOAPPROVE_ROTATION)


def control_plane_core(cluster: RealCluster) -> k8s.CoreV1Api:
    """The API as the control-plane Deployment calls it: its service account's token."""
    return k8s.CoreV1Api(cluster.api_client(cluster.service_account_token("gpufleet", "gpufleet-control-plane")))


def bootstrap_token(group: str, *, as_string_data: bool = True) -> dict:
    token_id = uuid.uuid4().hex[:6]
    values = {"token-id": token_id, "token-secret": uuid.uuid4().hex[:16], "usage-bootstrap-authentication": "true",
              "usage-bootstrap-signing": "true", "auth-extra-groups": group, "expiration": "2099-01-01T00:00:00Z"}
    body = {"apiVersion": "v1", "kind": "Secret", "type": "bootstrap.kubernetes.io/token",
            "metadata": {"name": f"bootstrap-token-{token_id}", "namespace": "kube-system"}}
    if as_string_data:
        body["stringData"] = values
    else:
        body["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}
    return body


def refused_by_the_policy(call) -> str:
    """The API server's answer to ``call``: the admission policy's message, or "" when it let it pass."""
    try:
        call()
    except ApiException as error:
        assert error.status in (403, 422), error
        assert ADMISSION_POLICY in (error.body or ""), f"refused, but not by the admission policy: {error.body}"
        return json.loads(error.body)["message"]
    return ""


def enforced(core: k8s.CoreV1Api) -> None:
    """The API server loads admission policies asynchronously: wait until it enforces the shipped one
    (asked with dry runs: nothing is stored either way)."""
    deadline = time.monotonic() + 60
    probe = bootstrap_token(KUBEADM_TOKEN_GROUP)
    while not refused_by_the_policy(lambda: core.create_namespaced_secret("kube-system", probe, dry_run="All")):
        assert time.monotonic() < deadline, "the admission policy was not enforced within 60 s"
        time.sleep(0.5)


def test_the_control_plane_may_write_only_gpufleets_own_join_tokens_in_kube_system(real_cluster: RealCluster):
    core = control_plane_core(real_cluster)
    enforced(core)
    # kubeadm's group: auto-approved a certificate for any node name. Refused in both spellings
    # (stringData is merged into data before admission: the policy sees data only).
    for as_string_data in (True, False):
        message = refused_by_the_policy(lambda: core.create_namespaced_secret(
            "kube-system", bootstrap_token(KUBEADM_TOKEN_GROUP, as_string_data=as_string_data), dry_run="All"))
        assert BOOTSTRAP_GROUP in message, message
    # Another group added to gpufleet's: refused (exactly gpufleet's group).
    assert refused_by_the_policy(lambda: core.create_namespaced_secret(
        "kube-system", bootstrap_token(f"{BOOTSTRAP_GROUP},system:masters"), dry_run="All"))
    # A token for a kube-system service account (the token controller would fill it in): refused.
    sa_token = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
                "metadata": {"name": f"stolen-{uuid.uuid4().hex[:6]}", "namespace": "kube-system",
                             "annotations": {"kubernetes.io/service-account.name": "clusterrole-aggregation-controller"}}}
    assert "service-account token" in refused_by_the_policy(
        lambda: core.create_namespaced_secret("kube-system", sa_token, dry_run="All"))
    opaque = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": f"other-{uuid.uuid4().hex[:6]}", "namespace": "kube-system"}, "stringData": {"a": "b"}}
    assert refused_by_the_policy(lambda: core.create_namespaced_secret("kube-system", opaque, dry_run="All"))
    # Deleting kubeadm's own token (judged on oldObject): refused.
    assert refused_by_the_policy(lambda: core.delete_namespaced_secret(
        f"bootstrap-token-{KUBEADM_TOKEN.split('.')[0]}", "kube-system", dry_run="All"))

    # gpufleet's own group: created and deleted for real, as the join activities do.
    ours = bootstrap_token(BOOTSTRAP_GROUP)
    core.create_namespaced_secret("kube-system", ours)
    core.delete_namespaced_secret(ours["metadata"]["name"], "kube-system")
    core.api_client.close()


@pytest.fixture
def kubeadm_bindings_restored(real_cluster: RealCluster):
    """The test removes kubeadm's bindings as the check advises; the package's other tests rely
    on kubeadm's behaviour, so they are put back afterwards as kubeadm made them."""
    saved = []
    for name in KUBEADM_BINDINGS:
        doc = json.loads(real_cluster.kubectl("get", "clusterrolebinding", name, "-o", "json").stdout)
        doc["metadata"] = {k: v for k, v in doc["metadata"].items() if k in ("name", "labels", "annotations")}
        saved.append(doc)
    yield
    for doc in saved:
        real_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(doc))


def check(real_cluster: RealCluster, tmp_path) -> tuple[int, str]:
    """`gpufleet cluster check` with a kubeconfig for the control plane's service account."""
    token = real_cluster.service_account_token("gpufleet", "gpufleet-control-plane")
    ca = tmp_path / "ca.crt"
    ca.write_bytes(real_cluster.ca_pem)
    kubeconfig = tmp_path / "gpufleet.yaml"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gpufleet",
        "clusters": [{"name": "real", "cluster": {"server": real_cluster.server, "certificate-authority": str(ca)}}],
        "users": [{"name": "gpufleet-control-plane", "user": {"token": token}}],
        "contexts": [{"name": "gpufleet", "context": {"cluster": "real", "user": "gpufleet-control-plane"}}]}))
    result = CliRunner().invoke(cluster_app, ["check", "--kubeconfig", str(kubeconfig), "--no-tunnels"],
                                env={"COLUMNS": "400"})
    return result.exit_code, result.output


def test_the_check_reports_kubeadms_auto_approve_bindings_until_its_advice_is_applied(
        real_cluster: RealCluster, tmp_path, kubeadm_bindings_restored) -> None:
    code, output = check(real_cluster, tmp_path)
    assert code == 1, output
    assert "permissions granted" in output, [line for line in output.splitlines() if "MISSING" in line or "missing" in line]
    advice = next(line for line in output.splitlines() if "remove kubeadm's auto-approve bindings" in line)
    command = advice.split(": ", 1)[1].split("  (", 1)[0].split()
    assert command == ["kubectl", "delete", "clusterrolebinding", *KUBEADM_BINDINGS], advice
    assert "kubeadm upgrade apply" in advice

    real_cluster.kubectl(*command[1:])  # the advice, as an admin runs it
    code, output = check(real_cluster, tmp_path)
    assert code == 0, output
    assert "admission policies enforced" in output
    assert "Konnectivity" not in output, "--no-tunnels checks permissions only"


@pytest.fixture
def one(lambda_harness, tmp_path, real_cluster):
    world = RealJoining(lambda_harness, tmp_path, real_cluster)
    yield world
    world.stop()


def joined(one: RealJoining, name: str):
    one.new_join()
    provisioned = one.provision()
    machine = one.machine(provisioned.machine.id, name=name).boot()
    return one.await_registration(provisioned), machine


def test_without_kubeadms_self_renewal_gpufleet_renews_a_live_node_and_denies_a_removed_one(
        one: RealJoining, real_cluster: RealCluster, kubeadm_bindings_restored) -> None:
    real_cluster.kubectl("delete", "clusterrolebinding", *KUBEADM_BINDINGS)
    live, live_machine = joined(one, "live")
    removed, removed_machine = joined(one, "removed")
    removed_machine.stop()  # its kubelet gone, its certificate still valid: what a stolen one is
    one.cluster.remove_node(removed.name)

    outcomes: dict[str, dict] = {}

    def renew(key, machine) -> None:
        try:
            outcomes[key] = machine.renew(600)
        except MachineFailed as failed:
            outcomes[key] = {"failed": failed}

    threads = [threading.Thread(target=renew, args=(key, machine))
               for key, machine in (("live", live_machine), ("removed", removed_machine))]
    for thread in threads:
        thread.start()
    try:
        while any(thread.is_alive() for thread in threads):
            run(one.acts.approve_node_csrs)
            threads[0].join(1)
    finally:
        for thread in threads:
            thread.join(90)

    assert outcomes["live"].get("step") == "renewed", outcomes["live"]
    [renewed] = [c for c in one.csrs() if c["metadata"]["name"] == outcomes["live"]["csr"]]
    assert renewed["spec"]["username"] == f"system:node:{live.name}"
    assert conditions(renewed) == [("Approved", "GpufleetApproved")], "gpufleet's approver, nothing else"

    failed = outcomes["removed"].get("failed")
    assert failed is not None and failed.step == "renew-wait", outcomes["removed"]
    [denied] = [c for c in one.csrs() if c["spec"]["username"] == f"system:node:{removed.name}"
                and c["spec"]["signerName"] == "kubernetes.io/kube-apiserver-client-kubelet"]
    assert conditions(denied) == [("Denied", "GpufleetDenied")] and not denied["status"].get("certificate")
