"""``gpufleet config check``'s warnings for ``mode: real``: what the file allows but a real
fleet would trip over (sites whose machines boot a stock image without kubeadm, spot sites whose
machines post no reclaim notice, a driver reinstall the base's node agent may not run); and,
against the fleet running now (``--fleet``), the sites it drops while the cluster still has
nodes there."""

from __future__ import annotations

from pathlib import Path

from fleet.cluster import NODE_IDENTITY_KIND
from fleet.config import FleetConfig, stock_images
from fleet.models import CapacityType, Node
from fleet.repair_policy import DRIVER_REINSTALL_SCRIPT
from providers.cluster.bootstrap import BootstrapError, load_node_install, node_install_path
from workers.reclaim_watch import SOURCES as SPOT_NOTICE_SOURCES

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


def unannounced_spot_warnings(config: FleetConfig) -> list[str]:
    """One line per spot site whose provider's machines post no reclaim notice the node agent can
    read (Nebius): its machines are taken without the drain ahead that SpotReclaim gives."""
    return [f"sites[{i}] ({site.name}).capacity_type: spot at a {site.provider} site, whose preempted machines "
            f"post no reclaim notice the node agent can read: no SpotReclaim drains one ahead, it goes NotReady "
            f"unannounced and is replaced only at the next site sweep (docs/concepts/capacity.md, "
            f"\"Spot without a notice\")"
            for i, site in enumerate(config.sites)
            if site.capacity_type == CapacityType.SPOT and site.provider not in SPOT_NOTICE_SOURCES]


def node_key_warnings(config: FleetConfig) -> list[str]:
    """One line per site whose store's key is a Secret and names no key for its nodes: its serving
    pods pull weights with the node's own role, or fail to (a node is never given the control
    plane's key, which writes and deletes every version there)."""
    return [f"sites[{i}] ({site.name}).object_store: no pull_credentials: its nodes are given no key to the "
            f"store (never its credentials, which write and delete the weights every node there loads), so "
            f"their weights pull uses the machine's own role or fails; name a read-only key in a Secret of its "
            f"own (docs/production/index.md, \"The weights store's keys\")"
            for i, site in enumerate(config.sites)
            if site.object_store is not None and site.object_store.credentials is not None
            and site.object_store.credentials.secret and site.object_store.pull_credentials is None]


def driver_reinstall_warnings(config: FleetConfig) -> list[str]:
    """One line where the repair ladder reinstalls drivers on the node (``reinstall_via: agent``):
    the node agent runs its node image's script only where its DaemonSet allows it, which the
    shipped one does not without deploy/driver-reinstall, and only on images that carry the
    script; where either is missing, the rung fails at every node and the ladder climbs past it."""
    if config.repair.reinstall_via != "agent":
        return []
    sites = ", ".join(site.name for site in config.sites) or "none yet"
    return [f"repair.reinstall_via: agent: a driver reinstall runs {DRIVER_REINSTALL_SCRIPT} of the node's own "
            f"image, in the host's namespaces, which the node agent may do only with the component "
            f"deploy/driver-reinstall (Helm: nodeAgent.driverReinstall=true; it makes every agent privileged); "
            f"without it, or on an image without the script, the rung fails and the ladder climbs past it "
            f"(to replacing the machine, where max_rung allows). Every site's image needs the script "
            f"(sites: {sites}; deploy/bootstrap/README.md, \"Driver reinstall\")"]


# -- a config against the fleet running now ---------------------------------------------------
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
