"""Routing: the weights of each model's sites at the front door, and the fleet-wide site routes.

Per model one Gateway API ``HTTPRoute`` (``<model>``, one
backendRef per site Service, weighted) and the ConfigMap ``gpufleet-routing``
(key ``<model>``: JSON ``{"model", "version", "sites": {site: {weight,
healthy, draining, incident}}}``). Each is written by one
resourceVersion-checked replace, and only when its content changes.
"""

from __future__ import annotations

import json
from typing import Any

from fleet.cluster import SITE_ROUTES, RoutingTable, SiteRoute
from providers.cluster.base import GATEWAY_GROUP, GATEWAY_VERSION, WeightedRouting, dns_label
from providers.cluster.envoy_gateway import (
    ENVOY_GROUP,
    ENVOY_VERSION,
    render_backend_traffic_policy,
    render_httproute,
    render_httproute_spec,
)
from providers.cluster.kubernetes.api import KubernetesApi, _canonical, _is_subset

ROUTING_CONFIGMAP = "gpufleet-routing"


class Routing(KubernetesApi, WeightedRouting):
    """The routing port (``set_routing_weights`` comes from ``WeightedRouting``)."""

    def store_routes(self, model: str, sites: dict[str, SiteRoute]) -> RoutingTable:
        self._write_httproute(model, sites)
        self._write_backend_traffic_policy(model)
        return self._write_routing_table(model, sites)

    def _write_backend_traffic_policy(self, model: str) -> None:
        """Envoy Gateway's policy on the model's HTTPRoute: sessions stick to their site, and
        only a request that got no response byte is retried (HTTPRoute alone can say neither)."""
        body = render_backend_traffic_policy(model, self.namespace)
        name = body["metadata"]["name"]
        args = (ENVOY_GROUP, ENVOY_VERSION, self.namespace, "backendtrafficpolicies")

        def attempt() -> None:
            current = self._get(f"read backendtrafficpolicy {name}", self.custom.get_namespaced_custom_object,
                                *args, name)
            if current is None:
                self._write(f"create backendtrafficpolicy {name}", self.custom.create_namespaced_custom_object,
                            *args, body)
                return
            if _is_subset(body["spec"], current.get("spec")):
                return
            current["spec"] = body["spec"]
            current.pop("status", None)
            self._write(f"update backendtrafficpolicy {name}", self.custom.replace_namespaced_custom_object,
                        *args, name, current)

        self._retry_on_conflict(f"backendtrafficpolicy {name}", attempt)

    def _write_httproute(self, model: str, sites: dict[str, SiteRoute]) -> None:
        name = dns_label(model)
        spec = render_httproute_spec(model, sites, self.gateway, self.gateway_namespace)
        args = (GATEWAY_GROUP, GATEWAY_VERSION, self.namespace, "httproutes")

        def attempt() -> None:
            current = self._get(f"read httproute {name}", self.custom.get_namespaced_custom_object, *args, name)
            if current is None:
                body = render_httproute(model, sites, self.namespace, self.gateway, self.gateway_namespace)
                self._write(f"create httproute {name}", self.custom.create_namespaced_custom_object, *args, body)
                return
            if _is_subset(spec, current.get("spec")):
                return
            current["spec"] = spec
            current.pop("status", None)
            self._write(f"update httproute {name}", self.custom.replace_namespaced_custom_object,
                        *args, name, current)

        self._retry_on_conflict(f"httproute {name}", attempt)

    def _read_routing_configmap(self) -> dict[str, Any] | None:
        return self._get("read routing table", self.core.read_namespaced_config_map, ROUTING_CONFIGMAP, self.namespace)

    def _write_routing_table(self, model: str, sites: dict[str, SiteRoute], key: str | None = None) -> RoutingTable:
        key = key or dns_label(model)
        wanted = {site: route.model_dump() for site, route in sorted(sites.items())}

        def attempt() -> RoutingTable:
            current = self._read_routing_configmap()
            entry = _routing_entry(current, key)
            if entry is not None and entry.get("sites") == wanted:
                return RoutingTable(model=model, version=entry["version"], sites=sites)
            version = (entry or {}).get("version", 0) + 1
            value = _canonical({"model": model, "version": version, "sites": wanted})
            if current is None:
                body = {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {
                        "name": ROUTING_CONFIGMAP,
                        "namespace": self.namespace,
                        "labels": {"app.kubernetes.io/managed-by": "gpufleet"},
                    },
                    "data": {key: value},
                }
                self._write("create routing table", self.core.create_namespaced_config_map, self.namespace, body)
            else:
                current["data"] = {**(current.get("data") or {}), key: value}
                self._write("update routing table", self.core.replace_namespaced_config_map,
                            ROUTING_CONFIGMAP, self.namespace, current)
            return RoutingTable(model=model, version=version, sites=sites)

        return self._retry_on_conflict("routing table", attempt)

    def get_routing(self, model: str) -> RoutingTable | None:
        entry = _routing_entry(self._read_routing_configmap(), dns_label(model))
        if entry is None:
            return None
        sites = {site: SiteRoute.model_validate(route) for site, route in entry.get("sites", {}).items()}
        return RoutingTable(model=model, version=entry["version"], sites=sites)

    def set_site_routes(self, sites: dict[str, SiteRoute]) -> RoutingTable:
        # One key of the routing ConfigMap; a leading underscore is never a model's DNS label.
        return self._write_routing_table(SITE_ROUTES, dict(sites), key=SITE_ROUTES)

    def get_site_routes(self) -> RoutingTable | None:
        entry = _routing_entry(self._read_routing_configmap(), SITE_ROUTES)
        if entry is None:
            return None
        sites = {site: SiteRoute.model_validate(route) for site, route in entry.get("sites", {}).items()}
        return RoutingTable(model=SITE_ROUTES, version=entry["version"], sites=sites)


def _routing_entry(configmap: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    if configmap is None:
        return None
    raw = (configmap.get("data") or {}).get(key)
    if not raw:
        return None
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("version"), int) else None
