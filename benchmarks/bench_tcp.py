"""TcpTransport against a plain Python socket stream on the same link (issue 17: >= 0.9x).

Two processes, a receiver and a sender, in the two namespaces of a veth pair
(``kvstream.bench.netns``; root needed) or both on loopback (``--loopback``). In one run,
rounds interleave the kinds (the order flips every round, the first round is a warm-up
not counted):

* plain: one connection, ``sendall`` of a layer-sized buffer over and over; the receiver
  reads layer after layer (``recv_into``) into the ring of ``--window`` buffers the
  transport lands in too;
* tcp: ``TcpTransport``, the same bytes as ``--layers`` tagged messages, driven like the
  streams drive a transfer: the receiver posts ``--window`` layer receives and credits
  them (8-byte messages), the sender sends a layer once credited, ``--inflight`` at once;
* ucx (``--ucx``): the same as tcp through ``UcxWorker`` with ``UCX_TLS=tcp``.

Each kind is timed on the receiver, from its go message to the last byte in place.

    python benchmarks/bench_tcp.py                       # netns veth pair, unshaped
    python benchmarks/bench_tcp.py --rate-gbit 10 --json
    python benchmarks/bench_tcp.py --loopback --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, cast

import anyio
import numpy as np
from anyio.abc import SocketListener
from anyio.streams.buffered import BufferedByteReceiveStream

from kvstream.bench import netns
from kvstream.dataplane import wire
from kvstream.dataplane.tcp import TcpLimits, TcpTransport

XFER_BASE = 0x7C00_0000_0000


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loopback", action="store_true", help="both processes on 127.0.0.1")
    p.add_argument("--rate-gbit", type=float, default=None, help="shape the veth pair (tc tbf)")
    p.add_argument("--mtu", type=int, default=None, help="veth MTU (default 1500)")
    p.add_argument("--mib", type=int, default=512, help="MiB moved per kind and round")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--window", type=int, default=8, help="layer receives posted ahead")
    p.add_argument("--inflight", type=int, default=8, help="layer sends at once")
    p.add_argument("--pieces", type=int, default=1,
                   help="tcp: each layer sent from and received into this many buffers "
                        "(a vectored message, as scattered blocks travel)")
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--socket-buffer-kib", type=int, default=None,
                   help="SO_SNDBUF/SO_RCVBUF for TcpTransport (default: kernel autotuning)")
    p.add_argument("--rounds", type=int, default=5, help="counted rounds (plus one warm-up)")
    p.add_argument("--ucx", action="store_true", help="also UcxWorker with UCX_TLS=tcp")
    p.add_argument("--json", action="store_true")
    p.add_argument("--role", choices=["recv", "send"], help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    return p.parse_args(argv)


class Ctrl:
    """One JSON object per line over a TCP connection between the two roles."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)

    async def put(self, **msg: Any) -> None:
        await self.stream.send(json.dumps(msg).encode() + b"\n")

    async def get(self) -> dict[str, Any]:
        return dict(json.loads(await self.reader.receive_until(b"\n", 1 << 16)))


def _pattern(nbytes: int) -> np.ndarray:
    return (np.arange(nbytes, dtype=np.uint32) % 251).astype(np.uint8)


def _limits(a: argparse.Namespace) -> TcpLimits:
    kib = a.socket_buffer_kib
    return TcpLimits(socket_buffer_bytes=None if kib is None else kib << 10)


async def _open_ucx(enabled: bool) -> Any:
    if not enabled:
        return None
    from kvstream.dataplane.ucx import UcxWorker

    return await UcxWorker.open()


def _split(buf: np.ndarray, pieces: int, t: Any) -> Any:
    return np.array_split(buf, pieces) if pieces > 1 and t.vectored else buf


