"""Site (entity, id ``site/<name>``): keep the site between its min and max.

Min/max come from the fleet config. Node workflows tell it their transitions
(``node_transition``); the reconcile sweep (a Schedule) and a timer send
``reconcile``. Each reconcile counts the site's nodes in the cluster, then:

- below min: an AcquireCapacity restricted to this site for the missing nodes;
- above max: drain (PDBs honoured) and retire the surplus, most expensive first,
  then newest.

Continues as new when the server suggests it (node map and counters carried).

SiteSweep (id ``site-sweep``, run by a Schedule): signal-with-start every site's
entity with ``reconcile``.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from workflows.capacity_models import (
        CapacityResult,
        DrainNodeInput,
        NodeTransition,
        RetireMachineInput,
        SignalSitesInput,
        SiteInput,
        SiteNode,
        SiteNodesInput,
        SiteStatus,
    )
    from activities.models import ResolveSiteInput
    from fleet import search_attributes as sa
    from fleet.config import Site
    from fleet.placement import surplus_to_retire
    from providers.cluster.base import DrainResult
    from workflows.inputs import parse_input
    from workflows.node_join import CLUSTER_RETRY, PROVIDER_RETRY, QUICK, failure_message

RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30))


@workflow.defn(name="Site")
class SiteEntity:
    def __init__(self) -> None:
        self._wanted = True
        self._status: SiteStatus | None = None
        self._fill: asyncio.Task | None = None

    @workflow.signal
    def reconcile(self) -> None:
        self._wanted = True

    @workflow.signal
    def node_transition(self, raw: dict[str, Any]) -> None:
        t = NodeTransition.model_validate(raw)
        if self._status is not None:
            self._status.nodes[t.node_name] = t.state
        self._wanted = True

    @workflow.query
    def status(self) -> SiteStatus:
        return self._status

    @workflow.run
    async def run(self, raw: dict[str, Any]) -> None:
        args = parse_input(SiteInput, raw)
        self._args = args
        self._status = SiteStatus(site=args.site, nodes=dict(args.nodes))
        site: Site = await workflow.execute_activity(
            "resolve_site", ResolveSiteInput(site=args.site), result_type=Site, start_to_close_timeout=QUICK,
            retry_policy=PROVIDER_RETRY, summary=f"min/max of {args.site} from the config",
        )
        self._site = site
        self._fills = args.fills
        self._status = SiteStatus(site=site.name, min_nodes=site.min_nodes, max_nodes=site.max_nodes,
                                  nodes=dict(args.nodes))
        workflow.upsert_search_attributes([
            sa.SITE.value_set(site.name), sa.PROVIDER.value_set(site.provider), sa.ACCOUNT.value_set(site.account),
            sa.FLEET_STATE.value_set("reconciling"),
        ])
        while True:
            try:
                await workflow.wait_condition(
                    lambda: self._wanted or workflow.info().is_continue_as_new_suggested(),
                    timeout=timedelta(seconds=args.reconcile_seconds), timeout_summary="next reconcile",
                )
            except asyncio.TimeoutError:
                self._wanted = True
            if self._wanted:
                self._wanted = False
                await self._reconcile()
            if workflow.info().is_continue_as_new_suggested() and self._fill is None:
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(args.model_copy(update={
                    "nodes": self._status.nodes, "fills": self._fills,
                }).model_dump(mode="json"))

    def _show(self, line: str) -> None:
        s = self._status
        s.last = line
        ready = sum(state == "ready" for state in s.nodes.values())
        lines = [f"**{line}**", f"{len(s.nodes)} nodes ({ready} ready), min {s.min_nodes}, max {s.max_nodes}"]
        if s.filling:
            lines.append(f"filling: {s.filling}")
        lines += [f"- retiring {n}" for n in s.retiring]
        workflow.set_current_details("\n".join(lines))

    async def _reconcile(self) -> None:
        site, s = self._site, self._status
        nodes: list[SiteNode] = await workflow.execute_activity(
            "site_nodes", SiteNodesInput(site=site.name), result_type=list[SiteNode],
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary=f"nodes at {site.name}",
        )
        s.nodes = {n.node_name: ("ready" if n.ready and not n.unproven else "joining") for n in nodes}
        count = len(nodes)
        if self._fill is not None:
            self._show(f"{count} nodes; filling")
            return
        if count < site.min_nodes:
            self._start_fill(site.min_nodes - count)
            self._show(f"below min ({count} < {site.min_nodes}): acquiring {site.min_nodes - count}")
        elif count > site.max_nodes:
            await self._retire(surplus_to_retire(nodes, count - site.max_nodes), count)
        else:
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("ok")])
            self._show(f"{count} nodes, within min/max")

    def _start_fill(self, need: int) -> None:
        site = self._site
        self._fills += 1
        fill_id = f"capacity/site-{site.name}-{self._fills}"
        request = {
            "count": need, "reason": f"site {site.name} below min",
            **self._args.fill_request,
            "constraints": {**self._args.fill_request.get("constraints", {}), "sites": [site.name]},
        }
        self._status.filling = fill_id
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("filling")])

        async def fill() -> None:
            try:
                result: CapacityResult = await workflow.execute_child_workflow(
                    "AcquireCapacity", request, id=fill_id, result_type=CapacityResult,
                    parent_close_policy=ParentClosePolicy.ABANDON,
                    static_summary=f"fill {site.name} to its min ({need} nodes)",
                )
                self._status.last = f"fill {fill_id}: {len(result.nodes)} of {need} joined"
            except Exception as error:  # noqa: BLE001 - a failed fill is retried by the next reconcile
                self._status.last = f"fill {fill_id} failed: {failure_message(error)}"
            finally:
                self._status.filling = ""
                self._fill = None
                self._wanted = True

        self._fill = asyncio.create_task(fill())

    async def _retire(self, surplus: list[SiteNode], count: int) -> None:
        site, s = self._site, self._status
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("retiring")])
        s.retiring = [n.node_name for n in surplus]
        self._show(f"above max ({count} > {site.max_nodes}): retiring {len(surplus)}")
        for node in surplus:
            drained: DrainResult = await workflow.execute_activity(
                "drain_within", DrainNodeInput(node_name=node.node_name, deadline_seconds=self._args.drain_seconds),
                result_type=DrainResult, start_to_close_timeout=timedelta(seconds=self._args.drain_seconds + 60),
                heartbeat_timeout=timedelta(seconds=30), retry_policy=CLUSTER_RETRY,
                summary=f"drain {node.node_name} (PDBs honoured)",
            )
            if not drained.completed:
                s.last = f"{node.node_name}: drain blocked ({'; '.join(p.reason for p in drained.blocked)}); next reconcile"
                continue
            try:
                await workflow.execute_activity(
                    "retire_machine", RetireMachineInput(site=site.name, node_name=node.node_name,
                                                          machine_id=node.machine_id),
                    start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY,
                    summary=f"retire {node.node_name} (machine {node.machine_id})",
                )
                s.nodes[node.node_name] = "gone"
            except ActivityError as error:
                s.last = f"{node.node_name}: retire failed: {failure_message(error)}"
        s.retiring = []
        self._show(f"retired surplus at {site.name}")


@workflow.defn(name="SiteSweep")
class SiteSweep:
    """Signal-with-start every site's entity with ``reconcile``."""

    @workflow.run
    async def run(self, raw: dict[str, Any] | None = None) -> list[str]:
        sites: list[str] = await workflow.execute_activity(
            "signal_sites", SignalSitesInput(**(raw or {})), result_type=list[str], start_to_close_timeout=QUICK,
            retry_policy=RETRY, summary="reconcile every site",
        )
        workflow.set_current_details(f"**done**: reconcile sent to {len(sites)} sites")
        return sites
