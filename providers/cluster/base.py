"""The cluster port: what the control plane needs from Kubernetes.

Two implementations: the simulated cluster (``sim.cluster``) and the
official-client adapter (``providers.cluster.kubernetes``). Both pass the same
contract tests. Methods are synchronous and run in activity threads.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
import warnings
from typing import TYPE_CHECKING, Callable, Iterable, Literal, NamedTuple, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, Field

from fleet.errors import ClusterConflict, InvalidRequest, NotFound
from fleet.demand import GpuPod, gpus_counted
from fleet.models import Node
from fleet.naming import dns_label, serving_name
from fleet.routing import shortened
from fleet.cluster import (
    NodeIdentity,
    LABEL_MODEL,
    LABEL_SITE,
    GPU_RESOURCE,
    FLEET_TAINT_KEY,
    JoinTokenRef,
    DrainPod,
    DrainResult,
    SKIPPED_LISTED,
    ServingSpec,
    ServingStatus,
    SiteRoute,
    RoutingTable,
)

if TYPE_CHECKING:
    from cryptography import x509

    from providers.cluster.bootstrap import BootstrapToken


class NodeNotFound(NotFound, LookupError):
    """The node does not exist (a ``LookupError`` too, for plain callers)."""


class NodeChanged(ClusterConflict):
    """A write made on a node as read (``cordon(..., version=...)``) found it changed since: nothing
    was written. Read it again and decide again (``decide_on_node``). Workflows see a
    ``ClusterConflict``: a later attempt may win."""

    @property
    def type_name(self) -> str:
        return ClusterConflict.__name__


class NodeMarks(BaseModel):
    """A node's annotations and cordon as read at one version of it (Kubernetes: its
    resourceVersion), which a ``cordon(..., version=...)`` writes on only if it is still that."""

    annotations: dict[str, str]
    unschedulable: bool
    version: str


class ServingNotFound(NotFound, LookupError):
    """No serving Deployment for this model at this site."""


class NoPreviousTemplate(InvalidRequest, ValueError):
    """``rollback_serving`` with nothing to roll back to."""


class CsrDecision(BaseModel):
    """What gpufleet's approver decided about one kubelet CSR, and why."""

    name: str
    requester: str
    approve: bool
    reason: str


class OpenCsr(NamedTuple):
    """An open CSR as ``watch_open_csrs`` sees it; tuples of these sort oldest first."""

    #: ``metadata.creationTimestamp``: the API server's, whole seconds (RFC 3339, UTC).
    created: str
    name: str


CLIENT_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
SERVING_SIGNER = "kubernetes.io/kubelet-serving"
#: kubeadm labels its control-plane nodes so (as the admin, after the kubelet registered);
#: NodeRestriction keeps a kubelet from setting any ``node-role.kubernetes.io/`` label on itself,
#: so a removed node that registers again cannot claim it.
CONTROL_PLANE_LABEL = "node-role.kubernetes.io/control-plane"
_USAGES = {
    CLIENT_SIGNER: {"digital signature", "key encipherment", "client auth"},
    SERVING_SIGNER: {"digital signature", "key encipherment", "server auth"},
}
#: The signers whose CSRs gpufleet judges (``csr_decision``): one under any other wakes no pass.
JUDGED_SIGNERS = frozenset(_USAGES)


#: The most of the parser's message a denial of an unreadable request repeats: the reason lands
#: on the CSR and in the pass's result, and the message describes bytes a node wrote.
_PARSE_ERROR_CHARS = 120

# A CSR's subject is the node's to write, and cryptography warns of each name longer than RFC 5280
# allows when it reads one, the length in its message. Python prints a warning once per distinct
# message and keeps each in a registry for good: a node posting CSRs with names of ever other
# lengths would add log lines and memory to the control plane's worker, CSR by CSR. The denial
# names them already (cut short).
warnings.filterwarnings("ignore", message=r"Attribute's length must be >= 1 and <= 64", category=UserWarning)


class UnparseableRequest(ValueError):
    """A CSR's request that cryptography cannot read whole (``read_csr``)."""


def read_csr(request: object) -> "x509.CertificateSigningRequest":
    """A CSR's ``spec.request`` (base64 PEM), read whole: its subject, its key and every extension.

    cryptography reads a request's extensions only when first asked for them, and raises there
    (a ValueError, a DuplicateExtension) on what the API server accepted: Go's
    ``x509.ParseCertificateRequest`` reads only the SAN extension. So whatever a node wrote is
    read here, once, and anything unreadable raises UnparseableRequest, never later."""
    from cryptography import x509

    try:
        parsed = x509.load_pem_x509_csr(base64.b64decode(request))
        parsed.subject, parsed.public_key(), parsed.extensions  # each parsed when first read
    except Exception as error:  # noqa: BLE001 - whatever the parser raises on a node's bytes, they are unreadable
        raise UnparseableRequest(f"unparseable request ({type(error).__name__}: "
                                 f"{str(error)[:_PARSE_ERROR_CHARS]})") from error
    return parsed


