"""A machine of every provider joins a real kubeadm cluster from nothing but its user data.

The control plane is real (``cluster.RealCluster``: etcd, kube-apiserver with bootstrap-token
auth, Node,RBAC and NodeRestriction, kube-controller-manager's signer, approver, bootstrap signer
and token cleaner), set up by kubeadm's own phases, with gpufleet's manifests applied unchanged.
The control plane's activities run with the ``gpufleet-control-plane`` service account's token,
so every call they make passes the shipped RBAC or fails here.  The machine is ``gpufleet-join``:
kubeadm's join code and the real kubelet, in a network namespace of its own carrying the
addresses the provider reports (``machine.Machine``).
"""

from __future__ import annotations

import base64
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from fleet.messages.nodes import AwaitRegistrationInput, NodeFactsInput, ProvisionJoinInput
from activities.repair import RepairActivities
from fleet.cluster import GPU_RESOURCE, LABEL_PROVIDER, LABEL_SITE, LABEL_ZONE, UNPROVEN_TAINT
from fleet.naming import node_name_for
from providers.cluster.bootstrap import BOOTSTRAP_GROUP, read_join_configuration
from providers.cluster.kubernetes import KubernetesCluster
from tests.cluster.sim_kubelet import csr_pem
from tests.providers.harness import Harness
from tests.providers.test_join_real import PROVIDERS, join_activities, run, user_data_of
from tests.realk8s.cluster import JOIN_ENDPOINT_IP, KUBEADM_TOKEN, KUBEADM_TOKEN_GROUP, RealCluster
from tests.realk8s.machine import Machine, MachineFailed

CSR_PATH = "/apis/certificates.k8s.io/v1/certificatesigningrequests"


def control_plane_cluster(cluster: RealCluster) -> KubernetesCluster:
    """The adapter as the control-plane Deployment runs it: its service account's token."""
    token = cluster.service_account_token("gpufleet", "gpufleet-control-plane")
    return KubernetesCluster(api_client=cluster.api_client(token), namespace="gpufleet")


class RealJoining:
    """One provider's adapter (against its wire-level fake), the real control plane, and the
    control plane's join activities."""

    def __init__(self, harness: Harness, tmp_path: Path, cluster: RealCluster, join_endpoint: str = "") -> None:
        self.harness = harness
        self.tmp = tmp_path
        self.real = cluster
        provider = harness.provider
        if provider.site.provider == "own-dc":
            provider.options["seed_dir"] = str(tmp_path / "seeds")
        self.cluster = control_plane_cluster(cluster)
        self.cluster.join_endpoint = join_endpoint
        self.env, self.acts = join_activities(harness, tmp_path, self.cluster)
        self.site = provider.site
        self.machines: list[Machine] = []
        self.new_join()

    def new_join(self) -> None:
        self.join_id = f"join/{self.site.name}/{uuid.uuid4().hex[:6]}"
        self.node_name = node_name_for(self.site.name, self.join_id)

    def provision(self):
        spec = self.harness.spec.model_copy(update={"name": self.node_name})
        return run(self.acts.provision_joining_machine,
                   ProvisionJoinInput(site=self.site.name, spec=spec, idempotency_key=self.join_id))

    def machine(self, machine_id: str, user_data: str | None = None, name: str = "") -> Machine:
        """The machine the provider booted: its user data and its addresses, nothing else."""
        addresses = self.harness.provider.get_machine(machine_id).addresses
        # The machine reaches the API server at the address it was told to: the join endpoint
        # where there is one (and nothing else), else cluster-info's.
        server = self.cluster.join_endpoint or f"127.0.0.1:{self.real.api_port}"
        machine = Machine(user_data or user_data_of(self.harness, machine_id),
                          self.tmp / f"machine-{name or machine_id}", addresses=list(addresses),
                          routes={server: ("127.0.0.1", self.real.api_port)})
        self.machines.append(machine)
        return machine

    def await_registration(self, provisioned, seconds: float = 90, **labelling):
        """``labelling``: the labels and taints NodeJoin hands the activity (``labels``, ``add_taints``)."""
        try:
            return run(self.acts.await_registration, AwaitRegistrationInput(
                site=self.site.name, node_name=self.node_name, machine_id=provisioned.machine.id,
                provider_id=provisioned.provider_id, join_id=self.join_id, poll_seconds=0.2,
                deadline=datetime.now(timezone.utc) + timedelta(seconds=seconds), **labelling))
        except ApplicationError as error:
            if self.machines and error.type == "RegistrationTimeout":
                error.add_note(self.diagnosis())
            raise

    def diagnosis(self) -> str:
        """What the machines and the CSRs say, for a join that did not finish."""
        lines = []
        for machine in self.machines:
            lines.append(f"machine {machine.root.name}: steps {machine.steps}")
            lines.append(machine.log_tail(2500))
        for csr in self.csrs():
            lines.append(f"CSR {csr['metadata']['name']} {csr['spec']['signerName']} {csr['spec']['username']} "
                         f"{conditions(csr)} issued={bool((csr.get('status') or {}).get('certificate'))}")
        status, node = self.real.request("GET", f"/api/v1/nodes/{self.node_name}", admin=True)
        if status == 200:
            lines.append(f"Node {self.node_name}: {[(c['type'], c['status'], c.get('message', '')) for c in node['status'].get('conditions') or []]}")
            lines.append(f"  addresses {node['status'].get('addresses')} taints {node['spec'].get('taints')}")
        return "\n".join(lines)

    def csrs(self) -> list[dict]:
        status, listed = self.real.request("GET", CSR_PATH, admin=True)
        assert status == 200, listed
        return listed["items"]

    def stop(self) -> None:
        for machine in self.machines:
            machine.stop()
        self.cluster.api_client.close()


