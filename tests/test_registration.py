"""The seams between processes are declared once (``fleet/contracts``) and the declarations hold.

- Every activity declared in ``fleet/contracts/activities.py`` has exactly one body registered
  by a worker the product runs, under the same name, taking the same input type and returning
  the same type (a node agent's activity is declared to return ``NodeAnswer``, the undecoded
  payload: its body runs on the node's queue).
- Every workflow type, signal, update and query in ``fleet/contracts/workflows.py`` is one a
  registered workflow answers, and every handler a registered workflow has is declared there.
- Nothing outside ``fleet/contracts`` names an activity, workflow, signal, update or query with
  a bare string (a visibility query's ``WorkflowType = ...`` included), and no workflow
  schedules an activity by anything but its declaration: a misspelt name would only show when
  the call ran (an activity task waiting on its queue for a worker that never comes, a signal
  to a handler that does not exist).

Read from the source with ``ast`` and from the registered functions and classes.
"""

from __future__ import annotations

import ast
import inspect
import re
import typing
from pathlib import Path

import pytest
from temporalio import activity, workflow

from fleet.contracts import activities as declared_activities
from fleet.contracts import workflows as declared_workflows
from fleet.contracts.activities import NodeAnswer

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ["cli", "client", "workers", "workflows", "activities", "sim", "providers", "fleet", "bench"]
SCHEDULES = {"execute_activity", "start_activity", "execute_local_activity", "start_local_activity"}
#: Every SDK call whose first argument is a name Temporal routes by.
NAMED_CALLS = SCHEDULES | {
    "execute_child_workflow", "start_child_workflow", "signal", "query", "execute_update", "start_update",
    "start_workflow", "execute_workflow", "signal_with_start", "execute_update_with_start_workflow",
    "start_update_with_start_workflow", "get_external_workflow_handle", "get_workflow_handle",
}
NAME_KEYWORDS = {"start_signal"}


def _product_files() -> list[Path]:
    return [p for d in PRODUCT for p in sorted((ROOT / d).rglob("*.py"))
            if "contracts" not in p.relative_to(ROOT).parts]


def _declarations() -> dict[str, object]:
    return {name: fn for name, fn in vars(declared_activities).items()
            if callable(fn) and activity._Definition.from_callable(fn) is not None}


def registered_activities(state_dir: Path) -> dict[str, list[object]]:
    """Activity name → its bodies, for every worker the product runs (a simulated fleet's
    environment in ``state_dir``: only the functions are read)."""
    from activities import control_plane_activities
    from activities.entity_update import EntityUpdateActivities
    from activities.env import FleetEnv
    from activities.node_agent import NodeAgentActivities
    from fleet.settings import Settings
    from sim.gpu import SimGpuBackend

    env = FleetEnv.from_settings(Settings(state_dir=state_dir))
    node_agent = NodeAgentActivities("n", SimGpuBackend.__new__(SimGpuBackend)).all()
    bodies: dict[str, list[object]] = {}
    for fn in [*control_plane_activities(env), *EntityUpdateActivities().all(), *node_agent]:
        bodies.setdefault(activity._Definition.must_from_callable(fn).name, []).append(fn)
    return bodies


