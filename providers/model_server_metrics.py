"""Reading a model server's load from its Prometheus ``/metrics`` (vLLM's exposition).

The ``Routing`` entity's sample reads ``vllm:num_requests_waiting`` from each of a site's
servers: a site whose queue grows is a site whose new sessions would wait. Each figure is its
node's word, so the site's load is made from them by ``fleet.routing.site_queue_depth``, which
no one server of three or more decides.
"""

from __future__ import annotations

import asyncio
import logging
import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleet.routing import MAX_SERVER_QUEUE, QUEUE_METRIC

log = logging.getLogger(__name__)


def waiting_requests(text: str, metric: str = QUEUE_METRIC) -> float:
    """The gauge's value in one exposition, summed over its label sets (0 when absent), at most
    ``MAX_SERVER_QUEUE``. A value that is no count (NaN, infinite, negative) is a ValueError:
    the page is served from a node, and the site's sample must stay a number routing accepts."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric:
                if not (math.isfinite(sample.value) and sample.value >= 0):
                    raise ValueError(f"{metric} is {sample.value}, not a count of requests")
                total += sample.value
    return min(total, MAX_SERVER_QUEUE)


#: The most of one server's page read, and for how long from the moment it is asked, its
#: connection and its answer's headers included: the page comes from a node, which could send an
#: endless one, drip it a byte a second (each byte within the read timeout), or drip its status
#: line and headers that way (httpx's timeouts are per read: 100 KB of headers at a byte a second
#: held the read for a day), and the sample waits on it. vLLM's own page is some hundreds of KB.
MAX_PAGE_BYTES = 8 * 2**20
PAGE_SECONDS = 5.0
#: A site's servers are read at once, this many at a time: what one node's servers take is
#: ``PAGE_SECONDS``, not ``PAGE_SECONDS`` each, and the sample is back well within its activity's
#: timeout.
READS_AT_ONCE = 32
#: Of a page only the gauge's lines are kept as it comes, at most this much of them, and a line
#: being read at most this long (past either a ValueError): pages read at once hold little each.
MAX_LINE_BYTES = 64 * 2**10


def server_queues(urls: list[str], timeout_s: float = 2.0) -> list[float]:
    """The requests waiting at each of these servers that answered a count, in their order, read
    at once, each within ``PAGE_SECONDS``. A server that does not answer, or answers no count, has
    no figure: a server that does not answer is not Ready either, and readiness already takes it
    out of the weights; one that answers nonsense (or too much, or too slowly: ``MAX_PAGE_BYTES``,
    ``PAGE_SECONDS``) must not stop the others counting. Called from a thread (the sample's),
    never from an event loop."""
    if not urls:
        return []
    return asyncio.run(_server_queues(urls, timeout_s))


async def _server_queues(urls: list[str], timeout_s: float) -> list[float]:
    at_once = asyncio.Semaphore(READS_AT_ONCE)
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=READS_AT_ONCE)) as client:
        async def one(url: str) -> float | None:
            async with at_once:
                try:
                    async with asyncio.timeout(PAGE_SECONDS):
                        return waiting_requests(await _waiting_lines(client, url.rstrip("/") + "/metrics"))
                except TimeoutError:
                    log.info("no load from %s: its page took over %g s", url, PAGE_SECONDS)
                except (httpx.HTTPError, ValueError) as error:
                    log.info("no load from %s: %s", url, error)
                return None

        read = await asyncio.gather(*(one(url) for url in urls))
        return [waiting for waiting in read if waiting is not None]


async def _waiting_lines(client: httpx.AsyncClient, url: str, metric: str = QUEUE_METRIC) -> str:
    """The lines of the page at ``url`` that give ``metric`` a value, the page read up to
    ``MAX_PAGE_BYTES`` (a ValueError past it, or past ``MAX_LINE_BYTES`` in one line or in the
    lines kept)."""
    starts = (f"{metric}{{".encode(), f"{metric} ".encode(), f"{metric}\t".encode())
    kept: list[bytes] = []
    line = bytearray()
    read = held = 0
    async with client.stream("GET", url) as response:
        response.raise_for_status()
        async for chunk in response.aiter_bytes():
            read += len(chunk)
            if read > MAX_PAGE_BYTES:
                raise ValueError(f"its page is over {MAX_PAGE_BYTES // 2**20} MiB")
            *ended, rest = chunk.split(b"\n")
            for part in ended:
                line += part
                if line.lstrip().startswith(starts):
                    kept.append(bytes(line))
                    held += len(line)
                line.clear()
            if held > MAX_LINE_BYTES:
                raise ValueError(f"its page has over {MAX_LINE_BYTES // 2**10} KiB of {metric} lines")
            line += rest
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"its page has a line over {MAX_LINE_BYTES // 2**10} KiB")
    if line.lstrip().startswith(starts):
        kept.append(bytes(line))
    return b"\n".join(kept + [b""]).decode("utf-8", errors="replace")
