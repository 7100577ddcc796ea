"""Temporal workflows only: deterministic, each reads like its runbook.

This package imports nothing at import time: the workflow sandbox re-imports a
workflow's module (and so this package) for every workflow run, and pulling in
every workflow here cost 40% of the worker's CPU. The list of workflows lives
in ``workflows.registry``; ``workflows.ALL_WORKFLOWS`` still works.
"""


def __getattr__(name: str):
    if name == "ALL_WORKFLOWS":
        from workflows.registry import ALL_WORKFLOWS

        return ALL_WORKFLOWS
    raise AttributeError(name)
