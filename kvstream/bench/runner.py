"""Benchmark harness: NATS plus a prefill and a decode process, kvstream against raw ucxx.

Every figure is measured in this run, between the same two processes, on the
same bytes; throughput is payload bytes over (decode's last byte in place -
prefill's start), both read from the host's monotonic clock.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvstream._exceptions import KVStreamError
from kvstream.bench.synthetic import BenchSpec, pick_blocks
from kvstream.bench.workers import Cmd, Event, decode_main, prefill_main
from kvstream.control.nats_server import EmbeddedNats

__all__ = ["BenchResult", "Harness", "KVRun", "memcpy_gbps", "run_bench"]


class KVRun(msgspec.Struct, kw_only=True):
    mode: str
    seconds: float
    gbps: float
    exposed_ms: float
    verified: bool
    status: str
    reason: str = ""


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
    final_stats: dict[str, dict[str, int]] = {}


class Harness:
    """NATS, a decode process and a prefill process; ``with Harness(spec) as h``."""

    def __init__(self, spec: BenchSpec, *, nats_url: str | None = None,
                 timeout_s: float = 180.0) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self._nats_url = nats_url
        self._nats: EmbeddedNats | None = None
        self._procs: list[Any] = []
        self._run = 0
        ctx = mp.get_context("spawn")
        self._ctx = ctx
        self._dq_cmd, self._dq_evt = ctx.Queue(), ctx.Queue()
        self._pq_cmd, self._pq_evt = ctx.Queue(), ctx.Queue()
        self.decode_address = b""
        self.src_ids = pick_blocks(spec, salt=1)
        self.dst_ids = pick_blocks(spec, salt=2)
        self.last_stats: dict[str, dict[str, int]] = {}

    def __enter__(self) -> Harness:
        try:
            if self._nats_url is None:
                self._nats = EmbeddedNats().start()
                self._nats_url = self._nats.url
            blob = msgspec.msgpack.encode(self.spec)
            for target, cq, eq in ((decode_main, self._dq_cmd, self._dq_evt),
                                   (prefill_main, self._pq_cmd, self._pq_evt)):
                proc = self._ctx.Process(target=target, args=(blob, self._nats_url, cq, eq),
                                         daemon=True)
                proc.start()
                self._procs.append(proc)
            self.decode_address = self._wait(self._dq_evt, "up").address
            self._wait(self._pq_evt, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for q in (self._dq_cmd, self._pq_cmd):
            with contextlib.suppress(Exception):
                q.put(Cmd(op="stop"))
        for proc in self._procs:
            proc.join(15)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self._procs.clear()
        if self._nats is not None:
            self._nats.stop()
            self._nats = None

    def _wait(self, q: Any, kind: str, *, run: int | None = None,
              on_event: Callable[[Event], None] | None = None) -> Event:
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVStreamError(f"benchmark process did not report {kind!r} in time")
            try:
                evt: Event = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(not p.is_alive() for p in self._procs):
                    raise KVStreamError("a benchmark process died") from None
                continue
            if evt.kind == "error":
                raise KVStreamError(f"benchmark process failed: {evt.reason}")
            if evt.kind == kind and (run is None or evt.run == run):
                return evt
            if on_event is not None:
                on_event(evt)

    def run_kv(self, *, mode: str = "pipelined", compute_ms: float = 0.0, verify: bool = True,
               on_event: Callable[[Event], None] | None = None) -> KVRun:
        self._run += 1
        r = self._run
        rid = f"bench-{r}"
        self._dq_cmd.put(Cmd(op="kv", run=r, request_id=rid, blocks=self.dst_ids,
                             src_blocks=self.src_ids, verify=verify,
                             report_layers=on_event is not None))
        self._wait(self._dq_evt, "ready", run=r)
        self._pq_cmd.put(Cmd(op="kv", run=r, request_id=rid, peer="bench-decode",
                             blocks=self.src_ids, mode=mode, compute_ms=compute_ms))
        d = self._wait(self._dq_evt, "done", run=r, on_event=on_event)
        p = self._wait(self._pq_evt, "done", run=r)
        self.last_stats = {"prefill": p.stats, "decode": d.stats}
        seconds = d.t - p.t0
        return KVRun(mode=mode, seconds=seconds, gbps=self.spec.payload_bytes / seconds / 1e9,
                     exposed_ms=(d.t - p.t_last_ready) * 1e3, verified=d.verified,
                     status=d.status if d.status != "completed" else p.status,
                     reason=d.reason or p.reason)

    def run_raw(self, *, wire: bool = False) -> float:
        self._run += 1
        r = self._run
        self._dq_cmd.put(Cmd(op="raw", run=r, blocks=self.dst_ids, wire=wire))
        self._wait(self._dq_evt, "ready", run=r)
        self._pq_cmd.put(Cmd(op="raw", run=r, blocks=self.src_ids, wire=wire,
                             peer_address=self.decode_address))
        d = self._wait(self._dq_evt, "done", run=r)
        p = self._wait(self._pq_evt, "done", run=r)
        return self.spec.payload_bytes / (d.t - p.t0) / 1e9


def memcpy_gbps(spec: BenchSpec, repeat: int = 3) -> float:
    """One thread gathering one layer's scattered blocks: the copy speed limit here."""
    import torch

    from kvstream.bench.synthetic import make_cache
    from kvstream.dataplane.memory import RegisteredKV

    one = BenchSpec(layout=msgspec.structs.replace(spec.layout, num_layers=1), tokens=spec.tokens,
                    cache_blocks=spec.num_cache_blocks, seed=spec.seed, scattered=spec.scattered)
    mem = RegisteredKV(one.layout, make_cache(one, fill=True))
    blocks = mem.block_map(pick_blocks(spec, salt=1))
    buf = torch.empty(mem.planes * mem.plane_bytes(len(blocks)), dtype=torch.uint8)
    view = mem.staging_view(buf, len(blocks))
    best = 0.0
    for _ in range(repeat + 1):
        t = time.perf_counter()
        mem.gather(0, blocks, view)
        best = max(best, buf.numel() / (time.perf_counter() - t) / 1e9)
    return best


