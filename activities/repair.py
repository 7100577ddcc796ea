"""Control-plane activities of the GPU repair ladder: facts, contain, restart, retire.

Run by the control-plane worker. Node-local steps (GPU reset, driver
reinstall, smoke test) are in ``activities.node_agent``. Every activity here is
idempotent, so a retried attempt after a worker crash changes nothing twice.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

from temporalio import activity
from temporalio.client import WorkflowExecutionStatus, WorkflowQueryFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.capacity import heartbeat_from_body, reports_account, run_end
from activities.env import FleetEnv
from activities.errors import typed_errors
from activities.waiting import poll_until
from fleet.messages.nodes import (
    ContainInput,
    ContainResult,
    FenceInput,
    NodeFacts,
    NodeFactsInput,
    ReplacementSitesInput,
    RestartMachineInput,
    SiteHealth,
    SiteHealthInput,
    UncontainInput,
    UncontainResult,
    WaitForBootInput,
)
from fleet.contracts import workflows as flows
from fleet.errors import NotFound
from fleet.messages.repair import MAX_NODE_GPUS, GpuRepairResult, LadderState, LeftRepair, NodeLeft, RepairRef
from fleet.naming import node_workflow_id, repair_workflow_id
from fleet.repair_policy import Rung
from providers.base import PowersOff
from providers.cluster.base import NodeMarks, decide_on_node
from fleet.models import CapacityType, Node
from fleet.replacement import replacement_sites
from activities.control_plane import bootstrap_user_data, machine_addresses
from fleet.cluster import FENCE_ON_HOLD, FENCE_PREFIX, LABEL_SITE, MAX_JOIN_TOKEN_TTL_S, UNPROVEN_TAINT, fenced_gpus

#: On the Node: which restart was requested from which boot, ``<op>:<boot id>`` (``reboot`` or
#: ``reinstall``). A retried activity that finds its own op and ``boot_id_before`` asked already and
#: does not restart again, even when the node has not yet reported its new boot id (the kubelet
#: lags the machine); a reinstall after a reboot from the same boot (its new boot never came) is
#: another request.
RESTARTED_FROM = "gpufleet.io/restarted-from-boot"
#: A reinstall's wait for the old Node to go NotReady ends this long before the activity's own
#: timeout (the reinstall call still has to be made), polling this often.
NOT_READY_MARGIN = timedelta(seconds=20)
NOT_READY_POLL_SECONDS = 2.0
#: ``node_left``: a repair's ladder query, asked this many times (pausing 1 s, then 2 s) before the
#: activity fails; the workflow's timeouts for it (``NODE_LEFT_TIMEOUT``) fit these.
LADDER_QUERY_TRIES = 3
LADDER_QUERY_TIMEOUT = timedelta(seconds=10)
LADDER_QUERY_PAUSE_SECONDS = 1.0


def fence_key(gpu: int) -> str:
    return f"{FENCE_PREFIX}{gpu}"


def restart_requested(mark: str | None) -> tuple[str, str] | None:
    """``RESTARTED_FROM``'s value as (op, boot id). A bare boot id (written before the mark named
    its op) reads as a reboot's: a repair whose reboot ran before the upgrade still reinstalls
    after it. An old reinstall's mark read so can be requested once more by a retry; a second
    reinstall ends as one does, while a skipped one would leave the machine to be replaced."""
    if not mark:
        return None
    op, colon, boot_id = mark.partition(":")
    return (op, boot_id) if colon else ("reboot", mark)


class RepairActivities:
    def __init__(self, env: FleetEnv) -> None:
        self.env = env

    def all(self) -> list:
        return [
            self.node_facts,
            self.site_health,
            self.fence_gpu,
            self.contain_gpu,
            self.uncontain_gpu,
            self.reboot_machine,
            self.reinstall_machine,
            self.wait_for_boot,
            self.replacement_sites,
            self.node_left,
            self.repair_end,
        ]

    # -- facts ------------------------------------------------------------------------
    @activity.defn
    @typed_errors
    def node_facts(self, input: NodeFactsInput) -> NodeFacts:
        settings = self.env.config.repair
        node = self.env.cluster.get_node(input.node_name)
        if node is None:
            return NodeFacts(node_name=input.node_name, found=False, settings=settings)
        # Site, provider, account and machine: what the join recorded (the cluster port fills them
        # in from the node's identity record), never the node's own labels or annotations.
        site, machine_id = node.site, node.machine_id
        gpus, capacity_type = self._gpus_and_capacity(node)
        return NodeFacts(
            node_name=node.name, found=True, site=site, capacity_type=capacity_type,
            provider=node.provider, account=node.account, machine_id=machine_id, gpus=gpus,
            boot_id=node.boot_id, ready=node.ready,
            admitted=bool(site) and UNPROVEN_TAINT not in node.taints, settings=settings,
        )

    def _gpus_and_capacity(self, node: Node) -> tuple[int, CapacityType | None]:
        """How many GPUs the node has and its site's capacity type, as the config says (a site gone
        from it: the node's own count, no type)."""
        if node.site:
            try:
                configured = self.env.site(node.site)
                return configured.gpus_per_machine, configured.capacity_type
            except Exception:  # noqa: BLE001 - a site gone from the config: keep the node's count
                pass
        return node.gpus_allocatable, None

    @activity.defn
    @typed_errors
    async def node_left(self, input: NodeFactsInput) -> NodeLeft:
        """What a Node entity started again takes as its state, which the run before kept and took
        with it: the node's repairs still running, as Temporal shows them (a describe for each GPU the
        node has, a ladder query of each one running), then the GPUs fenced and the cordon, as the
        cluster does. Read in that order: a repair that un-fences and ends between the two reads is
        followed to its end, not its GPU held for a person as fenced; and a fenced GPU the first read
        found no repair of is read again, so a repair started meanwhile (by hand, say), which fenced it
        after that read, is followed too. The fences are on the node's own object: they decide only
        about this node, no GPU past its count is taken, and the rung in one is only shown
        (``NodeLeft.fenced``); one the entity wrote before its repair started (``FENCE_ON_HOLD``) is
        named in ``NodeLeft.on_hold``."""
        cluster = self.env.cluster
        node = await asyncio.to_thread(cluster.get_node, input.node_name)
        if node is None:
            return NodeLeft()
        gpus = min(self._gpus_and_capacity(node)[0], MAX_NODE_GPUS)
        found = await asyncio.gather(*(self._running_repair(input.node_name, gpu) for gpu in range(gpus)))
        try:
            marks = await asyncio.to_thread(cluster.node_marks, input.node_name)
        except NotFound:
            return NodeLeft()
        rungs = {rung.value for rung in Rung}
        fenced, on_hold = {}, []
        for index in fenced_gpus(marks.annotations):
            if not (index.isdigit() and int(index) < gpus):
                continue
            value = marks.annotations[fence_key(index)]
            rung = value.removesuffix(FENCE_ON_HOLD)
            fenced[int(index)] = rung if rung in rungs else ""
            if value.endswith(FENCE_ON_HOLD):
                on_hold.append(int(index))
        repairs = {repair.gpu: repair for repair in found if repair}
        again = await asyncio.gather(*(self._running_repair(input.node_name, gpu)
                                       for gpu in sorted(fenced) if gpu not in repairs))
        repairs.update((repair.gpu, repair) for repair in again if repair)
        return NodeLeft(found=True, fenced=fenced, on_hold=on_hold, cordoned=marks.unschedulable,
                        repairs=[repairs[gpu] for gpu in sorted(repairs)])

    async def _running_repair(self, node_name: str, gpu: int) -> LeftRepair | None:
        """The GPU's repair if it runs: its rung, and whether it waits for or holds the node's action
        slot (its ladder's step; only a repair the Node entity started asks for the slot)."""
        repair_id = repair_workflow_id(node_name, gpu)
        handle = activity.client().get_workflow_handle(repair_id)
        try:
            described = await handle.describe()
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
        activity.heartbeat()
        if described.status != WorkflowExecutionStatus.RUNNING:
            return None
        left = LeftRepair(gpu=gpu, repair_id=repair_id, rung=Rung.RESET, since=described.start_time)
        ladder = await self._ladder(handle)
        if ladder is None:
            return left  # not past its first step yet, or ended since the describe: followed all the same
        left.rung, left.reasons = ladder.rung, ladder.reasons[-20:]
        if described.parent_id != node_workflow_id(node_name):
            return left  # started by hand: it asks no Node entity for the slot
        if ladder.step == "waiting for the node":
            left.slot = "waiting"
        elif (ladder.step == "recovering" and not ladder.held and ladder.attempts
              and ladder.attempts[-1].outcome == "running"):
            # (Held, it may be past its action, waiting to prove: the slot is taken as free.)
            left.slot, left.since = "acting", ladder.attempts[-1].started_at
        return left

    @staticmethod
    async def _ladder(handle) -> LadderState | None:
        """The repair's ladder; None where its workflow answers that it cannot (its first task not
        run yet, or ended). A query the server does not answer is asked again: a repair followed
        with no step known is never queued for the slot it may wait for, and waits for good. Still
        unanswered, the activity fails and is retried whole."""
        for attempt in range(LADDER_QUERY_TRIES):
            try:
                return await handle.query(flows.GpuRepair.ladder, result_type=LadderState,
                                          rpc_timeout=LADDER_QUERY_TIMEOUT)
            except WorkflowQueryFailedError:
                return None
            except RPCError as error:
                if error.status == RPCStatusCode.NOT_FOUND:
                    return None
                if attempt + 1 == LADDER_QUERY_TRIES:
                    raise ApplicationError(f"{handle.id}: its ladder did not answer {LADDER_QUERY_TRIES} queries "
                                           f"({error.status.name if error.status else 'no status'})",
                                           type="LadderUnanswered") from None
                activity.heartbeat()
                await asyncio.sleep(LADDER_QUERY_PAUSE_SECONDS * (attempt + 1))
        return None

    @activity.defn
    async def repair_end(self, input: RepairRef) -> GpuRepairResult:
        """Wait for the repair to end (heartbeats meanwhile): its result. One that ended otherwise
        (cancelled, terminated, failed, no longer on record) fails this, saying how; not retried."""
        result, how = await run_end(input.repair_id, GpuRepairResult)
        if result is None:
            raise ApplicationError(how, type="RepairUnproven", non_retryable=True)
        return result

    @activity.defn
    @typed_errors
    def site_health(self, input: SiteHealthInput) -> SiteHealth:
        nodes = self.env.cluster.list_nodes({LABEL_SITE: input.site})
        others = [n for n in nodes if n.name != input.node_name]
        unhealthy = sum(1 for n in others if not n.ready or n.unschedulable)
        return SiteHealth(site=input.site, nodes=len(nodes), unhealthy_others=unhealthy)

    # -- contain ----------------------------------------------------------------------
    @activity.defn
    @typed_errors
    def contain_gpu(self, input: ContainInput) -> ContainResult:
        """Fence the GPU, then drain the node's pods honoring PodDisruptionBudgets.

        The cluster port cannot tell which pod holds which GPU, so pods are
        drained node-wide and the node is cordoned (``drain_node`` cordons
        first) for every rung; un-containing uncordons only when no GPU of the
        node is still fenced.
        """
        cluster = self.env.cluster
        cluster.annotate_node(input.node_name, {fence_key(input.gpu): input.rung})
        drain = getattr(cluster, "drain_node", None)
        if drain is None:
            cluster.cordon(input.node_name, True)
            return ContainResult()
        result = drain(input.node_name, input.drain_seconds, False, activity.heartbeat)
        return ContainResult(
            evicted=len(result.evicted), blocked=[f"{p.key}: {p.reason}" for p in result.blocked],
            completed=result.completed,
        )

    @activity.defn
    @typed_errors
    def fence_gpu(self, input: FenceInput) -> None:
        """Fence the GPU and cordon the node: no new pod lands there. Containment's first
        half, quick enough for a local activity; ``contain_gpu`` drains (and repeats both). The
        fence says it is the entity's, on hold (``FENCE_ON_HOLD``), until the repair's own replaces it."""
        cluster = self.env.cluster
        cluster.annotate_node(input.node_name, {fence_key(input.gpu): input.rung + FENCE_ON_HOLD})
        cluster.cordon(input.node_name, True)

    @activity.defn
    @typed_errors
    def uncontain_gpu(self, input: UncontainInput) -> UncontainResult:
        cluster = self.env.cluster
        cluster.annotate_node(input.node_name, {fence_key(input.gpu): None})

        def uncordon(marks: NodeMarks) -> UncontainResult:
            still = sorted(int(gpu) for gpu in fenced_gpus(marks.annotations))
            if still:
                return UncontainResult(uncordoned=False, still_fenced=still)
            # On the marks read: another GPU's repair that fences since refuses it, and is seen.
            cluster.cordon(input.node_name, False, version=marks.version)
            return UncontainResult(uncordoned=True)

        return decide_on_node(cluster, input.node_name, uncordon)

    # -- restart ----------------------------------------------------------------------
    def _restart(self, input: RestartMachineInput, op: str) -> str:
        """Each restart (reboot, reinstall) at most once per boot: a retry that finds the boot id
        changed, this restart already requested from this boot, or the machine already restarting,
        does not restart it again. A reinstall after this boot's reboot is not held back by that
        reboot's mark nor by the machine still rebooting: the reboot's wait for its new boot ran
        out, and a machine stuck in that boot is what the reinstall is for (every provider
        reinstalls a rebooting machine), so a retry cannot tell from the machine whether the
        reinstall was requested. The call that went through is recorded as the activity's
        heartbeat (``<op>:<boot id>``) before the mark is written: a retry finds it in its
        heartbeat details (the server hands an attempt the last one recorded) and does not call
        again. Before, a call that went through, its mark not written (the annotate failed),
        was requested again by the retry: Hetzner's rebuild wiped the machine twice. Not a mark
        written before the call: it cannot say whether the call then went through, and a retry
        that trusted it would never reinstall after a call that failed. Only a worker lost
        between the call and the heartbeat's send requests it again: twice converges, never
        does not."""
        provider = self.env.provider(input.site)
        cluster = self.env.cluster
        node = cluster.get_node(input.node_name)
        if node is not None and node.boot_id and node.boot_id != input.boot_id_before:
            return f"already restarted (boot {node.boot_id[:8]})"
        marks = self._annotations(input.node_name) if node is not None else {}
        requested = restart_requested(marks.get(RESTARTED_FROM))
        if input.boot_id_before and requested == (op, input.boot_id_before):
            return f"already requested from boot {input.boot_id_before[:8]}"
        this_restart = f"{op}:{input.boot_id_before}"
        if this_restart in activity.info().heartbeat_details:
            # An earlier attempt's call went through and its mark was not written: write it now.
            self._mark_restarted(node, input, this_restart)
            return f"already requested from boot {input.boot_id_before[:8]} by an earlier attempt"
        after_this_boots_reboot = op == "reinstall" and requested == ("reboot", input.boot_id_before)
        if not after_this_boots_reboot and provider.get_machine(input.machine_id).state in ("rebooting", "pending"):
            return "already restarting"
        identity = cluster.node_identity(input.node_name) if op == "reinstall" else None
        if identity is not None:
            # A reinstall wipes the kubelet's credentials: the machine joins again as the same
            # node with a fresh token in fresh user data (kept under this boot: a retry reuses it).
            token = cluster.issue_bootstrap_token(
                input.node_name, f"reinstall/{input.node_name}/{input.boot_id_before}", MAX_JOIN_TOKEN_TTL_S)
            try:
                user_data = bootstrap_user_data(cluster, token, input.node_name, identity.provider_id,
                                                identity.site)
                if isinstance(provider, PowersOff):
                    # kubeadm refuses to join while a Ready Node of its name exists: the old
                    # kubelet must be gone, and seen gone, before the machine boots again. The
                    # Node stays (its labels, taints and this repair's marks).
                    provider.stop_machine(input.machine_id)
                    self._until_not_ready(input.node_name)
                provider.reinstall_machine(input.machine_id, user_data=user_data)
            except Exception:
                cluster.revoke_join_token(token.token_id)  # never handed to a machine
                raise
        else:
            getattr(provider, f"{op}_machine")(input.machine_id)
        heartbeat_from_body(this_restart)  # seen by a retry whatever becomes of the mark
        self._mark_restarted(node, input, this_restart)
        return f"{op} requested"

    def _mark_restarted(self, node: Node | None, input: RestartMachineInput, restart: str) -> None:
        if node is None or not input.boot_id_before:
            return
        try:
            self.env.cluster.annotate_node(input.node_name, {RESTARTED_FROM: restart})
        except NotFound:
            pass  # the node went meanwhile: nothing left to mark

    def _until_not_ready(self, node_name: str) -> None:
        """Until the Node is NotReady (its controller marks it so a grace period after the
        kubelet's last heartbeat, 50 s by default), within this activity's time less a margin
        for the reinstall call; past that a retryable error (the machine stays off)."""
        info = activity.info()
        budget = info.start_to_close_timeout or timedelta(seconds=120)
        deadline = (info.started_time or datetime.now(timezone.utc)) + budget - NOT_READY_MARGIN
        deadline = max(deadline, datetime.now(timezone.utc) + timedelta(seconds=1))

        def not_ready() -> bool | None:
            node = self.env.cluster.get_node(node_name)
            return True if node is None or not node.ready else None

        poll_until(not_ready, deadline, NOT_READY_POLL_SECONDS, lambda: ApplicationError(
            f"node {node_name} still Ready at {deadline.isoformat()} with its machine powered off: kubeadm "
            "refuses to join over a Ready Node of the same name, so the reinstall waits (tried again)",
            type="NodeStillReady"))

    def _annotations(self, node_name: str) -> dict[str, str]:
        try:
            return self.env.cluster.annotate_node(node_name, {})
        except NotFound:
            return {}

    @activity.defn
    @typed_errors
    @reports_account(lambda input: input.site)
    def reboot_machine(self, input: RestartMachineInput) -> str:
        return self._restart(input, "reboot")

    @activity.defn
    @typed_errors
    @reports_account(lambda input: input.site)
    def reinstall_machine(self, input: RestartMachineInput) -> str:
        return self._restart(input, "reinstall")

    @activity.defn
    @typed_errors
    def wait_for_boot(self, input: WaitForBootInput) -> Node:
        """Until the node is Ready with a boot id other than ``boot_id_before``."""
        cluster = self.env.cluster
        addresses = machine_addresses(self.env)

        def rebooted() -> Node | None:
            cluster.review_csrs(addresses)  # a reinstalled kubelet's certificate, for its own name only
            node = cluster.get_node(input.node_name)
            fresh = node is not None and node.ready and node.boot_id and node.boot_id != input.boot_id_before
            return node if fresh else None

        node = poll_until(rebooted, input.deadline, input.poll_seconds, lambda: ApplicationError(
            f"node {input.node_name} did not come back with a new boot id by {input.deadline.isoformat()}",
            type="BootTimeout", non_retryable=True,
        ))
        cluster.revoke_node_tokens(input.node_name)  # a reinstall's token: spent once the node is back
        return node

    # -- replace (retiring the old machine is CapacityActivities.retire_machine) ----------------------------------------------------------------------
    @activity.defn
    @typed_errors
    def replacement_sites(self, input: ReplacementSitesInput) -> list[str]:
        """Where the replacement may join (``fleet.replacement``: compliance geography);
        none for a site gone from the config."""
        config = self.env.config
        try:
            here = config.site(input.site)
        except KeyError:
            return []
        return replacement_sites(here, config.sites)
