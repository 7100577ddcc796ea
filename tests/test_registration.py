"""Every activity a workflow schedules by name is registered by a worker that polls for it, with
the input type the call builds; every child workflow started by name is a registered workflow.

The workflows name activities by string (the activities' module imports providers, which the
workflow sandbox must not load), so a misspelt name or an input of the wrong model would only
show when the call ran: the activity task would wait on its queue for a worker that never comes,
or fail to decode. Read from the source with ``ast`` (every ``execute_activity`` and friends in
``workflows/``) against what ``workers/control_plane.py`` and ``workers/node_agent.py`` register.
"""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest
from temporalio import activity, workflow

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = {"execute_activity", "start_activity", "execute_local_activity", "start_local_activity"}
CHILDREN = {"execute_child_workflow", "start_child_workflow"}


def _calls(kinds: set[str]) -> list[tuple[str, int, ast.Call]]:
    found = []
    for path in sorted((ROOT / "workflows").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in kinds and node.args):
                found.append((f"workflows/{path.name}", node.lineno, node))
    return found


def scheduled_by_name() -> list[tuple[str, str, str | None]]:
    """(where, activity name, the input model the call builds, if it builds one in place)."""
    out = []
    for where, line, call in _calls(SCHEDULES):
        first = call.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue  # by reference: the SDK checks those
        built = None
        if len(call.args) > 1 and isinstance(call.args[1], ast.Call) and isinstance(call.args[1].func, ast.Name):
            built = call.args[1].func.id
        out.append((f"{where}:{line}", first.value, built))
    return out


def registered_activities(state_dir: Path) -> dict[str, object]:
    """Activity name → its function, for every worker the product runs (a simulated fleet's
    environment in ``state_dir``: only the functions are read)."""
    from activities import control_plane_activities
    from activities.entity_update import EntityUpdateActivities
    from activities.env import FleetEnv
    from activities.node_agent import NodeAgentActivities
    from fleet.settings import Settings
    from providers.sim import SimGpuBackend

    env = FleetEnv.from_settings(Settings(state_dir=state_dir))
    functions = [*control_plane_activities(env), *EntityUpdateActivities().all(),
                 *NodeAgentActivities("n", SimGpuBackend.__new__(SimGpuBackend)).all()]
    return {activity._Definition.must_from_callable(fn).name: fn for fn in functions}


def _input_type_name(fn) -> str | None:
    parameters = [p for p in inspect.signature(fn).parameters.values()]
    if not parameters:
        return None
    hints = typing.get_type_hints(fn)
    hint = hints.get(parameters[0].name)
    return getattr(hint, "__name__", None)


def test_the_scan_finds_the_calls() -> None:
    """Not vacuous: the workflows schedule dozens of activities by name."""
    names = {name for _, name, _ in scheduled_by_name()}
    assert len(names) >= 40, sorted(names)
    assert {"watch_node", "check_credentials", "provision_machine"} <= names


def test_every_activity_a_workflow_schedules_is_registered_with_the_input_it_is_given(tmp_path: Path) -> None:
    registered = registered_activities(tmp_path)
    missing = [(where, name) for where, name, _ in scheduled_by_name() if name not in registered]
    assert not missing, f"scheduled by name, registered by no worker: {missing}"
    wrong = []
    for where, name, built in scheduled_by_name():
        if built is None or not built[0].isupper():
            continue
        expected = _input_type_name(registered[name])
        if expected is not None and expected != built:
            wrong.append(f"{where}: {name} takes {expected}, the call builds {built}")
    assert not wrong, "\n".join(wrong)


def test_every_child_workflow_started_by_name_is_registered() -> None:
    from workflows import ALL_WORKFLOWS

    names = {workflow._Definition.must_from_class(cls).name for cls in ALL_WORKFLOWS}
    started = [(f"{where}:{line}", call.args[0].value) for where, line, call in _calls(CHILDREN)
               if isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)]
    assert started, "the scan finds the workflows' child starts"
    missing = [(where, name) for where, name in started if name not in names]
    assert not missing, f"started by name, not a registered workflow: {missing}"


@pytest.mark.parametrize("typo", ["watch_nodes", "check_credential"])
def test_a_misspelt_name_is_caught(typo: str, tmp_path: Path) -> None:
    """The check itself: a name no worker registers is reported."""
    assert typo not in registered_activities(tmp_path)
