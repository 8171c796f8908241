"""OTLP export end to end: a real OTLP/HTTP receiver on loopback decodes what arrives."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import textwrap
import threading

import pytest

pb_trace = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pb_metrics = pytest.importorskip("opentelemetry.proto.collector.metrics.v1.metrics_service_pb2")

CHILD = textwrap.dedent("""
    import sys
    import anyio, torch
    from opentelemetry import metrics, trace
    from kvstream import Agent, AgentConfig, KVLayout
    from kvstream.tools.otel import configure

    shutdown = configure("otlp-test")  # OTLP, from the OTEL_* environment

    async def main(url):
        lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_size=8)
        mk = lambda: [torch.randn(lay.tensor_shape(8)).half() for _ in range(3)]
        cfg = dict(nats_url=url, heartbeat_s=0.25, peer_timeout_s=1.0)
        async with Agent(AgentConfig(instance_id="op", **cfg), layout=lay, kv_caches=mk()) as p, \\
                Agent(AgentConfig(instance_id="od", **cfg), layout=lay, kv_caches=mk()) as d:
            rx = d.expect("r", [0, 1], src=p.instance_id)
            with trace.get_tracer("engine").start_as_current_span("engine.request"):
                tx = await p.push("r", "od", [2, 3])  # nests under the engine's span
            tx.all_ready()
            await rx.wait()
            await tx.wait()
            metrics.get_meter_provider().force_flush()  # gauges are read while agents live

    anyio.run(main, sys.argv[1])
    shutdown()
""")


class _Receiver(http.server.BaseHTTPRequestHandler):
    spans: list = []
    metrics: list = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces":
            req = pb_trace.ExportTraceServiceRequest()
            req.ParseFromString(body)
            for rs in req.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes
                               if a.key == "service.name")
                for ss in rs.scope_spans:
                    _Receiver.spans += [(service, s) for s in ss.spans]
        elif self.path == "/v1/metrics":
            req = pb_metrics.ExportMetricsServiceRequest()
            req.ParseFromString(body)
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    _Receiver.metrics += [m.name for m in sm.metrics]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_spans_and_metrics_arrive_over_otlp_http(nats_server):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{server.server_port}",
                   OTEL_SERVICE_NAME="kvstream-otlp-test", OTEL_METRIC_EXPORT_INTERVAL="60000")
        out = subprocess.run([sys.executable, "-c", CHILD, nats_server.url], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
    finally:
        server.shutdown()
        server.server_close()
    names = [s.name for _, s in _Receiver.spans]
    assert names.count("kvstream.push") == 1 and names.count("kvstream.receive") == 1
    by_name = {s.name: s for _, s in _Receiver.spans}
    assert by_name["kvstream.push"].parent_span_id == by_name["engine.request"].span_id
    assert by_name["kvstream.receive"].parent_span_id == by_name["kvstream.push"].span_id
    # One frame (a short transfer): one layer span on each side.
    assert names.count("kvstream.layer.send") == 1 and names.count("kvstream.layer.receive") == 1
    assert {svc for svc, _ in _Receiver.spans} == {"kvstream-otlp-test"}
    assert len({s.trace_id for _, s in _Receiver.spans}) == 1  # one transfer, one trace
    assert {"kvstream.transfer.duration", "kvstream.transfer.bytes", "kvstream.transfer.ended",
            "kvstream.transfer.throughput", "kvstream.transfer.active",
            "kvstream.staging.usage"} <= set(_Receiver.metrics)
