#!/usr/bin/env python3
"""Set up and run gpufleet with nothing but python3 (stdlib only).

    python3 bootstrap.py dev     # venv + install, then `gpufleet dev` (the dev stack)
    python3 bootstrap.py test    # venv + install (+ Debian packages as root), then the whole test suite
    python3 bootstrap.py test --fast   # the unit tier only (README, "Test tiers"): under a minute
    python3 bootstrap.py bench   # venv + install, then every benchmark in bench/

The venv is rebuilt only when pyproject.toml changes.
"""

import sys

# First, and in syntax any Python 3 parses: an older interpreter would otherwise fail later with a
# traceback (a type hint, a pyproject.toml pip refuses). No `from __future__` import above it for
# the same reason: Python 3.6 refuses `annotations` before this line could run.
if sys.version_info < (3, 11):
    sys.stderr.write("bootstrap.py: gpufleet needs Python 3.11 or newer; this is Python %d.%d (%s)\n"
                     % (sys.version_info[0], sys.version_info[1], sys.executable or "python3"))
    sys.exit(2)

import hashlib  # noqa: E402 - after the version check
import os  # noqa: E402
import subprocess  # noqa: E402
import venv  # noqa: E402
from pathlib import Path  # noqa: E402

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
    # The real Kubernetes tier's machines: a netns each; the install step's: a mount namespace each.
    "ip": "iproute2", "unshare": "util-linux",
    # The node agent's driver reinstall enters the host's namespaces (deploy/driver-reinstall).
    "nsenter": "util-linux",
    # The real Temporal tier's database. The server (initdb, postgres) sits off PATH under
    # /usr/lib/postgresql/<v>/bin: this is postgresql-common's wrapper, which comes with it.
    "pg_ctlcluster": "postgresql",
    # The install pages' certificate recipes, run as written (tests/doc_recipes.py).
    "openssl": "openssl",
}
#: What skips without each program (outside CI; in CI it fails instead): the tiers and files that
#: drive it, as the message below names them. tests/test_tools.py keeps it in step with the tests'
#: ``needs(...)``/``require(...)`` (tests/tools.py) and the real tiers' own checks.
SKIPPED_WITHOUT = {
    "prometheus": ["tests/test_observability.py"],
    "promtool": ["tests/test_observability.py"],
    "cloud-init": ["tests/test_bootstrap.py", "tests/test_node_install.py", "tests/providers/test_join_real.py",
                   "tests/providers/test_own_dc_seed.py"],
    "haproxy": ["tests/test_front_door.py", "tests/test_routing_entity.py", "tests/test_bench_smoke.py"],
    "curl": ["tests/test_readme_http.py"],
    "ip": ["the real Kubernetes tier (tests/realk8s)"],
    "unshare": ["the real Kubernetes tier (tests/realk8s)", "tests/test_node_install.py",
                "tests/test_driver_reinstall.py"],
    "pg_ctlcluster": ["the real Temporal tier (tests/realtemporal)"],
    "openssl": ["tests/realtemporal/test_tls.py", "tests/security/test_gateway_tokens.py", "tests/test_node_gateway.py"],
    # Not a Debian package: built with the real Kubernetes tier (build_real_components).
    "nsenter": ["tests/test_driver_reinstall.py"],
    "kubectl": ["tests/test_deploy.py", "tests/cluster/test_network.py", "tests/test_helm.py",
                "tests/test_driver_reinstall.py"],
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
    skipped: dict[str, list[str]] = {}  # test file or tier -> the missing programs it needs
    for tool in sorted(missing):
        for tests in SKIPPED_WITHOUT.get(tool, ["the tests that drive it"]):
            skipped.setdefault(tests, []).append(tool)
    in_ci = os.environ.get("CI") == "true"
    message = "\n".join(
        [f"missing {', '.join(sorted(missing))} (Debian: apt-get install {' '.join(sorted(set(missing.values())))});"
         f" these tests {'would' if in_ci else 'will'} skip:"]
        + [f"  {tests} (needs {', '.join(tools)})" for tests, tools in sorted(skipped.items())])
    if in_ci:
        raise SystemExit(f"CI runs every test: {message}")
    print(message, file=sys.stderr, flush=True)


def build_with_go(what: str, script: str, skips: str) -> None:
    """One Go-built component of the tests (``script``, a build script of ours), built once per
    version and cached. Without Go the tests that need it skip (they say why); in CI a failed
    build fails the run. ``what`` names it, ``skips`` names the tests that need it."""
    import shutil
    import time

    if shutil.which("go") is None:
        print(f"go is not on PATH: {skips} will skip", flush=True)
        return
    started = time.monotonic()
    code = subprocess.call([sys.executable, str(ROOT / script)])
    if code != 0:
        if os.environ.get("CI") == "true":
            raise SystemExit(f"building {what} failed (exit {code})")
        print(f"building {what} failed: {skips} will skip", file=sys.stderr, flush=True)
        return
    print(f"{what} ready ({time.monotonic() - started:.0f} s)", flush=True)


def build_real_components() -> None:
    """Everything the real tiers run, from the Go module proxy, sharing Go's build and module
    caches: the Kubernetes control plane and machine harness, the Temporal server, helm, the
    Prometheus Operator's CRDs (generated by controller-gen from its API types), and AWS's EC2
    metadata mock."""
    build_with_go("the real Kubernetes tier", "tests/realk8s/build.py",
                  "the real Kubernetes tier (tests/realk8s) and, unless kubectl is on PATH, "
                  + ", ".join(SKIPPED_WITHOUT["kubectl"]))
    build_with_go("the real Temporal tier", "tests/realtemporal/build.py", "the real Temporal tier (tests/realtemporal)")
    build_with_go("helm", "tests/helm/build.py", "the Helm chart's tests (tests/test_helm.py)")
    build_with_go("the Prometheus Operator's CRDs", "tests/prometheus_operator/build.py",
                  "the monitoring objects' test on the real API server (tests/realk8s/test_monitoring.py)")
    build_with_go("AWS's EC2 metadata mock", "tests/ec2_metadata_mock/build.py",
                  "the AWS spot notice's tests (tests/test_reclaim_watch.py)")


def build_image_install() -> None:
    """The images' Python install (tests/realk8s/image.py): a second venv holding what each
    Containerfile's `pip install .` installs, no test extras, which the real Kubernetes tier runs
    the shipped pods with. Built once per pyproject.toml (about 30 s with pip's cache), then
    reused; in CI a failed build fails the run."""
    import time

    started = time.monotonic()
    code = subprocess.call([sys.executable, str(ROOT / "tests" / "realk8s" / "image.py")])
    if code != 0:
        if os.environ.get("CI") == "true":
            raise SystemExit(f"building the images' Python install failed (exit {code})")
        print("building the images' Python install failed: the real Kubernetes tier's pods will fail",
              file=sys.stderr, flush=True)
        return
    print(f"the images' Python install ready ({time.monotonic() - started:.0f} s)", flush=True)


def serial_asked(rest: list[str]) -> bool:
    return any(arg.startswith(("-n", "--numprocesses", "--pdb", "--trace")) or arg == "no:xdist" for arg in rest)


def bytecode_written() -> dict[str, str]:
    """Bytecode is written even where PYTHONDONTWRITEBYTECODE says not to: each xdist worker would
    otherwise compile, and rewrite the asserts of, some 250 modules on every run (seconds each)."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}


#: pytest-xdist workers for the full suite. Its tests mostly wait (timers, watches, servers
#: starting) rather than compute. On the 2-core machine CI has, with each file's tests in one
#: worker (tests/plugins/scheduling.py), four workers kept the cores about half busy (53% on
#: average, sampled every 15 s) and took 974 s; five, 74% busy, took 826 s. The largest units
#: (the real Kubernetes tier's two, tests/test_evacuation.py) take about 7 minutes each.
FULL_SUITE_WORKERS = 5


def full_suite_workers(rest: list[str]) -> list[str]:
    """Each test file's tests in one worker, each real tier's in one or two (their clusters start
    once in each): tests/plugins/scheduling.py's scheduler for ``--dist loadscope``."""
    return [] if serial_asked(rest) else ["-n", str(FULL_SUITE_WORKERS), "--dist", "loadscope"]


def fast_tier(rest: list[str]) -> int:
    """The unit tier (tests marked ``unit`` by tests/plugins/tiers.py): no Temporal dev server, no
    cluster, no system tools, so nothing to install or build first.

    Its tests mostly wait (fakes' timeouts, watches' waits) rather than compute, so they run in
    pytest-xdist workers, two per core, each test file in one worker (its module's fakes start
    once)."""
    workers = [] if serial_asked(rest) else ["-n", str(min(8, 2 * (os.cpu_count() or 1))), "--dist", "loadfile"]
    code = subprocess.call([PYTHON, "-m", "pytest", "-m", "unit", "-p", "no:cacheprovider", *workers, *rest],
                           env=bytecode_written())
    if code == 5:
        print("pytest collected no tests: that is a failure here", file=sys.stderr)
        return 1
    return code


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("dev", "test", "bench"):
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    ensure_venv()
    os.chdir(ROOT)
    if command == "dev":
        # The dev stack in this process's place: the terminal's Ctrl-C reaches `gpufleet dev` alone, which
        # stops its children in order (a parent waiting in subprocess.call would print a KeyboardInterrupt
        # traceback and SIGKILL it mid-stop).
        sys.stdout.flush()
        os.execv(BIN / "gpufleet", [str(BIN / "gpufleet"), "dev", *rest])
    if command == "test":
        if "--fast" in rest:
            return fast_tier([arg for arg in rest if arg != "--fast"])
        ensure_system_packages()
        build_real_components()
        build_image_install()
        code = subprocess.call([PYTHON, "-m", "pytest", *full_suite_workers(rest), *rest],
                               env=bytecode_written())
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
