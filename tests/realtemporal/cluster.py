"""The real Temporal cluster for this tier's tests: cli/temporal_cluster.py (PostgreSQL, the schema,
frontend, history, matching and worker, from deploy/temporal/values.yaml), the same launcher
``gpufleet dev --temporal cluster`` runs. Re-exported here under the names the tests use.

``python -m tests.realtemporal.cluster`` (as ``python -m cli.temporal_cluster``) runs one until
Ctrl-C and prints its address and process ids (``bench.scale --address ... --server-pids ...``).
"""

from __future__ import annotations

import sys

from cli.temporal_cluster import (  # noqa: F401 - the tier's names
    CHART_ONLY_KEYS,
    DEPLOY,
    DYNAMIC_CONFIG,
    REPO,
    SCHEMA_BY_STORE,
    SERVICES,
    START_SECONDS,
    VALUES,
    ClusterFailed,
    Postgres,
    RealTemporal,
    datastores,
    history_shards,
    internode_secret,
    internode_tls,
    main,
    missing_reason,
    parse_retention,
    postgres_bin,
    postgres_user,
    values,
)

if __name__ == "__main__":
    sys.exit(main())
