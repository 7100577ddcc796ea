"""Deterministic names derived from workflow ids (safe to call in workflows)."""

from __future__ import annotations

import hashlib


def node_name_for(site: str, join_id: str, nonce: str = "") -> str:
    """A node name that a retried or replayed join always computes the same. ``nonce``: the
    join's per-start nonce (its first run id): a later join started with the same id gets a
    new name, so an earlier machine's certificate for the old name never becomes a live
    node's again. Without one (joins started before the nonce), the name of the id alone."""
    seed = f"{join_id}#{nonce}" if nonce else join_id
    return f"{site}-{hashlib.sha256(seed.encode()).hexdigest()[:8]}"


def join_workflow_id(site: str, request: str) -> str:
    return f"join/{site}/{request}"


def account_workflow_id(provider: str, account: str) -> str:
    return f"account/{provider}/{account}"


def site_workflow_id(site: str) -> str:
    return f"site/{site}"


def capacity_workflow_id(request: str) -> str:
    return f"capacity/{request}"


def reclaim_workflow_id(node_name: str) -> str:
    return f"reclaim/{node_name}"
