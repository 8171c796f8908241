"""The UCX probe program: two local processes exchange tagged messages over ucxx, the
way two agents do, so that UCX's own log can say which transports carried them.

``kvstream.doctor.ucx_check`` runs it as ``python -m kvstream.doctor.ucx_probe PLAN_JSON``
with ``UCX_LOG_FILE``, ``UCX_PROTO_INFO=used`` and ``UCX_LOG_LEVEL=info`` set, in a
process group of its own and under a deadline. This process sends; a spawned child
receives. Both use ``kvstream.dataplane.ucx.UcxWorker``, the agent's UCX boundary:
endpoints from the exchanged worker address, error handling off, ``force_tag`` sends,
"thread" progress. Each message goes to a receive posted beforehand (the agent's credit
rule). The result is written to ``Plan.out`` as JSON (``ProbeResult``); nothing is
printed (UCX and ucxx may write to stdout; the caller captures it).

Both processes end with ``os._exit`` after shutting UCX down and flushing C stdio:
UCX writes its usage tables when the worker is destroyed, into a buffered FILE, and
an interpreter exit with UCX half torn down can hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import msgspec

__all__ = ["Plan", "ProbeResult", "main"]

TAG_BASE = 0xD0C7_0000 << 32


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    out: str  # where the result goes
    link_bytes: int = 0  # 0: no link check
    link_runs: int = 3  # timed sends after one warm-up
    device: str = ""  # "torch" or "cupy": also probe device memory with that library
    step_timeout: float = 5.0


class ProbeResult(msgspec.Struct, kw_only=True):
    ucxx: str = ""
    ucx: str = ""
    link_seconds: list[float] = []
    memcpy_seconds: list[float] = []
    device_error: str = ""
    error: str = ""
    seconds: float = 0.0


def _words(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _Buffers:
    """One reusable buffer per (memory, size), pages touched before any clock starts."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._bufs: dict[tuple[str, int], Any] = {}

    def setup_device(self) -> str:
        """Make the CUDA context, before UCX starts (UCX's CUDA transports look for one
        then). On failure: device memory is off for this process; returns why."""
        try:
            if self.device == "torch":
                import torch

                torch.cuda.set_device(0)
                torch.empty(1, device="cuda")
            elif self.device == "cupy":
                import cupy

                cupy.cuda.Device(0).use()
                cupy.empty(1)
        except Exception as exc:
            self.device = ""
            return f"CUDA set-up failed: {_words(exc)}"
        return ""

    def get(self, memory: str, nbytes: int, fill: int) -> Any:
        buf = self._bufs.get((memory, nbytes))
        if memory == "host":
            import numpy as np

            if buf is None:
                buf = self._bufs[memory, nbytes] = np.empty(nbytes, dtype=np.uint8)
            buf.fill(fill)
        elif self.device == "torch":
            import torch

            if buf is None:
                buf = self._bufs[memory, nbytes] = torch.empty(nbytes, dtype=torch.uint8,
                                                               device="cuda")
            buf.fill_(fill)
            torch.cuda.synchronize()
        elif self.device == "cupy":
            import cupy

            if buf is None:
                buf = self._bufs[memory, nbytes] = cupy.empty(nbytes, dtype=cupy.uint8)
            buf.fill(fill)
            cupy.cuda.Device().synchronize()
        else:
            raise RuntimeError("CUDA is not set up in this process")
        return buf

    def samples(self, buf: Any) -> list[int]:
        n = len(buf)
        idx = [0, n // 2, n - 1]
        if hasattr(buf, "get"):  # cupy
            return [int(v) for v in buf[idx].get()]
        if hasattr(buf, "cpu"):  # torch
            return [int(v) for v in buf[idx].cpu().tolist()]
        return [int(buf[i]) for i in idx]


def _get(conn: Any, timeout: float) -> tuple[Any, ...]:
    if not conn.poll(timeout):
        raise TimeoutError(f"the other probe process did not answer within {timeout:g}s")
    try:
        msg = conn.recv()
    except EOFError:
        raise RuntimeError("the other probe process exited") from None
    if msg[0] == "error":
        raise RuntimeError(f"receiver: {msg[1]}")
    return tuple(msg)


def _flush_c_stdio() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


# --- the receiving child -------------------------------------------------------------

async def _serve(conn: Any, plan: Plan, worker: Any, bufs: _Buffers) -> None:
    conn.send(("address", worker.address))
    while True:
        msg = _get(conn, plan.step_timeout * 3)
        if msg[0] == "bye":
            return
        _, memory, nbytes, tag, fill = msg
        buf = bufs.get(memory, nbytes, 0)
        posted = worker.post_recv(buf, tag)
        conn.send(("ready", tag))
        await asyncio.wait_for(posted.wait(), plan.step_timeout)
        got = bufs.samples(buf)
        conn.send(("ok", tag) if got == [fill] * 3 else ("bad", tag, got))


async def _receive(conn: Any, plan: Plan) -> None:
    from kvstream.dataplane.ucx import UcxWorker

    bufs = _Buffers(plan.device)
    bufs.setup_device()  # a failure shows on the sender's side, as a failed device send
    worker = await UcxWorker.open()
    try:
        await _serve(conn, plan, worker, bufs)
    except Exception as exc:
        conn.send(("error", _words(exc)))
    await _close(worker)


async def _close(worker: Any) -> None:
    # Every request and endpoint must be unreferenced first: ``_serve``/``_exchange``
    # have returned, and an exception the caller caught is gone with its traceback.
    gc.collect()
    await worker.close()


def _destroy_worker() -> None:
    """UCX prints its usage tables when the worker is destroyed. ucxx's event loop still
    references it until the loop is closed, so that happens here, after ``asyncio.run``,
    at the collection; then C stdio (UCX's log FILE) is flushed before ``os._exit``."""
    gc.collect()
    _flush_c_stdio()


def _receiver(conn: Any, plan_json: bytes) -> None:
    plan = msgspec.json.decode(plan_json, type=Plan)
    try:
        asyncio.run(_receive(conn, plan))
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", _words(exc)))
    _destroy_worker()
    os._exit(0)


# --- the sending parent --------------------------------------------------------------

class _Sender:
    def __init__(self, conn: Any, plan: Plan, worker: Any, peer: bytes, bufs: _Buffers) -> None:
        self.conn, self.plan, self.worker, self.peer, self.bufs = conn, plan, worker, peer, bufs
        self.sent = 0

    async def send(self, memory: str, nbytes: int) -> float:
        """One message to a posted receive; the seconds the send took."""
        tag = TAG_BASE + self.sent
        fill = self.sent % 250 + 1
        self.sent += 1
        buf = self.bufs.get(memory, nbytes, fill)
        self.conn.send(("recv", memory, nbytes, tag, fill))
        _get(self.conn, self.plan.step_timeout)
        t0 = time.perf_counter()
        await asyncio.wait_for(self.worker.send(self.peer, buf, tag), self.plan.step_timeout)
        seconds = time.perf_counter() - t0
        answer = _get(self.conn, self.plan.step_timeout)
        if answer[0] != "ok":
            raise RuntimeError(f"{nbytes} bytes of {memory} memory arrived wrong: {answer[2:]}")
        return seconds


def _memcpy_seconds(nbytes: int, runs: int) -> list[float]:
    import numpy as np

    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # fault the pages in
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t0)
    return out


