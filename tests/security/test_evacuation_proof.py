"""Issue 35, item 5: an evacuation's proof is per node. One node that fails its smoke test (a
GPU still broken) or garbles it (a hostile agent) cannot hold its site at weight 0: the site
comes back with the nodes that pass, the others stay cordoned and go to the repair ladder,
which repairs them (and they serve again)."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest

from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue
from temporalio.worker import Worker

import workers.node_agent
from fleet.messages.nodes import SmokeTestInput
from activities.node_agent import NodeAgentActivities
from fleet.cluster import fenced_gpus
from fleet.messages.evacuation import EvacuationLeftovers, EvacuationProgress, EvacuationResult
from fleet.messages.repair import GpuDecision, GpuRepairResult, NodeStatus
from fleet.naming import node_queue
from tests.bad_input_helpers import task_failures
from tests.evacuation_helpers import incident_fleet, open_incident_stack, poll
from fleet.contracts import workflows as flows
from tests.repair_helpers import eventually, exists, join_node, repair_handle, running_stack
from tests.replay import replay_and_record
from providers.gpu import ComputeCheckUnavailable
from sim.gpu import SimGpuBackend
from workflows.evacuation import failing_gpus


#: A garbled proof: "yes" is not a boolean; a count that is no number.
GARBLED = Payload(metadata={"encoding": b"json/plain"}, data=json.dumps({"passed": "yes", "gpus_seen": "all"}).encode())
#: A proof the SDK refuses before workflow code runs (TMPRL1105: an external-storage reference,
#: no external storage configured): before the gateway rebuilt results, it failed the
#: SiteEvacuation's workflow task on every retry, and the site stayed at weight 0.
EXTERNALLY_STORED = Payload(metadata={"encoding": b"json/external-storage-reference"},
                            data=b'{"driver_name": "s3", "driver_claim": {"key": "proof"}}')


class GarbledProof:
    """Agents as usual, except that the nodes in ``nodes`` answer an evacuation's smoke test
    with ``answer`` (``GARBLED`` unless told)."""

    def __init__(self, answer: Payload = GARBLED) -> None:
        self.nodes: set[str] = set()
        self.answer = answer

    def build_agent(self, client, node_name, gpus, executor, watch=None) -> Worker:
        agent = NodeAgentActivities(node_name, gpus, watch)

        @activity.defn(name="smoke_test")
        def smoke_test(input: SmokeTestInput) -> Any:
            if node_name in self.nodes and activity.info().workflow_type == "SiteEvacuation":
                return RawValue(self.answer)
            return agent.smoke_test(input)

        others = [a for a in agent.all() if getattr(a, "__name__", "") != "smoke_test"]
        return Worker(client, task_queue=node_queue(node_name), activities=[*others, smoke_test],
                      activity_executor=executor, max_concurrent_activities=5)


async def test_one_failing_and_one_garbled_node_do_not_keep_the_site_at_weight_zero(
        temporal_env, tmp_path, monkeypatch) -> None:
    garbled = GarbledProof()
    monkeypatch.setattr(workers.node_agent, "build_agent", garbled.build_agent)
    async for inc in open_incident_stack(temporal_env.client, tmp_path):
        machines = await inc.join("a", 4)
        names = {m: inc.world.machine(m)["name"] for m in machines}
        await inc.start_site("a")
        broken, healed, liar = machines[0], machines[1:3], machines[3]
        # A condition (not an XID event): a finding held by the incident is forgotten once its GPU
        # heals, so after the restore only the two unproven nodes ask for repairs (no new trip).
        # The provider's fix clears two; the third GPU is one a reboot (the ladder's) fixes.
        for machine in healed:
            inc.world.inject_fault(machine, 0, "ecc", 1, clears_on="never")
        inc.world.inject_fault(broken, 0, "ecc", 1, clears_on="reboot")
        evacuation = inc.evacuation("a")
        await poll(lambda: inc.progress("a"), timeout=60)

        # The incident is open (the proof comes after the drain): the provider fixes two of the
        # three; the third stays broken; the fourth will lie.
        for machine in healed:
            inc.world.clear_faults(machine, "never")
        garbled.nodes.add(names[liar])
        result = EvacuationResult.model_validate(await asyncio.wait_for(evacuation.result(), 90))

        assert result.outcome == "restored"
        proven = next(s for s in result.timeline if s.name == "nodes proven")
        assert proven.detail.startswith("2 nodes passed smoke tests")
        assert names[broken] in proven.detail and names[liar] in proven.detail and "bad report" in proven.detail
        routes = inc.cluster.get_site_routes().sites[inc.site("a")]
        assert (routes.weight, routes.healthy) == (100, True)
        # The nodes that passed serve again; the two others stay out and go to the repair ladder.
        assert [inc.cluster.get_node(names[m]).unschedulable for m in machines] == [True, False, False, True]
        # The ladder repairs both (the broken GPU by a reboot; the liar's GPU was never broken, and
        # its agent answers the repair's own proof honestly): each repair's result says so, and
        # the node serves again, the same machine (nothing replaced).
        for machine in (broken, liar):
            repair = inc.client.get_workflow_handle(f"repair/{names[machine]}/gpu0")
            await poll(lambda r=repair: exists(r), timeout=30)
            repaired = GpuRepairResult.model_validate(await asyncio.wait_for(repair.result(), 90))
            assert (repaired.node_name, repaired.outcome) == (names[machine], "repaired"), repaired
            assert repaired.attempts[-1].outcome == "passed" and not repaired.replacement_node, repaired
            assert await task_failures(repair) == 0
        async def all_serving() -> bool:
            return all(not inc.cluster.get_node(names[m]).unschedulable for m in machines)

        await poll(all_serving, timeout=30)
        assert sorted(m["name"] for m in inc.world.machines(inc.site("a"))) == sorted(names.values())
        assert inc.cluster.get_site_routes().sites[inc.site("a")].weight == 100, "no new trip"
        assert await task_failures(evacuation) == 0
        await replay_and_record(evacuation, "site_evacuation_proof_per_node")


async def test_a_proof_the_sdk_would_refuse_does_not_keep_the_site_at_weight_zero(
        temporal_env, tmp_path, monkeypatch) -> None:
    """Three of a site's four nodes fail (an incident: the site goes to weight 0) and recover;
    the fourth answers its proof with an external-storage reference. The gateway replaces that
    result: the evacuation ends with the site back at weight 100, the fourth node unproven (a bad
    report) and cordoned, and no failed workflow task (before: the task failed on every retry)."""
    poisoned = GarbledProof(EXTERNALLY_STORED)
    monkeypatch.setattr(workers.node_agent, "build_agent", poisoned.build_agent)
    async for inc in open_incident_stack(temporal_env.client, tmp_path):
        evacuation, liar = await inc.evacuate_with_a_liar("a", poisoned.nodes.add)
        try:
            ended = await asyncio.wait_for(evacuation.result(), 90)
        except asyncio.TimeoutError:
            ended = None
        failures = await task_failures(evacuation)
        assert failures == 0 and ended is not None, f"{failures} failed workflow tasks; ended: {ended is not None}"
        result = EvacuationResult.model_validate(ended)
        assert result.outcome == "restored"
        proven = next(s for s in result.timeline if s.name == "nodes proven")
        assert proven.detail.startswith("3 nodes passed smoke tests"), proven.detail
        assert liar in proven.detail and "bad report: undecodable" in proven.detail, proven.detail
        assert inc.cluster.get_site_routes().sites[inc.site("a")].weight == 100
        assert inc.cluster.get_node(liar).unschedulable


async def test_a_node_whose_gpu_3_fails_the_proof_has_gpu_3_fenced_and_repaired_not_gpu_0(
        temporal_env, tmp_path) -> None:
    """The incident runbook's defect: a node that failed an evacuation's proof was quarantined on GPU
    0 whatever GPU failed. GPU 0, healthy, was fenced (out of scheduling) and repaired; its repair's
    proof tested GPU 0 alone and passed, and the node served again with the GPU that failed still
    computing wrong. Now the GPU the proof named is the one fenced and repaired: its repair proves
    it, climbing the ladder until it computes right (a reboot does not fix this fault, a reinstall
    does), and GPU 0 is never fenced. A compute fault is not in the node's health snapshot: only a
    proof finds it."""
    uid = uuid.uuid4().hex[:6]
    fleet = incident_fleet(uid, a={"gpus_per_machine": 4})
    async for inc in open_incident_stack(temporal_env.client, tmp_path, fleet, uid):
        broken: dict[str, str] = {}

        def breaks_gpu_3(name: str) -> None:
            machine = next(m["id"] for m in inc.world.machines(inc.site("a")) if m["name"] == name)
            inc.world.inject_fault(machine, 3, "compute", 1, clears_on="reinstall")
            broken[name] = machine

        evacuation, name = await inc.evacuate_with_a_liar("a", breaks_gpu_3)
        result = EvacuationResult.model_validate(await asyncio.wait_for(evacuation.result(), 90))
        assert result.outcome == "restored", result
        proven = next(s for s in result.timeline if s.name == "nodes proven")
        assert f"{name}: GPU 3: compute check produced wrong results" in proven.detail, proven.detail

        repair = inc.client.get_workflow_handle(f"repair/{name}/gpu3")
        await poll(lambda: exists(repair), timeout=30)  # before: repair/<node>/gpu0
        fenced = fenced_gpus(inc.cluster.node_marks(name).annotations)
        assert "0" not in fenced, f"GPU 0 is healthy: fenced {fenced}"
        repaired = GpuRepairResult.model_validate(await asyncio.wait_for(repair.result(), 120))
        assert (repaired.gpu, repaired.outcome) == (3, "repaired"), repaired
        assert [a.outcome for a in repaired.attempts][-1] == "passed" and len(repaired.attempts) > 1, repaired
        assert inc.world.compute_ok(broken[name], 3), "the GPU that failed computes right before the node serves"
        assert not await exists(inc.client.get_workflow_handle(f"repair/{name}/gpu0"))

        async def serving() -> bool:
            return not inc.cluster.get_node(name).unschedulable

        await poll(serving, timeout=30)
        assert await task_failures(evacuation) == 0
        await replay_and_record(evacuation, "site_evacuation_quarantines_the_failing_gpu")
        await replay_and_record(inc.client.get_workflow_handle(f"node/{name}"), "node_entity_quarantined_on_the_failing_gpu")


@pytest.mark.parametrize("failures, gpus, named", [
    (["GPU 3: compute check produced wrong results"], 4, [3]),
    (["GPU 1: XID 79", "GPU 1: 2 uncorrected ECC errors", "GPU 2: 1 NVLink links down"], 4, [1, 2]),
    # Every repair's proof checks how many GPUs are visible: it names none, and asks for no more.
    (["3 of 4 GPUs visible", "GPU 2: GPU is lost"], 4, [2]),
    (["3 of 4 GPUs visible"], 4, None),
    # A compute check that cannot run names no GPU: it says what was not checked, it asks for no GPU.
    (["GPU 2: XID 79", "the compute check cannot run on a-1: libcuda not loadable (not run)"], 4, [2]),
    (["the compute check cannot run on a-1: libcuda not loadable (not run)"], 4, None),
    # A node-wide failure, or a GPU past the site's count (a lie): the whole node's GPU 0 as well.
    (["GPU 3: x", "libcuda not loadable: no such file"], 4, [0, 3]),
    (["GPU 3: x", "GPU 9: x"], 4, [0, 3]),
    (["GPU 9: x", "GPU 63: x", "GPU 999: x"], 4, None),
    (["no GPU named", "GPU x: y", " GPU 1: leading space"], 4, None),
    ([f"GPU {i}: x" for i in range(100)], 8, list(range(8))),
])
def test_the_gpus_a_failed_proof_names_are_the_nodes_own_and_bounded(failures, gpus, named) -> None:
    """What a node's report names decides only about its own GPUs, below the site's count per
    machine; a report naming none keeps the whole-node quarantine (None)."""
    assert failing_gpus(failures, gpus) == named


async def test_a_quarantine_acts_only_on_gpus_the_node_has_by_the_clusters_count(temporal_env, tmp_path) -> None:
    """The Node entity takes the GPUs a quarantine names as far as its node has them by the cluster's
    count: on a 2-GPU node, GPU 1 named is GPU 1 fenced and repaired (not GPU 0); GPU 5 named (a report
    within the message's bound, not the node's) is none of its own, so the whole node's GPU 0."""
    async for stack in running_stack(temporal_env.client, tmp_path):
        node = (await join_node(stack)).node_name
        entity = stack.client.get_workflow_handle(f"node/{node}")
        await entity.signal(flows.Node.quarantine, {"reason": "failed a proof: GPU 1: compute", "gpus": [1]})
        one = repair_handle(stack, node, 1)
        await eventually(lambda: exists(one), timeout=30)
        assert "0" not in fenced_gpus(stack.cluster.node_marks(node).annotations)
        assert GpuRepairResult.model_validate(await asyncio.wait_for(one.result(), 90)).outcome == "repaired"
        assert not await exists(repair_handle(stack, node, 0))

        await entity.signal(flows.Node.quarantine, {"reason": "failed a proof: GPU 5: compute", "gpus": [5]})
        zero = repair_handle(stack, node, 0)
        await eventually(lambda: exists(zero), timeout=30)
        assert GpuRepairResult.model_validate(await asyncio.wait_for(zero.result(), 90)).outcome == "repaired"
        assert await task_failures(entity) == 0


