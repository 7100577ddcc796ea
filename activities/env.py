"""What activities reach the world through: config, providers, the cluster.

Built once per worker process. In sim mode every site is a ``SimProvider`` and
the cluster is the ``SimCluster``, both over ``<state-dir>/sim.db``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from fleet.config import FleetConfig, load_config
from fleet.errors import InvalidRequest
from fleet.settings import Settings
from providers import make_provider
from providers.base import Provider
from providers.cluster.base import Cluster
from providers.sim import SimWorld


@dataclass
class FleetEnv:
    settings: Settings
    config: FleetConfig
    cluster: Cluster
    world: SimWorld | None = None
    _providers: dict[str, Provider] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_settings(cls, settings: Settings) -> "FleetEnv":
        config = load_config(settings.config)
        if config.mode == "sim":
            from providers.cluster.sim import SimCluster

            world = SimWorld(settings.sim_db)
            world.seed(config)
            return cls(settings, config, SimCluster(world), world)
        from providers.cluster.kubernetes import KubernetesCluster

        return cls(settings, config, KubernetesCluster(kubeconfig=os.environ.get("KUBECONFIG")))

    def site(self, name: str):
        try:
            return self.config.site(name)
        except KeyError:
            known = ", ".join(s.name for s in self.config.sites)
            raise InvalidRequest(f"site: unknown site {name!r}; known sites: {known}") from None

    def provider(self, site_name: str) -> Provider:
        with self._lock:
            if site_name not in self._providers:
                site = self.site(site_name)
                self._providers[site_name] = make_provider(site, self.config.account_for(site), self.world)
            return self._providers[site_name]

