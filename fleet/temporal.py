"""One way to connect to Temporal: standard environment configuration (TLS, API key),
pydantic payloads and OpenTelemetry tracing."""

from __future__ import annotations

import os

from temporalio.client import Client, Interceptor
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime

from fleet.settings import Settings, temporal_profile

_tracing_ready = False


def tracing_interceptors() -> list[Interceptor]:
    """Temporal's tracing interceptor, exporting per the standard OTEL_* env vars.

    Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_TRACES_EXPORTER``
    other than ``none``) is set, so a laptop run exports nothing.
    """
    global _tracing_ready
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "otlp" if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") else "none")
    if exporter == "none" or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return []
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from temporalio.contrib.opentelemetry import TracingInterceptor

    if not _tracing_ready:
        provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "gpufleet")}))
        if exporter == "console":
            span_exporter = ConsoleSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            span_exporter = OTLPSpanExporter()  # endpoint, headers from OTEL_EXPORTER_OTLP_*
        provider.add_span_processor(BatchSpanProcessor(span_exporter))
        trace.set_tracer_provider(provider)
        _tracing_ready = True
    return [TracingInterceptor()]


def flush_tracing() -> None:
    """Export buffered spans now (before a process ends without atexit handlers)."""
    if _tracing_ready:
        from opentelemetry import trace

        trace.get_tracer_provider().shutdown()


async def connect(settings: Settings | None = None, runtime: Runtime | None = None) -> Client:
    """The one way every client and worker connects.

    Address and namespace come from ``settings`` (flags, else Temporal's environment
    configuration); the API key, TLS / mTLS files, server name and gRPC metadata from
    Temporal's standard environment configuration (``TEMPORAL_API_KEY``,
    ``TEMPORAL_TLS_*``, ``temporal.toml`` profiles), exactly as the ``temporal`` CLI
    reads them. ``runtime`` carries a worker's metrics telemetry.
    """
    settings = settings or Settings.from_env()
    connect_config = dict(temporal_profile().to_client_connect_config())
    connect_config.update(target_host=settings.address, namespace=settings.namespace)
    return await Client.connect(
        **connect_config,
        data_converter=pydantic_data_converter,
        interceptors=tracing_interceptors(),
        runtime=runtime,
    )
