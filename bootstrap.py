#!/usr/bin/env python3
"""Set up and run gpufleet with nothing but python3 (stdlib only).

    python3 bootstrap.py dev     # venv + install, then `gpufleet dev` (the dev stack)
    python3 bootstrap.py test    # venv + install (+ Debian packages as root), then the whole test suite
    python3 bootstrap.py test --fast   # the unit tier only: pure policy and replay, under a minute
    python3 bootstrap.py bench   # venv + install, then every benchmark in bench/

The venv is rebuilt only when pyproject.toml changes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("GPUFLEET_VENV", ROOT / ".venv"))
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / "python"
STAMP = VENV / ".gpufleet-installed"
BENCHMARKS = ["bench.join_overhead", "bench.fallback", "bench.repair_latency", "bench.incident", "bench.replicate",
              "bench.soak", "bench.front_door", "bench.demand", "bench.gateway", "bench.actions"]


def ensure_venv() -> None:
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted and PYTHON.exists():
        return
    if not PYTHON.exists():
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    print("installing gpufleet and its test dependencies (pip)", flush=True)
    subprocess.run([PYTHON, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([PYTHON, "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]"], check=True)
    STAMP.write_text(wanted)


#: The programs some tests drive for real, and the Debian package each comes from. tests/tools.py
#: reads this table: a test that needs a missing one skips with the way to get it, and fails in CI.
SYSTEM_TOOLS = {
    "prometheus": "prometheus", "promtool": "prometheus",  # a real scrape, `promtool check rules`
    "cloud-init": "cloud-init",  # `cloud-init schema` and its NoCloud code on the bootstrap documents
    "haproxy": "haproxy",  # the front door
    "curl": "curl",  # the README's HTTP examples, run as written
    "ip": "iproute2", "unshare": "util-linux",  # the real Kubernetes tier's machines: a netns each
}
SBIN = ("/usr/sbin", "/sbin")


def missing_tools() -> dict[str, str]:
    import shutil

    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return {tool: package for tool, package in SYSTEM_TOOLS.items() if shutil.which(tool, path=path) is None}


def ensure_system_packages() -> None:
    """Install the Debian packages the tests use, as CI does, when this runs as root (or with
    password-less sudo) on a machine with apt; otherwise say which tests will skip and why."""
    import shutil

    missing = missing_tools()
    if not missing:
        return
    packages = sorted(set(missing.values()))
    as_root: list[str] | None = []  # the prefix that runs apt as root; None: there is none
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        can_sudo = shutil.which("sudo") and subprocess.call(["sudo", "-n", "true"], stderr=subprocess.DEVNULL) == 0
        as_root = ["sudo", "-n"] if can_sudo else None
    if shutil.which("apt-get") and as_root is not None:
        print(f"installing Debian packages the tests use: {' '.join(packages)}", flush=True)
        quiet = {"stdout": subprocess.DEVNULL}
        if (subprocess.call([*as_root, "apt-get", "update", "-qq"], **quiet) == 0
                and subprocess.call([*as_root, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
                                    env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, **quiet) == 0):
            missing = missing_tools()
    if not missing:
        return
    message = (f"missing {', '.join(sorted(missing))} (Debian: apt-get install {' '.join(sorted(set(missing.values())))}):"
               " the tests that drive them will skip")
    if os.environ.get("CI") == "true":
        raise SystemExit(f"CI runs every test: {message}")
    print(message, file=sys.stderr, flush=True)


def build_real_kubernetes() -> None:
    """The real Kubernetes tier's binaries (tests/realk8s/build.py), built once per version and
    cached. Without Go the tier skips (its tests say why); in CI a failed build fails the run."""
    import shutil
    import time

    if shutil.which("go") is None:
        print("go is not on PATH: the real Kubernetes tier (tests/realk8s) will skip", flush=True)
        return
    started = time.monotonic()
    code = subprocess.call([sys.executable, str(ROOT / "tests" / "realk8s" / "build.py")])
    if code != 0:
        if os.environ.get("CI") == "true":
            raise SystemExit(f"building the real Kubernetes tier failed (exit {code})")
        print("building the real Kubernetes tier failed: its tests will skip", file=sys.stderr, flush=True)
        return
    print(f"real Kubernetes tier ready ({time.monotonic() - started:.0f} s)", flush=True)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("dev", "test", "bench"):
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    ensure_venv()
    os.chdir(ROOT)
    if command == "dev":
        return subprocess.call([BIN / "gpufleet", "dev", *rest])
    if command == "test":
        if "--fast" in rest:
            # The unit tier (tests marked `unit` by tests/conftest.py): no Temporal server, no
            # cluster, no system tools, so nothing to install or build first.
            rest = [arg for arg in rest if arg != "--fast"]
            code = subprocess.call([PYTHON, "-m", "pytest", "-m", "unit", "-p", "no:cacheprovider", *rest])
            return 1 if code == 5 else code
        ensure_system_packages()
        build_real_kubernetes()
        code = subprocess.call([PYTHON, "-m", "pytest", *rest])
        if code == 5:
            print("pytest collected no tests: that is a failure here", file=sys.stderr)
            return 1
        return code
    worst = 0
    for module in BENCHMARKS:
        worst = max(worst, subprocess.call([PYTHON, "-m", module, *rest]))
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