class Reported(NamedTuple):
    """What the provider reports for a node's machine, as a CSR pass judges the node's serving requests
    on it: its ``addresses`` (none: nothing to judge them on), whether they were ``kept`` from an
    earlier ask (activities/address_memo.py) rather than given for this judgment, and the lookup's
    own ``token`` (which answer it was, for ``AddressLookup.recheck``)."""
    addresses: tuple[str, ...] = ()
    kept: bool = False
    token: object = None


class AddressLookup:
    """node → what the provider reports for its machine, for ``Cluster.review_csrs``. This one asks
    ``addresses`` (node → its addresses, None: not a gpufleet node or none reported) for every
    judgment, each answer the provider's word; the activities' keeps answers a while, and says so."""

    def __init__(self, addresses: Callable[[str], "list[str] | None"]) -> None:
        self._addresses = addresses

    def reported(self, node: str) -> Reported:
        return Reported(tuple(self._addresses(node) or ()))

    def recheck(self, node: str, held: Reported) -> Reported:
        """A serving request of ``node`` names an address ``held`` (its ``reported``) lacks: the
        answer to judge it on. Not ``kept``: denied if it lacks it too; kept: left open (this one
        asks for every judgment, so what it holds is never kept)."""
        return held


def address_lookup(addresses: "Callable[[str], list[str] | None] | AddressLookup") -> AddressLookup:
    """``addresses`` as a lookup: a plain callable's answers are the provider's for each judgment."""
    return addresses if isinstance(addresses, AddressLookup) else AddressLookup(addresses)


def _as_reported(found: "Reported | list[str] | None") -> Reported:
    return found if isinstance(found, Reported) else Reported(tuple(found or ()))