async def stream_recv(t: Any, peer: bytes, xfer: int, layers: int, bufs: list[np.ndarray],
                      pieces: int) -> None:
    window = len(bufs)
    slots = [_split(b, pieces, t) for b in bufs]
    credit_tag = wire.make_tag(xfer, 0, wire.KIND_CREDIT)
    recvs = {}
    for i in range(min(window, layers)):
        recvs[i] = t.post_recv(slots[i % window], wire.make_tag(xfer, i, wire.KIND_DATA))
    await t.send(peer, wire.encode_credit(len(recvs)), credit_tag)
    for i in range(layers):
        await recvs.pop(i).wait()
        if i + window < layers:
            recvs[i + window] = t.post_recv(slots[i % window],
                                            wire.make_tag(xfer, i + window, wire.KIND_DATA))
            await t.send(peer, wire.encode_credit(i + window + 1), credit_tag)


async def stream_send(t: Any, peer: bytes, xfer: int, layers: int, src: np.ndarray,
                      inflight: int, pieces: int) -> None:
    message = _split(src, pieces, t)
    granted, changed = 0, anyio.Event()
    credit = np.zeros(8, dtype=np.uint8)
    credit_tag = wire.make_tag(xfer, 0, wire.KIND_CREDIT)
    limiter = anyio.Semaphore(inflight)

    async def credits() -> None:
        nonlocal granted, changed
        while granted < layers:
            await t.post_recv(credit, credit_tag).wait()
            granted = max(granted, wire.decode_credit(credit.data))
            changed.set()
            changed = anyio.Event()

    async def one(layer: int) -> None:
        try:
            await t.send(peer, message, wire.make_tag(xfer, layer, wire.KIND_DATA))
        finally:
            limiter.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(credits)
        for layer in range(layers):
            while granted <= layer:
                await changed.wait()
            await limiter.acquire()
            tg.start_soon(one, layer)


def _plain_recv(conn: socket.socket, bufs: list[np.ndarray], layers: int) -> None:
    """Layer after layer into the same ring of buffers the transport lands in (one
    buffer reused would stay in cache and flatter the baseline)."""
    for i in range(layers):
        view, got = bufs[i % len(bufs)].data.cast("B"), 0
        while got < len(view):
            n = conn.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
            if n == 0:
                raise RuntimeError("plain stream ended early")
            got += n


