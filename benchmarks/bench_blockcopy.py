"""The CPU batched block copy (csrc/blockcopy.c) against one contiguous copy of the same bytes
and against torch's two copies (index_select into staging, index_copy_ out of it), all on one
thread; and the kernel's strategies against each other (what picked KVS_AUTO).

    python benchmarks/bench_blockcopy.py                        # 16,384 x 32 KiB scattered
    python benchmarks/bench_blockcopy.py --sweep --json         # strategies by batch size
    python benchmarks/bench_blockcopy.py --items 8192 --item-kib 64 --repeat 9

Items are scattered: a random permutation of the source's blocks into a random permutation of
the destination's. GB/s counts the bytes copied once (n * item), for every method.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from kvstream.dataplane import blockcopy

STRATEGIES = ("auto", "memcpy", "stream")


def _time(fn: Callable[[], None], repeat: int) -> list[float]:
    fn()  # warm: page faults, the library build, torch's first call
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run(items: int, item_bytes: int, repeat: int, methods: tuple[str, ...], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    src = torch.from_numpy(rng.integers(0, 256, items * item_bytes, dtype=np.uint8))
    dst = torch.zeros_like(src)
    dst.fill_(1)  # touch every page before timing
    sids, dids = rng.permutation(items), rng.permutation(items)
    src_off, dst_off = blockcopy.layer_items(1, item_bytes, items, sids, items, dids)
    total = items * item_bytes

    def kernel(strategy: str) -> Callable[[], None]:
        return lambda: blockcopy.copy_blocks(dst.data_ptr(), dst.nbytes, dst_off, src.data_ptr(),
                                             src.nbytes, src_off, item_bytes, strategy=strategy)

    flat_dst, flat_src = dst.numpy(), src.numpy()
    elem = torch.int64 if item_bytes % 8 == 0 else torch.uint8
    rows_src = src.view(elem).view(items, -1)
    rows_dst = dst.view(elem).view(items, -1)
    staging = torch.empty_like(rows_src)
    s_idx, d_idx = torch.from_numpy(sids), torch.from_numpy(dids)

    def torch_two_copies() -> None:
        torch.index_select(rows_src, 0, s_idx, out=staging)
        rows_dst.index_copy_(0, d_idx, staging)

    fns: dict[str, Callable[[], None]] = {
        "contiguous": lambda: np.copyto(flat_dst, flat_src),
        "torch_index": torch_two_copies,
        **{f"kernel_{s}": kernel(s) for s in STRATEGIES},
        "python_memmove": kernel("python"),
    }
    results: dict[str, dict[str, float]] = {}
    for name in methods:
        times = _time(fns[name], repeat)
        results[name] = {"best_gbps": total / min(times) / 1e9,
                         "median_gbps": total / statistics.median(times) / 1e9}
    if "kernel_auto" in methods:  # the check the numbers are worth reading
        ref = torch.empty_like(rows_dst).copy_(rows_dst)
        ref.index_copy_(0, d_idx, torch.index_select(rows_src, 0, s_idx))
        rows_dst.zero_()
        kernel("auto")()
        assert torch.equal(rows_dst, ref), "kernel_auto differs from the torch reference"
    return {"items": items, "item_bytes": item_bytes, "total_bytes": total, "repeat": repeat,
            "methods": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=16384)
    ap.add_argument("--item-kib", type=float, default=32)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--sweep", action="store_true",
                    help="the kernel's strategies at 1 MiB to 1 GiB batches of 32 KiB items")
    ap.add_argument("--python", action="store_true", help="also the ctypes.memmove fallback")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    lib = blockcopy.load()
    info = {"library": str(lib.path) if lib else None, "vector_bytes": lib.vector_bytes if lib else 0,
            "stream_threshold": lib.stream_threshold if lib else 0}
    item_bytes = int(args.item_kib * 1024)
    runs = []
    if args.sweep:
        for mib in (1, 4, 16, 64, 256, 512, 1024):
            n = mib * 2 ** 20 // item_bytes
            runs.append(run(n, item_bytes, args.repeat, tuple(f"kernel_{s}" for s in STRATEGIES)))
    else:
        methods = ("contiguous", "torch_index", *(f"kernel_{s}" for s in STRATEGIES))
        runs.append(run(args.items, item_bytes, args.repeat,
                        (*methods, "python_memmove") if args.python else methods))
    if args.json:
        print(json.dumps({**info, "runs": runs}, indent=2))
        return 0
    print(f"library {info['library']} (streaming stores {info['vector_bytes']} B, "
          f"AUTO streams from {info['stream_threshold'] / 2 ** 20:.0f} MiB)")
    for r in runs:
        print(f"\n{r['items']} items x {r['item_bytes'] / 1024:g} KiB = {r['total_bytes'] / 2 ** 20:.0f} MiB"
              f", best / median of {r['repeat']}, GB/s:")
        base = r["methods"].get("torch_index", {}).get("best_gbps")
        for name, m in r["methods"].items():
            ratio = f"  x{m['best_gbps'] / base:.2f} torch" if base else ""
            print(f"  {name:16s} {m['best_gbps']:7.2f} / {m['median_gbps']:7.2f}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
