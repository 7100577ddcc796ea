"""The layers of the house hold: every import points down a floor (pyproject's
``[tool.importlinter]`` contracts), so the next upward arrow fails CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    run = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def test_no_product_code_waits_with_asyncio_wait_for():
    """On Python 3.11 (the version CI and the images run) ``asyncio.wait_for`` swallows a cancel
    that comes as the awaited thing completes. It hid three ways: a node's health watch the entity
    had cancelled waited out its whole wait beside its replacement, a gateway poll whose caller had
    left went upstream anyway, and a test's background task never ended (a CI run hung for 300 s).
    ``async with asyncio.timeout(...)`` runs the awaited thing in the same task, so a cancel always
    lands. Tests are not held to it: a test awaits in its own task, which nothing cancels."""
    import tomllib

    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
    found = [f"{path.relative_to(REPO)}:{number}"
             for package in packages for path in sorted((REPO / package).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if "asyncio.wait_for(" in line]
    assert found == [], f"asyncio.wait_for in product code (use asyncio.timeout): {found}"
