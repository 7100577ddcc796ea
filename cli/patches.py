"""``gpufleet patches``: every ``workflow.patched`` id in the code, and whether it may go yet.

The rule (docs/design/patches.md): a patch may be deprecated (``workflow.deprecate_patch``)
once no open run can still take its old path, and removed a release after that, once no open
run can still hold its (non-deprecated) marker. Both come down to one question per workflow
type: *is any run of it open that started before the release was deployed?*

Why the start time, not the runs' ``core_patch`` markers: ``patched(X)`` answers once per run
and the answer is kept (the SDK memoizes it). A run that started under the old code and is
replayed by the new one reaches ``patched(X)`` inside its old history, gets ``False`` there,
and keeps ``False`` for the rest of the run: it never records X's marker, and it may take the
old path again at any later point. A run started after every worker ran the patched code gets
``True`` at its first call (and records the marker) or never reaches the call (and then has
no old-path commands either). So "open, and started before the deploy" holds every run that
may hold the old path (and some that reached the call only after the deploy and took the new
one: counted too, erring on the side of keeping), and it is one visibility count per type:
``WorkflowType = T AND ExecutionStatus = 'Running' AND TaskQueue = Q AND StartTime < deploy``.
An entity that continues as new starts a new run (a new ``StartTime``), so its old runs leave
the count by themselves; a short workflow's leave when they end. An idle entity may not continue
as new for weeks: ``gpufleet patches renew`` sends each entity run the same query lists its
``renew`` signal, and it continues as new at its next safe point (``workflows/entity.py``).

The ids come from the source itself (``ast`` over the ``workflows`` package: each call of
``workflow.patched``/``workflow.deprecate_patch`` inside a ``@workflow.defn`` class, or a base
class of one, its id a string literal or a module-level string constant), so the list cannot
drift from the code. A call the scan cannot place (outside a workflow class, an id it cannot
resolve) is an error naming its file and line, not a silent omission.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Optional

import typer

from cli.common import Address, OutputFormat, connect, err, fail, fleet_client, run, settings, show_rows
from fleet.contracts import workflows as flows
from fleet.settings import TASK_QUEUE_ENV
from fleet.visibility import open_runs_query
from fleet.visibility import utc_stamp as _stamp

PATCH_CALLS = ("patched", "deprecate_patch")
COLUMNS = ["patch", "workflow", "where", "open before", "verdict"]
#: At 80 columns the source location goes first, then the count (the verdict repeats it).
NARROW = ("where", ("open before", "open"))


@dataclass(frozen=True)
class Patch:
    """One patch id as one workflow type uses it (an id used by two types is two rows)."""

    id: str
    workflow_type: str
    where: str  # file:line of its first call, relative to the package's parent
    deprecated: bool  # every call of it in this type is ``deprecate_patch``


class ScanError(ValueError):
    """A patch call the scan cannot attribute to a workflow type or an id."""


def workflows_package() -> Path:
    """The ``workflows`` package's directory, found without importing it."""
    spec = importlib.util.find_spec("workflows")
    if spec is None or not spec.submodule_search_locations:
        raise ScanError("the workflows package is not importable from here")
    return Path(next(iter(spec.submodule_search_locations)))


def _string_constants(tree: ast.Module) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            out.update({t.id: value.value for t in targets if isinstance(t, ast.Name)})
    return out


def _imports(tree: ast.Module, package: str) -> dict[str, tuple[str, str]]:
    """Local name -> (module stem, name there) for ``from workflows.x import NAME`` and ``from .x import NAME``."""
    out: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if node.level == 1 and len(parts) == 1:
                stem = parts[0]
            elif node.level == 0 and len(parts) == 2 and parts[0] == package:
                stem = parts[1]
            else:
                continue
            out.update({(a.asname or a.name): (stem, a.name) for a in node.names})
    return out


def _workflow_name(cls: ast.ClassDef) -> str | None:
    """The ``@workflow.defn`` name of a class (its class name when the decorator names none)."""
    for deco in cls.decorator_list:
        call = deco if isinstance(deco, ast.Call) else None
        func = call.func if call else deco
        if isinstance(func, ast.Attribute) and func.attr == "defn" or isinstance(func, ast.Name) and func.id == "defn":
            for kw in call.keywords if call else []:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    return str(kw.value.value)
            return cls.name
    return None


