"""gpufleet's approver judges every node's client-certificate renewal, so kubeadm's
``kubeadm:node-autoapprove-certificate-rotation`` can be removed: a live gpufleet node (its
identity record) and a control-plane node (the label NodeRestriction keeps kubelets from
setting) are renewed for their own name; any other node, a removed one above all, is denied.
The adapter's verdicts on CSRs made as the node against a real control plane:
tests/realk8s/test_adapter_objects.py (and with a real kubelet, tests/realk8s/test_blast_radius.py)."""

from __future__ import annotations

import base64

from providers.cluster.base import CLIENT_SIGNER, SERVING_SIGNER, csr_decision
from tests.cluster.sim_kubelet import csr_pem


def renewal(name: str, node: str, subject: str | None = None, signer: str = CLIENT_SIGNER) -> dict:
    return {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest", "metadata": {"name": name},
            "spec": {"signerName": signer, "username": f"system:node:{node}", "groups": ["system:nodes"],
                     "usages": ["digital signature", "client auth"],
                     "request": base64.b64encode(csr_pem(f"system:node:{subject or node}", ["system:nodes"])).decode()}}


def test_a_renewal_is_judged_for_live_and_control_plane_nodes_and_denied_for_any_other() -> None:
    def decide(csr, renewable=None):
        return csr_decision(csr, lambda _t: None, {"gpu-live"}.__contains__, lambda _n: None, renewable)

    control_plane = {"cp-1"}.__contains__
    assert decide(renewal("a", "gpu-live"), control_plane).approve
    assert decide(renewal("b", "cp-1"), control_plane).approve
    assert not decide(renewal("c", "cp-1", subject="cp-2"), control_plane).approve, "its own name only"
    retired = decide(renewal("d", "gpu-retired"), control_plane)
    assert not retired.approve and "not renewed" in retired.reason
    # Without the take-over (callers that leave renewals to kubeadm) and for serving CSRs: not ours.
    assert decide(renewal("e", "gpu-retired")) is None
    assert decide(renewal("f", "gpu-retired", signer=SERVING_SIGNER), control_plane) is None



def test_a_denial_says_a_few_of_the_names_a_node_asked_for_each_cut_short() -> None:
    """The names in a CSR are the node's to choose, any number of any length; the denial's reason
    goes onto the CSR, into the approver's result and history and onto every join waiting on the
    pass. Before, it repeated them all: 1,000 names of 200 characters made a 200 KB reason."""
    def decide(csr):
        return csr_decision(csr, lambda _t: None, {"gpu-live"}.__contains__, lambda _n: ["10.0.0.7"])

    long_name = "x" * 5000
    wrong_subject = decide(renewal("a", "gpu-live", subject=long_name))
    assert not wrong_subject.approve and "it asked for 'system:node:xxx" in wrong_subject.reason
    assert len(wrong_subject.reason) < 300, len(wrong_subject.reason)

    names = [f"{i:04d}-" + "y" * 200 for i in range(1000)]
    serving = renewal("b", "gpu-live", signer=SERVING_SIGNER)
    serving["spec"]["usages"] = ["digital signature", "server auth"]
    serving["spec"]["request"] = base64.b64encode(
        csr_pem("system:node:gpu-live", ["system:nodes"], ips=["10.0.0.7"], dns=names)).decode()
    denied = decide(serving)
    assert not denied.approve and "'0000-yyy" in denied.reason and "and 996 more" in denied.reason, denied.reason
    assert len(denied.reason) < 600, len(denied.reason)
