"""Lambda Cloud adapter specifics: capacity pre-check, name-based idempotency,
rate limit, error codes, no reinstall, offers."""

from __future__ import annotations

import time

import pytest

from fleet.errors import (
    BadCredentials,
    InvalidRequest,
    NoCapacity,
    NotFound,
    OverQuota,
    ProviderError,
    Transient,
)
from providers.lambda_cloud import ERROR_CODES, LambdaProvider, classify
from tests.ports import free_port
from tests.providers.harness_lambda import CREDENTIALS_ENV, LambdaHarness


def launches(harness: LambdaHarness) -> list[dict]:
    return [body for method, path, body in harness.fake.requests if path.endswith("/instance-operations/launch")]


def test_launch_request_matches_the_api(lambda_harness: LambdaHarness) -> None:
    machine = lambda_harness.provider.create_machine(lambda_harness.spec, "k1")
    assert launches(lambda_harness) == [
        {
            "region_name": "us-east-1",
            "instance_type_name": "gpu_8x_h100_sxm5",
            "ssh_key_names": ["gpufleet"],
            "name": lambda_harness.spec.name,
            "quantity": 1,
        }
    ]
    assert machine.state == "pending" and len(machine.id) == 32
    time.sleep(0.1)
    assert lambda_harness.provider.get_machine(machine.id).state == "running"


def test_repeat_create_finds_the_instance_by_name(lambda_harness: LambdaHarness) -> None:
    first = lambda_harness.provider.create_machine(lambda_harness.spec, "k1")
    second = lambda_harness.provider.create_machine(lambda_harness.spec, "k1")
    assert first.id == second.id
    assert len(launches(lambda_harness)) == 1


def test_no_listed_capacity_raises_without_launching(lambda_harness: LambdaHarness) -> None:
    spec = lambda_harness.spec.model_copy(update={"instance_type": "gpu_1x_a10"})
    with pytest.raises(NoCapacity):
        lambda_harness.provider.create_machine(spec, "k1")
    assert launches(lambda_harness) == []


def test_unknown_instance_type_is_invalid_request(lambda_harness: LambdaHarness) -> None:
    spec = lambda_harness.spec.model_copy(update={"instance_type": "gpu_9x_imaginary"})
    with pytest.raises(InvalidRequest):
        lambda_harness.provider.create_machine(spec, "k1")


def test_rate_limited_launch_is_transient_at_once(lambda_harness: LambdaHarness) -> None:
    lambda_harness.fake.launch_interval_s = 60
    lambda_harness.provider.create_machine(lambda_harness.spec, "k1")
    other = lambda_harness.spec.model_copy(update={"name": lambda_harness.spec.name + "-b"})
    with pytest.raises(Transient) as caught:
        lambda_harness.provider.create_machine(other, "k2")
    assert caught.value.code == "http-429"
    # One launch refused, none sent again: the adapter neither waits out the limit nor retries
    # (Temporal's retry policy backs off).
    assert [body["name"] for body in launches(lambda_harness)] == [lambda_harness.spec.name, other.name]


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        ("account-inactive", BadCredentials),
        ("unknown", Transient),
        ("quota-exceeded", OverQuota),
        ("insufficient-capacity", NoCapacity),
    ],
)
def test_real_error_bodies_on_any_call(lambda_harness: LambdaHarness, error: str, expected: type) -> None:
    lambda_harness.fake.faults.append(("any", error))
    with pytest.raises(ProviderError) as caught:
        lambda_harness.provider.list_machines()
    assert type(caught.value) is expected
    assert caught.value.code.startswith(("global/", "instance-operations/"))


def test_classify_table() -> None:
    for code, cls in ERROR_CODES.items():
        assert classify(400, code) is cls
    assert classify(429, "global/invalid-parameters") is Transient
    assert classify(503, "provider/internal-unavailable") is Transient
    assert classify(400, "something/new") is Transient
    assert (
        classify(404, "global/object-does-not-exist", {"global/object-does-not-exist": InvalidRequest})
        is InvalidRequest
    )


