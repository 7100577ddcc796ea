"""What the real authorizer grants each of gpufleet's identities equals what the product uses.

The shipped manifests are applied unchanged (``conftest.apply_shipped_manifests``); the API
server's own RBAC authorizer then answers a SelfSubjectRulesReview per identity and namespace
(what ``kubectl auth can-i --list --as=...`` shows). Less what every authenticated identity
gets anyway (a service account with no bindings), that must equal the access table of the
code running as that identity: a grant nobody uses, or a call nobody granted, fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.config import load_config
from providers.cluster.base import AccessRule
from providers.cluster.check import CHECK_ACCESS
from providers.cluster.kubernetes import BOOTSTRAP_NAMESPACE, TOKEN_NAMESPACE, access_table
from providers.credentials import ACCESS as CREDENTIALS_ACCESS
from tests.cluster.test_manifests import SHIPPED_CONFIGS, credential_references
from tests.realk8s.cluster import RealCluster
from workers.gateway.liveness import ACCESS as GATEWAY_ACCESS

REPO = Path(__file__).resolve().parents[2]
NAMESPACES = ["gpufleet", TOKEN_NAMESPACE, "kube-public", BOOTSTRAP_NAMESPACE, "default"]
Grant = tuple[str, str, str, str]  # verb, group, resource, subresource


def granted(cluster: RealCluster, user: str, namespace: str) -> set[Grant]:
    rules = cluster.rules(user, namespace)
    assert not rules["incomplete"], rules
    out: set[Grant] = set()
    for rule in rules["resourceRules"]:
        for verb in rule["verbs"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    name, _, sub = resource.partition("/")
                    out.add((verb, group, name, sub))
    return out


def matrix(cluster: RealCluster, user: str, nobody: str = "system:serviceaccount:gpufleet:nobody") -> dict[str, set[Grant]]:
    """Per namespace: what ``user`` may do beyond what an identity with no bindings may (``nobody``,
    of the same kind: a service account of the same namespace gets that namespace's group)."""
    baseline = {ns: granted(cluster, nobody, ns) for ns in NAMESPACES}
    return {ns: granted(cluster, user, ns) - baseline[ns] for ns in NAMESPACES}


def expected(rules) -> dict[str, set[Grant]]:
    """A cluster-wide rule is granted in every namespace's review, a namespaced one in its own."""
    return {ns: {(r.verb, r.group, r.resource, r.subresource) for r in rules if r.namespace in ("", ns)}
            for ns in NAMESPACES}


@pytest.mark.parametrize("account, rules", [
    ("gpufleet-control-plane", [*access_table("gpufleet"), *CREDENTIALS_ACCESS, *CHECK_ACCESS]),
    ("gpufleet-node-gateway", list(GATEWAY_ACCESS)),
    ("gpufleet-node-agent", []),
])
def test_each_service_account_may_do_exactly_what_its_code_calls(real_cluster: RealCluster, account, rules) -> None:
    assert matrix(real_cluster, f"system:serviceaccount:gpufleet:{account}") == expected(rules)


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_the_control_plane_may_get_every_secret_a_shipped_config_names(real_cluster: RealCluster, path) -> None:
    """An operator who copies the example gets no BadCredentials on an account's first call: the
    real authorizer, over the shipped RBAC, lets the control plane's service account (with the
    groups its token carries) get each Secret it names. In the shipped pod only a Secret
    resolves: it sets no credential variable and mounts no credential file
    (tests/cluster/test_manifests.py checks those against the Deployment)."""
    account = "gpufleet-control-plane"
    groups = ("system:serviceaccounts", "system:serviceaccounts:gpufleet", "system:authenticated")
    references = credential_references(load_config(path))
    assert references
    refused = []
    for where, ref in references:
        namespace, name, _ = ref.secret_location()
        if not (ref.secret and real_cluster.may(f"system:serviceaccount:gpufleet:{account}", "get", "secrets",
                                                namespace, name, groups=groups)):
            refused.append(f"{where}: {ref.describe()}")
    assert refused == []
    # The question is the authorizer's: a Secret outside the credentials Role's namespace is refused.
    assert not real_cluster.may(f"system:serviceaccount:gpufleet:{account}", "get", "secrets", "default",
                                "lambda-prod", groups=groups)


#: deploy/network's Konnectivity identities. The agent calls nothing on the API server (its projected
#: token's audience is the Konnectivity server's); the server, as its kubeconfig user, checks the
#: agents' tokens with TokenReviews, and system:auth-delegator also grants SubjectAccessReviews.
KONNECTIVITY_SERVER_ACCESS = [AccessRule(verb="create", group="authentication.k8s.io", resource="tokenreviews",
                                         purpose="the Konnectivity server checks an agent's token"),
                              AccessRule(verb="create", group="authorization.k8s.io", resource="subjectaccessreviews",
                                         purpose="system:auth-delegator's other grant (the server makes none)")]


@pytest.fixture
def network_rbac(real_cluster: RealCluster) -> RealCluster:
    """deploy/network's Konnectivity ServiceAccount and binding, as ``kubectl apply -k`` applies them
    (the package's conftest applies deploy/kubernetes only); left in place, like it."""
    real_cluster.kubectl("apply", "--server-side", "-f",
                         str(REPO / "deploy" / "network" / "konnectivity" / "rbac.yaml"))
    return real_cluster


@pytest.mark.parametrize("user, nobody, rules", [
    ("system:serviceaccount:kube-system:konnectivity-agent", "system:serviceaccount:kube-system:nobody", []),
    ("system:konnectivity-server", "nobody", KONNECTIVITY_SERVER_ACCESS),
])
def test_the_konnectivity_identities_may_do_exactly_what_they_call(network_rbac: RealCluster, user, nobody,
                                                                    rules) -> None:
    assert matrix(network_rbac, user, nobody) == expected(rules)


def test_gpufleets_manifests_grant_nodes_and_join_tokens_nothing_of_their_own(real_cluster: RealCluster) -> None:
    """A node's powers are Kubernetes' own (the Node authorizer, NodeRestriction) and kubeadm's
    bindings; a join token's are kubeadm's join RBAC. No binding gpufleet ships names either,
    except the join RBAC for gpufleet's own token group (deploy/bootstrap/rbac.yaml)."""
    done = real_cluster.kubectl("get", "clusterrolebindings,rolebindings", "-A", "-o", "json")
    import json

    from providers.cluster.bootstrap import BOOTSTRAP_GROUP

    for binding in json.loads(done.stdout)["items"]:
        name = binding["metadata"]["name"]
        if not name.startswith("gpufleet"):
            continue
        for subject in binding.get("subjects") or []:
            who = subject["name"]
            assert not who.startswith("system:node"), (name, who)
            if who.startswith("system:bootstrappers"):
                assert who == BOOTSTRAP_GROUP, (name, who)
                assert binding["roleRef"]["name"] in {
                    "system:node-bootstrapper", "kubeadm:get-nodes", "kubeadm:nodes-kubeadm-config",
                    "kubeadm:kubelet-config"}, (name, binding["roleRef"])
