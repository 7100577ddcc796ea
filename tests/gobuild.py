"""The command line the Go-built test components' build scripts share (tests/realk8s/build.py,
tests/realtemporal/build.py, tests/helm/build.py, tests/prometheus_operator/build.py,
tests/ec2_metadata_mock/build.py).

stdlib only: bootstrap.py runs those scripts before any venv exists.
"""

from __future__ import annotations

import sys
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
