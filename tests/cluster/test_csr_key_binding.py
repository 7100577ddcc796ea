"""Issue 35, finding 3: the node gateway's liveness is the identity record *and* the client
keys gpufleet's approver bound to the node (``NODE_KEYS_KIND``), never a Node object or a
certificate some other approver signed.

The approver binds a kubelet client CSR's key to its node when it approves the CSR, before
the approval (no certificate is ever out unbound); a CSR another approver approved (kubeadm's
bootstrap auto-approval) is bound only where gpufleet's own judgement approves it too; a
denied one is never bound; ``remove_node`` forgets the keys with the identity record.
(End to end, through the gateway and the real control plane: tests/realk8s/test_node_agent.py.)
"""

from __future__ import annotations

import base64

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fleet.cluster import NODE_KEYS_KIND, NodeIdentity, bound_keys, client_key_fingerprint
from providers.cluster.kubernetes import CSR_GROUP, NODE_IDENTITY_KIND
from tests.cluster.test_csr_renewals import renewal


def key_of(csr: dict) -> str:
    request = x509.load_pem_x509_csr(base64.b64decode(csr["spec"]["request"]))
    return client_key_fingerprint(request.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo))


def approved_elsewhere(csr: dict) -> dict:
    """The CSR as another approver left it (kube-controller-manager's csrapproving)."""
    return csr | {"status": {"conditions": [{"type": "Approved", "status": "True", "reason": "AutoApproved"}]}}


def test_the_approver_binds_the_keys_it_approves_and_only_those(kube, fake) -> None:
    fake.add_node("gpu-live", {})
    fake.add_node("gpu-removed", {})  # its kubelet registered the Node again; no identity record
    identity = NodeIdentity(node_name="gpu-live", machine_id="m-1", provider="lambda", account="a", site="s")
    kube.update_state(NODE_IDENTITY_KIND, "gpu-live", lambda _current: identity.state())
    live, removed = renewal("r-live", "gpu-live"), renewal("r-removed", "gpu-removed")
    # Approved by kubeadm's auto-approval, for a name gpufleet does not approve: not bound.
    other_removed = approved_elsewhere(renewal("a-removed", "gpu-removed"))
    # Approved by kubeadm for a live node's own renewal: gpufleet approves it too, so bound.
    other_live = approved_elsewhere(renewal("a-live", "gpu-live"))
    for csr in (live, removed, other_removed, other_live):
        fake.put(CSR_GROUP, "certificatesigningrequests", csr)

    verdicts = {d.name: d.approve for d in kube.review_csrs(lambda _node: None)}
    assert verdicts == {"r-live": True, "r-removed": False}

    assert set(bound_keys(kube.read_state(NODE_KEYS_KIND, "gpu-live"))) == {key_of(live), key_of(other_live)}
    assert kube.read_state(NODE_KEYS_KIND, "gpu-removed") == {}, "no key of a node gpufleet does not renew"
    # A second pass binds nothing new and keeps what it bound.
    kube.review_csrs(lambda _node: None)
    assert set(bound_keys(kube.read_state(NODE_KEYS_KIND, "gpu-live"))) == {key_of(live), key_of(other_live)}

    kube.remove_node("gpu-live")
    assert kube.read_state(NODE_KEYS_KIND, "gpu-live") == {}, "a removed node's keys open nothing"
    assert kube.node_identity("gpu-live") is None
