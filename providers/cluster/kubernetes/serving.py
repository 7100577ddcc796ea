"""A model's replicas at a site: applied, scaled, rolled back, deleted and listed.

Per model and site a Deployment and a Service named
``serving_name(model, site)`` in the adapter's namespace. The pod template we
rendered is kept in the annotation ``gpufleet.io/template`` and the one before
it in ``gpufleet.io/previous-template``; ``rollback_serving`` swaps them.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from fleet.cluster import (
    ANNOTATION_PREVIOUS_TEMPLATE,
    ANNOTATION_TEMPLATE,
    LABEL_MODEL,
    LABEL_SITE,
    ServingSpec,
    ServingStatus,
    template_fingerprint,
)
from providers.cluster.base import ANNOTATION_MODEL, NoPreviousTemplate, ServingNotFound, serving_name
from providers.cluster.base import label_value as _label_value
from providers.cluster.kubernetes.api import MERGE, PROVIDER, KubernetesApi, _canonical, _is_subset, _translate
from providers.cluster.kubernetes.gpu_pods import container_gpus
from providers.cluster.kubernetes.manifests import (
    SERVED_POD_HARDENING, render_deployment, render_model_service, render_pdb, render_service,
)


class Serving(KubernetesApi):
    """The serving port: each model and site's Deployment, Service and PodDisruptionBudget."""

    def _read_deployment(self, name: str) -> dict[str, Any] | None:
        return self._get(f"read deployment {name}", self.apps.read_namespaced_deployment, name, self.namespace)

    def apply_serving(self, spec: ServingSpec) -> ServingStatus:
        desired = render_deployment(spec, self.namespace)
        name = desired["metadata"]["name"]
        template_json = desired["metadata"]["annotations"][ANNOTATION_TEMPLATE]

        def attempt() -> None:
            current = self._read_deployment(name)
            if current is None:
                self._write(f"create deployment {name}", self.apps.create_namespaced_deployment,
                            self.namespace, desired)
                return
            annotations = current["metadata"].get("annotations") or {}
            live = annotations.get(ANNOTATION_TEMPLATE) or _canonical(current["spec"].get("template"))
            if (
                annotations.get(ANNOTATION_TEMPLATE) == template_json
                and current["spec"].get("replicas") == spec.replicas
                and _is_subset(desired["metadata"]["labels"], current["metadata"].get("labels"))
            ):
                return
            body = current
            body["metadata"].setdefault("labels", {}).update(desired["metadata"]["labels"])
            body["metadata"]["annotations"] = {**annotations, ANNOTATION_MODEL: spec.model}
            if live != template_json:
                body["metadata"]["annotations"][ANNOTATION_PREVIOUS_TEMPLATE] = live
                body["metadata"]["annotations"][ANNOTATION_TEMPLATE] = template_json
                body["spec"]["template"] = desired["spec"]["template"]
                body["spec"]["strategy"] = desired["spec"]["strategy"]
            body["spec"]["replicas"] = spec.replicas
            body.pop("status", None)
            self._write(f"update deployment {name}", self.apps.replace_namespaced_deployment,
                        name, self.namespace, body)

        self._retry_on_conflict(f"deployment {name}", attempt)
        self._apply_service(spec.model, spec.site)
        self._apply_pdb(spec.model, spec.site)
        return self._status_or_raise(spec.model, spec.site)

    def serving_template(self, spec: ServingSpec) -> str:
        return template_fingerprint(render_deployment(spec, self.namespace)["metadata"]["annotations"][ANNOTATION_TEMPLATE])

    def _apply_pdb(self, model: str, site: str) -> None:
        desired = render_pdb(model, site, self.namespace)
        name = desired["metadata"]["name"]

        def attempt() -> None:
            current = self._get(f"read poddisruptionbudget {name}",
                                self.policy.read_namespaced_pod_disruption_budget, name, self.namespace)
            if current is None:
                self._write(f"create poddisruptionbudget {name}",
                            self.policy.create_namespaced_pod_disruption_budget, self.namespace, desired)
                return
            if _is_subset(desired["spec"], current.get("spec")):
                return
            patch = {"metadata": {"labels": desired["metadata"]["labels"]}, "spec": desired["spec"]}
            self._do(f"patch poddisruptionbudget {name}", self.policy.patch_namespaced_pod_disruption_budget,
                     name, self.namespace, patch, _content_type=MERGE)

        self._retry_on_conflict(f"poddisruptionbudget {name}", attempt)

    def _apply_service(self, model: str, site: str) -> None:
        self._apply_service_doc(render_service(model, site, self.namespace))
        self._apply_service_doc(render_model_service(model, self.namespace), only_own=True)

    def _apply_service_doc(self, desired: dict[str, Any], only_own: bool = False) -> None:
        name = desired["metadata"]["name"]

        def attempt() -> None:
            current = self._get(f"read service {name}", self.core.read_namespaced_service, name, self.namespace)
            if current is None:
                self._write(f"create service {name}", self.core.create_namespaced_service, self.namespace, desired)
                return
            if only_own and not _same_service(current, desired):
                # "<model>" can be another model's "<model>-<site>": the model-wide Service is a
                # convenience, so it yields rather than take over (and re-route) the other one.
                return
            if _is_subset(desired["spec"], current.get("spec")) and _is_subset(
                desired["metadata"]["labels"], current["metadata"].get("labels")
            ):
                return
            patch = {"metadata": {"labels": desired["metadata"]["labels"]}, "spec": desired["spec"]}
            self._do(f"patch service {name}", self.core.patch_namespaced_service, name, self.namespace, patch,
                     _content_type=MERGE)

        self._retry_on_conflict(f"service {name}", attempt)

    def _status(self, model: str, site: str, deployment: dict[str, Any]) -> ServingStatus:
        meta, spec, status = deployment["metadata"], deployment.get("spec") or {}, deployment.get("status") or {}
        desired = spec.get("replicas", 1)
        containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or [{}]
        generation = meta.get("generation", 0)
        observed = status.get("observedGeneration", 0)
        replicas = status.get("replicas", 0)
        updated = status.get("updatedReplicas", 0)
        available = status.get("availableReplicas", 0)
        return ServingStatus(
            model=model, site=site, name=meta["name"], image=containers[0].get("image", ""),
            desired_replicas=desired, generation=generation, observed_generation=observed,
            replicas=replicas, updated_replicas=updated, available_replicas=available,
            ready=observed >= generation and replicas == updated == available == desired,
            can_rollback=bool((meta.get("annotations") or {}).get(ANNOTATION_PREVIOUS_TEMPLATE)),
            gpus_per_replica=container_gpus(containers[0]),
            # What apply and rollback wrote (the API server defaults fields in the live template).
            template=template_fingerprint((meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE)
                                          or _canonical(spec.get("template"))),
            max_surge=_max_surge(spec),
        )

    def serving_status(self, model: str, site: str) -> ServingStatus | None:
        deployment = self._read_deployment(serving_name(model, site))
        return self._status(model, site, deployment) if deployment else None

    def _status_or_raise(self, model: str, site: str) -> ServingStatus:
        status = self.serving_status(model, site)
        if status is None:
            raise ServingNotFound(f"no serving of {model} at {site}", provider=PROVIDER, code="404")
        return status

    def scale_serving(self, model: str, site: str, replicas: int) -> ServingStatus:
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        name = serving_name(model, site)
        try:
            deployment = self._call(f"scale deployment {name}", self.apps.patch_namespaced_deployment, name,
                                    self.namespace, {"spec": {"replicas": replicas}}, _content_type=MERGE)
        except ApiException as error:
            if error.status == 404:
                raise ServingNotFound(f"no serving of {model} at {site}", provider=PROVIDER, code="404") from error
            raise _translate(error, f"scale deployment {name}") from error
        return self._status(model, site, deployment)

    def rollback_serving(self, model: str, site: str) -> ServingStatus:
        name = serving_name(model, site)

        def attempt() -> ServingStatus:
            current = self._read_deployment(name)
            if current is None:
                raise ServingNotFound(f"no serving of {model} at {site}", provider=PROVIDER, code="404")
            annotations = current["metadata"].get("annotations") or {}
            previous = annotations.get(ANNOTATION_PREVIOUS_TEMPLATE)
            if not previous:
                raise NoPreviousTemplate(f"{name}: no previous template to roll back to", provider=PROVIDER)
            live = annotations.get(ANNOTATION_TEMPLATE) or _canonical(current["spec"].get("template"))
            current["metadata"]["annotations"] = {
                **annotations, ANNOTATION_TEMPLATE: previous, ANNOTATION_PREVIOUS_TEMPLATE: live,
            }
            restored = json.loads(previous)
            # One written before a field of SERVED_POD_HARDENING was there comes back with it. The
            # annotation keeps the template as written, the name a rollout knows it by
            # (RollbackSiteInput.previous_template).
            restored.setdefault("spec", {}).update(SERVED_POD_HARDENING)
            current["spec"]["template"] = restored
            current.pop("status", None)
            deployment = self._write(f"roll back deployment {name}", self.apps.replace_namespaced_deployment,
                                     name, self.namespace, current)
            return self._status(model, site, deployment)

        return self._retry_on_conflict(f"deployment {name}", attempt)

    def delete_serving(self, model: str, site: str) -> None:
        name = serving_name(model, site)
        self._delete(f"delete deployment {name}", self.apps.delete_namespaced_deployment, name, self.namespace)
        self._delete(f"delete service {name}", self.core.delete_namespaced_service, name, self.namespace)
        wide = render_model_service(model, self.namespace)
        name = wide["metadata"]["name"]
        if not any(s.model == model for s in self.list_serving()):  # the model's last site
            current = self._get(f"read service {name}", self.core.read_namespaced_service, name, self.namespace)
            if current is not None and _same_service(current, wide):
                self._delete(f"delete service {name}", self.core.delete_namespaced_service, name, self.namespace)

    def list_serving(self, site: str | None = None) -> list[ServingStatus]:
        selector = "app.kubernetes.io/managed-by=gpufleet"
        if site is not None:
            selector += f",{LABEL_SITE}={_label_value(site)}"
        listed = self._do("list deployments", self.apps.list_namespaced_deployment, self.namespace,
                          label_selector=selector)
        out = []
        for item in listed.get("items") or []:
            meta = item.get("metadata") or {}
            labels = meta.get("labels") or {}
            model = (meta.get("annotations") or {}).get(ANNOTATION_MODEL) or labels.get(LABEL_MODEL, "")
            where = labels.get(LABEL_SITE, "")
            if model and where and (site is None or where == site):
                out.append(self._status(model, where, item))
        return sorted(out, key=lambda s: (s.model, s.site))


def _max_surge(spec: dict[str, Any]) -> int | None:
    """The rolling update's ``maxSurge`` when a number (a percentage, as a Deployment not made
    here may have, is no count of replicas to reason with)."""
    surge = ((spec.get("strategy") or {}).get("rollingUpdate") or {}).get("maxSurge")
    return surge if isinstance(surge, int) else None


def _same_service(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    """``current`` is the Service ``desired`` describes (same model, same selector keys), not
    another object that happens to carry its name."""
    meta = current.get("metadata") or {}
    return ((meta.get("annotations") or {}).get(ANNOTATION_MODEL) == desired["metadata"]["annotations"][ANNOTATION_MODEL]
            and set(((current.get("spec") or {}).get("selector") or {})) == set(desired["spec"]["selector"]))
