"""``gpufleet config check``'s warnings for ``mode: real``: what the file allows but a real
fleet would trip over (sites whose machines boot a stock image without kubeadm); and, against the
fleet running now (``--fleet``), the sites it drops while the cluster still has nodes there."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from fleet.cluster import LABEL_SITE, NODE_IDENTITY_KIND, NodeIdentity
from fleet.config import FleetConfig, stock_images
from fleet.models import Node
from providers.cluster.bootstrap import BootstrapError, load_node_install, node_install_path

RECIPE = "deploy/bootstrap/README.md, \"An image with the pinned parts\""


def stock_image_warnings(config: FleetConfig) -> list[str]:
    """One line per site on a stock image, saying what its machines will do at first boot."""
    try:
        pins = load_node_install()
        unpinned = pins.unpinned("amd64")
    except BootstrapError as error:
        pins, unpinned = None, [str(error)]
    warnings = []
    for stock in stock_images(config):
        said = f"{stock.where}: {stock.image} is a stock {stock.provider} image without {' or '.join(stock.lacks)}"
        if "the NVIDIA driver" in stock.lacks:
            warnings.append(f"{said}: its machines stop before `kubeadm join` (the install step builds no "
                            f"driver); use a prepared image ({RECIPE})")
        elif unpinned:
            missing = f"pins no sha256 for {', '.join(unpinned)}" if pins is not None else f"is unusable ({unpinned[0]})"
            instead = "Lambda boots only its own images" if stock.provider == "lambda" \
                else f"or use a prepared image ({RECIPE})"
            warnings.append(f"{said}: its machines stop before `kubeadm join` when they lack one of those parts, "
                            f"since {node_install_path()} {missing}; pin them ({instead})")
        else:
            sooner = "" if stock.provider == "lambda" else f"; a prepared image ({RECIPE}) joins sooner"
            warnings.append(f"{said}: its machines install kubelet, kubeadm and containerd at first boot "
                            f"(minutes per join, downloads from dl.k8s.io and GitHub){sooner}")
    return warnings


# -- a config against the fleet running now ---------------------------------------------------
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


class FleetUnreadable(Exception):
    """The fleet running now could not be read; the message says why, in one line."""


def fleet_now(config: FleetConfig, state_dir: Path, kubeconfig: str | None, context: str | None,
              namespace: str) -> tuple[list[Node], dict[str, dict[str, str]]]:
    """The nodes and node identity records of the fleet running now, where ``config``'s mode keeps
    them: the simulated fleet in ``state_dir`` (not seeded with ``config``, which is not applied
    yet), or the cluster at ``kubeconfig``."""
    try:
        if config.mode == "sim":
            from cli.common import settings
            from sim.cluster import SimCluster
            from sim.world import SimWorld

            db = settings(state_dir=state_dir).sim_db
            if not db.exists():
                raise FleetUnreadable(f"no simulated fleet at {db} (--state-dir)")
            cluster = SimCluster(SimWorld(db))
        else:
            from providers.cluster.kubernetes import KubernetesCluster

            cluster = KubernetesCluster(kubeconfig=kubeconfig, context=context, namespace=namespace)
        return cluster.list_nodes(), cluster.list_state(NODE_IDENTITY_KIND)
    except FleetUnreadable:
        raise
    except Exception as error:  # noqa: BLE001 - no kubeconfig, unreachable, refused: one line
        raise FleetUnreadable(f"cannot read the fleet running now: {type(error).__name__}: {error}"
                              .splitlines()[0]) from None
