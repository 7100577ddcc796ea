"""The real Temporal tier: one real cluster (``cluster.RealTemporal``: PostgreSQL, frontend, history,
matching and worker as processes, numHistoryShards and the dynamic config from deploy/temporal)
for this package's tests, and a node gateway in front of it as deployed.

Skipped, with one line saying what is missing, where the server is not built (no Go) or
PostgreSQL's server is not installed. In CI (``CI=true``) a missing piece fails instead.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator

import pytest

from tests.realtemporal import build, cluster
from tests.realtemporal.cluster import RealTemporal

if TYPE_CHECKING:
    from temporalio.testing import WorkflowEnvironment

#: A namespace of the test cluster's own for the continue-as-new tests: the server suggests
#: continue-as-new there at 50 events (production's 4,096 would take minutes to reach). The
#: one key is constrained to that namespace, so values.yaml's namespace runs the shipped file
#: alone (tests/realtemporal/test_config.py checks both).
CAN_NAMESPACE = "gpufleet-can"
#: ``bench.scale --address``'s namespace (tests/realtemporal/test_bench_scale.py): its fleet's
#: entities and Schedules stay out of the other tests' way.
BENCH_NAMESPACE = "gpufleet-bench"
CAN_SUGGEST_AT = 50
CAN_DYNAMIC_CONFIG = f"""# Added by tests/realtemporal for {CAN_NAMESPACE} only.
limit.historyCount.suggestContinueAsNew:
  - value: {CAN_SUGGEST_AT}
    constraints:
      namespace: {CAN_NAMESPACE}
"""


#: Fixtures that need the built server (and PostgreSQL): a test using one is skipped where they
#: are missing, and is never in the unit tier. The tier's other tests read files only.
NEEDS_SERVER = {"real_temporal", "temporal_server"}


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py derives the unit tier from the marks
def pytest_collection_modifyitems(config, items):
    reason = cluster.missing_reason()
    for item in items:
        if Path(str(item.fspath)).parent != Path(__file__).parent:
            continue
        item.add_marker(pytest.mark.realtemporal)
        if NEEDS_SERVER & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
            if reason and os.environ.get("CI") != "true":
                item.add_marker(pytest.mark.skip(reason=reason))


def _require_built() -> None:
    reason = cluster.missing_reason()
    if reason:
        pytest.fail(f"CI must run the real Temporal tier: {reason}")


@pytest.fixture(scope="package")
def temporal_server() -> Path:
    """The built ``temporal-server`` binary."""
    _require_built()
    return build.bin_dir() / "temporal-server"


@pytest.fixture(scope="package")
async def real_temporal(tmp_path_factory) -> AsyncIterator[RealTemporal]:
    """One cluster for the tier's tests, stopped when they are done."""
    _require_built()
    running = RealTemporal(tmp_path_factory.mktemp("realtemporal"), extra_dynamic_config=CAN_DYNAMIC_CONFIG,
                           extra_namespaces=(CAN_NAMESPACE, BENCH_NAMESPACE))
    await asyncio.to_thread(running.start)
    try:
        yield running
    finally:
        await asyncio.to_thread(running.stop)


@pytest.fixture(scope="package")
async def temporal_env(real_temporal: RealTemporal) -> AsyncIterator[WorkflowEnvironment]:
    """tests/conftest.py's ``temporal_env``, on the real cluster: values.yaml's namespace (the one
    deploy/kubernetes names), and a node gateway in front of it, so the suite's stack fixtures
    (``stack``, ``fleet_world``, the helpers' stacks) and the tests written on them run here
    unchanged."""
    # Imported here: collecting this tier must not load the stack (tests/conftest.py loads it lazily).
    from temporalio.testing import WorkflowEnvironment

    from fleet.naming import CONTROL_PLANE_QUEUE
    from tests.conftest import CONTROL_PLANE_QUEUES, NODE_GATEWAYS, start_test_gateway

    client = await real_temporal.connect(namespace=real_temporal.namespaces[0][0])
    gateway = await start_test_gateway(client)
    NODE_GATEWAYS[real_temporal.address] = gateway
    # The stacks' control planes poll the production queue and its four partitions.
    CONTROL_PLANE_QUEUES[real_temporal.address] = CONTROL_PLANE_QUEUE
    try:
        yield WorkflowEnvironment.from_client(client)
    finally:
        CONTROL_PLANE_QUEUES.pop(real_temporal.address, None)
        NODE_GATEWAYS.pop(real_temporal.address, None)
        await gateway.running.stop(grace=None)


@pytest.fixture(scope="package")
async def can_env(real_temporal: RealTemporal) -> WorkflowEnvironment:
    """tests/test_continue_as_new.py's ``can_env``: the continue-as-new namespace. Its stacks'
    settings name the default namespace, which a node gateway would refuse (it admits its one
    namespace only), so their simulated agents share this client, as without a gateway: the
    client connects under the frontend's other name (``localhost``), which has no gateway."""
    from temporalio.testing import WorkflowEnvironment

    address = real_temporal.address.replace("127.0.0.1", "localhost")
    return WorkflowEnvironment.from_client(await real_temporal.connect(namespace=CAN_NAMESPACE, address=address))
