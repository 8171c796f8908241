"""Traces and metrics of transfers, through the OpenTelemetry *API* only.

The library never configures an SDK: an application (the sidecar, the CLI, the demo,
or the engine) does, with ``kvstream.tools.otel.configure``. Without one every call here is
the API's no-op, and the per-layer work is skipped outright: a layer span is made only
when its transfer's span is recording.

One transfer is one trace across both sides. The side that starts it (``push``, or
``pull`` on the decode side) opens the transfer span under the caller's current context
(the engine's request span nests it); its W3C ``traceparent`` rides in the NATS headers
of the manifest / pull, and the other side's transfer span is its child. Each side has a
span per layer under its own transfer span; a layer's data-plane header carries the
sender's layer span, linked from the receiver's. Metric names and units: README,
"Observability".
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

if TYPE_CHECKING:
    from opentelemetry.trace import Span


class _Outcome(Protocol):
    """What telemetry reads of a transfer's result (``transfer.TransferResult``)."""

    @property
    def transfer_id(self) -> str: ...

    @property
    def request_id(self) -> str: ...

    @property
    def side(self) -> str: ...

    @property
    def peer(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def reason(self) -> str: ...

    @property
    def bytes(self) -> int: ...

    @property
    def layers(self) -> int: ...

    @property
    def bytes_skipped(self) -> int: ...

    @property
    def codec(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def seconds(self) -> float: ...

    @property
    def ok(self) -> bool: ...


class _Side(Protocol):
    @property
    def value(self) -> str: ...


class Transfer(Protocol):
    """What telemetry reads of a transfer (``transfer.Transfer``): the tracing API knows
    the transfer only through this, so it imports nothing of the engine."""

    transfer_id: str
    num_layers: int
    codec: str
    span: Span | None
    streamed: bool
    shared: bool

    @property
    def side(self) -> _Side: ...

    @property
    def terminal(self) -> bool: ...

    def result(self) -> _Outcome: ...

__all__ = [
    "all_layers_ready",
    "context_from",
    "headers_of",
    "layer_span",
    "link_from",
    "metrics_for",
    "open_span",
    "route_decided",
    "trace_transfer",
    "traceparent_of",
    "transfer_started",
]

log = logging.getLogger("kvstream.telemetry")
_tracer = trace.get_tracer("kvstream")
_tracked: weakref.WeakSet[Any] = weakref.WeakSet()  # spans a Transfer will end
_meter = metrics.get_meter("kvstream")

# Bucket advice in the metric's own unit (the SDK's defaults suit milliseconds).
_SECONDS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0]
_duration = _meter.create_histogram(
    "kvstream.transfer.duration", unit="s",
    description="Time from the start of a transfer to its end, per side",
    explicit_bucket_boundaries_advisory=_SECONDS)
_bytes = _meter.create_counter(
    "kvstream.transfer.bytes", unit="By", description="Bytes moved over the data plane")
_skipped = _meter.create_counter(
    "kvstream.transfer.skipped_bytes", unit="By",
    description="Bytes not moved because the destination held them (incremental)")
_throughput = _meter.create_histogram(
    "kvstream.transfer.throughput", unit="By/s",
    description="Wire bytes over the duration of each completed transfer",
    explicit_bucket_boundaries_advisory=[1e8, 2.5e8, 5e8, 1e9, 2e9, 4e9, 8e9, 1.6e10, 3.2e10,
                                         6.4e10, 1.28e11])
_ended = _meter.create_counter(
    "kvstream.transfer.ended", unit="{transfer}",
    description="Transfers ended, by side and status (completed, failed, aborted, ...)")
_active = _meter.create_up_down_counter(
    "kvstream.transfer.active", unit="{transfer}",
    description="Transfers not yet ended (reservations and held offers included)")
_layer_wait = _meter.create_histogram(
    "kvstream.layer.wait", unit="s",
    description="How long the decode engine waited for a layer that had not landed",
    explicit_bucket_boundaries_advisory=_SECONDS)


_route_blocks = _meter.create_counter(
    "kvstream.route.blocks", unit="{block}",
    description="Prompt blocks of routed legs, by leg and whether the chosen engine held "
                "them (kvstream.hit)")


def route_decided(leg: str, blocks: int, overlap: int) -> None:
    """One leg placed by a KV-aware router: its prompt blocks, those already held."""
    _route_blocks.add(overlap, {"kvstream.leg": leg, "kvstream.hit": True})
    _route_blocks.add(max(0, blocks - overlap), {"kvstream.leg": leg, "kvstream.hit": False})


_gauges: list[Callable[[], list[metrics.Observation]]] = []


def _observe(_options: metrics.CallbackOptions) -> list[metrics.Observation]:
    return [o for cb in list(_gauges) for o in cb()]


_meter.create_observable_up_down_counter(
    "kvstream.staging.usage", callbacks=[_observe], unit="By",
    description="Staging pool bytes lent out, per agent")


def observe_staging(cb: Callable[[], list[metrics.Observation]]) -> Callable[[], None]:
    """Register an agent's staging gauge; returns the unregister function."""
    _gauges.append(cb)
    return lambda: _gauges.remove(cb) if cb in _gauges else None


def context_from(headers: Mapping[str, str] | None) -> Context:
    """The remote parent a peer sent in NATS headers; without one an empty context, so the
    span is a root, not a child of whatever was current when the agent started."""
    if not headers or not headers.get("traceparent"):
        return Context()
    return propagate.extract(dict(headers))


def headers_of(span: Span | None) -> dict[str, str] | None:
    """NATS headers carrying ``span`` as the remote parent. Sent whenever the span context
    is valid, sampled or not, so the peer follows the same sampling decision (a no-op
    span without an SDK is invalid: nothing is sent)."""
    if span is None or not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier or None


def current_traceparent(context: Context | None = None) -> str:
    """The current span of ``context`` (default: the caller's) as a ``traceparent`` ("" when
    none is recording)."""
    return traceparent_of(trace.get_current_span(context))


def traceparent_of(span: Span | None) -> str:
    headers = headers_of(span)
    return headers.get("traceparent", "") if headers else ""


def count_refused(side: str, code: str) -> None:
    """A request refused before any transfer existed (a pull of an expired offer)."""
    _ended.add(1, {"kvstream.side": side, "kvstream.codec": "none",
                   "kvstream.status": "failed", "kvstream.reason": f"refused_{code}"})


def link_from(traceparent: str) -> list[Link]:
    """A link to the peer's layer span named in a data-plane header."""
    if not traceparent:
        return []
    ctx = trace.get_current_span(propagate.extract({"traceparent": traceparent}))
    sc = ctx.get_span_context()
    return [Link(sc)] if sc.is_valid else []


def open_span(name: str, *, parent: Context | None = None,
              kind: SpanKind = SpanKind.INTERNAL, **attributes: Any) -> Span:
    """A transfer's span under ``parent`` (default: the caller's current context)."""
    return _tracer.start_span(name, context=parent, kind=kind, attributes={
        f"kvstream.{k}": v for k, v in attributes.items() if v is not None})


def trace_transfer(t: Transfer, span: Span) -> Span:
    """Make ``span`` the trace of ``t``: ended with its outcome when ``t`` ends."""
    t.span = span
    _tracked.add(span)
    if t.terminal:
        _end_span(t, span)
    return span


def end_untracked(span: Span, exc: BaseException) -> None:
    """End a span whose transfer never came to exist (the request failed before)."""
    if span.is_recording() and span not in _tracked:
        span.set_status(Status(StatusCode.ERROR, repr(exc)))
        span.end()


def transfer_started(t: Transfer) -> None:
    """Every transfer counts (reservations and offers too) until it ends."""
    _active.add(1, {"kvstream.side": t.side.value})


def transfer_ended(t: Transfer) -> None:
    """Called once by ``Transfer.finish`` after its release hooks. Telemetry must never
    break a transfer's ending: an exporter's error is logged, not raised."""
    try:
        _active.add(-1, {"kvstream.side": t.side.value})
        if not t.shared:  # a shared offer's bytes are its readers' (counted there)
            _record_end(t)
        if t.span is not None:
            _end_span(t, t.span)
    except Exception:
        log.exception("telemetry failed at the end of %r", t)


def _record_end(t: Transfer) -> None:
    r = t.result()
    attrs = {"kvstream.side": r.side, "kvstream.codec": r.codec, "kvstream.path": r.path}
    if t.streamed or r.ok:  # an idle offer or reservation says nothing about latency
        _duration.record(r.seconds, {**attrs, "kvstream.status": r.status})
    _ended.add(1, {**attrs, "kvstream.status": r.status,
                   "kvstream.reason": reason_class(r.status, r.reason)})
    if r.bytes:
        _bytes.add(r.bytes, {**attrs, "kvstream.direction":
                             "sent" if r.side == "send" else "received"})
    if r.bytes_skipped:
        _skipped.add(r.bytes_skipped, attrs)
    if r.ok and r.seconds > 0 and r.bytes:
        _throughput.record(r.bytes / r.seconds, attrs)


def _end_span(t: Transfer, span: Span) -> None:
    if not span.is_recording():
        return
    r = t.result()
    span.set_attributes({"kvstream.request_id": r.request_id,
                         "kvstream.transfer_id": r.transfer_id, "kvstream.peer": r.peer,
                         "kvstream.side": r.side, "kvstream.bytes": r.bytes,
                         "kvstream.bytes_skipped": r.bytes_skipped,
                         "kvstream.layers_done": r.layers, "kvstream.layers": t.num_layers,
                         "kvstream.codec": r.codec, "kvstream.status": r.status,
                         "kvstream.path": r.path})
    if r.ok:
        span.set_status(Status(StatusCode.OK))
    else:
        span.set_status(Status(StatusCode.ERROR, f"{r.status}: {r.reason}"))
    span.end()


def layer_span(t: Transfer, name: str, layer: int, *, start_ns: int | None = None,
               links: list[Link] | None = None, **attributes: Any) -> Span | None:
    """A child of ``t``'s span for one layer, or None when nobody records (no cost)."""
    parent = t.span
    if parent is None or not parent.is_recording():
        return None
    return _tracer.start_span(
        name, context=trace.set_span_in_context(parent), start_time=start_ns, links=links,
        attributes={"kvstream.layer": layer, "kvstream.transfer_id": t.transfer_id,
                    **{f"kvstream.{k}": v for k, v in attributes.items() if v is not None}})


@contextlib.contextmanager
def step(parent: Span | None, name: str, **attributes: Any) -> Iterator[Span | None]:
    """A child span of ``parent`` around one step (the manifest or pull exchange); nothing
    when ``parent`` does not record."""
    if parent is None or not parent.is_recording():
        yield None
        return
    span = _tracer.start_span(name, context=trace.set_span_in_context(parent), attributes={
        f"kvstream.{k}": v for k, v in attributes.items() if v is not None})
    try:
        yield span
    except BaseException as exc:
        span.set_status(Status(StatusCode.ERROR, repr(exc)))
        raise
    finally:
        span.end()


def reason_class(status: str, reason: str) -> str:
    """A low-cardinality cause for ``kvstream.transfer.ended`` (the reason text is free)."""
    if status in ("completed", "expired"):
        return status
    text = reason.lower()
    if text.startswith("aborted by ") and not text.startswith("aborted by the engine"):
        return "aborted_by_peer"  # the peer's Abort: "aborted by <instance>: <why>"
    for cls, words in (("timeout", ("deadline", "timed out", "timeout")),
                       ("peer_lost", ("peer lost", "dead", "died", "no heartbeat", "left",
                                      "no instance answers")),
                       ("lease", ("lease",)),
                       ("codec", ("fp8", "int8", "wire codec", "inf or nan", "scales", "quantiz")),
                       ("shutdown", ("shutting down", "unregistered")),
                       ("refused", ("refused", "incompatible", "fingerprint")),
                       ("aborted", ("abort",))):
        if any(w in text for w in words):
            return cls
    return status


def end_layer(span: Span | None, ok: bool) -> None:
    """End a layer span; never raises (it runs in the streams' ``finally`` blocks)."""
    if span is None:
        return
    try:
        if not ok:
            span.set_status(Status(StatusCode.ERROR, "layer did not complete"))
        span.end()
    except Exception:
        log.exception("ending a layer span failed")


def all_layers_ready(t: Transfer) -> None:
    """The source engine has marked its last layer ready: the start of exposed time (the
    one definition kvstream uses: from here to the destination's last byte in place)."""
    span = t.span
    if span is not None and span.is_recording():
        try:
            span.add_event("all_layers_ready")
        except Exception:
            log.exception("recording all_layers_ready failed")


def record_wait(t: Transfer, layer: int, start_ns: int) -> None:
    """The engine waited for ``layer`` since ``start_ns`` (it had not landed)."""
    seconds = (time.time_ns() - start_ns) / 1e9
    _layer_wait.record(seconds, {"kvstream.codec": t.codec})
    span = layer_span(t, "kvstream.wait_layer", layer, start_ns=start_ns)
    if span is not None:
        span.end()


def record_engine_wait(layer: int, start_ns: int) -> None:
    """An engine behind a sidecar waited for ``layer``: measured in the engine's process,
    under its current span (the transfer's spans live in the sidecar)."""
    _layer_wait.record((time.time_ns() - start_ns) / 1e9, {"kvstream.where": "engine"})
    span = _tracer.start_span("kvstream.wait_layer", start_time=start_ns,
                              attributes={"kvstream.layer": layer})
    span.end()


def metrics_for() -> dict[str, str]:
    """Metric names and units (the README lists them from here)."""
    return {"kvstream.transfer.duration": "s", "kvstream.transfer.bytes": "By",
            "kvstream.transfer.skipped_bytes": "By", "kvstream.transfer.throughput": "By/s",
            "kvstream.transfer.ended": "{transfer}", "kvstream.transfer.active": "{transfer}",
            "kvstream.layer.wait": "s", "kvstream.staging.usage": "By"}
