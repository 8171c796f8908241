"""Human output for ``kvstream bench`` and the ``kvstream demo`` run (rich)."""

from __future__ import annotations

import os
import tempfile

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstream.bench.runner import BenchResult, Harness
from kvstream.bench.synthetic import BenchSpec
from kvstream.bench.workers import Event

__all__ = ["DemoResult", "print_bench", "run_demo"]


def print_bench(r: BenchResult, console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title=f"kvstream bench: {r.tokens} tokens, {r.payload_bytes / 2**20:.0f} MiB, "
                    f"{r.blocks_per_layer} {'scattered' if r.scattered else 'contiguous'} "
                    f"blocks/layer", show_header=True)
    t.add_column("what")
    t.add_column("GB/s", justify="right")
    t.add_column("note")
    t.add_row("kvstream", f"{r.kvstream_gbps:.2f}",
              f"best of {r.kvstream_runs_gbps}, verified={r.verified}")
    t.add_row("raw ucxx, coalesced per layer", f"{r.ucx_gbps:.2f}", f"best of {r.ucx_runs_gbps}")
    t.add_row("ratio kvstream / raw", f"{r.ratio:.3f}", "")
    t.add_row("raw ucxx, contiguous (wire)", f"{r.ucx_wire_gbps:.2f}", "no gather/scatter")
    t.add_row("memcpy gather, 1 thread", f"{r.memcpy_gbps:.2f}", "one layer, this process")
    if r.sidecar_gbps is not None:
        t.add_row("kvstream, agents in sidecars", f"{r.sidecar_gbps:.2f}",
                  f"{r.sidecar_ratio:.3f} of in-process, best of {r.sidecar_runs_gbps}")
    if r.layer_ready_us_p50 is not None:
        t.add_row(f"layer_ready, us per call ({r.overhead_measured_in})",
                  f"{r.layer_ready_us_p50:.1f}", f"p99 {r.layer_ready_us_p99:.1f} us")
        t.add_row(f"wait_layer (landed), us per call ({r.overhead_measured_in})",
                  f"{r.wait_layer_us_p50:.1f}", f"p99 {r.wait_layer_us_p99:.1f} us")
    if r.exposed_ms_pipelined is not None:
        t.add_row(f"exposed ms, pipelined ({r.layer_compute_ms} ms/layer)",
                  f"{r.exposed_ms_pipelined:.2f}", "after the last layer's compute")
        t.add_row("exposed ms, eager", f"{r.exposed_ms_eager:.2f}", "")
    if r.tracing_gbps is not None:
        t.add_row("kvstream, tracing on (spans to a file)", f"{r.tracing_gbps:.2f}",
                  f"{r.tracing_ratio:.3f} of tracing off, {r.traced_spans} spans, "
                  f"best of {r.tracing_runs_gbps}")
    if r.prefix_hit:
        t.add_row(f"prefix hit {r.prefix_hit:.0%}: wire MiB per transfer",
                  f"{r.wire_bytes / 2**20:.0f}", f"of {r.payload_bytes / 2**20:.0f} MiB; "
                  f"whole cache at {r.effective_gbps:.2f} GB/s effective")
    console.print(t)
    if r.modes:
        mt = Table(title="transfer modes", show_header=True)
        for col in ("mode", "GB/s", f"exposed ms ({r.layer_compute_ms} ms/layer)", "verified"):
            mt.add_column(col)
        for name, mr in r.modes.items():
            mt.add_row(name, f"{mr.gbps:.2f}",
                       "-" if mr.exposed_ms is None else f"{mr.exposed_ms:.2f}", str(mr.verified))
        console.print(mt)
    if r.codecs:
        ct = Table(title=f"wire codecs ({r.transport or 'default'} transport)", show_header=True)
        for col in ("codec", "whole KV GB/s", "wire GB/s", "wire MiB", "speedup",
                    f"exposed ms ({r.layer_compute_ms} ms/layer)", "verified"):
            ct.add_column(col)
        for name, cr in r.codecs.items():
            ct.add_row(name, f"{cr.effective_gbps:.2f}", f"{cr.wire_gbps:.2f}",
                       f"{cr.wire_bytes / 2**20:.1f}", f"{cr.speedup:.2f}x",
                       "-" if cr.exposed_ms is None else f"{cr.exposed_ms:.2f}", str(cr.verified))
        console.print(ct)
    if r.codec_speed:
        st = Table(title="codec speed, one layer, one thread (engine-dtype bytes)",
                   show_header=True)
        for col in ("codec", "kernel", "", "kvstream GB/s", "naive torch GB/s", "speedup"):
            st.add_column(col)
        for name, s in r.codec_speed.items():
            st.add_row(name, s.backend, "quantize", f"{s.quantize_gbps:.2f}",
                       f"{s.naive_quantize_gbps:.2f}", f"{s.quantize_speedup:.1f}x")
            st.add_row("", "", "dequantize", f"{s.dequantize_gbps:.2f}",
                       f"{s.naive_dequantize_gbps:.2f}", f"{s.dequantize_speedup:.1f}x")
        console.print(st)
    console.print(r.layout)


