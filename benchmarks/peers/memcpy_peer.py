"""The limit: one thread copying kvstream bench's workload inside one process.

    python benchmarks/peers/memcpy_peer.py [--block-bytes 65536] [--blocks-per-layer 256]
        [--layers 32] [--contiguous]

Every variant runs on one thread, into memory touched before the clock starts:

* ``gather``: every layer's source chunks (scattered over a cache of twice the blocks)
  into one contiguous buffer of the whole payload, ``torch.index_select`` on int64 rows
  (what PERF.md calls the limit; a staged transfer's first copy).
* ``memmove``: every chunk from its source block straight to its destination block, one
  ``memmove`` (glibc, through ctypes) per chunk: one copy, scattered to scattered, what a
  same-host one-copy path must do at least.
* ``gather_scatter``: ``gather``, then each layer's chunks into their destination blocks
  (``index_copy_``): the two copies a staged transfer adds.
* ``contiguous``: one ``memmove`` of the whole payload between two contiguous buffers
  (glibc streams stores this large past the cache): the machine's one-thread copy
  bandwidth, a bound for any copy of these bytes.

The scattered results are verified. Runs in either venv (torch only). Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from workload import PLANES, Workload, add_workload_args, workload_from_args


def measure(w: Workload, repeat: int) -> dict[str, Any]:
    import ctypes

    import torch
    from _data import chunk_rows, make_layers, verify

    torch.set_num_threads(1)
    src_layers = make_layers(w, fill=True)
    src = [chunk_rows(t, w) for t in src_layers]
    dst_layers = make_layers(w, fill=False)
    dst = [chunk_rows(t, w) for t in dst_layers]
    row = w.chunk_bytes // 8
    out = torch.ones(w.layers, PLANES, w.blocks_per_layer, row, dtype=torch.int64)  # paged in
    out2 = torch.ones_like(out)
    src_idx = torch.tensor(w.src_ids, dtype=torch.int64)
    dst_idx = torch.tensor(w.dst_ids, dtype=torch.int64)
    # (destination, source) address of every chunk: the block tables an engine holds
    pairs = [(d.data_ptr() + w.chunk_index(0, p, b) * w.chunk_bytes,
              s.data_ptr() + w.chunk_index(0, p, a) * w.chunk_bytes)
             for d, s in zip(dst_layers, src_layers, strict=True) for p in range(PLANES)
             for a, b in zip(w.src_ids, w.dst_ids, strict=True)]
    memmove, chunk = ctypes.memmove, w.chunk_bytes

    def gather() -> None:
        for layer in range(w.layers):
            for p in range(PLANES):
                torch.index_select(src[layer][p], 0, src_idx, out=out[layer, p])

    def scatter() -> None:
        for layer in range(w.layers):
            for p in range(PLANES):
                dst[layer][p].index_copy_(0, dst_idx, out[layer, p])

    def chunks() -> None:
        for d, s in pairs:
            memmove(d, s, chunk)

    def contiguous() -> None:
        memmove(out2.data_ptr(), out.data_ptr(), w.payload_bytes)

    def timed(*steps: Any) -> float:
        t = time.perf_counter()
        for step in steps:
            step()
        return w.payload_bytes / (time.perf_counter() - t) / 1e9

    def zero() -> None:
        for t in dst_layers:
            t.zero_()

    variants = {"gather": (gather,), "memmove": (chunks,), "gather_scatter": (gather, scatter),
                "contiguous": (contiguous,)}
    result: dict[str, Any] = {"system": "memcpy", "threads": 1, "workload": w.describe(),
                              "payload_bytes": w.payload_bytes, "variants": {}}
    for name, steps in variants.items():
        for step in steps:  # warm-up
            step()
        runs = []
        ok = True
        for _ in range(repeat):
            zero()
            runs.append(timed(*steps))
            if name in ("memmove", "gather_scatter"):
                ok = ok and verify(dst_layers, w)
        result["variants"][name] = {"gbps": round(max(runs), 3),
                                    "runs_gbps": [round(x, 3) for x in runs], "verified": ok}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs (best kept)")
    args = ap.parse_args()
    w = workload_from_args(args)
    print(json.dumps(measure(w, args.repeat)), flush=True)


if __name__ == "__main__":
    main()