async def _exchange(conn: Any, plan: Plan, worker: Any, bufs: _Buffers,
                    result: ProbeResult) -> None:
    _, peer = _get(conn, plan.step_timeout * 3)
    sender = _Sender(conn, plan, worker, peer, bufs)
    # A medium message (eager, through UCX's request path so it is counted) and a large
    # one (rendezvous): the two protocols a KV transfer uses.
    for nbytes in (4096, 1 << 20):
        await sender.send("host", nbytes)
    if plan.link_bytes:
        await sender.send("host", plan.link_bytes)  # warm-up: pages, endpoint lanes
        result.link_seconds = [await sender.send("host", plan.link_bytes)
                               for _ in range(plan.link_runs)]
        result.memcpy_seconds = _memcpy_seconds(plan.link_bytes, plan.link_runs)
    if bufs.device:
        try:
            for nbytes in (4096, 16 << 20):
                await sender.send("device", nbytes)
        except Exception as exc:  # the host results stand; say what device memory did
            result.device_error = _words(exc)


async def _send(conn: Any, plan: Plan, result: ProbeResult) -> None:
    from kvstream.dataplane.ucx import UcxWorker

    bufs = _Buffers(plan.device)
    result.device_error = bufs.setup_device()
    worker = await UcxWorker.open()
    try:
        await _exchange(conn, plan, worker, bufs, result)
    except Exception as exc:
        result.error = _words(exc)
    with contextlib.suppress(OSError):
        conn.send(("bye",))
    await _close(worker)


def main(argv: list[str] | None = None) -> None:
    t0 = time.perf_counter()
    plan = msgspec.json.decode((argv or sys.argv[1:])[0], type=Plan)
    result = ProbeResult()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(there, msgspec.json.encode(plan)), daemon=True)
    child.start()  # before importing ucxx here: both processes start up at once
    try:
        import ucxx

        result.ucxx = str(getattr(ucxx, "__version__", ""))
        result.ucx = ".".join(str(v) for v in ucxx.get_ucx_version())
        asyncio.run(_send(here, plan, result))
        _destroy_worker()
        child.join(plan.step_timeout)
    except BaseException as exc:
        result.error = result.error or _words(exc)
    finally:
        if child.is_alive():  # os._exit skips multiprocessing's reaping of daemons
            child.kill()
    result.seconds = time.perf_counter() - t0
    with open(plan.out, "wb") as f:
        f.write(msgspec.json.encode(result))
    _flush_c_stdio()
    os._exit(0)


if __name__ == "__main__":
    main()
