"""Temporal workflows only: deterministic, each reads like its runbook."""

from workflows.node_join import NodeJoin

ALL_WORKFLOWS = [NodeJoin]
