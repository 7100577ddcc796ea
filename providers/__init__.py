"""Adapters to the outside world: one module per GPU provider, and the cluster.

``make_provider`` picks the adapter for a site: the simulated provider in sim
mode, otherwise the provider's own module (imported only when used, so a
fleet without Nebius never imports its SDK).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleet.config import Account, Site
    from providers.base import Provider
    from providers.sim import SimWorld

ADAPTERS = {
    "aws": "providers.aws:AwsProvider",
    "lambda": "providers.lambda_cloud:LambdaProvider",
    "nebius": "providers.nebius:NebiusProvider",
    "hetzner": "providers.hetzner:HetznerProvider",
    "own-dc": "providers.own_dc:OwnDcProvider",
}


def make_provider(site: "Site", account: "Account", world: "SimWorld | None" = None) -> "Provider":
    if world is not None:
        from providers.sim import SimProvider

        return SimProvider(site, account, world)
    module, _, cls = ADAPTERS[site.provider].partition(":")
    return getattr(import_module(module), cls)(site, account)