@pytest.fixture
def every_provider(request: pytest.FixtureRequest, tmp_path, real_cluster):
    """Each provider, with GPUFLEET_JOIN_ENDPOINT set: its machines reach the API server only at
    that address (inside their namespace nothing answers at cluster-info's 127.0.0.1)."""
    worlds = [RealJoining(request.getfixturevalue(f"{provider}_harness"), tmp_path / provider, real_cluster,
                          join_endpoint=f"{JOIN_ENDPOINT_IP}:6443") for provider in PROVIDERS]
    yield worlds
    for world in worlds:
        world.stop()


@pytest.fixture
def one(lambda_harness, tmp_path, real_cluster):
    world = RealJoining(lambda_harness, tmp_path, real_cluster)
    yield world
    world.stop()


def token_id(user_data: str) -> str:
    return read_join_configuration(user_data)["discovery"]["tlsBootstrapToken"].split(".")[0]


def conditions(csr: dict) -> list[tuple[str, str]]:
    return [(c["type"], c.get("reason", "")) for c in (csr.get("status") or {}).get("conditions") or []]


def wait_for(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {seconds:.0f} s")


def test_a_machine_of_every_provider_joins_a_real_kubeadm_cluster(every_provider: list[RealJoining]) -> None:
    """The five machines boot at once, as a fleet's joins do, each from its own user data; then
    each is held to its own identity (NodeRestriction), a second machine's token of its provider
    gets no certificate under its name, and its kubelet renews a 600-second client certificate."""
    booted = []
    for joining in every_provider:
        provisioned = joining.provision()
        user_data = user_data_of(joining.harness, provisioned.machine.id)
        assert read_join_configuration(user_data)["nodeRegistration"]["name"] == joining.node_name
        booted.append((joining, provisioned, user_data, joining.machine(provisioned.machine.id).boot()))
    for joining, provisioned, user_data, machine in booted:
        joined(joining, provisioned, user_data, machine)
    real = every_provider[0].real
    victim = f"victim-{uuid.uuid4().hex[:6]}"
    status, answer = real.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                            "metadata": {"name": victim}}, admin=True)
    assert status == 201, answer
    try:
        for joining, provisioned, _, machine in booted:
            keeps_to_its_own_identity(joining, provisioned, machine, victim)
    finally:
        real.request("DELETE", f"/api/v1/nodes/{victim}", admin=True)
    renews_for_600_seconds([(joining, machine) for joining, _, _, machine in booted])
    for joining, *_ in booted:
        another_token_gets_no_certificate_for_its_name(joining)


