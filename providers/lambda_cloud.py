"""Lambda Cloud adapter (public API v1 over httpx).

Configuration
    ``account.credentials`` names a secret holding the Lambda Cloud API key (sent as
    ``Authorization: Bearer``). ``account.options``: ``ssh_key_names`` (required by
    Lambda: the name of one SSH key already registered in the account),
    ``file_system_names`` (optional list), ``api_base`` (default
    ``https://cloud.lambdalabs.com/api/v1``), ``timeout`` (seconds, default 30).
    The region is ``site.region`` (e.g. ``us-east-1``), the instance type is
    ``spec.instance_type`` (e.g. ``gpu_8x_h100_sxm5``). The machine image is
    ``spec.image`` or ``site.image``: one of Lambda's own images (Lambda takes no image of
    yours), by id (``id:<id>``, or a bare UUID / 32 hex digits) or by family
    (``family:<name>``, or any other bare name), sent as launch's ``image: {"id"}`` or
    ``{"family"}``; none: Lambda's default, the latest Lambda Stack. None of Lambda's images
    has kubeadm or the kubelet: the user data's install step fetches them at first boot.

Quirks
    * No idempotency key and no tags. ``create_machine`` names the instance
      ``spec.name`` (the control plane derives it from the idempotency key, so one
      key means one name) and first looks for a live instance of that name in the
      region: a repeat returns it instead of launching again. Two creates racing
      for the same name can still both launch; the workflow runs one at a time.
    * Launch is rate limited (about one request per 12 s per account). A 429 is
      raised as ``Transient`` at once and Temporal's retry policy backs off; the
      adapter never sleeps. 429 is classified by status because its body is not
      guaranteed to be Lambda's JSON error.
    * Capacity is checked from ``/instance-types`` before launching: when the site's
      region is not in ``regions_with_capacity_available`` the adapter raises
      ``NoCapacity`` without calling launch (saving the rate-limited call).
    * Errors: ``{"error": {"code", "message", "suggestion"}}``; the code maps through
      ``ERROR_CODES`` (then ``PREFIX_ERRORS``); anything else, 5xx included, is
      ``Transient`` with the raw code in the message. On launch,
      ``global/object-does-not-exist`` names a missing SSH key or file system, so it
      is ``InvalidRequest`` there (``LAUNCH_OVERRIDES``), not ``NotFound``.
    * The image is checked against ``/images`` in the site's region before launching: an
      unknown one is ``InvalidRequest`` naming ``site.image`` (no launch, which is rate limited).
    * ``user_data`` is plain text of at most 1 MB (``MAX_USER_DATA_BYTES``); a longer document
      is ``InvalidRequest`` before any call.
    * There is no reimage call. ``reinstall_machine`` raises ``InvalidRequest``
      rather than terminate+relaunch, which would change the machine id behind
      the control plane's back; the repair workflow replaces the node instead.
    * ``reboot_machine`` is ``/instance-operations/restart`` (Lambda does not say
      whether it is a soft or hard restart).
    * ``list_machines`` returns live instances in the site's region of the site's
      instance type: Lambda has no tags, so the fleet's ownership marker is the
      name (``<site>-<8 hex>``, ``is_fleet_name``); the sweep deletes only those.
    * Offers take the price from the API (``price_cents_per_hour`` / GPUs), falling
      back to ``site.price_per_gpu_hour``.
"""

from __future__ import annotations

import math
import re
from typing import Any

import httpx

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
from fleet.models import MAX_PRICE_PER_GPU_HOUR, CapacityType, Machine, MachineSpec, Offer
from providers.credentials import read_token
from providers.http_api import error_object, send

PROVIDER = "lambda"
DEFAULT_API_BASE = "https://cloud.lambdalabs.com/api/v1"
#: Launch's ``user_data``: "plain text and cannot exceed 1MB in size" (Lambda's API reference).
MAX_USER_DATA_BYTES = 1_000_000
_IMAGE_ID = re.compile(r"^([0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$")

#: Lambda error code -> taxonomy.
ERROR_CODES: dict[str, type[ProviderError]] = {
    "instance-operations/launch/insufficient-capacity": NoCapacity,
    "global/quota-exceeded": OverQuota,
    "global/invalid-api-key": BadCredentials,
    "global/account-inactive": BadCredentials,
    "global/invalid-address": BadCredentials,  # billing address: a person must fix the account
    "global/invalid-parameters": InvalidRequest,
    "instance-operations/launch/file-system-in-wrong-region": InvalidRequest,
    "instance-operations/launch/file-systems-not-supported": InvalidRequest,
    "global/object-does-not-exist": NotFound,
    "global/unknown": Transient,
}
#: Code prefixes -> taxonomy, after exact codes.
PREFIX_ERRORS: dict[str, type[ProviderError]] = {
    "provider/": Transient,
}
#: HTTP statuses that decide the class whatever the body says.
STATUS_ERRORS: dict[int, type[ProviderError]] = {
    429: Transient,
}
#: Launch-specific meanings of codes.
LAUNCH_OVERRIDES: dict[str, type[ProviderError]] = {
    "global/object-does-not-exist": InvalidRequest,
}

