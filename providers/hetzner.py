"""Hetzner Cloud adapter, over the official ``hcloud`` SDK (REST + JSON).

Hetzner quirks this module absorbs:

* **No idempotency keys.** Server names are unique per project, so the node
  name (``spec.name``) is the idempotency key: create looks the name up
  first, and a ``uniqueness_error`` answer (a concurrent create won the race)
  means "already exists, return it". A server of that name that carries
  another site's label is refused with ``InvalidRequest``.
* **The SDK retries by itself** (``conflict``, ``rate_limit_exceeded``,
  ``timeout``, ``bad_gateway``, 502/504) for up to five tries with backoff
  capped at 60 s. Temporal owns retries here, so the adapter switches that off
  (a private attribute of ``hcloud``'s client; there is no public knob).
* **Errors** come as ``{"error": {"code", "message", "details"}}`` with an
  HTTP status; ``APIException.code`` is the machine word and the only thing
  classified (table ``ERRORS``). A body that is not JSON gives the HTTP status
  as an ``int`` code (table ``HTTP_STATUS_ERRORS``); a 404 without a Hetzner
  body is *not* read as "server gone" (a wrong ``api_endpoint`` says 404 too).
* **Reboot is ``reset``** (cut power, start again). Hetzner's ``reboot`` is an
  ACPI request a wedged GPU host ignores, and the port asks for a hard reboot.
* **Reinstall is ``rebuild``** from the server's own image (falling back to the
  site's image when the server's image was deleted), with the fresh user data the
  control plane hands it (a new join token: ``rebuild`` takes ``user_data``). The id
  stays the same. The server is started after the rebuild if it is still off.
  ``stop_machine`` (``poweroff``) is the reinstall's first half: the control plane
  powers the server off and waits until its Node is NotReady before the rebuild
  (kubeadm refuses to join while a Ready Node of the same name exists).
* **User data** is at most 32 KiB (``MAX_USER_DATA_BYTES``): a longer document is
  ``InvalidRequest`` before any call.
* Reset and rebuild return an *action*; the adapter waits for it, bounded by
  ``action_wait_s``; a timeout is ``Transient``. Create and delete do not wait
  (capacity and quota errors are synchronous answers to ``POST /servers``).
* Machines are labelled ``gpufleet.io/site=<site>``; ``list_machines`` selects
  on that label. ``spec.tags`` become labels too (Hetzner's label syntax).
* No spot market: every machine and offer is on-demand. Offers come from the
  server type's per-location entry (``available``, ``deprecation``); the price
  is the site's configured price (Hetzner bills in EUR, net/gross).

Account options: ``api_endpoint`` (default the public API), ``image``
(default ``ubuntu-24.04``; ``spec.image`` and ``site.image`` win),
``ssh_keys`` (names or ids), ``user_data``, ``action_wait_s`` (300),
``poll_interval_s`` (1.0), ``timeout_s`` (HTTP timeout, 30).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from typing import Any

import requests
from hcloud import APIException, Client
from hcloud.actions import ActionFailedException, ActionTimeoutException, BoundAction
from hcloud.images import Image
from hcloud.locations import Location
from hcloud.server_types import ServerType
from hcloud.servers import BoundServer, Server
from hcloud.ssh_keys import SSHKey

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
from providers.credentials import read_token

PROVIDER = "hetzner"
DEFAULT_ENDPOINT = "https://api.hetzner.cloud/v1"
DEFAULT_IMAGE = "ubuntu-24.04"
#: ``user_data`` at create and rebuild: "limited to 32KiB" (Hetzner Cloud API reference).
MAX_USER_DATA_BYTES = 32 * 1024
#: Label every server this control plane creates carries; list_machines selects on it.
SITE_LABEL = MACHINE_TAG_SITE

#: Hetzner error code (``error.code`` in the JSON body) -> taxonomy class.
ERRORS: dict[str, type[ProviderError]] = {
    "resource_unavailable": NoCapacity,
    "placement_error": NoCapacity,
    "no_space_left_in_location": NoCapacity,
    "resource_limit_exceeded": OverQuota,
    "unauthorized": BadCredentials,
    "forbidden": BadCredentials,
    "token_readonly": BadCredentials,
    "rate_limit_exceeded": Transient,
    "conflict": Transient,
    "locked": Transient,
    "server_error": Transient,
    "service_error": Transient,
    "maintenance": Transient,
    "timeout": Transient,
    "bad_gateway": Transient,
    "invalid_input": InvalidRequest,
    "json_error": InvalidRequest,
    "uniqueness_error": InvalidRequest,
    "protected": InvalidRequest,
    "invalid_server_type": InvalidRequest,
    "unsupported_error": InvalidRequest,
    "not_found": NotFound,
}

#: HTTP status -> class, for answers without a Hetzner JSON error body.
HTTP_STATUS_ERRORS: dict[int, type[ProviderError]] = {
    400: InvalidRequest,
    401: BadCredentials,
    403: BadCredentials,
    422: InvalidRequest,
}

#: Hetzner server status -> Machine.state.
STATES: dict[str, str] = {
    "initializing": "pending",
    "starting": "pending",
    "running": "running",
    "stopping": "stopped",
    "off": "stopped",
    "rebuilding": "rebooting",
    "migrating": "running",
    "deleting": "terminated",
    "unknown": "pending",
}


def classify(code: str | int, message: str) -> ProviderError:
    """The taxonomy exception for one Hetzner error code; unknown -> Transient."""
    table: dict[Any, type[ProviderError]] = HTTP_STATUS_ERRORS if isinstance(code, int) else ERRORS
    cls = table.get(code)
    if cls is None:
        return Transient(f"unclassified Hetzner error {code!r}: {message}", provider=PROVIDER, code=str(code))
    return cls(f"{message} ({code})", provider=PROVIDER, code=str(code))


def _translated(action: str) -> AbstractContextManager[None]:
    """Turn SDK and transport failures inside the block into the taxonomy."""
    return translated(lambda exc: _sdk_error(exc, action), answered=_answered)


def _answered(exc: Exception) -> bool:
    """Whether the SDK failure is Hetzner's answer (not the transport's, which quotes headers)."""
    return isinstance(exc, (APIException, ActionFailedException, ActionTimeoutException))


def _sdk_error(exc: Exception, action: str) -> ProviderError | None:
    if isinstance(exc, APIException):
        return classify(exc.code, f"{action}: {exc.message}")
    if isinstance(exc, ActionFailedException):
        error = exc.action.error or {}
        code = error.get("code") or "action_failed"
        return classify(code, f"{action}: {error.get('message', 'action failed')}")
    if isinstance(exc, ActionTimeoutException):
        return Transient(f"{action}: action still running", provider=PROVIDER, code="action_timeout")
    if isinstance(exc, requests.RequestException):
        return Transient(
            f"{action}: {type(exc).__name__} talking to the Hetzner API", provider=PROVIDER, code="connection_error"
        )
    return None


def _addresses(server: BoundServer | Server) -> list[str]:
    """The server's private and public IPv4 addresses."""
    found = [getattr(net, "ip", "") for net in getattr(server, "private_net", None) or []]
    ipv4 = getattr(getattr(server, "public_net", None), "ipv4", None)
    found.append(getattr(ipv4, "ip", "") if ipv4 is not None else "")
    return [ip for ip in found if ip]


