"""Read a JSON-lines span file (``kvstream.tools.otel``) and draw a transfer as a text waterfall.

For a look at where a transfer's time went without a tracing backend: one row per
transfer span and per layer span of both sides, on a shared time axis (the processes
share the host clock, or NTP between hosts), and the part left after the source's last
layer started: what the decode side still waited for.
"""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import datetime
from typing import Any

from kvstream._exceptions import ConfigError

__all__ = ["exposed_ns", "load_spans", "traces", "waterfall"]

TRANSFER_SPANS = ("kvstream.push", "kvstream.receive", "kvstream.pull", "kvstream.serve_pull")


def _ns(stamp: str) -> int:
    dt = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return int(dt.timestamp() * 1e9)


def load_spans(path: str) -> list[dict[str, Any]]:
    """The spans of a JSON-lines file, with ``start_ns``/``end_ns`` added."""
    spans = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    s = json.loads(line)
                    s["start_ns"], s["end_ns"] = _ns(s["start_time"]), _ns(s["end_time"])
                except (ValueError, KeyError) as exc:
                    raise ConfigError(f"{path}:{n}: not a span ({exc})") from exc
                spans.append(s)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    return spans


def traces(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Spans by transfer (``trace_id/transfer_id``): one engine request's trace may hold
    several transfers, and each is drawn on its own."""
    owner = {s["context"]["span_id"]: s["attributes"].get("kvstream.transfer_id", "")
             for s in spans if s["name"] in TRANSFER_SPANS}
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        tid = s["attributes"].get("kvstream.transfer_id") or owner.get(s.get("parent_id") or "")
        if tid:
            by[f"{s['context']['trace_id']}/{tid}"].append(s)
    return {k: ss for k, ss in by.items() if any(s["name"] in TRANSFER_SPANS for s in ss)}


def _bar(s: dict[str, Any], t0: int, total: int, width: int) -> str:
    """``#`` busy; ``.`` a receive posted but its data not yet there. Always ``width``
    columns: a span that ends on the frame's last nanosecond stays inside it."""
    a = min(width - 1, max(0, round((s["start_ns"] - t0) / total * width)))
    b = min(width, max(a + 1, round((s["end_ns"] - t0) / total * width)))
    arrived = s.get("arrived_ns")
    if arrived is None:
        arrived = next((_ns(e["timestamp"]) for e in s.get("events", ())
                        if e["name"] == "arrived"), None)
    m = a if arrived is None else min(b - 1, max(a, round((arrived - t0) / total * width)))
    return " " * a + "." * (m - a) + "#" * (b - m) + " " * (width - b)


def exposed_ns(spans: list[dict[str, Any]]) -> int | None:
    """kvstream's one definition of exposed time: from the source engine marking its last
    layer ready to the destination's last byte in place. For a push: from the push span's
    ``all_layers_ready`` event to the end of the receive span. For a pull the source was
    done before the pull started, so all of it is exposed: the pull span's length (a lazy
    pull hides part of it under the decode forward: the wait_layer rows show how much).
    None when the trace holds neither."""
    ready = [_ns(e["timestamp"]) for s in spans if s["name"] == "kvstream.push"
             for e in s.get("events", ()) if e["name"] == "all_layers_ready"]
    ends = [s["end_ns"] for s in spans if s["name"] == "kvstream.receive"]
    if ready and ends:
        return max(ends) - max(ready)
    pulls = [s for s in spans if s["name"] == "kvstream.pull"]
    if pulls:
        return max(s["end_ns"] for s in pulls) - min(s["start_ns"] for s in pulls)
    return None


def _fold(name: str, group: list[dict[str, Any]]) -> dict[str, Any]:
    """One span standing for several layers' spans of one kind: first start to last end."""
    arrived = [_ns(e["timestamp"]) for s in group for e in s.get("events", ())
               if e["name"] == "arrived"]
    return {"name": name, "start_ns": min(s["start_ns"] for s in group),
            "end_ns": max(s["end_ns"] for s in group),
            "arrived_ns": max(arrived) if arrived else None,
            "attributes": {"kvstream.bytes": sum(s["attributes"].get("kvstream.bytes", 0)
                                                 for s in group)},
            "status": {"status_code": "ERROR" if any(s["status"]["status_code"] == "ERROR"
                                                     for s in group) else "OK"}}


def _layer_rows(spans: list[dict[str, Any]], fold: int | None
                ) -> list[tuple[str, dict[str, Any] | None, str]]:
    """Rows ``(label, span or None, note)``: per layer its send, its receive and the
    engine's wait (a layer the engine never waited for gets a row that says so); with
    ``fold``, layers in at most ``fold`` groups, a send and a receive row each."""
    by: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for s in spans:
        if s["name"].startswith("kvstream.layer.") or s["name"] == "kvstream.wait_layer":
            by[int(s["attributes"].get("kvstream.layer", -1))][
                s["name"].removeprefix("kvstream.").replace("layer.", "")].append(s)
    layers = sorted(by)
    rows: list[tuple[str, dict[str, Any] | None, str]] = []
    if fold is None or len(layers) <= fold:
        for layer in layers:
            for kind in ("send", "receive", "wait_layer"):
                if by[layer][kind]:
                    rows += [(f"L{layer} {kind}", s, "") for s in by[layer][kind]]
                elif kind == "wait_layer" and by[layer]["receive"]:
                    rows.append((f"L{layer} wait_layer", None,
                                 "no wait: landed before the engine asked"))
        return rows
    step = -(-len(layers) // fold)
    for i in range(0, len(layers), step):
        part = layers[i:i + step]
        label = f"L{part[0]}-{part[-1]}"
        waited = [s for layer in part for s in by[layer]["wait_layer"]]
        wait_ms = sum(s["end_ns"] - s["start_ns"] for s in waited) / 1e6
        for kind in ("send", "receive"):
            group = [s for layer in part for s in by[layer][kind]]
            if group:
                note = (f"engine waited {wait_ms:.2f} ms on {len(waited)} of {len(part)} layers"
                        if kind == "receive" else "")
                rows.append((f"{label} {kind}", _fold(kind, group), note))
    return rows


def waterfall(spans: list[dict[str, Any]], *, width: int = 48, fold: int | None = None) -> str:
    """One trace's transfer: transfer spans, then each layer's send, receive and engine
    wait (``fold``: layers in at most that many groups), then the exposed time."""
    if not spans:
        return "(no spans)"
    t0 = min(s["start_ns"] for s in spans)
    t1 = max(s["end_ns"] for s in spans)
    total = max(t1 - t0, 1)
    rows: list[tuple[str, dict[str, Any] | None, str]] = [
        (s["name"].removeprefix("kvstream."), s, "")
        for s in sorted((s for s in spans if s["name"] in (*TRANSFER_SPANS, "kvstream.manifest")),
                        key=lambda s: s["start_ns"])]
    rows += _layer_rows(spans, fold)
    lines = [f"trace {spans[0]['context']['trace_id']}   {total / 1e6:.2f} ms   "
             f"(one column = {total / width / 1e6:.2f} ms; # busy, . posted, data not there)"]
    label_w = max(len(label) for label, _, _ in rows)
    for label, s, note in rows:
        if s is None:
            lines.append(f"{label:<{label_w}} |{' ' * width}|          {note}")
            continue
        a = s["attributes"]
        notes = [note] if note else []
        if "kvstream.bytes" in a:
            notes.insert(0, f"{a['kvstream.bytes']:,} B")
        if s["status"]["status_code"] == "ERROR":
            notes.append(f"ERROR {s['status'].get('description', '')}".rstrip())
        lines.append(f"{label:<{label_w}} |{_bar(s, t0, total, width)}| "
                     f"{(s['end_ns'] - s['start_ns']) / 1e6:8.2f} ms {' '.join(notes)}".rstrip())
    exposed = exposed_ns(spans)
    if exposed is not None and any(s["name"] == "kvstream.pull" for s in spans):
        waited = sum(s["end_ns"] - s["start_ns"] for s in spans if s["name"] == "kvstream.wait_layer")
        lines.append(f"exposed: {exposed / 1e6:.2f} ms, the whole pull (the prefill was done "
                     f"before it); the decode engine waited {waited / 1e6:.2f} ms of it")
    elif exposed is not None:
        lines.append(f"exposed: {exposed / 1e6:.2f} ms from the prefill engine's last "
                     f"layer_ready to the decode side's last byte in place")
    return "\n".join(lines)
