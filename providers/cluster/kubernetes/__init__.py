"""The cluster port over the official ``kubernetes`` client.

Split by job, one mixin each over ``api.KubernetesApi`` (the API client, the namespaces, the
plumbing of one call and the error taxonomy), assembled here as ``KubernetesCluster``:

- ``state``: control-plane state, one ConfigMap per record (join tokens, node identities and
  keys, the workflows' own); the jobs that keep records build on it.
- ``tokens``: join tokens, the bootstrap channel, the join's API endpoint and CA.
- ``csrs``: gpufleet's CSR approver (kubelet certificates, the client keys bound to a node).
- ``nodes``: reading nodes with their recorded identity, labels, taints, cordon, drain, removal.
- ``gpu_pods``: the GPU pods the demand loop reads.
- ``watch``: list-then-watch, what ``watch_nodes``, ``watch_gpu_pods`` and ``watch_open_csrs``
  follow their objects with.
- ``manifests``: the serving objects rendered from a ``ServingSpec``.
- ``serving``: applies them per model and site; scales, rolls back, deletes and lists them.
- ``routing``: each model's HTTPRoute and traffic policy, and the routing table ConfigMap.
- ``access``: ``ACCESS``, every API permission the adapter uses (the RBAC manifests grant it).

Each module's doc says which objects it owns and how it writes them.
"""

from __future__ import annotations

from fleet.cluster import NODE_IDENTITY_KIND  # fleet.cluster's; the adapter's importers read it here too
from providers.cluster.kubernetes.access import ACCESS, CSR_GROUP, SERVING_NS, access_table
from providers.cluster.kubernetes.api import (
    _RETRY_CONFLICTS,
    BOOTSTRAP_NAMESPACE,
    ERROR_STATUSES,
    MERGE,
    PROVIDER,
    STRATEGIC,
    KubernetesApi,
    load_api_client,
)
from providers.cluster.kubernetes.csrs import CsrApprover
from providers.cluster.kubernetes.gpu_pods import MIRROR_ANNOTATION, GpuPods, gpu_pod
from providers.cluster.kubernetes.manifests import (
    READINESS_PROBE,
    render_deployment,
    render_model_service,
    render_pdb,
    render_pod_template,
    render_service,
)
from providers.cluster.kubernetes.nodes import Nodes, _machine_from_provider_id
from providers.cluster.kubernetes.routing import ROUTING_CONFIGMAP, Routing
from providers.cluster.kubernetes.serving import Serving
from providers.cluster.kubernetes.state import ANNOTATION_STATE_KEY, LABEL_STATE
from providers.cluster.kubernetes.tokens import (
    ANNOTATION_JOIN,
    ANNOTATION_NODE_NAME,
    JOIN_GROUP,
    JOIN_TOKEN_KEY_SECRET,
    JOIN_TOKEN_KIND,
    LABEL_JOIN_KEY,
    LABEL_TOKEN_ID,
    TOKEN_NAMESPACE,
    JoinTokens,
    bootstrap_secret_name,
)


class KubernetesCluster(JoinTokens, CsrApprover, Nodes, GpuPods, Serving, Routing):
    """The cluster port (``providers.cluster.base.Cluster``) on a Kubernetes API server: every
    job shares the one API client, namespace and timeout that ``KubernetesApi`` takes."""
