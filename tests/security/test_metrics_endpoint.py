"""What a caller of a worker's ``/metrics`` port can take from the worker.

The control plane's worker runs the fleet's workflows in the same process that serves its
metrics. Its NetworkPolicy admits only Prometheus's pods to that port
(tests/realk8s/test_control_plane_access.py), but under a CNI that enforces no policy any pod may
dial it, a GPU node's included, as any may dial the gateway's and a node agent's (left open to
wherever Prometheus runs). So the endpoint is the attacker's: connections it opens and never
finishes, requests it trickles a byte at a time, scrapes it sends in a loop. Each is judged by what the process spends on it (threads,
pages rendered) and by whether a real scrape is still answered.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from tests.conftest import wait_for
from workers.metrics import MAX_CONNECTIONS, MetricsServer


class CountedCollector:
    """A collector that counts how often it is asked (each rendered page asks once)."""

    def __init__(self) -> None:
        self.collected = 0

    def describe(self) -> list:
        return []

    def collect(self):
        self.collected += 1
        yield CounterMetricFamily("gpufleet_test_pages", "Pages rendered.", value=self.collected)


def metrics_server(counted: CountedCollector | None = None, **bounds) -> tuple[MetricsServer, CountedCollector]:
    """A server of a registry holding ``counted`` (a fresh ``CountedCollector`` by default)."""
    registry = CollectorRegistry()
    counted = counted or CountedCollector()
    registry.register(counted)
    server = MetricsServer(0, "control-plane", host="127.0.0.1", registry=registry, worker_heartbeats=False,
                           **bounds)
    return server, counted


@pytest.fixture
def served() -> Iterator[tuple[MetricsServer, CountedCollector]]:
    """A metrics server whose request deadline is a second (the shipped one's is ten)."""
    server, counted = metrics_server(request_timeout_s=1.0)
    try:
        yield server, counted
    finally:
        server.close()


def scrape(server: MetricsServer) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as answer:
        assert answer.status == 200
        return answer.read().decode()


def open_silent(server: MetricsServer, count: int) -> list[socket.socket]:
    """``count`` connections that send nothing."""
    return [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(count)]


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` (its read ends) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


async def test_connections_a_caller_opens_and_never_uses_take_a_bounded_number_of_threads() -> None:
    """100 silent connections to a server as shipped: the process runs no more than its bound of
    threads for them (old code: a thread each, held for as long as the caller liked), and once
    the caller closes them a scrape is answered."""
    server, _ = metrics_server()
    try:
        scrape(server)  # the server's threads at rest, then the attack
        before = threading.active_count()
        silent = open_silent(server, 100)
        try:
            # All in the listen backlog at once; the 8 served hold their slots (their deadline is 10 s).
            await wait_for(lambda: server.httpd.turned_away >= 100 - MAX_CONNECTIONS, timeout=30)
            # A handler thread and its request deadline per connection served.
            assert threading.active_count() - before <= 2 * MAX_CONNECTIONS
        finally:
            for sock in silent:
                sock.close()
        # Their slots come back: a scrape gets one.
        await wait_for(lambda: "gpufleet_test_pages" in _try_scrape(server), timeout=30)
    finally:
        server.close()


def _try_scrape(server: MetricsServer) -> str:
    try:
        return scrape(server)
    except OSError:
        return ""


def test_a_request_trickled_a_byte_at_a_time_is_closed_at_its_deadline(served) -> None:
    """A caller sending its request a byte every 0.2 s (each read finishes well inside the
    socket's timeout) is closed once the request is not whole at its deadline (1 s here; old code:
    open for as long as the caller kept trickling)."""
    server, _ = served
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        started = time.monotonic()
        closed = False
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            if closed_by_server(sock, within=0.2):
                closed = True
                break
        assert closed, "the request was still being read after 200 bytes"
        assert time.monotonic() - started < 10
    finally:
        sock.close()
    assert "gpufleet_test_pages" in scrape(server)


def test_a_caller_silent_after_connecting_is_closed_and_its_slot_given_back(served) -> None:
    """Eight silent connections fill every slot; each is closed at its request deadline, and the
    next scrape is answered (old code: held open; with the bound and no deadline, the port would
    answer no one again)."""
    server, _ = served
    silent = open_silent(server, 8)
    try:
        assert all(closed_by_server(sock, within=10) for sock in silent)
    finally:
        for sock in silent:
            sock.close()
    assert "gpufleet_test_pages" in scrape(server)


def test_scrapes_sent_in_a_loop_cost_one_page_a_second(served) -> None:
    """30 scrapes as fast as a caller can send them render the page once or twice (one per
    ``page_reuse_s``, a second), not once each (old code: 30 collections of every collector, the
    fleet's and the SDK's page with them); a scrape after that second gets a fresh page."""
    server, counted = served
    started = time.monotonic()
    for _ in range(30):
        scrape(server)
    elapsed = time.monotonic() - started
    assert counted.collected <= 1 + int(elapsed / server.page_reuse_s)
    assert counted.collected < 30
    rendered = counted.collected
    time.sleep(server.page_reuse_s)  # the page's age, not an assertion on timing
    assert f"gpufleet_test_pages_total {float(rendered + 1)}" in scrape(server)


class SlowCollector(CountedCollector):
    """A page that takes longer to render than it is reused for (the fleet's snapshot may take
    seconds: visibility, the cluster, the providers)."""

    def collect(self):
        time.sleep(1.5)
        yield from super().collect()


def test_scrapes_that_waited_for_a_slow_page_are_answered_with_it() -> None:
    """Five scrapes at once while a page takes 1.5 s to render (reused for 1 s): it is rendered
    once and answers all five (its age counts from when it was done; from when it began, each
    scrape that waited would render it again, one after the other)."""
    server, slow = metrics_server(SlowCollector())
    try:
        pages: list[str] = []
        scrapers = [threading.Thread(target=lambda: pages.append(scrape(server))) for _ in range(5)]
        for scraper in scrapers:
            scraper.start()
        for scraper in scrapers:
            scraper.join(timeout=30)
        assert len(pages) == 5 and slow.collected == 1, (len(pages), slow.collected)
    finally:
        server.close()