def csr_decision(
    csr: dict,
    token_node: Callable[[str], "str | None"],
    is_our_node: Callable[[str], bool],
    addresses: Callable[[str], "Reported | list[str] | None"],
    renewable: Callable[[str], bool] | None = None,
    serving_spent: Callable[[str], "str | None"] = lambda _node: None,
    recheck: Callable[[str], "Reported | list[str] | None"] | None = None,
) -> CsrDecision | None:
    """Approve, deny, or ``None`` (not gpufleet's to judge: left to its usual approver).

    The requester is ``spec.username``, which the API server sets from the authenticated
    caller; nothing the caller wrote in the request decides who it is.

    With ``renewable`` gpufleet judges every node's client-certificate renewal (so kubeadm's
    ``kubeadm:node-autoapprove-certificate-rotation`` can go): a live gpufleet node's, or one
    of a node ``renewable`` vouches for (a control-plane node), for its own name; any other
    node's is denied, so a removed node's credential ends with its certificate.

    ``serving_spent(node)`` says why a node may get no more serving certificates now (None: it may):
    its serving request is then denied without asking ``addresses``, each ask a provider call.

    ``addresses(node)`` is what the provider reports for the node's machine (a list: its answer for
    this judgment; a ``Reported`` says whether it was kept from an earlier ask instead). A serving
    request naming an IP the answer lacks is denied only on an answer the provider gave for its
    judgment: on a kept one it asks ``recheck(node)`` (the answer to judge it on: a list, or a
    ``Reported`` still kept where the lookup will not ask again yet), and on one still kept it is
    left open (None). Its names are judged first: one not the node's own, or no IP at all, is denied
    whatever the provider says, without asking it."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    spec, name = csr.get("spec") or {}, (csr.get("metadata") or {}).get("name", "")
    signer, user = spec.get("signerName", ""), spec.get("username", "")
    if signer == CLIENT_SIGNER and user.startswith("system:bootstrap:"):
        issued = token_node(user.removeprefix("system:bootstrap:"))
        if issued is None:
            return None
        want = issued
    elif signer in (CLIENT_SIGNER, SERVING_SIGNER) and user.startswith("system:node:"):
        want = user.removeprefix("system:node:")
        if not is_our_node(want):
            if signer != CLIENT_SIGNER or renewable is None:
                return None
            if not renewable(want):
                return CsrDecision(name=name, requester=user, approve=False,
                                   reason=f"node {want} is neither a live gpufleet node nor a control-plane node: "
                                          "its client certificate is not renewed")
    else:
        return None

    def verdict(approve: bool, reason: str) -> CsrDecision:
        return CsrDecision(name=name, requester=user, approve=approve, reason=reason)

    try:
        request = read_csr(spec.get("request") or "")
    except UnparseableRequest as error:
        return verdict(False, str(error))  # denied by itself: the pass goes on to decide the others
    common = [a.value for a in request.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    orgs = [a.value for a in request.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    subject = f"system:node:{want}"
    if common != [subject] or orgs != ["system:nodes"]:
        asked = _quoted(common[0]) if common else "no common name"
        return verdict(False, f"{user} may get a certificate for {subject} only; it asked for {asked}")
    if not set(spec.get("usages") or []) <= _USAGES[signer]:
        return verdict(False, f"usages {sorted(spec.get('usages') or [])} are not a kubelet's")
    try:
        sans = request.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        sans = None
    if signer == CLIENT_SIGNER:
        if sans is not None:
            return verdict(False, "a kubelet client certificate names no alternative names")
        return verdict(True, f"{user} asked for {subject}, the node it may be")
    if spent := serving_spent(want):
        return verdict(False, spent)
    dns = sans.get_values_for_type(x509.DNSName) if sans else []
    ips = [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] if sans else []
    wrong = sorted({d for d in dns if d != want})
    if wrong or not ips:
        # Another name than the node's own, or no address: wrong whatever its machine reports, so
        # denied at once, without a provider call.
        return verdict(False, f"serving names {_named(wrong) or 'without an address'} are not node {want}'s")
    reported = _as_reported(addresses(want))
    if not reported.addresses:
        return None  # nothing to check the addresses against: no serving certificate from us
    lacking = sorted({ip for ip in ips if ip not in reported.addresses})
    if lacking and recheck is not None:
        # A kept answer may be out of date (the machine re-addressed since): the lookup asks afresh
        # or says it will not yet (activities/address_memo.py); a fresh answer it marks denied on.
        reported = _as_reported(recheck(want))
        if not reported.addresses:
            return None
        lacking = sorted({ip for ip in ips if ip not in reported.addresses})
    if lacking and reported.kept:
        # Left open, not denied, on an answer kept from an earlier ask that the lookup will not
        # ask about again (the activities' memo hands back the answer it judges on instead: one
        # given once a request already lacked an address in it, denied on). A kubelet waits up to
        # 15 minutes on an open request (client-go's certificate manager,
        # ``certificateWaitTimeout``, k8s.io/client-go/util/certificate) before it asks again;
        # denied, it backs off 2 s doubling to 16 s, then every 32 s, and asks again.
        return None
    if lacking:
        return verdict(False, f"serving names {_named(lacking)} are not node {want}'s "
                              f"(the provider reports {sorted(reported.addresses)})")
    return verdict(True, f"serving names match node {want} and its machine's addresses")


#: A denial names at most this many of the names a CSR asked for, each cut to ``CSR_NAME_SAID``
#: characters: the node wrote them (any number, any length), and the reason goes onto the CSR, into
#: the approver's activity result and its history, and onto every join that waits on the pass.
CSR_NAMES_SAID, CSR_NAME_SAID = 4, 64


def _named(names: list[str]) -> str:
    """The first ``CSR_NAMES_SAID`` of the names a request asked for, quoted, and how many more."""
    return ", ".join(_quoted(name) for name in names[:CSR_NAMES_SAID]) + \
        (f" and {len(names) - CSR_NAMES_SAID} more" if len(names) > CSR_NAMES_SAID else "")


def _quoted(name: str) -> str:
    """A name a node wrote, quoted and cut short (its length and characters are its own choice)."""
    return repr(shortened(name, CSR_NAME_SAID + 1))


class AccessRule(BaseModel):
    """One (verb, group, resource, subresource, namespace) the adapter uses."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    #: "" = cluster-wide (cluster-scoped resource, or every namespace).
    namespace: str = ""
    purpose: str = ""


class WeightedRouting(Protocol):
    """``set_routing_weights`` once for every implementation, which subclasses this to inherit
    it: the arguments become one route per site (``routing_sites``), which it then stores
    (``store_routes``)."""

    def set_routing_weights(
        self,
        model: str,
        weights: dict[str, int],
        healthy: dict[str, bool] | None = None,
        draining: dict[str, bool] | None = None,
        incident: dict[str, str] | None = None,
    ) -> RoutingTable:
        """Write the whole table for ``model`` (sites missing from ``weights`` are
        dropped) in one atomic write; writing the same table again changes nothing."""
        return self.store_routes(model, routing_sites(weights, healthy, draining, incident))

    def store_routes(self, model: str, sites: dict[str, SiteRoute]) -> RoutingTable:
        """``sites`` become the whole table for ``model`` in one atomic write; the same sites
        again keep its version."""
        ...


