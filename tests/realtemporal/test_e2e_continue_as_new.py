"""Continue-as-new on the real Temporal cluster: tests/test_continue_as_new.py's evacuation test,
unchanged, in the cluster's continue-as-new namespace (the server suggests continue-as-new there
at 50 events; see tests/realtemporal/conftest.py). The evacuation continues as new twice while it
waits for the provider, each new run of the same workflow id on the same shard through
PostgreSQL, and the chain must restore exactly as one run would (every mark, move and drained
node carried)."""

from __future__ import annotations

from tests.test_continue_as_new import (  # noqa: F401
    inc,
    test_evacuation_continues_as_new_while_waiting_for_recovery_and_restores,
)
