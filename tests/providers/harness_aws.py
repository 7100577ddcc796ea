"""AWS harness: the real adapter and boto3 against moto (server mode) behind a
fault proxy that can answer a call with EC2's real XML error body instead."""

from __future__ import annotations

import threading
import uuid
from typing import Any
from urllib.parse import parse_qs

import boto3
import pytest
from moto.server import ThreadedMotoServer

from fleet.config import Account, Site
from fleet.models import CapacityType, CredentialsRef, MachineSpec
from providers.aws import AwsProvider
from tests.providers.fault_proxy import FaultProxy, Reply, Request

ACCESS_KEY_ID = "AKIAGPUFLEETTEST0001"
SECRET_ACCESS_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYgpufleet01"
SECRET = f"{ACCESS_KEY_ID}:{SECRET_ACCESS_KEY}"
CREDENTIALS_ENV = "GPUFLEET_TEST_AWS_CREDENTIALS"
REGION = "us-east-1"
INSTANCE_TYPE = "p5.48xlarge"
AMI = "ami-0abcdef1234567890"

#: Contract error kind -> (EC2 action it answers, or None for any; HTTP status; code; message).
FAULTS: dict[str, tuple[str | None, int, str, str]] = {
    "NoCapacity": (
        "RunInstances",
        500,
        "InsufficientInstanceCapacity",
        f"We currently do not have sufficient {INSTANCE_TYPE} capacity in the Availability Zone you requested "
        "(us-east-1a). Our system will be working on provisioning additional capacity. You can currently get "
        f"{INSTANCE_TYPE} capacity by not specifying an Availability Zone in your request or choosing us-east-1b, "
        "us-east-1c.",
    ),
    "OverQuota": (
        "RunInstances",
        400,
        "VcpuLimitExceeded",
        "You have requested more vCPU capacity than your current vCPU limit of 0 allows for the instance bucket "
        "that the specified instance type belongs to. Please visit http://aws.amazon.com/contact-us/ec2-request "
        "to request an adjustment to this limit.",
    ),
    "BadCredentials": (None, 401, "AuthFailure", "AWS was not able to validate the provided access credentials"),
    "Transient": ("RunInstances", 503, "RequestLimitExceeded", "Request limit exceeded."),
    "InvalidRequest": (
        "RunInstances",
        400,
        "InvalidParameterValue",
        f"Value ({INSTANCE_TYPE}) for parameter instanceType is invalid. Instance type not supported.",
    ),
}


def ec2_error(status: int, code: str, message: str) -> Reply:
    """EC2's error response, as the Query API sends it."""
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors>"
        f"<RequestID>{uuid.uuid4()}</RequestID></Response>"
    )
    return Reply(status, body.encode(), {"Content-Type": "text/xml;charset=UTF-8"})


def action(request: Request) -> str:
    """The EC2 Query API action of a request (form-encoded POST body)."""
    return (parse_qs(request.body.decode()).get("Action") or [""])[0]


def params(request: Request) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(request.body.decode()).items()}


def answer(ec2_action: str | None, reply: Reply):
    """A one-shot proxy rule answering the next ``ec2_action`` (any when None)."""
    return lambda request: reply if ec2_action is None or action(request) == ec2_action else None


_started: dict[str, object] = {}
_guard = threading.Lock()


def shared_servers(config: pytest.Config) -> tuple[Any, FaultProxy]:
    """(EC2 client straight to moto, proxy in front of moto), once per test session."""
    with _guard:
        if "proxy" not in _started:
            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            moto.start()
            host, port = moto.get_host_and_port()
            url = f"http://{host}:{port}"
            proxy = FaultProxy(url).start()
            # A client straight to moto, for looking behind the adapter's back.
            ec2 = boto3.client(
                "ec2",
                region_name=REGION,
                endpoint_url=url,
                aws_access_key_id="AKIAHARNESS",
                aws_secret_access_key="harness",
            )
            _started.update(moto=moto, url=url, proxy=proxy, ec2=ec2)

            def stop() -> None:
                proxy.stop()
                moto.stop()
                _started.clear()

            config.add_cleanup(stop)
        return _started["ec2"], _started["proxy"]  # type: ignore[return-value]


class AwsHarness:
    error_kinds = tuple(FAULTS)
    secret = SECRET
    unknown_id = "i-0123456789abcdef0"

    def __init__(self, ec2: Any, proxy: FaultProxy, capacity_type: CapacityType = CapacityType.ON_DEMAND) -> None:
        #: An EC2 client straight to moto, for looking behind the adapter's back.
        self.ec2 = ec2
        self.proxy = proxy
        suffix = uuid.uuid4().hex[:6]
        self.site = Site(
            name=f"aws-{REGION}-{suffix}",
            provider="aws",
            account="aws-main",
            region=REGION,
            gpu="H100",
            gpus_per_machine=8,
            gpu_memory_gb=80,
            instance_type=INSTANCE_TYPE,
            price_per_gpu_hour=3.93,
            capacity_type=capacity_type,
            max_nodes=4,
            image=AMI,
        )
        self.account = Account(
            name="aws-main",
            provider="aws",
            credentials=CredentialsRef(env=CREDENTIALS_ENV),
            options={"endpoint_url": proxy.url, "connect_timeout": 5, "read_timeout": 30},
        )
        self.provider = AwsProvider(self.site, self.account)
        self.spec = MachineSpec(
            name=f"gpu-aws-{suffix}",
            site=self.site.name,
            region=REGION,
            instance_type=INSTANCE_TYPE,
            gpu="H100",
            gpus=8,
            capacity_type=capacity_type,
            image=AMI,
        )

    def fail_next_create(self, kind: str) -> None:
        ec2_action, status, code, message = FAULTS[kind]
        self.proxy.once(answer(ec2_action, ec2_error(status, code, message)))

    def live_instances(self) -> list[dict]:
        pages = self.ec2.describe_instances(
            Filters=[
                {"Name": "tag:gpufleet.io/site", "Values": [self.site.name]},
                {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]},
            ]
        )
        return [i for r in pages["Reservations"] for i in r["Instances"]]

    def machine_count(self) -> int:
        return len(self.live_instances())

    def requests(self, ec2_action: str) -> list[dict[str, str]]:
        """Parameters of every ``ec2_action`` request the adapter sent."""
        return [params(r) for r in self.proxy.requests if action(r) == ec2_action]


@pytest.fixture
def aws_harness(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> AwsHarness:
    ec2, proxy = shared_servers(request.config)
    proxy.reset()
    monkeypatch.setenv(CREDENTIALS_ENV, SECRET)
    return AwsHarness(ec2, proxy)
