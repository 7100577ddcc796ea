"""gpufleet's Helm chart (deploy/helm/gpufleet) as the tests drive it: the real helm, built from
its Go module by tests/helm/build.py, and the chart's rendering normalized to compare it with the
kustomize base (deploy/kubernetes) object by object."""

from __future__ import annotations

import copy
import os
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm import build

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpufleet"

#: The labels the chart adds to every object beside the base's own; never in a selector.
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
               "app.kubernetes.io/version")
#: The images, which the base and the chart name by the package version.
IMAGES = ("gpufleet-control-plane", "gpufleet-node-agent")


def package_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def helm_binary() -> Path:
    """The built helm; else skip (fail in CI), naming what is missing."""
    reason = build.missing_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs every test: {reason}", pytrace=False)
        pytest.skip(reason)
    return build.helm_path()


def helm(*args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    if check:
        assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stderr}"
    return done


def template(*values: str, release: str = "gpufleet") -> str:
    """`helm template` of the chart with these `--set`-style arguments: the manifest text."""
    return helm("template", release, str(CHART), *values).stdout


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def key(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"]


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    found: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for doc in docs:
        assert key(doc) not in found, f"rendered twice: {key(doc)}"
        found[key(doc)] = doc
    return found


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*pod.get("containers", []), *pod.get("initContainers", [])]


def without_helm_metadata(obj: dict[str, Any]) -> dict[str, Any]:
    """The object less what helm adds: its labels, and its own annotations (helm.sh/...)."""
    obj = copy.deepcopy(obj)
    meta = obj["metadata"]
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k not in HELM_LABELS}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if not k.startswith("helm.sh/")}
    meta.pop("labels", None)
    meta.pop("annotations", None)
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    return obj


def with_image_tag(obj: dict[str, Any], tag: str) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    for container in containers(obj):
        repository, _, _ = container["image"].rpartition(":")
        container["image"] = f"{repository}:{tag}"
    return obj
