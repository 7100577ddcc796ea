"""What activities reach the world through: config, providers, the cluster.

Built once per worker process. In sim mode every site is a ``SimProvider`` and
the cluster is the ``SimCluster``, both over ``<state-dir>/sim.db``. In real mode
the control plane keeps no state on local disk: the account guard, queued deletes
and own-rack allocations live in the cluster (``Cluster.update_state``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from activities.address_memo import AddressMemo
from activities.ready_flaps import ReadyFlaps
from fleet.cluster import LABEL_SITE
from fleet.config import FleetConfig, load_config
from fleet.errors import AccountRevoked, InvalidRequest, NotFound, OfferBlocked
from fleet.models import AccountState, Node
from fleet.settings import Settings
from providers import make_provider
from providers.base import Provider
from providers.cluster.base import Cluster

if TYPE_CHECKING:
    from sim.world import SimWorld
    from activities.account_store import AccountStore, ClusterAccountStore


@dataclass
class FleetEnv:
    settings: Settings
    config: FleetConfig
    cluster: Cluster
    world: "SimWorld | None" = None
    _providers: dict[str, Provider] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _accounts: "AccountStore | ClusterAccountStore | None" = None
    #: Each node's machine addresses as its provider reported them, kept across CSR passes.
    address_memo: AddressMemo = field(default_factory=AddressMemo)
    #: Each node's Ready changes as the site watches saw them: a node flipping its own is taken as NotReady.
    ready_flaps: ReadyFlaps = field(default_factory=ReadyFlaps)

    @classmethod
    def from_settings(cls, settings: Settings) -> "FleetEnv":
        config = load_config(settings.config)
        if config.mode == "sim":
            from sim.cluster import SimCluster
            from sim.world import SimWorld

            world = SimWorld(settings.sim_db)
            world.seed(config)
            return cls(settings, config, SimCluster(world), world)
        from providers.cluster.kubernetes import KubernetesCluster

        return cls(settings, config, KubernetesCluster(kubeconfig=os.environ.get("KUBECONFIG")))

    def nodes(self, selector: dict[str, str] | None = None) -> "list[Node]":
        """The cluster's nodes, each believed to have no more GPUs than the config says a machine
        at its site has (``Node.believed``): what every count of capacity must read."""
        most = {s.name: s.gpus_per_machine for s in self.config.sites}
        return [n.believed(most.get(n.site or n.labels.get(LABEL_SITE, ""))) for n in self.cluster.list_nodes(selector)]

    def site(self, name: str):
        try:
            return self.config.site(name)
        except KeyError:
            known = ", ".join(s.name for s in self.config.sites)
            raise InvalidRequest(f"site: unknown site {name!r}; known sites: {known}") from None

    @property
    def accounts(self) -> "AccountStore | ClusterAccountStore":
        """The account guard's store (see activities.account_store for where it lives)."""
        from activities.account_store import AccountStore, ClusterAccountStore

        with self._lock:
            if self._accounts is None:
                if self.world is not None:
                    self._accounts = AccountStore(self.settings.sim_db)
                else:
                    self._accounts = ClusterAccountStore(self.cluster)
            return self._accounts

    def check_account(self, site_name: str, instance_type: str | None = None) -> None:
        """Raise before any provider call to an account a person must fix first."""
        site = self.site(site_name)
        record = self.accounts.get(site.account)
        if record.state == AccountState.CREDENTIALS_REVOKED:
            raise AccountRevoked(
                f"account {site.account}: credentials revoked; no calls until a person rotates them",
                provider=site.provider, code="gpufleet/account-revoked",
            )
        if instance_type is not None and f"{site.name}/{instance_type}" in record.blocked_offers:
            raise OfferBlocked(
                f"account {site.account}: over quota for {instance_type} at {site.name}; waiting for a person",
                provider=site.provider, code="gpufleet/quota-blocked",
            )

    def delete_machine(self, site_name: str, machine_id: str) -> bool:
        """Delete the machine, or queue the delete while its account is revoked (rule 6:
        no call of any kind; the ProviderAccount entity runs the queue once the
        credentials are rotated). True when it was deleted now, False when queued."""
        site = self.site(site_name)
        if self.accounts.get(site.account).state == AccountState.CREDENTIALS_REVOKED:
            self.accounts.queue_delete(site.name, site.account, machine_id)
            return False
        self.provider(site.name).delete_machine(machine_id)
        return True

    def machine_gone(self, site_name: str, machine_id: str) -> bool:
        """Whether the machine has left already: the provider no longer knows it or has it
        terminated (deleted, reclaimed), or its delete is queued while its account is revoked.
        A revoked account's machine with no delete queued is not asked after (rule 6): not gone."""
        site = self.site(site_name)
        if self.accounts.get(site.account).state == AccountState.CREDENTIALS_REVOKED:
            return any(p.machine_id == machine_id for p in self.accounts.pending_deletes(site.account))
        try:
            return self.provider(site.name).get_machine(machine_id).state == "terminated"
        except NotFound:
            return True

    def provider(self, site_name: str, *, guard: bool = True) -> Provider:
        if guard:
            self.check_account(site_name)
        with self._lock:
            if site_name not in self._providers:
                site = self.site(site_name)
                account = self.config.account_for(site)
                if self.world is not None:
                    from sim.provider import SimProvider

                    self._providers[site_name] = SimProvider(site, account, self.world)
                elif site.provider == "own-dc":
                    # Which rack machine is allocated lives in the cluster, not on this pod's disk.
                    from providers.own_dc import ClusterAllocations, OwnDcProvider

                    allocations = ClusterAllocations(self.cluster, account.name)
                    self._providers[site_name] = OwnDcProvider(site, account, allocations)
                else:
                    self._providers[site_name] = make_provider(site, account)
            return self._providers[site_name]

