"""What a joining machine of each provider is handed (issue 24), in ``mode: real``: each provider
adapter against its wire-level fake renders the machine's user data from the join's token, and
that document is valid cloud-config naming the node, its providerID and nothing secret outside
it. The control plane here is the simulated cluster (only its token and bootstrap endpoint are
used); the join itself, against a real kubeadm control plane with real kubelets booted from this
user data, is tests/realk8s/test_join.py.

The helpers below are the real tier's too (tests/realk8s/).

What used to run here against the fake API server and a simulated kubelet, and where it runs now
on the real control plane (issue 33):

* a machine of every provider joins from its user data; the token is deleted at registration;
  the CSR is gpufleet-approved: ``test_join.py::test_a_machine_of_every_provider_joins_a_real_kubeadm_cluster``,
  which also holds each node to its own identity under NodeRestriction (what it may and may not
  write of its Node, and that none of it changes ``node_facts``), denies a serving certificate
  for another address and a second token's CSR under its name;
* a spent token joins nobody: ``test_join.py::test_a_joined_nodes_spent_token_joins_nobody_and_its_kubelet_runs_pods_on_its_gpus``;
* registration labels and taints the node it admitted: ``test_labels.py`` (labels and taint
  through ``await_registration``), a mismatched registration is not labelled:
  ``test_join.py::test_a_machine_that_is_not_what_its_join_provisioned_is_refused_and_leaves_no_identity``;
* a fence cordons at the API server, lifting it uncordons:
  ``test_adapter_objects.py::test_a_fence_cordons_the_node_and_lifting_the_last_uncordons``;
* a reinstall waits for NotReady before it boots fresh user data:
  ``test_reinstall.py`` (own racks, the real node lifecycle controller's verdict; Hetzner's
  rebuild with fresh user data: tests/providers/test_hetzner.py), and one whose Node stays Ready
  leaves the machine off and no token: ``test_reinstall.py::test_a_reinstall_whose_node_stays_ready_leaves_the_machine_off_and_no_token``.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import logging
import subprocess
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from temporalio.testing import ActivityEnvironment

from activities.account_store import AccountStore
from activities.control_plane import ControlPlaneActivities
from activities.env import FleetEnv
from fleet.messages.nodes import ProvisionJoinInput
from fleet.config import FleetConfig
from fleet.naming import node_name_for
from fleet.settings import Settings
from providers.cluster.bootstrap import read_join_configuration
from sim.cluster import SimCluster
from sim.world import SimWorld
from tests.providers.harness import Harness
from tests.tools import needs, require

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


class Rendering:
    """One provider and the control plane's join activities over the simulated cluster: what a
    machine is handed, without a cluster to join."""

    def __init__(self, harness: Harness, tmp_path) -> None:
        self.harness = harness
        provider = harness.provider
        if provider.site.provider == "own-dc":
            provider.options["seed_dir"] = str(tmp_path / "seeds")
        self.cluster = SimCluster(SimWorld(tmp_path / "sim.db"))
        self.env, self.acts = join_activities(harness, tmp_path, self.cluster)
        self.site = provider.site
        self.join_id = f"join/{self.site.name}/{uuid.uuid4().hex[:6]}"
        self.node_name = node_name_for(self.site.name, self.join_id)

    def provision(self):
        spec = self.harness.spec.model_copy(update={"name": self.node_name})
        return run(self.acts.provision_joining_machine,
                   ProvisionJoinInput(site=self.site.name, spec=spec, idempotency_key=self.join_id))


@pytest.fixture(params=PROVIDERS)
def rendering(request: pytest.FixtureRequest, tmp_path) -> Rendering:
    return Rendering(request.getfixturevalue(f"{request.param}_harness"), tmp_path)


@needs("cloud-init")
def test_a_machine_joins_from_nothing_but_its_user_data(rendering: Rendering, caplog) -> None:
    """What each provider hands its machine: valid cloud-config carrying the join (the name,
    tests/plugins/tiers.py lists it, is the whole story's: the join itself, from this document, is
    tests/realk8s/test_join.py's)."""
    caplog.set_level(logging.DEBUG)
    provisioned = rendering.provision()
    user_data = user_data_of(rendering.harness, provisioned.machine.id)
    config = read_join_configuration(user_data)
    token = config["discovery"]["tlsBootstrapToken"]
    secret = token.partition(".")[2]
    assert token.split(".")[0] == provisioned.token.token_id
    assert secret not in provisioned.model_dump_json(), "only the token's id leaves the activity"
    assert secret not in caplog.text, "the token's secret is in no log line"
    assert config["nodeRegistration"]["name"] == rendering.node_name
    site = rendering.site
    assert provisioned.provider_id == f"gpufleet://{site.provider}/{site.account}/{rendering.node_name}"
    assert provisioned.provider_id in user_data, "the kubelet registers with the providerID the join checks"

    # Valid cloud-config (without cloud-init the test skips here, naming how to get it; CI, which
    # installs it, fails instead: tests/tools.py).
    document = rendering.env.settings.state_dir / "user-data.yaml"
    document.write_text(user_data)
    checked = subprocess.run([require("cloud-init"), "schema", "--config-file", str(document)],
                             capture_output=True, text=True)
    assert "Valid cloud-config" in checked.stdout, checked.stdout + checked.stderr


def test_a_retried_provision_reuses_its_token_and_its_machine(lambda_harness, tmp_path) -> None:
    one = Rendering(lambda_harness, tmp_path)
    first = one.provision()
    again = one.provision()
    assert again.machine.id == first.machine.id and again.token.token_id == first.token.token_id
    assert user_data_of(one.harness, first.machine.id) == user_data_of(one.harness, again.machine.id)


def _activity_with_time(fn, *args, seconds: float = 60):
    """The activity with a real start time and ``seconds`` to run (what a worker gives it)."""
    import dataclasses

    environment = ActivityEnvironment()
    environment.info = dataclasses.replace(environment.info, started_time=datetime.now(timezone.utc),
                                           start_to_close_timeout=timedelta(seconds=seconds))
    result = environment.run(fn, *args)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def _powered_off(world) -> bool:
    """The provider was told to power the machine off (sushy's fake driver reports no power
    state changes, so for own racks: the BMC got a ForceOff)."""
    harness = world.harness
    if world.site.provider == "hetzner":
        return any(m == "POST" and p.endswith("/actions/poweroff") for m, p in harness.fake.requests)
    return any(r.method == "POST" and r.path.endswith("/Actions/ComputerSystem.Reset") and b"ForceOff" in r.body
               for r in harness.proxy.requests)


def _booted_again(world) -> bool:
    """The provider was told to boot the machine's fresh install (rebuild; one-time PXE boot)."""
    harness = world.harness
    if world.site.provider == "hetzner":
        return bool(harness.fake.rebuilds)
    return any(r.method == "PATCH" and b"Pxe" in r.body for r in harness.proxy.requests)


def _rack_machine_booted_long_ago(world) -> None:
    """Own racks: the machine is up and running (sushy's fake driver answers Off whatever it
    was told): the reinstall's first look at it and its power-off find it On."""
    if world.site.provider == "own-dc":
        from tests.providers.test_own_dc import rewrite_system

        world.harness.provider.options["boot_grace_seconds"] = 0
        world.harness.proxy.reset()
        for _ in range(2):
            world.harness.proxy.once(rewrite_system(lambda system: system.update(PowerState="On")))
