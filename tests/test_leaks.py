"""Nothing leaks (issue 13, items 5, 7, 9): the account guard holds for every path, disruptive
actions happen once across activity retries, a failed provision deletes what it made, and
FleetSweep deletes fleet-marked orphans past the grace, and nothing else."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.control_plane import ControlPlaneActivities
from activities.env import FleetEnv
from fleet.messages.nodes import DeleteMachineInput, ReleaseProvisionInput, ResetGpuInput, RestartMachineInput
from activities.node_agent import NodeAgentActivities
from activities.repair import RESTARTED_FROM, RepairActivities
from fleet.messages.join import NodeJoinResult
from fleet.messages.sweep import FleetSweepResult
from fleet.models import AccountState, MachineSpec
from fleet.naming import account_workflow_id, node_name_for
from sim.gpu import SimGpuBackend
from sim.provider import SimProvider
from tests.conftest import Stack, wait_for
from tests.replay import replay_and_record

FAST = {"timeouts": {"registration_seconds": 3, "smoke_test_seconds": 5, "heartbeat_seconds": 2}}
HOURS_2 = 7200


async def failure_of(handle) -> ApplicationError:
    with pytest.raises(WorkflowFailureError) as caught:
        await handle.result()
    assert isinstance(caught.value.cause, ApplicationError)
    return caught.value.cause


def sim_provider(stack: Stack, site: str) -> SimProvider:
    env = FleetEnv.from_settings(stack.settings)
    s = env.config.site(site)
    return SimProvider(s, env.config.account_for(s), stack.world)


def make_machine(stack: Stack, site: str, key: str) -> str:
    """A fleet-marked machine created the way a join creates one (name from the key)."""
    provider = sim_provider(stack, site)
    s = provider.site
    spec = MachineSpec(name=node_name_for(site, key), site=site, region=s.region, instance_type=s.instance_type,
                       gpu=s.gpu, gpus=s.gpus_per_machine)
    return provider.create_machine(spec, key).id


def actions(stack: Stack, machine_id: str, op: str) -> int:
    return sum(1 for a in stack.world.actions(machine_id) if a["op"] == op)


# -- item 7: the account guard holds for a plain join ---------------------------------------
async def test_a_revoked_account_is_called_once_by_two_plain_joins(stack: Stack) -> None:
    stack.world.set_credentials_valid("acct-b", False)
    first = await failure_of(await stack.start_join({"site": "site-b"}))
    assert first.type == "BadCredentials"
    calls = stack.world.calls("acct-b")
    assert calls >= 1
    second = await failure_of(await stack.start_join({"site": "site-b"}))
    assert second.type == "BadCredentials"
    assert stack.world.calls("acct-b") == calls, "the second join made a provider call to a revoked account"
    # The entity is the record a person sees: it says revoked too.
    handle = stack.client.get_workflow_handle(account_workflow_id("nebius", "acct-b"))
    status = await wait_for_async(lambda: handle.query("status"))
    assert status["state"] == AccountState.CREDENTIALS_REVOKED.value


async def wait_for_async(fn, timeout: float = 10):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await fn()
        except Exception:  # noqa: BLE001 - not there yet
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


# -- item 5: a failed provision deletes what an earlier attempt created ----------------------
async def test_release_provision_deletes_the_machine_made_under_the_key(stack: Stack) -> None:
    key = f"join/site-a/{uuid.uuid4().hex[:8]}"
    made = make_machine(stack, "site-a", key)
    other = make_machine(stack, "site-a", f"join/site-a/{uuid.uuid4().hex[:8]}")
    foreign = stack.world.add_foreign_machine("site-a", node_name_for("site-a", key))
    acts = ControlPlaneActivities(FleetEnv.from_settings(stack.settings))
    inp = ReleaseProvisionInput(site="site-a", name=node_name_for("site-a", key), idempotency_key=key)
    assert await ActivityEnvironment().run(acts.release_provision, inp) == [made]
    assert await ActivityEnvironment().run(acts.release_provision, inp) == [], "a second run finds nothing"
    live = {m["id"] for m in stack.world.machines("site-a")}
    assert made not in live and {other, foreign} <= live, "only the key's fleet-marked machine goes"


async def test_a_failed_provision_looks_for_its_machine(stack: Stack) -> None:
    stack.world.set_site("site-a", quota=0)
    handle = await stack.start_join({"site": "site-a"})
    assert (await failure_of(handle)).type == "OverQuota"
    assert stack.world.calls("acct-a", "list") == 1
    await replay_and_record(handle, "node_join_release_failed_provision")


async def test_clean_up_deletes_the_machine_then_the_node(stack: Stack) -> None:
    stack.world.set_site("site-a", unreachable=1)  # boots, never registers: the join cleans up
    handle = await stack.start_join({"site": "site-a", "timeouts": {"registration_seconds": 1}})
    assert (await failure_of(handle)).type == "RegistrationTimeout"
    assert stack.world.machines("site-a") == []
    history = await handle.fetch_history()
    scheduled = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                 if e.HasField("activity_task_scheduled_event_attributes")]
    assert scheduled.index("delete_machine") < scheduled.index("remove_node"), scheduled
    await replay_and_record(handle, "node_join_clean_up_machine_first")


# -- item 9: disruptive actions once across retries ------------------------------------------
async def test_a_retried_reboot_is_not_repeated_before_the_node_reports_its_new_boot(stack: Stack) -> None:
    result = NodeJoinResult.model_validate(await (await stack.start_join({"site": "site-a", **FAST})).result())
    node = result.nodes[0]
    stack.host_stop.set()  # no kubelet: the node keeps reporting its old boot id
    stack.world.set_site("site-a", boot_seconds=0)
    boot_before = stack.cluster.get_node(node.node_name).boot_id
    acts = RepairActivities(FleetEnv.from_settings(stack.settings))
    inp = RestartMachineInput(site="site-a", machine_id=node.machine_id, node_name=node.node_name,
                              boot_id_before=boot_before)
    said = await ActivityEnvironment().run(acts.reboot_machine, inp)
    assert said == "reboot requested"
    assert stack.world.machine(node.machine_id)["boot_id"] != boot_before
    again = await ActivityEnvironment().run(acts.reboot_machine, inp)  # the retry of a lost reply
    assert again.startswith("already")
    assert actions(stack, node.machine_id, "reboot") == 1


@pytest.mark.parametrize("bare_mark", [False, True], ids=["marked", "marked-before-the-op-was-named"])
async def test_a_reinstall_after_a_reboot_from_the_same_boot_reinstalls_once(stack: Stack, bare_mark: bool) -> None:
    """The reboot's new boot never came (the machine still rebooting, the node on its old boot
    id), and the ladder reinstalls from that boot. The reinstall took the reboot's mark for its
    own request and never reinstalled. It is requested, once across retries; so after a reboot
    marked by a version whose mark was the bare boot id (a repair mid-flight across an upgrade)."""
    result = NodeJoinResult.model_validate(await (await stack.start_join({"site": "site-a", **FAST})).result())
    node = result.nodes[0]
    stack.host_stop.set()  # no kubelet: the node keeps reporting its old boot id
    stack.world.set_site("site-a", boot_seconds=600)  # the reboot's new boot never comes
    boot_before = stack.cluster.get_node(node.node_name).boot_id
    acts = RepairActivities(FleetEnv.from_settings(stack.settings))
    inp = RestartMachineInput(site="site-a", machine_id=node.machine_id, node_name=node.node_name,
                              boot_id_before=boot_before)
    assert await ActivityEnvironment().run(acts.reboot_machine, inp) == "reboot requested"
    if bare_mark:
        stack.cluster.annotate_node(node.node_name, {RESTARTED_FROM: boot_before})
    assert (await ActivityEnvironment().run(acts.reboot_machine, inp)).startswith("already requested")
    assert await ActivityEnvironment().run(acts.reinstall_machine, inp) == "reinstall requested"
    again = await ActivityEnvironment().run(acts.reinstall_machine, inp)  # the retry of a lost reply
    assert again.startswith("already requested")
    assert actions(stack, node.machine_id, "reboot") == 1
    assert actions(stack, node.machine_id, "reinstall") == 1


async def test_a_retried_reinstall_after_a_reboot_whose_call_went_through_does_not_wipe_the_machine_again(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reinstall after this boot's reboot went through at the provider, but its mark was not
    written (the API server refused the annotate). Its retry found only the reboot's mark, which
    lets a reinstall past the machine's rebuilding state, and wiped the machine a second time.
    The attempt's heartbeat records the call; the retry, which the server hands that heartbeat,
    does not call the provider again and writes the mark."""
    import dataclasses

    from fleet.errors import Transient

    result = NodeJoinResult.model_validate(await (await stack.start_join({"site": "site-a", **FAST})).result())
    node = result.nodes[0]
    stack.host_stop.set()  # no kubelet: the node keeps reporting its old boot id
    stack.world.set_site("site-a", boot_seconds=600)  # the reboot's and the reinstall's boots never come
    boot_before = stack.cluster.get_node(node.node_name).boot_id
    acts = RepairActivities(FleetEnv.from_settings(stack.settings))
    inp = RestartMachineInput(site="site-a", machine_id=node.machine_id, node_name=node.node_name,
                              boot_id_before=boot_before)
    assert await ActivityEnvironment().run(acts.reboot_machine, inp) == "reboot requested"

    annotate = acts.env.cluster.annotate_node

    def refused_once(name: str, changes: dict, *args, **kwargs):
        if changes.get(RESTARTED_FROM, "").startswith("reinstall:"):
            monkeypatch.setattr(acts.env.cluster, "annotate_node", annotate)
            raise Transient("the API server answered 503", provider="kubernetes", code="503")
        return annotate(name, changes, *args, **kwargs)

    monkeypatch.setattr(acts.env.cluster, "annotate_node", refused_once)
    first, beats = ActivityEnvironment(), []
    first.on_heartbeat = lambda *details: beats.extend(details)
    with pytest.raises(Exception, match="503"):
        await first.run(acts.reinstall_machine, inp)
    assert actions(stack, node.machine_id, "reinstall") == 1
    assert sim_provider(stack, "site-a").get_machine(node.machine_id).state == "rebooting"

    retry = ActivityEnvironment()  # what the server hands attempt 2: attempt 1's last heartbeat
    retry.info = dataclasses.replace(retry.info, attempt=2, heartbeat_details=beats)
    assert (await retry.run(acts.reinstall_machine, inp)).startswith("already requested")
    assert actions(stack, node.machine_id, "reinstall") == 1, "the retry wiped the machine again"
    assert stack.cluster.annotate_node(node.node_name, {})[RESTARTED_FROM] == f"reinstall:{boot_before}"


