"""Reading a model server's load from its Prometheus ``/metrics`` (vLLM's exposition).

The ``Routing`` entity's sample sums ``vllm:num_requests_waiting`` over a site's
servers: a site whose queue grows is a site whose new sessions would wait.
"""

from __future__ import annotations

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


def queue_depth(urls: list[str], timeout_s: float = 2.0) -> float:
    """Requests waiting across these servers. A server that does not answer, or answers no
    count, adds nothing: a server that does not answer is not Ready either, and readiness
    already takes it out of the weights; one that answers nonsense must not stop the others
    counting."""
    total = 0.0
    with httpx.Client(timeout=timeout_s) as client:
        for url in urls:
            try:
                response = client.get(url.rstrip("/") + "/metrics")
                response.raise_for_status()
                total += waiting_requests(response.text)
            except (httpx.HTTPError, ValueError) as error:
                log.info("no load from %s: %s", url, error)
    return total
