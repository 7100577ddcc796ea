"""EC2 adapter specifics: ClientToken idempotency, spot, error codes through real
XML error bodies, credentials, reinstall, offers."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from fleet.config import Account
from fleet.errors import (
    BadCredentials,
    InvalidRequest,
    NoCapacity,
    NotFound,
    OverQuota,
    ProviderError,
    Transient,
)
from fleet.models import CapacityType, CredentialsRef
from providers.aws import ERROR_CODES, AwsProvider, classify, client_token
from tests.providers.fault_proxy import Reply
from tests.ports import free_port
from tests.providers.harness_aws import (
    AMI,
    CREDENTIALS_ENV,
    SECRET,
    AwsHarness,
    action,
    answer,
    ec2_error,
    shared_servers,
)


def test_client_token_is_the_key_when_it_fits() -> None:
    assert client_token("create-node-7") == "create-node-7"
    long_key = "k" * 65
    assert client_token(long_key) == hashlib.sha256(long_key.encode()).hexdigest()
    assert len(client_token(long_key)) == 64
    assert len(client_token("nœud-é")) == 64


def test_run_instances_carries_client_token_and_tags(aws_harness: AwsHarness) -> None:
    key = f"wf-{uuid.uuid4()}"
    machine = aws_harness.provider.create_machine(aws_harness.spec, key)
    [run] = aws_harness.requests("RunInstances")
    assert run["ClientToken"] == key
    assert run["ImageId"] == AMI and run["InstanceType"] == "p5.48xlarge"
    tags = {run[f"TagSpecification.1.Tag.{i}.Key"]: run[f"TagSpecification.1.Tag.{i}.Value"] for i in range(1, 5)}
    assert tags["Name"] == aws_harness.spec.name
    assert tags["gpufleet.io/site"] == aws_harness.site.name
    assert tags["gpufleet.io/idempotency-key"] == key
    assert "InstanceMarketOptions.MarketType" not in run
    assert machine.id.startswith("i-") and machine.capacity_type == CapacityType.ON_DEMAND
    assert machine.state in ("pending", "running") and machine.created_at is not None


def test_instances_require_imds_tokens_that_reach_the_node_agents_pod(aws_harness: AwsHarness) -> None:
    """The node agent reads the spot notice from a pod without host networking: IMDSv2 with a
    hop limit of 1 (EC2's default) never delivers that pod a token, so no notice is ever seen."""
    machine = aws_harness.provider.create_machine(aws_harness.spec, f"wf-{uuid.uuid4()}")
    [run] = aws_harness.requests("RunInstances")
    assert run["MetadataOptions.HttpTokens"] == "required"
    assert run["MetadataOptions.HttpPutResponseHopLimit"] == "2"
    assert run["MetadataOptions.HttpEndpoint"] == "enabled"
    [instance] = [i for i in aws_harness.live_instances() if i["InstanceId"] == machine.id]
    assert instance["MetadataOptions"]["HttpTokens"] == "required", instance.get("MetadataOptions")
    assert instance["MetadataOptions"]["HttpPutResponseHopLimit"] == 2


def test_repeat_create_sends_no_second_run_instances(aws_harness: AwsHarness) -> None:
    key = "x" * 100
    first = aws_harness.provider.create_machine(aws_harness.spec, key)
    second = aws_harness.provider.create_machine(aws_harness.spec, key)
    assert first.id == second.id
    [run] = aws_harness.requests("RunInstances")
    assert run["ClientToken"] == hashlib.sha256(key.encode()).hexdigest()


def test_lost_answer_then_retry_makes_one_instance(aws_harness: AwsHarness) -> None:
    """RunInstances reaches EC2 but the answer is lost; the retry finds the instance."""
    lost = ec2_error(500, "InternalError", "An internal error has occurred")
    aws_harness.proxy.once(lambda r: (lambda _reply: lost) if action(r) == "RunInstances" else None)
    key = f"wf-{uuid.uuid4()}"
    with pytest.raises(Transient):
        aws_harness.provider.create_machine(aws_harness.spec, key)
    assert aws_harness.machine_count() == 1
    machine = aws_harness.provider.create_machine(aws_harness.spec, key)
    assert machine.id == aws_harness.live_instances()[0]["InstanceId"]
    assert aws_harness.machine_count() == 1


def test_spot_uses_instance_market_options(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    ec2, proxy = shared_servers(request.config)
    proxy.reset()
    monkeypatch.setenv(CREDENTIALS_ENV, SECRET)
    harness = AwsHarness(ec2, proxy, capacity_type=CapacityType.SPOT)
    machine = harness.provider.create_machine(harness.spec, f"wf-{uuid.uuid4()}")
    [run] = harness.requests("RunInstances")
    assert run["InstanceMarketOptions.MarketType"] == "spot"
    assert run["InstanceMarketOptions.SpotOptions.InstanceInterruptionBehavior"] == "terminate"
    assert machine.capacity_type == CapacityType.SPOT
    [offer] = harness.provider.list_offers()
    assert offer.capacity_type == CapacityType.SPOT and offer.interruption_risk > 0


# Every code in the table, plus unknown codes, as real EC2 XML with a plausible status.
STATUS = {NoCapacity: 500, OverQuota: 400, BadCredentials: 403, Transient: 503, InvalidRequest: 400, NotFound: 400}
CASES = [(code, STATUS[cls], cls) for code, cls in ERROR_CODES.items()] + [
    ("InsufficientInstanceCapacity", 400, NoCapacity),
    ("SomethingNewClientSide", 400, InvalidRequest),
    ("SomethingNewServerSide", 500, Transient),
]


@pytest.mark.parametrize(("code", "status", "expected"), CASES, ids=[f"{c}-{s}" for c, s, _ in CASES])
def test_ec2_error_codes(aws_harness: AwsHarness, code: str, status: int, expected: type[ProviderError]) -> None:
    aws_harness.proxy.once(answer("RunInstances", ec2_error(status, code, f"message for {code}")))
    with pytest.raises(ProviderError) as caught:
        aws_harness.provider.create_machine(aws_harness.spec, f"wf-{uuid.uuid4()}")
    assert type(caught.value) is expected
    assert caught.value.code == code and caught.value.provider == "aws"
    assert code in str(caught.value)


def test_classify_without_status_is_transient() -> None:
    assert classify("Whatever", None) is Transient


def test_not_found_codes_on_reads_and_deletes(aws_harness: AwsHarness) -> None:
    provider = aws_harness.provider
    with pytest.raises(NotFound):
        provider.get_machine("i-0123456789abcdef0")
    with pytest.raises(NotFound):
        provider.reboot_machine("i-0123456789abcdef0")
    aws_harness.proxy.once(
        answer("TerminateInstances", ec2_error(400, "InvalidInstanceID.Malformed", 'Invalid id: "bogus"'))
    )
    provider.delete_machine("bogus")


def test_terminated_machine_is_reported_not_listed(aws_harness: AwsHarness) -> None:
    machine = aws_harness.provider.create_machine(aws_harness.spec, f"wf-{uuid.uuid4()}")
    aws_harness.provider.delete_machine(machine.id)
    assert aws_harness.provider.get_machine(machine.id).state == "terminated"
    assert machine.id not in {m.id for m in aws_harness.provider.list_machines()}


def test_list_machines_is_scoped_to_the_site(aws_harness: AwsHarness) -> None:
    mine = aws_harness.provider.create_machine(aws_harness.spec, f"wf-{uuid.uuid4()}")
    aws_harness.ec2.run_instances(ImageId=AMI, InstanceType="t3.micro", MinCount=1, MaxCount=1)
    listed = aws_harness.provider.list_machines()
    assert [m.id for m in listed] == [mine.id]
    assert listed[0].name == aws_harness.spec.name and listed[0].site == aws_harness.site.name


def test_reinstall_replaces_the_root_volume_from_the_launch_ami(aws_harness: AwsHarness) -> None:
    machine = aws_harness.provider.create_machine(aws_harness.spec, f"wf-{uuid.uuid4()}")
    # moto has no CreateReplaceRootVolumeTask: answer it with EC2's documented response.
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<CreateReplaceRootVolumeTaskResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
        f"<requestId>{uuid.uuid4()}</requestId><replaceRootVolumeTask>"
        "<replaceRootVolumeTaskId>replacevol-0123456789abcdef0</replaceRootVolumeTaskId>"
        f"<instanceId>{machine.id}</instanceId><taskState>pending</taskState>"
        "<startTime>2026-01-01T00:00:00Z</startTime><deleteReplacedRootVolume>true</deleteReplacedRootVolume>"
        "</replaceRootVolumeTask></CreateReplaceRootVolumeTaskResponse>"
    )
    aws_harness.proxy.once(
        answer("CreateReplaceRootVolumeTask", Reply(200, body.encode(), {"Content-Type": "text/xml"}))
    )
    aws_harness.provider.reinstall_machine(machine.id)
    [task] = aws_harness.requests("CreateReplaceRootVolumeTask")
    assert task["InstanceId"] == machine.id
    assert task["ImageId"] == AMI
    assert task["DeleteReplacedRootVolume"] == "true"


def test_offers_come_from_instance_type_apis(aws_harness: AwsHarness) -> None:
    [offer] = aws_harness.provider.list_offers()
    assert (offer.instance_type, offer.gpus, offer.gpu_memory_gb) == ("p5.48xlarge", 8, 80)
    assert offer.available and offer.region == "us-east-1"
    assert offer.price_per_gpu_hour == aws_harness.site.price_per_gpu_hour
    assert offer.capacity_type == CapacityType.ON_DEMAND and offer.interruption_risk == 0


def test_missing_credentials_fail_before_any_call(aws_harness: AwsHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CREDENTIALS_ENV)
    with pytest.raises(BadCredentials, match=CREDENTIALS_ENV):
        aws_harness.provider.create_machine(aws_harness.spec, "k")
    assert aws_harness.proxy.requests == []


def test_malformed_credentials_name_the_reference_not_the_value(
    aws_harness: AwsHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CREDENTIALS_ENV, "just-one-long-secret-value")
    with pytest.raises(BadCredentials) as caught:
        aws_harness.provider.list_machines()
    assert CREDENTIALS_ENV in str(caught.value)
    assert "just-one-long-secret-value" not in str(caught.value)
    assert aws_harness.proxy.requests == []


def test_unknown_profile_is_bad_credentials(aws_harness: AwsHarness) -> None:
    account = Account(name="aws-p", provider="aws", options={"profile": "gpufleet-no-such-profile"})
    with pytest.raises(BadCredentials):
        AwsProvider(aws_harness.site, account).list_machines()


def test_unreachable_endpoint_is_transient(aws_harness: AwsHarness) -> None:
    account = Account(
        name="aws-x",
        provider="aws",
        credentials=CredentialsRef(env=CREDENTIALS_ENV),
        options={"endpoint_url": f"http://127.0.0.1:{free_port()}", "connect_timeout": 1},
    )
    provider = AwsProvider(aws_harness.site, account)  # the constructor makes no call
    with pytest.raises(Transient):
        provider.get_machine("i-0123456789abcdef0")


def test_site_without_image_is_invalid_request(aws_harness: AwsHarness) -> None:
    site = aws_harness.site.model_copy(update={"image": ""})
    spec = aws_harness.spec.model_copy(update={"image": ""})
    with pytest.raises(InvalidRequest):
        AwsProvider(site, aws_harness.account).create_machine(spec, "k")
    assert aws_harness.proxy.requests == []
