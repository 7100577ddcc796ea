"""The provider error taxonomy (product rule 6), and the cluster port's beside it.

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


class AccountRevoked(BadCredentials):
    """The account guard refused the call: the account is already known revoked, so no
    provider was asked. Workflows see it as ``BadCredentials`` (the rule is the same);
    in-process code tells it from a provider's own answer by its class."""

    @property
    def type_name(self) -> str:
        return BadCredentials.__name__


class OfferBlocked(OverQuota):
    """The account guard refused the call: the offer is known over quota (no provider asked)."""

    @property
    def type_name(self) -> str:
        return OverQuota.__name__


# -- the cluster port (the Kubernetes API), typed like provider errors ------------------------
class ClusterError(FleetError):
    """The Kubernetes API answered in a way we classified; ``code`` is the HTTP status."""

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class ClusterForbidden(ClusterError):
    """401/403: the control plane's identity may not do this (RBAC, an expired token).
    A person must grant it (``gpufleet cluster check`` names the verb); retrying cannot.
    Not ``BadCredentials``: that would revoke a provider account for a cluster problem."""


class ClusterInvalid(ClusterError):
    """400/405/415/422: the API refused the object itself (an invalid label value, a
    malformed patch); the same request will be refused again."""


class ClusterConflict(ClusterError):
    """409 that kept coming back through the adapter's own bounded re-reads: another
    writer is busy on the object; a later attempt may win."""

    retryable = True


class InvalidInput(FleetError):
    """Workflow or config input failed validation; names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


#: Every error type a workflow may see from an activity, by name.
ERROR_TYPES: dict[str, type[FleetError]] = {
    cls.__name__: cls
    for cls in (NoCapacity, OverQuota, BadCredentials, Transient, InvalidRequest, NotFound, InvalidInput,
                ClusterForbidden, ClusterInvalid, ClusterConflict)
}
#: Types an activity retry policy must not retry.
NON_RETRYABLE_TYPES: list[str] = [name for name, cls in ERROR_TYPES.items() if not cls.retryable]
