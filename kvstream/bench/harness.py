"""The benchmark's processes: NATS plus a prefill and a decode process, driven over queues.

``Harness`` starts them, runs one transfer (``run_kv``) or one raw-ucxx baseline
(``run_raw``) at a time and reads back what each side measured; ``runner`` decides what to
run and what it means.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvstream._exceptions import KVStreamError
from kvstream.bench.synthetic import BenchSpec, pick_blocks
from kvstream.bench.workers import Cmd, Event, decode_main, prefill_main, sidecar_main
from kvstream.control.nats_server import EmbeddedNats

__all__ = ["MODES", "Harness", "KVRun"]

# Who starts the transfer and when (DESIGN.md's axes); incremental is --prefix-hit.
MODES = ("push-pipelined", "push-eager", "pull-eager", "pull-lazy")


class KVRun(msgspec.Struct, kw_only=True):
    mode: str
    seconds: float
    gbps: float
    exposed_ms: float
    verified: bool
    status: str
    reason: str = ""
    layer_ready_us: list[float] = []
    wait_layer_us: list[float] = []
    wire_bytes: int = 0
    codec: str = "none"
    path: str = ""


def _check_nats(url: str) -> None:
    import anyio

    from kvstream.control.bus import ControlBus

    async def connect() -> None:
        bus = await ControlBus.connect(url, name="kvstream-bench")
        await bus.close()

    anyio.run(connect)


class Harness:
    """NATS, a decode process and a prefill process; ``with Harness(spec) as h``."""

    def __init__(self, spec: BenchSpec, *, nats_url: str | None = None,
                 timeout_s: float = 180.0, sidecar: bool = False) -> None:
        self.sidecar = sidecar
        if sidecar:  # its own namespace, so an in-process harness can share the NATS server
            spec = msgspec.structs.replace(spec, namespace=f"{spec.namespace}-sidecar")
        self.spec = spec
        self.timeout_s = timeout_s
        self._nats_url = nats_url
        self._nats: EmbeddedNats | None = None
        self._procs: list[Any] = []
        self._sidecars: list[Any] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._run = 0
        ctx = mp.get_context("spawn")
        self._ctx = ctx
        self._dq_cmd, self._dq_evt = ctx.Queue(), ctx.Queue()
        self._pq_cmd, self._pq_evt = ctx.Queue(), ctx.Queue()
        self.decode_address = b""
        self.src_ids = pick_blocks(spec, salt=1)
        self.dst_ids = pick_blocks(spec, salt=2)
        self.last_stats: dict[str, dict[str, int]] = {}

    @property
    def nats_url(self) -> str:
        return self._nats_url or ""

    def _start_sidecars(self, blob: bytes) -> dict[str, str]:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstream-bench-")
        targets = {}
        for role in ("decode", "prefill"):
            sock = os.path.join(self._tmp.name, f"{role}.sock")
            proc = self._ctx.Process(target=sidecar_main, args=(blob, role, sock, self._nats_url),
                                     daemon=True)
            proc.start()
            self._sidecars.append(proc)
            targets[role] = f"unix:{sock}"
        deadline = time.monotonic() + self.timeout_s
        for target in targets.values():
            while not os.path.exists(target[5:]):
                if time.monotonic() > deadline or any(not p.is_alive() for p in self._sidecars):
                    raise KVStreamError("a benchmark sidecar did not come up")
                time.sleep(0.05)
        return targets

    def __enter__(self) -> Harness:
        try:
            if self._nats_url is None:
                self._nats = EmbeddedNats().start()
                self._nats_url = self._nats.url
            else:  # the cause in one line here, not a traceback from each child
                _check_nats(self._nats_url)
            blob = msgspec.msgpack.encode(self.spec)
            targets = (self._start_sidecars(blob) if self.sidecar
                       else {"decode": self._nats_url, "prefill": self._nats_url})
            for target, role, cq, eq in ((decode_main, "decode", self._dq_cmd, self._dq_evt),
                                         (prefill_main, "prefill", self._pq_cmd, self._pq_evt)):
                proc = self._ctx.Process(target=target, args=(blob, targets[role], cq, eq),
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
        for proc in self._sidecars:
            proc.terminate()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self._sidecars.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
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
                if any(not p.is_alive() for p in (*self._procs, *self._sidecars)):
                    raise KVStreamError("a benchmark process died") from None
                continue
            if evt.kind == "error":
                raise KVStreamError(f"benchmark process failed: {evt.reason}")
            if evt.kind == kind and (run is None or evt.run == run):
                return evt
            if on_event is not None:
                on_event(evt)

    def run_kv(self, *, mode: str = "push-pipelined", compute_ms: float = 0.0,
               verify: bool = True, on_event: Callable[[Event], None] | None = None,
               codec: str = "none", tamper: bool = False) -> KVRun:
        """One transfer in ``mode`` (one of MODES; "pipelined"/"eager" mean push).

        Push: timed from the push to the last byte in place; exposed time is what is left
        after the prefill's last layer. Pull: prefill computes and holds, then decode pulls
        (timed from the pull); exposed time is pull-eager's whole pull, and for pull-lazy
        the time the decode forward (``compute_ms`` per layer too) stalled on KV.
        GB/s count the bytes that crossed the wire (all of them unless --prefix-hit).
        """
        mode = {"pipelined": "push-pipelined", "eager": "push-eager"}.get(mode, mode)
        if mode not in MODES:
            raise KVStreamError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        who, when = mode.split("-")
        pull = when if who == "pull" else ""
        self._run += 1
        r = self._run
        rid = f"bench-{r}"
        decode = Cmd(op="kv", run=r, request_id=rid, blocks=self.dst_ids, peer="bench-prefill",
                     src_blocks=self.src_ids, verify=verify, report_layers=on_event is not None,
                     pull=pull, hit_blocks=self.spec.hit_blocks, compute_ms=compute_ms,
                     codec=codec, tamper=tamper)
        prefill = Cmd(op="kv", run=r, request_id=rid, peer="bench-decode", blocks=self.src_ids,
                      mode="pipelined" if pull else when, compute_ms=compute_ms, pull=pull,
                      codec=codec)
        if pull:
            self._pq_cmd.put(prefill)
            self._wait(self._pq_evt, "offered", run=r)
            self._dq_cmd.put(decode)
        else:
            self._dq_cmd.put(decode)
            self._wait(self._dq_evt, "ready", run=r)
            self._pq_cmd.put(prefill)
        d = self._wait(self._dq_evt, "done", run=r, on_event=on_event)
        p = self._wait(self._pq_evt, "done", run=r)
        self.last_stats = {"prefill": p.stats, "decode": d.stats}
        seconds = d.t - (d.t0 if pull else p.t0)
        # A pull starts once the prefill is done: all of it is exposed, except in lazy mode
        # where the decode forward overlaps it; a push is exposed after the last layer.
        exposed = {"lazy": d.waited_s, "eager": d.t - d.t0}.get(pull, d.t - p.t_last_ready)
        return KVRun(mode=mode, seconds=seconds, gbps=d.wire_bytes / seconds / 1e9,
                     exposed_ms=exposed * 1e3, verified=d.verified,
                     status=d.status if d.status != "completed" else p.status,
                     reason=d.reason or p.reason, layer_ready_us=p.overhead_us,
                     wait_layer_us=d.overhead_us, wire_bytes=d.wire_bytes, codec=d.codec,
                     path=d.path)

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
