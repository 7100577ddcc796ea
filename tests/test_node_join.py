"""NodeJoin end to end on a real Temporal dev server and the simulated fleet."""

from __future__ import annotations

import asyncio
import base64
import json
import copy
import subprocess
import sys
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError, CancelledError

from fleet import search_attributes as sa
from fleet.naming import node_name_for
from providers.cluster.bootstrap import read_join_configuration
from fleet.cluster import UNPROVEN_TAINT
from fleet.config import load_config
from fleet.demand import DEMAND_TAINT_KEY, LABEL_FLEET, LABEL_GEOGRAPHY, GpuPod, Toleration, site_labels
from tests.conftest import TEST_FLEET, Stack, run_node_host, wait_for
from tests.details_helpers import current_details, decided, held, scheduled, until
from tests.replay import replay_and_record
from sim.gpu import SimGpuBackend
from sim.provider import SimProvider
from workers.control_plane import build_worker
from fleet.messages.join import JoinProgress, JoinTimeouts, NodeJoinResult
from tests.repair_helpers import eventually

FAST = {"timeouts": {"registration_seconds": 3, "smoke_test_seconds": 5, "heartbeat_seconds": 2}}


#: The event of a child workflow's start.
START_CHILD = EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED


async def failure_of(handle) -> ApplicationError:
    with pytest.raises(WorkflowFailureError) as caught:
        await handle.result()
    assert isinstance(caught.value.cause, ApplicationError)
    return caught.value.cause


