"""What the benchmark runs and reports: kvstream against raw ucxx, modes, codecs, tracing.

The processes are ``bench.harness``'s. Every figure is measured in this run, between
the same two processes, on the same bytes; throughput is payload bytes over (decode's
last byte in place - prefill's start), both read from the host's monotonic clock.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvstream._exceptions import KVStreamError
from kvstream.bench.harness import MODES, Harness, KVRun
from kvstream.bench.synthetic import BenchSpec, pick_blocks

__all__ = ["MODES", "BenchResult", "CodecResult", "CodecSpeed", "Harness", "KVRun", "ModeResult",
           "codec_speed", "memcpy_gbps", "run_bench"]


class ModeResult(msgspec.Struct, kw_only=True):
    """One transfer mode in this run: best GB/s (no compute) and median exposed time."""

    gbps: float
    exposed_ms: float | None
    verified: bool
    wire_bytes: int  # per transfer, as the destination counted them
    runs_gbps: list[float]
    path: str = ""  # the data-plane path its transfers took


class CodecResult(msgspec.Struct, kw_only=True):
    """One wire codec in this run, same mode, same KV: how fast the whole KV arrived."""

    seconds: float  # best run: push to last byte in place (engine dtype)
    effective_gbps: float  # engine bytes of the whole KV over ``seconds``
    wire_gbps: float
    wire_bytes: int  # per transfer: codes plus scales
    speedup: float  # codec "none"'s best seconds over this codec's, this run
    exposed_ms: float | None  # with --layer-compute-ms: left after the last layer
    verified: bool  # bit-exact for "none", within the documented bound otherwise
    runs_s: list[float]


class CodecSpeed(msgspec.Struct, kw_only=True):
    """The CPU codec on one layer, one thread, against the naive torch path, this run.
    GB/s are engine-dtype bytes (fp16-equivalent for an fp16 cache) per second."""

    backend: str
    quantize_gbps: float
    dequantize_gbps: float
    naive_quantize_gbps: float
    naive_dequantize_gbps: float
    quantize_speedup: float
    dequantize_speedup: float


class BenchResult(msgspec.Struct, kw_only=True):
    verified: bool
    kvstream_gbps: float
    ucx_gbps: float
    ratio: float
    ucx_wire_gbps: float
    memcpy_gbps: float
    payload_bytes: int
    layout: str
    tokens: int
    blocks_per_layer: int
    scattered: bool
    repeat: int
    kvstream_runs_gbps: list[float]
    ucx_runs_gbps: list[float]
    layer_compute_ms: float | None = None
    exposed_ms_pipelined: float | None = None
    exposed_ms_eager: float | None = None
    # --sidecar: agents in sidecar processes, engines in two more processes.
    sidecar_gbps: float | None = None
    sidecar_ratio: float | None = None  # sidecar GB/s over in-process GB/s, same run
    sidecar_runs_gbps: list[float] = []
    # Engine -> agent cost per call: layer_ready (prefill), wait_layer on a landed layer.
    overhead_measured_in: str = ""
    layer_ready_us_p50: float | None = None
    layer_ready_us_p99: float | None = None
    wait_layer_us_p50: float | None = None
    wait_layer_us_p99: float | None = None
    final_stats: dict[str, dict[str, int]] = {}
    # --mode: one entry per mode measured (kvstream_gbps is the first mode's).
    modes: dict[str, ModeResult] = {}
    # --prefix-hit: the share of blocks already at the destination; wire_bytes per
    # transfer then covers the rest only, while verified covers the whole cache.
    prefix_hit: float = 0.0
    wire_bytes: int = 0
    effective_gbps: float | None = None  # whole-cache bytes over the transfer time
    # --codec: each wire codec (and "none" as the baseline), --transport: UCX_TLS used.
    codecs: dict[str, CodecResult] = {}
    codec_speed: dict[str, CodecSpeed] = {}  # per codec of --codec
    transport: str = ""
    path: str = ""  # the data-plane path(s) the first mode's transfers took
    accuracy: list[Any] = []  # --accuracy: quant.accuracy.AccuracyReport per data source
    # --tracing: the same transfers with an SDK exporting every span to a file, same run.
    tracing_gbps: float | None = None
    tracing_ratio: float | None = None  # traced GB/s over untraced GB/s (best of each)
    tracing_runs_gbps: list[float] = []
    traced_spans: int = 0  # spans both processes exported in the traced runs


def memcpy_gbps(spec: BenchSpec, repeat: int = 3) -> float:
    """One thread gathering one layer's scattered blocks: the copy speed limit here."""
    import torch

    from kvstream.bench.synthetic import make_cache
    from kvstream.memory import RegisteredKV

    one = BenchSpec(layout=msgspec.structs.replace(spec.layout, num_layers=1), tokens=spec.tokens,
                    cache_blocks=spec.num_cache_blocks, seed=spec.seed, scattered=spec.scattered)
    mem = RegisteredKV(one.layout, make_cache(one, fill=True))
    blocks = mem.block_map(pick_blocks(spec, salt=1))
    buf = torch.empty(mem.planes * mem.plane_bytes(len(blocks)), dtype=torch.uint8)
    view = mem.staging_view(buf, len(blocks))
    best = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the limit one copy thread has (as the agents' copies run)
    try:
        for _ in range(repeat + 1):
            t = time.perf_counter()
            mem.gather(0, blocks, view)
            best = max(best, buf.numel() / (time.perf_counter() - t) / 1e9)
    finally:
        torch.set_num_threads(threads)
    return best


def codec_speed(spec: BenchSpec, codec: str = "fp8_e4m3", repeat: int = 3) -> CodecSpeed:
    """Encode and decode one layer's scattered blocks on one thread: kvstream's CPU path
    against the naive torch path (``quant.reference``, what PERF.md measured)."""
    import torch

    from kvstream.bench.synthetic import make_cache
    from kvstream.memory import RegisteredKV
    from kvstream.quant.codec import LayerCodec

    one = BenchSpec(layout=msgspec.structs.replace(spec.layout, num_layers=1), tokens=spec.tokens,
                    cache_blocks=spec.num_cache_blocks, seed=spec.seed, scattered=spec.scattered,
                    data="kv")
    mem = RegisteredKV(one.layout, make_cache(one, fill=True))
    blocks = mem.block_map(pick_blocks(spec, salt=1))
    engine_bytes = len(blocks) * one.layout.block_bytes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    speed: dict[str, float] = {}
    try:
        backend = ""
        for kind in ("fast", "naive"):
            lc = LayerCodec(mem, codec, backend="torch" if kind == "naive" else None)
            backend = backend or lc.backend.name
            buf = torch.empty(lc.layer_bytes(len(blocks)), dtype=torch.uint8)
            for op, fn in (("quantize", lc.encode), ("dequantize", lc.decode)):
                best = min(_timed(fn, 0, blocks, buf) for _ in range(repeat + 1))
                speed[f"{kind}_{op}"] = engine_bytes / best / 1e9
    finally:
        torch.set_num_threads(threads)
    return CodecSpeed(
        backend=backend,
        quantize_gbps=round(speed["fast_quantize"], 3),
        dequantize_gbps=round(speed["fast_dequantize"], 3),
        naive_quantize_gbps=round(speed["naive_quantize"], 3),
        naive_dequantize_gbps=round(speed["naive_dequantize"], 3),
        quantize_speedup=round(speed["fast_quantize"] / speed["naive_quantize"], 2),
        dequantize_speedup=round(speed["fast_dequantize"] / speed["naive_dequantize"], 2))


def _timed(fn: Callable[..., None], *args: Any) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def _pct(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def run_bench(spec: BenchSpec, *, repeat: int = 3, layer_compute_ms: float | None = None,
              nats_url: str | None = None, raw: bool = True, sidecar: bool = False,
              modes: list[str] | None = None, codecs: list[str] | None = None,
              tracing: bool = False,
              progress: Callable[[str], None] | None = None) -> BenchResult:
    """``modes``: transfer modes to measure (default: push-pipelined for throughput, and
    push-pipelined against push-eager for exposed time). ``codecs``: wire codecs to
    compare in the first mode, against "none" in the same run, on KV-like data."""
    from kvstream.quant.scheme import check_codec

    say = progress or (lambda _msg: None)
    extra_codecs = [c for c in dict.fromkeys(codecs or []) if check_codec(c) != "none"]
    if codecs:
        spec = msgspec.structs.replace(spec, data="kv")
    for mode in modes or ():
        if mode not in MODES:
            raise KVStreamError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    rate_modes = list(modes or ["push-pipelined"])
    exposure_modes = list(modes or ["push-pipelined", "push-eager"])
    runs: dict[str, list[KVRun]] = {m: [] for m in rate_modes}
    exposure: dict[str, list[KVRun]] = {}
    sc_runs: list[KVRun] = []
    codec_runs: dict[str, list[KVRun]] = {c: [] for c in extra_codecs}
    traced_runs: list[KVRun] = []
    traced_spans = 0
    codec_exposure: dict[str, list[KVRun]] = {}
    raw_runs: list[float] = []
    wire = 0.0
    with contextlib.ExitStack() as stack:
        h = stack.enter_context(Harness(spec, nats_url=nats_url))
        hs = (stack.enter_context(Harness(spec, nats_url=h.nats_url, sidecar=True))
              if sidecar else None)
        trace_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstream-trace-")) \
            if tracing else ""
        ht = (stack.enter_context(Harness(msgspec.structs.replace(
            spec, trace_dir=trace_dir, namespace=f"{spec.namespace}-traced"),
            nats_url=h.nats_url)) if tracing else None)
        say("warm-up")
        for mode in rate_modes:
            h.run_kv(mode=mode, verify=False)
        for codec in extra_codecs:
            h.run_kv(mode=rate_modes[0], verify=False, codec=codec)
        if hs is not None:
            hs.run_kv(mode=rate_modes[0], verify=False)
        if ht is not None:
            ht.run_kv(mode=rate_modes[0], verify=False)
        if raw:
            h.run_raw()
        # Interleave the variants so machine noise hits all alike.
        for i in range(repeat):
            for mode in rate_modes:
                say(f"round {i + 1}/{repeat}: kvstream {mode}")
                runs[mode].append(h.run_kv(mode=mode))
            for codec in extra_codecs:
                say(f"round {i + 1}/{repeat}: kvstream {rate_modes[0]}, codec {codec}")
                codec_runs[codec].append(h.run_kv(mode=rate_modes[0], codec=codec))
            if ht is not None:
                say(f"round {i + 1}/{repeat}: kvstream {rate_modes[0]}, tracing on")
                traced_runs.append(ht.run_kv(mode=rate_modes[0]))
            if hs is not None:
                say(f"round {i + 1}/{repeat}: kvstream, agents in sidecars")
                sc_runs.append(hs.run_kv(mode=rate_modes[0]))
            if raw:
                say(f"round {i + 1}/{repeat}: raw ucxx")
                raw_runs.append(h.run_raw())
        if raw:
            say("raw ucxx, contiguous buffers (wire speed)")
            wire = max(h.run_raw(wire=True) for _ in range(repeat))
        if layer_compute_ms is not None:
            for mode in exposure_modes:
                say(f"exposed time, {mode}, {layer_compute_ms} ms compute per layer")
                exposure[mode] = [h.run_kv(mode=mode, compute_ms=layer_compute_ms)
                                  for _ in range(repeat)]
            for codec in extra_codecs:
                say(f"exposed time, {rate_modes[0]}, codec {codec}")
                codec_exposure[codec] = [
                    h.run_kv(mode=rate_modes[0], compute_ms=layer_compute_ms, codec=codec)
                    for _ in range(repeat)]
        stats = {**h.last_stats, **({f"sidecar_{k}": v for k, v in hs.last_stats.items()}
                                    if hs is not None else {})}
        if ht is not None:
            ht.close()  # its processes flush their spans on the way out
            for role in ("prefill", "decode"):
                path = os.path.join(trace_dir, f"{role}.jsonl")
                if os.path.exists(path):
                    with open(path) as f:
                        traced_spans += sum(1 for line in f if line.strip())
    every = [r for rs in (*runs.values(), *exposure.values(), sc_runs, *codec_runs.values(),
                          *codec_exposure.values(), traced_runs) for r in rs]
    best_traced = max((r.gbps for r in traced_runs), default=0.0)
    for codec, rs in (*codec_runs.items(), *codec_exposure.items()):
        if any(r.codec != codec for r in rs if r.status == "completed"):
            raise KVStreamError(f"asked for codec {codec}, the transfer negotiated "
                                f"{sorted({r.codec for r in rs})}: nothing to compare")
    exposed = {m: statistics.median(r.exposed_ms for r in rs) for m, rs in exposure.items()}
    first = runs[rate_modes[0]]
    best_kv = max(r.gbps for r in first)
    best_raw = max(raw_runs) if raw_runs else 0.0
    best_sc = max((r.gbps for r in sc_runs), default=0.0)
    overhead_runs = sc_runs or first
    ready_us = [x for r in overhead_runs for x in r.layer_ready_us]
    wait_us = [x for r in overhead_runs for x in r.wait_layer_us]
    best_run = max(first, key=lambda r: r.gbps)

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 2)

    return BenchResult(
        verified=all(r.verified and r.status == "completed" for r in every),
        kvstream_gbps=round(best_kv, 3),
        ucx_gbps=round(best_raw, 3),
        ratio=round(best_kv / best_raw, 3) if best_raw else 0.0,
        ucx_wire_gbps=round(wire, 3),
        memcpy_gbps=round(memcpy_gbps(spec), 3),
        payload_bytes=spec.payload_bytes,
        layout=spec.layout.describe(),
        tokens=spec.tokens,
        blocks_per_layer=spec.blocks,
        scattered=spec.scattered,
        repeat=repeat,
        kvstream_runs_gbps=[round(r.gbps, 3) for r in first],
        ucx_runs_gbps=[round(g, 3) for g in raw_runs],
        layer_compute_ms=layer_compute_ms,
        exposed_ms_pipelined=rounded(exposed.get("push-pipelined")),
        exposed_ms_eager=rounded(exposed.get("push-eager")),
        sidecar_gbps=round(best_sc, 3) if sidecar else None,
        sidecar_ratio=round(best_sc / best_kv, 3) if sidecar else None,
        sidecar_runs_gbps=[round(r.gbps, 3) for r in sc_runs],
        overhead_measured_in="sidecar" if sc_runs else "in-process",
        layer_ready_us_p50=_pct(ready_us, 0.5),
        layer_ready_us_p99=_pct(ready_us, 0.99),
        wait_layer_us_p50=_pct(wait_us, 0.5),
        wait_layer_us_p99=_pct(wait_us, 0.99),
        final_stats=stats,
        modes={m: ModeResult(
            gbps=round(max(r.gbps for r in runs[m]), 3), exposed_ms=rounded(exposed.get(m)),
            verified=all(r.verified and r.status == "completed"
                         for r in (*runs[m], *exposure.get(m, []))),
            wire_bytes=max(r.wire_bytes for r in runs[m]),
            runs_gbps=[round(r.gbps, 3) for r in runs[m]],
            path=",".join(sorted({r.path for r in runs[m]}))) for m in (modes or [])},
        prefix_hit=spec.prefix_hit,
        wire_bytes=best_run.wire_bytes,
        effective_gbps=round(spec.payload_bytes / best_run.seconds / 1e9, 3),
        codecs=_codec_results(spec, rate_modes[0], runs, exposure, codec_runs, codec_exposure)
        if codecs else {},
        codec_speed={c: codec_speed(spec, c) for c in extra_codecs},
        transport=spec.transport,
        path=",".join(sorted({r.path for r in first})),
        tracing_gbps=round(best_traced, 3) if tracing else None,
        tracing_ratio=round(best_traced / best_kv, 3) if tracing else None,
        tracing_runs_gbps=[round(r.gbps, 3) for r in traced_runs],
        traced_spans=traced_spans,
    )


def _codec_results(spec: BenchSpec, mode: str, runs: dict[str, list[KVRun]],
                   exposure: dict[str, list[KVRun]], codec_runs: dict[str, list[KVRun]],
                   codec_exposure: dict[str, list[KVRun]]) -> dict[str, CodecResult]:
    """Each codec against "none" (the same mode's verbatim runs of this run)."""
    out = {}
    base = min(r.seconds for r in runs[mode])
    for codec, rs in {"none": runs[mode], **codec_runs}.items():
        exp = exposure.get(mode, []) if codec == "none" else codec_exposure.get(codec, [])
        best = min(rs, key=lambda r: r.seconds)
        out[codec] = CodecResult(
            seconds=round(best.seconds, 4),
            effective_gbps=round(spec.payload_bytes / best.seconds / 1e9, 3),
            wire_gbps=round(best.wire_bytes / best.seconds / 1e9, 3),
            wire_bytes=best.wire_bytes, speedup=round(base / best.seconds, 3),
            exposed_ms=round(statistics.median(r.exposed_ms for r in exp), 2) if exp else None,
            verified=all(r.verified and r.status == "completed" for r in (*rs, *exp)),
            runs_s=[round(r.seconds, 4) for r in rs])
    return out
