"""The provider error taxonomy (product rule 6).

Adapters raise these plain exceptions; activities turn them into Temporal
``ApplicationError``s whose ``type`` is the class name, so retry policies and
workflows can name them. Nothing here imports Temporal or a cloud SDK.
"""

from __future__ import annotations


class FleetError(Exception):
    """Base class: every error the control plane reasons about by type."""

    #: Whether Temporal may retry the activity that raised it.
    retryable: bool = False

    @property
    def type_name(self) -> str:
        return type(self).__name__


class ProviderError(FleetError):
    """A provider call failed in a way we classified."""

    def __init__(self, message: str, *, provider: str = "", code: str = "") -> None:
        super().__init__(message)
        self.provider = provider
        self.code = code


class NoCapacity(ProviderError):
    """The site has no machine of this kind right now: try the next candidate."""


class OverQuota(ProviderError):
    """The account hit a limit only a person can raise."""


class BadCredentials(ProviderError):
    """The account's credentials are missing, wrong or revoked: stop calling it."""


class Transient(ProviderError):
    """Rate limit, 5xx, timeout, unknown code: retried with backoff."""

    retryable = True


class InvalidRequest(ProviderError):
    """The request itself is wrong; retrying cannot help."""


class NotFound(ProviderError):
    """The machine (or other object) does not exist at the provider."""


class InvalidInput(FleetError):
    """Workflow or config input failed validation; names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


#: Every error type a workflow may see from an activity, by name.
ERROR_TYPES: dict[str, type[FleetError]] = {
    cls.__name__: cls
    for cls in (NoCapacity, OverQuota, BadCredentials, Transient, InvalidRequest, NotFound, InvalidInput)
}
#: Types an activity retry policy must not retry.
NON_RETRYABLE_TYPES: list[str] = [name for name, cls in ERROR_TYPES.items() if not cls.retryable]