def readable_history(history: dict) -> str:
    """History JSON with every payload's base64 data decoded, so a search sees values."""
    decoded: list[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "data" and isinstance(value, str):
                    decoded.append(base64.b64decode(value).decode(errors="replace"))
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(history)
    return json.dumps(history) + "\n".join(decoded)


def provider_calls(stack: Stack) -> int:
    return stack.world.calls("acct-a") + stack.world.calls("acct-b")


def upserted_keys(history) -> list[set[str]]:
    return [
        set(e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields)
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES
    ]


def own_upserts(history) -> list[set[str]]:
    """The join's own writes (a patch's TemporalChangeVersion is the SDK's)."""
    return [own for keys in upserted_keys(history) if (own := keys - {"TemporalChangeVersion"})]


async def test_join_started_with_its_search_attributes_writes_only_what_changes(stack: Stack) -> None:
    """The CLI and AcquireCapacity start a join with its site's search attributes: an
    operator finds it by Site and NodeName from the start, and the join itself writes
    only its state changes and whatever the starter got wrong."""
    join_id = "join/site-a/with-attributes"
    handle = await stack.client.start_workflow(
        "NodeJoin", {"site": "site-a"}, id=join_id, task_queue=stack.settings.task_queue,
        search_attributes=sa.join_start_attributes("site-a", "lambda", "acct-a", join_id),
    )
    started = (await handle.describe()).typed_search_attributes
    # The starter names the node from the id alone; the join's name carries its nonce (its first
    # run id, which no starter knows), corrected in its first task.
    named = node_name_for("site-a", join_id, handle.first_execution_run_id)
    assert started[sa.NODE_NAME] in (node_name_for("site-a", join_id), named)
    assert started[sa.FLEET_STATE] == "provisioning"
    await handle.result()
    assert (await handle.describe()).typed_search_attributes[sa.NODE_NAME] == named
    # the node's name, then proving, ready (the activity that saw the node register labelled it)
    assert own_upserts(await handle.fetch_history()) == [{"NodeName"}, {"FleetState"}, {"FleetState"}]

    # A starter with a stale idea of the site: the join corrects just that.
    stale_id = "join/site-a/stale-attributes"
    stale = await stack.client.start_workflow(
        "NodeJoin", {"site": "site-a"}, id=stale_id, task_queue=stack.settings.task_queue,
        search_attributes=sa.join_start_attributes("site-a", "aws", "acct-a", stale_id),
    )
    await stale.result()
    assert own_upserts(await stale.fetch_history())[0] == {"Provider", "NodeName"}
    assert (await stale.describe()).typed_search_attributes[sa.PROVIDER] == "lambda"

    # Started without them (the temporal CLI): the join sets all five itself.
    bare = await stack.start_join({"site": "site-a"}, request="bare-attributes")
    await bare.result()
    assert own_upserts(await bare.fetch_history())[0] == {"Site", "Provider", "Account", "NodeName", "FleetState"}


async def test_join_happy_path(stack: Stack) -> None:
    handle = await stack.start_join({"site": "site-a"}, request="happy")
    result = NodeJoinResult.model_validate(await handle.result())
    (node,) = result.nodes
    assert node.node_name == node_name_for("site-a", "join/site-a/happy", handle.first_execution_run_id)
    assert node.gpus == 2

    joined = stack.cluster.get_node(node.node_name)
    assert joined.ready
    assert joined.labels["node-restriction.kubernetes.io/gpufleet-site"] == "site-a"
    assert joined.labels["node-restriction.kubernetes.io/gpufleet-provider"] == "lambda"
    assert joined.labels["topology.kubernetes.io/region"] == "us-east-1"
    assert joined.labels["nvidia.com/gpu.product"] == "H100"
    assert UNPROVEN_TAINT not in joined.taints, "admitted nodes lose the unproven taint"
    assert [m["id"] for m in stack.world.machines("site-a")] == [node.machine_id]

    # Operators find it by search attribute (visibility is eventually consistent).
    query = f'WorkflowId = "{handle.id}" AND Site = "site-a" AND NodeName = "{node.node_name}" AND FleetState = "ready"'

    async def listed() -> list:
        return [w async for w in stack.client.list_workflows(query)]

    for _ in range(50):
        if await listed():
            break
        await asyncio.sleep(0.1)
    assert len(await listed()) == 1


async def test_a_pod_opted_in_to_the_fleet_binds_as_the_join_admits_its_node(stack: Stack, monkeypatch) -> None:
    """A join labels its node, as it registers, with every label the fleet keeps on its site's nodes
    (``site_labels``: the opt-in ``gpufleet: "true"``, the geography and the capacity type beside the
    site, provider, region and GPU), so a Pending pod that opted in to the fleet binds the moment the
    smoke test passed and the unproven taint went. Before, the join set four of them and the others
    waited for the demand loop's next look (once the purchase had ended, or within 2 s while pods
    were Pending): the pod a purchase was for waited on the loop after its node was admitted."""
    testing, tested = held(monkeypatch, SimGpuBackend, "compute_check")
    stack.cluster.create_pod(GpuPod(
        namespace="ml", name="opted-in", gpus=2, node_selector={LABEL_FLEET: "true", LABEL_GEOGRAPHY: "us-east"},
        tolerations=[Toleration(key=DEMAND_TAINT_KEY, operator="Exists", effect="NoSchedule")]))
    handle = await stack.start_join({"site": "site-a"}, request="labelled")
    await eventually(lambda: asyncio.to_thread(testing.wait, 0.1), timeout=30)
    name = node_name_for("site-a", "join/site-a/labelled", handle.first_execution_run_id)
    proving = stack.cluster.get_node(name)
    wanted = site_labels(load_config(stack.settings.config).site("site-a"))
    assert {k: proving.labels.get(k) for k in wanted} == wanted, "labelled as it registered, before it is proven"
    assert UNPROVEN_TAINT in proving.taints
    assert not {p.name: p.node for p in stack.cluster.list_gpu_pods()}["opted-in"], "bound before it was proven"
    tested.set()
    await handle.result()
    assert {p.name: p.node for p in stack.cluster.list_gpu_pods()}["opted-in"] == name


async def test_each_wait_of_a_join_says_until_when(stack: Stack, monkeypatch) -> None:
    """The join's page names the bound of each step it waits in, by the workflow's clock in UTC:
    provisioning (one try's limit), registration (its deadline) and the smoke test. Before:
    "until 900s" for registration (a duration with no start), nothing for the others."""
    timeouts = JoinTimeouts()  # the defaults: 600 s, 900 s, 600 s
    creating, created = held(monkeypatch, SimProvider, "create_machine")
    testing, tested = held(monkeypatch, SimGpuBackend, "compute_check")
    stack.world.set_site("site-a", unreachable=1)  # booted, it dials home when the test says
    handle = await stack.start_join({"site": "site-a"}, request="until-when")

    async def saying(words: str) -> str | None:
        details = await current_details(handle)
        return details if words in details else None

    await eventually(lambda: asyncio.to_thread(creating.wait, 0.1), timeout=30)
    began, _ = await scheduled(handle, "provision_joining_machine")
    shown = await eventually(lambda: saying("provisioning"), timeout=30)
    assert f"{until(began, timeouts.provision_seconds)} (per try)" in shown, shown
    created.set()

    began, registering = await eventually(lambda: scheduled(handle, "await_registration"), timeout=30)
    deadline = datetime.fromisoformat(registering["deadline"])
    # The task's clock, read here from its history to the microsecond the SDK may round.
    assert abs(deadline - began - timedelta(seconds=timeouts.registration_seconds)) < timedelta(milliseconds=1)
    shown = await eventually(lambda: saying("waiting for registration"), timeout=30)
    assert f"**waiting for registration**: {until(deadline)}; its certificate" in shown, shown
    stack.world.set_site("site-a", unreachable=0)

    await eventually(lambda: asyncio.to_thread(testing.wait, 0.1), timeout=30)
    began, _ = await scheduled(handle, "smoke_test")
    shown = await eventually(lambda: saying("smoke test"), timeout=30)
    assert until(began, timeouts.smoke_test_seconds) in shown, shown
    tested.set()
    assert NodeJoinResult.model_validate(await handle.result()).nodes


def scheduled_activities(history) -> list[str]:
    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


async def test_join_looks_its_site_up_in_its_provisioning_activity(stack: Stack) -> None:
    """The provisioning activity looks the site up and returns its facts: a join runs no local
    activity (a local one's result could reach the join a task late, with a cancel, and its
    history then did not replay), and it still sets its search attributes from the site. A join a
    parent started (a fan-out's, AcquireCapacity's) schedules no lookup of its own; one started by
    hand looks its site up first, as a regular activity, to refuse a site with no room
    (``join-by-hand-refuses-max-nodes-0``). An unknown site is refused, naming ``site``, before
    anything is bought."""
    handle = await stack.start_join({"site": "site-a"}, request="site-in-provisioning")
    await handle.result()
    history = await handle.fetch_history()
    scheduled = scheduled_activities(history)
    assert scheduled[:2] == ["resolve_site", "provision_joining_machine"], scheduled
    markers = [e.marker_recorded_event_attributes.marker_name for e in history.events
               if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]
    assert "core_local_activity" not in markers, markers
    found = (await handle.describe()).typed_search_attributes
    assert (found[sa.PROVIDER], found[sa.ACCOUNT]) == ("lambda", "acct-a")

    fan_out = await stack.start_join({"site": "site-a", "count": 2}, request="site-in-provisioning-2")
    await fan_out.result()
    child = await stack.client.get_workflow_handle(f"{fan_out.id}/0").fetch_history()
    assert scheduled_activities(child)[0] == "provision_joining_machine", scheduled_activities(child)
    assert "resolve_site" not in scheduled_activities(child)

    calls, bought = provider_calls(stack), len(stack.world.machines(include_deleted=True))
    error = await failure_of(await stack.start_join({"site": "atlantis"}, request="unknown-site"))
    assert error.type == "InvalidRequest" and error.non_retryable, error
    assert error.message.startswith("InvalidRequest while resolving site: site: unknown site 'atlantis'"), error.message
    assert provider_calls(stack) == calls and len(stack.world.machines(include_deleted=True)) == bought, "nothing bought"


#: A join by hand at a site whose max_nodes is 0 (one being emptied), refused before it buys
#: (``join-by-hand-refuses-max-nodes-0``); ``_before``, the code before, which bought the machine
#: and joined it for the Site entity to retire, replays; and a join by hand with room, the new path.
REFUSED_AT_MAX_0 = "node_join_by_hand_refused_at_max_nodes_0"
REFUSED_AT_MAX_0_BEFORE = f"{REFUSED_AT_MAX_0}_before"
LOOKS_ITS_SITE_UP = "node_join_by_hand_looks_its_site_up"


def site_a_emptied(fleet_world: Stack) -> None:
    """site-a at min_nodes 0, max_nodes 0 in the config the worker reads (the procedure that empties
    a site before it leaves the config); site-b as before."""
    fleet = copy.deepcopy(TEST_FLEET)
    fleet["sites"][0].update(min_nodes=0, max_nodes=0)
    Path(fleet_world.settings.config).write_text(yaml.safe_dump(fleet))


async def test_a_join_by_hand_at_a_site_whose_max_nodes_is_0_is_refused_before_anything_is_bought(
        fleet_world: Stack) -> None:
    """A join of one node from code (a client, ``temporal workflow start``, a Schedule) at a site
    whose max_nodes is 0 bought a machine, which the Site entity then retired above its max: paid
    for nothing. Now the join refuses it before buying, non-retryable, naming ``count``; a join
    with room still joins."""
    from tests.plugins.stack import running_stack

    site_a_emptied(fleet_world)
    async with running_stack(fleet_world) as stack:
        handle = await stack.start_join({"site": "site-a"}, request=f"emptied-{uuid.uuid4().hex[:6]}")
        error = await failure_of(handle)
        assert (error.type, error.non_retryable) == ("InvalidInput", True), error
        assert error.message == "count: 1 is more than site-a's max_nodes (0)", error.message
        assert error.details == ({"field": "count"},), error.details
        assert stack.world.calls("acct-a") == 0 and stack.world.machines(include_deleted=True) == [], "nothing bought"
        found = (await handle.describe()).typed_search_attributes
        assert (found.get(sa.SITE), found.get(sa.FLEET_STATE)) == ("site-a", "failed")
        progress = JoinProgress.model_validate(await handle.query("progress"))
        assert progress.step == "failed" and progress.done == ["resolving site"], progress
        await replay_and_record(handle, REFUSED_AT_MAX_0)

        # A site with room: looked up, then bought and joined.
        joined = await stack.start_join({"site": "site-b"}, request=f"room-{uuid.uuid4().hex[:6]}")
        (node,) = NodeJoinResult.model_validate(await joined.result()).nodes
        assert node.site == "site-b" and stack.cluster.get_node(node.node_name).ready
        scheduled = scheduled_activities(await joined.fetch_history())
        assert scheduled[:2] == ["resolve_site", "provision_joining_machine"], scheduled
        await replay_and_record(joined, LOOKS_ITS_SITE_UP)


async def test_join_fans_out_for_count(stack: Stack) -> None:
    handle = await stack.start_join({"site": "site-b", "count": 3}, request="three")
    result = NodeJoinResult.model_validate(await handle.result())
    assert len({n.node_name for n in result.nodes}) == 3
    assert len(stack.world.machines("site-b")) == 3
    assert all(stack.cluster.get_node(n.node_name).ready for n in result.nodes)


async def test_a_fan_out_says_until_when_its_joins_run(stack: Stack, monkeypatch) -> None:
    """A join of several nodes waits for one child join per node, each bounded by its own timeouts
    (tens of minutes by default): its details say until when, in UTC. Before: "joining: 2 nodes at
    site-b", no time."""
    creating, created = held(monkeypatch, SimProvider, "create_machine")
    timeouts = {"provision_seconds": 120, "registration_seconds": 30, "smoke_test_seconds": 20}
    handle = await stack.start_join({"site": "site-b", "count": 2, "timeouts": timeouts}, request="two-says")
    try:
        assert await asyncio.to_thread(creating.wait, 30), "a child began buying"
        began, _ = await decided(handle, lambda e: e.event_type == START_CHILD)  # the children's task
        shown = await current_details(handle)
    finally:
        created.set()
    assert shown.split("\n")[0] == (
        f"**joining**: 2 nodes at site-b, each {until(began, 170)} (its timeouts: provision 120 s a try, "
        "registration 30 s, smoke test 20 s)"), shown
    result = NodeJoinResult.model_validate(await asyncio.wait_for(handle.result(), 60))
    assert len(result.nodes) == 2, result


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"site": "atlantis"}, "site"),
        ({"site": "site-a", "count": 0}, "count"),
        ({"site": 5}, "site"),
        ({"sites": "site-a"}, "sites"),
        ({"site": "site-a", "token_ttl_seconds": 7200}, "token_ttl_seconds"),
        ({"site": "site-a", "timeouts": {"registration_seconds": -1}}, "timeouts.registration_seconds"),
    ],
)
async def test_bad_input_fails_fast_naming_the_field_and_calls_no_provider(stack: Stack, raw, field) -> None:
    handle = await stack.start_join(raw)
    error = await failure_of(handle)
    assert error.non_retryable
    assert error.type in ("InvalidInput", "InvalidRequest")
    assert field in str(error)
    assert provider_calls(stack) == 0
    assert stack.world.machines(include_deleted=True) == []


