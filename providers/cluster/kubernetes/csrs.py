"""gpufleet's CSR approver: which kubelet certificates a node gets, and the client keys that
the node gateway then accepts from it.

Kubelet certificates: ``review_csrs`` is gpufleet's approver. A client CSR
from ``system:bootstrap:<id>`` (the requester the API server authenticated,
never the request body) is approved only when token ``<id>`` is gpufleet's
and was issued for exactly the node in the CSR's subject; a renewal from
``system:node:<name>`` only for ``<name>``, and only while ``<name>`` is a live
gpufleet node (its identity record) or a control-plane node (``CONTROL_PLANE_LABEL``);
any other node's client renewal is denied, so kubeadm's self-renewal binding can go
and a removed node's certificate is its last; so is a renewal past ``RENEWALS_PER_WINDOW``
in ``RENEWAL_WINDOW`` (a kubelet renews once per certificate lifetime). A kubelet-serving
CSR only when its names are the node's name and the addresses the provider reports for
its machine, and at most ``SERVING_PER_WINDOW`` of a node's in ``RENEWAL_WINDOW``. Other CSRs
(other signers, other requesters) are left alone. A node's requests are its own to post, any
number: a pass asks the provider for a node's addresses once, and not at all once its allowance
is spent, and writes its approvals before its denials. Across passes the ``addresses`` the activities
hand in keep each machine's answer a while (activities/address_memo.py), so what a node posts sets no
pace of calls to its provider; a serving request is denied only on an answer the provider gave for
it (or given once a request already lacked an address in it), and one that a kept answer does not
cover (its machine re-addressed since) has the provider asked again once. A serving request naming
another name than the node's own, or no address, is denied whatever the provider reports (even
nothing), without asking it.
"""

from __future__ import annotations

import copy
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from kubernetes.client.exceptions import ApiException

from fleet.cluster import (
    NODE_IDENTITY_KIND,
    NODE_KEYS_KEPT,
    NODE_KEYS_KIND,
    NODE_KEYS_NEWEST_CSR,
    bound_keys,
    client_key_fingerprint,
    with_key,
)
from providers.cluster.base import (CLIENT_SIGNER, CONTROL_PLANE_LABEL, SERVING_SIGNER, AddressLookup, CsrDecision,
                                    JUDGED_SIGNERS, OpenCsr, Reported, UnparseableRequest, address_lookup,
                                    csr_decision, read_csr)
from providers.cluster.kubernetes.api import _translate
from providers.cluster.kubernetes.state import ControlPlaneState
from providers.cluster.kubernetes.tokens import _TOKEN_ID, JOIN_TOKEN_KIND
from providers.cluster.kubernetes.watch import Watches

#: Client-certificate renewals approved per node within ``RENEWAL_WINDOW``: with the key in use
#: each stays bound (``NODE_KEYS_KEPT``). A node asking for more is denied: it would rotate the
#: keys of its own record, and give every pass a write per renewal.
RENEWALS_PER_WINDOW = NODE_KEYS_KEPT - 1
#: Serving certificates approved per node within ``RENEWAL_WINDOW``. A kubelet asks for one when it
#: starts (its join, or the fresh start a reinstall gives the same name) and again once per
#: certificate lifetime: a start, a rotation and a reinstall in one hour is the most an honest node
#: needs. Every approval is an API write and a signed certificate, so a node asking for more is
#: denied: it would otherwise have any number of them, each a write on the pass every join polls.
SERVING_PER_WINDOW = 3
RENEWAL_WINDOW = timedelta(hours=1)
#: What a node's kubelet asks for, capped per node in ``RENEWAL_WINDOW``: (most approved, what they are, why).
_CAPPED = {
    CLIENT_SIGNER: (RENEWALS_PER_WINDOW, "client certificates renewed",
                    "a kubelet renews once per certificate lifetime"),
    SERVING_SIGNER: (SERVING_PER_WINDOW, "serving certificates approved",
                     "a kubelet asks for one when it starts and once per certificate lifetime"),
}


