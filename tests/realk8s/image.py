#!/usr/bin/env python3
"""The images' Python install, for the real tier's pods (``pod.py``): what ships is what runs.

    python3 tests/realk8s/image.py          # build the image venv once per pyproject.toml, print it
    python3 tests/realk8s/image.py --check  # print it if it is built, else exit 1

Each ``deploy/containers/Containerfile.*`` copies the package's folders (and, for the control
plane, ``deploy/bootstrap``) into its WORKDIR, runs ``pip install .`` there (no extras) and
``compileall``, and starts ``python -m ...`` from that WORKDIR. A pod of the real tier runs the
same way: with the interpreter of a venv that holds only ``pip install .``'s install (built from
a copy laid out like the WORKDIR, so nothing of ``tests/`` nor the ``[test]`` extras is in it),
from a folder laid out as the Containerfile lays out its WORKDIR, and with its ``ENV``. So a
runtime import that only the test extras satisfy, or a file the WORKDIR lacks, fails here.

What cannot match, and why:

* No image is built: there is no container engine here (a ``docker`` client without a daemon,
  and the base image could not be pulled from this machine anyway). The Containerfile is read
  instead: its ``FROM`` picks the Python minor, its ``COPY`` lines lay out the WORKDIR, its
  ``ENV`` sets the environment, and an instruction this module does not mirror fails loudly.
* The interpreter is the host's Python of the image's minor (python:3.11-slim's is CPython 3.11
  built from source; Debian's is a 3.11 too), one the pod's non-root user can reach (the dev
  venv's base lives under /root).
* One venv serves every image: each Containerfile runs the same ``pip install .``.
* The WORKDIR is a folder of the host (not ``/app``: making ``/app`` would change the host's
  root), root-owned and not writable by the pod's user, as the image's is. Its copy of the
  package shadows site-packages' (``python -m`` puts the WORKDIR first on ``sys.path``) exactly
  as in the image, so the venv's own copy of gpufleet, kept by pyproject.toml's hash, may lag
  the tree without the pods ever importing it.

stdlib only: bootstrap.py calls this before any venv exists.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILES = REPO / "deploy" / "containers"
CACHE = REPO / ".venv-image"
VENV = CACHE / "venv"
PYTHON = VENV / "bin" / "python"
STAMP = CACHE / "installed"
#: What the venv is built from, besides pyproject.toml: bump it when the build steps change.
BUILD_STEPS = "1"
#: The one RUN line mirrored (by ``ensure_venv``): an image installing otherwise must be mirrored anew.
INSTALL = "pip install ."


def instructions(path: Path) -> list[tuple[str, str]]:
    """A Containerfile's instructions in order, (``COPY``, its arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@dataclass(frozen=True)
class Containerfile:
    """The instructions of one ``deploy/containers/Containerfile.<name>`` this module mirrors."""

    name: str
    python_minor: str
    #: (sources relative to the build context, destination relative to WORKDIR)
    copies: tuple[tuple[tuple[str, ...], str], ...]
    env: dict[str, str]

    @classmethod
    def read(cls, name: str) -> "Containerfile":
        path = CONTAINERFILES / f"Containerfile.{name}"
        python_minor, workdir, copies, env, installs = None, None, [], {}, False
        for instruction, rest in instructions(path):
            if instruction == "FROM":
                image = rest.split()[0].rsplit("/", 1)[-1]
                if not image.startswith("python:"):
                    raise ValueError(f"{path.name}: FROM {rest}: only python:<minor>-… images are mirrored")
                python_minor = ".".join(image.removeprefix("python:").split("-")[0].split(".")[:2])
            elif instruction == "WORKDIR":
                workdir = rest.strip()
            elif instruction == "COPY":
                *sources, destination = shlex.split(rest)
                if any(source.startswith("--") for source in sources):
                    raise ValueError(f"{path.name}: COPY {rest}: options are not mirrored")
                if destination.startswith("/"):  # only into the WORKDIR, which is all that is laid out
                    if workdir is None or not (destination + "/").startswith(workdir.rstrip("/") + "/"):
                        raise ValueError(f"{path.name}: COPY {rest}: only copies into the WORKDIR are mirrored")
                    destination = "./" + destination[len(workdir.rstrip("/")):].lstrip("/")
                copies.append((tuple(sources), destination))
            elif instruction == "ENV":
                env.update(pair.split("=", 1) for pair in shlex.split(rest))
            elif instruction == "RUN":
                installs = installs or INSTALL in [command.strip() for command in rest.split("&&")]
            elif instruction not in ("ARG", "LABEL", "USER", "EXPOSE", "CMD"):
                # USER is the pod's securityContext's to set; CMD the pod's command's.
                raise ValueError(f"{path.name}: {instruction} is not mirrored by tests/realk8s/image.py")
        if python_minor is None or workdir is None or not installs:
            raise ValueError(f"{path.name}: expected FROM python:<minor>, a WORKDIR and `RUN {INSTALL} ...`")
        return cls(name, python_minor, tuple(copies), env)

    def lay_out(self, into: Path) -> None:
        """The WORKDIR as the Containerfile's COPY lines fill it (a folder's caches left out)."""
        for sources, destination in self.copies:
            target = into / destination
            for source in sources:
                origin = REPO / source
                if origin.is_dir():
                    shutil.copytree(origin, target if len(sources) == 1 else target / origin.name,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
                else:
                    at = target / origin.name if destination.endswith("/") or len(sources) > 1 else target
                    at.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, at)

    def digest(self) -> str:
        """The hash of what the WORKDIR would hold now."""
        digest = hashlib.sha256(self.name.encode())
        for sources, destination in self.copies:
            for source in sources:
                origin = REPO / source
                files = sorted(origin.rglob("*")) if origin.is_dir() else [origin]
                for path in files:
                    if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                        digest.update(f"{destination}\0{path.relative_to(REPO)}\0".encode() + path.read_bytes())
        return digest.hexdigest()[:16]