async def test_a_delete_that_finds_nothing_is_done(stack: Stack) -> None:
    machine = make_machine(stack, "site-a", f"join/site-a/{uuid.uuid4().hex[:8]}")
    acts = ControlPlaneActivities(FleetEnv.from_settings(stack.settings))
    for _ in range(2):
        await ActivityEnvironment().run(acts.delete_machine, DeleteMachineInput(site="site-a", machine_id=machine))
    await ActivityEnvironment().run(acts.delete_machine, DeleteMachineInput(site="site-a", machine_id="sim-unknown"))
    assert actions(stack, machine, "delete") == 1
    assert stack.world.machines("site-a") == []


async def test_a_gpu_reset_is_keyed_to_its_repair_attempt(stack: Stack) -> None:
    machine = make_machine(stack, "site-a", f"join/site-a/{uuid.uuid4().hex[:8]}")
    agent = NodeAgentActivities("n", SimGpuBackend(stack.world, machine))
    attempt = ResetGpuInput(index=1, key="repair/n/gpu1/run/1")
    for _ in range(2):
        ActivityEnvironment().run(agent.reset_gpu, attempt)
    assert actions(stack, machine, "gpu_reset") == 1, "a retried reset of one attempt resets once"
    ActivityEnvironment().run(agent.reset_gpu, ResetGpuInput(index=1, key="repair/n/gpu1/run/2"))
    assert actions(stack, machine, "gpu_reset") == 2, "the next attempt resets again"