async def test_no_capacity_is_a_typed_failure_and_leaks_nothing(stack: Stack) -> None:
    stack.world.set_site("site-a", capacity=0)
    error = await failure_of(await stack.start_join({"site": "site-a"}))
    assert error.type == "NoCapacity"
    assert error.non_retryable
    assert stack.world.machines(include_deleted=True) == []
    assert stack.world.calls("acct-a", "create") == 1, "NoCapacity is not retried at the same offer"


async def test_over_quota_and_bad_credentials_are_typed(stack: Stack) -> None:
    stack.world.set_site("site-a", quota=0)
    assert (await failure_of(await stack.start_join({"site": "site-a"}))).type == "OverQuota"
    stack.world.set_credentials_valid("acct-b", False)
    assert (await failure_of(await stack.start_join({"site": "site-b"}))).type == "BadCredentials"
    assert stack.world.calls("acct-b", "create") == 1, "BadCredentials is never retried"
    assert stack.world.machines(include_deleted=True) == []


async def test_registration_timeout_deletes_the_machine(stack: Stack) -> None:
    stack.world.set_site("site-a", unreachable=1)  # the machine boots but never dials home
    error = await failure_of(await stack.start_join({"site": "site-a", **FAST}))
    assert error.type == "RegistrationTimeout"
    assert stack.world.machines("site-a") == [], "no live machine is left behind"
    (deleted,) = stack.world.machines("site-a", include_deleted=True)
    assert deleted["deleted_at"] is not None
    assert stack.world.site_row("site-a")["capacity"] == 8, "capacity returned to the provider"