class AgentsThatCannotCheck:
    """The node agents of the simulated machines in ``machines`` cannot run their compute check (their
    image lacks libcuda): their smoke test raises ``ComputeCheckUnavailable``, no verdict on any GPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.machines: set[str] = set()
        checked = SimGpuBackend.compute_check

        def compute_check(backend: SimGpuBackend, index: int) -> str | None:
            if backend.machine_id in self.machines:
                raise ComputeCheckUnavailable("libcuda not loadable in the node agent: libcuda.so.1: cannot open "
                                              "shared object file: No such file or directory")
            return checked(backend, index)

        monkeypatch.setattr(SimGpuBackend, "compute_check", compute_check)


async def signals_to(handle, name: str) -> list[str]:
    history = await handle.fetch_history()
    return [e.workflow_execution_signaled_event_attributes.signal_name for e in history.events
            if e.HasField("workflow_execution_signaled_event_attributes")
            and e.workflow_execution_signaled_event_attributes.signal_name == name]


async def test_a_node_whose_agent_cannot_run_its_check_stays_cordoned_for_a_person_and_is_not_rebooted(
        temporal_env, tmp_path, monkeypatch) -> None:
    """The proof meets a node whose agent cannot run its compute check (``ComputeCheckUnavailable``):
    nothing proved it, nothing said a GPU of it is broken. It stays cordoned and unproven, its reason
    naming the agent's problem and the way back, and the site comes back with the three others.
    Its Node entity is told and holds it for a person (needs-person: the alert), no repair; the
    person's `return_gpu` of GPU 0, once the agent is fixed, uncordons it. Before: first it was
    quarantined like a node whose GPU failed (a GpuRepair at the reboot rung, the machine restarted
    for the agent's problem); then it was sent nothing, and nothing alerted anyone once the
    incident cleared."""
    agents = AgentsThatCannotCheck(monkeypatch)
    async for inc in open_incident_stack(temporal_env.client, tmp_path):
        machine: dict[str, str] = {}

        def cannot_check(name: str) -> None:
            machine[name] = next(m["id"] for m in inc.world.machines(inc.site("a")) if m["name"] == name)
            agents.machines.add(machine[name])

        evacuation, name = await inc.evacuate_with_a_liar("a", cannot_check)
        result = EvacuationResult.model_validate(await asyncio.wait_for(evacuation.result(), 90))
        assert result.outcome == "restored", result
        proven = next(s for s in result.timeline if s.name == "nodes proven")
        assert proven.detail.startswith("3 nodes passed smoke tests"), proven.detail
        assert f"{name}: smoke test did not run (ComputeCheckUnavailable): the node agent cannot run its compute " \
               "check" in proven.detail and "libcuda not loadable in the node agent" in proven.detail, proven.detail
        # Why it stays cordoned, as the evacuation leaves it (others may stay for a repair's fence:
        # their faults, cleared by the provider, were found while the incident held their repairs).
        held = (await evacuation.query("progress", result_type=EvacuationProgress)).held
        assert "the node agent cannot run its compute check" in held[name], held
        assert "libcuda not loadable in the node agent" in held[name], held
        assert "not handed to the repair ladder" in held[name] and f"gpufleet repair return {name} 0" in held[name], held
        assert "GpufleetNodeNeedsPerson" in held[name], held
        assert not [node for node, why in held.items() if node != name and "node agent" in why], held
        shown = next(s for s in result.timeline if s.name == "nodes held")
        assert f"{name}: unproven: the node agent cannot run its compute check" in shown.detail, shown.detail
        routes = inc.cluster.get_site_routes().sites[inc.site("a")]
        assert (routes.weight, routes.healthy) == (100, True)
        assert inc.cluster.get_node(name).unschedulable, "nothing proved it: it stays cordoned"

        # Not handed to the repair ladder, but told: its Node entity holds it for a person (FleetState
        # needs-person: the GpufleetNodeNeedsPerson alert), the agent's words its reason, and starts
        # no repair; no reboot. Before, it was sent nothing: no alert once the incident's cleared.
        entity = inc.client.get_workflow_handle(f"node/{name}")
        assert await signals_to(entity, "quarantine") == ["quarantine"]

        async def held_for_a_person() -> NodeStatus | None:
            status = await entity.query("status", result_type=NodeStatus)
            return status if status.state == "needs-person" else None

        status = await poll(held_for_a_person, timeout=30)
        assert "libcuda not loadable in the node agent" in status.needs_person["0"], status.needs_person
        assert f"gpufleet repair return {name} 0" in status.needs_person["0"], status.needs_person
        assert not status.active_repairs, status
        assert "0" in fenced_gpus(inc.cluster.node_marks(name).annotations), "fenced: no other repair's end uncordons it"
        assert not await exists(inc.client.get_workflow_handle(f"repair/{name}/gpu0"))
        assert (inc.world.machine(machine[name])["reboots"], inc.world.machine(machine[name])["reinstalls"]) == (0, 0)
        assert inc.cluster.get_node(name).unschedulable, "held for a person: still cordoned"
        assert await task_failures(evacuation) == 0
        assert await task_failures(entity) == 0
        await replay_and_record(evacuation, "site_evacuation_tells_the_node_it_waits_for_a_person")

        # The way back the reason names: nothing of the evacuation's is left to put back (its Site
        # entity's put-back of closed evacuations leaves this cordon); once the agent is fixed, the
        # person's `gpufleet repair return <node> 0` uncordons it, and nothing cordons it again.
        left = await evacuation.query("leftovers", result_type=EvacuationLeftovers)
        assert left.put_back and name not in left.cordoned, left
        agents.machines.clear()
        decision = await entity.execute_update(flows.Node.return_gpu, {"gpu": 0, "reason": "node agent image fixed"},
                                               result_type=GpuDecision)
        assert (decision.outcome, decision.uncordoned, decision.state) == ("returned", True, "ready"), decision
        assert not inc.cluster.get_node(name).unschedulable
        assert not await exists(inc.client.get_workflow_handle(f"repair/{name}/gpu0"))
        assert await task_failures(entity) == 0
        await replay_and_record(entity, "node_entity_holds_for_a_person_where_the_check_cannot_run")


async def test_a_site_whose_every_agent_cannot_run_its_check_waits_saying_so_and_comes_back_once_fixed(
        temporal_env, tmp_path, monkeypatch) -> None:
    """One agent image for the whole site, broken: every node's proof cannot run. The site is not
    restored with each node cordoned for a person to lift by hand, nor is its wait read as the
    provider still down: the timeline says the node agent cannot run its check, and no node goes to
    the repair ladder. The agent fixed, the next proof passes and the site comes back by itself."""
    agents = AgentsThatCannotCheck(monkeypatch)
    async for inc in open_incident_stack(temporal_env.client, tmp_path):
        def every_agent_broken(_liar: str) -> None:
            agents.machines.update(m["id"] for m in inc.world.machines(inc.site("a")))

        evacuation, _ = await inc.evacuate_with_a_liar("a", every_agent_broken)

        async def says_the_agent_cannot_check():
            progress = await inc.progress("a")
            return next((s for s in progress.timeline if s.name == "compute check cannot run"), None) \
                if progress else None

        said = await poll(says_the_agent_cannot_check, timeout=60)
        assert said.detail.startswith("the node agent cannot run its compute check on 4 of 4 nodes"), said.detail
        assert "fix the node agent" in said.detail, said.detail
        names = [m["name"] for m in inc.world.machines(inc.site("a"))]
        for name in names:
            assert await signals_to(inc.client.get_workflow_handle(f"node/{name}"), "quarantine") == []

        agents.machines.clear()  # the agent's image fixed
        result = EvacuationResult.model_validate(await asyncio.wait_for(evacuation.result(), 90))
        assert result.outcome == "restored", result
        proven = next(s for s in result.timeline if s.name == "nodes proven")
        assert proven.detail.startswith("4 nodes passed smoke tests"), proven.detail
        assert inc.cluster.get_site_routes().sites[inc.site("a")].weight == 100
        assert await task_failures(evacuation) == 0


async def test_a_quarantine_naming_gpus_or_a_hold_is_taken_behind_the_nodes_own_patch(temporal_env, tmp_path) -> None:
    """A quarantine that names GPUs, and one that holds the node for a person, are taken behind the
    Node's own patch (``node-quarantine-takes-gpus-and-holds``), asked in the signal's handler: a
    worker of the release before dropped both (its model knew neither field), and a run it handled
    replays on today's code (``node_entity_quarantine_takes_gpus_and_holds_before``) where, without
    the patch, today's code would fence and repair (and hold) what that history never did."""
    async for stack in running_stack(temporal_env.client, tmp_path):
        node = (await join_node(stack)).node_name
        entity = stack.client.get_workflow_handle(f"node/{node}")
        await entity.signal(flows.Node.quarantine, {"reason": "failed a proof: GPU 1: compute", "gpus": [1]})
        await entity.signal(flows.Node.quarantine, {"reason": "the node agent cannot run its compute check",
                                                    "hold_for_person": True})
        one = repair_handle(stack, node, 1)
        await eventually(lambda: exists(one), timeout=30)

        async def held() -> NodeStatus | None:
            status = await entity.query("status", result_type=NodeStatus)
            return status if "0" in status.needs_person else None

        status = await eventually(held, timeout=30)
        assert "the node agent cannot run its compute check" in status.needs_person["0"], status
        assert not await exists(repair_handle(stack, node, 0))
        assert await task_failures(entity) == 0
        await replay_and_record(entity, "node_entity_quarantine_takes_gpus_and_holds")
