"""gpufleet's approver judges every node's client-certificate renewal, so kubeadm's
``kubeadm:node-autoapprove-certificate-rotation`` can be removed: a live gpufleet node (its
identity record) and a control-plane node (the label NodeRestriction keeps kubelets from
setting) are renewed for their own name; any other node, a removed one above all, is denied.
The adapter's verdicts on CSRs made as the node against a real control plane:
tests/realk8s/test_adapter_objects.py (and with a real kubelet, tests/realk8s/test_blast_radius.py)."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest

from providers.cluster.base import CLIENT_SIGNER, SERVING_SIGNER, csr_decision
from tests.cluster.sim_kubelet import csr_pem

REPO = Path(__file__).resolve().parents[2]


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



#: The approver's judgement of ten CSRs whose common names differ in length, in a process of its
#: own (as the control plane's worker imports the approver: pytest resets warning filters per test).
OVER_LONG_NAMES = """
import warnings
from providers.cluster.base import csr_decision
from tests.cluster.test_csr_renewals import renewal
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # making them (the test's helper) is not what is checked
    csrs = [renewal(f"r{n}", "gpu-live", subject="x" * n) for n in range(5000, 5010)]
for csr in csrs:
    assert not csr_decision(csr, lambda _t: None, {"gpu-live"}.__contains__, lambda _n: ["10.0.0.7"]).approve
import providers.cluster.base as base
print(len([key for key in getattr(base, "__warningregistry__", {}) if key != "version"]))
"""


@pytest.mark.integration  # a Python process of its own
def test_over_long_names_a_node_writes_leave_no_warning_behind() -> None:
    """cryptography warns of each over-long name it reads in a CSR's subject, the length in its
    message, and Python prints a warning once per distinct message and keeps it in a registry: ten
    CSRs whose common names differ in length put 30 warnings in the worker's log (three reads
    each) and 30 entries in its memory, as many more as a node posts. None now; each is denied."""
    run = subprocess.run([sys.executable, "-c", OVER_LONG_NAMES], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "UserWarning" not in run.stderr and run.stdout.split() == ["0"], (run.stdout, run.stderr[-2000:])