def _plain_send(conn: socket.socket, src: np.ndarray, total: int) -> None:
    view = src.data.cast("B")
    for _ in range(total // len(view)):
        conn.sendall(view)


async def receiver(a: argparse.Namespace) -> None:
    layer_bytes = (a.mib << 20) // a.layers
    total = layer_bytes * a.layers
    ctrl_l = await anyio.create_tcp_listener(local_host=a.host, local_port=0)
    plain_l = socket.create_server((a.host, 0))
    tcp = await TcpTransport.open(a.host, lanes=a.lanes, limits=_limits(a))
    ucx = await _open_ucx(a.ucx)
    print(f"CTRL {ctrl_l.extra(anyio.abc.SocketAttribute.local_port)}", flush=True)
    ctrl = Ctrl(await cast(SocketListener, ctrl_l.listeners[0]).accept())
    await ctrl.put(plain=plain_l.getsockname()[1], tcp=tcp.address.decode(),
                   tcp_token=tcp.token_for("send").hex(), ucx=ucx.address.hex() if ucx else None)
    hello = await ctrl.get()
    tcp.set_credentials(hello["tcp"].encode(), "recv", bytes.fromhex(hello["tcp_token"]))
    peers = {"tcp": (tcp, hello["tcp"].encode())}
    if ucx:
        peers["ucx"] = (ucx, bytes.fromhex(hello["ucx"]))
    plain, _ = await anyio.to_thread.run_sync(plain_l.accept)
    plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bufs = [np.ones(layer_bytes, dtype=np.uint8) for _ in range(a.window)]  # pages faulted in
    want = _pattern(layer_bytes)
    kinds = ["plain", *peers]
    results: list[dict[str, Any]] = []
    for rnd in range(a.rounds + 1):
        for kind in kinds if rnd % 2 else kinds[::-1]:
            for b in bufs:
                b[:1] = 0
            xfer = XFER_BASE + rnd * 16 + len(results)
            t0, cpu0 = time.perf_counter(), time.process_time()
            await ctrl.put(kind=kind, xfer=xfer)
            if kind == "plain":
                await anyio.to_thread.run_sync(_plain_recv, plain, bufs, a.layers)
            else:
                t, peer = peers[kind]
                await stream_recv(t, peer, xfer, a.layers, bufs, a.pieces)
            dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            sender_cpu = (await ctrl.get())["cpu"]
            ok = bool(np.array_equal(bufs[0], want))
            if rnd:  # CPU seconds (all threads) per GB moved, each side
                results.append({"round": rnd, "kind": kind, "gbps": total / dt / 1e9, "ok": ok,
                                "recv_cpu_s_per_gb": cpu / (total / 1e9),
                                "send_cpu_s_per_gb": sender_cpu / (total / 1e9)})
    await ctrl.put(kind="quit")
    stats = tcp.statistics()
    plain.close()
    plain_l.close()
    await tcp.close()
    if ucx:
        await ucx.close()
    await ctrl_l.aclose()
    print("RESULT " + json.dumps({"results": results, "layer_bytes": layer_bytes,
                                  "total_bytes": total, "tcp_stats": vars(stats)}), flush=True)


async def sender(a: argparse.Namespace) -> None:
    layer_bytes = (a.mib << 20) // a.layers
    host, port = a.peer.rsplit(":", 1)
    ctrl = Ctrl(await anyio.connect_tcp(host, int(port)))
    hello = await ctrl.get()
    tcp = await TcpTransport.open(a.host, lanes=a.lanes, limits=_limits(a))
    ucx = await _open_ucx(a.ucx)
    await ctrl.put(tcp=tcp.address.decode(), tcp_token=tcp.token_for("recv").hex(),
                   ucx=ucx.address.hex() if ucx else None)
    tcp.set_credentials(hello["tcp"].encode(), "send", bytes.fromhex(hello["tcp_token"]))
    peers = {"tcp": (tcp, hello["tcp"].encode())}
    if ucx:
        peers["ucx"] = (ucx, bytes.fromhex(hello["ucx"]))
    plain = socket.create_connection((host, hello["plain"]))
    plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src = _pattern(layer_bytes)
    while (cmd := await ctrl.get())["kind"] != "quit":
        cpu0 = time.process_time()
        if cmd["kind"] == "plain":
            await anyio.to_thread.run_sync(_plain_send, plain, src, layer_bytes * a.layers)
        else:
            t, peer = peers[cmd["kind"]]
            await stream_send(t, peer, cmd["xfer"], a.layers, src, a.inflight, a.pieces)
        await ctrl.put(cpu=time.process_time() - cpu0)
    plain.close()
    await tcp.close()
    if ucx:
        await ucx.close()


def _role_argv(a: argparse.Namespace, role: str, host: str, peer: str | None) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--role", role, "--host", host,
            "--mib", str(a.mib), "--layers", str(a.layers), "--window", str(a.window),
            "--inflight", str(a.inflight), "--lanes", str(a.lanes), "--rounds", str(a.rounds),
            "--pieces", str(a.pieces)]
    if a.ucx:
        argv.append("--ucx")
    if a.socket_buffer_kib is not None:
        argv += ["--socket-buffer-kib", str(a.socket_buffer_kib)]
    if peer:
        argv += ["--peer", peer]
    return argv


