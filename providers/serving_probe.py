"""Health-gate probes: N requests to a site's serving Service.

Real mode (``HttpProbe``): ``POST /v1/completions`` (OpenAI-compatible, what vLLM,
SGLang and TensorRT-LLM serve) with a one-token prompt to
``http://<serving_name>.<namespace>.svc.cluster.local:8000``; override the base
with ``GPUFLEET_SERVING_URL`` (``{name}``, ``{namespace}``, ``{model}``, ``{site}``
are filled in) and the namespace with ``GPUFLEET_NAMESPACE``. A probe fails on a
transport error or a non-2xx answer.

Sim mode: ``sim/probe.py``.
"""

from __future__ import annotations

from fleet.rollout import ProbeResult
from fleet.settings import ControlPlaneEnv
from fleet.cluster import SERVING_PORT
from providers.cluster.base import serving_name


class HttpProbe:
    def __init__(self, namespace: str | None = None) -> None:
        self.namespace = namespace or ControlPlaneEnv.get("serving_namespace")
        self.template = (ControlPlaneEnv.get("serving_url")
                         or f"http://{{name}}.{{namespace}}.svc.cluster.local:{SERVING_PORT}")

    def url(self, model: str, site: str) -> str:
        return self.template.format(name=serving_name(model, site), namespace=self.namespace, model=model, site=site)

    def probe(self, model: str, site: str, requests: int, timeout_s: float) -> ProbeResult:
        import httpx

        result = ProbeResult(site=site)
        with httpx.Client(base_url=self.url(model, site), timeout=timeout_s) as client:
            for _ in range(requests):
                result.sent += 1
                try:
                    response = client.post("/v1/completions", json={"model": model, "prompt": "ping", "max_tokens": 1})
                    if response.is_success:
                        continue
                    problem = f"HTTP {response.status_code}: {response.text[:200]}"
                except httpx.HTTPError as error:
                    problem = f"{type(error).__name__}: {error}"
                result.errors += 1
                if len(result.samples) < 3:
                    result.samples.append(problem)
        return result
