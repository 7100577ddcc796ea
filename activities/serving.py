"""Serving activities for ModelRollout: the site's Deployment through the cluster
port (``env.cluster``), the health-gate probe, and whether a site is under
evacuation. Each is thin and idempotent under retries.

Evacuation is read through the cluster port, from the fleet-wide site document that
SiteEvacuation writes and from the model's routing table: a site whose route is
``draining`` or carries an ``incident`` is under evacuation. ``_evacuations`` (the look
of ``site_evacuations`` and ``wait_site_evacuations``) is the one place to change when the
Site entity takes this over.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from temporalio import activity
from temporalio.client import WorkflowQueryFailedError, WorkflowQueryRejectedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from activities.capacity import heartbeating
from activities.claims import take_claim
from activities.env import FleetEnv
from activities.errors import typed_errors
from activities.waiting import poll_until
from activities.watches import RECHECK_SECONDS, RareHeartbeat, stop_if_asked
from activities.weights import missing_from_source
from fleet.messages.rollout import (
    EvacuationInput,
    EvacuationWaitInput,
    ProbeServingInput,
    ResolveRolloutSitesInput,
    RollbackSiteInput,
    RolloutSites,
    ServingRef,
    UpdateServingInput,
    WaitServingInput,
)
from fleet.rollout import ProbeResult, RolloutProgress, WeightsManifest, another_rollout_running, check_routed_sites
from fleet.cluster import ServingSpec, ServingStatus
from fleet.contracts import workflows as flows
from fleet.naming import dns_label, kubernetes_name_clash, model_service_clash, serving_name_clash
from providers.cluster.base import free_gpus_at
from providers.object_store import make_s3_client


#: Which ModelRollout acts on a model: state ``rollout-claim``/<the model's Kubernetes name> names it.
ROLLOUT_CLAIM_KIND = "rollout-claim"
#: How long the look for a rollout's weights in its source store may take (the activity answers
#: within ``QUICK``, a minute): a store slower than that to list is not looked at.
SOURCE_LOOK_SECONDS = 20
#: A rollout's phases before it changes anything, and once it ended (a closed run the list still shows).
NOT_ACTING = {"starting", "validating", "failed", "completed", "completed-with-failures", "aborted", "cancelled"}


class ServingActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env
        self._probe = None

    def all(self) -> list:
        return [
            self.resolve_rollout_sites, self.serving_snapshot, self.update_serving, self.wait_serving_ready,
            self.probe_serving, self.rollback_site, self.site_evacuations, self.wait_site_evacuations,
        ]

    @property
    def prober(self):
        if self._probe is None:
            if self.env.world is not None:
                from sim.probe import SimProbe

                self._probe = SimProbe(self.env.world, self.env.cluster)
            else:
                from providers.serving_probe import HttpProbe

                self._probe = HttpProbe()
        return self._probe

    @activity.defn
    @typed_errors
    async def resolve_rollout_sites(self, input: ResolveRolloutSitesInput) -> RolloutSites:
        sites = {s.name: s for s in self.env.config.sites}
        asked = [name for name in input.sites if name in sites]
        problems = []
        if input.model:
            running = await self._rollout_running(input.model)
            served: dict[str, list[str]] = {}
            for status in await asyncio.to_thread(self.env.cluster.list_serving):
                served.setdefault(status.model, []).append(status.site)
            problems = ([running] if running else []) + (
                self._name_clashes(input.model, served) + self._serving_name_clashes(input, served)
                + check_routed_sites(input.model, input.sites, served.get(input.model, [])))
        if input.weights is not None:
            try:
                async with asyncio.timeout(SOURCE_LOOK_SECONDS):
                    problems += await asyncio.to_thread(self._missing_weights, input.weights)
            except TimeoutError:  # a store slow to list: the copies find out, as before the look
                activity.logger.warning("weights source %s: no answer to its listing within %s s: its files "
                                        "not looked for before the copies", input.weights.source.store,
                                        SOURCE_LOOK_SECONDS)
        return RolloutSites(
            known=sorted(sites), stores={name: sites[name].object_store for name in asked},
            object_stores=sorted(self.env.config.object_stores),
            gpus_per_machine={name: sites[name].gpus_per_machine for name in asked},
            problems=problems,
        )

    def _missing_weights(self, weights: WeightsManifest) -> list[str]:
        """The manifest's files its source store does not hold as it says (``missing_from_source``):
        refused before any copy. Nothing for a source the config does not name (``check_source``
        names it) or one that will not list (logged: the copies find out)."""
        store = self.env.config.object_stores.get(weights.source.store)
        if store is None:
            return []
        prefix = store.prefix + weights.source.prefix
        try:
            client = make_s3_client(store)
        except Exception as error:  # noqa: BLE001 - its credentials unreadable here: the copies say so
            activity.logger.warning("weights source %s not looked at: %s", weights.source.store, error)
            return []
        missing = missing_from_source(client, store.bucket, prefix, weights.files)
        if missing is None:
            activity.logger.warning("weights source s3://%s/%s would not list: its files not looked for before "
                                    "the copies", store.bucket, prefix)
            return []
        return missing

    def _name_clashes(self, model: str, served: dict[str, list[str]]) -> list[str]:
        """Another model, served or in the fleet config, under ``model``'s Kubernetes name: its
        Deployments would take this rollout's template and its route this model's sites, with
        no error anywhere."""
        problems = []
        for other in sorted(set(served) | set(self.env.config.models)):
            clash = kubernetes_name_clash(model, other)
            if clash:
                where = (f"is served at {', '.join(sorted(served[other]))}" if other in served
                         else f"is named in the fleet config (models.{other})")
                problems.append(f"model: {clash}: {other!r} {where}; roll out under its name or rename the model")
        return problems

    def _serving_name_clashes(self, input: ResolveRolloutSitesInput, served: dict[str, list[str]]) -> list[str]:
        """A target site where the model's serving name is another model's at one of its sites,
        served or in the fleet config (``a-b`` at ``c``, ``a`` at ``b-c``): the Deployment,
        Service and PodDisruptionBudget the rollout writes there would be that model's."""
        placed = {(other, site): f"is served at {site}" for other, where in served.items() for site in where}
        for other, policy in self.env.config.models.items():
            for site in [*policy.sites, *policy.standby_sites]:
                placed.setdefault((other, site), f"is to serve at {site} (models.{other} in the fleet config)")
        problems = [f"model: {clash}: {other!r} {where}; rename the model"
                    for (other, site), where in sorted(placed.items())
                    if (clash := model_service_clash(input.model, other, site))]
        models = sorted({other for other, _ in placed} | set(self.env.config.models))
        for i, target in enumerate(input.sites):
            problems += [f"sites[{i}].site: {clash}: {other!r} {where}; rename the model or roll out to another site"
                         for (other, site), where in sorted(placed.items())
                         if (clash := serving_name_clash(input.model, target, other, site))]
            problems += [f"sites[{i}].site: {clash}: {other!r} is a model; rename the model or roll out to another site"
                         for other in models if (clash := model_service_clash(other, input.model, target))]
        return problems

    async def _rollout_running(self, model: str) -> str:
        """The problem when another rollout of ``model`` runs (``another_rollout_running``), else ""
        with the model's rollout claim taken (``activities.claims``): rollouts of one model have one
        id per version, which Temporal does not keep apart. The claim is keyed by the model's
        Kubernetes name, the objects a rollout writes (``Llama-3-8B`` and ``llama_3_8b`` share
        them), and taken here, the rollout's first step, so a rollout started from code or the
        ``temporal`` CLI takes it too; it is free once its holder ended, however it ended."""
        client, me = activity.client(), activity.info().workflow_id
        holder = (await take_claim(client, self.env.cluster, ROLLOUT_CLAIM_KIND, dns_label(model), me)
                  or await self._unclaimed_rollout(model))
        return another_rollout_running(holder) if holder else ""

    @staticmethod
    async def _unclaimed_rollout(model: str) -> str:
        """A rollout of ``model`` that acts without the claim, by Temporal's list: one started
        before rollouts took it (or whose record was lost), past its validation, so running long
        enough for the list to show it. One still validating is left out: it takes the claim (or
        is refused by it) itself, and counted here two started together would each refuse the
        other. A closed one the list still shows as running says so by its phase."""
        client, info = activity.client(), activity.info()
        query = (f'WorkflowType = "{flows.ModelRollout.TYPE}" AND ExecutionStatus = "Running" '
                 f'AND TaskQueue = "{info.task_queue}" AND Model = "{model}"')
        async for wf in client.list_workflows(query):
            if wf.id == info.workflow_id:
                continue
            try:
                progress = await client.get_workflow_handle(wf.id, run_id=wf.run_id).query(
                    flows.ModelRollout.progress, result_type=RolloutProgress)
            except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError):
                continue
            if progress is not None and progress.phase not in NOT_ACTING:
                return wf.id
        return ""

    @activity.defn
    @typed_errors
    def serving_snapshot(self, input: ServingRef) -> ServingStatus | None:
        return self.env.cluster.serving_status(input.model, input.site)

    @activity.defn
    @typed_errors
    def update_serving(self, input: UpdateServingInput) -> ServingStatus:
        """Create or update the Deployment (idempotent: the same spec changes nothing). The
        rolling update surges where the site has room for it (``_strategy``)."""
        return self.env.cluster.apply_serving(self._strategy(input.spec))

    def _strategy(self, spec: ServingSpec) -> ServingSpec:
        """``spec``, or where its surge replica could never start, ``spec`` replacing one replica
        at a time (``max_surge`` 0, which the answer's ``max_surge`` shows).

        A surge starts a new replica before an old one goes, and no old one goes before it is
        available (maxUnavailable 0): at a site whose GPUs are all held (the model's replicas,
        another model's, other GPU pods) that pod stays Pending, the update never ends, and the
        readiness wait ends in ServingNotReady and a rollback. One at a time, one replica fewer
        serves meanwhile; where that is the model's last available replica anywhere, the update
        is refused instead (product rule 11: a rollout never takes every site down)."""
        cluster = self.env.cluster
        live = cluster.serving_status(spec.model, spec.site)
        if not spec.max_surge or live is None or live.template == cluster.serving_template(spec):
            return spec  # no replica replaced: a new Deployment, or the template it runs (a retry)
        serving = cluster.list_serving()
        free = free_gpus_at(self.env.nodes(), serving, cluster.list_gpu_pods(), spec.site)
        # GPUs for the replicas the update adds (fewer frees some), and for the surge replica.
        added = spec.gpus_per_replica * (spec.replicas - live.desired_replicas)
        needed = added + spec.gpus_per_replica
        if free >= needed or free < added:
            return spec  # room to surge; or none for the replicas asked for, however they are replaced
        elsewhere = sum(s.available_replicas for s in serving if s.model == spec.model and s.site != spec.site)
        if spec.replicas == 1 and live.available_replicas and not elsewhere:
            raise ApplicationError(
                f"no room for a surge replica at {spec.site} ({free} GPUs free, {needed} needed), and replacing "
                f"its one replica would leave {spec.model} served nowhere: free {needed - free} GPUs there or "
                "serve the model at another site first",
                type="NoRoomToUpdate", non_retryable=True,
            )
        return spec.model_copy(update={"max_surge": 0})

    @activity.defn
    @typed_errors
    def wait_serving_ready(self, input: WaitServingInput) -> ServingStatus:
        status: ServingStatus | None = None

        def ready() -> ServingStatus | None:
            nonlocal status
            status = self.env.cluster.serving_status(input.model, input.site)
            done = status is not None and status.ready and status.observed_generation >= status.generation
            return status if done else None

        def not_ready() -> ApplicationError:
            seen = (f"{status.available_replicas}/{status.desired_replicas} replicas available, "
                    f"{status.updated_replicas} updated") if status else "no Deployment"
            return ApplicationError(
                f"{input.model} at {input.site} not ready by {input.deadline.isoformat()}: {seen}",
                type="ServingNotReady", non_retryable=True,
            )

        return poll_until(ready, input.deadline, input.poll_seconds, not_ready)

    @activity.defn
    @typed_errors
    async def probe_serving(self, input: ProbeServingInput) -> ProbeResult:
        """The probe requests, one after another (each up to its timeout: minutes in all), in a
        thread; heartbeating meanwhile when the rollout asks for it, so a lost worker's attempt is
        retried within the heartbeat timeout."""
        prober = self.prober
        return await heartbeating(asyncio.to_thread(prober.probe, input.model, input.site, input.requests,
                                                    input.timeout_seconds))

    @activity.defn
    @typed_errors
    def rollback_site(self, input: RollbackSiteInput) -> ServingStatus | None:
        cluster = self.env.cluster
        if not input.had_previous:
            cluster.delete_serving(input.model, input.site)
            return None
        status = cluster.serving_status(input.model, input.site)
        if (input.updated_template or input.unanswered_image) and status is not None:
            ours_live = self._ours_live(input, status)
            if ours_live and status.template != input.previous_template:
                status = cluster.rollback_serving(input.model, input.site)  # the one before comes back
            elif not ours_live and status.template != input.previous_template:
                return status  # someone else's template since ours: theirs stays
            # Where the template before ours is live (ours never landed, or a retry: rolled back
            # already), rollback_serving is not called: it would go to the version before that one.
            return self._put_back_replicas(input, status)
        if status is not None and input.updated_generation and status.generation > input.updated_generation:
            return status  # a retried attempt: the rollback already happened
        return cluster.rollback_serving(input.model, input.site)

    @staticmethod
    def _ours_live(input: RollbackSiteInput, status: ServingStatus) -> bool:
        """Whether the template our update wrote is the live one. Where the update gave no answer,
        ours is any template other than the one before that runs the image it asked for."""
        if input.updated_template:
            return status.template == input.updated_template
        return status.template != input.previous_template and status.image == input.unanswered_image

    def _put_back_replicas(self, input: RollbackSiteInput, status: ServingStatus) -> ServingStatus:
        """The replicas the Deployment had before our update, unless someone changed ours since."""
        if input.previous_replicas is None or status.desired_replicas != input.updated_replicas:
            return status
        if status.desired_replicas == input.previous_replicas:
            return status
        return self.env.cluster.scale_serving(input.model, input.site, input.previous_replicas)

    @activity.defn
    @typed_errors
    def site_evacuations(self, input: EvacuationInput) -> dict[str, str]:
        """site -> why it is under evacuation, for the asked sites that are: what the
        evacuation decided (the fleet-wide site document, written as it happens), or what
        the model's routes say (written by its Routing entity, a moment later)."""
        return self._evacuations(input.model, input.sites)

    def _evacuations(self, model: str, sites: list[str]) -> dict[str, str]:
        decided = self.env.cluster.get_site_routes()
        table = self.env.cluster.get_routing(model)
        out: dict[str, str] = {}
        for site in sites:
            for routes in (decided, table):
                route = routes.sites.get(site) if routes else None
                if route is not None and (route.draining or route.incident):
                    out[site] = route.incident or "draining"
                    break
        return out

    @activity.defn
    @typed_errors
    async def wait_site_evacuations(self, input: EvacuationWaitInput) -> dict[str, str]:
        """The evacuations of the sites in ``input.seen`` (as ``site_evacuations``) once they
        differ from it (a site came back, or another evacuation holds it now), or at
        ``input.until``. A rollout whose next sites are all under evacuation waits here: the
        routes are read every ``poll_seconds`` in the worker, with a heartbeat at most once per
        half its timeout, where each look was an activity and a timer in the rollout's history
        (120 actions an hour, its history full within days)."""
        beat = RareHeartbeat()
        sites = list(input.seen)
        while True:
            now = await asyncio.to_thread(self._evacuations, input.model, sites)
            left = (input.until - datetime.now(timezone.utc)).total_seconds()
            if now != input.seen or left <= 0:
                return now
            look = min(input.poll_seconds, left)
            while look > 0:  # asleep between looks, heartbeating (each a write on the server)
                stop_if_asked()
                beat()
                chunk = min(look, RECHECK_SECONDS)
                await asyncio.sleep(chunk)
                look -= chunk
