"""Turn our error taxonomy into Temporal failures that retry policies can name."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

from temporalio.exceptions import ApplicationError

from fleet.errors import FleetError, ProviderError

F = TypeVar("F", bound=Callable)


def as_application_error(error: FleetError) -> ApplicationError:
    details = {"provider": error.provider, "code": error.code} if isinstance(error, ProviderError) else {}
    return ApplicationError(str(error), details, type=error.type_name, non_retryable=not error.retryable)


def typed_errors(fn: F) -> F:
    """Raise ``FleetError``s as ``ApplicationError(type=<class name>)``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FleetError as error:
            raise as_application_error(error) from error

    return wrapper  # type: ignore[return-value]