def _server_id(machine_id: str) -> int | None:
    """Hetzner ids are integers; anything else cannot name a server."""
    return int(machine_id) if machine_id.isdigit() else None


def _image(ref: str) -> Image:
    return Image(id=int(ref)) if ref.isdigit() else Image(name=ref)


def _ssh_key(ref: Any) -> SSHKey:
    text = str(ref)
    return SSHKey(id=int(text)) if text.isdigit() else SSHKey(name=text)


class HetznerProvider:
    """One Hetzner Cloud project (API token) at one location (``site.region``)."""

    name = PROVIDER

    def __init__(self, site: Site, account: Account) -> None:
        self.site = site
        self.account = account

    # -- plumbing -----------------------------------------------------------

    def _client(self) -> Client:
        """A fresh SDK client; reads the token now, makes no call yet."""
        token = read_token(self.account.credentials, provider=PROVIDER)
        poll = float(self.account.option("poll_interval_s", 1.0))
        client = Client(
            token=token,
            api_endpoint=str(self.account.option("api_endpoint", DEFAULT_ENDPOINT)).rstrip("/"),
            application_name="gpufleet",
            poll_interval=poll,
            poll_max_retries=max(1, math.ceil(float(self.account.option("action_wait_s", 300)) / poll)),
            timeout=float(self.account.option("timeout_s", 30)),
        )
        # Temporal retries; the SDK's own loop would hide Transient errors for a minute.
        base = getattr(client, "_client", None)
        if base is not None and hasattr(base, "_retry_max_retries"):
            base._retry_max_retries = 0
        return client

    def _machine(self, server: BoundServer | Server) -> Machine:
        server_type = getattr(server, "server_type", None)
        return Machine(
            id=str(server.id),
            name=server.name or "",
            site=self.site.name,
            provider=PROVIDER,
            instance_type=(server_type.name if server_type is not None else "") or "",
            state=STATES.get(server.status or "unknown", "pending"),
            capacity_type=CapacityType.ON_DEMAND,
            created_at=server.created,
            # The ownership marker: the fleet labels every server it creates with its site.
            owned=(server.labels or {}).get(SITE_LABEL) == self.site.name,
            addresses=_addresses(server),
        )

    def _labels(self, spec: MachineSpec) -> dict[str, str]:
        return {**spec.tags, SITE_LABEL: self.site.name}

    def _create_image(self, spec: MachineSpec) -> str:
        return spec.image or self.site.image or str(self.account.option("image", DEFAULT_IMAGE))

    def _wait(self, action: BoundAction) -> None:
        action.wait_until_finished()

    # -- the Provider verbs ---------------------------------------------------

    def _check_user_data(self, user_data: str) -> None:
        size = len(user_data.encode())
        if size > MAX_USER_DATA_BYTES:
            raise InvalidRequest(f"site {self.site.name}: user_data is {size} bytes; Hetzner takes at most "
                                 f"{MAX_USER_DATA_BYTES}", provider=PROVIDER, code="user_data-too-large")

    def create_machine(self, spec: MachineSpec, idempotency_key: str, user_data: str = "") -> Machine:
        """Create ``spec.name``; the name is the idempotency key (see module doc)."""
        self._check_user_data(user_data)
        client = self._client()
        with _translated("create server"):
            server = client.servers.get_by_name(spec.name)
            if server is None:
                server = self._create(client, spec, user_data)
            return self._owned(server)

    def _create(self, client: Client, spec: MachineSpec, user_data: str = "") -> BoundServer:
        ssh_keys = [_ssh_key(ref) for ref in self.account.option("ssh_keys", [])]
        try:
            response = client.servers.create(
                name=spec.name,
                server_type=ServerType(name=spec.instance_type or self.site.instance_type),
                image=_image(self._create_image(spec)),
                location=Location(name=spec.region or self.site.region),
                labels=self._labels(spec),
                ssh_keys=ssh_keys or None,
                # The machine's own bootstrap; the account's fixed option only without one.
                user_data=user_data or self.account.options.get("user_data"),
            )
        except APIException as exc:
            if exc.code != "uniqueness_error":
                raise
            # A concurrent create of the same name won the race: that server is ours.
            existing = client.servers.get_by_name(spec.name)
            if existing is None:
                raise
            return existing
        return response.server

    def _owned(self, server: BoundServer) -> Machine:
        """Refuse a same-named server that another site created."""
        site = (server.labels or {}).get(SITE_LABEL)
        if site != self.site.name:
            raise InvalidRequest(
                f"a server named {server.name!r} already exists and is not labelled {SITE_LABEL}={self.site.name}",
                provider=PROVIDER,
                code="name_taken",
            )
        return self._machine(server)

    def delete_machine(self, machine_id: str) -> None:
        server_id = _server_id(machine_id)
        if server_id is None:
            return
        client = self._client()
        try:
            with _translated("delete server"):
                client.servers.delete(Server(id=server_id))
        except NotFound:
            return

    def get_machine(self, machine_id: str) -> Machine:
        server_id = _server_id(machine_id)
        if server_id is None:
            raise NotFound(f"no Hetzner server {machine_id!r}", provider=PROVIDER, code="not_found")
        client = self._client()
        with _translated("get server"):
            return self._machine(client.servers.get_by_id(server_id))

    def list_machines(self) -> list[Machine]:
        client = self._client()
        with _translated("list servers"):
            servers = client.servers.get_all(label_selector=f"{SITE_LABEL}={self.site.name}")
        return [self._machine(server) for server in servers]

    def reboot_machine(self, machine_id: str) -> None:
        """Hard reboot: Hetzner ``reset`` (power cut), not the ACPI ``reboot``."""
        server = Server(id=self._existing_id(machine_id))
        client = self._client()
        with _translated("reset server"):
            self._wait(client.servers.reset(server))

    def stop_machine(self, machine_id: str) -> None:
        """Power off (``poweroff``, a power cut: the GPU host may be wedged), waiting for it."""
        server_id = self._existing_id(machine_id)
        client = self._client()
        with _translated("power off server"):
            server = client.servers.get_by_id(server_id)
            if server.status != "off":
                self._wait(client.servers.power_off(server))

    def reinstall_machine(self, machine_id: str, user_data: str = "") -> None:
        """``rebuild`` from the server's own image with ``user_data`` (its fresh bootstrap; none:
        the server keeps what it was created with); same id, fresh disk, running after."""
        self._check_user_data(user_data)
        server_id = self._existing_id(machine_id)
        client = self._client()
        with _translated("rebuild server"):
            server = client.servers.get_by_id(server_id)
            image = server.image
            target = Image(id=image.id) if image is not None and image.id else _image(self._site_image())
            self._wait(client.servers.rebuild(server, target, user_data=user_data or None).action)
            if client.servers.get_by_id(server_id).status == "off":  # rebuilt from a powered-off server
                self._wait(client.servers.power_on(Server(id=server_id)))

    def _site_image(self) -> str:
        return self.site.image or str(self.account.option("image", DEFAULT_IMAGE))

    def _existing_id(self, machine_id: str) -> int:
        server_id = _server_id(machine_id)
        if server_id is None:
            raise NotFound(f"no Hetzner server {machine_id!r}", provider=PROVIDER, code="not_found")
        return server_id

    def list_offers(self) -> list[Offer]:
        """The site's server type at its location, if Hetzner lists it there."""
        client = self._client()
        with _translated("list server types"):
            server_type = client.server_types.get_by_name(self.site.instance_type)
        if server_type is None:
            return []
        return [self._offer(available=self._sells_here(server_type))]

    def _sells_here(self, server_type: Any) -> bool:
        for entry in server_type.locations or []:
            if entry.location.name != self.site.region:
                continue
            return entry.deprecation is None and entry.available is not False
        return False

    def _offer(self, *, available: bool) -> Offer:
        return self.site.offer(PROVIDER, capacity_type=CapacityType.ON_DEMAND, available=available)