def _signature(fn) -> tuple[list[object], object]:
    hints = typing.get_type_hints(inspect.unwrap(fn))
    parameters = [p.name for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    return [hints.get(p) for p in parameters], hints.get("return", type(None))


def test_every_declared_activity_has_one_body_with_its_types(tmp_path: Path) -> None:
    from activities.node_agent import NodeAgentActivities

    bodies = registered_activities(tmp_path)
    declared = _declarations()
    assert len(declared) >= 70, sorted(declared)
    problems = []
    for name, stub in sorted(declared.items()):
        found = bodies.get(name, [])
        if len(found) != 1:
            problems.append(f"{name}: {len(found)} registered bodies")
            continue
        body = found[0]
        (stub_inputs, stub_result), (body_inputs, body_result) = _signature(stub), _signature(body)
        if stub_inputs != body_inputs:
            problems.append(f"{name}: declared input {stub_inputs}, the body takes {body_inputs}")
        if stub_result is NodeAnswer:
            if not isinstance(getattr(body, "__self__", None), NodeAgentActivities):
                problems.append(f"{name}: declared a node's answer, but its body is not the node agent's")
        elif stub_result != body_result:
            problems.append(f"{name}: declared result {stub_result}, the body returns {body_result}")
    undeclared = sorted(set(bodies) - set(declared))
    assert not undeclared, f"registered, not declared in fleet/contracts/activities.py: {undeclared}"
    assert not problems, "\n".join(problems)


def test_every_declared_name_is_a_registered_handler_and_back() -> None:
    from workflows import ALL_WORKFLOWS

    registered = set()
    for cls in ALL_WORKFLOWS:
        defn = workflow._Definition.must_from_class(cls)
        registered.add(("workflow", defn.name, defn.name))
        registered |= {("signal", name, defn.name) for name in defn.signals if name}
        registered |= {("update", name, defn.name) for name in defn.updates if name}
        registered |= {("query", name, defn.name) for name in defn.queries if name}
    declared = set()
    for holder in vars(declared_workflows).values():
        if isinstance(holder, type) and holder is not declared_workflows.Name:
            declared |= {(n.kind, str(n), n.of) for n in vars(holder).values() if isinstance(n, declared_workflows.Name)}
    assert declared - registered == set(), "declared, answered by no registered workflow"
    assert registered - declared == set(), "a registered handler missing from fleet/contracts/workflows.py"


def _named_calls(path: Path) -> list[tuple[int, str, ast.expr]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and node.func.attr in NAMED_CALLS and node.args:
            found.append((node.lineno, node.func.attr, node.args[0]))
        found += [(node.lineno, k.arg, k.value) for k in node.keywords if k.arg in NAME_KEYWORDS]
    return found


def _literal_start(expr: ast.expr) -> str:
    """The literal text a string (or an f-string's first part) starts with."""
    if isinstance(expr, ast.JoinedStr) and expr.values:
        expr = expr.values[0]
    return expr.value if isinstance(expr, ast.Constant) and isinstance(expr.value, str) else ""


def _is_text(expr: ast.expr) -> bool:
    """A string, or a choice between names one of which is a string (``"hold" if h else "release"``)."""
    if isinstance(expr, ast.IfExp):
        return _is_text(expr.body) or _is_text(expr.orelse)
    return isinstance(expr, ast.JoinedStr) or (isinstance(expr, ast.Constant) and isinstance(expr.value, str))


def test_nothing_outside_the_contracts_names_a_seam_with_a_bare_string() -> None:
    """Names come from ``fleet/contracts``, ids from ``fleet/naming``. The simulator's SQL
    ``query(...)`` calls are not Temporal's: a string there is SQL."""
    bare = []
    for path in _product_files():
        where = path.relative_to(ROOT)
        for line, call, first in _named_calls(path):
            if call == "query" and _literal_start(first).lstrip().upper().startswith("SELECT"):
                continue
            if _is_text(first):
                bare.append(f"{where}:{line}: {call}({ast.unparse(first)})")
    assert not bare, "\n".join(bare)


#: A visibility query that spells a workflow type out (``WorkflowType = "Site"``), not
#: ``WorkflowType = "{flows.Site.TYPE}"``.
SPELT_TYPE = re.compile(r"""WorkflowType\s*=\s*['"]\w""")


def test_no_visibility_query_spells_a_workflow_type_out() -> None:
    spelt = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in _product_files()
             for number, line in enumerate(path.read_text().splitlines(), 1) if SPELT_TYPE.search(line)]
    assert not spelt, "\n".join(spelt)
    assert SPELT_TYPE.search("""query = 'WorkflowType = "NodeJoin" AND ExecutionStatus = "Running"'""")
    assert not SPELT_TYPE.search("""f'WorkflowType = "{flows.NodeJoin.TYPE}" AND ExecutionStatus = "Running"'""")


def test_workflows_schedule_activities_by_their_declaration() -> None:
    by_other = []
    names = set(_declarations())
    for path in sorted((ROOT / "workflows").glob("*.py")):
        for line, call, first in _named_calls(path):
            if call not in SCHEDULES:
                continue
            refs = [n for n in ast.walk(first)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "act"]
            if _is_text(first) or not refs or any(r.attr not in names for r in refs):
                by_other.append(f"workflows/{path.name}:{line}: {ast.unparse(first)}")
    assert not by_other, "\n".join(by_other)


def test_the_scan_finds_the_calls() -> None:
    """Not vacuous: the product makes dozens of named calls, and the scan sees a bare one."""
    calls = [c for p in _product_files() for c in _named_calls(p)]
    assert len(calls) >= 150
    planted = ast.parse('await handle.signal("quarantine", arg)\nhandle.start_workflow(f"Node", x)\n'
                        'await handle.execute_update(flows.GpuRepair.hold if h else "release")')
    assert sum(1 for n in ast.walk(planted) if isinstance(n, ast.Call) and _is_text(n.args[0])) == 3


@pytest.mark.parametrize("typo", ["watch_nodes", "check_credential"])
def test_a_misspelt_name_is_caught(typo: str, tmp_path: Path) -> None:
    """The check itself: a name no worker registers is reported."""
    assert typo not in registered_activities(tmp_path)
    assert typo not in _declarations()


def test_a_handler_declared_on_a_mixin_cannot_be_sent_by_mistake() -> None:
    """``Entity.renew`` is declared once on the mixin and becomes a ``Name`` on each entity type.
    The mixin's own is no name: the SDK ``str()``-s whatever is not callable, and sent a signal
    named after the object's repr, which no run answers (a renew that silently did nothing)."""
    with pytest.raises(TypeError, match=r"flows\.Node\.renew"):
        str(declared_workflows.Entity.renew)
    assert declared_workflows.Node.renew == "renew" and declared_workflows.Node.renew.of == "Node"
