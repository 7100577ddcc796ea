#!/usr/bin/env python3
"""Build AWS's EC2 metadata mock (AEMM) from its published Go module, for the node agent's AWS
spot notice tests (tests/test_reclaim_watch.py).

    python3 tests/ec2_metadata_mock/build.py          # build once into the cache, print the bin folder
    python3 tests/ec2_metadata_mock/build.py --check  # print the bin folder if it is built, else exit 1

AWS publishes it to test what reads instance metadata off an instance: `ec2-metadata-mock spot`
serves `spot/instance-action` as IMDS does (404 until the interruption's delay or trigger time,
then the notice, its `time` as given with `-t`), and `-I` requires IMDSv2 session tokens as
gpufleet launches its instances. `go install .../cmd/ec2-metadata-mock@<version>` works as it is
(its go.mod has no replace lines); the version it prints is embedded from its own tree.

Cached by version under $GPUFLEET_EC2_METADATA_MOCK_CACHE (default
~/.cache/gpufleet/ec2-metadata-mock/<version>), beside the other Go-built test components; Go's
build and module caches are Go's own. About 30 s cold on 2 cores.
stdlib only: bootstrap.py calls this before any venv exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

#: The newest release the module proxy serves.
VERSION = "v1.13.0"
COMMAND = "github.com/aws/amazon-ec2-metadata-mock/cmd/ec2-metadata-mock"


def cache_dir() -> Path:
    root = os.environ.get("GPUFLEET_EC2_METADATA_MOCK_CACHE") or str(
        Path.home() / ".cache" / "gpufleet" / "ec2-metadata-mock")
    return Path(root) / VERSION


def bin_dir() -> Path:
    return cache_dir() / "bin"


def mock_path() -> Path:
    return bin_dir() / "ec2-metadata-mock"


def built() -> bool:
    stamp = cache_dir() / "built"
    return stamp.exists() and stamp.read_text() == VERSION and mock_path().exists()


def missing_reason() -> str | None:
    """None when the mock is built; else one line saying what is missing and how to get it."""
    if built():
        return None
    if shutil.which("go") is None:
        return (f"AWS's EC2 metadata mock {VERSION} is not built, and building it needs Go (`go` on PATH, then "
                "`python3 tests/ec2_metadata_mock/build.py`; bootstrap.py test does)")
    return (f"AWS's EC2 metadata mock {VERSION} is not built: run `python3 tests/ec2_metadata_mock/build.py` "
            "(bootstrap.py test does)")


def build() -> Path:
    if built():
        return bin_dir()
    if shutil.which("go") is None:
        raise SystemExit(missing_reason())
    started = time.monotonic()
    bin_dir().mkdir(parents=True, exist_ok=True)
    (cache_dir() / "built").unlink(missing_ok=True)
    # As the other Go-built components build (no cgo, this machine's Go), so shared packages are compiled once.
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local"}
    print(f"building AWS's EC2 metadata mock {VERSION} from the Go module proxy into {bin_dir()}", flush=True)
    partial = cache_dir() / "gobin"  # go install names the binary itself: moved into bin/ once whole
    done = subprocess.run(["go", "install", "-ldflags", "-s -w", f"{COMMAND}@{VERSION}"], cwd=cache_dir(),
                          env={**env, "GOBIN": str(partial)}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"`go install {COMMAND}@{VERSION}` failed:\n{done.stderr[-6000:]}")
    (partial / "ec2-metadata-mock").rename(mock_path())
    partial.rmdir()
    (cache_dir() / "built").write_text(VERSION)
    print(f"AWS's EC2 metadata mock {VERSION} built in {time.monotonic() - started:.0f} s", flush=True)
    return bin_dir()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a script: the repository's tests package
    from tests.gobuild import main

    sys.exit(main(sys.argv[1:], built, build, missing_reason))
