"""The one registry of search attribute keys gpufleet uses.

The SQLite dev server allows 10 custom Keyword attributes and 3 of each other
type per namespace; this list stays inside that. ``ensure_registered`` adds the
missing ones (an existing dev-server database ignores ``--search-attribute``).
"""

from __future__ import annotations

import asyncio
import time

from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.service import RPCError

from fleet.naming import node_name_for

SITE = SearchAttributeKey.for_keyword("Site")
PROVIDER = SearchAttributeKey.for_keyword("Provider")
ACCOUNT = SearchAttributeKey.for_keyword("Account")
NODE_NAME = SearchAttributeKey.for_keyword("NodeName")
#: Lifecycle word of the thing the workflow drives: provisioning, ready, needs-person, ...
FLEET_STATE = SearchAttributeKey.for_keyword("FleetState")
REPAIR_RUNG = SearchAttributeKey.for_keyword("RepairRung")
MODEL = SearchAttributeKey.for_keyword("Model")
MODEL_VERSION = SearchAttributeKey.for_keyword("ModelVersion")
GPU_INDEX = SearchAttributeKey.for_int("GpuIndex")

ALL: list[SearchAttributeKey] = [
    SITE, PROVIDER, ACCOUNT, NODE_NAME, FLEET_STATE, REPAIR_RUNG, MODEL, MODEL_VERSION, GPU_INDEX,
]

def join_attributes(site: str, provider: str, account: str, join_id: str) -> list[SearchAttributePair]:
    """What a NodeJoin shows from its first moment: site, provider, account, node name, provisioning."""
    return [
        SearchAttributePair(SITE, site), SearchAttributePair(PROVIDER, provider),
        SearchAttributePair(ACCOUNT, account), SearchAttributePair(NODE_NAME, node_name_for(site, join_id)),
        SearchAttributePair(FLEET_STATE, "provisioning"),
    ]


def join_start_attributes(site: str, provider: str, account: str, join_id: str) -> TypedSearchAttributes:
    """For whoever starts a NodeJoin and knows its site: set at start they cost no
    visibility write of their own, and the join upserts only what differs."""
    return TypedSearchAttributes(join_attributes(site, provider, account, join_id))


def dev_server_flags() -> list[str]:
    """``--search-attribute Name=Type`` flags for a new dev-server database."""
    flags = []
    for key in ALL:
        flags += ["--search-attribute", f"{key.name}={key.indexed_value_type.name.removeprefix('INDEXED_VALUE_TYPE_').title()}"]
    return flags


async def ensure_registered(client: Client, settle_seconds: float = 60) -> list[str]:
    """Register every missing key and wait until the server accepts them; returns the
    names it added. (gpufleet's dev servers cache search attributes instead of
    re-reading them on every use, so a new key takes a few seconds to be usable.)"""
    existing = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace)
    )
    missing = {
        key.name: key.indexed_value_type.value
        for key in ALL
        if key.name not in existing.custom_attributes
    }
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=client.namespace, search_attributes=missing)
        )
        await _until_usable(client, sorted(missing), settle_seconds)
    return sorted(missing)


async def _until_usable(client: Client, names: list[str], timeout: float) -> None:
    query = " AND ".join(f"{name} IS NULL" for name in names)
    deadline = time.monotonic() + timeout
    while True:
        try:
            await client.count_workflows(query)
            return
        except RPCError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