def image_name(container_image: str) -> str:
    """``gpufleet-control-plane:0.1.0`` → ``control-plane``: the Containerfile a manifest's image
    is built from (the tag is pyproject.toml's version, which the build checks)."""
    name = container_image.rsplit("/", 1)[-1].split(":")[0]
    if not name.startswith("gpufleet-") or not (CONTAINERFILES / f"Containerfile.{name[9:]}").exists():
        raise ValueError(f"image {container_image}: no deploy/containers/Containerfile for it")
    return name[9:]


def _reachable_by_others(path: Path) -> bool:
    """Whether a user other than root can read ``path`` (every folder above it searchable)."""
    path = path.resolve()
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in path.parents) and bool(os.stat(path).st_mode & stat.S_IROTH)


def base_python(minor: str) -> Path:
    """A Python of the image's minor that the pod's non-root user can run, stdlib and all."""
    candidates = [Path(sys.executable)]
    for folder in ("/usr/local/bin", "/usr/bin", *os.environ.get("PATH", "").split(os.pathsep)):
        found = shutil.which(f"python{minor}", path=folder) if folder else None
        if found:
            candidates.append(Path(found))
    for candidate in candidates:
        probe = subprocess.run([candidate, "-c", "import sys, sysconfig; print('%d.%d' % sys.version_info[:2]);"
                                "print(sysconfig.get_path('stdlib')); print(sys._base_executable)"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            continue
        version, stdlib, executable = probe.stdout.split("\n")[:3]
        if version == minor and _reachable_by_others(Path(stdlib)) and _reachable_by_others(Path(executable)):
            return Path(executable)
    raise SystemExit(f"no Python {minor} (the images' FROM) that a non-root pod user can run: tried "
                     + ", ".join(map(str, candidates)))


def _stamp(minor: str) -> str:
    return hashlib.sha256(BUILD_STEPS.encode() + minor.encode() + (REPO / "pyproject.toml").read_bytes()).hexdigest()


def _images() -> list[Containerfile]:
    names = sorted(path.name.removeprefix("Containerfile.") for path in CONTAINERFILES.glob("Containerfile.*"))
    return [Containerfile.read(name) for name in names]


def built() -> bool:
    minors = {image.python_minor for image in _images()}
    return len(minors) == 1 and STAMP.exists() and STAMP.read_text() == _stamp(*minors) and PYTHON.exists()


def ensure_venv() -> Path:
    """The venv each image's ``RUN pip install . && python -m compileall ...`` makes, rebuilt when
    pyproject.toml changes: its base Python, then ``pip install .`` (no extras, not editable) of a
    copy laid out like the control plane's WORKDIR, then byte-compiled."""
    images = _images()
    minors = {image.python_minor for image in images}
    if len(minors) != 1:
        raise SystemExit(f"the images' FROM lines name several Pythons ({sorted(minors)}): one venv cannot mirror them")
    (minor,) = minors
    if built():
        return PYTHON
    CACHE.mkdir(exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:  # pods started together (each in a thread) build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built():
            _build(images, minor)
    return PYTHON


def _build(images: list[Containerfile], minor: str) -> None:
    print(f"building the images' Python install (pip install ., no extras) into {VENV}", flush=True)
    STAMP.unlink(missing_ok=True)
    if VENV.exists():
        shutil.rmtree(VENV)
    subprocess.run([base_python(minor), "-m", "venv", VENV], check=True)
    with tempfile.TemporaryDirectory(prefix="gpufleet-image-build-") as build:
        app = Path(build) / "app"
        next(i for i in images if i.name == "control-plane").lay_out(app)
        # The base Python's own pip, as the image uses python:<minor>-slim's. Its ENV's PIP_NO_CACHE_DIR
        # is left out: pip's cache on this machine keeps a rebuild from downloading everything again.
        subprocess.run([PYTHON, "-m", "pip", "install", "-q", "."], cwd=app, check=True)
    subprocess.run([PYTHON, "-m", "compileall", "-q", VENV / "lib"], check=True, stdout=subprocess.DEVNULL)
    STAMP.write_text(_stamp(minor))


def workdir(name: str) -> Path:
    """The image ``name``'s WORKDIR as its Containerfile lays it out from the tree as it is now,
    byte-compiled (as the image's RUN does), root-owned and read-only to others. Made once per
    content and shared by the pods of a run (each made in a folder of its own, then renamed, so
    pods started together neither race nor see half a layout)."""
    image = Containerfile.read(name)
    folder = CACHE / "workdirs" / f"{name}-{image.digest()}"
    if folder.exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    image.lay_out(partial)
    subprocess.run([ensure_venv(), "-m", "compileall", "-q", partial], check=True, stdout=subprocess.DEVNULL)
    for path in [partial, *partial.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    try:
        partial.rename(folder)
    except OSError:  # another pod made it meanwhile
        shutil.rmtree(partial)
    for stale in folder.parent.glob(f"{name}-*"):
        if stale != folder:
            shutil.rmtree(stale, ignore_errors=True)
    return folder


@dataclass(frozen=True)
class ImageProcess:
    """How a pod's container runs: the image venv's interpreter, from its WORKDIR, with its ENV."""

    python: Path
    workdir: Path
    env: dict[str, str]


def for_container(container_image: str) -> ImageProcess:
    name = image_name(container_image)
    return ImageProcess(ensure_venv(), workdir(name), dict(Containerfile.read(name).env))


@dataclass(frozen=True)
class Imports:
    """What a running Python process loads its modules from."""

    #: module → the file its spec points at (a package's ``__init__.py``), None if not importable.
    found: dict[str, str | None]
    #: The files of site-packages folders the process has mapped (its C extensions).
    mapped: list[Path]


def imports_of(pid: int, modules: list[str]) -> Imports:
    """Where process ``pid`` imports ``modules`` from: its own interpreter (``argv[0]``), its
    environment, its uid and working directory, in its mount namespace, asked for each module's
    spec; and the site-packages files the process itself has mapped."""
    proc = Path(f"/proc/{pid}")
    interpreter = proc.joinpath("cmdline").read_bytes().split(b"\0")[0].decode()
    environ = [item.decode() for item in proc.joinpath("environ").read_bytes().split(b"\0") if item]
    uid, gid = (line.split()[1] for line in proc.joinpath("status").read_text().splitlines()
                if line.startswith(("Uid:", "Gid:")))
    ask = ("import importlib.util, json, sys; specs = {m: importlib.util.find_spec(m) for m in sys.argv[1:]}; "
           "print(json.dumps({m: s and s.origin for m, s in specs.items()}))")
    done = subprocess.run(["nsenter", f"--target={pid}", "--mount", "--wd", "setpriv", f"--reuid={uid}",
                           f"--regid={gid}", "--clear-groups", "env", "-i", *environ, interpreter, "-c", ask, *modules],
                          capture_output=True, text=True, timeout=60, check=True)
    mapped = {Path(line.split()[-1]) for line in proc.joinpath("maps").read_text().splitlines()
              if "/site-packages/" in line}
    return Imports(json.loads(done.stdout), sorted(mapped))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        if built():
            print(PYTHON)
            return 0
        print(f"the images' Python install is not built: run `python3 {Path(__file__).relative_to(REPO)}`",
              file=sys.stderr)
        return 1
    print(ensure_venv())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
