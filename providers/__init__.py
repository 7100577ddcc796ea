"""Adapters to the outside world: one module per GPU provider, and the cluster.

``make_provider`` picks the adapter for a site: the provider's own module (imported only
when used, so a fleet without Nebius never imports its SDK). The simulated provider is not
among them: ``sim/``, chosen by ``FleetEnv`` in sim mode.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleet.config import Account, Site
    from providers.base import Provider

ADAPTERS = {
    "aws": "providers.aws:AwsProvider",
    "lambda": "providers.lambda_cloud:LambdaProvider",
    "nebius": "providers.nebius:NebiusProvider",
    "hetzner": "providers.hetzner:HetznerProvider",
    "own-dc": "providers.own_dc:OwnDcProvider",
}


def make_provider(site: "Site", account: "Account") -> "Provider":
    module, _, cls = ADAPTERS[site.provider].partition(":")
    return getattr(import_module(module), cls)(site, account)