#: Lambda instance status -> Machine.state.
STATES = {
    "booting": "pending",
    "active": "running",
    "unhealthy": "running",
    "terminating": "terminated",
    "terminated": "terminated",
    "preempted": "terminated",
}
GONE = {"terminating", "terminated", "preempted"}


def is_fleet_name(name: str, site: str) -> bool:
    """The ownership marker: Lambda has no tags or labels, so the instance name is it. The
    fleet names every machine ``<site>-<8 hex>`` (``fleet.naming.node_name_for``); an
    instance named otherwise was launched by someone else and is never swept."""
    return re.fullmatch(re.escape(site) + r"-[0-9a-f]{8}", name) is not None


def image_spec(image: str) -> dict[str, str] | None:
    """Launch's ``image`` for a configured image: ``{"id": ...}`` or ``{"family": ...}``."""
    image = image.strip()
    if not image:
        return None
    kind, sep, value = image.partition(":")
    if sep and kind in ("id", "family") and value:
        return {kind: value}
    return {"id": image} if _IMAGE_ID.fullmatch(image) else {"family": image}


def classify(status: int, code: str, overrides: dict[str, type[ProviderError]] | None = None) -> type[ProviderError]:
    """The taxonomy class for an HTTP status and Lambda error code."""
    if status in STATUS_ERRORS:
        return STATUS_ERRORS[status]
    if overrides and code in overrides:
        return overrides[code]
    if code in ERROR_CODES:
        return ERROR_CODES[code]
    for prefix, cls in PREFIX_ERRORS.items():
        if code.startswith(prefix):
            return cls
    return Transient


def _error(response: httpx.Response, what: str, overrides: dict[str, type[ProviderError]] | None) -> ProviderError:
    body = error_object(response)
    code = str(body.get("code") or f"http-{response.status_code}")
    cls = classify(response.status_code, code, overrides)
    message = f"Lambda {what}: HTTP {response.status_code} {code}: {body.get('message', '')}"
    if body.get("suggestion"):
        message += f" ({body['suggestion']})"
    return cls(message, provider=PROVIDER, code=code)


