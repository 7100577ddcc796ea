"""The test tiers (docs/testing.md, "Test tiers"), and the guard that keeps the fast one honest.

``unit`` (``python3 bootstrap.py test --fast``, under a minute): pure policy, replay against
recorded histories, in-process fakes on loopback, and Temporal's time-skipping test server
(``time_skipping_env``) for timer logic. The full suite (``python3 bootstrap.py test``) runs
every test: also those with a real Temporal dev server, the real Kubernetes tier, system
programs, benches' smoke runs and processes of their own.

A test is ``unit`` unless it

- uses a fixture that starts a server or a process (``SERVER_FIXTURES``),
- is marked ``integration``, ``needs_tools``, ``realk8s`` or ``realtemporal`` (itself or its module), or
- is listed in ``INTEGRATION`` (tests in files other work owns that start processes in their
  own body; a new such test marks itself ``@pytest.mark.integration`` instead).

The derivation alone would let a test that quietly starts a process slip into the fast tier
(that is how it came to take minutes). So while a ``unit`` test runs (its setup, call and
teardown), starting a subprocess, forking, starting a Temporal dev server or binding a socket
to anything but loopback fails it, saying what it started and how to mark it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest

#: Fixtures that start a server or processes of their own: a test that uses one is not a unit test.
SERVER_FIXTURES = {
    "temporal_env",  # a Temporal dev server (tests/conftest.py)
    "real_cluster",  # the real Kubernetes control plane (tests/realk8s/conftest.py)
    "moto_s3",  # two moto S3 servers, each a process (tests/rollout/conftest.py)
    "own_dc_harness",  # sushy-tools' Redfish emulator, a process (tests/providers/conftest.py)
    "can_env",  # a dev server with a low continue-as-new threshold (test_entities, test_continue_as_new)
    "http_stack",  # a dev server and the HTTP API (test_readme_http)
    "dev_stack",  # `gpufleet dev` as a process (test_readme_walk)
    "door",  # HAProxy, the front door (test_front_door)
}

#: Tests (a module, or ``module::test`` without parameters) that start processes in their own
#: body, by what they start. Kept here rather than as marks in files other work is editing.
INTEGRATION: dict[str, str] = {
    "tests/test_control_plane_loss.py": "a dev server on SQLite, the workers and the gateway, each a process",
    "tests/test_soak.py": "the chaos soak: dev servers, workers, the gateway, moto servers",
    "tests/test_bench_actions.py::test_smoke_run_prints_every_figure": "bench.actions --smoke, with its dev server",
    "tests/test_dev_stack.py": "`gpufleet dev` as a process",
    "tests/test_dev_server_metrics.py": "a dev server with metrics",
    "tests/test_search_attributes.py": "a dev server of its own",
    "tests/test_site_reclaim.py::test_entities_continue_as_new": "a dev server with a low continue-as-new threshold",
    "tests/test_front_door.py": "HAProxy",
    "tests/test_observability.py::test_alert_rules_pass_promtool": "promtool",
    "tests/test_observability.py::test_dev_stack_workers_serve_their_metrics": "`gpufleet dev` as a process",
    "tests/test_layers.py::test_import_contracts_are_kept": "lint-imports",
    "tests/test_config.py::test_console_script_exit_code": "the installed command (python -m cli)",
    "tests/test_cli_output.py::test_lists_are_plain_lines_when_piped_and_json_on_request": "python -m cli, piped",
    "tests/test_worker_cache.py::test_a_bad_cache_size_is_named": "a Python process that reads the variable",
    "tests/test_bootstrap.py::test_cloud_init_accepts_the_document": "cloud-init schema",
    "tests/test_bootstrap.py::test_cloud_init_schema_can_fail": "cloud-init schema",
    "tests/providers/test_join_real.py::test_a_machine_joins_from_nothing_but_its_user_data": "cloud-init schema",
    "tests/cluster/test_network.py::test_every_kustomization_renders": "kubectl kustomize",
    "tests/cluster/test_network.py::test_konnectivity_agents_dial_out_on_443_on_the_node_agents_nodes":
        "kubectl kustomize",
    "tests/cluster/test_network.py::test_node_agent_dials_the_gateway_from_its_configmap": "kubectl kustomize",
    "tests/cluster/test_network.py::test_nothing_listens_on_a_gpu_node": "kubectl kustomize",
    "tests/cluster/test_network.py::test_nothing_on_a_node_dials_a_cluster_internal_name": "kubectl kustomize",
    "tests/test_deploy.py::test_control_plane_and_gateway_run_only_on_control_plane_hosts": "kubectl kustomize",
    "tests/test_deploy.py::test_gpu_workloads_tolerate_every_taint_an_admitted_gpu_node_keeps": "kubectl kustomize",
    "tests/test_deploy.py::test_kustomize_renders_and_control_plane_runs_non_root_read_only": "kubectl kustomize",
    "tests/test_deploy.py::test_metrics_are_served_and_scraped": "kubectl kustomize",
    "tests/test_deploy.py::test_node_agent_is_the_one_exception_with_the_least_it_needs": "kubectl kustomize",
    "tests/test_temporal_manifests.py::test_every_temporal_client_of_the_control_plane_uses_mutual_tls_from_its_secret":
        "kubectl kustomize",
}

#: Markers that keep a test out of the unit tier.
NOT_UNIT_MARKERS = ("integration", "needs_tools", "realk8s", "realtemporal")


def listed_integration(nodeid: str) -> str | None:
    """Why ``INTEGRATION`` keeps this test out of the unit tier, if it does."""
    module, _, rest = nodeid.partition("::")
    test = rest.split("[", 1)[0]
    return INTEGRATION.get(f"{module}::{test}") or INTEGRATION.get(module)


def harness_fixtures(item: pytest.Item) -> set[str]:
    """The provider tests pick their harness by parameter (``own_dc`` → ``own_dc_harness``, through
    ``request.getfixturevalue``), which hides that fixture from the test's fixture closure."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return {f"{value}_harness" for value in params.values() if isinstance(value, str)}