def joined(joining: RealJoining, provisioned, user_data: str, machine: Machine) -> None:
    """Everything a joined machine of ``joining``'s provider must be."""
    # Discovery, the TLS bootstrap and the kubelet all use the join endpoint: token discovery
    # would switch to cluster-info's `server` after discovery and hang in the TLS bootstrap.
    discovered = machine.wait_step("discovered", 60)
    assert discovered["server"] == f"https://{JOIN_ENDPOINT_IP}:6443"
    node = joining.await_registration(provisioned)
    machine.wait_step("kubelet", 30)
    assert f"server: https://{JOIN_ENDPOINT_IP}:6443" in machine.kubeconfig.read_text(), "the kubelet stays on it"

    assert node.name == joining.node_name and node.ready
    assert node.provider_id == provisioned.provider_id
    assert (node.site, node.provider) == (joining.site.name, joining.site.provider), "from the identity record"
    assert UNPROVEN_TAINT in node.taints, "registered unproven, from the JoinConfiguration's taints"
    assert node.gpus_allocatable == 8, "the kubelet advertises nvidia.com/gpu"
    assert set(node.addresses) <= set(joining.harness.provider.get_machine(provisioned.machine.id).addresses)
    identity = joining.cluster.node_identity(node.name)
    assert identity is not None and identity.machine_id == provisioned.machine.id
    assert node.addresses, "the kubelet reports the machine's address (own racks: its provisioning address)"
    lease = node_lease(joining, node.name)
    assert lease["spec"]["holderIdentity"] == node.name, "the kubelet heartbeats through its own Lease"

    # The kubelet's serving certificate (rotate-server-certificates) for the machine's own
    # addresses: gpufleet's approver can judge it only where the provider reports them.
    def serving():
        return next((c for c in joining.csrs() if c["spec"]["signerName"] == "kubernetes.io/kubelet-serving"
                     and c["spec"]["username"] == f"system:node:{node.name}"), None)

    wait_for(serving, 60, "the kubelet's serving CSR")
    run(joining.acts.approve_node_csrs)
    issued = wait_for(lambda: (c := serving()) and c["status"].get("certificate") and c, 30, "the serving certificate")
    assert ("Approved", "GpufleetApproved") in conditions(issued)

    token_id = read_join_configuration(user_data)["discovery"]["tlsBootstrapToken"].split(".")[0]
    [client_csr] = [c for c in joining.csrs() if c["spec"]["username"] == f"system:bootstrap:{token_id}"]
    assert client_csr["spec"]["signerName"] == "kubernetes.io/kube-apiserver-client-kubelet"
    assert BOOTSTRAP_GROUP in client_csr["spec"]["groups"]
    assert ("Approved", "GpufleetApproved") in conditions(client_csr)
    assert client_csr["status"].get("certificate"), "issued by the controller-manager's signer"
    status, tokens = joining.real.request("GET", "/api/v1/namespaces/kube-system/secrets", admin=True)
    assert not [t for t in tokens["items"] if t["type"] == "bootstrap.kubernetes.io/token"
                and base64.b64decode(t["data"]["token-id"]).decode() == token_id], \
        "the join token is deleted at registration"


def node_lease(joining: RealJoining, name: str) -> dict:
    """The node's heartbeat: its Lease in kube-node-lease, which its kubelet creates just after
    registering and renews."""
    def lease():
        status, found = joining.real.request(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}", admin=True)
        assert status in (200, 404), found
        return found if status == 200 else None

    return wait_for(lease, 20, f"{name}'s Lease")


