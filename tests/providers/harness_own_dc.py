"""own-dc harness: the real adapter and httpx against sushy-tools' Redfish emulator
(fake systems driver, HTTP basic auth from an htpasswd file, so a wrong password
gets the emulator's real 401), behind a fault proxy."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import bcrypt
import httpx
import pytest

from fleet.config import Account, Site
from fleet.models import CapacityType, CredentialsRef, MachineSpec
from providers.own_dc import OwnDcProvider
from tests.providers.fault_proxy import FaultProxy, Reply, Request
from tests.ports import free_port

BMC_USER = "gpufleet"
BMC_PASSWORD = "bmc-Pa55word-gpufleet-test"
SECRET = f"{BMC_USER}:{BMC_PASSWORD}"
CREDENTIALS_ENV = "GPUFLEET_TEST_BMC_CREDENTIALS"
BLOCKER = "harness-blocker"

SYSTEMS = [
    {
        "uuid": f"8f5f5a52-0000-4000-8000-00000000000{i}",
        "name": f"rack1-node{i}",
        "power_state": "Off",
        "nics": [{"mac": f"52:54:00:00:00:0{i}", "ip": f"10.0.0.{i}"}],
    }
    for i in range(1, 4)
]


def redfish_error(status: int, message_id: str, message: str, headers: dict[str, str] | None = None) -> Reply:
    """A Redfish error body as BMCs send it."""
    body = {
        "error": {
            "code": "Base.1.8.GeneralError",
            "message": "A general error has occurred. See ExtendedInfo for more information.",
            "@Message.ExtendedInfo": [
                {
                    "@odata.type": "#Message.v1_1_1.Message",
                    "MessageId": message_id,
                    "Message": message,
                    "Severity": "Critical",
                }
            ],
        }
    }
    return Reply(status, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})


def is_reset(request: Request) -> bool:
    return request.method == "POST" and request.path.endswith("/Actions/ComputerSystem.Reset")


_started: dict[str, object] = {}
_guard = threading.Lock()


def _start_emulator(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    htpasswd = workdir / "htpasswd"
    hashed = bcrypt.hashpw(BMC_PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    htpasswd.write_text(f"{BMC_USER}:{hashed}\n")
    config = workdir / "emulator.conf"
    config.write_text(
        "\n".join(
            [
                "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'",
                f"SUSHY_EMULATOR_LISTEN_PORT = {port}",
                "SUSHY_EMULATOR_FAKE_DRIVER = True",
                f"SUSHY_EMULATOR_STATE_DIR = {str(workdir / 'state')!r}",
                f"SUSHY_EMULATOR_AUTH_FILE = {str(htpasswd)!r}",
                f"SUSHY_EMULATOR_FAKE_SYSTEMS = {SYSTEMS!r}",
                "",
            ]
        )
    )
    log = open(workdir / "emulator.log", "w")  # noqa: SIM115 - lives as long as the process
    process = subprocess.Popen(
        [sys.executable, "-m", "sushy_tools.emulator.main", "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/redfish/v1/", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"sushy-emulator did not start: {(workdir / 'emulator.log').read_text()[-2000:]}")


def shared_bmc(config: pytest.Config) -> FaultProxy:
    """A proxy in front of one sushy-emulator per test session."""
    with _guard:
        if "proxy" not in _started:
            workdir = Path(tempfile.mkdtemp(prefix="gpufleet-sushy-"))
            process, url = _start_emulator(workdir)
            proxy = FaultProxy(url).start()
            _started.update(proxy=proxy)

            def stop() -> None:
                proxy.stop()
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                shutil.rmtree(workdir, ignore_errors=True)
                _started.clear()

            config.add_cleanup(stop)
        return _started["proxy"]  # type: ignore[return-value]


class OwnDcHarness:
    #: own-dc has no account quota, so it never raises OverQuota.
    error_kinds = ("NoCapacity", "BadCredentials", "Transient", "InvalidRequest")
    secret = SECRET
    #: user:password goes as HTTP basic auth, base64-encoded: any character travels.
    secret_in_header = False
    unknown_id = "rack9-node99"

    def __init__(self, proxy: FaultProxy, state_dir: Path) -> None:
        self.proxy = proxy
        suffix = uuid.uuid4().hex[:6]
        self.state_file = state_dir / "own-dc.json"
        self.site = Site(
            name=f"dc-fra-{suffix}",
            provider="own-dc",
            account="dc-fra",
            region="fra1",
            gpu="H100",
            gpus_per_machine=8,
            gpu_memory_gb=80,
            instance_type="hgx-h100",
            price_per_gpu_hour=1.10,
            capacity_type=CapacityType.OWNED,
            max_nodes=3,
        )
        self.account = Account(
            name="dc-fra",
            provider="own-dc",
            credentials=CredentialsRef(env=CREDENTIALS_ENV),
            options={
                # Each machine's static lease on the provisioning network (sushy's fake driver
                # reports MACs but no addresses for its interfaces).
                "machines": [{"name": s["name"], "bmc_url": proxy.url, "system_id": s["uuid"],
                              "provision_address": s["nics"][0]["ip"]} for s in SYSTEMS],
                "state_file": str(self.state_file),
                "timeout": 10,
            },
        )
        self.provider = OwnDcProvider(self.site, self.account)
        self.spec = MachineSpec(
            name=f"gpu-dc-{suffix}",
            site=self.site.name,
            region="fra1",
            instance_type="hgx-h100",
            gpu="H100",
            gpus=8,
            capacity_type=CapacityType.OWNED,
        )

    def allocations(self) -> dict[str, dict]:
        if not self.state_file.exists():
            return {}
        return json.loads(self.state_file.read_text()).get("allocations", {})

    def fail_next_create(self, kind: str) -> None:
        if kind == "NoCapacity":
            self._fill_pool()
        elif kind == "BadCredentials":
            wrong = base64.b64encode(f"{BMC_USER}:wrong-password".encode()).decode()
            self.proxy.once(lambda r: r.with_header("Authorization", f"Basic {wrong}"))
        elif kind == "Transient":
            self.proxy.once(
                lambda r: redfish_error(
                    503,
                    "Base.1.8.ServiceTemporarilyUnavailable",
                    "The service is temporarily unavailable.  Retry in 30 seconds.",
                    {"Retry-After": "30"},
                )
            )
        elif kind == "InvalidRequest":
            # The BMC rejects the reset: the emulator really answers 501 for PowerCycle.
            self.proxy.once(
                lambda r: Request(r.method, r.path, r.headers, b'{"ResetType": "PowerCycle"}') if is_reset(r) else None
            )
        else:
            raise ValueError(f"own-dc cannot produce {kind}")

    def _fill_pool(self) -> None:
        """Another tenant holds every free machine."""
        state = {"allocations": self.allocations()}
        for s in SYSTEMS:
            state["allocations"].setdefault(
                s["name"], {"key": BLOCKER, "name": "other", "site": "other", "status": "allocated"}
            )
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(state))

    def machine_count(self) -> int:
        return sum(1 for a in self.allocations().values() if a.get("key") != BLOCKER)

    def power_state(self, name: str) -> str:
        system = next(s for s in SYSTEMS if s["name"] == name)
        reply = httpx.get(f"{self.proxy.url}/redfish/v1/Systems/{system['uuid']}", auth=(BMC_USER, BMC_PASSWORD))
        return reply.json()["PowerState"]


@pytest.fixture
def own_dc_harness(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> OwnDcHarness:
    proxy = shared_bmc(request.config)
    proxy.reset()
    monkeypatch.setenv(CREDENTIALS_ENV, SECRET)
    return OwnDcHarness(proxy, tmp_path)
