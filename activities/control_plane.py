"""Control-plane activities: provider and cluster calls, each one thin.

Run by the control-plane worker on task queue ``gpufleet``. Secrets (provider
credentials, join-token values) exist only inside these functions.
"""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities import metrics
from activities.capacity import reports_account
from activities.env import FleetEnv
from activities.errors import typed_errors
from activities.ledger import record_join_async, record_retire
from activities.waiting import poll_until
from activities.models import (
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
from fleet.config import Site
from fleet.errors import NotFound
from fleet.models import Machine, Node
from fleet.naming import site_workflow_id
from fleet.cluster import LABEL_SITE, LABEL_ZONE, UNPROVEN_TAINT, JoinTokenRef


class ControlPlaneActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env

    def all(self) -> list:
        return [
            self.resolve_site,
            self.provision_machine,
            self.release_provision,
            self.delete_machine,
            self.issue_join_token,
            self.revoke_join_token,
            self.wait_for_registration,
            self.prepare_node,
            self.admit_node,
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
    @reports_account(lambda input: input.site, lambda input: input.spec.instance_type)
    def provision_machine(self, input: ProvisionMachineInput) -> Machine:
        self.env.check_account(input.site, input.spec.instance_type)  # blocked account/offer: no provider call
        with metrics.capacity_attempt(self.env.site(input.site).provider, input.site):
            return self.env.provider(input.site).create_machine(input.spec, input.idempotency_key)

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
    @activity.defn
    @typed_errors
    def issue_join_token(self, input: IssueJoinTokenInput) -> JoinTokenRef:
        return self.env.cluster.create_join_token(input.node_name, input.machine_id, input.ttl_seconds)

    @activity.defn
    @typed_errors
    def revoke_join_token(self, input: RevokeJoinTokenInput) -> None:
        self.env.cluster.revoke_join_token(input.token_id)

    @activity.defn
    @typed_errors
    def wait_for_registration(self, input: WaitForRegistrationInput) -> Node:
        """Poll the cluster until the node registers and is Ready, or the deadline."""

        def registered() -> Node | None:
            node = self.env.cluster.get_node(input.node_name)
            return node if node is not None and node.ready else None

        return poll_until(registered, input.deadline, input.poll_seconds, lambda: ApplicationError(
            f"node {input.node_name} did not register by {input.deadline.isoformat()}",
            type="RegistrationTimeout", non_retryable=True,
        ))

    @activity.defn
    @typed_errors
    def prepare_node(self, input: PrepareNodeInput) -> Node:
        """Our labels and taints on the node; touches no other key."""
        cluster = self.env.cluster
        labels = dict(input.labels)
        if LABEL_SITE in labels:  # a site is a topology zone (same-site Services, README "Network model")
            labels[LABEL_ZONE] = labels[LABEL_SITE]
        if labels:
            cluster.label_node(input.node_name, labels)
        return cluster.set_taints(input.node_name, add=input.add_taints, remove=input.remove_taints)

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
        transition = {"node_name": input.node_name, "state": "ready", "machine_id": input.machine_id}
        try:
            await activity.client().get_workflow_handle(site_workflow_id(input.site)).signal("node_transition", transition)
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            # No Site entity running: it counts the cluster when it starts.
        return node

    @activity.defn
    @typed_errors
    def remove_node(self, input: RemoveNodeInput) -> None:
        self.env.cluster.remove_node(input.node_name)
