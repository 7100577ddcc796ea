"""How the full suite's tests are shared among its pytest-xdist workers (bootstrap.py ``test``
passes ``--dist loadscope``; this module's scheduler takes that over).

* Each test file's tests go to one worker, so its module-scoped fixtures (fakes, servers) start once.
* A real tier's package starts a whole cluster in each worker that runs its tests (a package-scoped
  fixture), so its files go together: the real Temporal tier's to one worker, the real Kubernetes
  tier's to two, each starting its own control plane. In one worker that tier's tests take some
  13 minutes (their times add up to about 800 s), nearly a whole run's wall time on five workers.

Why not pytest-xdist's own groups (``--dist loadgroup`` and the ``xdist_group`` mark, what the suite
used before): xdist 3.8 groups by appending the group to each test's node id, and pytest 9 no
longer reads that attribute. Nothing said so; every test was scheduled on its own, so each of the
four workers started a real control plane and a real Temporal cluster of its own, and each
module's fixtures started in every worker. A scheduler that groups by path changes no node id.
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

#: Packages whose tests share a package-scoped cluster, each with its work units after the
#: first: the files named there go to a worker (and control plane) of their own; every other
#: file of the package, a new one too, goes with the first unit. The real Kubernetes tier's
#: second unit holds its tests that boot machines and wait for kubelets (about half its time).
CLUSTER_PACKAGES: dict[str, tuple[frozenset[str], ...]] = {
    "tests/realk8s/": (frozenset({
        "test_join.py", "test_reinstall.py", "test_watch.py", "test_labels.py", "test_blast_radius.py",
    }),),
    "tests/realtemporal/": (),
}


def work_unit(nodeid: str) -> str:
    """The unit a test is scheduled with: its file, or its cluster package's part."""
    path = nodeid.split("::", 1)[0]
    for package, later_units in CLUSTER_PACKAGES.items():
        if path.startswith(package):
            name = path.removeprefix(package)
            number = next((index for index, files in enumerate(later_units, start=2) if name in files), 1)
            return f"{package}#{number}"
    return path


class FileAndClusterScheduling(LoadScopeScheduling):
    """xdist's scope scheduling (whole units to a worker, the units with most tests first), with
    ``work_unit`` as the scope."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)


@pytest.hookimpl(optionalhook=True)  # ``-p no:xdist`` (a serial run) declares no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling | None:
    if config.getvalue("dist") == "loadscope":
        return FileAndClusterScheduling(config, log)
    return None