def is_unit(item: pytest.Item) -> bool:
    fixtures = set(getattr(item, "fixturenames", ())) | harness_fixtures(item)
    return (not fixtures & SERVER_FIXTURES
            and not any(any(item.iter_markers(name)) for name in NOT_UNIT_MARKERS)
            and listed_integration(item.nodeid) is None)


# No ordering: sub-conftests (registered later, so called first) have added their own marks
# (realk8s), and pytest's ``-m`` selection (registered first, so called last) comes after.
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if is_unit(item):
            item.add_marker(pytest.mark.unit)


# -- the guard ---------------------------------------------------------------------------------
class UnitTierViolation(Exception):
    """A unit test did what only the full suite's tests may."""


HOW_TO_MARK = ("a unit test runs in-process (loopback fakes and the time-skipping test server at most); mark "
               "this one @pytest.mark.integration, or list it in tests/plugins/tiers.py INTEGRATION")


def loopback(host: Any) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(str(host).split("%", 1)[0]).is_loopback
    except ValueError:
        return False  # '' (every address) or a name that may resolve anywhere


@contextmanager
def unit_guard() -> Iterator[list[str]]:
    """Refuse (raise, and record, so that a test swallowing the error still fails) what a unit
    test may not do. Yields the record."""
    import temporalio.bridge.testing as bridge_testing

    seen: list[str] = []

    def refuse(what: str) -> None:
        seen.append(what)
        raise UnitTierViolation(f"{what}: {HOW_TO_MARK}")

    def popen(self, args, *_a, **_k):
        refuse(f"started a subprocess {args!r}")

    def spawn(name: str) -> Callable[..., Any]:
        def refused(*args, **_kwargs):
            refuse(f"called os.{name}{args[:2]!r}")
        return refused

    real_bind = socket.socket.bind

    def bind(sock: socket.socket, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not loopback(address[0]):
            refuse(f"bound a socket to {address!r}, not loopback")
        return real_bind(sock, address)

    async def dev_server(*_args, **_kwargs):
        refuse("started a Temporal dev server")

    patches: list[tuple[Any, str, Any]] = [
        (subprocess.Popen, "__init__", popen),
        (socket.socket, "bind", bind),
        (bridge_testing.EphemeralServer, "start_dev_server", staticmethod(dev_server)),
        *[(os, name, spawn(name)) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")
          if hasattr(os, name)],
    ]
    #: (owner, name, what it held; None: a class that only inherited it, so the name goes again)
    saved = [(owner, name, vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name))
             for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield seen
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def guarded(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("unit") is None:
        return (yield)
    with unit_guard() as seen:
        result = yield
    if seen:
        pytest.fail(f"{item.nodeid} is in the unit tier but {seen[0]}: {HOW_TO_MARK}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    return (yield from guarded(item))