MERGE = "application/merge-patch+json"


def keeps_to_its_own_identity(joining: RealJoining, provisioned, machine: Machine, victim: str) -> None:
    """NodeRestriction, as the machine's kubelet (its client certificate): it may annotate its own
    Node and set labels of no consequence, which change nothing the control plane knows of it;
    gpufleet's placement labels and annotations, its taints, its providerID and any other Node are
    refused; and
    gpufleet's approver denies it a serving certificate for an address not its machine's."""
    name, cert = joining.node_name, machine.client_pem
    repair = RepairActivities(joining.env)
    before = run(repair.node_facts, NodeFactsInput(node_name=name))
    assert (before.machine_id, before.site, before.provider) == (
        provisioned.machine.id, joining.site.name, joining.site.provider), "from the join's identity record"

    def as_the_node(node: str, patch: dict) -> tuple[int, dict]:
        return joining.real.request("PATCH", f"/api/v1/nodes/{node}", patch, cert=cert, content_type=MERGE)

    status, answer = as_the_node(name, {"metadata": {
        "annotations": {"example.com/machine-id": "victim-machine"},
        "labels": {"gpufleet.io/site": "another-site", "gpufleet.io/provider": "aws"}}})
    assert status == 200, (joining.site.provider, answer)
    for refused in ({"metadata": {"annotations": {"gpufleet.io/machine-id": "victim-machine"}}},  # gpufleet-node-marks
                    {"metadata": {"labels": {LABEL_SITE: "another-site"}}},
                    {"metadata": {"labels": {LABEL_PROVIDER: "aws"}}},
                    {"spec": {"taints": []}},
                    {"spec": {"providerID": "gpufleet://aws/x/victim"}}):
        status, answer = as_the_node(name, refused)
        assert status in (403, 422), (joining.site.provider, refused, answer)
    status, answer = as_the_node(victim, {"metadata": {"labels": {"x": "y"}}})
    assert status == 403, (joining.site.provider, answer)
    # A serving certificate for an address the provider does not report for the machine.
    serving = f"serving-{uuid.uuid4().hex[:8]}"
    status, answer = joining.real.request("POST", CSR_PATH, {
        "apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest", "metadata": {"name": serving},
        "spec": {"request": base64.b64encode(csr_pem(f"system:node:{joining.node_name}", ["system:nodes"],
                                                     ips=["198.51.100.99"], dns=[joining.node_name])).decode(),
                 "signerName": "kubernetes.io/kubelet-serving", "usages": ["digital signature", "server auth"]}},
        cert=cert)
    assert status == 201, (joining.site.provider, answer)
    run(joining.acts.approve_node_csrs)
    [csr] = [c for c in joining.csrs() if c["metadata"]["name"] == serving]
    assert [t for t, _ in conditions(csr)] == ["Denied"] and not csr["status"].get("certificate"), \
        (joining.site.provider, conditions(csr))
    assert run(repair.node_facts, NodeFactsInput(node_name=name)) == before, joining.site.provider
    assert UNPROVEN_TAINT in joining.cluster.get_node(name).taints


