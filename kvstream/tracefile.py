"""Read a JSON-lines span file (``kvstream.otel``) and draw a transfer as a text waterfall.

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

__all__ = ["load_spans", "traces", "waterfall"]

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
    """``#`` busy; ``.`` a receive posted but its data not yet there."""
    a = round((s["start_ns"] - t0) / total * width)
    b = max(a + 1, round((s["end_ns"] - t0) / total * width))
    arrived = next((_ns(e["timestamp"]) for e in s.get("events", ()) if e["name"] == "arrived"),
                   None)
    m = a if arrived is None else min(b - 1, max(a, round((arrived - t0) / total * width)))
    return " " * a + "." * (m - a) + "#" * (b - m) + " " * (width - b)


def waterfall(spans: list[dict[str, Any]], *, width: int = 48) -> str:
    """One trace's transfer: transfer spans, then each layer's send and receive spans."""
    if not spans:
        return "(no spans)"
    t0 = min(s["start_ns"] for s in spans)
    t1 = max(s["end_ns"] for s in spans)
    total = max(t1 - t0, 1)
    rows: list[tuple[str, dict[str, Any]]] = []
    for s in sorted((s for s in spans if s["name"] in (*TRANSFER_SPANS, "kvstream.manifest")),
                    key=lambda s: s["start_ns"]):
        rows.append((s["name"].removeprefix("kvstream."), s))
    layers: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        if s["name"].startswith("kvstream.layer.") or s["name"] == "kvstream.wait_layer":
            layers[int(s["attributes"].get("kvstream.layer", -1))].append(s)
    for layer in sorted(layers):
        for s in sorted(layers[layer], key=lambda s: s["name"]):
            rows.append((f"L{layer} {s['name'].removeprefix('kvstream.').replace('layer.', '')}",
                         s))
    lines = [f"trace {spans[0]['context']['trace_id']}   {total / 1e6:.2f} ms   "
             f"(one column = {total / width / 1e6:.2f} ms)"]
    label_w = max(len(label) for label, _ in rows)
    for label, s in rows:
        a = s["attributes"]
        note = []
        if "kvstream.bytes" in a:
            note.append(f"{a['kvstream.bytes']:,} B")
        if s["status"]["status_code"] == "ERROR":
            note.append(f"ERROR {s['status'].get('description', '')}")
        lines.append(f"{label:<{label_w}} |{_bar(s, t0, total, width)}| "
                     f"{(s['end_ns'] - s['start_ns']) / 1e6:8.2f} ms {' '.join(note)}")
    sends = [s for s in spans if s["name"] == "kvstream.layer.send"]
    ends = [s["end_ns"] for s in spans if s["name"] in ("kvstream.receive", "kvstream.pull")]
    if sends and ends:
        exposed = max(ends) - max(s["start_ns"] for s in sends)
        lines.append(f"exposed: {exposed / 1e6:.2f} ms from the last layer leaving the source "
                     f"to the decode side's last byte")
    return "\n".join(lines)
