"""The dev stack's front door: real HAProxy in front of real streaming model servers.

Skipped (with the way to get it) only where the ``haproxy`` binary is missing; failed there in CI,
which installs it (tests/tools.py).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from fleet.routing import RoutingDocument, SiteRouteState
from providers.haproxy import HAProxy, HAProxyError, Replica, server_name
from tests.tools import needs
from sim.model_server import SimModelServer

pytestmark = needs("haproxy")  # skipped without it, naming how to get it; failed in CI (tests/tools.py)

SITES = ("site-a", "site-b")


def doc(version: int, weights: dict[str, int], draining: tuple[str, ...] = ()) -> RoutingDocument:
    return RoutingDocument(model="llm", version=version, sites={
        s: SiteRouteState(weight=w, draining=s in draining) for s, w in weights.items()})


class FrontDoor:
    def __init__(self, servers: dict[str, list[SimModelServer]], proxy: HAProxy) -> None:
        self.servers, self.proxy = servers, proxy
        self.client = httpx.AsyncClient(base_url=proxy.url, timeout=10,
                                        limits=httpx.Limits(max_connections=20))

    async def ask(self, session: str | None = None, stream: bool = True) -> str:
        """One completion; the site that answered."""
        headers = {"x-session-id": session} if session else {}
        response = await self.client.post("/llm/v1/completions", headers=headers,
                                          json={"model": "llm", "prompt": "hi", "stream": stream, "max_tokens": 2})
        response.raise_for_status()
        return response.headers["x-gpufleet-site"]

    async def many(self, sessions: list[str | None], parallel: int = 16) -> list[str]:
        gate = asyncio.Semaphore(parallel)

        async def one(s: str | None) -> str:
            async with gate:
                return await self.ask(s)
        return await asyncio.gather(*(one(s) for s in sessions))

    def requests(self) -> dict[str, int]:
        return {s.name: s.requests for reps in self.servers.values() for s in reps}

    def apply(self, document: RoutingDocument) -> None:
        assert self.proxy.apply(document)


async def _front_door(tmp_path: Path, weights: dict[str, int], check_interval_ms: int = 500, **server) -> FrontDoor:
    servers = {site: [await SimModelServer(site=site, first_token_ms=server.pop("first_token_ms", 1), token_ms=0,
                                           **server).start() for _ in range(2)] for site in SITES}
    replicas = {site: [Replica(site, s.address) for s in reps] for site, reps in servers.items()}
    proxy = HAProxy(tmp_path / "haproxy", check_interval_ms=check_interval_ms, models={"llm": replicas},
                    documents={"llm": doc(1, weights)})
    await asyncio.to_thread(proxy.start)
    return FrontDoor(servers, proxy)


async def _close(fd: FrontDoor) -> None:
    await fd.client.aclose()
    fd.proxy.stop()
    for reps in fd.servers.values():
        for s in reps:
            await s.stop()


@pytest.fixture
async def door(tmp_path: Path):
    # Health checks far apart: these tests are about weights, stickiness and drains, not health.
    # The model servers share the test's event loop, so on a starved machine a 500 ms check could
    # time out, HAProxy would mark a healthy server down and move its sessions (as it should), and
    # a stickiness assertion would fail for a reason the test is not about.
    fd = await _front_door(tmp_path, {"site-a": 700, "site-b": 300}, check_interval_ms=60_000)
    yield fd
    await _close(fd)


async def test_a_streamed_completion_names_its_site(door: FrontDoor):
    async with door.client.stream("POST", "/llm/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        assert r.headers["content-type"] == "text/event-stream"
        events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"site": "site-' in events[0]


async def test_sessions_stick_and_new_sessions_follow_the_weights(door: FrontDoor):
    first = await door.many([f"s{i}" for i in range(50)])
    for _ in range(3):  # later turns of the same sessions
        assert await door.many([f"s{i}" for i in range(50)]) == first
    sites = Counter(await door.many([f"new{i}" for i in range(2000)]))
    assert abs(sites["site-a"] / 2000 - 0.7) <= 0.05, sites


async def _stuck_at(door: FrontDoor, site: str, n: int = 20) -> list[str]:
    sessions = [f"stuck{i}" for i in range(4 * n)]
    landed = await door.many(sessions)
    return [s for s, at in zip(sessions, landed) if at == site][:n]


async def _new_sessions_for(door: FrontDoor, seconds: float, tag: str) -> Counter:
    seen: Counter = Counter()
    deadline, i = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        seen.update(await door.many([f"{tag}{i}-{j}" for j in range(16)]))
        i += 1
    return seen


async def test_reweight_keeps_stuck_sessions_and_sends_no_new_ones(door: FrontDoor):
    stuck = await _stuck_at(door, "site-b")
    assert stuck
    door.apply(doc(2, {"site-a": 1000, "site-b": 0}))
    assert (await _new_sessions_for(door, 1.0, "after"))["site-b"] == 0
    assert set(await door.many(stuck)) == {"site-b"}  # reweight: stuck sessions stay


async def test_drain_moves_stuck_sessions_and_sends_no_new_ones(door: FrontDoor):
    stuck = await _stuck_at(door, "site-b")
    door.apply(doc(2, {"site-a": 1000, "site-b": 0}, draining=("site-b",)))
    assert (await _new_sessions_for(door, 1.0, "after"))["site-b"] == 0
    assert set(await door.many(stuck)) == {"site-a"}  # drain: they move on their next turn
    assert "site-b" not in set(await door.many(stuck))  # and stay moved


async def test_a_refusing_site_fails_over_before_the_first_byte(tmp_path: Path):
    # Health checks far apart: the front door has not noticed the dead site yet.
    fd = await _front_door(tmp_path, {"site-a": 500, "site-b": 500}, check_interval_ms=60_000)
    try:
        stuck = await _stuck_at(fd, "site-b", n=10)
        for s in fd.servers["site-b"]:
            await s.stop()
        before = fd.requests()
        assert set(await fd.many(stuck + [f"fresh{i}" for i in range(20)])) == {"site-a"}
        after = fd.requests()
        assert all(after[s.name] == before[s.name] for s in fd.servers["site-b"])
        assert sum(after.values()) - sum(before.values()) == 30  # each answered exactly once
        # Out at their first refused connection, a minute before a health check would have seen it:
        # no later request tries them (each try could land on one, and all of a request's on dead ones
        # answered 503, as CI once saw).
        up = await asyncio.to_thread(fd.proxy.servers_up, "llm")
        assert up == {server_name("site-a", 0): True, server_name("site-a", 1): True,
                      server_name("site-b", 0): False, server_name("site-b", 1): False}, up
    finally:
        await _close(fd)


async def test_a_stream_cut_after_tokens_is_an_error_and_never_replayed(tmp_path: Path):
    fd = await _front_door(tmp_path, {"site-a": 1000, "site-b": 0}, die_after_tokens=2, tokens=6)
    try:
        got: list[str] = []
        with pytest.raises(httpx.HTTPError):
            async with fd.client.stream("POST", "/llm/v1/completions",
                                        json={"prompt": "hi", "stream": True, "max_tokens": 6}) as r:
                async for line in r.aiter_lines():
                    got.append(line)
        assert sum(line.startswith("data: {") for line in got) == 2  # the tokens before the crash arrived
        await asyncio.sleep(0.3)  # time for any (wrong) retry to reach a server
        assert sum(fd.requests().values()) == 1, fd.requests()
    finally:
        await _close(fd)


async def test_a_front_door_in_a_deep_state_dir_starts_and_is_steered(tmp_path: Path):
    """HAProxy refuses a runtime socket path over 97 characters; a state dir that deep (a user's
    home, pytest-xdist's own tmp dirs) once kept the dev stack's front door from starting at all."""
    deep = tmp_path / ("state-" + "d" * 60) / "front-door"
    fd = await _front_door(deep, {"site-a": 1000, "site-b": 0})
    try:
        assert len(str(deep / "haproxy" / "haproxy.sock")) > 97
        fd.apply(doc(2, {"site-a": 0, "site-b": 1000}))  # through the runtime socket
        assert set(await _new_sessions_for(fd, 1.0, "deep")) == {"site-b"}
    finally:
        await _close(fd)
    assert not Path(fd.proxy.socket_path).exists(), "the short socket outside the state dir goes with it"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_haproxy_whose_front_door_died_before_it_could_ask_for_the_death_signal_exits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The front door killed between HAProxy's fork and its ``prctl``: the death signal is then set
    for HAProxy's new parent and never comes, and an orphaned HAProxy held the front door's port
    for good. Now it sees it was orphaned and exits before it runs. Here the front door's pid, as
    the child is told it, is one that is not its parent."""
    import providers.haproxy as haproxy_module

    monkeypatch.setattr(haproxy_module.os, "getpid", lambda: 1_000_000_000)
    proxy = HAProxy(tmp_path / "haproxy", models={"llm": {}}, documents={})
    with pytest.raises(HAProxyError, match="exited with 1"):
        proxy.start()
    monkeypatch.undo()
    proxy = HAProxy(tmp_path / "haproxy-live", models={"llm": {}}, documents={}).start()
    try:
        assert proxy.process is not None and proxy.process.poll() is None, "an HAProxy of a live front door runs"
    finally:
        proxy.stop()
