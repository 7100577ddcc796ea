"""Validate raw workflow input, signals and update arguments inside the workflow.

Workflows take a plain JSON value and validate it here: a payload the data
converter cannot decode would fail the workflow *task* and retry forever, while
this fails the workflow at once, non-retryable, naming the field. Signals cannot
be refused, so a bad one is logged (naming the field) and dropped; updates are
refused by their validator with the same message.

``first_problem`` is the backstop under every model (the worker's input guard in
workers/ runs it on every start, signal and update): whatever a model forgot, a
JSON value with a non-finite or out-of-range number, an overlong string or deep
nesting never reaches workflow code.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, TypeVar

from pydantic import BaseModel, ValidationError
from temporalio import workflow
from temporalio.exceptions import ApplicationError

M = TypeVar("M", bound=BaseModel)

#: Integers beyond this lose precision in JSON (and no field of ours needs them).
MAX_NUMBER = 2**53
#: No string we take is near this; the payload limit (2 MB) is the only other bound.
MAX_STRING = 64 * 1024
MAX_DEPTH = 32
#: Free text an operator passes to an update (a reason, a note).
MAX_NOTE = 1000


def invalid_input(message: str, fields: list[str]) -> ApplicationError:
    return ApplicationError(message, {"fields": fields}, type="InvalidInput", non_retryable=True)


def _walk(value: Any, path: str, depth: int) -> Iterator[tuple[str, str]]:
    if depth > MAX_DEPTH:
        yield path or "(input)", f"nested deeper than {MAX_DEPTH} levels"
        return
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        yield path or "(input)", "must be a finite number"
    elif isinstance(value, (int, float)) and abs(value) > MAX_NUMBER:
        yield path or "(input)", f"must be between -{MAX_NUMBER} and {MAX_NUMBER}"
    elif isinstance(value, str) and len(value) > MAX_STRING:
        yield path or "(input)", f"longer than {MAX_STRING} characters"
    elif isinstance(value, dict):
        for key, item in value.items():
            key = str(key)
            if len(key) > MAX_STRING:
                yield path or "(input)", f"has a key longer than {MAX_STRING} characters"
                return
            yield from _walk(item, f"{path}.{key}" if path else key, depth + 1)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _walk(item, f"{path}.{index}" if path else str(index), depth + 1)


def json_kind(value: Any) -> str:
    """What an operator sent, in JSON's words."""
    if value is None:
        return "null"
    for kind, names in (("a boolean", (bool,)), ("a number", (int, float)), ("a string", (str,)),
                        ("an array", (list, tuple)), ("an object", (dict, BaseModel))):
        if isinstance(value, names):
            return kind
    return type(value).__name__


def first_problem(value: Any) -> tuple[str, str] | None:
    """``(field, problem)`` for the first value no input may hold, else None."""
    return next(_walk(value, "", 0), None)


def refusal(name: str, problems: list[tuple[str, str]]) -> ApplicationError:
    """``InvalidInput`` for a start that what the workflow read refuses (the served models, the
    fleet config): ``invalid <name>: field: problem; ...``, naming each field."""
    text = "; ".join(f"{field}: {problem}" for field, problem in problems)
    return invalid_input(f"invalid {name}: {text}", [field for field, _ in problems])


def describe(error: ValidationError) -> tuple[str, list[str]]:
    """Pydantic's errors in an operator's words: ``field: problem; ...`` and the fields."""
    problems, fields = [], []
    for err in error.errors(include_url=False):
        field = ".".join(str(p) for p in err["loc"]) or "(input)"
        message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        problems.append(f"{field}: {message}")
        fields.append(field)
    return "; ".join(problems), fields


def validate(model: type[M], raw: Any, context: dict[str, Any] | None = None) -> M:
    """``model`` from ``raw``, or ``InvalidInput`` naming every bad field. ``context``: pydantic's
    validation context (a check a workflow leaves out where it does not apply: ``TOKEN_CHECKS``)."""
    if isinstance(raw, model):
        return raw
    problem = first_problem(raw)
    if problem is not None:
        raise invalid_input(f"invalid {model.__name__}: {problem[0]}: {problem[1]}", [problem[0]])
    try:
        return model.model_validate(raw, context=context)
    except ValidationError as error:
        text, fields = describe(error)
        raise invalid_input(f"invalid {model.__name__}: {text}", fields) from None


#: A workflow's start input: a bad one fails the workflow (raised from ``run``).
parse_input = validate


def parse_signal(model: type[M], raw: Any, signal: str) -> M | None:
    """The signal's payload, or None after logging why it is dropped (a signal cannot be refused)."""
    try:
        return validate(model, raw)
    except ApplicationError as error:
        workflow.logger.warning("dropped signal %s: %s", signal, error.message)
        return None


def check_text(name: str, value: Any, max_length: int = MAX_NOTE) -> str:
    """An update's free-text argument (a reason, a note): a string of bounded length."""
    if not isinstance(value, str):
        raise invalid_input(f"{name}: must be a string, got {json_kind(value)}", [name])
    if len(value) > max_length:
        raise invalid_input(f"{name}: longer than {max_length} characters", [name])
    return value
