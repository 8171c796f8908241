"""The GPU benchmarks of the GPU check (``benchmarks/gpu/check.sh``), each bounded in time:

  codec       the 8-bit codecs' CUDA kernels against the torch path on the same layer
              (encode = gather + quantize, decode = dequantize + scatter), GB/s of KV
  busy_move   a pull of scattered device blocks between two agents over UCX while the
              default stream is kept busy by matrix products, verified byte for byte
              (the fence before UCX is what keeps it right), MB/s and ms per transfer

    python benchmarks/gpu/bench_gpu.py --out bench.json [--seconds 90]

Prints one JSON object (also written to --out). Each part reports "skipped" with the
reason where CUDA, cupy or a GPU is missing, so the check's summary always has a line.
The CUDA IPC copy has its own benchmark (``benchmarks/bench_cuda_ipc.py``), which the
check runs beside this one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from typing import Any


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 2)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def codec(deadline: float, device: str = "cuda", small: bool = False) -> dict[str, Any]:
    import torch

    from kvstream.layout import KVLayout
    from kvstream.memory import RegisteredKV
    from kvstream.quant.codec import LayerCodec
    from kvstream.quant.scheme import wire_layer_bytes

    lay = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16",
                   arrangement="hnd_kv")
    blocks = 64 if small else 4096
    kv = [torch.randn(lay.tensor_shape(blocks), device=device).half()]
    mem = RegisteredKV(lay, kv)
    ids = mem.block_map(torch.randperm(blocks)[:blocks // 2].tolist())
    nbytes = len(ids) * lay.block_bytes
    out: dict[str, Any] = {"kv_bytes": nbytes}
    for name in ("fp8_e4m3", "int8"):
        buf = torch.empty(wire_layer_bytes(lay, name, len(ids)), dtype=torch.uint8, device=device)
        for backend in (device, "torch"):
            if time.monotonic() > deadline:
                out[f"{name}/{backend}"] = "skipped: out of time"
                continue
            try:
                c = LayerCodec(mem, name, backend=backend)
                enc, dec = [], []
                for _ in range(2 if small else 10):
                    _sync(device)
                    t0 = time.perf_counter()
                    c.encode(0, ids, buf)
                    _sync(device)
                    t1 = time.perf_counter()
                    c.decode(0, ids, buf)
                    _sync(device)
                    enc.append(t1 - t0)
                    dec.append(time.perf_counter() - t1)
                out[f"{name}/{backend}"] = {"encode_gbps": _gbps(nbytes, enc),
                                            "decode_gbps": _gbps(nbytes, dec)}
            except Exception as exc:  # a missing kernel is a finding, not a crash
                out[f"{name}/{backend}"] = f"failed: {type(exc).__name__}: {exc}"[:300]
    return out


def busy_move(deadline: float, device: str = "cuda", small: bool = False) -> dict[str, Any]:
    import anyio
    import torch

    from kvstream import Agent, AgentConfig, EmbeddedNats
    from kvstream.layout import KVLayout

    layers, blocks, moved = (4, 32, 8) if small else (32, 256, 64)
    lay = KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, block_size=16,
                   dtype="float16", arrangement="hnd_kv")
    src = [torch.randn(lay.tensor_shape(blocks), device=device).half() for _ in range(layers)]
    dst = [torch.zeros(lay.tensor_shape(blocks), device=device).half() for _ in range(layers)]
    _sync(device)
    stop = threading.Event()

    def busy() -> None:
        if device != "cuda":
            return
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        while not stop.is_set():
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.current_stream().synchronize()

    result: dict[str, Any] = {}

    async def main() -> None:
        with EmbeddedNats() as nats:
            cfg = {"nats_url": nats.url, "heartbeat_s": 0.25, "peer_timeout_s": 2.0}
            async with Agent(AgentConfig(instance_id="bp", **cfg), layout=lay,
                             kv_caches=src) as p, \
                    Agent(AgentConfig(instance_id="bd", **cfg), layout=lay,
                          kv_caches=dst) as d:
                times, wrong, n = [], 0, 0
                while time.monotonic() < deadline and n < (2 if small else 20):
                    sb = torch.randperm(blocks)[:moved].tolist()
                    db = torch.randperm(blocks)[:moved].tolist()
                    offer = p.offer(f"r{n}", sb)
                    offer.all_ready()
                    t0 = time.perf_counter()
                    rx = await d.pull(f"r{n}", "bp", db, secret=offer.secret)
                    with anyio.fail_after(60):
                        res = await rx.result()
                    times.append(time.perf_counter() - t0)
                    _sync(device)
                    wrong += sum(not torch.equal(p.memory.read_block(layer, a),
                                                 d.memory.read_block(layer, b))
                                 for layer in range(0, layers, 7) for a, b in zip(sb, db, strict=True))
                    n += 1
                    if not res.ok:
                        result["failed"] = res.reason
                        break
                nbytes = moved * lay.block_bytes * lay.num_layers
                result.update({"transfers": n, "wrong_blocks": wrong,
                               "bytes_per_transfer": nbytes,
                               "ms_p50": round(statistics.median(times) * 1e3, 2) if times
                               else None,
                               "mbps": round(nbytes / statistics.median(times) / 1e6, 1)
                               if times else None})

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        anyio.run(main)
    finally:
        stop.set()
        thread.join(30)
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every part small on the CPU (the script itself is checked)")
    args = ap.parse_args()
    start = time.monotonic()
    report: dict[str, Any] = {}
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    for name, part, share in (("codec", codec, 0.3), ("busy_move", busy_move, 1.0)):
        if not gpu and not args.cpu_smoke:
            report[name] = "skipped: no CUDA device"
            continue
        deadline = start + args.seconds * share
        try:
            report[name] = part(deadline, "cuda" if gpu and not args.cpu_smoke else "cpu",
                                args.cpu_smoke)
        except Exception as exc:
            report[name] = f"failed: {type(exc).__name__}: {exc}"[:500]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    # On the GPU a failed part is a finding for the summary; the CPU smoke run checks the
    # script itself, so there it fails the run.
    failed = any(isinstance(v, str) and v.startswith("failed") for v in report.values())
    return 1 if args.cpu_smoke and failed else 0


if __name__ == "__main__":
    sys.exit(main())
