"""``gpufleet patches`` (cli/patches.py, the rule in docs/design/patches.md): the ids come from
the workflows' source, and a patch is kept exactly while a run of its type is open that
started before the deploy."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import typer

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from cli.patches import Patch, ScanError, _stamp, parse_deployed_since, scan_patches, verdict
from fleet.contracts import workflows as flows
from fleet.naming import node_workflow_id, site_workflow_id
from fleet.visibility import open_runs_query
from tests.conftest import Stack
from tests.evacuation_helpers import FAST_JOIN, poll
from tests.replay import replay_and_record

ROOT = Path(__file__).resolve().parents[1]
PATCH_CALL = re.compile(r"workflow\.(?:patched|deprecate_patch)\(\s*(?:\"([^\"]+)\"|([A-Za-z_][A-Za-z0-9_]*))")
CONSTANT = re.compile(r"^([A-Z][A-Z0-9_]*) = \"([^\"]+)\"$", re.MULTILINE)


def grepped_patches() -> set[tuple[str, str]]:
    """(id, file) of every patch call, by regular expression over the source (not by ``ast``)."""
    found = set()
    for path in sorted((ROOT / "workflows").glob("*.py")):
        text = path.read_text()
        constants = dict(CONSTANT.findall(text))
        for literal, name in PATCH_CALL.findall(text):
            found.add((literal or constants[name], path.name))
    return found


def test_the_scan_finds_every_patch_the_source_calls() -> None:
    scanned = scan_patches()
    by_file = {(p.id, p.where.split("/")[-1].split(":")[0]) for p in scanned}
    assert by_file == grepped_patches()
    # Two modules name their constant EVENTS_PATCH: each resolves to its own id and type.
    assert {(p.id, p.workflow_type) for p in scanned} >= {("site-events", "Site"), ("demand-events", "Demand")}
    assert all(p.workflow_type for p in scanned)


def write_package(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "workflows"
    package.mkdir(parents=True)
    for name, text in files.items():
        (package / name).write_text(text)
    return package


def test_deprecated_and_inherited_patches_are_placed_and_an_unplaceable_call_is_an_error(tmp_path: Path) -> None:
    package = write_package(tmp_path, {
        "ids.py": 'SHARED = "shared-id"\n',
        "base.py": "from temporalio import workflow\n"
                   "class Entity:\n"
                   "    def gate(self):\n"
                   "        return workflow.patched('base-gate')\n",
        "thing.py": "from temporalio import workflow\n"
                    "from workflows.base import Entity\n"
                    "from workflows.ids import SHARED\n"
                    "OLD = 'old-id'\n"
                    "@workflow.defn(name='Thing')\n"
                    "class ThingEntity(Entity[int]):\n"
                    "    @workflow.run\n"
                    "    async def run(self):\n"
                    "        workflow.deprecate_patch(OLD)\n"
                    "        workflow.patched(SHARED)\n",
    })
    assert scan_patches(package) == [
        Patch("base-gate", "Thing", "workflows/base.py:4", False),
        Patch("old-id", "Thing", "workflows/thing.py:9", True),
        Patch("shared-id", "Thing", "workflows/thing.py:10", False),
    ]
    helper = write_package(tmp_path / "helper", {
        "steps.py": "from temporalio import workflow\n"
                    "def step():\n"
                    "    return workflow.patched('loose')\n"})
    with pytest.raises(ScanError, match=r"workflows/steps.py:3: a patch call outside"):
        scan_patches(helper)
    computed = write_package(tmp_path / "computed", {
        "thing.py": "from temporalio import workflow\n"
                    "@workflow.defn\n"
                    "class Thing:\n"
                    "    def go(self, n):\n"
                    "        return workflow.patched(f'id-{n}')\n"})
    with pytest.raises(ScanError, match=r"workflows/thing.py:5: a patch id that is not"):
        scan_patches(computed)


def test_a_deploy_in_the_future_is_refused_and_no_offset_means_utc() -> None:
    now = datetime(2026, 12, 3, 19, 0, tzinfo=timezone.utc)
    with pytest.raises(typer.BadParameter, match="in the future"):
        parse_deployed_since("2026-12-03T19:00:01Z", now=now)
    with pytest.raises(typer.BadParameter, match="ISO 8601"):
        parse_deployed_since("yesterday", now=now)
    assert parse_deployed_since("2026-12-03T18:00:00", now=now) == datetime(2026, 12, 3, 18, tzinfo=timezone.utc)
    deprecated = Patch("x", "Node", "", True)
    assert verdict(deprecated, 0, now) == "can remove"
    assert verdict(deprecated, 2, now) == "keep deprecated: 2 open runs of Node started before 2026-12-03T19:00:00Z"


def run_patches(address: str, queue: str, since: datetime, *more: str) -> subprocess.CompletedProcess:
    """``gpufleet patches <more> --deployed-since <since>`` on the dev server at ``address``."""
    env = {**os.environ, "TEMPORAL_ADDRESS": address, "TEMPORAL_NAMESPACE": "default"}
    env.pop("TEMPORAL_PROFILE", None)
    return subprocess.run([sys.executable, "-m", "cli", "patches", *more, "--deployed-since", since.isoformat(),
                           "--task-queue", queue, "-o", "json"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def gpufleet_patches(address: str, queue: str, since: datetime, *more: str) -> list[dict[str, str]]:
    done = run_patches(address, queue, since, *more)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def test_an_open_run_started_before_the_deploy_keeps_its_types_patches_and_only_those(temporal_env) -> None:
    client = temporal_env.client
    address = client.service_client.config.target_host
    queue = f"patches-{uuid.uuid4().hex[:8]}"  # no worker polls it: the run stays open, as a join mid-way does
    handle = await client.start_workflow("NodeJoin", {"site": "site-a"}, id=f"join/{queue}", task_queue=queue)
    try:
        for _ in range(200):  # visibility lags the start a little
            if (await client.count_workflows(f'TaskQueue = "{queue}" AND ExecutionStatus = "Running"')).count:
                break
            await asyncio.sleep(0.05)
        started = (await handle.describe()).start_time
        after, before = started + timedelta(milliseconds=300), started - timedelta(milliseconds=300)
        while datetime.now(timezone.utc) <= after:
            await asyncio.sleep(0.05)
        join_ids = {p.id for p in scan_patches() if p.workflow_type == "NodeJoin"}
        assert "join-by-hand-refuses-max-nodes-0" in join_ids

        rows = await asyncio.to_thread(gpufleet_patches, address, queue, after)
        verdicts = {(r["patch"], r["workflow"]): r["verdict"] for r in rows}
        assert {p for p, t in verdicts if t == "NodeJoin"} == join_ids
        deprecated = {(p.id, p.workflow_type) for p in scan_patches() if p.deprecated}
        for (patch, workflow_type), said in verdicts.items():
            if workflow_type == "NodeJoin":
                keep = "keep deprecated" if (patch, workflow_type) in deprecated else "keep"
                assert said.startswith(f"{keep}: 1 open run of NodeJoin started before "), (patch, said)
            else:
                free = "can remove" if (patch, workflow_type) in deprecated else "can deprecate"
                assert said == free, (patch, workflow_type, said)
        assert {r["open before"] for r in rows if r["workflow"] == "NodeJoin"} == {"1"}

        # Deployed before the run started: the run is on the new code, nothing holds a patch.
        rows = await asyncio.to_thread(gpufleet_patches, address, queue, before, "--workflow", "NodeJoin")
        assert {r["patch"] for r in rows} == join_ids
        assert {r["verdict"] for r in rows} <= {"can deprecate", "can remove"}
    finally:
        await handle.terminate("test over")
    # A closed run holds nothing, however early it started.
    for _ in range(200):
        if not (await client.count_workflows(f'TaskQueue = "{queue}" AND ExecutionStatus = "Running"')).count:
            break
        await asyncio.sleep(0.05)
    rows = await asyncio.to_thread(gpufleet_patches, address, queue, after, "--workflow", "NodeJoin")
    assert {r["verdict"] for r in rows} <= {"can deprecate", "can remove"}


def test_the_patch_table_in_the_docs_is_the_code_s() -> None:
    """docs/design/patches.md lists every patch the code asks, with its workflow type, and no other."""
    table = (ROOT / "docs" / "design" / "patches.md").read_text()
    documented = set(re.findall(r"^\| (\w+) \| `([a-z0-9-]+)` \|", table, re.MULTILINE))
    assert documented == {(p.workflow_type, p.id) for p in scan_patches()}


def in_words(n: int) -> str:
    """``n`` (below 100) as the docs write it: "sixty-six"."""
    ones = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
            "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
    tens = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
    if n < 20:
        return ones[n]
    return tens[n // 10] + (f"-{ones[n % 10]}" if n % 10 else "")


def test_the_patch_count_in_the_docs_is_the_code_s() -> None:
    """"The patches now" opens with how many ids the code asks, in how many workflow types, and how
    many of them are deprecated: the counts a person retiring patches starts from."""
    text = (ROOT / "docs" / "design" / "patches.md").read_text()
    said = re.search(r"^## The patches now\n\n(\S+) ids in (\S+) workflow types, (\S+) of them deprecated",
                     text, re.MULTILINE)
    assert said, "the count sentence under \"The patches now\""
    scanned = scan_patches()
    counted = (len(scanned), len({p.workflow_type for p in scanned}), sum(p.deprecated for p in scanned))
    assert [w.lower() for w in said.groups()] == [in_words(n) for n in counted]


#: Patches asked in a signal handler, where the signal is taken (as the entities' ``entity-renews``):
#: a signal's handler runs as its event is applied, in the same task on replay as when it was
#: recorded, whatever a local activity's late result did to the code after that activity.
ASKED_WHERE_A_SIGNAL_IS_TAKEN = {"NODE_QUARANTINE_NAMES_PATCH"}


def test_workflows_with_local_activities_ask_their_patches_at_start() -> None:
    """A patch asked after a local activity can fail replay (docs/design/patches.md, "Where a patch
    may be asked"): in a workflow module that runs local activities, every ``workflow.patched`` call
    is behind ``self._settled or`` or asked at the start of ``run``, before its first ``await``; the
    at-start one is ``run``'s first line. A module whose patches are all retired asks none (NodeJoin
    runs no local activity). A Node patch may also be asked behind ``self._settled_N and`` for an N
    at or past ``node-patches-at-start-4``: such a run runs no local activity."""
    no_local_activity = re.compile(r"self\._settled_([4-9]|[1-9][0-9]) and $")
    for path in sorted((ROOT / "workflows").glob("*.py")):
        text = path.read_text()
        if "execute_local_activity" not in text and "start_local_activity" not in text:
            continue
        calls = re.findall(r"(.{0,20})workflow\.patched\(([A-Za-z_\"-]+)\)", text)
        at_start = [name for before, name in calls
                    if "self._settled or " not in before and not no_local_activity.search(before)
                    and name not in ASKED_WHERE_A_SIGNAL_IS_TAKEN]
        if not calls:
            continue
        assert at_start and at_start[0].endswith("PATCHES_AT_START"), (path.name, at_start)
        run = re.search(r"@workflow\.run\n    async def run\(self[^)]*\)[^:]*:\n(?:        \"\"\".*?\"\"\"\n)?(.*)",
                        text, re.DOTALL)
        assert run, path.name
        first_line, before_first_await = run.group(1).split("\n", 1)[0], run.group(1).split("await ", 1)[0]
        assert f"workflow.patched({at_start[0]})" in first_line, path.name
        for name in at_start[1:]:
            assert f"workflow.patched({name})" in before_first_await, (path.name, name, "asked after an await")


async def test_renew_moves_the_entity_runs_from_before_the_deploy_onto_new_runs(stack: Stack) -> None:
    """docs/operations.md, "Upgrading the control plane", step 4: an idle entity keeps its run (and
    its type's patches) for weeks; ``gpufleet patches renew`` asks it to continue as new, and the run
    from before the deploy is gone in seconds, its state carried into the next. The Node entity's
    loop does not wait on the suggestion (it looks after each watch, which rests on an idle node):
    the request wakes it."""
    client, queue = stack.client, stack.settings.task_queue
    address = client.service_client.config.target_host
    site = await client.start_workflow("Site", {"site": "site-a"}, id=site_workflow_id("site-a"), task_queue=queue)
    joined = (await (await stack.start_join({"site": "site-a", "timeouts": FAST_JOIN})).result())["nodes"][0]
    node = client.get_workflow_handle(node_workflow_id(joined["node_name"]))
    reported = await poll(lambda: _status_with_reports(node), timeout=60)
    deployed = datetime.now(timezone.utc)
    await asyncio.sleep(0.3)  # whatever starts next starts after the deploy
    since = _stamp(deployed)

    said = {(r["workflow"], r["patch"]): r["verdict"]
            for r in await asyncio.to_thread(gpufleet_patches, address, queue, deployed)}
    for entity in ("Node", "Site"):
        assert {v for (t, _), v in said.items() if t == entity} == {f"keep: 1 open run of {entity} started before {since}"}
    runs = {h.id: (await h.describe()).run_id for h in (node, site)}

    asked = {r["workflow"]: r["asked"] for r in await asyncio.to_thread(gpufleet_patches, address, queue, deployed, "renew")}
    assert asked["Node"] == asked["Site"] == "1", asked
    assert set(asked) == set(flows.ENTITIES)

    async def moved_on() -> bool:
        return all([(await client.get_workflow_handle(wid).describe()).run_id != run for wid, run in runs.items()])
    await poll(moved_on, timeout=30)
    carried = {}
    for wid, run in runs.items():
        old = client.get_workflow_handle(wid, run_id=run)
        assert (await old.describe()).status == WorkflowExecutionStatus.CONTINUED_AS_NEW, wid
        events = (await old.fetch_history()).events
        assert not [e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED], wid
        carried[wid] = json.loads(events[-1].workflow_execution_continued_as_new_event_attributes.input.payloads[0].data)
    # The state came along into the next run: what the node reported and its watch's place (a fresh
    # start's are empty), the nodes the site counts.
    node_carry = carried[node.id]["carry"]
    assert (node_carry["boot_id"], node_carry["reports"]) == (reported["boot_id"], reported["reports"])
    assert node_carry["watch_seq"] >= 1 and node_carry["watch_digest"]
    assert joined["node_name"] in carried[site.id]["state"]["status"]["nodes"]
    now = await node.query("status")
    assert (now["boot_id"], now["reports"]) == (reported["boot_id"], reported["reports"])

    async def none_before() -> bool:
        return all([not (await client.count_workflows(open_runs_query(t, queue, deployed))).count
                    for t in ("Node", "Site")])
    await poll(none_before, timeout=30)
    said = {(r["workflow"], r["patch"]): r["verdict"]
            for r in await asyncio.to_thread(gpufleet_patches, address, queue, deployed)}
    for entity in ("Node", "Site"):
        assert {v for (t, _), v in said.items() if t == entity} <= {"can deprecate", "can remove"}, entity
    # Asked again, nothing is left to ask: the runs now open started after the deploy.
    asked = {r["workflow"]: r["asked"] for r in await asyncio.to_thread(gpufleet_patches, address, queue, deployed, "renew")}
    assert asked["Node"] == asked["Site"] == "0", asked
    await replay_and_record(client.get_workflow_handle(node.id, run_id=runs[node.id]), "node_entity_renewed")


async def _status_with_reports(node: WorkflowHandle) -> dict | None:
    status = await node.query("status")
    return status if status["boot_id"] and status["reports"] else None


def test_renew_refuses_a_workflow_type_that_is_no_entity_and_a_deploy_in_the_future() -> None:
    """Only entities continue as new: a short workflow's runs end by themselves, and CsrApprover's
    each end too. Refused before anything is asked (no server at this address)."""
    from typer.testing import CliRunner

    from cli.main import app

    def renew(since: datetime, *more: str):
        return CliRunner().invoke(app, ["patches", "renew", "--deployed-since", since.isoformat(), *more],
                                  env={"COLUMNS": "200", "TEMPORAL_ADDRESS": "127.0.0.1:1"})

    past = datetime.now(timezone.utc) - timedelta(hours=1)
    for short in ("NodeJoin", "CsrApprover"):
        done = renew(past, "--workflow", short)
        assert done.exit_code == 2, done.output
        assert f"--workflow: {short!r} is no entity type" in done.output, done.output
    done = renew(datetime.now(timezone.utc) + timedelta(hours=1))
    assert done.exit_code == 2 and "in the future" in done.output, done.output
