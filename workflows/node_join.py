"""NodeJoin (id ``join/<site>/<request>``): one machine from provider to serving.

The runbook: resolve the site (a local activity: a config lookup) → a join token bound
to the node's name, then the machine with its bootstrap (kubeadm join) in its user data,
in one activity (the workflow id is the provider's idempotency key and the token's) →
approve its kubelet's certificate, wait for it to register as this machine (providerID,
addresses), delete the token, record its identity, label it and taint it unproven, in
one activity → smoke test on the node's own queue (it also returns the node's state) →
lift the taint and start the node's Node entity with that state (the admit activity
also tells the Site entity). Anything failing after the machine exists deletes the
machine: a failed join leaks nothing and never admits the node.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, FailureError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities.models import (
        AwaitRegistrationInput,
        ProvisionedMachine,
        ProvisionJoinInput,
        RevokeNodeTokensInput,
        AdmitNodeInput,
        DeleteMachineInput,
        IssueJoinTokenInput,
        PrepareNodeInput,
        ProvisionMachineInput,
        ReleaseProvisionInput,
        RemoveNodeInput,
        ResolveSiteInput,
        RevokeJoinTokenInput,
        WaitForRegistrationInput,
    )
    from fleet import search_attributes as sa
    from fleet.config import Site
    from fleet.models import Machine, MachineSpec, Node
    from fleet.naming import node_name_for, site_workflow_id
    from fleet.settings import node_queue
    from fleet.cluster import (
        LABEL_GPU_PRODUCT,
        LABEL_PROVIDER,
        LABEL_REGION,
        LABEL_SITE,
        UNPROVEN_TAINT,
        JoinTokenRef,
    )
    from workflows.inputs import parse_input
    from workflows.steps import (
        CLUSTER_RETRY,
        PROVIDER_RETRY,
        QUICK,
        failure_message,
        failure_type,
        show_details,
        smoke_test_node,
    )
    from fleet.messages.join import JoinedNode, JoinProgress, NodeJoinInput, NodeJoinResult

#: Workflow patches, newest first. ``admit-tells-site``: the admit activity tells the
#: Site entity. Histories recorded before it replay through the older branches:
#: ``admit-together`` (admit, revoke and a signal to the Site in one round trip) and
#: ``tell-site-entity`` (the signal after the admission).
ADMIT_TELLS_SITE = "admit-tells-site"
#: Clean-up deletes the machine first (it bills), then removes the Node, each tried even
#: when the other failed. Runs before it removed the Node first.
MACHINE_FIRST = "clean-up-machine-first"
#: A provision that failed looks for a machine an earlier attempt created under the key
#: and deletes it (the reply of a create that succeeded can be lost).
RELEASE_FAILED_PROVISION = "release-failed-provision"
#: The machine is bought with its bootstrap in its user data: a node-bound token issued
#: first, in the activity that creates the machine; registration must then match the
#: machine (providerID, addresses) and the token goes as soon as the node registered.
#: Runs before it issued the token after the machine existed.
BOOTSTRAP_IN_USER_DATA = "bootstrap-in-user-data"
#: The node name carries a per-join nonce (the join's first run id): a join started again with
#: the same id names a new node (the starter's ``NodeName`` search attribute, from the id alone,
#: is corrected in the first task). Joins started before it name the node from the id alone.
NAME_NONCE = "join-name-nonce"
#: Two workflow tasks and two scheduled activities fewer per join: the site is resolved by a
#: local activity (a config lookup), and the node is labelled and tainted by the activity that
#: saw it register. Runs before it resolved the site as an activity and labelled the node in a
#: ``prepare_node`` step.
FEWER_STEPS = "join-in-fewer-steps"
#: Every patch above decided once, by this one, in the run's first workflow task: a run that has
#: it takes each one's new path without asking again. ``BOOTSTRAP_IN_USER_DATA`` was asked right
#: after the site's local activity, where a replay can ask it one workflow task early and fail
#: (see ``workflows.node.NODE_PATCHES_AT_START``). Runs from before it ask as before.
JOIN_PATCHES_AT_START = "join-patches-at-start"


@workflow.defn(name="NodeJoin")
class NodeJoin:
    def __init__(self) -> None:
        self._progress = JoinProgress(step="starting")
        #: ``JOIN_PATCHES_AT_START``: this run takes every patch's new path (asked once, first).
        self._settled = False

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
        self._settled = workflow.patched(JOIN_PATCHES_AT_START)  # first: before the local activity
        request = parse_input(NodeJoinInput, raw)
        if request.count > 1:
            return await self._join_many(request)
        try:
            return NodeJoinResult(nodes=[await self._join_one(request)])
        except (ActivityError, ApplicationError) as error:
            # One typed failure for callers: the root cause's type, where it happened.
            step = self._progress.step
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("failed")])
            kind = failure_type(error)
            # The activity's message may already start with its type: say each cause once.
            message = failure_message(error).removeprefix(f"{kind}: ")
            self._step("failed", f"{kind} while {step}: {message}")
            raise ApplicationError(f"{kind} while {step}: {message}", type=kind, non_retryable=True) from error

    async def _join_many(self, request: NodeJoinInput) -> NodeJoinResult:
        """One child join per node, so each machine has its own id and history."""
        # The fan-out is findable by Site/FleetState however it was started, refuses more
        # nodes than the site's max_nodes, and its progress shows a failure.
        tracked = self._settled or workflow.patched("join-many-site-and-failure")
        if tracked:
            await self._check_fan_out(request)
        try:
            result = await self._fan_out(request)
        except ApplicationError as error:
            if tracked:
                workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("failed")])
                self._step("failed", f"{error.type}: {error.message}")
            raise
        if tracked:
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("ready")])
            self._step("ready", f"{len(result.nodes)} nodes at {request.site}")
        return result

    async def _check_fan_out(self, request: NodeJoinInput) -> None:
        started_with = workflow.info().typed_search_attributes
        missing = [pair for pair in (sa.SITE.value_set(request.site), sa.FLEET_STATE.value_set("joining"))
                   if started_with.get(pair.key) is None]
        if missing:
            workflow.upsert_search_attributes(missing)
        self._step("resolving site", request.site)
        try:
            site: Site = await workflow.execute_activity(
                "resolve_site", ResolveSiteInput(site=request.site), result_type=Site,
                start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY, summary=f"look up site {request.site}",
            )
        except ActivityError as error:
            kind = failure_type(error)
            message = failure_message(error).removeprefix(f"{kind}: ")
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("failed")])
            self._step("failed", f"{kind} while resolving site: {message}")
            raise ApplicationError(f"{kind} while resolving site: {message}", type=kind, non_retryable=True) from None
        if request.count > site.max_nodes:
            message = f"count: {request.count} is more than {site.name}'s max_nodes ({site.max_nodes})"
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("failed")])
            self._step("failed", f"InvalidInput: {message}")
            raise ApplicationError(message, {"field": "count"}, type="InvalidInput", non_retryable=True)

    async def _fan_out(self, request: NodeJoinInput) -> NodeJoinResult:
        self._step("joining", f"{request.count} nodes at {request.site}")
        base = workflow.info().workflow_id
        single = request.model_copy(update={"count": 1})
        children = [
            workflow.execute_child_workflow(
                NodeJoin.run, single.model_dump(mode="json"), id=f"{base}/{i}",
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
        join_id = workflow.info().workflow_id
        timeouts = request.timeouts
        heartbeat = timedelta(seconds=timeouts.heartbeat_seconds)
        # A node name is never reused: a later join started with this same id names its node
        # anew, so an earlier machine's certificate for the old name never becomes a live node's.
        nonce = workflow.info().first_execution_run_id if (self._settled or workflow.patched(NAME_NONCE)) else ""
        node_name = node_name_for(request.site, join_id, nonce)
        # The provider's idempotency key too: the same id started again buys a new machine,
        # never the one an earlier run created (and may have deleted) under that key.
        provision_key = f"{join_id}#{nonce}" if nonce else join_id
        self._progress.node_name = node_name

        self._step("resolving site", request.site)
        fewer_steps = self._settled or workflow.patched(FEWER_STEPS)
        site: Site = await (workflow.execute_local_activity if fewer_steps else workflow.execute_activity)(
            "resolve_site", ResolveSiteInput(site=request.site), result_type=Site,
            start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY, summary=f"look up site {request.site}",
        )
        # A starter that knew the site set these at start (``sa.join_start_attributes``): upsert what differs.
        started_with = workflow.info().typed_search_attributes
        wanted = [(pair.key, node_name if pair.key == sa.NODE_NAME else pair.value)
                  for pair in sa.join_attributes(site.name, site.provider, site.account, join_id)]
        changed = [key.value_set(value) for key, value in wanted if started_with.get(key) != value]
        if changed:
            workflow.upsert_search_attributes(changed)

        self._step("provisioning", f"{site.instance_type} at {site.provider} {site.region}")
        bootstrap = self._settled or workflow.patched(BOOTSTRAP_IN_USER_DATA)
        spec = MachineSpec(
            name=node_name, site=site.name, region=site.region, instance_type=site.instance_type, gpu=site.gpu,
            gpus=site.gpus_per_machine, capacity_type=site.capacity_type, image=site.image,
            tags={"gpufleet.io/join": join_id, "gpufleet.io/site": site.name},
        )
        if bootstrap:
            provisioning = workflow.start_activity(
                "provision_joining_machine",
                ProvisionJoinInput(site=site.name, spec=spec, idempotency_key=provision_key,
                                   ttl_seconds=request.token_ttl_seconds),
                result_type=ProvisionedMachine, start_to_close_timeout=timedelta(seconds=timeouts.provision_seconds),
                # The activity heartbeats while the provider creates the machine: a lost worker is
                # retried within the heartbeat timeout, under the same key (no second machine).
                heartbeat_timeout=heartbeat, retry_policy=PROVIDER_RETRY,
                summary=f"node-bound join token, then {site.instance_type} at {site.name} with it in its user data",
            )
        else:
            provisioning = workflow.start_activity(
                "provision_machine", ProvisionMachineInput(site=site.name, spec=spec, idempotency_key=provision_key),
                result_type=Machine, start_to_close_timeout=timedelta(seconds=timeouts.provision_seconds),
                heartbeat_timeout=heartbeat, retry_policy=PROVIDER_RETRY,
                summary=f"create {site.instance_type} at {site.name}",
            )
        provisioned: ProvisionedMachine | None = None
        try:
            # Shielded: a join cancelled mid-create must still learn the machine to delete it.
            result = await asyncio.shield(provisioning)
        except asyncio.CancelledError:
            result = await provisioning
            machine = result.machine if bootstrap else result
            self._progress.machine_id = machine.id
            await self._clean_up(site, machine, node_name)
            raise
        except ActivityError as error:
            # Every adapter looks the key up before it reports no capacity: then nothing is there. A
            # revoked account may not be called at all (rule 6): the sweep finds it once rotated.
            if (failure_type(error) not in ("NoCapacity", "BadCredentials")
                    and (self._settled or workflow.patched(RELEASE_FAILED_PROVISION))):
                await self._release_provision(site, spec, provision_key)
            if bootstrap:
                await self._revoke_node_tokens(node_name)
            raise
        if bootstrap:
            provisioned = result
            machine = provisioned.machine
        else:
            machine = result
        self._progress.machine_id = machine.id

        token: JoinTokenRef | None = provisioned.token if provisioned else None
        told_site = False
        labels = {LABEL_SITE: site.name, LABEL_PROVIDER: site.provider, LABEL_REGION: site.region,
                  LABEL_GPU_PRODUCT: site.gpu}
        labelled = False
        try:
            deadline = workflow.now() + timedelta(seconds=timeouts.registration_seconds)
            if provisioned is not None:
                labelled = fewer_steps
                self._step("waiting for registration", f"until {timeouts.registration_seconds:.0f}s; "
                           "its certificate only for its own name, providerID and addresses its machine's"
                           + ("; then labelled, tainted unproven until the smoke test passes" if labelled else ""))
                await workflow.execute_activity(
                    "await_registration",
                    AwaitRegistrationInput(site=site.name, node_name=node_name, machine_id=machine.id,
                                           provider_id=provisioned.provider_id, join_id=join_id, deadline=deadline,
                                           labels=labels if labelled else {},
                                           add_taints=[UNPROVEN_TAINT] if labelled else []),
                    result_type=Node, start_to_close_timeout=timedelta(seconds=timeouts.registration_seconds + 60),
                    heartbeat_timeout=heartbeat, retry_policy=CLUSTER_RETRY,
                    summary=f"approve {node_name}'s certificate, wait for it to register, delete its token"
                            + (", label site/provider/region/GPU, taint unproven" if labelled else ""),
                )
                token = None  # deleted by the activity the moment the node registered
            else:
                self._step("issuing join token")
                token = await workflow.execute_activity(
                    "issue_join_token",
                    IssueJoinTokenInput(node_name=node_name, machine_id=machine.id,
                                        ttl_seconds=request.token_ttl_seconds),
                    result_type=JoinTokenRef, start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                    summary="single-use join token, handed to the machine",
                )

                self._step("waiting for registration", f"until {timeouts.registration_seconds:.0f}s")
                deadline = workflow.now() + timedelta(seconds=timeouts.registration_seconds)
                await workflow.execute_activity(
                    "wait_for_registration", WaitForRegistrationInput(node_name=node_name, deadline=deadline),
                    result_type=Node, start_to_close_timeout=timedelta(seconds=timeouts.registration_seconds + 60),
                    heartbeat_timeout=heartbeat, retry_policy=CLUSTER_RETRY,
                    summary=f"wait for {node_name} to register",
                )
            if not labelled:
                workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("registered")])
                self._step("labelling", "unproven taint until the smoke test passes")
                await workflow.execute_activity(
                    "prepare_node", PrepareNodeInput(node_name=node_name, add_taints=[UNPROVEN_TAINT], labels=labels),
                    result_type=Node, start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                    summary="label site/provider/region/GPU, taint unproven",
                )

            self._step("smoke test", f"on {node_queue(node_name)}")
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("proving")])
            smoke = await smoke_test_node(
                node_name, site.gpus_per_machine, timeout_seconds=timeouts.smoke_test_seconds, heartbeat=heartbeat,
                summary="GPUs visible, counters clean, compute check", include_state=True,
            )
            if not smoke.passed:
                raise ApplicationError(
                    f"smoke test failed on {node_name}: " + "; ".join(smoke.failures),
                    {"failures": smoke.failures}, type="SmokeTestFailed", non_retryable=True,
                )

            self._step("admitting", "remove the unproven taint")
            if self._settled or workflow.patched(ADMIT_TELLS_SITE):
                # The token was spent at registration: revoking it need not wait for the admission.
                await asyncio.gather(
                    workflow.execute_activity(
                        "admit_node", AdmitNodeInput(node_name=node_name, site=site.name, machine_id=machine.id,
                                                   first_state=smoke.state),
                        result_type=Node, start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
                        summary="admit: remove unproven taint, tell the Site entity",
                    ),
                    *([self._revoke(token)] if token is not None else []),
                )
                token, told_site = None, True
            elif self._settled or workflow.patched("admit-together"):
                await asyncio.gather(self._untaint(node_name), self._revoke(token),
                                     self._tell_site(site.name, node_name, machine.id, "ready"))
                token, told_site = None, True
            else:
                await self._untaint(node_name)
        except (FailureError, asyncio.CancelledError):
            step = self._progress.step
            await self._clean_up(site, machine, node_name)
            self._progress.step = step  # report where it failed, not the clean-up
            raise
        finally:
            if token is not None:
                if provisioned is not None:
                    await self._revoke_node_tokens(node_name)  # and any other a retried attempt issued
                else:
                    await self._revoke(token)

        workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("ready")])
        if not told_site and (self._settled or workflow.patched("tell-site-entity")):
            await self._tell_site(site.name, node_name, machine.id, "ready")
        self._step("ready", f"{site.gpus_per_machine}x {site.gpu}")
        return JoinedNode(
            node_name=node_name, machine_id=machine.id, site=site.name, provider=site.provider,
            gpus=site.gpus_per_machine, account=site.account,
        )

    async def _untaint(self, node_name: str) -> None:
        """Admission before ``admit-tells-site``: the taint lifted by the generic node patch."""
        await workflow.execute_activity(
            "prepare_node", PrepareNodeInput(node_name=node_name, labels={}, remove_taints=[UNPROVEN_TAINT]),
            result_type=Node, start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY,
            summary="admit: remove unproven taint",
        )

    async def _tell_site(self, site: str, node_name: str, machine_id: str, state: str) -> None:
        """Tell the Site entity (when it runs; the reconcile sweep starts it) about a transition."""
        try:
            await workflow.get_external_workflow_handle(site_workflow_id(site)).signal(
                "node_transition", {"node_name": node_name, "state": state, "machine_id": machine_id}
            )
        except Exception:  # noqa: BLE001 - no Site entity running: it counts the cluster when it starts
            pass

    async def _release_provision(self, site: Site, spec: MachineSpec, provision_key: str) -> None:
        step = self._progress.step
        self._step("cleaning up", "deleting any machine an earlier attempt created")
        try:
            await workflow.execute_activity(
                "release_provision", ReleaseProvisionInput(site=site.name, name=spec.name, idempotency_key=provision_key),
                result_type=list[str], start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY,
                summary=f"delete any machine created as {spec.name}",
            )
        except ActivityError as error:
            # The sweep is the bound on this leak: it finds the machine by its marker later.
            workflow.logger.warning("could not look for a machine created as %s: %s", spec.name,
                                    failure_message(error))
        self._progress.step = step  # report where it failed, not the clean-up

    async def _clean_up(self, site: Site, machine: Machine, node_name: str) -> None:
        """Never leave a machine behind: machine deleted, node object out."""
        self._step("cleaning up", f"deleting machine {machine.id}")
        if self._settled or workflow.patched(MACHINE_FIRST):
            failed = []
            try:
                await workflow.execute_activity(
                    "delete_machine", DeleteMachineInput(site=site.name, machine_id=machine.id),
                    start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY,
                    summary=f"delete machine {machine.id}",
                )
            except ActivityError as error:
                failed.append(f"machine {machine.id}: {failure_message(error)}")
            finally:
                try:
                    await workflow.execute_activity(
                        "remove_node", RemoveNodeInput(node_name=node_name), start_to_close_timeout=QUICK,
                        retry_policy=CLUSTER_RETRY, summary=f"remove node {node_name}",
                    )
                except ActivityError as error:
                    failed.append(f"node {node_name}: {failure_message(error)}")
            if failed:
                workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("needs-person")])
                workflow.logger.error("clean-up incomplete: %s", "; ".join(failed))
            return
        try:
            await workflow.execute_activity(
                "remove_node", RemoveNodeInput(node_name=node_name), start_to_close_timeout=QUICK,
                retry_policy=CLUSTER_RETRY, summary=f"remove node {node_name}",
            )
            await workflow.execute_activity(
                "delete_machine", DeleteMachineInput(site=site.name, machine_id=machine.id),
                start_to_close_timeout=QUICK, retry_policy=PROVIDER_RETRY, summary=f"delete machine {machine.id}",
            )
        except ActivityError as error:
            workflow.upsert_search_attributes([sa.FLEET_STATE.value_set("needs-person")])
            workflow.logger.error("could not delete machine %s: %s", machine.id, failure_message(error))

    async def _revoke_node_tokens(self, node_name: str) -> None:
        try:
            await workflow.execute_activity(
                "revoke_node_tokens", RevokeNodeTokensInput(node_name=node_name), result_type=list[str],
                start_to_close_timeout=QUICK, retry_policy=CLUSTER_RETRY, summary="delete the node's join tokens",
            )
        except ActivityError as error:
            # Each token expires within the hour anyway, and is good only for this node's name.
            workflow.logger.warning("could not delete the join tokens of %s: %s", node_name, failure_message(error))

    async def _revoke(self, token: JoinTokenRef) -> None:
        await workflow.execute_activity(
            "revoke_join_token", RevokeJoinTokenInput(token_id=token.token_id), start_to_close_timeout=QUICK,
            retry_policy=CLUSTER_RETRY, summary="revoke the join token",
        )
