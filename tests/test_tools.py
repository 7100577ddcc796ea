"""The programs tests drive (tests/tools.py) and what `python3 bootstrap.py test` says about them:
a missing one skips its tests naming how to get it and fails them in CI, kubectl is found where
the real tier's build leaves it, and the set-up names every test file that will skip for a missing
program (bootstrap.SKIPPED_WITHOUT, kept here in step with the tests that ask for each)."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

import bootstrap
from tests import tools
from tests.realk8s import build

ROOT = Path(__file__).resolve().parents[1]
#: ``needs("a", "b")`` / ``require("a")``: how a test asks for a program (tests/tools.py).
ASKED = re.compile(r"\b(?:needs|require)\(((?:\s*\"[\w.-]+\"\s*,?)+)\)")


def asked_for() -> dict[str, set[str]]:
    """program -> the test files that ask for it."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == "tools.py" or path == Path(__file__):
            continue
        for match in ASKED.finditer(path.read_text()):
            for name in re.findall(r'"([\w.-]+)"', match.group(1)):
                found.setdefault(name, set()).add(path.relative_to(ROOT).as_posix())
    return found


def test_the_set_up_names_every_file_that_skips_for_a_missing_program() -> None:
    asked = asked_for()
    assert {"haproxy", "cloud-init", "curl", "promtool", "kubectl"} <= set(asked), asked
    for name, files in asked.items():
        assert name in bootstrap.SKIPPED_WITHOUT, f"bootstrap.SKIPPED_WITHOUT has no entry for {name}"
        assert files <= set(bootstrap.SKIPPED_WITHOUT[name]), f"{name}: add {sorted(files)} to SKIPPED_WITHOUT"
    for name, entries in bootstrap.SKIPPED_WITHOUT.items():
        assert name in bootstrap.SYSTEM_TOOLS or name == "kubectl", name
        for entry in entries:
            if entry.endswith(".py"):
                assert (ROOT / entry).exists() and entry in asked.get(name, set()), \
                    f"SKIPPED_WITHOUT[{name!r}] names {entry}, which does not ask for {name}"
    assert set(bootstrap.SYSTEM_TOOLS) <= set(bootstrap.SKIPPED_WITHOUT)


def test_a_missing_program_is_named_with_the_tests_that_will_skip(monkeypatch, capsys) -> None:
    monkeypatch.setattr(bootstrap, "missing_tools", lambda: {"haproxy": "haproxy", "ip": "iproute2"})
    monkeypatch.setattr(bootstrap.subprocess, "call", lambda *a, **k: 1)  # no apt here, whoever runs it
    monkeypatch.delenv("CI", raising=False)
    bootstrap.ensure_system_packages()
    said = capsys.readouterr().err.splitlines()
    assert said[0] == "missing haproxy, ip (Debian: apt-get install haproxy iproute2); these tests will skip:"
    assert "  tests/test_front_door.py (needs haproxy)" in said
    assert "  the real Kubernetes tier (tests/realk8s) (needs ip)" in said
    monkeypatch.setenv("CI", "true")
    with pytest.raises(SystemExit) as refused:
        bootstrap.ensure_system_packages()
    assert "CI runs every test" in str(refused.value) and "tests/test_routing_entity.py" in str(refused.value)


@pytest.fixture
def no_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(bootstrap, "SBIN", ())
    monkeypatch.setattr(tools, "SBIN", ())
    monkeypatch.setenv("GPUFLEET_REALK8S_CACHE", str(tmp_path / "realk8s"))
    return tmp_path


def test_kubectl_is_found_where_the_real_tiers_build_leaves_it(no_path: Path) -> None:
    assert tools.find("kubectl") is None
    built = no_path / "realk8s" / build.KUBERNETES_VERSION / "bin" / "kubectl"
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    built.chmod(built.stat().st_mode | stat.S_IXUSR)
    assert tools.find("kubectl") == str(built) == tools.require("kubectl")


def test_a_missing_program_skips_saying_how_to_get_it_and_fails_in_ci(no_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install haproxy"):
        tools.require("haproxy")
    with pytest.raises(pytest.skip.Exception, match="tests/realk8s/build.py"):
        tools.require("kubectl")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI runs every test: `haproxy` is not installed"):
        tools.require("haproxy")