@runtime_checkable
class Cluster(WeightedRouting, Protocol):
    def create_join_token(self, node_name: str, machine_id: str, ttl_seconds: int) -> JoinTokenRef:
        """Create a token for one machine (TTL at most an hour) and hand it to that
        machine's bootstrap channel, which gives it out once. The secret is never
        returned (the sim keeps only its hash; Kubernetes keeps it in the bootstrap
        token Secret in kube-system, as the API server needs it)."""
        ...

    def revoke_join_token(self, token_id: str) -> None:
        """Delete the token (used or not). Revoking a gone token succeeds."""
        ...

    # -- bootstrap: the token rides in the machine's user data -----------------------------
    def issue_bootstrap_token(self, node_name: str, join_key: str, ttl_seconds: int) -> "BootstrapToken":
        """A token usable only to join as ``node_name`` (TTL at most an hour), issued before the
        machine exists; the same one again for the same ``join_key`` while it is valid (a
        retried activity renders the same user data). Returned with its secret: for the
        user data only, never out of the activity."""
        ...

    def revoke_node_tokens(self, node_name: str) -> list[str]:
        """Delete every join token issued for ``node_name`` (when it registered); the ids."""
        ...

    def bootstrap_endpoint(self) -> tuple[str, str]:
        """(API server ``host:port`` machines join and then use, the cluster CA as base64 PEM)."""
        ...

    def review_csrs(self, addresses: "Callable[[str], list[str] | None] | AddressLookup") -> list["CsrDecision"]:
        """gpufleet's approver: judge every pending kubelet CSR that is gpufleet's to judge, serving
        requests on what ``addresses`` (``address_lookup``) reports for each node's machine."""
        ...

    def node_identity(self, name: str) -> NodeIdentity | None:
        """The identity the join recorded for node ``name`` (None: not joined by gpufleet)."""
        ...

    def get_node(self, name: str) -> Node | None:
        """The node, or None when it has not registered (or was removed)."""
        ...

    def list_nodes(self, selector: dict[str, str] | None = None) -> list[Node]:
        ...

    def label_node(self, name: str, labels: dict[str, str]) -> Node:
        """Merge our labels; touches no other key. Idempotent. (A ``None`` value
        removes that label, as in a merge patch.)"""
        ...

    def set_taints(self, name: str, add: list[str] = (), remove: list[str] = ()) -> Node:
        """Add/remove taints given as ``key[=value]:Effect``. Idempotent."""
        ...

    def cordon(self, name: str, unschedulable: bool = True, *, by: str | None = None,
               version: str | None = None) -> Node:
        """Cordon (or uncordon). With ``by``, the same change marks who cordoned it
        (``ANNOTATION_CORDONED_BY``); an uncordon removes that mark, whoever wrote it. A cordon
        without ``by`` leaves the mark as it is. With ``version`` (a ``node_marks`` read's), only
        if the node has not changed since that read: else ``NodeChanged``, nothing written."""
        ...

    def node_marks(self, name: str) -> NodeMarks:
        """The node's annotations and cordon, with the version they were read at (for a
        ``cordon`` decided on them). Raises ``NodeNotFound``."""
        ...

    def remove_node(self, name: str) -> None:
        """Delete the Node object, then the join's identity record of it (a name that is no
        longer a node of ours must not keep getting its kubelet's renewals approved, nor
        lend its machine to a kubelet that registers under it again). Removing a gone node
        succeeds."""
        ...

    def annotate_node(self, name: str, annotations: dict[str, str | None], *,
                      version: str | None = None) -> dict[str, str]:
        """Merge our annotations (``None`` removes one); returns all the node's annotations. With
        ``version`` (a ``node_marks`` read's), only if the node has not changed since that read:
        else ``NodeChanged``, nothing written."""
        ...

    def drain_node(
        self, name: str, deadline_s: float, force: bool = False, heartbeat: Callable[[], None] | None = None,
    ) -> DrainResult:
        """Cordon (leaving any cordon mark as it is), then evict every pod but DaemonSet and mirror pods
        through the Eviction API, retrying PDB refusals with backoff until ``deadline_s``.
        With ``force``, pods still refused at the deadline are deleted (PDB
        bypassed). ``heartbeat`` is called between rounds (activity heartbeats)."""
        ...

    def list_gpu_pods(self, pending_only: bool = False) -> list[GpuPod]:
        """Every pod that requests ``nvidia.com/gpu`` and has not finished (with
        ``pending_only``: only those Pending and not bound to a node), every namespace:
        what the demand loop plans from and counts each node's GPUs with."""
        ...

    # -- watches: what the event-driven entities wait on (issue 37) -----------------------
    def watch_nodes(
        self, selector: dict[str, str] | None, until: Callable[[list[Node]], bool], timeout_s: float,
        recheck_s: float = 30.0, heartbeat: Callable[[], None] | None = None, poll_s: float = 1.0,
    ) -> list[Node]:
        """The nodes matching ``selector`` as soon as ``until(nodes)`` holds, or after ``timeout_s``.

        A real watch: list, then follow the changes from the list's resourceVersion; a version the
        server no longer has (``410 Gone``: compacted, or too old for its watch cache) lists again.
        ``until`` is asked after the list, after every change and at least every ``recheck_s``
        (so it may keep clocks of its own, e.g. a provider probe); ``heartbeat`` is called as
        often. The nodes carry no identity record (the machine as the providerID names it)."""
        ...

    def watch_gpu_pods(
        self, until: Callable[[list[GpuPod]], bool], timeout_s: float, recheck_s: float = 30.0,
        heartbeat: Callable[[], None] | None = None, poll_s: float = 0.2,
        wake_at: Callable[[], float | None] | None = None,
    ) -> list[GpuPod]:
        """``list_gpu_pods()`` as soon as ``until`` holds for it, or after ``timeout_s``: a watch on
        the pods that have not finished (every namespace), as ``watch_nodes``. ``until`` is also
        asked at ``wake_at()`` (``time.monotonic()``, asked after each look; None: no such time),
        when it may hold though no pod changed (a batch's window closing): no wait of the watch
        goes past it."""
        ...

    def watch_open_csrs(
        self, until: Callable[[list[OpenCsr]], bool], timeout_s: float, recheck_s: float = 30.0,
        heartbeat: Callable[[], None] | None = None,
    ) -> list[OpenCsr]:
        """The CSRs under a signer gpufleet judges (``JUDGED_SIGNERS``) still open (neither Denied
        nor Failed: pending, or approved and not yet cleaned up), oldest first (by creation, then
        name), as soon as ``until`` holds for them, or after ``timeout_s``: a watch on CSRs, as
        ``watch_nodes``."""
        ...

    # -- per-site serving -----------------------------------------------------------------
    def apply_serving(self, spec: ServingSpec) -> ServingStatus:
        """Create or update the model's Deployment and Service at the site. A changed
        template keeps the one before it for ``rollback_serving``; it comes with the spec's
        ``max_surge`` (a Deployment's strategy). Idempotent."""
        ...

    def serving_template(self, spec: ServingSpec) -> str:
        """The pod template ``apply_serving(spec)`` leaves the Deployment on, as
        ``ServingStatus.template`` names it: a status showing another is replaced by the apply."""
        ...

    def scale_serving(self, model: str, site: str, replicas: int) -> ServingStatus:
        ...

    def serving_status(self, model: str, site: str) -> ServingStatus | None:
        ...

    def rollback_serving(self, model: str, site: str) -> ServingStatus:
        """Back to the previous template (which becomes the one to roll back to).
        ``ServingNotFound`` when there is no Deployment, ``ValueError`` when no previous template."""
        ...

    def delete_serving(self, model: str, site: str) -> None:
        """Delete the Deployment and Service. Deleting gone ones succeeds."""
        ...

    # -- routing (``set_routing_weights`` and ``store_routes``: ``WeightedRouting``) -------
    def get_routing(self, model: str) -> RoutingTable | None:
        ...

    def list_serving(self, site: str | None = None) -> list[ServingStatus]:
        """Every serving Deployment we manage (at ``site`` when given), by model then site."""
        ...

    def set_site_routes(self, sites: dict[str, SiteRoute]) -> RoutingTable:
        """Publish the fleet-wide per-site document (weight, healthy, draining, incident
        of every site: what a site-first front door reads) in one atomic write; the
        version bumps once per change, not on repeats. ``model`` is ``SITE_ROUTES``."""
        ...

    def get_site_routes(self) -> RoutingTable | None:
        ...

    # -- control-plane state (the account guard, queued deletes, own-rack allocations) -----
    def read_state(self, kind: str, key: str) -> dict[str, str]:
        """The state object's data (``{}`` when there is none)."""
        ...

    def update_state(self, kind: str, key: str, change: StateChange) -> dict[str, str]:
        """Compare-and-swap: read the object, ``change`` a copy of its data, write it back
        only if nobody wrote in between; when someone did, read again and call ``change``
        again (so ``change`` must depend on nothing but the data it is given). ``change``
        returning ``None`` writes nothing. An exception from ``change`` writes nothing and
        propagates. Returns the data now stored."""
        ...

    def list_state(self, kind: str) -> dict[str, dict[str, str]]:
        """Every state object of ``kind``: key -> data."""
        ...

    def delete_state(self, kind: str, key: str, only_if: dict[str, str] | None = None) -> bool:
        """Delete the state object; with ``only_if``, only while its data is exactly that
        (someone who wrote it since wins). ``False`` when nothing was deleted (gone already,
        or changed)."""
        ...

    # -- backup (``gpufleet backup export`` / ``restore``: cli/backup.py) --------------------
    def state_origin(self) -> dict[str, str]:
        """Where this state lives, as a backup names its source: the API server and namespace
        (the sim: its database file). Names only, never a credential."""
        ...

    def state_kinds(self) -> list[str]:
        """The kind of every state object held, sorted, each once: a backup exports the kinds it
        knows and names any other, so a kind added later is never left out without a word."""
        ...