def _patch_call(node: ast.AST) -> str | None:
    """``patched`` or ``deprecate_patch`` when ``node`` calls ``workflow.<that>`` (or the bare name)."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in PATCH_CALLS and isinstance(func.value, ast.Name) \
            and func.value.id == "workflow":
        return func.attr
    if isinstance(func, ast.Name) and func.id in PATCH_CALLS:
        return func.id
    return None


def scan_patches(package_dir: Path | None = None) -> list[Patch]:
    """Every patch id the workflows under ``package_dir`` use, with the workflow type using it."""
    package_dir = package_dir or workflows_package()
    package = package_dir.name
    trees = {path.stem: (path, ast.parse(path.read_text(), filename=str(path)))
             for path in sorted(package_dir.glob("*.py"))}
    constants = {stem: _string_constants(tree) for stem, (_, tree) in trees.items()}
    imported = {stem: _imports(tree, package) for stem, (_, tree) in trees.items()}
    classes = {node.name: (stem, node) for stem, (_, tree) in trees.items()
               for node in tree.body if isinstance(node, ast.ClassDef)}

    def resolve(stem: str, arg: ast.AST | None, where: str) -> str:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name):
            if arg.id in constants[stem]:
                return constants[stem][arg.id]
            source = imported[stem].get(arg.id)
            if source and source[1] in constants.get(source[0], {}):
                return constants[source[0]][source[1]]
        raise ScanError(f"{where}: a patch id that is not a string literal or a module-level string constant")

    def calls_in(stem: str, cls: ast.ClassDef, seen: set[str]) -> list[tuple[str, str, str]]:
        """(id, call, where) for the class and its base classes defined in the package."""
        seen.add(cls.name)
        path = trees[stem][0]
        found = []
        for node in ast.walk(cls):
            if kind := _patch_call(node):
                where = f"{package}/{path.name}:{node.lineno}"
                found.append((resolve(stem, node.args[0] if node.args else None, where), kind, where))
        for base in cls.bases:
            if isinstance(base, ast.Subscript):
                base = base.value  # a generic base, ``Entity[NodeCarry]``: the class is ``Entity``
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name in classes and name not in seen:
                found += calls_in(*classes[name], seen)
        return sorted(found, key=lambda call: (call[2].rsplit(":", 1)[0], int(call[2].rsplit(":", 1)[1])))

    patches: dict[tuple[str, str], Patch] = {}
    placed: set[str] = set()  # "file:line" of every call attributed to a workflow type
    for name, (stem, cls) in classes.items():
        workflow_type = _workflow_name(cls)
        if workflow_type is None:
            continue
        for patch_id, kind, where in calls_in(stem, cls, set()):
            placed.add(where)
            key = (patch_id, workflow_type)
            before = patches.get(key)
            deprecated = kind == "deprecate_patch" and (before is None or before.deprecated)
            patches[key] = Patch(patch_id, workflow_type, before.where if before else where, deprecated)
    for stem, (path, tree) in trees.items():
        for node in ast.walk(tree):
            if _patch_call(node) and (where := f"{package}/{path.name}:{node.lineno}") not in placed:
                raise ScanError(f"{where}: a patch call outside any @workflow.defn class (or a base class of one): "
                                "no workflow type to check its open runs for")
    return sorted(patches.values(), key=lambda p: (p.workflow_type, p.id))


def verdict(patch: Patch, open_before: int, deployed_since: datetime) -> str:
    """What may happen to ``patch`` given the open runs of its type started before the deploy."""
    if open_before:
        runs = "open run" if open_before == 1 else "open runs"
        keep = "keep deprecated" if patch.deprecated else "keep"
        return f"{keep}: {open_before} {runs} of {patch.workflow_type} started before {_stamp(deployed_since)}"
    return "can remove" if patch.deprecated else "can deprecate"


def parse_deployed_since(text: str, now: datetime | None = None) -> datetime:
    """An ISO 8601 time (``Z`` or an offset; none means UTC), not in the future."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise typer.BadParameter(f"not an ISO 8601 time: {text!r} (e.g. 2026-12-03T18:00:00Z)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    if moment > (now or datetime.now(timezone.utc)):
        raise typer.BadParameter(f"{_stamp(moment)} is in the future: the deploy has not finished yet")
    return moment


async def open_before(client, workflow_types: set[str], task_queue: str, deployed_since: datetime) -> dict[str, int]:
    """Per workflow type: its open runs started before ``deployed_since`` (one count each)."""
    return {t: (await client.count_workflows(open_runs_query(t, task_queue, deployed_since))).count
            for t in sorted(workflow_types)}


