"""A real machine joins a real cluster (issue 24), in ``mode: real`` without the simulator.

Each provider adapter against its wire-level fake, the Kubernetes adapter against the
fake API server (bearer-token authentication, RBAC from deploy/bootstrap/rbac.yaml and
kubeadm's defaults, the CSR API and its controllers, NodeRestriction), and a simulated
kubelet that knows only the user data its machine received. The join's activities run
as the control-plane worker runs them: token and machine, then registration.

What the real control plane proves with real machines is not repeated here
(tests/realk8s/test_join.py): a token gets no certificate for another node, kubeadm's default
group is auto-approved where gpufleet's is not, a spent token joins nobody, a machine with
another providerID or at other addresses is refused.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import logging
import subprocess
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.account_store import AccountStore
from activities.control_plane import ControlPlaneActivities
from activities.env import FleetEnv
from activities.models import AwaitRegistrationInput, NodeFactsInput, PrepareNodeInput, ProvisionJoinInput
from activities.repair import RepairActivities
from fleet.cluster import LABEL_PROVIDER, LABEL_SITE, LABEL_ZONE, UNPROVEN_TAINT
from fleet.config import FleetConfig
from fleet.naming import node_name_for
from fleet.settings import Settings
from providers.cluster.bootstrap import BOOTSTRAP_GROUP, read_join_configuration
from providers.cluster.kubernetes import KubernetesCluster
from tests.cluster.fake_apiserver import FakeKube
from tests.cluster.sim_kubelet import JoinFailed, SimKubelet
from tests.providers.harness import Harness
from tests.tools import require

PROVIDERS = ["aws", "lambda", "nebius", "hetzner", "own_dc"]


def run(activity_fn, *args):
    """The activity as the worker runs it (the test stays sync: the Nebius SDK's sync calls
    refuse a running event loop)."""
    result = ActivityEnvironment().run(activity_fn, *args)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def user_data_of(harness: Harness, machine_id: str) -> str:
    """What the machine received, read where the provider keeps it."""
    kind = harness.provider.site.provider
    if kind == "aws":
        raw = harness.ec2.describe_instance_attribute(InstanceId=machine_id, Attribute="userData")
        return base64.b64decode(raw["UserData"]["Value"]).decode()
    if kind == "lambda":
        return harness.fake.user_data[machine_id]
    if kind == "hetzner":
        return harness.fake.user_data[int(machine_id)]
    if kind == "nebius":
        return harness.fake.instances[machine_id].spec.cloud_init_user_data
    seed = harness.provider.options["seed_dir"]
    with open(f"{seed}/{machine_id}/user-data") as seed_file:
        return seed_file.read()


def join_activities(harness: Harness, tmp_path, cluster) -> tuple[FleetEnv, ControlPlaneActivities]:
    """The control plane's join activities for one provider's adapter, over ``cluster``."""
    provider = harness.provider
    config = FleetConfig(mode="real", accounts=[provider.account], sites=[provider.site])
    env = FleetEnv(Settings(state_dir=tmp_path), config, cluster)
    env._providers[provider.site.name] = provider
    env._accounts = AccountStore(tmp_path / "guard.db")
    return env, ControlPlaneActivities(env)


class Joining:
    """One provider, the fake API server and the control plane's activities."""

    def __init__(self, harness: Harness, tmp_path) -> None:
        self.harness = harness
        self.tmp = tmp_path
        provider = harness.provider
        if provider.site.provider == "own-dc":
            provider.options["seed_dir"] = str(tmp_path / "seeds")
        self.fake = FakeKube().start().enable_bootstrap()
        self.cluster = KubernetesCluster(api_client=self.fake.api_client(), namespace="gpufleet")
        self.env, self.acts = join_activities(harness, tmp_path, self.cluster)
        self.site = provider.site
        self.join_id = f"join/{self.site.name}/{uuid.uuid4().hex[:6]}"
        self.node_name = node_name_for(self.site.name, self.join_id)

    def provision(self):
        spec = self.harness.spec.model_copy(update={"name": self.node_name})
        return run(self.acts.provision_joining_machine,
                   ProvisionJoinInput(site=self.site.name, spec=spec, idempotency_key=self.join_id))

    def kubelet(self, machine_id: str) -> SimKubelet:
        addresses = self.harness.provider.get_machine(machine_id).addresses
        return SimKubelet(user_data_of(self.harness, machine_id), addresses=addresses)

    def await_registration(self, provisioned, seconds: float = 20, **labelling):
        return run(self.acts.await_registration, AwaitRegistrationInput(
            site=self.site.name, node_name=self.node_name, machine_id=provisioned.machine.id,
            provider_id=provisioned.provider_id, join_id=self.join_id, poll_seconds=0.1,
            deadline=datetime.now(timezone.utc) + timedelta(seconds=seconds), **labelling))

    def join_alongside(self, kubelet: SimKubelet, provisioned, seconds: float = 20, **labelling):
        """The machine boots and joins while the control plane waits for it."""
        outcome: dict = {}

        def machine() -> None:
            try:
                outcome["node"] = kubelet.join()
            except Exception as error:  # noqa: BLE001 - reported to the test
                outcome["error"] = error

        thread = threading.Thread(target=machine)
        thread.start()
        try:
            return self.await_registration(provisioned, seconds, **labelling), outcome
        finally:
            thread.join(timeout=30)

    def tokens(self) -> list[dict]:
        return [s for s in self.fake.objects("", "secrets", "kube-system") if s["metadata"]["name"].startswith(
            "bootstrap-token-")]

    def stop(self) -> None:
        self.fake.stop()


