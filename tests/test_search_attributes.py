"""The search-attribute registry on a dev server that does not know our keys yet
(an existing database: ``--search-attribute`` flags only apply to a new one)."""

from __future__ import annotations

import uuid

from temporalio.testing import WorkflowEnvironment

from fleet import search_attributes as sa
from cli.dev import dev_server_tuning_flags, temporal_binary


async def test_keys_registered_on_a_running_server_are_usable_at_once() -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error",
        dev_server_extra_args=dev_server_tuning_flags(),
    )
    try:
        client = env.client
        added = await sa.ensure_registered(client)
        assert set(added) == {key.name for key in sa.ALL}
        # The server caches its registry: a start carrying the new keys right away must still pass.
        join_id = f"join/site-x/{uuid.uuid4().hex[:6]}"
        handle = await client.start_workflow(
            "NodeJoin", {"site": "site-x"}, id=join_id, task_queue="nobody-polls",
            search_attributes=sa.join_start_attributes("site-x", "lambda", "acct-x", join_id),
        )
        assert (await handle.describe()).typed_search_attributes[sa.SITE] == "site-x"
        assert await sa.ensure_registered(client) == []
    finally:
        await env.shutdown()
