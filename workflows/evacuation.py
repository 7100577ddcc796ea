"""SiteEvacuation (id ``evacuate/<site>/<n>``): a provider incident's runbook.

Started by the Site entity when its incident rule trips (fleet.incident), or by
hand. Each step is stamped on a timeline (current details and the ``progress``
query):

1. **weight 0**: the site's routing weight goes to 0 for new sessions (each
   model's HTTPRoute/ConfigMap entry and the fleet-wide site document), marked
   unhealthy, draining, with the incident id;
2. **capacity**: the serving deficit (replicas per model at the site) is placed
   on other sites that already run the model's Deployment, honouring compliance
   geography; what does not fit is bought through AcquireCapacity restricted to
   those sites. Nothing compliant → ``needs-person``, waiting (``retry`` signal
   or the probe interval) — never outside the geography;
3. **replicas elsewhere**: those Deployments scale up and must be ready;
4. **drain**: only then are the site's nodes cordoned and drained (PDBs, deadline)
   and its Deployments scaled to 0;
5. **wait for recovery**: a periodic probe (provider API answers, every node's
   agent back) or the operator update ``declare_recovered``; ``abort`` (update)
   stops the evacuation where it is, at any step;
6. **restore**: every node passes a smoke test (else back to 5), the site's
   Deployments come back, the weight climbs in steps (10 → 50 → 100 % with a bake
   time between), the extra replicas elsewhere go, and the nodes bought for the
   evacuation are retired while their site is above its min.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ChildWorkflowError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities.models import ResolveSiteInput, SmokeResult, SmokeTestInput
    from fleet.config import Site
    from fleet import search_attributes as sa
    from fleet.incident import Deficit, IncidentSettings, Plan, allowed_targets, nodes_needed, plan_moves
    from fleet.settings import node_queue
    from fleet.messages.capacity import CapacityResult, DrainNodeInput, RetireMachineInput, SiteNodesInput, SiteNode
    from fleet.messages.evacuation import (
        EvacuationFacts,
        EvacuationProgress,
        EvacuationResult,
        FreeGpusInput,
        RecoveryProbe,
        ScaleInput,
        SiteEvacuationInput,
        SiteRef,
        SiteWeightInput,
        SiteWeightResult,
        Step,
        UncordonInput,
    )
    from workflows.inputs import parse_input
    from workflows.node_join import CLUSTER_RETRY, PROVIDER_RETRY, QUICK, failure_message, failure_type
    from activities.rollout_models import WaitServingInput
    from fleet.cluster import DrainResult, ServingStatus


def evacuation_workflow_id(site: str, n: int) -> str:
    return f"evacuate/{site}/{n}"


class Aborted(Exception):
    pass


@workflow.defn(name="SiteEvacuation")
class SiteEvacuation:
    def __init__(self) -> None:
        self._progress: EvacuationProgress | None = None
        self._recovered = ""
        self._abort = ""
        self._retry = 0
        self._acquired: list = []

    # -- operator surface -----------------------------------------------------------------
    @workflow.update
    def declare_recovered(self, note: str = "") -> EvacuationProgress:
        """The operator says the provider is back: restore now (nodes must still pass smoke tests)."""
        self._recovered = note or "declared recovered by an operator"
        return self._progress

    @declare_recovered.validator
    def _validate_recovered(self, note: str = "") -> None:
        if self._progress is None or self._progress.state in ("restored", "aborted"):
            raise ValueError("the evacuation is not running")

    @workflow.update
    def abort(self, reason: str = "") -> EvacuationProgress:
        """Stop where it is: nothing more is changed (routing stays as it is now)."""
        self._abort = reason or "aborted by an operator"
        return self._progress

    @abort.validator
    def _validate_abort(self, reason: str = "") -> None:
        if self._progress is None or self._progress.state in ("restored", "aborted"):
            raise ValueError("the evacuation is not running")

    @workflow.signal
    def retry(self) -> None:
        """Look again now (after a person added capacity or a compliant site)."""
        self._retry += 1

    @workflow.query
    def progress(self) -> EvacuationProgress:
        return self._progress

    def _state(self, state: str) -> None:
        if state != self._progress.state:
            self._progress.state = state
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(state)])

    def _mark(self, name: str, detail: str = "") -> None:
        self._progress.timeline.append(Step(name=name, at=workflow.now(), detail=detail))
        self._show(name)

    def _show(self, step: str, detail: str = "") -> None:
        p = self._progress
        p.step = step
        start = p.timeline[0].at if p.timeline else workflow.now()
        lines = [f"**{step}**" + (f": {detail}" if detail else "") + f" — evacuating {p.site}"]
        if p.needs_person:
            lines.append(f"**needs a person**: {p.needs_person}")
        lines += [
            f"- {s.at.isoformat(timespec='seconds')} (+{(s.at - start).total_seconds():.1f}s) {s.name}"
            + (f": {s.detail}" if s.detail else "")
            for s in p.timeline
        ]
        workflow.set_current_details("\n".join(lines))

    def _check(self) -> None:
        if self._abort:
            raise Aborted(self._abort)

    async def _wait(self, seconds: float, until, summary: str) -> bool:
        """Wait ``seconds`` or until ``until()`` / an abort; True when ``until()`` came true."""
        try:
            await workflow.wait_condition(lambda: bool(until() or self._abort), timeout=timedelta(seconds=seconds),
                                          timeout_summary=summary)
        except asyncio.TimeoutError:
            pass
        self._check()
        return bool(until())

    # -- the runbook ----------------------------------------------------------------------
    @workflow.run
    async def run(self, raw: dict[str, Any]) -> EvacuationResult:
        args = parse_input(SiteEvacuationInput, raw)
        self._args = args
        site = args.site
        self._progress = EvacuationProgress(site=site)
        workflow.upsert_search_attributes([sa.SITE.value_set(site), sa.FLEET_STATE.value_set("evacuating")])
        self._mark("detected", args.reason)
        try:
            await self._evacuate()
            outcome = "restored"
            self._state("restored")
            self._mark("restored")
        except Aborted as stop:
            outcome = "aborted"
            self._state("aborted")
            self._mark("aborted", str(stop))
        return EvacuationResult(site=site, outcome=outcome, timeline=self._progress.timeline)

    async def _evacuate(self) -> None:
        args, p = self._args, self._progress
        site = args.site
        facts: EvacuationFacts = await workflow.execute_activity(
            "evacuation_facts", SiteRef(site=site), result_type=EvacuationFacts, start_to_close_timeout=QUICK,
            retry_policy=PROVIDER_RETRY, summary=f"serving, routing and nodes at {site}",
        )
        self._facts = facts
        s: IncidentSettings = args.settings or facts.settings
        self._s = s
        incident = workflow.info().workflow_id

        # 1. routing weight 0 for new sessions.
        self._original_models = {}
        for serving in facts.here:
            table = facts.model_routes.get(serving.model)
            route = table.sites.get(site) if table else None
            self._original_models[serving.model] = route.weight if route and not route.incident and route.weight else 100
        route = facts.site_routes.sites.get(site) if facts.site_routes else None
        self._original_site = route.weight if route and not route.incident and route.weight else 100
        self._all_sites = [x.name for x in facts.sites]
        await self._weight(0, healthy=False, draining=True, incident=incident)
        self._mark("weight 0", f"{len(self._original_models)} models")
        self._check()

        # 2. the deficit, and capacity for it elsewhere.
        moves = await self._place()
        # 3. replicas elsewhere, ready.
        self._elsewhere_before: dict[tuple[str, str], int] = {
            (x.model, x.site): x.desired_replicas for x in facts.elsewhere
        }
        await self._scale_elsewhere(moves)
        # 4. drain the site.
        await self._drain()
        # 5. wait for recovery, 6. restore (smoke tests first; a failure goes back to waiting).
        failed_proofs = 0
        while True:
            await self._wait_recovery()
            if await self._prove():
                break
            # Not yet: back off before the next proof (an operator's declare_recovered skips the wait).
            failed_proofs += 1
            backoff = min(self._s.probe_seconds * 2 ** failed_proofs, 600)
            await self._wait(backoff, lambda: bool(self._recovered), "back off before the next proof")
        await self._restore()

    async def _weight(self, percent: int, healthy: bool, draining: bool, incident: str) -> SiteWeightResult:
        result: SiteWeightResult = await workflow.execute_activity(
            "set_site_weight",
            SiteWeightInput(site=self._args.site, percent=percent, healthy=healthy, draining=draining,
                            incident=incident, original_models=self._original_models,
                            original_site=self._original_site, all_sites=self._all_sites),
            result_type=SiteWeightResult, start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary=f"routing weight of {self._args.site} → {percent}%",
        )
        self._progress.weights = result.weights
        return result

    def _deficits(self) -> list[Deficit]:
        facts, site = self._facts, self._args.site
        # Never onto a site that is itself under an incident (or otherwise out of routing).
        out_of_routing = {name for name, r in (facts.site_routes.sites if facts.site_routes else {}).items()
                          if r.incident or r.draining or not r.healthy}
        allowed = {t.name for t in allowed_targets(facts.site, facts.sites)} - out_of_routing
        out = []
        for here in facts.here:
            if here.desired_replicas <= 0:
                continue
            targets = sorted(x.site for x in facts.elsewhere if x.model == here.model and x.site in allowed
                             and x.site != site)
            out.append(Deficit(model=here.model, replicas=here.desired_replicas,
                               gpus_per_replica=here.gpus_per_replica, targets=targets))
        return out

    async def _free(self, deficits: list[Deficit]) -> dict[str, int]:
        sites = sorted({t for d in deficits for t in d.targets})
        if not sites:
            return {}
        return await workflow.execute_activity(
            "free_gpus", FreeGpusInput(sites=sites), result_type=dict[str, int], start_to_close_timeout=QUICK,
            retry_policy=CLUSTER_RETRY, summary="free GPUs at the target sites",
        )

    async def _place(self) -> dict[str, dict[str, int]]:
        p, s, site = self._progress, self._s, self._args.site
        prices = {x.name: x.price_per_gpu_hour for x in self._facts.sites}
        bought = 0
        while True:
            deficits = self._deficits()
            free = await self._free(deficits)
            prefer = sorted(free, key=lambda name: (prices.get(name, 0), name))
            plan: Plan = plan_moves(deficits, free, prefer)
            if plan.impossible:
                geo = self._facts.site.geography
                p.needs_person = "; ".join(
                    f"{m}: {why}" + (f" inside geography {geo!r}" if self._facts.site.compliance else "")
                    for m, why in sorted(plan.impossible.items())
                )
                self._state("needs-person")
                self._show("waiting: nothing may take the replicas")
                seen = self._retry
                await self._wait(s.probe_seconds, lambda: self._retry != seen, "look again for a compliant site")
                self._facts = await workflow.execute_activity(
                    "evacuation_facts", SiteRef(site=site), result_type=EvacuationFacts,
                    start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY, summary="serving again",
                )
                continue
            if p.needs_person:
                p.needs_person = ""
                self._state("evacuating")
            missing = plan.missing_gpus(deficits)
            if missing and bought == 0:
                bought += 1
                await self._acquire(deficits, plan, missing)
                continue
            if missing:
                p.needs_person = f"{sum(plan.missing.values())} replicas have no room elsewhere (capacity short)"
                self._show("capacity short; moving what fits")
            p.moves = plan.moves
            return plan.moves

    async def _acquire(self, deficits: list[Deficit], plan: Plan, missing_gpus: int) -> None:
        p, s, site = self._progress, self._s, self._args.site
        targets = sorted({t for d in deficits if d.model in plan.missing for t in d.targets})
        per_machine = min((x.gpus_per_machine for x in self._facts.sites if x.name in targets), default=1)
        count = nodes_needed(missing_gpus, per_machine)
        base = dict(self._args.capacity_request)
        request = {
            **base, "count": count, "reason": f"evacuate {site}",
            "deadline_seconds": base.get("deadline_seconds", s.capacity_deadline_seconds),
            "constraints": {**base.get("constraints", {}), "sites": targets},
        }
        child_id = f"capacity/{workflow.info().workflow_id.replace('/', '-')}"
        p.capacity_request = child_id
        self._mark("capacity requested", f"{count} nodes ({missing_gpus} GPUs) at {', '.join(targets)}")
        try:
            result: CapacityResult = await workflow.execute_child_workflow(
                "AcquireCapacity", request, id=child_id, result_type=CapacityResult,
                parent_close_policy=ParentClosePolicy.TERMINATE,
                static_summary=f"replacement capacity for {site}'s replicas",
            )
            self._acquired = result.nodes
            p.acquired = [n.node_name for n in result.nodes]
            self._mark("capacity joined", f"{len(result.nodes)} of {count} nodes")
        except ChildWorkflowError as error:
            self._acquired = []
            self._mark("capacity failed", f"{failure_type(error)}: {failure_message(error)}")
        self._check()

    async def _scale_elsewhere(self, moves: dict[str, dict[str, int]]) -> None:
        deadline = workflow.now() + timedelta(seconds=self._s.ready_seconds)
        waits = []
        for model, where in sorted(moves.items()):
            for target, extra in sorted(where.items()):
                replicas = self._elsewhere_before.get((model, target), 0) + extra
                await self._scale(model, target, replicas)
                waits.append((model, target))
        self._check()
        for model, target in waits:
            try:
                await workflow.execute_activity(
                    "wait_serving_ready", WaitServingInput(model=model, site=target, deadline=deadline,
                                                           poll_seconds=1.0),
                    result_type=ServingStatus, start_to_close_timeout=timedelta(seconds=self._s.ready_seconds + 60),
                    heartbeat_timeout=timedelta(seconds=30), retry_policy=CLUSTER_RETRY,
                    summary=f"wait for {model} at {target}",
                )
            except ActivityError as error:
                self._progress.needs_person = f"{model} at {target} not ready: {failure_message(error)}"
                self._show("replicas elsewhere not all ready; draining anyway")
            self._check()
        self._mark("replicas ready elsewhere", ", ".join(f"{m}@{t}" for m, t in waits) or "nothing to move")

    async def _scale(self, model: str, site: str, replicas: int) -> None:
        await workflow.execute_activity(
            "scale_serving", ScaleInput(model=model, site=site, replicas=replicas), result_type=ServingStatus,
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary=f"{model} at {site} → {replicas}",
        )

    async def _drain(self) -> None:
        p, s, site = self._progress, self._s, self._args.site
        blocked = []

        async def drain(name: str) -> None:
            result: DrainResult = await workflow.execute_activity(
                "drain_within", DrainNodeInput(node_name=name, deadline_seconds=s.drain_seconds),
                result_type=DrainResult, start_to_close_timeout=timedelta(seconds=s.drain_seconds + 60),
                heartbeat_timeout=timedelta(seconds=30), retry_policy=CLUSTER_RETRY,
                summary=f"cordon and drain {name} (PDBs honoured)",
            )
            p.drained.append(name)
            blocked.extend(f"{b.key}: {b.reason}" for b in result.blocked)

        await asyncio.gather(*(drain(n.name) for n in self._facts.nodes))
        self._check()
        for here in self._facts.here:
            await self._scale(here.model, site, 0)
        self._mark("drained", f"{len(p.drained)} nodes" + (f"; blocked: {'; '.join(blocked)}" if blocked else ""))

    async def _wait_recovery(self) -> None:
        s, site = self._s, self._args.site
        self._state("waiting-for-recovery")
        self._show("waiting for recovery")
        while not self._recovered:
            probe: RecoveryProbe = await workflow.execute_activity(
                "recovery_probe", SiteRef(site=site), result_type=RecoveryProbe, start_to_close_timeout=QUICK,
                retry_policy=CLUSTER_RETRY, summary=f"is {site} back?",
            )
            if probe.recovered:
                self._recovered = probe.detail
                break
            self._show("waiting for recovery", probe.detail)
            await self._wait(s.probe_seconds, lambda: bool(self._recovered), "next recovery probe")
        self._check()
        self._mark("recovered", self._recovered)

    async def _prove(self) -> bool:
        """Every node at the site passes a smoke test; a failure sends us back to waiting."""
        s, site = self._s, self._args.site
        self._state("restoring")
        nodes = await workflow.execute_activity(
            "site_nodes", SiteNodesInput(site=site), result_type=list[SiteNode], start_to_close_timeout=QUICK,
            retry_policy=CLUSTER_RETRY, summary=f"nodes at {site}",
        )
        gpus = self._facts.site.gpus_per_machine
        failures = []

        async def smoke(name: str) -> None:
            try:
                result: SmokeResult = await workflow.execute_activity(
                    "smoke_test", SmokeTestInput(expected_gpus=gpus), result_type=SmokeResult,
                    task_queue=node_queue(name), schedule_to_close_timeout=timedelta(seconds=s.smoke_test_seconds),
                    start_to_close_timeout=timedelta(seconds=min(s.smoke_test_seconds, 300)),
                    retry_policy=RetryPolicy(maximum_attempts=2), summary=f"smoke test {name}",
                )
                if not result.passed:
                    failures.append(f"{name}: {'; '.join(result.failures)}")
            except ActivityError as error:
                failures.append(f"{name}: smoke test did not run ({failure_type(error)})")

        await asyncio.gather(*(smoke(n.node_name) for n in nodes))
        self._check()
        if failures or not nodes:
            self._recovered = ""
            self._state("waiting-for-recovery")
            self._mark("smoke tests failed", "; ".join(failures) or "no nodes")
            return False
        self._mark("nodes proven", f"{len(nodes)} nodes passed smoke tests")
        return True

    async def _restore(self) -> None:
        p, s, site = self._progress, self._s, self._args.site
        await workflow.execute_activity(
            "uncordon_nodes", UncordonInput(nodes=p.drained), result_type=list[str], start_to_close_timeout=QUICK,
            retry_policy=CLUSTER_RETRY, summary=f"uncordon {len(p.drained)} nodes at {site}",
        )
        deadline = workflow.now() + timedelta(seconds=s.ready_seconds)
        for here in self._facts.here:
            await self._scale(here.model, site, here.desired_replicas)
        for here in self._facts.here:
            if here.desired_replicas <= 0:
                continue
            try:
                await workflow.execute_activity(
                    "wait_serving_ready", WaitServingInput(model=here.model, site=site, deadline=deadline,
                                                           poll_seconds=1.0),
                    result_type=ServingStatus, start_to_close_timeout=timedelta(seconds=s.ready_seconds + 60),
                    heartbeat_timeout=timedelta(seconds=30), retry_policy=CLUSTER_RETRY,
                    summary=f"wait for {here.model} back at {site}",
                )
            except ActivityError as error:
                p.needs_person = f"{here.model} at {site} not ready again: {failure_message(error)}"
            self._check()
        self._mark("replicas back", f"{len(self._facts.here)} models at {site}")
        steps = sorted({min(max(x, 1), 100) for x in s.restore_steps} | {100})
        for i, percent in enumerate(steps):
            last = i == len(steps) - 1
            await self._weight(percent, healthy=True, draining=not last,
                               incident="" if last else workflow.info().workflow_id)
            self._mark(f"weight {percent}%")
            if not last and s.bake_seconds:
                await self._wait(s.bake_seconds, lambda: False, f"bake at {percent}%")
        # Surplus elsewhere back toward each site's min.
        for model, where in sorted(p.moves.items()):
            for target in sorted(where):
                await self._scale(model, target, self._elsewhere_before.get((model, target), 0))
        retired = await self._retire_acquired()
        self._mark("surplus drained", f"{retired} nodes retired")

    async def _retire_acquired(self) -> int:
        s = self._s
        retired = 0
        for node in self._acquired:
            nodes = await workflow.execute_activity(
                "site_nodes", SiteNodesInput(site=node.site), result_type=list[SiteNode],
                start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary=f"nodes at {node.site}",
            )
            if len(nodes) <= await self._min_nodes(node.site):
                continue
            drained: DrainResult = await workflow.execute_activity(
                "drain_within", DrainNodeInput(node_name=node.node_name, deadline_seconds=s.drain_seconds),
                result_type=DrainResult, start_to_close_timeout=timedelta(seconds=s.drain_seconds + 60),
                heartbeat_timeout=timedelta(seconds=30), retry_policy=CLUSTER_RETRY,
                summary=f"drain {node.node_name} (bought for the evacuation)",
            )
            if not drained.completed:
                continue
            try:
                await workflow.execute_activity(
                    "retire_machine", RetireMachineInput(site=node.site, node_name=node.node_name,
                                                         machine_id=node.machine_id),
                    start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY,
                    summary=f"retire {node.node_name}",
                )
                retired += 1
            except ActivityError as error:
                self._progress.needs_person = f"retire {node.node_name}: {failure_message(error)}"
        return retired

    async def _min_nodes(self, site: str) -> int:
        resolved: Site = await workflow.execute_activity(
            "resolve_site", ResolveSiteInput(site=site), result_type=Site, start_to_close_timeout=QUICK,
            retry_policy=PROVIDER_RETRY, summary=f"min of {site}",
        )
        return resolved.min_nodes

