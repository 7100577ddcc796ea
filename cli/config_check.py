"""``gpufleet config check``'s warnings for ``mode: real``: what the file allows but a real
fleet would trip over. Today: sites whose machines boot a stock image without kubeadm."""

from __future__ import annotations

from fleet.config import FleetConfig, stock_images
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
