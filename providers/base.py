"""The one interface every GPU provider implements, and its error taxonomy.

Modelled on Karpenter's CloudProvider: a handful of verbs. Every method is
synchronous (the SDKs are) and runs inside a Temporal activity thread. Each
adapter maps its provider's error codes, as data in one table, to the
exceptions re-exported here; provider quirks stay inside the adapter module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from fleet.errors import (
    BadCredentials,
    InvalidRequest,
    NoCapacity,
    NotFound,
    OverQuota,
    ProviderError,
    Transient,
)
from fleet.models import Machine, MachineSpec, Offer

__all__ = [
    "Provider",
    "PowersOff",
    "ProviderError",
    "NoCapacity",
    "OverQuota",
    "BadCredentials",
    "Transient",
    "InvalidRequest",
    "NotFound",
    "translated",
    "transport_failure",
]


@runtime_checkable
class Provider(Protocol):
    """One provider account at one site (region)."""

    #: Provider kind: aws, lambda, nebius, hetzner, own-dc.
    name: str

    def create_machine(self, spec: MachineSpec, idempotency_key: str, user_data: str = "") -> Machine:
        """Create a machine, or return the one already created for this key. ``user_data``
        (its bootstrap cloud-config, holding a join token's secret) goes into the provider's
        own user-data field and nowhere else: never in a log line, error or returned model."""
        ...

    def delete_machine(self, machine_id: str) -> None:
        """Delete (or return to the pool). Deleting a gone machine succeeds."""
        ...

    def get_machine(self, machine_id: str) -> Machine:
        """The machine as the provider sees it; ``NotFound`` when unknown."""
        ...

    def list_machines(self) -> list[Machine]:
        """Machines this control plane created at this site."""
        ...

    def reboot_machine(self, machine_id: str) -> None:
        """Hard reboot (power cycle where the provider distinguishes)."""
        ...

    def reinstall_machine(self, machine_id: str, user_data: str = "") -> None:
        """Reimage the machine from its image; its node re-joins afterwards, with ``user_data``
        (a fresh bootstrap) where given. An adapter that cannot hand a reinstalled machine new
        user data refuses one (``InvalidRequest``): the repair ladder then replaces the node."""
        ...

    def list_offers(self) -> list[Offer]:
        """What this site can sell now, with availability."""
        ...


@runtime_checkable
class PowersOff(Protocol):
    """An optional capability: a provider that can power a machine off and leave it off.

    A reinstall on such a provider is two steps (``activities.repair``): power off, wait until
    the cluster sees the Node NotReady (kubeadm refuses to join while a Ready Node of its name
    exists), then ``reinstall_machine``. Hetzner and own racks have it; the clouds whose
    reinstall is refused (the node is replaced) need not."""

    def stop_machine(self, machine_id: str) -> None:
        """Power the machine off (a machine already off stays so); its allocation stays."""
        ...


@contextmanager
def translated(
    taxonomy_error: Callable[[Exception], ProviderError | None], *, answered: Callable[[Exception], bool]
) -> Iterator[None]:
    """Raise the block's SDK failures as the taxonomy: ``taxonomy_error`` names the error for one
    (None: not the SDK's, raised as it is). A taxonomy error raised inside passes untouched.

    Only a failure ``answered`` by the provider (its message is the provider's words) stays the
    taxonomy error's cause. Any other, the transport's above all, can quote the request: requests
    and h11 quote a header they refuse whole, ``Authorization: Bearer <key>`` included, and a
    cause travels into workflow history and worker logs. The taxonomy error names its type."""
    try:
        yield
    except ProviderError:
        raise
    except Exception as exc:
        error = taxonomy_error(exc)
        if error is None:
            raise
        if answered(exc):
            raise error from exc
        raise error from None


def transport_failure(exc: Exception, endpoint: str | None = None) -> str:
    """What an error message may say of a transport failure: its type (and, for urllib3's
    ``MaxRetryError``, the type of the ``reason`` its last try met), and the endpoint it names
    (botocore's ``endpoint_url``, else ``endpoint``: where it was sent) without user, password,
    query or fragment. Never the failure's own message, which quotes what the HTTP layer said: a
    header it refused, a proxy's URL, the URL a proxied request went to with its password."""
    said = type(exc).__name__
    reason = getattr(exc, "reason", None)
    if isinstance(reason, BaseException):
        said = f"{said}: {type(reason).__name__}"
    url = (getattr(exc, "kwargs", None) or {}).get("endpoint_url") or endpoint
    if not isinstance(url, str) or not url:
        return said
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", f":{parts.port}" if parts.port else ""
    except ValueError:  # not a URL after all
        return said
    return f"{said} ({parts.scheme}://{host}{port}{parts.path})"
