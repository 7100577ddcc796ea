"""The control plane reads no Secret in kube-system (its RBAC no longer lets it: kubeadm's
tokens and every other kube-system credential stay out of its reach). A retried join renders
the same token from its record and the derived secret; revocation and the CSR approver go by
the records too."""

from __future__ import annotations

import base64

from providers.cluster.kubernetes import JOIN_TOKEN_KIND, TOKEN_NAMESPACE


def kube_system_reads(fake) -> list:
    return [r for r in fake.requests if r[0] in ("get", "list", "watch") and r[2] == "secrets"
            and r[4] == TOKEN_NAMESPACE]


def test_a_retried_join_gets_the_same_token_without_reading_kube_system(kube, fake) -> None:
    first = kube.issue_bootstrap_token("gpu-1", "join/site-a/abc", 3600)
    again = kube.issue_bootstrap_token("gpu-1", "join/site-a/abc", 3600)
    assert (again.token_id, again.secret, again.expires_at) == (first.token_id, first.secret, first.expires_at)
    stored = fake.get("", "secrets", TOKEN_NAMESPACE, f"bootstrap-token-{first.token_id}")
    assert base64.b64decode(stored["data"]["token-secret"]).decode() == first.secret, "what the API server checks"
    other = kube.issue_bootstrap_token("gpu-2", "join/site-a/def", 3600)
    assert other.token_id != first.token_id and other.secret != first.secret
    record = kube.read_state(JOIN_TOKEN_KIND, first.token_id)
    assert record["node-name"] == "gpu-1" and first.secret not in str(record), "the record holds no secret"
    assert kube_system_reads(fake) == []


def test_the_approver_and_revocation_go_by_the_records(kube, fake) -> None:
    token = kube.issue_bootstrap_token("gpu-1", "join/site-a/abc", 3600)
    assert kube._token_node(token.token_id, {}) == "gpu-1"
    assert kube._token_node("zzzzzz", {}) is None, "a token gpufleet did not issue (kubeadm's) is not ours"
    assert kube.revoke_node_tokens("gpu-1") == [token.token_id]
    assert fake.get("", "secrets", TOKEN_NAMESPACE, f"bootstrap-token-{token.token_id}") is None
    assert kube.read_state(JOIN_TOKEN_KIND, token.token_id) == {}
    assert kube._token_node(token.token_id, {}) is None, "a revoked token is no longer approved"
    assert kube_system_reads(fake) == []
