#!/usr/bin/env python3
"""Build AWS's EC2 metadata mock (AEMM) from its published Go module, for the node agent's AWS
spot notice tests (tests/test_reclaim_watch.py).

    python3 tests/ec2_metadata_mock/build.py          # build once into the cache, print the bin folder
    python3 tests/ec2_metadata_mock/build.py --check  # print the bin folder if it is built, else exit 1

AWS publishes it to test what reads instance metadata off an instance: `ec2-metadata-mock spot`
serves `spot/instance-action` as IMDS does (404 until the interruption's delay or trigger time,
then the notice, its `time` as given with `-t`), and `-I` requires IMDSv2 session tokens as
gpufleet launches its instances. `go install .../cmd/ec2-metadata-mock@<version>` works as it is
(its go.mod has no replace lines); the version it prints is embedded from its own tree.

Cached by version under $GPUFLEET_EC2_METADATA_MOCK_CACHE (default
~/.cache/gpufleet/ec2-metadata-mock/<version>), beside the other Go-built test components; Go's
build and module caches are Go's own. About 30 s cold on 2 cores.
stdlib only: bootstrap.py calls this before any venv exists.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # a script: the repository's tests package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gobuild import GoInstalled  # noqa: E402

#: The newest release the module proxy serves.
VERSION = "v1.13.0"
TOOL = GoInstalled(title="AWS's EC2 metadata mock", command="github.com/aws/amazon-ec2-metadata-mock/cmd/ec2-metadata-mock",
                   version=VERSION, cache_env="GPUFLEET_EC2_METADATA_MOCK_CACHE", folder="ec2-metadata-mock",
                   script="tests/ec2_metadata_mock/build.py")
built, build, missing_reason, mock_path = TOOL.built, TOOL.build, TOOL.missing_reason, TOOL.path

if __name__ == "__main__":
    sys.exit(TOOL.main(sys.argv[1:]))
