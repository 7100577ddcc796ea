"""Notifications never break an entity (issue 13, item 3): a webhook answering 500 is
counted and shown on the ProviderAccount; its URL (a credentials reference) appears in
no error, log line or history."""

from __future__ import annotations

import http.server
import logging
import threading
import uuid
from typing import Iterator

import pytest
import yaml

from tests.bad_input_helpers import task_failures, wait_for_async
from tests.conftest import TEST_FLEET, Stack
from tests.test_node_join import readable_history
from workers.control_plane import build_worker

SECRET = "s3cr3t-" + uuid.uuid4().hex


class _Hook(http.server.BaseHTTPRequestHandler):
    posts: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        _Hook.posts.append(self.rfile.read(int(self.headers.get("content-length", 0))))
        self.send_response(500)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def failing_webhook() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Hook.posts = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hooks/{SECRET}"
    finally:
        server.shutdown()


async def test_failing_webhook_is_counted_and_never_leaks_its_url(
        fleet_world: Stack, failing_webhook: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("GPUFLEET_TEST_WEBHOOK", failing_webhook)
    config = {**TEST_FLEET, "notify_webhook": {"env": "GPUFLEET_TEST_WEBHOOK"}}
    (fleet_world.settings.state_dir / "sites.yaml").write_text(yaml.safe_dump(config))
    stack = fleet_world
    async with build_worker(stack.client, stack.settings):
        handle = await stack.client.start_workflow(
            "ProviderAccount", {"account": "acct-a", "provider": "lambda"},
            id=f"account/lambda/acct-a-{uuid.uuid4().hex[:6]}", task_queue=stack.settings.task_queue,
        )
        await handle.signal("report", {"account": "acct-a", "kind": "OverQuota", "offer": "site-a/gpu_2x_h100",
                                       "message": "quota reached"})
        status = await wait_for_async(lambda: handle.query("status"), lambda s: s["notify_failures"] == 1, timeout=30)
        assert status["state"] == "quota-blocked"
        assert "answered HTTP 500" in status["notify_error"]
        assert "env:GPUFLEET_TEST_WEBHOOK" in status["notify_error"]
        assert len(_Hook.posts) == 3  # every attempt reached the hook
        metadata = await handle.query("__temporal_workflow_metadata")
        assert "webhook failed 1 time(s)" in str(metadata)

        # The entity carries on: the next report is applied (and its notification counted too).
        await handle.signal("report", {"account": "acct-a", "kind": "BadCredentials", "message": "key revoked"})
        status = await wait_for_async(lambda: handle.query("status"), lambda s: s["notify_failures"] == 2, timeout=30)
        assert status["state"] == "credentials-revoked"

        history = readable_history((await handle.fetch_history()).to_json_dict())
        await handle.terminate("test over")
    assert await task_failures(handle) == 0
    assert "answered HTTP 500" in history
    assert "HTTP Request: POST <notify webhook>" in caplog.text  # httpx logged each attempt, hidden
    for text in (history, caplog.text, str(status)):
        assert SECRET not in text
        assert failing_webhook not in text


async def test_missing_webhook_reference_is_a_named_permanent_failure(
        fleet_world: Stack, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GPUFLEET_TEST_WEBHOOK", raising=False)
    config = {**TEST_FLEET, "notify_webhook": {"env": "GPUFLEET_TEST_WEBHOOK"}}
    (fleet_world.settings.state_dir / "sites.yaml").write_text(yaml.safe_dump(config))
    stack = fleet_world
    async with build_worker(stack.client, stack.settings):
        handle = await stack.client.start_workflow(
            "ProviderAccount", {"account": "acct-b", "provider": "nebius"},
            id=f"account/nebius/acct-b-{uuid.uuid4().hex[:6]}", task_queue=stack.settings.task_queue,
        )
        await handle.signal("report", {"account": "acct-b", "kind": "OverQuota", "message": "quota reached"})
        status = await wait_for_async(lambda: handle.query("status"), lambda s: s["notify_failures"] == 1, timeout=15)
        assert "env:GPUFLEET_TEST_WEBHOOK is missing or empty" in status["notify_error"]
        history = (await handle.fetch_history()).events
        await handle.terminate("test over")
    # Not retried: a reference that is not there does not appear by itself.
    assert sum(e.activity_task_started_event_attributes.attempt > 1 for e in history) == 0


#: Webhook URLs as their services hand them out, which httpx writes otherwise in its log line
#: (``HTTP Request: POST <url> ...``, INFO, which the control plane logs): a Teams / Power Automate
#: workflow URL names its port (httpx drops ``:443``); a host or scheme in capitals (lowered).
NORMALIZED_BY_HTTPX = {
    "power automate": "https://prod-27.westus.logic.azure.com:443/workflows/0f1e2d3c4b5a/triggers/manual/paths/"
                      "invoke?api-version=2016-06-01&sp=%2Ftriggers%2Fmanual%2Frun&sv=1.0&sig={secret}",
    "host in capitals": "https://Hooks.Example.COM/services/T0001/B0001/{secret}",
    "scheme in capitals": "HTTPS://hooks.example.com/services/T0001/B0001/{secret}",
}


@pytest.mark.parametrize("case", sorted(NORMALIZED_BY_HTTPX))
async def test_a_webhook_url_httpx_logs_in_another_form_is_hidden_too(
        case: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    import httpx

    from activities import notify

    secret = "s1g-" + uuid.uuid4().hex
    url = NORMALIZED_BY_HTTPX[case].format(secret=secret)
    monkeypatch.setenv("GPUFLEET_TEST_WEBHOOK", url)
    posted: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        posted.append(request)
        return httpx.Response(202)

    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real_client(transport=httpx.MockTransport(answer), **kw))
    caplog.set_level(logging.INFO)
    from fleet.models import CredentialsRef

    assert await notify.post(CredentialsRef(env="GPUFLEET_TEST_WEBHOOK"), {"text": "a person must act"})
    assert len(posted) == 1 and secret in str(posted[0].url)  # it went where it was meant to
    assert "HTTP Request: POST <notify webhook>" in caplog.text
    assert secret not in caplog.text, caplog.text