async def test_failed_smoke_test_never_admits_and_deletes_the_machine(stack: Stack) -> None:
    stack.world.set_site("site-a", boot_seconds=1.0)
    handle = await stack.start_join({"site": "site-a", **FAST})
    machine = await wait_for(lambda: stack.world.machines("site-a"))
    stack.world.inject_fault(machine[0]["id"], 1, "compute", clears_on="never")
    name = machine[0]["name"]
    admitted = []

    async def watch() -> None:  # the node must never be schedulable without the taint
        while True:
            node = stack.cluster.get_node(name)
            if node and UNPROVEN_TAINT not in node.taints and "node-restriction.kubernetes.io/gpufleet-site" in node.labels:
                admitted.append(node)
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    error = await failure_of(handle)
    watcher.cancel()
    assert error.type == "SmokeTestFailed"
    assert "GPU 1" in str(error)
    assert admitted == []
    assert stack.cluster.get_node(name) is None
    assert stack.world.machines("site-a") == []


async def test_worker_killed_after_provider_create_joins_exactly_one_machine(fleet_world: Stack) -> None:
    """SIGKILL the control-plane worker while the create call is in flight."""
    stack = fleet_world
    stack.world.set_site("site-a", api_latency_ms=3000)  # the reply takes 1.5 s after the machine exists
    stop = asyncio.Event()
    host = await run_node_host(stack.client, stack.settings, stop)
    worker = subprocess.Popen([sys.executable, "-m", "workers.control_plane"], env=stack.settings_env())
    try:
        handle = await stack.start_join(
            {"site": "site-a", "timeouts": {"provision_seconds": 4}}, request="crash"
        )
        await wait_for(lambda: stack.world.machines("site-a"), timeout=30)
        worker.kill()
        worker.wait()
        stack.world.set_site("site-a", api_latency_ms=0)
        async with build_worker(stack.client, stack.settings):
            result = NodeJoinResult.model_validate(await handle.result())
    finally:
        if worker.poll() is None:
            worker.kill()
        stop.set()
        await host
    machines = stack.world.machines("site-a", include_deleted=True)
    assert len(machines) == 1
    assert machines[0]["id"] == result.nodes[0].machine_id
    assert stack.world.calls("acct-a", "create") == 2, "the create was retried, idempotently"
    assert stack.cluster.get_node(result.nodes[0].node_name).ready


