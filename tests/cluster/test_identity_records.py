"""Node identity records are cleaned up with their node (issue 24, item 3), in both
cluster implementations: ``remove_node`` deletes the join's record of the node, and
``delete_state`` deletes a state object only while it holds what the caller judged."""

from __future__ import annotations

from fleet.cluster import NODE_IDENTITY_KIND, NodeIdentity


def record(cluster, name: str, machine_id: str) -> NodeIdentity:
    identity = NodeIdentity(node_name=name, machine_id=machine_id, provider="lambda", account="acct-a",
                            site="site-a", provider_id=f"gpufleet://lambda/acct-a/{name}", join_id=f"join/{name}")
    cluster.update_state(NODE_IDENTITY_KIND, name, lambda _old: identity.state())
    return identity


def test_removing_a_node_forgets_its_identity(harness, unique) -> None:
    cluster = harness.cluster
    gone, kept = f"gpu-{unique}-a", f"gpu-{unique}-b"
    for name in (gone, kept):
        harness.add_node(name)
        record(cluster, name, f"m-{name}")
    assert cluster.node_identity(gone).machine_id == f"m-{gone}"

    cluster.remove_node(gone)
    assert cluster.get_node(gone) is None and cluster.node_identity(gone) is None
    assert set(cluster.list_state(NODE_IDENTITY_KIND)) == {kept}, "only that node's record"
    assert cluster.node_identity(kept).machine_id == f"m-{kept}"
    cluster.remove_node(gone)  # again: nothing left, and that is success


def test_delete_state_only_if_unchanged(harness) -> None:
    cluster = harness.cluster
    judged = record(cluster, "n1", "m-1").state()
    record(cluster, "n1", "m-2")  # written again after it was judged
    assert cluster.delete_state(NODE_IDENTITY_KIND, "n1", only_if=judged) is False
    assert cluster.node_identity("n1").machine_id == "m-2"
    assert cluster.delete_state(NODE_IDENTITY_KIND, "n1", only_if=cluster.read_state(NODE_IDENTITY_KIND, "n1"))
    assert cluster.read_state(NODE_IDENTITY_KIND, "n1") == {}
    assert cluster.delete_state(NODE_IDENTITY_KIND, "n1") is False, "a gone object: nothing deleted, no error"


def test_a_node_listed_by_its_site_carries_the_joins_record(harness, unique) -> None:
    """A label selector narrows the list; each node in it still reads as the join recorded it."""
    from fleet.cluster import LABEL_SITE

    cluster = harness.cluster
    name, other = f"gpu-{unique}-a", f"gpu-{unique}-b"
    harness.add_node(name, site="site-a")
    harness.add_node(other, site="site-b")
    record(cluster, name, f"m-{name}")
    listed = {n.name: n for n in cluster.list_nodes({LABEL_SITE: "site-a"})}
    assert other not in listed
    assert listed[name].machine_id == f"m-{name}" and listed[name].account == "acct-a"
