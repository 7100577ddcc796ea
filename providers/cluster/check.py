"""``gpufleet cluster check``: may our credentials do everything the adapter does?

One SelfSubjectAccessReview per row of ``providers.cluster.kubernetes.ACCESS``
(the same table the RBAC manifests are tested against), so a missing verb is
found before a workflow trips over it.
"""

from __future__ import annotations

from kubernetes import client as k8s

from providers.cluster.base import AccessRule
from providers.cluster.kubernetes import access_table


class AccessRow(AccessRule):
    allowed: bool
    #: The authorizer's reason, or why the review itself failed.
    reason: str = ""

    @property
    def what(self) -> str:
        resource = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return f"{resource}.{self.group}" if self.group else resource


def check_access(api_client: k8s.ApiClient, namespace: str = "gpufleet") -> list[AccessRow]:
    """Ask the API server, for each permission the adapter uses, whether we have it."""
    authorization = k8s.AuthorizationV1Api(api_client)
    rows = []
    for rule in access_table(namespace):
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {
                "resourceAttributes": {
                    "verb": rule.verb,
                    "group": rule.group,
                    "resource": rule.resource,
                    "subresource": rule.subresource,
                    "namespace": rule.namespace,
                }
            },
        }
        status = authorization.create_self_subject_access_review(review).status
        reason = status.reason or status.evaluation_error or ""
        rows.append(AccessRow(**rule.model_dump(), allowed=bool(status.allowed), reason=reason))
    return rows