def test_wrong_api_key_is_bad_credentials(lambda_harness: LambdaHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CREDENTIALS_ENV, "secret_wrong_key")
    with pytest.raises(BadCredentials) as caught:
        lambda_harness.provider.list_offers()
    assert caught.value.code == "global/invalid-api-key"


def test_missing_api_key_fails_before_any_call(lambda_harness: LambdaHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CREDENTIALS_ENV)
    with pytest.raises(BadCredentials, match=CREDENTIALS_ENV):
        lambda_harness.provider.create_machine(lambda_harness.spec, "k1")
    assert lambda_harness.fake.requests == []


def test_missing_ssh_key_option_fails_before_any_call(lambda_harness: LambdaHarness) -> None:
    account = lambda_harness.account.model_copy(update={"options": {"api_base": lambda_harness.fake.url}})
    with pytest.raises(InvalidRequest):
        LambdaProvider(lambda_harness.site, account).create_machine(lambda_harness.spec, "k1")
    assert lambda_harness.fake.requests == []


def test_unknown_ssh_key_on_launch_is_invalid_request_not_not_found(lambda_harness: LambdaHarness) -> None:
    options = {**lambda_harness.account.options, "ssh_key_names": ["nobody"]}
    account = lambda_harness.account.model_copy(update={"options": options})
    with pytest.raises(InvalidRequest) as caught:
        LambdaProvider(lambda_harness.site, account).create_machine(lambda_harness.spec, "k1")
    assert caught.value.code == "global/object-does-not-exist"


def test_reinstall_is_refused_without_a_call(lambda_harness: LambdaHarness) -> None:
    machine = lambda_harness.provider.create_machine(lambda_harness.spec, "k1")
    calls = len(lambda_harness.fake.requests)
    with pytest.raises(InvalidRequest):
        lambda_harness.provider.reinstall_machine(machine.id)
    assert len(lambda_harness.fake.requests) == calls


def test_delete_terminates_once(lambda_harness: LambdaHarness) -> None:
    machine = lambda_harness.provider.create_machine(lambda_harness.spec, "k1")
    lambda_harness.provider.delete_machine(machine.id)
    lambda_harness.provider.delete_machine(machine.id)
    terminates = [b for m, p, b in lambda_harness.fake.requests if p.endswith("/terminate")]
    assert terminates == [{"instance_ids": [machine.id]}]
    assert lambda_harness.provider.get_machine(machine.id).state == "terminated"
    assert lambda_harness.provider.list_machines() == []


def test_reboot_unknown_is_not_found(lambda_harness: LambdaHarness) -> None:
    with pytest.raises(NotFound):
        lambda_harness.provider.reboot_machine(lambda_harness.unknown_id)


def test_offers_use_the_api_price(lambda_harness: LambdaHarness) -> None:
    [offer] = lambda_harness.provider.list_offers()
    assert offer.price_per_gpu_hour == pytest.approx(23.92 / 8)
    assert (offer.gpus, offer.available, offer.region) == (8, True, "us-east-1")
    site = lambda_harness.site.model_copy(update={"instance_type": "gpu_1x_a10"})
    [offer] = LambdaProvider(site, lambda_harness.account).list_offers()
    assert not offer.available and offer.gpus == 1


def test_unreachable_api_is_transient(lambda_harness: LambdaHarness) -> None:
    options = {**lambda_harness.account.options, "api_base": f"http://127.0.0.1:{free_port()}/api/v1"}
    account = lambda_harness.account.model_copy(update={"options": options})
    provider = LambdaProvider(lambda_harness.site, account)  # the constructor makes no call
    with pytest.raises(Transient):
        provider.list_machines()


