"""The tour, in order, as an operator runs it on a fresh ``gpufleet dev``, and the fleet's
invariants after every step.

The commands are read from the tour itself (docs/getting-started.md: the fenced ``bash``
blocks of the dev-stack "Try" list, the ``temporal`` CLI, the game day and the rollout), so
the document and this test cannot drift. Only addresses and ports are substituted (a free
port per server, the S3 emulator's port in a copy of the built-in fleet); a placeholder such
as ``<node>`` gets a real value from the output before it. A comment "exits N" is the exit
code the tour promises; every other command must exit 0.

The tour breaks things on purpose (the sim's knobs, a GPU fault, a provider loss) and must
leave the fleet as it found it. After every step ``fleet_invariants`` must hold (``settle``
seconds at most, for what the step set off to finish): no node cordoned without an open
reason, no site at routing weight 0 without an open incident or evacuation, no request
running that the step did not start on purpose, no machine that nobody asked for.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.ports import free_dev_port, free_port

ROOT = Path(__file__).resolve().parents[1]
# The tour moved from the README to the docs site; the name stays for the tests that read it.
README = ROOT / "docs" / "getting-started.md"
VENV_BIN = Path(sys.executable).parent
#: The tour's sections, in order.
SECTIONS = ("Try, in a second shell", "### From the `temporal` CLI", "### Provider incidents",
            "### Ending an evacuation by hand", "### Model rollouts")
#: Requests: workflows that buy, join or evacuate, and end. Entities (Site, Node, accounts,
#: routing) run for ever by design and are not requests.
REQUEST_TYPES = ("AcquireCapacity", "NodeJoin", "SiteEvacuation")


def bash_blocks(section: str) -> list[list[str]]:
    """The ``bash`` blocks under a README heading (up to the next heading of any level)."""
    text = README.read_text()
    start = text.index(section)
    end = re.search(r"\n#{2,4} ", text[start + len(section):])
    body = text[start:start + len(section) + (end.start() if end else len(text))]
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", body, re.S):
        commands = []
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.strip().startswith("#"):
                commands.append(line.strip())
        blocks.append(commands)
    return blocks


def walked() -> list[tuple[str, str]]:
    """(section, command) for every step of the tour, in order."""
    return [(section, command) for section in SECTIONS for command in bash_blocks(section)[0]]


def expected_code(command: str) -> int:
    found = re.search(r"#.*\bexits (\d+)", command)
    return int(found.group(1)) if found else 0


def machines_asked(command: str) -> int:
    """Machines a step asks for: a join's count (a join expected to fail buys none to keep)."""
    if expected_code(command):
        return 0
    if command.startswith("gpufleet join"):
        found = re.search(r"--count (\d+)", command)
        return int(found.group(1)) if found else 1
    if command.startswith("temporal workflow start") and "--type NodeJoin" in command:
        found = re.search(r"--input '([^']*)'", command)
        return int(json.loads(found.group(1)).get("count", 1)) if found else 1
    return 0


def started_on_purpose(command: str) -> str | None:
    """The workflow a step starts and leaves running (``temporal workflow start``)."""
    if command.startswith("temporal workflow start"):
        return re.search(r"--workflow-id (\S+)", command).group(1)
    return None


@dataclass
class Look:
    """One look at the fleet: the cluster, the sim's machines and Temporal's open workflows."""

    cordoned: dict[str, str] = field(default_factory=dict)  # node -> site
    zero_weight: dict[str, str] = field(default_factory=dict)  # site -> which routing document
    requests: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (type, root id)
    machines: int = 0
    #: What holds a cordoned node or a site: running repairs/reclaims/joins by node, running
    #: evacuations by site, and (asked only when needed) open incidents and fenced GPUs.
    held_nodes: set[str] = field(default_factory=set)
    evacuating: set[str] = field(default_factory=set)
    incident_open: set[str] = field(default_factory=set)


