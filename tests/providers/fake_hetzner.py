"""A local Hetzner Cloud API: the real JSON shapes over real HTTP.

Serves the part of https://docs.hetzner.cloud the adapter uses (servers,
server types, actions) from a ``ThreadingHTTPServer`` on 127.0.0.1, so the
official ``hcloud`` client talks to it unchanged via ``api_endpoint=``.
Errors use Hetzner's body ``{"error": {"code", "message", "details"}}`` and
HTTP status. ``fail_next`` arms one error for the next matching request.
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

#: Real Hetzner error answers: (HTTP status, code, message, details).
ERROR_BODIES: dict[str, tuple[int, str, str, Any]] = {
    "NoCapacity": (412, "resource_unavailable", "error during placement", {}),
    "OverQuota": (403, "resource_limit_exceeded", "project limit exceeded", {"limits": [{"name": "project_limit"}]}),
    "BadCredentials": (401, "unauthorized", "unable to authenticate", None),
    "Transient": (429, "rate_limit_exceeded", "limit of 3600 requests per hour reached", None),
    "InvalidRequest": (
        400,
        "invalid_input",
        "invalid input in field 'server_type'",
        {"fields": [{"name": "server_type", "messages": ["Server type is not supported in this location"]}]},
    ),
    "Maintenance": (503, "maintenance", "cannot perform operation due to maintenance", None),
    "Locked": (423, "locked", "server is locked", None),
    "Protected": (423, "protected", "server is delete protected", None),
    "NoSpace": (412, "no_space_left_in_location", "no space left in location", None),
    "Unknown": (418, "brand_new_code", "something new", None),
}

LOCATIONS: dict[str, dict[str, Any]] = {
    "fsn1": {
        "id": 1,
        "name": "fsn1",
        "description": "Falkenstein DC Park 1",
        "country": "DE",
        "city": "Falkenstein",
        "latitude": 50.47612,
        "longitude": 12.370071,
        "network_zone": "eu-central",
    },
    "nbg1": {
        "id": 2,
        "name": "nbg1",
        "description": "Nuremberg DC Park 1",
        "country": "DE",
        "city": "Nuremberg",
        "latitude": 49.452102,
        "longitude": 11.076665,
        "network_zone": "eu-central",
    },
    "hel1": {
        "id": 3,
        "name": "hel1",
        "description": "Helsinki DC Park 1",
        "country": "FI",
        "city": "Helsinki",
        "latitude": 60.169855,
        "longitude": 24.938379,
        "network_zone": "eu-central",
    },
}

IMAGES: dict[str, dict[str, Any]] = {
    "ubuntu-24.04": {
        "id": 161547269,
        "type": "system",
        "status": "available",
        "name": "ubuntu-24.04",
        "description": "Ubuntu 24.04",
        "image_size": None,
        "disk_size": 5,
        "created": "2024-04-25T13:26:04+00:00",
        "created_from": None,
        "bound_to": None,
        "os_flavor": "ubuntu",
        "os_version": "24.04",
        "rapid_deploy": True,
        "protection": {"delete": False},
        "deprecated": None,
        "deleted": None,
        "labels": {},
        "architecture": "x86",
    },
}


def _now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


def server_type(
    id: int, name: str, *, cores: int, memory: float, disk: int, sold_in: dict[str, bool]
) -> dict[str, Any]:
    """A server type as ``GET /server_types`` returns it (per-location entries)."""

    def price(location: str) -> dict[str, Any]:
        return {
            "location": location,
            "price_hourly": {"net": "1.5000000000", "gross": "1.7850000000000"},
            "price_monthly": {"net": "935.0000000000", "gross": "1112.6500000000"},
            "included_traffic": 21990232555520,
            "price_per_tb_traffic": {"net": "1.0000000000", "gross": "1.1900000000"},
        }

    return {
        "id": id,
        "name": name,
        "description": name.upper(),
        "category": "dedicated_cpu",
        "cores": cores,
        "memory": memory,
        "disk": disk,
        "deprecated": False,
        "deprecation": None,
        "prices": [price(loc) for loc in sold_in],
        "storage_type": "local",
        "cpu_type": "dedicated",
        "architecture": "x86",
        "locations": [
            {
                "id": LOCATIONS[loc]["id"],
                "name": loc,
                "deprecation": None,
                "available": available,
                "recommended": available,
            }
            for loc, available in sold_in.items()
        ],
    }


class FakeHetzner:
    """State plus the HTTP server. ``url`` is the ``api_endpoint`` to use."""

    def __init__(self, token: str, server_types: list[dict[str, Any]]) -> None:
        self.token = token
        self.server_types = {t["name"]: t for t in server_types}
        self.servers: dict[int, dict[str, Any]] = {}
        #: server id → the user data it was created with (what its metadata service serves).
        self.user_data: dict[int, str | None] = {}
        self.actions: dict[int, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.resets: dict[int, int] = {}
        self.rebuilds: dict[int, list[Any]] = {}
        #: Whether a rebuild leaves a server that was off powered off (the adapter starts it
        #: either way; Hetzner's reference says only that it powers the server off first).
        self.rebuild_leaves_off = False
        self._armed: dict[str, list[tuple[int, Any]]] = {}
        #: Keep every action "running" (to test the adapter's bounded wait).
        self.hold_actions = False
        self._failing_actions: list[dict[str, Any]] = []
        self._ids = itertools.count(4711)
        self._action_ids = itertools.count(90001)
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.02,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> "FakeHetzner":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    # -- test controls -------------------------------------------------------

    def fail_next(self, route: str, kind: str) -> None:
        """Answer the next ``route`` (e.g. ``"POST /servers"``) with error ``kind``."""
        self.answer_next(route, *_error(*ERROR_BODIES[kind]))

    def answer_next(self, route: str, status: int, body: Any) -> None:
        """Answer the next ``route`` with exactly this status and JSON body."""
        with self._lock:
            self._armed.setdefault(route, []).append((status, body))

    def fail_next_action(self, code: str, message: str) -> None:
        """The next action polled ends in ``status: error`` with this error."""
        with self._lock:
            self._failing_actions.append({"code": code, "message": message, "details": {}})

    def live_servers(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.servers.values())

    def count(self, method: str, path: str) -> int:
        return sum(1 for m, p in self.requests if m == method and p == path)

    # -- request handling ----------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any, auth: str | None):
        """Return ``(status, json)`` for one request."""
        with self._lock:
            self.requests.append((method, path))
            if auth != f"Bearer {self.token}":
                return _error(401, "unauthorized", "unable to authenticate", None)
            route = f"{method} {_route_of(path)}"
            armed = self._armed.get(route)
            if armed:
                return armed.pop(0)
            return self._dispatch(method, path, query, body)

    def _dispatch(self, method: str, path: str, query: dict[str, list[str]], body: Any):
        parts = [p for p in path.split("/") if p][1:]  # drop "v1"
        if parts == ["server_types"] and method == "GET":
            return self._list("server_types", list(self.server_types.values()), query)
        if parts == ["servers"] and method == "GET":
            return self._list("servers", [self._public(s) for s in self._select(query)], query)
        if parts == ["servers"] and method == "POST":
            return self._create(body or {})
        if len(parts) == 2 and parts[0] == "actions" and method == "GET":
            return self._get_action(parts[1])
        if len(parts) >= 2 and parts[0] == "servers":
            server = self.servers.get(int(parts[1])) if parts[1].isdigit() else None
            if server is None:
                return _error(404, "not_found", f"server with ID '{parts[1]}' not found", None)
            return self._on_server(method, parts[2:], server, body or {})
        return _error(404, "not_found", "not found", None)

    def _list(self, key: str, items: list[dict[str, Any]], query: dict[str, list[str]]):
        name = query.get("name", [None])[0]
        if name is not None:
            items = [i for i in items if i["name"] == name]
        page = int(query.get("page", ["1"])[0])
        per_page = int(query.get("per_page", ["25"])[0])
        total = len(items)
        last = max(1, -(-total // per_page))
        window = items[(page - 1) * per_page : page * per_page]
        meta = {
            "pagination": {
                "page": page,
                "per_page": per_page,
                "previous_page": page - 1 if page > 1 else None,
                "next_page": page + 1 if page < last else None,
                "last_page": last,
                "total_entries": total,
            }
        }
        return 200, {key: copy.deepcopy(window), "meta": meta}

    def _select(self, query: dict[str, list[str]]) -> list[dict[str, Any]]:
        servers = list(self.servers.values())
        for selector in query.get("label_selector", []):
            for term in selector.split(","):
                key, _, value = term.partition("=")
                servers = [s for s in servers if s["labels"].get(key) == value]
        return servers

    def _public(self, server: dict[str, Any]) -> dict[str, Any]:
        return copy.deepcopy(server)

    def _create(self, body: dict[str, Any]):
        fields = {"name", "server_type", "image"}
        missing = [f for f in sorted(fields) if not body.get(f)]
        if missing:
            return _invalid(missing[0], "Missing data for required field.")
        stype = self.server_types.get(body["server_type"])
        if stype is None:
            return _invalid("server_type", "server type not found")
        location = body.get("location") or "fsn1"
        if location not in LOCATIONS:
            return _invalid("location", "location not found")
        entry = next((e for e in stype["locations"] if e["name"] == location), None)
        if entry is None or not entry["available"]:
            return _error(412, "resource_unavailable", "error during placement", {})
        image = IMAGES.get(str(body["image"]))
        if image is None:
            return _invalid("image", "image not found")
        if body.get("user_data") is not None:
            problem = _user_data_problem(body["user_data"])
            if problem:
                return _invalid("user_data", problem)
        if any(s["name"] == body["name"] for s in self.servers.values()):
            return _error(409, "uniqueness_error", "server name is already used", {"fields": [{"name": "name"}]})
        server = self._new_server(body, stype, location, image)
        self.servers[server["id"]] = server
        self.user_data[server["id"]] = body.get("user_data")
        action = self._action("create_server", server["id"])
        answer = self._public(server)
        answer["status"] = "initializing"
        start = self._action("start_server", server["id"])
        return 201, {"server": answer, "action": action, "next_actions": [start], "root_password": "Secr3tRootPw"}

    def _new_server(self, body: dict[str, Any], stype: dict[str, Any], location: str, image: dict[str, Any]):
        server_id = next(self._ids)
        return {
            "id": server_id,
            "name": body["name"],
            "status": "running",
            "created": _now(),
            "public_net": {
                "ipv4": {"id": server_id + 1000, "ip": "203.0.113.7", "blocked": False, "dns_ptr": "static.example"},
                "ipv6": {"id": server_id + 2000, "ip": "2001:db8::/64", "blocked": False, "dns_ptr": []},
                "floating_ips": [],
                "firewalls": [],
            },
            "private_net": [],
            "server_type": copy.deepcopy(stype),
            "datacenter": {
                "id": 4,
                "name": f"{location}-dc14",
                "description": "DC 14",
                "location": LOCATIONS[location],
            },
            "location": copy.deepcopy(LOCATIONS[location]),
            "image": copy.deepcopy(image),
            "iso": None,
            "rescue_enabled": False,
            "locked": False,
            "backup_window": None,
            "outgoing_traffic": 0,
            "ingoing_traffic": 0,
            "included_traffic": 21990232555520,
            "protection": {"delete": False, "rebuild": False},
            "labels": dict(body.get("labels") or {}),
            "volumes": [],
            "load_balancers": [],
            "primary_disk_size": stype["disk"],
            "placement_group": None,
        }

    def _on_server(self, method: str, rest: list[str], server: dict[str, Any], body: dict[str, Any]):
        sid = server["id"]
        if not rest and method == "GET":
            return 200, {"server": self._public(server)}
        if not rest and method == "DELETE":
            del self.servers[sid]
            return 200, {"action": self._action("delete_server", sid)}
        if rest == ["actions", "reset"] and method == "POST":
            self.resets[sid] = self.resets.get(sid, 0) + 1
            return 201, {"action": self._action("reset_server", sid)}
        if rest == ["actions", "poweroff"] and method == "POST":
            server["status"] = "off"
            return 201, {"action": self._action("stop_server", sid)}
        if rest == ["actions", "poweron"] and method == "POST":
            server["status"] = "running"
            return 201, {"action": self._action("start_server", sid)}
        if rest == ["actions", "rebuild"] and method == "POST":
            if not body.get("image"):
                return _invalid("image", "Missing data for required field.")
            if "user_data" in body:
                problem = _user_data_problem(body["user_data"])
                if problem:
                    return _invalid("user_data", problem)
                # What the metadata service serves the rebuilt server's cloud-init.
                self.user_data[sid] = body["user_data"]
            self.rebuilds.setdefault(sid, []).append(body["image"])
            # Powered off before the rebuild, started after it (unless it was off).
            was_off = server["status"] == "off"
            server["status"] = "off" if was_off and self.rebuild_leaves_off else "running"
            return 201, {"action": self._action("rebuild_server", sid), "root_password": None}
        return _error(404, "not_found", "not found", None)

    def _action(self, command: str, server_id: int) -> dict[str, Any]:
        """A running action; it reports success the first time it is polled."""
        action = {
            "id": next(self._action_ids),
            "command": command,
            "status": "running",
            "progress": 0,
            "started": _now(),
            "finished": None,
            "resources": [{"id": server_id, "type": "server"}],
            "error": None,
        }
        self.actions[action["id"]] = action
        return copy.deepcopy(action)

    def _get_action(self, raw_id: str):
        action = self.actions.get(int(raw_id)) if raw_id.isdigit() else None
        if action is None:
            return _error(404, "not_found", f"action with ID '{raw_id}' not found", None)
        if self.hold_actions:
            return 200, {"action": copy.deepcopy(action)}
        if action["status"] == "running" and self._failing_actions:
            action.update(status="error", progress=100, finished=_now(), error=self._failing_actions.pop(0))
        elif action["status"] == "running":
            action.update(status="success", progress=100, finished=_now())
        return 200, {"action": copy.deepcopy(action)}


def _route_of(path: str) -> str:
    """``/v1/servers/42/actions/reset`` -> ``/servers/{id}/actions/reset``."""
    parts = [p for p in path.split("/") if p][1:]
    return "/" + "/".join("{id}" if p.isdigit() else p for p in parts)


#: ``user_data`` at create and rebuild: "limited to 32KiB".
MAX_USER_DATA_BYTES = 32 * 1024


def _user_data_problem(user_data: Any) -> str | None:
    if not isinstance(user_data, str):
        return "Not a valid string."
    if len(user_data.encode()) > MAX_USER_DATA_BYTES:
        return f"Longer than maximum length {MAX_USER_DATA_BYTES}."
    return None


def _error(status: int, code: str, message: str, details: Any):
    return status, {"error": {"code": code, "message": message, "details": details}}


def _invalid(field: str, message: str):
    details = {"fields": [{"name": field, "messages": [message]}]}
    return _error(400, "invalid_input", f"invalid input in field '{field}'", details)


def _handler_for(fake: FakeHetzner) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def _serve(self) -> None:
            url = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                status, answer = _error(400, "json_error", "invalid JSON", None)
            else:
                status, answer = fake.handle(
                    self.command, url.path, parse_qs(url.query), body, self.headers.get("Authorization")
                )
            payload = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("X-Correlation-Id", "fake-0001")
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_DELETE = do_PUT = _serve

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            pass

    return Handler
