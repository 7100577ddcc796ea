"""A loopback fake of the Lambda Cloud API v1, for the real httpx client.

Speaks the documented endpoints and JSON shapes under ``/api/v1``:
``GET /instance-types``, ``GET /images``, ``GET /instances``, ``GET /instances/{id}``,
``POST /instance-operations/launch|terminate|restart``. Launch checks what Lambda's API
reference says of its fields: ``image`` is ``{"id": ...}`` or ``{"family": ...}`` and names
one of the images ``/images`` lists in that region; ``user_data`` is a string of at most 1 MB. Errors use Lambda's body
``{"error": {"code", "message", "suggestion"}}`` with the codes, messages and
statuses of Lambda's published API models. Authentication is a bearer API key
(or the key as the basic-auth user name, which Lambda also accepts).

Launch can be rate limited like the real one (``launch_interval_s``); the 429
body is plain text because its shape is not documented.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: Real error bodies, by the name of the error in Lambda's API models.
ERRORS: dict[str, tuple[int, dict[str, Any]]] = {
    "invalid-api-key": (
        401,
        {
            "code": "global/invalid-api-key",
            "message": "API key was invalid, expired, or deleted.",
            "suggestion": "Check your API key or create a new one, then try again.",
        },
    ),
    "account-inactive": (
        403,
        {
            "code": "global/account-inactive",
            "message": "Your account is inactive.",
            "suggestion": "Make sure you have verified your email address and have a valid payment method. "
            "Contact Support if problems continue.",
        },
    ),
    "insufficient-capacity": (
        400,
        {
            "code": "instance-operations/launch/insufficient-capacity",
            "message": "Not enough capacity to fulfill launch request.",
            "suggestion": "Choose an instance type with more availability, or try again later.",
        },
    ),
    "quota-exceeded": (
        400,
        {
            "code": "global/quota-exceeded",
            "message": "Quota exceeded.",
            "suggestion": "Contact Support to increase your quota.",
        },
    ),
    "invalid-parameters": (
        400,
        {"code": "global/invalid-parameters", "message": "Invalid request data."},
    ),
    "instance-not-found": (
        404,
        {"code": "global/object-does-not-exist", "message": "Specified instance does not exist."},
    ),
    "unknown": (
        500,
        {"code": "global/unknown", "message": "An unknown error occurred."},
    ),
}

#: Contract error kind -> (which requests it hits, error name or "rate-limited").
FAULTS = {
    "NoCapacity": ("launch", "insufficient-capacity"),
    "OverQuota": ("launch", "quota-exceeded"),
    "BadCredentials": ("any", "invalid-api-key"),
    "Transient": ("launch", "rate-limited"),
    "InvalidRequest": ("launch", "invalid-parameters"),
}

DEFAULT_INSTANCE_TYPES: dict[str, dict[str, Any]] = {
    "gpu_8x_h100_sxm5": {
        "instance_type": {
            "name": "gpu_8x_h100_sxm5",
            "description": "8x H100 (80 GB SXM5)",
            "gpu_description": "H100 (80 GB SXM5)",
            "price_cents_per_hour": 2392,
            "specs": {"vcpus": 208, "memory_gib": 1800, "storage_gib": 24780, "gpus": 8},
        },
        "regions_with_capacity_available": [{"name": "us-east-1", "description": "Virginia, USA"}],
    },
    "gpu_1x_a10": {
        "instance_type": {
            "name": "gpu_1x_a10",
            "description": "1x A10 (24 GB PCIe)",
            "gpu_description": "A10 (24 GB PCIe)",
            "price_cents_per_hour": 75,
            "specs": {"vcpus": 30, "memory_gib": 200, "storage_gib": 1400, "gpus": 1},
        },
        "regions_with_capacity_available": [],
    },
}

REGIONS = {"us-east-1": "Virginia, USA", "us-west-1": "California, USA"}

#: ``GET /images`` (Lambda's Image schema); Lambda's own images only.
DEFAULT_IMAGES: list[dict[str, Any]] = [
    {"id": "43336648-096d-4cba-9aa2-f9bb7727639d", "name": "ubuntu-24.04.01", "description": "Ubuntu LTS",
     "family": "ubuntu-lts", "version": "24.04.01", "architecture": "x86_64"},
    {"id": "ddaedf1b7a0e41ac981711504493b242", "name": "lambda-stack-24.04", "description": "Lambda Stack",
     "family": "lambda-stack", "version": "24.04", "architecture": "x86_64"},
]
#: Launch's ``user_data``: "cannot exceed 1MB in size".
MAX_USER_DATA_BYTES = 1_000_000


class FakeLambdaCloud:
    def __init__(self, api_key: str, ssh_keys: tuple[str, ...] = ("gpufleet",)) -> None:
        self.api_key = api_key
        self.ssh_keys = set(ssh_keys)
        self._lock = threading.Lock()
        self.reset()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - silence
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                status, body, headers = fake.handle(self.command, self.path, dict(self.headers.items()), raw)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # -- control ------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/api/v1"

    def start(self) -> "FakeLambdaCloud":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        with self._lock:
            self.instances: dict[str, dict[str, Any]] = {}
            #: instance id → the user data it was launched with (never in an instance's answer).
            self.user_data: dict[str, str | None] = {}
            self.instance_types = json.loads(json.dumps(DEFAULT_INSTANCE_TYPES))
            self.images = [{**image, "created_time": "2026-01-05T10:00:00+00:00",
                            "updated_time": "2026-01-05T10:00:00+00:00",
                            "region": {"name": region, "description": description}}
                           for image in DEFAULT_IMAGES for region, description in REGIONS.items()]
            #: instance id → the ``image`` it was launched with (None: Lambda's default).
            self.launch_images: dict[str, dict[str, str] | None] = {}
            self.faults: list[tuple[str, str]] = []
            self.requests: list[tuple[str, str, Any]] = []
            self.launch_interval_s = 0.0
            self._last_launch = 0.0
            self._ready_at: dict[str, float] = {}
            self.boot_seconds = 0.05

    def fail_next(self, kind: str) -> None:
        with self._lock:
            self.faults.append(FAULTS[kind])

    def live_instances(self) -> list[dict[str, Any]]:
        with self._lock:
            return [i for i in self.instances.values() if i["status"] not in ("terminating", "terminated")]

    # -- HTTP -----------------------------------------------------------------------

    def _authorized(self, headers: dict[str, str]) -> bool:
        auth = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
        if auth.startswith("Bearer "):
            return auth[len("Bearer ") :] == self.api_key
        if auth.startswith("Basic "):
            user = base64.b64decode(auth[len("Basic ") :]).decode().partition(":")[0]
            return user == self.api_key
        return False

    @staticmethod
    def _json(status: int, payload: Any) -> tuple[int, bytes, dict[str, str]]:
        return status, json.dumps(payload).encode(), {"Content-Type": "application/json"}

    def _error(self, name: str, **extra: Any) -> tuple[int, bytes, dict[str, str]]:
        if name == "rate-limited":
            return 429, b"429 Too Many Requests", {"Content-Type": "text/plain", "Retry-After": "12"}
        status, error = ERRORS[name]
        return self._json(status, {"error": error, **extra})

    def handle(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, bytes, dict[str, str]]:
        body = json.loads(raw) if raw else None
        path = path.split("?")[0].rstrip("/")
        with self._lock:
            self.requests.append((method, path, body))
            is_launch = path.endswith("/instance-operations/launch")
            for fault in self.faults:
                if fault[0] == "any" or (fault[0] == "launch" and is_launch):
                    self.faults.remove(fault)
                    return self._error(fault[1])
            if not self._authorized(headers):
                return self._error("invalid-api-key")
            return self._route(method, path, body)

    def _route(self, method: str, path: str, body: Any) -> tuple[int, bytes, dict[str, str]]:
        if not path.startswith("/api/v1/"):
            return self._json(404, {"error": {"code": "global/object-does-not-exist", "message": "Not found."}})
        route = path[len("/api/v1") :]
        if method == "GET" and route == "/instance-types":
            return self._json(200, {"data": self.instance_types})
        if method == "GET" and route == "/images":
            return self._json(200, {"data": self.images})
        if method == "GET" and route == "/instances":
            self._advance()
            return self._json(200, {"data": [i for i in self.instances.values() if i["status"] != "terminated"]})
        match = re.fullmatch(r"/instances/([^/]+)", route)
        if method == "GET" and match:
            self._advance()
            instance = self.instances.get(match.group(1))
            return self._json(200, {"data": instance}) if instance else self._error("instance-not-found")
        if method == "POST" and route == "/instance-operations/launch":
            return self._launch(body or {})
        if method == "POST" and route == "/instance-operations/terminate":
            return self._operate(body or {}, "terminated", "terminated_instances")
        if method == "POST" and route == "/instance-operations/restart":
            return self._operate(body or {}, "booting", "restarted_instances")
        return self._json(404, {"error": {"code": "global/object-does-not-exist", "message": "Not found."}})

    def _advance(self) -> None:
        """Booting instances become active a moment after launch or restart."""
        now = time.monotonic()
        for instance_id, ready_at in list(self._ready_at.items()):
            if now >= ready_at:
                del self._ready_at[instance_id]
                if self.instances[instance_id]["status"] == "booting":
                    self.instances[instance_id]["status"] = "active"

    def _launch(self, body: dict[str, Any]) -> tuple[int, bytes, dict[str, str]]:
        now = time.monotonic()
        if self.launch_interval_s and now - self._last_launch < self.launch_interval_s:
            return self._error("rate-limited")
        self._last_launch = now
        entry = self.instance_types.get(body.get("instance_type_name"))
        region = body.get("region_name")
        keys = body.get("ssh_key_names") or []
        if entry is None or region not in REGIONS or len(keys) != 1 or body.get("quantity", 1) != 1:
            return self._error("invalid-parameters")
        if keys[0] not in self.ssh_keys:
            return self._json(
                404,
                {
                    "error": {
                        "code": "global/object-does-not-exist",
                        "message": f"SSH key {keys[0]!r} was not found.",
                        "suggestion": "Add the SSH key to your account, then try again.",
                    }
                },
            )
        image = body.get("image")
        if image is not None and not (isinstance(image, dict) and len(image) == 1
                                      and next(iter(image)) in ("id", "family")
                                      and isinstance(next(iter(image.values())), str)):
            return self._error("invalid-parameters")  # neither ImageSpecificationID nor ImageSpecificationFamily
        user_data = body.get("user_data")
        if user_data is not None and (not isinstance(user_data, str)
                                      or len(user_data.encode()) > MAX_USER_DATA_BYTES):
            return self._error("invalid-parameters")
        if image is not None:
            [(kind, value)] = image.items()
            if not any(i[kind] == value and i["region"]["name"] == region for i in self.images):
                return self._json(404, {"error": {"code": "global/object-does-not-exist",
                                                  "message": "Specified image does not exist."}})
        if region not in {r["name"] for r in entry["regions_with_capacity_available"]}:
            return self._error("insufficient-capacity")
        instance_id = uuid.uuid4().hex
        self.instances[instance_id] = {
            "id": instance_id,
            "name": body.get("name"),
            "ip": "192.0.2.10",
            "private_ip": "10.19.0.10",
            "status": "booting",
            "ssh_key_names": keys,
            "file_system_names": body.get("file_system_names") or [],
            "region": {"name": region, "description": REGIONS[region]},
            "instance_type": entry["instance_type"],
            "hostname": f"{instance_id[:8]}.cloud.lambdalabs.com",
            "jupyter_token": uuid.uuid4().hex,
            "jupyter_url": f"https://jupyter-{instance_id[:8]}.lambdaspaces.com/?token=redacted",
            "is_reserved": False,
        }
        self._ready_at[instance_id] = now + self.boot_seconds
        self.user_data[instance_id] = body.get("user_data")
        self.launch_images[instance_id] = image
        return self._json(200, {"data": {"instance_ids": [instance_id]}})

    def _operate(self, body: dict[str, Any], status: str, key: str) -> tuple[int, bytes, dict[str, str]]:
        ids = body.get("instance_ids") or []
        if not ids:
            return self._error("invalid-parameters")
        found = [self.instances.get(i) for i in ids]
        if any(i is None or i["status"] == "terminated" for i in found):
            return self._error("instance-not-found")
        for instance in found:
            instance["status"] = status
            if status == "booting":
                self._ready_at[instance["id"]] = time.monotonic() + self.boot_seconds
        return self._json(200, {"data": {key: found}})
