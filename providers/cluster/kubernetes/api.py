"""The Kubernetes API as every job of the adapter calls it: the client (``load_api_client``),
the plumbing of one call (JSON in and out, a timeout, a 409 retried) and the fleet's error
taxonomy for what the API server answers.

Every call goes through the generated client (paths, auth, TLS, kubeconfig) but
reads and writes plain JSON (``_preload_content=False``), so fields newer than
the client's models survive a read-modify-write.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any, Callable, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from fleet.errors import ClusterConflict, ClusterError, ClusterForbidden, ClusterInvalid, NotFound, Transient
from fleet.settings import ControlPlaneEnv

PROVIDER = "kubernetes"
#: The namespace of the bootstrap channel and the join token key (the adapter's default).
BOOTSTRAP_NAMESPACE = "gpufleet-bootstrap"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> k8s.ApiClient:
    """``kubeconfig`` (and ``context``) if given; else the in-cluster service
    account when running in a pod; else ``$KUBECONFIG`` / ``~/.kube/config``."""
    if kubeconfig:
        return k8s_config.new_client_from_config(config_file=kubeconfig, context=context)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not context:
        configuration = k8s.Configuration()
        k8s_config.load_incluster_config(client_configuration=configuration)
        return k8s.ApiClient(configuration)
    return k8s_config.new_client_from_config(context=context)


# -- JSON objects ------------------------------------------------------------------------
def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _is_subset(want: Any, have: Any) -> bool:
    """Whether ``have`` holds everything in ``want`` (the server may add defaults)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_is_subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(_is_subset, want, have))
    return want == have


# -- errors ----------------------------------------------------------------------------
def _status_of(error: ApiException) -> dict[str, Any]:
    try:
        body = json.loads(error.body or b"{}")
        return body if isinstance(body, dict) else {}
    except (TypeError, ValueError):
        return {}


def _message(error: ApiException) -> str:
    status = _status_of(error)
    # A real API server names the field in each cause's ``field``, not in its message (and may
    # repeat a cause): the field goes first, each cause once, so the error names what was wrong.
    causes: list[str] = []
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("message"):
            text = f"{cause['field']}: {cause['message']}" if cause.get("field") else cause["message"]
            if text not in causes:
                causes.append(text)
    return "; ".join(causes) or status.get("message") or error.reason or f"HTTP {error.status}"


#: HTTP status -> the permanent answers, each its own non-retryable type. 404 is the
#: shared ``NotFound``; 409 is ``_Conflict`` inside the adapter (re-read and tried
#: again, bounded) and ``ClusterConflict`` (retryable) past that. Everything else
#: (429, 5xx, timeouts, a refused connection, a status nobody listed) is ``Transient``.
ERROR_STATUSES: dict[int, type[ClusterError]] = {
    401: ClusterForbidden,
    403: ClusterForbidden,
    400: ClusterInvalid,
    405: ClusterInvalid,
    406: ClusterInvalid,
    413: ClusterInvalid,
    414: ClusterInvalid,
    415: ClusterInvalid,
    422: ClusterInvalid,
}


def _translate(error: Exception, what: str) -> Exception:
    if isinstance(error, ApiException):
        code, message = error.status, f"{what}: {_message(error)}"
        if code in ERROR_STATUSES:
            return ERROR_STATUSES[code](message, code=str(code))
        if code == 404:
            return NotFound(message, provider=PROVIDER, code="404")
        if code == 409:
            return ClusterConflict(message, code="409")
        return Transient(message, provider=PROVIDER, code=str(code))
    return Transient(f"{what}: {error}", provider=PROVIDER, code=type(error).__name__)


class _Conflict(Exception):
    """A write met a 409 (another writer came first): read again and retry (``_retry_on_conflict``)."""


#: Re-reads of one object after a 409 before the call gives up as ``ClusterConflict``
#: (a write loses only to another writer, which is done in milliseconds).
_RETRY_CONFLICTS = 12
#: The first pause after a conflict (doubled per try, jittered, at most the max).
_CONFLICT_PAUSE_S, _CONFLICT_PAUSE_MAX_S = 0.01, 0.5

T = TypeVar("T")


class KubernetesApi:
    """The API client and the namespaces every job of the adapter shares, and the plumbing
    of one call: each job's mixin reaches the API server only through these methods."""

    def __init__(
        self,
        api_client: k8s.ApiClient | None = None,
        kubeconfig: str | None = None,
        namespace: str = "gpufleet",
        *,
        context: str | None = None,
        gateway: str = "gpufleet",
        gateway_namespace: str | None = None,
        bootstrap_namespace: str = BOOTSTRAP_NAMESPACE,
        request_timeout_s: float = 30.0,
        join_endpoint: str | None = None,
    ) -> None:
        self.api_client = api_client or load_api_client(kubeconfig, context)
        #: (connect, read) timeout of every call, so a hung API server cannot hold an activity forever.
        self.request_timeout = (min(10.0, request_timeout_s), request_timeout_s)
        self.namespace = namespace
        self.gateway = gateway
        self.gateway_namespace = gateway_namespace or namespace
        self.bootstrap_namespace = bootstrap_namespace
        self.core = k8s.CoreV1Api(self.api_client)
        self.apps = k8s.AppsV1Api(self.api_client)
        self.policy = k8s.PolicyV1Api(self.api_client)
        self.custom = k8s.CustomObjectsApi(self.api_client)
        self.certificates = k8s.CertificatesV1Api(self.api_client)
        #: Where machines reach the API server, when not what ``kube-public/cluster-info`` says.
        self.join_endpoint = join_endpoint if join_endpoint is not None else ControlPlaneEnv.get("join_endpoint")

    # -- plumbing -------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Call ``fn`` and return the response body as JSON; API errors stay ``ApiException``."""
        try:
            response = fn(*args, _preload_content=False, _request_timeout=self.request_timeout, **kwargs)
        except ApiException:
            raise
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise _translate(error, what) from error
        data = response.data
        return json.loads(data) if data else {}

    def _do(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``_call`` with every API error turned into the fleet taxonomy."""
        try:
            return self._call(what, fn, *args, **kwargs)
        except ApiException as error:
            raise _translate(error, what) from error

    def _get(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        try:
            return self._call(what, fn, *args, **kwargs)
        except ApiException as error:
            if error.status == 404:
                return None
            raise _translate(error, what) from error

    def _delete(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Delete; ``False`` when it was already gone."""
        try:
            self._call(what, fn, *args, **kwargs)
            return True
        except ApiException as error:
            if error.status == 404:
                return False
            raise _translate(error, what) from error

    def _write(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """A write whose 409 (conflict / already exists) the caller retries."""
        try:
            return self._call(what, fn, *args, **kwargs)
        except ApiException as error:
            if error.status == 409:
                raise _Conflict(_message(error)) from error
            raise _translate(error, what) from error

    @staticmethod
    def _retry_on_conflict(what: str, attempt: Callable[[], T]) -> T:
        """Run ``attempt`` (read, decide, write under the resourceVersion read) again
        while its write meets a 409, after a jittered, growing pause (writers that collided
        would otherwise collide again: on a real API server six writers of one object starved
        each other through eight immediate retries); past ``_RETRY_CONFLICTS`` tries,
        ``ClusterConflict``."""
        for tries in range(_RETRY_CONFLICTS):
            try:
                return attempt()
            except _Conflict:
                time.sleep(random.uniform(0, min(_CONFLICT_PAUSE_S * 2 ** tries, _CONFLICT_PAUSE_MAX_S)))
        raise ClusterConflict(f"{what} kept conflicting", code="409")