@pytest.mark.parametrize(("configured", "sent"), [
    ("lambda-stack", {"family": "lambda-stack"}),
    ("family:ubuntu-lts", {"family": "ubuntu-lts"}),
    ("ddaedf1b7a0e41ac981711504493b242", {"id": "ddaedf1b7a0e41ac981711504493b242"}),
    ("id:43336648-096d-4cba-9aa2-f9bb7727639d", {"id": "43336648-096d-4cba-9aa2-f9bb7727639d"}),
])
def test_launch_sends_the_sites_image_as_lambdas_id_or_family(lambda_harness: LambdaHarness, configured, sent) -> None:
    site = lambda_harness.site.model_copy(update={"image": configured})
    machine = LambdaProvider(site, lambda_harness.account).create_machine(lambda_harness.spec, "k1", user_data="#cloud-config\n")
    [launch] = launches(lambda_harness)
    assert launch["image"] == sent and launch["user_data"] == "#cloud-config\n"
    assert lambda_harness.fake.launch_images[machine.id] == sent


def test_an_image_lambda_does_not_have_is_refused_before_launch(lambda_harness: LambdaHarness) -> None:
    site = lambda_harness.site.model_copy(update={"image": "ubuntu-24.04"})  # a Hetzner name, not Lambda's
    with pytest.raises(InvalidRequest) as refused:
        LambdaProvider(site, lambda_harness.account).create_machine(lambda_harness.spec, "k1")
    assert refused.value.code == "unknown-image" and "image" in str(refused.value) and site.name in str(refused.value)
    assert launches(lambda_harness) == []


def _raw_launch(harness: LambdaHarness, **fields):
    import httpx

    body = {"region_name": "us-east-1", "instance_type_name": "gpu_8x_h100_sxm5", "ssh_key_names": ["gpufleet"],
            "name": "raw", **fields}
    return httpx.post(f"{harness.fake.url}/instance-operations/launch", json=body,
                      headers={"Authorization": f"Bearer {harness.secret}"})


@pytest.mark.parametrize("image", ["lambda-stack", {"name": "lambda-stack"}, {"id": "x", "family": "y"}, {"id": 7}])
def test_the_fake_refuses_an_image_that_is_neither_an_id_nor_a_family(lambda_harness: LambdaHarness, image) -> None:
    answer = _raw_launch(lambda_harness, image=image)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "global/invalid-parameters")
    assert lambda_harness.fake.live_instances() == []


def test_user_data_over_a_megabyte_is_refused_before_any_call_and_by_the_api(lambda_harness: LambdaHarness) -> None:
    from providers.lambda_cloud import MAX_USER_DATA_BYTES

    too_long = "#cloud-config\n" + "#" * MAX_USER_DATA_BYTES
    with pytest.raises(InvalidRequest) as refused:
        lambda_harness.provider.create_machine(lambda_harness.spec, "k1", user_data=too_long)
    assert refused.value.code == "user_data-too-large" and lambda_harness.fake.requests == []
    answer = _raw_launch(lambda_harness, user_data=too_long)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "global/invalid-parameters")
    fits = "#cloud-config\n" + "#" * (MAX_USER_DATA_BYTES - 20)
    machine = lambda_harness.provider.create_machine(lambda_harness.spec, "k1", user_data=fits)
    assert lambda_harness.fake.user_data[machine.id] == fits


@pytest.mark.parametrize("answer", ["inf", "NaN", float("inf"), -2392, "cheap"])
def test_an_api_price_that_is_no_price_is_the_sites_error_not_an_offer(lambda_harness: LambdaHarness,
                                                                       answer: object) -> None:
    """An infinite price in an offer reached workflows as null, which none could decode (AcquireCapacity,
    SpotReclaim failed their workflow task for good): the catalog records the site's error instead."""
    lambda_harness.fake.instance_types["gpu_8x_h100_sxm5"]["instance_type"]["price_cents_per_hour"] = answer
    with pytest.raises(ProviderError, match="price_cents_per_hour=.* for 8 GPUs: not a price"):
        lambda_harness.provider.list_offers()
