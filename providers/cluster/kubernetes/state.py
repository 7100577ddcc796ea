"""The control plane's durable records in the cluster (join tokens, node identities and keys,
whatever the workflows keep), and what a backup reads of them.

Control-plane state (``read_state``/``update_state``/``list_state``/``delete_state``): one
ConfigMap per (kind, key), ``state_object_name(kind, key)`` in the adapter's
namespace, label ``gpufleet.io/state=<kind>``, the key in the annotation
``gpufleet.io/state-key``. Every write is a create (409 AlreadyExists: someone
else created it first) or a replace under the resourceVersion read (409
Conflict: someone else wrote first); either way the object is read again and
the change applied again, so two writers never lose each other's change.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from providers.cluster.base import StateChange, check_state_data, state_object_name
from providers.cluster.base import label_value as _label_value
from providers.cluster.kubernetes.api import KubernetesApi, _translate

#: Control-plane state ConfigMaps: their kind (label) and their key as the caller spelled it.
LABEL_STATE = "gpufleet.io/state"
ANNOTATION_STATE_KEY = "gpufleet.io/state-key"


class ControlPlaneState(KubernetesApi):
    """The state port (the module doc says how it is kept)."""

    def _read_state_object(self, name: str) -> dict[str, Any] | None:
        return self._get(f"read state {name}", self.core.read_namespaced_config_map, name, self.namespace)

    def read_state(self, kind: str, key: str) -> dict[str, str]:
        current = self._read_state_object(state_object_name(kind, key))
        return dict((current or {}).get("data") or {})

    def update_state(self, kind: str, key: str, change: StateChange) -> dict[str, str]:
        name = state_object_name(kind, key)

        def attempt() -> dict[str, str]:
            current = self._read_state_object(name)
            data = dict((current or {}).get("data") or {})
            wanted = change(dict(data))
            if wanted is None or (current is not None and wanted == data):
                return data
            check_state_data(wanted)
            if current is None:
                body = {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {
                        "name": name,
                        "namespace": self.namespace,
                        "labels": {"app.kubernetes.io/managed-by": "gpufleet", LABEL_STATE: _label_value(kind)},
                        "annotations": {ANNOTATION_STATE_KEY: key},
                    },
                    "data": wanted,
                }
                self._write(f"create state {name}", self.core.create_namespaced_config_map, self.namespace, body)
            else:
                # ``current`` carries the resourceVersion read above: a write in between answers 409.
                current["data"] = wanted
                self._write(f"update state {name}", self.core.replace_namespaced_config_map,
                            name, self.namespace, current)
            return wanted

        return self._retry_on_conflict(f"state {name}", attempt)

    def list_state(self, kind: str) -> dict[str, dict[str, str]]:
        listed = self._do("list state", self.core.list_namespaced_config_map, self.namespace,
                          label_selector=f"{LABEL_STATE}={_label_value(kind)}")
        out: dict[str, dict[str, str]] = {}
        for item in listed.get("items") or []:
            meta = item.get("metadata") or {}
            key = (meta.get("annotations") or {}).get(ANNOTATION_STATE_KEY)
            # The label is shortened; the name is exact: only objects of exactly this kind.
            if key is not None and meta.get("name") == state_object_name(kind, key):
                out[key] = dict(item.get("data") or {})
        return out

    def delete_state(self, kind: str, key: str, only_if: dict[str, str] | None = None) -> bool:
        name = state_object_name(kind, key)
        if only_if is None:
            return self._delete(f"delete state {name}", self.core.delete_namespaced_config_map, name, self.namespace)
        current = self._read_state_object(name)
        if current is None or dict(current.get("data") or {}) != only_if:
            return False
        # Under the resourceVersion read: a write in between answers 409 and wins.
        precondition = {"preconditions": {"resourceVersion": current["metadata"]["resourceVersion"]}}
        try:
            self._call(f"delete state {name}", self.core.delete_namespaced_config_map, name, self.namespace,
                       body=precondition)
        except ApiException as error:
            if error.status in (404, 409):
                return False
            raise _translate(error, f"delete state {name}") from error
        return True

    # -- backup (cli/backup.py) ---------------------------------------------------------------
    def state_origin(self) -> dict[str, str]:
        return {"cluster": self.api_client.configuration.host, "namespace": self.namespace}

    def state_kinds(self) -> list[str]:
        # One list of the state ConfigMaps (the label exists, whatever its value): what
        # ``list_state`` of each kind would read, in one call the control plane's RBAC allows.
        listed = self._do("list state", self.core.list_namespaced_config_map, self.namespace,
                          label_selector=LABEL_STATE)
        kinds = {((item.get("metadata") or {}).get("labels") or {}).get(LABEL_STATE, "")
                 for item in listed.get("items") or []}
        return sorted(kind for kind in kinds if kind)