async def test_join_token_never_enters_workflow_history(fleet_world: Stack) -> None:
    """Read the token where the machine reads it, then look for it in history."""
    stack = fleet_world
    async with build_worker(stack.client, stack.settings):
        handle = await stack.start_join({"site": "site-a"}, request="secret")
        # Where the machine reads it: the user data the provider was handed.
        rows = await wait_for(lambda: stack.world.query("SELECT user_data FROM machines WHERE user_data IS NOT NULL"),
                              timeout=30)
        token = read_join_configuration(rows[0]["user_data"])["discovery"]["tlsBootstrapToken"]
        token_id, _, secret = token.partition(".")
        stop = asyncio.Event()
        host = await run_node_host(stack.client, stack.settings, stop)  # now the machine may boot
        try:
            await handle.result()
        finally:
            stop.set()
            await host
    history = readable_history((await handle.fetch_history()).to_json_dict())
    assert token_id in history, "the token is referenced by id"
    assert secret not in history
    assert stack.world.query("SELECT * FROM join_tokens WHERE id=?", token_id) == [], "deleted once registered"


async def test_cancelled_join_deletes_its_machine(stack: Stack) -> None:
    stack.world.set_site("site-b", unreachable=1)
    handle = await stack.start_join({"site": "site-b"})
    await wait_for(lambda: stack.world.machines("site-b"), timeout=30)
    await handle.cancel()
    with pytest.raises(WorkflowFailureError):
        await handle.result()
    await wait_for(lambda: not stack.world.machines("site-b"), timeout=30)
    assert len(stack.world.machines("site-b", include_deleted=True)) == 1


