"""The node gateway's task-token keys as the shipped manifest gives them to it: the Secret its
Deployment mounts, at the folder its environment names, read by the gateway's own loader. Every
test gateway starts from these, so a manifest that mounted the Secret elsewhere, or named another
variable, fails the tests that start one."""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path

import yaml

from workers.gateway.task_tokens import CURRENT, PREVIOUS, TokenKeys

MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "node-gateway.yaml"
#: The Secret the operator creates (docs/production/index.md, "The node gateway").
TOKEN_KEY_SECRET = "gpufleet-node-gateway-token-key"


def gateway_container_and_volumes() -> tuple[dict, list[dict]]:
    """The shipped Deployment's gateway container and its pod's volumes."""
    (deployment,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container, pod["volumes"]


def token_key_mount() -> tuple[str, str]:
    """(the variable, the folder it names) by which the manifest gives the gateway the Secret's
    keys: the one variable whose value is the mount path of the Secret ``TOKEN_KEY_SECRET``."""
    container, volumes = gateway_container_and_volumes()
    (volume,) = [v["name"] for v in volumes if v.get("secret", {}).get("secretName") == TOKEN_KEY_SECRET]
    (path,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume]
    (variable,) = [e["name"] for e in container["env"] if e.get("value") == path]
    return variable, path


def token_keys_as_deployed(folder: Path | None = None, current: bytes | None = None,
                           previous: bytes | None = None) -> TokenKeys:
    """The keys a gateway pod reads: ``current`` (a fresh key when None) and ``previous`` written
    as the Secret's files into ``folder`` (standing in for its mount; a new temporary folder when
    None), and the manifest's environment, that folder in place of the mount path, read by
    ``TokenKeys.from_env`` as the gateway does at start."""
    folder = folder or Path(tempfile.mkdtemp(prefix="gpufleet-token-keys-"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CURRENT).write_bytes(current or secrets.token_hex(32).encode() + b"\n")
    if previous:
        (folder / PREVIOUS).write_bytes(previous)
    return keys_from_mount(folder)


def keys_from_mount(folder: Path) -> TokenKeys:
    """``TokenKeys.from_env`` over the manifest's environment with ``folder`` as the Secret's mount."""
    container, _volumes = gateway_container_and_volumes()
    variable, _path = token_key_mount()
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env[variable] = str(folder)
    return TokenKeys.from_env(env)