def renews_for_600_seconds(machines: list[tuple[RealJoining, Machine]]) -> None:
    """Each kubelet renews its client certificate with the shortest lifetime a CSR may ask for
    (what its certificate manager sends near expiry), all at once; the real signer honours it.
    kubeadm's kubeadm:node-autoapprove-certificate-rotation binding lets the controller-manager
    approve them; gpufleet's approver passes meanwhile (it approves a node's own renewal where
    that binding is gone: tests/realk8s/test_blast_radius.py)."""
    renewals: dict[str, dict] = {}

    def renew(joining: RealJoining, machine: Machine) -> None:
        try:
            renewals[joining.node_name] = machine.renew(600)
        except MachineFailed as failed:
            renewals[joining.node_name] = {"failed": failed}

    threads = [threading.Thread(target=renew, args=pair) for pair in machines]
    for thread in threads:
        thread.start()
    try:
        while any(thread.is_alive() for thread in threads):
            run(machines[0][0].acts.approve_node_csrs)
            threads[0].join(1)
    finally:
        for thread in threads:
            thread.join(90)
    csrs = {c["metadata"]["name"]: c for c in machines[0][0].csrs()}
    for joining, _ in machines:
        renewal = renewals.get(joining.node_name, {})
        assert renewal.get("step") == "renewed", (joining.site.provider, renewal)
        # The signer backdates notBefore by 5 minutes; notAfter is 600 s from issue.
        remaining = (datetime.fromisoformat(renewal["not_after"].replace("Z", "+00:00"))
                     - datetime.now(timezone.utc)).total_seconds()
        assert 500 <= remaining <= 600, f"{joining.site.provider}: expirationSeconds 600 ({remaining:.0f} s left)"
        renewed = csrs[renewal["csr"]]
        assert renewed["spec"]["username"] == f"system:node:{joining.node_name}"
        assert renewed["spec"]["expirationSeconds"] == 600
        assert [t for t, _ in conditions(renewed)] == ["Approved"], (joining.site.provider, conditions(renewed))


def another_token_gets_no_certificate_for_its_name(joining: RealJoining) -> None:
    """A second machine of the same provider, hostile, with its own fresh token from its own user
    data: the token may not write a Node, and its kubelet client CSR under the first machine's
    name (what its TLS bootstrap would send) is denied by gpufleet's approver and never signed."""
    first = joining.node_name
    joining.new_join()
    second = joining.provision()
    token = read_join_configuration(user_data_of(joining.harness, second.machine.id))["discovery"]["tlsBootstrapToken"]
    try:
        status, answer = joining.real.request("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": f"{first}-twin"}}, bearer=token)
        assert status == 403, (joining.site.provider, answer)
        name = f"forged-{uuid.uuid4().hex[:8]}"
        status, answer = joining.real.request("POST", CSR_PATH, {
            "apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest", "metadata": {"name": name},
            "spec": {"request": base64.b64encode(csr_pem(f"system:node:{first}", ["system:nodes"])).decode(),
                     "signerName": "kubernetes.io/kube-apiserver-client-kubelet",
                     "usages": ["digital signature", "client auth"]}}, bearer=token)
        assert status == 201, (joining.site.provider, answer)
        assert answer["spec"]["username"] == f"system:bootstrap:{token.split('.')[0]}"
        assert run(joining.acts.approve_node_csrs).denied >= 1
        time.sleep(1)  # the signer's chance to issue, were it approved
        [csr] = [c for c in joining.csrs() if c["metadata"]["name"] == name]
        assert [t for t, _ in conditions(csr)] == ["Denied"], (joining.site.provider, conditions(csr))
        assert not csr["status"].get("certificate")
    finally:
        joining.cluster.revoke_node_tokens(joining.node_name)


def test_gpufleets_token_group_is_not_auto_approved_while_kubeadms_still_is(one: RealJoining) -> None:
    """The controller-manager's csrapproving approves kubeadm's default group (kubeadm binds it);
    gpufleet's group is bound to no auto-approval: only gpufleet's approver decides its CSRs."""
    provisioned = one.provision()
    machine = one.machine(provisioned.machine.id).boot()
    machine.wait_step("kubelet-start", 60)

    requester = f"system:bootstrap:{token_id(machine.user_data)}"

    def pending_csr():
        return next((c for c in one.csrs() if c["spec"]["username"] == requester), None)

    csr = wait_for(pending_csr, 30, "the machine's bootstrap CSR")
    time.sleep(3)  # the controller-manager's approver has had its chance
    csr = pending_csr()
    assert BOOTSTRAP_GROUP in csr["spec"]["groups"]
    assert conditions(csr) == [], "left pending for gpufleet's approver"

    # The same user data with kubeadm's own token: approved with no approver of ours.
    kubeadm_user_data = machine.user_data.replace(read_join_configuration(machine.user_data)[
        "discovery"]["tlsBootstrapToken"], KUBEADM_TOKEN)
    one.new_join()
    other = one.machine(provisioned.machine.id, kubeadm_user_data.replace(
        read_join_configuration(machine.user_data)["nodeRegistration"]["name"], "kubeadm-joined-node"),
        name="kubeadm-token").boot()
    other.wait_step("tls-bootstrapped", 60)
    # Two such CSRs were seen once, on a loaded run: the one its kubelet took its certificate from
    # was approved by the controller-manager.
    kubeadms = [c for c in one.csrs() if KUBEADM_TOKEN_GROUP in c["spec"]["groups"]
                and c["spec"]["username"] == f"system:bootstrap:{KUBEADM_TOKEN.split('.')[0]}"]
    assert any(("Approved", "AutoApproved") in conditions(c) for c in kubeadms), [conditions(c) for c in kubeadms]


