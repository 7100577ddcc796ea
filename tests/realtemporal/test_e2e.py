"""The suite's end-to-end tests, run unchanged against the real Temporal cluster.

Each test below is imported from the module that runs it on the dev server, with the fixtures it
uses there; tests/realtemporal/conftest.py's ``temporal_env`` makes them run on the real cluster
(PostgreSQL persistence and SQL visibility, values.yaml's history shards, separate frontend,
history, matching and worker services, deploy/temporal's dynamic config) in values.yaml's
namespace, with every simulated node agent behind a node gateway as deployed.

What the real cluster adds to each: workflow ids spread over many shards (a site's entity, its
nodes' entities and their repairs each on a shard of its own, so every signal, child and query
between them crosses shards); visibility queries on search attributes answered by SQL (the dev
server's SQLite has its own query path); Schedules run by the worker service's per-namespace
scheduler; and the task-queue partitions of the dynamic config.
"""

from __future__ import annotations

from tests.test_cli_capacity import cap, test_schedules_apply_is_idempotent_and_listed  # noqa: F401
# An evacuation whose worker dies midway and a new one resumes it: all it had done is the
# cluster's (PostgreSQL), none of it the worker's.
from tests.test_evacuation import test_worker_killed_mid_evacuation_resumes  # noqa: F401
from tests.test_node_join import (  # noqa: F401
    test_join_happy_path,
    test_join_started_with_its_search_attributes_writes_only_what_changes,
)
from tests.test_repair import rstack, test_xid48_reset_fixes_and_node_serves_only_after_proof  # noqa: F401

