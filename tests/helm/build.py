#!/usr/bin/env python3
"""Build helm v3 from its published Go module, for the chart's tests (deploy/helm/gpufleet).

    python3 tests/helm/build.py          # build once into the cache, print the bin folder
    python3 tests/helm/build.py --check  # print the bin folder if it is built, else exit 1

`go install helm.sh/helm/v3/cmd/helm@<version>` works as it is (helm's go.mod has no replace
lines), stamped the way helm's own Makefile stamps a release: the version `helm version`
prints, and the Kubernetes version `helm template` and `helm lint` assume when no cluster is
asked (the minor of the client-go helm is built with).

Cached by version under $GPUFLEET_HELM_CACHE (default ~/.cache/gpufleet/helm/<version>), beside
the real Kubernetes tier's build (tests/realk8s/build.py); both use Go's own build and module
caches, so the k8s.io modules they share are downloaded once.
stdlib only: bootstrap.py calls this before any venv exists.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

#: The helm release the suite lints and renders with: the newest v3 the module proxy serves
#: that `go install` builds with this machine's Go (1.26).
HELM_VERSION = "v3.21.4"
MODULE = "helm.sh/helm/v3"
COMMAND = f"{MODULE}/cmd/helm"


def cache_dir() -> Path:
    root = os.environ.get("GPUFLEET_HELM_CACHE") or str(Path.home() / ".cache" / "gpufleet" / "helm")
    return Path(root) / HELM_VERSION


def bin_dir() -> Path:
    return cache_dir() / "bin"


def helm_path() -> Path:
    return bin_dir() / "helm"


def built() -> bool:
    stamp = cache_dir() / "built"
    return stamp.exists() and stamp.read_text() == HELM_VERSION and helm_path().exists()


def missing_reason() -> str | None:
    """None when helm is built; else one line saying what is missing and how to get it."""
    if built():
        return None
    if shutil.which("go") is None:
        return f"the Helm chart's tests need helm {HELM_VERSION}, built with Go (`go` on PATH)"
    return f"helm {HELM_VERSION} is not built: run `python3 tests/helm/build.py` (bootstrap.py test does)"


def _go(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(["go", *args], cwd=cache_dir(), env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"`go {' '.join(args)}` failed:\n{done.stderr[-6000:]}")
    return done.stdout


def ldflags(helm_gomod: str) -> str:
    """Helm's Makefile flags: its version, and the Kubernetes version (1.<client-go minor>)
    that `helm template` and the lint's deprecation rules assume without a cluster."""
    client_go = re.search(r"^\s*k8s\.io/client-go\s+v0\.(\d+)\.", helm_gomod, re.M)
    flags = ["-s", "-w", f"-X {MODULE}/internal/version.version={HELM_VERSION}",
             f"-X {MODULE}/internal/version.gitTreeState=clean"]
    if client_go:
        for pkg in ("pkg/lint/rules", "pkg/chartutil"):
            flags += [f"-X {MODULE}/{pkg}.k8sVersionMajor=1", f"-X {MODULE}/{pkg}.k8sVersionMinor={client_go.group(1)}"]
    return " ".join(flags)


def build() -> Path:
    if built():
        return bin_dir()
    if shutil.which("go") is None:
        raise SystemExit(missing_reason())
    started = time.monotonic()
    bin_dir().mkdir(parents=True, exist_ok=True)
    (cache_dir() / "built").unlink(missing_ok=True)
    # As tests/realk8s/build.py builds (no cgo, this machine's Go), so the packages both compile are shared.
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local"}
    print(f"building helm {HELM_VERSION} from the Go module proxy into {bin_dir()}", flush=True)
    info = json.loads(_go(["mod", "download", "-json", f"{MODULE}@{HELM_VERSION}"], env))
    partial = cache_dir() / "gobin"  # go install names the binary itself: moved into bin/ once whole
    _go(["install", "-ldflags", ldflags(Path(info["GoMod"]).read_text()), f"{COMMAND}@{HELM_VERSION}"],
        {**env, "GOBIN": str(partial)})
    (partial / "helm").rename(helm_path())
    partial.rmdir()
    (cache_dir() / "built").write_text(HELM_VERSION)
    print(f"helm {HELM_VERSION} built in {time.monotonic() - started:.0f} s", flush=True)
    return bin_dir()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a script: the repository's tests package
    from tests.gobuild import main

    sys.exit(main(sys.argv[1:], built, build, missing_reason))