@pytest.fixture(params=PROVIDERS)
def joining(request: pytest.FixtureRequest, tmp_path):
    harness = request.getfixturevalue(f"{request.param}_harness")
    world = Joining(harness, tmp_path)
    yield world
    world.stop()


@pytest.fixture
def one(lambda_harness, tmp_path):
    world = Joining(lambda_harness, tmp_path)
    yield world
    world.stop()


def test_a_machine_joins_from_nothing_but_its_user_data(joining: Joining, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    provisioned = joining.provision()
    machine = provisioned.machine
    [token] = joining.tokens()
    secret = base64.b64decode(token["data"]["token-secret"]).decode()
    assert base64.b64decode(token["data"]["auth-extra-groups"]).decode() == BOOTSTRAP_GROUP
    assert secret not in provisioned.model_dump_json(), "only the token's id leaves the activity"

    user_data = user_data_of(joining.harness, machine.id)
    config = read_join_configuration(user_data)
    assert config["nodeRegistration"]["name"] == joining.node_name
    kubelet = joining.kubelet(machine.id)
    assert kubelet.provider_id == provisioned.provider_id
    assert provisioned.provider_id == f"gpufleet://{joining.site.provider}/{joining.site.account}/{joining.node_name}"

    node, outcome = joining.join_alongside(kubelet, provisioned)
    assert "error" not in outcome, outcome.get("error")
    assert node.name == joining.node_name and node.ready
    assert (node.machine_id, node.site, node.provider, node.account) == (
        machine.id, joining.site.name, joining.site.provider, joining.site.account)
    assert UNPROVEN_TAINT in node.taints, "registered unproven: nothing lands before the smoke test"
    assert joining.tokens() == [], "the token is deleted as soon as the node registered"
    [csr] = joining.fake.objects("certificates.k8s.io", "certificatesigningrequests")
    assert csr["spec"]["username"] == f"system:bootstrap:{token['metadata']['labels']['gpufleet.io/token-id']}"
    assert [c["reason"] for c in csr["status"]["conditions"]] == ["GpufleetApproved"]

    labelled = run(joining.acts.prepare_node, PrepareNodeInput(
        node_name=node.name, labels={LABEL_SITE: joining.site.name, LABEL_PROVIDER: joining.site.provider}))
    assert labelled.labels[LABEL_SITE] == joining.site.name
    # The token, spent, authenticates nobody any more.
    with pytest.raises(JoinFailed) as spent:
        kubelet.call("GET", "/api/v1/namespaces/kube-public/configmaps/cluster-info", bearer=kubelet.token)
    assert spent.value.status == 401
    assert secret not in caplog.text, "the token's secret is in no log line"

    # What this provider handed the machine is valid cloud-config (without cloud-init the test
    # skips here, naming how to get it; CI, which installs it, fails instead: tests/tools.py).
    document = joining.tmp / "user-data.yaml"
    document.write_text(user_data)
    checked = subprocess.run([require("cloud-init"), "schema", "--config-file", str(document)],
                             capture_output=True, text=True)
    assert "Valid cloud-config" in checked.stdout, checked.stdout + checked.stderr


def test_a_retried_provision_reuses_its_token_and_its_machine(one: Joining) -> None:
    first = one.provision()
    again = one.provision()
    assert again.machine.id == first.machine.id and again.token.token_id == first.token.token_id
    assert len(one.tokens()) == 1


def test_registration_labels_and_taints_the_node_it_admitted(one: Joining) -> None:
    """NodeJoin (patch ``join-in-fewer-steps``) hands its labels and taint to the activity that
    sees the node register: against the API server they land once the registration matched."""
    provisioned = one.provision()
    kubelet = one.kubelet(provisioned.machine.id)
    labels = {LABEL_SITE: one.site.name, LABEL_PROVIDER: one.site.provider}
    node, outcome = one.join_alongside(kubelet, provisioned, labels=labels, add_taints=[UNPROVEN_TAINT])
    assert "error" not in outcome, outcome.get("error")
    stored = one.cluster.get_node(node.name)
    assert {k: stored.labels.get(k) for k in labels} == labels
    assert stored.labels.get(LABEL_ZONE) == one.site.name, "a site is a topology zone"
    assert UNPROVEN_TAINT in stored.taints


def test_a_mismatched_registration_is_not_labelled(one: Joining) -> None:
    provisioned = one.provision()
    kubelet = one.kubelet(provisioned.machine.id)
    kubelet.provider_id = "gpufleet://lambda/other-account/someone-else"
    with pytest.raises(ApplicationError):
        one.join_alongside(kubelet, provisioned, labels={LABEL_SITE: one.site.name}, add_taints=[UNPROVEN_TAINT])
    stored = one.cluster.get_node(one.node_name)
    assert stored is None or LABEL_SITE not in stored.labels, "placement labels only on this join's machine"


def test_a_node_relabelling_itself_changes_nothing_the_control_plane_does(one: Joining) -> None:
    provisioned = one.provision()
    kubelet = one.kubelet(provisioned.machine.id)
    node, _ = one.join_alongside(kubelet, provisioned)
    run(one.acts.prepare_node, PrepareNodeInput(node_name=node.name, labels={LABEL_SITE: one.site.name}))
    repair = RepairActivities(one.env)
    before = run(repair.node_facts, NodeFactsInput(node_name=node.name))

    # What NodeRestriction lets a kubelet do to its own Node: annotations, unrestricted labels.
    kubelet.patch_own_node({"metadata": {"annotations": {"gpufleet.io/machine-id": "victim-machine"},
                                         "labels": {"gpufleet.io/site": "another-site",
                                                    "gpufleet.io/provider": "aws"}}})
    # What it refuses: placement and compliance labels, taints, the providerID, other nodes.
    for refused in ({"metadata": {"labels": {LABEL_SITE: "another-site"}}},
                    {"metadata": {"labels": {LABEL_PROVIDER: "aws"}}},
                    {"spec": {"taints": []}},
                    {"spec": {"providerID": "gpufleet://aws/x/victim"}}):
        with pytest.raises(JoinFailed) as denied:
            kubelet.patch_own_node(refused)
        assert denied.value.status in (403, 422), refused
    other = SimKubelet(kubelet.user_data)
    other.credential, other.name = kubelet.credential, "some-other-node"
    with pytest.raises(JoinFailed) as denied:
        other.patch_own_node({"metadata": {"labels": {"x": "y"}}})
    assert denied.value.status == 403

    after = run(repair.node_facts, NodeFactsInput(node_name=node.name))
    assert after == before
    assert (after.machine_id, after.site, after.provider) == (provisioned.machine.id, one.site.name, "lambda")
    assert one.cluster.get_node(node.name).labels[LABEL_SITE] == one.site.name


def test_serving_certificates_only_for_the_machines_own_addresses(one: Joining) -> None:
    provisioned = one.provision()
    kubelet = one.kubelet(provisioned.machine.id)
    node, _ = one.join_alongside(kubelet, provisioned)
    good = kubelet.request_serving_certificate(kubelet.addresses)
    bad = kubelet.request_serving_certificate(["198.51.100.99"])
    count = run(one.acts.review_node_csrs)
    assert count == 2
    csrs = {c["metadata"]["name"]: c for c in one.fake.objects("certificates.k8s.io", "certificatesigningrequests")}
    assert [c["type"] for c in csrs[good]["status"]["conditions"]] == ["Approved"]
    assert csrs[good]["status"].get("certificate")
    assert [c["type"] for c in csrs[bad]["status"]["conditions"]] == ["Denied"]


def test_a_fence_cordons_the_node_at_the_api_server_and_lifting_it_uncordons(one: Joining) -> None:
    """Contain first, against the API server: the Node entity's ``fence_gpu`` writes the fence
    and the cordon; ``uncontain_gpu`` lifts them, uncordoning only when no GPU is fenced."""
    from activities.models import FenceInput, UncontainInput
    from activities.repair import fence_key

    provisioned = one.provision()
    node, _ = one.join_alongside(one.kubelet(provisioned.machine.id), provisioned)
    repair = RepairActivities(one.env)
    run(repair.fence_gpu, FenceInput(node_name=node.name, gpu=0, rung="reset"))
    run(repair.fence_gpu, FenceInput(node_name=node.name, gpu=1, rung="reboot"))
    stored = next(n for n in one.fake.objects("", "nodes") if n["metadata"]["name"] == node.name)
    assert stored["spec"].get("unschedulable") is True
    assert {k: v for k, v in stored["metadata"]["annotations"].items() if k.startswith("gpufleet.io/fenced")} == {
        fence_key(0): "reset", fence_key(1): "reboot"}

    first = run(repair.uncontain_gpu, UncontainInput(node_name=node.name, gpu=0))
    assert (first.uncordoned, first.still_fenced) == (False, [1])
    assert one.cluster.get_node(node.name).unschedulable
    last = run(repair.uncontain_gpu, UncontainInput(node_name=node.name, gpu=1))
    assert last.uncordoned and not one.cluster.get_node(node.name).unschedulable


def _activity_with_time(fn, *args, seconds: float = 60):
    """The activity with a real start time and ``seconds`` to run (what a worker gives it)."""
    import dataclasses

    environment = ActivityEnvironment()
    environment.info = dataclasses.replace(environment.info, started_time=datetime.now(timezone.utc),
                                           start_to_close_timeout=timedelta(seconds=seconds))
    result = environment.run(fn, *args)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def _gpufleet_token_ids(world: Joining) -> set[str]:
    return {base64.b64decode(s["data"]["token-id"]).decode() for s in world.fake.objects("", "secrets", "kube-system")
            if s.get("type") == "bootstrap.kubernetes.io/token"}


def _powered_off(world: Joining) -> bool:
    """The provider was told to power the machine off (sushy's fake driver reports no power
    state changes, so for own racks: the BMC got a ForceOff)."""
    harness = world.harness
    if world.site.provider == "hetzner":
        return any(m == "POST" and p.endswith("/actions/poweroff") for m, p in harness.fake.requests)
    return any(r.method == "POST" and r.path.endswith("/Actions/ComputerSystem.Reset") and b"ForceOff" in r.body
               for r in harness.proxy.requests)


def _booted_again(world: Joining) -> bool:
    """The provider was told to boot the machine's fresh install (rebuild; one-time PXE boot)."""
    harness = world.harness
    if world.site.provider == "hetzner":
        return bool(harness.fake.rebuilds)
    return any(r.method == "PATCH" and b"Pxe" in r.body for r in harness.proxy.requests)


def _rack_machine_booted_long_ago(world: Joining) -> None:
    """Own racks: the machine is up and running (sushy's fake driver answers Off whatever it
    was told): the reinstall's first look at it and its power-off find it On."""
    if world.site.provider == "own-dc":
        from tests.providers.test_own_dc import rewrite_system

        world.harness.provider.options["boot_grace_seconds"] = 0
        world.harness.proxy.reset()
        for _ in range(2):
            world.harness.proxy.once(rewrite_system(lambda system: system.update(PowerState="On")))


@pytest.mark.parametrize("provider", ["hetzner", "own_dc"])
def test_a_reinstall_boots_fresh_user_data_only_once_the_old_node_is_not_ready(provider, request, tmp_path) -> None:
    """kubeadm refuses to join while a Ready Node of its name exists: the reinstall rung powers
    the machine off, waits for the Node to go NotReady (the node lifecycle controller's verdict
    on a kubelet gone quiet), and only then rebuilds (Hetzner) or PXE-boots (own racks) it with
    fresh user data carrying a fresh token. The Node itself, with its labels, stays."""
    from activities.models import RestartMachineInput

    world = Joining(request.getfixturevalue(f"{provider}_harness"), tmp_path)
    try:
        provisioned = world.provision()
        machine_id = provisioned.machine.id
        node, _ = world.join_alongside(world.kubelet(machine_id), provisioned)
        run(world.acts.prepare_node, PrepareNodeInput(node_name=node.name, labels={LABEL_SITE: world.site.name}))
        first = user_data_of(world.harness, machine_id)
        _rack_machine_booted_long_ago(world)
        repair = RepairActivities(world.env)
        outcome: dict = {}

        def reinstall() -> None:
            try:
                outcome["said"] = _activity_with_time(repair.reinstall_machine, RestartMachineInput(
                    site=world.site.name, machine_id=machine_id, node_name=node.name, boot_id_before=node.boot_id))
            except Exception as error:  # noqa: BLE001 - reported to the test
                outcome["error"] = error

        thread = threading.Thread(target=reinstall)
        thread.start()
        deadline = time.monotonic() + 20
        while not _powered_off(world) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _powered_off(world), "powered off first"
        time.sleep(1.5)
        assert thread.is_alive() and not _booted_again(world) and user_data_of(world.harness, machine_id) == first, \
            "nothing boots while the old Node is Ready"
        world.fake.set_node_ready(node.name, False)
        thread.join(30)
        assert outcome.get("said") == "reinstall requested", outcome
        fresh = user_data_of(world.harness, machine_id)
        token = read_join_configuration(fresh)["discovery"]["tlsBootstrapToken"]
        assert token != read_join_configuration(first)["discovery"]["tlsBootstrapToken"]
        assert token.split(".")[0] in _gpufleet_token_ids(world) and _booted_again(world)
        assert world.cluster.get_node(node.name).labels[LABEL_SITE] == world.site.name, "the Node stays"
    finally:
        world.stop()


def test_a_reinstall_whose_node_stays_ready_leaves_the_machine_off_and_no_token(own_dc_harness, tmp_path) -> None:
    from activities.models import RestartMachineInput

    world = Joining(own_dc_harness, tmp_path)
    try:
        provisioned = world.provision()
        node, _ = world.join_alongside(world.kubelet(provisioned.machine.id), provisioned)
        first = user_data_of(world.harness, provisioned.machine.id)
        tokens = _gpufleet_token_ids(world)
        _rack_machine_booted_long_ago(world)
        repair = RepairActivities(world.env)
        with pytest.raises(ApplicationError) as waited:
            _activity_with_time(repair.reinstall_machine, RestartMachineInput(
                site=world.site.name, machine_id=provisioned.machine.id, node_name=node.name,
                boot_id_before=node.boot_id), seconds=23)
        assert waited.value.type == "NodeStillReady" and not waited.value.non_retryable
        assert "still Ready at" in waited.value.message and "kubeadm refuses" in waited.value.message
        assert _powered_off(world) and not _booted_again(world)
        assert user_data_of(world.harness, provisioned.machine.id) == first
        assert _gpufleet_token_ids(world) == tokens, "the reinstall's token never reached a machine: revoked"
    finally:
        world.stop()
