"""Read an account's secret from its reference, inside an activity only; and the Role that
lets the control plane read the Secrets its config names, and no other."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fleet.config import ConfigError, FleetConfig
from fleet.config_checks import NODE_CREDENTIALS
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


#: Where the control plane reads the Secrets its config names, and the Role that lets it.
CREDENTIALS_NAMESPACE = "gpufleet"
CREDENTIALS_ROLE = "gpufleet-credentials"
CONTROL_PLANE_ACCOUNT = "gpufleet-control-plane"

#: The one Kubernetes call credentials make (``secret: gpufleet/<name>#<key>`` in sites.yaml), as
#: the control plane's service account runs it: the Role ``credentials_role`` renders, which
#: grants it for the Secrets the config names only (``control_plane_secrets``).
ACCESS = (AccessRule(verb="get", group="", resource="secrets", namespace=CREDENTIALS_NAMESPACE,
                     purpose="provider credentials given as `secret: gpufleet/<name>#<key>`, each by name"),)

#: Config sections whose references the control plane never reads: ``node_gateway.ca`` is read by
#: ``gpufleet cluster node-config``, run with the operator's own credentials.
NOT_READ_BY_THE_CONTROL_PLANE = ("node_gateway",)
#: Fields whose references only GPU nodes read (a store's ``pull_credentials``, named in serving
#: pods): the control plane never gets them, so its Role does not grant them.
NODE_ONLY_FIELDS = (NODE_CREDENTIALS,)


def read_by_the_control_plane(where: str) -> bool:
    """Whether the control plane reads the reference at ``where`` (``credential_references``)."""
    return where.split(".", 1)[0] not in NOT_READ_BY_THE_CONTROL_PLANE \
        and where.rsplit(".", 1)[-1] not in NODE_ONLY_FIELDS


def credential_references(value: object, where: str = "") -> list[tuple[str, CredentialsRef]]:
    """Every credentials reference in a loaded config (accounts, object stores, a site's object
    store, the webhook, ...), each with where it sits, so a reference added to the config later
    is found too."""
    if isinstance(value, CredentialsRef):
        return [(where, value)]
    if isinstance(value, BaseModel):
        items = [(name, getattr(value, name)) for name in type(value).model_fields]
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = [(getattr(v, "name", i), v) for i, v in enumerate(value)]
    else:
        return []
    return [found for key, item in items for found in credential_references(item, f"{where}.{key}".lstrip("."))]


def control_plane_secrets(config: FleetConfig, source: str = "<config>") -> list[str]:
    """The names of the Secrets the control plane reads (its config's ``secret:`` references),
    sorted, each once. ``ConfigError`` naming the field for a reference it could not read with
    ``credentials_role``'s grant: a Secret outside ``gpufleet``, or no name."""
    return sorted(control_plane_secret_fields(config, source))


def control_plane_secret_fields(config: FleetConfig, source: str = "<config>") -> dict[str, list[str]]:
    """``control_plane_secrets``, each with the config fields that name it
    (``accounts.lambda-prod.credentials``), so whoever finds one unreadable can say where it
    comes from (``gpufleet cluster check``)."""
    fields: dict[str, list[str]] = {}
    problems = []
    for where, ref in credential_references(config):
        if not ref.secret or not read_by_the_control_plane(where):
            continue
        namespace, name, _ = ref.secret_location()
        if namespace != CREDENTIALS_NAMESPACE or not name:
            problems.append(f"{where}: {ref.describe()}: the control plane reads credentials only as "
                            f"`secret: {CREDENTIALS_NAMESPACE}/<name>#<key>` (a Secret in its own namespace)")
        else:
            fields.setdefault(name, []).append(where)
    if problems:
        raise ConfigError(source, problems)
    return dict(sorted(fields.items()))


def credentials_role(config: FleetConfig, source: str = "<config>") -> list[dict[str, Any]]:
    """The Role and RoleBinding that let the control plane's service account ``get`` exactly the
    Secrets its config names (``gpufleet cluster credentials-role``), by name: it cannot read,
    list or watch any other Secret in its namespace (another app's, the Temporal client's).

    A config that names none gets a Role with no rules, never a rule with no names (RBAC reads
    an empty ``resourceNames`` as every name). Applied over a Role of the same name, it replaces
    that Role's rules whole."""
    names = control_plane_secrets(config, source)
    rules = [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": names, "verbs": ["get"]}] if names else []
    metadata = {"name": CREDENTIALS_ROLE, "namespace": CREDENTIALS_NAMESPACE}
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {**metadata, "labels": {"gpufleet.io/rbac-for": "credentials"}}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": metadata,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": CREDENTIALS_ROLE},
         "subjects": [{"kind": "ServiceAccount", "name": CONTROL_PLANE_ACCOUNT,
                       "namespace": CREDENTIALS_NAMESPACE}]},
    ]


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
