"""kvstream between "two hosts" (two network namespaces joined by a veth pair) against a
plain socket stream on the same link, in one run (issue 17's TCP bars).

    python benchmarks/bench_netns.py [--rounds 3] [--rate-gbit 10] [--codec int8 ...]
                                     [--layers 32] [--tokens 4096] [--json]

The benchmark process enters namespace A (NATS, the prefill process); the decode process
runs in namespace B. kvstream pushes the default bench cache (512 MiB, scattered blocks)
over its TCP path (the agents have different host ids, so no same-host path), verified
byte for byte; the plain stream sends the same number of bytes A -> B with ``sendall``
into ``recv_into`` (16 MiB buffers, one connection). Rounds interleave the two. With
``--codec``, the same run also pushes with that wire codec (KV-like data) and reports
its speedup over verbatim (the end-to-end time, engine dtype in place on both ends).
Needs root and ``ip netns``; ``tc tbf`` for ``--rate-gbit``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20


def _plain_recv(ns: str, port_q: Any, result_q: Any, nbytes: int) -> None:
    from kvstream.bench.netns import enter

    enter(ns)
    import numpy as np

    bufs = [np.empty(16 * MiB, dtype=np.uint8) for _ in range(4)]
    with socket.create_server(("0.0.0.0", 0)) as srv:
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            got, i, t0 = 0, 0, None
            while got < nbytes:
                view = memoryview(bufs[i % 4])[:min(16 * MiB, nbytes - got)]
                n = conn.recv_into(view, len(view), socket.MSG_WAITALL)
                if n == 0:
                    break
                if t0 is None:
                    t0 = time.perf_counter()
                got += n
                i += 1
            result_q.put((got, time.perf_counter() - (t0 or time.perf_counter())))


def plain_stream(b_ns: str, b_addr: str, nbytes: int) -> float:
    """GB/s of one socket stream A -> B (receiver in B; timed from the first byte)."""
    import numpy as np

    ctx = mp.get_context("spawn")
    port_q, result_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_plain_recv, args=(b_ns, port_q, result_q, nbytes))
    proc.start()
    try:
        port = port_q.get(timeout=30)
        src = np.arange(16 * MiB, dtype=np.uint8)
        with socket.create_connection((b_addr, port), timeout=30) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sent = 0
            while sent < nbytes:
                chunk = memoryview(src)[:min(16 * MiB, nbytes - sent)]
                s.sendall(chunk)
                sent += len(chunk)
            got, seconds = result_q.get(timeout=120)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if got != nbytes:
        raise SystemExit(f"plain stream moved {got} of {nbytes} bytes")
    return nbytes / seconds / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate-gbit", type=float, default=None)
    ap.add_argument("--codec", action="append", default=[], choices=["int8", "fp8_e4m3"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    from kvstream.bench import netns
    from kvstream.bench.runner import run_bench
    from kvstream.bench.synthetic import BenchSpec
    from kvstream.control.nats_server import find_nats_server, is_listening
    from kvstream.layout import KVLayout

    if not netns.available():
        raise SystemExit("ip netns is not permitted here (needs root)")
    say = (lambda msg: None) if a.json else (lambda msg: print(f"... {msg}", file=sys.stderr))
    layout = KVLayout(num_layers=a.layers, num_kv_heads=8, head_dim=128, block_size=16)
    with netns.netns_pair(a.rate_gbit) as pair:
        netns.enter(pair.a.name)  # this process and the prefill it starts: host A
        url = f"nats://{pair.a.address}:4222"
        nats = subprocess.Popen([find_nats_server(), "-a", pair.a.address, "-p", "4222"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while not is_listening(url) and time.monotonic() < deadline:
                time.sleep(0.05)
            spec = BenchSpec(layout=layout, tokens=a.tokens, path="tcp", host_ids=True,
                             decode_netns=pair.b.name, transport="tcp")
            plain, kv, codecs = [], [], []
            for i in range(a.rounds):
                say(f"round {i + 1}/{a.rounds}: plain socket")
                plain.append(plain_stream(pair.b.name, pair.b.address, spec.payload_bytes))
                say(f"round {i + 1}/{a.rounds}: kvstream push over tcp")
                r = run_bench(spec, repeat=1, nats_url=url, raw=False,
                              codecs=["none", *a.codec] if a.codec else None)
                if r.path != "tcp" or not r.verified:
                    raise SystemExit(f"kvstream took {r.path!r}, verified={r.verified}")
                kv.append(r.kvstream_gbps)
                if a.codec:
                    codecs.append({c: msgspec_builtins(v) for c, v in r.codecs.items()})
        finally:
            nats.kill()
            nats.wait()
    out: dict[str, Any] = {
        "link": f"veth, tbf {a.rate_gbit} Gbit/s" if a.rate_gbit else "veth, unshaped",
        "payload_bytes": spec.payload_bytes, "plain_gbps": plain, "kvstream_gbps": kv,
        "ratio_of_medians": round(statistics.median(kv) / statistics.median(plain), 3),
        "ratios_per_round": [round(k / p, 3) for k, p in zip(kv, plain, strict=True)],
    }
    if a.rate_gbit:
        # A codec can only win what the wire costs: where a plain stream cannot fill the
        # shaped link (the veth is CPU-bound on a small machine), the CPU is the bottleneck.
        out["plain_of_link"] = round(statistics.median(plain) / (a.rate_gbit / 8), 3)
    if codecs:
        out["codec_speedup"] = {c: [r[c]["speedup"] for r in codecs] for c in codecs[0]}
        out["codec_verified"] = all(v["verified"] for r in codecs for v in r.values())
    if a.json:
        print(json.dumps(out))
        return
    print(f"{out['link']}: {spec.payload_bytes / MiB:.0f} MiB per transfer, "
          f"{a.rounds} rounds interleaved")
    print(f"  plain socket stream  GB/s {', '.join(f'{x:.2f}' for x in plain)}")
    print(f"  kvstream (tcp path)  GB/s {', '.join(f'{x:.2f}' for x in kv)}")
    print(f"  kvstream / plain     {out['ratio_of_medians']} (medians); per round "
          f"{out['ratios_per_round']}")
    if "plain_of_link" in out:
        print(f"  plain stream / link  {out['plain_of_link']} (below ~0.8: the CPU, not the "
              "link, bounds the transfer)")
    for c, xs in out.get("codec_speedup", {}).items():
        if c != "none":
            print(f"  {c} over verbatim, end to end: {xs}")


def msgspec_builtins(v: Any) -> dict[str, Any]:
    import msgspec

    return dict(msgspec.to_builtins(v))


if __name__ == "__main__":
    main()
