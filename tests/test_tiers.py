"""The test tiers (tests/plugins/tiers.py): the unit tier holds only in-process tests, and the
guard fails a unit test that starts a process, a Temporal dev server or a server on a
non-loopback address, even one that catches the error."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.plugins.tiers import INTEGRATION, UnitTierViolation, unit_guard

ROOT = Path(__file__).resolve().parent.parent


def test_the_guard_refuses_a_subprocess_and_records_it_even_when_the_test_catches_it() -> None:
    before = subprocess.Popen.__init__
    with unit_guard() as seen:
        with pytest.raises(UnitTierViolation, match="started a subprocess"):
            subprocess.run(["true"])
        try:
            os.system("true")
        except UnitTierViolation:
            pass  # a test that swallows the error still leaves the record
    assert [what.split(" ")[0:2] for what in seen] == [["started", "a"], ["called", "os.system('true',)"]]
    assert subprocess.Popen.__init__ is before, "the guard put back what it replaced"


@pytest.mark.parametrize(("family", "address"), [(socket.AF_INET, ("0.0.0.0", 0)), (socket.AF_INET, ("", 0)),
                                                 (socket.AF_INET6, ("::", 0))], ids=["0.0.0.0", "empty", "::"])
def test_the_guard_refuses_a_socket_on_every_address(family, address) -> None:
    with unit_guard() as seen, socket.socket(family) as sock:
        with pytest.raises(UnitTierViolation, match="not loopback"):
            sock.bind(address)
    assert seen


@pytest.mark.parametrize(("family", "address"), [(socket.AF_INET, ("127.0.0.1", 0)), (socket.AF_INET, ("localhost", 0)),
                                                 (socket.AF_INET6, ("::1", 0))], ids=["127.0.0.1", "localhost", "::1"])
def test_the_guard_lets_in_process_fakes_listen_on_loopback(family, address) -> None:
    with unit_guard() as seen, socket.socket(family) as sock:
        sock.bind(address)
        sock.listen()
    assert seen == []


async def test_the_guard_refuses_a_temporal_dev_server() -> None:
    from temporalio.testing import WorkflowEnvironment

    with unit_guard() as seen:
        with pytest.raises(UnitTierViolation, match="Temporal dev server"):
            await WorkflowEnvironment.start_local(dev_server_existing_path="/nonexistent/temporal")
    assert seen == ["started a Temporal dev server"]


INNER_TESTS = '''
    import socket
    import subprocess

    import pytest


    def test_spawns():
        subprocess.run(["true"])


    def test_swallows_the_refusal():
        try:
            subprocess.run(["true"])
        except Exception:
            pass


    @pytest.mark.integration
    def test_marked_integration_spawns():
        subprocess.run(["true"])


    def test_listens_on_loopback():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))


    def test_listens_everywhere():
        with socket.socket() as sock:
            sock.bind(("0.0.0.0", 0))


    def test_pure():
        assert sorted([3, 1, 2]) == [1, 2, 3]
'''


@pytest.mark.integration  # a pytest session of its own, as a process
def test_a_session_with_the_plugin_fails_only_the_unit_tests_that_leave_the_process(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    integration: x\n    unit: x\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.plugins.tiers", "-p", "no:cacheprovider", "-q", "-rA",
         "-p", "no:asyncio", "-p", "no:timeout", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    # The -rA summary: "PASSED test_inner.py::test_pure", "FAILED test_inner.py::test_spawns - why".
    outcome = {line.split(" ")[1].split("::")[1]: line.split(" ")[0] for line in done.stdout.splitlines()
               if line.startswith(("PASSED test_inner.py::", "FAILED test_inner.py::"))}
    assert outcome == {
        "test_spawns": "FAILED", "test_swallows_the_refusal": "FAILED", "test_listens_everywhere": "FAILED",
        "test_marked_integration_spawns": "PASSED", "test_listens_on_loopback": "PASSED", "test_pure": "PASSED",
    }, done.stdout[-4000:] + done.stderr[-2000:]
    assert "mark this one @pytest.mark.integration" in done.stdout


@pytest.mark.integration  # collects the whole suite, as a process
def test_the_fast_tier_holds_the_pure_tests_and_none_that_start_servers() -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only", "-m", "unit"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    unit = {line.split("[")[0] for line in done.stdout.splitlines() if "::" in line}
    for pure in ("tests/test_policy.py::test_weight_at", "tests/test_repair_policy.py::test_ladder_is_ordered",
                 "tests/test_replay.py::test_recorded_history_replays",
                 "tests/test_time_skipping.py::test_a_request_nothing_can_serve_backs_off_doubling_to_its_cap_and_"
                 "gives_up_at_its_deadline"):
        assert pure in unit, f"{pure} left the unit tier"
    for heavy in ("tests/test_control_plane_loss.py::test_gameday_control_plane_loss",
                  "tests/test_bench_actions.py::test_smoke_run_prints_every_figure",
                  "tests/test_soak.py::test_short_chaos_soak_keeps_every_invariant",
                  "tests/test_bench_smoke.py::test_the_bench_runs_at_its_smoke_size_and_prints_its_figures",
                  "tests/test_capacity.py::test_no_capacity_at_first_choice_uses_the_second"):
        assert heavy not in unit, f"{heavy} is in the unit tier"


def test_every_test_listed_as_integration_still_exists() -> None:
    """A listed test that was renamed would fall into the unit tier (where the guard fails it) and
    its entry would linger: each entry names a module and a test that are there."""
    for listed in INTEGRATION:
        module, _, test = listed.partition("::")
        source = (ROOT / module).read_text()  # a missing module raises, naming it
        if test:
            assert re.search(rf"^(async )?def {re.escape(test)}\(", source, re.MULTILINE), f"{listed} is gone"


@pytest.mark.integration  # a pytest session of its own, as a process
def test_a_misspelt_marker_fails_collection(tmp_path: Path) -> None:
    (tmp_path / "test_misspelt.py").write_text("import pytest\n\n\n@pytest.mark.integraton\ndef test_x():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
                           "-p", "no:cacheprovider", "--collect-only", "-q", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout[-2000:]
    assert "'integraton' not found in `markers` configuration option" in done.stdout + done.stderr
