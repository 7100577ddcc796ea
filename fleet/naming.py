"""Deterministic names derived from workflow ids (safe to call in workflows)."""

from __future__ import annotations

import hashlib


def node_name_for(site: str, join_id: str) -> str:
    """A node name that a retried or replayed join always computes the same."""
    return f"{site}-{hashlib.sha256(join_id.encode()).hexdigest()[:8]}"


def join_workflow_id(site: str, request: str) -> str:
    return f"join/{site}/{request}"