def test_registration_times_out_when_the_machine_never_gets_a_certificate(one: RealJoining) -> None:
    """No machine booted: the wait ends at its deadline, non-retryable, naming the node."""
    provisioned = one.provision()
    with pytest.raises(ApplicationError) as waited:
        one.await_registration(provisioned, seconds=2)
    assert waited.value.type == "RegistrationTimeout" and one.node_name in waited.value.message


def test_a_joined_nodes_spent_token_joins_nobody_and_its_kubelet_runs_pods_on_its_gpus(one: RealJoining) -> None:
    """One joined machine: its spent join token authenticates nobody (a second `kubeadm join` with
    the same user data stops at its first call as the token); the real scheduler places a GPU pod
    on it and its kubelet runs it. (NodeRestriction holding each node to its own object: every
    provider's, in the first test.)"""
    provisioned = one.provision()
    machine = one.machine(provisioned.machine.id).boot()
    node = one.await_registration(provisioned)
    first_renewal = node_lease(one, node.name)["spec"]["renewTime"]

    token = read_join_configuration(machine.user_data)["discovery"]["tlsBootstrapToken"]
    status, _ = one.real.request("GET", "/api/v1/namespaces/kube-public/configmaps/cluster-info", bearer=token)
    assert status == 401
    replay = one.machine(provisioned.machine.id, machine.user_data, name="replay")
    with pytest.raises(MachineFailed) as failed:
        replay.discover("--discovery-timeout=5s")
    # File discovery reads cluster-info anonymously; the first call as the token is refused.
    assert failed.value.step == "fetch-init-configuration" and "Unauthorized" in failed.value.error, failed.value

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"gpu-{uuid.uuid4().hex[:6]}", "namespace": "default"},
           "spec": {"containers": [{"name": "c", "image": "registry.invalid/serve:1",
                                    "resources": {"limits": {GPU_RESOURCE: "2"}}}],
                    "tolerations": [{"key": "gpufleet.io/unproven", "operator": "Exists"},
                                    {"key": "gpufleet.io/demand", "operator": "Exists"}],
                    "nodeSelector": {"kubernetes.io/hostname": node.name}}}
    status, created = one.real.request("POST", "/api/v1/namespaces/default/pods", pod, admin=True)
    assert status == 201, created
    name = pod["metadata"]["name"]

    def running():
        _, got = one.real.request("GET", f"/api/v1/namespaces/default/pods/{name}", admin=True)
        return got if got["status"].get("phase") == "Running" else None

    got = wait_for(running, 60, "the pod Running on the machine's kubelet")
    assert got["spec"]["nodeName"] == node.name
    one.real.request("DELETE", f"/api/v1/namespaces/default/pods/{name}?gracePeriodSeconds=0", admin=True)
    # Lease heartbeats: the kubelet renews its Lease every 10 s (a quarter of its 40 s duration).
    wait_for(lambda: node_lease(one, node.name)["spec"]["renewTime"] != first_renewal, 25, "a renewed Lease")


