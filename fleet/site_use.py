"""What the cluster still has at a site: what ``gpufleet config check --fleet`` refuses to drop, and
what keeps a Site entity whose site the config no longer names running (``site_configured``); and
what a site can take, which refuses a join before anything is bought (``join_refusal``)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fleet.cluster import LABEL_SITE, NodeIdentity
from fleet.config import FleetConfig, Site
from fleet.models import Node


#: Where the procedure that empties a site before it leaves the config is.
PROCEDURE = 'docs/operations.md, "Changing the fleet config"'


@dataclass(frozen=True)
class SiteInUse:
    """What the cluster still has at one site: nodes labelled for it (or whose join recorded it),
    and identity records of nodes no longer in the cluster, whose machines may still be billed."""

    site: str
    nodes: tuple[str, ...] = ()
    gone: tuple[tuple[str, str], ...] = ()  # (node, machine)


def sites_in_use(nodes: list[Node], records: dict[str, dict[str, str]] | None = None) -> dict[str, SiteInUse]:
    """Each site the cluster's ``nodes`` and node identity ``records`` name, with what is there.
    A node's site is its control-plane label (NodeRestriction keeps a kubelet from writing it),
    else its join's record."""
    identities = {name: NodeIdentity.from_state(data) for name, data in (records or {}).items()}
    at: dict[str, set[str]] = defaultdict(set)
    gone: dict[str, set[tuple[str, str]]] = defaultdict(set)
    present = {n.name for n in nodes}
    for node in nodes:
        identity = identities.get(node.name)
        site = node.labels.get(LABEL_SITE) or (identity.site if identity else "")
        if site:
            at[site].add(node.name)
    for name, identity in identities.items():
        if identity is not None and name not in present:
            gone[identity.site].add((name, identity.machine_id))
    return {site: SiteInUse(site, tuple(sorted(at[site])), tuple(sorted(gone[site])))
            for site in sorted(set(at) | set(gone))}


def removed_sites_in_use(config: FleetConfig, nodes: list[Node],
                         records: dict[str, dict[str, str]] | None = None) -> list[SiteInUse]:
    """The sites the cluster still has nodes or identity records at that ``config`` does not name:
    applied, nothing would reconcile, sweep or count their machines, which stay billed."""
    named = {s.name for s in config.sites}
    return [use for site, use in sites_in_use(nodes, records).items() if site not in named]


def _some(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def removed_site_refusal(use: SiteInUse, file: str) -> str:
    """Why a config without ``use.site`` may not be applied yet, and what to do instead."""
    held = []
    if use.nodes:
        held.append(f"{len(use.nodes)} node(s) there ({_some(list(use.nodes))})")
    if use.gone:
        held.append(f"the identity record(s) of {len(use.gone)} node(s) no longer in the cluster, whose machines "
                    f"may still be billed ({_some([f'{node}: machine {machine}' for node, machine in use.gone])})")
    return (f"{use.site}: not in {file}, but the cluster still has {' and '.join(held)}. Without the site in the "
            "config nothing reconciles, sweeps or counts them, and their machines are billed until deleted by hand: "
            f"the config must name {use.site}, with min_nodes: 0 and max_nodes: 0, until it has none; then remove "
            f"it ({PROCEDURE})")


def over_max_nodes(site: Site, count: int) -> str | None:
    """Why ``count`` nodes can never join at ``site``, or None: more than its ``max_nodes`` (0 for a
    site being emptied), which its Site entity retires down to whatever the cluster holds, so each
    machine past it is bought for nothing. NodeJoin's own check and the client's, in one wording."""
    if count > site.max_nodes:
        return f"{count} is more than {site.name}'s max_nodes ({site.max_nodes})"
    return None


def join_refusal(config: FleetConfig, site: str, count: int, have: int | None = None) -> tuple[str, str] | None:
    """``(field, message)`` refusing a join of ``count`` nodes at ``site`` before anything starts, or
    None: an unknown site (``site``), or more nodes than it can take (``count``): more than its
    ``max_nodes``; given ``have``, the nodes the cluster has there now, more than the room left.

    ``gpufleet join`` passes ``have`` (it reads the cluster, and says the numbers to the person at
    the terminal, who can raise max_nodes or remove a node first); the client does not (it reads no
    cluster), and NodeJoin checks ``max_nodes`` alone (``over_max_nodes``): a count taken at the
    start is stale by the time the machine registers (a node retired, reclaimed or replaced
    meanwhile), and the Site entity retires whatever is above the max."""
    try:
        where = config.site(site)
    except KeyError:
        return "site", f"unknown site {site!r}; known: {', '.join(s.name for s in config.sites)}"
    if have is None:
        over = over_max_nodes(where, count)
        return ("count", over) if over else None
    room = max(where.max_nodes - have, 0)
    if count > room:
        return "count", (f"{site} can take {room} more node(s) (max_nodes {where.max_nodes}, {have} there now); "
                         f"asked for {count}")
    return None
