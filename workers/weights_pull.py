"""``gpufleet weights pull``: verified weights on the node before the model server starts.

Run as the serving pod's init container (``python -m workers.weights_pull``, reading
``GPUFLEET_WEIGHTS``) or by hand (``gpufleet weights pull SPEC.json``). It copies one
model version from the site's object store into ``<cache>/<model>/<version>/``:

- every file's sha256 is checked against the rollout manifest; on any mismatch the
  pull fails naming the file (exit 2), so the init container fails and the model
  server never starts on unverified bytes;
- replicas on one node share the cache: one pull at a time per version (an exclusive
  lock file next to it); a replica that finds the version already verified starts at once;
- an interrupted copy resumes: ``<file>.partial`` is continued with a ranged GET from
  its size, then the whole file is hashed; a resumed file whose hash does not match is
  fetched again from the start once (the partial's first part may be what was bad).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from fleet.errors import FleetError
from fleet.settings import WeightsPullEnv
from fleet.weights_pull import CACHE_ROOT, ENV, WeightsPull
from providers.object_store import Throttle, classify, make_s3_client

CHUNK = 1024 * 1024
#: Written last, after every file verified: its presence means the version is complete.
VERIFIED = ".gpufleet-verified"
EXIT_MISMATCH = 2
EXIT_ERROR = 1


class WeightsMismatch(Exception):
    """A file's bytes are not the manifest's: the server must not start."""

    def __init__(self, path: str, want: str, got: str, size: int) -> None:
        super().__init__(f"{path}: sha256 {got} ({size} bytes) is not the manifest's {want}")
        self.path = path


@dataclass
class PullReport:
    cache_dir: Path
    #: Bytes fetched from the store in this run, per file (0: already verified here).
    fetched: dict[str, int] = field(default_factory=dict)
    resumed: list[str] = field(default_factory=list)
    #: The version was already complete in the cache (another replica pulled it).
    cached: bool = False


def _marker(spec: WeightsPull) -> str:
    return json.dumps(sorted((f.path, f.sha256) for f in spec.files))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()




def _fetch(client: Any, spec: WeightsPull, key: str, partial: Path, offset: int, throttle: Throttle) -> int:
    """Append the object's bytes from ``offset`` to ``partial``; bytes fetched."""
    kwargs = {"Range": f"bytes={offset}-"} if offset else {}
    try:
        body = client.get_object(Bucket=spec.store.bucket, Key=key, **kwargs)["Body"]
    except Exception as error:  # noqa: BLE001 - classified into the fleet's taxonomy
        raise classify(error, f"get s3://{spec.store.bucket}/{key}") from error
    fetched = 0
    with partial.open("ab") as out:
        while block := body.read(CHUNK):
            out.write(block)
            fetched += len(block)
            throttle(len(block))
        out.flush()
        os.fsync(out.fileno())
    return fetched


def _pull_file(client: Any, spec: WeightsPull, dest: Path, f, report: PullReport, throttle: Throttle) -> None:
    final = dest / f.path
    if final.exists() and final.stat().st_size == f.size and _sha256(final) == f.sha256:
        report.fetched[f.path] = 0
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    key = f"{spec.prefix}{f.path}"
    fetched = 0
    for attempt in range(2):
        offset = partial.stat().st_size if partial.exists() else 0
        if offset > f.size:
            partial.unlink()
            offset = 0
        if offset and attempt == 0:
            report.resumed.append(f.path)
        if offset < f.size:
            fetched += _fetch(client, spec, key, partial, offset, throttle)
        got = _sha256(partial)
        if got == f.sha256 and partial.stat().st_size == f.size:
            os.replace(partial, final)
            report.fetched[f.path] = fetched
            return
        size = partial.stat().st_size
        partial.unlink()
        if not offset:  # fetched whole and still wrong: the store's copy is bad
            raise WeightsMismatch(f.path, f.sha256, got, size)
    raise WeightsMismatch(f.path, f.sha256, got, size)


def pull(spec: WeightsPull, cache_root: str | Path = CACHE_ROOT, *, client: Any = None,
         bandwidth_bytes_per_s: int = 0) -> PullReport:
    """Copy and verify ``spec``'s files into the node-local cache; the report of what was done.

    Raises ``WeightsMismatch`` (the file named) or a ``FleetError`` from the store."""
    dest = Path(spec.cache_dir(str(cache_root)))
    dest.mkdir(parents=True, exist_ok=True)
    report = PullReport(cache_dir=dest)
    marker = dest / VERIFIED
    with (dest.parent / f".{spec.version}.lock").open("a") as lock:
        # Replicas on one node wait here for the one that pulls; then find it verified.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and marker.read_text() == _marker(spec):
            report.cached = True
            return report
        marker.unlink(missing_ok=True)
        client = client or make_s3_client(spec.store)
        throttle = Throttle(bandwidth_bytes_per_s)
        for f in spec.files:
            _pull_file(client, spec, dest, f, report, throttle)
        marker.write_text(_marker(spec))
    return report


def load_spec(source: str | None) -> WeightsPull:
    """The spec from a file path, ``-`` (stdin), or the ``GPUFLEET_WEIGHTS`` variable."""
    if source == "-":
        raw = sys.stdin.read()
    elif source:
        raw = Path(source).read_text()
    else:
        raw = WeightsPullEnv.get("weights")
        if not raw:
            raise ValueError(f"no weights spec: give a file or set {ENV}")
    return WeightsPull.model_validate_json(raw)


def run(source: str | None, cache: str, bandwidth: int = 0) -> int:
    """The command's body: exit 0 (verified), 2 (a mismatch), 1 (anything else)."""
    try:
        spec = load_spec(source)
        report = pull(spec, cache, bandwidth_bytes_per_s=bandwidth)
    except WeightsMismatch as error:
        print(f"weights pull: refusing to start: {error}", file=sys.stderr)
        return EXIT_MISMATCH
    except (FleetError, ValueError, OSError) as error:
        print(f"weights pull: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_ERROR
    if report.cached:
        print(f"weights pull: {spec.model} {spec.version} already verified in {report.cache_dir}")
    else:
        total = sum(report.fetched.values())
        resumed = f", resumed {', '.join(report.resumed)}" if report.resumed else ""
        print(f"weights pull: {spec.model} {spec.version}: {len(spec.files)} files verified in "
              f"{report.cache_dir} ({total} bytes fetched{resumed})")
    return 0


def cli(
    spec: Annotated[Optional[str], typer.Argument(help=f"WeightsPull JSON file, '-' for stdin; default ${ENV}")] = None,
    cache: Annotated[str, typer.Option(help="the node-local weights cache")] = CACHE_ROOT,
    bandwidth: Annotated[int, typer.Option(help="bytes/s cap (0 = none)")] = 0,
) -> None:
    """Copy and verify a model version into the node-local cache."""
    sys.exit(run(spec, cache, bandwidth))


if __name__ == "__main__":
    typer.run(cli)