def _managers_of(node: dict, *path: str) -> set[str]:
    """The field managers of the Node that own the field at ``path`` (``f:`` keys of managedFields)."""
    owners = set()
    for entry in node["metadata"].get("managedFields") or []:
        fields = entry.get("fieldsV1") or {}
        for key in path:
            fields = fields.get(f"f:{key}") if isinstance(fields, dict) else None
        if fields is not None:
            owners.add(entry["manager"])
    return owners


def test_the_kubelet_registers_its_node_in_its_sites_zone(one: RealJoining) -> None:
    """The shipped bootstrap runs the kubelet with ``--node-labels=topology.kubernetes.io/zone=<site>``:
    the Node is in its site's zone from its registration on (pods started before gpufleet labels
    it already get their site's pod pool and same-site routing), written by the kubelet itself
    (NodeRestriction admits the key from a kubelet), not by gpufleet, which set no label here."""
    provisioned = one.provision()
    one.machine(provisioned.machine.id).boot()
    node = one.await_registration(provisioned)  # no labels handed over: gpufleet writes none
    status, registered = one.real.request("GET", f"/api/v1/nodes/{node.name}", admin=True)
    assert status == 200, registered
    labels = registered["metadata"]["labels"]
    assert labels.get(LABEL_ZONE) == one.site.name, labels
    assert LABEL_SITE not in labels, "gpufleet labelled nothing: the zone is the kubelet's"
    # The zone label's writer is the one that set the providerID: the kubelet registering the Node.
    kubelet = _managers_of(registered, "spec", "providerID")
    assert kubelet and _managers_of(registered, "metadata", "labels", LABEL_ZONE) == kubelet, \
        registered["metadata"].get("managedFields")


def test_a_machine_that_is_not_what_its_join_provisioned_is_refused_and_leaves_no_identity(
        one: RealJoining, aws_harness, tmp_path, real_cluster) -> None:
    """Two machines boot at once, each lying about itself in a way it can: one rewrote its own
    kubelet flags (another providerID), the other sits at addresses its provider does not
    report. Each registration is refused, nothing is recorded, the tokens are gone all the same."""
    provisioned = one.provision()
    user_data = user_data_of(one.harness, provisioned.machine.id)
    lying = user_data.replace(provisioned.provider_id, "gpufleet://lambda/other-account/someone-else")
    assert lying != user_data
    one.machine(provisioned.machine.id, lying, name="lying").boot()

    elsewhere = RealJoining(aws_harness, tmp_path / "aws", real_cluster)
    try:
        moved = elsewhere.provision()
        machine = elsewhere.machine(moved.machine.id)
        machine.addresses = ["198.51.100.99"]  # inside its own namespace: nothing leaves the machine
        machine.boot()

        # With the placement labels and taint NodeJoin hands over: they land only on a match.
        placement = {"labels": {LABEL_SITE: one.site.name}, "add_taints": [UNPROVEN_TAINT]}
        with pytest.raises(ApplicationError) as refused:
            one.await_registration(provisioned, **placement)
        assert refused.value.type == "RegistrationMismatch" and "providerID" in refused.value.message
        with pytest.raises(ApplicationError) as refused:
            elsewhere.await_registration(moved, **placement)
        assert refused.value.type == "RegistrationMismatch" and "addresses" in refused.value.message
        for world in (one, elsewhere):
            assert world.cluster.node_identity(world.node_name) is None
            stored = world.cluster.get_node(world.node_name)
            assert stored is None or LABEL_SITE not in stored.labels, "placement labels only on this join's machine"
        status, tokens = one.real.request("GET", "/api/v1/namespaces/kube-system/secrets", admin=True)
        spent = {token_id(user_data), token_id(user_data_of(aws_harness, moved.machine.id))}
        assert not [t for t in tokens["items"] if t["type"] == "bootstrap.kubernetes.io/token"
                    and base64.b64decode(t["data"]["token-id"]).decode() in spent]
    finally:
        elsewhere.stop()
