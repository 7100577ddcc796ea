#!/usr/bin/env python3
"""Build a real Kubernetes control plane (and a kubelet) from their published Go modules.

    python3 tests/realk8s/build.py          # build once into the cache, print the bin folder
    python3 tests/realk8s/build.py --check  # print the bin folder if it is built, else exit 1

Why a module of our own: `go install k8s.io/kubernetes/cmd/...@v` refuses, because
k8s.io/kubernetes replaces every `k8s.io/*` staging module with a folder of its own tree
(`./staging/src/k8s.io/...`), and etcd's server module does the same with its siblings.
Replace lines only count in the main module, so ours requires k8s.io/kubernetes and replaces
each staging module with its published v0.<minor>.<patch> release.  The list is generated
from the pinned k8s.io/kubernetes go.mod, since new staging modules appear between minors.
etcd's server is already in k8s.io/kubernetes's module graph (the apiserver's tests use it),
so it is built from the same module and shares its compiled dependencies.

The binaries are cached by version under $GPUFLEET_REALK8S_CACHE (default
~/.cache/gpufleet/realk8s/<version>) and reused; the Go build cache is Go's own.
Beside them, the published CRDs of the routing objects gpufleet writes, copied unchanged from their
projects' Go modules: Gateway API's HTTPRoute (standard channel; sigs.k8s.io/gateway-api carries
config/crd/) and Envoy Gateway's BackendTrafficPolicy (github.com/envoyproxy/gateway carries its
Helm chart's generated CRDs). The tier serves both kinds from them, so the real API server holds
gpufleet's objects to the published schemas: fields, enums, limits and CEL rules.
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

# One pinned minor.  Bump both together: the staging modules are released as v0.<minor>.<patch>.
KUBERNETES_VERSION = "v1.36.3"
STAGING_VERSION = "v0." + KUBERNETES_VERSION.removeprefix("v1.")
HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness"  # our Go programs (token discovery as kubeadm does it)

#: The released programs, keyed by the version alone.
COMMANDS = {
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kubeadm": "k8s.io/kubernetes/cmd/kubeadm",
    "kubectl": "k8s.io/kubernetes/cmd/kubectl",
    "etcd": "go.etcd.io/etcd/server/v3",
}
#: Gateway API's release whose CRDs the tier installs (pinned: the module proxy serves it).
GATEWAY_API_VERSION = "v1.4.1"
GATEWAY_API_CRDS = ("gateway.networking.k8s.io_httproutes.yaml",)
#: Envoy Gateway's release whose BackendTrafficPolicy CRD the tier installs (pinned: the module proxy
#: serves it, and nothing else publishes it where the tier is built).
ENVOY_GATEWAY_VERSION = "v1.9.1"
ENVOY_GATEWAY_CRDS = ("gateway.envoyproxy.io_backendtrafficpolicies.yaml",)
#: Our machine harness (kubeadm's join code, the kubelet's bootstrap, kubemark's hollow kubelet),
#: keyed by the version and its own sources, so editing it rebuilds it alone.
HARNESS_COMMANDS = {"gpufleet-join": "gpufleet.test/realk8s/harness/join"}


def cache_dir() -> Path:
    root = os.environ.get("GPUFLEET_REALK8S_CACHE") or str(Path.home() / ".cache" / "gpufleet" / "realk8s")
    return Path(root) / KUBERNETES_VERSION


def bin_dir() -> Path:
    return cache_dir() / "bin"


def _harness_stamp() -> str:
    """What the harness binary was built from: the version and our Go sources."""
    import hashlib

    digest = hashlib.sha256(KUBERNETES_VERSION.encode())
    for path in sorted(HARNESS.rglob("*.go")):
        digest.update(path.relative_to(HARNESS).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _fresh(names: dict[str, str], stamp_name: str, stamp: str) -> bool:
    path = cache_dir() / stamp_name
    return path.exists() and path.read_text() == stamp and all((bin_dir() / n).exists() for n in names)


def published_crds() -> dict[Path, tuple[str, str, tuple[str, ...]]]:
    """Each cached folder of published CRDs: the module@version they come from, the module's folder
    that carries them (Envoy Gateway's moved into a subchart in v1.8), and the files."""
    return {
        cache_dir() / f"gateway-api-{GATEWAY_API_VERSION}":
            (f"sigs.k8s.io/gateway-api@{GATEWAY_API_VERSION}", "config/crd/standard", GATEWAY_API_CRDS),
        cache_dir() / f"envoy-gateway-{ENVOY_GATEWAY_VERSION}":
            (f"github.com/envoyproxy/gateway@{ENVOY_GATEWAY_VERSION}",
             "charts/gateway-helm/charts/crds/crds/generated", ENVOY_GATEWAY_CRDS),
    }


def crd_files() -> list[Path]:
    """The published CRDs the tier installs, as cached."""
    return [folder / name for folder, (_, _, names) in published_crds().items() for name in names]


def _binaries_built() -> bool:
    return (_fresh(COMMANDS, "built", KUBERNETES_VERSION)
            and _fresh(HARNESS_COMMANDS, "built-harness", _harness_stamp()))


def built() -> bool:
    return _binaries_built() and all(path.exists() for path in crd_files())


def missing_reason() -> str | None:
    """None when the tier can run; else one line saying what is missing."""
    if built():
        return None
    if shutil.which("go") is None:
        return "the real Kubernetes tier needs Go (`go` on PATH) to build kube-apiserver and friends"
    return f"the real Kubernetes tier is not built: run `python3 tests/realk8s/build.py` ({KUBERNETES_VERSION})"


def _go(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(["go", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"`go {' '.join(args)}` failed in {cwd}:\n{done.stderr[-6000:]}")
    return done.stdout


def staging_replaces(kubernetes_gomod: str) -> list[str]:
    """Every staging module k8s.io/kubernetes requires, pinned to its published release."""
    local = set(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", kubernetes_gomod, re.M))
    required = set(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+v0\.0\.0\b", kubernetes_gomod, re.M))
    return sorted(local & required)


def write_module(work: Path, env: dict[str, str]) -> None:
    info = json.loads(_go(["mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"], work, env))
    kubernetes_gomod = Path(info["GoMod"]).read_text()
    go_line = re.search(r"^go (\S+)", kubernetes_gomod, re.M).group(1)
    replaces = "\n".join(f"\t{m} => {m} {STAGING_VERSION}" for m in staging_replaces(kubernetes_gomod))
    (work / "go.mod").write_text(
        "// Generated by tests/realk8s/build.py: do not edit.\n"
        "module gpufleet.test/realk8s\n\n"
        f"go {go_line}\n\n"
        f"require k8s.io/kubernetes {KUBERNETES_VERSION}\n\n"
        f"replace (\n{replaces}\n)\n"
    )
    if (work / "harness").exists():
        shutil.rmtree(work / "harness")
    shutil.copytree(HARNESS, work / "harness")
    # A tools file keeps etcd's main package (and the commands) in the module graph for tidy.
    (work / "tools.go").write_text(
        "//go:build tools\n\npackage tools\n\nimport (\n"
        + "".join(f'\t_ "{pkg}"\n' for pkg in COMMANDS.values())
        + ")\n"
    )


def ldflags() -> str:
    major, minor = KUBERNETES_VERSION.removeprefix("v").split(".")[:2]
    flags = []
    # Stamped like the release build does, so each binary reports its version, not v0.0.0.
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {pkg}.gitVersion={KUBERNETES_VERSION}", f"-X {pkg}.gitMajor={major}",
                  f"-X {pkg}.gitMinor={minor}", f"-X {pkg}.gitTreeState=clean",
                  f"-X {pkg}.buildDate=1970-01-01T00:00:00Z"]
    return "-s -w " + " ".join(flags)


def build() -> Path:
    if built():
        return bin_dir()
    if shutil.which("go") is None:
        raise SystemExit(missing_reason())
    started = time.monotonic()
    work = cache_dir() / "module"
    work.mkdir(parents=True, exist_ok=True)
    bin_dir().mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}
    if not _binaries_built():
        build_binaries(work, env, started)
    fetch_published_crds(env)
    return bin_dir()


def fetch_published_crds(env: dict[str, str]) -> None:
    """The published CRDs, as their modules carry them (unchanged: the API server checks against them)."""
    for folder, (module, source, names) in published_crds().items():
        if all((folder / name).exists() for name in names):
            continue
        # Outside our module (no go.mod above the cache folder): a download, nothing required.
        info = json.loads(_go(["mod", "download", "-json", module], cache_dir(), env))
        folder.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copyfile(Path(info["Dir"]) / source / name, folder / f".{name}.partial")
            (folder / f".{name}.partial").rename(folder / name)


def build_binaries(work: Path, env: dict[str, str], started: float) -> None:
    print(f"building Kubernetes {KUBERNETES_VERSION} (etcd, control plane, kubeadm, kubectl) and the machine "
          f"harness from the Go module proxy into {bin_dir()}", flush=True)
    write_module(work, env)
    _go(["mod", "tidy"], work, env)
    for names, stamp_name, stamp in ((COMMANDS, "built", KUBERNETES_VERSION),
                                     (HARNESS_COMMANDS, "built-harness", _harness_stamp())):
        if _fresh(names, stamp_name, stamp):
            continue
        (cache_dir() / stamp_name).unlink(missing_ok=True)
        for name, pkg in names.items():
            partial = bin_dir() / f".{name}.partial"
            _go(["build", "-ldflags", ldflags(), "-o", str(partial), pkg], work, env)
            partial.rename(bin_dir() / name)
            print(f"  built {name} ({time.monotonic() - started:.0f} s)", flush=True)
        (cache_dir() / stamp_name).write_text(stamp)
    print(f"real Kubernetes built in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a script: the repository's tests package
    from tests.gobuild import main

    sys.exit(main(sys.argv[1:], built, build, missing_reason))
