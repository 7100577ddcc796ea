"""A next release of the control plane for tests/test_upgrade.py: today's workflows, with NodeJoin
changed the way a release changes a workflow whose runs may be open (one more patch, asked first).

A workflow module (the sandbox imports it again for each run): nothing at import time but the
class.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from fleet.messages.join import NodeJoinResult

from workflows.node_join import NodeJoin

#: The change this release makes to NodeJoin. Not in the ``workflows`` package, so ``gpufleet
#: patches`` (which scans that package) does not list it: the test reads its effect by query.
NEXT_PATCH = "upgrade-test-next-release"


@workflow.defn(name="NodeJoin")
class NodeJoinNextRelease(NodeJoin):
    def __init__(self) -> None:
        super().__init__()
        self._next_path = False

    @workflow.query
    def next_path(self) -> bool:
        """Whether this run took the next release's path (False: a run from before it)."""
        return self._next_path

    @workflow.run
    async def run(self, raw: Any) -> NodeJoinResult:
        self._next_path = workflow.patched(NEXT_PATCH)  # first: before any activity
        return await super().run(raw)
