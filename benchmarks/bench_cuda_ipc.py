"""The same-host one-copy path on a GPU: process A exports its KV over CUDA IPC, process B
copies scattered blocks out of it into its own KV, three ways:

  kernel        csrc/blockcopy.cu, one launch for every block (CudaBlockCopy, offsets
                uploaded each call, as the path does)
  memcpy_async  one cudaMemcpyAsync per block (device to device, issued from Python)
  torch_index   torch index_select into a staging tensor, then index_copy_ (two copies)

and, for scale, one contiguous device-to-device copy of the same bytes (no scatter).

    python benchmarks/bench_cuda_ipc.py                    # 512 MiB of 64 KiB blocks
    python benchmarks/bench_cuda_ipc.py --json --repeat 20 --block-kib 32

GB/s counts the bytes copied once. Needs a CUDA GPU and cupy (pip install 'kvstream[cu12]' or '[cu13]');
the CPU kernel has its own benchmark, benchmarks/bench_blockcopy.py.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np


def _gpu_missing() -> str | None:
    try:
        import cupy  # noqa: F401
        import torch
    except ImportError as exc:
        return f"needs torch and cupy (pip install 'kvstream[cu12]' or '[cu13]'): {exc}"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: none is visible (the CPU copy: benchmarks/bench_blockcopy.py)"
    return None


def _timed(fn: Callable[[], None], repeat: int, stream: Any) -> list[float]:
    import torch

    fn()  # warm: NVRTC, cupy's pool, the mapping's first touch
    torch.cuda.synchronize()
    out = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def _peer(wire: bytes, n_blocks: int, block: int, repeat: int, out: Any) -> None:
    """Process B: map A's KV, time the copies, verify the kernel's bytes."""
    try:
        out.put(("ok", _measure(wire, n_blocks, block, repeat)))
    except Exception as exc:  # reported by process A
        out.put(("error", repr(exc)))


def _measure(wire: bytes, n_blocks: int, block: int, repeat: int) -> dict[str, Any]:
    import cupy
    import msgspec
    import torch

    from kvstream import cuda_ipc
    from kvstream.dataplane import blockcopy

    h = msgspec.msgpack.decode(wire, type=cuda_ipc.IpcHandle)
    gen = np.random.default_rng(1)
    sids, dids = gen.permutation(n_blocks), gen.permutation(n_blocks)
    src_off, dst_off = blockcopy.layer_items(1, block, n_blocks, sids, n_blocks, dids)
    total = n_blocks * block
    with cuda_ipc.open_handle(h) as mapping:
        torch.cuda.set_device(mapping.device)
        stream = torch.cuda.current_stream()
        dst = torch.zeros(total, dtype=torch.uint8, device="cuda")
        mem = cupy.cuda.UnownedMemory(mapping.ptr, mapping.size, owner=None, device_id=mapping.device)
        peer = torch.as_tensor(cupy.ndarray((mapping.size,), dtype=cupy.uint8,
                                            memptr=cupy.cuda.MemoryPointer(mem, 0)), device="cuda")
        elem = torch.int64 if block % 8 == 0 else torch.uint8
        rows_src, rows_dst = peer.view(elem).view(n_blocks, -1), dst.view(elem).view(n_blocks, -1)
        staging = torch.empty_like(rows_dst)
        s_idx = torch.from_numpy(sids).cuda()
        d_idx = torch.from_numpy(dids).cuda()
        bc = blockcopy.CudaBlockCopy()

        def kernel() -> None:
            bc.copy(dst.data_ptr(), dst.nbytes, dst_off, mapping.ptr, mapping.size, src_off, block,
                    stream=stream, wait=False)

        d_ptrs = (dst.data_ptr() + dst_off).tolist()
        s_ptrs = (mapping.ptr + src_off).tolist()
        memcpy_async, d2d, handle = cupy.cuda.runtime.memcpyAsync, 3, stream.cuda_stream

        def per_item() -> None:
            for d, s in zip(d_ptrs, s_ptrs, strict=True):
                memcpy_async(d, s, block, d2d, handle)

        def torch_index() -> None:
            torch.index_select(rows_src, 0, s_idx, out=staging)
            rows_dst.index_copy_(0, d_idx, staging)

        def contiguous() -> None:
            dst.copy_(peer[:total])

        results = {}
        for name, fn in (("kernel", kernel), ("memcpy_async", per_item), ("torch_index", torch_index),
                         ("contiguous", contiguous)):
            times = _timed(fn, repeat, stream)
            results[name] = {"best_gbps": total / min(times) / 1e9,
                             "median_gbps": total / statistics.median(times) / 1e9,
                             "median_ms": statistics.median(times) * 1e3}
        dst.zero_()
        kernel()
        stream.synchronize()
        want = torch.empty_like(rows_dst)
        want.index_copy_(0, d_idx, torch.index_select(rows_src, 0, s_idx))
        if not torch.equal(rows_dst, want):
            raise AssertionError("the kernel's copy differs from torch's")
        props = torch.cuda.get_device_properties(mapping.device)
        torch.cuda.synchronize()  # nothing reads the mapping once it is closed
    base = results["kernel"]["median_gbps"]
    for r in results.values():
        r["kernel_over_this"] = base / r["median_gbps"]
    return {"device": props.name, "blocks": n_blocks, "block_bytes": block, "total_bytes": total,
            "repeat": repeat, "handle_offset": h.offset, "methods": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=512)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    missing = _gpu_missing()
    if missing:
        print(f"bench_cuda_ipc: {missing}", file=sys.stderr)
        return 2
    import msgspec
    import torch

    from kvstream import cuda_ipc

    block = args.block_kib * 1024
    n_blocks = args.total_mib * 2 ** 20 // block
    # Process A: the source KV, filled, exported, alive until B is done.
    src = torch.randint(0, 256, (n_blocks * block,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    wire = msgspec.msgpack.encode(cuda_ipc.export_tensor(src))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_peer, args=(wire, n_blocks, block, args.repeat, out))
    proc.start()
    status, result = out.get(timeout=600)
    proc.join(timeout=60)
    if status != "ok":
        print(f"bench_cuda_ipc: process B failed: {result}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['device']}: {n_blocks} scattered blocks of {args.block_kib} KiB "
          f"({args.total_mib} MiB) over CUDA IPC, median of {args.repeat}")
    for name, r in result["methods"].items():
        print(f"  {name:13s} {r['median_gbps']:8.1f} GB/s (best {r['best_gbps']:.1f}, "
              f"{r['median_ms']:.2f} ms)  kernel x{r['kernel_over_this']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