class DemoResult(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool  # every transfer completed and verified byte for byte
    verdict: str  # the closing line


def run_demo(spec: BenchSpec, *, model: str, layer_compute_ms: float, link: str,
             nats_url: str | None, full_waterfall: bool = False,
             fault: str = "", console: Console | None = None) -> DemoResult:
    """The demo: one pipelined transfer with a live per-layer bar, then the same bytes
    eager and without compute, raw ucxx and a memcpy in the same run for the limits, a
    waterfall of the pipelined transfer, a table, and one closing verdict line.
    ``fault="corrupt"`` flips a byte on the decode side after every transfer (what a test
    uses to see the demo fail)."""
    from kvstream.bench.runner import memcpy_gbps
    from kvstream.tools.planner import estimate_decode_step_s, estimate_prefill_s, plan_transfer
    from kvstream.tools.presets import get_gpu, get_link, get_model

    console = console or Console()
    layers = spec.layout.num_layers
    tamper = fault == "corrupt"
    console.print(f"[bold]kvstream demo[/]: {model}, {spec.tokens} tokens, "
                  f"{spec.payload_bytes / 2**20:.0f} MiB of KV ({spec.layout.describe()})")
    console.print("starting NATS, a prefill process and a decode process ...")
    tmp = tempfile.TemporaryDirectory(prefix="kvstream-demo-")
    if _sdk_available():
        spec = msgspec.structs.replace(spec, trace_dir=tmp.name)
    with tmp, Harness(spec, nats_url=nats_url) as h:
        h.run_kv(verify=False)  # warm-up: endpoints, staging buffers, page faults
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task(f"pipelined, {layer_compute_ms} ms compute/layer: layers landed",
                                     total=layers)

            def on_event(evt: Event) -> None:
                if evt.kind == "layer":
                    progress.update(task, completed=evt.layer + 1)

            piped = h.run_kv(mode="pipelined", compute_ms=layer_compute_ms, on_event=on_event,
                             tamper=tamper)
        piped_rid = f"bench-{h._run}"
        console.print("the same bytes eager, then without compute, then raw ucxx ...")
        eager = h.run_kv(mode="eager", compute_ms=layer_compute_ms, tamper=tamper)
        fast = [h.run_kv(tamper=tamper) for _ in range(2)]
        raw = max(h.run_raw() for _ in range(2))
        h.close()  # the processes flush their spans on the way out
        picture = _waterfall(spec.trace_dir, piped_rid, fold=None if full_waterfall else 8)
    memcpy = memcpy_gbps(spec)
    runs = (piped, eager, *fast)
    best = max(fast, key=lambda r: r.gbps)
    ok = all(r.verified and r.status == "completed" for r in runs)

    mspec, ln, gpu = get_model(model), get_link(link), get_gpu("h100")
    plan = plan_transfer(
        model_name=model, layout=spec.layout, prompt_tokens=spec.tokens, codec="fp16",
        link_name=ln.name, bandwidth_gbytes_per_s=ln.gbytes_per_s, rtt_us=ln.rtt_us,
        prefill_s=estimate_prefill_s(mspec, spec.tokens, gpu), prefill_source="h100 estimate",
        first_decode_s=estimate_decode_step_s(mspec, gpu))

    print(picture)  # not through rich: a waterfall must not wrap
    t = Table(title="summary", caption="exposed: from the prefill engine's last layer_ready "
              "to the decode side's last byte in place")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("bytes moved per transfer", f"{spec.payload_bytes:,}")
    t.add_row("verified byte for byte (4 transfers)",
              "yes" if ok else f"NO ({sum(not r.verified for r in runs)} of 4 differ)")
    t.add_row("time (no compute, best of 2)", f"{best.seconds * 1e3:.1f} ms")
    t.add_row("kvstream throughput", f"{best.gbps:.2f} GB/s")
    t.add_row("raw ucxx, same processes and bytes", f"{raw:.2f} GB/s")
    t.add_row("memcpy gather, 1 thread, this process", f"{memcpy:.2f} GB/s")
    t.add_row(f"exposed, pipelined ({layer_compute_ms} ms/layer)", f"{piped.exposed_ms:.1f} ms")
    t.add_row(f"exposed, eager ({layer_compute_ms} ms/layer)", f"{eager.exposed_ms:.1f} ms")
    t.add_row(f"planner on {ln.name} ({ln.gbytes_per_s:g} GB/s)", f"{plan.transfer_ms:.2f} ms")
    t.add_row("  share of TTFT (H100 prefill estimate)",
              f"{plan.share_of_ttft:.1%} ({plan.verdict})")
    console.print(t)
    what = (f"{spec.payload_bytes / 2**20:.0f} MiB of KV ({layers} layers x {spec.blocks} "
            f"{'scattered ' if spec.scattered else ''}blocks) prefill -> decode")
    if ok:
        verdict = (f"PASS: moved {what}, verified byte for byte; {best.gbps:.2f} GB/s = "
                   f"{best.gbps / raw:.2f}x raw ucxx ({raw:.2f}) and {best.gbps / memcpy:.2f}x "
                   f"memcpy ({memcpy:.2f}), measured here in this run; exposed "
                   f"{piped.exposed_ms:.1f} ms pipelined, {eager.exposed_ms:.1f} ms eager")
    else:
        bad = next(r for r in runs if not (r.verified and r.status == "completed"))
        why = ("the decode side's bytes differ from the prefill's" if bad.status == "completed"
               else f"a transfer ended {bad.status}: {bad.reason}")
        verdict = f"FAIL: moved {what}, but {why}"
    print(verdict)
    return DemoResult(ok=ok, verdict=verdict)


def _sdk_available() -> bool:
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def _waterfall(trace_dir: str, request_id: str, fold: int | None = None) -> str:
    """The pipelined run's trace from both processes' span files, as text."""
    from kvstream.tools.tracefile import load_spans, traces, waterfall

    if not trace_dir:
        return ("(install the otel extra, pip install 'kvstream[otel]', to see the transfer's "
                "per-layer waterfall here)")
    spans = [s for role in ("prefill", "decode")
             if os.path.exists(p := os.path.join(trace_dir, f"{role}.jsonl"))
             for s in load_spans(p)]
    for ss in traces(spans).values():
        if any(s["attributes"].get("kvstream.request_id") == request_id for s in ss):
            head = ("the pipelined transfer, both processes"
                    + (f", layers in {fold} groups (--waterfall: every layer)" if fold else "")
                    + ":\n")
            return head + waterfall(ss, fold=fold)
    return "(no trace of the pipelined transfer was exported)"
