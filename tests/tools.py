"""The programs some tests drive for real (prometheus, cloud-init, haproxy, curl, kubectl, ...).

One rule for all of them: a test that needs a missing program skips, saying how to get it; in CI
(``CI=true``, set by .ci/run) it fails instead, so no check vanishes from CI without a word.
``python3 bootstrap.py test`` installs the Debian packages (``bootstrap.SYSTEM_TOOLS``) when it can.
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

from bootstrap import SBIN, SYSTEM_TOOLS


def find(name: str) -> str | None:
    """The program's path, or None. kubectl: the one tests/realk8s/build.py builds (its pinned
    version, in ``~/.cache/gpufleet/realk8s/<version>/bin`` or ``$GPUFLEET_REALK8S_CACHE``) first,
    then one an earlier pin left there, then PATH; the others: PATH, then /usr/sbin and /sbin."""
    if name == "kubectl":
        from tests.realk8s import build

        pinned = build.bin_dir() / "kubectl"
        earlier = sorted(build.cache_dir().parent.glob("v*/bin/kubectl"), reverse=True)
        for path in (pinned, *earlier):
            if os.access(path, os.X_OK):
                return str(path)
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN]))


def how_to_get(name: str) -> str:
    if name == "kubectl":
        return "python3 tests/realk8s/build.py builds it (bootstrap.py test does)"
    return f"apt-get install {SYSTEM_TOOLS.get(name, name)}; python3 bootstrap.py test does as root"


def missing_reason(name: str) -> str | None:
    return None if find(name) else f"`{name}` is not installed ({how_to_get(name)})"


def require(name: str) -> str:
    """The program's path; else skip the test (fail it in CI) naming how to get it."""
    path = find(name)
    if path is None:
        skip_or_fail(missing_reason(name) or name)
    return path


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the test saying why; in CI fail it instead: CI runs every test."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI runs every test: {reason}", pytrace=False)
    pytest.skip(reason)


def needs(*names: str) -> pytest.MarkDecorator:
    """A mark for tests (or a module's ``pytestmark``) that drive these programs: before the test
    runs, tests/conftest.py ``require``s each one (skip with the reason; in CI, fail)."""
    return pytest.mark.needs_tools(*names)


def require_marked(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs_tools"):
        for name in mark.args:
            require(name)