#: ``update_state``'s change: the new data, or ``None`` for no write.
StateChange = Callable[[dict[str, str]], "dict[str, str] | None"]
#: Value keys a state object may hold (what a ConfigMap's ``data`` allows).
STATE_VALUE_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")


def state_object_name(kind: str, key: str) -> str:
    """The name of the object holding state ``kind``/``key``: readable, and distinct for
    distinct keys even when their readable parts agree (``A_b`` and ``a-b``)."""
    digest = hashlib.sha256(f"{kind}\0{key}".encode()).hexdigest()[:10]
    return f"gpufleet-{dns_label(kind, 20)}-{dns_label(key, 30)}-{digest}"


def check_state_data(data: dict[str, str]) -> dict[str, str]:
    """Refuse what a state object cannot hold (a bug in the caller, never retried)."""
    for name, value in data.items():
        if not isinstance(name, str) or not STATE_VALUE_KEY.fullmatch(name) or not isinstance(value, str):
            raise InvalidRequest(f"state data key {name!r}: keys are [-._a-zA-Z0-9]+, values strings",
                                 code="state-data")
    return data


# -- shared helpers ---------------------------------------------------------------------
#: On every object gpufleet renders for a model: the model's name as written.
ANNOTATION_MODEL = "gpufleet.io/model"
#: Gateway API's group (Gateway, HTTPRoute).
GATEWAY_GROUP = "gateway.networking.k8s.io"
GATEWAY_VERSION = "v1"


