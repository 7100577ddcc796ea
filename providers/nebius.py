"""Nebius AI Cloud adapter, over the official ``nebius`` SDK (gRPC).

Nebius quirks this module absorbs:

* **Every mutation is a long-running Operation.** Create, delete, stop, start
  and update answer with an ``Operation``; the adapter polls it through the
  ``OperationService`` (``poll_interval_s``), bounded by ``operation_wait_s``.
  A wait that runs out is ``Transient``: the retry sends the same idempotency
  key and so waits on the same operation again.
* **Capacity errors arrive late.** Quota is usually refused by the Create RPC
  itself, while "not enough resources" is usually the *operation's* final
  status. Both travel as ``RESOURCE_EXHAUSTED``; only the ``ServiceError``
  packed in the status details (``grpc-status-details-bin`` -> ``google.rpc.
  Status`` -> ``nebius.common.v1.ServiceError``, oneof ``details``) tells
  ``quota_failure`` from ``not_enough_resources``. The adapter classifies RPC
  errors and failed operations the same way: the detail first
  (``DETAIL_ERRORS``), then the gRPC code (``STATUS_ERRORS``), else
  ``Transient``.
* **Idempotency** is the ``X-Idempotency-Key`` gRPC header. The SDK puts a
  random one on every call; create sends a UUID derived from the caller's key
  instead (the header wants a UUID). Instance names are unique per project,
  so an ``ALREADY_EXISTS`` answer (a key the server has forgotten) returns the
  instance of that name, if it is this site's.
* **No restart RPC**: reboot is ``Stop`` then ``Start`` (a full power cycle).
* **No reimage RPC**: the boot disk is a *managed* disk of the instance, and
  renaming a managed disk in the instance spec replaces it with a fresh disk
  from the same image. Reinstall is stop, update (boot disk ``<name>-boot-N``),
  start. The instance id stays the same.
* The SDK retries ``UNAVAILABLE``/``RESOURCE_EXHAUSTED`` by itself; Temporal
  owns retries, so calls go out with ``retries=0`` (``sdk_retries``).
* The SDK runs its own event loop thread; the adapter opens one SDK per call
  and closes it, so credentials are read at call time and nothing lingers.
* ``instance_type`` is ``<platform>.<preset>`` (``gpu-h100-sxm.8gpu-128vcpu-1600gb``)
  unless ``options.instance_types`` maps a name to ``{platform, preset}``.
* Spot sites create preemptible instances (``on_preemption: STOP``).
* Offers come from ``PlatformService.List``; Nebius publishes no live stock
  there, so a listed platform+preset is offered as available at the site's
  configured price.

Credentials: an IAM token, or the JSON of a service-account credentials file
(``nebius iam auth-public-key generate`` output); the SDK exchanges the latter
for tokens. Account options: ``parent_id`` (project, required), ``subnet_id``
(required to create), ``image_family`` (``ubuntu22.04-cuda12``), ``boot_disk_gib``
(200), ``public_ip`` (true), ``service_account_id``, ``user_data``,
``instance_types``, ``domain`` (``api.nebius.cloud:443``), ``address`` (send
every service to this one ``host:port``), ``insecure`` (plaintext gRPC, for
local fakes), ``request_timeout_s`` (30), ``operation_wait_s`` (600),
``poll_interval_s`` (2), ``sdk_retries`` (0).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from grpc import StatusCode
from nebius.aio.idempotency import HEADER as IDEMPOTENCY_HEADER
from nebius.aio.operation import Operation
from nebius.aio.request import RequestError as SDKRequestError
from nebius.aio.service_error import RequestError
from nebius.aio.token.options import OPTION_MAX_RETRIES, OPTION_REPORT_ERROR
from nebius.api.nebius.common.v1 import GetByNameRequest, ResourceMetadata
from nebius.api.nebius.compute.v1 import (
    AttachedDiskSpec,
    CreateInstanceRequest,
    DeleteInstanceRequest,
    DiskSpec,
    GetInstanceRequest,
    Instance,
    InstanceServiceClient,
    InstanceSpec,
    IPAddress,
    ListInstancesRequest,
    ListPlatformsRequest,
    ManagedDisk,
    NetworkInterfaceSpec,
    PlatformServiceClient,
    PreemptibleSpec,
    PublicIPAddress,
    ResourcesSpec,
    SourceImageFamily,
    StartInstanceRequest,
    StopInstanceRequest,
    UpdateInstanceRequest,
)
from nebius.base.error import SDKError
from nebius.base.options import INSECURE
from nebius.base.resolver import Constant
from nebius.sdk import SDK

from fleet.config import Account, Site
from fleet.errors import (
    BadCredentials,
    InvalidRequest,
    NoCapacity,
    NotFound,
    OverQuota,
    ProviderError,
    Transient,
)
from fleet.models import MACHINE_TAG_SITE, CapacityType, Machine, MachineSpec, Offer
from providers.base import translated
from providers.credentials import header_safe, read_secret

PROVIDER = "nebius"
DEFAULT_DOMAIN = "api.nebius.cloud:443"
DEFAULT_IMAGE_FAMILY = "ubuntu22.04-cuda12"
USER_AGENT = "gpufleet/0.1"
#: Label every instance this control plane creates carries; list_machines filters on it.
SITE_LABEL = MACHINE_TAG_SITE
#: Namespace for turning a caller's idempotency key into the UUID Nebius expects.
KEY_NAMESPACE = uuid.UUID("6b1d2c1e-5f43-4f4e-9b53-8d1f0a1c9e77")

#: A failed token exchange (service-account credentials) fails the call at once
#: instead of being retried in the background until the deadline.
AUTH_OPTIONS = {OPTION_REPORT_ERROR: "1", OPTION_MAX_RETRIES: "1"}

#: ``ServiceError.details`` oneof field -> class. Decides before the gRPC code.
DETAIL_ERRORS: dict[str, type[ProviderError]] = {
    "not_enough_resources": NoCapacity,
    "quota_failure": OverQuota,
    "permission_denied": BadCredentials,
    "too_many_requests": Transient,
    "internal_error": Transient,
    "operation_conflict": Transient,
    "operation_aborted": Transient,
    "resource_conflict": Transient,
    "bad_resource_state": Transient,
    "bad_request": InvalidRequest,
    "out_of_range": InvalidRequest,
    "resource_not_found": NotFound,
}

#: gRPC status -> class, when no ServiceError detail decided.
STATUS_ERRORS: dict[StatusCode, type[ProviderError]] = {
    StatusCode.UNAUTHENTICATED: BadCredentials,
    StatusCode.PERMISSION_DENIED: BadCredentials,
    StatusCode.UNAVAILABLE: Transient,
    StatusCode.DEADLINE_EXCEEDED: Transient,
    StatusCode.ABORTED: Transient,
    StatusCode.INTERNAL: Transient,
    StatusCode.CANCELLED: Transient,
    StatusCode.INVALID_ARGUMENT: InvalidRequest,
    StatusCode.OUT_OF_RANGE: InvalidRequest,
    StatusCode.FAILED_PRECONDITION: InvalidRequest,
    StatusCode.ALREADY_EXISTS: InvalidRequest,
    StatusCode.UNIMPLEMENTED: InvalidRequest,
    StatusCode.NOT_FOUND: NotFound,
}

#: ``InstanceStatus.InstanceState`` name -> Machine.state.
STATES: dict[str, str] = {
    "UNSPECIFIED": "pending",
    "CREATING": "pending",
    "UPDATING": "pending",
    "STARTING": "pending",
    "RUNNING": "running",
    "STOPPING": "stopped",
    "STOPPED": "stopped",
    "ERROR": "stopped",
    "DELETING": "terminated",
}


def classify(code: StatusCode, details: Sequence[str], message: str) -> ProviderError:
    """The taxonomy exception for one gRPC status and its ServiceError details."""
    for detail in details:
        cls = DETAIL_ERRORS.get(detail)
        if cls is not None:
            return cls(f"{message} ({code.name}/{detail})", provider=PROVIDER, code=f"{code.name}/{detail}")
    cls = STATUS_ERRORS.get(code)
    if cls is not None:
        return cls(f"{message} ({code.name})", provider=PROVIDER, code=code.name)
    raw = "/".join([code.name, *details])
    return Transient(f"unclassified Nebius error {raw}: {message}", provider=PROVIDER, code=raw)


def _classify_request_error(exc: RequestError, action: str) -> ProviderError:
    status = exc.status
    details = [err.details.field for err in status.service_errors if err.details is not None]
    return classify(status.code, details, f"{action}: {status.message or 'failed'}")


def _translated(action: str) -> AbstractContextManager[None]:
    """Turn SDK failures (RPC errors and failed operations alike) into the taxonomy. Only those
    are Nebius's answer: the SDK's own (the channel's, the token's) are not chained."""
    return translated(lambda exc: _sdk_error(exc, action), answered=lambda exc: isinstance(exc, RequestError))


def _sdk_error(exc: Exception, action: str) -> ProviderError | None:
    if isinstance(exc, RequestError):  # includes OperationError, a failed operation
        return _classify_request_error(exc, action)
    if isinstance(exc, TimeoutError):
        return Transient(f"{action}: timed out", provider=PROVIDER, code="timeout")
    if isinstance(exc, (SDKRequestError, SDKError)):
        return Transient(f"{action}: {type(exc).__name__}", provider=PROVIDER, code=type(exc).__name__)
    return None


def _is_already_exists(exc: RequestError) -> bool:
    if exc.status.code == StatusCode.ALREADY_EXISTS:
        return True
    return any(
        err.details is not None and err.details.field == "resource_already_exists" for err in exc.status.service_errors
    )


def _addresses(instance: Instance) -> list[str]:
    """The instance's private and public IPs (Nebius writes them as ``a.b.c.d/32``)."""
    found = []
    for interface in getattr(instance.status, "network_interfaces", None) or []:
        for field in ("ip_address", "public_ip_address"):
            value = getattr(getattr(interface, field, None), "address", "") or ""
            if value:
                found.append(value.split("/")[0])
    return found