DeployedSince = Annotated[Optional[str], typer.Option(
    "--deployed-since", callback=lambda text: text and _stamp(parse_deployed_since(text)),
    help="when the release of this code (every patch listed) finished rolling out: from then on every "
         "control-plane worker ran it. ISO 8601, e.g. 2026-12-03T18:00:00Z (no offset: UTC)")]
TaskQueue = Annotated[Optional[str], typer.Option(
    "--task-queue", envvar=TASK_QUEUE_ENV,
    help="the control plane's task queue, where every workflow runs (default: gpufleet's)")]
RENEWED_COLUMNS = ["workflow", "asked", "closed meanwhile"]

patches_app = typer.Typer()


@patches_app.callback(invoke_without_command=True)
def patches(
    ctx: typer.Context,
    deployed_since: DeployedSince = None,
    workflow: Annotated[Optional[str], typer.Option(help="only this workflow type's patches, e.g. NodeJoin")] = None,
    task_queue: TaskQueue = None,
    output: OutputFormat = "table",
    address: Address = "localhost:7233",
) -> None:
    """Every workflow patch id in the code, its workflow type, the open runs of that type started
    before --deployed-since, and whether it can be deprecated (or, deprecated already, removed).
    Changes nothing; see docs/design/patches.md for the rule. `gpufleet patches renew` asks the
    entity runs from before the deploy to move on."""
    if ctx.invoked_subcommand is not None:
        return
    if deployed_since is None:
        raise typer.BadParameter("required: when the release of this code finished rolling out",
                                 param_hint="'--deployed-since'")
    since = parse_deployed_since(deployed_since)
    try:
        found = scan_patches()
    except (ScanError, SyntaxError) as error:
        fail(f"cannot list the patches: {error}")
    if workflow is not None:
        found = [p for p in found if p.workflow_type == workflow]
        if not found:
            fail(f"--workflow: no patches in a workflow type named {workflow!r}", 2)
    config = settings(address)
    queue = task_queue or config.task_queue

    async def counts() -> dict[str, int]:
        client = await connect(config)
        return await open_before(client, {p.workflow_type for p in found}, queue, since)

    before = run(counts())
    show_rows(f"workflow patches (deployed since {_stamp(since)})", COLUMNS,
              [[p.id, p.workflow_type, p.where, str(before[p.workflow_type]),
                verdict(p, before[p.workflow_type], since)] for p in found], output, drop_narrow=NARROW)


@patches_app.command("renew")
def renew(
    deployed_since: Annotated[str, typer.Option(
        "--deployed-since", callback=lambda text: text and _stamp(parse_deployed_since(text)),
        help="when the release now running finished rolling out (as for `gpufleet patches`): every entity run "
             "started before it is asked. ISO 8601, e.g. 2026-12-03T18:00:00Z (no offset: UTC)")],
    workflow: Annotated[Optional[str], typer.Option(
        help=f"only this entity type's runs ({', '.join(sorted(flows.ENTITIES))}; default: every one)")] = None,
    task_queue: TaskQueue = None,
    output: OutputFormat = "table",
    address: Address = "localhost:7233",
) -> None:
    """Ask every running entity run started before --deployed-since to continue as new.

    Each continues as new at its next safe point (its `renew` signal), as on the server's
    suggestion: the new run starts on the code deployed since, and the patches the old runs held
    (`keep: N open runs of Node ...`) may go. Prints how many runs of each type it asked. Most
    move on within seconds; one with work in flight once that ends (a Site's fill, evacuation or
    retirement, a Node's repair, Demand's retirements). Other workflow types are no entities:
    their runs end by themselves. Only once the deploy has finished: a run whose signal reaches
    a worker of a release before `renew` ignores it, and every later one."""
    from client import InvalidArgument

    since = parse_deployed_since(deployed_since)
    config = settings(address)
    try:
        renewed = run(fleet_client(config).renew_entities(
            since, None if workflow is None else [workflow], task_queue=task_queue or config.task_queue))
    except InvalidArgument as error:
        fail(f"--{error.field.replace('_', '-')}: {error.problems[0][1]}", 2)
    show_rows(f"entity runs started before {_stamp(since)} asked to renew", RENEWED_COLUMNS,
              [[r.workflow_type, str(r.asked), str(r.closed)] for r in renewed], output)
    err.print(f"`gpufleet patches --deployed-since {_stamp(since)}` counts the runs not yet renewed; a run whose "
              "signal reached a worker of a release before `renew` ignores it, and any sent again, until Temporal "
              "suggests it continue as new")