def label_value(value: str) -> str:
    """A valid label value (≤63, alphanumerics at both ends)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", value)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", cleaned)


def parse_taint(taint: str) -> tuple[str, str, str]:
    """``key[=value]:Effect`` → (key, value, effect)."""
    key_value, sep, effect = taint.rpartition(":")
    if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute") or not key_value:
        raise ValueError(f"taint {taint!r} is not key[=value]:NoSchedule|PreferNoSchedule|NoExecute")
    key, _, value = key_value.partition("=")
    return key, value, effect


def format_taint(key: str, value: str | None, effect: str) -> str:
    return f"{key}={value}:{effect}" if value else f"{key}:{effect}"


def apply_taints(current: list[str], add: Iterable[str] = (), remove: Iterable[str] = ()) -> list[str]:
    """The taint list after the change; a taint is identified by key and effect."""
    add, remove = list(add), list(remove)

    def ident(taint: str) -> tuple[str, str]:
        key, _value, effect = parse_taint(taint)
        return key, effect

    drop = {ident(t) for t in [*add, *remove]}
    # A taint already there exactly as asked keeps its place (no needless write).
    kept = [t for t in current if ident(t) not in drop or t in add]
    for taint in add:
        if taint not in kept:
            kept.append(taint)
    return kept


def routing_sites(
    weights: dict[str, int],
    healthy: dict[str, bool] | None = None,
    draining: dict[str, bool] | None = None,
    incident: dict[str, str] | None = None,
) -> dict[str, SiteRoute]:
    """The per-site routes of ``set_routing_weights`` (both implementations)."""
    healthy, draining, incident = healthy or {}, draining or {}, incident or {}
    unknown = (set(healthy) | set(draining) | set(incident)) - set(weights)
    if unknown:
        raise ValueError(f"health given for sites without a weight: {sorted(unknown)}")
    return {
        site: SiteRoute(
            weight=weight,
            healthy=healthy.get(site, True),
            draining=draining.get(site, False),
            incident=incident.get(site, ""),
        )
        for site, weight in sorted(weights.items())
    }


T = TypeVar("T")


def poll_watch(
    look: Callable[[], T],
    until: Callable[[T], bool],
    timeout_s: float,
    recheck_s: float,
    heartbeat: Callable[[], None] | None,
    poll_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    wake_at: Callable[[], float | None] | None = None,
) -> T:
    """A watch for a store that has none (the simulated cluster): ``look()`` every ``poll_s``
    (and at ``wake_at()``, when sooner) until ``until`` holds for what it saw or ``timeout_s``
    passed; ``heartbeat`` every ``recheck_s``. Looking costs the store a read, never the caller a
    Temporal action."""
    deadline = clock() + max(timeout_s, 0.0)
    beat_at = clock() + recheck_s
    while True:
        seen = look()
        now = clock()
        if until(seen) or now >= deadline:
            return seen
        if heartbeat is not None and now >= beat_at:
            heartbeat()
            beat_at = now + recheck_s
        wake = wake_at() if wake_at is not None else None
        sleep(max(0.0, min(poll_s, deadline - now, wake - now if wake is not None else poll_s)))


#: Reads of a node before ``decide_on_node`` gives up: a decision is lost only to another writer
#: of that node in between its read and its write, which takes milliseconds.
NODE_DECISION_TRIES = 5


def decide_on_node(cluster: Cluster, name: str, decide: Callable[[NodeMarks], T]) -> T:
    """``decide(marks)`` on the node's marks as read now, its writes made on that read
    (``version=marks.version``); one meeting ``NodeChanged`` (the node changed in between: a repair
    fenced a GPU, a person marked it theirs) is decided again on a fresh read. Past
    ``NODE_DECISION_TRIES``, ``NodeChanged`` (retryable). Raises ``NodeNotFound`` for a node gone."""
    for _ in range(NODE_DECISION_TRIES - 1):
        try:
            return decide(cluster.node_marks(name))
        except NodeChanged:
            continue
    return decide(cluster.node_marks(name))  # the last try's NodeChanged goes to the caller


def uncordon_unless(cluster: Cluster, names: list[str], keep: Callable[[str, NodeMarks], bool]) -> list[str]:
    """Uncordon each node of ``names`` that ``keep(name, marks)`` does not keep, each decided on
    its marks as read (``decide_on_node``: a fence or a mark written since refuses the uncordon,
    and is seen); the ones uncordoned. A node gone is skipped."""

    def uncordon(name: str, marks: NodeMarks) -> bool:
        if keep(name, marks):
            return False
        cluster.cordon(name, False, version=marks.version)
        return True

    done = []
    for name in names:
        try:
            if decide_on_node(cluster, name, lambda marks: uncordon(name, marks)):
                done.append(name)
        except NodeNotFound:
            continue
    return done


def selector_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _repels_serving(taint: str) -> bool:
    key, _value, effect = parse_taint(taint)
    # Serving pods tolerate the usual GPU-node taint ``nvidia.com/gpu:NoSchedule`` and the
    # fleet taint every gpufleet node keeps (``render_pod_template``).
    return effect in ("NoSchedule", "NoExecute") and not (key in SERVING_TOLERATED and effect == "NoSchedule")


#: The NoSchedule taint keys a serving pod tolerates.
SERVING_TOLERATED = (GPU_RESOURCE, FLEET_TAINT_KEY)


def takes_serving(node: Node, site: str) -> bool:
    """Whether a new serving replica of ``site`` may be placed on ``node``: a ready, schedulable
    node at the site with no NoSchedule/NoExecute taint (but ``nvidia.com/gpu:NoSchedule``)."""
    return (node.labels.get(LABEL_SITE) == site and node.ready and not node.unschedulable
            and not any(_repels_serving(t) for t in node.taints))


def serving_capacity(nodes: Iterable[Node], site: str, gpus_per_replica: int) -> int:
    """How many replicas the site's nodes can hold, with nothing else on them (what both the
    simulated cluster and the test API server's scheduler assume): the nodes that take serving
    (``takes_serving``), GPUs divided per replica."""
    return sum(node.gpus_allocatable // gpus_per_replica if gpus_per_replica else 1_000
               for node in nodes if takes_serving(node, site))


def serving_labels(model: str, site: str) -> dict[str, str]:
    """The labels of ``model``'s serving objects at ``site``; its pods' selector."""
    return {LABEL_MODEL: label_value(dns_label(model)), LABEL_SITE: label_value(site)}


def gpus_held_by_pods(nodes: Iterable[Node], pods: Iterable[GpuPod], site: str,
                      serving: Iterable[tuple[str, str]] = ()) -> int:
    """GPUs the pods bound to ``site``'s serving nodes hold (a training job, a demand pod), but
    the pods of the ``serving`` (model, site) Deployments: those are counted as their Deployment's.
    Each node's pods hold at most the GPUs it has (``gpus_counted``): a node's own mirror pod,
    whatever it asks, takes no GPU of another node. A mirror pod is never a replica, whatever its
    labels (a ReplicaSet adopts no pod another controller owns)."""
    on_nodes = {node.name: node.gpus_allocatable for node in nodes if takes_serving(node, site)}
    selectors = [serving_labels(model, where) for model, where in serving]
    return sum(gpus for pod, gpus in gpus_counted(pods, on_nodes)
               if pod.mirror or not any(selector_matches(s, pod.labels) for s in selectors))


def free_gpus_at(nodes: Iterable[Node], serving: Iterable[ServingStatus], pods: Iterable[GpuPod], site: str) -> int:
    """GPUs at ``site`` no one holds or asks for: its serving nodes' GPUs less each serving
    Deployment's there (replicas x GPUs per replica, scheduled or still Pending) and those every
    other pod on those nodes holds. Counted per site, not per node: GPUs left on two nodes may
    add up to a replica neither node can hold."""
    nodes, serving = list(nodes), [s for s in serving if s.site == site]
    asked = sum(s.desired_replicas * s.gpus_per_replica for s in serving)
    held = gpus_held_by_pods(nodes, pods, site, [(s.model, s.site) for s in serving])
    return max(0, serving_capacity(nodes, site, 1) - asked - held)


class PodInfo(BaseModel):
    namespace: str
    name: str
    owner_kinds: list[str] = Field(default_factory=list)
    mirror: bool = False


EvictOutcome = Literal["evicted", "gone", "blocked"]


def run_drain(
    node: str,
    deadline_s: float,
    force: bool,
    *,
    list_pods: Callable[[], list[PodInfo]],
    evict: Callable[[str, str], tuple[EvictOutcome, str]],
    delete: Callable[[str, str], None],
    heartbeat: Callable[[], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> DrainResult:
    """The drain loop both implementations share (the node is already cordoned).

    1. Skip DaemonSet-owned and mirror pods; evict the rest, retrying refusals
       (PDB: HTTP 429) with exponential backoff until the deadline.
    2. Wait, until the deadline, for evicted pods to leave the node.
    3. At the deadline: with ``force`` delete the pods still refused; otherwise
       report them, with the last refusal's reason, as blocked.
    """
    start = clock()
    deadline = start + max(deadline_s, 0.0)
    result = DrainResult(node=node)
    pending: dict[str, PodInfo] = {}
    for pod in list_pods():
        left_alone = "mirror pod" if pod.mirror else "DaemonSet pod" if "DaemonSet" in pod.owner_kinds else ""
        if not left_alone:
            pending[f"{pod.namespace}/{pod.name}"] = pod
        elif len(result.skipped) < SKIPPED_LISTED:
            result.skipped.append(DrainPod(namespace=pod.namespace, name=pod.name, reason=left_alone))
        else:
            result.skipped_unlisted += 1
    reasons: dict[str, str] = {}
    delay = 0.1

    def pause() -> bool:
        nonlocal delay
        left = deadline - clock()
        if left <= 0:
            return False
        if heartbeat:
            heartbeat()
        sleep(min(delay, left))
        delay = min(delay * 2, 2.0)
        return True

    while pending:
        for key, pod in list(pending.items()):
            outcome, reason = evict(pod.namespace, pod.name)
            if outcome == "blocked":
                reasons[key] = reason
            else:
                del pending[key]
                reasons.pop(key, None)
                result.evicted.append(DrainPod(namespace=pod.namespace, name=pod.name))
        if not pending or not pause():
            break

    # Evicted pods terminate gracefully; the node is drained when they are gone.
    evicted = {p.key for p in result.evicted}
    terminating: set[str] = set()
    delay = 0.1
    while evicted:
        present = {f"{p.namespace}/{p.name}" for p in list_pods()}
        terminating = evicted & present
        if not terminating or not pause():
            break

    if force:
        for key, pod in list(pending.items()):
            delete(pod.namespace, pod.name)
            result.deleted.append(DrainPod(namespace=pod.namespace, name=pod.name, reason=reasons.get(key, "")))
        pending.clear()
    for key, pod in sorted(pending.items()):
        result.blocked.append(DrainPod(namespace=pod.namespace, name=pod.name, reason=reasons.get(key, "")))
    for key in sorted(terminating):
        namespace, _, name = key.partition("/")
        result.blocked.append(DrainPod(namespace=namespace, name=name, reason="evicted but still terminating"))
    result.completed = not result.blocked
    result.elapsed_s = round(clock() - start, 3)
    return result


class EvictionDrain:
    """``drain_node`` as both implementations run it: cordon, then ``run_drain`` over the node's
    pods with the implementation's own ``_pods_on``, ``_evict`` and ``_delete_pod``."""

    def drain_node(
        self, name: str, deadline_s: float, force: bool = False, heartbeat: Callable[[], None] | None = None,
    ) -> DrainResult:
        self.cordon(name)  # type: ignore[attr-defined]
        return run_drain(
            name, deadline_s, force,
            list_pods=lambda: self._pods_on(name),  # type: ignore[attr-defined]
            evict=self._evict,  # type: ignore[attr-defined]
            delete=self._delete_pod,  # type: ignore[attr-defined]
            heartbeat=heartbeat,
        )
