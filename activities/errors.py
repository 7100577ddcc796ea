"""Turn our error taxonomy into Temporal failures that retry policies can name."""

from __future__ import annotations

import functools
import inspect
from typing import Callable, TypeVar

from temporalio.exceptions import ApplicationError

from fleet.errors import ClusterError, FleetError, ProviderError

F = TypeVar("F", bound=Callable)


def as_application_error(error: FleetError) -> ApplicationError:
    if isinstance(error, ProviderError):
        details = {"provider": error.provider, "code": error.code}
    elif isinstance(error, ClusterError):
        details = {"code": error.code}
    else:
        details = {}
    return ApplicationError(str(error), details, type=error.type_name, non_retryable=not error.retryable)


def typed_errors(fn: F) -> F:
    """Raise ``FleetError``s as ``ApplicationError(type=<class name>)``.

    The ``FleetError`` stays the cause (its traceback says where an adapter raised it); what is
    chained below it travels into workflow history and worker logs too, so an adapter chains only
    failures that cannot quote a request's secrets (``providers.base.translated``)."""

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def async_wrapper(*args, **kwargs):
            try:
                return await fn(*args, **kwargs)
            except FleetError as error:
                raise as_application_error(error) from error

        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FleetError as error:
            raise as_application_error(error) from error

    return wrapper  # type: ignore[return-value]
