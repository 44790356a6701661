"""OpenTelemetry for the gateway: the tracer, the GenAI metrics and the propagator the
request signals use, and (when ``observability.otlp`` is set) the OTLP/HTTP exporters.

Names follow OpenTelemetry's GenAI semantic conventions: spans ``{operation} {model}``
with ``gen_ai.*`` attributes, and the histograms ``gen_ai.server.request.duration``,
``gen_ai.server.time_to_first_token`` and ``gen_ai.client.token.usage`` (the gateway is
the server of its clients and a client of its upstreams).

Everything that is not in ``observability.otlp`` comes from the standard ``OTEL_*``
variables, read by the SDK itself (endpoint, headers, sampler, service name, resource
attributes, export interval); ``OTEL_PROPAGATORS`` picks the propagator (W3C trace
context by default). Nothing here is imported unless telemetry is on: the default
gateway does not load OpenTelemetry at all.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ncap import __version__
from ncap.config import Observability, Otlp
from ncap.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.metrics import Histogram
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.trace import Tracer

__all__ = ["PROVIDER_NAMES", "Telemetry", "finish_reason", "telemetry_for"]

# ``gen_ai.provider.name`` of each route kind (well-known values where one exists)
PROVIDER_NAMES = {
    "openai": "openai",
    "azure": "azure.ai.openai",
    "anthropic": "anthropic",
    "gemini": "gcp.gemini",
    "local": "llama_cpp",
}

# the finish reasons OpenAI's API defines; an upstream's other strings become "other"
# (an upstream-made string never reaches a span as it is)
_FINISH_REASONS = frozenset(
    {"stop", "length", "tool_calls", "content_filter", "function_call", "none"}
)

# the GenAI conventions' advised bucket boundaries
_DURATION_BUCKETS = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92
]  # fmt: skip
_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0
]  # fmt: skip
_TOKEN_BUCKETS = [4.0**i for i in range(14)]  # 1, 4, 16, … 67108864


def finish_reason(reason: str) -> str:
    return reason if reason in _FINISH_REASONS else "other"


@dataclass(slots=True)
class Telemetry:
    """What the request signals make spans and GenAI metrics with."""

    tracer: Tracer
    request_duration: Histogram
    time_to_first_token: Histogram
    token_usage: Histogram
    propagator: TextMapPropagator
    # what to call at shutdown (the providers this module made: flush, then close)
    closers: list[Callable[[], Any]] = field(default_factory=list)

    def shutdown(self) -> None:
        for close in self.closers:
            close()
        self.closers.clear()


def telemetry_for(
    obs: Observability, *, tracer_provider: Any = None, meter_provider: Any = None
) -> Telemetry | None:
    """The telemetry ``observability`` asks for (None: off). Providers passed in (tests)
    win; else ``otlp`` makes OTLP/HTTP ones; else the process's (e.g. set up by
    ``opentelemetry-instrument``)."""
    if not obs.telemetry:
        return None
    try:
        from opentelemetry import metrics, propagate, trace
    except ImportError as exc:
        raise ConfigError(
            "observability.traces and observability.otlp need OpenTelemetry: "
            "pip install 'ncap[otel]'"
        ) from exc
    closers: list[Callable[[], Any]] = []
    if obs.otlp is not None and (tracer_provider is None or meter_provider is None):
        made_tracers, made_meters = _otlp_providers(obs.otlp)
        if tracer_provider is None:
            tracer_provider = made_tracers
            closers.append(made_tracers.shutdown)
        if meter_provider is None:
            meter_provider = made_meters
            closers.append(made_meters.shutdown)
    tracers = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    meters = meter_provider if meter_provider is not None else metrics.get_meter_provider()
    meter = meters.get_meter("ncap", __version__)
    return Telemetry(
        tracer=tracers.get_tracer("ncap", __version__),
        request_duration=meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Generative AI server request duration",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        ),
        time_to_first_token=meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to the first chunk of a streamed answer",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS,
        ),
        token_usage=meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Tokens used per upstream attempt, by gen_ai.token.type",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
        ),
        propagator=propagate.get_global_textmap(),
        closers=closers,
    )


def _otlp_providers(otlp: Otlp) -> tuple[Any, Any]:
    """A tracer provider and a meter provider exporting over OTLP/HTTP (protobuf)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise ConfigError(
            "observability.otlp needs the OTLP exporter: pip install 'ncap[otel]'"
        ) from exc
    resource = _resource(otlp)
    base = otlp.endpoint.rstrip("/") if otlp.endpoint else None
    headers = dict(otlp.headers) or None  # None: OTEL_EXPORTER_OTLP_HEADERS
    spans = OTLPSpanExporter(
        endpoint=f"{base}/v1/traces" if base else None, headers=headers, timeout=otlp.timeout_s
    )
    sampler = ParentBased(TraceIdRatioBased(otlp.sampling)) if otlp.sampling is not None else None
    tracers = TracerProvider(resource=resource, sampler=sampler)
    tracers.add_span_processor(BatchSpanProcessor(spans))
    points = OTLPMetricExporter(
        endpoint=f"{base}/v1/metrics" if base else None, headers=headers, timeout=otlp.timeout_s
    )
    interval = otlp.metrics_interval_s * 1000 if otlp.metrics_interval_s else None
    reader = PeriodicExportingMetricReader(points, export_interval_millis=interval)
    meters = MeterProvider(resource=resource, metric_readers=[reader])
    return tracers, meters


def _resource(otlp: Otlp) -> Any:
    """``service.name``: the config's, else ``OTEL_SERVICE_NAME`` /
    ``OTEL_RESOURCE_ATTRIBUTES`` (read by ``Resource.create``), else ``ncap``."""
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create({"service.version": __version__})
    name = otlp.service_name
    if name is None and str(resource.attributes.get("service.name", "")).startswith(
        "unknown_service"
    ):
        name = os.environ.get("OTEL_SERVICE_NAME") or "ncap"
    return resource.merge(Resource({"service.name": name})) if name else resource
