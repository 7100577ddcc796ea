"""Which pytest-xdist worker runs which tests in the full suite (tests/plugins/scheduling.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import bootstrap
from tests.plugins.scheduling import CLUSTER_PACKAGES, work_unit

REPO = Path(__file__).resolve().parents[1]


def test_each_test_file_is_one_unit_and_each_cluster_package_a_few() -> None:
    assert work_unit("tests/test_evacuation.py::test_no_false_trips") == "tests/test_evacuation.py"
    assert work_unit("tests/rollout/test_rollout_workflow.py::test_x[bake]") == "tests/rollout/test_rollout_workflow.py"
    # The real Kubernetes tier: its machine-booting files in a second worker, the rest (a file
    # added later too) in the first, each with a control plane of its own.
    assert work_unit("tests/realk8s/test_join.py::test_a[aws]") == "tests/realk8s/#2"
    assert work_unit("tests/realk8s/test_reinstall.py::test_b") == "tests/realk8s/#2"
    assert work_unit("tests/realk8s/test_adapter.py::test_c") == "tests/realk8s/#1"
    assert work_unit("tests/realk8s/test_added_next_year.py::test_d") == "tests/realk8s/#1"
    assert work_unit("tests/realtemporal/test_tls.py::test_e") == "tests/realtemporal/#1"
    # Every file a later unit names exists: a renamed file would quietly move to the first unit.
    for package, later_units in CLUSTER_PACKAGES.items():
        for files in later_units:
            assert all((REPO / package / name).is_file() for name in files), (package, files)


@pytest.mark.integration  # pytest-xdist's workers, each a process
def test_the_full_suites_workers_run_each_files_tests_together() -> None:
    """With the full suite's own options (bootstrap.py), each file's tests run in one worker, so
    its module's fixtures start once. (Before: pytest-xdist's groups were ignored under pytest 9,
    and every test was scheduled on its own.)"""
    files = ["tests/test_entity_base.py", "tests/cluster/test_manifests.py", "tests/test_backup.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", *bootstrap.full_suite_workers([]), *files],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for worker, path in re.findall(r"^\[(gw\d+)\] \[ *\d+%\] PASSED (\S+?)::", run.stdout, re.MULTILINE):
        workers[path].add(worker)
    assert set(workers) == set(files), run.stdout[-3000:]
    assert all(len(ran_in) == 1 for ran_in in workers.values()), dict(workers)


@pytest.mark.integration  # pytest as a process of its own
def test_a_serial_run_without_xdist_still_starts() -> None:
    """`python3 bootstrap.py test -p no:xdist` (docs/getting-started.md) runs the suite serially:
    the scheduler's hook must not stop pytest where xdist is not loaded."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                          "tests/test_scheduling.py::test_each_test_file_is_one_unit_and_each_cluster_package_a_few"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
