"""What the real authorizer grants each of gpufleet's identities equals what the product uses.

The shipped manifests are applied unchanged (``conftest.apply_shipped_manifests``); the API
server's own RBAC authorizer then answers a SelfSubjectRulesReview per identity and namespace
(what ``kubectl auth can-i --list --as=...`` shows). Less what every authenticated identity
gets anyway (a service account with no bindings), that must equal the access table of the
code running as that identity, each grant limited to the names the code reads by where it reads
by name: a grant nobody uses, a grant to every name where the code reads a few, or a call
nobody granted, fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from fleet.config import load_config
from fleet.models import CredentialsRef
from providers.cluster.base import AccessRule
from providers.cluster.check import CHECK_ACCESS, CHECK_NAMES, NAMED_GRANTS
from providers.cluster.kubernetes import BOOTSTRAP_NAMESPACE, TOKEN_NAMESPACE, access_table
from providers.credentials import ACCESS as CREDENTIALS_ACCESS
from providers.credentials import control_plane_secrets, credential_references, read_by_the_control_plane
from tests.cluster.test_manifests import SHIPPED_CONFIGS
from tests.realk8s.cluster import RealCluster
from tests.realk8s.conftest import SHIPPED_SITES
from workers.gateway.liveness import ACCESS as GATEWAY_ACCESS

REPO = Path(__file__).resolve().parents[2]
NAMESPACES = ["gpufleet", TOKEN_NAMESPACE, "kube-public", BOOTSTRAP_NAMESPACE, "default"]
#: verb, group, resource, subresource, and the names it is limited to (sorted; () = every name).
Grant = tuple[str, str, str, str, tuple[str, ...]]


def granted(cluster: RealCluster, user: str, namespace: str) -> set[Grant]:
    rules = cluster.rules(user, namespace)
    assert not rules["incomplete"], rules
    out: set[Grant] = set()
    for rule in rules["resourceRules"]:
        names = tuple(sorted(rule.get("resourceNames") or ()))
        for verb in rule["verbs"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    name, _, sub = resource.partition("/")
                    out.add((verb, group, name, sub, names))
    return out


def names_read(rule: AccessRule) -> tuple[str, ...]:
    """The names the code reads ``rule``'s objects by, where it reads them by name only: the
    kubelet signers, the check's bindings and policies, and the Secrets the installed fleet
    config (conftest's ``SHIPPED_SITES``) names."""
    if (rule.group, rule.resource) in NAMED_GRANTS:
        return tuple(sorted(NAMED_GRANTS[(rule.group, rule.resource)]))
    if rule in CHECK_ACCESS:
        return tuple(sorted(CHECK_NAMES[rule.resource]))
    if rule in CREDENTIALS_ACCESS:
        return tuple(control_plane_secrets(load_config(SHIPPED_SITES)))
    return ()


def matrix(cluster: RealCluster, user: str, nobody: str = "system:serviceaccount:gpufleet:nobody") -> dict[str, set[Grant]]:
    """Per namespace: what ``user`` may do beyond what an identity with no bindings may (``nobody``,
    of the same kind: a service account of the same namespace gets that namespace's group)."""
    baseline = {ns: granted(cluster, nobody, ns) for ns in NAMESPACES}
    return {ns: granted(cluster, user, ns) - baseline[ns] for ns in NAMESPACES}


def expected(rules) -> dict[str, set[Grant]]:
    """A cluster-wide rule is granted in every namespace's review, a namespaced one in its own."""
    return {ns: {(r.verb, r.group, r.resource, r.subresource, names_read(r)) for r in rules
                 if r.namespace in ("", ns)} for ns in NAMESPACES}


@pytest.mark.parametrize("account, rules", [
    ("gpufleet-control-plane", [*access_table("gpufleet"), *CREDENTIALS_ACCESS, *CHECK_ACCESS]),
    ("gpufleet-node-gateway", list(GATEWAY_ACCESS)),
    ("gpufleet-node-agent", []),
    # The model servers' (render_pod_template mounts no token, but a GPU node's kubelet may ask one
    # of it for a pod it runs): nothing.
    ("default", []),
])
def test_each_service_account_may_do_exactly_what_its_code_calls(real_cluster: RealCluster, account, rules) -> None:
    assert matrix(real_cluster, f"system:serviceaccount:gpufleet:{account}") == expected(rules)


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_the_control_plane_may_get_every_secret_a_shipped_config_names(real_cluster: RealCluster, path) -> None:
    """An operator who copies the example gets no BadCredentials on an account's first call: the
    real authorizer, over the shipped RBAC and the credentials Role rendered from the example,
    lets the control plane's service account (with the groups its token carries) get each
    Secret it names. In the shipped pod only a Secret resolves: it sets no credential variable
    and mounts no credential file (tests/cluster/test_manifests.py checks those against the
    Deployment)."""
    assert path == SHIPPED_SITES, "the config the tier installed its credentials Role for"
    account = "gpufleet-control-plane"
    groups = ("system:serviceaccounts", "system:serviceaccounts:gpufleet", "system:authenticated")
    # ``node_gateway.ca`` is read by ``gpufleet cluster node-config``, with the operator's own
    # credentials, and a store's ``pull_credentials`` by its site's nodes, never by the control
    # plane (read_by_the_control_plane).
    references = [(where, ref) for where, ref in credential_references(load_config(path))
                  if read_by_the_control_plane(where)]
    assert references
    refused = []
    for where, ref in references:
        namespace, name, _ = ref.secret_location()
        if not (ref.secret and real_cluster.may(f"system:serviceaccount:gpufleet:{account}", "get", "secrets",
                                                namespace, name, groups=groups)):
            refused.append(f"{where}: {ref.describe()}")
    assert refused == []
    # The question is the authorizer's: a Secret outside the credentials Role's namespace, or one
    # in it that the config does not name, is refused.
    assert not real_cluster.may(f"system:serviceaccount:gpufleet:{account}", "get", "secrets", "default",
                                "lambda-prod", groups=groups)
    assert not real_cluster.may(f"system:serviceaccount:gpufleet:{account}", "get", "secrets", "gpufleet",
                                "gpufleet-temporal-client", groups=groups)


def read_as_the_control_plane(kubeconfig: Path, references: list[str]) -> list[str]:
    """``providers.credentials.read_secret`` of each ``secret:`` reference as the control plane
    runs it: in a process of its own whose Kubernetes client finds the service account's
    kubeconfig. Each value, or "BadCredentials" where the reader got none."""
    code = ("import json, sys\n"
            "from fleet.errors import BadCredentials\n"
            "from fleet.models import CredentialsRef\n"
            "from providers.credentials import read_secret\n"
            "def read(ref):\n"
            "    try:\n"
            "        return read_secret(CredentialsRef(secret=ref))\n"
            "    except BadCredentials:\n"
            "        return 'BadCredentials'\n"
            "print(json.dumps([read(ref) for ref in sys.argv[1:]]))\n")
    done = subprocess.run([sys.executable, "-c", code, *references], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def refused(call) -> int:
    """The status the API server refused ``call`` with; 0 when it answered."""
    try:
        call()
    except ApiException as error:
        return error.status
    return 0


def test_the_control_plane_reads_the_secrets_its_config_names_and_no_other(real_cluster: RealCluster,
                                                                            tmp_path) -> None:
    """The audit's finding: the control plane's token could get every Secret in `gpufleet`, so
    whoever held it (a compromised worker, anything running as its service account) read every
    credential there, another app's too. As that service account, over the shipped RBAC and the
    credentials Role rendered from its config: another app's Secret in `gpufleet` cannot be read,
    nor any listed or watched there, and the product's reader gets nothing from it; while every
    Secret operation the product makes still goes through, for real: each credential the config
    names is read by the product's own reader, and the joins' Secrets are made, read, taken once,
    found by token id and deleted (kube-system and gpufleet-bootstrap)."""
    from kubernetes import client as k8s

    from providers.cluster.kubernetes import JOIN_TOKEN_KEY_SECRET, bootstrap_secret_name
    from tests.realk8s.test_backup import control_plane_kubeconfig
    from tests.realk8s.test_join import control_plane_cluster

    unique = uuid.uuid4().hex[:6]
    references = sorted({ref.secret for _, ref in credential_references(load_config(SHIPPED_SITES)) if ref.secret})
    # Each credential as an operator creates it, and another app's Secret beside them.
    values = {ref: f"{ref}-{unique}" for ref in references}
    other = f"other-app-{unique}"
    by_name: dict[str, dict[str, str]] = {other: {"password": f"not-gpufleets-{unique}"}}
    for ref, value in values.items():
        _, name, key = CredentialsRef(secret=ref).secret_location()
        by_name.setdefault(name, {})[key] = value
    for name, data in by_name.items():
        real_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": "gpufleet"},
             "type": "Opaque", "stringData": data}))

    token = real_cluster.service_account_token("gpufleet", "gpufleet-control-plane")
    core = k8s.CoreV1Api(real_cluster.api_client(token))
    try:
        assert refused(lambda: core.read_namespaced_secret(other, "gpufleet")) == 403
        assert refused(lambda: core.read_namespaced_secret("gpufleet-temporal-client", "gpufleet")) == 403
        assert refused(lambda: core.list_namespaced_secret("gpufleet")) == 403
        assert refused(lambda: core.list_namespaced_secret("gpufleet", watch=True, _preload_content=False)) == 403
        assert refused(lambda: core.list_secret_for_all_namespaces()) == 403
    finally:
        core.api_client.close()
    kubeconfig = control_plane_kubeconfig(real_cluster, tmp_path)
    read = read_as_the_control_plane(kubeconfig, [*references, f"gpufleet/{other}#password"])
    assert read == [*(values[ref] for ref in references), "BadCredentials"]

    # The joins' Secrets, through the adapter as the control plane runs it.
    kube = control_plane_cluster(real_cluster)
    node, machine = f"secrets-{unique}", f"m-secrets-{unique}"
    try:
        issued = kube.issue_bootstrap_token(node, f"join/site/{unique}", 600)  # the token key, a kube-system token
        assert kube.issue_bootstrap_token(node, f"join/site/{unique}", 600).secret == issued.secret
        first = kube.create_join_token(f"{node}-a", machine, 600)       # a token and the machine's channel
        second = kube.create_join_token(f"{node}-a", machine, 600)      # supersedes: the old channel read, both gone
        taken = kube.take_bootstrap_token(machine)                       # read once, deleted
        assert taken is not None and taken.startswith(f"{second.token_id}.")
        assert kube.take_bootstrap_token(machine) is None
        third = kube.create_join_token(f"{node}-b", f"{machine}-b", 600)
        kube.revoke_join_token(third.token_id)                           # its channel found by token id
        assert kube.revoke_node_tokens(node) == [issued.token_id]
        assert sorted(kube.revoke_node_tokens(f"{node}-a")) == sorted([first.token_id, second.token_id])
    finally:
        kube.api_client.close()
    gone = [(TOKEN_NAMESPACE, f"bootstrap-token-{t.token_id}") for t in (issued, first, second, third)]
    gone += [(BOOTSTRAP_NAMESPACE, bootstrap_secret_name(m)) for m in (machine, f"{machine}-b")]
    for namespace, name in gone:
        status, _ = real_cluster.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}", admin=True)
        assert status == 404, f"{namespace}/{name} is left"
    status, _ = real_cluster.request(
        "GET", f"/api/v1/namespaces/{BOOTSTRAP_NAMESPACE}/secrets/{JOIN_TOKEN_KEY_SECRET}", admin=True)
    assert status == 200, "the join token key stays, for the next join"


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