def run_bench(spec: BenchSpec, *, repeat: int = 3, layer_compute_ms: float | None = None,
              nats_url: str | None = None, raw: bool = True,
              progress: Callable[[str], None] | None = None) -> BenchResult:
    say = progress or (lambda _msg: None)
    kv_runs: list[KVRun] = []
    raw_runs: list[float] = []
    wire = 0.0
    exposed: dict[str, float] = {}
    with Harness(spec, nats_url=nats_url) as h:
        say("warm-up")
        h.run_kv(verify=False)
        if raw:
            h.run_raw()
        # Interleave kvstream and raw runs so machine noise hits both alike.
        for i in range(repeat):
            say(f"round {i + 1}/{repeat}: kvstream")
            kv_runs.append(h.run_kv())
            if raw:
                say(f"round {i + 1}/{repeat}: raw ucxx")
                raw_runs.append(h.run_raw())
        if raw:
            say("raw ucxx, contiguous buffers (wire speed)")
            wire = max(h.run_raw(wire=True) for _ in range(repeat))
        if layer_compute_ms is not None:
            for mode in ("pipelined", "eager"):
                say(f"exposed time, {mode}, {layer_compute_ms} ms compute per layer")
                runs = [h.run_kv(mode=mode, compute_ms=layer_compute_ms) for _ in range(repeat)]
                kv_runs.extend(runs)
                exposed[mode] = statistics.median(r.exposed_ms for r in runs)
        stats = h.last_stats
    best_kv = max(r.gbps for r in kv_runs[:repeat])
    best_raw = max(raw_runs) if raw_runs else 0.0
    return BenchResult(
        verified=all(r.verified and r.status == "completed" for r in kv_runs),
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
        kvstream_runs_gbps=[round(r.gbps, 3) for r in kv_runs[:repeat]],
        ucx_runs_gbps=[round(g, 3) for g in raw_runs],
        layer_compute_ms=layer_compute_ms,
        exposed_ms_pipelined=round(exposed["pipelined"], 2) if exposed else None,
        exposed_ms_eager=round(exposed["eager"], 2) if exposed else None,
        final_stats=stats,
    )