class LambdaProvider:
    """One Lambda Cloud account in one region."""

    name = PROVIDER

    def __init__(self, site: Site, account: Account) -> None:
        self.site = site
        self.account = account
        self.options = dict(account.options)
        self.api_base = str(self.options.get("api_base", DEFAULT_API_BASE)).rstrip("/")

    # -- plumbing ---------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        overrides: dict[str, type[ProviderError]] | None = None,
    ) -> Any:
        """``data`` of a successful answer; a taxonomy error otherwise."""
        key = read_token(self.account.credentials, provider=PROVIDER)
        what = f"{method} {path}"

        def call() -> httpx.Response:
            with httpx.Client(
                base_url=self.api_base,
                headers={"Authorization": f"Bearer {key}", "Accept": "application/json"},
                timeout=float(self.options.get("timeout", 30)),
            ) as client:
                return client.request(method, path, json=body)

        response = send(call, f"Lambda {what}", PROVIDER)
        if not response.is_success:
            raise _error(response, what, overrides)
        try:
            return response.json()["data"]
        except (ValueError, KeyError, TypeError) as exc:
            raise Transient(f"Lambda {what}: unreadable answer", provider=PROVIDER, code="bad-body") from exc

    def _machine(self, instance: dict[str, Any]) -> Machine:
        return Machine(
            id=instance["id"],
            name=instance.get("name") or "",
            site=self.site.name,
            provider=PROVIDER,
            instance_type=(instance.get("instance_type") or {}).get("name", ""),
            state=STATES.get(instance.get("status", ""), "pending"),
            capacity_type=CapacityType.ON_DEMAND,
            owned=is_fleet_name(instance.get("name") or "", self.site.name),
            addresses=[ip for ip in (instance.get("private_ip"), instance.get("ip")) if ip],
        )

    def _live_instances(self) -> list[dict[str, Any]]:
        return [
            i
            for i in self._request("GET", "/instances")
            if (i.get("region") or {}).get("name") == self.site.region and i.get("status") not in GONE
        ]

    def _instance_type(self, instance_type: str) -> dict[str, Any] | None:
        return self._request("GET", "/instance-types").get(instance_type)

    # -- Provider ---------------------------------------------------------------

    def create_machine(self, spec: MachineSpec, idempotency_key: str, user_data: str = "") -> Machine:
        ssh_keys = self.options.get("ssh_key_names") or []
        if not ssh_keys:
            raise InvalidRequest(
                f"account {self.account.name}: options.ssh_key_names is required by Lambda",
                provider=PROVIDER,
                code="config/ssh_key_names",
            )
        if len(user_data.encode()) > MAX_USER_DATA_BYTES:
            raise InvalidRequest(
                f"site {self.site.name}: user_data is {len(user_data.encode())} bytes; Lambda takes at most "
                f"{MAX_USER_DATA_BYTES}", provider=PROVIDER, code="user_data-too-large")
        for instance in self._live_instances():
            if instance.get("name") == spec.name:
                return self._machine(instance)
        instance_type = spec.instance_type or self.site.instance_type
        image = image_spec(spec.image or self.site.image)
        self._check_capacity(instance_type)
        if image is not None:
            self._check_image(image)
        launch = {
            "region_name": self.site.region,
            "instance_type_name": instance_type,
            "ssh_key_names": list(ssh_keys),
            "name": spec.name,
            "quantity": 1,
        }
        if image is not None:
            launch["image"] = image
        if self.options.get("file_system_names"):
            launch["file_system_names"] = list(self.options["file_system_names"])
        if user_data:
            launch["user_data"] = user_data
        data = self._request("POST", "/instance-operations/launch", launch, overrides=LAUNCH_OVERRIDES)
        return Machine(
            id=data["instance_ids"][0],
            name=spec.name,
            site=self.site.name,
            provider=PROVIDER,
            instance_type=instance_type,
            state="pending",
        )

    def _check_capacity(self, instance_type: str) -> None:
        entry = self._instance_type(instance_type)
        if entry is None:
            raise InvalidRequest(
                f"Lambda has no instance type {instance_type!r}",
                provider=PROVIDER,
                code="unknown-instance-type",
            )
        regions = {r.get("name") for r in entry.get("regions_with_capacity_available", [])}
        if self.site.region not in regions:
            raise NoCapacity(
                f"Lambda lists no capacity for {instance_type} in {self.site.region}",
                provider=PROVIDER,
                code="regions_with_capacity_available",
            )

    def _check_image(self, image: dict[str, str]) -> None:
        """The image is one of Lambda's in the site's region (launch would refuse it anyway, but
        only after a rate-limited call, and with a message that does not name the site's field)."""
        [(kind, value)] = image.items()
        for entry in self._request("GET", "/images"):
            if entry.get(kind) == value and (entry.get("region") or {}).get("name") == self.site.region:
                return
        raise InvalidRequest(
            f"site {self.site.name}: image: Lambda has no image of {kind} {value!r} in {self.site.region} "
            "(GET /images lists them; Lambda takes no images of your own)",
            provider=PROVIDER, code="unknown-image")

    def delete_machine(self, machine_id: str) -> None:
        try:
            instance = self._request("GET", f"/instances/{machine_id}")
            if instance.get("status") in GONE:
                return
            self._request("POST", "/instance-operations/terminate", {"instance_ids": [machine_id]})
        except NotFound:
            return

    def get_machine(self, machine_id: str) -> Machine:
        return self._machine(self._request("GET", f"/instances/{machine_id}"))

    def list_machines(self) -> list[Machine]:
        return [
            self._machine(i)
            for i in self._live_instances()
            if (i.get("instance_type") or {}).get("name") == self.site.instance_type
        ]

    def reboot_machine(self, machine_id: str) -> None:
        self._request("POST", "/instance-operations/restart", {"instance_ids": [machine_id]})

    def reinstall_machine(self, machine_id: str, user_data: str = "") -> None:
        raise InvalidRequest(
            f"Lambda cannot reimage instance {machine_id} in place; replace the node instead",
            provider=PROVIDER,
            code="reinstall-unsupported",
        )

    def list_offers(self) -> list[Offer]:
        entry = self._instance_type(self.site.instance_type)
        if entry is None:
            return []
        itype = entry.get("instance_type", {})
        gpus = int((itype.get("specs") or {}).get("gpus") or self.site.gpus_per_machine)
        cents = itype.get("price_cents_per_hour")
        price = _price_per_gpu_hour(cents, gpus) if cents is not None else self.site.price_per_gpu_hour
        regions = {r.get("name") for r in entry.get("regions_with_capacity_available", [])}
        return [self.site.offer(PROVIDER, gpus=gpus, price_per_gpu_hour=round(price, 4),
                                capacity_type=CapacityType.ON_DEMAND, available=self.site.region in regions)]


def _price_per_gpu_hour(cents: Any, gpus: int) -> float:
    """Lambda's ``price_cents_per_hour`` per GPU, in dollars. An answer that is no price ("NaN",
    "inf", 1e400, a negative or absurd number) is the site's error in the catalog: an infinite
    price in an offer is sent to workflows as null, which none of them can decode."""
    try:
        price = float(cents) / 100 / gpus
    except (TypeError, ValueError, ZeroDivisionError):
        price = math.nan
    if not (math.isfinite(price) and 0 <= price <= MAX_PRICE_PER_GPU_HOUR):
        raise ProviderError(f"Lambda answered price_cents_per_hour={str(cents)[:40]!r} for {gpus} GPUs: not a price",
                            provider=PROVIDER, code="bad-price")
    return price
