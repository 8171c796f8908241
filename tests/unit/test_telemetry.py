"""Telemetry that must never hurt a transfer, the OTEL_* switches, and span-file grouping."""

from __future__ import annotations

import pytest

from kvstream import telemetry
from kvstream.tools import otel
from kvstream.tools.tracefile import traces, waterfall
from kvstream.transfer import Side, Transfer, TransferState


class _BrokenSpan:
    def is_recording(self) -> bool:
        return True

    def set_attributes(self, *_: object) -> None:
        raise RuntimeError("exporter bug")

    def end(self) -> None:
        raise RuntimeError("exporter bug")


def test_a_failing_span_never_breaks_the_ending():
    t = Transfer(transfer_id="t", request_id="r", side=Side.SEND, peer="p", num_layers=2,
                 layer_bytes=10)
    released = []
    t.on_release(lambda: released.append(True))
    t.span = _BrokenSpan()  # type: ignore[assignment]
    assert t.finish(TransferState.FAILED, "x")
    assert released == [True] and t.terminal
    telemetry.end_layer(_BrokenSpan(), ok=False)  # logged, not raised  # type: ignore[arg-type]


def test_no_sdk_means_no_headers_and_no_layer_spans():
    t = Transfer(transfer_id="t", request_id="r", side=Side.RECV, peer="p", num_layers=1,
                 layer_bytes=1)
    span = telemetry.trace_transfer(t, telemetry.open_span("kvstream.push"))
    assert telemetry.headers_of(span) is None and telemetry.traceparent_of(span) == ""
    assert telemetry.layer_span(t, "kvstream.layer.send", 0) is None
    assert telemetry.context_from({}) is not None  # an empty context: a root, never "current"
    t.finish(TransferState.COMPLETED)


@pytest.mark.parametrize("env,want", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_TRACES_EXPORTER": "console,otlp"}, True),
])
def test_otlp_follows_the_standard_variables(monkeypatch, env, want):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert otel.otlp_requested() is want


def test_sdk_disabled_and_grpc(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    otel.configure("x")()  # a no-op: no provider installed
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    from kvstream import ConfigError

    with pytest.raises(ConfigError, match="http/protobuf"):
        otel._check_protocol()


def _span(name: str, sid: str, parent: str | None, tid: str, t0: int, t1: int, **attrs):
    a = {"kvstream.transfer_id": tid, **attrs} if tid else dict(attrs)
    return {"name": name, "context": {"trace_id": "0xabc", "span_id": sid}, "parent_id": parent,
            "attributes": a, "status": {"status_code": "OK"}, "events": [],
            "start_ns": t0, "end_ns": t1}


def test_two_transfers_in_one_request_trace_are_drawn_apart():
    spans = [_span("engine.request", "e", None, "", 0, 100)]
    for tid, base in (("A", 0), ("B", 50)):
        spans += [_span("kvstream.push", f"p{tid}", "e", tid, base, base + 40),
                  _span("kvstream.manifest", f"m{tid}", f"p{tid}", "", base, base + 2),
                  _span("kvstream.receive", f"r{tid}", f"p{tid}", tid, base + 1, base + 40),
                  _span("kvstream.layer.send", f"s{tid}", f"p{tid}", tid, base + 5, base + 20,
                        **{"kvstream.layer": 0, "kvstream.bytes": 10}),
                  _span("kvstream.layer.receive", f"l{tid}", f"r{tid}", tid, base + 3,
                        base + 30, **{"kvstream.layer": 0, "kvstream.bytes": 10})]
    found = traces(spans)
    assert sorted(found) == ["0xabc/A", "0xabc/B"]
    for ss in found.values():
        assert [s["name"] for s in ss].count("kvstream.layer.send") == 1
        assert "manifest" in waterfall(ss) and "L0 send" in waterfall(ss)


def _iso(ns: int) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat()


def _push_trace(layers: int) -> list[dict]:
    base = 1_700_000_000_000_000_000
    ms = 1_000_000
    push = _span("kvstream.push", "p", None, "T", base, base + 100 * ms)
    push["events"] = [{"name": "all_layers_ready", "timestamp": _iso(base + 60 * ms)}]
    spans = [push, _span("kvstream.receive", "r", "p", "T", base, base + 100 * ms)]
    for layer in range(layers):
        t = base + layer * 10 * ms
        spans += [_span("kvstream.layer.send", f"s{layer}", "p", "T", t, t + 5 * ms,
                        **{"kvstream.layer": layer, "kvstream.bytes": 10}),
                  _span("kvstream.layer.receive", f"l{layer}", "r", "T", t, t + 40 * ms,
                        **{"kvstream.layer": layer, "kvstream.bytes": 10})]
        if layer % 2:  # the engine waited for odd layers only
            spans.append(_span("kvstream.wait_layer", f"w{layer}", "r", "T", t, t + ms,
                               **{"kvstream.layer": layer}))
    return spans


def test_waterfall_rows_stay_in_their_frame_and_every_layer_has_its_wait_row():
    text = waterfall(_push_trace(8), width=20)
    bars = [ln for ln in text.splitlines() if ln.count("|") == 2]
    assert {ln.rindex("|") - ln.index("|") for ln in bars} == {21}  # receive spans end last
    for layer in range(8):
        assert f"L{layer} wait_layer" in text
    assert text.count("no wait: landed before the engine asked") == 4


def test_exposed_is_last_layer_ready_to_last_byte():
    from kvstream.tools.tracefile import exposed_ns

    spans = _push_trace(4)
    assert exposed_ns(spans) == 40_000_000  # receive ends at 100 ms, ready at 60 ms
    assert "exposed: 40.00 ms from the prefill engine's last layer_ready" in waterfall(spans)
    spans[0]["events"] = []  # no ready event and no pull: no exposed line rather than a guess
    assert exposed_ns(spans) is None and "exposed" not in waterfall(spans)
    spans[0]["name"] = "kvstream.pull"  # a pull: the source was done before it started
    assert exposed_ns(spans) == 100_000_000
    assert "exposed: 100.00 ms, the whole pull" in waterfall(spans)


def test_folded_waterfall_groups_layers():
    text = waterfall(_push_trace(32), fold=8)
    assert "L0-3 send" in text and "L28-31 receive" in text and "L4 " not in text
    assert text.count(" send ") == 8 and "engine waited 2.00 ms on 2 of 4 layers" in text
