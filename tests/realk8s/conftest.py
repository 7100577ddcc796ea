"""The real Kubernetes tier: one real control plane for this package's tests (``cluster.RealCluster``),
gpufleet's shipped manifests applied to it unchanged, and machines booted from rendered user data.

Skipped, with one line saying what is missing, where the binaries are not built (no Go) or
machines cannot start (not root).  In CI (``CI=true``) a missing piece fails instead: there the
tier must run.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.providers.conftest import (  # noqa: F401 - the provider harness fixtures
    aws_harness,
    hetzner_harness,
    lambda_harness,
    nebius_harness,
    own_dc_harness,
)
from tests.realk8s import build, machine
from tests.realk8s.cluster import RealCluster
from tests.realk8s.contract import POD_NAMESPACES, RealHarness, ensure_namespace, install_routing_crds

REPO = Path(__file__).resolve().parents[2]


def _missing() -> str | None:
    return build.missing_reason() or machine.missing_reason()


def pytest_collection_modifyitems(config, items):
    reason = _missing()
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.realk8s)
            if reason and os.environ.get("CI") != "true":
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="package")
def real_cluster(tmp_path_factory) -> RealCluster:
    """One control plane for the tier's tests, stopped when they are done (its API server and
    controllers cost CPU the rest of the suite needs)."""
    reason = _missing()
    if reason:
        pytest.fail(f"CI must run the real Kubernetes tier: {reason}")
    with shipped_cluster(tmp_path_factory.mktemp("realk8s")) as cluster:
        yield cluster


@contextmanager
def shipped_cluster(root: Path) -> Iterator[RealCluster]:
    """A control plane in ``root`` with gpufleet's manifests applied; stopped afterwards."""
    cluster = RealCluster(root).start()
    try:
        apply_shipped_manifests(cluster)
        yield cluster
    finally:
        cluster.stop()


#: The fleet config the tier's control plane is installed for: the shipped example.
SHIPPED_SITES = REPO / "deploy" / "sites.example.yaml"


def apply_shipped_manifests(cluster: RealCluster) -> None:
    """What an operator applies, unchanged: the kustomize base, the credentials Role that
    ``gpufleet cluster credentials-role`` renders from the fleet config (the shipped example's),
    the bootstrap RBAC, and the frontend's NetworkPolicy into the namespace Temporal's chart
    would be installed in."""
    from typer.testing import CliRunner

    from cli.cluster import cluster_app

    cluster.kubectl("apply", "--server-side", "-k", str(REPO / "deploy" / "kubernetes"))
    rendered = CliRunner().invoke(cluster_app, ["credentials-role", "--config", str(SHIPPED_SITES)])
    assert rendered.exit_code == 0, rendered.output
    cluster.kubectl("apply", "--server-side", "-f", "-", input=rendered.stdout)
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "deploy" / "bootstrap" / "rbac.yaml"))
    cluster.kubectl("create", "namespace", TEMPORAL_NAMESPACE)
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "deploy" / "temporal" / "network-policy.yaml"))


#: Where deploy/kubernetes's TEMPORAL_ADDRESS (temporal-frontend.temporal.svc) says Temporal runs.
TEMPORAL_NAMESPACE = "temporal"


@pytest.fixture(scope="package")
def contract_token(real_cluster: RealCluster) -> str:
    """For ``harness``: the control plane's service account token (what its Deployment's projected
    volume holds), the namespaces the contract's pods go to, and the routing objects' CRDs."""
    for namespace in POD_NAMESPACES:
        ensure_namespace(real_cluster, namespace)
    install_routing_crds(real_cluster)
    return real_cluster.service_account_token("gpufleet", "gpufleet-control-plane")


@pytest.fixture(params=["kubernetes"])
def harness(real_cluster: RealCluster, contract_token: str):
    """The cluster port's contract harness over the real control plane (tests/realk8s/contract.py)."""
    made = RealHarness(real_cluster, contract_token)
    yield made
    made.close()
