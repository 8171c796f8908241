"""One transfer, one trace: spans from two processes joined over NATS and the data plane."""

from __future__ import annotations

import os

import pytest

from kvstream import KVLayout
from kvstream.bench.runner import Harness
from kvstream.bench.synthetic import BenchSpec
from kvstream.tools.tracefile import load_spans, traces, waterfall

LAYERS = 6


def _spans(tmp_path, nats_server, mode: str) -> tuple[BenchSpec, list[dict]]:
    lay = KVLayout(num_layers=LAYERS, num_kv_heads=2, head_dim=64, block_size=16)
    spec = BenchSpec(layout=lay, tokens=16 * 20, trace_dir=str(tmp_path),
                     namespace=f"trace-{mode}", layered=True)  # a span per layer
    with Harness(spec, nats_url=nats_server.url, timeout_s=60) as h:
        run = h.run_kv(mode=mode, compute_ms=1.0)
        assert run.status == "completed" and run.verified, run.reason
    spans = []
    for role in ("prefill", "decode"):
        path = os.path.join(tmp_path, f"{role}.jsonl")
        spans += [dict(s, process=role) for s in load_spans(path)]
    return spec, spans


@pytest.mark.parametrize("mode,root,child", [("push-pipelined", "kvstream.push", "kvstream.receive"),
                                             ("pull-eager", "kvstream.pull", "kvstream.serve_pull")])
def test_one_trace_across_both_processes(tmp_path, nats_server, mode, root, child):
    spec, spans = _spans(tmp_path, nats_server, mode)
    by_trace = traces(spans)
    assert len(by_trace) == 1, f"{len(by_trace)} traces for one transfer"
    (trace,) = by_trace.values()
    assert {s["process"] for s in trace} == {"prefill", "decode"}
    names = [s["name"] for s in trace]
    assert names.count(root) == 1 and names.count(child) == 1
    top = next(s for s in trace if s["name"] == root)
    other = next(s for s in trace if s["name"] == child)
    assert top["parent_id"] is None
    assert other["parent_id"] == top["context"]["span_id"]  # joined through NATS headers
    (exchange,) = [s for s in trace if s["name"] == "kvstream.manifest"]
    assert exchange["parent_id"] == top["context"]["span_id"] and exchange["process"] == (
        "prefill" if root == "kvstream.push" else "decode")
    sender = top if root == "kvstream.push" else other
    receiver = other if root == "kvstream.push" else top
    assert sender["process"] == "prefill" and receiver["process"] == "decode"
    for name, parent in (("kvstream.layer.send", sender), ("kvstream.layer.receive", receiver)):
        layer_spans = [s for s in trace if s["name"] == name]
        assert sorted(s["attributes"]["kvstream.layer"] for s in layer_spans) == list(range(LAYERS))
        assert all(s["parent_id"] == parent["context"]["span_id"] for s in layer_spans)
        assert all(s["status"]["status_code"] != "ERROR" for s in layer_spans)
        assert sum(s["attributes"]["kvstream.bytes"] for s in layer_spans) == spec.payload_bytes
    sends = {s["context"]["span_id"]: s for s in trace if s["name"] == "kvstream.layer.send"}
    for s in trace:
        if s["name"] == "kvstream.layer.receive":  # linked to its sender's layer span
            (link,) = s["links"]
            sent = sends[link["context"]["span_id"]]
            assert sent["attributes"]["kvstream.layer"] == s["attributes"]["kvstream.layer"]
    for end in (sender, receiver):
        assert end["attributes"]["kvstream.bytes"] == spec.payload_bytes
        assert end["attributes"]["kvstream.status"] == "completed"
        assert end["status"]["status_code"] == "OK"
    text = waterfall(trace)
    assert "L5 send" in text and "L5 receive" in text and "exposed:" in text


def test_trace_command_draws_the_transfer(tmp_path, nats_server):
    import subprocess
    import sys

    _spans(tmp_path, nats_server, "push-eager")
    files = [str(tmp_path / "prefill.jsonl"), str(tmp_path / "decode.jsonl")]
    out = subprocess.run([sys.executable, "-m", "kvstream.tools.cli", "trace", *files],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("trace 0x") == 1
    for row in ("push", "receive", f"L{LAYERS - 1} send", f"L{LAYERS - 1} receive", "exposed:"):
        assert row in out.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    out = subprocess.run([sys.executable, "-m", "kvstream.tools.cli", "trace", str(bad)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0 and "not a span" in out.stderr


SIDECAR_CHILD = """
import sys
import anyio
from opentelemetry import trace
from kvstream import AgentConfig, Client, KVLayout, SharedKV, Sidecar
from kvstream.tools.otel import configure

shutdown = configure("sidecar-trace", span_file=sys.argv[2], otlp=False)

async def main(url, d):
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=8)
    cfg = dict(nats_url=url, heartbeat_s=0.25, peer_timeout_s=1.0)
    async with anyio.create_task_group() as tg:
        for name in ("tsp", "tsd"):
            await tg.start(Sidecar(AgentConfig(instance_id=name, **cfg), f"{d}/{name}.sock").serve)
        kp, kd = SharedKV.create(lay, 8), SharedKV.create(lay, 8)
        async with Client.connect(f"{d}/tsp.sock") as p, Client.connect(f"{d}/tsd.sock") as dd:
            await p.register_kv(lay, kp)
            await dd.register_kv(lay, kd)
            rx = await dd.expect("r", [0, 1], src="tsp")
            with trace.get_tracer("engine").start_as_current_span("engine.request"):
                tx = await p.push("r", "tsd", [2, 3])  # the span crosses the local socket
            tx.all_ready()
            await rx.wait()
            await tx.wait()
        tg.cancel_scope.cancel()

anyio.run(main, sys.argv[1], sys.argv[3])
shutdown()
"""


def test_engine_span_reaches_the_sidecar(tmp_path, nats_server):
    """An engine behind a sidecar passes its current span along: the push nests under it."""
    import subprocess
    import sys

    spans_file = tmp_path / "spans.jsonl"
    out = subprocess.run([sys.executable, "-c", SIDECAR_CHILD, nats_server.url, str(spans_file),
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    spans = {s["name"]: s for s in load_spans(str(spans_file))}
    engine, push = spans["engine.request"], spans["kvstream.push"]
    assert push["parent_id"] == engine["context"]["span_id"]
    assert spans["kvstream.receive"]["parent_id"] == push["context"]["span_id"]
