"""``gpufleet cluster check``: may our credentials do everything the adapter does, and
can the API server reach the kubelets of nodes behind a provider's NAT?

One SelfSubjectAccessReview per row of ``providers.cluster.kubernetes.ACCESS``
(the same table the RBAC manifests are tested against), so a missing verb is
found before a workflow trips over it; then the Konnectivity server and agents
(``check_tunnels``); and whether the control plane's service account may get each Secret
its fleet config names (``check_credentials_access``).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, Field

from fleet.cluster import LABEL_SITE
from providers.cluster.base import CLIENT_SIGNER, SERVING_SIGNER, AccessRule
from providers.cluster.kubernetes import access_table


class AccessRow(AccessRule):
    allowed: bool
    #: The authorizer's reason, or why the review itself failed.
    reason: str = ""

    @property
    def what(self) -> str:
        resource = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return f"{resource}.{self.group}" if self.group else resource


#: Grants limited to names (rbac.yaml's resourceNames): a review without a name would say no.
NAMED_GRANTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("certificates.k8s.io", "signers"): (CLIENT_SIGNER, SERVING_SIGNER),
}


def check_access(api_client: k8s.ApiClient, namespace: str = "gpufleet") -> list[AccessRow]:
    """Ask the API server, for each permission the adapter uses, whether we have it (for a
    grant limited to names, for each of those names)."""
    authorization = k8s.AuthorizationV1Api(api_client)
    rows = []
    for rule in access_table(namespace):
        allowed, reasons = True, []
        for name in NAMED_GRANTS.get((rule.group, rule.resource), ("",)):
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
                        "name": name,
                    }
                },
            }
            status = authorization.create_self_subject_access_review(review).status
            allowed = allowed and bool(status.allowed)
            reason = status.reason or status.evaluation_error or ""
            reasons.append(f"{name}: {reason}" if name and reason else reason)
        rows.append(AccessRow(**rule.model_dump(), allowed=allowed, reason="; ".join(r for r in reasons if r)))
    return rows


# -- the Secrets the fleet config names: may the control plane get them? ----------------------
class SecretAccessRow(BaseModel):
    """May the control plane's service account get one Secret its fleet config names?"""

    #: The Secret's name (in the control plane's namespace).
    secret: str
    #: The config fields that name it (``accounts.lambda-prod.credentials``).
    fields: list[str]
    allowed: bool
    #: The authorizer's reason.
    reason: str = ""


class CredentialsAccess(BaseModel):
    #: Whom the reviews asked about: ``system:serviceaccount:<namespace>:<account>``.
    user: str
    rows: list[SecretAccessRow] = Field(default_factory=list)
    #: Why nothing could be asked (these credentials may not create SubjectAccessReviews), or "".
    unasked: str = ""


