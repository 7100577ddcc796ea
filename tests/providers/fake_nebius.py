"""A local Nebius compute API: real gRPC, real messages, real error statuses.

A ``grpc.server`` on 127.0.0.1 serves ``nebius.compute.v1.InstanceService``,
``nebius.compute.v1.PlatformService`` and ``nebius.common.v1.OperationService``
through generic handlers built from the SDK's own descriptor registry, so the
official ``nebius`` SDK talks to it unchanged (``options.address`` +
``options.insecure``).

Errors are encoded the way the Nebius API encodes them: a gRPC status whose
``grpc-status-details-bin`` trailer is a ``google.rpc.Status`` carrying a
``nebius.common.v1.ServiceError`` packed in an ``Any``; a failed long-running
operation carries the same ``google.rpc.Status`` in ``Operation.status``.
Mutations answer with an unfinished Operation that finishes on its first poll.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from datetime import datetime, timezone
from typing import Any

import grpc
import jwt
# The registry itself, which imports each service's module on first use: nebius.api._registry
# would import every API module first, 4 s of each test session's collection.
from nebius.base.protos.dynamic import REGISTRY
from nebius.api.nebius.common.v1 import (
    BadRequest,
    BadResourceState,
    NotEnoughResources,
    Operation,
    PermissionDenied,
    QuotaFailure,
    ResourceAlreadyExists,
    ResourceMetadata,
    ResourceNotFound,
    ServiceError,
    TooManyRequests,
)
from nebius.api.nebius.compute.v1 import (
    Instance,
    InstanceStatus,
    IPAddressStatus,
    NetworkInterfaceStatus,
    ListInstancesResponse,
    ListPlatformsResponse,
    Platform,
    PlatformSpec,
    PlatformStatus,
    Preset,
    PresetResources,
)
from nebius.api.nebius.iam.v1 import CreateTokenResponse
from nebius.base._service_error import grpc_status_of_errors, pbrpc_status_of_errors

State = InstanceStatus.InstanceState


class Failure:
    """One error as the Nebius API sends it: gRPC code, message, ServiceError."""

    def __init__(self, code: grpc.StatusCode, message: str, error: ServiceError | None = None) -> None:
        self.code, self.message, self.error = code, message, error

    def abort(self, context: grpc.ServicerContext) -> None:
        errors = [self.error] if self.error is not None else []
        context.abort_with_status(grpc_status_of_errors(self.code, self.message, errors))

    def rpc_status(self) -> Any:
        errors = [self.error] if self.error is not None else []
        return pbrpc_status_of_errors(self.code, self.message, errors)


def _service_error(code: str, **detail: Any) -> ServiceError:
    return ServiceError(service="compute", code=code, **detail)


def no_capacity() -> Failure:
    violation = NotEnoughResources.Violation(
        resource_type="gpu-h100-sxm", message="Not enough GPUs of this platform in the region", requested="8"
    )
    return Failure(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "Not enough resources to create the instance",
        _service_error("NotEnoughResources", not_enough_resources=NotEnoughResources(violations=[violation])),
    )


def over_quota() -> Failure:
    violation = QuotaFailure.Violation(
        quota="compute.instance.gpu.h100", message="Quota exceeded", limit="8", requested="16"
    )
    return Failure(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "Quota limit exceeded",
        _service_error("QuotaFailure", quota_failure=QuotaFailure(violations=[violation])),
    )


def too_many_requests() -> Failure:
    return Failure(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "Too many requests",
        _service_error("TooManyRequests", too_many_requests=TooManyRequests(violation="compute.instance.create rate")),
    )


def unauthenticated() -> Failure:
    return Failure(grpc.StatusCode.UNAUTHENTICATED, "invalid or expired token")


def permission_denied(resource_id: str) -> Failure:
    return Failure(
        grpc.StatusCode.PERMISSION_DENIED,
        "Permission denied",
        _service_error("PermissionDenied", permission_denied=PermissionDenied(resource_id=resource_id)),
    )


def unavailable() -> Failure:
    return Failure(grpc.StatusCode.UNAVAILABLE, "service temporarily unavailable")


def bad_request(field: str, message: str) -> Failure:
    violation = BadRequest.Violation(field=field, message=message)
    return Failure(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"Invalid request: {field}",
        _service_error("BadRequest", bad_request=BadRequest(violations=[violation])),
    )


def not_found(resource_id: str) -> Failure:
    return Failure(
        grpc.StatusCode.NOT_FOUND,
        f"resource {resource_id} not found",
        _service_error("NotFound", resource_not_found=ResourceNotFound(resource_id=resource_id)),
    )


def already_exists(resource_id: str) -> Failure:
    return Failure(
        grpc.StatusCode.ALREADY_EXISTS,
        f"resource {resource_id} already exists",
        _service_error("AlreadyExists", resource_already_exists=ResourceAlreadyExists(resource_id=resource_id)),
    )


def bad_state(resource_id: str, message: str) -> Failure:
    return Failure(
        grpc.StatusCode.FAILED_PRECONDITION,
        message,
        _service_error(
            "BadResourceState", bad_resource_state=BadResourceState(resource_id=resource_id, message=message)
        ),
    )


#: What the harness arms for ``fail_next_create(kind)``, and where Nebius reports it.
#: ``"operation"``: the Create RPC succeeds and the operation fails; ``"rpc"``: the call fails.
CREATE_FAILURES: dict[str, tuple[str, Callable[[], Failure]]] = {
    "NoCapacity": ("operation", no_capacity),
    "NoCapacityRpc": ("rpc", no_capacity),
    "OverQuota": ("rpc", over_quota),
    "BadCredentials": ("rpc", unauthenticated),
    "PermissionDenied": ("rpc", lambda: permission_denied("project-e00fake")),
    "Transient": ("rpc", too_many_requests),
    "Unavailable": ("rpc", unavailable),
    "InvalidRequest": ("rpc", lambda: bad_request("spec.resources.preset", "preset is not available on platform")),
    "Unknown": ("rpc", lambda: Failure(grpc.StatusCode.DATA_LOSS, "something new")),
}


#: Methods callable without a bearer token.
PUBLIC_METHODS = {"TokenExchangeService.Exchange"}

#: The audience Nebius' token service expects in a service account's JWT.
TOKEN_AUDIENCE = "token-service.iam.new.nebiuscloud.net"


def platform(name: str, presets: dict[str, int], gpu_memory_gb: int, preemptible: bool = True) -> Platform:
    return Platform(
        metadata=ResourceMetadata(id=f"computeplatform-{name}", parent_id="project-e00public", name=name),
        spec=PlatformSpec(
            presets=[
                Preset(
                    name=p,
                    resources=PresetResources(gpu_count=g, vcpu_count=16 * max(g, 1), memory_gibibytes=200 * max(g, 1)),
                )
                for p, g in presets.items()
            ],
            human_readable_name=name.upper(),
            gpu_memory_gigabytes=gpu_memory_gb,
        ),
        status=PlatformStatus(allowed_for_preemptibles=preemptible),
    )


def _now() -> datetime:
    return datetime.now(timezone.utc)


class FakeNebius:
    """The state and the gRPC server. ``address`` goes into ``options.address``."""

    def __init__(self, token: str, project_id: str, platforms: list[Platform]) -> None:
        self.token = token
        self.project_id = project_id
        self.platforms = platforms
        self.instances: dict[str, Instance] = {}
        self.operations: dict[str, Operation] = {}
        self.calls: Counter[str] = Counter()
        self.idempotency_keys: list[str] = []
        self.boot_disks_replaced: Counter[str] = Counter()
        self.power_cycles: Counter[str] = Counter()
        #: Keep every operation running (to test the adapter's bounded wait).
        self.hold_operations = False
        self.max_page_size = 100
        #: Service-account keys the token exchange accepts: key id -> (account id, public key PEM).
        self.service_account_keys: dict[str, tuple[str, bytes]] = {}
        self._by_key: dict[str, str] = {}
        self._finishers: dict[str, Callable[[], Failure | None]] = {}
        self._armed: dict[str, list[tuple[str, Failure]]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self._server.add_generic_rpc_handlers(
            [
                self._handlers("nebius.compute.v1.InstanceService", {
                    "Get": self._get, "GetByName": self._get_by_name, "List": self._list, "Create": self._create,
                    "Update": self._update, "Delete": self._delete, "Start": self._start, "Stop": self._stop,
                }),
                self._handlers("nebius.compute.v1.PlatformService", {"List": self._list_platforms}),
                self._handlers("nebius.common.v1.OperationService", {"Get": self._get_operation}),
                self._handlers("nebius.iam.v1.TokenExchangeService", {"Exchange": self._exchange}),
            ]
        )
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "FakeNebius":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    # -- test controls -------------------------------------------------------

    def fail_next(self, method: str, kind: str) -> None:
        """Answer the next InstanceService ``method`` (``"Create"``) the way Nebius reports ``kind``."""
        where, make = CREATE_FAILURES[kind]
        with self._lock:
            self._armed.setdefault(f"InstanceService.{method}", []).append((where, make()))

    def live_instances(self) -> list[Instance]:
        with self._lock:
            return [i for i in self.instances.values() if i.status.state != State.DELETING]

    # -- plumbing ------------------------------------------------------------

    def _handlers(self, service: str, methods: dict[str, Callable[[Any, dict[str, str]], Any]]):
        descriptor = REGISTRY.service_descriptor(service)
        handlers = {}
        for method in descriptor.methods:
            if method.name not in methods:
                continue
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                self._guarded(f"{service.rsplit('.', 1)[1]}.{method.name}", methods[method.name]),
                request_deserializer=REGISTRY.message_class(method.input_type.full_name).FromString,
                response_serializer=REGISTRY.message_class(method.output_type.full_name).SerializeToString,
            )
        return grpc.method_handlers_generic_handler(service, handlers)

    def _guarded(self, name: str, fn: Callable[[Any, dict[str, str]], Any]):
        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            metadata = dict(context.invocation_metadata())
            with self._lock:
                self.calls[name] += 1
                if name not in PUBLIC_METHODS and metadata.get("authorization") != f"Bearer {self.token}":
                    unauthenticated().abort(context)
                armed = self._armed.get(name)
                if armed and armed[0][0] == "rpc":
                    armed.pop(0)[1].abort(context)
                answer = fn(request, metadata)
            if isinstance(answer, Failure):
                answer.abort(context)
            return answer

        return handle

    def _operation(self, resource_id: str, description: str, finish: Callable[[], Failure | None]) -> Operation:
        op_id = f"computeoperation-e00{next(self._ids):06d}"
        operation = Operation(
            id=op_id,
            description=description,
            created_at=_now(),
            created_by="serviceaccount-e00fake",
            resource_id=resource_id,
        )
        self.operations[op_id] = operation
        self._finishers[op_id] = finish
        return operation

    def _instance(self, instance_id: str) -> Instance | Failure:
        instance = self.instances.get(instance_id)
        if instance is None:
            return not_found(instance_id)
        return instance

    def _set_state(self, instance_id: str, state: Any) -> None:
        instance = self.instances[instance_id]
        status = InstanceStatus(instance.status, state=state)
        if state == State.RUNNING and not status.network_interfaces:
            # As Nebius does once the instance runs: its interface's private address (a.b.c.d/32).
            number = list(self.instances).index(instance_id) + 10
            status = InstanceStatus(status, network_interfaces=[NetworkInterfaceStatus(
                name="eth0", ip_address=IPAddressStatus(address=f"10.128.{number // 250}.{number % 250}/32"))])
        self.instances[instance_id] = Instance(instance, status=status)

    # -- OperationService ----------------------------------------------------

    def _get_operation(self, request: Any, metadata: dict[str, str]) -> Any:
        operation = self.operations.get(request.id)
        if operation is None:
            return not_found(request.id)
        if self.hold_operations:
            return operation
        finish = self._finishers.pop(request.id, None)
        if finish is not None:
            failure = finish()
            status = failure.rpc_status() if failure else pbrpc_status_of_errors(grpc.StatusCode.OK, "", [])
            operation = Operation(operation, status=status, finished_at=_now())
            self.operations[request.id] = operation
        return operation

    # -- InstanceService -----------------------------------------------------

    def _get(self, request: Any, metadata: dict[str, str]) -> Any:
        return self._instance(request.id)

    def _get_by_name(self, request: Any, metadata: dict[str, str]) -> Any:
        for instance in self.instances.values():
            if instance.metadata.parent_id == request.parent_id and instance.metadata.name == request.name:
                return instance
        return not_found(f"{request.parent_id}/{request.name}")

    def _list(self, request: Any, metadata: dict[str, str]) -> Any:
        items = [i for i in self.instances.values() if i.metadata.parent_id == request.parent_id]
        size = min(request.page_size or 100, self.max_page_size)
        start = int(request.page_token or 0)
        window = items[start : start + size]
        token = str(start + size) if start + size < len(items) else ""
        return ListInstancesResponse(items=window, next_page_token=token)

    def _create(self, request: Any, metadata: dict[str, str]) -> Any:
        key = metadata.get("x-idempotency-key", "")
        self.idempotency_keys.append(key)
        if key in self._by_key:
            return self.operations[self._by_key[key]]
        problem = self._validate(request)
        if problem is not None:
            return problem
        armed = self._armed.get("InstanceService.Create")
        late = armed.pop(0)[1] if armed and armed[0][0] == "operation" else None
        if late is not None:
            operation = self._operation("", "Create instance", lambda: late)
        else:
            instance_id = f"computeinstance-e00{secrets.token_hex(8)}"
            self.instances[instance_id] = Instance(
                metadata=ResourceMetadata(
                    request.metadata,
                    id=instance_id,
                    resource_version=1,
                    created_at=_now(),
                    updated_at=_now(),
                ),
                spec=request.spec,
                status=InstanceStatus(state=State.CREATING, reconciling=True),
            )

            def finish() -> None:
                self._set_state(instance_id, State.RUNNING)

            operation = self._operation(instance_id, "Create instance", finish)
        self._by_key[key] = operation.id
        return operation

    def _validate(self, request: Any) -> Failure | None:
        if request.metadata.parent_id != self.project_id:
            return permission_denied(request.metadata.parent_id)
        if not request.metadata.name:
            return bad_request("metadata.name", "name is required")
        for instance in self.instances.values():
            same = (instance.metadata.parent_id, instance.metadata.name)
            if same == (request.metadata.parent_id, request.metadata.name):
                return already_exists(instance.metadata.id)
        resources = request.spec.resources
        known = {p.metadata.name: {s.name for s in p.spec.presets} for p in self.platforms}
        if resources.platform not in known:
            return bad_request("spec.resources.platform", f"unknown platform {resources.platform!r}")
        if resources.preset not in known[resources.platform]:
            return bad_request("spec.resources.preset", f"unknown preset {resources.preset!r}")
        if not request.spec.network_interfaces or not request.spec.network_interfaces[0].subnet_id:
            return bad_request("spec.network_interfaces", "a network interface with a subnet is required")
        if not request.spec.boot_disk.check_presence("managed_disk"):
            return bad_request("spec.boot_disk", "boot disk is required")
        return None

    def _update(self, request: Any, metadata: dict[str, str]) -> Any:
        instance = self._instance(request.metadata.id)
        if isinstance(instance, Failure):
            return instance
        old_disk = instance.spec.boot_disk.managed_disk.name
        new_disk = request.spec.boot_disk.managed_disk.name
        replaced = old_disk != new_disk
        if replaced and instance.status.state != State.STOPPED:
            return bad_state(instance.metadata.id, "instance must be stopped to replace its boot disk")
        if replaced:
            self.boot_disks_replaced[instance.metadata.id] += 1
        version = instance.metadata.resource_version + 1
        self.instances[instance.metadata.id] = Instance(
            instance,
            metadata=ResourceMetadata(instance.metadata, resource_version=version, updated_at=_now()),
            spec=request.spec,
        )
        return self._operation(instance.metadata.id, "Update instance", lambda: None)

    def _delete(self, request: Any, metadata: dict[str, str]) -> Any:
        instance = self._instance(request.id)
        if isinstance(instance, Failure):
            return instance
        self._set_state(request.id, State.DELETING)
        return self._operation(request.id, "Delete instance", lambda: self.instances.pop(request.id) and None)

    def _stop(self, request: Any, metadata: dict[str, str]) -> Any:
        instance = self._instance(request.id)
        if isinstance(instance, Failure):
            return instance
        self._set_state(request.id, State.STOPPING)
        return self._operation(request.id, "Stop instance", lambda: self._set_state(request.id, State.STOPPED))

    def _start(self, request: Any, metadata: dict[str, str]) -> Any:
        instance = self._instance(request.id)
        if isinstance(instance, Failure):
            return instance
        if instance.status.state == State.STOPPED:
            self.power_cycles[request.id] += 1
        self._set_state(request.id, State.STARTING)
        return self._operation(request.id, "Start instance", lambda: self._set_state(request.id, State.RUNNING))

    # -- TokenExchangeService -------------------------------------------------

    def _exchange(self, request: Any, metadata: dict[str, str]) -> Any:
        """Trade a service account's signed JWT for the bearer token the fake accepts."""
        try:
            kid = jwt.get_unverified_header(request.subject_token)["kid"]
            account_id, public_key = self.service_account_keys[kid]
            claims = jwt.decode(request.subject_token, public_key, algorithms=["RS256"], audience=TOKEN_AUDIENCE)
        except (jwt.PyJWTError, KeyError):
            return unauthenticated()
        if claims.get("sub") != account_id:
            return unauthenticated()
        return CreateTokenResponse(
            access_token=self.token,
            issued_token_type="urn:ietf:params:oauth:token-type:access_token",
            token_type="Bearer",
            expires_in=3600,
        )

    # -- PlatformService -----------------------------------------------------

    def _list_platforms(self, request: Any, metadata: dict[str, str]) -> Any:
        return ListPlatformsResponse(items=self.platforms)