# -- item 5: FleetSweep on the simulated fleet ----------------------------------------------
async def test_fleet_sweep_deletes_only_old_unaccounted_fleet_machines(stack: Stack) -> None:
    # Accounted for by a node: a join that finished.
    done = NodeJoinResult.model_validate(await (await stack.start_join({"site": "site-a", **FAST})).result())
    joined = done.nodes[0].machine_id
    stack.world.age_machine(joined, HOURS_2)
    # Accounted for by a running join: its machine never registers (the join waits for it).
    stack.world.set_site("site-a", unreachable=1)
    running = await stack.start_join({"site": "site-a", "timeouts": {"registration_seconds": 120}})
    in_flight = (await wait_for(lambda: [m for m in stack.world.machines("site-a") if m["id"] != joined]))[0]["id"]
    stack.world.age_machine(in_flight, HOURS_2)
    orphan = make_machine(stack, "site-a", "join/site-a/lost-long-ago")
    stack.world.age_machine(orphan, HOURS_2)
    young = make_machine(stack, "site-a", "join/site-a/lost-just-now")
    foreign = stack.world.add_foreign_machine("site-a", "someone-elses-box", age_seconds=HOURS_2)
    # A revoked account: not called at all, its machines untouched.
    stack.world.set_credentials_valid("acct-b", False)
    await failure_of(await stack.start_join({"site": "site-b"}))
    calls_b = stack.world.calls("acct-b")

    sweep = await stack.client.start_workflow(
        "FleetSweep", {"grace_seconds": 1800}, id=f"fleet-sweep/{uuid.uuid4().hex[:8]}",
        task_queue=stack.settings.task_queue, result_type=FleetSweepResult,
    )
    result = await sweep.result()
    await replay_and_record(sweep, "fleet_sweep")
    live = {m["id"] for m in stack.world.machines("site-a")}
    assert orphan not in live
    assert {joined, in_flight, young, foreign} <= live
    by_site = {r.site: r for r in result.sites}
    a = by_site["site-a"]
    assert a.deleted == [orphan] and a.young == [young] and a.unmarked == 1 and a.joining == 1 and a.known == 1
    assert by_site["site-b"].skipped.startswith("credentials revoked")
    assert stack.world.calls("acct-b") == calls_b
    assert result.deleted == 1
    await running.terminate("test over")