async def test_join_cancelled_mid_create_still_deletes_the_machine(stack: Stack) -> None:
    """The cancel lands while the provider is still answering the create call."""
    stack.world.set_site("site-b", api_latency_ms=3000)  # the machine exists 1.5 s before the reply
    handle = await stack.start_join({"site": "site-b"})
    await wait_for(lambda: stack.world.machines("site-b"), timeout=30)
    await handle.cancel()
    with pytest.raises(WorkflowFailureError):
        await handle.result()
    assert stack.world.machines("site-b") == [], "deleted before the join reported cancelled"
    (machine,) = stack.world.machines("site-b", include_deleted=True)
    # And its join token, which the machine never used (it was left to expire at its TTL once).
    assert stack.world.query("SELECT * FROM join_tokens WHERE node_name=?", machine["name"]) == []
    await replay_and_record(handle, "node_join_cancelled_mid_create")


async def test_join_cancelled_mid_create_that_then_finds_no_capacity_cleans_up_and_ends_cancelled(stack: Stack) -> None:
    """The cancel lands while the provider is still answering the create call, and its answer is
    no capacity: the join still deletes the node's join token (good for an hour otherwise) and
    ends cancelled, as a cancelled join does, not failed with the provider's error."""
    stack.world.set_site("site-b", capacity=0, api_latency_ms=3000)  # "no capacity", 3 s later
    handle = await stack.start_join({"site": "site-b"})

    async def token_issued() -> str:
        name = JoinProgress.model_validate(await handle.query("progress")).node_name
        return name if name and stack.world.query("SELECT * FROM join_tokens WHERE node_name=?", name) else ""

    node_name = await eventually(token_issued, timeout=30)
    await handle.cancel()
    with pytest.raises(WorkflowFailureError) as ended:
        await handle.result()
    assert stack.world.query("SELECT * FROM join_tokens WHERE node_name=?", node_name) == []
    assert isinstance(ended.value.cause, CancelledError), ended.value.cause
    assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED
    assert stack.world.machines("site-b", include_deleted=True) == []
    await replay_and_record(handle, "node_join_cancelled_mid_create_no_capacity")
