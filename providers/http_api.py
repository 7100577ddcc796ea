"""What the adapters that speak HTTP themselves (Lambda Cloud, a BMC's Redfish) share: a call whose
transport fails is Transient, and an error answer's JSON ``error`` object, however malformed."""

from __future__ import annotations

from typing import Any, Callable

import httpx

from fleet.errors import Transient


def send(call: Callable[[], httpx.Response], what: str, provider: str) -> httpx.Response:
    """The answer to ``call``; no answer (a timeout, a connection failure) is Transient, named ``what``.

    Not chained to httpx's exception: a cause travels into workflow history and worker logs, and
    h11 quotes a header it refuses whole (``Illegal header value b'Bearer <key>'``)."""
    try:
        return call()
    except httpx.TimeoutException:
        raise Transient(f"{what}: timeout", provider=provider, code="timeout") from None
    except httpx.TransportError as exc:
        code = type(exc).__name__
        raise Transient(f"{what}: {code}", provider=provider, code=code) from None


def error_object(response: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of an error answer: {} when the body is not JSON or holds none."""
    try:
        error = response.json().get("error") or {}
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}
