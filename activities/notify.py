"""The notify webhook: a JSON POST when a person must act.

The URL is a credentials reference (``notify_webhook: {env|file|secret}``), read
here only, because a webhook URL usually carries its secret in the path. A
failure says what went wrong (the status code, the kind of connection error) and
names the reference, never the URL: the message ends up in workflow history, the
worker's log and the entity's details. httpx logs each request's URL at INFO;
the filter below hides the webhook's.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from temporalio.exceptions import ApplicationError

from fleet.errors import FleetError
from fleet.models import CredentialsRef
from providers.credentials import read_secret

TIMEOUT_SECONDS = 10
HIDDEN = "<notify webhook>"
#: Webhook URLs read so far (one per configured reference): never written to a log.
_urls: set[str] = set()


class _HideWebhookUrls(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if _urls:
            text = record.getMessage()
            hidden = text
            for url in _urls:
                hidden = hidden.replace(url, HIDDEN)
            if hidden != text:
                record.msg, record.args = hidden, None
        return True


logging.getLogger("httpx").addFilter(_HideWebhookUrls())


def _logged_forms(url: str) -> set[str]:
    """``url`` and the form httpx writes it in its log line (the request's URL: scheme and host
    lowered, a default port dropped, ``..`` resolved, some characters escaped), which a Teams /
    Power Automate URL (``https://...logic.azure.com:443/...&sig=<secret>``) is not as given."""
    forms = {url}
    try:
        forms.add(str(httpx.Request("POST", url).url))
    except Exception:  # noqa: BLE001 - not a URL httpx takes: post() refuses it, nothing is logged
        pass
    return forms


def _failed(ref: CredentialsRef, what: str, *, permanent: bool) -> ApplicationError:
    return ApplicationError(f"notify webhook {ref.describe()}: {what}", type="NotifyFailed", non_retryable=permanent)


async def post(ref: CredentialsRef | None, payload: dict) -> bool:
    """POST ``payload``; False when no webhook is configured. Raises ``NotifyFailed``."""
    if ref is None:
        return False
    try:
        # A Kubernetes Secret is read over the network: not on the event loop.
        url = await asyncio.to_thread(read_secret, ref)
    except FleetError as error:
        raise _failed(ref, str(error), permanent=True) from None
    _urls.update(_logged_forms(url))
    try:
        async with httpx.AsyncClient(timeout=TIMEOUT_SECONDS) as http:
            response = await http.post(url, json=payload)
    except httpx.HTTPError as error:
        # No ``from error``: httpx's exceptions name the URL, and a cause travels into history.
        raise _failed(ref, f"not reached ({type(error).__name__})", permanent=False) from None
    except (httpx.InvalidURL, ValueError):  # not a URL at all
        raise _failed(ref, "the reference does not hold a valid http(s) URL", permanent=True) from None
    if response.status_code >= 400:
        # A 4xx other than a timeout or rate limit will not change by retrying.
        permanent = response.status_code < 500 and response.status_code not in (408, 429)
        raise _failed(ref, f"answered HTTP {response.status_code}", permanent=permanent)
    return True