class CsrApprover(Watches, ControlPlaneState):
    """Judges the pending kubelet CSRs (``review_csrs``) and follows the open ones."""

    def review_csrs(self, addresses: Callable[[str], list[str] | None] | AddressLookup) -> list[CsrDecision]:
        """Approve or deny the pending kubelet CSRs that are gpufleet's to judge (see the
        module doc); ``addresses(node)`` is what the provider reports for that node's machine
        (None: not a gpufleet node), or an ``AddressLookup`` that says when it kept an answer."""
        lookup = address_lookup(addresses)
        listed = self._do("list CSRs", self.certificates.list_certificate_signing_request)
        decisions = []
        tokens: dict[str, str | None] = {}
        identities = self.list_state(NODE_IDENTITY_KIND)
        control_plane: list[set[str]] = []

        def renewable(node: str) -> bool:
            """A control-plane node's kubelet renews through gpufleet too (kubeadm's self-renewal
            binding removed): the Node exists and carries the label only an admin can set."""
            if not control_plane:
                found = self._do("list control-plane nodes", self.core.list_node, label_selector=CONTROL_PLANE_LABEL)
                control_plane.append({n["metadata"]["name"] for n in found.get("items", [])})
            return node in control_plane[0]

        keys: list[dict[str, dict[str, str]]] = []  # NODE_KEYS_KIND, listed when first needed
        looked_up: dict[str, Reported] = {}

        def addresses_once(node: str) -> Reported:
            """Asked once per node a pass, however many requests it posted: each ask is a call to the
            provider, against a rate limit its account's other machines and sites share."""
            if node not in looked_up:
                looked_up[node] = lookup.reported(node)
            return looked_up[node]

        def recheck(node: str) -> Reported:
            """A request of the node names an address its answer lacks: the answer to judge it on,
            asked afresh at most once (the lookup's rule), and the node's other requests this pass
            judged on it too."""
            looked_up[node] = lookup.recheck(node, addresses_once(node))
            return looked_up[node]

        def judge(csr: dict[str, Any]) -> CsrDecision | None:
            return csr_decision(csr, lambda token_id: self._token_node(token_id, tokens),
                                lambda node: node in identities, addresses_once, renewable,
                                lambda node: spent((SERVING_SIGNER, node)), recheck)

        def bind_key(node: str, fingerprint: str, csr: str) -> None:
            keys[0][node] = self.update_state(NODE_KEYS_KIND, node, lambda old: with_key(old, fingerprint, csr))

        # Oldest first: a node's keys are bound in the order it asked for them.
        items = sorted(listed.get("items", []), key=_order)
        since = datetime.now(timezone.utc) - RENEWAL_WINDOW
        approved = Counter(asked for csr in items if (asked := _node_asks(csr)) and _approved_after(csr, since))

        def spent(asked: tuple[str, str]) -> str | None:
            """Why the node may get no more certificates of this kind in the window (None: it may)."""
            most, what, why = _CAPPED[asked[0]]
            if approved[asked] < most:
                return None
            return (f"node {asked[1]} had {approved[asked]} {what} in the last "
                    f"{RENEWAL_WINDOW.total_seconds() / 3600:g} h, the most it may: {why}")

        # Judged before any is decided: a kubelet waits only on the newest certificate it asked for
        # (one unanswered for minutes it gives up on, and asks again), so of a node's open requests
        # of one kind that gpufleet would approve only the newest is, the older are denied as
        # superseded. Approved oldest first, they spent the node's allowance on requests nobody
        # waits for, and after an approver outage the one its kubelet waits on was denied, leaving
        # the node without a certificate for the window.
        verdicts = {_order(csr): judge(csr) for csr in items if not _judged(csr)}
        newest = {asked: _order(csr) for csr in items
                  if (verdict := verdicts.get(_order(csr))) is not None and verdict.approve
                  and (asked := _node_asks(csr))}
        denials: list[tuple[dict[str, Any], CsrDecision]] = []
        for csr in items:
            status = csr.get("status") or {}
            judged = {c.get("type") for c in status.get("conditions") or []}
            if "Denied" in judged or "Failed" in judged:
                continue
            client_key = _client_csr_key(csr)
            if client_key is not None and not keys:
                keys.append(self.list_state(NODE_KEYS_KIND))
            record = keys[0].get(client_key[0], {}) if client_key is not None else {}
            unbound = client_key is not None and client_key[1] not in bound_keys(record)
            if "Approved" in judged:
                # Approved by another approver (kubeadm's auto-approval): its key opens the node
                # gateway only where gpufleet's own judgement approves it too. Bound once: one no
                # newer than the newest CSR bound had its key rotated out by later ones (a CSR stays
                # listed for an hour after it is approved), and binding it again would rotate out
                # another, on every pass.
                if unbound and _order(csr) > record.get(NODE_KEYS_NEWEST_CSR, "") \
                        and (decision := judge(csr)) is not None and decision.approve:
                    bind_key(*client_key, _order(csr))
                continue
            decision = verdicts[_order(csr)]
            if decision is None:
                continue
            if decision.approve and (asked := _node_asks(csr)) is not None:
                if _order(csr) < newest[asked]:
                    decision = decision.model_copy(update={"approve": False, "reason": (
                        f"superseded: node {asked[1]} asked again since (its kubelet waits on its newest request)")})
                elif reason := spent(asked):
                    decision = decision.model_copy(update={"approve": False, "reason": reason})
                else:
                    approved[asked] += 1
            if decision.approve and unbound:
                bind_key(*client_key, _order(csr))  # before the approval: no certificate is ever out unbound
            if decision.approve:
                self._decide(csr, decision)
            else:
                denials.append((csr, decision))
            decisions.append(decision)
        # Denied last: one node's thousands of requests, a write each, delay no node's approval.
        for csr, decision in denials:
            self._decide(csr, decision)
        return decisions

    def _token_node(self, token_id: str, cache: dict[str, str | None]) -> str | None:
        """The node a gpufleet token was issued for, from its record (None: not one of gpufleet's)."""
        if token_id not in cache:
            record = self.read_state(JOIN_TOKEN_KIND, token_id) if _TOKEN_ID.fullmatch(token_id) else {}
            cache[token_id] = record.get("node-name") or None
        return cache[token_id]

    def _decide(self, csr: dict[str, Any], decision: CsrDecision) -> None:
        name = csr["metadata"]["name"]
        body = copy.deepcopy(csr)
        conditions = (body.setdefault("status", {}).get("conditions") or [])
        conditions.append({"type": "Approved" if decision.approve else "Denied", "status": "True",
                           "reason": "GpufleetApproved" if decision.approve else "GpufleetDenied",
                           "message": decision.reason,
                           "lastUpdateTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
        body["status"]["conditions"] = conditions
        try:
            self._call(f"decide CSR {name}", self.certificates.replace_certificate_signing_request_approval,
                       name, body)
        except ApiException as error:
            if error.status in (404, 409):
                return  # gone, or changed meanwhile: judged again on the next review
            raise _translate(error, f"decide CSR {name}") from error

    def watch_open_csrs(self, until: Callable[[list[OpenCsr]], bool], timeout_s: float, recheck_s: float = 30.0,
                        heartbeat: Callable[[], None] | None = None) -> list[OpenCsr]:
        def convert(obj: dict[str, Any]) -> OpenCsr | None:
            if (obj.get("spec") or {}).get("signerName") not in JUDGED_SIGNERS:
                return None  # left to another approver: no pass of gpufleet's decides it
            conditions = (obj.get("status") or {}).get("conditions") or []
            if any(c.get("type") in ("Denied", "Failed") for c in conditions):
                return None
            meta = obj.get("metadata") or {}
            return OpenCsr(meta.get("creationTimestamp") or "", meta["name"]) if meta.get("name") else None

        return sorted(self._follow("CSRs", self.certificates.list_certificate_signing_request, convert,
                                   lambda found: until(sorted(found)), timeout_s, recheck_s, heartbeat))


def _order(csr: dict[str, Any]) -> str:
    """Where a CSR stands among the others: its creation time (whole seconds), then its name."""
    meta = csr.get("metadata") or {}
    return f"{meta.get('creationTimestamp') or ''} {meta.get('name') or ''}"


def _judged(csr: dict[str, Any]) -> bool:
    """Whether the CSR is approved, denied or failed already."""
    conditions = (csr.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("Approved", "Denied", "Failed") for c in conditions)


def _node_asks(csr: dict[str, Any]) -> tuple[str, str] | None:
    """(signer, node) of a certificate a node's kubelet asks for as itself (the requester), a
    client renewal or a serving certificate, or None."""
    spec = csr.get("spec") or {}
    user, signer = spec.get("username") or "", spec.get("signerName")
    if signer not in _CAPPED or not user.startswith("system:node:"):
        return None
    return signer, user.removeprefix("system:node:")


def _approved_after(csr: dict[str, Any], since: datetime) -> bool:
    """Whether the CSR was approved after ``since`` (the API server stamps the condition's time)."""
    for condition in (csr.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Approved":
            stamp = condition.get("lastUpdateTime") or (csr.get("metadata") or {}).get("creationTimestamp") or ""
            try:
                return datetime.fromisoformat(stamp.replace("Z", "+00:00")) > since
            except (TypeError, ValueError):
                return True  # approved, and it does not say when: counted as recent
    return False


def _client_csr_key(csr: dict[str, Any]) -> tuple[str, str] | None:
    """(node, key fingerprint) of a kubelet client CSR (``system:node:<node>``), or None."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import NameOID

    spec = csr.get("spec") or {}
    if spec.get("signerName") != CLIENT_SIGNER:
        return None
    try:
        request = read_csr(spec.get("request") or "")
    except UnparseableRequest:
        return None
    public = request.public_key().public_bytes(serialization.Encoding.DER,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    common = [a.value for a in request.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if len(common) != 1 or not str(common[0]).startswith("system:node:"):
        return None
    return str(common[0]).removeprefix("system:node:"), client_key_fingerprint(public)