async def look_at_fleet(stack: dict) -> Look:
    from temporalio.client import Client, WorkflowExecutionStatus

    from fleet import search_attributes as sa
    from fleet.cluster import LABEL_SITE

    fleet, look = stack["fleet"], Look()
    nodes = fleet.cluster.list_nodes()
    look.cordoned = {n.name: n.labels.get(LABEL_SITE) or n.site for n in nodes if n.unschedulable}
    look.machines = len(fleet.world.machines())
    documents = {"site routes": fleet.cluster.get_site_routes()}
    for model in sorted({s.model for s in fleet.cluster.list_serving()}):
        documents[f"routes of {model}"] = fleet.cluster.get_routing(model)
    for where, table in documents.items():
        for site, route in (table.sites.items() if table else ()):
            # A model's table has weight 0 where it serves nothing; an evacuation marks its own.
            if route.weight == 0 and (where == "site routes" or route.incident or route.draining):
                look.zero_weight.setdefault(site, where)
    client = await Client.connect(f"127.0.0.1:{stack['port']}")
    async for wf in client.list_workflows('ExecutionStatus = "Running"'):
        kind = wf.workflow_type
        node = wf.typed_search_attributes.get(sa.NODE_NAME)
        if kind in ("GpuRepair", "SpotReclaim", "NodeJoin") and node:
            look.held_nodes.add(str(node))
        if kind == "SiteEvacuation":
            look.evacuating.add(str(wf.typed_search_attributes.get(sa.SITE) or wf.id.split("/")[1]))
        if kind in REQUEST_TYPES:
            # Visibility can lag a close by a moment: the workflow's own description decides.
            described = await client.get_workflow_handle(wf.id).describe()
            if described.status == WorkflowExecutionStatus.RUNNING:
                look.requests[wf.id] = (kind, wf.root_id or wf.id)
    unexplained = {site for node, site in look.cordoned.items() if node not in look.held_nodes}
    for site in sorted((unexplained | set(look.zero_weight)) - look.evacuating):
        try:
            status = await client.get_workflow_handle(f"site/{site}").query("status")
        except Exception:  # noqa: BLE001 - no Site entity: no incident
            continue
        if (status.get("incident") or {}).get("open"):
            look.incident_open.add(site)
    for node, site in look.cordoned.items():
        if node in look.held_nodes or site in look.evacuating or site in look.incident_open:
            continue
        try:  # a GPU the Node entity fenced, its repair not started yet (held while the site decides)
            status = await client.get_workflow_handle(f"node/{node}").query("status")
        except Exception:  # noqa: BLE001 - no Node entity
            continue
        if status.get("fenced"):
            look.held_nodes.add(node)
    return look


def broken_invariants(look: Look, on_purpose: set[str], machines_expected: int) -> list[str]:
    """What is wrong with the fleet after a step (empty: nothing)."""
    broken = []
    for node, site in sorted(look.cordoned.items()):
        if node not in look.held_nodes and site not in look.evacuating | look.incident_open:
            broken.append(f"node {node} at {site} is cordoned with no open reason "
                          "(no running repair, evacuation, incident or quarantine holds it)")
    for site, where in sorted(look.zero_weight.items()):
        if site not in look.evacuating | look.incident_open:
            broken.append(f"{site} is at routing weight 0 in the {where} with no open incident or evacuation")
    stray = sorted(f"{kind} {wid}" for wid, (kind, root) in look.requests.items()
                   if wid not in on_purpose and root not in on_purpose)
    if stray:
        broken.append(f"requests running that the step did not start on purpose: {', '.join(stray)}")
    if look.machines > machines_expected or (look.machines != machines_expected and not look.requests):
        broken.append(f"{look.machines} machines held where {machines_expected} were asked for")
    return broken


def fleet_invariants(stack: dict, step: str, on_purpose: set[str], machines_expected: int,
                     settle: float = 30.0) -> Look:
    """Assert the fleet's invariants after ``step``, giving what it set off ``settle`` seconds
    to finish (a repair uncordoning its node, an evacuation's last weight step)."""
    deadline = time.monotonic() + settle
    while True:
        look = asyncio.run(look_at_fleet(stack))
        broken = broken_invariants(look, on_purpose, machines_expected)
        if not broken:
            return look
        if time.monotonic() > deadline:
            raise AssertionError(f"after step {step!r}, {settle:.0f}s later:\n  " + "\n  ".join(broken))
        time.sleep(0.5)