def idempotency_uuid(key: str) -> str:
    """The ``X-Idempotency-Key`` sent for a caller's idempotency key."""
    return str(uuid.uuid5(KEY_NAMESPACE, key))


@dataclass
class _Session:
    sdk: SDK
    instances: InstanceServiceClient
    platforms: PlatformServiceClient


class NebiusProvider:
    """One Nebius project (``options.parent_id``) at one region (``site.region``)."""

    name = PROVIDER

    def __init__(self, site: Site, account: Account) -> None:
        self.site = site
        self.account = account

    # -- configuration --------------------------------------------------------

    def _required(self, key: str) -> str:
        value = self.account.options.get(key)
        if not value:
            raise InvalidRequest(
                f"account {self.account.name!r}: options.{key} is required for Nebius",
                provider=PROVIDER,
                code="config",
            )
        return str(value)

    def _call_kwargs(self) -> dict[str, Any]:
        timeout = float(self.account.option("request_timeout_s", 30))
        return {
            "timeout": timeout,
            "per_retry_timeout": timeout,
            "auth_timeout": timeout,
            "auth_options": dict(AUTH_OPTIONS),
            "retries": int(self.account.option("sdk_retries", 0)),
        }

    def _platform_preset(self, instance_type: str) -> tuple[str, str]:
        mapped = self.account.option("instance_types", {}).get(instance_type)
        if mapped:
            return str(mapped["platform"]), str(mapped["preset"])
        platform, dot, preset = instance_type.partition(".")
        if not dot or not platform or not preset:
            raise InvalidRequest(
                f"instance type {instance_type!r} is not '<platform>.<preset>' and not in options.instance_types",
                provider=PROVIDER,
                code="config",
            )
        return platform, preset

    def _instance_type_of(self, platform: str, preset: str) -> str:
        for name, mapped in self.account.option("instance_types", {}).items():
            if mapped.get("platform") == platform and mapped.get("preset") == preset:
                return str(name)
        return f"{platform}.{preset}" if preset else platform

    # -- SDK session ---------------------------------------------------------

    def _credentials(self) -> Any:
        """IAM token, or a service-account reader from a credentials JSON. No network."""
        secret = read_secret(self.account.credentials, provider=PROVIDER)
        if not secret.startswith("{"):  # an IAM token: sent as gRPC metadata
            return header_safe(secret, self.account.credentials, provider=PROVIDER)
        from nebius.base.service_account.credentials_file import ServiceAccountCredentials
        from nebius.base.service_account.service_account import ServiceAccount
        from nebius.base.service_account.static import Reader

        try:
            subject = ServiceAccountCredentials.from_json(json.loads(secret)).subject_credentials
            account = ServiceAccount(subject.parse_private_key(), subject.kid, subject.sub)
        except Exception as exc:  # noqa: BLE001 - any parse failure means unusable credentials
            ref = self.account.credentials.describe() if self.account.credentials else "(none)"
            raise BadCredentials(
                f"credentials reference {ref} is not a valid Nebius service-account credentials JSON "
                f"({type(exc).__name__})",
                provider=PROVIDER,
                code="credentials_file",
            ) from None
        return Reader(account)

    def _sdk_kwargs(self, credentials: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "credentials": credentials,
            "user_agent_prefix": USER_AGENT,
            "domain": str(self.account.option("domain", DEFAULT_DOMAIN)),
        }
        address = self.account.options.get("address")
        if address:
            kwargs["resolver"] = Constant(str(address))
        if self.account.options.get("insecure"):
            kwargs["options"] = [(INSECURE, True)]
        return kwargs

    @contextmanager
    def _session(self, action: str) -> Iterator[_Session]:
        credentials = self._credentials()
        with _translated(action):
            sdk = SDK(**self._sdk_kwargs(credentials))
        try:
            with _translated(action):
                yield _Session(sdk, InstanceServiceClient(sdk), PlatformServiceClient(sdk))
        finally:
            try:
                sdk.sync_close()
            except Exception:  # noqa: BLE001 - closing must never mask the call's outcome
                pass

    def _wait(self, operation: Operation[Any]) -> None:
        """Poll ``operation`` to its end, bounded; a failed one raises via ``_translated``."""
        timeout = float(self.account.option("request_timeout_s", 30))
        operation.sync_wait(
            interval=float(self.account.option("poll_interval_s", 2)),
            timeout=float(self.account.option("operation_wait_s", 600)),
            poll_iteration_timeout=timeout,
            poll_per_retry_timeout=timeout,
            poll_retries=int(self.account.option("sdk_retries", 0)),
            auth_timeout=timeout,
            auth_options=dict(AUTH_OPTIONS),
        )

    # -- mapping -------------------------------------------------------------

    def _machine(self, instance: Instance) -> Machine:
        resources = instance.spec.resources
        preemptible = instance.spec.check_presence("preemptible")
        return Machine(
            id=instance.metadata.id,
            name=instance.metadata.name,
            site=self.site.name,
            provider=PROVIDER,
            instance_type=self._instance_type_of(resources.platform, resources.preset or ""),
            state=STATES.get(instance.status.state.name, "pending"),
            capacity_type=CapacityType.SPOT if preemptible else CapacityType.ON_DEMAND,
            created_at=instance.metadata.created_at,
            # The ownership marker: the fleet labels every instance it creates with its site.
            owned=instance.metadata.labels.get(SITE_LABEL) == self.site.name,
            addresses=_addresses(instance),
        )

    def _owned(self, instance: Instance) -> Machine:
        if instance.metadata.labels.get(SITE_LABEL) != self.site.name:
            raise InvalidRequest(
                f"an instance named {instance.metadata.name!r} already exists and is not labelled "
                f"{SITE_LABEL}={self.site.name}",
                provider=PROVIDER,
                code="name_taken",
            )
        return self._machine(instance)

    def _boot_disk(self, spec: MachineSpec) -> DiskSpec:
        image = spec.image or self.site.image or str(self.account.option("image_family", DEFAULT_IMAGE_FAMILY))
        source: dict[str, Any] = (
            {"source_image_id": image}
            if image.startswith("computeimage-")
            else {"source_image_family": SourceImageFamily(image_family=image)}
        )
        return DiskSpec(
            size_gibibytes=int(self.account.option("boot_disk_gib", 200)),
            type=DiskSpec.DiskType.NETWORK_SSD,
            **source,
        )

    def _create_request(self, spec: MachineSpec, user_data: str = "") -> CreateInstanceRequest:
        platform, preset = self._platform_preset(spec.instance_type or self.site.instance_type)
        subnet_id = self._required("subnet_id")
        interface: dict[str, Any] = {"name": "eth0", "subnet_id": subnet_id, "ip_address": IPAddress()}
        if self.account.option("public_ip", True):
            interface["public_ip_address"] = PublicIPAddress()
        fields: dict[str, Any] = {
            "resources": ResourcesSpec(platform=platform, preset=preset),
            "boot_disk": AttachedDiskSpec(
                attach_mode=AttachedDiskSpec.AttachMode.READ_WRITE,
                managed_disk=ManagedDisk(name=f"{spec.name}-boot", spec=self._boot_disk(spec)),
            ),
            "network_interfaces": [NetworkInterfaceSpec(**interface)],
            "hostname": spec.name,
        }
        if spec.capacity_type == CapacityType.SPOT:
            fields["preemptible"] = PreemptibleSpec(on_preemption=PreemptibleSpec.PreemptionPolicy.STOP)
        for option in ("service_account_id", "user_data"):
            if self.account.options.get(option):
                fields["cloud_init_user_data" if option == "user_data" else option] = str(self.account.options[option])
        if user_data:  # the machine's own bootstrap wins over the account's fixed option
            fields["cloud_init_user_data"] = user_data
        return CreateInstanceRequest(
            metadata=ResourceMetadata(
                parent_id=self._required("parent_id"),
                name=spec.name,
                labels={**spec.tags, SITE_LABEL: self.site.name},
            ),
            spec=InstanceSpec(**fields),
        )

    # -- the Provider verbs ----------------------------------------------------

    def create_machine(self, spec: MachineSpec, idempotency_key: str, user_data: str = "") -> Machine:
        request = self._create_request(spec, user_data)  # config errors before any call
        kwargs = self._call_kwargs()
        with self._session("create instance") as s:
            try:
                operation = s.instances.create(
                    request, metadata=[(IDEMPOTENCY_HEADER, idempotency_uuid(idempotency_key))], **kwargs
                ).wait()
                self._wait(operation)
            except RequestError as exc:  # the call, or its operation
                if not _is_already_exists(exc):
                    raise
                by_name = GetByNameRequest(parent_id=request.metadata.parent_id, name=spec.name)
                return self._owned(s.instances.get_by_name(by_name, **kwargs).wait())
            instance = s.instances.get(GetInstanceRequest(id=operation.resource_id), **kwargs).wait()
            return self._owned(instance)

    def delete_machine(self, machine_id: str) -> None:
        try:
            with self._session("delete instance") as s:
                self._wait(s.instances.delete(DeleteInstanceRequest(id=machine_id), **self._call_kwargs()).wait())
        except NotFound:
            return

    def get_machine(self, machine_id: str) -> Machine:
        with self._session("get instance") as s:
            return self._machine(s.instances.get(GetInstanceRequest(id=machine_id), **self._call_kwargs()).wait())

    def list_machines(self) -> list[Machine]:
        parent_id = self._required("parent_id")
        instances: list[Instance] = []
        with self._session("list instances") as s:
            token = ""
            while True:
                page = s.instances.list(
                    ListInstancesRequest(parent_id=parent_id, page_size=100, page_token=token), **self._call_kwargs()
                ).wait()
                instances.extend(page.items)
                token = page.next_page_token
                if not token:
                    break
        return [self._machine(i) for i in instances if i.metadata.labels.get(SITE_LABEL) == self.site.name]

    def reboot_machine(self, machine_id: str) -> None:
        """Power cycle: Stop, then Start (Nebius has no restart call)."""
        with self._session("reboot instance") as s:
            self._stop(s, machine_id)
            self._start(s, machine_id)

    def _stop(self, s: _Session, machine_id: str) -> None:
        self._wait(s.instances.stop(StopInstanceRequest(id=machine_id), **self._call_kwargs()).wait())

    def _start(self, s: _Session, machine_id: str) -> None:
        self._wait(s.instances.start(StartInstanceRequest(id=machine_id), **self._call_kwargs()).wait())

    def reinstall_machine(self, machine_id: str, user_data: str = "") -> None:
        """Replace the managed boot disk with a fresh one from the same image."""
        if user_data:
            # The new disk boots with the instance's cloud-init user data as created.
            raise InvalidRequest(f"instance {machine_id}: a reinstall cannot carry new user data; replace it",
                                 provider=PROVIDER, code="reinstall-rebootstrap-unsupported")
        kwargs = self._call_kwargs()
        with self._session("reinstall instance") as s:
            instance = s.instances.get(GetInstanceRequest(id=machine_id), **kwargs).wait()
            boot = instance.spec.boot_disk
            if not boot.check_presence("managed_disk"):
                raise InvalidRequest(
                    f"instance {machine_id} boots from an existing disk; only managed boot disks can be reinstalled",
                    provider=PROVIDER,
                    code="unmanaged_boot_disk",
                )
            self._stop(s, machine_id)
            new_name = _next_disk_name(boot.managed_disk.name, instance.metadata.name)
            fresh = ManagedDisk(boot.managed_disk, name=new_name)
            spec = InstanceSpec(instance.spec, boot_disk=AttachedDiskSpec(boot, managed_disk=fresh))
            request = UpdateInstanceRequest(metadata=instance.metadata, spec=spec)
            self._wait(s.instances.update(request, **kwargs).wait())
            self._start(s, machine_id)

    def list_offers(self) -> list[Offer]:
        platform_name, preset_name = self._platform_preset(self.site.instance_type)
        parent_id = self._required("parent_id")
        with self._session("list platforms") as s:
            token = ""
            while True:
                page = s.platforms.list(
                    ListPlatformsRequest(parent_id=parent_id, page_size=100, page_token=token), **self._call_kwargs()
                ).wait()
                for platform in page.items:
                    if platform.metadata.name == platform_name:
                        return self._offers(platform, preset_name)
                token = page.next_page_token
                if not token:
                    return []

    def _offers(self, platform: Any, preset_name: str) -> list[Offer]:
        preset = next((p for p in platform.spec.presets if p.name == preset_name), None)
        if preset is None:
            return []
        site = self.site
        spot = site.capacity_type == CapacityType.SPOT
        return [site.offer(PROVIDER, gpus=preset.resources.gpu_count or site.gpus_per_machine,
                           gpu_memory_gb=site.gpu_memory_gb or platform.spec.gpu_memory_gigabytes,
                           available=platform.status.allowed_for_preemptibles if spot else True)]


def _next_disk_name(current: str, instance_name: str) -> str:
    """``node-boot`` -> ``node-boot-1`` -> ``node-boot-2``: a new name means a new disk."""
    base = f"{instance_name}-boot"
    match = re.fullmatch(re.escape(base) + r"-(\d+)", current)
    generation = int(match.group(1)) + 1 if match else 1
    return f"{base}-{generation}"
