"""Read an account's secret from its reference, inside an activity only."""

from __future__ import annotations

import os
from pathlib import Path

from fleet.errors import BadCredentials
from fleet.models import CredentialsRef


def read_secret(ref: CredentialsRef | None, *, provider: str = "") -> str:
    """The secret value; ``BadCredentials`` naming the reference when it is
    missing or empty. Makes no network call except for a Kubernetes Secret."""
    if ref is None:
        raise BadCredentials("no credentials reference configured for this account", provider=provider)
    value = ""
    if ref.env:
        value = os.environ.get(ref.env, "")
    elif ref.file:
        path = Path(ref.file).expanduser()
        try:
            value = path.read_text().strip()
        except OSError:
            value = ""
    elif ref.secret:
        value = _read_kubernetes_secret(ref.secret)
    if not value:
        raise BadCredentials(f"credentials reference {ref.describe()} is missing or empty", provider=provider)
    return value


def _read_kubernetes_secret(ref: str) -> str:
    import base64

    from kubernetes import client, config

    namespace_name, _, key = ref.partition("#")
    namespace, _, name = namespace_name.partition("/")
    try:
        config.load_config()
        secret = client.CoreV1Api().read_namespaced_secret(name, namespace)
    except Exception:  # noqa: BLE001 - any failure to read is "no usable credentials"
        return ""
    data = (secret.data or {}).get(key or "token", "")
    return base64.b64decode(data).decode() if data else ""