@pytest.fixture(scope="module")
def dev_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("walk")
    port, ui_port, http_port, s3_port = free_dev_port(), free_port(), free_port(), free_port()
    config = tmp / "sites.yaml"
    builtin = (ROOT / "fleet" / "default_sites.yaml").read_text()
    assert "127.0.0.1:7244" in builtin
    config.write_text(builtin.replace("127.0.0.1:7244", f"127.0.0.1:{s3_port}"))
    env = {**os.environ, "GPUFLEET_STATE_DIR": str(tmp / "state"), "GPUFLEET_CONFIG": str(config),
           "TEMPORAL_ADDRESS": f"127.0.0.1:{port}", "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    for name in ("GPUFLEET_TASK_QUEUE", "GPUFLEET_DEV_S3_KEY"):
        env.pop(name, None)
    log = tmp / "dev.log"
    proc = subprocess.Popen([sys.executable, "-m", "cli", "dev", "--port", str(port), "--ui-port", str(ui_port),
                             "--http-port", str(http_port)], env=env, cwd=ROOT, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while "gpufleet dev is up" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    from activities.env import FleetEnv
    from fleet.settings import Settings

    fleet = FleetEnv.from_settings(Settings.from_env(state_dir=tmp / "state", config=str(config)))
    yield {"env": env, "port": port, "tmp": tmp, "log": log, "fleet": fleet}
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)


def site_says(env: dict, site: str, says, what: str, within: float = 60) -> None:
    """``gpufleet sites`` shows ``what`` for ``site`` within ``within`` seconds."""
    deadline = time.monotonic() + within
    while not says(row := {s["site"]: s for s in json.loads(sh(env, "gpufleet sites -o json").stdout)}[site]):
        assert time.monotonic() < deadline, f"gpufleet sites never showed {what} at {site}: {row}"
        time.sleep(0.5)


def site_now_says(stack: dict, site: str, says, what: str, within: float = 60) -> None:
    """What ``gpufleet sites`` computes (``cli.site_status``) shows ``what`` for ``site`` within
    ``within`` seconds: for a state too short-lived for a command per look."""
    from cli import site_status
    from fleet.settings import Settings
    from fleet.temporal import connect

    async def look():
        client = await connect(Settings.from_env(address=f"127.0.0.1:{stack['port']}"))  # the CLI's converter
        names = [s.name for s in stack["fleet"].config.sites]
        deadline = time.monotonic() + within
        while True:
            nodes = stack["fleet"].cluster.list_nodes()
            now = site_status.summarize(names, nodes, await site_status.holds(client, "gpufleet", names, nodes))
            if says(now[site]):
                return
            assert time.monotonic() < deadline, f"site status never showed {what} at {site}: {now[site]}"
            await asyncio.sleep(0.1)

    asyncio.run(look())


def sh(env: dict, command: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(600)
def test_readme_examples_run_as_written(dev_stack) -> None:
    env, last_nodes = dev_stack["env"], ""
    steps = walked()
    commands = [command for _, command in steps]
    assert any(c.startswith("gpufleet gameday provider-loss") for c in commands)
    assert any(c.startswith("gpufleet rollout start") for c in commands)
    # Every knob the tour turns, it turns back (its undo is a later step of the tour).
    for knob in ("sim capacity nebius-eu-north", "sim revoke nebius-main", "sim quota aws-us-east-1",
                 "sim unreachable own-dc-ber"):
        turned = [i for i, c in enumerate(commands) if f"gpufleet {knob}" in c]
        assert len(turned) >= 2, f"the tour never undoes `gpufleet {knob}`"
    machines = fleet_invariants(dev_stack, "before the tour", set(), 0, settle=0).machines
    on_purpose: set[str] = set()
    for i, (section, command) in enumerate(steps):
        if "<node>" in command:
            names = [line.split("\t")[0] for line in last_nodes.splitlines()[1:]
                     if "\tlambda-us-east\t" in line]
            assert names, f"no node to put into {command!r}:\n{last_nodes}"
            command = command.replace("<node>", names[0])
        assert "<" not in command.split("#")[0], f"placeholder without a value: {command}"
        started = time.monotonic()
        done = sh(env, command)
        took = time.monotonic() - started
        assert done.returncode == expected_code(command), (
            f"{command}\nexit {done.returncode} after {took:.1f}s\n{done.stdout}\n{done.stderr}")
        if command.startswith("gpufleet nodes"):
            last_nodes = done.stdout
        if command.startswith("gpufleet gameday"):
            # The timeline arrived line by line although stdout was a pipe, and the site tripped.
            assert "lambda-us-east: detected" in done.stdout and "lambda-us-east: restored" in done.stdout, done.stdout
        if command.startswith("gpufleet rollout start"):
            assert "rollout/demo-llm/v1: completed" in done.stdout, done.stdout
        if command.startswith("gpufleet sim fault"):
            # Site status says what holds the node: the repair the fault set off. It lasts a few
            # seconds, so the look is the command's own, in-process, ten times a second.
            site_now_says(dev_stack, "lambda-us-east", lambda s: s.cordoned_cell() == "1: repair 1",
                          "the repair's cordon")
        if command.startswith("until temporal workflow query --workflow-id evacuate/own-dc-ber"):
            site_says(env, "own-dc-ber", lambda s: s["cordoned"] == "2: evacuation 2"
                      and s["last incident"] == "evacuate/own-dc-ber/manual-1 waiting-for-recovery",
                      "the evacuation's cordon")
        if command.startswith("temporal workflow result --workflow-id evacuate/"):
            assert "aborted" in done.stdout, done.stdout
        if command.startswith("gpufleet gameday"):
            site_says(env, "lambda-us-east", lambda s: s["last incident"] == "evacuate/lambda-us-east/1 restored"
                      and s["cordoned"] == "0", "the restored incident")
        assert "errors.pydantic.dev" not in done.stdout + done.stderr
        machines += machines_asked(command)
        if started_on_purpose(command):
            on_purpose.add(started_on_purpose(command))
        last_of_section = i + 1 == len(steps) or steps[i + 1][0] != section
        if last_of_section:
            on_purpose = set()  # a section ends with what it started finished
        checked = time.monotonic()
        fleet_invariants(dev_stack, command, on_purpose, machines)
        print(f"{took:6.1f}s + {time.monotonic() - checked:4.1f}s invariants  {command[:90]}")  # shown with -s
    # What the text says the commands did, and what site status says of it.
    site_says(env, "own-dc-ber", lambda s: s["serving/nodes"] == "2/2", "both nodes serving again")
    sites = {s["site"]: s for s in json.loads(sh(env, "gpufleet sites --output json").stdout)}
    assert sites["lambda-us-east"]["serving/nodes"] == "4/4", sites
    assert sites["own-dc-ber"]["last incident"] == "evacuate/own-dc-ber/manual-1 aborted", sites
    assert all(s["cordoned"] == "0" and s["joining"] == "0" for s in sites.values()), sites
    nodes = json.loads(sh(env, "gpufleet nodes --output json").stdout)
    assert sum(n["site"] == "lambda-us-east" for n in nodes) >= 3
    status = sh(env, "gpufleet rollout status rollout/demo-llm/v1 --output json")
    assert json.loads(status.stdout)["phase"] == "completed"
    summaries = sh(env, "temporal workflow describe --workflow-id join/lambda-us-east/manual-1 --output json")
    assert "join a node at lambda-us-east" in summaries.stdout


def test_the_invariants_name_each_broken_one() -> None:
    look = Look(cordoned={"n-1": "a", "n-2": "b", "n-3": "c"}, zero_weight={"a": "site routes", "d": "routes of m"},
                requests={"capacity/x": ("AcquireCapacity", "capacity/x"), "join/a/t/0": ("NodeJoin", "join/a/t")},
                machines=5, held_nodes={"n-2"}, evacuating={"a"}, incident_open=set())
    broken = broken_invariants(look, {"join/a/t"}, machines_expected=4)
    assert broken == [
        "node n-3 at c is cordoned with no open reason (no running repair, evacuation, incident or quarantine holds it)",
        "d is at routing weight 0 in the routes of m with no open incident or evacuation",
        "requests running that the step did not start on purpose: AcquireCapacity capacity/x",
        "5 machines held where 4 were asked for",
    ]
    # Nothing running and one machine short: a machine asked for was not kept (or was bought and lost).
    assert broken_invariants(Look(machines=3), set(), 4) == ["3 machines held where 4 were asked for"]
    assert broken_invariants(Look(machines=4), set(), 4) == []


def test_a_cordon_by_hand_breaks_the_first_invariant_and_sites_says_operator(dev_stack) -> None:
    env, fleet = dev_stack["env"], dev_stack["fleet"]
    if not fleet.cluster.list_nodes():  # run on its own: the tour's nodes are not there
        assert sh(env, "gpufleet join --site aws-us-east-1-spot --wait").returncode == 0
    machines = fleet_invariants(dev_stack, "before the cordon", set(), len(fleet.world.machines()), settle=0).machines
    node = fleet.cluster.list_nodes()[0]
    site = node.labels["node-restriction.kubernetes.io/gpufleet-site"]
    fleet.cluster.cordon(node.name)  # what `kubectl cordon` does
    try:
        with pytest.raises(AssertionError, match=f"after step 'kubectl cordon', 0s later:\n  node {node.name} at "
                                                 f"{site} is cordoned with no open reason"):
            fleet_invariants(dev_stack, "kubectl cordon", set(), machines, settle=0)
        site_says(env, site, lambda s: s["cordoned"] == "1: operator 1", "the operator's cordon", within=0)
    finally:
        fleet.cluster.cordon(node.name, False)
    fleet_invariants(dev_stack, "kubectl uncordon", set(), machines, settle=0)


def test_dev_refuses_a_busy_port_before_starting_anything(dev_stack) -> None:
    env = dev_stack["env"]
    done = subprocess.run([sys.executable, "-m", "cli", "dev", "--port", str(dev_stack["port"]),
                           "--ui-port", str(free_port()), "--http-port", str(free_port()),
                           "--state-dir", str(dev_stack["tmp"] / "second")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--port: port {dev_stack['port']} is already in use" in done.stdout + done.stderr
    assert "is up" not in done.stdout
    assert not (dev_stack["tmp"] / "second" / "temporal.db").exists()


def test_join_validates_before_starting(dev_stack) -> None:
    env = dev_stack["env"]
    unknown = sh(env, "gpufleet join --site nowhere")
    assert unknown.returncode == 2 and "--site: unknown site 'nowhere'" in unknown.stderr
    too_many = sh(env, "gpufleet join --site lambda-us-east --count 100")
    assert too_many.returncode == 2 and "--count:" in too_many.stderr and "max_nodes 8" in too_many.stderr
    assert "started" not in unknown.stdout + too_many.stdout


def test_temporal_cli_fan_out_is_findable_and_refuses_more_than_max_nodes(dev_stack) -> None:
    env = dev_stack["env"]
    start = ("temporal workflow start --type NodeJoin --task-queue gpufleet --workflow-id join/aws-us-east-1/many "
             "--input '{\"site\": \"aws-us-east-1\", \"count\": 5}'")
    assert sh(env, start).returncode == 0
    result = sh(env, "temporal workflow result --workflow-id join/aws-us-east-1/many --output json")
    assert "max_nodes" in result.stdout + result.stderr
    query = ("temporal workflow list --query 'WorkflowId=\"join/aws-us-east-1/many\" AND Site=\"aws-us-east-1\" "
             "AND FleetState=\"failed\"'")
    deadline = time.monotonic() + 15  # visibility is eventually consistent
    while "join/aws-us-east-1/many" not in (found := sh(env, query)).stdout:
        assert time.monotonic() < deadline, found.stdout + found.stderr
        time.sleep(0.5)
    progress = sh(env, "temporal workflow query --workflow-id join/aws-us-east-1/many --type progress")
    assert '"failed"' in progress.stdout, progress.stdout


def test_gameday_interrupted_leaves_the_site_reachable(dev_stack) -> None:
    env = dev_stack["env"]
    # Enough nodes for the site's incident rule to trip (min_nodes 3): with fewer the game day is
    # refused before it breaks anything.
    joined = sh(env, "gpufleet join --site aws-us-east-1-spot --count 3")
    assert joined.returncode == 0, joined.stdout + joined.stderr
    proc = subprocess.Popen(["gpufleet", "gameday", "provider-loss", "--site", "aws-us-east-1-spot", "--timeout", "120"],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = proc.stdout.readline()
    assert "aws-us-east-1-spot: lost" in first, first
    sites = {s["site"]: s for s in json.loads(sh(env, "gpufleet sites --output json").stdout)}
    assert sites["aws-us-east-1-spot"]["reachable"] == "no"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode != 0
    sites = {s["site"]: s for s in json.loads(sh(env, "gpufleet sites --output json").stdout)}
    assert sites["aws-us-east-1-spot"]["reachable"] == "yes", out
