"""NodeJoin (id ``join/<site>/<request>``): one machine from provider to serving.

The runbook: the site looked up (its config), a join token bound to the node's name, then
the machine with its bootstrap (kubeadm join) in its user data, in one activity (the
workflow id is the provider's idempotency key and the token's) →
approve its kubelet's certificate, wait for it to register as this machine (providerID,
addresses), delete the token, record its identity, label it and taint it unproven, in
one activity → smoke test on the node's own queue (it also returns the node's state) →
lift the taint and start the node's Node entity with that state (the admit activity
also tells the Site entity). Anything failing after the machine exists deletes the
machine: a failed join leaks nothing and never admits the node.

A cancel (``temporal workflow cancel``, ``gpufleet join`` interrupted, a parent request or
repair cancelled) cleans up the same way, then ends the run cancelled, not failed:
``FleetState = "cancelled"`` (``needs-person`` when the machine could not be deleted), its
details naming the step it stopped at and what it deleted. One that lands while the node is
admitted waits for the admit's answer (the call hears no cancel): admitted, the node may already
run pods, so the join has finished and ends ready, its node kept, the cancel noted; an admit that
failed is cleaned up as any cancel is.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, FailureError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import activities as act
    from fleet.messages.nodes import (
        AdmitNodeInput, AwaitRegistrationInput, DeleteMachineInput, ProvisionedMachine, ProvisionJoinInput,
        ReleaseProvisionInput, RemoveNodeInput, ResolveSiteInput, RevokeNodeTokensInput, SmokeResult,
    )
    from fleet import search_attributes as sa
    from fleet.config import Site
    from fleet.models import MACHINE_TAG_JOIN, MACHINE_TAG_SITE, Machine, Node
    from fleet.naming import fan_out_join_id, node_name_for, node_queue
    from fleet.cluster import UNPROVEN_TAINT, JoinTokenRef
    from fleet.demand import site_labels
    from fleet.site_use import over_max_nodes
    from workflows.inputs import parse_input
    from workflows.steps import (
        CLUSTER_RETRY,
        PROVIDER_RETRY,
        QUICK,
        cancelled_by_request,
        cancelled_words,
        failure_message,
        failure_type,
        join_until,
        show_details,
        smoke_test_node,
        to_its_end,
        until,
        until_in,
    )
    from fleet.messages.join import (
        TOKEN_CHECKS,
        JoinedNode,
        JoinProgress,
        JoinTimeouts,
        NodeJoinInput,
        NodeJoinResult,
    )

#: Deprecated, to be removed in a later release (docs/design/patches.md, "The rule"): a cancel that
#: lands during the admit waits for its answer. ``admit_node`` hears no cancel (it does not
#: heartbeat) and goes on: it lifts the unproven taint, starts the Node entity and tells the Site the
#: node is ready, so pods may land on it. Admitted, the node stays and the join ends ready; an admit
#: that failed is cleaned up. Every join open now started after it; the call stays, deprecated, where
#: a cancel lands during the admit, until no run holding its marker is open.
ADMIT_TO_ITS_END_PATCH = "join-admits-to-its-end"
#: Workflow patch: a join of one node started by hand (no parent: a client, ``temporal workflow
#: start``, a Schedule) looks its site up first (``resolve_site``) and refuses a site whose
#: ``max_nodes`` is 0 (one being emptied) before anything is bought, ``InvalidInput`` naming
#: ``count``, as a fan-out refuses a count above max_nodes. Runs before it went straight to the
#: provisioning activity and bought the machine, which the Site entity then retired. Asked first,
#: before any activity.
REFUSES_NO_ROOM_PATCH = "join-by-hand-refuses-max-nodes-0"


@workflow.defn(name="NodeJoin")
class NodeJoin:
    def __init__(self) -> None:
        self._progress = JoinProgress(step="starting")
        #: The clean-up ran (the machine it bought was deleted unless ``_left_behind`` says otherwise).
        self._cleaned_up = False
        #: What the clean-up could not delete or remove.
        self._left_behind: list[str] = []

    @workflow.query
    def progress(self) -> JoinProgress:
        return self._progress

    def _step(self, step: str, detail: str = "") -> None:
        if self._progress.step not in ("starting", step):
            self._progress.done.append(self._progress.step)
        self._progress.step = step
        self._show(detail)

    def _show(self, detail: str = "") -> None:
        p = self._progress
        lines = [f"node `{p.node_name}` machine `{p.machine_id or '-'}`"] if p.node_name else []
        show_details(p.step, *lines, *(f"- done: {s}" for s in p.done), detail=detail)

    @workflow.run
    async def run(self, raw: Any) -> NodeJoinResult:
        # Only a join started by a person (or a client): one a parent started (AcquireCapacity, a
        # fan-out) has the input its parent checked at its own start.
        by_hand = workflow.info().parent is None
        request = parse_input(NodeJoinInput, raw, context={TOKEN_CHECKS: by_hand})
        if request.count > 1:
            return await self._join_many(request)
        if by_hand and workflow.patched(REFUSES_NO_ROOM_PATCH):
            # A parent's join is not asked: an AcquireCapacity placed it within its sites' max_nodes,
            # a fan-out checked its count, a repair's replacement takes its old node's place.
            await self._check_site(request)
        try:
            return NodeJoinResult(nodes=[await self._join_one(request)])
        except (ActivityError, ApplicationError, asyncio.CancelledError) as error:
            step = self._progress.step
            if self._cancelled(error):
                self._stopped_by_cancel(step)
                # The run closes Canceled: a cancel of it was requested and this is a cancel error.
                raise
            if isinstance(error, asyncio.CancelledError):
                raise
            # One typed failure for callers: the root cause's type, where it happened. A clean-up
            # that left something behind keeps saying so (``needs-person``): a machine may be billing.
            left = self._left_behind
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("needs-person" if left else "failed")])
            kind = failure_type(error)
            # The activity's message may already start with its type: say each cause once.
            message = failure_message(error).removeprefix(f"{kind}: ")
            behind = f"; clean-up incomplete, a person looks: {'; '.join(left)}" if left else ""
            self._step("failed", f"{kind} while {step}: {message}{behind}")
            raise ApplicationError(f"{kind} while {step}: {message}{behind}", type=kind, non_retryable=True) from error

    async def _join_many(self, request: NodeJoinInput) -> NodeJoinResult:
        """One child join per node, so each machine has its own id and history."""
        # The fan-out is findable by Site/FleetState however it was started, refuses more
        # nodes than the site's max_nodes, and its progress shows a failure.
        await self._check_fan_out(request)
        try:
            result = await self._fan_out(request)
        except ApplicationError as error:
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("failed")])
            self._step("failed", f"{error.type}: {error.message}")
            raise
        except asyncio.CancelledError as error:
            if self._cancelled(error):
                # Its children were cancelled with it and have ended (each waited for).
                base = workflow.info().workflow_id
                self._cancelled_fan_out(f"its joins {base}/0 to {base}/{request.count - 1} were cancelled with it: "
                                        "each deleted the machine it bought; a node already admitted stays")
            raise
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("ready")])
        self._step("ready", f"{len(result.nodes)} nodes at {request.site}")
        return result

    async def _check_fan_out(self, request: NodeJoinInput) -> None:
        started_with = workflow.info().typed_search_attributes
        missing = [pair for pair in (sa.SITE.value_set(request.site), sa.FLEET_STATE.value_set("joining"))
                   if started_with.get(pair.key) is None]
        if missing:
            workflow.upsert_search_attributes(missing)
        await self._check_site(request)

    async def _check_site(self, request: NodeJoinInput) -> None:
        """Before anything is bought: the site looked up (an unknown one refused), and ``count``
        refused where it is more than the site's ``max_nodes``, which its Site entity retires down to.

        The nodes already at the site are not counted, on purpose: a person joins one to a full
        site to replace a failing node (removed once its replacement serves), or while one is being
        retired or reclaimed, and a count read now is stale by the time the machine registers,
        minutes later. What an operator expects is the join they asked for, not a refusal from a
        count that may no longer hold; the Site entity, which owns the count, retires whatever is
        still above its max at its next reconcile (most expensive first, then newest; never a held
        node). ``gpufleet join``, at a terminal, counts them and says the room left. Only what can
        never fit is refused here: more than max_nodes, whatever the cluster holds."""
        self._step("resolving site", request.site)
        try:
            site: Site = await workflow.execute_activity(
                act.resolve_site, ResolveSiteInput(site=request.site),
                start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY, summary=f"look up site {request.site}",
            )
        except ActivityError as error:
            if self._cancelled(error):
                self._say_cancelled("cancelled", self._progress.step, "nothing was bought")
                raise
            kind = failure_type(error)
            message = failure_message(error).removeprefix(f"{kind}: ")
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("failed")])
            self._step("failed", f"{kind} while resolving site: {message}")
            raise ApplicationError(f"{kind} while resolving site: {message}", type=kind, non_retryable=True) from None
        over = over_max_nodes(site, request.count)
        if over is not None:
            message = f"count: {over}"
            # Found by its Site however it was started (a fan-out set it at its start).
            unnamed = [sa.SITE.value_set(site.name)] if workflow.info().typed_search_attributes.get(sa.SITE) is None else []
            workflow.upsert_search_attributes([*unnamed, sa.FLEET_STATE.value_set("failed")])
            self._step("failed", f"InvalidInput: {message}")
            raise ApplicationError(message, {"field": "count"}, type="InvalidInput", non_retryable=True)

    async def _fan_out(self, request: NodeJoinInput) -> NodeJoinResult:
        # Each child runs to its own timeouts, all started now.
        self._step("joining", f"{request.count} nodes at {request.site}, each "
                              f"{join_until(workflow.now(), request.timeouts)}")
        base = workflow.info().workflow_id
        single = request.model_copy(update={"count": 1})
        children = [
            workflow.execute_child_workflow(
                NodeJoin.run, single.model_dump(mode="json"), id=fan_out_join_id(base, i),
                static_summary=f"join node {i + 1} of {request.count} at {request.site}",
                # Ending this join (terminated, cancelled) cancels its children, and each
                # cancelled child deletes its machine: none keeps billing unowned.
                parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
            )
            for i in range(request.count)
        ]
        results = await asyncio.gather(*children, return_exceptions=True)
        joined = [node for r in results if isinstance(r, NodeJoinResult) for node in r.nodes]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise ApplicationError(
                f"{len(joined)} of {request.count} nodes joined; first failure: {failure_message(failed[0])}",
                {"joined": [n.model_dump(mode="json") for n in joined]},
                type=failure_type(failed[0]),
                non_retryable=True,
            )
        return NodeJoinResult(nodes=joined)

    async def _join_one(self, request: NodeJoinInput) -> JoinedNode:
        """The runbook: buy the machine with its bootstrap (the same step looks the site up), wait
        for it to register, prove its GPUs, admit it. A step that fails deletes the machine."""
        join_id = workflow.info().workflow_id
        # A node name is never reused: a later join started with this same id names its node
        # anew, so an earlier machine's certificate for the old name never becomes a live node's.
        nonce = workflow.info().first_execution_run_id
        node_name = node_name_for(request.site, join_id, nonce)
        self._progress.node_name = node_name

        # The provider's idempotency key too: the same id started again buys a new machine,
        # never the one an earlier run created (and may have deleted) under that key.
        provision_key = f"{join_id}#{nonce}" if nonce else join_id
        # Provisioning looks the site up, and returns the site's facts with the machine.
        provisioned = await self._provision(request.site, node_name, request, provision_key=provision_key)
        machine = provisioned.machine
        token: JoinTokenRef | None = provisioned.token
        try:
            site = self._found_site(provisioned, node_name, join_id)
            await self._await_registration(site, node_name, provisioned, join_id, request.timeouts)
            token = None  # deleted by the activity the moment the node registered
            smoke = await self._smoke_test(site, node_name, request.timeouts)
            admitted_as_cancelled = await self._admit(site, node_name, machine, smoke)
        except (FailureError, asyncio.CancelledError):
            step = self._progress.step
            await self._clean_up(request.site, machine, node_name)
            self._progress.step = step  # report where it failed, not the clean-up
            raise
        finally:
            if token is not None:
                await self._revoke_node_tokens(node_name)  # and any other a retried attempt issued

        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("ready")])
        cancel = (f"; {cancelled_words()} while admitting: node {node_name} was admitted as the cancel came "
                  f"and stays (machine {machine.id})" if admitted_as_cancelled else "")
        self._step("ready", f"{site.gpus_per_machine}x {site.gpu}{cancel}")
        return JoinedNode(
            node_name=node_name, machine_id=machine.id, site=site.name, provider=site.provider,
            gpus=site.gpus_per_machine, account=site.account,
        )

    def _found_site(self, provisioned: ProvisionedMachine, node_name: str, join_id: str) -> Site:
        """The site's facts as the provisioning activity found them: the join's search attributes
        and what its steps say."""
        site = provisioned.site
        if site is None:  # only a worker from before the field answers without it
            raise ApplicationError("provisioning returned no site: a worker older than this workflow",
                                   type="WorkerTooOld", non_retryable=True)
        self._set_site_attributes(site, node_name, join_id)
        self._show(f"{site.instance_type} at {site.provider} {site.region}: machine {provisioned.machine.id}")
        return site

    def _set_site_attributes(self, site: Site, node_name: str, join_id: str) -> None:
        # A starter that knew the site set these at start (``sa.join_start_attributes``): upsert what differs.
        started_with = workflow.info().typed_search_attributes
        wanted = [(pair.key, node_name if pair.key == sa.NODE_NAME else pair.value)
                  for pair in sa.join_attributes(site.name, site.provider, site.account, join_id)]
        changed = [key.value_set(value) for key, value in wanted if started_with.get(key) != value]
        if changed:
            workflow.upsert_search_attributes(changed)

    async def _provision(self, site_name: str, node_name: str, request: NodeJoinInput, *,
                         provision_key: str) -> ProvisionedMachine:
        """2. The site looked up, a node-bound join token, then the machine with it in its user
        data. An unknown site is refused before anything is bought."""
        timeouts = request.timeouts
        tags = {MACHINE_TAG_JOIN: workflow.info().workflow_id, MACHINE_TAG_SITE: site_name}
        # The activity's limit is one try's: a try that fails is tried again (``PROVIDER_RETRY``).
        bound = f"{until_in(timeouts.provision_seconds)} (per try)"
        self._step("provisioning", f"looking up site {site_name}, then its machine, {bound}")
        what = ProvisionJoinInput(site=site_name, name=node_name, tags=tags, idempotency_key=provision_key,
                                  ttl_seconds=request.token_ttl_seconds)
        provisioning = workflow.start_activity(
            act.provision_joining_machine, what,
            start_to_close_timeout=timedelta(seconds=timeouts.provision_seconds),
            # The activity heartbeats while the provider creates the machine: a lost worker is
            # retried within the heartbeat timeout, under the same key (no second machine).
            heartbeat_timeout=timedelta(seconds=timeouts.heartbeat_seconds), retry_policy=PROVIDER_RETRY,
            summary=f"look up site {site_name}, node-bound join token, then its machine with it in its user data",
        )
        try:
            # Shielded: a join cancelled mid-create must still learn the machine to delete it.
            provisioned: ProvisionedMachine = await asyncio.shield(provisioning)
        except asyncio.CancelledError as cancel:
            try:
                machine = (await provisioning).machine
            except ActivityError as error:
                # The create failed after the cancel: the failed create's clean-up all the same
                # (the token; any machine made under the key), and the join still ends cancelled,
                # not failed with the provider's answer to a create nobody wants any more.
                await self._provision_failed(site_name, node_name, provision_key, error)
                self._progress.step = "provisioning"
                raise cancel from None
            self._progress.machine_id = machine.id
            await self._clean_up(site_name, machine, node_name)
            await self._revoke_node_tokens(node_name)  # its machine never used it
            self._progress.step = "provisioning"  # report where it was cancelled, not the clean-up
            raise
        except ActivityError as error:
            await self._provision_failed(site_name, node_name, provision_key, error)
            raise
        self._progress.machine_id = provisioned.machine.id
        return provisioned

    async def _provision_failed(self, site_name: str, node_name: str, provision_key: str, error: ActivityError) -> None:
        """A failed create leaves nothing: any machine made under its key, the node's join tokens."""
        # Every adapter looks the key up before it reports no capacity: then nothing is there. A
        # revoked account may not be called at all (rule 6): the sweep finds it once rotated.
        if failure_type(error) not in ("NoCapacity", "BadCredentials"):
            await self._release_provision(site_name, node_name, provision_key)
        await self._revoke_node_tokens(node_name)

    async def _await_registration(self, site: Site, node_name: str, provisioned: ProvisionedMachine,
                                  join_id: str, timeouts: JoinTimeouts) -> None:
        """3. Its certificate approved only for its own name, providerID and addresses; its token
        deleted at registration; labelled, and tainted unproven."""
        # Every label the fleet keeps on its site's nodes (``site_labels``), the demand loop's opt-in
        # selector among them: a pod bought this node binds as its unproven taint goes, not once the
        # loop next labels (which it did after the purchase ended, or within 2 s).
        labels = site_labels(site)
        deadline = workflow.now() + timedelta(seconds=timeouts.registration_seconds)
        self._step("waiting for registration", f"{until(deadline)}; "
                   "its certificate only for its own name, providerID and addresses its machine's"
                   "; then labelled, tainted unproven until the smoke test passes")
        await workflow.execute_activity(
            act.await_registration,
            AwaitRegistrationInput(site=site.name, node_name=node_name, machine_id=provisioned.machine.id,
                                   provider_id=provisioned.provider_id, join_id=join_id, deadline=deadline,
                                   labels=labels, add_taints=[UNPROVEN_TAINT]),
            start_to_close_timeout=timedelta(seconds=timeouts.registration_seconds + 60),
            heartbeat_timeout=timedelta(seconds=timeouts.heartbeat_seconds), retry_policy=CLUSTER_RETRY,
            summary=f"approve {node_name}'s certificate, wait for it to register, delete its token"
                    ", label site/provider/region/GPU, taint unproven",
        )

    async def _smoke_test(self, site: Site, node_name: str, timeouts: JoinTimeouts) -> SmokeResult:
        """4. On the node's own queue: GPUs visible, counters clean, compute check."""
        self._step("smoke test", f"on {node_queue(node_name)} {until_in(timeouts.smoke_test_seconds)}")
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("proving")])
        try:
            smoke = await smoke_test_node(
                node_name, site.gpus_per_machine, timeout_seconds=timeouts.smoke_test_seconds,
                heartbeat=timedelta(seconds=timeouts.heartbeat_seconds),
                summary="GPUs visible, counters clean, compute check", include_state=True,
            )
        except ActivityError as error:
            if self._cancelled(error):
                raise  # the join was cancelled during its smoke test: the test did not fail
            # The node's own failure, whatever type it names: the join's failure type is read by
            # AcquireCapacity (BadCredentials revokes the account, OverQuota blocks the offer,
            # InvalidRequest ends the whole request), so a node must not choose it.
            raise ApplicationError(f"smoke test did not run on {node_name}: {failure_message(error)}"[:1000],
                                   type="SmokeTestFailed", non_retryable=True) from None
        if not smoke.passed:
            raise ApplicationError(
                f"smoke test failed on {node_name}: " + "; ".join(smoke.failures),
                {"failures": smoke.failures}, type="SmokeTestFailed", non_retryable=True,
            )
        return smoke

    async def _admit(self, site: Site, node_name: str, machine: Machine, smoke: SmokeResult) -> bool:
        """5. The unproven taint lifted, the Site entity told. True when a cancel came meanwhile and
        the admit went through all the same: the join has finished, its node stays."""
        self._step("admitting", "remove the unproven taint")
        admitting = workflow.start_activity(
            act.admit_node, AdmitNodeInput(node_name=node_name, site=site.name, machine_id=machine.id,
                                           first_state=smoke.state),
            start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary="admit: remove unproven taint, tell the Site entity",
        )
        try:
            await asyncio.shield(admitting)
        except asyncio.CancelledError:
            workflow.deprecate_patch(ADMIT_TO_ITS_END_PATCH)
            # The call goes on whatever the join does: its answer (its retries too) is awaited.
            # Admitted, the node is schedulable and its Site counts it ready: pods may be on it, and
            # deleting it now would take their machine with no drain. The join has finished: it
            # keeps the node (a person who wants it gone drains it as any node). A failed admit is
            # cleaned up, and the join ends cancelled, not failed on a step nobody wants any more.
            try:
                await admitting
            except ActivityError:
                raise asyncio.CancelledError() from None
            self._progress.admitted = True
            return True
        return False

    async def _release_provision(self, site_name: str, node_name: str, provision_key: str) -> None:
        step = self._progress.step
        self._step("cleaning up", "deleting any machine an earlier attempt created")
        try:
            await self._finish(workflow.start_activity(
                act.release_provision, ReleaseProvisionInput(site=site_name, name=node_name, idempotency_key=provision_key),
                start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY,
                summary=f"delete any machine created as {node_name}",
            ))
        except ActivityError as error:
            # The sweep is the bound on this leak: it finds the machine by its marker later.
            workflow.logger.warning("could not look for a machine created as %s: %s", node_name,
                                    failure_message(error))
        self._progress.step = step  # report where it failed, not the clean-up

    async def _clean_up(self, site_name: str, machine: Machine, node_name: str) -> None:
        """Never leave a machine behind: machine deleted, node object out."""
        self._step("cleaning up", f"deleting machine {machine.id}")
        self._cleaned_up = True
        failed = self._left_behind
        try:
            await self._finish(workflow.start_activity(
                act.delete_machine, DeleteMachineInput(site=site_name, machine_id=machine.id),
                start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY,
                summary=f"delete machine {machine.id}",
            ))
        except ActivityError as error:
            failed.append(f"machine {machine.id}: {failure_message(error)}")
        finally:
            try:
                await self._finish(workflow.start_activity(
                    act.remove_node, RemoveNodeInput(node_name=node_name), start_to_close_timeout=QUICK,
                    retry_policy=CLUSTER_RETRY, summary=f"remove node {node_name}",
                ))
            except ActivityError as error:
                failed.append(f"node {node_name}: {failure_message(error)}")
        if failed:
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("needs-person")])
            workflow.logger.error("clean-up incomplete: %s", "; ".join(failed))

    def _cancelled(self, error: BaseException) -> bool:
        """Whether ``error`` is this join's own cancel reaching the step it was in: a cancel of the
        run was requested, and the wait ended cancelled (an activity cancelled with it, or the
        wait itself). Anything else, a node's own answer included, is a failure as before."""
        return cancelled_by_request(error)

    def _stopped_by_cancel(self, where: str) -> None:
        """A cancelled join has cleaned up (machine deleted, node object out, tokens deleted):
        say so where the operator looks (``FleetState``, details, the progress query)."""
        p = self._progress
        if self._left_behind:
            state = "needs-person"
            what = f"clean-up incomplete, a person looks: {'; '.join(self._left_behind)}"
        elif p.machine_id:
            state = "cancelled"
            what = f"machine {p.machine_id} deleted, node {p.node_name} never admitted"
        else:
            state, what = "cancelled", "nothing was bought"
        if self._cleaned_up:
            p.step = "cleaning up"  # done: where it was cancelled, then the clean-up
        self._say_cancelled(state, where, what)

    def _cancelled_fan_out(self, what: str) -> None:
        self._say_cancelled("cancelled", self._progress.step, what)

    def _say_cancelled(self, state: str, where: str, what: str) -> None:
        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set(state)])
        self._progress.cancelled_while = where
        self._step("cancelled", f"{cancelled_words()} while {where}: {what}")

    async def _finish(self, clean_up: workflow.ActivityHandle[Any]) -> Any:
        """Await a clean-up step to its end. A cancel of the join that lands meanwhile (a failed
        join cleaning up, an operator pressing Ctrl-C) must not stop it: it would leave the machine
        billing and the join saying a person must look. The cancel is not lost: the join ends
        right after its clean-up, the way it was going to end."""
        return await to_its_end(clean_up)

    async def _revoke_node_tokens(self, node_name: str) -> None:
        try:
            await self._finish(workflow.start_activity(
                act.revoke_node_tokens, RevokeNodeTokensInput(node_name=node_name),
                start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary="delete the node's join tokens",
            ))
        except ActivityError as error:
            # Each token expires within the hour anyway, and is good only for this node's name.
            workflow.logger.warning("could not delete the join tokens of %s: %s", node_name, failure_message(error))