def _run_pair(a: argparse.Namespace, recv_host: str, send_host: str, recv_prefix: list[str],
              send_prefix: list[str]) -> dict[str, Any]:
    """Both roles; if one fails, the other is killed rather than left waiting on it."""
    env = dict(os.environ, UCX_TLS="tcp") if a.ucx else None
    recv = subprocess.Popen([*recv_prefix, *_role_argv(a, "recv", recv_host, None)],
                            stdout=subprocess.PIPE, text=True, env=env)
    procs: list[subprocess.Popen[str]] = [recv]
    try:
        assert recv.stdout is not None
        line = recv.stdout.readline()
        if not line.startswith("CTRL "):
            raise SystemExit(f"receiver did not start: {line!r}")
        peer = f"{recv_host}:{line.split()[1]}"
        procs.append(subprocess.Popen([*send_prefix, *_role_argv(a, "send", send_host, peer)],
                                      env=env, text=True))
        deadline = time.monotonic() + 1800
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode for p in procs):
                break
            time.sleep(0.1)
        out = recv.stdout.read() if recv.returncode == 0 else ""
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"roles exited {[p.returncode for p in procs]} (receiver, sender)")
    result = next(json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT "))
    return dict(result)


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        kinds.setdefault(r["kind"], []).append(r)
    out: dict[str, Any] = {}
    for k, rs in kinds.items():
        gbps = [r["gbps"] for r in rs]
        out[k] = {"median_gbps": statistics.median(gbps), "best_gbps": max(gbps),
                  "worst_gbps": min(gbps),
                  "recv_cpu_s_per_gb": statistics.median(r["recv_cpu_s_per_gb"] for r in rs),
                  "send_cpu_s_per_gb": statistics.median(r["send_cpu_s_per_gb"] for r in rs)}
    rounds = sorted({r["round"] for r in results})
    by = {(r["round"], r["kind"]): r["gbps"] for r in results}
    for kind in kinds:
        if kind != "plain":
            ratios = [by[(n, kind)] / by[(n, "plain")] for n in rounds]
            out[f"{kind}_over_plain"] = {"median": statistics.median(ratios),
                                         "per_round": ratios}
    out["all_bytes_ok"] = all(r["ok"] for r in results)
    return out


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    if a.role:
        try:
            anyio.run(receiver if a.role == "recv" else sender, a)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # not a normal exit: a UCX progress thread can keep it from ending
        return
    mode: dict[str, Any] = {"link": "loopback"}
    if a.loopback:
        result = _run_pair(a, "127.0.0.1", "127.0.0.1", [], [])
    else:
        if not netns.available():
            raise SystemExit("network namespaces are not available here (root and `ip netns` "
                             "needed): use --loopback")
        with netns.netns_pair(a.rate_gbit, mtu=a.mtu) as pair:
            mode = {"link": "veth", "rate_gbit": a.rate_gbit, "mtu": a.mtu or 1500}
            result = _run_pair(a, pair.b.address, pair.a.address,
                               netns.exec_prefix(pair.b.name), netns.exec_prefix(pair.a.name))
    summary = _summary(result["results"])
    report = {**mode, "mib": a.mib, "layers": a.layers, "window": a.window,
              "inflight": a.inflight, "lanes": a.lanes, "socket_buffer_kib": a.socket_buffer_kib,
              "pieces": a.pieces,
              **result, "summary": summary}
    if a.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{mode['link']}{f' {a.rate_gbit} Gbit/s' if a.rate_gbit else ''}: {a.mib} MiB per "
          f"kind and round, {a.layers} layers, lanes {a.lanes}, window {a.window}, "
          f"inflight {a.inflight}, pieces {a.pieces}, {a.rounds} rounds")
    for kind, s in summary.items():
        if isinstance(s, dict) and "median_gbps" in s:
            print(f"  {kind:6s} median {s['median_gbps']:.2f} GB/s  best {s['best_gbps']:.2f}  "
                  f"worst {s['worst_gbps']:.2f}  CPU s/GB recv {s['recv_cpu_s_per_gb']:.3f} "
                  f"send {s['send_cpu_s_per_gb']:.3f}")
    for key, s in summary.items():
        if key.endswith("_over_plain"):
            print(f"  {key}: median {s['median']:.2f}  per round "
                  + " ".join(f"{x:.2f}" for x in s["per_round"]))
    print(f"  bytes verified: {summary['all_bytes_ok']}")


if __name__ == "__main__":
    main()
