"""Read an account's secret from its reference, inside an activity only."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fleet.errors import BadCredentials
from fleet.models import CredentialsRef
from providers.cluster.base import AccessRule


def read_secret(ref: CredentialsRef | None, *, provider: str = "") -> str:
    """The secret value, without surrounding whitespace; ``BadCredentials`` naming the reference
    when it is missing or empty. Makes no network call except for a Kubernetes Secret.

    Stripped whatever its source: a Secret made with ``kubectl create secret --from-file``, or a
    variable or file written by ``echo``, ends in a newline that no API key holds (and that an HTTP
    client refuses in a header with an error quoting the whole header, key included)."""
    if ref is None:
        raise BadCredentials("no credentials reference configured for this account", provider=provider)
    value = ""
    if ref.env:
        value = os.environ.get(ref.env, "")
    elif ref.file:
        path = Path(ref.file).expanduser()
        try:
            value = path.read_text()
        except OSError:
            value = ""
    elif ref.secret:
        value = _read_kubernetes_secret(ref)
    value = value.strip()
    if not value:
        raise BadCredentials(f"credentials reference {ref.describe()} is missing or empty (or only whitespace)",
                             provider=provider)
    return value


def read_token(ref: CredentialsRef | None, *, provider: str = "") -> str:
    """The secret as an API token an HTTP header carries (``Authorization: Bearer <token>``);
    ``BadCredentials`` when it is missing, empty or not one (``header_safe``)."""
    return header_safe(read_secret(ref, provider=provider), ref, provider=provider)


def header_safe(value: str, ref: CredentialsRef | None, *, provider: str, part: str = "") -> str:
    """``value`` when a request header (or gRPC metadata) can carry it: printable ASCII. Else
    ``BadCredentials`` naming the reference (and ``part`` of it), never the value: an HTTP client
    refuses such a header with an error that quotes it whole, and as a transport failure it would
    be retried as Transient, though no retry can mend the key."""
    if value.isascii() and value.isprintable():
        return value
    where = ref.describe() if ref is not None else "(none)"
    raise BadCredentials(
        f"credentials reference {where}{f' ({part})' if part else ''} holds a character a request header "
        "cannot carry (a control character or non-ASCII); the value is not shown",
        provider=provider, code="MalformedCredentials",
    )


def aws_keys(secret: str, ref: CredentialsRef | None, *, provider: str) -> dict[str, str]:
    """boto3 arguments from an AWS key secret: ``ACCESS_KEY_ID:SECRET_ACCESS_KEY[:SESSION_TOKEN]``
    or JSON ``{"access_key_id", "secret_access_key"[, "session_token"]}``.

    A malformed one is ``BadCredentials`` naming the reference, never the secret."""
    where = ref.describe() if ref is not None else "(none)"
    if secret.startswith("{"):
        try:
            data = json.loads(secret)
            parts = [data["access_key_id"], data["secret_access_key"], *([data["session_token"]]
                                                                         if data.get("session_token") else [])]
        except (ValueError, KeyError, TypeError):
            parts = []
    else:
        parts = secret.split(":")
    parts = [p.strip() if isinstance(p, str) else p for p in parts]
    if len(parts) not in (2, 3) or not all(isinstance(p, str) and p for p in parts):
        raise BadCredentials(
            f"credentials reference {where} must hold ACCESS_KEY_ID:SECRET_ACCESS_KEY[:SESSION_TOKEN] or JSON "
            "with access_key_id and secret_access_key",
            provider=provider, code="MalformedCredentials",
        )
    # Each is sent in a header (the key id and session token as they are; the secret key is
    # only ever signed with, but no AWS secret key holds anything else either).
    names = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
    return {name: header_safe(part, ref, provider=provider, part=name) for name, part in zip(names, parts)}


#: The one Kubernetes call credentials make (``secret: gpufleet/<name>#<key>`` in sites.yaml), as
#: the control plane's service account runs it: deploy/kubernetes/rbac.yaml (gpufleet-credentials).
ACCESS = (AccessRule(verb="get", group="", resource="secrets", namespace="gpufleet",
                     purpose="provider credentials given as `secret: gpufleet/<name>#<key>`"),)


def _read_kubernetes_secret(ref: CredentialsRef) -> str:
    import base64

    from kubernetes import client, config

    namespace, name, key = ref.secret_location()
    try:
        config.load_config()
        secret = client.CoreV1Api().read_namespaced_secret(name, namespace)
    except Exception:  # noqa: BLE001 - any failure to read is "no usable credentials"
        return ""
    data = (secret.data or {}).get(key or "token", "")
    try:
        return base64.b64decode(data).decode() if data else ""
    except ValueError:  # not base64, or not UTF-8: as unusable as none
        return ""
