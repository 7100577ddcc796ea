"""Control-plane activities: provider and cluster calls, each one thin.

Run by the control-plane worker on task queue ``gpufleet``. Secrets (provider
credentials, join-token values) exist only inside these functions.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone

from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from activities import metrics
from activities.address_memo import Answer, Key
from activities.capacity import heartbeating, reports_account
from activities.env import FleetEnv
from activities.errors import typed_errors
from activities.ledger import record_join_async, record_retire
from activities.waiting import poll_until
from fleet.messages.nodes import (
    AwaitRegistrationInput,
    ProvisionedMachine,
    ProvisionJoinInput,
    RevokeNodeTokensInput,
    AdmitNodeInput,
    DeleteMachineInput,
    MAX_ENTITY_STARTS,
    MAX_STARTED_NAMED,
    NodeEntitiesStarted,
    StartedEntity,
    StoppedSpotReclaims,
    ReleaseProvisionInput,
    RemoveNodeInput,
    ResolveSiteInput,
    SiteConfigured,
)
from fleet import search_attributes as sa
from fleet.config import Site
from fleet.messages.csr import CsrApproverResult, named_verdicts
from fleet.messages.repair import NodeEntityInput
from fleet.errors import FleetError, InvalidRequest, NotFound, ProviderError
from fleet.cluster import NODE_IDENTITY_KIND, NodeIdentity, gpufleet_provider_id
from providers.cluster.base import AddressLookup, Reported
from providers.cluster.bootstrap import BootstrapError, BootstrapToken, JoinParams, render_user_data
from fleet.models import CapacityType, Node
from fleet.naming import node_workflow_id, reclaim_workflow_id, site_workflow_id
from fleet.watched import closed_as, nodes_under_repair, retiring, running_node_entities, unwatched_nodes
from fleet.site_use import sites_in_use
from fleet.cluster import FLEET_TAINT, LABEL_SITE, LABEL_ZONE, UNPROVEN_TAINT
from fleet.contracts import workflows as flows

#: How long the site sweep leaves a stopped spot machine to a person who cancelled or terminated its
#: node's SpotReclaim (``reclaim/<node>``), e.g. to start the machine again: the pass does not start
#: another before, and says so. Started again and Ready, its node is not looked at at all; still
#: stopped after this, it is reclaimed as any other.
RECLAIM_LEFT_TO_A_PERSON = timedelta(hours=6)


def bootstrap_user_data(cluster, token: BootstrapToken, node_name: str, provider_id: str, site: str) -> str:
    """The machine's cloud-config (holds the token's secret: never returned, logged or raised)."""
    endpoint, ca_data = cluster.bootstrap_endpoint()
    try:
        return render_user_data(JoinParams(api_server=endpoint, ca_data=ca_data, token=token.value,
                                           node_name=node_name, provider_id=provider_id, site=site))
    except BootstrapError as error:
        raise InvalidRequest(str(error), code="bootstrap") from None


def machine_addresses(env: FleetEnv, joining: dict[str, tuple[str, str]] | None = None) -> "MachineAddresses":
    """node → the addresses the provider reports for its machine (None: not a gpufleet node,
    or nothing to check against). The machine comes from ``joining`` (a join in flight:
    node → (site, machine id)) or from the node's identity record, never from the node.
    The provider's answer is kept a while (``env.address_memo``): a pass runs every second for
    each wait in flight, and a node's requests decide which of them ask. ``fresh=True`` asks the
    provider now (its answer kept for the passes after). As a CSR pass's ``AddressLookup`` it says
    which answers were kept, and rechecks one a serving request finds out of date."""
    return MachineAddresses(env, joining or {})


class MachineAddresses(AddressLookup):
    """``machine_addresses``: the provider's answers through the worker's ``AddressMemo``."""

    def __init__(self, env: FleetEnv, joining: dict[str, tuple[str, str]]) -> None:
        self.env, self.joining = env, joining

    def __call__(self, node_name: str, fresh: bool = False) -> list[str] | None:
        found = self._answer(node_name, fresh)
        return found[1].addresses if found is not None else None

    def reported(self, node: str) -> Reported:
        found = self._answer(node)
        if found is None:
            return Reported()
        key, answer = found
        return Reported(tuple(answer.addresses or ()), kept=answer.kept, token=(key, answer))

    def recheck(self, node: str, held: Reported) -> Reported:
        if held.token is None:
            return held  # not a gpufleet node's (nothing was asked)
        key, answer = held.token
        answer = self.env.address_memo.recheck(key, self._ask(key), answer)
        return Reported(tuple(answer.addresses or ()), kept=answer.kept, token=(key, answer))

    def _answer(self, node_name: str, fresh: bool = False) -> tuple[Key, Answer] | None:
        site, machine_id = self.joining.get(node_name, ("", ""))
        if not machine_id:
            identity = self.env.cluster.node_identity(node_name)
            if identity is None:
                return None
            site, machine_id = identity.site, identity.machine_id
        key = (node_name, site, machine_id)
        return key, self.env.address_memo.answer(key, self._ask(key), fresh=fresh)

    def _ask(self, key: Key):
        _node, site, machine_id = key

        def ask() -> list[str] | None:
            try:
                return self.env.provider(site).get_machine(machine_id).addresses or None
            except (ProviderError, InvalidRequest):
                return None

        return ask


class ControlPlaneActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env

    def all(self) -> list:
        return [
            self.resolve_site,
            self.site_configured,
            self.provision_joining_machine,
            self.await_registration,
            self.revoke_node_tokens,
            self.approve_node_csrs,
            self.release_provision,
            self.delete_machine,
            self.admit_node,
            self.ensure_node_entities,
            self.reclaim_stopped_spot,
            self.remove_node,
        ]

    # -- provider ---------------------------------------------------------------------
    @activity.defn
    @typed_errors
    def resolve_site(self, input: ResolveSiteInput) -> Site:
        """The site's config, or InvalidRequest naming ``site`` when unknown."""
        return self.env.site(input.site)

    @activity.defn
    @typed_errors
    def site_configured(self, input: ResolveSiteInput) -> SiteConfigured:
        """Whether this worker's config names the site; where it does not, what the cluster still
        has there (nodes, identity records of nodes gone), as ``gpufleet config check --fleet``
        reads it. Listed only for a site that is not named: a Site entity asks once one of its
        activities refused its site as unknown."""
        if any(s.name == input.site for s in self.env.config.sites):
            return SiteConfigured(configured=True)
        cluster = self.env.cluster
        # Records first, as the identity sweep reads them: one written meanwhile has its node listed.
        records = cluster.list_state(NODE_IDENTITY_KIND)
        use = sites_in_use(cluster.list_nodes(), records).get(input.site)
        if use is None:
            return SiteConfigured(configured=False)
        return SiteConfigured(configured=False, nodes=list(use.nodes), gone=list(use.gone))

    @activity.defn
    @typed_errors
    @reports_account(lambda input: input.site, lambda input: input.spec.instance_type if input.spec else None)
    def provision_joining_machine(self, input: ProvisionJoinInput) -> ProvisionedMachine:
        """The site looked up (an unknown one is refused before anything is bought), the token
        (kept under the join's id: a retry renders the same user data, and a machine found by the
        key carries it already), then the machine with its bootstrap document in the provider's
        user data. Only the token's id leaves this activity, with the site's facts."""
        site = self.env.site(input.site)
        spec = input.spec or site.machine_spec(input.name, input.tags)
        self.env.check_account(input.site, spec.instance_type)
        node_name = spec.name
        token = self.env.cluster.issue_bootstrap_token(node_name, input.idempotency_key, input.ttl_seconds)
        provider_id = gpufleet_provider_id(site.provider, site.account, node_name)
        user_data = bootstrap_user_data(self.env.cluster, token, node_name, provider_id, input.site)
        with metrics.capacity_attempt(site.provider, input.site):
            machine = self.env.provider(input.site).create_machine(spec, input.idempotency_key, user_data=user_data)
        return ProvisionedMachine(machine=machine, token=token.ref, provider_id=provider_id, site=site)

    @activity.defn
    @typed_errors
    def await_registration(self, input: AwaitRegistrationInput) -> Node:
        """Approve the kubelet's certificate (only for the node its token was issued for),
        wait until the node registers and is Ready, delete its token at once, and admit the
        registration only if it is this join's machine: its providerID the one the user
        data named and, where the provider reports addresses, its addresses the machine's.
        A mismatch is ``RegistrationMismatch`` (the join deletes the machine). A match is
        recorded as the node's identity, which no node can write."""
        cluster = self.env.cluster
        addresses = machine_addresses(self.env, {input.node_name: (input.site, input.machine_id)})

        def registered() -> Node | None:
            cluster.review_csrs(addresses)
            node = cluster.get_node(input.node_name)
            return node if node is not None and node.ready else None

        node = poll_until(registered, input.deadline, input.poll_seconds, lambda: ApplicationError(
            f"node {input.node_name} did not register by {input.deadline.isoformat()}",
            type="RegistrationTimeout", non_retryable=True,
        ))
        # The kubelet holds its own certificate now: the token has nothing left to do.
        cluster.revoke_node_tokens(input.node_name)
        problems = []
        if node.provider_id != input.provider_id:
            problems.append(f"providerID {node.provider_id or '(none)'!r} is not {input.provider_id!r}")
        reported = addresses(input.node_name, fresh=True) or []  # the machine as it is now, not as a pass kept it
        if reported and (not node.addresses or not set(node.addresses) <= set(reported)):
            problems.append(f"addresses {sorted(node.addresses)} are not the machine's {sorted(reported)}")
        if problems:
            raise ApplicationError(
                f"node {input.node_name} registered but is not machine {input.machine_id}: " + "; ".join(problems),
                {"node_name": input.node_name, "machine_id": input.machine_id},
                type="RegistrationMismatch", non_retryable=True,
            )
        site = self.env.site(input.site)
        identity = NodeIdentity(node_name=input.node_name, machine_id=input.machine_id, provider=site.provider,
                                account=site.account, site=site.name, provider_id=input.provider_id,
                                join_id=input.join_id)
        cluster.update_state(NODE_IDENTITY_KIND, input.node_name, lambda _old: identity.state())
        cluster.review_csrs(addresses)  # a serving CSR waiting for the identity
        if input.labels or input.add_taints:
            return self._label_and_taint(input.node_name, input.labels, add=input.add_taints)
        return cluster.get_node(input.node_name) or node

    @activity.defn
    @typed_errors
    def revoke_node_tokens(self, input: RevokeNodeTokensInput) -> list[str]:
        """Every join token issued for the node (a join that failed before registration)."""
        return self.env.cluster.revoke_node_tokens(input.node_name)

    @activity.defn
    @typed_errors
    async def approve_node_csrs(self) -> CsrApproverResult:
        """gpufleet's CSR approver, one pass (kubelet certificate renewals, serving CSRs), for the
        ``CsrApprover`` workflow (woken by its CSR watch): what it decided and why. Each decision
        is also a condition on its CSR. The pass lists every CSR and every machine of the fleet
        (provider calls): it runs in a thread and heartbeats meanwhile when the workflow asks for
        it, so a lost worker's pass is retried within the heartbeat timeout."""
        env = self.env
        decisions = await heartbeating(asyncio.to_thread(
            lambda: env.cluster.review_csrs(machine_addresses(env))))
        for d in decisions:
            activity.logger.info("CSR %s from %s %s: %s", d.name, d.requester,
                                 "approved" if d.approve else "denied", d.reason)
        approved = sum(d.approve for d in decisions)
        return CsrApproverResult(decided=named_verdicts(decisions), approved=approved, denied=len(decisions) - approved)

    @activity.defn
    @typed_errors
    @reports_account(lambda input: input.site)
    def release_provision(self, input: ReleaseProvisionInput) -> list[str]:
        """After a failed provision: delete what an earlier attempt may have created under the
        key (it timed out after the provider made the machine, a later attempt then failed).
        Looked up by name among the fleet-marked machines; returns the ids deleted (or queued)."""
        found = [m for m in self.env.provider(input.site).list_machines()
                 if m.owned and m.name == input.name and m.state != "terminated"]
        for machine in found:
            self._delete(input.site, machine.id)
        return [m.id for m in found]

    def _delete(self, site: str, machine_id: str) -> None:
        try:
            deleted = self.env.delete_machine(site, machine_id)
        except NotFound:
            return  # nothing there: the delete is done (an earlier attempt, or the provider, got it)
        if not deleted:
            activity.logger.warning("delete of %s queued until the credentials of %s are rotated", machine_id,
                                    self.env.site(site).account)

    @activity.defn
    @typed_errors
    @reports_account(lambda input: input.site)
    def delete_machine(self, input: DeleteMachineInput) -> None:
        self._delete(input.site, input.machine_id)
        record_retire(self.env, input.site, input.machine_id)

    # -- cluster ----------------------------------------------------------------------
    def _label_and_taint(self, node_name: str, labels: dict[str, str], *, add: list[str]) -> Node:
        cluster = self.env.cluster
        labels = dict(labels)
        add = list(add)
        if LABEL_SITE in labels:  # a site is a topology zone (same-site Services, README "Network model")
            labels[LABEL_ZONE] = labels[LABEL_SITE]
            # A GPU node of a site keeps the fleet taint, whether or not its kubelet registered
            # with it (a site's own bootstrap template): the control plane must never land there.
            if FLEET_TAINT not in add:
                add.append(FLEET_TAINT)
        if labels:
            cluster.label_node(node_name, labels)
        return cluster.set_taints(node_name, add=add)

    @activity.defn
    @typed_errors
    async def admit_node(self, input: AdmitNodeInput) -> Node:
        """Lift the unproven taint, then tell the Site entity the node is ready.

        Told from here rather than by a signal from the join: the server carries out a
        workflow's signal as a task of the join's own, and when no Site entity runs it
        writes the failure back into the join's history (about 12 ms of server CPU per
        join under bench/join_overhead); a client signal is one lookup."""
        node = await asyncio.to_thread(self.env.cluster.set_taints, input.node_name, remove=[UNPROVEN_TAINT])
        await record_join_async(self.env, input.site, input.machine_id, input.node_name)
        # The node's entity starts here, labelled from the join's own record: the node itself
        # can no longer start or signal a workflow (node gateway), it answers the entity's watch.
        await self._start_node_entity(
            NodeEntityInput(node_name=input.node_name, site=input.site, settings=self.env.config.repair,
                            first_state=input.first_state),
            self.env.site(input.site).provider, WorkflowIDConflictPolicy.USE_EXISTING)
        transition = {"node_name": input.node_name, "state": "ready", "machine_id": input.machine_id}
        try:
            await activity.client().get_workflow_handle(site_workflow_id(input.site)).signal(flows.Site.node_transition, transition)
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            # No Site entity running: it counts the cluster when it starts.
        return node

    async def _start_node_entity(self, entity: NodeEntityInput, provider: str,
                                 conflict: WorkflowIDConflictPolicy) -> None:
        await activity.client().start_workflow(
            flows.Node.TYPE, entity, id=node_workflow_id(entity.node_name),
            task_queue=activity.info().task_queue, id_conflict_policy=conflict,
            search_attributes=TypedSearchAttributes([
                SearchAttributePair(sa.SITE, entity.site), SearchAttributePair(sa.NODE_NAME, entity.node_name),
                SearchAttributePair(sa.PROVIDER, provider)]),
            static_summary=f"node {entity.node_name}: health, repairs",
        )

    @activity.defn
    @typed_errors
    async def ensure_node_entities(self) -> NodeEntitiesStarted:
        """Start the entity of every node that must have one running and has none
        (``fleet.watched.unwatched_nodes``: Ready, or NotReady under a running GpuRepair, which waits
        for an entity to take its request for the node's action slot over; proven, joined by
        gpufleet and not retired, not cordoned by a retirement): terminated or failed, nothing else
        would start it again. From the join's identity record, as ``admit_node`` starts it: its site
        and provider, the config's repair settings. One visibility list and one list of nodes a
        pass, a second visibility list (the running repairs) only where a NotReady node has no
        entity; a describe and a start only for a node the lists leave out. Each start is logged
        with how the run before ended, and the new run's log says so too."""
        client, queue = activity.client(), activity.info().task_queue
        running = await running_node_entities(client, queue)
        cluster = self.env.cluster
        nodes = await asyncio.to_thread(cluster.list_nodes)
        not_ready = {n.name for n in nodes if not n.ready and n.name not in running}
        under_repair = await nodes_under_repair(client, queue) if not_ready else set()
        unwatched = await asyncio.to_thread(lambda: unwatched_nodes(cluster, nodes, running, under_repair))
        done = NodeEntitiesStarted(running=len(running), left=max(0, len(unwatched) - MAX_ENTITY_STARTS))
        for identity in unwatched[:MAX_ENTITY_STARTS]:
            entity_id = node_workflow_id(identity.node_name)
            try:
                before = await client.get_workflow_handle(entity_id).describe()
            except RPCError as error:
                if error.status != RPCStatusCode.NOT_FOUND:
                    raise
                before = None
            if before is not None and before.status == WorkflowExecutionStatus.RUNNING:
                continue  # started since the list (a join admitting it): visibility lagged
            started = StartedEntity(node_name=identity.node_name, site=identity.site,
                                    was=closed_as(before.status) if before else "none",
                                    closed_at=before.close_time if before else None)
            how = (f"its run before was {started.was} at {started.closed_at:%Y-%m-%d %H:%M:%S} UTC"
                   if started.closed_at else "Temporal has no run of it on record")
            if identity.node_name in not_ready:  # listed for its repair alone
                how += "; its node is NotReady and a GpuRepair of it runs, waiting for the entity"
            try:
                # FAIL on a running one: one started meanwhile is kept, and not counted as ours.
                await self._start_node_entity(
                    NodeEntityInput(node_name=identity.node_name, site=identity.site, settings=self.env.config.repair,
                                    started_again=f"started again by the site sweep: {how}"),
                    identity.provider, WorkflowIDConflictPolicy.FAIL)
            except WorkflowAlreadyStartedError:
                continue
            activity.logger.warning("node %s (%s) had no running entity (%s): %s started again", identity.node_name,
                                    identity.site, how, entity_id)
            done.started += 1
            if len(done.named) < MAX_STARTED_NAMED:
                done.named.append(started)
        return done

    @activity.defn
    @typed_errors
    async def reclaim_stopped_spot(self) -> StoppedSpotReclaims:
        """Start the SpotReclaim (``reclaim/<node>``, terminating now) of every spot node that is
        NotReady while its provider reports its machine stopped or terminated: the provider took it
        without a notice the node agent read (Nebius posts none; an agent that was down missed one).
        Without it the node stayed, NotReady and counted toward its site's min_nodes, until a person
        acted. A reclaim already running is left alone, and so is a node a GpuRepair works on (its
        reboot stops the machine) and one whose last reclaim a person cancelled or terminated
        (to start the machine again, say: before, every pass started another) while
        ``_left_to_a_person`` holds it. Spot, site and machine come from the join's identity record and
        the site's config, never from the node; an on-demand machine stopped may be a person's doing
        and is left as it is. One list of nodes a pass; one provider list for each spot site that
        has such a node; a visibility list of the running repairs only where one was found, and a
        describe of each such node's reclaim."""
        done = StoppedSpotReclaims()
        stopped = await asyncio.to_thread(self._stopped_spot_nodes, done)
        if not stopped:
            return done
        client = activity.client()
        repairing = {wf.typed_search_attributes.get(sa.NODE_NAME) async for wf in client.list_workflows(
            f'WorkflowType = "{flows.GpuRepair.TYPE}" AND ExecutionStatus = "Running"')}
        for identity, ready_changed_at, state in stopped:
            node = identity.node_name
            if node in repairing:
                done.repairing.append(node)
                continue
            last = await self._last_reclaim(client, node)
            if last is not None and last.status == WorkflowExecutionStatus.RUNNING:
                done.running.append(node)
                continue
            if last is not None and (held := self._left_to_a_person(node, last, state, ready_changed_at)):
                done.left_to_a_person.append(held)
                continue
            try:
                await client.start_workflow(
                    flows.SpotReclaim.TYPE,
                    {"node_name": node, "site": identity.site, "machine_id": identity.machine_id,
                     # The machine is gone already: the drain is short and the replacement bought now.
                     "terminate_at": time.time()},
                    id=reclaim_workflow_id(node), task_queue=activity.info().task_queue,
                    id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                    static_summary=f"spot reclaim of {node}: its machine stopped without a notice; replace it",
                )
            except WorkflowAlreadyStartedError:
                done.running.append(node)
                continue
            activity.logger.warning("node %s (%s): machine %s stopped by its provider without a notice: %s started",
                                    node, identity.site, identity.machine_id, reclaim_workflow_id(node))
            done.started.append(node)
        return done

    @staticmethod
    async def _last_reclaim(client, node: str):
        """The describe of the node's last ``reclaim/<node>`` run; None where Temporal has none."""
        try:
            return await client.get_workflow_handle(reclaim_workflow_id(node)).describe()
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            return None

    @staticmethod
    def _left_to_a_person(node: str, last, state: str, ready_changed_at: datetime | None) -> str:
        """Why the pass leaves the node's stopped machine alone, until when: its last reclaim was
        cancelled or terminated (a person's doing: the sweep and the Node entity only start one)
        less than ``RECLAIM_LEFT_TO_A_PERSON`` ago, its machine is stopped (a terminated one
        cannot be started again: held, it stayed NotReady and unreplaced, counted toward
        min_nodes), and its node has not been Ready since (its Ready condition last changed before
        the reclaim ended; a person who started the machine again is done with it, and a second
        stop is the provider's, reclaimed at once). "" otherwise. Where the cluster does not say
        when the node's Ready last changed, the reclaim's end decides alone. The time is the
        node's own status, written by its kubelet or the node controller: it decides only
        whether this node's own machine is reclaimed now or after the hold."""
        if state != "stopped":
            return ""
        if last.status not in (WorkflowExecutionStatus.CANCELED, WorkflowExecutionStatus.TERMINATED):
            return ""
        if last.close_time is None or datetime.now(timezone.utc) >= last.close_time + RECLAIM_LEFT_TO_A_PERSON:
            return ""
        if ready_changed_at is not None and ready_changed_at > last.close_time:
            return ""
        until = last.close_time + RECLAIM_LEFT_TO_A_PERSON
        return (f"{node} (its reclaim was {closed_as(last.status)} at {last.close_time:%Y-%m-%d %H:%M} UTC: "
                f"not started again before {until:%Y-%m-%d %H:%M} UTC while its machine stays stopped)")

    def _stopped_spot_nodes(self, done: StoppedSpotReclaims) -> list[tuple[NodeIdentity, datetime | None, str]]:
        """(identity record, when its node's Ready last changed, the machine's state) of each spot
        node NotReady whose machine its provider reports stopped or terminated; each site whose
        provider did not answer goes to ``done.skipped``."""
        env, cluster = self.env, self.env.cluster
        spot = {s.name for s in env.config.sites if s.capacity_type == CapacityType.SPOT}
        records = cluster.list_state(NODE_IDENTITY_KIND)
        at: dict[str, list[tuple[NodeIdentity, datetime | None]]] = {}
        for node in sorted(cluster.list_nodes(), key=lambda n: n.name):
            identity = NodeIdentity.from_state(records.get(node.name, {}))
            if node.ready or identity is None or not identity.machine_id or identity.site not in spot:
                continue
            if retiring(cluster, node):
                continue  # its retirement (or reclaim) deletes the machine on purpose
            at.setdefault(identity.site, []).append((identity, node.ready_changed_at))
        found = []
        for site, identities in at.items():
            try:
                states = {m.id: m.state for m in env.provider(site).list_machines()}
            except FleetError as error:
                done.skipped.append(f"{site}: {error.type_name}: {str(error)[:300]}")
                continue
            except Exception as error:  # noqa: BLE001 - one site's provider must not hide the others
                # Not one of our typed errors, whose messages are written not to quote a request.
                done.skipped.append(f"{site}: {type(error).__name__}")
                continue
            found += [(i, changed, states[i.machine_id]) for i, changed in identities
                      if states.get(i.machine_id) in ("stopped", "terminated")]
        return found

    @activity.defn
    @typed_errors
    def remove_node(self, input: RemoveNodeInput) -> None:
        self.env.cluster.remove_node(input.node_name)
