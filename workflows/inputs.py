"""Validate raw workflow input inside the workflow.

Workflows take a plain dict and validate it here: a payload the data converter
cannot decode would fail the workflow *task* and retry forever, while this
fails the workflow at once, non-retryable, naming the field.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from temporalio.exceptions import ApplicationError

M = TypeVar("M", bound=BaseModel)


def parse_input(model: type[M], raw: Any) -> M:
    if isinstance(raw, model):
        return raw
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        problems = []
        for err in error.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(input)"
            message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(f"{field}: {message}")
        raise ApplicationError(
            f"invalid {model.__name__}: " + "; ".join(problems),
            {"fields": [".".join(str(p) for p in err["loc"]) for err in error.errors()]},
            type="InvalidInput",
            non_retryable=True,
        ) from None
