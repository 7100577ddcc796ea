"""What the provider contract suite needs from each adapter's test harness.

A harness points a real adapter at a local fake that speaks the provider's real
wire format. Harness fixtures are named ``<provider>_harness`` (``own_dc_harness``
for own-dc) and are function-scoped: each test gets a clean fake world.

Optional attributes the contract suite uses when present:

* ``error_kinds``: the kinds ``fail_next_create`` supports (default: all of
  ``ERROR_KINDS``); a kind the provider cannot produce is skipped.
* ``secret``: the credential value the adapter reads, so the suite can check
  that it never appears in returned models or error messages.
* ``unknown_id``: a well-formed machine id the fake does not know (default
  ``"does-not-exist-0000"``).
* ``secret_in_header``: False where the credential travels encoded (HTTP basic auth), so that
  a control character in it is no error (default True: sent as it is, ``Bearer <key>``).
"""

from __future__ import annotations

import traceback
from typing import Protocol, runtime_checkable

from temporalio.api.failure.v1 import Failure
from temporalio.converter import DataConverter

from fleet.errors import BadCredentials, InvalidRequest, NoCapacity, OverQuota, ProviderError, Transient
from fleet.models import MachineSpec
from providers.base import Provider

#: Error kinds ``fail_next_create`` understands, and the class each must raise.
ERROR_KINDS: dict[str, type[ProviderError]] = {
    "NoCapacity": NoCapacity,
    "OverQuota": OverQuota,
    "BadCredentials": BadCredentials,
    "Transient": Transient,
    "InvalidRequest": InvalidRequest,
}


@runtime_checkable
class Harness(Protocol):
    #: The adapter under test, pointed at the fake.
    provider: Provider
    #: A MachineSpec the fake accepts.
    spec: MachineSpec

    def fail_next_create(self, kind: str) -> None:
        """Make the fake answer the next create with the provider's real error for ``kind``."""
        ...

    def machine_count(self) -> int:
        """Live machines in the fake."""
        ...


def stored_failure(error: BaseException) -> str:
    """All that leaves the worker of an activity's failure: the Failure in workflow history (message,
    type, details and the whole cause chain, as Temporal's failure converter encodes them) and the
    traceback the worker logs with it."""
    failure = Failure()
    DataConverter.default.failure_converter.to_failure(error, DataConverter.default.payload_converter, failure)
    return str(failure) + "".join(traceback.format_exception(error))
