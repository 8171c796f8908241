"""Configure the OpenTelemetry SDK for a kvstream process (sidecar, CLI, demo, tests).

The library itself only uses the API (``kvstream.telemetry``); an application calls
``configure`` once. Exporters:

* OTLP over HTTP when the standard variables ask for it (``OTEL_EXPORTER_OTLP_ENDPOINT``,
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or ``OTEL_TRACES_EXPORTER=otlp``); the exporter
  reads the rest of ``OTEL_*`` itself (headers, timeouts). Metrics go the same way.
* a JSON-lines span file (``span_file``: one span per line, what ``kvstream trace`` reads);
* the console (``console=True``).

``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` name the process as usual.
Spans leave through a ``BatchSpanProcessor``, off the transfer's path.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvstream._exceptions import ConfigError

__all__ = ["JsonLinesSpanExporter", "configure", "otlp_requested"]


def _exporters(var: str) -> list[str]:
    return [x.strip().lower() for x in os.environ.get(var, "").split(",") if x.strip()]


def otlp_requested() -> bool:
    """OTLP traces asked for by the standard variables (an endpoint, or the exporter list)."""
    env = os.environ
    named = _exporters("OTEL_TRACES_EXPORTER")
    if named:
        return "otlp" in named
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or
                env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _check_protocol() -> None:
    for var in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"):
        if os.environ.get(var, "http/protobuf") not in ("http/protobuf", ""):
            raise ConfigError(f"{var}={os.environ[var]}: kvstream exports OTLP over "
                              "http/protobuf (point it at the collector's HTTP port, 4318)")


class JsonLinesSpanExporter:
    """One JSON object per finished span, appended to a file (safe across processes:
    each line is written with a single ``write`` on an ``O_APPEND`` descriptor)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = "".join(json.dumps(json.loads(s.to_json(indent=None)),
                                   separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            os.write(self._fd, lines.encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def configure(service_name: str, *, span_file: str | None = None, console: bool = False,
              otlp: bool | None = None) -> Callable[[], None]:
    """Install tracer and meter providers; returns a function that flushes and shuts them
    down. ``OTEL_SDK_DISABLED=true`` turns it into a no-op; ``OTEL_TRACES_EXPORTER`` /
    ``OTEL_METRICS_EXPORTER`` (comma lists of otlp, console, none) pick exporters on top of
    the arguments. Raises ConfigError when the SDK (the ``otel`` extra) is missing."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return lambda: None
    try:
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        raise ConfigError("tracing needs the OpenTelemetry SDK: pip install opentelemetry-sdk"
                          ) from exc
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                service_name)})
    tracer_provider = TracerProvider(resource=resource)
    use_otlp = otlp_requested() if otlp is None else otlp
    named_metrics = _exporters("OTEL_METRICS_EXPORTER")
    metrics_otlp = "otlp" in named_metrics if named_metrics else use_otlp
    console = console or "console" in _exporters("OTEL_TRACES_EXPORTER")
    readers = []
    if use_otlp or metrics_otlp:
        _check_protocol()
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        except ImportError as exc:
            raise ConfigError("OTLP export needs opentelemetry-exporter-otlp-proto-http: "
                              "pip install 'kvstream[otel]'") from exc
        if use_otlp:
            tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        if metrics_otlp:
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if "console" in named_metrics:
        from opentelemetry.sdk.metrics.export import (
            ConsoleMetricExporter,
            PeriodicExportingMetricReader,
        )

        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
    if span_file:
        tracer_provider.add_span_processor(
            BatchSpanProcessor(JsonLinesSpanExporter(span_file)))  # type: ignore[arg-type]
    if console:
        tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(tracer_provider)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    metrics.set_meter_provider(meter_provider)

    def shutdown() -> None:
        tracer_provider.shutdown()
        meter_provider.shutdown()

    return shutdown
