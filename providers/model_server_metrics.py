"""Reading a model server's load from its Prometheus ``/metrics`` (vLLM's exposition).

The ``Routing`` entity's sample sums ``vllm:num_requests_waiting`` over a site's
servers: a site whose queue grows is a site whose new sessions would wait.
"""

from __future__ import annotations

import logging
import math
import time

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


#: The most of one server's page read, and for how long: the page comes from a node, which could
#: send an endless one or drip it a byte a second (each byte within the read timeout), and the
#: worker that reads it samples every model's load. vLLM's own page is some hundreds of KB.
MAX_PAGE_BYTES = 8 * 2**20
PAGE_SECONDS = 5.0


def queue_depth(urls: list[str], timeout_s: float = 2.0) -> float:
    """Requests waiting across these servers. A server that does not answer, or answers no
    count, adds nothing: a server that does not answer is not Ready either, and readiness
    already takes it out of the weights; one that answers nonsense (or too much, or too
    slowly: ``MAX_PAGE_BYTES``, ``PAGE_SECONDS``) must not stop the others counting."""
    total = 0.0
    with httpx.Client(timeout=timeout_s) as client:
        for url in urls:
            try:
                total += waiting_requests(_page(client, url.rstrip("/") + "/metrics"))
            except (httpx.HTTPError, ValueError) as error:
                log.info("no load from %s: %s", url, error)
    return total


def _page(client: httpx.Client, url: str) -> str:
    """The page at ``url``, read up to ``MAX_PAGE_BYTES`` and ``PAGE_SECONDS`` (a ValueError past either)."""
    deadline = time.monotonic() + PAGE_SECONDS
    with client.stream("GET", url) as response:
        response.raise_for_status()
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > MAX_PAGE_BYTES:
                raise ValueError(f"its page is over {MAX_PAGE_BYTES // 2**20} MiB")
            if time.monotonic() > deadline:
                raise ValueError(f"its page took over {PAGE_SECONDS:g} s")
    return body.decode("utf-8", errors="replace")
