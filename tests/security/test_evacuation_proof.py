"""Issue 35, item 5: an evacuation's proof is per node. One node that fails its smoke test (a
GPU still broken) or garbles it (a hostile agent) cannot hold its site at weight 0: the site
comes back with the nodes that pass, the others stay cordoned and go to the repair ladder,
which repairs them (and they serve again)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue
from temporalio.worker import Worker

import workers.node_agent
from fleet.messages.nodes import SmokeTestInput
from activities.node_agent import NodeAgentActivities
from fleet.messages.evacuation import EvacuationResult
from fleet.messages.repair import GpuRepairResult
from fleet.naming import node_queue
from tests.bad_input_helpers import task_failures
from tests.evacuation_helpers import open_incident_stack, poll
from tests.repair_helpers import exists
from tests.replay import replay_and_record


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
