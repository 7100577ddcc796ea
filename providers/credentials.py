"""Read an account's secret from its reference, inside an activity only."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fleet.errors import BadCredentials
from fleet.models import CredentialsRef
from providers.cluster.base import AccessRule


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


def aws_keys(secret: str, ref: CredentialsRef | None, *, provider: str) -> dict[str, str]:
    """boto3 arguments from an AWS key secret: ``ACCESS_KEY_ID:SECRET_ACCESS_KEY[:SESSION_TOKEN]``
    or JSON ``{"access_key_id", "secret_access_key"[, "session_token"]}``.

    A malformed one is ``BadCredentials`` naming the reference, never the secret."""
    where = ref.describe() if ref is not None else "(none)"
    secret = secret.strip()
    if secret.startswith("{"):
        try:
            data = json.loads(secret)
            parts = [data["access_key_id"], data["secret_access_key"], *([data["session_token"]]
                                                                         if data.get("session_token") else [])]
        except (ValueError, KeyError, TypeError):
            parts = []
    else:
        parts = secret.split(":")
    if len(parts) not in (2, 3) or not all(isinstance(p, str) and p for p in parts):
        raise BadCredentials(
            f"credentials reference {where} must hold ACCESS_KEY_ID:SECRET_ACCESS_KEY[:SESSION_TOKEN] or JSON "
            "with access_key_id and secret_access_key",
            provider=provider, code="MalformedCredentials",
        )
    keys = {"aws_access_key_id": parts[0], "aws_secret_access_key": parts[1]}
    if len(parts) == 3:
        keys["aws_session_token"] = parts[2]
    return keys


#: The one Kubernetes call credentials make (``secret: gpufleet/<name>#<key>`` in sites.yaml), as
#: the control plane's service account runs it: deploy/kubernetes/rbac.yaml (gpufleet-credentials).
ACCESS = (AccessRule(verb="get", group="", resource="secrets", namespace="gpufleet",
                     purpose="provider credentials given as `secret: gpufleet/<name>#<key>`"),)


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
