"""One workflow at a time acts on a thing (a site's evacuation, a model's rollout): a claim record
in the cluster's state store (``Cluster.update_state``) names the one acting, taken by
compare-and-swap. Temporal's visibility, which a listing reads, is eventually consistent (about a
second behind with Elasticsearch): two workflows started within its lag each listed none and both
acted. Whether the holder still runs is asked of Temporal by its id (``describe``, consistent), so
a holder that ended in any way (completed, failed, cancelled, terminated) frees the thing at once,
with nothing to release and nothing left held by a run that could not release it.
"""

from __future__ import annotations

import asyncio

from temporalio.client import Client

from activities.capacity import is_running
from fleet.errors import Transient

#: The claim record's value that names the workflow holding it.
CLAIM_HOLDER = "workflow-id"


class _ClaimMoved(Exception):
    """The claim changed between its read and its write."""


async def take_claim(client: Client, cluster, kind: str, key: str, workflow_id: str) -> str:
    """The workflow holding claim ``kind``/``key`` when that is another, still running; "" when
    ``workflow_id`` holds it now (taken here, or by an earlier attempt or run of it: a run that
    continued as new keeps its id). A holder that ended is replaced. Other values of the record
    are kept."""
    for _ in range(10):
        claim = await asyncio.to_thread(cluster.read_state, kind, key)
        holder = claim.get(CLAIM_HOLDER, "")
        if holder == workflow_id:
            return ""
        if holder and await is_running(client, holder):
            return holder

        def take(data: dict[str, str], seen: str = holder) -> dict[str, str]:
            if data.get(CLAIM_HOLDER, "") != seen:
                raise _ClaimMoved  # another took it since it was read: look again
            return {**data, CLAIM_HOLDER: workflow_id}

        try:
            await asyncio.to_thread(cluster.update_state, kind, key, take)
        except _ClaimMoved:
            continue
        return ""
    raise Transient(f"{kind} {key}: the claim kept changing", provider="kubernetes")
