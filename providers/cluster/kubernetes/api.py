"""The Kubernetes API as every job of the adapter calls it: the client (``load_api_client``),
the plumbing of one call (JSON in and out, a timeout, a 409 retried) and the fleet's error
taxonomy for what the API server answers.

Every call goes through the generated client (paths, auth, TLS, kubeconfig) but
reads and writes plain JSON (``_preload_content=False``), so fields newer than
the client's models survive a read-modify-write. Every write asks for strict field validation:
a field the cluster's schema does not declare is refused by name (``ClusterInvalid``), never
stored without it.

No error of ours quotes the client's failure to send a request, nor is raised from it: the
HTTP layer quotes what it refused (``Invalid header value b'Bearer <token>\\n'``) and the URL it
was sending to (a proxied request's, password and all), and a cause travels into workflow
history and worker logs (``activities.errors.typed_errors``). An answer from the API server
(``ApiException``) is the server's words and stays the cause.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import time
from typing import Any, Callable, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException, ApiTypeError, ApiValueError
from kubernetes.config import incluster_config

from fleet.errors import (
    ClusterConflict,
    ClusterError,
    ClusterForbidden,
    ClusterInvalid,
    FleetError,
    NotFound,
    Transient,
)
from fleet.settings import ControlPlaneEnv
from providers.base import transport_failure
from providers.cluster.envoy_gateway import ROUTING_CRDS

PROVIDER = "kubernetes"
#: The namespace of the bootstrap channel and the join token key (the adapter's default).
BOOTSTRAP_NAMESPACE = "gpufleet-bootstrap"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
#: The client's calls that write an object: each asks for ``fieldValidation=Strict``. Without it
#: the API server stores an object without a field its schema lacks (an Envoy Gateway, a Gateway
#: API or a Kubernetes older than what gpufleet writes), answering only with a warning header:
#: session stickiness or retries silently gone, and the stored object, never matching what the
#: adapter wants, rewritten on every call.
_WRITES = ("create_", "replace_", "patch_")
#: What a refusal for a field of a built-in kind asks for (docs/production/joining.md; the
#: model-wide Service's ``trafficDistribution`` is the newest field gpufleet writes).
KUBERNETES_REQUIRED = "Kubernetes 1.31 or later"


class ClientConfiguration(k8s.Configuration):
    """The client's configuration, saying where its credentials come from (``credentials``, what
    an error names instead of their value), and sending its bearer token without surrounding
    whitespace.

    A token written by ``kubectl create token ... > file`` or ``echo``, or a Secret made from such
    a file, ends in a newline: client-go (kubectl) trims a token file, the Python client sends what
    it read, and http.client refuses the header with an error quoting it whole. Trimmed where every
    request reads it, so a token the client reads again later (the in-cluster token file, each
    minute; a kubeconfig's expired one) is trimmed too."""

    #: Where the credentials come from: a kubeconfig and its context, the in-cluster service account.
    credentials = "the API client's credentials"

    def get_api_key_with_prefix(self, identifier: str, alias: str | None = None) -> str | None:
        key = super().get_api_key_with_prefix(identifier, alias)
        return key.strip() if isinstance(key, str) else key


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> k8s.ApiClient:
    """``kubeconfig`` (and ``context``) if given; else the in-cluster service
    account when running in a pod; else ``$KUBECONFIG`` / ``~/.kube/config``."""
    configuration = ClientConfiguration()
    in_context = f"context {context}" if context else "its current context"
    if kubeconfig:
        configuration.credentials = f"kubeconfig {kubeconfig} ({in_context})"
        return k8s_config.new_client_from_config(config_file=kubeconfig, context=context,
                                                 client_configuration=configuration)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not context:
        configuration.credentials = f"the in-cluster service account's token {incluster_config.SERVICE_TOKEN_FILENAME}"
        k8s_config.load_incluster_config(client_configuration=configuration)
        return k8s.ApiClient(configuration)
    configuration.credentials = f"kubeconfig {os.environ.get('KUBECONFIG') or '~/.kube/config'} ({in_context})"
    return k8s_config.new_client_from_config(context=context, client_configuration=configuration)


def unanswered(error: Exception, what: str, configuration: k8s.Configuration) -> FleetError | None:
    """The fleet's error for a request the client failed to send or to have answered, naming no
    part of the request; None when ``error`` is no such failure (an ``ApiException`` is the
    server's answer; an ``ApiTypeError``/``ApiValueError``, a call the adapter got wrong, names
    only a parameter). Raise it outside the ``except`` block that caught ``error``: not even as a
    suppressed ``__context__`` may ``error`` travel with it.

    A transport failure is ``Transient``, named by its type and the API server's address. A
    ``ValueError`` while the bearer token is no printable ASCII is http.client refusing the
    Authorization header (a line break, a character beyond Latin-1): ``ClusterForbidden`` naming
    where the credentials come from, since no retry mends them."""
    if isinstance(error, (ApiException, ApiTypeError, ApiValueError)):
        return None
    if isinstance(error, (urllib3.exceptions.HTTPError, OSError, http.client.HTTPException)):
        return Transient(f"{what}: {transport_failure(error, configuration.host)}", provider=PROVIDER,
                         code=type(error).__name__)
    token = configuration.get_api_key_with_prefix("BearerToken", alias="authorization") or ""
    if isinstance(error, ValueError) and not (token.isascii() and token.isprintable()):
        source = getattr(configuration, "credentials", ClientConfiguration.credentials)
        return ClusterForbidden(
            f"{what}: the request could not be sent: the token of {source} holds what no request "
            "header can carry (a line break, a character beyond Latin-1); the value is not shown",
            code="MalformedCredentials")
    return None


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


#: A create or update strict field validation refused: ``<Kind> in version "<v>" cannot be handled
#: as a <Kind>: strict decoding error: ...``. A refused patch quotes the patch or the whole patched
#: object (a Node's annotations, as its node wrote them) before the same list: only that list is read.
_STRICT_KIND = re.compile(r'^(\w+) in version "[^"]*" cannot be handled as ')
_STRICT_ERROR = "strict decoding error: "
_STRICT_FIELD = re.compile(r'(unknown|duplicate) field "([^"]*)"')


def _strict_refusal(error: ApiException, what: str) -> ClusterInvalid | None:
    """The refusal of a field the cluster's schema does not declare (or one sent twice), naming the
    kind, each field and the release that declares them; None for any other answer. Built from the
    field names alone: the server's message can quote the object."""
    message = str(_status_of(error).get("message") or "")
    if _STRICT_ERROR not in message:
        return None
    fields = _STRICT_FIELD.findall(message.rpartition(_STRICT_ERROR)[2])
    if not fields:
        return None
    kind_match = _STRICT_KIND.match(message)
    kind = kind_match.group(1) if kind_match else ""
    unknown = [field for problem, field in fields if problem == "unknown"]
    twice = [field for problem, field in fields if problem == "duplicate"]
    refused = "; ".join(([f"lacks {', '.join(unknown)}, which gpufleet writes"] if unknown else [])
                        + ([f"got {', '.join(twice)} twice"] if twice else []))
    needs = ROUTING_CRDS.get(kind, KUBERNETES_REQUIRED)
    return ClusterInvalid(
        f"{what}: refused, nothing written: this cluster's {kind or 'object'} schema {refused} (strict "
        f"field validation: no field is dropped silently). gpufleet needs {needs}: upgrade to it "
        "(docs/production/index.md, \"Cluster requirements\")", code=str(error.status))


def _translate(error: ApiException, what: str) -> Exception:
    refused = _strict_refusal(error, what)
    if refused is not None:
        return refused
    code, message = error.status, f"{what}: {_message(error)}"
    if code in ERROR_STATUSES:
        return ERROR_STATUSES[code](message, code=str(code))
    if code == 404:
        return NotFound(message, provider=PROVIDER, code="404")
    if code == 409:
        return ClusterConflict(message, code="409")
    return Transient(message, provider=PROVIDER, code=str(code))


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
    def _send(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn``'s response; API errors stay ``ApiException``, a request never answered is
        ``unanswered``'s error, raised outside the handler (the client's error, which can quote the
        request, travels not even as its context)."""
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - unanswered() picks the client's failures, the rest re-raised
            failure = unanswered(error, what, self.api_client.configuration)
            if failure is None:
                raise
        raise failure

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Call ``fn`` and return the response body as JSON; API errors stay ``ApiException``."""
        if getattr(fn, "__name__", "").startswith(_WRITES):
            kwargs.setdefault("field_validation", "Strict")
        response = self._send(what, fn, *args, _preload_content=False, _request_timeout=self.request_timeout, **kwargs)
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