def service_account_user(namespace: str, account: str) -> tuple[str, list[str]]:
    """The username and groups the API server gives the token of that service account."""
    return (f"system:serviceaccount:{namespace}:{account}",
            ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"])


def check_credentials_access(api_client: k8s.ApiClient, secrets: dict[str, list[str]], namespace: str,
                             account: str) -> CredentialsAccess:
    """For each Secret in ``namespace`` (its name → the config fields naming it), whether the
    control plane's service account ``account`` (``providers.credentials.CONTROL_PLANE_ACCOUNT``)
    may ``get`` it: the Role ``gpufleet cluster credentials-role`` renders grants exactly these, so one it may
    not get fails with ``BadCredentials`` at run time.

    Asked about the account with a SubjectAccessReview (an operator's credentials may create
    one), or, where these credentials are the account's own token, with a SelfSubjectAccessReview
    (they may not create the other). Neither possible: ``unasked`` says why. No Secret is read."""
    user, groups = service_account_user(namespace, account)
    authorization = k8s.AuthorizationV1Api(api_client)
    own = _whoami(api_client) == user

    def review(name: str):
        attributes = {"verb": "get", "group": "", "resource": "secrets", "namespace": namespace, "name": name}
        if own:
            return authorization.create_self_subject_access_review({
                "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attributes}})
        return authorization.create_subject_access_review({
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": user, "groups": groups, "resourceAttributes": attributes}})

    rows = []
    for name, fields in secrets.items():
        try:
            status = review(name).status
        except ApiException as error:
            if error.status != 403:
                raise
            return CredentialsAccess(user=user, unasked=f"these credentials may not create subjectaccessreviews "
                                                        f"({error.status} {error.reason})")
        rows.append(SecretAccessRow(secret=name, fields=fields, allowed=bool(status.allowed),
                                    reason=status.reason or status.evaluation_error or ""))
    return CredentialsAccess(user=user, rows=rows)


def _whoami(api_client: k8s.ApiClient) -> str:
    """The username these credentials carry (a SelfSubjectReview, which every authenticated user
    may create), or "" where the API server does not say."""
    try:
        review = k8s.AuthenticationV1Api(api_client).create_self_subject_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}, _preload_content=False)
    except ApiException:
        return ""
    return ((json.loads(review.data).get("status") or {}).get("userInfo") or {}).get("username") or ""


# -- API server → kubelet tunnels (Konnectivity) ----------------------------------------
#: Where the Konnectivity server and agents run (deploy/network/konnectivity/).
TUNNEL_NAMESPACE = "kube-system"
TUNNEL_SERVER = "konnectivity-server"
TUNNEL_AGENT = "konnectivity-agent"
#: What a server without ``--server-count`` tells its agents (apiserver-network-proxy's default).
DEFAULT_SERVER_COUNT = "1"


class TunnelReport(BaseModel):
    """Can the API server reach every gpufleet node's kubelet (logs, exec, port-forward)?
    Each node sits behind its provider's NAT, so only through a tunnel the node dialled out.
    The API server's EgressSelectorConfiguration cannot be read through the API: the
    README's checklist covers it."""

    #: Running, ready Konnectivity server pods (a static pod per control-plane node, or a DaemonSet).
    servers: list[str] = Field(default_factory=list)
    #: gpufleet node → the running, ready agent pod on it.
    agents: dict[str, str] = Field(default_factory=dict)
    #: gpufleet nodes (the ones with a site label) with no running agent.
    missing: list[str] = Field(default_factory=list)
    #: Running server → the ``--server-count`` its container args declare (the default when absent).
    #: The server hands it to every agent, which stops dialling the load balancer once it holds
    #: that many distinct servers.
    server_counts: dict[str, str] = Field(default_factory=dict)
    #: Why the cluster could not be read, when it could not.
    error: str = ""

    @property
    def miscounted(self) -> dict[str, str]:
        """The running servers whose ``--server-count`` is not the number of running servers."""
        running = len(self.servers)
        return {name: count for name, count in self.server_counts.items()
                if not (count.isdigit() and int(count) == running)}

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.servers) and not self.missing and not self.miscounted


def _is(pod: dict[str, Any], component: str) -> bool:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    # The upstream static pod carries no labels; its mirror pod is named "<name>-<node>".
    return component in (labels.get("k8s-app"), labels.get("component")) or meta.get("name", "").startswith(
        f"{component}-") or meta.get("name") == component


def _running(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return status.get("phase") == "Running" and ready and not (pod.get("metadata") or {}).get("deletionTimestamp")


def _server_count(pod: dict[str, Any]) -> str:
    """The ``--server-count`` a server pod's containers are started with (a static pod's mirror
    pod carries its spec), or the upstream default."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        flags = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
        for i, flag in enumerate(flags):
            if flag.startswith("--server-count="):
                return flag.split("=", 1)[1]
            if flag == "--server-count" and i + 1 < len(flags):
                return flags[i + 1]
    return DEFAULT_SERVER_COUNT


def check_tunnels(api_client: k8s.ApiClient) -> TunnelReport:
    """Which Konnectivity servers run, whether each tells agents to connect to as many servers as
    run, and which gpufleet nodes have a running agent. Two list calls the control plane's RBAC
    already grants (pods, nodes)."""
    core = k8s.CoreV1Api(api_client)
    try:
        pods = core.list_namespaced_pod(TUNNEL_NAMESPACE, _preload_content=False)
        nodes = core.list_node(label_selector=LABEL_SITE, _preload_content=False)
        pods, nodes = (json.loads(r.data).get("items") or [] for r in (pods, nodes))
    except ApiException as error:
        return TunnelReport(error=f"{error.status} {error.reason}")
    running = [p for p in pods if _running(p)]
    names = sorted(n["metadata"]["name"] for n in nodes)
    # No server runs on a GPU node: a pod named like one there is that node's own mirror pod (a
    # kubelet may publish any it likes), and must not pass for a server or change their count.
    servers = {p["metadata"]["name"]: _server_count(p) for p in running
               if _is(p, TUNNEL_SERVER) and p["spec"].get("nodeName") not in names}
    agents = {p["spec"].get("nodeName", ""): p["metadata"]["name"] for p in running if _is(p, TUNNEL_AGENT)}
    return TunnelReport(servers=sorted(servers), server_counts=dict(sorted(servers.items())),
                        agents={n: agents[n] for n in names if n in agents},
                        missing=[n for n in names if n not in agents])


# -- the control plane's blast radius (kubeadm's auto-approve bindings, the admission policy) --
#: kubeadm's bindings that widen what a kube-system Secret write or a node's certificate can do.
#: ``kubeadm init`` creates both and ``kubeadm upgrade apply`` creates them again, so the check
#: looks every time.
KUBEADM_AUTOAPPROVE_BOOTSTRAP = "kubeadm:node-autoapprove-bootstrap"
KUBEADM_AUTOAPPROVE_ROTATION = "kubeadm:node-autoapprove-certificate-rotation"
KUBEADM_BINDINGS: dict[str, str] = {
    KUBEADM_AUTOAPPROVE_BOOTSTRAP: (
        "auto-approves a client certificate for ANY node name (control-plane nodes too) to every "
        "token of kubeadm's group system:bootstrappers:kubeadm:default-node-token"),
    KUBEADM_AUTOAPPROVE_ROTATION: (
        "renews every node's client certificate (group system:nodes), so a removed node's "
        "credential never ends; gpufleet's CSR approver renews live nodes instead"),
}
#: deploy/kubernetes/admission-policy.yaml: the policy and its binding share this name.
ADMISSION_POLICY = "gpufleet-control-plane-secrets"
#: deploy/kubernetes/admission-policy.yaml: what a node's own credential may not write on its Node
#: (gpufleet's marks, its cordon); the policy and its binding share this name.
NODE_MARKS_POLICY = "gpufleet-node-marks"
#: deploy/kubernetes/admission-policy.yaml: where a node's own (mirror) pods may not go (gpufleet's and
#: Temporal's namespaces, the labels gpufleet's selectors pick); the policy and its binding share this name.
MIRROR_PODS_POLICY = "gpufleet-node-mirror-pods"
#: The shipped admission policies, each with what a cluster without it is open to.
ADMISSION_POLICIES: dict[str, str] = {
    ADMISSION_POLICY: "the control plane's token may write any kube-system Secret",
    NODE_MARKS_POLICY: ("a node's credential may fence, mark, cordon or uncordon its own Node, so the "
                        "control plane keeps it for good or uncordons it"),
    MIRROR_PODS_POLICY: ("a node's credential may create its own pods as gpufleet's: behind the node gateway's "
                         "or a model's Service (its connections, users' prompts), or in Temporal's namespace"),
}
RBAC_GROUP = "rbac.authorization.k8s.io"
ADMISSION_GROUP = "admissionregistration.k8s.io"

#: What ``check_hardening`` reads, each by name only (deploy/kubernetes/rbac.yaml, the
#: ClusterRole labelled gpufleet.io/rbac-for=cluster-check). Not in ``access_table``: a
#: SelfSubjectAccessReview without a name would say no to a grant limited to names, and a
#: refused read is reported by the check itself.
CHECK_ACCESS: tuple[AccessRule, ...] = (
    AccessRule(verb="get", group=RBAC_GROUP, resource="clusterrolebindings",
               purpose="cluster check: kubeadm's auto-approve bindings"),
    AccessRule(verb="get", group=ADMISSION_GROUP, resource="validatingadmissionpolicies",
               purpose="cluster check: gpufleet's admission policies"),
    AccessRule(verb="get", group=ADMISSION_GROUP, resource="validatingadmissionpolicybindings",
               purpose="cluster check: gpufleet's admission policies"),
)
#: The names each ``CHECK_ACCESS`` resource is read by.
CHECK_NAMES: dict[str, tuple[str, ...]] = {
    "clusterrolebindings": tuple(KUBEADM_BINDINGS),
    "validatingadmissionpolicies": tuple(ADMISSION_POLICIES),
    "validatingadmissionpolicybindings": tuple(ADMISSION_POLICIES),
}


class HardeningRow(BaseModel):
    #: What was looked at ("clusterrolebinding kubeadm:node-autoapprove-bootstrap").
    what: str
    ok: bool
    #: What is wrong and why it matters, or what was found.
    state: str
    #: How to put it right (a command), when it is not.
    fix: str = ""


def remove_kubeadm_bindings_command(names: list[str] | tuple[str, ...] = tuple(KUBEADM_BINDINGS)) -> str:
    return "kubectl delete clusterrolebinding " + " ".join(names)


def _read(what: str, fn: Callable[..., Any], name: str) -> tuple[dict[str, Any] | None, str]:
    """(the object, "") or (None, "") when absent, or (None, why it could not be read)."""
    try:
        response = fn(name, _preload_content=False)
    except ApiException as error:
        if error.status == 404:
            return None, ""
        return None, f"{what} cannot be read: {error.status} {error.reason}"
    return json.loads(response.data), ""


def check_hardening(api_client: k8s.ApiClient) -> list[HardeningRow]:
    """kubeadm's two auto-approve bindings must be gone (a row each, with the command that
    removes it) and each admission policy (the control plane's Secret writes, a node's own marks
    and pods) must be installed and bound with ``Deny``. A read refused counts as not ok: the check
    cannot vouch."""
    rbac = k8s.RbacAuthorizationV1Api(api_client)
    admission = k8s.AdmissionregistrationV1Api(api_client)
    rows = []
    for name, harm in KUBEADM_BINDINGS.items():
        what = f"clusterrolebinding {name}"
        found, error = _read(what, rbac.read_cluster_role_binding, name)
        if error:
            rows.append(HardeningRow(what=what, ok=False, state=error))
        elif found is None:
            rows.append(HardeningRow(what=what, ok=True, state="absent"))
        else:
            rows.append(HardeningRow(
                what=what, ok=False, fix=remove_kubeadm_bindings_command([name]),
                state=f"present: it {harm}; `kubeadm upgrade apply` creates it again, run the check after "
                      "every upgrade"))
    for name, harm in ADMISSION_POLICIES.items():
        rows += _admission_policy_rows(admission, name, harm)
    return rows


def _admission_policy_rows(admission: k8s.AdmissionregistrationV1Api, name: str, harm: str) -> list[HardeningRow]:
    """The policy ``name`` and its binding (same name): installed, and bound with ``Deny``."""
    apply = "kubectl apply -f deploy/kubernetes/admission-policy.yaml"
    what = f"validatingadmissionpolicy {name}"
    policy, error = _read(what, admission.read_validating_admission_policy, name)
    rows = [HardeningRow(what=what, ok=policy is not None, fix="" if policy is not None else apply,
                         state=error or ("installed" if policy is not None else f"missing: {harm}"))]
    what = f"validatingadmissionpolicybinding {name}"
    binding, error = _read(what, admission.read_validating_admission_policy_binding, name)
    spec = (binding or {}).get("spec") or {}
    denies = spec.get("policyName") == name and "Deny" in (spec.get("validationActions") or [])
    if error:
        rows.append(HardeningRow(what=what, ok=False, state=error))
    elif binding is None:
        rows.append(HardeningRow(what=what, ok=False, fix=apply, state="missing: the policy is not enforced"))
    else:
        rows.append(HardeningRow(what=what, ok=denies, fix="" if denies else apply,
                                 state="binds the policy with Deny" if denies else
                                 f"binds {spec.get('policyName')!r} with {spec.get('validationActions')}: "
                                 "the policy denies nothing"))
    return rows
