"""What only the Kubernetes adapter has, where no API server is needed, or a fault a real one is
not made to show (a hung server, on the fake API server). Everything else runs against the real
control plane: join-token Secrets, node patches and their write counts, resourceVersion
preconditions, drains through the Eviction API, serving objects and a real 403
(``tests/realk8s/test_adapter_objects.py``); a drain waiting for a graceful termination, a
Deployment's rollout status and the routing objects (``tests/realk8s/test_adapter_routing.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fleet.errors import Transient
from providers.cluster.kubernetes import KubernetesCluster, _machine_from_provider_id
from tests.ports import free_port


# -- nodes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("provider_id, machine", [
    ("aws:///us-east-1a/i-0abc123", "i-0abc123"),
    ("hcloud://4711", "4711"),
    ("gce://proj/europe-west4-a/gpu-node-1", "gpu-node-1"),
    ("", ""),
])
def test_machine_id_from_provider_id(provider_id, machine):
    assert _machine_from_provider_id(provider_id) == machine


# -- errors -----------------------------------------------------------------------------------
def test_unreachable_api_is_transient():
    """A loopback port nothing listens on: the connection is refused (no server needed)."""
    from kubernetes import client as k8s

    configuration = k8s.Configuration()
    configuration.host = f"http://127.0.0.1:{free_port()}"
    configuration.retries = 0
    cluster = KubernetesCluster(api_client=k8s.ApiClient(configuration))
    with pytest.raises(Transient):
        cluster.get_node("gpu-1")


def test_a_hung_api_server_times_out_as_transient(fake):
    # Fake: a server that accepts and then answers nothing for a second is a fault a real API
    # server is not made to show.
    cluster = KubernetesCluster(api_client=fake.api_client(), request_timeout_s=0.2)
    fake.response_delay_s = 1.0
    with pytest.raises(Transient) as caught:
        cluster.get_node("gpu-1")
    # Given up at the request timeout: waited out, the late answer (no such node) would be None.
    assert "ReadTimeoutError" in str(caught.value), caught.value



# -- drains -----------------------------------------------------------------------------------
#: What kube-apiserver answers an eviction in a namespace being deleted (its NamespaceLifecycle
#: admission): a 403 whose cause is NamespaceTerminating. A real one needs a namespace held in
#: Terminating by a finalizer while a pod still runs on a node; the answer's shape is all that matters.
TERMINATING = ('{"kind":"Status","apiVersion":"v1","status":"Failure","message":"pods \\"web-0\\" is forbidden: '
               'unable to create new content in namespace team-a because it is being terminated",'
               '"reason":"Forbidden","details":{"name":"web-0","kind":"pods","causes":[{"reason":'
               '"NamespaceTerminating","message":"namespace team-a is being terminated",'
               '"field":"metadata.namespace"}]},"code":403}')


def _refusing(status: int, body: str) -> KubernetesCluster:
    from kubernetes.client.exceptions import ApiException

    cluster = KubernetesCluster.__new__(KubernetesCluster)

    def refuse(*_args, **_kwargs):
        error = ApiException(status=status, reason="Forbidden")
        error.body = body
        raise error

    cluster._call = refuse  # type: ignore[method-assign]
    # Only named: ``_call`` (the one way the adapter calls the API) answers for it.
    cluster.core = SimpleNamespace(create_namespaced_pod_eviction=None)  # type: ignore[assignment]
    return cluster


def test_an_eviction_in_a_terminating_namespace_counts_as_evicted():
    """As ``kubectl drain``: the namespace's deletion removes the pod; a drain does not fail on it."""
    assert _refusing(403, TERMINATING)._evict("team-a", "web-0") == ("evicted", "")


def test_any_other_forbidden_eviction_is_still_refused():
    from fleet.errors import ClusterForbidden

    with pytest.raises(ClusterForbidden):
        _refusing(403, '{"kind":"Status","reason":"Forbidden","code":403}')._evict("team-a", "web-0")
