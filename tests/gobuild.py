"""The command line the Go-built test components' build scripts share (tests/realk8s/build.py,
tests/realtemporal/build.py, tests/helm/build.py, tests/prometheus_operator/build.py,
tests/ec2_metadata_mock/build.py).

stdlib only: bootstrap.py runs those scripts before any venv exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


def main(argv: list[str], built: Callable[[], bool], build: Callable[[], Path],
         missing_reason: Callable[[], str | None]) -> int:
    """``SCRIPT``: build once into the cache; ``SCRIPT --check``: exit 1 unless it is built. Either
    way print the cached folder (``build`` returns it at once when it is built)."""
    if argv[:1] == ["--check"] and not built():
        print(missing_reason(), file=sys.stderr)
        return 1
    print(build())
    return 0


@dataclass(frozen=True)
class GoInstalled:
    """A test tool that ``go install <command>@<version>`` builds as published (no replace lines in
    its go.mod), cached by version under ``$<cache_env>`` (default ~/.cache/gpufleet/<folder>)."""

    #: What messages call it ("AWS's EC2 metadata mock").
    title: str
    command: str
    version: str
    cache_env: str
    folder: str
    #: The script that builds it, relative to the repository (named in what is missing).
    script: str

    @property
    def binary(self) -> str:
        return self.command.rsplit("/", 1)[-1]

    def cache_dir(self) -> Path:
        root = os.environ.get(self.cache_env) or str(Path.home() / ".cache" / "gpufleet" / self.folder)
        return Path(root) / self.version

    def bin_dir(self) -> Path:
        return self.cache_dir() / "bin"

    def path(self) -> Path:
        return self.bin_dir() / self.binary

    def built(self) -> bool:
        stamp = self.cache_dir() / "built"
        return stamp.exists() and stamp.read_text() == self.version and self.path().exists()

    def missing_reason(self) -> str | None:
        """None when it is built; else one line saying what is missing and how to get it."""
        if self.built():
            return None
        how = f"`python3 {self.script}` (bootstrap.py test does)"
        if shutil.which("go") is None:
            return f"{self.title} {self.version} is not built, and building it needs Go (`go` on PATH, then {how})"
        return f"{self.title} {self.version} is not built: run {how}"

    def build(self) -> Path:
        if self.built():
            return self.bin_dir()
        if shutil.which("go") is None:
            raise SystemExit(self.missing_reason())
        started = time.monotonic()
        self.bin_dir().mkdir(parents=True, exist_ok=True)
        (self.cache_dir() / "built").unlink(missing_ok=True)
        # As the other Go-built components build (no cgo, this machine's Go), so shared packages
        # are compiled once.
        env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local"}
        print(f"building {self.title} {self.version} from the Go module proxy into {self.bin_dir()}", flush=True)
        partial = self.cache_dir() / "gobin"  # go install names the binary itself: moved into bin/ once whole
        done = subprocess.run(["go", "install", "-ldflags", "-s -w", f"{self.command}@{self.version}"],
                              cwd=self.cache_dir(), env={**env, "GOBIN": str(partial)}, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"`go install {self.command}@{self.version}` failed:\n{done.stderr[-6000:]}")
        (partial / self.binary).rename(self.path())
        partial.rmdir()
        (self.cache_dir() / "built").write_text(self.version)
        print(f"{self.title} {self.version} built in {time.monotonic() - started:.0f} s", flush=True)
        return self.bin_dir()

    def main(self, argv: list[str]) -> int:
        return main(argv, self.built, self.build, self.missing_reason)
